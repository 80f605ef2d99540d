"""A Llama-style decoder with torchtitan's module names (tok_embeddings, layers.N, norm, output).

Architecture numbers of the public Llama 3 models are given for planning (built on meta only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.attention import sdpa


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    tie_embeddings: bool = False


LLAMA3_8B = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim=14_336)
LLAMA3_70B = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128_256, ffn_dim=28_672)
LLAMA3_405B = LlamaConfig(dim=16_384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128_256, ffn_dim=53_248)
# Llama 3.2 3B ties the input embedding and the output projection.
LLAMA32_3B = LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128_256, ffn_dim=8192,
                         tie_embeddings=True)
# Llama 3.2 1B: torchtitan's llama3 "1B" flavour (its FFN: 8/3 x 2048 x 1.5, up to a multiple of 1024)
LLAMA32_1B = LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim=8192,
                         tie_embeddings=True)
# torchtitan's llama3 "debugmodel" flavour (models/llama3/__init__.py's _debugmodel: its FFN 8/3 x 256 up to a
# multiple of 256, no GQA): the model torchtitan's own quick start trains
LLAMA3_DEBUG = LlamaConfig(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, ffn_dim=768)
TOY_LLAMA = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=160)
# the built-ins, for what a trace cannot say (the head counts behind a traced wq's rows)
CONFIGS = (LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, LLAMA32_3B, LLAMA32_1B, LLAMA3_DEBUG, TOY_LLAMA)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on (batch, heads, seq, head_dim); GQA by repeating k/v heads."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return sdpa(q, k, v, is_causal=True)


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim)."""
    seq, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.theta = cfg.n_heads, cfg.n_kv_heads, cfg.rope_theta
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads as -1: under tensor parallelism each rank holds n_heads / TP of them (torchtitan does the same)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = attention(rotary(q, self.theta), rotary(k, self.theta), v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def lm_loss(tokens: torch.Tensor):  # type: ignore[no-untyped-def]
    """Next-token cross-entropy on ``tokens``, as torchtitan computes it (``train.py`` of its published runs,
    commit 9dec370: ``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``): its data loader gives
    the labels already shifted by one, so the loss reads every position of the logits and makes no copy of them
    (slicing ``logits[:, :-1]`` first would, and that bf16 copy changes how the allocator packs the loss's blocks,
    ``sim/allocator.py``). The labels are made here, outside the step: ``tokens.roll(-1, dims=1)``, written as two
    copies because on meta tensors ``roll``'s and ``cat``'s decompositions import torch._dynamo, whose frames then
    hold the step's tensors alive (tests/test_trace.py)."""
    labels = torch.empty_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, -1] = tokens[:, 0]

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return loss


def build(cfg: LlamaConfig, batch_size: int, seq_len: int,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any, Any]:
    model = Transformer(cfg)
    if dtype is not torch.float32:  # a no-op cast still swaps every param, which fake tensors refuse
        model = model.to(dtype)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, (tokens,), lm_loss(tokens)
