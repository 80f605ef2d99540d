"""Verify a plan on a real multi-process run: same parameters as unsharded training, predicted collectives.

``run_verify`` predicts the step's collectives from the FSDP2 replay, writes a job file and launches
``torchrun --standalone --nproc_per_node N -m fsdp_planner.runtime.worker JOB`` (gloo on CPU, NCCL on GPUs); see
``worker.py`` for what each rank does. A plan passes when the parameters match the unsharded reference and the
counted all-gathers and reduce-scatters, and their bytes, equal the prediction on every step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.collectives import CollectiveKind
from fsdp_planner.models import ModelSpec, as_spec
from fsdp_planner.sim.sizing import Sizing
from fsdp_planner.trace.records import Trace

FP32_TOLERANCE = 1e-5
Counts = dict[str, int]  # collective kind's value -> count or bytes
STOP_GRACE_S = 5.0  # SIGTERM to the job's process group, then SIGKILL after this long


class Terminated(BaseException):
    """A terminating signal (SIGTERM, SIGHUP) arrived; raised from its handler so every ``finally`` runs: the
    torchrun job is killed and the temporary directory removed, as on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


@contextmanager
def signals_raise(signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise ``Terminated`` instead of killing the process outright (only in the
    main thread, where Python runs signal handlers; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_process_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """End ``proc`` and every process of its session (it was started with ``start_new_session``): torchrun and its
    workers. SIGTERM, then SIGKILL after ``grace`` seconds; Ctrl-C and SIGTERM wait until it is done."""
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        pgid = proc.pid  # a session leader's group id is its pid, even after it exits
        if proc.poll() is None or _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                proc.poll()  # reap torchrun itself: a zombie still counts as a member of the group
                if not _group_alive(pgid):
                    break
                time.sleep(0.05)
            else:
                _signal_group(pgid, signal.SIGKILL)
                _wait_until_dead(pgid, grace)  # SIGKILL is delivered, not yet acted on, when killpg returns
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with suppress(OSError):
                    pipe.close()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    finally:
        if in_main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)


def _signal_group(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_until_dead(pgid: int, seconds: float) -> None:
    """Until no process of the group is still running (zombies waiting for their parent to reap them do not
    count), at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _running_members(pgid):
        time.sleep(0.02)


def _running_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is running (not a zombie), read from /proc; where there is no /proc,
    whether the group exists."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return _group_alive(pgid)
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class VerifyResult:
    world_size: int
    steps: int
    backend: str
    predicted: Counts
    counted: list[Counts]  # per step
    counted_bytes: list[Counts]
    predicted_bytes: Counts
    losses: list[float]
    reference_losses: list[float]
    max_abs_diff: float
    tolerance: float = FP32_TOLERANCE
    notes: list[str] = field(default_factory=list)
    units: list[str] | None = None  # FSDP1 (``fsdp1=True``): the modules it wrapped, as the plan's groups name them
    expected_units: list[str] | None = None

    @property
    def units_match(self) -> bool:
        return self.units is None or sorted(self.units) == sorted(self.expected_units or [])

    @property
    def params_match(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    @property
    def counts_match(self) -> bool:
        return all(c == self.predicted for c in self.counted)

    @property
    def bytes_match(self) -> bool:
        return all(b == self.predicted_bytes for b in self.counted_bytes)

    @property
    def ok(self) -> bool:
        return self.params_match and self.counts_match and self.bytes_match and self.units_match

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params_match": self.params_match, "counts_match": self.counts_match,
                "bytes_match": self.bytes_match, "units_match": self.units_match, "ok": self.ok}


def predict_collectives(trace: Trace, plan: Plan, world_size: int) -> tuple[Counts, Counts]:
    """Per-step all-gather / reduce-scatter (HSDP: all-reduce) counts, and their bytes as FSDP2 sends them (padded,
    params' dtypes). FSDP2 issues no all-gather or reduce-scatter over a shard group of one rank."""
    shard = plan.shard_size(world_size)
    sizing = Sizing(trace, shard)
    groups = sizing.groups(plan)
    counts = dict.fromkeys((k.value for k in CollectiveKind), 0)
    nbytes = dict.fromkeys((k.value for k in CollectiveKind), 0)
    for c in build_schedule(trace, plan, world_size).collectives:
        if c.kind is not CollectiveKind.ALL_REDUCE and shard == 1:
            continue
        counts[c.kind.value] += 1
        if c.kind is CollectiveKind.ALL_GATHER:
            nbytes[c.kind.value] += groups[c.group].gather_bytes
        elif c.kind is CollectiveKind.REDUCE_SCATTER:
            nbytes[c.kind.value] += sizing.reduce_bytes(c.params)
        else:
            nbytes[c.kind.value] += sizing.reduce_bytes(c.params) // shard
    return counts, nbytes


def run_verify(model: ModelSpec | str, trace: Trace, plan: Plan, nproc: int, steps: int = 3, lr: float = 0.05,
               seed: int = 0, timeout: float = 600.0, fsdp1: bool = False) -> VerifyResult:
    """Launch the torchrun job and compare its results with the plan's predictions (``fsdp1``: run the plan as
    FSDP1 ``FullyShardedDataParallel`` units, ``fsdp1_worker.py``)."""
    from fsdp_planner.models import BUILTINS

    model = as_spec(model)
    spec = model.name

    if nproc < 1:
        raise PlannerError("--nproc must be at least 1")
    if steps < 1:
        raise PlannerError("--steps must be at least 1")
    if spec in BUILTINS and not BUILTINS[spec].trainable:
        raise PlannerError(f"'{spec}' is for planning only (too large to train here); verify a trainable model")
    if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
        path, _, fn = spec.rpartition(":")
        model = dataclasses.replace(model, name=f"{Path(path).resolve()}:{fn}")
    predicted, predicted_bytes = predict_collectives(trace, plan, nproc)
    if fsdp1:
        predicted_bytes = predict_fsdp1_bytes(trace, plan, nproc)
    with signals_raise(), \
            tempfile.TemporaryDirectory(prefix="fsdp-planner-verify-", ignore_cleanup_errors=True) as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps({"model": model.to_json(), "plan": plan.to_json(), "steps": steps, "lr": lr,
                                        "seed": seed, "result": str(result_path)}))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", f"fsdp_planner.runtime.{'fsdp1_worker' if fsdp1 else 'worker'}", str(job_path)]
        # Its own session: the job's processes are one group to kill on every way out, and Ctrl-C in a terminal
        # reaches only this process (which then stops them) instead of racing torchrun's own handling.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PlannerError(f"verify job did not finish within {timeout:.0f} s (stopped)") from None
        finally:
            stop_process_group(proc)  # also after a normal exit: no rank outlives the job
        if not result_path.is_file():
            raised = sorted(Path(tmp).glob("result.json.rank*.error"))
            if raised:
                rank = raised[0].name.rpartition(".rank")[2].split(".")[0]
                raise PlannerError(f"verify job failed: rank {rank} raised {raised[0].read_text()}")
            tail = "\n".join((stdout + stderr).strip().splitlines()[-15:])
            raise PlannerError(f"verify job failed (exit {proc.returncode}):\n{tail}")
        data = json.loads(result_path.read_text())
    notes = []
    if proc.returncode != 0:
        notes.append(f"torchrun exited {proc.returncode} after the results were written (exit noise ignored)")
    return VerifyResult(
        world_size=data["world"], steps=steps, backend=data["backend"], predicted=predicted,
        counted=data["counted"], counted_bytes=data["counted_bytes"], predicted_bytes=predicted_bytes,
        losses=data["losses"], reference_losses=data["reference_losses"], max_abs_diff=data["max_abs_diff"],
        notes=notes, units=data.get("units"),
        expected_units=[g.modules[0] for g in plan.inner_groups] + [""] if fsdp1 else None)


def predict_fsdp1_bytes(trace: Trace, plan: Plan, world_size: int) -> Counts:
    """FSDP1 issues the collectives FSDP2's replay predicts for a single-module plan (its root is never resharded
    after forward, SHARD_GRAD_OP units neither), but with one flat parameter per unit: other bytes."""
    from fsdp_planner.fsdp2.fsdp1 import fsdp1_collective_bytes

    kinds = [(c.kind.value, c.group) for c in build_schedule(trace, plan, world_size).collectives]
    nbytes = dict.fromkeys((k.value for k in CollectiveKind), 0)
    return {**nbytes, **fsdp1_collective_bytes(trace, plan, world_size, [] if world_size == 1 else kinds)}
