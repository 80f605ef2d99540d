"""Measure torch's AdamW step on the CPU (foreach), the optimizer FSDP2's CPUOffloadPolicy runs on the host.

Usage: python benchmarks/cpu_adamw.py [--tensors 3] [--numel 100000000] [--steps 3]
Prints elements per second and fp32 param bytes per second; benchmarks/cpu_adamw.md records the figure that
hardware/cluster.py uses as the preset's CPU optimizer rate.
"""

from __future__ import annotations

import argparse
import time

import torch


def measure(tensors: int, numel: int, steps: int) -> float:
    """Seconds per AdamW step over ``tensors`` fp32 params of ``numel`` elements (state already allocated)."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()  # the first step allocates exp_avg / exp_avg_sq: not timed
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=3)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    seconds = measure(a.tensors, a.numel, a.steps)
    elements = a.tensors * a.numel
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}: {elements:,} elements, "
          f"{seconds:.3f} s/step, {elements / seconds / 1e6:.1f} M elements/s, "
          f"{elements * 4 / seconds / 1e9:.2f} GB/s of fp32 params")


if __name__ == "__main__":
    main()
