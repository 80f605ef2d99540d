"""What one H200 measured of torchtitan's 2-D layouts (``benchmarks/gpu_2d.md``; files in ``benchmarks/gpu/``): rank 0
of FSDP 8 x TP 8 on the fake process group with real CUDA tensors, its torch.profiler trace read by ``calibrate
--trace``. A TP rank runs 1/TP of each parallelized matmul: the trace's kernels are matched to the simulator's view
of one TP rank (``simulate.rank_step``), not to the whole model's ops, and float8's converted matmuls run at the
float8 peak with their casts as memory-bound kernels, fused where the plan compiles the blocks."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from fsdp_planner.calibrate.kineto import read_trace
from fsdp_planner.hardware.cluster import Cluster, preset_cluster

GPU_DATA = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"
MODELS = str(GPU_DATA.parent / "gpu_models.py")


def free_links(world: int) -> Cluster:
    """The h200 preset of ``world`` GPUs with ideal links: the fake process group's collectives move nothing."""
    d = preset_cluster("h200", nodes=world // 8).to_dict()
    for link in ("intra", "inter"):
        d[link].update(bus_bandwidth=math.inf, base_latency=0.0, hop_latency=0.0)
    return Cluster.from_dict(d)


def _classes(rows: list) -> dict[str, tuple[int, int, float, float]]:
    return {r.op_class: (r.ops_measured, r.ops_simulated, r.measured, r.before) for r in rows}


@pytest.mark.integration
def test_tp_trace_is_matched_to_one_tp_rank_s_ops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3 70B's block (4 layers) at TP 8: the preset's matmul seconds are the trace's within 15% (+11.0% on
    2026-11-30) and the matmul kernels and ops agree in number within 10%; matched to the whole model's ops, as
    before this, the preset charged 9x the measured matmul time. The fake collectives left no NCCL kernels, and
    the simulator's TP collectives are in no op class. ``simulate --against`` draws the TP rank's timeline (it
    indexed the whole model's events with the view's ops: an internal error)."""
    from fsdp_planner.calibrate.trace_fit import fit_trace
    from fsdp_planner.cli import main
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions

    options = SimOptions.named("bf16-mixed")
    tr = trace_spec(ModelSpec(f"{MODELS}:llama3_70b_l4"), options.precision, False, lambda line: None)
    plan = Plan.from_json((GPU_DATA / "llama3-70b-l4-tp8.plan.json").read_text())
    measured = read_trace(GPU_DATA / "llama3-70b-l4-tp8.trace.json.gz")
    assert (measured.device, measured.world) == ("cuda", 64)
    cluster, fit = fit_trace(tr, plan, [measured], free_links(64), options)
    ops, sim_ops, seconds, before = _classes(fit.classes)["matmul"]
    assert before == pytest.approx(seconds, rel=0.15)
    assert sim_ops == pytest.approx(ops, rel=0.10)
    assert not fit.collectives
    assert fit.after.step_seconds(False) == pytest.approx(fit.measured_step, rel=0.02)
    cluster.save(tmp_path / "fitted.json")
    assert main(["simulate", f"{MODELS}:llama3_70b_l4", "--plan", str(GPU_DATA / "llama3-70b-l4-tp8.plan.json"),
                 "--cluster", str(tmp_path / "fitted.json"), "--precision", "bf16-mixed", "--against",
                 str(GPU_DATA / "llama3-70b-l4-tp8.trace.json.gz"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"]["step"] == pytest.approx(fit.after.step_seconds(False), rel=1e-9)
    assert out["simulated"]["backward"] > out["simulated"]["forward"] > 0


@pytest.mark.integration
def test_compiled_float8_plan_is_calibrated_as_it_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3.1 405B's block (2 layers) at TP 8, compiled, float8: ``calibrate --trace`` traces the blocks the plan
    compiles compiled (their float8 casts fused) and charges the converted matmuls at the float8 peak: the
    preset's matmul seconds are the trace's within 20% (+14.6%), and its memory-bound seconds stay below the
    measured ones, as bf16 eager's do (the casts charged eager and unfused were 2.1x the measured class)."""
    from fsdp_planner.cli import main

    out = tmp_path / "fit.json"
    base = tmp_path / "free.json"
    base.write_text(free_links(128).to_json())
    args = ["calibrate", "--trace", str(GPU_DATA / "llama3-405b-l2-tp8-float8.trace.json.gz"), "--model",
            f"{MODELS}:llama3_405b_l2", "--plan", str(GPU_DATA / "llama3-405b-l2-tp8-float8.plan.json"), "--base",
            str(base), "--precision", "bf16-mixed", "--out", str(out), "--json"]
    assert main(args) == 0
    classes = {r["op_class"]: r for r in json.loads(capsys.readouterr().out)["fit"]["classes"]}
    assert classes["matmul"]["before"] == pytest.approx(classes["matmul"]["measured"], rel=0.20)
    assert 0 < classes["memory-bound"]["before"] < classes["memory-bound"]["measured"]


@pytest.mark.integration
@pytest.mark.parametrize("name", ["llama3-70b-l4-tp8", "llama3-8b-fsdp64", "llama3-405b-l2-tp8"])
def test_allocated_peak_on_the_h200(name: str) -> None:
    """The predicted allocated peak of each eager layout is the H200's within 1% (median of its runs,
    ``measured2d.json``). The 405B one peaks in the vocab-parallel embedding's backward, beside the CUDA kernel's
    partial-sums buffer (``workspaces.py``): 13.3% short without it, where the CPU fake world agreed with the
    prediction, its kernel making no such buffer."""
    import statistics

    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import simulate

    measured = json.loads((GPU_DATA / "measured2d.json").read_text())["runs"][name]
    model = {"llama3-70b-l4-tp8": "llama3_70b_l4", "llama3-8b-fsdp64": "llama3_8b",
             "llama3-405b-l2-tp8": "llama3_405b_l2"}[name]
    options = SimOptions.named("bf16-mixed")
    tr = trace_spec(ModelSpec(f"{MODELS}:{model}"), options.precision, False, lambda line: None)
    plan = Plan.from_json((GPU_DATA / f"{name}.plan.json").read_text())
    world = measured[0]["world"]
    report = simulate(tr, plan, free_links(world), options, timeline=False)
    assert report.peak_memory == pytest.approx(statistics.median(r["peak_allocated"] for r in measured), rel=0.01)


def test_embedding_backward_workspace_is_the_cuda_kernel_s() -> None:
    """``grad_weight_per_segment``'s rows: numel / 10 partial segments beyond one a distinct index (at most
    num_weights), fp32 for bf16 grads; none on the atomic path of at most 3,072 indices."""
    import torch

    from fsdp_planner.workspaces import workspace_bytes

    op = torch.ops.aten.embedding_dense_backward.default
    grad = torch.empty(2, 8192, 16384, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(2, 8192, dtype=torch.long, device="meta")
    assert workspace_bytes(op, (grad, ids, 128_256, -1, False)) == (16384 // 10 + 16384) * 16384 * 4 == 1_181_089_792
    small = torch.empty(3, 1000, dtype=torch.long, device="meta")
    assert workspace_bytes(op, (torch.empty(3, 1000, 64, device="meta"), small, 50, -1, False)) == 0
    assert workspace_bytes(op, (torch.empty(3, 1000, 64, device="meta"), small, 50, -1, True)) == (300 + 50) * 64 * 4
    assert workspace_bytes(torch.ops.aten.mm.default, (grad, ids)) == 0


def test_embedding_workspace_is_its_own_dtype_and_gpu_only() -> None:
    """The trace records the buffer on the embedding's backward op as ``Event.workspace``, apart from the gradients
    alive there: a fp32 trace planned in bf16 halves the gradients, not the fp32 buffer, and CPU ranks (gloo's
    ``Engine.HOST``) hold none of it."""
    import torch
    from torch import nn

    from fsdp_planner.sim.memory import activation_levels
    from fsdp_planner.sim.options import PRECISIONS
    from fsdp_planner.trace import record

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(100, 16), nn.Linear(16, 100)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(ids))

    with torch.device("meta"):
        model = Tiny()
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    trace = record(model, (ids,), lambda y: y.float().sum())
    (op,) = [i for i, e in enumerate(trace.events) if e.workspace]
    assert trace.events[op].workspace == (4096 // 10 + 100) * 16 * 4 and trace.events[op].backward
    for name in ("fp32", "pure-bf16"):
        gpu, cpu = (activation_levels(trace, PRECISIONS[name], (), w) for w in (True, False))
        assert gpu[op] - cpu[op] == trace.events[op].workspace
        assert (gpu - cpu).sum() == trace.events[op].workspace


@pytest.mark.integration
@pytest.mark.parametrize(("name", "model", "world"), [("llama3-70b-l4-tp8", "llama3_70b_l4", 64),
                                                      ("llama3-405b-l2-tp8", "llama3_405b_l2", 128)])
def test_relayout_copies_are_the_trace_s_cat_kernels(name: str, model: str, world: int) -> None:
    """Each sequence-dim TP collective's re-layout copy (``tensor_parallel._relayout``) is one ``CatArrayBatchedCopy``
    kernel of the H200's trace, as many a step (70B, local batch 8: 48; 405B, batch 2: 26; full checkpointing's
    recomputation stops before a block's last reduce-scatter), each moving the whole activation; at local batch 1
    the all-gathers' copies are views, and only the reduce-scatters' remain."""
    import dataclasses

    from fsdp_planner.calibrate.trace_fit import op_runs
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import rank_step
    from fsdp_planner.trace.events import KERNEL_TP_ALL_GATHER, KERNEL_TP_RELAYOUT

    tr = trace_spec(ModelSpec(f"{MODELS}:{model}"), SimOptions.named("bf16-mixed").precision, False, lambda _: None)
    plan = Plan.from_json((GPU_DATA / f"{name}.plan.json").read_text())
    events = json.loads(gzip.decompress((GPU_DATA / f"{name}.trace.json.gz").read_bytes()))["traceEvents"]
    steps = sum(1 for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    cats, rest = divmod(sum(1 for e in events if e.get("cat") == "kernel" and "CatArrayBatchedCopy" in e["name"]),
                        steps)
    assert steps == 3 and rest == 0

    def copies(trace: object) -> tuple[int, int]:
        view, p, _ = rank_step(trace, plan, free_links(world))
        k, runs = view.index.op_kernel, op_runs(view, p)
        gathers = [i for i in range(1, len(k)) if k[i] == KERNEL_TP_RELAYOUT and k[i - 1] == KERNEL_TP_ALL_GATHER]
        return int(runs[k == KERNEL_TP_RELAYOUT].sum()), len(gathers)

    (runs, gathers), (alone, none) = copies(tr), copies(dataclasses.replace(tr, attention_batch=1))
    assert runs == cats and gathers > 0
    assert none == 0 and 0 < alone < runs
