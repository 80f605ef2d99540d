"""Command line: ``fsdp-planner demo | plan | simulate | verify | cost | calibrate | memory | models``.

Every user error is one line on stderr and exit code 2; never a traceback (set FSDP_PLANNER_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from fsdp_planner.cli import calibrate, cost, demo, memory, models, plan, simulate, verify
from fsdp_planner.errors import PlannerError

COMMANDS = (demo, plan, simulate, verify, cost, calibrate, memory, models)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdp-planner", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("FSDP_PLANNER_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {e} (set FSDP_PLANNER_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
