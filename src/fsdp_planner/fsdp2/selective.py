"""Op-level selective activation checkpointing (SAC), as torchtitan applies it to each transformer block.

A block under op-level SAC is checkpointed (non-reentrant ``torch.utils.checkpoint``, inputs kept) with
``context_fn=create_selective_checkpoint_contexts(policy)``: the policy is asked about every aten op of the block's
forward; an op it marks MUST_SAVE has its outputs kept in SAC's cache from the forward until the recomputation in
backward takes them; every other op (PREFER_RECOMPUTE) runs again in the recomputation. A policy here is a set of
op classes (``trace.events.OpClass``) to save, and the classes counted per block call of which every second one
is recomputed instead, as torchtitan's policy counts ``aten.mm``.

The two policies, modelled on torchtitan (read, not copied):

* ``titan``: ``_op_sac_save_list`` of ``torchtitan/models/llama3/infra/parallelize.py`` at commit 018740b7 (2025):
  ``aten.mm``; SDPA's efficient, flash, cuDNN, math and fused-overrideable kernels;
  ``_c10d_functional.reduce_scatter_tensor``; ``aten.max``; with the rule of ``torchtitan/distributed/
  activation_checkpoint.py`` of that time: the mm calls of one block call are counted and the even-numbered ones
  (2nd, 4th, ...) recomputed. (Its list also names flex attention, varlen attention and inductor's compiled code,
  which no built-in model runs: not modelled. torchtitan's later versions choose saved tensors by name instead.)
* ``titan-early``: the first list (``parallelize_llama.py``, 2024): ``aten.mm`` (every second recomputed), SDPA's
  efficient and flash kernels, ``reduce_scatter_tensor``, ``aten.max``.

On the built-in models both make the same choices (they run flash or memory-efficient attention); they differ on a
model whose attention is cuDNN's or the math kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fsdp_planner.choices import SacPolicy
from fsdp_planner.trace.events import OpClass
from fsdp_planner.trace.ops import op_class


@dataclass(frozen=True)
class SavePolicy:
    """The op classes whose outputs are kept, and those counted per block call (the even-numbered recomputed)."""

    saves: frozenset[OpClass]
    every_second: frozenset[OpClass]


_FIRST = frozenset({OpClass.MM, OpClass.SDPA, OpClass.REDUCE_SCATTER, OpClass.MAX})
POLICIES: dict[SacPolicy, SavePolicy] = {
    SacPolicy.TITAN: SavePolicy(_FIRST | {OpClass.SDPA_MORE}, frozenset({OpClass.MM})),
    SacPolicy.TITAN_EARLY: SavePolicy(_FIRST, frozenset({OpClass.MM})),
}


class Decider:
    """One block call's decisions, op by op in forward order (the count of mm calls is per call, as torchtitan's
    ``meta`` dict is made per call by its ``context_fn``)."""

    def __init__(self, policy: SacPolicy) -> None:
        self.policy = POLICIES[policy]
        self.counted = 0

    def saves(self, cls: OpClass) -> bool:
        if cls in self.policy.every_second:
            self.counted += 1
            if self.counted % 2 == 0:
                return False
        return cls in self.policy.saves


def saved_flags(policy: SacPolicy, classes: Iterable[OpClass]) -> list[bool]:
    """Per forward op of one block call (in order), whether ``policy`` keeps its outputs."""
    decider = Decider(policy)
    return [decider.saves(c) for c in classes]


def sac_context_fn(policy: SacPolicy, log: Callable[[Any, bool], None] | None = None) -> Callable[[], Any]:
    """The ``context_fn`` that ``torch.utils.checkpoint`` runs ``policy`` with: a fresh count per block call.
    ``log(func, saved)``: told of each forward decision (tests compare them with the trace's)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def context_fn() -> Any:
        # one decider per pass: torch 2.13 asks the policy in forward only and replays its answers in the
        # recomputation; an older torch asks again there (``ctx.is_recompute``), and must get the same answers
        deciders = {False: Decider(policy), True: Decider(policy)}

        def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            saved = deciders[bool(ctx.is_recompute)].saves(op_class(func))
            if log is not None and not ctx.is_recompute:
                log(func, saved)
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)

    return context_fn
