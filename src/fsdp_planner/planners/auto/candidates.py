"""Where candidate plans come from: the classic policies, module-tree cuts (what FSDP1 can express), the most
frugal plan, and a dynamic program over group boundaries driven by a per-group surrogate of the step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cached_property

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.planners.auto.atoms import Atom, Pin, coarsen
from fsdp_planner.planners.auto.evaluator import ROOT_ONLY, Candidate, Evaluator
from fsdp_planner.planners.classic import ModuleWrapPolicy, SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.planners.order import ExecutionOrderPolicy
from fsdp_planner.planners.repair import joined_until_runnable
from fsdp_planner.sim.compute import traced_itemsize
from fsdp_planner.sim.context import SimContext
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT

DP_ATOM_LIMIT = 512  # atoms the DP works on at most (finer models are coarsened first)


def classic_plans(trace: Trace, model: str) -> dict[str, Plan]:
    """The four classic policies' plans with their defaults (they do not depend on the layout: built once per
    search and evaluated on every mesh); a policy the model cannot use (no repeated block) is left out. Built
    unchecked: the evaluator finds those that cannot run (``classic_baselines`` leaves them out), with the schedule
    it simulates anyway."""
    out = {}
    for policy in (ModuleWrapPolicy(), SizeBasedPolicy(), TorchtitanPolicy(), ExecutionOrderPolicy()):
        try:
            out[policy.name] = policy.build(trace, model)
        except PlannerError:
            continue
    if "order" in out:  # the order policy joins a group it cannot run to the next, as its plan() does
        with contextlib.suppress(PlannerError):
            out["order"] = joined_until_runnable(trace, out["order"])
    return out


def root_plan(trace: Trace, model: str) -> Plan:
    """Every param on the root group but those FSDP2 needs in groups of another dtype (``split_by_dtype``), which
    stay unsharded after forward like the root: the plan holding params unsharded the longest, so the one a model
    reading params outside their modules' forward is likeliest to run with."""
    plan = make_plan(trace, [], policy=ROOT_ONLY, model=model)
    return replace(plan, groups=[*(replace(g, reshard_after_forward=False) for g in plan.inner_groups), plan.root])


def classic_baselines(ev: Evaluator, plans: dict[str, Plan]) -> dict[str, Candidate]:
    """The classic plans simulated on ``ev``'s mesh, but those FSDP2 could not run (``validity.py``): no baseline,
    as in the CLI's comparison (the evaluator keeps them, never ranked)."""
    tried = {name: ev.evaluate(plan, plan.policy or name) for name, plan in plans.items()}
    return {name: c for name, c in tried.items() if c.runs}


class ModuleTreeCuts:
    """FSDP1 units are single modules: size-based wrapping at ``count`` thresholds from per-leaf to none, and every
    param-owning module wrapped alone. They are FSDP2 plans too: the root then plays a never-resharded group, which
    pays when backward all-gathers are latency-bound. The cuts do not depend on the layout: listed once per search,
    each plan built the first time a layout could rank it."""

    def __init__(self, trace: Trace, model: str, count: int) -> None:
        self.trace, self.model = trace, model
        numels = sorted({p.numel for p in trace.params})
        self.cuts: dict[tuple[str, ...], str] = {}  # wrapped modules -> origin; thresholds often wrap the same
        for t in sorted({int(x) for x in np.geomspace(max(numels[0], 1), max(trace.numel, 2), count)}, reverse=True):
            self.cuts.setdefault(tuple(SizeBasedPolicy(t).wrapped_modules(trace)), f"size({t})")
        leaves = tuple(m for m in trace.index.owning_modules
                       if m != ROOT and not any(trace.param(p).is_shared for p in trace.modules[m].params))
        self.cuts.setdefault(leaves, "per-module")
        self.plans: dict[tuple[str, ...], Plan] = {}

    def evaluate(self, ev: Evaluator) -> None:
        """Simulate on ``ev`` the cuts that could rank there (large thresholds first: cheap plans)."""
        for wrapped, origin in self.cuts.items():
            if ev.could_rank([[m] for m in wrapped]):
                ev.evaluate(self.plan(wrapped), origin)

    def plan(self, wrapped: tuple[str, ...]) -> Plan:
        if wrapped not in self.plans:
            origin = self.cuts[wrapped]
            self.plans[wrapped] = make_plan(self.trace, [[m] for m in wrapped], model=self.model,
                                            policy="" if origin == "per-module" else origin)
        return self.plans[wrapped]


def segments(atoms: Sequence[Atom], free_segments: Sequence[Sequence[Atom]]) -> list[list[Atom]]:
    """Free segments plus each atom pinned ALONE as its own segment, in execution order (ROOT-pinned atoms stay
    with the root)."""
    segs = [list(s) for s in free_segments] + [[a] for a in atoms if a.pin is Pin.ALONE]
    return sorted(segs, key=lambda s: s[0].start)


def frugal_segments(atoms: Sequence[Atom]) -> list[list[Atom]]:
    """The most frugal grouping of ``atoms``: every free atom alone."""
    return segments(atoms, [[a] for a in atoms if a.pin is Pin.FREE])


def frugal_plan(ev: Evaluator, atoms: Sequence[Atom]) -> Plan | None:
    """The most frugal plan of ``atoms``: every free atom alone, every group resharded after forward (the least any
    grouping of them holds unsharded); None when there is no atom to group."""
    segs = frugal_segments(atoms)
    return ev.build(segs, [True] * len(segs)) if segs else None


def frugal_and_dp(ev: Evaluator, atoms: list[Atom]) -> Callable[[], None] | None:
    """The most frugal plan (every free atom alone) and the DP's plans for group-size caps from one atom to the
    whole model, simulated in the surrogate's order until a few of them fit the budget. The frugal plan is the
    memory floor; when it could not rank it is returned unsimulated, as a function that simulates it."""
    segs = frugal_segments(atoms)
    deferred = None
    if segs:
        def frugal() -> None:
            ev.evaluate(frugal_plan(ev, atoms), "frugal")

        if ev.could_rank([[m for a in seg for m in a.modules] for seg in segs]):
            frugal()
        else:
            deferred = frugal
    free = coarsen([a for a in atoms if a.pin is Pin.FREE], DP_ATOM_LIMIT)
    if not free:
        return deferred
    for kept in (False, True):
        _dp(ev, atoms, free, kept)
    return deferred


def _dp(ev: Evaluator, atoms: list[Atom], free: list[Atom], kept: bool) -> None:
    """The DP's plans for each cap, simulated in the surrogate's order until a few fit; ``kept``: every group
    unsharded after forward (no all-gather in backward, where the memory allows: smaller groups then pay, as the
    first all-gather of forward is the only one exposed), each judged by the surrogate of that."""
    surrogate = Surrogate(ev.ctx, ev.trace, free, kept)
    if kept and surrogate.P[-1] >= ev.budget:  # the unsharded params alone exceed the budget
        return
    found: dict[tuple[int, ...], tuple[float, float]] = {}
    for cap in caps(np.array([a.nbytes for a in free], dtype=float)):
        cuts, cost = surrogate.best_cuts(cap)
        found.setdefault(tuple(cuts), (0.0 if kept else cost, cap))
    fitting = 0
    for rank, (cuts, (_, cap)) in enumerate(sorted(found.items(), key=lambda kv: kv[1])):
        if not kept and rank >= 4 and fitting >= 3:
            break
        segs = segments(atoms, [free[i:j] for i, j in zip((0, *cuts), (*cuts, len(free)), strict=True)])
        plan = ev.build(segs, [False] * len(segs) if kept else None)
        fits = ev.fits(ev.evaluate(plan, f"dp({fmt_bytes(cap)}{', kept' if kept else ''})"))
        if kept and not fits:
            break  # every param is held unsharded from forward to backward, and larger caps add larger buffers
        fitting += fits


def caps(sizes: np.ndarray) -> list[float]:
    """Group-size caps to run the DP with: the largest atom, doubling up to everything in one group."""
    cap, total = float(sizes.max()), float(sizes.sum())
    out = []
    while cap < total:
        out.append(cap)
        cap *= 2
    out.append(total)
    return out


class Surrogate:
    """Per-group step time for the DP, vectorised over group starts:
    ``max(forward compute, all-gather) + max(backward compute, all-gather + reduce-scatter)`` (the two collectives
    share the links in backward; each at the protocol NCCL picks for its size, with its copy-in), backward compute
    in forward's proportions, plus the copy-outs on the compute stream and FSDP2's host work per group."""

    def __init__(self, ctx: SimContext, trace: Trace, free: list[Atom], kept: bool = False) -> None:
        prec = ctx.precision
        itemsize = traced_itemsize(trace)
        trainable = [sum(trace.params[p].nbytes for p in a.params if trace.params[p].requires_grad) for a in free]
        gather = np.array([a.nbytes for a in free], dtype=float) * prec.gather_bytes / itemsize
        reduce = np.array(trainable, dtype=float) * prec.reduce_bytes / itemsize
        fwd_end = trace.index.forward_end
        starts = [a.start for a in free] + [fwd_end]
        cum = ctx.cum
        fwd = np.array([cum[starts[i + 1]] - cum[starts[i]] for i in range(len(free))])
        bwd = fwd * (cum[-1] - cum[fwd_end]) / max(cum[fwd_end], 1e-30)
        self.ctx, self.kept = ctx, kept
        overhead = ctx.cluster.overhead
        self.copy = 1 / overhead.copy_bandwidth
        # FSDP2's host work per group and step (four hooks), added whole: it only hides behind compute that the
        # host is not itself launching op by op
        self.per_group = 4 * overhead.hook_seconds
        self.P = np.concatenate([[0.0], np.cumsum(gather)])
        self.R = np.concatenate([[0.0], np.cumsum(reduce)])
        self.F = np.concatenate([[0.0], np.cumsum(fwd)])
        self.B = np.concatenate([[0.0], np.cumsum(bwd)])
        self.raw = np.concatenate([[0.0], np.cumsum([a.nbytes for a in free])])

    def best_cuts(self, cap: float) -> tuple[list[int], float]:
        """Group ends (exclusive atom indices, the last omitted) minimising the surrogate with groups <= ``cap``
        bytes, and the surrogate's step time for them."""
        n = len(self.P) - 1
        cost = self.cost
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        back = np.zeros(n + 1, dtype=int)
        lo = 0
        for j in range(1, n + 1):
            while self.raw[j] - self.raw[lo] > cap and lo < j - 1:
                lo += 1
            total = best[lo:j] + cost[lo:j, j]
            k = int(np.argmin(total))
            best[j], back[j] = total[k], lo + k
        cuts = []
        j = n
        while j > 0:
            j = back[j]
            if j > 0:
                cuts.append(j)
        return sorted(cuts), float(best[n])

    @cached_property
    def cost(self) -> np.ndarray:
        """cost[i, j]: the surrogate for one group of atoms i..j-1 (upper triangle; the same for every cap)."""
        i, j = np.triu_indices(len(self.P), k=1)
        gather, reduce = self.P[j] - self.P[i], self.R[j] - self.R[i]
        ctx, shard = self.ctx, self.ctx.shard
        ag = ctx.comm_time(CollectiveKind.ALL_GATHER, gather) + ctx.copy_in_seconds(CollectiveKind.ALL_GATHER, gather)
        rs = ctx.comm_time(CollectiveKind.REDUCE_SCATTER, reduce) \
            + ctx.copy_in_seconds(CollectiveKind.REDUCE_SCATTER, reduce)
        if ctx.mesh.replicate > 1:  # HSDP: each reduce-scatter's output (1/shard of it) is all-reduced after it
            rs = rs + ctx.comm_time(CollectiveKind.ALL_REDUCE, reduce / shard)
        copy_out = gather * self.copy  # on the compute stream, in forward and again in backward (kept: once)
        if self.kept:
            c = np.maximum(self.F[j] - self.F[i], ag) + np.maximum(self.B[j] - self.B[i], rs) + copy_out
        else:
            c = np.maximum(self.F[j] - self.F[i], ag) + np.maximum(self.B[j] - self.B[i], ag + rs) + 2 * copy_out
        c = c + self.per_group
        penalty = 1e-9 / max(self.raw[-1], 1.0) ** 2  # among equal times prefer smaller groups (memory)
        c = c + np.where(i == 0, ag, 0.0) + penalty * (self.raw[j] - self.raw[i]) ** 2
        out = np.full((len(self.P), len(self.P)), np.inf)
        out[i, j] = c
        return out
