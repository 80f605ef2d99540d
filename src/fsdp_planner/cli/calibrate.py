"""``fsdp-planner calibrate [LOG...] [--overhead] --out cluster.json``: fit the cluster's collectives from
nccl-tests logs, and FSDP2's host overhead from real FSDP2 timed on this machine; ``--backend gloo --nproc N``:
measure a cluster of N CPU ranks of this machine in a real torchrun job (collectives and FSDP2's per-group cost)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import asdict
from pathlib import Path

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.calibrate.compute import fit_compute, measure_compute
from fsdp_planner.calibrate.cpu_optimizer import measure_cpu_optimizer
from fsdp_planner.calibrate.gloo import MAX_NPROC, calibrate_gloo
from fsdp_planner.calibrate.nccl_logs import calibrate
from fsdp_planner.calibrate.overhead import OverheadMeasurement, measure_overhead
from fsdp_planner.cli.commands import CALIBRATE_BASE as DEFAULT_BASE
from fsdp_planner.cli.paths import output_file
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import json_text, printable
from fsdp_planner.hardware.cluster import Cluster, calibrated_name, parse_cluster, with_cpu_optimizer_rate


def run(args: argparse.Namespace) -> int:
    if any((args.trace, args.trace_model, args.plan, args.policy)):
        from fsdp_planner.cli.calibrate_trace import run_trace

        return run_trace(args)
    if args.backend is not None:
        return run_gloo(args)
    if args.nproc != 2:
        render.note("--nproc has no effect without --backend gloo")
    if not args.logs and not args.overhead and not args.compute and not args.cpu_optimizer:
        raise PlannerError("calibrate needs nccl-tests logs, --overhead, --compute, --cpu-optimizer or --backend gloo "
                           "(all but --backend combine)")
    out = output_file(args.out, "cluster.json", force=args.force, kind="cluster")
    assert out is not None
    base = parse_cluster(args.base) if args.base else None
    cluster = calibrate(args.logs, base, note=render.note) if args.logs else base or parse_cluster(DEFAULT_BASE)
    measured = None
    if args.compute:
        samples = measure_compute()
        cluster = dataclasses.replace(cluster, compute=fit_compute(
            samples, cluster.gpu, cluster.compute, f"calibrate --compute on {_gpu_name()}"))
        if not args.json:
            c = cluster.compute
            render.console.print(f"compute: matmul {c.matmul_efficiency:.0%} of peak (half at dim "
                                 f"{c.matmul_half_dim:.0f}), attention {c.attention_efficiency:.0%}, memory-bound "
                                 f"{c.memory_efficiency:.0%} of HBM bandwidth")
    if args.cpu_optimizer:
        with render.progress("timing torch's AdamW on one rank's share of this host's cores"):
            rate, source = measure_cpu_optimizer(cluster.gpus_per_node)
        cluster = with_cpu_optimizer_rate(cluster, rate, source)
        if not args.json:
            render.console.print(escape(f"CPU optimizer: {rate / 1e6:,.1f} M elements/s per rank ({source})"))
    if args.overhead:
        cluster, measured = _with_measured_overhead(cluster)
        if not args.json:
            render.console.print(render.overhead_table(measured))
    # whichever figure was measured (--compute or --cpu-optimizer alone too), the file is no longer the preset
    cluster = dataclasses.replace(cluster, name=calibrated_name(cluster.name))
    _save(cluster, out)
    if args.json:
        print(json_text({"out": str(out), "cluster": cluster.to_dict(),
                         "overhead_measurement": None if measured is None else render.json_ready(asdict(measured))},
                        indent=2))
        return 0
    for kind, fits in cluster.fits.items():
        for n, (alpha, busbw) in sorted(fits.items()):
            render.console.print(f"{kind:15s} {n:5d} ranks: latency {alpha * 1e6:.1f} us, "
                                 f"bus bandwidth {busbw / 1e9:.1f} GB/s")
    render.plain(f"cluster written to {out}")
    return 0


def _gpu_name() -> str:
    import torch

    return printable(torch.cuda.get_device_name())[:200]


def _with_measured_overhead(cluster: Cluster) -> tuple[Cluster, OverheadMeasurement]:
    with render.progress("timing real FSDP2 (fake process group) with 1 to 256 groups"):
        m = measure_overhead()
    overhead = m.overhead
    if m.device == "cpu":  # host memory bandwidth says nothing of a GPU's copy kernels: keep the cluster's
        render.note(f"no GPU here: copy bandwidth measured on the CPU ({overhead.copy_bandwidth / 1e9:.1f} GB/s) "
                    f"is not used; the cluster's {cluster.overhead.copy_bandwidth / 1e9:.0f} GB/s is kept")
        overhead = dataclasses.replace(overhead, copy_bandwidth=cluster.overhead.copy_bandwidth)
    return dataclasses.replace(cluster, overhead=overhead), m


def run_gloo(args: argparse.Namespace) -> int:
    """``--backend gloo --nproc N``: the cluster of N CPU ranks, measured in a torchrun job."""
    if args.logs or args.overhead or args.base or args.compute or args.cpu_optimizer:
        raise PlannerError("--backend gloo measures this machine's CPU ranks on its own: give no nccl-tests logs, "
                           "--overhead, --compute, --cpu-optimizer or --base with it")
    if not 2 <= args.nproc <= MAX_NPROC:
        raise PlannerError(f"--nproc must be from 2 to {MAX_NPROC} with --backend gloo (a collective needs two "
                           f"ranks), got {args.nproc}")
    out = output_file(args.out, "cluster.json", force=args.force, kind="cluster")
    assert out is not None
    cores = os.cpu_count() or 1
    if args.nproc > cores:
        render.note(f"{args.nproc} ranks on {cores} cores: the ranks share cores, so every time measured includes "
                    "waiting for one; predictions hold for jobs run the same way")
    with render.progress(f"torchrun job: {args.nproc} gloo ranks timing collectives and FSDP2 (about a minute)"):
        cluster, measured = calibrate_gloo(args.nproc)
    _save(cluster, out)
    if args.json:
        print(json_text({"out": str(out), "cluster": cluster.to_dict(),
                         "gloo_measurement": render.json_ready(asdict(measured))}, indent=2))
        return 0
    render.console.print(render.gloo_table(measured))
    render.console.print(render.overhead_table(measured))
    render.console.print(escape(f"cluster written to {out}: {cluster.describe()}"))
    render.plain(f"predict and measure a plan's step: fsdp-planner verify MODEL --policy auto --nproc {args.nproc} "
                 f"--cluster {out} --measure")
    return 0


def _save(cluster: Cluster, out: Path) -> None:
    cluster.save(out)
