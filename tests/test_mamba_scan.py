"""Mamba-2's mixers planned as mamba_ssm's fused function trains them (``mamba_scan.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_main

pytest.importorskip("transformers")

from fsdp_planner import mamba_scan as ms
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.patching import patched
from fsdp_planner.trace import record
from fsdp_planner.workspaces import workspace_bytes

# NemotronH's hybrid: two Mamba-2 mixers (8 heads of 16, 2 groups, state 16, chunks of 32), an attention layer and an
# MLP; transformers 5 writes the time step's unbounded clamp as a tagged float
TINY_NEMOTRON_H = {"model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 64,
                   "layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention"],
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                   "ssm_state_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2,
                   "chunk_size": 32, "max_position_embeddings": 512,
                   "time_step_limit": [0.0, {"__float__": "Infinity"}]}
TINY_MAMBA2 = {"model_type": "mamba2", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
               "num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "chunk_size": 32, "expand": 2}


def tiny(tmp_path: Path, config: dict) -> str:
    path = tmp_path / f"{config['model_type']}.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def traced(spec: str, seq: int):  # type: ignore[no-untyped-def]
    lm = load_model(ModelSpec(spec, batch_size=2, seq_len=seq), meta=True)
    return lm, record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)


def unwrapped(model: torch.nn.Module) -> Any:
    """Inside, the model's mixers call transformers' own entry point (the planner's wrapper taken off)."""
    module = sys.modules[type(next(m for m in model.modules() if ms._mixer(m))).__module__]
    return patched(module, ms.FUSED, getattr(module, ms.FUSED).__wrapped__)


def test_a_planned_mixer_saves_what_mamba_ssm_saves(tmp_path):
    """The fused function saves its input (the in-projection's output), the scan's output before the norm and the
    norm's reciprocal std (fp32, one per token and group) and A, the decay made from A_log outside it (whose exp
    saves its output too: 32 bytes each), where the reference's fp32 chunk matrices saved many times it."""
    _, tr = traced(tiny(tmp_path, TINY_NEMOTRON_H), 256)
    zxbcdt = 2 * 256 * (128 + (128 + 2 * 2 * 16) + 8) * 2  # z, x B C, dt in bf16
    out_x = 2 * 256 * 8 * 16 * 2
    rstd = 2 * 256 * 2 * 4
    saved = sum(e.saved for e in tr.events if e.is_op and not e.backward and e.module == "model.layers.0.mixer")
    assert saved == zxbcdt + out_x + rstd + 2 * 8 * 4
    mixer = [e for e in tr.events if e.is_op and e.module == "model.layers.0.mixer" and e.flops]
    forward = [e.flops for e in mixer if not e.backward]
    macs = ms.scan_macs(8, 16, 16, 2, 32, 128 + 2 * 2 * 16, 4, backward=False)
    # the conv and scan op, then the output projection's matmul (128 -> 64 features)
    assert forward == [2 * 2 * 256 * macs, 2 * 2 * 256 * 128 * 64]
    backward = sorted(e.flops for e in mixer if e.backward)
    macs = ms.scan_macs(8, 16, 16, 2, 32, 128 + 2 * 2 * 16, 4, backward=True)
    assert backward == sorted([2 * 2 * 256 * macs, *[2 * 2 * 256 * 128 * 64] * 2])  # dy and the weight's grad
    assert any(e.workspace for e in tr.events if e.backward and e.module == "model.layers.0.mixer")


def test_the_reference_s_saved_chunk_matrices_are_gone(tmp_path):
    """transformers' reference saved fp32 chunk-by-chunk products: many times what the fused function saves."""
    spec = tiny(tmp_path, TINY_MAMBA2)
    _, fused = traced(spec, 512)
    lm = load_model(ModelSpec(spec, batch_size=2, seq_len=512), meta=True)  # (building wraps the entry point)
    with unwrapped(lm.model):
        reference = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)

    def mixer_saved(tr) -> int:  # type: ignore[no-untyped-def]
        return sum(e.saved for e in tr.events if e.is_op and not e.backward and e.module.endswith(".mixer"))

    assert mixer_saved(reference) > 5 * mixer_saved(fused)


def test_real_tensors_take_transformers_own_path(tmp_path):
    torch.manual_seed(0)
    model = load_model(tiny(tmp_path, TINY_NEMOTRON_H), meta=False).model
    module = sys.modules[type(next(m for m in model.modules() if ms._mixer(m))).__module__]
    assert getattr(getattr(module, ms.FUSED), "__wrapped_by_fsdp_planner__", False) and ms.mixers(model) == 2
    ids = torch.randint(0, 256, (2, 40))
    got = model(ids).logits
    with unwrapped(model):
        want = model(ids).logits
    assert torch.equal(got, want)


def test_the_backward_workspace_holds_the_conv_the_norm_s_dx_and_the_larger_moment():
    zxbcdt = torch.empty(2, 100, 2 * 128 + 2 * 2 * 16 + 8, device="meta", dtype=torch.bfloat16)
    conv_w = torch.empty(128 + 2 * 2 * 16, 4, device="meta")
    D = torch.empty(8, device="meta")
    chunks = 4  # 100 tokens in chunks of 32
    conv = 2 * 2 * 100 * (128 + 64) * 2
    norm_dx = 2 * 100 * 128 * 2
    dda = 2 * 8 * chunks * 1 * 32 * 4
    states = 2 * 2 * chunks * 8 * 16 * 16 * (4 + 2)  # fp32 and a bf16 copy, the states and their gradients
    cb = 3 * 2 * chunks * 2 * 32 * 32 * 4 + 2 * 2 * 100 * 2 * 16 * 4
    args = (None, zxbcdt, conv_w, None, None, None, D, None, None, None, 16, 2, 32)
    got = workspace_bytes(torch.ops.fsdp_planner.mamba_conv_scan_backward.default, args, {})
    assert got == conv + norm_dx + dda + max(states, cb)


def test_the_note_counts_the_mixers_the_trace_ran_fused_and_mamba_1_has_none(tmp_path):
    """Mamba-1's mixers (a conv1d, A_log and D too, but A_log a matrix) are no Mamba-2 mixers: no note; a mixer that
    ran the reference (a cache, another transformers) is said, not counted as fused."""
    from fsdp_planner.service.tracing import mamba_note

    mamba1 = {"model_type": "mamba", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "state_size": 8}
    lm, tr = traced(tiny(tmp_path, mamba1), 64)
    assert ms.mixers(lm.model) == 0 and mamba_note(tr, lm.model) is None
    lm, tr = traced(tiny(tmp_path, TINY_NEMOTRON_H), 64)
    assert mamba_note(tr, lm.model).startswith("2 Mamba-2 mixers traced as mamba_ssm's fused function")
    with unwrapped(lm.model):
        reference = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    assert mamba_note(reference, lm.model).startswith("2 of 2 Mamba-2 mixers traced as transformers' PyTorch reference")


def test_a_config_s_tagged_infinity_is_read_and_nan_is_refused(tmp_path, capsys):
    from fsdp_planner.cli import main

    nan = {**TINY_MAMBA2, "time_step_limit": [0.0, {"__float__": "NaN"}]}
    assert main(["plan", tiny(tmp_path, nan), "--cluster", "h100:8", "--policy", "titan"]) == 2
    assert "time_step_limit[1] = NaN is not a finite number" in capsys.readouterr().err
    huge = {**TINY_MAMBA2, "hidden_size": {"__float__": "Infinity"}}
    assert main(["plan", tiny(tmp_path, huge), "--cluster", "h100:8", "--policy", "titan"]) == 2
    assert "hidden_size = Infinity is not a finite number" in capsys.readouterr().err
    low = {**TINY_MAMBA2, "time_step_limit": [{"__float__": "Infinity"}, 1.0]}  # only the upper end is unbounded
    assert main(["plan", tiny(tmp_path, low), "--cluster", "h100:8", "--policy", "titan"]) == 2
    assert "time_step_limit[0] = Infinity is not a finite number" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.parametrize("config", [TINY_NEMOTRON_H, TINY_MAMBA2], ids=["nemotron_h", "mamba2"])
def test_real_fsdp2_on_fake_ranks_allocates_as_predicted(tmp_path, config):
    r = run_main("verify", tiny(tmp_path, config), "--policy", "titan", "--ac", "full", "--fake-world-size", "8",
                 "--cluster", "h100:8", "--seq", "512")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


@pytest.mark.integration
def test_a_tiny_nemotron_h_trains_on_two_gloo_ranks_with_parity(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_main("verify", tiny(tmp_path, TINY_NEMOTRON_H), "--policy", "titan", "--nproc", "2", "--steps", "2",
                 "--seq", "64", "--time-steps", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


def test_mamba_ssm_s_scan_kernels_in_a_profile_are_the_class_the_simulator_times_them_in():
    """The stand-in's op has FLOPs and no named kernel: the calibration's matmul class (``trace_fit``); its cumsum
    kernels move bytes only."""
    from fsdp_planner.calibrate.kineto import OpClass, op_class

    for name in ("_chunk_scan_fwd_kernel", "_chunk_state_bwd_db_kernel", "_bmm_chunk_fwd_kernel",
                 "_state_passing_bwd_kernel", "_chunk_scan_chunk_state_bwd_dx_kernel"):
        assert op_class(name, gpu=True) is OpClass.MATMUL, name
    assert op_class("_chunk_cumsum_fwd_kernel", gpu=True) is OpClass.MEMORY
