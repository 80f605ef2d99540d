"""The data behind the step pictures: lanes of bars, exposed communication and the memory curve of one plan.

Both renderers (``timeline_png.py``, ``timeline_html.py``) draw a ``StepView`` and nothing else, so what a picture
shows is computed (and tested) once. The bars are the simulator's own timeline (``sim/timeline.py``); the memory
curve is the memory model's per-event levels (``MemoryModel.levels``, the same terms as the peak), put on the time
axis by the compute events, which say where each run of ops starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from fsdp_planner.fmt import fmt_bytes, fmt_time
from fsdp_planner.fsdp2.checkpointing import plan_checkpointing
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.expert_parallel import ep_positions, ep_view
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.recompute import CheckpointedCall, checkpointed_calls
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.tensor_parallel import tp_positions, tp_view
from fsdp_planner.sim.timeline import Stream, TimelineEvent, Work
from fsdp_planner.trace.records import Trace

# Compute runs shorter than this share of the step are merged with their neighbours: a picture is ~1,500 pixels
# wide, and thousands of abutting slivers would read as noise (and bloat the HTML).
MIN_BAR_SHARE = 1 / 1500
MEMORY_POINTS = 20_000  # the memory curve is thinned to this many steps, each keeping its maximum


class BarKind(Enum):
    """What a bar shows; the renderers give each kind one colour and one legend entry."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    COPY_OUT = "copy_out"  # FSDP2's copy of an all-gather's output into the params, on the compute stream
    HOST = "host"  # compute idle, waiting for the host to launch the next op
    EXPOSED = "exposed"  # compute idle, waiting for a collective
    OPTIMIZER = "optimizer"  # the optimizer step after backward
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    TP_COLLECTIVE = "tp_collective"  # TP's collectives of activations and grads, which compute waits for
    EP_ALL_TO_ALL = "ep_all_to_all"  # EP's all-to-alls of routed tokens, which compute waits for

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def color(self) -> str:
        """The same in the PNG and the HTML, so the two read alike."""
        return _COLORS[self]


_LABELS = {
    BarKind.FORWARD: "forward compute",
    BarKind.BACKWARD: "backward compute",
    BarKind.RECOMPUTE: "recompute (activation checkpointing)",
    BarKind.COPY_OUT: "FSDP2 copy-out",
    BarKind.HOST: "waiting for the host (FSDP2 hooks, launches)",
    BarKind.EXPOSED: "exposed communication (compute waits)",
    BarKind.OPTIMIZER: "optimizer step",
    BarKind.ALL_GATHER: "all-gather",
    BarKind.REDUCE_SCATTER: "reduce-scatter",
    BarKind.ALL_REDUCE: "all-reduce (HSDP replicas)",
    BarKind.TP_COLLECTIVE: "TP collective (inside the compute bars: compute waits)",
    BarKind.EP_ALL_TO_ALL: "EP all-to-all (inside the compute bars: compute waits)",
}
_COLORS = {
    BarKind.FORWARD: "#4c78a8",
    BarKind.BACKWARD: "#2a4d7a",
    BarKind.RECOMPUTE: "#9ecae9",
    BarKind.COPY_OUT: "#bab0ac",
    BarKind.HOST: "#eeca3b",
    BarKind.EXPOSED: "#e45756",
    BarKind.OPTIMIZER: "#72b7b2",
    BarKind.ALL_GATHER: "#54a24b",
    BarKind.REDUCE_SCATTER: "#f58518",
    BarKind.ALL_REDUCE: "#b279a2",
    BarKind.TP_COLLECTIVE: "#d67195",
    BarKind.EP_ALL_TO_ALL: "#8c6d31",
}
_COMM = {Stream.ALL_GATHER: BarKind.ALL_GATHER, Stream.REDUCE_SCATTER: BarKind.REDUCE_SCATTER,
         Stream.ALL_REDUCE: BarKind.ALL_REDUCE}


@dataclass(frozen=True)
class Bar:
    kind: BarKind
    name: str  # the module(s) or group it runs for; for exposed time, what compute waits for
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Lane:
    name: str
    bars: list[Bar]


@dataclass
class StepView:
    """One plan's step on one cluster, ready to draw."""

    label: str
    report: StepReport
    lanes: list[Lane]  # compute, all-gather, reduce-scatter (and all-reduce under HSDP, TP's and EP's under them)
    memory_times: np.ndarray  # start of each event position, then the step's end
    memory_bytes: np.ndarray  # allocated bytes per rank from that time on (the last repeats the one before)
    capacity: int  # one GPU's memory
    gpu: str
    backward_start: float  # when the step's backward begins: forward bars end by then, backward bars start after
    budget: MemoryBudget  # what the reserved peak must fit (the GPU less its headroom, or --memory-budget)

    @property
    def exposed(self) -> list[Bar]:
        return [b for b in self.lanes[0].bars if b.kind is BarKind.EXPOSED]

    def summary(self) -> str:
        r = self.report
        share = r.exposed_comm / r.step_time if r.step_time else 0.0
        host = f", waiting for the host {fmt_time(r.host_wait)}" if r.host_wait else ""
        if r.cpu_optimizer_time:  # CPUOffloadPolicy: part of the step, after backward
            host += f", optimizer step on the CPU {fmt_time(r.cpu_optimizer_time)}"
        if r.gpu_optimizer_time:  # part of the step, after backward
            host += f", optimizer step on the GPU {fmt_time(r.gpu_optimizer_time)}"
        return (f"{self.label}: step {fmt_time(r.step_time)}, exposed comm {fmt_time(r.exposed_comm)} ({share:.1%})"
                f"{host}, "
                f"peak {fmt_bytes(r.peak_memory)} allocated, {fmt_bytes(r.reserved_memory)} reserved, "
                f"{self.budget.margin(r.reserved_memory)}"
                f"{'' if self.budget.fits(r.reserved_memory) else ': does not fit'}")


def step_view(trace: Trace, plan: Plan, cluster: Cluster, options: SimOptions | None = None,
              label: str | None = None, budget: MemoryBudget | None = None) -> StepView:
    """Simulate ``plan`` with its timeline and turn it into lanes and a memory curve; its margin is below ``budget``
    (default: one GPU of ``cluster`` less the default headroom). A plan with TP: one TP rank's step; with EP, one
    EP rank's."""
    if plan.tensor_parallel is not None and plan.tp_degree > 1 and not trace.tensor_parallel:
        view = tp_view(trace, plan.tensor_parallel, cluster, (options.float8 if options else None) or plan.float8)
        trace, plan, cluster = view.trace, view.plan(plan), view.cluster
    if plan.ep_degree > 1 and not trace.expert_parallel:  # one EP rank's (of one TP rank's) step
        trace = ep_view(trace, plan).trace
    ctx = SimContext(trace, cluster, plan_options(plan, options or SimOptions()), mesh=plan.layout(cluster.world_size))
    groups = ctx.sizing.groups(plan)
    schedule = build_schedule(trace, plan, ctx.world, [g.params for g in groups])
    report = simulate(trace, plan, context=ctx, schedule=schedule, timeline=True)
    levels = ctx.memory.levels(plan, schedule)
    times = event_times(report.timeline, ctx.cum, len(trace.events))
    comm = [comm_bars(report.timeline, s) for s in _COMM if s is not Stream.ALL_REDUCE or ctx.mesh.replicate > 1]
    compute = compute_bars(report.timeline, trace.index.forward_end, report.step_time, comm)
    lanes = [Lane("compute", compute), *(Lane(k.label.split(" (")[0], bars) for k, bars in comm)]
    parallel = parallel_bars(ctx, plan, report.timeline, times)
    if parallel:  # (named by what the plan runs: "TP", "EP" or "TP / EP")
        name = " / ".join(k for k, on in (("TP", trace.tensor_parallel), ("EP", trace.expert_parallel)) if on)
        lanes.append(Lane(name, merge_thin(parallel, report.step_time * MIN_BAR_SHARE)))
    return StepView(label or plan.policy or "plan", report, lanes,
                    np.append(times, report.step_time), np.append(levels, _optimizer_level(ctx, plan, levels)),
                    cluster.gpu.memory_bytes, cluster.gpu.name, float(times[trace.index.forward_end]),
                    budget or MemoryBudget.of_gpu(cluster.gpu.memory_bytes, cluster.gpu.name))


def _optimizer_level(ctx: SimContext, plan: Plan, levels: np.ndarray) -> float:
    """The memory while the optimizer steps (after the last event): its temporaries beside the state, when the GPU
    runs it; else the level the step ended at."""
    if ctx.options.offload:
        return float(levels[-1])
    return float(ctx.memory.step_level(plan))


def event_times(timeline: Sequence[TimelineEvent], cum: Sequence[float], n: int) -> np.ndarray:
    """When each event position ``0..n`` starts: the compute run holding it started at ``start`` with op ``op``,
    and the ops before it in the run took ``cum[k] - cum[op]``. Positions of zero-time ops that ended a run
    (no event of their own) sit at its end."""
    runs = sorted((e for e in timeline if e.stream is Stream.COMPUTE and e.work is Work.OPS and e.op >= 0),
                  key=lambda e: e.op)
    cum_arr = np.asarray(cum)
    out = np.zeros(n + 1)
    for k, e in enumerate(runs):
        stop = runs[k + 1].op if k + 1 < len(runs) else n + 1
        out[e.op:stop] = np.minimum(e.start + cum_arr[e.op:stop] - cum_arr[e.op], e.end)
    return out


def parallel_bars(ctx: SimContext, plan: Plan, timeline: Sequence[TimelineEvent], times: np.ndarray) -> list[Bar]:
    """TP's collectives and EP's all-to-alls, each where it runs: at its op's place in its compute run, and again
    inside the recomputation that runs it (a checkpointed call's forward ops, less those its policy keeps, in
    order from the recompute bar's start: the seconds ``SimContext.recompute`` adds up). Eager DTensor and the
    all-to-alls block the compute stream, so these bars sit inside the compute lane's, not beside them."""
    trace = ctx.trace
    kinds = {p: BarKind.TP_COLLECTIVE for p in tp_positions(trace, ctx.grad_sync).tolist()} \
        if trace.tensor_parallel else {}
    if trace.expert_parallel:
        kinds |= {p: BarKind.EP_ALL_TO_ALL for p in ep_positions(trace).tolist()}
    if not kinds:
        return []
    name = lambda p: trace.events[p].module or "(root)"  # noqa: E731
    bars = [Bar(k, name(p), float(times[p]), float(times[p]) + ctx.times[p]) for p, k in kinds.items()]
    calls: dict[int, list[CheckpointedCall]] = {}
    for c in checkpointed_calls(trace, plan_checkpointing(plan)):
        if not c.offload:  # (its saved tensors copied out and back: nothing runs again)
            calls.setdefault(c.runs_again_at(trace), []).append(c)
    for e in timeline:
        if e.work is Work.RECOMPUTE and e.op >= 0:
            t = e.start
            for p in (p for c in calls.get(e.op, ()) for p in c.recomputed(trace)):
                if p in kinds:
                    bars.append(Bar(kinds[p], name(p), t, min(t + ctx.times[p], e.end)))
                t += ctx.times[p]
    return sorted((b for b in bars if b.end > b.start), key=lambda b: b.start)


def comm_bars(timeline: Sequence[TimelineEvent], stream: Stream) -> tuple[BarKind, list[Bar]]:
    """One communication stream's collectives, named by their group's modules."""
    kind = _COMM[stream]
    return kind, [Bar(kind, e.name, e.start, e.end) for e in timeline if e.stream is stream]


def compute_bars(timeline: Sequence[TimelineEvent], forward_end: int, step: float,
                 comm: Sequence[tuple[BarKind, list[Bar]]]) -> list[Bar]:
    """The compute lane: runs of ops (forward, backward, recompute), thin abutting runs merged, and the gaps
    between them, where compute waits for a collective, as exposed bars naming that collective."""
    runs = [Bar(_compute_kind(e, forward_end), e.name, e.start, e.end)
            for e in timeline if e.stream is Stream.COMPUTE]
    runs.sort(key=lambda b: b.start)
    tol = step * 1e-9
    bars: list[Bar] = []
    clock = 0.0
    for b in runs:
        if b.start > clock + tol:
            bars.append(Bar(BarKind.EXPOSED, _waited_for(clock, b.start, comm), clock, b.start))
        bars.append(b)
        clock = max(clock, b.end)
    if step > clock + tol:
        bars.append(Bar(BarKind.EXPOSED, _waited_for(clock, step, comm), clock, step))
    return merge_thin(bars, step * MIN_BAR_SHARE)


def _compute_kind(e: TimelineEvent, forward_end: int) -> BarKind:
    """A run of ops is forward or backward by its first op: the engines end every run at the step's
    forward/backward boundary (``forward_end``), so no run holds both."""
    if e.work is not Work.OPS:
        return _WORK[e.work]
    return BarKind.FORWARD if e.op < forward_end else BarKind.BACKWARD


_WORK = {Work.RECOMPUTE: BarKind.RECOMPUTE, Work.COPY_OUT: BarKind.COPY_OUT, Work.HOST: BarKind.HOST,
         Work.OPTIMIZER: BarKind.OPTIMIZER}


def _waited_for(start: float, end: float, comm: Sequence[tuple[BarKind, list[Bar]]]) -> str:
    """The collective compute waits for in [start, end]: of those running then, the one that finishes last
    before compute resumes (the last one running at all when none finishes in time)."""
    running = [b for _, bars in comm for b in bars if b.start < end and b.end > start]
    if not running:
        return "nothing (idle)"
    done = [b for b in running if b.end <= end * (1 + 1e-9)]
    b = max(done or running, key=lambda x: x.end)
    return f"{b.kind.label} {b.name}"


def merge_thin(bars: Sequence[Bar], min_width: float) -> list[Bar]:
    """Merge abutting bars of one kind while the merged bar stays under ``min_width``: a run of thin bars
    becomes a few readable ones; a wide bar and every exposed gap keep their own extent."""
    out: list[Bar] = []
    for b in bars:
        last = out[-1] if out else None
        if (last is not None and last.kind is b.kind and b.kind is not BarKind.EXPOSED
                and abs(b.start - last.end) <= min_width * 1e-6 and b.end - last.start < min_width):
            first = last.name.split(" … ")[0]
            out[-1] = Bar(b.kind, first if first == b.name else f"{first} … {b.name}", last.start, b.end)
        else:
            out.append(b)
    return out


def thin_curve(times: np.ndarray, levels: np.ndarray, points: int = MEMORY_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``points`` steps of the memory curve, each the maximum of the levels it covers (so the peak
    survives thinning); times are the start of each step, the last one the step's end."""
    if len(times) <= points:
        return times, levels
    end = float(times[-1])
    edges = np.linspace(0.0, end, points)
    which = np.clip(np.searchsorted(edges, times[:-1], side="right") - 1, 0, points - 1)
    out = np.full(points, -np.inf)
    np.maximum.at(out, which, levels[:-1])
    keep = np.isfinite(out)
    t, b = edges[keep], out[keep]
    return np.append(t, end), np.append(b, b[-1])


def time_unit(seconds: float) -> tuple[str, float]:
    """The axis unit for a step of ``seconds``: s, ms or us, and the factor from seconds."""
    if seconds >= 1.0:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "us", 1e6
