"""fsdp-planner: trace a model, plan its FSDP2 groups, apply them, verify them on a real run.

The pipeline, one package per step: ``trace`` (the step on meta tensors) -> ``fsdp2`` (FSDP2's semantics for a
plan) -> ``hardware`` (the cluster and its collectives) -> ``sim`` (time and memory of a plan) -> ``planners``
(classic policies and auto) -> ``apply`` (the plan on a real model, or as code) -> ``runtime`` (measure and verify
for real) -> ``cli``.
"""

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
from fsdp_planner.sim import PlanMetrics, SimOptions, StepReport, plan_metrics, simulate
from fsdp_planner.trace import Trace, trace

__all__ = [
    "AutoPolicy",
    "Cluster",
    "ExecutionOrderPolicy",
    "Group",
    "ModuleWrapPolicy",
    "Plan",
    "PlanMetrics",
    "PlannerError",
    "SimOptions",
    "SizeBasedPolicy",
    "StepReport",
    "TorchtitanPolicy",
    "Trace",
    "apply_plan",
    "parse_cluster",
    "plan_metrics",
    "simulate",
    "trace",
]
