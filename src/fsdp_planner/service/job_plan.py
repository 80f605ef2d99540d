"""The plan a training job runs (``verify``, the fake world): a plan file checked against the model, a policy's
plan, or auto's plan for a large cluster carried onto the job's model and ranks (``planners/at_scale.py``)."""

from __future__ import annotations

from pathlib import Path

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.fsdp2.validity import check_plan_runs
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.at_scale import onto_job
from fsdp_planner.planners.registry import PolicyRequest
from fsdp_planner.service.plan_files import load_plan
from fsdp_planner.service.planning import SILENT, Reporter, policy_plan
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.records import Trace


def job_plan(tr: Trace, plan_file: Path | None, policy: PolicyRequest | None, model: ModelSpec,
             cluster: Cluster | None, options: SimOptions, world: int | None, reporter: Reporter = SILENT) -> Plan:
    """The plan to run: the plan file's, checked against the model, or the policy's (auto's for ``cluster``);
    checked against ``world`` ranks when given."""
    if plan_file is not None:
        plan = load_plan(str(plan_file), tr, model, reporter.note, world, options)
    else:
        assert policy is not None
        plan = policy_plan(tr, policy, model, cluster, options, reporter, world)
    if world is not None:
        check_plan_world_size(plan, world, plan_file=plan_file is not None)
    return plan


def check_carries(plan: Plan) -> None:
    """Refuse carrying a plan with expert parallelism onto a small job (``--plan-for``): its expert groups and EP
    degree are the large cluster's, which ``onto_job`` does not rescale; verify an EP plan on its own ranks."""
    if plan.expert_parallel is not None:
        ep = plan.expert_parallel.describe()
        raise PlannerError(f"--plan-for does not carry expert parallelism ({ep}) onto a smaller job yet: verify with "
                           "--ep on --nproc ranks, or on the cluster's own world size with --fake-world-size")


def carried_plan(planned: Trace, tr: Trace, policy: PolicyRequest, name: str, cluster: Cluster, nproc: int,
                 options: SimOptions, other_model: bool, reporter: Reporter = SILENT) -> tuple[Plan, Plan, list[str]]:
    """``--plan-for``: auto's plan for ``cluster`` of the model traced as ``planned`` (named ``name``; with
    ``other_model``, ``--plan-model``'s), carried onto the job's model ``tr`` and ``nproc`` ranks and checked there:
    the plan at scale, the job's, and notes saying what did not carry over."""
    at_scale = policy_plan(planned, policy, name, cluster, options, reporter)
    check_carries(at_scale)
    label = f"{at_scale.policy} of {name}" if other_model else at_scale.policy  # (it names the cluster)
    plan, notes = onto_job(at_scale, planned, tr, nproc, label)
    check_plan_matches(plan, tr)
    check_plan_runs(tr, plan)
    check_plan_world_size(plan, nproc)
    return at_scale, plan, notes
