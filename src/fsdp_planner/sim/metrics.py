"""Hardware-free metrics of a plan, counted from its FSDP2 schedule.

"Idle unsharded bytes" is the waste of grouping unrelated modules (size-based wrapping puts a CNN's first conv and
last linear layer in one unit): parameter bytes gathered because their group is in use, while
the parameter itself is not. A param is idle at an op when its group is unsharded, the op lies inside the
group's use window for the phase (first to last use of any of its params, forward or backward) and outside
the param's own window. Holding a group between its forward and its backward (reshard_after_forward=False)
or prefetching it early is a deliberate trade, not grouping waste, and is not counted. Summed over the
step's ops it gives byte-ops; divided by the op count, the average bytes a rank holds gathered for nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.replay import Schedule, build_schedule
from fsdp_planner.sim.sizing import Sizing
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.records import Trace


@dataclass(frozen=True)
class PlanMetrics:
    """A plan's per-step counts and bytes, without hardware: what ``plan`` shows when no cluster is given."""

    groups: int  # groups that own params (the root counted only if it owns some)
    root_numel: int
    all_gathers: int
    reduce_scatters: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    peak_unsharded_bytes: int
    idle_byte_ops: int
    avg_idle_bytes: float
    largest_group_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def use_windows(trace: Trace) -> list[tuple[tuple[int, int] | None, tuple[int, int] | None]]:
    """Per param: (first, last) forward-use event index and (first, last) backward-use event index."""
    out = []
    for uses in trace.index.param_uses:
        fwd = [i for i in uses if not trace.events[i].backward]
        bwd = [i for i in uses if trace.events[i].backward]
        out.append(((fwd[0], fwd[-1]) if fwd else None, (bwd[0], bwd[-1]) if bwd else None))
    return out


def idle_byte_ops(trace: Trace, plan: Plan, sched: Schedule, itemsize: int | None = None) -> int:
    """Sum over ops of unsharded param bytes that are idle while their group is in use (module docstring), at
    ``itemsize`` bytes per element (None: each param's own)."""
    op_idx = [i for i, e in enumerate(trace.events) if e.kind is EventKind.OP]

    def ops_in(lo: int, hi: int) -> int:  # number of op events with lo <= index < hi
        return bisect.bisect_left(op_idx, hi) - bisect.bisect_left(op_idx, lo) if hi > lo else 0

    windows = use_windows(trace)
    index = trace.index.param_index
    group_windows = []
    for g in plan.groups:
        per_phase = []
        for phase in (0, 1):
            ws = [windows[index[p]][phase] for p in g.params]
            ws = [w for w in ws if w is not None]
            per_phase.append((min(w[0] for w in ws), max(w[1] for w in ws)) if ws else None)
        group_windows.append(per_phase)
    total = 0
    for r in sched.residency:
        if r.divisor != 1:
            continue  # a post-forward shard is not an unsharded param
        for phase in (0, 1):
            gw = group_windows[r.group][phase]
            if gw is None:
                continue
            lo, hi = max(r.start, gw[0]), min(r.end, gw[1] + 1)
            if hi <= lo:
                continue
            active = ops_in(lo, hi)
            for fqn in plan.groups[r.group].params:
                i = index[fqn]
                w = windows[i][phase]
                used = ops_in(max(lo, w[0]), min(hi, w[1] + 1)) if w is not None else 0
                param = trace.params[i]
                total += (active - used) * (param.nbytes if itemsize is None else param.numel * itemsize)
    return total


def peak_unsharded(plan: Plan, sched: Schedule, sizing: Sizing) -> int:
    """Max over the step of bytes held unsharded (post-forward shards count 1/k)."""
    gathered = [g.gather_bytes for g in sizing.groups(plan)]
    deltas: dict[int, float] = {}
    for r in sched.residency:
        b = gathered[r.group] / r.divisor
        deltas[r.start] = deltas.get(r.start, 0.0) + b
        deltas[r.end] = deltas.get(r.end, 0.0) - b
    cur = peak = 0.0
    for k in sorted(deltas):
        cur += deltas[k]
        peak = max(peak, cur)
    return round(peak)


def plan_metrics(trace: Trace, plan: Plan, world_size: int | None = None,
                 precision: Precision | None = None) -> PlanMetrics:
    """Counts and bytes per step, padded for ``world_size`` ranks (None: no world known, nothing padded and
    ``reshard_after_forward`` ints kept as given), at each param's own dtype, or at ``precision``'s when the plan
    is simulated with it: then the unsharded bytes are those of the simulation's memory breakdown."""
    sched = build_schedule(trace, plan, world_size)
    sizing = Sizing(trace, world_size or 1, precision)
    ag = [c for c in sched.collectives if c.kind is CollectiveKind.ALL_GATHER]
    rs = [c for c in sched.collectives if c.kind is CollectiveKind.REDUCE_SCATTER]
    gathered = [g.gather_bytes for g in sizing.groups(plan)]
    idle = idle_byte_ops(trace, plan, sched, precision.gather_bytes if precision is not None else None)
    return PlanMetrics(
        groups=sum(1 for g in plan.groups if g.params),
        root_numel=sum(trace.param(p).numel for p in plan.root.params),
        all_gathers=len(ag),
        reduce_scatters=len(rs),
        all_gather_bytes=sum(gathered[c.group] for c in ag),
        reduce_scatter_bytes=sum(sizing.reduce_bytes(c.params) for c in rs),
        peak_unsharded_bytes=peak_unsharded(plan, sched, sizing),
        idle_byte_ops=idle,
        avg_idle_bytes=idle / max(trace.index.op_count, 1),
        largest_group_bytes=max(gathered, default=0),
    )
