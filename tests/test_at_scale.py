"""``verify --plan-for``: a plan made for a large cluster (and a full-size model) carried onto a small job."""

from __future__ import annotations

import pytest
from conftest import traced

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches, make_plan
from fsdp_planner.fsdp2.plan import Mesh, check_plan_world_size
from fsdp_planner.planners.at_scale import onto_job


@pytest.fixture(scope="module")
def toy():
    return traced("toy-llama")


def test_a_full_size_model_s_groups_carry_onto_the_toy_by_module_name(toy):
    """Llama 3 8B's per-block plan on 8x8 HSDP, on toy-llama (the same code, 4 blocks) over 2 ranks: the blocks
    the toy has keep their groups, the deeper ones are left out, the layout is flat and an intra-node
    reshard_after_forward=8 reshards in full; the result is a valid plan for the toy, each step noted."""
    big = traced("llama3-8b")
    plan = make_plan(big, [["tok_embeddings"], *([f"layers.{i}"] for i in range(32)), ["norm", "output"]],
                     reshard=[True] * 33 + [8])
    plan = plan.replace(mesh=Mesh(8, 8))
    out, notes = onto_job(plan, big, toy, 2, "mapped")
    assert [list(g.modules) for g in out.groups] == [["tok_embeddings"], *([f"layers.{i}"] for i in range(4)),
                                               ["norm", "output"], [""]]
    assert [g.reshard_after_forward for g in out.inner_groups] == [True] * 6  # 8 cannot divide 2 ranks
    assert out.mesh is None and out.policy == "mapped" and not out.root.params
    check_plan_matches(out, toy)
    check_plan_world_size(out, 2)
    assert any("28 of the plan's 34 groups" in n for n in notes)
    assert any("HSDP layout 8x8 runs as plain FSDP over 2 ranks" in n for n in notes)
    assert any("reshard_after_forward=8" in n for n in notes)


def test_a_full_size_plan_s_prefetch_lists_follow_their_groups_onto_the_toy(toy):
    """Auto's plans prefetch explicitly: each list names groups by position, renumbered as the groups carry over;
    a target among the blocks the toy lacks is left out, said once (they were all dropped before)."""
    big = traced("llama3-8b")
    plan = make_plan(big, [["tok_embeddings"], *([f"layers.{i}"] for i in range(32)), ["norm", "output"]])
    plan = plan.with_group(1, forward_prefetch=[2, 3]).with_group(33, backward_prefetch=[32, 4])
    plan = plan.with_group(4, backward_prefetch=[3, 2]).with_group(0, forward_prefetch=[33])
    out, notes = onto_job(plan, big, toy, 2, "mapped")
    check_plan_matches(out, toy)
    assert list(out.groups[1].forward_prefetch) == [2, 3]  # layers.0 prefetches layers.1 and 2, as planned
    assert list(out.groups[4].backward_prefetch) == [3, 2]
    assert list(out.groups[5].backward_prefetch) == [4]  # norm/output: layers.31 left out, layers.3 kept
    assert list(out.groups[0].forward_prefetch) == [5]  # the embedding's target, norm/output, is group 5 now
    assert sum("prefetch" in n for n in notes) == 1


def test_a_plan_carried_onto_a_model_that_ties_what_it_kept_apart_joins_the_groups():
    """The planned model's embedding and output head are apart, the job's share one weight: make_plan joins their
    groups, and the prefetch lists follow the groups as they now are (an internal error before: a trial's own LM,
    tied when tiny)."""
    big = traced("tests/fixtures/tp_llama.py:llama3_8b_shaped")
    tied = traced("tests/fixtures/tp_llama.py:tied_llama")
    plan = make_plan(big, [["tok_embeddings"], ["layers.0"], ["layers.1"], ["output"]])
    plan = plan.with_group(1, forward_prefetch=[2]).with_group(3, backward_prefetch=[2])
    plan = plan.with_group(2, backward_prefetch=[1, 0])
    out, notes = onto_job(plan, big, tied, 2, "mapped")
    check_plan_matches(out, tied)
    at = {m: i for i, g in enumerate(out.groups) for m in g.modules}
    assert at["tok_embeddings"] == at["output"]  # joined: one weight
    assert list(out.groups[at["layers.0"]].forward_prefetch) == [at["layers.1"]]
    # the joined group holds the head's list (it was lost), and a list naming the embedding names the joined group
    assert list(out.groups[at["output"]].backward_prefetch) == [at["layers.1"]]
    assert list(out.groups[at["layers.1"]].backward_prefetch) == [at["layers.0"], at["output"]]
    assert any("the 4 groups carried over are regrouped on this model, as 3" in n for n in notes)
    assert not any("prefetch" in n for n in notes)  # (no target was left out)


def test_the_job_s_own_plan_keeps_its_groups_prefetch_and_sub_groups_that_fit(toy):
    plan = make_plan(toy, [[f"layers.{i}"] for i in range(4)], reshard=[True, 2, 4, False])
    plan = plan.replace(mesh=Mesh(2, 4))
    plan = plan.with_group(0, forward_prefetch=[1])
    out, notes = onto_job(plan, toy, toy, 2, "same")
    assert [list(g.modules) for g in out.groups] == [list(g.modules) for g in plan.groups]
    assert list(out.groups[0].forward_prefetch) == [1] and out.mesh is None
    assert [g.reshard_after_forward for g in out.inner_groups] == [True, 2, True, False]  # 4 > 2 ranks
    assert plan.mesh == Mesh(2, 4) and plan.groups[2].reshard_after_forward == 4  # the given plan is untouched
    assert len(notes) == 2


def test_a_plan_of_another_model_code_is_one_clear_error(toy):
    seed = traced("seed-net")
    plan = make_plan(seed, [["conv1"], ["fc1"]])
    with pytest.raises(PlannerError, match=r"^no group of the plan made for the larger model \(2 groups\) names"):
        onto_job(plan, seed, toy, 2, "x")


@pytest.mark.parametrize("args, message", [
    (["--policy", "titan", "--plan-for", "h100:64"], "--policy auto plans for: add --policy auto"),
    (["--policy", "auto", "--plan-model", "llama3-8b"], "--plan-model names the model auto plans for --plan-for"),
    (["--policy", "auto", "--plan-for", "h100:64", "--fake-world-size", "8"], "give --cluster instead"),
    (["--policy", "auto", "--plan-for", "h100:0"], "h100:0"),
])
def test_plan_for_misuse_is_one_line_before_any_work(args, message, capsys):
    from fsdp_planner.cli import main

    assert main(["verify", "toy-llama", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
