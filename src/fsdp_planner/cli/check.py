"""``fsdp-planner check MODEL [--plan FILE | --policy NAME]``: FSDP pitfalls in a model and a plan, each with its
severity and fix. Exit 1 when a finding is an error (the run would fail or be wrong: a step failing in the
precision's compute dtype among them, ``sim/tracing.py``), 0 otherwise, 2 for bad input. With ``--cluster``, a
plan without errors also gets ``info`` answers (``planners/answers.py``): the step with grads reduced in the other
dtype, on the best HSDP layout, and with a node-sized ``reshard_after_forward``."""

from __future__ import annotations

import argparse

import fsdp_planner.cli.render as render
from fsdp_planner.cli.common import REPORTER, load_trace
from fsdp_planner.cli.requests import (
    cluster_or_none,
    memory_budget,
    model_spec,
    policy_notes,
    policy_request,
    sim_options,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import json_text
from fsdp_planner.fsdp2.claim import SplitParamError
from fsdp_planner.fsdp2.pitfalls import (
    Code,
    Finding,
    Severity,
    has_errors,
    model_findings,
    plan_findings,
    routing_skip_findings,
)
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import complex_reduce_problem
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.planners import PolicyName
from fsdp_planner.planners.answers import answers
from fsdp_planner.planners.auto import Target
from fsdp_planner.service.plan_files import plan_to_check
from fsdp_planner.service.planning import grouping_to_check
from fsdp_planner.service.tracing import LayoutDoesNotRun, routing_skips
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.tracing import PrecisionError
from fsdp_planner.trace.records import Trace

DEFAULT_POLICY = PolicyName.MODULE  # what hand-written FSDP code does most: each block, the root takes the rest


def run(args: argparse.Namespace) -> int:
    if args.plan and args.policy:
        raise PlannerError("give at most one of --plan FILE or --policy NAME")
    options, cluster = sim_options(args), cluster_or_none(args)
    tr, findings = _model(args, options)
    fsdp1 = args.target == Target.FSDP1.value
    plan, label, refused = _plan(args, tr, cluster, options)
    findings += refused
    if plan is not None:
        findings += plan_findings(tr, plan, _world(cluster, plan), fsdp1=fsdp1)
    if plan is not None and cluster is not None and not has_errors(findings):
        with render.progress(f"check: simulating the plan's alternatives on {cluster.name}"):
            findings += answers(tr, plan, cluster, options, memory_budget(args, cluster))
    if args.json:
        print(json_text([f.to_dict() for f in findings], indent=2))
    else:
        _show(args.model, label if plan is not None or refused else None, findings)  # refused: checked, cannot run
    return 1 if has_errors(findings) else 0


def _world(cluster: Cluster | None, plan: Plan) -> int | None:
    """The ranks the plan is checked on: the cluster's, else the ones its file says it was made for (a reshard
    size FSDP2 refuses on them is an error without --cluster too)."""
    if cluster is not None:
        return cluster.world_size
    return plan.workload.ranks if plan.workload is not None and plan.workload.ranks else None


def _model(args: argparse.Namespace, options: SimOptions) -> tuple[Trace, list[Finding]]:
    """The model's trace and its findings; a step that fails in the precision's compute dtype is an error finding
    (the real run crashes), the rest checked on the step in the model's own dtypes."""
    try:
        tr = load_trace(model_spec(args), full=args.full_trace, precision=options.precision)
        complex_params = [p.fqn for p in tr.params if p.dtype.startswith("complex") and p.requires_grad]
        problem = complex_reduce_problem(options.precision, complex_params)  # the ranks would raise
        failed = [Finding(Severity.ERROR, Code.PRECISION, problem, "train it with --precision fp32")] if problem else []
        skips = routing_skip_findings(routing_skips(model_spec(args), tr))
        return tr, [*failed, *model_findings(tr, options.precision), *skips]
    except PrecisionError as e:
        failed = Finding(Severity.ERROR, Code.PRECISION, e.problem, e.fix, e.module)
        return e.own_dtypes, [failed, *model_findings(e.own_dtypes, options.precision)]


def _plan(args: argparse.Namespace, tr: Trace, cluster: Cluster | None, options: SimOptions
          ) -> tuple[Plan | None, str, list[Finding]]:
    """The plan to check, how to call it, and the finding of a layout asked for (``--tp``, ``--ep``) that cannot
    run; no plan when the policy cannot make one (a note, or that finding, says why)."""
    if args.plan:
        for note in policy_notes(args, [], plan_file=True):
            render.note(note)
        label = f"the plan in {args.plan}"
        try:
            return plan_to_check(args.plan, tr, model_spec(args), render.note,
                                 cluster.world_size if cluster else None, options.micro_batches), label, []
        except SplitParamError as e:  # a pitfall check names, not a file it cannot read
            owner = e.param.rpartition(".")[0]
            return None, label, [Finding(Severity.ERROR, Code.TIED_ACROSS_GROUPS, e.problem, e.fix, owner)]
        except LayoutDoesNotRun as e:  # as --tp's: a plan that cannot run, not a file it cannot read
            return None, label, [Finding(Severity.ERROR, Code.DOES_NOT_RUN, str(e),
                                         "give the plan a tensor-parallel layout its model's code runs")]
    name = args.policy or DEFAULT_POLICY.value
    label = f"the plan of --policy {name}" + ("" if args.policy else " (the default: each block sharded, the root "
                                                                       "takes the rest)")
    request = policy_request(args, name)
    try:
        return grouping_to_check(tr, request, args.model, cluster, options, REPORTER), label, []
    except PlannerError as e:
        if "--cluster" in str(e):
            raise
        asked = [f"--{k} {getattr(args, k)}" for k in ("tp", "ep") if getattr(args, k, None) not in (None, 1)]
        if asked:  # the job asked for cannot run: a gate on check's exit status must fail it
            return None, label, [Finding(Severity.ERROR, Code.DOES_NOT_RUN, str(e),
                                         f"plan it without {' and '.join(a.split()[0] for a in asked)}, or give a "
                                         "layout in a plan file")]
        render.note(f"--policy {name} makes no plan for this model: {e}")
        return None, label, []


def _show(model: str, label: str | None, findings: list[Finding]) -> None:
    """``label``: the plan checked; None when the policy made none (only the model was checked)."""
    what = f"the model, and {label}" if label else "the model only (no plan to check)"
    render.console.print(f"checked {model}: {what}", highlight=False, markup=False)
    if not findings:
        render.console.print("no findings: FSDP2 accepts this plan and nothing in it is wasteful that check knows of"
                             if label else "no findings in the model", highlight=False)
        return
    render.console.print(render.findings_table(findings))
    errors = sum(f.severity is Severity.ERROR for f in findings)
    infos = sum(f.severity is Severity.INFO for f in findings)
    answered = f", {infos} answer(s) (info: the simulator's figures for a change to the plan)" if infos else ""
    render.console.print(f"{errors} error(s), {len(findings) - errors - infos} warning(s){answered}",
                         highlight=False)
