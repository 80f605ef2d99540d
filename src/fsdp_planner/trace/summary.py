"""One ``ModuleInfo`` per module object: its place in the model and the stats of its calls in the traced step."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.infos import ModuleInfo, ParamInfo
from fsdp_planner.trace.tree import ROOT, parent_of
from fsdp_planner.trace.walk import ModuleWalk


def module_infos(walk: ModuleWalk, params: list[ParamInfo], param_objs: list[nn.Parameter], events: list[Event],
                 calls: dict[str, int], modified_inputs: set[str], modified_outputs: set[str],
                 modified_topks: set[str] = frozenset(), input_dims: dict[str, int] | None = None,
                 aliased_inputs: set[str] = frozenset()) -> dict[str, ModuleInfo]:
    """One ModuleInfo per module object, with its real children and the stats of its calls (``modified_inputs``:
    modules a call of which modified its grad-requiring inputs in place; ``modified_outputs``: modules whose
    call's output was modified in place after it returned; ``modified_topks``: modules whose ``topk``'s outputs
    were; ``input_dims``: the dims of the first tensor each module's first call was given)."""
    input_dims = input_dims or {}
    aliases: dict[str, list[str]] = {}
    for n, m in walk.named:
        if n != walk.canonical[id(m)]:
            aliases.setdefault(walk.canonical[id(m)], []).append(n)
    pname = {id(p): params[i].fqn for i, p in enumerate(param_objs)}
    fwd, bwd, first = _module_stats(events)
    return {
        fqn: ModuleInfo(
            fqn=fqn, cls=type(m).__name__,
            params=tuple(dict.fromkeys(pname[id(p)] for p in m._parameters.values() if p is not None)),
            children=tuple(dict.fromkeys(walk.canonical[id(c)] for c in m._modules.values() if c is not None)),
            aliases=tuple(dict.fromkeys(aliases.get(fqn, ()))),
            calls=calls.get(fqn, 0), fwd_flops=fwd.get(fqn, 0), bwd_flops=bwd.get(fqn, 0), first_use=first.get(fqn, -1),
            shardable=_shardable(m) and not (fqn in modified_inputs and _fsdp2_refuses_inplace(fqn, m)),
            records_outputs=bool(getattr(type(m), "_can_record_outputs", None)),
            input_dims=input_dims.get(fqn, -1), from_transformers=type(m).__module__.startswith("transformers."),
            output_modified=fqn in modified_outputs, topk_modified=fqn in modified_topks,
            aliased_inputs=fqn in aliased_inputs,
            torch_class=_torch_class(m), plain_torch_class=type(m) in (nn.Linear, nn.Embedding),
            running_stats=bool(m.training and getattr(m, "track_running_stats", False)
                               and isinstance(getattr(m, "running_mean", None), torch.Tensor)),
        )
        for fqn, m in walk.modules.items()
    }


def _torch_class(m: nn.Module) -> str:
    """The torch class among those TP's weight-sharding styles take (their ``_apply``'s isinstance checks)."""
    return "Linear" if isinstance(m, nn.Linear) else "Embedding" if isinstance(m, nn.Embedding) else ""


def _shardable(m: nn.Module) -> bool:
    """What ``fully_shard``'s module check accepts: not a ModuleList/ModuleDict that keeps nn.Module's forward."""
    return not (isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward)


def _fsdp2_refuses_inplace(fqn: str, m: nn.Module) -> bool:
    """Whether ``fully_shard(m)`` breaks a call that modifies its grad-requiring inputs in place. FSDP2 passes the
    inputs of a module that manages params through ``RegisterPostBackwardFunction``, which returns them as-is:
    autograd makes them views made in a custom Function, which an in-place op may not modify. A module without
    params below it gets no such function. The root is always sharded (a plan cannot avoid it), so it is left
    shardable: its inputs rarely need grads."""
    return fqn != ROOT and next(m.parameters(), None) is not None


def _module_stats(events: list[Event]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per module name: forward and backward FLOPs of the ops run in its subtree, and the first forward op in
    its subtree that read a param (summed per innermost module, then up the names once)."""
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.kind is EventKind.OP:
            flops = bwd if e.backward else fwd
            flops[e.module] = flops.get(e.module, 0) + e.flops
            if e.params and not e.backward and e.module not in first:
                first[e.module] = i
    for own in (fwd, bwd):
        for fqn, n in list(own.items()):
            while fqn != ROOT:
                fqn = parent_of(fqn)
                own[fqn] = own.get(fqn, 0) + n
    for fqn, i in list(first.items()):
        while fqn != ROOT:
            fqn = parent_of(fqn)
            if first.get(fqn, i + 1) <= i:
                break
            first[fqn] = i
    return fwd, bwd, first
