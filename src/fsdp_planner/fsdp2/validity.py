"""Whether a plan runs: every op must find the params it reads unsharded.

FSDP2 unshards a group only in the hooks of the modules the group lists (and its prefetches); a param read while
its group is sharded is a DTensor shard in a plain op, and the step fails ("aten.mm.default got mixed
torch.Tensor and DTensor"), or, with some orders, silently reads a stale unsharded copy. This happens when a
parent calls a grandchild directly (``self.layer.proc(x)``, the FSDP2 docs' toy model), a non-forward method of a
sharded module runs (``generate()``, a head's ``loss()``), or a param is reused after its group resharded. The
replay (``replay.py``) knows when each group is unsharded (``Residency`` with divisor 1); here every op's params
are checked against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Schedule, build_schedule
from fsdp_planner.trace.records import Trace


@dataclass(frozen=True)
class ShardedRead:
    """Op ``event`` (in ``module``) reads ``param`` while its group ``group`` is sharded."""

    event: int
    param: str
    group: int
    module: str
    backward: bool

    def describe(self, plan: Plan) -> str:
        g = plan.groups[self.group]
        phase = "backward" if self.backward else "forward"
        listed = ", ".join(f"'{m}'" for m in g.modules[:3]) + (" ..." if len(g.modules) > 3 else "")
        return (f"an op of '{self.module or '(root)'}' in {phase} (trace event {self.event}) reads param "
                f"'{self.param}' while its group {self.group} ({listed}) is sharded: FSDP2 unshards a group only "
                f"in the forward/backward hooks of the modules it lists, and this call runs outside them (a parent "
                f"calling a submodule of a sharded child directly, a non-forward method, or a param reused after "
                f"its group resharded); group the caller with those params, or register the method with "
                f"register_fsdp_forward_method")


def sharded_reads(trace: Trace, plan: Plan, schedule: Schedule,
                  group_params: Sequence[Sequence[int]], limit: int = 1) -> list[ShardedRead]:
    """The first ``limit`` ops (in trace order per group) that read a param of a group that is not unsharded at
    that moment under ``schedule``; empty when the plan runs."""
    intervals: dict[int, list[tuple[int, int]]] = {}
    for r in schedule.residency:
        if r.divisor == 1 and r.end > r.start:
            intervals.setdefault(r.group, []).append((r.start, r.end))
    uses, events = trace.index.param_uses, trace.events
    found: list[ShardedRead] = []
    for gi, params in enumerate(group_params):
        spans = sorted(intervals.get(gi, ()))
        starts = np.array([s for s, _ in spans], dtype=np.int64)
        ends = np.array([e for _, e in spans], dtype=np.int64)
        for p in params:
            at = np.asarray(uses[p], dtype=np.int64)
            if not len(at):
                continue
            k = np.searchsorted(starts, at, side="right") - 1
            inside = (k >= 0) & (at < ends[np.maximum(k, 0)]) if len(starts) else np.zeros(len(at), dtype=bool)
            for i in at[~inside][:limit]:
                e = events[int(i)]
                found.append(ShardedRead(int(i), trace.params[p].fqn, gi, e.module, e.backward))
        if len(found) >= limit:
            break
    return sorted(found, key=lambda r: r.event)[:limit]


def check_plan_runs(trace: Trace, plan: Plan, world_size: int | None = None) -> None:
    """Refuse, with the first op that would fail and why, a plan that reads a sharded param."""
    index = trace.index.param_index
    group_params = [[index[p] for p in g.params] for g in plan.groups]
    bad = sharded_reads(trace, plan, build_schedule(trace, plan, world_size, group_params), group_params)
    if bad:
        raise PlannerError(f"this plan cannot run: {bad[0].describe(plan)}")
