"""The memory model's changes of level: each category's bytes up at one event position and down at another.

A plan's replay makes ~10 of them per param (each param's unsharded grad from its own first backward op), so a
group's per-param run is added in one call (``add_each``: as arrays where it is long), and all are summed per
position in one pass. A category's change at a position is the running sum of what was added there, in the order
it was added, as a per-position running total would add them: the same floats (bytes divided by a residency's
divisor are not whole), so the peaks do not depend on how the changes are stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ONE_BY_ONE = 64  # runs of changes up to this long are added one by one (``add_each``)


class Changes:
    """Changes of ``categories`` levels by event position, in the order they were added."""

    def __init__(self, categories: int) -> None:
        self.categories = categories
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (positions, categories, bytes)
        self._positions: list[int] = []  # single changes since the last chunk, kept as lists: most calls add one
        self._cats: list[int] = []
        self._bytes: list[float] = []

    def add(self, cat: int, start: int, end: int, nbytes: float) -> None:
        """``nbytes`` of category ``cat`` from position ``start`` up to (not including) ``end``."""
        self._positions += (start, end)
        self._cats += (cat, cat)
        self._bytes += (nbytes, -nbytes)

    def add_each(self, cat: int, starts: Sequence[int] | np.ndarray, end: int, nbytes: Sequence[float] | np.ndarray,
                 at_most: int) -> None:
        """``add(cat, min(s, at_most), end, b)`` for each ``s, b`` of ``starts, nbytes``, in that order: in one
        array operation when there are more than ``ONE_BY_ONE`` (below that numpy's per-call cost is the larger)."""
        k = len(starts)
        if k <= ONE_BY_ONE:
            for s, b in zip(starts, nbytes, strict=True):
                self._positions += (min(s, at_most), end)
                self._cats += (cat, cat)
                self._bytes += (b, -b)
            return
        self._flush()
        positions, values = np.empty(2 * k, dtype=np.int64), np.empty(2 * k, dtype=np.float64)
        positions[0::2], positions[1::2] = np.minimum(starts, at_most), end
        values[0::2] = nbytes
        values[1::2] = -values[0::2]
        self._chunks.append((positions, np.full(2 * k, cat, dtype=np.int64), values))

    def by_position(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions below ``n`` with changes, sorted, with position 0 always first, and each one's change per
        category (rows: positions; columns: categories)."""
        self._flush()
        positions, cats, values = (np.concatenate([c[i] for c in self._chunks]) if self._chunks
                                   else np.zeros(0, dtype=np.int64 if i < 2 else np.float64) for i in range(3))
        inside = positions < n
        positions, cats, values = positions[inside], cats[inside], values[inside]
        # (one sort for both: np.union1d's hashing and a searchsorted were each slower)
        starts, row = np.unique(np.concatenate([[0], positions]), return_inverse=True)
        row = row[1:]
        # bincount adds each weight into its bin in the order given: a running sum per (position, category)
        table = np.bincount(row * self.categories + cats, weights=values, minlength=len(starts) * self.categories)
        return starts, table.reshape(len(starts), self.categories)

    def _flush(self) -> None:
        if self._positions:
            self._chunks.append((np.array(self._positions, dtype=np.int64), np.array(self._cats, dtype=np.int64),
                                 np.array(self._bytes, dtype=np.float64)))
            self._positions, self._cats, self._bytes = [], [], []
