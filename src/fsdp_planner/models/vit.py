"""A ViT image classifier with timm's module names (patch_embed, blocks.N, norm, head).

The patch embedding owns the conv projection and the ``cls_token`` / ``pos_embed`` parameters directly.
Architecture numbers of the public ViT-H/14 are given for planning (built on meta only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.attention import sdpa


@dataclass(frozen=True)
class ViTConfig:
    hidden: int
    n_layers: int
    n_heads: int
    mlp_dim: int
    patch: int
    image: int
    n_classes: int
    channels: int = 3
    norm_eps: float = 1e-6

    @property
    def n_patches(self) -> int:
        return (self.image // self.patch) ** 2


# ViT-H/14 at 224px: ~632M parameters.
VIT_H14 = ViTConfig(hidden=1280, n_layers=32, n_heads=16, mlp_dim=5120, patch=14, image=224, n_classes=1000)


class PatchEmbed(nn.Module):
    """Conv patchify, prepend the class token, add learned position embeddings."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.n_patches + 1, cfg.hidden) * 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)  # (batch, patches, hidden)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat((cls, x), dim=1) + self.pos_embed


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = sdpa(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer encoder block."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])  # classify from the class token


def classification_loss(labels: torch.Tensor):  # type: ignore[no-untyped-def]
    """Cross-entropy of logits against ``labels``."""

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    return loss


def build(cfg: ViTConfig, batch_size: int, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any, Any]:
    """``(model, (images,), loss_fn)``."""
    model = VisionTransformer(cfg)
    if dtype is not torch.float32:  # a no-op cast still swaps every param, which fake tensors refuse
        model = model.to(dtype)
    images = torch.randn(batch_size, cfg.channels, cfg.image, cfg.image, dtype=dtype)
    labels = torch.randint(0, cfg.n_classes, (batch_size,))
    return model, (images,), classification_loss(labels)


def vit_h14(batch_size: int = 32) -> tuple[nn.Module, Any, Any]:
    """ViT-H/14 (~632M) on a batch of images at 224px (the sequence is fixed by the image: 256 patches + 1)."""
    return build(VIT_H14, batch_size)
