"""``fsdp-planner export PLAN.json --format python|accelerate|lightning|torchtitan``: the plan as code."""

from __future__ import annotations

import argparse

import fsdp_planner.cli.render as render
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.choices import DEFAULT_PRECISION
from fsdp_planner.fmt import json_text
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.sim.options import precision_named
from fsdp_planner.userfiles import write_atomic


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    precision = _precision(args.precision, plan)
    source = export_plan(plan, ExportFormat(args.format), precision_named(precision))
    if args.out is not None:
        write_atomic(args.out, source)  # export_plan writes ASCII only
        render.note(f"{args.format} code for the plan ({precision}) written to {args.out}")
    if args.json:
        print(json_text({"format": args.format, "precision": precision, "out": args.out, "source": source},
                        indent=2))
    elif args.out is None:
        print(source, end="")
    return 0


def _precision(asked: str | None, plan: Plan) -> str:
    """``--precision``, else the plan's own, else plan's default; a note where the two disagree (the code then
    runs in another precision than the plan's numbers assumed)."""
    if asked and plan.precision and asked != plan.precision:
        render.note(f"the plan was simulated in {plan.precision}; the code sets {asked} as --precision asks")
    return asked or plan.precision or DEFAULT_PRECISION
