"""``fsdp_planner.plan``: the command line's plan in one call, for a model on meta or real, and the example script
that plans and trains under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import launch_env, traced

import fsdp_planner as fp
from fsdp_planner import cli
from fsdp_planner.errors import PlannerError
from fsdp_planner.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def _without_workload(plan: dict) -> dict:
    assert plan["workload"]["batch"] > 0  # (a named model's, which a module's plan does not record)
    return {k: v for k, v in plan.items() if k != "workload"}


@pytest.mark.integration  # (about 2.5 s: two auto searches and a command)
def test_plan_is_the_cli_plan_for_a_spec_a_meta_module_and_a_real_one(capsys, tmp_path):
    """The API gives the plan ``plan --policy auto --out`` writes; a real model gets the same plan as its meta
    build, and its params (values, dtypes, grads, device) are left as they were."""
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--out", str(out)]) == 0
    capsys.readouterr()
    written = json.loads(out.read_text())
    assert fp.plan("toy-llama", cluster="h100:8").to_dict() == written
    meta = load_model("toy-llama", meta=True)
    real = load_model("toy-llama", meta=False)
    before = {n: t.detach().clone() for n, t in real.model.state_dict().items()}
    for lm in (meta, real):
        got = fp.plan(lm.model, lm.example_inputs, lm.loss_fn, cluster="h100:8").to_dict()
        # (a module's batch is its inputs', which the plan does not record: a named model's workload it does)
        assert {**got, "model": None} == {**_without_workload(written), "model": None}
    after = dict(real.model.state_dict())
    assert all(torch.equal(before[n], after[n]) and after[n].dtype == before[n].dtype for n in before)
    assert all(p.grad is None and not p.is_meta for p in real.model.parameters())


@pytest.mark.integration  # (about 5 s alone, most of it transformers' import and first traces; ~1.5 s in a suite)
def test_the_cli_options_the_api_takes_give_the_cli_plan(capsys, tmp_path):
    """micro_batches='auto', reduce_dtype, shard_placement, attention, routing and hf_config give the plan the
    command line writes with the same options."""
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--batch", "2", "--micro-batches",
                     "auto", "--reduce-dtype", "bf16", "--shard-placement", "auto", "--attention", "eager",
                     "--routing", "2", "--out", str(out)]) == 0
    got = fp.plan("toy-llama", cluster="h100:8", batch=2, micro_batches="auto", reduce_dtype="bf16",
                  shard_placement="auto", attention="eager", routing=2)
    assert got.to_dict() == json.loads(out.read_text())
    assert got.reduce_dtype == "bf16" and got.attention == "eager"
    hf = ["--hf-config", "n_layer=2", "--hf-config", "n_embd=64", "--hf-config", "n_head=2"]
    assert cli.main(["plan", "hf:gpt2", "--policy", "titan", "--cluster", "h100:8", "--batch", "2", "--seq", "32",
                     *hf, "--reduce-dtype", "bf16", "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    got = fp.plan("hf:gpt2", policy="titan", cluster="h100:8", batch=2, seq=32, reduce_dtype="bf16",
                  hf_config={"n_layer": 2, "n_embd": 64, "n_head": 2})
    assert got.to_dict() == json.loads(out.read_text()) and got.hf_config["n_layer"] == 2


@pytest.mark.integration  # (about 25 s: torch.compile's partitioner on a block and the loss, twice)
def test_compile_and_float8_give_the_cli_plan_for_a_real_module(capsys, tmp_path):
    """A real model's plan with its blocks and loss compiled, float8 and zeroed grads is the command line's: the
    loss it closes over real labels compiles on meta as the factory's does (a dispatch mode there broke Dynamo,
    and the loss was planned eager, another plan with no word said)."""
    out = tmp_path / "plan.json"
    job = {"compile": True, "compile_loss": True, "float8": "tensorwise", "zero_grad": "zeros"}
    assert cli.main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--compile", "--compile-loss",
                     "--float8", "tensorwise", "--zero-grad", "zeros", "--out", str(out)]) == 0
    capsys.readouterr()
    written = json.loads(out.read_text())
    assert written["compiled_loss"] and written["float8"]["recipe"] == "tensorwise"
    real = load_model("toy-llama", meta=False)
    got = fp.plan(real.model, real.example_inputs, real.loss_fn, cluster="h100:8", **job).to_dict()
    assert {**got, "model": None} == {**_without_workload(written), "model": None}
    assert got != fp.plan(real.model, real.example_inputs, real.loss_fn, cluster="h100:8").to_dict()


def test_a_loss_reading_a_real_parameter_compiles():
    """A loss dividing by a learnable real temperature (CLIP's) fell back to an eager loss under compile_loss, with
    no word (Dynamo refused the meta move's requires_grad_), where the factory's meta one compiled (a trial)."""
    real = load_model("toy-llama", meta=False)
    temp = torch.nn.Parameter(torch.tensor(1.5))
    plan = fp.plan(real.model, real.example_inputs, lambda out: real.loss_fn(out / temp), cluster="h100:8",
                   policy="titan", compile_loss=True)
    assert plan.to_dict().get("compiled_loss") is True and temp.grad is None


def test_a_loss_that_does_not_compile_is_said_as_a_warning():
    """compile_loss on a loss reading a value (int(mask.sum())) is planned eager, as the command line does and
    notes; the API dropped the note, and the caller had a plan of an eager loss without a word (a trial)."""
    real = load_model("toy-llama", meta=False)
    (tokens,) = real.example_inputs
    labels = torch.randint(0, real.model.output.out_features, tokens.shape)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        total = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return total / int((labels != -100).sum())

    with pytest.warns(UserWarning, match="^compile_loss: the loss of .* reads a value from a tensor") as said:
        plan = fp.plan(real.model, real.example_inputs, loss_fn, cluster="h100:8", policy="auto", compile_loss=True)
    assert not plan.to_dict().get("compiled_loss")
    assert len(said) == 1 and said[0].filename == __file__  # once, at the caller's line


def test_the_service_s_sentences_name_the_api_s_keywords():
    """A script passed keywords, not options: the planning service's sentences named --tp and --float8-skip (a
    trial); each option that is a keyword of plan is written as the keyword."""
    from fsdp_planner.api import api_spelling

    lm = load_model("seed-net", meta=True)
    with pytest.raises(PlannerError, match="plan it without tp, or give a layout") as e:
        fp.plan(lm.model, lm.example_inputs, lm.loss_fn, cluster="h100:8", tp=2)
    assert "--" not in str(e.value)
    assert api_spelling("(--float8-skip head, --no-float8-all-gather, --nproc 2, x--tp, /a/--tp/m.py, "
                        "--compile.enable)") == \
        "(float8_skip head, float8_all_gather=False, --nproc 2, x--tp, /a/--tp/m.py, --compile.enable)"
    # the same error, its class and fields kept: a PrecisionError is caught as one (a review: a plain PlannerError)
    from fsdp_planner.models import ModelSpec

    with pytest.raises(fp.PrecisionError) as failed:
        fp.plan(str(ModelSpec("tests/fixtures/precision_models.py:unet_matmul")), policy="titan", cluster="h100:8")
    assert failed.value.fix


def test_a_classic_policy_and_its_options():
    plan = fp.plan("toy-llama", policy="titan", ac="full", cluster="h100:8", precision="fp32")
    assert plan.policy.startswith("titan") and plan.precision == "fp32"
    assert plan.activation_checkpointing  # every block


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"ac": "half"}, "ac must be one of none, full, op, selective"),
    ({"ac_policy": "titan", "ac": "full"}, "give it with ac='op'"),
    ({"memory_budget": "60GiB", "headroom": 0.1}, "give memory_budget or headroom, not both"),
    ({"micro_batches": 0}, "micro_batches must be from 1 to 1,000,000, got 0"),
    ({"cluster": ""}, "cluster must be a Cluster or a non-empty string"),
    ({"cluster": 8}, r"cluster must be a Cluster or a non-empty string .*, got 8"),
    ({"policy": None}, "policy must be a policy's name"),  # (it returned the module policy's plan)
    # in the API's names, not the command line's (--memory-budget, --hf-config)
    ({"memory_budget": -5}, "^memory_budget must be positive, got -5"),
    ({"cluster": "h100:x"}, "h100:x"),
    ({"precision": "fp8"}, "fp8"),
    ({"batch": "4"}, "batch must be a whole number, got '4'"),  # was a TypeError from inside the trace
    ({"seq": 2.5}, "seq must be a whole number, got 2.5"),
    ({"reduce_dtype": "fp16"}, "reduce_dtype must be one of fp32, bf16"),
    ({"shard_placement": "dim1"}, "shard_placement must be one of dim0, auto"),
    ({"attention": "paged"}, "attention must be one of"),
    ({"routing": 0.0}, "routing must be a capacity factor"),
    ({"memory_budget": 10**30}, "^memory_budget 1,000,.* is too large: at most 1 EiB"),  # (as '1e30' was: a trial)
    ({"hf_config": ["n_layer=2"]}, "hf_config must be a dict of config fields"),
    ({"hf_config": {"n_layer": 2}}, "^hf_config sets fields .* applies to hf: models"),
    ({"micro_batches": "auto"}, "micro_batches='auto' lets policy='auto' split batch"),
    # only what is missing is asked for (the batch given was asked for too)
    ({"micro_batches": "auto", "batch": 4, "policy": "titan"}, "of the step: add policy='auto'$"),
    ({"micro_batches": "auto", "policy": "auto"}, "of the step: add batch$"),
    ({"micro_batches": "auto", "batch": "4"}, "batch must be a whole number, got '4'"),
    ({"micro_batches": 2, "batch": "4"}, "batch must be a whole number, got '4'"),
    ({"tp": 3, "cluster": "h100:8"}, "tp = 3 must divide the 8 GPUs of a node"),  # as the API names it, not --tp
    ({"compile": "yes"}, "^compile must be"),
    ({"float8": "fp8"}, "^float8 must be one of"),
    ({"float8_skip": ("wq",)}, "^float8_skip names Linears float8 training leaves in bf16: give float8"),
    ({"zero_grad": "never"}, "^zero_grad must be one of none, zeros"),
    # (planned with FSDP2's float8 all-gather under an FSDP1 target: a trial)
    ({"float8": "tensorwise", "target": "fsdp1"}, "^float8 tensorwise all-gathers its weights in float8 through "
                                                  "FSDP2's .*: turn it off .float8_all_gather=False., or leave "
                                                  "target fsdp1 out"),
])
def test_bad_arguments_are_one_sentence(kwargs, message):
    with pytest.raises(PlannerError, match=message.replace("(", r"\(")):
        fp.plan("toy-llama", **kwargs)


def test_module_arguments_are_checked():
    lm = load_model("toy-llama", meta=True)
    with pytest.raises(PlannerError, match="give the model's example inputs"):
        fp.plan(lm.model)
    with pytest.raises(PlannerError, match="batch and seq reach a MODEL spec's factory"):
        fp.plan(lm.model, lm.example_inputs, batch=2)
    with pytest.raises(PlannerError, match="brings its own inputs"):
        fp.plan("toy-llama", lm.example_inputs)
    with pytest.raises(PlannerError, match=r"nn\.Module or a MODEL spec string"):
        fp.plan(42)  # type: ignore[arg-type]


def test_module_inputs_are_one_micro_batch():
    """An nn.Module's inputs are one micro-batch: micro_batches=N plans a step of N of them (it asked for batch,
    which a module refuses: the two sentences sent a trial of the API round in a circle); 'auto', which traces
    the batch at each split, is refused in one sentence."""
    lm = load_model("toy-llama", meta=True)
    one = fp.plan(lm.model, lm.example_inputs, lm.loss_fn, policy="titan", cluster="h100:8")
    two = fp.plan(lm.model, lm.example_inputs, lm.loss_fn, policy="titan", cluster="h100:8", micro_batches=2)
    tr = fp.trace(lm.model, lm.example_inputs, lm.loss_fn)
    step = [fp.simulate(tr, one, "h100:8", fp.SimOptions.named(micro_batches=n)).step_time for n in (1, 2)]
    assert two.signature() == one.signature() and step[1] > 1.5 * step[0]
    with pytest.raises(PlannerError, match=r"^micro_batches='auto' lets auto split a MODEL spec's batch.*give "
                                           r"micro_batches=N"):
        fp.plan(lm.model, lm.example_inputs, lm.loss_fn, micro_batches="auto")


def _bad_calls(tr, plan):  # (call, the sentence it raises)
    from fsdp_planner.models import load_model as load

    module = load("toy-llama", meta=True).model
    return [
        (lambda: fp.simulate(tr, None, "h100:8"), r"^simulate's plan must be a Plan, not None$"),
        (lambda: fp.simulate(tr, plan.to_dict(), "h100:8"), r"^simulate's plan must be a Plan, not a dict$"),
        (lambda: fp.simulate(module, plan, "h100:8"), r"^simulate's trace must be a Trace, not a Transformer$"),
        (lambda: fp.simulate(tr, plan, "h100:8", "fp32"), r"^simulate's options must be a SimOptions or None"),
        (lambda: fp.plan_metrics(tr, plan, 0), r"world_size must be a number of ranks from 1 to 1,000,000, not 0"),
        (lambda: fp.plan_metrics(tr, plan, True), r"world_size must be an int or None, not bool True"),
        (lambda: fp.plan_metrics(tr, plan, "8"), r"world_size must be an int or None, not str '8'"),
        (lambda: fp.parse_cluster(None), r"^parse_cluster's spec must be a str, not None$"),
        (lambda: fp.trace("toy-llama", ()), r"^trace's model must be an nn\.Module, not str 'toy-llama'$"),
        (lambda: fp.ExecutionOrderPolicy().plan(module), r"^ExecutionOrderPolicy\.plan's trace must be a Trace"),
        (lambda: fp.AutoPolicy("h100:8").plan(module), r"^AutoPolicy\.plan's trace must be a Trace"),
        (lambda: fp.SimOptions(precision="fp32"), r"^SimOptions's precision must be a Precision, not str 'fp32': "
                                                  r"SimOptions\.named\(precision=\.\.\."),
        (lambda: fp.AutoPolicy("h100:8", checkpointing="bogus"), r"^AutoPolicy's checkpointing must be one of "
                                                                  r"'none', 'full'.*not 'bogus'"),
        (lambda: fp.Plan.from_json(plan.to_dict()), r"^Plan\.from_json reads a plan's JSON text \(a str\), not dict"),
        (lambda: plan.with_group(99), r"^with_group's i must be a group's index, from 0 to"),
        (lambda: fp.SimOptions.named(zero_grad="maybe"), r"^SimOptions\.named's zero_grad must be one of 'none', "
                                                         r"'zeros' \(or ZeroGrad\), not 'maybe'$"),
        (lambda: fp.simulate(tr, plan.with_group(0, reshard_after_forward="no"), "h100:8"),
         r"reshard_after_forward must be true, false or a positive whole number"),
    ]


def test_the_api_s_arguments_are_checked_at_the_door():
    """A value of another type than an API function or class takes is one sentence naming the argument (a trial
    met AttributeErrors from deep inside: a module given as the trace, a precision's name to SimOptions, a plan as
    a dict); an enum's value converts to the enum (``checkpointing="full"`` was kept as a string, planned as no
    fixed mode); a size by name converts as the command line reads it; one name is a tuple of it, not of its
    letters."""
    from fsdp_planner.choices import ACMode

    tr = traced("toy-llama")
    plan = fp.ExecutionOrderPolicy().plan(tr)
    for call, message in _bad_calls(tr, plan):
        with pytest.raises(PlannerError, match=message):
            call()
    assert fp.AutoPolicy("h100:8", checkpointing="full").checkpointing is ACMode.FULL
    assert fp.ExecutionOrderPolicy("1MiB").target_bytes == 1 << 20
    # what plainly means the type asked for is taken as it (a review found these refused): FSDP1's 1e8, a numpy
    # int, a set of class names, 0 for False, None as a plan's model name
    import numpy as np

    assert fp.SizeBasedPolicy(1e8).min_nonwrapped_numel == 10**8 and fp.ExecutionOrderPolicy(np.int64(4096))
    assert fp.ModuleWrapPolicy({"TransformerBlock"}).module_classes == ("TransformerBlock",)
    assert fp.SimOptions(offload=0).offload is False and fp.SimOptions(offload=np.bool_(True)).offload is True
    assert fp.ModuleWrapPolicy("TransformerBlock").plan(tr, None).groups
    with pytest.raises(PlannerError, match=r"min_nonwrapped_numel must be an int, not float 1\.5"):
        fp.SizeBasedPolicy(1.5)
    assert plan.replace(activation_checkpointing="layers.3").activation_checkpointing == ("layers.3",)


def test_importing_the_package_does_not_import_torch():
    code = ("import sys, fsdp_planner; assert 'torch' not in sys.modules; "
            "print('plan' in dir(fsdp_planner))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.integration
def test_the_example_plans_and_trains_on_two_gloo_ranks(tmp_path):
    env = launch_env(tmp_path, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(ROOT / "examples" / "plan_and_train.py"), "--steps", "3"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "plan: auto(h100:2" in out.stdout
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trained
    assert "returned a view tensor" not in out.stderr  # FSDP2's warning for a wrapped module's view output



@pytest.mark.integration
def test_the_documented_train_script_trains_on_a_saved_plan(tmp_path):
    """docs/your-model.md: ``plan ... --out plan.json`` then ``torchrun ... docs/examples/train.py plan.json``."""
    factory = ROOT / "docs" / "examples" / "my_model.py"
    assert cli.main(["plan", f"{factory}:build", "--policy", "auto", "--cluster", "h100:2",
                     "--out", str(tmp_path / "plan.json")]) == 0
    env = launch_env(tmp_path, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(ROOT / "docs" / "examples" / "train.py"), "plan.json"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and torch.isfinite(torch.tensor(losses)).all()  # three steps on rank 0

def test_the_examples_modules_return_no_views():
    """FSDP2 warns when a wrapped module returns a view (an in-place op on it skips the pre-backward hook): every
    module of the example's model, any of which a plan may wrap, returns a fresh tensor."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_and_train", ROOT / "examples" / "plan_and_train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.TinyLM()
    views: list[str] = []
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, i, out, name=name: views.append(name) if out._is_view() else None)
    tokens = torch.randint(0, 256, (2, 8))
    example.next_token_loss(tokens)(model(tokens)).backward()
    assert views == []


class _DeviceBound(torch.nn.Module):
    """A forward that makes a tensor on an explicit device: it cannot run on meta, only under fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + torch.ones(8, device="cpu"))


def test_a_model_that_cannot_run_on_meta_is_traced_under_fake_tensors():
    model = _DeviceBound()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    plan = fp.plan(model, (torch.randn(4, 8),), cluster="h100:2", precision="fp32")
    assert plan.groups and all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    # compiled code is measured on the meta copy, where this step fails: said with what failed there; a step that
    # fails on real tensors too is the model's own error, not blamed on a device (a review: inputs of the wrong
    # width, compile=True, read "a tensor made on an explicit device")
    with pytest.raises(PlannerError, match=r"^compile: what compiled code saves is measured on a meta copy of the "
                                           r"_DeviceBound model, and its step runs on real tensors only \(.*add"):
        fp.plan(model, (torch.randn(4, 8),), cluster="h100:2", precision="fp32", compile=True)
    with pytest.raises(PlannerError, match=r"^tracing the _DeviceBound model failed: .*addmm.*same reduction dim"):
        fp.plan(model, (torch.randn(4, 7),), cluster="h100:2", precision="fp32", compile=True)
    assert all(p.grad is None and p.dtype == torch.float32 for p in model.parameters())


def test_a_real_model_with_tied_weights_plans_as_its_spec():
    """The meta twin keeps ties (one meta tensor per shared param): the tied embedding and head stay one group."""
    real = load_model("toy-gpt2-tied", meta=False)
    got = fp.plan(real.model, real.example_inputs, real.loss_fn, cluster="h100:2").to_dict()
    want = fp.plan("toy-gpt2-tied", cluster="h100:2").to_dict()
    assert {**got, "model": None} == {**_without_workload(want), "model": None}
    assert real.model.lm_head.weight is real.model.wte.weight and not real.model.wte.weight.is_meta


HAND_PLAN = ROOT / "docs" / "examples" / "hand_plan.json"


def test_simulate_checks_a_plan_against_the_trace_as_the_cli_does(capsys):
    """A hand-written plan (module lists) loaded by ``Plan.load`` simulated a step that gathered nothing (0
    all-gathers, no warning: a new user's trial); a plan of another model raised a KeyError. The API's ``simulate``
    and ``plan_metrics`` derive its params and check it as ``simulate --plan`` does."""
    lm = load_model(f"{ROOT / 'docs' / 'examples' / 'my_model.py'}:build")
    tr = fp.trace(lm.model, lm.example_inputs, lm.loss_fn)
    hand = fp.Plan.load(str(HAND_PLAN))
    step = fp.simulate(tr, hand, "h100:2", timeline=False)
    assert cli.main(["simulate", f"{ROOT / 'docs' / 'examples' / 'my_model.py'}:build", "--plan", str(HAND_PLAN),
                     "--cluster", "h100:2", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert step.all_gathers == said["all_gathers"] > 0 and step.step_time == pytest.approx(said["step_time"])
    assert fp.plan_metrics(tr, hand).all_gathers == step.all_gathers
    other = load_model("seed-net")
    seed = fp.trace(other.model, other.example_inputs, other.loss_fn)
    with pytest.raises(PlannerError, match=r"plan names modules the model does not have: blocks\.0"):
        fp.simulate(seed, hand, "h100:2")  # (a hand-written plan)
    plan = fp.ExecutionOrderPolicy().plan(tr)
    with pytest.raises(PlannerError, match="plan was made for another model"):
        fp.plan_metrics(seed, plan)  # (a plan that lists params: a KeyError before)
    with pytest.raises(PlannerError, match="activation_checkpointing names modules the model does not have: nosuch"):
        fp.simulate(tr, plan.replace(activation_checkpointing=["nosuch"]), fp.parse_cluster("h100:8"))
    with pytest.raises(PlannerError, match="simulate needs a cluster"):
        fp.simulate(tr, plan, None)  # type: ignore[arg-type]


def test_a_model_that_fails_its_own_step_is_one_sentence(capfd):
    """A shape error in the model's forward was a bare RuntimeError after 38 logged tracebacks of fake tensors
    (the meta attempt failed, then the real model under fake tensors): one PlannerError naming the op and module,
    as the command line says it, and nothing logged; a loss_fn that is no function is said so."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    with pytest.raises(PlannerError, match=r"^tracing the Sequential model failed: aten.addmm in module '0' raised "
                                           r"RuntimeError: a and b must have same reduction dim"):
        fp.plan(model, (torch.randn(8, 3),))
    assert "Traceback" not in capfd.readouterr().err
    with pytest.raises(PlannerError, match="loss_fn must be a function of the model's output, got int"):
        fp.plan(model, (torch.randn(8, 64),), 3)  # type: ignore[arg-type]


def test_the_policies_take_what_plan_takes():
    """``AutoPolicy("h100:8")`` was an AttributeError and a budget "3MiB" a TypeError, though ``fp.plan`` takes both;
    ``ModuleWrapPolicy("TransformerBlock")`` wrapped the classes T, r, a, ...: each as ``fp.plan`` reads it."""
    lm = load_model("toy-llama")
    tr = fp.trace(lm.model, lm.example_inputs, lm.loss_fn)
    assert fp.AutoPolicy("h100:8", memory_budget="3MiB").plan(tr) == \
        fp.AutoPolicy(fp.parse_cluster("h100:8"), memory_budget=3 * 2**20).plan(tr)
    assert fp.ModuleWrapPolicy("TransformerBlock").plan(tr) == fp.ModuleWrapPolicy(("TransformerBlock",)).plan(tr)
    with pytest.raises(PlannerError, match="cluster must be a Cluster or a preset"):
        fp.AutoPolicy(8)  # type: ignore[arg-type]
    with pytest.raises(PlannerError, match="module_classes must be class names"):
        fp.ModuleWrapPolicy(("Block", 3))  # type: ignore[arg-type]


def test_tp_on_a_users_module_is_the_specs_plan():
    """``fp.plan(module, inputs, loss_fn, tp=2)`` on a model whose layout is detected (column-then-row pairs) was
    "unknown model '<class name>'" on every rank (a new user's trial): one TP rank's step is checked on a meta twin
    of the module, as on its factory's model; the plan is the spec's, and the module is left as it was."""
    spec = f"{ROOT / 'tests' / 'fixtures' / 'tp_detected.py'}:pairs_mlp"
    module = load_model(spec, meta=False)
    before = {n: t.detach().clone() for n, t in module.model.state_dict().items()}
    mine = fp.plan(module.model, module.example_inputs, module.loss_fn, cluster="h100:4", tp=2)
    theirs = fp.plan(spec, cluster="h100:4", tp=2)
    assert mine.tensor_parallel == theirs.tensor_parallel and mine.tensor_parallel.degree == 2
    assert _without_workload(theirs.to_dict())["groups"] == mine.to_dict()["groups"]
    after = module.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


class _PairsBlock(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Locked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(_PairsBlock(), _PairsBlock())
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class _OnCpu(_Locked):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) + torch.zeros(x.shape[-1], device="cpu")


def test_tp_on_a_module_its_meta_twin_cannot_check_is_one_sentence():
    """A module deepcopy cannot copy, or whose step runs only on real tensors, plans without TP (under fake
    tensors); with tp= it was a TypeError, or "its code fixes a shape the layout splits" (the review): said what
    it is."""
    x = torch.randn(2, 16, 32)
    with pytest.raises(PlannerError, match=r"meta copy of the _Locked model, which cannot be copied \(TypeError"):
        fp.plan(_Locked(), (x,), cluster="h100:8", tp=2)
    model = _OnCpu()
    model.lock = None  # (copyable: its step alone runs only on real tensors)
    assert fp.plan(model, (x,), cluster="h100:8").groups
    with pytest.raises(PlannerError, match="its step runs only on real tensors"):
        fp.plan(model, (x,), cluster="h100:8", tp=2)


def test_apply_plan_checks_its_arguments_and_takes_a_meta_model():
    """A plan's path, a model sharded already or a string mesh were AttributeErrors and torch's AssertionError from
    inside FSDP2; a model built on meta (to be materialized after sharding) got a mesh of device type "meta", which
    FSDP2 has no device module for (a trial of the API)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    lm = load_model("toy-llama", meta=True)
    plan = fp.plan("toy-llama", policy="titan", cluster="h100:2")
    with pytest.raises(PlannerError, match=r"^apply_plan's plan must be a Plan, not a path: Plan\.load\('p\.json'\)"):
        fp.apply_plan(lm.model, "p.json")  # type: ignore[arg-type]
    with pytest.raises(PlannerError, match=r"^apply_plan's mesh must be a DeviceMesh or None, not str$"):
        fp.apply_plan(lm.model, plan, mesh="cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        fp.apply_plan(lm.model, plan)  # on meta, no mesh given
        assert all(p.is_meta for p in lm.model.parameters())
        with pytest.raises(PlannerError, match=r"^apply_plan shards a model once: .* is sharded already"):
            fp.apply_plan(lm.model, plan)
    finally:
        dist.destroy_process_group()


def test_a_compiled_plan_on_an_eager_trace_warns_and_a_compiled_trace_gives_the_cli_figures(capsys, tmp_path):
    """``simulate`` of a compiled plan on ``trace``'s eager step gave eager figures without a word, and ``trace``
    had no way to trace the blocks compiled (a trial): it warns now, and ``trace(..., compile=True)`` gives
    ``simulate --plan --compile``'s figures."""
    import warnings

    lm = load_model("toy-llama", meta=True)
    plan = fp.plan("toy-llama", cluster="h100:8", policy="titan", ac="op", compile=True)
    with pytest.warns(UserWarning, match=r"^the plan compiles 4 modules and the trace took them eager: add compile "
                                         r"for the figures it was planned with; compile, compile_loss and "
                                         r"loss_chunks are keywords of trace\(\)$"):
        eager = fp.simulate(fp.trace(lm.model, lm.example_inputs, lm.loss_fn), plan, "h100:8", timeline=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = fp.simulate(fp.trace(lm.model, lm.example_inputs, lm.loss_fn, compile=True), plan, "h100:8",
                               timeline=False)
    plan.save(tmp_path / "plan.json")
    assert cli.main(["simulate", "toy-llama", "--plan", str(tmp_path / "plan.json"), "--compile", "--cluster",
                     "h100:8", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert compiled.step_time == pytest.approx(said["step_time"]) and compiled.peak_memory == said["peak_memory"]
    assert compiled.step_time < eager.step_time
    with pytest.raises(PlannerError, match="leave reuse=True"):
        fp.trace(lm.model, lm.example_inputs, lm.loss_fn, reuse=False, compile=True)
    with pytest.raises(PlannerError, match=r"^loss_chunks must be a whole number from 2 to "):  # (the API's name)
        fp.trace(lm.model, lm.example_inputs, lm.loss_fn, loss_chunks=1)


def test_simulate_trace_and_policies_refuse_what_the_command_line_refuses():
    """A trial of the API: an int reshard_after_forward FSDP2 refuses on the cluster's ranks (simulate and
    plan_metrics gave figures where simulate --plan and check refuse it), a routing capacity of NaN (a ValueError
    from inside the routing) and values past the command line's bounds were taken."""
    from fsdp_planner.models import load_model

    lm = load_model("toy-llama")
    tr = fp.trace(lm.model, lm.example_inputs, lm.loss_fn)
    three = fp.TorchtitanPolicy().plan(tr).with_every_group(reshard_after_forward=3)
    with pytest.raises(PlannerError, match="reshard_after_forward=3, which FSDP2 needs to divide the world size of 8"):
        fp.simulate(tr, three, "h100:8")
    with pytest.raises(PlannerError, match="reshard_after_forward=3, which FSDP2 needs to divide the world size of 8"):
        fp.plan_metrics(tr, three, world_size=8)
    assert fp.simulate(tr, three.with_every_group(reshard_after_forward=2), "h100:8").step_time > 0
    with pytest.raises(PlannerError, match=r"^trace's routing must be a capacity factor from 0\.1 to 64, got nan"):
        fp.trace(lm.model, lm.example_inputs, lm.loss_fn, routing=float("nan"))
    with pytest.raises(PlannerError, match=r"^the search effort is a number of plans: 0 to 1,000,000,000"):
        fp.AutoPolicy("h100:8", search_effort=10**12)
    with pytest.raises(PlannerError, match="at most 1 EiB"):
        fp.AutoPolicy("h100:8", memory_budget=10**30)
