"""LoRA fine-tuning: a Llama-style decoder whose base weights are frozen and whose attention projections carry
trainable low-rank adapters (peft's ``LoraConfig``, injected in place so module names keep their shape).

What makes it a planning case of its own: only the adapters get grads, so only they are reduce-scattered and
only they carry optimizer state, while every frozen weight is still sharded and all-gathered; and FSDP1 (flat
parameters) cannot put a frozen weight and its adapter in one unit. Needs ``peft`` (the ``lora`` extra).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import fsdp_planner.models.llama as llama
from fsdp_planner.errors import PlannerError

LORA_TARGETS = ("wq", "wk", "wv", "wo")  # the attention projections, as most LoRA recipes adapt
LORA_RANK = 8


def add_lora(model: nn.Module, targets: tuple[str, ...] = LORA_TARGETS, rank: int = LORA_RANK) -> nn.Module:
    """Freeze ``model`` and inject peft LoRA adapters (rank ``rank``) into every Linear named in ``targets``;
    only the adapters stay trainable. The model is changed in place and returned."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise PlannerError("LoRA models need peft: pip install 'fsdp-planner[lora]' (or pip install peft)") from None
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0)
    # Adapters made on meta, then materialised beside their base weight: peft's own move to the base weight's
    # device swaps params, which fake tensors (the fake-world check builds models under FakeTensorMode) refuse.
    device = _base_device(model)
    with torch.device("meta"):
        model = inject_adapter_in_model(config, model)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta and device.type != "meta":
                fresh = torch.empty(p.shape, dtype=p.dtype, device=device)
                nn.init.normal_(fresh, std=1.0 / rank)  # B too (peft zeroes it): parity checks see every adapter move
                setattr(module, name, nn.Parameter(fresh))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)  # peft marks only adapters trainable; said here so it does not depend on it
    return model


def _base_device(model: nn.Module) -> torch.device:
    """Where the base weights live (the first param that is not an adapter)."""
    return next(p.device for n, p in model.named_parameters() if "lora_" not in n)


def toy_llama_lora(batch_size: int = 4, seq_len: int = 32) -> tuple[nn.Module, Any, Any]:
    """toy-llama with rank-8 LoRA on wq/wk/wv/wo: frozen base, trainable adapters."""
    model, inputs, loss = llama.build(llama.TOY_LLAMA, batch_size=batch_size, seq_len=seq_len)
    return add_lora(model), inputs, loss
