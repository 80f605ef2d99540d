"""Measure torch's AdamW step on the CPU (foreach), the optimizer FSDP2's CPUOffloadPolicy runs on the host.

Usage: python benchmarks/cpu_adamw.py [--tensors 3] [--numel 100000000] [--steps 3]
Prints elements per second and fp32 param bytes per second; benchmarks/cpu_adamw.md records the figure that
hardware/cluster.py derives the presets' CPU optimizer rate from. ``calibrate --cpu-optimizer`` times the same step
(``calibrate/cpu_optimizer.py``) on one rank's share of the cores and writes it into a cluster file.
"""

from __future__ import annotations

import argparse

import torch

from fsdp_planner.calibrate.cpu_optimizer import adamw_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=3)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    seconds = adamw_seconds(a.tensors, a.numel, a.steps)
    elements = a.tensors * a.numel
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}: {elements:,} elements, "
          f"{seconds:.3f} s/step, {elements / seconds / 1e6:.1f} M elements/s, "
          f"{elements * 4 / seconds / 1e9:.2f} GB/s of fp32 params")


if __name__ == "__main__":
    main()
