"""Judging candidate plans: each simulated once, ranked by fit, then step time, then memory."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fsdp_planner.choices import SacPolicy, Target
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Mesh, Plan, ReshardAfterForward
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.fsdp2.targets import shardable_cover
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
from fsdp_planner.fsdp2.validity import inside_compiled, sharded_reads
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.planners.auto.atoms import Atom
from fsdp_planner.planners.order import compress_modules
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.compute import launches_through
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.options import SimOptions, with_early_stop
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import proper_ancestors

# the plan keeping every param on the root group (unsharded from the root's forward to the end of backward) but
# those FSDP2 needs in groups of another dtype, kept unsharded after forward (``candidates.root_plan``)
ROOT_ONLY = "root only"
REFINE_STARTS = 3  # refinement starts from this many of the best plans
ROOT_SLACK = 1e-3  # a plan whose root manages nothing is preferred within this fraction of the best step time
GROUP_SLACK = 5e-3  # then the plan with the fewest groups within this fraction (``Refiner.prefer_fewer_groups``)
MIN_GAIN = 1e-4  # refining a plan behind the best, a move must save this fraction of its step (see ``pays``)


@dataclass
class Candidate:
    plan: Plan
    report: StepReport
    origin: str  # where it came from: a classic policy, "dp(cap)", "frugal", a refinement
    runs: bool = True  # False: some op would read a param while its group is sharded (``validity.py``)
    why: str = ""  # when it does not run: the first such read, described


class Evaluator:
    """Simulates each distinct plan once on one context (one mesh) and ranks what it has seen against ``memory``
    (the per-rank budget; ``budget`` is its limit in bytes). ``checkpointed``: the modules every plan it builds
    checkpoints in full (under FSDP1, each unless a group lies inside it; ``selective``: op-level, with their
    policies, each unless a group lies inside it);
    ``checkpointing`` gives the same evaluator under another setting of the full ones, sharing what was
    simulated."""

    def __init__(self, trace: Trace, cluster: Cluster, options: SimOptions, target: Target, model: str,
                 budget: MemoryBudget, mesh: Mesh | None = None, like: SimContext | None = None,
                 checkpointed: Sequence[str] = (), selective: Mapping[str, SacPolicy] | None = None,
                 offloaded: Sequence[str] = (), tensor_parallel: TensorParallel | None = None) -> None:
        """``like``: the context of a search of the same model on another layout, whose layout-free parts are
        shared (``SimContext.on_mesh``). ``tensor_parallel``: the TP every plan carries, ``trace`` and ``cluster``
        being one TP rank's view (``sim/tensor_parallel.py``)."""
        self.trace, self.cluster, self.target, self.model = trace, cluster, target, model
        self.tensor_parallel = tensor_parallel
        self.ctx = like.on_mesh(mesh or Mesh.flat(cluster.world_size)) if like is not None else \
            SimContext(trace, cluster, options, mesh=mesh)
        self.mesh = self.ctx.mesh if self.ctx.mesh.replicate > 1 else None  # what the plans carry
        self.memory = budget
        self.budget = budget.limit  # bytes: how far over it a plan is ranks it (``key``)
        self.checkpointed = tuple(checkpointed)
        self.selective = dict(selective or {})
        self.offloaded = tuple(offloaded)  # modules every plan offloads the saved activations of (``--ac offload``)
        self.seen: list[Candidate] = []
        self.cache: dict[tuple, Candidate] = {}
        self.compressed: dict[tuple[str, ...], list[str]] = {}  # a segment's modules -> its group's (``build``)

    def checkpointing(self, modules: Sequence[str], selective: Mapping[str, SacPolicy] | None = None) -> Evaluator:
        """This evaluator with every plan checkpointing ``modules`` in full (and ``selective`` op-level; None: the
        op-level ones as they are: a module in both is checkpointed in full, ``with_checkpointing``); the plans
        simulated (``seen``, the cache) are shared, so a plan is simulated once whichever setting asked for it."""
        view = copy.copy(self)
        view.checkpointed = tuple(modules)
        if selective is not None:
            view.selective = dict(selective)
        return view

    def fits(self, c: Candidate) -> bool:
        """Whether ``c``'s reserved peak is within the budget (``MemoryBudget.fits``, the one fit test)."""
        return self.memory.fits(c.report.reserved_memory)

    @property
    def simulated(self) -> int:
        """Plans simulated so far: the unit the refinement's effort is counted in."""
        return len(self.seen)

    def evaluate(self, plan: Plan, origin: str) -> Candidate:
        plan = self.with_checkpointing(plan)
        if plan.mesh != self.mesh or plan.tensor_parallel != self.tensor_parallel:
            plan = replace(plan, mesh=self.mesh, tensor_parallel=self.tensor_parallel)
        plan = with_early_stop(plan, self.ctx.options)  # (before the schedule: its replay reads it)
        key = plan.signature()
        if key not in self.cache:  # classic policies often agree (titan and order on a plain decoder)
            group_params = self.ctx.sizing.group_params(plan)
            schedule = build_schedule(self.trace, plan, self.ctx.world, group_params)
            bad = sharded_reads(self.trace, plan, schedule, group_params)
            why = bad[0].describe(plan) if bad else ""
            inside = inside_compiled(plan, self.trace.compiled)  # (FSDP2's hooks inside a compiled block)
            if inside is not None and not why:
                why = f"group {inside[0]} lists '{inside[1]}', inside the block '{inside[2]}' compiled whole"
            c = Candidate(plan, simulate(self.trace, plan, context=self.ctx, schedule=schedule, timeline=False),
                          origin, not why, why)
            self.seen.append(c)
            self.cache[key] = c
        return self.cache[key]

    def with_checkpointing(self, plan: Plan) -> Plan:
        """``plan`` checkpointing ``self.checkpointed``, less the modules a group lies inside where that cannot
        be (``inside_selective``: op-level ones; in full, under FSDP1, whose hooks in the recomputation are not
        replayed). A module both in full and op-level is checkpointed in full: a plan lists it one way (torchtitan's
        405B job planned from its config listed 26 blocks both ways, a plan every command then refused)."""
        if self.offloaded and plan.activation_offloading != self.offloaded:
            plan = replace(plan, activation_offloading=self.offloaded)  # groups inside them do not matter
        if not (self.checkpointed or self.selective or plan.activation_checkpointing or plan.selective_checkpointing):
            return plan
        blocked = {a for g in plan.groups for m in g.modules for a in proper_ancestors(m)}
        ac = tuple(m for m in self.checkpointed if self.target is Target.FSDP2 or m not in blocked)
        sac = {m: p for m, p in self.selective.items() if m not in blocked and m not in ac}
        if ac == plan.activation_checkpointing and sac == plan.selective_checkpointing:
            return plan
        return replace(plan, activation_checkpointing=ac, selective_checkpointing=sac)

    def could_rank(self, module_groups: Sequence[Sequence[str]]) -> bool:
        """Whether a plan of these groups could be chosen, or start a refinement. FSDP2 all-gathers a group at
        least once when one of its modules runs in forward and it surely claims a param (``_surely_claims``): the
        step is at least ``step_floor`` of the number of such groups. When ``REFINE_STARTS`` plans the target can
        express and that fit are already faster than that (with the empty-root preference's slack), simulating it
        changes nothing."""
        fitting = sorted(c.report.step_time for c in self.seen
                         if self.fits(c) and c.runs and self.allowed(c.plan))
        if len(fitting) < REFINE_STARTS:
            return True
        bar = fitting[REFINE_STARTS - 1] * (1 + ROOT_SLACK)
        if self.step_floor(len(module_groups)) <= bar:  # even if every group all-gathers (the exact count costs a
            return True  # walk of the module tree)
        groups = [[c for m in ms for c in shardable_cover(self.trace, m)] for ms in module_groups]
        group_of = {m: i for i, ms in enumerate(groups) for m in ms}
        modules = self.trace.modules
        gathered = sum(1 for i, ms in enumerate(groups) if any(modules[m].calls for m in ms)
                       and any(self._surely_claims(m, i, group_of) for m in ms))
        return self.step_floor(gathered) <= bar

    def step_floor(self, gathered: int) -> float:
        """The least step of any plan in which ``gathered`` groups all-gather: their all-gathers run one after
        another on their stream, each at least its latency (the lowest-latency protocol); and the step cannot end
        before the host's work, which on GPUs launches every op of the step (whatever the plan) and runs each such
        group's pre- and post-forward hooks. (On CPU ranks the op figure is a correction to measured op times, not a
        launch: the hooks alone count there.)"""
        overhead = self.cluster.overhead
        launches = float(launches_through(self.trace)[-1]) * overhead.op_seconds \
            if self.cluster.engine is Engine.STREAMS else 0.0
        return max(gathered * self.ctx.cost(CollectiveKind.ALL_GATHER).latency,
                   launches + gathered * 2 * overhead.hook_seconds)

    def _surely_claims(self, fqn: str, group: int, group_of: dict[str, int]) -> bool:
        """Whether the group listing ``fqn`` claims a param whatever the rest of the plan: an untied param
        registered on a module below ``fqn`` (or on it) that is reached by one path only, with no module on the way
        listed by another group (FSDP2 applies those first and its DFS stops at them)."""
        modules, parents = self.trace.modules, self.trace.index.parents
        for owner in self.trace.index.owners_below[fqn]:
            if all(self.trace.param(p).is_shared for p in modules[owner].params):
                continue
            a = owner
            while a != fqn and group_of.get(a, group) == group and len(parents[a]) == 1:
                a = parents[a][0]
            if a == fqn and group_of.get(a, group) == group:
                return True
        return False

    def key(self, c: Candidate) -> tuple:
        """Ranking: over the budget last, then faster (equal up to float noise), less memory, a smaller root."""
        over = max(0, c.report.reserved_memory - self.budget)
        return (over, float(f"{c.report.step_time:.9g}"), c.report.reserved_memory, len(c.plan.root.params))

    def better(self, c: Candidate, than: Candidate) -> bool:
        return c.runs and self.allowed(c.plan) and self.key(c) < self.key(than)

    def pays(self, c: Candidate, than: Candidate) -> bool:
        """``c`` is worth moving to from ``than``: better, and either the best plan seen so far, or bringing the
        peak closer to the budget, or saving at least ``MIN_GAIN`` of the step. (Refining a plan well behind the
        best, descent over 1,000 blocks otherwise creeps one block at a time along 0.01% differences, a simulation
        per step, and cannot catch up.)"""
        if not self.better(c, than):
            return False
        if self.key(c) <= self.key(self.best()) or not self.fits(than):
            return True
        return c.report.step_time <= than.report.step_time * (1 - MIN_GAIN)

    def best(self) -> Candidate:
        valid = [c for c in self.seen if c.runs and self.allowed(c.plan)]
        if not valid and self.target is Target.FSDP1 and any(c.runs for c in self.seen):
            raise PlannerError("no plan FSDP1 can express: every candidate unit mixes dtypes or requires_grad in one "
                               "flat parameter; use target fsdp2")
        if not valid:
            held = next((c for c in self.seen if c.origin == ROOT_ONLY), None)  # params unsharded the longest
            why = f": even keeping its params on the root (and the groups FSDP2 needs for another dtype unsharded " \
                  f"after forward), {held.why}" if held else ""
            raise PlannerError(f"no candidate plan runs: every one reads a param while its group is sharded{why}")
        return min(valid, key=self.key)

    def ranked(self) -> list[Candidate]:
        return sorted((c for c in self.seen if c.runs and self.allowed(c.plan)), key=self.key)

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
        groups = [self._compressed(tuple(m for a in seg for m in a.modules)) for seg in segments]
        if reshard is None:
            reshard = [True] * len(groups)
            used = [i for i, seg in enumerate(segments) if seg[0].start < len(self.trace.events)]
            if used:
                reshard[used[-1]] = False
        return make_plan(self.trace, groups, reshard, model=self.model)

    def _compressed(self, modules: tuple[str, ...]) -> list[str]:
        """``compress_modules`` once per segment: a refinement rebuilds every group but the one or two it moves."""
        if modules not in self.compressed:
            self.compressed[modules] = compress_modules(self.trace, modules)
        return self.compressed[modules]
