"""Why a torchrun job failed, told from what its ranks left: each rank's exception (``rank.py`` writes it with
``write_failure``, JSON beside the result) and each rank's exit status (``launch.py`` records torchrun's).

One rank's failure takes the others down with it: a rank that dies mid-step leaves its peers' collectives with a
closed connection (gloo raises "Connection reset by peer"), and torchrun then stops every rank still running with
SIGTERM. So the cause is told apart from its echoes: a rank that raised an exception of its own, or died of a
signal torchrun did not send, is a cause; a collective that failed in the backend, or a SIGTERM, is an echo.
"""

from __future__ import annotations

import json
import re
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

ERROR_SUFFIX = ".error"  # a rank writes RESULT.rankN.error; the launcher writes EXITS
STACK_SUFFIX = ".stack"  # RESULT.rankN.stack: the rank's Python stacks, written on torchrun's SIGTERM
MAX_STACK_BYTES = 1 << 20
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')
MAX_MESSAGE = 300
MAX_FRAMES = 3
# wrappers in every module call, every collective and every context manager, telling nothing of where it failed
NOISE_FRAMES = ("torch/nn/modules/module.py", "torch/distributed/c10d_logger.py", "/contextlib.py")


class EarlyExit(BaseException):
    """The model's code called ``os._exit(0)`` inside a rank's work (``rank.failing_exit``)."""


@dataclass(frozen=True)
class RankFailure:
    rank: int
    error: str | None = None  # "Type: message" when the rank raised
    frames: tuple[str, ...] = ()  # innermost first: "file.py:12 in fn"
    backend: bool = False  # raised by the communication backend: a peer went away or a collective timed out
    exitcode: int | None = None  # torchrun's record; negative: killed by that signal
    stopped_at: tuple[str, ...] = ()  # where torchrun's SIGTERM found it, innermost first (``rank.stacks_on_sigterm``)
    waiting: bool = False  # stopped inside torch.distributed (a collective, FSDP's hooks): likely waiting on a peer

    @property
    def stopped_by_launcher(self) -> bool:
        """Ended by torchrun's SIGTERM after another rank failed (what it sends every rank still running)."""
        return self.error is None and self.exitcode == -signal.SIGTERM

    @property
    def is_cause(self) -> bool:
        if self.error is not None:
            return not self.backend
        return self.exitcode not in (None, 0) and not self.stopped_by_launcher

    def describe(self) -> str:
        if self.error is not None:
            where = f" (at {'; '.join(self.frames)})" if self.frames else ""
            verb = "failed in a collective:" if self.backend else "raised"
            return f"rank {self.rank} {verb} {self.error}{where}"
        if self.exitcode is not None and self.exitcode < 0:
            name = _signal_name(-self.exitcode)
            if self.stopped_by_launcher:
                return f"rank {self.rank} was stopped by torchrun ({name})"
            if -self.exitcode in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE):
                return (f"rank {self.rank} was killed by {name} (it raised no exception: a native crash in torch or "
                        "a library it calls, such as gloo given different buffer sizes on different ranks by a "
                        "model whose shapes depend on the data)")
            return (f"rank {self.rank} was killed by {name} (it raised no exception: killed from outside, or by the "
                    "out-of-memory killer)")
        return f"rank {self.rank} exited with status {self.exitcode} without raising an exception"


# signals a process gets from its own fault (a segfault, an abort), not from another process
CRASHES = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def error_file(result_path: Path, rank: int) -> Path:
    """Where ``rank`` leaves its exception: beside the result, one file per rank (``read_failures`` finds them)."""
    return result_path.with_name(f"{result_path.name}.rank{rank}{ERROR_SUFFIX}")


def stack_file(result_path: Path, rank: int) -> Path:
    """Where ``rank`` leaves its stacks when torchrun stops it (``rank.stacks_on_sigterm``)."""
    return result_path.with_name(f"{result_path.name}.rank{rank}{STACK_SUFFIX}")


def stopped_at(path: Path) -> tuple[tuple[str, ...], bool]:
    """The innermost frames of the rank's main thread (the one running ``run_rank``) in the stacks ``faulthandler``
    wrote to ``path``, and whether the innermost is torch.distributed's (a collective's wait, FSDP's hooks: a peer
    the rank waited for, more likely than the rank itself, is where the job stopped); none when it wrote none (the
    rank was not stopped by SIGTERM)."""
    try:
        with path.open(errors="replace") as f:
            text = f.read(MAX_STACK_BYTES)
    except OSError:
        return (), False
    threads = [[m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
               for block in re.split(r"^(?:Current thread|Thread) 0x", text, flags=re.M)]
    main = next((t for t in threads if any(fn == "run_rank" for _, _, fn in t)), None) or \
        next((t for t in threads if t), [])
    kept = [(file, line, fn) for file, line, fn in main if not file.endswith(NOISE_FRAMES)]
    waiting = bool(kept) and "/torch/distributed/" in kept[0][0].replace("\\", "/")
    return tuple(f"{Path(file).name}:{line} in {fn}" for file, line, fn in kept)[:MAX_FRAMES], waiting


def write_failure(result_path: Path, rank: int, e: BaseException) -> None:
    """Leave the rank's exception where the launcher reads it: torchrun's summary drops the rank's traceback."""
    error_file(result_path, rank).write_text(json.dumps(describe_exception(e)))


def read_failures(result_path: Path, exits_path: Path) -> list[RankFailure]:
    """Every rank that raised or ended badly, in rank order."""
    raised: dict[int, dict] = {}
    for path in result_path.parent.glob(f"{result_path.name}.rank*{ERROR_SUFFIX}"):
        rank = int(path.name[len(result_path.name) + len(".rank"):-len(ERROR_SUFFIX)])
        try:
            raised[rank] = json.loads(path.read_text())
        except (OSError, ValueError):  # killed while writing it: its exit status still tells
            continue
    exits: dict[int, int] = {}
    if exits_path.is_file():
        exits = {int(r): int(code) for r, code in json.loads(exits_path.read_text()).items()}
    stopped: dict[int, tuple[tuple[str, ...], bool]] = {}  # torchrun's summary may leave out a rank it stopped
    for path in result_path.parent.glob(f"{result_path.name}.rank*{STACK_SUFFIX}"):
        at, waiting = stopped_at(path)
        if at:
            stopped[int(path.name[len(result_path.name) + len(".rank"):-len(STACK_SUFFIX)])] = at, waiting
    failures = []
    for rank in sorted(set(raised) | set(stopped) | {r for r, code in exits.items() if code != 0}):
        info = raised.get(rank, {})
        exitcode = exits.get(rank, -signal.SIGTERM if rank in stopped and rank not in raised else None)
        failures.append(RankFailure(rank, info.get("error"), tuple(info.get("frames", ())),
                                    bool(info.get("backend")), exitcode, *stopped.get(rank, ((), False))))
    return failures


def explain(failures: list[RankFailure], what: str = "verify job") -> str | None:
    """The cause on the first line, then the other failing ranks' lines; None when no rank left a trace."""
    if not failures:
        return None
    causes = [f for f in failures if f.is_cause] or [f for f in failures if f.error is not None] or failures
    echoes = [f for f in failures if f not in causes and not f.stopped_by_launcher]
    stopped = [f for f in failures if f not in causes and f.stopped_by_launcher]
    # where the backend failed alone (a collective timed out), a rank still running is one its peers waited for:
    # where it was leads the first line (the only one a command shows), a rank stopped outside torch.distributed
    # (in the model's code, a loader) before one stopped waiting in a collective
    suspects = sorted((f for f in stopped if f.stopped_at and not any(c.is_cause for c in causes)),
                      key=lambda f: (f.waiting, f.rank))
    first = f"rank {suspects[0].rank} was still at {'; '.join(suspects[0].stopped_at)} when " if suspects else ""
    lines = [f"{what} failed: {first}{'; '.join(_grouped(causes))}"]
    lines += [f"  then {f.describe()}" for f in echoes]
    lines += [f"  rank {f.rank} was still at {'; '.join(f.stopped_at)}" for f in suspects[1:]]
    if stopped:
        ranks = [f.rank for f in stopped]
        lines.append(f"  then torchrun stopped rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                     "(SIGTERM)")
    return "\n".join(lines)


def launcher_killed(returncode: int, what: str = "verify job") -> str | None:
    """The job's failure when its torchrun launcher was killed by a signal from outside (the command stops it only
    after reading its status): its ranks died with it (``rank.follow_launcher``), so nothing they wrote is a
    finished job's. None when the launcher exited."""
    if returncode >= 0:
        return None
    if -returncode in CRASHES:  # the process's own fault, not a signal sent to it
        return (f"{what} failed: its torchrun launcher crashed ({_signal_name(-returncode)}), and its ranks were "
                "stopped with it (a module of the working directory or the model's folder that shadows one torch "
                "imports, such as numpy.py, can do this)")
    return (f"{what} failed: its torchrun launcher was killed by {_signal_name(-returncode)} (from outside the "
            "job), and its ranks were stopped with it")


def unexplained(returncode: int, output: str, what: str = "verify job") -> str:
    """A job with no result that left no cause (no rank raised or died: they all exited 0 without rank 0's result,
    or torchrun failed before it started them): one line, with the last line the job printed as a clue."""
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    clue = f"; its last output: {last[:MAX_MESSAGE]}" if last else ""
    return f"{what} failed: no result, and no rank raised or died (torchrun exited with status {returncode}){clue}"


def _grouped(failures: list[RankFailure]) -> list[str]:
    """One phrase per distinct failure: "ranks 0, 1 raised X" rather than the same line per rank."""
    ranks: dict[str, list[int]] = {}
    for f in failures:
        ranks.setdefault(f.describe().partition(" ")[2].partition(" ")[2], []).append(f.rank)
    return [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {_plural(what) if len(rs) > 1 else what}"
            for what, rs in ranks.items()]


def _plural(phrase: str) -> str:
    """A rank's phrase said of several ranks ("was killed" -> "were killed")."""
    return "were" + phrase[3:] if phrase.startswith("was ") else phrase


def checkpoint_cause(e: BaseException) -> BaseException:
    """What DCP's ``CheckpointException`` (a BaseException, not an Exception) wraps: the exception of the lowest
    rank that failed, with its own message (DCP's is every rank's traceback); any other exception is its own."""
    if isinstance(e, CheckpointException) and e.failures:
        return e.failures[min(e.failures)][0]
    return e


def is_backend_error(e: BaseException) -> bool:
    """Raised by the communication backend (gloo's errors name their source; NCCL's are ``DistError``): a peer
    went away or a collective timed out."""
    return isinstance(e, dist.DistError) or "/gloo/" in str(e)


def describe_exception(e: BaseException) -> dict:
    """What a rank writes when it raises: ``Type: message``, its innermost frames, and whether the communication
    backend raised it (``is_backend_error``)."""
    frames = [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.endswith(NOISE_FRAMES)][::-1][:MAX_FRAMES]
    if isinstance(e, EarlyExit):
        return {"error": "os._exit(0): the model's code ended the process before the rank's work was done",
                "frames": [], "backend": False}
    if isinstance(e, SystemExit):
        code = "" if e.code is None else repr(e.code)
        return {"error": f"SystemExit: the model's code called sys.exit({code})", "frames": frames,
                "backend": False}
    cause = checkpoint_cause(e)
    prefix = "" if cause is e else f"{type(e).__name__}: "  # DCP's wrapper, then what it wraps
    message = " ".join(str(cause).split())
    backend = is_backend_error(cause)
    if backend:  # gloo's source path and generic advice say nothing about what happened
        message = re.sub(r"^\[[^\]]*\]\s*", "", message).split(". This is typically caused")[0]
    error = f"{prefix}{type(cause).__name__}{': ' + message if message else ''}"
    return {"error": error[:MAX_MESSAGE], "frames": frames, "backend": backend}
