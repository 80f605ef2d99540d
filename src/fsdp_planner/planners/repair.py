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
    plan runs; when no join does, the PlannerError of ``plan`` as given (``runnable``: the op and the group it
    names are the policy's own). Its checkpointing, mesh and other settings are kept; its label says how many
    groups were joined."""
    given, joined = plan, 0
    bad = first_sharded_read(trace, plan)
    while bad is not None and not plan.groups[bad.group].is_root and joined < len(given.inner_groups):
        modules = [list(g.modules) for g in plan.inner_groups]
        reshard = [g.reshard_after_forward for g in plan.inner_groups]
        if bad.group + 1 < len(modules):
            modules[bad.group + 1] = modules[bad.group] + modules[bad.group + 1]
        del modules[bad.group], reshard[bad.group]
        rebuilt = make_plan(trace, modules, reshard, root_reshard=plan.root.reshard_after_forward)
        plan = plan.replace(groups=rebuilt.groups, forward_methods=rebuilt.forward_methods)
        joined += 1
        bad = first_sharded_read(trace, plan)
    if bad is not None:
        return runnable(trace, given)
    if joined:
        plan = plan.replace(policy=f"{plan.policy}, {joined} group{'s' * (joined > 1)} joined to run")
    return plan
