"""Float8 training: the plan's policy and its JSON, what it changes in a simulated step, and real FSDP2 with
torchao's float8 all-gather on fake ranks as the oracle of its counts and bytes."""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np
import pytest

from fsdp_planner.choices import Float8Recipe
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.service.validate import Keywords, Spelling, sim_options
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.float8 import cast_bytes, cast_peak, converted_linears, float8_step
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind

TENSORWISE = Float8.named("tensorwise")


@functools.cache
def _toy():
    options = SimOptions.named("bf16-mixed")
    lm = load_model("toy-llama")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype)
    return tr, TorchtitanPolicy("TransformerBlock").plan(tr), options


def test_plan_json_round_trips_float8_and_refuses_what_torchao_cannot_run() -> None:
    _, plan, _ = _toy()
    written = plan.replace(float8=TENSORWISE)
    assert Plan.from_json(written.to_json()) == written
    assert "float8" not in plan.to_dict()  # a plan without float8 reads and writes as before
    assert Float8.named("rowwise") == Float8(Float8Recipe.ROWWISE, False, False)
    with pytest.raises(PlannerError, match="tensorwise scaling only"):
        Float8(Float8Recipe.ROWWISE, fsdp_float8_all_gather=True, precompute_scale=False)
    data = written.to_dict()
    data["float8"]["recipe"] = "mxfp8"
    with pytest.raises(PlannerError, match=r"float8\.recipe"):
        Plan.from_json(json.dumps(data))


def test_the_validator_reads_float8_for_cli_and_api() -> None:
    assert sim_options(Keywords(float8="tensorwise"), Spelling.CLI).float8 == TENSORWISE
    off = sim_options(Keywords(float8="tensorwise", float8_all_gather=False), Spelling.API).float8
    assert off == Float8(Float8Recipe.TENSORWISE, False, False)
    with pytest.raises(PlannerError, match="--no-float8-all-gather is a setting"):
        sim_options(Keywords(float8_all_gather=False), Spelling.CLI)
    with pytest.raises(PlannerError, match="tensorwise scaling only"):
        sim_options(Keywords(float8="rowwise", float8_all_gather=True), Spelling.API)
    with pytest.raises(PlannerError, match="--no-float8-all-gather changes nothing with --float8 rowwise"):
        sim_options(Keywords(float8="rowwise", float8_all_gather=False), Spelling.CLI)  # was a silent no-op
    rowwise = sim_options(Keywords(float8="rowwise", float8_all_gather=False), Spelling.API).float8
    assert rowwise is not None and not rowwise.fsdp_float8_all_gather  # a file or the API may spell it out


def test_torchtitan_s_filter_leaves_the_output_head_and_odd_dims_in_bf16() -> None:
    tr, _, _ = _toy()
    linears = converted_linears(tr, TENSORWISE)
    all_linears = [n for n, m in tr.modules.items() if m.cls == "Linear"]
    assert set(all_linears) - set(linears) == {"output"}
    assert not TENSORWISE.converts("layers.0.w", (64, 40)) and TENSORWISE.converts("layers.0.w", (64, 48))


def test_converted_matmuls_run_at_the_float8_peak_after_their_casts() -> None:
    tr, _, options = _toy()
    step = float8_step(tr, TENSORWISE, options.precision.compute_bytes)
    converted = converted_linears(tr, TENSORWISE)
    matmuls = [i for i, e in enumerate(tr.events) if e.kind is EventKind.OP and e.kernel > 0
               and not e.module.startswith("output") and e.module != ""]  # every matmul but the head's
    assert sorted(step.matmuls.tolist()) == matmuls and len(matmuls) == 3 * len(converted)  # forward, 2 backward
    assert (step.cast_nbytes > 0).all() and step.gathered == frozenset(converted.values())
    assert cast_bytes(2, compiled=True) == (5, 2) and cast_bytes(2, compiled=False)[0] > 5  # inductor fuses them
    # at the float8 peak (1,979 vs 989 TFLOP/s dense on an H100, 0.88 of it reached: FLOAT8_PEAK_SHARE), FLOP-bound
    # matmuls take 0.57 of their bf16 time
    from fsdp_planner.sim.compute import op_times

    h100 = parse_cluster("h100:8")
    bf16 = np.array(op_times(tr, h100.gpu, options.precision, h100.compute))
    fp8 = np.array(op_times(tr, h100.gpu, options.precision, h100.compute, float8=step))
    others = np.setdiff1d(np.arange(len(tr.events)), step.matmuls)
    assert (fp8[others] == bf16[others]).all() and (fp8[step.matmuls] != bf16[step.matmuls]).all()


def test_float8_all_gather_halves_the_converted_weights_bytes_and_a100_is_refused() -> None:
    tr, plan, options = _toy()
    h100 = parse_cluster("h100:8")
    eager, fp8 = (SimContext(tr, h100, dataclasses.replace(options, float8=f8)) for f8 in (None, TENSORWISE))
    weights = list(converted_linears(tr, TENSORWISE).values())
    rest = [i for i in range(len(tr.params)) if i not in weights]
    assert fp8.sizing.gather_bytes(weights) * 2 == eager.sizing.gather_bytes(weights)  # 1 byte, not bf16's 2
    assert fp8.sizing.gather_bytes(rest) == eager.sizing.gather_bytes(rest)
    report = simulate(tr, plan, context=fp8, timeline=False)
    assert report.all_gathers == simulate(tr, plan, context=eager, timeline=False).all_gathers
    assert report.float8_all_reduces == 1 and report.float8_all_reduce_bytes == 4 * len(weights)  # fp32 amaxes
    with pytest.raises(PlannerError, match="no float8 tensor cores"):
        simulate(tr, plan.replace(float8=TENSORWISE), parse_cluster("a100:8"), options, timeline=False)


@pytest.mark.integration  # real FSDP2 and torchao (emulated float8) on fake ranks: the full suite runs it
def test_float8_all_gather_counts_and_bytes_are_exact_on_fake_ranks() -> None:
    from fsdp_planner.runtime.fake_world import run_fake_world

    tr, plan, options = _toy()
    for world, f8 in ((8, TENSORWISE), (64, Float8(Float8Recipe.TENSORWISE, True, False))):
        on = dataclasses.replace(options, float8=f8)
        predicted = simulate(tr, plan.replace(float8=f8), parse_cluster(f"h100:{world}"), on, timeline=False)
        measured = run_fake_world("toy-llama", plan.replace(float8=f8), world, options.precision)
        assert measured.counts == {"all_gather": predicted.all_gathers, "reduce_scatter": predicted.reduce_scatters,
                                   "all_reduce": 0}
        assert measured.nbytes["all_gather"] == predicted.all_gather_bytes
        assert measured.nbytes["reduce_scatter"] == predicted.reduce_scatter_bytes
        # the amax all-reduces: one a step precomputed (8 ranks), one per weight per all-gather without (64)
        assert (measured.float8_all_reduces, measured.float8_all_reduce_bytes) == \
            (predicted.float8_all_reduces, predicted.float8_all_reduce_bytes)
        assert predicted.peak_memory == pytest.approx(measured.peak_memory, rel=0.05)


@pytest.mark.integration  # real FSDP2 + DTensor TP and torchao (emulated float8) on 8 fake ranks: ~3 s each
@pytest.mark.parametrize("gathered", [True, False])
def test_float8_amax_all_reduces_under_tp_are_counted_exactly(gathered: bool) -> None:
    """Under TP the casts of TP-sharded tensors (a rowwise Linear's input, a colwise one's output grad, a weight
    not gathered in float8) all-reduce their amax over the TP group, again in a recomputation up to the Linear
    whose pack stops it; precomputed scales all-reduce once per sharded mesh dim (FSDP's and TP's)."""
    from fsdp_planner.fsdp2.checkpointing import ACMode, checkpointed_blocks
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    tr, plan, options = _toy()
    f8 = Float8(Float8Recipe.TENSORWISE, gathered, gathered)
    bf16 = plan.replace(tensor_parallel=titan_llama_layout(2),
                        activation_checkpointing=tuple(checkpointed_blocks(tr, ACMode.FULL)))
    plan = bf16.replace(float8=f8)
    on = dataclasses.replace(options, float8=f8)
    predicted = simulate(tr, plan, parse_cluster("h100:8"), on, timeline=False)
    others = simulate(tr, bf16, parse_cluster("h100:8"), options, timeline=False).tp_all_reduces
    measured = run_fake_world("toy-llama", plan, 8, options.precision)
    rows = beside_prediction(predicted, measured)
    assert all(p == m for k, (p, m) in rows.items() if k != "peak_memory"), rows
    assert predicted.peak_memory == pytest.approx(measured.peak_memory, rel=0.05)  # casts in backward: -13% without
    # 7 converted Linears in each of 4 blocks, 2 amax all-reduces each a step, and each block's 2 rowwise inputs
    # again in its recomputation; without the float8 all-gather each weight's too, 3 times
    assert predicted.tp_all_reduces - others == 4 * (7 * 2 + 2) + (not gathered) * 4 * 7 * 3
    assert predicted.float8_all_reduces == (2 if gathered else 0)


def test_a_converted_linear_s_backward_holds_its_casts_copies_beside_the_input_recast() -> None:
    """Eager torchao: a cast holds 9 bytes an element at its peak (fp32 scaled and clamped copies beside the float8
    result); the input recast for the weight grad runs beside both output-grad copies, so an up-projection's
    backward peaks at its second output-grad cast and a down-projection's at its input recast."""
    tr, _, options = _toy()
    step = float8_step(tr, TENSORWISE, options.precision.compute_bytes)
    rows, down, up = 128, (128, 160, 64), (128, 64, 160)
    assert cast_peak(down, False, True, False, 2, 9) == 2 * rows * 64 + 9 * rows * 160  # input recast
    assert cast_peak(up, False, True, False, 2, 9) == rows * 160 + 9 * rows * 160  # output grad's second cast
    assert cast_peak(up, True, False, False, 2, 9) == max(9 * rows * 64, rows * 64 + 9 * 64 * 160)  # weight too
    levels = step.levels(len(tr.events) + 1)
    assert (levels[step.matmuls] == step.cast_peaks).all() and levels.sum() == step.cast_peaks.sum()


@pytest.mark.integration  # real FSDP2 and torchao (emulated float8) on 8 fake ranks at batch 16: ~6 s
def test_float8_under_full_checkpointing_peaks_at_a_backward_cast_within_5_percent() -> None:
    """Under per-block full checkpointing the peak is in a block's backward, at the down-projection's input recast
    beside its output-grad copies (-22.6% before the casts were counted)."""
    from fsdp_planner.fsdp2.checkpointing import ACMode, checkpointed_blocks
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.runtime.fake_world import run_fake_world

    options = dataclasses.replace(SimOptions.named("bf16-mixed"), float8=TENSORWISE)
    spec = ModelSpec("toy-llama", batch_size=16)
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype)
    plan = TorchtitanPolicy("TransformerBlock").plan(tr)
    plan = plan.replace(activation_checkpointing=tuple(checkpointed_blocks(tr, ACMode.FULL)), float8=TENSORWISE)
    predicted = simulate(tr, plan, parse_cluster("h100:8"), options, timeline=False)
    measured = run_fake_world(spec, plan, 8, options.precision)
    assert predicted.peak_memory == pytest.approx(measured.peak_memory, rel=0.05)
