"""``fsdp-planner calibrate --trace TRACE.json [--trace ...] --model M --plan P --out cluster.json``: fit a cluster to
a job's own torch.profiler traces (``calibrate/trace_fit.py``), and show measured beside predicted."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from rich.table import Table

import fsdp_planner.cli.render as render
from fsdp_planner.calibrate.kineto import MeasuredTrace, read_trace
from fsdp_planner.calibrate.trace_fit import TraceFit, fit_trace
from fsdp_planner.cli.common import load_plan, load_trace, policy_plan
from fsdp_planner.cli.paths import output_file
from fsdp_planner.cli.requests import policy_request
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_count, json_text
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.hardware.cluster import Cluster, Engine, parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.records import Trace

MAX_TRACES = 64  # one per rank of a job of 64 ranks, or a few runs of fewer


FEW_STEPS = 3  # profiled steps below which the fit has no middle third to keep (``trace_fit.typical_steps``)


def run_trace(args: argparse.Namespace) -> int:
    if not args.trace:
        raise PlannerError("--model, --plan and --policy name the job of --trace: give its traces with --trace")
    if args.logs or args.overhead or args.compute or args.cpu_optimizer or args.backend:
        raise PlannerError("--trace fits a cluster from traces alone: give no nccl-tests logs, --overhead, "
                           "--compute, --cpu-optimizer or --backend with it")
    if len(args.trace) > MAX_TRACES:
        raise PlannerError(f"at most {MAX_TRACES} --trace files, got {len(args.trace)}")
    if not args.trace_model or bool(args.plan) == bool(args.policy):
        raise PlannerError("--trace needs the traced job: --model M and one of --plan P or --policy NAME")
    out = output_file(args.out, "cluster.json", force=args.force, kind="cluster")
    assert out is not None
    traces = [read_trace(path) for path in args.trace]
    if (profiled := sum(len(t.steps) for t in traces)) < FEW_STEPS:
        render.note(f"the traces hold {fmt_count(profiled, 'profiled step')}: the fit takes each as typical, a "
                    f"warm-up's or a slow step's time too; profile {FEW_STEPS} or more (torch.profiler's schedule, "
                    "active=3), of which the middle third is fitted")
    options = SimOptions.named(args.precision)
    # the traced job ran the blocks its plan compiles compiled: what they fuse and save is traced so (--compile)
    spec = ModelSpec(args.trace_model, batch_size=args.batch, seq_len=args.seq,
                     compile=bool(args.plan and Plan.load(args.plan).compiled))
    tr = load_trace(spec, precision=options.precision)
    base = parse_cluster(args.base) if args.base else None
    plan = _plan(args, tr, spec, traces)
    cluster, fit = fit_trace(tr, plan, traces, base, options)
    if base is not None:
        _note_raised_peaks(base, cluster)
    cluster.save(out)
    if args.json:
        # before and after as every STEP is written (StepReport.summary), and the steps as the measured ones ran
        steps = {"before": fit.before.summary(), "after": fit.after.summary(), "before_step": fit.before_step,
                 "after_step": fit.after_step}
        print(json_text({"out": str(out), "cluster": cluster.to_dict(),
                         "fit": render.json_ready({**asdict(fit), **steps})}, indent=2))
        return 0
    for table in fit_tables(fit):
        render.console.print(table)
    if cluster.engine is not Engine.HOST and cluster.overhead.op_seconds > 0:
        launch = cluster.overhead.op_seconds * 1e6
        render.plain(f"the step beyond what its kernels take is charged to the host: {launch:.1f} us a launched op "
                     "(the GPU waits on it), which the trace's FSDP2 ranges do not time")
    render.plain(f"cluster written to {out}: {cluster.describe()}")
    render.plain(f"predict another plan's step with it: fsdp-planner simulate {args.trace_model} --plan PLAN.json "
                 f"--cluster {out} --against TRACE.json")
    return 0


def _note_raised_peaks(base: Cluster, cluster: Cluster) -> None:
    """Say where the fit raised the data sheet's peaks (kernels ran faster than the base's peak: an fp32 job's
    TF32 matmuls, or a --base of another GPU), which every plan costed with the cluster inherits."""
    before, after = base.gpu, cluster.gpu
    flops, hbm = after.peak_bf16_flops / before.peak_bf16_flops, after.hbm_bandwidth / before.hbm_bandwidth
    if flops > 1 or hbm > 1:
        raised = " and ".join(f"{what} x{up:.2f}" for what, up in (("FLOP/s peaks", flops),
                                                                      ("HBM bandwidth", hbm)) if up > 1)
        render.note(f"the traced kernels ran faster than {before.name}'s data sheet allows, so the cluster's "
                    f"{raised} are raised to match (an fp32 job's matmuls on TF32, or a --base of another GPU?): "
                    "plans of another precision costed with it inherit that")


def _plan(args: argparse.Namespace, tr: Trace, spec: ModelSpec, traces: list[MeasuredTrace]) -> Plan:
    world = max(t.world for t in traces)
    if args.plan:
        plan = load_plan(args.plan, tr, spec)
        check_plan_world_size(plan, world)
        return plan
    if args.policy == "auto":
        raise PlannerError("auto's plan depends on the cluster it planned for: give the traced job's plan file "
                           "(plan --policy auto --out P.json, then verify --plan P.json) with --plan")
    return policy_plan(tr, policy_request(args, args.policy), spec)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def fit_tables(fit: TraceFit) -> list[Table]:
    """Measured beside predicted, per op class, per collective and size, and the step's parts."""
    steps = f"the {fit.steps} typical steps" if fit.steps != 1 else "the 1 typical step"
    ops = Table(title=f"ops a step: measured (mean of {steps}) vs predicted")
    for col in ("class", "ops measured", "ops simulated", "measured", "before fit", "after fit"):
        ops.add_column(col, justify="left" if col == "class" else "right")
    for r in fit.classes:
        ops.add_row(r.op_class, str(r.ops_measured), str(r.ops_simulated), _ms(r.measured), _ms(r.before),
                    _ms(r.after))
    comms = Table(title="collectives: one call, measured (mean) vs charged")
    for col in ("collective", "size", "ranks", "a step", "measured", "before fit", "after fit"):
        comms.add_column(col, justify="left" if col == "collective" else "right")
    for c in fit.collectives:
        comms.add_row(c.kind, fmt_bytes(c.nbytes), str(c.ranks), str(c.count), _ms(c.measured), _ms(c.before),
                      _ms(c.after))
    step = Table(title="the step")
    for col in ("", "measured", "before fit", "after fit"):
        step.add_column(col, justify="left" if not col else "right")
    b, a = fit.before, fit.after
    name = "step" if fit.optimizer else "step (forward and backward: no optimizer step was profiled)"
    step.add_row(name, _ms(fit.measured_step), _ms(fit.before_step), _ms(fit.after_step))
    # (not one quantity: the trace times FSDP2's own ranges, the model the host's whole work, each op's launch too)
    step.add_row("host: measured FSDP2's ranges; simulated launches, hooks, copies", _ms(fit.measured_host),
                 _ms(b.host_time + b.copy_time), _ms(a.host_time + a.copy_time))
    step.add_row("exposed communication", _ms(fit.measured_exposed), _ms(b.exposed_comm), _ms(a.exposed_comm))
    return [ops, comms, step]
