"""The FSDP groups a plan with expert parallelism needs: each expert module's params a group of their own, over the
EP-reduced mesh (a param group's params share one mesh). Either ``fully_shard``-ed alone (the expert module's own
call and hooks, torchtitan's ``apply_fsdp`` before March 2026), or, with ``ExpertParallel.per_param_mesh``, in their
block's call on a mesh of their own (``shard_placement_fn`` returning torch's ``ShardPlacementResult``: FSDP2 makes
them a second param group of the block's state, as torchtitan's ``apply_fsdp`` since pytorch/torchtitan#2281):
``param_group_hosts`` says which group's call holds them."""

from __future__ import annotations

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan, short_list
from fsdp_planner.fsdp2.plan import Plan, ReshardAfterForward
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT


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
    keeping its group's ``reshard_after_forward``; on a per-param mesh, the expert modules a group's call holds
    together in one group (FSDP2's one param group for their process group). A plan whose experts are so already
    is returned as it is."""
    if plan.expert_parallel is None:
        return plan
    experts = plan.expert_parallel.experts(trace.modules)
    per_param = plan.expert_parallel.per_param_mesh
    own = [g for g in plan.inner_groups if set(g.modules) <= set(experts)]
    if {m for g in own for m in g.modules} == set(experts) and (not per_param or _holds(plan, trace)) and \
            (per_param or all(len(g.modules) == 1 for g in own)):
        return plan
    if any(g.forward_prefetch or g.backward_prefetch for g in plan.groups):
        raise PlannerError("cannot move the experts into their own groups in a plan with explicit prefetch lists "
                           f"(they name groups by position): give the expert modules their own groups: "
                           f"{short_list(experts)}")
    if own:  # experts grouped otherwise before: back into the calls that hold them, then taken out again
        rest = [g for g in plan.inner_groups if g not in own]
        plan = plan.replace(groups=make_plan(trace, [list(g.modules) for g in rest],
                                             [g.reshard_after_forward for g in rest],
                                             root_reshard=bool(plan.root.reshard_after_forward)).groups)
    groups, reshard = _taken_out(plan, trace, experts, per_param)
    made = make_plan(trace, groups, reshard, root_reshard=bool(plan.root.reshard_after_forward), policy=plan.policy,
                     model=plan.model)
    return plan.replace(groups=made.groups, forward_methods=made.forward_methods)


def _taken_out(plan: Plan, trace: Trace, experts: list[str], per_param: bool
               ) -> tuple[list[list[str]], list[ReshardAfterForward]]:
    """Each group's modules and ``reshard_after_forward`` with its expert modules taken out before it: each a
    group of its own, or all of a call's one group, resharded as that call (``per_param``)."""
    subtree = trace.index.subtree_params
    groups: list[list[str]] = []
    reshard: list[ReshardAfterForward] = []
    for g in (*plan.inner_groups, plan.root):
        owned = set(g.params)
        mine = [e for e in experts if subtree[e] & owned]
        if per_param and mine:  # the call's params on the EP-reduced mesh: one param group, resharded as the call
            groups.append(mine)
            reshard.append(g.reshard_after_forward)
        else:
            groups.extend([e] for e in mine)
            reshard.extend([g.reshard_after_forward if isinstance(g.reshard_after_forward, bool) else True] *
                           len(mine))
        if not g.is_root and set(g.modules) - set(mine):
            groups.append([m for m in g.modules if m not in mine])
            reshard.append(g.reshard_after_forward)
    return groups, reshard


def _holds(plan: Plan, trace: Trace) -> bool:
    """Whether ``plan``'s expert groups are those a per-param mesh makes (``param_group_hosts`` accepts them)."""
    try:
        param_group_hosts(plan, trace)
    except PlannerError:
        return False
    return True


def param_group_hosts(plan: Plan, trace: Trace) -> dict[int, int]:
    """For a plan whose experts are sharded in their block's ``fully_shard`` call (``ExpertParallel.per_param_mesh``):
    each expert group's index -> the index of the group whose call shards them (the group listing the nearest
    module above the experts; the root where none does). FSDP2 makes the experts a second ``FSDPParamGroup`` of
    that call's state: no hooks of their own, gathered and reduced at the state's. Empty for other plans. A
    block holding two expert modules is refused: FSDP2 would put both in one param group (one process group), which
    a plan's groups, one per expert module, do not say."""
    ep = plan.expert_parallel
    if ep is None or not ep.per_param_mesh:
        return {}
    group_of = {m: i for i, g in enumerate(plan.groups) for m in g.modules}
    parents = trace.index.parents
    hosts: dict[int, int] = {}
    for expert in ep.experts(trace.modules):
        above = expert
        while above != ROOT and (above == expert or above not in group_of or group_of[above] == group_of[expert]):
            above = parents[above][0] if parents.get(above) else ROOT
        host = group_of.get(above, len(plan.groups) - 1)
        if hosts.get(group_of[expert], host) != host or (host in hosts.values() and group_of[expert] not in hosts):
            raise PlannerError(f"the expert modules sharded in one fully_shard call with a per-param mesh must be one "
                               f"group (FSDP2 gathers them as one param group), and a group's expert modules in one "
                               f"call: {short_list(plan.groups[group_of[expert]].modules, 3)}")
        own, block = plan.groups[group_of[expert]], plan.groups[host]
        if own.reshard_after_forward != block.reshard_after_forward:
            raise PlannerError(f"the experts '{expert}' are sharded in the fully_shard call of "
                               f"{short_list(block.modules, 3)} (a per-param mesh), which reshards them after "
                               f"forward as it does its own params ({block.reshard_after_forward}), not as their "
                               f"group says ({own.reshard_after_forward}): give both the same reshard_after_forward")
        hosts[group_of[expert]] = host
    return hosts
