"""Write ``tests/slow_tests.txt``, the test functions a full run measured over 0.3 s (their parameters
together), from that run's ``--durations=0`` report; ``conftest.py`` marks them ``integration``, so that the fast
subset (``-m "not integration"``) keeps the tests that take a second together and runs in about a minute.

    python -m pytest -n 2 -p no:cacheprovider --durations=0 > full.log
    python tests/slow_tests.py full.log
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the list names tests by their path from it
LIST = Path(__file__).with_name("slow_tests.txt")
HEADER = ("# Test functions a full run measured over {over:g} s (call, setup and teardown of all their parameters);\n"
          "# conftest.py marks them integration. Regenerate: python tests/slow_tests.py LOG (its docstring).\n")
DURATION = re.compile(r"([\d.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py::[^\s\[]+)")


def listed() -> list[str]:
    """The list's entries (``FILE::NAME``), in its order."""
    return [line for line in LIST.read_text().splitlines() if line and not line.startswith("#")]


def measured(log: str) -> dict[str, float]:
    """Seconds per test function (``FILE::NAME``, ``FILE::CLASS::NAME``) in a ``--durations=0`` report."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = DURATION.match(line.strip())
        if m:
            seconds[m.group(2)] += float(m.group(1))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, help="a full run's output with --durations=0")
    ap.add_argument("--over", type=float, default=0.3, help="seconds (default 0.3)")
    args = ap.parse_args()
    seconds = measured(args.log.read_text())
    if not seconds:
        raise SystemExit(f"{args.log}: no durations in it (run pytest with --durations=0)")
    slow = sorted(k for k, s in seconds.items() if s > args.over)
    LIST.write_text(HEADER.format(over=args.over) + "".join(f"{k}\n" for k in slow))
    print(f"{len(slow)} of {len(seconds)} test functions over {args.over:g} s: {LIST}")


if __name__ == "__main__":
    main()
