"""torchtitan's MoE layout with TP and no EP: each TP rank holds 1/TP of every expert's hidden units
(``TPStyle.EXPERT_TENSOR``: w1, w3 [E, dim, ffn] on dim 2, w2 [E, ffn, dim] on dim 1), runs every routed token of
the MoE layer's all-gathered input through them and leaves its output partial for the layer's reduce-scatter. The
simulated step against real DTensor + FSDP2 on torch's fake process group (counts and bytes exact, the peak within
5%), the export against ``apply_plan``, and the real thing on 4 gloo ranks against one process."""

from __future__ import annotations

import pytest
from conftest import run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.planners.tensor_parallel import Layout, check_layout, titan_moe_layout, tp_layout
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.sim.tensor_parallel import tp_view
from fsdp_planner.trace import record

TINY = "tests/fixtures/ep_moe.py:tiny_mixtral"
BF16 = SimOptions.named("bf16-mixed")


@pytest.fixture(scope="module")
def traced():  # type: ignore[no-untyped-def]
    lm = load_model(TINY)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=BF16.precision.trace_dtype)


def _plan(tr, world: int, tp: int, checkpointing: bool = False) -> Plan:  # type: ignore[no-untyped-def]
    plan = TorchtitanPolicy("MoEBlock").plan(tr)
    if checkpointing:
        plan = plan.replace(activation_checkpointing=[m for m in tr.modules if m.count(".") == 1])
    return plan.replace(tensor_parallel=titan_moe_layout(tp, expert_parallel=False), mesh=Mesh(1, world // tp))


def test_moe_layout_without_ep_shards_the_experts_hidden_units(traced) -> None:  # type: ignore[no-untyped-def]
    """``--tp`` without ``--ep`` on an MoE model with torchtitan's structure takes its MoE layout with the experts
    tensor-parallel (not the column-then-row pairs of its attention alone, which left the experts whole on every TP
    rank); with EP the token split. One TP rank's view holds 1/TP of each expert's hidden units; a degree the
    hidden units do not divide, a style outside an MoE layer and a param of another name are refused."""
    layout = tp_layout(traced, 2, ModelSpec(TINY))
    assert layout.source.startswith("torchtitan's MoE layout") and "no EP" in layout.source
    assert layout.tp.styles(traced.modules)["layers.1.moe.experts"] is TPStyle.EXPERT_TENSOR
    assert tp_layout(traced, 2, ModelSpec(TINY), ep=2).tp.styles(traced.modules)["layers.1.moe.experts"] is \
        TPStyle.TOKEN_SPLIT
    view = tp_view(traced, layout.tp, parse_cluster("h100:8")).trace
    shapes = {p.fqn: p.shape for p in view.params}
    assert shapes["layers.0.moe.experts.w1"] == shapes["layers.0.moe.experts.w3"] == (8, 128, 256 // 2)
    assert shapes["layers.0.moe.experts.w2"] == (8, 256 // 2, 128)
    assert shapes["layers.0.moe.router.gate.weight"] == (8, 128)  # replicated
    # the experts' FLOPs a TP rank runs: half the whole model's
    experts = [traced.modules[f"layers.{i}.moe.experts"].fwd_flops for i in (0, 1)]
    assert [view.modules[f"layers.{i}.moe.experts"].fwd_flops for i in (0, 1)] == [f // 2 for f in experts]
    three = TensorParallel(3, {"layers.*.moe": TPStyle.MOE_SEQUENCE, "layers.*.moe.experts": TPStyle.EXPERT_TENSOR})
    with pytest.raises(PlannerError, match="256 hidden units"):
        check_layout(traced, Layout(three, "the user's"))
    lone = TensorParallel(2, {"layers.*.moe.experts": TPStyle.EXPERT_TENSOR})
    with pytest.raises(PlannerError, match="moe_sequence"):
        tp_view(traced, lone, parse_cluster("h100:8"))
    gate = TensorParallel(2, {"layers.*.moe": TPStyle.MOE_SEQUENCE, "layers.*.moe.router.gate": TPStyle.EXPERT_TENSOR})
    with pytest.raises(PlannerError, match='holds "weight"'):
        tp_view(traced, gate, parse_cluster("h100:8"))


def _check(tr, world: int, tp: int, checkpointing: bool = False) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The fake-world check (``run_fake_world`` applies the plan with ``apply_plan``) beside the prediction: FSDP2's
    and TP's collectives exact (the experts add none: their input is the layer's all-gathered one, their partial
    output summed by its reduce-scatter), the peak returned."""
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world

    plan = _plan(tr, world, tp, checkpointing)
    predicted = simulate(tr, plan, parse_cluster(f"h100:{world}"), BF16, timeline=False)
    measured = run_fake_world(TINY, plan, world, BF16.precision)
    rows = beside_prediction(predicted, measured)
    assert rows["tp_all_gathers"][1] > 0 and "ep_all_to_alls" not in rows
    for key, (p, m) in rows.items():
        if key != "peak_memory":
            assert p == m, key
    return rows["peak_memory"]


def test_expert_tp_step_matches_real_dtensor_and_fsdp2(traced) -> None:  # type: ignore[no-untyped-def]
    """FSDP 4 x TP 2 on 8 fake ranks: every collective exact, the peak within 5% (-0.3% when written)."""
    predicted, measured = _check(traced, 8, 2)
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.integration  # real TP + FSDP2 on fake ranks: about a second each
@pytest.mark.parametrize(("world", "tp", "checkpointing"), [(8, 2, True), (16, 4, False), (64, 2, False),
                                                            (32, 4, True)])
def test_expert_tp_on_more_layouts(traced, world: int, tp: int, checkpointing: bool) -> None:  # type: ignore[no-untyped-def]
    """Full checkpointing (the MoE layer's all-gather run again in the recomputation), TP 4, 64 ranks."""
    predicted, measured = _check(traced, world, tp, checkpointing)
    assert predicted == pytest.approx(measured, rel=0.05)


def test_exported_expert_tp_shards_as_apply_plan_does(traced) -> None:  # type: ignore[no-untyped-def]
    """The exported ``apply`` (every format compiles) leaves every param as ``apply_plan`` does: the experts'
    hidden dims sharded over tp (w1 Shard(2), w2 Shard(1)) and their expert dim over dp_shard; a step runs."""
    from test_expert_parallel import exported_and_applied

    from fsdp_planner.apply.export import ExportFormat, export_plan

    plan = _plan(traced, 4, 2)
    for fmt in ExportFormat:
        compile(export_plan(plan, fmt, BF16.precision), "exported.py", "exec")
    shards = exported_and_applied(plan)
    assert shards[0] == shards[1]
    for name, dim in (("w1", 2), ("w2", 1)):
        placements, local, dims = shards[0][f"layers.0.moe.experts.{name}"]
        assert ([p.dim for p in placements], local, dims) == ([0, dim], (4, 128, 128), ("dp_shard", "tp"))


@pytest.mark.integration  # torchrun, 4 gloo ranks: ~12 s
def test_verify_expert_tp_trains_with_parity_on_gloo() -> None:
    """``verify --tp 2 --nproc 4`` on the tiny MoE (no EP: the experts tensor-parallel): FSDP2's collectives as
    predicted and the params the unsharded reference's (the experts' partial input grads and the router gate's
    partial grads summed over TP)."""
    import json

    r = run_main("verify", TINY, "--policy", "titan", "--json", "--tp", "2", "--nproc", "4", "--steps", "2",
                 "--time-steps", "0", "--precision", "fp32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["counts_match"] and result["bytes_match"]
    assert result["max_abs_diff"] <= 1e-5


def test_a_torchtitan_moe_job_with_tp_and_no_ep_plans_the_experts_tensor_parallel(tmp_path) -> None:
    """torchtitan's DeepSeek-V3 / Llama 4 layout (tensor_parallel_degree > 1, expert_parallel_degree 1) read from
    its job file keeps TP, and the plan shards the experts over it (not whole on every TP rank)."""
    from fsdp_planner import api
    from fsdp_planner.cli import build_parser
    from fsdp_planner.cli.requests import configured

    job = tmp_path / "job.toml"
    job.write_text("[parallelism]\ntensor_parallel_degree = 2\n[activation_checkpoint]\nmode = \"none\"\n")
    args, _ = configured(build_parser().parse_args(["plan", TINY, "--from-torchtitan", str(job), "--cluster",
                                                    "h100:8", "--policy", "titan"]))
    assert (args.tp, args.ep) == (2, None) or (args.tp, args.ep) == (2, 1)
    plan = api.plan(TINY, cluster="h100:8", policy="titan", tp=args.tp)
    assert plan.expert_parallel is None
    assert plan.tensor_parallel.layout["layers.*.moe.experts"] is TPStyle.EXPERT_TENSOR


def test_a_plan_file_with_the_moe_styles_where_they_cannot_run_is_refused_before_anything_changes(traced) -> None:  # type: ignore[no-untyped-def]
    """Where a plan meets its model (``check_plan_matches``: simulate, check, export of a plan file) and in
    ``apply_plan`` before any module changes: expert_tensor with EP, expert_tensor outside an moe_sequence layer
    and token_split without EP, each one sentence."""
    from fsdp_planner.apply.fully_shard import apply_plan
    from fsdp_planner.fsdp2.claim import check_plan_matches
    from fsdp_planner.fsdp2.expert_groups import with_expert_groups
    from fsdp_planner.fsdp2.expert_parallel import ExpertParallel

    base = _plan(traced, 8, 2)
    with_ep = with_expert_groups(base.replace(expert_parallel=ExpertParallel(2, ("layers.*.moe.experts",))), traced)
    outside = base.replace(tensor_parallel=TensorParallel(2, {"layers.*.moe.experts": TPStyle.EXPERT_TENSOR}))
    split = base.replace(tensor_parallel=titan_moe_layout(2))
    lm = load_model(TINY, meta=True)
    for plan, says in ((with_ep, "under EP give them the style token_split"), (outside, "moe_sequence"),
                       (split, "token_split of layers.0.moe.experts")):
        with pytest.raises(PlannerError, match=says):
            check_plan_matches(plan, traced)
        with pytest.raises(PlannerError, match=says):
            apply_plan(lm.model, plan)
        assert not any(hasattr(p, "placements") for p in lm.model.parameters())  # nothing changed


@pytest.mark.integration
def test_verify_runs_the_job_auto_planned_with_tp_on_fake_ranks() -> None:
    """auto under a budget that needs TP on the tiny MoE (8 heads, 4 kv heads): it takes a degree the kv heads
    divide (TP 4; TP 8 would fail in DTensor's view of the kv heads), and ``verify --fake-world-size`` runs the job
    it planned, batch 2 x 4 per data-parallel rank, not a quarter of it: counts and bytes exact, the peak within
    5%, the reserved estimate within the budget."""
    import json

    r = run_main("verify", TINY, "--policy", "auto", "--memory-budget", "9.5MiB", "--batch", "2", "--cluster", "h100:8",
                 "--fake-world-size", "8", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert "TP 4" in result["plan"] and "batch 8 per data-parallel rank" in r.stderr
    assert result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.05
    assert result["predicted_reserved"] <= 9.5 * 2**20
