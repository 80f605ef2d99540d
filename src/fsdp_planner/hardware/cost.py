"""What one collective costs on one process group: the single entry point the simulator, the planner and the
``cost`` command all read (as inductor's ``comm_analysis.py`` does for its estimates).

A ``CollectiveCost`` (``collective_cost``) prices one collective kind on a group of N ranks with r per node, from
the best figure the cluster has, in this order:
1. measured: the cluster's ``tables`` (``calibrate --backend gloo``: a host-engine cluster's collectives timed over
   all its ranks as FSDP2 runs them, copy-in included), interpolated by ``table_seconds``;
2. fitted: the cluster's ``fits`` (``calibrate`` from NCCL logs: (latency, bus bandwidth) per group size), which
   scale the NCCL model's lines (``collectives.lines``);
3. modelled: NCCL's ring model with its protocols (``collectives.model_lines``, constants cited there).

Each line is ``LinkCost``: T = alpha + bytes * per_byte (``LinkCost.seconds``, the one place that formula lives),
per_byte = (N-1)/N / bus bandwidth; a size is charged at its fastest line, the protocol NCCL would pick.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.hardware.collectives import Protocol, group_layout, lines

Rows = tuple[tuple[int, float], ...]  # measured (bytes, seconds), sizes ascending


class LinkCost(NamedTuple):
    """One protocol's line for a collective: T = alpha + bytes * per_byte, its bytes queued on ``link``."""

    alpha: float  # seconds
    per_byte: float  # seconds per byte of data
    link: str  # "intra" (NVLink, or a measured host collective) | "inter" (the network)

    def transfer(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """Seconds the bytes occupy the link (what a simulator queues behind other streams' bytes)."""
        return nbytes * self.per_byte

    def seconds(self, nbytes: float | np.ndarray) -> float | np.ndarray:
        """The collective's seconds on this line: its latency, then its bytes."""
        return self.alpha + self.transfer(nbytes)


@dataclass(frozen=True)
class CollectiveCost:
    """One collective kind on one group: every protocol's line (SIMPLE last) and, where measured, its table."""

    kind: CollectiveKind
    ranks: int
    link: str  # the slowest link the group's ring crosses: "intra" on one node, "inter" across nodes
    lines: tuple[LinkCost, ...]
    protocols: tuple[Protocol, ...]  # each line's protocol
    table: Rows | None = None  # measured: preferred over the lines at any finite size

    def line(self, nbytes: float = math.inf) -> LinkCost:
        """How ``nbytes`` is charged: the measured time as a latency (no bytes to queue), or the line of the protocol
        NCCL runs at that size (default: a large message, SIMPLE)."""
        if self.table is not None and nbytes != math.inf:
            return LinkCost(table_seconds(self.table, nbytes), 0.0, self.link)
        if len(self.lines) == 1 or nbytes == math.inf:
            return self.lines[-1]
        return min(self.lines, key=lambda line: line.seconds(nbytes))

    def protocol(self, nbytes: float) -> Protocol:
        """The protocol NCCL runs at this size (a measured table: SIMPLE, gloo's only one)."""
        if self.table is not None or nbytes == 0 or self.ranks == 1:
            return Protocol.SIMPLE
        return self.protocols[self.lines.index(self.line(nbytes))]

    def seconds(self, nbytes: float) -> float:
        """Seconds for one collective of ``nbytes`` (the full unsharded size); nothing moved costs nothing."""
        if nbytes <= 0 or self.ranks == 1:
            return 0.0
        return float(self.line(nbytes).seconds(nbytes))

    def seconds_each(self, nbytes: np.ndarray) -> np.ndarray:
        """``seconds`` of every size in ``nbytes`` at once (the planner's vector work)."""
        if self.table is not None:
            best = np.array([table_seconds(self.table, float(b)) for b in np.ravel(nbytes)]).reshape(np.shape(nbytes))
        else:
            best = np.min([line.seconds(nbytes) for line in self.lines], axis=0)
        return np.where(nbytes > 0, best, 0.0)

    @property
    def latency(self) -> float:
        """The least the collective can cost: the smallest measured size's time, or the lowest-latency line's."""
        if self.table is not None:
            return self.table[0][1]
        return min(line.alpha for line in self.lines)

    @property
    def per_byte(self) -> float:
        """The best seconds per byte any line reaches (the fitted or modelled lines: a table is not a line)."""
        return min(line.per_byte for line in self.lines)

    def bus_bandwidth(self, nbytes: float) -> float:
        """The nccl-tests "busbw" at this size, (N-1)/N * S / T (0 when nothing moves)."""
        t = self.seconds(nbytes)
        return (self.ranks - 1) / self.ranks * nbytes / t if t > 0 else 0.0


def collective_cost(cluster: Cluster, kind: str | CollectiveKind, ranks: int | None = None,
                    ranks_per_node: int | None = None) -> CollectiveCost:
    """The cost of ``kind`` on a group of ``ranks`` (default: the world) with ``ranks_per_node`` per node (default:
    packed, see ``collectives.group_layout``). The cluster's measured table serves a host-engine group of all its
    ranks (what ``calibrate --backend gloo`` times); other groups use the fitted or modelled lines."""
    k = CollectiveKind.parse(kind)
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    where = "inter" if nodes > 1 else "intra"
    if n == 1:
        return CollectiveCost(k, 1, where, (LinkCost(0.0, 0.0, where),), (Protocol.SIMPLE,))
    # SIMPLE last: the large-message line
    ordered = sorted(lines(cluster, k, n, rpn), key=lambda line: line.protocol is Protocol.SIMPLE)
    rows = cluster.tables.get(k.value) if cluster.engine is Engine.HOST and n == cluster.world_size else None
    return CollectiveCost(k, n, where, tuple(LinkCost(alpha, (n - 1) / n / bw, where) for _, alpha, bw in ordered),
                          tuple(line.protocol for line in ordered), tuple(rows) if rows else None)


def table_seconds(rows: Rows | list[tuple[int, float]], nbytes: float) -> float:
    """A measured collective's seconds at ``nbytes``: linear between the measured sizes, the smallest size's time
    below them, the last two sizes' slope beyond."""
    if nbytes <= rows[0][0]:
        return rows[0][1]
    for (s0, t0), (s1, t1) in itertools.pairwise(rows):
        if nbytes <= s1:
            return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
    (s0, t0), (s1, t1) = rows[-2], rows[-1]
    return t1 + max(0.0, (t1 - t0) / (s1 - s0)) * (nbytes - s1)


def collective_time(cluster: Cluster, kind: str | CollectiveKind, nbytes: float, ranks: int | None = None,
                    ranks_per_node: int | None = None) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` (full unsharded size) over ``ranks`` ranks (default: the
    world; ``ranks_per_node`` default: packed), as the simulator charges it. Zero bytes or one rank cost nothing."""
    return protocol_for(cluster, kind, nbytes, ranks, ranks_per_node)[1]


def protocol_for(cluster: Cluster, kind: str | CollectiveKind, nbytes: float, ranks: int | None = None,
                 ranks_per_node: int | None = None) -> tuple[Protocol, float]:
    """The protocol NCCL runs for this collective (the fastest line at this size) and its seconds."""
    _check_bytes(nbytes)
    cost = collective_cost(cluster, kind, ranks, ranks_per_node)
    return cost.protocol(nbytes), cost.seconds(nbytes)


def bus_bandwidth_at(cluster: Cluster, kind: str | CollectiveKind, nbytes: float, ranks: int | None = None,
                     ranks_per_node: int | None = None) -> float:
    """The nccl-tests "busbw" the cost predicts at this size, (N-1)/N * S / T (0 when nothing moves)."""
    _check_bytes(nbytes)
    return collective_cost(cluster, kind, ranks, ranks_per_node).bus_bandwidth(nbytes)


def _check_bytes(nbytes: object) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or not nbytes >= 0:
        raise PlannerError(f"a collective needs a non-negative byte count, got {nbytes!r}")
