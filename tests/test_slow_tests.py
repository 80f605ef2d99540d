"""The fast subset's list of slow tests (``slow_tests.txt``) names test functions that exist, so a renamed or
removed test does not leave the list, and the subset, silently stale."""

from __future__ import annotations

import re

from slow_tests import ROOT, listed, measured


def _tests(text: str) -> set[str]:
    """The tests a test file's ``text`` defines: ``NAME`` for a function of the module, ``CLASS::NAME`` for a
    method of one of its classes (read, not imported)."""
    names, cls = set(), None
    for indent, kind, name in re.findall(r"^( *)(class|(?:async )?def) (\w+)", text, re.M):
        if kind == "class" and not indent:
            cls = name
        elif kind != "class" and not indent:
            names.add(name)
        elif kind != "class" and indent == "    " and cls is not None:
            names.add(f"{cls}::{name}")
    return names


def test_every_listed_slow_test_exists():
    entries = listed()
    assert entries == sorted(set(entries))
    tests: dict[str, set[str]] = {}
    for entry in entries:
        file, _, name = entry.partition("::")
        assert (ROOT / file).is_file(), entry
        if file not in tests:
            tests[file] = _tests((ROOT / file).read_text())
        assert name in tests[file], f"{entry}: no such test (regenerate the list)"


def test_a_file_s_tests_are_its_module_s_functions_and_its_classes_methods():
    text = """def test_a():
    def nested():
        pass


class TestB:
    def test_c(self):
        pass

    async def test_d(self):
        pass


async def test_e():
    pass
"""
    assert _tests(text) == {"test_a", "TestB::test_c", "TestB::test_d", "test_e"}


def test_a_durations_report_is_summed_per_function():
    log = """============================= slowest durations =============================
3.50s call     tests/test_a.py::test_x[1-2]
0.25s setup    tests/test_a.py::test_x[3 4]
0.01s teardown tests/test_a.py::T::test_y
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert measured(log) == {"tests/test_a.py::test_x": 3.75, "tests/test_a.py::T::test_y": 0.01}
