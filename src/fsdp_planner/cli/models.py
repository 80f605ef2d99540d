"""``fsdp-planner models``: the built-in models and their default workloads."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.fmt import fmt_bytes, json_text
from fsdp_planner.hardware.cluster import PRESETS, preset_cluster
from fsdp_planner.models import BUILTINS, hf, workload_defaults


def listing() -> list[dict[str, Any]]:
    """Every model a name selects: built-ins and shipped configs, with their default workload."""
    out = [{"name": name, "description": b.description, "workload": workload_defaults(b.factory),
            "trainable": b.trainable, "needs": None} for name, b in BUILTINS.items()]
    out += [{"name": hf.PREFIX + name, "description": shipped.description, "workload": shipped.workload(),
             "trainable": False, "needs": "fsdp-planner[hf]"} for name, shipped in hf.SHIPPED.items()]
    return out


def presets() -> list[dict[str, Any]]:
    """The cluster presets (``--cluster NAME:N``): the GPU, its memory, and where their host figures come from."""
    out = []
    for name in PRESETS:
        c = preset_cluster(name)
        out.append({"name": name, "gpu": c.gpu.name, "memory_bytes": c.gpu.memory_bytes,
                    "host_figures": c.overhead.source})
    return out


def run(args: argparse.Namespace) -> int:
    rows = listing()
    if args.json:
        print(json_text({"models": rows, "cluster_presets": presets()}, indent=2))
        return 0
    words = {"batch_size": "batch", "seq_len": "seq"}
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        workload = ", ".join(f"{words[k]} {v:,}" for k, v in r["workload"].items())
        planning = "planning only" + (f"; needs {r['needs']}" if r["needs"] else "")
        line = escape(f"{r['name']:{width}s} {r['description']}{f' ({workload})' if workload else ''}")
        render.console.print(line + ("" if r["trainable"] else f"  [dim]{escape(f'({planning})')}[/dim]"),
                             highlight=False)
    render.console.print("hf:path/config.json or hf:path/dir builds any Hugging Face causal LM, encoder-decoder LM "
                         "or image classifier from its config (no download).", highlight=False)
    render.console.print("--batch and --seq set the batch and sequence length of the models that have them.",
                         highlight=False)
    render.console.print("\ncluster presets (--cluster NAME:GPUS):", highlight=False)
    shown = presets()
    for p in shown:
        render.console.print(escape(f"{p['name']:16s} {p['gpu']} ({fmt_bytes(p['memory_bytes'])})"), highlight=False)
    sources = {p["host_figures"] for p in shown}
    render.console.print(escape(f"FSDP2 host figures of every preset: {', '.join(sorted(sources))}; "
                                "`fsdp-planner calibrate --overhead` measures yours"), highlight=False)
    return 0
