from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import traced

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import (
    application_order,
    check_plan_matches,
    make_plan,
    validate_plan,
    with_claimed_params,
)
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.models import load_model
from fsdp_planner.planners import ExecutionOrderPolicy, SizeBasedPolicy
from fsdp_planner.trace import record


def test_json_round_trip_has_the_documented_shape(seed_trace):
    plan = SizeBasedPolicy(2000).plan(seed_trace, "seed-net")
    data = json.loads(plan.to_json())
    assert data["version"] == 1
    assert data["model"]["fingerprint"] == seed_trace.fingerprint and data["model"]["numel"] == seed_trace.numel
    assert set(data["groups"][0]) >= {"modules", "params", "reshard_after_forward"}
    back = Plan.from_json(plan.to_json())
    check_plan_matches(back, seed_trace)
    assert [g.to_dict() for g in back.groups] == [g.to_dict() for g in plan.groups]



def test_a_plan_records_the_workload_it_was_made_for(tmp_path, capsys):
    """``plan --out`` writes the step the plan was judged at (2 micro-batches of 2) and reads it back; a model whose
    batch is unknown (a factory's inputs) has none; a workload that is not one is refused in one sentence."""
    from fsdp_planner.cli import main

    out = tmp_path / "p.json"
    assert main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--batch", "4", "--micro-batches",
                 "2", "--out", str(out)]) == 0
    step = {"batch": 4, "seq": 32, "micro_batches": 2, "ranks": 8, "nodes": 1}
    assert json.loads(out.read_text())["workload"] == step and Plan.load(out).workload.to_dict() == step
    fixture = Path(__file__).parent / "fixtures" / "titan_decoder.py"
    assert main(["plan", f"{fixture}:titan_decoder", "--policy", "titan", "--cluster", "h100:2", "--out",
                 str(out), "--force"]) == 0
    assert "workload" not in json.loads(out.read_text())  # (it takes no batch_size or seq_len)
    # a factory's defaults written as literals are read from its signature, without running the file (a plan at its
    # defaults recorded no workload), and what a command sets over them is compared with them
    factory = Path(__file__).parent.parent / "docs" / "examples" / "my_model.py"
    assert main(["plan", f"{factory}:build", "--policy", "titan", "--cluster", "h100:2", "--out", str(out),
                 "--force"]) == 0
    assert json.loads(out.read_text())["workload"] == {"batch": 4, "seq": 32, "micro_batches": 1, "ranks": 2,
                                                       "nodes": 1}
    for extra, said in (([], False), (["--batch", "8"], True)):
        capsys.readouterr()
        assert main(["simulate", f"{factory}:build", "--plan", str(out), "--cluster", "h100:2", *extra]) == 0
        assert ("the plan was made for batch 4, seq 32" in capsys.readouterr().err) == said
    # a model without a sequence length records its batch alone (it recorded none: a new user's ViT plan at
    # --batch 2121 was simulated at its factory's default batch without a note)
    assert main(["plan", "seed-net", "--policy", "size", "--cluster", "h100:2", "--batch", "6", "--out", str(out),
                 "--force"]) == 0
    step = {"batch": 6, "micro_batches": 1, "ranks": 2, "nodes": 1}
    assert json.loads(out.read_text())["workload"] == step and Plan.load(out).workload.to_dict() == step
    capsys.readouterr()
    assert main(["simulate", "seed-net", "--plan", str(out), "--cluster", "h100:2"]) == 0
    assert "note: the plan was made for batch 6 on 2 ranks: add --batch 6 for the step" in capsys.readouterr().err
    # simulated at another step, or on another world, the plan file says what it was made for
    plan_file = tmp_path / "p2.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--batch", "4", "--micro-batches",
                 "2", "--out", str(plan_file)]) == 0
    for extra, said in (([], "add --batch 4 --micro-batches 2 --seq 32 for the step it was planned for"),
                        (["--batch", "4", "--micro-batches", "2", "--cluster", "h100:16"],
                         "and this command runs 16: its memory verdict was for 8 ranks' shards"),
                        (["--batch", "4", "--micro-batches", "2"], None)):
        capsys.readouterr()
        assert main(["simulate", "toy-llama", "--plan", str(plan_file), "--cluster", "h100:8", *extra]) == 0
        err = capsys.readouterr().err
        assert (said in err) if said else "the plan was made for" not in err, err
    data = json.loads(Plan.from_json(ExecutionOrderPolicy().plan(traced("toy-llama")).to_json()).to_json())
    # ({"batch": 4} alone is a model's without a sequence length, above)
    for bad in ({"seq": 8}, {"batch": 4, "seq": 0}, {"batch": 4, "seq": 8, "micro_batches": 3},
                {"batch": True, "seq": 8}, {"batch": 4, "seq": 8, "tokens": 1}, [4, 8],
                {"batch": 4, "seq": 8, "ranks": 12, "nodes": 8}):
        with pytest.raises(PlannerError, match="plan 'workload' must be"):
            Plan.from_json(json.dumps({**data, "workload": bad}))

def test_plan_for_another_model_names_missing_and_extra_params(seed_trace):
    other = ExecutionOrderPolicy().plan(traced("toy-llama"), "toy-llama")
    with pytest.raises(PlannerError, match=r"another model.*missing parameters: conv1\.bias.*extra parameters"):
        check_plan_matches(Plan.from_json(other.to_json()), seed_trace)
    # the same names: other shapes (the count differs), or only the fingerprint (it said "shapes or dtypes" of an
    # edited fingerprint, a new user's finding)
    own = ExecutionOrderPolicy().plan(seed_trace, "seed-net")
    with pytest.raises(PlannerError, match=r"another model \(the same parameter names and count, but another "
                                           r"'model.fingerprint': .*or the file's fingerprint was edited\)"):
        check_plan_matches(dataclasses.replace(own, fingerprint="deadbeefdeadbeef"), seed_trace)
    with pytest.raises(PlannerError, match=rf"but {own.numel + 1:,} parameters where this model has {own.numel:,}"):
        check_plan_matches(dataclasses.replace(own, fingerprint="deadbeefdeadbeef", numel=own.numel + 1), seed_trace)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 7, "model": {}, "groups": []}',
                                  '{"version": 1, "model": {}, "groups": [{"modules": "fc1"}]}'])
def test_corrupt_plans_fail_clearly(text):
    with pytest.raises(PlannerError):
        Plan.from_json(text)


def test_group_params_must_be_what_fully_shard_claims(seed_trace):
    plan = SizeBasedPolicy(2000).plan(seed_trace)
    plan = plan.with_group(0, params=[*plan.groups[0].params, "fc2.weight"])  # fc2 is not under conv2
    with pytest.raises(PlannerError, match="differ from what fully_shard would claim"):
        validate_plan(plan, seed_trace)


def test_nested_groups_apply_children_first():
    tr = traced("toy-llama")
    plan = make_plan(tr, [["layers.0"], ["layers.0.attention"], ["layers.0.feed_forward.w1", "layers.1"]])
    order = [list(plan.groups[i].modules) for i in application_order(plan, tr.index.parents)]
    assert order.index(["layers.0.attention"]) < order.index(["layers.0"])
    assert order[-1] == [""]
    claimed = {tuple(g.modules): set(g.params) for g in plan.groups}
    assert "layers.0.attention.wq.weight" in claimed[("layers.0.attention",)]
    assert "layers.0.attention.wq.weight" not in claimed[("layers.0",)]
    assert "layers.0.feed_forward.w1.weight" not in claimed[("layers.0",)]


def test_root_group_is_last_and_reads_root_default():
    plan = Plan.from_json(json.dumps({"version": 1, "model": {"fingerprint": "x", "numel": 1},
                                      "groups": [{"modules": ["a"], "params": ["a.w"]}]}))
    assert plan.root.is_root and plan.root.reshard_after_forward is False
    assert isinstance(plan.groups[0], Group)


def _order_plan_dict() -> dict:
    return ExecutionOrderPolicy().plan(traced("toy-llama"), "toy-llama").to_dict()


@pytest.mark.parametrize(("change", "message"), [
    (lambda g: g[0].__setitem__("forward_prefetch", [99]), "forward_prefetch names 99, which is not another group"),
    (lambda g: g[0].__setitem__("forward_prefetch", ["abc"]), "forward_prefetch must be a list of group indices"),
    (lambda g: g[1].__setitem__("backward_prefetch", [-1]), "backward_prefetch names -1"),
    (lambda g: g[1].__setitem__("backward_prefetch", [1]), "backward_prefetch names 1, which is not another group"),
    (lambda g: g[1].__setitem__("forward_prefetch", [True]), "must be a list of group indices"),
    # a group listed twice (FSDP2 would unshard it twice; 100,000 repeats were read, a trial)
    (lambda g: g[1].__setitem__("forward_prefetch", [2, 0, 2]), "forward_prefetch names group 2 twice"),
    (lambda g: g[1]["modules"].append(g[1]["modules"][0]), "twice in that group"),
    (lambda g: g[2]["modules"].append(g[1]["modules"][0]), "also in group 1"),
    (lambda g: g[0].__setitem__("modules", []), "lists no modules"),
    (lambda g: g[0].__setitem__("reshard_after_forward", 0), "reshard_after_forward must be"),
])
def test_bad_plan_fields_are_refused_with_the_reason(change, message):
    data = _order_plan_dict()
    change(data["groups"])
    with pytest.raises(PlannerError, match=message):
        Plan.from_json(json.dumps(data))


def test_json_that_is_not_a_plan_says_so():
    with pytest.raises(PlannerError, match="not an fsdp-planner plan"):
        Plan.from_json('{"foo": 1}')
    with pytest.raises(PlannerError, match="unsupported plan version 7"):
        Plan.from_json('{"version": 7}')
    # without groups the message asks for them alone: a plan may leave out 'model' (it asked for a 'model' object)
    with pytest.raises(PlannerError, match=r"needs a non-empty 'groups' list \(each group"):
        Plan.from_json('{"version": 1, "groups": []}')
    with pytest.raises(PlannerError, match="plan 'model' must be an object"):
        Plan.from_json('{"version": 1, "model": "toy-llama", "groups": [["a"]]}')
    assert Plan.from_json('{"version": 1, "groups": [["a"]]}').groups[0].modules == ("a",)


def test_binary_plan_file_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(PlannerError, match="is not text"):
        Plan.load(path)


@pytest.mark.parametrize("case", ["tree", "shared module"])
def test_groups_nested_in_each_other_are_refused(case):
    """Each group lists a module above one of the other's: no fully_shard order exists (both claim paths)."""
    if case == "tree":
        tr = traced("toy-llama")
        groups = [["layers.0", "layers.1.attention"], ["layers.1", "layers.0.attention"]]
    else:
        lm = load_model(f"{Path(__file__).parent / 'fixtures' / 'factories.py'}:shared_submodule", meta=True)
        tr = record(lm.model, lm.example_inputs, lm.loss_fn)
        assert tr.index.shared_modules  # the DAG walk, not the tree fast path
        groups = [["blocks.0", "blocks.1.ff"], ["blocks.1", "blocks.0.ff"]]
    with pytest.raises(PlannerError, match="cycle"):
        make_plan(tr, groups)


def test_a_shared_module_listed_below_another_by_a_second_path_is_claimed_once():
    """``fully_shard([proj, blocks.1])``: FSDP2 hooks ``blocks.1`` alone (``proj`` is below it, as
    ``blocks.1.proj``) and gives ``proj`` no state, so ``blocks.0``'s call later reaches it and shards its params
    again (real FSDP2 fails). The claim rule now says so, and make_plan gives ``proj`` a group of its own, which
    trains (a trial's order plan listed ``blocks.0.shared`` beside ``blocks.2`` and failed the ranks)."""
    from random_models import apply_on_fake_ranks

    from fsdp_planner.fsdp2.claim import SplitParamError, claimed_params
    from fsdp_planner.fsdp2.plan import Group

    spec = f"{Path(__file__).parent / 'fixtures' / 'factories.py'}:shared_submodule"
    lm = load_model(spec, meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    listed = Plan((Group(("proj", "blocks.1")), Group(("blocks.0",)), Group(("blocks.2",)), Group(("",))), "", 0)
    with pytest.raises(SplitParamError, match=r"'proj\.weight' is reachable from groups"):
        claimed_params(listed, tr)
    failure = apply_on_fake_ranks(spec, listed)
    assert failure is not None and "Invariant encountered: value was None" in failure, failure
    plan = make_plan(tr, [["proj", "blocks.1"], ["blocks.0"], ["blocks.2"]])
    assert ("proj",) in [g.modules for g in plan.groups] and ("blocks.1",) in [g.modules for g in plan.groups]
    assert apply_on_fake_ranks(spec, plan) is None


def test_containers_without_forward_become_their_children_and_plan_files_naming_them_are_refused():
    """fully_shard(ModuleList) raises: a policy's group on one lists its children instead (same params)."""
    tr = traced("toy-llama")
    assert not tr.modules["layers"].shardable and tr.modules["layers.0"].shardable
    plan = make_plan(tr, [["layers"]])
    assert list(plan.groups[0].modules) == [m for m in tr.modules["layers"].children]
    assert set(plan.groups[0].params) == set(tr.index.subtree_params["layers"])
    bad = Plan.from_json(plan.to_json()).with_group(0, modules=["layers"])
    with pytest.raises(PlannerError, match=r"containers without forward.*layers"):
        check_plan_matches(bad, tr)


HAND_PLAN = Path(__file__).parent.parent / "docs" / "examples" / "hand_plan.json"
MY_MODEL = f"{HAND_PLAN.parent / 'my_model.py'}:build"


def test_a_hand_written_module_list_plan_gets_its_params_by_the_claim_rule():
    """The documented minimal plan (groups as module lists, no params, no model) passes the plan-vs-model check
    once each group's params are what its fully_shard call claims: the same groups a policy would make."""
    tr = traced(MY_MODEL)
    loaded = Plan.load(HAND_PLAN)
    assert not any(g.params for g in loaded.groups) and loaded.fingerprint == ""
    with pytest.raises(PlannerError, match="do not list every param"):
        check_plan_matches(loaded, tr)
    plan = with_claimed_params(loaded, tr)
    check_plan_matches(plan, tr)
    expected = make_plan(tr, [["embed"], *([f"blocks.{i}"] for i in range(4)), ["norm", "head"]],
                         reshard=[True] * 5 + [False])
    assert [(g.modules, g.params, g.reshard_after_forward) for g in plan.groups] == \
        [(g.modules, g.params, g.reshard_after_forward) for g in expected.groups]
    assert plan.fingerprint == tr.fingerprint and list(loaded.groups[0].params) == []  # the loaded plan is untouched


def test_a_module_list_plan_follows_first_use_and_nested_groups_carve_their_params():
    """Groups written out of order are put in execution order; a block listed inside a group listing its parent
    container's owner keeps its own params (FSDP2 applies nested groups first)."""
    tr = traced(MY_MODEL)
    plan = with_claimed_params(Plan.from_json(json.dumps(
        {"version": 1, "groups": [["blocks.1"], ["blocks.0"]]})), tr)
    assert [list(g.modules) for g in plan.groups] == [["blocks.0"], ["blocks.1"], [""]]
    assert list(plan.groups[0].params) == [p.fqn for p in tr.params if p.fqn.startswith("blocks.0.")]
    assert set(plan.root.params) == {p.fqn for p in tr.params} - set(plan.groups[0].params) - set(plan.groups[1].params)
    check_plan_matches(plan, tr)


def test_a_module_list_plan_naming_a_missing_module_is_one_clear_error():
    tr = traced(MY_MODEL)
    plan = Plan.from_json(json.dumps({"version": 1, "groups": [["blocks.9"], ["blok.0"]]}))
    with pytest.raises(PlannerError, match=r"^plan names modules the model does not have: blocks\.9, blok\.0$"):
        with_claimed_params(plan, tr)


def test_a_compiled_list_naming_a_missing_module_is_one_clear_error():
    """Every command reading a plan refuses it (only export did: simulate and check took it)."""
    tr = traced(MY_MODEL)
    plan = with_claimed_params(Plan.from_json(json.dumps(
        {"version": 1, "groups": [["blocks.0"], ["blocks.1"]], "compiled": ["blocks.0", "nope"]})), tr)
    with pytest.raises(PlannerError, match=r"^plan 'compiled' names modules the model does not have: nope$"):
        check_plan_matches(plan, tr)
    check_plan_matches(plan.replace(compiled=["blocks.0"]), tr)


def test_the_comparison_bytes_are_the_job_precision_s_without_a_cluster_too(capsys):
    """Without --cluster the table showed every precision's all-gather bytes in fp32 (the params' own), so
    bf16-mixed and pure-bf16 read as fp32's; now they are the job's, as with a cluster."""
    from fsdp_planner import cli

    gathered = {}
    for precision in ("fp32", "bf16-mixed"):
        assert cli.main(["plan", "toy-llama", "--policy", "titan", "--precision", precision, "--json"]) == 0
        gathered[precision] = json.loads(capsys.readouterr().out)["plans"][0]["metrics"]["all_gather_bytes"]
    assert gathered["fp32"] == 2 * gathered["bf16-mixed"] > 0


@pytest.mark.parametrize(("args", "said"), [
    (["tests/fixtures/conv_models.py:conv_net", "--float8", "tensorwise"], "--float8 converts nothing in this model"),
    (["toy-llama", "--precision", "pure-bf16"], "the model builds its trainable params in float32 and precision "
                                                "'pure-bf16' stores them in bfloat16"),
])
def test_plan_says_what_its_figures_assume_of_the_model_s_dtypes(capsys, args, said):
    from fsdp_planner import cli

    assert cli.main(["plan", *args, "--policy", "order"]) == 0
    assert said in capsys.readouterr().err


def test_a_tied_model_is_not_taken_for_its_untied_twin():
    """A tied model and its untied twin have one fingerprint (names, shapes and dtypes alike: the tied head's name
    is an alias of the embedding's weight); the param counts tell them apart, so the untied one's plan is said to
    be another model's, not this model's with its groups edited (a new user's trial: granite's tied config beside
    mistral's plan)."""
    import torch
    import torch.nn as nn

    def lm(tied: bool) -> nn.Module:
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
        if tied:
            model[1].weight = model[0].weight
        return model

    tokens = (torch.randint(0, 16, (2, 4)),)
    untied, tied = (record(lm(t), tokens) for t in (False, True))
    assert untied.fingerprint == tied.fingerprint and untied.numel != tied.numel
    with pytest.raises(PlannerError, match=r"plan was made for another model \(extra parameters: 1\.weight\)"):
        check_plan_matches(ExecutionOrderPolicy().plan(untied), tied)
