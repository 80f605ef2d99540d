"""A plan as FSDP1 (``FullyShardedDataParallel``) runs it: an ``auto_wrap_policy`` that wraps exactly the plan's
inner groups, each its own FSDP1 unit, and leaves the rest to the root unit.

What FSDP1 can express: one module per unit (no list groups), ``reshard_after_forward`` True or False per unit
(``FULL_SHARD`` / ``SHARD_GRAD_OP``, the unit's ``sharding_strategy``), one flat parameter per unit (uniform dtype
and requires_grad, with the default ``use_orig_params=False``). What it cannot: list groups, an int
``reshard_after_forward`` (FSDP1's ``_HYBRID_SHARD_ZERO2`` is a replica mesh, not a smaller shard group), explicit
prefetch lists (FSDP1 prefetches by its own recorded order), HSDP meshes (not modelled for FSDP1), and a root that
reshards after forward (FSDP1 never frees the root's params after forward).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.trace.tree import is_within


def fsdp1_refusal(plan: Plan) -> str | None:
    """Why FSDP1 cannot run ``plan`` (one sentence), or None when it can."""
    if plan.tensor_parallel is not None:
        return (f"the plan's tensor parallelism ({plan.tensor_parallel.describe()}) composes with FSDP2 only "
                "(FSDP2 shards the DTensor params TP makes); drop --fsdp1")
    if plan.mesh is not None and plan.mesh.replicate > 1:
        return (f"the plan's HSDP mesh {plan.mesh.describe()} has no FSDP1 form here (HYBRID_SHARD is not "
                "modelled); plan with --policy auto --target fsdp1")
    for i, g in enumerate(plan.groups):
        if len(g.modules) > 1:
            return (f"plan group {i} is a list of {len(g.modules)} modules, which FSDP1 cannot wrap as one unit; "
                    "plan with --policy auto --target fsdp1 (or the size or module policy)")
        if not isinstance(g.reshard_after_forward, bool):
            return (f"plan group {i} has reshard_after_forward={g.reshard_after_forward}, a sub-group FSDP1 cannot "
                    "shard over (only true or false)")
        if g.forward_prefetch or g.backward_prefetch:
            return f"plan group {i} has explicit prefetch lists, which FSDP1 does not take per unit"
    inner = next(((m, g) for m in plan.activation_checkpointing for grp in plan.inner_groups for g in grp.modules
                  if g != m and is_within(g, m)), None)
    if inner is not None:  # FSDP2's hooks in the recomputation are replayed (fsdp2/replay.py), FSDP1's are not
        return (f"checkpointed module '{inner[0]}' holds the unit '{inner[1]}', whose hooks under FSDP1 in the "
                "recomputation are not modelled; wrap the checkpointed module as the unit")
    if plan.root.reshard_after_forward is True and plan.root.params:
        return "the plan's root reshards after forward, which an FSDP1 root never does"
    return None


def _unrun(plan: Plan) -> str | None:
    """What the plan asks for beside its units that the FSDP1 job (``runtime/fsdp1_worker.py``) does not run: a
    PASS of the job without it would be a PASS of another job (a trial's --fsdp1 --float8 trained bf16, its losses
    plain FSDP1's, and passed)."""
    asks = [what for what, on in (
        ("activation checkpointing (--ac)", plan.activation_checkpointing or plan.selective_checkpointing),
        ("activation offloading", plan.activation_offloading), ("CPU offload (--offload)", plan.offload),
        ("float8 (--float8)", plan.float8 is not None), ("a reduce dtype (--reduce-dtype)", plan.reduce_dtype),
        ("shard dims (--shard-placement)", plan.shard_dims)) if on]
    return (f"the FSDP1 job runs the plan's units alone, and this plan also asks for {', '.join(asks)}: verify it "
            "with FSDP2 (drop --fsdp1), or plan without it") if asks else None


def check_fsdp1(plan: Plan, model: nn.Module | None = None,
                kinds: dict[str, tuple[str, bool]] | None = None) -> None:
    """Refuse a plan FSDP1 cannot run; with ``model`` or ``kinds`` (param -> its dtype and requires_grad, a
    trace's: checked before any rank starts), also a unit mixing dtypes or requires_grad in one flat parameter
    (``use_orig_params=False``)."""
    reason = fsdp1_refusal(plan) or _unrun(plan)
    if model is not None:
        kinds = {n: (str(p.dtype), p.requires_grad) for n, p in model.named_parameters()}
    if reason is None and kinds is not None:
        for i, g in enumerate(plan.groups):
            if len({kinds[p] for p in g.params if p in kinds}) > 1:
                reason = (f"plan group {i} ({g.modules[0] or 'root'}) mixes dtypes or requires_grad in one FSDP1 "
                          "flat parameter: run it with FSDP2 (drop --fsdp1), or plan with --policy auto --target "
                          "fsdp1, whose units keep them apart where the modules allow")
                break
    if reason is not None:
        raise PlannerError(f"FSDP1 cannot run this plan: {reason}")


def sharding_strategy(reshard_after_forward: bool) -> Any:
    """FSDP1's name for a unit's ``reshard_after_forward``: FULL_SHARD frees after forward, SHARD_GRAD_OP keeps."""
    from torch.distributed.fsdp import ShardingStrategy

    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def fsdp1_policy(plan: Plan, model: nn.Module) -> Any:
    """The ``CustomPolicy`` that wraps each inner group's module as an FSDP1 unit with its sharding strategy
    (FSDP1 calls the policy with modules only, so the names are resolved against ``model`` here)."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    check_fsdp1(plan, model)
    modules = dict(model.named_modules())
    unknown = [g.modules[0] for g in plan.inner_groups if g.modules[0] not in modules]
    if unknown:
        raise PlannerError(f"plan names modules the model does not have: {', '.join(unknown[:5])}")
    units = {id(modules[g.modules[0]]): {"sharding_strategy": sharding_strategy(g.reshard_after_forward)}
             for g in plan.inner_groups}
    return CustomPolicy(lambda module: units.get(id(module), False))


def fsdp1_kwargs(plan: Plan, model: nn.Module) -> dict[str, Any]:
    """``FullyShardedDataParallel(model, **fsdp1_kwargs(plan, model), device_id=...)``: the policy and the root's
    strategy (the root is never resharded after forward by FSDP1, whatever its strategy)."""
    return {"auto_wrap_policy": fsdp1_policy(plan, model), "sharding_strategy": sharding_strategy(True),
            "use_orig_params": False}


def wrapped_units(model: nn.Module) -> list[str]:
    """The module names FSDP1 wrapped (``""`` for the root), as the unwrapped model names them."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [clean_name(n) for n, m in model.named_modules() if isinstance(m, FullyShardedDataParallel)]


def clean_name(name: str) -> str:
    """A module name without FSDP1's wrapper segments."""
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")
