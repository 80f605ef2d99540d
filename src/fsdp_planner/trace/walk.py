"""The model's modules and params, walked once per trace: names (canonical and aliases), unique params with their
owners, and the fingerprint that identifies the model across runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_planner.trace.infos import ParamInfo


class ModuleWalk:
    """The model's module objects, walked once: every (name, module) pair, shared modules under each of their
    names, as ``named_modules(remove_duplicate=False)`` gives them; a module's canonical name is its first."""

    def __init__(self, model: nn.Module) -> None:
        self.named = list(model.named_modules(remove_duplicate=False))
        self.canonical: dict[int, str] = {}
        self.modules: dict[str, nn.Module] = {}
        for n, m in self.named:
            if id(m) not in self.canonical:
                self.canonical[id(m)] = n
                self.modules[n] = m

    def named_params(self) -> list[tuple[str, str, nn.Parameter]]:
        """(module name, param name, param) for every registration, as named_parameters(remove_duplicate=False)."""
        return [(mname, k, p) for mname, m in self.named for k, p in m._parameters.items() if p is not None]


def model_fingerprint(model: nn.Module, walk: ModuleWalk | None = None) -> str:
    """Stable digest of parameter names, shapes and dtypes: identifies 'the same model' across runs."""
    h = hashlib.sha256()
    for mname, pname, p in (walk or ModuleWalk(model)).named_params():
        h.update(f"{mname}.{pname}:{tuple(p.shape)}:{p.dtype}\n".encode() if mname
                 else f"{pname}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()[:16]


def collect_params(walk: ModuleWalk) -> tuple[list[ParamInfo], list[nn.Parameter]]:
    """Unique parameters in registration order, with their other names and owner modules (canonical names)."""
    names: dict[int, list[str]] = {}
    objs: dict[int, nn.Parameter] = {}
    owners: dict[int, dict[str, None]] = {}
    for mname, mod in walk.named:
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            names.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
            objs[id(p)] = p
            owners.setdefault(id(p), {})[walk.canonical[id(mod)]] = None
    dtypes: dict[torch.dtype, tuple[str, int]] = {}
    infos = []
    for pid, ns in names.items():
        p = objs[pid]
        if p.dtype not in dtypes:
            dtypes[p.dtype] = (str(p.dtype).removeprefix("torch."), p.element_size())
        dtype, itemsize = dtypes[p.dtype]
        infos.append(ParamInfo(fqn=ns[0], numel=p.numel(), dtype=dtype, itemsize=itemsize,
                               requires_grad=p.requires_grad, owners=tuple(owners[pid]),
                               aliases=tuple(dict.fromkeys(ns[1:])) if len(ns) > 1 else (), shape=tuple(p.shape)))
    return infos, [objs[pid] for pid in names]


@dataclass(frozen=True)
class TracedModel:
    """What every pass of a trace shares: the walk, the params (as recorded and as objects) and the fingerprint,
    taken before params are cast to a compute dtype (a trace records their own dtypes)."""

    walk: ModuleWalk
    params: list[ParamInfo]
    param_objs: list[nn.Parameter]
    fingerprint: str

    @classmethod
    def of(cls, model: nn.Module) -> TracedModel:
        walk = ModuleWalk(model)
        params, param_objs = collect_params(walk)
        return cls(walk, params, param_objs, model_fingerprint(model, walk))
