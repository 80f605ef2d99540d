"""The planning use case: a ``PlanJob`` in, a ``PlanOutcome`` out. The command line's ``plan`` (with or without a
job config), ``fsdp_planner.plan`` and ``fit`` all run this, so they give the same plan for the same job.

How the model is traced is the caller's (``Tracer``): the command line may time the ops (``--measure``), the API
traces a live module; a spec's meta trace is ``tracing.trace_spec``. What a run has to say on the way (a note, a
spinner) goes to a ``Reporter``; the API's is silent."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from fsdp_planner.choices import ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.plan import Mesh, Plan, check_plan_world_size
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, infeasible_message
from fsdp_planner.planners.auto.split import choose_split
from fsdp_planner.planners.blocks import default_block_class
from fsdp_planner.planners.registry import PolicyName, PolicyRequest, make_baseline, make_policy
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.outcome import PlanOutcome, Row, Split, explained, summarize
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.sizing import with_memory_options
from fsdp_planner.trace.records import Trace

Tracer = Callable[[ModelSpec, SimOptions], Trace]  # the step of one micro-batch of the model, in the options' dtypes


@contextlib.contextmanager
def _quietly(description: str) -> Iterator[None]:
    yield


def _ignore(text: str) -> None:
    return None


@dataclass(frozen=True)
class Reporter:
    """Where a run's notes and progress go (default: nowhere)."""

    note: Callable[[str], None] = _ignore
    progress: Callable[[str], AbstractContextManager[None]] = _quietly


SILENT = Reporter()


def plan(job: PlanJob, tracer: Tracer, reporter: Reporter = SILENT) -> PlanOutcome:
    """The job's plans and their figures; with one policy, its failure is an error (auto: finding nothing within
    the budget), in a comparison it is left out with a note (auto: ``no_fit`` says why)."""
    splits: tuple[Split, ...] = ()
    if job.split:
        job, splits = _split(job, tracer, reporter)
    tr = tracer(job.model, job.options)
    plans, auto, no_fit = _plans(tr, job, reporter)
    rows = _rows(tr, plans, job, auto)
    kept = as_written(plans[0], job, tr) if plans else None
    why = explained(auto) if job.explain and auto is not None and no_fit is None else None
    return PlanOutcome(job, tr, tuple(rows), kept, auto, summarize(auto) if auto else None, no_fit, splits, why)


def as_written(plan: Plan, job: PlanJob, tr: Trace) -> Plan:
    """``plan`` as it leaves the program (``--out``, the API's return): with the precision (export sets it, so the
    code runs as the numbers assumed), the attention kernel it was planned for (absent: the default), the
    hf_config fields (verify rebuilds that model) and the modules it compiles (the trace's, ``--compile``)."""
    return dataclasses.replace(plan, precision=job.options.precision.name, attention=job.model.attention or "",
                               hf_config=dict(job.model.hf_config), compiled=tuple(tr.compiled))


def _split(job: PlanJob, tracer: Tracer, reporter: Reporter) -> tuple[PlanJob, tuple[Split, ...]]:
    """``split``: the job at the split of the batch whose auto plan is fastest within the budget
    (``planners/auto/split.py``), each split traced at its micro-batch and searched."""
    (policy,), cluster, batch = job.policies, job.cluster, job.whole_batch
    assert cluster is not None and batch is not None

    def at(n: int) -> PlanJob:
        return dataclasses.replace(job, model=dataclasses.replace(job.model, batch_size=batch // n),
                                   options=dataclasses.replace(job.options, micro_batches=n), split=False)

    def searched(n: int) -> AutoResult:
        one = at(n)
        return search(tracer(one.model, one.options), policy, cluster, one.options, job.model.name, reporter)

    best, tried = choose_split(batch, searched)
    return at(best.micro_batches), tuple(Split(s.micro_batches, s.result.report.step_time, s.result.fits)
                                         for s in tried)


def search(tr: Trace, request: PolicyRequest, cluster: Cluster, options: SimOptions, model: str,
           reporter: Reporter = SILENT) -> AutoResult:
    """Auto's search on ``cluster`` (a result over the budget is the caller's to report)."""
    capacity = cluster.gpu.memory_bytes
    if request.memory_budget is not None and request.memory_budget > capacity:
        reporter.note(f"--memory-budget {fmt_bytes(request.memory_budget)} is more than one {cluster.gpu.name} "
                      f"holds ({fmt_bytes(capacity)}): a plan within it may not fit on the GPU")
    with reporter.progress(f"auto: searching plans for {cluster.name}"):
        policy = make_policy(request, cluster, options)
        assert isinstance(policy, AutoPolicy)
        return policy.search(tr, model)


def fitting(result: AutoResult) -> AutoResult:
    """``result``, or the one sentence saying why no plan fits the budget."""
    if not result.fits:
        raise PlannerError(infeasible_message(result))
    return result


def stamped(plan: Plan, tr: Trace, world: int | None, options: SimOptions | None) -> Plan:
    """``plan`` recording the memory options asked for beside those it has (a plan file's offload or shard dims are
    kept; a reduce dtype asked for replaces its own). Shard dims need the shard size: none without ``world``."""
    if options is None:
        return plan
    placement = options.shard_placement if world is not None and not plan.shard_dims else ShardPlacement.DIM0
    shard = plan.shard_size(world) if world is not None else 1
    reduce = options.reduce_dtype.value if options.reduce_dtype else plan.reduce_dtype
    out = with_memory_options(plan, tr, shard, plan.offload or options.offload, placement, reduce)
    return out if not plan.shard_dims else dataclasses.replace(out, shard_dims=plan.shard_dims)


def with_reshard(plan: Plan, rule: str) -> Plan:
    """``plan`` with a job config's ``reshard_after_forward`` rule ("always": every group; "never": none;
    "default": the policy's own)."""
    if rule == "default":
        return plan
    groups = [dataclasses.replace(g, reshard_after_forward=rule == "always") for g in plan.groups]
    return dataclasses.replace(plan, policy=f"{plan.policy}, reshard_after_forward {rule}", groups=groups)


def policy_plan(tr: Trace, request: PolicyRequest, model: str, cluster: Cluster | None = None,
                options: SimOptions | None = None, reporter: Reporter = SILENT) -> Plan:
    """The plan a policy makes for the traced model (auto: for ``cluster``, within its budget)."""
    if request.name is PolicyName.AUTO:
        if cluster is None:
            raise PlannerError("--policy auto plans for a cluster: add --cluster, e.g. --cluster h100:8")
        return fitting(search(tr, request, cluster, options or SimOptions(), model, reporter)).written_plan
    plan = make_policy(request).plan(tr, model)
    if cluster is not None:
        check_plan_world_size(plan, cluster.world_size)
    return stamped(plan, tr, cluster.world_size if cluster else None, options)


def grouping_to_check(tr: Trace, request: PolicyRequest, model: str, cluster: Cluster | None = None,
                      options: SimOptions | None = None, reporter: Reporter = SILENT) -> Plan:
    """The plan ``check`` looks for faults in: auto's for ``cluster`` (as ``policy_plan``), a classic policy's
    grouping unchecked (a param it would read sharded is one of check's findings, not an error)."""
    if request.name is PolicyName.AUTO:
        return policy_plan(tr, request, model, cluster, options, reporter)
    return make_baseline(request).build(tr, model)


def _compared(tr: Trace, job: PlanJob, reporter: Reporter) -> tuple[PolicyRequest, ...]:
    """The policies to run: in a comparison, module and titan only when the model has a block class to wrap (the
    module classes asked for, or a repeated one)."""
    named = any(p.module_classes for p in job.policies)
    if not job.compare or named or default_block_class(tr) is not None:
        return job.policies
    reporter.note("the module and titan policies are left out of the comparison: the model has no repeated "
                  "block class (name the classes to wrap with --module-classes to compare them)")
    return tuple(p for p in job.policies if p.name not in (PolicyName.MODULE, PolicyName.TITAN))


def _plans(tr: Trace, job: PlanJob, reporter: Reporter) -> tuple[list[Plan], AutoResult | None, str | None]:
    """Each policy's plan, auto's search result, and why auto found no plan within the budget (in a comparison
    that is a result, not an error)."""
    auto: AutoResult | None = None
    plans: list[Plan] = []
    no_fit: str | None = None
    for policy in _compared(tr, job, reporter):
        if policy.name is not PolicyName.AUTO:
            plans += _classic(tr, policy, job, reporter)
            continue
        assert job.cluster is not None
        auto = search(tr, policy, job.cluster, job.options, job.model.name, reporter)
        if not job.compare and job.must_fit:
            fitting(auto)
        if not auto.fits:
            no_fit = infeasible_message(auto)
            if job.must_fit or not job.compare:
                continue
        plans.append(auto.written_plan)  # with auto's run options (offload, shard dims, reduce dtype)
    return plans, auto, no_fit


def _classic(tr: Trace, policy: PolicyRequest, job: PlanJob, reporter: Reporter) -> list[Plan]:
    """A classic policy's plan; in a comparison, none (with a note saying why) when the policy cannot take the
    requested settings or FSDP2 would fail on its plan: that is no baseline."""
    try:
        plan = make_policy(policy).plan(tr, job.model.name)  # its world size is checked where it is simulated
        return [with_reshard(stamped(plan, tr, job.cluster.world_size if job.cluster else None, job.options),
                             job.reshard)]
    except PlannerError as e:
        if not job.compare:
            raise
        reporter.note(f"the {policy.name.value} policy is left out of the comparison: {e}")
        return []


def _rows(tr: Trace, plans: list[Plan], job: PlanJob, auto: AutoResult | None) -> list[Row]:
    """Each plan's metrics and, with a cluster, its simulated step (one context per layout: the comparison may mix
    auto's HSDP with pure FSDP); auto's step is the one its search simulated."""
    cluster = job.cluster
    world = cluster.world_size if cluster else None
    contexts: dict[tuple[Mesh, SimOptions], SimContext] = {}

    def simulated(p: Plan) -> StepReport | None:
        if cluster is None:
            return None
        if auto is not None and (auto.fits or not job.must_fit) and p == auto.written_plan:
            return auto.report
        check_plan_world_size(p, cluster.world_size)
        key = (p.layout(cluster.world_size), plan_options(p, job.options))  # auto may have chosen offload
        if key not in contexts:
            contexts[key] = SimContext(tr, cluster, key[1], mesh=key[0])
        return simulate(tr, p, context=contexts[key], timeline=False)

    precision = job.options.precision if cluster else None  # the table's bytes in the simulation's dtypes
    return [(p, plan_metrics(tr, p, world, precision), simulated(p)) for p in plans]
