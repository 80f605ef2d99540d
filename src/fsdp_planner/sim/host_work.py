"""FSDP2's host work in one step, counted: what the engines charge the cluster's ``Overhead`` figures for, so a
report can show the sum it makes (``plan``'s host line)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_planner.fsdp2.checkpointing import plan_checkpointing
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import build_schedule, state_hook_calls
from fsdp_planner.sim.compute import launches_through
from fsdp_planner.sim.context import SimContext


@dataclass(frozen=True)
class HostWork:
    """FSDP2's host work in one step, counted: what ``HostClock`` (and the CPU-rank engine) charges the cluster's
    ``Overhead`` figures for, so a report can show the sum it makes."""

    hooks: int
    params: float  # params per hook, summed over the hooks (a group's four hooks a step count its params once)
    module_calls: int  # calls of modules fully_shard was applied to
    ops: int  # ops launched, recomputation included (on CPU ranks the ops are the compute itself)
    waits: int = 0  # ops whose output the host reads, recomputation included (``Event.syncs``): GPUs only
    forward_waits: int = 0  # of those, in forward (the ones ``check``'s forward-prefetch answer counts)


def host_work(ctx: SimContext, plan: Plan) -> HostWork:
    groups = ctx.sizing.groups(plan)
    sched = build_schedule(ctx.trace, plan, ctx.world, [g.params for g in groups])
    recompute = ctx.recompute(plan_checkpointing(plan))
    return HostWork(hooks=len(sched.hooks), params=sum(len(groups[g].params) for _, g in sched.hooks) / 4,
                    module_calls=len(state_hook_calls(ctx.trace, plan)),
                    ops=round(launches_through(ctx.trace)[-1]) + sum(r.ops for r in recompute.values()),
                    waits=len(ctx.trace.index.host_syncs) + sum(r.syncs for r in recompute.values()),
                    forward_waits=sum(1 for i in ctx.trace.index.host_syncs if not ctx.trace.events[i].backward))
