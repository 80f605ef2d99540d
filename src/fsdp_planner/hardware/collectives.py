"""NCCL's model of one FSDP collective (ring all-gather / reduce-scatter / all-reduce) on a ``Cluster``: the
fitted and modelled lines behind ``cost.py``'s ``CollectiveCost`` (which also reads measured tables first).

``nbytes`` is always the FULL unsharded size S of the group, as nccl-tests reports it; N ranks take part.
NCCL's ring model (src/graph/tuning.cc) gives each protocol p (LL, LL128, SIMPLE) a line::

    T_p(S, N) = base_p + k * ((N - 1 - X) * hop_nvlink_p + X * hop_network_p) + k * (N-1)/N * S / B_p

with X = nodes spanned - 1 the ring steps that cross nodes (NCCL counts one network step per extra node), k = 1
for all-gather and reduce-scatter and 2 for all-reduce (a reduce-scatter then an all-gather: twice the steps and
twice the bytes per rank), and NCCL runs the protocol whose line is lowest at that size (``cost.py`` picks it).

SIMPLE reads the cluster's links: B the bus bandwidth of the slowest link the ring uses (NVLink on one node;
min(NVLink, network share) across nodes, where a group with r ranks per node gets min(r, NICs)/NICs of a node's
network bandwidth), shrunk for small rings by ``(1 - ring_overhead / N)`` (fitted on nccl-tests, see
``cluster.py``), plus a small-message term: eff(S) = S / (S + S_half) with S_half the link's ``half_bw_bytes``
(one SIMPLE pipeline slot), algebraically a fixed (N-1)/N * S_half / B on top of the latency. On the presets
its constants are NCCL's: the 2x8 / 8x8 / 32x8 H100 all-gathers cost 70 / 297 / 1204 us of latency.

LL and LL128 (``PROTOCOLS``) scale the same links by NCCL's ratios: latencies base 6.6 / 14 us and per hop
0.6 / 1.9 us over NVLink (LL's x1.8 when the ring spans nodes) and 2.7 / 4.0 us over the network, against
SIMPLE's 8.4, 3.4 and 14; bandwidth LL 1/3 of SIMPLE's on one node and 1/4 across nodes (half of each 8-byte
line is a flag) capped by NCCL's ``llMaxBws`` (H100: 141 / 45 / 35 GB/s on one / two / more nodes), LL128 0.92
(0.7 with one rank per node). So a few-KB collective runs with LL at a third of
SIMPLE's latency, and LL128 takes over in between. NCCL's per-channel cap on LL128 bandwidth and its tree and
NVLS algorithms are not modelled (ring only, what FSDP's all-gather and reduce-scatter use).

Calibrated clusters carry measured (alpha, B) per (collective, N); every protocol's line is scaled by the
measured/SIMPLE-model ratios (so a matching N reproduces the fit verbatim for large messages); other N scale by
the ratios of the nearest fitted sizes (same one-node/multi-node regime only), interpolated in log N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import COLLECTIVES, CollectiveKind
from fsdp_planner.hardware.cluster import Cluster, Engine


class Protocol(Enum):
    """NCCL's protocols: LL (8-byte lines with a flag, lowest latency), LL128 (128-byte lines), SIMPLE (bulk)."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


@dataclass(frozen=True)
class ProtocolModel:
    """One protocol relative to SIMPLE (which the cluster's links describe), from NCCL's tuning.cc: its ring
    latencies (baseLat, hwLat[NVLINK], hwLat[NET]) over SIMPLE's, and its bus bandwidth over SIMPLE's."""

    base: float
    nvlink_hop: float
    network_hop: float
    nvlink_hop_across_nodes: float  # extra factor on the NVLink hops when the ring spans nodes (LL: 1.8)
    bandwidth_one_node: float
    bandwidth_nodes: float
    bandwidth_one_rank_per_node: float
    pipelined: bool  # SIMPLE's small-message term (the half-bandwidth slot) applies


# NCCL tuning.cc (2.19-2.30), ring: baseLat LL/LL128/SIMPLE 6.6/14/8.4 us; hwLat NVLink .6/1.9/3.4, network
# 2.7/4.0/14 us; LL bandwidth x1/3 (one node) or x1/4; LL128 x0.92 (x0.7 when ppn < 2).
PROTOCOLS: dict[Protocol, ProtocolModel] = {
    Protocol.LL: ProtocolModel(6.6 / 8.4, 0.6 / 3.4, 2.7 / 14, 1.8, 1 / 3, 1 / 4, 1 / 4, False),
    Protocol.LL128: ProtocolModel(14 / 8.4, 1.9 / 3.4, 4.0 / 14, 1.0, 0.92, 0.92, 0.7, False),
    Protocol.SIMPLE: ProtocolModel(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, True),
}
# NCCL's cap on LL's bus bandwidth (llMaxBws, GB/s) on one node, two nodes, more, by GPU generation; a GPU this
# table does not name is treated as Hopper.
LL_MAX_BUS_BANDWIDTH = {"A100": (87.7e9, 22.5e9, 19.0e9), "H100": (141e9, 45e9, 35e9), "H200": (141e9, 45e9, 35e9),
                        "B200": (282e9, 90e9, 70e9)}


class ProtocolLine(NamedTuple):
    """One protocol's time line for a collective on a group: T = alpha + (N-1)/N * S / bus_bandwidth."""

    protocol: Protocol
    alpha: float  # seconds
    bus_bandwidth: float  # bytes/s


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


def model_lines(cluster: Cluster, ranks: int | None = None, ranks_per_node: int | None = None,
                steps: int = 1) -> list[ProtocolLine]:
    """The preset (uncalibrated) ring model, one line per protocol; ``steps`` 2 for an all-reduce (module doc)."""
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    if n == 1:
        return [ProtocolLine(Protocol.SIMPLE, 0.0, math.inf)]
    if cluster.engine is Engine.HOST:  # gloo: one algorithm, no NCCL protocols; calibrate fits this line as it is
        link = cluster.inter if nodes > 1 else cluster.intra
        return [ProtocolLine(Protocol.SIMPLE, link.base_latency, link.bus_bandwidth / steps)]
    inter_steps = nodes - 1
    intra_steps = n - 1 - inter_steps
    used = []  # (link, its SIMPLE bus bandwidth for this ring)
    if rpn > 1:
        used.append((cluster.intra, cluster.intra.bus_bandwidth * (1 - cluster.intra.ring_overhead / n)))
    if nodes > 1:
        share = min(rpn, cluster.nics_per_node) / cluster.nics_per_node
        used.append((cluster.inter, cluster.inter.bus_bandwidth * share * (1 - cluster.inter.ring_overhead / n)))
    base = max(link.base_latency for link, _ in used)
    link, bw = min(used, key=lambda u: u[1])
    lines: list[ProtocolLine] = []
    for protocol, m in PROTOCOLS.items():
        intra_hop = cluster.intra.hop_latency * m.nvlink_hop * (m.nvlink_hop_across_nodes if nodes > 1 else 1.0)
        hops = intra_steps * intra_hop + inter_steps * cluster.inter.hop_latency * m.network_hop
        share = m.bandwidth_one_rank_per_node if rpn == 1 else m.bandwidth_nodes if nodes > 1 else \
            m.bandwidth_one_node
        bw_p = bw * share
        if protocol is Protocol.LL:
            bw_p = min(bw_p, _ll_cap(cluster, nodes))
        bw_p /= steps
        latency = base * m.base + steps * hops
        if m.pipelined:  # eff(S) = S/(S+S_half) folded into alpha: (N-1)/N * S_half / B (zero on an ideal link)
            latency += steps * (n - 1) / n * link.half_bw_bytes / bw
        lines.append(ProtocolLine(protocol, latency, bw_p))
    return lines


def _ll_cap(cluster: Cluster, nodes: int) -> float:
    caps = next((c for name, c in LL_MAX_BUS_BANDWIDTH.items() if cluster.gpu.name.upper().startswith(name)),
                LL_MAX_BUS_BANDWIDTH["H100"])
    return caps[min(nodes, 3) - 1]


def model_alpha_beta(cluster: Cluster, ranks: int | None = None,
                     ranks_per_node: int | None = None) -> tuple[float, float]:
    """The preset SIMPLE line of an all-gather or reduce-scatter as (alpha seconds, bus bandwidth bytes/s)."""
    _, alpha, bw = _simple(model_lines(cluster, ranks, ranks_per_node))
    return alpha, bw


def _simple(lines: list[ProtocolLine]) -> ProtocolLine:
    return next(line for line in lines if line.protocol is Protocol.SIMPLE)


def alpha_beta(cluster: Cluster, kind: str | CollectiveKind = CollectiveKind.ALL_GATHER, ranks: int | None = None,
               ranks_per_node: int | None = None) -> tuple[float, float]:
    """(alpha seconds, bus bandwidth bytes/s) of the SIMPLE protocol for ``kind`` on this group: the large-message
    line, what calibration fits (calibrated when possible; ``lines`` has every protocol)."""
    _, alpha, bw = _simple(lines(cluster, kind, ranks, ranks_per_node))
    return alpha, bw


def lines(cluster: Cluster, kind: str | CollectiveKind = CollectiveKind.ALL_GATHER, ranks: int | None = None,
          ranks_per_node: int | None = None) -> list[ProtocolLine]:
    """Every protocol's line for ``kind`` on this group; calibrated (fits for its regime), the fitted line alone.

    Fits of the other collective are used when ``kind`` has none for this group's regime (one node or
    several): ring all-gather and reduce-scatter move the same bytes over the same steps; an all-reduce is
    costed as a reduce-scatter and an all-gather (its fits are not used).
    """
    k = CollectiveKind.parse(kind)
    steps = 2 if k is CollectiveKind.ALL_REDUCE else 1
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    model = model_lines(cluster, n, rpn, steps)
    if n == 1:
        return model
    same: dict[int, tuple[float, float]] = {}
    own = () if k is CollectiveKind.ALL_REDUCE else (k.value,)
    measured = cluster.measured_on()  # calibration logs are packed runs on whole nodes, whatever view reads them
    for name in (*own, *(c for c in COLLECTIVES if c not in (k.value, CollectiveKind.ALL_REDUCE.value))):
        same = {m: ab for m, ab in cluster.fits.get(name, {}).items()
                if (m <= measured.gpus_per_node) == (nodes == 1)}
        if same:
            break
    if not same:
        return model
    if n in same and measured is cluster and rpn == min(n, cluster.gpus_per_node):
        ra, rb = _ratio(cluster, n, same[n])
    else:  # a view's group spanning nodes is looked up as the packed run over as many whole nodes
        ra, rb = _fit_ratio(measured, same, n if measured is cluster or nodes == 1 else nodes * measured.gpus_per_node)
    # the fitted line alone: a log's small sizes took the fitted latency under whichever protocol NCCL chose, so
    # the model's faster LL lines, scaled by the large-message line's ratios, would undercut what was measured
    # (a log of 28-30 us at 64 KiB was costed 10 us)
    return [ProtocolLine(p, alpha * ra, bw * rb) for p, alpha, bw in model if p is Protocol.SIMPLE]


def _ratio(cluster: Cluster, m: int, fit: tuple[float, float]) -> tuple[float, float]:
    """Measured/model (alpha, bandwidth) at ``m`` packed ranks."""
    a_mod, b_mod = model_alpha_beta(cluster, m)
    return fit[0] / a_mod if a_mod > 0 else 1.0, fit[1] / b_mod if math.isfinite(b_mod) else 1.0


def _fit_ratio(cluster: Cluster, fits: dict[int, tuple[float, float]], n: int) -> tuple[float, float]:
    """Measured/model (alpha, bandwidth) ratios at ``n`` ranks, interpolated in log N between the nearest fitted
    sizes: geometrically, or linearly when a fit has zero latency (the fitter's floor)."""
    ratios = {m: _ratio(cluster, m, fit) for m, fit in fits.items()}
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
