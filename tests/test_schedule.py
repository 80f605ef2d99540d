"""FSDP2 schedule replay on hand-checkable cases."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conftest import traced

from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.models import load_model
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.trace import record

ALL_GATHER, REDUCE_SCATTER = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER

FIXTURES = Path(__file__).parent / "fixtures"


def counts(tr, plan):
    m = plan_metrics(tr, plan)
    return m.all_gathers, m.reduce_scatters


def test_one_group_root_only(seed_trace):
    plan = make_plan(seed_trace, [])
    assert counts(seed_trace, plan) == (1, 1)  # root: gathered once, never resharded, one reduce-scatter
    m = plan_metrics(seed_trace, plan)
    assert m.peak_unsharded_bytes == seed_trace.nbytes
    assert m.all_gather_bytes == seed_trace.nbytes == m.reduce_scatter_bytes


def test_reshard_after_forward_true_vs_false(seed_trace):
    groups = [["conv1"], ["conv2"], ["fc1"], ["fc2"]]
    resharding = make_plan(seed_trace, groups, [True] * 4)
    keeping = make_plan(seed_trace, groups, [False] * 4)
    assert counts(seed_trace, resharding) == (8, 4)  # each gathered in forward and again in backward
    assert counts(seed_trace, keeping) == (4, 4)
    assert plan_metrics(seed_trace, keeping).peak_unsharded_bytes == seed_trace.nbytes
    assert plan_metrics(seed_trace, resharding).peak_unsharded_bytes < seed_trace.nbytes


def test_tied_group_gathered_once_per_pass():
    tr = traced("toy-gpt2-tied")
    plan = make_plan(tr, [["wte", "lm_head"]] + [[f"h.{i}"] for i in range(3)])
    sched = build_schedule(tr, plan)
    tied = [c for c in sched.collectives if c.group == 0]
    # list group: gathered at wte, held until lm_head finishes forward, gathered again for backward
    assert [(c.kind, c.backward) for c in tied] == [(ALL_GATHER, False), (ALL_GATHER, True),
                                                     (REDUCE_SCATTER, True)]


def test_module_called_twice_gathers_twice():
    lm = load_model(f"{FIXTURES / 'factories.py'}:twice")
    tr = record(lm.model, lm.example_inputs)
    plan = make_plan(tr, [["inp"], ["block"], ["out"]], [True, True, True])
    sched = build_schedule(tr, plan)
    block = [(c.kind, c.backward) for c in sched.collectives if c.group == 1]
    assert block.count((ALL_GATHER, False)) == 2
    assert block.count((ALL_GATHER, True)) == 2
    assert block.count((REDUCE_SCATTER, True)) == 1  # grad complete only after both calls' backward


def test_backward_prefetch_is_one_group_ahead():
    tr = traced("toy-llama")
    plan = make_plan(tr, [["tok_embeddings"]] + [[f"layers.{i}"] for i in range(4)] + [["norm", "output"]])
    sched = build_schedule(tr, plan)
    prefetched = [list(plan.groups[c.group].modules) for c in sched.collectives if c.prefetch]
    assert prefetched == [["layers.3"], ["layers.2"], ["layers.1"], ["layers.0"], ["tok_embeddings"]]


def test_int_reshard_keeps_a_partial_shard():
    tr = traced("toy-llama")
    plan = make_plan(tr, [[f"layers.{i}"] for i in range(4)], [4, 4, 4, 4])
    sched = build_schedule(tr, plan, world_size=16)
    bwd_ag = [c for c in sched.collectives if c.kind == ALL_GATHER and c.backward and c.group < 4]
    assert bwd_ag and all(c.ranks == 4 for c in bwd_ag)
    assert any(r.divisor == 4 for r in sched.residency)


def fixture_trace(name):
    lm = load_model(f"{FIXTURES / 'factories.py'}:{name}")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def test_params_without_a_gradient_are_not_reduce_scattered():
    """The routers' outputs are unused: autograd gives their params no grad, and FSDP2 reduces only grads."""
    tr = fixture_trace("unused_outputs")
    assert {p.fqn for p in tr.params if not p.gets_grad} == {f"blocks.{i}.router.{w}" for i in range(3)
                                                             for w in ("weight", "bias")}
    plan = make_plan(tr, [[f"blocks.{i}"] for i in range(3)] + [["head"]])
    reduced = {tr.params[p].fqn for c in build_schedule(tr, plan).collectives if c.kind is REDUCE_SCATTER
               for p in c.params}
    assert not any("router" in p for p in reduced) and "blocks.0.lin.weight" in reduced


def test_pre_backward_found_inside_dataclass_outputs():
    tr = fixture_trace("dataclass_outputs")
    entered = [e.module for e in tr.events if e.kind.value == "bwd_pre"]
    assert {"blocks.0", "blocks.1", "blocks.2"} <= set(entered)
    plan = make_plan(tr, [["inp"], *[[f"blocks.{i}"] for i in range(3)], ["head"]])
    backward_gathers = [c for c in build_schedule(tr, plan).collectives if c.kind is ALL_GATHER and c.backward]
    assert {plan.groups[c.group].modules[0] for c in backward_gathers} >= {"blocks.0", "blocks.1", "blocks.2"}


def test_group_that_claims_nothing_does_not_take_part_in_backward_prefetch(seed_trace):
    """A fully_shard call that claims no params (a plan file may list dropout1) makes no FSDP param group: it never
    enters the post-forward order, so default backward prefetch goes past it as if it were not there."""
    from fsdp_planner.fsdp2.claim import claimed_params
    from fsdp_planner.fsdp2.plan import Group, Plan

    def plan_of(groups):
        plan = Plan([*(Group(list(g)) for g in groups), Group([""], [], False)], seed_trace.fingerprint,
                    seed_trace.numel)
        return plan.replace(groups=[dataclasses.replace(g, params=ps) for g, ps in
                                    zip(plan.groups, claimed_params(plan, seed_trace), strict=True)])

    def prefetched(plan):
        return [(plan.groups[c.group].modules[0], c.event) for c in build_schedule(seed_trace, plan).collectives
                if c.prefetch]

    layers = [["conv1"], ["conv2"], ["fc1"], ["fc2"]]
    with_empty = plan_of([*layers[:2], ["dropout1"], *layers[2:]])
    assert list(with_empty.groups[2].params) == []
    assert prefetched(with_empty) == prefetched(plan_of(layers)) != []


def test_a_simulated_plan_s_table_columns_are_in_the_simulation_s_dtype():
    """fp32 params simulated in bf16-mixed: the table's byte columns are the simulation's bf16 bytes (what its
    memory breakdown counts), not fp32 beside bf16, and the caption under them names the dtype."""
    import pytest

    from fsdp_planner.cli.render import comparison_table, metrics_dtype
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import simulate

    tr = traced("toy-llama")
    options = SimOptions()
    assert options.precision.gather_bytes == 2 and {p.itemsize for p in tr.params} == {4}
    plan = make_policy(PolicyRequest(PolicyName.TITAN)).plan(tr, "toy-llama")
    report = simulate(tr, plan, parse_cluster("h100:8"), options, timeline=False)
    own, simulated = plan_metrics(tr, plan, 8), plan_metrics(tr, plan, 8, options.precision)
    assert simulated.all_gather_bytes == report.all_gather_bytes == own.all_gather_bytes // 2
    assert simulated.peak_unsharded_bytes == own.peak_unsharded_bytes // 2
    assert simulated.avg_idle_bytes == pytest.approx(own.avg_idle_bytes / 2)
    assert report.memory_at_peak["unsharded_params"] <= simulated.peak_unsharded_bytes
    table = comparison_table("t", [(plan, simulated, report)], dtype=metrics_dtype(tr, options.precision))
    assert str(table.caption).startswith("AG bytes and unsharded in bf16 (the simulated precision")
    assert metrics_dtype(tr, None) == "fp32"
