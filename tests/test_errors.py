"""Where an error a user's code raised is said to come from (``errors.raised_at``)."""

from __future__ import annotations

import json

from fsdp_planner.errors import raised_at


def _parse(text: str) -> object:
    return json.loads(text)  # raised in the standard library's json


def test_an_error_raised_in_a_library_names_the_user_s_line_too() -> None:
    try:
        _parse("{")
    except ValueError as e:
        said = raised_at(e)
    assert said.startswith(" (at decoder.py:") and said.endswith(", from test_errors.py:11 in _parse)"), said


def test_generated_code_is_no_user_s_line() -> None:
    """Code compiled from a string (a dataclass's __init__, an fx graph) is the library's that made it."""
    try:
        exec(compile("raise ValueError('x')", "<string>", "exec"))
    except ValueError as e:
        said = raised_at(e)
    assert said.startswith(" (at <string>:1 in <module>, from test_errors.py:"), said
