"""Terminating signals as exceptions, so every ``finally`` runs (a torchrun job killed, a temporary directory
removed) and the CLI ends with one line. Imports nothing heavy: ``cli.main`` installs it before the command's
modules (and torch) are imported."""

from __future__ import annotations

import signal
import threading
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
