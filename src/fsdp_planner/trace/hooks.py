"""The module boundaries FSDP2 hooks on, seen through hooks of the same kinds: a forward pre-hook and a forward
hook on every module, an identity autograd function on each call's grad-requiring inputs (FSDP2's
``RegisterPostBackwardFunction``) and a grad hook on its grad-requiring outputs (FSDP2's pre-backward)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp._common_utils import collect_grad_tensors, replace_grad_tensors
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_planner.trace.bookkeeping import bookkeeping
from fsdp_planner.trace.failures import mark
from fsdp_planner.trace.leaves import ATOMS, containers, flat_leaves, into_callers
from fsdp_planner.trace.step import Slot
from fsdp_planner.trace.tree import proper_ancestors
from fsdp_planner.trace.walk import ModuleWalk


class PostBackwardMarker(torch.autograd.Function):
    """Identity on a module's grad-requiring inputs; its backward fires when the module's backward is done
    (FSDP2's RegisterPostBackwardFunction).

    It returns ``t.detach()``, not ``t`` or ``t.view_as(t)``: autograd turns an input returned as-is into a view
    of it, and a view made inside a custom Function may not be modified in place ("Output 0 of
    PostBackwardMarker is a view and is being modified inplace"), so every module fed by an in-place op's target
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


class ModuleHooks:
    """Forward hooks on every module, feeding boundary events to the slot's recorder. Made before they are
    installed: the forward methods wrapped for FSDP2 (``methods.forward_methods``) call them, and must be wrapped
    before the hooks go on (see ``session.TraceSession``)."""

    def __init__(self, walk: ModuleWalk, slot: Slot, param_by_id: dict[int, int] | None = None) -> None:
        self.slot = slot
        self.param_by_id = param_by_id or {}  # id of a param object -> its index: the params a call is given
        self.modules = list(walk.modules.values())
        self.name = {m: n for n, m in walk.modules.items()}  # a module registered twice keeps its first name
        self.holders = _holders(walk)
        # per running call (pushed by pre_forward, popped by post_forward): its marked inputs and their versions,
        # and the lists and dicts it was given with their lengths
        self.watched: list[tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None] = []
        self.sized: list[list[tuple[Any, int]]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The hooks on every module, removed on exit."""
        handles = []
        try:
            for m in self.modules:
                handles.append(m.register_forward_pre_hook(self.pre_forward, with_kwargs=True))
                handles.append(m.register_forward_hook(self.post_forward, always_call=True))
            yield
        finally:
            for h in handles:
                h.remove()

    @bookkeeping
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """FSDP2's post-backward hook goes on the call's grad-requiring inputs, found as FSDP2 finds them
        (``collect_grad_tensors``: tuples, lists, dicts, NamedTuples and dataclasses)."""
        fqn = self.name[module]
        recorder = self.slot.recorder
        flat = not kwargs and all(isinstance(a, ATOMS) for a in args)  # the common case, without a traversal
        leaves = args if flat else flat_leaves(args, kwargs)
        held, kept, made = recorder.call_inputs(fqn, [a for a in leaves if isinstance(a, torch.Tensor)],
                                                fqn in self.holders)
        if not torch.is_grad_enabled():
            inputs: tuple[torch.Tensor, ...] = ()
        elif flat:
            inputs = tuple(a for a in args if isinstance(a, torch.Tensor) and a.requires_grad)
        else:
            inputs = collect_grad_tensors((args, kwargs))
        first = next((a for a in leaves if isinstance(a, torch.Tensor)), None)
        passed = tuple(sorted({self.param_by_id[id(a)] for a in leaves if id(a) in self.param_by_id}))
        call = recorder.enter_forward(fqn, bool(inputs), held, kept, made, -1 if first is None else first.dim(),
                                      passed)
        self.sized.append([] if flat else [(c, len(c)) for c in containers((args, tuple(kwargs.values())))])
        if not inputs:
            self.watched.append(None)
        else:
            key = (fqn, call)
            # one alias per distinct tensor: a module given one tensor twice or more (nn.MultiheadAttention's
            # self-attention, query is key is value) must still see one, or it takes another path (three
            # projections instead of one packed)
            distinct = list({id(t): t for t in inputs}.values())
            if len(distinct) < len(inputs) and isinstance(module, nn.MultiheadAttention):  # (FSDP2's hooks would
                recorder.aliased_input(fqn)  # not keep it: ``ModuleInfo.aliased_inputs``)
            marked = PostBackwardMarker.apply(lambda: recorder.exit_backward(key), *distinct)
            self.watched.append((marked, tuple(t._version for t in marked)))
            alias = {id(t): m for t, m in zip(distinct, marked, strict=True)}
            outs = iter([alias[id(t)] for t in inputs])
            if flat:
                args = tuple(next(outs) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)
            else:  # (the caller's lists and dicts kept, their tensors swapped in place: ``leaves.into_callers``)
                args, kwargs = into_callers((args, kwargs), replace_grad_tensors((args, kwargs), outs))
        return args, kwargs

    @bookkeeping
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """FSDP2's pre-backward hook goes on the call's grad-requiring outputs (``collect_grad_tensors``)."""
        fqn = self.name[module]
        recorder = self.slot.recorder
        failure = sys.exc_info()[1]
        if failure is not None and output is None:  # always_call: the call raised (torch runs this in its except)
            mark(failure, None, fqn, type(module).__name__)
        watched = self.watched.pop() if self.watched else None
        sized = self.sized.pop() if self.sized else []
        if (watched is not None and any(t._version != v for t, v in zip(*watched, strict=True))) or \
                any(len(c) != n for c, n in sized):
            # an in-place op wrote the call's input (an alias sharing its version counter): with FSDP2's function on
            # these inputs, autograd would have refused it; or the call popped from (appended to) a list or dict it
            # was given, a copy of which FSDP2 gives a sharded module's call: the caller would not see it
            recorder.modified_input(fqn)
        grads = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
                 for t in collect_grad_tensors(output)} if torch.is_grad_enabled() else {}
        leaves = flat_leaves((output,))
        recorder.made(leaves)  # a replayed call's outputs: no op the recorder saw made them
        if not recorder.backward:  # (modified in place after: no TP style can return it, ``StepRecorder.written``)
            self.slot.returned(fqn, (t for t in leaves if isinstance(t, torch.Tensor)))
        if not recorder.backward:  # and temporaries from now on, as a traced call's are (``Temporaries``)
            recorder.temporary(t for t in leaves if isinstance(t, torch.Tensor))
        call = recorder.exit_forward(fqn, sum(grads.values()))  # its outputs' gradients (``Event.held``)
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


def _holders(walk: ModuleWalk) -> set[str]:
    """The modules that hold a param, their own or below them: those a plan can checkpoint."""
    out: set[str] = set()
    for mname, _, _ in walk.named_params():
        for m in (mname, *proper_ancestors(mname)):
            if m in out:
                break
            out.add(m)
    return out
