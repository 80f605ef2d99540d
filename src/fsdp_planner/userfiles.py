"""The files a user hands over (plans, clusters) and the ones the tool writes for them: every way reading can go
wrong is one PlannerError line, and no write can leave a file half written."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short

# The largest file read: a plan of 100,000 groups over a million params is tens of MiB; cluster files, configs and
# checkpoint metadata are far smaller.
MAX_FILE_BYTES = 256 << 20


def read_text(path: str | Path, label: str, expected: str) -> str:
    """The UTF-8 text of ``path``; ``label`` names it in messages ("plan file 'p.json'"), ``expected`` says what
    it should hold."""
    p = Path(path)
    if not p.is_file():
        raise PlannerError(f"{label} does not exist")
    try:
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:  # read whole, parsed whole: a file this large would take minutes and gigabytes
            raise PlannerError(f"{label} is {size / 2**20:,.0f} MiB: at most {MAX_FILE_BYTES >> 20} MiB is read "
                               f"(expected {expected})")
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PlannerError(f"{label} is not text: expected {expected}") from None
    except OSError as e:
        raise PlannerError(f"cannot read {label}: {e.strerror}") from None


def parse_json(text: str, message: Callable[[str], str]) -> Any:
    """``json.loads``; on bad input, a PlannerError whose line is ``message(what is wrong)``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        detail = f"{e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        detail = "it nests too deeply to read"
    except ValueError:  # Python refuses integers of more than 4300 digits
        detail = "it holds a number too long to read, over 4300 digits"
    raise PlannerError(message(detail)) from None


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` without ever leaving it half written: a regular file is written
    beside it and renamed over it, so a full disk or a kill leaves the previous file whole; a device or a pipe
    (``/dev/stdout``) cannot be renamed over and is written directly. Every file the tool writes goes through
    here; a failure is one line naming the file."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if path.exists() and not path.is_file():
        try:
            with open(path, "wb") as f:
                f.write(raw)
        except OSError as e:
            raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None
        return
    target = Path(os.path.realpath(path))  # through a symlink, as a plain write would
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
        _keep_mode(target, tmp)
        os.replace(tmp, target)
    except OSError as e:
        raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _keep_mode(target: Path, tmp: Path) -> None:
    """A file written again keeps its permissions (the temporary file has the umask's)."""
    with contextlib.suppress(FileNotFoundError):  # a new file: the umask's mode, as a plain write gives
        os.chmod(tmp, os.stat(target).st_mode & 0o7777)


def shown_json(value: Any) -> str:
    """A value from a file as the file spells it (true, 1.0, "1", null), cut short when long: a message never
    echoes an unbounded input."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return cut_short(text)
