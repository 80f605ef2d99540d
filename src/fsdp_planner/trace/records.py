"""What a trace knows about a model: its params, its modules and the events of one training step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.index import TraceIndex
from fsdp_planner.trace.tree import depth


@dataclass(frozen=True)
class ParamInfo:
    """One ``nn.Parameter`` (tied aliases share one entry)."""

    fqn: str  # canonical name: the first in named_parameters() order
    numel: int
    dtype: str
    itemsize: int
    requires_grad: bool
    owners: tuple[str, ...]  # canonical names of the modules registering it directly; more than one: tied
    aliases: tuple[str, ...] = ()  # its other names
    shape: tuple[int, ...] = ()
    gets_grad: bool = True  # autograd gave it a gradient in the traced step (FSDP2 reduce-scatters only those)

    def padded_numel(self, world_size: int) -> int:
        """Numel after FSDP2 pads dim 0 to a multiple of the world size (its all-gather size)."""
        if not self.shape:
            return self.numel if world_size == 1 else world_size
        rest = self.numel // self.shape[0] if self.shape[0] else 0
        return -(-self.shape[0] // world_size) * world_size * rest

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_shared(self) -> bool:
        return len(self.owners) > 1


@dataclass(frozen=True)
class ModuleInfo:
    """One module object of the model, under its canonical name. FLOPs include its subtree's (by name)."""

    fqn: str
    cls: str
    params: tuple[str, ...]  # canonical names of the params registered directly on it
    children: tuple[str, ...] = ()  # canonical names of its child module objects (a shared child: elsewhere)
    aliases: tuple[str, ...] = ()  # its other names (a module object registered under several parents)
    calls: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    first_use: int = -1  # first forward op run inside its subtree that read a param; -1 if none
    shardable: bool = True  # False: a ModuleList/ModuleDict without its own forward, which fully_shard refuses, or
    # a module managing params whose call modifies its grad-requiring inputs in place, which FSDP2's post-backward
    # function on them makes autograd refuse (see recorder._fsdp2_refuses_inplace)

    @property
    def depth(self) -> int:
        return depth(self.fqn)


@dataclass(frozen=True)
class Trace:
    """One traced training step. Immutable: derived views live in ``index``; measured op times make a new
    Trace (``with_op_seconds``)."""

    params: tuple[ParamInfo, ...]
    modules: Mapping[str, ModuleInfo]  # canonical name -> info, in registration (named_modules) order
    events: tuple[Event, ...]
    fingerprint: str
    buffers_nbytes: int = 0
    op_seconds: tuple[float, ...] | None = None  # measured seconds per event (0 for boundaries), see measure.py
    compute_itemsize: int | None = None  # bytes per element params were cast to for the trace (None: their own)
    method_calls: Mapping[tuple[str, int], str] = field(default_factory=dict)  # (module, call) -> method name: calls
    # of a non-forward method that reads the module's params outside its forward (trace/methods.py); recorded as calls
    # of the module, which FSDP2 hooks only when the plan registers the method (Plan.forward_methods)

    @property
    def forward_methods(self) -> list[tuple[str, str]]:
        """(module, method) pairs the step calls, in call order, each once."""
        return list(dict.fromkeys((m, name) for (m, _), name in self.method_calls.items()))

    @cached_property
    def index(self) -> TraceIndex:
        return TraceIndex(self.params, self.modules, self.events)

    @cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def param(self, fqn: str) -> ParamInfo:
        return self.params[self.index.param_index[fqn]]

    @property
    def fwd_flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind is EventKind.OP and not e.backward)

    @property
    def bwd_flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind is EventKind.OP and e.backward)

    def with_op_seconds(self, seconds: tuple[float, ...]) -> Trace:
        if len(seconds) != len(self.events):
            raise ValueError(f"got {len(seconds)} op times for a trace of {len(self.events)} events")
        return replace(self, op_seconds=tuple(seconds))
