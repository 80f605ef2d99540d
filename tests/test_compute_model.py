"""The compute model (issue 27): the roofline's terms, the published runs' hardware presets, the compute section of
a cluster file, and the kernel each traced op records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.cluster import COMPUTE, GPUS, Cluster, Compute, parse_cluster, slowest_rank_factor
from fsdp_planner.sim.compute import flop_efficiency, op_times
from fsdp_planner.sim.float8 import FLOAT8_PEAK_SHARE, fp8_peak
from fsdp_planner.sim.options import PRECISIONS
from fsdp_planner.trace import record
from fsdp_planner.trace.events import KERNEL_ATTENTION, KERNEL_OTHER

H100 = COMPUTE["h100"]


class _Scale(nn.Module):
    """One Linear (a matmul of known shape) and one elementwise op (memory-bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(512, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 3.0


@pytest.fixture(scope="module")
def scale_trace():
    with torch.device("meta"):
        model = _Scale()
        x = torch.randn(4096, 512)
    return record(model, (x,), lambda out: out.sum())


def test_matmul_efficiency_by_shape() -> None:
    big, half, small = (H100.matmul_fraction(d) for d in (16384, H100.matmul_half_dim, 8))
    assert 0.98 * H100.matmul_efficiency < big <= H100.matmul_efficiency  # a big matmul nears the cap
    assert half == pytest.approx(H100.matmul_efficiency / 2)
    assert small < 0.1  # a skinny matmul leaves the tensor cores mostly idle
    eff = flop_efficiency(np.array([KERNEL_OTHER, KERNEL_ATTENTION, 4096, 16]), H100)
    assert eff[0] == H100.matmul_efficiency and eff[1] == H100.attention_efficiency
    assert eff[3] < eff[2] < H100.matmul_efficiency


def test_trace_records_matmul_dims(scale_trace) -> None:
    mm = [e for e in scale_trace.events if e.is_op and e.kernel > 0]
    # forward x @ W.T (4096x512 by 512x64), backward grad_W (64x4096 by 4096x512): smallest dim 64 for both
    assert mm and all(e.kernel == 64 for e in mm)
    assert all(e.kernel == KERNEL_OTHER for e in scale_trace.events if not e.is_op)


def test_roofline_memory_bound_and_matmul(scale_trace) -> None:
    gpu, precision = GPUS["h100"], PRECISIONS["fp32"]
    times = op_times(scale_trace, gpu, precision, H100)
    for e, t in zip(scale_trace.events, times, strict=True):
        if not e.is_op:
            assert t == 0
        elif e.flops == 0 and e.nbytes:  # memory-bound: bytes over the achieved HBM bandwidth
            assert t == pytest.approx(e.nbytes / (gpu.hbm_bandwidth * H100.memory_efficiency))
        elif e.kernel > 0:
            assert t >= e.flops / (gpu.peak_fp32_flops * H100.matmul_fraction(e.kernel)) * (1 - 1e-9)
    # --mfu: the single constant, bytes at the full bandwidth, as before the roofline
    old = op_times(scale_trace, gpu, precision, H100, mfu=0.5)
    for e, t in zip(scale_trace.events, old, strict=True):
        if e.is_op:
            assert t == pytest.approx(max(e.flops / (gpu.peak_fp32_flops * 0.5), e.nbytes / gpu.hbm_bandwidth))


def test_slowest_rank_grows_with_the_world() -> None:
    assert slowest_rank_factor(0.012, 1) == 1.0 and slowest_rank_factor(0.0, 128) == 1.0
    f8, f128, f1024 = (slowest_rank_factor(0.012, n) for n in (8, 128, 1024))
    assert 1 < f8 < f128 < f1024 < 1.05
    assert f8 == pytest.approx(1 + 0.012 * 1.42, abs=2e-4)  # expected max of 8 standard normals: 1.42


def test_published_hardware_presets() -> None:
    e = parse_cluster("h100e:128")
    assert (e.nodes, e.gpus_per_node, e.name) == (16, 8, "h100e:128")
    assert e.gpu.hbm_bandwidth == 2.4e12 and e.gpu.memory_bytes == 96_000_000_000  # torchtitan's table
    assert 835e12 < e.gpu.peak_bf16_flops < 989e12  # between H100 NVL and SXM, as torchtitan's footnote says
    assert GPUS["a100"].peak_bf16_flops == 312e12 and GPUS["a100"].hbm_bandwidth == 2.039e12  # A100 80GB SXM data sheet
    assert GPUS["h200"].hbm_bandwidth == 4.8e12 and GPUS["h200"].peak_bf16_flops == 989e12
    # FlashAttention-2 reaches more of an A100 than of an H100 (its paper, and FlashAttention-3's)
    assert COMPUTE["a100"].attention_efficiency > COMPUTE["h100"].attention_efficiency
    assert e.compute == COMPUTE["h100e"]
    # the matmul caps are the GEMM sweeps' figures (hardware/cluster.py): H100 SXM 794.5 of 989 TFLOP/s, A100 SXM
    # 271.2 of 312, and float8 on the H100 1,402.6 of 1,979
    assert COMPUTE["h100"].matmul_efficiency == round(794.5 / 989, 2) == COMPUTE["h200"].matmul_efficiency
    assert COMPUTE["a100"].matmul_efficiency == round(271.2 / 312, 2)
    h100 = GPUS["h100"]
    assert fp8_peak(h100) * FLOAT8_PEAK_SHARE * COMPUTE["h100"].matmul_efficiency == pytest.approx(1402.6e12, rel=0.005)


def test_compute_section_round_trip(tmp_path) -> None:
    c = parse_cluster("a100:16")
    path = tmp_path / "c.json"
    c.save(path)
    assert Cluster.load(path).compute == COMPUTE["a100"]
    d = json.loads(path.read_text())
    del d["compute"]  # a file written before the compute model: the H100's factors
    path.write_text(json.dumps(d))
    assert Cluster.load(path).compute == COMPUTE["h100"]
    d["compute"] = {"matmul_efficiency": 1.5}
    path.write_text(json.dumps(d))
    with pytest.raises(PlannerError, match=r"compute.matmul_efficiency' is 1.5, outside 0..1"):
        Cluster.load(path)
    d["compute"] = {"matmul_eficiency": 0.5}
    path.write_text(json.dumps(d))
    with pytest.raises(PlannerError, match=r"unknown field 'compute\.matmul_eficiency'"):
        Cluster.load(path)


def test_compute_fields_have_defaults_for_partial_sections(tmp_path) -> None:
    d = parse_cluster("h100:8").to_dict()
    d["compute"] = {"attention_efficiency": 0.7}
    c = Cluster.from_dict(d)
    assert c.compute.attention_efficiency == 0.7 and c.compute.matmul_efficiency == H100.matmul_efficiency
    assert isinstance(c.compute, Compute)


def test_calibrate_compute_fit_round_trip(tmp_path) -> None:
    """Op times made by a known roofline are fitted back to its factors, and the cluster file keeps them."""
    from fsdp_planner.calibrate.compute import MATMUL_DIMS, ComputeSample, fit_compute

    gpu, truth = GPUS["h100"], Compute(0.7, 200.0, 0.4, 0.9, 0.01)
    peak = gpu.peak_bf16_flops
    samples = [ComputeSample("matmul", d, 2.0 * d * 8192 ** 2, 0.0,
                             2.0 * d * 8192 ** 2 / (peak * truth.matmul_fraction(d))) for d in MATMUL_DIMS]
    samples += [ComputeSample("attention", 0, 1e12, 0.0, 1e12 / (peak * 0.4)),
                ComputeSample("memory", 0, 0.0, 1e9, 1e9 / (gpu.hbm_bandwidth * 0.9))]
    fitted = fit_compute(samples, gpu, COMPUTE["h100"], "test")
    assert fitted.matmul_efficiency == pytest.approx(0.7) and fitted.matmul_half_dim == pytest.approx(200.0)
    assert fitted.attention_efficiency == pytest.approx(0.4) and fitted.memory_efficiency == pytest.approx(0.9)
    assert fitted.variation == COMPUTE["h100"].variation  # one GPU cannot see the spread across a cluster
    replace(parse_cluster("h100:8"), compute=fitted).save(tmp_path / "c.json")
    assert Cluster.load(tmp_path / "c.json").compute == fitted


def test_calibrate_compute_needs_a_gpu(tmp_path, capsys) -> None:
    from fsdp_planner.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["calibrate", "--compute", "--out", str(tmp_path / "c.json")]) != 0
    err = capsys.readouterr().err
    assert "on a CUDA GPU" in err and "Traceback" not in err and not (tmp_path / "c.json").exists()


def test_no_shape_term_is_the_cap() -> None:
    flat = replace(H100, matmul_half_dim=0.0)
    with np.errstate(all="raise"):
        eff = flop_efficiency(np.array([KERNEL_OTHER, 8, 4096]), flat)
    assert list(eff) == [flat.matmul_efficiency] * 3


@pytest.fixture(scope="module")
def published_h100_tps() -> dict[int, float]:
    """The predicted tokens/s/GPU of torchtitan's published Llama 3 8B rows (benchmarks/fidelity_published.md) on
    8 and 128 H100s: the model they ran, with torchtitan's RMSNorm module of 2024 (benchmarks/titan2024_models.py)."""
    import contextlib
    import io

    from fsdp_planner.cli import main

    model = str(Path(__file__).resolve().parent.parent / "benchmarks" / "titan2024_models.py") + ":llama3_8b"
    tps = {}
    for gpus in (8, 128):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["simulate", model, "--policy", "titan", "--ac", "op", "--ac-policy", "titan-early",
                         "--batch", "2", "--seq", "8192", "--cluster", f"h100e:{gpus}", "--json"]) == 0
        tps[gpus] = 2 * 8192 / json.loads(out.getvalue())["step_time"]
    return tps


_FAST_128 = pytest.mark.xfail(
    strict=True, reason="+13.3% with the H100's matmul cap from an independent GEMM sweep (0.80; +9.8% with 0.75, "
                        "B200's figure): the step lacks time the model does not charge, FSDP2's copy kernels and "
                        "eager's idle gaps, which an H200 trace shows (benchmarks/gpu_step.md, fidelity_published.md)")


@pytest.mark.integration  # two traces of Llama 3 8B (~8 s): the full suite runs it
@pytest.mark.parametrize("gpus", [8, pytest.param(128, marks=_FAST_128)])
def test_published_h100_runs_within_ten_percent(published_h100_tps, gpus) -> None:
    """5,762 tokens/s/GPU published on 8 H100s, 5,605 on 128: the prediction within 10%."""
    assert published_h100_tps[gpus] == pytest.approx({8: 5762, 128: 5605}[gpus], rel=0.10)


@pytest.mark.integration
@pytest.mark.xfail(strict=True, reason="the 8 -> 128 trend: published -2.7% per GPU, predicted +0.1% since the GPU "
                   "optimizer step (smaller at 128) is modelled; the missing cost is named in fidelity_published.md")
def test_published_h100_runs_slow_per_gpu_from_8_to_128(published_h100_tps) -> None:
    """128 GPUs are slower per GPU than 8, as published."""
    assert published_h100_tps[128] < published_h100_tps[8]


@pytest.mark.parametrize("section", ["compute", "overhead", "gpu"])
@pytest.mark.parametrize("value", [[1, 2], None, 5])
def test_cluster_section_not_an_object_is_refused(tmp_path, section: str, value: object) -> None:
    """A list or null where a section belongs read as an absent section (the preset's factors, unsaid)."""
    path = tmp_path / "c.json"
    parse_cluster("h100:8").save(path)
    d = json.loads(path.read_text())
    d[section] = value
    path.write_text(json.dumps(d))
    with pytest.raises(PlannerError, match=rf"field '{section}' must be a JSON object of "):
        Cluster.load(path)
