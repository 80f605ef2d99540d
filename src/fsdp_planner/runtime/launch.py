"""torchrun, plus a record of how each rank ended:
``python -m fsdp_planner.runtime.launch EXITS.json START ARGS...``.

ARGS are torchrun's own (``... -m MODULE JOB.json``). When the job fails, torchrun knows each rank's exit status (a
rank killed by SIGKILL has no other trace: it wrote nothing) but only prints it in a summary meant for people; this
writes it as JSON (``{"RANK": EXITCODE}``, a negative code being the signal) so ``verify`` can name the rank that
died and why.

START is how torchrun's elastic agent starts the ranks (``RankStart``):

- ``exec``: each rank its own ``python -m MODULE JOB.json`` (torchrun's own way), for GPU jobs: a rank forked from
  a process that had touched CUDA could not use it.
- ``forkserver``: each rank forked from one server process that imported torch, FSDP2 and ``MODULE`` once, then
  runs ``MODULE`` as ``__main__`` (the agent's function entrypoint, ``start_method="forkserver"``). The same agent,
  rendezvous, environment and exit statuses; on CPU (gloo) it spares each rank ~4-5 s of CPU for its imports,
  which is most of a small job's cost. The server is started first, so it imports while this process imports
  torchrun. Each rank follows the server (``run_forked``), which ends when the agent does.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from fsdp_planner.patching import patched
from fsdp_planner.signals import follow_parent

PARENT_ENV = "FSDP_PLANNER_PARENT"  # the pid of the command that started the job (runtime/verify.py)
LAUNCHER_ENV = "FSDP_PLANNER_LAUNCHER"  # this launcher's pid, which its ranks follow (rank.follow_launcher)
# What the rank server imports before it forks a rank: first the module that makes it follow this launcher, then
# what each rank would import itself (torch._inductor and dynamo come with torch.use_deterministic_algorithms, which
# every verify rank calls)
PRELOAD = ("fsdp_planner.runtime.rank_server", "fsdp_planner.runtime.rank", "torch._dynamo", "torch._inductor")
RANK_POLL_S = 0.5  # how often watch_ranks looks for forked ranks that ended without returning
AGENT_GRACE_S = 5.0  # ... and how long after the last ended it lets the agent finish (it polls every 0.1 s)


class RankStart(enum.Enum):
    EXEC = "exec"
    FORKSERVER = "forkserver"


def follow_command() -> None:
    """End with the command that started the job, even when it is killed by SIGKILL and cannot stop the job
    itself: this process then gets SIGTERM (``signals.follow_parent``), on which torchrun ends its ranks."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        follow_parent(int(parent), signal.SIGTERM)


def main(argv: list[str]) -> int:
    follow_command()
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # torchrun passes its environment on to the ranks
    exits_path, start, torchrun_args = Path(argv[0]), RankStart(argv[1]), argv[2:]
    # What this process makes in temp files goes into the job's directory, removed with it: the rank server's
    # socket (``verify.rank_start`` checks its path fits) and the agent's per-rank error pickles, which it leaves
    # behind when a rank fails.
    with patched(tempfile, "tempdir", str(exits_path.parent)):
        return run_job(exits_path, start, torchrun_args)


def run_job(exits_path: Path, start: RankStart, torchrun_args: list[str]) -> int:
    """torchrun's job; each rank's exit status written to ``exits_path`` when it fails."""
    if start is RankStart.FORKSERVER:  # before torch is imported here: the server imports it meanwhile
        module = torchrun_args[torchrun_args.index("-m") + 1]
        multiprocessing.set_forkserver_preload([*PRELOAD, module])
        multiprocessing.forkserver.ensure_running()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch(torchrun_args, start)
    except ChildFailedError as e:
        exits_path.write_text(json.dumps({str(rank): f.exitcode for rank, f in e.failures.items()}))
        return 1
    except SignalException as e:  # torchrun stopped its ranks on a signal sent to it: die of it, not a traceback
        return die_of(e.sigval)
    return 0


def launch(torchrun_args: list[str], start: RankStart) -> None:
    """torchrun with ``torchrun_args``, its ranks started as ``start`` says."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run

    args = parse_args(torchrun_args)
    if start is RankStart.EXEC:
        run(args)
        return
    if args.standalone:
        raise ValueError("give the rendezvous (--rdzv-backend, --rdzv-endpoint, --rdzv-id), not --standalone")
    config, _, _ = config_from_args(args)
    watch_ranks(Path(args.training_script_args[0]).parent, config.nproc_per_node)
    elastic_launch(dataclasses.replace(config, start_method=start.value), entrypoint=run_forked)(
        args.training_script, *args.training_script_args)


def run_forked(module: str, *argv: str) -> None:
    """A rank forked from the rank server (``RankStart.FORKSERVER``): ``python -m MODULE ARGV...`` run in this
    process (the server imported ``MODULE``'s imports already). It follows the server, its parent, as a rank of
    its own process follows the launcher (``rank.follow_launcher``): the server ends when the launcher does
    (``rank_server.py``). (Pickled by name for the server as ``__main__.run_forked``: multiprocessing imports this
    module, the launcher's main, in the rank first.)"""
    os.environ[LAUNCHER_ENV] = str(os.getppid())
    rank_pid_file(Path(argv[0]).parent, os.getpid()).touch()  # argv[0]: the job file, in the job's directory
    with patched(sys, "argv", [module, *argv]):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def rank_pid_file(job_dir: Path, pid: int) -> Path:
    """Where a forked rank says its pid (``rank.run_forked``), for ``watch_ranks``."""
    return job_dir / f"rank.{pid}.pid"


def watch_ranks(job_dir: Path, nproc: int) -> None:
    """End this launcher with status 0, as torchrun ends when its ranks did, once all ``nproc`` forked ranks have
    ended while the agent still waits: it waits for each rank function's return value, which a rank that ended its
    process itself (``os._exit(0)`` in a model's code) never sends, and would wait until the job's timeout. A
    daemon thread; a job that ends as it should ends it."""

    def ended(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    def watch() -> None:
        while True:
            time.sleep(RANK_POLL_S)
            pids = [int(f.name.split(".")[1]) for f in job_dir.glob("rank.*.pid")]  # rank_pid_file's
            if len(pids) == nproc and all(map(ended, pids)):
                time.sleep(AGENT_GRACE_S)  # the agent, had the ranks returned, would have ended by now
                os._exit(0)

    threading.Thread(target=watch, name="watch-ranks", daemon=True).start()


def die_of(signum: int) -> int:
    """End this process by ``signum``, which the command reads as the launcher killed from outside
    (``failures.launcher_killed``); the status a shell would give, should the signal not end it."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
