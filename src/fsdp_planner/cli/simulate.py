"""``fsdp-planner simulate MODEL --cluster SPEC``: one step of a plan in time and memory, optionally drawn as a
timeline (``--timeline`` PNG, ``--html`` page) beside a second plan (``--compare``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path

import fsdp_planner.cli.render as render
from fsdp_planner.choices import PolicyName
from fsdp_planner.cli.common import REPORTER, load_plan, load_trace, policy_plan, tracer
from fsdp_planner.cli.paths import picture_file
from fsdp_planner.cli.requests import (
    PlanSource,
    compare_source,
    configured,
    memory_budget,
    micro_batches,
    model_spec,
    named_cluster,
    plan_source,
    policy_notes,
    policy_request,
    sim_options,
)
from fsdp_planner.configs.job_config import JobConfig
from fsdp_planner.configs.torchtitan_registry import PLAN_NAME
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import json_text
from fsdp_planner.fsdp2.checkpointing import titan_routers
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.report.step_view import StepView, step_view
from fsdp_planner.report.timeline_html import write_html
from fsdp_planner.report.timeline_png import write_png
from fsdp_planner.service.configured import classes_named_by, graphed_host_note
from fsdp_planner.service.fit import config_verdict
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.planning import with_reshard
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.options import SimOptions, with_early_stop
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.trace.records import Trace

PNG_SUFFIXES = (".png", ".svg", ".pdf")
HTML_SUFFIXES = (".html", ".htm")


def run(args: argparse.Namespace) -> int:
    with titan_routers() if args.from_torchtitan else contextlib.nullcontext():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    tp_note = _tp_note(args)  # (before the config's job sets --tp)
    args, config = configured(args)  # --from-torchtitan / --from-accelerate: the config's job over these options
    png = picture_file(args.timeline, "--timeline", PNG_SUFFIXES, force=args.force)
    page = picture_file(args.html, "--html", HTML_SUFFIXES, force=args.force)
    if micro_batches(args) > 1 and (png or page):  # (refuses --micro-batches auto too)
        raise PlannerError("--timeline and --html draw a step of one micro-batch: drop --micro-batches to draw it")
    sources = [plan_source(args), *filter(None, [compare_source(args)])]
    cluster, options = named_cluster(args, args.cluster), sim_options(args)
    policies = [s.policy.name for s in sources if s.policy]
    ran = " and ".join(f"{o} {v}" for o, v in (("--policy", args.policy), ("--compare", args.compare))
                       if v in {p.value for p in policies})
    budget = memory_budget(args, cluster)
    for note in policy_notes(args, policies, f"with {ran}", plan_file=not policies, budgeted=True):
        render.note(note)
    tr = load_trace(model_spec(args), args.measure, full=args.full_trace,
                    precision=options.precision)
    # the config's reshard_after_forward on the first plan
    with classes_named_by(config):
        plans = [(_label(s, p), with_reshard(p, config.reshard) if i == 0 and config else p)
                 for i, s in enumerate(sources) for p in [_plan(tr, s, model_spec(args), cluster, options)]]
    if config is not None and config.plan is not None:  # an export's job runs the plan it holds
        held = load_plan(f"{config.path}'s {PLAN_NAME}", tr, model_spec(args), cluster.world_size, options,
                         config.plan)
        plans[0] = (f"{config.path} ({held.policy})" if held.policy else config.path, held)
    if args.against is not None:
        if len(plans) > 1:
            raise PlannerError("--against draws one plan beside its measured trace: drop --compare")
        from fsdp_planner.cli.simulate_against import against

        return against(tr, plans[0], cluster, options, args.against, (png, page), args.json)
    if png is None and page is None:  # no picture: the step's numbers alone, without recording its timeline
        reports = [(label, simulate(tr, p, cluster, options, timeline=False)) for label, p in plans]
    else:
        views = [step_view(tr, p, cluster, options, label, budget) for label, p in plans]
        _draw(views, png, page, f"{short_label(model_spec(args).label())} on {cluster.name}")
        reports = [(v.label, v.report) for v in views]
    _graphed_note(config, reports[0][1])
    verdict = _verdict(args, config is not None, tr, plans[0][1], reports[0][1], cluster, options, budget)
    _show(args, reports, plans, verdict, cluster, options, budget, tp_note, tr.compiled_loss is not None,
          tr.loss_chunks)
    for path in filter(None, (png, page)) if not args.json else ():  # (the JSON document stays alone on stdout)
        render.plain(f"timeline written to {path}")
    return 0


def _graphed_note(config: JobConfig | None, report: StepReport) -> None:
    """A torchtitan job's CUDA graphs spend no host time on the launches its eager step here waits on."""
    if config is not None and (said := graphed_host_note(config, report)) is not None:
        render.note(said)


def _tp_note(args: argparse.Namespace) -> str | None:
    """What ``--tp`` makes of ``--batch`` (``render.tp_batch``); None for a config's TP degree, whose job's batch
    torchtitan reads so, and beside a plan file, whose TP is its own (--tp has no effect there: both were said)."""
    config = args.from_torchtitan or args.from_accelerate
    given = args.tp is not None and args.tp > 1
    return render.tp_batch(args.tp) if given and not config and not getattr(args, "plan", None) else None


def _show(args: argparse.Namespace, reports: list[tuple[str, StepReport]], plans: list[tuple[str, Plan]],
          verdict: str | None, cluster: Cluster, options: SimOptions, budget: MemoryBudget,
          tp_note: str | None = None, loss_compiled: bool = False, loss_chunks: int = 0) -> None:
    """The steps' figures: one JSON document, or the verdict first, then each step's lines and memory table;
    ``tp_note``: said first; ``loss_compiled``: the step's loss is compiled (a model computing its loss in its
    forward has none to compile, whatever ``--compile-loss`` said); ``loss_chunks``: the chunks the trace ran its
    loss in (0: whole; a model without an output layer to chunk runs it whole whatever ``--loss-chunks`` said)."""
    if tp_note is not None:
        render.note(tp_note)
    if args.json:
        summaries = [{**r.summary(), "budget": budget.to_dict(r.reserved_memory),
                      "micro_batches": options.micro_batches, "gradient_sync": options.gradient_sync.value,
                      "loss_chunks": loss_chunks,
                      **({"checkpoint_early_stop": with_early_stop(p, options).checkpoint_early_stop}
                         if p.checkpoints else {})}
                     for (_, r), (_, p) in zip(reports, plans, strict=True)]
        doc = summaries[0] if len(reports) == 1 else {**summaries[0], "compare": summaries[1]}
        print(json_text({**doc, **({"verdict": verdict} if verdict else {})}, indent=2))
        return
    if verdict is not None:  # the first line: nothing this cluster runs without CPU offload fits
        render.plain(verdict)
    for (label, r), (_, p) in zip(reports, plans, strict=True):
        # what changes the step beyond the grouping: compiled blocks, float8 matmuls
        label += ", blocks compiled" if model_spec(args).compile else ""
        label += ", loss compiled" if loss_compiled else ""
        float8 = options.float8 or p.float8  # the command line's, or the plan file's own (plan_options)
        label += f", {float8.describe()}" if float8 else ""
        # torchtitan's wrapper (its jobs), --no-early-stop or a plan file's own: recomputation re-runs the block
        label += ", checkpointed blocks re-run whole (early_stop=False)" if p.checkpoints and \
            not with_early_stop(p, options).checkpoint_early_stop else ""
        for line in render.step_lines(render.workload_label(model_spec(args).label(), options.micro_batches,
                                                            options.gradient_sync), label,
                                      cluster, r, bool(p.activation_offloading)):
            render.console.print(line)
        render.console.print(render.memory_table(r.peak_memory, r.reserved_memory, r.memory_at_peak, budget))


def _verdict(args: argparse.Namespace, from_config: bool, tr: Trace, plan: Plan, report: StepReport,
             cluster: Cluster, options: SimOptions, budget: MemoryBudget) -> str | None:
    """A config's job that offloads or is over the budget: the verdict when auto fits nothing on the cluster
    without CPU offload either (``--no-offload``: an error)."""
    if not from_config or not (plan.offload or not budget.fits(report.reserved_memory)):
        return None
    # auto as plan --from-... runs it: its own checkpointing, layout and memory options, not the config's
    auto = dataclasses.replace(policy_request(args, PolicyName.AUTO.value), checkpointing=None, mesh=None)
    plain = options.with_memory_options(False, options.shard_placement)
    job = PlanJob(model_spec(args), (auto,), cluster, plain, budget)
    verdict = config_verdict(job, tracer(False, args.full_trace), tr, report if plan.offload else None, REPORTER)
    if verdict is not None and args.no_offload:
        raise PlannerError(f"{verdict} (--no-offload)")
    if verdict is None and not budget.fits(report.reserved_memory):  # (the fit: note above is auto's own plan)
        render.note("the configuration as given is over the budget (below), and auto's own plan of the same job "
                    "fits (the fit: line above): `fsdp-planner plan` with the same options writes it")
    elif verdict is None:  # (it offloads: a trial read the fit: line as a stray, its step beside none of this job's)
        render.note("the configuration offloads to the CPU, and auto's own plan of the same job fits without CPU "
                    "offload (the fit: line above, its step beside this one's below): `fsdp-planner plan` with the "
                    "same options writes it")
    return verdict


def short_label(label: str) -> str:
    """A model's label for a title: a model file named without its folders (an absolute path is no title)."""
    name, sep, rest = label.partition(", ")
    if ".py:" in name:
        path, _, fn = name.rpartition(":")
        name = f"{Path(path).name}:{fn}"
    return name + sep + rest


def _plan(tr: Trace, source: PlanSource, model: ModelSpec, cluster: Cluster, options: SimOptions) -> Plan:
    if source.plan_file is not None:
        return load_plan(str(source.plan_file), tr, model, cluster.world_size, options)
    assert source.policy is not None
    return policy_plan(tr, source.policy, model, cluster, options)  # checked against the cluster


def _label(source: PlanSource, plan: Plan) -> str:
    """How the output names a plan (``step_view`` names an unnamed one "plan" too)."""
    if source.policy is not None:
        return plan.policy or "plan"
    return f"{source.plan_file} ({plan.policy})" if plan.policy else str(source.plan_file)


def _draw(views: list[StepView], png: Path | None, page: Path | None, title: str) -> None:
    if png is not None:
        write_png(views, png, title)
    if page is not None:
        write_html(views, page, title)

