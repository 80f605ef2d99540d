"""Grouping policies. Each turns a Trace into a Plan.

The classic ones reproduce what people use today, with their exact semantics, so they can be compared:
``ModuleWrapPolicy`` (FSDP's class-based wrapping), ``SizeBasedPolicy`` (FSDP1 ``size_based_auto_wrap_policy``),
``TorchtitanPolicy`` (torchtitan's ``apply_fsdp``). ``ExecutionOrderPolicy`` is fsdp-planner's baseline:
contiguous groups in first-use order, the root managing no params.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from fsdp_planner.errors import PlannerError
from fsdp_planner.plan import Plan, make_plan, module_children, parent_of
from fsdp_planner.trace import ROOT, Trace

_CONTAINERS = {"ModuleList", "Sequential", "ModuleDict"}


class Policy(Protocol):
    name: str

    def plan(self, trace: Trace, model: str = "") -> Plan: ...


# -- helpers over the module tree ------------------------------------------------------------------
def subtree_params(trace: Trace, fqn: str) -> frozenset[str]:
    return trace.subtree_params(fqn)


def subtree_numel(trace: Trace, fqn: str) -> int:
    return sum(trace.param(p).numel for p in subtree_params(trace, fqn))


def default_block_class(trace: Trace, in_container_only: bool = False) -> str | None:
    """The model's repeated block class: the class of a container's (ModuleList/Sequential) children that
    repeats and holds the most params; else (unless ``in_container_only``) the repeated class holding the
    most params."""
    numel = {fqn: subtree_numel(trace, fqn) for fqn in trace.modules if fqn != ROOT}

    def best(cands: Iterable[str]) -> str | None:
        count: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for fqn in cands:
            if numel[fqn] > 0:
                cls = trace.modules[fqn].cls
                count[cls] += 1
                total[cls] += numel[fqn]
        repeated = [c for c in count if count[c] >= 2]
        return max(repeated, key=lambda c: total[c]) if repeated else None

    in_container = [f for f in numel if parent_of(f) in trace.modules and trace.modules[parent_of(f)].cls
                    in _CONTAINERS and parent_of(f) != ROOT]
    return best(in_container) or (None if in_container_only else best(numel))


def find_class_instances(trace: Trace, classes: Iterable[str]) -> list[str]:
    classes = list(classes)
    present = {m.cls for m in trace.modules.values()}
    missing = [c for c in classes if c not in present]
    if missing:
        with_params = sorted({m.cls for f, m in trace.modules.items() if f != ROOT and subtree_numel(trace, f)})
        raise PlannerError(
            f"module class {', '.join(missing)} not found in the model; classes with params: "
            f"{', '.join(with_params)}"
        )
    return [f for f, m in trace.modules.items() if f != ROOT and m.cls in classes]


# -- classic policies ------------------------------------------------------------------------------
@dataclass
class ModuleWrapPolicy:
    """Every instance of ``module_classes`` is a unit (nested instances too); the root takes the rest."""

    module_classes: tuple[str, ...] = ()
    name: str = "module"

    def plan(self, trace: Trace, model: str = "") -> Plan:
        classes = self.module_classes or tuple(filter(None, [default_block_class(trace)]))
        if not classes:
            raise PlannerError("the model has no repeated block class; pass --module-classes")
        wrapped = find_class_instances(trace, classes)
        return make_plan(trace, [[m] for m in wrapped], policy=f"{self.name}({','.join(classes)})", model=model)


@dataclass
class SizeBasedPolicy:
    """FSDP1 ``size_based_auto_wrap_policy`` replayed on the module tree (``_recursive_wrap`` semantics):
    a module is recursed into when its nonwrapped numel reaches the threshold (except MultiheadAttention) and
    wrapped when its remaining numel after wrapping children still does (except ModuleList/ModuleDict)."""

    min_nonwrapped_numel: int = int(1e8)
    name: str = "size"
    force_leaf_classes: tuple[str, ...] = ("MultiheadAttention",)
    exclude_wrap_classes: tuple[str, ...] = ("ModuleList", "ModuleDict")

    def wrapped_modules(self, trace: Trace) -> list[str]:
        children = module_children(trace)
        wrapped: list[str] = []

        def visit(fqn: str, only_children: bool) -> int:
            numel = subtree_numel(trace, fqn)
            cls = trace.modules[fqn].cls
            if not (numel >= self.min_nonwrapped_numel and cls not in self.force_leaf_classes):
                return 0
            total = sum(visit(c, False) for c in children[fqn])
            remainder = numel - total
            if not only_children and remainder >= self.min_nonwrapped_numel and cls not in self.exclude_wrap_classes:
                wrapped.append(fqn)
                return numel
            return total

        visit(ROOT, True)
        return wrapped

    def plan(self, trace: Trace, model: str = "") -> Plan:
        units = self.wrapped_modules(trace)
        return make_plan(trace, [[m] for m in units], policy=f"{self.name}({self.min_nonwrapped_numel})",
                         model=model)


@dataclass
class TorchtitanPolicy:
    """torchtitan's ``apply_fsdp``: the input embedding alone, each block, [norm, output] as one list group
    kept unsharded after forward, tied weights grouped as [embedding, norm, output], the root last.

    Generalised: modules that are not blocks and own params are split into those running before the first
    block (each alone) and after it (one list group)."""

    block_class: str | None = None
    name: str = "titan"

    def plan(self, trace: Trace, model: str = "") -> Plan:
        block_cls = self.block_class or default_block_class(trace)
        if block_cls is None:
            raise PlannerError("the model has no repeated block class for the torchtitan policy")
        blocks = find_class_instances(trace, [block_cls])
        block_set = set(blocks)
        blocks = [b for b in blocks if not _has_ancestor_in(b, block_set)]
        chain: set[str] = set()  # ancestors of blocks: containers whose other children are side modules
        for b in blocks:
            a = b
            while a != ROOT:
                a = parent_of(a)
                chain.add(a)
        children = module_children(trace)
        side = [c for a in sorted(chain) for c in children[a] if c not in chain and c not in blocks
                and subtree_params(trace, c)]
        first_block = min(trace.modules[b].first_use for b in blocks if trace.modules[b].first_use >= 0) \
            if any(trace.modules[b].first_use >= 0 for b in blocks) else 0

        def first_use(fqn: str) -> int:  # ModuleInfo.first_use already covers the subtree
            use = trace.modules[fqn].first_use
            return use if use >= 0 else len(trace.events)

        side.sort(key=first_use)
        pre = [s for s in side if first_use(s) < first_block]
        post = [s for s in side if first_use(s) >= first_block]
        pre_params = {s: subtree_params(trace, s) for s in pre}
        post_params = set().union(*(subtree_params(trace, s) for s in post)) if post else set()
        tied_pre = [s for s in pre if pre_params[s] & post_params]
        groups: list[list[str]] = []
        reshard: list[bool | int] = []
        for s in pre:
            if s not in tied_pre:
                groups.append([s])
                reshard.append(True)
        for b in blocks:
            groups.append([b])
            reshard.append(True)
        if post or tied_pre:
            groups.append(tied_pre + post)
            reshard.append(False)
        return make_plan(trace, groups, reshard, policy=f"{self.name}({block_cls})", model=model)


# -- fsdp-planner's execution-order baseline -------------------------------------------------------
def atoms_in_execution_order(trace: Trace, whole: Iterable[str] = ()) -> list[tuple[list[str], int]]:
    """Indivisible units with their bytes, sorted by the first use of their params (unused ones last):
    param-owning modules, merged when they share (tied) params or lie in the same ``whole`` module."""
    owners = trace.owning_modules()
    parent = {m: m for m in owners}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in trace.params:
        for o in p.owners[1:]:
            parent[find(o)] = find(p.owners[0])
    whole_set = set(whole)
    first_inside: dict[str, str] = {}  # outermost whole module -> the first owner found inside it
    for m in owners:
        w, a = None, m
        while True:
            if a in whole_set:
                w = a
            if a == ROOT:
                break
            a = parent_of(a)
        if w is None:
            continue
        if w in first_inside:
            parent[find(m)] = find(first_inside[w])
        else:
            first_inside[w] = m
    members: dict[str, list[str]] = {}
    for m in owners:
        members.setdefault(find(m), []).append(m)
    big = len(trace.events) + 1
    first = trace.param_first_use()
    reg = {m: i for i, m in enumerate(trace.modules)}
    atoms = []
    for ms in members.values():
        params = {p for m in ms for p in trace.modules[m].params}
        nbytes = sum(trace.param(p).nbytes for p in params)
        start = min((first.get(trace.param_index(p), big) for p in params), default=big)
        atoms.append((start, min(reg[m] for m in ms), ms, nbytes))
    atoms.sort(key=lambda a: (a[0], a[1]))
    return [(a[2], a[3]) for a in atoms]


def compress_modules(trace: Trace, modules: list[str], children: dict[str, list[str]] | None = None) -> list[str]:
    """Replace sets of modules that cover a whole subtree's param-owning modules by the subtree's root, so a
    group reads ``[layers.3]`` instead of its 9 leaves (same params, one hook)."""
    children = children or module_children(trace)
    mine = set(modules)
    covered: dict[str, bool] = {}

    def covers(fqn: str) -> bool:  # every param-owning module in fqn's subtree is in this group
        if fqn not in covered:
            own_ok = not trace.modules[fqn].params or fqn in mine
            covered[fqn] = own_ok and all(covers(c) for c in children[fqn])
        return covered[fqn]

    tops: dict[str, None] = {}
    for m in modules:
        top = m
        a = m
        while a != ROOT:
            a = parent_of(a)
            if a == ROOT or not covers(a):
                break
            top = a
        tops[top] = None
    return [t for t in tops if not _has_ancestor_in(t, tops)]


def _has_ancestor_in(fqn: str, fqns: dict[str, None] | set[str]) -> bool:
    """Whether a proper ancestor of ``fqn`` (other than the root) is in ``fqns``."""
    a = fqn
    while a:
        a = parent_of(a)
        if a and a in fqns:
            return True
    return False


@dataclass
class ExecutionOrderPolicy:
    """Contiguous groups in first-use order, closed before they would exceed ``target_bytes``; tied params
    stay in one group; the root manages no params; the last group to run forward stays unsharded after
    forward (it is needed first in backward).

    Default target: one repeated block's bytes, blocks kept whole (the transformer-block granularity people
    tune by hand; a smaller target splits blocks); a model without a container of repeated blocks (e.g. a CNN)
    gets one group per param-owning module. Groups under 1/16 of the target join their smaller neighbour, so a
    lone norm does not cost a collective of its own."""

    target_bytes: int | None = None
    name: str = "order"

    def plan(self, trace: Trace, model: str = "") -> Plan:
        block_cls = default_block_class(trace, in_container_only=True)
        blocks = [f for f, m in trace.modules.items() if block_cls and m.cls == block_cls]
        block_bytes = max((sum(trace.param(p).nbytes for p in subtree_params(trace, b)) for b in blocks), default=0)
        target = block_bytes if self.target_bytes is None else self.target_bytes
        # blocks stay whole unless the target asks for groups smaller than a block
        atoms = atoms_in_execution_order(trace, whole=blocks if target >= block_bytes else ())
        sized: list[tuple[list[str], int]] = []
        for mods, nbytes in atoms:
            if sized and sized[-1][1] + nbytes <= target:
                sized[-1] = (sized[-1][0] + mods, sized[-1][1] + nbytes)
            else:
                sized.append((list(mods), nbytes))
        sized = _merge_small(sized, target / 16)
        children = module_children(trace)
        groups = [compress_modules(trace, g, children) for g, _ in sized]
        reshard: list[bool | int] = [True] * len(groups)
        used = [i for i, g in enumerate(groups) if any(trace.modules[m].first_use >= 0 for m in g)]
        if used:
            reshard[used[-1]] = False
        label = _fmt_bytes(target) if target else "per-module"
        return make_plan(trace, groups, reshard, policy=f"{self.name}({label})", model=model)


def _merge_small(groups: list[tuple[list[str], int]], floor: float) -> list[tuple[list[str], int]]:
    """Merge each group smaller than ``floor`` into its smaller neighbour (order is kept)."""
    groups = list(groups)
    while len(groups) > 1:
        small = [i for i, (_, b) in enumerate(groups) if b < floor]
        if not small:
            break
        i = min(small, key=lambda k: groups[k][1])
        left = groups[i - 1][1] if i > 0 else float("inf")
        right = groups[i + 1][1] if i + 1 < len(groups) else float("inf")
        j = i - 1 if left <= right else i + 1
        a, b = min(i, j), max(i, j)
        groups[a:b + 1] = [(groups[a][0] + groups[b][0], groups[a][1] + groups[b][1])]
    return groups


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


POLICY_NAMES = ("module", "size", "titan", "order")


def make_policy(name: str, module_classes: tuple[str, ...] = (), min_nonwrapped_numel: int | None = None,
                target_bytes: int | None = None) -> Policy:
    if name == "module":
        return ModuleWrapPolicy(module_classes)
    if name == "size":
        return SizeBasedPolicy(min_nonwrapped_numel if min_nonwrapped_numel is not None else int(1e8))
    if name == "titan":
        return TorchtitanPolicy(module_classes[0] if module_classes else None)
    if name == "order":
        return ExecutionOrderPolicy(target_bytes)
    raise PlannerError(f"unknown policy '{name}': choose one of {', '.join(POLICY_NAMES)}")
