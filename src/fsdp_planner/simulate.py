"""One training step under FSDP2 on a named cluster: time, exposed communication, per-rank memory, timeline.

The FSDP2 decisions (what is gathered, resharded, reduce-scattered, when) come from ``schedule.py``; this
module puts times on them with three streams, as FSDP2 runs them:
- compute: the trace's ops in order, each at ``max(flops / (peak * mfu), bytes / hbm_bandwidth)`` (or its
  measured time, see ``measure.py``); an op reading a param waits until that param's group is gathered and
  copied out;
- all-gather: collectives in issue order. Forward: the CPU runs one group ahead (FSDP2's implicit forward
  prefetch), so a group's all-gather may start once compute reached the previously gathered group. Backward and
  explicit prefetches start when compute reaches the boundary that issues them. Each pays a copy-in;
- reduce-scatter: starts when compute finished the group's backward (its post-backward boundary).
The two communication streams share the links: latencies overlap, but the bytes of one collective wait for the
other stream's bytes on the same link (NVLink for groups within a node, the network otherwise).
Collectives are costed by ``cost.alpha_beta`` on the full (padded) size.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

import numpy as np

from fsdp_planner.cluster import Cluster
from fsdp_planner.cost import alpha_beta, collective_time, group_layout
from fsdp_planner.memory import Precision, optimizer_from_name, precision_from_name
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
    scale = precision.compute_bytes / _traced_itemsize(trace)
    hbm = cluster.gpu.hbm_bandwidth
    out = []
    for e in trace.events:
        if e.kind != OP:
            out.append(0.0)
            continue
        out.append(max(e.flops / (peak * mfu) if e.flops else 0.0, e.nbytes * scale / hbm))
    return out


def _traced_itemsize(trace: Trace) -> int:
    return max((p.itemsize for p in trace.params), default=4)


class SimContext:
    """Everything about a step that does not depend on the plan, computed once so that a planner can
    simulate many plans of one model on one cluster cheaply. Op times: ``times`` if given, else the trace's
    measured ``op_seconds`` when it has them, else the roofline estimate (``op_times``)."""

    def __init__(self, trace: Trace, cluster: Cluster, options: SimOptions | None = None,
                 times: list[float] | None = None) -> None:
        self.trace = trace
        self.cluster = cluster
        self.options = options or SimOptions()
        self.precision = precision_from_name(self.options.precision)
        self.optimizer = optimizer_from_name(self.options.optimizer)
        self.world = cluster.world_size
        n = len(trace.events)
        if times is None:
            times = trace.op_seconds or op_times(trace, cluster, self.precision, self.options.mfu)
        self.times = list(times)
        if len(self.times) != n:
            raise ValueError(f"got {len(self.times)} op times for a trace of {n} events")
        self.cum = np.concatenate([[0.0], np.cumsum(self.times)]).tolist()
        self.compute_total = float(sum(self.times))
        self.param_ops = [i for i, e in enumerate(trace.events) if e.kind == OP and e.params]
        self.param_uses: list[list[int]] = [[] for _ in trace.params]  # per param: the ops reading it
        for i in self.param_ops:
            for p in trace.events[i].params:
                self.param_uses[p].append(i)
        big = n + 1
        self.first_backward_use = [big] * len(trace.params)  # per param: first backward op reading it
        for i, e in enumerate(trace.events):
            if e.kind == OP and e.backward:
                for p in e.params:
                    if self.first_backward_use[p] == big:
                        self.first_backward_use[p] = i
        self.activations = _activation_levels(trace, self.precision)
        self.lower_bound = lower_bound(trace, cluster, self.precision, self.compute_total)
        trainable = sum(p.padded_numel(self.world) for p in trace.params if p.requires_grad) // self.world
        all_numel = sum(p.padded_numel(self.world) for p in trace.params) // self.world
        prec = self.precision
        self.static_memory = {  # per rank, the same for every plan
            "params": all_numel * prec.param_bytes,
            "grads": trainable * prec.grad_bytes,
            "optimizer_state": trainable * self.optimizer.state_bytes_per_element(prec.param_bytes),
        }
        self.padded_numel = {a: p.padded_numel(self.world) for p in trace.params for a in (p.fqn, *p.aliases)}
        self._alpha_beta: dict[tuple[str, int], tuple[float, float, str]] = {}

    def link(self, kind: str, ranks: int) -> tuple[float, float, str]:
        """(alpha, seconds per byte of data, link) of a collective on ``ranks`` ranks (0: the whole world)."""
        key = (kind, ranks)
        if key not in self._alpha_beta:
            n = ranks or self.world
            alpha, bw = alpha_beta(self.cluster, kind, n)
            nodes = group_layout(self.cluster, n)[2]
            per_byte = 0.0 if n == 1 else (n - 1) / n / bw
            self._alpha_beta[key] = (0.0 if n == 1 else alpha, per_byte, "inter" if nodes > 1 else "intra")
        return self._alpha_beta[key]


def _activation_levels(trace: Trace, precision: Precision) -> np.ndarray:
    """Bytes of activations saved for backward held at each event (index len(events): the final callback):
    saved in forward, freed when the saving module call's backward is done."""
    n = len(trace.events)
    deltas = np.zeros(n + 1)
    scale = precision.compute_bytes / _traced_itemsize(trace)
    stack: list[tuple[str, int]] = []
    saved_by: dict[tuple[str, int], float] = {}
    for i, e in enumerate(trace.events):
        if e.kind == FWD_PRE:
            stack.append((e.module, e.call))
        elif e.kind == FWD_POST:
            stack.pop()
        elif e.kind == OP and e.saved and not e.backward:
            key = stack[-1] if stack else (ROOT, 0)
            deltas[i] += e.saved * scale
            saved_by[key] = saved_by.get(key, 0.0) + e.saved * scale
        elif e.kind == BWD_POST and (e.module, e.call) in saved_by:
            deltas[i] -= saved_by.pop((e.module, e.call))
    return np.cumsum(deltas)


def _param_group(trace: Trace, plan: Plan) -> list[int]:
    of = plan.group_of_param()
    return [of[p.fqn] for p in trace.params]


def simulate(trace: Trace, plan: Plan, cluster: Cluster | None = None, options: SimOptions | None = None,
             schedule: Schedule | None = None, context: SimContext | None = None,
             timeline: bool = True) -> StepReport:
    """Simulate one step of ``plan`` on ``cluster`` (world size = the cluster's GPU count).

    Pass a ``context`` (built once for the trace and cluster) to simulate many plans fast; ``timeline=False``
    skips the per-op timeline, which only pictures need.
    """
    if context is None:
        if cluster is None:
            raise ValueError("simulate needs a cluster or a context")
        context = SimContext(trace, cluster, options)
    ctx = context
    world, hbm = ctx.world, ctx.cluster.gpu.hbm_bandwidth
    precision = ctx.precision
    sched = schedule or build_schedule(trace, plan, world, precision.gather_bytes, precision.reduce_bytes)
    padded = ctx.padded_numel
    gather_bytes = [sum(padded[p] for p in g.params) * precision.gather_bytes for g in plan.groups]
    param_group = _param_group(trace, plan)
    times, cum = ctx.times, ctx.cum

    by_event: dict[int, list] = {}
    for c in sched.collectives:
        by_event.setdefault(c.event, []).append(c)
    events: list[TimelineEvent] = []
    n_events = len(trace.events)
    t = 0.0  # compute clock at the start of event ``pos``
    pos = 0
    free = {ALL_GATHER: 0.0, REDUCE_SCATTER: 0.0}  # when each stream is idle again
    link_free = {"intra": 0.0, "inter": 0.0}  # when each link has carried the bytes queued on it
    ready = [0.0] * len(plan.groups)  # when each group's latest all-gather (and copy-out) finished
    last_forward_ag_use = 0.0  # compute time at the pre-forward of the previously gathered group
    comm = {ALL_GATHER: 0.0, REDUCE_SCATTER: 0.0}
    visit = range(n_events + 1) if timeline else sorted({*ctx.param_ops, *by_event, n_events})
    for idx in visit:
        t += cum[idx] - cum[pos]  # ops in between read no params: they never wait
        pos = idx
        for c in by_event.get(idx, []):
            if c.kind == ALL_GATHER:
                nbytes = gather_bytes[c.group]
                copy_in = nbytes / world / hbm
                issue = t if (c.backward or c.prefetch) else last_forward_ag_use
            else:
                nbytes, copy_in, issue = c.nbytes, 0.0, t
            alpha, per_byte, link = ctx.link(c.kind, c.ranks)
            start = max(free[c.kind], issue) + copy_in
            data = nbytes * per_byte
            end = start + (alpha if nbytes else 0.0)
            if data > 0:
                end = max(end, link_free[link]) + data
                link_free[link] = end
            free[c.kind] = end
            comm[c.kind] += end - start + copy_in
            if c.kind == ALL_GATHER:
                ready[c.group] = end + nbytes / hbm  # copy-out into the unsharded params
                if not c.backward and not c.prefetch:
                    last_forward_ag_use = t
            if timeline:
                events.append(TimelineEvent(c.kind, _label(plan, c.group), start - copy_in, end, c.group))
        if idx == n_events:
            break
        e = trace.events[idx]
        for p in e.params:
            t = max(t, ready[param_group[p]])
        if timeline and times[idx] > 0:
            events.append(TimelineEvent("compute", e.module or "(root)", t, t + times[idx]))
        t += times[idx]
        pos = idx + 1
    step = max(t, free[ALL_GATHER], free[REDUCE_SCATTER])
    ag = [c for c in sched.collectives if c.kind == ALL_GATHER]
    rs = [c for c in sched.collectives if c.kind == REDUCE_SCATTER]
    peak, at_peak = peak_memory(ctx, plan, sched)
    return StepReport(
        step_time=step,
        compute_time=ctx.compute_total,
        exposed_comm=max(0.0, step - ctx.compute_total),
        lower_bound=ctx.lower_bound,
        peak_memory=peak,
        memory_at_peak=at_peak,
        all_gathers=len(ag),
        reduce_scatters=len(rs),
        all_gather_bytes=sum(gather_bytes[c.group] for c in ag),
        reduce_scatter_bytes=sum(c.nbytes for c in rs),
        comm_time=comm,
        timeline=events,
    )


def _label(plan: Plan, group: int) -> str:
    mods = plan.groups[group].modules
    return "(root)" if mods == [ROOT] else mods[0] + (f" +{len(mods) - 1}" if len(mods) > 1 else "")


def lower_bound(trace: Trace, cluster: Cluster, precision: Precision, compute_total: float) -> float:
    """No plan beats this: all compute; or every param gathered once and every grad reduced once, each in one
    message, their bytes sharing the links."""
    numel = sum(p.numel for p in trace.params)
    grad_numel = sum(p.numel for p in trace.params if p.requires_grad)
    ag_bytes, rs_bytes = numel * precision.gather_bytes, grad_numel * precision.reduce_bytes
    ag = collective_time(cluster, ALL_GATHER, ag_bytes)
    rs = collective_time(cluster, REDUCE_SCATTER, rs_bytes)
    n = cluster.world_size
    data = 0.0
    if n > 1:
        data = sum((n - 1) / n * b / alpha_beta(cluster, k)[1] for k, b in ((ALL_GATHER, ag_bytes),
                                                                            (REDUCE_SCATTER, rs_bytes)))
    return max(compute_total, ag, rs, data)


def peak_memory(ctx: SimContext, plan: Plan, sched: Schedule) -> tuple[int, dict[str, int]]:
    """Per-rank peak over the step and its breakdown at the peak.

    Static: sharded params, grads and optimizer state (/ world size, padded). Dynamic: gathered groups (from
    the schedule's residency), the all-gather output buffer alive beside the unsharded params while it is
    copied out (just before the group's first use after its all-gather), unsharded grads of a group from its first
    backward use until its reduce-scatter, and activations saved in forward (``SimContext.activations``).
    """
    trace, precision = ctx.trace, ctx.precision
    static = ctx.static_memory
    n = len(trace.events) + 1
    # category deltas at sparse positions: 0 unsharded params, 1 all-gather buffers, 2 unsharded grads
    deltas: dict[int, list[float]] = {}

    def add(cat: int, start: int, end: int, nbytes: float) -> None:
        deltas.setdefault(start, [0.0, 0.0, 0.0])[cat] += nbytes
        deltas.setdefault(end, [0.0, 0.0, 0.0])[cat] -= nbytes

    numel = {p.fqn: p.numel for p in trace.params}
    gbytes = [sum(numel[p] for p in g.params) * precision.gather_bytes for g in plan.groups]
    for r in sched.residency:
        add(0, r.start, r.end, gbytes[r.group] / r.divisor)
    param_group = _param_group(trace, plan)
    group_params: list[list[int]] = [[] for _ in plan.groups]
    for p, g in enumerate(param_group):
        group_params[g].append(p)
    first_bwd = [min((ctx.first_backward_use[p] for p in ps), default=n) for ps in group_params]
    group_uses: dict[int, list[int]] = {}
    for c in sched.collectives:
        if c.kind == ALL_GATHER:
            # FSDP2 copies the all-gather output out (then frees it) just before the group's first use after
            # the all-gather was issued: both copies are alive at that moment, before the op runs
            if c.group not in group_uses:  # every op reading the group's params, in order
                group_uses[c.group] = sorted({i for p in group_params[c.group] for i in ctx.param_uses[p]})
            uses = group_uses[c.group]
            k = bisect.bisect_left(uses, c.event)
            use = uses[k] if k < len(uses) else n - 1
            add(1, max(c.event, use - 1), use, gbytes[c.group])
        else:
            nbytes = sum(trace.params[p].numel for p in c.params) * precision.compute_bytes
            add(2, min(first_bwd[c.group], c.event), c.event + 1, nbytes)
    starts = sorted(p for p in deltas if p < n)
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    acts = ctx.activations
    seg_max = np.maximum.reduceat(acts, starts)
    level = [0.0, 0.0, 0.0]
    static_total = sum(static.values())
    best, best_at = -1.0, {}
    for k, s in enumerate(starts):
        for cat, d in enumerate(deltas.get(s, (0.0, 0.0, 0.0))):
            level[cat] += d
        total = static_total + sum(level) + seg_max[k]
        if total > best:
            best = total
            best_at = {**static, "unsharded_params": round(level[0]), "all_gather_buffers": round(level[1]),
                       "unsharded_grads": round(level[2]), "activations": round(float(seg_max[k]))}
    return round(best), best_at

