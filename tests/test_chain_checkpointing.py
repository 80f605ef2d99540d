"""A chain of blocks without a residual, each ending in a Linear, checkpointed block by block (torchtitan's AC):
storages a checkpoint holds that something else holds too, counted once. The first block is given the batch as it
is, which the step holds all along (``Trace.inputs_nbytes``): its checkpoint keeps no second copy (+4.9% under full
AC on 8 fake ranks before). Under op-level SAC each block's output is its last Linear's, which SAC's cache keeps
until the block's backward: the same storage the next block's checkpoint keeps as its input and the head saves
(``Event.made_at``; +12.0% before, 150 MiB predicted for 134)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy
from fsdp_planner.runtime.fake_world import run_fake_world
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.sim.tensor_parallel import tp_view
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind, OpClass


class Chain(nn.Module):
    """Blocks that end in a Linear, no residual around them, and a head."""

    def __init__(self, d: int = 128, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def chain() -> tuple:
    return Chain(), (torch.randn(32, 64, 128),)


SPEC = f"{__file__}:chain"


def _trace(reuse: bool = True):
    lm = load_model(SPEC)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=SimOptions().precision.trace_dtype,
                  reuse=reuse)


@pytest.mark.parametrize("checkpointing", [None, ACMode.FULL, ACMode.OP])
def test_a_chain_checkpointed_block_by_block_is_predicted_exactly(checkpointing) -> None:
    """The peak is in the last block's backward: the blocks' kept inputs, the first of them the batch's bf16 copy
    (counted twice under both modes before), the others the cached outputs of the blocks before (twice under
    op-level before)."""
    options = SimOptions()
    tr = _trace()
    plan = make_policy(PolicyRequest(PolicyName.TITAN, checkpointing=checkpointing)).plan(tr, SPEC)
    predicted = simulate(tr, plan, parse_cluster("h100:8"), options, timeline=False)
    measured = run_fake_world(SPEC, plan, 8, options.precision, optimizer=options.optimizer)
    assert predicted.peak_memory == pytest.approx(measured.peak_memory, rel=0.002)


def test_a_blocks_kept_input_names_the_op_that_made_it() -> None:
    """``Event.made_at``: each block after the first keeps the storage the last Linear of the block before made
    (its addmm, which torchtitan's policy keeps), and the head saves the last block's; the same replayed from a
    template as traced (``trace/reuse.py``). The first block keeps nothing of its own: it is given the batch."""
    tr = _trace()
    assert [tuple(e) for e in tr.events] == [tuple(e) for e in _trace(reuse=False).events]
    pres = {e.module: (i, e) for i, e in enumerate(tr.events) if e.kind is EventKind.FWD_PRE}
    assert pres["blocks.0"][1].kept_inputs == 0 and not pres["blocks.0"][1].made_at
    for k in range(1, 4):
        (maker, nbytes), = pres[f"blocks.{k}"][1].made_at
        assert tr.events[maker].module == f"blocks.{k - 1}.2" and tr.events[maker].op_class is OpClass.COMPUTE_MORE
        assert nbytes == pres[f"blocks.{k}"][1].kept_inputs == 32 * 64 * 128 * 2
    head = pres["head"][0]
    saves = [e for e in tr.events[head:] if e.is_op and not e.backward and e.made_at]
    assert [tr.events[m].module for e in saves for m, _ in e.made_at] == ["blocks.3.2"]


def test_a_tp_view_names_the_makers_where_they_went() -> None:
    """One TP rank's view (``sim/tensor_parallel.py``) puts its collectives in: ``Event.made_at`` names each maker at
    its position there, the bytes at the rank's share; a rowwise Linear's output is all-reduced, another storage than
    its matmul's, so the next block's kept input names no maker there."""
    tr = _trace()
    layout = TensorParallel(2, {"blocks.*.0": TPStyle.COLWISE, "blocks.*.2": TPStyle.ROWWISE})
    view = tp_view(tr, layout, parse_cluster("h100:8")).trace
    pres = {e.module: e for e in view.events if e.kind is EventKind.FWD_PRE}
    for k in range(4):
        (maker, nbytes), = pres[f"blocks.{k}.1"].made_at  # the GELU's input: the colwise Linear's own output
        assert view.events[maker].module == f"blocks.{k}.0" and view.events[maker].op_class is OpClass.COMPUTE_MORE
        assert nbytes == pres[f"blocks.{k}.1"].kept_inputs == 32 * 64 * 512 * 2 // 2
    assert all(not pres[f"blocks.{k}"].made_at for k in range(1, 4))
