"""What the CUDA caching allocator reserves for the loss region's few large blocks, beyond their live bytes.

A language model's loss works on a handful of blocks each the size of the logits (bf16 logits, their fp32 copy,
log-softmax's output, the loss's gradient in fp32, then in bf16): several GiB each at 8B scale, and made and freed
in an order that can leave a freed block too small for the next one. The allocator serves a request from the
smallest free block of the stream's pool that fits it (best fit, ties to the lower address: ``BlockComparatorSize``
in ``c10/cuda/CUDACachingAllocator.cpp``), splitting it; with ``expandable_segments:True`` (torchtitan's launch
script) a request no free block fits maps new pages at the end of the stream's one segment (or extends its free
tail), and freed blocks stay mapped, merged with free neighbours, until ``empty_cache()``. So the loss region can
reserve more than it ever holds live: e.g. torchtitan's ``cross_entropy(pred.flatten(0, 1).float(), labels)``
frees the bf16 logits and their fp32 copy together when the loss returns (a hole of 1.5 logits in fp32), the
loss's fp32 gradient takes one fp32 logits of it, and log-softmax's backward output, another, no longer fits the
0.5 left: the segment grows by it, and the bf16 logits' bytes stay reserved unused (3.9 GiB at batch 2 x 8192 x
128,256).

``loss_region_slack`` replays the trace's loss-region blocks (``Trace.loss_blocks``) through that policy, on top of
whatever lies below them (taken as packed: the step's other memory is not replayed block by block, so holes it
leaves are not counted), and gives, at each event, the bytes the region's segment extent has reached beyond the
bytes live then. Request rounding (512 bytes) is left out: it is nothing beside blocks of GiB.
"""

from __future__ import annotations

import bisect

import numpy as np

from fsdp_planner.trace.records import Trace


class BestFitSegment:
    """One stream's expandable segment: best-fit allocation from its free blocks, growth at its end."""

    def __init__(self) -> None:
        self.top = 0  # the segment's mapped extent: what it reserves
        self.live = 0
        self._free: list[tuple[int, int]] = []  # (start, size), sorted by start, never adjacent
        self._used: dict[int, tuple[int, int]] = {}  # block id -> (start, size)

    def allocate(self, key: int, size: int) -> None:
        fits = [(s, start) for start, s in self._free if s >= size]
        if fits:
            s, start = min(fits)
            k = bisect.bisect_left(self._free, (start, s))
            del self._free[k]
            if s > size:
                self._free.insert(k, (start + size, s - size))
        elif self._free and sum(self._free[-1]) == self.top:  # a free tail: extend it
            start, _ = self._free.pop()
            self.top = start + size
        else:
            start, self.top = self.top, self.top + size
        self._used[key] = (start, size)
        self.live += size

    def free(self, key: int) -> None:
        start, size = self._used.pop(key)
        self.live -= size
        k = bisect.bisect_left(self._free, (start, size))
        if k < len(self._free) and start + size == self._free[k][0]:  # merge with the next free block
            size += self._free.pop(k)[1]
        if k > 0 and sum(self._free[k - 1]) == start:  # and with the previous one
            start, prev = self._free.pop(k - 1)
            start, size, k = start, prev + size, k - 1
        self._free.insert(k, (start, size))


def loss_region_slack(trace: Trace, scale: float) -> np.ndarray:
    """Per event position (``len(events) + 1`` of them), the loss region's reserved extent so far less its live
    bytes (at the compute dtype's sizes, ``scale``): zero outside the region."""
    n = len(trace.events) + 1
    slack = np.zeros(n)
    region = [i for i, inside in enumerate(trace.index.loss_region) if inside]
    if not region or not trace.loss_blocks:
        return slack
    first, last = region[0], region[-1]
    made: dict[int, list[int]] = {}
    freed: dict[int, list[int]] = {}
    for key, (born, end, _) in enumerate(trace.loss_blocks):
        if 0 <= end <= born:  # made and freed within one op: never beside the next op's blocks
            continue
        made.setdefault(max(born, first), []).append(key)
        if end >= 0:
            freed.setdefault(max(end, first), []).append(key)
    seg = BestFitSegment()
    alive: set[int] = set()
    for pos in range(first, last + 1):
        for key in freed.get(pos, ()):  # freed before this event's allocations
            if key in alive:
                seg.free(key)
                alive.discard(key)
        for key in made.get(pos, ()):
            seg.allocate(key, round(trace.loss_blocks[key][2] * scale))
            alive.add(key)
        if trace.index.loss_region[pos]:
            slack[pos] = seg.top - seg.live
    return slack
