"""FSDP2 schedule replay on hand-checkable cases."""

from __future__ import annotations

from pathlib import Path

from conftest import traced

from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.collectives import CollectiveKind
from fsdp_planner.models import load_model
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.trace import trace

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
    tr = trace(lm.model, lm.example_inputs)
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
    prefetched = [plan.groups[c.group].modules for c in sched.collectives if c.prefetch]
    assert prefetched == [["layers.3"], ["layers.2"], ["layers.1"], ["layers.0"], ["tok_embeddings"]]


def test_int_reshard_keeps_a_partial_shard():
    tr = traced("toy-llama")
    plan = make_plan(tr, [[f"layers.{i}"] for i in range(4)], [4, 4, 4, 4])
    sched = build_schedule(tr, plan, world_size=16)
    bwd_ag = [c for c in sched.collectives if c.kind == ALL_GATHER and c.backward and c.group < 4]
    assert bwd_ag and all(c.ranks == 4 for c in bwd_ag)
    assert any(r.divisor == 4 for r in sched.residency)
