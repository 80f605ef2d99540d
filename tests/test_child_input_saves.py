"""A storage a module call makes, hands to a child call and saves itself (Bloom's attention probabilities, given to
its ``attention_dropout`` module and saved by the next ``bmm``) is freed where autograd releases it, as any storage
the call made (``StepRecorder.made_outside``); a Bloom config's peak against real FSDP2 on fake ranks; and the
attention note of a model transformers gives eager attention only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import run_main

from fsdp_planner.sim.memory import activation_levels
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind

SEQ = 64


class _Attention(nn.Module):
    """Scores, their softmax in float64 cast back (as Bloom's fp32 softmax of bf16 scores) through a dropout module
    (p=0: the same tensor back), then a matmul that saves the cast."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        probs = self.dropout(torch.softmax(h @ h.transpose(-1, -2), dim=-1, dtype=torch.float64).to(h.dtype))
        return x + probs @ h


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attention(), _Attention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("reuse", [True, False])
def test_a_storage_handed_to_a_child_call_and_saved_is_freed_where_autograd_releases_it(reuse):
    """The cast probabilities (seq x seq, fp32), saved by the matmul, are freed after its backward; the dropout call
    took them as its input, which made them a caller's before: held to the layer's post-backward. (The softmax's
    float64 output, which it saves, was freed early already.)"""
    torch.manual_seed(0)
    tr = record(_Net(), (torch.randn(SEQ, 16, requires_grad=True),), lambda y: y.sum(), reuse=reuse)
    probs = SEQ * SEQ * 4
    second = [i for i, e in enumerate(tr.events) if e.module.startswith("layers.1") and e.backward]
    dropout = next(i for i in second
                   if tr.events[i].kind is EventKind.BWD_PRE and tr.events[i].module == "layers.1.dropout")
    [matmul] = [i for i in second if i < dropout and tr.events[i].is_op and tr.events[i].freed]
    assert tr.events[matmul].freed == probs  # the matmul's backward, before the dropout's and the layer's end
    levels = activation_levels(tr, SimOptions.named("fp32").precision)
    assert levels[matmul + 1] <= levels[matmul] - probs


BLOOM = {"model_type": "bloom", "n_layer": 2, "hidden_size": 128, "n_head": 4, "vocab_size": 512}


@pytest.mark.integration  # real FSDP2 on fake ranks: a few seconds
def test_bloom_s_peak_matches_real_fsdp2_on_fake_ranks(tmp_path: Path):
    """ALiBi eager attention at seq 1,024: +8.2% with the bf16 probabilities held to the attention's
    post-backward (the peak is the softmax's backward, after the bmm's node released them)."""
    pytest.importorskip("transformers")
    config = tmp_path / "bloom.json"
    config.write_text(json.dumps(BLOOM))
    done = run_main("verify", f"hf:{config}", "--policy", "titan", "--fake-world-size", "8", "--seq", "1024",
                    "--json")
    result = json.loads(done.stdout)
    assert result["counts_and_bytes_exact"]
    assert abs(result["peak_error"]) < 0.03, result["peak_error"]
    assert "attention traced as eager" in done.stderr and "the only one transformers has" in done.stderr
