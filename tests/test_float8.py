"""Float8 training: the plan's policy and its JSON, what it changes in a simulated step, and real FSDP2 with
torchao's float8 all-gather on fake ranks as the oracle of its counts and bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from fsdp_planner.choices import Float8Recipe
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.float8 import Float8, float8_from_dict
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
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
    kw = {"plain": True, "tied": False}
    assert not TENSORWISE.converts("layers.0.w", (64, 40), **kw) and TENSORWISE.converts("layers.0.w", (64, 48), **kw)


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
@pytest.mark.parametrize("recipe, gathered", [(Float8Recipe.TENSORWISE, True), (Float8Recipe.TENSORWISE, False),
                                              (Float8Recipe.ROWWISE, False)])
def test_float8_amax_all_reduces_under_tp_are_counted_exactly(recipe: Float8Recipe, gathered: bool, capfd) -> None:
    """Under TP the casts of TP-sharded tensors (a rowwise Linear's input, a colwise one's output grad, a weight
    not gathered in float8) all-reduce their amax over the TP group, again in a recomputation up to the Linear
    whose pack stops it; precomputed scales all-reduce once per sharded mesh dim (FSDP's and TP's). Rowwise
    scales all-reduce a vector of amaxes where the scaled axis is the sharded one (a new user's trial: 124
    all-reduces of 3.5 KiB predicted on toy-llama TP 2, 68 of 44.6 KiB measured)."""
    from fsdp_planner.fsdp2.checkpointing import ACMode, checkpointed_blocks
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    tr, plan, options = _toy()
    f8 = Float8(recipe, gathered, gathered)
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
    # the precomputed scales' amax reduced one mesh dim at a time: DTensor's warning of it held and counted, not shown,
    # and counted again by a second world in this process (DTensor warns once a process of meshes that compare equal)
    assert (measured.sequential_reductions > 0) == gathered
    if gathered and recipe is Float8Recipe.TENSORWISE:
        again = run_fake_world("toy-llama", plan, 8, options.precision)
        assert again.sequential_reductions == measured.sequential_reductions
    assert "sequential all_reduce" not in capfd.readouterr().err
    if recipe is Float8Recipe.ROWWISE:  # 2 a Linear (a rowwise one's in forward: again in its recomputation)
        assert predicted.tp_all_reduces - others == 4 * (7 * 2 + 2 * 2)
        return
    # 7 converted Linears in each of 4 blocks, 2 amax all-reduces each a step, and each block's 2 rowwise inputs
    # again in its recomputation; without the float8 all-gather each weight's too, 3 times
    assert predicted.tp_all_reduces - others == 4 * (7 * 2 + 2) + (not gathered) * 4 * 7 * 3
    assert predicted.float8_all_reduces == (2 if gathered else 0)


@pytest.mark.integration  # real FSDP2 + DTensor TP and torchao (emulated float8) on 8 fake ranks
def test_float8_amaxes_of_linears_with_biases_and_a_first_linear_are_exact() -> None:
    """A Linear with a bias runs its weight-grad matmul after its input-grad one (addmm's backward): each was
    charged to the next Linear's, and the last's lost; a first Linear, whose input needs no grad, runs no input-grad
    matmul in the trace, but torchao's autograd function casts the output grad for one all the same (a new user's
    ViT with TP 2: 10 TP all-reduces predicted, 12 measured)."""
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world
    from fsdp_planner.service.tracing import trace_spec

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:pairs_mlp"
    options = dataclasses.replace(SimOptions(), float8=TENSORWISE)
    tr = trace_spec(spec, options.precision)
    layout = TensorParallel(2, {"*.up": TPStyle.COLWISE, "*.down": TPStyle.ROWWISE})
    plan = make_plan(tr, [["0"], ["1"]]).replace(tensor_parallel=layout, float8=TENSORWISE)
    predicted = simulate(tr, plan, parse_cluster("h100:8"), options, timeline=False)
    rows = beside_prediction(predicted, run_fake_world(spec, plan, 8, options.precision))
    assert all(p == m for k, (p, m) in rows.items() if k != "peak_memory"), rows
    assert predicted.tp_all_reduces == 11  # 2 x 4 amaxes a block, 2 rowwise outputs, 1 input grad


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


_TINY_HF_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 4096,
                  "max_position_embeddings": 128}


def _tiny_hf(tmp_path):
    from fsdp_planner.models import ModelSpec

    config = tmp_path / "llama.json"
    config.write_text(json.dumps(_TINY_HF_LLAMA))
    spec = ModelSpec(f"hf:{config}", batch_size=4, seq_len=32)
    lm = load_model(spec)
    options = SimOptions.named("bf16-mixed")
    return spec, record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype), options


@pytest.mark.integration  # real FSDP2 and torchao (emulated float8) on 8 fake ranks, a transformers model: ~5 s
def test_a_converted_output_head_in_a_group_of_two_modules_is_exact_on_fake_ranks(tmp_path) -> None:
    """transformers' head is ``lm_head``: the default filter keeps it in bf16 as torchtitan's keeps ``output``.
    Converted (``filter_fqns`` empty), in the group ``model.norm, lm_head``: apply_plan gave fully_shard the
    Linear float8's conversion had replaced (one all-gather and reduce-scatter more than planned, the new head
    left to the root); and the head's backward casts run before its weight grad exists (+6.4% peak before)."""
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    spec, tr, options = _tiny_hf(tmp_path)
    assert "lm_head" not in converted_linears(tr, TENSORWISE) and "lm_head" in converted_linears(tr, Float8(
        filter_fqns=()))
    plan = TorchtitanPolicy("LlamaDecoderLayer").plan(tr)
    assert ["model.norm", "lm_head"] in [list(g.modules) for g in plan.groups]
    for f8 in (TENSORWISE, Float8(filter_fqns=())):
        on = dataclasses.replace(options, float8=f8)
        predicted = simulate(tr, plan.replace(float8=f8), parse_cluster("h100:8"), on, timeline=False)
        rows = beside_prediction(predicted, run_fake_world(spec, plan.replace(float8=f8), 8, options.precision))
        assert all(p == m for k, (p, m) in rows.items() if k != "peak_memory"), rows
        assert rows["peak_memory"][0] == pytest.approx(rows["peak_memory"][1], rel=0.01), f8


def test_precomputed_scales_under_tp_refuse_a_converted_linear_tp_leaves_whole(tmp_path) -> None:
    """torchao's precompute stacks every converted weight's amax: a converted head off TP (a layout that leaves
    ``lm_head`` whole, transformers' without its head) is on another mesh, and the real step raised inside
    DTensor."""
    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
    from fsdp_planner.planners.tensor_parallel import tp_layout
    from fsdp_planner.sim.float8 import check_float8_scales

    spec, tr, _ = _tiny_hf(tmp_path)
    tp = TensorParallel(2, {k: s for k, s in tp_layout(tr, 2, spec).tp.layout.items() if k != "lm_head"})
    check_float8_scales(tr, tp, TENSORWISE)  # the default filter: the head stays bf16
    check_float8_scales(tr, tp, Float8(Float8Recipe.TENSORWISE, True, False, ()))  # scales at each all-gather
    with pytest.raises(PlannerError, match=r"TP leaves lm_head whole .* float8.filter_fqns"):
        check_float8_scales(tr, tp, Float8(filter_fqns=()))


@pytest.mark.integration  # three small simulations of a transformers model: ~6 s
def test_a_plan_file_s_converted_head_under_tp_is_refused_as_the_step_runs_it(tmp_path, capsys) -> None:
    """The refusal judges the float8 the step runs: a plan file's, unless the command line gives its own (the
    advice, --float8 tensorwise --no-float8-all-gather, was refused by the plan's own float8); the headline names
    a plan file's float8."""
    from fsdp_planner.cli import main

    config, plan = tmp_path / "llama.json", tmp_path / "p.json"
    config.write_text(json.dumps(_TINY_HF_LLAMA))
    job = [f"hf:{config}", "--seq", "32", "--batch", "4", "--cluster", "h100:8"]
    assert main(["plan", *job, "--policy", "titan", "--tp", "2", "--float8", "tensorwise", "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["float8"]["filter_fqns"] = []
    del data["tensor_parallel"]["layout"]["lm_head"]  # (transformers' plan gathers its logits: left whole here)
    plan.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["simulate", *job, "--plan", str(plan)]) == 2
    assert "TP leaves lm_head whole" in capsys.readouterr().err
    assert main(["simulate", *job, "--plan", str(plan), "--float8", "tensorwise", "--no-float8-all-gather"]) == 0
    data["float8"]["filter_fqns"] = ["output", "lm_head"]
    plan.write_text(json.dumps(data))
    assert main(["simulate", *job, "--plan", str(plan)]) == 0
    assert "TP 2), float8 tensorwise, float8 all-gather (precomputed scales) on h100:8" in capsys.readouterr().out


def test_float8_skip_keeps_a_head_of_another_name_in_bf16(tmp_path, capsys) -> None:
    """A head named otherwise (``lm_out``) was converted with no way to keep it in bf16 from the command line, and
    under TP the refusal's advice (its filter_fqns) could not be followed (a new user's finding)."""
    from fsdp_planner.cli import main

    model = tmp_path / "net.py"
    model.write_text("import torch\nfrom torch import nn\n\n"
                     "class Net(nn.Module):\n"
                     "    def __init__(self):\n        super().__init__()\n"
                     "        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))\n"
                     "        self.lm_out = nn.Linear(32, 64)\n\n"
                     "    def forward(self, x):\n        for lin in self.layers:\n            x = x + lin(x)\n"
                     "        return self.lm_out(x)\n\n"
                     "def build(batch_size: int = 16):\n"
                     "    return Net(), (torch.randn(batch_size, 32),), lambda out: out.float().pow(2).mean()\n")
    runs = {}
    for extra in ((), ("--float8-skip", "lm_out,lm_out")):
        path = tmp_path / f"p{len(extra)}.json"
        assert main(["plan", f"{model}:build", "--policy", "titan", "--float8", "tensorwise", "--cluster", "h100:8",
                     "--out", str(path), *extra]) == 0
        runs[extra] = json.loads(path.read_text())["float8"]["filter_fqns"]
        # the head converted is said, with the flag that keeps it in bf16 (it went to float8 without a word)
        said = "float8 converts the output head lm_out (the Linear the loss reads) as well" in capsys.readouterr().err
        assert said == (not extra)
    assert runs[()] == ["output", "lm_head"] and runs[("--float8-skip", "lm_out,lm_out")] == ["output", "lm_head",
                                                                                             "lm_out"]
    # a head whose name is part of other Linears' names: the flag, matching parts of names, keeps those too
    model.write_text(model.read_text().replace("lm_out", "out").replace("nn.Linear(32, 32) for", "Block() for")
                     .replace("class Net", "class Block(nn.Module):\n    def __init__(self):\n        super()"
                              ".__init__()\n        self.out_proj = nn.Linear(32, 32)\n\n    def forward(self, x):"
                              "\n        return self.out_proj(x)\n\n\nclass Net"))
    assert main(["plan", f"{model}:build", "--policy", "titan", "--float8", "tensorwise", "--cluster", "h100:8"]) == 0
    assert "--float8-skip out keeps it so, and every Linear whose name holds it (layers.0.out_proj, " \
        "layers.1.out_proj)" in " ".join(capsys.readouterr().err.split())
    assert main(["plan", f"{model}:build", "--float8-skip", "lm_out", "--cluster", "h100:8"]) == 2
    assert "--float8-skip names Linears float8 training leaves in bf16: give --float8" in capsys.readouterr().err


def test_float8_tp_all_gathers_on_a_layout_without_sequence_parallelism_are_said_to_move_only_casts(
        tmp_path, capsys) -> None:
    """transformers' TP plans have no sequence parallelism: nothing is all-gathered in float8 for the flag to
    halve (the head's gathered logits stay bf16, as torch's ColwiseParallel gathers them)."""
    from fsdp_planner.cli import main

    config = tmp_path / "llama.json"
    config.write_text(json.dumps(_TINY_HF_LLAMA))
    runs, errs = [], []
    for flag in ("--float8-tp-all-gather", "--no-float8-tp-all-gather"):
        assert main(["simulate", f"hf:{config}", "--seq", "32", "--batch", "4", "--policy", "titan", "--tp", "2",
                     "--float8", "tensorwise", flag, "--cluster", "h100:8", "--json"]) == 0
        out, err = capsys.readouterr()
        runs.append({k: v for k, v in json.loads(out).items() if k.startswith("tp_all_gather")})  # (the amax
        # all-reduces differ: torchao's styles cast in their hooks)
        errs.append(err)
    assert runs[0] == runs[1] and runs[0]["tp_all_gathers"] == 1, runs
    assert "this --tp 2 layout has none (its all-reduces, and the gathers of transformers' gathered styles, stay" \
        in errs[0]


def test_a_filter_name_in_no_linear_s_name_is_said(tmp_path, capsys) -> None:
    from fsdp_planner.cli import main

    _, plan, _ = _toy()
    path = tmp_path / "p.json"
    path.write_text(plan.replace(float8=Float8(filter_fqns=("outptu", "w2"))).to_json())
    assert main(["simulate", "toy-llama", "--plan", str(path), "--cluster", "h100:8", "--json"]) == 0
    assert 'filter_fqns ["outptu"] is in no Linear\'s name: filtering nothing' in capsys.readouterr().err
    path.write_text(plan.replace(float8=TENSORWISE).to_json())  # the default: one of its two names is always idle
    assert main(["simulate", "toy-llama", "--plan", str(path), "--cluster", "h100:8", "--json"]) == 0
    assert "filter_fqns" not in capsys.readouterr().err


# torchao's float8 TP styles (``Float8.tp_float8_all_gather``): a non-sequence-parallel layout of the same Linears
_PLAIN_TP = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
             "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
             "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
             "layers.*.feed_forward.w2": "rowwise"}


def _tp_float8_run(layout, batch: int, full_ac: bool, styles: bool):
    from fsdp_planner.fsdp2.checkpointing import ACMode, checkpointed_blocks
    from fsdp_planner.fsdp2.tensor_parallel import tensor_parallel_from_dict
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    spec = ModelSpec("toy-llama", batch_size=batch)
    options = SimOptions.named("bf16-mixed")
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype)
    tp = titan_llama_layout(2) if layout is None else tensor_parallel_from_dict({"degree": 2, "layout": layout})
    plan = TorchtitanPolicy("TransformerBlock").plan(tr).replace(tensor_parallel=tp)
    if full_ac:
        plan = plan.replace(activation_checkpointing=tuple(checkpointed_blocks(tr, ACMode.FULL)))
    f8 = Float8.named("tensorwise", tp_all_gather=styles)
    plan = plan.replace(float8=f8)
    predicted = simulate(tr, plan, parse_cluster("h100:8"), dataclasses.replace(options, float8=f8), timeline=False)
    return predicted, beside_prediction(predicted, run_fake_world(spec, plan, 8, options.precision))


@pytest.mark.integration  # real FSDP2 + DTensor with torchao's float8 TP styles on 8 fake ranks: ~4 s each
@pytest.mark.parametrize("batch, full_ac", [(16, False), (16, True), (4, False)])
def test_float8_tp_styles_gather_in_float8_exactly_on_fake_ranks(batch: int, full_ac: bool) -> None:
    """Under torchtitan's sequence-parallel layout, torchao's float8 styles cast each region's input on its sequence
    shard before the all-gather and a rowwise output's grad before its backward all-gather: every collective count
    and byte as real FSDP2 + DTensor run them, the peak within 3% (the rowwise Linears save their inputs' float8
    copies, the regions their gathered float8 input: +9.7% before those were counted)."""
    bf16, _ = _tp_float8_run(None, batch, full_ac, False)
    predicted, rows = _tp_float8_run(None, batch, full_ac, True)
    assert all(p == m for k, (p, m) in rows.items() if k != "peak_memory"), rows
    assert predicted.peak_memory == pytest.approx(rows["peak_memory"][1], rel=0.03)
    # each block's 2 forward gathers (again when recomputed) and 2 backward ones move half the bytes; the output
    # head's input gather and the embedding's output-grad gather stay bf16 (toy-llama's are all batch x seq x dim)
    per = bf16.tp_all_gather_bytes // bf16.tp_all_gathers
    assert bf16.tp_all_gathers == 4 * (4 + 2 * full_ac) + 2 == predicted.tp_all_gathers
    assert predicted.tp_all_gather_bytes == (bf16.tp_all_gathers - 2) * per // 2 + 2 * per
    # amaxes a block: the styles' 2 region casts and 2 rowwise inputs (again when recomputed) + 7 output grads,
    # against torch's styles' 2 rowwise inputs (again when recomputed) + 5 x 2 colwise output grads + 2 input recasts
    assert bf16.tp_all_reduces - predicted.tp_all_reduces == 4 * (3 - 2 * full_ac)


@pytest.mark.integration  # 8 fake ranks: ~4 s
def test_float8_tp_styles_without_sequence_parallel_are_exact_on_fake_ranks() -> None:
    """Colwise Linears on a replicated input cast it in their own style (no amax all-reduce); a rowwise one's
    output is all-reduced in bf16 and its grad cast whole: the same all-gathers (none), fewer amax all-reduces."""
    bf16, _ = _tp_float8_run(_PLAIN_TP, 16, False, False)
    predicted, rows = _tp_float8_run(_PLAIN_TP, 16, False, True)
    assert all(p == m for k, (p, m) in rows.items() if k != "peak_memory"), rows
    assert predicted.peak_memory == pytest.approx(rows["peak_memory"][1], rel=0.05)
    assert predicted.tp_all_gathers == bf16.tp_all_gathers == 0 and predicted.tp_all_reduces < bf16.tp_all_reduces


def test_float8_tp_styles_take_the_converted_linears_and_their_regions() -> None:
    """torchao's styles go to the float8 Linears and to a region whose colwise Linears are all float8; a Linear the
    filter leaves in bf16 keeps torch's style, and so does its region (its input gathered in bf16)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from fsdp_planner.apply.float8 import apply_float8
    from fsdp_planner.apply.tensor_parallel import torch_plan
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout

    model: nn.Module = load_model("toy-llama").model
    apply_float8(model, Float8(filter_fqns=("output", "layers.0.attention.wk")))
    styles = torch_plan(model, titan_llama_layout(2), float8=True)
    assert type(styles["layers.1.attention"]) is PrepareFloat8ModuleInput
    assert type(styles["layers.1.attention.wq"]) is Float8ColwiseParallel
    assert type(styles["layers.1.feed_forward.w2"]) is Float8RowwiseParallel
    assert type(styles["layers.0.attention"]) is PrepareModuleInput  # wk left in bf16: gathered in bf16
    assert type(styles["layers.0.attention.wk"]) is ColwiseParallel
    assert type(styles["layers.0.attention.wq"]) is Float8ColwiseParallel  # (casts its replicated input itself)
    assert type(styles["output"]) is ColwiseParallel
    plain = torch_plan(model, titan_llama_layout(2))
    assert type(plain["layers.1.attention.wq"]) is ColwiseParallel


def test_float8_tp_all_gather_is_validated_and_round_trips() -> None:
    """The setting needs tensorwise float8, TP and a 16-bit compute dtype, each said in one line; a plan file
    keeps it, and a plan without TP is refused where it is read."""
    def options(**kw):
        return sim_options(Keywords(**kw), Spelling.CLI)

    assert options(float8="tensorwise", float8_tp_all_gather=True, tp=2).float8.tp_float8_all_gather
    for kw, said in ((dict(float8_tp_all_gather=True, tp=2), "--float8-tp-all-gather is a setting of float8"),
                     (dict(float8="rowwise", float8_tp_all_gather=True, tp=2),
                      "needs --float8 tensorwise"),
                     (dict(float8="tensorwise", float8_tp_all_gather=True), "give --tp 2 or more"),
                     (dict(float8="tensorwise", float8_tp_all_gather=True, tp=2, precision="fp32"),
                      "16-bit compute dtype")):
        with pytest.raises(PlannerError, match=said):
            options(**kw)
    with pytest.raises(PlannerError, match="tensorwise"):
        Float8(Float8Recipe.ROWWISE, False, False, tp_float8_all_gather=True)
    f8 = Float8.named("tensorwise", tp_all_gather=True)
    _, plan, _ = _toy()
    assert Plan.from_json(plan.replace(float8=f8).to_json()).float8 == f8
    assert "tp_float8_all_gather" not in json.dumps(TENSORWISE.to_dict())  # (plans without it read as before)
    with pytest.raises(PlannerError, match="tp_float8_all_gather' must be true or false"):
        float8_from_dict({"recipe": "tensorwise", "tp_float8_all_gather": "yes"})


@pytest.mark.integration  # the fake process group: a few seconds
def test_exported_float8_tp_gathers_in_float8_as_apply_plan_does(tmp_path, capsys) -> None:
    """The exported apply() of a plan with float8 TP all-gathers takes torchao's styles where apply_plan does: a
    step on 4 fake ranks (FSDP 2 x TP 2) moves the same TP all-gather bytes either way, half of them in float8.
    torchtitan's job, whose TP has gathered bf16 since April 2026, says so in a note."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_planner.apply.export import ExportFormat, export_plan
    from fsdp_planner.apply.fully_shard import apply_plan
    from fsdp_planner.cli import main
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout
    from fsdp_planner.runtime.fake_world import FunctionalCounter, fake_process_group

    _, plan, _ = _toy()
    plan = plan.replace(tensor_parallel=titan_llama_layout(2), float8=Float8.named("tensorwise", tp_all_gather=True),
                        precision="bf16-mixed")
    bf16_mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # the export's
    scope: dict = {"__name__": "exported"}
    exec(compile(export_plan(plan, ExportFormat.PYTHON), "exported.py", "exec"), scope)
    gathered = []
    with fake_process_group(4):
        for shard in (lambda m: scope["apply"](m, scope["make_mesh"]("cpu")),
                      lambda m: apply_plan(m, plan, mp_policy=bf16_mixed)):
            lm = load_model("toy-llama", meta=False)
            model = shard(lm.model)
            counter = FunctionalCounter()
            with counter.counting(), scope["loss_context"]():
                lm.loss_fn(model(*lm.example_inputs)).backward()
            gathered.append(counter.take()[1]["all_gather"])
    bf16 = plan.replace(float8=Float8.named("tensorwise"))
    with fake_process_group(4):
        lm = load_model("toy-llama", meta=False)
        model, counter = apply_plan(lm.model, bf16, mp_policy=bf16_mixed), FunctionalCounter()
        with counter.counting(), scope["loss_context"]():
            lm.loss_fn(model(*lm.example_inputs)).backward()
        whole = counter.take()[1]["all_gather"]
    assert gathered[0] == gathered[1] < whole, (gathered, whole)
    path = tmp_path / "p.json"
    path.write_text(plan.replace(model="toy-llama").to_json())
    assert main(["export", str(path), "--format", "torchtitan"]) == 0
    assert "fsdp_planner_job()'s torchtitan config cannot say it" in capsys.readouterr().err


@pytest.mark.integration  # torch.compile's AOT graphs of one toy-llama block on this CPU: ~7 s
def test_a_compiled_block_casts_each_shared_input_once_as_aot_cse_does() -> None:
    """torch.compile's joint graph eliminates common subexpressions before partitioning: wq, wk and wv cast their
    one input once, w1 and w3 theirs, and backward recasts each input once. The model's casts of a compiled
    block's activations meet the AOT graphs' amax reductions of activations (``abs``): 4 in forward, and in
    backward 7 output grads and 4 input recasts; the partitioner moves one backward cast into forward (5 and 10),
    the step's total the model's. Eager torchao casts each Linear's input itself (7 in forward). Checkpointed in
    full, the compiled backward recomputes the forward's casts beside its recasts, unmerged: 4 + 14, the model's
    4 + (4 + 11) less one."""
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp_planner.apply.float8 import float8_module, torchao_config
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec

    block = load_model("toy-llama", meta=False).model.layers[0].to(torch.bfloat16)
    float8_module().convert_to_float8_training(block, config=torchao_config(TENSORWISE, emulate=True))
    rows: dict[str, int] = {}

    def counted(name: str):  # the graph's amaxes of activations: (4, 32, dim) or (128, dim); no weight's dim 0
        def compiler(gm, inputs):
            rows[name] = sum(n.op == "call_function" and "abs" in str(n.target)
                             and n.args[0].meta["val"].shape[0] in (4, 128) for n in gm.graph.nodes)
            return gm.forward
        return compiler

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=counted("forward"), bw_compiler=counted("backward"),
                                     partition_fn=min_cut_rematerialization_partition)

    x = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(block, backend=backend)(x).float().sum().backward()
    plain = dict(rows)
    torch.compile(checkpoint_wrapper(block), backend=backend)(x).float().sum().backward()
    checkpointed = dict(rows)
    options = SimOptions.named("bf16-mixed")
    modelled = {}
    for compile in (True, False):
        tr = trace_spec(ModelSpec("toy-llama", compile=compile), options.precision)
        step = float8_step(tr, TENSORWISE, options.precision.compute_bytes)
        launches = cast_bytes(options.precision.compute_bytes, compile)[1]
        block0 = np.array([tr.events[i].module.startswith("layers.0.") for i in step.matmuls])
        backward = np.array([tr.events[i].backward for i in step.matmuls])
        modelled[compile] = [step.cast_kernels[block0 & (backward == b)].sum() / launches for b in (False, True)]
    assert modelled[False][0] == 7 and modelled[True][0] == 4 and modelled[True][1] == 7 + 4
    assert plain == {"forward": 5, "backward": 10}  # (the partitioner moved one backward cast into forward)
    assert sum(plain.values()) == sum(modelled[True])
    # checkpointed in full: the recomputation's casts are not merged with backward's recasts (4 + 14), the model's
    # forward again beside its backward (4 + 4 + 11) one more
    assert checkpointed == {"forward": 4, "backward": 14}
    assert sum(checkpointed.values()) == 2 * modelled[True][0] + modelled[True][1] - 1


def test_auto_plans_with_float8_tp_all_gathers_and_writes_them(tmp_path) -> None:
    """Auto searches on a TP view built with the options' float8 (its candidate plans carry none until written):
    the plan it writes runs torchao's float8 TP styles, and simulating that file alone reads them from it. Without
    --tp auto chooses the degree, and a plan without TP is written without the setting (a file refuses it)."""
    from fsdp_planner.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "toy-llama", "--policy", "auto", "--tp", "2", "--float8", "tensorwise",
                 "--float8-tp-all-gather", "--cluster", "h100:8", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["float8"]["tp_float8_all_gather"] is True
    printed = io.StringIO()  # --json's plan is the file --out writes (it had no float8)
    with contextlib.redirect_stdout(printed):
        assert main(["plan", "toy-llama", "--policy", "auto", "--tp", "2", "--float8", "tensorwise",
                     "--float8-tp-all-gather", "--cluster", "h100:8", "--json"]) == 0
    assert json.loads(printed.getvalue())["plans"][0]["plan"] == json.loads(out.read_text())
    assert main(["simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8"]) == 0
    # auto chooses the degree itself where --tp is not given; where it chooses none, the plan gathers nothing
    assert main(["plan", "toy-llama", "--policy", "auto", "--float8", "tensorwise", "--float8-tp-all-gather",
                 "--cluster", "h100:8", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert "tensor_parallel" not in written and "tp_float8_all_gather" not in written["float8"]


class Linear(nn.Linear):
    """A subclass under nn.Linear's own name (timm's ``timm.layers.Linear`` is one)."""


class _TiedAndAttention(nn.Module):
    """A tied output head under a name no filter holds, nn.MultiheadAttention, whose out_proj (a Linear subclass)
    the attention reads the weight of itself, a subclass named Linear, and a Linear registered twice: none may be
    swapped for a Float8Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(64, 32)
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.mlp = nn.Linear(32, 32)
        self.named_like = Linear(32, 32)
        self.twice = nn.ModuleList([nn.Linear(32, 32)] * 2)
        self.embed_out = nn.Linear(32, 64, bias=False)
        self.embed_out.weight = self.embed_in.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_in(ids)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.twice[1](self.twice[0](self.named_like(h)))
        return self.embed_out(h + self.mlp(h))


def test_a_tied_head_and_an_attention_s_out_proj_stay_unconverted_in_the_model_apply_and_export() -> None:
    """The simulator, apply_plan and the exported code convert the same Linears: not a tied head (torchao's swap
    gave it a weight of its own, one embedding more in every all-gather on 8 fake ranks), not MultiheadAttention's
    out_proj (its converted weight failed the attention's own addmm), not a subclass however named, and not a
    Linear registered under two names (swapped under one)."""
    from fsdp_planner.apply.export import ExportFormat, export_plan
    from fsdp_planner.apply.float8 import apply_float8

    model = _TiedAndAttention()
    ids = torch.randint(0, 64, (2, 16))
    tr = record(model, (ids,), lambda out: out.float().pow(2).mean())
    assert set(converted_linears(tr, TENSORWISE)) == {"mlp"}
    applied = _TiedAndAttention()
    assert apply_float8(applied, TENSORWISE) == ["mlp"]
    assert applied.embed_out.weight is applied.embed_in.weight
    scope: dict = {}
    plan = TorchtitanPolicy("MultiheadAttention").plan(tr).replace(float8=TENSORWISE)
    exec(compile(export_plan(plan, ExportFormat.PYTHON), "exported.py", "exec"), scope)
    exported = _TiedAndAttention()
    scope["convert_float8"](exported)
    assert [n for n, m in exported.named_modules() if type(m).__name__ == "Float8Linear"] == ["mlp"]
    assert exported.embed_out.weight is exported.embed_in.weight
    exported(ids).float().pow(2).mean().backward()  # the attention runs its out_proj's weight as it was


def test_a_float8_skip_name_in_no_linear_s_name_is_said(capsys) -> None:
    """--float8-skip (fp.plan's float8_skip) naming no Linear kept nothing in bf16 without a word (a trial's typo
    'layers.0.atention.wq'), where a plan file's filter was said so."""
    from fsdp_planner.cli import main
    from fsdp_planner.fsdp2.float8 import Float8

    # a default head's name is a typo only where no head name matches: "output" alone leaves lm_head in float8
    assert Float8(filter_fqns=("output",)).filtering_nothing(["model.layers.0.q", "lm_head"]) == ["output"]
    assert Float8(filter_fqns=("output", "lm_head", "w2")).filtering_nothing(["layers.0.w2", "output"]) == []
    assert Float8().filtering_nothing(["conv"]) == []  # (the default: a model may have no head)
    for skip, said in (("layers.0.atention.wq", True), ("layers.0.attention.wq", False)):
        assert main(["plan", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--float8", "tensorwise",
                     "--float8-skip", skip]) == 0
        err = capsys.readouterr().err
        assert (f"--float8-skip {skip}: in no Linear's name, so it keeps nothing in bf16" in err) is said


def test_the_table_s_caption_says_which_bytes_are_float8(capsys) -> None:
    """Under float8's all-gather the AG bytes hold the float8 weights at 1 byte and the unsharded column (which
    knows no float8) at 2: the caption said both were bf16 (a trial)."""
    from fsdp_planner.cli import main

    for extra, gathered in (((), True), (("--no-float8-all-gather",), False)):
        assert main(["plan", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--float8", "tensorwise",
                     *extra]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert ("AG bytes in bf16 but the float8 Linears' weights, gathered in float8" in out) is gathered
        assert ("AG bytes and unsharded in bf16 (the simulated precision" in out) is not gathered
