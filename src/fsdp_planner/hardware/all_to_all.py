"""What one all-to-all costs on an EP group: the dispatch and combine of expert parallelism.

NCCL has no all-to-all kernel of its own: ``all_to_all_single`` is one ``ncclGroupStart``/``End`` of an
``ncclSend`` and an ``ncclRecv`` to every peer (torch's ``ProcessGroupNCCL::alltoall_base``; NCCL's p2p, which
runs over NVLink inside a node and the NICs across nodes, both at once). nccl-tests' ``alltoall_perf`` reports
the size S as one rank's whole send buffer and busbw = algbw x (N-1)/N (its ``AlltoAllGetBw``): each rank sends
(N-1)/N of S to its peers and keeps 1/N. So for N ranks, r per node (consecutive ranks)::

    T(S) = alpha + max(S (r-1)/N / B_nvlink,  r S (N-r)/N / (B_net x min(r, NICs)/NICs))

the bytes to the r-1 peers on the node at the NVLink bus bandwidth, and all r ranks' bytes leaving the node
through the share of the node's network bandwidth their NICs give (the ``Cluster`` convention of
``collectives.py``). alpha: one SIMPLE base latency and one hop of the slowest link crossed (p2p is one step,
not a ring). No small-message protocols, and the links' fitted ring overhead is not applied (no ring).
"""

from __future__ import annotations

from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.hardware.collectives import group_layout
from fsdp_planner.hardware.cost import LinkCost


def all_to_all_cost(cluster: Cluster, ranks: int, ranks_per_node: int | None = None) -> LinkCost:
    """The line of an all-to-all over ``ranks`` ranks (``ranks_per_node`` per node, default packed): seconds for a
    send buffer of ``nbytes`` per rank are ``.seconds(nbytes)``; ``link`` the slower link it crosses."""
    n, rpn, nodes = group_layout(cluster, ranks, ranks_per_node)
    if n == 1:
        return LinkCost(0.0, 0.0, "intra")
    per_byte_intra = (rpn - 1) / n / cluster.intra.bus_bandwidth
    if nodes == 1:
        return LinkCost(cluster.intra.base_latency + cluster.intra.hop_latency, per_byte_intra, "intra")
    share = min(rpn, cluster.nics_per_node) / cluster.nics_per_node
    per_byte_inter = rpn * (n - rpn) / n / (cluster.inter.bus_bandwidth * share)
    alpha = max(cluster.intra.base_latency, cluster.inter.base_latency) + cluster.inter.hop_latency
    return LinkCost(alpha, max(per_byte_intra, per_byte_inter), "inter")
