"""``calibrate --compute``: the roofline's factors (``hardware.cluster.Compute``) fitted from op times measured on
this machine's GPU, so that a cluster file carries what its own kernels reach instead of the presets' citations.

Timed in bf16 with CUDA events: matmuls of one large shape and a falling smallest dim (the shape curve), causal
fused attention forward and backward, and an elementwise op over a large tensor (the memory-bound rate). The
fractions are of the base cluster's data-sheet peaks, so the base must name this GPU. ``variation`` (the spread of
speed across a cluster's GPUs) cannot be seen from one GPU: the base's is kept.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.cluster import GPU, Compute

MATMUL_DIMS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # smallest dim; the other two are LARGE
LARGE = 8192
ATTENTION_SHAPE = (1, 32, 8192, 128)  # batch, heads, sequence, head dim: a Llama 3 8B layer's
MEMORY_ELEMENTS = 256 * 2 ** 20
COMPUTE_BOUND = 0.5  # a matmul sample fits the curve where its bytes at the memory rate take under this of its time


@dataclass(frozen=True)
class ComputeSample:
    """One timed op: which kernel (``matmul``, ``attention``, ``memory``), a matmul's smallest dim, its work."""

    kind: str
    dim: int
    flops: float
    nbytes: float
    seconds: float


def fit_compute(samples: Sequence[ComputeSample], gpu: GPU, base: Compute, source: str) -> Compute:
    """The factors that make the roofline reproduce ``samples`` on ``gpu``'s peaks; kinds not sampled keep
    ``base``'s. The matmul curve ``cap x d / (d + half)`` is fitted as the line ``1/f = 1/cap + (half/cap) / d``
    over the matmuls whose time is their arithmetic's: a thin one (d = 32-256 of 8192 x 8192 on an H200) takes
    as long as reading its large operand at the memory rate, which the roofline's other term charges, so fitting
    the curve to it would bend the cap past 1 (seen on an H200: benchmarks/gpu_step.md)."""
    peak = gpu.peak_bf16_flops
    out = replace(base, source=source)
    memory = [s.nbytes / (s.seconds * gpu.hbm_bandwidth) for s in samples if s.kind == "memory"]
    if memory:
        out = replace(out, memory_efficiency=min(1.0, statistics.median(memory)))
    attention = [s.flops / (s.seconds * peak) for s in samples if s.kind == "attention"]
    if attention:
        out = replace(out, attention_efficiency=min(1.0, statistics.median(attention)))
    bandwidth = gpu.hbm_bandwidth * out.memory_efficiency
    matmul = [(s.dim, s.flops / (s.seconds * peak)) for s in samples
              if s.kind == "matmul" and s.nbytes / bandwidth < COMPUTE_BOUND * s.seconds]
    if len(matmul) >= 2:
        xs, ys = [1 / d for d, _ in matmul], [1 / f for _, f in matmul]
        slope, intercept = statistics.linear_regression(xs, ys)
        if intercept > 0 and slope >= 0:
            out = replace(out, matmul_efficiency=min(1.0, 1 / intercept), matmul_half_dim=slope / intercept)
        else:  # no saturation seen: the best fraction measured, no shape term
            out = replace(out, matmul_efficiency=min(1.0, max(f for _, f in matmul)), matmul_half_dim=0.0)
    return out


def measure_compute() -> list[ComputeSample]:
    """Time the samples on this machine's CUDA GPU (refused without one: a CPU's rates say nothing of a GPU's)."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise PlannerError("calibrate --compute times matmuls, attention and an elementwise op on a CUDA GPU, and "
                           "this machine has none; the presets' factors and their sources are in "
                           "docs/model.md#compute")

    def timed(fn: Callable[[], object], repeats: int = 10) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats

    dev, dt = torch.device("cuda"), torch.bfloat16
    samples = []
    for d in MATMUL_DIMS:
        a, b = torch.randn(d, LARGE, device=dev, dtype=dt), torch.randn(LARGE, LARGE, device=dev, dtype=dt)
        samples.append(ComputeSample("matmul", d, 2.0 * d * LARGE * LARGE, 2.0 * (2 * d * LARGE + LARGE ** 2),
                                     timed(lambda a=a, b=b: a @ b)))
    q, k, v = (torch.randn(*ATTENTION_SHAPE, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    bsz, heads, seq, hd = ATTENTION_SHAPE
    causal_flops = 2.0 * bsz * heads * seq * seq * hd  # QK^T and PV, 2 FLOPs a multiply-add, half (causal)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    samples.append(ComputeSample("attention", 0, causal_flops, 0.0,
                                 timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))))
    grad = torch.randn_like(out)
    samples.append(ComputeSample("attention", 0, 2.5 * causal_flops, 0.0,
                                 timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))))
    x = torch.randn(MEMORY_ELEMENTS, device=dev, dtype=dt)
    samples.append(ComputeSample("memory", 0, 0.0, 2.0 * x.numel() * x.element_size(), timed(lambda: x * 2.0)))
    return samples
