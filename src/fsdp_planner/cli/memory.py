"""``fsdp-planner memory MODEL --cluster C`` (or ``--world-size N``): per-rank memory of one device, DDP, ZeRO-1/2
and FSDP. Its figures are the memory model's *allocated* peaks of each strategy without activation checkpointing
(FSDP: one group per param-owning module, about the least FSDP holds); ``plan`` simulates a plan and prints its
allocated peak and what the caching allocator reserves beyond it (the collective streams' pools), which is what
auto holds to the budget. The command says so under its table, with the budget."""

from __future__ import annotations

import argparse
import shlex

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.cli.common import load_trace
from fsdp_planner.cli.options import job_flags
from fsdp_planner.cli.requests import model_spec, named_cluster
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, fmt_bytes, json_text
from fsdp_planner.hardware.cluster import MAX_WORLD_SIZE, Cluster
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.memory import strategy_table
from fsdp_planner.sim.options import SimOptions


def _budget(cluster: Cluster) -> MemoryBudget:
    """The budget plans on ``cluster`` are held to by default (``plan``'s, without --memory-budget or --headroom)."""
    return MemoryBudget.of_gpu(cluster.gpu.memory_bytes, cluster.gpu.name)


def run(args: argparse.Namespace) -> int:
    cluster = named_cluster(args, args.cluster) if args.cluster else None
    if cluster is not None:
        args.world_size = cluster.world_size
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise PlannerError(f"--world-size must be from 1 to {MAX_WORLD_SIZE:,}, got {cut_short(args.world_size)}")
    options = SimOptions.named(args.precision, args.optimizer, zero_grad=args.zero_grad)
    rows = strategy_table(load_trace(model_spec(args), full=args.full_trace,
                                   precision=options.precision), args.world_size, options)
    if args.json:
        print(json_text({k: v.to_dict() for k, v in rows.items()}, indent=2))
    else:
        where = cluster.name if cluster is not None else f"world size {args.world_size}"
        title = f"{escape(args.model)}: per-rank peak memory on {escape(where)} ({args.precision}, " \
                f"{options.optimizer.name})"
        render.console.print(render.strategy_table(rows, title))
        budget = f"; one {cluster.gpu.name} holds {fmt_bytes(cluster.gpu.memory_bytes)}, and a plan's reserved " \
                 f"peak, above its allocated one, is held to {fmt_bytes(_budget(cluster).limit)} of it " \
                 f"({_budget(cluster).source})" if cluster else ""
        render.plain("allocated peaks without activation checkpointing (FSDP: one group per module owning params, "
                     f"none gathered by the root, about the least FSDP holds){budget}. A plan's own peaks, its "
                     "groups' and the allocator's: plan "
                     f"{escape(shlex.quote(args.model))} --policy auto --cluster "
                     f"{escape(where if cluster else f'h100:{args.world_size}')}"
                     f"{escape(''.join(f' {f}' for f in job_flags(args)))} (or --policy module: a group per block, "
                     "the root keeping the embeddings and the output gathered)")
    return 0
