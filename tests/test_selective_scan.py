"""Mamba-1's selective scan planned as mamba_ssm's fused kernel runs it (``selective_scan.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_main, runs_the_reference, verify_passes

pytest.importorskip("transformers")

from fsdp_planner import selective_scan as ss
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.sim.compute import op_times
from fsdp_planner.sim.options import PRECISIONS
from fsdp_planner.trace import record
from fsdp_planner.trace.events import KERNEL_SELECTIVE_SCAN

# a Jamba: Mamba layers 0, 1 and 3, attention layer 2, experts in layers 1 and 3 (a new user's trial config)
TINY_JAMBA = {"model_type": "jamba", "attn_layer_offset": 2, "attn_layer_period": 4, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 0, "expert_layer_offset": 1, "expert_layer_period": 2,
              "hidden_size": 64, "intermediate_size": 128, "mamba_d_conv": 4, "mamba_d_state": 16,
              "mamba_dt_rank": 8, "mamba_expand": 2, "max_position_embeddings": 256, "num_attention_heads": 4,
              "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "use_cache": False}


def tiny(tmp_path: Path) -> str:
    path = tmp_path / "tiny-jamba.json"
    path.write_text(json.dumps(TINY_JAMBA))
    return f"hf:{path}"


def traced(spec: str, seq: int):  # type: ignore[no-untyped-def]
    lm = load_model(ModelSpec(spec, batch_size=2, seq_len=seq), meta=True)
    return lm, record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)


def test_a_planned_step_runs_the_kernel_not_the_loop_over_tokens(tmp_path):
    """One forward and one backward op a Mamba layer at any length (the reference loops over every token), no
    FLOPs counted, timed by its bytes at the memory efficiency; the note names the path."""
    from fsdp_planner.service.tracing import selective_scan_note

    spec = tiny(tmp_path)
    ops = {}
    for seq in (64, 256):
        lm, tr = traced(spec, seq)
        scans = [i for i, e in enumerate(tr.events) if e.is_op and e.kernel == KERNEL_SELECTIVE_SCAN]
        assert len(scans) == 6 and sum(tr.events[i].backward for i in scans) == 3
        assert all(tr.events[i].flops == 0 and tr.events[i].nbytes > 0 for i in scans)
        ops[seq] = sum(1 for e in tr.events if e.is_op)
    assert ops[64] == ops[256]
    cluster = parse_cluster("h100:8")
    seconds = op_times(tr, cluster.gpu, PRECISIONS["bf16-mixed"], cluster.compute)
    i = scans[0]
    assert seconds[i] == pytest.approx(tr.events[i].nbytes / (cluster.gpu.hbm_bandwidth
                                                              * cluster.compute.memory_efficiency))
    said = selective_scan_note(tr, lm.model)
    assert said is not None and said.startswith("3 Mamba-1 mixers' scans traced as mamba_ssm's selective_scan_fn")


def test_the_scan_saves_what_mamba_ssm_s_function_saves():
    """SelectiveScanFn with a gate (mamba_ssm/ops/selective_scan_interface.py): u, delta, A, B, C, D, z, the delta
    bias, the chunk states x (batch, channels, one per 2,048 tokens, 2 x dstate) in A's fp32, and the ungated out."""
    b, d, n, t = 2, 32, 16, 2100  # two chunks of 2,048
    u, delta, z = (torch.empty(b, d, t, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    B, C = (torch.empty(b, n, t, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    A = torch.empty(d, n, device="meta", requires_grad=True)
    D, bias = (torch.empty(d, device="meta", requires_grad=True) for _ in range(2))
    saved: list[torch.Tensor] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = ss.fused_scan(lambda *a, **kw: None)(u, delta, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True)
    assert out.shape == (b, d, t) and out.dtype == torch.bfloat16
    assert [(tuple(x.shape), x.dtype) for x in saved] == [
        *[((b, d, t), torch.bfloat16)] * 2, ((d, n), torch.float32), *[((b, n, t), torch.bfloat16)] * 2,
        ((d,), torch.float32), ((b, d, t), torch.bfloat16), ((d,), torch.float32),
        ((b, d, 2, 2 * n), torch.float32), ((b, d, t), torch.bfloat16)]
    out.sum().backward()
    assert B.grad.dtype == torch.bfloat16 and A.grad.shape == (d, n)


def test_real_tensors_run_transformers_own_reference(tmp_path):
    torch.manual_seed(0)
    model = load_model(tiny(tmp_path), meta=False).model
    runs_the_reference(model, next(m for m in model.modules() if ss._mixer(m)), ss.SCAN,
                       torch.randint(0, 512, (2, 40)))


@pytest.mark.integration
def test_real_fsdp2_on_fake_ranks_allocates_as_predicted(tmp_path):
    verify_passes(tiny(tmp_path), "--policy", "titan", "--ac", "full", "--fake-world-size", "8", "--cluster",
                  "h100:8", "--seq", "256")


@pytest.mark.integration
def test_a_tiny_jamba_trains_on_two_gloo_ranks_with_parity(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    verify_passes(tiny(tmp_path), "--policy", "titan", "--nproc", "2", "--steps", "2", "--seq", "40",
                  "--time-steps", "0")


def test_the_plan_records_the_kernels_it_assumes_and_its_export_checks_for_them(tmp_path):
    """A plan whose figures assume mamba_ssm's kernel says so (``kernels``), reads back, and its exported code warns
    where the launching Python lacks the package (this CPU machine has no mamba_ssm); a plan file naming another
    package is refused in one sentence."""
    import warnings

    from fsdp_planner.apply.export import export_plan
    from fsdp_planner.choices import ExportFormat
    from fsdp_planner.errors import PlannerError
    from fsdp_planner.fsdp2.plan import Plan

    out = tmp_path / "plan.json"
    r = run_main("plan", tiny(tmp_path), "--policy", "titan", "--cluster", "h100:2", "--seq", "64", "--out",
                 str(out), "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    plan = Plan.load(out)
    assert plan.kernels == ("mamba-ssm",)
    source = export_plan(plan, ExportFormat.PYTHON)
    namespace: dict = {}
    exec(compile(source, "exported.py", "exec"), namespace)  # (the export's own code: a module of definitions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace["check_kernels"]()
    assert [str(w.message)[:60] for w in caught] == ["the plan's step time and memory assume mamba-ssm's kernels, "]
    bad = json.loads(out.read_text())
    bad["kernels"] = ["cuda-magic"]
    with pytest.raises(PlannerError, match="plan 'kernels' must be a list of flash-linear-attention, mamba-ssm"):
        Plan.from_json(json.dumps(bad))


@pytest.mark.integration
@pytest.mark.parametrize("extra", [["--ac", "full"], []])
def test_a_cache_asked_for_runs_the_kernel_too_and_real_fsdp2_agrees(tmp_path, extra):
    """With use_cache=true the scan returns a last state too, which sent the trace to the per-token reference while
    checkpointed layers run without a cache: the peak was predicted +128% above real FSDP2's under --ac full (a new
    user's trial). The kernel returns the state as a view of its chunk states: one path either way."""
    spec = tiny(tmp_path)
    lm = load_model(ModelSpec(spec, batch_size=1, seq_len=64, hf_config=(("use_cache", True),)), meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    assert sum(1 for e in tr.events if e.is_op and e.kernel == KERNEL_SELECTIVE_SCAN) == 6
    verify_passes(spec, "--hf-config", "use_cache=true", "--policy", "module", *extra, "--fake-world-size", "4",
                  "--seq", "128", "--cluster", "h100:4")
