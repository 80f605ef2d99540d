"""Trace one training step (forward + backward) without real memory.

The trace is the planner's only view of the model: which params every op reads, in what order, inside which
module call, with FLOPs, bytes moved and activation bytes saved for backward. It also records the module
boundaries FSDP2 hooks on (pre/post-forward, pre/post-backward), so that ``fsdp2/replay.py`` can replay FSDP2's
unshard / reshard / reduce-scatter decisions for any plan.

Param reads are caught by a dispatch mode on op inputs (by identity and by storage, so views such as
``weight.t()`` saved for backward count too); module hooks alone would miss tied weights and params read outside
their own module. Post-backward is found the way FSDP2 finds it: an identity autograd function on the module's
grad-requiring inputs (FSDP2's ``RegisterPostBackwardFunction``) whose backward runs once their grads are ready.

In-place ops (``nn.ReLU(inplace=True)``, ``out += identity``) run on what that identity returns as they run on the
call's inputs: it returns aliases that autograd does not treat as views (see ``_PostBackwardMarker``). A call that
modifies its own grad-requiring inputs in place is recorded, since FSDP2's function on them would refuse it
(``ModuleInfo.shardable``). Tensors saved for backward are checked as autograd checks them without hooks: one
modified in place after it was saved fails the trace as it fails the real step.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp._common_utils import collect_grad_tensors, replace_grad_tensors
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from fsdp_planner.attention import GpuAttention
from fsdp_planner.batch import paused_gc
from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.methods import MethodFinder, forward_methods
from fsdp_planner.trace.records import ModuleInfo, ParamInfo, Trace
from fsdp_planner.trace.tree import ROOT, is_within, parent_of

Call = tuple[str, int]

# Ops that move no data: their inputs and outputs are not counted as traffic.
_NO_TRAFFIC_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
}


_ATOMS = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def flat_leaves(args: tuple | list, kwargs: dict | None = None) -> list:
    """The leaves ``tree_flatten((args, kwargs))`` gives, fast for the flat argument lists of ops and most module
    calls (order kept; anything nested deeper than one list falls back to pytree)."""
    out: list = []
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(a, _ATOMS):
            out.append(a)
        elif type(a) in (list, tuple) and all(isinstance(b, _ATOMS) for b in a):
            out.extend(a)
        else:
            return tree_flatten((args, kwargs or {}))[0]
    return out


class StepRecorder:
    """The trace's state machine: turns hook and dispatch callbacks into events."""

    def __init__(self, static_storages: set[StorageWeakRef]) -> None:
        self.events: list[Event] = []
        self.static_storages = static_storages  # params' and buffers': what they save or take is not activations
        self.input_storages: set[StorageWeakRef] = set()  # storages some call's inputs_nbytes already counts
        self.fwd_stack: list[str] = []
        self.bwd_active: list[Call] = []  # module calls whose backward is running
        self.bwd_pending_post: set[Call] = set()  # calls that will get a post-backward marker
        self.calls: dict[str, int] = {}
        self.backward = False
        self.saved_storages: set[StorageWeakRef] = set()
        self.last_op = -1
        self.grads: set[int] = set()  # params whose grads replayed calls produced (see reuse.py)
        self.bwd_started = False  # a module's pre-backward has run
        self.loss = LossRegion()
        self.modified_inputs: set[str] = set()  # modules a call of which modified its grad-requiring inputs in place
        self.methods: MethodFinder | None = None  # set on the step's recorder: finds non-forward methods reading params
        self.method_calls: dict[Call, str] = {}  # module calls that were a wrapped non-forward method (methods.py)

    def current_module(self) -> str:
        if self.backward:
            return self.bwd_active[-1][0] if self.bwd_active else ROOT
        return self.fwd_stack[-1] if self.fwd_stack else ROOT

    def op(self, params: tuple[int, ...], flops: int, nbytes: int, live: int = 0) -> None:
        self.last_op = len(self.events)
        self.events.append(Event(EventKind.OP, self.current_module(), params=params, flops=flops, nbytes=nbytes,
                                 backward=self.backward, live=live))

    def outside_modules(self) -> bool:
        """Whether an op now runs outside every module call: the loss, or its backward before the model's."""
        return not self.fwd_stack and not self.bwd_active and not (self.backward and self.bwd_started)

    def ops(self, batch: list[tuple[tuple[int, ...], int, int]]) -> None:
        """Several ops in a row in the same module (replayed calls): (params, flops, bytes) each."""
        module, backward = self.current_module(), self.backward
        self.events.extend([Event(EventKind.OP, module, 0, params, flops, nbytes, 0, True, backward)
                            for params, flops, nbytes in batch])
        self.last_op = len(self.events) - 1

    def save(self, ref: StorageWeakRef, nbytes: int) -> None:
        """Activation bytes saved for backward, once per storage, charged to the op that saved them."""
        if self.backward or ref in self.static_storages or ref in self.saved_storages:
            return
        self.saved_storages.add(ref)
        if self.last_op < 0:  # saved before any op ran (an input): seen, not charged
            return
        e = self.events[self.last_op]
        self.events[self.last_op] = e._replace(saved=e.saved + nbytes)

    def inputs_nbytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of the storages of a call's tensor inputs that no earlier call counted (params excluded)."""
        nbytes = 0
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in self.static_storages and ref not in self.input_storages:
                self.input_storages.add(ref)
                nbytes += t.untyped_storage().nbytes()
        return nbytes

    def enter_forward(self, fqn: str, grad_inputs: bool, inputs_nbytes: int = 0) -> int:
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        self.events.append(Event(EventKind.FWD_PRE, fqn, call=call, grad_inputs=grad_inputs,
                                 inputs_nbytes=inputs_nbytes))
        self.fwd_stack.append(fqn)
        if grad_inputs:
            self.bwd_pending_post.add((fqn, call))
        return call

    def modified_input(self, fqn: str) -> None:
        """A call of ``fqn`` (now ending) modified one of its grad-requiring inputs in place."""
        self.modified_inputs.add(fqn)

    def exit_forward(self, fqn: str) -> int:
        call = self.calls[fqn] - 1
        self.fwd_stack.pop()
        self.events.append(Event(EventKind.FWD_POST, fqn, call=call))
        return call

    def enter_backward(self, key: Call) -> None:
        # A module whose backward started earlier and that gets no post-backward marker (no grad inputs) is
        # finished once an unrelated module starts: close it so ops are attributed correctly.
        for k in list(self.bwd_active):
            if k not in self.bwd_pending_post and not is_within(key[0], k[0]):
                self.bwd_active.remove(k)
                self.events.append(Event(EventKind.BWD_POST, k[0], call=k[1], backward=True))
        self.bwd_active.append(key)
        self.bwd_started = True
        self.events.append(Event(EventKind.BWD_PRE, key[0], call=key[1], backward=True))

    def exit_backward(self, key: Call) -> None:
        self.bwd_pending_post.discard(key)
        if key in self.bwd_active:
            self.bwd_active.remove(key)
        self.events.append(Event(EventKind.BWD_POST, key[0], call=key[1], backward=True))

    def outputs(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """The grad-requiring outputs of the module call that just ended (templates compare them, see reuse.py)."""

    def finish_backward(self) -> None:
        for k in reversed(self.bwd_active):
            self.events.append(Event(EventKind.BWD_POST, k[0], call=k[1], backward=True))
        self.bwd_active.clear()


class LossRegion:
    """Live bytes of the tensors the loss works on, outside the model: its outputs and what the loss's ops and
    their backward make, counted from the model's last output until backward reaches a module. A saved-tensor
    view misses most of it (a language model's logits in bf16 and fp32, the loss's gradient), and at the loss
    it is often the step's peak. Freed storages are seen through weak references, as ``fake_world.LiveBytes``
    counts."""

    def __init__(self) -> None:
        self.current = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.current += self._sizes[key]
                    self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)


class NullRecorder(StepRecorder):
    """Records nothing: the target while the tracer makes tensors of its own (templates' inputs and grads)."""

    def __init__(self) -> None:
        super().__init__(set())

    def op(self, params: tuple[int, ...], flops: int, nbytes: int, live: int = 0) -> None:
        pass

    def outside_modules(self) -> bool:
        return False

    def save(self, ref: StorageWeakRef, nbytes: int) -> None:
        pass

    def modified_input(self, fqn: str) -> None:
        pass

    def inputs_nbytes(self, tensors: list[torch.Tensor]) -> int:
        return 0


NULL = NullRecorder()


class Slot:
    """Where the hooks, the dispatch mode and the saved-tensor hook send what they see: the step's recorder,
    or (while a repeated module is traced once on its own, see ``reuse.py``) something else."""

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder
        self.produced: set[StorageWeakRef] | None = None  # when set: storages of every op's outputs are added


class _PostBackwardMarker(torch.autograd.Function):
    """Identity on a module's grad-requiring inputs; its backward fires when the module's backward is done
    (FSDP2's RegisterPostBackwardFunction).

    It returns ``t.detach()``, not ``t`` or ``t.view_as(t)``: autograd turns an input returned as-is into a view
    of it, and a view made inside a custom Function may not be modified in place ("Output 0 of
    _PostBackwardMarker is a view and is being modified inplace"), so every module fed by an in-place op's target
    (``nn.ReLU(inplace=True)`` after a BatchNorm, ``F.relu(x, inplace=True)`` or ``x += y`` on a module's input)
    failed to trace. A detached alias is no autograd view: autograd attaches it to this function as a new output,
    and an in-place op on it is recorded on it like on any non-leaf (ReluBackward -> this backward -> the
    producer's). It is the same storage, offset, strides and version counter as ``t``: no memory is made (saved
    activations and call inputs are counted by storage, so they count the same bytes), the op writes the caller's
    tensor as without the tracer, and a saved tensor it modifies is still caught by its version.
    """

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


class _ModuleHooks:
    """Forward hooks on every module, feeding boundary events to a recorder."""

    def __init__(self, walk: ModuleWalk, slot: Slot) -> None:
        self.slot = slot
        self.name = {m: n for n, m in walk.modules.items()}  # a module registered twice keeps its first name
        # per running call (pushed by pre_forward, popped by post_forward): its marked inputs and their versions
        self.watched: list[tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None] = []
        self.handles = []
        for m in walk.modules.values():
            self.handles.append(m.register_forward_pre_hook(self.pre_forward, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self.post_forward, always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """FSDP2's post-backward hook goes on the call's grad-requiring inputs, found as FSDP2 finds them
        (``collect_grad_tensors``: tuples, lists, dicts, NamedTuples and dataclasses)."""
        fqn = self.name[module]
        recorder = self.slot.recorder
        flat = not kwargs and all(isinstance(a, _ATOMS) for a in args)  # the common case, without a traversal
        leaves = args if flat else flat_leaves(args, kwargs)
        held = recorder.inputs_nbytes([a for a in leaves if isinstance(a, torch.Tensor)])
        if not torch.is_grad_enabled():
            inputs: tuple[torch.Tensor, ...] = ()
        elif flat:
            inputs = tuple(a for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
        else:
            inputs = collect_grad_tensors((args, kwargs))
        call = recorder.enter_forward(fqn, bool(inputs), held)
        if not inputs:
            self.watched.append(None)
        else:
            key = (fqn, call)
            marked = _PostBackwardMarker.apply(lambda: recorder.exit_backward(key), *inputs)
            self.watched.append((marked, tuple(t._version for t in marked)))
            outs = iter(marked)
            if flat:
                args = tuple(next(outs) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
            else:
                args, kwargs = replace_grad_tensors((args, kwargs), outs)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """FSDP2's pre-backward hook goes on the call's grad-requiring outputs (``collect_grad_tensors``)."""
        fqn = self.name[module]
        recorder = self.slot.recorder
        watched = self.watched.pop() if self.watched else None
        if watched is not None and any(t._version != v for t, v in zip(*watched, strict=True)):
            # an in-place op wrote the call's input (an alias sharing its version counter); with FSDP2's
            # function on these inputs, autograd would have refused it
            recorder.modified_input(fqn)
        call = recorder.exit_forward(fqn)
        if recorder.outside_modules():  # the model's own outputs: what the loss starts from
            recorder.loss.track(flat_leaves((output,)))
        if torch.is_grad_enabled():
            fired = [False]
            key = (fqn, call)

            def hook(grad: torch.Tensor) -> None:  # FSDP2's pre-backward: the first output grad of this call
                if not fired[0]:
                    fired[0] = True
                    recorder.enter_backward(key)

            outputs = ((output,) if output.requires_grad else ()) if isinstance(output, torch.Tensor) \
                else collect_grad_tensors(output)
            recorder.outputs(outputs)
            for t in outputs:
                t.register_hook(hook)


class _OpRecorder(TorchDispatchMode):
    """Records every aten op with the params it reads, its FLOPs and bytes (and, when measuring, its time)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless a mode opts out; the wrapper
        # costs ~60 us an op (70 vs 9 us measured on torch 2.13), and a trace never runs under torch.compile.
        return False

    def __init__(self, slot: Slot, param_by_id: dict[int, int],
                 param_by_storage: dict[StorageWeakRef, int], sync: Callable[[], None] | None) -> None:
        super().__init__()
        self.slot = slot
        self.param_by_id, self.param_by_storage = param_by_id, param_by_storage
        self.sync = sync  # set when timing ops: waits for the device
        self.seconds: dict[int, float] = {}  # event index -> measured seconds of that op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if type(self.slot.recorder) is NullRecorder or func.namespace == "prim":
            # the tracer's own tensors (replayed calls), or a metadata query (prim.device on a fake tensor): no op
            return func(*args, **kwargs)
        if self.sync is None:
            out = func(*args, **kwargs)
        else:
            self.sync()
            start = time.perf_counter()
            out = func(*args, **kwargs)
            self.sync()
            self.seconds[len(self.slot.recorder.events)] = time.perf_counter() - start
        flat_in = flat_leaves(args, kwargs)
        flat_out = flat_leaves((out,))
        if self.slot.produced is not None:
            self.slot.produced.update(StorageWeakRef(t.untyped_storage()) for t in flat_out
                                      if isinstance(t, torch.Tensor))
        used: set[int] = set()
        for a in flat_in:
            if isinstance(a, torch.Tensor):
                idx = self.param_by_id.get(id(a))
                if idx is None:
                    idx = self.param_by_storage.get(StorageWeakRef(a.untyped_storage()))
                if idx is not None:
                    used.add(idx)
        nbytes = 0
        if not (getattr(func, "is_view", False) or func in _NO_TRAFFIC_OPS):
            for a in flat_in + flat_out:
                if isinstance(a, torch.Tensor):
                    nbytes += a.numel() * a.element_size()
        fn = flop_registry.get(func._overloadpacket)
        flops = int(fn(*args, **kwargs, out_val=out)) if fn is not None else 0
        recorder = self.slot.recorder
        if used and recorder.methods is not None and not recorder.backward:
            recorder.methods.check(tuple(used), recorder.fwd_stack)
        live = 0
        if recorder.outside_modules():
            recorder.loss.track(flat_out)
            live = recorder.loss.current
        recorder.op(tuple(sorted(used)), flops, nbytes, live)
        return out


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


def _module_infos(walk: ModuleWalk, params: list[ParamInfo], param_objs: list[nn.Parameter],
                  events: list[Event], calls: dict[str, int],
                  modified_inputs: set[str] | None = None) -> dict[str, ModuleInfo]:
    """One ModuleInfo per module object, with its real children and the stats of its calls (``modified_inputs``:
    modules a call of which modified its grad-requiring inputs in place)."""
    aliases: dict[str, list[str]] = {}
    for n, m in walk.named:
        if n != walk.canonical[id(m)]:
            aliases.setdefault(walk.canonical[id(m)], []).append(n)
    pname = {id(p): params[i].fqn for i, p in enumerate(param_objs)}
    fwd, bwd, first = _module_stats(events)
    modified_inputs = modified_inputs or set()
    return {
        fqn: ModuleInfo(
            fqn=fqn, cls=type(m).__name__,
            params=tuple(dict.fromkeys(pname[id(p)] for p in m._parameters.values() if p is not None)),
            children=tuple(dict.fromkeys(walk.canonical[id(c)] for c in m._modules.values() if c is not None)),
            aliases=tuple(dict.fromkeys(aliases.get(fqn, ()))),
            calls=calls.get(fqn, 0), fwd_flops=fwd.get(fqn, 0), bwd_flops=bwd.get(fqn, 0), first_use=first.get(fqn, -1),
            shardable=_shardable(m) and not (fqn in modified_inputs and _fsdp2_refuses_inplace(fqn, m)),
        )
        for fqn, m in walk.modules.items()
    }


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


def trace(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    measure: bool = False,
    reuse: bool = True,
    compute_dtype: torch.dtype | None = None,
) -> Trace:
    """Run one forward + backward of ``model`` on meta/fake tensors and record its execution.

    ``example_inputs`` is a tuple of positional args (a single tensor is accepted too) or a dict of kwargs.
    A model with real (non-meta) parameters is run under FakeTensorMode, so no real memory or compute is used.
    With ``measure=True`` the model runs for real on its device instead and every op is timed
    (``Trace.op_seconds``); ``runtime/measure.py`` wraps this with warm-up and repeats. With ``reuse`` (not when
    measuring) a repeated module is traced once and its events replayed for identical calls (``reuse.py``).

    ``compute_dtype`` runs the step the way FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does: floating
    params (not buffers) and the floating inputs cast to it, so what the model upcasts (a norm computing in fp32,
    a loss on ``.float()`` logits) is recorded at its real size. Params are recorded with their own dtypes and
    restored after.
    """
    if measure and compute_dtype is not None:
        raise ValueError("a measured trace runs the model as it is: no compute_dtype")
    with paused_gc():
        return _trace(model, example_inputs, loss_fn, measure, reuse, compute_dtype)


@contextlib.contextmanager
def _params_cast(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Floating params' data cast to ``dtype`` (same Parameter objects), put back on exit."""
    if dtype is None:
        yield
        return
    originals = [(p, p.data) for p in dict.fromkeys(model.parameters())
                 if p.is_floating_point() and p.dtype != dtype]
    try:
        for p, data in originals:
            p.data = data.to(dtype)
        yield
    finally:
        for p, data in originals:
            p.data = data


def _trace(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None, measure: bool,
           reuse: bool, compute_dtype: torch.dtype | None) -> Trace:
    walk = ModuleWalk(model)
    params, param_objs = collect_params(walk)
    fingerprint = model_fingerprint(model, walk)  # of the params' own dtypes, before the cast
    methods: dict[str, str] = {}
    with _params_cast(model, compute_dtype):
        # a non-forward method found reading params is wrapped and the step traced again (methods.py); a wrapped
        # method may reveal another (one it calls on a child), so up to a few passes
        for _ in range(_METHOD_PASSES):
            finder = MethodFinder(walk.modules, params)
            tr = _trace_cast(model, walk, params, param_objs, fingerprint, example_inputs, loss_fn, measure, reuse,
                             compute_dtype, methods, finder)
            new = {m: name for m, name in finder.found.items() if m not in methods}
            if not new:
                return tr
            methods |= new
    return tr


_METHOD_PASSES = 4


def _trace_cast(model: nn.Module, walk: ModuleWalk, params: list[ParamInfo], param_objs: list[nn.Parameter],
                fingerprint: str, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                measure: bool, reuse: bool, compute_dtype: torch.dtype | None, methods: dict[str, str],
                finder: MethodFinder) -> Trace:
    from fsdp_planner.trace.reuse import BlockReuse

    args, kwargs = split_inputs(example_inputs)
    if compute_dtype is not None:  # FSDP2's root casts floating forward inputs (cast_forward_inputs=True)
        args, kwargs = tree_map(
            lambda t: t.to(compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            (args, kwargs))
    on_meta = all(p.is_meta for p in param_objs) and all(
        t.is_meta for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    if measure and (on_meta or any(p.is_meta for p in param_objs)):
        raise ValueError("measuring op times needs a model with real (non-meta) parameters and inputs")
    fake_mode = None
    if not on_meta and not measure:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    by_storage = {StorageWeakRef(p.untyped_storage()): i for i, p in enumerate(param_objs)}
    if fake_mode is not None:
        for i, p in enumerate(param_objs):
            by_storage[StorageWeakRef(fake_mode.from_tensor(p).untyped_storage())] = i
    buffer_objs = list({id(b): b for m in walk.modules.values() for b in m._buffers.values() if b is not None}.values())
    buffer_storages = {StorageWeakRef(b.untyped_storage()) for b in buffer_objs}
    if fake_mode is not None:
        buffer_storages |= {StorageWeakRef(fake_mode.from_tensor(b).untyped_storage()) for b in buffer_objs}
    recorder = StepRecorder(set(by_storage) | buffer_storages)
    recorder.methods = finder
    slot = Slot(recorder)
    param_by_id = {id(p): i for i, p in enumerate(param_objs)}
    ops = _OpRecorder(slot, param_by_id, by_storage, _device_sync(param_objs) if measure else None)
    hooks: list[_ModuleHooks] = []
    wrapped = forward_methods(walk.modules, methods, lambda: hooks[0], slot)
    wrapped.__enter__()  # before BlockReuse: a module with a wrapped method is no template (its attributes differ)
    repeated = BlockReuse(model, walk, slot, param_by_id, set(by_storage)) if reuse and not measure else None
    hooks.append(_ModuleHooks(walk, slot))  # after BlockReuse's: its hooks must run first

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        slot.recorder.save(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        return t, t._version

    def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        # Autograd skips its own version check on tensors that saved-tensor hooks pack: done here, as it does it
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.dtype} {list(t.shape)}] is at version {t._version}; expected version {version} instead (the "
                f"model's backward fails the same way without the tracer)")
        return t

    leaf_inputs = [t for t in flat_leaves(args, kwargs) if isinstance(t, torch.Tensor) and t.is_leaf
                   and t.requires_grad and t.grad is None]  # their grads are the trace's doing: undone after
    try:
        with fake_mode or contextlib.nullcontext(), GpuAttention(), ops, \
                torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = (loss_fn or default_loss)(model(*args, **kwargs))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor")
            recorder.backward = True
            loss.backward()
            recorder.finish_backward()
            got_grad = {i for i, p in enumerate(param_objs) if p.grad is not None} | recorder.grads
    finally:
        hooks[0].remove()
        if repeated is not None:
            repeated.remove()
        wrapped.__exit__(None, None, None)
        for t in [*param_objs, *leaf_inputs]:
            t.grad = None
    events = recorder.events
    seconds = tuple(ops.seconds.get(i, 0.0) for i in range(len(events))) if measure else None
    params = [p if i in got_grad else replace(p, gets_grad=False) for i, p in enumerate(params)]
    return Trace(params=tuple(params), modules=_module_infos(walk, params, param_objs, events, recorder.calls,
                                                             recorder.modified_inputs),
                 events=tuple(events), fingerprint=fingerprint, method_calls=dict(recorder.method_calls),
                 compute_itemsize=None if compute_dtype is None else compute_dtype.itemsize,
                 buffers_nbytes=sum(b.numel() * b.element_size() for b in buffer_objs), op_seconds=seconds)


def _device_sync(param_objs: list[nn.Parameter]) -> Callable[[], None]:
    """A barrier for timing: CUDA kernels run asynchronously, CPU ops do not."""
    if any(p.is_cuda for p in param_objs):
        return torch.cuda.synchronize
    return lambda: None


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """A factory's example inputs as ``model(*args, **kwargs)`` takes them: a dict is kwargs, a tuple or list
    positional args, anything else the one positional arg."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}
