"""One training step under FSDP2 on a cluster: time, exposed communication, per-rank memory, timeline.

The FSDP2 decisions (what is gathered, resharded, reduce-scattered, when) come from ``fsdp2/replay.py``; this
module puts times on them with three streams, as FSDP2 runs them:
- host: eager PyTorch runs ahead of the GPU, launching each op (``Overhead.op_seconds``) and running FSDP2's
  hooks (``hook_seconds`` each, at the boundaries the replay lists); an op cannot start before the host launched
  it, and a collective not before its hook ran. While the host keeps ahead this costs nothing; with many tiny
  groups or ops it is the step (pytorch#173680);
- compute: the trace's ops in order (``compute.py``); an op reading a param waits until that param's group is
  gathered, then pays the group's copy-out (FSDP2 runs ``split_with_sizes_copy`` on the compute stream);
- all-gather: collectives in issue order. Forward: the CPU runs one group ahead (FSDP2's implicit forward
  prefetch), so a group's all-gather may start once compute reached the previously gathered group. Backward and
  explicit prefetches start when compute reaches the boundary that issues them. Each pays a copy-in (FSDP2's
  copy-in stream) at ``Overhead.copy_bandwidth``;
- reduce-scatter: starts when compute finished the group's backward (its post-backward boundary), after the
  copy of the grads into its input;
- all-reduce (HSDP): FSDP2's ``all_reduce_stream`` all-reduces each reduce-scatter's output across the replicas
  once that reduce-scatter is done.
The communication streams share the links: latencies overlap, but the bytes of one collective wait for the
other streams' bytes on the same link (NVLink for groups within a node, the network otherwise).

Only two kinds of event can change the clocks: a collective being issued, and an op reading a group's params
for the first time after that group's all-gather (later reads find it ready). The simulation stops only there
and adds up the op times in between (the host's lead over such a stretch is one running maximum), so a plan
costs time in its collectives, not in the trace's length. Each collective is costed with the protocol NCCL
would run at its size (``hardware/collectives.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np

from fsdp_planner.fmt import fmt_modules
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Collective, Schedule, build_schedule, state_hook_calls
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.sim.context import Recompute, SimContext
from fsdp_planner.sim.memory import first_at_or_after
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.records import Trace

AG, RS, AR = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE


class Stream(Enum):
    COMPUTE = "compute"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


class Work(Enum):
    """What the compute stream does during one of its timeline events."""

    OPS = "ops"  # a run of the trace's ops
    RECOMPUTE = "recompute"  # a checkpointed forward run again
    COPY_OUT = "copy-out"  # FSDP2 copying an all-gather's output into the unsharded params
    HOST = "host"  # idle: the host has not launched the next op yet (FSDP2's hooks, launches)


@dataclass(frozen=True)
class TimelineEvent:
    stream: Stream
    name: str
    start: float
    end: float
    group: int = -1
    op: int = -1  # compute: the first trace event of this run of ops (pictures map event positions to times)
    work: Work = Work.OPS  # compute only


@dataclass
class StepReport:
    step_time: float
    compute_time: float
    exposed_comm: float  # compute waiting for collectives: step - compute - copy-outs - host waits
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
    host_time: float = 0.0  # the host's work for the step: ops launched, FSDP2's hooks (hidden while it keeps ahead)
    host_wait: float = 0.0  # compute idle because the host had not launched the next op
    copy_time: float = 0.0  # FSDP2's copy-outs on the compute stream
    hooks: int = 0  # FSDP2 lifecycle calls doing work in the step (pre/post-forward, pre/post-backward per group)
    timeline: list[TimelineEvent] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        return d


class Streams:
    """The host and compute clocks, the communication streams and the links they share."""

    def __init__(self, ctx: SimContext, plan: Plan, gather: list[int], timeline: bool,
                 host: HostClock | None) -> None:
        self.ctx, self.plan, self.gather, self.host = ctx, plan, gather, host
        self.t = 0.0  # compute clock at the start of event ``pos``
        self.pos = 0
        self.free = {AG: 0.0, RS: 0.0, AR: 0.0}  # when each stream is idle again
        self.link_free = {"intra": 0.0, "inter": 0.0}  # when each link has carried the bytes queued on it
        self.ready = [0.0] * len(plan.groups)  # when each group's latest all-gather finished
        self.copy_out = [0.0] * len(plan.groups)  # its copy-out, paid on the compute stream by the first reader
        self.last_forward_gather = 0.0  # compute time at the pre-forward of the previously gathered group
        self.busy = {AG: 0.0, RS: 0.0, AR: 0.0}
        self.host_wait = 0.0
        self.copy_time = 0.0
        self.events: list[TimelineEvent] | None = [] if timeline else None

    def compute_until(self, idx: int) -> None:
        """Run the ops before ``idx`` (none of them waits for a collective; each waits for its launch: where the
        host is behind, the wait is drawn before the run)."""
        busy = self.ctx.cum[idx] - self.ctx.cum[self.pos]
        if self.host is not None and idx > self.pos:
            self.wait_for_host(self.host.finish(self.pos, idx) - busy)
        if self.events is not None and busy > 0:
            self.events.append(TimelineEvent(Stream.COMPUTE, self.ctx.trace.events[self.pos].module or "(root)",
                                             self.t, self.t + busy, op=self.pos))
        self.t += busy
        self.pos = idx

    def wait_for_host(self, until: float) -> None:
        """Compute idle until the host reaches ``until`` (drawn as a wait for the host)."""
        if until > self.t:
            if self.events is not None:
                self.events.append(TimelineEvent(Stream.COMPUTE, "waiting for the host", self.t, until,
                                                 work=Work.HOST))
            self.host_wait += until - self.t
            self.t = until

    def issue(self, c: Collective) -> None:
        nbytes = collective_bytes(self.ctx, c, self.gather)
        copy = self.ctx.cluster.overhead.copy_bandwidth
        # a shard group of one rank: FSDP2 issues no all-gather or reduce-scatter, yet copies the params out of
        # their shards on the compute stream and the grads into the reduce-scatter buffer (wait_for_unshard and
        # foreach_reduce at world size 1)
        one_rank = self.ctx.shard == 1 and c.kind is not AR
        if c.kind is AG:
            copy_in = 0.0 if one_rank else nbytes / self.ctx.shard / copy
            issued = self.t if (c.backward or c.prefetch) else self.last_forward_gather
        elif c.kind is AR:  # the reduce-scatter just issued for the same grads must be done
            copy_in, issued = 0.0, self.free[RS]
        else:  # the unsharded grads copied into the reduce-scatter's input
            copy_in, issued = nbytes / copy, self.t
        if self.host is not None:  # launched by the hook at this boundary
            issued = max(issued, self.host.at(c.event))
        alpha, per_byte, link = (0.0, 0.0, "intra") if one_rank else self.ctx.link(c.kind, c.ranks, nbytes)
        start = max(self.free[c.kind], issued) + copy_in
        end = start + (alpha if nbytes else 0.0)
        if nbytes * per_byte > 0:  # the bytes queue behind the other stream's on the same link
            end = max(end, self.link_free[link]) + nbytes * per_byte
            self.link_free[link] = end
        self.free[c.kind] = end
        self.busy[c.kind] += end - start + copy_in
        if c.kind is AG:
            self.ready[c.group] = end
            self.copy_out[c.group] = nbytes / copy
            if not c.backward and not c.prefetch:
                self.last_forward_gather = self.t
        if self.events is not None and end > start - copy_in:
            self.events.append(TimelineEvent(Stream(c.kind.value), fmt_modules(self.plan.groups[c.group].modules, 1),
                                             start - copy_in, end, c.group))

    def run_extra(self, seconds: float, name: str, launched: float = 0.0) -> None:
        """Compute that is not one of the trace's ops (a checkpointed forward run again), its last op launched by
        the host at ``launched``."""
        if self.events is not None and seconds > 0:
            self.events.append(TimelineEvent(Stream.COMPUTE, name, self.t, self.t + seconds, work=Work.RECOMPUTE))
        self.t += seconds
        self.wait_for_host(launched)

    def wait_for(self, groups: list[int]) -> None:
        """Compute waits for each group's all-gather, then copies it out (once per all-gather)."""
        for g in groups:
            self.t = max(self.t, self.ready[g])
            copy = self.copy_out[g]
            if self.events is not None and copy > 0:
                name = f"copy-out {fmt_modules(self.plan.groups[g].modules, 1)}"
                self.events.append(TimelineEvent(Stream.COMPUTE, name, self.t, self.t + copy, g, work=Work.COPY_OUT))
            self.t += copy
            self.copy_time += copy
            self.copy_out[g] = 0.0


@dataclass(frozen=True)
class HostWork:
    """FSDP2's host work in one step, counted: what ``HostClock`` (and the CPU-rank engine) charges the cluster's
    ``Overhead`` figures for, so a report can show the sum it makes."""

    hooks: int
    params: float  # params per hook, summed over the hooks (a group's four hooks a step count its params once)
    module_calls: int  # calls of modules fully_shard was applied to
    ops: int  # ops launched, recomputation included (on CPU ranks the ops are the compute itself)


def host_work(ctx: SimContext, plan: Plan) -> HostWork:
    groups = ctx.sizing.groups(plan)
    sched = build_schedule(ctx.trace, plan, ctx.world, [g.params for g in groups])
    recompute = ctx.recompute(plan.activation_checkpointing)
    return HostWork(hooks=len(sched.hooks), params=sum(len(groups[g].params) for _, g in sched.hooks) / 4,
                    module_calls=len(state_hook_calls(ctx.trace, plan)),
                    ops=ctx.trace.index.op_count + sum(r.ops for r in recompute.values()))


class HostClock:
    """When the host has launched each op of the trace under one plan: ``op_seconds`` per op, and per FSDP2 hook
    (at its boundary, before the ops after it) ``hook_seconds`` plus ``param_seconds`` / 4 for each param its group
    manages (a group runs four hooks a step), ``module_seconds`` at each call of a module fully_shard was applied
    to, and the ops of a checkpointed forward launched again at its pre-backward boundary. The host never waits for
    the GPU within a step (FSDP2's stream waits are on the GPU), so this is a running sum, and the GPU finishes ops
    pos..idx-1 no earlier than the latest (launch of op j + the ops from j to idx)."""

    def __init__(self, ctx: SimContext, hooks: list[tuple[int, int]], group_params: list[int],
                 recompute: dict[int, Recompute], calls: Sequence[int] = ()) -> None:
        n = len(ctx.trace.events)
        overhead = ctx.cluster.overhead
        host = np.zeros(n + 1)  # host seconds spent at each event beyond launching its op
        for at, group in hooks:
            host[at] += overhead.hook_seconds + group_params[group] * overhead.param_seconds / 4
        for at in calls:  # its backward hooks charged with its forward ones
            host[at] += overhead.module_seconds
        for at, r in recompute.items():
            host[at] += r.ops * overhead.op_seconds
        # launched[i]: the host's time once event i is done (an op launched, a boundary's hooks run)
        self.launched = ctx.trace.index.ops_through * overhead.op_seconds + np.cumsum(host)
        self.cum = ctx.cum
        self.lead = self.launched[:n] - np.asarray(self.cum[:n])  # launch of op j less the ops before it

    def at(self, idx: int) -> float:
        """The host's time once boundary ``idx``'s hooks ran (and any recomputation there was launched)."""
        return float(self.launched[idx])

    def finish(self, pos: int, idx: int) -> float:
        """The earliest the GPU can finish ops pos..idx-1, given when they were launched."""
        return float(self.lead[pos:idx].max()) + self.cum[idx]


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
    if ctx.cluster.engine is Engine.HOST:
        from fsdp_planner.sim.host_engine import simulate_host

        return simulate_host(ctx, plan, sched, gather, [len(g.params) for g in groups], recompute, timeline)
    group_of = {p: gi for gi, g in enumerate(groups) for p in g.params}
    overhead = ctx.cluster.overhead
    busy_host = overhead.op_seconds or overhead.hook_seconds or overhead.param_seconds or overhead.module_seconds
    calls = state_hook_calls(trace, plan) if overhead.module_seconds else []
    host = HostClock(ctx, sched.hooks, [len(g.params) for g in groups], recompute, calls) if busy_host else None
    streams = Streams(ctx, plan, gather, timeline, host)
    for idx in sorted({*issued_at, *waits, *recompute, n}):
        streams.compute_until(idx)
        for c in issued_at.get(idx, ()):
            streams.issue(c)
        if idx in recompute:  # the checkpointed forward runs again once the params it reads are gathered
            r = recompute[idx]
            streams.wait_for(sorted({group_of[p] for p in r.params if p in group_of}))
            streams.run_extra(r.seconds, f"recompute {fmt_modules(r.modules, 1)}", host.at(idx) if host else 0.0)
        if idx < n and idx in waits:
            streams.wait_for(waits[idx])
    if host is not None:  # the step is not over before the host ran the final callback's hooks
        streams.wait_for_host(host.at(n))
    step = max(streams.t, *streams.free.values())
    recomputed = sum(r.seconds for r in recompute.values())
    # exposed: compute waiting for collectives, what is left of the step after compute, copy-outs and host waits
    exposed = step - ctx.compute_total - recomputed - streams.copy_time - streams.host_wait
    return report(ctx, plan, sched, gather, step, recomputed, exposed, streams.busy, host.at(n) if host else 0.0,
                  streams.host_wait, streams.copy_time, streams.events or [])


def collective_bytes(ctx: SimContext, c: Collective, gather: list[int]) -> int:
    """Bytes as nccl-tests counts them: an all-gather's output, a reduce-scatter's input (both padded, the
    full unsharded size), an all-reduce's buffer (the reduce-scatter's output, one shard)."""
    if c.kind is AG:
        return gather[c.group]
    reduced = ctx.sizing.reduce_bytes(c.params)
    return reduced if c.kind is RS else reduced // ctx.shard


def report(ctx: SimContext, plan: Plan, sched: Schedule, gather: list[int], step: float, recompute: float,
           exposed: float, busy: dict[CollectiveKind, float], host_time: float, host_wait: float, copy_time: float,
           events: list[TimelineEvent], compute: float | None = None) -> StepReport:
    """The step's report: the engine's times, the schedule's collectives and the memory model's peak (``compute``:
    the engine's compute time, recomputation included; default the trace's ops and ``recompute``)."""
    issued = [c for c in sched.collectives if ctx.shard > 1 or c.kind is AR]  # none over one rank (Streams.issue)
    ag = [c for c in issued if c.kind is AG]
    rs = [c for c in issued if c.kind is RS]
    ar = [c for c in issued if c.kind is AR]
    memory = ctx.memory.peak(plan, sched)
    breakdown = memory.at.to_dict()
    breakdown.pop("total")
    return StepReport(
        step_time=step, compute_time=ctx.compute_total + recompute if compute is None else compute,
        exposed_comm=max(0.0, exposed),
        recompute_time=recompute, host_wait=host_wait, copy_time=copy_time,
        lower_bound=ctx.lower_bound, peak_memory=memory.allocated,
        reserved_memory=memory.reserved, memory_at_peak=breakdown,
        all_gathers=len(ag), reduce_scatters=len(rs), all_gather_bytes=sum(gather[c.group] for c in ag),
        reduce_scatter_bytes=sum(ctx.sizing.reduce_bytes(c.params) for c in rs),
        comm_time={k.value: v for k, v in busy.items() if k is not AR or ar},
        all_reduces=len(ar), all_reduce_bytes=sum(collective_bytes(ctx, c, gather) for c in ar),
        mesh=ctx.mesh.describe(), host_time=host_time, hooks=len(sched.hooks), timeline=events)
