"""``PlanJob``: one planning job, typed and checked, as every front end hands it to the service."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.registry import PolicyName, PolicyRequest
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.options import SimOptions

DEFAULT_CLUSTER = "h100:8"  # auto's cluster when none is given (the command line and the API alike)


def default_cluster(mesh_size: int | None = None) -> str:
    """Auto's cluster when none is given: ``DEFAULT_CLUSTER``, or as many H100s as a given mesh has ranks."""
    return f"h100:{mesh_size}" if mesh_size else DEFAULT_CLUSTER


@dataclass(frozen=True)
class PlanJob:
    """What to plan: the model with its workload (one micro-batch's), the cluster, the step's options, the
    policies and the budget every fits verdict is against."""

    model: ModelSpec
    policies: tuple[PolicyRequest, ...]  # one: that policy's plan; several: a comparison (auto last)
    cluster: Cluster | None  # what the plans are simulated on; None: no simulation (a classic policy alone)
    options: SimOptions
    budget: MemoryBudget | None = None  # with a cluster
    compare: bool = False  # a comparison: a policy that cannot take the settings is left out, not an error
    split: bool = False  # auto chooses how many micro-batches the batch is split into
    whole_batch: int | None = None  # with ``split``: the per-GPU batch of the optimizer step
    split_by_default: bool = False  # ``split`` without ``--micro-batches auto``: the few smallest splits only
    full_trace: bool = False  # every module call traced (no replay of repeated blocks)
    measure: bool = False  # the ops timed on this machine (the front end's tracer does it)
    default_cluster: str | None = None  # the cluster chosen for auto because none was given
    # auto's plan must fit the budget: alone, finding nothing within it is an error (else ``no_fit``); in a
    # comparison, a plan over it is left out (else it is a row, over the budget, and ``no_fit`` says why)
    must_fit: bool = True
    reshard: str = "default"  # a job config's reshard_after_forward rule on classic plans ("default": their own)
    explain: bool = False  # say why auto's plan is what it is (``PlanOutcome.explanation``)

    @property
    def auto(self) -> PolicyRequest | None:
        """Auto's request among the job's policies (None: auto does not run)."""
        return next((p for p in self.policies if p.name is PolicyName.AUTO), None)
