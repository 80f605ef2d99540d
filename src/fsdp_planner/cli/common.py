"""What several commands do: load and trace the model a spec names, and get the plan they were asked for."""

from __future__ import annotations

import shlex

import fsdp_planner.cli.render as render
import fsdp_planner.service.plan_files as plan_files
import fsdp_planner.service.planning as planning
from fsdp_planner.choices import DEFAULT_OPTIMIZER, DEFAULT_PRECISION, GradientSync
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec, as_spec, exit_message, load_model
from fsdp_planner.planners.registry import PolicyRequest
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.planning import Reporter, Tracer
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.failures import model_error
from fsdp_planner.trace.records import Trace

REPORTER = Reporter(render.note, render.progress)  # the service's notes and progress, on stderr


def load_trace(spec: ModelSpec | str, measure: bool = False, full: bool = False,
               precision: Precision | None = None, threads: int | None = None, repeats: int = 3) -> Trace:
    """The model's trace on meta tensors, in ``precision``'s compute dtype (default: the default precision's);
    with ``measure``, then timed for real on the local device (median of ``repeats`` steps, with ``threads`` CPU
    threads when given).
    ``full``: every module call traced (no replay of repeated blocks)."""
    named = as_spec(spec)
    if measure and (named.compile or named.compile_loss or named.loss_chunks):
        # (the ops are timed on the model run eager, whole: a compiled plan's step was predicted from that eager
        # trace, and said to be traced eager though --compile was given: a trial)
        raise PlannerError("--measure times the model's ops as they run eager, its loss whole, and this step compiles "
                           "its blocks or loss or runs its loss in chunks: drop --measure (the step time then comes "
                           "from the cluster's compute model), or measure the step as it runs eager")
    with render.progress(f"tracing {spec}"):
        tr = trace_spec(spec, precision, full, render.trace_note)
        return _measured(as_spec(spec), tr, threads, repeats) if measure else tr


def tracer(measure: bool, full: bool) -> Tracer:
    """How the command line traces a job's model: on meta (``full``: every module call), the ops timed on this
    machine with ``measure``."""
    return lambda spec, options: load_trace(spec, measure, full=full, precision=options.precision)


def _measured(spec: ModelSpec, tr: Trace, threads: int | None, repeats: int) -> Trace:
    from fsdp_planner.runtime.measure import check_fits, local_device
    from fsdp_planner.runtime.measure import measure as measure_ops

    device = local_device()
    check_fits(tr, device, spec)
    real = load_model(spec, meta=False)
    try:
        measured = measure_ops(real.model, real.example_inputs, real.loss_fn, repeats=repeats, device=device,
                              threads=threads)
    except PlannerError:
        raise
    except SystemExit as e:
        raise PlannerError(exit_message(e, f"measuring '{spec}' on {device.type}")) from e
    except Exception as e:
        raise PlannerError(f"measuring '{spec}' on {device.type} failed: {model_error(e)}") from e
    render.notes.print(f"[dim]compute times measured on this machine's {device.type} "
                       f"({sum(measured.op_seconds or ()) * 1e3:.1f} ms of ops per step)"
                       f"{'; CPU times, not the cluster GPUs' if device.type == 'cpu' else ''}[/dim]", highlight=False)
    return measured


def policy_plan(tr: Trace, request: PolicyRequest, model: str, cluster: Cluster | None = None,
                options: SimOptions | None = None) -> Plan:
    """The plan a policy makes for the traced model (auto: for ``cluster``)."""
    return planning.policy_plan(tr, request, model, cluster, options, REPORTER)


def load_plan(path: str, tr: Trace, model: ModelSpec | str, world: int | None = None,
              options: SimOptions | None = None, text: str | None = None) -> Plan:
    """The plan file for the traced ``model``, checked (``service/plan_files.py``; against ``world`` ranks too),
    its notes on stderr (``text``: the plan's JSON held elsewhere, ``path`` naming where)."""
    return plan_files.load_plan(path, tr, model, render.note, world, options, text)


def run_flags(job: PlanJob, split: bool, workload: bool = False, written: Plan | None = None) -> str:
    """What ``simulate`` and ``verify`` of the written plan must be given for the step it was planned for: the
    plan file records the workload and the optimizer and the two commands run their options' (`` (simulated as
    ...)``; empty when nothing is needed). ``split``: auto chose the micro-batches; ``workload``: the batch and
    sequence came from a job config, not the command line (the model is named too: the user never typed it);
    ``written``: the plan file, whose recorded workload is what the two commands check the flags against (with TP,
    each data-parallel rank's batch: a trial was told --batch 4 for a plan of batch 8, TP 2)."""
    opts, model = job.options, job.model
    n, flags = opts.micro_batches, [shlex.quote(model.name)] if workload else []
    if n > 1 and (split or workload):
        recorded = written.workload if written is not None else None
        batch = recorded.batch if recorded is not None and recorded.micro_batches == n else n * (model.batch_size or 1)
        flags += ["--batch", str(batch), "--micro-batches", str(n)]
        if opts.gradient_sync is not GradientSync.LAST:
            flags += ["--gradient-sync", opts.gradient_sync.value]
    elif workload and model.batch_size is not None:
        flags += ["--batch", str(model.batch_size)]
    elif written is not None and written.workload is not None and written.tp_degree > 1:
        # (TP d runs d x the batch on each data-parallel rank, which the plan records and the commands take: a
        # trial's simulate of auto's TP 2 plan ran batch 1, 121 ms for the plan's 188)
        flags += ["--batch", str(written.workload.batch)]
    if workload and model.seq_len is not None:
        flags += ["--seq", str(model.seq_len)]
    if opts.precision.name != DEFAULT_PRECISION:  # (the plan records it; the commands run their option's)
        flags += ["--precision", opts.precision.name]
    if opts.optimizer.name != DEFAULT_OPTIMIZER:
        flags += ["--optimizer", opts.optimizer.name]
    if model.compile:  # (the plan names its compiled blocks; the step traced compiled needs the option)
        flags.append("--compile")
    if model.compile_loss:
        flags.append("--compile-loss")
    if model.loss_chunks:
        flags += ["--loss-chunks", str(model.loss_chunks)]
    return f" (simulated with {' '.join(flags)}: give simulate and verify the same)" if flags else ""
