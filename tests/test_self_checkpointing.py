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
