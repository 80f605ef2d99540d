"""Real 2-process torchrun/gloo runs: every policy trains like the unsharded reference and issues exactly the
predicted collectives."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import as_users_run, policy, run_main, traced

from fsdp_planner import signals
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.models import load_model
from fsdp_planner.runtime import verify as v
from fsdp_planner.runtime.launch import FORK_ENV
from fsdp_planner.runtime.verify import run_verify
from fsdp_planner.trace import record

FIXTURES = Path(__file__).parent / "fixtures"
THRESHOLDS = {"seed-net": 2000, "toy-llama": 20_000, "toy-gpt2-tied": 2000}


# each policy on real gloo ranks, each model under two: a torchrun job costs seconds, and every policy x model's
# counts, bytes and peak are checked against real FSDP2 on fake ranks (test_fake_world.py, fidelity_memory)
POLICY_RUNS = [("seed-net", "size"), ("seed-net", "order"), ("toy-llama", "module"), ("toy-llama", "order"),
               ("toy-gpt2-tied", "titan"), ("toy-gpt2-tied", "size")]


@pytest.mark.integration
@pytest.mark.parametrize("spec,name", POLICY_RUNS)
def test_every_policy_matches_reference_and_prediction(spec, name):
    tr = traced(spec)
    plan = policy(name, min_nonwrapped_numel=THRESHOLDS[spec]).plan(tr, spec)
    result = run_verify(spec, tr, plan, nproc=2, steps=2)
    assert result.counted == [result.predicted] * 2, (result.counted, result.predicted)
    assert result.counted_bytes == [result.predicted_bytes] * 2
    assert result.max_abs_diff <= 1e-5
    assert result.losses == pytest.approx(result.reference_losses, rel=1e-5)
    assert result.ok


@pytest.mark.integration  # ~10 s: torchao's float8 (emulated on CPU) under FSDP2 on 2 gloo ranks
def test_float8_plan_trains_like_its_float8_reference_with_the_predicted_bytes():
    """The plan's Linears converted with torchao, the float8 all-gather with precomputed scales: the all-gather
    bytes are the float8 weights' (1 byte a param), and the params stay within bf16 steps of an unsharded float8
    reference, which casts the gathered weights from fp32 as FSDP2 does: the first step's loss is the same (cast
    to bf16 first, they rounded twice, and a trial's LM failed 1.46x its bound)."""
    from fsdp_planner.fsdp2.float8 import Float8

    tr = traced("toy-llama")
    plan = policy("titan").plan(tr, "toy-llama").replace(float8=Float8.named("tensorwise"))
    result = run_verify("toy-llama", tr, plan, nproc=2, steps=2, precision="bf16-mixed")
    bf16 = run_verify("toy-llama", tr, plan.replace(float8=None), nproc=2, steps=1, precision="bf16-mixed")
    assert result.ok, (result.counted, result.predicted, result.max_abs_diff)
    assert result.losses[0] == pytest.approx(result.reference_losses[0], rel=1e-6)  # (was 1e-4 apart)
    assert result.counted_bytes == [result.predicted_bytes] * 2
    assert result.predicted_bytes["all_gather"] < bf16.predicted_bytes["all_gather"]


@pytest.mark.integration
def test_module_called_twice_on_a_real_run():
    spec = f"{FIXTURES / 'factories.py'}:twice"
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs)
    plan = make_plan(tr, [["inp"], ["block"], ["out"]])
    result = run_verify(spec, tr, plan, nproc=2, steps=2)
    assert result.ok, (result.counted, result.predicted, result.max_abs_diff)
    # block: gathered twice in forward and twice in backward, but reduce-scattered once: autograd accumulates
    # its grad only after the backward of both calls (FSDP2's first post-backward finds no grad yet)
    assert result.predicted == {"all_gather": 2 + 4 + 2, "reduce_scatter": 3, "all_reduce": 0}


@pytest.mark.integration
def test_mismatch_is_reported_not_hidden():
    """A plan whose prediction is wrong (reshard flag flipped after predicting) must fail the count check."""
    tr = traced("seed-net")
    plan = policy("order").plan(tr, "seed-net")
    predicted, _ = v.predict_collectives(tr, plan, 2)
    plan = plan.replace(groups=[*(dataclasses.replace(g, reshard_after_forward=False) for g in plan.inner_groups),
                                plan.root])
    result = v.run_verify("seed-net", tr, plan, nproc=2, steps=1)
    assert result.counted[0] != predicted
    result.predicted = predicted
    assert not result.counts_match and not result.ok


@pytest.mark.integration
@pytest.mark.parametrize("spec", ["toy-llama", "toy-gpt2-tied"])  # two models: a torchrun job costs seconds
def test_auto_plans_train_on_real_runs(spec):
    """The issue's command, as a user types it."""

    out = run_main("verify", spec, "--policy", "auto", "--nproc", "2", "--steps", "2", "--time-steps", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


@pytest.mark.integration
def test_auto_under_a_tight_budget_with_prefetch_trains_on_a_real_run():
    """Many list groups that cut across blocks, plus explicit prefetch lists: still exact."""
    from fsdp_planner.fsdp2.checkpointing import ACMode
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners import AutoPolicy

    tr = traced("toy-llama")
    cluster = parse_cluster("h100:2")
    free = AutoPolicy(cluster).search(tr)
    # without checkpointing: with it, 2 groups with blocks checkpointed are faster on this host-bound model
    plan = AutoPolicy(cluster, int(free.min_peak * 1.02), checkpointing=ACMode.NONE).plan(tr, "toy-llama")
    inner = [i for i, g in enumerate(plan.groups) if not g.is_root]
    assert len(inner) >= 4 and any(len(g.modules) > 1 for g in plan.groups)
    for pos, i in enumerate(inner):
        plan = plan.with_group(i, forward_prefetch=inner[pos + 1:pos + 3],
                               backward_prefetch=inner[max(0, pos - 2):pos][::-1])
    result = run_verify("toy-llama", tr, plan, nproc=2, steps=2)
    assert result.max_abs_diff <= 1e-5 and result.counts_match, (result.counted, result.predicted)
    assert result.ok


@pytest.mark.integration
def test_int_reshard_after_forward_on_four_ranks():
    """What auto chooses on multi-node clusters (reshard to a node-sized sub-group) is exact on a real run: the
    backward all-gathers run on 2-rank sub-groups of a 4-rank world."""
    tr = traced("toy-llama")
    plan = policy("order").plan(tr, "toy-llama")
    inner = range(1, len(plan.groups) - 2)
    plan = plan.replace(groups=[dataclasses.replace(g, reshard_after_forward=2) if i in inner else g
                                for i, g in enumerate(plan.groups)])
    result = run_verify("toy-llama", tr, plan, nproc=4, steps=2)
    assert result.counted == [result.predicted] * 2 and result.counted_bytes == [result.predicted_bytes] * 2
    assert result.max_abs_diff <= 1e-5 and result.ok


def test_byte_mismatch_fails_the_verdict():
    """A run whose counts match but whose bytes do not must not PASS (it once did)."""
    counts = {"all_gather": 3, "reduce_scatter": 2}
    result = v.VerifyResult(world_size=2, steps=1, backend="gloo", predicted=counts, counted=[counts],
                            counted_bytes=[{"all_gather": 100, "reduce_scatter": 64}],
                            predicted_bytes={"all_gather": 100, "reduce_scatter": 80}, losses=[1.0],
                            reference_losses=[1.0], max_abs_diff=0.0)
    assert result.counts_match and result.params_match
    assert not result.bytes_match and not result.ok
    assert result.to_dict()["ok"] is False


@pytest.mark.integration
# auto's plans for root_param and shared_submodule are the root alone, run by other tests
@pytest.mark.parametrize("spec,name", [(spec, "order") for spec in
                                       ["root_param", "shared_submodule", "dataclass_outputs"]]
                         + [("unused_outputs", "auto")])
def test_unusual_models_train_on_real_runs_with_predicted_collectives(spec, name):
    """A param on the root, a shared submodule, blocks returning dataclasses, outputs autograd never reaches: the
    real FSDP2 run's collective counts and bytes equal the prediction, and params match a single-process run."""
    out = run_main("verify", f"{FIXTURES / 'factories.py'}:{spec}", "--policy", name, "--nproc", "2", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


@pytest.mark.integration
def test_a_failing_rank_reports_its_exception_not_torchruns_summary():
    spec = f"{FIXTURES / 'factories.py'}:fails_in_job"
    out = run_main("verify", spec, "--policy", "order", "--nproc", "2", "--steps", "1")
    assert out.returncode != 0
    assert "raised ValueError: no real runs for this model (at factories.py:" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr + out.stdout and "error_file" not in out.stderr + out.stdout


# -- the job's processes and files never outlive the command -------------------------------------------------------
SLOW_MODEL = '''
import os
import re
import time
from pathlib import Path

import torch
import torch.nn as nn


def slow():
    """Instant on the meta device (planning); in a verify rank, says it started and then sleeps."""
    if torch.empty(0).device.type != "meta":
        (Path(__file__).parent / f"started.{os.getpid()}").touch()
        time.sleep(600)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), (torch.randn(4, 8),)
'''


def _processes_mentioning(marker: str) -> list[str]:
    """Command lines of live processes whose command line or environment holds ``marker`` (no psutil needed)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state != "Z" and (marker in cmdline or marker in environ):
            found.append(f"{pid}: {cmdline}")
    return found


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except OSError:
        return None


def _start_slow_verify(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, str]:
    import uuid

    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    marker = f"fsdp-planner-test-{uuid.uuid4().hex}"
    env = {**as_users_run(), "TMPDIR": str(tmpdir), "FSDP_PLANNER_TEST_MARKER": marker}
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_planner", "verify", f"{tmp_path / 'slow.py'}:slow",
                             "--policy", "order", "--nproc", "2", "--steps", "1", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_terminal)
    return proc, tmpdir, marker


def _as_from_a_terminal() -> None:
    """The command's signals as a terminal leaves them: a disposition of SIG_IGN and a blocked mask are inherited
    across exec, and a test worker's may be either (the full suite's SIGINT case hung twice under pytest-xdist:
    Python installs its KeyboardInterrupt handler only where SIGINT is not ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def _wait_for_ranks(proc: subprocess.Popen, tmp_path: Path, n: int = 2, limit: float = 240) -> None:
    deadline = time.monotonic() + limit
    while len(list(tmp_path.glob("started.*"))) < n:
        if proc.poll() is not None:
            raise AssertionError(f"verify ended before its ranks started: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the verify ranks did not start")
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])  # SIGHUP takes SIGTERM's handler
def test_a_signal_stops_the_whole_job_and_removes_its_temp_dir(tmp_path, sig):
    """SIGTERM (a job scheduler, `kill`), Ctrl-C or SIGHUP (the terminal closed) while the ranks run: the torchrun
    launcher and every rank end with the command, and the job directory and the half-written checkpoint are
    removed."""
    proc, tmpdir, marker = _start_slow_verify(tmp_path, "--save-checkpoint", str(tmp_path / "ck"))
    try:
        _wait_for_ranks(proc, tmp_path)
        assert list(tmpdir.glob("fsdp-planner-verify-*")), "the job directory should exist while it runs"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert ("interrupted" if sig == signal.SIGINT else f"terminated ({signal.Signals(sig).name})") in err
    assert "Traceback" not in err
    assert _processes_mentioning(marker) == []
    assert _processes_mentioning(str(tmpdir)) == []
    assert not list(tmpdir.glob("fsdp-planner-verify-*")) and not list(tmpdir.glob("torchelastic_*"))
    assert not list(tmp_path.glob("*ck*")), "no checkpoint, whole or partial"


@pytest.mark.integration
def test_a_killed_command_takes_its_job_with_it(tmp_path, monkeypatch):
    """SIGKILL (the OOM killer, a cancelled CI job) runs no handler: the launcher follows its parent (the kernel's
    PR_SET_PDEATHSIG) and ends the ranks; the next job removes the directory nobody else will."""
    proc, tmpdir, marker = _start_slow_verify(tmp_path)
    try:
        _wait_for_ranks(proc, tmp_path)
        proc.kill()
        proc.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while _processes_mentioning(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_mentioning(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
    left = list(tmpdir.glob("fsdp-planner-verify-*"))
    assert len(left) == 1 and (left[0] / v.OWNER_FILE).read_text() == str(proc.pid)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    v.remove_orphaned_job_dirs("fsdp-planner-verify-")
    assert not left[0].exists()


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_launcher_takes_its_ranks_with_it_and_fails_the_command(tmp_path, sig):
    """The torchrun agent (launch.py) killed from outside while its ranks run. SIGKILL: each rank follows its
    launcher (PR_SET_PDEATHSIG) and dies at once instead of running on unsupervised; SIGTERM: torchrun stops them.
    Either way the command fails with one line, not a traceback."""
    proc, _, marker = _start_slow_verify(tmp_path)
    try:
        _wait_for_ranks(proc, tmp_path)
        # the command's child (its ranks, forked from it, have its command line too)
        launchers = [p for p in _processes_mentioning(marker) if "fsdp_planner.runtime.launch" in p
                     and _parent(int(p.partition(":")[0])) == proc.pid]
        assert len(launchers) == 1, launchers
        os.kill(int(launchers[0].partition(":")[0]), sig)
        killed = time.monotonic()
        while _processes_mentioning(marker) and time.monotonic() - killed < 30:
            time.sleep(0.1)
        ranks_gone = time.monotonic() - killed
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _processes_mentioning(marker) == []
    # (seconds, not the slow step's minutes: torchrun's SIGTERM shutdown took 5.8 s on a loaded 2-core host)
    assert ranks_gone < 20, f"ranks outlived their launcher by {ranks_gone:.1f} s"
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert lines == [f"error: verify job failed: its torchrun launcher was killed by {signal.Signals(sig).name} (from "
                     "outside the job), and its ranks were stopped with it"], err


def _faulty_command(tmp_path: Path, fault: str, *args: str, timeout_s: float | None = None
                    ) -> tuple[subprocess.CompletedProcess, float, float | None]:
    """Run the CLI with a test-only fault injected into the ranks (``timeout_s``: their collectives' timeout);
    returns its outcome, its wall time and the seconds from the first verify rank's death to the command's end (None
    when no rank died before it)."""
    import uuid

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    marker = f"fsdp-planner-test-{uuid.uuid4().hex}"
    env = {**as_users_run(), "TMPDIR": str(tmpdir), "FSDP_PLANNER_TEST_MARKER": marker,
           "FSDP_PLANNER_TEST_FAULT": fault, **({"FSDP_PLANNER_TEST_TIMEOUT_S": str(timeout_s)} if timeout_s else {})}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_planner", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ranks_seen, first_death = 0, None
    try:
        while proc.poll() is None and time.monotonic() - start < 300:
            ranks = len([p for p in _processes_mentioning(marker) if "fsdp_planner.runtime.worker" in p])
            ranks_seen = max(ranks_seen, ranks)
            if first_death is None and 0 < ranks < ranks_seen:
                first_death = time.monotonic()
            time.sleep(0.1)
        out, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    end = time.monotonic()
    assert _processes_mentioning(marker) == [], "no rank and no launcher outlives the command"
    # torch's compile cache (torchinductor_USER) is made by any command, planning too, and kept on purpose
    left = [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], "the job's temp dirs (its own, torchrun's) are removed"
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, end - start, None if first_death is None else end - first_death


@pytest.mark.integration
def test_a_killed_rank_ends_the_job_naming_it(tmp_path):
    """Rank 1 SIGKILLs itself in step 1 while rank 0 waits in an all-gather: torchrun notices within its 0.1 s
    monitor interval and stops rank 0; the error names rank 1 and its signal first, rank 0's echo after."""
    done, wall, after_death = _faulty_command(tmp_path, "kill:1", "verify", "seed-net", "--policy", "order",
                                              "--nproc", "2", "--steps", "2")
    print(f"killed rank: command took {wall:.1f} s, {after_death} s after the first rank died")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[0].startswith("error: verify job failed: rank 1 was killed by SIGKILL"), done.stderr
    assert "Traceback" not in done.stderr
    assert after_death is not None and after_death < 30  # not gloo's 30 minutes, nor the 300 s collective timeout


@pytest.mark.integration
def test_a_rank_with_another_plan_ends_the_job_naming_it(tmp_path):
    """A rank that would apply another plan would issue other collectives (a hang, or garbage): the ranks compare
    plans before sharding and stop with the rank's number."""
    done, wall, _ = _faulty_command(tmp_path, "plan:1", "verify", "seed-net", "--policy", "order", "--nproc", "2",
                                    "--steps", "1")
    print(f"plan mismatch: command took {wall:.1f} s")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: verify job failed: ranks 0, 1 raised RuntimeError: rank 1 has a different "
                                  "plan than rank 0"), done.stderr
    assert wall < 120


@pytest.mark.integration
def test_a_rank_that_never_joins_is_named_with_where_it_was(tmp_path):
    """Rank 1 never joins the process group (``hang:1``): rank 0 times out waiting for it, and torchrun's SIGTERM
    has rank 1 write where it was, which the error says (the suite once failed so with no clue: rank 3 of 4 never
    joined, and the three others' timeouts were all it said)."""
    done, wall, _ = _faulty_command(tmp_path, "hang:1", "verify", "seed-net", "--policy", "order", "--nproc", "2",
                                    "--steps", "1", timeout_s=5)
    print(f"hang: command took {wall:.1f} s")
    lines = [line for line in done.stderr.splitlines() if not line.startswith("note: ")]
    assert done.returncode == 2, done.stderr
    # (the first line: the one a command shows)
    assert re.match(r"error: verify job failed: rank 1 was still at rank\.py:\d+ in _hang; rank\.py:\d+ in run_rank; "
                    r".* when rank 0 failed in a collective: DistStoreError: wait timeout", lines[0]), done.stderr
    assert "Traceback" not in done.stderr and wall < 120


# every torchrun job's worker, each through runtime/rank.py: (command, what its failure is called)
WORKER_JOBS = {
    "fsdp2": (["verify", "seed-net", "--policy", "order", "--nproc", "2", "--steps", "1"], "verify job"),
    "fsdp1": (["verify", "seed-net", "--policy", "order", "--nproc", "2", "--steps", "1", "--fsdp1"], "verify job"),
    "gloo-calibration": (["calibrate", "--backend", "gloo", "--nproc", "2"], "calibration job"),
}


@pytest.mark.integration
@pytest.mark.parametrize("worker", list(WORKER_JOBS))
def test_a_rank_that_raises_is_the_first_line_of_every_jobs_command(tmp_path, worker):
    """Rank 1 raises as its work starts (``raise:1``): whichever worker runs, the command fails with that rank's
    exception on its first line, read from the one error file every rank writes, not torchrun's summary."""
    args, what = WORKER_JOBS[worker]
    out = tmp_path / "cluster.json"
    extra = ["--out", str(out)] if args[0] == "calibrate" else []
    done, wall, _ = _faulty_command(tmp_path, "raise:1", *args, *extra)
    print(f"{worker}: command took {wall:.1f} s")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("note: ")]  # e.g. more ranks than cores
    assert lines[0].startswith(f"error: {what} failed: rank 1 raised RuntimeError: test fault: rank 1 raised on "
                               "purpose"), done.stderr
    assert "Traceback" not in done.stderr and not out.exists()


VANISHING_MODEL = '''
import os
import re

import torch
import torch.nn as nn


class Vanishing(nn.Sequential):
    def forward(self, x):
        if x.device.type != "meta":  # traced on meta for planning; a verify rank's first step ends the process
            os._exit(0)
        return super().forward(x)


def vanishes():
    """In a verify rank, ends the process with status 0 in its first forward (in the factory, the loader names
    os._exit itself: ``test_cli.py``)."""
    return Vanishing(nn.Linear(8, 8), nn.Linear(8, 4)), (torch.randn(4, 8),)
'''


@pytest.mark.integration
@pytest.mark.parametrize("forked", [False, True])
def test_ranks_that_end_well_without_a_result_fail_the_job_in_one_line(tmp_path, forked):
    """The model's code ends the process with status 0 (``os._exit(0)``): nothing raised, no signal, and no result;
    a failure, said in one line, not torchrun's log, and no wait (a rank forked by torchrun that ends with status 0
    without returning leaves torchrun waiting for its return value for good)."""
    (tmp_path / "vanishes.py").write_text(VANISHING_MODEL)
    out = subprocess.run([sys.executable, "-m", "fsdp_planner", "verify", f"{tmp_path / 'vanishes.py'}:vanishes",
                          "--policy", "order", "--nproc", "2", "--steps", "1"], capture_output=True, text=True,
                         timeout=120, env={**as_users_run(), **({FORK_ENV: "1"} if forked else {})})
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if not line.startswith("note: ")]
    # (both ranks, or one when torchrun stopped the other first)
    assert len(lines) == 1 and re.match(r"error: verify job failed: ranks? (0, 1|0|1) raised os\._exit\(0\): the "
                                        r"model's code ended the process before the rank's work was done", lines[0]), \
        out.stderr


def test_a_result_cut_short_is_no_result(tmp_path):
    path = tmp_path / "result.json"
    assert v.read_result(path) is None
    path.write_text('{"counted": [')  # rank 0 killed while writing it
    assert v.read_result(path) is None
    path.write_text('{"counted": []}')
    assert v.read_result(path) == {"counted": []}


GROWS_MODEL = '''
import torch
import torch.nn as nn


def grows():
    """Planned 8 wide; built in a verify job's ranks, 12 wide: the same groups, other bytes."""
    width = 12 if torch.distributed.is_initialized() else 8
    return nn.Sequential(nn.Linear(8, width), nn.Linear(width, 4)), (torch.randn(4, 8),)
'''


@pytest.mark.integration
def test_a_byte_mismatch_fails_a_real_run(tmp_path):
    """The collectives' counts match the prediction but their bytes do not (the model that trains is wider than
    the one planned; a plan without a fingerprint cannot tell): the verdict fails on bytes alone."""
    (tmp_path / "grows.py").write_text(GROWS_MODEL)
    spec = f"{tmp_path / 'grows.py'}:grows"
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs)
    plan = policy("order").plan(tr, spec).replace(fingerprint="")
    result = run_verify(spec, tr, plan, nproc=2, steps=1)
    assert result.counts_match and result.params_match
    assert not result.bytes_match and not result.ok
    assert result.counted_bytes[0]["all_gather"] > result.predicted_bytes["all_gather"]


@pytest.mark.integration
def test_a_timeout_stops_the_whole_job_and_removes_its_temp_dir(tmp_path, monkeypatch):
    """As users run it: the launcher and ranks started fresh, each with this test's TMPDIR in its environment
    (a forked one keeps its parent's start-up environment in /proc, where the check below looks)."""
    monkeypatch.delenv(FORK_ENV)
    (tmp_path / "slow.py").write_text(SLOW_MODEL)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    spec = f"{tmp_path / 'slow.py'}:slow"
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs)
    plan = policy("order").plan(tr, spec)
    with pytest.raises(PlannerError, match="did not finish within 15 s"):
        run_verify(spec, tr, plan, nproc=2, steps=1, timeout=15)
    assert len(list(tmp_path.glob("started.*"))) == 2  # the ranks were running when it timed out
    assert _processes_mentioning(str(tmpdir)) == []
    assert not list(tmpdir.glob("fsdp-planner-verify-*")) and not list(tmpdir.glob("torchelastic_*"))


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
def test_stop_process_group_ends_children_that_ignore_sigterm(tmp_path):
    """Everything in the job's session goes: SIGTERM first, SIGKILL for what ignores it."""
    marker = f"stop-group-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(["sh", "-c", f"trap '' TERM; sleep 300 & sleep 301 & echo {marker}; wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "FSDP_PLANNER_TEST_MARKER": marker})
    assert proc.stdout is not None and proc.stdout.readline().strip() == marker
    start = time.monotonic()
    v.stop_process_group(proc, grace=0.5)
    assert time.monotonic() - start < 5
    assert proc.returncode is not None
    assert _processes_mentioning(marker) == []


def test_sigterm_raises_terminated_only_inside_signals_raise():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(signals.Terminated) as info, signals.signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode
    assert info.value.signum == signal.SIGTERM and info.value.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_rank_calling_sys_exit_is_reported():
    from fsdp_planner.runtime.failures import RankFailure, describe_exception

    try:
        raise SystemExit(0)
    except SystemExit as e:
        info = describe_exception(e)
    failure = RankFailure(1, info["error"], tuple(info["frames"]), info["backend"], 1)
    assert failure.describe().startswith("rank 1 raised SystemExit: the model's code called sys.exit(0) (at "
                                         "test_verify.py:")


class ModelGaveUp(BaseException):
    """A model's own BaseException (not an Exception), as DCP's CheckpointException is one."""


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
@pytest.mark.parametrize(("raised", "written"), [
    (ModelGaveUp("the model gave up"), "ModelGaveUp: the model gave up"),
    (SystemExit("bad config"), "SystemExit: the model's code called sys.exit('bad config')"),
    (KeyboardInterrupt(), None),  # SIGINT from outside the job: its signal is the rank's exit status
])
def test_a_rank_leaves_whatever_its_work_raised(tmp_path, monkeypatch, raised, written):
    """run_rank on a real gloo group of one rank: a BaseException that is no Exception still reaches the error file
    the launcher reads, and still ends the rank."""
    import json
    import socket

    from fsdp_planner.runtime.failures import error_file
    from fsdp_planner.runtime.launch import LAUNCHER_ENV
    from fsdp_planner.runtime.rank import run_rank

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    result = tmp_path / "result.json"
    (tmp_path / "job.json").write_text(json.dumps({"result": str(result)}))

    def body(job, device, rank, world):
        raise raised

    with pytest.raises(type(raised)) as info:
        run_rank(str(tmp_path / "job.json"), body)
    if isinstance(raised, SystemExit):
        assert info.value.code == 1  # whatever the model passed: 0 would read as a finished job
    error = error_file(result, 0)
    assert (json.loads(error.read_text())["error"] if error.exists() else None) == written


def test_dcps_checkpoint_exception_is_told_by_what_it_wraps():
    from torch.distributed.checkpoint.api import CheckpointException

    from fsdp_planner.runtime.failures import describe_exception

    wrapped = CheckpointException("load failed", {1: (EOFError(), None), 0: (FileNotFoundError("__0_0.distcp"), None)})
    assert describe_exception(wrapped)["error"] == "CheckpointException: FileNotFoundError: __0_0.distcp"


@pytest.mark.integration
def test_one_rank_is_judged_with_no_collectives():
    """FSDP2 issues no all-gather or reduce-scatter on one rank; verify --nproc 1 must pass a correct plan."""
    tr = traced("seed-net")
    plan = policy("order").plan(tr, "seed-net")
    assert v.predict_collectives(tr, plan, 1) == ({"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0},) * 2
    result = v.run_verify("seed-net", tr, plan, nproc=1, steps=1)
    assert result.counted == [{"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}] and result.ok


def test_the_cause_is_told_apart_from_its_echoes():
    """A rank killed by a signal is the cause; its peer's failed collective and torchrun's SIGTERMs are echoes."""
    from fsdp_planner.runtime.failures import RankFailure, explain

    killed = RankFailure(2, exitcode=-signal.SIGKILL)
    echo = RankFailure(0, "RuntimeError: Connection reset by peer", ("pair.cc",), backend=True, exitcode=1)
    stopped = [RankFailure(r, exitcode=-signal.SIGTERM) for r in (1, 3)]
    lines = explain([echo, stopped[0], killed, stopped[1]]).splitlines()
    assert lines == ["verify job failed: rank 2 was killed by SIGKILL (it raised no exception: killed from outside, "
                     "or by the out-of-memory killer)",
                     "  then rank 0 failed in a collective: RuntimeError: Connection reset by peer (at pair.cc)",
                     "  then torchrun stopped ranks 1, 3 (SIGTERM)"]
    raised = RankFailure(1, "ValueError: bad", ("m.py:3 in f",), exitcode=1)
    first = explain([echo, raised]).splitlines()[0]
    assert first == "verify job failed: rank 1 raised ValueError: bad (at m.py:3 in f)"
    assert explain([]) is None


def test_a_stopped_ranks_stacks_name_where_it_was_only_where_no_rank_failed_of_its_own(tmp_path):
    """faulthandler's stacks of a rank torchrun stopped: its main thread's innermost frames (the one running
    run_rank, not gloo's or a loader's thread), said first where the peers only timed out; a rank that raised of
    its own is the cause, and the stopped ranks' stacks are then no clue."""
    import faulthandler
    import threading

    from fsdp_planner.runtime.failures import RankFailure, explain, read_failures, stack_file

    result = tmp_path / "result.json"
    release = threading.Event()
    helper = threading.Thread(target=release.wait, daemon=True)
    helper.start()

    def run_rank() -> None:  # (named as rank.py's: the thread to read)
        with stack_file(result, 3).open("w") as f:
            faulthandler.dump_traceback(f, all_threads=True)

    run_rank()
    release.set()
    stack_file(result, 1).write_text("")  # opened at start, never signalled: not stopped
    timed_out = RankFailure(0, "DistStoreError: wait timeout", ("distributed_c10d.py:1 in init_process_group",),
                            backend=True, exitcode=1)
    failures = [timed_out, *read_failures(result, tmp_path / "exits")]
    assert [f.rank for f in failures] == [0, 3] and failures[1].stopped_by_launcher
    innermost = failures[1].stopped_at[0]
    assert innermost.startswith("test_verify.py:") and innermost.endswith(" in run_rank"), failures[1]
    first = explain(failures).splitlines()[0]
    assert first.startswith("verify job failed: rank 3 was still at test_verify.py:") and \
        first.endswith(" when rank 0 failed in a collective: DistStoreError: wait timeout (at distributed_c10d.py:1 "
                       "in init_process_group)"), first
    raised = RankFailure(2, "ValueError: bad", ("m.py:3 in f",), exitcode=1)
    first = explain([raised, *failures]).splitlines()[0]
    assert first == "verify job failed: rank 2 raised ValueError: bad (at m.py:3 in f)"



def test_a_stopped_rank_outside_a_collective_is_named_before_its_waiting_peers(tmp_path):
    """Two ranks stopped by torchrun after a peer's collective timed out: rank 1 was waiting in a collective
    (torch.distributed's frame innermost), rank 2 in the model's own code. Rank 2 is the one the others waited
    for, and leads the first line though its number is higher."""
    from fsdp_planner.runtime.failures import RankFailure, explain, read_failures, stack_file

    result = tmp_path / "result.json"
    stack = ('Current thread 0x00007f0000000001 (most recent call first):\n'
             '  File "{inner}", line 12 in {fn}\n'
             '  File "/site/fsdp_planner/runtime/rank.py", line 40 in run_rank\n')
    stack_file(result, 1).write_text(stack.format(inner="/site/torch/distributed/distributed_c10d.py",
                                                  fn="all_reduce"))
    stack_file(result, 2).write_text(stack.format(inner="/home/me/model.py", fn="slow_loader"))
    timed_out = RankFailure(0, "DistBackendError: timeout", ("distributed_c10d.py:1 in all_reduce",),
                            backend=True, exitcode=1)
    failures = [timed_out, *read_failures(result, tmp_path / "exits")]
    assert [(f.rank, f.waiting) for f in failures] == [(0, False), (1, True), (2, False)]
    lines = explain(failures).splitlines()
    assert lines[0].startswith("verify job failed: rank 2 was still at model.py:12 in slow_loader; rank.py:40 in "
                               "run_rank when rank 0 failed in a collective"), lines
    assert "  rank 1 was still at distributed_c10d.py:12 in all_reduce; rank.py:40 in run_rank" in lines

def test_a_job_that_left_no_cause_says_so_with_its_last_output():
    """No rank raised or died and no result (a native ``exit(0)``, torchrun failing before it started the ranks):
    one line with torchrun's status and the job's last words as a clue."""
    from fsdp_planner.runtime.failures import unexplained

    line = unexplained(0, "loading\nsomething odd happened\n\n", "calibration job")
    assert line == ("calibration job failed: no result, and no rank raised or died (torchrun exited with status 0); "
                    "its last output: something odd happened")
    assert unexplained(1, "").endswith("(torchrun exited with status 1)")


def test_a_gloo_error_is_marked_as_the_backends_and_shortened():
    from fsdp_planner.runtime.failures import describe_exception

    try:
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                           "[127.0.0.1]:5558: Connection reset by peer. This is typically caused by a remote worker")
    except RuntimeError as e:
        info = describe_exception(e)
    assert info["backend"] and info["error"] == "RuntimeError: Read error [127.0.0.1]:5558: Connection reset by peer"


def test_titan_and_order_make_the_same_plan_for_toy_llama():
    """Why POLICY_RUNS runs titan on toy-llama no more: its plan is order's, run there already."""
    tr = traced("toy-llama")
    titan, order = (policy(name, min_nonwrapped_numel=THRESHOLDS["toy-llama"]).plan(tr, "toy-llama")
                    for name in ("titan", "order"))
    assert [(g.modules, g.reshard_after_forward) for g in titan.groups] == \
        [(g.modules, g.reshard_after_forward) for g in order.groups]


def test_parity_bounds_follow_the_dtypes_the_model_trains():
    """fp32 models agree within 1e-5; once a model trains 16-bit params, their rounding reaches every param (a
    run measured an fp32 bias 1.5e-5 off beside a bf16 adapter), bounded by a few steps of that precision."""
    import torch

    from fsdp_planner.runtime.worker import parity

    w = torch.full((4,), 0.2, requires_grad=True)
    half = torch.full((4,), 0.2, dtype=torch.bfloat16, requires_grad=True)
    assert parity([("w", w + 5e-6, w)])["param_error"] <= 1 < parity([("w", w + 2e-5, w)])["param_error"]
    mixed = parity([("w", w + 2e-5, w), ("half", half + 2 ** -10, half)])  # one bf16 step at 0.2, 2e-5 beside
    assert mixed["param_error"] <= 1 and mixed["max_abs_diff"] == 2 ** -10
    off = parity([("w", w + 2e-5, w), ("half", half + 0.05, half)])
    assert off["param_error"] > 1 and off["worst_param"] == "half"
    assert parity([("w", w * float("nan"), w)])["param_error"] == float("inf")


FOLLOWER = '''
import os, signal, sys, time
from fsdp_planner import signals
getattr(signals, sys.argv[1])(os.getppid(), signal.SIGKILL)
print(os.getpid(), flush=True)
time.sleep(60)
'''


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and waiting to be reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("how", ["follow_parent", "watch_parent"])  # prctl, and the fallback where it is missing
def test_a_process_following_its_parent_dies_with_it(how):
    """A middle process starts a follower of itself and is SIGKILLed: the follower (a rank, under its launcher)
    is gone within a second or so, by the kernel's PR_SET_PDEATHSIG or by the watcher thread."""
    middle = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               f"subprocess.run([sys.executable, '-c', {FOLLOWER!r}, {how!r}])"],
                              stdout=subprocess.PIPE, text=True)
    follower = None
    try:
        assert middle.stdout is not None
        follower = int(middle.stdout.readline())
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 5
        while _running(follower) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(follower), f"the follower outlived its parent ({how})"
    finally:
        if middle.poll() is None:
            middle.kill()
        if follower is not None and _running(follower):
            os.kill(follower, signal.SIGKILL)


@pytest.mark.integration
def test_the_documented_hand_written_plan_verifies():
    """docs/examples/hand_plan.json (module lists only) trains like the reference on a real 2-rank job, each of
    its six groups gathered and reduce-scattered as predicted."""
    docs = Path(__file__).parent.parent / "docs" / "examples"
    out = run_main("verify", f"{docs / 'my_model.py'}:build", "--plan", str(docs / "hand_plan.json"), "--nproc", "2",
                   "--steps", "2", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] and result["predicted"]["reduce_scatter"] == 6  # one per group: the root claims nothing


@pytest.mark.integration
def test_auto_s_plan_at_scale_verifies_on_the_toy():
    """The issue's command: auto plans Llama 3 8B for 64 H100s (one group per block) and the toy, the same code
    with 4 blocks, trains that grouping on 2 ranks exactly as predicted."""
    out = run_main("verify", "toy-llama", "--policy", "auto", "--plan-for", "h100:64", "--plan-model", "llama3-8b",
                   "--nproc", "2", "--steps", "2", "--time-steps", "0", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] and result["counts_match"] and result["bytes_match"]
    assert result["predicted"]["reduce_scatter"] > 1  # one per group with params: more than one group proven
    assert (result["plan_for"], result["plan_model"]) == ("h100:64", "llama3-8b")
    assert "for llama3-8b on h100:64" in out.stderr and "hold only modules this model does not have" in out.stderr


def test_a_native_crash_is_not_blamed_on_the_oom_killer():
    """SIGABRT is a native abort inside the rank (gloo given different buffer sizes, say), not a kill from outside;
    several ranks "were" killed."""
    from fsdp_planner.runtime.failures import RankFailure, explain

    line = explain([RankFailure(r, exitcode=-signal.SIGABRT) for r in (0, 2)])
    assert line == ("verify job failed: ranks 0, 2 were killed by SIGABRT (it raised no exception: a native crash in "
                    "torch or a library it calls, such as gloo given different buffer sizes on different ranks by a "
                    "model whose shapes depend on the data)")


@pytest.mark.integration  # a 2-rank torchrun job started from the model's folder: seconds
def test_a_module_beside_the_model_that_shadows_numpy_does_not_crash_the_job(tmp_path):
    """``verify`` run in a folder holding a numpy.py: the launcher (``python -m``) put the working directory first
    on its path, imported that file for numpy and died of SIGSEGV, reported as a kill "from outside the job" (a new
    user's finding). The launcher and ranks now start without it; a crash signal is said to be one."""
    (tmp_path / "numpy.py").write_text("import torch\n")
    (tmp_path / "model.py").write_text("import torch\nfrom torch import nn\n\n\n"
                                       "def build(batch_size=4):\n"
                                       "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), "
                                       "(torch.randn(batch_size, 8),)\n")
    if sys.version_info < (3, 11):
        pytest.skip("PYTHONSAFEPATH and -P are Python 3.11's")
    # the command as installed (a console script puts its own folder on its path, not the working directory)
    command = "import sys; from fsdp_planner.cli import main; sys.exit(main())"
    done = subprocess.run([sys.executable, "-P", "-c", command, "verify", "model.py:build", "--policy", "order",
                           "--nproc", "2", "--steps", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**as_users_run(), "PYTHONPATH": str(Path(v.__file__).parents[2])})
    assert done.returncode == 0 and "PASS" in done.stdout, done.stderr
    from fsdp_planner.runtime.failures import launcher_killed

    assert "crashed (SIGSEGV)" in launcher_killed(-signal.SIGSEGV)
    assert "from outside the job" in launcher_killed(-signal.SIGTERM)


def test_verify_refuses_ranks_the_host_cannot_hold(tmp_path):
    """Each CPU rank builds the model and an unsharded reference: a config of 137B params is refused before any
    rank starts (a new user's 2.1B-param config was killed by the out-of-memory killer after 98 s on 2 ranks)."""
    from conftest import run_main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 64,
                                  "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 1,
                                  "vocab_size": 1 << 24}))
    done = run_main("verify", f"hf:{config}", "--policy", "titan", "--nproc", "2")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
        "error: verify runs 2 CPU ranks that each build the model and an unsharded reference (512 GiB of params"), \
        done.stderr



def test_the_replica_check_fails_a_param_that_is_not_finite_on_any_rank():
    """gloo's MAX and MIN pass a NaN by: a NaN copy on another rank read as 0 apart (a review). Run on one gloo
    rank in this process: a finite param is 0 apart, a NaN or inf one fails (above 1x its bound)."""
    import torch
    import torch.distributed as dist

    from fsdp_planner.runtime.worker import replicas

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ok = replicas([("w", torch.ones(4)), ("ids", torch.arange(3))])
        assert ok == {"replica_diff": 0.0, "replica_error": 0.0, "replica_param": ""}
        for bad in (float("nan"), float("inf")):
            out = replicas([("w", torch.tensor([1.0, bad]))])
            assert out["replica_error"] > 1 and out["replica_param"] == "w", out
    finally:
        dist.destroy_process_group()


def test_ranks_far_above_the_cores_are_said(monkeypatch, capsys):
    """64 CPU ranks on 2 cores ran without a word (a new user's finding): above 4 a core, a note says what such a
    job's times are worth."""
    import os

    from fsdp_planner.cli.verify import RANKS_PER_CORE, _note_oversubscribed

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    _note_oversubscribed(2 * RANKS_PER_CORE)
    assert capsys.readouterr().err == ""
    _note_oversubscribed(2 * RANKS_PER_CORE + 1)
    assert "starts 9 CPU ranks on this host's 2 cores: they take turns" in " ".join(capsys.readouterr().err.split())


@pytest.mark.integration  # one 2-rank torchrun job, ~15 s
def test_a_run_that_changes_no_param_says_its_parity_proves_nothing(tmp_path):
    """A new user's model whose gradients were all zero passed verify (loss the same each step, parameter
    difference 0): parity holds whatever a plan does when nothing trains. Said in a note; the run passes."""
    factory = tmp_path / "still.py"
    factory.write_text("import torch\n\n\ndef build(batch_size: int = 4):\n"
                       "    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), "
                       "torch.nn.Linear(32, 4))\n"
                       "    x = torch.randn(batch_size, 16)\n"
                       "    return model, (x,), lambda out: out.sum() * 0.0\n")
    r = run_main("verify", f"{factory}:build", "--policy", "order", "--nproc", "2", "--steps", "2",
                 "--precision", "fp32")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no param changed in the 2 steps" in " ".join((r.stdout + r.stderr).split())
    plan = tmp_path / "f1.json"  # (FSDP1's worker too)
    assert run_main("plan", f"{factory}:build", "--policy", "order", "--target", "fsdp1", "--out", str(plan)
                    ).returncode == 0
    r = run_main("verify", f"{factory}:build", "--plan", str(plan), "--fsdp1", "--nproc", "2", "--steps", "2")
    assert r.returncode == 0 and "no param changed in the 2 steps" in " ".join((r.stdout + r.stderr).split())
    r = run_main("verify", "seed-net", "--policy", "order", "--nproc", "2", "--steps", "1", "--precision", "fp32")
    assert r.returncode == 0 and "no param changed" not in r.stdout + r.stderr


class _Counting(torch.nn.Module):
    """A buffer the forward counts its calls in and reads (a warm-up inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * torch.clamp(self.calls / 4.0, max=1.0)


def test_the_reference_runs_each_rank_with_its_own_buffers():
    """FSDP2 syncs no buffer: on 2 ranks each rank's count moves once a step. The one-process reference ran both
    ranks' batches through one model, counting twice a step, and a trial's model failed parity for it; each rank's
    batches now run with that rank's buffers, and the reference holds rank 0's between steps."""
    from fsdp_planner.runtime.worker import RankBuffers, reference_step

    model = _Counting()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    buffers = RankBuffers(model, 2)
    batch = (torch.ones(2, 4),), lambda out: out.sum()
    for step in range(3):
        reference_step(model, optimizer, [[batch], [batch]], step, 0, torch.device("cpu"), buffers=buffers)
    assert [b[("", "calls")].item() for b in buffers.saved] == [3.0, 3.0] and model.calls.item() == 3.0
    # a buffer two modules register stays one tensor in each rank's copy (a review's case)
    shared = torch.nn.Sequential(_Counting(), _Counting())
    shared[1].calls = shared[0].calls
    buffers = RankBuffers(shared, 2)
    buffers.install(1)
    assert shared[0].calls is shared[1].calls
