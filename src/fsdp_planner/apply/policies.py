"""The FSDP2 arguments a plan's groups share, in one home for ``apply_plan`` and the expert modules' own
``fully_shard`` (``expert_parallel.py``): an int ``reshard_after_forward`` as FSDP2 takes it, and the plan's
mixed-precision and offload policies."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan, ReshardAfterForward


def reshard_arg(value: ReshardAfterForward, world_size: int) -> ReshardAfterForward:
    """FSDP2 wants an int that divides the shard size (``world_size`` here); 1 means False and the shard size
    means True."""
    if isinstance(value, bool):
        return value
    if value <= 1:
        return False
    if value >= world_size:
        return True
    if world_size % value:
        raise PlannerError(f"reshard_after_forward={value} does not divide the world size {world_size}")
    return value


def plan_policies(plan: Plan, mp_policy: Any, offload_policy: Any) -> tuple[Any, Any]:
    """The mixed-precision and offload policies to apply: the given ones, else what the plan records (its
    ``reduce_dtype`` over the given or default ``MixedPrecisionPolicy``; ``CPUOffloadPolicy`` when ``offload``,
    pinned where CUDA can pin)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mp = mp_policy or MixedPrecisionPolicy()
    if plan.reduce_dtype:
        mp = dataclasses.replace(mp, reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[plan.reduce_dtype])
    if offload_policy is None:
        offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if plan.offload else OffloadPolicy()
    return mp, offload_policy
