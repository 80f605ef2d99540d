"""fsdp-planner: trace a model, plan its FSDP2 groups, apply them, verify them on a real run.

The pipeline, one package per step: ``trace`` (the step on meta tensors) -> ``fsdp2`` (FSDP2's semantics for a
plan) -> ``hardware`` (the cluster and its collectives) -> ``sim`` (time and memory of a plan) -> ``planners``
(classic policies and auto) -> ``apply`` (the plan on a real model, or as code) -> ``runtime`` (measure and verify
for real) -> ``cli``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_planner.api import plan, plan_metrics, simulate, trace
    from fsdp_planner.apply import apply_plan
    from fsdp_planner.errors import PlannerError
    from fsdp_planner.fsdp2 import Group, Plan
    from fsdp_planner.hardware import Cluster, parse_cluster
    from fsdp_planner.planners import (
        AutoPolicy,
        ExecutionOrderPolicy,
        ModuleWrapPolicy,
        SizeBasedPolicy,
        TorchtitanPolicy,
    )
    from fsdp_planner.sim import PlanMetrics, SimOptions, StepReport
    from fsdp_planner.sim.tracing import PrecisionError
    from fsdp_planner.trace import Trace

# Each public name and the module it comes from, imported on first use: importing any part of the package (the
# command line's parser above all) must not import torch and every subpackage before it is needed.
_SOURCES = {
    "PlannerError": "fsdp_planner.errors",
    "plan": "fsdp_planner.api",  # the one call a training script makes: the CLI's plan --policy auto
    "Group": "fsdp_planner.fsdp2", "Plan": "fsdp_planner.fsdp2", "apply_plan": "fsdp_planner.apply",
    "Cluster": "fsdp_planner.hardware", "parse_cluster": "fsdp_planner.hardware",
    **dict.fromkeys(("AutoPolicy", "ExecutionOrderPolicy", "ModuleWrapPolicy", "SizeBasedPolicy", "TorchtitanPolicy"),
                    "fsdp_planner.planners"),
    **dict.fromkeys(("PlanMetrics", "SimOptions", "StepReport"), "fsdp_planner.sim"),
    # (the API's simulate and plan_metrics check a plan against the trace first, as the command line does)
    # ``trace`` at a precision (default the command line's), of the model's meta twin: the API and every command
    # trace alike
    **dict.fromkeys(("plan_metrics", "simulate", "trace"), "fsdp_planner.api"),
    "PrecisionError": "fsdp_planner.sim.tracing",
    "Trace": "fsdp_planner.trace",
}

__all__ = [
    "AutoPolicy",
    "Cluster",
    "ExecutionOrderPolicy",
    "Group",
    "ModuleWrapPolicy",
    "Plan",
    "PlanMetrics",
    "PlannerError",
    "PrecisionError",
    "SimOptions",
    "SizeBasedPolicy",
    "StepReport",
    "TorchtitanPolicy",
    "Trace",
    "apply_plan",
    "parse_cluster",
    "plan",
    "plan_metrics",
    "simulate",
    "trace",
]


def __getattr__(name: str) -> Any:
    """``fsdp_planner.Plan`` and the other public names, imported when first read (PEP 562)."""
    if name not in _SOURCES:
        raise AttributeError(f"module 'fsdp_planner' has no attribute '{name}'")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # read once: later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """This package's module: importing the ``fsdp_planner.trace`` subpackage sets the package's ``trace`` to that
    module, but the public name ``trace`` is the function (``sim.tracing.trace``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "trace" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
