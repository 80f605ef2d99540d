"""Compute time per op: the roofline estimate, unless the trace carries measured times (``runtime/measure.py``)."""

from __future__ import annotations

import numpy as np

from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.hardware.cluster import GPU
from fsdp_planner.trace.records import Trace


def traced_itemsize(trace: Trace) -> int:
    """Bytes per element the model was traced in: the compute dtype it was cast to, else its widest param
    dtype."""
    return trace.compute_itemsize or max((p.itemsize for p in trace.params), default=4)


def op_times(trace: Trace, gpu: GPU, precision: Precision, mfu: float) -> list[float]:
    """Seconds per event (0 for boundaries): ``max(flops / (peak * mfu), bytes / HBM bandwidth)``.

    The peak is the dense bf16 one for 16-bit compute, else fp32. Bytes are scaled from the traced dtype to the
    compute dtype (a model traced in fp32 but run in bf16 moves half).
    """
    peak = gpu.peak_bf16_flops if precision.compute_bytes <= 2 else gpu.peak_fp32_flops
    scale = precision.compute_bytes / traced_itemsize(trace)
    index = trace.index  # boundaries have no FLOPs and no bytes: they take 0 s
    return np.maximum(index.op_flops / (peak * mfu), index.op_nbytes * (scale / gpu.hbm_bandwidth)).tolist()


def step_op_times(trace: Trace, gpu: GPU, precision: Precision, mfu: float) -> list[float]:
    """The trace's measured op times when it has them, else the roofline estimate."""
    return list(trace.op_seconds) if trace.op_seconds is not None else op_times(trace, gpu, precision, mfu)
