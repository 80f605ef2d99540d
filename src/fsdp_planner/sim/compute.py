"""Compute time per op: a roofline with per-kernel efficiencies, unless the trace carries measured times
(``runtime/measure.py``).

Each op takes ``max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x memory efficiency))``, the efficiency by
kernel (``hardware.cluster.Compute``): a matmul by its smallest dim, a fused attention kernel its own, other FLOPs
(convolutions) at the matmul cap. The step waits for its slowest rank: every op is stretched by
``slowest_rank_factor`` of the world size. ``--mfu`` (``SimOptions.mfu``) instead runs every op's FLOPs at that one
fraction of the peak and its bytes at the full HBM bandwidth, with no rank variation: the model before the roofline,
kept to reproduce figures made with it.

In a torch.compile'd module call (``Trace.compiled``) inductor fuses the memory-bound ops (``KERNEL_OTHER``): their
bytes in its forward, and in its backward, are scaled to the bytes its fused kernels move (``trace/compiled.py``:
each tensor crossing into or out of a fused region once), each op keeping its share; matmuls and attention are
library kernels, timed as in eager. The host launches a compiled call's kernels (its graphs' ``launches``) rather
than one per op: ``launches_through``.
"""

from __future__ import annotations

import numpy as np

from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.hardware.cluster import GPU, Compute, slowest_rank_factor
from fsdp_planner.linear_attention import FLA_SHARE_OF_FLASH
from fsdp_planner.sim.float8 import FLOAT8_PEAK_SHARE, Float8Step, fp8_peak
from fsdp_planner.trace.events import (
    ATTENTION_KERNELS,
    KERNEL_CAUSAL_ATTENTION,
    KERNEL_LINEAR_ATTENTION,
    KERNEL_OTHER,
    EventKind,
)
from fsdp_planner.trace.index import TraceIndex
from fsdp_planner.trace.records import Trace


def traced_itemsize(trace: Trace) -> int:
    """Bytes per element the model was traced in (``Trace.traced_itemsize``)."""
    return trace.traced_itemsize


def flop_efficiency(kernel: np.ndarray, compute: Compute) -> np.ndarray:
    """Per event: the fraction of the dense peak its FLOPs run at (``Event.kernel`` says which kernel): a matmul's
    by its smallest dim, fused attention's, and flash-linear-attention's a share of that (``FLA_SHARE_OF_FLASH``)."""
    dims = np.maximum(kernel, 1).astype(np.float64)  # non-matmuls' 1 only keeps the division defined
    matmul = compute.matmul_efficiency * dims / (dims + compute.matmul_half_dim)
    out = np.where(kernel > 0, matmul, compute.matmul_efficiency)
    out = np.where(kernel == KERNEL_LINEAR_ATTENTION, compute.attention_efficiency * FLA_SHARE_OF_FLASH, out)
    return np.where(np.isin(kernel, ATTENTION_KERNELS), compute.attention_efficiency, out)


def kernel_flops(index: TraceIndex) -> np.ndarray:
    """Per event: the FLOPs its kernel does, which the efficiencies are fractions of. A causal attention kernel
    does half of what torch's FLOP counter counts for it (``KERNEL_CAUSAL_ATTENTION``), and its efficiency is of
    that half, as FlashAttention's benchmarks and ``calibrate --compute`` count it; the trace keeps the counter's
    FLOPs (MFU, ``--mfu``: model FLOPs as torchtitan counts them)."""
    return np.where(index.op_kernel == KERNEL_CAUSAL_ATTENTION, 0.5, 1.0) * index.op_flops


def fused_nbytes(trace: Trace) -> np.ndarray:
    """Per event: the bytes it moves, the memory-bound ops of compiled calls scaled to their fused kernels' bytes
    (module docstring); the trace's own when nothing is compiled."""
    nbytes = trace.index.op_nbytes
    if not trace.compiled:
        return nbytes
    out = nbytes.copy()
    memory_bound = trace.index.op_kernel == KERNEL_OTHER  # boundaries move nothing: unchanged
    events = trace.events
    for m, block in trace.compiled.items():
        at = {(events[i].kind, events[i].call): i for i in trace.index.boundaries_by_module.get(m, ())}
        for (kind, call), start in at.items():
            if kind not in (EventKind.FWD_PRE, EventKind.BWD_PRE):
                continue
            end = at.get((EventKind.FWD_POST if kind is EventKind.FWD_PRE else EventKind.BWD_POST, call))
            fused = block.fused_nbytes[kind is EventKind.BWD_PRE]
            sel = np.flatnonzero(memory_bound[start:end]) + start if end is not None else []
            eager = out[sel].sum()
            if eager > 0:
                out[sel] *= fused / eager
    return out


def launches_through(trace: Trace) -> np.ndarray:
    """``TraceIndex.ops_through`` counting launches: a compiled call's forward and backward each launch their
    graph's kernels, spread over their ops (a fraction each), where eager launches one per op."""
    through = trace.index.ops_through
    if not trace.compiled:
        return through
    is_op = np.diff(through, prepend=0).astype(np.float64)
    events = trace.events
    for m, block in trace.compiled.items():
        at = {(events[i].kind, events[i].call): i for i in trace.index.boundaries_by_module.get(m, ())}
        for (kind, call), start in at.items():
            end = at.get((EventKind.FWD_POST if kind is EventKind.FWD_PRE else EventKind.BWD_POST, call))
            if kind not in (EventKind.FWD_PRE, EventKind.BWD_PRE) or end is None:
                continue
            ops = is_op[start:end].sum()
            if ops:
                is_op[start:end] *= block.launches[kind is EventKind.BWD_PRE] / ops
    return np.cumsum(is_op)


def full_precision_ops(trace: Trace) -> np.ndarray:
    """Per event: whether it is an op of a module kept in fp32 or of one inside it (an fp32 group's BatchNorm or
    router computes in fp32 under a 16-bit step: its matmuls run at fp32's peak, not bf16's)."""
    names = set(trace.full_precision)
    inside = tuple(f"{name}." for name in names)
    return np.fromiter((e.is_op and (e.module in names or e.module.startswith(inside)) for e in trace.events),
                       dtype=bool, count=len(trace.events))


def peak_flops(gpu: GPU, precision: Precision) -> float:
    """The GPU's dense peak FLOP/s in the precision's compute dtype: bf16's for 16-bit compute, else fp32's."""
    return gpu.peak_bf16_flops if precision.compute_bytes <= 2 else gpu.peak_fp32_flops


def op_times(trace: Trace, gpu: GPU, precision: Precision, compute: Compute, ranks: int = 1,
             mfu: float | None = None, float8: Float8Step | None = None) -> list[float]:
    """Seconds per event (0 for boundaries) on ``gpu``, in a step synchronised over ``ranks`` GPUs.

    The peak is the dense bf16 one for 16-bit compute, else fp32; the ops of modules kept in fp32 (an fp32 group's,
    ``Trace.full_precision``) at fp32's; float8 training's converted matmuls at the float8 peak, after their casts
    (``float8.py``). Bytes are scaled from the traced dtype to the compute dtype (a
    model traced in fp32 but run in bf16 moves half).
    """
    peak = op_peaks(trace, gpu, precision, float8, share=mfu is None)
    scale = precision.compute_bytes / traced_itemsize(trace)
    index = trace.index  # boundaries have no FLOPs and no bytes: they take 0 s
    nbytes = fused_nbytes(trace)
    if mfu is not None:
        times = np.maximum(index.op_flops / (peak * mfu), nbytes * (scale / gpu.hbm_bandwidth))
        return _with_casts(times, float8, gpu.hbm_bandwidth).tolist()
    flops_time = kernel_flops(index) / (peak * flop_efficiency(index.op_kernel, compute))
    bytes_time = nbytes * (scale / (gpu.hbm_bandwidth * compute.memory_efficiency))
    times = _with_casts(np.maximum(flops_time, bytes_time), float8, gpu.hbm_bandwidth * compute.memory_efficiency)
    return (times * slowest_rank_factor(compute.variation, ranks)).tolist()


def op_peaks(trace: Trace, gpu: GPU, precision: Precision, float8: Float8Step | None = None,
             share: bool = True) -> np.ndarray:
    """Per event, the FLOP/s its kernel's efficiency applies to: the dense bf16 peak for 16-bit compute, else
    fp32's; fp32 groups' ops at fp32's; float8 training's converted matmuls at the float8 peak, times the share of it
    a float8 matmul reaches where the efficiencies are bf16 matmuls' (``share``; float8.py)."""
    peak = np.full(len(trace.events), peak_flops(gpu, precision))
    if trace.full_precision and precision.compute_bytes <= 2:
        peak[full_precision_ops(trace)] = gpu.peak_fp32_flops
    if float8 is not None:
        peak[float8.matmuls] = fp8_peak(gpu) * (FLOAT8_PEAK_SHARE if share else 1.0)
    return peak


def cast_seconds_of(events: int, float8: Float8Step | None, bandwidth: float) -> np.ndarray:
    """Per event, the seconds of a converted matmul's float8 casts (memory-bound kernels before it), else 0."""
    out = np.zeros(events)
    if float8 is not None:
        out[float8.matmuls] = float8.cast_nbytes / bandwidth
    return out


def _with_casts(times: np.ndarray, float8: Float8Step | None, bandwidth: float) -> np.ndarray:
    """``times`` with each converted matmul's casts (memory-bound kernels before it) added to it."""
    return times + cast_seconds_of(len(times), float8, bandwidth)


def step_op_times(trace: Trace, gpu: GPU, precision: Precision, compute: Compute, ranks: int = 1,
                  mfu: float | None = None, float8: Float8Step | None = None) -> list[float]:
    """The trace's measured op times when it has them, else the roofline estimate."""
    if trace.op_seconds is not None:
        return list(trace.op_seconds)
    return op_times(trace, gpu, precision, compute, ranks, mfu, float8)
