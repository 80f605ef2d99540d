"""``fit``'s evaluations: auto's plan for one workload (batch, sequence) on one world (node count), each point the
search ``plan MODEL --policy auto`` runs for it (the same trace, policy, options and budget), run once and kept, so a
search over the batch, the sequence or the node count (``planners/fit.py``) asks for a point as often as it likes.

Three things make a sweep take seconds instead of minutes (each search of an 8B model is seconds; a workload that
does not fit costs auto a search with every memory option it has):
- the search runs in auto's own stages, and each is asked for only when needed: without FSDP2's memory options
  first (fit's main question: does the workload fit without CPU offload?), then on with them, reusing the first
  stage where no TP layout is screened (``AutoPolicy.search(first=...)``); the result is the one ``plan`` prints
  either way;
- a screen: the same search without local refinement (``search_effort=0``), several times cheaper. Refinement only
  adds plans to the structured candidates, so where the screen finds a plan within the budget the full search does
  too (the converse may fail); the searches locate a boundary with the screen and confirm it with the full search
  on both sides;
- one trace per workload, shared by every node count and stage.
A deadline (``--time-limit``) is checked before each search; ``Stopped`` says it passed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from fsdp_planner.choices import ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time
from fsdp_planner.hardware.cluster import MAX_GPUS_PER_NODE, Cluster, with_nodes
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.models.hf import learned_positions
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, infeasible_message
from fsdp_planner.planners.expert_parallel import (
    expert_modules,
    per_param_meshes,
    runs_ep,
    screen_placement,
    token_list_experts,
    with_auto_ep,
    with_own_ep,
)
from fsdp_planner.planners.fit import FitPoint, below_by_powers, smallest_confirmed
from fsdp_planner.planners.registry import make_policy
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.outcome import PlanOutcome
from fsdp_planner.service.planning import (
    SILENT,
    Reporter,
    Tracer,
    auto_layouts,
    ep_tp_layouts,
    with_ep_at_tp,
    with_ep_tp,
)
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.compute import peak_flops
from fsdp_planner.sim.memory import state_floor
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.sim.sizing import shard_dims
from fsdp_planner.trace.records import Trace

Key = tuple[int, int | None, int]  # batch, seq (None: the model takes none), world (``Points.cluster_at``'s count)


class Stopped(Exception):
    """The deadline passed before the next search: what was evaluated stands, the answer is partial."""


@dataclass
class Staged:
    """One workload's search in auto's stages: ``plain`` without FSDP2's memory options, ``full`` with them (auto's
    ways out where ``plain`` found nothing within the budget; dim-1 sharding where it is faster, for a model with
    params it applies to); None: not asked yet."""

    plain: AutoResult
    full: AutoResult | None = None

    @property
    def result(self) -> AutoResult:
        """What ``plan`` prints: the second stage once asked for, else the first."""
        return self.full if self.full is not None else self.plain

    @property
    def complete(self) -> bool:
        return self.plain.fits or self.full is not None


def offloads(result: AutoResult) -> bool:
    """Whether the plan runs with CPUOffloadPolicy (auto's way out, or asked for with ``--offload``)."""
    return result.run.offload or result.plan.offload


class Points:
    """Every point evaluated, each stage once: ``job`` at the point's workload and world (``cluster_at``: the
    cluster for a key's third coordinate, e.g. a node count; None: the job's cluster for every key).
    ``deadline``: ``time.monotonic()`` after which no search starts (``Stopped``)."""

    def __init__(self, job: PlanJob, tracer: Tracer, cluster_at: Callable[[int], Cluster] | None = None,
                 reporter: Reporter = SILENT, deadline: float | None = None) -> None:
        self.job, self.tracer, self.cluster_at, self.reporter = job, tracer, cluster_at, reporter
        self.deadline = deadline
        self.traces: dict[tuple[int, int | None], Trace] = {}
        self.staged: dict[Key, Staged] = {}  # the full searches: what plan runs
        self.screens: dict[Key, Staged] = {}  # the searches without refinement
        self.searches = 0  # searches run (either kind, each stage one)
        # with --ep: each result under EP -> (it, auto's result before EP), which the next stage starts from
        self._before_ep: dict[int, tuple[AutoResult, AutoResult]] = {}
        self._over_budget: dict[Key, bool] = {}  # ``_state_over_budget``'s answers

    @property
    def seen(self) -> dict[Key, FitPoint]:
        """The points searched in full, as plan reports them (a point whose second stage was not asked for is
        one that does not fit without CPU offload, ``FitPoint.complete`` False)."""
        return {key: self._point(key, staged) for key, staged in self.staged.items()}

    def at(self, batch: int, seq: int | None, nodes: int = 1) -> FitPoint:
        """The point as ``plan`` gives it: every stage its search needs."""
        key = (batch, seq, nodes)
        return self._point(key, self._stages(key, full=True, screen=False))

    def plain_at(self, batch: int, seq: int | None, nodes: int = 1) -> FitPoint:
        """The point searched without CPU offload only (its second stage when the first fits is never needed)."""
        key = (batch, seq, nodes)
        return self._point(key, self._stages(key, full=self._dim1(key), screen=False))

    def no_fit(self, batch: int, seq: int | None, nodes: int = 1) -> str:
        """Why nothing fits at the point (auto's one sentence); "" when something does."""
        self.at(batch, seq, nodes)
        result = self.staged[(batch, seq, nodes)].result
        return "" if result.fits else infeasible_message(result)

    def result(self, batch: int, seq: int | None, nodes: int = 1) -> AutoResult:
        """Auto's result at the point, every stage run (the plan ``plan`` prints)."""
        self.at(batch, seq, nodes)
        return self.staged[(batch, seq, nodes)].result

    def fits(self, at: Callable[[int], Key], plain: bool = False, past_plain: bool = False) -> Callable[[int], bool]:
        """``fits`` for a search over one coordinate, the others fixed by ``at``; ``plain``: fits without CPU
        offload (auto turns it on only when nothing fits without it, so this too is monotone). ``past_plain``: the
        values asked lie past the boundary without offload, where the first stage fails: a point not searched yet
        starts its second stage from the screen's first (the second stage's plans do not depend on the first's;
        only a point that fits with neither shows the screen's closest plan instead of plan's)."""
        def fits(value: int) -> bool:
            key = at(value)
            if past_plain and not plain and key not in self.staged:
                first = self._stages(key, full=False, screen=True).plain
                if not first.fits:
                    self.staged[key] = Staged(first, self._search(key, False, first))
            staged = self._stages(key, full=not plain or self._dim1(key), screen=False)
            return _fits(staged, plain)
        return fits

    def screen(self, at: Callable[[int], Key], plain: bool = False) -> Callable[[int], bool]:
        """As ``fits``, by the search without refinement (never True where ``fits`` is False); a point searched in
        full already answers from that search."""
        def fits(value: int) -> bool:
            key = at(value)
            known = self.staged.get(key)
            if known is not None and (known.complete or plain):
                return _fits(known, plain)
            if plain and key not in self.screens and self._state_over_budget(key):
                return False
            return _fits(self._stages(key, full=not plain or self._dim1(key), screen=True), plain)
        return fits

    def sorted(self) -> list[FitPoint]:
        return sorted(self.seen.values(), key=lambda p: (p.gpus, p.seq, p.batch))

    def seq_limit(self) -> tuple[str, int] | None:
        """The model's learned position table and its length: the longest sequence it takes (None: no limit)."""
        return learned_positions(load_model(self.job.model, meta=True).model)

    def configured_positions(self) -> int | None:
        """The config's ``max_position_embeddings`` of a model without a learned table (rotary positions take any
        length, past what the model was configured, and trained, for); None where it has none, or a table."""
        model = load_model(self.job.model, meta=True).model
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        ok = isinstance(positions, int) and not isinstance(positions, bool) and learned_positions(model) is None
        return positions if ok else None

    def _state_over_budget(self, key: Key) -> bool:
        """Whether the model's state alone rules the point out without CPU offload (``state_floor`` over auto's
        budget), which a screen would find at length (DeepSeek-V3 on 8-128 H100s: 5-15 s each, each saying no). A
        search in full still runs where asked: its point is a row of the table (the count below the answer, and why
        it does not fit)."""
        if key not in self._over_budget:  # (auto's budget, without building its policy: its TP layouts)
            request, cluster = self.job.auto, self._cluster(key)
            assert request is not None
            budget = MemoryBudget.given(request.memory_budget, cluster.gpu.memory_bytes, cluster.gpu.name,
                                        request.headroom)
            self._over_budget[key] = state_floor(self._trace(key), self.job.options, cluster.world_size) > \
                budget.limit
        return self._over_budget[key]

    def _stages(self, key: Key, full: bool, screen: bool) -> Staged:
        store = self.screens if screen else self.staged
        staged = store.get(key)
        if staged is None:
            staged = Staged(self._search(key, screen, None))
            store[key] = staged
        # where the first stage fits, the second only tries dim-1 sharding for speed: fit's screens answer whether
        # a point fits, which it cannot change
        if full and staged.full is None and (not staged.plain.fits or (not screen and self._dim1(key))):
            staged.full = self._search(key, screen, staged.plain)
        return staged

    def _search(self, key: Key, screen: bool, first: AutoResult | None) -> AutoResult:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Stopped
        tr = self._trace(key)
        policy = self._policy(key, tensor_parallel=not screen)
        if screen:
            policy = dataclasses.replace(policy, search_effort=0)
        self.searches += 1
        if first is None:
            searched = dataclasses.replace(policy, choose_memory_options=False).search(tr, self.job.model.name)
        else:
            first = self._before_ep.get(id(first), (first, first))[1]
            searched = policy.search(tr, self.job.model.name, first=first)
        # (an MoE model's search without TP takes auto's memory options, as plan's does: dim-1 sharding of the
        # experts, not offload, is what lets EP beat TP there; offloading is slower, so never the faster)
        result = self._with_ep(key, searched, policy)
        if not screen:
            result = self._with_ep_tp(key, result)
            self._before_ep[id(result)] = (result, searched)  # (the next stage starts from the search's own)
            self._note(key, result, first is not None)
        return result

    def _policy(self, key: Key, tensor_parallel: bool = True) -> AutoPolicy:
        """Auto's policy at the point, with the TP layouts ``plan`` screens there (``auto_layouts``: TP d judged at
        d times the batch per data-parallel rank, the same step), so the point is ``plan``'s. A screen goes
        without them (``tensor_parallel`` False, unless ``--tp`` fixes one): it may then be pessimistic, which the
        confirming search, with them, searches on past, never optimistic; tracing each layout's wider batch at
        every point a boundary search visits took 3.5x the CPU of the searches (fit llama3-8b)."""
        request = self.job.auto
        assert request is not None and self.job.cluster is not None
        if (request.ep or 1) > 1 and request.tp is None:  # EP x TP: torchtitan's MoE layout only, as plan's
            request = dataclasses.replace(request, tp=1)
        cluster = self._cluster(key)
        layouts = auto_layouts(self._trace(key), request, self._spec(key), cluster, self.job.options, SILENT,
                               self._traced) if tensor_parallel or request.tp is not None else ()
        policy = make_policy(request, cluster, self.job.options, layouts)
        assert isinstance(policy, AutoPolicy)
        return policy

    def _spec(self, key: Key) -> ModelSpec:
        batch, seq, _ = key
        return dataclasses.replace(self.job.model, batch_size=batch or self.job.model.batch_size,
                                   seq_len=seq or self.job.model.seq_len)

    def _traced(self, spec: ModelSpec, options: SimOptions) -> Trace:
        """The tracer, one trace per workload (a TP layout's wider batch is another point's too)."""
        at = (spec.batch_size, spec.seq_len)
        if at not in self.traces:
            self.traces[at] = self.tracer(spec, options)
        return self.traces[at]

    def _with_ep(self, key: Key, result: AutoResult, policy: AutoPolicy) -> AutoResult:
        """``result`` under the EP degree asked for (``--ep``: auto's groups with each expert module alone, as
        ``plan --ep`` gives them); not fitting where the degree does not divide the plan's shard ranks (fewer GPUs
        than EP, or HSDP replicas of fewer)."""
        ep = self.job.auto.ep if self.job.auto is not None else None
        if ep is None:
            return self._auto_ep(key, result, policy)
        if ep == 1:
            return result
        cluster = self._cluster(key)
        shard = result.plan.shard_size(cluster.world_size)
        if shard % ep:
            self.reporter.note(f"fit: EP {ep} does not divide the {shard:,} shard ranks on {cluster.name}: no plan "
                               "there (the figures shown are auto's without EP)")
            out = dataclasses.replace(result, fits=False)
        else:
            tr = self._trace(key)
            out = with_auto_ep(result, tr, cluster, self.job.options, (ep,),
                               per_param=per_param_meshes(policy.ep_placement, tr), placement=screen_placement(policy))
        self._before_ep[id(out)] = (out, result)  # (out kept alive: its id stays its own)
        return out

    def _auto_ep(self, key: Key, result: AutoResult, policy: AutoPolicy) -> AutoResult:
        """Without ``--ep``, for a model with grouped experts: auto's EP screen as ``plan`` runs it (no EP and each
        degree the model and the plan's shard ranks allow, the fastest that fits, beside a TP layout the search
        took: ``with_own_ep``; for experts EP is simulated for only, where nothing fits without it)."""
        cluster, tr = self._cluster(key), self._trace(key)
        if not expert_modules(tr) or token_list_experts(tr) is not None or \
                (result.fits and not runs_ep(self.job.model, tr, 1)):
            return result  # (EP of experts it is simulated for only, ``runs_ep``: where nothing fits without)
        try:
            out = with_own_ep(result, policy, tr, self.job.model.name, cluster, self.job.options)
        except PlannerError:  # experts of several counts: EP only as the user names it (``--ep``, a plan file)
            return result
        self._before_ep[id(out)] = (out, result)
        return out

    def _with_ep_tp(self, key: Key, result: AutoResult) -> AutoResult:
        """An MoE model's EP x TP layouts screened beside ``result`` as ``plan`` screens them (``with_ep_tp``; with
        ``--tp N`` the EP degrees at that TP, ``with_ep_at_tp``), at the points searched in full."""
        request = self.job.auto
        assert request is not None
        cluster, tr, spec = self._cluster(key), self._trace(key), self._spec(key)
        ep_tp = ep_tp_layouts(tr, request, spec, cluster)
        if ep_tp and request.tp is not None:
            return with_ep_at_tp(result, tr, request, spec, cluster, self.job.options, SILENT, self._traced,
                                 ep_tp[request.tp])
        return with_ep_tp(result, tr, request, spec, cluster, self.job.options, SILENT, self._traced, ep_tp) \
            if ep_tp else result

    def _cluster(self, key: Key) -> Cluster:
        assert self.job.cluster is not None
        return self.cluster_at(key[2]) if self.cluster_at is not None else self.job.cluster

    def _trace(self, key: Key) -> Trace:
        return self._traced(self._spec(key), self.job.options)

    def _dim1(self, key: Key) -> bool:
        """Whether auto may try dim-1 sharding without CPU offload at the point: then whether it fits without
        offload needs the second stage too."""
        options = self.job.options
        if options.offload or options.shard_placement is not ShardPlacement.DIM0 or \
                any(p.keeps_placement for p in self.job.policies):
            return False
        return bool(shard_dims(self._trace(key), self._cluster(key).world_size, ShardPlacement.AUTO))

    def _point(self, key: Key, staged: Staged) -> FitPoint:
        found, tr = staged.result, self._trace(key)
        cluster = self._cluster(key)
        report = found.report
        return FitPoint(key[0], key[1] or 1, cluster.world_size, cluster.nodes, found.fits, report.step_time,
                        report.reserved_memory, found.budget, tr.fwd_flops + tr.bwd_flops,
                        peak_flops(cluster.gpu, self.job.options.precision), _layout(found),
                        len(found.plan.activation_checkpointing), offloads(found),
                        len(found.plan.activation_offloading), staged.complete,
                        len(found.plan.selective_checkpointing), self.job.auto.tp or 1 if self.job.auto else 1)

    def _note(self, key: Key, result: AutoResult, ways_out: bool) -> None:
        batch, seq, _ = key
        # auto's plan for the workload, not the configuration a job file gives (simulated apart, and may not fit)
        verdict = ("auto's plan fits" + (" with CPU offload" if offloads(result) else "") if result.fits
                   else "no plan fits" + (" (CPU offload tried too)" if ways_out else " without CPU offload"))
        workload = f"batch {batch:,}{f', seq {seq:,}' if seq else ''}" if batch else "the job"
        # "as auto plans it": under a job file, apart from its own configuration, whose figures and verdict follow
        self.reporter.note(f"fit: {workload} on {self._cluster(key).name} as auto plans it: "
                           f"{verdict} (reserved {fmt_bytes(result.report.reserved_memory)}, "
                           f"step {fmt_time(result.report.step_time)})")


def _layout(result: AutoResult) -> str:
    """The plan's data-parallel layout (REPLICATExSHARD), with its TP and EP degrees: "1x32 TP 2 EP 8"."""
    tp, ep = result.plan.tp_degree, result.plan.ep_degree
    return result.report.mesh + (f" TP {tp}" if tp > 1 else "") + (f" EP {ep}" if ep > 1 else "")


def _fits(staged: Staged, plain: bool) -> bool:
    result = staged.result
    return result.fits and not (plain and offloads(result))


def larger_clusters(cluster: Cluster, most: int) -> list[Cluster]:
    """Clusters of ``cluster``'s GPU with more GPUs, smallest first, up to ``most`` GPUs: a partial node doubled up
    to a whole one, then whole nodes, one more at a time."""
    out: list[Cluster] = []
    base = cluster.name.split(":")[0]
    gpus = cluster.world_size
    if cluster.nodes == 1 and gpus < MAX_GPUS_PER_NODE:
        while gpus * 2 <= MAX_GPUS_PER_NODE and gpus * 2 <= most:
            gpus *= 2
            out.append(dataclasses.replace(cluster, gpus_per_node=gpus, name=f"{base}:{gpus}"))
        cluster = dataclasses.replace(cluster, gpus_per_node=MAX_GPUS_PER_NODE)
    node = cluster.gpus_per_node
    out += [with_nodes(cluster, n) for n in range(gpus // node + 1, most // node + 1)]
    return out


@dataclass(frozen=True)
class Fewest:
    """Where a workload that needs CPU offload on its cluster fits without it: auto's plan on the fewest GPUs of the
    same kind (None: not on up to ``most``)."""

    point: FitPoint | None
    most: int
    gpu: str

    def line(self, cluster: str, offload_step: float | None = None, who: str = "auto's plan") -> str:
        """The verdict, one line: nothing fits without offload, the fewest GPUs that fit without, and (given) what
        ``who``, with CPU offload, takes a step."""
        cost = f"; with CPU offload on {cluster.split(' ')[0]} {who} takes {fmt_time(offload_step)} a step" \
            if offload_step is not None else ""
        if self.point is None:
            return f"nothing fits {cluster} without CPU offload, nor on up to {self.most:,} {self.gpu}{cost}"
        p = self.point
        times = f" ({offload_step / p.step_time:.1f}x as long)" if offload_step is not None else ""
        return (f"nothing fits {cluster} without CPU offload: the fewest {self.gpu} that fit it without: "
                f"{p.gpus:,} ({fmt_time(p.step_time)} a step){cost}{times}")


def fewest_without_offload(job: PlanJob, tracer: Tracer, most: int, reporter: Reporter = SILENT,
                           trace: Trace | None = None) -> Fewest:
    """The fewest GPUs of the job's kind (more than its cluster's) on which auto fits the job's workload without
    CPU offload: a search over ``larger_clusters`` (``trace``: the workload's, when the caller has it)."""
    assert job.cluster is not None
    clusters = larger_clusters(job.cluster, most)
    points = Points(job, tracer, lambda i: clusters[i - 1], reporter)
    if trace is not None:
        points.traces[(0, 0)] = trace
    at = lambda i: (0, 0, i)  # noqa: E731  (the job's own workload)
    fits = points.fits(at, plain=True)
    found = smallest_confirmed(points.screen(at, plain=True), fits, len(clusters)) if clusters else None
    if found:
        # fitting is not monotone in the node count where a layout's degrees must divide it (an MoE's 8 experts on
        # 127 nodes' ranks, which no EP degree divides, held 321 GiB, on 8 nodes 50: a trial's "fewest 1,024" for a
        # job 64 GPUs fit): the power-of-two counts below the answer are tried too
        found = below_by_powers(fits, found, [i for i, c in enumerate(clusters, 1) if c.nodes & (c.nodes - 1) == 0])
    return Fewest(points.plain_at(0, 0, found) if found else None, most, job.cluster.gpu.name)


DEFAULT_MOST_GPUS = 1024  # the verdict's search for the fewest GPUs without offload stops there


def offload_verdict(outcome: PlanOutcome, tracer: Tracer, reporter: Reporter = SILENT,
                    most: int = DEFAULT_MOST_GPUS) -> str | None:
    """When auto's plan for the job needs CPU offload (its last resort, not asked for): the verdict for the first
    line, the fewest GPUs that fit without it and what offload costs here (``Fewest.line``); None otherwise."""
    search, job = outcome.auto, outcome.job
    if search is None or not search.fits or not offloads(search) or job.options.offload or job.cluster is None:
        return None
    # (the search's "fit: ..." notes, one per GPU count tried, read as a fit nobody asked for: a trial)
    reporter.note(f"auto's plan offloads to the CPU on {job.cluster.name}: searching the fewest "
                  f"{job.cluster.gpu.name} that fit it without (auto at each count tried, up to {most:,})")
    fewest = fewest_without_offload(job, tracer, most, reporter, trace=outcome.trace)
    return fewest.line(job.cluster.name, search.report.step_time)


def config_verdict(job: PlanJob, tracer: Tracer, trace: Trace, offloaded: StepReport | None,
                   reporter: Reporter = SILENT, most: int = DEFAULT_MOST_GPUS) -> str | None:
    """``simulate --from-*`` of a config job that offloads or is over the budget: when auto fits nothing without
    CPU offload on the job's cluster either, the verdict (``Fewest.line``, ``offloaded``: the config's own step
    when it offloads, said as the config's and, over the budget, with what it holds: a trial read a config's step
    said as auto's plan's); None when auto's plan fits without it (``plan --from-...`` shows it)."""
    assert job.cluster is not None
    points = Points(job, tracer, None, reporter)
    points.traces[(0, 0)] = trace
    if points.fits(lambda _: (0, 0, 1), plain=True)(0):
        return None
    reporter.note(f"nothing fits {job.cluster.name} without CPU offload: searching the fewest {job.cluster.gpu.name} "
                  f"that fit it (auto at each count tried, up to {most:,}: a large model takes a minute or two)")
    fewest = fewest_without_offload(job, tracer, most, reporter, trace=trace)
    if offloaded is None:
        return fewest.line(job.cluster.name)
    held = "" if job.budget.fits(offloaded.reserved_memory) else \
        f" and holds {fmt_bytes(offloaded.reserved_memory)}, over the budget"
    return fewest.line(job.cluster.name, offloaded.step_time, "the config's job") + held
