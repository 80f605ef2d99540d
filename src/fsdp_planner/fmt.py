"""Human-readable numbers: one formatter per unit, and the one size parser.

Bytes are shown in binary units (KiB, MiB, GiB), as ``torch.cuda.memory_summary`` and FSDP's own logs do;
times in s / ms / us; element counts with K / M / B / T suffixes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from decimal import Decimal, InvalidOperation

from fsdp_planner.errors import PlannerError


def _three(n: float) -> str:
    """Three significant digits, never in exponent notation (``1,000``, not ``1e+03``; a trial's 1 EiB all-gather
    took ``2927789 s``)."""
    return f"{n:.3g}" if abs(n) < 999.5 else f"{n:,.0f}"


def fmt_bytes(n: float) -> str:
    """``1.5 MiB``: binary units, three significant digits (``1000 MiB`` reads ``0.977 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if unit == "B" and abs(n) < 1024:
            return f"{n:.0f} B"
        if abs(n) < 999.5 or unit == "PiB":
            return f"{_three(n)} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_time(seconds: float) -> str:
    """``2.76 ms``: three significant digits in s, ms or us."""
    if seconds >= 0.9995:
        return f"{_three(seconds)} s"
    if seconds >= 0.9995e-3:
        return f"{_three(seconds * 1e3)} ms"
    return f"{_three(seconds * 1e6)} us"


def fmt_numel(n: float) -> str:
    """``8.03B``: element counts with K / M / B / T suffixes."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div * 0.9995:
            return f"{_three(n / div)}{unit}"
    return f"{n:.0f}"


def fmt_count(n: int, noun: str) -> str:
    """``1 group``, ``2 groups``: a count with its noun (plural by ``s``)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def fmt_gain(time: float, rival: float) -> str | None:
    """How a step time compares with a rival's: ``12.3% faster``, ``4.0% slower``, or None for a tie (within 0.05%,
    what one decimal shows as 0.0%)."""
    gain = 1 - time / rival if rival else 0.0
    if abs(gain) < 0.0005:
        return None
    return f"{abs(gain):.1%} {'faster' if gain > 0 else 'slower'}"


def fmt_modules(modules: Sequence[str], limit: int = 3) -> str:
    """A group's modules for a table cell: ``layers.0, layers.1, +6``; the root module is ``(root)``. One name
    more than ``limit`` is shown rather than counted (``+1`` would hide it in no less room)."""
    names = ["(root)" if m == "" else cell_text(m) for m in modules]
    if len(names) <= limit + 1:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", +{len(names) - limit}"


# C0 and C1 control characters but tab and newline, DEL, and the Unicode line separators and bidirectional
# overrides: what lets a name from a file move the cursor, retitle or clear the terminal, or reorder the text shown;
# and the invisible ones (no-break and zero-width spaces, joiners, marks, the byte-order mark, soft hyphen), which
# make a name look blank or like another (a module named "\u00a0" read as the root's row, a trial).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\xa0\xad\u061c\u180e\u2000-\u200f\u2028-\u202f\u205f-\u2064"
                      r"\u2066-\u2069\u3000\ufeff]")


def printable(text: str) -> str:
    """``text`` for a terminal: each control character shown as its escape (``\\x1b``, ``\\u202e``), so a name from
    a plan, cluster or model file reads as written and cannot act on the terminal."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def printable_name(name: str) -> str:
    """A module or param name (from a plan file or a model: anything ``add_module`` takes) inside a one-line message:
    ``printable``, with its newlines and tabs escaped too, so the message stays the one line it is."""
    return printable(name).replace("\n", "\\n").replace("\t", "\\t")


def json_text(doc: object, indent: int | None = 2) -> str:
    """A ``--json`` document as strict JSON: a NaN or infinite float (a diverged loss, an unbounded ratio) is
    null, since ``json.dumps`` would print ``NaN``/``Infinity``, which no JSON parser but Python's accepts."""
    return json.dumps(finite(doc), indent=indent, allow_nan=False)


def finite(value: object) -> object:
    """``value`` with every non-finite float replaced by None, in nested dicts and lists (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def cell_text(name: str) -> str:
    """A name from a model or file for one table cell or line: ``printable``, and a newline or tab escaped too
    (``printable`` keeps them for layout, but an ``nn.ModuleDict`` key ``"a\\nb"`` split a table row in two)."""
    return printable(name).replace("\n", "\\n").replace("\t", "\\t")


# The longest number or size a person types (1_000_000_000_000 or 1.5e6GiB are far shorter): a longer one is refused
# before the patterns below see it (_SIZE backtracks quadratically on a long run of digits: 20,000 took 33 s).
MAX_NUMBER_TEXT = 100
MAX_BYTES = 2**60  # 1 EiB: a million times any GPU's memory; beyond it a cost is a typo (and prints 300 digits)


SHORT, SHOWN = 40, 30  # a value longer than SHORT characters is shown as its first SHOWN
MAX_MEASURED = 10_000  # characters of a value serialised to count its length: beyond, "over 10,000 characters"


def cut_short(text: object) -> str:
    """A value as typed, cut short when long: a message never echoes an unbounded input."""
    text = str(text)
    return text if len(text) <= SHORT else f"{text[:SHOWN]}...({len(text)} characters)"


def cut_short_stream(chunks: Iterable[str]) -> str:
    """``cut_short`` of the text ``chunks`` make up, reading no more of them than ``MAX_MEASURED`` characters: a
    value from a file is shortened while it is serialised, never serialised whole first (a 1 KB YAML of nested
    aliases is a list of 387 million strings)."""
    taken: list[str] = []
    length = 0
    for chunk in chunks:
        taken.append(chunk)
        length += len(chunk)
        if length > MAX_MEASURED:
            return f"{''.join(taken)[:SHOWN]}...(over {MAX_MEASURED:,} characters)"
    return cut_short("".join(taken))


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5,  # bare letters are binary, as in
    # nccl-tests -b/-e (no bare "e": "1e" reads as a cut exponent); up to the limit's own unit, so "2EiB" is said to
    # be too large, not unreadable
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5, "eib": 1024**6,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5, "eb": 1000**6,
}


def parse_size(text: str, what: str | None = None) -> int:
    """Bytes from ``1GiB``, ``512MB``, ``1e9``, ``8G`` (bare K/M/G/T are binary, as in nccl-tests -e 8G).

    Fractions of a byte round to the nearest byte (``0.1GiB``), but a nonzero size under one byte is refused rather
    than read as 0. ``what`` (an option name such as ``--memory-budget``) starts the error messages."""
    quoted = f"{what} '{cut_short(text)}'" if what else f"the size '{cut_short(text)}'"
    if len(str(text)) > MAX_NUMBER_TEXT:
        raise PlannerError(f"{quoted} is {len(str(text)):,} characters long: not a size")
    m = _SIZE.match(str(text))  # on at most MAX_NUMBER_TEXT characters: its backtracking stays cheap
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise PlannerError(
            f"cannot read {quoted}{' as a size' if what else ''}: use a number with an optional unit such as 1GiB, "
            "512MB, 64KiB or 1e9"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise PlannerError(f"{quoted} is too large: at most 1 EiB (2^60 bytes)")
    if 0 < value < 1:
        raise PlannerError(f"{quoted} is less than one byte: give a whole number of bytes or a unit, e.g. 64MiB")
    return round(value)


_COUNT = re.compile(r"^\s*[+-]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:e[+-]?[0-9]+)?\s*$", re.IGNORECASE)


def parse_count(text: str, what: str | None = None) -> int:
    """A whole number written as an integer or in float notation: ``100000000``, ``1e8``, ``1.5e6``, ``1_000``.

    Float notation is read exactly (``1.5e6`` is 1500000); a value that is not whole (``1.5``, ``1e-3``) is refused."""
    quoted = f"{what} '{cut_short(text)}'" if what else f"'{cut_short(text)}'"
    if len(str(text)) > MAX_NUMBER_TEXT:
        raise PlannerError(f"{quoted} is {len(str(text)):,} characters long: not a number")
    if not _COUNT.match(str(text)):
        raise PlannerError(f"cannot read {quoted}: give a whole number such as 8, 1000 or 1e8")
    try:
        value = Decimal(str(text).strip().replace("_", ""))
    except InvalidOperation:
        raise PlannerError(f"cannot read {quoted}: give a whole number such as 8, 1000 or 1e8") from None
    if abs(value.adjusted()) > 100:
        raise PlannerError(f"{quoted} is out of range")
    if value != value.to_integral_value():
        raise PlannerError(f"{quoted} is not a whole number")
    return int(value)
