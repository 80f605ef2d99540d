"""One training step under FSDP2 on a named cluster: time, exposed communication, per-rank memory, timeline.

The FSDP2 decisions (what is gathered, resharded, reduce-scattered, when) come from ``schedule.py``; this
module puts times on them with three streams, as FSDP2 runs them:
- compute: the trace's ops in order, each at ``max(flops / (peak * mfu), bytes / hbm_bandwidth)``, plus the
  all-gather copy-out; an op reading a param waits until that param's group is gathered;
- all-gather: collectives in issue order. Forward: the CPU runs one group ahead (FSDP2's implicit forward
  prefetch), so a group's all-gather may start once compute reached the previously gathered group. Backward and
  explicit prefetches start when compute reaches the boundary that issues them. Each pays a copy-in;
- reduce-scatter: starts when compute finished the group's backward (its post-backward boundary).
Collectives are costed by ``cost.collective_time`` on the full (padded) size. The two comm streams do not
slow each other down (a limit: in NCCL they share the links).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fsdp_planner.cluster import Cluster
from fsdp_planner.cost import collective_time
from fsdp_planner.memory import Optimizer, Precision, optimizer_from_name, precision_from_name
from fsdp_planner.plan import Plan
from fsdp_planner.schedule import ALL_GATHER, REDUCE_SCATTER, Schedule, build_schedule
from fsdp_planner.trace import BWD_POST, FWD_POST, FWD_PRE, OP, ROOT, Trace


@dataclass(frozen=True)
class SimOptions:
    mfu: float = 0.5  # fraction of peak FLOP/s that matmul-like ops reach
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"


@dataclass(frozen=True)
class TimelineEvent:
    stream: str  # "compute" | "all_gather" | "reduce_scatter"
    name: str
    start: float
    end: float
    group: int = -1


@dataclass
class StepReport:
    step_time: float
    compute_time: float
    exposed_comm: float
    lower_bound: float
    peak_memory: int
    memory_at_peak: dict[str, int]
    all_gathers: int
    reduce_scatters: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    comm_time: dict[str, float]
    timeline: list[TimelineEvent] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("timeline")
        return d


def op_times(trace: Trace, cluster: Cluster, precision: Precision, mfu: float) -> list[float]:
    """Seconds per event (0 for boundaries): matmul-like ops at ``mfu`` of peak, the rest at HBM bandwidth.

    Bytes are scaled from the traced dtype to the compute dtype (a model traced in fp32 but run in bf16 moves half).
    """
    peak = cluster.gpu.peak_bf16_flops if precision.compute_bytes <= 2 else cluster.gpu.peak_fp32_flops
    traced_itemsize = max((p.itemsize for p in trace.params), default=4)
    scale = precision.compute_bytes / traced_itemsize
    hbm = cluster.gpu.hbm_bandwidth
    out = []
    for e in trace.events:
        if e.kind != OP:
            out.append(0.0)
            continue
        out.append(max(e.flops / (peak * mfu) if e.flops else 0.0, e.nbytes * scale / hbm))
    return out


def _param_group(trace: Trace, plan: Plan) -> list[int]:
    of = plan.group_of_param()
    return [of[p.fqn] for p in trace.params]


def simulate(trace: Trace, plan: Plan, cluster: Cluster, options: SimOptions | None = None,
             schedule: Schedule | None = None) -> StepReport:
    """Simulate one step of ``plan`` on ``cluster`` (world size = the cluster's GPU count)."""
    opts = options or SimOptions()
    precision = precision_from_name(opts.precision)
    optimizer = optimizer_from_name(opts.optimizer)
    world = cluster.world_size
    sched = schedule or build_schedule(trace, plan, world, precision.gather_bytes, precision.reduce_bytes)
    times = op_times(trace, cluster, precision, opts.mfu)
    gather_bytes = [sum(trace.param(p).padded_numel(world) for p in g.params) * precision.gather_bytes
                    for g in plan.groups]
    param_group = _param_group(trace, plan)
    hbm = cluster.gpu.hbm_bandwidth

    by_event: dict[int, list] = {}
    for c in sched.collectives:
        by_event.setdefault(c.event, []).append(c)
    timeline: list[TimelineEvent] = []
    t = 0.0  # compute clock
    ag_free = rs_free = 0.0
    ready = [0.0] * len(plan.groups)  # when each group's latest all-gather (and copy-out) finished
    reached: dict[int, float] = {}  # compute time at each boundary event
    last_forward_ag_use = 0.0  # compute time at the pre-forward of the previously gathered group
    comm = {ALL_GATHER: 0.0, REDUCE_SCATTER: 0.0}
    n_events = len(trace.events)
    for idx in range(n_events + 1):
        e = trace.events[idx] if idx < n_events else None
        reached[idx] = t
        for c in by_event.get(idx, []):
            if c.kind == ALL_GATHER:
                nbytes = gather_bytes[c.group]
                dur = collective_time(cluster, ALL_GATHER, nbytes, ranks=c.ranks or None)
                copy_in = nbytes / world / hbm
                issue = t if (c.backward or c.prefetch) else last_forward_ag_use
                start = max(ag_free, issue)
                end = start + copy_in + dur
                ag_free = end
                ready[c.group] = end + nbytes / hbm  # copy-out into the unsharded params
                comm[ALL_GATHER] += copy_in + dur
                timeline.append(TimelineEvent(ALL_GATHER, _label(plan, c.group), start, end, c.group))
                if not c.backward and not c.prefetch:
                    last_forward_ag_use = t
            else:
                dur = collective_time(cluster, REDUCE_SCATTER, c.nbytes, ranks=None)
                start = max(rs_free, t)
                rs_free = start + dur
                comm[REDUCE_SCATTER] += dur
                timeline.append(TimelineEvent(REDUCE_SCATTER, _label(plan, c.group), start, rs_free, c.group))
        if e is None or e.kind != OP:
            continue
        for p in e.params:
            t = max(t, ready[param_group[p]])
        if times[idx] > 0:
            timeline.append(TimelineEvent("compute", e.module or "(root)", t, t + times[idx]))
        t += times[idx]
    compute_total = sum(times)
    step = max(t, ag_free, rs_free)
    ag = [c for c in sched.collectives if c.kind == ALL_GATHER]
    rs = [c for c in sched.collectives if c.kind == REDUCE_SCATTER]
    peak, at_peak = peak_memory(trace, plan, sched, world, precision, optimizer)
    return StepReport(
        step_time=step,
        compute_time=compute_total,
        exposed_comm=max(0.0, step - compute_total),
        lower_bound=lower_bound(trace, cluster, precision, compute_total),
        peak_memory=peak,
        memory_at_peak=at_peak,
        all_gathers=len(ag),
        reduce_scatters=len(rs),
        all_gather_bytes=sum(gather_bytes[c.group] for c in ag),
        reduce_scatter_bytes=sum(c.nbytes for c in rs),
        comm_time=comm,
        timeline=timeline,
    )


def _label(plan: Plan, group: int) -> str:
    mods = plan.groups[group].modules
    return "(root)" if mods == [ROOT] else mods[0] + (f" +{len(mods) - 1}" if len(mods) > 1 else "")


def lower_bound(trace: Trace, cluster: Cluster, precision: Precision, compute_total: float) -> float:
    """No plan beats this: all compute, or every param gathered once / every grad reduced once in one message."""
    numel = sum(p.numel for p in trace.params)
    grad_numel = sum(p.numel for p in trace.params if p.requires_grad)
    ag = collective_time(cluster, ALL_GATHER, numel * precision.gather_bytes)
    rs = collective_time(cluster, REDUCE_SCATTER, grad_numel * precision.reduce_bytes)
    return max(compute_total, ag, rs)


def peak_memory(trace: Trace, plan: Plan, sched: Schedule, world: int, precision: Precision,
                optimizer: Optimizer) -> tuple[int, dict[str, int]]:
    """Per-rank peak over the step and its breakdown at the peak.

    Static: sharded params, grads and optimizer state (/ world size, padded). Dynamic: gathered groups (from
    the schedule's residency), unsharded grads of a group from its first backward use until its reduce-scatter,
    and activations saved in forward, freed when the saving module call's backward is done.
    """
    trainable = sum(p.padded_numel(world) for p in trace.params if p.requires_grad) // world
    all_numel = sum(p.padded_numel(world) for p in trace.params) // world
    static = {
        "params": all_numel * precision.param_bytes,
        "grads": trainable * precision.grad_bytes,
        "optimizer_state": trainable * optimizer.state_bytes_per_element(precision.param_bytes),
    }
    n = len(trace.events) + 1
    gathered = [0.0] * (n + 1)
    gbytes = [sum(trace.param(p).numel for p in g.params) * precision.gather_bytes for g in plan.groups]
    for r in sched.residency:
        gathered[r.start] += gbytes[r.group] / r.divisor
        gathered[r.end] -= gbytes[r.group] / r.divisor
    grads = [0.0] * (n + 1)
    first_bwd: dict[int, int] = {}
    param_group = _param_group(trace, plan)
    for i, e in enumerate(trace.events):
        if e.kind == OP and e.backward:
            for p in e.params:
                first_bwd.setdefault(param_group[p], i)
    for c in sched.collectives:
        if c.kind == REDUCE_SCATTER:
            start = first_bwd.get(c.group, c.event)
            nbytes = sum(trace.params[p].numel for p in c.params) * precision.compute_bytes
            grads[min(start, c.event)] += nbytes
            grads[c.event + 1] -= nbytes
    acts = [0.0] * (n + 1)
    traced_itemsize = max((p.itemsize for p in trace.params), default=4)
    scale = precision.compute_bytes / traced_itemsize
    stack: list[tuple[str, int]] = []
    saved_by: dict[tuple[str, int], float] = {}
    for i, e in enumerate(trace.events):
        if e.kind == FWD_PRE:
            stack.append((e.module, e.call))
        elif e.kind == FWD_POST:
            stack.pop()
        elif e.kind == OP and e.saved and not e.backward:
            key = stack[-1] if stack else (ROOT, 0)
            acts[i] += e.saved * scale
            saved_by[key] = saved_by.get(key, 0.0) + e.saved * scale
        elif e.kind == BWD_POST and (e.module, e.call) in saved_by:
            acts[i] -= saved_by.pop((e.module, e.call))
    best, best_at = -1.0, {}
    cur_g = cur_gr = cur_a = 0.0
    static_total = sum(static.values())
    for i in range(n):
        cur_g += gathered[i]
        cur_gr += grads[i]
        cur_a += acts[i]
        total = static_total + cur_g + cur_gr + cur_a
        if total > best:
            best = total
            best_at = {**static, "unsharded_params": round(cur_g), "unsharded_grads": round(cur_gr),
                       "activations": round(cur_a)}
    return round(best), best_at
