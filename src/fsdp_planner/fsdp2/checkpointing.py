"""Activation checkpointing in a plan: which modules are checkpointed, whether FSDP2 can run it, and applying it.

A plan's ``activation_checkpointing`` lists modules whose every call is checkpointed in full: the call keeps only
its inputs alive after forward, and its forward is run again at the start of its backward (non-reentrant
``torch.utils.checkpoint``). ``apply_checkpointing`` uses the composable ``torch.distributed._composable.checkpoint``
hooks, so module names (and the plan's, and the state dict's) stay as they are, unlike ``checkpoint_wrapper``; it
runs before ``fully_shard``, the order torchtitan uses, so FSDP2's hooks run outside the checkpointed region.

The ``--ac`` choices for whole-model policies, as torchtitan's ``activation_checkpoint`` config names them:
``full`` checkpoints every block; ``selective`` is torchtitan's layer-level selective option with frequency 2
(``selective_ac_option = "2"``): every second block, counting from the first (blocks 1, 3, 5, ... 0-based).
torchtitan's op-level option ("op", a per-op save list) is not modelled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

from fsdp_planner.choices import ACMode
from fsdp_planner.errors import PlannerError
from fsdp_planner.trace.tree import ROOT, is_within

if TYPE_CHECKING:
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.trace.records import Trace


SELECTIVE_EVERY = 2  # torchtitan's layer-level selective frequency this mode reproduces


def checkpointed_blocks(trace: Trace, mode: ACMode) -> list[str]:
    """The modules ``mode`` checkpoints: none, every block, or every second block."""
    if mode is ACMode.NONE:
        return []
    cls = trace.index.container_block_class
    blocks = [f for f, m in trace.modules.items() if cls and m.cls == cls]
    if not blocks:
        raise PlannerError(f"--ac {mode.value} checkpoints the model's repeated blocks, and this model has none "
                           "(no repeated module class in a ModuleList or Sequential); list the modules to "
                           "checkpoint in a plan file's \"activation_checkpointing\" instead")
    if mode is ACMode.FULL:
        return blocks
    return [b for k, b in enumerate(blocks, start=1) if k % SELECTIVE_EVERY == 0]


def check_checkpointing(plan: Plan, trace: Trace) -> None:
    """PlannerError when the plan's checkpointed modules are not something this planner models and FSDP2 runs:
    each must be a module of the model, called in the step, not inside another checkpointed module, and hold no
    FSDP group inside it (an inner group's hooks would run again during the recomputation)."""
    names = plan.activation_checkpointing
    unknown = [m for m in names if m not in trace.modules]
    if unknown:
        raise PlannerError(f"activation_checkpointing names modules the model does not have: {', '.join(unknown[:5])}")
    for m in names:
        if m == ROOT:
            raise PlannerError("activation_checkpointing cannot name the root module ''; name its blocks")
        if not trace.modules[m].calls:
            raise PlannerError(f"activation_checkpointing names '{m}', which the step never calls")
        outer = next((o for o in names if o != m and is_within(m, o)), None)
        if outer is not None:
            raise PlannerError(f"activation_checkpointing names '{m}' inside '{outer}', which is checkpointed too; "
                               "name one of them")
        inner = next((g for grp in plan.groups for g in grp.modules if g != m and is_within(g, m)), None)
        if inner is not None:
            raise PlannerError(f"checkpointed module '{m}' holds the FSDP group module '{inner}'; checkpoint a "
                               f"module that no group lies inside (e.g. make '{m}' the group)")


def apply_checkpointing(model: nn.Module, names: list[str]) -> None:
    """Checkpoint each named module in place (composable hooks, names unchanged); before ``fully_shard``."""
    from torch.distributed._composable import checkpoint

    modules = dict(model.named_modules())
    for name in names:
        if name not in modules:
            raise PlannerError(f"activation_checkpointing names a module the model does not have: '{name}'")
        checkpoint(modules[name])
