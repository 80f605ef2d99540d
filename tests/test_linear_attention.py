"""Gated DeltaNet's and Kimi delta attention's linear attention planned as flash-linear-attention's kernels run it
(``linear_attention.py``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_main, runs_the_reference, verify_passes

pytest.importorskip("transformers")

from fsdp_planner import linear_attention as la
from fsdp_planner.calibrate.kineto import OpClass, op_class
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.patching import patched
from fsdp_planner.sim.compute import flop_efficiency
from fsdp_planner.trace import record
from fsdp_planner.trace.events import KERNEL_LINEAR_ATTENTION
from fsdp_planner.workspaces import workspace_bytes

# a Qwen3.5 text decoder: three gated DeltaNet layers, then an attention layer; 4 key heads serving 8 value heads
TINY_QWEN35 = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
               "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "max_position_embeddings": 512}

# FLA's README, "Benchmarks" (fla-org/flash-linear-attention as fetched 2026-08-22): one GB200, forward ms of
# chunk_gdn (use_qk_l2norm_in_kernel) and flash_attn_func (causal), the rows of head dim 128 and 4,096 tokens or more
FLA_ROWS = [  # batch, tokens, heads, head dim, chunk_gdn ms, flash_attn ms
    (1, 8192, 96, 128, 1.265, 3.753),
    (2, 16384, 16, 128, 1.029, 5.035),
    (4, 4096, 64, 128, 1.581, 2.560),
]


def tiny(tmp_path: Path) -> str:
    path = tmp_path / "tiny-qwen35.json"
    path.write_text(json.dumps(TINY_QWEN35))
    return f"hf:{path}"


def test_the_share_of_flash_attention_is_fla_s_own_benchmark():
    """The constant is the median of FLA's published rows, FLOPs counted as the trace counts them: ``chunk_flops``
    for the gated delta rule, half of torch's counter for causal flash attention (``sim/compute.kernel_flops``)."""
    shares = []
    for batch, tokens, heads, dim, gdn_ms, flash_ms in FLA_ROWS:
        gdn = la.chunk_flops(batch, tokens, heads, dim, dim, backward=False) / gdn_ms
        flash = 0.5 * 4 * batch * heads * tokens * tokens * dim / flash_ms
        shares.append(gdn / flash)
    assert statistics.median(shares) == pytest.approx(la.FLA_SHARE_OF_FLASH, abs=0.005)
    cluster = parse_cluster("h100:8")
    eff = flop_efficiency(torch.tensor([KERNEL_LINEAR_ATTENTION]).numpy(), cluster.compute)
    assert eff[0] == pytest.approx(cluster.compute.attention_efficiency * la.FLA_SHARE_OF_FLASH)


def traced(spec: str, seq: int):  # type: ignore[no-untyped-def]
    lm = load_model(ModelSpec(spec, batch_size=2, seq_len=seq), meta=True)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("seq", [256, 1024])
def test_a_planned_step_runs_fla_s_two_kernels_not_the_reference_loop(tmp_path, seq):
    tr = traced(tiny(tmp_path), seq)
    linear = [e for e in tr.events if e.is_op and e.kernel == KERNEL_LINEAR_ATTENTION]
    forward = [e for e in linear if not e.backward]
    assert len(forward) == 3 and len(linear) == 6  # one forward and one backward op per gated DeltaNet layer
    assert {e.flops for e in forward} == {la.chunk_flops(2, seq, 8, 16, 16, backward=False)}
    assert {e.flops for e in linear if e.backward} == {la.chunk_flops(2, seq, 8, 16, 16, backward=True)}
    assert all(e.workspace > 0 for e in linear if e.backward)


def test_the_layer_s_ops_do_not_grow_with_the_chunks(tmp_path):
    """The reference loops over 64-token chunks (ops per chunk); FLA's kernels are two ops at any length."""
    spec = tiny(tmp_path)

    def ops(seq: int) -> int:
        return sum(1 for e in traced(spec, seq).events if e.is_op and ".linear_attn" in e.module)

    assert ops(256) == ops(1024)


def test_real_tensors_run_transformers_own_reference(tmp_path):
    """The wrapper hands real tensors (verify's ranks) to the reference: the same output as without it."""
    torch.manual_seed(0)
    model = load_model(tiny(tmp_path), meta=False).model
    wrapped = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert len(wrapped) == 3
    module = sys.modules[type(wrapped[0]).__module__]
    rule = getattr(module, la.REFERENCE)
    assert getattr(rule, "__wrapped_by_fsdp_planner__", False)
    ids = torch.randint(0, 256, (2, 70))  # 70 tokens: two chunks, the last padded
    got = model(ids).logits
    with patched(module, la.REFERENCE, rule.__wrapped__):
        want = model(ids).logits
    assert torch.equal(got, want)


def test_the_backward_workspace_holds_the_chunk_states_again():
    """h and dh per chunk, w, u, v_new, the new dv and dw, dq and dk at the value heads' width, the fp32 dg."""
    do = torch.empty(2, 130, 8, 16, device="meta", dtype=torch.bfloat16)  # 3 chunks of 64, 8 value heads
    q = torch.empty(2, 130, 4, 32, device="meta", dtype=torch.bfloat16)  # 4 key heads
    states = 2 * (2 * 3 * 8 * 32 * 16)
    value_width = 2 * 130 * 8 * (32 + 16 + 16 + 16 + 32 + 32 + 32)  # w, u, v_new, dv, dw, dq, dk
    key_width = 2 * 130 * 4 * (32 + 32)  # dq and dk summed to the key heads
    dg = 2 * 130 * 8 * 4
    assert workspace_bytes(torch.ops.fsdp_planner.chunk_gated_delta_rule_backward.default,
                           (do, q), {}) == (states + value_width + key_width) * 2 + dg


def test_fla_s_kernels_in_a_profile_are_attention():
    for name in ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "chunk_fwd_kernel_o", "chunk_bwd_kernel_dqkwg",
                 "recompute_w_u_fwd_kernel", "prepare_wy_repr_bwd_kernel", "merge_16x16_to_64x64_inverse_kernel",
                 "chunk_kda_fwd_kernel_inter_solve_fused", "chunk_kda_bwd_kernel_wy_dqkg_fused",
                 "recompute_w_u_fwd_kda_kernel", "chunk_gla_fwd_kernel_o"):
        assert op_class(name, gpu=True) is OpClass.ATTENTION, name


@pytest.mark.integration
def test_real_fsdp2_on_fake_ranks_allocates_as_predicted(tmp_path):
    """Real FSDP2 on 8 fake ranks runs the planned kernels (their fake implementations) under full checkpointing:
    counts, bytes and peak as the trace predicts."""
    verify_passes(tiny(tmp_path), "--policy", "titan", "--ac", "full", "--fake-world-size", "8", "--cluster",
                  "h100:8", "--seq", "256")


@pytest.mark.integration
def test_a_tiny_qwen35_trains_on_two_gloo_ranks_with_parity(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_main("verify", tiny(tmp_path), "--policy", "titan", "--nproc", "2", "--steps", "2", "--seq", "70",
                 "--time-steps", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


def test_layers_that_ran_the_reference_are_said(tmp_path):
    """A transformers whose layers call the rule another way (before 5.25: an attribute the layer binds) traces the
    reference: the note says so rather than stay silent."""
    from fsdp_planner.service.tracing import linear_attention_note

    lm = load_model(ModelSpec(tiny(tmp_path), batch_size=1, seq_len=128), meta=True)
    layer = next(m for m in lm.model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    module = sys.modules[type(layer).__module__]
    with patched(module, la.REFERENCE, getattr(module, la.REFERENCE).__wrapped__):
        tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    said = linear_attention_note(tr, lm.model)
    assert said is not None and said.startswith("3 linear attention layers traced as transformers' PyTorch reference")


# a Kimi Linear decoder: two Kimi delta attention layers of 4 heads of 16 (transformers' own default layer types)
TINY_KIMI = {"model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "num_experts": 4, "num_experts_per_token": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
             "v_head_dim": 16, "qk_nope_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4, "head_dim": 16,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_kimi(tmp_path: Path) -> str:
    path = tmp_path / "tiny-kimi.json"
    path.write_text(json.dumps(TINY_KIMI))
    return f"hf:{path}"


@pytest.mark.parametrize("seq", [128, 512])
def test_kimi_delta_attention_runs_fla_s_two_kernels_at_any_length(tmp_path, seq):
    """Kimi Linear's delta attention (FLA's chunk_kda) is one forward and one backward op per layer at any length,
    with the gated delta rule's FLOPs and KDA's backward workspace; the note names it and its time's estimate."""
    from fsdp_planner.service.tracing import linear_attention_note

    spec = tiny_kimi(tmp_path)
    lm = load_model(ModelSpec(spec, batch_size=2, seq_len=seq), meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    linear = [e for e in tr.events if e.is_op and e.kernel == KERNEL_LINEAR_ATTENTION]
    assert len([e for e in linear if not e.backward]) == 2 and len(linear) == 4
    assert {e.flops for e in linear if not e.backward} == {la.chunk_flops(2, seq, 4, 16, 16, backward=False)}
    assert {e.flops for e in linear if e.backward} == {la.chunk_flops(2, seq, 4, 16, 16, backward=True)}
    do = torch.empty(2, seq, 4, 16, device="meta", dtype=torch.bfloat16)
    assert {e.workspace for e in linear if e.backward} == {la.kda_backward_workspace(do, do)}
    said = linear_attention_note(tr, lm.model)
    assert said is not None and said.startswith("linear attention (2 Kimi delta attention calls) traced as flash")
    assert "FLA publishes no KDA benchmark" in said


def test_kimi_delta_attention_saves_what_fla_s_function_saves():
    """ChunkKDAFunction's saved set with the l2 norm in the kernel (fla/ops/kda/chunk.py): normalised q and k and
    their fp32 reciprocal norms, v, the fp32 cumulative gates, the gates given, beta, and Aqk and Akk (T x 64 per
    value head, in k's dtype); w, u, qg, kg, v_new and h are made again in backward."""
    b, t, h, d = 2, 130, 4, 32
    q, k, v = (torch.empty(b, t, h, d, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.empty(b, t, h, d, device="meta", dtype=torch.float32, requires_grad=True)
    beta = torch.empty(b, t, h, device="meta", dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    rule = la.chunk_rule(lambda *a, **kw: None, la._kda_forward)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out, state = rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert out.shape == (b, t, h, d) and out.dtype == torch.bfloat16 and state is None
    assert [(tuple(x.shape), x.dtype) for x in saved] == [
        ((b, t, h, d), torch.bfloat16), ((b, t, h), torch.float32),  # q normalised, its reciprocal norms
        ((b, t, h, d), torch.bfloat16), ((b, t, h), torch.float32),  # k
        ((b, t, h, d), torch.bfloat16), ((b, t, h, d), torch.float32), ((b, t, h, d), torch.float32),  # v, gates
        ((b, t, h), torch.bfloat16), ((b, t, h, la.CHUNK), torch.bfloat16), ((b, t, h, la.CHUNK), torch.bfloat16)]
    assert saved[6] is g


def test_kimi_delta_attention_s_backward_workspace():
    """h and dh per chunk and w, qg, kg, u and v_new in the inputs' dtype; dAqk, dAkk, two passes' dq, dk and dg,
    and two db in fp32 (fla/ops/kda/chunk_bwd.py, chunk_intra.py); not the dv it returns, an output."""
    do = torch.empty(2, 130, 4, 16, device="meta", dtype=torch.bfloat16)  # 3 chunks of 64, value head dim 16
    q = torch.empty(2, 130, 4, 32, device="meta", dtype=torch.bfloat16)
    states = 2 * (2 * 3 * 4 * 32 * 16) * 2
    bf16 = 2 * 130 * 4 * (3 * 32 + 2 * 16) * 2
    fp32 = 2 * 130 * 4 * (2 * 64 + 6 * 32 + 2) * 4
    assert workspace_bytes(torch.ops.fsdp_planner.chunk_kda_backward.default, (do, q), {}) == states + bf16 + fp32


def test_kimi_delta_attention_on_real_tensors_is_transformers_reference(tmp_path):
    torch.manual_seed(0)
    model = load_model(tiny_kimi(tmp_path), meta=False).model
    layer = next(m for m in model.modules() if type(m).__name__ == "KimiLinearDeltaAttention")
    runs_the_reference(model, layer, la.KDA_REFERENCE, torch.randint(0, 256, (2, 70)))


@pytest.mark.integration
def test_a_tiny_kimi_linear_on_fake_ranks_allocates_as_predicted(tmp_path):
    verify_passes(tiny_kimi(tmp_path), "--policy", "titan", "--ac", "full", "--fake-world-size", "8", "--cluster",
                  "h100:8", "--seq", "256")
