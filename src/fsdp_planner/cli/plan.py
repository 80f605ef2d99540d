"""``fsdp-planner plan MODEL``: a plan for the model, or every policy side by side."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fsdp_planner.cli import render
from fsdp_planner.cli.common import load_trace, run_auto
from fsdp_planner.cli.requests import (
    add_json,
    add_model,
    add_policy_options,
    add_sim_options,
    cluster_or_none,
    output_file,
    policy_request,
    sim_options,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners.auto import AutoResult
from fsdp_planner.planners.auto.explain import explain
from fsdp_planner.planners.registry import CLASSIC_POLICIES, POLICY_NAMES, PolicyName, make_policy
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.sim.timeline import simulate

DEFAULT_AUTO_CLUSTER = "h100:8"


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("plan", help="plan FSDP groups for a model; without --policy compare all policies")
    add_model(sp)
    sp.add_argument("--policy", choices=POLICY_NAMES)
    add_policy_options(sp)
    add_sim_options(sp, cluster_required=False)
    add_json(sp)
    sp.add_argument("--out", help="write the plan JSON here")
    sp.add_argument("--explain", action="store_true", help="auto: why each group boundary sits where it does")
    sp.set_defaults(fn=run)


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
        cluster = parse_cluster(DEFAULT_AUTO_CLUSTER)
        render.notes.print(f"auto: no --cluster given, planning for {DEFAULT_AUTO_CLUSTER}", highlight=False)
    if not args.policy and cluster is not None:
        requests.append(policy_request(args, PolicyName.AUTO.value))
    tr = load_trace(args.model, render.notes, args.measure, full=args.full_trace)
    auto: AutoResult | None = None
    plans: list[Plan] = []
    for request in requests:
        if request.name is PolicyName.AUTO:
            assert cluster is not None
            auto = run_auto(tr, request, cluster, options, args.model)
            plans.append(auto.plan)
        else:
            plans.append(make_policy(request).plan(tr, args.model))
    context = SimContext(tr, cluster, options) if cluster else None
    world = cluster.world_size if cluster else None
    rows = [(p, plan_metrics(tr, p, world), simulate(tr, p, context=context, timeline=False) if context else None)
            for p in plans]
    if out is not None:
        plans[0].save(out)
    if args.json:
        print(json.dumps(_json(args.model, tr, rows, auto), indent=2))
        return 0
    _print(args, tr, rows, auto)
    if out is not None:
        render.console.print(f"plan written to {out}")
    return 0


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


def _print(args: argparse.Namespace, tr: Any, rows: list, auto: AutoResult | None) -> None:
    console = render.console
    console.print(render.model_line(args.model, tr))
    if len(rows) == 1:
        console.print(render.groups_table(rows[0][0], tr))
    console.print(render.comparison_table("per training step (FSDP2 semantics)", rows))
    if auto is None:
        return
    console.print(render.auto_line(auto), highlight=False)
    if args.explain:
        explanations = explain(auto)
        console.print(render.explain_table(explanations, auto.report.step_time, auto.report.peak_memory))
        console.print(render.reasons_legend([r.reason for r in explanations]), highlight=False)
