"""Measured compute: run the model's forward + backward for real on the local device and time every op.

The roofline estimate (``sim/compute.py``) is a guess; on the GPU type the job will run on, measured times
are the accurate mode. The timed run is a normal ``record(..., measure=True)``, so the measured trace has the
same events as the planning trace and the simulator uses its ``op_seconds`` in place of the estimate.
Measured on a CPU, the times are the CPU's, not the cluster GPUs': useful to check the machinery, not to
predict a GPU step.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp_planner.errors import PlannerError
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.recorder import record
from fsdp_planner.trace.records import Trace

# repeats when timing ops for a CPU rank (calibrate --backend gloo, verify --measure on its cluster): the host
# engine corrects each op by a per-op figure that is a small difference of two sums, so the medians must be steady
CPU_RANK_REPEATS = 9


def local_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def available_memory(device: torch.device) -> int:
    """Free bytes on ``device``: CUDA's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_memory("MemAvailable", "SC_AVPHYS_PAGES")


def host_memory(field: str = "MemTotal", pages: str = "SC_PHYS_PAGES") -> int:
    """Bytes of the host's memory from /proc/meminfo's ``field`` (MemTotal, MemAvailable), or from ``sysconf``'s
    ``pages`` where there is no /proc."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def required_memory(planning_trace: Trace) -> int:
    """Bytes a real unsharded step needs, from the planning trace: params and grads, buffers, activations
    saved for backward, and the largest single op's traffic as working space."""
    ops = [e for e in planning_trace.events if e.kind is EventKind.OP]
    saved = sum(e.saved for e in ops if not e.backward)
    largest_op = max((e.nbytes for e in ops), default=0)
    return 2 * planning_trace.nbytes + planning_trace.buffers_nbytes + saved + largest_op


def check_fits(planning_trace: Trace, device: torch.device, name: str = "the model") -> None:
    need, free = required_memory(planning_trace), available_memory(device)
    if need > 0.8 * free:
        raise PlannerError(
            f"--measure runs {name} unsharded on this machine's {device.type}: it needs about "
            f"{need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is free; measure on a larger device or drop "
            "--measure to use the roofline estimate"
        )


def measure(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    repeats: int = 3,
    device: torch.device | None = None,
    threads: int | None = None,
) -> Trace:
    """A trace whose ``op_seconds`` are per-op medians over ``repeats`` timed steps, after one warm-up step.

    ``model`` must have real parameters; it and the example inputs are moved to ``device`` (default: the
    local GPU, else the CPU). ``threads``: the CPU threads torch may use meanwhile (a gloo rank's, to predict
    its step: ``verify`` runs each rank with one); default: as it is.
    """
    if repeats < 1:
        raise PlannerError("--measure needs at least one timed repeat")
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure(model, example_inputs, loss_fn, repeats, device)
        finally:
            torch.set_num_threads(before)
    device = device or local_device()
    model = model.to(device)
    inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, example_inputs)
    loss = loss_fn
    if loss_fn is not None and device.type != "cpu":
        def loss(out: Any) -> torch.Tensor:  # a factory's loss closes over CPU labels
            return loss_fn(tree_map(lambda t: t.to("cpu") if isinstance(t, torch.Tensor) else t, out))
    runs = [record(model, inputs, loss, measure=True) for _ in range(repeats + 1)]
    first, timed = runs[0], runs[1:]
    shape = [(e.kind, e.module, e.backward) for e in first.events]
    for r in timed:
        if [(e.kind, e.module, e.backward) for e in r.events] != shape:
            raise PlannerError("the model ran different ops on repeated steps; --measure needs a deterministic step")
    seconds = tuple(statistics.median(r.op_seconds[i] for r in timed) for i in range(len(shape)))  # type: ignore[index]
    return timed[-1].with_op_seconds(seconds)
