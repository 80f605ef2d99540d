"""``calibrate --trace``: a cluster fitted to a user's own profiler traces of one plan of one model.

The traces (``kineto.py``) are matched to the simulator's step of the same model and plan by op class and by
collective: the simulator's ops of each class (``sim/compute.py``'s kernels: matmul, fused attention, memory-bound)
against the measured ones' median time a step, and each measured collective (kind, size, group) against what the
cost model charges it. Fitted, in this order, each with the earlier ones in place:
1. each class's efficiency, so the class's predicted seconds equal the measured (a few fixed-point passes through
   the roofline's max); an efficiency beyond 1 raises the peak instead (a CPU's "peak" is what it reached);
2. each collective's line ``alpha + (N-1)/N x bytes / busbw`` over the measured sizes (``nccl_logs.fit_samples``,
   the fitted-line path of ``hardware/cost.py``) and, on CPU ranks, the measured times themselves (``tables``);
3. the host's overhead: on CPU ranks (``Engine.HOST``: nothing overlaps) FSDP2's measured host ranges (``FSDP::``,
   less the collectives and ops in them) over the step's hooks, and what is left of the measured step over its
   ops; on GPUs the per-op launch cost that makes the simulated step the measured one (the host falls behind).
Not fitted: per-block or per-shape matmul rates (one rate a class), the slowest-rank spread.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from fsdp_planner.calibrate.gloo import monotone
from fsdp_planner.calibrate.kineto import MeasuredTrace, OpClass
from fsdp_planner.calibrate.nccl_logs import fit_samples
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import GPU, Cluster, Compute, Engine, Link, Overhead
from fsdp_planner.hardware.cost import collective_time
from fsdp_planner.runtime.measure import host_memory
from fsdp_planner.sim.compute import op_times
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.trace.events import KERNEL_ATTENTION
from fsdp_planner.trace.records import Trace

# fixed-point passes of the efficiencies, at most: a class's ops bound by the other term (a small matmul moving its
# bytes) answer to its efficiency only in part, so the passes converge geometrically, not at once
PASSES = 200
CONVERGED = 1e-6  # every class's predicted seconds within this relative distance of the measured
CPU_START = 1e10  # a CPU "GPU"'s starting peak FLOP/s and bandwidth; the fit moves them to what was measured


@dataclass(frozen=True)
class ClassRow:
    op_class: str
    ops_measured: int
    ops_simulated: int
    measured: float  # seconds a step (median over the traces' steps)
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

    steps: int  # measured steps read
    measured_step: float  # median
    before: StepReport
    after: StepReport
    classes: list[ClassRow]
    collectives: list[CollectiveRow]
    measured_host: float  # FSDP2's host ranges a step (median)
    measured_exposed: float
    measured_idle: float


def simulated_classes(trace: Trace) -> np.ndarray:
    """Per event, its ``OpClass`` index in ``list(OpClass)`` (boundaries: memory-bound, with no time)."""
    kernel = trace.index.op_kernel
    return np.where(kernel > 0, 0, np.where(kernel == KERNEL_ATTENTION, 1, 2))


def class_seconds(trace: Trace, cluster: Cluster, options: SimOptions) -> dict[OpClass, float]:
    """The simulator's seconds of each class's ops a step on ``cluster``."""
    times = np.asarray(op_times(trace, cluster.gpu, options.precision, cluster.compute, cluster.world_size))
    classes = simulated_classes(trace)
    return {c: float(times[classes == i].sum()) for i, c in enumerate(OpClass)}


def measured_classes(traces: list[MeasuredTrace]) -> dict[OpClass, float]:
    steps = [s for t in traces for s in t.steps]
    return {c: statistics.median(s.op_seconds[c] for s in steps) for c in OpClass}


def fit_compute(trace: Trace, cluster: Cluster, measured: dict[OpClass, float], options: SimOptions) -> Cluster:
    """Efficiencies (and where one passes 1, the peaks) so each class's simulated seconds equal the measured."""
    for _ in range(PASSES):
        predicted = class_seconds(trace, cluster, options)
        c = cluster.compute
        scale = {k: predicted[k] / measured[k] if measured[k] > 0 and predicted[k] > 0 else 1.0 for k in OpClass}
        if all(abs(v - 1) <= CONVERGED for v in scale.values()):
            break
        matmul = c.matmul_efficiency * scale[OpClass.MATMUL]
        attention = c.attention_efficiency * scale[OpClass.ATTENTION]
        memory = c.memory_efficiency * scale[OpClass.MEMORY]
        flops_up, bytes_up = max(1.0, matmul, attention), max(1.0, memory)
        g = cluster.gpu
        gpu = dataclasses.replace(g, peak_bf16_flops=g.peak_bf16_flops * flops_up,
                                  peak_fp32_flops=g.peak_fp32_flops * flops_up,
                                  hbm_bandwidth=g.hbm_bandwidth * bytes_up)
        compute = dataclasses.replace(c, matmul_efficiency=max(1e-6, matmul / flops_up),
                                      attention_efficiency=max(1e-6, attention / flops_up),
                                      memory_efficiency=max(1e-6, memory / bytes_up))
        cluster = dataclasses.replace(cluster, gpu=gpu, compute=compute)
    return cluster


def by_size(traces: list[MeasuredTrace]) -> dict[tuple[str, int, int], list[float]]:
    """Every measured collective's seconds, by (kind, bytes, ranks)."""
    out: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for t in traces:
        for s in t.steps:
            for c in s.collectives:
                out[(c.kind.value, c.nbytes, c.ranks)].append(c.seconds)
    return out


def fit_collectives(cluster: Cluster, traces: list[MeasuredTrace]) -> Cluster:
    """The collectives' lines (and on CPU ranks their measured times) from the traces: a kind needs two sizes."""
    samples: dict[str, dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for (kind, nbytes, ranks), seconds in sorted(by_size(traces).items()):
        if ranks >= 2 and nbytes > 0:
            samples[kind][ranks].append((nbytes, statistics.fmean(seconds)))  # a step pays every call, tails too
    fits = {k: dict(v) for k, v in cluster.fits.items()}
    tables = dict(cluster.tables)
    for kind, groups in samples.items():
        for ranks, rows in groups.items():
            if len(rows) < 2:
                continue
            if cluster.engine is Engine.HOST and ranks == cluster.world_size:
                tables[kind] = monotone(rows)
            try:
                alpha, busbw, _, _ = fit_samples(rows, ranks, f"the trace's {kind.replace('_', '-')}s")
            except PlannerError:
                if kind in tables:  # too few or too noisy sizes for a line: the measured times stand alone
                    continue
                raise
            fits.setdefault(kind, {})[ranks] = (alpha, busbw)
    return dataclasses.replace(cluster, fits=fits, tables=tables)


def fit_overhead(trace: Trace, plan: Plan, cluster: Cluster, traces: list[MeasuredTrace], options: SimOptions
                 ) -> Cluster:
    """The host's costs (module docstring, 3.), the compute and collectives already fitted."""
    steps = [s for t in traces for s in t.steps]
    step = statistics.median(s.seconds for s in steps)
    bare = dataclasses.replace(cluster, overhead=dataclasses.replace(
        cluster.overhead, hook_seconds=0.0, op_seconds=0.0, param_seconds=0.0, module_seconds=0.0))
    report = simulate(trace, plan, bare, options, timeline=False)
    ops = int(trace.index.ops_through[-1])
    source = f"calibrate --trace: {len(steps)} profiled step(s) of {plan.policy or 'a plan'}"
    if cluster.engine is Engine.HOST:
        host = statistics.median(s.fsdp_seconds for s in steps)
        hook = host / max(1, report.hooks)
        rest = step - report.step_time - host
        overhead = dataclasses.replace(bare.overhead, hook_seconds=hook, op_seconds=max(-1e-3, rest / max(1, ops)),
                                       source=source)
        return dataclasses.replace(cluster, overhead=overhead)
    low, high = 0.0, 1e-3  # the launch cost per op, bisected: the step grows with it once the host falls behind
    for _ in range(40):
        mid = (low + high) / 2
        trial = dataclasses.replace(bare, overhead=dataclasses.replace(bare.overhead, op_seconds=mid))
        if simulate(trace, plan, trial, options, timeline=False).step_time < step:
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
    if base.world_size != world:
        raise PlannerError(f"the traces are of {world} ranks and the base cluster {base.name} has "
                           f"{base.world_size}: give a --base of the traced job's size")
    measured = measured_classes(traces)
    cluster = fit_compute(trace, base, measured, options)
    cluster = fit_collectives(cluster, traces)
    cluster = fit_overhead(trace, plan, cluster, traces, options)
    name = base.name if base.name.endswith("+trace") else f"{base.name}+trace"
    cluster = dataclasses.replace(cluster, name=name, compute=dataclasses.replace(
        cluster.compute, source=f"calibrate --trace ({len(traces)} trace(s))"))
    return cluster, describe_fit(trace, plan, traces, base, cluster, options)


def describe_fit(trace: Trace, plan: Plan, traces: list[MeasuredTrace], base: Cluster, cluster: Cluster,
                 options: SimOptions) -> TraceFit:
    """Measured beside predicted, before and after the fit: per class, per collective size, the step."""
    steps = [s for t in traces for s in t.steps]
    measured = measured_classes(traces)
    before, after = class_seconds(trace, base, options), class_seconds(trace, cluster, options)
    classes_sim = simulated_classes(trace)[np.asarray([e.is_op for e in trace.events])]
    counts = steps[len(steps) // 2].op_counts
    classes = [ClassRow(c.value, counts[c], int((classes_sim == i).sum()), measured[c], before[c], after[c])
               for i, c in enumerate(OpClass)]
    per_step = max(1, len(steps))
    rows = [CollectiveRow(kind, nbytes, ranks, round(len(seconds) / per_step), statistics.fmean(seconds),
                          _charged(base, kind, nbytes, ranks), _charged(cluster, kind, nbytes, ranks))
            for (kind, nbytes, ranks), seconds in sorted(by_size(traces).items())]
    return TraceFit(len(steps), statistics.median(s.seconds for s in steps),
                    simulate(trace, plan, base, options, timeline=False),
                    simulate(trace, plan, cluster, options, timeline=False), classes, rows,
                    statistics.median(s.fsdp_seconds for s in steps),
                    statistics.median(s.exposed_comm for s in steps), statistics.median(s.idle for s in steps))


def _charged(cluster: Cluster, kind: str, nbytes: int, ranks: int) -> float:
    ranks = min(ranks, cluster.world_size)
    return collective_time(cluster, kind, nbytes, ranks) if ranks >= 2 else 0.0

