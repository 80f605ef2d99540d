"""``fsdp-planner plan MODEL``: a plan for the model, or every policy side by side."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.cli.common import load_trace, run_auto, stamped
from fsdp_planner.cli.requests import PlanRequest, plan_request
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_time, json_text
from fsdp_planner.fsdp2.plan import Mesh, Plan, check_plan_world_size
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.auto import AutoResult, infeasible_message
from fsdp_planner.planners.auto.explain import GroupExplanation, explain
from fsdp_planner.planners.auto.split import choose_split
from fsdp_planner.planners.blocks import default_block_class
from fsdp_planner.planners.registry import PolicyName, PolicyRequest, make_policy
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.host_work import host_work
from fsdp_planner.sim.metrics import PlanMetrics, plan_metrics
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import write_atomic

Row = tuple[Plan, PlanMetrics, StepReport | None]  # a plan, its metrics, its simulated step (with a cluster)


def run(args: argparse.Namespace) -> int:
    if args.from_torchtitan or args.from_accelerate:  # the config's job beside auto's, and the keys that differ
        from fsdp_planner.cli.from_config_plan import run_plan

        return run_plan(args)
    request = plan_request(args)
    if request.default_cluster is not None:
        render.notes.print(f"auto: no --cluster given, planning for {request.default_cluster}", highlight=False)
    for note in request.notes:
        render.note(note)
    if request.split:
        request = _split(request)
    tr = load_trace(request.model, render.notes, request.measure, full=request.full_trace,
                    precision=request.options.precision)
    plans, auto, no_fit = _plans(tr, request)
    rows = _rows(tr, plans, request)
    if request.out is not None:
        # the precision goes with the plan: export sets it, so the code runs as the numbers assumed
        # and the attention kernel it was planned for (--attention; absent: the default), and the --hf-config
        # fields: verify and check rebuild the model the plan was made for
        kept = dataclasses.replace(rows[0][0], precision=request.options.precision.name,
                                   attention=request.model.attention or "", hf_config=request.model.hf_config)
        write_atomic(request.out, kept.checked_json() + "\n")
    if request.json:
        doc = {**_json(request, tr, rows, auto),
               **({"auto": {"fits": False, "message": no_fit}} if no_fit else {})}
        if request.explain and auto is not None and not no_fit:
            doc["auto"]["explanation"] = [_explanation(r) for r in explain(auto)]
        print(json_text(doc, indent=2))
        return 1 if no_fit else 0
    _print(request, tr, rows, auto)
    if request.out is not None:
        render.plain(f"plan written to {request.out}")
    if no_fit:
        render.plain(f"auto: {no_fit}")  # it names the budget's source: a cluster file's GPU
        return 1
    return 0


def _split(request: PlanRequest) -> PlanRequest:
    """``--micro-batches auto``: the request for the split of ``--batch`` whose auto plan is fastest within the
    budget (``planners/auto/split.py``), each split traced at its micro-batch and searched."""
    model, (policy,), cluster = request.model, request.policies, request.cluster
    assert model.batch_size is not None and cluster is not None

    def spec(n: int) -> ModelSpec:
        return dataclasses.replace(model, batch_size=model.batch_size // n)

    def search(n: int) -> AutoResult:
        options = dataclasses.replace(request.options, micro_batches=n)
        tr = load_trace(spec(n), render.notes, request.measure, full=request.full_trace, precision=options.precision)
        return run_auto(tr, policy, cluster, options, model.name, must_fit=False)

    best, tried = choose_split(model.batch_size, search)
    shown = ", ".join(f"{s.micro_batches}: {fmt_time(s.result.report.step_time)}"
                      f"{'' if s.result.fits else ' (does not fit)'}" for s in tried)
    render.note(f"--micro-batches auto: {best.micro_batches} micro-batches of {model.batch_size // best.micro_batches}"
                f" (step time of each split's auto plan: {shown})")
    return dataclasses.replace(request, model=spec(best.micro_batches),
                               options=dataclasses.replace(request.options, micro_batches=best.micro_batches))


def _compared(tr: Trace, request: PlanRequest) -> tuple[PolicyRequest, ...]:
    """The policies to run: in a comparison, module and titan only when the model has a block class to wrap (the
    user's --module-classes, which the module request carries, or a repeated one)."""
    named = any(p.module_classes for p in request.policies)
    if request.policy is not None or named or default_block_class(tr) is not None:
        return request.policies
    render.note("the module and titan policies are left out of the comparison: the model has no repeated "
                "block class (name the classes to wrap with --module-classes to compare them)")
    return tuple(p for p in request.policies if p.name not in (PolicyName.MODULE, PolicyName.TITAN))


Found = tuple[Plan, StepReport | None]  # a plan and, when its search simulated it, its step (not simulated again)


def _plans(tr: Trace, request: PlanRequest) -> tuple[list[Found], AutoResult | None, str | None]:
    """Each policy's plan, auto's search result, and why auto found no plan within the budget (in a comparison
    that is a result, not an error)."""
    auto: AutoResult | None = None
    plans: list[Found] = []
    no_fit: str | None = None
    for policy in _compared(tr, request):
        if policy.name is not PolicyName.AUTO:
            plans += [(p, None) for p in _classic(tr, policy, request)]
            continue
        assert request.cluster is not None
        found = run_auto(tr, policy, request.cluster, request.options, request.model.name,
                         must_fit=request.policy is not None)
        if not found.fits:
            no_fit = infeasible_message(found)
            continue
        auto = found
        plans.append((auto.written_plan, auto.report))  # as the command writes it: auto's run options in
    return plans, auto, no_fit


def _classic(tr: Trace, policy: PolicyRequest, request: PlanRequest) -> list[Plan]:
    """A classic policy's plan; in a comparison, none (with a note saying why) when the policy cannot take the
    requested settings or FSDP2 would fail on its plan: that is no baseline."""
    try:
        plan = make_policy(policy).plan(tr, request.model.name)
        world = request.cluster.world_size if request.cluster else None
        return [stamped(plan, tr, world, request.options)]
    except PlannerError as e:
        if request.policy is not None:
            raise
        render.note(f"the {policy.name.value} policy is left out of the comparison: {e}")
        return []


def _rows(tr: Trace, plans: list[Found], request: PlanRequest) -> list[Row]:
    """Each plan's metrics and, with a cluster, its simulated step (one context per layout: the comparison may mix
    auto's HSDP with pure FSDP); auto's plan keeps the step its search simulated."""
    cluster = request.cluster
    world = cluster.world_size if cluster else None
    contexts: dict[tuple[Mesh, SimOptions], SimContext] = {}

    def simulated(p: Plan, report: StepReport | None) -> StepReport | None:
        if cluster is None:
            return None
        check_plan_world_size(p, cluster.world_size)
        if report is not None:
            return report
        key = (p.layout(cluster.world_size), plan_options(p, request.options))
        if key not in contexts:
            contexts[key] = SimContext(tr, cluster, key[1], mesh=key[0])
        return simulate(tr, p, context=contexts[key], timeline=False)

    precision = request.options.precision if cluster else None  # the table's bytes in the simulation's dtypes
    return [(p, plan_metrics(tr, p, world, precision), simulated(p, r)) for p, r in plans]


def _explanation(r: GroupExplanation) -> dict[str, Any]:
    """One group of ``--explain`` for ``--json``."""
    return {"group": r.group, "modules": r.modules, "bytes": r.nbytes, "all_gather": r.all_gather,
            "latency_share": r.latency_share, "hidden_by": r.hidden_by, "held_by": r.reason.value,
            "why": r.reason.description, "alternative": r.alternative.value if r.alternative else None,
            "alternative_step": r.alternative_step, "alternative_reserved": r.alternative_peak}


def _json(request: PlanRequest, tr: Trace, rows: list[Row], auto: AutoResult | None) -> dict[str, Any]:
    budget = request.budget

    def simulation(r: StepReport | None) -> dict[str, Any]:
        if r is None:
            return {}
        return {"simulation": r.summary(), **({"budget": budget.to_dict(r.reserved_memory)} if budget else {})}

    out: dict[str, Any] = {
        "model": {"name": request.model.name, "fingerprint": tr.fingerprint, "numel": tr.numel},
        "micro_batches": request.options.micro_batches, "gradient_sync": request.options.gradient_sync.value,
        "plans": [{"plan": dataclasses.replace(p, attention=request.model.attention or "").to_dict(),
                   "metrics": m.to_dict(), **simulation(r)} for p, m, r in rows],
    }
    if auto is not None:
        out["auto"] = {"budget": auto.budget, "budget_source": auto.budget_source, "fits": auto.fits,
                       "plans_simulated": auto.evaluated,
                       "plans_refined": auto.refined, "search_effort": auto.effort, "seconds": auto.seconds}
    return out


def _print(request: PlanRequest, tr: Trace, rows: list[Row], auto: AutoResult | None) -> None:
    console, cluster = render.console, request.cluster
    console.print(render.model_line(render.workload_label(request.model.label(), request.options.micro_batches,
                                                           request.options.gradient_sync), tr))
    if len(rows) == 1:
        console.print(render.groups_table(rows[0][0], tr))
    dtype = render.metrics_dtype(tr, request.options.precision if cluster is not None else None)
    console.print(render.comparison_table("per training step (FSDP2 semantics)", rows, request.budget, dtype))
    report = rows[0][2]
    if len(rows) == 1 and report is not None and request.budget is not None:
        console.print(render.margin_line(report.reserved_memory, request.budget), highlight=False)
    if auto is None:
        return
    console.print(render.auto_line(auto), highlight=False)
    if request.explain:
        explanations = explain(auto)
        for part in render.explanation(explanations, auto.report.step_time, auto.report.reserved_memory,
                                       collapse=True):
            console.print(part, highlight=False)
        if auto.checkpointing is not None:
            console.print(escape(auto.checkpointing.describe(auto.plan)), highlight=False)
        ev = auto.search.ev
        console.print(render.host_line(auto.report, ev.cluster, host_work(ev.ctx, auto.plan)), highlight=False)
        if ev.cluster.overhead.source:  # a preset's citation, or the machine a calibration measured (from a file)
            console.print(escape(f"host figures: {ev.cluster.overhead.source}"), highlight=False)
