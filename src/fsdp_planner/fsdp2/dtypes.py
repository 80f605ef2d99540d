"""One original dtype per group: what FSDP2 2.13 asserts at its first forward.

``FSDPParamGroup._init_mp_dtypes`` (lazy init) raises "FSDP expects uniform original parameter dtype" when the
params a group manages that require grad have more than one dtype. The check is on the params' own (original)
dtypes, before any cast: ``MixedPrecisionPolicy(param_dtype=...)`` does not make a group uniform. Frozen params
are not checked (FSDP2 all-gathers a group of mixed dtypes as bytes).

A policy's grouping is made uniform here by splitting: a module whose claimed params mix dtypes is replaced by
pieces (its children, recursively) each of one dtype, and the pieces of each dtype form one list group. The module
itself stays listed for its own params. A module that registers trainable params of several dtypes itself cannot
be split (``fully_shard`` manages a module's own params together): that is an error naming it.

The same split keeps apart the modules traced in fp32 (``Trace.full_precision``: BatchNorm under bf16-mixed): FSDP2
applies one ``MixedPrecisionPolicy`` per group, so theirs are groups of their own, marked ``param_dtype="fp32"``.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Group, Plan, ReshardAfterForward
from fsdp_planner.fsdp2.targets import shardable_cover
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, proper_ancestors

FP32_GROUP = " (fp32 group)"  # a param's split key: its dtype, and this when its module runs in fp32


def param_kinds(trace: Trace) -> dict[str, str]:
    """Trainable param -> what the params of one group share: their dtype, and whether their module runs in fp32."""
    fp32 = trace.full_precision_params
    return {p.fqn: p.dtype + (FP32_GROUP if i in fp32 else "") for i, p in enumerate(trace.params) if p.requires_grad}


def several_kinds(trace: Trace) -> bool:
    """Whether some groups must be split: the model trains several dtypes, or keeps modules in fp32."""
    return len(trace.index.trainable_dtypes) > 1 or bool(trace.full_precision)


def group_param_dtype(trace: Trace, params: tuple[str, ...] | list[str]) -> str:
    """``Group.param_dtype`` of a group holding ``params``: "fp32" when they all belong to modules traced in fp32."""
    if not params or not trace.full_precision:
        return ""
    index, fp32 = trace.index.param_index, trace.full_precision_params
    return "fp32" if all(index[p] in fp32 for p in params) else ""


def check_full_precision(plan: Plan, trace: Trace) -> None:
    """Refuse a plan whose fp32 groups differ from the modules the step needs in fp32: a group mixing them with
    others would run one of the two in the wrong dtype (FSDP2 applies one policy per group)."""
    if trace.compute_itemsize is None:  # traced in fp32: an fp32 group changes nothing
        return
    for i, g in enumerate(plan.groups):
        name = ", ".join(g.modules[:3]) or "(root)"
        if g.param_dtype and group_param_dtype(trace, g.params) != g.param_dtype:
            raise PlannerError(f"group {i} ({name}) has param_dtype {g.param_dtype} but holds params of modules that "
                               "run in the compute dtype; fp32 groups hold the modules that fail in it and those "
                               "--fp32-modules names: remove its param_dtype, name its modules, or make the plan again")
    for i, held in fp32_modules_computed_low(plan, trace)[:1]:
        name = ", ".join(plan.groups[i].modules[:3]) or "(root)"
        raise PlannerError(f"group {i} ({name}) holds params of {', '.join(held[:3])}"
                           f"{f' and {len(held) - 3} more' if len(held) > 3 else ''}, which fail in the compute "
                           "dtype and must run in fp32: give them groups of their own with \"param_dtype\": "
                           "\"fp32\" (or make the plan again)")


def fp32_modules_computed_low(plan: Plan, trace: Trace) -> list[tuple[int, list[str]]]:
    """(group, the modules traced in fp32 it holds params of) for each group that computes in the compute dtype
    yet holds such params: its MixedPrecisionPolicy would run them in that dtype, which their kernels refuse."""
    if trace.compute_itemsize is None:
        return []
    out = []
    for i, g in enumerate(plan.groups):
        held = [] if g.param_dtype else full_precision_modules_in(trace, g.params)
        if held:
            out.append((i, held))
    return out


def full_precision_modules_in(trace: Trace, params: tuple[str, ...] | list[str]) -> list[str]:
    """The modules traced in fp32 (``Trace.full_precision``) some of whose params are among ``params``."""
    mine, subtree = set(params), trace.index.subtree_params
    return [m for m in trace.full_precision if subtree[m] & mine]


def with_param_dtypes(trace: Trace, groups: list[Group]) -> list[Group]:
    """``groups`` with the fp32 groups marked (the root never: it holds what the split left in the compute dtype)."""
    if not trace.full_precision:
        return groups
    return [replace(g, param_dtype=group_param_dtype(trace, g.params)) if not g.is_root else g for g in groups]


def group_dtypes(plan: Plan, trace: Trace) -> list[list[str]]:
    """Per group: the distinct original dtypes of its params that require grad, in first-seen order."""
    index = trace.index.param_index
    out = []
    for g in plan.groups:
        ps = (trace.params[index[p]] for p in g.params)
        out.append(list(dict.fromkeys(p.dtype for p in ps if p.requires_grad)))
    return out


def check_uniform_dtypes(plan: Plan, trace: Trace) -> None:
    """Refuse a plan with a group FSDP2 would reject for mixed original dtypes."""
    for i, dtypes in enumerate(group_dtypes(plan, trace)):
        if len(dtypes) > 1:
            g = plan.groups[i]
            raise PlannerError(f"group {i} ({', '.join(g.modules[:3]) or '(root)'}) manages trainable params of "
                               f"several dtypes ({', '.join(dtypes)}), which FSDP2 refuses at its first forward "
                               f"(\"FSDP expects uniform original parameter dtype\"); put each dtype's modules in a "
                               f"group of their own")


def fp32_targets(trace: Trace, modules: list[str]) -> list[str]:
    """An fp32 piece's ``fully_shard`` targets: exactly the modules traced in fp32 (whose calls FSDP2's hooks must
    cast as the trace did), each once: a module inside one is replaced by it, a parent of some by them."""
    kept = trace.full_precision
    out: list[str] = []
    for m in modules:
        above = next((a for a in (m, *proper_ancestors(m)) if a in kept), None)
        out.extend([above] if above is not None else [f for f in kept if m == ROOT or f.startswith(m + ".")])
    return list(dict.fromkeys(out))


def split_by_dtype(trace: Trace, groups: list[list[str]], reshard: list[ReshardAfterForward]
                   ) -> tuple[list[list[str]], list[ReshardAfterForward]]:
    """``groups`` (the non-root groups, root implied) with every group, the root's share included, made of one
    trainable dtype; added groups reshard after forward. Unchanged when the model has one trainable dtype."""
    if not several_kinds(trace):
        return groups, reshard
    splitter = _Splitter(trace, {m for ms in groups for m in ms})
    out: list[list[str]] = []
    out_reshard: list[ReshardAfterForward] = []
    for ms, r in zip(groups, reshard, strict=True):
        pieces: dict[str | None, list[str]] = {}
        for m in ms:
            splitter.expand(m, pieces)
        frozen = pieces.pop(None, [])
        split = [fp32_targets(trace, ms) if k.endswith(FP32_GROUP) else ms for k, ms in pieces.items()] or [[]]
        # pieces without trainable params join any group but an fp32 one (whose hooks would cast their inputs)
        first = next((i for i, k in enumerate(pieces) if not k.endswith(FP32_GROUP)), 0)
        split[first] = [*split[first], *frozen]
        out.extend(split)
        out_reshard.extend([r] * len(split))
    root_pieces = splitter.expand_root()
    out.extend(root_pieces)
    out_reshard.extend([True] * len(root_pieces))
    return _listed_once(out, out_reshard) if trace.full_precision else (out, out_reshard)


def _listed_once(groups: list[list[str]], reshard: list[ReshardAfterForward]
                 ) -> tuple[list[list[str]], list[ReshardAfterForward]]:
    """Each module in its first group only: the pieces of one module kept in fp32 that several groups listed all
    name that module (``fp32_targets``); a group left with none is dropped."""
    seen: set[str] = set()
    out: list[list[str]] = []
    out_reshard: list[ReshardAfterForward] = []
    for ms, r in zip(groups, reshard, strict=True):
        kept = [m for m in ms if m not in seen]
        seen.update(kept)
        if kept or not ms:  # a group the policy gave empty stays as it was
            out.append(kept)
            out_reshard.append(r)
    return out, out_reshard


class _Splitter:
    def __init__(self, trace: Trace, listed: set[str]) -> None:
        self.trace, self.modules = trace, trace.modules
        self.dtype = param_kinds(trace)
        self.numel = {p.fqn: p.numel for p in trace.params}
        self.listed = listed
        self.owners_below = trace.index.owners_below

    def below(self, m: str) -> set[str]:
        """Trainable dtypes ``fully_shard(m)`` would claim: ``m``'s subtree without modules listed elsewhere."""
        out: set[str] = set()
        stack, seen = [m], set()
        while stack:
            x = stack.pop()
            if x in seen or (x != m and x in self.listed):
                continue
            seen.add(x)
            out.update(self.dtype[p] for p in self.modules[x].params if p in self.dtype)
            stack.extend(self.modules[x].children)
        return out

    def own(self, m: str) -> list[str]:
        dtypes = list(dict.fromkeys(self.dtype[p] for p in self.modules[m].params if p in self.dtype))
        if len(dtypes) > 1:
            where = "the root module" if m == ROOT else f"module '{m}'"
            raise PlannerError(f"{where} registers trainable params of several dtypes ({', '.join(dtypes)}) itself; "
                               f"FSDP2 manages a module's own params in one group and needs one original dtype per "
                               f"group: cast them to one dtype (the precision policy casts for compute) or freeze one")
        return dtypes

    def carve(self, m: str, keep: str | None, pieces: dict[str | None, list[str]]) -> None:
        """List apart (as pieces) the children of ``m`` whose dtypes are not ``keep``."""
        for c in self.modules[m].children:
            if c in self.listed or not self.owners_below[c]:
                continue
            ds = self.below(c)
            if not ds or ds == {keep}:
                continue
            for piece in shardable_cover(self.trace, c):
                if piece in self.listed:  # a container's child another group lists already
                    continue
                self.listed.add(piece)
                self.expand(piece, pieces)

    def expand(self, m: str, pieces: dict[str | None, list[str]]) -> None:
        ds = self.below(m)
        if len(ds) <= 1:
            pieces.setdefault(next(iter(ds), None), []).append(m)
            return
        own = self.own(m)
        keep = own[0] if own else None
        self.carve(m, keep, pieces)
        pieces.setdefault(keep, []).append(m)  # its own params and what stayed below it

    def expand_root(self) -> list[list[str]]:
        """The root's share: the root keeps its own params' dtype (else the one dtype of the params read outside
        their modules, which only the root group holds unsharded there; else the largest dtype it would hold);
        every other dtype below it becomes a list group."""
        ds = self.below(ROOT)
        plain = sorted(d for d in ds if not d.endswith(FP32_GROUP))  # the root computes as the plan: never in fp32
        if len(ds) <= 1 and ds == set(plain):  # (modules kept in fp32 alone left to it are carved out all the same)
            return []
        own = self.own(ROOT)
        params = self.trace.params
        outside = {self.dtype[params[p].fqn] for p in self.trace.index.read_outside if params[p].fqn in self.dtype}
        keep = own[0] if own else next(iter(outside)) if len(outside) == 1 else \
            max(plain, key=self._numel_of) if plain else None
        pieces: dict[str | None, list[str]] = {}
        self.carve(ROOT, keep, pieces)
        # what has the root's dtype (or none trainable) stays the root's: a ResNet's inner convs were a group of
        # their own under size, carved out beside its BatchNorms' fp32 group, with no word of why
        pieces.pop(None, None)
        pieces.pop(keep, None)
        return [fp32_targets(self.trace, ms) if k.endswith(FP32_GROUP) else ms for k, ms in pieces.items() if ms]

    def _numel_of(self, dtype: str) -> int:
        return sum(self.numel[p] for p, d in self.dtype.items() if d == dtype)
