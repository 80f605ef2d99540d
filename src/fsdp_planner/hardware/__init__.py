"""Step 2 of the pipeline's cost side: the cluster, and what a collective costs on it."""

from fsdp_planner.hardware.cluster import GPU, Cluster, Link, parse_cluster, preset_cluster
from fsdp_planner.hardware.collectives import alpha_beta
from fsdp_planner.hardware.cost import CollectiveCost, collective_cost, collective_time

__all__ = ["GPU", "Cluster", "CollectiveCost", "Link", "alpha_beta", "collective_cost", "collective_time",
           "parse_cluster", "preset_cluster"]
