"""Models from the seed discussions: the CNN of seed 000 and the 10 x Linear(10000, 10000) of seed 002."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class SeedNet(nn.Module):
    """The CNN from the seed question (MNIST-sized); size-based wrapping puts conv1 and fc2 in one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def seed_net(batch_size: int = 8) -> tuple[nn.Module, Any, Any]:
    model = SeedNet()
    images = torch.randn(batch_size, 1, 28, 28)
    labels = torch.randint(0, 10, (batch_size,))
    return model, (images,), lambda out: F.nll_loss(out, labels)


class SeedLinear10(nn.Module):
    """Seed 002's memory-study model: 10 x Linear(10000, 10000), one input vector."""

    def __init__(self, width: int = 10_000, depth: int = 10) -> None:
        super().__init__()
        self.linear = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def seed_linear10() -> tuple[nn.Module, Any, Any]:
    model = SeedLinear10()
    return model, (torch.ones(10_000),), lambda out: out.sum()
