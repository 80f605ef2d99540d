"""Distributed checkpoints (DCP) across world sizes and plans: ``verify --save-checkpoint`` at 2 ranks, then
``--load-checkpoint`` at 4 ranks under another plan, and back to 2 under a third: nothing lost, and training goes
on as one uninterrupted run on the same data would."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import run_main

from fsdp_planner import cli
from fsdp_planner.runtime.checkpoint import META, REFERENCE, VERSION, CheckpointLoadError, digests, read_meta, reading
from fsdp_planner.runtime.checkpoint_pickle import DCP_METADATA
from fsdp_planner.runtime.verify import check_load_dir

LR, SEED = 0.05, 0


def _verify(*args: str) -> dict:
    # fp32, as the uninterrupted run these jobs are compared with (reference_step without FSDP2's casts)
    out = run_main("verify", "toy-llama", *args, "--precision", "fp32", "--json")
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
    return [reference_step(model, optimizer, [[batch(spec, step, r, SEED)] for r in range(world)], step, SEED,
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
    # a path that is not there, or a file, said so (both were "no fsdp-planner.json in it": a trial)
    written = "is a file, not a checkpoint directory written by verify --save-checkpoint"
    for path, said in ((tmp_path / "none", "does not exist"), (tmp_path / "file", written)):
        if said.startswith("is a file"):
            path.write_text("x")
        assert cli.main(["verify", "seed-net", "--policy", "order", "--load-checkpoint", str(path)]) == 2
        assert capsys.readouterr().err == f"error: --load-checkpoint '{path}' {said}\n"


def _checkpoint_files(directory: Path, **meta: object) -> None:
    """What verify --save-checkpoint leaves (the files' contents are not read before the ranks load them)."""
    (directory / META).write_text(json.dumps({"version": VERSION, "step": 2, "world": 2, "policy": "size",
                                              "fingerprint": "abc", "digests": {}, **meta}))
    (directory / DCP_METADATA).write_bytes(b"")
    (directory / REFERENCE).write_bytes(b"")


def test_load_checkpoint_refuses_another_models(tmp_path):
    from fsdp_planner.errors import PlannerError

    _checkpoint_files(tmp_path)
    assert check_load_dir(tmp_path, "abc")["step"] == 2
    with pytest.raises(PlannerError, match="was saved from another model"):
        check_load_dir(tmp_path, "def")


def test_load_checkpoint_refuses_another_format_before_any_rank_starts(capsys, tmp_path):
    _checkpoint_files(tmp_path, version=VERSION + 1)
    assert cli.main(["verify", "seed-net", "--policy", "order", "--load-checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: the checkpoint's {META} in '{tmp_path}' has format version "
                                       f"{VERSION + 1}: this fsdp-planner reads version {VERSION}\n")


@pytest.mark.parametrize("missing", [DCP_METADATA, REFERENCE])
def test_load_checkpoint_refuses_an_incomplete_directory_before_any_rank_starts(capsys, tmp_path, missing):
    _checkpoint_files(tmp_path)
    (tmp_path / missing).unlink()
    assert cli.main(["verify", "seed-net", "--policy", "order", "--load-checkpoint", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --load-checkpoint '{tmp_path}' is incomplete: {missing} missing\n"


# -- a damaged checkpoint: the cause on the first line, whichever file is damaged -------------------------------------
@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory) -> Path:
    """One checkpoint of seed-net at 2 ranks, copied by each test before it damages it."""
    directory = tmp_path_factory.mktemp("saved") / "ck"
    out = run_main("verify", "seed-net", "--policy", "order", "--nproc", "2", "--steps", "1", "--time-steps", "0",
                   "--save-checkpoint", str(directory))
    assert out.returncode == 0, out.stdout + out.stderr
    return directory


def _truncate_shard(directory: Path) -> str:
    shard = sorted(directory.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    return "cannot be loaded"  # DCP's own words for a short file differ between its readers


def _delete_shard(directory: Path) -> str:
    shard = sorted(directory.glob("*.distcp"))[0]
    shard.unlink()
    return f"FileNotFoundError: [Errno 2] No such file or directory: '{shard.name}'"


def _corrupt_metadata(directory: Path) -> str:
    (directory / ".metadata").write_bytes(b"not a pickle\n")
    return "global metadata read failed"


def _truncate_reference(directory: Path) -> str:
    reference = directory / REFERENCE
    reference.write_bytes(reference.read_bytes()[:100])
    return "cannot be loaded"


@pytest.mark.integration
@pytest.mark.parametrize("damage", [_truncate_shard, _delete_shard, _corrupt_metadata, _truncate_reference],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_checkpoint_fails_with_its_cause_on_the_first_line(saved_checkpoint, tmp_path, damage):
    """DCP raises CheckpointException, a BaseException: each rank still writes it, unwrapped, and the command's
    first line names the checkpoint and what is wrong with it (not "exited with status 1 without raising")."""
    directory = tmp_path / "ck"
    shutil.copytree(saved_checkpoint, directory)
    expected = damage(directory)
    out = run_main("verify", "seed-net", "--policy", "order", "--nproc", "2", "--steps", "1", "--time-steps", "0",
                   "--load-checkpoint", str(directory))
    assert out.returncode == 2, out.stdout + out.stderr
    first = out.stderr.splitlines()[0]
    assert re.match(rf"error: verify job failed: ranks? [0-9, ]+ raised CheckpointLoadError: checkpoint "
                    rf"'{re.escape(str(directory))}' cannot be loaded \(a file missing, truncated or not written by "
                    r"verify\): ", first), out.stderr
    assert expected in first, out.stderr
    assert "Traceback" not in out.stderr


def test_save_checkpoint_under_a_file_is_refused_in_one_line(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "ck"
    assert cli.main(["verify", "seed-net", "--policy", "order", "--save-checkpoint", str(target)]) == 2
    assert capsys.readouterr().err == (f"error: --save-checkpoint '{target}': its parent directory does not exist (a "
                                       "file of that name does)\n")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no directory can be made")
def test_save_checkpoint_where_nothing_can_be_written_is_refused_before_any_rank_starts(capsys):
    assert cli.main(["verify", "seed-net", "--policy", "order", "--save-checkpoint", "/proc/ck"]) == 2
    assert capsys.readouterr().err.startswith("error: --save-checkpoint '/proc/ck': cannot write in /proc (")


# -- a checkpoint is data: pickles that would run code are refused before anything of them is built ------------------
class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


class _Creates:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


def _real_metadata(directory: Path) -> Any:
    """A DCP checkpoint of a small model and its SGD state, saved in this process (no process group: DCP writes
    one rank's files), and its metadata as DCP's own reader gives it (``saved``: the state saved)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    metadata = dcp.FileSystemReader(directory).read_metadata()
    metadata.saved = {k: v.detach().clone() for k, v in model_sd.items()}
    return metadata


def _malicious(marker: Path, directory: Path) -> dict[str, bytes]:
    """``.metadata`` files that run code on unpickling: a global, and one hidden inside DCP's own Metadata."""
    hidden = _real_metadata(directory)
    del hidden.saved
    hidden.storage_meta.modules = [_Creates(marker)]
    return {"os.system": pickle.dumps(_System(marker)), "open": pickle.dumps(_Creates(marker)),
            "inside Metadata": pickle.dumps(hidden)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_real_checkpoints_metadata_and_values_load_through_the_allow_list(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from fsdp_planner.runtime.checkpoint_pickle import SafeLoadPlanner, SafeReader, check_metadata, read_metadata

    saved = _real_metadata(tmp_path)
    read = read_metadata(tmp_path / DCP_METADATA)
    assert (read.state_dict_metadata, read.storage_data) == (saved.state_dict_metadata, saved.storage_data)
    check_metadata(tmp_path, "ck")
    state = {"model": {"weight": torch.zeros(4, 3), "bias": torch.zeros(4)},
             "optim": {"param_groups": [{"lr": 0.0}]}}
    dcp.load(state, storage_reader=SafeReader(tmp_path), planner=SafeLoadPlanner())
    assert all(torch.equal(state["model"][k], v) for k, v in saved.saved.items())
    assert state["optim"]["param_groups"][0]["lr"] == LR  # a non-tensor value, read with weights_only


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("kind", ["os.system", "open", "inside Metadata"])
def test_a_malicious_metadata_runs_nothing_and_verify_refuses_it_in_one_line(capsys, tmp_path, kind):
    import torch.distributed.checkpoint as dcp

    from fsdp_planner.runtime.checkpoint_pickle import SafeLoadPlanner, SafeReader

    marker, directory = tmp_path / "ran", tmp_path / "ck"
    payload = _malicious(marker, tmp_path / "real")[kind]
    directory.mkdir()
    _checkpoint_files(directory)
    (directory / DCP_METADATA).write_bytes(payload)
    assert cli.main(["verify", "seed-net", "--policy", "order", "--load-checkpoint", str(directory)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"error: --load-checkpoint '{re.escape(str(directory))}': \.metadata names '[\w.]+', which "
                        r"is not one of DCP's metadata classes: refusing to unpickle it \(a checkpoint is data, never "
                        r"code\)\n", err), err
    with pytest.raises(CheckpointLoadError, match="not one of DCP's metadata classes"), reading(directory):
        dcp.load({}, storage_reader=SafeReader(directory), planner=SafeLoadPlanner())  # a rank, had the file changed
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        pickle.loads(payload)  # what plain unpickling, as dcp.load does it, would have done
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_malicious_value_in_a_shard_runs_nothing(tmp_path):
    """A non-tensor value is read with weights_only, as DCP reads the tensors: DCP's own planner reads it with a
    plain unpickler."""
    import torch.distributed.checkpoint as dcp

    from fsdp_planner.runtime.checkpoint_pickle import SafeLoadPlanner, SafeReader

    marker = tmp_path / "ran"
    dcp.save({"lr": _System(marker)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(CheckpointLoadError, match="Weights only load failed"), reading(tmp_path / "ck"):
        dcp.load({"lr": 0.1}, storage_reader=SafeReader(tmp_path / "ck"), planner=SafeLoadPlanner())
    assert not marker.exists()


@pytest.mark.integration  # ~25 s (loaded): two torchrun jobs of 2 gloo ranks
def test_batchnorm_running_stats_each_rank_holds_its_own_are_named_not_a_mismatch(tmp_path):
    """Each rank's BatchNorm keeps its own running stats (FSDP2 syncs no buffer) and DCP saves one rank's copy of a
    tensor that is not a DTensor: a reload compared them with rank 0's digests and always said MISMATCH. The save
    records each rank's digest of the buffers that differ; the load checks the restored copy is one of them and says
    so (a param or optimizer state differing by rank stays a mismatch)."""
    resnet = str(Path(__file__).parent / "fixtures" / "resnet_models.py") + ":build"
    saved = tmp_path / "ck"
    for extra in (["--save-checkpoint", str(saved)], ["--load-checkpoint", str(saved)]):
        out = run_main("verify", resnet, "--policy", "module", "--nproc", "2", "--steps", "1", *extra, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    local = read_meta(saved)["rank_local"]  # each buffer's digest on each rank: the one restored is among them
    assert local and all(k.startswith("model.") and k.endswith(("running_mean", "running_var")) and len(v) == 2
                         for k, v in local.items())
    assert report["loaded"]["mismatched"] == [] and report["loaded"]["rank_local"] == sorted(local)
    assert report["ok"]
