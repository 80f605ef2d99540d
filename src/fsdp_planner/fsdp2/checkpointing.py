"""Activation checkpointing in a plan: which modules are checkpointed, whether FSDP2 can run it, and applying it.

A plan's ``activation_checkpointing`` lists modules whose every call is checkpointed in full: the call keeps only
its inputs alive after forward, and its forward is run again at the start of its backward (non-reentrant
``torch.utils.checkpoint``). Its ``selective_checkpointing`` maps modules to an op-level selective checkpointing
policy (``selective.py``): the call keeps its inputs and the outputs of the ops the policy saves, and runs the
others again. ``apply_checkpointing`` uses the composable ``torch.distributed._composable.checkpoint``
hooks, so module names (and the plan's, and the state dict's) stay as they are, unlike ``checkpoint_wrapper``; it
runs before ``fully_shard``, the order torchtitan uses, so FSDP2's hooks run outside the checkpointed region.

The ``--ac`` choices for whole-model policies, after torchtitan's ``activation_checkpoint`` config: ``full``
checkpoints every block; ``op`` checkpoints every block with op-level selective checkpointing (torchtitan's
``mode = "selective"``, ``selective_ac_option = "op"``, its default), the policy chosen by ``--ac-policy``;
``selective`` is torchtitan's removed layer-level option with frequency 2 (``selective_ac_option = "2"``): every
second block in full, counting from the first (blocks 1, 3, 5, ... 0-based).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdp_planner.choices import ACMode, SacPolicy
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.selective import sac_context_fn
from fsdp_planner.trace.tree import ROOT, is_within

if TYPE_CHECKING:
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.trace.records import Trace


SELECTIVE_EVERY = 2  # torchtitan's layer-level selective frequency this mode reproduces

# What a plan checkpoints, as the simulator keys it: (module, None for full or its op-level policy), full first.
Checkpointing = tuple[tuple[str, SacPolicy | None], ...]


def plan_checkpointing(plan: Plan) -> Checkpointing:
    """The plan's checkpointed modules and how each is checkpointed."""
    return (*((m, None) for m in plan.activation_checkpointing), *plan.selective_checkpointing.items())


def checkpoint_blocks(plan: Plan, trace: Trace, mode: ACMode, policy: SacPolicy) -> None:
    """Set ``plan``'s checkpointing to what ``mode`` checkpoints (``op``: with ``policy``), and label it."""
    blocks = checkpointed_blocks(trace, mode)
    if mode is ACMode.OP:
        plan.activation_checkpointing, plan.selective_checkpointing = [], dict.fromkeys(blocks, policy)
        plan.policy = f"{plan.policy} + ac op {policy.value}"
    else:
        plan.activation_checkpointing, plan.selective_checkpointing = blocks, {}
        plan.policy = f"{plan.policy} + ac {mode.value}" if mode is not ACMode.NONE else plan.policy


def checkpointed_blocks(trace: Trace, mode: ACMode) -> list[str]:
    """The modules ``mode`` checkpoints: none, every block (full or op-level), or every second block."""
    if mode is ACMode.NONE:
        return []
    cls = trace.index.container_block_class
    blocks = [f for f, m in trace.modules.items() if cls and m.cls == cls]
    if not blocks:
        key = "selective_checkpointing" if mode is ACMode.OP else "activation_checkpointing"
        raise PlannerError(f"--ac {mode.value} checkpoints the model's repeated blocks, and this model has none "
                           "(no repeated module class in a ModuleList or Sequential); list the modules to "
                           f"checkpoint in a plan file's \"{key}\" instead")
    if mode in (ACMode.FULL, ACMode.OP):
        return blocks
    return [b for k, b in enumerate(blocks, start=1) if k % SELECTIVE_EVERY == 0]


def check_checkpointing(plan: Plan, trace: Trace) -> None:
    """PlannerError when the plan's checkpointed modules are not something this planner models and FSDP2 runs:
    each must be a module of the model, called in the step, not inside another checkpointed module, and hold no
    FSDP group inside it (an inner group's hooks would run again during the recomputation)."""
    names = [m for m, _ in plan_checkpointing(plan)]
    twice = next((m for m in plan.selective_checkpointing if m in plan.activation_checkpointing), None)
    if twice is not None:
        raise PlannerError(f"'{twice}' is in both activation_checkpointing and selective_checkpointing; a module is "
                           "checkpointed one way")

    def field(m: str) -> str:  # the plan key that names ``m``, for the message
        return "selective_checkpointing" if m in plan.selective_checkpointing else "activation_checkpointing"

    unknown = [m for m in names if m not in trace.modules]
    if unknown:
        raise PlannerError(f"{field(unknown[0])} names modules the model does not have: {', '.join(unknown[:5])}")
    for m in names:
        if m == ROOT:
            raise PlannerError(f"{field(m)} cannot name the root module ''; name its blocks")
        if not trace.modules[m].calls:
            raise PlannerError(f"{field(m)} names '{m}', which the step never calls")
        outer = next((o for o in names if o != m and is_within(m, o)), None)
        if outer is not None:
            raise PlannerError(f"{field(m)} names '{m}' inside '{outer}', which is checkpointed too; name one of them")
        inner = next((g for grp in plan.groups for g in grp.modules if g != m and is_within(g, m)), None)
        if inner is not None:
            raise PlannerError(f"checkpointed module '{m}' holds the FSDP group module '{inner}'; checkpoint a "
                               f"module that no group lies inside (e.g. make '{m}' the group)")


def apply_checkpointing(model: nn.Module, names: list[str], selective: Mapping[str, SacPolicy] | None = None) -> None:
    """Checkpoint each named module in place, names unchanged (no ``checkpoint_wrapper``, which would rename the
    module's params); before ``fully_shard``. Full: the composable ``checkpoint`` hooks. Op-level (``selective``):
    the module's forward runs under ``torch.utils.checkpoint`` with SAC's ``context_fn`` (``_checkpoint_forward``)."""
    from torch.distributed._composable import checkpoint

    modules = dict(model.named_modules())
    how: dict[str, SacPolicy | None] = {**dict.fromkeys(names), **(selective or {})}
    for name, policy in how.items():
        if name not in modules:
            key = "activation_checkpointing" if policy is None else "selective_checkpointing"
            raise PlannerError(f"{key} names a module the model does not have: '{name}'")
        modules[name].register_forward_pre_hook(_without_cache, with_kwargs=True)  # before checkpoint's hooks
        if policy is None:
            checkpoint(modules[name])
        else:
            _checkpoint_forward(modules[name], policy)


# The keyword arguments through which a Hugging Face layer writes its KV cache (names differ by model and version).
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """A checkpointed layer writes no KV cache: the recomputed forward would write it a second time (Gemma 2's
    mask then disagrees with the keys, T5's checkpoint saves a different number of tensors). What transformers'
    own ``GradientCheckpointingLayer`` does: ``use_cache=False`` and no cache for this call, unless the layer only
    reads the cache (``_can_checkpoint_with_cache``). Other modules' calls are left as they are."""
    if not kwargs or not torch.is_grad_enabled():
        return None
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for key in CACHE_KWARGS:
            if changed.get(key) is not None:
                changed[key] = None
    return (args, changed) if changed != kwargs else None


def _checkpoint_forward(module: nn.Module, policy: SacPolicy) -> None:
    """Run ``module``'s forward under non-reentrant ``torch.utils.checkpoint`` with ``policy``'s SAC context, as
    torchtitan's ``checkpoint_wrapper`` does, by setting the instance's ``forward``. Not the composable
    ``checkpoint`` with ``context_fn``: its recomputation calls the module with its hooks, so FSDP2's pre-forward
    (its ``record_function`` on casting inputs under mixed precision) runs inside SAC's replay but ran outside the
    caching forward, and SAC refuses the unknown op. Here FSDP2's hooks stay outside both."""
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    forward = module.forward
    context_fn = sac_context_fn(policy)

    def checkpointed(*args: object, **kwargs: object) -> object:
        return run_checkpointed(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]
