"""One torchrun rank's life, the same for every job: ``run_rank(job_path, body)``.

Each job's worker (``worker.py`` for verify, ``fsdp1_worker.py`` for verify --fsdp1, ``calibrate/worker.py`` for
calibrate --backend gloo) runs as ``__main__`` with JOB.json as its argument (forked by torchrun from the launcher,
or ``python -m MODULE JOB.json``: ``launch.rank_command``) and hands its own work to ``run_rank``, which reads the
job, joins the process group, runs the work and leaves the process group. How a rank ends, as the launcher
(``verify.run_torchrun``) reads it:

- status 0: the work returned (rank 0 wrote the job's ``result`` file);
- status 1: the work raised; the exception is in ``RESULT.rankN.error`` (``failures.write_failure``), and a
  ``sys.exit`` or ``os._exit`` in the model's code counts as raising, whatever its status (with 0 the job would
  look finished, with no result);
- killed by a signal: no file; ``launch.py`` records the signal. SIGTERM, which torchrun sends every rank still
  running once one has failed, first writes the rank's Python stacks to ``RESULT.rankN.stack`` (``faulthandler``):
  a rank that never reached the collective its peers timed out in is named with where it was.

A rank ends with its launcher (``follow_launcher``): a rank whose torchrun agent was killed would otherwise run on
unsupervised, keeping the command waiting on its output.

Test-only fault injection (never set it otherwise): ``FSDP_PLANNER_TEST_FAULT=KIND:R`` aims a fault at rank R
(``injected_fault``); ``raise:R`` makes it raise before its work starts, ``hang:R`` keeps it from joining the
process group (its peers wait ``FSDP_PLANNER_TEST_TIMEOUT_S``, the collective timeout a test sets), the other
kinds are the workers' own.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fsdp_planner.patching import patched
from fsdp_planner.runtime.failures import EarlyExit, stack_file, write_failure
from fsdp_planner.runtime.launch import LAUNCHER_ENV, await_forked_siblings
from fsdp_planner.signals import follow_parent

# A collective that waits this long for a peer fails instead of blocking (gloo's default is 30 minutes); every
# rank does the same work between collectives, so a healthy job never waits near this. It bounds joining the
# group too: 8 gloo ranks on 2 cores already busy with other jobs left one rank outside the rendezvous for 120 s
# (2026-11-30), so the bound is well above that.
COLLECTIVE_TIMEOUT_S = 300
FAULT_ENV = "FSDP_PLANNER_TEST_FAULT"
TIMEOUT_ENV = "FSDP_PLANNER_TEST_TIMEOUT_S"  # test-only: the collective timeout in seconds (a hang's test is quick)
_stack_file: io.TextIOWrapper | None = None  # where SIGTERM writes this rank's stacks: open for the rank's life

Body = Callable[[dict[str, Any], torch.device, int, int], None]  # (job, device, rank, world size)


def run_rank(job_path: str, body: Body, *, cpu: bool = False) -> None:
    """Run ``body`` as this rank of the job in ``job_path`` (``cpu``: gloo on the CPU even beside a GPU); a
    failure is written for the launcher before it ends the rank (see the module's docstring)."""
    follow_launcher()
    job = json.loads(Path(job_path).read_text())  # the launcher wrote it; without it no error file can be placed
    joining = int(os.environ.get("RANK", "0"))
    try:
        stacks_on_sigterm(Path(job["result"]), joining)
        if injected_fault(joining) == "hang":
            _hang()
        await_forked_siblings()
        device, rank, world = start_rank(cpu)
    except Exception as e:  # joining the group failed (a peer gone, a port taken): said as this rank's failure
        write_failure(Path(job["result"]), int(os.environ.get("RANK", "0")), e)
        raise
    try:
        if injected_fault(rank) == "raise":
            raise RuntimeError(f"test fault: rank {rank} raised on purpose ({FAULT_ENV}=raise:{rank})")
        with patched(os, "_exit", failing_exit(Path(job["result"]), rank)):
            body(job, device, rank, world)
    except KeyboardInterrupt:  # SIGINT, from outside the job (its own session): the signal is the exit status
        raise
    except BaseException as e:  # DCP's CheckpointException, a model's own BaseException, sys.exit: all told
        write_failure(Path(job["result"]), rank, e)
        traceback.clear_frames(e.__traceback__)  # the failed work's locals (its FSDP modules): for end_rank's gc
        if isinstance(e, SystemExit):
            raise SystemExit(1) from e
        raise
    finally:
        end_rank()


def failing_exit(result_path: Path, rank: int) -> Callable[[int], NoReturn]:
    """``os._exit`` for the rank's work: status 0 from the model's code (nothing returned, nothing raised) ends
    the rank with status 1 and says so in its error file. A forked rank that ends well without returning leaves
    torchrun waiting for its return value for good; one started fresh would leave a job with no result and no
    cause."""
    exit_, pid = os._exit, os.getpid()

    def _exit(status: int) -> NoReturn:
        if status == 0 and os.getpid() == pid:  # (a process the work forks, a DataLoader's worker, ends so)
            write_failure(result_path, rank, EarlyExit())
            status = 1
        exit_(status)

    return _exit


def stacks_on_sigterm(result_path: Path, rank: int) -> None:
    """Have torchrun's SIGTERM write this rank's Python stacks where ``failures.read_failures`` reads them, then
    end the rank as SIGTERM does (``chain``). A signal handler of the model's own replaces this one."""
    global _stack_file
    _stack_file = stack_file(result_path, rank).open("w")
    faulthandler.register(signal.SIGTERM, file=_stack_file, all_threads=True, chain=True)


def _hang() -> None:
    """The test fault ``hang``: this rank never joins the process group (until torchrun stops it)."""
    while True:
        time.sleep(1)


def follow_launcher() -> None:
    """End this rank with SIGKILL when its launcher dies (``launch.py``; its pid in ``LAUNCHER_ENV``): nothing
    supervises the rank any longer, and a handler in the model's code must not keep it alive. Not under a launcher
    that does not say its pid (torchrun run by hand)."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher:
        follow_parent(int(launcher), signal.SIGKILL)


def start_rank(cpu: bool = False) -> tuple[torch.device, int, int]:
    """Join torchrun's process group: NCCL on this rank's GPU when there is one (and not ``cpu``), gloo on the CPU
    otherwise, with collectives that time out (a peer that hangs ends the job instead of blocking it for gloo's 30
    minutes)."""
    use_cuda = torch.cuda.is_available() and not cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = float(os.environ.get(TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout))
    return device, dist.get_rank(), dist.get_world_size()


def end_rank() -> None:
    """Leave the process group. The job's FSDP modules and meshes hold it: collected first (their reference cycles
    need ``gc``), else the gloo backend outlives ``destroy_process_group`` and its threads may abort the exiting
    process (``terminate called without an active exception``, about 1 exit in 10 on a 2-vCPU VM)."""
    gc.collect()
    dist.destroy_process_group()


def injected_fault(rank: int) -> str | None:
    """The kind of test-only fault aimed at this rank, if any (see the module's docstring)."""
    kind, _, target = os.environ.get(FAULT_ENV, "").partition(":")
    return kind if target == str(rank) else None
