"""Memory model: seed 002's measured table, ZeRO ordering and the ZeRO paper's 7.5B anchor (facts.md)."""

from __future__ import annotations

import pytest
from rich.console import Console

from fsdp_planner.errors import PlannerError
from fsdp_planner.memory import (
    GB,
    OPTIMIZERS,
    PRECISIONS,
    SEED_002_GB,
    STRATEGIES,
    MemoryBreakdown,
    ModelSizes,
    breakdown,
    explain_seed_fsdp,
    format_table,
    optimizer_from_name,
    precision_from_name,
    seed_fsdp_fits,
    seed_fsdp_gb,
    strategy_table,
)
from fsdp_planner.models import load_model
from fsdp_planner.trace import ModuleInfo, ParamInfo, Trace, trace

SGDM = OPTIMIZERS["sgd-momentum"]


@pytest.fixture(scope="module")
def seed_trace() -> Trace:
    lm = load_model("seed-linear10")
    return trace(lm.model, lm.example_inputs, lm.loss_fn)


def _close(got_bytes: int | float, want_gb: float, rel: float) -> bool:
    return abs(got_bytes / GB - want_gb) <= rel * want_gb


# -- seed 002 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "autocast", "autocast-nocache"])
def test_seed_single_device(seed_trace: Trace, precision: str) -> None:
    b = strategy_table(seed_trace, 1, SGDM, precision_from_name(precision))["single"]
    assert _close(b.total, SEED_002_GB[precision], 0.02), b.total / GB
    assert b.params == b.grads == b.optimizer_state == 4_000_400_000  # 1.0001e9 fp32 elements each


def test_seed_components(seed_trace: Trace) -> None:
    cached = strategy_table(seed_trace, 1, SGDM, PRECISIONS["autocast"])["single"]
    nocache = strategy_table(seed_trace, 1, SGDM, PRECISIONS["autocast-nocache"])["single"]
    assert cached.unsharded_params == 10 * 100_010_000 * 2  # fp16 cache of every weight and bias: 2.0 GB
    assert nocache.unsharded_params == 10_000 * 10_000 * 2  # one Linear weight's fp16 copy: the 0.2 GB gap
    assert seed_trace.numel == 1_000_100_000
    assert 0 < strategy_table(seed_trace, 1, SGDM, PRECISIONS["fp32"])["single"].activations < 1e6


@pytest.mark.parametrize("precision", ["fp32", "autocast-nocache"])  # the seed's DDP run used the latter
def test_seed_ddp(seed_trace: Trace, precision: str) -> None:
    rows = strategy_table(seed_trace, 8, SGDM, precision_from_name(precision))
    assert _close(rows["ddp"].total, SEED_002_GB["ddp"], 0.02), rows["ddp"].total / GB
    assert rows["ddp"].buffers == rows["ddp"].grads  # gradient buckets: one more copy of the grads
    assert rows["ddp"].total - rows["single"].total == rows["ddp"].grads


def test_seed_fsdp_explained(seed_trace: Trace) -> None:
    target = SEED_002_GB["fsdp"]
    # A) FSDP1's default BACKWARD_PRE peak (two gathered Linears + one unsharded grad): W = 37.
    assert _close(seed_fsdp_gb(37, 2) * GB, target, 0.02)
    assert seed_fsdp_fits(2) == list(range(34, 41))
    # ... and the trace-driven table, with this module's default working set, agrees.
    rows = strategy_table(seed_trace, 37, SGDM, PRECISIONS["fp32"])
    assert rows["fsdp"] == rows["zero3"]
    assert _close(rows["fsdp"].total, target, 0.02)
    assert rows["fsdp"].unsharded_params == 2 * 100_010_000 * 4
    # B) one gathered Linear at the peak: W = 16 (two 8-GPU nodes) or 17.
    assert seed_fsdp_fits(1) == [16, 17]
    assert _close(strategy_table(seed_trace, 16, SGDM, PRECISIONS["fp32"],
                                 unsharded_peak_bytes=400_040_000)["fsdp"].total, target, 0.02)
    # C) W = 8 only matches if nothing unsharded is counted, which FULL_SHARD cannot do.
    assert _close(3 * 4_000_400_000 / 8, target, 0.02)
    assert seed_fsdp_gb(8, 0) > 1.2 * target
    text = explain_seed_fsdp()
    for needle in ("W=37", "W=16", "W=8", "BACKWARD_PRE", "12.0012"):
        assert needle in text


# -- ordering ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4, 8, 64])
@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_zero_stages_decrease(seed_trace: Trace, world_size: int, optimizer: str, precision: str) -> None:
    opt, prec = optimizer_from_name(optimizer), precision_from_name(precision)
    rows = strategy_table(seed_trace, world_size, opt, prec)
    totals = [rows[s].total for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals
    assert rows["single"].total < rows["ddp"].total


def test_world_size_one_shards_nothing(seed_trace: Trace) -> None:
    rows = strategy_table(seed_trace, 1, SGDM, PRECISIONS["fp32"])
    assert rows["zero1"].total == rows["zero2"].total == rows["single"].total


# -- facts.md anchor: 7.5B params, mixed-precision Adam, 64 ranks ----------------------------------------


def _synthetic_trace(total: int, layers: int) -> Trace:
    per = total // layers
    params = [ParamInfo(f"l{i}.w", per, "bfloat16", 2, True, (f"l{i}",), shape=(per,)) for i in range(layers)]
    modules = {"": ModuleInfo("", "Model", ())}
    modules.update({f"l{i}": ModuleInfo(f"l{i}", "Linear", (f"l{i}.w",)) for i in range(layers)})
    return Trace(params=params, modules=modules, events=[], fingerprint="synthetic")


def test_zero_paper_anchor_pure() -> None:
    sizes = ModelSizes(param_numel=7_500_000_000, grad_numel=7_500_000_000)
    adam, zero_mixed = OPTIMIZERS["adam"], PRECISIONS["pure-bf16"]  # 2 + 2 + (4 master + 4 m + 4 v)
    assert adam.state_bytes_per_element(2) == 12 and adam.state_bytes_per_element(4) == 8
    assert _close(breakdown("single", sizes, 1, adam, zero_mixed).total, 120.0, 0.001)
    want = {"zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    for stage, gb in want.items():
        got = breakdown(stage, sizes, 64, adam, zero_mixed, unsharded_peak_bytes=0).total
        assert _close(got, gb, 0.03), (stage, got / GB)


def test_zero_paper_anchor_trace() -> None:
    t = _synthetic_trace(7_500_000_000, 750)  # 750 units of 10M params
    rows = strategy_table(t, 64, OPTIMIZERS["adamw"], PRECISIONS["pure-bf16"], unsharded_peak_bytes=0)
    for stage, gb in {"zero1": 31.4, "zero2": 16.6, "zero3": 1.9}.items():
        assert _close(rows[stage].total, gb, 0.03), (stage, rows[stage].total / GB)
    # default working set: two gathered 10M-param units in bf16 + one unit's grad: still ~1.9 GB
    zero3 = strategy_table(t, 64, OPTIMIZERS["adam"], PRECISIONS["pure-bf16"])["zero3"]
    assert _close(zero3.total, 1.9, 0.03)


# -- presets, errors, table -------------------------------------------------------------------------------


def test_presets() -> None:
    assert PRECISIONS["bf16-mixed"].gather_bytes == 2 and PRECISIONS["bf16-mixed"].param_bytes == 4
    assert PRECISIONS["autocast"].gather_bytes == 4  # autocast does not change what FSDP gathers
    assert PRECISIONS["autocast"].weight_cache and not PRECISIONS["autocast-nocache"].weight_cache
    assert OPTIMIZERS["sgd"].state_bytes_per_element(4) == 0
    assert OPTIMIZERS["sgd-momentum"].state_bytes_per_element(2) == 2


@pytest.mark.parametrize("call", [lambda: precision_from_name("fp8"), lambda: optimizer_from_name("lion"),
                                  lambda: breakdown("zero4", ModelSizes(1, 1), 2, SGDM, PRECISIONS["fp32"]),
                                  lambda: breakdown("ddp", ModelSizes(1, 1), 0, SGDM, PRECISIONS["fp32"])])
def test_errors(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PlannerError):
        call()


def test_format_table(seed_trace: Trace) -> None:
    rows = strategy_table(seed_trace, 8, SGDM, PRECISIONS["fp32"])
    assert set(rows) == set(STRATEGIES)
    console = Console(width=140, record=True)
    console.print(format_table(rows, title="seed-linear10"))
    out = console.export_text()
    for needle in ("strategy", "unsharded/buffers", "zero3 / fsdp", "12.002", "16.002", "0.800 / 0.400"):
        assert needle in out
    d = rows["ddp"].to_dict()
    assert d["total"] == rows["ddp"].total and set(d) == {*MemoryBreakdown().to_dict()}
