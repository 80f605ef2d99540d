"""``calibrate --backend gloo --nproc N``: a cluster of N CPU ranks on gloo, measured in a real torchrun job.

The job (``worker.py``) times the collectives FSDP2 calls over a sweep of sizes, the chain of tiny layers
of ``overhead.py`` under FSDP2 plans of 1 to 256 groups, and the chain's per-op times. Fitted here:
- each collective's measured times, made non-decreasing in size (``monotone``), as the cluster's ``tables``
  (which the host engine interpolates: on a CPU the time per byte changes with size), and its line
  ``alpha + (N-1)/N * bytes / busbw`` (``nccl_logs.fit_samples``, the fit of nccl-tests logs) as its
  ``fits``, for display and for groups of fewer ranks;
- ``op_seconds``: the step without FSDP less its measured ops, per op: what a measured op time leaves out
  (autograd, module calls) less what timing each op adds to it (negative when that is more);
- ``hook_seconds``, ``module_seconds`` and ``param_seconds``: each plan's measured step less what the host engine
  (``sim/host_engine.py``) predicts for it without them (ops, copies, the measured collectives) is fitted in
  relative error as ``params x param + hooks x hook + calls x module``, with ``hooks`` the lifecycle calls the
  planner's replay counts (``Schedule.hooks``) and ``calls`` the calls of modules fully_shard was applied to
  (``replay.state_hook_calls``: 257 in every plan of the chain but the root alone's 1); every param is managed
  in every plan, so their cost is the intercept. The residuals are reported: they check the fit.
The cluster's engine is ``Engine.HOST`` (nothing overlaps on a CPU rank); its "GPU" is this CPU (one thread's
fp32 matmul rate, its copy bandwidth, the host's memory over N), which only a trace without ``--measure`` uses.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from fsdp_planner.calibrate.nccl_logs import fit_samples
from fsdp_planner.calibrate.overhead import GROUP_SIZES, LAYERS, PlanTiming, chain_plan, chain_trace
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.replay import build_schedule, state_hook_calls
from fsdp_planner.hardware.cluster import GPU, Cluster, Engine, Link, Overhead
from fsdp_planner.runtime.measure import host_memory
from fsdp_planner.runtime.verify import run_torchrun, signals_raise
from fsdp_planner.sim.simulate import simulate

# 4 KiB .. 64 MiB by factors of 2, and 12, 24 and 48 MiB: a CPU's time per byte jumps where a collective's buffers
# outgrow its last-level cache (32 MiB on this project's host), and interpolating across that jump misprices sizes
SIZES = tuple(sorted({4096 * 2**i for i in range(15)} | {3 << 22, 3 << 23, 3 << 24}))
QUICK_SIZES = (4096, 1 << 20, 8 << 20)  # far enough apart that noise cannot hide the growth
REPS = 15  # calls per size (a third of it above 1 MiB)
ROUNDS = 5  # turns the plans take (worker.time_chain)
MAX_NPROC = 64


@dataclass(frozen=True)
class CollectiveFit:
    kind: str
    samples: list[tuple[int, float]]  # (bytes, median seconds)
    alpha: float
    busbw: float
    rms: float  # relative rms error of the line over the samples


@dataclass(frozen=True)
class GlooMeasurement:
    """What the job measured, and what was fitted from it."""

    world: int
    threads: int  # torch threads per rank
    collectives: list[CollectiveFit]
    ops: int
    params: int
    plain_seconds: float  # the chain's step without FSDP
    op_seconds_total: float  # its ops as --measure times them
    plans: list[PlanTiming]  # the chain under FSDP2: measured, and predicted by the fitted cluster
    overhead: Overhead

    @property
    def worst_residual(self) -> float:
        return max(abs(p.seconds / p.predicted - 1) for p in self.plans)


def calibrate_gloo(nproc: int, quick: bool = False, timeout: float = 600.0) -> tuple[Cluster, GlooMeasurement]:
    """Run the calibration job on ``nproc`` local gloo ranks and fit the cluster (``quick``: fewer sizes, plans
    and rounds; for tests)."""
    return fit(measure_gloo(nproc, quick, timeout), job_group_sizes(quick))


def job_group_sizes(quick: bool) -> list[int]:
    """The layers per group of the chain's plans the job times: the root alone (0), then 1 to 256 groups."""
    return [0, LAYERS, 16, 1] if quick else [0, *GROUP_SIZES]


def measure_gloo(nproc: int, quick: bool = False, timeout: float = 600.0) -> dict:
    """What the calibration job on ``nproc`` local gloo ranks measured (``worker.py``), before any fit."""
    if not 2 <= nproc <= MAX_NPROC:
        raise PlannerError(f"--nproc must be from 2 to {MAX_NPROC} for --backend gloo (a collective needs two "
                           f"ranks), got {nproc}")
    job = {"sizes": list(QUICK_SIZES if quick else SIZES), "reps": 5 if quick else REPS,
           "rounds": 2 if quick else ROUNDS, "group_sizes": job_group_sizes(quick)}
    if quick:
        job.update(seconds=0.6, repeats=3)
    with signals_raise():
        data, _ = run_torchrun("fsdp_planner.calibrate.worker", nproc, timeout, "calibration job", job)
    return data


def fit(data: dict, group_sizes: list[int]) -> tuple[Cluster, GlooMeasurement]:
    """The cluster and the measurement from what the calibration job wrote."""
    world = int(data["world"])
    fits = []
    for kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        samples = [(int(s), float(t)) for s, t in data["collectives"][kind.value]]
        alpha, busbw, rms, _ = fit_samples(samples, world, f"the {kind.value.replace('_', '-')} sweep")
        fits.append(CollectiveFit(kind.value, samples, alpha, busbw, rms))
    traced = chain_trace()
    if len(data["op_seconds"]) != len(traced.events):
        raise PlannerError("the calibration job's chain ran other ops than its trace (a different PyTorch?)")
    measured = traced.with_op_seconds(tuple(data["op_seconds"]))
    ops = sum(e.is_op for e in traced.events)
    op_total = float(sum(data["op_seconds"]))
    plain = float(data["plain_seconds"])
    copy = float(data["copy_bandwidth"])
    base = _cluster(world, fits, Overhead(0.0, (plain - op_total) / ops, copy, 0.0, _source(data)), data)
    plans = [chain_plan(traced, k) for k in group_sizes]
    hooks = [len(build_schedule(traced, plan, world).hooks) for plan in plans]
    calls = [len(state_hook_calls(traced, plan)) for plan in plans]
    without = [simulate(measured, plan, base, timeline=False).step_time for plan in plans]
    seconds = [float(t) for t in data["plan_seconds"]]
    intercept, hook_seconds, module_seconds = relative_fit(
        [(1.0, h, c) for h, c in zip(hooks, calls, strict=True)],
        [t - w for t, w in zip(seconds, without, strict=True)], seconds)
    if not hook_seconds > 0:
        raise PlannerError("the measured FSDP2 step did not grow with the number of groups beyond its collectives "
                           "(the machine was too busy to time it?): run calibrate again on an idle machine")
    params = len(traced.params)
    overhead = dataclasses.replace(base.overhead, hook_seconds=hook_seconds,
                                   param_seconds=max(0.0, intercept) / params, module_seconds=max(0.0, module_seconds))
    cluster = dataclasses.replace(base, overhead=overhead)
    predicted = [simulate(measured, plan, cluster, timeline=False).step_time for plan in plans]
    timings = [PlanTiming(len(p.inner_groups), h, t, q)
               for p, h, t, q in zip(plans, hooks, seconds, predicted, strict=True)]
    return cluster, GlooMeasurement(world, int(data["threads"]), fits, ops, params, plain, op_total, timings,
                                    overhead)


def relative_fit(features: list[tuple[float, ...]], residuals: list[float], steps: list[float]) -> list[float]:
    """``residual = features . x`` by least squares of each plan's error relative to its step: the one-group plan
    (tens of ms) counts as much as the 256-group one (a second), so the intercept, FSDP2's per-param cost, is
    pinned by the plans where it matters."""
    w = 1 / np.asarray(steps)
    x, *_ = np.linalg.lstsq(np.asarray(features) * w[:, None], np.asarray(residuals) * w, rcond=None)
    return [float(v) for v in x]


def _source(data: dict) -> str:
    return (f"calibrate --backend gloo: FSDP2 {torch.__version__} on {data['world']} gloo ranks of this machine "
            f"({os.cpu_count()} cores, {data['threads']} thread(s) per rank), {LAYERS} tiny layers")


def _cluster(world: int, fits: list[CollectiveFit], overhead: Overhead, data: dict) -> Cluster:
    flops = float(data["matmul_flops"])
    ag = next(f for f in fits if f.kind == CollectiveKind.ALL_GATHER.value)
    link = Link(ag.busbw, ag.alpha, 0.0)
    cpu = GPU(f"CPU ({os.cpu_count()} cores)", flops, flops, overhead.copy_bandwidth, host_memory() // world)
    return Cluster(name=f"gloo:{world}+calibrated", gpu=cpu, gpus_per_node=world, nodes=1, intra=link, inter=link,
                   nics_per_node=1, fits={f.kind: {world: (f.alpha, f.busbw)} for f in fits}, overhead=overhead,
                   engine=Engine.HOST, tables={f.kind: monotone(f.samples) for f in fits})


def monotone(samples: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The samples with times made non-decreasing in size, each the least time measured at its size or above:
    noise only adds time, and a collective never gets cheaper with more bytes, so a size measured slower than a
    larger one had a hiccup (on this project's VM a size's median is now and then 5x its neighbours')."""
    out, least = [], float("inf")
    for size, t in reversed(samples):
        least = min(least, t)
        out.append((size, least))
    return out[::-1]
