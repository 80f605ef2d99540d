"""The FSDP groups a plan with expert parallelism needs: each expert module ``fully_shard``-ed alone, over the
EP-reduced mesh, as torchtitan's ``apply_fsdp`` does for ``transformer_block.moe.experts`` (a group's params share
one mesh, so an expert module's params cannot be sharded with its block's)."""

from __future__ import annotations

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan, short_list
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.trace.records import Trace


def expert_param_indices(plan: Plan, trace: Trace) -> tuple[int, ...]:
    """Indices into ``trace.params`` of the params the plan's expert modules hold (their subtrees)."""
    if plan.expert_parallel is None:
        return ()
    subtree = trace.index.subtree_params
    names = set().union(*(subtree[m] for m in plan.expert_parallel.experts(trace.modules)))
    return tuple(i for i, p in enumerate(trace.params) if p.fqn in names)


def check_expert_groups(plan: Plan, trace: Trace) -> None:
    """Refuse a plan whose groups mix expert params with others: FSDP2 shards a group over one mesh."""
    experts = {trace.params[i].fqn for i in expert_param_indices(plan, trace)}
    mixed = [i for i, g in enumerate(plan.groups) if experts & set(g.params) and not set(g.params) <= experts]
    if mixed:
        raise PlannerError(f"plan group {mixed[0]} holds expert params and others, but expert parallelism shards the "
                           "experts over the EP-reduced mesh: give each expert module its own group (as "
                           "torchtitan's fully_shard(block.moe.experts)), e.g. with --ep, which does it: "
                           f"{short_list(g for g in plan.groups[mixed[0]].modules)}")


def with_expert_groups(plan: Plan, trace: Trace) -> Plan:
    """``plan`` with each expert module taken out of its group into its own (applied first, as torchtitan does),
    keeping its group's ``reshard_after_forward``; a plan whose experts are already alone is returned as it is."""
    if plan.expert_parallel is None:
        return plan
    experts = plan.expert_parallel.experts(trace.modules)
    alone = {g.modules[0] for g in plan.groups if len(g.modules) == 1}
    if all(e in alone for e in experts):
        return plan
    if any(g.forward_prefetch or g.backward_prefetch for g in plan.groups):
        raise PlannerError("cannot move the experts into their own groups in a plan with explicit prefetch lists "
                           f"(they name groups by position): give the expert modules their own groups: "
                           f"{short_list(experts)}")
    subtree = trace.index.subtree_params
    groups: list[list[str]] = []
    reshard = []
    for g in (*plan.inner_groups, plan.root):
        owned = set(g.params)
        mine = [e for e in experts if e not in alone and subtree[e] & owned]
        groups.extend([e] for e in mine)
        reshard.extend([g.reshard_after_forward if isinstance(g.reshard_after_forward, bool) else True] * len(mine))
        if not g.is_root and set(g.modules) - set(mine):
            groups.append([m for m in g.modules if m not in mine])
            reshard.append(g.reshard_after_forward)
    made = make_plan(trace, groups, reshard, root_reshard=bool(plan.root.reshard_after_forward), policy=plan.policy,
                     model=plan.model)
    return plan.replace(groups=made.groups, forward_methods=made.forward_methods)
