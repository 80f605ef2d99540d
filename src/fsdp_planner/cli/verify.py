"""``fsdp-planner verify MODEL``: train with the plan under torchrun and check it against the prediction."""

from __future__ import annotations

import argparse
import json

from fsdp_planner.cli import render
from fsdp_planner.cli.common import load_plan, load_trace, policy_plan
from fsdp_planner.cli.requests import add_json, add_plan_source, plan_source
from fsdp_planner.hardware.cluster import MAX_GPUS_PER_NODE, parse_cluster
from fsdp_planner.runtime.verify import run_verify
from fsdp_planner.sim.options import SimOptions


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("verify", help="train with the plan under torchrun and check it against the prediction")
    add_plan_source(sp)
    sp.add_argument("--nproc", type=int, default=2, help="processes (ranks) to run (default 2)")
    sp.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    sp.add_argument("--cluster", help="auto: the cluster to plan for (default: h100 with --nproc GPUs)")
    add_json(sp)
    sp.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    source = plan_source(args)
    tr = load_trace(args.model, render.notes, full=args.full_trace)
    if source.plan_file is not None:
        plan = load_plan(str(source.plan_file), tr)
    else:
        assert source.policy is not None
        cluster = parse_cluster(args.cluster or f"h100:{min(max(args.nproc, 1), MAX_GPUS_PER_NODE)}")
        plan = policy_plan(tr, source.policy, args.model, cluster, SimOptions())
    if not args.json:
        render.console.print(f"verifying [bold]{plan.policy or source.plan_file}[/bold] on {args.model} with "
                             f"{args.nproc} processes, {args.steps} steps ...")
    result = run_verify(args.model, tr, plan, args.nproc, args.steps)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        render.console.print(render.verify_table(result))
        for note in result.notes:
            render.console.print(f"note: {note}")
        render.console.print("[green]PASS[/green]" if result.ok else "[red]FAIL[/red]")
    return 0 if result.ok else 1
