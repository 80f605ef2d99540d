"""``fsdp-planner verify MODEL``: train with the plan under torchrun and check it against the prediction."""

from __future__ import annotations

import argparse
import dataclasses
import json

from fsdp_planner.cli import render
from fsdp_planner.cli.common import load_plan, load_trace, policy_plan
from fsdp_planner.cli.requests import model_spec, plan_source, policy_notes
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.plan import check_plan_world_size
from fsdp_planner.hardware.cluster import MAX_GPUS_PER_NODE, Cluster, Engine, parse_cluster
from fsdp_planner.models import planning_only
from fsdp_planner.planners.registry import PolicyName
from fsdp_planner.runtime.measure import CPU_RANK_REPEATS
from fsdp_planner.runtime.verify import check_load_dir, check_save_dir, run_verify
from fsdp_planner.sim.options import DEFAULT_PRECISION, SimOptions, ZeroGrad
from fsdp_planner.sim.timeline import simulate

FP32 = SimOptions.named("fp32", "sgd-momentum")  # what the torchrun jobs train with (worker.py)


def run(args: argparse.Namespace) -> int:
    if args.fake_world_size is not None:
        if args.fsdp1:
            raise PlannerError("--fsdp1 runs on torchrun ranks (--nproc); the fake-world check runs FSDP2 only")
        return run_fake(args)
    # every argument is checked before the model is traced or auto searches: a typo costs no minutes
    if args.nproc < 1:
        raise PlannerError(f"--nproc must be at least 1, got {args.nproc}")
    if args.steps < 1:
        raise PlannerError(f"--steps must be at least 1, got {args.steps}")
    if args.time_steps < 0:
        raise PlannerError(f"--time-steps must be 0 or more, got {args.time_steps}")
    if args.fsdp1 and (args.save_checkpoint is not None or args.load_checkpoint is not None):
        raise PlannerError("--save-checkpoint and --load-checkpoint run with FSDP2 only: drop --fsdp1")
    if planning_only(args.model):
        raise PlannerError(f"'{args.model}' is for planning only (too large to train here); verify a trainable "
                           "model")
    if args.save_checkpoint is not None:
        check_save_dir(args.save_checkpoint)
    if args.load_checkpoint is not None:
        check_load_dir(args.load_checkpoint, "")
    if args.precision != DEFAULT_PRECISION or args.zero_grad != ZeroGrad.NONE.value:
        render.note("--precision and --zero-grad apply with --fake-world-size: torchrun jobs train in fp32 with "
                    "zero_grad()")
    source = plan_source(args)
    auto = source.policy is not None and source.policy.name is PolicyName.AUTO
    given = parse_cluster(args.cluster) if args.cluster else None
    cluster = (given or parse_cluster(f"h100:{min(args.nproc, MAX_GPUS_PER_NODE)}")) if auto else None
    for note in policy_notes(args, [source.policy.name] if source.policy else [],
                             f"with --policy {args.policy}", plan_file=source.plan_file is not None):
        render.note(note)
    predict_on = _prediction_cluster(given, args)
    if args.measure and predict_on is None:
        render.note("--measure has no effect without a --cluster of --nproc ranks to predict the step time on")
    host = predict_on is not None and predict_on.engine is Engine.HOST
    tr = load_trace(model_spec(args), render.notes, measure=args.measure and predict_on is not None,
                    full=args.full_trace, precision=FP32.precision if predict_on else None,
                    threads=1 if host else None, repeats=CPU_RANK_REPEATS if host else 3)
    if source.plan_file is not None:
        plan = load_plan(str(source.plan_file), tr)
        check_plan_world_size(plan, args.nproc)
    else:
        assert source.policy is not None
        plan = policy_plan(tr, source.policy, args.model, cluster, SimOptions())
        check_plan_world_size(plan, args.nproc)
    if args.fsdp1:
        from fsdp_planner.fsdp2.fsdp1 import check_fsdp1

        check_fsdp1(plan)
    if not args.json:
        render.console.print(f"verifying [bold]{plan.policy or source.plan_file}[/bold] on {args.model} with "
                             f"{args.nproc} processes{' (FSDP1)' if args.fsdp1 else ''}, {args.steps} steps ...")
    with render.progress(f"torchrun job: {args.nproc} ranks, {args.steps} steps"):
        result = run_verify(model_spec(args), tr, plan, args.nproc, args.steps, fsdp1=args.fsdp1,
                            timed_steps=0 if args.fsdp1 else args.time_steps,
                            save_checkpoint=args.save_checkpoint, load_checkpoint=args.load_checkpoint)
    if predict_on is not None and not args.fsdp1:
        predicted = simulate(tr, plan, predict_on, FP32, timeline=False).step_time
        result = dataclasses.replace(result, predicted_step=predicted)
    if args.json:
        print(json.dumps({**result.to_dict(), "cluster": predict_on.name if predict_on else None}, indent=2))
    else:
        render.console.print(render.verify_table(result, predict_on.name if predict_on else args.cluster))
        if result.units is not None:
            differ = sorted(set(result.units) ^ set(result.expected_units or []))
            verdict = "exactly the plan's groups" if result.units_match else f"NOT the plan's groups: {differ}"
            render.console.print(f"FSDP1 units: {len(result.units)} wrapped, {verdict}")
        for note in result.notes:
            render.console.print(f"note: {note}")
        render.console.print("[green]PASS[/green]" if result.ok else "[red]FAIL[/red]")
    return 0 if result.ok else 1


def _prediction_cluster(given: Cluster | None, args: argparse.Namespace) -> Cluster | None:
    """The cluster to predict the job's step time on: the one given, when it has --nproc ranks (auto may plan for
    a larger one). Notes say when there is none, or when its GPUs are not what the job runs on."""
    if given is None:
        return None
    if args.fsdp1:
        render.note("no step time with --fsdp1: the simulator models FSDP2 and the FSDP1 job is not timed")
        return None
    if given.world_size != args.nproc:
        render.note(f"no step-time prediction: --cluster {given.name} has {given.world_size} ranks and the job "
                    f"runs {args.nproc}")
        return None
    import torch

    if given.engine is Engine.STREAMS and not torch.cuda.is_available():
        render.note(f"the step time is predicted for {given.name}'s GPUs and measured on this machine's CPU ranks: "
                    f"not comparable; for CPU ranks run `fsdp-planner calibrate --backend gloo --nproc {args.nproc} "
                    "--out gloo.json` and pass --cluster gloo.json")
    elif given.engine is Engine.HOST and not args.measure:
        render.note("op times from the roofline of this CPU's matmul rate: add --measure to time them")
    return given


def run_fake(args: argparse.Namespace) -> int:
    """Real FSDP2 on ``--fake-world-size`` fake ranks beside the simulator's prediction for that world size."""
    from fsdp_planner.runtime.fake_world import MAX_FAKE_WORLD, beside_prediction, check_precision, run_fake_world

    world = args.fake_world_size
    if not 1 <= world <= MAX_FAKE_WORLD:
        raise PlannerError(f"--fake-world-size must be between 1 and {MAX_FAKE_WORLD:,}, got {world}")
    if not 0 <= args.memory_tolerance < 1:
        raise PlannerError(f"--memory-tolerance must be in [0, 1), got {args.memory_tolerance}")
    if args.nproc != 2 or args.steps != 3:
        render.note("--nproc and --steps have no effect with --fake-world-size (one process, two steps)")
    if args.save_checkpoint is not None or args.load_checkpoint is not None:
        render.note("--save-checkpoint and --load-checkpoint have no effect with --fake-world-size (fake tensors "
                    "hold no values)")
    options = SimOptions.named(args.precision, zero_grad=args.zero_grad)
    check_precision(options.precision)
    source = plan_source(args)
    cluster = parse_cluster(args.cluster or f"h100:{world}")
    if cluster.world_size != world:
        raise PlannerError(f"--cluster {args.cluster} has {cluster.world_size} GPUs but --fake-world-size is {world}")
    tr = load_trace(model_spec(args), render.notes, full=args.full_trace, precision=options.precision)
    if source.plan_file is not None:
        plan = load_plan(str(source.plan_file), tr)
        check_plan_world_size(plan, world)
    else:
        assert source.policy is not None
        plan = policy_plan(tr, source.policy, args.model, cluster, options)
    if not args.json:
        render.console.print(f"running [bold]{plan.policy or source.plan_file}[/bold] on {args.model} with real "
                             f"FSDP2 on {world} fake ranks ({args.precision}) ...")
    predicted = simulate(tr, plan, cluster, options, timeline=False)
    with render.progress(f"real FSDP2 on {world} fake ranks"):
        measured = run_fake_world(model_spec(args), plan, world, options.precision, zero_grad=options.zero_grad)
    rows = beside_prediction(predicted, measured)
    exact = all(p == m for k, (p, m) in rows.items() if k != "peak_memory")
    error = predicted.peak_memory / measured.peak_memory - 1 if measured.peak_memory else 0.0
    ok = exact and abs(error) <= args.memory_tolerance
    if args.json:
        print(json.dumps({"world_size": world, "precision": args.precision, "plan": plan.policy,
                          "predicted": {k: p for k, (p, _) in rows.items()},
                          "measured": {k: m for k, (_, m) in rows.items()},
                          "predicted_memory_at_peak": predicted.memory_at_peak,
                          "predicted_reserved": predicted.reserved_memory, "counts_and_bytes_exact": exact,
                          "peak_error": error, "memory_tolerance": args.memory_tolerance, "ok": ok,
                          "seconds": measured.seconds}, indent=2))
        return 0 if ok else 1
    title = f"{model_spec(args).label()}: prediction vs real FSDP2 on {world} fake ranks ({measured.seconds:.1f} s)"
    render.console.print(render.fake_world_table(title, rows))
    render.console.print(f"peak: bytes allocated per rank; on a GPU the caching allocator would reserve "
                         f"{fmt_bytes(predicted.reserved_memory)} (predicted: the default stream's peak plus the "
                         "all-gather stream's)")
    render.console.print("[green]PASS[/green]" if ok else "[red]FAIL[/red]")
    return 0 if ok else 1
