"""Gradient accumulation's split, chosen by auto (``plan --micro-batches auto``): of the per-GPU batch, the number
of micro-batches whose best plan is fastest within the budget.

More micro-batches hold fewer activations (each is smaller) but all-gather every group once more per micro-batch
and keep the unsharded grads accumulated between them (``sim/simulate.py``); fewer may need activation
checkpointing to fit. Each split is traced at its micro-batch and searched in full, so the comparison is bounded
by ``MAX_SPLITS`` searches, never by time: the choice is as deterministic as each search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsdp_planner.planners.auto import AutoResult

# Splits compared at most: the smallest divisors of the batch (1, 2, 3, 4, 6, 8, 12, 16 of a batch of 48). Past
# a handful of micro-batches each one is small enough that activations no longer decide the fit, and every one
# more adds a full set of all-gathers: a bound on the searches, each as long as one auto search.
MAX_SPLITS = 8
# Without ``--micro-batches auto``, auto compares the three smallest (1, 2 and 3 or 4): the splits that beat the
# whole batch in the hand grids measured (issue 35: qwen2.5-3b batch 4 on h100:64, 2 micro-batches 7% faster), for
# at most three searches.
DEFAULT_SPLITS = 3


@dataclass(frozen=True)
class Split:
    """One split of the batch and auto's search for it."""

    micro_batches: int
    result: AutoResult


def candidate_splits(batch: int, limit: int = MAX_SPLITS) -> list[int]:
    """The micro-batch counts auto compares for a per-GPU ``batch``: its ``limit`` smallest divisors."""
    found: list[int] = []
    d = 1
    while d <= batch and len(found) < limit:
        if batch % d == 0:
            found.append(d)
        d += 1
    return found


def choose_split(batch: int, search: Callable[[int], AutoResult], limit: int = MAX_SPLITS,
                 allowed: Callable[[int], bool] = lambda n: True) -> tuple[Split, list[Split]]:
    """The fastest split whose plan fits (ties: the fewer micro-batches), else the one with the smallest peak; and
    every split tried. ``search(n)``: auto's search with ``n`` micro-batches of ``batch / n``; ``allowed(n)``:
    whether the job can run that split (one micro-batch always can)."""
    tried = [Split(n, search(n)) for n in candidate_splits(batch, limit) if n == 1 or allowed(n)]
    fitting = [s for s in tried if s.result.fits]
    if fitting:
        return min(fitting, key=lambda s: (s.result.report.step_time, s.micro_batches)), tried
    return min(tried, key=lambda s: (s.result.min_peak, s.micro_batches)), tried
