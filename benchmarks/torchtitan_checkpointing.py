"""What torchtitan's activation checkpointing of 2026 changes in a step: its checkpoint wrapper's
``early_stop=False`` (each checkpointed block re-run whole) and its SelectiveAC save list (AOTAutograd's
compute-intensive ops, ``topk``, EP's all-to-alls), each beside what the planner modelled before (torch's early stop;
torchtitan's llama3 list of 2025), on the same job.

Run: ``python benchmarks/torchtitan_checkpointing.py`` (writes benchmarks/torchtitan_checkpointing.md). The figures
are the simulator's; the terms are checked against torch and real FSDP2 in tests/test_early_stop.py,
tests/test_selective.py and tests/test_expert_parallel.py (op by op, and EP's all-to-alls counted on fake ranks).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

GIB = 2**30

# (what the pair compares, the job's options, the option that makes the second row)
PAIRS = (
    ("early stop", ["llama3-8b", "--policy", "titan", "--ac", "full", "--cluster", "h100:8"], ["--no-early-stop"]),
    ("early stop", ["llama3-70b", "--policy", "titan", "--ac", "full", "--batch", "1", "--seq", "8192",
                    "--cluster", "a100:64"], ["--no-early-stop"]),
    ("early stop", ["llama3-8b", "--policy", "titan", "--ac", "op", "--cluster", "h100:8"], ["--no-early-stop"]),
    ("save list", ["hf:qwen3-30b-a3b", "--policy", "titan", "--ep", "8", "--ac", "op", "--batch", "2", "--seq",
                   "4096", "--cluster", "h100:16", "--ac-policy", "titan-2025"], ["--ac-policy", "titan"]),
    ("save list", ["hf:qwen2.5-3b", "--policy", "titan", "--ac", "op", "--batch", "2", "--seq", "4096",
                   "--cluster", "h100:8", "--ac-policy", "titan-2025"], ["--ac-policy", "titan"]),
    ("save list", ["vit-h14", "--policy", "titan", "--ac", "op", "--cluster", "h100:8", "--ac-policy",
                   "titan-2025"], ["--ac-policy", "titan"]),
)


def simulate(args: list[str]) -> dict:
    """``simulate ARGS --json``'s step."""
    out = subprocess.run([sys.executable, "-m", "fsdp_planner", "simulate", *args, "--json"], capture_output=True,
                         text=True, check=True, env={**os.environ, "COLUMNS": "120"})
    return json.loads(out.stdout)


def _with(args: list[str], change: list[str]) -> list[str]:
    """``args`` with ``change`` set: an option it has replaced, else added."""
    out = list(args)
    if change[0] in out and len(change) == 2:
        out[out.index(change[0]) + 1] = change[1]
        return out
    return out + change


def main() -> None:
    lines = [
        "# torchtitan's activation checkpointing of 2026 in the step",
        "",
        f"Measured by `python benchmarks/torchtitan_checkpointing.py` on {platform.machine()}, torch "
        f"{torch.__version__}: `fsdp-planner simulate ... --json` for each row (bf16-mixed, the cluster's roofline).",
        "Early stop: torch's default, which `apply_plan` and the Python export run; torchtitan's checkpoint",
        "wrapper passes `early_stop=False` (#1580), which `--no-early-stop` models and `--from-torchtitan` jobs run.",
        "Save list: `titan-2025` (torchtitan's llama3 list of 2025) against `titan` (its SelectiveAC at b5bcd76).",
        "",
        "| job | row | step | recompute | reserved | EP all-to-alls |",
        "|---|---|---|---|---|---|",
    ]
    for what, args, change in PAIRS:
        for label, argv in ((f"{what}: as given", args), (f"{what}: {' '.join(change)}", _with(args, change))):
            step = simulate(argv)
            a2a = step.get("ep_all_to_alls")
            lines.append(f"| `{' '.join(args[:1] + args[1:])}` | {label} | {step['step_time'] * 1e3:,.1f} ms | "
                         f"{step['recompute_time'] * 1e3:,.1f} ms | {step['reserved_memory'] / GIB:.1f} GiB | "
                         f"{a2a if a2a is not None else '-'} |")
            print(lines[-1], file=sys.stderr)
    Path(__file__).with_name("torchtitan_checkpointing.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
