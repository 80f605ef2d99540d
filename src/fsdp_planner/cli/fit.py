"""``fsdp-planner fit MODEL --cluster C``: what fits the cluster with auto's best plan. The largest per-GPU batch at
``--seq`` and the longest sequence at ``--batch``, with tokens/s per GPU and MFU at each batch that fits; with
``--gpus auto``, the fewest whole nodes that fit ``--batch`` x ``--seq`` and the tokens/s at each count tried.

Every point is ``plan MODEL --policy auto --cluster C --batch B --seq S`` run the same way (the same trace, the
same deterministic search within ``--search-effort``, the same budget with ``--headroom``), so each row is what
``plan`` prints for that workload; the searches (``planners/fit.py``) rely on memory being monotone in the batch,
the sequence and the node count."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.choices import PolicyName
from fsdp_planner.cli.commands import DEFAULT_MAX_FIT_GPUS
from fsdp_planner.cli.common import REPORTER, tracer
from fsdp_planner.cli.paths import picture_file
from fsdp_planner.cli.requests import memory_budget, model_spec, named_cluster, policy_request, sim_options
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time, json_text
from fsdp_planner.hardware.cluster import Cluster, with_nodes
from fsdp_planner.limits import MAX_BATCH, MAX_SEQ, MAX_TOKENS
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.fit import FitPoint, largest_fitting, smallest_fitting
from fsdp_planner.planners.registry import PolicyRequest
from fsdp_planner.service.fit import Points
from fsdp_planner.service.job import PlanJob
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.options import SimOptions

PICTURE_SUFFIXES = (".png", ".svg", ".pdf")
SEQ_STEP = 128  # the longest sequence is found to a multiple of this (or of the --seq it starts from, if smaller)
SEQ_PARTS = 16  # ... and to 1/16 of the longest power-of-two multiple that fits: a few traces, not a dozen
BAR = 20  # characters of the fastest row's throughput bar
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


def fit_request(args: argparse.Namespace) -> FitRequest:
    picture = picture_file(args.picture, "--picture", PICTURE_SUFFIXES, stem="fit")
    if args.gpus and _COUNTED_CLUSTER.match(args.cluster):
        raise PlannerError(f"--gpus auto chooses the GPU count: give --cluster without one (e.g. "
                           f"{args.cluster.split(':')[0].strip()}), or drop --gpus auto to search the batch on "
                           f"{args.cluster}")
    if args.gpus and args.mesh:
        raise PlannerError("--mesh fixes the GPU count, which --gpus auto chooses: drop --mesh (auto chooses the "
                           "layout at each count) or --gpus auto")
    spec = model_spec(args)
    workload = spec.workload()
    batch = workload.get("batch_size")
    if not isinstance(batch, int):
        raise PlannerError(f"the per-GPU batch of '{args.model}' is not known: give --batch")
    seq = workload.get("seq_len")
    seq = seq if isinstance(seq, int) else None  # None: no seq_len (or a user factory's, not read): batch only
    if args.find == "seq" and seq is None and not args.gpus:
        raise PlannerError(f"--find seq searches the sequence length, and '{args.model}' takes none (or its default "
                           "is not known): give --seq, or search the batch")
    if args.find == "batch" and args.batch is not None and not args.gpus:  # said, never silently ignored
        render.note(f"--batch {args.batch} has no effect with --find batch: the batch is what it searches (from 1)")
    if args.gpus and args.find != "both":
        render.note("--find has no effect with --gpus auto: the workload is --batch x --seq as given")
    cluster = named_cluster(args, args.cluster)
    if args.gpus:
        cluster = with_nodes(cluster, 1)
    elif args.max_gpus != DEFAULT_MAX_FIT_GPUS:
        render.note("--max-gpus has no effect without --gpus auto: the batch and sequence are searched on --cluster")
    return FitRequest(spec, batch, seq, policy_request(args, PolicyName.AUTO.value), cluster, bool(args.gpus),
                      args.max_gpus, sim_options(args), memory_budget(args, cluster), picture, args.json,
                      args.full_trace, args.find)


def run(args: argparse.Namespace) -> int:
    request = fit_request(args)
    points = _points(request)
    if request.gpus_auto:
        doc, lines = _gpus(request, points)
    else:
        doc, lines = _workload(request, points)
    if request.picture is not None:
        _draw(request, points)
    if request.json:
        print(json_text(doc, indent=2))
        return 0
    for title, rows in _sections(request, points):
        render.console.print(_table(title, rows, request.seq is not None))
    for line in lines:
        render.plain(line)
    if request.picture is not None:
        render.plain(f"picture written to {request.picture}")
    return 0


def _points(request: FitRequest) -> Points:
    """The evaluations of ``plan MODEL --policy auto`` at each point the searches ask for."""
    job = PlanJob(request.model, (request.policy,), request.cluster, request.options, request.budget,
                  full_trace=request.full_trace, must_fit=False)
    return Points(job, tracer(False, request.full_trace), request.gpus_auto, REPORTER)


def _workload(request: FitRequest, points: Points) -> tuple[dict[str, Any], list[str]]:
    """The largest batch at the sequence, then the longest sequence at the batch (``--find`` picks)."""
    doc: dict[str, Any] = _header(request)
    lines: list[str] = []
    if request.find in ("batch", "both"):
        doc["batch"], lines = _largest_batch(request, points)
    if request.seq is not None and request.find in ("seq", "both"):
        b, seq = request.batch, request.seq
        cap = min(MAX_SEQ, MAX_TOKENS // b)
        step = min(SEQ_STEP, 1 << (seq.bit_length() - 1))
        longest = largest_fitting(points.fits(lambda s: (b, s, 1)), seq, cap, step, SEQ_PARTS)
        lines.append(_seq_line(points, b, longest, cap, step))
        plain = longest
        if longest is not None and points.at(b, longest).offload:
            plain = largest_fitting(points.fits(lambda s: (b, s, 1), plain=True), seq, longest, step, SEQ_PARTS)
            answer = (f"{plain:,}: {_figures(points.at(b, plain), 'tokens')}" if plain
                      else f"none (not even {step:,} tokens)")
            lines.append(f"longest without CPU offload at batch {b:,}: {answer}")
        doc["seq"] = {"batch": b, "longest": longest, "longest_without_offload": plain}
    doc["points"] = [p.to_dict() for p in points.sorted()]
    return doc, lines


def _largest_batch(request: FitRequest, points: Points) -> tuple[dict[str, Any], list[str]]:
    """The largest batch that fits at the sequence, and the fastest per GPU of the batches tried (checkpointing
    may make the largest slower than a smaller one)."""
    seq = request.seq
    cap = min(MAX_BATCH, MAX_TOKENS // (seq or 1))
    largest = largest_fitting(points.fits(lambda b: (b, seq, 1)), 1, cap)
    if largest is None:
        raise PlannerError(f"nothing fits even at batch 1: {points.no_fit(1, seq)}")
    where = f" at seq {seq:,}" if seq else ""
    lines = [_largest_line(request, points, largest, points.at(largest, seq), cap, where)]
    plain: int | None = largest
    if points.at(largest, seq).offload:  # auto's last resort: how far the batch goes without it
        plain = largest_fitting(points.fits(lambda b: (b, seq, 1), plain=True), 1, largest)
        lines.append(f"largest batch without CPU offload{where}: "
                     + (f"{plain:,}: {_figures(points.at(plain, seq), _per(request))}" if plain
                        else "none (not even 1)"))
    fastest = max((p for p in points.sorted() if p.fits and p.seq == (seq or 1)), key=lambda p: p.tokens_per_gpu)
    if fastest.batch != largest:
        lines.append(f"most {_per(request)}/s per GPU{where}: batch {fastest.batch:,}: "
                     f"{_figures(fastest, _per(request))}")
    return {"seq": seq, "largest": largest, "largest_without_offload": plain, "fastest": fastest.batch,
            "next": _next(points, largest + 1, seq)}, lines


def _next(points: Points, batch: int, seq: int | None) -> dict[str, Any] | None:
    """The point just past the largest, when the search evaluated it (it always does below the cap)."""
    seen = points.seen.get((batch, seq, 1))
    return seen[0].to_dict() if seen else None


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
    """The fewest nodes that fit the workload, the fewest that fit without CPU offload when those needed it (auto
    turns offload on only when nothing fits without it, so that too is monotone in the node count), and the next
    doubling (what adding nodes buys)."""
    b, seq = request.batch, request.seq
    per_node = request.cluster.gpus_per_node
    cap = max(1, request.max_gpus // per_node)
    fewest = smallest_fitting(points.fits(lambda n: (b, seq, n)), cap)
    if fewest is None:
        raise PlannerError(f"nothing fits on up to {cap * per_node:,} GPUs (--max-gpus {request.max_gpus:,}): "
                           f"{points.no_fit(b, seq, cap)}")
    p = points.at(b, seq, fewest)
    workload = f"batch {b:,}{f' x seq {seq:,}' if seq else ''} per GPU"
    lines = [f"fewest GPUs that fit {workload}: {_count(p, per_node)}{' with CPU offload' if p.offload else ''}: "
             f"{p.tokens_per_gpu * p.gpus:,.0f} {_per(request)}/s in all, {_figures(p, _per(request))}"]
    doc: dict[str, Any] = {**_header(request), "gpus": {"batch": b, "seq": seq, "fewest": p.gpus, "nodes": p.nodes,
                                                        "offload": p.offload, "fewest_without_offload": None}}
    if p.offload:
        plain = smallest_fitting(points.fits(lambda n: (b, seq, n), plain=True), cap)
        if plain is None:
            lines.append(f"without CPU offload nothing fits on up to {cap * per_node:,} GPUs")
        else:
            q = points.at(b, seq, plain)
            doc["gpus"]["fewest_without_offload"] = q.gpus
            lines.append(f"fewest GPUs that fit it without CPU offload: {_count(q, per_node)}: "
                         f"{q.tokens_per_gpu * q.gpus:,.0f} {_per(request)}/s in all, {_figures(q, _per(request))}")
            fewest = plain
    if fewest * 2 <= cap:
        points.at(b, seq, fewest * 2)
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
    out = [(f"auto's plan at each batch tried{at} on {request.cluster.name}", batches)]
    seqs = [p for p in rows if p.batch == batch and p.seq != (seq or 1)]
    if seqs:
        out.append((f"auto's plan at each sequence length tried at batch {batch:,}",
                    sorted([*seqs, *(p for p in batches if p.batch == batch)], key=lambda p: p.seq)))
    return out


def _table(title: str, rows: list[FitPoint], with_seq: bool) -> Any:
    from rich.table import Table

    best = max((p.tokens_per_gpu for p in rows if p.fits), default=0.0)
    table = Table(title=escape(title), title_justify="left")  # a cluster file's name
    per = "tokens" if with_seq else "samples"
    for name in ("GPUs", "batch", "seq", "step", f"{per}/s/GPU", "", "MFU", "reserved peak", "layout"):
        table.add_column(name, justify="left" if name in ("", "layout") else "right")
    for p in rows:
        bar = "█" * max(1, round(BAR * p.tokens_per_gpu / best)) if p.fits and best else ""
        reserved = fmt_bytes(p.reserved_memory) if p.fits else f"[red]{fmt_bytes(p.reserved_memory)} > budget[/red]"
        table.add_row(f"{p.gpus:,}", f"{p.batch:,}", f"{p.seq:,}" if with_seq else "-", fmt_time(p.step_time),
                      f"{p.tokens_per_gpu:,.0f}" if p.fits else "does not fit", bar,
                      f"{p.mfu:.1%}" if p.fits else "", reserved,
                      f"{p.layout}{f', {p.checkpointed} AC' if p.checkpointed else ''}"
                      f"{', offload' if p.offload else ''}{f', {p.offloaded} act. offload' if p.offloaded else ''}")
    return table


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
    title = f"{request.model.name} on {request.cluster.gpu.name}: auto's plan at each {what} tried"
    write_fit_png(rows, x, label, request.budget.capacity, request.picture, title, _per(request))
