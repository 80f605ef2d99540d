"""The simulator's step of a plan with expert parallelism (``sim/expert_parallel.py``) against real EP + FSDP2 on
torch's fake process group: the expert modules distributed over ``ep`` with all-to-all dispatch and combine
(``apply/expert_parallel.py``, torchtitan's ``ExpertParallel``), each ``fully_shard``-ed over the EP-reduced mesh,
the rest over the whole data-parallel mesh; real training steps. FSDP2's collectives and EP's all-to-alls counted
exactly, the peak within 5%."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import launch_env, max_abs_diff, run_main

from fsdp_planner import api
from fsdp_planner.choices import SacPolicy
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.expert_groups import with_expert_groups
from fsdp_planner.fsdp2.expert_parallel import ExpertParallel, expert_parallel_from_dict
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.tensor_parallel import TPStyle
from fsdp_planner.hardware.all_to_all import all_to_all_cost
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.planners.tensor_parallel import titan_moe_layout
from fsdp_planner.sim.expert_parallel import ep_view
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record

TINY = "tests/fixtures/ep_moe.py:tiny_mixtral"
BF16 = SimOptions.named("bf16-mixed")
EXPERTS = ("layers.*.moe.experts",)


def _traced(spec: str = TINY):
    lm = load_model(spec)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=BF16.precision.trace_dtype)


def _ep_plan(tr, degree: int, checkpointing: bool = False, tp: int = 1,  # type: ignore[no-untyped-def]
             sac: SacPolicy | None = None, per_param: bool = False) -> Plan:
    plan = TorchtitanPolicy("MoEBlock").plan(tr)
    blocks = [m for m in tr.modules if m.count(".") == 1]
    if checkpointing:
        plan = plan.replace(activation_checkpointing=blocks)
    if sac is not None:
        plan = plan.replace(selective_checkpointing=dict.fromkeys(blocks, sac))
    if tp > 1:
        plan = plan.replace(tensor_parallel=titan_moe_layout(tp))
    return with_expert_groups(plan.replace(expert_parallel=ExpertParallel(degree, EXPERTS, per_param_mesh=per_param)),
                              tr)


def _check(degree: int, world: int = 8, checkpointing: bool = False, replicate: int = 1,
           tp: int = 1, sac: SacPolicy | None = None, all_to_alls: int = 0, per_param: bool = False) -> tuple[int, int]:
    """The fake-world check (``run_fake_world``, which applies the plan with ``apply_plan``) beside the
    prediction: FSDP2's collectives and EP's all-to-alls exact, no other collective without TP (no TP rows); under
    HSDP (``replicate`` > 1) every group's grads all-reduced too, the experts' over dp_replicate. With TP
    (torchtitan's MoE layout, EP's ranks spanning the TP ranks) TP's collectives exact too."""
    from fsdp_planner.fsdp2.plan import Mesh
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    tr = _traced()
    plan = _ep_plan(tr, degree, checkpointing, tp, sac, per_param)
    plan = plan.replace(mesh=Mesh(replicate, world // replicate // tp))
    predicted = simulate(tr, plan, parse_cluster(f"h100:{world}"), BF16, timeline=False)
    measured = run_fake_world(TINY, plan, world, BF16.precision)
    rows = beside_prediction(predicted, measured)
    # EP adds no collective but all-to-alls; with TP, DTensor's (the MoE layer's input all-gathered and output
    # reduce-scattered, the router gate's grads all-reduced) beside the attention's
    assert (measured.tp_counts is None) == (tp == 1)
    # HSDP: every group's grads all-reduced over dp_replicate (the experts' too where their shard dim is one rank,
    # with no reduce-scatter before)
    assert measured.counts["all_reduce"] >= measured.counts["reduce_scatter"] if replicate > 1 else \
        measured.counts["all_reduce"] == 0
    # 2 blocks, each a dispatch and a combine in forward and their grads' in backward; recomputed: forward's again
    assert rows["ep_all_to_alls"][1] == (all_to_alls or 2 * (6 if checkpointing else 4))
    for key, (p, m) in rows.items():
        if key != "peak_memory":
            assert p == m, key
    return rows["peak_memory"]


@pytest.mark.integration  # real EP + FSDP2 on fake ranks: seconds each
@pytest.mark.parametrize(("degree", "world", "checkpointing", "replicate"), [
    (2, 8, False, 1), (4, 8, False, 1), (8, 8, False, 1), (4, 8, True, 1), (8, 64, False, 1),
    # 4 x 32 with full AC: 7,522,616 bytes predicted against 7,522,716 measured when last looked at (-6.5% while
    # the experts' all-gather output, kept through their recomputed forward, was counted nowhere)
    (4, 32, True, 1), (4, 8, False, 2), (4, 32, True, 4)])
def test_ep_step_matches_real_ep_and_fsdp2(degree: int, world: int, checkpointing: bool, replicate: int) -> None:
    """EP 2 / 4 / 8 on 8 fake ranks (the experts' FSDP mesh 4 / 2 / 1 ranks), EP 8 on 64, and under full
    checkpointing, whose recomputed forwards run their all-to-alls again; EP x HSDP 2x4 (the experts' mesh
    2 x 1: EP takes dp_shard whole, and FSDP2 divides the one-rank reduce through a quotient of its input) and
    4x8 (4 x 2), EP's ranks out of dp_shard as torchtitan takes them."""
    predicted, measured = _check(degree, world, checkpointing=checkpointing, replicate=replicate)
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.integration  # real EP + FSDP2 on fake ranks: seconds each
@pytest.mark.parametrize(("degree", "world", "checkpointing", "replicate", "tp"), [
    (2, 8, False, 1, 1), (4, 8, True, 1, 1), (8, 8, False, 1, 1), (4, 32, True, 4, 1), (2, 8, False, 2, 1),
    (4, 8, False, 2, 1), (4, 8, False, 1, 2), (4, 16, False, 2, 2),
    # +0.4% (+6.1% while the block's checkpointed forward was re-created at its pre-backward, beside the
    # all-gather outputs FSDP2's hook frees before the recomputation, which runs at the MoE's pre-backward)
    (4, 32, True, 1, 2)])
def test_experts_in_their_blocks_calls_match_real_fsdp2(degree: int, world: int, checkpointing: bool, replicate: int,
                                                        tp: int) -> None:
    """The experts sharded in their block's fully_shard call on a per-param mesh (torchtitan's apply_fsdp since
    pytorch/torchtitan#2281): FSDP2 makes them the call's second param group, gathered and reduced at the block's
    hooks, its backward prefetch walking back past the block's own groups, a reduce-scatter input kept until the
    call's last param group reduces, the final callback's groups the last first. Counts and bytes exact, the peak
    within 5% (within 0.9% on each when last looked at)."""
    predicted, measured = _check(degree, world, checkpointing=checkpointing, replicate=replicate, tp=tp,
                                 per_param=True)
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.integration  # real EP + FSDP2 on fake ranks: seconds each
@pytest.mark.parametrize(("per_param", "sync", "world", "replicate"), [
    (True, "every", 8, 1), (True, "every", 4, 1), (False, "every", 8, 1), (True, "last", 8, 1),
    (True, "every", 8, 2)])
def test_ep_micro_batches_match_real_fsdp2(per_param: bool, sync: str, world: int, replicate: int) -> None:
    """EP 2 with 2 micro-batches a step: each reduce-scattering (torchtitan's train_step) or the last only. With
    the experts in their blocks' calls, a block's hook reduces two param groups, each output added into the
    sharded grads and freed before the hook returns (once counted in the next hook, beside its all-gather: +5.8%
    on 8 ranks, +5.4% on 4, a verify FAIL); under HSDP each is kept, all-reduced, to the end of backward.
    Counts and bytes exact (x 2), the peak within 5%."""
    from dataclasses import replace

    from fsdp_planner.fsdp2.plan import Mesh
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world
    from fsdp_planner.sim.options import GradientSync

    tr = _traced()
    plan = _ep_plan(tr, 2, per_param=per_param).replace(mesh=Mesh(replicate, world // replicate))
    options = replace(BF16, micro_batches=2, gradient_sync=GradientSync(sync))
    predicted = simulate(tr, plan, parse_cluster(f"h100:{world}"), options, timeline=False)
    measured = run_fake_world(TINY, plan, world, BF16.precision, micro_batches=2, gradient_sync=GradientSync(sync))
    rows = beside_prediction(predicted, measured)
    assert rows["ep_all_to_alls"][1] == 2 * 2 * 4  # 2 micro-batches of 2 blocks' dispatch and combine, and grads
    assert measured.counts["reduce_scatter"] == (12 if sync == "every" else 6)
    for key, (p, m) in rows.items():
        if key != "peak_memory":
            assert p == m, key
    # seen: +0.7%, -1.6%, -1.3%, +0.5%, +0.5% (HSDP: -6.6% while freed in the hook)
    assert rows["peak_memory"][0] == pytest.approx(rows["peak_memory"][1], rel=0.05)


@pytest.mark.parametrize(("sac", "all_to_alls"), [(SacPolicy.TITAN, 8), (SacPolicy.TITAN_2025, 12)])
def test_op_level_checkpointing_saves_the_all_to_alls_as_torchtitan_does(sac: SacPolicy, all_to_alls: int) -> None:
    """torchtitan's SelectiveAC saves ``all_to_all_single``'s output: EP 4 on 8 fake ranks under it sends each
    block's dispatch and combine once (8 all-to-alls in 2 blocks, as without checkpointing); under its llama3 list
    of 2025, which does not name them, the recomputation sends the forward ones again (12). Counts and bytes exact, the
    peak within 5%."""
    predicted, measured = _check(4, 8, sac=sac, all_to_alls=all_to_alls)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_ep_x_tp_step_matches_real_ep_tp_and_fsdp2() -> None:
    """EP 4 x TP 2 on 8 fake ranks (torchtitan's expert TP 1: EP's group is 2 dp_shard ranks x 2 TP ranks, the
    experts' FSDP mesh 4 x 2 / 4 = 2 ranks): FSDP2's, TP's and EP's collectives exact, the peak within 5%."""
    predicted, measured = _check(4, 8, tp=2)
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.integration  # real EP x TP + FSDP2 on fake ranks: seconds each
@pytest.mark.parametrize(("degree", "world", "checkpointing", "replicate", "tp"), [
    (2, 8, False, 1, 2), (8, 8, False, 1, 2), (4, 16, False, 1, 2), (4, 32, True, 1, 2), (8, 16, False, 1, 4),
    (4, 16, False, 2, 2)])
def test_ep_x_tp_on_more_layouts(degree: int, world: int, checkpointing: bool, replicate: int, tp: int) -> None:
    """EP inside one TP group (EP 2 x TP 2: dp_shard gives none), EP over the whole world (EP 8, the experts
    unsharded by FSDP), 16 and 32 ranks with full checkpointing, TP 4, and EP x TP under HSDP."""
    predicted, measured = _check(degree, world, checkpointing=checkpointing, replicate=replicate, tp=tp)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_ep_x_tp_plan_round_trips_and_its_refusals() -> None:
    """An EP x TP plan keeps both through JSON (its mesh dims torchtitan's: EP's group dp_shard_in_ep x tp); EP
    whose TP layout does not split the experts' tokens, EP not a multiple of TP, or EP / TP not dividing dp_shard
    are refused in one sentence each."""
    from fsdp_planner.fsdp2.plan import check_plan_world_size
    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
    from fsdp_planner.sim.tensor_parallel import tp_view

    tr, cluster = _traced(), parse_cluster("h100:8")
    plan = _ep_plan(tr, 4, tp=2)
    again = Plan.from_json(plan.to_json())
    assert (again.expert_parallel, again.tensor_parallel) == (plan.expert_parallel, plan.tensor_parallel)
    assert plan.mesh_dims(16) == {"dp_shard_mod_ep": 4, "dp_shard_in_ep": 2, "tp": 2}
    unsplit = TensorParallel(2, {k: v for k, v in plan.tensor_parallel.layout.items() if not k.endswith("experts")})
    with pytest.raises(PlannerError, match="split the experts' routed tokens"):
        simulate(tr, plan.replace(tensor_parallel=unsplit), cluster, BF16)
    assert tp_view(tr, plan.tensor_parallel, cluster).trace.tp_degree == 2
    with pytest.raises(PlannerError, match="not a multiple of its TP degree 4"):
        check_plan_world_size(_ep_plan(tr, 2, tp=1).replace(tensor_parallel=titan_moe_layout(4)), 8)
    with pytest.raises(PlannerError, match="does not divide its 2 data-parallel shard ranks"):
        check_plan_world_size(_ep_plan(tr, 8, tp=2), 4)


def test_plan_json_round_trip_and_refusals() -> None:
    tr = _traced()
    plan = _ep_plan(tr, 4)
    again = Plan.from_json(plan.to_json())
    assert again.expert_parallel == plan.expert_parallel and again.signature() == plan.signature()
    assert plan.mesh_dims(8) == {"dp_shard_mod_ep": 2, "dp_shard_in_ep": 4}
    assert plan.signature() != plan.replace(expert_parallel=ExpertParallel(2, EXPERTS)).signature()
    for bad, match in [({"degree": 0, "modules": ["a"]}, "degree"), ({"degree": 2, "modules": []}, "no modules"),
                       ({"degree": 2, "modules": ["a..b"]}, "modules"), ({"degree": 2, "modules": ["a"], "skew": 3},
                                                                        "skew"), ({"degree": 2, "x": 1}, "keys")]:
        with pytest.raises(PlannerError, match=match):
            expert_parallel_from_dict(bad)
    with pytest.raises(PlannerError, match="matches no module"):
        ExpertParallel(2, ("layers.*.mlp.experts",)).experts(tr.modules)


def test_experts_get_their_own_groups_and_a_mixed_group_is_refused() -> None:
    tr = _traced()
    titan = TorchtitanPolicy("MoEBlock").plan(tr)
    plan = _ep_plan(tr, 4)
    alone = [g.modules for g in plan.groups if g.modules[0].endswith("moe.experts")]
    assert alone == [("layers.0.moe.experts",), ("layers.1.moe.experts",)]
    assert len(plan.groups) == len(titan.groups) + 2
    with pytest.raises(PlannerError, match="own group"):
        simulate(tr, titan.replace(expert_parallel=ExpertParallel(4, EXPERTS)), parse_cluster("h100:8"), BF16)


def test_ep_shrinks_expert_memory_and_skew_slows_the_step() -> None:
    """Experts' unsharded params / EP while gathered; a skewed routing makes the busiest rank's experts do more."""
    tr = _traced()
    cluster = parse_cluster("h100:8")
    fsdp = simulate(tr, TorchtitanPolicy("MoEBlock").plan(tr), cluster, BF16, timeline=False)
    ep = simulate(tr, _ep_plan(tr, 8), cluster, BF16, timeline=False)
    skewed_plan = _ep_plan(tr, 8)
    skewed = simulate(tr, skewed_plan.replace(expert_parallel=ExpertParallel(8, EXPERTS, skew=2.0)), cluster, BF16,
                      timeline=False)
    assert ep.all_gather_bytes < fsdp.all_gather_bytes / 3
    assert "ep_degree" not in fsdp.summary() and ep.summary()["ep_degree"] == 8 and ep.ep_time > 0
    assert skewed.compute_time > ep.compute_time and skewed.ep_time > ep.ep_time


def test_all_to_all_cost_inside_a_node_and_across() -> None:
    """One node: (r-1)/N of the buffer over NVLink; across nodes the off-node share at the NICs' rate is slower."""
    one = all_to_all_cost(parse_cluster("h100:8"), 8)
    two = all_to_all_cost(parse_cluster("h100:16"), 16)
    size = 64 * 2**20
    assert one.link == "intra" and two.link == "inter"
    assert one.seconds(size) == pytest.approx(one.alpha + size * 7 / 8 / 370e9)
    assert two.seconds(size) > one.seconds(size)
    assert all_to_all_cost(parse_cluster("h100:8"), 1).seconds(size) == 0.0


def test_expert_modules_found_and_degrees_divide_experts_and_shard() -> None:
    from fsdp_planner.planners.expert_parallel import ep_degrees, expert_modules, with_expert_parallel

    tr = _traced()
    assert expert_modules(tr) == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert ep_degrees(tr, 8) == [1, 2, 4, 8] and ep_degrees(tr, 12) == [1, 2, 4]
    plan = with_expert_parallel(TorchtitanPolicy("MoEBlock").plan(tr), tr, 4)
    assert plan.groups == _ep_plan(tr, 4).groups and plan.ep_degree == 4
    assert ep_degrees(_traced("toy-llama"), 8) == [1]


def test_ep_screen_simulates_each_degree_and_picks_the_fastest_that_fits() -> None:
    from fsdp_planner.planners.expert_parallel import best_ep_option, ep_options

    tr = _traced()
    cluster = parse_cluster("h100:8")
    plan = TorchtitanPolicy("MoEBlock").plan(tr)
    found = ep_options(tr, plan, cluster, BF16)
    # each degree: the experts in their blocks' calls (torchtitan's), then in calls of their own; resharded or kept
    assert [(o.degree, o.keep_experts, o.plan.expert_parallel.per_param_mesh if o.degree > 1 else None)
            for o in found] == [(1, False, None)] + [(d, keep, per_param) for d in (2, 4, 8)
                                                     for per_param in (True, False) for keep in (False, True)]
    again = simulate(tr, found[3].plan, cluster, BF16, timeline=False)  # on the view as on the whole trace
    assert again.summary() == found[3].step.summary()
    best = best_ep_option(found, 2**40)
    assert best is not None and best.step.step_time == min(o.step.step_time for o in found)
    assert best_ep_option(found, 1) is None


def test_ep_in_the_blocks_calls_of_a_plan_resharding_to_an_int_reshards_those_calls_whole() -> None:
    """A call resharding to an int holds no experts on a per-param mesh, and the screen skipped the plan under the
    blocks' placement asked for (a torchtitan registry job's): auto's flat layout then had no EP option, and auto
    chose a slower HSDP one (a trial's Qwen3-30B-A3B job, 10% slower than the job's one-key edit). The plan is tried
    with those calls resharded whole."""
    from fsdp_planner.planners.expert_parallel import ep_options

    tr = _traced()
    plan = TorchtitanPolicy("MoEBlock").plan(tr).with_group(1, reshard_after_forward=2)
    found = ep_options(tr, plan, parse_cluster("h100:8"), BF16, degrees=(2,), per_param=(True,))
    assert [(o.degree, o.degree > 1 and o.plan.expert_parallel.per_param_mesh) for o in found] == \
        [(1, False), (2, True), (2, True)]
    assert not any(isinstance(g.reshard_after_forward, int) and not isinstance(g.reshard_after_forward, bool)
                   for o in found for g in o.plan.groups[:-1] if o.degree > 1)
    own = ep_options(tr, plan, parse_cluster("h100:8"), BF16, degrees=(2,), per_param=(False,))
    assert 2 in [g.reshard_after_forward for g in own[1].plan.groups]  # in the experts' own calls the int is kept


def test_ep_checkpoints_only_what_it_still_needs() -> None:
    """The EP option chosen checkpoints the fewest of its modules that fit (EP shrinks the experts' shards, so the
    search's checkpointing for the step without EP can be more than it needs: Qwen3-30B-A3B on 32 H100s kept 12
    blocks op-level, 4% slower): none with room, the fewest that fit with less, all where nothing less fits."""
    from fsdp_planner.planners.expert_parallel import EPOption, _relaxed_checkpointing
    from fsdp_planner.sim.expert_parallel import ep_view

    tr = _traced()
    cluster = parse_cluster("h100:8")
    plan = _ep_plan(tr, 2, checkpointing=True)
    view = ep_view(tr, plan).trace
    run = lambda p: simulate(view, p, cluster, BF16, timeline=False)  # noqa: E731
    best = EPOption(2, False, plan, run(plan))
    blocks = list(plan.activation_checkpointing)
    peaks = [run(plan.replace(activation_checkpointing=blocks[:n])).reserved_memory for n in range(len(blocks) + 1)]
    assert peaks[0] > max(peaks[1:])  # checkpointing none holds most
    roomy = _relaxed_checkpointing(best, view, cluster, BF16, lambda b: True)
    assert roomy.plan.activation_checkpointing == () and roomy.step.step_time < best.step.step_time
    tight = _relaxed_checkpointing(best, view, cluster, BF16, lambda b: b < peaks[0])
    assert tight.plan.activation_checkpointing == tuple(blocks[:1]) and tight.step.reserved_memory == peaks[1]
    assert tight.step.step_time < best.step.step_time
    assert _relaxed_checkpointing(best, view, cluster, BF16, lambda b: b <= min(peaks[1:]) - 1) is best


def test_ep_keeps_the_checkpointing_the_user_fixed(capsys) -> None:
    """``--ac full`` is every plan's checkpointing (the option's help): EP's relaxation leaves it as given."""
    import json

    from fsdp_planner.cli import main

    assert main(["plan", TINY, "--policy", "auto", "--cluster", "h100:8", "--ep", "2", "--ac", "full", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]["plan"]
    assert len(plan["activation_checkpointing"]) == 2 and plan["policy"].endswith("EP 2")


def test_auto_ep_screen_combines_ep_with_auto_hsdp_layouts() -> None:
    """On 2 nodes auto's layouts include HSDP 2x8: its EP screen tries EP on that layout's plan too (EP's ranks out
    of its dp_shard), each option simulated as simulate() gives it, and takes the fastest that fits of them all."""
    from fsdp_planner.choices import PolicyName
    from fsdp_planner.fsdp2.plan import Mesh
    from fsdp_planner.planners.expert_parallel import hsdp_ep_options
    from fsdp_planner.planners.registry import PolicyRequest
    from fsdp_planner.service.planning import Reporter, search

    notes: list[str] = []
    tr = _traced()
    cluster = parse_cluster("h100:16")
    result = search(tr, PolicyRequest(PolicyName.AUTO), cluster, BF16, ModelSpec(TINY), Reporter(note=notes.append))
    assert Mesh(2, 8) in {c.plan.mesh for c in result.meshes.values()}
    screen = next(n for n in notes if n.startswith("auto's EP screen"))
    assert " on 2x8 " in screen  # the best EP option of the HSDP layout, beside every one of auto's own

    hsdp = hsdp_ep_options(result, tr, cluster, BF16, {})
    assert hsdp and all(o.plan.mesh == Mesh(2, 8) and o.degree in (2, 4, 8) for o in hsdp)
    again = simulate(tr, hsdp[0].plan, cluster, BF16, timeline=False)
    assert again.step_time == hsdp[0].step.step_time and again.all_reduces > 0
    assert result.report.step_time <= min(o.step.step_time for o in hsdp if result.memory.fits(
        o.step.reserved_memory))


def test_ep_through_the_api_for_auto_and_a_classic_policy() -> None:
    """``ep=`` (``--ep``): auto's groups under EP (experts alone, resharded or kept, the faster that fits), a classic
    policy's too; a model without grouped experts, or a degree 0, is refused in one sentence."""

    auto = api.plan(TINY, cluster="h100:8", policy="auto", ep=4)
    titan = api.plan(TINY, cluster="h100:8", policy="titan", ep=2)
    for plan, degree in ((auto, 4), (titan, 2)):
        assert plan.ep_degree == degree and "EP" in plan.policy and plan.expert_parallel.per_param_mesh
        # the experts a fully_shard call holds (each block's; auto's root holds both blocks) in one group
        experts = {g.modules for g in plan.groups if "moe.experts" in g.modules[0]}
        assert experts in ({("layers.0.moe.experts",), ("layers.1.moe.experts",)},
                           {("layers.0.moe.experts", "layers.1.moe.experts")}), experts
        assert Plan.from_json(plan.to_json()).expert_parallel == plan.expert_parallel
    with pytest.raises(PlannerError, match="grouped experts"):
        api.plan("toy-llama", cluster="h100:8", policy="titan", ep=2)
    with pytest.raises(PlannerError, match="ep"):
        api.plan(TINY, cluster="h100:8", policy="titan", ep=0)
    # EP with TP: a classic policy's plan has both (torchtitan's MoE layout), auto's too (its groups screened
    # under the EP asked for, on one TP rank's view)
    auto_both = api.plan(TINY, cluster="h100:8", policy="auto", ep=2, tp=2)
    experts = "layers.*.moe.experts"
    assert (auto_both.ep_degree, auto_both.tp_degree, auto_both.tensor_parallel.layout[experts]) == \
        (2, 2, TPStyle.TOKEN_SPLIT)
    both = api.plan(TINY, cluster="h100:8", policy="titan", ep=2, tp=2)
    assert (both.ep_degree, both.tp_degree, both.tensor_parallel.layout[experts]) == (2, 2, TPStyle.TOKEN_SPLIT)
    from fsdp_planner.report.step_view import BarKind, step_view

    tr, cluster = _traced(), parse_cluster("h100:8")  # its picture: one EP rank's step of one TP rank's
    view = step_view(tr, both, cluster, BF16)
    assert view.report.step_time == simulate(tr, both, cluster, BF16).step_time
    # its TP collectives and all-to-alls on a lane of their own, adding up to the report's seconds of each
    lane = view.lanes[-1]
    assert lane.name == "TP / EP"
    for kind, seconds in ((BarKind.TP_COLLECTIVE, view.report.tp_time), (BarKind.EP_ALL_TO_ALL, view.report.ep_time)):
        assert sum(b.seconds for b in lane.bars if b.kind is kind) == pytest.approx(seconds, rel=1e-9) and seconds
    with pytest.raises(PlannerError, match="must be a multiple of 2"):
        api.plan(TINY, cluster="h100:8", policy="titan", ep=1 + 2, tp=2)


@pytest.mark.integration  # ~10 s: two auto searches with their EP screens and a command
def test_auto_screens_ep_by_default_and_takes_the_fastest_that_fits(capsys, tmp_path) -> None:
    """Without ``--ep`` auto tries no EP and each degree the experts and shard ranks allow, notes each one's step,
    and keeps the fastest that fits; ``--ep 1`` keeps it off (issue 35: mixtral-8x7b on h100:64, 1.52 -> 1.04 s)."""
    import re

    from fsdp_planner import api, cli

    out = tmp_path / "plan.json"
    assert cli.main(["plan", TINY, "--policy", "auto", "--cluster", "h100:8", "--out", str(out)]) == 0
    screen = next(line for line in capsys.readouterr().err.splitlines() if "auto's EP screen" in line)
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
    options = {m[1]: (float(m[2]) * unit[m[3]], not m[4]) for m in re.finditer(
        r"(no EP|EP \d+(?: \((?:experts|experts' blocks) kept after forward\))?) ([\d.]+) (us|ms|s)"
        r"( \([^)]*does not fit\))?", screen)}
    assert {"no EP", "EP 2", "EP 4", "EP 8"} <= set(options)  # 8 experts on 8 shard ranks
    fastest = min((t, k) for k, (t, fits) in options.items() if fits)[1]
    chosen = Plan.from_json(out.read_text())
    assert (chosen.ep_degree, chosen.policy.endswith(fastest)) == (int(fastest.split()[1]), True) \
        if fastest != "no EP" else chosen.ep_degree == 1
    off = api.plan(TINY, cluster="h100:8", policy="auto", ep=1)
    assert off.ep_degree == 1 and "EP" not in off.policy


def test_transformers_experts_send_tokens_x_top_k_rows() -> None:
    """transformers' experts layer (dispatch inside it): each all-to-all is one rank's tokens x top_k rows x dim."""
    from fsdp_planner.planners.expert_parallel import expert_modules, with_expert_parallel

    small = (("num_hidden_layers", 2), ("hidden_size", 128), ("intermediate_size", 256), ("num_attention_heads", 4),
             ("num_key_value_heads", 2), ("vocab_size", 512))
    lm = load_model(ModelSpec("hf:mixtral-8x7b", hf_config=small, seq_len=256))
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=BF16.precision.trace_dtype)
    assert expert_modules(tr) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    r = simulate(tr, with_expert_parallel(TorchtitanPolicy().plan(tr), tr, 4), parse_cluster("h100:8"), BF16,
                 timeline=False)
    assert r.ep_all_to_alls == 2 * 4 and r.ep_all_to_all_bytes == 8 * 256 * 2 * 128 * 2  # tokens x top_k x dim x bf16


def _tiny_qwen3_moe(tmp_path) -> str:  # type: ignore[no-untyped-def]

    config = tmp_path / "qwen3_moe.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 128}))
    return f"hf:{config}"


@pytest.mark.integration  # real FSDP2 on 4 fake ranks: ~4 s
def test_transformers_packed_experts_zero_gradient_is_a_ranks_experts(tmp_path) -> None:
    """The backward of ``gate_up_proj[e]`` makes a zero gradient of the whole stacked param for autograd to add
    into its grad: on an EP rank that is its E / EP experts', not all of them (a new user's Qwen3-MoE at hidden
    512 and EP 2: +6.6% predicted against real FSDP2; OLMoE at EP 8, +5.0% at 1,024 tokens)."""
    config = tmp_path / "qwen3_moe_wide.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 128,
                                  "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "num_hidden_layers": 2, "vocab_size": 512}))
    r = run_main("verify", f"hf:{config}", "--policy", "titan", "--ep", "2", "--batch", "1", "--seq", "256",
                 "--fake-world-size", "4", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.03


@pytest.mark.integration  # real FSDP2 on 16 fake ranks: ~5 s
def test_every_stacked_expert_param_s_zero_gradient_is_a_ranks_experts(tmp_path) -> None:
    """Of each stacked param, not the largest alone: Mixtral's down_proj is half its gate_up_proj, and the zero
    gradient its backward makes was charged at all the experts (+9.3% here; +19% on a 1-layer Mixtral-8x7B at EP
    8 on 16 fake ranks, and +7% on auto's DeepSeek-V3 plan at 256: a trial's)."""
    config = tmp_path / "mixtral_wide.json"
    config.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 512, "intermediate_size": 4096,
                                  "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}))
    r = run_main("verify", f"hf:{config}", "--policy", "titan", "--ep", "8", "--batch", "1", "--seq", "256",
                 "--fake-world-size", "16", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.03


@pytest.mark.integration  # fake ranks, 4 gloo ranks under torchrun and an exported plan's 2: ~45 s
def test_transformers_experts_run_transformers_own_ep(tmp_path) -> None:
    """transformers' standard experts layers route inside their forward ((tokens, dim) in): apply runs their EP
    through transformers' own (its ``grouped_gemm`` params, its all-to-all dispatch with the routing's split
    sizes), so ``--ep`` plans them with a note on what the step does not price, verify trains them with parity on
    gloo (the experts' FSDP group of two ranks; the exported code's of one), the fake world counts EP's
    all-to-alls and bytes exactly (the recomputed ones too: the combine comes before the layer's own weighing of
    the rows, which saves its output) and the exported code trains with parity; EP x TP of them is refused in
    one line."""
    import subprocess
    import sys
    from pathlib import Path

    from fsdp_planner.models.hf_experts import UNPRICED_EP

    model = _tiny_qwen3_moe(tmp_path)
    verify = ["verify", model, "--policy", "titan", "--ep", "2", "--batch", "2", "--seq", "32", "--json"]
    for ac, a2a in (("none", 8), ("full", 12)):
        r = run_main(*verify, "--ac", ac, "--fake-world-size", "4")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        result = json.loads(r.stdout)
        assert result["ok"] and result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.05
        assert result["measured"]["ep_all_to_alls"] == a2a
    # 4 ranks, EP 2: the experts sharded over 2 (a reduce-scatter and its divide factor; the exported code below
    # runs them over 1)
    r = run_main(*verify, "--nproc", "4", "--steps", "2", "--precision", "fp32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["max_abs_diff"] <= 1e-5
    assert result["predicted"]["reduce_scatter"] > 0
    plan = tmp_path / "plan.json"
    r = run_main("plan", model, "--policy", "titan", "--ep", "2", "--cluster", "h100:2", "--precision", "fp32",
                 "--out", str(plan))
    assert r.returncode == 0 and "EP 2" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert UNPRICED_EP in " ".join(r.stderr.split()) and "not applied" not in r.stderr
    code = tmp_path / "ep_plan.py"
    r = run_main("export", str(plan), "--format", "python", "--precision", "fp32", "--out", str(code))
    assert r.returncode == 0 and "transformers.distributed.expert_parallel" in code.read_text(), r.stderr
    root = Path(__file__).resolve().parents[1]
    env = launch_env(tmp_path, PYTHONPATH=str(root / "src"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(root / "examples" / "torchrun_fsdp2.py"), str(code), model],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert max_abs_diff(out.stdout) <= 1e-5
    r = run_main("plan", model, "--policy", "titan", "--ep", "2", "--tp", "2", "--cluster", "h100:4")
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()[-1]) > 20


@pytest.mark.integration  # an export through the command line: ~8 s
def test_other_transformers_experts_ep_is_simulated_and_refused(tmp_path) -> None:
    """Experts layers transformers' EP does not run (Llama 4's take pre-routed rows), or that it cannot split:
    ``--ep`` simulates them with a note saying so, auto screens them only where nothing fits, and apply, export
    and verify refuse them in one sentence before anything runs (the ranks failed inside the dispatch before)."""
    from fsdp_planner.apply.expert_parallel import check_experts_run
    from fsdp_planner.models.hf_experts import OTHER_EXPERTS

    llama4 = "hf:tests/fixtures/llama4_tiny.json"
    plan = tmp_path / "plan.json"
    r = run_main("plan", llama4, "--policy", "titan", "--ep", "2", "--cluster", "h100:2", "--seq", "32",
                 "--out", str(plan))
    assert r.returncode == 0 and OTHER_EXPERTS in " ".join(r.stderr.split()), r.stdout[-2000:] + r.stderr[-2000:]
    r = run_main("export", str(plan))
    assert r.returncode != 0 and "not one of transformers' standard experts layers" in r.stderr
    assert "Traceback" not in r.stderr
    # a job refuses it in one sentence, not a note saying the same before it
    r = run_main("verify", llama4, "--plan", str(plan), "--seq", "32", "--fake-world-size", "2")
    assert r.returncode != 0 and " ".join(r.stderr.split()).count(OTHER_EXPERTS) == 0, r.stderr[-2000:]
    assert r.stderr.count("not one of transformers' standard experts layers") == 1
    lm = load_model(ModelSpec(_tiny_qwen3_moe(tmp_path), seq_len=32), meta=False)
    modules = dict(lm.model.named_modules())
    check_experts_run(modules, ["model.layers.0.mlp.experts"], 2, 1)
    with pytest.raises(PlannerError, match="without tensor parallelism"):
        check_experts_run(modules, ["model.layers.0.mlp.experts"], 2, 2)
    with pytest.raises(PlannerError, match="4 experts, which expert parallelism of degree 3"):
        check_experts_run(modules, ["model.layers.0.mlp.experts"], 3, 1)


def test_builtin_experts_all_to_alls_sit_at_their_boundaries() -> None:
    """The built-in's experts take their routed rows and give them back ((experts, tokens per expert, dim)): EP's
    dispatch comes right after the call's pre-forward (before a view costing nothing that leads the call), its
    combine right before its post-forward, as torchtitan's input and output hooks run them."""
    from fsdp_planner.sim.expert_parallel import ep_positions, ep_view
    from fsdp_planner.trace.events import EventKind

    tr = _traced()
    view = ep_view(tr, _ep_plan(tr, 2)).trace
    forward = [p for p in ep_positions(view).tolist() if not view.events[p].backward]
    assert len(forward) == 4
    for dispatch, combine in zip(forward[::2], forward[1::2], strict=True):
        assert view.events[dispatch - 1].kind is EventKind.FWD_PRE
        assert view.events[combine + 1].kind is EventKind.FWD_POST


def test_experts_with_biases_take_expert_parallelism(tmp_path) -> None:
    """gpt-oss's experts hold 2-D biases ([E, 2I], [E, H]) beside their stacked 3-D weights: still grouped experts,
    every param sharded on the expert dim (they were taken for no experts: "--ep needs grouped experts modules")."""

    from fsdp_planner.planners.expert_parallel import expert_modules, with_expert_parallel

    pytest.importorskip("transformers")
    config = {"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
              "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 64}
    path = tmp_path / "gpt_oss.json"
    path.write_text(json.dumps(config))
    lm = load_model(ModelSpec(f"hf:{path}", seq_len=64))
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=BF16.precision.trace_dtype)
    assert expert_modules(tr) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert any(len(tr.param(p).shape) == 2 for p in tr.modules["model.layers.0.mlp.experts"].params)  # the biases
    r = simulate(tr, with_expert_parallel(TorchtitanPolicy().plan(tr), tr, 2), parse_cluster("h100:8"), BF16,
                 timeline=False)
    assert r.ep_all_to_alls == 2 * 4 and r.ep_all_to_all_bytes == 8 * 64 * 2 * 64 * 2  # tokens x top_k x dim x bf16


def test_ep_with_hsdp_all_reduces_the_experts_shards() -> None:
    """HSDP 2 x 4 with EP 2: the experts' reduce-scatter over 4 / 2 ranks, their all-reduce of that shard."""
    from fsdp_planner.fsdp2.plan import Mesh, check_plan_world_size

    tr = _traced()
    plan = _ep_plan(tr, 2).replace(mesh=Mesh(2, 4))
    r = simulate(tr, plan, parse_cluster("h100:8"), BF16, timeline=False)
    flat = simulate(tr, _ep_plan(tr, 2).replace(mesh=Mesh(1, 8)), parse_cluster("h100:8"), BF16, timeline=False)
    assert r.all_reduces == r.reduce_scatters and r.all_reduce_bytes > 0
    assert r.peak_memory > flat.peak_memory  # each replica holds twice the shard
    # what verify predicts for the gloo job (runtime/verify.py) agrees with the simulator: the experts' all-reduce
    # is of their shard over dp_shard / EP ranks (EP 2 on 2x2: one rank, the whole EP-local experts)
    from fsdp_planner.runtime.verify import data_parallel_view, predict_collectives

    reduced = []
    for degree, mesh in ((2, Mesh(2, 2)), (2, Mesh(2, 4)), (4, Mesh(2, 4))):
        hsdp = _ep_plan(tr, degree).replace(mesh=mesh)
        counts, nbytes = predict_collectives(*data_parallel_view(tr, hsdp, mesh.size), BF16.precision)
        sim = simulate(tr, hsdp, parse_cluster(f"h100:{mesh.size}"), BF16, timeline=False)
        assert (counts["all_reduce"], nbytes["all_reduce"]) == (sim.all_reduces, sim.all_reduce_bytes)
        reduced.append(nbytes["all_reduce"])
    assert reduced[0] > reduced[1] == reduced[2]  # 2x2 EP 2: the rest over 2 ranks, the experts over 1
    with pytest.raises(PlannerError, match="does not divide"):
        check_plan_world_size(_ep_plan(tr, 8).replace(mesh=Mesh(2, 4)), 8)


@pytest.mark.integration  # the fake-world check of an EP plan, and EP + FSDP2 on 4 gloo ranks (torchrun)
def test_verify_ep_on_fake_ranks_and_on_gloo_from_the_cli() -> None:
    """``verify --ep 4 --fake-world-size 8``: every count and byte exact (EP's all-to-alls among them), the peak
    within 5%; ``verify --ep 2 --mesh 2x2 --nproc 4`` (torchrun, gloo's all-to-all, EP x HSDP) and ``verify --ep 2
    --tp 2 --nproc 4`` (EP x TP): FSDP2's collectives as predicted (the experts' all-reduced over dp_replicate) and
    the params equal to the unsharded reference's."""

    verify = ["verify", TINY, "--policy", "titan", "--json"]
    r = run_main(*verify, "--ep", "4", "--fake-world-size", "8")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.05
    assert result["measured"]["ep_all_to_alls"] == result["predicted"]["ep_all_to_alls"] == 8
    assert result["measured"]["ep_all_to_all_bytes"] == result["predicted"]["ep_all_to_all_bytes"] > 0
    r = run_main(*verify, "--ep", "2", "--mesh", "2x2", "--nproc", "4", "--steps", "2", "--precision", "fp32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["counts_match"] and result["bytes_match"]
    assert result["max_abs_diff"] <= 1e-5  # fp32: the experts' grads averaged over all 4 ranks, not EP x that
    # HSDP 2x2: the experts' shard dim is one rank (EP takes dp_shard whole), their grads all-reduced over 2
    assert result["predicted"]["all_reduce"] == result["predicted"]["reduce_scatter"] + 2
    # EP 2 x TP 2 (torchtitan's expert TP 1: EP's pair is one TP group, each TP rank dispatching half the routed
    # tokens): FSDP2's collectives as predicted, the params the unsharded reference's (the router gate's partial
    # grads all-reduced over TP, the experts' averaged over the 2 data-parallel ranks)
    r = run_main(*verify, "--ep", "2", "--tp", "2", "--nproc", "4", "--steps", "2", "--precision", "fp32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["counts_match"] and result["bytes_match"]
    assert result["max_abs_diff"] <= 1e-5


@pytest.mark.integration  # a few seconds
def test_fit_gpus_auto_with_ep() -> None:
    """``fit --gpus auto --ep N``: each GPU count's plan is auto's under EP N (as ``plan --ep`` gives it); without
    ``--ep``, auto's EP screen as ``plan`` runs it: no EP where that is fastest (here), an EP degree where only it
    fits."""

    fit = ["fit", TINY, "--cluster", "h100", "--gpus", "auto", "--json"]
    r = run_main(*fit, "--ep", "4")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["gpus"]["fewest"] == 8 and result["points"][0]["layout"] == "1x8 EP 4"
    r = run_main(*fit)
    assert r.returncode == 0 and json.loads(r.stdout)["points"][0]["layout"] == "1x8", r.stderr[-2000:]
    # a budget auto's plan without EP or TP exceeds (its 12 MiB above): the EP degrees the model allows and the
    # TP layouts (the experts tensor-parallel, or EP x TP) are tried, as plan --batch 2 tries them
    r = run_main(*fit, "--memory-budget", "9.5MiB")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    point = json.loads(r.stdout)["points"][0]
    assert (" EP " in point["layout"] or " TP " in point["layout"]) and point["fits"] and not point["offload"]
    assert point["reserved_memory"] <= 9.5 * 2**20


@pytest.mark.parametrize("fmt", ["python", "torchtitan", "accelerate", "lightning"])
def test_export_of_an_ep_plan_compiles_and_names_its_degree(fmt: str) -> None:
    """The export carries EP as literals (EP_DEGREE, the expert groups), its own mesh split and dispatch code (no
    import of fsdp_planner); torchtitan's job sets expert_parallel_degree. Prefetch lists with EP are refused, as
    apply_plan refuses them."""
    import ast

    from fsdp_planner.apply.export import ExportFormat, export_plan

    source = export_plan(_ep_plan(_traced(), 2), ExportFormat(fmt))
    compile(ast.parse(source), "exported.py", "exec")
    assert "fsdp_planner" not in source.replace("fsdp_planner_job", "")
    scope: dict = {"__name__": "exported"}
    exec(compile(source.split("\n\ndef fsdp_planner_job(")[0], "exported.py", "exec"), scope)
    assert scope["EP_DEGREE"] == 2 and scope["EXPERTS"] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    if fmt == "torchtitan":
        assert "expert_parallel_degree=2," in source and "'--parallelism.expert_parallel_degree', '2'" in source
    # EP x TP: both carried, the TP ranks' token split with them (torchtitan: both degrees, expert TP its default 1)
    source = export_plan(_ep_plan(_traced(), 4, tp=2), ExportFormat(fmt))
    scope = {"__name__": "exported"}
    exec(compile(source.split("\n\ndef fsdp_planner_job(")[0], "exported.py", "exec"), scope)
    assert (scope["EP_DEGREE"], scope["TP_DEGREE"], scope["EP_TOKEN_SPLIT"]) == (4, 2, 2)
    assert scope["TP_LAYOUT"]["layers.*.moe.experts"] == "token_split"
    if fmt == "torchtitan":
        assert "expert_parallel_degree=4," in source and "tensor_parallel_degree=2," in source
    plan = _ep_plan(_traced(), 2)
    with pytest.raises(PlannerError, match="prefetch"):
        export_plan(plan.with_group(1, forward_prefetch=[3]), ExportFormat(fmt))


def exported_and_applied(plan: Plan, world: int = 4, model: str = TINY) -> list[dict]:
    """Each param's (placements, local shape, mesh dims) after the exported ``apply`` and after ``apply_plan`` of
    ``plan`` on ``model`` (the tiny MoE) on ``world`` fake ranks, a training step run after each."""
    from fsdp_planner.apply.export import ExportFormat, export_plan
    from fsdp_planner.apply.fully_shard import apply_plan
    from fsdp_planner.apply.tensor_parallel import loss_context
    from fsdp_planner.runtime.fake_world import fake_process_group

    scope: dict = {"__name__": "exported"}
    exec(compile(export_plan(plan, ExportFormat.PYTHON, BF16.precision), "exported.py", "exec"), scope)
    shards = []
    with fake_process_group(world):
        for shard in (lambda m: scope["apply"](m), lambda m: apply_plan(m, plan)):
            lm = load_model(model, meta=False)
            shard(lm.model)
            shards.append({n: (p.placements, tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
                           for n, p in lm.model.named_parameters()})
            inputs = lm.example_inputs  # (a transformers model's are keywords)
            with loss_context(plan):
                out = lm.model(**inputs) if isinstance(inputs, dict) else lm.model(*inputs)
                lm.loss_fn(out).backward()
    return shards


@pytest.mark.integration  # EP + FSDP2 twice on 4 fake ranks: a few seconds
@pytest.mark.parametrize(("replicate", "tp", "dim1", "per_param"), [
    (1, 1, False, False), (2, 1, False, False), (1, 2, False, False), (1, 2, True, False),
    (1, 1, False, True), (2, 1, False, True), (1, 2, False, True), (1, 2, True, True)])
def test_exported_apply_shards_as_apply_plan_does(replicate: int, tp: int, dim1: bool, per_param: bool) -> None:
    """The exported ``apply`` on 4 fake ranks (EP 2; FSDP 4, HSDP 2x2 or FSDP 2 x TP 2) leaves every param with the
    placements, local shape and mesh ``apply_plan`` gives it (the experts Shard(0) over ep and over the EP-reduced
    mesh, under HSDP Replicate over dp_replicate; with TP, the router gate replicated over tp; with shard dims, the
    experts FSDP-sharded on dim 1, as torchtitan places them), and a step runs; the experts in calls of their own,
    or in their blocks' calls on a per-param mesh (``per_param``)."""
    from fsdp_planner.fsdp2.plan import Mesh

    plan = _ep_plan(_traced(), 2, tp=tp, per_param=per_param).replace(mesh=Mesh(replicate, 4 // replicate // tp))
    if dim1:
        plan = plan.replace(shard_dims={f"layers.{i}.moe.experts.{w}": 1 for i in (0, 1) for w in ("w1", "w2", "w3")})
    shards = exported_and_applied(plan)
    assert shards[0] == shards[1]
    placements, local, dims = shards[0]["layers.0.moe.experts.w1"]
    if dim1:  # FSDP's Shard(1) over the 2 TP groups, EP's Shard(0): 4 experts a rank, their rows halved
        assert [p.dim for p in placements] == [1, 0] and local == (8 // 2, 128 // 2, 256)
    elif tp > 1:  # EP's pair is one TP group: the experts' FSDP mesh the 2 TP groups, the gate replicated over tp
        assert dims == ("dp_shard_mod_ep", "ep") and local[0] == 8 // 2 // 2
        assert shards[0]["layers.0.moe.router.gate.weight"][2] == ("dp_shard", "tp")
    elif replicate == 1:
        assert len(placements) == 2 and dims == ("dp_shard_mod_ep", "ep")  # FSDP's Shard(0) over 2, EP's over 2
        assert local[0] == 8 // 2 // 2
    else:  # HSDP: the experts replicated over dp_replicate, sharded over dp_shard / EP = 1 rank, EP's Shard(0)
        assert len(placements) == 3 and dims == ("dp_replicate", "dp_shard_mod_ep", "ep") and local[0] == 8 // 2
        assert shards[0]["layers.0.attention.wq.weight"][2] == ("dp_replicate", "dp_shard")


@pytest.mark.integration  # EP + FSDP2 twice on 4 fake ranks: a few seconds
def test_experts_one_call_holds_together_on_a_per_param_mesh_export(tmp_path) -> None:
    """On a per-param mesh the experts of one call share its second param group: a plan whose call holds two blocks
    lists their experts modules in one group (auto's, on a new user's Qwen2-MoE), which verify passed and export
    refused ("not a group of its own ... (as --ep does)"). It exports, and the exported apply shards as apply_plan
    does; with the experts' own calls (per_param_mesh false) such a group is still refused."""
    model = _tiny_qwen3_moe(tmp_path)
    made = tmp_path / "titan.json"
    r = run_main("plan", model, "--policy", "titan", "--ep", "2", "--cluster", "h100:4", "--out", str(made))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(made.read_text())
    assert data["expert_parallel"]["per_param_mesh"] is True
    by = {tuple(g["modules"]): g for g in data["groups"]}
    for pair in ((("model.layers.0",), ("model.layers.1",)),
                 (("model.layers.0.mlp.experts",), ("model.layers.1.mlp.experts",))):
        first, second = by[pair[0]], by[pair[1]]
        first["modules"] += second["modules"]
        first["params"] += second["params"]
        data["groups"].remove(second)
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps(data))
    r = run_main("export", str(merged), "--format", "python", "--out", str(tmp_path / "merged.py"))
    assert r.returncode == 0, r.stderr[-2000:]
    shards = exported_and_applied(Plan.load(merged), model=model)
    assert shards[0] == shards[1]
    assert shards[0]["model.layers.1.mlp.experts.gate_up_proj"][2] == ("dp_shard_mod_ep", "ep")
    data["expert_parallel"]["per_param_mesh"] = False
    merged.write_text(json.dumps(data))
    r = run_main("export", str(merged), "--format", "python", "--out", str(tmp_path / "own.py"))
    assert r.returncode == 2 and "is not a group of its own, and this plan (per_param_mesh false)" in r.stderr


@pytest.mark.integration  # real EP + FSDP2 on 4 fake ranks, then 2 gloo ranks under torchrun: ~30 s
def test_experts_written_as_a_loop_run_on_their_local_shards(tmp_path) -> None:
    """An experts module looping over its experts (``range(self.w1.shape[0])``, ``x[e] @ self.w1[e]``) failed on
    every rank: it saw its params and input as DTensors, whose shapes are the global ones (a new user's, following
    the README's advice). It runs on its local shards now, as torchtitan's GroupedExperts reads them: on fake ranks
    every count and byte exact (the all-to-alls sized from the call's input, which no batched matmul gives here),
    and on gloo with parity."""
    spec = "tests/fixtures/ep_moe.py:looped_tiny_mixtral"
    # (8 x 1,024 tokens: an expert's rows outnumber the other experts' weight rows, where reading the whole weight
    # off one expert's matmul left a positive, wrong size: a reviewer's case)
    for workload in ((), ("--batch", "8", "--seq", "1024")):
        r = run_main("verify", spec, "--policy", "titan", "--ep", "2", "--fake-world-size", "4", *workload, "--json")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        result = json.loads(r.stdout)
        assert result["ok"] and result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.05
        assert result["measured"]["ep_all_to_all_bytes"] > 0
    r = run_main("verify", spec, "--policy", "titan", "--ep", "2", "--nproc", "2", "--steps", "2", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout)["ok"]


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_an_ep_rank_s_expert_matmuls_are_its_local_experts(degree: int) -> None:
    """Under EP a rank's E / EP experts each multiply the rows all EP ranks route to them: the matmul's smallest
    dim (its efficiency's) is EP times the traced rows, up to the weight's own dims, and it reads or writes E / EP
    experts' weights; its FLOPs are unchanged (a trial's finding: DeepSeek-V3's expert matmuls were priced reading
    all 256 experts' weights at 128 rows' efficiency under any EP)."""
    tr = _traced()
    view = ep_view(tr, _ep_plan(tr, degree)).trace
    traced = [e for e in tr.events if e.is_op and e.module == "layers.0.moe.experts" and e.kernel > 0]
    local = [e for e in view.events if e.is_op and e.module == "layers.0.moe.experts" and e.kernel > 0]
    weight = 8 * 128 * 256 * 2  # one of w1, w2, w3 (8 experts, 128 x 256), traced in bf16
    assert len(traced) == len(local) == 9  # 3 forward, 6 backward (input and weight grads)
    for t, e in zip(traced, local, strict=True):
        assert t.kernel == 32 and e.kernel == min(32 * degree, 128)
        assert (e.flops, e.nbytes) == (t.flops, t.nbytes - weight + weight // degree)


def test_a_transformers_experts_weight_grads_take_their_own_weight(tmp_path) -> None:
    """transformers' experts layer fuses gate and up (a weight twice its down weight): a weight-gradient matmul,
    which reads no param, takes off the bytes of the weight whose input-gradient matmul does its FLOPs, and each
    matmul's smallest dim grows up to its own weight's dims (a reviewer's finding: the module's smallest and
    largest were taken)."""
    config = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 64,
              "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    lm = load_model(ModelSpec(f"hf:{tmp_path / 'config.json'}", seq_len=192))
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=BF16.precision.trace_dtype)
    from fsdp_planner.planners.expert_parallel import expert_modules, with_expert_parallel

    m = expert_modules(tr)[0]
    view = ep_view(tr, with_expert_parallel(TorchtitanPolicy().plan(tr), tr, 4)).trace
    traced = [e for e in tr.events if e.is_op and e.module == m and e.kernel > 0]
    local = [e for e in view.events if e.is_op and e.module == m and e.kernel > 0]
    gate_up, down = 4 * 128 * 256 * 2, 4 * 256 * 64 * 2  # (experts, 2 x 64, 256) and (experts, 256, 64), bf16
    for t, e in zip(traced, local, strict=True):
        weight = gate_up if t.kernel == 96 else down  # gate_up's smallest dim is the 96 rows, down's its own 64
        assert e.kernel == (128 if t.kernel == 96 else 64)
        assert e.nbytes == t.nbytes - weight + weight // 4, (t, e)


def test_a_classic_policy_s_experts_are_sharded_as_torchtitan_places_them() -> None:
    """--policy titan --ep: the experts on dim 1 where their FSDP ranks x EP exceed the experts (torchtitan's
    apply_fsdp), which is where dim 0 would pad (a trial's finding: Mixtral's experts padded 8x on 64 GPUs, titan
    with EP 8 six times slower than with them on dim 1); --shard-placement dim0 keeps dim 0; real FSDP2 on 32
    fake ranks agrees."""
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    wide = api.plan(TINY, cluster="h100:32", policy="titan", ep=2)  # 16 ranks x EP 2 > 8 experts: dim 1
    assert {k for k, d in wide.shard_dims.items() if d == 1} >= {f"layers.{b}.moe.experts.w{i}" for b in (0, 1)
                                                                 for i in (1, 2, 3)}
    assert not api.plan(TINY, cluster="h100:8", policy="titan", ep=2).shard_dims  # 4 ranks x EP 2: dim 0 divides
    assert not api.plan(TINY, cluster="h100:32", policy="titan", ep=2, shard_placement="dim0").shard_dims
    rows = beside_prediction(simulate(_traced(), wide, parse_cluster("h100:32"), BF16, timeline=False),
                             run_fake_world(TINY, wide, 32, BF16.precision))
    assert all(p == m for key, (p, m) in rows.items() if key != "peak_memory"), rows
    assert rows["peak_memory"][0] == pytest.approx(rows["peak_memory"][1], rel=0.05)  # seen: +1.2%


def test_a_classic_policy_s_experts_under_tp_are_sharded_on_dim_1_of_their_tp_shards() -> None:
    """The same under TP: titan with TP 2 x EP 8 on 64 GPUs kept Mixtral's experts on dim 0, padded over their 8
    FSDP ranks (7.1 s and 117 GiB a step, a trial; auto's EP x TP screens placed them so, 0.86 s): the rule now reads
    one TP rank's shards, which FSDP2 shards; real FSDP2 and DTensor on 32 fake ranks agree."""
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    wide = api.plan(TINY, cluster="h100:32", policy="titan", ep=2, tp=2)  # 16 x 2 ranks / EP 2 > 4 experts
    assert wide.tp_degree == 2
    assert {k for k, d in wide.shard_dims.items() if d == 1} >= {f"layers.{b}.moe.experts.w{i}" for b in (0, 1)
                                                                 for i in (1, 2, 3)}
    assert not api.plan(TINY, cluster="h100:8", policy="titan", ep=2, tp=2).shard_dims  # 4 x 2 / 2: dim 0 divides
    # 8 x 2 ranks / EP 2 = 8 FSDP ranks for 4 experts a rank: dim 1 (the rule read 8 / 2 = 4 ranks, dim 0: a review)
    mid = api.plan(TINY, cluster="h100:16", policy="titan", ep=2, tp=2)
    assert {k for k, d in mid.shard_dims.items() if d == 1} >= {f"layers.{b}.moe.experts.w{i}" for b in (0, 1)
                                                                for i in (1, 2, 3)}
    for plan, world in ((wide, 32), (mid, 16)):
        rows = beside_prediction(simulate(_traced(), plan, parse_cluster(f"h100:{world}"), BF16, timeline=False),
                                 run_fake_world(TINY, plan, world, BF16.precision))
        assert all(p == m for key, (p, m) in rows.items() if key != "peak_memory"), rows
        assert rows["ep_all_to_alls"][0] and rows["tp_all_gathers"][0]
        assert rows["peak_memory"][0] == pytest.approx(rows["peak_memory"][1], rel=0.05)  # seen: +0.6%


def test_ep_placement_chooses_where_the_experts_are_sharded(tmp_path) -> None:
    """--ep-placement: 'own' gives each experts module a fully_shard call of its own (the plan file's
    per_param_mesh false), 'blocks' their blocks' calls; auto's EP screen keeps to the one given (its EP x TP
    screen's searched layout too: it took both, and 'own' came back as 'blocks'); without EP it is one sentence;
    with a plan file, a note."""
    plans = {}
    for placement in ("own", "blocks"):
        out = tmp_path / f"{placement}.json"
        r = run_main("plan", TINY, "--policy", "auto", "--ep", "2", "--ep-placement", placement, "--cluster", "h100:4",
                     "--out", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        plans[placement] = json.loads(out.read_text())["expert_parallel"]
    assert plans["own"].get("per_param_mesh", False) is False and plans["blocks"]["per_param_mesh"] is True
    r = run_main("plan", TINY, "--policy", "titan", "--ep-placement", "own", "--cluster", "h100:4")
    assert r.returncode != 0 and "--ep-placement says where FSDP2 shards the experts" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_main("simulate", TINY, "--plan", str(tmp_path / "own.json"), "--ep-placement", "blocks", "--cluster",
                 "h100:4")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--ep-placement has no effect with --plan: the plan file already fixes its expert parallelism" in r.stderr
    with pytest.raises(PlannerError, match="ep_placement"):
        api.plan(TINY, cluster="h100:4", policy="titan", ep=2, ep_placement="nowhere")
    assert not api.plan(TINY, cluster="h100:4", policy="titan", ep=2, ep_placement="own").expert_parallel.per_param_mesh


def test_from_torchtitan_keeps_expert_parallel_degree(tmp_path) -> None:
    """torchtitan's expert_parallel_degree becomes --ep (bounded and checked as --ep is), and the plan has it."""
    from fsdp_planner.cli import build_parser
    from fsdp_planner.cli.requests import configured

    job = tmp_path / "job.toml"
    job.write_text("[parallelism]\nexpert_parallel_degree = 2\n[activation_checkpoint]\nmode = \"none\"\n")
    args, _ = configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                    "h100:8", "--policy", "titan"]))
    assert args.ep == 2
    # a TOML job's torchtitan (before its config registry) gave each experts module a fully_shard call of its own;
    # the registry's (since pytorch/torchtitan#2281) shards them in their blocks' calls; --ep-placement wins
    assert args.ep_placement == "own"
    given, _ = configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                     "h100:8", "--ep-placement", "blocks"]))
    assert given.ep_placement == "blocks"
    registry = Path(__file__).resolve().parent / "fixtures" / "torchtitan" / "deepseek_v3" / "config_registry.py"
    titan, _ = configured(build_parser().parse_args(["plan", "--from-torchtitan", f"{registry}:deepseek_v3_16b",
                                                     "--cluster", "h100:8"]))
    assert (titan.ep, titan.ep_placement) == (8, "blocks")

    assert api.plan(TINY, cluster="h100:8", policy="titan", ep=args.ep).ep_degree == 2
    # HSDP kept with EP (EP's ranks out of dp_shard: 4 here); EP with TP kept (EP's ranks out of dp_shard x tp),
    # an EP degree that is no multiple of TP's or an expert TP above 1 refused before any plan is made
    job.write_text("[parallelism]\nexpert_parallel_degree = 4\ndata_parallel_replicate_degree = 2\n"
                   "[activation_checkpoint]\nmode = \"none\"\n")
    args, _ = configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                    "h100:8", "--policy", "titan"]))
    assert (args.ep, args.mesh) == (4, "2x4")
    job.write_text("[parallelism]\nexpert_parallel_degree = 4\ntensor_parallel_degree = 2\n"
                   "[activation_checkpoint]\nmode = \"none\"\n")
    args, _ = configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                    "h100:8", "--policy", "titan"]))
    assert (args.ep, args.tp) == (4, 2)
    plan = api.plan(TINY, cluster="h100:8", policy="titan", ep=args.ep, tp=args.tp)
    assert (plan.ep_degree, plan.tp_degree) == (4, 2)
    assert plan.mesh_dims(8) == {"dp_shard_mod_ep": 2, "dp_shard_in_ep": 2, "tp": 2}
    for keys, match in (("expert_parallel_degree = 2\ntensor_parallel_degree = 4\n", "not a multiple"),
                        ("expert_parallel_degree = 2\ntensor_parallel_degree = 2\nexpert_tensor_parallel_degree = 2\n",
                         "expert TP 1 only"),
                        # (torchtitan's rule: 1 or the TP degree; read past in silence before: a new user's trial)
                        ("expert_parallel_degree = 2\ntensor_parallel_degree = 1\nexpert_tensor_parallel_degree = 2\n",
                         "takes 1 or the TP degree only")):
        job.write_text(f"[parallelism]\n{keys}")
        with pytest.raises(PlannerError, match=match):
            configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                  "h100:8"]))
    job.write_text("[parallelism]\ntensor_parallel_degree = 2\nexpert_tensor_parallel_degree = 4\n")  # (no EP: no
    # effect, and torchtitan checks it under EP only)
    assert configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                 "h100:8"]))[0].tp == 2
    job.write_text("[parallelism]\nexpert_parallel_degree = 3\n")
    with pytest.raises(PlannerError, match="expert_parallel_degree = 3 does not divide"):
        configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster", "h100:8"]))
    job.write_text("[parallelism]\nexpert_parallel_degree = 0\n")
    with pytest.raises(PlannerError, match="expert_parallel_degree"):
        configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster", "h100:8"]))


@pytest.mark.integration  # 2 gloo ranks under torchrun: ~13 s
def test_exported_ep_plan_trains_with_parity_on_gloo(tmp_path) -> None:
    """The exported module (EP 2 on 2 gloo ranks, fp32; examples/torchrun_fsdp2.py: one batch a rank) trains as
    one process does: the experts' all-to-alls and their grads averaged over both ranks, as apply_plan does."""
    import subprocess
    import sys
    from pathlib import Path

    from fsdp_planner.apply.export import ExportFormat, export_plan
    from fsdp_planner.sim.options import PRECISIONS

    root = Path(__file__).resolve().parents[1]
    code = tmp_path / "ep_plan.py"
    code.write_text(export_plan(_ep_plan(_traced(), 2), ExportFormat.PYTHON, PRECISIONS["fp32"]))
    env = launch_env(tmp_path, PYTHONPATH=str(root / "src"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(root / "examples" / "torchrun_fsdp2.py"), str(code), str(root / TINY)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "fsdp modules: 8" in out.stdout  # every module of the plan's groups (the 2 experts among them), the root
    assert max_abs_diff(out.stdout) <= 1e-5


def _ep_tp_search(**request):  # type: ignore[no-untyped-def]
    from fsdp_planner.choices import PolicyName
    from fsdp_planner.planners.registry import PolicyRequest
    from fsdp_planner.service.planning import search

    return search(_traced(), PolicyRequest(PolicyName.AUTO, **request), parse_cluster("h100:8"), BF16,
                  ModelSpec(TINY, batch_size=2))


def test_auto_screens_ep_x_tp_layouts_and_takes_the_fastest_that_fits() -> None:
    """Without --tp or --ep, auto screens each TP degree x the EP degrees it allows on an MoE model with
    torchtitan's layout (EP a multiple of TP dividing the experts and the data-parallel ranks; TP dividing the 4
    kv heads), each with its line, and takes the fastest that fits (no TP on 8 GPUs at the GPU's budget). The same
    search twice gives the same plan."""
    roomy = _ep_tp_search()
    assert {"1x8", "1x8, EP 8", "1x4 x TP 2, EP 2", "1x4 x TP 2, EP 8", "1x2 x TP 4, EP 4",
            "1x2 x TP 4, EP 8"} <= set(roomy.meshes)
    assert not any(name.startswith(("1x4 x TP 2, EP 1", "1x2 x TP 4, EP 2")) or "TP 8" in name
                   for name in roomy.meshes)
    _assert_fastest_that_fits(roomy)
    again = _ep_tp_search()
    assert again.written_plan == roomy.written_plan and again.report.summary() == roomy.report.summary()
    assert list(again.meshes) == list(roomy.meshes)


def test_auto_with_ep_alone_screens_tp_degrees_at_that_ep() -> None:
    """``--ep 4`` alone: auto screens the TP degrees that divide it (TP 2 and 4, not 8) at EP 4 only."""
    result = _ep_tp_search(ep=4)
    assert {"1x4 x TP 2, EP 4", "1x2 x TP 4, EP 4"} <= set(result.meshes)
    assert not any("TP 8" in name or name.endswith(("EP 2", "EP 8")) for name in result.meshes)
    assert result.plan.ep_degree == 4


def _assert_fastest_that_fits(result) -> None:  # type: ignore[no-untyped-def]
    fitting = [c.report.step_time for c in result.meshes.values() if result.memory.fits(c.report.reserved_memory)]
    assert result.fits and result.report.step_time == min(fitting)


def test_auto_takes_a_tp_x_ep_layout_where_it_is_fastest() -> None:
    """Under a budget where the layouts without TP offload to fit, a TP layout is the fastest that fits: auto
    takes it, ahead of the best plan without TP. Both kinds of torchtitan's MoE layout are screened: TP with the
    experts tensor-parallel (no EP: the one taken on this one-node toy, all-to-alls cost more than TP's
    collectives of its small experts) and EP x TP (EP a multiple of TP)."""
    tight = _ep_tp_search(memory_budget=8_000_000)
    _assert_fastest_that_fits(tight)
    assert tight.plan.tp_degree > 1 and (tight.plan.ep_degree == 1 or tight.plan.ep_degree % tight.plan.tp_degree == 0)
    assert {"1x2 x TP 4", "1x2 x TP 4, EP 4", "1x4 x TP 2", "1x4 x TP 2, EP 2"} <= set(tight.meshes)
    assert tight.report.step_time < tight.meshes["1x8"].report.step_time


def test_auto_ep_x_tp_screen_plan_with_experts_on_dim_1_runs_as_simulated() -> None:
    """TP 2 x EP 8 on 64 ranks: one expert a rank, sharded over 8 ranks, so auto's EP x TP screen shards the
    experts on dim 1 (as torchtitan places them); apply_plan shards them so (it shards them on dim 0 before,
    all-gathering 5.4x the bytes predicted): FSDP2's, TP's and EP's collectives and bytes exact, the peak within 5%."""
    from fsdp_planner.choices import PolicyName
    from fsdp_planner.planners.expert_parallel import screen_ep_tp
    from fsdp_planner.planners.registry import PolicyRequest, make_policy
    from fsdp_planner.planners.tensor_parallel import TPChoice, tp_layout
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    tr, cluster = _traced(), parse_cluster("h100:64")
    choice = TPChoice(tp_layout(tr, 2, ModelSpec(TINY), ep=8).tp)
    policy = make_policy(PolicyRequest(PolicyName.AUTO), cluster, BF16, (choice, choice))
    screen = screen_ep_tp(policy.screen_layouts(tr, TINY)[0], (8,), BF16)
    assert screen is not None
    plan = screen.options[0].plan.replace(fingerprint=tr.fingerprint, numel=tr.numel)
    assert plan.shard_dims.get("layers.0.moe.experts.w1") == 1 and (plan.tp_degree, plan.ep_degree) == (2, 8)
    predicted = simulate(tr, plan, cluster, BF16, timeline=False)
    assert predicted.step_time == screen.options[0].step.step_time
    rows = beside_prediction(predicted, run_fake_world(TINY, plan, 64, BF16.precision))
    for key, (p, m) in rows.items():
        assert p == pytest.approx(m, rel=0.05) if key == "peak_memory" else p == m, key


def test_ep_tp_screen_takes_the_degrees_the_heads_allow():
    """The tiny Mixtral's 4 kv heads: auto's EP x TP screen takes TP 2 and 4, not 8 (which real DTensor refuses:
    a view of 4 kv heads over 8 ranks); a ``--tp`` the user gives is checked and refused in one sentence."""
    from fsdp_planner.planners.expert_parallel import ep_tp_degrees
    from fsdp_planner.planners.tensor_parallel import check_layout, tp_layout

    tr = _traced()
    spec = ModelSpec(TINY)
    assert sorted(ep_tp_degrees(tr, spec, parse_cluster("h100:8"), None, None)) == [2, 4]
    with pytest.raises(PlannerError, match="8 attention heads and 4 kv heads"):
        check_layout(tr, tp_layout(tr, 8, spec, ep=8), parse_cluster("h100:8"))


def test_no_fit_message_names_the_smallest_peak_of_the_ep_screen() -> None:
    """Under a budget nothing reaches, the message's smallest peak is the least any plan holds, the EP screen's
    included (it said 9.93 MiB, the searched plans' least, beside the screen's EP 8 at 5.59 MiB)."""
    from fsdp_planner.fmt import fmt_bytes
    from fsdp_planner.planners.auto import infeasible_message

    result = _ep_tp_search(memory_budget=2 * 2**20)
    assert not result.fits and result.plan.ep_degree > 1
    assert result.report.reserved_memory < result.search.min_peak()
    assert f"the smallest peak any plan reaches is {fmt_bytes(result.report.reserved_memory)}" in \
        infeasible_message(result)


def test_a_plan_file_giving_ep_to_a_module_that_holds_no_grouped_experts_is_refused() -> None:
    """A plan file's EP names the grouped experts modules ``--ep`` finds: a router's gate (a Linear, its weight
    [experts, dim] looks stacked by expert) or a whole block is refused in one sentence, not priced as EP."""
    from fsdp_planner.service.plan_files import check_plan_ep

    tr = _traced()
    check_plan_ep(_ep_plan(tr, 2), tr)
    for modules in (("layers.*.moe.router.gate",), ("layers.0",)):
        plan = TorchtitanPolicy("MoEBlock").plan(tr).replace(expert_parallel=ExpertParallel(2, modules))
        with pytest.raises(PlannerError, match="not a grouped experts module"):
            check_plan_ep(plan, tr)


def test_a_refused_ep_job_says_only_why_and_a_plan_file_says_the_ep_it_runs(tmp_path) -> None:
    """A job whose EP degree does not divide its ranks is refused in one line before any note on what its EP
    leaves out (the note came first, then the refusal); a plan file with EP gets that note from ``simulate
    --plan`` too, and one edited to EP degree 1 runs none and is labelled so (it kept "EP 2"). transformers'
    deprecated checkpointing aliases are not read (a FutureWarning on every hf model)."""
    from fsdp_planner.models.hf_experts import UNPRICED_EP

    model = _tiny_qwen3_moe(tmp_path)
    r = run_main("verify", model, "--policy", "titan", "--ep", "2", "--nproc", "3", "--batch", "2", "--seq", "32")
    assert r.returncode != 0 and "does not divide the 3 data-parallel shard ranks" in r.stderr, r.stderr[-2000:]
    assert UNPRICED_EP not in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    assert "Warning" not in r.stderr
    plan = tmp_path / "plan.json"
    r = run_main("plan", model, "--policy", "titan", "--ep", "2", "--cluster", "h100:2", "--seq", "32",
                 "--out", str(plan))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_main("simulate", model, "--plan", str(plan), "--cluster", "h100:2", "--seq", "32", "--json")
    assert r.returncode == 0 and UNPRICED_EP in " ".join(r.stderr.split()), r.stderr[-2000:]
    assert json.loads(r.stdout)["ep_all_to_alls"] > 0
    data = json.loads(plan.read_text())
    data["expert_parallel"]["degree"] = 1
    plan.write_text(json.dumps(data))
    r = run_main("simulate", model, "--plan", str(plan), "--cluster", "h100:2", "--seq", "32")
    assert r.returncode == 0 and UNPRICED_EP not in " ".join(r.stderr.split()), r.stderr[-2000:]
    assert "EP" not in r.stdout.splitlines()[0] and "all-to-all" not in r.stdout
    code = tmp_path / "plan.py"  # the export reads it so too: no EP code
    r = run_main("export", str(plan), "--format", "python", "--out", str(code))
    assert r.returncode == 0 and "EP_DEGREE" not in code.read_text(), r.stderr[-2000:]


def test_experts_not_stacked_on_an_expert_dim_are_named_in_the_refusal(tmp_path) -> None:
    """DBRX's experts keep their weights flattened (2-D, experts x ffn rows) in a child: ``--ep`` refuses naming
    the class and why, not "this model has no ...Experts class"."""
    pytest.importorskip("transformers")
    config = tmp_path / "dbrx.json"
    config.write_text(json.dumps({"model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 2,
                                  "max_seq_len": 64, "vocab_size": 128,
                                  "attn_config": {"kv_n_heads": 2, "rope_theta": 10000, "clip_qkv": 8},
                                  "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}}))
    with pytest.raises(PlannerError, match="DbrxExperts does not hold its experts' weights as its own params stacked"):
        api.plan(f"hf:{config}", cluster="h100:2", policy="titan", ep=2, seq=32)
    # auto screens none, and says why (a trial read its silence as an oversight)
    r = run_main("plan", f"hf:{config}", "--policy", "auto", "--cluster", "h100:2", "--seq", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: auto screens no expert parallelism: expert parallelism needs grouped experts modules, and " \
        "DbrxExperts does not hold" in r.stderr and "without --ep" not in r.stderr


def test_hand_edited_ep_plan_files_meet_the_same_checks_everywhere(tmp_path) -> None:
    """A new user's edits of an EP plan file (all found run by hand): each command that reads it says the same.
    An expert module merged into its block's group is refused by check and export too (check said "no findings",
    export wrote code sharding those experts without EP); a file without its "model" object is a hand-written plan
    for any model (it was "made for another model"); a file whose EP was taken out keeps no "EP 2" in its label;
    an int reshard_after_forward of an experts group is checked against the experts' EP-reduced mesh; export
    refuses a module the model does not have; an --ep beside --plan other than its own is refused by the fake world
    too; duplicate EP
    modules are refused; Accelerate's config says the world size must be a multiple of the EP degree."""
    model = _tiny_qwen3_moe(tmp_path)
    made = tmp_path / "plan.json"
    r = run_main("plan", model, "--policy", "titan", "--ep", "2", "--cluster", "h100:4", "--seq", "32",
                 "--out", str(made))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(made.read_text())

    def edited(name: str, change) -> str:  # type: ignore[no-untyped-def]
        d = json.loads(json.dumps(data))
        change(d)
        path = tmp_path / name
        path.write_text(json.dumps(d))
        return str(path)

    def merge(d: dict) -> None:
        block, experts = d["groups"][1], d["groups"].pop(2)
        block["modules"] += experts["modules"]
        block["params"] += experts["params"]

    merged = edited("merged.json", merge)
    r = run_main("check", model, "--plan", merged, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode != 0 and "holds expert params and others" in r.stderr, r.stdout[-1000:] + r.stderr[-1000:]
    r = run_main("export", merged)  # (the same words as check)
    assert r.returncode != 0 and "holds expert params and others" in r.stderr and "Traceback" not in r.stderr
    modelless = edited("modelless.json", lambda d: d.pop("model"))
    r = run_main("simulate", model, "--plan", modelless, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    no_ep = edited("no_ep.json", lambda d: d.pop("expert_parallel"))
    r = run_main("simulate", model, "--plan", no_ep, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode == 0 and "EP" not in r.stdout.splitlines()[0], r.stdout[:500] + r.stderr[-1000:]
    # the experts sharded in their block's call (a per-param mesh) are resharded as the block: refused apart
    raf = edited("raf.json", lambda d: d["groups"][2].update(reshard_after_forward=4))
    r = run_main("simulate", model, "--plan", raf, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode != 0 and "give both the same reshard_after_forward" in r.stderr, r.stderr[-1000:]

    def both(d: dict) -> None:
        d["groups"][1].update(reshard_after_forward=4)
        d["groups"][2].update(reshard_after_forward=4)

    raf = edited("raf_both.json", both)  # FSDP2 reshards no DTensor param to a smaller mesh
    r = run_main("simulate", model, "--plan", raf, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode != 0 and "FSDP2 reshards no DTensor param to a smaller mesh" in r.stderr, r.stderr[-1000:]

    def own_calls(d: dict) -> None:  # the experts in calls of their own: their int checked on their own mesh
        d["expert_parallel"]["per_param_mesh"] = False
        d["groups"][2].update(reshard_after_forward=4)

    raf = edited("raf_own.json", own_calls)
    r = run_main("simulate", model, "--plan", raf, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode != 0 and "experts' EP-reduced shard mesh of 2 ranks" in r.stderr, r.stderr[-1000:]
    ghost = edited("ghost.json", lambda d: d["activation_checkpointing"].append("model.layers.7"))
    r = run_main("export", ghost)
    assert r.returncode != 0 and "does not have: model.layers.7" in r.stderr, r.stderr[-1000:]
    r = run_main("verify", model, "--plan", str(made), "--ep", "4", "--seq", "32", "--fake-world-size", "4",
                 "--json")
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "error: --ep 4 contradicts --plan's plan file, planned with --ep 2: drop --ep, or plan again with --ep 4"), \
        r.stderr[-2000:]
    twice = edited("twice.json", lambda d: d["expert_parallel"]["modules"].append(
        d["expert_parallel"]["modules"][0]))
    r = run_main("simulate", model, "--plan", twice, "--cluster", "h100:4", "--seq", "32")
    assert r.returncode != 0 and "twice" in r.stderr
    r = run_main("export", str(made), "--format", "accelerate", "--out", str(tmp_path / "a.yaml"))
    assert r.returncode == 0 and "num_processes: 4  # the plan's world" in (tmp_path / "a.yaml").read_text()
    anywhere = edited("anywhere.json", lambda d: d.pop("workload"))  # a plan of no recorded world
    r = run_main("export", anywhere, "--format", "accelerate", "--out", str(tmp_path / "b.yaml"))
    assert r.returncode == 0 and "any multiple of 2 ranks" in (tmp_path / "b.yaml").read_text()


def test_calibration_matches_a_profiled_rank_to_the_balanced_share() -> None:
    """A profile is of one rank, on average the balanced router's share: ``calibrate --trace`` matches its kernels
    to the EP view at skew 1 (the busiest rank's skewed work would fit the experts' matmul efficiency skew x too
    high), with the EP all-to-alls in no op class."""
    from fsdp_planner.calibrate.trace_fit import NO_CLASS, RankOps, simulated_classes

    tr, cluster = _traced(), parse_cluster("h100:8")
    plan = _ep_plan(tr, 8)
    balanced = RankOps.of(tr, plan, cluster, BF16)
    skewed = RankOps.of(tr, plan.replace(expert_parallel=ExpertParallel(8, EXPERTS, skew=2.0)), cluster, BF16)
    assert balanced.trace.index.op_flops.sum() == skewed.trace.index.op_flops.sum() == tr.index.op_flops.sum()
    a2a = simulated_classes(balanced.trace) == NO_CLASS
    assert a2a.sum() == 4 * sum(1 for m in tr.modules if m.endswith("moe.experts"))  # dispatch, combine x fwd, bwd


def test_experts_sized_from_data_are_simulated_not_run(tmp_path) -> None:
    """Experts whose rows the layer sizes with ``.item()`` (padded to the busiest expert): the routing stand-in
    gives every rank the same rows, real routing does not, and EP's equal-split all-to-all aborted gloo's ranks
    (SIGABRT). The plan says so, auto leaves EP out unless nothing fits without it, and verify refuses real ranks
    before any start; the fake world (the stand-in's step) runs it."""
    from fsdp_planner.planners.expert_parallel import DATA_SIZED_EXPERTS

    spec = "tests/fixtures/routing_models.py:padded_moe"
    path = tmp_path / "ep.json"
    done = run_main("plan", spec, "--policy", "auto", "--ep", "2", "--cluster", "h100:4", "--out", str(path))
    assert done.returncode == 0 and f"note: {DATA_SIZED_EXPERTS}" in done.stderr, done.stderr
    done = run_main("plan", spec, "--policy", "auto", "--cluster", "h100:4")  # auto's own EP screen skips it
    assert done.returncode == 0 and "EP screen" not in done.stderr and "EP 2" not in done.stdout, done.stderr
    done = run_main("verify", spec, "--plan", str(path), "--nproc", "2")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error: {DATA_SIZED_EXPERTS}", done.stderr
    assert "verifying" not in done.stdout
    done = run_main("verify", spec, "--plan", str(path), "--fake-world-size", "2")
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    tiny = run_main("plan", TINY, "--policy", "auto", "--cluster", "h100:4")  # a fixed capacity: screened
    assert tiny.returncode == 0 and "auto's EP screen" in tiny.stderr and DATA_SIZED_EXPERTS not in tiny.stderr


def test_experts_that_select_their_own_tokens_are_refused_ep(tmp_path) -> None:
    """An experts module (stacked 3-D weights, an ...Experts class) that picks its tokens itself takes the layer's
    token list, not EP's (experts, rows, dim) block: ``plan --ep`` simulated it with a note and the fake world then
    failed inside apply's dispatch. ``--ep`` and a plan file's EP are refused in one sentence; auto's EP screen
    leaves it out."""
    from fsdp_planner.planners.expert_parallel import SELF_ROUTED_EXPERTS

    spec = "tests/fixtures/routing_models.py:self_routed"
    done = run_main("plan", spec, "--policy", "auto", "--ep", "2", "--cluster", "h100:4")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error: {SELF_ROUTED_EXPERTS}"
    done = run_main("plan", spec, "--policy", "auto", "--cluster", "h100:4")
    assert done.returncode == 0 and "EP screen" not in done.stderr and "EP 2" not in done.stdout, done.stderr
    lm = load_model(spec)
    by_hand = tmp_path / "ep.json"  # EP written into a plan file by hand
    by_hand.write_text(make_plan(record(lm.model, lm.example_inputs), [["experts"]], model=spec)
                       .replace(expert_parallel=ExpertParallel(2, ("experts",))).to_json())
    # (export builds no Python factory from a plan file: the code it writes says so when the experts run)
    for command in (("verify", "--fake-world-size", "2"), ("simulate", "--cluster", "h100:4"), ("check",)):
        done = run_main(command[0], spec, "--plan", str(by_hand), *command[1:])
        assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error: {SELF_ROUTED_EXPERTS}", \
            (command, done.stderr)


def test_an_ep_degree_the_experts_do_not_divide_names_their_count() -> None:
    done = run_main("plan", TINY, "--policy", "titan", "--ep", "3", "--cluster", "h100:6")
    assert done.returncode == 2 and done.stderr.rstrip().endswith("choose a degree that divides its 8 experts"), \
        done.stderr


def test_an_ep_degree_no_layout_of_the_cluster_takes_is_one_sentence_on_its_ranks(capsys) -> None:
    """EP 3 on 64 GPUs: the comparison noted every classic policy out on "the 64 data-parallel shard ranks", then
    auto failed on "the 32" of its HSDP layout (a new user's finding); now one error, before any trace."""
    from fsdp_planner import cli

    assert cli.main(["plan", "mixtral-8x7b", "--ep", "3", "--cluster", "h100:64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --ep 3 does not divide the 64 data-parallel ranks of h100:64 (EP's ranks come out of "
                   "them): choose one of 2, 4, 8, 16, 32, 64 that divides the model's routed experts too"], err
    assert cli.main(["plan", "mixtral-8x7b", "--ep", "6", "--tp", "2", "--cluster", "h100:16", "--policy",
                     "titan"]) == 2
    assert "--ep 6 does not divide the 8 data-parallel ranks of h100:16 (EP's ranks come out of them x TP): choose " \
        "one of 4, 8, 16" in capsys.readouterr().err


def test_a_dense_model_asked_for_ep_and_tp_is_told_it_has_no_experts() -> None:
    """A dense Llama job with expert_parallel_degree and tensor_parallel_degree was told to give one of the two
    (EP x TP is modelled for torchtitan's MoE layout only); dropping TP then said the model has no experts (a new
    user's trial): that is said first."""
    for ep_tp in (["--ep", "4", "--tp", "2"], ["--ep", "4"]):
        r = run_main("plan", "toy-llama", *ep_tp, "--policy", "titan", "--cluster", "h100:16")
        assert r.returncode == 2 and r.stderr.strip() == (
            "error: expert parallelism needs grouped experts modules (params stacked on an expert dim, a class named "
            "...Experts); this model has none"), r.stderr


def test_an_ep_view_keeps_where_each_storage_was_first_saved() -> None:
    """``Event.resaved`` names the first save's position; the EP view puts all-to-alls into the events, so a
    position kept from the whole trace named another event (the TP view's was mapped after it cost +4 GiB on
    torchtitan's 2-D 70B row; the EP view's was not)."""
    from fsdp_planner.sim.expert_parallel import ep_view

    tr = _traced()
    view = ep_view(tr, _ep_plan(tr, 2, checkpointing=True)).trace
    original = [e for e in tr.events if e.resaved]
    mapped = [e for e in view.events if e.resaved]
    assert original and len(mapped) == len(original)
    for before, after in zip(original, mapped, strict=True):
        for (old, k, _), (new, k2, _) in zip(before.resaved, after.resaved, strict=True):
            assert k == k2 and view.events[new] == tr.events[old]._replace(made_at=view.events[new].made_at)


def test_an_ep_view_moves_the_loss_region_s_storages_with_its_events() -> None:
    """The allocator replays the loss region's storages (``Trace.loss_blocks``) at their events; the EP view put its
    all-to-alls in before the loss and kept the whole trace's positions, so no storage was freed in the region and
    its packing slack fell (hf:titan-qwen3-debugmodel-moe under EP 2: 336 -> 67 MB; a review's finding)."""
    from fsdp_planner.sim.expert_parallel import ep_view

    tr = _traced()
    view = ep_view(tr, _ep_plan(tr, 2)).trace
    assert tr.loss_blocks and len(view.loss_blocks) == len(tr.loss_blocks)
    for (made, freed, n), (made2, freed2, n2) in zip(tr.loss_blocks, view.loss_blocks, strict=True):
        assert n2 == n and view.events[made2] == tr.events[made]._replace(made_at=view.events[made2].made_at)
        assert (freed2 < 0) == (freed < 0) and (freed2 == len(view.events)) == (freed == len(tr.events))
        if 0 <= freed < len(tr.events):
            assert view.events[freed2] == tr.events[freed]._replace(made_at=view.events[freed2].made_at)


def test_experts_in_their_blocks_calls_wherever_the_groups_cut_the_blocks() -> None:
    """Groups that cut through blocks (order's, listing an experts module beside the next block's modules: auto's
    groups of hf:mixtral-8x7b on 64 GPUs) put the experts in the call of the nearest listed module above them, each
    call's experts one group (a planner-made plan was refused by its own check); a call resharding to an int keeps
    the experts' own calls (FSDP2 reshards no DTensor param to a smaller mesh); a call of no params of its own
    makes the experts its only param group; the replay leaves nothing for the cycle collector."""
    import gc

    from fsdp_planner.fsdp2.expert_groups import param_group_hosts
    from fsdp_planner.fsdp2.replay import build_schedule
    from fsdp_planner.planners.expert_parallel import with_expert_parallel

    tr = _traced()
    cut = make_plan(tr, [["tok_embeddings", "layers.0.attention_norm", "layers.0.attention"],
                         ["layers.0.ffn_norm", "layers.0.moe.router", "layers.0.moe.experts", "layers.1.attention_norm",
                          "layers.1.attention"],  # layers.0's experts listed beside layers.1's first modules
                         ["layers.1.ffn_norm", "layers.1.moe.router"], ["layers.1.moe.experts", "norm", "output"]])
    ep = with_expert_parallel(cut, tr, 2)
    hosts = param_group_hosts(ep, tr)
    assert ep.expert_parallel.per_param_mesh and sorted(m for g in hosts for m in ep.groups[g].modules) == \
        ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert all(set(ep.groups[g].modules) <= set(ep.expert_parallel.experts(tr.modules)) for g in hosts)
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    rows = beside_prediction(simulate(tr, ep, parse_cluster("h100:8"), BF16, timeline=False),
                             run_fake_world(TINY, ep, 8, BF16.precision))  # the root's call holds both experts
    assert all(p == m for key, (p, m) in rows.items() if key != "peak_memory"), rows
    assert rows["peak_memory"][0] == pytest.approx(rows["peak_memory"][1], rel=0.05)
    titan = TorchtitanPolicy("MoEBlock").plan(tr)
    ints = titan.replace(groups=[dataclasses.replace(g, reshard_after_forward=2) if not g.is_root else g
                                 for g in titan.groups])
    assert not with_expert_parallel(ints, tr, 2).expert_parallel.per_param_mesh
    from fsdp_planner.fsdp2.replay import GroupReplay

    view = ep_view(tr, ep).trace
    build_schedule(view, ep, 8)  # (its memos made once)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage (other threads' too: looked at)
    try:
        build_schedule(view, ep, 8)
        gc.collect()
        assert not [o for o in gc.garbage if isinstance(o, GroupReplay)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_edited_ep_plan_files_get_one_sentence_from_simulate_and_export(tmp_path) -> None:
    """A trial's edits of an EP plan file, each refused alike by simulate and export (export does not build a model
    file's model, and wrote code for some: an experts module in no group lost its EP silently): the experts group
    removed, two experts modules in one group with the experts' own calls, a prefetch list; a root call holding
    the experts is named so, not by its empty name."""
    made = tmp_path / "plan.json"
    r = run_main("plan", TINY, "--policy", "titan", "--ep", "2", "--cluster", "h100:4", "--out", str(made))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(made.read_text())
    experts = next(i for i, g in enumerate(data["groups"]) if g["modules"] == ["layers.0.moe.experts"])

    def edited(name: str, change) -> str:  # type: ignore[no-untyped-def]
        d = json.loads(json.dumps(data))
        change(d)
        (tmp_path / name).write_text(json.dumps(d))
        return str(tmp_path / name)

    def drop(d: dict) -> None:
        d["groups"][-1]["params"] += d["groups"].pop(experts)["params"]

    def merge(d: dict) -> None:
        d["expert_parallel"]["per_param_mesh"] = False
        other = next(g for g in d["groups"] if g["modules"] == ["layers.1.moe.experts"])
        d["groups"][experts]["modules"] += other["modules"]
        d["groups"][experts]["params"] += other["params"]
        d["groups"].remove(other)

    def prefetch(d: dict) -> None:
        d["groups"][0]["forward_prefetch"] = [1]

    def rootless(d: dict) -> None:  # the blocks' params to the root's call, which then holds the experts
        for block in [g for g in d["groups"] if g["modules"] in (["layers.0"], ["layers.1"])]:
            d["groups"][-1]["params"] += block["params"]
            d["groups"].remove(block)

    for name, change, said in (("drop", drop, "is in no group of its own"),
                               ("merge", merge, "is not a group of its own, and this plan (per_param_mesh false)"),
                               ("prefetch", prefetch, "cannot have explicit prefetch lists yet")):
        path = edited(f"{name}.json", change)
        for command in (["simulate", TINY, "--plan", path, "--cluster", "h100:4"], ["export", path]):
            r = run_main(*command)
            assert r.returncode == 2 and said in r.stderr.strip().splitlines()[-1], (name, command[0], r.stderr)
    r = run_main("simulate", TINY, "--plan", edited("rootless.json", rootless), "--cluster", "h100:4")
    said = "in the fully_shard call of the root module (a per-param mesh; no group lists a module above them)"
    assert r.returncode == 2 and said in r.stderr, r.stderr

    def renamed(d: dict) -> None:  # a block renamed to one the model lacks: that is said first (a trial's finding)
        next(g for g in d["groups"] if g["modules"] == ["layers.0"])["modules"] = ["layers.7"]

    for command in ("simulate", "verify"):
        r = run_main(command, TINY, "--plan", edited("renamed.json", renamed), "--cluster", "h100:4")
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
            "error: plan names modules the model does not have: layers.7", r.stderr


def test_a_size_policy_s_experts_are_sharded_in_their_own_calls_not_the_root_s() -> None:
    """``--policy size --ep N`` wraps no block, so the experts' blocks' fully_shard call (the default per-param mesh)
    was the root's, which keeps them gathered all step: Mixtral's 32 experts modules were one 11 GiB group, 11% over
    an H100's budget on 64 GPUs. Unless ``--ep-placement`` says, each is sharded in a call of its own, said in a
    note; on 8 fake ranks every count and byte exact."""
    common = ("--policy", "size", "--min-nonwrapped-numel", "1000", "--ep", "2")
    r = run_main("plan", TINY, *common, "--cluster", "h100:8", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)["plans"][0]["plan"]
    assert "per_param_mesh" not in plan["expert_parallel"]  # (absent: the experts' own calls)
    experts = [g["modules"] for g in plan["groups"] if any(m.endswith("moe.experts") for m in g["modules"])]
    assert experts == [["layers.0.moe.experts"], ["layers.1.moe.experts"]]
    assert "wraps no module above the experts" in r.stderr
    r = run_main("plan", TINY, *common, "--ep-placement", "blocks", "--cluster", "h100:8", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["plans"][0]["plan"]["expert_parallel"]["per_param_mesh"]
    assert "wraps no module above" not in r.stderr
    r = run_main("verify", TINY, *common, "--fake-world-size", "8", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout)["counts_and_bytes_exact"]


def test_experts_multiplying_rows_split_by_offsets_count_their_flops_and_refuse_ep(capsys) -> None:
    """Experts written as torchtitan's (``torch._grouped_mm`` of the token rows sorted by expert, split by offsets)
    were priced at no FLOPs (torch's FLOP counter has no formula for it: a Mixtral-sized model's forward read
    2.75e4 GFLOP where its experts alone run 9.2e4), and ``--ep`` was planned, chosen by auto and exported for
    them while EP's dispatch sends (experts, rows, dim) blocks: they failed on the ranks only. Their FLOPs are the
    batched twin's (2 x rows x dim x hidden a projection, twice that in backward); EP is refused at plan time in
    one sentence, and auto screens none."""
    from fsdp_planner.models import load_model
    from fsdp_planner.planners.expert_parallel import OFFSET_ROWS_EXPERTS, expert_modules
    from fsdp_planner.sim.tracing import trace as trace_model
    from fsdp_planner.trace.records import Trace

    def traced(name: str) -> Trace:
        lm = load_model(ModelSpec(f"tests/fixtures/ep_moe.py:{name}"), meta=True)
        return trace_model(lm.model, lm.example_inputs, lm.loss_fn, precision=BF16.precision)

    offsets, batched = traced("offset_tiny_mixtral"), traced("tiny_mixtral")
    rows = 2 * 64 * 2  # batch x seq x top-k, in 8 equal shares
    for m in expert_modules(offsets):
        assert offsets.modules[m].fwd_flops == batched.modules[m].fwd_flops == 3 * 2 * rows * 128 * 256
        assert offsets.modules[m].bwd_flops == 2 * offsets.modules[m].fwd_flops

    def matmuls(tr: Trace) -> list[int]:  # (each expert's rows: a matmul's smallest dim)
        return [e.kernel for e in tr.events if e.is_op and e.module == "layers.0.moe.experts" and e.kernel > 0]

    assert matmuls(offsets) == matmuls(batched) == [rows // 8] * 9  # 3 forward, 6 backward
    spec = "tests/fixtures/ep_moe.py:offset_tiny_mixtral"
    r = run_main("plan", spec, "--policy", "titan", "--ep", "2", "--cluster", "h100:8")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {OFFSET_ROWS_EXPERTS}"
    r = run_main("plan", spec, "--policy", "auto", "--cluster", "h100:8", "--json")
    assert r.returncode == 0 and "expert_parallel" not in json.loads(r.stdout)["plans"][0]["plan"]


def test_experts_taking_token_rows_are_refused_ep_at_plan_time_and_by_check(tmp_path) -> None:
    """Experts given the layer's (tokens, dim) rows (each row's weights taken by its expert id) were planned with
    ``--ep``, chosen by auto (EP 16 on 64 H100s), passed by ``check`` and exported, while EP's dispatch sends
    (experts, rows, dim) blocks: every rank refused them (a new user's trial). Refused at plan time in one sentence
    naming the module and its input, by ``check`` of a plan with EP; auto screens none; the grouped experts' 3-D
    input is still EP's."""
    spec = "tests/fixtures/ep_moe.py:indexed_tiny_mixtral"
    said = ("expert parallelism sends each rank's experts a block of (experts, rows, dim) routed rows (models/moe.py's "
            "GroupedExperts), and IndexedExperts ('layers.0.moe.experts') takes a 2-D input")
    r = run_main("plan", spec, "--policy", "titan", "--ep", "2", "--cluster", "h100:8")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: {said}"), r.stderr[-2000:]
    r = run_main("plan", spec, "--policy", "auto", "--cluster", "h100:8", "--json")
    assert r.returncode == 0 and "expert_parallel" not in json.loads(r.stdout)["plans"][0]["plan"]
    plan = tmp_path / "plan.json"  # the grouped experts' own EP plan (their input is 3-D), the same module names
    r = run_main("plan", TINY, "--policy", "titan", "--ep", "2", "--cluster", "h100:8", "--out", str(plan))
    assert r.returncode == 0 and "EP 2" in r.stdout, r.stderr[-2000:]
    r = run_main("check", spec, "--plan", str(plan), "--cluster", "h100:8")
    assert r.returncode != 0 and said in " ".join(r.stderr.split()) and "Traceback" not in r.stderr, r.stderr


def test_dim_0_s_padding_of_the_experts_is_said_with_its_way_out() -> None:
    """8 experts sharded on dim 0 over 64 ranks are padded 8x: Mixtral's titan plan on 64 H100s gathered 1.32 TiB
    a step and reserved 211 GiB with no word of why, where --shard-placement auto (dim 1) takes 64 GiB (a trial).
    The padding is said, with the option; not once the option is given, nor where nothing pads."""
    r = run_main("plan", TINY, "--policy", "titan", "--cluster", "h100:64")
    assert r.returncode in (0, 1), r.stderr[-2000:]
    said = [line for line in r.stderr.splitlines() if "padded to a multiple of its 64 ranks" in line]
    assert len(said) == 1 and "'layers.0.moe.experts.w1', 8 x 128 x 256, 8x" in said[0], r.stderr
    assert "--shard-placement auto" in said[0]
    for args in (("--cluster", "h100:64", "--shard-placement", "auto"), ("--cluster", "h100:8")):
        r = run_main("plan", TINY, "--policy", "titan", *args)
        assert "padded to a multiple" not in r.stderr, args


@pytest.mark.integration  # ~17 s: Qwen3-30B-A3B traced and auto's search with its EP screen
def test_auto_s_own_ep_screen_checkpoints_what_a_faster_ep_layout_needs_to_fit() -> None:
    """Auto's plan without EP fits (some blocks checkpointed in full), and its EP options, checkpointed as that plan
    is, are faster and over the budget: the screen tries torchtitan's grouping with the blocks each needs in full,
    as it does for the EP a user asks for (a trial: auto kept 828 ms without EP where --ep 8 found 652 ms)."""
    from fsdp_planner.choices import PolicyName
    from fsdp_planner.planners.registry import PolicyRequest
    from fsdp_planner.service.planning import Reporter, search
    from fsdp_planner.service.tracing import trace_spec

    spec = ModelSpec("hf:qwen3-30b-a3b", batch_size=1, seq_len=4096)
    notes: list[str] = []
    result = search(trace_spec(spec), PolicyRequest(PolicyName.AUTO), parse_cluster("h100:16"), BF16, spec,
                    Reporter(note=notes.append))
    screen = next(n for n in notes if n.startswith("auto's EP screen"))
    without = re.search(r"no EP on 1x16 ([\d.]+) ms", screen)
    assert without is not None, screen
    assert result.fits and result.plan.expert_parallel is not None, result.plan.policy
    assert result.report.step_time < 0.85 * float(without[1]) * 1e-3, (result.report.step_time, screen)


@pytest.mark.integration  # ~12 s each: an 8-layer DeepSeek-V3 traced and auto's search with its EP screen
@pytest.mark.parametrize("gpus", [256, 512])
def test_auto_screens_torchtitan_s_grouping_at_every_ep_degree_and_placement(gpus: int) -> None:
    """Where nothing fits without EP, auto screens torchtitan's grouping under EP too, at every degree, in each
    placement and on each layout, the experts sharded on dim 1 where dim 0 would pad (torchtitan's placement), not
    only at the options auto's own groups ran best in: on DeepSeek-V3 (256 H100s) auto's groups ran best at EP 256
    in the experts' own calls (9.09 s), a hand configuration (titan, EP 64, every block checkpointed, the experts in
    their blocks' calls) took 9.02 s; auto now 8.49 s at EP 32 (on 512, 8.51 s with 8 experts padded over 16 ranks,
    now 8.40 s). Here 8 of its layers under a 16 GiB budget: auto 1.01 s at EP 256 on 256 GPUs against the hand
    configuration's 973 ms at EP 32; on 512, 977 ms against 960 ms."""
    from fsdp_planner.choices import PolicyName, ShardPlacement
    from fsdp_planner.planners.expert_parallel import with_expert_parallel
    from fsdp_planner.planners.registry import PolicyRequest
    from fsdp_planner.service.planning import search
    from fsdp_planner.service.tracing import trace_spec

    spec = ModelSpec("hf:deepseek-v3", hf_config=(("num_hidden_layers", 8),))
    tr = trace_spec(spec)
    cluster = parse_cluster(f"h100:{gpus}")
    budget = 16 * 2**30
    auto = search(tr, PolicyRequest(PolicyName.AUTO, memory_budget=budget), cluster, BF16, spec)
    titan = TorchtitanPolicy().plan(tr)
    blocks = tuple(m for m in tr.modules if m.count(".") == 2 and m.startswith("model.layers."))
    hand = with_expert_parallel(titan, tr, 32, shard=cluster.world_size, placement=ShardPlacement.AUTO)  # (as
    # --policy titan --ep 32 plans it), with the fewest leading blocks checkpointed in full that fit
    view = ep_view(tr, hand).trace
    steps = [simulate(view, hand.replace(activation_checkpointing=blocks[:k]), cluster, BF16, timeline=False)
             for k in range(len(blocks) + 1)]
    step = next(s for s in steps if s.reserved_memory <= budget)
    assert auto.fits and auto.report.reserved_memory <= budget
    assert auto.report.step_time <= step.step_time, (auto.plan.policy, auto.report.step_time, step.step_time)
