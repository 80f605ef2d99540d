"""Trace one training step (forward + backward) without real memory.

The trace is the planner's only view of the model: which parameters every op touches, in what order,
inside which module call, with FLOPs, bytes moved and activation bytes saved for backward. It also records
the module-boundary events that FSDP2 hooks on (pre/post-forward, pre/post-backward), so that
``schedule.py`` can replay FSDP2's exact unshard/reshard/reduce-scatter decisions for any plan.

Parameter uses are caught with a dispatch mode on op inputs (by identity and by storage, so views such as
``weight.t()`` saved for backward count too); module hooks alone would miss tied weights and parameters used
outside their own module.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

ROOT = ""

# Event kinds, in the order FSDP2 sees them.
FWD_PRE, FWD_POST, BWD_PRE, BWD_POST, OP = "fwd_pre", "fwd_post", "bwd_pre", "bwd_post", "op"


@dataclass(frozen=True)
class ParamInfo:
    """One ``nn.Parameter`` (tied aliases share one entry)."""

    fqn: str
    numel: int
    dtype: str
    itemsize: int
    requires_grad: bool
    owners: tuple[str, ...]  # modules registering it directly; more than one means tied
    aliases: tuple[str, ...] = ()  # other FQNs of the same parameter
    shape: tuple[int, ...] = ()

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


@dataclass
class ModuleInfo:
    """One module of the model; FLOPs are inclusive of its children."""

    fqn: str
    cls: str
    params: tuple[str, ...]  # canonical FQNs of parameters registered directly on it
    calls: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    first_use: int = -1  # first forward op run inside its subtree that read a param; -1 if none

    @property
    def depth(self) -> int:
        return 0 if self.fqn == ROOT else self.fqn.count(".") + 1


@dataclass(frozen=True)
class Event:
    """One step of the timeline: a module boundary or an op."""

    kind: str
    module: str  # boundary: the module; op: the innermost module running
    call: int = 0  # which call of ``module`` (0-based); boundaries only
    params: tuple[int, ...] = ()  # op: indices into Trace.params that it read
    flops: int = 0
    nbytes: int = 0  # op: bytes read + written (for memory-bound ops)
    saved: int = 0  # op (forward): activation bytes it saved for backward
    grad_inputs: bool = True  # fwd_pre: whether any input requires grad (else post-backward runs at the end)
    backward: bool = False


@dataclass
class Trace:
    params: list[ParamInfo]
    modules: dict[str, ModuleInfo]  # in registration (named_modules) order
    events: list[Event]
    fingerprint: str
    buffers_nbytes: int = 0
    op_seconds: list[float] | None = None  # measured seconds per event (0 for boundaries), see measure.py
    _param_index: dict[str, int] = field(default_factory=dict, repr=False)
    _subtree: dict[str, frozenset[str]] | None = field(default=None, repr=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._param_index = {}
        for i, p in enumerate(self.params):
            self._param_index[p.fqn] = i
            for alias in p.aliases:
                self._param_index[alias] = i

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def param(self, fqn: str) -> ParamInfo:
        return self.params[self._param_index[fqn]]

    def param_index(self, fqn: str) -> int:
        return self._param_index[fqn]

    @property
    def fwd_flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind == OP and not e.backward)

    @property
    def bwd_flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind == OP and e.backward)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, once per trace: derived views that planners ask for again and again."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def param_first_use(self) -> dict[int, int]:
        """Index of the first op using each parameter (forward first, then backward-only uses); shared, do not
        mutate."""

        def compute() -> dict[int, int]:
            first: dict[int, int] = {}
            for i, e in enumerate(self.events):
                if e.kind == OP:
                    for p in e.params:
                        first.setdefault(p, i)
            return first

        return self.memo("param_first_use", compute)

    def boundary_events(self) -> list[int]:
        """Indices of the module-boundary events (everything but ops): where FSDP2's hooks run."""
        return self.memo("boundaries", lambda: [i for i, e in enumerate(self.events) if e.kind != OP])

    def subtree_params(self, fqn: str) -> frozenset[str]:
        """Canonical FQNs of all params registered in ``fqn``'s subtree (computed once for all modules)."""
        if self._subtree is None:
            acc: dict[str, set[str]] = {m: set(info.params) for m, info in self.modules.items()}
            for m in sorted(self.modules, key=lambda f: -self.modules[f].depth):
                if m != ROOT:
                    acc[m.rpartition(".")[0]].update(acc[m])
            self._subtree = {m: frozenset(v) for m, v in acc.items()}
        return self._subtree[fqn]

    def owning_modules(self) -> list[str]:
        """Modules that directly register at least one parameter, in registration order."""
        return [m.fqn for m in self.modules.values() if m.params]


def model_fingerprint(model: nn.Module) -> str:
    """Stable digest of parameter names, shapes and dtypes: identifies 'the same model' across runs."""
    h = hashlib.sha256()
    for name, p in model.named_parameters(remove_duplicate=False):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()[:16]


def default_loss(output: Any) -> torch.Tensor:
    """Loss used when none is given: mean of squares of every floating output (non-trivial gradients)."""
    if hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        output = output.logits
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output has no floating-point tensor to build a default loss from")
    loss = tensors[0].float().pow(2).mean()
    for t in tensors[1:]:
        loss = loss + t.float().pow(2).mean()
    return loss


class _PostBackwardMarker(torch.autograd.Function):
    """Identity on a module's grad-requiring inputs; its backward fires when the module's backward is done.

    FSDP2 uses the same construction (RegisterPostBackwardFunction) to run post_backward.
    """

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


class _Recorder(TorchDispatchMode):
    """Records every aten op with the parameters it reads, FLOPs and bytes."""

    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        t = self.tracer
        if t.sync is None:
            out = func(*args, **kwargs)
        else:
            t.sync()
            start = time.perf_counter()
            out = func(*args, **kwargs)
            t.sync()
            t.seconds[len(t.events)] = time.perf_counter() - start
        used: set[int] = set()
        nbytes = 0
        flat_in = tree_flatten((args, kwargs))[0]
        for a in flat_in:
            if isinstance(a, torch.Tensor):
                idx = t.param_by_id.get(id(a))
                if idx is None:
                    idx = t.param_by_storage.get(StorageWeakRef(a.untyped_storage()))
                if idx is not None:
                    used.add(idx)
        is_view = getattr(func, "is_view", False) or func in _NO_TRAFFIC_OPS
        if not is_view:
            for a in flat_in + tree_flatten(out)[0]:
                if isinstance(a, torch.Tensor):
                    nbytes += a.numel() * a.element_size()
        flops = 0
        fn = flop_registry.get(func._overloadpacket)
        if fn is not None:
            flops = int(fn(*args, **kwargs, out_val=out))
        t.record_op(tuple(sorted(used)), flops, nbytes)
        return out


_NO_TRAFFIC_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
}


class _Tracer:
    def __init__(self, model: nn.Module, params: list[ParamInfo], param_objs: list[nn.Parameter]) -> None:
        self.model = model
        self.params = params
        self.param_by_id = {id(p): i for i, p in enumerate(param_objs)}
        self.param_by_storage = {StorageWeakRef(p.untyped_storage()): i for i, p in enumerate(param_objs)}
        self.param_storages = set(self.param_by_storage)
        self.module_fqn = {m: n for n, m in model.named_modules()}  # a module reused under two names: first
        self.events: list[Event] = []
        self.fwd_stack: list[str] = []
        self.bwd_active: list[tuple[str, int]] = []  # (module, call) whose backward is running
        self.bwd_pending_post: set[tuple[str, int]] = set()  # calls that will get a post-backward marker
        self.calls: dict[str, int] = {}
        self.backward = False
        self.saved_storages: set[StorageWeakRef] = set()
        self.last_op_saved = 0
        self.sync: Callable[[], None] | None = None  # set when timing ops: waits for the device
        self.seconds: dict[int, float] = {}  # event index -> measured seconds of that op

    # -- ops ---------------------------------------------------------------------------------------
    def current_module(self) -> str:
        if self.backward:
            return self.bwd_active[-1][0] if self.bwd_active else ROOT
        return self.fwd_stack[-1] if self.fwd_stack else ROOT

    def record_op(self, used: tuple[int, ...], flops: int, nbytes: int) -> None:
        self.events.append(
            Event(OP, self.current_module(), params=used, flops=flops, nbytes=nbytes, backward=self.backward)
        )

    def pack_saved(self, t: torch.Tensor) -> torch.Tensor:
        """Count activation bytes saved for backward, once per storage, excluding parameters."""
        if not self.backward and isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in self.param_storages and ref not in self.saved_storages:
                self.saved_storages.add(ref)
                nbytes = t.untyped_storage().nbytes()
                # attribute to the latest op (the one that saved it)
                for i in range(len(self.events) - 1, -1, -1):
                    e = self.events[i]
                    if e.kind == OP:
                        self.events[i] = Event(
                            OP, e.module, params=e.params, flops=e.flops, nbytes=e.nbytes,
                            saved=e.saved + nbytes, backward=e.backward,
                        )
                        break
        return t

    # -- module hooks ------------------------------------------------------------------------------
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        fqn = self.module_fqn[module]
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        flat, spec = tree_flatten((args, kwargs))
        grad_idx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        has_grad = bool(grad_idx) and torch.is_grad_enabled()
        self.events.append(Event(FWD_PRE, fqn, call=call, grad_inputs=has_grad))
        self.fwd_stack.append(fqn)
        if has_grad:
            key = (fqn, call)
            self.bwd_pending_post.add(key)
            outs = _PostBackwardMarker.apply(lambda: self.post_backward(key), *[flat[i] for i in grad_idx])
            for i, o in zip(grad_idx, outs, strict=True):
                flat[i] = o
            args, kwargs = spec.unflatten(flat)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        fqn = self.module_fqn[module]
        call = self.calls[fqn] - 1
        self.fwd_stack.pop()
        self.events.append(Event(FWD_POST, fqn, call=call))
        if torch.is_grad_enabled():
            fired = [False]
            key = (fqn, call)

            def hook(grad: torch.Tensor) -> None:
                if not fired[0]:
                    fired[0] = True
                    self.pre_backward(key)

            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)

    def pre_backward(self, key: tuple[str, int]) -> None:
        # A module whose backward started earlier and that gets no post-backward marker (no grad inputs)
        # is finished once an unrelated module starts: close it so ops are attributed correctly.
        for k in list(self.bwd_active):
            if k not in self.bwd_pending_post and not _is_ancestor(k[0], key[0]):
                self.bwd_active.remove(k)
                self.events.append(Event(BWD_POST, k[0], call=k[1], backward=True))
        self.bwd_active.append(key)
        self.events.append(Event(BWD_PRE, key[0], call=key[1], backward=True))

    def post_backward(self, key: tuple[str, int]) -> None:
        self.bwd_pending_post.discard(key)
        if key in self.bwd_active:
            self.bwd_active.remove(key)
        self.events.append(Event(BWD_POST, key[0], call=key[1], backward=True))

    def finish_backward(self) -> None:
        for k in reversed(self.bwd_active):
            self.events.append(Event(BWD_POST, k[0], call=k[1], backward=True))
        self.bwd_active.clear()


def _is_ancestor(a: str, b: str) -> bool:
    return a == ROOT or b == a or b.startswith(a + ".")


def collect_params(model: nn.Module) -> tuple[list[ParamInfo], list[nn.Parameter]]:
    """Unique parameters in registration order, with tied aliases and owner modules."""
    by_id: dict[int, list[str]] = {}
    objs: dict[int, nn.Parameter] = {}
    owners: dict[int, list[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{mname}.{pname}" if mname else pname
            by_id.setdefault(id(p), []).append(fqn)
            objs[id(p)] = p
            if mname not in owners.setdefault(id(p), []):
                owners[id(p)].append(mname)
    infos = []
    for pid, names in by_id.items():
        p = objs[pid]
        infos.append(
            ParamInfo(
                fqn=names[0],
                numel=p.numel(),
                dtype=str(p.dtype).removeprefix("torch."),
                itemsize=p.element_size(),
                requires_grad=p.requires_grad,
                owners=tuple(owners[pid]),
                aliases=tuple(names[1:]),
                shape=tuple(p.shape),
            )
        )
    return infos, [objs[pid] for pid in by_id]


def trace(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    measure: bool = False,
) -> Trace:
    """Run one forward + backward of ``model`` on meta/fake tensors and record its execution.

    ``example_inputs`` is a tuple of positional args (a single tensor is accepted too) or a dict of kwargs.
    A model with real (non-meta) parameters is run under FakeTensorMode, so no real memory or compute is used.
    With ``measure=True`` the model runs for real on its device instead and every op is timed
    (``Trace.op_seconds``); ``measure.py`` wraps this with warm-up and repeats.
    """
    params, param_objs = collect_params(model)
    index = {id(p): i for i, p in enumerate(param_objs)}
    modules = {
        fqn: ModuleInfo(
            fqn=fqn,
            cls=type(m).__name__,
            params=tuple(dict.fromkeys(params[index[id(p)]].fqn for p in m.parameters(recurse=False))),
        )
        for fqn, m in model.named_modules()
    }
    args, kwargs = _split_inputs(example_inputs)
    on_meta = all(p.is_meta for p in param_objs) and all(
        t.is_meta for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
    )
    if measure and (on_meta or any(p.is_meta for p in param_objs)):
        raise ValueError("measuring op times needs a model with real (non-meta) parameters and inputs")
    fake_mode = None
    if not on_meta and not measure:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracer = _Tracer(model, params, param_objs)
    if measure:
        tracer.sync = _device_sync(param_objs)
    if fake_mode is not None:
        for i, p in enumerate(param_objs):
            fp = fake_mode.from_tensor(p)
            tracer.param_by_storage[StorageWeakRef(fp.untyped_storage())] = i
            tracer.param_storages.add(StorageWeakRef(fp.untyped_storage()))
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(tracer.pre_forward, with_kwargs=True))
        handles.append(m.register_forward_hook(tracer.post_forward, always_call=True))
    loss_fn = loss_fn or default_loss
    try:
        with fake_mode or contextlib.nullcontext(), _Recorder(tracer), torch.autograd.graph.saved_tensors_hooks(
            tracer.pack_saved, lambda t: t
        ):
            output = model(*args, **kwargs)
            loss = loss_fn(output)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor")
            tracer.backward = True
            loss.backward()
            tracer.finish_backward()
    finally:
        for h in handles:
            h.remove()
        for p in param_objs:
            p.grad = None
    events = tracer.events
    _fill_module_stats(modules, events, tracer.calls, params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    seconds = [tracer.seconds.get(i, 0.0) for i in range(len(events))] if measure else None
    return Trace(params=params, modules=modules, events=events, fingerprint=model_fingerprint(model),
                 buffers_nbytes=buffers, op_seconds=seconds)


def _device_sync(param_objs: list[nn.Parameter]) -> Callable[[], None]:
    """A barrier for timing: CUDA kernels run asynchronously, CPU ops do not."""
    if any(p.is_cuda for p in param_objs):
        return torch.cuda.synchronize
    return lambda: None


def _fill_module_stats(
    modules: dict[str, ModuleInfo], events: list[Event], calls: dict[str, int], params: list[ParamInfo]
) -> None:
    for fqn, n in calls.items():
        if fqn in modules:
            modules[fqn].calls = n
    for e in events:
        if e.kind != OP:
            continue
        fqn = e.module
        while True:
            m = modules.get(fqn)
            if m is not None:
                if e.backward:
                    m.bwd_flops += e.flops
                else:
                    m.fwd_flops += e.flops
            if fqn == ROOT:
                break
            fqn = fqn.rpartition(".")[0]
    for i, e in enumerate(events):  # first op run inside each module's subtree that read a param
        if e.kind != OP or not e.params or e.backward:
            continue
        fqn = e.module
        while True:
            m = modules.get(fqn)
            if m is not None:
                if m.first_use >= 0:
                    break
                m.first_use = i
            if fqn == ROOT:
                break
            fqn = fqn.rpartition(".")[0]


def compact(trace: Trace, times: list[float]) -> tuple[Trace, list[float]]:
    """The same step in fewer events, for planners that simulate many plans: within one module call (no
    boundary in between), an op merges into the op before it when it reads no params, or when both read only
    params registered directly on that module (FLOPs, bytes, saved bytes, params and ``times`` combined).

    Simulation results are unchanged: a module's direct params always share one FSDP group, so after the first
    op reading them no later op of the run can wait; param-free ops never wait; FSDP2's hooks, activation frees
    and grad readiness all sit at module boundaries.
    """
    direct = {f: {trace.param_index(p) for p in m.params} for f, m in trace.modules.items()}
    events: list[Event] = []
    out_times: list[float] = []
    for e, t in zip(trace.events, times, strict=True):
        prev = events[-1] if events else None
        if (prev is not None and e.kind == OP and prev.kind == OP and e.module == prev.module
                and e.backward == prev.backward
                and (not e.params or (prev.params and direct[e.module].issuperset(e.params + prev.params)))):
            params = tuple(sorted(set(prev.params) | set(e.params)))
            events[-1] = Event(OP, e.module, params=params, flops=prev.flops + e.flops,
                               nbytes=prev.nbytes + e.nbytes, saved=prev.saved + e.saved, backward=e.backward)
            out_times[-1] += t
        else:
            events.append(e)
            out_times.append(t)
    modules = {f: ModuleInfo(f, m.cls, m.params) for f, m in trace.modules.items()}
    _fill_module_stats(modules, events, {f: m.calls for f, m in trace.modules.items()}, trace.params)
    small = Trace(params=trace.params, modules=modules, events=events, fingerprint=trace.fingerprint,
                  buffers_nbytes=trace.buffers_nbytes)
    return small, out_times


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


__all__: Sequence[str] = ["Event", "ModuleInfo", "ParamInfo", "Trace", "compact", "default_loss", "trace"]
