"""Memory-budgeted activation checkpointing: which leading blocks auto checkpoints in full, which op-level.

Per block, op-level selective checkpointing (``SacPolicy``, torchtitan's save list) frees less memory than full
checkpointing at a smaller recomputation. Which blocks get which matters mostly through how long their activations
live: the first blocks' live longest (from their forward to the end of backward), so those are checkpointed first,
the heaviest way first. A setting is then two counts: the first ``full`` blocks in full and the next ``op``
op-level. For a given ``full``, more op blocks only add recomputation, so the fastest setting with that many in full
is the fewest op blocks that fit (a binary search, memory falling with each block checkpointed); ``full`` itself is
searched on a coarse grid from 0 (op-level only) to the fewest that fit in full alone (today's plan, so the choice
is never slower than it), then by steps around the best, each step taken again while it pays, then halved. Every
setting is judged on one plan (torchtitan's grouping, or the best classic one) with the evaluator, so the search is
deterministic and costs about ``(GRID + 2 log2 n + moves) x log2 n`` simulations for ``n`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_planner.choices import SacPolicy
from fsdp_planner.fsdp2.checkpointing import modified_topk
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.selective import POLICIES
from fsdp_planner.planners.auto.evaluator import Candidate, Evaluator
from fsdp_planner.trace.events import OpClass
from fsdp_planner.trace.records import Trace

GRID = 5  # counts of full blocks tried first, evenly spaced from 0 to the fewest that fit in full alone


@dataclass(frozen=True)
class Setting:
    """The first ``full`` blocks checkpointed in full, the next ``op`` op-level."""

    full: int
    op: int

    def describe(self, policy: SacPolicy) -> str:
        parts = [f"{self.full} full"] * bool(self.full) + [f"{self.op} op {policy.value}"] * bool(self.op)
        return " + ".join(parts) or "none"


def setting_view(ev: Evaluator, blocks: list[str], s: Setting, policy: SacPolicy) -> Evaluator:
    """``ev`` with its plans checkpointing what ``s`` says."""
    return ev.checkpointing(blocks[:s.full], dict.fromkeys(blocks[s.full:s.full + s.op], policy))


@dataclass
class Choice:
    """The chosen setting, with the evidence ``--explain`` shows."""

    setting: Setting
    policy: SacPolicy
    start: str  # the plan the settings were judged on (its origin: torchtitan's grouping, or a classic policy)
    tried: dict[Setting, Candidate]  # every setting simulated on the start plan
    full_only: Setting  # the fewest leading blocks in full alone that fit (the plan an expert writes by hand)
    op_only: Setting | None  # the fewest leading blocks op-level alone that fit (None: op-level alone cannot)
    op_level: bool = True  # whether op-level settings were searched (``op_level_runs``)

    def describe(self, plan: Plan) -> str:
        """What ``plan`` checkpoints, the setting chosen on the start plan, and what full alone and op-level alone
        would cost there (the plan's own may differ: each setting's groupings were searched, the fastest kept)."""
        ours = Setting(len(plan.activation_checkpointing), len(plan.selective_checkpointing))
        best = self.tried[self.setting]
        parts = [f"checkpointing: {ours.describe(self.policy)} of the first blocks; on {self.start}'s "
                 f"grouping the fastest that fits of {len(self.tried)} settings simulated is "
                 f"{self.setting.describe(self.policy)}"]
        for label, s in (("full alone", self.full_only), ("op-level alone", self.op_only)):
            if s is not None and s != self.setting:
                step = self.tried[s].report.step_time
                parts.append(f"{label} ({s.describe(self.policy)}) {step / best.report.step_time - 1:+.1%}")
        if not self.op_level:  # (said: a trial read "of 2 settings" with no word on why none was op-level)
            keeps_none = next((p for p in SacPolicy if OpClass.TOPK not in POLICIES[p].saves), None)
            parts.append(f"op-level not tried: a block's router modifies in place the topk outputs the "
                         f"{self.policy.value} save list keeps, which torch refuses" +
                         (f" (--ac-policy {keeps_none.value} keeps none)" if keeps_none else ""))
        return "; ".join(parts)


def op_level_runs(trace: Trace, blocks: list[str], policy: SacPolicy) -> bool:
    """Whether every block of ``blocks`` can be checkpointed op-level with ``policy``: op-level checkpointing fails on
    one whose router modifies the topk outputs the policy saves (``check_checkpointing``)."""
    return not any(modified_topk(trace, b, policy) for b in blocks)


class CheckpointSearch:
    """The fastest setting of full and op-level checkpointing of the leading blocks that lets ``start`` fit."""

    def __init__(self, ev: Evaluator, blocks: list[str], start: Candidate, policy: SacPolicy,
                 op_level: bool = True) -> None:
        """``op_level``: whether op-level settings are searched (not where a block's router modifies the topk
        outputs the policy saves: ``op_level_runs``)."""
        self.ev, self.blocks, self.start, self.policy, self.op_level = ev, blocks, start, policy, op_level
        self.tried: dict[Setting, Candidate] = {}

    def choose(self, fewest_full: int) -> Choice:
        """The fastest fitting setting (ties: less memory, then fewer full blocks); ``fewest_full``: the fewest
        leading blocks that fit in full alone, always a candidate."""
        full_only = Setting(fewest_full, 0)
        self._try(full_only)
        grid = sorted({round(i * fewest_full / (GRID - 1)) for i in range(GRID)})
        best = min(filter(None, map(self._rank, grid)), default=None)
        step = max(1, fewest_full // (2 * (GRID - 1)))
        while best is not None and step >= 1:
            around = [self._rank(k) for k in (best[-1] - step, best[-1] + step) if 0 <= k <= fewest_full]
            moved = min(filter(None, [best, *around]))
            if moved == best:  # a step that pays is taken again before halving: the fastest setting can lie a
                step //= 2  # few grid steps off (llama3-8b at batch 2 on 8 GPUs: 7 full, between 6 and 13)
            best = moved
        chosen = self._least_op(best[-1]) if best is not None else None
        if chosen is None or self._key(full_only) <= self._key(chosen):
            chosen = full_only
        return Choice(chosen, self.policy, self.start.origin, self.tried, full_only, self._least_op(0), self.op_level)

    def _rank(self, full: int) -> tuple | None:
        """The ranking key of the fastest setting with ``full`` blocks in full (None: none fits); it ends in
        ``full``."""
        s = self._least_op(full)
        return None if s is None else self._key(s)

    def _key(self, s: Setting) -> tuple:
        """Over the budget last, then faster (equal up to float noise), less memory, fewer blocks in full."""
        r = self.tried[s].report
        return (not self.ev.fits(self.tried[s]), float(f"{r.step_time:.9g}"), r.reserved_memory, s.full)

    def _least_op(self, full: int) -> Setting | None:
        """The fewest op-level blocks after the first ``full`` in full that fit; None when even all do not."""
        lo, hi = 0, len(self.blocks) - full if self.op_level else 0
        if not self._fits(Setting(full, hi)):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self._fits(Setting(full, mid)):
                hi = mid
            else:
                lo = mid + 1
        return Setting(full, lo)

    def _fits(self, s: Setting) -> bool:
        return self.ev.fits(self._try(s))

    def _try(self, s: Setting) -> Candidate:
        if s not in self.tried:
            view = setting_view(self.ev, self.blocks, s, self.policy)
            self.tried[s] = view.evaluate(self.start.plan, f"{self.start.origin} + checkpoint "
                                                           f"{s.describe(self.policy)}")
        return self.tried[s]
