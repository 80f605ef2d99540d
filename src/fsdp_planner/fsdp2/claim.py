"""Which params each ``fully_shard`` call manages, replaying FSDP2's claim rule (``_fsdp_init.py``).

``fully_shard(modules)`` walks the module objects below each listed module (``_get_managed_modules``: a DFS over
``module.children()``, visiting a shared submodule once, stopping at modules that already have FSDP state) and
manages every param it finds that no earlier call manages. Groups are therefore applied children-first; a param
reachable from two groups (a tied weight, a submodule shared by blocks) must be claimed by one of them, or
FSDP2 2.13 raises "Parameter ... is shared with a parameter already managed by another FSDP group".
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable_name
from fsdp_planner.fsdp2.checkpointing import check_checkpointing
from fsdp_planner.fsdp2.dtypes import check_full_precision, check_uniform_dtypes, split_by_dtype, with_param_dtypes
from fsdp_planner.fsdp2.input_casts import check_input_casts, with_cast_targets
from fsdp_planner.fsdp2.plan import Group, Plan, ReshardAfterForward
from fsdp_planner.fsdp2.targets import shardable_cover, split_recording
from fsdp_planner.fsdp2.tensor_parallel import check_moe_styles, check_style_classes
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, proper_ancestors


class SplitParamError(PlannerError):
    """A param (tied, or of a module two groups reach) that a plan's groups would each claim: FSDP2 2.13 raises
    ValueError ("shared with a parameter already managed by another FSDP group"); ``check`` reports it as a
    finding, every other command as an error."""

    def __init__(self, param: str, first: int, second: int, holders: Sequence[str],
                 shared: Sequence[str] = ()) -> None:
        self.param = param
        self.problem = f"parameter '{param}' is reachable from groups {first} and {second}; FSDP2 needs it in one group"
        self.fix = f"give {printable_name(shared[0])} a group of its own (its fully_shard before its holders')" \
            if len(shared) == 1 else \
            f"list {', '.join(map(printable_name, shared))} in a group of their own (one fully_shard([...]) before " \
            "their holders')" if shared else f"list {', '.join(holders)} together in one fully_shard([...])" \
            if len(holders) > 1 else "list its modules together in one fully_shard([...])"
        super().__init__(f"{self.problem}: {self.fix}")


def _split(param: str, first: int, second: int, trace: Trace) -> SplitParamError:
    """The error naming what to do: a tied param's modules (every name it has) listed together; a module
    registered in several places (one adapter inside every block) a group of its own, as the module policy gives
    it (listing its holders together made one group of every block, a trial's finding)."""
    info = trace.params[trace.index.param_index[param]]
    if len(info.owners) > 1:
        return SplitParamError(param, first, second, list(info.owners))
    parents = trace.index.parents
    shared = next((m for m in (info.owners[0], *proper_ancestors(info.owners[0])) if len(parents.get(m, ())) > 1),
                  None)
    # (a shared ModuleList, which fully_shard refuses: the modules under it that hold params, as one list group)
    return SplitParamError(param, first, second, list(parents.get(info.owners[0], ())),
                           shardable_cover(trace, shared) if shared is not None else ())


def short_list(names: Iterable[str], limit: int = 5) -> str:
    """The first ``limit`` of ``names`` sorted, each on the message's one line (``printable_name``), and how many
    more."""
    names = sorted(names)
    head = ", ".join(map(printable_name, names[:limit]))
    return head + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def application_order(plan: Plan, parents: Mapping[str, Sequence[str]]) -> list[int]:
    """Group indices in the order ``fully_shard`` must be called: a group listing a module below a module of
    another group comes first (its DFS must stop there); the root comes last. ``parents``: module -> the modules
    holding it as a child."""
    order = shard_order([g.modules for g in plan.groups], parents)
    if len(order) < len(plan.groups):
        raise PlannerError(NESTED_IN_A_CYCLE)
    return order


NESTED_IN_A_CYCLE = "plan groups nest inside each other in a cycle; no fully_shard order exists"


def shard_order(groups: Sequence[Sequence[str]], parents: Mapping[str, Sequence[str]]) -> list[int]:
    """Indices of ``groups`` (each a group's module names) in the order ``fully_shard`` must be called: a group
    listing a module below a module of another group comes first (its DFS must stop there). Groups nested in each
    other in a cycle have no order and are left out: the caller refuses them. ``export`` writes this function's
    source into its code (with ``dag_ancestors``, ``hooked_modules`` and ``topological_order``), so the exported
    code orders the groups of the model it is given as ``apply_plan`` does: keep them free of this package."""
    group_of = {m: i for i, g in enumerate(groups) for m in g}
    before: list[set[int]] = [set() for _ in groups]  # before[i]: groups to apply before group i
    for j, g in enumerate(groups):
        for m in g:
            for a in dag_ancestors(m, parents):
                i = group_of.get(a)
                if i is not None and i != j:
                    before[i].add(j)
    return topological_order(before)


def dag_ancestors(fqn: str, parents: Mapping[str, Sequence[str]]) -> set[str]:
    """Every module holding ``fqn`` below it, by any path (a shared submodule has several parents)."""
    seen: set[str] = set()
    stack = list(parents.get(fqn, ()))
    while stack:
        a = stack.pop()
        if a not in seen:
            seen.add(a)
            stack.extend(parents.get(a, ()))
    return seen


def hooked_modules(modules: Sequence[str], parents: Mapping[str, Sequence[str]]) -> list[str]:
    """The modules of a group that FSDP2 hooks: ``fully_shard([a, a.b])`` keeps only the modules not below another
    listed one (``_get_root_modules``), so ``a.b`` gets no hooks and no FSDP state of its own, and a call of it from
    outside ``a``'s forward unshards nothing (its params are still the group's, claimed through ``a``)."""
    if len(modules) == 1:
        return list(modules)
    listed = set(modules)
    return [m for m in modules if not dag_ancestors(m, parents) & listed]


def hooked_in(trace: Trace, modules: Sequence[str]) -> tuple[str, ...]:
    """``hooked_modules`` of a group of ``trace``'s modules, once per group (``TraceIndex.memo``): a search replays
    the same groups plan after plan. (``hooked_modules`` itself goes into exported code: ``apply/export.py``.)"""
    key = ("hooked_in", tuple(modules))
    memo = trace.index.memo
    if key not in memo:
        memo[key] = tuple(hooked_modules(modules, trace.index.parents))
    return memo[key]


def claimed_params(plan: Plan, trace: Trace) -> list[list[str]]:
    """Params each group's ``fully_shard`` call would manage (FSDP2's DFS, in application order)."""
    if not trace.index.shared_modules and not trace.index.tied_params:
        return _claimed_in_tree(plan, trace)
    modules = trace.modules
    sharded: set[str] = set()
    claimed_by: dict[str, int] = {}
    result: list[list[str]] = [[] for _ in plan.groups]
    for gi in application_order(plan, trace.index.parents):
        # FSDP2's DFS starts at the listed modules no other listed one holds (``hooked_in``), and only those get an
        # FSDP state that stops a later call's DFS: a module listed below another by a second path (a shared
        # submodule, ``blocks.0.shared`` is ``blocks.2.shared``) gets none, so a later group reaching it by a third
        # path claims its params again (FSDP2 then fails on an already sharded param: a trial's order plan)
        listed = set(hooked_in(trace, plan.groups[gi].modules))
        mine: dict[str, None] = {}
        visited: set[str] = set()
        for m in plan.groups[gi].modules:
            stack = [m]
            while stack:
                x = stack.pop()
                if x in visited or (x in sharded and x not in listed):
                    continue
                visited.add(x)
                mine.update(dict.fromkeys(modules[x].params))
                stack.extend(modules[x].children)
        for p in mine:
            if p in claimed_by:
                raise _split(p, claimed_by[p], gi, trace)
            claimed_by[p] = gi
        result[gi] = _registration_order(set(mine), trace)
        sharded |= listed
    return result


def _claimed_in_tree(plan: Plan, trace: Trace) -> list[list[str]]:
    """The DFS's result when every param is reachable by one path only (no shared module, no tied param): a group
    claims its modules' subtrees but the subtrees of modules listed by other groups below them (those are applied
    first). Set arithmetic instead of a walk."""
    group_of = {m: i for i, g in enumerate(plan.groups) for m in g.modules}
    parents, subtree = trace.index.parents, trace.index.subtree_params
    carved: list[list[str]] = [[] for _ in plan.groups]  # per group: modules of other groups inside its subtrees
    for m, gi in group_of.items():
        a = m
        while parents.get(a):
            a = parents[a][0]
            if a in group_of:
                if group_of[a] != gi:
                    carved[group_of[a]].append(m)
                break
    if len(topological_order([{group_of[m] for m in ms} for ms in carved])) < len(plan.groups):
        raise PlannerError(NESTED_IN_A_CYCLE)
    result: list[list[str]] = []
    claimed_by: dict[str, int] = {}
    for gi, g in enumerate(plan.groups):
        mine = set().union(*(subtree[m] for m in g.modules)).difference(*(subtree[x] for x in carved[gi]))
        for p in mine:
            if p in claimed_by:  # a tied param reachable from two groups
                raise _split(p, claimed_by[p], gi, trace)
            claimed_by[p] = gi
        result.append(_registration_order(mine, trace))
    return result


def topological_order(before: list[set[int]]) -> list[int]:
    """Indices ordered so that each comes after all of ``before[i]``, smallest index first among the ready ones
    (deterministic). Indices in a cycle (two groups each nested in the other, which FSDP2 cannot apply) are left
    out."""
    missing = [len(b) for b in before]
    after: list[list[int]] = [[] for _ in before]
    for i, b in enumerate(before):
        for j in b:
            after[j].append(i)
    ready = [i for i, n in enumerate(missing) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        j = heapq.heappop(ready)
        order.append(j)
        for i in after[j]:
            missing[i] -= 1
            if missing[i] == 0:
                heapq.heappush(ready, i)
    return order


def _registration_order(params: set[str], trace: Trace) -> list[str]:
    index = trace.index.param_index
    return sorted(params, key=index.__getitem__)


def validate_plan(plan: Plan, trace: Trace) -> None:
    """Each group's params are exactly what its fully_shard call claims; every param is owned once."""
    if not plan.groups or not plan.root.is_root:
        raise PlannerError("a plan's last group must be the root (modules [''])")
    for i, g in enumerate(plan.inner_groups):
        if ROOT in g.modules or not g.modules:
            raise PlannerError(f"group {i}: only the last group may be the root, and no group may be empty")
    for i, (g, c) in enumerate(zip(plan.groups, claimed_params(plan, trace), strict=True)):
        if set(g.params) != set(c):
            raise PlannerError(f"group {i} ({short_list(g.modules, 3)}) lists params that differ from what "
                               f"fully_shard would claim: {short_list(set(g.params) ^ set(c))}")


def check_shardable_params(trace: Trace) -> None:
    """``fully_shard`` refuses a 0-dim (scalar) param in any module it manages ("fully_shard doesn't support scalar
    parameters"), and the root's call manages whatever no group took, so no FSDP2 plan of such a model runs."""
    scalars = scalar_params(trace)
    if scalars:
        raise PlannerError(f"{SCALAR_PROBLEM} {short_list(scalars)}: {SCALAR_FIX}")


SCALAR_PROBLEM = "FSDP2's fully_shard refuses 0-dim (scalar) parameters, and the model registers"
SCALAR_FIX = ("register each as a 1-element 1-D tensor (e.g. nn.Parameter(value.reshape(1))) and the model can be "
              "sharded; a library's model (transformers' CLIPModel and its logit_scale): plan it from a factory "
              "file of yours that builds it and replaces the param so, before fully_shard (docs/your-model.md)")


def scalar_params(trace: Trace) -> list[str]:
    """The model's 0-dim params, which no ``fully_shard`` call accepts."""
    return [p.fqn for p in trace.params if not p.shape and p.numel == 1]


def _check_same_params(plan: Plan, trace: Trace) -> None:
    """The plan's groups list this model's params, and a plan that names its model (a fingerprint) names this one;
    one without is hand-written, for any model."""
    have = {p for g in plan.groups for p in g.params}
    want = {p.fqn for p in trace.params}
    if (not plan.fingerprint or plan.fingerprint == trace.fingerprint) and have == want:
        return
    missing, extra = want - have, have - want
    parts = [f"missing parameters: {short_list(missing)}"] * bool(missing) + \
        [f"extra parameters: {short_list(extra)}"] * bool(extra)
    if not parts and plan.numel and plan.numel != trace.numel:
        parts.append(f"the same parameter names, but {plan.numel:,} parameters where this model has "
                     f"{trace.numel:,}: other shapes")
    elif not parts:  # (the fingerprint hashes the names, shapes and dtypes: which differ, the plan cannot say)
        parts.append("the same parameter names and count, but another 'model.fingerprint': other shapes or dtypes, "
                     "or the file's fingerprint was edited")
    # this model's plan, its groups edited (the fingerprint hashes names, shapes and dtypes, not which names one
    # param holds: a tied model's and an untied one's are alike, their param counts not: a new user's trial)
    if plan.fingerprint in ("", trace.fingerprint) and plan.numel in (0, trace.numel):
        raise PlannerError(f"the plan's groups do not list every param of this model ({'; '.join(parts)}): "
                           "each group's 'params' are those its modules own (make the plan again with "
                           "'plan --out' to get them)")
    raise PlannerError(f"plan was made for another model ({'; '.join(parts)})")


def check_known_modules(plan: Plan, trace: Trace) -> None:
    """PlannerError naming the modules ``plan``'s groups list that the model does not have."""
    unknown = {m for g in plan.groups for m in g.modules} - set(trace.modules)
    if unknown:
        raise PlannerError(f"plan names modules the model does not have: {short_list(unknown)}")


def check_same_model(plan: Plan, trace: Trace) -> None:
    """PlannerError when ``plan`` was made for another model, or names params or modules this one lacks: said
    before any check that reads the groups (an edited EP plan naming 'layers.7' was told its experts sat in the
    root's call)."""
    _check_same_params(plan, trace)
    if plan.numel and plan.numel != trace.numel:  # 0: not recorded; the fingerprint agrees, so an edited file
        raise PlannerError(f"the plan's 'model.numel' is {plan.numel:,} but this model has {trace.numel:,} parameters "
                           "(the plan file was edited: make it again with 'plan --out')")
    check_known_modules(plan, trace)


def check_plan_matches(plan: Plan, trace: Trace) -> None:
    """PlannerError naming missing/extra params or unknown modules when ``plan`` does not fit the model."""
    check_same_model(plan, trace)
    refused = {m for g in plan.groups for m in g.modules if not trace.modules[m].shardable}
    containers = {m for m in refused if trace.modules[m].cls in ("ModuleList", "ModuleDict")}
    if containers:
        raise PlannerError(f"fully_shard refuses containers without forward (ModuleList/ModuleDict): "
                           f"{short_list(containers)}; list their children in the group instead")
    if refused:
        raise PlannerError(f"these modules change their own inputs (an in-place op on a tensor, or a pop from a "
                           f"list they are given), which FSDP2's handling of a sharded module's inputs breaks "
                           f"(autograd refuses the first; the second changes a copy their caller never sees): "
                           f"{short_list(refused)}; shard their children instead")
    unknown = sorted({m for m, _ in plan.forward_methods} - set(trace.modules))
    if unknown:
        raise PlannerError(f"plan 'forward_methods' names modules the model does not have: {short_list(unknown)}")
    unknown = sorted(set(plan.compiled) - set(trace.modules))
    if unknown:  # apply's compile refuses them too: a simulation must not compile what the job cannot
        raise PlannerError(f"plan 'compiled' names modules the model does not have: {short_list(unknown)}")
    if plan.tensor_parallel is not None:  # every pattern names modules of this model, the MoE styles where they run
        check_moe_styles(plan.tensor_parallel, trace.modules, plan.expert_parallel is not None)
        check_style_classes(plan.tensor_parallel, trace.modules)  # ... and torch's styles on modules they take
    if plan.expert_parallel is not None:
        plan.expert_parallel.experts(trace.modules)  # ... and every expert pattern
    check_shardable_params(trace)
    validate_plan(plan, trace)
    check_uniform_dtypes(plan, trace)
    check_full_precision(plan, trace)
    check_input_casts(trace, hooked_by(plan, trace))
    check_checkpointing(plan, trace)


def with_claimed_params(plan: Plan, trace: Trace) -> Plan:
    """A plan written as lists of modules (no group lists params) made whole for ``trace``: each group's params
    are what its fully_shard call claims (the root takes the rest), so people write the groups and never the
    params. The groups then follow first use, as a policy's do, unless a prefetch list names them by position
    (then they keep the order written). A plan that lists params is returned as it is, for
    ``check_plan_matches`` to compare."""
    if any(g.params for g in plan.groups):
        return plan
    check_known_modules(plan, trace)
    groups = [replace(g, params=params) for g, params in zip(plan.groups, claimed_params(plan, trace), strict=True)]
    if not any(g.forward_prefetch or g.backward_prefetch for g in groups):
        first = trace.index.first_use_by_name
        never = len(trace.events) + 2  # a group claiming nothing goes last
        groups[:-1] = sorted(groups[:-1], key=lambda g: min((first[p] for p in g.params), default=never))
    return replace(plan, groups=groups, fingerprint=plan.fingerprint or trace.fingerprint,
                   numel=plan.numel or trace.numel)


def make_plan(trace: Trace, module_groups: Sequence[Sequence[str]],
              reshard: Sequence[ReshardAfterForward] | None = None, root_reshard: bool = False, policy: str = "",
              model: str = "") -> Plan:
    """A validated Plan from lists of modules (the non-root groups): params are derived, the root takes the
    rest, groups that claim nothing are dropped, the rest sorted by first use."""
    check_shardable_params(trace)
    reshard = list(reshard) if reshard is not None else [True] * len(module_groups)
    # a transformers sub-model that records outputs is sharded as its children (``targets.records_outputs``)
    module_groups, reshard = split_recording(trace, module_groups, reshard)
    listed: set[str] = set()
    groups = []
    for ms in module_groups:  # a module listed twice stays in its first group (a policy may reach it twice)
        ms = [c for m in ms for c in shardable_cover(trace, m)]
        groups.append([m for m in dict.fromkeys(ms) if m not in listed])
        listed.update(ms)
    parents = trace.index.parents

    def above(m: str) -> set[str]:
        return dag_ancestors(m, parents)

    if trace.cast_inputs:
        groups = with_cast_targets(trace, groups, above)
        reshard += [True] * (len(groups) - len(reshard))
    added = resolve_shared_modules(trace, groups)
    reshard += [True] * added
    groups = resolve_ties(trace, groups)
    groups, reshard = split_by_dtype(trace, groups, reshard)
    # the split lists a mixed-dtype module's pieces instead of it (the root's too): a piece may hold one owner of
    # a tied param whose other owner stays with the root or another group, so the ties are resolved again
    groups = resolve_ties(trace, groups)
    if trace.cast_inputs:  # again after the split, which lists the modules kept in fp32 below one instead of it
        groups = with_cast_targets(trace, groups, above)
        reshard += [True] * (len(groups) - len(reshard))
        groups = resolve_ties(trace, groups)
    plan = Plan([*(Group(ms, [], r) for ms, r in zip(groups, reshard, strict=True)), Group([ROOT], [], root_reshard)],
                trace.fingerprint, trace.numel, policy=policy, model=model)
    # (built, not ``replace``d: auto builds thousands of groups per plan)
    claimed = [Group(g.modules, params, g.reshard_after_forward)
               for g, params in zip(plan.groups, claimed_params(plan, trace), strict=True)]
    # a group claiming nothing is dropped, but one that hooks a module of ``Trace.cast_inputs`` (FSDP2 runs a
    # fully_shard without params: its pre-forward casts the module's inputs all the same)
    cast = set(trace.cast_inputs)
    kept = [g for g in claimed if g.params or g.is_root or (cast and cast.intersection(g.modules))]
    plan = replace(plan, groups=with_param_dtypes(trace, kept))
    first = trace.index.first_use_by_name.__getitem__
    inner = sorted(plan.inner_groups, key=lambda g: min(map(first, g.params)) if g.params else
                   _first_call(trace, g.modules))
    plan = replace(plan, groups=[*inner, plan.root], forward_methods=methods_to_register(trace, plan))
    if cast:  # a module the policy listed only beside a module above it is not hooked
        check_input_casts(trace, hooked_by(plan, trace), policy=True)
    return plan


def _first_call(trace: Trace, modules: Sequence[str]) -> int:
    """Where a group without params goes among the others: the first param read below its modules (its calls
    come just before), else after every forward op."""
    uses = [trace.modules[m].first_use for m in modules if trace.modules[m].first_use >= 0]
    return min(uses, default=len(trace.events)) - 1


def hooked_by(plan: Plan, trace: Trace) -> set[str]:
    """The modules the plan's ``fully_shard`` calls hook (``hooked_modules``), the root's included."""
    return {m for g in plan.groups for m in hooked_in(trace, g.modules)}


def methods_to_register(trace: Trace, plan: Plan) -> list[tuple[str, str]]:
    """The non-forward methods the step calls on modules the plan shards (``fully_shard`` targets, the root
    included): FSDP2 runs them inside the module's hooks only once ``register_fsdp_forward_method`` is called."""
    listed = hooked_by(plan, trace)  # only a module fully_shard hooked has the state the registration wraps
    return [(m, name) for m, name in trace.forward_methods if m in listed]


def resolve_ties(trace: Trace, module_groups: list[list[str]]) -> list[list[str]]:
    """Move every owner of a tied param into one group (the earliest listed that holds one of them), as FSDP2
    requires; classic policies (size-based, per-class) otherwise split tied weights."""
    for p in (trace.params[i] for i in trace.index.tied_params):
        group_of = {m: i for i, ms in enumerate(module_groups) for m in ms}
        if ROOT in p.owners:  # only the root's own fully_shard can manage a param registered on the root
            for o in p.owners:
                if o in group_of:
                    module_groups[group_of[o]].remove(o)
            continue
        gids = [claiming_group(o, group_of, trace.index.parents) for o in p.owners]
        inner = sorted({g for g in gids if g >= 0})
        if len(set(gids)) <= 1 or not inner:
            continue
        for o, g in zip(p.owners, gids, strict=True):
            if g != inner[0]:
                if g >= 0 and o in module_groups[g]:
                    module_groups[g].remove(o)
                module_groups[inner[0]].append(o)
    return module_groups


def resolve_shared_modules(trace: Trace, module_groups: list[list[str]]) -> int:
    """A submodule held by several parents (one object under several names) whose params two groups would both
    reach gets a group of its own, applied before them, so that it is claimed once. Returns the groups added."""
    parents = trace.index.parents
    added = 0
    for m in trace.index.shared_modules:
        group_of = {x: i for i, ms in enumerate(module_groups) for x in ms}
        if m in group_of and dag_ancestors(m, parents) & set(module_groups[group_of[m]]):
            # listed beside a module holding it by another path: FSDP2 hooks it not (``hooked_modules``), so it is
            # as good as unlisted (an order plan listed ``blocks.0.shared`` beside ``blocks.2``, the ranks failed)
            module_groups[group_of.pop(m)].remove(m)
        if m not in group_of and len({claiming_group(p, group_of, parents) for p in parents[m]}) > 1:
            module_groups.append([m])
            added += 1
    return added


def claiming_group(fqn: str, group_of: Mapping[str, int], parents: Mapping[str, Sequence[str]]) -> int:
    """The group whose fully_shard call claims ``fqn``'s own params: its own, else its nearest listed ancestor's
    (following the first parent of a shared module); -1 for the root."""
    while True:
        if fqn in group_of:
            return group_of[fqn]
        if fqn == ROOT or not parents.get(fqn):
            return -1
        fqn = parents[fqn][0]
