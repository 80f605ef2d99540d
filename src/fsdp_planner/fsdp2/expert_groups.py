"""The FSDP groups a plan with expert parallelism needs: each expert module's params a group of their own, over the
EP-reduced mesh (a param group's params share one mesh). Either ``fully_shard``-ed alone (the expert module's own
call and hooks, torchtitan's ``apply_fsdp`` before March 2026), or, with ``ExpertParallel.per_param_mesh``, in their
block's call on a mesh of their own (``shard_placement_fn`` returning torch's ``ShardPlacementResult``: FSDP2 makes
them a second param group of the block's state, as torchtitan's ``apply_fsdp`` since pytorch/torchtitan#2281):
``param_group_hosts`` says which group's call holds them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

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
    """Refuse a plan whose groups mix expert params with others: FSDP2 shards a group over one mesh; whose experts
    modules share a call of their own (each is one, ``alone_refusal``); on a per-param mesh, one whose expert
    groups are not the calls' own (``param_group_hosts``); with explicit prefetch lists (``check_no_prefetch``)."""
    check_no_prefetch(plan)
    experts = {trace.params[i].fqn for i in expert_param_indices(plan, trace)}
    mixed = [i for i, g in enumerate(plan.groups) if experts & set(g.params) and not set(g.params) <= experts]
    if mixed:
        raise PlannerError(f"plan group {mixed[0]} holds expert params and others, but expert parallelism shards the "
                           "experts over the EP-reduced mesh: give each expert module its own group (as "
                           "torchtitan's fully_shard(block.moe.experts)), e.g. with --ep, which does it: "
                           f"{short_list(g for g in plan.groups[mixed[0]].modules)}")
    ep = plan.expert_parallel
    if ep is not None and not ep.per_param_mesh and (said := alone_refusal(plan, ep.experts(trace.modules))):
        raise PlannerError(said)
    param_group_hosts(plan, trace)


def check_no_prefetch(plan: Plan) -> None:
    """An EP plan's expert groups are sharded apart from the rest (in calls of their own or as their blocks' second
    param groups), while explicit prefetch lists name groups by position: refused rather than prefetching the
    wrong groups."""
    if plan.expert_parallel is not None and any(g.forward_prefetch or g.backward_prefetch for g in plan.groups):
        raise PlannerError("a plan with expert parallelism cannot have explicit prefetch lists yet (they name groups "
                           "by position, and the expert groups are sharded apart): drop forward_prefetch and "
                           "backward_prefetch")


def alone_refusal(plan: Plan, experts: list[str]) -> str | None:
    """Why ``plan``'s experts modules cannot each be sharded in a call of their own (``per_param_mesh`` false): one
    listed in no group alone (None: each is)."""
    alone = {g.modules[0] for g in plan.groups if len(g.modules) == 1}
    missing = [name for name in experts if name not in alone]
    if missing:
        return (f"the experts module '{missing[0]}' is not a group of its own, and this plan (per_param_mesh false) "
                "shards each experts module in a fully_shard call of its own: give it one (plan --ep makes them)")
    return None


def with_expert_groups(plan: Plan, trace: Trace) -> Plan:
    """``plan`` with each expert module taken out of its group into its own (applied first, as torchtitan does),
    keeping its group's ``reshard_after_forward``; on a per-param mesh, the expert modules one call holds (the call
    of the nearest listed module above them, once they are listed nowhere) together in one group, resharded as that
    call (FSDP2's one param group for their process group). A plan whose experts are so already is returned as it
    is. A call resharding to an int cannot hold experts on a per-param mesh (FSDP2 reshards no DTensor param to a
    smaller mesh: "not supported for DTensor parameters yet"): such a plan keeps the experts' own calls."""
    ep = plan.expert_parallel
    if ep is None:
        return plan
    experts = ep.experts(trace.modules)
    own = [g for g in plan.inner_groups if set(g.modules) <= set(experts)]
    if {m for g in own for m in g.modules} == set(experts) and \
            (_holds(plan, trace) if ep.per_param_mesh else alone_refusal(plan, experts) is None):
        return plan
    if any(g.forward_prefetch or g.backward_prefetch for g in plan.groups):
        raise PlannerError("cannot move the experts into their own groups in a plan with explicit prefetch lists "
                           f"(they name groups by position): give the expert modules their own groups: "
                           f"{short_list(experts)}")
    if ep.per_param_mesh:
        groups, reshard = _in_their_calls(plan, trace, experts)
        if any(not isinstance(r, bool) for r in reshard):
            return with_expert_groups(plan.replace(expert_parallel=replace(ep, per_param_mesh=False)), trace)
    else:
        if own:  # experts grouped otherwise before: back into the calls that hold them, then taken out again
            rest = [g for g in plan.inner_groups if g not in own]
            plan = plan.replace(groups=make_plan(trace, [list(g.modules) for g in rest],
                                                 [g.reshard_after_forward for g in rest],
                                                 root_reshard=bool(plan.root.reshard_after_forward)).groups)
        groups, reshard = _alone(plan, trace, experts)
    made = make_plan(trace, groups, reshard, root_reshard=bool(plan.root.reshard_after_forward), policy=plan.policy,
                     model=plan.model)
    return plan.replace(groups=made.groups, forward_methods=made.forward_methods)


def _alone(plan: Plan, trace: Trace, experts: list[str]) -> tuple[list[list[str]], list[ReshardAfterForward]]:
    """Each group's modules and ``reshard_after_forward``, each expert module it holds taken out before it into a
    group of its own (resharded fully, or as its group where that is a bool)."""
    subtree = trace.index.subtree_params
    groups: list[list[str]] = []
    reshard: list[ReshardAfterForward] = []
    for g in (*plan.inner_groups, plan.root):
        owned = set(g.params)
        mine = [e for e in experts if subtree[e] & owned]
        groups.extend([e] for e in mine)
        reshard.extend([g.reshard_after_forward if isinstance(g.reshard_after_forward, bool) else True] * len(mine))
        if not g.is_root and set(g.modules) - set(mine):
            groups.append([m for m in g.modules if m not in mine])
            reshard.append(g.reshard_after_forward)
    return groups, reshard


def _in_their_calls(plan: Plan, trace: Trace, experts: list[str]
                    ) -> tuple[list[list[str]], list[ReshardAfterForward]]:
    """The groups with the expert modules listed nowhere, each call's experts (those below its nearest listed
    module: ``_host``) one group before it, resharded as it; the root's last."""
    listed = [[m for m in g.modules if m not in experts] for g in plan.inner_groups]
    kept = [(g, ms) for g, ms in zip(plan.inner_groups, listed, strict=True) if ms]
    group_of = {m: i for i, (_, ms) in enumerate(kept) for m in ms}
    held: dict[int, list[str]] = {}
    parent_of = traced_parent(trace)
    for e in experts:
        held.setdefault(_host(e, group_of, parent_of, len(kept)), []).append(e)
    groups: list[list[str]] = []
    reshard: list[ReshardAfterForward] = []
    for i, (g, ms) in enumerate(kept):
        if i in held:
            groups.append(held[i])
            reshard.append(g.reshard_after_forward)
        groups.append(ms)
        reshard.append(g.reshard_after_forward)
    if len(kept) in held:
        groups.append(held[len(kept)])
        reshard.append(plan.root.reshard_after_forward)
    return groups, reshard


def traced_parent(trace: Trace) -> Callable[[str], str | None]:
    """A module's parent in the traced model (its first, for a module registered twice); None for the root."""
    parents = trace.index.parents
    return lambda m: parents[m][0] if parents.get(m) else None


def named_parent(module: str) -> str | None:
    """A module's parent by its name alone (``a.b.c`` -> ``a.b``; the root's children -> the root): for a plan
    checked without its model (an export of a model file, which is not run)."""
    return None if module == ROOT else module.rpartition(".")[0]


def _host(module: str, group_of: Mapping[str, int], parent_of: Callable[[str], str | None], root: int) -> int:
    """The group whose call claims ``module``: the nearest module above it a group lists (``root`` where none)."""
    above: str | None = module
    while (above := parent_of(above)) is not None:
        if above in group_of:
            return group_of[above]
    return root


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
    that call's state: no hooks of their own, gathered and reduced at the state's. Empty for other plans. Each call
    holds its experts in one group (FSDP2 gathers them as one param group) and reshards them as its own, a bool.
    Memoized per trace: a search replays thousands of plans."""
    ep = plan.expert_parallel
    if ep is None or not ep.per_param_mesh:
        return {}
    key = ("param_group_hosts", ep.modules, tuple((g.modules, g.reshard_after_forward) for g in plan.groups))
    memo = trace.index.memo
    if key not in memo:
        memo[key] = hosts_or_refusal(plan, ep.experts(trace.modules), traced_parent(trace))
    found = memo[key]
    if isinstance(found, str):  # (the refusal's sentence: a fresh error each time)
        raise PlannerError(found)
    return dict(found)


def root_held_experts(plan: Plan, trace: Trace) -> list[str]:
    """The expert modules of a per-param-mesh plan that the root's call shards (no group lists a module above
    them: a policy that wraps no block), which FSDP2 keeps gathered as the root's params through the step."""
    hosts = param_group_hosts(plan, trace)
    root = len(plan.groups) - 1
    return [m for g, host in hosts.items() if host == root for m in plan.groups[g].modules]


def hosts_or_refusal(plan: Plan, experts: list[str], parent_of: Callable[[str], str | None]) -> dict[int, int] | str:
    """``param_group_hosts`` of ``plan`` whose expert modules are ``experts``, the module tree as ``parent_of``
    gives it; a sentence saying why FSDP2 cannot shard them so."""
    expert_set = set(experts)
    group_of = {m: i for i, g in enumerate(plan.groups) for m in g.modules if m not in expert_set}
    of_expert = {m: i for i, g in enumerate(plan.groups) for m in g.modules if m in expert_set}
    hosts: dict[int, int] = {}
    for expert in experts:
        if expert not in of_expert:
            return f"the expert module '{expert}' is in no group of its own: give it one (plan --ep makes them)"
        host = _host(expert, group_of, parent_of, len(plan.groups) - 1)
        mine = of_expert[expert]
        if hosts.get(mine, host) != host or (host in hosts.values() and mine not in hosts) or \
                not set(plan.groups[mine].modules) <= expert_set:
            return (f"the expert modules one fully_shard call holds on a per-param mesh must be one group "
                                f"of their own (FSDP2 gathers them as one param group), not split or mixed: "
                                f"{short_list(plan.groups[mine].modules, 3)}")
        own, block = plan.groups[mine], plan.groups[host]
        call = "the root module" if block.is_root else short_list(block.modules, 3)
        mesh = "a per-param mesh; no group lists a module above them" if block.is_root else "a per-param mesh"
        if not isinstance(block.reshard_after_forward, bool):
            return (f"the experts '{expert}' are sharded in the fully_shard call of "
                                f"{call} ({mesh}), which reshards to "
                                f"{block.reshard_after_forward} ranks after forward: FSDP2 reshards no DTensor param "
                                "to a smaller mesh; give that group true or false, or the plan per_param_mesh false")
        if own.reshard_after_forward != block.reshard_after_forward:
            return (f"the experts '{expert}' are sharded in the fully_shard call of "
                                f"{call} ({mesh}), which reshards them after "
                                f"forward as it does its own params ({block.reshard_after_forward}), not as their "
                                f"group says ({own.reshard_after_forward}): give both the same reshard_after_forward")
        hosts[mine] = host
    return hosts
