"""Terminating signals as exceptions, so every ``finally`` runs (a torchrun job killed, a temporary directory
removed) and the CLI ends with one line; and a child process that ends with its parent (``follow_parent``). Imports
nothing heavy: ``cli.main`` installs it before the command's modules (and torch) are imported."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


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


def die_of(signum: int) -> int:
    """End this process by ``signum`` (its parent reads the signal as the exit status); the status a shell would
    give, should the signal not end it."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 0.5  # the fallback watcher's period, where prctl does not exist


def follow_parent(parent: int, sig: int) -> None:
    """Have this process receive ``sig`` when ``parent`` (its parent's pid, as the parent passed it down) dies, even
    by SIGKILL, whose death runs no handler that could stop its children. Linux: the kernel sends it
    (``PR_SET_PDEATHSIG``); elsewhere a daemon thread polls the parent pid. When the parent is already gone (it
    died before this ran, and this process was re-parented), ``sig`` comes at once."""
    if not _set_parent_death_signal(sig):
        watch_parent(parent, sig)
    if os.getppid() != parent:  # checked after prctl: a death before it would otherwise go unnoticed
        os.kill(os.getpid(), sig)


def _set_parent_death_signal(sig: int) -> bool:
    """Whether the kernel will send ``sig`` to this process when its parent dies (Linux's prctl)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        return False


def watch_parent(parent: int, sig: int) -> None:
    """``follow_parent`` without prctl: a daemon thread sends ``sig`` to this process within ``PARENT_POLL_S`` of
    its parent's death (this process is then re-parented, so its parent pid changes)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()
