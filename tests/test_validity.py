"""A plan that reads a sharded param is refused before it runs, and auto never returns one (issue 11)."""

from __future__ import annotations

import pytest
from conftest import run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.fsdp2.validity import check_plan_runs, sharded_reads
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import BUILTINS, load_model
from fsdp_planner.planners import (
    CLASSIC_POLICIES,
    AutoPolicy,
    PolicyRequest,
    TorchtitanPolicy,
    make_baseline,
    make_policy,
)
from fsdp_planner.sim.sizing import Sizing
from fsdp_planner.trace import record

FIXTURES = "tests/fixtures/invalid_models.py"


def traced(spec: str):
    lm = load_model(spec)
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def reads(tr, plan):
    group_params = Sizing(tr, 8).group_params(plan)
    return sharded_reads(tr, plan, build_schedule(tr, plan, 8, group_params), group_params)


def test_a_parent_calling_a_grandchild_directly_is_found() -> None:
    tr = traced(f"{FIXTURES}:direct_call")
    for groups in ([["layer", "linear"]], [["layer"], ["linear"]]):  # layer.proc runs outside layer's hooks
        bad = reads(tr, make_plan(tr, groups))
        assert bad and bad[0].param == "layer.proc.weight" and bad[0].module == "layer.proc"
    assert not reads(tr, make_plan(tr, [["layer.proc"], ["linear"], ["layer"]]))
    with pytest.raises(PlannerError, match=r"this plan cannot run: an op of 'layer\.proc' in forward"):
        check_plan_runs(tr, make_plan(tr, [["layer", "linear"]]))


def test_a_param_reused_after_its_group_resharded_is_found_and_auto_avoids_it() -> None:
    tr = traced(f"{FIXTURES}:reuse")
    titan = TorchtitanPolicy().build(tr)  # the grouping torchtitan makes
    bad = reads(tr, titan)
    assert bad and bad[0].param == "blocks.0.weight" and bad[0].module == "" and not bad[0].backward
    with pytest.raises(PlannerError, match=r"this plan cannot run: an op of '\(root\)' in forward .* reads param "
                                           r"'blocks\.0\.weight'"):
        make_policy(PolicyRequest.named("titan")).plan(tr)  # the policy refuses it
    result = AutoPolicy(parse_cluster("h100:8")).search(tr)
    assert not reads(tr, result.plan)
    assert any(not c.runs for c in result.search.ev.seen)  # it saw plans that would fail, and ranked none


def test_a_param_passed_to_a_call_is_read_by_its_caller() -> None:
    """``self.borrower(h, self.mix.weight)``: the parent reads the weight before ``borrower``'s hooks unshard its
    group, so a group [mix, borrower] fails on the ranks (real FSDP2 on fake ranks says so); check passed it, and
    the order policy wrote it. Refused naming the pass; the weight in the caller's group runs."""
    from random_models import apply_on_fake_ranks

    spec = f"{FIXTURES}:passing"
    tr = traced(spec)
    assert [(tr.events[i].module, [tr.params[p].fqn for p in tr.events[i].passed])
            for i in range(len(tr.events)) if tr.events[i].passed] == [("borrower", ["mix.weight"])]
    wrong = make_plan(tr, [["inp"], ["mix", "borrower"], ["out"]])
    with pytest.raises(PlannerError, match=r"this plan cannot run: '\(root\)' passes param 'mix\.weight' to "
                                           r"'borrower' \(trace event \d+\) while its group 1 \('mix', 'borrower'\)"):
        check_plan_runs(tr, wrong)
    right = make_plan(tr, [["inp"], ["borrower"], ["out"]])  # mix.weight left to the root, gathered all forward
    check_plan_runs(tr, right)
    assert "mixed torch.Tensor and DTensor" in apply_on_fake_ranks(spec, wrong)
    assert apply_on_fake_ranks(spec, right) is None
    order = make_policy(PolicyRequest.named("order")).plan(tr)
    assert not reads(tr, order) and apply_on_fake_ranks(spec, order) is None
    # the caller is the module whose forward runs the call, not the callee's parent: the root here
    tr = traced(f"{FIXTURES}:passing_from_root")
    [bad] = reads(tr, make_plan(tr, [["layers.0"], ["layers.1"]]))
    assert (bad.module, bad.passed_to, bad.param) == ("", "layers.0.borrower", "layers.1.mix.weight")


@pytest.mark.parametrize("model", [m for m in BUILTINS if m not in ("llama3-70b", "llama3-405b", "llama32-1b")])
def test_every_classic_plan_of_the_built_ins_runs(model: str) -> None:
    tr = traced(model)
    for policy in CLASSIC_POLICIES:
        assert not reads(tr, make_policy(PolicyRequest(policy)).plan(tr, model)), policy


@pytest.mark.integration  # a comparison of every policy
def test_cli_refuses_an_explicit_policy_whose_plan_cannot_run_and_leaves_it_out_of_a_comparison() -> None:
    run = ["plan", f"{FIXTURES}:reuse"]
    r = run_main(*run, "--policy", "titan")
    assert r.returncode == 2 and "this plan cannot run" in r.stderr and "Traceback" not in r.stderr
    r = run_main(*run)
    assert r.returncode == 0, r.stderr
    assert "the module and titan policies are left out of the comparison: this plan cannot run" in r.stdout + r.stderr


def test_a_policy_refuses_a_grouping_that_cannot_run_and_check_reports_it(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan()`` refuses the grouping, naming the op; ``build()`` gives it, and ``check`` reports the sharded read
    as an error finding (exit 1) instead of passing the model alone."""
    from fsdp_planner.cli import main

    tr = traced(f"{FIXTURES}:direct_call")
    request = PolicyRequest.named("module", module_classes=("Layer",))
    with pytest.raises(PlannerError, match=r"this plan cannot run: an op of 'layer\.proc' in forward"):
        make_policy(request).plan(tr)
    assert [list(g.modules) for g in make_baseline(request).build(tr).groups] == [["layer"], [""]]
    assert main(["check", f"{FIXTURES}:direct_call", "--policy", "module", "--module-classes", "Layer"]) == 1
    assert "sharded-read" in capsys.readouterr().out
