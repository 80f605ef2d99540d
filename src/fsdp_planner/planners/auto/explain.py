"""Why each group boundary of an auto plan sits where it does, with the best one-step alternative's cost."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.planners.auto import AutoResult
from fsdp_planner.planners.auto.evaluator import GROUP_SLACK, MIN_GAIN, ROOT_SLACK, Candidate
from fsdp_planner.planners.auto.refine import Move, Refiner


class Reason(Enum):
    """Which term holds a boundary in place."""

    FIXED = "fixed"
    MEMORY = "memory"
    TIE = "tie"
    UNCONVERGED = "unconverged"
    MARGIN = "margin"
    GROUPS = "fewer groups"
    OVERLAP = "overlap"
    BANDWIDTH = "bandwidth"
    BALANCE = "balance"

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Reason.FIXED: "no boundary to move: the last group, a pinned module (tied, reused or read outside its module), "
                  "or modules the root holds between this group and the next",
    Reason.MEMORY: "a faster alternative exists but exceeds the memory budget",
    Reason.TIE: "the best alternative simulates equally fast: no time gained by moving (the search weighs time within "
                "the budget; the memory the move would save, if any, is in its row)",
    Reason.UNCONVERGED: "a one-step move is faster and fits: the search's effort ran out before it tried it "
                         "(raise --search-effort)",
    Reason.MARGIN: f"a one-step move is faster and fits, by less than the search's margins (refining a plan behind "
                   f"the best, a move must save {MIN_GAIN:.2%}; a root that manages nothing is preferred within "
                   f"{ROOT_SLACK:.1%})",
    Reason.GROUPS: f"a split is faster by less than {GROUP_SLACK:.1%}: not worth another group (what a group costs "
                   "the GPU beyond its collectives and copies is not modelled)",
    Reason.OVERLAP: "merging removes a latency-bound collective but exposes a larger all-gather",
    Reason.BANDWIDTH: "its all-gather already takes longer than the compute hiding it; larger would be slower",
    Reason.BALANCE: "latency vs overlap: every one-step move simulates slower",
}


@dataclass
class GroupExplanation:
    group: int
    modules: list[str]
    nbytes: int  # unsharded bytes at the gather dtype
    all_gather: float  # seconds for its all-gather
    latency_share: float  # fraction of that time that is latency (alpha), not bandwidth
    hidden_by: float  # forward compute of the group before it, which its all-gather overlaps
    reason: Reason
    alternative: Move | None  # the best one-step alternative (None: no boundary to move)
    alternative_step: float | None
    alternative_peak: int | None


def explain(result: AutoResult) -> list[GroupExplanation]:
    """Per group of ``result.plan``: its size and all-gather terms, why its boundary with the next group sits where
    it does, and what the best one-step alternative (boundary moved, groups merged) would cost."""
    plan = result.plan
    # alternatives checkpoint what the plan does (the search may have ended on another setting)
    ev = result.search.ev.checkpointing(plan.activation_checkpointing, plan.selective_checkpointing)
    refiner = Refiner(ev, result.search.atoms, result.search.fine_atoms)
    trace, ctx = ev.trace, ev.ctx
    fwd_end = trace.index.forward_end
    first, index = trace.index.first_use, trace.index.param_index
    starts = [min((first.get(index[p], fwd_end) for p in g.params), default=fwd_end) for g in plan.inner_groups]
    groups = ctx.sizing.groups(plan)
    out = []
    for k, g in enumerate(plan.inner_groups):
        nbytes = groups[k].gather_bytes
        cost = ctx.cost(CollectiveKind.ALL_GATHER)
        ag, alpha = cost.seconds(nbytes), cost.line(nbytes).alpha  # the protocol NCCL picks at this size
        prev = ctx.cum[starts[k]] - ctx.cum[starts[k - 1]] if k > 0 else 0.0
        alternatives = [] if k + 1 >= len(plan.inner_groups) else [
            (move, ev.evaluate(p, "explain")) for move, p in refiner.moves(plan, only=k) if ev.allowed(p)]
        best = min(alternatives, key=lambda mc: ev.key(mc[1]), default=None)
        out.append(GroupExplanation(
            group=k, modules=list(g.modules), nbytes=nbytes, all_gather=ag, latency_share=alpha / ag if ag else 0.0,
            hidden_by=prev, reason=_reason(ag, alpha, prev, best, result),
            alternative=best[0] if best else None,
            alternative_step=best[1].report.step_time if best else None,
            alternative_peak=best[1].report.reserved_memory if best else None))
    return out


def _reason(ag: float, alpha: float, prev: float, best: tuple[Move, Candidate] | None, result: AutoResult) -> Reason:
    if best is None:
        return Reason.FIXED
    move, c = best
    step = result.report.step_time
    faster = c.report.step_time < step * (1 - 1e-9)
    if faster and not result.memory.fits(c.report.reserved_memory):
        return Reason.MEMORY
    if faster and len(c.plan.inner_groups) > len(result.plan.inner_groups) \
            and c.report.step_time >= step * (1 - GROUP_SLACK):
        return Reason.GROUPS
    if faster:  # the refinement stopped short of it, or moved past it by its margins
        return Reason.UNCONVERGED if result.cut else Reason.MARGIN
    if c.report.step_time <= step * (1 + 1e-9):
        return Reason.TIE
    if move is Move.MERGED and ag > 0 and alpha / ag >= 0.5:
        return Reason.OVERLAP
    if ag > prev > 0:
        return Reason.BANDWIDTH
    return Reason.BALANCE
