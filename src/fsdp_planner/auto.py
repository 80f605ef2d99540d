"""AutoPolicy: the grouping that minimises simulated step time under a per-rank memory budget.

Search, in three steps:
1. **Atoms.** The params split into indivisible units in execution order (``atoms_in_execution_order``): one
   per param-owning module, tied owners merged, repeated blocks whole unless a finer split is needed. Atoms
   FSDP2 cannot group freely are pinned: an atom whose params are read outside its modules' forward goes to
   the root (only the root is unsharded around such a read); an atom with a module called more than once, or
   whose uses enclose other atoms' (a tied embedding and head), is a group of its own (pytorch#183702: a list
   group whose module is reused later can fail in backward).
2. **Dynamic programming** over segment boundaries of the free atoms, with a per-segment surrogate of the step:
   ``max(forward compute, all-gather) + max(backward compute, all-gather + reduce-scatter)`` (the two
   collectives share the links in backward), for a range of caps on the group size. Every resulting plan, the
   classic policies' plans and the most memory-frugal plan are judged by the simulator (``simulate.py``).
3. **Local refinement** of the best plan that fits, judged by the simulator: keep the groups that finish
   forward last unsharded (``reshard_after_forward`` False, or an intra-node int), prefetch two groups ahead,
   and move single boundaries by one atom, while it pays and fits.

Without a budget, auto keeps to the peak memory of the fastest classic policy: it is then never slower and
never uses more memory than any of them. ``target="fsdp1"`` searches only what FSDP1 can express: one module
per unit, uniform dtype and requires_grad per unit, bool ``reshard_after_forward``, no prefetch lists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from fsdp_planner.cluster import Cluster
from fsdp_planner.errors import PlannerError
from fsdp_planner.memory import precision_from_name
from fsdp_planner.plan import Plan, is_descendant, make_plan, module_children
from fsdp_planner.policies import (
    POLICY_NAMES,
    SizeBasedPolicy,
    _fmt_bytes,
    atoms_in_execution_order,
    compress_modules,
    default_block_class,
    make_policy,
)
from fsdp_planner.simulate import SimContext, SimOptions, StepReport, op_times, simulate
from fsdp_planner.trace import OP, Trace, compact

TARGETS = ("fsdp2", "fsdp1")


@dataclass
class Atom:
    modules: list[str]
    nbytes: int  # unsharded bytes at the traced dtype
    start: int  # first forward op reading its params (len(events) when never used)
    pinned: str = ""  # "" free | "alone": a group of its own | "root": left to the root


@dataclass
class Candidate:
    plan: Plan
    report: StepReport
    origin: str  # where it came from: a classic policy, "dp(cap)", "frugal", a refinement


@dataclass
class AutoResult:
    plan: Plan
    report: StepReport
    budget: int
    budget_source: str  # "--memory-budget" or the classic policy whose peak it is
    fits: bool
    min_peak: int  # the lowest peak memory any evaluated plan reached
    baselines: dict[str, Candidate]
    evaluated: int
    seconds: float
    search: _Search | None = field(default=None, repr=False)


@dataclass
class AutoPolicy:
    """Choose groups, ``reshard_after_forward`` and prefetch for ``cluster`` under ``memory_budget`` bytes."""

    cluster: Cluster
    memory_budget: int | None = None
    target: str = "fsdp2"
    options: SimOptions = field(default_factory=SimOptions)
    refine_seconds: float = 2.0  # time allowed for boundary moves after the structured search
    name: str = "auto"

    def plan(self, trace: Trace, model: str = "") -> Plan:
        result = self.search(trace, model)
        if not result.fits:
            raise PlannerError(infeasible_message(result, self.cluster))
        return result.plan

    def search(self, trace: Trace, model: str = "") -> AutoResult:
        if self.target not in TARGETS:
            raise PlannerError(f"unknown auto target '{self.target}': choose fsdp2 or fsdp1")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise PlannerError("the memory budget must be positive")
        started = time.perf_counter()
        search = _Search(trace, self.cluster, self.options, self.target, model)
        baselines = search.baselines()
        if self.memory_budget is not None:
            budget, source = self.memory_budget, "--memory-budget"
        elif baselines:
            fastest = min(baselines.values(), key=lambda c: (c.report.step_time, c.report.peak_memory))
            budget, source = fastest.report.peak_memory, f"peak of the fastest classic policy, {fastest.origin}"
        else:
            budget, source = self.cluster.gpu.memory_bytes, "GPU memory"
        search.budget = budget
        search.consider(*baselines.values())
        search.structured()
        search.refine(time.perf_counter() + self.refine_seconds)
        best = search.best()
        if self.target == "fsdp2" and best.plan.root.params:
            best = search.prefer_empty_root(best)
        label = f"auto({self.cluster.name}, {_fmt_bytes(budget)}{', fsdp1' if self.target == 'fsdp1' else ''})"
        plan = best.plan
        plan.policy, plan.model = label, model
        return AutoResult(
            plan=plan, report=best.report, budget=budget, budget_source=source,
            fits=best.report.peak_memory <= budget, min_peak=min(c.report.peak_memory for c in search.seen),
            baselines=baselines, evaluated=len(search.seen), seconds=time.perf_counter() - started,
            search=search,
        )


def infeasible_message(result: AutoResult, cluster: Cluster) -> str:
    return (f"no plan fits the memory budget of {_fmt_bytes(result.budget)} per rank on {cluster.name}: the "
            f"smallest peak any plan reaches is {_fmt_bytes(result.min_peak)} (most of it fixed: sharded "
            f"state and activations); raise --memory-budget to at least that or use more GPUs")


# -- atoms -------------------------------------------------------------------------------------------
def plan_atoms(trace: Trace, whole_blocks: bool) -> list[Atom]:
    """Atoms in execution order with their pinning (see the module doc)."""
    blocks: list[str] = []
    if whole_blocks:
        cls = default_block_class(trace, in_container_only=True)
        blocks = [f for f, m in trace.modules.items() if cls and m.cls == cls]
    big = len(trace.events)
    first = trace.param_first_use()
    atoms = []
    for mods, nbytes in atoms_in_execution_order(trace, whole=blocks):
        params = [trace.param_index(p) for m in mods for p in trace.modules[m].params]
        start = min((first[p] for p in params if p in first and not trace.events[first[p]].backward), default=big)
        atoms.append(Atom(list(mods), nbytes, start))
    atoms.sort(key=lambda a: a.start)
    _pin(trace, atoms)
    return atoms


def _pin(trace: Trace, atoms: list[Atom]) -> None:
    atom_of_param: dict[int, int] = {}
    for ai, a in enumerate(atoms):
        for m in a.modules:
            for p in trace.modules[m].params:
                atom_of_param[trace.param_index(p)] = ai
    # forward ops that read params, in order: an atom whose window of uses holds an op reading anything
    # else encloses other atoms (a tied embedding used again by the head)
    first = [-1] * len(atoms)
    last = [-1] * len(atoms)
    only_mine = [0] * len(atoms)
    outside: set[int] = set()
    k = 0
    for e in trace.events:
        if e.kind != OP or e.backward or not e.params:
            continue
        read = {atom_of_param[p] for p in e.params}
        for ai in read:
            if first[ai] < 0:
                first[ai] = k
            last[ai] = k
        if len(read) == 1:
            only_mine[next(iter(read))] += 1
        for p in e.params:
            if not any(is_descendant(e.module, o) for o in trace.params[p].owners):
                outside.add(atom_of_param[p])
        k += 1
    for ai, a in enumerate(atoms):
        if ai in outside:
            a.pinned = "root"
        elif any(trace.modules[m].calls > 1 for m in a.modules):
            a.pinned = "root" if len(a.modules) > 1 else "alone"
        elif first[ai] < 0 or only_mine[ai] != last[ai] - first[ai] + 1:
            a.pinned = "alone"  # never runs in forward, or interleaved with other atoms


def _coarsen(free: list[Atom], limit: int) -> list[Atom]:
    """Merge runs of consecutive atoms into at most about ``limit`` atoms of similar bytes, so the DP stays
    fast on models with thousands of tiny modules (groups that small would be latency-bound anyway)."""
    if len(free) <= limit:
        return free
    target = sum(a.nbytes for a in free) / limit
    out: list[Atom] = []
    for a in free:
        if out and out[-1].nbytes + a.nbytes <= target:
            out[-1] = Atom(out[-1].modules + a.modules, out[-1].nbytes + a.nbytes, out[-1].start)
        else:
            out.append(Atom(list(a.modules), a.nbytes, a.start))
    return out


# -- the search --------------------------------------------------------------------------------------
class _Search:
    def __init__(self, trace: Trace, cluster: Cluster, options: SimOptions, target: str, model: str) -> None:
        self.cluster, self.target, self.model, self.options = cluster, target, model, options
        precision = precision_from_name(options.precision)
        times = trace.op_seconds or op_times(trace, cluster, precision, options.mfu)
        self.trace, times = compact(trace, times)  # same results, fewer events to replay per plan
        self.ctx = SimContext(self.trace, cluster, options, times=times)
        self.world = cluster.world_size
        self.budget = 0
        self.seen: list[Candidate] = []
        self.cache: dict[tuple, Candidate] = {}
        self.classic_step = float("inf")  # the fastest classic policy's step time
        self.children = module_children(trace)
        blocks = default_block_class(trace, in_container_only=True) is not None
        self.atoms = plan_atoms(self.trace, whole_blocks=blocks)  # positions index the compacted trace
        self.fine_atoms = plan_atoms(self.trace, whole_blocks=False) if blocks else self.atoms

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, plan: Plan, origin: str) -> Candidate:
        key = _signature(plan)
        if key in self.cache:  # classic policies often agree (titan and order on a plain decoder)
            return self.cache[key]
        c = Candidate(plan, simulate(self.trace, plan, context=self.ctx, timeline=False), origin)
        self.seen.append(c)
        self.cache[key] = c
        return c

    def consider(self, *cands: Candidate) -> None:
        for c in cands:
            if c not in self.seen:
                self.seen.append(c)

    def key(self, c: Candidate) -> tuple:
        over = max(0, c.report.peak_memory - self.budget)
        step = float(f"{c.report.step_time:.9g}")  # equal up to float noise: then less memory, root managing less
        return (over, step, c.report.peak_memory, len(c.plan.root.params))

    def best(self) -> Candidate:
        valid = [c for c in self.seen if self.allowed(c.plan)]
        if not valid:
            raise PlannerError("no plan FSDP1 can express: every candidate unit mixes dtypes or requires_grad "
                               "in one flat parameter; use target fsdp2")
        return min(valid, key=self.key)

    def allowed(self, plan: Plan) -> bool:
        """Plans the target can express (a classic policy may produce a list group FSDP1 cannot)."""
        if self.target == "fsdp2":
            return True
        return all(len(g.modules) == 1 and not g.forward_prefetch and not g.backward_prefetch
                   and isinstance(g.reshard_after_forward, bool) and self._uniform(g.params)
                   for g in plan.groups)

    def _uniform(self, params: list[str]) -> bool:
        kinds = {(self.trace.param(p).dtype, self.trace.param(p).requires_grad) for p in params}
        return len(kinds) <= 1

    def baselines(self) -> dict[str, Candidate]:
        out = {}
        for name in POLICY_NAMES:
            try:
                plan = make_policy(name).plan(self.trace, self.model)
            except PlannerError:
                continue  # e.g. no repeated block class for module/titan
            out[name] = self.evaluate(plan, plan.policy)
        self.classic_step = min((c.report.step_time for c in out.values()), default=float("inf"))
        return out

    def build(self, segments: list[list[Atom]], reshard: list[bool | int] | None = None) -> Plan | None:
        groups = [compress_modules(self.trace, [m for a in seg for m in a.modules], self.children)
                  for seg in segments]
        if reshard is None:
            reshard = [True] * len(groups)
            used = [i for i, seg in enumerate(segments) if seg[0].start < len(self.trace.events)]
            if used:
                reshard[used[-1]] = False  # needed first in backward
        try:
            return make_plan(self.trace, groups, reshard, model=self.model)
        except PlannerError:
            return None

    # -- step 2: structured candidates -----------------------------------------------------------
    def structured(self) -> None:
        # module-tree cuts (what FSDP1 can express) are FSDP2 plans too: the root then plays a
        # never-resharded group, which pays when backward all-gathers are latency-bound
        self._fsdp1_candidates(24 if self.target == "fsdp1" else 8)
        if self.target == "fsdp1":
            return
        for atoms in ([self.atoms, self.fine_atoms] if self.fine_atoms is not self.atoms else [self.atoms]):
            segs = _segments(atoms, [[a] for a in atoms if not a.pinned])
            frugal = self.build(segs, [True] * len(segs))
            if frugal is not None:
                self.evaluate(frugal, "frugal")
            free = _coarsen([a for a in atoms if not a.pinned], 512)
            if not free:
                continue
            sizes = np.array([a.nbytes for a in free], dtype=float)
            caps = _caps(sizes)
            surrogate = _Surrogate(self.ctx, self.trace, atoms, free)
            found: dict[tuple[int, ...], tuple[float, float]] = {}
            for cap in caps:
                cuts, cost = surrogate.best_cuts(cap)
                found.setdefault(tuple(cuts), (cost, cap))
            # simulate in the surrogate's order until a few plans fit the budget (larger caps, more memory)
            fitting = 0
            for rank, (cuts, (_, cap)) in enumerate(sorted(found.items(), key=lambda kv: kv[1])):
                if rank >= 4 and fitting >= 3:
                    break
                segs = [free[i:j] for i, j in zip((0, *cuts), (*cuts, len(free)), strict=True)]
                plan = self.build(_segments(atoms, segs))
                if plan is not None:
                    fitting += self.evaluate(plan, f"dp({_fmt_bytes(cap)})").report.peak_memory <= self.budget

    def _fsdp1_candidates(self, count: int) -> None:
        """FSDP1 units are single modules: evaluate module-tree cuts from per-leaf wrapping to none (size-based
        wrapping at ``count`` thresholds), and every param-owning module wrapped."""
        numels = sorted({p.numel for p in self.trace.params})
        thresholds = sorted({int(x) for x in np.geomspace(max(numels[0], 1), max(self.trace.numel, 2), count)})
        for t in thresholds:
            plan = SizeBasedPolicy(t).plan(self.trace, self.model)
            self.evaluate(plan, f"size({t})")
        leaves = [[m] for m in self.trace.owning_modules()
                  if not any(len(self.trace.param(p).owners) > 1 for p in self.trace.modules[m].params)]
        try:
            plan = make_plan(self.trace, leaves, model=self.model)
            self.evaluate(plan, "per-module")
        except PlannerError:
            pass

    # -- step 3: refinement ----------------------------------------------------------------------
    def refine(self, deadline: float, starts: int = 3) -> None:
        """Refine the ``starts`` best distinct plans so far (one local optimum is not enough: a plan that is
        second before refinement can end first), sharing the time until ``deadline``."""
        ranked = sorted((c for c in self.seen if self.allowed(c.plan)), key=self.key)[:starts]
        for n, start in enumerate(ranked):
            share = time.perf_counter() + (deadline - time.perf_counter()) / (len(ranked) - n)
            best = self._reshard_prefix(start)
            if self.target == "fsdp2":
                best = self._prefetch(best)
                self._move_boundaries(best, share)

    def prefer_empty_root(self, best: Candidate, slack: float = 1e-3) -> Candidate:
        """A plan whose root manages nothing, if one is within ``slack`` of ``best``'s step time, no slower than
        every classic policy and uses no more memory: that is what the plan is for, and the root's head start
        (its all-gather issued first) is worth little. Candidates: every plan seen, and ``best`` with the params
        its root holds but need not moved into a group of their own, kept unsharded after forward."""
        held = [a for a in self.atoms if a.pinned != "root" and any(
            p in best.plan.root.params for m in a.modules for p in self.trace.modules[m].params)]
        alone = [a.modules for a in held if a.pinned == "alone"]  # reused or enclosing: never in a list
        rest = [m for a in held if a.pinned != "alone" for m in a.modules]
        new = [*alone, *([compress_modules(self.trace, rest, self.children)] if rest else [])]
        if new:
            groups = [list(g.modules) for g in best.plan.inner_groups]
            reshard = [g.reshard_after_forward for g in best.plan.inner_groups]
            try:
                plan = make_plan(self.trace, [*groups, *new], [*reshard, *[False] * len(new)], model=self.model)
                self.evaluate(plan, best.origin + " + root emptied")
            except PlannerError:
                pass
        ok = [c for c in self.seen if not c.plan.root.params and self.allowed(c.plan)
              and c.report.peak_memory <= best.report.peak_memory
              and c.report.step_time <= min(best.report.step_time * (1 + slack), self.classic_step * (1 + 1e-9))]
        return min(ok, key=self.key, default=best)

    def _better(self, c: Candidate, than: Candidate) -> bool:
        return self.allowed(c.plan) and self.key(c) < self.key(than)

    def _with(self, plan: Plan, **changes: object) -> Plan:
        return replace(plan, groups=[replace(g) for g in plan.groups], **changes)  # type: ignore[arg-type]

    def _reshard_prefix(self, best: Candidate) -> Candidate:
        """Keep the last m groups of forward unsharded (False or an intra-node int): they are the first
        needed in backward. Binary-search the largest m that pays and fits, for each value."""
        inner = [i for i, g in enumerate(best.plan.groups) if not g.is_root and g.params]
        values: list[bool | int] = [False]
        k = self.cluster.gpus_per_node
        if self.target == "fsdp2" and 1 < k < self.world and self.world % k == 0:
            values.append(k)
        for value in values:
            lo, hi = 0, len(inner)
            while lo < hi:
                m = (lo + hi + 1) // 2
                plan = self._with(best.plan)
                for i in inner[len(inner) - m:]:
                    if plan.groups[i].reshard_after_forward is True:
                        plan.groups[i].reshard_after_forward = value
                c = self.evaluate(plan, f"{best.origin} + last {m} reshard={value}")
                if self._better(c, best):
                    best, lo = c, m
                elif c.report.peak_memory > self.budget:
                    hi = m - 1
                else:
                    break  # fits but does not pay: more of the same will not either
        return best

    def _prefetch(self, best: Candidate) -> Candidate:
        inner = [i for i, g in enumerate(best.plan.groups) if not g.is_root and g.params]
        if len(inner) < 3:
            return best
        for direction in ("forward", "backward"):
            plan = self._with(best.plan)
            for pos, i in enumerate(inner):
                if direction == "forward":
                    plan.groups[i].forward_prefetch = inner[pos + 1:pos + 3]
                else:
                    plan.groups[i].backward_prefetch = inner[max(0, pos - 2):pos][::-1]
            c = self.evaluate(plan, f"{best.origin} + {direction} prefetch 2")
            if self._better(c, best):
                best = c
        return best

    def _move_boundaries(self, best: Candidate, deadline: float) -> Candidate:
        """Move one boundary between adjacent free groups by one atom, or merge two, while it pays: sweep the
        boundaries in turn, retrying one after a move it accepted, until a full sweep changes nothing."""
        k, unchanged = 0, 0
        while time.perf_counter() < deadline:
            bounds = len(best.plan.inner_groups) - 1
            if bounds < 1 or unchanged >= bounds:
                break
            k %= bounds
            for _, alt in self._moves(best.plan, deadline, only=k):
                c = self.evaluate(alt, best.origin + " + moved")
                if self._better(c, best):
                    best, unchanged = c, 0
                    break
            else:
                k, unchanged = k + 1, unchanged + 1
        return best

    def _aligned(self, plan: Plan) -> tuple[list[Atom], list[list[int]]] | None:
        """The atom list (whole blocks or fine) whose atoms ``plan``'s inner groups are unions of, with each
        group's atom indices; None when the plan splits atoms (a classic policy's may)."""
        for atoms in (self.atoms, self.fine_atoms):
            atom_params = [{p for m in a.modules for p in self.trace.modules[m].params} for a in atoms]
            atom_of = {p: ai for ai, ps in enumerate(atom_params) for p in ps}
            seq = [sorted({atom_of[p] for p in g.params}) for g in plan.inner_groups]
            flat = [x for s in seq for x in s]
            covered = sum(len(atom_params[x]) for x in flat)
            if len(flat) == len(set(flat)) and covered == sum(len(g.params) for g in plan.inner_groups):
                return atoms, seq
        return None

    def _moves(self, plan: Plan, deadline: float, only: int | None = None) -> Iterator[tuple[str, Plan]]:
        """Plans one step away, made lazily until ``deadline``, with what changed: a boundary between
        consecutive groups of atoms moved by one atom either way, or the two groups merged (``only``: just the
        boundary after inner group ``only``). Reshard settings carry over by group position; prefetch lists
        are dropped."""
        aligned = self._aligned(plan)
        if aligned is None:
            return
        atoms, seq = aligned
        reshard = [g.reshard_after_forward for g in plan.inner_groups]
        for k in range(len(seq) - 1) if only is None else [only]:
            a, b = seq[k], seq[k + 1]
            if not a or not b or any(atoms[x].pinned for x in a + b) or a[-1] + 1 != b[0]:
                continue
            moves = (("boundary one atom earlier", a[:-1], [a[-1], *b]),
                     ("boundary one atom later", [*a, b[0]], b[1:]), ("merged with the next group", a + b, []))
            for what, na, nb in moves:
                if not na or time.perf_counter() >= deadline:
                    continue
                segs = [[atoms[x] for x in s] for s in seq]
                segs[k], segs[k + 1] = [atoms[x] for x in na], [atoms[x] for x in nb]
                p = self.build([s for s in segs if s], reshard if nb else reshard[:k + 1] + reshard[k + 2:])
                if p is not None:
                    yield what, p


def _signature(plan: Plan) -> tuple:
    return tuple((tuple(g.modules), g.reshard_after_forward, tuple(g.forward_prefetch), tuple(g.backward_prefetch))
                 for g in plan.groups)


def _segments(atoms: list[Atom], free_segments: list[list[Atom]]) -> list[list[Atom]]:
    """Free segments plus each atom pinned "alone" as its own segment, in execution order."""
    segs = [*free_segments, *[[a] for a in atoms if a.pinned == "alone"]]
    return sorted(segs, key=lambda s: s[0].start)


def _caps(sizes: np.ndarray) -> list[float]:
    """Group-size caps to run the DP with: the largest atom, doubling up to everything in one group."""
    cap, total = float(sizes.max()), float(sizes.sum())
    caps = []
    while cap < total:
        caps.append(cap)
        cap *= 2
    caps.append(total)
    return caps


class _Surrogate:
    """Per-segment step-time estimate for the DP (see the module doc), vectorised over segment starts."""

    def __init__(self, ctx: SimContext, trace: Trace, atoms: list[Atom], free: list[Atom]) -> None:
        prec, world = ctx.precision, ctx.world
        hbm = ctx.cluster.gpu.hbm_bandwidth
        itemsize = max((p.itemsize for p in trace.params), default=4)
        gather = np.array([a.nbytes for a in free], dtype=float) * prec.gather_bytes / itemsize
        reduce = np.array([self._grad_bytes(trace, a) for a in free], dtype=float) * prec.reduce_bytes / itemsize
        fwd_end = next((i for i, e in enumerate(trace.events) if e.backward), len(trace.events))
        starts = [a.start for a in free] + [fwd_end]
        cum = ctx.cum
        fwd = np.array([cum[starts[i + 1]] - cum[starts[i]] for i in range(len(free))])
        bwd = fwd * (ctx.cum[-1] - cum[fwd_end]) / max(cum[fwd_end], 1e-30)  # backward in forward's proportions
        a_ag, pb_ag, _ = ctx.link("all_gather", 0)
        a_rs, pb_rs, _ = ctx.link("reduce_scatter", 0)
        self.a_ag, self.a_rs = a_ag, a_rs
        self.pb_ag = pb_ag + 1 / world / hbm + 1 / hbm  # copy-in and copy-out at HBM speed
        self.pb_rs = pb_rs
        self.P = np.concatenate([[0.0], np.cumsum(gather)])
        self.R = np.concatenate([[0.0], np.cumsum(reduce)])
        self.F = np.concatenate([[0.0], np.cumsum(fwd)])
        self.B = np.concatenate([[0.0], np.cumsum(bwd)])
        self.raw = np.concatenate([[0.0], np.cumsum([a.nbytes for a in free])])

    @staticmethod
    def _grad_bytes(trace: Trace, atom: Atom) -> int:
        return sum(trace.param(p).nbytes for m in atom.modules for p in trace.modules[m].params
                   if trace.param(p).requires_grad)

    def best_cuts(self, cap: float) -> tuple[list[int], float]:
        """Segment ends (exclusive atom indices, the last omitted) minimising the surrogate with groups <= cap,
        and the surrogate's step time for them."""
        n = len(self.P) - 1
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        back = np.zeros(n + 1, dtype=int)
        penalty = 1e-9 / max(self.raw[-1], 1.0) ** 2  # among equal times prefer smaller groups (memory)
        lo = 0
        for j in range(1, n + 1):
            while self.raw[j] - self.raw[lo] > cap and lo < j - 1:
                lo += 1
            i = np.arange(lo, j)
            g = self.P[j] - self.P[i]
            ag = self.a_ag + g * self.pb_ag
            rs = np.where(self.R[j] > self.R[i], self.a_rs + (self.R[j] - self.R[i]) * self.pb_rs, 0.0)
            cost = np.maximum(self.F[j] - self.F[i], ag) + np.maximum(self.B[j] - self.B[i], ag + rs)
            cost = cost + np.where(i == 0, ag, 0.0) + penalty * (self.raw[j] - self.raw[i]) ** 2
            total = best[lo:j] + cost
            k = int(np.argmin(total))
            best[j], back[j] = total[k], lo + k
        cuts = []
        j = n
        while j > 0:
            j = back[j]
            if j > 0:
                cuts.append(j)
        return sorted(cuts), float(best[n])


# -- explanation -------------------------------------------------------------------------------------
@dataclass
class GroupExplanation:
    group: int
    modules: list[str]
    nbytes: int  # unsharded bytes at the gather dtype
    all_gather: float  # seconds for its all-gather
    latency_share: float  # fraction of that time that is latency (alpha), not bandwidth
    hidden_by: float  # forward compute of the group before it, which its all-gather overlaps
    reason: str
    alternative: str
    alternative_step: float | None  # simulated step time of the best alternative (None: no alternative)
    alternative_peak: int | None


def explain(result: AutoResult) -> list[GroupExplanation]:
    """Per group of ``result.plan``: its size and all-gather terms, why its boundary with the next group sits
    where it does, and what the best one-step alternative (boundary moved, groups merged) would cost."""
    search = result.search
    if search is None:
        raise PlannerError("this AutoResult has no search to explain")
    plan, report = result.plan, result.report
    ctx, trace = search.ctx, search.trace
    prec = ctx.precision
    alpha, per_byte, _ = ctx.link("all_gather", 0)
    fwd_end = next((i for i, e in enumerate(trace.events) if e.backward), len(trace.events))
    first = trace.param_first_use()
    starts = [min((first.get(trace.param_index(p), fwd_end) for p in g.params), default=fwd_end)
              for g in plan.inner_groups]
    out = []
    for k, g in enumerate(plan.inner_groups):
        nbytes = sum(trace.param(p).numel for p in g.params) * prec.gather_bytes
        ag = alpha + nbytes * per_byte if nbytes else 0.0
        prev = ctx.cum[starts[k]] - ctx.cum[starts[k - 1]] if k > 0 else 0.0
        alts = [(what, c) for what, p in search._moves(plan, float("inf"), only=k)
                if search.allowed(p) for c in [search.evaluate(p, "explain")]] \
            if k + 1 < len(plan.inner_groups) else []
        best = min(alts, key=lambda wc: search.key(wc[1]), default=None)
        reason = _reason(ag, alpha, prev, best, report, result.budget)
        out.append(GroupExplanation(
            group=k, modules=list(g.modules), nbytes=nbytes, all_gather=ag,
            latency_share=alpha / ag if ag else 0.0, hidden_by=prev, reason=reason,
            alternative=best[0] if best else "-",
            alternative_step=best[1].report.step_time if best else None,
            alternative_peak=best[1].report.peak_memory if best else None,
        ))
    return out


REASONS = {
    "fixed": "last group, or pinned (tied, reused or read outside its module): no boundary to move",
    "memory": "a faster alternative exists but exceeds the memory budget",
    "tie": "alternatives simulate equally fast; this one has the smaller peak memory",
    "unconverged": "a one-step move is faster and fits: the search's time ran out before it tried it",
    "overlap": "merging removes a latency-bound collective but exposes a larger all-gather",
    "bandwidth": "its all-gather already takes longer than the compute hiding it; larger would be slower",
    "balance": "latency vs overlap: every one-step move simulates slower",
}


def _reason(ag: float, alpha: float, prev: float, best: tuple[str, Candidate] | None, report: StepReport,
            budget: int) -> str:
    """Which term holds the boundary in place: a key of ``REASONS``."""
    if best is None:
        return "fixed"
    what, c = best
    faster = c.report.step_time < report.step_time * (1 - 1e-9)
    if faster and c.report.peak_memory > budget:
        return "memory"
    if faster:
        return "unconverged"
    if c.report.step_time <= report.step_time * (1 + 1e-9):
        return "tie"
    if "merged" in what and ag > 0 and alpha / ag >= 0.5:
        return "overlap"
    if ag > prev > 0:
        return "bandwidth"
    return "balance"
