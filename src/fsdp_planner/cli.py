"""Command line: ``fsdp-planner demo | plan | simulate | verify | cost | calibrate | memory | models``.

Every user error is one line on stderr and exit code 2; never a traceback (set FSDP_PLANNER_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from fsdp_planner.errors import PlannerError
from fsdp_planner.metrics import plan_metrics
from fsdp_planner.models import BUILTINS, load_model
from fsdp_planner.plan import Plan
from fsdp_planner.policies import POLICY_NAMES, make_policy
from fsdp_planner.report import comparison_table, fmt_bytes, groups_table, verify_table
from fsdp_planner.trace import Trace, trace

# Wide enough for the comparison tables when piped (rich falls back to 80 columns otherwise).
console = Console(width=None if sys.stdout.isatty() else 150)
notes = Console(stderr=True, width=None if sys.stderr.isatty() else 150)  # keeps --json output clean


def _trace(spec: str, measure: bool = False) -> Trace:
    """The model's trace on meta tensors; with ``measure``, then timed for real on the local device."""
    lm = load_model(spec, meta=True)
    try:
        tr = trace(lm.model, lm.example_inputs, lm.loss_fn)
    except PlannerError:
        raise
    except Exception as e:
        raise PlannerError(f"tracing '{spec}' failed: {type(e).__name__}: {e}") from e
    if not measure:
        return tr
    from fsdp_planner.measure import check_fits, local_device
    from fsdp_planner.measure import measure as measure_ops

    device = local_device()
    check_fits(tr, device, spec)
    real = load_model(spec, meta=False)
    try:
        measured = measure_ops(real.model, real.example_inputs, real.loss_fn, device=device)
    except PlannerError:
        raise
    except Exception as e:
        raise PlannerError(f"measuring '{spec}' on {device.type} failed: {type(e).__name__}: {e}") from e
    notes.print(f"[dim]compute times measured on this machine's {device.type} "
                  f"({sum(measured.op_seconds or []) * 1e3:.1f} ms of ops per step)"
                  f"{'; CPU times, not the cluster GPUs' if device.type == 'cpu' else ''}[/dim]",
                  highlight=False)
    return measured


def _classes(arg: str | None) -> tuple[str, ...]:
    return tuple(c.strip() for c in arg.split(",") if c.strip()) if arg else ()


def _size(arg: str | None) -> int | None:
    if arg is None:
        return None
    from fsdp_planner.cost import parse_size

    return parse_size(arg)


def _policy_plan(args: argparse.Namespace, tr: Trace, name: str) -> Plan:
    if name == "auto":
        return _auto_result(args, tr).plan
    policy = make_policy(name, _classes(args.module_classes), args.min_nonwrapped_numel,
                         _size(getattr(args, "target_bytes", None)))
    return policy.plan(tr, args.model)


def _auto_cluster(args: argparse.Namespace) -> str:
    """--cluster, or (verify) the local run's size, or h100:8."""
    if getattr(args, "cluster", None):
        return args.cluster
    nproc = getattr(args, "nproc", None)
    return f"h100:{nproc}" if nproc and nproc <= 8 else "h100:8"


def _auto_result(args: argparse.Namespace, tr: Trace) -> Any:
    """Run AutoPolicy as the arguments say (once per command: plan and its table share it)."""
    cached = getattr(args, "_auto", None)
    if cached is not None:
        return cached
    from fsdp_planner.auto import AutoPolicy, infeasible_message
    from fsdp_planner.cluster import parse_cluster
    from fsdp_planner.simulate import SimOptions

    cluster = parse_cluster(_auto_cluster(args))
    budget = _size(getattr(args, "memory_budget", None))
    options = _sim_options(args) if hasattr(args, "mfu") else SimOptions()  # verify has no --mfu etc.
    policy = AutoPolicy(cluster, budget, getattr(args, "target", "fsdp2"), options)
    result = policy.search(tr, args.model)
    if not result.fits:
        raise PlannerError(infeasible_message(result, cluster))
    args._auto = result
    return result


def _plan_from_args(args: argparse.Namespace, command: str) -> tuple[Trace, Plan]:
    """The traced model and the plan named by exactly one of --plan FILE / --policy NAME."""
    if bool(args.plan) == bool(args.policy):
        raise PlannerError(f"{command} needs exactly one of --plan FILE or --policy NAME")
    tr = _trace(args.model, getattr(args, "measure", False))
    return tr, Plan.load(args.plan, tr) if args.plan else _policy_plan(args, tr, args.policy)


def cmd_plan(args: argparse.Namespace) -> int:
    if args.explain and args.policy != "auto":
        raise PlannerError("--explain explains an auto plan: add --policy auto")
    _size(args.memory_budget)  # a bad size fails before any work
    if args.policy == "auto" and not args.cluster:
        args.cluster = "h100:8"
        notes.print("auto: no --cluster given, planning for h100:8", highlight=False)
    tr = _trace(args.model, args.measure)
    names = [args.policy] if args.policy else [*POLICY_NAMES, *(["auto"] if args.cluster else [])]
    plans = [_policy_plan(args, tr, n) for n in names]
    context = _sim_context(args, tr)
    rows = [(p, plan_metrics(tr, p), _sim_extra(context, tr, p)) for p in plans]
    if args.out:
        if len(plans) != 1:
            raise PlannerError("--out writes one plan: choose it with --policy")
        plans[0].save(args.out)
    if args.json:
        out: dict[str, Any] = {
            "model": {"name": args.model, "fingerprint": tr.fingerprint, "numel": tr.numel},
            "plans": [{"plan": p.to_dict(), "metrics": m.to_dict(), **({"simulation": x} if x else {})}
                      for p, m, x in rows],
        }
        auto = getattr(args, "_auto", None)
        if auto is not None:
            out["auto"] = {"budget": auto.budget, "budget_source": auto.budget_source, "fits": auto.fits,
                           "plans_simulated": auto.evaluated, "seconds": auto.seconds}
        print(json.dumps(out, indent=2))
        return 0
    console.print(f"[bold]{args.model}[/bold]: {tr.numel:,} params ({fmt_bytes(tr.nbytes)}), "
                  f"{len(tr.modules)} modules, {tr.fwd_flops / 1e9:.3g} GFLOP forward, "
                  f"{tr.bwd_flops / 1e9:.3g} GFLOP backward")
    if len(plans) == 1:
        console.print(groups_table(plans[0], tr))
    console.print(comparison_table("per training step (FSDP2 semantics)", rows))
    if getattr(args, "_auto", None) is not None:
        _print_auto(args, args._auto)
    if args.out:
        console.print(f"plan written to {args.out}")
    return 0


def _sim_options(args: argparse.Namespace) -> Any:
    from fsdp_planner.memory import optimizer_from_name, precision_from_name
    from fsdp_planner.simulate import SimOptions

    precision_from_name(args.precision)
    optimizer_from_name(args.optimizer)
    if not 0 < args.mfu <= 1:
        raise PlannerError("--mfu must be in (0, 1]")
    return SimOptions(mfu=args.mfu, precision=args.precision, optimizer=args.optimizer)


def _sim_context(args: argparse.Namespace, tr: Trace) -> Any:
    """One simulation context for every plan of this command (None without --cluster)."""
    if not getattr(args, "cluster", None):
        return None
    from fsdp_planner.cluster import parse_cluster
    from fsdp_planner.simulate import SimContext

    return SimContext(tr, parse_cluster(args.cluster), _sim_options(args))


def _sim_extra(context: Any, tr: Trace, plan: Plan) -> dict[str, Any] | None:
    if context is None:
        return None
    from fsdp_planner.simulate import simulate

    return simulate(tr, plan, context=context, timeline=False).summary()


def _print_auto(args: argparse.Namespace, result: Any) -> None:
    from fsdp_planner.report import explain_table, fmt_time

    fitting = [c for c in result.baselines.values() if c.report.peak_memory <= result.budget]
    best_other = min(fitting, key=lambda c: c.report.step_time, default=None)
    n = len(result.plan.inner_groups)
    line = (f"auto: {n} group{'s' if n != 1 else ''}, step {fmt_time(result.report.step_time)}, peak "
            f"{fmt_bytes(result.report.peak_memory)} within the budget {fmt_bytes(result.budget)} "
            f"({result.budget_source}); {result.evaluated} plans simulated in {result.seconds:.1f} s")
    if best_other is not None:
        gain = 1 - result.report.step_time / best_other.report.step_time
        line += f"; {gain:.1%} faster than the best classic policy that fits, {best_other.origin}"
    else:
        line += "; no classic policy fits this budget"
    console.print(line, highlight=False)
    if args.explain:
        from fsdp_planner.auto import REASONS, explain
        from fsdp_planner.report import explain_legend

        rows = explain(result)
        console.print(explain_table(rows, result.report.step_time, result.report.peak_memory))
        console.print("held by:\n" + explain_legend({k: v for k, v in REASONS.items()
                                                     if any(r.reason == k for r in rows)}), highlight=False)


def cmd_simulate(args: argparse.Namespace) -> int:
    from fsdp_planner.cluster import parse_cluster
    from fsdp_planner.report import fmt_time, memory_table
    from fsdp_planner.simulate import simulate

    cluster = parse_cluster(args.cluster)
    tr, plan = _plan_from_args(args, "simulate")
    report = simulate(tr, plan, cluster, _sim_options(args), timeline=False)
    if args.json:
        print(json.dumps(report.summary(), indent=2))
        return 0
    console.print(f"[bold]{args.model}[/bold] with [bold]{plan.policy or args.plan}[/bold] on {cluster.describe()}")
    console.print(f"step time {fmt_time(report.step_time)}  compute {fmt_time(report.compute_time)}  "
                  f"exposed comm {fmt_time(report.exposed_comm)}  lower bound {fmt_time(report.lower_bound)}")
    console.print(f"{report.all_gathers} all-gathers ({fmt_bytes(report.all_gather_bytes)}), "
                  f"{report.reduce_scatters} reduce-scatters ({fmt_bytes(report.reduce_scatter_bytes)}) per step; "
                  f"comm busy: all-gather {fmt_time(report.comm_time['all_gather'])}, "
                  f"reduce-scatter {fmt_time(report.comm_time['reduce_scatter'])}")
    console.print(memory_table(report.peak_memory, report.memory_at_peak))
    return 0


def cmd_cost(args: argparse.Namespace) -> int:
    from fsdp_planner.cluster import parse_cluster
    from fsdp_planner.cost import collective_time, parse_size
    from fsdp_planner.report import fmt_time

    kind = args.collective.replace("-", "_")
    cluster = parse_cluster(args.cluster)
    nbytes = parse_size(args.size)
    seconds = collective_time(cluster, kind, nbytes, ranks=args.ranks)
    if args.json:
        print(json.dumps({"collective": kind, "bytes": nbytes, "ranks": args.ranks or cluster.world_size,
                          "seconds": seconds}))
    else:
        ranks = args.ranks or cluster.world_size
        console.print(f"{args.collective} of {fmt_bytes(nbytes)} over {ranks} ranks on {cluster.describe()}: "
                      f"{fmt_time(seconds)} (bus bandwidth {(ranks - 1) / ranks * nbytes / seconds / 1e9:.0f} GB/s)")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from fsdp_planner.calibrate import calibrate
    from fsdp_planner.cluster import parse_cluster

    base = parse_cluster(args.base) if args.base else None
    cluster = calibrate(args.logs, base)
    cluster.save(args.out)
    for kind, fits in cluster.fits.items():
        for n, (alpha, busbw) in sorted(fits.items()):
            console.print(f"{kind:15s} {n:5d} ranks: latency {alpha * 1e6:.1f} us, "
                          f"bus bandwidth {busbw / 1e9:.1f} GB/s")
    console.print(f"cluster written to {args.out}")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from fsdp_planner.memory import format_table, optimizer_from_name, precision_from_name, strategy_table

    if args.world_size < 1:
        raise PlannerError("--world-size must be at least 1")
    tr = _trace(args.model)
    rows = strategy_table(tr, args.world_size, optimizer_from_name(args.optimizer),
                          precision_from_name(args.precision))
    if args.json:
        print(json.dumps({k: v.to_dict() for k, v in rows.items()}, indent=2))
    else:
        console.print(format_table(rows, title=f"{args.model}: per-rank memory at world size {args.world_size} "
                                               f"({args.precision}, {args.optimizer})"))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from fsdp_planner.verify import result_dict, run_verify

    tr, plan = _plan_from_args(args, "verify")
    if not args.json:
        console.print(f"verifying [bold]{plan.policy or args.plan}[/bold] on {args.model} with "
                      f"{args.nproc} processes, {args.steps} steps ...")
    result = run_verify(args.model, tr, plan, args.nproc, args.steps)
    if args.json:
        print(json.dumps(result_dict(result), indent=2))
    else:
        console.print(verify_table(result))
        for note in result.notes:
            console.print(f"note: {note}")
        console.print("[green]PASS[/green]" if result.ok else "[red]FAIL[/red]")
    return 0 if result.ok else 1


def cmd_models(args: argparse.Namespace) -> int:
    for name, b in BUILTINS.items():
        console.print(f"{name:16s} {b.description}{'' if b.trainable else '  [dim](planning only)[/dim]'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the built-in defaults: what the classic policies do vs the execution-order plan."""
    for spec in ("seed-net", "toy-llama"):
        tr = _trace(spec)
        # size thresholds: the seed's 2000 for its CNN; for the toy decoder one that wraps inside blocks,
        # as size-based wrapping does on real transformers
        ns = argparse.Namespace(model=spec, module_classes=None, target_bytes=None,
                                min_nonwrapped_numel=2000 if spec == "seed-net" else 20_000)
        plans = [_policy_plan(ns, tr, n) for n in POLICY_NAMES]
        rows = [(p, plan_metrics(tr, p), None) for p in plans]
        console.rule(f"[bold]{spec}[/bold]: {tr.numel:,} params")
        by_name = {p.policy.split("(")[0]: p for p in plans}
        for name in ("size", "order"):
            console.print(groups_table(by_name[name], tr))
        console.print(comparison_table(f"{spec}: per training step (FSDP2 semantics)", rows))
        size_root = by_name["size"].root
        if spec == "seed-net" and size_root.params:
            mods = sorted({m for p in size_root.params for m in tr.param(p).owners})
            console.print(f"size-based: the root unit holds {', '.join(mods)} together and keeps them gathered "
                          "from the first op of forward to the end of backward; the execution-order plan "
                          "gives each its own group and the root manages nothing.")
    console.print("\nnext: fsdp-planner plan MODEL --policy order --out plan.json; "
                  "fsdp-planner verify MODEL --plan plan.json --nproc 2")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdp-planner", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="classic wrap policies vs the execution-order plan on the built-in models")
    d.set_defaults(fn=cmd_demo)

    def sim_options(sp: argparse.ArgumentParser, cluster_required: bool) -> None:
        sp.add_argument("--cluster", required=cluster_required,
                        help="preset and GPU count (h100:64, a100:16, b200:8, h200:512) or a cluster JSON file")
        sp.add_argument("--mfu", type=float, default=0.5, help="fraction of peak FLOP/s matmuls reach (0.5)")
        sp.add_argument("--precision", default="bf16-mixed",
                        help="fp32, bf16-mixed (default), pure-bf16, autocast, autocast-nocache")
        sp.add_argument("--optimizer", default="adamw", help="sgd, sgd-momentum, adam, adamw (default)")
        sp.add_argument("--measure", action="store_true",
                        help="time the model's ops for real on this machine (GPU if present) instead of the "
                             "roofline estimate; the model must fit unsharded")

    def policy_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--module-classes", help="comma-separated class names (default: the repeated block class)")
        sp.add_argument("--min-nonwrapped-numel", type=int, default=None,
                        help="size policy threshold (default 1e8, FSDP1's)")
        sp.add_argument("--target-bytes", help="order policy group size, e.g. 64MiB (default: one block)")
        sp.add_argument("--memory-budget", help="auto: per-rank peak memory budget, e.g. 60GiB (default: the "
                                                "peak of the fastest classic policy)")
        sp.add_argument("--target", choices=("fsdp2", "fsdp1"), default="fsdp2",
                        help="auto: plans FSDP2 can apply (default) or only what FSDP1 can express")

    pl = sub.add_parser("plan", help="plan FSDP groups for a model; without --policy compare all policies")
    pl.add_argument("model", help="built-in name, path/file.py:fn or package.module:fn")
    pl.add_argument("--policy", choices=(*POLICY_NAMES, "auto"))
    policy_options(pl)
    sim_options(pl, cluster_required=False)
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--out", help="write the plan JSON here")
    pl.add_argument("--explain", action="store_true", help="auto: why each group boundary sits where it does")
    pl.set_defaults(fn=cmd_plan)

    def plan_source(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("model")
        sp.add_argument("--plan", help="plan JSON file")
        sp.add_argument("--policy", choices=(*POLICY_NAMES, "auto"))
        policy_options(sp)

    v = sub.add_parser("verify", help="train with the plan under torchrun and check it against the prediction")
    plan_source(v)
    v.add_argument("--nproc", type=int, default=2)
    v.add_argument("--steps", type=int, default=3)
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_verify)

    si = sub.add_parser("simulate", help="simulate one step of a plan on a cluster")
    plan_source(si)
    sim_options(si, cluster_required=True)
    si.add_argument("--json", action="store_true")
    si.set_defaults(fn=cmd_simulate)

    co = sub.add_parser("cost", help="time of one collective on a cluster")
    co.add_argument("collective", choices=("all-gather", "reduce-scatter"))
    co.add_argument("size", help="full (unsharded) size, e.g. 1GiB, 512MB, 1e9")
    co.add_argument("--cluster", required=True)
    co.add_argument("--ranks", type=int, default=None, help="sub-group size (default: the whole cluster)")
    co.add_argument("--json", action="store_true")
    co.set_defaults(fn=cmd_cost)

    ca = sub.add_parser("calibrate", help="fit latency and bandwidth from nccl-tests logs")
    ca.add_argument("logs", nargs="+", help="all_gather_perf / reduce_scatter_perf output files")
    ca.add_argument("--base", help="cluster preset to start from (e.g. h100:16); default: detected from the logs")
    ca.add_argument("--out", required=True, help="cluster JSON to write")
    ca.set_defaults(fn=cmd_calibrate)

    me = sub.add_parser("memory", help="per-rank memory: DDP, ZeRO-1/2/3 (FSDP)")
    me.add_argument("model")
    me.add_argument("--world-size", type=int, required=True)
    me.add_argument("--precision", default="fp32")
    me.add_argument("--optimizer", default="sgd-momentum")
    me.add_argument("--json", action="store_true")
    me.set_defaults(fn=cmd_memory)

    m = sub.add_parser("models", help="list the built-in models")
    m.set_defaults(fn=cmd_models)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except PlannerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("FSDP_PLANNER_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {e} (set FSDP_PLANNER_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
