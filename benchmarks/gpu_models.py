"""Llama-shaped models sized for one GPU, as a user's model file (``benchmarks/gpu_models.py:llama_1b``): what
``benchmarks/gpu_step.py`` trains on an H200 beside the planner's prediction. The shapes are Llama 3.2 1B's
(public config: dim 2048, 16 layers, 32 heads, 8 kv heads, FFN 8192, vocab 128,256), untied."""

from __future__ import annotations

from typing import Any

from fsdp_planner.models import llama

LLAMA_1B = llama.LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim=8192)


def llama_1b(batch_size: int = 2, seq_len: int = 4096) -> tuple[Any, Any, Any]:
    return llama.build(LLAMA_1B, batch_size, seq_len)
