"""The collectives FSDP1 (``FullyShardedDataParallel``) issues for a plan it can express: FSDP2's replay with
FSDP1's differences (no backward all-gather for a unit whose outputs need no grad; one padded flat parameter per
unit). What ``verify --fsdp1`` predicts; wrapping the model is ``apply/fsdp1.py``'s."""

from __future__ import annotations

from typing import Any

from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Collective, build_schedule
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.records import Trace


def fsdp1_collectives(trace: Trace, plan: Plan, world_size: int) -> list[Collective]:
    """The collectives FSDP1 issues for a plan it can express: FSDP2's replay (FSDP1's root also never reshards
    after forward, SHARD_GRAD_OP units neither), less the backward all-gathers of a unit whose forward outputs
    need no gradient: FSDP1 registers its pre-backward unshard on outputs that require grad, and its backward
    prefetch skips a handle without one (FSDP2 prefetches it all the same). Under LoRA, the frozen base layers of
    the first block are such units (their input needs no grad)."""
    backward_of = {e.module for e in trace.events if e.kind is EventKind.BWD_PRE}
    no_backward = {gi for gi, g in enumerate(plan.groups)
                   if not g.is_root and not any(m in backward_of for m in g.modules)}
    return [c for c in build_schedule(trace, plan, world_size).collectives
            if not (c.kind is CollectiveKind.ALL_GATHER and c.backward and c.group in no_backward)]


def fsdp1_collective_bytes(trace: Any, plan: Plan, world_size: int, kinds: list[tuple[str, int]]) -> dict[str, int]:
    """Bytes of FSDP1's all-gathers and reduce-scatters (``kinds``: each collective's kind and group): one flat
    parameter per unit, padded as a whole to a multiple of the world size (FSDP2 pads each param instead); a
    reduce-scatter carries the unit's flat gradient, which exists only when the unit is trainable."""
    flat: list[int] = []
    for g in plan.groups:
        params = [trace.param(p) for p in g.params]
        numel = sum(p.numel for p in params)
        padded = -(-numel // world_size) * world_size
        flat.append(padded * (params[0].itemsize if params else 0))
    out: dict[str, int] = {}
    for kind, group in kinds:
        out[kind] = out.get(kind, 0) + flat[group]
    return out
