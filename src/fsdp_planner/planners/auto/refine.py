"""Local refinement of the best plans, judged by the simulator: keep the groups that finish forward last
unsharded, prefetch ahead, move single boundaries by one atom or merge neighbours, while it pays and fits.

Its effort is counted in plans simulated, never in seconds: the same search gives the same plan on any machine
under any load (``Refiner.refine``'s ``plans``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from enum import Enum

from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan, ReshardAfterForward
from fsdp_planner.planners.auto.atoms import Atom, Pin
from fsdp_planner.planners.auto.candidates import frugal_plan
from fsdp_planner.planners.auto.evaluator import GROUP_SLACK, REFINE_STARTS, ROOT_SLACK, Candidate, Evaluator, Target
from fsdp_planner.planners.order import compress_modules
from fsdp_planner.sim.sizing import shard_dims
from fsdp_planner.trace.tree import proper_ancestors


class Move(Enum):
    """A one-step change to a plan's grouping."""

    EARLIER = "boundary one atom earlier"
    LATER = "boundary one atom later"
    MERGED = "merged with the next group"


class Refiner:
    def __init__(self, ev: Evaluator, atoms: list[Atom], fine_atoms: list[Atom]) -> None:
        self.ev, self.atoms, self.fine_atoms = ev, atoms, fine_atoms
        self.cut = False  # the effort stopped a refinement before it converged

    def _within(self, stop: int) -> bool:
        """Whether the effort allows another simulation; remembers when it did not (``cut``)."""
        if self.ev.simulated < stop:
            return True
        self.cut = True
        return False

    def refine(self, plans: int, starts: int = REFINE_STARTS) -> int:
        """Refine the ``starts`` best distinct plans so far (a plan second before refinement can end first),
        simulating at most ``plans`` new plans between them (what one start leaves, the next may use). Every plan
        tried stays in the evaluator. Returns the plans simulated."""
        first = self.ev.simulated
        stop = first + plans
        ranked = self.ev.ranked()[:starts]
        # plans built from a start checkpoint what it does (the search may have left the evaluator on another
        # setting), and what the setting would have it checkpoint but a group inside forbade (FSDP1)
        settings = [self.ev.checkpointing(self._intended(start, self.ev.checkpointed)) for start in ranked]
        if ranked and not self.ev.fits(ranked[0]) and not any(self._floor_fits(ev) for ev in settings):
            return self.ev.simulated - first
        for n, (start, setting) in enumerate(zip(ranked, settings, strict=True)):
            refiner = Refiner(setting, self.atoms, self.fine_atoms)
            share = self.ev.simulated + max(0, stop - self.ev.simulated) // (len(ranked) - n)
            best = refiner.reshard_prefix(start, share)
            if self.ev.target is Target.FSDP2:
                best = refiner.prefetch(best, share)
                refiner.move_boundaries(best, share)
            self.cut = self.cut or refiner.cut
        return self.ev.simulated - first

    def _floor_fits(self, ev: Evaluator) -> bool:
        """Whether any plan the moves reach could fit under ``ev``'s checkpointing. Keeping groups unsharded and
        prefetching add memory; moving or merging boundaries never groups finer than the fine atoms: the least
        memory in reach is the frugal plan of those, every group resharded after forward. When nothing simulated
        fits and that does not either, refinement would only polish plans that cannot run (llama3-405b on 64 H100s
        without offload: 158 plans, 60% of auto's time, all over the budget by 70 GiB)."""
        if ev.target is not Target.FSDP2:  # only resharding moves, which add memory
            return False
        if ev.selective and self.fine_atoms is not self.atoms:  # a group inside a block drops its op-level
            return True  # checkpointing (``with_checkpointing``): finer groups may hold more, no floor to test
        plan = frugal_plan(ev, self.fine_atoms)
        return plan is not None and ev.fits(ev.evaluate(plan, "frugal"))

    @staticmethod
    def _intended(start: Candidate, setting: Sequence[str]) -> list[str]:
        own = start.plan.activation_checkpointing
        blocked = {a for g in start.plan.groups for m in g.modules for a in proper_ancestors(m)}
        return [*own, *(m for m in setting if m in blocked and m not in own)]

    def reshard_prefix(self, best: Candidate, stop: int) -> Candidate:
        """Keep the last m groups of forward unsharded (False, or the node size when a shard group spans nodes): they
        are the first needed in backward. Binary-search the largest m that pays and fits, for each value, until
        ``stop`` plans have been simulated."""
        inner = [i for i, g in enumerate(best.plan.groups) if not g.is_root and g.params]
        values: list[ReshardAfterForward] = [False]
        k, shard = self.ev.cluster.gpus_per_node, self.ev.ctx.shard
        # an int needs dim-0 sharding (``check_int_reshard_on_dim0``): not with a placement putting params on dim 1
        on_dim1 = shard_dims(self.ev.trace, shard, self.ev.ctx.options.shard_placement)
        if self.ev.target is Target.FSDP2 and 1 < k < shard and shard % k == 0 and not on_dim1:
            values.append(k)
        for value in values:
            lo, hi = 0, len(inner)
            while lo < hi and self._within(stop):
                m = (lo + hi + 1) // 2
                last = set(inner[len(inner) - m:])
                plan = replace(best.plan, groups=[
                    replace(g, reshard_after_forward=value) if i in last and g.reshard_after_forward is True else g
                    for i, g in enumerate(best.plan.groups)])
                c = self.ev.evaluate(plan, f"{best.origin} + last {m} reshard={value}")
                if self.ev.better(c, best):
                    best, lo = c, m
                elif not self.ev.fits(c):
                    hi = m - 1
                else:
                    break  # fits but does not pay: more of the same will not either
        return best

    def prefetch(self, best: Candidate, stop: int) -> Candidate:
        """Explicit prefetch two groups ahead, forward then backward, kept when it pays (until ``stop`` plans have
        been simulated)."""
        inner = [i for i, g in enumerate(best.plan.groups) if not g.is_root and g.params]
        if len(inner) < 3:
            return best
        for direction in ("forward", "backward"):
            if not self._within(stop):
                break
            groups = list(best.plan.groups)
            for pos, i in enumerate(inner):
                if direction == "forward":
                    groups[i] = replace(groups[i], forward_prefetch=inner[pos + 1:pos + 3])
                else:
                    groups[i] = replace(groups[i], backward_prefetch=inner[max(0, pos - 2):pos][::-1])
            plan = replace(best.plan, groups=groups)
            c = self.ev.evaluate(plan, f"{best.origin} + {direction} prefetch 2")
            if self.ev.better(c, best):
                best = c
        return best

    def move_boundaries(self, best: Candidate, stop: int) -> Candidate:
        """Move one boundary between adjacent free groups by one atom, or merge two, while it pays: sweep the
        boundaries in turn, taking the best of the three moves at each and retrying a boundary after a move it
        accepted, until a full sweep changes nothing or ``stop`` plans have been simulated. A boundary move that pays
        is tried again twice as far (then four times...) while that pays too."""
        k, unchanged = 0, 0
        while self._within(stop):
            bounds = len(best.plan.inner_groups) - 1
            if bounds < 1 or unchanged >= bounds:
                break
            k %= bounds
            tried = [(move, self.ev.evaluate(alt, best.origin + " + moved"))
                     for move, alt in self.moves(best.plan, stop, only=k)]
            move, c = min(tried, key=lambda mc: self.ev.key(mc[1]), default=(None, best))
            if move is not None and self.ev.pays(c, best):
                best, unchanged = self._gallop(c, move, k, stop), 0
            else:
                k, unchanged = k + 1, unchanged + 1
        return best

    def _gallop(self, best: Candidate, move: Move, k: int, stop: int) -> Candidate:
        step = 2
        while move is not Move.MERGED and self._within(stop):
            alt = next((p for m, p in self.moves(best.plan, stop, only=k, step=step) if m is move), None)
            if alt is None:
                break
            c = self.ev.evaluate(alt, best.origin + " + moved")
            if not self.ev.pays(c, best):
                break
            best, step = c, step * 2
        return best

    def aligned(self, plan: Plan) -> tuple[list[Atom], list[list[int]]] | None:
        """The atom list (whole blocks or fine) whose atoms ``plan``'s inner groups are unions of, with each group's
        atom indices; None when the plan splits atoms (a classic policy's may)."""
        index = self.ev.trace.index.param_index
        for atoms in (self.atoms, self.fine_atoms):
            atom_of = {p: ai for ai, a in enumerate(atoms) for p in a.params}
            seq = [sorted({atom_of[index[p]] for p in g.params if index[p] in atom_of}) for g in plan.inner_groups]
            flat = [x for s in seq for x in s]
            covered = sum(len(atoms[x].params) for x in flat)
            if len(flat) == len(set(flat)) and covered == sum(len(g.params) for g in plan.inner_groups):
                return atoms, seq
        return None

    def moves(self, plan: Plan, stop: int | None = None, only: int | None = None,
              step: int = 1) -> Iterator[tuple[Move, Plan]]:
        """Plans one step away, made lazily until ``stop`` plans have been simulated (None: all of them), with what
        changed: a boundary between consecutive
        groups of free atoms moved by ``step`` atoms either way, or the two groups merged (``only``: just the
        boundary after inner group ``only``). Reshard settings carry over by group position; prefetch lists are
        dropped."""
        aligned = self.aligned(plan)
        if aligned is None:
            return
        atoms, seq = aligned
        reshard = [g.reshard_after_forward for g in plan.inner_groups]
        if only is not None and only >= len(seq) - 1:
            return
        for k in range(len(seq) - 1) if only is None else [only]:
            a, b = seq[k], seq[k + 1]
            if not a or not b or any(atoms[x].pin is not Pin.FREE for x in a + b) or a[-1] + 1 != b[0]:
                continue
            options = ((Move.EARLIER, a[:-step], [*a[-step:], *b]), (Move.LATER, [*a, *b[:step]], b[step:]),
                       (Move.MERGED, a + b, []))
            for what, na, nb in options:
                if not na or (step > 1 and not nb) or (stop is not None and not self._within(stop)):
                    continue  # a longer step moves a boundary; it never empties a group
                segs = [[atoms[x] for x in s] for s in seq]
                segs[k], segs[k + 1] = [atoms[x] for x in na], [atoms[x] for x in nb]
                # a group of no atoms goes (the merged one's second, and any group whose modules hold no param of
                # their own: a UNet's), its reshard setting with it
                kept = [(s, r) for s, r in zip(segs, reshard, strict=True) if s]
                yield what, self.ev.build([s for s, _ in kept], [r for _, r in kept])

    def prefer_fewer_groups(self, best: Candidate, classic_step: float, slack: float = GROUP_SLACK) -> Candidate:
        """The plan with the fewest groups among those within ``slack`` of ``best``'s step time (and no slower
        than every classic policy) that fit, run, and keep no more params on the root. FSDP2's host work per group
        is modelled (``Overhead``), but what a group costs on the GPU beyond its collectives and copies (each
        copy kernel's fixed minimum, NCCL's kernels taking SMs from compute, allocator churn) is not: a few
        microseconds each, so more groups must win clearly to be worth them (llama32-3b on 8 H100s: 253
        single-Linear groups were 0.1% faster than 28 blocks in the model)."""
        ok = [c for c in self.ev.seen
              if c.runs and self.ev.allowed(c.plan) and self.ev.fits(c)
              and len(c.plan.root.params) <= len(best.plan.root.params)
              and c.report.step_time <= min(best.report.step_time * (1 + slack), classic_step * (1 + 1e-9))]
        return min(ok, key=lambda c: (len(c.plan.inner_groups), self.ev.key(c)), default=best)

    def prefer_empty_root(self, best: Candidate, classic_step: float, slack: float = ROOT_SLACK) -> Candidate:
        """A plan whose root manages only what it must, if one is within ``slack`` of ``best``'s step time, no
        slower than every classic policy and uses no more memory: that is what the plan is for, and the root's head
        start (its all-gather issued first) is worth little. Candidates: every plan seen, and ``best`` with the
        params its root holds but need not moved into groups of their own, kept unsharded after forward."""
        root_params = set(best.plan.root.params)
        index = self.ev.trace.index.param_index
        held = [a for a in self.atoms if a.pin is not Pin.ROOT and any(p in root_params for m in a.modules
                                                                        for p in self.ev.trace.modules[m].params)]
        alone = [a.modules for a in held if a.pin is Pin.ALONE]  # reused or enclosing: never in a list
        rest = [m for a in held if a.pin is not Pin.ALONE for m in a.modules]
        new = [*alone, *([compress_modules(self.ev.trace, rest)] if rest else [])]
        if new:
            groups = [list(g.modules) for g in best.plan.inner_groups]
            reshard = [g.reshard_after_forward for g in best.plan.inner_groups]
            plan = make_plan(self.ev.trace, [*groups, *new], [*reshard, *[False] * len(new)], model=self.ev.model)
            # the new groups hold no block: the plan checkpoints what ``best`` does
            self.ev.checkpointing(best.plan.activation_checkpointing).evaluate(plan, best.origin + " + root emptied")
        movable = {p for a in self.atoms if a.pin is not Pin.ROOT for p in a.params}
        ok = [c for c in self.ev.seen
              if c.runs and not any(index[p] in movable for p in c.plan.root.params) and self.ev.allowed(c.plan)
              and c.report.reserved_memory <= best.report.reserved_memory
              and c.report.step_time <= min(best.report.step_time * (1 + slack), classic_step * (1 + 1e-9))]
        return min(ok, key=self.ev.key, default=best)
