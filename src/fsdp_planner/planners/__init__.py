"""Step 4 of the pipeline: turning a trace into a plan, with the classic policies as baselines."""

from fsdp_planner.planners.auto import AutoPolicy, AutoResult, Target
from fsdp_planner.planners.classic import ModuleWrapPolicy, SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.planners.order import ExecutionOrderPolicy
from fsdp_planner.planners.registry import (
    CLASSIC_POLICIES,
    Baseline,
    Policy,
    PolicyName,
    PolicyRequest,
    make_baseline,
    make_policy,
)

__all__ = ["CLASSIC_POLICIES", "AutoPolicy", "AutoResult", "Baseline", "ExecutionOrderPolicy", "ModuleWrapPolicy",
           "Policy", "PolicyName", "PolicyRequest", "SizeBasedPolicy", "Target", "TorchtitanPolicy", "make_baseline",
           "make_policy"]
