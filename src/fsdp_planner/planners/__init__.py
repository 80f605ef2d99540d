"""Step 4 of the pipeline: turning a trace into a plan, with the classic policies as baselines."""

from fsdp_planner.planners.auto import AutoPolicy, AutoResult, Target
from fsdp_planner.planners.classic import ModuleWrapPolicy, SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.planners.order import ExecutionOrderPolicy
from fsdp_planner.planners.registry import CLASSIC_POLICIES, Policy, PolicyName, PolicyRequest, make_policy

__all__ = ["CLASSIC_POLICIES", "AutoPolicy", "AutoResult", "ExecutionOrderPolicy", "ModuleWrapPolicy", "Policy",
           "PolicyName", "PolicyRequest", "SizeBasedPolicy", "Target", "TorchtitanPolicy", "make_policy"]
