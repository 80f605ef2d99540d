"""``fsdp-planner export PLAN.json --format python|accelerate|lightning|torchtitan``: the plan as code."""

from __future__ import annotations

import argparse
import json

import fsdp_planner.cli.render as render
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.userfiles import write_atomic


def run(args: argparse.Namespace) -> int:
    source = export_plan(Plan.load(args.plan), ExportFormat(args.format))
    if args.out is not None:
        write_atomic(args.out, source)
        render.note(f"{args.format} code for the plan written to {args.out}")
    if args.json:
        print(json.dumps({"format": args.format, "out": args.out, "source": source}, indent=2))
    elif args.out is None:
        print(source, end="")
    return 0
