"""The searches behind ``fit``: the largest workload, or the fewest nodes, for which auto's best plan fits.

Both rely on one fact instead of trying every value: the reserved peak of the best plan is monotone. It grows with
the per-GPU batch and the sequence length (activations, and the logits and loss buffers, grow with the tokens a
rank holds; the sharded state does not change), and it falls as nodes are added (params, grads and optimizer state
divide by the world size; the activations of a rank do not change). So when a value fits every smaller workload
(every larger node count) fits too, and doubling then bisection finds the boundary in about 2 log2(answer)
evaluations, each a trace and an auto search. Each function takes ``fits``, which evaluates one value (the caller
caches and reports every evaluation), and returns the boundary or None when not even the smallest value fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FitPoint:
    """One evaluated workload and world: auto's best plan for it, simulated (the plan's own figures, as ``plan
    --policy auto`` prints them for the same ``--batch``, ``--seq`` and ``--cluster``)."""

    batch: int  # per GPU (per data-parallel rank under ``--tp``: ``batch_ranks``)
    seq: int
    gpus: int
    nodes: int
    fits: bool  # auto found a plan within the budget
    step_time: float  # seconds (of the plan auto chose; when nothing fits, of the plan closest to fitting)
    reserved_memory: int  # bytes per rank
    budget: int
    model_flops: int  # FLOPs of one rank's step without recomputation (forward + backward as traced)
    peak_flops: float  # one GPU's dense peak in the compute dtype
    layout: str  # REPLICATExSHARD, with " EP N" under expert parallelism
    checkpointed: int  # modules auto checkpoints in full
    offload: bool = False  # auto turned CPUOffloadPolicy on (nothing fit without it)
    offloaded: int = 0  # modules whose saved activations auto offloads (its very last resort)
    complete: bool = True  # False: searched without CPU offload only, which did not fit (whether offload would
    # was not asked: the answer sought was the largest workload without it)
    op_level: int = 0  # modules auto checkpoints op by op (selective)
    batch_ranks: int = 1  # the GPUs one ``batch`` is shared by: the TP degree where ``--tp`` makes the batch one
    # data-parallel rank's (torchtitan's local batch), else 1 (``batch`` and ``model_flops`` are then one GPU's)

    @property
    def tokens_per_gpu(self) -> float:
        """Tokens per second per GPU: the batch x seq over the step time, over the GPUs sharing it."""
        return self.batch * self.seq / self.step_time / self.batch_ranks if self.step_time > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: one GPU's share of the step's model FLOPs over its peak for the step time
        (recomputed forwards are not model FLOPs, so checkpointing lowers it)."""
        return self.model_flops / self.batch_ranks / (self.step_time * self.peak_flops) if self.step_time > 0 \
            else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "seq": self.seq, "gpus": self.gpus, "nodes": self.nodes, "fits": self.fits,
                "step_time": self.step_time, "reserved_memory": self.reserved_memory, "budget": self.budget,
                "margin": self.budget - self.reserved_memory, "tokens_per_second_per_gpu": self.tokens_per_gpu,
                "tokens_per_second": self.tokens_per_gpu * self.gpus, "mfu": self.mfu, "layout": self.layout,
                "checkpointed": self.checkpointed, "op_level_checkpointed": self.op_level, "offload": self.offload,
                "activations_offloaded": self.offloaded, "offload_tried": self.complete or self.fits,
                "batch_ranks": self.batch_ranks}


def largest_fitting(fits: Callable[[int], bool], start: int, cap: int, step: int = 1, parts: int = 0) -> int | None:
    """The largest multiple of ``step`` (or ``start`` itself) up to ``cap`` that fits: from ``start``, doubling
    while it fits (halving while it does not, down to ``step``), then bisection between the last value that fits
    and the first that does not, to ``step`` or (``parts``) to that value / ``parts``, whichever is coarser.
    None: not even the smallest value tried fits."""
    lo, hi = _bracket_up(fits, start, cap, step)
    if lo is None or hi is None:
        return lo
    resolution = max(step, lo // parts if parts else 0)
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _bracket_up(fits: Callable[[int], bool], start: int, cap: int, step: int) -> tuple[int | None, int | None]:
    """(a value that fits, a larger one that does not) around the boundary; (the cap, None) when the cap fits,
    (None, None) when nothing from ``step`` up fits."""
    value = min(start, cap)
    if fits(value):
        while value < cap:
            nxt = min(value * 2, cap)
            if not fits(nxt):
                return value, nxt
            value = nxt
        return value, None
    miss = value
    while value > step:
        value = max(step, value // 2 // step * step)
        if fits(value):
            return value, miss
        miss = value
    return None, None


def smallest_fitting(fits: Callable[[int], bool], cap: int) -> int | None:
    """The smallest count from 1 to ``cap`` that fits: doubling from 1 until it fits, then bisection between the
    last count that did not fit and the first that did. None: not even ``cap`` fits."""
    miss, value = 0, 1
    while not fits(value):
        if value >= cap:
            return None
        miss, value = value, min(value * 2, cap)
    return _bisect(fits, miss, value)


def largest_confirmed(screen: Callable[[int], bool], fits: Callable[[int], bool], start: int, cap: int,
                      step: int = 1, parts: int = 0) -> int | None:
    """``largest_fitting`` by ``fits``, found with ``screen`` (a cheaper test that never says a value fits where
    ``fits`` does not) and confirmed with ``fits`` on both sides: the screen's answer fits, and the next value at
    the search's resolution does not. Where the screen was pessimistic, ``fits`` searches on from there (each
    ``fits`` call is the expensive one: two of them in the usual case)."""
    guess = largest_fitting(screen, start, cap, step, parts)
    if guess is None:
        low = min(step, cap)  # the smallest value the screen tried
        return largest_fitting(fits, low, cap, step, parts) if fits(low) else None
    if not fits(guess):  # the screen was wrong (it should not be): search with the real test
        return largest_fitting(fits, start, guess, step, parts)
    if guess >= cap:
        return guess
    nxt = min(cap, guess + max(step, (guess // parts) // step * step if parts else step))
    return guess if not fits(nxt) else largest_fitting(fits, nxt, cap, step, parts)


def smallest_confirmed(screen: Callable[[int], bool], fits: Callable[[int], bool], cap: int) -> int | None:
    """``smallest_fitting`` by ``fits`` (monotone), found with ``screen`` (never True where ``fits`` is False) and
    confirmed with ``fits``: the answer fits and the count below it does not."""
    guess = smallest_fitting(screen, cap)
    if guess is None:  # the screen fits nowhere: ``fits`` is monotone too, so when ``cap`` does not fit nothing does
        # (llama3-405b's offload verdict on h100:64: one full search at 1,024 GPUs, not one at each doubling)
        if not fits(cap):
            return None
        guess = cap
    elif not fits(guess):  # the screen was wrong (it should not be): search with the real test
        return smallest_fitting(fits, cap)
    return smallest_below(fits, guess)


def below_by_powers(fits: Callable[[int], bool], found: int, probes: list[int]) -> int:
    """``found`` (a count that fits, the monotone searches' answer), or a smaller one: the smallest of ``probes``
    (counts where a layout's degrees divide well, powers of two) below it that fits, and below that as
    ``smallest_below`` finds. Where fitting is not monotone (a count no degree divides fits worse than a smaller
    one), the searches above stop at the wrong side of such a count."""
    lower = next((i for i in sorted(probes) if i < found and fits(i)), None)
    return found if lower is None else smallest_below(fits, lower)


def smallest_below(fits: Callable[[int], bool], value: int) -> int:
    """The smallest count that fits, given that ``value`` fits: galloping down from it (value - 1, - 2, - 4, ...)
    to the first count that does not fit, then bisection. Where the screen was pessimistic it missed by little, so
    this asks ``fits`` (the expensive test) a few times near the answer, where doubling up from 1 would ask it at
    every power of two below."""
    step, miss = 1, 0
    while value > 1:
        probe = max(1, value - step)
        if not fits(probe):
            miss = probe
            break
        value, step = probe, step * 2
    return _bisect(fits, miss, value)


def _bisect(fits: Callable[[int], bool], miss: int, value: int) -> int:
    """The smallest count in (``miss``, ``value``] that fits, ``miss`` not fitting (0: none tried) and ``value``
    fitting."""
    while value - miss > 1:
        mid = (miss + value) // 2
        if fits(mid):
            value = mid
        else:
            miss = mid
    return value
