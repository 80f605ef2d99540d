"""The files a command writes and the ones it reads: every writer replaces its file whole or not at all (a full disk
keeps the old file), and no output option replaces a file the command reads unless ``--force`` says so.

A full disk is made real where it matters: the write into the temporary file fails part-way, after some bytes
reached it, as ``write(2)`` does with ENOSPC."""

from __future__ import annotations

import errno
import io
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import traced

from fsdp_planner import cli, userfiles
from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import SizeBasedPolicy

FIXTURES = Path(__file__).parent / "fixtures"
LOG = FIXTURES / "nccl" / "all_gather_perf_8xh100.log"


class _FullDisk(io.FileIO):
    """A file on a disk that fills up after 16 bytes: the rest of a write fails with ENOSPC."""

    def write(self, data) -> int:  # type: ignore[override]
        super().write(bytes(data)[:16])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file userfiles opens for writing is on a full disk (reading is untouched)."""
    real_open = open

    def fake_open(file, mode="r", *args, **kwargs):
        if "w" in mode:
            return _FullDisk(file, "w")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(userfiles, "open", fake_open, raising=False)  # the module's name `open`, not builtins'


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "internal error" not in err and "Traceback" not in err
    return lines[0]


def _ok(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err


def _plan_file(path: Path) -> Path:
    SizeBasedPolicy(2000).plan(traced("seed-net"), "seed-net").save(path)
    return path


def _writers(tmp: Path) -> dict[str, tuple[Path, list[str]]]:
    """Each CLI writer: the file it writes, and the command that writes it (over an existing file of that kind)."""
    plan = _plan_file(tmp / "in.json")
    return {
        "plan --out": (tmp / "plan.json", ["plan", "seed-net", "--policy", "order", "--out", str(tmp / "plan.json")]),
        "export --out": (tmp / "code.py", ["export", str(plan), "--out", str(tmp / "code.py")]),
        "calibrate --out": (tmp / "cluster.json", ["calibrate", str(LOG), "--out", str(tmp / "cluster.json")]),
        "simulate --timeline": (tmp / "step.png", ["simulate", "seed-net", "--plan", str(plan), "--cluster",
                                                   "h100:8", "--timeline", str(tmp / "step.png")]),
        "simulate --html": (tmp / "step.html", ["simulate", "seed-net", "--plan", str(plan), "--cluster", "h100:8",
                                                "--html", str(tmp / "step.html")]),
    }


@pytest.mark.parametrize("writer", ["plan --out", "export --out", "calibrate --out", "simulate --timeline",
                                    "simulate --html"])
def test_every_writer_keeps_the_old_file_on_a_full_disk(capsys, tmp_path: Path, request: pytest.FixtureRequest,
                                                         writer: str) -> None:
    target, argv = _writers(tmp_path)[writer]
    _ok(capsys, argv)  # the first write: what a full disk must not spoil
    before = target.read_bytes()
    assert len(before) > 16
    request.getfixturevalue("full_disk")
    _one_line_error(capsys, argv, f"cannot write {target}: No space left on device")
    assert target.read_bytes() == before  # whole, not the 16 bytes the disk took
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_save_methods_keep_the_old_file_on_a_full_disk(tmp_path: Path, full_disk: None) -> None:
    for path, save in ((tmp_path / "plan.json", SizeBasedPolicy(2000).plan(traced("seed-net"), "seed-net").save),
                       (tmp_path / "cluster.json", parse_cluster("h100:8").save)):
        path.write_text("old")
        with pytest.raises(PlannerError, match=f"^cannot write {path}: No space left on device$"):
            save(path)
        assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json", "plan.json"]


def test_write_atomic_keeps_the_mode_and_follows_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    userfiles.write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    assert real.stat().st_mode & 0o777 == 0o640


# ---- --out onto an input ---------------------------------------------------------------------------------------------
def _hf_config(tmp: Path) -> Path:
    directory = tmp / "hf_model"
    directory.mkdir()
    config = directory / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    return config


Inputs = Callable[[Path], tuple[Path, list[str], str]]
INPUTS: dict[str, Inputs] = {
    # (the input, a command reading it with --out left to add, what the refusal calls it)
    "hf config.json": lambda t: (c := _hf_config(t), ["plan", f"hf:{c}", "--policy", "size"],
                                 "the model's config file"),
    "hf directory": lambda t: (c := _hf_config(t), ["plan", f"hf:{c.parent}", "--policy", "size"],
                               "the model's config file"),
    "plan": lambda t: (p := _plan_file(t / "p.json"), ["export", str(p)], "the plan file"),
    "cluster": lambda t: (c := _cluster_file(t), ["plan", "seed-net", "--policy", "size", "--cluster", str(c)],
                          "the cluster file"),
    "calibrate base": lambda t: (c := _cluster_file(t), ["calibrate", str(LOG), "--base", str(c)],
                                 "the cluster file"),
    "log": lambda t: (log := _log(t), ["calibrate", str(log)], "a log"),
    "model file": lambda t: (m := _model_file(t), ["plan", f"{m}:build", "--policy", "size"], "the model file"),
}


def _model_file(tmp: Path) -> Path:
    path = tmp / "my_model.py"
    path.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    return path


def _cluster_file(tmp: Path) -> Path:
    path = tmp / "c.json"
    parse_cluster("h100:8").save(path)
    return path


def _log(tmp: Path) -> Path:
    path = tmp / "ag.json"
    path.write_text(LOG.read_text())
    return path


@pytest.mark.parametrize("kind", list(INPUTS))
def test_out_onto_an_input_is_refused(capsys, tmp_path: Path, kind: str) -> None:
    source, argv, what = INPUTS[kind](tmp_path)
    before = source.read_bytes()
    line = _one_line_error(capsys, [*argv, "--out", str(source)], f"--out '{source}' is {what} this command reads")
    assert line.endswith("(or add --force to replace it)")
    assert source.read_bytes() == before


@pytest.mark.parametrize(("option", "source"), [("--timeline", ["--plan"]), ("--html", ["--plan"]),
                                               ("--html", ["--policy", "size", "--compare"])])
def test_a_picture_onto_a_plan_it_draws_is_refused(capsys, tmp_path: Path, option: str, source: list[str]) -> None:
    plan = _plan_file(tmp_path / f"plan{'.png' if option == '--timeline' else '.html'}")  # an odd name for a plan
    before = plan.read_bytes()
    _one_line_error(capsys, ["simulate", "seed-net", *source, str(plan), "--cluster", "h100:8", option, str(plan)],
                    f"{option} '{plan}' is the plan file this command reads")
    assert plan.read_bytes() == before


@pytest.mark.parametrize(("option", "name"), [("--timeline", "step.png"), ("--timeline", "step.pdf"),
                                             ("--html", "step.html")])
def test_a_picture_or_page_the_tool_did_not_write_is_not_replaced(capsys, tmp_path: Path, option: str,
                                                                  name: str) -> None:
    """--out refused a user's file; --timeline, --html and --picture replaced one of theirs by name (a trial's own
    page.html). What the tool wrote names it (PNG Software, PDF Creator, HTML generator) and is replaced again."""
    mine = tmp_path / name
    mine.write_text("<html>my page</html>")
    argv = ["simulate", "seed-net", "--policy", "size", "--cluster", "h100:8", option, str(mine)]
    _one_line_error(capsys, argv, f"{option} '{mine}' already exists and fsdp-planner did not write it")
    assert mine.read_text() == "<html>my page</html>"
    _ok(capsys, [*argv, "--force"])
    assert b"fsdp-planner" in mine.read_bytes()
    _ok(capsys, argv)  # its own output: replaced without --force


def test_a_profile_directory_holding_other_files_is_refused(capsys, tmp_path: Path) -> None:
    from fsdp_planner.cli.paths import profile_dir

    profile_dir(tmp_path / "new")  # a new directory, an empty one, and one an earlier --profile wrote are taken
    (tmp_path / "ours").mkdir()
    profile_dir(tmp_path / "ours")
    (tmp_path / "ours" / "rank0.json").write_text('{"traceEvents": []}')
    (tmp_path / "ours" / "rank0.cpu.json").write_text('{"written_by": "fsdp-planner", "wall": [], "cpu": []}')
    profile_dir(tmp_path / "ours")
    (tmp_path / "ours" / "rank1.json").write_text('{"user": "data"}')  # no rank1.cpu.json beside it: the user's
    with pytest.raises(PlannerError, match=r"holds 'rank1\.json', which an earlier --profile did not write"):
        profile_dir(tmp_path / "ours")
    profile_dir(tmp_path / "ours", force=True)
    with pytest.raises(PlannerError, match="is not a directory"):
        profile_dir(tmp_path / "ours" / "rank0.json")


def test_a_checkpoint_is_not_saved_over_the_one_loaded(capsys, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "fsdp-planner.json").write_text("{}")
    _one_line_error(capsys, ["verify", "seed-net", "--policy", "size", "--load-checkpoint", str(checkpoint),
                             "--save-checkpoint", str(checkpoint)],
                    f"--save-checkpoint '{checkpoint}' is the checkpoint this command reads")
    assert (checkpoint / "fsdp-planner.json").read_text() == "{}"


def test_force_replaces_an_input_and_a_file_not_written_by_the_tool(capsys, tmp_path: Path) -> None:
    plan = _plan_file(tmp_path / "p.json")
    _ok(capsys, ["plan", "seed-net", "--policy", "order", "--out", str(plan), "--force"])
    assert json.loads(plan.read_text())["policy"].startswith("order")
    cluster = _cluster_file(tmp_path)
    _ok(capsys, ["plan", "seed-net", "--policy", "size", "--cluster", str(cluster), "--out", str(cluster),
                 "--force"])
    assert "groups" in json.loads(cluster.read_text())
    notes = tmp_path / "notes.py"
    notes.write_text("mine")
    _one_line_error(capsys, ["export", str(plan), "--out", str(notes)], "refusing to overwrite it")
    _ok(capsys, ["export", str(plan), "--out", str(notes), "--force"])
    assert "fully_shard" in notes.read_text()


# ---- checkpoint metadata ---------------------------------------------------------------------------------------------
def _meta(**changes) -> str:
    meta = {"version": 1, "step": 3, "world": 2, "policy": "size", "model": {"name": "seed-net"}, "fingerprint": "ab",
            "seed": 0, "lr": 0.1, "digests": {"model.w": "00ff"}}
    return json.dumps({**meta, **changes})


@pytest.mark.parametrize(("text", "message"), [
    (_meta(step=math.inf), "'step' must be a whole number from 0 to 1,000,000,000,000, got Infinity"),
    (_meta().replace('"step": 3', '"step": 1e999'), "'step' must be a whole number from 0 to 1,000,000,000,000, got "
                                                     "Infinity"),
    (_meta(step=-1), "'step' must be a whole number from 0 to 1,000,000,000,000, got -1"),
    (_meta(step="3"), "'step' must be a whole number from 0 to 1,000,000,000,000, got \"3\""),
    (_meta(step=10**40), "got 100000000000000000000000000000...(41 characters)"),
    (_meta().replace('"step": 3', '"step": ' + "9" * 5000), "is not valid JSON: it holds a number too long to read"),
    (_meta(world=0), "'world' must be a whole number from 1 to 1,048,576, got 0"),
    (_meta(version=2), "has format version 2: this fsdp-planner reads version 1"),
    (_meta(fingerprint=["ab"]), "'fingerprint' must be a string of at most 10,000 characters, got [\"ab\"]"),
    (_meta(policy="p" * 20_000), "'policy' must be a string of at most 10,000 characters, got \"ppppppppppppppppppp"),
    (_meta(digests=[1, 2]), "'digests' must map each tensor's name to its sha256 (strings)"),
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON: it nests too deeply to read"),
    ("[1, 2]", "is not a JSON object: it was not written by verify --save-checkpoint"),
    ("\xff", "is not valid JSON"),
], ids=["inf", "1e999", "negative", "string", "1e40", "5000-digits", "world-0", "version", "fingerprint-list",
        "long-policy", "digests-list", "deep", "list", "garbage"])
def test_checkpoint_metadata_is_read_with_limits(capsys, tmp_path: Path, text: str, message: str) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "fsdp-planner.json").write_text(text)
    line = _one_line_error(capsys, ["verify", "seed-net", "--policy", "size", "--load-checkpoint", str(checkpoint)],
                           message)
    assert f"the checkpoint's fsdp-planner.json in '{checkpoint}'" in line and len(line) < 300


def test_checkpoint_metadata_as_written_reads_back() -> None:
    from fsdp_planner.runtime.checkpoint import parse_meta

    assert parse_meta(_meta(), "meta")["step"] == 3
