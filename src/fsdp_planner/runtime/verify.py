"""Verify a plan on a real multi-process run: same parameters as unsharded training, predicted collectives.

``run_verify`` predicts the step's collectives from the FSDP2 replay, writes a job file and launches
``torchrun --standalone --nproc_per_node N -m fsdp_planner.runtime.worker JOB`` (gloo on CPU, NCCL on GPUs; through
``launch.py``, which records each rank's exit status and may fork the ranks, ``launch.rank_command``); see
``worker.py`` for what each rank does. A plan passes when the parameters match the unsharded reference and the
counted all-gathers and reduce-scatters, and their bytes, equal the prediction on every step, and, when it starts
from a checkpoint, the restored state is the saved one. A failed job is told by its cause (``failures.py``): the
rank that raised or died, not the ranks it took down with it. The job runs in its own session, ended as a whole on
every way out; its launcher follows this command and its ranks follow their launcher (``signals.follow_parent``),
so none outlives a parent killed by SIGKILL, and a launcher killed from outside fails the job
(``failures.launcher_killed``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
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

import torch

from fsdp_planner.apply.tensor_parallel import async_tp_runs
from fsdp_planner.choices import DEFAULT_PRECISION, REDUCE_BYTES, GradientSync, ReduceDtype
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.fsdp1_replay import fsdp1_collective_bytes, fsdp1_collectives
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.fsdp2.precision import (
    Precision,
    built_dtypes,
    check_complex_params,
    check_param_dtypes,
    check_precision,
)
from fsdp_planner.fsdp2.replay import Kept, build_schedule
from fsdp_planner.fsdp2.validity import check_forward_methods
from fsdp_planner.hardware.cluster import preset_cluster
from fsdp_planner.models import ModelSpec, as_spec, load_model, planning_only
from fsdp_planner.runtime.checkpoint import META, REFERENCE, read_meta
from fsdp_planner.runtime.checkpoint_pickle import DCP_METADATA, check_metadata
from fsdp_planner.runtime.failures import explain, launcher_killed, read_failures, unexplained
from fsdp_planner.runtime.launch import PARENT_ENV
from fsdp_planner.runtime.measure import host_memory
from fsdp_planner.runtime.worker import FP32_TOLERANCE
from fsdp_planner.runtime.zygote import Forked, start_launcher
from fsdp_planner.signals import signals_raise
from fsdp_planner.sim.expert_parallel import ep_view
from fsdp_planner.sim.float8 import converted_linears
from fsdp_planner.sim.options import PRECISIONS, with_reduce_dtype
from fsdp_planner.sim.sizing import Sizing, param_shards
from fsdp_planner.sim.tensor_parallel import tp_view
from fsdp_planner.sim.tracing import resolve_precision
from fsdp_planner.trace.records import Trace

Counts = dict[str, int]  # collective kind's value -> count or bytes
JOB_OPTIMIZER = "sgd-momentum"  # what the job's ranks and reference train with (worker.py)
STOP_GRACE_S = 5.0  # SIGTERM to the job's process group, then SIGKILL after this long
# CPU ranks keep the memory they free for their next allocations, as PyTorch's caching allocator does on a GPU:
# glibc would otherwise return every buffer of 32 MiB or more to the OS (mmap) and fault its pages in again on the
# next step (1.6 against 13 GB/s writing 100 MB on this project's host), a cost FSDP2 on a GPU never pays and the
# step-time model does not carry. No effect outside glibc; a GLIBC_TUNABLES the user set is kept.
KEEP_FREED_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


def stop_process_group(proc: subprocess.Popen | Forked, grace: float = STOP_GRACE_S) -> None:
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
    """The torchrun job's counts, losses and parity against the prediction; ``ok`` when every check holds."""

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
    tolerance: float = FP32_TOLERANCE  # of fp32 training; in 16 bits (params or compute): ``worker.allowed_diff``
    precision: str = "fp32"  # what the job trained in (``PRECISIONS``)
    bound: str = ""  # the 16-bit dtype the parity bound comes from ("" : fp32's ``tolerance``)
    param_error: float | None = None  # the worst param's difference over what its dtype allows (above 1 fails)
    worst_param: str = ""
    replica_diff: float | None = None  # with TP: the ranks' copies of a gathered param, their largest spread
    replica_error: float = 0.0  # ... the worst param's over what it may be (``worker.REPLICA_ULPS``; above 1 fails)
    replica_param: str = ""
    notes: list[str] = field(default_factory=list)
    start_step: int = 0
    loaded: dict[str, Any] | None = None  # the checkpoint it started from: step, world, policy, tensors, mismatched
    saved: str | None = None  # the checkpoint directory it wrote
    units: list[str] | None = None  # FSDP1 (``fsdp1=True``): the modules it wrapped, as the plan's groups name them
    expected_units: list[str] | None = None
    step_seconds: list[float] = field(default_factory=list)  # the timed steps' forward + backward on rank 0
    predicted_step: float | None = None  # the simulator's step on the cluster verify was given (--cluster)

    @property
    def measured_step(self) -> float | None:
        """The median timed step; None when none was timed."""
        return statistics.median(self.step_seconds) if self.step_seconds else None

    @property
    def step_error(self) -> float | None:
        """predicted / measured - 1."""
        if self.predicted_step is None or not self.measured_step:
            return None
        return self.predicted_step / self.measured_step - 1

    @property
    def checkpoint_match(self) -> bool:
        """The state restored from the checkpoint is the saved one, tensor for tensor (true when none was loaded)."""
        return self.loaded is None or not self.loaded["mismatched"]

    @property
    def units_match(self) -> bool:
        return self.units is None or sorted(self.units) == sorted(self.expected_units or [])

    @property
    def params_match(self) -> bool:
        if self.param_error is not None:
            return self.param_error <= 1.0
        return self.max_abs_diff <= self.tolerance

    @property
    def replicas_match(self) -> bool:
        """Every rank holds the same params (checked with TP, where a param whole on each TP rank may drift)."""
        return self.replica_diff is None or self.replica_error <= 1.0

    @property
    def counts_match(self) -> bool:
        return all(c == self.predicted for c in self.counted)

    @property
    def bytes_match(self) -> bool:
        return all(b == self.predicted_bytes for b in self.counted_bytes)

    @property
    def ok(self) -> bool:
        return (self.params_match and self.replicas_match and self.counts_match and self.bytes_match
                and self.checkpoint_match and self.units_match)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "params_match": self.params_match, "replicas_match": self.replicas_match,
                "counts_match": self.counts_match,
                "bytes_match": self.bytes_match, "checkpoint_match": self.checkpoint_match,
                "units_match": self.units_match, "measured_step": self.measured_step, "step_error": self.step_error,
                "ok": self.ok}


def micro_batch_all_gathers(trace: Trace, plan: Plan, world_size: int, micro_batches: int,
                            reshard_after_backward: bool, precision: Precision | None = None) -> tuple[int, int]:
    """The all-gathers (and their bytes) of a step of ``micro_batches``: each micro-batch's, fewer where
    ``set_reshard_after_backward(False)`` keeps the groups gathered from one micro-batch into the next."""
    ag = CollectiveKind.ALL_GATHER.value
    runs = [(Kept.NONE, micro_batches)] if reshard_after_backward else \
        [(Kept.FIRST, 1), (Kept.MIDDLE, micro_batches - 2), (Kept.LAST, 1)]
    counted = [(k, predict_collectives(trace, plan, world_size, precision, kept)) for kept, k in runs]
    return sum(k * c[ag] for k, (c, _) in counted), sum(k * b[ag] for k, (_, b) in counted)


def predict_collectives(trace: Trace, plan: Plan, world_size: int, precision: Precision | None = None,
                        kept: Kept = Kept.NONE, accumulated: bool = False) -> tuple[Counts, Counts]:
    """Per-step all-gather / reduce-scatter (HSDP: all-reduce) counts, and their bytes as FSDP2 sends them (padded;
    in ``precision``'s dtypes, the params' own without one); ``kept``: of a micro-batch under
    ``set_reshard_after_backward(False)``; ``accumulated``: of the micro-batch syncing what others accumulated.
    FSDP2 issues no all-gather or reduce-scatter over a shard group of one rank (with EP, the experts' groups are
    over shard / EP ranks)."""
    shard = plan.shard_size(world_size)
    # the plan's shard dims (no padding off dim 0) and reduce dtype (what the worker applies: apply_plan)
    reduce = ReduceDtype(plan.reduce_dtype) if plan.reduce_dtype else None
    own = REDUCE_BYTES[reduce] if reduce and precision is None else None  # over the params' own dtypes
    f8 = plan.float8  # the weights FSDP2 all-gathers in float8 (sim/float8.py)
    gathered = frozenset(converted_linears(trace, f8).values()) if f8 is not None and f8.fsdp_float8_all_gather \
        else frozenset()
    sizing = Sizing(trace, shard, with_reduce_dtype(precision, reduce) if precision is not None else None,
                    dims=plan.shard_dims, reduce_itemsize=own, float8_gathered=gathered)
    groups, group_params = sizing.groups(plan), sizing.group_params(plan)
    ranks = param_shards(trace, shard)  # an EP view's experts: over shard / EP ranks
    counts = dict.fromkeys((k.value for k in CollectiveKind), 0)
    nbytes = dict.fromkeys((k.value for k in CollectiveKind), 0)
    for c in build_schedule(trace, plan, world_size, kept=kept, accumulated=accumulated).collectives:
        params = group_params[c.group] if c.kind is CollectiveKind.ALL_GATHER else c.params
        if c.kind is not CollectiveKind.ALL_REDUCE and max((ranks[i] for i in params), default=shard) == 1:
            continue
        counts[c.kind.value] += 1
        if c.kind is CollectiveKind.ALL_GATHER:
            nbytes[c.kind.value] += groups[c.group].gather_bytes
        elif c.kind is CollectiveKind.REDUCE_SCATTER:
            nbytes[c.kind.value] += sizing.reduce_bytes(c.params)
        else:  # the reduce-scatter's output: over the group's own shard ranks (an EP view's experts: shard / EP)
            nbytes[c.kind.value] += sizing.reduce_bytes(c.params) // (ranks[c.params[0]] if c.params else shard)
    return counts, nbytes


def check_save_dir(directory: Path) -> None:
    """A checkpoint goes to a new (or empty) directory: never mixed with, or over, other files."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise PlannerError(f"--save-checkpoint '{directory}' already exists and is not an empty directory: give a "
                           "new one")
    if not directory.parent.is_dir():
        raise PlannerError(f"--save-checkpoint '{directory}': its parent directory does not exist"
                           f"{' (a file of that name does)' if directory.parent.exists() else ''}")


def check_load_dir(directory: Path, fingerprint: str) -> dict[str, Any]:
    """The checkpoint's metadata, once it is known to be one verify wrote for this model."""
    if not directory.is_dir():  # (said as "no fsdp-planner.json in it" before: a trial)
        raise PlannerError(f"--load-checkpoint '{directory}' " + ("is a file, not a checkpoint directory written by "
                           "verify --save-checkpoint" if directory.exists() else "does not exist"))
    if not (directory / META).is_file():
        raise PlannerError(f"--load-checkpoint '{directory}' is not a checkpoint written by verify --save-checkpoint "
                           f"(no {META} in it)")
    try:
        meta = read_meta(directory)
        step, saved_from = int(meta["step"]), str(meta["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PlannerError(f"--load-checkpoint '{directory}': its {META} cannot be read ({e})") from None
    check_checkpoint_format(directory)
    if fingerprint and saved_from != fingerprint:
        raise PlannerError(f"--load-checkpoint '{directory}' was saved from another model (parameter names, shapes "
                           "or dtypes differ)")
    return {**meta, "step": step}


def check_checkpoint_format(directory: Path) -> None:
    """Refuse a directory that is plainly not a checkpoint of this format, or whose DCP metadata names anything
    but DCP's classes, before any rank starts. (``read_meta`` has checked the format version.)"""
    missing = [name for name in (DCP_METADATA, REFERENCE) if not (directory / name).is_file()]
    if missing:
        raise PlannerError(f"--load-checkpoint '{directory}' is incomplete: {' and '.join(missing)} missing")
    check_metadata(directory, f"--load-checkpoint '{directory}'")


@contextmanager
def staged(directory: Path | None) -> Iterator[Path | None]:
    """A fresh directory beside ``directory`` for the job to write into; the caller renames it into place once
    the job succeeded, and whatever is left (a failed or interrupted job's half checkpoint) is removed."""
    if directory is None:
        yield None
        return
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
    except OSError as e:  # a read-only or special file system: before any rank starts
        raise PlannerError(f"--save-checkpoint '{directory}': cannot write in {directory.parent} "
                           f"({e.strerror or e})") from None
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # mkdtemp's 0700 is for secrets; a checkpoint gets what mkdir would give it
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


OWNER_FILE = "owner"  # in a job's temp directory: the pid of the command that made it


def remove_orphaned_job_dirs(prefix: str) -> None:
    """Temp directories of jobs whose command was killed by SIGKILL (its handlers never ran; ``launch`` ended the
    job itself): removed by the next job, once their owner is gone."""
    for directory in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            owner = int((directory / OWNER_FILE).read_text())
            os.kill(owner, 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except (OSError, ValueError):
            continue  # not ours to judge: unreadable, another user's, or still being written


def run_torchrun(module: str, nproc: int, timeout: float, what: str, job: dict[str, Any]) -> tuple[dict, int]:
    """``python -m MODULE JOB.json`` on ``nproc`` local ranks under torchrun (``launch.py``), in its own session,
    ended as a whole on every way out (call it inside ``signals_raise``). ``job`` gains ``result``, the file rank 0
    writes; returns what it wrote and torchrun's exit status. A job that wrote nothing is a ``PlannerError`` naming
    the rank that failed and why (``failures.py``)."""
    prefix = f"fsdp-planner-{what.split()[0]}-"  # fsdp-planner-verify-..., fsdp-planner-calibration-...
    remove_orphaned_job_dirs(prefix)
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as tmp:
        job_path, result_path, exits_path = Path(tmp) / "job.json", Path(tmp) / "result.json", Path(tmp) / "exits"
        (Path(tmp) / OWNER_FILE).write_text(str(os.getpid()))
        job_path.write_text(json.dumps({**job, "result": str(result_path)}))
        # PYTHONSAFEPATH: ``python -m`` puts no working directory first on the launcher's and ranks' path, where a
        # user's numpy.py beside their model would shadow numpy before torch loads (the launcher died of SIGSEGV);
        # a rank puts the model file's folder on its path itself, once torch is imported (``resolve_factory``)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", KEEP_FREED_MEMORY), PARENT_ENV: str(os.getpid()),
               "PYTHONSAFEPATH": "1"}
        # torchrun's per-rank error files go under the job's directory too (by default a torchelastic_* temp dir
        # that it never removes)
        cmd = [sys.executable, "-u", "-m", "fsdp_planner.runtime.launch", str(exits_path), module, str(job_path),
               "--standalone", f"--nproc_per_node={nproc}", f"--log-dir={Path(tmp) / 'torchrun'}"]
        # Its own session: the job's processes are one group to kill on every way out, and Ctrl-C in a terminal
        # reaches only this process (which then stops them) instead of racing torchrun's own handling.
        proc = start_launcher(cmd, env)  # Popen, or forked from a zygote where ranks are forked (``zygote.py``)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise PlannerError(f"{what} did not finish within {timeout:.0f} s (stopped)") from None
        finally:
            stop_process_group(proc)  # also after a normal exit: no rank outlives the job
        killed = launcher_killed(proc.returncode, what)
        if killed is not None:  # even after rank 0 wrote the result: a job nobody supervised to its end
            raise PlannerError(killed)
        data = read_result(result_path)
        if data is None:
            message = explain(read_failures(result_path, exits_path), what)
            raise PlannerError(message or unexplained(proc.returncode, stdout + stderr, what))
        return data, proc.returncode


def read_result(path: Path) -> dict[str, Any] | None:
    """What rank 0 wrote; None when it wrote nothing whole (none at all, or it was killed while writing)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class JobSteps:
    """How the job's ranks train: ``run_verify``'s arguments of that name."""

    steps: int = 3
    lr: float = 0.05
    seed: int = 0
    timed_steps: int = 0
    micro_batches: int = 1
    reshard_after_backward: bool = True
    gradient_sync: GradientSync = GradientSync.LAST


@dataclass(frozen=True)
class VerifyJob:
    """What the torchrun job runs, checked and resolved (``prepare_job``): the model (a file's path made absolute,
    for ranks that start elsewhere), the plan, how it trains and its checkpoints."""

    model: ModelSpec
    plan: Plan
    nproc: int
    precision: Precision  # what it trains in (``job_precision``)
    fsdp1: bool
    timeout: float
    train: JobSteps
    save: Path | None = None  # resolved --save-checkpoint, checked to be new or empty
    load: Path | None = None  # resolved --load-checkpoint, checked to be one of this model
    start_step: int = 0  # the loaded checkpoint's step
    profile: Path | None = None  # --profile: each rank writes a torch.profiler trace of its steps here

    @property
    def worker(self) -> str:
        return f"fsdp_planner.runtime.{'fsdp1_worker' if self.fsdp1 else 'worker'}"

    def to_json(self, stage: Path | None) -> dict[str, Any]:
        """The job file the ranks read (``worker.build_job``); a checkpoint is written into ``stage``."""
        train = self.train
        return {"model": self.model.to_json(), "plan": self.plan.to_json(), "steps": train.steps, "lr": train.lr,
                "seed": train.seed, "timed_steps": train.timed_steps, "precision": self.precision.name,
                "micro_batches": train.micro_batches, "reshard_after_backward": train.reshard_after_backward,
                "gradient_sync": train.gradient_sync.value, "start_step": self.start_step,
                "load": str(self.load) if self.load else None, "save": str(stage) if stage else None,
                "profile": str(self.profile) if self.profile else None}


def run_verify(model: ModelSpec | str, trace: Trace, plan: Plan, nproc: int, steps: int = 3, lr: float = 0.05,
               seed: int = 0, timeout: float = 600.0, save_checkpoint: Path | None = None,
               load_checkpoint: Path | None = None, fsdp1: bool = False, timed_steps: int = 0,
               precision: Precision | str | None = None, micro_batches: int = 1,
               reshard_after_backward: bool = True,
               gradient_sync: GradientSync = GradientSync.LAST, profile: Path | None = None) -> VerifyResult:
    """Launch the torchrun job and compare its results with the plan's predictions; optionally start from a
    checkpoint (any world size and plan) and save one. ``precision``: what FSDP2 trains in (its
    ``MixedPrecisionPolicy``; default the command line's, as ``plan`` assumes); ``fsdp1``: run the plan as FSDP1
    ``FullyShardedDataParallel`` units in fp32 (``fsdp1_worker.py``; no checkpoints). ``timed_steps``: then time
    that many steps of the sharded model alone (``worker.time_steps``; FSDP2 only). ``micro_batches``: each step
    that many forward + backward passes of ``model``'s batch, gradient sync on the last only (FSDP2 only), or on
    each with ``gradient_sync`` EVERY;
    ``reshard_after_backward`` False: params kept gathered between them (``set_reshard_after_backward``).
    ``profile``: a directory each rank writes ``rankR.json`` into, a torch.profiler trace of a few more steps
    (``worker.profile_steps``; FSDP2 only), which ``calibrate --trace`` reads, and ``rankR.cpu.json``, those steps'
    wall and CPU seconds."""
    if micro_batches > 1 and fsdp1:
        raise PlannerError("--micro-batches runs FSDP2's set_requires_gradient_sync: not with --fsdp1")
    job = VerifyJob(as_spec(model), plan, nproc, job_precision(precision, fsdp1), fsdp1, timeout,
                    JobSteps(steps, lr, seed, timed_steps, micro_batches, reshard_after_backward, gradient_sync),
                    profile=_profile_dir(profile, fsdp1))
    job = prepare_job(job, save_checkpoint, load_checkpoint)
    check_on_meta(job, trace)
    predicted, predicted_bytes = predict_job(job, trace)
    data, returncode = launch_job(job)
    return job_result(job, data, returncode, predicted, predicted_bytes)


def _profile_dir(directory: Path | None, fsdp1: bool) -> Path | None:
    """``--profile DIR`` made absolute (ranks may start elsewhere) and created; FSDP2 jobs only."""
    if directory is None:
        return None
    if fsdp1:
        raise PlannerError("--profile traces FSDP2's steps: not with --fsdp1")
    directory = directory.resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlannerError(f"--profile: cannot make the directory {directory}: {e.strerror}") from None
    return directory


def prepare_job(job: VerifyJob, save_checkpoint: Path | None, load_checkpoint: Path | None) -> VerifyJob:
    """``job`` checked (its sizes, a trainable model) with its model file's path made absolute and its checkpoint
    directories resolved and checked."""
    spec = job.model.name
    if job.nproc < 1:
        raise PlannerError("--nproc must be at least 1")
    if job.train.steps < 1:
        raise PlannerError("--steps must be at least 1")
    if planning_only(spec):
        raise PlannerError(f"'{spec}' is for planning only (too large to train here); verify a trainable model")
    model = job.model
    if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
        path, _, fn = spec.rpartition(":")
        model = dataclasses.replace(model, name=f"{Path(path).resolve()}:{fn}")
    save = save_checkpoint.resolve() if save_checkpoint is not None else None
    load = load_checkpoint.resolve() if load_checkpoint is not None else None
    if save is not None:
        check_save_dir(save)
    start_step = check_load_dir(load, job.plan.fingerprint)["step"] if load is not None else 0
    return dataclasses.replace(job, model=model, save=save, load=load, start_step=start_step)


def check_model_dtypes(spec: ModelSpec, precision: Precision) -> None:
    """Refuse a precision the model's params cannot train in (FSDP2 keeps the sharded params in the dtype they are
    built in), from the model built on meta: before it is traced, a plan searched or any rank started."""
    model = load_model(spec, meta=True).model
    check_param_dtypes(precision, built_dtypes(model))
    check_complex_params(precision, model)


HOST_SHARE = 0.8  # of the host's available memory a job's ranks may need (the launcher, the command and others run)
RANK_COPIES = 4  # what each CPU rank holds of the whole model at least: the model it builds, the unsharded
# reference, the reference's grads and its optimizer's momentum (its own sharded state and activations come on top)


def check_host_memory(job: VerifyJob, trace: Trace) -> None:
    """Refuse a job whose CPU ranks cannot hold what each builds (``RANK_COPIES`` of the model's params) in the
    host's available memory, before any rank starts: the out-of-memory killer ended one after 98 s (a 2.1B-param
    config on 2 ranks of a 23 GB host), and it may take another process of the host's with it."""
    if torch.cuda.is_available():  # (a GPU rank holds the reference on its GPU)
        return
    need = job.nproc * RANK_COPIES * trace.nbytes
    free = host_memory("MemAvailable", "SC_AVPHYS_PAGES")
    if need > HOST_SHARE * free:
        raise PlannerError(f"verify runs {job.nproc} CPU ranks that each build the model and an unsharded "
                           f"reference ({fmt_bytes(trace.nbytes)} of params; with the reference's grads and "
                           f"momentum about {fmt_bytes(RANK_COPIES * trace.nbytes)} a rank), and this host has "
                           f"{fmt_bytes(free)} available: verify a smaller config of the model (the plan's groups "
                           "follow its structure) or fewer --nproc")


def check_on_meta(job: VerifyJob, trace: Trace) -> None:
    """What can be refused before any rank starts: forward methods the plan names, params' dtypes the precision
    cannot train."""
    if job.plan.forward_methods:
        check_forward_methods(job.plan, load_model(job.model, meta=True).model)
    check_param_dtypes(job.precision, {p.dtype for p in trace.params if p.is_floating_point and p.requires_grad})
    check_host_memory(job, trace)
    f8 = job.plan.float8
    if f8 is not None and f8.tp_float8_all_gather and job.plan.tensor_parallel is not None \
            and not torch.cuda.is_available():
        raise PlannerError("gloo cannot all-gather float8 tensors, which torchao's float8 TP styles do (the ranks "
                           "raise 'Invalid scalar type'): check this plan on the fake process group "
                           "(--fake-world-size N) or on GPUs, where NCCL runs it")


def predict_job(job: VerifyJob, trace: Trace) -> tuple[Counts, Counts]:
    """The collectives (counts, bytes) each step of the job should issue: FSDP1's or FSDP2's; with micro-batches,
    the gradient collectives in the last backward only (or in each, EVERY) and the all-gathers of each."""
    plan, nproc, trained = job.plan, job.nproc, job.precision
    if job.fsdp1:
        return predict_fsdp1(trace, plan, nproc)
    trace, plan, nproc = data_parallel_view(trace, plan, nproc)
    predicted, predicted_bytes = predict_collectives(trace, plan, nproc, trained)
    micro = job.train.micro_batches
    if micro > 1:
        if job.train.gradient_sync is GradientSync.EVERY:
            predicted = {k: v * micro for k, v in predicted.items()}
            predicted_bytes = {k: v * micro for k, v in predicted_bytes.items()}
        else:  # the last micro-batch syncs what the others accumulated (``build_schedule(accumulated=True)``)
            kept = Kept.NONE if job.train.reshard_after_backward else Kept.LAST
            last, last_bytes = predict_collectives(trace, plan, nproc, trained, kept, accumulated=True)
            for kind in (CollectiveKind.REDUCE_SCATTER.value, CollectiveKind.ALL_REDUCE.value):
                predicted[kind], predicted_bytes[kind] = last[kind], last_bytes[kind]
        ag = CollectiveKind.ALL_GATHER.value
        predicted[ag], predicted_bytes[ag] = micro_batch_all_gathers(trace, plan, nproc, micro,
                                                                     job.train.reshard_after_backward, trained)
    return predicted, predicted_bytes


def data_parallel_view(trace: Trace, plan: Plan, nproc: int) -> tuple[Trace, Plan, int]:
    """What FSDP2 shards on ``nproc`` ranks: the plan's TP-local params (one TP rank's view, ``tp_view``) on its
    data-parallel mesh of ``nproc`` / TP ranks; with EP, one EP rank's view (``ep_view``: its E / EP experts,
    FSDP-sharded over nproc / EP ranks; with both, the EP view of the TP view); else the trace and plan as given."""
    if plan.tensor_parallel is None:
        return (ep_view(trace, plan).trace if plan.expert_parallel is not None else trace), plan, nproc
    check_plan_world_size(plan, nproc)
    # the job's ranks as one node: the view's sizes do not depend on the cluster, only its checks that TP fits in one
    view = tp_view(trace, plan.tensor_parallel, preset_cluster("h100", gpus_per_node=nproc), plan.float8)
    dp_plan = view.plan(plan)
    on = ep_view(view.trace, dp_plan).trace if plan.expert_parallel is not None else view.trace
    return on, dp_plan, nproc // plan.tp_degree


def launch_job(job: VerifyJob) -> tuple[dict[str, Any], int]:
    """Run the job under torchrun (``run_torchrun``); its checkpoint, when asked for, renamed into place only once
    the job succeeded. What rank 0 wrote and torchrun's exit status."""
    with signals_raise(), staged(job.save) as stage:
        data, returncode = run_torchrun(job.worker, job.nproc, job.timeout, "verify job", job.to_json(stage))
        if job.save is not None and stage is not None:
            os.replace(stage, job.save)  # whole or not at all: a failed job leaves no half checkpoint under that name
    return data, returncode


def job_result(job: VerifyJob, data: dict[str, Any], returncode: int, predicted: Counts,
               predicted_bytes: Counts) -> VerifyResult:
    """What the ranks measured beside what was predicted."""
    notes = []
    if returncode != 0:
        notes.append(f"torchrun exited {returncode} after the results were written (exit noise ignored)")
    tp = job.plan.tensor_parallel
    if tp is not None and tp.async_tp and not async_tp_runs("cuda" if data["backend"] == "nccl" else "cpu"):
        notes.append(f"async TP needs CUDA's symmetric memory: these {data['backend']} ranks ran the plan's TP "
                     "synchronous (its collectives and parity are the same; on NCCL ranks apply_plan switches it "
                     "on, as torchtitan does)")
    if data.get("params_changed") == 0:
        notes.append(f"no param changed in the {job.train.steps} steps (every gradient zero, or a learning rate of "
                     "0): the parity check holds whatever the plan does, and proves nothing of it")
    return VerifyResult(
        world_size=data["world"], steps=job.train.steps, backend=data["backend"], predicted=predicted,
        counted=data["counted"], counted_bytes=data["counted_bytes"], predicted_bytes=predicted_bytes,
        losses=data["losses"], reference_losses=data["reference_losses"], max_abs_diff=data["max_abs_diff"],
        param_error=data.get("param_error"), worst_param=data.get("worst_param", ""), precision=job.precision.name,
        replica_diff=data.get("replica_diff"), replica_error=data.get("replica_error", 0.0),
        replica_param=data.get("replica_param", ""),
        bound=data.get("bound", ""),
        notes=notes, start_step=job.start_step, loaded=data.get("loaded"), saved=str(job.save) if job.save else None,
        units=data.get("units"), step_seconds=data.get("step_seconds", []),
        expected_units=[g.modules[0] for g in job.plan.inner_groups] + [""] if job.fsdp1 else None)


def job_precision(precision: Precision | str | None, fsdp1: bool) -> Precision:
    """What the job trains in: FSDP2 under the precision asked for (default the command line's); FSDP1 in fp32
    only (its own MixedPrecision is not run)."""
    if fsdp1:
        if precision is not None and resolve_precision(precision).name != "fp32":
            raise PlannerError("--fsdp1 trains in fp32 (FSDP1's MixedPrecision is not run): drop --precision or pass "
                               "--precision fp32")
        return PRECISIONS["fp32"]
    resolved = resolve_precision(precision if precision is not None else DEFAULT_PRECISION)
    check_precision(resolved)
    return resolved


def predict_fsdp1(trace: Trace, plan: Plan, world_size: int) -> tuple[Counts, Counts]:
    """Per-step FSDP1 all-gather / reduce-scatter counts and bytes (``fsdp1_collectives``): one flat parameter per
    unit, so other bytes than FSDP2's; none on one rank."""
    kinds = [] if world_size == 1 else [(c.kind.value, c.group) for c in fsdp1_collectives(trace, plan, world_size)]
    counts = dict.fromkeys((k.value for k in CollectiveKind), 0)
    for kind, _ in kinds:
        counts[kind] += 1
    return counts, {**dict.fromkeys(counts, 0), **fsdp1_collective_bytes(trace, plan, world_size, kinds)}
