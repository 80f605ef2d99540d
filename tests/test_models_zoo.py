"""Planning-benchmark built-ins: meta builds, public parameter counts, traces that use every parameter."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from fsdp_planner.models import BUILTINS, encdec, llama, load_model, moe, vit
from fsdp_planner.trace import record

TINY_LLAMA_TIED = dataclasses.replace(llama.TOY_LLAMA, tie_embeddings=True)
TINY_T5 = encdec.T5Config(d_model=32, d_kv=8, d_ff=48, n_layers=2, n_decoder_layers=2, n_heads=4,
                          vocab_size=64, rel_buckets=8, rel_max_distance=16)
TINY_VIT = vit.ViTConfig(hidden=32, n_layers=2, n_heads=4, mlp_dim=64, patch=4, image=16, n_classes=10)
TINY_MOE = moe.MoEConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, n_experts=4, top_k=2,
                         ffn_dim=48)

# name -> (tiny factory, public parameter count)
ZOO: dict[str, tuple[Callable[[], tuple], float]] = {
    "llama32-3b": (lambda: llama.build(TINY_LLAMA_TIED, 2, 16), 3.21e9),
    "t5-3b": (lambda: encdec.build(TINY_T5, 2, 32, 16), 2.85e9),
    "vit-h14": (lambda: vit.build(TINY_VIT, 4), 632e6),
    "mixtral-8x7b": (lambda: moe.build(TINY_MOE, 2, 15), 46.7e9),  # 2*15*2 tokens: uneven over 4 experts
}


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters once


@pytest.mark.parametrize("name", list(ZOO))
def test_full_config_param_count(name: str) -> None:
    assert not BUILTINS[name].trainable
    lm = load_model(name, meta=True)
    assert all(p.is_meta for p in lm.model.parameters())
    n, public = _numel(lm.model), ZOO[name][1]
    print(f"{name}: {n:,} params")
    assert abs(n - public) / public < 0.03


@pytest.mark.parametrize("name", list(ZOO))
def test_tiny_config_trace_uses_every_param(name: str) -> None:
    with torch.device("meta"):
        model, inputs, loss_fn = ZOO[name][0]()
    tr = record(model, inputs, loss_fn)
    assert tr.fwd_flops > 0 and tr.bwd_flops > 0
    unused = set(range(len(tr.params))) - set(tr.index.first_use)
    assert not unused, [tr.params[i].fqn for i in unused]


@pytest.mark.parametrize("name", list(ZOO))
def test_tiny_config_runs_on_cpu(name: str) -> None:
    """The non-meta code paths (SDPA with masks, uneven MoE padding) run and give finite gradients."""
    torch.manual_seed(0)
    model, inputs, loss_fn = ZOO[name][0]()
    loss = loss_fn(model(*inputs))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_t5_shared_embedding_called_for_encoder_and_decoder() -> None:
    with torch.device("meta"):
        model, inputs, loss_fn = ZOO["t5-3b"][0]()
    tr = record(model, inputs, loss_fn)
    assert tr.modules["shared"].calls == 2
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"
    assert tr.modules[bias].calls == 1 and "encoder.block.1.layer.0.SelfAttention.relative_attention_bias" \
        not in tr.modules  # computed once per stack, reused by later blocks
    assert "lm_head.weight" in {p.fqn for p in tr.params}  # untied


def test_moe_expert_flops_equal_top_k_compute() -> None:
    cfg = moe.MoEConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, n_experts=4, top_k=2,
                        ffn_dim=48)
    with torch.device("meta"):
        model, inputs, loss_fn = moe.build(cfg, 2, 16)
    tr = record(model, inputs, loss_fn)
    tokens = 2 * 16
    assert tr.modules["layers.0.moe.experts"].fwd_flops == 3 * 2 * tokens * cfg.top_k * cfg.dim * cfg.ffn_dim


def test_full_mixtral_traces_every_param() -> None:
    """(Its trace time is in benchmarks/trace_speed.md.)"""
    lm = load_model("mixtral-8x7b", meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    assert tr.fwd_flops > 0 and tr.bwd_flops > 0
    assert len(tr.index.first_use) == len(tr.params)
