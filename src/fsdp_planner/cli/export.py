"""``fsdp-planner export PLAN.json --format python|accelerate|lightning|torchtitan``: the plan as code."""

from __future__ import annotations

import argparse
import json

import fsdp_planner.cli.render as render
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.cli.requests import add_json
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("export", help="write a plan as ready code: apply(model, mesh) for plain FSDP2, "
                                       "Accelerate, Lightning or torchtitan")
    sp.add_argument("plan", help="plan JSON (from `plan --out`)")
    sp.add_argument("--format", default=ExportFormat.PYTHON.value, choices=[f.value for f in ExportFormat],
                    help="python (default): apply(model, mesh); accelerate: prepare(accelerator, model, ...); "
                         "lightning: configure_model(self); torchtitan: parallelize(model, world_mesh)")
    sp.add_argument("--out", help="file to write (default: stdout)")
    add_json(sp)
    sp.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    source = export_plan(Plan.load(args.plan), ExportFormat(args.format))
    if args.out is not None:
        try:
            with open(args.out, "w") as f:
                f.write(source)
        except OSError as e:
            raise PlannerError(f"cannot write '{args.out}': {e.strerror}") from None
        render.note(f"{args.format} code for the plan written to {args.out}")
    if args.json:
        print(json.dumps({"format": args.format, "out": args.out, "source": source}, indent=2))
    elif args.out is None:
        print(source, end="")
    return 0
