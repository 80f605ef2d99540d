"""Apply a Plan to a model with FSDP2 ``fully_shard``: activation checkpointing and compile first, then one call per
group (lists allowed), children first, the root last, then the plan's forward methods and explicit prefetch lists."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.apply.compile import apply_compile
from fsdp_planner.apply.expert_parallel import (
    check_experts_run,
    set_expert_reduction,
    shard_experts,
    with_expert_placements,
)
from fsdp_planner.apply.float8 import apply_float8
from fsdp_planner.apply.policies import plan_policies, reshard_arg
from fsdp_planner.apply.tensor_parallel import apply_tp, split_mesh
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable_name
from fsdp_planner.fsdp2.checkpointing import apply_checkpointing, apply_offloading
from fsdp_planner.fsdp2.claim import application_order, hooked_modules
from fsdp_planner.fsdp2.plan import Plan, check_int_reshard_on_dim0, check_plan_world_size
from fsdp_planner.fsdp2.precision import full_precision_policy
from fsdp_planner.fsdp2.tensor_parallel import check_moe_styles
from fsdp_planner.fsdp2.validity import check_forward_methods
from fsdp_planner.models.hf import own_checkpointing_off
from fsdp_planner.trace.walk import model_fingerprint


def module_parents(model: nn.Module) -> dict[str, list[str]]:
    """Module (canonical name) -> the modules holding it as a child: the graph FSDP2's claim rule walks."""
    name = {id(m): n for n, m in model.named_modules()}
    parents: dict[str, list[str]] = {n: [] for n in name.values()}
    for n, m in model.named_modules():
        for c in dict.fromkeys(m.children()):
            parents[name[id(c)]].append(n)
    return parents


def device_mesh(plan: Plan, device_type: str, world_size: int) -> Any:
    """The ``DeviceMesh`` the plan's layout needs on ``world_size`` ranks: 1-D for pure FSDP, 2-D
    ``(dp_replicate, dp_shard)`` for HSDP (torchtitan's names; ``fully_shard`` shards on the last dimension and
    all-reduces grads over the first); with TP, the named dims (dp_replicate,) dp_shard, tp with ``tp`` innermost
    (consecutive ranks), which ``apply_plan`` splits into its data-parallel and TP meshes (EP's meshes: views of
    the whole one, ``apply/expert_parallel.py``)."""
    from torch.distributed.device_mesh import init_device_mesh

    check_plan_world_size(plan, world_size)
    if plan.tensor_parallel is not None:  # EP's meshes are views of this one (apply/expert_parallel.py)
        dp = plan.layout(world_size)
        dims = {"dp_replicate": dp.replicate, "dp_shard": dp.shard, "tp": plan.tp_degree}
        dims = {k: v for k, v in dims.items() if v > 1 or k != "dp_replicate"}
        return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    mesh = plan.layout(world_size)
    if mesh.replicate == 1:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(device_type, (mesh.replicate, mesh.shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def shard_placement_fn(model: nn.Module, plan: Plan, world: int) -> Any:
    """``fully_shard(shard_placement_fn=...)`` for the plan's ``shard_dims``: ``Shard(dim)`` for those params, None
    (FSDP2's Shard(0)) for the others; None when the plan shards every param on dim 0. FSDP2 refuses a dim that the
    shard size does not divide (NotImplementedError deep in fully_shard), so that is refused here in one line."""
    if not plan.shard_dims:
        return None
    from torch.distributed.tensor import Shard

    params = dict(model.named_parameters(remove_duplicate=False))
    placed: dict[int, int] = {}
    for name, dim in plan.shard_dims.items():
        p = params.get(name)
        if p is None:
            raise PlannerError(f"plan 'shard_dims' names {name!r}, which is not a parameter of the model")
        local = p.to_local() if hasattr(p, "to_local") else p  # a TP param: FSDP2 shards its TP-local shard
        if dim >= p.dim() or local.shape[dim] % world:
            raise PlannerError(f"plan 'shard_dims' shards {printable_name(name)} {tuple(p.shape)} on dim {dim}, which "
                               f"FSDP2 needs to "
                               f"exist and divide evenly by the shard size {world}")
        placed[id(p)] = dim
    return lambda param: Shard(placed[id(param)]) if id(param) in placed else None


def _check_modules(model: nn.Module, plan: Plan) -> None:
    """The plan checked against the model: every refusal comes before any module changes, so a refused plan
    leaves the model as it was."""
    if plan.fingerprint and plan.fingerprint != model_fingerprint(model):
        raise PlannerError("plan was made for another model (parameter names, shapes or dtypes differ)")
    modules = dict(model.named_modules())
    if unknown := [m for g in plan.groups for m in g.modules if m not in modules]:
        raise PlannerError(f"plan names modules the model does not have: {', '.join(map(printable_name, unknown[:5]))}")
    check_forward_methods(plan, model)
    check_moe_styles(plan.tensor_parallel, modules, plan.expert_parallel is not None)
    if plan.expert_parallel is not None:
        check_experts_run(modules, plan.expert_parallel.experts(modules), plan.ep_degree, plan.tp_degree,
                          plan.compiled)
    check_int_reshard_on_dim0(plan)


def _check_arguments(model: object, plan: object, mesh: object, mp_policy: object, offload_policy: object) -> None:
    """Each argument of the type FSDP2 takes, a model once: an AttributeError from inside FSDP2 or torch's
    AssertionError on a second ``fully_shard`` said no more than that (a trial of the API)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

    if isinstance(plan, str | Path):
        raise PlannerError(f"apply_plan's plan must be a Plan, not a path: Plan.load({str(plan)[:100]!r}) reads it")
    for what, value, kind, said in (("model", model, nn.Module, "an nn.Module"), ("plan", plan, Plan, "a Plan"),
                                    ("mesh", mesh, DeviceMesh, "a DeviceMesh or None"),
                                    ("mp_policy", mp_policy, MixedPrecisionPolicy, "a MixedPrecisionPolicy or None"),
                                    ("offload_policy", offload_policy, OffloadPolicy, "an OffloadPolicy or None")):
        if not isinstance(value, kind) and (what in ("model", "plan") or value is not None):
            raise PlannerError(f"apply_plan's {what} must be {said}, not {type(value).__name__}")
    assert isinstance(model, nn.Module)
    if sharded := next((name or "the model" for name, m in model.named_modules() if isinstance(m, FSDPModule)),
                       None):
        raise PlannerError(f"apply_plan shards a model once: {printable_name(sharded)} is sharded already (build the "
                           "model again to apply another plan)")


def _mesh_device(model: nn.Module) -> str:
    """The device type of the mesh ``apply_plan`` builds: the params'; for a model built on meta, to be materialized
    after sharding (``to_empty``), the device it will be on (FSDP2 found no device module of "meta": a trial)."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    if device_type != "meta":
        return device_type
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def apply_plan(model: nn.Module, plan: Plan, mesh: Any = None, mp_policy: Any = None,
               offload_policy: Any = None) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it. Works on any world size; without ``mesh``, the
    plan's layout over the default process group (``device_mesh``). With tensor parallelism, ``mesh`` has named
    dims with ``tp`` among them: ``parallelize_module`` over it first (``apply_tp``), then checkpointing, then
    ``fully_shard`` over the data-parallel dims, as torchtitan's ``parallelize`` orders them. With expert
    parallelism, the expert modules over ``ep`` and the EP-reduced mesh first (``shard_experts``). ``mp_policy``
    (default FSDP2's) with the plan's reduce dtype where it records one, which replaces the policy's (the step it
    was simulated with); the plan's CPU offload unless ``offload_policy`` is given (``plan_policies``)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    _check_arguments(model, plan, mesh, mp_policy, offload_policy)
    _check_modules(model, plan)
    if mesh is None:
        import torch.distributed as dist

        mesh = device_mesh(plan, _mesh_device(model), dist.get_world_size())
    expert_parallel = plan.expert_parallel is not None  # the experts first, on meshes of their own (before TP)
    ep_plan, dp_world = plan, mesh.size() // plan.tp_degree  # (for experts sharded in their blocks' calls)
    plan, experts_placed = shard_experts(model, plan, mesh, mp_policy, offload_policy) if expert_parallel \
        else (plan, {})
    mesh, tp_mesh = split_mesh(mesh, plan)
    world = mesh.size(mesh.ndim - 1)  # the shard dimension: what an int reshard_after_forward divides
    apply_float8(model, plan.float8)  # before TP and fully_shard, as torchtitan's converter
    if plan.tensor_parallel is not None:
        apply_tp(model, plan.tensor_parallel, tp_mesh, expert_parallel,
                 plan.float8 is not None and plan.float8.tp_float8_all_gather, plan.chunked_head)
    placement = with_expert_placements(shard_placement_fn(model, plan, world), experts_placed)  # by the names the
    # plan knows, after TP made its params; experts on a per-param mesh by their params' ids
    own_checkpointing_off(model)  # transformers' own: the plan's, before fully_shard as torchtitan's, replaces it
    apply_checkpointing(model, plan.activation_checkpointing, plan.selective_checkpointing, plan.compiled,
                        plan.checkpoint_early_stop)
    apply_offloading(model, plan.activation_offloading)
    apply_compile(model, plan.compiled)  # after checkpointing, before fully_shard, as torchtitan does
    modules = dict(model.named_modules())  # (after float8's conversion, which swaps Linears a group may name)
    mp, offload = plan_policies(plan, mp_policy, offload_policy)
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload,
                              "shard_placement_fn": placement}
    parents = module_parents(model)
    for gi in application_order(plan, parents):
        g = plan.groups[gi]
        targets = [modules[m] for m in g.modules]
        if g.is_root:
            continue
        own = {**kwargs, "mp_policy": full_precision_policy(mp)} if g.param_dtype == "fp32" else kwargs
        fully_shard(targets[0] if len(targets) == 1 else targets,
                    reshard_after_forward=reshard_arg(g.reshard_after_forward, world), **own)
    # the root's reshard_after_forward is given explicitly (False by default, what FSDP2 2.8+ infers from None)
    fully_shard(model, reshard_after_forward=reshard_arg(plan.root.reshard_after_forward, world), **kwargs)
    set_expert_reduction(model, ep_plan, dp_world)
    for fqn, name in plan.forward_methods:  # after fully_shard: it wraps with the module's FSDP state's hooks
        register_fsdp_forward_method(modules[fqn], name)
    # a group's FSDP module: its first module that fully_shard hooked (a listed module below another gets no state)
    state = [modules[hooked_modules(g.modules, parents)[0]] for g in plan.groups]
    for g, first in zip(plan.groups, state, strict=True):
        if g.forward_prefetch:
            first.set_modules_to_forward_prefetch([state[j] for j in g.forward_prefetch])
        if g.backward_prefetch:
            first.set_modules_to_backward_prefetch([state[j] for j in g.backward_prefetch])
    return model
