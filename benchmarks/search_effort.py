"""What auto's default search effort gives up: each row of plan_quality.md searched with the default
``--search-effort`` and with no bound at all (issue 23).

Run: python benchmarks/search_effort.py   (writes benchmarks/search_effort.md; ~8 min on 2 cores)
The default bounds the local refinement at 6,000,000 trace events' worth of simulated plans (at least 24). A row
where the refinement used its whole effort is one the bound stopped; the table says whether an unbounded search
(10^9 plans: the refinement runs until a full sweep changes nothing) finds another plan, and how much faster it is.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners.auto import AutoPolicy

sys.path.insert(0, str(Path(__file__).parent))
from plan_quality import MODELS, planning_trace  # the same rows, traced alike

UNBOUNDED = 10**9


def main() -> None:
    started = time.perf_counter()
    rows = []
    for model, (_, gpus) in MODELS.items():
        tr, _ = planning_trace(model)
        for n in gpus:
            cluster = parse_cluster(f"h100:{n}")
            t0 = time.process_time()
            bounded = AutoPolicy(cluster).search(tr, model)
            t1 = time.process_time()
            free = AutoPolicy(cluster, search_effort=UNBOUNDED).search(tr, model)
            t2 = time.process_time()
            rows.append({"model": model, "gpus": n, "events": len(tr.events), "effort": bounded.effort,
                         "refined": bounded.refined, "refined_unbounded": free.refined,
                         "same": bounded.plan.to_dict() == free.plan.to_dict(),
                         "step": bounded.report.step_time, "step_unbounded": free.report.step_time,
                         "cpu_s": t1 - t0, "cpu_s_unbounded": t2 - t1})
            print(json.dumps(rows[-1]), file=sys.stderr)
    same = sum(r["same"] for r in rows)
    lines = [
        "# Search effort: the default bound against none",
        "",
        f"Measured by `python benchmarks/search_effort.py` ({time.perf_counter() - started:.0f} s on "
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}): every row of "
        "`benchmarks/plan_quality.md`, auto with the default `--search-effort` beside auto with none "
        f"({UNBOUNDED:.0e} plans). **The same plan on {same} of {len(rows)} rows.**",
        "",
        "| model | GPUs | trace events | effort (plans) | refined | refined, unbounded | same plan | step gained "
        "unbounded | auto CPU s | unbounded CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gain = 1 - r["step_unbounded"] / r["step"]
        lines.append(f"| {r['model']} | {r['gpus']} | {r['events']:,} | {r['effort']} | {r['refined']} | "
                     f"{r['refined_unbounded']} | {'yes' if r['same'] else 'no'} | {gain:+.3%} | {r['cpu_s']:.2f} | "
                     f"{r['cpu_s_unbounded']:.2f} |")
    lines += ["", "'refined' equal to the effort: the bound stopped the refinement there (its plans are shared between "
              "the layouts searched and the three starts, so a start may stop before the total is spent)."]
    (Path(__file__).parent / "search_effort.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
