"""One original dtype per group (issue 11): FSDP2 asserts it at its first forward, whatever the precision policy;
every policy splits a mixed-dtype model's groups by dtype, and real fully_shard accepts the result."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches, make_plan
from fsdp_planner.fsdp2.dtypes import group_dtypes
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.fsdp2.validity import check_plan_runs
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import PolicyRequest, make_policy
from fsdp_planner.trace import record

MIXED = "tests/fixtures/factories.py:mixed_dtype"
POLICIES = ["module", "size", "titan", "order", "auto"]


def traced(spec: str):
    lm = load_model(spec)
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def policy_plan(tr, name: str) -> Plan:
    settings = {"min_nonwrapped_numel": 300} if name == "size" else {}
    return make_policy(PolicyRequest.named(name, **settings), parse_cluster("h100:8")).plan(tr)


def run_with_fully_shard(plan: Plan, world_size: int = 4) -> None:
    """apply_plan with real FSDP2 on the fake process group (bf16 compute, fp32 reduce), then one forward and
    backward: FSDP2 checks the groups' dtypes at its lazy init."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_planner.apply.fully_shard import apply_plan, device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = device_mesh(plan, "cpu", world_size)  # outside fake mode, as the fake-world check builds it
        with FakeTensorMode(allow_non_fake_inputs=True):
            lm = load_model(MIXED, meta=False)
            apply_plan(lm.model, plan, mesh=mesh,
                       mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            lm.model(*lm.example_inputs).float().pow(2).mean().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_splits_a_mixed_dtype_block_and_fully_shard_accepts_it(name):
    tr = traced(MIXED)
    plan = policy_plan(tr, name)
    assert all(len(d) <= 1 for d in group_dtypes(plan, tr)), [list(g.modules) for g in plan.groups]
    check_plan_matches(plan, tr)
    check_plan_runs(tr, plan)
    run_with_fully_shard(plan)


def test_a_group_of_mixed_dtypes_is_refused_and_fully_shard_refuses_it_too():
    tr = traced(MIXED)
    index = {p.fqn for p in tr.params}
    whole = Plan([Group(["layers.0"], [p for p in index if p.startswith("layers.0.")]),
                  Group([""], [p for p in index if not p.startswith("layers.0.")], False)],
                 tr.fingerprint, tr.numel)
    with pytest.raises(PlannerError, match=r"group 0 \(layers\.0\) manages trainable params of several dtypes"):
        check_plan_matches(whole, tr)
    with pytest.raises(AssertionError, match="FSDP expects uniform original parameter dtype"):
        run_with_fully_shard(whole)


def test_frozen_params_of_another_dtype_do_not_split_a_group():
    tr = traced(MIXED)
    tr = replace(traced(MIXED), params=tuple(replace(p, requires_grad="norm" not in p.fqn) for p in tr.params))
    plan = make_plan(tr, [["inp"], ["layers.0"], ["layers.1"], ["layers.2"]])
    assert [list(g.modules) for g in plan.groups][:4] == [["inp"], ["layers.0"], ["layers.1"], ["layers.2"]]


def test_a_module_registering_two_dtypes_itself_cannot_be_split():
    tr = traced("tests/fixtures/factories.py:own_mixed")
    with pytest.raises(PlannerError, match="module 'body' registers trainable params of several dtypes"):
        make_plan(tr, [["body"]])
