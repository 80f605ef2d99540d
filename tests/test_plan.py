from __future__ import annotations

import json

import pytest
from conftest import traced

from fsdp_planner.errors import PlannerError
from fsdp_planner.plan import Group, Plan, application_order, make_plan, validate_plan
from fsdp_planner.policies import ExecutionOrderPolicy, SizeBasedPolicy


def test_json_round_trip_has_the_documented_shape(seed_trace):
    plan = SizeBasedPolicy(2000).plan(seed_trace, "seed-net")
    data = json.loads(plan.to_json())
    assert data["version"] == 1
    assert data["model"]["fingerprint"] == seed_trace.fingerprint and data["model"]["numel"] == seed_trace.numel
    assert set(data["groups"][0]) >= {"modules", "params", "reshard_after_forward"}
    back = Plan.from_json(plan.to_json(), seed_trace)
    assert [g.to_dict() for g in back.groups] == [g.to_dict() for g in plan.groups]


def test_plan_for_another_model_names_missing_and_extra_params(seed_trace):
    other = ExecutionOrderPolicy().plan(traced("toy-llama"), "toy-llama")
    with pytest.raises(PlannerError, match=r"another model.*missing parameters: conv1\.bias.*extra parameters"):
        Plan.from_json(other.to_json(), seed_trace)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 7, "model": {}, "groups": []}',
                                  '{"version": 1, "model": {}, "groups": [{"modules": "fc1"}]}'])
def test_corrupt_plans_fail_clearly(text):
    with pytest.raises(PlannerError):
        Plan.from_json(text)


def test_group_params_must_be_what_fully_shard_claims(seed_trace):
    plan = SizeBasedPolicy(2000).plan(seed_trace)
    plan.groups[0].params.append("fc2.weight")  # fc2 is not under conv2
    with pytest.raises(PlannerError, match="differ from what fully_shard would claim"):
        validate_plan(plan, seed_trace)


def test_nested_groups_apply_children_first():
    tr = traced("toy-llama")
    plan = make_plan(tr, [["layers.0"], ["layers.0.attention"], ["layers.0.feed_forward.w1", "layers.1"]])
    order = [plan.groups[i].modules for i in application_order(plan)]
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
