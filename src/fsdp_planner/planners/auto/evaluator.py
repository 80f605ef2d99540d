"""Judging candidate plans: each simulated once, ranked by fit, then step time, then memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan, ReshardAfterForward
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.hardware.collectives import CollectiveKind
from fsdp_planner.planners.auto.atoms import Atom
from fsdp_planner.planners.order import compress_modules
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.timeline import StepReport, simulate
from fsdp_planner.trace.records import Trace

REFINE_STARTS = 3  # refinement starts from this many of the best plans
ROOT_SLACK = 1e-3  # a plan whose root manages nothing is preferred within this fraction of the best step time


class Target(Enum):
    """What the plan will be applied with."""

    FSDP2 = "fsdp2"  # fully_shard: list groups, int reshard_after_forward, explicit prefetch
    FSDP1 = "fsdp1"  # FullyShardedDataParallel: one module per unit, uniform dtype and requires_grad per unit


@dataclass
class Candidate:
    plan: Plan
    report: StepReport
    origin: str  # where it came from: a classic policy, "dp(cap)", "frugal", a refinement


class Evaluator:
    """Simulates each distinct plan once on one context and ranks what it has seen."""

    def __init__(self, trace: Trace, cluster: Cluster, options: SimOptions, target: Target, model: str) -> None:
        self.trace, self.cluster, self.target, self.model = trace, cluster, target, model
        self.ctx = SimContext(trace, cluster, options)
        self.budget = 0
        self.seen: list[Candidate] = []
        self.cache: dict[tuple, Candidate] = {}

    def evaluate(self, plan: Plan, origin: str) -> Candidate:
        key = plan.signature()
        if key not in self.cache:  # classic policies often agree (titan and order on a plain decoder)
            c = Candidate(plan, simulate(self.trace, plan, context=self.ctx, timeline=False), origin)
            self.seen.append(c)
            self.cache[key] = c
        return self.cache[key]

    def could_rank(self, module_groups: Sequence[Sequence[str]]) -> bool:
        """Whether a plan of these groups could be chosen, or start a refinement. A group listing a module that
        runs in forward and registers an untied param directly owns that param (FSDP2's DFS reaches it first), so
        it is all-gathered at least once; all-gathers run one after another on their stream, each costing at least
        its latency, so the step is at least (such groups) x alpha. When ``REFINE_STARTS`` plans the target can
        express and that fit are already faster than that (with the empty-root preference's slack), simulating it
        changes nothing."""
        fitting = sorted(c.report.step_time for c in self.seen
                         if c.report.peak_memory <= self.budget and self.allowed(c.plan))
        if len(fitting) < REFINE_STARTS:
            return True
        gathered = sum(1 for ms in module_groups if any(self._gathers(m) for m in ms))
        return gathered * self.ctx.link(CollectiveKind.ALL_GATHER)[0] <= fitting[REFINE_STARTS - 1] * (1 + ROOT_SLACK)

    def _gathers(self, fqn: str) -> bool:
        module = self.trace.modules[fqn]
        return module.calls > 0 and any(not self.trace.param(p).is_shared for p in module.params)

    def key(self, c: Candidate) -> tuple:
        """Ranking: over the budget last, then faster (equal up to float noise), less memory, a smaller root."""
        over = max(0, c.report.peak_memory - self.budget)
        return (over, float(f"{c.report.step_time:.9g}"), c.report.peak_memory, len(c.plan.root.params))

    def better(self, c: Candidate, than: Candidate) -> bool:
        return self.allowed(c.plan) and self.key(c) < self.key(than)

    def best(self) -> Candidate:
        valid = [c for c in self.seen if self.allowed(c.plan)]
        if not valid:
            raise PlannerError("no plan FSDP1 can express: every candidate unit mixes dtypes or requires_grad in one "
                               "flat parameter; use target fsdp2")
        return min(valid, key=self.key)

    def ranked(self) -> list[Candidate]:
        return sorted((c for c in self.seen if self.allowed(c.plan)), key=self.key)

    def allowed(self, plan: Plan) -> bool:
        """Plans the target can express (a classic policy may produce a list group FSDP1 cannot)."""
        if self.target is Target.FSDP2:
            return True
        return all(len(g.modules) == 1 and not g.forward_prefetch and not g.backward_prefetch
                   and isinstance(g.reshard_after_forward, bool) and self._uniform(g.params) for g in plan.groups)

    def _uniform(self, params: list[str]) -> bool:
        kinds = {(self.trace.param(p).dtype, self.trace.param(p).requires_grad) for p in params}
        return len(kinds) <= 1

    def build(self, segments: Sequence[Sequence[Atom]],
              reshard: Sequence[ReshardAfterForward] | None = None) -> Plan:
        """The plan with one group per segment of atoms; by default only the last group used in forward stays
        unsharded after forward (it is the first needed in backward)."""
        groups = [compress_modules(self.trace, [m for a in seg for m in a.modules]) for seg in segments]
        if reshard is None:
            reshard = [True] * len(groups)
            used = [i for i, seg in enumerate(segments) if seg[0].start < len(self.trace.events)]
            if used:
                reshard[used[-1]] = False
        return make_plan(self.trace, groups, reshard, model=self.model)
