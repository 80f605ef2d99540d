"""Trace a repeated module once, then replay its events for every identical call.

Most of a trace's time is running ops on meta tensors (many meta kernels are Python), and a model with 1,000
identical blocks runs the same ops 1,000 times. Here a module call whose result is determined by things the
tracer can compare is traced once, on its own (a *template*), and every identical call, the first included, is
replaced by a stand-in autograd function whose forward and backward feed the template's callbacks, renamed, into
the step's recorder. The recorder's state machine runs on them exactly as on a real call.

Why the events are the same as tracing the call: a module's forward runs the same ops when its code, its state and
its arguments are the same, so calls are grouped by
- a static signature, computed once per module: its class and its children's, recursively; param and buffer
  shapes, dtypes and requires_grad; every other attribute (numbers, strings, tuples of them, dtypes, enums, tensor
  metadata; any other object by identity); and no hooks but the tracer's;
- the call's arguments: every tensor's shape, strides, storage size and offset, dtype, device and requires_grad,
  and every other argument's value (only numbers, strings, None and tuples of them qualify); grad mode on,
  autocast off.
Inside one call of such a module autograd runs its backward nodes contiguously (outside nodes created later have
higher sequence numbers and depend on nothing inside; nodes created earlier wait for the call's input grads), so
its backward callbacks are replayed where the stand-in's backward runs, except the pre-backwards of inner calls
whose output the call returns as its own (a Sequential's last child's): their hooks are on that tensor, before the
module's, so a replay fires them from a hook it puts on its output first. A template is not used (the call is traced
normally) when its module or one below it was called before, when it reads a param outside its subtree or a module
held elsewhere, modifies an input in place, returns a view, an alias or a non-constant non-tensor, or saves for
backward a tensor that is neither an input, a buffer, nor made by its own ops. ``trace(reuse=False)`` turns it off;
a test traces every built-in model both ways and compares the events.
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import TreeSpec, tree_flatten

from fsdp_planner.routing import StandIn as Routing
from fsdp_planner.trace.bookkeeping import bookkeeping
from fsdp_planner.trace.events import OpClass
from fsdp_planner.trace.saved import foreign_saved_hooks
from fsdp_planner.trace.step import NULL, Call, KeptInputs, Slot, StepRecorder
from fsdp_planner.trace.tree import is_within
from fsdp_planner.trace.walk import ModuleWalk

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
_STRUCTURE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_is_full_backward_hook")
_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_LEAVES = (torch.Tensor, *_CONSTANTS)
# the call that took a replayed call's outputs as its input (an in-place ReLU's result): one inside it, which has
# returned, as the traced call's had (``StepRecorder.call_inputs``)
REPLAYED = "\0replayed"
Structure = Any  # how a call's arguments nest: ("flat", n_args, kwarg names) or a pytree TreeSpec


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, Structure]:
    """A call's arguments as leaves and the structure to rebuild them (fast for flat argument lists)."""
    if all(isinstance(a, _LEAVES) for a in args) and all(isinstance(v, _LEAVES) for v in kwargs.values()):
        return [*args, *kwargs.values()], ("flat", len(args), tuple(kwargs))
    return tree_flatten((args, kwargs))


def unflatten_call(structure: Structure, leaves: list) -> tuple[tuple, dict]:
    if isinstance(structure, tuple):
        _, n, names = structure
        return tuple(leaves[:n]), dict(zip(names, leaves[n:], strict=True))
    return structure.unflatten(leaves)


def freeze(value: Any) -> Any:
    """A hashable stand-in for an attribute value, equal for values that make a forward run the same ops."""
    if isinstance(value, _CONSTANTS):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(freeze(v) for v in value))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type,
                value.requires_grad)
    return ("object", id(value))  # the same object only: its behaviour cannot be compared


_SKIP = frozenset(_HOOK_DICTS + _STRUCTURE)


def static_signatures(model: nn.Module) -> dict[nn.Module, int]:
    """Module -> its static signature (module docstring) as a small int: equal ints, equal signatures. Children
    first; each module's signature holds its children's ints, so none is rehashed."""
    ids: dict[tuple, int] = {}
    out: dict[nn.Module, int] = {}
    global_hooks = any(getattr(nn.modules.module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))

    def sig(m: nn.Module) -> int:
        if m not in out:
            attrs = vars(m)
            if global_hooks or "forward" in attrs or any(attrs.get(h) for h in _HOOK_DICTS):
                out[m] = -len(out) - 1  # unique: never a reuse candidate
                return out[m]
            other = tuple(sorted((k, freeze(v)) for k, v in attrs.items() if k not in _SKIP))
            params = tuple((k, tuple(p.shape), p.dtype, p.requires_grad) if p is not None else (k, None)
                           for k, p in m._parameters.items())
            buffers = tuple((k, tuple(b.shape), b.dtype) if b is not None else (k, None) for k, b in m._buffers.items())
            children = tuple((k, sig(c)) if c is not None else (k, None) for k, c in m._modules.items())
            out[m] = ids.setdefault((type(m), other, params, buffers, children), len(ids))
        return out[m]

    for m in model.modules():
        sig(m)
    return out


@dataclass
class Template:
    """One module call traced on its own: the callbacks it produced, relative to the module."""

    forward: list[tuple] = field(default_factory=list)
    backward: list[tuple] = field(default_factory=list)
    held: int = 0  # its own ``Event.held`` but its outputs' gradients: its frame at its last pack
    rise: int = 0  # its own ``Event.rise``
    excess: int = 0  # its frame's and saves' height less all its saves (``FrameBytes.close``)
    fed_until: int = 0  # its backward ops its output's gradient, fed to it alone, was alive at (``_Feed``)
    outlived: int = 0  # bytes of the gradients its backward made that outlive it (``_record_backward``)
    # the pre-backwards of inner calls whose output is the call's own: they hook that tensor before the module's
    # own hook does, so a replay fires them from a hook on its output, registered before the module's
    on_output: list[tuple] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # relative names of the params its ops read
    grads: list[str] = field(default_factory=list)  # relative names of the params autograd gave a grad
    out_spec: TreeSpec | None = None
    outputs: list[Any] = field(default_factory=list)  # per output leaf: tensor metadata, or ("const", value)
    # outputs whose storage an inner call counted as its input (an in-place ReLU's result): a later call given
    # them counts no new bytes (``StepRecorder.call_inputs``); and whether a param-holding inner call took it (a
    # later call's checkpoint keeps it otherwise)
    counted: list[tuple[int, bool]] = field(default_factory=list)
    # outputs an op a policy can keep made: (output leaf, that op's place among its forward ops), the storage's
    # maker in the step from its replay on (``StepRecorder.makers``)
    made_outputs: list[tuple[int, int]] = field(default_factory=list)
    # what the call told the data-dependent ops' stand-in (routing.py): (op, relative module) it stood in for,
    # and the routing it left (its experts, per-expert rows), which a later call's stand-in reads
    routed: list[tuple[str, str, int]] = field(default_factory=list)  # (op, relative module, times)
    # outputs a topk inside made, (output leaf, relative module: "" its own body): a replay's caller modifying
    # them in place is told as the call's own would be (``Slot.topk_by``)
    topk_outputs: list[tuple[int, str]] = field(default_factory=list)
    routing: tuple[int | None, int] = (None, 1)
    reusable: bool = True
    confirmed: bool = field(default=False, compare=False)  # a second identical call recorded the same


class ActionLog(StepRecorder):
    """Records the callbacks of one isolated call (the StepRecorder interface), relative to module ``prefix``."""

    def __init__(self, prefix: str, param_name: dict[int, str], static_storages: set[StorageWeakRef]) -> None:
        super().__init__(static_storages)
        self.prefix, self.param_name = prefix + ".", param_name
        self.template = Template()
        self.slots: dict[int, int] = {}  # global param index -> index into template.params
        # (position in forward, storage, bytes, whether an attention mask's: ``StepRecorder.save``)
        self.saved: list[tuple[int, StorageWeakRef, int, bool]] = []
        # grad-requiring outputs of the calls inside, held weakly: a strong reference would keep the temporaries
        # of the recorded call alive, which its real call frees (``Event.held``)
        self.inner_outputs: list[tuple[weakref.ref, Call]] = []
        self.hooked: list[Call] = []  # the inner calls that hooked the call's own output, in hook order
        self.last_exit: Call = ("", 0)
        self.forward_ops = 0  # forward ops logged: a maker's place among them (``maker``)

    def current_module(self) -> str:
        """The innermost module call running inside this one, else this one's module: where a failing op ran."""
        return self.fwd_stack[-1] if self.fwd_stack else self.prefix[:-1]

    def relative(self, fqn: str) -> str:
        if not fqn.startswith(self.prefix):
            self.template.reusable = False  # a module held outside the subtree
        return fqn[len(self.prefix):]

    def _log(self, action: tuple) -> None:
        (self.template.backward if self.backward else self.template.forward).append(action)

    def enter_forward(self, fqn: str, grad_inputs: bool, inputs_nbytes: int = 0, kept_inputs: int = 0,
                      made_at: tuple = (), input_dims: int = -1, passed: tuple[int, ...] = ()) -> int:
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        slots = self._slots(passed)
        # (the inputs its checkpoint keeps: storages, turned into sources a replay finds, ``_classify_saves``; and
        # its ``Event.made_at``, every kept input of the call's own among them: the step's batch is none, ``replay``)
        self._log(("fwd_pre", self.relative(fqn), grad_inputs, inputs_nbytes, kept_inputs, tuple(self.kept_next),
                   made_at, input_dims, () if slots is None else slots))
        self.fwd_stack.append(fqn)  # read only by current_module(): where a failing op ran
        self.opened()
        if grad_inputs:
            self.bwd_pending_post.add((fqn, call))
        return call

    def modified_input(self, fqn: str) -> None:
        self._log(("modified_input", self.relative(fqn)))

    def aliased_input(self, fqn: str) -> None:
        self._log(("aliased_input", self.relative(fqn)))

    def modified_output(self, fqns: tuple[str, ...]) -> None:
        # (a module outside the call's subtree: the caller's own, which the step's recorder sees)
        inside = tuple(f[len(self.prefix):] for f in fqns if f.startswith(self.prefix))
        if inside:
            self._log(("modified_output", inside))

    def modified_topk(self, fqn: str) -> None:
        if fqn.startswith(self.prefix) or fqn == self.prefix[:-1]:  # (its own body's topk: "")
            self._log(("modified_topk", fqn[len(self.prefix):]))

    def own_region(self, begin: bool, reentrant: bool = False) -> None:
        self._log(("own_region", begin, reentrant))  # a replay tells the step's recorder where it lies among the calls

    def exit_forward(self, fqn: str, grads_nbytes: int = 0, replayed: tuple[int, int] | None = None) -> int:
        # (what its kept inputs saved: the replay's recorder counts it as it replays the saves)
        held, rise, _ = self.closed(grads_nbytes)
        self._log(("fwd_post", self.relative(fqn), *((held, rise) if replayed is None else replayed)))
        self.fwd_stack.pop()
        self.last_exit = (fqn, self.calls[fqn] - 1)
        return self.last_exit[1]

    def outputs(self, tensors: tuple[torch.Tensor, ...]) -> None:
        # the hooks' post_forward: the call ended
        self.inner_outputs.extend((weakref.ref(t), self.last_exit) for t in tensors)

    def position(self) -> int:
        return len(self.template.backward) if self.backward else len(self.template.forward)

    def enter_backward(self, key: Call) -> None:
        # the calls whose backward runs, as the step's recorder keeps them (``StepRecorder.enter_backward``)
        self.bwd_active = [k for k in self.bwd_active if k in self.bwd_pending_post or is_within(key[0], k[0])]
        self.bwd_active.append(key)
        self._log(("bwd_pre", self.relative(key[0]), key[1]))

    def exit_backward(self, key: Call) -> None:
        self.bwd_pending_post.discard(key)
        if key in self.bwd_active:
            self.bwd_active.remove(key)
        self._log(("bwd_post", self.relative(key[0]), key[1]))

    def saving_call(self) -> Call | None:
        """Relative to the recorded call, whose own name is ""."""
        return (self.relative(self.fwd_stack[-1]), 0) if self.fwd_stack else ("", 0)

    def freed_by(self, owner: Call, nbytes: int) -> None:
        """The last backward op's, with the call that saved them: a replay counts them where that call is the step's
        innermost backward call, as the step's recorder does (``replayed_freed``)."""
        if self.backward and self.last_op >= 0:  # positions in the template's backward log
            a = self.template.backward[self.last_op]
            self.template.backward[self.last_op] = (*a[:-1], (*a[-1], (owner[0], nbytes)))

    def outside_modules(self) -> bool:
        return False  # a template is one module call: nothing in it is outside the model

    def _slots(self, params: tuple[int, ...]) -> tuple[int, ...] | None:
        """``params`` as the template's slots (each param's first read or pass gives it the next); None, and the
        template not reusable, where one is outside the subtree."""
        slots = []
        for p in params:
            if p not in self.param_name:
                self.template.reusable = False  # reads a param outside the subtree
                return None
            if p not in self.slots:
                self.slots[p] = len(self.template.params)
                self.template.params.append(self.param_name[p])
            slots.append(self.slots[p])
        return tuple(slots)

    def op(self, params: tuple[int, ...], flops: int, nbytes: int, live: int = 0,
           op_class: OpClass = OpClass.OTHER, out_nbytes: int = 0, kernel: int = 0, grad_live: int = 0,
           workspace: int = 0, syncs: bool = False) -> None:
        slots = self._slots(params)
        if slots is None:
            return
        self._log(("op", slots, flops, nbytes, op_class, out_nbytes, kernel, syncs, live, workspace, grad_live,
                   ()))
        if not self.backward:
            self.frame.op_done()
            self.forward_ops += 1
        self.last_op = len(self.template.backward) - 1 if self.backward else -1
        self.last_op_module = self.current_module()
        self.new_inputs.clear()

    def maker(self) -> Any:
        """A maker by its place among the call's forward ops (``_replay_actions`` finds its position); the call's own
        inputs are ``("input", i)`` (``BlockReuse._record``)."""
        return ("op", self.forward_ops)

    def pack(self) -> None:
        if not self.backward:
            forward = self.template.forward
            if not (forward and forward[-1] == ("pack",)):
                forward.append(("pack",))  # replayed where it was (``Event.packs``)

    def made_grads(self, made: list[tuple[StorageWeakRef, int]]) -> None:
        if self.backward and self.last_op >= 0:  # positions in the template's backward log
            super().made_grads(made)

    def uncount(self, i: int, nbytes: int) -> None:
        a = self.template.backward[i]  # an op's entry ends with its grad_live and its freed bytes
        if a[0] == "op" and a[-2]:
            self.template.backward[i] = (*a[:-2], max(0, a[-2] - nbytes), a[-1])

    def save(self, ref: StorageWeakRef, nbytes: int, storage: torch.UntypedStorage | None = None,
             mask: bool = False) -> None:
        tracked = self.packed(ref)
        self.pack()
        if self.backward or ref in self.static_storages:
            return
        if ref in self.first_saves:  # saved again: replayed as a save of the same storage (``Event.resaved``)
            self.saved.append((len(self.template.forward), ref, nbytes, mask or ref in self.mask_storages, ()))
            return
        self.first_saves[ref] = (len(self.template.forward), 0)  # (where, in the template: unread)
        self.first_saved(ref, nbytes, tracked)
        self.saved.append((len(self.template.forward), ref, nbytes, mask or ref in self.mask_storages,
                           self.made_at(ref, nbytes)))
        self.watch_saved(storage, nbytes)
        unsaved = self.unsaved(ref)  # as ``StepRecorder.save``: the saving op counted it alive
        last = next((i for i in range(len(self.template.forward) - 1, -1, -1)
                     if self.template.forward[i][0] == "op"), None)
        if unsaved and last is not None:
            a = self.template.forward[last]
            # an op's entry ends (..., live, workspace, grad_live, freed): its live bytes less the saved ones
            self.template.forward[last] = (*a[:-4], max(0, a[-4] - unsaved), *a[-3:])


class _Sink(torch.autograd.Function):
    """Identity whose backward drops the grads: a template's inputs behave like the real call's (aliases made by
    the post-backward marker, which an in-place op may modify; see ``hooks.PostBackwardMarker``), and nothing
    accumulates into them."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return tuple(None for _ in grads)


class _Feed(torch.autograd.Function):
    """Gives a template's outputs their gradients from inside autograd (``feed()`` makes them), so that autograd
    alone holds them: each is freed once its last reader has run, as the step's would be if nothing outside the
    call held it, not held by the recording to its end. Its output, a scalar, is the backward's root."""

    @staticmethod
    def forward(ctx: Any, feed: Callable[[], list[torch.Tensor]], *outputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.feed = feed
        return outputs[0].new_empty(())

    @staticmethod
    def backward(ctx: Any, _: Any) -> Any:  # type: ignore[override]
        return (None, *ctx.feed())


class _StandIn(torch.autograd.Function):
    """Replaces one module call: forward replays the template's forward callbacks and returns fresh outputs;
    backward replays its backward callbacks and returns fresh input grads."""

    @staticmethod
    def forward(ctx: Any, replay: Callable[..., Any], anchor: torch.Tensor,
                *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.replay = replay
        outputs, non_differentiable = replay(False)
        ctx.mark_non_differentiable(*non_differentiable)
        return tuple(outputs)

    @staticmethod
    @bookkeeping
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return (None, None, *ctx.replay(True, grads))


@dataclass
class _Input:
    """What a call's tensor argument must match, and how to make one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage_nbytes: int
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> _Input:
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype,
                   str(t.device), t.requires_grad)

    def key(self) -> tuple:
        return (self.shape, self.stride, self.offset, self.storage_nbytes, self.dtype, self.device, self.requires_grad)

    def make(self) -> torch.Tensor:
        """A new tensor with this metadata and a storage of this size (no autograd history)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if self.offset == 0 and t.untyped_storage().nbytes() == self.storage_nbytes:
            return t
        base = torch.empty(-(-self.storage_nbytes // t.element_size()), dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset).detach()

    def make_grad(self) -> torch.Tensor:
        """A gradient for a tensor like this, as a backward op makes one: a storage of its own, of the tensor's
        bytes (a gradient alive counts its storage, ``Event.grad_live``; a slice's is no view of a larger one),
        laid out as the tensor where that is dense (a channels-last map's), else contiguous."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        if t.untyped_storage().nbytes() == t.numel() * t.element_size():
            return t
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


@dataclass
class _Repeated:
    """A module whose static signature repeats, with what its calls need, computed once."""

    module: nn.Module
    fqn: str
    below: tuple[str, ...]  # names of the modules under it
    params: dict[str, int]  # relative name -> index into the trace's params
    buffers: dict[str, torch.Tensor]
    signature: Any = None


def _closed_subtrees(model: nn.Module, walk: ModuleWalk, param_index: dict[int, int]) -> dict[nn.Module, _Repeated]:
    """Modules whose subtree's modules and params are reached by no other path (every module and param under it
    has one name, and that name lies under the module's), with their names, params and buffers; children first."""
    module_names: dict[int, int] = {}
    for _, m in walk.named:
        module_names[id(m)] = module_names.get(id(m), 0) + 1
    param_names: dict[int, int] = {}
    for _, _, p in walk.named_params():
        param_names[id(p)] = param_names.get(id(p), 0) + 1
    out: dict[nn.Module, _Repeated] = {}
    blocked: set[nn.Module] = set()

    def visit(m: nn.Module, fqn: str) -> None:
        ok = module_names[id(m)] == 1 and all(param_names[id(p)] == 1 for p in m._parameters.values() if p is not None)
        below: list[str] = []
        params = {k: param_index[id(p)] for k, p in m._parameters.items() if p is not None}
        buffers = {k: b for k, b in m._buffers.items() if b is not None}
        for k, c in m._modules.items():
            if c is None:
                continue
            name = f"{fqn}.{k}" if fqn else k
            if c not in out and c not in blocked:
                visit(c, name)
            sub = out.get(c)
            if sub is None or sub.fqn != name:
                ok = False
                continue
            below += [name, *sub.below]
            params.update({f"{k}.{n}": i for n, i in sub.params.items()})
            buffers.update({f"{k}.{n}": b for n, b in sub.buffers.items()})
        if ok:
            out[m] = _Repeated(m, fqn, tuple(below), params, buffers)
        else:
            blocked.add(m)

    visit(model, "")
    return out


class BlockReuse:
    """Installs a forward wrapper on every module whose static signature repeats, and replays templates."""

    def __init__(self, model: nn.Module, walk: ModuleWalk, slot: Slot, param_index: dict[int, int],
                 param_storages: set[StorageWeakRef], routing: Routing) -> None:
        self.slot, self.param_index, self.param_storages = slot, param_index, param_storages
        self.routing = routing  # the step's data-dependent ops' stand-in: its state is part of a call's key
        self.templates: dict[tuple, Template] = {}
        self.active = True  # off while a template is being recorded (no nesting)
        self.anchor: torch.Tensor | None = None
        signatures = static_signatures(model)
        closed = _closed_subtrees(model, walk, param_index)
        count: dict[Any, int] = {}
        for m in closed:
            count[signatures[m]] = count.get(signatures[m], 0) + 1
        self.repeated = [r for m, r in closed.items() if count[signatures[m]] > 1 and m is not model]
        for r in self.repeated:
            r.signature = signatures[r.module]
            r.module.forward = self._wrapper(r, r.module.forward)  # an instance attribute: __call__ looks it up

    def remove(self) -> None:
        for r in self.repeated:
            del r.module.forward

    @contextlib.contextmanager
    def own_tensors(self) -> Iterator[None]:
        """Make the tracer's own tensors (stand-in outputs, input grads): the recorder lets their ops through
        unrecorded (under a fake mode the fake mode still makes them, as it makes the model's)."""
        main, self.slot.recorder = self.slot.recorder, NULL
        try:
            yield
        finally:
            self.slot.recorder = main

    def _wrapper(self, r: _Repeated, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return forward(*args, **kwargs)
            leaves, structure = flatten_call(args, kwargs)
            inputs = self._inputs(leaves)
            key = self._call_key(r, leaves, inputs, structure)
            if key is None:
                return forward(*args, **kwargs)
            template = self.templates.get(key)
            outlived: list[weakref.ref] = []  # temporaries a recording made that outlive it (``outlived``)
            if template is None:
                template = self.templates[key] = self._record(r, forward, leaves, inputs, structure, outlived)
            elif template.reusable and not template.confirmed:
                # The second identical call is recorded too: a forward that reads state its first call changed
                # (a cache it filled, a counter) records differently, and is then traced, not replayed.
                template.confirmed = True
                template.reusable = self._record(r, forward, leaves, inputs, structure, outlived) == template
            out = self._replay(r, template, leaves, inputs) if template.reusable else forward(*args, **kwargs)
            self.slot.recorder.outlived(outlived)
            return out

        return run

    @staticmethod
    @bookkeeping
    def _inputs(leaves: list) -> dict[int, _Input]:
        return {i: _Input.of(a) for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)}

    @bookkeeping
    def _call_key(self, r: _Repeated, leaves: list, inputs: dict[int, _Input], structure: Structure) -> tuple | None:
        """What a call must match to reuse a template, or None when it cannot reuse one."""
        if not torch.is_grad_enabled() or torch.is_autocast_enabled() or foreign_saved_hooks():
            return None  # under the user's saved-tensor hooks (save_on_cpu): a replay would save other tensors
        calls = self.slot.recorder.calls
        if calls.get(r.fqn) != 1 or any(calls.get(n) for n in r.below):
            return None  # called before (its pre-forward hook has counted this call): its call numbers would differ
        key, storages = [], set()
        for i, a in enumerate(leaves):
            if i in inputs:
                ref = StorageWeakRef(a.untyped_storage())
                if ref in storages or ref in self.param_storages:
                    return None  # two arguments share memory, or an argument is a param
                storages.add(ref)
                key.append(inputs[i].key())
            elif isinstance(a, _CONSTANTS):
                key.append(freeze(a))
            else:
                return None
        return (r.signature, structure, tuple(key), self.routing.experts, self.routing.per_expert)

    # -- recording a template -------------------------------------------------------------------------------
    def _record(self, r: _Repeated, forward: Callable[..., Any], leaves: list, inputs: dict[int, _Input],
                structure: Structure, outlived: list[weakref.ref]) -> Template:
        main = self.slot.recorder
        log = ActionLog(r.fqn, {i: n for n, i in r.params.items()}, main.static_storages)
        self.active, self.slot.recorder = False, NULL
        before = dict(self.routing.used), self.routing.experts, self.routing.per_expert
        try:
            clones = {i: m.make().requires_grad_(m.requires_grad) for i, m in inputs.items()}
            grad_idx = [i for i in clones if clones[i].requires_grad]
            for i, t in zip(grad_idx, _Sink.apply(*(clones[i] for i in grad_idx)), strict=True):
                clones[i] = t
            versions = {i: t._version for i, t in clones.items()}
            # the call's own inputs are counted by its pre-forward (in the step's recorder), not by inner calls
            # (taken by the call itself, which runs through its inner calls: theirs to keep, ``call_inputs``)
            log.input_storages.update(dict.fromkeys(StorageWeakRef(t.untyped_storage()) for t in clones.values()))
            # (and their makers are the step's, found by the replay: ``Event.made_at``)
            log.makers.update({StorageWeakRef(t.untyped_storage()): ("input", i) for i, t in clones.items()})
            iso = list(leaves)
            for i, t in clones.items():
                iso[i] = t
            iso_args, iso_kwargs = unflatten_call(structure, iso)
            self.slot.recorder, self.slot.produced = log, set()
            log.frame.track(clones.values())  # made before the call, as its real inputs were (``Event.held``)
            log.frame.open()
            log.kept_stack.append(KeptInputs({StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
                                              for t in clones.values()}))  # (its saves: ``Event.saved_inputs``)
            out = forward(*iso_args, **iso_kwargs)
            log.template.held, log.template.rise, log.template.excess = log.frame.close()
            log.kept_stack.pop()
            produced, self.slot.produced = self.slot.produced, None
            self._routed(log, r, before[0])
            self._describe_outputs(log, out, produced)
            self._classify_saves(log, r, clones, out, produced)
            if any(t._version != versions[i] for i, t in clones.items()):
                log.template.reusable = False  # modified an input in place
            if log.template.reusable:
                held = [out]
                del out  # autograd alone holds the outputs in backward, as in the step (``_record_backward``)
                self._record_backward(log, held)
                _compile_ops(log.template, r)
                log.template.grads = [n for n, p in r.module.named_parameters() if p.grad is not None]
                if self.routing.used != _added(before[0], log.template.routed, r.fqn):
                    log.template.reusable = False  # a stand-in in backward: replayed in forward, out of order
        finally:
            log.unwatch()
            outlived.extend(log.temporaries.alive())
            self.active, self.slot.recorder, self.slot.produced = True, main, None
            # the replay (or the full call, for a template not used) tells the stand-in, not the recording
            self.routing.used, self.routing.experts, self.routing.per_expert = before
            for p in r.module.parameters():
                p.grad = None
        return log.template

    def _routed(self, log: ActionLog, r: _Repeated, before: dict[tuple[str, str], int]) -> None:
        """What the call's forward told the stand-in, relative to the module, for a replay to tell it again."""
        after = self.routing.used
        for (op, module), n in after.items():
            if n == before.get((op, module), 0):
                continue
            if (op, module) in before or not (module == r.fqn or module.startswith(r.fqn + ".")):
                log.template.reusable = False  # in a module outside the call: not one a replay can name
            log.template.routed.append((op, module[len(r.fqn):], n))
        log.template.routing = (self.routing.experts, self.routing.per_expert)

    def _describe_outputs(self, log: ActionLog, out: Any, produced: set[StorageWeakRef]) -> None:
        """The outputs a stand-in must return. Refused: views, aliases of inputs or params, outputs sharing memory,
        non-constant non-tensors and more than one output needing a grad (which of them gets one depends on the
        caller). An output that is an inner call's own output (a Sequential's last child's) carries that call's
        pre-backward hook, registered before the module's: noted (``ActionLog.hooked``), for the replay to keep
        the order."""
        flat, log.template.out_spec = tree_flatten(out)
        seen: set[StorageWeakRef] = set()
        for j, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                fresh = ref in produced and ref not in seen and t._base is None
                if ref in log.input_storages:
                    log.template.counted.append((j, log.input_storages[ref] is not None))
                maker = log.makers.get(ref)
                if maker is not None and maker[0] == "op":
                    log.template.made_outputs.append((j, maker[1]))
                if ref in self.slot.topk_by:
                    log.template.topk_outputs.append((j, self.slot.topk_by[ref][len(log.prefix):]))
                meta = _Input.of(t)
                if not fresh or meta.storage_nbytes != t.numel() * t.element_size():
                    log.template.reusable = False
                log.hooked += [key for inner, key in log.inner_outputs if inner() is t]
                seen.add(ref)
                log.template.outputs.append(meta)
            elif isinstance(t, _CONSTANTS):
                log.template.outputs.append(("const", t))
            else:
                log.template.reusable = False
        if sum(1 for m in log.template.outputs if isinstance(m, _Input) and m.requires_grad) > 1:
            log.template.reusable = False

    def _classify_saves(self, log: ActionLog, r: _Repeated, clones: dict[int, torch.Tensor], out: Any,
                        produced: set[StorageWeakRef]) -> None:
        """Turn each saved storage into something a replay can find again: an input, an output, a buffer, or a
        storage made inside the call (counted once per replay); and so each inner call's kept inputs that it saved
        (``Event.saved_inputs``, which the replay's recorder counts as it replays the saves)."""
        inputs = {StorageWeakRef(t.untyped_storage()): i for i, t in clones.items()}
        outputs = {StorageWeakRef(t.untyped_storage()): j for j, t in enumerate(tree_flatten(out)[0])
                   if isinstance(t, torch.Tensor)}
        buffers = {StorageWeakRef(b.untyped_storage()): n for n, b in r.buffers.items()}
        internal: dict[StorageWeakRef, int] = {}  # a storage made inside -> its first save's (saved again after)
        sources: dict[StorageWeakRef, tuple] = {}
        for n, (pos, ref, nbytes, mask, made) in enumerate(log.saved):
            if ref in inputs:
                source: tuple = ("input", inputs[ref])
            elif ref in outputs:
                source = ("output", outputs[ref])
            elif ref in buffers:
                source = ("buffer", buffers[ref])
            elif ref in produced:
                source = ("internal", internal.setdefault(ref, n))
            else:
                log.template.reusable = False  # saves a tensor from outside the call
                return
            log.template.forward.insert(pos + n, ("save", source, nbytes, mask, made))
            sources[ref] = source
        log.template.forward = [(*a[:5], tuple(sources[r] for r in a[5] if r in sources), *a[6:])
                                if a[0] == "fwd_pre" else a for a in log.template.forward]

    def _record_backward(self, log: ActionLog, held: list[Any]) -> None:
        """The call's backward from its outputs, the outputs themselves (``held``'s one item) let go: a saved
        output is then freed where the step frees it, once the node that saved it has run (``Event.freed``), not
        held by the recording to its end; and so is the gradient fed to them (``_Feed``), a gradient alive
        (``Event.grad_live``) until then: how many backward ops it was alive at (``Template.fed_until``)."""
        tensors = [t for t in tree_flatten(held.pop())[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        metas, fed = [_Input.of(t) for t in tensors], []

        def feed() -> list[torch.Tensor]:
            with self.own_tensors():
                grads = [m.make() for m in metas]
            # what flows in, as in the step
            log.grad_storages.update(StorageWeakRef(g.untyped_storage()) for g in grads)
            fed.extend(log.gradients.track(g) for g in grads)
            return grads

        with self.own_tensors():
            root = _Feed.apply(feed, *tensors)
            seed = torch.ones_like(root)
        del tensors
        log.backward = True
        self.slot.recorder = log
        torch.autograd.backward(root, seed)
        log.unwatch()  # what the recording frees from now on is no backward op's (``Event.freed``)
        died = max((record[1] for record in fed), default=0)
        # gradients its ops made that autograd's graph holds beyond it, to the step's backward's end (a layer
        # norm's backward's fp32 copy of its weight): what the fed gradient, its params' and inputs' leave alive
        log.template.outlived = log.gradients.current
        log.template.fed_until = sum(1 for a in log.template.backward[:died if died >= 0 else None] if a[0] == "op")
        # the output's own hooks fire first, before any op of the call's backward: split them off, or refuse
        backward, n = log.template.backward, len(log.hooked)
        if backward[:n] != [("bwd_pre", log.relative(fqn), call) for fqn, call in log.hooked]:
            log.template.reusable = False
        log.template.on_output, backward[:n] = backward[:n], []

    # -- replaying it ---------------------------------------------------------------------------------------
    def _anchor(self) -> torch.Tensor:
        """A leaf that requires grad, passed to every stand-in so that its backward runs even when no input needs
        a grad (the call's params do); it receives no grad."""
        if self.anchor is None:
            with self.own_tensors():
                self.anchor = torch.empty(1, device="meta").requires_grad_()
        return self.anchor

    @bookkeeping
    def _replay(self, r: _Repeated, template: Template, leaves: list, inputs: dict[int, _Input]) -> Any:
        main, prefix = self.slot.recorder, r.fqn + "."
        tensors = [leaves[i] for i in inputs]
        params = [r.params[n] for n in template.params]
        # the call's arguments, for its forward only: the closure lives until backward, and holding them there would
        # keep alive what the real call frees after it (a temporary only it read; ``Event.held``)
        arguments = {"leaves": leaves}

        def replay(backward: bool, grads: tuple = ()) -> Any:
            if backward:  # runs only when an output received a grad, as the call's own backward would
                _replay_actions(main, template.backward, prefix, params, {},
                                _outside(main, [g for g in grads if isinstance(g, torch.Tensor)], template.fed_until))
                main.gradients.current += template.outlived
                main.grads.update(r.params[n] for n in template.grads)
                with self.own_tensors():
                    made = [m.make_grad() if m.requires_grad else None for m in inputs.values()]
                # the input grads a replayed call returns are gradients, as its own backward's outputs would be
                main.gradients_made([g for g in made if g is not None])
                return made
            with self.own_tensors():
                outs = [m.make() if isinstance(m, _Input) else m[1] for m in template.outputs]
            args = arguments.pop("leaves")
            sources: dict[tuple, StorageWeakRef] = {("input", i): StorageWeakRef(args[i].untyped_storage())
                                                    for i in inputs}
            sources.update({("output", j): StorageWeakRef(t.untyped_storage()) for j, t in enumerate(outs)
                            if isinstance(t, torch.Tensor)})
            _counted_outputs(main, template, sources)
            sources.update({("buffer", n): StorageWeakRef(b.untyped_storage()) for n, b in r.buffers.items()})
            positions: list[int] = []  # where its forward ops went (``Event.made_at``)
            _replay_actions(main, template.forward, prefix, params, sources, positions=positions)
            _made_outputs(main, template, sources, positions)
            _topk_outputs(self.slot, template, prefix, outs)
            if ("pack",) in template.forward:  # its ops ran in the recording: their frame at its last pack
                main.frame.replayed(template.held, template.rise)
            main.frame.replayed_height(template.excess)
            self.routing.used = _added(self.routing.used, template.routed, r.fqn)
            self.routing.experts, self.routing.per_expert = template.routing
            return ([t for t in outs if isinstance(t, torch.Tensor)],
                    [t for t, m in zip(outs, template.outputs, strict=True)
                     if isinstance(m, _Input) and not m.requires_grad])

        result = _StandIn.apply(replay, self._anchor(), *tensors)
        if template.on_output:
            self._hook_output(main, template.on_output, prefix, params, result)
        assert template.out_spec is not None
        if template.out_spec.is_leaf():  # one tensor: the common case
            return result[0]
        it = iter(result)
        return template.out_spec.unflatten([next(it) if isinstance(m, _Input) else m[1] for m in template.outputs])


    def _hook_output(self, main: StepRecorder, actions: list[tuple], prefix: str, params: list[int],
                     result: tuple[torch.Tensor, ...]) -> None:
        """Fire the inner calls' pre-backwards from a hook on the output that needs a grad (one at most),
        registered now, before the module's own hook: the order a real call's hooks fire in; and tell the slot
        those calls returned it (``Slot.returned``)."""
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                _replay_actions(main, actions, prefix, params, {})

        for t in result:
            if t.requires_grad:
                t.register_hook(hook)
        # the inner calls that returned the call's own output (whose pre-backwards these are) returned it here too
        for action in actions:
            self.slot.returned(prefix + action[1], (t for t in result if t.requires_grad))


def _topk_outputs(slot: Slot, template: Template, prefix: str, outs: list[Any]) -> None:
    """The replay's outputs that a topk inside made (``Template.topk_outputs``), told to the slot as the call's own
    would be: its caller modifying them in place is then seen (``Slot.written``)."""
    for j, module in template.topk_outputs:
        slot.topk_made(prefix + module if module else prefix[:-1], [outs[j]])


def _outside(main: StepRecorder, grads: list[torch.Tensor], fed_until: int) -> tuple[int, int, int]:
    """The gradients alive outside a replayed call's backward, which its template, traced alone, never saw (a
    skip's or a residual's, waiting in autograd's input buffers for more contributions), as (bytes added to its
    first ``fed_until`` backward ops, bytes added to the rest, ``fed_until``). The template counts its output's
    gradient, a tensor of its own, until its last reader has run (``_Feed``); the step counts the storage handed
    to it instead (a loss's expanded scalar: 4 bytes), alive as long, or all through where something outside holds
    it too (a residual around the call: autograd holds it in the other branch's input buffer; a concat's view)."""
    handed = main.gradients.nbytes(grads)
    fed = sum(g.numel() * g.element_size() for g in grads)
    held = handed > fed or any(g._use_count() > 1 for g in grads)
    return main.gradients.current - fed, main.gradients.current - (0 if held else handed), fed_until


def _counted_outputs(main: StepRecorder, template: Template, sources: dict[tuple, StorageWeakRef]) -> None:
    """The replayed call's outputs that an inner call took as its input: taken, as the traced call left them."""
    for j, taken in template.counted:
        main.input_storages[sources["output", j]] = REPLAYED if taken else None


def _made_outputs(main: StepRecorder, template: Template, sources: dict[tuple, StorageWeakRef],
                  positions: list[int]) -> None:
    """The replayed call's outputs an op a policy can keep made: that op, where the replay put it, is their maker in
    the step (``StepRecorder.makers``), as it is where the call is traced."""
    for j, k in template.made_outputs:
        main.makers.setdefault(sources["output", j], positions[k])


def _added(used: dict[tuple[str, str], int], routed: list[tuple[str, str, int]], fqn: str
           ) -> dict[tuple[str, str], int]:
    """``used`` (the stand-in's count per op and module) after a call of ``fqn`` that stood in for ``routed``."""
    out = dict(used)
    for op, rel, n in routed:
        key = (op, fqn + rel)
        out[key] = out.get(key, 0) + n
    return out


def _compile_ops(template: Template, r: _Repeated) -> None:
    """Merge each run of consecutive ops into one ("ops", [(slots, flops, bytes, class, output bytes, kernel, host
    sync, temporaries, kernel workspace, gradient bytes, saved bytes freed by the saving call), ...])
    action, their param slots
    ordered by registration (which every instance shares), so a replay maps them straight to the sorted index
    tuples the recorder keeps."""
    rank = [r.params[n] for n in template.params]
    for actions in (template.forward, template.backward):
        merged: list[tuple] = []
        for a in actions:
            if a[0] != "op":
                merged.append(a)
                continue
            op = (tuple(sorted(a[1], key=rank.__getitem__)), *a[2:])
            if merged and merged[-1][0] == "ops":
                merged[-1][1].append(op)
            else:
                merged.append(("ops", [op]))
        actions[:] = merged


def _replay_actions(main: StepRecorder, actions: list[tuple], prefix: str, params: list[int],
                    sources: dict[tuple, StorageWeakRef], outside: tuple[int, int, int] = (0, 0, 0),
                    positions: list[int] | None = None) -> None:
    """Feeds a template's actions into the step's recorder; ``outside``: the gradients alive outside a replayed
    backward (``_outside``), added to each op's that counts gradients (``Event.grad_live``: one that allocates);
    ``positions``: a forward's, filled with where each op went (a maker's position, ``Event.made_at``)."""
    before, after, until = outside
    done = 0  # ops replayed so far
    positions = [] if positions is None else positions
    for action in actions:
        kind = action[0]
        if kind == "ops":
            positions.extend(range(len(main.events), len(main.events) + len(action[1])))
            inner = main.innermost_backward()
            main.ops([(tuple([params[i] for i in slots]), *rest,
                       grad_live + (before if j < until else after) if grad_live else 0,
                       replayed_freed(freed, prefix, inner)) for j, (slots, *rest, grad_live, freed)
                      in enumerate(action[1], done)])
            done += len(action[1])
        elif kind == "fwd_pre":
            kept = dict.fromkeys((_source_ref(sources, s) for s in action[5]), 0)
            # the step's batch among the call's own inputs: no kept input (``StepRecorder.call_inputs``)
            batch = sum(n for m, n in action[6] if m[0] == "input" and sources[m] in main.step_inputs)
            main.kept_next = {ref: n for ref, n in kept.items() if ref not in main.step_inputs}
            main.enter_forward(prefix + action[1], action[2], action[3], action[4] - batch,
                               _made(main, action[6], sources, positions), action[7],
                               tuple(params[i] for i in action[8]))
        elif kind == "fwd_post":
            main.exit_forward(prefix + action[1], replayed=action[2:4])
        elif kind == "bwd_pre":
            main.enter_backward((prefix + action[1], action[2]))
        elif kind == "bwd_post":
            main.exit_backward((prefix + action[1], action[2]))
        elif kind == "pack":
            main.pack()
        elif kind == "own_region":
            main.own_region(action[1], action[2])
        elif kind == "modified_input":
            main.modified_input(prefix + action[1])
        elif kind == "aliased_input":
            main.aliased_input(prefix + action[1])
        elif kind == "modified_output":
            main.modified_output(tuple(prefix + f for f in action[1]))
        elif kind == "modified_topk":
            main.modified_topk(prefix + action[1] if action[1] else prefix[:-1])
        else:  # save
            source, nbytes, mask = action[1], action[2], action[3]
            main.save(_source_ref(sources, source), nbytes, mask=mask,
                      made=_made(main, action[4], sources, positions))


def _made(main: StepRecorder, made: tuple, sources: dict[tuple, StorageWeakRef], positions: list[int]) -> tuple:
    """A recording's ``Event.made_at`` entries in the step: a maker among the call's forward ops at the position its
    replay put it; one of the call's inputs by the step's maker of it, if any (the batch has none)."""
    out = []
    for (kind, k), nbytes in made:
        if kind == "op":
            out.append((positions[k], nbytes))
        elif (maker := main.makers.get(sources[kind, k])) is not None and sources[kind, k] not in main.step_inputs:
            out.append((maker, nbytes))
    return tuple(out)


def _source_ref(sources: dict[tuple, StorageWeakRef], source: tuple) -> StorageWeakRef:
    """The storage a replay's source is; one made inside the call, the same for each save of it (or none left:
    the backward's)."""
    ref = sources.get(source)
    if ref is None:
        ref = sources[source] = _Fresh()  # type: ignore[assignment]
    return ref


def replayed_freed(freed: tuple[tuple[str, int], ...], prefix: str, inner: Call | None) -> int:
    """A replayed backward op's ``Event.freed``: of what its recording freed (bytes by the saving call, relative to
    the replayed call, "" itself), the saves of the step's innermost backward call now."""
    if not freed or inner is None:
        return 0
    return sum(n for name, n in freed if inner[0] == (prefix + name if name else prefix[:-1]))


class _Fresh:
    """A storage made inside a replayed call: equal only to itself (compares like a StorageWeakRef)."""

    __slots__ = ("cdata",)
    _next = 0

    def __init__(self) -> None:
        _Fresh._next -= 1
        self.cdata = _Fresh._next  # negative: no real storage has it

    def __hash__(self) -> int:
        return hash(self.cdata)

    def __eq__(self, other: object) -> bool:
        return getattr(other, "cdata", None) == self.cdata
