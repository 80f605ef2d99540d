"""Step 2 of the pipeline: FSDP2's semantics for a plan, with no hardware: which params each ``fully_shard`` call
claims, when each group gathers, reshards and reduce-scatters, and in which precision. Applying a plan for real is
``fsdp_planner.apply``'s."""

from fsdp_planner.fsdp2.checkpointing import ACMode, apply_checkpointing, checkpointed_blocks
from fsdp_planner.fsdp2.claim import check_plan_matches, claimed_params, make_plan, validate_plan
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Group, Plan, RunOptions
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.replay import Collective, Replay, Residency, Schedule, TrainingState, build_schedule

__all__ = ["ACMode", "Collective", "CollectiveKind", "Group", "Plan", "Precision", "Replay", "Residency", "RunOptions",
           "Schedule", "TrainingState", "apply_checkpointing", "build_schedule", "check_plan_matches",
           "checkpointed_blocks", "claimed_params", "make_plan", "validate_plan"]
