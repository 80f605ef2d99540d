"""``fsdp-planner cost all-gather 1GiB --cluster h100:8``: the time of one collective."""

from __future__ import annotations

import argparse

import fsdp_planner.cli.render as render
from fsdp_planner.fmt import json_text, parse_size
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.hardware.cost import collective_cost, collective_time


def run(args: argparse.Namespace) -> int:
    kind = CollectiveKind.parse(args.collective)
    cluster = parse_cluster(args.cluster)
    nbytes = parse_size(args.size)
    seconds = collective_time(cluster, kind, nbytes, ranks=args.ranks)  # what the simulator charges
    ranks = args.ranks or cluster.world_size
    if args.json:
        print(json_text({"collective": kind.value, "bytes": nbytes, "ranks": ranks, "seconds": seconds}, indent=None))
    else:
        busbw = collective_cost(cluster, kind, args.ranks).bus_bandwidth(nbytes)
        render.console.print(render.cost_line(args.collective, nbytes, ranks, cluster, seconds, busbw))
    return 0
