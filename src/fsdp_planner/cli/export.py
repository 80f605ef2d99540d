"""``fsdp-planner export PLAN.json --format python|accelerate|lightning|torchtitan``: the plan as code (and, for
accelerate, the YAML ``accelerate launch --config_file`` takes, with the code beside it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import fsdp_planner.cli.render as render
from fsdp_planner.apply.accelerate_config import accelerate_config
from fsdp_planner.apply.expert_parallel import check_model_runs_ep
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.apply.torchtitan_job import unexpressed
from fsdp_planner.choices import DEFAULT_PRECISION
from fsdp_planner.cli.paths import export_files
from fsdp_planner.fmt import json_text
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.validity import check_compiled_groups
from fsdp_planner.models import ModelSpec, as_spec, hf
from fsdp_planner.planners.config_edit import keeps_torchtitan_groups
from fsdp_planner.service.plan_files import checked_modules, checked_on_model
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.options import precision_named
from fsdp_planner.trace.chunked_loss import output_layer
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import stamped, write_atomic


def run(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    check_compiled_groups(plan, plan.compiled)  # (the blocks the code compiles: no FSDP2 hooks inside them)
    modules = checked_modules(plan)  # the model built once, on meta
    if modules is None:
        render.note(f"the plan's model {plan.model or '(none named)'} is not built here (a plan file's Python "
                    "factory is not run): the code checks the module names it needs when it runs")
    # transformers' experts its EP does not run: refused (a torchtitan job of torchtitan's own MoE model keeps
    # torchtitan's parallelize_fn and modules, which compile with EP)
    fmt = ExportFormat(args.format)
    own_modules = fmt is ExportFormat.TORCHTITAN and keeps_torchtitan_groups(plan)
    check_model_runs_ep(as_spec(plan.model), plan.replace(compiled=()) if own_modules else plan, modules)
    traced = check_on_model(plan, args.plan) if modules is not None else None
    loss_head = _output_layer(plan, traced, args.format)
    precision = _precision(args.precision, plan)
    if plan.model.partition(":")[0].endswith(".py") and not Path(plan.model.rpartition(":")[0]).is_file():
        render.note(f"the plan's model file {plan.model.rpartition(':')[0]} is not found from here: the code names "
                    "it as the plan does (export from the directory the plan was made in for a path relative to "
                    "the code)")
    if fmt is ExportFormat.TORCHTITAN:  # its job file runs one setting for every block
        for said in unexpressed(plan, precision_named(precision), modules):
            render.note(said)
    elif plan.compiled_loss:  # (torchtitan's job compiles it: compile.components)
        render.note("the plan's loss runs torch.compile'd (--compile-loss): the code applies the plan to the model; "
                    "compile your loss function too (loss_fn = torch.compile(loss_fn)), or its memory is eager's")
    # accelerate: --out is the launch config, the code goes beside it (checked before any work by check_paths)
    hook = export_files(args.out, fmt.value, args.force) if args.out is not None else None
    code_file = hook or (Path(args.out) if args.out is not None else None)
    # each file under its checksum line: a second export --out replaces it only as written (cli/paths.py)
    source = stamped(export_plan(plan, fmt, precision_named(precision), where=code_file.parent if code_file else None,
                                 loss_head=loss_head))
    config = stamped(accelerate_config(plan, precision_named(precision))) if fmt is ExportFormat.ACCELERATE else None
    if code_file is not None:
        write_atomic(code_file, source)  # export_plan writes ASCII only
        if hook is not None and config is not None:
            write_atomic(args.out, config)
            render.note(f"accelerate launch config written to {args.out}, its hook ({precision}) to {hook}")
        else:
            render.note(f"{args.format} code for the plan ({precision}) written to {args.out}")
    elif config is not None:
        render.note("--out NAME.yaml writes the accelerate launch config too, with this code beside it as NAME.py")
    if args.json:
        print(json_text({"format": args.format, "precision": precision, "out": args.out, "source": source,
                         **({"config": config, "hook": str(hook) if hook else None} if config else {})}, indent=2))
    elif args.out is None:
        print(source, end="")
    return 0


def _output_layer(plan: Plan, traced: Trace | None, fmt: str) -> str | None:
    """The output layer a plan with chunks runs them on, for the code's OUTPUT_LAYER: the traced model's, else the
    one the plan recorded (a factory's model, not built here), else None, with a note (a plan written before plans
    recorded it)."""
    if not plan.loss_chunks:
        return None
    head = output_layer(traced) if traced is not None else None
    found = head.module if head is not None else plan.loss_head or None
    if found is None and fmt != ExportFormat.TORCHTITAN.value:
        render.note("the plan runs its loss in chunks and names no output layer (a plan written before plans "
                    "recorded it): set OUTPUT_LAYER in the code to your output layer's module name")
    return found


def check_on_model(plan: Plan, path: str) -> Trace:
    """The plan file checked against the model it names (built and traced here, on meta, at the plan's workload) as
    ``simulate`` checks it (``checked_on_model``), on the ranks it was made for: shard dims a param lacks, an int
    reshard_after_forward that does not divide them, groups that miss a param or list one FSDP2 would not claim,
    tensor parallelism torch cannot apply (a style, a layout whose Linears do not pair, a pattern naming no
    module) fail here, in one line, not on the ranks of the exported code."""
    w = plan.workload
    spec = ModelSpec(plan.model, batch_size=w.batch if w else None, seq_len=w.seq if w and w.seq else None,
                     attention=plan.attention or None,
                     hf_config=tuple(plan.hf_config.items()) if hf.is_hf(plan.model) else ())
    tr = trace_spec(spec)
    checked_on_model(plan, path, tr, spec, render.note, w.ranks if w and w.ranks else None)
    return tr


def _precision(asked: str | None, plan: Plan) -> str:
    """``--precision``, else the plan's own, else plan's default; a note where the two disagree (the code then
    runs in another precision than the plan's numbers assumed)."""
    if asked and plan.precision and asked != plan.precision:
        render.note(f"the plan was simulated in {plan.precision}; the code sets {asked} as --precision asks")
    return asked or plan.precision or DEFAULT_PRECISION
