"""The two models of ``fidelity_time.py``, at the two ends of what makes an FSDP step slow on gloo ranks.

``deep``: 128 tiny residual blocks (LayerNorm, Linear(48, 48), GELU), a norm and a head, 259 modules and 516
params of 1.3 MB in all: a step is latency, per-group and per-op host work. ``wide``: 6 x Linear(2048, 2048), 100 MB of
fp32 params and a batch of 16 rows: a step is bytes through gloo.
"""

from __future__ import annotations

import torch
from torch import nn


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.fc(self.norm(x)))


class Deep(nn.Module):
    def __init__(self, blocks: int = 128, dim: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def deep() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return Deep(), (torch.randn(8, 48),), _loss


class Wide(nn.Module):
    def __init__(self, layers: int = 6, dim: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def wide() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return Wide(), (torch.randn(16, 1024),), _loss
