"""``fsdp_planner.plan``: the one call a training script makes to get its FSDP2 plan.

It runs what ``fsdp-planner plan MODEL --policy P --cluster C --json`` runs (the trace at the precision's compute
dtype, the policy, auto's search on the cluster) and returns the plan that command writes with ``--out``, so a
script and the command line agree plan for plan. The model may be built on meta (no memory) or for real: a real
model is traced under fake tensors and its params, their values, dtypes and grads, are left as they were, so the
script can plan and then train the very model it built.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

from fsdp_planner.attention import kernel
from fsdp_planner.choices import (
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    DEFAULT_SAC_POLICY,
    GRADIENT_SYNC_NAMES,
    ACMode,
    AttentionKernel,
    GradientSync,
    PolicyName,
    ReduceDtype,
    SacPolicy,
    ShardPlacement,
    Target,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, parse_size
from fsdp_planner.fsdp2.plan import Mesh, Plan, check_plan_world_size
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.models import MAX_ROUTING, MIN_ROUTING, ModelSpec, load_model
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, infeasible_message
from fsdp_planner.planners.auto.split import choose_split
from fsdp_planner.planners.registry import PolicyRequest, make_policy
from fsdp_planner.routing import DEFAULT_CAPACITY
from fsdp_planner.sim.budget import Headroom, parse_headroom
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.sizing import with_memory_options
from fsdp_planner.sim.tracing import trace
from fsdp_planner.trace.records import Trace

DEFAULT_CLUSTER = "h100:8"  # as ``plan --policy auto`` without --cluster


def plan(model: nn.Module | str, inputs: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
         cluster: Cluster | str = DEFAULT_CLUSTER, policy: str = PolicyName.AUTO.value,
         precision: str = DEFAULT_PRECISION, optimizer: str = DEFAULT_OPTIMIZER, batch: int | None = None,
         seq: int | None = None, ac: str | None = None, ac_policy: str | None = None, mesh: str | None = None,
         memory_budget: int | str | None = None, headroom: float | str | None = None,
         micro_batches: int | str = 1, offload: bool = False, module_classes: tuple[str, ...] = (),
         search_effort: int | None = None, target: str = Target.FSDP2.value, reduce_dtype: str | None = None,
         shard_placement: str = ShardPlacement.DIM0.value, attention: str | None = None,
         routing: float | None = None, hf_config: dict[str, Any] | None = None,
         gradient_sync: str = GradientSync.LAST.value) -> Plan:
    """The FSDP2 plan for ``model`` on ``cluster``: the plan ``fsdp-planner plan ... --policy POLICY --out`` writes
    for the same model and options (each keyword is the option of the same name, ``-`` as ``_``; the README's
    Python API section lists them). ``micro_batches="auto"`` is ``--micro-batches auto``: auto's choice of the
    split of ``batch`` (a MODEL spec string with ``batch`` and ``policy="auto"``). ``hf_config``: a dict of
    ``--hf-config`` fields, for an ``hf:`` MODEL spec.

    ``model`` is an ``nn.Module`` (on meta or real) with its ``inputs`` (a tuple of positional args, one tensor or
    a dict of kwargs: one micro-batch of one rank) and optional ``loss_fn`` (default: the mean of squares of the
    output), or a MODEL spec string (``"toy-llama"``, ``"path/model.py:build"``, ``"hf:..."``) whose factory
    ``batch`` and ``seq`` reach, as ``--batch`` and ``--seq`` do. ``cluster``: a preset such as ``"h100:64"``, a
    cluster JSON path, or a ``Cluster``. Raises ``PlannerError`` with one sentence for a bad argument, and when
    auto finds no plan within the memory budget.

    A real model is traced as its meta twin (params and buffers as meta tensors, ties kept, nothing copied) with
    its inputs on meta and the real tensors its ``loss_fn`` reads moved to meta, as the command line traces a
    factory's model; a step that cannot run on meta (a tensor made on an explicit device in forward) is traced on
    the real model under fake tensors instead, its params' values, dtypes and grads restored.
    """
    the_cluster = cluster if isinstance(cluster, Cluster) else parse_cluster(_text(cluster, "cluster"))
    request = _policy_request(policy, ac, ac_policy, mesh, memory_budget, headroom, module_classes, search_effort,
                              target)
    split = _is_auto_split(micro_batches)
    if split and (request.name is not PolicyName.AUTO or not isinstance(model, str) or batch is None):
        raise PlannerError("micro_batches='auto' lets policy='auto' split batch, the per-GPU batch of a MODEL spec: "
                           "give a MODEL spec string, policy='auto' and batch")
    workload = _workload(attention, routing, hf_config, model)
    options = _options(precision, optimizer, 1 if split else micro_batches, offload, batch, shard_placement,
                       reduce_dtype, gradient_sync)
    if split:  # auto's search at each split of the batch, traced at its micro-batch (as plan --micro-batches auto)
        best, _ = choose_split(_whole(batch, "batch"), lambda n: _searched(
            request, the_cluster, replace(options, micro_batches=n), model, batch, seq, workload))
        options = replace(options, micro_batches=best.micro_batches)
        chosen = _fitting(best.result)
    else:
        tr, name = _trace(model, inputs, loss_fn, batch, seq, options.micro_batches, options, workload)
        chosen = (_fitting(_search(request, the_cluster, options, tr, name)) if request.name is PolicyName.AUTO
                  else _classic(request, tr, name, the_cluster, options))
    # as ``plan --out``: export and apply train in the precision, verify rebuilds with the attention and hf_config
    return replace(chosen, precision=options.precision.name, attention=workload.attention or "",
                   hf_config=workload.hf_config)


@dataclass(frozen=True)
class _Workload:
    """The step's settings beside batch and seq: ``--attention``, ``--routing``, ``--hf-config``."""

    attention: str | None
    routing: float | None
    hf_config: tuple[tuple[str, Any], ...]


def _workload(attention: object, routing: object, hf_config: object, model: object) -> _Workload:
    """``attention``, ``routing`` and ``hf_config`` checked as the command line checks its options."""
    if attention is not None:
        attention = _choice(AttentionKernel, attention, "attention").value
    if routing is not None and (isinstance(routing, bool) or not isinstance(routing, int | float)
                                or not MIN_ROUTING <= routing <= MAX_ROUTING):
        raise PlannerError(f"routing must be a capacity factor from {MIN_ROUTING} to {MAX_ROUTING:g}, got "
                           f"{cut_short(repr(routing))}")
    return _Workload(attention, routing, _hf_config(hf_config, model))  # type: ignore[arg-type]


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerError(f"{what} must be a whole number, got {cut_short(repr(value))}")
    return value


def _fitting(found: AutoResult) -> Plan:
    """Auto's plan, or the one sentence saying why none fits the budget."""
    if not found.fits:
        raise PlannerError(infeasible_message(found))
    return found.written_plan


def _is_auto_split(micro_batches: object) -> bool:
    return isinstance(micro_batches, str) and micro_batches.strip().lower() == "auto"


def _hf_config(fields: object, model: object) -> tuple[tuple[str, Any], ...]:
    """``hf_config`` checked: a dict of JSON scalars keyed by field name, for an ``hf:`` MODEL spec."""
    if fields is None:
        return ()
    if not isinstance(fields, dict) or not all(isinstance(k, str) and k for k in fields):
        raise PlannerError(f"hf_config must be a dict of config fields by name, got {cut_short(repr(fields))}")
    if not isinstance(model, str):
        raise PlannerError("hf_config sets fields of an hf: MODEL spec's config: build the nn.Module with them "
                           "instead")
    bad = [k for k, v in fields.items() if v is not None and not isinstance(v, bool | int | float | str)]
    if bad:
        raise PlannerError(f"hf_config values must be JSON scalars (bool, number, string or None): "
                           f"{cut_short(repr(bad[0]))} is not")
    return tuple(fields.items())


def _classic(request: PolicyRequest, tr: Trace, name: str, cluster: Cluster, options: SimOptions) -> Plan:
    """A classic policy's plan with the memory options recorded, as ``plan --policy P --cluster C --out``."""
    chosen = make_policy(request).plan(tr, name)
    check_plan_world_size(chosen, cluster.world_size)
    reduce = options.reduce_dtype.value if options.reduce_dtype else chosen.reduce_dtype
    return with_memory_options(chosen, tr, chosen.shard_size(cluster.world_size), options.offload,
                               options.shard_placement, reduce)


def _search(request: PolicyRequest, cluster: Cluster, options: SimOptions, tr: Trace, name: str) -> AutoResult:
    policy_obj = make_policy(request, cluster, options)
    assert isinstance(policy_obj, AutoPolicy)
    return policy_obj.search(tr, name)


def _searched(request: PolicyRequest, cluster: Cluster, options: SimOptions, model: str, batch: int,
              seq: int | None, workload: _Workload) -> AutoResult:
    """Auto's search for one split of ``batch`` (``micro_batches="auto"``), traced at its micro-batch."""
    tr, name = _trace(model, None, None, batch, seq, options.micro_batches, options, workload)
    return _search(request, cluster, options, tr, name)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PlannerError(f"{what} must be a non-empty string, got {cut_short(repr(value))}")
    return value


def _policy_request(policy: str, ac: str | None, ac_policy: str | None, mesh: str | None,
                    memory_budget: int | str | None, headroom: float | str | None,
                    module_classes: tuple[str, ...], search_effort: int | None, target: str) -> PolicyRequest:
    """The settings checked as the command line checks its options, each error naming the keyword."""
    name = PolicyRequest.named(_text(policy, "policy")).name
    if ac_policy is not None and ac != ACMode.OP.value:
        raise PlannerError("ac_policy chooses what op-level checkpointing saves: give it with ac='op'")
    if memory_budget is not None and headroom is not None:
        raise PlannerError("give memory_budget or headroom, not both: an explicit budget is taken as given")
    if isinstance(module_classes, str):
        module_classes = (module_classes,)
    return PolicyRequest(
        name, module_classes=tuple(module_classes) if name in (PolicyName.MODULE, PolicyName.TITAN) else (),
        memory_budget=_budget(memory_budget) if name is PolicyName.AUTO else None,
        headroom=_headroom(headroom) if name is PolicyName.AUTO else None,
        search_effort=search_effort if name is PolicyName.AUTO else None,
        target=_choice(Target, target, "target") if name is PolicyName.AUTO else Target.FSDP2,
        checkpointing=_choice(ACMode, ac, "ac") if ac is not None else None,
        sac_policy=_choice(SacPolicy, ac_policy, "ac_policy") if ac_policy is not None else DEFAULT_SAC_POLICY,
        mesh=Mesh.parse(_text(mesh, "mesh")) if mesh is not None else None)


def _choice(kind: type, value: object, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(m.value for m in kind)
        raise PlannerError(f"{what} must be one of {names}, got {cut_short(repr(value))}") from None


def _budget(value: int | str | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PlannerError(f"memory_budget must be bytes (an int) or a size such as '60GiB', got "
                           f"{cut_short(repr(value))}")
    return parse_size(value, "memory_budget") if isinstance(value, str) else value


def _headroom(value: float | str | None) -> Headroom | None:
    if value is None:
        return None
    return parse_headroom(str(value), "headroom")


def _options(precision: str, optimizer: str, micro_batches: int | str, offload: bool, batch: int | None,
             shard_placement: str, reduce_dtype: str | None,
             gradient_sync: str = GradientSync.LAST.value) -> SimOptions:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PlannerError(f"micro_batches must be a whole number of at least 1, got {cut_short(repr(micro_batches))}")
    if micro_batches > 1 and batch is not None and _whole(batch, "batch") % micro_batches:
        raise PlannerError(f"micro_batches {micro_batches} must divide batch {batch} (each micro-batch is batch / N)")
    if gradient_sync not in GRADIENT_SYNC_NAMES:
        raise PlannerError(f"gradient_sync must be one of {', '.join(GRADIENT_SYNC_NAMES)}, got "
                           f"{cut_short(repr(gradient_sync))}")
    return SimOptions.named(_text(precision, "precision"), _text(optimizer, "optimizer"),
                            micro_batches=micro_batches, offload=bool(offload),
                            shard_placement=_choice(ShardPlacement, shard_placement, "shard_placement").value,
                            reduce_dtype=_choice(ReduceDtype, reduce_dtype, "reduce_dtype").value
                            if reduce_dtype is not None else None, gradient_sync=gradient_sync)


def _trace(model: nn.Module | str, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
           batch: int | None, seq: int | None, micro_batches: int, options: SimOptions,
           workload: _Workload) -> tuple[Trace, str]:
    """The step traced as the command line traces it (under ``workload``'s attention kernel and routing capacity),
    and the model's name in the plan."""
    with kernel(workload.attention):
        return _traced(model, inputs, loss_fn, batch, seq, micro_batches, options, workload)


def _traced(model: nn.Module | str, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
            batch: int | None, seq: int | None, micro_batches: int, options: SimOptions,
            workload: _Workload) -> tuple[Trace, str]:
    routing = workload.routing or DEFAULT_CAPACITY
    if isinstance(model, str):
        if inputs is not None or loss_fn is not None:
            raise PlannerError("a MODEL spec string brings its own inputs and loss_fn (its factory's): give inputs "
                               "and loss_fn with an nn.Module only")
        for value, what in ((batch, "batch"), (seq, "seq")):  # types here; ranges where the CLI checks them
            if value is not None:
                _whole(value, what)
        per_micro = batch // micro_batches if batch is not None else None
        lm = load_model(ModelSpec(_text(model, "model"), per_micro, seq, workload.attention, workload.routing,
                                  workload.hf_config), meta=True)
        return trace(lm.model, lm.example_inputs, lm.loss_fn, precision=options.precision, routing=routing), lm.name
    if not isinstance(model, nn.Module):
        raise PlannerError(f"model must be an nn.Module or a MODEL spec string, got {type(model).__name__}")
    if batch is not None or seq is not None:
        raise PlannerError("batch and seq reach a MODEL spec's factory; with an nn.Module the inputs are the "
                           "workload: give inputs of one micro-batch instead")
    if inputs is None:
        raise PlannerError("give the model's example inputs (one micro-batch of one rank): plan(model, inputs)")
    if not any(p.requires_grad for p in model.parameters()):
        raise PlannerError("the model has no trainable parameters: FSDP plans are for training")
    name = type(model).__name__
    try:
        copy, meta_inputs = _on_meta(model, inputs)
    except Exception:  # a module deepcopy cannot copy (a lock, a handle): the real model under fake tensors
        copy = None
    try:  # the command line traces on meta: a real model's meta twin gives its figures, and leaves it untouched
        if copy is not None:
            return trace(copy, meta_inputs, _on_meta_loss(loss_fn), precision=options.precision,
                         routing=routing), name
    except PlannerError:  # the verdict of the step in the precision (PrecisionError): the model's, not meta's
        raise
    except Exception:
        if copy is model:
            raise
    # a step that cannot run on meta (a tensor made on an explicit device in forward): the real model under fake
    # tensors, its grads kept
    with _grads_kept(model):
        return trace(model, inputs, loss_fn, precision=options.precision, routing=routing), name


def _on_meta(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """A copy of ``model`` whose params and buffers are meta tensors of the same shapes, dtypes and ties (no
    storage copied; a model on meta already is itself), and ``inputs`` on meta."""
    moved = tree_map_only(torch.Tensor, _meta, inputs)
    if all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers()):
        return model, moved
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return deepcopy(model, memo), moved


class _RealToMeta(TorchDispatchMode):
    """Every real tensor an op reads moved onto meta first: a ``loss_fn`` closing over real targets (built beside
    the real model) reads them as the factory's meta twin would."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with _disable_current_modes():  # the move itself is no op of the step
            args, kwargs = tree_map_only(torch.Tensor, _meta, (args, kwargs or {}))
        return func(*args, **kwargs)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else t.detach().to("meta").requires_grad_(t.requires_grad)


def _on_meta_loss(loss_fn: Callable[[Any], torch.Tensor] | None) -> Callable[[Any], torch.Tensor] | None:
    if loss_fn is None:
        return None

    def loss(out: Any) -> torch.Tensor:
        with _RealToMeta():
            return loss_fn(out)

    return loss


class _grads_kept:
    """A real model's ``.grad`` of every param as it was before the trace (the fake step must leave none)."""

    def __init__(self, model: nn.Module) -> None:
        self.grads = [(p, p.grad) for p in model.parameters()]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for p, g in self.grads:
            p.grad = g
