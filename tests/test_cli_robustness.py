"""What a new user's mistakes get from the CLI: one clear line (``error: ...``, exit 2) or a one-line ``note:``,
never a traceback, an "internal error", a silent exit or a lost file.

Most tests call ``fsdp_planner.cli.main`` in-process; the ones that need a real closed stream or pipe run the CLI
in a subprocess and are marked integration (each pays a Python + torch start-up)."""

from __future__ import annotations

import errno
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_planner import cli
from fsdp_planner.cli import render
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import parse_count, parse_size

FIXTURES = Path(__file__).parent / "fixtures"
LOG = FIXTURES / "nccl" / "all_gather_perf_8xh100.log"

USER_MODELS = '''
import sys
import torch
import torch.nn as nn

INPUT = torch.randn(4, 8)  # made at import: on the CPU even when the factory runs under torch.device("meta")


class ExitsInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        sys.exit(0)


def exits_in_factory():
    sys.exit(0)


def exits_in_forward():
    return ExitsInForward(), (torch.randn(4, 8),)


def exits_in_loss():
    return nn.Linear(8, 4), (torch.randn(4, 8),), lambda out: sys.exit(5)


def cpu_inputs():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), (torch.randn(4, 8, device="cpu"),)


def module_level_inputs():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), (INPUT,)


def frozen():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model.requires_grad_(False)
    return model, (torch.randn(4, 8),)


def no_params():
    return nn.ReLU(), (torch.randn(4, 8),)


def needs_an_argument(width):
    return nn.Linear(width, 4), (torch.randn(4, width),)


class Unread(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * 2


def reads_no_param():
    return Unread(), (torch.randn(4, 8),)


def single_linear():
    return nn.Linear(8, 4), (torch.randn(4, 8),)


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.aux = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.body(x)


class KeepsAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        self.aux = y.square().mean()  # read by the loss: state a replayed call does not remake
        return y


def stateful_blocks():
    model = nn.Sequential(*(KeepsAux() for _ in range(3)))
    return model, (torch.randn(4, 8),), lambda out: out.square().mean() + sum(b.aux for b in model)


def loss_on_a_head():
    model = WithAux()
    return model, (torch.randn(4, 8),), lambda out: model.aux(out).square().mean()
'''


@pytest.fixture
def user_models(tmp_path: Path) -> Path:
    path = tmp_path / "user_models.py"
    path.write_text(USER_MODELS)
    return path


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "internal error" not in err and "usage:" not in err


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note: ")]


# -- 1. output streams ------------------------------------------------------------------------------------------
class BrokenPipe(io.StringIO):
    """A stdout whose reader has gone away."""

    def write(self, s: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_closed_stdout_is_not_a_crash(monkeypatch, capsys):
    assert render._isatty(None) is False  # render is imported with sys.stdout None under `>&-`
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["models"]) == 0
    assert sys.stdout is not None  # replaced by the null device
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("args", [("models",), ("cost", "all-gather", "1GiB", "--cluster", "h100:8", "--json")])
def test_broken_pipe_exits_quietly_with_141(monkeypatch, capsys, args):
    """rich's console (models) and print (--json) alike: no 'internal error', exit status 141 as for SIGPIPE."""
    monkeypatch.setattr(sys, "stdout", BrokenPipe())
    assert cli.main(list(args)) == cli.EXIT_BROKEN_PIPE == 141
    assert capsys.readouterr().err == ""


def test_os_error_is_one_line_not_internal_error(monkeypatch, capsys):
    def fails(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out.json")

    monkeypatch.setattr("fsdp_planner.cli.models.run", fails)
    code, _, err = run_main(capsys, "models")
    assert_one_line_error(code, err, "No space left on device: /data/out.json")


class FullDisk(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_stdout_on_a_full_disk(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", FullDisk())
    assert cli.main(["models"]) == 2
    assert capsys.readouterr().err == "error: cannot write the output: No space left on device\n"


@pytest.mark.integration
def test_real_closed_stdout_and_broken_pipe():
    exe = f'"{sys.executable}" -m fsdp_planner'
    closed = subprocess.run(["sh", "-c", f"{exe} models >&-"], capture_output=True, text=True, timeout=120)
    assert closed.returncode == 0 and closed.stderr == "", closed.stderr
    no_err = subprocess.run(["sh", "-c", f"{exe} models 2>&-"], capture_output=True, text=True, timeout=120)
    assert no_err.returncode == 0 and "seed-net" in no_err.stdout
    for args in (["models"], ["plan", "seed-net", "--json"]):
        proc = subprocess.Popen([sys.executable, "-m", "fsdp_planner", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.close()  # the reader is gone before the first line is written (`| head -0`)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 141 and err == "", err


# -- 2. argument errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (("plan", "seed-net", "--polcy", "order"),
     "error: unrecognized arguments: --polcy order; did you mean --policy? (see fsdp-planner plan --help)"),
    # an option of other commands names them; never "did you mean --help?" (a trial's `memory ... --tp 2`)
    (("memory", "seed-net", "--world-size", "8", "--tp", "2"),
     "error: unrecognized arguments: --tp 2; --tp is an option of plan, fit, simulate, verify, check, calibrate, not "
     "of fsdp-planner memory (see fsdp-planner memory --help)"),
    (("plna",), "invalid choice: 'plna'"),
    (("plan",), "the following arguments are required: model (see fsdp-planner plan --help)"),
    (("verify", "seed-net", "--nproc", "x"), "invalid int value: 'x' (see fsdp-planner verify --help)"),
    (("plan", "seed-net", "--policy", "fastest"), "invalid choice: 'fastest'"),
    ((), "required: COMMAND (see fsdp-planner --help)"),
    (("simulate", "seed-net", "--policy", "order", "--cluster", "h100:8", "--measure", "--mfu", "0.5"),
     "--mfu and --measure both set the op times"),
])
def test_argument_errors_are_one_line(capsys, args, message):
    code, out, err = run_main(capsys, *args)
    assert_one_line_error(code, err, message)
    assert out == ""


def test_help_still_exits_0(capsys):
    code, out, _ = run_main(capsys, "plan", "--help")
    assert code == 0 and "--memory-budget" in out


# -- 3. --out ---------------------------------------------------------------------------------------------------
def test_out_never_overwrites_the_model_file(capsys, user_models):
    before = user_models.read_text()
    code, _, err = run_main(capsys, "plan", f"{user_models}:single_linear", "--policy", "order",
                            "--out", str(user_models))
    assert_one_line_error(code, err, "is the model file this command reads")
    assert user_models.read_text() == before


@pytest.mark.parametrize(("name", "mine"), [("notes.txt", "mine"), ("data.json", '{"my": "data"}')])
def test_out_refuses_an_existing_file_it_did_not_write(capsys, tmp_path, name, mine):
    """Notes, and a user's own JSON (any .json used to be replaced, against --force's help)."""
    notes_file = tmp_path / name
    notes_file.write_text(mine)
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(notes_file))
    assert_one_line_error(code, err, "already exists and is neither a plan or cluster file fsdp-planner wrote nor "
                                     "code its export wrote: refusing to overwrite it")
    assert notes_file.read_text() == mine
    assert run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(notes_file), "--force")[0] == 0
    assert run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(notes_file))[0] == 0  # its own


def test_out_of_one_kind_never_replaces_the_other(capsys, tmp_path):
    """A plan's --out does not replace a cluster file fsdp-planner wrote, nor calibrate's a plan (each replaced the
    other silently: a calibrated cluster lost to a plan's name)."""
    cluster_file, plan_file = tmp_path / "c.json", tmp_path / "p.json"
    assert cli.main(["calibrate", str(LOG), "--out", str(cluster_file)]) == 0
    assert cli.main(["plan", "seed-net", "--policy", "order", "--out", str(plan_file)]) == 0
    capsys.readouterr()
    kept = cluster_file.read_text(), plan_file.read_text()
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(cluster_file))
    assert_one_line_error(code, err, "is a cluster file fsdp-planner wrote, and this command writes a plan file")
    code, _, err = run_main(capsys, "calibrate", str(LOG), "--out", str(plan_file))
    assert_one_line_error(code, err, "is a plan file fsdp-planner wrote, and this command writes a cluster file")
    assert (cluster_file.read_text(), plan_file.read_text()) == kept
    assert run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(cluster_file), "--force")[0] == 0
    # a cluster written by hand, its keys in another order: told by its keys, not its second one
    data = json.loads(kept[0])
    cluster_file.write_text(json.dumps({"version": data["version"], "gpus_per_node": data["gpus_per_node"],
                                        **{k: v for k, v in data.items() if k not in ("version", "gpus_per_node")}}))
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(cluster_file))
    assert_one_line_error(code, err, "is a cluster file fsdp-planner wrote")


def test_export_never_overwrites_a_plan_with_code(capsys, tmp_path):
    plan, other = tmp_path / "plan.json", tmp_path / "other.json"
    assert cli.main(["plan", "seed-net", "--policy", "order", "--out", str(plan)]) == 0
    assert cli.main(["plan", "seed-net", "--policy", "module", "--out", str(other)]) == 0
    before = other.read_text()
    capsys.readouterr()
    code, _, err = run_main(capsys, "export", str(plan), "--out", str(other))
    assert_one_line_error(code, err, f"--out '{other}' already exists and is not code fsdp-planner export wrote")
    assert other.read_text() == before
    code, _, err = run_main(capsys, "export", str(plan), "--out", str(plan))
    assert_one_line_error(code, err, "is the plan file this command reads: write to another file, e.g. plan_code.py")
    written = tmp_path / "plan_code.py"
    assert run_main(capsys, "export", str(plan), "--out", str(written))[0] == 0
    assert run_main(capsys, "export", str(plan), "--out", str(written))[0] == 0  # its own code: written again


def test_an_accelerate_export_beside_the_user_s_code_names_a_yaml_it_can_write(capsys, tmp_path):
    """The accelerate export's hook (the YAML's name, .py) is the user's model file: the refusal suggested
    'mynet_plan.py', which the next run refused as no .yaml (a trial). It names another --out, a .yaml, that runs."""
    plan, model = tmp_path / "plan.json", tmp_path / "mynet.py"
    assert cli.main(["plan", "seed-net", "--policy", "order", "--out", str(plan)]) == 0
    model.write_text("import torch\n")
    capsys.readouterr()
    yaml, other = tmp_path / "mynet.yaml", tmp_path / "mynet_plan.yaml"
    code, _, err = run_main(capsys, "export", str(plan), "--format", "accelerate", "--out", str(yaml))
    assert_one_line_error(code, err, f"--out '{yaml}' writes its Python hook beside it as '{model}', which already "
                                     "exists and is not code fsdp-planner export wrote: refusing to overwrite it (give "
                                     f"another --out, e.g. {other}")
    assert model.read_text() == "import torch\n"
    assert run_main(capsys, "export", str(plan), "--format", "accelerate", "--out", str(other))[0] == 0


def test_out_refuses_an_input_json(capsys, tmp_path):
    cluster_file = tmp_path / "cluster.json"
    assert cli.main(["calibrate", str(LOG), "--out", str(cluster_file)]) == 0
    before = cluster_file.read_text()
    capsys.readouterr()
    code, _, err = run_main(capsys, "simulate", "seed-net", "--policy", "order", "--cluster", str(cluster_file))
    assert code == 0, err
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "order", "--cluster", str(cluster_file),
                            "--out", str(cluster_file))
    assert_one_line_error(code, err, "is the cluster file this command reads")
    assert cluster_file.read_text() == before


def test_calibrate_out_is_not_one_of_its_logs(capsys, tmp_path):
    log = tmp_path / "ag.json"  # even a .json name: it is an input
    log.write_text(LOG.read_text())
    code, _, err = run_main(capsys, "calibrate", str(log), "--out", str(log))
    assert_one_line_error(code, err, "is a log this command reads")
    assert log.read_text() == LOG.read_text()


@pytest.mark.parametrize("command", [("plan", "seed-net", "--policy", "order"), ("calibrate", str(LOG))])
def test_empty_out(capsys, command):
    code, _, err = run_main(capsys, *command, "--out", "")
    assert_one_line_error(code, err, "--out is empty")


def test_out_overwrites_its_own_plan_and_keeps_it_when_writing_fails(capsys, tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    assert run_main(capsys, "plan", "seed-net", "--policy", "module", "--out", str(plan))[0] == 0
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", str(plan))
    assert code == 0, err
    written = plan.read_text()
    assert json.loads(written)["groups"]

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "size", "--out", str(plan))
    assert_one_line_error(code, err, f"cannot write {plan}: No space left on device")
    assert plan.read_text() == written  # the previous plan is whole
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # and no temporary file is left


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_out_on_a_full_disk(capsys):
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "order", "--out", "/dev/full")
    assert_one_line_error(code, err, "cannot write /dev/full: No space left on device")


# -- 4. input paths ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (("verify", "seed-net", "--plan", "{dir}"), "plan file '{dir}' is a directory"),
    (("simulate", "seed-net", "--plan", "/dev/null", "--cluster", "h100:8"),
     "plan file '/dev/null' is not a regular file"),
    (("simulate", "seed-net", "--policy", "order", "--cluster", "{dir}"), "cluster file '{dir}' is a directory"),
    (("cost", "all-gather", "1GiB", "--cluster", "/dev/null"), "cluster file '/dev/null' is not a regular file"),
    (("plan", "{dir}/model.py:fn"), "model file '{dir}/model.py' is a directory"),
    (("plan", "{dir}:fn"), "'{dir}' is a directory; give path/to/file.py:fn"),
    (("calibrate", "/dev/null", "--out", "{dir}/c.json"), "nccl-tests log '/dev/null' is not a regular file"),
    (("verify", "seed-net", "--plan", "{dir}/missing.json"), "plan file '{dir}/missing.json' does not exist"),
])
def test_input_paths_say_what_is_wrong(capsys, tmp_path, args, message):
    (tmp_path / "model.py").mkdir()
    code, _, err = run_main(capsys, *(a.format(dir=tmp_path) for a in args))
    assert_one_line_error(code, err, message.format(dir=tmp_path))


# -- 5. sizes and counts ----------------------------------------------------------------------------------------
def test_parse_size_refuses_less_than_a_byte_quoting_the_input():
    with pytest.raises(PlannerError, match=r"--memory-budget '0.4' is less than one byte"):
        parse_size("0.4", "--memory-budget")
    assert parse_size("0") == 0 and parse_size("0.1GiB") == round(0.1 * 2**30)


@pytest.mark.parametrize(("text", "value"), [("1e8", 10**8), ("1.5e6", 1_500_000), ("100", 100), ("1_000", 1000),
                                             ("-5", -5)])
def test_parse_count_reads_float_notation(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize(("text", "message"), [("1.5", "is not a whole number"), ("1e-3", "is not a whole number"),
                                               ("lots", "cannot read"), ("inf", "cannot read"), ("1e999", "range")])
def test_parse_count_errors(text, message):
    with pytest.raises(PlannerError, match=message):
        parse_count(text, "--min-nonwrapped-numel")


def test_memory_budget_under_a_byte(capsys):
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "auto", "--memory-budget", "0.4")
    assert_one_line_error(code, err, "--memory-budget '0.4' is less than one byte")


def test_min_nonwrapped_numel_in_float_notation(capsys):
    code, out, err = run_main(capsys, "plan", "seed-net", "--policy", "size", "--min-nonwrapped-numel", "1e3",
                              "--json")
    assert code == 0, err
    assert json.loads(out)["plans"][0]["plan"]["policy"] == "size(1000)"
    code, _, err = run_main(capsys, "plan", "seed-net", "--policy", "size", "--min-nonwrapped-numel", "1.5")
    assert_one_line_error(code, err, "--min-nonwrapped-numel '1.5' is not a whole number")


# -- 6. options that have no effect -----------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (("plan", "seed-net", "--policy", "order", "--memory-budget", "1GiB"),
     ["--memory-budget has no effect with --policy order: only --policy auto uses it"]),
    (("plan", "seed-net", "--policy", "order", "--memory-budget", "0"),  # ignored, so not "auto's ... positive"
     ["--memory-budget has no effect with --policy order: only --policy auto uses it"]),
    (("plan", "seed-net", "--memory-budget", "1GiB"),
     ["--memory-budget has no effect without --cluster (the comparison includes auto only when a cluster is "
      "given): only --policy auto uses it"]),
    (("plan", "seed-net", "--policy", "size", "--module-classes", "Linear", "--target", "fsdp1"),
     ["--module-classes has no effect with --policy size: only --policy module and --policy titan use it",
      "--target has no effect with --policy size: only --policy auto uses it"]),
    (("plan", "seed-net", "--policy", "order", "--module-classes", "Linear", "--min-nonwrapped-numel", "1000"),
     ["--module-classes has no effect with --policy order: only --policy module and --policy titan use it",
      "--min-nonwrapped-numel has no effect with --policy order: only --policy size uses it"]),
    (("plan", "seed-net", "--policy", "titan", "--module-classes", "Linear,Conv2d"),
     ["the titan policy wraps one block class: it uses Linear and ignores Conv2d from --module-classes"]),
    (("plan", "seed-net", "--policy", "order", "--mfu", "0.3", "--optimizer", "sgd", "--precision", "fp32"),
     ["--mfu, --optimizer have no effect without --cluster: only the step simulation uses them"]),
    (("plan", "seed-net", "--policy", "order", "--cluster", "h100:8", "--mfu", "0.3"), []),
    (("plan", "seed-net", "--memory-budget", "1GiB", "--cluster", "h100:8", "--module-classes", "Linear"), []),
    # given at its default value too (it was not noted then: the check compared it with the default)
    (("verify", "seed-net", "--policy", "module", "--nproc", "2", "--fake-world-size", "2"),
     ["--nproc and --steps have no effect with --fake-world-size (one process, two steps)"]),
    # (a trial's were silently unused: no profile written, no note)
    (("verify", "seed-net", "--policy", "module", "--fake-world-size", "2", "--time-steps", "7", "--profile", "pp"),
     ["--profile, --time-steps and --measure have no effect with --fake-world-size (it counts collectives, bytes "
      "and memory: fake tensors run no time worth measuring)"]),
])
def test_ignored_options_get_a_note(capsys, args, expected):
    code, _, err = run_main(capsys, *args)
    assert code == 0, err
    assert notes(err) == [f"note: {n}" for n in expected]


def test_policy_options_with_a_plan_file_are_noted(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", "seed-net", "--policy", "order", "--out", str(plan)]) == 0
    capsys.readouterr()
    code, out, err = run_main(capsys, "simulate", "seed-net", "--plan", str(plan), "--cluster", "h100:8",
                              "--memory-budget", "1GiB", "--search-effort", "5")
    assert code == 0, err
    # the budget judges the plan file's plan (its margin); only auto's search setting has no effect
    assert notes(err) == ["note: --search-effort has no effect with --plan: the plan file already fixes the groups"]
    assert "below the 1 GiB budget (--memory-budget)" in out
    # --tp beside a plan file: its own degree runs without a word; another is one error (a trial's --tp 4 beside a
    # TP 2 plan ran TP 2 with a note, where the same contradiction with a job config is an error)
    code, out, err = run_main(capsys, "simulate", "seed-net", "--plan", str(plan), "--cluster", "h100:8", "--tp", "1")
    assert code == 0 and notes(err) == [], err
    code, out, err = run_main(capsys, "simulate", "seed-net", "--plan", str(plan), "--cluster", "h100:8", "--tp", "4")
    assert code == 2 and err == ("error: --tp 4 contradicts --plan's plan file, planned with --tp 1: drop --tp, or "
                                 "plan again with --tp 4\n"), err


def test_a_tp_degree_beside_two_plan_files_is_checked_against_both(capsys, tmp_path):
    """simulate --plan A --compare B --tp N runs both files: B's degree is checked too (a review: only A's was)."""
    for name, tp in (("tp1.json", []), ("tp2.json", ["--tp", "2"])):
        assert cli.main(["plan", "toy-llama", "--policy", "titan", *tp, "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    code, _, err = run_main(capsys, "simulate", "toy-llama", "--plan", str(tmp_path / "tp1.json"), "--compare",
                            str(tmp_path / "tp2.json"), "--cluster", "h100:8", "--tp", "1")
    assert code == 2 and err == ("error: --tp 1 contradicts --compare's plan file, planned with --tp 2: drop --tp, "
                                 "or plan again with --tp 1\n"), err


def test_verify_notes_a_cluster_it_does_not_use(capsys, tmp_path, monkeypatch):
    from fsdp_planner.cli import verify

    plan = tmp_path / "plan.json"
    assert cli.main(["plan", "seed-net", "--policy", "order", "--out", str(plan)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(verify, "run_verify", lambda *a, **k: (_ for _ in ()).throw(PlannerError("stop here")))
    code, _, err = run_main(capsys, "verify", "seed-net", "--plan", str(plan), "--cluster", "h100:8")
    assert code == 2 and "stop here" in err
    assert notes(err) == ["note: no step-time prediction: --cluster h100:8 has 8 ranks and the job runs 2"]
    code, _, err = run_main(capsys, "verify", "seed-net", "--plan", str(plan), "--measure")
    assert code == 2 and "stop here" in err
    assert notes(err) == ["note: --measure has no effect without a --cluster of --nproc ranks to predict the step "
                          "time on"]


# -- 7. verify checks every argument before any work ------------------------------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (("--policy", "auto", "--nproc", "0"), "--nproc must be from 1 to 64 (processes on this machine"),
    (("--policy", "auto", "--steps", "0"), "--steps must be from 1 to 100,000, got 0"),
    (("--policy", "order", "--nproc", "-2"), "got -2"),
    (("--policy", "order", "--nproc", "99999999999"), "--nproc must be from 1 to 64"),
])
def test_verify_rejects_bad_counts_before_tracing(capsys, monkeypatch, args, message):
    from fsdp_planner.cli import verify

    def no_work(*a, **k):
        raise AssertionError("traced before the arguments were checked")

    monkeypatch.setattr(verify, "load_trace", no_work)
    code, out, err = run_main(capsys, "verify", "toy-llama", *args)
    assert_one_line_error(code, err, message)
    assert out == ""  # no "verifying ..." line


# -- 8. the user's model code -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "message"), [
    ("exits_in_factory", "the model's code called sys.exit(0) while building the model"),
    ("exits_in_forward", "the model's code called sys.exit(0) while running the forward, backward or loss_fn"),
    ("exits_in_loss", "the model's code called sys.exit(5) while running the forward, backward or loss_fn"),
    ("frozen", "has no trainable parameters (all 4 have requires_grad=False)"),
    ("no_params", "has no parameters: there is nothing for FSDP to shard"),
    # (a trial: torch's TypeError was said at fsdp-planner's own line; autograd's refusal in its own words alone)
    ("needs_an_argument", "cannot be called with no arguments, as fsdp-planner calls it (missing a required "
     "argument: 'width'): give its other parameters defaults"),
    ("reads_no_param", "; the loss depends on no trainable param"),
])
def test_user_model_mistakes_are_one_line(capsys, user_models, fn, message):
    code, out, err = run_main(capsys, "plan", f"{user_models}:{fn}", "--policy", "order")
    assert_one_line_error(code, err, message)
    assert out == ""


@pytest.mark.parametrize("fn", ["cpu_inputs", "module_level_inputs"])
def test_cpu_example_inputs_of_a_meta_model_are_moved(capsys, user_models, fn):
    code, out, err = run_main(capsys, "plan", f"{user_models}:{fn}", "--policy", "order", "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["numel"] == 8 * 8 + 8 + 8 * 4 + 4


def test_meta_device_mismatch_is_explained(capsys, tmp_path):
    path = tmp_path / "targets.py"
    path.write_text("import torch, torch.nn as nn\nT = torch.zeros(4, dtype=torch.long)\n"
                    "def fn():\n    return nn.Linear(8, 4), (torch.randn(4, 8),), "
                    "lambda out: nn.functional.cross_entropy(out, T)\n")
    code, _, err = run_main(capsys, "plan", f"{path}:fn", "--policy", "order")
    assert_one_line_error(code, err, "the model is built on the meta device for planning")


def test_a_model_reading_stdin_is_refused_not_left_waiting(capsys, tmp_path):
    """A trial's model file called ``input()`` at import: the command waited for a line no one was asked for."""
    path = tmp_path / "asks.py"
    path.write_text("import torch.nn as nn\nname = input('checkpoint? ')\n"
                    "def fn():\n    return nn.Linear(8, 4), ()\n")
    code, _, err = run_main(capsys, "plan", f"{path}:fn", "--policy", "order")
    assert_one_line_error(code, err, "failed: EOFError: EOF when reading a line (it reads stdin, which fsdp-planner "
                          "does not give a model's code)")


def test_a_slow_factory_is_said_to_be_the_model_s_own_code(capsys, tmp_path, monkeypatch):
    """A factory that sleeps, downloads or loops looked like a hung planner: after a while, a note says what
    runs (and the note stops with it: no second note from a timer left running)."""
    from fsdp_planner import models

    monkeypatch.setattr(models, "SLOW_USER_CODE_S", 0.2)
    path = tmp_path / "slow.py"
    path.write_text("import time, torch, torch.nn as nn\n"
                    "def fn():\n    time.sleep(0.6)\n    return nn.Linear(8, 4), (torch.randn(2, 8),)\n")
    code, _, err = run_main(capsys, "plan", f"{path}:fn", "--policy", "order")
    assert code == 0, err
    said = f"note: building the model '{path}:fn' has run for 0.2 s: that is the model's own code (a download, a " \
           "loop, a wait?), not the planner's; Ctrl-C stops it"
    # (importing the file, torch's import included, may take 0.2 s too on a busy machine: its own note then)
    assert said in notes(err) and all("has run for 0.2 s" in n for n in notes(err))


# -- 9. the comparison without a repeated block -----------------------------------------------------------------
def test_comparison_skips_block_policies_when_the_model_has_no_block(capsys, user_models):
    code, out, err = run_main(capsys, "plan", f"{user_models}:single_linear", "--json")
    assert code == 0, err
    assert [p["plan"]["policy"].split("(")[0] for p in json.loads(out)["plans"]] == ["size", "order"]
    assert notes(err) == ["note: the module and titan policies are left out of the comparison: the model has no "
                          "repeated block class (name the classes to wrap with --module-classes to compare them)"]
    code, _, err = run_main(capsys, "plan", f"{user_models}:single_linear", "--policy", "module")
    assert_one_line_error(code, err, "no repeated block class")  # asked for by name: still an error


def test_version_names_the_package_and_torch(capsys):
    import torch

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fsdp-planner ") and f"(torch {torch.__version__})" in out


def test_a_model_file_without_its_factory_lists_the_functions(capsys, tmp_path):
    model = tmp_path / "mine.py"
    model.write_text("import torch\n\n\ndef build():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n\n\n"
                     "def _helper():\n    pass\n")
    code, _, err = run_main(capsys, "plan", str(model))
    assert code == 2
    assert err.strip() == f"error: model '{model}' names a file but not its factory: give '{model}:FN' (its " \
                          "functions: build)"
    code, _, err = run_main(capsys, "plan", str(tmp_path / "missing.py"))
    assert code == 2 and "does not exist" in err


def test_a_misspelt_factory_lists_the_functions_closest_first(capsys):
    model = Path(__file__).parent / "fixtures" / "routing_models.py"
    code, _, err = run_main(capsys, "plan", f"{model}:dbrx_lik")
    assert code == 2
    assert err.strip() == f"error: '{model}' has no callable 'dbrx_lik' (its functions, closest first: dbrx_like, " \
                          "where_moe, placeholders, llava, mha_encoder, sorted_moe, wav2vec2_like, padded_moe, ...)"
    code, _, err = run_main(capsys, "plan", f"{model}:zzz")  # nothing near: the file's order, as without ':FN'
    assert code == 2 and err.strip().endswith("has no callable 'zzz' (its functions: where_moe, placeholders, llava, "
                                              "mha_encoder, sorted_moe, dbrx_like, wav2vec2_like, padded_moe, ...)")


def test_demo_with_an_unknown_model_fails_before_any_work(capsys, tmp_path):
    code, out, err = run_main(capsys, "demo", "--model", "nosuch", "--out-dir", str(tmp_path / "pics"))
    assert code == 2 and err.startswith("error: unknown model 'nosuch'")
    assert "1. The seed's problem" not in out and not (tmp_path / "pics").exists()


def test_a_value_that_looks_like_an_option_says_how_to_give_it(capsys):
    code, _, err = run_main(capsys, "plan", "toy-llama", "--policy", "auto", "--memory-budget", "-5GiB")
    assert_one_line_error(code, err, "given as --option=VALUE")


def test_a_model_file_imports_what_lies_beside_it_and_modules_come_from_here(capsys, tmp_path, monkeypatch):
    """As ``python file.py`` and ``python -m`` do: a model file imports its neighbours, and ``module:fn`` finds a
    module in the current directory (the console script's sys.path has neither)."""
    package = tmp_path / "models_here"
    package.mkdir()
    (package / "blocks_beside.py").write_text(
        "import torch\n\n\nclass MLP(torch.nn.Sequential):\n    def __init__(self):\n"
        "        super().__init__(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n")
    (package / "net_beside.py").write_text("import torch\nfrom blocks_beside import MLP\n\n\ndef build():\n"
                                            "    return MLP(), (torch.randn(2, 8),)\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    code, out, err = run_main(capsys, "plan", f"{package / 'net_beside.py'}:build", "--policy", "order")
    assert code == 0 and "3 modules" in out, err
    monkeypatch.chdir(package)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(package))])
    code, out, err = run_main(capsys, "plan", "net_beside:build", "--policy", "order")
    assert code == 0 and "net_beside:build" in out, err


@pytest.mark.parametrize("name", ["[/x]", "[bold]x[/bold]"])
def test_names_from_files_print_as_text_never_markup(tmp_path, capsys, name):
    """A cluster file's GPU name (and so its description) is data: printed as written, never read as rich markup
    (a closing tag that matches nothing used to end simulate and cost in 'internal error: MarkupError')."""
    from fsdp_planner.hardware.cluster import parse_cluster

    d = parse_cluster("h100:8").to_dict()
    d["gpu"]["name"] = name
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(d))
    for args in (("cost", "all-gather", "1GiB"), ("simulate", "seed-net", "--policy", "size")):
        code, out, err = run_main(capsys, *args, "--cluster", str(path))
        assert code == 0 and "internal error" not in err
        assert f"8 {name} (8 GPUs)" in out  # the brackets kept, not taken as style


@pytest.mark.parametrize("args", [["check", "toy-llama", "--plan", ""], ["plan", "toy-llama", "--cluster", " "],
                                  ["plan", "toy-llama", "--mesh", ""], ["demo", "--out-dir", ""],
                                  ["verify", "toy-llama", "--policy", "auto", "--plan-for", ""]])
def test_an_empty_option_is_refused_not_ignored(capsys, args):
    code, _, err = run_main(capsys, *args)
    assert_one_line_error(code, err, "is empty: give a value")


def test_out_through_a_symlink_is_judged_by_what_it_replaces(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mycode.py").write_text("print(1)\n")
    (tmp_path / "notes.txt").write_text("notes\n")
    (tmp_path / "out.json").symlink_to("mycode.py")
    (tmp_path / "out2.png").symlink_to("notes.txt")
    code, _, err = run_main(capsys, "plan", "toy-llama", "--policy", "titan", "--out", "out.json")
    assert_one_line_error(code, err, "is a link to")
    code, _, err = run_main(capsys, "simulate", "toy-llama", "--cluster", "h100:8", "--policy", "titan",
                            "--timeline", "out2.png")
    assert_one_line_error(code, err, "is a link to")
    assert (tmp_path / "mycode.py").read_text() == "print(1)\n" and (tmp_path / "notes.txt").read_text() == "notes\n"


def test_every_json_document_is_strict_json():
    """A diverged verify (NaN losses, an infinite max_abs_diff) once printed NaN/Infinity, which JSON parsers
    refuse: every --json goes through json_text, which writes them as null."""
    from fsdp_planner.fmt import json_text

    doc = json.loads(json_text({"losses": [float("nan"), 1.0], "max_abs_diff": float("inf"), "t": (2, -math.inf)}))
    assert doc == {"losses": [None, 1.0], "max_abs_diff": None, "t": [2, None]}
    cli_dir = Path(cli.__file__).parent
    assert not [p.name for p in cli_dir.glob("*.py") if "json.dumps(" in p.read_text()]


def test_verify_table_says_a_diverged_run_is_nan():
    from rich.console import Console

    from fsdp_planner.cli.render import verify_table
    from fsdp_planner.runtime.verify import VerifyResult

    counts = {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0}
    nan = float("nan")
    result = VerifyResult(2, 1, "gloo", counts, [counts], [counts], counts, [nan], [nan], math.inf,
                          param_error=math.inf, worst_param="w")
    console = Console(file=io.StringIO(), width=400)
    console.print(verify_table(result))
    shown = console.file.getvalue()
    assert "training diverged" in shown and "its bound" not in shown, shown


def test_a_newline_in_a_module_name_is_escaped_in_tables():
    """A ModuleDict key "nl\\nline" split a plan table's row in two; tables show it as nl\\nline."""
    from fsdp_planner.fmt import cell_text, fmt_modules

    assert cell_text("d.nl\nline\tx\x1b") == "d.nl\\nline\\tx\\x1b"
    assert fmt_modules(["", "a\nb"]) == "(root), a\\nb"


def test_quiet_silences_library_loggers_for_the_command_only():
    """transformers imports torchao, which logs 'Failed to load ...' for its CUDA kernels on a CPU host, and
    torch's pytree logs a deprecation for torchao's enums: --quiet holds both back, and gives the levels back."""
    import logging

    from fsdp_planner.cli import quiet_libraries

    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    before = (torchao.level, pytree.level)
    with quiet_libraries(True):
        assert not torchao.isEnabledFor(logging.WARNING) and not pytree.isEnabledFor(logging.WARNING)
        assert torchao.isEnabledFor(logging.ERROR)
    assert (torchao.level, pytree.level) == before


def test_policy_names_keep_their_words_whole_in_the_comparison(capsys):
    """The policy column grows to its longest word: 'module(TransformerBlock)' on one line, not folded mid-word
    into 'module(Transfor' and 'merBlock)' as the 120-column table did."""
    assert cli.main(["plan", "toy-llama", "--cluster", "h100:8"]) == 0
    out = capsys.readouterr().out
    assert "│ module(TransformerBlock) │" in out and "│ size(100000000) " in out


def test_a_long_path_in_an_error_keeps_its_file_s_name(tmp_path, capsys):
    # a path of over 200 characters was cut to its first 100: the line named a directory, not the file
    deep = tmp_path.joinpath(*(["a_long_directory_name_" * 2] * 6))
    spec = f"{deep / 'my_config_registry.py'}:llama3_70b_job"
    code, _, err = run_main(capsys, "plan", "--from-torchtitan", spec, "--cluster", "h100:8")
    assert_one_line_error(code, err, "my_config_registry.py' does not exist")
    assert str(tmp_path)[:30] in err and len(err) < 1000


def test_an_op_of_the_loss_without_a_meta_kernel_names_loss_fn_and_the_way_out(capsys):
    """CTC's loss in the factory's loss_fn was said to fail "at the model's top level", no way out given (a new
    user's Conformer): it is named as loss_fn's, with what to give for planning."""
    code, _, err = run_main(capsys, "plan", "tests/fixtures/invalid_models.py:ctc_loss", "--policy", "order")
    assert_one_line_error(code, err, "aten._ctc_loss in the factory's loss_fn")
    assert "top level" not in err and "a loss_fn every op of which runs on the meta device" in err


def test_verify_nproc_refuses_a_loss_that_reads_its_model(capsys, user_models):
    """The ranks draw each micro-batch's loss from a factory call of their own and the reference is a copy: a loss
    closing over its factory's modules would read another model than the one trained (a new user's trial: a dtype
    error on the ranks, or a parity that checked nothing). One line before torchrun starts."""
    code, _, err = run_main(capsys, "verify", f"{user_models}:loss_on_a_head", "--policy", "order", "--nproc", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the factory's loss_fn reads the model it built (through 'model')")


def test_a_block_keeping_state_for_the_loss_is_told_to_trace_in_full(capsys, user_models):
    """A block that keeps a tensor for the loss (self.aux) breaks the replay of identical calls: the error says
    --full-trace, and check takes it as plan does (check ignored it: a new user's trial)."""
    spec = f"{user_models}:stateful_blocks"
    code, _, err = run_main(capsys, "plan", spec, "--policy", "order")
    assert code == 2 and err.rstrip().endswith("a block keeping a tensor for the loss (self.aux = ...) needs "
                                               "--full-trace"), err
    assert run_main(capsys, "check", spec, "--full-trace")[0] in (0, 1)
    assert run_main(capsys, "plan", spec, "--policy", "order", "--full-trace")[0] == 0
