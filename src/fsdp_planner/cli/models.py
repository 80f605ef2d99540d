"""``fsdp-planner models``: the built-in models."""

from __future__ import annotations

import argparse

from fsdp_planner.cli import render
from fsdp_planner.models import BUILTINS


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("models", help="list the built-in models").set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    for name, b in BUILTINS.items():
        render.console.print(f"{name:16s} {b.description}{'' if b.trainable else '  [dim](planning only)[/dim]'}")
    return 0
