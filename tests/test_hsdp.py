"""HSDP (issue 10): the mesh in the plan, the replay's all-reduces, the cost model, real FSDP2 on a 2-D mesh."""

from __future__ import annotations

import json

import pytest
from conftest import run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Mesh, Plan, check_plan_world_size
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy
from fsdp_planner.planners.auto import AutoPolicy, candidate_meshes
from fsdp_planner.planners.auto.evaluator import Target
from fsdp_planner.runtime.verify import predict_collectives
from fsdp_planner.sim.context import SimContext, replica_ranks_per_node
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record

AR, RS = CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER


@pytest.fixture(scope="module")
def toy():
    lm = load_model("toy-llama")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def titan(tr, mesh: Mesh | None = None) -> Plan:
    return make_policy(PolicyRequest(PolicyName.TITAN, mesh=mesh)).plan(tr, "toy-llama")


def test_mesh_parse_and_plan_json_round_trip(toy) -> None:
    assert Mesh.parse("2x4") == Mesh(2, 4) and Mesh.parse(" 1X8 ").size == 8
    for bad in ("2x", "x4", "0x8", "2*4", "2x4x2", "-1x8", ""):
        with pytest.raises(PlannerError, match="REPLICATExSHARD"):
            Mesh.parse(bad)
    plan = titan(toy, Mesh(2, 4))
    data = json.loads(plan.to_json())
    assert data["mesh"] == {"replicate": 2, "shard": 4}
    assert Plan.from_json(plan.to_json()).mesh == Mesh(2, 4)
    assert "mesh" not in json.loads(titan(toy).to_json())  # pure FSDP plans stay world-size free
    data["mesh"] = {"replicate": 2}
    with pytest.raises(PlannerError, match="plan 'mesh' must be"):
        Plan.from_json(json.dumps(data))


def test_mesh_must_match_the_world(toy) -> None:
    plan = titan(toy, Mesh(2, 4))
    check_plan_world_size(plan, 8)
    with pytest.raises(PlannerError, match="mesh 2x4 has 8 ranks but the job runs on 16: give --mesh"):
        check_plan_world_size(plan, 16)
    # a plan file's mesh no option changes: planned again, not --mesh (which a note says has no effect with --plan)
    with pytest.raises(PlannerError, match=r"^the plan file's mesh 2x4 has 8 ranks but the job runs on 16: make the "
                                           r"plan again for 16 ranks \(a plan file fixes its mesh\)$"):
        check_plan_world_size(plan, 16, plan_file=True)
    plan = plan.with_group(0, reshard_after_forward=8)  # divides the world (8) but not the shard size (4)
    with pytest.raises(PlannerError, match="divide the shard size of 4 ranks"):
        check_plan_world_size(plan, 8)


def test_replay_all_reduces_each_reduce_scatter_across_replicas(toy) -> None:
    flat = build_schedule(toy, titan(toy), 8).collectives
    hsdp = build_schedule(toy, titan(toy, Mesh(2, 4)), 8).collectives
    assert not [c for c in flat if c.kind is AR]
    rs = [c for c in hsdp if c.kind is RS]
    ar = [c for c in hsdp if c.kind is AR]
    assert rs and [(c.group, c.event, c.params) for c in ar] == [(c.group, c.event, c.params) for c in rs]
    # the same all-gathers and reduce-scatters as pure FSDP: HSDP changes who takes part, not when
    assert [(c.kind, c.group, c.event) for c in hsdp if c.kind is not AR] == \
        [(c.kind, c.group, c.event) for c in flat]


def test_sharded_state_is_divided_by_the_shard_size(toy) -> None:
    cluster, options = parse_cluster("h100:64"), SimOptions()
    flat = simulate(toy, titan(toy), cluster, options, timeline=False)
    hsdp = simulate(toy, titan(toy, Mesh(8, 8)), cluster, options, timeline=False)
    assert flat.all_reduces == 0 and hsdp.all_reduces == hsdp.reduce_scatters > 0
    assert hsdp.mesh == "8x8" and flat.mesh == "1x64"
    # optimizer state: two fp32 states per element of the shard; padding to 8 is at most 7 rows per param
    numel = sum(p.numel for p in toy.params)
    assert abs(hsdp.memory_at_peak["optimizer_state"] - numel * 8 / 8) <= 8 * 8 * 64 * len(toy.params)
    assert hsdp.memory_at_peak["optimizer_state"] > 6 * flat.memory_at_peak["optimizer_state"]
    # the all-reduce carries each reduce-scatter's output: 1/8 of its bytes
    assert hsdp.all_reduce_bytes == hsdp.reduce_scatter_bytes // 8
    assert hsdp.comm_time["all_reduce"] > 0 and "all_reduce" not in flat.comm_time


def test_replica_groups_are_strided() -> None:
    cluster = parse_cluster("h100:64")
    assert replica_ranks_per_node(cluster, Mesh(8, 8)) == 1  # shard = a node: one replica member per node
    assert replica_ranks_per_node(cluster, Mesh(16, 4)) == 2
    assert replica_ranks_per_node(cluster, Mesh(2, 32)) == 1
    ctx = SimContext(load_trace_small(), cluster, mesh=Mesh(8, 8))
    assert ctx.cost(AR).link == "inter" and ctx.cost(RS).link == "intra"
    # a shard that does not divide a node: Accelerate's dp_replicate 3 x dp_shard 4 on two 6-GPU nodes puts ranks
    # 0, 4 and 8 on two nodes (it was taken for one a node, three nodes, and refused: "spans 3 nodes")
    assert replica_ranks_per_node(parse_cluster("h100:2x6"), Mesh(3, 4)) == 2
    r = run_main("simulate", "toy-llama", "--policy", "titan", "--cluster", "h100:2x6", "--mesh", "3x4")
    assert r.returncode == 0 and "per step on mesh 3x4" in r.stdout, r.stderr


def load_trace_small():
    lm = load_model("seed-net")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def test_candidate_meshes_are_whole_node_shard_groups() -> None:
    meshes = candidate_meshes(parse_cluster("h100:64"), Target.FSDP2)
    assert meshes[0] == Mesh(1, 64)
    assert {m.shard for m in meshes[1:]} == {8, 16, 32}
    assert candidate_meshes(parse_cluster("h100:8"), Target.FSDP2) == [Mesh(1, 8)]
    assert candidate_meshes(parse_cluster("h100:64"), Target.FSDP1) == [Mesh(1, 64)]


def test_auto_keeps_a_fixed_mesh_and_reports_every_layout_it_compared(toy) -> None:
    cluster = parse_cluster("h100:64")
    fixed = AutoPolicy(cluster, mesh=Mesh(8, 8)).search(toy, "toy-llama")
    assert fixed.plan.mesh == Mesh(8, 8) and fixed.report.all_reduces > 0 and list(fixed.meshes) == ["8x8"]
    chosen = AutoPolicy(cluster).search(toy, "toy-llama")
    assert set(chosen.meshes) == {"1x64", "2x32", "4x16", "8x8"}
    best = min(chosen.meshes.values(), key=lambda c: c.report.step_time)
    assert chosen.report.step_time <= best.report.step_time * (1 + 1e-9)
    with pytest.raises(PlannerError, match="mesh 2x2 has 4 ranks but cluster h100:64 has 64"):
        AutoPolicy(cluster, mesh=Mesh(2, 2))


def test_verify_predicts_all_reduces(toy) -> None:
    counts, nbytes = predict_collectives(toy, titan(toy, Mesh(2, 2)), 4)
    assert counts["all_reduce"] == counts["reduce_scatter"] > 0
    assert nbytes["all_reduce"] == nbytes["reduce_scatter"] // 2
    counts, _ = predict_collectives(toy, titan(toy, Mesh(4, 1)), 4)  # shard groups of one rank: DDP-like
    assert counts["all_gather"] == counts["reduce_scatter"] == 0 and counts["all_reduce"] > 0


@pytest.mark.integration  # seconds of real FSDP2 or tracing: the full suite runs it
@pytest.mark.parametrize("mesh", [Mesh(128, 8), Mesh(2, 4)])
def test_fake_world_hsdp_matches_prediction(toy, mesh: Mesh) -> None:
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    options = SimOptions()
    tr = load_traced("toy-llama", options)
    plan = titan(tr, mesh)
    cluster = parse_cluster(f"h100:{mesh.size}")
    predicted = simulate(tr, plan, cluster, options, timeline=False)
    measured = run_fake_world("toy-llama", plan, mesh.size, options.precision)
    rows = beside_prediction(predicted, measured)
    assert rows["all_reduces"][0] == rows["all_reduces"][1] > 0
    for key, (p, m) in rows.items():
        if key != "peak_memory":
            assert p == m, key
    p, m = rows["peak_memory"]
    assert abs(p / m - 1) <= 0.05


def load_traced(name: str, options: SimOptions):
    lm = load_model(name)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype)


@pytest.mark.integration  # CLI subprocesses
def test_cli_mesh_errors_are_one_line() -> None:
    for args, expected in ((["--mesh", "2by4"], "bad mesh '2by4'"),
                           (["--mesh", "99999999999x8"], "each of REPLICATE and SHARD must be under 10,000,000 ranks"),
                           (["--mesh", "3x3"], "has 9 ranks but the job runs on 8")):
        r = run_main("plan", "toy-llama", "--policy", "titan", "--cluster", "h100:8", *args)
        assert r.returncode == 2, r.stderr
        assert expected in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_verify_hsdp_on_four_gloo_ranks() -> None:
    r = run_main("verify", "toy-llama", "--policy", "titan", "--mesh", "2x2", "--nproc", "4", "--steps", "2", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["predicted"]["all_reduce"] > 0
    assert all(c == result["predicted"] for c in result["counted"])
