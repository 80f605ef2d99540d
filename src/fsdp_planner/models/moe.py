"""A Mixtral-style mixture-of-experts decoder with torchtitan-like names (layers.N.moe.router/experts).

Each layer's experts are one ``GroupedExperts`` module holding stacked weights ``w1``/``w3`` [E, dim, ffn]
and ``w2`` [E, ffn, dim]. Routing is meta-friendly: router logits and top-k are computed (their FLOPs and the
router's gradient are real), then tokens are dispatched assuming a perfectly even load, so the expert matmuls
cost exactly the real top-k compute and every expert weight is used. Attention, RoPE and norms come from
``llama``. Architecture numbers of the public Mixtral 8x7B are given for planning (built on meta only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.models.llama import Attention, LlamaConfig, lm_loss


@dataclass(frozen=True)
class MoEConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    n_experts: int
    top_k: int
    ffn_dim: int  # per expert
    norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0

    def attention_config(self) -> LlamaConfig:
        """The Llama config ``llama.Attention`` reads (dims, heads, rope)."""
        return LlamaConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, vocab_size=self.vocab_size, ffn_dim=self.ffn_dim,
                           norm_eps=self.norm_eps, rope_theta=self.rope_theta)


# mistralai/Mixtral-8x7B: ~46.7B parameters (~12.9B active per token).
MIXTRAL_8X7B = MoEConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32_000, n_experts=8,
                         top_k=2, ffn_dim=14_336)
CONFIGS = (MIXTRAL_8X7B,)  # the built-in MoE configs (what a trace's shapes are matched against)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights, applied with one batched matmul per projection."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, ffn_dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, ffn_dim, dim) * ffn_dim**-0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, dim, ffn_dim) * dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (E, tokens_per_expert, dim) -> same shape."""
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: (tokens, dim) -> top-k (weights, expert indices), weights renormalised as in Mixtral."""
        scores = F.softmax(self.gate(x).float(), dim=-1)
        weights, idx = scores.topk(self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), idx


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = Router(cfg.dim, cfg.n_experts, cfg.top_k)
        self.experts = GroupedExperts(cfg.dim, cfg.ffn_dim, cfg.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)
        weights, _ = self.router(tokens)  # the indices would drive a real dispatch; here the load is even
        n = b * s * self.top_k
        per_expert = -(-n // self.n_experts)
        routed = tokens.repeat_interleave(self.top_k, dim=0)  # (tokens * top_k, dim)
        if per_expert * self.n_experts != n:
            routed = F.pad(routed, (0, 0, 0, per_expert * self.n_experts - n))
        out = self.experts(routed.view(self.n_experts, per_expert, d)).reshape(-1, d)[:n]
        out = (out.view(b * s, self.top_k, d) * weights.unsqueeze(-1)).sum(dim=1)
        return out.view(b, s, d)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg.attention_config())
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(cfg: MoEConfig, batch_size: int, seq_len: int,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any, Any]:
    """``(model, (tokens,), next-token loss)``."""
    model = MoETransformer(cfg)
    if dtype is not torch.float32:  # a no-op cast still swaps every param, which fake tensors refuse
        model = model.to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, (tokens,), lm_loss(tokens)


def mixtral_8x7b(batch_size: int = 1, seq_len: int = 4096) -> tuple[nn.Module, Any, Any]:
    """Mixtral 8x7B (~46.7B)."""
    return build(MIXTRAL_8X7B, batch_size, seq_len)
