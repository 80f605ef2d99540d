"""fsdp-planner: trace a model, plan its FSDP2 groups, apply them, verify them on a real run."""

from fsdp_planner.apply import apply_plan
from fsdp_planner.auto import AutoPolicy
from fsdp_planner.cluster import Cluster, parse_cluster
from fsdp_planner.errors import PlannerError
from fsdp_planner.metrics import PlanMetrics, plan_metrics
from fsdp_planner.plan import Group, Plan
from fsdp_planner.policies import ExecutionOrderPolicy, ModuleWrapPolicy, SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.simulate import SimOptions, StepReport, simulate
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
