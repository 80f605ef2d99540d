"""Making a policy's grouping run when one of its groups would have a param read while sharded."""

from __future__ import annotations

from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.validity import first_sharded_read, runnable
from fsdp_planner.trace.records import Trace


def joined_until_runnable(trace: Trace, plan: Plan) -> Plan:
    """``plan`` with each group FSDP2 could not run (an op reads its param outside its modules' hooks: Whisper's
    encoder adds ``embed_positions.weight`` itself, a checkpointed block's recomputation reads the group before
    it) joined to the group after it, or left to the root when it is the last, as one fixes it by hand, until the
    plan runs; a PlannerError naming the op when no join does (``runnable``). Its checkpointing, mesh and other
    settings are kept; its label says how many groups were joined."""
    joined = 0
    for _ in range(len(plan.inner_groups)):
        bad = first_sharded_read(trace, plan)
        if bad is None or plan.groups[bad.group].is_root:
            break
        modules = [list(g.modules) for g in plan.inner_groups]
        reshard = [g.reshard_after_forward for g in plan.inner_groups]
        if bad.group + 1 < len(modules):
            modules[bad.group + 1] = modules[bad.group] + modules[bad.group + 1]
        del modules[bad.group], reshard[bad.group]
        rebuilt = make_plan(trace, modules, reshard, root_reshard=plan.root.reshard_after_forward)
        plan = plan.replace(groups=rebuilt.groups, forward_methods=rebuilt.forward_methods)
        joined += 1
    if joined:
        plan = plan.replace(policy=f"{plan.policy}, {joined} group{'s' * (joined > 1)} joined to run")
    return runnable(trace, plan)
