"""The step traced at a precision: the package's public ``trace``, which every command calls too, so the Python
API and the command line share one default (the CLI's ``--precision``) and give the same figures.

The simulator sizes activations and traffic from the trace at the precision's compute dtype: a step traced in
fp32 and simulated under bf16-mixed would scale every activation by half, upcasts included, and give another step
time and peak than the command line. A model that cannot run in the compute dtype (a float32 tensor built in the
forward and multiplied with bfloat16 activations) is a verdict, not a detail: the real mixed-precision run crashes
the same way, so it is a ``PrecisionError`` that names the op, the module and the way out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.choices import DEFAULT_PRECISION
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.input_casts import float32_subject
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.targets import records_outputs, shardable_cover
from fsdp_planner.routing import DEFAULT_CAPACITY
from fsdp_planner.sim.options import precision_named
from fsdp_planner.trace.failures import LOSS, FailedOp, failed_at, first_line
from fsdp_planner.trace.recorder import record
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT


class PrecisionError(PlannerError):
    """The step runs in the model's own dtypes but fails in the precision's compute dtype. ``own_dtypes`` is the
    step traced in the model's own dtypes (``check`` reports its other findings on it)."""

    def __init__(self, precision: Precision, cause: Exception, own_dtypes: Trace) -> None:
        self.precision, self.own_dtypes = precision, own_dtypes
        self.failed = failed_at(cause)
        self.module = self.failed.module if self.failed is not None else ROOT
        dtype = str(precision.trace_dtype).removeprefix("torch.")
        where = f"{self.failed.describe()} raised " if self.failed is not None else ""
        self.problem = (f"the step fails in {dtype}, the compute dtype of precision '{precision.name}': "
                        f"{where}{type(cause).__name__}: {first_line(cause)}")
        inside = self.module not in (ROOT, LOSS)
        name = holding_params(own_dtypes, self.module) if inside else None
        # (a frozen module, a frozen backbone's BatchNorm, has no trainable params for an fp32 group to hold, nor
        # does any module above it: --fp32-modules refuses it, so it is not offered: a trial followed it there)
        group = f"keep the module in an fp32 group of its own (--fp32-modules {name or 'NAME'})" \
            if name or not inside else \
            f"keep it trainable in an fp32 group of its own ('{self.module}' and the modules above it hold no " \
            "trainable params, which --fp32-modules needs)"
        self.fix = ("cast in forward, so the op's operands share a dtype (build tensors with dtype=x.dtype, or "
                    "t.to(x.dtype); FSDP2 casts params, not buffers such as BatchNorm's running stats), "
                    f"{group}, or plan with --precision fp32")
        super().__init__(f"{self.problem}; {self.fix}")


def holding_params(tr: Trace, module: str) -> str | None:
    """The module an fp32 group can keep for a failure in ``module``: the module a parametrization belongs to
    (``head.fc`` for ``head.fc.parametrizations.weight.0``, whose params the group holds), else the nearest of
    ``module`` and its ancestors holding trainable params; None where none does."""
    module = module.split(".parametrizations.", 1)[0]
    while module != ROOT:
        if any(p.requires_grad and any(o == module or o.startswith(module + ".") for o in p.owners)
               for p in tr.params):
            return module
        module = module.rpartition(".")[0]
    return None


def resolve_precision(precision: Precision | str) -> Precision:
    """A precision given by name (``PRECISIONS``) or as itself."""
    return precision_named(precision) if isinstance(precision, str) else precision


def trace(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
          precision: Precision | str = DEFAULT_PRECISION, reuse: bool = True,
          routing: float = DEFAULT_CAPACITY, fp32_modules: Sequence[str] = ()) -> Trace:
    """One training step of ``model`` traced on meta/fake tensors as FSDP2 runs it under ``precision`` (a name
    such as ``'bf16-mixed'`` or ``'fp32'``, or a ``Precision``; the default is the command line's).

    Params and floating inputs are cast to the precision's compute dtype, as ``MixedPrecisionPolicy`` casts them,
    so what the model upcasts is recorded at its real size and ``simulate`` with the same precision gives the
    command line's figures. A step that fails in that dtype at a module holding trainable params and floating
    buffers (BatchNorm and its running stats, which FSDP2 does not cast) is traced again with every module of that
    class in fp32, as fp32 groups of their own run them (``Trace.full_precision``; the policies then give them such
    groups); a step failing in a module after one that adds an fp32 buffer to activations keeps that one so
    (``kept_before``); ``fp32_modules`` are kept in fp32 from the start (a router, as torchtitan keeps them). A
    step that still fails in that dtype but runs in the model's own dtypes raises ``PrecisionError`` (the real run
    would crash); one that fails in both raises what the model raised.
    ``routing`` is the capacity factor of data-dependent ops' stand-in (``routing.py``).
    ``fsdp_planner.trace.record`` is the recorder underneath, with an explicit ``compute_dtype``. A model with
    real params gets a compute-dtype copy of them while it is traced: build it on meta to spend no memory."""
    precision = resolve_precision(precision)
    dtype = precision.trace_dtype
    asked = kept = checked_fp32_modules(model, fp32_modules)
    # a precision storing params in the compute dtype (pure-bf16) has the model converted whole (model.to), its
    # floating buffers with it, where the model is not built so already
    uncast = precision.fsdp_dtypes()[0] is None  # FSDP2 casts nothing (pure-bf16, fp32, autocast)
    whole = dtype is not None and not precision.autocast and uncast and \
        any(p.requires_grad and p.is_floating_point() and p.dtype != dtype for p in model.parameters())
    step = functools.partial(record, model, example_inputs, loss_fn, reuse=reuse, routing=routing,
                             cast_buffers=whole)
    try:
        first = step(compute_dtype=dtype, full_precision=kept)
    except Exception as e:
        if dtype is None:
            raise
        cause = e
    else:
        return _groupable_fp32(first, asked)
    own: Trace | None = None  # the step in the model's own dtypes, traced when needed
    casting = False  # FSDP2's casts of the inputs of the modules a group lists (``input_casts.py``): tried last
    for _ in range(MAX_KEPT_CLASSES + 1):
        more = kept_in_fp32(model, failed_at(cause))
        if not more:  # an fp32 buffer added to activations fails a module after the one that added it
            own = own or step()
            more = kept_before(model, own, failed_at(cause))
        if more and not set(more) <= set(kept):
            kept = (*kept, *(m for m in more if m not in kept))
        elif casting or uncast:
            break
        else:
            casting = True
        try:  # (casting: every call traced, none replayed from an identical one: the casts of a replayed block
            # would go unrecorded, and its modules unhooked)
            tr = step(compute_dtype=dtype, full_precision=kept, cast_inputs=casting, reuse=reuse and not casting)
        except Exception as e:
            cause = e
            continue
        notes = (kept_note(model, kept, precision) if kept else "", cast_note(tr.cast_inputs, precision))
        return _groupable_fp32(replace(tr, notes=(*tr.notes, *(n for n in notes if n))), asked)
    # the same step in the model's own dtypes: what fails there too is the model's error, not the precision's
    raise PrecisionError(precision, cause, own or step()) from cause


def checked_fp32_modules(model: nn.Module, names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as modules an fp32 group can hold: modules of ``model`` with trainable params."""
    modules = dict(model.named_modules())
    for name in names:
        module = modules.get(name) if isinstance(name, str) else None
        if module is None or name == ROOT:
            raise PlannerError(f"fp32_modules: {str(name)[:80]!r} is not a submodule of the model (the root computes "
                               "in the precision's dtype)")
        if not any(p.requires_grad and p.is_floating_point() for p in module.parameters()):
            raise PlannerError(f"fp32_modules: module '{name}' holds no trainable params, so no group of its own "
                               "can keep it in fp32")
    return tuple(dict.fromkeys(names))


def _groupable_fp32(tr: Trace, names: Sequence[str]) -> Trace:
    """``tr``, where each of ``names`` (the user's fp32 modules) kept in fp32 (``Trace.full_precision``: not under a
    precision that casts nothing) can have the fp32 groups that keep all of its params so: FSDP2 cannot shard a
    module whose forward modifies its inputs in place, nor a transformers sub-model that records outputs, and such
    a module's own params would stay, silently, in the group above computing in the precision's dtype."""
    for name in names:
        info = tr.modules[name]
        if name not in tr.full_precision or (info.shardable and not records_outputs(tr, name)) or \
                (shardable_cover(tr, name) and not info.params):
            continue
        why = ("it is a transformers sub-model that records outputs, which fully_shard would stop recording"
               if records_outputs(tr, name) else
               "its forward modifies its inputs in place, which fully_shard on it breaks (FSDP2 hands a module's "
               "inputs on through an autograd function, and autograd refuses an in-place change of its outputs)")
        raise PlannerError(f"fp32_modules: '{name}' cannot have the FSDP2 group of its own that keeps its params in "
                           f"fp32: {why}; leave it out of fp32_modules, or name its children instead" +
                           ("" if records_outputs(tr, name) else
                            " or stop the in-place op (a router scaling its input by jitter noise in training, as "
                            "Phi-MoE's: a model option turns it off, --hf-config input_jitter_noise=0.0 there)"))
    return tr


MAX_KEPT_CLASSES = 4  # module classes kept in fp32 before the step is refused (a ResNet has one: BatchNorm2d)


def _needs_fp32(module: nn.Module) -> bool:
    """A module FSDP2 can keep in fp32 with a group of its own: it registers trainable params (the group's) and
    floating buffers (what FSDP2 never casts, e.g. BatchNorm's running stats)."""
    return any(p.requires_grad and p.is_floating_point() for p in module.parameters(recurse=False)) and \
        any(b.is_floating_point() for b in module.buffers(recurse=False))


def kept_in_fp32(model: nn.Module, failed: FailedOp | None) -> tuple[str, ...]:
    """The modules to run in fp32 after ``failed``: every module of the failing module's class that holds trainable
    params and floating buffers; none when the failing module is not such a module (its failure has another cause,
    e.g. a float32 tensor built in its forward, which an fp32 group would only hide)."""
    if failed is None or failed.module in (ROOT, LOSS):
        return ()
    module = model.get_submodule(failed.module)
    if not _needs_fp32(module):
        return ()
    return tuple(name for name, m in model.named_modules() if type(m) is type(module) and _needs_fp32(m))


def kept_before(model: nn.Module, own: Trace, failed: FailedOp | None) -> tuple[str, ...]:
    """The modules to run in fp32 when ``failed`` names a module that holds no floating buffer: the step's latest
    module before it (by first param read, in the model's own dtypes) that holds trainable params and floating
    buffers, with every module of its class: an fp32 buffer added to activations there makes what the failing
    module gets fp32, and that module's fp32 group casts its output back."""
    if failed is None or failed.module not in own.modules or own.modules[failed.module].first_use < 0:
        return ()
    at, named = own.modules[failed.module].first_use, dict(model.named_modules())
    before = [(info.first_use, name) for name, info in own.modules.items()
              if 0 <= info.first_use < at and name in named and _needs_fp32(named[name])]
    if not before:
        return ()
    source = type(named[max(before)[1]])
    return tuple(name for name, m in model.named_modules() if type(m) is source and _needs_fp32(m))


def cast_note(cast: tuple[str, ...], precision: Precision) -> str:
    """One line naming the modules that get float32 activations, which FSDP2 casts only where a group lists them:
    what every plan of this trace does (a --plan file that does not is refused: ``check_input_casts``)."""
    if not cast:
        return ""
    dtype = str(precision.trace_dtype).removeprefix("torch.")
    return (f"{float32_subject(cast)} activations (made by the forward before them, e.g. a float32 buffer added to "
            f"them) where '{precision.name}' computes in {dtype}: the step runs because FSDP2 casts a module's "
            "inputs at its pre-forward (MixedPrecisionPolicy.cast_forward_inputs), and only for a module a group "
            "lists, so every plan lists them (the policies do; a --plan file must)")


def kept_note(model: nn.Module, kept: tuple[str, ...], precision: Precision) -> str:
    """One line saying which modules need fp32 and why: what every plan of this trace must do (the trace comes
    before the plan, and a hand-edited --plan file that does not do it is refused: ``check_full_precision``)."""
    classes = ", ".join(dict.fromkeys(type(model.get_submodule(m)).__name__ for m in kept))
    return (f"{len(kept)} module(s) ({classes}) fail in the compute dtype of '{precision.name}' (floating buffers "
            "FSDP2 does not cast): they need fp32 groups of their own (MixedPrecisionPolicy(param_dtype=float32)), "
            "which the policies give them and a --plan file must too")
