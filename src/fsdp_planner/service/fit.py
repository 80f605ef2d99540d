"""``fit``'s evaluations: auto's plan for one workload (batch, sequence) on one world (node count), each point the
job ``plan MODEL --policy auto`` runs for it, run once and kept, so a search over the batch, the sequence or the
node count (``planners/fit.py``) asks for a point as often as it likes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsdp_planner.fmt import fmt_bytes, fmt_time
from fsdp_planner.hardware.cluster import with_nodes
from fsdp_planner.planners.fit import FitPoint
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.outcome import PlanOutcome
from fsdp_planner.service.planning import SILENT, Reporter, Tracer, plan
from fsdp_planner.sim.compute import peak_flops

Key = tuple[int, int | None, int]  # batch, seq (None: the model takes none), nodes


class Points:
    """Every point evaluated, each once: ``job`` (auto on one node, or on the cluster) at the point's workload and
    node count (``nodes_vary``: the cluster grows by whole nodes)."""

    def __init__(self, job: PlanJob, tracer: Tracer, nodes_vary: bool, reporter: Reporter = SILENT) -> None:
        self.job, self.tracer, self.nodes_vary, self.reporter = job, tracer, nodes_vary, reporter
        self.seen: dict[Key, tuple[FitPoint, PlanOutcome]] = {}

    def at(self, batch: int, seq: int | None, nodes: int = 1) -> FitPoint:
        key = (batch, seq, nodes)
        if key not in self.seen:
            self.seen[key] = self._evaluate(batch, seq, nodes)
        return self.seen[key][0]

    def no_fit(self, batch: int, seq: int | None, nodes: int = 1) -> str:
        """Why nothing fits at the point (auto's one sentence); "" when something does."""
        self.at(batch, seq, nodes)
        return self.seen[(batch, seq, nodes)][1].no_fit or ""

    def _evaluate(self, batch: int, seq: int | None, nodes: int) -> tuple[FitPoint, PlanOutcome]:
        job = self.job
        assert job.cluster is not None
        cluster = with_nodes(job.cluster, nodes) if self.nodes_vary else job.cluster
        spec = dataclasses.replace(job.model, batch_size=batch, seq_len=seq if seq is not None else job.model.seq_len)
        outcome = plan(dataclasses.replace(job, model=spec, cluster=cluster, must_fit=False), self.tracer,
                       self.reporter)
        found, tr = outcome.search, outcome.trace
        assert found is not None
        report = found.report
        point = FitPoint(batch, seq or 1, cluster.world_size, cluster.nodes, found.fits, report.step_time,
                         report.reserved_memory, found.budget, tr.fwd_flops + tr.bwd_flops,
                         peak_flops(cluster.gpu, job.options.precision), report.mesh,
                         len(found.plan.activation_checkpointing), found.plan.offload,
                         len(found.plan.activation_offloading))
        self.reporter.note(f"fit: batch {batch:,}{f', seq {seq:,}' if seq else ''} on {cluster.name}: "
                           f"{'fits' if found.fits else 'does not fit'} (reserved {fmt_bytes(report.reserved_memory)}, "
                           f"step {fmt_time(report.step_time)})")
        return point, outcome

    def fits(self, at: Callable[[int], Key], plain: bool = False) -> Callable[[int], bool]:
        """``fits`` for a search over one coordinate, the others fixed by ``at``; ``plain``: fits without CPU
        offload (auto turns it on only when nothing fits without it, so this too is monotone)."""
        def fits(value: int) -> bool:
            p = self.at(*at(value))
            return p.fits and not (plain and p.offload)
        return fits

    def sorted(self) -> list[FitPoint]:
        return sorted((p for p, _ in self.seen.values()), key=lambda p: (p.gpus, p.seq, p.batch))
