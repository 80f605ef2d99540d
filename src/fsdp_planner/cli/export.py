"""``fsdp-planner export PLAN.json --format python|accelerate|lightning|torchtitan``: the plan as code."""

from __future__ import annotations

import argparse
import json

import fsdp_planner.cli.render as render
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.sim.options import precision_named


def run(args: argparse.Namespace) -> int:
    source = export_plan(Plan.load(args.plan), ExportFormat(args.format), precision_named(args.precision))
    if args.out is not None:
        try:
            with open(args.out, "w", encoding="ascii") as f:  # export_plan writes ASCII only
                f.write(source)
        except OSError as e:
            raise PlannerError(f"cannot write '{args.out}': {e.strerror}") from None
        render.note(f"{args.format} code for the plan ({args.precision}) written to {args.out}")
    if args.json:
        print(json.dumps({"format": args.format, "precision": args.precision, "out": args.out, "source": source},
                         indent=2))
    elif args.out is None:
        print(source, end="")
    return 0
