"""The suite's launchers forked from a zygote (runtime/zygote.py): reported as a started launcher is, and gone with
the process that started the zygote, job and all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_planner.runtime import zygote
from fsdp_planner.runtime.launch import FORK_ENV, forks_ranks
from fsdp_planner.runtime.zygote import ZYGOTE_ENV, Forked, start_launcher

FIXTURES = Path(__file__).parent / "fixtures"
LAUNCHER = [sys.executable, "-u", "-m", zygote.LAUNCH_MODULE]


def _env(**settings: str) -> dict[str, str]:
    """A launch environment whose path holds the fixtures' rank module: a start-up environment of its own, so a
    zygote of its own (each test below ends it)."""
    src = str(Path(zygote.__file__).parents[2])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1", FORK_ENV: "1",
            ZYGOTE_ENV: str(os.getpid()), "PYTHONPATH": os.pathsep.join([src, str(FIXTURES)]), **settings}


pytestmark = [pytest.mark.integration,  # each starts a launcher, which imports torch
              pytest.mark.skipif(not forks_ranks(_env()), reason="ranks fork on Linux with a CPU-only torch only")]


def test_a_forked_launcher_exits_and_writes_as_a_started_one(tmp_path):
    """torchrun's own argument error: the same status and the same message, on the same stream, either way."""
    args = [str(tmp_path / "exits"), "sleeping_rank", str(tmp_path / "job"), "--no-such-option"]
    started = subprocess.Popen([*LAUNCHER, *args], env={k: v for k, v in _env().items() if k != FORK_ENV},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    forked = start_launcher([*LAUNCHER, *args], _env())
    assert isinstance(forked, Forked) and forked.pid != os.getpid()
    try:
        (out_a, err_a), (out_b, err_b) = started.communicate(timeout=120), forked.communicate(timeout=120)
    finally:
        os.kill(forked.zygote, signal.SIGTERM)  # no other test asks for this environment's
    assert started.returncode == forked.returncode == 2 and forked.stdout.closed and forked.stderr.closed
    assert out_a == out_b == "" and "unrecognized arguments: --no-such-option" in err_b
    assert err_a.splitlines()[-1] == err_b.splitlines()[-1]


@pytest.mark.parametrize("how", ["client killed", "handle dropped"])
def test_a_job_ends_with_its_client_or_its_handle(tmp_path, how):
    """The client killed by SIGKILL (no handler runs): the zygote follows it, each launcher follows the zygote and
    torchrun ends its ranks. The client alive but its handle dropped without a wait (nobody left to stop the job):
    the zygote kills the job. Either way nothing of the job is left."""
    client = f"""
import gc, os, sys, time
from pathlib import Path
from fsdp_planner.runtime import zygote
os.environ[zygote.ZYGOTE_ENV] = str(os.getpid())
proc = zygote.start_launcher({[*LAUNCHER, str(tmp_path / 'exits'), 'sleeping_rank', str(tmp_path / 'started'),
                               '--standalone', '--nproc_per_node=2', f'--log-dir={tmp_path / "logs"}']!r},
                             {{**{_env(TMPDIR=str(tmp_path))!r}, zygote.ZYGOTE_ENV: str(os.getpid())}})
print(type(proc).__name__, proc.pid, proc.zygote, flush=True)
while len(list(Path({str(tmp_path)!r}).glob("started.*"))) < 2:
    time.sleep(0.2)
if {how == "handle dropped"}:
    del proc
    gc.collect()
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
        job = [int(launcher), *(int(p.suffix[1:]) for p in tmp_path.glob("started.*"))]
        if how == "client killed":
            proc.kill()
            proc.wait(timeout=30)
            job.append(int(zygote_pid))
        deadline = time.monotonic() + 30
        while _alive(*job) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(*job) == []
        assert (how == "client killed") == (_alive(int(zygote_pid)) == [])  # a dropped handle ends its job only
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


def test_the_zygote_serves_only_this_process_s_launchers_of_forked_ranks():
    """Users' jobs (no ``FORK_ENV``), a subprocess's (another pid in ``ZYGOTE_ENV``) and any other command start as
    processes of their own."""
    for env in ({k: v for k, v in _env().items() if k != FORK_ENV}, _env(**{ZYGOTE_ENV: str(os.getppid())})):
        proc = start_launcher([*LAUNCHER, "x", "sleeping_rank", "z", "--no-such-option"], env)
        assert isinstance(proc, subprocess.Popen)
        proc.communicate(timeout=120)
        assert proc.returncode == 2
    proc = start_launcher([sys.executable, "-c", "pass"], _env())
    assert isinstance(proc, subprocess.Popen)
    proc.communicate(timeout=60)
    assert proc.returncode == 0


def test_a_request_from_another_process_is_refused(tmp_path):
    """The zygote's address is visible to every local user: it forks for the process that started it only."""
    forked = start_launcher([*LAUNCHER, "x", "sleeping_rank", "z", "--no-such-option"], _env())
    assert isinstance(forked, Forked)
    try:
        forked.communicate(timeout=120)
        intruder = f"""
import json, os, socket
conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
conn.connect({forked.address!r})
r, w = os.pipe()
try:  # the zygote may hang up before the request is sent, or with it unread
    socket.send_fds(conn, [json.dumps({{"argv": ["--help"], "env": {{}}, "cwd": "/"}}).encode()], [w, w])
    conn.settimeout(30)
    print(repr(conn.recv(4096)))
except (BrokenPipeError, ConnectionResetError):
    print("refused")
"""
        out = subprocess.run([sys.executable, "-c", intruder], capture_output=True, text=True, timeout=60)
        # hung up on without a pid: the zygote replies with one after a fork only
        assert out.stdout.strip() in ("b''", "refused"), out
    finally:
        os.kill(forked.zygote, signal.SIGTERM)


@pytest.mark.skipif(not forks_ranks({FORK_ENV: "1"}), reason="ranks are forked only on Linux with a CPU-only torch")
def test_a_forked_rank_joins_once_its_launcher_has_forked_every_rank(monkeypatch):
    """A forked rank waits until the launcher has forked as many ranks as the node runs (its main thread's
    children): a rank forked while an earlier one's connection held glibc's resolver lock in the launcher would
    wait for good in its own ``getaddrinfo``. The launcher here: a process that starts two children."""
    from fsdp_planner.runtime.launch import LAUNCHER_ENV, await_forked_siblings

    code = "import subprocess, sys, time\n" \
           "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) for _ in range(2)]\n" \
           "time.sleep(60)"
    launcher = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        monkeypatch.setenv(FORK_ENV, "1")
        monkeypatch.setenv(LAUNCHER_ENV, str(launcher.pid))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        started = time.monotonic()
        await_forked_siblings(timeout=30)
        assert time.monotonic() - started < 25  # both started (within seconds): the wait ends then
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
        started = time.monotonic()
        await_forked_siblings(timeout=0.5)
        assert time.monotonic() - started >= 0.5  # one not started yet: it waits (here until its time is up)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_the_zygote_preloads_the_modules_its_setting_names_and_leaves_out_the_rest(monkeypatch):
    """``PRELOAD_ENV``: each module name imported before the zygote forks (the suite's transformers: ~3 s of CPU a
    rank of a transformers model otherwise); a name that is no module name or fails to import is left out, for the
    rank that needs it to say; at most 100 names."""
    for name in ("json.tool", "no_such_module_here", "os; import sys", "xml.dom.minidom"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    zygote.preload_modules(" json.tool,no_such_module_here,,os; import sys")
    assert "json.tool" in sys.modules and "no_such_module_here" not in sys.modules
    zygote.preload_modules(",".join(["json"] * 100 + ["xml.dom.minidom"]))
    assert "xml.dom.minidom" not in sys.modules


def test_the_launcher_names_rendezvous_events_as_torch_does_without_reading_the_stack() -> None:
    """torchrun's rendezvous names each event by its caller's caller (``get_method_name``: ``inspect.stack()``,
    which reads every frame's source and, in a launcher forked from the zygote, searches its thousands of modules):
    the launcher's ``caller_name`` gives the same names from the frames alone."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name

    from fsdp_planner.runtime.launch import caller_name

    def by(name_of):  # an event recorded two calls below the function it is named by
        def record():
            return name_of()
        return record()

    def next_rendezvous():
        return by(get_method_name), by(caller_name)

    assert next_rendezvous() == ("by", "by")
    assert caller_name(10_000) == get_method_name(10_000) == "no_method_name"
