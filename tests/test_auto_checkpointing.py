"""Auto's memory-budgeted checkpointing: per leading block none, op-level or full, the fastest that fits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import traced

from fsdp_planner.cli import main
from fsdp_planner.cli.render import ac_cell
from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import AutoPolicy, PolicyName, PolicyRequest, make_policy
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.sim.simulate import StepReport, simulate

SPEC = f"{Path(__file__).parent / 'fixtures' / 'ac_llama.py'}:ac_llama"
CLUSTER = parse_cluster("h100:8")


@pytest.fixture(scope="module")
def tr():
    return traced(SPEC)


def titan(tr, ac: ACMode) -> StepReport:
    return simulate(tr, make_policy(PolicyRequest(PolicyName.TITAN, checkpointing=ac)).plan(tr, ""), CLUSTER)


def first_k_full(tr, budget: int) -> StepReport | None:
    """torchtitan's grouping with the fewest leading blocks in full that fit, found by scanning every count."""
    plan = make_policy(PolicyRequest(PolicyName.TITAN)).plan(tr, "")
    blocks = block_instances(tr)
    for k in range(1, len(blocks) + 1):
        r = simulate(tr, plan.replace(activation_checkpointing=blocks[:k]), CLUSTER)
        if r.reserved_memory <= budget:
            return r
    return None


def budget_between(tr, frac: float) -> int:
    """A budget ``frac`` of the way from titan's peak with every block in full to its peak with every block
    op-level (above 1: op-level on every block fits)."""
    full, op = titan(tr, ACMode.FULL).reserved_memory, titan(tr, ACMode.OP).reserved_memory
    assert full < op < titan(tr, ACMode.NONE).reserved_memory  # the budgets below bind
    return int(full + frac * (op - full))


@pytest.mark.parametrize("frac", [0.1, 0.5, 0.9, 1.1])
def test_fits_and_beats_first_k_full_and_op_everywhere(tr, frac):
    budget = budget_between(tr, frac)
    result = AutoPolicy(CLUSTER, budget).search(tr, "")
    assert result.fits and result.report.reserved_memory <= budget
    by_hand = first_k_full(tr, budget)
    assert by_hand is not None and result.report.step_time <= by_hand.step_time * (1 + 1e-9)
    op = titan(tr, ACMode.OP)
    assert (op.reserved_memory <= budget) == (frac > 1)
    if op.reserved_memory <= budget:
        assert result.report.step_time <= op.step_time * (1 + 1e-9)


def test_mixes_op_and_full_where_that_is_fastest(tr):
    """Between the two peaks, op-level on every block does not fit and full alone recomputes too much: the first
    blocks in full (their activations live longest) and the next op-level beat the fewest in full by over 1%."""
    budget = budget_between(tr, 0.5)
    result = AutoPolicy(CLUSTER, budget).search(tr, "")
    plan = result.plan
    assert plan.activation_checkpointing and plan.selective_checkpointing
    blocks = block_instances(tr)
    full, op = len(plan.activation_checkpointing), len(plan.selective_checkpointing)
    assert list(plan.activation_checkpointing) == blocks[:full]
    assert list(plan.selective_checkpointing) == blocks[full:full + op]
    assert result.report.step_time < first_k_full(tr, budget).step_time * 0.99
    assert result.checkpointing is not None and result.checkpointing.setting.full and result.checkpointing.setting.op


def test_same_plan_twice(tr):
    budget = budget_between(tr, 0.5)
    first = AutoPolicy(CLUSTER, budget).search(tr, "")
    again = AutoPolicy(CLUSTER, budget).search(traced(SPEC), "")
    assert first.plan.to_json() == again.plan.to_json()
    assert first.checkpointing.tried.keys() == again.checkpointing.tried.keys()


def test_no_checkpointing_when_the_plan_fits_without(tr):
    result = AutoPolicy(CLUSTER, titan(tr, ACMode.NONE).reserved_memory).search(tr, "")
    assert result.fits and result.checkpointing is None
    assert not result.plan.activation_checkpointing and not result.plan.selective_checkpointing


@pytest.mark.integration  # about a second: the full suite runs it, the fast subset does not
def test_explain_and_the_table_show_the_choice(tr, capsys):
    budget = budget_between(tr, 0.5)
    plan = AutoPolicy(CLUSTER, budget).search(tr, "").plan
    full, op = len(plan.activation_checkpointing), len(plan.selective_checkpointing)
    assert ac_cell(plan) == f"{full} full + {op} op"  # the comparison table's AC column
    assert main(["plan", SPEC, "--policy", "auto", "--cluster", "h100:8", "--memory-budget", str(budget),
                 "--explain"]) == 0
    out = capsys.readouterr().out
    said = re.search(r"checkpointing: (\d+) full \+ (\d+) op titan of the first blocks; .* full alone \(\d+ full\)",
                     out)
    assert said is not None, out
    full, op = (fmt_count(int(n), "module") for n in said.groups())
    assert f"{full} checkpointed, {op} with op-level checkpointing" in out


class _Linear:
    """A stand-in evaluator whose step and memory are linear in the counts of full and op-level blocks (each full
    block frees 3 units and recomputes 0.3 s, each op-level one 2 and 0.1): the search's own logic, on a landscape
    whose best setting (the fewest blocks in full with every other op-level) lies between its grid's points."""

    def __init__(self, budget: float, full: int = 0, op: int = 0) -> None:
        self.budget, self.full, self.op = budget, full, op

    def checkpointing(self, modules, selective=None):  # type: ignore[no-untyped-def]
        return _Linear(self.budget, len(modules), len(selective or {}))

    def evaluate(self, plan, origin):  # type: ignore[no-untyped-def]
        from types import SimpleNamespace

        from fsdp_planner.planners.auto.evaluator import Candidate

        report = SimpleNamespace(step_time=10 + 0.3 * self.full + 0.1 * self.op,
                                 reserved_memory=100 - 3 * self.full - 2 * self.op)
        return Candidate(plan, report, origin)  # type: ignore[arg-type]

    def fits(self, c) -> bool:  # type: ignore[no-untyped-def]
        return c.report.reserved_memory <= self.budget


def test_the_full_count_search_walks_past_its_grid():
    """32 blocks, a budget of 29: full alone needs 24 blocks; with every other block op-level, 7 in full fit, the
    fastest setting. The grid (0, 6, 12, 18, 24) brackets it; steps that pay are taken again before halving, so the
    search reaches 7 (halving alone stopped at 8: llama3-8b at batch 2 on 8 H100s chose 9 full where 7 was 0.7%
    faster)."""
    from fsdp_planner.choices import DEFAULT_SAC_POLICY
    from fsdp_planner.planners.auto.checkpointing import CheckpointSearch, Setting

    ev = _Linear(29)
    blocks = [f"layers.{i}" for i in range(32)]
    start = ev.evaluate(None, "titan")
    choice = CheckpointSearch(ev, blocks, start, DEFAULT_SAC_POLICY).choose(24)  # type: ignore[arg-type]
    assert choice.setting == Setting(7, 25) and choice.full_only == Setting(24, 0)
