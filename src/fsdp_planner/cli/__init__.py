"""Command line: ``fsdp-planner demo | plan | fit | simulate | verify | check | export | cost | calibrate | memory |
models``.

Every user error is one line on stderr and exit code 2; never a traceback (set FSDP_PLANNER_DEBUG=1 to see one).
Bad arguments are one line too: ``error: MESSAGE (see fsdp-planner COMMAND --help)``. When the reader of stdout goes
away (``fsdp-planner models | head -1``) the command stops quietly with exit status 141, what a shell reports for a
program killed by SIGPIPE (as ``yes | head`` gives); SIGTERM, SIGHUP and Ctrl-C stop it cleanly (worker processes
and temporary files removed) with 128 + the signal number.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from fsdp_planner.cli.parser import build_parser
from fsdp_planner.cli.paths import check_paths
from fsdp_planner.errors import PlannerError, one_line
from fsdp_planner.fmt import printable
from fsdp_planner.signals import Terminated, signals_raise

__all__ = ["EXIT_BROKEN_PIPE", "build_parser", "main"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _open_missing_streams() -> None:
    """A closed stdout or stderr (``>&-``) is None in Python: write to the null device instead."""
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115


def _silence_output() -> None:
    """After a broken pipe: point stdout's and stderr's descriptors at the null device, so the flush at exit
    cannot fail again (nothing more is printed; every note so far was flushed as it was printed)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor (e.g. captured in tests): nothing to protect
            pass


def _say(text: str) -> None:
    """One line on stderr; if stderr itself is gone there is nobody to tell."""
    with contextlib.suppress(OSError, ValueError):
        print(printable(text), file=sys.stderr, flush=True)  # errors quote names from files


QUIET_LOGGERS = ("torch", "torch.utils._pytree", "torchao")  # the pytree one sets its own level


@contextlib.contextmanager
def quiet_libraries(quiet: bool) -> Iterator[None]:
    """``--quiet`` silences what PyTorch and transformers print on their own too (Python warnings; transformers'
    logger, read from the environment when it is first imported; the loggers of torch and of torchao, which
    transformers imports and which reports its CUDA kernels missing on a CPU host), for this command only."""
    if not quiet:
        yield
        return
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    saved = os.environ.get("TRANSFORMERS_VERBOSITY")
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    hf_logging = sys.modules.get("transformers.utils.logging")
    level = hf_logging.get_verbosity() if hf_logging else None
    if hf_logging:
        hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if saved is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = saved
        if hf_logging and level is not None:
            hf_logging.set_verbosity(level)
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 2


MAX_DEBUG_MESSAGE = 20_000  # characters of an error's further lines FSDP_PLANNER_DEBUG shows


def main(argv: Sequence[str] | None = None) -> int:
    _open_missing_streams()
    render = sys.modules.get("fsdp_planner.cli.render")  # (not imported here: --help stays fast without rich)
    if render is not None:  # an earlier command in this process said its notes
        render.new_command()
    try:
        with signals_raise():  # from the start: Ctrl-C or SIGTERM while torch is imported is one line too
            return _run(argv)
    except BrokenPipeError:
        _silence_output()
        return EXIT_BROKEN_PIPE
    except PlannerError as e:
        _say(f"error: {one_line(str(e))}")
        if os.environ.get("FSDP_PLANNER_DEBUG"):  # the lines one_line leaves out (the other ranks' failures)
            for line in str(e)[:MAX_DEBUG_MESSAGE].splitlines()[1:]:
                _say(line)
        return 2
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except Terminated as e:
        _say(f"terminated ({e.name})")
        return 128 + e.signum
    except OSError as e:
        if os.environ.get("FSDP_PLANNER_DEBUG"):
            raise
        if e.filename:
            _say(one_line(f"error: {e.strerror or e}: {e.filename}"))  # a 100 KB name is cut short
        elif e.errno in WRITE_ERRNOS:  # no file named: stdout itself (`> /dev/full`, a full disk)
            _say(f"error: cannot write the output: {e.strerror}")
            _silence_output()
        else:
            _say(f"error: {e.strerror or e}")
        return 2
    except Exception as e:
        if os.environ.get("FSDP_PLANNER_DEBUG"):
            raise
        _say(f"error: internal error: {type(e).__name__}: {e} (set FSDP_PLANNER_DEBUG=1 for the traceback)")
        return 3


def _run(argv: Sequence[str] | None) -> int:
    """Parse, check the paths, then import the command (and with it torch) and run it."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or the one-line argument error already printed
        return _exit_code(e.code)
    with quiet_libraries(args.quiet):
        check_paths(args)
        command = importlib.import_module(f"fsdp_planner.cli.{args.command}")
        from fsdp_planner.cli import render

        render.set_quiet(args.quiet)
        try:
            status = int(command.run(args))
            sys.stdout.flush()  # a broken pipe shows here, not in the interpreter's flush at exit
        finally:  # one call's --quiet is not the next one's (main() called again in one process: the API, tests)
            render.set_quiet(False)
        return status


if __name__ == "__main__":
    sys.exit(main())
