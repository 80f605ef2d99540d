"""``calibrate --cpu-optimizer``: the host's optimizer step rate under ``CPUOffloadPolicy``, measured here.

FSDP2 with ``CPUOffloadPolicy`` steps the optimizer on the host over each rank's fp32 shard; the ranks of a node run
theirs at once, sharing its cores. So one rank's rate is timed on its share of the cores: torch's
``AdamW(foreach=True)`` (what training loops use) on ``cores // ranks per node`` threads, over params far larger
than the caches (the step streams ~28 bytes per element: param, grad, two moments).
"""

from __future__ import annotations

import os
import time

TENSORS = 3
NUMEL = 4_000_000  # 16 MB per fp32 tensor, ~240 MB for params, grads and moments: past any CPU cache
STEPS = 3


def adamw_seconds(tensors: int = TENSORS, numel: int = NUMEL, steps: int = STEPS) -> float:
    """Seconds per AdamW step over ``tensors`` fp32 params of ``numel`` elements (state already allocated)."""
    import torch

    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()  # the first step allocates exp_avg / exp_avg_sq: not timed
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps


def rank_threads(ranks_per_node: int) -> int:
    """One rank's share of this machine's cores (at least one)."""
    return max(1, (os.cpu_count() or 1) // ranks_per_node)


def measure_cpu_optimizer(ranks_per_node: int, numel: int = NUMEL) -> tuple[float, str]:
    """(elements/s of one rank's optimizer step, the figure's source), timed on its share of the cores."""
    import torch

    threads = rank_threads(ranks_per_node)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = adamw_seconds(numel=numel)
    finally:
        torch.set_num_threads(before)
    cores = os.cpu_count() or 1
    return TENSORS * numel / seconds, (f"calibrate --cpu-optimizer: torch {torch.__version__} AdamW(foreach) on "
                                       f"{threads} of {cores} cores (one of {ranks_per_node} ranks' share)")
