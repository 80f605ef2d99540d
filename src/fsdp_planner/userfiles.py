"""Reading the files a user hands over (plans, clusters): every way they can be wrong is one PlannerError line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError


def read_text(path: str | Path, label: str, expected: str) -> str:
    """The UTF-8 text of ``path``; ``label`` names it in messages ("plan file 'p.json'"), ``expected`` says what
    it should hold."""
    p = Path(path)
    if not p.is_file():
        raise PlannerError(f"{label} does not exist")
    try:
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
