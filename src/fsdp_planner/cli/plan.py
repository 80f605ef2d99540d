"""``fsdp-planner plan MODEL``: a plan for the model, or every policy side by side."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import Any

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.cli.common import REPORTER, run_flags, tracer
from fsdp_planner.cli.requests import plan_request
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_time, json_text
from fsdp_planner.fsdp2.checkpointing import titan_routers
from fsdp_planner.fsdp2.pitfalls import Finding
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.answers import (
    ANSWER_LOSS_CHUNKS,
    compile_answer,
    compile_loss_answer,
    compiled_float8_answer,
    float8_answer,
    loss_chunks_answer,
)
from fsdp_planner.planners.auto.explain import GroupExplanation
from fsdp_planner.service.fit import offload_verdict
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.outcome import PlanOutcome
from fsdp_planner.service.planning import as_written, judged_model, plan
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.userfiles import write_atomic


def run(args: argparse.Namespace) -> int:
    if args.from_torchtitan or args.from_accelerate:  # the config's job beside auto's, and the keys that differ
        from fsdp_planner.cli.from_config_plan import run_plan

        with titan_routers() if args.from_torchtitan else contextlib.nullcontext():
            return run_plan(args)
    request = plan_request(args)
    job = request.job
    if job.default_cluster is not None:
        render.notes.print(f"auto: no --cluster given, planning for {job.default_cluster}", highlight=False)
    for note in request.notes:
        render.note(note)
    outcome = plan(job, tracer(job.measure, job.full_trace), REPORTER)
    if args.tp is not None and args.tp > 1:  # (after the planning: not before an error)
        render.note(render.tp_batch(args.tp))
    if outcome.splits:
        _split_note(outcome)
    verdict = offload_verdict(outcome, tracer(False, job.full_trace), REPORTER)
    if verdict is not None and args.no_offload:
        raise PlannerError(f"{verdict} (--no-offload)")
    no_fit = outcome.no_fit
    if request.out is not None:
        assert outcome.plan is not None
        write_atomic(request.out, outcome.plan.checked_json() + "\n")
    if request.json:
        doc = {**_json(outcome), **({"auto": {"fits": False, "message": no_fit}} if no_fit else {}),
               **({"verdict": verdict} if verdict else {})}
        if outcome.explanation is not None:
            doc["auto"]["explanation"] = [_explanation(r) for r in outcome.explanation.groups]
        print(json_text(doc, indent=2))
        return 1 if no_fit else 0
    if verdict is not None:  # the first line: the plan below is auto's last resort
        render.plain(verdict)
    _print(outcome)
    if request.out is not None:
        flags = run_flags(outcome.job, bool(outcome.splits), written=outcome.plan)
        render.plain(f"plan written to {request.out}{flags}")
    if no_fit:
        render.plain(f"auto: {no_fit}")  # it names the budget's source: a cluster file's GPU
        return 1
    return 0


def _split_note(outcome: PlanOutcome) -> None:
    """``--micro-batches auto``, or auto's default comparison of splits: the split chosen, each split's plan."""
    shown = ", ".join(f"{s.micro_batches}: {fmt_time(s.step_time)}{'' if s.fits else ' (does not fit)'}"
                      for s in outcome.splits)
    n, batch = outcome.job.options.micro_batches, outcome.job.model.batch_size
    if not outcome.job.split_by_default:
        render.note(f"--micro-batches auto: {n} micro-batches of {batch} (step time of each split's auto plan: "
                    f"{shown})")
    elif n > 1:
        render.note(f"auto splits --batch {n * batch} into {n} micro-batches of {batch}, the fastest split that fits "
                    f"(step time of each split's auto plan: {shown}; --micro-batches 1 keeps the batch whole)")
    elif len(outcome.splits) > 1:  # (each split is a search of its own: said, so that the time it took is not a
        # mystery; one alone was a batch kept whole for its BatchNorm, which its own note says)
        render.note(f"auto kept --batch {batch} whole, the fastest that fits of the splits it compared (step time "
                    f"of each split's auto plan: {shown}; --micro-batches 1 plans the whole batch only)")


def _explanation(r: GroupExplanation) -> dict[str, Any]:
    """One group of ``--explain`` for ``--json``."""
    return {"group": r.group, "modules": r.modules, "bytes": r.nbytes, "all_gather": r.all_gather,
            "latency_share": r.latency_share, "hidden_by": r.hidden_by, "held_by": r.reason.value,
            "why": r.reason.description, "alternative": r.alternative.value if r.alternative else None,
            "alternative_step": r.alternative_step, "alternative_reserved": r.alternative_peak}


def _json(outcome: PlanOutcome) -> dict[str, Any]:
    job, tr, budget = outcome.job, outcome.trace, outcome.job.budget

    def simulation(r: StepReport | None) -> dict[str, Any]:
        if r is None:
            return {}
        return {"simulation": r.summary(), **({"budget": budget.to_dict(r.reserved_memory)} if budget else {})}

    out: dict[str, Any] = {
        "model": {"name": job.model.name, "fingerprint": tr.fingerprint, "numel": tr.numel},
        "micro_batches": job.options.micro_batches, "gradient_sync": job.options.gradient_sync.value,
        "loss_chunks": tr.loss_chunks,
        "plans": [{"plan": as_written(p, job, tr).to_dict(),  # (as --out writes it: its float8, precision, ...)
                   "metrics": m.to_dict(), **simulation(r)} for p, m, r in outcome.rows],
    }
    search = outcome.search
    if search is not None and outcome.fits:
        out["auto"] = {"budget": search.budget, "budget_source": search.budget_source, "fits": search.fits,
                       "plans_simulated": search.evaluated, "plans_refined": search.refined,
                       "search_effort": search.effort, "seconds": search.seconds}
    return out


def _print(outcome: PlanOutcome) -> None:
    console, job, tr, rows = render.console, outcome.job, outcome.trace, outcome.rows
    console.print(render.model_line(render.workload_label(job.model.label(), job.options.micro_batches,
                                                           job.options.gradient_sync), tr))
    if len(rows) == 1:  # the plan as it is written (its compiled modules and float8 are named in the title)
        console.print(render.groups_table(outcome.plan or rows[0][0], tr))
    dtype = render.metrics_dtype(tr, job.options.precision)
    f8 = job.options.float8
    console.print(render.comparison_table("per training step (FSDP2 semantics)", rows, job.budget, dtype,
                                          float8_gather=f8 is not None and f8.fsdp_float8_all_gather))
    report = rows[0][2]
    if len(rows) == 1 and report is not None and job.budget is not None:
        console.print(render.margin_line(report.reserved_memory, job.budget), highlight=False)
    search, why = outcome.search, outcome.explanation
    if search is None or not outcome.fits:
        return
    console.print(render.auto_line(search), highlight=False)
    _what_ifs(outcome)
    if why is None:
        return
    for part in render.explanation(why.groups, search.report.step_time, search.report.reserved_memory, collapse=True):
        console.print(part, highlight=False)
    if why.checkpointing is not None:
        console.print(escape(why.checkpointing), highlight=False)
    console.print(render.host_line(search.report, why.cluster, why.host), highlight=False)
    if why.cluster.overhead.source:  # a preset's citation, or the machine a calibration measured (from a file)
        console.print(escape(f"host figures: {why.cluster.overhead.source}"), highlight=False)


def _what_ifs(outcome: PlanOutcome) -> None:
    """What torch.compile and float8 training would change for auto's plan (or, for a job that has them, what
    going without would), step and memory: the user's choices (numerics, compile time), so said, not planned."""
    job, auto = outcome.job, outcome.auto
    if auto is None or job.cluster is None or job.budget is None or outcome.search is None:
        return
    # auto's plan, whose step is the base (in a comparison the first row is a classic policy's)
    plan = as_written(auto.written_plan, job, outcome.trace)
    base, model, trace = outcome.search.report, job.model, outcome.trace
    if job.auto is not None and (judged := judged_model(model, job.auto, plan)) is not model:
        # the alternatives of a TP layout auto chose answer for the workload it judged, or for a fraction of the job
        model, trace = judged, tracer(job.measure, job.full_trace)(judged, job.options)
    found = [float8_answer(trace, plan, job.cluster, job.options, base, job.budget)]
    other = None
    # compiling the blocks to see what compile changes takes AOTAutograd seconds to a minute (a transformers model):
    # asked for with --explain; a --compile job's eager step is a plain trace
    if model.compile or job.explain:
        with contextlib.suppress(PlannerError):  # a model without repeated blocks does not compile: no line
            other = tracer(job.measure, job.full_trace)(dataclasses.replace(model, compile=not model.compile),
                                                        job.options)
    if other is not None:
        found.append(compile_answer(other, plan, job.cluster, job.options, base, job.budget))
        found.append(compiled_float8_answer(other, plan, job.cluster, job.options, base, job.budget))
    if model.compile_loss or job.explain:  # (a second trace, and dynamo on the loss: seconds)
        with contextlib.suppress(PlannerError):
            loss = tracer(job.measure, job.full_trace)(
                dataclasses.replace(model, compile_loss=not model.compile_loss), job.options)
            found.append(compile_loss_answer(loss, plan, job.cluster, job.options, base, job.budget))
    found.append(_loss_chunks_answer(job, model, plan, base))
    for f in found:
        if f is not None:
            render.console.print(escape(f"{f.message}: {f.fix}"), highlight=False)


def _loss_chunks_answer(job: PlanJob, model: ModelSpec, plan: Plan, base: StepReport) -> Finding | None:
    """With ``--explain``, auto's plan with the output layer and loss in torchtitan's default chunks beside it (a
    job with chunks: beside its loss whole); None where the model cannot run them (its loss in its forward, a
    soft-cap after its output layer, tokens that do not split). Traced on meta, its notes unsaid (they describe
    the alternative, not the job); a measured job has none."""
    if not (model.loss_chunks or job.explain) or job.cluster is None or job.budget is None or job.measure:
        return None
    other = dataclasses.replace(model, loss_chunks=0 if model.loss_chunks else ANSWER_LOSS_CHUNKS)
    try:
        trace = trace_spec(other, job.options.precision, job.full_trace)
    except PlannerError:
        return None
    if trace.loss_chunks == model.loss_chunks:  # (no output layer found: the loss traced as it was)
        return None
    return loss_chunks_answer(trace, plan, job.cluster, job.options, base, job.budget)
