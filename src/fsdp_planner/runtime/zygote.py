"""Launchers forked from one process that has imported torch once, where ranks are forked too (``FORK_ENV``).

The test suite runs ~90 torchrun jobs; each launcher (``launch.py``) spends ~3 s of its ~5 s of CPU importing
torch, torchrun and dynamo (which its forked ranks need) before it starts a rank. The zygote, ``python -m
fsdp_planner.runtime.zygote``, imports what a launcher imports and runs nothing else (no op, no thread: a fork of it
is a launcher started fresh, less the imports), then forks one launcher a request. A request (a Unix socket
message, one a connection) carries the launcher's arguments, environment and working directory, with its stdout
and stderr as file descriptors; the reply is its pid, then its exit status once the zygote has reaped it. Each
launcher leads a session of its own, as ``start_new_session`` makes one, and follows the zygote, which follows the
process that started it (``signals.follow_parent``): none outlives a command killed by SIGKILL.

Only where the launcher's interpreter would start as the zygote's did: the same interpreter and the environment
read at start-up (``STARTUP_PREFIXES``: the hash seed, the path, glibc's and OpenMP's settings); else, and
wherever ranks are not forked, ``subprocess.Popen`` as ever. ``Forked`` is the handle: the part of ``Popen`` that
``verify.run_torchrun`` and ``verify.stop_process_group`` use.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import locale
import os
import re
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Protocol

LAUNCH_MODULE = "fsdp_planner.runtime.launch"
# the pid of the one process whose launchers are forked (the test suite's conftest sets its own): a command the
# tests start as a subprocess inherits it and starts its one job as a process of its own, as a zygote would not pay
ZYGOTE_ENV = "FSDP_PLANNER_ZYGOTE_FOR"
# more modules for the zygote to import before it forks, comma-separated (the suite's: transformers and the models
# its ranks build, ~3 s of CPU a rank of a transformers model otherwise); one that fails to import is left out
PRELOAD_ENV = "FSDP_PLANNER_ZYGOTE_PRELOAD"
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# what the interpreter, glibc and OpenMP read once, at start-up: a zygote serves only requests that agree on them
STARTUP_PREFIXES = ("PYTHON", "PYTORCH_", "TORCH", "GLIBC_", "LD_", "MALLOC_", "OMP_", "KMP_", "MKL_", "LC_", "LANG",
                    "LOGLEVEL")
READY = b"ready\n"
START_TIMEOUT_S = 120.0  # a zygote not ready by then is given up: jobs start as separate processes
MAX_ZYGOTES = 4  # zygotes kept by one process, one per start-up environment
MESSAGE_BYTES = 1 << 20  # a request larger than this (its environment) starts as a separate process
REQUEST_TIMEOUT_S = 10.0  # a connection that sends no request by then is dropped (the zygote serves one at a time)


def start_launcher(cmd: list[str], env: dict[str, str]) -> subprocess.Popen | Forked:
    """``Popen(cmd, env=env, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True)``, forked from a zygote
    where ``cmd`` runs the launcher, ranks are forked and this is the process ``ZYGOTE_ENV`` names (module
    docstring)."""
    from fsdp_planner.runtime.launch import PARENT_ENV, forks_ranks

    args = cmd[4:] if cmd[:4] == [sys.executable, "-u", "-m", LAUNCH_MODULE] else None
    ours = env.get(ZYGOTE_ENV) == str(os.getpid())
    zygote = _zygote(env) if args is not None and ours and forks_ranks(env) else None
    if zygote is not None:
        forked = zygote.fork(args, {**env, PARENT_ENV: str(zygote.pid)})
        if forked is not None:
            return forked
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


class Forked:
    """A launcher a zygote (pid ``zygote``, listening at ``address``) forked: the part of ``subprocess.Popen`` that
    ``run_torchrun`` uses. Its exit status comes from the zygote, its parent, on ``conn``."""

    def __init__(self, pid: int, zygote: int, address: str, conn: socket.socket, stdout: io.FileIO,
                 stderr: io.FileIO) -> None:
        self.pid, self.zygote, self.address, self._conn = pid, zygote, address, conn
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._read: dict[io.FileIO, list[bytes]] = {stdout: [], stderr: []}  # what ``communicate`` has read

    def poll(self) -> int | None:
        """The exit status once the zygote has reported it, else None."""
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, waiting at most ``timeout`` seconds (``TimeoutExpired``)."""
        status = self._status(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(LAUNCH_MODULE, timeout or 0.0)
        return status

    def kill(self) -> None:
        """SIGKILL to the launcher (its ranks follow it)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both outputs to their ends, then the exit status, as ``Popen.communicate`` in text mode (decoded once
        whole, universal newlines; ``TimeoutExpired`` after ``timeout`` seconds, the process left running and
        what was read kept for the next call). Each stream is closed at its end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for stream in (self.stdout, self.stderr):
                if not stream.closed:
                    sel.register(stream, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(LAUNCH_MODULE, timeout or 0.0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        self._read[key.fileobj].append(data)
                    else:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return _text(b"".join(self._read[self.stdout])), _text(b"".join(self._read[self.stderr]))

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                message = self._conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                message = b""
            # the zygote gone before it reported (it died): the launcher went with it, on the SIGTERM it follows
            self.returncode = json.loads(message)["returncode"] if message else -signal.SIGTERM
            self._conn.close()
        return self.returncode


def _text(data: bytes) -> str:
    """What ``Popen(text=True)`` makes of a stream's bytes: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


class _Zygote:
    """The client's end: the zygote process and the address it listens on."""

    def __init__(self, env: dict[str, str]) -> None:
        name = f"fsdp-planner-zygote-{os.getpid()}-{secrets.token_hex(8)}"
        self.address = abstract(name)
        # its own session: Ctrl-C in a terminal reaches the client, which stops its jobs, not the zygote mid-job
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, name, str(os.getpid())],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        self.ready = _read_ready(self.proc)
        atexit.register(self.close)
        if not self.ready:
            warnings.warn("the launchers' zygote did not start: each torchrun job's launcher starts fresh",
                          RuntimeWarning, stacklevel=3)

    def fork(self, args: list[str], env: dict[str, str]) -> Forked | None:
        """A launcher of ``args`` forked by the zygote; None where the request cannot be made (then a separate
        process starts)."""
        try:
            message = json.dumps({"argv": args, "env": env, "cwd": os.getcwd()}).encode()
        except OSError:  # no working directory (deleted): a separate process says so as Popen would
            return None
        if len(message) > MESSAGE_BYTES or self.proc.poll() is not None:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = None
        try:
            conn.connect(self.address)
            socket.send_fds(conn, [message], [out_w, err_w])
            conn.settimeout(START_TIMEOUT_S)
            reply = conn.recv(4096)
            pid = json.loads(reply)["pid"] if reply else None
        except (OSError, ValueError, KeyError):
            pid = None
        finally:
            os.close(out_w)
            os.close(err_w)
            if pid is None:  # also on a signal's exception: a launcher whose pid never came is killed by the
                conn.close()  # zygote when this connection closes
                os.close(out_r)
                os.close(err_r)
        if pid is None:
            return None
        return Forked(pid, self.pid, self.address, conn, io.FileIO(out_r, "r"), io.FileIO(err_r, "r"))

    def close(self) -> None:
        """Ends the zygote (it exits when its stdin closes); its launchers, if any, with it."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_zygotes: dict[tuple[tuple[str, str], ...], _Zygote | None] = {}
_lock = threading.Lock()


def _zygote(env: dict[str, str]) -> _Zygote | None:
    """The zygote for this start-up environment, started on first use and again after it died; None where it
    could not start."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES)))
    with _lock:
        gone = _zygotes.get(key)
        if gone is not None and gone.proc.poll() is not None:  # killed: another takes its place
            del _zygotes[key]
        if key not in _zygotes:
            if len(_zygotes) >= MAX_ZYGOTES:
                return None
            zygote = _Zygote(env)
            _zygotes[key] = zygote if zygote.ready else None
            if not zygote.ready:
                zygote.close()
        return _zygotes[key]


def abstract(name: str) -> str:
    """A Unix socket address in Linux's abstract namespace: no file to remove, gone with its last socket."""
    return "\0" + name


def _read_ready(proc: subprocess.Popen) -> bool:
    """Whether the zygote said it is ready within ``START_TIMEOUT_S`` (it imports torch first)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(START_TIMEOUT_S):
            return False
    return proc.stdout.readline() == READY


# The zygote's side.


class Closable(Protocol):
    def close(self) -> None: ...


def preload_modules(names: str) -> None:
    """Import each module ``names`` lists (``PRELOAD_ENV``): a warm-up, so one that is not a module name or fails
    to import is left to the ranks that need it."""
    for name in filter(None, (n.strip() for n in names.split(",")[:100])):
        if _MODULE_NAME.fullmatch(name):
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def serve(name: str, parent: int) -> None:
    """Fork a launcher for each request of ``parent`` until stdin closes (the client's ``close``, or its death)."""
    from fsdp_planner.runtime import launch
    from fsdp_planner.signals import follow_parent

    follow_parent(parent, signal.SIGTERM)
    launch.preload()
    preload_modules(os.environ.get(PRELOAD_ENV, ""))
    # what the imports made, out of the collector's reach in every fork: no launcher or rank spends its collections
    # walking (and so copying) the zygote's pages (``gc.freeze``'s documented use before fork)
    gc.freeze()
    if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
        return  # a thread started by an import would be missing from every fork (its locks held for good): no
        # READY, so the client starts its launchers fresh
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(abstract(name))
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select through the wakeup fd
    waiting: dict[int, socket.socket] = {}  # launcher pid -> its request's connection
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    with selectors.DefaultSelector() as sel:
        sel.register(listener, selectors.EVENT_READ)
        sel.register(sys.stdin, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj is sys.stdin:
                    if not os.read(sys.stdin.fileno(), 4096):
                        return
                elif key.fileobj is listener:
                    conn, _ = listener.accept()
                    pid = _fork_request(conn, parent, closing=(sel, listener, wake_r, wake_w, *waiting.values()))
                    if pid is None:
                        conn.close()
                    else:
                        waiting[pid] = conn
                        sel.register(conn, selectors.EVENT_READ, pid)
                elif key.fileobj is wake_r:
                    os.read(wake_r, 4096)
                else:  # a client hung up before its launcher's status: nobody will stop that job but this
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    del waiting[key.data]
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(key.data, signal.SIGKILL)
            for conn in _reap(waiting):
                sel.unregister(conn)
                conn.close()


def _fork_request(conn: socket.socket, parent: int, closing: tuple[Closable | int, ...]) -> int | None:
    """Read one request, from ``parent`` only, and fork its launcher; its pid (sent back), or None for a request
    that could not be read or came from another process (an abstract socket's name is visible to every local
    user)."""
    peer, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if peer != parent:
        return None
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 2)
        request = json.loads(message)
    except (OSError, ValueError):
        return None
    if len(fds) != 2:
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        _run_launcher(request, fds, (conn, *closing))
    for fd in fds:
        os.close(fd)
    # the client gone: the launcher's status has no one to go to; the hang-up kills it
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"pid": pid}).encode())
    return pid


def _run_launcher(request: dict[str, Any], fds: list[int], closing: tuple[Closable | int, ...]) -> None:
    """In the forked child: become what ``Popen(..., start_new_session=True)`` of ``python -u -m launch`` would
    start, then run the launcher; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for x in closing:  # the zygote's own: its listener, its wakeup pipe, other launchers' connections
            os.close(x) if isinstance(x, int) else x.close()
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
            os.close(fd)
        # -u: the text layer writes straight through to an unbuffered file, in the encoding the interpreter chose
        for fd, name in ((1, "stdout"), (2, "stderr")):
            was = getattr(sys, f"__{name}__")
            setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=was.encoding,
                                                errors=was.errors, write_through=True))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the request's TMPDIR, not the zygote's
        from fsdp_planner.runtime import launch

        sys.argv = [launch.__file__, *request["argv"]]
        code = launch.main(request["argv"])
    except SystemExit as e:  # as the interpreter ends on it: None is 0, a message is printed and is 1
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _reap(waiting: dict[int, socket.socket]) -> list[socket.socket]:
    """Report each launcher that has exited to its request's connection; those connections, done with."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            done.append(conn)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
