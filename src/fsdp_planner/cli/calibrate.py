"""``fsdp-planner calibrate LOG... --out cluster.json``: fit latency and bandwidth from nccl-tests logs."""

from __future__ import annotations

import argparse

from fsdp_planner.cli import render
from fsdp_planner.cli.requests import output_file
from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.calibrate import calibrate
from fsdp_planner.hardware.cluster import parse_cluster


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("calibrate", help="fit latency and bandwidth from nccl-tests logs")
    sp.add_argument("logs", nargs="+", help="all_gather_perf / reduce_scatter_perf output files")
    sp.add_argument("--base", help="cluster preset to start from (e.g. h100:16); default: detected from the logs")
    sp.add_argument("--out", required=True, help="cluster JSON to write")
    sp.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    out = output_file(args.out)
    assert out is not None
    cluster = calibrate(args.logs, parse_cluster(args.base) if args.base else None)
    try:
        cluster.save(out)
    except OSError as e:
        raise PlannerError(f"cannot write '{out}': {e.strerror}") from None
    for kind, fits in cluster.fits.items():
        for n, (alpha, busbw) in sorted(fits.items()):
            render.console.print(f"{kind:15s} {n:5d} ranks: latency {alpha * 1e6:.1f} us, "
                                 f"bus bandwidth {busbw / 1e9:.1f} GB/s")
    render.console.print(f"cluster written to {out}")
    return 0
