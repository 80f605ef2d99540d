"""The Llama 3 models of torchtitan's published runs of 2024 (``benchmarks/fidelity_published.py``'s rows), as a
user's model file: the built-in shapes with the RMSNorm torchtitan wrote itself then, not ``nn.RMSNorm``.

torchtitan's ``norm_type = "rmsnorm"`` (its default, and its Llama 3 TOMLs', until 2025; torchtitan/models/norms.py
@ba2469780, December 2024) built its own module: upcast the input to fp32, multiply it by the reciprocal root mean
square over the last dim, cast back, then multiply by the weight. A GPU runs those ops one kernel each and autograd
saves their fp32 intermediates; the built-ins' ``nn.RMSNorm`` runs CUDA's one fused kernel (torch 2.8 on,
``norms.py``). Planning the published runs with the built-ins would plan a program they did not run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_planner.models import llama


class RMSNorm2024(nn.Module):
    """torchtitan's RMSNorm of 2024, written from its description above."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def with_2024_norms(model: nn.Module) -> nn.Module:
    """``model`` with each ``nn.RMSNorm`` replaced by ``RMSNorm2024`` of the same size and eps, under the same name."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.RMSNorm):
                setattr(parent, name, RMSNorm2024(child.weight.shape[0], child.eps or 1e-6))
    return model


def _build(cfg: llama.LlamaConfig, batch_size: int, seq_len: int) -> tuple[Any, Any, Any]:
    model, inputs, loss = llama.build(cfg, batch_size, seq_len)
    return with_2024_norms(model), inputs, loss


def llama3_8b(batch_size: int = 1, seq_len: int = 8192) -> tuple[Any, Any, Any]:
    return _build(llama.LLAMA3_8B, batch_size, seq_len)


def llama3_70b(batch_size: int = 1, seq_len: int = 8192) -> tuple[Any, Any, Any]:
    return _build(llama.LLAMA3_70B, batch_size, seq_len)
