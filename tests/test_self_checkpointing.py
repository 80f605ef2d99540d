"""Models that call ``torch.utils.checkpoint`` themselves: traced, planned and checked against real FSDP2."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_planner.cli import main
from fsdp_planner.models import load_model
from fsdp_planner.trace import record

FIXTURE = Path(__file__).parent / "fixtures" / "self_checkpointing.py"


@pytest.mark.parametrize("factory", ["non_reentrant", "reentrant", "sequential"])
def test_a_self_checkpointing_model_traces_with_and_without_block_reuse(factory: str) -> None:
    """Block reuse used to replay a call inside the user's checkpoint region, so its recomputation saved a
    different number of tensors ("A different number of tensors was saved ...")."""
    events = []
    for reuse in (True, False):
        lm = load_model(f"{FIXTURE}:{factory}")
        events.append(record(lm.model, lm.example_inputs, lm.loss_fn, reuse=reuse).events)
    assert events[0] == events[1]


@pytest.mark.parametrize("factory", ["non_reentrant", "sequential"])
def test_a_self_checkpointing_model_plans(factory: str) -> None:
    assert main(["plan", f"{FIXTURE}:{factory}", "--policy", "titan", "--cluster", "h100:8"]) == 0


@pytest.mark.integration  # real FSDP2 on fake ranks: the full suite runs it
def test_a_non_reentrant_checkpointing_model_matches_real_fsdp2_on_8_fake_ranks(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", f"{FIXTURE}:non_reentrant", "--policy", "titan", "--fake-world-size", "8"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.integration  # two gloo ranks under torchrun
def test_a_non_reentrant_checkpointing_model_trains_on_2_gloo_ranks() -> None:
    assert main(["verify", f"{FIXTURE}:non_reentrant", "--policy", "titan", "--nproc", "2"]) == 0


def test_transformers_gradient_checkpointing_is_replaced_by_the_plans(capsys: pytest.CaptureFixture[str]) -> None:
    """``gradient_checkpointing_enable()`` wraps each layer (SDPA inside) in torch.utils.checkpoint, whose
    recomputation the trace could not replay (refused before): the model's own is turned off where it is built, the
    plan's checkpointing stands in for it (--ac full: the same blocks), and apply_plan turns it off too."""
    from fsdp_planner.apply import apply_plan
    from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy
    from fsdp_planner.service.tracing import trace_spec

    lm = load_model(f"{FIXTURE}:hf_llama")
    assert lm.own_checkpointing == tuple(f"model.layers.{i}" for i in range(4))
    assert not lm.model.is_gradient_checkpointing
    assert main(["plan", f"{FIXTURE}:hf_llama", "--policy", "titan", "--ac", "full", "--cluster", "h100:8"]) == 0
    assert "the model turns on transformers' gradient checkpointing (4 layers" in capsys.readouterr().err
    spec = f"{FIXTURE}:hf_llama"
    plan = make_policy(PolicyRequest(PolicyName.TITAN)).plan(trace_spec(spec), spec)
    real = load_model(spec, meta=True).model
    real.gradient_checkpointing_enable()
    assert real.is_gradient_checkpointing
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_plan(real, plan, mesh=init_device_mesh("cpu", (2,)))
    finally:
        dist.destroy_process_group()
    assert not real.is_gradient_checkpointing


@pytest.mark.integration  # real FSDP2 on fake ranks
def test_transformers_gradient_checkpointing_model_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", f"{FIXTURE}:hf_llama", "--policy", "titan", "--ac", "full", "--fake-world-size", "8"]) == 0
    assert "PASS" in capsys.readouterr().out
