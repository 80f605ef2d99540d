"""Float32 activations under bf16-mixed (``trace/input_casts.py``, ``fsdp2/input_casts.py``): a model adding a
float32 position table to its embeddings runs under FSDP2 only because the first block's group casts its inputs,
so the trace casts where a group could, names the module, and every plan lists it; a plan that does not is
refused, as real FSDP2 fails it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import policy

from fsdp_planner import cli
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches, hooked_by, with_claimed_params
from fsdp_planner.fsdp2.dtypes import full_precision_modules_in
from fsdp_planner.fsdp2.input_casts import UncastInputsError
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import AutoPolicy
from fsdp_planner.sim.tracing import PrecisionError, trace
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.tree import ROOT

MODELS = str(Path(__file__).parent / "fixtures" / "fp32_activation_models.py")
BUILD = f"{MODELS}:build"


def traced(factory: str = "build", precision: str = "bf16-mixed"):
    lm = load_model(f"{MODELS}:{factory}")
    return trace(lm.model, lm.example_inputs, lm.loss_fn, precision=precision)


@pytest.fixture(scope="module")
def sinusoid():
    return traced()


def test_the_first_block_gets_the_cast_and_the_trace_says_so(sinusoid):
    assert sinusoid.cast_inputs == ("blocks.0",)
    assert any("'blocks.0' gets float32 activations" in n for n in sinusoid.notes)
    assert traced(precision="fp32").cast_inputs == ()  # nothing to cast in the model's own dtype


def test_the_blocks_compute_in_bf16_after_the_cast(sinusoid):
    """The block's matmuls run on bf16 operands: its forward mm outputs are half an fp32 trace's bytes."""
    fp32 = traced(precision="fp32")

    def block_mm_bytes(tr):
        return sum(e.out_nbytes for e in tr.events if e.kind is EventKind.OP and not e.backward and e.flops
                   and e.module.startswith("blocks.") and e.module.endswith(("fc1", "fc2")))
    assert block_mm_bytes(sinusoid) * 2 == block_mm_bytes(fp32) > 0


def test_a_position_module_with_a_dropout_puts_the_cast_on_the_block_not_the_dropout():
    """The dropout holds no params (no group can list it): the float32 sum passes it to the first block."""
    assert traced("build_module").cast_inputs == ("blocks.0",)


def test_a_float32_matmul_in_the_root_forward_is_still_refused():
    with pytest.raises(PrecisionError, match=r"aten\.mm at the model's top level"):
        traced("build_uncastable")


@pytest.mark.parametrize("name", ["titan", "module", "order", "size"])
def test_every_policy_hooks_the_block(sinusoid, name):
    plan = policy(name).plan(sinusoid, BUILD)
    assert "blocks.0" in hooked_by(plan, sinusoid)


def test_auto_hooks_the_block_even_where_a_cut_wraps_every_module_below_it(sinusoid):
    """Wrapping every param-owning module alone leaves blocks.0 nothing to manage: its group hooks it without
    params, and the search ends in a plan that hooks it."""
    result = AutoPolicy(parse_cluster("h100:8")).search(sinusoid, BUILD)
    assert "blocks.0" in hooked_by(result.plan, sinusoid)


def _hand_plan(tr, groups):
    return with_claimed_params(Plan([*(Group(g) for g in groups), Group([ROOT])], "", 0), tr)


def test_a_plan_that_lists_a_piece_of_the_block_but_not_the_block_is_refused(sinusoid):
    bad = _hand_plan(sinusoid, [["blocks.0.fc1"], ["blocks.1"]])
    with pytest.raises(UncastInputsError, match=r"'blocks.0' gets float32 activations.*no group of the plan hooks"):
        check_plan_matches(bad, sinusoid)
    check_plan_matches(_hand_plan(sinusoid, [["emb", "blocks.1"], ["blocks.0"]]), sinusoid)  # listed, so hooked


def test_the_cli_refuses_such_a_plan_file_and_check_names_the_module(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 1, "groups": [{"modules": ["blocks.0.fc1"]}, {"modules": [""]}]}))
    assert cli.main(["simulate", BUILD, "--plan", str(path), "--precision", "bf16-mixed", "--cluster", "h100:8"]) == 2
    err = capsys.readouterr().err
    assert "error: 'blocks.0' gets float32 activations" in err and "Traceback" not in err
    assert cli.main(["check", BUILD, "--plan", str(path), "--precision", "bf16-mixed", "--json"]) == 1
    findings = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "precision"]
    assert [(f["module"], f["fix"]) for f in findings] == [
        ("blocks.0", "give it a group (fully_shard(model.blocks[0]), one without params of its own is fine)")]


def _real_fsdp2_step(listed: list[str]) -> None:
    """One bf16-mixed forward and backward of the model with real FSDP2 on 2 fake ranks, a group per name."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    lm = load_model(BUILD, meta=False)
    model, (ids,) = lm.model, lm.example_inputs
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        for name in listed:
            fully_shard(model.get_submodule(name), mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model(ids).float().pow(2).mean().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.integration  # ~2 s: real FSDP2 on 2 fake ranks with real CPU tensors, twice
def test_real_fsdp2_runs_the_step_only_where_a_group_lists_the_block():
    """The oracle of the rule: with blocks.0 listed the step runs; with only its fc1 listed the float32 sum reaches
    its LayerNorm uncast and the CPU kernel refuses it, as the plan check does."""
    _real_fsdp2_step(["blocks.0", "blocks.1"])
    with pytest.raises(RuntimeError, match="mixed dtype"):
        _real_fsdp2_step(["blocks.0.fc1", "blocks.1"])


@pytest.mark.integration  # ~25 s (loaded): a torchrun job of 2 gloo ranks, then real FSDP2 on 4 fake ranks
@pytest.mark.parametrize("where", [["--nproc", "2"], ["--fake-world-size", "4", "--cluster", "h100:4"]])
def test_verify_passes_the_size_policy_that_only_the_added_group_makes_run(where, capsys):
    """size(100M) wraps nothing: the plan is blocks.0's added group and the root, and trains so."""
    assert cli.main(["verify", BUILD, "--policy", "size", "--precision", "bf16-mixed", *where]) == 0, \
        capsys.readouterr()
    assert "PASS" in capsys.readouterr().out


def test_a_float32_channel_concatenated_before_a_conv_module_is_cast_at_that_conv():
    """A U-Net's decoder concatenating a float32 coordinate channel: each fuse conv gets the cast (where the
    channel is built inside the conv's own forward no cast reaches it: ``test_precision.py``)."""
    lm = load_model(str(Path(__file__).parent / "fixtures" / "precision_models.py") + ":unet_conv")
    tr = trace(lm.model, lm.example_inputs, lm.loss_fn, precision="bf16-mixed")
    assert tr.cast_inputs == ("up2.fuse", "up1.fuse")
    plan = policy("order").plan(tr)
    assert {"up2.fuse", "up1.fuse"} <= hooked_by(plan, tr)


@pytest.mark.parametrize("name", ["titan", "module", "order", "size", "auto"])
def test_a_sequential_trunk_gets_a_group_without_params_where_the_policy_groups_its_blocks(name):
    """The Sequential holding the blocks gets the float32 sum: a policy grouping its blocks one by one leaves it
    nothing to manage, and its group hooks it all the same (real FSDP2 runs fully_shard on a module without params
    of its own: ``test_verify_passes_...``); order and auto keep the blocks apart (they made one group of the
    trunk when it had to be listed whole)."""
    tr = traced("build_sequential")
    assert tr.cast_inputs == ("blocks",)
    plan = AutoPolicy(parse_cluster("h100:8")).search(tr, BUILD).plan if name == "auto" else policy(name).plan(tr)
    assert "blocks" in hooked_by(plan, tr)
    if name in ("titan", "order"):
        assert [g.params for g in plan.groups if g.modules == ("blocks",)] == [()]
        assert {f"blocks.{i}" for i in range(4)} <= {m for g in plan.groups for m in g.modules}


@pytest.mark.parametrize("name", ["titan", "module", "order", "size"])
def test_a_conv_bn_sequential_getting_float32_keeps_its_batchnorms_in_fp32_groups_not_the_root(name):
    """The module policy (Conv2d) left the BatchNorms nested in Sequentials to the root, which computes in bf16
    (a crash the plan check refuses); every policy now gives them fp32 groups and hooks the Sequential."""
    tr = traced("build_conv_bn")
    assert tr.cast_inputs == ("fuse",) and set(tr.full_precision) == {"fuse.1", "mix.1"}
    plan = policy(name).plan(tr)
    check_plan_matches(plan, tr)
    assert "fuse" in hooked_by(plan, tr) and not full_precision_modules_in(tr, plan.root.params)


def test_pure_bf16_converts_the_model_whole_and_casts_nothing_in_forward():
    """pure-bf16 stores the model in bf16 (built in fp32, it is converted: model.to(torch.bfloat16), its position
    table with it) and runs FSDP2 without a param_dtype, so no pre-forward casts; a float32 tensor the forward
    builds itself then fails the step, as it would (a reviewer's finding: the cast was assumed there)."""
    tr = traced(precision="pure-bf16")
    assert tr.cast_inputs == () and tr.buffers_nbytes == traced(precision="bf16-mixed").buffers_nbytes // 2
    lm = load_model(str(Path(__file__).parent / "fixtures" / "precision_models.py") + ":unet_matmul")
    with pytest.raises(PrecisionError, match=r"'pure-bf16'.*aten\.bmm in module 'mix'"):
        trace(lm.model, lm.example_inputs, lm.loss_fn, precision="pure-bf16")


@pytest.mark.integration  # ~30 s (loaded): torchrun jobs of 2 gloo ranks
@pytest.mark.parametrize(("factory", "name"), [("build_sequential", "titan"), ("build_conv_bn", "module")])
def test_verify_passes_the_groups_without_params_that_hook_a_cast_module(factory, name, capsys):
    assert cli.main(["verify", f"{MODELS}:{factory}", "--policy", name, "--precision", "bf16-mixed",
                     "--nproc", "2"]) == 0, capsys.readouterr()
    assert "PASS" in capsys.readouterr().out


def test_a_group_inside_a_compiled_block_is_refused():
    """A trial's model adding its position table inside each block: titan hooks each block's norm with a group of
    its own, which --compile would put inside the block's fullgraph compile, where Dynamo refuses FSDP2's hooks
    ("Attempted to call function marked as skipped" on the ranks). Refused before any run."""
    from fsdp_planner.fsdp2.validity import check_compiled_groups

    plan = _hand_plan(traced(), [["blocks.0.norm"], ["blocks.0"], ["blocks.1"]])
    check_compiled_groups(plan, ())
    check_compiled_groups(plan, ("blocks.1",))
    with pytest.raises(PlannerError, match=r"group \d lists 'blocks.0.norm', inside the block 'blocks.0' that "
                                           r"--compile compiles whole"):
        check_compiled_groups(plan, ("blocks.0", "blocks.1"))


@pytest.mark.parametrize("name", ["titan", "module", "order", "size"])
def test_a_cast_module_listed_beside_a_module_above_it_gets_a_group_of_its_own(name):
    """The blocks' fc2 get float32 activations (a float32 mask), and a block owns a param itself: a group listing
    the block beside its pieces hooks the block only, so fc2 is taken out into a group of its own (order and auto
    refused the model: "the policy's groups leave them unhooked", a new user's trial)."""
    tr = traced("build_masked")
    assert set(tr.cast_inputs) >= {"1.fc2", "2.fc2", "3.fc2"}
    plan = policy(name).plan(tr, f"{MODELS}:build_masked")
    assert set(tr.cast_inputs) <= hooked_by(plan, tr)
    result = AutoPolicy(parse_cluster("h100:8")).search(tr, f"{MODELS}:build_masked")
    assert set(tr.cast_inputs) <= hooked_by(result.plan, tr)
