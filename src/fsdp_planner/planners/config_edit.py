"""The best edit of a job config's keys alone: its grouping kept, every checkpointing mode and
``reshard_after_forward`` rule the format can say, on the config's mesh or auto's, at its expert-parallel degree or
auto's (where the format has the key). A grid of a few dozen settings,
each simulated by the caller; what a plan says in those keys' terms is ``plan_setting`` (FSDP2 semantics), and what
torchtitan's job exported from an EP plan on its own MoE model runs, ``exported_setting``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fsdp_planner.choices import ACMode
from fsdp_planner.configs.torchtitan_registry import TITAN_MODELS
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.trace.records import Trace


@dataclass(frozen=True)
class Setting:
    """A job's settings that config keys express, as a plan or a config has them (None: no key can say it)."""

    ac: ACMode | None
    reshard: str | None  # "default", "always", "never"
    mesh: Mesh
    offload: bool
    ep: int = 1  # the expert-parallel degree (1: none)
    tp: int = 1  # the tensor-parallel degree (1: none); an edit keeps the config's


def plan_setting(plan: Plan, tr: Trace, world: int) -> Setting:
    """What config keys would say of ``plan``: uniform checkpointing of the blocks, one reshard rule."""
    blocks = set(block_instances(tr))
    full, op = set(plan.activation_checkpointing), set(plan.selective_checkpointing)
    ac = (ACMode.NONE if not full and not op else ACMode.FULL if full == blocks and not op
          else ACMode.OP if op == blocks and not full else None)
    flags = [g.reshard_after_forward for g in plan.inner_groups]
    reshard = ("always" if all(f is True for f in flags) else "never" if all(f is False for f in flags)
               else "default" if flags and all(f is True for f in flags[:-1]) and flags[-1] is False else None)
    return Setting(ac, reshard, plan.layout(world), plan.offload, plan.ep_degree, plan.tp_degree)


def best_edit(modes: Sequence[ACMode], rules: Sequence[str], old: Setting, new: Setting,
              step: Callable[[Setting], StepReport | None], fits: Callable[[int], bool],
              before: StepReport, ep_key: bool = True) -> tuple[Setting, StepReport] | None:
    """The fastest setting (checkpointing ``modes`` x reshard ``rules`` x the config's or auto's mesh x its or
    auto's CPU offload x its or auto's EP degree, where the format has a key for it: ``ep_key``) whose step
    (``step``: None when the config's policy cannot take it) fits and beats ``before``, or, where ``before`` is over
    the budget, the fastest that fits; None when none does."""
    best: tuple[Setting, StepReport] | None = None
    over = not fits(before.reserved_memory)  # (any edit that fits beats a job that does not)
    # (auto's mesh at its own TP degree only: an edit keeps the config's)
    for mode, rule, mesh, offload, ep in itertools.product(modes, dict.fromkeys([old.reshard, *rules]),
                                                           dict.fromkeys([old.mesh, new.mesh][:1 + (new.tp == old.tp)]),
                                                           dict.fromkeys([old.offload, new.offload]),
                                                           dict.fromkeys([old.ep, new.ep] if ep_key else [old.ep])):
        setting = Setting(mode, rule, mesh, offload, ep, old.tp)
        if setting == old:
            continue
        r = step(setting)
        bar = best[1].step_time if best else float("inf") if over else before.step_time
        if r is not None and fits(r.reserved_memory) and r.step_time < bar:
            best = (setting, r)
    return best


def keeps_torchtitan_groups(plan: Plan) -> bool:
    """Whether ``fsdp_planner_job()`` keeps torchtitan's own parallelize_fn: expert parallelism on torchtitan's MoE
    model, whose routed experts torchtitan lays out itself. The job then runs torchtitan's groups with the plan's
    one checkpointing class and reshard rule (``exported_setting``), not the plan's groups."""
    return plan.expert_parallel is not None and plan.model in TITAN_MODELS.values()


def exported_setting(plan: Plan, mesh: Mesh) -> Setting:
    """The settings ``fsdp_planner_job()``'s keys give a job that keeps torchtitan's groups, as a config edit on
    ``mesh``: its one checkpointing class and one reshard rule (as ``apply/torchtitan_job.py`` writes them), the
    plan's offload and EP degree."""
    return Setting(job_ac(plan), reshard_rule(plan), mesh, plan.offload, plan.ep_degree, plan.tp_degree)


def job_ac(plan: Plan) -> ACMode:
    """The one checkpointing mode a job config gives every block for ``plan``: op-level where it checkpoints any
    block so, else full where any, else none."""
    return ACMode.OP if plan.selective_checkpointing else ACMode.FULL if plan.activation_checkpointing else ACMode.NONE


def reshard_rule(plan: Plan) -> str:
    """torchtitan's one ``fsdp_reshard_after_forward`` for the plan's groups: "always" or "never" where every group
    agrees, else "default" (a size to reshard to has no torchtitan key)."""
    values = [g.reshard_after_forward for g in plan.inner_groups]
    if values and all(v is True for v in values):
        return "always"
    if values and all(v is False for v in values):
        return "never"
    return "default"
