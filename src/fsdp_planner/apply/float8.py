"""Float8 training as torchtitan's float8 converter applies it: torchao's ``convert_to_float8_training`` swaps the
Linears the plan's filter keeps for ``Float8Linear`` (``fsdp2/float8.py``), before TP and ``fully_shard``; after each
optimizer step, with precomputed scales, ``precompute_float8_dynamic_scale_for_fsdp`` all-reduces the converted
weights' amaxes once for the next step's float8 all-gathers.

Where the GPU has no float8 matmul (a CPU, a GPU below compute capability 8.9) torchao's ``emulate`` mode runs the
same casts, scales and all-gathers with the matmuls done in high precision: the fake-world check and ``verify`` on
gloo run float8 training that way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.patching import TORCHAO_LOGGERS, quiet_loggers

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores


def float8_module() -> Any:
    """``torchao.float8``, imported without torchao's warnings about the CUDA kernels a CPU build cannot load and
    a deprecated pytree registration: lines that say nothing about the user's job."""
    try:
        with quiet_loggers(*TORCHAO_LOGGERS):
            import torchao.float8 as float8
    except ImportError as e:
        raise PlannerError("float8 training is applied with torchao: pip install torchao (fsdp-planner[float8])") \
            from e
    return float8


def emulated(device_type: str) -> bool:
    """Whether torchao must emulate float8 matmuls on this device (module docstring)."""
    return device_type != "cuda" or torch.cuda.get_device_capability() < FP8_CAPABILITY


def torchao_config(f8: Float8, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for the policy: its recipe, with FSDP2's float8 all-gather as asked."""
    config = float8_module().Float8LinearConfig.from_recipe_name(f8.recipe.value)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=f8.fsdp_float8_all_gather, emulate=emulate)


def apply_float8(model: nn.Module, f8: Float8 | None) -> list[str]:
    """Convert ``model``'s Linears as the policy says, in place (before TP and ``fully_shard``); the names of those
    converted."""
    if f8 is None:
        return []
    device = next((p.device.type for p in model.parameters()), "cpu")
    converted: list[str] = []
    owners = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def keep(module: nn.Module, fqn: str) -> bool:
        hit = isinstance(module, nn.Linear) and f8.converts(fqn, tuple(module.weight.shape),
                                                            plain=type(module) is nn.Linear,
                                                            tied=owners[id(module.weight)] > 1)
        if hit:
            converted.append(fqn)
        return hit

    config = torchao_config(f8, emulated(device))
    float8_module().convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return converted


def after_optimizer_step(model: nn.Module, f8: Float8 | None) -> None:
    """With precomputed scales, the one amax all-reduce of the converted weights for the next step."""
    if f8 is not None and f8.precompute_scale:
        float8_module().precompute_float8_dynamic_scale_for_fsdp(model)
