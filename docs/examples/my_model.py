"""A small model factory for the docs: ``fsdp-planner plan docs/examples/my_model.py:build``.

A factory returns ``(model, example_inputs[, loss_fn])``. It must not move the model to a device: the planner
calls it under ``torch.device("meta")`` to plan and for real on each rank to verify.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(batch_size: int = 4, seq_len: int = 32):
    """``--batch`` and ``--seq`` arrive here as ``batch_size`` and ``seq_len``."""
    return _step(TinyLM(), 512, batch_size, seq_len)


def build_large(batch_size: int = 2, seq_len: int = 4096):
    """The same architecture at 2.4B params: for planning only (on meta it costs no memory)."""
    return _step(TinyLM(vocab=32_000, dim=4096, depth=16), 32_000, batch_size, seq_len)


def _step(model: TinyLM, vocab: int, batch_size: int, seq_len: int):
    tokens = torch.randint(0, vocab, (batch_size, seq_len))
    labels = torch.randint(0, vocab, (batch_size, seq_len))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    return model, (tokens,), loss_fn
