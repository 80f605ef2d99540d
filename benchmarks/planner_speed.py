"""Planner speed: trace + auto-plan of llama3-405b, and auto-plan of synthetic 10,000-module models.

Run: python benchmarks/planner_speed.py   (writes benchmarks/planner_speed.md; ~3 min on 2 cores)
Each case runs in a fresh process. Targets (issue 4): 405B trace + auto under 10 s; auto-plan of a
10,000-module trace under 2 s. The synthetic models are built here, on meta:
- "blocks": 1,000 blocks of 9 modules (2 LayerNorms, 6 Linears, GELU) in a ModuleList: 10,002 modules;
- "flat": 10,000 Linear(256, 256) in one Sequential: 10,001 modules, every one its own atom.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

CLUSTER = "h100:512"


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.act, self.down = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + self.o(torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h))
        return x + self.down(self.act(self.up(self.mlp_norm(x))))


class Blocks(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def build(case: str) -> tuple[nn.Module, tuple, object]:
    from fsdp_planner.models import load_model

    if case == "llama3-405b":
        lm = load_model(case)
        return lm.model, lm.example_inputs, lm.loss_fn
    with torch.device("meta"):
        if case == "blocks":
            return Blocks(1000, 128), (torch.randn(4, 64, 128),), lambda out: out.sum()
        return nn.Sequential(*(nn.Linear(256, 256) for _ in range(10_000))), (torch.randn(64, 256),), \
            lambda out: out.sum()


def child(case: str) -> None:
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners import AutoPolicy
    from fsdp_planner.trace import trace

    t0 = time.perf_counter()
    model, inputs, loss_fn = build(case)
    t1 = time.perf_counter()
    tr = trace(model, inputs, loss_fn)
    t2 = time.perf_counter()
    result = AutoPolicy(parse_cluster(CLUSTER)).search(tr, case)
    t3 = time.perf_counter()
    print(json.dumps({"modules": len(tr.modules), "events": len(tr.events), "build_s": t1 - t0,
                      "trace_s": t2 - t1, "auto_s": t3 - t2, "plans": result.evaluated,
                      "groups": len(result.plan.inner_groups)}))


def main() -> None:
    rows = []
    for case in ("llama3-405b", "blocks", "flat"):
        out = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, check=True)
        rows.append((case, json.loads(out.stdout.strip().splitlines()[-1])))
        print(case, rows[-1][1], file=sys.stderr)
    lines = [
        "# Planner speed",
        "",
        f"Measured by `python benchmarks/planner_speed.py` on {platform.machine()} ({platform.processor() or 'cpu'}), "
        f"Python {platform.python_version()}, one fresh process per case; auto plans for {CLUSTER} with no budget "
        "(its default search: classic policies, module-tree cuts, DP over two atom granularities, 2 s of refinement).",
        "",
        "| case | modules | trace events | trace (s) | auto-plan (s) | plans simulated | groups | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in rows:
        if case == "llama3-405b":
            total, limit, target = r["trace_s"] + r["auto_s"], 10, "trace + auto < 10 s"
        else:
            total, limit, target = r["auto_s"], 2, "auto < 2 s"
        met = "yes" if total < limit else "no"
        lines.append(f"| {case} | {r['modules']} | {r['events']} | {r['trace_s']:.2f} | {r['auto_s']:.2f} | "
                     f"{r['plans']} | {r['groups']} | {target} | {met} ({total:.1f} s) |")
    lines += [
        "",
        "Where the time goes on the 10,000-module cases: every simulated plan replays FSDP2's hooks over the whole "
        "trace (about 83,000 events after `trace.compact`), about 0.1-0.2 s per plan in Python, "
        "and the search simulates 20-35 plans (classic policies, module-tree cuts, DP plans, refinement). "
        "The 2 s target would need a vectorised replay or a coarser planning trace; it is not met.",
    ]
    Path(__file__).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child(sys.argv[1])
    else:
        main()
