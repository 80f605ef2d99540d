"""Op-level selective activation checkpointing (SAC), as torchtitan applies it to each transformer block.

A block under op-level SAC is checkpointed (non-reentrant ``torch.utils.checkpoint``, inputs kept) with
``context_fn=create_selective_checkpoint_contexts(policy)``: the policy is asked about every aten op of the block's
forward; an op it marks MUST_SAVE has its outputs kept in SAC's cache from the forward until the recomputation in
backward takes them; every other op (PREFER_RECOMPUTE) runs again in the recomputation. A policy here is a set of
op classes (``trace.events.OpClass``) to save, and the classes counted per block call of which every second one
is recomputed instead, as torchtitan's policy counts ``aten.mm``.

The three policies, modelled on torchtitan (read, not copied):

* ``titan``: ``SelectiveAC`` of ``torchtitan/distributed/activation_checkpoint.py`` at b5bcd76 (2026; one list for
  every model since #2357): AOTAutograd's compute-intensive ops (``get_default_op_list``: ``aten.mm``, ``addmm``,
  ``bmm``, ``_scaled_mm`` where a model calls it (torchao's Float8Linear shows SAC an ``aten.mm``), convolution,
  the flash and efficient SDPA kernels), the other SDPA kernels, ``aten.max``,
  ``aten.topk`` (a router's choice: a recomputation could choose other experts), ``reduce_scatter_tensor`` and
  ``all_to_all_single`` (EP's dispatch and combine are not sent again); of them only the ``aten.mm`` calls of one
  block call are counted, the even-numbered recomputed; and an mm whose weight has the shape of a Linear named
  ``moe.router.gate`` (its config's default ``force_recompute_mm_shapes_by_fqns``) is recomputed, uncounted: here
  an mm of a router gate's shape (``OpClass.ROUTER_MM``: torchtitan's name, or transformers' ``mlp.gate`` of the MoE
  models its jobs are simulated on; ``trace/ops.router_shapes``).
  (It also saves a device-to-host ``_to_copy``, the MoE token counts' sync, which the trace has no device to
  make; flex, varlen attention and inductor's compiled code, which no built-in model runs: not modelled.)
* ``titan-2025``: ``_op_sac_save_list`` of ``torchtitan/models/llama3/infra/parallelize.py`` at 018740b7:
  ``aten.mm`` (every second recomputed); SDPA's efficient, flash, cuDNN, math and fused-overrideable kernels;
  ``reduce_scatter_tensor``; ``aten.max``.
* ``titan-early``: the first list (``parallelize_llama.py``, 2024): ``aten.mm`` (every second recomputed), SDPA's
  efficient and flash kernels, ``reduce_scatter_tensor``, ``aten.max``.

On a Llama block without biases the three make the same choices; a Linear with a bias (``addmm``), ``bmm``
experts, a router and EP's all-to-alls are saved by ``titan`` alone (torchtitan's MoE models of 2025 saved their
all-to-alls too, #1672; their llama3 list, modelled here, had none to save).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fsdp_planner.choices import SacPolicy
from fsdp_planner.trace.events import OpClass
from fsdp_planner.trace.ops import forward_class


@dataclass(frozen=True)
class SavePolicy:
    """The op classes whose outputs are kept, those counted per block call (the even-numbered recomputed), and
    whether a router gate's mm is recomputed uncounted (else it is an mm like any other)."""

    saves: frozenset[OpClass]
    every_second: frozenset[OpClass]
    recompute_router: bool = False


_FIRST = frozenset({OpClass.MM, OpClass.SDPA, OpClass.REDUCE_SCATTER, OpClass.MAX})
_2025 = _FIRST | {OpClass.SDPA_MORE}
POLICIES: dict[SacPolicy, SavePolicy] = {
    SacPolicy.TITAN: SavePolicy(_2025 | {OpClass.COMPUTE_MORE, OpClass.TOPK, OpClass.ALL_TO_ALL},
                                frozenset({OpClass.MM}), recompute_router=True),
    SacPolicy.TITAN_2025: SavePolicy(_2025, frozenset({OpClass.MM})),
    SacPolicy.TITAN_EARLY: SavePolicy(_FIRST, frozenset({OpClass.MM})),
}


class Decider:
    """One block call's decisions, op by op in forward order (the count of mm calls is per call, as torchtitan's
    ``meta`` dict is made per call by its ``context_fn``)."""

    def __init__(self, policy: SacPolicy) -> None:
        self.policy = POLICIES[policy]
        self.counted = 0

    def saves(self, cls: OpClass) -> bool:
        if cls is OpClass.ROUTER_MM:
            if self.policy.recompute_router:
                return False
            cls = OpClass.MM
        if cls in self.policy.every_second:
            self.counted += 1
            if self.counted % 2 == 0:
                return False
        return cls in self.policy.saves


def saved_flags(policy: SacPolicy, classes: Iterable[OpClass]) -> list[bool]:
    """Per forward op of one block call (in order), whether ``policy`` keeps its outputs."""
    decider = Decider(policy)
    return [decider.saves(c) for c in classes]


def sac_context_fn(policy: SacPolicy, log: Callable[[Any, bool], None] | None = None,
                   router: frozenset[tuple[int, int]] = frozenset()) -> Callable[[], Any]:
    """The ``context_fn`` that ``torch.utils.checkpoint`` runs ``policy`` with: a fresh count per block call.
    ``log(func, saved)``: told of each forward decision (tests compare them with the trace's). ``router``: the
    block's router gates' mm shapes (``trace/ops.router_shapes``)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def context_fn() -> Any:
        # one decider per pass: torch 2.13 asks the policy in forward only and replays its answers in the
        # recomputation; an older torch asks again there (``ctx.is_recompute``), and must get the same answers
        deciders = {False: Decider(policy), True: Decider(policy)}

        def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            saved = deciders[bool(ctx.is_recompute)].saves(forward_class(func, args, router))
            if log is not None and not ctx.is_recompute:
                log(func, saved)
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)

    return context_fn
