"""Trace one training step (forward + backward) without real memory.

The trace is the planner's only view of the model: which params every op reads, in what order, inside which
module call, with FLOPs, bytes moved and activation bytes saved for backward. It also records the module
boundaries FSDP2 hooks on (pre/post-forward, pre/post-backward), so that ``fsdp2/replay.py`` can replay FSDP2's
unshard / reshard / reduce-scatter decisions for any plan.

Param reads are caught by a dispatch mode on op inputs (``ops.py``: by identity and by storage, so views such as
``weight.t()`` saved for backward count too); module hooks alone would miss tied weights and params read outside
their own module. Post-backward is found the way FSDP2 finds it (``hooks.py``): an identity autograd function on the
module's grad-requiring inputs (FSDP2's ``RegisterPostBackwardFunction``) whose backward runs once their grads are
ready.

In-place ops (``nn.ReLU(inplace=True)``, ``out += identity``) run on what that identity returns as they run on the
call's inputs: it returns aliases that autograd does not treat as views (see ``hooks.PostBackwardMarker``). A call that
modifies its own grad-requiring inputs in place is recorded, since FSDP2's function on them would refuse it
(``ModuleInfo.shardable``). Tensors saved for backward are checked as autograd checks them without hooks: one
modified in place after it was saved fails the trace as it fails the real step (``saved.py``).

Each pass of the step is a ``session.TraceSession``; this module is the entry point around it.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from fsdp_planner.batch import paused_gc
from fsdp_planner.routing import DEFAULT_CAPACITY
from fsdp_planner.trace.compiled import compiled_blocks
from fsdp_planner.trace.compiled_loss import LossInputs, compiled_loss
from fsdp_planner.trace.full_precision import subtree_params
from fsdp_planner.trace.input_casts import group_input_casts
from fsdp_planner.trace.records import CompiledBlock, CompiledLoss, Trace
from fsdp_planner.trace.session import TraceRequest, TraceSession, step_inputs
from fsdp_planner.trace.walk import TracedModel


def record(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    measure: bool = False,
    reuse: bool = True,
    compute_dtype: torch.dtype | None = None,
    routing: float = DEFAULT_CAPACITY,
    full_precision: tuple[str, ...] = (),
    cast_inputs: bool = False,
    cast_buffers: bool = False,
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

    ``routing`` is the capacity factor of the stand-in that data-dependent ops (a ``torch.where`` router, an
    ``.item()`` check) run while planned (``routing.py``); the trace's ``notes`` say where it stood in.

    ``full_precision``: modules that keep fp32 under ``compute_dtype``, as an fp32 group of their own runs them
    (``full_precision.py``): their params are not cast, their calls' inputs are cast to fp32 and outputs back.

    ``cast_inputs``: every module holding params casts its floating inputs to ``compute_dtype``, as FSDP2 does
    for a module a group lists (``input_casts.py``); ``Trace.cast_inputs`` names those where that changed a dtype.
    ``cast_buffers``: floating buffers are cast to ``compute_dtype`` too (a model converted whole to it).
    """
    if measure and compute_dtype is not None:
        raise ValueError("a measured trace runs the model as it is: no compute_dtype")
    args, kwargs = split_inputs(example_inputs)
    request = TraceRequest(model, args, kwargs, loss_fn or default_loss, measure, reuse, compute_dtype, routing,
                           tuple(full_precision), cast_inputs, cast_buffers)
    with paused_gc():
        return _trace(request)


@contextlib.contextmanager
def _params_cast(model: nn.Module, dtype: torch.dtype | None, full_precision: tuple[str, ...] = (),
                 buffers: bool = False) -> Iterator[None]:
    """Floating params' data cast to ``dtype`` (same Parameter objects), put back on exit; those of the
    ``full_precision`` modules kept. ``buffers``: floating buffers too, as ``model.to(dtype)`` converts a model
    built in another dtype for a precision that stores it in ``dtype`` (pure-bf16)."""
    if dtype is None:
        yield
        return
    kept = subtree_params(dict(model.named_modules()), full_precision)
    originals = [(p, p.data) for p in dict.fromkeys(model.parameters())
                 if p.is_floating_point() and p.dtype != dtype and id(p) not in kept]
    held = [(m._buffers, name, b) for m in model.modules() for name, b in m._buffers.items()
            if buffers and b is not None and b.is_floating_point() and b.dtype != dtype]
    try:
        for p, data in originals:
            p.data = data.to(dtype)
        for owner, name, b in held:
            owner[name] = b.to(dtype)
        yield
    finally:
        for p, data in originals:
            p.data = data
        for owner, name, b in held:
            owner[name] = b


def _trace(request: TraceRequest) -> Trace:
    # Imported before the step, not by its first decomposition (``_disable_dynamo`` imports it then): that import
    # leaves module frames in reference cycles (``torch.fx.wrap`` keeps its caller's), which hold the step's frames
    # and so its tensors while the collector is paused, and the loss's live bytes would depend on what ran before.
    importlib.import_module("torch._dynamo")
    model = request.model
    traced = TracedModel.of(model)  # the params' own dtypes, before the cast
    methods: dict[str, str] = {}
    with _params_cast(model, request.compute_dtype, request.full_precision, request.cast_buffers):
        # a non-forward method found reading params is wrapped and the step traced again (methods.py); a wrapped
        # method may reveal another (one it calls on a child), so up to a few passes
        for _ in range(_METHOD_PASSES):
            session = TraceSession(request, traced, methods)
            tr = session.run()
            new = {m: name for m, name in session.finder.found.items() if m not in methods}
            if not new:
                return tr
            methods |= new
    return tr


_METHOD_PASSES = 4


def record_compiled(model: nn.Module, example_inputs: Any, names: list[str], compute_dtype: torch.dtype | None = None,
                    variants: Mapping[str, Callable[[nn.Module], nn.Module]] | None = None,
                    cast_inputs: tuple[str, ...] = (), alike: Mapping[str, str] | None = None
                    ) -> dict[str, CompiledBlock]:
    """Each of ``names`` compiled (``compiled.py``: what it saves for backward, the bytes and kernels of its
    fused graphs), in the step's compute dtype as ``record`` runs it; the model on meta. ``cast_inputs``: the
    step's ``Trace.cast_inputs``, whose group casts run outside the compiled code, before it. ``alike``: which
    compile as one (``compiled.alike_blocks``; default: those of one static signature)."""
    args, kwargs = split_inputs(example_inputs)
    request = TraceRequest(model, args, kwargs, default_loss, compute_dtype=compute_dtype)
    casts: contextlib.AbstractContextManager = contextlib.nullcontext()
    if cast_inputs and compute_dtype is not None:
        modules = dict(model.named_modules())
        casts = group_input_casts({m: modules[m] for m in cast_inputs}, (), compute_dtype, [])
    with _params_cast(model, compute_dtype), casts:
        return compiled_blocks(model, *step_inputs(request), names, variants, alike)


def record_compiled_loss(model: nn.Module, loss_fn: Callable[[Any], torch.Tensor], given: LossInputs,
                         compute_dtype: torch.dtype | None, full_precision: tuple[str, ...] = ()) -> CompiledLoss:
    """The loss compiled (``compiled_loss.py``) on the outputs the traced step gave it, the model's params in the
    compute dtype as ``record`` runs them (a loss that reads a param, a tied output layer's, reads it so)."""
    with _params_cast(model, compute_dtype, full_precision):
        return compiled_loss(loss_fn, given)


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


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """A factory's example inputs as ``model(*args, **kwargs)`` takes them: a dict is kwargs, a tuple or list
    positional args, anything else the one positional arg."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def run_model(model: nn.Module, example_inputs: Any) -> Any:
    """``model`` on a factory's example inputs (``split_inputs``: a dict is keyword inputs, transformers')."""
    args, kwargs = split_inputs(example_inputs)
    return model(*args, **kwargs)
