"""SDPA in a planned step runs the fused kernel a GPU would: the trace of a user's model that calls
F.scaled_dot_product_attention saves O(seq), not the math path's O(seq^2) scores, and masks and GQA are taken."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.attention import GpuAttention
from fsdp_planner.trace import record

HEADS, SEQ, HEAD_DIM = 4, 512, 16


class SelfAttention(nn.Module):
    """What a user's model does: project, then call SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)


def test_a_users_sdpa_saves_what_a_gpu_saves():
    with torch.device("meta"):
        model, x = SelfAttention(), torch.randn(1, SEQ, HEADS * HEAD_DIM)
    tr = record(model, (x,))
    saved = sum(e.saved for e in tr.events)
    scores = HEADS * SEQ * SEQ * 4  # one fp32 score matrix per head: what the math path would save
    assert saved < scores / 4, saved  # inputs, projections, output and log-sum-exp: ~0.66 MB


@pytest.mark.parametrize("mask", ["none", "bool", "float2d"])
def test_fused_attention_takes_sdpa_arguments(mask: str):
    with torch.device("meta"):
        q = torch.randn(2, 8, 64, 16, requires_grad=True)
        kv = torch.randn(2, 2, 64, 16)  # grouped-query: 2 kv heads for 8 query heads
        masks = {"none": None, "bool": torch.ones(64, 64, dtype=torch.bool).tril(), "float2d": torch.zeros(64, 64)}
        with GpuAttention():
            out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=masks[mask], enable_gqa=True)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_real_tensors_are_left_to_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with GpuAttention():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("mask", [None, "bool"])
def test_value_heads_of_another_size_give_the_value_s_head_size(mask: str | None):
    """Multi-head latent attention (DeepSeek-V3): query/key heads of 96, value heads of 64."""
    with torch.device("meta"):
        q = torch.randn(1, 4, 128, 96, requires_grad=True)
        k, v = torch.randn(1, 4, 128, 96), torch.randn(1, 4, 128, 64)
        m = torch.ones(128, 128, dtype=torch.bool).tril() if mask else None
        with GpuAttention():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)
    assert out.shape == (1, 4, 128, 64)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_eager_keeps_the_score_matrices_that_flash_does_not():
    """--attention eager against flash on a user's SDPA model: the extra saved bytes are of the order of the
    score matrices (per head, seq x seq: the math path keeps its scores and softmax), the sign always more."""
    from fsdp_planner.attention import kernel

    with torch.device("meta"):
        model, x = SelfAttention(), torch.randn(1, SEQ, HEADS * HEAD_DIM)
    saved = {}
    for name in ("flash", "eager"):
        with kernel(name) as k:
            saved[name] = sum(e.saved for e in record(model, (x,)).events)
        assert k.calls == 1
    scores = HEADS * SEQ * SEQ * 4
    assert scores <= saved["eager"] - saved["flash"] <= 3 * scores


@pytest.mark.integration  # whole commands or two model builds: kept out of the fast subset
def test_the_plan_records_its_attention_kernel(tmp_path, capsys):
    import json

    from fsdp_planner.cli import main
    from fsdp_planner.fsdp2.plan import Plan

    out = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "module", "--attention", "eager", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["attention"] == "eager" and Plan.from_json(out.read_text()).attention == "eager"
    capsys.readouterr()
    assert main(["simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8"]) == 0
    assert "the plan was made for --attention eager" in capsys.readouterr().err
    del data["attention"]  # a plan written before the field: the default kernel
    assert Plan.from_json(json.dumps(data)).attention == ""
    data["attention"] = "math"
    with pytest.raises(Exception, match="plan 'attention' must be one of sdpa, flash, eager"):
        Plan.from_json(json.dumps(data))


def test_a_module_given_one_tensor_twice_still_sees_one():
    """nn.MultiheadAttention(y, y, y) projects once, packed, when query is key is value; the tracer's hook on its
    inputs once gave each argument an alias of its own, and the trace took three projections (+12% of peak)."""
    seen = []

    class Same(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(8, 8)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            seen.append(a is b)
            return self.w(a) + b

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre, self.same = nn.Linear(8, 8), Same()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.pre(x)
            return self.same(y, y)

    with torch.device("meta"):
        model, x = Outer(), torch.randn(2, 8)
    record(model, (x,), reuse=False)
    assert seen == [True]


def test_attention_option_on_a_model_without_attention_is_said(capsys):
    """--attention on a model whose step calls no SDPA changes nothing: a note says so instead of silence."""
    from fsdp_planner.cli import main

    assert main(["plan", "seed-net", "--policy", "titan", "--attention", "eager"]) == 0
    assert "--attention eager changes nothing here" in capsys.readouterr().err


@pytest.mark.integration  # a Hugging Face model built and planned: a second or more
def test_attention_option_on_a_hugging_face_cnn_is_said(capsys, tmp_path):
    """transformers records an attention implementation for a ResNet too: the note says the option changes
    nothing, not that attention was traced as flash."""
    pytest.importorskip("transformers")
    from fsdp_planner.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16],
                                  "depths": [1, 1], "num_labels": 10, "image_size": 32}))
    common = ["plan", f"hf:{config}", "--policy", "size", "--precision", "fp32", "--batch", "2"]
    assert main([*common, "--attention", "flash"]) == 0
    err = capsys.readouterr().err
    assert "--attention flash changes nothing here" in err and "attention traced as" not in err
    assert main(common) == 0
    assert "attention" not in capsys.readouterr().err


class MultiQueryAttention(nn.Module):
    """Falcon's multi-query attention as transformers writes it: one key/value head, broadcast by SDPA's matmuls
    (no ``enable_gqa``), with a boolean mask."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM)
        self.kv = nn.Linear(HEADS * HEAD_DIM, 2 * HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 1, HEAD_DIM).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)


def test_keys_with_fewer_heads_and_no_gqa_take_the_math_path():
    """SDPA's fused kernels refuse keys with fewer heads than the queries unless ``enable_gqa``: a GPU runs the
    math path there, and so must the trace (Falcon's peak was 13-48% under the independent FSDPMemTracker run)."""
    with torch.device("meta"):
        model, x = MultiQueryAttention(), torch.randn(1, SEQ, HEADS * HEAD_DIM)
    saved = sum(e.saved for e in record(model, (x,)).events)
    assert saved > HEADS * SEQ * SEQ * 4, saved  # at least the fp32 scores of every head


def test_grouped_query_keys_reach_flash_unrepeated():
    """With ``enable_gqa`` and no mask a GPU's flash kernel reads the grouped keys and values as they are: the
    trace saves them at their own size, not repeated to the query heads (GQA models were 2-3% high)."""
    with torch.device("meta"):
        q = torch.randn(2, 8, SEQ, HEAD_DIM, requires_grad=True)
        kv = torch.randn(2, 2, SEQ, HEAD_DIM, requires_grad=True)

        def saved(gqa: bool) -> int:
            k = kv if gqa else kv.repeat_interleave(4, dim=1)
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel()) or t, lambda t: t)
            with hooks, GpuAttention():
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=gqa)
            return sum(seen)

        seen: list[int] = []
        grouped = saved(True)
        seen.clear()
        repeated = saved(False)
    assert repeated - grouped == 2 * 6 * SEQ * HEAD_DIM * 2, (grouped, repeated)  # k and v: 6 heads fewer, b=2


def test_inputs_with_a_strided_last_dim_take_the_math_path():
    """Every fused SDPA kernel asks for a last dim of stride 1; a feature map's channels viewed as heads and
    transposed (a U-Net's attention) have not, and a GPU runs the math path: the trace saves the scores."""
    with torch.device("meta"):
        q = torch.randn(2, HEADS, HEAD_DIM, SEQ, requires_grad=True).transpose(-1, -2)
        seen: list[int] = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.numel()) or t, lambda t: t)
        with hooks, GpuAttention():
            F.scaled_dot_product_attention(q, q, q)
    assert sum(seen) >= 2 * HEADS * SEQ * SEQ, sum(seen)  # the scores of every head
