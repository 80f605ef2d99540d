"""One training step of a plan on a cluster: time, exposed communication, per-rank memory, and its timeline when
asked. The replay (``fsdp2/replay.py``) says what FSDP2 does; the cluster's engine puts times on it: overlapping
streams on GPUs (``streams.py``), one blocking thread on CPU ranks (``host_engine.py``); the memory model gives the
peak (``memory.py``). This module chooses the engine and puts the report together."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fsdp_planner.fsdp2.checkpointing import plan_checkpointing
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Schedule, build_schedule
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.sim.context import SimContext, collective_bytes
from fsdp_planner.sim.host_engine import simulate_host
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.sizing import check_shard_dims
from fsdp_planner.sim.streams import simulate_streams
from fsdp_planner.sim.timeline import AG, AR, RS, StepTimes, TimelineEvent
from fsdp_planner.trace.records import Trace


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
    cpu_optimizer_time: float = 0.0  # of step_time: CPUOffloadPolicy's optimizer step on the host, after backward

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        if not d["cpu_optimizer_time"]:  # a step without offload reports as it always did
            d.pop("cpu_optimizer_time")
        return d


def simulate(trace: Trace, plan: Plan, cluster: Cluster | None = None, options: SimOptions | None = None,
             schedule: Schedule | None = None, context: SimContext | None = None,
             timeline: bool = True) -> StepReport:
    """Simulate one step of ``plan`` on ``cluster`` (world size = the cluster's GPU count).

    Pass a ``context`` (built once for the trace and cluster) to simulate many plans fast; ``timeline=False``
    skips the timeline, which only pictures need.
    """
    ctx = _context(trace, plan, cluster, options, context)
    check_shard_dims(plan, trace, ctx.shard)
    groups = ctx.sizing.groups(plan)
    sched = schedule or build_schedule(trace, plan, ctx.world, [g.params for g in groups])
    gather = [g.gather_bytes for g in groups]
    recompute = ctx.recompute(plan_checkpointing(plan))
    if ctx.cluster.engine is Engine.HOST:
        times = simulate_host(ctx, plan, sched, gather, [len(g.params) for g in groups], recompute, timeline)
    else:
        times = simulate_streams(ctx, plan, sched, groups, recompute, timeline)
    return report(ReportInput(ctx, plan, sched, gather, times))


def _context(trace: Trace, plan: Plan, cluster: Cluster | None, options: SimOptions | None,
             context: SimContext | None) -> SimContext:
    """The given context, checked to be for the plan's mesh, or one built for this call."""
    if context is None:
        if cluster is None:
            raise ValueError("simulate needs a cluster or a context")
        context = SimContext(trace, cluster, plan_options(plan, options or SimOptions()), mesh=plan.mesh)
    if plan.layout(context.world) != context.mesh:
        raise ValueError(f"plan's mesh {plan.layout(context.world).describe()} is not the context's "
                         f"{context.mesh.describe()}")
    return context


@dataclass(frozen=True)
class ReportInput:
    """What a step's report is made of: the plan in its context, its schedule, each group's all-gather bytes, and
    the engine's times."""

    ctx: SimContext
    plan: Plan
    sched: Schedule
    gather: list[int]
    times: StepTimes


def report(given: ReportInput) -> StepReport:
    """The step's report: the engine's times, the schedule's collectives and the memory model's peak."""
    ctx, times, gather = given.ctx, given.times, given.gather
    issued = [c for c in given.sched.collectives if ctx.shard > 1 or c.kind is AR]  # none over one rank
    ag = [c for c in issued if c.kind is AG]
    rs = [c for c in issued if c.kind is RS]
    ar = [c for c in issued if c.kind is AR]
    memory = ctx.memory.peak(given.plan, given.sched)
    breakdown = memory.at.to_dict()
    breakdown.pop("total")
    optimizer = ctx.optimizer_seconds()
    return StepReport(
        step_time=times.step + optimizer, cpu_optimizer_time=optimizer,
        compute_time=ctx.compute_total + times.recompute if times.compute is None else times.compute,
        exposed_comm=max(0.0, times.exposed),
        recompute_time=times.recompute, host_wait=times.host_wait, copy_time=times.copy_time,
        lower_bound=ctx.lower_bound, peak_memory=memory.allocated,
        reserved_memory=memory.reserved, memory_at_peak=breakdown,
        all_gathers=len(ag), reduce_scatters=len(rs), all_gather_bytes=sum(gather[c.group] for c in ag),
        reduce_scatter_bytes=sum(ctx.sizing.reduce_bytes(c.params) for c in rs),
        comm_time={k.value: v for k, v in times.busy.items() if k is not AR or ar},
        all_reduces=len(ar), all_reduce_bytes=sum(collective_bytes(ctx, c, gather) for c in ar),
        mesh=ctx.mesh.describe(), host_time=times.host_time, hooks=len(given.sched.hooks), timeline=times.events)
