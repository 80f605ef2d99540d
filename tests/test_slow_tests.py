"""The fast subset's list of slow tests (``slow_tests.txt``) names test functions that exist, so a renamed or
removed test does not leave the list, and the subset, silently stale."""

from __future__ import annotations

import re
from pathlib import Path

from slow_tests import LIST, measured

ROOT = Path(__file__).parent.parent


def _names(text: str) -> set[str]:
    """The functions and classes a test file's ``text`` defines, by name (read, not imported)."""
    return set(re.findall(r"^\s*(?:async def|def|class) (\w+)", text, re.M))


def test_every_listed_slow_test_exists():
    entries = [x for x in LIST.read_text().splitlines() if x and not x.startswith("#")]
    assert entries == sorted(set(entries))
    names: dict[str, set[str]] = {}
    for entry in entries:
        file, *name = entry.split("::")  # FILE::NAME or FILE::CLASS::NAME
        assert (ROOT / file).is_file(), entry
        if file not in names:
            names[file] = _names((ROOT / file).read_text())
        assert set(name) <= names[file], f"{entry}: no such test (regenerate the list)"


def test_a_durations_report_is_summed_per_function():
    log = """============================= slowest durations =============================
3.50s call     tests/test_a.py::test_x[1-2]
0.25s setup    tests/test_a.py::test_x[3 4]
0.01s teardown tests/test_a.py::T::test_y
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert measured(log) == {"tests/test_a.py::test_x": 3.75, "tests/test_a.py::T::test_y": 0.01}
