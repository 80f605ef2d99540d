"""``PlanOutcome``: what the service returns for a ``PlanJob``, ready to format: the plan as it leaves the program,
each plan's figures, and auto's search in summary (the front ends read no search internals)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.planners.auto import AutoResult, best_fitting_baseline
from fsdp_planner.planners.auto.explain import GroupExplanation, explain
from fsdp_planner.service.job import PlanJob
from fsdp_planner.sim.host_work import HostWork, host_work
from fsdp_planner.sim.metrics import PlanMetrics
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.trace.records import Trace

Row = tuple[Plan, PlanMetrics, StepReport | None]  # a plan, its metrics, its simulated step (with a cluster)


@dataclass(frozen=True)
class Layout:
    """One data-parallel layout auto compared: its best plan's step and reserved memory."""

    name: str  # "RxS"
    step_time: float
    reserved: int
    fits: bool
    offload: bool = False  # its best plan runs with CPU offload (what let it fit, where the layouts beside it do not)


@dataclass(frozen=True)
class SearchSummary:
    """Auto's search as a user reads it: the plan it chose and its step, the budget, the work done, the best
    classic policy that fits the budget on the chosen layout (None: none does) and the layouts compared."""

    plan: Plan
    report: StepReport
    budget: int
    budget_source: str
    fits: bool
    evaluated: int
    refined: int
    effort: int
    seconds: float
    best_baseline: str | None  # the best fitting classic policy's name ("titan + full AC")
    best_baseline_step: float | None
    layouts: tuple[Layout, ...]
    cluster: Cluster  # planned for: its host figures (the CPU optimizer rate an offload plan's step depends on)
    tp_fixed: bool = False  # the TP degree was given (--tp, a config's): each layout ran the batch per DP rank given


def summarize(result: AutoResult, tp_fixed: bool = False) -> SearchSummary:
    best = best_fitting_baseline(result)
    ev = result.search.ev
    # (a search keeps its plans' CPU offload apart, ``RunOptions``: its step says it, the optimizer on the host)
    layouts = tuple(Layout(name, c.report.step_time, c.report.reserved_memory, ev.fits(c),
                           c.plan.offload or c.report.cpu_optimizer_time > 0) for name, c in result.meshes.items())
    return SearchSummary(result.written_plan, result.report, result.budget, result.budget_source, result.fits,
                         result.evaluated, result.refined, result.effort, result.seconds,
                         best.origin if best else None, best.report.step_time if best else None, layouts,
                         ev.cluster, tp_fixed)


@dataclass(frozen=True)
class Explanation:
    """Why auto's plan is what it is (``plan --explain``): per group what holds its boundary and the best one-step
    alternative, the checkpointing choice in words, and FSDP2's host work on the cluster it was planned for."""

    groups: tuple[GroupExplanation, ...]
    checkpointing: str | None
    host: HostWork
    cluster: Cluster


def explained(result: AutoResult) -> Explanation:
    ev = result.search.ev
    return Explanation(tuple(explain(result)),
                       result.checkpointing.describe(result.plan) if result.checkpointing is not None else None,
                       host_work(ev.ctx, result.plan), ev.cluster)


@dataclass(frozen=True)
class Split:
    """One split of the batch tried for ``micro_batches='auto'``: its auto plan's step and whether it fits."""

    micro_batches: int
    step_time: float
    fits: bool


@dataclass(frozen=True)
class PlanOutcome:
    """The job as run (after ``split``, at its chosen micro-batches), its trace, each plan's row (the job's
    policies in order; a comparison leaves out what cannot run), ``plan``: the first row's plan as it leaves the
    program (precision, attention kernel and hf_config recorded, as ``--out`` writes it), auto's search (None when
    auto did not run) and, when it found nothing within the budget, ``no_fit``: why (its plan is no row then,
    unless a comparison's ``must_fit`` is False)."""

    job: PlanJob
    trace: Trace
    rows: tuple[Row, ...]
    plan: Plan | None
    auto: AutoResult | None
    search: SearchSummary | None
    no_fit: str | None
    splits: tuple[Split, ...] = ()
    explanation: Explanation | None = None  # with ``PlanJob.explain`` and a plan auto found within the budget

    @property
    def fits(self) -> bool:
        return self.no_fit is None

    @property
    def report(self) -> StepReport | None:
        """The first plan's simulated step (None without a cluster)."""
        return self.rows[0][2] if self.rows else None

    @property
    def baselines(self) -> tuple[Row, ...]:
        """The rows of the policies other than auto (auto's, when a row, is the last: it is the job's last policy)."""
        shown = self.auto is not None and (self.fits or (self.job.compare and not self.job.must_fit))
        return self.rows[:-1] if shown else self.rows

    def fastest_baseline(self) -> tuple[Plan, StepReport, bool] | None:
        """The fastest simulated baseline within the job's budget, else the fastest (None: none simulated), and
        whether it fits: what a comparison sets auto's plan against."""
        budget = self.job.budget
        simulated = [(p, r) for p, _, r in self.baselines if r is not None]
        if budget is None or not simulated:
            return None
        fitting = [(p, r) for p, r in simulated if budget.fits(r.reserved_memory)]
        plan, report = min(fitting or simulated, key=lambda pr: pr[1].step_time)
        return plan, report, bool(fitting)
