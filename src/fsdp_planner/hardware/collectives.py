"""Time of one FSDP collective (ring all-gather / reduce-scatter) on a ``Cluster``.

``nbytes`` is always the FULL unsharded size S of the group, as nccl-tests reports it; N ranks take part.
NCCL's ring model (src/graph/tuning.cc), SIMPLE protocol::

    T(S, N) = base + (N - 1 - X) * hop_nvlink + X * hop_network + (N-1)/N * S / (B * eff(S))

with X = nodes spanned - 1 the ring steps that cross nodes (NCCL counts one network step per extra node) and
B the bus bandwidth of the slowest link the ring uses: NVLink on one node; min(NVLink, network share) across
nodes, where a group with r ranks per node gets min(r, NICs)/NICs of a node's network bandwidth. Each link's
B shrinks for small rings by ``(1 - ring_overhead / N)`` (fitted on nccl-tests, see ``cluster.py``).

Small-message efficiency: eff(S) = S / (S + S_half), S_half = the bottleneck link's ``half_bw_bytes`` (one
SIMPLE pipeline slot). Algebraically that is a fixed (N-1)/N * S_half / B on top of the latency, so the whole
model stays an alpha-beta line, ``T = alpha + (N-1)/N * S / B``, which is what ``alpha_beta`` returns and what
calibration fits. SIMPLE only (no LL/LL128 switch): its latency constants give NCCL's own figures, at the price
of overestimating sub-10 us collectives that NCCL would run with LL.

Calibrated clusters carry measured (alpha, B) per (collective, N); a matching N uses them verbatim, other N
scale the analytic model by the measured/model ratios of the nearest fitted sizes (same one-node/multi-node
regime only), interpolated in log N.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING

from fsdp_planner.errors import PlannerError

if TYPE_CHECKING:
    from fsdp_planner.hardware.cluster import Cluster


class CollectiveKind(Enum):
    """The collectives FSDP2 issues per group: its params' all-gather and its grads' reduce-scatter, and with
    HSDP the all-reduce of the reduced grads across replicas."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    @classmethod
    def parse(cls, text: str | CollectiveKind) -> CollectiveKind:
        """``all-gather``, ``all_gather``, ``allgather`` (and the reduce-scatter spellings)."""
        if isinstance(text, CollectiveKind):
            return text
        k = text.strip().lower().replace("-", "_")
        k = {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}.get(k, k)
        try:
            return cls(k)
        except ValueError:
            raise PlannerError(f"unknown collective '{text}': use one of {', '.join(COLLECTIVES)}") from None


COLLECTIVES = tuple(k.value for k in CollectiveKind)


def group_layout(cluster: Cluster, ranks: int | None = None, ranks_per_node: int | None = None) -> tuple[int, int, int]:
    """(N, ranks per node, nodes spanned) of a process group, checked against the cluster.

    By default the group is packed: as many ranks per node as fit (FSDP shard groups and
    ``reshard_after_forward=k`` sub-groups are contiguous ranks). An HSDP replica group is strided: pass
    ``ranks_per_node=1``.
    """
    n = cluster.world_size if ranks is None else ranks
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlannerError(f"a process group needs a positive whole number of ranks, got {ranks!r}")
    if n > cluster.world_size:
        raise PlannerError(f"a group of {n} ranks does not fit cluster {cluster.name} of {cluster.world_size} GPUs")
    rpn = min(n, cluster.gpus_per_node) if ranks_per_node is None else ranks_per_node
    if isinstance(rpn, bool) or not isinstance(rpn, int) or not 1 <= rpn <= min(n, cluster.gpus_per_node):
        raise PlannerError(
            f"ranks_per_node must be between 1 and {min(n, cluster.gpus_per_node)} for a group of {n} ranks "
            f"on {cluster.gpus_per_node}-GPU nodes, got {ranks_per_node!r}")
    nodes = -(-n // rpn)
    if nodes > cluster.nodes:
        raise PlannerError(f"a group of {n} ranks with {rpn} per node spans {nodes} nodes but cluster "
                           f"{cluster.name} has {cluster.nodes}")
    return n, rpn, nodes


def model_alpha_beta(cluster: Cluster, ranks: int | None = None,
                     ranks_per_node: int | None = None) -> tuple[float, float]:
    """The preset (uncalibrated) ring model as (alpha seconds, bus bandwidth bytes/s); see the module doc."""
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    if n == 1:
        return 0.0, math.inf
    inter_steps = nodes - 1
    intra_steps = n - 1 - inter_steps
    used = []  # (link, its bus bandwidth for this ring)
    if rpn > 1:
        used.append((cluster.intra, cluster.intra.bus_bandwidth * (1 - cluster.intra.ring_overhead / n)))
    if nodes > 1:
        share = min(rpn, cluster.nics_per_node) / cluster.nics_per_node
        used.append((cluster.inter, cluster.inter.bus_bandwidth * share * (1 - cluster.inter.ring_overhead / n)))
    base = max(link.base_latency for link, _ in used)
    latency = base + intra_steps * cluster.intra.hop_latency + inter_steps * cluster.inter.hop_latency
    link, bw = min(used, key=lambda u: u[1])
    # eff(S) = S/(S+S_half) folded into alpha: (N-1)/N * S_half / B (zero for an infinite-bandwidth link).
    return latency + (n - 1) / n * link.half_bw_bytes / bw, bw


def alpha_beta(cluster: Cluster, kind: str | CollectiveKind = CollectiveKind.ALL_GATHER, ranks: int | None = None,
               ranks_per_node: int | None = None) -> tuple[float, float]:
    """(alpha seconds, bus bandwidth bytes/s) used for ``kind`` on this group: calibrated when possible.

    Fits of the other collective are used when ``kind`` has none for this group's regime (one node or
    several): ring all-gather and reduce-scatter move the same bytes over the same steps.
    """
    k = CollectiveKind.parse(kind)
    if k is CollectiveKind.ALL_REDUCE:
        # NCCL's ring all-reduce is a reduce-scatter then an all-gather: twice the ring steps and twice the bytes
        # per rank (nccl-tests' busbw factor 2(N-1)/N), i.e. twice the latency and half the bandwidth in this line
        alpha, bw = alpha_beta(cluster, CollectiveKind.REDUCE_SCATTER, ranks, ranks_per_node)
        return 2 * alpha, bw / 2
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    model = model_alpha_beta(cluster, n, rpn)
    if n == 1:
        return model
    same: dict[int, tuple[float, float]] = {}
    for name in (k.value, *(c for c in COLLECTIVES if c != k.value)):
        same = {m: ab for m, ab in cluster.fits.get(name, {}).items()
                if (m <= cluster.gpus_per_node) == (nodes == 1)}  # calibration logs are packed runs
        if same:
            break
    if not same:
        return model
    if n in same and rpn == min(n, cluster.gpus_per_node):
        return same[n]
    ra, rb = _fit_ratio(cluster, same, n)
    return model[0] * ra, model[1] * rb


def _fit_ratio(cluster: Cluster, fits: dict[int, tuple[float, float]], n: int) -> tuple[float, float]:
    """Measured/model (alpha, bandwidth) ratios at ``n`` ranks, interpolated in log N between the nearest fitted
    sizes: geometrically, or linearly when a fit has zero latency (the fitter's floor)."""
    ratios = {}
    for m, (a_fit, b_fit) in fits.items():
        a_mod, b_mod = model_alpha_beta(cluster, m)
        ratios[m] = (a_fit / a_mod if a_mod > 0 else 1.0, b_fit / b_mod if math.isfinite(b_mod) else 1.0)
    sizes = sorted(ratios)
    lo = max((m for m in sizes if m <= n), default=sizes[0])
    hi = min((m for m in sizes if m >= n), default=sizes[-1])
    if lo == hi:
        return ratios[lo]
    t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))

    def mix(a: float, b: float) -> float:
        if a > 0 and b > 0:
            return math.exp((1 - t) * math.log(a) + t * math.log(b))
        return (1 - t) * a + t * b

    return mix(ratios[lo][0], ratios[hi][0]), mix(ratios[lo][1], ratios[hi][1])


def collective_time(cluster: Cluster, kind: str | CollectiveKind, nbytes: float, ranks: int | None = None,
                    ranks_per_node: int | None = None) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` (full unsharded size) over ``ranks`` ranks.

    ``ranks`` defaults to the world; ``ranks_per_node`` to a packed group (see ``group_layout``). Zero bytes or
    a single rank cost nothing (NCCL returns at once).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or not nbytes >= 0:
        raise PlannerError(f"a collective needs a non-negative byte count, got {nbytes!r}")
    alpha, bw = alpha_beta(cluster, kind, ranks, ranks_per_node)
    n = cluster.world_size if ranks is None else ranks
    if nbytes == 0 or n == 1:
        return 0.0
    return alpha + (n - 1) / n * nbytes / bw


def bus_bandwidth_at(cluster: Cluster, kind: str | CollectiveKind, nbytes: float, ranks: int | None = None,
                     ranks_per_node: int | None = None) -> float:
    """The nccl-tests "busbw" the model predicts at this size, (N-1)/N * S / T (0 when nothing moves)."""
    n = cluster.world_size if ranks is None else ranks
    t = collective_time(cluster, kind, nbytes, ranks, ranks_per_node)
    return (n - 1) / n * nbytes / t if t > 0 else 0.0


def bandwidth_saturation_bytes(cluster: Cluster, ranks: int | None = None, ranks_per_node: int | None = None,
                               kind: str | CollectiveKind = CollectiveKind.ALL_GATHER) -> float:
    """Size S where the latency and bandwidth terms are equal: below it a collective is latency-bound.

    At S the achieved busbw is half the peak; 9*S reaches 90%. Buckets much smaller than S waste the link.
    """
    alpha, bw = alpha_beta(cluster, kind, ranks, ranks_per_node)
    n = cluster.world_size if ranks is None else ranks
    if n == 1 or alpha == 0:
        return 0.0
    return alpha * bw * n / (n - 1)
