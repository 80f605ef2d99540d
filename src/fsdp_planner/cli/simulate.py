"""``fsdp-planner simulate MODEL --cluster SPEC``: one step of a plan in time and memory."""

from __future__ import annotations

import argparse
import json

from fsdp_planner.cli import render
from fsdp_planner.cli.common import load_plan, load_trace, policy_plan
from fsdp_planner.cli.requests import (
    add_json,
    add_plan_source,
    add_sim_options,
    model_spec,
    plan_source,
    policy_notes,
    sim_options,
)
from fsdp_planner.fsdp2.plan import check_plan_world_size
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.sim.timeline import simulate


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("simulate", help="simulate one step of a plan on a cluster")
    add_plan_source(sp)
    add_sim_options(sp, cluster_required=True)
    add_json(sp)
    sp.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    source = plan_source(args)
    cluster, options = parse_cluster(args.cluster), sim_options(args)
    for note in policy_notes(args, [source.policy.name] if source.policy else [], f"with --policy {args.policy}",
                             plan_file=source.plan_file is not None):
        render.note(note)
    tr = load_trace(model_spec(args), render.notes, args.measure, full=args.full_trace,
                    precision=options.precision)
    if source.plan_file is not None:
        plan = load_plan(str(source.plan_file), tr)
        check_plan_world_size(plan, cluster.world_size)
    else:
        assert source.policy is not None
        plan = policy_plan(tr, source.policy, args.model, cluster, options)  # checked against the cluster
    report = simulate(tr, plan, cluster, options, timeline=False)
    if args.json:
        print(json.dumps(report.summary(), indent=2))
        return 0
    for line in render.step_lines(model_spec(args).label(), plan.policy or str(source.plan_file), cluster, report):
        render.console.print(line)
    render.console.print(render.memory_table(report.peak_memory, report.reserved_memory, report.memory_at_peak,
                                             cluster.gpu))
    return 0
