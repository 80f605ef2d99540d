"""Step 3 of the pipeline: the step on a cluster, in time and memory, for any plan."""

from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.memory import MemoryBreakdown, MemoryModel, strategy_table
from fsdp_planner.sim.metrics import PlanMetrics, plan_metrics
from fsdp_planner.sim.options import OPTIMIZERS, PRECISIONS, Optimizer, SimOptions
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.sizing import Sizing
from fsdp_planner.sim.timeline import Stream, TimelineEvent

__all__ = ["OPTIMIZERS", "PRECISIONS", "MemoryBreakdown", "MemoryModel", "Optimizer", "PlanMetrics",
           "SimContext", "SimOptions", "Sizing", "StepReport", "Stream", "TimelineEvent", "plan_metrics", "simulate",
           "strategy_table"]
