"""``plan --from-torchtitan JOB.toml`` / ``--from-accelerate CONFIG.yaml``: the config's job beside auto's plan for
the same model, workload, precision and cluster, the config keys auto would set otherwise (old -> new), and the
best edit of the config's keys alone (its grouping kept, every checkpointing mode and reshard rule the format has,
on its mesh or auto's): what changing the config buys before the grouping, which no key expresses, is exported as
code."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from rich.markup import escape
from rich.table import Table

import fsdp_planner.cli.render as render
from fsdp_planner.apply.torchtitan_job import FLAVORS
from fsdp_planner.choices import ACMode, PolicyName
from fsdp_planner.cli.common import REPORTER, run_flags, tracer
from fsdp_planner.cli.requests import configured, keywords
from fsdp_planner.configs.job_config import TORCHTITAN, JobConfig
from fsdp_planner.configs.torchtitan_registry import PLAN_NAME
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_count, fmt_time, json_text
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.planners.auto import PeakTerm
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.planners.config_edit import Setting
from fsdp_planner.service.configured import ConfigOutcome, compare_config
from fsdp_planner.service.fit import offload_verdict
from fsdp_planner.service.planning import as_written
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.simulate import StepReport
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


@dataclasses.dataclass(frozen=True)
class Result:
    """The comparison as printed: the config's job and auto's plan, the keys that differ, the best edit alone."""

    outcome: ConfigOutcome
    changes: list[Change]
    edit: tuple[list[Change], StepReport] | None  # the best config edit alone (its own grouping), and its step

    @property
    def before(self) -> StepReport:
        report = self.outcome.config.report
        assert report is not None
        return report

    @property
    def after(self) -> StepReport:
        assert self.outcome.auto.search is not None
        return self.outcome.auto.search.report

    @property
    def exported(self) -> StepReport | None:
        """Auto's plan as its torchtitan export runs where that keeps torchtitan's groups (an EP plan)."""
        return self.outcome.exported[1] if self.outcome.exported else None

    @property
    def auto(self) -> Plan:
        assert self.outcome.auto.search is not None
        return self.outcome.auto.search.plan

    @property
    def budget(self) -> MemoryBudget:
        assert self.outcome.config.job.budget is not None
        return self.outcome.config.job.budget

    @property
    def fits(self) -> bool:
        return self.outcome.auto.fits

    @property
    def no_fit(self) -> str | None:
        return self.outcome.auto.no_fit


def run_plan(args: argparse.Namespace) -> int:
    """``plan --from-X``: print (or ``--json``) the comparison; exit 1 when auto finds no plan within the budget."""
    if args.policy not in (None, PolicyName.AUTO.value):
        raise PlannerError("plan --from-torchtitan / --from-accelerate compares the config's job with auto's plan: "
                           "drop --policy (simulate --from-... simulates the config's own grouping)")
    if args.explain or str(args.micro_batches).strip().lower() == "auto":
        raise PlannerError("--explain and --micro-batches auto go with plan MODEL --policy auto, not with "
                           "--from-torchtitan / --from-accelerate")
    given, cfg = configured(args)
    assert cfg is not None
    kw = keywords(given)
    outcome = compare_config(kw, cfg, tracer(False, bool(args.full_trace)), REPORTER,
                             early_stop_given=args.early_stop is not None)
    verdict = offload_verdict(outcome.auto, tracer(False, bool(args.full_trace)), REPORTER)
    if verdict is not None and args.no_offload:
        raise PlannerError(f"{verdict} (--no-offload)")
    result = _result(outcome, cfg)
    if args.out is not None:  # as plan --out writes it (even over the budget: the exit status says so)
        write_atomic(args.out, as_written(result.auto, outcome.auto.job, outcome.auto.trace).checked_json() + "\n")
    if args.json:
        print(json_text({**_json(result, cfg, given), **({"verdict": verdict} if verdict else {})}, indent=2))
    else:
        if verdict is not None:  # the first line: auto's plan below is its last resort
            render.plain(verdict)
        _print(result, cfg, given, run_flags(outcome.auto.job, False, workload=True))
    return 0 if result.fits else 1


def _result(outcome: ConfigOutcome, cfg: JobConfig) -> Result:
    config_plan = outcome.config.rows[0][0]
    blocks = len(block_instances(outcome.auto.trace))
    changes = _changes(cfg, outcome.old, outcome.new, config_plan, outcome.auto.search.plan
                       if outcome.auto.search else None, blocks)
    changes += _batch_change(cfg, outcome.old, outcome.new, outcome.config.job.model.workload())
    edit = (_changes(cfg, outcome.old, outcome.edit[0], config_plan, None, blocks), outcome.edit[1]) \
        if outcome.edit else None
    return Result(outcome, changes, edit)


# torchtitan's current checkpointing classes (its every-k-th-block option is gone)
REGISTRY_AC = {ACMode.NONE: "None", ACMode.FULL: "FullAC.Config()", ACMode.OP: "SelectiveAC.Config()"}


def _ac_text(cfg: JobConfig, mode: ACMode | None, plan: Plan | None = None, blocks: int = 0) -> str:
    """The checkpointing a key says, or a plan's per block (``blocks``: the model's, so the ones left
    uncheckpointed are counted too: "19 op-level" read as every block checkpointed)."""
    if mode is None and plan is not None and (plan.activation_checkpointing or plan.selective_checkpointing):
        full, op = len(plan.activation_checkpointing), len(plan.selective_checkpointing)
        whole = "" if plan.checkpoint_early_stop else ", re-run whole (early_stop=False)"
        left = blocks - full - op - len(plan.activation_offloading)  # (the offloaded said apart)
        return "per block: " + " + ".join([*([f"{full} full"] if full else []),
                                           *([f"{op} op-level"] if op else []),
                                           *([f"{left} none"] if left > 0 else [])]) + whole
    if cfg.registry:
        return REGISTRY_AC.get(mode or ACMode.NONE, f"{(mode or ACMode.NONE).value} (no torchtitan class)")
    if cfg.kind == TORCHTITAN:
        return {ACMode.NONE: "none", ACMode.FULL: "full", ACMode.OP: 'selective, selective_ac_option = "op"',
                ACMode.SELECTIVE: 'selective, selective_ac_option = "2"'}[mode or ACMode.NONE]
    return {ACMode.NONE: "false", ACMode.FULL: "true"}.get(mode or ACMode.NONE, f"{(mode or ACMode.NONE).value} "
                                                                                 "(not an Accelerate setting)")


def _reshard_text(cfg: JobConfig, value: str | None, plan: Plan | None = None, replicate: int = 1) -> str:
    """The reshard rule as the config's key says it; an Accelerate job's true (FSDP1: FULL_SHARD, or HYBRID_SHARD
    on ``replicate`` machines) is the wrap policy's own rule, every wrapped group resharded ("always" or
    "default" here: the root, and Accelerate's carved tail, kept gathered either way)."""
    if value is None and plan is not None:
        flags = [str(f) for f in _flags(plan)]
        return "per group: " + ", ".join(f"{flags.count(v)} x {v}" for v in dict.fromkeys(flags))
    if cfg.kind == TORCHTITAN:
        return str(value)
    on = value in ("always", "default")
    if cfg.fsdp1:  # FSDP1's strategy (HSDP is its HYBRID_SHARD pair)
        return ("HYBRID_SHARD" if on else "_HYBRID_SHARD_ZERO2") if replicate > 1 else \
            ("FULL_SHARD" if on else "SHARD_GRAD_OP")
    return "true" if on else "false"


def _changes(cfg: JobConfig, old: Setting, new: Setting, config_plan: Plan, auto: Plan | None,
             blocks: int = 0) -> list[Change]:
    """The keys whose value differs, each old -> new; a value no key can say is marked not expressible. With
    ``auto``, its grouping last (an export's job, which runs the plan it holds, compared plan with plan).
    ``blocks``: the model's repeated blocks (``_ac_text``)."""
    held = auto is not None and cfg.plan is not None
    out = _ac_change(cfg, old, new, config_plan, auto, blocks)
    fsdp1 = cfg.fsdp1
    olds, news = (_reshard_text(cfg, r, p, m.replicate) for r, p, m in ((old.reshard, config_plan, old.mesh),
                                                                         (new.reshard, auto, new.mesh)))
    if olds != news or (held and new.reshard is None and _flags(config_plan) != _flags(auto)):
        ok = new.reshard is not None and (not fsdp1 or new.mesh.replicate in (1, cfg.nodes or 1))
        out.append(Change(cfg.key("reshard"), olds, news, ok))
    out.extend(_mesh_changes(cfg, old, new))
    if new.ep != old.ep:  # (auto's EP screen chose another degree, or the edit takes it)
        out.append(Change(cfg.key("ep"), str(old.ep), str(new.ep), cfg.kind == TORCHTITAN))
    if new.offload != old.offload:
        out.append(Change(cfg.key("offload"), str(old.offload).lower(), str(new.offload).lower()))
    # (a config's own job: its reshard key has a row of its own, so the grouping's row is its modules alone)
    same = _grouping(config_plan) == _grouping(auto) if held else _modules(config_plan) == _modules(auto)
    if auto is not None and not same:
        out.append(Change(cfg.key("policy"), f"{config_plan.policy}: {fmt_count(len(config_plan.groups), 'group')}",
                          fmt_count(len(auto.groups), "group"), False))
    return out


def _ac_change(cfg: JobConfig, old: Setting, new: Setting, config_plan: Plan, auto: Plan | None,
               blocks: int = 0) -> list[Change]:
    """The checkpointing key's change, if any (auto's activation offloading, ``--ac offload``'s, said: no key says
    it, and "none" alone read as advice to drop checkpointing)."""
    held = auto is not None and cfg.plan is not None
    offloaded = len(auto.activation_offloading) if auto is not None else 0
    if not (new.ac != old.ac or offloaded or
            (held and new.ac is None and _checkpointed(config_plan) != _checkpointed(auto))):
        return []
    ok = new.ac is not None and not offloaded and (new.ac in REGISTRY_AC if cfg.registry else
                                                   cfg.kind == TORCHTITAN or new.ac in (ACMode.NONE, ACMode.FULL))
    owners = "1 block's" if offloaded == 1 else f"{offloaded:,} blocks'"
    said = _ac_text(cfg, new.ac, auto, blocks) + (f" + {owners} activations offloaded to the host" if offloaded
                                                  else "")
    return [Change(cfg.key("ac"), _ac_text(cfg, old.ac, config_plan, blocks), said, ok)]


def _mesh_changes(cfg: JobConfig, old: Setting, new: Setting) -> list[Change]:
    """The TP and data-parallel degrees' changes (auto's TP screen chose another degree: the data-parallel degrees
    follow; an FSDP1 job's HSDP is a strategy, HYBRID_SHARD across the machines: no parallelism_config keys)."""
    out = []
    if new.tp != old.tp:
        out.append(Change(cfg.key("tp"), str(old.tp), str(new.tp), not cfg.fsdp1))
    if new.mesh != old.mesh and not cfg.fsdp1:
        if new.mesh.replicate != old.mesh.replicate:
            out.append(Change(cfg.key("replicate"), str(old.mesh.replicate), str(new.mesh.replicate)))
        out.append(Change(cfg.key("shard"), str(old.mesh.shard), str(new.mesh.shard)))
    return out


def _batch_change(cfg: JobConfig, old: Setting, new: Setting, workload: dict[str, int]) -> list[Change]:
    """The batch key a TP change moves: auto judges TP d at d / the job's TP degree times the batch per
    data-parallel rank (the same step on fewer data-parallel ranks, ``judged_model``), and the export writes it; a
    user following the other rows alone would halve the global batch (a trial). ``workload``: the job's as run,
    one micro-batch's, as the key says it."""
    batch, seq = workload.get("batch_size"), workload.get("seq_len")
    if new.tp == old.tp or cfg.kind != TORCHTITAN or not batch:
        return []
    if cfg.registry and seq:
        key, before = "training.num_tokens_per_microbatch_per_dp_rank", batch * seq
    else:
        key = "training.batch_size" if "training.batch_size" in cfg.keys else "training.local_batch_size"
        before = batch
    after = before * new.tp / old.tp
    return [Change(key, f"{before:,}", f"{after:,.0f}" if after.is_integer() else f"{after:,.2f}",
                   after.is_integer())]


def _checkpointed(plan: Plan) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    return tuple(plan.activation_checkpointing), tuple(plan.selective_checkpointing), plan.checkpoint_early_stop


def _flags(plan: Plan) -> list[Any]:
    return [g.reshard_after_forward for g in plan.inner_groups]


def _faster_than_auto(result: Result) -> str:
    """What fits and is faster than auto's plan as its export runs (or than nothing, where that is over the budget):
    the config's job or its best edit ("" where neither is)."""
    fits = result.budget.fits
    target = result.exported if result.outcome.exported else result.after
    auto = target.step_time if target is not None and fits(target.reserved_memory) else float("inf")
    if result.edit is not None and fits(result.edit[1].reserved_memory) and result.edit[1].step_time < auto:
        return "the edit above"
    if fits(result.before.reserved_memory) and result.before.step_time < auto:
        return "the config's job"
    return ""


def _decided(plan: Plan) -> dict[str, Any]:
    """What a plan decides, as its file says it (its policy's name aside)."""
    return {k: v for k, v in plan.to_dict().items() if k != "policy"}


def _same_plan(result: Result) -> bool:
    """Whether auto's plan decides all the config's job does (its policy's name aside)."""
    config_plan, auto_plan = result.outcome.config.plan, result.outcome.auto.plan
    return config_plan is not None and auto_plan is not None and _decided(config_plan) == _decided(auto_plan)


def _modules(plan: Plan | None) -> list[tuple[str, ...]]:
    """A plan's groups' modules, in order."""
    return [] if plan is None else [tuple(g.modules) for g in plan.groups]


def _grouping(plan: Plan) -> list[tuple[tuple[str, ...], Any]]:
    """A plan's groups as the job runs them: each one's modules and reshard rule."""
    return [(tuple(g.modules), g.reshard_after_forward) for g in plan.groups]


def _step_line(label: str, r: StepReport, result: Result) -> str:
    base = result.before.step_time
    gain = "" if r is result.before else f" ({(r.step_time - base) / base:+.1%} against the config's)"
    over = "" if result.budget.fits(r.reserved_memory) else " (over the budget)"
    return f"{label}: step {fmt_time(r.step_time)}{gain}, reserved {fmt_bytes(r.reserved_memory)}{over}"


def _exported_advice(result: Result, kept: str) -> str:
    """Where the torchtitan export keeps torchtitan's groups (EP on its MoE model), what the exported job runs and
    which to keep: auto's grouping reaches no job file here."""
    assert result.outcome.exported is not None
    setting, r = result.outcome.exported
    runs = (f"auto's plan has expert parallelism on torchtitan's own MoE model, so `fsdp-planner export --format "
            "torchtitan` keeps torchtitan's parallelize_fn, which lays out the routed experts and groups the blocks "
            f"itself: the exported job runs torchtitan's groups, not auto's {len(result.auto.groups)}, with "
            f"activation_checkpoint = {REGISTRY_AC[setting.ac or ACMode.NONE]} and fsdp_reshard_after_forward = "
            f"{setting.reshard}")
    if kept:
        return f"{runs}: keep {'the edit' if kept.startswith('the edit') else 'the config'}"
    if r is None or not result.budget.fits(r.reserved_memory):
        return f"{runs}, over the budget too"
    return f"{runs}: to run it, write it with --out plan.json, then `fsdp-planner export plan.json --format torchtitan`"


def _export_line(result: Result, cfg: JobConfig, fmt: str) -> str:
    """How to run auto's grouping, which no config key says: its export (whose parallelize_fn a model torchtitan
    lacks must be given by hand: the export sets no model_spec for it)."""
    own = cfg.kind == TORCHTITAN and result.auto.model not in FLAVORS
    return (f"auto's grouping ({fmt_count(len(result.auto.groups), 'group')}) is not expressible as {cfg.kind} "
            "config keys: write "
            f"it with --out plan.json, then `fsdp-planner export plan.json --format {fmt}`"
            + (", and set the exported parallelize_fn on your model's spec (the export sets it on torchtitan's own "
               "models only)" if own else ""))


def _advice(result: Result, cfg: JobConfig, fmt: str) -> None:
    """The best edit of the config's keys (or that none pays), and which to keep: the config, the edit, or auto's
    plan as its export runs."""
    if result.edit is not None:
        render.plain("  the edit: " + "; ".join(f"{c.key} = {c.new}" for c in result.edit[0]))
    else:
        within = "fits the budget" if not result.budget.fits(result.before.reserved_memory) else \
            "is faster within the budget"
        render.plain(f"no edit of the config's keys alone (its own grouping) {within}")
    kept = _faster_than_auto(result)
    if result.outcome.exported is not None:
        if result.exported is not None:
            render.plain(_step_line("auto's plan as exported (torchtitan's groups)", result.exported, result))
        render.plain(_exported_advice(result, kept))
    elif kept:  # (auto's search did not find what the user's job has: never advice to export a slower plan)
        keep = "the edit" if kept.startswith("the edit") else "the config"
        render.plain(f"auto's plan is slower than {kept} here: keep {keep}")
    elif not result.no_fit:  # (no advice to export a plan that does not fit either: the verdict below says why)
        render.plain(_export_line(result, cfg, fmt))


def _no_fit(message: str, cfg: JobConfig) -> None:
    """Auto's verdict where nothing fits; beside a loss peak, that the job's chunked loss is simulated whole (the
    way out the verdict names is what the job does already)."""
    render.plain(f"auto: {message}")
    if cfg.loss_chunks == 0 and PeakTerm.LOSS.value in message:
        render.plain("  the job computes its loss in chunks (ChunkedLossWrapper) of a number not read, simulated as "
                     "one loss over the whole sequence (its note above): the loss's share of that peak is "
                     "over-counted, so the verdict is pessimistic by up to that much")


def _json(result: Result, cfg: JobConfig, args: argparse.Namespace) -> dict[str, Any]:
    def step(r: StepReport | None) -> dict[str, Any] | None:
        return None if r is None else {**r.summary(), "budget": result.budget.to_dict(r.reserved_memory)}

    options = result.outcome.config.job.options
    return {"config": {"format": cfg.kind, "path": cfg.path, "notes": cfg.notes}, "model": args.model,
            "cluster": args.cluster, "micro_batches": options.micro_batches,
            "gradient_sync": options.gradient_sync.value, "loss_chunks": result.outcome.config.trace.loss_chunks,
            "config_step": step(result.before),
            "auto_step": step(result.after),
            "changes": [c.to_dict() for c in result.changes],
            "best_edit": None if result.edit is None else {"changes": [c.to_dict() for c in result.edit[0]],
                                                           "step": step(result.edit[1])},
            # where the torchtitan export keeps torchtitan's groups (EP on its MoE model): auto's plan as it runs
            **({"exported_step": step(result.exported)} if result.exported is not None else {}),
            "fits": result.fits, **({"message": result.no_fit} if result.no_fit else {}),
            # (as --out writes it: its compile, float8, precision, workload and optimizer)
            "plan": as_written(result.auto, result.outcome.auto.job, result.outcome.auto.trace).to_dict()}


def _print(result: Result, cfg: JobConfig, args: argparse.Namespace, written: str = "") -> None:
    t = Table(title=f"{cfg.kind} config keys auto would change ({args.model} on {args.cluster})",
              title_justify="left")
    for col in ("key", "config", "auto"):
        t.add_column(col, overflow="fold")
    for c in result.changes:
        t.add_row(escape(c.key), escape(c.old), escape(c.new) + ("" if c.expressible else " (not expressible)"))
    if result.changes:
        render.console.print(t)
    edit = result.edit[1] if result.edit else None
    for label, r in (("config's job", result.before), ("auto's plan", result.after),
                     ("best config edit alone (its own grouping)", edit)):
        if r is not None:
            render.plain(_step_line(label, r, result))
    fmt = "torchtitan" if cfg.kind == TORCHTITAN else "accelerate"
    if cfg.plan is not None:  # an export's job: it runs the plan it holds, whatever torchtitan's keys group
        config_plan, auto_plan = result.outcome.config.plan, result.outcome.auto.plan
        same = _same_plan(result)
        held = f"the job runs the plan its file holds ({PLAN_NAME})"
        differs = ", ".join(k for k in {**_decided(config_plan), **_decided(auto_plan)}
                            if _decided(config_plan).get(k) != _decided(auto_plan).get(k)) \
            if config_plan is not None and auto_plan is not None else ""
        render.plain(f"{held}: auto's plan for this job, nothing to change" if same else
                     f"{held}, and auto's differs ({differs}): write auto's with --out plan.json, then "
                     f"`fsdp-planner export plan.json --format {fmt}` again")
    elif _same_plan(result) and not _faster_than_auto(result):
        render.plain("auto's plan is the config's job: nothing to change")
    else:
        _advice(result, cfg, fmt)
    if result.no_fit:
        _no_fit(result.no_fit, cfg)
    if args.out is not None:
        render.plain(f"plan written to {args.out}{written}")
