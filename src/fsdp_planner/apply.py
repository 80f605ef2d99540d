"""Apply a Plan to a model with FSDP2 ``fully_shard``: one call per group (lists allowed), then the root."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdp_planner.errors import PlannerError
from fsdp_planner.plan import Plan, application_order
from fsdp_planner.trace import model_fingerprint


def _reshard_arg(value: bool | int, world_size: int) -> bool | int:
    """FSDP2 wants an int that divides the world size; 1 means False and the world size means True."""
    if isinstance(value, bool):
        return value
    if value <= 1:
        return False
    if value >= world_size:
        return True
    if world_size % value:
        raise PlannerError(f"reshard_after_forward={value} does not divide the world size {world_size}")
    return value


def apply_plan(model: nn.Module, plan: Plan, mesh: Any = None, mp_policy: Any = None,
               offload_policy: Any = None) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it. Works on any world size."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if plan.fingerprint and plan.fingerprint != model_fingerprint(model):
        raise PlannerError("plan was made for another model (parameter names, shapes or dtypes differ)")
    modules = dict(model.named_modules())
    unknown = [m for g in plan.groups for m in g.modules if m not in modules]
    if unknown:
        raise PlannerError(f"plan names modules the model does not have: {', '.join(unknown[:5])}")
    if mesh is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        device_type = next((p.device.type for p in model.parameters()), "cpu")
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    world = mesh.size()
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(),
                              "offload_policy": offload_policy or OffloadPolicy()}
    for gi in application_order(plan):
        g = plan.groups[gi]
        if g.is_root:
            continue
        targets = [modules[m] for m in g.modules]
        fully_shard(targets[0] if len(targets) == 1 else targets,
                    reshard_after_forward=_reshard_arg(g.reshard_after_forward, world), **kwargs)
    root = plan.root
    root_reshard = None if root.reshard_after_forward is False else _reshard_arg(root.reshard_after_forward, world)
    fully_shard(model, reshard_after_forward=root_reshard, **kwargs)
    for g in plan.groups:
        first = modules[g.modules[0]]
        if g.forward_prefetch:
            first.set_modules_to_forward_prefetch([modules[plan.groups[j].modules[0]] for j in g.forward_prefetch])
        if g.backward_prefetch:
            first.set_modules_to_backward_prefetch(
                [modules[plan.groups[j].modules[0]] for j in g.backward_prefetch])
    return model
