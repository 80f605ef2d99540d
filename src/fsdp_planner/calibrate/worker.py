"""One rank of ``calibrate --backend gloo``, run under torchrun as ``__main__`` with JOB.json
(``runtime.launch.rank_command``). Rank 0 writes what every rank measured together (``gloo.py`` fits it);
``runtime.rank.run_rank`` starts and ends the rank (gloo on the CPU, even beside a GPU) and reports a failure. It
measures:

- the collectives FSDP2 calls (``all_gather_single``, ``reduce_scatter_single``) over a sweep of sizes, with the
  buffers FSDP2 allocates and copies into for them, median seconds of each (a barrier before each call: every rank
  starts it together, as in a step);
- the chain of tiny layers of ``overhead.py`` trained for real: without FSDP, and under FSDP2 plans of the root
  alone, and one list group down to one group per layer (``overhead.chain_plan``), median seconds of steps
  run back to back as ``verify`` times them (``runtime.worker.time_steps``: a barrier before each), the plans
  taking turns;
- the chain's per-op times as ``--measure`` times them, to split the step without FSDP into the ops and what the
  framework spends around them;
- this CPU's one-thread fp32 matmul rate and copy bandwidth (the roofline of a model traced without ``--measure``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_planner.apply.fully_shard import apply_plan, device_mesh
from fsdp_planner.calibrate.overhead import (
    chain_model,
    chain_plan,
    chain_trace,
    copy_bandwidth,
    fastest_steps,
    training_step,
)
from fsdp_planner.runtime.measure import CPU_RANK_REPEATS, measure
from fsdp_planner.runtime.rank import run_rank

WARMUP = 2
STEP_SECONDS = 2.0  # each chain plan is timed for at least this long, over all its turns
MAX_REPS = 200
MATMUL = 512  # square fp32 matmul whose rate stands for the CPU's peak


def _timed(fn: Any, reps: int, min_seconds: float = 0.0) -> list[float]:
    """Seconds of ``fn`` over ``reps`` calls, or more until they took ``min_seconds`` (a fast step wants more
    samples; rank 0 decides, so every rank makes the same calls), after warm-up calls; all ranks start each call
    together."""
    for _ in range(WARMUP):  # gloo sets up each new size's buffers and pairs on first use
        fn()
    times: list[float] = []
    more = torch.ones(1)
    while more.item():
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        more.fill_(len(times) < reps or (sum(times) < min_seconds and len(times) < MAX_REPS))
        dist.broadcast(more, 0)
    return times


def sweep(sizes: list[int], world: int, reps: int) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) of each collective at each size (bytes as nccl-tests counts them: the unsharded side), as
    FSDP2 runs it on a CPU: its input allocated and copied in, its output allocated, every call (there is no caching
    allocator on a CPU: a buffer of 32 MiB or more is fresh pages from the OS each time, which a collective into a
    reused buffer would not show)."""
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def all_gather(numel: int, source: torch.Tensor) -> None:
        shard = torch.empty(numel // world)
        shard.copy_(source[: numel // world])
        gather(torch.empty(numel), shard)

    def reduce_scatter(numel: int, source: torch.Tensor) -> None:
        full = torch.empty(numel)
        full.copy_(source)
        scatter(torch.empty(numel // world), full)

    out: dict[str, list[tuple[int, float]]] = {"all_gather": [], "reduce_scatter": []}
    for size in sizes:
        numel = max(world, size // 4 // world * world)
        source = torch.ones(numel)
        many = reps if size <= 1 << 20 else max(3, reps // 3)
        for kind, fn in (("all_gather", all_gather), ("reduce_scatter", reduce_scatter)):
            out[kind].append((numel * 4, statistics.median(_timed(lambda f=fn, n=numel, s=source: f(n, s), many))))
    return out


def time_chain(group_sizes: list[int], world: int, rounds: int, seconds: float = STEP_SECONDS,
               repeats: int = 0) -> tuple[float, list[float], list[float]]:
    """Median step of the chain without FSDP, and under each plan (``chain_plan``); and the chain's per-op times
    measured as ``--measure`` does. The plans take turns, ``rounds`` times: in each turn a plan runs warm-up steps,
    then steps back to back for ``seconds / rounds`` (as ``verify`` times them: its own caches warm), so a
    machine that is slower for a minute slows every plan alike instead of one. ``repeats``: of the per-op timing
    (default ``CPU_RANK_REPEATS``)."""
    traced = chain_trace()
    steps = []
    for k in [None, *group_sizes]:
        built = chain_model()
        if k is not None:
            plan = chain_plan(traced, k)
            apply_plan(built.model, plan, mesh=device_mesh(plan, "cpu", world))
        steps.append(training_step(built.model, built.example_inputs, built.loss_fn))
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i] += _timed(step, 1, seconds / rounds)
    built = chain_model()
    measured = measure(built.model, built.example_inputs, built.loss_fn, repeats=repeats or CPU_RANK_REPEATS,
                       device=torch.device("cpu"))
    medians = [statistics.median(t) for t in times]
    return medians[0], medians[1:], list(measured.op_seconds or ())


def cpu_rates(reps: int = 5) -> tuple[float, float]:
    """(fp32 matmul FLOP/s, copy bytes/s) of one thread of this CPU."""
    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    cpu = torch.device("cpu")
    return 2 * MATMUL**3 / fastest_steps([lambda: torch.mm(a, b)], cpu, reps)[0], copy_bandwidth(cpu, reps)


def _run(job: dict, device: torch.device, rank: int, world: int) -> None:
    """The measurements on this rank; rank 0 writes them."""
    # the chain first: the sweep's large buffers would leave this rank's heap larger than a small model's
    plain, plans, op_seconds = time_chain(job["group_sizes"], world, job["rounds"],
                                          job.get("seconds", STEP_SECONDS), job.get("repeats", 0))
    collectives = sweep(job["sizes"], world, job["reps"])
    flops, copy = cpu_rates()
    if rank == 0:
        Path(job["result"]).write_text(json.dumps({
            "world": world, "collectives": collectives, "plain_seconds": plain, "plan_seconds": plans,
            "op_seconds": op_seconds, "matmul_flops": flops, "copy_bandwidth": copy,
            "threads": torch.get_num_threads()}))
    dist.barrier()


if __name__ == "__main__":
    run_rank(sys.argv[1], _run, cpu=True)
