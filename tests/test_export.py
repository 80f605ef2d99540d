"""``fsdp-planner export``: the generated code compiles, has each framework's entry point, and trains with the
plan's groups on real gloo ranks (plain torchrun, torchtitan-style); the accelerate and lightning exports launch
unchanged in their frameworks (``accelerate launch --config_file``, a Lightning Trainer) where installed."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import launch_env, max_abs_diff

from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.choices import DEFAULT_PRECISION
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Group, Plan, Workload
from fsdp_planner.models import load_model
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.sim.options import PRECISIONS
from fsdp_planner.trace import record

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FACTORIES = str(Path(__file__).resolve().parent / "fixtures" / "factories.py")
LAUNCHED = str(Path(__file__).resolve().parent / "launched.py")
ENTRY = {ExportFormat.PYTHON: {"apply"}, ExportFormat.ACCELERATE: {"shard", "prepare"},
         ExportFormat.LIGHTNING: {"strategy", "configure_model"},
         ExportFormat.TORCHTITAN: {"parallelize", "parallelize_fn"}}


def _plan() -> Plan:
    lm = load_model("toy-llama")
    plan = TorchtitanPolicy("TransformerBlock").plan(record(lm.model, lm.example_inputs, lm.loss_fn))
    return plan.with_group(1, reshard_after_forward=2, forward_prefetch=[2]).replace(
        activation_checkpointing=["layers.3"])


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_export_compiles_with_its_entry_point(fmt: ExportFormat) -> None:
    source = export_plan(_plan(), fmt)
    tree = ast.parse(source)
    compile(tree, "exported.py", "exec")
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"apply", "make_mesh", *ENTRY[fmt]} <= functions
    scope: dict = {}
    exec(compile(source, "exported.py", "exec"), scope)
    assert scope["GROUPS"][1] == (["layers.0"], 2)
    assert scope["GROUPS"][-1] == (["norm", "output"], False)
    assert scope["FORWARD_PREFETCH"] == {1: [2]} and scope["CHECKPOINTED"] == ["layers.3"]


def _apply_exported(precision: str, methods: bool = True, **fsdp_kwargs) -> tuple[set, str | None]:
    """Export a head_loss plan, apply it with real FSDP2 on 2 ranks of the fake process group, run a step: the
    dtypes ``block`` computes in, and the error of the step (None when it ran)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    lm = load_model(f"{FACTORIES}:head_loss", meta=False)
    plan = make_plan(record(lm.model, lm.example_inputs, lm.loss_fn), [["inp"], ["block"], ["head"]])
    scope: dict = {}
    exec(compile(export_plan(plan if methods else plan.replace(forward_methods=[]), ExportFormat.PYTHON,
                             PRECISIONS[precision]), "exported.py", "exec"), scope)
    model, seen = load_model(f"{FACTORIES}:head_loss", meta=False).model, set()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        scope["apply"](model, init_device_mesh("cpu", (2,)), **fsdp_kwargs)
        model.block.register_forward_pre_hook(lambda m, args: seen.add(m.weight.dtype))  # after FSDP2's unshard
        try:
            model(*lm.example_inputs).backward()
        except RuntimeError as e:
            return seen, str(e)
    finally:
        dist.destroy_process_group()
    return seen, None


def test_exported_apply_sets_the_plans_precision_and_forward_methods() -> None:
    """bf16-mixed computes in bf16 (FSDP2 all-gathers the fp32 shards as bf16), fp32 in fp32, an mp_policy given
    to apply wins; and head.loss runs only because apply registers it (FSDP2 refuses it otherwise)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert _apply_exported("bf16-mixed") == ({torch.bfloat16}, None)
    assert _apply_exported("fp32") == ({torch.float32}, None)
    assert _apply_exported("bf16-mixed", mp_policy=MixedPrecisionPolicy()) == ({torch.float32}, None)
    _, error = _apply_exported("fp32", methods=False)
    assert error is not None and "DTensor" in error


def _fsdp_params(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each FSDP module of a sharded ``model`` (by name) -> the params its group manages, as FSDP2 holds them."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule) and (group := m._get_fsdp_state()._fsdp_param_group) is not None:
            out[name] = sorted(p._param_fqn for p in group.fsdp_params)
    return out


def _prefetched(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each FSDP module (by name) -> the modules its forward prefetches (explicit lists)."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m._get_fsdp_state()): n for n, m in model.named_modules() if isinstance(m, FSDPModule)}
    return {n: [names[id(s)] for s in m._get_fsdp_state()._states_to_forward_prefetch]
            for n, m in model.named_modules() if isinstance(m, FSDPModule)
            and m._get_fsdp_state()._states_to_forward_prefetch}


def _export_beside_apply_plan(spec: str, plan: Plan, fmt: ExportFormat = ExportFormat.PYTHON) -> tuple[dict, dict]:
    """``plan`` applied to ``spec``'s model by its export and by ``apply_plan`` on 2 fake ranks, then a step of
    each: what FSDP2 made of each model (its FSDP modules' params, and their forward prefetch)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_planner.apply import apply_plan

    scope: dict = {}
    exec(compile(export_plan(plan, fmt, PRECISIONS["fp32"]), "exported.py", "exec"), scope)
    made = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for shard in (lambda m: scope["apply"](m, init_device_mesh("cpu", (2,))),
                      lambda m: apply_plan(m, plan, mesh=init_device_mesh("cpu", (2,)))):
            lm = load_model(spec, meta=False)
            shard(lm.model)
            lm.model(*lm.example_inputs).square().mean().backward()
            made.append((_fsdp_params(lm.model), _prefetched(lm.model)))
    finally:
        dist.destroy_process_group()
    return made[0], made[1]


@pytest.mark.parametrize("fmt", [ExportFormat.PYTHON, ExportFormat.TORCHTITAN])  # (its modules by torchtitan's names)
@pytest.mark.parametrize("spec, groups", [
    ("nested_stem", [["stem.2", "stem"], ["stem.0"], ["head"]]),  # depths tie: the parent's group listed first
    ("shared_submodule", [["blocks.0"], ["proj"], ["blocks.1"]]),  # proj is blocks.0.proj too: shallower, first
])
def test_exported_code_shards_nested_groups_in_apply_plan_s_order(spec: str, groups: list[list[str]],
                                                                   fmt: ExportFormat) -> None:
    """A group holding a module below another group's module is sharded first, by the module tree of the model the
    code is given (a shared submodule's every parent), as apply_plan orders it: sharded after its parent's group,
    its params were the parent's and fully_shard failed on the ranks ("Invariant encountered")."""
    lm = load_model(f"{FACTORIES}:{spec}", meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    plan = make_plan(tr, groups, model=f"{FACTORIES}:{spec}")
    plan = plan.replace(groups=[*sorted(plan.inner_groups, key=lambda g: groups.index(list(g.modules))), plan.root])
    exported, applied = _export_beside_apply_plan(f"{FACTORIES}:{spec}", plan, fmt)
    assert exported == applied
    hooked = {"nested_stem": "stem", "shared_submodule": "blocks.0"}[spec]
    assert exported[0][hooked] == sorted(plan.groups[0].params)


@pytest.mark.parametrize("first, then, prefetch", [("head", "", {"head": [""]}), ("stem.2", "", {"stem": [""]}),
                                                    ("", "head", {"": ["head"]})])
def test_a_prefetch_list_naming_the_root_is_exported_as_apply_plan_applies_it(first, then, prefetch) -> None:
    """The root is the plan's last group, which a prefetch list may name and which may have lists of its own
    (apply_plan prefetches the model itself, and sets the model's lists); the export's list of groups left it out
    (IndexError on the ranks), and its lists were dropped. A group's FSDP module is its first module not below
    another of its own ('stem', not 'stem.2', which FSDP2 gives no state)."""
    lm = load_model(f"{FACTORIES}:nested_stem", meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    plan = make_plan(tr, [["stem.2", "stem"], ["stem.0"], ["head"]], model=f"{FACTORIES}:nested_stem")
    at = {m: i for i, g in enumerate(plan.groups) for m in g.modules}
    plan = plan.with_group(at[first], forward_prefetch=[at[then]])
    exported, applied = _export_beside_apply_plan(f"{FACTORIES}:nested_stem", plan)
    assert exported == applied and exported[1] == prefetch


def _run_example(tmp_path: Path, fmt: ExportFormat, script: str, torchrun: bool = True,
                 precision: str = DEFAULT_PRECISION) -> str:
    code = tmp_path / f"plan_{fmt.value}.py"
    code.write_text(export_plan(_plan(), fmt, PRECISIONS[precision]))
    out = _launch(tmp_path, [str(EXAMPLES / script), str(code)], torchrun)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def _launch(tmp_path: Path, args: list[str], torchrun: bool = True) -> subprocess.CompletedProcess:
    """An example script, under torchrun on 2 CPU gloo ranks or alone, with this checkout's package."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] \
        if torchrun else [sys.executable]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = launch_env(tmp_path, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.integration
def test_torchrun_example_matches_unsharded_training(tmp_path: Path) -> None:
    out = _run_example(tmp_path, ExportFormat.PYTHON, "torchrun_fsdp2.py", precision="fp32")  # as the reference
    assert max_abs_diff(out) <= 1e-5
    assert "fsdp modules: 8" in out  # 6 groups, [norm, output] two modules, the root
    params = list(load_model("toy-llama").model.parameters())
    for rank in range(2):  # every param a DTensor holding its dim-0 shard on each of the 2 ranks torchrun started
        local = sum(_local_numel(p.shape, rank, 2) for p in params)
        assert f"rank {rank} of 2: {len(params)} of {len(params)} params DTensors, local numel {local}" in out


@pytest.mark.integration
def test_exported_code_registers_the_plans_forward_methods(tmp_path: Path) -> None:
    """head sharded on its own and the step calling ``head.loss``: the exported ``apply`` registers the method, and
    the run matches unsharded training; the same code without it fails as FSDP2 does (plain tensors meet the
    sharded DTensor params), so the registration is what makes it run."""
    factory = f"{FACTORIES}:head_loss"
    lm = load_model(factory)
    plan = make_plan(record(lm.model, lm.example_inputs, lm.loss_fn), [["inp"], ["block"], ["head"]])
    assert list(plan.forward_methods) == [("head", "loss")]
    runs = {}
    for name, p in (("registered", plan), ("unregistered", plan.replace(forward_methods=[]))):
        code = tmp_path / f"{name}.py"
        code.write_text(export_plan(p, ExportFormat.PYTHON, PRECISIONS["fp32"]))  # fp32: as the reference
        runs[name] = _launch(tmp_path, [str(EXAMPLES / "torchrun_fsdp2.py"), str(code), factory])
    ok, bad = runs["registered"], runs["unregistered"]
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "fsdp modules: 4" in ok.stdout and max_abs_diff(ok.stdout) <= 1e-5
    assert bad.returncode != 0 and "DTensor" in bad.stderr, bad.stdout[-2000:] + bad.stderr[-2000:]


@pytest.mark.integration
def test_torchtitan_example_trains(tmp_path: Path) -> None:
    assert "trained 3 steps" in _run_example(tmp_path, ExportFormat.TORCHTITAN, "torchtitan_parallelize.py")



class TitanDims:
    """torchtitan's ``ParallelDims`` as the exported ``parallelize_fn`` reads it (degrees, ``get_mesh`` of named
    dims: ``dp_replicate``, ``fsdp``, ``tp`` as b5bcd76 names them); torchtitan is not installed here."""

    def __init__(self, world: int, replicate: int = 1, tp: int = 1) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.dp_replicate, self.dp_shard, self.tp, self.ep, self.pp, self.cp = (
            replicate, world // replicate // tp, tp, 1, 1, 1)
        self.mesh = init_device_mesh("cpu", (replicate, self.dp_shard, tp), mesh_dim_names=("dp_replicate", "fsdp",
                                                                                             "tp"))

    def get_mesh(self, names: str | list[str]) -> object:
        return self.mesh[names if isinstance(names, str) else tuple(names)]


def test_torchtitan_parallelize_fn_shards_torchtitan_s_module_names(tmp_path) -> None:
    """A plan made on toy-llama (``output``; one group of ``attention.wq``, ``wk``, ``wv``) applies, through the
    torchtitan export's ``parallelize_fn``, to a model named as torchtitan's Decoder is today (``lm_head``, fused
    ``attention.qkv_linear.wqkv``): the same groups, each module once, on 4 fake ranks; HSDP's ``dp_replicate`` and
    torchtitan's ``fsdp`` dim; and it refuses, before any change, a job whose degrees or backend differ from the
    plan's. (benchmarks/torchtitan_export.md runs it on torchtitan's own models beside torchtitan's parallelize.)"""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_planner.fsdp2.plan import Group, Mesh, Workload

    sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
    from titan_decoder import titan_decoder

    lm = load_model("toy-llama")
    qkv = ["layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv"]
    plan = make_plan(record(lm.model, lm.example_inputs, lm.loss_fn), [["tok_embeddings"], qkv, ["layers.0"],
                                                                        ["layers.1"], ["norm", "output"]],
                     model="toy-llama").replace(activation_checkpointing=["layers.1"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for mesh, dims in ((None, {}), (Mesh(2, 2), {"replicate": 2})):
            scope: dict = {}
            exec(compile(export_plan(plan.replace(mesh=mesh), ExportFormat.TORCHTITAN), "exported.py", "exec"), scope)
            model, (tokens,) = titan_decoder()
            wrong = TitanDims(4, replicate=1 if mesh else 2)
            with pytest.raises(ValueError, match="this plan was made for"):
                scope["parallelize_fn"](model, parallel_dims=wrong)
            spmd = dataclasses.make_dataclass("Parallelism", [("spmd_backend", str)])("spmd_types")
            with pytest.raises(ValueError, match=r"set parallelism\.spmd_backend = 'partial_dtensor'"):
                scope["parallelize_fn"](model, parallel_dims=TitanDims(4, **dims), parallelism=spmd)
            assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())  # refused before a change
            scope["parallelize_fn"](model, parallel_dims=TitanDims(4, **dims))
            sharded = sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP"))
            assert sharded == ["", "layers.0", "layers.0.attention.qkv_linear.wqkv", "layers.1", "lm_head", "norm",
                               "tok_embeddings"]
            assert {p.device_mesh.mesh_dim_names for p in model.parameters()} == {
                ("dp_replicate", "fsdp") if mesh else ("fsdp",)}
            assert "checkpointed" in type(model.layers["1"]).forward.__qualname__ or \
                model.layers["1"].forward.__name__ == "checkpointed"
            model(tokens).sum().backward()  # (fake collectives: runs, values not compared)
        other, _ = titan_decoder()
        del other.layers["1"]
        with pytest.raises(ValueError, match=r"does not have: \['layers.1'\]"):
            scope["parallelize_fn"](other, parallel_dims=TitanDims(4, replicate=2))
        # q and k apart, which torchtitan's model fuses: refused before any change; a param sharded on dim 1 found
        # by its torchtitan name; a plan made for 8 ranks refused on 4
        apart = make_plan(record(lm.model, lm.example_inputs, lm.loss_fn), [qkv[:1], qkv[1:], ["layers.0"]],
                          model="toy-llama")
        for bad, match in ((apart, r"shards 'layers.0.attention.wq' and 'layers.0.attention.wk' in different groups"),
                           (plan.replace(workload=Workload(2, 16, 1, 8)), r"'dp_shard': 8.*'dp_shard': 4")):
            scope = {}
            exec(compile(export_plan(bad, ExportFormat.TORCHTITAN), "exported.py", "exec"), scope)
            model, _ = titan_decoder()
            with pytest.raises(ValueError, match=match):
                scope["parallelize_fn"](model, parallel_dims=TitanDims(4))
            assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
        # transformers' backbone ``model`` (auto's one group of an hf: model) is the Decoder's parts, in one group
        backbone = Plan([Group(["model", "lm_head"], []), Group([""], [], False)], "", 0, model="hf:x")
        scope = {}
        exec(compile(export_plan(backbone, ExportFormat.TORCHTITAN), "x.py", "exec"), scope)
        model, _ = titan_decoder()
        scope["parallelize_fn"](model, parallel_dims=TitanDims(4))
        assert sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")) == [
            "", "layers", "lm_head", "norm", "tok_embeddings"]
        scope = {}
        exec(compile(export_plan(plan.replace(shard_dims={"output.weight": 1}), ExportFormat.TORCHTITAN), "x.py",
                     "exec"), scope)
        model, _ = titan_decoder()
        scope["parallelize_fn"](model, parallel_dims=TitanDims(4))
        assert [p.placements[0].dim for p in (model.lm_head.weight, model.norm.weight)] == [1, 0]
    finally:
        dist.destroy_process_group()

def test_torchtitan_export_converts_float8_before_the_model_s_own_tp() -> None:
    """torchtitan's Decoder lays out its TP itself (``model.parallelize(parallel_dims)``), which the export's
    parallelize_fn calls first; its float8 conversion ran after, and torchao's swap of a Linear TP had parallelized
    dropped TP's hooks: the forward mixed a Tensor with DTensors (a trial's 70B TP 8 float8 export). It converts
    first: on 4 fake ranks (TP 2) the feed-forwards are float8 Linears holding TP's shards, and a step runs."""
    pytest.importorskip("torchao")
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchao.float8.float8_linear import Float8Linear

    from fsdp_planner import api

    sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
    from titan_decoder import TitanDecoder, titan_decoder

    class OwnTP(TitanDecoder):
        def parallelize(self, parallel_dims: TitanDims) -> None:  # (torchtitan's Decoder.parallelize, its MLPs)
            for block in self.layers.values():
                parallelize_module(block.feed_forward, parallel_dims.get_mesh("tp"),
                                   {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()})

    plan = api.plan("toy-llama", policy="titan", tp=2, float8="tensorwise", cluster="h100:4")
    scope: dict = {}
    exec(compile(export_plan(plan, ExportFormat.TORCHTITAN), "exported.py", "exec"), scope)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model, (tokens,) = titan_decoder()
        model.__class__ = OwnTP
        scope["parallelize_fn"](model, parallel_dims=TitanDims(4, tp=2))
        w1 = model.layers["0"].feed_forward.w1
        assert isinstance(w1, Float8Linear) and "tp" in w1.weight.device_mesh.mesh_dim_names
        model(tokens).sum().backward()  # (fake collectives: runs, values not compared)
    finally:
        dist.destroy_process_group()


TINY = """import torch
import torch.nn as nn


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 5), nn.ReLU(), nn.Linear(5, 3))
    return model, (torch.randn(4, 7),)
"""


def _tiny_export(tmp_path: Path, fmt: ExportFormat, out: str) -> tuple[Plan, Path]:
    """A plan of a tiny model in its own file (groups 0 and 2, 4 left to the root, 2 checkpointed), exported with
    the CLI into a directory beside the model's: the plan and the file ``--out`` names."""
    from fsdp_planner.cli import main

    (tmp_path / "tiny.py").write_text(TINY)
    lm = load_model(f"{tmp_path / 'tiny.py'}:tiny", meta=False)
    plan = make_plan(record(lm.model, lm.example_inputs, lm.loss_fn), [["0"], ["2"]], reshard=[True, False],
                     model=f"{tmp_path / 'tiny.py'}:tiny").replace(activation_checkpointing=["2"])
    plan.save(tmp_path / "plan.json")
    (tmp_path / "export").mkdir()
    target = tmp_path / "export" / out
    assert main(["export", str(tmp_path / "plan.json"), "--format", fmt.value, "--precision", "fp32",
                 "--out", str(target)]) == 0
    return plan, target


def _launched(out: subprocess.CompletedProcess) -> list[dict]:
    """The ``LAUNCHED`` line of each rank of a tests/launched.py run, by rank."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("LAUNCHED ")]
    return sorted(ranks, key=lambda r: r["index"])


def _assert_plans_shards(plan: Plan, ranks: list[dict], world: int = 2) -> None:
    """Each of ``world`` ranks saw ``world`` processes, its own index; FSDP2 made the plan's groups and the root
    into FSDP modules and nothing else, and holds every param as a DTensor with its dim-0 shard
    (ceil(rows / world) rows a rank, the last rank the rest)."""
    assert [r["index"] for r in ranks] == list(range(world)) and all(r["processes"] == world for r in ranks)
    assert {r["fsdp"] and tuple(r["fsdp"]) for r in ranks} == {tuple(sorted({"", *(m for g in plan.inner_groups
                                                                                    for m in g.modules)}))}
    model = load_model(plan.model, meta=True).model
    for rank, seen in enumerate(ranks):
        for name, param in model.named_parameters():
            assert seen["params"][name] == ["DTensor", _local_numel(param.shape, rank, world)], name


def _local_numel(shape: torch.Size, rank: int, world: int) -> int:
    """What FSDP2's dim-0 sharding leaves ``rank`` of a param: ceil(rows / world) rows, the last ranks the rest."""
    chunk = math.ceil(shape[0] / world)
    return max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])


def test_accelerate_export_is_a_launch_config_with_its_hook_beside_it(tmp_path: Path, capsys) -> None:
    """--out NAME.yaml: the YAML Accelerate's own loader reads as an FSDP2 job (and --from-accelerate reads back),
    the code as NAME.py beside it, both written again over themselves; a suffix that is not what a format writes
    is refused in one line."""
    pytest.importorskip("accelerate")
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    from fsdp_planner.apply import accelerate_config
    from fsdp_planner.cli import main
    from fsdp_planner.configs.job_config import ACCELERATE, read_config
    from fsdp_planner.fsdp2.plan import Mesh

    plan, config = _tiny_export(tmp_path, ExportFormat.ACCELERATE, "plan.yaml")
    loaded = load_config_from_file(str(config))
    assert loaded.distributed_type.value == "FSDP" and loaded.mixed_precision == "no"  # fp32: 'no', not false
    assert loaded.fsdp_config["fsdp_version"] == 2 and loaded.fsdp_config["fsdp_activation_checkpointing"] is False
    job = read_config(ACCELERATE, str(config))
    # (fsdp_reshard_after_forward: true is the wrap policy's own rule: "default")
    assert (job.precision, job.reshard, job.offload) == ("fp32", "default", False)
    # read back, the YAML says its groups are a script's: the one note
    assert len(job.notes) == 1 and job.notes[0].startswith("fsdp_auto_wrap_policy NO_WRAP is read as one FSDP group")
    hook = config.with_suffix(".py")
    assert {"shard", "prepare"} <= {n.name for n in ast.parse(hook.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "MODEL: str = '../tiny.py:tiny'" in hook.read_text()  # relative to the export, not absolute
    hsdp = plan.replace(mesh=Mesh(2, 2), groups=[dataclasses.replace(g, reshard_after_forward=False)
                                                 for g in plan.groups])
    settings = yaml.safe_load(accelerate_config(hsdp, PRECISIONS["bf16-mixed"]))
    assert (settings["num_processes"], settings["mixed_precision"]) == (4, "bf16")  # the mesh's ranks
    assert settings["fsdp_config"]["fsdp_reshard_after_forward"] is False  # every group keeps its params
    plan_file = str(tmp_path / "plan.json")
    assert main(["export", plan_file, "--format", "accelerate", "--out", str(config)]) == 0  # its own files
    capsys.readouterr()
    for fmt, out, says in (("accelerate", "x.py", "give a .yaml file"), ("python", "x.yaml", "give a .py file"),
                           ("lightning", "x.json", "give a .py file"), ("torchtitan", "x.txt", "give a .py file")):
        assert main(["export", plan_file, "--format", fmt, "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and not (tmp_path / out).exists()


def test_an_accelerate_export_launches_the_world_the_plan_was_made_for(tmp_path) -> None:
    """A pure-FSDP plan fits any world; one recording the world it was made for (its workload's ranks: its memory
    is that shard degree's) launches that many processes, on its nodes' machines, and reads back as that job."""
    from fsdp_planner.apply.accelerate_config import accelerate_config
    from fsdp_planner.configs.job_config import ACCELERATE, read_config
    from fsdp_planner.fsdp2.plan import Workload

    plan = _plan()
    assert "# num_processes: the plan fits any world size" in accelerate_config(plan, PRECISIONS["bf16-mixed"])
    yaml = tmp_path / "job.yaml"
    yaml.write_text(accelerate_config(plan.replace(workload=Workload(2, 32, 1, 16)), PRECISIONS["bf16-mixed"]))
    assert "num_processes: 16  # the plan's world" in yaml.read_text()
    assert read_config(ACCELERATE, str(yaml)).world == 16
    yaml.write_text(accelerate_config(plan.replace(workload=Workload(2, 32, 1, 16, 2)), PRECISIONS["bf16-mixed"]))
    assert (read_config(ACCELERATE, str(yaml)).world, read_config(ACCELERATE, str(yaml)).nodes) == (16, 2)

def test_exports_use_public_torch_apis_and_never_make_a_process_group() -> None:
    """No import of a private module (``torch.distributed._composable`` once checkpointed); ``make_mesh`` and the
    accelerate hook refuse in one line where no launcher made a process group, rather than making one."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    for fmt in ExportFormat:
        tree = ast.parse(export_plan(_plan(), fmt))
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in modules if m != "__future__" and any(p.startswith("_") for p in m.split("."))], fmt
    scope: dict = {}
    exec(compile(export_plan(_plan(), ExportFormat.ACCELERATE), "exported.py", "exec"), scope)
    with pytest.raises(RuntimeError, match=r"^no default process group: launch with torchrun"):
        scope["make_mesh"]()
    try:
        with pytest.raises(RuntimeError, match=r"distributed_type NO.*accelerate launch --config_file"):
            scope["shard"](Accelerator(cpu=True), torch.nn.Linear(2, 2))
    finally:
        AcceleratorState._reset_state(True)
    with pytest.raises(RuntimeError, match="call shard first"):
        scope["prepare"](None, torch.nn.Linear(2, 2))


@pytest.mark.integration
def test_accelerate_export_launches_with_accelerate_launch(tmp_path: Path) -> None:
    """``accelerate launch --config_file`` with the exported YAML starts 2 processes, and the hook beside it shards
    the model as the plan says on Accelerate's process group. On CPU Accelerate has no FSDP type (its launcher
    runs 2 processes only through the GPU path; ACCELERATE_USE_CPU makes them MULTI_CPU, gloo), so the hook keeps
    the sharded model from Accelerate's DDP there."""
    pytest.importorskip("accelerate")
    plan, config = _tiny_export(tmp_path, ExportFormat.ACCELERATE, "plan_accelerate.yaml")
    hook = config.with_suffix(".py")
    assert str(tmp_path) not in config.read_text() + hook.read_text()  # the model is named relative to the export
    env = launch_env(tmp_path, ACCELERATE_USE_CPU="true", PYTHONPATH="")  # no fsdp-planner
    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                          "--num_processes", "2", "--main_process_port", "0", LAUNCHED, "accelerate", str(hook)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    ranks = _launched(out)
    assert {r["distributed_type"] for r in ranks} == {"MULTI_CPU"}
    _assert_plans_shards(plan, ranks)


@pytest.mark.integration
def test_lightning_export_launches_in_a_trainer(tmp_path: Path) -> None:
    """A Lightning Trainer on 2 CPU devices with the exported strategy runs the exported configure_model on the
    module it is given: 2 processes, the plan's groups."""
    pytest.importorskip("lightning")
    plan, hook = _tiny_export(tmp_path, ExportFormat.LIGHTNING, "plan_lightning.py")
    env = launch_env(tmp_path, PYTHONPATH="")
    out = subprocess.run([sys.executable, LAUNCHED, "lightning", str(hook)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    ranks = _launched(out)
    assert {r["distributed_type"] for r in ranks} == {"ModelParallelStrategy"}
    _assert_plans_shards(plan, ranks)


def test_export_rewrites_its_own_file_but_never_the_users(tmp_path, capsys) -> None:
    from fsdp_planner.cli import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--out", str(plan), "--quiet"]) == 0
    out = tmp_path / "my_plan.py"
    assert main(["export", str(plan), "--out", str(out)]) == 0
    assert main(["export", str(plan), "--out", str(out)]) == 0  # a plan changed: export again over its own file
    mine = tmp_path / "train.py"
    mine.write_text("print('my training script')\n")
    assert main(["export", str(plan), "--out", str(mine)]) == 2
    assert mine.read_text() == "print('my training script')\n"
    assert "refusing to overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("edit, said", [
    (lambda d: d.update(shard_dims={"output.weight": 2}), "shards output.weight [256, 64] on dim 2, which it does "
                                                          "not have"),
    (lambda d: d.update(shard_dims={"output.wieght": 1}), "names \"output.wieght\", which is not a parameter"),
    (lambda d: d["groups"][1].update(reshard_after_forward=3), "reshard_after_forward=3, which FSDP2 needs to divide "
                                                               "the world size of 2 ranks"),
    (lambda d: d["groups"][1]["params"].pop(), "do not list every param of this model (missing parameters: "),
], ids=["dim-the-param-lacks", "no-such-param", "reshard-not-dividing", "param-missing"])
def test_export_refuses_what_simulate_refuses_on_the_same_model(tmp_path, capsys, edit, said) -> None:
    """A plan file of a model export builds (a built-in, an hf: config) is checked against it as simulate checks it,
    on the ranks it was made for: the code once failed on the ranks (an AssertionError for a dim the param lacks, a
    reshard size FSDP2 refuses) or silently dropped a shard dim naming no param."""
    from fsdp_planner.cli import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--cluster", "h100:2", "--out", str(plan), "--quiet"]) == 0
    capsys.readouterr()
    data = json.loads(plan.read_text())
    edit(data)
    plan.write_text(json.dumps(data))
    assert main(["simulate", "toy-llama", "--plan", str(plan), "--cluster", "h100:2"]) == 2
    refused = capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["export", str(plan), "--out", str(tmp_path / "code.py")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == refused and said in refused
    assert not (tmp_path / "code.py").exists()


@pytest.mark.parametrize("fmt, out", [("python", "plan_code.py"), ("accelerate", "plan.yaml")])
def test_export_never_replaces_its_file_once_edited(tmp_path, capsys, fmt, out) -> None:
    """Each file export writes begins with the checksum of its text: --out writes it again while it is as written,
    and refuses (in one line, the file kept) once edited, e.g. a function appended, which the header alone let the
    next export overwrite; an older export's file, without a checksum, is refused too (no one can tell its edits);
    --force replaces either."""
    from fsdp_planner.cli import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--out", str(plan), "--quiet"]) == 0
    target = tmp_path / out
    assert main(["export", str(plan), "--format", fmt, "--out", str(target)]) == 0
    assert main(["export", str(plan), "--format", fmt, "--out", str(target)]) == 0  # unedited: written again
    written = {p: p.read_text() for p in (target, target.with_suffix(".py"))}
    for edited in written:
        capsys.readouterr()
        edited.write_text(written[edited] + "# my note\n")
        assert main(["export", str(plan), "--format", fmt, "--out", str(target)]) == 2
        err = capsys.readouterr().err
        assert "someone edited since" in err and "--force" in err and len(err.strip().splitlines()) == 1, err
        assert edited.read_text() == written[edited] + "# my note\n"
        edited.write_text(written[edited])
    older = written[target].partition("\n")[2]  # as export wrote it before it had the checksum line
    target.write_text(older)
    assert main(["export", str(plan), "--format", fmt, "--out", str(target)]) == 2
    assert "older fsdp-planner export wrote" in capsys.readouterr().err and target.read_text() == older
    assert main(["export", str(plan), "--format", fmt, "--out", str(target), "--force"]) == 0
    assert target.read_text() == written[target]


def test_export_sets_the_precision_the_plan_was_made_in(tmp_path, capsys) -> None:
    """`plan --out` records its --precision and export sets it; --precision on export wins, with a note."""
    from fsdp_planner.cli import main

    plan = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--precision", "fp32", "--out", str(plan), "--quiet"]) == 0
    assert Plan.load(plan).precision == "fp32"
    capsys.readouterr()
    assert main(["export", str(plan)]) == 0
    assert "PRECISION: str = 'fp32'" in capsys.readouterr().out
    assert main(["export", str(plan), "--precision", "bf16-mixed"]) == 0
    out, err = capsys.readouterr()
    assert "PRECISION: str = 'bf16-mixed'" in out and "the plan was simulated in fp32" in err
    hand = tmp_path / "hand.json"
    hand.write_text('{"version": 1, "groups": [["layers.0"]]}')
    assert main(["export", str(hand)]) == 0
    assert f"PRECISION: str = {DEFAULT_PRECISION!r}" in capsys.readouterr().out


def test_export_and_simulate_say_the_optimizer_and_precision_the_plan_was_made_with(tmp_path, capsys) -> None:
    """`plan --out` records its --optimizer; every export names it (the torchtitan job sets it: test_torchtitan_
    registry), a hand-written plan's none; a plan file's optimizer that is none of fsdp-planner's is refused."""
    from fsdp_planner.apply.export import OPTIMIZER_CALLS
    from fsdp_planner.choices import OPTIMIZER_NAMES
    from fsdp_planner.cli import main

    assert set(OPTIMIZER_CALLS) == set(OPTIMIZER_NAMES)
    plan = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--optimizer", "sgd-momentum", "--out", str(plan),
                 "--quiet"]) == 0
    assert Plan.load(plan).optimizer == "sgd-momentum"
    for fmt in ExportFormat:
        capsys.readouterr()
        assert main(["export", str(plan), "--format", fmt.value]) == 0
        assert "OPTIMIZER: str = 'sgd-momentum'  # the plan's figures assume torch.optim.SGD(params, lr, momentum)" \
            in capsys.readouterr().out
    assert "OPTIMIZER" not in export_plan(Plan.load(plan).replace(optimizer=""), ExportFormat.PYTHON)
    # a plan of grads kept all step (--zero-grad zeros) says how the loop clears them; one of freed grads, nothing
    kept = export_plan(Plan.load(plan).replace(zero_grad="zeros"), ExportFormat.PYTHON)
    assert "SET_TO_NONE: bool = False  # the plan's memory assumes optimizer.zero_grad(set_to_none=False)" in kept
    assert "SET_TO_NONE" not in export_plan(Plan.load(plan), ExportFormat.PYTHON)
    for given, said in (([], True), (["--optimizer", "sgd-momentum"], False)):  # simulate says which it runs
        capsys.readouterr()
        assert main(["simulate", "toy-llama", "--plan", str(plan), "--cluster", "h100:8", *given]) == 0
        assert (("the plan was made with --optimizer sgd-momentum and this command runs adamw: add --optimizer "
                 "sgd-momentum for the figures it was planned with") in capsys.readouterr().err) == said
    # its precision too (a trial's fp32 plan was simulated and verified in bf16-mixed without a word)
    fp32 = tmp_path / "fp32.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--precision", "fp32", "--out", str(fp32), "--quiet"]) == 0
    for command, given, said in (("simulate", [], True), ("simulate", ["--precision", "fp32"], False),
                                 ("verify", ["--fake-world-size", "2"], True)):
        capsys.readouterr()
        assert main([command, "toy-llama", "--plan", str(fp32), "--cluster", "h100:2", *given]) == 0
        assert (("the plan was made with --precision fp32 and this command runs bf16-mixed: add --precision fp32 "
                 "for the figures it was planned with") in capsys.readouterr().err) == said
    data = json.loads(plan.read_text())
    data["optimizer"] = "lamb"
    plan.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match=r"^plan 'optimizer' must be one of sgd, .*, got \"lamb\"$"):
        Plan.load(plan)
    data["optimizer"] = "adamw"  # zero_grad: "zeros" kept, "none" the default's (written as nothing), else refused
    for value, read in (("zeros", "zeros"), ("none", "")):
        plan.write_text(json.dumps(data | {"zero_grad": value}))
        assert Plan.load(plan).zero_grad == read and Plan.load(plan).to_dict().get("zero_grad", "") == read
    plan.write_text(json.dumps(data | {"zero_grad": True}))
    with pytest.raises(PlannerError, match=r"^plan 'zero_grad' must be \"zeros\" or \"none\", got true$"):
        Plan.load(plan)


def test_a_float8_plan_exports_its_conversion_and_torchtitan_s_converter(tmp_path) -> None:
    """The exported apply() converts the Linears apply_plan converts (torchao, emulated here) before fully_shard
    and a step runs on 2 fake ranks; the torchtitan job carries the converter and reads back as the same float8."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_planner.apply.float8 import apply_float8
    from fsdp_planner.configs.job_config import TORCHTITAN, read_config
    from fsdp_planner.fsdp2.float8 import Float8

    f8 = Float8.named("tensorwise")
    plan = _plan().replace(float8=f8)
    scope: dict = {}
    exec(compile(export_plan(plan, ExportFormat.PYTHON), "exported.py", "exec"), scope)
    lm, expected = load_model("toy-llama", meta=False), load_model("toy-llama", meta=False).model
    wanted = apply_float8(expected, f8)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = scope["apply"](lm.model, init_device_mesh("cpu", (2,)))
        lm.loss_fn(model(*lm.example_inputs)).backward()
        scope["after_optimizer_step"](model)
    finally:
        dist.destroy_process_group()
    converted = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    assert converted == sorted(wanted) and "output" not in converted
    # torchtitan's job (its 2026 Float8LinearConverter: rowwise recipes only) converts with the rowwise recipe and
    # has no converter for tensorwise (said by the export), which then reads back as a bf16 job
    job = tmp_path / "job.py"
    for recipe, read in (("rowwise", "rowwise"), ("tensorwise", None)):
        f8_plan = plan.replace(model="llama3-8b", float8=Float8.named(recipe), workload=Workload(1, 8192))
        job.write_text(export_plan(f8_plan, ExportFormat.TORCHTITAN))
        cfg = read_config(TORCHTITAN, f"{job}:fsdp_planner_job")
        assert (cfg.float8, cfg.float8_all_gather) == (read, False)
        assert [n.split(" is ")[0].split(",")[0] for n in cfg.notes] == [
            "fsdp_planner_job builds on llama3_8b()", "model_spec.parallelize_fn = parallelize_fn"]


def test_a_float8_plan_of_a_model_outside_torchtitan_says_its_job_has_no_converter(tmp_path, capsys) -> None:
    """toy-llama is no torchtitan flavour: the job function names no model and no converter (parallelize()
    converts), which read back was a bf16 job and refused --float8 ("whose model has no float8 converter")."""
    from fsdp_planner.cli import main
    from fsdp_planner.fsdp2.float8 import Float8

    path, job = tmp_path / "p.json", tmp_path / "job.py"
    path.write_text(_plan().replace(model="toy-llama", float8=Float8.named("tensorwise")).to_json())
    assert main(["export", str(path), "--format", "torchtitan", "--out", str(job)]) == 0
    assert "fsdp_planner_job() has no float8 converter" in capsys.readouterr().err
    assert main(["export", str(path), "--format", "torchtitan", "--out", str(job), "--force"]) == 0
    assert "give --float8 tensorwise for the plan's figures" in capsys.readouterr().err
    back = ["simulate", "toy-llama", "--from-torchtitan", f"{job}:fsdp_planner_job", "--cluster", "h100:8", "--json"]
    assert main([*back, "--float8", "tensorwise"]) == 0
    assert json.loads(capsys.readouterr().out)["float8_all_reduces"] == 1  # the precomputed scales' all-reduce


def test_what_a_torchtitan_job_cannot_say_is_noted(tmp_path, capsys) -> None:
    """torchtitan's job keys run one setting for every block: a plan checkpointing one block of four, compiling one,
    resharding a group to 2 ranks or running under autocast is exported with a note for each, not silently as
    every block (its job file read back checkpointed all four)."""
    from fsdp_planner.cli import main

    plan = _plan().replace(model="toy-llama", compiled=["layers.0"])
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    assert main(["export", str(path), "--format", "torchtitan", "--precision", "autocast"]) == 0
    err = capsys.readouterr().err
    assert "checkpoints 1 of the model's 4 blocks; torchtitan's job checkpoints every block (full)" in err
    assert "compiles 1 of the model's 4 blocks" in err and "int reshard_after_forward" in err
    assert "under autocast" in err
    assert "more groups than the last" not in err  # (the int group is said above; the rest are torchtitan's default)
    mixed = plan.with_group(1, reshard_after_forward=False).with_group(2, reshard_after_forward=False)
    path.write_text(mixed.to_json())
    assert main(["export", str(path), "--format", "torchtitan"]) == 0
    assert "the plan keeps 2 more groups than the last unsharded after forward" in capsys.readouterr().err
    every = plan.replace(activation_checkpointing=[f"layers.{i}" for i in range(4)], compiled=[],
                         groups=[dataclasses.replace(g, reshard_after_forward=True) for g in plan.groups])
    path.write_text(every.to_json())
    assert main(["export", str(path), "--format", "torchtitan"]) == 0
    assert "torchtitan's job" not in capsys.readouterr().err


def test_a_model_file_not_found_from_here_is_named_as_the_plan_names_it(tmp_path, monkeypatch) -> None:
    """A plan made in another directory names its model file relative to that one: exported from here, a path
    made relative to this directory would miss it ('../../tests/...'); the plan's name is kept."""
    from fsdp_planner.apply.export import portable_model

    spec = "tests/fixtures/ep_moe.py:tiny_mixtral"
    assert portable_model(spec, "tests") == "fixtures/ep_moe.py:tiny_mixtral"  # found: relative to the export
    monkeypatch.chdir(tmp_path)
    assert portable_model(spec, tmp_path / "out") == spec


@pytest.mark.parametrize("every", [True, False])
def test_a_gradient_accumulation_plans_exports_say_its_micro_batches_and_their_sync(every):
    """A plan of 2 micro-batches a step fits only as it syncs them (a new user's Llama 3 8B: 70.7 GiB syncing each,
    100 GiB syncing the last), and its Python, Accelerate and Lightning exports said neither: the plan records its
    gradient sync (``workload.gradient_sync``, absent for the last) and each export says both."""
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                workload=Workload(4, 8192, 2, 8, 1, every))
    again = Plan.from_json(plan.to_json())
    assert again.workload == plan.workload and ("gradient_sync" in plan.to_json()) == every
    for fmt in (ExportFormat.PYTHON, ExportFormat.ACCELERATE, ExportFormat.LIGHTNING):
        source = export_plan(plan, fmt)
        line = next(x for x in source.splitlines() if x.startswith("MICRO_BATCHES: int = 2"))
        assert ("every micro-batch's backward reduce-scatters" in line) == every
        assert ("set_requires_gradient_sync(False)" in line) == (not every)
    with pytest.raises(PlannerError, match=r"\"gradient_sync\" \"last\" or \"every\""):
        Plan.from_json(plan.replace(workload=Workload(4, 8192, 2)).to_json().replace(
            '"micro_batches": 2', '"micro_batches": 2, "gradient_sync": "each"'))


def test_a_model_file_not_found_from_here_is_named_as_the_plan_names_it_with_a_note(tmp_path: Path) -> None:
    """An absolute model path that does not exist here cannot be made relative: the code names it as the plan does,
    and the command says so (the README promised no absolute path: a new user's trial)."""
    from conftest import run_main

    made = tmp_path / "p.json"
    factory = Path(__file__).parents[1] / "docs" / "examples" / "my_model.py"
    assert run_main("plan", f"{factory}:build", "--policy", "order", "--out", str(made)).returncode == 0
    data = json.loads(made.read_text())
    data["model"]["name"] = "/nowhere/model.py:build"
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(data))
    done = run_main("export", str(moved), "--format", "python", "--out", str(tmp_path / "code.py"))
    assert done.returncode == 0
    assert "note: the plan's model file /nowhere/model.py is not found from here" in done.stderr, done.stderr
    assert "MODEL: str = '/nowhere/model.py:build'" in (tmp_path / "code.py").read_text()
    assert "not found from here" not in run_main("export", str(made), "--format", "python").stderr
