"""Time of one FSDP collective (ring all-gather / reduce-scatter) on a :class:`~fsdp_planner.cluster.Cluster`.

``nbytes`` is always the FULL unsharded size S of the group, as nccl-tests reports it; N ranks take part.
NCCL's ring model, SIMPLE protocol::

    T(S, N) = base + (N - 1 - X) * hop_nvlink + X * hop_network + (N-1)/N * S / (B * eff(S))

with X = nodes spanned - 1 the ring steps that cross nodes (NCCL counts one network step per extra node) and
B the bus bandwidth of the slowest link the ring uses: NVLink on one node; min(NVLink, network share) across
nodes, where a group with r ranks per node gets min(r, NICs)/NICs of a node's network bandwidth. Each link's
B shrinks for small rings by ``(1 - ring_overhead / N)`` (fitted on nccl-tests, see ``cluster``).

Small-message efficiency: eff(S) = S / (S + S_half), S_half = the bottleneck link's ``half_bw_bytes`` (one
SIMPLE pipeline slot). Algebraically that is a fixed (N-1)/N * S_half / B on top of the latency, so the whole
model stays an alpha-beta line, ``T = alpha + (N-1)/N * S / B``, which is what :func:`alpha_beta` returns and
what calibration fits. We model SIMPLE only (no LL/LL128 switch): its latency constants reproduce NCCL 2.27's
published figures, at the price of overestimating sub-10 us collectives that NCCL would run with LL.

Calibrated clusters carry measured (alpha, B) per (collective, N); a matching N uses them verbatim, other N
scale the analytic model by the measured/model ratios of the nearest fitted sizes (same one-node/multi-node
regime only), interpolated in log N.
"""

from __future__ import annotations

import math
import re

from fsdp_planner.cluster import COLLECTIVES, Cluster
from fsdp_planner.errors import PlannerError


def _kind(kind: str) -> str:
    k = kind.strip().lower().replace("-", "_")
    if k in ("allgather", "reducescatter"):
        k = "all_gather" if k == "allgather" else "reduce_scatter"
    if k not in COLLECTIVES:
        raise PlannerError(f"Unknown collective '{kind}': use one of {', '.join(COLLECTIVES)}.")
    return k


def group_layout(
    cluster: Cluster, ranks: int | None = None, ranks_per_node: int | None = None
) -> tuple[int, int, int]:
    """(N, ranks per node, nodes spanned) of a process group, checked against the cluster.

    By default the group is packed: as many ranks per node as fit (FSDP shard groups and
    ``reshard_after_forward=k`` sub-groups are contiguous ranks). An HSDP replica group is strided: pass
    ``ranks_per_node=1``.
    """
    n = cluster.world_size if ranks is None else ranks
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlannerError(f"A process group needs a positive whole number of ranks, got {ranks!r}.")
    if n > cluster.world_size:
        raise PlannerError(
            f"A group of {n} ranks does not fit cluster {cluster.name} of {cluster.world_size} GPUs."
        )
    rpn = min(n, cluster.gpus_per_node) if ranks_per_node is None else ranks_per_node
    if isinstance(rpn, bool) or not isinstance(rpn, int) or not 1 <= rpn <= min(n, cluster.gpus_per_node):
        raise PlannerError(
            f"ranks_per_node must be between 1 and {min(n, cluster.gpus_per_node)} for a group of {n} ranks "
            f"on {cluster.gpus_per_node}-GPU nodes, got {ranks_per_node!r}."
        )
    nodes = -(-n // rpn)
    if nodes > cluster.nodes:
        raise PlannerError(
            f"A group of {n} ranks with {rpn} per node spans {nodes} nodes but cluster {cluster.name} has "
            f"{cluster.nodes}."
        )
    return n, rpn, nodes


def model_alpha_beta(
    cluster: Cluster, ranks: int | None = None, ranks_per_node: int | None = None
) -> tuple[float, float]:
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
        inter_bw = cluster.inter.bus_bandwidth * share * (1 - cluster.inter.ring_overhead / n)
        used.append((cluster.inter, inter_bw))
    base = max(link.base_latency for link, _ in used)
    latency = base + intra_steps * cluster.intra.hop_latency + inter_steps * cluster.inter.hop_latency
    link, bw = min(used, key=lambda u: u[1])
    # eff(S) = S/(S+S_half) folded into alpha: (N-1)/N * S_half / B (zero for an infinite-bandwidth link).
    alpha = latency + (n - 1) / n * link.half_bw_bytes / bw
    return alpha, bw


def _regime_single_node(cluster: Cluster, n: int) -> bool:
    """Calibration logs are packed runs: N ranks fit one node iff N <= gpus_per_node."""
    return n <= cluster.gpus_per_node


def alpha_beta(
    cluster: Cluster, kind: str = "all_gather", ranks: int | None = None, ranks_per_node: int | None = None
) -> tuple[float, float]:
    """(alpha seconds, bus bandwidth bytes/s) used for ``kind`` on this group: calibrated when possible.

    Fits of the other collective are used when ``kind`` has none for this group's regime (one node or
    several): ring all-gather and reduce-scatter move the same bytes over the same steps.
    """
    k = _kind(kind)
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    model = model_alpha_beta(cluster, n, rpn)
    if n == 1:
        return model
    single = nodes == 1
    other = "reduce_scatter" if k == "all_gather" else "all_gather"
    same: dict[int, tuple[float, float]] = {}
    for name in (k, other):
        table = cluster.fits.get(name, {})
        same = {m: ab for m, ab in table.items() if _regime_single_node(cluster, m) == single}
        if same:
            break
    if not same:
        return model
    packed = rpn == min(n, cluster.gpus_per_node)
    if n in same and packed:
        return same[n]
    # Scale the model by measured/model ratios at the nearest fitted sizes, interpolated in log N.
    ratios = {}
    for m, (a_fit, b_fit) in same.items():
        a_mod, b_mod = model_alpha_beta(cluster, m)
        ratios[m] = (a_fit / a_mod if a_mod > 0 else 1.0, b_fit / b_mod if math.isfinite(b_mod) else 1.0)
    sizes = sorted(ratios)
    lo = max((m for m in sizes if m <= n), default=sizes[0])
    hi = min((m for m in sizes if m >= n), default=sizes[-1])
    if lo == hi:
        ra, rb = ratios[lo]
    else:
        t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        ra = math.exp((1 - t) * math.log(ratios[lo][0]) + t * math.log(ratios[hi][0]))
        rb = math.exp((1 - t) * math.log(ratios[lo][1]) + t * math.log(ratios[hi][1]))
    return model[0] * ra, model[1] * rb


def collective_time(
    cluster: Cluster,
    kind: str,
    nbytes: float,
    ranks: int | None = None,
    ranks_per_node: int | None = None,
) -> float:
    """Seconds for one ``kind`` collective of ``nbytes`` (full unsharded size) over ``ranks`` ranks.

    ``ranks`` defaults to the world; ``ranks_per_node`` to a packed group (see :func:`group_layout`).
    Zero bytes or a single rank cost nothing (NCCL returns at once).
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or not nbytes >= 0:
        raise PlannerError(f"A collective needs a non-negative byte count, got {nbytes!r}.")
    alpha, bw = alpha_beta(cluster, kind, ranks, ranks_per_node)
    n = cluster.world_size if ranks is None else ranks
    if nbytes == 0 or n == 1:
        return 0.0
    return alpha + (n - 1) / n * nbytes / bw


def bus_bandwidth_at(
    cluster: Cluster, kind: str, nbytes: float, ranks: int | None = None, ranks_per_node: int | None = None
) -> float:
    """The nccl-tests "busbw" the model predicts at this size: (N-1)/N * S / T."""
    n = cluster.world_size if ranks is None else ranks
    t = collective_time(cluster, kind, nbytes, ranks, ranks_per_node)
    return (n - 1) / n * nbytes / t if t > 0 else 0.0


def bandwidth_saturation_bytes(
    cluster: Cluster, ranks: int | None = None, ranks_per_node: int | None = None, kind: str = "all_gather"
) -> float:
    """Size S where the latency and bandwidth terms are equal: below it a collective is latency-bound.

    At S the achieved busbw is half the peak; 9*S reaches 90%. Buckets much smaller than S waste the link.
    """
    alpha, bw = alpha_beta(cluster, kind, ranks, ranks_per_node)
    n = cluster.world_size if ranks is None else ranks
    if n == 1 or alpha == 0:
        return 0.0
    return alpha * bw * n / (n - 1)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4,  # bare letters are binary, as in nccl-tests -b/-e
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}


def parse_size(text: str) -> int:
    """Bytes from ``1GiB``, ``512MB``, ``1e9``, ``8G`` (bare K/M/G/T are binary, as in nccl-tests -e 8G)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise PlannerError(
            f"Cannot read the size '{text}': use a number with an optional unit such as 1GiB, 512MB, "
            "64KiB or 1e9."
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise PlannerError(f"The size '{text}' is too large.")
    return round(value)
