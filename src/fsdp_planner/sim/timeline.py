"""One training step under FSDP2 on a cluster: time, exposed communication, per-rank memory, timeline.

The FSDP2 decisions (what is gathered, resharded, reduce-scattered, when) come from ``fsdp2/replay.py``; this
module puts times on them with three streams, as FSDP2 runs them:
- compute: the trace's ops in order (``compute.py``); an op reading a param waits until that param's group is
  gathered and copied out;
- all-gather: collectives in issue order. Forward: the CPU runs one group ahead (FSDP2's implicit forward
  prefetch), so a group's all-gather may start once compute reached the previously gathered group. Backward and
  explicit prefetches start when compute reaches the boundary that issues them. Each pays a copy-in;
- reduce-scatter: starts when compute finished the group's backward (its post-backward boundary);
- all-reduce (HSDP): FSDP2's ``all_reduce_stream`` all-reduces each reduce-scatter's output across the replicas
  once that reduce-scatter is done.
The communication streams share the links: latencies overlap, but the bytes of one collective wait for the
other streams' bytes on the same link (NVLink for groups within a node, the network otherwise).

Only two kinds of event can change the clocks: a collective being issued, and an op reading a group's params
for the first time after that group's all-gather (later reads find it ready). The simulation stops only there
and adds up the op times in between, so a plan costs time in its collectives, not in the trace's length.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from fsdp_planner.fmt import fmt_modules
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Collective, Schedule, build_schedule
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.hardware.collectives import CollectiveKind
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.memory import first_at_or_after
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.records import Trace

AG, RS, AR = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE


class Stream(Enum):
    COMPUTE = "compute"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


@dataclass(frozen=True)
class TimelineEvent:
    stream: Stream
    name: str
    start: float
    end: float
    group: int = -1
    op: int = -1  # compute: the first trace event of this run of ops (pictures map event positions to times)


@dataclass
class StepReport:
    step_time: float
    compute_time: float
    exposed_comm: float
    lower_bound: float
    peak_memory: int  # allocated bytes per rank at the step's peak (what real FSDP2 allocates)
    reserved_memory: int  # what the caching allocator reserves for the step: what must fit the GPU (sim/memory.py)
    memory_at_peak: dict[str, int]
    all_gathers: int
    reduce_scatters: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    comm_time: dict[str, float]  # seconds each communication stream is busy
    recompute_time: float = 0.0  # of compute_time: checkpointed forwards run again in backward
    all_reduces: int = 0  # HSDP: the reduced grads' all-reduces across replicas
    all_reduce_bytes: int = 0
    mesh: str = ""  # REPLICATExSHARD
    timeline: list[TimelineEvent] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        return d


class Streams:
    """The compute clock, the two communication streams and the links they share."""

    def __init__(self, ctx: SimContext, plan: Plan, gather: list[int], timeline: bool) -> None:
        self.ctx, self.plan, self.gather = ctx, plan, gather
        self.t = 0.0  # compute clock at the start of event ``pos``
        self.pos = 0
        self.free = {AG: 0.0, RS: 0.0, AR: 0.0}  # when each stream is idle again
        self.link_free = {"intra": 0.0, "inter": 0.0}  # when each link has carried the bytes queued on it
        self.ready = [0.0] * len(plan.groups)  # when each group's latest all-gather (and copy-out) finished
        self.last_forward_gather = 0.0  # compute time at the pre-forward of the previously gathered group
        self.busy = {AG: 0.0, RS: 0.0, AR: 0.0}
        self.events: list[TimelineEvent] | None = [] if timeline else None

    def compute_until(self, idx: int) -> None:
        """Run the ops before ``idx`` (none of them waits)."""
        start = self.t
        self.t += self.ctx.cum[idx] - self.ctx.cum[self.pos]
        if self.events is not None and self.t > start:
            self.events.append(TimelineEvent(Stream.COMPUTE, self.ctx.trace.events[self.pos].module or "(root)",
                                             start, self.t, op=self.pos))
        self.pos = idx

    def issue(self, c: Collective) -> None:
        nbytes = collective_bytes(self.ctx, c, self.gather)
        hbm = self.ctx.cluster.gpu.hbm_bandwidth
        if c.kind is AG:
            copy_in = nbytes / self.ctx.shard / hbm
            issued = self.t if (c.backward or c.prefetch) else self.last_forward_gather
        elif c.kind is AR:  # the reduce-scatter just issued for the same grads must be done
            copy_in, issued = 0.0, self.free[RS]
        else:
            copy_in, issued = 0.0, self.t
        alpha, per_byte, link = self.ctx.link(c.kind, c.ranks)
        start = max(self.free[c.kind], issued) + copy_in
        end = start + (alpha if nbytes else 0.0)
        if nbytes * per_byte > 0:  # the bytes queue behind the other stream's on the same link
            end = max(end, self.link_free[link]) + nbytes * per_byte
            self.link_free[link] = end
        self.free[c.kind] = end
        self.busy[c.kind] += end - start + copy_in
        if c.kind is AG:
            self.ready[c.group] = end + nbytes / hbm  # copy-out into the unsharded params
            if not c.backward and not c.prefetch:
                self.last_forward_gather = self.t
        if self.events is not None:
            self.events.append(TimelineEvent(Stream(c.kind.value), fmt_modules(self.plan.groups[c.group].modules, 1),
                                             start - copy_in, end, c.group))

    def run_extra(self, seconds: float, name: str) -> None:
        """Compute that is not one of the trace's ops (a checkpointed forward run again)."""
        if self.events is not None and seconds > 0:
            self.events.append(TimelineEvent(Stream.COMPUTE, name, self.t, self.t + seconds))
        self.t += seconds

    def wait_for(self, groups: list[int]) -> None:
        for g in groups:
            self.t = max(self.t, self.ready[g])


def simulate(trace: Trace, plan: Plan, cluster: Cluster | None = None, options: SimOptions | None = None,
             schedule: Schedule | None = None, context: SimContext | None = None,
             timeline: bool = True) -> StepReport:
    """Simulate one step of ``plan`` on ``cluster`` (world size = the cluster's GPU count).

    Pass a ``context`` (built once for the trace and cluster) to simulate many plans fast; ``timeline=False``
    skips the timeline, which only pictures need.
    """
    if context is None:
        if cluster is None:
            raise ValueError("simulate needs a cluster or a context")
        context = SimContext(trace, cluster, options, mesh=plan.mesh)
    ctx = context
    if plan.layout(ctx.world) != ctx.mesh:
        raise ValueError(f"plan's mesh {plan.layout(ctx.world).describe()} is not the context's "
                         f"{ctx.mesh.describe()}")
    groups = ctx.sizing.groups(plan)
    sched = schedule or build_schedule(trace, plan, ctx.world, [g.params for g in groups])
    gather = [g.gather_bytes for g in groups]
    issued_at: dict[int, list[Collective]] = {}
    waits: dict[int, list[int]] = {}  # op -> groups it is the first to read after their all-gather
    n = len(trace.events)
    for c in sched.collectives:
        issued_at.setdefault(c.event, []).append(c)
        if c.kind is AG:
            use = first_at_or_after(groups[c.group].uses, c.event, default=n)
            if use < n:
                waits.setdefault(use, []).append(c.group)
    recompute = ctx.recompute(plan.activation_checkpointing)
    group_of = {p: gi for gi, g in enumerate(groups) for p in g.params}
    streams = Streams(ctx, plan, gather, timeline)
    for idx in sorted({*issued_at, *waits, *recompute, n}):
        streams.compute_until(idx)
        for c in issued_at.get(idx, ()):
            streams.issue(c)
        if idx in recompute:  # the checkpointed forward runs again once the params it reads are gathered
            r = recompute[idx]
            streams.wait_for(sorted({group_of[p] for p in r.params if p in group_of}))
            streams.run_extra(r.seconds, f"recompute {fmt_modules(r.modules, 1)}")
        if idx < n and idx in waits:
            streams.wait_for(waits[idx])
    step = max(streams.t, *streams.free.values())
    return _report(ctx, sched, gather, streams, step, sum(r.seconds for r in recompute.values()))


def collective_bytes(ctx: SimContext, c: Collective, gather: list[int]) -> int:
    """Bytes as nccl-tests counts them: an all-gather's output, a reduce-scatter's input (both padded, the
    full unsharded size), an all-reduce's buffer (the reduce-scatter's output, one shard)."""
    if c.kind is AG:
        return gather[c.group]
    reduced = ctx.sizing.reduce_bytes(c.params)
    return reduced if c.kind is RS else reduced // ctx.shard


def _report(ctx: SimContext, sched: Schedule, gather: list[int], streams: Streams, step: float,
            recompute: float) -> StepReport:
    ag = [c for c in sched.collectives if c.kind is AG]
    rs = [c for c in sched.collectives if c.kind is RS]
    ar = [c for c in sched.collectives if c.kind is AR]
    memory = ctx.memory.peak(streams.plan, sched)
    breakdown = memory.at.to_dict()
    breakdown.pop("total")
    return StepReport(
        step_time=step, compute_time=ctx.compute_total + recompute,
        exposed_comm=max(0.0, step - ctx.compute_total - recompute), recompute_time=recompute,
        lower_bound=ctx.lower_bound, peak_memory=memory.allocated,
        reserved_memory=memory.reserved, memory_at_peak=breakdown,
        all_gathers=len(ag), reduce_scatters=len(rs), all_gather_bytes=sum(gather[c.group] for c in ag),
        reduce_scatter_bytes=sum(ctx.sizing.reduce_bytes(c.params) for c in rs),
        comm_time={k.value: v for k, v in streams.busy.items() if k is not AR or ar},
        all_reduces=len(ar), all_reduce_bytes=sum(collective_bytes(ctx, c, gather) for c in ar),
        mesh=ctx.mesh.describe(), timeline=streams.events or [])
