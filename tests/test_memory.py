"""The one memory model: seed 002's measured table, the ZeRO paper's 7.5B anchor, ZeRO ordering, and the strategy
table's FSDP row being the simulator's peak."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rich.console import Console

from fsdp_planner.cli.render import strategy_table as render_strategy_table
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.sim.memory import STRATEGIES, MemoryBreakdown, MemoryModel, activation_levels, strategy_table
from fsdp_planner.sim.options import (
    OPTIMIZERS,
    PRECISIONS,
    Optimizer,
    SimOptions,
    ZeroGrad,
    optimizer_named,
    precision_named,
)
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.sim.sizing import Sizing
from fsdp_planner.trace import ModuleInfo, ParamInfo, Trace, record

GB = 1e9  # seed 002 prints memory / 1e9
# Seed 002 (10 x Linear(10000, 10000), SGD momentum, one input vector), torch.cuda.max_memory_allocated on rank 0
SEED_002_GB = {"fp32": 12.035, "autocast": 14.035, "autocast-nocache": 12.235, "ddp": 16.036}


@pytest.fixture(scope="module")
def seed_trace() -> Trace:
    lm = load_model("seed-linear10")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def seed_options(precision: str) -> SimOptions:
    return SimOptions.named(precision, "sgd-momentum")


def _close(got_bytes: float, want_gb: float, rel: float) -> bool:
    return abs(got_bytes / GB - want_gb) <= rel * want_gb


@pytest.mark.parametrize("precision", ["fp32", "autocast", "autocast-nocache"])
def test_seed_single_device(seed_trace: Trace, precision: str) -> None:
    b = strategy_table(seed_trace, 1, seed_options(precision))["single"]
    assert _close(b.total, SEED_002_GB[precision], 0.02), b.total / GB
    assert b.params == b.grads == b.optimizer_state == 4_000_400_000  # 1.0001e9 fp32 elements each


def test_seed_components(seed_trace: Trace) -> None:
    cached = strategy_table(seed_trace, 1, seed_options("autocast"))["single"]
    nocache = strategy_table(seed_trace, 1, seed_options("autocast-nocache"))["single"]
    assert cached.compute_copies == 10 * 100_010_000 * 2  # fp16 cache of every weight and bias: 2.0 GB
    assert nocache.compute_copies == 10_000 * 10_000 * 2  # one Linear weight's fp16 copy: the 0.2 GB gap
    assert seed_trace.numel == 1_000_100_000
    assert 0 < activation_levels(seed_trace, seed_options("fp32").precision).max() < 1e6
    # 4 GB of grads outweigh 80 KB of activations: the peak is after backward, every grad held and of the
    # activations only the batch, which the caller holds all step
    fp32 = strategy_table(seed_trace, 1, seed_options("fp32"))["single"]
    assert seed_trace.inputs_nbytes > 0
    assert (fp32.grads, fp32.activations) == (4_000_400_000, seed_trace.inputs_nbytes)


def test_each_strategy_at_its_peak_moment() -> None:
    """Activations peak as forward ends, grads (set to None by zero_grad) once backward is done: a row holds
    one or the other at its peak, never both maxima."""
    lm = load_model("toy-llama")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    acts = activation_levels(tr, SimOptions().precision)
    assert acts[-1] < acts.max()
    single = strategy_table(tr, 1, SimOptions.named("bf16-mixed", "adamw-fused"))["single"]
    kept = strategy_table(tr, 1, SimOptions.named("bf16-mixed", "adamw-fused", zero_grad="zeros"))["single"]
    grads = sum(p.numel for p in tr.params) * 4
    assert (single.grads, single.activations) == (0, round(acts.max()))  # forward's end: no grad exists yet
    assert (kept.grads, kept.activations) == (grads, round(acts.max()))  # zeroed grads live all step
    # foreach AdamW's step holds one state's size more beside every grad: here that moment is the peak
    foreach = strategy_table(tr, 1, SimOptions())["single"]
    assert (foreach.grads, foreach.optimizer_temporaries, foreach.activations) == (grads, grads, round(acts[-1]))
    assert foreach.total > single.total


@pytest.mark.parametrize("precision", ["fp32", "autocast-nocache"])  # the seed's DDP run used the latter
def test_seed_ddp(seed_trace: Trace, precision: str) -> None:
    rows = strategy_table(seed_trace, 8, seed_options(precision))
    assert _close(rows["ddp"].total, SEED_002_GB["ddp"], 0.02), rows["ddp"].total / GB
    assert rows["ddp"].gradient_buckets == rows["ddp"].grads  # gradient buckets: one more copy of the grads
    assert rows["ddp"].total - rows["single"].total == rows["ddp"].grads


@pytest.mark.parametrize("spec", ["seed-linear10", "toy-llama", "toy-gpt2-tied"])
def test_fsdp_row_is_the_simulators_peak_for_one_group_per_module(spec: str) -> None:
    """One memory model: the memory command's FSDP row and simulate agree on the same plan."""
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    options = SimOptions()
    row = strategy_table(tr, 16, options)["fsdp"]
    plan = make_plan(tr, [[m] for m in tr.index.owning_modules if m])
    report = simulate(tr, plan, parse_cluster("h100:16"), options, timeline=False)
    assert row.total == report.peak_memory
    assert row.to_dict() == {**report.memory_at_peak, "total": report.peak_memory}


@pytest.mark.parametrize("world_size", [2, 4, 8, 64])
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_zero_stages_decrease(seed_trace: Trace, world_size: int, optimizer: str, precision: str) -> None:
    rows = strategy_table(seed_trace, world_size, SimOptions.named(precision, optimizer))
    totals = [rows[s].total for s in ("ddp", "zero1", "zero2", "fsdp")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals
    assert rows["single"].total < rows["ddp"].total


def test_world_size_one_shards_nothing(seed_trace: Trace) -> None:
    rows = strategy_table(seed_trace, 1, seed_options("fp32"))
    assert rows["zero1"].total == rows["zero2"].total == rows["single"].total


# -- the ZeRO paper's anchor: 7.5B params, mixed-precision Adam (2 + 2 + 12 bytes per param), 64 ranks --------------
# The paper's optimizer keeps three fp32 tensors per param (master weights, momentum, variance) beside 16-bit params;
# torch's Adam keeps its two moments in the params' dtype and no master (test_torch_adam_states_follow_params).
ZERO_PAPER_ADAM = Optimizer("zero-paper-adam", OPTIMIZERS["adam-fused"].step_bytes, states=3, state_bytes=4,
                            fused=True)


def _synthetic_trace(total: int, layers: int) -> Trace:
    per = total // layers
    params = tuple(ParamInfo(f"l{i}.w", per, "bfloat16", 2, True, (f"l{i}",), shape=(per,)) for i in range(layers))
    modules = {"": ModuleInfo("", "Model", (), children=tuple(f"l{i}" for i in range(layers)))}
    modules.update({f"l{i}": ModuleInfo(f"l{i}", "Linear", (f"l{i}.w",)) for i in range(layers)})
    return Trace(params=params, modules=modules, events=(), fingerprint="synthetic")


def test_zero_paper_anchor() -> None:
    """ZeRO paper, Figure 1: 7.5B params, 64 GPUs: 120 GB unsharded, ZeRO-1 31.4 GB, ZeRO-2 16.6 GB, ZeRO-3 1.9 GB
    (params, grads and states only: all held at once, as with grads zeroed rather than set to None)."""
    synthetic = _synthetic_trace(7_500_000_000, 750)
    # the paper counts the states, not the step's temporaries: a fused step makes none
    options = replace(SimOptions.named("pure-bf16", zero_grad="zeros"), optimizer=ZERO_PAPER_ADAM)
    rows = strategy_table(synthetic, 64, options)
    assert _close(rows["single"].total, 120.0, 0.001)
    for stage, gb in {"zero1": 31.4, "zero2": 16.6, "fsdp": 1.9}.items():
        assert _close(rows[stage].total, gb, 0.03), (stage, rows[stage].total / GB)
    # set to None, the grads of a trace that runs no op never exist: params and states only
    unset = strategy_table(synthetic, 64, replace(options, zero_grad=ZeroGrad.NONE))
    assert unset["single"].grads == unset["fsdp"].grads == 0 and _close(unset["single"].total, 105.0, 0.001)


@pytest.mark.parametrize("name", ["adam", "adamw", "adam-fused", "adamw-fused"])
def test_torch_adam_states_follow_params(name: str) -> None:
    """torch's Adam makes exp_avg and exp_avg_sq with ``zeros_like(param)``: as many bytes as two params, whatever
    their dtype (measured here on torch itself), so pure-bf16 holds 4 bytes of state a param, bf16-mixed's fp32
    shards 8."""
    for dtype in (torch.bfloat16, torch.float32):
        param = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
        param.grad = torch.ones_like(param)
        kind = torch.optim.AdamW if name.startswith("adamw") else torch.optim.Adam
        optimizer = kind([param], foreach=False)
        optimizer.step()
        held = sum(t.numel() * t.element_size() for t in optimizer.state[param].values() if t.dim())
        assert OPTIMIZERS[name].state_bytes_per_element(dtype.itemsize) * param.numel() == held


def test_presets() -> None:
    assert PRECISIONS["bf16-mixed"].gather_bytes == 2 and PRECISIONS["bf16-mixed"].param_bytes == 4
    assert PRECISIONS["autocast"].gather_bytes == 4  # autocast does not change what FSDP gathers
    assert PRECISIONS["autocast"].weight_cache and not PRECISIONS["autocast-nocache"].weight_cache
    assert OPTIMIZERS["sgd"].state_bytes_per_element(4) == 0
    assert OPTIMIZERS["sgd-momentum"].state_bytes_per_element(2) == 2
    assert SimOptions() == SimOptions.named("bf16-mixed", "adamw", None)  # the one set of defaults: the roofline


@pytest.mark.parametrize("call", [lambda: precision_named("fp8"), lambda: optimizer_named("lion"),
                                  lambda: SimOptions(mfu=0), lambda: SimOptions(mfu=1.5)])
def test_errors(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlannerError):
        call()


def test_strategy_table_renders_every_strategy(seed_trace: Trace) -> None:
    rows = strategy_table(seed_trace, 8, seed_options("fp32"))
    assert tuple(rows) == STRATEGIES
    console = Console(width=220, record=True)
    console.print(render_strategy_table(rows, "seed-linear10"))
    out = console.export_text()
    for needle in ("strategy", "gradient buckets", "unsharded params", "11.2 GiB", "14.9 GiB", "ddp", "fsdp"):
        assert needle in out
    d = rows["ddp"].to_dict()
    assert d["total"] == rows["ddp"].total and set(d) == {*MemoryBreakdown().to_dict()}


@pytest.mark.parametrize("spec", ["toy-llama", "seed-linear10", "toy-gpt2-tied"])
def test_reserved_adds_the_collective_streams_own_pools(spec: str) -> None:
    """The caching allocator's pools are per stream: FSDP2's all-gather buffers and reduce-scatter outputs (their
    own streams) cannot reuse the default stream's free blocks, so what is reserved is the default stream's peak
    plus the largest all-gather buffer plus the sharded grads (the reduce-scatter outputs, kept cached in their
    pool after ``zero_grad()`` frees them), which the allocated peak counts only where they are live."""
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    plan = make_plan(tr, [[m] for m in tr.index.owning_modules if m])
    report = simulate(tr, plan, parse_cluster("h100:16"), SimOptions(), timeline=False)
    largest = max(g.gather_bytes for g in Sizing(tr, 16, SimOptions().precision).groups(plan))
    grads = _sharded_grads(tr, 16, SimOptions().precision.grad_bytes)
    at = report.memory_at_peak
    pools = report.peak_memory + largest + grads
    slack = round(MemoryModel(tr, 16, SimOptions().precision, SimOptions().optimizer).loss_slack.max())  # allocator.py
    assert pools - at["all_gather_buffers"] - at["grads"] <= report.reserved_memory <= pools + slack
    if at["all_gather_buffers"] == at["grads"] == slack == 0:  # the peak holds neither: the pools add up
        assert report.reserved_memory == pools


def _sharded_grads(tr: Trace, world: int, grad_bytes: int) -> int:
    """The formula: each param's dim 0 padded to a multiple of the world size, one shard per rank."""
    return sum(-(-p.shape[0] // world) * (p.numel // p.shape[0]) for p in tr.params if p.requires_grad) * grad_bytes


def test_reserved_keeps_the_sharded_grads_in_the_reduce_scatter_pool() -> None:
    """The reduce-scatter stream's pool: with ``zero_grad()``'s default (set_to_none) the next step finds the
    sharded grads' blocks cached there, the formula's bytes on top of the default and all-gather pools; with
    ``set_to_none=False`` the grads are allocated all step (counted in the peak) and with offload on the CPU, so
    neither adds them again."""
    lm = load_model("toy-llama")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    plan = make_plan(tr, [[m] for m in tr.index.owning_modules if m])
    cluster, base = parse_cluster("h100:16"), SimOptions()
    none = simulate(tr, plan, cluster, base, timeline=False)
    zeros = simulate(tr, plan, cluster, replace(base, zero_grad=ZeroGrad.ZEROS), timeline=False)
    grads = _sharded_grads(tr, 16, base.precision.grad_bytes)
    assert none.memory_at_peak["grads"] == 0 and zeros.memory_at_peak["grads"] == grads
    assert zeros.peak_memory == none.peak_memory + grads  # set_to_none=False: allocated, so no longer only reserved
    assert zeros.reserved_memory - zeros.peak_memory < none.reserved_memory - none.peak_memory - grads // 2
    model = MemoryModel(tr, 16, base.precision, base.optimizer)
    assert model.kept_grads(plan) == grads
    assert MemoryModel(tr, 16, base.precision, base.optimizer, offload=True).kept_grads(plan) == 0
