"""torchtitan's own config-registry jobs beside auto's plan for each: the expert's configuration as shipped
(torchtitan at b5bcd76, tests/fixtures/torchtitan) is the baseline auto must meet.

Run: ``python benchmarks/torchtitan_jobs.py`` (writes benchmarks/torchtitan_jobs.md; about 3 min on 2 cores). Each
row is ``fsdp-planner plan --from-torchtitan FILE.py:JOB --cluster h100:N --json``: the job simulated as its keys
configure it (TP and EP kept, its checkpointing, its grouping), auto's plan for the same model, workload and cluster,
and the keys auto would change (the job's loss in its ChunkedLossWrapper chunks for both). The figures are the
simulator's (bf16-mixed, the preset's roofline); no GPU ran them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2**30
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torchtitan"

# (the job, the GPU count planned for): one node for the jobs sized for it, the GPU counts torchtitan's larger jobs
# are published or sized for beside it
JOBS = (
    ("llama3", "llama3_8b", 8), ("llama3", "llama3_70b", 64), ("llama3", "llama3_405b", 128),
    ("deepseek_v3", "deepseek_v3_16b", 8), ("deepseek_v3", "deepseek_v3_16b_hybridep", 8),
    ("gpt_oss", "gpt_oss_20b", 8), ("gpt_oss", "gpt_oss_120b", 32), ("kimi_k2_7", "moonlight_16b_a3b", 8),
    ("qwen3", "qwen3_14b", 8), ("qwen3", "qwen3_30b_a3b", 8), ("qwen3", "qwen3_32b", 16),
)


def plan(folder: str, job: str, gpus: int) -> tuple[dict | None, str, float]:
    """``plan --from-torchtitan``'s JSON (None where nothing fits: its message instead), and the seconds it took."""
    spec = f"{FIXTURES / folder / 'config_registry.py'}:{job}"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "fsdp_planner", "plan", "--from-torchtitan", spec, "--cluster",
                          f"h100:{gpus}", "--json"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "120"})
    seconds = time.perf_counter() - start
    if not out.stdout.strip():
        return None, out.stderr.strip().splitlines()[-1], seconds
    return json.loads(out.stdout), "", seconds


def _step(step: dict) -> str:
    return f"{step['step_time'] * 1e3:,.0f} ms, {step['reserved_memory'] / GIB:.1f} GiB" + \
        ("" if step["budget"]["fits"] else " (over)")


def row(folder: str, job: str, gpus: int) -> str:
    result, message, seconds = plan(folder, job, gpus)
    if result is None:
        return f"| `{folder}:{job}` | h100:{gpus} | - | - | - | {message} | {seconds:.0f} |"
    config, auto = result["config_step"], result["auto_step"]
    gain = auto["step_time"] / config["step_time"] - 1
    changes = ", ".join(f"{c['key']}: {c['config']} -> {c['auto']}" for c in result["changes"]) or "none"
    verdict = "fits" if result["fits"] else "nothing fits"
    return (f"| `{folder}:{job}` | h100:{gpus} | {_step(config)} | {_step(auto)} | {gain:+.1%} | {verdict}; "
            f"{changes} | {seconds:.0f} |")


def commit() -> str:
    """The checkout's commit the table was measured at (with '+' where files differ from it)."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True)
    return (head.stdout.strip() or "(no git)") + ("+" if dirty.stdout.strip() else "")


def main() -> None:
    lines = [
        "# torchtitan's shipped jobs beside auto's plan",
        "",
        f"Measured by `python benchmarks/torchtitan_jobs.py` at fsdp-planner {commit()} on {platform.machine()}, "
        f"torch {torch.__version__}: "
        "`fsdp-planner plan --from-torchtitan tests/fixtures/torchtitan/FOLDER/config_registry.py:JOB --cluster "
        "h100:N --json` for each row (torchtitan b5bcd76's config registry; bf16-mixed; the H100 preset's roofline, "
        "no GPU). 'auto' is free to choose grouping, checkpointing, reshard, offload, HSDP and the EP degree; the job "
        "keeps its keys, its loss among them (each job's ChunkedLossWrapper chunks: `--loss-chunks 8`, auto's too). "
        "Step and reserved memory per rank; '(over)' is above the 70.8 GiB budget.",
        "",
        "| job | cluster | the job as configured | auto | auto against the job | verdict; keys auto would change | "
        "plan s |",
        "|---|---|---|---|---|---|---|",
    ]
    for folder, job, gpus in JOBS:
        lines.append(row(folder, job, gpus))
        print(lines[-1], file=sys.stderr)
    Path(__file__).with_name("torchtitan_jobs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
