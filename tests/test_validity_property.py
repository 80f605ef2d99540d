"""Property: every plan a policy returns runs, and the validity check says exactly which plans run.

Over random tiny models (``random_models.py``: random call orders, direct calls into a child's submodules, a
module called twice, tied weights, frozen params, params of the other dtype, nesting depth 1-3):
- every plan a classic policy or auto returns passes ``check_plan_runs``; a classic policy that cannot plan a model
  refuses it in one line, naming the op when its grouping would read a sharded param;
- every random grouping the check refuses names an op of the model, the param it reads and that param's group;
- (integration) real FSDP2 on the fake process group trains every returned plan, and trains exactly the random
  groupings the check accepts: the check is neither too strict nor too lax.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from random_models import build, loss, random_groups, train_on_fake_ranks

from fsdp_planner.choices import ACMode
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.validity import check_plan_runs
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import CLASSIC_POLICIES, AutoPolicy, PolicyName, PolicyRequest, make_policy
from fsdp_planner.trace import Trace, record

CLASSIC_NAMES = {p.value for p in CLASSIC_POLICIES}
ISSUE_MODEL = "tests/fixtures/invalid_models.py:direct_call_first"  # the reported model
SEEDS = range(160)  # ~160 models, ~1,100 plans from policies and ~640 random ones
FAST_SEEDS = range(40)  # the fast subset's share of them; the full suite runs the rest too
SAMPLE = range(0, 160, 12)  # the integration part: 14 of them, each plan trained on fake ranks
REFUSAL = re.compile(r"^this plan cannot run: an op of '(?P<module>[^']+)' in (?P<phase>forward|backward) "
                     r"\(trace event (?P<event>\d+)\) reads param '(?P<param>[^']+)' while its group "
                     r"(?P<group>\d+) \(")


@functools.cache
def traced(seed: int) -> tuple[Trace, tuple[str, ...]]:
    """The trace of the model of ``seed`` (built on meta tensors) and the features it drew."""
    with torch.device("meta"):
        model, inputs, drawn = build(seed)
    return record(model, inputs, loss), (*drawn.features, f"depth {drawn.depth}", str(drawn.dtype))


@dataclass
class Outcome:
    """What one policy made of one model: a plan, or the sentence it refused with."""

    policy: str
    plan: Plan | None
    refusal: str = ""
    world: int = 8  # the GPUs it planned for


def policy_outcomes(tr: Trace, seed: int) -> list[Outcome]:
    """Each classic policy with its defaults, and auto on one node, across nodes (it chooses the layout) and under a
    budget just above the least memory any plan needs (the search then works at the edge of what fits)."""
    out = []
    for name in CLASSIC_POLICIES:
        out.append(outcome(name.value, lambda name=name: make_policy(PolicyRequest(name)).plan(tr)))
    out.append(outcome("titan --ac full", lambda: make_policy(PolicyRequest(PolicyName.TITAN,
                                                                            checkpointing=ACMode.FULL)).plan(tr)))
    out.append(outcome("auto h100:8", lambda: AutoPolicy(parse_cluster("h100:8")).plan(tr)))
    out.append(outcome("auto h100:16", lambda: AutoPolicy(parse_cluster("h100:16")).plan(tr), world=16))
    if out[-2].plan is not None:
        floor = AutoPolicy(parse_cluster("h100:8")).search(tr).min_peak
        budget = int(floor * (1 + random.Random(seed).random() * 0.2))
        out.append(outcome("auto budget", lambda: AutoPolicy(parse_cluster("h100:8"), memory_budget=budget).plan(tr)))
    return out


def outcome(policy: str, make: Callable[[], Plan], world: int = 8) -> Outcome:
    try:
        return Outcome(policy, make(), world=world)
    except PlannerError as e:
        return Outcome(policy, None, str(e), world)


def random_plans(tr: Trace, seed: int, count: int) -> list[Plan]:
    """``count`` random groupings (make_plan may refuse some: a cycle of nested groups), with random
    ``reshard_after_forward`` and sometimes explicit prefetch."""
    rng = random.Random(seed)
    modules = [m for m in tr.modules if m and tr.index.subtree_numel[m]]
    first_use = {m: tr.modules[m].first_use for m in modules}
    choices = [True, True, False, 2, 4]  # 2 and 4: reshard to a sub-group of 8 ranks
    plans = []
    for _ in range(count):
        groups = random_groups(rng, modules, first_use)
        try:
            plan = make_plan(tr, groups, [rng.choice(choices) for _ in groups])
        except PlannerError:
            continue
        inner = range(len(plan.inner_groups))
        if len(inner) >= 2 and rng.random() < 0.4:
            for i in inner:
                others = [j for j in inner if j != i]
                fwd = [rng.choice(others)] if rng.random() < 0.5 else []
                bwd = [rng.choice(others)] if rng.random() < 0.5 else []
                plan = plan.with_group(i, forward_prefetch=fwd, backward_prefetch=bwd)
        plans.append(plan)
    return plans


def refusal(tr: Trace, plan: Plan) -> str | None:
    try:
        check_plan_runs(tr, plan)
    except PlannerError as e:
        return str(e)
    return None


def assert_names_the_op(tr: Trace, plan: Plan, message: str) -> None:
    """The refusal names a real op of the model, in the module it says, reading a param of the group it says."""
    found = REFUSAL.match(message)
    assert found, message
    event = tr.events[int(found["event"])]
    assert (event.module or "(root)") == found["module"] and event.backward == (found["phase"] == "backward")
    assert found["param"] in plan.groups[int(found["group"])].params
    assert "\n" not in message


@functools.cache
def policy_outcomes_seen(seed: int) -> Counter[str]:
    """Every policy on the model of ``seed``: each returned plan runs, each refusal is one line (naming the op
    when a grouping cannot run); what was seen, counted (cached: the fast test's models are not checked twice)."""
    seen: Counter[str] = Counter()
    tr, features = traced(seed)
    seen.update(set(features))
    for o in policy_outcomes(tr, seed):
        if o.plan is not None:
            assert refusal(tr, o.plan) is None, (seed, o.policy, refusal(tr, o.plan))
            seen["plans returned"] += 1
            continue
        assert o.refusal and "\n" not in o.refusal and "internal" not in o.refusal, (seed, o.policy)
        if o.policy.startswith("auto"):  # no plan runs (naming the op), or none fits a budget near the floor
            assert ("no candidate plan runs" in o.refusal and "reads param" in o.refusal) or \
                (o.policy == "auto budget" and "no plan fits" in o.refusal), (seed, o.policy, o.refusal)
            seen["auto refused"] += 1
        elif o.refusal.startswith("this plan cannot run"):
            if o.policy in CLASSIC_NAMES:  # the op, in the grouping the policy's rules make
                assert_names_the_op(tr, make_policy(PolicyRequest.named(o.policy)).build(tr), o.refusal)
            assert REFUSAL.match(o.refusal), o.refusal
            seen["classic refused: cannot run"] += 1
    return seen


@pytest.mark.integration  # seconds of planning (the fast subset stays near a minute)
def test_every_policy_returns_a_plan_that_runs_and_refuses_in_one_line() -> None:
    seen = sum((policy_outcomes_seen(seed) for seed in FAST_SEEDS), Counter())
    assert seen["plans returned"] >= 150 and seen["classic refused: cannot run"] >= 10, seen


@pytest.mark.integration  # the other 120 models: ~15 s
def test_every_policy_on_every_model_and_the_models_draw_every_feature() -> None:
    seen = sum((policy_outcomes_seen(seed) for seed in SEEDS), Counter())
    # the models drew every feature, and the classic policies did meet groupings that cannot run
    for feature in ("blocks", "direct call", "reuse", "tied", "frozen", "mixed dtypes", "weight read", "unused",
                    "depth 1", "depth 2", "depth 3", "torch.bfloat16"):
        assert seen[feature] >= 5, (feature, seen)
    assert seen["classic refused: cannot run"] >= 50 and seen["plans returned"] >= 700, seen
    assert seen["auto refused"] <= len(SEEDS) // 20, seen  # auto plans nearly every model


def test_every_random_plan_the_check_refuses_names_the_op() -> None:
    verdicts: Counter[bool] = Counter()
    for seed in SEEDS:
        tr, _ = traced(seed)
        for plan in random_plans(tr, seed, 4):
            message = refusal(tr, plan)
            verdicts[message is None] += 1
            if message is not None:
                assert_names_the_op(tr, plan, message)
    assert verdicts[True] >= 100 and verdicts[False] >= 50, verdicts  # both verdicts met, often


def test_the_issue_model_plans_verify_and_train_on_fake_ranks(tmp_path, capsys) -> None:
    """The reported model (4096 wide, the parent calling ``layer.proc`` first): under budgets that make auto split
    it, its plan passes ``verify --plan``'s check and real FSDP2 on 8 fake ranks trains it."""
    from fsdp_planner.cli import main

    spec = ISSUE_MODEL
    for budget in ("400MiB", "300MiB", "250MiB"):
        out = tmp_path / f"plan-{budget}.json"
        assert main(["plan", spec, "--policy", "auto", "--cluster", "h100:8", "--memory-budget", budget,
                     "--out", str(out), "--quiet"]) == 0, capsys.readouterr().err
        plan = Plan.load(out)
        assert len(plan.inner_groups) >= 2  # the budget made it split the model
        assert main(["verify", spec, "--plan", str(out), "--fake-world-size", "8"]) == 0, capsys.readouterr()
        assert "PASS" in capsys.readouterr().out


def test_the_issue_model_at_a_small_width_under_every_budget_auto_can_meet() -> None:
    """64 wide, auto under budgets from its memory floor up to its unconstrained plan's peak: every plan runs
    (the reported plan grouped ``[layer, linear]``, leaving ``layer.proc``, called first by the parent, sharded)."""
    from fsdp_planner.models import resolve_factory

    with torch.device("meta"):
        model, inputs = resolve_factory(ISSUE_MODEL)(width=64)
    tr = record(model, inputs)
    cluster = parse_cluster("h100:8")
    free = AutoPolicy(cluster).search(tr)
    low, high = free.min_peak, free.report.reserved_memory
    plans = [AutoPolicy(cluster, int(low + (high - low) * k / 8)).plan(tr) for k in range(9)]
    for plan in plans:
        check_plan_runs(tr, plan)
        assert ["layer", "linear"] not in [sorted(g.modules) for g in plan.groups]
    assert len({len(p.groups) for p in plans}) > 1  # the budgets did move the search


@pytest.mark.integration  # real FSDP2 on the fake process group, ~100 small trainings
def test_real_fsdp2_trains_every_returned_plan_and_exactly_the_random_plans_the_check_accepts() -> None:
    agreed: Counter[str] = Counter()
    for seed in SAMPLE:
        tr, _ = traced(seed)
        for o in policy_outcomes(tr, seed):
            if o.plan is not None:
                assert train_on_fake_ranks(seed, o.plan, o.world) is None, (seed, o.policy)
                agreed["returned plans trained"] += 1
        for plan in random_plans(tr, seed, 3):
            verdict, failure = refusal(tr, plan), train_on_fake_ranks(seed, plan)
            assert (verdict is None) == (failure is None), (seed, [g.modules for g in plan.groups], verdict, failure)
            agreed["accepted and trained" if failure is None else "refused and failed"] += 1
    assert agreed["accepted and trained"] >= 10 and agreed["refused and failed"] >= 5, agreed
