"""A plan made for a large cluster, run on a small job: what ``verify --plan-for CLUSTER`` proves.

On a small model and a small job auto picks one group (a few microseconds of collectives never pay for the hooks
of more), so verifying ``--policy auto`` there proves little about the per-block plans the same search makes at
scale. ``--plan-for`` plans with the large cluster's figures and world size instead, optionally for the full-size
model of the same family (``--plan-model``), and this module carries that grouping onto the job's model and ranks:

- groups: each keeps the modules the job's model has (same names: the same model code at another size); a group
  left with none (blocks beyond the small model's depth) is dropped, and the root takes what no group claims;
- ``reshard_after_forward``: kept, but an int sub-group size that does not divide the job's ranks becomes True
  (reshard in full: the intra-node sub-group has no counterpart on a few CPU ranks);
- the HSDP layout: the job runs plain FSDP over its ranks (the replicas' all-reduce is not proven);
- prefetch lists: kept, their targets renumbered as the groups carried over are (those of groups left out left out;
  a group the job's model joins to another, one tied param between them, has the lists of both);
- activation checkpointing: the modules the job's model has.
What is proven is the grouping's mechanics (claims, collectives and their bytes, training parity), not its speed.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Group, Plan, ReshardAfterForward
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import is_within


def onto_job(plan: Plan, planned: Trace, job: Trace, nproc: int, label: str) -> tuple[Plan, list[str]]:
    """``plan`` (made for ``planned``'s model) as ``job``'s model runs it on ``nproc`` ranks, and notes saying
    what did not carry over (module docstring). ``label``: the plan's new policy name."""
    notes: list[str] = []
    if plan.mesh is not None and plan.mesh.replicate > 1:
        notes.append(f"the plan's HSDP layout {plan.mesh.describe()} runs as plain FSDP over {nproc} ranks "
                     "(its all-reduce across replicas is not proven)")
    reshard = [_reshard_on(g.reshard_after_forward, nproc, i, notes) for i, g in enumerate(plan.groups)]
    if planned is job:  # the plan's own groups: only the layout and the sub-group sizes change
        groups = [replace(g, reshard_after_forward=r) for g, r in zip(plan.groups, reshard, strict=True)]
        return replace(plan, groups=groups, mesh=None, policy=label), notes
    kept = [(i, [m for m in g.modules if m in job.modules], r)
            for i, (g, r) in enumerate(zip(plan.inner_groups, reshard[:-1], strict=True))]
    kept = [(i, ms, r) for i, ms, r in kept if ms]
    if not kept:
        groups = fmt_count(len(plan.inner_groups), "group")
        raise PlannerError(f"no group of the plan made for the larger model ({groups}) names a module this model "
                           "has: --plan-model must be the same model code at another size (e.g. llama3-8b for "
                           "toy-llama)")
    dropped = len(plan.inner_groups) - len(kept)
    if dropped:
        notes.append(f"{dropped} of the plan's {len(plan.inner_groups)} groups below its root hold only modules this "
                     "model does not have (blocks deeper than its own, or modules it names otherwise) and are left "
                     "out")
    out = make_plan(job, [ms for _, ms, _ in kept], [r for _, _, r in kept], policy=label, model=plan.model)
    if [list(g.modules) for g in out.inner_groups] != [ms for _, ms, _ in kept]:
        notes.append(f"the {fmt_count(len(kept), 'group')} carried over are regrouped on this model, as "
                     f"{len(out.inner_groups)} (make_plan: the modules sharing a param it ties go into one group, a "
                     "module of another dtype apart, a group claiming no param of its own is dropped)")
    home = _homes(plan, out, [(old, ms) for old, ms, _ in kept])
    groups = [_prefetching(g, new, [plan.groups[old] for old, at in home.items() if at == new], home, notes)
              for new, g in enumerate(out.inner_groups)]
    root = _prefetching(replace(out.root, reshard_after_forward=reshard[-1]), len(out.inner_groups), [plan.root],
                        home, notes)
    out = replace(out, groups=[*groups, root],
                  activation_checkpointing=[m for m in plan.activation_checkpointing if m in job.modules])
    carried = sum(job.param(p).numel for g in out.inner_groups for p in g.params)
    if carried * 2 < job.numel:  # (the job's root holds most of it: little of the plan's grouping is run)
        notes.append(f"the groups carried over hold {carried / job.numel:.0%} of this model's params, its root the "
                     "rest (the modules the plan's groups do not name): the run proves little of the plan's grouping "
                     "(--plan-model should be the same model code at another size)")
    return out, notes


def _homes(plan: Plan, out: Plan, kept: list[tuple[int, list[str]]]) -> dict[int, int]:
    """Each carried group's home (its index in ``plan`` -> in ``out``): the job's group holding its modules
    (make_plan joins, splits or drops groups where the job's model differs from the planned one; a group's prefetch
    lists are then those of the groups it holds); the root's, last."""
    home = {old: new for old, ms in kept
            if (new := next((i for i, g in enumerate(out.inner_groups)
                             if any(is_within(m, k) or is_within(k, m) for m in g.modules for k in ms)), None))
            is not None}
    home[len(plan.inner_groups)] = len(out.inner_groups)
    return home


def _prefetching(group: Group, index: int, planned: list[Group], at: dict[int, int], notes: list[str]) -> Group:
    """``group`` (the job's group ``index``) with the prefetch lists of the groups it holds (``planned``), their
    targets renumbered by ``at`` (old index -> new), each once and none its own; targets left out with their
    groups are noted once."""
    lists = []
    for kind in ("forward_prefetch", "backward_prefetch"):
        targets = [j for p in planned for j in getattr(p, kind)]
        lists.append(tuple(dict.fromkeys(at[j] for j in targets if j in at and at[j] != index)))
        if any(j not in at for j in targets) and not any("prefetch" in n for n in notes):
            notes.append("the prefetch lists' targets among the groups left out are left out too")
    return replace(group, forward_prefetch=lists[0], backward_prefetch=lists[1])


def _reshard_on(raf: ReshardAfterForward, nproc: int, group: int, notes: list[str]) -> ReshardAfterForward:
    """An int sub-group size the job's ranks cannot hold becomes True (reshard in full)."""
    if isinstance(raf, bool) or (raf <= nproc and nproc % raf == 0):
        return raf
    notes.append(f"group {group}'s reshard_after_forward={raf} (a sub-group of the larger cluster) runs as true "
                 f"on {nproc} ranks")
    return True
