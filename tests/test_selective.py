"""Op-level selective activation checkpointing (SAC): the trace's op classes against torch's real SAC, the plan
field, what the model holds and recomputes, and real FSDP2 (fake process group, gloo ranks) agreeing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import launch_env, max_abs_diff, traced
from torch.distributed._composable import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_planner.apply.export import export_plan
from fsdp_planner.choices import ExportFormat, SacPolicy
from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.checkpointing import ACMode, apply_checkpointing, check_checkpointing, recomputed_at
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.selective import sac_context_fn, saved_flags
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import PolicyRequest, make_policy
from fsdp_planner.runtime.fake_world import run_fake_world
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.memory import activation_levels
from fsdp_planner.sim.options import PRECISIONS, SimOptions
from fsdp_planner.sim.recompute import checkpointed_calls
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record
from fsdp_planner.trace.events import EventKind, OpClass
from fsdp_planner.trace.ops import op_class

BLOCKS = [f"layers.{i}" for i in range(4)]


def _titan(ac: ACMode, sac: SacPolicy = SacPolicy.TITAN) -> Plan:
    request = PolicyRequest.named("titan", checkpointing=ac, sac_policy=sac)
    return make_policy(request).plan(traced("toy-llama"), "toy-llama")


def test_every_second_mm_is_recomputed_and_attention_kept():
    mm, sdpa, other = OpClass.MM, OpClass.SDPA, OpClass.OTHER
    assert saved_flags(SacPolicy.TITAN, [mm, other, mm, sdpa, mm, mm, mm]) == [True, False, False, True, True,
                                                                               False, True]
    assert saved_flags(SacPolicy.TITAN, [OpClass.SDPA_MORE]) == [True]
    assert saved_flags(SacPolicy.TITAN_EARLY, [OpClass.SDPA_MORE, OpClass.MAX]) == [False, True]


@pytest.mark.parametrize("policy", list(SacPolicy))
def test_trace_decides_what_torch_sac_saves_op_by_op(policy):
    """A real toy-llama (CPU, fp32) with torch's SAC on one block, its policy logging each forward decision: the
    ops it saves are the ones the planner's trace (on meta) keeps, class by class and in order, and the mm it
    recomputes are the ones the trace recomputes. The trace also counts ops SAC is never asked about (detach, the
    tracer's own hook views), all of them OTHER: it recomputes at least the real number of those."""
    lm = load_model("toy-llama", meta=False)
    log: list[tuple[object, bool]] = []
    checkpoint(lm.model.get_submodule("layers.1"), context_fn=sac_context_fn(policy, lambda f, s: log.append((f, s))))
    lm.model(*lm.example_inputs).float().pow(2).mean().backward()
    real_saved = [op_class(f) for f, saved in log if saved]
    real_recomputed = Counter(op_class(f) for f, saved in log if not saved)

    tr = traced("toy-llama")
    (call,) = checkpointed_calls(tr, [("layers.1", policy)])
    planned_recomputed = Counter(tr.events[i].op_class for i in call.recomputed(tr))
    assert [tr.events[i].op_class for i in call.kept] == real_saved == [OpClass.MM, OpClass.MM, OpClass.SDPA,
                                                                        OpClass.MM, OpClass.MM]
    assert planned_recomputed[OpClass.MM] == real_recomputed[OpClass.MM] == 3
    assert set(planned_recomputed) == set(real_recomputed) == {OpClass.MM, OpClass.OTHER}
    assert planned_recomputed[OpClass.OTHER] >= real_recomputed[OpClass.OTHER]


def test_kept_outputs_are_the_ops_output_bytes():
    """A kept mm's outputs are tokens x the weight's rows at the traced dtype; attention's its output and more."""
    tr = traced("toy-llama")
    lm = load_model("toy-llama")
    tokens = lm.example_inputs[0].numel()
    (call,) = checkpointed_calls(tr, [("layers.0", SacPolicy.TITAN)])
    for i in call.kept:
        e = tr.events[i]
        if e.op_class is OpClass.MM:
            (p,) = e.params
            assert e.out_nbytes == tokens * tr.params[p].shape[0] * tr.params[p].itemsize
    (sdpa,) = [i for i in call.kept if tr.events[i].op_class is OpClass.SDPA]
    dim = lm.model.get_submodule("layers.0.attention.wq").weight.shape[0]
    assert tr.events[sdpa].out_nbytes > tokens * dim * tr.params[0].itemsize  # its output and log-sum-exp


def test_op_sac_holds_the_cache_between_full_and_none():
    """After the last block's forward, op-SAC's activations exceed full checkpointing's by exactly the kept ops'
    outputs (the SAC cache of every block); the peak lies between full and none."""
    tr = traced("toy-llama")
    precision = SimOptions().precision
    full = activation_levels(tr, precision, [(b, None) for b in BLOCKS])
    op = activation_levels(tr, precision, [(b, SacPolicy.TITAN) for b in BLOCKS])
    none = activation_levels(tr, precision)
    calls = checkpointed_calls(tr, [(b, SacPolicy.TITAN) for b in BLOCKS])
    end_of_forward = max(c.fwd_post for c in calls)
    scale = precision.compute_bytes / tr.params[0].itemsize
    cache = sum(tr.events[i].out_nbytes for c in calls for i in c.kept) * scale
    assert cache > 0
    assert op[end_of_forward] - full[end_of_forward] == pytest.approx(cache)
    assert full.max() < op.max() < none.max()
    # everything freed by the end of the step but the batch, which the caller holds all step
    assert np.all(op[-1:] == pytest.approx(tr.inputs_nbytes, abs=1e-6))


def test_recompute_runs_only_the_ops_not_kept():
    tr = traced("toy-llama")
    ctx = SimContext(tr, parse_cluster("h100:8"), SimOptions())
    spec = [(b, SacPolicy.TITAN) for b in BLOCKS]
    op = ctx.recompute(spec)
    full = ctx.recompute([(b, None) for b in BLOCKS])
    calls = checkpointed_calls(tr, spec)
    at = {c: recomputed_at(tr, c.end, c.fwd_post, c.bwd_pre, c.bwd_post) for c in calls}  # where backward unpacks
    assert sorted(op) == sorted(full) == sorted(at.values())
    for c in calls:
        assert op[at[c]].seconds == pytest.approx(sum(ctx.times[i] for i in c.recomputed(tr)))
        assert op[at[c]].ops == len(c.recomputed(tr))
        assert 0 < op[at[c]].seconds < full[at[c]].seconds
    reports = {ac: simulate(tr, _titan(ac), context=ctx, timeline=False) for ac in (ACMode.NONE, ACMode.FULL,
                                                                                     ACMode.OP)}
    assert reports[ACMode.OP].recompute_time == pytest.approx(sum(r.seconds for r in op.values()))
    assert 0 < reports[ACMode.OP].recompute_time < reports[ACMode.FULL].recompute_time
    acts = {ac: r.memory_at_peak["activations"] for ac, r in reports.items()}
    assert acts[ACMode.FULL] < acts[ACMode.OP] < acts[ACMode.NONE]


def test_plan_json_round_trip_old_files_and_bad_values():
    plan = _titan(ACMode.OP, SacPolicy.TITAN_EARLY)
    assert list(plan.activation_checkpointing) == [] and plan.policy.endswith("+ ac op titan-early")
    assert plan.selective_checkpointing == dict.fromkeys(BLOCKS, SacPolicy.TITAN_EARLY)
    data = json.loads(plan.to_json())
    assert data["selective_checkpointing"] == dict.fromkeys(BLOCKS, "titan-early")
    again = Plan.from_json(plan.to_json())
    assert again.selective_checkpointing == plan.selective_checkpointing and again.signature() == plan.signature()
    old = json.loads(_titan(ACMode.SELECTIVE).to_json())
    assert "selective_checkpointing" not in old  # a plan without op-level checkpointing is written as before
    assert list(Plan.from_json(json.dumps(old)).activation_checkpointing) == ["layers.1", "layers.3"]
    for bad, message in (([], "must be an object"), ({"layers.0": "sometimes"}, "unknown policy \"sometimes\""),
                         ({"layers..0": "titan"}, "is not a module path")):
        with pytest.raises(PlannerError, match=message):
            Plan.from_json(json.dumps({**data, "selective_checkpointing": bad}))
    both = plan.replace(activation_checkpointing=["layers.0"])
    with pytest.raises(PlannerError, match=r"'layers\.0' is in both"):
        check_checkpointing(both, traced("toy-llama"))
    for names, message in ((["layers.9"], "selective_checkpointing names modules the model does not have"),
                           (["layers.0", "layers.0.attention"], "selective_checkpointing names 'layers.0.attention' "
                                                                "inside 'layers.0'")):
        with pytest.raises(PlannerError, match=message):
            check_checkpointing(plan.replace(selective_checkpointing=dict.fromkeys(names, SacPolicy.TITAN)),
                                traced("toy-llama"))


class _CountMm(TorchDispatchMode):
    """Counts the aten.mm that run (SAC's cached ones never reach it: the cache answers them)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.mm += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def _backward_mm(full: list[str], selective: dict[str, SacPolicy]) -> int:
    """The mm run by backward (its own and the recomputed ones) of a real toy-llama so checkpointed."""
    lm = load_model("toy-llama", meta=False)
    names = [n for n, _ in lm.model.named_parameters()]
    apply_checkpointing(lm.model, full, selective)
    assert [n for n, _ in lm.model.named_parameters()] == names  # no wrapper module: plans still name the same
    loss = lm.model(*lm.example_inputs).float().pow(2).mean()
    with _CountMm() as counter:
        loss.backward()
    return counter.mm


def test_apply_recomputes_only_what_the_policy_drops():
    """A llama block runs 7 mm (wq wk wv wo w1 w3 w2): op-level SAC runs the 3 even-numbered ones again in
    backward, as the trace's plan says; full checkpointing more (6: its early stop skips the last)."""
    base = _backward_mm([], {})
    op = _backward_mm([], {"layers.2": SacPolicy.TITAN}) - base
    tr = traced("toy-llama")
    (call,) = checkpointed_calls(tr, [("layers.2", SacPolicy.TITAN)])
    assert op == Counter(tr.events[i].op_class for i in call.recomputed(tr))[OpClass.MM] == 3
    assert _backward_mm(["layers.0"], {"layers.2": SacPolicy.TITAN}) - base > op


def test_ac_op_on_a_model_without_blocks_names_the_plan_key():
    with pytest.raises(PlannerError, match=r"no repeated composite module class.*\"selective_checkpointing\" instead"):
        _titan_on("seed-net", ACMode.OP)


def _titan_on(model: str, ac: ACMode) -> Plan:
    return make_policy(PolicyRequest.named("titan", checkpointing=ac)).plan(traced(model), model)


def test_cli_ac_op_and_its_policy(capsys):
    assert main(["simulate", "toy-llama", "--policy", "titan", "--ac", "op", "--ac-policy", "titan-early",
                 "--cluster", "h100:8"]) == 0
    assert "+ ac op titan-early" in capsys.readouterr().out
    assert main(["plan", "toy-llama", "--policy", "titan", "--ac", "op"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "│ layers." in line]  # the groups table's block rows
    assert len(rows) == 4 and all(row.rstrip(" │").endswith("op titan") for row in rows)
    assert "│ 4 op │" in out  # the comparison table's AC column
    assert main(["simulate", "toy-llama", "--policy", "titan", "--ac", "full", "--ac-policy", "titan",
                 "--cluster", "h100:8"]) != 0
    assert "--ac-policy chooses what op-level checkpointing saves: give it with --ac op, or to the auto policy " \
        "without --ac (its op-level blocks then save so)" in capsys.readouterr().err
    assert main(["plan", "toy-llama", "--policy", "titan", "--ac-policy", "titan"]) != 0  # (titan without --ac)
    assert "give it with --ac op" in capsys.readouterr().err


def test_auto_s_own_op_level_choices_save_what_ac_policy_says(capsys):
    """Auto without --ac chooses each block's checkpointing, op-level among its choices, and --ac-policy was
    refused there (a trial): it is what auto's op-level blocks save now. GPT-2's blocks save less under the 2024
    list, so at 2 MiB a rank auto checkpoints both op-level, where under torchtitan's list one runs in full."""
    chosen = {}
    for ac_policy in ((), ("--ac-policy", "titan-early")):
        assert main(["plan", "toy-gpt2-tied", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "2MiB",
                     *ac_policy, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)["plans"][0]["plan"]
        chosen[ac_policy] = (plan["activation_checkpointing"], plan["selective_checkpointing"])
    assert chosen[()] == (["h.0"], {"h.1": "titan"})
    assert chosen[("--ac-policy", "titan-early")] == ([], {"h.0": "titan-early", "h.1": "titan-early"})


def test_trace_events_carry_op_classes_for_forward_ops_and_the_loss_s_backward():
    """The model's backward ops carry no class; the loss's do (loss parallel runs some otherwise)."""
    tr = traced("toy-llama")
    ops = [(e, bool(inside)) for e, inside in zip(tr.events, tr.index.loss_region, strict=True)
           if e.kind is EventKind.OP]
    assert {e.op_class for e, loss in ops if e.backward and not loss} == {OpClass.OTHER}
    assert all(e.out_nbytes == 0 for e, loss in ops if e.backward and not loss)
    loss_backward = {e.op_class: e.out_nbytes for e, loss in ops if e.backward and loss}
    assert loss_backward[OpClass.NLL_LOSS_BACKWARD] == loss_backward[OpClass.LOG_SOFTMAX_BACKWARD] > 0
    assert Counter(e.op_class for e, _ in ops if not e.backward and e.module.startswith("layers."))[OpClass.SDPA] == 4


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
@pytest.mark.parametrize("world", [8, 64])
def test_real_fsdp2_with_op_sac_matches_the_prediction(world):
    """Real FSDP2 on the fake process group, the plan applied with apply_plan (so with torch's SAC): the same
    collectives, and the peak within 5% of the prediction."""
    options = SimOptions()
    lm = load_model("toy-llama")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype)
    plan = make_policy(PolicyRequest.named("titan", checkpointing=ACMode.OP)).plan(tr, "toy-llama")
    predicted = simulate(tr, plan, parse_cluster(f"h100:{world}"), options, timeline=False)
    measured = run_fake_world("toy-llama", plan, world, options.precision)
    assert measured.counts == {"all_gather": predicted.all_gathers, "reduce_scatter": predicted.reduce_scatters,
                               "all_reduce": 0}
    assert predicted.peak_memory == pytest.approx(measured.peak_memory, rel=0.05)


@pytest.mark.integration
def test_verify_passes_with_op_sac_on_real_gloo_ranks():
    """torchrun + gloo, 2 ranks: the op-SAC plan counts the predicted collectives and trains to the unsharded
    reference's params."""
    from fsdp_planner.runtime.verify import run_verify

    result = run_verify("toy-llama", traced("toy-llama"), _titan(ACMode.OP), nproc=2, steps=2)
    assert result.ok and result.max_abs_diff <= 1e-5
    assert result.counted == [result.predicted] * 2


def test_exported_code_applies_the_same_op_sac():
    """``export``'s self-contained copy of the policy recomputes what fsdp-planner's own apply does (the 3 dropped
    mm of a block), and plans without op-level checkpointing export as before (no SAC code)."""
    plan = _titan(ACMode.OP)
    scope: dict = {}
    exec(compile(export_plan(plan, ExportFormat.PYTHON), "exported.py", "exec"), scope)
    assert scope["SELECTIVE"] == dict.fromkeys(BLOCKS, "titan")
    lm = load_model("toy-llama", meta=False)
    base = _backward_mm([], {})
    scope["_checkpoint_selective"](lm.model.get_submodule("layers.2"), "titan")
    loss = lm.model(*lm.example_inputs).float().pow(2).mean()
    with _CountMm() as counter:
        loss.backward()
    assert counter.mm - base == _backward_mm([], {"layers.2": SacPolicy.TITAN}) - base == 3
    assert "_checkpoint_selective" not in export_plan(_titan(ACMode.FULL), ExportFormat.PYTHON)


@pytest.mark.integration
def test_exported_op_sac_plan_trains_like_unsharded_on_gloo(tmp_path):
    """The exported module of an op-SAC plan, run by examples/torchrun_fsdp2.py on 2 gloo ranks: parameter
    parity with unsharded training."""
    code = tmp_path / "plan_python.py"
    code.write_text(export_plan(_titan(ACMode.OP), ExportFormat.PYTHON, PRECISIONS["fp32"]))  # as the reference
    root = Path(__file__).resolve().parents[1]
    env = launch_env(tmp_path, PYTHONPATH=str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(root / "examples" / "torchrun_fsdp2.py"), str(code)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert max_abs_diff(out.stdout) <= 1e-5


@pytest.mark.integration
@pytest.mark.parametrize("world", [8, 64])
def test_llama3_8b_op_sac_peak_matches_real_fsdp2(world, capsys):
    """The issue's bar: llama3-8b (batch 1, seq 8192, bf16-mixed) with op-level SAC on every block, its peak within
    5% of real FSDP2's on the fake process group (measured at the time of writing: within 2 KB at 8 and 64)."""
    assert main(["verify", "llama3-8b", "--policy", "titan", "--ac", "op", "--fake-world-size", str(world),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["counts_and_bytes_exact"] and doc["ok"]
    assert abs(doc["peak_error"]) < 0.05


def test_auto_with_ac_op_checkpoints_every_block_it_can_op_level():
    """``--ac op`` fixes op-level SAC for every plan auto simulates, as ``--ac full`` fixes full checkpointing:
    each block no group lies inside is checkpointed op-level, none in full, and the report is that plan's."""
    tr = traced("toy-llama")
    cluster = parse_cluster("h100:8")
    auto = make_policy(PolicyRequest.named("auto", checkpointing=ACMode.OP, sac_policy=SacPolicy.TITAN_EARLY), cluster)
    plan = auto.plan(tr, "toy-llama")
    inside = {b for b in BLOCKS for g in plan.groups for m in g.modules if m != b and m.startswith(b + ".")}
    assert list(plan.activation_checkpointing) == [] and plan.policy.endswith("ac op titan-early)")
    assert plan.selective_checkpointing == {b: SacPolicy.TITAN_EARLY for b in BLOCKS if b not in inside}
    assert len(plan.selective_checkpointing) == 4  # on this model auto's plan holds no group inside a block
    report = simulate(tr, plan, cluster, timeline=False)
    assert report.recompute_time == pytest.approx(sum(r.seconds for r in SimContext(tr, cluster).recompute(
        [(b, SacPolicy.TITAN_EARLY) for b in BLOCKS]).values()))


def test_torchtitan_2026_list_on_an_moe_block_decides_as_real_sac():
    """torchtitan's SelectiveAC of 2026 on a block of the built-in MoE (real, CPU): the router gate's mm is
    recomputed uncounted (a Linear named ``moe.router.gate``), its topk and the experts' bmm saved, every second
    of the other mm recomputed; the trace on meta keeps the same ops in the same order, and its 2025 list keeps
    neither the topk nor the bmm."""
    from fsdp_planner.trace.ops import router_shapes

    spec = "tests/fixtures/ep_moe.py:tiny_mixtral"
    lm = load_model(spec, meta=False)
    block = lm.model.get_submodule("layers.1")
    log: list[tuple[object, bool]] = []
    shapes = router_shapes((n, tuple(p.shape)) for n, p in block.named_parameters())
    assert shapes == {(128, 8)}
    checkpoint(block, context_fn=sac_context_fn(SacPolicy.TITAN, lambda f, s: log.append((f, s)), shapes))
    lm.model(*lm.example_inputs).float().pow(2).mean().backward()
    real_saved = [op_class(f) for f, saved in log if saved]
    gate = [saved for f, saved in log if op_class(f) is OpClass.MM and f is torch.ops.aten.mm.default]

    tr = traced(spec)
    (call,) = checkpointed_calls(tr, [("layers.1", SacPolicy.TITAN)])
    assert [tr.events[i].op_class for i in call.kept] == real_saved
    assert real_saved.count(OpClass.TOPK) == 1 and real_saved.count(OpClass.COMPUTE_MORE) == 3
    assert len(gate) == 5 and gate[4] is False  # q, k, v, o: two kept; the router's gate: recomputed
    (old,) = checkpointed_calls(tr, [("layers.1", SacPolicy.TITAN_2025)])
    assert {tr.events[i].op_class for i in old.kept} == {OpClass.MM, OpClass.SDPA, OpClass.ROUTER_MM}  # 5th mm


def test_transformers_experts_under_the_2026_list_decide_as_their_real_grouped_mm_path(tmp_path):
    """A transformers Qwen3 MoE block, real on the CPU through transformers' own ``grouped_mm`` experts path, with
    torchtitan's 2026 SelectiveAC: its router's topk is kept and its experts' ``_grouped_mm`` recomputed (no list
    names it). The trace plans the same layer through the balanced stand-in (``hf_experts.py``), whose matmuls must
    be classed as that path's: it keeps the same ops in the same order (a ``bmm`` stand-in was kept as ``bmm``)."""
    config = tmp_path / "qwen3_moe.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 128}))
    from fsdp_planner.trace.ops import router_shapes

    spec, block = f"hf:{config}", "model.layers.1"
    lm = load_model(spec, meta=False)
    log: list[tuple[object, bool]] = []
    layer = lm.model.get_submodule(block)
    router = router_shapes((n, tuple(p.shape)) for n, p in layer.named_parameters())
    assert router == {(64, 4)}  # its mlp.gate (transformers' name), not an mlp.*_proj
    checkpoint(layer, context_fn=sac_context_fn(SacPolicy.TITAN, lambda f, s: log.append((f, s)), router))
    lm.model(**lm.example_inputs).logits.float().pow(2).mean().backward()
    real_saved = [op_class(f) for f, saved in log if saved]
    assert any("grouped_mm" in str(f) and not saved for f, saved in log)

    tr = traced(spec)
    (call,) = checkpointed_calls(tr, [(block, SacPolicy.TITAN)])
    assert [tr.events[i].op_class for i in call.kept] == real_saved
    assert OpClass.TOPK in real_saved and OpClass.COMPUTE_MORE not in real_saved
    assert OpClass.ROUTER_MM in {tr.events[i].op_class for i in call.recomputed(tr)}


# transformers' Qwen3-MoE, tiny: its router divides the top-k weights in place (``router_top_value /= ...``) where
# it renormalises them, as Qwen3-30B-A3B's config asks
TINY_QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3moe") / "config.json"
    path.write_text(json.dumps(TINY_QWEN3_MOE))
    return f"hf:{path}"


def test_a_router_modifying_its_saved_topk_refuses_the_policy_that_saves_it(qwen3_moe, capsys):
    """A new user's trial: ``--ac op`` on transformers' Qwen MoE models was planned without a word, and real FSDP2
    (fake ranks, gloo) then raised "Tensor cached during selective activation checkpoint has been mutated": the
    titan policy saves topk's outputs, which the router divides in place. The trace sees it; the plan names the
    router and the way out, titan-2025 (no topk saved) plans, and auto checkpoints those blocks in full only."""
    tr = traced(qwen3_moe)
    assert [m for m, i in tr.modules.items() if i.topk_modified] == ["model.layers.0.mlp.gate",
                                                                     "model.layers.1.mlp.gate"]
    assert main(["plan", qwen3_moe, "--policy", "titan", "--ac", "op", "--cluster", "h100:8"]) == 2
    err = capsys.readouterr().err
    assert "'model.layers.0.mlp.gate' modifies its topk's outputs in place" in err and "titan-2025" in err
    assert main(["plan", qwen3_moe, "--policy", "titan", "--ac", "op", "--ac-policy", "titan-2025", "--cluster",
                 "h100:8", "--json"]) == 0
    # what auto's checkpointing search asks of each block (op-level there only where no such router is inside)
    from fsdp_planner.fsdp2.checkpointing import modified_topk

    assert modified_topk(tr, "model.layers.1", SacPolicy.TITAN) == "model.layers.1.mlp.gate"
    assert modified_topk(tr, "model.layers.1", SacPolicy.TITAN_2025) is None
    assert modified_topk(tr, "model.layers.1.self_attn", SacPolicy.TITAN) is None


def test_auto_says_why_it_tries_no_op_level_and_the_list_that_lets_it(qwen3_moe, capsys):
    """Auto checkpointed the blocks of such a router in full only, and --explain said "of 2 settings simulated"
    without a word on op-level (a trial): it says why and which list keeps no topk; with that list auto
    checkpoints op-level (--ac-policy without --ac)."""
    said = {}
    for ac_policy in ((), ("--ac-policy", "titan-2025")):
        assert main(["plan", qwen3_moe, "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "3MiB",
                     "--explain", *ac_policy]) == 0
        said[ac_policy] = next(line for line in capsys.readouterr().out.splitlines()
                               if line.startswith("checkpointing:"))
    assert said[()].startswith("checkpointing: 1 full of the first blocks") and said[()].endswith(
        "op-level not tried: a block's router modifies in place the topk outputs the titan save list keeps, which "
        "torch refuses (--ac-policy titan-2025 keeps none)")
    assert said[("--ac-policy", "titan-2025")].startswith("checkpointing: 1 op titan-2025 of the first blocks")
    assert "not tried" not in said[("--ac-policy", "titan-2025")]


@pytest.mark.integration
def test_the_policy_that_saves_no_topk_runs_on_fake_ranks(qwen3_moe):
    from conftest import run_main

    r = run_main("verify", qwen3_moe, "--policy", "titan", "--ac", "op", "--ac-policy", "titan-2025",
                 "--fake-world-size", "8", "--cluster", "h100:8")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr


class _Router(nn.Module):
    """A router renormalising its top-k weights in place in its own forward (transformers 5's MoE routers)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = torch.topk(F.linear(x, self.weight).softmax(-1), 2, dim=-1)
        weights /= weights.sum(-1, keepdim=True)
        return weights, chosen


class _Returning(nn.Module):
    """Returns topk's outputs as they are; its caller renormalises them in place."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(F.linear(x, self.weight).softmax(-1), 2, dim=-1)


class _Layer(nn.Module):
    def __init__(self, router: type[nn.Module]) -> None:
        super().__init__()
        self.gate, self.up = router(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, _ = self.gate(x)
        if isinstance(self.gate, _Returning):
            weights /= weights.sum(-1, keepdim=True)
        return x + self.up(x) * weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("router", [_Router, _Returning])
def test_a_modified_topk_is_seen_in_a_replayed_block_as_in_a_traced_one(router):
    """A repeated module is traced once and replayed: its own body's topk modified in place, and a topk output it
    returns that its caller modifies, were missed there (a reviewer's finding) and seen without the replay."""
    found = []
    for reuse in (True, False):
        with torch.device("meta"):
            model = nn.Sequential(*(_Layer(router) for _ in range(3)))
        tr = record(model, (torch.randn(2, 8, 16, device="meta"),), lambda out: out.sum(), reuse=reuse)
        found.append([m for m, info in tr.modules.items() if info.topk_modified])
    assert found[0] == found[1] == [f"{i}.gate" for i in range(3)]


def test_auto_with_op_level_fixed_refuses_such_a_router_as_a_plan_file_is(qwen3_moe, capsys):
    assert main(["plan", qwen3_moe, "--policy", "auto", "--ac", "op", "--cluster", "h100:8"]) == 2
    assert "modifies its topk's outputs in place" in capsys.readouterr().err


def test_torchtitan_s_own_router_runs_its_selective_checkpointing(tmp_path, capsys):
    """A torchtitan job is simulated on transformers' modules of its numbers, but torchtitan's router divides out of
    place: its SelectiveAC saving topk runs, and is not refused (a reviewer's finding)."""
    job = tmp_path / "config_registry.py"
    job.write_text("from torchtitan.components.optimizer import default_adamw\n"
                   "from torchtitan.config import ParallelismConfig, TrainingConfig\n"
                   "from torchtitan.distributed.activation_checkpoint import SelectiveAC\n"
                   "from torchtitan.models.qwen3 import model_registry\n"
                   "from torchtitan.trainer import Trainer\n\n\n"
                   "def job() -> Trainer.Config:\n"
                   "    return Trainer.Config(\n"
                   "        model_spec=model_registry(\"debugmodel_moe\"),\n"
                   "        optimizer=default_adamw(lr=1e-4),\n"
                   "        training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=1024,\n"
                   "                                max_context_length=512),\n"
                   "        parallelism=ParallelismConfig(data_parallel_shard_degree=8),\n"
                   "        activation_checkpoint=SelectiveAC.Config(),\n"
                   "    )\n")
    assert main(["simulate", "--from-torchtitan", f"{job}:job", "--cluster", "h100:8", "--json"]) == 0, \
        capsys.readouterr().err
