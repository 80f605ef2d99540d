"""Which modules ``fully_shard`` takes as a target: it refuses a container without a forward (a ModuleList), so
such a container is sharded as its children, one list group. A transformers sub-model that records outputs is
never a target either (``records_outputs``): it is sharded as its children. Shared by the claim replay and the
dtype split."""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_planner.fsdp2.plan import ReshardAfterForward
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT


def records_outputs(trace: Trace, fqn: str) -> bool:
    """Whether ``fqn`` is a transformers sub-model that records outputs (``_can_record_outputs``: hidden states,
    attentions). transformers finds what a model records by ``str(module.__class__)``, which ``fully_shard``
    changes to ``FSDP<class>``: sharded, its hidden states come back None, and a caller reading them fails
    (LLaVA's ``get_image_features`` reads its vision tower's: "'NoneType' object is not subscriptable"). Its
    children keep recording (transformers hooks them by isinstance, which the FSDP subclass passes). The root is
    sharded whatever the plan says."""
    return fqn != ROOT and trace.modules[fqn].records_outputs


def shardable_cover(trace: Trace, fqn: str) -> list[str]:
    """``fqn``, or for a container fully_shard refuses (a ModuleList without forward) or a sub-model that records
    outputs (``records_outputs``) its children holding params, recursively: the same params as one list group
    (params such a sub-model registers itself go to the group above it)."""
    info = trace.modules[fqn]
    if info.shardable and not records_outputs(trace, fqn):
        return [fqn]
    owners_below = trace.index.owners_below
    return [m for c in info.children if owners_below[c] for m in shardable_cover(trace, c)]


def alone_cover(trace: Trace, fqn: str) -> list[list[str]]:
    """The groups that shard ``fqn`` where a policy gives it a group of its own: ``[shardable_cover]``, but a
    sub-model that records outputs as one group per child (each child's cover). Not its children as one list
    group: FSDP2 registers a list group's pre-backward hook on the outputs of the module that finishes forward
    last, and a sub-model's last child may return what no loss reads (CLIP's post_layernorm, whose pooled output
    LLaVA drops): its other children's backward would then run on sharded params."""
    if not records_outputs(trace, fqn):
        return [shardable_cover(trace, fqn)]
    owners_below = trace.index.owners_below
    return [g for c in trace.modules[fqn].children if owners_below[c] for g in alone_cover(trace, c)]


def split_recording(trace: Trace, module_groups: Sequence[Sequence[str]],
                    reshard: Sequence[ReshardAfterForward]) -> tuple[list[list[str]], list[ReshardAfterForward]]:
    """``module_groups`` (with their ``reshard``) where a group of one sub-model that records outputs is its
    ``alone_cover`` groups, each with that group's reshard_after_forward; the other groups as they are."""
    groups: list[list[str]] = []
    out: list[ReshardAfterForward] = []
    for ms, r in zip(module_groups, reshard, strict=True):
        pieces = alone_cover(trace, ms[0]) if len(ms) == 1 else [list(ms)]
        groups += pieces
        out += [r] * len(pieces)
    return groups, out
