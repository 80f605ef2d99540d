"""The suite's launchers forked from a zygote (runtime/zygote.py): reported as a started launcher is, and gone with
the process that started the zygote, job and all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_planner.runtime import zygote
from fsdp_planner.runtime.launch import FORK_ENV
from fsdp_planner.runtime.zygote import Forked, start_launcher

FIXTURES = Path(__file__).parent / "fixtures"
LAUNCHER = [sys.executable, "-u", "-m", zygote.LAUNCH_MODULE]
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks and launchers fork on Linux only")


def _env(**settings: str) -> dict[str, str]:
    src = str(Path(zygote.__file__).parents[2])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1", FORK_ENV: "1",
            "PYTHONPATH": os.pathsep.join([src, str(FIXTURES)]), **settings}


@pytest.mark.integration
def test_a_forked_launcher_exits_and_writes_as_a_started_one(tmp_path):
    """torchrun's own argument error: the same status and the same message, on the same stream, either way."""
    args = [str(tmp_path / "exits"), "sleeping_rank", str(tmp_path / "job"), "--no-such-option"]
    started = subprocess.Popen([*LAUNCHER, *args], env={k: v for k, v in _env().items() if k != FORK_ENV},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    forked = start_launcher([*LAUNCHER, *args], _env())
    assert isinstance(forked, Forked) and forked.pid != os.getpid()
    (out_a, err_a), (out_b, err_b) = started.communicate(timeout=120), forked.communicate(timeout=120)
    assert started.returncode == forked.returncode == 2
    assert out_a == out_b == "" and "unrecognized arguments: --no-such-option" in err_b
    assert err_a.splitlines()[-1] == err_b.splitlines()[-1]


@pytest.mark.integration
def test_a_zygote_ends_with_the_process_that_started_it_and_takes_its_jobs(tmp_path):
    """The client killed by SIGKILL (no handler runs): the zygote follows it, each launcher follows the zygote and
    torchrun ends its ranks; nothing of the job is left."""
    client = f"""
import sys, time
from fsdp_planner.runtime import zygote
proc = zygote.start_launcher({[*LAUNCHER, str(tmp_path / 'exits'), 'sleeping_rank', str(tmp_path / 'started'),
                               '--standalone', '--nproc_per_node=2', f'--log-dir={tmp_path / "logs"}']!r},
                             {_env(TMPDIR=str(tmp_path))!r})
print(type(proc).__name__, proc.pid, proc.zygote, flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", client], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        kind, launcher, zygote_pid = proc.stdout.readline().split()
        assert kind == "Forked"
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("started.*"))) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int(p.suffix[1:]) for p in tmp_path.glob("started.*")]
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(int(zygote_pid), int(launcher), *ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(int(zygote_pid), int(launcher), *ranks) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(*pids: int) -> list[int]:
    """Those of ``pids`` still running (zombies, whose parent has not yet reaped them, are done)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.append(pid)
    return running


def test_the_zygote_serves_only_launchers_of_forked_ranks():
    """Users' jobs (no ``FORK_ENV``) and any other command start as their own processes."""
    env = {k: v for k, v in _env().items() if k != FORK_ENV}
    proc = start_launcher([sys.executable, "-c", "pass"], _env())
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0
    proc = start_launcher([*LAUNCHER, "x", "y", "z", "--no-such-option"], env)
    assert isinstance(proc, subprocess.Popen)
    proc.communicate(timeout=120)
    assert proc.returncode == 2
