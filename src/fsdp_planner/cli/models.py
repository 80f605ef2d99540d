"""``fsdp-planner models``: the built-in models and their default workloads."""

from __future__ import annotations

import argparse

from fsdp_planner.cli import render
from fsdp_planner.models import BUILTINS, ModelSpec, hf


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("models", help="list the built-in models and the shipped Hugging Face configs").set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    for name, b in BUILTINS.items():
        workload = ModelSpec(name).label().partition(", ")[2]
        render.console.print(f"{name:16s} {b.description}{f' ({workload})' if workload else ''}"
                             f"{'' if b.trainable else '  [dim](planning only)[/dim]'}", highlight=False)
    for name, shipped in hf.SHIPPED.items():
        workload = ModelSpec(f"{hf.PREFIX}{name}").label().partition(", ")[2]
        render.console.print(f"{hf.PREFIX + name:16s} {shipped.description} ({workload})  [dim](planning only; "
                             r"needs fsdp-planner\[hf])[/dim]", highlight=False)
    render.console.print("hf:path/config.json or hf:path/dir builds any Hugging Face causal LM, encoder-decoder LM "
                         "or image classifier from its config (no download).", highlight=False)
    render.console.print("--batch and --seq set the batch and sequence length of the models that have them.",
                         highlight=False)
    return 0
