"""The gradients alive in backward (``Event.grad_live``, ``trace/step.Gradients``): a tied weight's contributions
are the param's grad, which the FSDP2 replay counts once (the rest, alive beside it while autograd sums them,
are ``grad_live``); a loss computed inside the model frees what it saved before the blocks' backward."""

from __future__ import annotations

from pathlib import Path

from fsdp_planner.models import load_model
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind

TIED = f"{Path(__file__).parent / 'fixtures' / 'scan_models.py'}:tied_lm"


def _trace():
    lm = load_model(TIED)
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def _at(tr, kind: EventKind, module: str) -> int:
    return next(i for i, e in enumerate(tr.events) if e.kind is kind and e.module == module)


def test_a_tied_weight_s_first_contribution_is_no_gradient_of_an_activation() -> None:
    """The head's contribution to the tied weight's grad (vocab x dim, fp32: 256 KiB) waits in autograd's input
    buffer until the embedding's arrives; it is that param's grad, counted by the replay from the head's backward,
    so no backward op between the two counts it (each holds a few KiB of activation gradients)."""
    tr = _trace()
    weight = 2048 * 32 * 4
    between = range(_at(tr, EventKind.BWD_POST, "head"), _at(tr, EventKind.BWD_PRE, "embed"))
    live = [tr.events[i].grad_live for i in between if tr.events[i].is_op and tr.events[i].backward]
    assert live and max(live) < weight // 8
    assert tr.index.first_backward_use[tr.index.param_index["embed.weight"]] < between.start  # the head reads it
    embed = range(_at(tr, EventKind.BWD_PRE, "embed"), _at(tr, EventKind.BWD_POST, "embed"))
    # where autograd sums them: the embedding's contribution and the sum, beside the head's (the param grad), and
    # what else is alive all backward (the loss's scalar gradient)
    assert 2 * weight <= max(tr.events[i].grad_live for i in embed) < 2 * weight + weight // 64


def test_a_loss_inside_the_model_frees_what_it_saved_before_the_blocks_backward() -> None:
    """The root call's own ops after its last child (a loss inside the model's forward) have their autograd nodes
    run first in backward: their saved tensors (the fp32 log-softmax, 2 x 8 x 1024 x 4 bytes) are gone before
    any child's backward starts, not held until the root call's backward is done (BART +6% under per-block
    checkpointing): ``Event.freed`` frees them at the op whose node releases them (``recompute.early_frees``)."""
    from fsdp_planner.sim.memory import activation_levels
    from fsdp_planner.sim.options import SimOptions

    lm = load_model(f"{Path(__file__).parent / 'fixtures' / 'scan_models.py'}:loss_inside")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    levels = activation_levels(tr, SimOptions.named("fp32").precision)
    first_child = next(i for i, e in enumerate(tr.events) if e.kind is EventKind.BWD_PRE and e.module)
    backward = next(i for i, e in enumerate(tr.events) if e.backward)
    assert levels[backward] - levels[first_child] >= 2 * 8 * 1024 * 4  # freed where autograd releases it
