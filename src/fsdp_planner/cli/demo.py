"""``fsdp-planner demo``: what classic wrap policies do on the built-in models, beside the execution-order plan."""

from __future__ import annotations

import argparse

from fsdp_planner.cli import render
from fsdp_planner.cli.common import load_trace
from fsdp_planner.planners.registry import CLASSIC_POLICIES, PolicyName, PolicyRequest, make_policy
from fsdp_planner.sim.metrics import plan_metrics

# Size thresholds: 2000 for the CNN (what its forum question used); for the toy decoder one that wraps inside blocks,
# as size-based wrapping does on real transformers.
DEMO_MODELS = {"seed-net": 2000, "toy-llama": 20_000}


def register(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser("demo", help="classic wrap policies vs the execution-order plan on the built-in models")
    sp.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    console = render.console
    for spec, threshold in DEMO_MODELS.items():
        tr = load_trace(spec, render.notes)
        plans = {name: make_policy(PolicyRequest(name, min_nonwrapped_numel=threshold)).plan(tr, spec)
                 for name in CLASSIC_POLICIES}
        console.rule(f"[bold]{spec}[/bold]: {tr.numel:,} params")
        for name in (PolicyName.SIZE, PolicyName.ORDER):
            console.print(render.groups_table(plans[name], tr))
        rows = [(p, plan_metrics(tr, p), None) for p in plans.values()]
        console.print(render.comparison_table(f"{spec}: per training step (FSDP2 semantics)", rows))
        size_root = plans[PolicyName.SIZE].root
        if spec == "seed-net" and size_root.params:
            mods = sorted({m for p in size_root.params for m in tr.param(p).owners})
            console.print(f"size-based: the root unit holds {', '.join(mods)} together and keeps them gathered from "
                          "the first op of forward to the end of backward; the execution-order plan gives each its "
                          "own group and the root manages nothing.")
    console.print("\nnext: fsdp-planner plan MODEL --policy order --out plan.json; "
                  "fsdp-planner verify MODEL --plan plan.json --nproc 2")
    return 0
