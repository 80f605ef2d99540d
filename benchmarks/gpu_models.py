"""Llama-shaped models sized for one GPU, as a user's model file (``benchmarks/gpu_models.py:llama_1b``): what
``benchmarks/gpu_step.py`` trains on an H200 beside the planner's prediction. The shapes are Llama 3.2 1B's
(public config: dim 2048, 16 layers, 32 heads, 8 kv heads, FFN 8192, vocab 128,256), untied."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_planner.models import llama

LLAMA_1B = llama.LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128_256, ffn_dim=8192)


def llama_1b(batch_size: int = 2, seq_len: int = 4096) -> tuple[Any, Any, Any]:
    return llama.build(LLAMA_1B, batch_size, seq_len)


# Llama 3 70B's block (public config: dim 8192, 64 heads, 8 kv heads, FFN 28,672, vocab 128,256) with 4 of its 80
# layers, and Llama 3 8B whole: what ``benchmarks/gpu_2d.py`` runs at torchtitan's layouts on fake ranks.
LLAMA3_70B_L4 = dataclasses.replace(llama.LLAMA3_70B, n_layers=4)
LLAMA3_405B_L2 = dataclasses.replace(llama.LLAMA3_405B, n_layers=2)
# The same shapes at 1/32 the width, for trying that script on a CPU (heads still divide by TP 8).
SMOKE = llama.LlamaConfig(dim=256, n_layers=2, n_heads=16, n_kv_heads=8, vocab_size=1024, ffn_dim=896)


def llama3_70b_l4(batch_size: int = 8, seq_len: int = 8192) -> tuple[Any, Any, Any]:
    return llama.build(LLAMA3_70B_L4, batch_size, seq_len)


def llama3_405b_l2(batch_size: int = 2, seq_len: int = 8192) -> tuple[Any, Any, Any]:
    return llama.build(LLAMA3_405B_L2, batch_size, seq_len)


def llama3_8b(batch_size: int = 1, seq_len: int = 8192) -> tuple[Any, Any, Any]:
    return llama.build(llama.LLAMA3_8B, batch_size, seq_len)


def smoke(batch_size: int = 1, seq_len: int = 64) -> tuple[Any, Any, Any]:
    return llama.build(SMOKE, batch_size, seq_len)
