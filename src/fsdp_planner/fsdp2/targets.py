"""Which modules ``fully_shard`` takes as a target: it refuses a container without a forward (a ModuleList), so
such a container is sharded as its children, one list group. Shared by the claim replay and the dtype split."""

from __future__ import annotations

from fsdp_planner.trace.records import Trace


def shardable_cover(trace: Trace, fqn: str) -> list[str]:
    """``fqn``, or for a container fully_shard refuses (a ModuleList without forward) its children holding params,
    recursively: the same params as one list group."""
    info = trace.modules[fqn]
    if info.shardable:
        return [fqn]
    owners_below = trace.index.owners_below
    return [m for c in info.children if owners_below[c] for m in shardable_cover(trace, c)]
