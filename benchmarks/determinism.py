"""Same input, same plan: auto's plan does not depend on the machine's load (issue 23).

Run: python benchmarks/determinism.py   (writes benchmarks/determinism.md; ~2 min on 2 cores)
Each command runs three times as a user runs it (`fsdp-planner plan ... --json`, a fresh process each): alone, alone
again, and beside two CPU-bound processes (on a 2-core machine the planner then gets about a third of the CPU).
The JSON documents are compared whole, less `auto.seconds` (the wall time, the one field that may differ), and the
plan's own bytes are hashed.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

COMMANDS = [
    ["hf:qwen2.5-3b", "--cluster", "h100:64"],
    ["t5-3b", "--cluster", "h100:4096"],
    ["llama32-3b", "--cluster", "h100:4096"],
]
LOADS = ["idle", "idle", "2 CPU-bound processes beside it"]


def plan_json(args: list[str], busy: int) -> tuple[dict, float]:
    """One run's JSON document and wall seconds, with ``busy`` CPU-bound processes running beside it."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "fsdp_planner", "plan", *args, "--policy", "auto", "--json",
                              "--quiet"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout), time.perf_counter() - started
    finally:
        for b in burners:
            b.kill()
            b.wait()


def main() -> None:
    rows = []
    for args in COMMANDS:
        docs = []
        for load in LOADS:
            doc, wall = plan_json(args, 2 if "CPU-bound" in load else 0)
            seconds = doc["auto"].pop("seconds")
            plan = json.dumps(doc["plans"][0]["plan"], sort_keys=True).encode()
            docs.append(json.dumps(doc, sort_keys=True))
            rows.append((" ".join(args), load, hashlib.sha256(plan).hexdigest()[:16], doc["auto"]["plans_simulated"],
                         doc["auto"]["plans_refined"], doc["auto"]["search_effort"], seconds, wall))
            print(rows[-1], file=sys.stderr)
        rows.append((" ".join(args), "identical", str(len(set(docs)) == 1), None, None, None, None, None))
    lines = [
        "# Determinism: the same command gives the same plan under any load",
        "",
        f"Measured by `python benchmarks/determinism.py` on {platform.machine()} ({_cores()} cores), Python "
        f"{platform.python_version()}, torch {torch.__version__}. Each command is "
        "`fsdp-planner plan MODEL --policy auto --cluster C --json`, run three times in a fresh process; the third "
        "beside two CPU-bound processes. 'identical' compares the whole JSON documents less `auto.seconds`.",
        "",
        "| command | load | plan sha256 | plans simulated | refining | search effort | auto (s) | command (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cmd, load, digest, evaluated, refined, effort, seconds, wall in rows:
        if evaluated is None:
            lines.append(f"| {cmd} | **identical** | **{digest.lower()}** | | | | | |")
        else:
            lines.append(f"| {cmd} | {load} | `{digest}` | {evaluated} | {refined} | {effort} | {seconds:.2f} | "
                         f"{wall:.2f} |")
    lines += ["", "The search is bounded by plans simulated (`--search-effort`), never by the clock: the load changes "
              "the seconds, not the plan."]
    (Path(__file__).parent / "determinism.md").write_text("\n".join(lines) + "\n")


def _cores() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    main()
