"""``calibrate --trace``: a cluster fitted to a user's own profiler traces of one plan of one model.

The traces (``kineto.py``) are matched to the simulator's step of the same model and plan, as one rank runs it
(with TP or EP the rank's view, float8's casts apart: ``RankOps``), by op class and by collective: the
simulator's ops of each class (``sim/compute.py``'s kernels: matmul, fused attention, memory-bound) against the
measured ones' mean time a step over the typical steps (``typical_steps``), and each measured
collective (kind, size, group) against what the cost model charges it. Fitted, in this order, each with the
earlier ones in place:
1. the roofline's three efficiencies (matmul, attention, memory), so each class's predicted seconds equal the
   measured: per class, its ops' seconds bound by each efficiency form a 3 x 3 linear system in the efficiencies'
   inverses (``bound_terms``), solved again until no op changes its binding term; an efficiency beyond 1 raises
   the peak instead (a CPU's "peak" is what it reached);
2. each collective's line ``alpha + (N-1)/N x bytes / busbw`` over the measured sizes (``nccl_logs.fit_samples``,
   the fitted-line path of ``hardware/cost.py``; with fewer than three sizes, or sizes too noisy for a line, the
   cluster's latency and the bandwidth of the measured bytes). On CPU ranks a gloo call's time is mostly waiting
   (behind the gloo thread's earlier calls, on a peer the shared host slowed), which does not grow with the bytes
   and, call by call, depends on where in the step the call falls, not on its size: the line is fitted on each
   size's least-delayed calls (``LOW_QUANTILE``; where even they show no bandwidth the base cluster's line stays)
   and the cluster's table charges each size that line plus the mean call's wait (``_waited``): the traced calls
   cost what they took in all. Their means' own slope over one plan's few sizes was the waits' noise: titan's
   32-168 KiB on 2026-11-30 gave 52 MB/s, charging auto's 401 KiB all-gathers 3.1 ms where they took 1.3;
3. the host's overhead: on CPU ranks (``Engine.HOST``: nothing overlaps) FSDP2's measured host ranges (``FSDP::``,
   less the collectives and ops in them) over the step's hooks, and what is left of the measured step over its
   ops; on GPUs the per-op launch cost that makes the simulated step the measured one (the host falls behind).
A checkpointed plan's recomputed forward ops count twice (``op_runs``), as its profile shows their kernels.
Not fitted: per-block or per-shape matmul rates (one rate a class), the slowest-rank spread.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fsdp_planner.calibrate.kineto import MeasuredTrace, OpClass, Step, forward_kernel, op_class
from fsdp_planner.calibrate.nccl_logs import fit_samples
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_count
from fsdp_planner.fsdp2.checkpointing import plan_checkpointing
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import GPU, Cluster, Compute, Engine, Link, Overhead, slowest_rank_factor
from fsdp_planner.hardware.cost import collective_cost, collective_time
from fsdp_planner.runtime.measure import host_memory
from fsdp_planner.sim.compute import (
    cast_seconds_of,
    flop_efficiency,
    fused_nbytes,
    kernel_flops,
    op_peaks,
    op_times,
    traced_itemsize,
)
from fsdp_planner.sim.float8 import Float8Step, float8_step
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.recompute import checkpointed_calls
from fsdp_planner.sim.simulate import StepReport, rank_step, simulate
from fsdp_planner.trace.events import (
    ATTENTION_KERNELS,
    KERNEL_EP_ALL_TO_ALL,
    KERNEL_LINEAR_ATTENTION,
    KERNEL_MAMBA_SCAN,
    KERNEL_OTHER,
    TP_KERNELS,
)
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import shown_json

# the kernels timed by the attention efficiency the fit fits (linear attention's at a share of it)
ATTENTION_CLASS = (*ATTENTION_KERNELS, KERNEL_LINEAR_ATTENTION)

# passes of the efficiencies' fit, at most: each solves the class sums for the ops' binding terms of the pass before
# (a small matmul moving more bytes than it computes is bound by the memory efficiency, not the matmul one)
PASSES = 20
# on CPU ranks, the quantile of a size's calls whose time is taken as its transfer (``fit_collectives``): a quarter
# of the calls waited least
LOW_QUANTILE = 0.25
CONVERGED = 1e-9  # the efficiencies move less than this (relative) in a pass
CPU_START = 1e10  # a CPU "GPU"'s starting peak FLOP/s and bandwidth; the fit moves them to what was measured


@dataclass(frozen=True)
class ClassRow:
    op_class: str
    ops_measured: int
    ops_simulated: int
    measured: float  # seconds a step (mean over the typical steps)
    before: float  # predicted on the base cluster
    after: float  # predicted on the fitted one


@dataclass(frozen=True)
class CollectiveRow:
    kind: str
    nbytes: int
    ranks: int
    count: int  # a step
    measured: float  # mean seconds of one (a step pays every call: a slow peer's waits too)
    before: float
    after: float


@dataclass(frozen=True)
class TraceFit:
    """What ``fit_trace`` matched and fitted, for the report."""

    steps: int  # typical steps fitted on (``typical_steps``)
    measured_step: float  # their mean
    before: StepReport
    after: StepReport
    classes: list[ClassRow]
    collectives: list[CollectiveRow]
    measured_host: float  # FSDP2's host ranges a step (mean)
    measured_exposed: float
    measured_idle: float
    optimizer: bool  # the measured steps ran the optimizer step; if not, the simulated ones are compared without

    @property
    def before_step(self) -> float:
        return self.before.step_seconds(self.optimizer)

    @property
    def after_step(self) -> float:
        return self.after.step_seconds(self.optimizer)


NO_CLASS = len(OpClass)  # ``simulated_classes`` of a rank view's TP and EP collectives: a profile's NCCL kernels


@dataclass(frozen=True)
class RankOps:
    """The ops one traced rank runs, as the simulator charges them: the step of a plan with TP or EP is one rank's
    view (``simulate.rank_step``: its matmuls 1/TP wide), whose cluster is the data-parallel one; float8's
    converted matmuls at the float8 peak, their casts apart (memory-bound kernels in a profile)."""

    trace: Trace
    cluster: Cluster
    runs: np.ndarray  # per event, how many times a step runs it (``op_runs``)
    float8: Float8Step | None

    @classmethod
    def of(cls, trace: Trace, plan: Plan, cluster: Cluster, options: SimOptions) -> RankOps:
        ep = plan.expert_parallel
        if ep is not None and ep.skew != 1.0:  # the skew is the busiest rank's load, the one the step waits for; a
            # profiled rank's kernels ran its own share, on average the balanced one: fitted to the busiest rank's,
            # the matmul efficiency would come out 1/skew too high on the experts' ops
            plan = plan.replace(expert_parallel=dataclasses.replace(ep, skew=1.0))
        view, _, view_cluster = rank_step(trace, plan, cluster)
        assert view_cluster is not None
        f8 = plan_options(plan, options).float8
        return cls(view, view_cluster, op_runs(view, plan),
                   float8_step(view, f8, options.precision.compute_bytes) if f8 is not None else None)

    def on(self, cluster: Cluster) -> Cluster:
        """The view's cluster with ``cluster``'s GPU and compute factors (what the fit changes)."""
        return dataclasses.replace(self.cluster, gpu=cluster.gpu, compute=cluster.compute)


def simulated_classes(trace: Trace) -> np.ndarray:
    """Per event, its ``OpClass`` index in ``list(OpClass)`` (boundaries: memory-bound, with no time; a TP or EP
    collective of a rank's view: ``NO_CLASS``). An op of no named kernel that has FLOPs is a convolution: a matmul,
    as a trace's cuDNN/CUTLASS kernels and CPU ``aten::conv2d`` ops are read (``kineto.op_class``)."""
    kernel = trace.index.op_kernel
    matmul = (kernel > 0) | (kernel == KERNEL_MAMBA_SCAN) | ((kernel == KERNEL_OTHER) & (trace.index.op_flops > 0))
    classes = np.where(matmul, 0, np.where(np.isin(kernel, ATTENTION_CLASS), 1, 2))
    return np.where(np.isin(kernel, (*TP_KERNELS, KERNEL_EP_ALL_TO_ALL)), NO_CLASS, classes)


def op_runs(trace: Trace, plan: Plan) -> np.ndarray:
    """Per event, how many times a step of ``plan`` runs it: once, and again in each checkpointed call's
    recomputation (the trace holds a checkpointed block's forward ops once; a GPU runs their kernels twice, and a
    profile counts both)."""
    runs = np.ones(len(trace.events))
    for c in checkpointed_calls(trace, plan_checkpointing(plan)):
        if not c.offload:
            np.add.at(runs, c.recomputed(trace), 1)
    return runs


def class_seconds(ops: RankOps, cluster: Cluster, options: SimOptions) -> dict[OpClass, float]:
    """The simulator's seconds of each class's ops a step on ``cluster``'s GPU (float8's casts memory-bound)."""
    trace, view = ops.trace, ops.on(cluster)
    gpu, compute = view.gpu, view.compute
    times = np.asarray(op_times(trace, gpu, options.precision, compute, view.world_size, float8=ops.float8))
    casts = cast_seconds_of(len(times), ops.float8, gpu.hbm_bandwidth * compute.memory_efficiency) * \
        slowest_rank_factor(compute.variation, view.world_size)
    times, casts = (times - casts) * ops.runs, casts * ops.runs
    classes = simulated_classes(trace)
    out = {c: float(times[classes == i].sum()) for i, c in enumerate(OpClass)}
    out[OpClass.MEMORY] += float(casts.sum())
    return out


def typical_steps(traces: list[MeasuredTrace]) -> list[Step]:
    """The middle third of the traces' steps by time (at least one): every figure is fitted on the same steps, so
    the parts add up to the step; a step that waited on a busy peer (on a shared host, twice the others) or ran
    alone on an idle one leaves out."""
    steps = sorted((s for t in traces for s in t.steps), key=lambda s: s.seconds)
    third = len(steps) // 3
    return steps[third:len(steps) - third] or steps


def ran_optimizer(steps: list[Step]) -> bool:
    """Whether the measured steps hold the optimizer step: a profile of forward and backward alone (``verify
    --profile``'s) is compared with the simulated step less its optimizer step."""
    return any(s.ran_optimizer for s in steps)


def measured_classes(steps: list[Step]) -> dict[OpClass, float]:
    return {c: statistics.fmean(s.op_seconds[c] for s in steps) for c in OpClass}


def bound_terms(ops: RankOps, cluster: Cluster, options: SimOptions) -> np.ndarray:
    """``A[class, factor]``: seconds of each class's ops bound by each roofline factor (matmul, attention, memory
    efficiency), at that factor 1: a class's predicted seconds are ``A @ (1 / efficiencies)`` while no op changes
    which of its two terms binds (``sim/compute.py``'s max); float8's casts are memory-bound seconds."""
    trace, view = ops.trace, ops.on(cluster)
    index, c, gpu = trace.index, view.compute, view.gpu
    stretch = slowest_rank_factor(c.variation, view.world_size)
    kernel = index.op_kernel
    peaks = op_peaks(trace, gpu, options.precision, ops.float8)
    flops_time = kernel_flops(index) / (peaks * flop_efficiency(kernel, c)) * stretch
    scale = options.precision.compute_bytes / traced_itemsize(trace)
    bytes_time = fused_nbytes(trace) * (scale / (gpu.hbm_bandwidth * c.memory_efficiency)) * stretch  # as op_times
    factor = np.where(bytes_time > flops_time, 2, np.where(np.isin(kernel, ATTENTION_CLASS), 1, 0))
    efficiency = np.array([c.matmul_efficiency, c.attention_efficiency, c.memory_efficiency])
    unit = np.maximum(flops_time, bytes_time) * efficiency[factor] * ops.runs
    classes = simulated_classes(trace)
    classed = classes < NO_CLASS
    out = np.zeros((3, 3))
    np.add.at(out, (classes[classed], factor[classed]), unit[classed])
    out[2, 2] += float((cast_seconds_of(len(unit), ops.float8, gpu.hbm_bandwidth) * stretch * ops.runs).sum())
    return out


def fit_compute(ops: RankOps, cluster: Cluster, measured: dict[OpClass, float], options: SimOptions) -> Cluster:
    """Efficiencies (and where one passes 1, the peaks) so each class's simulated seconds equal the measured: the
    linear system of ``bound_terms`` solved for the efficiencies' inverses, again until no op changes its binding
    term. A factor no op is bound by keeps its value."""
    target = np.array([measured[k] for k in OpClass])
    for _ in range(PASSES):
        terms = bound_terms(ops, cluster, options)
        c = cluster.compute
        old = np.array([c.matmul_efficiency, c.attention_efficiency, c.memory_efficiency])
        used = terms.sum(axis=0) > 0
        rows = target > 0
        if not used.any() or not rows.any():
            return cluster
        inverse, *_ = np.linalg.lstsq(terms[np.ix_(rows, used)], target[rows], rcond=None)
        new = old.copy()
        new[used] = np.where(inverse > 0, 1 / np.maximum(inverse, 1e-30), old[used])
        cluster = _with_efficiencies(cluster, new)
        if np.allclose(new, old, rtol=CONVERGED, atol=0):
            break
    return cluster


def _with_efficiencies(cluster: Cluster, eff: np.ndarray) -> Cluster:
    """The cluster with these matmul, attention and memory efficiencies; one past 1 raises the peak instead."""
    flops_up, bytes_up = max(1.0, float(eff[0]), float(eff[1])), max(1.0, float(eff[2]))
    g = cluster.gpu
    gpu = dataclasses.replace(g, peak_bf16_flops=g.peak_bf16_flops * flops_up,
                              peak_fp32_flops=g.peak_fp32_flops * flops_up, peak_fp8_flops=g.peak_fp8_flops * flops_up,
                              hbm_bandwidth=g.hbm_bandwidth * bytes_up)
    compute = dataclasses.replace(cluster.compute, matmul_efficiency=max(1e-6, float(eff[0]) / flops_up),
                                  attention_efficiency=max(1e-6, float(eff[1]) / flops_up),
                                  memory_efficiency=max(1e-6, float(eff[2]) / bytes_up))
    return dataclasses.replace(cluster, gpu=gpu, compute=compute)


def by_size(steps: list[Step]) -> dict[tuple[str, int, int], list[float]]:
    """Every measured collective's seconds, by (kind, bytes, ranks)."""
    out: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for s in steps:
        for c in s.collectives:
            out[(c.kind.value, c.nbytes, c.ranks)].append(c.seconds)
    return out


def fit_collectives(cluster: Cluster, steps: list[Step], strided: frozenset[int] = frozenset()) -> Cluster:
    """The collectives' lines (and on CPU ranks their measured times) from the traces: a kind needs two sizes.
    ``strided``: group sizes whose ranks are spread over nodes (a TP job's data-parallel groups), left to the
    base's line: a fit is a run of packed ranks (``Cluster.measured_on``), which these are not."""
    groups: dict[tuple[str, int], dict[int, list[float]]] = defaultdict(dict)
    for (kind, nbytes, ranks), seconds in sorted(by_size(steps).items()):
        if ranks >= 2 and nbytes > 0 and ranks not in strided:
            groups[(kind, ranks)][nbytes] = seconds
    fits = {k: dict(v) for k, v in cluster.fits.items()}
    tables = dict(cluster.tables)
    for (kind, ranks), sizes in groups.items():
        if len(sizes) < 2:
            continue
        if cluster.engine is Engine.HOST:
            line = _line(kind, ranks, [(n, _low(ts)) for n, ts in sizes.items()])
            if line is not None:  # else waits, not bytes, made even the least-delayed times: the base line stays
                fits.setdefault(kind, {})[ranks] = line
            if ranks == cluster.world_size:
                tables[kind] = _waited(dataclasses.replace(cluster, fits=fits, tables={}), kind, ranks, sizes)
            continue
        rows = [(n, statistics.fmean(ts)) for n, ts in sizes.items()]  # a step pays every call, tails too
        line = _line(kind, ranks, rows)
        if line is None:  # too few or too noisy sizes for a line: the cluster's latency, the bytes' rate
            alpha = _charged(cluster, kind, 1, ranks)
            moved = sum((ranks - 1) / ranks * n for n, _ in rows)
            spent = sum(t - alpha for _, t in rows)
            if spent <= 0:
                continue
            line = (alpha, moved / spent)
        fits.setdefault(kind, {})[ranks] = line
    return dataclasses.replace(cluster, fits=_halves(fits), tables=tables)


def _line(kind: str, ranks: int, rows: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(alpha, busbw) fitted to ``rows`` of (bytes, seconds); None where they make no line."""
    try:
        alpha, busbw, _, _ = fit_samples(rows, ranks, f"the trace's {kind.replace('_', '-')}s")
    except PlannerError:
        return None
    return alpha, busbw


def _low(seconds: list[float]) -> float:
    """The ``LOW_QUANTILE`` of one size's calls' seconds."""
    ordered = sorted(seconds)
    return ordered[int(LOW_QUANTILE * (len(ordered) - 1))]


def _waited(cluster: Cluster, kind: str, ranks: int, sizes: dict[int, list[float]]) -> list[tuple[int, float]]:
    """A CPU rank's table: at each measured size the line's time plus the mean call's wait (its time over the
    line), so the calls traced cost what they took in all, and other sizes the same wait beyond their transfer."""
    line = collective_cost(cluster, kind, ranks).lines[-1]
    calls = [(n, t) for n, ts in sizes.items() for t in ts]
    wait = max(0.0, statistics.fmean(t - float(line.seconds(n)) for n, t in calls))
    return [(n, float(line.seconds(n)) + wait) for n in sorted(sizes)]


def _halves(fits: dict[str, dict[int, tuple[float, float]]]) -> dict[str, dict[int, tuple[float, float]]]:
    """An all-reduce's line as the all-gather and reduce-scatter lines of a group that has none measured: the cost
    model charges an all-reduce as those two (``hardware/collectives.lines``), so a DDP trace's all-reduces (its
    only collectives) reach it only this way. Each half: half the latency over half the bytes' time."""
    out = {k: dict(v) for k, v in fits.items()}
    for ranks, (alpha, busbw) in fits.get(CollectiveKind.ALL_REDUCE.value, {}).items():
        if any(ranks in fits.get(k.value, {}) for k in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER)):
            continue
        for k in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
            out.setdefault(k.value, {})[ranks] = (alpha / 2, busbw * 2)
    return out


def fit_overhead(trace: Trace, plan: Plan, cluster: Cluster, steps: list[Step], options: SimOptions) -> Cluster:
    """The host's costs (module docstring, 3.), the compute and collectives already fitted."""
    step, optimizer = statistics.fmean(s.seconds for s in steps), ran_optimizer(steps)
    bare = dataclasses.replace(cluster, overhead=dataclasses.replace(
        cluster.overhead, hook_seconds=0.0, op_seconds=0.0, param_seconds=0.0, module_seconds=0.0))
    report = simulate(trace, plan, bare, options, timeline=False)
    view = rank_step(trace, plan, cluster)[0]  # the engine charges each op one rank runs, recomputations too
    ops = int(op_runs(view, plan)[[e.is_op for e in view.events]].sum())
    source = f"calibrate --trace: {len(steps)} profiled step(s) of {plan.policy or 'a plan'}"
    if cluster.engine is Engine.HOST:
        host = statistics.fmean(s.fsdp_seconds for s in steps)
        hook = host / max(1, report.hooks)
        rest = step - report.step_seconds(optimizer) - host
        overhead = dataclasses.replace(bare.overhead, hook_seconds=hook, op_seconds=max(-1e-3, rest / max(1, ops)),
                                       source=source)
        return dataclasses.replace(cluster, overhead=overhead)
    low, high = 0.0, 1e-3  # the launch cost per op, bisected: the step grows with it once the host falls behind
    for _ in range(40):
        mid = (low + high) / 2
        trial = dataclasses.replace(bare, overhead=dataclasses.replace(bare.overhead, op_seconds=mid))
        if simulate(trace, plan, trial, options, timeline=False).step_seconds(optimizer) < step:
            low = mid
        else:
            high = mid
    return dataclasses.replace(cluster, overhead=dataclasses.replace(bare.overhead, op_seconds=low, source=source))


def cpu_base(world: int) -> Cluster:
    """A cluster of ``world`` CPU ranks on gloo of this machine, before the fit (its figures are placeholders)."""
    cpu = GPU(f"CPU ({os.cpu_count()} cores)", CPU_START, CPU_START, CPU_START, max(1 << 30, host_memory() // world))
    link = Link(1e9, 1e-5, 0.0)
    return Cluster(name=f"gloo:{world}+trace", gpu=cpu, gpus_per_node=world, nodes=1, intra=link, inter=link,
                   nics_per_node=1, overhead=Overhead(0.0, 0.0, float("inf")), engine=Engine.HOST,
                   compute=Compute(1.0, 0.0, 1.0, 1.0, 0.0, "calibrate --trace"))


def _named(path: str, traces: list[MeasuredTrace]) -> str:
    """A trace's file by as many of its path's last parts as tell it from the other traces' (two runs'
    rank0.json: "run2/rank0.json"), its whole path where none do."""
    parts = Path(path).parts
    for n in range(1, len(parts)):
        tail = Path(*parts[-n:])
        if sum(Path(*Path(t.path).parts[-n:]) == tail for t in traces) == 1:
            return str(tail)
    return path


def fit_trace(trace: Trace, plan: Plan, traces: list[MeasuredTrace], base: Cluster | None,
              options: SimOptions) -> tuple[Cluster, TraceFit]:
    """The cluster fitted to ``traces`` of ``plan`` on ``trace``'s model, and how it matches them."""
    devices = {t.device for t in traces}
    if len(devices) > 1:
        raise PlannerError("the traces mix CPU and GPU runs: give the traces of one job")
    world = max(t.world for t in traces)
    if base is None:
        if devices != {"cpu"}:
            raise PlannerError("a GPU trace needs --base: the cluster it ran on (e.g. h100:8), whose peaks the "
                               "efficiencies are fitted against")
        base = cpu_base(world)
    elif (base.engine is Engine.HOST) != (devices == {"cpu"}):
        # a CPU step fitted against a GPU's peaks writes efficiencies of a thousandth (and the reverse, of a
        # thousand): every plan costed with them would be wrong by as much
        ran = "on the CPU (no GPU kernels in them)" if devices == {"cpu"} else "on GPUs"
        raise PlannerError(f"the traces ran {ran} and --base {base.name} is a "
                           f"{'CPU (gloo)' if base.engine is Engine.HOST else 'GPU'} cluster: give the cluster they "
                           "ran on (a CPU job's traces need no --base; a GPU job's are profiled with "
                           "ProfilerActivity.CUDA)")
    if base.world_size != world:
        raise PlannerError(f"the traces are of {world} ranks and the base cluster {base.name} has "
                           f"{base.world_size}: give a --base of the traced job's size")
    steps, ops = typical_steps(traces), RankOps.of(trace, plan, base, options)
    before = simulate(trace, plan, base, options, timeline=False)  # the plan on the base cluster: checked and shown
    check_matches(ops, plan, traces, before)
    cluster = fit_compute(ops, base, measured_classes(steps), options)
    if devices != {"cpu"} and options.precision.compute_bytes == 2:  # (fp32 matmuls run on TF32: 4-8x past the
        # fp32 peak, which the fit raises, and says so)
        _check_peaks(cluster, base, traces)
    # a TP job's data-parallel groups take one rank of each TP group: over several nodes, strided
    strided = frozenset({world // plan.tp_degree}) if plan.tp_degree > 1 and base.nodes > 1 else frozenset()
    cluster = fit_collectives(cluster, steps, strided)
    cluster = fit_overhead(trace, plan, cluster, steps, options)
    name = base.name if base.name.endswith("+trace") else f"{base.name}+trace"
    cluster = dataclasses.replace(cluster, name=name, compute=dataclasses.replace(
        cluster.compute, source=f"calibrate --trace ({len(traces)} trace(s))"))
    return cluster, describe_fit(trace, plan, ops, steps, base, cluster, options, before)


PAST_PEAK = 1.05  # a GPU trace's matmuls or attention fitted faster than the base GPU's datasheet peak by more than
# this: no kernel runs past the peak, so the plan counts more FLOPs than the traced step ran (a larger batch)


def _check_peaks(fitted: Cluster, base: Cluster, traces: list[MeasuredTrace]) -> None:
    """Refuse a GPU fit of a 16-bit job whose FLOP-bound kernels ran past the base GPU's peak (a fit of more than 1
    raises the peak, right for a CPU's unknown one and fp32 on TF32): a trace of a smaller workload than the one
    given wrote a matmul efficiency of 1.0 at 1.67x the base's peak, without a word (a trial's --batch 4 beside a
    trace of batch 2)."""
    # (matmuls only: their FLOPs are exact, while a sliding window's attention is counted as full causal)
    up = fitted.compute.matmul_efficiency * fitted.gpu.peak_bf16_flops / base.gpu.peak_bf16_flops
    if up > PAST_PEAK:
        raise PlannerError(f"the traces' matmuls ran at {up:.0%} of the {base.gpu.name}'s peak as the plan counts "
                           f"their FLOPs, which no GPU runs past: "
                           f"{shown_json(Path(traces[0].path).name)} is of a smaller workload than the one given "
                           "(give the --batch, --seq and --precision the traced job ran with), or --base is another "
                           "GPU than it ran on")


# a CPU step's matmul ops (and their FLOPs) against the plan's, checkpointing's recomputation counted: one aten op
# each, as traced; a trace of another model, two steps overlapping or another workload is far outside. (A GPU
# step's matmul kernels are not one per op: cuDNN ran 182 for ResNet-50's 109 convolutions and matmuls on an A100,
# tests/test_trace_real_gpu.py, torchtitan's TP block 119 for 111 on an H200.)
MATMUL_RATIO = (0.8, 1.25)


def check_matches(ops: RankOps, plan: Plan, traces: list[MeasuredTrace], report: StepReport) -> None:
    """Refuse traces of another job than the one given, step by step (a step of another job among them skewed
    the fit: calibrate pools every step): a CPU step's matmuls and their FLOPs, and FSDP2's all-gathers and their
    bytes (exact on every rank of an FSDP2 job of the plan; a plan with TP or EP mixes its own collectives in), a
    distributed job's steps with none at all among them, against the plan's. A fit to a foreign trace writes a
    cluster whose figures are wrong for every plan; a comparison with one, gaps that are not the model's."""
    is_op = np.asarray([e.is_op for e in ops.trace.events])
    classes = simulated_classes(ops.trace)
    is_matmul = is_op & (classes == 0)
    attention = ops.runs[is_op & (classes == 1)]
    counts = PlanCounts(int(ops.runs[is_matmul].sum()), int(attention.sum()), int((attention - 1).sum()))
    flops = float((ops.trace.index.op_flops * ops.runs)[is_matmul].sum())
    for t in traces:
        for i, step in enumerate(t.steps):
            problems = _step_problems(step, t, plan, report, counts, flops)
            if problems:
                raise PlannerError(f"the traces are not of the job given: {'; '.join(problems)} (step {i + 1} of "
                                   f"{shown_json(_named(t.path, traces))}): give the --model, --plan or --policy, "
                                   "--batch, --seq and --precision the traced job ran with (one job's traces; one "
                                   "forward and backward a profiled step, no micro-batches)")


class PlanCounts(NamedTuple):
    """What a step of the plan runs that a GPU trace's kernels show: its matmuls and attention calls,
    recomputation's included, and the attention calls its checkpointing recomputes."""

    matmuls: int
    attention: int
    recomputed_attention: int


def _step_problems(step: Step, t: MeasuredTrace, plan: Plan, report: StepReport, counts: PlanCounts,
                   flops: float) -> list[str]:
    """``check_matches`` of one step (``counts``: the plan's matmuls and attention calls a step, recomputation's
    included)."""
    measured, matmuls = step.op_counts.get(OpClass.MATMUL, 0), counts.matmuls
    problems = [] if t.device == "cpu" else _kernel_problems(step, counts)
    if not sum(step.op_counts.values()):
        problems.append("its steps hold no ops")
    mesh = plan.layout(max(1, t.world))
    ddp = mesh.shard == 1 and mesh.replicate > 1  # a DDP job's trace stands for the Rx1 mesh (docs/calibrate.md)
    if not ddp and not any(sp.lane == "host" for sp in step.spans):  # FSDP2's hooks record FSDP:: ranges
        problems.append("its steps hold no FSDP:: ranges (the job ran without FSDP2)")
    elif t.device == "cpu" and not MATMUL_RATIO[0] <= measured / max(1, matmuls) <= MATMUL_RATIO[1]:
        problems.append(f"a step of it runs {measured:,} matmuls where the plan's runs {matmuls:,}")
    elif step.matmul_flops is not None and plan.tensor_parallel is None and plan.expert_parallel is None \
            and not MATMUL_RATIO[0] <= step.matmul_flops / max(1.0, flops) <= MATMUL_RATIO[1]:  # a CPU trace's
        # shapes: the workload too (under TP the profiler records a DTensor op's global shapes)
        problems.append(f"its matmuls run {step.matmul_flops / 1e9:,.3g} GFLOP a step where the plan's at this "
                        f"workload run {flops / 1e9:,.3g}")
    # (a fake process group's job runs its collectives nowhere: one GPU running a larger job's step, benchmarks/gpu)
    distributed = t.world > 1 and t.backend != "fake"
    if plan.tensor_parallel is None and plan.expert_parallel is None and (step.collectives or distributed):
        gathers = [c for c in step.collectives if c.kind is CollectiveKind.ALL_GATHER]
        nbytes = sum(c.nbytes for c in gathers)
        if (len(gathers), nbytes) != (report.all_gathers, report.all_gather_bytes):
            problems.append(f"it all-gathers {len(gathers):,} times a step ({fmt_bytes(nbytes)}) where the plan "
                            f"does {report.all_gathers:,} times ({fmt_bytes(report.all_gather_bytes)})")
    return problems


def _kernel_problems(step: Step, counts: PlanCounts) -> list[str]:
    """A GPU step's kernels against the plan's ops: a matmul runs one kernel or more (cuDNN's convolutions several)
    and an attention call one or more each way (cuDNN's one, FlashAttention's backward three, flash-linear-
    attention's several), never far fewer: a trace with fewer is of a job that runs less (a job without
    checkpointing beside a plan with it: 339 matmul kernels for 435 matmuls). More kernels than ops say nothing,
    but a forward attention kernel in backward is a recomputation: a checkpointed job's trace beside a plan that
    recomputes no attention (Llama 3.2 1B with every block checkpointed on an H200: 16 cuDNN fprop kernels in
    backward, none without)."""
    matmuls, attention = step.op_counts.get(OpClass.MATMUL, 0), step.op_counts.get(OpClass.ATTENTION, 0)
    problems = []
    if matmuls < MATMUL_RATIO[0] * counts.matmuls:
        problems.append(f"a step of it runs {matmuls:,} matmul kernels where the plan's runs {counts.matmuls:,} "
                        "matmuls")
    if attention and attention < MATMUL_RATIO[0] * counts.attention:  # (none: attention on matmuls, SDPA's math
        # path)
        problems.append(f"a step of it runs {attention:,} attention kernels where the plan's runs "
                        f"{counts.attention:,} attention calls")
    again = sum(1 for sp in step.spans if sp.lane == "compute" and sp.start >= step.forward
                and op_class(sp.name, True) is OpClass.ATTENTION and forward_kernel(sp.name))
    if again and not counts.recomputed_attention:
        problems.append(f"its backward runs {fmt_count(again, 'forward attention kernel')} (a checkpointed job's "
                        "recomputation) where the plan recomputes no attention")
    return problems


def check_trace_of(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, measured: MeasuredTrace,
                   report: StepReport) -> None:
    """``simulate --against``'s trace is of the job simulated (``check_matches``) on a cluster of its size
    (``report``: the plan's step on ``cluster``)."""
    if measured.world > 1 and measured.world != cluster.world_size:
        raise PlannerError(f"{shown_json(Path(measured.path).name)} is a trace of a job of {measured.world} ranks and "
                           f"the cluster {cluster.name} has {cluster.world_size}: simulate on a cluster of the "
                           "traced job's size")
    check_matches(RankOps.of(tr, plan, cluster, options), plan, [measured], report)


def describe_fit(trace: Trace, plan: Plan, ops: RankOps, steps: list[Step], base: Cluster, cluster: Cluster,
                 options: SimOptions, on_base: StepReport) -> TraceFit:
    """Measured beside predicted, before and after the fit, on the typical steps: per class, per collective size,
    the step (``ops``: the plan's ``RankOps``; ``on_base``: its step simulated on ``base``)."""
    measured = measured_classes(steps)
    before, after = class_seconds(ops, base, options), class_seconds(ops, cluster, options)
    is_op = np.asarray([e.is_op for e in ops.trace.events])
    classes_sim, runs_sim = simulated_classes(ops.trace)[is_op], ops.runs[is_op]
    counts = steps[len(steps) // 2].op_counts
    classes = [ClassRow(c.value, counts[c], int(runs_sim[classes_sim == i].sum()), measured[c], before[c], after[c])
               for i, c in enumerate(OpClass)]
    per_step = max(1, len(steps))
    rows = [CollectiveRow(kind, nbytes, ranks, round(len(seconds) / per_step), statistics.fmean(seconds),
                          _charged(base, kind, nbytes, ranks), _charged(cluster, kind, nbytes, ranks))
            for (kind, nbytes, ranks), seconds in sorted(by_size(steps).items())]
    return TraceFit(len(steps), statistics.fmean(s.seconds for s in steps), on_base,
                    simulate(trace, plan, cluster, options, timeline=False), classes, rows,
                    statistics.fmean(s.fsdp_seconds for s in steps),
                    statistics.fmean(s.exposed_comm for s in steps), statistics.fmean(s.idle for s in steps),
                    ran_optimizer(steps))


def _charged(cluster: Cluster, kind: str, nbytes: int, ranks: int) -> float:
    ranks = min(ranks, cluster.world_size)
    return collective_time(cluster, kind, nbytes, ranks) if ranks >= 2 else 0.0

