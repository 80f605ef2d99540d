"""torchrun, plus a record of how each rank ended:
``python -m fsdp_planner.runtime.launch EXITS.json MODULE JOB.json ARGS...``.

ARGS are torchrun's own; each rank runs MODULE as ``__main__`` with JOB.json as its argument (``rank_command``).
When the job fails, torchrun knows each rank's exit status (a rank killed by SIGKILL has no other trace: it wrote
nothing) but only prints it in a summary meant for people; this writes it as JSON (``{"RANK": EXITCODE}``, a
negative code being the signal) so ``verify`` can name the rank that died and why.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.run import parse_args, run

from fsdp_planner.patching import patched
from fsdp_planner.signals import die_of, follow_parent

PARENT_ENV = "FSDP_PLANNER_PARENT"  # the pid of the command that started the job (runtime/verify.py)
LAUNCHER_ENV = "FSDP_PLANNER_LAUNCHER"  # this launcher's pid, which its ranks follow (rank.follow_launcher)
# "1": ranks forked from the launcher where that is sound (``rank_command``), and the launcher from a zygote
# (``zygote.py``): the test suite's setting
FORK_ENV = "FSDP_PLANNER_FORK_RANKS"
SIBLINGS_WAIT_S = 60.0  # how long a forked rank waits for its siblings' forks (``await_forked_siblings``)
# what torch imports only when first used and every rank uses: inductor's config (``use_deterministic_algorithms``
# sets a flag there; it imports dynamo, which FSDP2 asks for on its first call): 0.8 s of CPU a forked rank
LOADED_BY_EVERY_RANK = ("torch._inductor.config",)
# what ``run_torchrun`` runs on ranks: verify's, verify --fsdp1's, calibrate --gloo's
RANK_MODULES = ("fsdp_planner.runtime.worker", "fsdp_planner.runtime.fsdp1_worker", "fsdp_planner.calibrate.worker")


def follow_command() -> None:
    """End with the command that started the job, even when it is killed by SIGKILL and cannot stop the job
    itself: this process then gets SIGTERM (``signals.follow_parent``), on which torchrun ends its ranks."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        follow_parent(int(parent), signal.SIGTERM)


def main(argv: list[str]) -> int:
    follow_command()
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # torchrun passes its environment on to the ranks
    exits_path, module, job_path, torchrun_args = Path(argv[0]), argv[1], argv[2], argv[3:]
    ranks = rank_command(module)
    try:
        # torch.multiprocessing's per-rank error files (a forked rank's, kept when it raised) under the job's
        # directory, removed with it; a forked rank takes the temp directory back (``as_fresh_interpreter``)
        with patched(tempfile, "tempdir", str(exits_path.parent)), \
                patched(dynamic_rendezvous, "get_method_name", caller_name):
            run(parse_args([*torchrun_args, *ranks, job_path]))
    except ChildFailedError as e:
        exits_path.write_text(json.dumps({str(rank): f.exitcode for rank, f in e.failures.items()}))
        return 1
    except SignalException as e:  # torchrun stopped its ranks on a signal sent to it: die of it, not a traceback
        return die_of(e.sigval)
    return 0


def caller_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up, what torchrun's rendezvous names each event it records by
    (``dynamic_rendezvous.get_method_name``): from the frame itself, where torch's ``inspect.stack()``, twice an
    event, reads every frame's source file and searches ``sys.modules`` for it (a launcher forked from the
    suite's zygote, with transformers imported: 2% of the whole suite's CPU, py-spy)."""
    try:
        return sys._getframe(depth).f_code.co_name  # (this function's own frame is depth 0, as the stack's first
        # entry is)
    except ValueError:  # a stack shallower than that
        return "no_method_name"  # (torch's word)


def rank_command(module: str) -> list[str]:
    """How torchrun starts each rank: ``-m MODULE`` in a fresh interpreter, torchrun's default. With
    ``FORK_ENV=1`` on Linux with a CPU-only build of torch (``forks_ranks``): forked from this process once it has
    imported MODULE (torchrun's ``--start-method fork --run-path``, which runs MODULE's file as ``__main__`` in the
    fork), so no rank pays its own imports of torch, FSDP2 and DTensor, about 4 s of CPU a rank, most of what a
    small job costs; the test suite runs hundreds of jobs so (and forks their launchers too: ``zygote.py``). Not
    the default, because forked ranks differ from a real job's in what ``verify`` checks: they share the
    launcher's string-hash seed (models built in set order look the same on every rank), and torch reports only
    the first of the ranks that fail together (the exits file names one). Never where torch may use a GPU (CUDA
    cannot run in a process forked from one that touched it)."""
    if not forks_ranks(os.environ):
        return ["-m", module]
    file = preload(module)
    gc.freeze()  # the imports' objects out of the ranks' collections: none walks (and so copies) these pages
    os.register_at_fork(after_in_child=as_fresh_interpreter)
    return ["--start-method", "fork", "--run-path", file]


def forks_ranks(env: Mapping[str, str]) -> bool:
    """Whether a job launched with ``env`` forks its ranks (``rank_command``)."""
    return env.get(FORK_ENV) == "1" and sys.platform == "linux" and not torch.backends.cuda.is_built()


def await_forked_siblings(timeout: float = SIBLINGS_WAIT_S) -> None:
    """In a rank the launcher forked (``rank_command``), wait until it has forked every rank of the node before
    joining the process group. It forks them one by one while its TCPStore server's thread accepts the ranks
    already running, and glibc's resolver lock, which no fork handler resets, is held there at times: a rank forked
    then inherits it held, with no thread to release it, and its ``getaddrinfo`` in ``init_process_group`` waits
    for good (about 1 job in 50 of 8 ranks on a loaded 2-core machine; py-spy: ``__resolv_context_get`` under
    ``TCPStore::TCPStore``, never in rank 0, which is forked before any rank connects). Once every rank is forked
    no fork is left to inherit it. Without ``/proc``'s children list (another kernel): no wait."""
    launcher, ranks = os.environ.get(LAUNCHER_ENV), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not launcher or not forks_ranks(os.environ):
        return
    children = Path(f"/proc/{launcher}/task/{launcher}/children")  # (forked by its main thread)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(children.read_text().split()) >= ranks:
                return
        except OSError:
            return
        time.sleep(0.005)


def preload(*modules: str) -> str:
    """Import what every forked rank needs and the ranks' ``modules`` (by default each rank module a job runs);
    the file of the first."""
    for name in (*LOADED_BY_EVERY_RANK, *(modules or RANK_MODULES)):
        importlib.import_module(name)
    file = sys.modules[(modules or RANK_MODULES)[0]].__file__
    assert file is not None
    return file


def as_fresh_interpreter() -> None:
    """In a forked rank, what the launcher changed, as a rank started fresh has it: the temp directory (``main``
    points the launcher's at the job's) and the handlers of the signals torchrun handles, the defaults, so that
    each ends the rank with that signal as its exit status (an uncaught KeyboardInterrupt ends a fresh one by
    SIGINT). The agent's handlers, which the fork inherits, raise instead: a rank torchrun stops because a peer
    failed would report the stop as its own failure, and torch's fork wrapper swallows a KeyboardInterrupt, ending
    the rank with status 0 and torchrun waiting for its return value."""
    tempfile.tempdir = None
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
