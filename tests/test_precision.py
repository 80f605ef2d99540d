"""Precision is a verdict, and the Python API traces as the command line does.

A step that fails in the precision's compute dtype (a float32 tensor built in forward beside weights FSDP2 casts to
bfloat16) is an error naming the op, the module and the way out, in ``plan``, ``check``, the API and the
fake-world check; the README's Python example gives the command line's figures.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import fsdp_planner as fp
from fsdp_planner import cli
from fsdp_planner.errors import PlannerError
from fsdp_planner.models import load_model
from fsdp_planner.planners import ExecutionOrderPolicy
from fsdp_planner.runtime.fake_world import run_fake_world
from fsdp_planner.runtime.verify import VerifyResult
from fsdp_planner.sim.options import PRECISIONS
from fsdp_planner.trace import record

ROOT = Path(__file__).resolve().parents[1]
MODELS = str(ROOT / "tests" / "fixtures" / "precision_models.py")
CONV, MATMUL, BUILT_BF16 = f"{MODELS}:unet_coord", f"{MODELS}:unet_matmul", f"{MODELS}:bf16_built_mixes_fp32"


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(("spec", "where"), [
    (CONV, "the forward of module 'up2.fuse' (CoordConv) raised RuntimeError: Input type (float) and bias type"),
    (MATMUL, "aten.bmm in module 'mix' raised MixedDtypeError: aten.bmm got bfloat16 and float32 operands"),
])
def test_plan_refuses_a_model_that_fails_in_bf16_naming_the_op_module_and_way_out(capsys, spec, where):
    code, out, err = run_main(capsys, "plan", spec, "--policy", "order")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: the step fails in bfloat16, the compute dtype of "
                                                   "precision 'bf16-mixed': "), err
    assert where in err and err.rstrip().endswith("or plan with --precision fp32"), err
    assert "internal error" not in err and "note" not in err


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_an_integer_operand_of_a_matmul_is_refused_as_real_kernels_refuse_it(capsys, precision):
    code, out, err = run_main(capsys, "plan", f"{MODELS}:ids_into_linear", "--policy", "order", "--precision",
                              precision)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "MixedDtypeError: aten.addmm got " in err and "and int64 operands" in err and "--precision fp32" not in err


def test_the_same_model_plans_in_fp32(capsys):
    code, out, err = run_main(capsys, "plan", MATMUL, "--policy", "order", "--precision", "fp32")
    assert code == 0 and "error" not in err and "order" in out


def test_check_reports_the_precision_failure_as_an_error_and_still_checks_the_rest(capsys):
    code, out, _ = run_main(capsys, "check", CONV, "--json")
    findings = json.loads(out)
    assert code == 1
    assert (findings[0]["severity"], findings[0]["code"], findings[0]["module"]) == ("error", "precision", "up2.fuse")
    assert "--precision fp32" in findings[0]["fix"]
    assert any(f["code"] == "root-params" for f in findings[1:])  # the plan checked on the fp32 trace
    code, out, _ = run_main(capsys, "check", CONV, "--json", "--precision", "fp32")
    assert "precision" not in [f["code"] for f in json.loads(out)]


def test_the_api_raises_the_verdict_with_the_place_and_the_model_own_trace():
    lm = load_model(MATMUL)
    with pytest.raises(fp.PrecisionError) as caught:
        fp.trace(lm.model, lm.example_inputs, lm.loss_fn)
    assert (caught.value.failed.op, caught.value.failed.module) == ("aten.bmm", "mix")
    assert caught.value.own_dtypes.numel == sum(p.numel() for p in lm.model.parameters())
    assert fp.trace(lm.model, lm.example_inputs, lm.loss_fn, precision="fp32").compute_itemsize is None


def test_meta_kernels_mixed_dtype_matmul_is_refused_as_real_kernels_refuse_it():
    """On meta, ``aten.mm`` of float32 and bfloat16 returns a tensor; on CPU and CUDA it raises. The recorder
    refuses it, so the trace never calls fine what crashes on the cluster."""
    import torch

    a, b = torch.ones(2, 3, device="meta"), torch.ones(3, 4, device="meta", dtype=torch.bfloat16)
    assert (a @ b).shape == (2, 4)  # meta lets it through
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ones(2, 3) @ torch.ones(3, 4, dtype=torch.bfloat16)
    lm = load_model(MATMUL)
    with pytest.raises(RuntimeError, match=r"aten\.bmm got bfloat16 and float32 operands"):
        record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)


def test_a_model_failing_in_every_precision_is_its_own_error_with_op_and_module(capsys):
    for precision in ("bf16-mixed", "fp32"):
        code, _, err = run_main(capsys, "plan", BUILT_BF16, "--policy", "order", "--precision", precision)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: tracing '{BUILT_BF16}' failed: aten.mm in module 'proj' raised "
                              "MixedDtypeError"), err
        assert "compute dtype" not in err


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
def test_fake_world_names_the_op_and_module_of_the_model_failure():
    lm = load_model(MATMUL)
    plan = ExecutionOrderPolicy().plan(record(lm.model, lm.example_inputs, lm.loss_fn))
    with pytest.raises(PlannerError, match=r"failed under real FSDP2 on fake ranks: aten\.bmm in module 'mix' "
                                           r"raised MixedDtypeError"):
        run_fake_world(MATMUL, plan, 2, PRECISIONS["bf16-mixed"])
    assert run_fake_world(MATMUL, plan, 2, PRECISIONS["fp32"]).peak_memory > 0


def test_fake_world_cli_gives_the_verdict_not_an_internal_error(capsys):
    code, _, err = run_main(capsys, "verify", MATMUL, "--policy", "order", "--fake-world-size", "2")
    assert code == 2 and err.startswith("error: the step fails in bfloat16") and "internal error" not in err


def _readme_python_example() -> str:
    """The README's Python example up to the training-script part (which needs a process group)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Python API\n\n```python\n(.*?)```", text, re.S)
    assert block is not None, "README.md lost its Python example"
    return block.group(1).split("# in the training script")[0]


def test_readme_python_example_gives_the_cli_figures(capsys, tmp_path, monkeypatch):
    """``fp.trace`` traces at the command line's default precision: the README's example and ``plan --json`` give
    the same plan, step time and memory. Tracing in the model's own dtypes (the old API default) gives others."""
    monkeypatch.chdir(tmp_path)  # the example saves plan.json
    example: dict = {}
    exec(compile(_readme_python_example(), "README.md", "exec"), example)  # the README's own code
    capsys.readouterr()  # what the example printed
    tr, plan = example["tr"], example["plan"]
    cluster = fp.parse_cluster("h100:64")
    api = fp.simulate(tr, plan, cluster).summary()
    budget = re.search(r"memory_budget=(\d+) \* 2\*\*20", _readme_python_example())
    assert budget is not None
    code, out, _ = run_main(capsys, "plan", "toy-llama", "--policy", "auto", "--cluster", "h100:64",
                            "--memory-budget", f"{budget.group(1)}MiB", "--json")
    assert code == 0
    [row] = json.loads(out)["plans"]
    assert row["plan"]["groups"] == plan.to_dict()["groups"]
    for key in ("step_time", "peak_memory", "reserved_memory", "all_gather_bytes", "reduce_scatter_bytes"):
        assert api[key] == row["simulation"][key], key
    lm = example["lm"]
    own = fp.simulate(record(lm.model, lm.example_inputs, lm.loss_fn), plan, cluster).summary()
    assert (own["step_time"], own["peak_memory"]) != (api["step_time"], api["peak_memory"])


FP32_MLP = f"{MODELS}:fp32_mlp"


def _verify_result(precision: str, bound: str) -> VerifyResult:
    counts = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0}
    return VerifyResult(world_size=2, steps=1, backend="gloo", predicted=counts, counted=[counts],
                        counted_bytes=[counts], predicted_bytes=counts, losses=[1.0], reference_losses=[1.0],
                        max_abs_diff=0.0, precision=precision, bound=bound)


def test_the_parity_row_says_what_the_job_trained_in():
    from rich.console import Console

    from fsdp_planner.cli.render import verify_table

    def row(result: VerifyResult) -> str:
        console = Console(width=200, record=True)
        console.print(verify_table(result))
        return next(line for line in console.export_text().splitlines() if "unsharded reference" in line)

    fp32 = row(_verify_result("fp32", ""))
    assert "fp32" in fp32 and "<= 1e-05" in fp32 and "16-bit" not in fp32 and "bfloat16" not in fp32
    assert "bf16-mixed" in (bf16 := row(_verify_result("bf16-mixed", "bfloat16"))) and "steps of bfloat16" in bf16


@pytest.mark.parametrize(("args", "message"), [
    (("--fsdp1", "--precision", "bf16-mixed"), "--fsdp1 trains in fp32"),
    (("--precision", "autocast"), "'autocast' uses torch.autocast"),
    # FSDP2 keeps params in the dtype they were built in: told before any rank starts
    (("--precision", "pure-bf16"), "precision 'pure-bf16' stores params in bfloat16 but the model builds them in "
                                   "float32"),
])
def test_verify_refuses_a_precision_it_cannot_train_in_one_line(capsys, args, message):
    code, _, err = run_main(capsys, "verify", FP32_MLP, "--policy", "order", *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def _verify_json(capsys, *args: str) -> dict:
    code, out, err = run_main(capsys, "verify", FP32_MLP, "--policy", "order", "--steps", "2", "--time-steps", "0",
                              "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.integration
def test_verify_trains_in_the_precision_plan_assumes(capsys):
    """Default: bf16-mixed, as ``plan``: FSDP2 all-gathers bf16 (half the fp32 job's bytes), the losses are not the
    fp32 job's, and the reference, casting as FSDP2 does, still matches; ``--precision fp32`` trains in fp32 and
    says so (no 16-bit wording)."""
    bf16, fp32 = _verify_json(capsys), _verify_json(capsys, "--precision", "fp32")
    assert (bf16["precision"], bf16["bound"]) == ("bf16-mixed", "bfloat16")
    assert (fp32["precision"], fp32["bound"]) == ("fp32", "")
    assert bf16["ok"] and fp32["ok"] and fp32["max_abs_diff"] <= 1e-5
    assert bf16["counted_bytes"][0]["all_gather"] * 2 == fp32["counted_bytes"][0]["all_gather"]
    assert bf16["counted_bytes"][0]["reduce_scatter"] == fp32["counted_bytes"][0]["reduce_scatter"]  # fp32 reduce
    assert bf16["losses"][0] != fp32["losses"][0]
    code, out, _ = run_main(capsys, "verify", FP32_MLP, "--policy", "order", "--steps", "1", "--time-steps", "0",
                            "--precision", "fp32")
    assert code == 0 and "16-bit" not in out and "bfloat16" not in out and "in fp32" in out


def test_verify_measure_says_when_the_job_trains_in_another_precision(capsys, monkeypatch):
    """Measured op times are the model's own dtypes': a bf16-mixed job is not timed like them, and a note says so."""
    from fsdp_planner.cli import verify

    monkeypatch.setattr(verify, "run_verify", lambda *a, **k: (_ for _ in ()).throw(PlannerError("stop here")))
    for args, noted in (((), True), (("--precision", "fp32"), False)):
        code, _, err = run_main(capsys, "verify", FP32_MLP, "--policy", "order", "--cluster", "h100:2", "--measure",
                                *args)
        assert code == 2 and err.rstrip().endswith("error: stop here"), err
        assert ("the job trains in bf16-mixed: add --precision fp32" in err) is noted, err


def test_the_fp32_group_named_is_one_that_holds_the_params(capsys):
    """A failure inside a parametrization (spectral_norm's power iteration) names the module it parametrizes for
    --fp32-modules, not the parametrization's own module, which holds no params (a new user's trial); with that
    name the model plans."""
    code, _, err = run_main(capsys, "plan", f"{MODELS}:spectral_head", "--policy", "order")
    assert code == 2 and "in module 'head.parametrizations.weight.0'" in err, err
    assert "(--fp32-modules head)" in err, err
    assert run_main(capsys, "plan", f"{MODELS}:spectral_head", "--policy", "order", "--fp32-modules", "head")[0] == 0


def test_a_frozen_batchnorm_is_not_sent_to_fp32_modules(capsys):
    """A frozen backbone's BatchNorm fails in bf16 and no module up to the root holds trainable params: the fix
    offered --fp32-modules NAME, which then refused the module (a trial went round); it says why not, and the
    precision that runs it."""
    code, _, err = run_main(capsys, "plan", f"{MODELS}:frozen_batchnorm", "--policy", "order")
    assert code == 2 and "in module '0.1'" in err, err
    assert "--fp32-modules NAME" not in err and "'0.1' and the modules above it hold no trainable params" in err
    assert "or plan with --precision fp32" in err
    assert run_main(capsys, "plan", f"{MODELS}:frozen_batchnorm", "--policy", "order", "--precision", "fp32")[0] == 0
