"""Trace speed and memory of the planning-only built-ins on this machine.

Run: python benchmarks/trace_speed.py   (writes benchmarks/trace_speed.md)
Each model is traced in a fresh process so its peak RSS is its own.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

MODELS = ["llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b"]

CHILD = """
import json, resource, sys, time
from fsdp_planner.models import load_model
from fsdp_planner.planners import ExecutionOrderPolicy
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.trace import record
t0 = time.perf_counter()
lm = load_model(sys.argv[1])
t1 = time.perf_counter()
tr = record(lm.model, lm.example_inputs, lm.loss_fn)
t2 = time.perf_counter()
plan = ExecutionOrderPolicy().plan(tr)
plan_metrics(tr, plan)
t3 = time.perf_counter()
print(json.dumps({"numel": tr.numel, "events": len(tr.events), "build_s": t1 - t0, "trace_s": t2 - t1,
                  "plan_s": t3 - t2, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    rows = []
    for name in MODELS:
        out = subprocess.run([sys.executable, "-c", CHILD, name], capture_output=True, text=True, check=True)
        rows.append((name, json.loads(out.stdout.strip().splitlines()[-1])))
    lines = [
        "# Trace speed",
        "",
        f"Measured by `python benchmarks/trace_speed.py` on {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}; one process per model (peak RSS includes the Python + torch import).",
        "",
        "| model | params | events | build on meta (s) | trace fwd+bwd (s) | order plan + metrics (s) "
        "| peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['numel'] / 1e9:.2f}B | {r['events']} | {r['build_s']:.2f} | {r['trace_s']:.2f} "
                     f"| {r['plan_s']:.2f} | {r['rss_mib']:.0f} |")
    Path(__file__).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
