"""Distributed checkpoints (DCP) across world sizes and plans: ``verify --save-checkpoint`` at 2 ranks, then
``--load-checkpoint`` at 4 ranks under another plan, and back to 2 under a third: nothing lost, and training goes
on as one uninterrupted run on the same data would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_planner import cli
from fsdp_planner.runtime.checkpoint import META, digests, read_meta
from fsdp_planner.runtime.verify import check_load_dir

LR, SEED = 0.05, 0


def _verify(*args: str) -> dict:
    # fp32, as the uninterrupted run these jobs are compared with (reference_step without FSDP2's casts)
    out = subprocess.run([sys.executable, "-m", "fsdp_planner", "verify", "toy-llama", *args, "--precision", "fp32",
                          "--json"],
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def _files_state(directory: Path) -> dict:
    """The checkpoint's full model and optimizer state, read from its files in this process (no process group:
    DCP reads every shard), laid out as ``get_state_dict`` gives it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fsdp_planner.models import load_model
    from fsdp_planner.runtime.worker import MOMENTUM

    model = load_model("toy-llama", meta=False, seed=SEED).model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # zeros of the right shapes, momentum buffers included
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    return state


def _uninterrupted_losses(worlds: list[int]) -> list[float]:
    """One process trains the unsharded model with step s on the micro-batches of ``worlds[s]`` ranks: the run
    the chain of jobs must reproduce."""
    import torch

    from fsdp_planner.models import ModelSpec, load_model
    from fsdp_planner.runtime.worker import MOMENTUM, batch, reference_step

    model = load_model("toy-llama", meta=False, seed=SEED).model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    spec = ModelSpec("toy-llama")
    return [reference_step(model, optimizer, [batch(spec, step, r, SEED) for r in range(world)], step, SEED,
                           torch.device("cpu")) for step, world in enumerate(worlds)]


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # reading it here, on purpose
def test_a_checkpoint_goes_from_2_to_4_ranks_and_back_under_other_plans(tmp_path):
    first, second = tmp_path / "at2", tmp_path / "at4"
    a = _verify("--policy", "order", "--nproc", "2", "--steps", "2", "--save-checkpoint", str(first))
    b = _verify("--policy", "auto", "--nproc", "4", "--steps", "1", "--load-checkpoint", str(first),
                "--save-checkpoint", str(second))
    c = _verify("--policy", "size", "--min-nonwrapped-numel", "20000", "--nproc", "2", "--steps", "2",
                "--load-checkpoint", str(second))
    assert a["ok"] and b["ok"] and c["ok"]

    # the state each job restored (resharded onto 4 ranks and one list group; then onto 2 ranks and four
    # feed-forward groups) is the saved one, tensor for tensor: params and momentum buffers
    for run, source, world in ((b, first, 2), (c, second, 4)):
        loaded = run["loaded"]
        assert (loaded["step"], loaded["world"], loaded["mismatched"]) == (run["start_step"], world, [])
        assert loaded["tensors"] == len(read_meta(source)["digests"])
    saved = read_meta(first)["digests"]
    assert sum(k.endswith(".momentum_buffer") for k in saved) == sum(k.startswith("model.") for k in saved) > 0
    # ... and the files hold what the 2 ranks had in memory when they saved (read here with no process group)
    assert digests(_files_state(first)) == saved

    # every job's steps continue the same data: the losses are those of one uninterrupted run
    losses = a["losses"] + b["losses"] + c["losses"]
    assert (a["start_step"], b["start_step"], c["start_step"]) == (0, 2, 3)
    assert losses == pytest.approx(_uninterrupted_losses([2, 2, 4, 2, 2]), rel=1e-5)
    assert a["reference_losses"] + b["reference_losses"] + c["reference_losses"] == pytest.approx(losses, rel=1e-5)
    assert c["max_abs_diff"] <= 1e-5  # the params after the chain match the uninterrupted reference's


def test_save_checkpoint_refuses_a_directory_with_files(capsys, tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "mine.txt").write_text("keep")
    assert cli.main(["verify", "seed-net", "--policy", "order", "--save-checkpoint", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --save-checkpoint '{tmp_path / 'ck'}' already exists and is not an empty directory: give " \
                  "a new one\n"
    assert (tmp_path / "ck" / "mine.txt").read_text() == "keep"


def test_load_checkpoint_refuses_what_verify_did_not_write(capsys, tmp_path):
    assert cli.main(["verify", "seed-net", "--policy", "order", "--load-checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --load-checkpoint '{tmp_path}' is not a checkpoint written by verify "
                                       f"--save-checkpoint (no {META} in it)\n")


def test_load_checkpoint_refuses_another_models(tmp_path):
    from fsdp_planner.errors import PlannerError

    (tmp_path / META).write_text(json.dumps({"step": 2, "fingerprint": "abc", "digests": {}}))
    assert check_load_dir(tmp_path, "abc")["step"] == 2
    with pytest.raises(PlannerError, match="was saved from another model"):
        check_load_dir(tmp_path, "def")
