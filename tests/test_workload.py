"""The workload is the user's: --batch and --seq reach the model's factory (built-ins and user factories), the
trace and the real runs follow it, and an option the factory cannot take is one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_planner.cli import main
from fsdp_planner.cli.common import load_trace
from fsdp_planner.cli.render import notes
from fsdp_planner.errors import PlannerError
from fsdp_planner.models import BUILTINS, ModelSpec, load_model, workload_defaults

FACTORY = '''
import torch
import torch.nn as nn

def sized(batch_size=2, seq_len=8):
    return nn.Linear(16, 16), (torch.randn(batch_size, seq_len, 16),)

def fixed():
    return nn.Linear(16, 16), (torch.randn(2, 16),)
'''


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "factories_workload.py"
    path.write_text(FACTORY)
    return path


@pytest.mark.integration  # seconds of planning (the fast subset stays near a minute)
def test_batch_and_seq_scale_the_traced_step():
    """FLOPs of a decoder are linear in the batch; the saved activations grow with the sequence."""
    base = load_trace(ModelSpec("toy-llama"), notes)
    doubled = load_trace(ModelSpec("toy-llama", batch_size=8), notes)
    assert doubled.fwd_flops == 2 * base.fwd_flops and doubled.bwd_flops == 2 * base.bwd_flops
    longer = load_trace(ModelSpec("toy-llama", seq_len=64), notes)
    assert sum(e.saved for e in longer.events) > 1.9 * sum(e.saved for e in base.events)
    assert doubled.numel == base.numel  # the model is the same


def test_every_builtin_default_is_what_it_builds():
    """The defaults `fsdp-planner models` prints are the shapes the factory builds."""
    lm = load_model("llama3-8b")
    assert tuple(lm.example_inputs[0].shape) == (1, 8192)
    assert workload_defaults(BUILTINS["llama3-8b"].factory) == {"batch_size": 1, "seq_len": 8192}
    t5 = load_model(ModelSpec("t5-3b", batch_size=2, seq_len=512))
    assert [tuple(t.shape) for t in t5.example_inputs] == [(2, 512), (2, 128)]
    assert ModelSpec("llama3-8b", seq_len=4096).label() == "llama3-8b, batch 1, seq 4,096"


def test_user_factory_takes_the_workload_it_declares(factory_file: Path):
    lm = load_model(ModelSpec(f"{factory_file}:sized", batch_size=3, seq_len=5))
    assert tuple(lm.example_inputs[0].shape) == (3, 5, 16)
    with pytest.raises(PlannerError, match=r"--seq does not apply to .*takes no 'seq_len' keyword argument"):
        load_model(ModelSpec(f"{factory_file}:fixed", seq_len=5))


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "vit-h14", "--policy", "titan", "--seq", "512"], "--seq does not apply to 'vit-h14'"),
    (["plan", "seed-linear10", "--policy", "titan", "--batch", "2"], "--batch does not apply to 'seed-linear10'"),
    (["plan", "toy-llama", "--policy", "titan", "--batch", "0"], "--batch must be at least 1"),
    (["plan", "toy-llama", "--policy", "titan", "--seq", "1.5"], "is not a whole number"),
])
def test_bad_workload_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_plan_prints_the_workload_it_planned(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "toy-llama", "--policy", "titan", "--batch", "2", "--seq", "16"]) == 0
    assert "toy-llama, batch 2, seq 16" in capsys.readouterr().out


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
def test_fake_world_check_runs_the_users_workload(capsys: pytest.CaptureFixture[str]):
    """Real FSDP2 on fake ranks builds the model with the same --seq as the prediction: they agree."""
    code = main(["verify", "toy-llama", "--policy", "titan", "--fake-world-size", "8", "--seq", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["counts_and_bytes_exact"], out
    assert abs(out["peak_error"]) <= 0.05


@pytest.mark.integration
def test_verify_trains_with_the_users_batch(capsys: pytest.CaptureFixture[str]):
    """Real gloo ranks train toy-llama at --batch 2 --seq 16 with parameter parity."""
    assert main(["verify", "toy-llama", "--policy", "titan", "--nproc", "2", "--batch", "2", "--seq", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_match"] and out["counts_match"] and out["bytes_match"], out
