"""``fsdp-planner fit MODEL --cluster C``: what fits the cluster with auto's best plan. The largest per-GPU batch at
``--seq`` and the longest sequence at ``--batch``, with tokens/s per GPU and MFU at each batch that fits; with
``--gpus auto``, the fewest whole nodes that fit ``--batch`` x ``--seq`` and the tokens/s at each count tried.

The answer without CPU offload comes first; the one with it (auto's last resort) is named as such and priced
against it. Every row is ``plan MODEL --policy auto --cluster C --batch B --seq S --micro-batches 1`` (the batch
that fits at once: plan's own default may split a batch into micro-batches) run the same way (the same
trace, the same deterministic search within ``--search-effort``, the same budget with ``--headroom``), so each row
is what ``plan`` prints for that workload; the boundaries are located with searches without refinement and
confirmed with plan's search on both sides (``service/fit.py``). The searches (``planners/fit.py``) rely on memory
being monotone in the batch, the sequence and the node count. Ctrl-C or ``--time-limit`` prints what was found so
far."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.choices import PolicyName
from fsdp_planner.cli.commands import DEFAULT_MAX_FIT_GPUS
from fsdp_planner.cli.common import REPORTER
from fsdp_planner.cli.paths import picture_file
from fsdp_planner.cli.requests import (
    Configured,
    configured,
    keywords,
    memory_budget,
    model_spec,
    named_cluster,
    policy_request,
    sim_options,
)
from fsdp_planner.configs.job_config import ACCELERATE, world_of
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time, json_text
from fsdp_planner.hardware.cluster import Cluster, with_nodes
from fsdp_planner.limits import MAX_BATCH, MAX_SEQ, MAX_TOKENS
from fsdp_planner.models import BUILTINS, ModelSpec, hf, resolve_factory, takes, workload_defaults
from fsdp_planner.planners.fit import FitPoint, largest_confirmed, smallest_confirmed
from fsdp_planner.planners.registry import PolicyRequest
from fsdp_planner.service.fit import Points, Stopped, fewest_without_offload
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.planning import Tracer
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.signals import Terminated
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.options import SimOptions

PICTURE_SUFFIXES = (".png", ".svg", ".pdf")
SEQ_STEP = 128  # the longest sequence is found to a multiple of this (or of the --seq it starts from, if smaller)
SEQ_PARTS = 16  # ... and to 1/16 of the longest power-of-two multiple that fits: a few traces, not a dozen
BAR = 10  # characters of the fastest row's throughput bar
_COUNTED_CLUSTER = re.compile(r"^\s*[a-z0-9]+:\d", re.IGNORECASE)


@dataclass(frozen=True)
class FitRequest:
    """``fit MODEL``: the workload and world to search around, checked before anything is traced."""

    model: ModelSpec  # the name with --batch / --seq as given
    batch: int  # --batch, or the model's default: the sequence search's and --gpus auto's batch
    seq: int | None  # --seq, or the model's default; None: the model takes no sequence length (batch only)
    policy: PolicyRequest  # auto, with --headroom, --memory-budget, --search-effort ...
    cluster: Cluster  # with --gpus auto, one node of it
    gpus_auto: bool
    max_gpus: int
    options: SimOptions
    budget: MemoryBudget
    picture: Path | None
    json: bool
    full_trace: bool
    find: str = "both"  # --find: batch, seq or both
    no_offload: bool = False  # --no-offload: answers without CPU offload only; none at all is an error
    time_limit: float | None = None  # --time-limit: seconds after which no search starts (partial results)


def fit_request(args: argparse.Namespace) -> FitRequest:
    picture = picture_file(args.picture, "--picture", PICTURE_SUFFIXES, stem="fit", force=args.force)
    given_batch = args.batch  # (the command line's: a job's batch is where the batch search starts, unsaid)
    args = _job_of(args)
    if args.gpus and _COUNTED_CLUSTER.match(args.cluster):
        raise PlannerError(f"--gpus auto chooses the GPU count: give --cluster without one (e.g. "
                           f"{args.cluster.split(':')[0].strip()}), or drop --gpus auto to search the batch on "
                           f"{args.cluster}")
    if args.gpus and args.mesh:
        raise PlannerError("--mesh fixes the GPU count, which --gpus auto chooses: drop --mesh (auto chooses the "
                           "layout at each count) or --gpus auto")
    spec = model_spec(args)
    workload = _workload_of(spec)
    batch = workload.get("batch_size")
    if not isinstance(batch, int):
        raise PlannerError(f"the per-GPU batch of '{args.model}' is not known: give --batch")
    seq = workload.get("seq_len")
    seq = seq if isinstance(seq, int) else None  # None: no seq_len (or a required one): batch only
    if args.find == "seq" and seq is None and not args.gpus:
        raise PlannerError(f"--find seq searches the sequence length, and '{args.model}' takes none (or its default "
                           "is not known): give --seq, or search the batch")
    if args.find == "batch" and given_batch is not None and not args.gpus:  # said, never silently ignored
        render.note(f"--batch {given_batch} has no effect with --find batch: the batch is what it searches (from 1)")
    if args.gpus and args.find != "both":
        render.note("--find has no effect with --gpus auto: the workload is --batch x --seq as given")
    cluster = named_cluster(args, args.cluster)
    if args.gpus:
        cluster = with_nodes(cluster, 1)
        if args.max_gpus < cluster.gpus_per_node:  # (it answered a node of 8 under --max-gpus 7)
            raise PlannerError(f"--max-gpus {args.max_gpus:,} is less than one node of {cluster.gpus_per_node} GPUs, "
                               f"and --gpus auto counts whole nodes: give at least {cluster.gpus_per_node}, or fit "
                               "on N GPUs of one node with --cluster GPU:N and no --gpus")
    elif args.max_gpus != DEFAULT_MAX_FIT_GPUS:
        render.note("--max-gpus has no effect without --gpus auto: the batch and sequence are searched on --cluster")
    return FitRequest(spec, batch, seq, policy_request(args, PolicyName.AUTO.value), cluster, bool(args.gpus),
                      args.max_gpus, sim_options(args), memory_budget(args, cluster), picture, args.json,
                      args.full_trace, args.find, args.no_offload, args.time_limit)


def _job_of(args: argparse.Namespace) -> argparse.Namespace | Configured:
    """The options with the job ``--from-torchtitan`` / ``--from-accelerate`` describes, as ``plan`` reads it for
    auto: its model, sequence, cluster, precision, TP and EP degrees, compile and float8 kept; its checkpointing
    (its wrapper's early stop too), mesh and offload auto's to choose (the command line's own ``--ac``, ``--mesh``,
    ``--offload`` and ``--no-early-stop`` kept), as auto's plan beside the job chooses them (``configured._auto``;
    on an EP job that keeps torchtitan's groups, plan searches again with the wrapper's early stop, fit does not);
    its gradient accumulation one micro-batch a step, as fit's every point. ``--gpus auto`` counts the GPUs, so
    the job must leave its count to the cluster."""
    given, cfg = configured(args, gpus_searched=bool(args.gpus))
    if cfg is None:
        return args
    world = world_of(cfg, None)
    if args.gpus and world is not None:
        raise PlannerError(f"--gpus auto chooses the GPU count, and the {cfg.kind} job runs on {world:,} GPUs: drop "
                           "--gpus auto to fit its batch and sequence there, or leave its count to the cluster ("
                           + ("no num_processes" if cfg.kind == ACCELERATE else "data_parallel_shard_degree = -1")
                           + ")")
    if args.gpus and cfg.nodes:
        raise PlannerError(f"--gpus auto chooses the node count, and the {cfg.kind} job runs on {cfg.nodes} "
                           "machines (num_machines): drop --gpus auto, or num_machines")
    kw = keywords(given)
    micro = int(str(kw.micro_batches)) if str(kw.micro_batches).isdecimal() else 1  # (the job's: "2")
    render.note(f"fit plans the {cfg.kind} job with auto: its checkpointing, mesh and CPU offload are auto's to "
                "choose (what it sets of the model, workload, precision, parallel degrees, compile and float8 "
                "kept)"
                + (f"; its gradient accumulation of {micro} micro-batches is one a step here" if micro > 1 else ""))
    free = dataclasses.replace(kw, ac=args.ac, ac_policy=args.ac_policy, mesh=args.mesh, offload=args.offload,
                               early_stop=args.early_stop,  # (the export checkpoints as the plan says: auto's)
                               micro_batches=None, gradient_sync=None,
                               batch=kw.batch // micro if isinstance(kw.batch, int) else kw.batch,
                               cluster=(args.cluster or str(kw.cluster).partition(":")[0]) if args.gpus
                               else kw.cluster)
    return Configured(args, free)


def _workload_of(spec: ModelSpec) -> dict[str, Any]:
    """The workload the model's factory runs by default, with --batch / --seq over it: a user factory's own
    defaults too (a wrong name is "unknown model" here, before anything else is asked)."""
    factory = resolve_factory(spec.name)
    if spec.name in BUILTINS or hf.is_hf(spec.name):
        return spec.workload()
    if not takes(factory, "batch_size"):  # (--batch would be refused as not applying: a trial met both sentences)
        raise PlannerError(f"fit searches the per-GPU batch, and the factory '{spec.name}' takes no batch_size "
                           "keyword argument: give it batch_size (and seq_len) parameters to fit it, or plan its "
                           "one workload with plan or simulate")
    own = {k: v for k, v in workload_defaults(factory).items() if isinstance(v, int) and not isinstance(v, bool)}
    return {**own, **spec.kwargs()}


def run(args: argparse.Namespace) -> int:
    request = fit_request(args)
    points = _points(request)
    started = time.monotonic()
    try:
        doc, lines = _gpus(request, points) if request.gpus_auto else _workload(request, points)
    except (KeyboardInterrupt, Terminated, Stopped) as e:
        return _partial(request, points, e, time.monotonic() - started)
    if request.picture is not None:
        _draw(request, points)
    if request.json:
        print(json_text(doc, indent=2))
        return 0
    for line in lines:  # the answers first, then the points behind them
        render.plain(line)
    _print_tables(request, points)
    if request.picture is not None:
        render.plain(f"picture written to {request.picture}")
    return 0


def _print_tables(request: FitRequest, points: Points) -> None:
    for title, rows in _sections(request, points):
        render.console.print(_table(title, rows, request.seq is not None))
    searched = len(points.staged)
    render.plain(f"{points.searches:,} searches ({searched:,} workload{'' if searched == 1 else 's'} searched as "
                 f"plan searches them, {len(points.screens):,} screened without refinement; the tables list the "
                 "first)")


def _partial(request: FitRequest, points: Points, why: BaseException, seconds: float) -> int:
    """Ctrl-C, a terminating signal or --time-limit during the searches: the points found so far and what they
    show, marked partial."""
    reason = ("--time-limit" if isinstance(why, Stopped) else
              why.name if isinstance(why, Terminated) else "Ctrl-C")
    fitting = [p for p in points.sorted() if p.fits]
    plain = [p for p in fitting if not p.offload]
    best = max(plain or fitting, key=lambda p: p.batch * p.seq * 1e9 - p.gpus, default=None)
    so_far = (f"; so far the largest workload that fits{'' if plain else ' with CPU offload'}: batch {best.batch:,}"
              f"{f' x seq {best.seq:,}' if request.seq else ''} on {best.gpus:,} GPUs" if best else "")
    status = 3 if isinstance(why, Stopped) else 128 + why.signum if isinstance(why, Terminated) else 130
    if request.json:
        print(json_text({**_header(request), "partial": reason, "status": status,
                         "points": [p.to_dict() for p in points.sorted()]}, indent=2))
        return status
    render.plain(f"stopped by {reason} after {seconds:.0f} s: partial results{so_far}")
    _print_tables(request, points)
    return status


def _points(request: FitRequest) -> Points:
    """The evaluations of ``plan MODEL --policy auto`` at each point the searches ask for."""
    job = PlanJob(request.model, (request.policy,), request.cluster, request.options, request.budget,
                  full_trace=request.full_trace, must_fit=False)
    cluster = request.cluster
    deadline = time.monotonic() + request.time_limit if request.time_limit else None
    render.note("each batch is one forward and backward a step (plan ... --micro-batches 1): plan without "
                "--micro-batches may split a larger batch into micro-batches that fit")
    tp = request.policy.tp
    if tp is not None and tp > 1:  # as plan's --tp: torchtitan's local batch
        render.note(f"{render.tp_batch(tp)} (tokens/s and MFU per GPU count each GPU's share)")
    return Points(job, _tracer(request.full_trace), (lambda n: with_nodes(cluster, n)) if request.gpus_auto
                  else None, REPORTER, deadline)


def _tracer(full: bool) -> Tracer:
    """The command line's meta trace (every workload is traced, and says the same notes: render says each once)."""
    return lambda spec, options: trace_spec(spec, options.precision, full, render.note)


def _workload(request: FitRequest, points: Points) -> tuple[dict[str, Any], list[str]]:
    """The largest batch at the sequence, then the longest sequence at the batch (``--find`` picks)."""
    doc: dict[str, Any] = _header(request)
    lines: list[str] = []
    if request.find in ("batch", "both"):
        doc["batch"], lines = _largest_batch(request, points)
    if request.seq is not None and request.find in ("seq", "both"):
        doc["seq"], more = _longest_seq(request, points)
        lines += more
    doc["points"] = [p.to_dict() for p in points.sorted()]
    return doc, lines


def _largest_batch(request: FitRequest, points: Points) -> tuple[dict[str, Any], list[str]]:
    """The largest batch that fits at the sequence without CPU offload, then with it (auto's last resort), and the
    fastest per GPU of the batches searched (checkpointing may make the largest slower than a smaller one)."""
    seq = request.seq
    step = chunked_step(seq or 1, request.model.loss_chunks)  # (batches whose tokens split into the chunks)
    cap = min(MAX_BATCH, MAX_TOKENS // (seq or 1)) // step * step
    where = f" at seq {seq:,}" if seq else ""
    at = lambda b: (b, seq, 1)  # noqa: E731
    plain = largest_confirmed(points.screen(at, plain=True), points.fits(at, plain=True), step, cap, step)
    largest = plain
    if not request.no_offload and (plain is None or plain < cap):
        largest = largest_confirmed(points.screen(at), points.fits(at, past_plain=True), (plain or 0) + step, cap,
                                    step) or plain
    if largest is None and request.no_offload and not points.no_fit(step, seq):  # the least fits with offload only
        _verdict(request, points, step, seq, f"batch {step}{where}")  # raises: the fewest GPUs without offload
    if largest is None:
        raise PlannerError(f"nothing fits even at batch {step}: {points.no_fit(step, seq)}")
    per = _per(request)
    if plain is None:
        lines = [_verdict(request, points, step, seq, f"batch {step}{where}")]
    else:
        capped = " (the largest tried: the search stops there)" if plain >= cap else ""
        after = "" if plain >= cap else f"; batch {plain + step:,} does not fit without it"
        lines = [f"largest batch without CPU offload{where} on {request.cluster.name}: {plain:,}{capped}: "
                 f"{_figures(points.at(plain, seq), per)}{after}"]
    lines += _offload_line("batch", plain, largest, cap, lambda b: points.at(b, seq), per, where, request)
    fitting = [p for p in points.sorted() if p.fits and p.seq == (seq or 1)]
    fastest = max(fitting, key=lambda p: p.tokens_per_gpu)
    if fastest.batch != (plain or largest):
        lines.append(f"most {per}/s per GPU of the batches searched{where}: {fastest.batch:,}"
                     f"{' (with CPU offload)' if fastest.offload else ''}: {_figures(fastest, per)}")
    return {"seq": seq, "largest": largest, "largest_without_offload": plain, "fastest": fastest.batch,
            "next": _next(points, largest + step, seq)}, lines


def _longest_seq(request: FitRequest, points: Points) -> tuple[dict[str, Any], list[str]]:
    """The longest sequence that fits at --batch without CPU offload, then with it; bounded by the model's
    learned positions."""
    b, seq = request.batch, request.seq
    assert seq is not None
    split = chunked_step(b, request.model.loss_chunks)  # (sequences whose tokens split into the loss's chunks)
    step = math.lcm(min(SEQ_STEP, 1 << (seq.bit_length() - 1)), split)
    cap = min(MAX_SEQ, MAX_TOKENS // b) // step * step
    limit = points.seq_limit()
    if limit is not None and limit[1] < cap:  # the model's own bound, tried as it is (Whisper's 448 decoder
        # positions were rounded down to 384, which fit, and said as the search's bound)
        cap = limit[1] // split * split
    at = lambda s: (b, s, 1)  # noqa: E731
    start = min(-(-seq // split) * split, cap)  # (from the sequence given, or the first after it that splits)
    failed: dict[int, str] = {}  # longer sequences the model's code refuses (a position table of its own)

    def traced(fits: Callable[[int], bool]) -> Callable[[int], bool]:
        def guarded(s: int) -> bool:  # a length past the given one that does not trace: not one the model takes
            if any(s >= f for f in failed):
                return False
            try:
                return fits(s)
            except PlannerError as e:
                if s <= seq or not str(e).startswith("tracing "):
                    raise
                failed[s] = str(e)
                return False
        return guarded

    plain = largest_confirmed(traced(points.screen(at, plain=True)), traced(points.fits(at, plain=True)), start,
                              cap, step, SEQ_PARTS)
    longest = plain
    if not request.no_offload and (plain is None or plain < cap):
        after = plain + _resolution(plain, step) if plain else start
        longest = largest_confirmed(traced(points.screen(at)), traced(points.fits(at, past_plain=True)),
                                    min(after, cap), cap, step, SEQ_PARTS) or plain
    if failed:  # (a new user's encoder-decoder with 4,096 positions: the search ended on the first longer one)
        shortest = min(failed)
        cap = min(cap, shortest - step) // step * step
    bound = (f" (the model's {cap:,} learned positions ({limit[0]}): the longest it takes)" if limit and
             limit[1] == cap else " (the longest the model takes: a longer one does not trace, below)" if failed
             else " (the largest tried: the search stops there)")
    if longest is None:
        lines = [f"longest sequence at batch {b:,}: none fits (not even {min(step, cap):,} tokens)"]
    elif plain is None:
        lines = [_verdict(request, points, b, min(step, cap), f"batch {b:,} x seq {min(step, cap):,}")]
    else:
        tried = [q.seq for q in points.sorted() if q.batch == b and q.seq > plain and not (q.fits and not q.offload)]
        after_text = f"; {min(tried):,} does not fit without it" if tried else ""
        configured = points.configured_positions()
        past = f" (past the config's max_position_embeddings, {configured:,}: its rotary positions compute any " \
            "length, but it was not configured for this one)" if configured is not None and plain > configured else ""
        lines = [f"longest sequence without CPU offload at batch {b:,}: {plain:,}{bound if plain >= cap else ''}"
                 f"{past}: {_figures(points.at(b, plain), 'tokens')}{after_text}"]
    lines += _offload_line("sequence", plain, longest, cap, lambda s: points.at(b, s), "tokens", f" at batch {b:,}",
                           request, bound)
    if failed:
        lines.append(f"seq {min(failed):,} and longer were not searched: {failed[min(failed)]}")
    return {"batch": b, "longest": longest, "longest_without_offload": plain, "cap": cap}, lines


def _resolution(value: int, step: int) -> int:
    return max(step, (value // SEQ_PARTS) // step * step)


def _offload_line(what: str, plain: int | None, largest: int | None, cap: int, at: Callable[[int], FitPoint],
                  per: str, where: str, request: FitRequest,
                  bound: str = " (the largest tried: the search stops there)") -> list[str]:
    """The answer with CPU offload, named as such and priced against the answer without it (``bound``: what the
    search's cap is, said where the answer is at it)."""
    if request.no_offload or request.options.offload or largest is None or (largest == cap and plain == cap):
        return []
    if plain is not None and largest == plain:
        return [f"CPU offload fits no larger {what}{where}"]
    p = at(largest)
    cost = ""
    if plain is not None:
        q = at(plain)
        cost = f"; {p.tokens_per_gpu / q.tokens_per_gpu:.0%} of the {per}/s per GPU of {plain:,} without it"
    most = "longest" if what == "sequence" else "largest"
    capped = bound if largest >= cap else ""
    return [f"{most} {what} with CPU offload (auto's last resort){where}: {largest:,}{capped}: {_figures(p, per)}"
            f"{cost}"]


def _verdict(request: FitRequest, points: Points, batch: int, seq: int | None, workload: str) -> str:
    """Nothing fits without CPU offload even at the smallest workload: the fewest GPUs that fit it without, and
    what offload costs here; with --no-offload that ends the command (an error)."""
    job = dataclasses.replace(points.job, model=dataclasses.replace(request.model, batch_size=batch, seq_len=seq))
    fewest = fewest_without_offload(job, points.tracer, request.max_gpus, REPORTER, points.traces.get((batch, seq)))
    if request.no_offload:
        raise PlannerError(f"{fewest.line(f'{request.cluster.name} at {workload}')} (--no-offload)")
    return fewest.line(f"{request.cluster.name} at {workload}", points.at(batch, seq).step_time)


def chunked_step(other: int, chunks: int) -> int:
    """The step of a batch (or sequence) search at ``other`` sequence tokens (or batch) whose tokens a chunked
    loss splits into ``chunks`` equal chunks (torchtitan's ChunkedLossWrapper); 1 without chunks."""
    return chunks // math.gcd(other, chunks) if chunks else 1


def _next(points: Points, batch: int, seq: int | None) -> dict[str, Any] | None:
    """The point just past the largest, when the search evaluated it (it always does below the cap)."""
    seen = points.seen.get((batch, seq, 1))
    return seen.to_dict() if seen else None


def _largest_line(request: FitRequest, points: Points, value: int, p: FitPoint, cap: int, where: str) -> str:
    capped = " (the largest tried: the search stops there)" if value >= cap else ""
    after = "" if value >= cap else f"; batch {value + 1:,} does not fit"
    return (f"largest batch that fits{where} on {request.cluster.name}: {value:,}{capped}: "
            f"{_figures(p, _per(request))}{after}")


def _seq_line(points: Points, batch: int, longest: int | None, cap: int, step: int) -> str:
    if longest is None:
        return f"longest sequence at batch {batch:,}: none fits (not even {step:,} tokens)"
    p = points.at(batch, longest)
    bound = " (the largest tried: the search stops there)" if longest >= cap else ""
    tried = [q.seq for q in points.sorted() if q.batch == batch and not q.fits and q.seq > longest]
    after = f"; {min(tried):,} does not fit" if tried else ""
    return f"longest sequence that fits at batch {batch:,}: {longest:,}{bound}: {_figures(p, 'tokens')}{after}"


def _per(request: FitRequest) -> str:
    """What throughput counts: tokens, or samples for a model that takes no sequence length (a CNN: its JSON
    fields keep their ``tokens_`` names, each token one sample)."""
    return "tokens" if request.seq is not None else "samples"


def _figures(p: FitPoint, per: str) -> str:
    return (f"{p.tokens_per_gpu:,.0f} {per}/s per GPU, MFU {p.mfu:.1%}, step {fmt_time(p.step_time)}, reserved "
            f"{fmt_bytes(p.reserved_memory)} of the {fmt_bytes(p.budget)} budget")


def _gpus(request: FitRequest, points: Points) -> tuple[dict[str, Any], list[str]]:
    """The fewest nodes that fit the workload without CPU offload, then with it (auto turns offload on only when
    nothing fits without it, so both are monotone in the node count), and the next doubling (what adding nodes
    buys)."""
    b, seq = request.batch, request.seq
    per_node = request.cluster.gpus_per_node
    cap = request.max_gpus // per_node
    at = lambda n: (b, seq, n)  # noqa: E731
    plain = smallest_confirmed(points.screen(at, plain=True), points.fits(at, plain=True), cap)
    fewest = plain
    if not request.no_offload and plain != 1:
        below = plain - 1 if plain else cap
        fewest = smallest_confirmed(points.screen(at), points.fits(at, past_plain=True), below) or plain
    tp = request.policy.tp or 1  # (a TP group's GPUs share its batch: per data-parallel rank, not per GPU)
    workload = f"batch {b:,}{f' x seq {seq:,}' if seq else ''} per " + \
        (f"data-parallel rank (each {tp} TP GPUs')" if tp > 1 else "GPU")
    if fewest is None or (request.no_offload and plain is None):
        raise PlannerError(f"nothing fits {workload} on up to {cap * per_node:,} GPUs"
                           f"{' without CPU offload' if request.no_offload else ''} (--max-gpus "
                           f"{request.max_gpus:,}): {points.no_fit(b, seq, cap) if not request.no_offload else ''}"
                           .rstrip(": "))
    per = _per(request)
    lines = []
    if plain is None:
        lines.append(f"without CPU offload nothing fits {workload} on up to {cap * per_node:,} GPUs")
    else:
        q = points.at(b, seq, plain)
        lines.append(f"fewest GPUs that fit {workload} without CPU offload: {_count(q, per_node)}: "
                     f"{q.tokens_per_gpu * q.gpus:,.0f} {per}/s in all, {_figures(q, per)}")
    if fewest != plain:
        p = points.at(b, seq, fewest)
        lines.append(f"fewest with CPU offload (auto's last resort): {_count(p, per_node)}: "
                     f"{p.tokens_per_gpu * p.gpus:,.0f} {per}/s in all, {_figures(p, per)}")
    p = points.at(b, seq, fewest)
    doc: dict[str, Any] = {**_header(request), "gpus": {"batch": b, "seq": seq, "fewest": p.gpus, "nodes": p.nodes,
                                                        "offload": p.offload, "fewest_without_offload":
                                                        plain * per_node if plain else None}}
    if plain and plain * 2 <= cap:  # said, or the table's larger count reads as if the answer were in doubt
        q, d = points.at(b, seq, plain), points.at(b, seq, plain * 2)
        lines.append(f"twice that, {_count(d, per_node)}, for scale: {d.tokens_per_gpu * d.gpus:,.0f} {per}/s in all "
                     f"({d.tokens_per_gpu * d.gpus / (q.tokens_per_gpu * q.gpus):.2f}x the {per}/s)")
    doc["points"] = [q.to_dict() for q in points.sorted()]
    return doc, lines


def _count(p: FitPoint, per_node: int) -> str:
    return f"{p.gpus:,} ({p.nodes:,} node{'s' if p.nodes > 1 else ''} of {per_node})"


def _header(request: FitRequest) -> dict[str, Any]:
    budget = request.budget
    return {"model": request.model.name, "cluster": request.cluster.name,
            "budget": {"budget": budget.limit, "capacity": budget.capacity, "source": budget.source,
                       "headroom": budget.capacity - budget.limit if budget.headroom is not None else None}}


def _sections(request: FitRequest, points: Points) -> list[tuple[str, list[FitPoint]]]:
    """The tables: the batch sweep and the sequence sweep, or the GPU counts tried."""
    rows = points.sorted()
    if request.gpus_auto:
        return [(f"auto's plan at each GPU count tried ({request.cluster.gpu.name})", rows)]
    seq, batch = request.seq, request.batch
    batches = [p for p in rows if p.seq == (seq or 1)]
    at = f" at seq {seq:,}" if seq else ""
    out = [(f"auto's plan at each batch tried{at} on {request.cluster.name}", batches)] \
        if request.find != "seq" and batches else []
    seqs = [p for p in rows if p.batch == batch and p.seq != (seq or 1)]
    if seqs or request.find == "seq":  # (--find seq: every row is a length tried, the given one among them)
        out.append((f"auto's plan at each sequence length tried at batch {batch:,}",
                    sorted([*seqs, *(p for p in batches if p.batch == batch)], key=lambda p: p.seq)))
    return out


def _over(p: FitPoint) -> str:
    """A point's reserved peak over the budget; by so little that both read the same ("70.8 GiB > budget" of 70.8
    GiB), the overshoot."""
    shown, over = fmt_bytes(p.reserved_memory), p.reserved_memory - p.budget
    return f"budget + {fmt_bytes(over)}" if shown == fmt_bytes(p.budget) and over > 0 else f"{shown} > budget"


def _table(title: str, rows: list[FitPoint], with_seq: bool) -> Any:
    from rich.table import Table

    best = max((p.tokens_per_gpu for p in rows if p.fits), default=0.0)
    table = Table(title=escape(title), title_justify="left")  # a cluster file's name
    per = "tokens" if with_seq else "samples"
    for name in ("GPUs", "batch", "seq", "step", f"{per}/s/GPU", "", "MFU", "reserved", "plan"):
        table.add_column(name, justify="left" if name in ("", "plan") else "right")
    for p in rows:
        bar = "█" * max(1, round(BAR * p.tokens_per_gpu / best)) if p.fits and best else ""
        reserved = fmt_bytes(p.reserved_memory) if p.fits else f"[red]{_over(p)}[/red]"
        table.add_row(f"{p.gpus:,}", f"{p.batch:,}", f"{p.seq:,}" if with_seq else "-", fmt_time(p.step_time),
                      f"{p.tokens_per_gpu:,.0f}" if p.fits else "no fit", bar,
                      f"{p.mfu:.1%}" if p.fits else "", reserved, _described(p))
    return table


def _described(p: FitPoint) -> str:
    """The plan in a few words: its layout, checkpointing (full and op-level blocks), offloads; a point searched
    without CPU offload only says so, and one where offload did not fit either that its figures are the closest
    plan's without it (auto's, as ``plan`` reports it: its reserved memory is not what offload would hold)."""
    tried = "" if p.fits or p.offload else "offload not tried" if not p.complete else \
        "shown without CPU offload, which does not fit either"
    words = [p.layout, f"{p.checkpointed} AC" if p.checkpointed else "", f"{p.op_level} op AC" if p.op_level else "",
             "offload" if p.offload else "", f"{p.offloaded} act. offload" if p.offloaded else "", tried]
    return ", ".join(w for w in words if w)


def _draw(request: FitRequest, points: Points) -> None:
    from fsdp_planner.report.fit_png import write_fit_png

    assert request.picture is not None
    if request.gpus_auto:
        rows = [p for p in points.sorted() if p.batch == request.batch]
        x, label = [p.gpus for p in rows], "GPUs"
    else:
        rows = [p for p in points.sorted() if p.seq == (request.seq or 1)]
        x, label = [p.batch for p in rows], "per-GPU batch"
    what = "GPU count" if request.gpus_auto else "batch"
    name = request.model.name  # a model file's name without its folders: titles stay short
    name = Path(name.split(":")[0]).name + ":" + name.rsplit(":", 1)[1] if ".py:" in name else name
    title = f"{name} on {request.cluster.name}: auto's plan at each {what} tried"
    write_fit_png(rows, x, label, request.budget.capacity, request.picture, title, _per(request))
