"""``plan --from-torchtitan JOB.toml`` / ``--from-accelerate CONFIG.yaml``: the config's job beside auto's plan for
the same model, workload, precision and cluster, the config keys auto would set otherwise (old -> new), and the
best edit of the config's keys alone (its grouping kept, every checkpointing mode and reshard rule the format has,
on its mesh or auto's): what changing the config buys before the grouping, which no key expresses, is exported as
code."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import Any

from rich.markup import escape
from rich.table import Table

import fsdp_planner.cli.render as render
from fsdp_planner.choices import ACMode, PolicyName
from fsdp_planner.cli.common import load_trace, policy_plan, run_auto
from fsdp_planner.cli.from_config import adjusted, configured
from fsdp_planner.cli.requests import (
    gradient_sync,
    memory_budget,
    micro_batches,
    model_spec,
    policy_request,
    sim_options,
)
from fsdp_planner.configs.job_config import TORCHTITAN, JobConfig
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time, json_text
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.planners.auto import infeasible_message
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.options import plan_options
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import write_atomic


@dataclasses.dataclass(frozen=True)
class Change:
    """One config key auto would set otherwise; ``expressible``: False when no value of the key says auto's."""

    key: str
    old: str
    new: str
    expressible: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "config": self.old, "auto": self.new, "expressible": self.expressible}


@dataclasses.dataclass
class Setting:
    """A job's settings that config keys express, as auto's plan or the config has them (None: not expressible)."""

    ac: ACMode | None
    reshard: str | None  # "default", "always", "never"
    mesh: Mesh
    offload: bool


@dataclasses.dataclass
class Result:
    config_plan: Plan
    auto: Plan
    before: StepReport
    after: StepReport
    edit: tuple[list[Change], StepReport] | None  # the best config edit alone (its own grouping), and its step
    changes: list[Change]
    budget: MemoryBudget
    precision: str
    fits: bool
    no_fit: str | None


def run_plan(args: argparse.Namespace) -> int:
    """``plan --from-X``: print (or ``--json``) the comparison; exit 1 when auto finds no plan within the budget."""
    if args.policy not in (None, PolicyName.AUTO.value):
        raise PlannerError("plan --from-torchtitan / --from-accelerate compares the config's job with auto's plan: "
                           "drop --policy (simulate --from-... simulates the config's own grouping)")
    if args.explain or str(args.micro_batches).strip().lower() == "auto":
        raise PlannerError("--explain and --micro-batches auto go with plan MODEL --policy auto, not with "
                           "--from-torchtitan / --from-accelerate")
    cfg = configured(args)
    assert cfg is not None
    result = plan_from_config(args, cfg)
    if args.out is not None:
        write_atomic(args.out, result.auto.copy(precision=result.precision).checked_json() + "\n")
    if args.json:
        print(json_text(_json(result, cfg, args), indent=2))
    else:
        _print(result, cfg, args)
    return 0 if result.fits else 1


def plan_from_config(args: argparse.Namespace, cfg: JobConfig) -> Result:
    cluster, options = parse_cluster(args.cluster), sim_options(args)
    budget = memory_budget(args, cluster)
    tr = load_trace(model_spec(args), render.notes, full=args.full_trace, precision=options.precision)
    config_plan = adjusted(policy_plan(tr, policy_request(args, cfg.policy.value), args.model, cluster, options), cfg)
    before = _simulated(tr, config_plan, cluster, args)
    free = argparse.Namespace(**{**vars(args), "ac": None, "ac_policy": None, "mesh": None, "offload": False})
    found = run_auto(tr, policy_request(free, PolicyName.AUTO.value), cluster, sim_options(free), args.model,
                     must_fit=False)
    old, new = _config_setting(cfg, cluster), _plan_setting(found.plan, tr, cluster)
    changes = _changes(cfg, old, new, config_plan, found.plan)
    best = _best_edit(args, cfg, tr, cluster, old, new, budget, before)
    edit = (_changes(cfg, old, best[0], config_plan, None), best[1]) if best else None
    return Result(config_plan, found.plan, before, found.report, edit, changes, budget,
                  options.precision.name, found.fits, None if found.fits else infeasible_message(found))


def _simulated(tr: Trace, plan: Plan, cluster: Cluster, args: argparse.Namespace) -> StepReport:
    return simulate(tr, plan, cluster, plan_options(plan, sim_options(args)), timeline=False)


def _config_setting(cfg: JobConfig, cluster: Cluster) -> Setting:
    world = cluster.world_size
    return Setting(cfg.ac or ACMode.NONE, cfg.reshard, Mesh(cfg.replicate, world // cfg.replicate), cfg.offload)


def _plan_setting(plan: Plan, tr: Trace, cluster: Cluster) -> Setting:
    """What config keys would say of ``plan``: uniform checkpointing of the blocks, one reshard rule."""
    blocks = set(block_instances(tr))
    full, op = set(plan.activation_checkpointing), set(plan.selective_checkpointing)
    ac = (ACMode.NONE if not full and not op else ACMode.FULL if full == blocks and not op
          else ACMode.OP if op == blocks and not full else None)
    flags = [g.reshard_after_forward for g in plan.inner_groups]
    reshard = ("always" if all(f is True for f in flags) else "never" if all(f is False for f in flags)
               else "default" if flags and all(f is True for f in flags[:-1]) and flags[-1] is False else None)
    return Setting(ac, reshard, plan.layout(cluster.world_size), plan.offload)


def _ac_text(cfg: JobConfig, mode: ACMode | None, plan: Plan | None = None) -> str:
    if mode is None and plan is not None:
        full, op = len(plan.activation_checkpointing), len(plan.selective_checkpointing)
        return "per block: " + " + ".join([*([f"{full} full"] if full else []), *([f"{op} op-level"] if op else [])])
    if cfg.kind == TORCHTITAN:
        return {ACMode.NONE: "none", ACMode.FULL: "full", ACMode.OP: 'selective, selective_ac_option = "op"',
                ACMode.SELECTIVE: 'selective, selective_ac_option = "2"'}[mode or ACMode.NONE]
    return {ACMode.NONE: "false", ACMode.FULL: "true"}.get(mode or ACMode.NONE, f"{(mode or ACMode.NONE).value} "
                                                                                 "(not an Accelerate setting)")


def _reshard_text(cfg: JobConfig, value: str | None, plan: Plan | None = None) -> str:
    if value is None and plan is not None:
        flags = [str(g.reshard_after_forward) for g in plan.inner_groups]
        return "per group: " + ", ".join(f"{flags.count(v)} x {v}" for v in dict.fromkeys(flags))
    if cfg.kind == TORCHTITAN:
        return str(value)
    return {"always": "true", "never": "false"}.get(str(value), f"{value} (the wrap policy's own)")


def _changes(cfg: JobConfig, old: Setting, new: Setting, config_plan: Plan, auto: Plan | None) -> list[Change]:
    """The keys whose value differs, each old -> new; a value no key can say is marked not expressible. With
    ``auto``, its grouping last."""
    out = []
    if new.ac != old.ac:
        ok = new.ac is not None and (cfg.kind == TORCHTITAN or new.ac in (ACMode.NONE, ACMode.FULL))
        out.append(Change(cfg.key("ac"), _ac_text(cfg, old.ac), _ac_text(cfg, new.ac, auto), ok))
    if new.reshard != old.reshard:
        ok = new.reshard is not None and (cfg.kind == TORCHTITAN or new.reshard != "default")
        out.append(Change(cfg.key("reshard"), _reshard_text(cfg, old.reshard), _reshard_text(cfg, new.reshard, auto),
                          ok))
    if new.mesh != old.mesh:
        out.append(Change(cfg.key("replicate"), str(old.mesh.replicate), str(new.mesh.replicate)))
        out.append(Change(cfg.key("shard"), str(old.mesh.shard), str(new.mesh.shard)))
    if new.offload != old.offload:
        out.append(Change(cfg.key("offload"), str(old.offload).lower(), str(new.offload).lower()))
    if auto is not None:
        out.append(Change(cfg.key("policy"), f"{config_plan.policy}: {len(config_plan.groups)} groups",
                          f"{len(auto.groups)} groups", False))
    return out


def _edited(args: argparse.Namespace, cfg: JobConfig, tr: Trace, cluster: Cluster,
            setting: Setting) -> StepReport | None:
    """The config's own grouping with ``setting``'s keys: the step a config edit alone gives (None: the config's
    policy cannot take them)."""
    ac, mesh = setting.ac or ACMode.NONE, setting.mesh
    edited = argparse.Namespace(**{**vars(args), "ac": ac.value if ac is not ACMode.NONE else None,
                                   "ac_policy": None if ac is not ACMode.OP else args.ac_policy,
                                   "mesh": f"{mesh.replicate}x{mesh.shard}" if mesh.replicate > 1 else None,
                                   "offload": setting.offload})
    try:
        plan = policy_plan(tr, policy_request(edited, cfg.policy.value), args.model, cluster, sim_options(edited))
    except PlannerError:
        return None
    return _simulated(tr, adjusted(plan, dataclasses.replace(cfg, reshard=setting.reshard or cfg.reshard)), cluster,
                      edited)


def _best_edit(args: argparse.Namespace, cfg: JobConfig, tr: Trace, cluster: Cluster, old: Setting, new: Setting,
               budget: MemoryBudget, before: StepReport) -> tuple[Setting, StepReport] | None:
    """The fastest setting config keys can express (checkpointing x reshard rule x the config's or auto's mesh) on
    the config's grouping that fits the budget and beats the config's step; None when no edit does."""
    # activation offloading is no option of these configs' activation checkpointing
    modes = [m for m in ACMode if m is not ACMode.OFFLOAD] if cfg.kind == TORCHTITAN else [ACMode.NONE, ACMode.FULL]
    rules = ["default", "always", "never"] if cfg.kind == TORCHTITAN else ["always", "never"]
    best: tuple[Setting, StepReport] | None = None
    for mode, rule, mesh in itertools.product(modes, dict.fromkeys([old.reshard, *rules]),
                                              dict.fromkeys([old.mesh, new.mesh])):
        setting = Setting(mode, rule, mesh, old.offload)
        if setting == old:
            continue
        r = _edited(args, cfg, tr, cluster, setting)
        bar = best[1].step_time if best else before.step_time
        if r is not None and budget.fits(r.reserved_memory) and r.step_time < bar:
            best = (setting, r)
    return best


def _json(result: Result, cfg: JobConfig, args: argparse.Namespace) -> dict[str, Any]:
    def step(r: StepReport | None) -> dict[str, Any] | None:
        return None if r is None else {**r.summary(), "budget": result.budget.to_dict(r.reserved_memory)}

    return {"config": {"format": cfg.kind, "path": cfg.path, "notes": cfg.notes}, "model": args.model,
            "cluster": args.cluster, "micro_batches": micro_batches(args),
            "gradient_sync": gradient_sync(args), "config_step": step(result.before), "auto_step": step(result.after),
            "changes": [c.to_dict() for c in result.changes],
            "best_edit": None if result.edit is None else {"changes": [c.to_dict() for c in result.edit[0]],
                                                           "step": step(result.edit[1])},
            "fits": result.fits, **({"message": result.no_fit} if result.no_fit else {}),
            "plan": result.auto.to_dict()}


def _print(result: Result, cfg: JobConfig, args: argparse.Namespace) -> None:
    t = Table(title=f"{cfg.kind} config keys auto would change ({args.model} on {args.cluster})",
              title_justify="left")
    for col in ("key", "config", "auto"):
        t.add_column(col, overflow="fold")
    for c in result.changes:
        t.add_row(escape(c.key), escape(c.old), escape(c.new) + ("" if c.expressible else " (not expressible)"))
    render.console.print(t)
    base = result.before.step_time
    edit = result.edit[1] if result.edit else None
    for label, r in (("config's job", result.before), ("auto's plan", result.after),
                     ("best config edit alone (its own grouping)", edit)):
        if r is None:
            continue
        gain = "" if r is result.before else f" ({(r.step_time - base) / base:+.1%} against the config's)"
        over = "" if result.budget.fits(r.reserved_memory) else " (over the budget)"
        render.plain(f"{label}: step {fmt_time(r.step_time)}{gain}, reserved {fmt_bytes(r.reserved_memory)}{over}")
    if result.edit is not None:
        render.plain("  the edit: " + "; ".join(f"{c.key} = {c.new}" for c in result.edit[0]))
    else:
        render.plain("no edit of the config's keys alone (its own grouping) is faster within the budget")
    fmt = "torchtitan" if cfg.kind == TORCHTITAN else "accelerate"
    render.plain(f"auto's grouping ({len(result.auto.groups)} groups) is not expressible as {cfg.kind} config keys: "
                 f"write it with --out plan.json, then `fsdp-planner export plan.json --format {fmt}`")
    if result.no_fit:
        render.plain(f"auto: {result.no_fit}")
    if args.out is not None:
        render.plain(f"plan written to {args.out}")
