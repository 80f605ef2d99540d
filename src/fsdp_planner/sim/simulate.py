"""One training step of a plan on a cluster: time, exposed communication, per-rank memory, and its timeline when
asked. The replay (``fsdp2/replay.py``) says what FSDP2 does; the cluster's engine puts times on it: overlapping
streams on GPUs (``streams.py``), one blocking thread on CPU ranks (``host_engine.py``); the memory model gives the
peak (``memory.py``). This module chooses the engine and puts the report together.

Gradient accumulation (``SimOptions.micro_batches`` = N > 1; the trace is of one micro-batch): N forward +
backward passes, ``model.set_requires_gradient_sync(False)`` on all but the last, one optimizer step. Without sync
FSDP2's post-backward reduce-scatters nothing (nor does HSDP all-reduce) and keeps each group's unsharded grads
(upcast to the reduce dtype, ``FSDPParam.to_accumulated_grad_if_needed``); the last micro-batch adds its grads in
and reduce-scatters the sums (``FSDPParamGroup.post_backward``). ``reshard_after_backward`` stays True, so each
micro-batch all-gathers as a step does. The step is the ordinary step (the last micro-batch) plus N - 1 runs of
its schedule without gradient collectives (nor TP's grad all-reduces of replicated params, which FSDP2 runs in the
post-backward that reduce-scatters: ``SimContext.accumulating``); its memory the largest of the micro-batches' peaks
(``memory.GradSync``, each read off the whole schedule: a group's post-backward is where its reduce-scatter would
be). The timeline, when recorded, is the last micro-batch's.

With ``SimOptions.gradient_sync`` EVERY (torchtitan's ``train_step``, which never disables sync) each micro-batch
is the ordinary step's schedule, reduce-scatters and all-reduces included (counts and bytes x N); no unsharded grads
are kept between micro-batches: from the second on, FSDP2's post-backward adds each reduce-scatter output into the
sharded grad made by the first (``foreach_reduce``: ``sharded_param.grad._local_tensor += new_sharded_grad``), so
the sharded grads are held all through those micro-batches (``MemoryModel.peak``'s ``sync_every``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from fsdp_planner.choices import GradientSync
from fsdp_planner.fsdp2.checkpointing import plan_checkpointing
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Kept, Schedule, build_schedule
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.sim.compute import traced_itemsize
from fsdp_planner.sim.context import SimContext, collective_bytes
from fsdp_planner.sim.expert_parallel import ep_collectives, ep_positions, ep_view
from fsdp_planner.sim.float8 import check_float8_scales, scale_all_reduces
from fsdp_planner.sim.host_engine import simulate_host
from fsdp_planner.sim.memory import GradSync, micro_batch_phases
from fsdp_planner.sim.options import SimOptions, plan_options, with_early_stop
from fsdp_planner.sim.recompute import CheckpointedCall, checkpointed_calls
from fsdp_planner.sim.sizing import check_shard_dims
from fsdp_planner.sim.streams import simulate_streams
from fsdp_planner.sim.tensor_parallel import (
    collective_runs,
    data_parallel_plan,
    tp_amax_seconds,
    tp_collectives,
    tp_positions,
    tp_view,
)
from fsdp_planner.sim.timeline import AG, AR, RS, StepTimes, Stream, TimelineEvent, Work
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
    gpu_optimizer_time: float = 0.0  # of step_time: the optimizer step on the GPU, after backward (without offload)
    # tensor parallelism's collectives on one rank (recomputed ones included) and their seconds on the compute
    # stream (of compute_time: eager DTensor waits on each; ``tensor_parallel.py``)
    tp_degree: int = 1
    tp_all_gathers: int = 0
    tp_reduce_scatters: int = 0
    tp_all_reduces: int = 0
    tp_all_gather_bytes: int = 0
    tp_reduce_scatter_bytes: int = 0
    tp_all_reduce_bytes: int = 0
    tp_time: float = 0.0
    # expert parallelism's all-to-alls on one rank (dispatch, combine, their gradients; recomputed ones included),
    # their send buffers' bytes and their seconds on the compute stream (of compute_time; ``expert_parallel.py``)
    ep_degree: int = 1
    ep_all_to_alls: int = 0
    ep_all_to_all_bytes: int = 0
    ep_time: float = 0.0
    # float8 training's amax all-reduces of the weights FSDP2 all-gathers in float8 (``float8.py``)
    float8_all_reduces: int = 0
    float8_all_reduce_bytes: int = 0

    @property
    def optimizer_time(self) -> float:
        """The optimizer step's seconds of ``step_time``, where it runs."""
        return self.cpu_optimizer_time + self.gpu_optimizer_time

    def step_seconds(self, optimizer: bool = True) -> float:
        """The step, or without its optimizer step: what a profile of forward and backward alone holds (``verify
        --profile`` records those, as torch.profiler examples do)."""
        return self.step_time if optimizer else self.step_time - self.optimizer_time

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        for name in ("cpu_optimizer_time", "gpu_optimizer_time"):  # the optimizer step where it runs
            if not d[name]:
                d.pop(name)
        if self.tp_degree == 1:  # and one without TP
            for name in _TP_FIELDS:
                d.pop(name)
        if self.ep_degree == 1:
            for name in _EP_FIELDS:
                d.pop(name)
        if not self.float8_all_reduces:
            for name in _FLOAT8_FIELDS:
                d.pop(name)
        return d


_TP_FIELDS = ("tp_degree", "tp_all_gathers", "tp_reduce_scatters", "tp_all_reduces", "tp_all_gather_bytes",
              "tp_reduce_scatter_bytes", "tp_all_reduce_bytes", "tp_time")
_EP_FIELDS = ("ep_degree", "ep_all_to_alls", "ep_all_to_all_bytes", "ep_time")
_FLOAT8_FIELDS = ("float8_all_reduces", "float8_all_reduce_bytes")


def simulate(trace: Trace, plan: Plan, cluster: Cluster | None = None, options: SimOptions | None = None,
             schedule: Schedule | None = None, context: SimContext | None = None,
             timeline: bool = True) -> StepReport:
    """Simulate one step of ``plan`` on ``cluster`` (world size = the cluster's GPU count).

    Pass a ``context`` (built once for the trace and cluster) to simulate many plans fast; ``timeline=False``
    skips the timeline, which only pictures need. A plan with tensor parallelism is simulated on one TP rank's view
    (``tensor_parallel.tp_view``): of ``trace`` and ``cluster`` as given, or, when ``trace`` is already such a view
    (what planners build once per layout), with ``cluster`` or ``context`` of that view.
    """
    trace, plan, cluster = rank_step(trace, plan, cluster, context, options)
    ctx = _context(trace, plan, cluster, options, context)
    check_shard_dims(plan, trace, ctx.shard)
    groups = ctx.sizing.groups(plan)
    sched = schedule or build_schedule(trace, plan, ctx.world, [g.params for g in groups])
    gather = [g.gather_bytes for g in groups]
    if ctx.options.micro_batches == 1:
        return report(ReportInput(ctx, plan, sched, gather, _engine(ctx, plan, sched, timeline)))
    runs = {}
    for phase in micro_batch_phases(ctx.options.micro_batches):
        ph_sched = _micro_batch_schedule(ctx, plan, sched, phase)
        synced = phase is GradSync.LAST or ctx.options.gradient_sync is GradientSync.EVERY
        ph_ctx, run = (ctx, _synced_schedule(ctx, plan, ph_sched, phase)) if synced else \
            (ctx.accumulating(), _without_grad_sync(ph_sched))
        times = _engine(ph_ctx, plan, run, timeline and phase is GradSync.LAST)
        # ``accumulated`` reads each group's post-backward off its reduce-scatter, issued or not: the whole schedule
        runs[phase] = (ph_sched, report(ReportInput(ph_ctx, plan, run, gather, times, phase is GradSync.LAST)))
    return accumulated(ctx, plan, runs)


def rank_step(trace: Trace, plan: Plan, cluster: Cluster | None, context: SimContext | None = None,
              options: SimOptions | None = None) -> tuple[Trace, Plan, Cluster | None]:
    """The trace, plan and cluster of the step one rank runs: with TP its view, with EP its experts' share; what a
    profile of one rank holds (``calibrate --trace`` matches its kernels to this trace's ops)."""
    given = options if options is not None else context.options if context is not None else None
    float8 = (given.float8 if given is not None else None) or plan.float8  # as ``plan_options`` has it
    plan = with_early_stop(plan, given) if given is not None else plan
    trace, plan, cluster = _tensor_parallel(trace, plan, cluster, context, float8)
    return _expert_parallel(trace, plan, context), plan, cluster


def _tensor_parallel(trace: Trace, plan: Plan, cluster: Cluster | None, context: SimContext | None,
                     float8: Float8 | None) -> tuple[Trace, Plan, Cluster | None]:
    """The trace, plan and cluster of one TP rank's step: the one place a plan's TP is dispatched."""
    tp = plan.tensor_parallel
    if tp is None or tp.degree == 1:  # on a TP rank's view, a plan without TP is its data-parallel part (a search
        # on the view builds such plans)
        return trace, plan.replace(tensor_parallel=None) if tp is not None else plan, cluster
    if trace.tensor_parallel:
        if trace.tensor_parallel != tp.signature():
            raise ValueError(f"the trace is a view of another tensor-parallel layout than the plan's {tp.describe()}")
        if trace.float8_tp and not (float8 is not None and float8.tp_float8_all_gather):
            raise ValueError("the trace is a view of float8 TP styles the plan does not run")
        dp_world = context.world if context is not None else cluster.world_size if cluster is not None else 0
        return trace, data_parallel_plan(plan, dp_world * tp.degree), cluster
    if cluster is None or context is not None:
        raise ValueError("a plan with tensor parallelism needs the cluster (or a context of its TP view)")
    check_float8_scales(trace, tp, float8)  # the float8 the step runs: a plan file's, or the command line's
    view = tp_view(trace, tp, cluster, float8)
    return view.trace, view.plan(plan), view.cluster


def _expert_parallel(trace: Trace, plan: Plan, context: SimContext | None) -> Trace:
    """The trace of one EP rank's step (``expert_parallel.ep_view``): ``trace`` itself when it is one already (a
    planner's, built once per EP layout), or has no EP to model."""
    ep = plan.expert_parallel
    if trace.expert_parallel:
        if ep is not None and trace.expert_parallel != ep.signature():
            raise ValueError(f"the trace is a view of another expert-parallel layout than the plan's {ep.describe()}")
        return trace
    if ep is None or ep.degree == 1:
        return trace
    if context is not None:
        raise ValueError("a plan with expert parallelism needs the cluster (or a context of its EP view)")
    return ep_view(trace, plan).trace


def _micro_batch_schedule(ctx: SimContext, plan: Plan, sched: Schedule, phase: GradSync) -> Schedule:
    """The replay of one micro-batch: ``sched`` (the step's own), or with ``set_reshard_after_backward(False)``
    (``SimOptions.reshard_after_backward`` False) the replay of groups kept unsharded across micro-batches."""
    if ctx.options.reshard_after_backward:
        return sched
    kept = {GradSync.FIRST: Kept.FIRST, GradSync.MIDDLE: Kept.MIDDLE, GradSync.LAST: Kept.LAST}[phase]
    return build_schedule(ctx.trace, plan, ctx.world, [g.params for g in ctx.sizing.groups(plan)], kept)


def _synced_schedule(ctx: SimContext, plan: Plan, sched: Schedule, phase: GradSync) -> Schedule:
    """The collectives of the micro-batch syncing what the others accumulated: where a post-backward comes early
    (``Schedule.early_post_backward``: a module called again), FSDP2 reduces the accumulated grads there and this
    micro-batch's again later (``build_schedule(accumulated=True)``); else ``sched``. The memory model reads
    ``sched``, each reduce-scatter carrying the accumulated grads with this micro-batch's: the early one's own
    terms are not modelled (a trial's reused block: peak -2.4% on 2 fake ranks)."""
    if phase is not GradSync.LAST or ctx.options.gradient_sync is not GradientSync.LAST or \
            not sched.early_post_backward:
        return sched
    kept = Kept.NONE if ctx.options.reshard_after_backward else Kept.LAST
    return build_schedule(ctx.trace, plan, ctx.world, [g.params for g in ctx.sizing.groups(plan)], kept,
                          accumulated=True)


def _without_grad_sync(sched: Schedule) -> Schedule:
    """What a micro-batch without gradient sync (all but the last, under ``GradientSync.LAST``) issues of ``sched``:
    its all-gathers, none of its reduce-scatters and all-reduces."""
    return replace(sched, collectives=[c for c in sched.collectives if c.kind is AG])


def _engine(ctx: SimContext, plan: Plan, sched: Schedule, timeline: bool) -> StepTimes:
    """The cluster's engine's times for one pass of ``sched``."""
    groups = ctx.sizing.groups(plan)
    recompute = ctx.recompute(plan_checkpointing(plan))
    if ctx.cluster.engine is Engine.HOST:
        return simulate_host(ctx, plan, sched, [g.gather_bytes for g in groups], [len(g.params) for g in groups],
                             recompute, timeline)
    return simulate_streams(ctx, plan, sched, groups, recompute, timeline)


# what a step of micro-batches sums over them (``accumulated``); the rest is the last micro-batch's or a peak
_SUMMED = ("step_time", "compute_time", "exposed_comm", "recompute_time", "host_wait", "copy_time", "host_time",
           "hooks", "all_gathers", "reduce_scatters", "all_reduces", "all_gather_bytes", "reduce_scatter_bytes",
           "all_reduce_bytes", *_TP_FIELDS[1:], *_EP_FIELDS[1:], *_FLOAT8_FIELDS)


def accumulated(ctx: SimContext, plan: Plan, runs: dict[GradSync, tuple[Schedule, StepReport]]) -> StepReport:
    """The step of ``ctx.options.micro_batches`` from one run of each distinct micro-batch (a middle one stands
    for all N - 2): their times, counts and bytes summed, the largest of their memory peaks (module docstring)."""
    n = ctx.options.micro_batches
    times = {GradSync.FIRST: 1, GradSync.MIDDLE: n - 2, GradSync.LAST: 1}
    every = ctx.options.gradient_sync is GradientSync.EVERY
    peaks = [ctx.memory.peak(plan, sched, phase, sync_every=every) for phase, (sched, _) in runs.items()]
    top = max(peaks, key=lambda p: p.allocated)
    breakdown = top.at.to_dict()
    breakdown.pop("total")
    last = runs[GradSync.LAST][1]
    others = [(times[phase], r) for phase, (_, r) in runs.items() if phase is not GradSync.LAST]
    summed = {name: getattr(last, name) + sum(k * getattr(r, name) for k, r in others) for name in _SUMMED}
    comm = {s: t + sum(k * r.comm_time.get(s, 0.0) for k, r in others) for s, t in last.comm_time.items()}
    return replace(last, **summed, comm_time=comm, peak_memory=top.allocated,
                   reserved_memory=max(p.reserved for p in peaks), memory_at_peak=breakdown,
                   # the last's bound, then the other micro-batches' compute at least
                   lower_bound=last.lower_bound + sum(k * r.compute_time for k, r in others))


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
    steps_optimizer: bool = True  # the optimizer steps after it (of micro-batches, the last only)


def report(given: ReportInput) -> StepReport:
    """The step's report: the engine's times, the schedule's collectives and the memory model's peak."""
    ctx, times, gather = given.ctx, given.times, given.gather
    group_params = ctx.sizing.group_params(given.plan)
    issued = [c for c in given.sched.collectives  # none over one rank
              if c.kind is AR or ctx.shard_of(group_params[c.group] if c.kind is AG else c.params) > 1]
    ag = [c for c in issued if c.kind is AG]
    rs = [c for c in issued if c.kind is RS]
    ar = [c for c in issued if c.kind is AR]
    memory = ctx.memory.peak(given.plan, given.sched)
    breakdown = memory.at.to_dict()
    breakdown.pop("total")
    # serial after the last reduce-scatter (it reads the grads) and before the next step's all-gathers
    optimizer = ctx.optimizer_seconds() if given.steps_optimizer else 0.0
    events = times.events
    if events and optimizer:  # a recorded timeline: the step ends with it
        where = "on the CPU" if ctx.options.offload else "on the GPU"
        events = [*events, TimelineEvent(Stream.COMPUTE, f"optimizer step {where}", times.step,
                                         times.step + optimizer, work=Work.OPTIMIZER)]
    return StepReport(
        step_time=times.step + optimizer, cpu_optimizer_time=optimizer if ctx.options.offload else 0.0,
        gpu_optimizer_time=0.0 if ctx.options.offload else optimizer,
        compute_time=ctx.compute_total + times.recompute if times.compute is None else times.compute,
        exposed_comm=max(0.0, times.exposed),
        recompute_time=times.recompute, host_wait=times.host_wait, copy_time=times.copy_time,
        lower_bound=ctx.lower_bound, peak_memory=memory.allocated,
        reserved_memory=memory.reserved, memory_at_peak=breakdown,
        all_gathers=len(ag), reduce_scatters=len(rs), all_gather_bytes=sum(gather[c.group] for c in ag),
        reduce_scatter_bytes=sum(ctx.sizing.reduce_bytes(c.params) for c in rs),
        comm_time={k.value: v for k, v in times.busy.items() if k is not AR or ar},
        all_reduces=len(ar), all_reduce_bytes=sum(collective_bytes(ctx, c, gather) for c in ar),
        mesh=ctx.mesh.describe(), host_time=times.host_time, hooks=len(given.sched.hooks), timeline=events,
        **_tp_fields(ctx, given.plan, given.steps_optimizer), **_ep_fields(ctx, given.plan),
        **_float8_fields(ctx, ag, group_params, given.steps_optimizer))


def _float8_fields(ctx: SimContext, ag: list, group_params: list[tuple[int, ...]], steps_optimizer: bool
                   ) -> dict:
    """The report's float8 amax all-reduces (``float8.scale_all_reduces``); precomputed scales' one after the
    optimizer step only (of micro-batches, the last's)."""
    if ctx.float8 is None or (ctx.float8.precompute_scale and not steps_optimizer):
        return {}
    count, nbytes = scale_all_reduces(ctx.float8, ag, group_params, ctx.precision.param_bytes)
    return {"float8_all_reduces": count, "float8_all_reduce_bytes": nbytes}


def _tp_fields(ctx: SimContext, plan: Plan, last: bool = True) -> dict:
    """The report's TP figures: its collectives (``tensor_parallel.tp_collectives``) and their seconds. ``last``:
    the step's last micro-batch, whose replicated params' grads, accumulated by FSDP2 in the reduce dtype over the
    micro-batches before (``set_requires_gradient_sync(False)``), are all-reduced in it (bf16 traced: counted in
    bf16, 5,376 bytes short a step of toy-llama's TP 2 with 2 micro-batches, a verify FAIL)."""
    trace = ctx.trace
    if not trace.tensor_parallel:
        return {}
    recomputed = checkpointed_calls(trace, plan_checkpointing(plan))
    positions = tp_positions(trace, ctx.grad_sync)
    accumulated = last and ctx.options.micro_batches > 1 and ctx.options.gradient_sync is GradientSync.LAST
    grads = ctx.precision.reduce_bytes if accumulated else ctx.precision.compute_bytes
    tp = tp_collectives(trace, recomputed, ctx.precision.compute_bytes / traced_itemsize(trace), positions,
                        grads / traced_itemsize(trace))
    at = ctx.cum_array[positions + 1] - ctx.cum_array[positions]  # each collective's seconds
    # each once, and again in a checkpointed call's recomputation unless its op-level policy keeps its output
    seconds = float((at * collective_runs(positions, recomputed)).sum())
    amaxes, amax_bytes, amax_seconds = _float8_amaxes(ctx, recomputed)
    return {"tp_degree": trace.tp_degree, "tp_all_gathers": tp.counts[AG], "tp_reduce_scatters": tp.counts[RS],
            "tp_all_reduces": tp.counts[AR] + amaxes, "tp_all_gather_bytes": tp.nbytes[AG],
            "tp_reduce_scatter_bytes": tp.nbytes[RS], "tp_all_reduce_bytes": tp.nbytes[AR] + amax_bytes,
            "tp_time": seconds + amax_seconds}


def _float8_amaxes(ctx: SimContext, recomputed: Sequence[CheckpointedCall]) -> tuple[int, float]:
    """float8's amax all-reduces over the TP group (``float8.Float8Step.tp_all_reduces``) and their seconds. A
    recomputation runs a converted Linear's forward casts again whether or not an op-level policy keeps its
    matmul's output, up to and including the Linear whose pack stops it: torchao's autograd function packs its
    inputs after its casts and matmul ran, where aten's matmul packs before it runs (measured on the fake process
    group, toy-llama TP 2: 8 all-reduces more a step under full and op-level checkpointing of its 4 blocks)."""
    f8 = ctx.float8
    if f8 is None or not f8.tp_all_reduces.any():
        return 0, 0, 0.0
    runs = np.ones(len(f8.matmuls), dtype=np.int64)  # each matmul's casts run once, and again when recomputed
    for c in recomputed:
        if not c.offload:
            lo, hi = np.searchsorted(f8.matmuls, c.fwd_pre), np.searchsorted(f8.matmuls, c.end, side="right")
            runs[lo:hi] += [not ctx.trace.events[i].backward for i in f8.matmuls[lo:hi].tolist()]
    seconds = f8.tp_amax_seconds(tp_amax_seconds(ctx.trace, ctx.cluster))
    return (int((f8.tp_all_reduces * runs).sum()), int((f8.tp_amax_nbytes * runs).sum()),
            float((seconds * runs).sum()))


def _ep_fields(ctx: SimContext, plan: Plan) -> dict:
    """The report's EP figures: its all-to-alls (``expert_parallel.ep_collectives``) and their seconds."""
    trace = ctx.trace
    if not trace.expert_parallel:
        return {}
    recomputed = [c for c in checkpointed_calls(trace, plan_checkpointing(plan)) if not c.offload]
    a2a = ep_collectives(trace, recomputed, ctx.precision.compute_bytes / traced_itemsize(trace))
    positions = ep_positions(trace).tolist()
    seconds = sum(ctx.times[p] for p in positions)
    seconds += sum(ctx.times[p] for c in recomputed for p in positions if c.fwd_pre <= p < c.end and p not in c.kept)
    return {"ep_degree": trace.ep_degree, "ep_all_to_alls": a2a.count, "ep_all_to_all_bytes": a2a.nbytes,
            "ep_time": seconds}
