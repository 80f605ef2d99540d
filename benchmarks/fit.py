"""`fit`'s workloads of issues 28 and 38, as a user runs them: the answers, the table, and how long the search
takes.

Run: ``python benchmarks/fit.py`` (writes benchmarks/fit.md). Wall time depends on the machine's load; the CPU time
(user + system of the command) is the figure to compare between runs.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

COMMANDS = (
    ["fit", "llama3-8b", "--cluster", "h100:8", "--seq", "8192"],
    ["fit", "llama3-70b", "--cluster", "h100", "--gpus", "auto", "--batch", "1", "--seq", "8192"],
    ["fit", "hf:gpt2", "--cluster", "h100:8", "--seq", "1024"],
)


def run(args: list[str]) -> tuple[str, float, float]:
    """The command's stdout, its wall seconds and its CPU seconds (user + system of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "fsdp_planner", *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "120"})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return out.stdout, wall, cpu


def main() -> None:
    lines = [
        "# `fit`: what fits a cluster, and how long the search takes",
        "",
        f"Measured by `python benchmarks/fit.py` on {platform.machine()} ({os.cpu_count()} cores), Python "
        f"{platform.python_version()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at the "
        "start. Each row is a trace of the model at that workload and auto's search as `plan` runs it (default "
        "`--search-effort`); the boundaries are located with auto's search without refinement and confirmed with "
        "the full one on both sides (`service/fit.py`). The figures are the simulator's (bf16-mixed, the cluster's "
        "compute roofline, reserved memory against the GPU less the default 5% headroom).",
    ]
    for args in COMMANDS:
        stdout, wall, cpu = run(args)
        lines += ["", f"## `fsdp-planner {' '.join(args)}`", "", f"CPU {cpu:.1f} s (user + system), wall {wall:.1f} s.",
                  "",
                  "```", stdout.rstrip(), "```"]
        print(f"{' '.join(args)}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)
    Path(__file__).with_name("fit.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
