"""Plans: which modules each FSDP group (one ``fully_shard`` call) covers, and how it behaves.

A plan is an ordered list of groups in execution order with the root group (modules ``[""]``) last. Every
group is exactly one ``fully_shard(list_of_modules)`` call; the params it owns are what that call claims
when the groups are applied children-first (see ``application_order``).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.trace import ROOT, Trace

PLAN_VERSION = 1


@dataclass
class Group:
    """One FSDP parameter group: ``fully_shard(modules, reshard_after_forward=...)``."""

    modules: list[str]
    params: list[str] = field(default_factory=list)
    reshard_after_forward: bool | int = True
    forward_prefetch: list[int] = field(default_factory=list)  # group indices to unshard at this one's forward
    backward_prefetch: list[int] = field(default_factory=list)  # ... at this one's pre-backward

    @property
    def is_root(self) -> bool:
        return self.modules == [ROOT]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "modules": list(self.modules),
            "params": list(self.params),
            "reshard_after_forward": self.reshard_after_forward,
        }
        if self.forward_prefetch:
            d["forward_prefetch"] = list(self.forward_prefetch)
        if self.backward_prefetch:
            d["backward_prefetch"] = list(self.backward_prefetch)
        return d


@dataclass
class Plan:
    groups: list[Group]  # execution order, root group last
    fingerprint: str
    numel: int
    policy: str = ""
    model: str = ""

    @property
    def root(self) -> Group:
        return self.groups[-1]

    @property
    def inner_groups(self) -> list[Group]:
        return self.groups[:-1]

    def group_of_param(self) -> dict[str, int]:
        return {p: i for i, g in enumerate(self.groups) for p in g.params}

    # -- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "model": {"fingerprint": self.fingerprint, "numel": self.numel, "name": self.model},
            "policy": self.policy,
            "groups": [g.to_dict() for g in self.groups],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_json(cls, text: str, trace: Trace | None = None) -> Plan:
        """Parse a plan; with ``trace``, also check that it was made for this model."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlannerError(f"plan is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
        plan = _plan_from_dict(data)
        if trace is not None:
            check_plan_matches(plan, trace)
        return plan

    @classmethod
    def load(cls, path: str | Path, trace: Trace | None = None) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise PlannerError(f"plan file '{path}' does not exist")
        return cls.from_json(p.read_text(), trace)


def _plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict):
        raise PlannerError("plan JSON must be an object with 'version', 'model' and 'groups'")
    if data.get("version") != PLAN_VERSION:
        raise PlannerError(f"unsupported plan version {data.get('version')!r} (expected {PLAN_VERSION})")
    model, groups = data.get("model"), data.get("groups")
    if not isinstance(model, dict) or not isinstance(groups, list) or not groups:
        raise PlannerError("plan JSON needs a 'model' object and a non-empty 'groups' list")
    parsed = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or not isinstance(g.get("modules"), list) or not isinstance(
            g.get("params", []), list
        ):
            raise PlannerError(f"plan group {i} must be an object with a 'modules' list and a 'params' list")
        raf = g.get("reshard_after_forward", True)
        if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
            raise PlannerError(f"plan group {i}: reshard_after_forward must be true, false or a positive int")
        parsed.append(
            Group(
                modules=[str(m) for m in g["modules"]],
                params=[str(p) for p in g.get("params", [])],
                reshard_after_forward=raf,
                forward_prefetch=[int(x) for x in g.get("forward_prefetch", [])],
                backward_prefetch=[int(x) for x in g.get("backward_prefetch", [])],
            )
        )
    if not parsed[-1].is_root:
        parsed.append(Group([ROOT], [], False))
    return Plan(parsed, str(model.get("fingerprint", "")), int(model.get("numel", 0)),
                policy=str(data.get("policy", "")), model=str(model.get("name", "")))


def _short(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    head = ", ".join(names[:limit])
    return head + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_plan_matches(plan: Plan, trace: Trace) -> None:
    """Raise a PlannerError naming missing/extra params when ``plan`` does not fit the traced model."""
    have = {p for g in plan.groups for p in g.params}
    want = {p.fqn for p in trace.params}
    if plan.fingerprint != trace.fingerprint or have != want:
        missing, extra = want - have, have - want
        parts = []
        if missing:
            parts.append(f"missing parameters: {_short(missing)}")
        if extra:
            parts.append(f"extra parameters: {_short(extra)}")
        if not parts:
            parts.append("same parameter names but different shapes or dtypes")
        raise PlannerError(f"plan was made for another model ({'; '.join(parts)})")
    unknown = {m for g in plan.groups for m in g.modules} - set(trace.modules)
    if unknown:
        raise PlannerError(f"plan names modules the model does not have: {_short(unknown)}")
    validate_plan(plan, trace)


# -- module tree helpers ---------------------------------------------------------------------------
def is_descendant(child: str, parent: str) -> bool:
    """Whether ``child`` is ``parent`` or lies in its subtree."""
    return parent == ROOT or child == parent or child.startswith(parent + ".")


def parent_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def application_order(plan: Plan) -> list[int]:
    """Group indices in the order ``fully_shard`` must be called: a group containing a module whose
    descendants belong to other groups comes after those groups; the root comes last."""
    n = len(plan.groups)
    group_of = {m: i for i, g in enumerate(plan.groups) for m in g.modules}
    deps: list[set[int]] = [set() for _ in range(n)]  # deps[i]: groups that must be applied before i
    for j, g in enumerate(plan.groups):
        for m in g.modules:
            a = m
            while a != ROOT:
                a = parent_of(a)
                i = group_of.get(a)
                if i is not None and i != j:
                    deps[i].add(j)
    users: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(deps):
        for j in ds:
            users[j].append(i)
    missing = [len(ds) for ds in deps]
    ready = [i for i in range(n) if missing[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < n:
        raise PlannerError("plan groups nest inside each other in a cycle; no fully_shard order exists")
    return order


def module_children(trace: Trace) -> dict[str, list[str]]:
    """Direct children per module (computed once per trace; do not mutate)."""

    def compute() -> dict[str, list[str]]:
        children: dict[str, list[str]] = {fqn: [] for fqn in trace.modules}
        for fqn in trace.modules:
            if fqn != ROOT:
                children[parent_of(fqn)].append(fqn)
        return children

    return trace.memo("children", compute)


def claimed_params(plan: Plan, trace: Trace) -> list[list[str]]:
    """Params each group's ``fully_shard`` call would manage, replaying FSDP2's claim rule: all params in
    the listed modules' subtrees, stopping at modules already sharded by an earlier call."""
    children = module_children(trace)
    sharded: set[str] = set()
    claimed_by: dict[str, int] = {}
    result: list[list[str]] = [[] for _ in plan.groups]
    for gi in application_order(plan):
        g = plan.groups[gi]
        mine: dict[str, None] = {}
        for m in g.modules:
            stack = [m]
            while stack:
                x = stack.pop()
                if x != m and x in sharded:
                    continue
                for p in trace.modules[x].params:
                    mine[p] = None
                stack.extend(children[x])
        for p in mine:
            if p in claimed_by:
                raise PlannerError(
                    f"parameter '{p}' is shared by groups {claimed_by[p]} and {gi}; FSDP2 needs tied parameters "
                    "in one fully_shard([...]) group"
                )
            claimed_by[p] = gi
        result[gi] = list(mine)
        sharded.update(g.modules)
    return result


def validate_plan(plan: Plan, trace: Trace) -> None:
    """Each group's params are exactly what its fully_shard call claims; every param is owned once."""
    if not plan.groups or not plan.groups[-1].is_root:
        raise PlannerError("a plan's last group must be the root (modules [''])")
    for i, g in enumerate(plan.groups[:-1]):
        if ROOT in g.modules or not g.modules:
            raise PlannerError(f"group {i}: only the last group may be the root, and no group may be empty")
    claimed = claimed_params(plan, trace)
    for i, (g, c) in enumerate(zip(plan.groups, claimed, strict=True)):
        if set(g.params) != set(c):
            diff = set(g.params) ^ set(c)
            raise PlannerError(
                f"group {i} ({_short(g.modules, 3)}) lists params that differ from what fully_shard would "
                f"claim: {_short(diff)}"
            )


def make_plan(trace: Trace, module_groups: list[list[str]], reshard: list[bool | int] | None = None,
              root_reshard: bool = False, policy: str = "", model: str = "") -> Plan:
    """Build a validated Plan from lists of modules (non-root groups); params are derived, root takes the rest."""
    reshard = reshard or [True] * len(module_groups)
    module_groups = resolve_ties(trace, [list(ms) for ms in module_groups])
    groups = [Group(ms, [], r) for ms, r in zip(module_groups, reshard, strict=True)]
    groups.append(Group([ROOT], [], root_reshard))
    plan = Plan(groups, trace.fingerprint, trace.numel, policy=policy, model=model)
    for g, params in zip(plan.groups, claimed_params(plan, trace), strict=True):
        g.params = params
    # drop non-root groups that claim nothing (e.g. a listed module without params)
    plan.groups = [g for g in plan.groups if g.params or g.is_root]
    order = _execution_order(plan, trace)
    plan.groups = [plan.groups[i] for i in order]
    return plan


def resolve_ties(trace: Trace, module_groups: list[list[str]]) -> list[list[str]]:
    """Move every owner of a tied param into one group (the earliest listed that holds one of them), as
    FSDP2 requires; classic policies (size-based, per-class) otherwise split tied weights."""
    for p in trace.params:
        if not p.is_shared:
            continue
        group_of = {m: i for i, ms in enumerate(module_groups) for m in ms}
        gids = [_nearest_group(o, group_of) for o in p.owners]
        inner = sorted({g for g in gids if g >= 0})
        if len(set(gids)) <= 1 or not inner:
            continue
        target = inner[0]
        for o, g in zip(p.owners, gids, strict=True):
            if g != target:
                if o in module_groups[g] if g >= 0 else False:
                    module_groups[g].remove(o)
                module_groups[target].append(o)
    return module_groups


def _nearest_group(fqn: str, group_of: dict[str, int]) -> int:
    """The group whose fully_shard call claims ``fqn``'s params: its own or its nearest listed ancestor's."""
    a = fqn
    while True:
        if a in group_of:
            return group_of[a]
        if a == ROOT:
            return -1  # the root claims it
        a = parent_of(a)


def _execution_order(plan: Plan, trace: Trace) -> list[int]:
    """Non-root groups sorted by the first forward op that uses any of their params; root last."""
    first = trace.param_first_use()
    big = len(trace.events) + 1

    def key(i: int) -> int:
        return min((first.get(trace.param_index(p), big) for p in plan.groups[i].params), default=big)

    inner = [i for i, g in enumerate(plan.groups) if not g.is_root]
    return [*sorted(inner, key=key), len(plan.groups) - 1]
