"""Non-forward methods that run a sharded module's params (issue 11): found by the trace, registered by plans and
apply_plan, replayed as FSDP2 runs them once registered."""

from __future__ import annotations

import json

import pytest
from conftest import run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches, make_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.validity import check_plan_runs
from fsdp_planner.models import load_model
from fsdp_planner.planners import CLASSIC_POLICIES, PolicyRequest, make_policy
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.session import TraceSession

FACTORIES = "tests/fixtures/factories.py"


def traced(fn: str):
    lm = load_model(f"{FACTORIES}:{fn}")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


@pytest.mark.parametrize("fn", ["head_loss", "head_loss_in_loss_fn"])
def test_the_trace_finds_a_method_reading_params_outside_forward(fn):
    """In the model's forward (head.loss reads its own weight) and in the loss function after it (head.loss runs
    its child proj's forward): recorded as a call of head with FSDP2's four boundaries."""
    tr = traced(fn)
    assert tr.forward_methods == [("head", "loss")]
    assert tr.method_calls == {("head", 0): "loss"}
    kinds = [e.kind for e in tr.events if e.module == "head" and not e.is_op]
    assert kinds == [EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_PRE, EventKind.BWD_POST]
    head_params = {i for i, p in enumerate(tr.params) if p.fqn.startswith("head.")}
    assert not head_params & tr.index.read_outside  # read inside the (wrapped) call now


def test_a_model_without_such_methods_is_traced_once(monkeypatch):
    calls = []
    original = TraceSession.run
    monkeypatch.setattr(TraceSession, "run", lambda self: calls.append(1) or original(self))
    tr = traced("twice")
    assert tr.method_calls == {} and len(calls) == 1


def test_a_parent_calling_a_grandchild_is_no_method():
    lm = load_model("tests/fixtures/invalid_models.py:direct_call")
    assert record(lm.model, lm.example_inputs).method_calls == {}


@pytest.mark.parametrize("name", [*CLASSIC_POLICIES, "order"])
def test_every_policy_registers_the_method_of_a_module_it_shards(name):
    tr = traced("head_loss")
    plan = make_policy(PolicyRequest.named(name, min_nonwrapped_numel=50)).plan(tr)
    listed = {m for g in plan.groups for m in g.modules}
    assert list(plan.forward_methods) == ([("head", "loss")] if "head" in listed else [])
    check_plan_runs(tr, plan)


def test_an_unregistered_method_of_a_sharded_module_is_refused_and_registering_it_runs():
    tr = traced("head_loss")
    plan = make_plan(tr, [["inp"], ["block"], ["head"]])
    assert list(plan.forward_methods) == [("head", "loss")]
    check_plan_runs(tr, plan)
    with pytest.raises(PlannerError, match=r"'head\.weight' while its group 2 .* is sharded"):
        check_plan_runs(tr, plan.replace(forward_methods=[]))


def test_forward_methods_round_trip_and_absent_means_none():
    tr = traced("head_loss")
    plan = make_plan(tr, [["inp"], ["block"], ["head"]])
    data = json.loads(plan.to_json())
    assert data["forward_methods"] == [{"module": "head", "method": "loss"}]
    assert list(Plan.from_json(plan.to_json()).forward_methods) == [("head", "loss")]
    del data["forward_methods"]
    assert list(Plan.from_json(json.dumps(data)).forward_methods) == []
    for bad in ([["head", "loss"]], [{"module": "head"}], [{"module": "head", "method": "no such"}]):
        with pytest.raises(PlannerError, match="forward_methods"):
            Plan.from_json(json.dumps({**data, "forward_methods": bad}))
    data["forward_methods"] = [{"module": "nope", "method": "loss"}]
    with pytest.raises(PlannerError, match="names modules the model does not have: nope"):
        check_plan_matches(Plan.from_json(json.dumps(data)), tr)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["order", "auto"])
def test_a_head_loss_method_trains_on_a_real_run(name):
    """Real FSDP2 on 2 gloo ranks with head sharded on its own: apply_plan registers head.loss, parameters match
    the unsharded run, the collectives equal the replay's prediction."""
    out = run_main("verify", f"{FACTORIES}:head_loss", "--policy", name, "--nproc", "2", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


@pytest.mark.parametrize(("method", "message"), [
    ("nope", "plan 'forward_methods' registers 'head.nope' but LossHead 'head' has no method 'nope'"),
    ("weight", "plan 'forward_methods' registers 'head.weight' but LossHead 'head' has no method 'weight'"),
    ("__call__", "plan 'forward_methods' registers 'head.__call__', a special method: list the module's own methods"),
    ("register_forward_hook", "plan 'forward_methods' registers 'head.register_forward_hook', nn.Module's own"),
])
def test_verify_refuses_a_method_the_model_lacks_before_torchrun_starts(method, message):
    """Checked on the model built on meta in this process: the message is the check's own, not a verify job's
    report of what its ranks raised (which would take a torchrun job to tell)."""
    from fsdp_planner.runtime.verify import run_verify

    tr = traced("head_loss")
    plan = make_plan(tr, [["inp"], ["block"], ["head"]])
    bad = plan.replace(forward_methods=[*plan.forward_methods, ("head", method)])
    with pytest.raises(PlannerError) as info:
        run_verify(f"{FACTORIES}:head_loss", tr, bad, nproc=2, steps=1)
    assert str(info.value).startswith(message)


def test_apply_plan_refuses_a_method_the_model_lacks_and_leaves_the_model_unsharded():
    from fsdp_planner.apply.fully_shard import apply_plan

    tr = traced("head_loss")
    plan = make_plan(tr, [["inp"], ["block"], ["head"]])
    model = load_model(f"{FACTORIES}:head_loss").model
    with pytest.raises(PlannerError, match="has no method 'nope'"):
        apply_plan(model, plan.replace(forward_methods=[("head", "nope")]))  # before it asks for a process group
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())
