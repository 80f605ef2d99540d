"""fsdp-planner's execution-order baseline: contiguous groups in first-use order, the root managing nothing.

Also the pieces other planners build on: atoms (the indivisible units of grouping) and naming a group by the
fewest modules (``compress_modules``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fsdp_planner.arguments import check_fields, checked
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, parse_size
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan, ReshardAfterForward
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.planners.repair import joined_until_runnable
from fsdp_planner.trace.index import CONTAINERS
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, parent_of, proper_ancestors


def atoms_in_execution_order(trace: Trace, whole: Iterable[str] = ()) -> list[tuple[list[str], int]]:
    """Indivisible units with their bytes, sorted by the first use of their params (unused ones last): modules
    that own params, merged when they share (tied) params or lie in the same ``whole`` module, or in the caller of a
    module given one tensor in several inputs (``ModuleInfo.aliased_inputs``: listed alone, FSDP2's hooks would hand
    it distinct tensors, and nn.MultiheadAttention would run other than traced). Params registered on the root
    module (and modules sharing a param with it) are in no atom: only the root's own ``fully_shard`` can manage
    them."""
    root_tied = {o for p in trace.params if ROOT in p.owners for o in p.owners}
    owners = [m for m in trace.index.owning_modules if m not in root_tied and m != ROOT]
    parent = {m: m for m in owners}
    whole = [*whole, *(up for m, info in trace.modules.items() if info.aliased_inputs and m != ROOT
                       and (up := _caller(trace, m)) != ROOT)]

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in trace.params:
        tied = [o for o in p.owners if o in parent]
        for o in tied[1:]:
            parent[find(o)] = find(tied[0])
    whole_set = set(whole)
    first_inside: dict[str, str] = {}  # outermost whole module -> the first owner found inside it
    for m in owners:
        outermost = next((a for a in reversed([m, *proper_ancestors(m)]) if a in whole_set), None)
        if outermost is None:
            continue
        if outermost in first_inside:
            parent[find(m)] = find(first_inside[outermost])
        else:
            first_inside[outermost] = m
    members: dict[str, list[str]] = {}
    for m in owners:
        members.setdefault(find(m), []).append(m)
    never = len(trace.events) + 1
    first, index = trace.index.first_use, trace.index.param_index
    registered = trace.index.registration
    atoms = []
    for ms in members.values():
        params = {p for m in ms for p in trace.modules[m].params}
        nbytes = sum(trace.param(p).nbytes for p in params)
        start = min((first.get(index[p], never) for p in params), default=never)
        atoms.append((start, min(registered[m] for m in ms), ms, nbytes))
    atoms.sort(key=lambda a: (a[0], a[1]))
    return [(a[2], a[3]) for a in atoms]


def _caller(trace: Trace, fqn: str) -> str:
    """The module that calls ``fqn``: its first ancestor that is no container (ModuleList, Sequential, ModuleDict:
    kept whole, a list would make one atom of a whole stack of blocks)."""
    up = parent_of(fqn)
    while up != ROOT and trace.modules[up].cls in CONTAINERS:
        up = parent_of(up)
    return up


def compress_modules(trace: Trace, modules: Sequence[str]) -> list[str]:
    """Replace sets of modules that cover a whole subtree's param-owning modules by the subtree's root, so a group
    reads ``[layers.3]`` instead of its 9 leaves (same params, one hook). The root module is never used, nor is a
    module whose calls do not enclose a call below it (``not_enclosing``: a module below called while it is not
    running, through a method or another parent): its hooks would not run around
    that call, which would read the group's params sharded (and FSDP2 hooks no listed module below another); nor
    a module of ``Trace.cast_inputs`` or one above it: FSDP2 casts its inputs only while it is listed and hooked,
    so no module above it is listed beside it."""
    mine = set(modules)
    cast = set(trace.cast_inputs)
    above_cast = {a for c in cast for a in proper_ancestors(c)}  # listed beside it, they would unhook it
    owners_below = trace.index.owners_below
    not_enclosing = trace.index.not_enclosing
    covered: dict[str, bool] = {}  # module -> every param-owning module below it is ours
    top_of: dict[str, str] = {}  # module -> the outermost module above it (or itself) whose subtree is all ours
    tops: dict[str, None] = {}
    for m in modules:
        path, a = [], m
        while a not in top_of:
            path.append(a)
            up = parent_of(a)
            if a != ROOT and up != ROOT and up not in covered:
                covered[up] = owners_below[up] <= mine
            if a == ROOT or up == ROOT or not covered[up] or up in not_enclosing or a in cast or up in above_cast:
                top_of[a] = a
                break
            a = up
        top = top_of[a]
        for x in path:
            top_of[x] = top
        tops[top] = None
    # a top below another that encloses its calls needs no hooks of its own (JetMoE's experts' linears, called
    # through the experts' ``map`` but within their layer's call)
    return [t for t in tops if t in cast or not any(a in tops and a not in not_enclosing for a in proper_ancestors(t))]


@dataclass
class ExecutionOrderPolicy:
    """Contiguous groups in first-use order, closed before they would exceed ``target_bytes``; tied params stay in
    one group; the root manages no params (but those registered on it, and those the forward reads outside their
    modules); the last group to run forward stays
    unsharded after forward (it is needed first in backward).

    Default target: one repeated block's bytes, blocks kept whole (the transformer-block granularity people tune
    by hand; a smaller target splits blocks); a model without a container of repeated blocks (e.g. a CNN) gets one
    group per param-owning module. Groups under 1/16 of the target join their smaller neighbour, so a lone norm
    does not cost a collective of its own. Like the classic policies, ``plan`` refuses the grouping when FSDP2
    could not run it (``build`` gives it regardless)."""

    target_bytes: int | None = None
    name: str = "order"

    def __post_init__(self) -> None:
        if isinstance(self.target_bytes, str):  # "64MiB", as --target-bytes reads it
            self.target_bytes = parse_size(self.target_bytes, "target_bytes")
        check_fields(self)
        if self.target_bytes is not None and (isinstance(self.target_bytes, bool) or self.target_bytes < 1):
            raise PlannerError(f"the order policy's target group size must be at least 1 byte, got {self.target_bytes}")

    @checked
    def plan(self, trace: Trace, model: str | None = "") -> Plan:
        """``build``'s plan, a group FSDP2 could not run joined to the next (``joined_until_runnable``); a
        PlannerError naming the op that would read a sharded param when no join makes it run."""
        return joined_until_runnable(trace, self.build(trace, model))

    def build(self, trace: Trace, model: str = "") -> Plan:
        """The grouping the policy's rules make, whether or not FSDP2 can run it (auto starts from it)."""
        blocks = block_instances(trace)
        subtree = trace.index.subtree_params
        block_bytes = max((sum(trace.param(p).nbytes for p in subtree[b]) for b in blocks), default=0)
        target = block_bytes if self.target_bytes is None else self.target_bytes
        # blocks stay whole unless the target asks for groups smaller than a block
        atoms = atoms_in_execution_order(trace, whole=blocks if target >= block_bytes else ())
        # an atom whose params the forward all reads outside their modules (GPT-2's head multiplying by wte.weight
        # in the root's forward) stays with the root, the one group unsharded there: joining its group to the next
        # until it ran made one group of a whole GPT-2
        outside = {trace.params[i].fqn for i in trace.index.read_outside}
        atoms = [(mods, nbytes) for mods, nbytes in atoms if not set().union(*(subtree[m] for m in mods)) <= outside]
        runs: list[Run] = []
        for mods, nbytes in atoms:
            # a module called more than once keeps a group of its own: FSDP2 can fail in backward when a module
            # of a list group is reused later in the step (pytorch#183702); so does an unused one (never gathered
            # alone; in a list group, gathered again in backward: ModuleInfo.unused)
            alone = any(trace.modules[m].calls > 1 for m in mods) or all(trace.modules[m].unused for m in mods)
            if runs and not alone and not runs[-1].alone and runs[-1].nbytes + nbytes <= target:
                runs[-1] = Run(runs[-1].modules + mods, runs[-1].nbytes + nbytes)
            else:
                runs.append(Run(list(mods), nbytes, alone))
        groups = [compress_modules(trace, r.modules) for r in merge_small(runs, target / 16)]
        reshard: list[ReshardAfterForward] = [True] * len(groups)
        used = [i for i, g in enumerate(groups) if any(trace.modules[m].first_use >= 0 for m in g)]
        if used:
            reshard[used[-1]] = False
        label = fmt_bytes(target) if target else "per-module"
        return make_plan(trace, groups, reshard, policy=f"{self.name}({label})", model=model)


@dataclass
class Run:
    """Consecutive atoms that form one group."""

    modules: list[str]
    nbytes: int
    alone: bool = False  # never merged with a neighbour


def merge_small(runs: list[Run], floor: float) -> list[Run]:
    """Merge each run smaller than ``floor`` into its smaller neighbour (order is kept; ``alone`` runs take no part)."""
    runs = list(runs)
    while True:
        small = [i for i, r in enumerate(runs) if r.nbytes < floor and not r.alone]
        if not small:
            return runs
        i = min(small, key=lambda k: runs[k].nbytes)
        sizes = {j: runs[j].nbytes for j in (i - 1, i + 1) if 0 <= j < len(runs) and not runs[j].alone}
        if not sizes:
            runs[i] = Run(runs[i].modules, runs[i].nbytes, alone=True)  # no neighbour can take it
            continue
        j = min(sizes, key=lambda k: (sizes[k], k))
        a, b = min(i, j), max(i, j)
        runs[a:b + 1] = [Run(runs[a].modules + runs[b].modules, runs[a].nbytes + runs[b].nbytes)]
