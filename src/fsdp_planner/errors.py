"""The one exception type the CLI turns into a single clear line and a non-zero exit."""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
from pathlib import Path

MAX_MESSAGE = 1000  # characters of an error line
MAX_WORD = 200  # characters of one space-free run in it: a path or name longer than this is cut short
_LONG_WORD = re.compile(rf"\S{{{MAX_WORD + 1},}}")  # linear: no nested repetition to backtrack over


class PlannerError(Exception):
    """A user-facing error: bad model spec, bad plan file, infeasible budget, mismatched world size..."""


def one_line(message: str) -> str:
    """``message`` as the one line the CLI prints: its first line (an error a user's code raised may run to a
    C++ backtrace), every space-free run of more than ``MAX_WORD`` characters cut short to its start and its end (a
    100 KB argument is never echoed whole; a long path keeps its file's name), at most ``MAX_MESSAGE`` characters
    in all."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    text = lines[0] + (f" (+{len(lines) - 1} more lines: FSDP_PLANNER_DEBUG=1 shows them)" if len(lines) > 1 else "")
    text = _LONG_WORD.sub(_cut_word, text)
    return text if len(text) <= MAX_MESSAGE else f"{text[:MAX_MESSAGE - 20]}... (cut short)"


def _cut_word(m: re.Match[str]) -> str:
    word = m.group()
    return f"{word[:40]}...({len(word):,} characters)...{word[-80:]}"


def raised_at(e: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION)``: the innermost frame ``e`` was raised in, for an error raised in a user's or a
    library's code (an IndexError alone does not say which list); empty when it has no traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    at = f" (at {Path(f.filename).name}:{f.lineno} in {f.name}"
    # raised in an installed library (torch's): the user's own line that called it too, the one to change
    mine = next((g for g in reversed(frames) if not _library(g.filename)), None) if _library(f.filename) else None
    return at + (f", from {Path(mine.filename).name}:{mine.lineno} in {mine.name})" if mine is not None else ")")


_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]")
# this Python's standard library and install folders (Fedora's lib64, Windows' Lib, PyPy's lib-python)
_LIBRARY_DIRS = tuple(sorted({os.path.normcase(os.path.realpath(p)) for k in ("stdlib", "platstdlib", "purelib",
                                                                              "platlib")
                              if (p := sysconfig.get_paths().get(k))}))


def _library(filename: str) -> bool:
    """Whether ``filename`` is an installed package's, the standard library's or generated code's (``<string>``,
    ``<frozen ...>``), not the user's (nor this package's from a source checkout, never the user's line either)."""
    if filename.startswith("<") or _LIBRARY.search(filename) or "fsdp_planner" in Path(filename).parts:
        return True
    real = os.path.normcase(os.path.realpath(filename))
    return any(real.startswith(d + os.sep) for d in _LIBRARY_DIRS)
