"""A plan with tensor parallelism applied for real (issue 35): ``apply_plan`` builds the named (dp_replicate,
dp_shard, tp) mesh, ``parallelize_module``s over tp with the torch styles the layout names, then ``fully_shard``s
over the data-parallel dims. Checked by training on gloo with parameter parity against one process, and on the fake
process group with FSDP2's and DTensor's collectives counted apart, beside the simulator's prediction."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import launch_env, max_abs_diff, run_main
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.apply.fully_shard import apply_plan
from fsdp_planner.apply.tensor_parallel import apply_tp, positional_inputs, torch_plan, torch_style
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.planners.tensor_parallel import titan_llama_layout
from fsdp_planner.runtime.fake_world import beside_prediction, fake_process_group, run_fake_world
from fsdp_planner.runtime.verify import predict_collectives, run_verify
from fsdp_planner.sim.options import PRECISIONS, SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record

BF16 = SimOptions.named("bf16-mixed")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy():
    lm = load_model("toy-llama")
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=BF16.precision.trace_dtype)


def tp_plan(trace, degree: int = 2, mesh: Mesh | None = None) -> Plan:
    return TorchtitanPolicy("TransformerBlock").plan(trace).replace(tensor_parallel=titan_llama_layout(degree),
                                                                    mesh=mesh)


class _Attention(nn.Module):
    """Takes a second positional input and an optional keyword, as torchtitan's attention takes freqs_cis."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 8, bias=False)
        self.wo = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.wq(x) * scale
        return self.wo(h if mask is None else h * mask)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attention = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(0.5)
        return x + self.attention(self.norm(x), scale, mask=torch.ones(1))


def test_each_style_is_the_torch_style_its_comment_names() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    linear = nn.Linear(4, 4)
    style = {s: torch_style(s, False, linear) for s in TPStyle if s is not TPStyle.GATHER_INPUT}
    assert type(style[TPStyle.COLWISE]) is ColwiseParallel and type(style[TPStyle.ROWWISE]) is RowwiseParallel
    assert style[TPStyle.ROWWISE_SEQUENCE].output_layouts == (Shard(1),)
    assert style[TPStyle.EMBEDDING].input_layouts == (Replicate(),)
    assert style[TPStyle.EMBEDDING_SEQUENCE].output_layouts == (Shard(1),)
    assert type(style[TPStyle.SEQUENCE_PARALLEL]) is SequenceParallel
    head = style[TPStyle.SEQUENCE_COLWISE]
    assert head.input_layouts == (Shard(1),) and head.output_layouts == (Replicate(),) and head.use_local_output
    head = torch_style(TPStyle.SEQUENCE_COLWISE, True, linear)  # loss parallel: vocab-sharded DTensor logits
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output
    gather = torch_style(TPStyle.GATHER_INPUT, False, _Attention())
    assert type(gather) is PrepareModuleInput
    assert gather.input_layouts == (Shard(1), None) and gather.desired_input_layouts == (Replicate(), None)


def test_gather_input_counts_required_positional_inputs_and_refuses_star_args() -> None:
    class Star(nn.Module):
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return args[0]

    assert positional_inputs(_Attention()) == 2 and positional_inputs(nn.LayerNorm(4)) == 1
    with pytest.raises(PlannerError, match=r"Star.forward takes \*args"):
        positional_inputs(Star())


def test_torch_plan_expands_the_layout_patterns(toy) -> None:
    model = load_model("toy-llama", meta=True).model
    styles = torch_plan(model, titan_llama_layout(2))
    assert len(styles) == 3 + 4 * 11  # embedding, norm, output + 11 per block
    assert "layers.3.feed_forward.w2" in styles and "layers.*.attention" not in styles


@pytest.mark.integration  # the fake process group: a few seconds
def test_gather_input_passes_other_args_and_kwargs_through() -> None:
    """A module taking more inputs than the one gathered runs forward and backward under TP + FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh

    layout = {"norm": TPStyle.SEQUENCE_PARALLEL, "attention": TPStyle.GATHER_INPUT,
              "attention.wq": TPStyle.COLWISE, "attention.wo": TPStyle.ROWWISE_SEQUENCE}
    from torch.distributed.tensor import DTensor

    model = _Block()
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        apply_tp(model, TensorParallel(2, layout), mesh["tp"])
        out = model(torch.randn(2, 3, 8, requires_grad=True))  # this rank's sequence shard, as SP passes it on
        out.sum().backward()
    assert out.shape == (2, 3, 8) and isinstance(model.attention.wq.weight, DTensor)
    assert model.attention.wq.weight.grad.placements == (Shard(0),)


def test_apply_plan_refuses_a_mesh_without_tp_and_an_unknown_pattern(toy) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = load_model("toy-llama", meta=False).model
    with fake_process_group(4):
        flat = init_device_mesh("cpu", (4,))
        with pytest.raises(PlannerError, match="no 'tp' dim"):
            apply_plan(model, tp_plan(toy), mesh=flat)
        bad = tp_plan(toy).replace(tensor_parallel=TensorParallel(2, {"layers.*.attn": TPStyle.COLWISE}))
        with pytest.raises(PlannerError, match="matches no module"):
            apply_plan(model, bad)
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before any change


@pytest.mark.integration  # 4 gloo ranks under torchrun: ~20 s
def test_verify_dp2_tp2_trains_with_parity_on_gloo(toy) -> None:
    """2 x 2 ranks, bf16-mixed: the params (gathered whole, full_tensor) match one process's training, FSDP2's
    all-gathers and reduce-scatters (of the TP-local shards) are those predicted."""
    result = run_verify("toy-llama", toy, tp_plan(toy), 4)
    assert result.ok, result.to_dict()
    assert result.world_size == 4 and result.params_match and result.param_error is not None
    assert result.counted[0]["all_gather"] == result.predicted["all_gather"] > 0
    plain = predict_collectives(toy, tp_plan(toy).replace(tensor_parallel=None), 2)[1]
    assert result.counted_bytes[0]["all_gather"] < plain["all_gather"]  # TP-local shards: fewer bytes gathered


@pytest.mark.integration  # 8 gloo ranks under torchrun: ~30 s
def test_verify_hsdp_by_tp_trains_with_parity_on_gloo(toy) -> None:
    """2 replicas x 2 shards x TP 2, fp32: parity and HSDP's all-reduces across replicas as predicted."""
    result = run_verify("toy-llama", toy, tp_plan(toy, mesh=Mesh(2, 2)), 8, precision="fp32")
    assert result.ok, result.to_dict()
    assert result.max_abs_diff <= 1e-5 and result.counted[-1]["all_reduce"] > 0


@pytest.mark.integration  # the fake process group: a few seconds each
@pytest.mark.parametrize(("world", "mesh"), [(8, None), (8, Mesh(2, 2)), (64, None)])
def test_fake_world_counts_fsdp_and_tp_collectives_apart(toy, world: int, mesh: Mesh | None) -> None:
    """Real TP + FSDP2 on fake ranks beside the simulator: every count and byte of both process groups exact, the
    peak within 5%."""
    plan = tp_plan(toy, mesh=mesh)
    measured = run_fake_world("toy-llama", plan, world, BF16.precision)
    predicted = simulate(toy, plan, parse_cluster(f"h100:{world}"), BF16, timeline=False)
    rows = beside_prediction(predicted, measured)
    assert {"tp_all_gathers", "tp_reduce_scatter_bytes", "tp_all_reduces"} <= set(rows)
    assert measured.tp_counts is not None and min(measured.tp_counts.values()) > 0
    assert all(p == m for k, (p, m) in rows.items() if k != "peak_memory"), rows
    assert rows["peak_memory"][0] == pytest.approx(rows["peak_memory"][1], rel=0.05)
    assert ("all_reduces" in rows) == (mesh is not None)  # HSDP's all-reduces counted as FSDP2's, not TP's


@pytest.mark.integration
def test_fake_world_without_tp_has_no_tp_rows(toy) -> None:
    plan = TorchtitanPolicy("TransformerBlock").plan(toy)
    measured = run_fake_world("toy-llama", plan, 4, BF16.precision)
    assert measured.tp_counts is None
    assert not any(k.startswith("tp_") for k in beside_prediction(
        simulate(toy, plan, parse_cluster("h100:4"), BF16, timeline=False), measured))


HOSTILE = ["x'];PWNED = 1;y = ['", 'a"""\nPWNED = 1\n"""', "b\nPWNED = 1 #"]  # a layout key closing its literal


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_export_carries_the_layout_as_literals(toy, fmt: ExportFormat) -> None:
    """Every format's module holds the plan's TP as data (hostile pattern names round-trip, run nothing) and its
    entry point; torchtitan's job gains tensor_parallel_degree and loss parallel / async TP."""
    layout = {**{k: s.value for k, s in titan_llama_layout(2).layout.items()}, **dict.fromkeys(HOSTILE, "colwise")}
    tp = TensorParallel(2, {k: TPStyle(v) for k, v in layout.items()}, loss_parallel=False, async_tp=True)
    source = export_plan(tp_plan(toy).replace(tensor_parallel=tp), fmt)
    assert source.isascii()
    scope: dict = {"__name__": "exported"}
    exec(compile(ast.parse(source), "exported.py", "exec"), scope)
    assert "PWNED" not in scope and scope["TP_LAYOUT"] == layout and scope["TP_DEGREE"] == 2
    assert scope["LOSS_PARALLEL"] is False and scope["ASYNC_TP"] is True
    assert callable(scope["tensor_parallel"]) and callable(scope["make_mesh"])
    if fmt is ExportFormat.TORCHTITAN:
        # (torchtitan's job has no key for loss parallel off, and async TP is compile's, with the blocks compiled:
        # neither here, tests/test_torchtitan_registry.py)
        assert "tensor_parallel_degree=2," in source and "disable_loss_parallel" not in source
        assert "'--parallelism.tensor_parallel_degree', '2'," in source
        assert "enable_async_tensor_parallel" not in source.partition("def fsdp_planner_job")[2]
    assert "TP_DEGREE" not in export_plan(tp_plan(toy).replace(tensor_parallel=None), fmt)  # as before without TP


@pytest.mark.parametrize(("mesh", "said"), [
    (None, "this plan's tensor parallelism over 2 ranks does not divide the job's 3 ranks: launch a multiple of 2"),
    (Mesh(2, 1), "this plan was made for 2x1 data-parallel ranks x TP 2 (4 ranks) and the job has 3"),
], ids=["no-mesh", "mesh-2x1"])
def test_an_exported_tp_mesh_refuses_a_world_it_was_not_made_for_in_its_numbers(toy, mesh, said) -> None:
    """3 ranks for a TP 2 plan: it said "made for 1 data-parallel ranks x TP 2" (the job's world // TP, not the
    plan's); a plan without a mesh runs on any multiple of its TP degree, which is what it says now."""
    scope: dict = {"__name__": "exported"}
    exec(compile(export_plan(tp_plan(toy, mesh=mesh), ExportFormat.PYTHON), "exported.py", "exec"), scope)
    with fake_process_group(3), pytest.raises(ValueError, match=re.escape(said)):
        scope["make_mesh"]("cpu")


def _lightning_mesh(scope: dict) -> DeviceMesh:
    """The mesh Lightning's ``ModelParallelStrategy`` (as the export's ``strategy`` makes it) gives
    ``configure_model``: (data_parallel, tensor_parallel)."""
    strategy = scope["strategy"](8)
    return init_device_mesh("cpu", (strategy._data_parallel_size, strategy._tensor_parallel_size),
                            mesh_dim_names=("data_parallel", "tensor_parallel"))


@pytest.mark.integration  # the fake process group: a few seconds
@pytest.mark.parametrize("fmt", [ExportFormat.TORCHTITAN, ExportFormat.LIGHTNING])
def test_exported_parallelize_shards_as_apply_plan_does(toy, fmt: ExportFormat) -> None:
    """torchtitan's ``parallelize(model, world_mesh)`` and Lightning's ``configure_model(model, device_mesh)`` of
    the export on 8 fake ranks (2 x 2 x TP 2) leave every param with the placements and local shape ``apply_plan``
    gives it (Lightning's mesh has one data-parallel dim: its export of an HSDP plan sharded over 4 ranks, with
    no replicas, until it built the plan's mesh)."""
    plan = tp_plan(toy, mesh=Mesh(2, 2))
    scope: dict = {"__name__": "exported"}
    exec(compile(export_plan(plan, fmt), "exported.py", "exec"), scope)
    shards = []
    with fake_process_group(8):
        exported = (lambda m: scope["parallelize"](m, scope["make_mesh"]("cpu"))) if fmt is ExportFormat.TORCHTITAN \
            else (lambda m: scope["configure_model"](m, _lightning_mesh(scope)))
        for shard in (exported, lambda m: apply_plan(m, plan)):
            model = load_model("toy-llama", meta=False).model
            shard(model)
            shards.append({n: (p.placements, p.to_local().shape, p.device_mesh.mesh_dim_names)
                           for n, p in model.named_parameters()})
    assert shards[0] == shards[1]
    placements, local, dims = shards[0]["layers.0.attention.wq.weight"]  # 64 x 64: rows / TP 2 / dp_shard 2
    assert placements[0] == Replicate() and placements[2] == Shard(0) and tuple(local) == (16, 64)
    assert dims == ("dp_replicate", "dp_shard", "tp")


KEYWORD_CALLS = f"{ROOT / 'tests' / 'fixtures' / 'tp_llama.py'}:keyword_calls"  # attention(x=...) and ffn(x=...)


@pytest.mark.integration  # the fake process group: ~10 s
def test_sequence_parallel_gathers_an_input_given_by_keyword() -> None:
    """A block calling its attention and feed-forward with keywords (transformers' decoder layers do): the
    gather_input styles all-gather it (PrepareModuleInput alone raised "module inputs and input_layouts should
    have same length"), every count and byte as predicted."""
    r = run_main("verify", KEYWORD_CALLS, "--policy", "titan", "--tp", "2", "--fake-world-size", "4")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert "tp all gathers" in r.stdout


@pytest.mark.integration  # 4 gloo ranks under torchrun: ~25 s
def test_exported_python_trains_with_parity_on_gloo(tmp_path: Path) -> None:
    """The exported module on 2 x TP 2 gloo ranks (examples/torchrun_fsdp2.py: one batch per TP group, the loss
    under its loss_context()) trains as one process does, in fp32; its blocks call their attention and feed-forward
    with keywords, which its gather_input styles take."""
    lm = load_model(KEYWORD_CALLS)
    plan = TorchtitanPolicy("KeywordBlock").plan(record(lm.model, lm.example_inputs, lm.loss_fn)).replace(
        tensor_parallel=titan_llama_layout(2), model=KEYWORD_CALLS)
    code = tmp_path / "tp_plan.py"
    code.write_text(export_plan(plan, ExportFormat.PYTHON, PRECISIONS["fp32"]))
    env = launch_env(tmp_path, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                          str(ROOT / "examples" / "torchrun_fsdp2.py"), str(code), KEYWORD_CALLS],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert max_abs_diff(out.stdout) <= 1e-5


@pytest.mark.integration  # two torchrun jobs: ~60 s
def test_checkpoint_saved_under_tp_loads_into_pure_fsdp(toy, tmp_path: Path) -> None:
    """DCP reshards the DTensor state of a dp 2 x TP 2 job into FSDP alone on 2 ranks: the restored state is the
    saved one, and training on from it keeps parity."""
    saved = run_verify("toy-llama", toy, tp_plan(toy), 4, steps=2, save_checkpoint=tmp_path / "ck", precision="fp32")
    assert saved.ok, saved.to_dict()
    plain = TorchtitanPolicy("TransformerBlock").plan(toy)
    loaded = run_verify("toy-llama", toy, plain, 2, steps=1, load_checkpoint=tmp_path / "ck", precision="fp32")
    assert loaded.ok and loaded.checkpoint_match and loaded.start_step == 2, loaded.to_dict()


def test_fsdp1_refuses_a_plan_with_tp(toy) -> None:
    from fsdp_planner.apply.fsdp1 import check_fsdp1

    with pytest.raises(PlannerError, match=r"tensor parallelism \(TP 2 \(SP, loss parallel\)\) composes with FSDP2"):
        check_fsdp1(tp_plan(toy))


@pytest.mark.integration  # 4 CPU ranks per framework: 20-80 s each
@pytest.mark.parametrize(("fmt", "script", "launcher"), [
    (ExportFormat.TORCHTITAN, "torchtitan_parallelize.py", "torchrun"),
    (ExportFormat.ACCELERATE, "accelerate_fsdp2.py", "torchrun"),
    (ExportFormat.LIGHTNING, "lightning_fsdp2.py", "lightning"),
])
def test_framework_exports_train_with_tp(toy, tmp_path: Path, fmt: ExportFormat, script: str, launcher: str) -> None:
    """Each framework's export of a dp 2 x TP 2 plan trains 3 steps in its example (its own mesh, one batch per TP
    group, the loss under loss_context())."""
    if fmt is not ExportFormat.TORCHTITAN:
        pytest.importorskip(fmt.value)
    code = tmp_path / "tp_plan.py"
    code.write_text(export_plan(tp_plan(toy), fmt, PRECISIONS["fp32"]))
    env = launch_env(tmp_path, PYTHONPATH=str(ROOT / "src"))
    if fmt is ExportFormat.ACCELERATE:  # Accelerate's own gloo process group on CPU under torchrun (MULTI_CPU)
        env["ACCELERATE_USE_CPU"] = "true"
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"] \
        if launcher == "torchrun" else [sys.executable]
    args = [str(ROOT / "examples" / script), str(code), *(["toy-llama", "4"] if launcher == "lightning" else [])]
    out = subprocess.run([*run, *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "trained 3 steps" in out.stdout or "max_steps=3" in out.stdout + out.stderr


_TINY_QWEN3 = ('{"model_type": "qwen3", "hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6, '
               '"num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256, '
               '"tie_word_embeddings": true}')


@pytest.mark.integration  # 4 gloo ranks under torchrun: ~20 s
def test_per_head_norms_sum_their_grads_over_tp(tmp_path: Path) -> None:
    """Qwen3's per-head q_norm / k_norm (transformers' ``replicated_with_grad_allreduce``) sit between the colwise
    and rowwise Linears and see this rank's heads only: replicated, their grads summed over TP. Left whole they
    trained on one rank's heads (params 42x off the unsharded reference on 4 gloo ranks)."""
    import json

    from fsdp_planner.models import ModelSpec
    from fsdp_planner.planners.tensor_parallel import tp_layout

    config = tmp_path / "config.json"
    config.write_text(_TINY_QWEN3)
    lm = load_model(f"hf:{config}")
    layout = tp_layout(record(lm.model, lm.example_inputs, lm.loss_fn), 2, ModelSpec(f"hf:{config}"))
    assert layout.tp.layout["model.layers.*.self_attn.q_norm"] is TPStyle.REPLICATE
    assert not any("q_norm" in n for n in layout.notes)
    r = run_main("verify", f"hf:{config}", "--policy", "titan", "--tp", "2", "--nproc", "4", "--precision", "fp32",
                 "--batch", "2", "--seq", "32", "--steps", "2", "--time-steps", "0", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["max_abs_diff"] <= 1e-5


@pytest.mark.integration  # 4 gloo ranks under torchrun (~15 s) and 8 fake ranks
def test_a_tied_llama_runs_torchtitan_s_layout_without_sequence_parallelism() -> None:
    """Llama 3.2's tied embeddings leave the embedding and the head whole over TP, so the first norm's input is whole
    and the last norm's output is not gathered: with sequence parallelism kept, every rank failed ("got mixed
    torch.Tensor and DTensor") after ``check`` had passed. The layout drops it, says so, trains with parity on 2 x 2
    gloo ranks and counts every FSDP and TP collective exactly on 8 fake ranks."""
    import json

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_llama.py'}:tied_llama"
    r = run_main("verify", spec, "--policy", "titan", "--tp", "2", "--nproc", "4", "--precision", "fp32",
                 "--steps", "2", "--time-steps", "0", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "share a weight: left whole over TP, so the layout runs without sequence parallelism" in r.stderr
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["max_abs_diff"] <= 1e-5
    fake = run_main("verify", spec, "--policy", "titan", "--tp", "2", "--fake-world-size", "8", "--json")
    assert fake.returncode == 0, fake.stdout[-2000:] + fake.stderr[-2000:]
    checked = json.loads(fake.stdout)
    assert checked["ok"] and checked["counts_and_bytes_exact"], checked
    assert checked["predicted"]["tp_all_reduces"] == checked["measured"]["tp_all_reduces"] > 0


@pytest.mark.integration  # 4 gloo ranks under torchrun: ~10 s
def test_a_detected_inline_mlp_pair_trains_with_parity() -> None:
    """The pair detected in a block holding fc1 and fc2 beside its norms and nn.MultiheadAttention
    (``_pair``) trains on 2 x 2 gloo ranks as one process does."""
    import json

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:inline_mlp"
    r = run_main("verify", spec, "--policy", "titan", "--tp", "2", "--nproc", "4", "--precision", "fp32",
                 "--steps", "2", "--time-steps", "0", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["max_abs_diff"] <= 1e-5


def test_export_refuses_a_layout_check_refuses(tmp_path: Path) -> None:
    """A plan file's TP layout that ``check`` refuses (a norm given colwise, wq rowwise after a sequence-sharding
    embedding) is refused by ``export`` too, in the same words, before any code is written: the exported code
    raised on the ranks instead (a new user's trial). The plan as made exports."""
    import json

    made = tmp_path / "tp.json"
    assert run_main("plan", "toy-llama", "--tp", "2", "--policy", "titan", "--cluster", "h100:8", "--out",
                    str(made)).returncode == 0
    for pattern, style, said in (("norm", "colwise", "is torch's ColwiseParallel, which shards an nn.Linear or "
                                                      "nn.Embedding only, and norm is a RMSNorm"),
                                 ("layers.*.attention.wq", "rowwise", "takes its input sharded on the features")):
        data = json.loads(made.read_text())
        data["tensor_parallel"]["layout"][pattern] = style
        edited = tmp_path / f"{style}.json"
        edited.write_text(json.dumps(data))
        code = tmp_path / f"{style}.py"
        checked, exported = run_main("check", "toy-llama", "--plan", str(edited)), \
            run_main("export", str(edited), "--format", "python", "--out", str(code))
        assert checked.returncode == exported.returncode == 2, exported.stderr
        assert said in exported.stderr and said in checked.stderr, exported.stderr
        assert not code.exists()
    assert run_main("export", str(made), "--format", "python", "--out", str(tmp_path / "ok.py")).returncode == 0


@pytest.mark.parametrize(("backend", "said"), [("gloo", True), ("nccl", False)])
def test_async_tp_is_switched_on_where_it_runs_and_said_where_it_does_not(toy, backend: str, said: bool) -> None:
    """A plan's async TP was simulated and exported, but ``apply_plan`` never switched it on: ``verify --async-tp``
    said "async" and ran TP synchronous (a trial). apply_tp switches it on for CUDA meshes, as torchtitan does
    (symmetric memory); gloo's CPU ranks cannot run it, and verify says so beside its result."""
    import torch._inductor.config

    from fsdp_planner.apply.tensor_parallel import async_tp_runs
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.runtime.verify import JobSteps, VerifyJob, job_result
    from fsdp_planner.sim.options import PRECISIONS

    assert async_tp_runs("cuda") and not async_tp_runs("cpu")
    plan = tp_plan(toy)
    plan = plan.replace(tensor_parallel=dataclasses.replace(plan.tensor_parallel, async_tp=True))
    job = VerifyJob(ModelSpec("toy-llama"), plan, 4, PRECISIONS["fp32"], False, 60.0, JobSteps(steps=1))
    counts = {"all_gather": 0, "reduce_scatter": 0}
    data = {"world": 4, "backend": backend, "counted": [counts], "counted_bytes": [counts], "losses": [1.0],
            "reference_losses": [1.0], "max_abs_diff": 0.0}
    notes = job_result(job, data, 0, counts, counts).notes
    assert any("these gloo ranks ran the plan's TP synchronous" in n for n in notes) is said
    assert torch._inductor.config._micro_pipeline_tp is False  # (no CUDA mesh here switched it on)
