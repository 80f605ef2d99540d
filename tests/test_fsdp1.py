"""FSDP1: a plan as an auto_wrap_policy, refusals, and a real FullyShardedDataParallel run on gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_main

from fsdp_planner.apply.fsdp1 import check_fsdp1, fsdp1_policy, fsdp1_refusal
from fsdp_planner.errors import PlannerError
from fsdp_planner.models import load_model
from fsdp_planner.planners.classic import SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.trace import record


def _trace():
    lm = load_model("toy-llama")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def test_policy_wraps_exactly_the_plans_modules_with_their_strategy() -> None:
    from torch.distributed.fsdp import ShardingStrategy

    plan = SizeBasedPolicy(20000).plan(_trace()).with_group(1, reshard_after_forward=False)
    model = load_model("toy-llama", meta=False).model
    policy = fsdp1_policy(plan, model)
    modules = dict(model.named_modules())
    chosen = policy._run_policy(model, set(), {})  # FSDP1 calls this; what it would wrap, and how
    assert sorted(n for n, m in modules.items() if m in chosen) == sorted(g.modules[0] for g in plan.inner_groups)
    assert chosen[modules[plan.groups[1].modules[0]]]["sharding_strategy"] is ShardingStrategy.SHARD_GRAD_OP
    assert chosen[modules[plan.groups[0].modules[0]]]["sharding_strategy"] is ShardingStrategy.FULL_SHARD


def test_plans_fsdp1_cannot_express_are_refused_in_one_sentence() -> None:
    plan = TorchtitanPolicy("TransformerBlock").plan(_trace())
    assert "list of 2 modules" in fsdp1_refusal(plan)
    with pytest.raises(PlannerError, match="FSDP1 cannot run this plan"):
        check_fsdp1(plan)


def test_a_unit_mixing_frozen_and_trainable_params_is_refused_before_the_ranks_start(tmp_path: Path) -> None:
    """verify --fsdp1 of a plan whose unit mixes requires_grad: refused from the trace, before torchrun (both
    ranks used to start and raise), advising FSDP2 or auto's FSDP1 target, not the --target the user gave."""
    lm = load_model("toy-llama-lora")
    plan = SizeBasedPolicy(20000).plan(record(lm.model, lm.example_inputs, lm.loss_fn))  # base and adapters mixed
    path = tmp_path / "plan.json"
    plan.save(path)
    out = run_main("verify", "toy-llama-lora", "--plan", str(path), "--fsdp1", "--nproc", "2")
    assert out.returncode == 2 and "torchrun" not in out.stderr
    assert "mixes dtypes or requires_grad in one FSDP1 flat parameter: run it with FSDP2 (drop --fsdp1)" in out.stderr


@pytest.mark.integration
def test_verify_fsdp1_on_two_gloo_ranks(tmp_path: Path) -> None:
    # SHARD_GRAD_OP: no re-gather in backward
    plan = SizeBasedPolicy(20000).plan(_trace()).with_group(1, reshard_after_forward=False)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = run_main("verify", "toy-llama", "--plan", str(path), "--fsdp1", "--nproc", "2", "--json")
    result = json.loads(out.stdout)
    assert result["ok"], out.stdout + out.stderr
    assert sorted(result["units"]) == sorted([g.modules[0] for g in plan.inner_groups] + [""])
    assert result["counted"][0] == result["predicted"]
    # the same data and reference step as FSDP2's verify: the global batch's loss, step for step
    assert len(result["losses"]) == result["steps"] and result["losses"] == pytest.approx(result["reference_losses"],
                                                                                          rel=1e-5)


def _lora_fsdp1_plan():
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners import AutoPolicy
    from fsdp_planner.planners.auto.evaluator import Target

    lm = load_model("toy-llama-lora")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    return tr, AutoPolicy(parse_cluster("h100:2"), target=Target.FSDP1).plan(tr)


def test_fsdp1_issues_no_backward_all_gather_for_a_unit_whose_outputs_need_no_grad() -> None:
    """LoRA's first block: its frozen base layers see an input that needs no grad, so their outputs need none and
    no pre-backward hook fires for them. FSDP2 still gathers the one its default backward prefetch reaches (wv's,
    prefetched from wo's pre-backward); FSDP1 skips it (measured: 65 all-gathers, not 66)."""
    from fsdp_planner.fsdp2.collectives import CollectiveKind
    from fsdp_planner.fsdp2.fsdp1_replay import fsdp1_collectives
    from fsdp_planner.fsdp2.replay import build_schedule

    tr, plan = _lora_fsdp1_plan()
    fsdp2 = build_schedule(tr, plan, 2).collectives
    fsdp1 = fsdp1_collectives(tr, plan, 2)
    dropped = [c for c in fsdp2 if c not in fsdp1]
    wv = next(i for i, g in enumerate(plan.groups) if list(g.modules) == ["layers.0.attention.wv.base_layer"])
    assert [(c.kind, c.group, c.backward, c.prefetch) for c in dropped] == [(CollectiveKind.ALL_GATHER, wv, True, True)]


@pytest.mark.integration
def test_verify_fsdp1_on_a_lora_model(tmp_path: Path) -> None:
    _, plan = _lora_fsdp1_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    out = run_main("verify", "toy-llama-lora", "--plan", str(path), "--fsdp1", "--nproc", "2", "--json")
    result = json.loads(out.stdout)
    assert result["ok"], out.stdout + out.stderr
    assert result["counted"][0] == result["predicted"]


@pytest.mark.parametrize(("flags", "said"), [
    (("--float8", "tensorwise"), "float8 (--float8)"),
    (("--ac", "full"), "activation checkpointing (--ac)"),
    (("--offload",), "CPU offload (--offload)"),
    (("--reduce-dtype", "bf16"), "a reduce dtype (--reduce-dtype)"),
])
def test_verify_fsdp1_refuses_what_its_ranks_would_not_run(flags: tuple[str, ...], said: str) -> None:
    """FSDP1's ranks wrap the units and train: with --float8 they trained bf16, with --ac or --offload without
    them, and passed (a trial: the float8 job's losses were plain FSDP1's). Refused before torchrun starts."""
    r = run_main("verify", "toy-llama", "--policy", "module", "--nproc", "2", "--fsdp1", *flags)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr
    assert f"this plan also asks for {said}: verify it with FSDP2 (drop --fsdp1)" in r.stderr
