"""Per-group mixed precision (issue 39, item 5): a model whose BatchNorms fail in bf16 (FSDP2 casts their weights,
not their fp32 running stats) is planned under bf16-mixed with those modules in fp32 groups of their own
(``Group.param_dtype``), sized, applied, exported and verified so."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import gathers_by_group, policy

from fsdp_planner import cli
from fsdp_planner.apply.export import export_plan
from fsdp_planner.choices import ExportFormat
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.checkpointing import ACMode, checkpointed_blocks
from fsdp_planner.fsdp2.claim import check_plan_matches, with_claimed_params
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import AutoPolicy, PolicyRequest, make_policy
from fsdp_planner.runtime.fake_world import run_fake_world
from fsdp_planner.runtime.verify import run_verify
from fsdp_planner.sim.options import PRECISIONS, SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.sim.sizing import Sizing
from fsdp_planner.sim.tracing import trace

RESNET = str(Path(__file__).parent / "fixtures" / "resnet_models.py") + ":build"


@pytest.fixture(scope="module")
def resnet():
    lm = load_model(RESNET)
    return trace(lm.model, lm.example_inputs, lm.loss_fn, precision="bf16-mixed")


def batchnorms(tr) -> set[str]:
    return {name for name, info in tr.modules.items() if info.cls == "BatchNorm2d"}


def test_group_param_dtype_round_trips_and_old_plans_read_unchanged():
    plan = Plan([Group(["a"], ["a.w"], param_dtype="fp32"), Group(["b"], ["b.w"]), Group([""], [], False)], "f", 2)
    data = json.loads(plan.to_json())
    assert data["groups"][0]["param_dtype"] == "fp32" and "param_dtype" not in data["groups"][1]
    assert Plan.from_json(plan.to_json()) == plan
    old = {**data, "groups": [{k: v for k, v in g.items() if k != "param_dtype"} for g in data["groups"]]}
    assert [g.param_dtype for g in Plan.from_json(json.dumps(old)).groups] == ["", "", ""]
    assert plan.signature() != plan.with_group(0, param_dtype="").signature()


@pytest.mark.parametrize("bad", ["bf16", "float32", 32, None])
def test_a_bad_group_param_dtype_is_one_clear_error(bad):
    text = json.dumps({"version": 1, "model": {}, "groups": [{"modules": ["a"], "param_dtype": bad}]})
    with pytest.raises(PlannerError, match=r"plan group 0: param_dtype must be fp32 .* or absent"):
        Plan.from_json(text)


def test_batchnorms_are_traced_in_fp32_and_gathered_in_fp32(resnet):
    assert set(resnet.full_precision) == batchnorms(resnet) and len(resnet.full_precision) == 15
    assert any("fp32 groups of their own" in n for n in resnet.notes)
    fp32 = resnet.full_precision_params
    assert {resnet.params[i].fqn.rsplit(".", 1)[0] for i in fp32} == batchnorms(resnet)
    sizing = Sizing(resnet, 2, PRECISIONS["bf16-mixed"])
    for i, p in enumerate(resnet.params):  # BatchNorm's all-gather in fp32, the convs' and fc's in bf16
        assert sizing.gather_bytes([i]) == p.padded_numel(2) * (4 if i in fp32 else 2)
        assert sizing.grad_bytes((i,)) == p.numel * (4 if i in fp32 else 2)


def test_fp32_trace_keeps_nothing_apart():
    lm = load_model(RESNET)
    tr = trace(lm.model, lm.example_inputs, lm.loss_fn, precision="fp32")
    assert tr.full_precision == () and not tr.full_precision_params


@pytest.mark.parametrize("name", ["titan", "order", "module", "size"])
def test_classic_policies_put_every_batchnorm_in_an_fp32_group_of_its_own(resnet, name):
    plan = policy(name, min_nonwrapped_numel=500).plan(resnet, RESNET)
    fp32 = [g for g in plan.groups if g.param_dtype == "fp32"]
    assert fp32 and not plan.root.param_dtype
    index = resnet.index.param_index
    assert {p for g in fp32 for p in g.params} == {resnet.params[i].fqn for i in resnet.full_precision_params}
    assert all(index[p] not in resnet.full_precision_params for g in plan.groups if not g.param_dtype
               for p in g.params)
    check_plan_matches(plan, resnet)


def test_size_leaves_the_root_what_has_its_dtype(resnet):
    """size wraps nothing in the ResNet (4,430 params): the BatchNorms' fp32 group, and every other param the root's
    (the inner convs were carved out as a group of their own beside the BatchNorms, a trial's finding)."""
    plan = policy("size").plan(resnet, RESNET)
    assert [g.param_dtype for g in plan.inner_groups] == ["fp32"]
    fp32 = set(plan.inner_groups[0].params)
    assert set(plan.root.params) == {p.fqn for p in resnet.params} - fp32
    check_plan_matches(plan, resnet)


def test_a_plan_mixing_batchnorm_into_a_compute_dtype_group_is_refused(resnet):
    plan = policy("order").plan(resnet, RESNET)
    i = next(i for i, g in enumerate(plan.groups) if g.param_dtype == "fp32")
    with pytest.raises(PlannerError, match=rf"group {i} .* must run in fp32: give them groups of their own"):
        check_plan_matches(plan.with_group(i, param_dtype=""), resnet)
    j = next(i for i, g in enumerate(plan.inner_groups) if not g.param_dtype)
    with pytest.raises(PlannerError, match=rf"group {j} .* has param_dtype fp32 but holds params of modules that "):
        check_plan_matches(plan.with_group(j, param_dtype="fp32"), resnet)


def test_a_hand_edited_plan_without_the_fp32_groups_gets_a_note_that_agrees_with_its_refusal(capsys, tmp_path):
    """The trace's note comes before the plan is read: it says what every plan must do, not that this one does."""
    out = tmp_path / "p.json"
    assert cli.main(["plan", RESNET, "--policy", "order", "--out", str(out), "--json"]) == 0
    data = json.loads(out.read_text())
    data["groups"] = [{k: v for k, v in g.items() if k != "param_dtype"} for g in data["groups"]]
    out.write_text(json.dumps(data))
    capsys.readouterr()
    for command in (["simulate", "--cluster", "h100:8"], ["verify", "--nproc", "2"]):
        assert cli.main([command[0], RESNET, "--plan", str(out), *command[1:]]) == 2
        captured = capsys.readouterr()
        note, error = captured.err.strip().splitlines()
        assert "they need fp32 groups of their own" in note and "a --plan file must too" in note
        assert "they run in" not in note and error.startswith("error: group ") and "must run in fp32" in error
        assert "verifying" not in captured.out


@pytest.mark.parametrize("where", [["--nproc", "2"], ["--fake-world-size", "4", "--cluster", "h100:4"]])
def test_verify_refuses_pure_bf16_on_fp32_params_before_anything_runs(capsys, where):
    assert cli.main(["verify", RESNET, "--precision", "pure-bf16", "--policy", "auto", *where]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("error: precision 'pure-bf16' stores params in bfloat16 but the model builds them "
                                    "in float32: build the model in that dtype or pick a precision that matches it "
                                    "(--precision)")  # one line: no note of the trace, which never ran
    assert captured.out == ""  # neither "verifying ..." nor "running ...": no job started


def test_auto_plans_batchnorm_in_fp32_groups_and_export_writes_their_policy(resnet):
    plan = AutoPolicy(parse_cluster("h100:8")).plan(resnet, RESNET)
    fp32 = [g for g in plan.inner_groups if g.param_dtype == "fp32"]
    assert {p for g in fp32 for p in g.params} == {resnet.params[i].fqn for i in resnet.full_precision_params}
    source = export_plan(plan, ExportFormat.PYTHON, PRECISIONS["bf16-mixed"])
    listed = [i for i, g in enumerate(plan.inner_groups) if g.param_dtype == "fp32"]
    assert f"FP32_GROUPS: list[int] = {listed}" in source and "def full_precision(" in source
    compile(source, "export.py", "exec")
    plain = export_plan(plan.replace(groups=[Group(g.modules, g.params, g.reshard_after_forward) for g in plan.groups]),
                        ExportFormat.PYTHON, PRECISIONS["bf16-mixed"])
    assert "FP32_GROUPS" not in plain and "full_precision" not in plain


def test_per_block_checkpointing_keeps_the_fp32_groups_inside_the_blocks(resnet):
    """--ac full checkpoints every bottleneck though its BatchNorms' fp32 group lies inside it (FSDP2 runs their
    hooks again in the recomputation, which the replay models): titan's plan and auto's (which dropped the
    checkpointing of any block a group lay inside)."""
    blocks = checkpointed_blocks(resnet, ACMode.FULL)
    titan = make_policy(PolicyRequest.named("titan", checkpointing=ACMode.FULL)).plan(resnet, RESNET)
    auto = AutoPolicy(parse_cluster("h100:8"), checkpointing=ACMode.FULL).plan(resnet, RESNET)
    for plan in (titan, auto):
        assert list(plan.activation_checkpointing) == blocks == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
        assert any(g.param_dtype == "fp32" and any(m.startswith("layer1.0.") for m in g.modules) for g in plan.groups)
        check_plan_matches(plan, resnet)


@pytest.mark.integration  # ~20 s (loaded): a torchrun job of 2 gloo ranks, then real FSDP2 on 4 fake ranks
def test_resnet_plan_with_fp32_batchnorm_groups_trains_on_2_gloo_ranks_with_parity(resnet):
    """Under bf16-mixed: auto's plan with every block checkpointed in full (its BatchNorms in an fp32 group that
    lies inside them) all-gathers them in fp32, the counts and bytes as predicted, and its params stay within bf16
    steps of an unsharded reference that runs those modules in fp32 too; on 4 fake ranks titan's plan (an fp32
    group beside each block's), with and without the blocks checkpointed, has real FSDP2's counts and bytes."""
    plan = AutoPolicy(parse_cluster("h100:8"), checkpointing=ACMode.FULL).plan(resnet, RESNET)
    assert any(g.param_dtype == "fp32" for g in plan.groups) and plan.activation_checkpointing
    result = run_verify(RESNET, resnet, plan, nproc=2, steps=2, precision="bf16-mixed")
    assert result.ok, (result.counted, result.predicted, result.max_abs_diff)
    assert result.counted == [result.predicted] * 2 and result.counted_bytes == [result.predicted_bytes] * 2
    assert result.losses == pytest.approx(result.reference_losses, rel=1e-2)
    options = SimOptions.named("bf16-mixed")
    for ac in (ACMode.NONE, ACMode.FULL):
        plan = make_policy(PolicyRequest.named("titan", checkpointing=ac)).plan(resnet, RESNET)
        predicted = simulate(resnet, plan, parse_cluster("h100:4"), options, timeline=False)
        measured = run_fake_world(RESNET, plan, 4, options.precision)
        assert measured.counts == {"all_gather": predicted.all_gathers, "reduce_scatter": predicted.reduce_scatters,
                                   "all_reduce": 0}
        assert (measured.nbytes["all_gather"], measured.nbytes["reduce_scatter"]) == \
            (predicted.all_gather_bytes, predicted.reduce_scatter_bytes)
    as_bf16 = simulate(dataclasses.replace(resnet, full_precision=()), plan, parse_cluster("h100:4"), options,
                       timeline=False)  # the BatchNorms counted in bf16: what the fp32 bytes correct
    assert as_bf16.all_gather_bytes < measured.nbytes["all_gather"]


def test_a_module_the_user_keeps_in_fp32_gets_an_fp32_group_and_is_gathered_in_fp32():
    """A router kept in fp32, as torchtitan keeps MoE routers: traced in fp32 (its output back in bf16 for the next
    Linear), its own fp32 group in every plan, its all-gather 4 bytes a param."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)).to("meta")
    x = torch.randn(4, 16, device="meta")
    tr = trace(model, (x,), precision="bf16-mixed", fp32_modules=["1"])
    assert tr.full_precision == ("1",)
    plan = policy("module", module_classes=("Linear",)).plan(tr)
    assert [g.modules for g in plan.groups if g.param_dtype == "fp32"] == [("1",)]
    sizing = Sizing(tr, 1, PRECISIONS["bf16-mixed"])
    assert [sizing.gather_bytes([tr.index.param_index[p]]) for p in ("0.weight", "1.weight")] == [512 * 2, 1024 * 4]
    assert trace(model, (x,), precision="fp32", fp32_modules=["1"]).full_precision == ()  # nothing to keep apart


@pytest.mark.parametrize(("names", "match"), [(["9"], "'9' is not a submodule"), ([""], "'' is not a submodule"),
                                              (["2", "missing.x"], "'missing.x' is not a submodule")])
def test_fp32_modules_must_be_submodules_with_params(names, match):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).to("meta")
    with pytest.raises(PlannerError, match=match):
        trace(model, (torch.randn(2, 4, device="meta"),), fp32_modules=names)
    with pytest.raises(PlannerError, match="module '1' holds no trainable params"):
        trace(model, (torch.randn(2, 4, device="meta"),), fp32_modules=["1"])


class Jittered(nn.Linear):
    """A router that scales its input by noise in place in training, as Phi-MoE's does with its jitter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x *= 1.01
        return super().forward(x)


def test_a_module_kept_in_fp32_that_modifies_its_inputs_in_place_is_refused():
    """fully_shard on such a module breaks (its inputs pass through FSDP2's autograd function), so it cannot have
    the fp32 group of its own: the plan left it, silently, in the group above computing in bf16 (a new user's
    Phi-3.5-MoE with its routers in fp32, a verify FAIL on the all-gather bytes)."""
    model = nn.Sequential(nn.Linear(16, 16), Jittered(16, 16), nn.Linear(16, 4)).to("meta")
    x = torch.randn(4, 16, device="meta")
    with pytest.raises(PlannerError, match=r"fp32_modules: '1' cannot have the FSDP2 group of its own.*in place"):
        trace(model, (x,), precision="bf16-mixed", fp32_modules=["1"])
    assert trace(model, (x,), precision="bf16-mixed", fp32_modules=["2"]).full_precision == ("2",)
    assert trace(model, (x,), precision="fp32", fp32_modules=["1"]).full_precision == ()  # nothing kept apart
    holder = nn.Sequential(nn.Linear(16, 16), _Holder(), nn.Linear(16, 4)).to("meta")  # its own param and a child
    with pytest.raises(PlannerError, match=r"fp32_modules: '1' cannot have"):
        trace(holder, (x,), precision="bf16-mixed", fp32_modules=["1"])


class _Holder(nn.Module):
    """A module that modifies its input in place, with a param of its own beside a child's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.inner = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x *= 1.01
        return self.inner(x) * self.scale


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate(x).float(), dim=-1).to(x.dtype) @ torch.ones(4, 16, dtype=x.dtype,
                                                                                     device=x.device)


def test_an_fp32_group_shards_exactly_the_modules_traced_in_fp32_whatever_the_policy_lists():
    """The hooks that cast must sit where the trace cast: a policy listing the gate (inside the kept router) or the
    block (above it) gets the router itself as its fp32 group's target."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(Router(), nn.Linear(16, 16))).to("meta")
    tr = trace(model, (torch.randn(4, 16, device="meta"),), precision="bf16-mixed", fp32_modules=("1.0",))
    for classes in (("Linear",), ("Sequential",)):
        plan = policy("module", module_classes=classes).plan(tr)
        assert [g.modules for g in plan.groups if g.param_dtype == "fp32"] == [("1.0",)], classes
        check_plan_matches(plan, tr)


def test_fp32_modules_as_the_cli_and_the_api_give_them():
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.validate import Spelling, fp32_modules

    assert fp32_modules("a.router, b.router,a.router", Spelling.CLI) == ("a.router", "b.router")
    assert fp32_modules(["x"], Spelling.API) == ("x",) and fp32_modules(None, Spelling.API) == ()
    with pytest.raises(PlannerError, match="--fp32-modules ' , ' names no module"):
        fp32_modules(" , ", Spelling.CLI)
    with pytest.raises(PlannerError, match="fp32_modules"):
        fp32_modules(3, Spelling.API)
    spec = ModelSpec("toy-llama", fp32_modules=("layers.0.attention.wq",))
    assert ModelSpec.from_json(spec.to_json()) == spec and "fp32_modules" not in ModelSpec("toy-llama").to_json()


def test_a_module_adding_an_fp32_buffer_to_activations_gets_fp32_groups():
    """The step fails in the Linear after ``Shift`` (its fp32 sum reaches a bf16 weight); the module before it that
    holds a floating buffer is kept in fp32 instead, its output cast back, and the step runs."""
    lm = load_model(str(Path(__file__).parent / "fixtures" / "fp32_buffer_models.py") + ":build")
    tr = trace(lm.model, lm.example_inputs, lm.loss_fn, precision="bf16-mixed")
    assert tr.full_precision == ("blocks.0.1", "blocks.1.1", "blocks.2.1")
    assert any("(Shift) fail in the compute dtype" in n for n in tr.notes)
    plan = policy("order").plan(tr)
    assert sorted(g.modules for g in plan.groups if g.param_dtype == "fp32") == [
        ("blocks.0.1",), ("blocks.1.1",), ("blocks.2.1",)]


@pytest.mark.parametrize("name", ["order", "size", "module"])
def test_a_kept_parent_whose_pieces_several_groups_list_is_sharded_once(name):
    """A U-Net whose decoder stages build an fp32 tensor in forward, run in fp32 as the refusal suggests: the
    policies list the stages' convs in several groups, and each stage is one fp32 group all the same."""
    lm = load_model(str(Path(__file__).parent / "fixtures" / "precision_models.py") + ":unet_conv")
    tr = trace(lm.model, lm.example_inputs, lm.loss_fn, precision="bf16-mixed", fp32_modules=("up2", "up1"))
    plan = policy(name, min_nonwrapped_numel=2000, module_classes=("Conv2d",)).plan(tr)
    assert sorted(g.modules for g in plan.groups if g.param_dtype == "fp32") == [("up1",), ("up2",)]
    check_plan_matches(plan, tr)


def test_the_python_api_plans_the_modules_it_is_told_to_keep_in_fp32():
    import fsdp_planner

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    plan = fsdp_planner.plan(model, (torch.randn(4, 16),), policy="order", fp32_modules=("1",))
    assert [g.modules for g in plan.groups if g.param_dtype == "fp32"] == [("1",)]
    assert not any(g.param_dtype for g in fsdp_planner.plan(model, (torch.randn(4, 16),), policy="order").groups)


def test_an_fp32_groups_matmuls_run_at_fp32s_peak():
    """Two identical Linears, the second kept in fp32 (a router as torchtitan keeps them): under bf16-mixed its
    forward matmul is timed at the GPU's fp32 peak, the first at bf16's (it was bf16's for both)."""
    from fsdp_planner.hardware.cluster import Compute
    from fsdp_planner.sim.compute import op_times
    from fsdp_planner.trace.events import ATTENTION_KERNELS

    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
    tr = trace(model, (torch.randn(4096, 1024),), lambda out: out.float().square().mean(), fp32_modules=["1"])
    assert tr.full_precision == ("1",)
    gpu = parse_cluster("h100:8").gpu
    compute = Compute(matmul_efficiency=1.0, matmul_half_dim=0.0, attention_efficiency=1.0, memory_efficiency=1.0)
    times = op_times(tr, gpu, PRECISIONS["bf16-mixed"], compute)
    forward = {e.module: times[i] for i, e in enumerate(tr.events)
               if e.is_op and not e.backward and e.flops and e.kernel != 0 and e.kernel not in ATTENTION_KERNELS}
    assert forward["0"] == pytest.approx(2 * 4096 * 1024**2 / gpu.peak_bf16_flops, rel=1e-6)
    assert forward["1"] == pytest.approx(2 * 4096 * 1024**2 / gpu.peak_fp32_flops, rel=1e-6)


@pytest.mark.integration  # ~3.5 s (loaded): real FSDP2 on 2 fake ranks with real CPU tensors
def test_exported_code_checkpoints_the_blocks_around_their_fp32_groups(resnet):
    """titan's --ac full plan exported as Python and applied to the real ResNet with real FSDP2 on 2 ranks of the
    fake process group: each block's forward runs again in backward (its convs called twice), its BatchNorms compute
    in fp32 (their own group's policy) both times, and FSDP2 issues the all-gathers the replay says, group by group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plan = make_policy(PolicyRequest.named("titan", checkpointing=ACMode.FULL)).plan(resnet, RESNET)
    scope: dict = {}
    exec(compile(export_plan(plan, ExportFormat.PYTHON, PRECISIONS["bf16-mixed"]), "exported.py", "exec"), scope)
    model = load_model(RESNET, meta=False).model
    calls, dtypes = [], set()
    model.layer1[0].conv1.register_forward_pre_hook(lambda m, args: calls.append(args[0].dtype))
    model.layer1[0].bn1.register_forward_pre_hook(lambda m, args: dtypes.add((m.weight.dtype, args[0].dtype)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        scope["apply"](model, init_device_mesh("cpu", (2,)))
        with gathers_by_group(plan) as issued:
            model(torch.randn(4, 3, 16, 16)).float().pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    assert calls == [torch.bfloat16] * 2 and dtypes == {(torch.float32, torch.float32)}
    assert issued == [c.group for c in build_schedule(resnet, plan, 2).collectives
                      if c.kind is CollectiveKind.ALL_GATHER]


def test_a_plan_grouping_batchnorms_with_their_convs_is_refused_and_check_says_why(resnet, tmp_path, capsys):
    """A hand plan listing whole residual blocks puts each block's BatchNorms in a compute-dtype group with its
    convs: the first step crashes in the BatchNorm kernel (a trial ran it to that RuntimeError after simulate and
    check had passed it). Refused, and ``check`` reports each such group as an error finding."""
    blocks = sorted({".".join(bn.split(".")[:2]) for bn in batchnorms(resnet) if bn.count(".") >= 2})
    plan = with_claimed_params(Plan([*(Group([b]) for b in blocks), Group([""])], "", 0), resnet)
    with pytest.raises(PlannerError, match=r"group 0 \(layer1\.0\) holds params of layer1\.0\.bn1, layer1\.0\.bn2.* "
                                           r"must run in fp32"):
        check_plan_matches(plan, resnet)
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps({"version": 1, "groups": [[b] for b in blocks]}))
    assert cli.main(["check", RESNET, "--plan", str(path), "--json"]) == 1
    findings = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "precision"]
    assert [f["module"] for f in findings] == [*(f"{b}.bn1" for b in blocks), "bn1"]  # the stem's: on the root
