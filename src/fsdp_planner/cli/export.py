"""``fsdp-planner export PLAN.json --format python|accelerate|lightning|torchtitan``: the plan as code."""

from __future__ import annotations

import argparse
import json

import fsdp_planner.cli.render as render
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.sim.options import precision_named
from fsdp_planner.userfiles import write_atomic


def run(args: argparse.Namespace) -> int:
    source = export_plan(Plan.load(args.plan), ExportFormat(args.format), precision_named(args.precision))
    if args.out is not None:
        write_atomic(args.out, source)  # export_plan writes ASCII only
        render.note(f"{args.format} code for the plan ({args.precision}) written to {args.out}")
    if args.json:
        print(json.dumps({"format": args.format, "precision": args.precision, "out": args.out, "source": source},
                         indent=2))
    elif args.out is None:
        print(source, end="")
    return 0
