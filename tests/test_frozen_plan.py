"""Plans are immutable values: a change makes a new plan (``dataclasses.replace``), the search keeps the run options
auto chooses apart from its grouping, and what ``plan --out`` writes is byte for byte what it wrote before."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
from conftest import traced

from fsdp_planner.choices import SacPolicy
from fsdp_planner.cli import main
from fsdp_planner.fsdp2.plan import Group, Plan, RunOptions
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import AutoPolicy, TorchtitanPolicy
from fsdp_planner.sim.options import SimOptions

FIXTURES = Path(__file__).parent / "fixtures"
# what `plan --out` wrote before plans were frozen (commit 2701305), with auto's offload and a reduce dtype in it
AUTO_OFFLOAD = (["toy-llama", "--policy", "auto", "--cluster", "h100:8", "--offload", "--reduce-dtype", "bf16"],
                FIXTURES / "plan_out_toy_llama_auto_offload.json")
TITAN_OPTIONS = (["toy-llama", "--policy", "titan", "--cluster", "h100:8", "--offload", "--reduce-dtype", "fp32",
                  "--shard-placement", "auto"], FIXTURES / "plan_out_toy_llama_titan_options.json")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return TorchtitanPolicy("TransformerBlock").plan(traced("toy-llama"), "toy-llama").replace(
        selective_checkpointing={"layers.0": SacPolicy.TITAN}, hf_config={"use_cache": False})


def test_a_plan_and_its_groups_cannot_be_changed(plan: Plan) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.policy = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups[0].reshard_after_forward = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        plan.groups[0].params.append("output.weight")  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        plan.activation_checkpointing.append("layers.1")  # type: ignore[attr-defined]
    for mapping in (plan.selective_checkpointing, plan.hf_config, plan.shard_dims):
        with pytest.raises(TypeError, match="cannot be changed"):
            mapping["x"] = 1  # type: ignore[index]
        with pytest.raises(TypeError, match="cannot be changed"):
            mapping.update(x=1)  # type: ignore[attr-defined]


def test_replace_makes_a_new_plan_and_leaves_the_old_one(plan: Plan) -> None:
    before = plan.to_json()
    changed = dataclasses.replace(plan, policy="mine", activation_checkpointing=["layers.1"])
    assert changed.policy == "mine" and changed.activation_checkpointing == ("layers.1",)  # lists kept as tuples
    regrouped = plan.with_group(0, reshard_after_forward=False, forward_prefetch=[1])
    assert regrouped.groups[0].reshard_after_forward is False and regrouped.groups[0].forward_prefetch == (1,)
    assert regrouped.groups[1:] == plan.groups[1:] and regrouped.groups[1] is plan.groups[1]  # shared, not copied
    assert plan.to_json() == before and plan.signature() != regrouped.signature()
    assert Group(["a"], ["a.weight"]) == Group(("a",), ("a.weight",)) and hash(plan) == hash(copy.deepcopy(plan))


def test_a_plan_pickles_and_reads_back_unchanged(plan: Plan) -> None:
    """Plans cross process boundaries (torchrun ranks, the fake world): the frozen mappings pickle as themselves."""
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.to_json() == plan.to_json()
    with pytest.raises(TypeError):
        again.selective_checkpointing["layers.1"] = SacPolicy.TITAN  # type: ignore[index]
    assert Plan.from_json(plan.to_json()) == plan


def test_the_search_keeps_its_run_options_apart_from_the_grouping() -> None:
    """Auto's options (here the offload and reduce dtype asked for) travel with the result and are written into the
    plan only where it leaves: ``written_plan``, ``AutoPolicy.plan``."""
    tr = traced("toy-llama")
    policy = AutoPolicy(parse_cluster("h100:8"), options=SimOptions.named(offload=True, reduce_dtype="bf16"))
    result = policy.search(tr, "toy-llama")
    assert result.run == RunOptions(offload=True, reduce_dtype="bf16")
    assert not result.plan.offload and not result.plan.reduce_dtype  # the grouping alone
    written = result.written_plan
    assert written.offload and written.reduce_dtype == "bf16" and written.run == result.run
    assert dataclasses.replace(written, offload=False, reduce_dtype="") == result.plan
    assert policy.plan(tr, "toy-llama") == written


@pytest.mark.parametrize(("args", "golden"), [AUTO_OFFLOAD, TITAN_OPTIONS], ids=["auto-offload", "titan-options"])
def test_plan_out_writes_what_it_wrote_before(tmp_path: Path, args: list[str], golden: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--out", str(out)]) == 0
    written = json.loads(out.read_text())  # the same, and the workload it was made for (recorded since 2026-12)
    assert written.pop("workload") == {"batch": 4, "seq": 32, "micro_batches": 1, "ranks": 8, "nodes": 1}
    # and the optimizer it was simulated with (recorded since 2026-12-03: --optimizer's, default adamw)
    assert written.pop("optimizer") == (args[args.index("--optimizer") + 1] if "--optimizer" in args else "adamw")
    assert json.dumps(written, indent=2) + "\n" == golden.read_text()
    assert Plan.load(golden).to_json() + "\n" == golden.read_text()  # a plan saved before reads and writes as it was
