"""``fsdp-planner export``: the generated code compiles, has each framework's entry point, and trains with the
plan's groups on real gloo ranks (plain torchrun, torchtitan-style, Accelerate and Lightning where installed)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.choices import DEFAULT_PRECISION
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.models import load_model
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.sim.options import PRECISIONS
from fsdp_planner.trace import record

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FACTORIES = str(Path(__file__).resolve().parent / "fixtures" / "factories.py")
ENTRY = {ExportFormat.PYTHON: "apply", ExportFormat.ACCELERATE: "prepare", ExportFormat.LIGHTNING: "configure_model",
         ExportFormat.TORCHTITAN: "parallelize"}


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
    assert {"apply", "make_mesh", ENTRY[fmt]} <= functions
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.integration
def test_torchrun_example_matches_unsharded_training(tmp_path: Path) -> None:
    out = _run_example(tmp_path, ExportFormat.PYTHON, "torchrun_fsdp2.py", precision="fp32")  # as the reference
    assert "max_abs_diff 0" in out or float(out.split("max_abs_diff")[1].split()[0]) <= 1e-5
    assert "fsdp modules: 8" in out  # 6 groups, [norm, output] two modules, the root


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
    assert "fsdp modules: 4" in ok.stdout and float(ok.stdout.split("max_abs_diff")[1].split()[0]) <= 1e-5
    assert bad.returncode != 0 and "DTensor" in bad.stderr, bad.stdout[-2000:] + bad.stderr[-2000:]


@pytest.mark.integration
def test_torchtitan_example_trains(tmp_path: Path) -> None:
    assert "trained 3 steps" in _run_example(tmp_path, ExportFormat.TORCHTITAN, "torchtitan_parallelize.py")


@pytest.mark.integration
def test_accelerate_example_trains(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    assert "trained 3 steps" in _run_example(tmp_path, ExportFormat.ACCELERATE, "accelerate_fsdp2.py")


@pytest.mark.integration
def test_lightning_example_trains(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    _run_example(tmp_path, ExportFormat.LIGHTNING, "lightning_fsdp2.py", torchrun=False)


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
    job = tmp_path / "job.py"
    job.write_text(export_plan(plan.replace(model="llama3-8b"), ExportFormat.TORCHTITAN))
    cfg = read_config(TORCHTITAN, f"{job}:fsdp_planner_job")
    assert (cfg.float8, cfg.float8_all_gather) == ("tensorwise", True) and not cfg.notes
