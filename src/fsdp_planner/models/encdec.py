"""A T5 v1.1-style encoder-decoder with HF T5's module names (shared, encoder/decoder.block.N, lm_head).

The ``shared`` token embedding is one module called twice per step (encoder tokens, then decoder tokens after
the encoder has run): one parameter used at two distant places. As in T5 v1.1 the ``lm_head`` is not tied.
Architecture numbers of the public T5 v1.1 XL are given for planning (built on meta only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.attention import sdpa


@dataclass(frozen=True)
class T5Config:
    d_model: int
    d_kv: int
    d_ff: int
    n_layers: int  # encoder layers
    n_decoder_layers: int
    n_heads: int
    vocab_size: int
    rel_buckets: int = 32
    rel_max_distance: int = 128
    norm_eps: float = 1e-6


# google/t5-v1_1-xl: ~2.85B parameters.
T5_V11_XL = T5Config(d_model=2048, d_kv=64, d_ff=5120, n_layers=24, n_decoder_layers=24, n_heads=32,
                     vocab_size=32_128)


def relative_position_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucketing of relative positions (key - query): exact for small offsets, log-spaced beyond."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(rel.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(rel < max_exact, rel, large)


class T5Attention(nn.Module):
    """Unscaled multi-head attention (T5); the first self-attention of a stack owns the position bias."""

    def __init__(self, cfg: T5Config, causal: bool, has_relative_bias: bool,
                 bidirectional: bool = True) -> None:
        super().__init__()
        self.n_heads, self.d_kv = cfg.n_heads, cfg.d_kv
        self.causal, self.bidirectional = causal, bidirectional
        self.buckets, self.max_distance = cfg.rel_buckets, cfg.rel_max_distance
        inner = cfg.n_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative_attention_bias = (nn.Embedding(cfg.rel_buckets, cfg.n_heads) if has_relative_bias
                                        else None)

    def compute_bias(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """Position bias (1, heads, q_len, k_len) from the learned bucket embedding."""
        assert self.relative_attention_bias is not None
        ctx = torch.arange(q_len, device=device)[:, None]
        mem = torch.arange(k_len, device=device)[None, :]
        buckets = relative_position_bucket(mem - ctx, self.bidirectional, self.buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, s, _ = x.shape
        src = x if kv is None else kv
        q = self.q(x).view(b, s, self.n_heads, self.d_kv).transpose(1, 2)
        k = self.k(src).view(b, src.shape[1], self.n_heads, self.d_kv).transpose(1, 2)
        v = self.v(src).view(b, src.shape[1], self.n_heads, self.d_kv).transpose(1, 2)
        if self.relative_attention_bias is not None:
            bias = self.compute_bias(s, src.shape[1], x.device).to(x.dtype)
        out = _attention(q, k, v, bias, self.causal)
        return self.o(out.transpose(1, 2).reshape(b, s, -1)), bias


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
               causal: bool) -> torch.Tensor:
    """Unscaled attention (T5) with an optional additive position bias; SDPA takes a mask or ``is_causal``, not
    both, so a causal stack with a bias folds the causal mask into it."""
    if bias is None:
        return sdpa(q, k, v, is_causal=causal, scale=1.0)
    mask = bias
    if causal:
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = mask + torch.zeros(tri.shape, dtype=q.dtype, device=q.device).masked_fill(~tri, float("-inf"))
    return sdpa(q, k, v, attn_mask=mask, scale=1.0)


class DenseGatedGeluDense(nn.Module):
    """T5 v1.1 feed-forward: wo(gelu(wi_0 x) * wi_1 x)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x), approximate="tanh") * self.wi_1(x))


class SelfAttentionLayer(nn.Module):
    def __init__(self, cfg: T5Config, causal: bool, has_relative_bias: bool) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(cfg, causal, has_relative_bias, bidirectional=not causal)
        self.layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.SelfAttention(self.layer_norm(x), bias=bias)
        return x + out, bias


class CrossAttentionLayer(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(cfg, causal=False, has_relative_bias=False)
        self.layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        return x + self.EncDecAttention(self.layer_norm(x), kv=enc)[0]


class FFLayer(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.DenseReluDense = DenseGatedGeluDense(cfg)
        self.layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Module):
    """Encoder block: layer.0 self-attention, layer.1 FF; decoder adds layer.1 cross-attention before FF."""

    def __init__(self, cfg: T5Config, decoder: bool, has_relative_bias: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [SelfAttentionLayer(cfg, decoder, has_relative_bias)]
        if decoder:
            layers.append(CrossAttentionLayer(cfg))
        layers.append(FFLayer(cfg))
        self.layer = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None,
                enc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, bias = self.layer[0](x, bias)
        if enc is not None:
            x = self.layer[1](x, enc)
        return self.layer[-1](x), bias


class T5Stack(nn.Module):
    """A stack of blocks on already-embedded tokens; block 0 computes the position bias the others reuse."""

    def __init__(self, cfg: T5Config, decoder: bool) -> None:
        super().__init__()
        n = cfg.n_decoder_layers if decoder else cfg.n_layers
        self.block = nn.ModuleList(T5Block(cfg, decoder, has_relative_bias=i == 0) for i in range(n))
        self.final_layer_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, h: torch.Tensor, enc: torch.Tensor | None = None) -> torch.Tensor:
        bias = None
        for block in self.block:
            h, bias = block(h, bias, enc)
        return self.final_layer_norm(h)


class T5(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, decoder=False)
        self.decoder = T5Stack(cfg, decoder=True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied in T5 v1.1

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        enc = self.encoder(self.shared(input_ids))
        dec = self.decoder(self.shared(decoder_input_ids), enc)
        return self.lm_head(dec)


def seq2seq_loss(labels: torch.Tensor):  # type: ignore[no-untyped-def]
    """Cross-entropy of decoder logits against ``labels``."""

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return loss


def build(cfg: T5Config, batch_size: int, enc_len: int, dec_len: int,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any, Any]:
    """``(model, (input_ids, decoder_input_ids), loss_fn)``."""
    model = T5(cfg)
    if dtype is not torch.float32:  # a no-op cast still swaps every param, which fake tensors refuse
        model = model.to(dtype)
    input_ids = torch.randint(0, cfg.vocab_size, (batch_size, enc_len))
    decoder_input_ids = torch.randint(0, cfg.vocab_size, (batch_size, dec_len))
    labels = torch.randint(0, cfg.vocab_size, (batch_size, dec_len))
    return model, (input_ids, decoder_input_ids), seq2seq_loss(labels)


def t5_3b(batch_size: int = 1, seq_len: int = 1024) -> tuple[nn.Module, Any, Any]:
    """T5 v1.1 XL (~2.85B): ``seq_len`` encoder tokens, a quarter as many decoder tokens (at least one), the
    ratio of T5's span-corruption pre-training (inputs 512, targets 114)."""
    return build(T5_V11_XL, batch_size, seq_len, max(1, seq_len // 4))
