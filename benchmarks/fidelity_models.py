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


# --- Attention variants and data-dependent routing (issue 26) ------------------------------------------------------
# Written the way users write them, for ``fidelity_memory.py --patterns``: multi-head latent attention (query/key
# heads of 96, value heads of 64, through F.scaled_dot_product_attention), an encoder built from
# nn.MultiheadAttention (need_weights=False: the call that takes SDPA's fused kernel), and a mixture of experts whose
# router picks each expert's tokens with torch.where (traced with the balanced stand-in, routing.py).

PATTERN_DIM, PATTERN_SEQ, PATTERN_BATCH = 256, 512, 4


class LatentAttention(nn.Module):
    """DeepSeek-style MLA: keys and values from a compressed latent; query/key heads wider than value heads."""

    def __init__(self, dim: int = PATTERN_DIM, heads: int = 4, latent: int = 64, qk_head: int = 96,
                 v_head: int = 64) -> None:
        super().__init__()
        self.heads, self.qk_head, self.v_head = heads, qk_head, v_head
        self.q = nn.Linear(dim, heads * qk_head, bias=False)
        self.down = nn.Linear(dim, latent, bias=False)
        self.norm = nn.LayerNorm(latent)
        self.k = nn.Linear(latent, heads * qk_head, bias=False)
        self.v = nn.Linear(latent, heads * v_head, bias=False)
        self.out = nn.Linear(heads * v_head, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.norm(self.down(x))
        q = self.q(x).view(b, s, self.heads, self.qk_head).transpose(1, 2)
        k = self.k(c).view(b, s, self.heads, self.qk_head).transpose(1, 2)
        v = self.v(c).view(b, s, self.heads, self.v_head).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.v_head))


class PatternBlock(nn.Module):
    """Pre-norm residual block around ``mixer`` and an MLP (a where-routed MoE when ``moe``)."""

    def __init__(self, mixer: str, moe: bool = False, dim: int = PATTERN_DIM) -> None:
        super().__init__()
        self.mixer_kind = mixer
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mixer = LatentAttention(dim) if mixer == "mla" else nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = WhereMoE(dim) if moe else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + (self.mixer(y) if self.mixer_kind == "mla" else self.mixer(y, y, y, need_weights=False)[0])
        return x + self.mlp(self.norm2(x))


class WhereMoE(nn.Module):
    """Top-2 of 4 experts; each expert's tokens picked with torch.where, outputs added back with index_add."""

    def __init__(self, dim: int = PATTERN_DIM, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.gate(tokens), dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class PatternNet(nn.Module):
    def __init__(self, mixer: str, moe: bool = False, layers: int = 4, dim: int = PATTERN_DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, dim)
        self.blocks = nn.ModuleList(PatternBlock(mixer, moe, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 512)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, 512, (PATTERN_BATCH, PATTERN_SEQ)),)


def mla() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return PatternNet("mla"), _ids(), _loss


def mha_encoder() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return PatternNet("mha"), _ids(), _loss


def where_moe() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return PatternNet("mha", moe=True), _ids(), _loss
