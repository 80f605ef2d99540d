"""Whether a plan runs: every op must find the params it reads unsharded.

FSDP2 unshards a group only in the hooks of the modules the group lists (and its prefetches); a param read while
its group is sharded is a DTensor shard in a plain op, and the step fails ("aten.mm.default got mixed
torch.Tensor and DTensor"), or, with some orders, silently reads a stale unsharded copy. This happens when a
parent calls a grandchild directly (``self.layer.proc(x)``, the FSDP2 docs' toy model), a non-forward method of a
sharded module runs (``generate()``, a head's ``loss()``), or a param is reused after its group resharded. The
replay (``replay.py``) knows when each group is unsharded (``Residency`` with divisor 1); here every op's params
are checked against it.
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable_name
from fsdp_planner.fsdp2.claim import hooked_in
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Schedule, build_schedule
from fsdp_planner.fsdp2.tensor_parallel import matches
from fsdp_planner.trace.chunked_loss import output_layer
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, proper_ancestors

if TYPE_CHECKING:
    import torch.nn as nn


@dataclass(frozen=True)
class ShardedRead:
    """Op ``event`` (in ``module``) reads ``param`` while its group ``group`` is sharded."""

    event: int
    param: str
    group: int
    module: str
    backward: bool
    passed_to: str | None = None  # the read is the caller's, passing the param to this module call's forward

    def describe(self, plan: Plan) -> str:
        g = plan.groups[self.group]
        phase = "backward" if self.backward else "forward"
        listed = ", ".join(f"'{m}'" for m in g.modules[:3]) + (" ..." if len(g.modules) > 3 else "")
        if self.passed_to is not None:
            return (f"'{self.module or '(root)'}' passes param '{self.param}' to '{self.passed_to}' (trace event "
                    f"{self.event + 1}) while its group {self.group} ({listed}) is sharded: the caller reads the "
                    f"param before the call's hooks run, so the group must be unsharded by then; put the param in "
                    f"the caller's group (or an enclosing one), or let '{self.passed_to}' read it itself")
        return (f"an op of '{self.module or '(root)'}' in {phase} (trace event {self.event}) reads param "
                f"'{self.param}' while its group {self.group} ({listed}) is sharded: FSDP2 unshards a group only "
                f"in the forward/backward hooks of the modules it lists, and this call runs outside them (a parent "
                f"calling a submodule of a sharded child directly, a non-forward method, or a param reused after "
                f"its group resharded); group the caller with those params, or register the method with "
                f"register_fsdp_forward_method")


def sharded_reads(trace: Trace, plan: Plan, schedule: Schedule,
                  group_params: Sequence[Sequence[int]], limit: int = 1) -> list[ShardedRead]:
    """The first ``limit`` ops that read a param of a group that is not unsharded at that moment under
    ``schedule``; empty when the plan runs. Vectorised over every (op, param) read: auto checks every candidate."""
    n = len(trace.events) + 1
    group_of = np.full(len(trace.params), -1, dtype=np.int64)
    for gi, params in enumerate(group_params):
        group_of[np.asarray(params, dtype=np.int64)] = gi
    # (a param given to a call is read by its caller, before the call's own hooks: just before its FWD_PRE, where
    # the caller's groups are unsharded and the call's are not yet: ``TraceIndex.read_arrays``)
    ops, params, passed = trace.index.read_arrays
    groups = group_of[params]
    managed = groups >= 0
    ops, params, groups, passed = ops[managed], params[managed], groups[managed], passed[managed]
    spans = sorted((r.group * n + r.start, r.group * n + r.end) for r in schedule.residency
                   if r.divisor == 1 and r.end > r.start)
    # One key space for every group (group * n + op): a read is covered when the nearest span starting at or
    # before it reaches past it; spans of a group may overlap (prefetch), hence the running maximum of the ends.
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.maximum.accumulate(np.array([e for _, e in spans], dtype=np.int64)) if spans else starts
    keys = groups * n + ops
    k = np.searchsorted(starts, keys, side="right") - 1
    inside = (k >= 0) & (keys < ends[np.maximum(k, 0)]) if spans else np.zeros(len(keys), dtype=bool)
    bad = np.flatnonzero(~inside)
    bad = bad[np.argsort(ops[bad], kind="stable")][:limit]
    events = trace.events
    out = []
    for i in bad.tolist():
        at, param = int(ops[i]), trace.params[int(params[i])].fqn
        if passed[i]:
            out.append(ShardedRead(at, param, int(groups[i]), _running(trace, at), False, events[at + 1].module))
        else:
            out.append(ShardedRead(at, param, int(groups[i]), events[at].module, events[at].backward))
    return out


def _running(trace: Trace, at: int) -> str:
    """The module whose forward runs at event ``at`` (the innermost call open there): the caller of the call whose
    FWD_PRE follows (a root calling a grandchild is the root, not the grandchild's parent: a review's case)."""
    depth, events = 0, trace.events
    for e in (events[j] for j in range(at, -1, -1)):
        if e.kind is EventKind.FWD_POST:
            depth += 1
        elif e.kind is EventKind.FWD_PRE:
            if depth == 0:
                return e.module
            depth -= 1
    return ROOT


def runnable(trace: Trace, plan: Plan) -> Plan:
    """``plan``, refused like ``check_plan_runs`` does when it reads a sharded param: what a policy returns."""
    check_plan_runs(trace, plan)
    return plan


def first_sharded_read(trace: Trace, plan: Plan, world_size: int | None = None) -> ShardedRead | None:
    """The first op that would read a param of ``plan`` while its group is sharded; None when the plan runs."""
    index = trace.index.param_index
    group_params = [[index[p] for p in g.params] for g in plan.groups]
    bad = sharded_reads(trace, plan, build_schedule(trace, plan, world_size, group_params), group_params)
    return bad[0] if bad else None


def check_plan_runs(trace: Trace, plan: Plan, world_size: int | None = None) -> None:
    """Refuse, with the first op that would fail and why, a plan that reads a sharded param (a chunked loss's
    output layer first: its sentence says what to change)."""
    if (said := chunked_head_resharded(trace, plan)) is not None:
        raise PlannerError(f"this plan cannot run: {said}")
    bad = first_sharded_read(trace, plan, world_size)
    if bad is not None:
        raise PlannerError(f"this plan cannot run: {bad.describe(plan)}")


def chunked_head_resharded(trace: Trace, plan: Plan) -> str | None:
    """Why a chunked loss's output layer would read sharded params, or None: the wrapper runs it after the model's
    forward, so a group that holds its params without hooking it must keep them gathered after forward (the root's
    group by default; torchtitan lists the layer in a group of its own, [norm, lm_head])."""
    head = output_layer(trace) if trace.loss_chunks else None
    if head is None:
        return None
    names = {trace.params[p].fqn for p in head.params}
    for k, g in enumerate(plan.groups):
        if names & set(g.params) and head.module not in hooked_in(trace, g.modules) \
                and g.reshard_after_forward is not False:
            return (f"the loss in chunks runs '{head.module}' after the model's forward, when group {k} "
                    f"({', '.join(g.modules) or '(root)'}) has resharded its params (reshard_after_forward "
                    f"{g.reshard_after_forward}): list '{head.module}' in a group of its own (torchtitan's "
                    f"[norm, lm_head]) or keep group {k} gathered after forward")
    return None


def inside_compiled(plan: Plan, compiled: Collection[str]) -> tuple[int, str, str] | None:
    """The first (group, module, block) where a group lists a module inside a block compiled whole (``compiled``,
    torchtitan's fullgraph compile of each block), whose hooks would run there: not experts sharded in their
    blocks' calls (a per-param mesh: no hooks of their own); None where there is none."""
    ep = plan.expert_parallel
    hookless = ep.modules if ep is not None and ep.per_param_mesh else ()
    return next(((i, m, b) for i, g in enumerate(plan.groups)
                 if not (hookless and all(any(matches(p, m) for p in hookless) for m in g.modules))
                 for m, b in modules_inside(g.modules, compiled)), None)


def modules_inside(modules: Collection[str], compiled: Collection[str]) -> Iterator[tuple[str, str]]:
    """(module, block) for each of ``modules`` inside one of the ``compiled`` blocks."""
    blocks = set(compiled)
    return ((m, b) for m in modules for b in proper_ancestors(m) if b in blocks) if blocks else iter(())


def own_calls_in_compiled_block(module: str, block: str) -> str:
    """Why the experts cannot be ``fully_shard``-ed in calls of their own under ``--compile``'s whole blocks (with
    its way out, ``COMPILED_EP_FIX``): FSDP2's hooks on them would run inside the block's compiled graph. Sharded in
    their blocks' calls (a per-param mesh, torchtitan's layout) they have no hooks of their own, and EP's
    all-to-alls are traced into the graph."""
    return f"{_own_calls_problem(module, block)}; {COMPILED_EP_FIX}"


def _own_calls_problem(module: str, block: str) -> str:
    return (f"the experts module '{module}' sharded in a fully_shard call of its own lies inside the block "
            f"{_block(block)} that --compile compiles whole, where FSDP2's hooks cannot run (Dynamo refuses them)")


def _block(block: str) -> str:
    return "(the root)" if block == ROOT else f"'{block}'"


COMPILED_EP_FIX = "shard the experts in their blocks' calls (--ep-placement blocks, torchtitan's layout) or plan the " \
    "blocks eager"
# what a compiled block with EP is measured with: the routing stand-in's balanced routing (a modelling limit of the
# simulator, not of the job: the code a plan exports is the same with a skew or without)
SKEW_COMPILED = ("an EP skew with compiled blocks is not modelled: what a compiled block saves is measured with "
                 "balanced routing (the busiest rank's extra rows are not in its graph); simulate the skew with the "
                 "blocks eager, or without the skew")


def compiled_groups_refusal(plan: Plan, compiled: Collection[str]) -> tuple[str, str, str] | None:
    """Why ``plan`` cannot run with ``compiled`` modules compiled whole, its way out and the module to change; None
    where it can. A group listing a module inside one (``inside_compiled``): FSDP2's hooks on it would run inside
    the compiled graph, which Dynamo refuses ("Attempted to call function marked as skipped"). Experts sharded in
    their blocks' calls (a per-param mesh) run there, EP's dispatch traced into the graph as torchtitan compiles its
    MoE blocks."""
    ep = plan.expert_parallel
    inside = inside_compiled(plan, compiled)
    if inside is None:
        return None
    i, module, block = inside
    if ep is not None and any(matches(p, module) for p in ep.modules):  # a grouping EP makes, not the user
        return _own_calls_problem(module, block), COMPILED_EP_FIX, module
    return (f"group {i} lists '{module}', inside the block {_block(block)} that --compile compiles whole: FSDP2's "
            "hooks cannot run inside a compiled graph (Dynamo refuses them)",
            "group whole blocks, plan without --compile, or keep such a module in an fp32 group of its block "
            "(--fp32-modules BLOCK)", module)


def check_compiled_groups(plan: Plan, compiled: Collection[str]) -> None:
    """Refuse a plan ``compiled_groups_refusal`` refuses, in one sentence."""
    if (refused := compiled_groups_refusal(plan, compiled)) is not None:
        problem, fix, _ = refused
        raise PlannerError(f"{problem}; {fix}")


def check_forward_methods(plan: Plan, model: nn.Module) -> None:
    """Every method the plan registers for FSDP2 (``forward_methods``) is a method of its module in ``model`` (on
    meta is enough), and not a special one (``__call__``, ``__init__``: FSDP2 would wrap them in its hooks). Checked
    on the model itself: the trace records only the methods the step called, and a torchrun job would find the
    mistake only after its ranks started."""
    import torch  # (loaded already: ``model`` is a module)

    modules = dict(model.named_modules())
    for fqn, name in plan.forward_methods:
        where = f"plan 'forward_methods' registers '{printable_name(f'{fqn}.' if fqn else '')}{name}'"
        if fqn not in modules:
            raise PlannerError(f"{where} but the model has no module '{printable_name(fqn)}'")
        if name.startswith("__") and name.endswith("__"):
            raise PlannerError(f"{where}, a special method: list the module's own methods that the step calls "
                               "(e.g. 'loss', 'generate'), never dunder names")
        if not inspect.ismethod(getattr(modules[fqn], name, None)):
            raise PlannerError(f"{where} but {type(modules[fqn]).__name__} '{fqn or '(root)'}' has no method "
                               f"'{name}'")
        if hasattr(torch.nn.Module, name) and getattr(type(modules[fqn]), name) is getattr(torch.nn.Module, name):
            raise PlannerError(f"{where}, nn.Module's own (not a forward the model defines): FSDP2 would run it "
                               "inside the group's hooks; list the module's own methods the step calls, e.g. 'loss'")
