"""One pass of a traced step: the tracer's pieces put on the model, the step run, the Trace built.

The pieces go on in one order, and each place in it has a reason:

1. the forward methods wrapped for FSDP2 (``methods.forward_methods``) before block reuse: a wrapped method is an
   instance attribute, which gives its module a static signature of its own, so it is never a template (its
   calls go through the module hooks, which a replay would skip);
2. block reuse (``reuse.BlockReuse``) before the module hooks: it takes the static signatures as it installs, and a
   module with hooks is never a template, so the tracer's own hooks must not be there yet;
3. the module hooks (``hooks.ModuleHooks``);
4. for the step itself, the fake mode (a model with real params; none on meta) before the op recorder: the
   dispatch mode entered last sees an op first, so the recorder records each op and runs it under the fake
   mode, which makes its outputs fake; then ``GpuAttention`` (a torch-function mode, a stack of its own) and
   ``F.rms_norm`` bound to the GPU's fused kernel (``norms.py``), the
   saved-tensor hooks, and the model's own ``torch.utils.checkpoint`` run as plain regions (``own_checkpoint.py``:
   its hooks would sit over the tracer's).

They come off in the reverse order, and the grads the step left (on params and on leaf inputs) are cleared last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_planner.attention import GpuAttention
from fsdp_planner.norms import fused_rms_norm_everywhere
from fsdp_planner.routing import DEFAULT_CAPACITY, StandIn, capacity, values_formatted
from fsdp_planner.trace.failures import mark_loss
from fsdp_planner.trace.full_precision import full_precision_casts
from fsdp_planner.trace.hooks import ModuleHooks
from fsdp_planner.trace.input_casts import group_input_casts
from fsdp_planner.trace.leaves import flat_leaves
from fsdp_planner.trace.methods import MethodFinder, forward_methods
from fsdp_planner.trace.ops import OpRecorder, device_sync, router_shapes
from fsdp_planner.trace.own_checkpoint import OwnCheckpoints
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.reuse import BlockReuse
from fsdp_planner.trace.saved import saved_tensor_hooks
from fsdp_planner.trace.step import Slot, StepRecorder
from fsdp_planner.trace.summary import module_infos
from fsdp_planner.trace.walk import TracedModel


@dataclass(frozen=True)
class TraceRequest:
    """What ``recorder.record`` was asked to trace, and how (see its docstring): the step is
    ``loss_fn(model(*args, **kwargs)).backward()``."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable[[Any], torch.Tensor]
    measure: bool = False
    reuse: bool = True
    compute_dtype: torch.dtype | None = None
    routing: float = DEFAULT_CAPACITY  # the capacity factor of data-dependent ops' stand-in (routing.py)
    full_precision: tuple[str, ...] = ()  # modules run in fp32 under the compute dtype (full_precision.py)
    cast_inputs: bool = False  # every module holding params casts its inputs to the compute dtype (input_casts.py)
    cast_buffers: bool = False  # floating buffers in the compute dtype too: the model converted whole (pure-bf16)


def step_inputs(request: TraceRequest) -> tuple[tuple, dict]:
    """The step's ``(args, kwargs)``: floating ones cast to the compute dtype, as FSDP2's root casts its forward
    inputs (``cast_forward_inputs=True``)."""
    dtype = request.compute_dtype
    if dtype is None:
        return request.args, request.kwargs
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    (request.args, request.kwargs))


def inputs_nbytes(request: TraceRequest, args: tuple, kwargs: dict) -> int:
    """Bytes of the step's inputs as given and of the compute-dtype copies FSDP2's root makes of floating ones
    (``step_inputs``): the caller holds its batch all step, and the model's first op saves the copy before the
    trace charges anything (an image model's pixels: a fifth of a small Swin's peak)."""
    seen: dict[StorageWeakRef, int] = {}
    for t in tree_flatten((request.args, request.kwargs, args, kwargs))[0]:
        if isinstance(t, torch.Tensor):
            seen.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
    return sum(seen.values())


class TraceSession:
    """One pass: its recorder, its pieces (module docstring for their order) and the Trace it makes. ``finder``
    holds the non-forward methods seen reading params, for the next pass to wrap (``methods.py``)."""

    def __init__(self, request: TraceRequest, model: TracedModel, methods: Mapping[str, str]) -> None:
        self.request, self.model, self.methods = request, model, methods
        self.args, self.kwargs = step_inputs(request)
        self.fake_mode = self._fake_mode()
        self.fakes: list[torch.Tensor] = []  # the fake copies ``_refs`` names: kept alive, or their storages
        # (weakly referenced) die and a param read under the fake mode gets a fresh fake whose storage is no param's
        self.param_by_storage = {ref: i for i, p in enumerate(model.param_objs) for ref in self._refs(p)}
        self.buffers = list({id(b): b for m in model.walk.modules.values() for b in m._buffers.values()
                             if b is not None}.values())
        buffer_storages = {ref for b in self.buffers for ref in self._refs(b)}
        # (a real batch is read through its fake copy too: its storage alone made the first op's save of it an
        # activation, the real model's peak one input above its meta twin's, a trial of the API)
        batch = frozenset(ref for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor)
                          for ref in self._refs(t))
        self.recorder = StepRecorder(set(self.param_by_storage) | buffer_storages, batch)
        self.finder = MethodFinder(model.walk.modules, model.params)
        self.recorder.check_methods = self.finder.check
        self.slot = Slot(self.recorder)
        self.param_by_id = {id(p): i for i, p in enumerate(model.param_objs)}
        sync = device_sync(model.param_objs) if request.measure else None
        self.stand_in = StandIn(request.routing)
        router = router_shapes((name, p.shape) for p in model.params for name in (p.fqn, *p.aliases))
        self.ops = OpRecorder(self.slot, self.param_by_id, self.param_by_storage, sync, self.stand_in, router)
        self.hooks = ModuleHooks(model.walk, self.slot, self.param_by_id)
        self.own = OwnCheckpoints(self.slot)
        self.cast: list[str] = []  # the modules whose inputs the group casts changed (``input_casts.py``)

    def _fake_mode(self) -> FakeTensorMode | None:
        """A fake mode for a model with real params (none on meta, none when measuring: those run for real)."""
        tensors = [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor)]
        params = self.model.param_objs
        on_meta = all(p.is_meta for p in params) and all(t.is_meta for t in tensors)
        if self.request.measure and (on_meta or any(p.is_meta for p in params)):
            raise ValueError("measuring op times needs a model with real (non-meta) parameters and inputs")
        if on_meta or self.request.measure:
            return None
        return FakeTensorMode(allow_non_fake_inputs=True)

    def _refs(self, t: torch.Tensor) -> list[StorageWeakRef]:
        """The storages a param, buffer or input is read through: its own, and its fake copy's under a fake mode."""
        refs = [StorageWeakRef(t.untyped_storage())]
        if self.fake_mode is not None:
            self.fakes.append(self.fake_mode.from_tensor(t))
            refs.append(StorageWeakRef(self.fakes[-1].untyped_storage()))
        return refs

    def run(self) -> Trace:
        with self._installed(), self._modes():
            got_grad = self._step()
        return self._trace(got_grad)

    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        """Steps 1 to 3 of the module docstring; on exit, the grads the step made are cleared."""
        request = self.request
        leaf_inputs = [t for t in flat_leaves(self.args, self.kwargs) if isinstance(t, torch.Tensor) and t.is_leaf
                       and t.requires_grad and t.grad is None]  # their grads are the trace's doing
        with contextlib.ExitStack() as stack:
            stack.callback(_clear_grads, [*self.model.param_objs, *leaf_inputs])
            stack.enter_context(forward_methods(self.model.walk.modules, self.methods, self.hooks, self.slot))
            if request.reuse and not request.measure:
                reuse = BlockReuse(request.model, self.model.walk, self.slot, self.param_by_id,
                                   set(self.param_by_storage), self.stand_in)
                stack.callback(reuse.remove)
            stack.enter_context(self.hooks.installed())
            # after the recorder's hooks, but the input cast prepended: FSDP2 casts before anything else it does
            stack.enter_context(full_precision_casts(self.model.walk.modules, request.full_precision,
                                                     request.compute_dtype))
            if request.cast_inputs and request.compute_dtype is not None:
                stack.enter_context(group_input_casts(self.model.walk.modules, request.full_precision,
                                                      request.compute_dtype, self.cast))
            for p in self.model.param_objs:  # a param's grad is no gradient of an activation (ops.py)
                if p.requires_grad:
                    stack.callback(p.register_post_accumulate_grad_hook(self._param_grad).remove)
            yield

    def _param_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.slot.recorder.param_grad(StorageWeakRef(param.grad.untyped_storage()))

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        """Step 4 of the module docstring."""
        with self.fake_mode or contextlib.nullcontext(), GpuAttention(), fused_rms_norm_everywhere(), self.ops, \
                saved_tensor_hooks(self.slot), capacity(self.request.routing), values_formatted(), \
                self.own.installed():
            yield

    def _step(self) -> set[int]:
        """Forward, loss and backward; the params that got a grad (replayed calls' included)."""
        out = [self.request.model(*self.args, **self.kwargs)]
        try:  # (the output passed on, no reference kept here: the loss frees it as it would, before backward)
            loss = self.request.loss_fn(out.pop())
        except Exception as e:
            mark_loss(e)
            raise
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        self.recorder.backward = True
        loss.backward()
        self.recorder.finish_backward()
        return {i for i, p in enumerate(self.model.param_objs) if p.grad is not None} | self.recorder.grads

    def _trace(self, got_grad: set[int]) -> Trace:
        recorder, model, dtype = self.recorder, self.model, self.request.compute_dtype
        events = recorder.events
        seconds = tuple(self.ops.seconds.get(i, 0.0) for i in range(len(events))) if self.request.measure else None
        params = [p if i in got_grad else replace(p, gets_grad=False) for i, p in enumerate(model.params)]
        modules = module_infos(model.walk, params, model.param_objs, events, recorder.calls, recorder.modified_inputs,
                               recorder.modified_outputs, recorder.modified_topks, recorder.input_dims,
                               recorder.aliased_inputs)
        return Trace(params=tuple(params), modules=modules, events=tuple(events), fingerprint=model.fingerprint,
                     method_calls=dict(recorder.method_calls), loss_blocks=recorder.loss.blocks,
                     compute_itemsize=None if dtype is None else dtype.itemsize,
                     buffers_nbytes=sum(b.numel() * b.element_size() for b in self.buffers), op_seconds=seconds,
                     inputs_nbytes=inputs_nbytes(self.request, self.args, self.kwargs),
                     notes=tuple(n for n in (self.stand_in.note(), self.own.note(tuple(recorder.own_calls))) if n),
                     full_precision=self.request.full_precision if dtype is not None else (),
                     cast_inputs=tuple(self.cast),
                     own_checkpointed=tuple(recorder.own_calls), attention=tuple(sorted(self.ops.attention)),
                     attention_batch=self.ops.attention_batch,
                     stood_in=tuple(sorted({module for _, module in self.stand_in.used})),
                     host_reads=self.stand_in.host_reads(),
                     offset_rows=tuple(sorted(self.ops.offset_rows)))


def _clear_grads(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None
