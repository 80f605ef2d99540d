"""``fsdp_planner.plan``: the one call a training script makes to get its FSDP2 plan.

It runs what ``fsdp-planner plan MODEL --policy P --cluster C --json`` runs (the trace at the precision's compute
dtype, the policy, auto's search on the cluster) and returns the plan that command writes with ``--out``, so a
script and the command line agree plan for plan. The model may be built on meta (no memory) or for real: a real
model is traced under fake tensors and its params, their values, dtypes and grads, are left as they were, so the
script can plan and then train the very model it built.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map_only

from fsdp_planner.arguments import checked
from fsdp_planner.attention import kernel
from fsdp_planner.choices import DEFAULT_OPTIMIZER, DEFAULT_PRECISION, PolicyName, Target, ZeroGrad
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.hardware.cluster import MAX_WORLD_SIZE, Cluster
from fsdp_planner.models import MAX_ROUTING, MIN_ROUTING, LoadedModel, ModelSpec
from fsdp_planner.patching import FAKE_TENSOR_LOGGER, quiet_loggers
from fsdp_planner.routing import DEFAULT_CAPACITY
from fsdp_planner.service.job import DEFAULT_CLUSTER, PlanJob
from fsdp_planner.service.outcome import PlanOutcome
from fsdp_planner.service.plan_files import checked_on_trace, traced_otherwise
from fsdp_planner.service.planning import plan as plan_job
from fsdp_planner.service.tracing import (
    LayoutDoesNotRun,
    as_the_job_runs,
    built_by,
    step_failure,
    step_loss,
    trace_spec,
)
from fsdp_planner.service.validate import Keywords, Spelling, splits
from fsdp_planner.service.validate import cluster as checked_cluster
from fsdp_planner.service.validate import plan_job as checked_job
from fsdp_planner.sim import tracing
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.metrics import PlanMetrics
from fsdp_planner.sim.metrics import plan_metrics as metrics_of
from fsdp_planner.sim.options import Precision, SimOptions, precision_named
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.sim.simulate import simulate as simulate_step
from fsdp_planner.trace.chunked_loss import cross_entropy
from fsdp_planner.trace.failures import model_error
from fsdp_planner.trace.records import Trace


def plan(model: nn.Module | str, inputs: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
         cluster: Cluster | str = DEFAULT_CLUSTER, policy: str = PolicyName.AUTO.value,
         precision: str = DEFAULT_PRECISION, optimizer: str = DEFAULT_OPTIMIZER, batch: int | None = None,
         seq: int | None = None, ac: str | None = None, ac_policy: str | None = None, early_stop: bool | None = None,
         mesh: str | None = None, memory_budget: int | str | None = None, headroom: float | str | None = None,
         micro_batches: int | str | None = None, offload: bool = False, module_classes: tuple[str, ...] = (),
         search_effort: int | None = None, target: str = Target.FSDP2.value, reduce_dtype: str | None = None,
         shard_placement: str | None = None, attention: str | None = None,
         routing: float | None = None, hf_config: dict[str, Any] | None = None,
         gradient_sync: str | None = None, tp: int | None = None, loss_parallel: bool | None = None,
         async_tp: bool = False, ep: int | None = None, ep_placement: str | None = None,
         fp32_modules: tuple[str, ...] = (), loss_chunks: int | None = None, compile: bool = False,
         compile_loss: bool = False, float8: str | None = None, float8_all_gather: bool | None = None,
         float8_skip: tuple[str, ...] = (), float8_tp_all_gather: bool | None = None,
         zero_grad: str = ZeroGrad.NONE.value) -> Plan:
    """The FSDP2 plan for ``model`` on ``cluster``: the plan ``fsdp-planner plan ... --policy POLICY --out`` writes
    for the same model and options. Each keyword is the option of the same name, ``-`` as ``_`` (``tp`` is
    ``--tp``, ``compile`` ``--compile``, ``float8`` ``--float8``, ``zero_grad`` ``--zero-grad``), checked by the same
    validator with the same types and ranges (a bool is a bool); the README's Python API section says what each
    does. ``micro_batches="auto"`` is auto's choice of the split of ``batch`` (a MODEL spec string with ``batch``
    and ``policy="auto"``); ``hf_config`` a dict of ``--hf-config`` fields, for an ``hf:`` MODEL spec;
    ``loss_chunks=0`` the loss whole.

    ``model`` is an ``nn.Module`` (on meta or real) with its ``inputs`` (a tuple of positional args, one tensor or
    a dict of kwargs: one micro-batch of one rank) and optional ``loss_fn`` (default: the mean of squares of the
    output), or a MODEL spec string (``"toy-llama"``, ``"path/model.py:build"``, ``"hf:..."``) whose factory
    ``batch`` and ``seq`` reach, as ``--batch`` and ``--seq`` do. ``cluster``: a preset such as ``"h100:64"``, a
    cluster JSON path, or a ``Cluster``. Raises ``PlannerError`` with one sentence for a bad argument, and when
    auto finds no plan within the memory budget.

    A real model is traced as its meta twin (params and buffers as meta tensors, ties kept, nothing copied) with
    its inputs on meta and the real tensors its ``loss_fn`` reads moved to meta, as the command line traces a
    factory's model; a step that cannot run on meta (a tensor made on an explicit device in forward) is traced on
    the real model under fake tensors instead, its params' values, dtypes and grads restored.
    """
    _check_model(model, inputs, loss_fn, policy, batch, seq, hf_config, micro_batches)
    keywords = Keywords(
        model=model if isinstance(model, str) else None, cluster=cluster, policy=policy, precision=precision,
        optimizer=optimizer, batch=batch, seq=seq, ac=ac, ac_policy=ac_policy, early_stop=early_stop, mesh=mesh,
        memory_budget=memory_budget, headroom=headroom, micro_batches=micro_batches, offload=offload,
        module_classes=module_classes or None, search_effort=search_effort, target=target,
        reduce_dtype=reduce_dtype, shard_placement=shard_placement, attention=attention, routing=routing,
        hf_config=hf_config, gradient_sync=gradient_sync, tp=tp, loss_parallel=loss_parallel, async_tp=async_tp,
        ep=ep, ep_placement=ep_placement, fp32_modules=fp32_modules or None,
        loss_chunks=None if loss_chunks == 0 and type(loss_chunks) is int else loss_chunks, compile=compile,
        compile_loss=compile_loss, float8=float8, float8_all_gather=float8_all_gather,
        float8_skip=float8_skip or None, float8_tp_all_gather=float8_tp_all_gather, zero_grad=zero_grad,
        inputs_batch=not isinstance(model, str))
    job = checked_job(keywords, Spelling.API, None if isinstance(model, str) else type(model).__name__,
                      split_by_default=True)
    said: list[str] = []  # the trace's notes: the API prints none, but warns of a compiled loss it could not give
    outcome = _outcome(job, model, inputs, loss_fn, said.append)
    _warn_compiled_loss(said, stacklevel=3)
    assert outcome.plan is not None  # one policy: its plan, or its error
    return outcome.plan


def _warn_compiled_loss(said: list[str], stacklevel: int) -> None:
    """The trace's notes of a loss it could not compile, as warnings at the caller's line (``stacklevel`` from
    here) (planned eager: a trial's loss reading a value was, without a word); the API prints no other note."""
    for line in dict.fromkeys(n for n in said if n.startswith("--compile-loss:")):
        warnings.warn(api_spelling(line), stacklevel=stacklevel)


def _outcome(job: PlanJob, model: nn.Module | str, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
             note: Callable[[str], None]) -> PlanOutcome:
    """The job planned for a MODEL spec or an ``nn.Module``, the trace's notes to ``note``; an error is the
    service's, in the API's names (the same error: a ``PrecisionError`` keeps its class and fields)."""
    try:
        if isinstance(model, str):
            return plan_job(job, lambda spec, options: trace_spec(spec, options.precision, note=note))
        with built_by(lambda spec: _meta_twin(model, inputs, cross_entropy if spec.loss_chunks else loss_fn)):
            return _planned_module(job, model, inputs, loss_fn, note)
    except PlannerError as e:
        e.args = (api_spelling(str(e)), *e.args[1:])
        raise


_OPTION = re.compile(r"(?<![\w/.-])--(no-)?([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?![\w./-])")  # (not in a path, nor
# a torchtitan override, --compile.enable)


def api_spelling(message: str) -> str:
    """A sentence of the planning service with each command-line option that is a keyword of ``plan`` written as
    the keyword (``--compile-loss`` as compile_loss, ``--no-float8-all-gather`` as float8_all_gather=False): a
    script's caller passed no option (a trial's errors named --tp and --float8-skip)."""
    def keyword(m: re.Match[str]) -> str:
        name = m.group(2).replace("-", "_")
        if name not in _KEYWORDS:
            return m.group(0)
        return f"{name}=False" if m.group(1) else name
    return _OPTION.sub(keyword, message)


_KEYWORDS = frozenset(inspect.signature(plan).parameters) - {"model", "inputs", "loss_fn"}


@checked
def simulate(trace: Trace, plan: Plan, cluster: Cluster | str | None = None, options: SimOptions | None = None, *,
             context: SimContext | None = None, timeline: bool = True) -> StepReport:
    """One step of ``plan`` on ``cluster`` (a ``Cluster``, a preset such as ``"h100:64"`` or a cluster JSON path):
    ``fsdp-planner simulate``'s figures. The plan is checked against ``trace`` as the command line checks a plan
    file: a hand-written plan (module lists, as ``Plan.load`` reads one) gets its params derived; one made for
    another model, or naming modules, checkpointing or params the model lacks, is a one-sentence ``PlannerError``
    (unchecked, such a plan simulated a step that gathers nothing). ``timeline=False`` skips the timeline, which
    only pictures need; a ``context`` (``SimContext(trace, cluster, options)``, built once) in place of ``cluster``
    and ``options`` simulates many plans of one trace faster."""
    named = checked_cluster(cluster, Spelling.API)
    if named is None and context is None:
        raise PlannerError("simulate needs a cluster: a Cluster, a preset such as 'h100:8' or a cluster JSON path")
    checked_plan = _checked_plan(plan, trace)
    world = context.world if context is not None else named.world_size
    check_plan_world_size(checked_plan, world * (checked_plan.tp_degree if trace.tensor_parallel else 1))
    for line in traced_otherwise(checked_plan, trace):  # (eager figures of a compiled plan, without a word: a trial)
        warnings.warn(api_spelling(line).replace("this command traced", "the trace took") +
                      ("; compile, compile_loss and loss_chunks are keywords of trace()" if ": add " in line else ""),
                      stacklevel=3)
    return simulate_step(trace, checked_plan, named, options, context=context, timeline=timeline)


@checked
def trace(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
          precision: Precision | str = DEFAULT_PRECISION, reuse: bool = True,
          routing: float | None = DEFAULT_CAPACITY, fp32_modules: Sequence[str] = (), *, compile: bool = False,
          compile_loss: bool = False, loss_chunks: int = 0) -> Trace:
    """One training step of ``model`` traced as FSDP2 runs it under ``precision`` (``sim.tracing.trace``, whose
    docstring says how), on the model's meta twin with its inputs and loss on meta, as ``plan`` traces a module: a
    real model gives its meta twin's figures, the command line's (traced under fake CPU tensors it took CPU kernels'
    choices, and counted its first op's save of the batch as an activation: a trial of the API), and is left
    untouched. A model that cannot be copied, or whose step runs on real tensors only, is traced itself under fake
    tensors. ``compile``, ``compile_loss`` and ``loss_chunks`` trace the step as a plan of ``plan`` with them runs
    it (its blocks or loss compiled, its loss in chunks), as ``--compile``, ``--compile-loss`` and
    ``--loss-chunks`` do: ``simulate`` of such a plan on an eager trace gives eager figures, and warns."""
    routing = DEFAULT_CAPACITY if routing is None else routing  # (None: the default, as plan() takes it)
    if isinstance(routing, bool) or not isinstance(routing, int | float) or not MIN_ROUTING <= routing <= MAX_ROUTING:
        raise PlannerError(f"trace's routing must be a capacity factor from {MIN_ROUTING} to {MAX_ROUTING:g}, got "
                           f"{routing!r}")  # (NaN included: no comparison holds)
    if compile or compile_loss or loss_chunks:
        if not reuse:
            raise PlannerError("compile, compile_loss and loss_chunks trace the step as plan() does, its repeated "
                               "blocks replayed: leave reuse=True")
        said: list[str] = []
        try:
            spec = ModelSpec(type(model).__name__, routing=routing, fp32_modules=tuple(fp32_modules),
                             compile=compile, compile_loss=compile_loss, loss_chunks=loss_chunks)
            options = SimOptions(precision=tracing.resolve_precision(precision))
            tr = _traced_module(model, example_inputs, loss_fn, spec, options, note=said.append)
        except PlannerError as e:  # (in the API's names, as plan()'s)
            e.args = (api_spelling(str(e)), *e.args[1:])
            raise
        _warn_compiled_loss(said, stacklevel=4)  # (the caller's line: trace is wrapped by @checked)
        return tr
    try:
        copy, meta_inputs = _on_meta(model, example_inputs)
    except Exception:  # (a module deepcopy cannot copy: a lock, a handle)
        copy = None
    if copy is not None:
        try:
            return tracing.trace(copy, meta_inputs, _on_meta_loss(loss_fn), precision, reuse, routing, fp32_modules)
        except PlannerError:
            raise
        except Exception:
            if copy is model:  # (on meta already: the model's own error)
                raise
    return tracing.trace(model, example_inputs, loss_fn, precision, reuse, routing, fp32_modules)


@checked
def plan_metrics(trace: Trace, plan: Plan, world_size: int | None = None,
                 precision: Precision | str | None = None) -> PlanMetrics:
    """Collective counts and bytes of one step of ``plan`` on ``world_size`` ranks (None: nothing padded), at each
    param's dtype or ``precision``'s (a ``Precision`` or its name), the plan checked against ``trace`` as
    ``simulate`` checks it."""
    if world_size is not None and not 1 <= world_size <= MAX_WORLD_SIZE:
        raise PlannerError(f"plan_metrics's world_size must be a number of ranks from 1 to {MAX_WORLD_SIZE:,}, not "
                           f"{world_size}")
    named = precision_named(precision) if isinstance(precision, str) else precision
    checked_plan = _checked_plan(plan, trace)
    if world_size is not None:  # (an int reshard_after_forward FSDP2 refuses on them: as simulate refuses it)
        check_plan_world_size(checked_plan, world_size)
    return metrics_of(trace, checked_plan, world_size, named)


def _checked_plan(plan: Plan, trace: Trace) -> Plan:
    """``plan`` checked as a plan file is (its values, which a plan edited in Python may have set to anything:
    ``with_group(0, reshard_after_forward="no")`` failed in the replay), then against ``trace``."""
    Plan.from_json(plan.to_json(), where="the plan")
    return checked_on_trace(plan, trace)


def _check_model(model: object, inputs: Any, loss_fn: object, policy: object, batch: object, seq: object,
                 hf_config: object, micro_batches: object) -> None:
    """A MODEL spec string alone, or an ``nn.Module`` with what it needs; one policy (this call returns one plan)."""
    if policy is None:  # (the command line's comparison of every policy)
        raise PlannerError("policy must be a policy's name (auto, titan, module, size or order): plan returns that "
                           "policy's plan")
    if isinstance(model, str):
        if inputs is not None or loss_fn is not None:
            raise PlannerError("a MODEL spec string brings its own inputs and loss_fn (its factory's): give inputs "
                               "and loss_fn with an nn.Module only")
    elif isinstance(model, nn.Module):
        _check_module(model, inputs, batch, seq, hf_config, micro_batches)
        if loss_fn is not None and not callable(loss_fn):
            raise PlannerError(f"loss_fn must be a function of the model's output, got {type(loss_fn).__name__}")
    else:
        raise PlannerError(f"model must be an nn.Module or a MODEL spec string, got {type(model).__name__}")


def _check_module(model: nn.Module, inputs: Any, batch: object, seq: object, hf_config: object,
                  micro_batches: object) -> None:
    """What an ``nn.Module`` needs: its inputs, trainable params; the workload is its inputs'."""
    if batch is not None or seq is not None:
        raise PlannerError("batch and seq reach a MODEL spec's factory; with an nn.Module the inputs are the "
                           "workload: give inputs of one micro-batch instead (micro_batches=N: a step of N of them)")
    if splits(micro_batches):
        raise PlannerError("micro_batches='auto' lets auto split a MODEL spec's batch, which it traces at each split; "
                           "an nn.Module's inputs are one micro-batch: give micro_batches=N, a step of N of them")
    if hf_config is not None:
        raise PlannerError("hf_config sets fields of an hf: MODEL spec's config: build the nn.Module with them "
                           "instead")
    if inputs is None:
        raise PlannerError("give the model's example inputs (one micro-batch of one rank): plan(model, inputs)")
    if not any(p.requires_grad for p in model.parameters()):
        raise PlannerError("the model has no trainable parameters: FSDP plans are for training")


def _traced_module(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                   spec: ModelSpec, options: SimOptions, real: list[str] | None = None,
                   note: Callable[[str], None] = lambda line: None) -> Trace:
    """The module's step traced as the command line traces a factory's (``_step_of``): on its meta twin, or, when
    the step cannot run on meta, the real model under fake tensors (said in ``real``), where compile cannot be
    measured: a step that fails on real tensors too is said as the model's own error."""
    name, on_meta = type(model).__name__, None
    with kernel(spec.attention):
        try:
            copy, meta_inputs = _on_meta(model, inputs)
        except Exception as e:  # a module deepcopy cannot copy (a lock, a handle): the real model under fake tensors
            copy, on_meta = None, e
        try:  # the command line traces on meta: a real model's meta twin gives its figures, and leaves it untouched
            if copy is not None:
                return _step_of(LoadedModel(name, copy, meta_inputs, _on_meta_loss(loss_fn)), spec, options, note)
        except PlannerError:  # the verdict of the step in the precision (PrecisionError), compile's: the model's
            raise
        except (SystemExit, Exception) as e:
            if copy is model:
                raise step_failure(e, f"the {name} model") from e
            on_meta = e
        # a step that cannot run on meta (a tensor made on an explicit device in forward): the real model under
        # fake tensors, its grads kept (an error of the step is said once, not logged by each fake op it fails in),
        # eager
        compiled = spec.compile or spec.compile_loss
        with _grads_kept(model), quiet_loggers(FAKE_TENSOR_LOGGER, level=logging.CRITICAL):
            try:
                tr = _step_of(LoadedModel(name, model, inputs, loss_fn),
                              dataclasses.replace(spec, compile=False, compile_loss=False), options, note)
            except PlannerError:
                raise
            except (SystemExit, Exception) as e:
                raise step_failure(e, f"the {name} model") from e
        if compiled:
            why = f"on the meta copy, {model_error(on_meta)}" if copy is not None else \
                f"no meta copy can be made: {model_error(on_meta)}"
            raise PlannerError(f"{'compile' if spec.compile else 'compile_loss'}: what compiled code saves is "
                               f"measured on a meta copy of the {name} model, "
                               f"and its step runs on real tensors only ({why}): a tensor made on an explicit device "
                               "in its forward? make it on its input's device, e.g. device=x.device") from on_meta
        if real is not None:
            real.append(spec.name)
        return tr


def _step_of(lm: LoadedModel, spec: ModelSpec, options: SimOptions, note: Callable[[str], None]) -> Trace:
    """``lm``'s step under the job's routing capacity, its loss and blocks as the job runs them (compiled, in
    chunks: ``as_the_job_runs``), its notes to ``note``."""
    loss, given = step_loss(lm, spec, note)
    tr = tracing.trace(lm.model, lm.example_inputs, loss, precision=options.precision,
                       routing=spec.routing or DEFAULT_CAPACITY, fp32_modules=spec.fp32_modules)
    return as_the_job_runs(tr, lm, spec, given, options.precision, note)


def _on_meta(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """A copy of ``model`` whose params and buffers are meta tensors of the same shapes, dtypes and ties (no
    storage copied; a model on meta already is itself), and ``inputs`` on meta."""
    moved = tree_map_only(torch.Tensor, _meta, inputs)
    if all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers()):
        return model, moved
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return deepcopy(model, memo), moved


def _planned_module(job: PlanJob, model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                    note: Callable[[str], None]) -> PlanOutcome:
    """The job's outcome for an ``nn.Module``; a TP layout refused because the module's step runs only on real
    tensors (its meta twin fails whole, not for the layout) said so."""
    real: list[str] = []  # the traces that ran on the real model under fake tensors

    try:
        return plan_job(job, lambda spec, options: _traced_module(model, inputs, loss_fn, spec, options, real, note))
    except LayoutDoesNotRun as e:
        if not real:
            raise
        raise PlannerError(f"tp: one TP rank's step is checked on the {type(model).__name__} model's meta twin, and "
                           "its step runs only on real tensors (a tensor made on an explicit device in its forward: "
                           "make it on its input's device, e.g. device=x.device)") from e


def _meta_twin(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> LoadedModel:
    """A fresh meta twin of ``model`` with its inputs and loss on meta, as the service builds a MODEL spec's
    (``service/tracing.built_by``): one TP rank's step is checked on it, its Linears split (never the user's)."""
    try:
        copy, meta_inputs = _on_meta(model, inputs)
        twin = deepcopy(copy) if copy is model else copy
    except Exception as e:  # a module deepcopy cannot copy (a lock, a handle)
        raise PlannerError(f"tp: one TP rank's step is checked on a meta copy of the {type(model).__name__} model, "
                           f"which cannot be copied ({model_error(e)}): plan it without tp, or give its factory "
                           "as a MODEL spec string") from e
    return LoadedModel(type(model).__name__, twin, meta_inputs, _on_meta_loss(loss_fn))


class _RealToMeta(TorchFunctionMode):
    """Every real tensor a torch function reads moved onto meta first: a ``loss_fn`` closing over real targets
    (built beside the real model) reads them as the factory's meta twin would. A function mode, not a dispatch
    mode, because torch.compile traces through it (``compile_loss``): the move is then the graph's ``device_put``
    of the lifted target, which ``trace/compiled_loss`` counts as the caller's."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.compiler.is_compiling():  # (a move Dynamo traces: no requires_grad_ on an intermediate, which it
            # refuses, and no grad back to the real tensor, which meta cannot copy out: a real Parameter the loss
            # reads, a temperature, is a constant to the compiled loss; it compiled eager before, another plan)
            args, kwargs = tree_map_only(torch.Tensor, lambda t: t if t.is_meta else t.detach().to("meta"),
                                         (args, kwargs or {}))
        else:
            with _disable_current_modes():  # the move itself is no op of the step
                args, kwargs = tree_map_only(torch.Tensor, _meta, (args, kwargs or {}))
        return func(*args, **kwargs)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else t.detach().to("meta").requires_grad_(t.requires_grad)


def _on_meta_loss(loss_fn: Callable[[Any], torch.Tensor] | None) -> Callable[[Any], torch.Tensor] | None:
    if loss_fn is None:
        return None

    def loss(out: Any) -> torch.Tensor:
        with _RealToMeta():
            return loss_fn(out)

    return loss


class _grads_kept:
    """A real model's ``.grad`` of every param as it was before the trace (the fake step must leave none)."""

    def __init__(self, model: nn.Module) -> None:
        self.grads = [(p, p.grad) for p in model.parameters()]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for p, g in self.grads:
            p.grad = g
