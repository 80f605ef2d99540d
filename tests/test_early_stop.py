"""Checkpoint early stop: non-reentrant ``torch.utils.checkpoint`` stops its recomputation once every tensor the
forward packed for backward is back, so the ops after the last pack (a Llama block's last matmul, whose saves are
its inputs, and residual add) are not run again. The model's recomputation against the ops torch really re-runs."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from conftest import traced
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_planner.choices import SacPolicy
from fsdp_planner.fsdp2.checkpointing import apply_checkpointing
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.recompute import checkpointed_calls
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind, OpClass
from fsdp_planner.trace.ops import op_class

BLOCK = "layers.1"
_DETACH = torch.ops.aten.detach.default  # what checkpoint's own saved-tensor hooks run, not the model


class _Ops(TorchDispatchMode):
    """Counts the ops it sees by class while ``on`` (checkpoint's detaches left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.seen = True, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.on and func is not _DETACH:
            self.seen[op_class(func)] += 1
        return func(*args, **(kwargs or {}))


def _real(policy: SacPolicy | None, checkpointed: bool, early_stop: bool | None = None,
          applied_early_stop: bool = True) -> tuple[Counter, Counter]:
    """A real toy-llama on the CPU, ``BLOCK`` checkpointed (full or op-level) or not: the ops of that block's
    forward, and every op its backward runs (its own and any recomputed). ``early_stop``: torch's global setting
    (``set_checkpoint_early_stop``, over any checkpoint's own; None: not set);
    ``applied_early_stop``: what ``apply_checkpointing`` passes (a plan's ``checkpoint_early_stop``)."""
    lm = load_model("toy-llama", meta=False)
    if checkpointed:
        apply_checkpointing(lm.model, [] if policy else [BLOCK], {BLOCK: policy} if policy else None,
                            early_stop=applied_early_stop)
    block = lm.model.get_submodule(BLOCK)
    setting = contextlib.nullcontext() if early_stop is None else \
        torch.utils.checkpoint.set_checkpoint_early_stop(early_stop)
    with setting:  # read by checkpoint in forward
        with _Ops() as forward:
            forward.on = False
            block.register_forward_pre_hook(lambda *_: setattr(forward, "on", True))
            block.register_forward_hook(lambda *_: setattr(forward, "on", False))
            loss = lm.model(*lm.example_inputs).float().pow(2).mean()
        with _Ops() as backward:
            loss.backward()
    return forward.seen, backward.seen


@pytest.mark.integration  # real toy-llama steps on the CPU (1-2 s): the full suite runs it
@pytest.mark.parametrize("policy", [None, SacPolicy.TITAN], ids=["full", "op"])
def test_recomputation_stops_where_torch_stops(policy):
    """The ops torch re-runs (backward's ops with the checkpoint less those without) are, class by class, the
    forward's less the ones the model says are not re-run (kept by SAC, or after the early stop): the same count
    of each class left out. The trace counts some OTHER ops torch does not see (its hooks' views), all before the
    stop, so the comparison is of what is left out. Without early stop torch re-runs all of the block's forward."""
    forward, plain = _real(policy, checkpointed=False)
    _, with_checkpoint = _real(policy, checkpointed=True)
    real_left_out = forward - (with_checkpoint - plain)

    tr = traced("toy-llama")
    (call,) = checkpointed_calls(tr, [(BLOCK, policy)])
    ops = [i for i in range(call.fwd_pre, call.fwd_post) if tr.events[i].kind is EventKind.OP]
    recomputed = set(call.recomputed(tr))
    planned_left_out = Counter(tr.events[i].op_class for i in ops if i not in recomputed)
    assert planned_left_out == real_left_out
    assert call.end < call.fwd_post  # something is left out by the early stop: the last mm (full), the add
    skipped = [tr.events[i].op_class for i in ops if i >= call.end]
    assert skipped.count(OpClass.MM) == 1  # w2's (op-level SAC keeps its output anyway)

    if policy is None:
        _, no_stop = _real(policy, checkpointed=True, early_stop=False)
        assert (no_stop - plain) == forward


@pytest.mark.integration  # real toy-llama steps on the CPU (1-2 s): the full suite runs it
@pytest.mark.parametrize("policy", [None, SacPolicy.TITAN], ids=["full", "op"])
def test_without_early_stop_the_recomputation_runs_the_whole_forward(policy):
    """A plan checkpointing without early stop (torchtitan's wrapper, ``--no-early-stop``): apply passes it to
    torch, which re-runs every op of the block's forward but SAC's kept ones; the model's recomputation is the
    same, class by class, and its time the forward's less the kept ops', more than with early stop."""
    forward, plain = _real(policy, checkpointed=False)
    _, whole = _real(policy, checkpointed=True, applied_early_stop=False)
    real_left_out = forward - (whole - plain)

    tr = traced("toy-llama")
    (call,) = checkpointed_calls(tr, [(BLOCK, policy, True)])
    ops = [i for i in range(call.fwd_pre, call.fwd_post) if tr.events[i].kind is EventKind.OP]
    recomputed = set(call.recomputed(tr))
    assert Counter(tr.events[i].op_class for i in ops if i not in recomputed) == real_left_out
    assert call.end == call.fwd_post and (policy is not None or not real_left_out)
    ctx = SimContext(tr, parse_cluster("h100:8"), SimOptions())
    ((at, r),) = ctx.recompute([(BLOCK, policy, True)]).items()
    ((stopped_at, stopped),) = ctx.recompute([(BLOCK, policy)]).items()
    assert at == stopped_at  # where backward first unpacks, early stop or not
    assert r.seconds == pytest.approx(sum(ctx.times[i] for i in call.recomputed(tr))) and r.seconds > stopped.seconds


def test_recompute_time_is_the_ops_before_the_stop():
    """A fully checkpointed block's recomputation costs the op time up to the stop, less than its forward's; it
    runs where backward first unpacks, after the pre-backward of the MLP (whose output only the residual add
    reads, the op after the last pack), before any of the block's backward ops."""
    tr = traced("toy-llama")
    ctx = SimContext(tr, parse_cluster("h100:8"), SimOptions())
    (call,) = checkpointed_calls(tr, [(BLOCK, None)])
    ((at, r),) = ctx.recompute([(BLOCK, None)]).items()
    assert (tr.events[at].kind, tr.events[at].module) == (EventKind.BWD_PRE, f"{BLOCK}.feed_forward")
    assert call.bwd_pre < at and not any(e.is_op for e in tr.events[call.bwd_pre:at])
    assert r.seconds == pytest.approx(sum(ctx.times[i] for i in call.recomputed(tr)))
    assert r.ops == len(call.recomputed(tr))
    assert 0 < r.seconds < ctx.cum[call.fwd_post] - ctx.cum[call.fwd_pre]


def test_packs_are_the_same_with_and_without_reuse():
    """A block replayed from its first call's template marks the same packs as one traced op by op."""
    lm = load_model("toy-llama")
    fresh = record(lm.model, lm.example_inputs, lm.loss_fn, reuse=False)
    reused = record(lm.model, lm.example_inputs, lm.loss_fn, reuse=True)
    assert [e.packs for e in fresh.events] == [e.packs for e in reused.events]
