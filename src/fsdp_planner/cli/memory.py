"""``fsdp-planner memory MODEL --world-size N``: per-rank memory of one device, DDP, ZeRO-1/2 and FSDP."""

from __future__ import annotations

import argparse

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.cli.common import load_trace
from fsdp_planner.cli.requests import model_spec
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, json_text
from fsdp_planner.hardware.cluster import MAX_WORLD_SIZE
from fsdp_planner.sim.memory import strategy_table
from fsdp_planner.sim.options import SimOptions


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise PlannerError(f"--world-size must be from 1 to {MAX_WORLD_SIZE:,}, got {cut_short(args.world_size)}")
    options = SimOptions.named(args.precision, args.optimizer, zero_grad=args.zero_grad)
    rows = strategy_table(load_trace(model_spec(args), render.notes, full=args.full_trace,
                                   precision=options.precision), args.world_size, options)
    if args.json:
        print(json_text({k: v.to_dict() for k, v in rows.items()}, indent=2))
    else:
        render.console.print(render.strategy_table(rows, f"{escape(args.model)}: per-rank peak memory at world size "
                                                         f"{args.world_size} ({args.precision}, {args.optimizer})"))
    return 0
