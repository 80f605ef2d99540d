"""FSDP2's host overhead, measured: the figures of ``hardware.cluster.Overhead`` (``calibrate --overhead``).

Real FSDP2 on PyTorch's fake process group (its collectives return at once, so nothing waits for a network) with
real tensors on this machine's device (the GPU when there is one), on a chain of tiny Linear layers: the step is
then the host's work, the ops' dispatch and launch and FSDP2's hooks, as in a model of tiny layers
(pytorch#173680). The same chain is timed without FSDP (``op_seconds`` = its step over the trace's ops) and under
plans of one group per k layers for several k. The simulator charges a plan ``hooks x hook_seconds +
params x param_seconds`` on top of its ops, with ``hooks`` counted by the planner's own replay
(``Schedule.hooks``) and ``params`` the params FSDP2 manages (all of them in every measured plan), so
``hook_seconds`` is the least-squares slope of step time over the hook count (whatever FSDP2 does per hook:
Python, its copy kernels' launches, stream and event calls) and ``param_seconds`` the line's intercept above the
step without FSDP, per param (its views, its DTensor gradient, its share of the foreach copies). The residuals
of that line are reported: a straight line is the model's claim, and they check it.

``copy_bandwidth`` is FSDP2's copy-out (``split_with_sizes_copy`` of an all-gather's output into the params) timed
on the device; on a CPU it is host memory bandwidth, which says nothing of a GPU, so ``calibrate`` keeps the
cluster's figure then.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_map

from fsdp_planner.apply.fully_shard import apply_plan, device_mesh
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import Overhead
from fsdp_planner.models import LoadedModel
from fsdp_planner.runtime.measure import local_device
from fsdp_planner.trace import record
from fsdp_planner.trace.recorder import default_loss, split_inputs
from fsdp_planner.trace.records import Trace

LAYERS = 256  # tiny layers in the measured chain
WIDTH = 32  # their width: small enough that every op is dispatch, not arithmetic
GROUP_SIZES = (256, 64, 16, 4, 1)  # layers per group in the measured plans (one group down to one per layer)
WORLD = 8  # fake ranks: FSDP2 on one rank skips its collectives, which would hide their launch
COPY_BYTES = 64 << 20


@dataclass(frozen=True)
class PlanTiming:
    """One measured plan: its groups, the hooks the replay counts for it, the median step seconds."""

    groups: int
    hooks: int
    seconds: float
    predicted: float = 0.0  # by the fitted line


@dataclass(frozen=True)
class OverheadMeasurement:
    """What ``measure_overhead`` found, and the line it fitted."""

    device: str
    ops: int  # ops in one step of the chain (the trace's count)
    params: int  # params FSDP2 manages in every measured plan
    plain_seconds: float  # one step without FSDP
    plans: list[PlanTiming]
    intercept: float  # the fitted line's step time at zero hooks (close to ``plain_seconds`` when it holds)
    overhead: Overhead

    @property
    def worst_residual(self) -> float:
        """The largest |measured / fitted - 1| over the plans."""
        return max(abs(p.seconds / p.predicted - 1) for p in self.plans)


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs(device: torch.device | str) -> torch.Tensor:
    return torch.randn(4, WIDTH, device=device)


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def chain_model() -> LoadedModel:
    """The measured chain with real parameters (seeded) on the CPU."""
    torch.manual_seed(0)
    return LoadedModel("chain", _Chain(), (_inputs("cpu"),), _sum)


def chain_trace() -> Trace:
    """The chain's trace, on meta tensors."""
    with torch.device("meta"):
        meta = _Chain()
    return record(meta, (_inputs("meta"),), _sum)


def fastest_steps(steps: list[Callable[[], None]], device: torch.device, rounds: int,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Each step's fastest time over ``rounds``, the steps taken in turn in every round: a machine busy with
    something else slows a whole stretch of time, and taking turns spreads that over every step alike, while the
    fastest time is the cost of the work itself (as ``timeit`` reports)."""
    for step in steps:  # warm-up: lazy init, allocator, first-call paths
        step()
        step()
    best = [float("inf")] * len(steps)
    for _ in range(rounds):
        for i, step in enumerate(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[i] = min(best[i], clock() - start)
    return best


def chain_plan(traced: Trace, k: int) -> Plan:
    """The chain under FSDP2: one group per ``k`` layers (a list group when k > 1), or with ``k`` 0 the root alone.
    The root-alone plan and the one-list-group plan differ in nothing but 255 modules' FSDPState hooks."""
    if k == 0:
        return make_plan(traced, [])
    return make_plan(traced, [[f"layers.{i}" for i in range(s, s + k)] for s in range(0, LAYERS, k)])


def training_step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[], None]:
    args, kwargs = split_inputs(inputs)

    def step() -> None:
        loss_fn(model(*args, **kwargs)).backward()
        for p in model.parameters():
            p.grad = None

    return step


def host_clock(device: torch.device) -> Callable[[], float]:
    """The clock a step of tiny ops is timed by. On a GPU the wall clock (the step ends when the device does). On a
    CPU the calling thread's CPU time: the step is all host work on this thread (CPU autograd runs backward on the
    caller, and ops this small take no intra-op threads), and CPU time leaves out the stretches another process
    held the core (a full test run on 2 cores timed 256 groups at 1.17x one group by the wall, 4x idle)."""
    return time.perf_counter if device.type == "cuda" else time.thread_time


def time_plans(build: Callable[[], LoadedModel], plans: Sequence[Plan | None], device: torch.device,
               rounds: int = 7) -> list[float]:
    """The fastest training step (forward, loss, backward) of a fresh model from ``build`` under each plan
    (``None``: no FSDP), applied with real ``fully_shard`` over ``WORLD`` ranks of the fake process group."""
    if dist.is_initialized():
        raise PlannerError("timing FSDP2 needs a process without a torch.distributed process group")
    steps = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        for plan in plans:
            built = build()
            model = built.model.to(device)
            if plan is not None:
                apply_plan(model, plan, mesh=device_mesh(plan, device.type, WORLD))
            inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, built.example_inputs)
            steps.append(training_step(model, inputs, built.loss_fn or default_loss))
        return fastest_steps(steps, device, rounds, host_clock(device))
    finally:
        dist.destroy_process_group()


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``seconds = a + hooks * b``, with ``a`` at least 0: a step takes no negative time without
    hooks, and a burst of other work on a shared host during the many-hook plans tilted the line below zero (a
    full-suite run: a plan predicted at a negative step). Then the line through the origin."""
    xs, ys = [float(h) for h, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if my - b * mx >= 0:
        return my - b * mx, b
    return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)


def copy_bandwidth(device: torch.device, rounds: int) -> float:
    """Bytes per second of FSDP2's copy-out: one flat buffer split into many params' tensors."""
    src = torch.empty(COPY_BYTES // 4, device=device)
    sizes = [src.numel() // 64] * 64
    outs = [torch.empty(s, device=device) for s in sizes]
    seconds = fastest_steps([lambda: torch.split_with_sizes_copy(src, sizes, out=outs)], device, rounds)[0]
    return COPY_BYTES / seconds


def measure_overhead(device: torch.device | None = None, rounds: int = 7,
                     progress: Callable[[str], None] | None = None) -> OverheadMeasurement:
    """Time the chain without FSDP and under each plan of ``GROUP_SIZES``, and fit ``Overhead``."""
    device = device or local_device()
    traced = chain_trace()
    ops = sum(e.is_op for e in traced.events)
    params = len(traced.params)
    plans = [chain_plan(traced, size) for size in GROUP_SIZES]
    hooks = [len(build_schedule(traced, plan, WORLD).hooks) for plan in plans]
    if progress:
        progress(f"timing {rounds} rounds of a step of {LAYERS} tiny layers without FSDP and with FSDP2 in "
                 f"{', '.join(str(len(p.inner_groups)) for p in plans)} groups")
    seconds = time_plans(chain_model, [None, *plans], device, rounds)
    plain_seconds = seconds[0]
    timings = [PlanTiming(len(p.inner_groups), h, t) for p, h, t in zip(plans, hooks, seconds[1:], strict=True)]
    intercept, hook_seconds = fit_line([(t.hooks, t.seconds) for t in timings])
    if hook_seconds <= 0:
        raise PlannerError("the measured step did not grow with the number of FSDP2 groups (the machine was too "
                           "busy to time it?): run calibrate --overhead again on an idle machine")
    timings = [PlanTiming(t.groups, t.hooks, t.seconds, intercept + t.hooks * hook_seconds) for t in timings]
    if progress:
        progress("timing the copy-out")
    copy = copy_bandwidth(device, rounds)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    source = (f"calibrate --overhead: FSDP2 {torch.__version__} on the fake process group, {LAYERS} tiny layers, "
              f"{name}")
    param_seconds = max(0.0, intercept - plain_seconds) / params
    return OverheadMeasurement(str(device), ops, params, plain_seconds, timings, intercept,
                               Overhead(hook_seconds, plain_seconds / ops, copy, param_seconds, source))
