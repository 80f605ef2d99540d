"""``fsdp-planner plan MODEL``: a plan for the model, or every policy side by side."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fsdp_planner.cli import render
from fsdp_planner.cli.common import load_trace, run_auto
from fsdp_planner.cli.paths import output_file, write_output
from fsdp_planner.cli.requests import (
    cluster_or_none,
    model_spec,
    policy_notes,
    policy_request,
    sim_options,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Mesh, Plan, check_plan_world_size
from fsdp_planner.fsdp2.validity import check_plan_runs
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.planners.auto import AutoResult, infeasible_message
from fsdp_planner.planners.auto.explain import GroupExplanation, explain
from fsdp_planner.planners.blocks import default_block_class
from fsdp_planner.planners.registry import CLASSIC_POLICIES, PolicyName, make_policy
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.sim.options import DEFAULT_MFU, DEFAULT_OPTIMIZER
from fsdp_planner.sim.timeline import host_work, simulate

DEFAULT_AUTO_CLUSTER = "h100:8"


def run(args: argparse.Namespace) -> int:
    out = output_file(args.out)
    if out is not None and not args.policy:
        raise PlannerError("--out writes one plan: choose it with --policy")
    if args.explain and args.policy != PolicyName.AUTO.value:
        raise PlannerError("--explain explains an auto plan: add --policy auto")
    names = [PolicyName(args.policy)] if args.policy else list(CLASSIC_POLICIES)
    requests = [policy_request(args, n.value) for n in names]
    cluster, options = cluster_or_none(args), sim_options(args)
    if args.policy == PolicyName.AUTO.value and cluster is None:
        # as many H100s as a given --mesh has ranks
        default = f"h100:{Mesh.parse(args.mesh).size}" if getattr(args, "mesh", None) else DEFAULT_AUTO_CLUSTER
        cluster = parse_cluster(default)
        render.notes.print(f"auto: no --cluster given, planning for {default}", highlight=False)
    if not args.policy and cluster is not None:
        requests.append(policy_request(args, PolicyName.AUTO.value))
    measure = args.measure
    for note in _ignored(args, [r.name for r in requests], cluster is not None):
        render.note(note)
        measure = measure and not note.startswith("--measure")
    tr = load_trace(model_spec(args), render.notes, measure, full=args.full_trace, precision=options.precision)
    if not args.policy and not args.module_classes and default_block_class(tr) is None:
        render.note("the module and titan policies are left out of the comparison: the model has no repeated "
                    "block class (name the classes to wrap with --module-classes to compare them)")
        requests = [r for r in requests if r.name not in (PolicyName.MODULE, PolicyName.TITAN)]
    auto: AutoResult | None = None
    plans: list[Plan] = []
    no_fit: str | None = None  # in a comparison, auto finding no plan within the budget is a result, not an error
    for request in requests:
        if request.name is PolicyName.AUTO:
            assert cluster is not None
            found = run_auto(tr, request, cluster, options, args.model, must_fit=bool(args.policy))
            if not found.fits:
                no_fit = infeasible_message(found)
                continue
            auto = found
            plans.append(auto.plan)
        else:
            try:
                plan = make_policy(request).plan(tr, args.model)
                check_plan_runs(tr, plan)  # a plan FSDP2 would fail on is not a baseline: say why instead
                plans.append(plan)
            except PlannerError as e:
                if args.policy:
                    raise
                # in a comparison, a policy that cannot take the requested checkpointing is left out, with why
                render.note(f"the {request.name.value} policy is left out of the comparison: {e}")
    world = cluster.world_size if cluster else None
    contexts: dict[Mesh, SimContext] = {}  # one per layout: the comparison may mix auto's HSDP with pure FSDP

    def simulated(p: Plan) -> Any:
        if cluster is None:
            return None
        check_plan_world_size(p, cluster.world_size)
        mesh = p.layout(cluster.world_size)
        if mesh not in contexts:
            contexts[mesh] = SimContext(tr, cluster, options, mesh=mesh)
        return simulate(tr, p, context=contexts[mesh], timeline=False)

    rows = [(p, plan_metrics(tr, p, world), simulated(p)) for p in plans]
    if out is not None:
        write_output(out, plans[0].to_json() + "\n")
    if args.json:
        doc = {**_json(args.model, tr, rows, auto), **({"auto": {"fits": False, "message": no_fit}} if no_fit else {})}
        if args.explain and auto is not None and not no_fit:
            doc["auto"]["explanation"] = [_explanation(r) for r in explain(auto)]
        print(json.dumps(doc, indent=2))
        return 1 if no_fit else 0
    _print(args, tr, rows, auto, cluster)
    if out is not None:
        render.console.print(f"plan written to {out}")
    if no_fit:
        render.console.print(f"auto: {no_fit}", highlight=False)
        return 1
    return 0


def _ignored(args: argparse.Namespace, ran: list[PolicyName], simulated: bool) -> list[str]:
    """What the user asked for that this run does not use, one note each."""
    why = (f"with --policy {args.policy}" if args.policy
           else "without --cluster (the comparison includes auto only when a cluster is given)")
    notes = policy_notes(args, ran, why)
    if not simulated:
        # (--precision is read without a cluster too: the model is traced in its compute dtype)
        given = [opt for opt, value, default in (("--mfu", args.mfu, DEFAULT_MFU),
                                                  ("--optimizer", args.optimizer, DEFAULT_OPTIMIZER))
                 if value != default]
        if given:
            notes.append(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without --cluster: "
                         f"only the step simulation uses {'it' if len(given) == 1 else 'them'}")
        if args.measure:
            notes.append("--measure has no effect without --cluster: measured times only feed the step simulation "
                         "(nothing measured)")
    return notes


def _explanation(r: GroupExplanation) -> dict[str, Any]:
    """One group of ``--explain`` for ``--json``."""
    return {"group": r.group, "modules": r.modules, "bytes": r.nbytes, "all_gather": r.all_gather,
            "latency_share": r.latency_share, "hidden_by": r.hidden_by, "held_by": r.reason.value,
            "why": r.reason.description, "alternative": r.alternative.value if r.alternative else None,
            "alternative_step": r.alternative_step, "alternative_reserved": r.alternative_peak}


def _json(model: str, tr: Any, rows: list, auto: AutoResult | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": {"name": model, "fingerprint": tr.fingerprint, "numel": tr.numel},
        "plans": [{"plan": p.to_dict(), "metrics": m.to_dict(), **({"simulation": r.summary()} if r else {})}
                  for p, m, r in rows],
    }
    if auto is not None:
        out["auto"] = {"budget": auto.budget, "budget_source": auto.budget_source, "fits": auto.fits,
                       "plans_simulated": auto.evaluated, "seconds": auto.seconds}
    return out


def _print(args: argparse.Namespace, tr: Any, rows: list, auto: AutoResult | None,
           cluster: Cluster | None) -> None:
    console = render.console
    console.print(render.model_line(model_spec(args).label(), tr))
    if len(rows) == 1:
        console.print(render.groups_table(rows[0][0], tr))
    capacity = cluster.gpu.memory_bytes if cluster is not None else None
    console.print(render.comparison_table("per training step (FSDP2 semantics)", rows, capacity))
    if auto is None:
        return
    console.print(render.auto_line(auto), highlight=False)
    if args.explain:
        explanations = explain(auto)
        for part in render.explanation(explanations, auto.report.step_time, auto.report.reserved_memory,
                                       collapse=True):
            console.print(part, highlight=False)
        ev = auto.search.ev
        console.print(render.host_line(auto.report, ev.cluster, host_work(ev.ctx, auto.plan)), highlight=False)
