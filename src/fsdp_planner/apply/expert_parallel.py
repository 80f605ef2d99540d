"""Apply a plan with expert parallelism as torchtitan's ``parallelize`` does for its MoE models: the expert modules
distributed over ``ep`` (their grouped params ``Shard(0)``: E / EP experts a rank, the routed tokens sent to their
experts' ranks by an all-to-all and back by another: ``distribute_module`` with input and output functions, as
torchtitan's ``ExpertParallel`` style), then each expert module ``fully_shard``-ed alone over the EP-reduced mesh
(``dp_shard_mod_ep``) and the rest of the plan over the whole data-parallel mesh: ``apply_plan`` calls
``shard_experts`` for a plan with EP, so verify, the fake world and a user's script share one path.

transformers' experts layers (Mixtral's, Qwen3-MoE's, gpt-oss's: (tokens, dim) in, with the top-k indices and
weights, routing inside their forward) take transformers' own EP instead (``hf_experts.distribute_experts``): the
same meshes, params and FSDP2 groups, its all-to-all dispatch of every (token, expert) pair.

The expert modules take (E, tokens per expert, dim) and give the same shape (``models/moe.py``'s
``GroupedExperts``): the dispatch turns one rank's (E, n, dim) into its local experts' (E / EP, EP x n, dim), the
tokens every EP rank routed to them, and the module runs on its params' local shards (``_on_local_shards``, as
torchtitan's GroupedExperts reads them); the combine reverses it. With TP (torchtitan's expert TP of 1)
EP's ranks are dp_shard x tp ranks: each TP rank dispatches its 1/TP of each expert's rows and puts the combined
ones back among the whole layer's (``TPStyle.TOKEN_SPLIT``), the MoE layer's other styles applied by ``apply_tp``
after the experts are distributed.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_planner.apply.policies import plan_policies, reshard_arg
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.expert_groups import alone_refusal, check_no_prefetch
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.validity import modules_inside
from fsdp_planner.models import ModelSpec, hf, load_model
from fsdp_planner.models.hf_experts import (
    COMPILED_EP,
    NO_EP_TP,
    check_runs_ep,
    distribute_experts,
    is_transformers_module,
    one_rank_mesh,
)


def _dispatch(module: nn.Module, inputs: tuple, mesh: Any, split: int = 1) -> tuple:
    """(E, n, dim) routed rows on this rank -> its E / EP experts' rows from every EP rank, Shard(0) on ``ep``.
    ``split`` > 1 (EP x TP): this TP rank's 1/``split`` of each expert's rows only (the TP ranks are the innermost
    of EP's, so a rank's place among its TP group is its EP rank mod ``split``)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    x, *rest = inputs
    ep = mesh.size()
    if x.dim() != 3:  # (transformers' standard experts layers take their own EP: hf_experts.distribute_experts)
        raise PlannerError(f"{type(module).__name__} takes a {x.dim()}-D input, and expert parallelism is applied "
                           "to experts taking (experts, tokens per expert, dim) (models/moe.py's GroupedExperts; "
                           "not torchtitan's, which take the token rows and their counts) or to transformers' "
                           "standard experts layers: plan it without --ep")
    if split > 1:
        if x.shape[1] % split:
            raise PlannerError(f"EP with TP {split} splits each expert's {x.shape[1]} routed tokens over the TP ranks: "
                               f"give a batch x sequence x top-k / experts that is a multiple of {split}")
        rows = x.shape[1] // split
        at = mesh.get_local_rank() % split * rows
        x = x[:, at:at + rows]
    e, n, dim = x.shape
    got = all_to_all_single_autograd(x.contiguous().view(e * n, dim), None, None, mesh)
    return (got.view(ep, e // ep, n, dim).transpose(0, 1).reshape(e // ep, ep * n, dim), *rest)


def _combine(module: nn.Module, out: Any, mesh: Any, split: int = 1) -> torch.Tensor:
    """The experts' (E / EP, EP x n, dim) rows back to the ranks that routed them: (E, n, dim); ``split`` > 1:
    put among the whole layer's rows, zeros for the other TP ranks' (the layer's output is partial over TP)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.tensor import DTensor

    local = out.to_local() if isinstance(out, DTensor) else out
    ep = mesh.size()
    e_local, rows, dim = local.shape
    n = rows // ep
    sent = local.view(e_local, ep, n, dim).transpose(0, 1).reshape(ep * e_local * n, dim)
    back = all_to_all_single_autograd(sent, None, None, mesh).view(ep * e_local, n, dim)
    if split == 1:
        return back
    at = mesh.get_local_rank() % split
    return torch.nn.functional.pad(back, (0, 0, at * n, (split - 1 - at) * n))


def _hooks(split: int) -> tuple[Any, Any]:
    """The dispatch and combine as ``distribute_module`` takes them (three arguments each) for ``split``."""
    def dispatch(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        return _dispatch(module, inputs, mesh, split)

    def combine(module: nn.Module, out: Any, mesh: Any) -> torch.Tensor:
        return _combine(module, out, mesh, split)

    return dispatch, combine


def _on_local_shards(module: nn.Module) -> None:
    """The experts module's forward run on this rank's shards: its params' local tensors while it runs (``to_local``,
    a view whose grad flows back to the DTensor param, as torchtitan's GroupedExperts reads them), its input the
    dispatch's local rows. So any experts module runs, its batched matmuls or a loop over its experts
    (``range(x.shape[0])`` or ``range(self.w1.shape[0])``: E / EP of them here); with DTensors, a loop's shapes were
    the global ones and failed on every rank (a new user's finding)."""
    # bound to the module (a method, not a closure over it: a deep copy of the model rebinds it to the copy)
    module.forward = types.MethodType(local_forward, module)


def local_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s class forward with its DTensor params swapped for their local tensors while it runs (an export
    with EP writes this function into its file)."""
    from torch.distributed.tensor import DTensor

    held = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    try:
        for n, p in held.items():  # (FSDP2 set these, unsharded, before the call: swapped back after it)
            module._parameters[n] = p.to_local()
        return type(module).forward(module, *args, **kwargs)
    finally:
        module._parameters.update(held)


def _shard_experts(name: str, module: nn.Module, mesh: Any) -> None:
    """Each of the module's own params sharded on its expert dim 0 over ``ep``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                      requires_grad=p.requires_grad))


def expert_parallel_meshes(plan: Plan, mesh: Any) -> tuple[Any, Any]:
    """(experts' FSDP mesh, ep mesh) over the ranks of the data-parallel ``mesh`` (1-D, or HSDP's (dp_replicate,
    dp_shard)), torchtitan's sparse view of the world: EP's ranks consecutive, out of dp_shard; the experts sharded
    over the dp_shard ranks holding the same ones (``dp_shard_mod_ep``, EP apart) and, under HSDP, replicated over
    dp_replicate (torchtitan's ``dp_mod_ep`` mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    ep, world = plan.ep_degree, mesh.size()
    names = tuple(mesh.mesh_dim_names or ())
    if plan.tp_degree > 1:  # the whole mesh, tp among its named dims: EP's ranks out of dp_shard x tp
        replicate = mesh["dp_replicate"].size() if "dp_replicate" in names else 1
    else:
        replicate = mesh.size(0) if mesh.ndim == 2 else 1
        if mesh.ndim > 2:
            raise PlannerError("expert parallelism without TP shards over a 1-D or (dp_replicate, dp_shard) mesh")
    if (world // replicate) % ep:
        raise PlannerError(f"the plan's expert-parallel degree {ep} does not divide the {world // replicate} "
                           "data-parallel shard ranks of the mesh (EP's ranks come out of dp_shard, x tp with TP)")
    whole = init_device_mesh(mesh.device_type, (world,), mesh_dim_names=("world",))
    sparse = whole._unflatten(0, (replicate, world // replicate // ep, ep), ("dp_replicate", "dp_shard_mod_ep", "ep"))
    return (sparse["dp_replicate", "dp_shard_mod_ep"] if replicate > 1 else sparse["dp_shard_mod_ep"]), sparse["ep"]


def _expert_placement(module: nn.Module, name: str, plan: Plan) -> Any:
    """``fully_shard(shard_placement_fn=...)`` for the expert module ``name``: its params' ``shard_dims`` (dim 1
    where E / EP experts are fewer than the ranks sharding them, as torchtitan places experts), after EP made them
    DTensors; None: all on dim 0."""
    from torch.distributed.tensor import Shard

    dims = {id(p): plan.shard_dims[f"{name}.{n}"] for n, p in module.named_parameters()
            if f"{name}.{n}" in plan.shard_dims}
    return (lambda param: Shard(dims[id(param)]) if id(param) in dims else None) if dims else None


def check_experts_run(modules: dict[str, nn.Module], experts: list[str], degree: int, tp_degree: int,
                      compiled: Sequence[str] = ()) -> None:
    """Refuse EP of experts apply does not run, before any module is changed: transformers' experts layers with
    TP (``NO_EP_TP``), inside ``compiled`` modules (``COMPILED_EP``) or that transformers' EP does not run
    (``check_runs_ep``)."""
    own = [name for name in experts if is_transformers_module(modules[name])]
    if own and tp_degree > 1:
        raise PlannerError(f"{own[0]} ({type(modules[own[0]]).__name__}): {NO_EP_TP}; plan it without --ep "
                           "or without --tp")
    if (inside := next(modules_inside(own, compiled), None)) is not None:
        raise PlannerError(f"{inside[0]} ({type(modules[inside[0]]).__name__}): {COMPILED_EP}")
    for name in own:
        check_runs_ep(name, modules[name], degree)


def check_model_runs_ep(model: ModelSpec, plan: Plan, modules: dict[str, nn.Module] | None = None) -> None:
    """``check_experts_run`` before anything runs (verify's ranks, an export), on an ``hf:`` model built on meta
    (``modules``: its modules, where the caller built it), its blocks compiled as the plan compiles them: only
    transformers' experts can be ones its EP does not run."""
    if plan.expert_parallel is not None and hf.is_hf(model.name):
        modules = modules if modules is not None else dict(load_model(model).model.named_modules())
        check_experts_run(modules, plan.expert_parallel.experts(modules), plan.ep_degree, plan.tp_degree,
                          plan.compiled)


def shard_experts(model: nn.Module, plan: Plan, mesh: Any, mp_policy: Any = None,
                  offload_policy: Any = None) -> tuple[Plan, dict[int, Any]]:
    """``plan``'s expert modules distributed over ``ep`` and each ``fully_shard``-ed alone over the EP-reduced mesh
    (module docstring), both out of the ranks of the data-parallel ``mesh`` the rest is sharded over; returns the
    rest of the plan (no EP, no expert groups) and, for a plan with ``per_param_mesh``, where its block's call must
    place each expert param instead of sharding the experts alone (``id(param)`` -> ``ShardPlacementResult``:
    ``with_expert_placements``). The expert modules must be groups alone."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_module

    assert plan.expert_parallel is not None
    check_no_prefetch(plan)
    modules = dict(model.named_modules())
    experts = plan.expert_parallel.experts(modules)
    alone = {g.modules[0]: g for g in plan.groups if len(g.modules) == 1}
    per_param = plan.expert_parallel.per_param_mesh  # (expert groups of several modules: one call's param group)
    if not per_param and (said := alone_refusal(plan, experts)):
        raise PlannerError(said)
    dp_mod_ep, ep = expert_parallel_meshes(plan, mesh)
    shard = dp_mod_ep.size(dp_mod_ep.ndim - 1)  # the experts' shard dim (after dp_replicate under HSDP)
    mp, offload = plan_policies(plan, mp_policy, offload_policy)
    split = plan.tp_degree  # EP x TP: each TP rank dispatches its 1/TP of the routed tokens (TPStyle.TOKEN_SPLIT)
    own_batch = one_rank_mesh(ep) if any(is_transformers_module(modules[n]) for n in experts) else None
    mesh_info = _mesh_info(dp_mod_ep) if per_param else None
    placements: dict[int, Any] = {}
    for name in experts:
        if is_transformers_module(modules[name]):  # routes inside its forward: transformers' own EP
            distribute_experts(modules[name], ep, own_batch)
        else:
            distribute_module(modules[name], ep, _shard_experts, *_hooks(split))
            _on_local_shards(modules[name])
        if mesh_info is not None:  # sharded by its block's fully_shard call, on the EP-reduced mesh
            placements.update(_per_param_placements(modules[name], name, plan, mesh_info))
            continue
        fully_shard(modules[name], mesh=dp_mod_ep, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_arg(alone[name].reshard_after_forward, shard),
                    shard_placement_fn=_expert_placement(modules[name], name, plan))
        # an expert's grad sums the tokens of every EP rank too: averaged over all data-parallel ranks, not only
        # the EP-reduced mesh FSDP2 reduces over (else it is EP x the unsharded run's)
        modules[name].set_gradient_divide_factor(float(mesh.size() // plan.tp_degree))  # TP ranks share a batch
        # gloo has no PREMUL_SUM for the factor: SUM, then a local divide (not on a shard dim of one rank, where
        # FSDP2 divides its copy already and would divide again)
        if shard > 1 and dist.get_backend(ep.get_group()) == "gloo":
            modules[name].set_force_sum_reduction_for_comms(True)
    rest = plan.replace(groups=[g for g in plan.groups if not set(g.modules) <= set(experts)],
                        expert_parallel=None, shard_dims={k: d for k, d in plan.shard_dims.items()
                                                          if k.rpartition(".")[0] not in experts})
    return rest, placements


def _mesh_info(mesh: Any) -> Any:
    """The FSDPMeshInfo FSDP2 itself makes for ``mesh`` (its private ``_get_mesh_info``, which torchtitan's
    ``apply_fsdp`` calls too): one object for every expert param, as FSDP2 wants for params of one process group."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    return _get_mesh_info(mesh)


def _per_param_placements(module: nn.Module, name: str, plan: Plan, mesh_info: Any) -> dict[int, Any]:
    """Each of the expert module's params -> torch's ``ShardPlacementResult``: its shard dim (``_expert_placement``)
    on the EP-reduced mesh (``mesh_info``), as torchtitan's ``apply_fsdp`` places them."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

    dim = _expert_placement(module, name, plan)
    return {id(p): ShardPlacementResult(placement=dim(p) if dim else None, mesh_info=mesh_info)
            for p in module.parameters()}


def with_expert_placements(placement: Any, experts: dict[int, Any]) -> Any:
    """``fully_shard(shard_placement_fn=...)`` placing the expert params as ``experts`` says (``shard_experts``)
    and the others as ``placement`` (None: FSDP2's Shard(0) on the call's mesh)."""
    if not experts:
        return placement
    return lambda param: experts.get(id(param)) or (placement(param) if placement is not None else None)


def set_expert_reduction(model: nn.Module, plan: Plan, dp_world: int) -> None:
    """``expert_reduction`` for a plan whose experts are sharded in their blocks' calls."""
    if plan.expert_parallel is not None and plan.expert_parallel.per_param_mesh:
        modules = dict(model.named_modules())
        expert_reduction(modules, plan.expert_parallel.experts(modules), float(dp_world))


def expert_reduction(modules: dict[str, nn.Module], experts: list[str], dp_world: float) -> None:
    """The grads of ``experts`` sharded in their blocks' calls (a per-param mesh) sum every EP rank's tokens: each
    call holding them divides by the whole data-parallel world of ``dp_world`` ranks, as an expert module's own call
    would (the block's other params are divided by that world by default already; TP's ranks share a batch).
    gloo has no PREMUL_SUM: SUM, then a local divide, but not for a param group over one shard rank, where FSDP2
    divides its copy already and would divide again; FSDPModule's setter sets every param group of a call alike,
    so each is set on its own (FSDP2's private state: only this gloo case needs it). ``export`` writes this
    function's source into its code: keep it free of this package."""
    from torch.distributed.fsdp import FSDPModule

    for name in experts:
        host = name
        while not isinstance(modules[host], FSDPModule):
            host = host.rpartition(".")[0]
        modules[host].set_gradient_divide_factor(dp_world)
        if dist.get_backend() == "gloo":
            for group in modules[host]._get_fsdp_state()._fsdp_param_groups:
                group.force_sum_reduction_for_comms = group.mesh_info.shard_mesh_size > 1
