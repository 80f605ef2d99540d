"""``fsdp-planner demo``: the seed's problem on the small built-in models, then the main job: auto's plan against the
classic policies on a real cluster, with step time, exposed communication, memory against the GPU, why each
boundary sits where it does, and the timelines drawn."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.cli.common import REPORTER, tracer
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_gain, fmt_time, json_text
from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.models import ModelSpec, resolve_factory
from fsdp_planner.planners.registry import CLASSIC_POLICIES, PolicyName, PolicyRequest
from fsdp_planner.report.step_view import step_view
from fsdp_planner.report.timeline_html import write_html
from fsdp_planner.report.timeline_png import write_png
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.outcome import Row
from fsdp_planner.service.planning import Reporter, plan
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.metrics import PlanMetrics
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport

# Size thresholds: 2000 for the CNN (what its forum question used); for the toy decoder one that wraps inside blocks,
# as size-based wrapping does on real transformers.
SEED_MODELS = {"seed-net": 2000, "toy-llama": 20_000}


def run(args: argparse.Namespace) -> int:
    resolve_factory(args.model)  # a model that does not exist is said before a minute of demo, not after
    out_dir = _out_dir(args.out_dir)
    cluster = parse_cluster(args.cluster)
    quiet = render.console.quiet
    render.console.quiet = quiet or args.json  # the same work; the tables give way to one JSON document
    try:
        render.console.rule("[bold]1. The seed's problem: what classic wrap policies do[/bold]")
        seed = [_seed_problem(spec, threshold) for spec, threshold in SEED_MODELS.items()]
        render.console.rule(f"[bold]2. The main job: {escape(args.model)} on {escape(cluster.name)}[/bold]")
        main = _main_job(args.model, cluster, out_dir)
        render.console.print(escape(f"\nnext: fsdp-planner plan {args.model} --policy auto --cluster {cluster.name} "
                                    f"--out plan.json; fsdp-planner verify {args.model} --plan plan.json "
                                    f"--fake-world-size {cluster.world_size}"), highlight=False)
    finally:
        render.console.quiet = quiet
    if args.json:
        print(json_text({"seed": seed, "main": main}, indent=2))
    return 0


def _out_dir(arg: str) -> Path:
    path = Path(arg)
    if path.exists() and not path.is_dir():
        raise PlannerError(f"--out-dir '{arg}' is a file: give a directory for the pictures")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlannerError(f"cannot create --out-dir '{arg}': {e.strerror or e}") from None
    return path


def seed_job(spec: str, threshold: int) -> PlanJob:
    """The classic policies on a small model, without a cluster (size-based wrapping at ``threshold``)."""
    policies = tuple(PolicyRequest(name, min_nonwrapped_numel=threshold) for name in CLASSIC_POLICIES)
    return PlanJob(ModelSpec(spec), policies, None, SimOptions())


def main_job(model: str, cluster: Cluster) -> PlanJob:
    """Auto against the classic policies (as run plain, and torchtitan's with every block checkpointed) on
    ``cluster``: a comparison, auto's plan shown over the budget too."""
    policies = (*(PolicyRequest(name) for name in CLASSIC_POLICIES),
                PolicyRequest(PolicyName.TITAN, checkpointing=ACMode.FULL), PolicyRequest(PolicyName.AUTO))
    budget = MemoryBudget.of_gpu(cluster.gpu.memory_bytes, cluster.gpu.name)  # auto's: the GPU less the headroom
    return PlanJob(ModelSpec(model), policies, cluster, SimOptions(), budget, compare=True, must_fit=False,
                   explain=True)


def _seed_problem(spec: str, threshold: int) -> dict[str, Any]:
    """The classic policies on a small model, and the one sentence that says what goes wrong."""
    console = render.console
    outcome = plan(seed_job(spec, threshold), tracer(False, False), REPORTER)
    tr, rows = outcome.trace, outcome.rows
    plans = {p.name: row for p, row in zip(outcome.job.policies, rows, strict=True)}
    console.print(render.model_line(spec, tr))
    if spec == "seed-net":
        console.print(render.groups_table(plans[PolicyName.SIZE][0], tr))
    console.print(render.comparison_table(f"{spec}: per training step (FSDP2 semantics)", rows,
                                          dtype=render.metrics_dtype(tr, outcome.job.options.precision)))
    blamed = PolicyName.SIZE if spec == "seed-net" else PolicyName.MODULE
    root = plans[blamed][0].root
    out = {"model": spec, "plans": [{"policy": p.policy, "metrics": m.to_dict()} for p, m, _ in rows],
           "root_holds": {"policy": plans[blamed][0].policy, "modules": []}}
    if not root.params:
        return out
    mods = sorted({m for p in root.params for m in tr.param(p).owners})
    idle = {name: plans[name][1].avg_idle_bytes for name in (blamed, PolicyName.ORDER)}
    how = "size-based wrapping" if blamed is PolicyName.SIZE else "per-block wrapping (ModuleWrapPolicy)"
    console.print(f"{how}: the root unit holds {', '.join(mods)} together and keeps them gathered from the first op "
                  f"of forward to the end of backward ({fmt_bytes(idle[blamed])} idle on average); the "
                  f"execution-order plan gives each its own group, the root manages nothing "
                  f"({fmt_bytes(idle[PolicyName.ORDER])} idle).\n", highlight=False)
    out["root_holds"]["modules"] = mods
    return out


def _main_job(model: str, cluster: Cluster, out_dir: Path) -> dict[str, Any]:
    """Auto against the classic policies, the fastest classic plan beside it, and both timelines drawn."""
    console = render.console
    job = main_job(model, cluster)
    held: list[str] = []  # the run's notes (a policy left out), said under the model and cluster they are about
    outcome = plan(job, tracer(False, False), Reporter(held.append, render.progress))
    tr, rows, budget, search = outcome.trace, outcome.rows, job.budget, outcome.search
    assert budget is not None and search is not None
    console.print(render.model_line(model, tr))
    console.print(escape(f"cluster {cluster.describe()}"), highlight=False)
    for line in held:
        render.note(line)
    console.print(render.comparison_table(escape(f"{model} on {cluster.name}: per training step; reserved memory "
                                                 f"against {fmt_bytes(budget.limit)} ({budget.source})"), rows,
                                          budget, render.metrics_dtype(tr, job.options.precision)))
    console.print(render.auto_line(search), highlight=False)
    out: dict[str, Any] = {
        "model": model, "cluster": cluster.name, "capacity": budget.capacity,
        "plans": [{"policy": _label(p), "groups": len(p.inner_groups), "simulation": r.summary(),
                   "fits": budget.fits(r.reserved_memory), "budget": budget.to_dict(r.reserved_memory)}
                  for p, _, r in _simulated(rows)],
        "auto": {"fits": search.fits, "layout": search.report.mesh, "groups": len(search.plan.inner_groups),
                 "checkpointed": len(search.plan.activation_checkpointing), "step_time": search.report.step_time,
                 "reserved_memory": search.report.reserved_memory},
        "rival": None, "timelines": []}
    if outcome.no_fit is not None:
        render.plain(f"auto: {outcome.no_fit}")
        return out
    fastest = outcome.fastest_baseline()
    assert fastest is not None  # (a comparison on a cluster: every row simulated)
    rival, rival_report, fits = fastest
    which = "the fastest classic plan that fits" if fits else "the fastest classic plan (none fits)"
    auto = search.report
    gain = fmt_gain(auto.step_time, rival_report.step_time) or "a tie"
    render.plain(f"auto against {_label(rival)}, {which}: step {fmt_time(auto.step_time)} against "
                 f"{fmt_time(rival_report.step_time)} ({gain}), {fmt_bytes(auto.reserved_memory)} reserved "
                 f"against {fmt_bytes(rival_report.reserved_memory)}; auto's peak is "
                 f"{budget.margin(auto.reserved_memory)}")
    assert outcome.explanation is not None
    for part in render.explanation(outcome.explanation.groups, auto.step_time, auto.reserved_memory, collapse=True):
        console.print(part, highlight=False)
    views = [step_view(tr, p, cluster, job.options, _label(p), budget) for p in (search.plan, rival)]
    title = f"{model} on {cluster.describe()}"
    png, page = out_dir / "timeline.png", out_dir / "timeline.html"
    write_png(views, png, title)
    write_html(views, page, title)
    render.plain(f"timelines of both on one time axis: {png} and {page} (open the HTML in a browser: hover for "
                 "group names, scroll to zoom)")
    out["rival"] = {"policy": _label(rival), "fits": fits, "step_time": rival_report.step_time,
                    "reserved_memory": rival_report.reserved_memory}
    out["timelines"] = [str(png), str(page)]
    return out


def _simulated(rows: tuple[Row, ...]) -> list[tuple[Plan, PlanMetrics, StepReport]]:
    """The rows of a job with a cluster: every one simulated."""
    return [(p, m, r) for p, m, r in rows if r is not None]


def _label(plan: Plan) -> str:
    """The plan's policy, and how many modules it checkpoints unless the policy's name says so."""
    ac = len(plan.activation_checkpointing)
    if not ac or "ac " in plan.policy:
        return plan.policy
    return f"{plan.policy}, {ac} module{'s' if ac != 1 else ''} checkpointed"

