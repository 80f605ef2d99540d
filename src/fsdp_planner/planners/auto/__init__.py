"""AutoPolicy: the grouping that minimises simulated step time under a per-rank memory budget.

The search, one concern per module:
1. ``atoms.py``: the params split into indivisible units in execution order, some pinned (alone, or to the root)
   where FSDP2 would fail or misbehave otherwise.
2. ``candidates.py``: the classic policies' plans, module-tree cuts, the most frugal plan, and a dynamic program
   over group boundaries for a range of caps on the group size.
3. ``refine.py``: local moves on the best plans (reshard the last groups after forward or not, prefetch, move one
   boundary, merge two groups), while they pay and fit.
``evaluator.py`` simulates every candidate once and ranks them; ``explain.py`` says why each boundary sits where
it does.

Without a budget, the budget is the GPU's memory (``GPU.memory_bytes``, the spec sheet's decimal capacity: 80e9
bytes = 74.5 GiB on an H100, which leaves ~4.5 GiB of the 79.1 GiB CUDA reports for the CUDA context and NCCL's
buffers) less a headroom for the memory model's error and the allocator's fragmentation (``sim/budget.py``,
``DEFAULT_HEADROOM``: 5%, 70.8 GiB on an H100); an explicit ``memory_budget`` is taken as given. A plan
fits when its *reserved* memory (``sim/memory.py``: allocated plus the collective streams' own pools) is within it.
Every classic plan is a candidate, so auto is never slower than a classic policy that fits.
When no plan fits, auto searches again with FSDP2's memory options, in order: params sharded on dim 1 where dim 0 is
smaller than the shard size (``ShardPlacement.AUTO``, when the model has such params), CPU offload, both; the first
search that fits wins. Dim-1 sharding is also searched where a plan fits on dim 0 but its screening says dim 1 is
faster (dim 0's padding costs bytes as well as memory: ``AutoPolicy._faster_on_dim1``), and the faster plan kept.
A model without such params gets the plan it always got.
``Target.FSDP1`` searches only what FSDP1 can express: one module per unit, uniform dtype and requires_grad per
unit, bool ``reshard_after_forward``, no prefetch lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from fsdp_planner.arguments import check_fields, checked
from fsdp_planner.batch import paused_gc
from fsdp_planner.choices import DEFAULT_SAC_POLICY, ExpertPlacement, SacPolicy, ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import MAX_BYTES, fmt_bytes, fmt_count, parse_size
from fsdp_planner.fsdp2.checkpointing import ACMode, check_saved_topk, checkpointed_blocks, own_overlap
from fsdp_planner.fsdp2.dtypes import several_kinds
from fsdp_planner.fsdp2.plan import Mesh, Plan, RunOptions, divisors
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.limits import MAX_SEARCH_EFFORT
from fsdp_planner.planners.auto.atoms import Atom, plan_atoms
from fsdp_planner.planners.auto.candidates import (
    ModuleTreeCuts,
    classic_baselines,
    classic_plans,
    frugal_and_dp,
    root_plan,
)
from fsdp_planner.planners.auto.checkpointing import (
    CheckpointSearch,
    Choice,
    Setting,
    op_level_runs,
    setting_view,
)
from fsdp_planner.planners.auto.evaluator import ROOT_ONLY, Candidate, Evaluator, Target
from fsdp_planner.planners.auto.refine import Refiner
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.planners.tensor_parallel import TPChoice
from fsdp_planner.sim.budget import Headroom, MemoryBudget
from fsdp_planner.sim.memory import state_floor
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.sim.sizing import shard_dims
from fsdp_planner.sim.tensor_parallel import tp_view
from fsdp_planner.trace.records import Trace


class Search:
    """The state of one auto search on one mesh: the evaluator, the two atom granularities, the classic plans
    and the refiner."""

    def __init__(self, ev: Evaluator, trace: Trace, model: str, shared: Search | None = None) -> None:
        """``shared``: a search of the same model on another mesh, whose atoms and candidate plans are reused."""
        self.ev = ev
        if shared is not None:
            self.atoms, self.fine_atoms, self.classics = shared.atoms, shared.fine_atoms, shared.classics
            self.cuts = shared.cuts
        else:
            whole = bool(block_instances(trace))
            self.atoms = plan_atoms(trace, whole_blocks=whole)
            # (compiled blocks are whole: FSDP2's hooks cannot run inside their graphs)
            self.fine_atoms = plan_atoms(trace, whole_blocks=False) if whole and not trace.compiled else self.atoms
            self.classics = classic_plans(trace, model)
            self.cuts = ModuleTreeCuts(trace, model, 24 if ev.target is Target.FSDP1 else 8)
        self.refiner = Refiner(self.ev, self.atoms, self.fine_atoms)
        self.deferred: list[Callable[[], None]] = []  # frugal plans not simulated (they could not rank)

    def min_peak(self) -> int:
        """The lowest peak memory any candidate that runs and the target can express reaches, the frugal plans
        included (simulated now if skipped). A plan that cannot run is no floor: a budget between its peak and the
        real floor would be refused as reachable."""
        while self.deferred:
            self.deferred.pop()()
        return min(c.report.reserved_memory for c in self.ev.ranked())

    def granularities(self) -> list[list[Atom]]:
        """The atom lists to search over: whole blocks and single modules (one list when the model has no blocks)."""
        return [self.atoms] if self.fine_atoms is self.atoms else [self.atoms, self.fine_atoms]


@dataclass
class MeshOutcome:
    """One layout's full search: its best plan (``chosen``) and the classic plans it started from."""

    search: Search
    chosen: Candidate
    baselines: dict[str, Candidate]
    cut: bool  # the effort stopped its refinement before it converged
    checkpointing: Choice | None = None  # the checkpointing auto chose when nothing fit without (None: not needed)


@dataclass
class AutoResult:
    plan: Plan  # the grouping (its run options apart, in ``run``)
    report: StepReport
    budget: int
    budget_source: str  # "--memory-budget" or the GPU whose memory it is, less the headroom
    memory: MemoryBudget  # the budget with its capacity and headroom (``budget`` is its limit): its ``fits`` is the
    # one fit test
    fits: bool
    baselines: dict[str, Candidate]
    evaluated: int  # plans simulated during the search
    effort: int  # plans the local refinement could simulate (``AutoPolicy.search_effort``)
    refined: int  # plans it did simulate
    cut: bool  # the effort stopped the chosen layout's refinement before it converged
    seconds: float
    search: Search = field(repr=False)
    meshes: dict[str, Candidate] = field(default_factory=dict)  # layout -> its best plan (every layout tried)
    chosen: Candidate | None = field(default=None, repr=False)  # the candidate behind ``plan`` and ``report``
    also_tried: tuple[str, ...] = ()  # FSDP2 memory options searched too, none of which fit (``AutoPolicy.search``)
    checkpointing: Choice | None = None  # the chosen layout's checkpointing choice (None: none was needed)
    ep_given: bool = False  # ``plan``'s EP is the degree asked for, laid on the searched groups after the search
    fixed_checkpointing: bool = False  # the user fixed the checkpointing (``--ac``, a config's): kept as given
    run: RunOptions = field(default_factory=RunOptions)  # the memory options the plan was searched with (auto's
    # way out when nothing fits without them): written into the plan only where it leaves the program
    without_tp: tuple[AutoPolicy, Trace, AutoResult] | None = field(default=None, repr=False, compare=False)
    # where the search chose among TP layouts and took one: its full search of the layout without TP (the policy,
    # the trace, the result: ``_choose_tp``), which auto's EP screen goes on with (``searched_without_tp``)

    @property
    def written_plan(self) -> Plan:
        """``plan`` recording its run options: what ``--out``, export and the Python API give."""
        return self.plan.running(self.run)

    @property
    def min_peak(self) -> int:
        """The lowest peak memory any candidate plan reaches (the memory floor of this search's plans)."""
        return self.search.min_peak()

    def searched_without_tp(self, policy: AutoPolicy, trace: Trace) -> AutoResult | None:
        """``policy``'s search of ``trace`` (without TP), where this result's search ran that very search on the way
        (``without_tp``); None otherwise. The search is deterministic: running it again would give the same."""
        if self.without_tp is None:
            return None
        searched_by, on, result = self.without_tp
        return result if on is trace and searched_by == policy else None

    @property
    def rank(self) -> tuple[bool, float]:
        """How results compare: one within the budget first, then the faster (else the one holding less)."""
        return not self.fits, self.report.step_time if self.fits else self.report.reserved_memory


def faster(a: AutoResult, b: AutoResult) -> AutoResult:
    """The better of two searches of one job (``AutoResult.rank``), with both searches' layout lines and work."""
    best = min((a, b), key=lambda r: r.rank)
    return replace(best, meshes={**a.meshes, **b.meshes}, evaluated=a.evaluated + b.evaluated,
                   seconds=a.seconds + b.seconds)


SEARCH_EVENTS = 6_000_000  # trace events the refinement simulates by default (plans x events per plan)
MIN_SEARCH_EFFORT = 24  # plans it may simulate at least, however large the trace


def default_search_effort(trace: Trace) -> int:
    """Plans the local refinement may simulate by default: ``SEARCH_EVENTS`` worth of traced events, so the
    refinement's work, like the rest of the search's, grows with the model no faster than linearly. A simulation
    costs about 0.1-0.3 us per trace event on a 2-core x86 host (~3 ms for llama3-8b's 11,538 events, ~20 ms for
    the 217,003 of a 10,000-module model): 1-2 s of refinement at most. llama3-8b gets 520 plans and uses 249-443 of
    them; on every row of benchmarks/plan_quality.md the default gives the plan an unbounded search gives, which
    simulates up to 1,398 (benchmarks/search_effort.md)."""
    return max(MIN_SEARCH_EFFORT, SEARCH_EVENTS // max(len(trace.events), 1))


@dataclass
class AutoPolicy:
    """Choose groups, ``reshard_after_forward`` and prefetch for ``cluster`` under ``memory_budget`` bytes.

    The search is deterministic: the structured candidates are a fixed set, and the local refinement simulates at
    most ``search_effort`` plans (None: ``default_search_effort``), so the same trace and cluster give the same plan
    on any machine under any load."""

    cluster: Cluster
    memory_budget: int | None = None
    target: Target = Target.FSDP2
    options: SimOptions = field(default_factory=SimOptions)
    search_effort: int | None = None  # plans the local refinement may simulate; None: ``default_search_effort``
    checkpointing: ACMode | None = None  # activation checkpointing fixed for every plan; None: auto chooses
    # (when nothing fits without: the fastest mix of full and op-level on the first blocks, ``checkpointing.py``)
    sac_policy: SacPolicy = DEFAULT_SAC_POLICY  # what op-level checkpointing saves (fixed ``--ac op`` or chosen)
    mesh: Mesh | None = None  # the data-parallel layout, fixed; None: auto chooses (pure FSDP or HSDP)
    headroom: Headroom | None = None  # below the GPU's memory when no memory_budget; None: ``DEFAULT_HEADROOM``
    name: str = "auto"
    choose_memory_options: bool = True  # try dim-1 sharding where faster, and with CPU offload where nothing fits
    # (module docstring)
    tensor_parallel: tuple[TPChoice, ...] = ()  # the TP layouts to choose among (none: no TP; degree 1 among
    # them: no TP as one of the choices), each with the trace it is judged on, ``_choose_tp``
    on_layout: TensorParallel | None = None  # the TP of the view this search runs on: its trace and ``cluster`` are
    # one TP rank's (``sim/tensor_parallel.tp_view``), every plan carries it
    whole_model: tuple[str, int] | None = None  # on a TP view: the whole model's fingerprint and numel, which the
    # plan leaving the search carries (it is checked against the model, not the view)
    keeps_placement: bool = False  # the user gave ``options.shard_placement``: no dim-1 sharding of auto's own
    ep_placement: ExpertPlacement | None = None  # where the EP screen shards the experts; None: it chooses

    def __post_init__(self) -> None:
        if isinstance(self.cluster, str):  # a preset or a cluster file, as fsdp_planner.plan takes it
            self.cluster = parse_cluster(self.cluster)
        if not isinstance(self.cluster, Cluster):
            raise PlannerError("cluster must be a Cluster or a preset such as 'h100:8' (or a cluster JSON path), got "
                               f"{type(self.cluster).__name__}")
        if isinstance(self.memory_budget, str):  # "3MiB", as --memory-budget reads it
            self.memory_budget = parse_size(self.memory_budget, "memory_budget")
        if not isinstance(self.target, Target):
            try:
                self.target = Target(self.target)
            except ValueError:
                raise PlannerError(f"unknown auto target '{self.target}': choose fsdp2 or fsdp1") from None
        check_fields(self)
        if self.memory_budget is not None and not 0 < self.memory_budget <= MAX_BYTES:
            raise PlannerError("the memory budget must be positive, at most 1 EiB (2^60 bytes)")
        if self.search_effort is not None and (isinstance(self.search_effort, bool)
                                               or not 0 <= self.search_effort <= MAX_SEARCH_EFFORT):
            raise PlannerError(f"the search effort is a number of plans: 0 to {MAX_SEARCH_EFFORT:,}")
        tp = self.tensor_parallel[0].tp.degree if len(self.tensor_parallel) == 1 else 1
        if self.mesh is not None and self.mesh.size * tp != self.cluster.world_size:
            with_tp = f" x TP {tp}" if tp > 1 else ""
            raise PlannerError(f"mesh {self.mesh.describe()}{with_tp} has {self.mesh.size * tp} ranks but cluster "
                               f"{self.cluster.name} has {self.cluster.world_size} GPUs")
        if self.mesh is not None and self.mesh.replicate > 1 and self.target is Target.FSDP1:
            raise PlannerError("the fsdp1 target plans pure FSDP: FSDP1's HYBRID_SHARD is not modelled")

    @checked
    def plan(self, trace: Trace, model: str | None = "") -> Plan:
        result = self.search(trace, model)
        if not result.fits:
            raise PlannerError(infeasible_message(result))
        return result.written_plan

    def search(self, trace: Trace, model: str = "", first: AutoResult | None = None,
               screened: Evaluator | None = None) -> AutoResult:
        """The best plan within the budget, FSDP2's memory options tried when nothing fits without them (dim-1
        sharding also where it is faster: ``_faster_on_dim1``). ``first``:
        this policy's search without them (``choose_memory_options=False``) on ``trace``, when the caller ran it
        already (``fit`` asks whether a workload fits without CPU offload before whether it fits at all).
        ``screened``: the evaluator of this policy's ``_screen`` on ``trace``, whose plans the search goes on with."""
        if self.tensor_parallel:  # each layout searched on its own view (``first`` is of one trace: not reused)
            return self._choose_tp(trace, model)
        with paused_gc():
            result = first if first is not None else self._search(trace, model, screened)
            if result.fits:
                return self._faster_on_dim1(trace, model, result)
            ways = self._ways_out(trace, result)
            if ways and self._state_over_budget(trace):  # dim-1 sharding alone cannot fit (it shrinks no state)
                ways = [w for w in ways if w[0]]
            for offload, placement in ways:
                tried = replace(self, options=self.options.with_memory_options(offload, placement),
                                choose_memory_options=False)._search(trace, model)
                if tried.fits:
                    return tried
            # none fits: the message speaks of the plans without them, and says they were tried
            names = {False: "", True: "CPU offload"}
            label = {(o, p): " and ".join(filter(None, (names[o], "dim-1 sharding" if p is ShardPlacement.AUTO
                                                         else ""))) for o, p in ways}
            tried_names = set(label.values())
            if self._offloads_activations(trace, result):  # the last resort, the most frugal options with it
                last = ways[-1] if ways else (self.options.offload, self.options.shard_placement)
                tried = replace(self, options=self.options.with_memory_options(*last), choose_memory_options=False,
                                checkpointing=ACMode.OFFLOAD)._search(trace, model)
                # (auto's own last resort, not the user's checkpointing: an EP screen after may checkpoint otherwise)
                tried = replace(tried, fixed_checkpointing=self.checkpointing is not None)
                if tried.fits:
                    return tried
                tried_names.add("activation offloading" + (f" with {label[ways[-1]]}" if ways else ""))
            return replace(result, also_tried=tuple(sorted(tried_names)))

    def _choose_tp(self, trace: Trace, model: str) -> AutoResult:
        """The fastest plan that fits over the TP layouts ``tensor_parallel``, each searched on one TP rank's view
        of the trace and cluster. With several, each is screened first by its best classic plan (with the fewest
        checkpointed blocks that let it fit, as ``_choose_meshes`` screens the data-parallel layouts); the best is
        searched in full, and the next ones up to ``TP_SEARCHES`` whose screening plan fits within ``TP_SLACK`` of
        the best's (or within what the best's search gained over its screening plan, if more), and the layout
        without TP always. Each layout's line keeps its best plan, searched or
        screened."""
        started = time.perf_counter()
        if len(self.tensor_parallel) == 1:
            policy, view = self._on_tp(self.tensor_parallel[0].trace or trace, self.tensor_parallel[0].tp)
            return policy.search(view, model)
        layouts = self.screen_layouts(trace, model)
        screened = sorted((s for s in layouts if s.best is not None), key=lambda s: s.key)
        if not screened:  # no classic plan runs on any layout: the no-TP search says why
            return layouts[0].search(model)
        first = screened[0].search(model)
        # a layout's search gains over its classic plan about what the best layout's did: where that is more than
        # TP_SLACK, the next layouts within it are searched too (toy-llama within 1.8 MB on h100:8: TP 1's search
        # 12% ahead of its screening plan, TP 2's screening plan 5.8% behind TP 1's and its search 14% ahead)
        gain = 1 - first.report.step_time / screened[0].step_time if first.fits and screened[0].key[0] == 0 else 0.0
        slack = max(TP_SLACK, gain)
        chosen = [s for i, s in enumerate(screened[:TP_SEARCHES])
                  if i == 0 or (s.key[0] == 0 and s.step_time <= screened[0].step_time * (1 + slack))]
        # the layout without TP is always searched in full too, so auto never does worse than without TP: its
        # screening (classic plans) can miss what its search finds (toy-llama within 3 MiB on h100:64: screened
        # behind TP 2, searched 1.5% faster than TP 2's best)
        chosen += [s for s in screened if s.policy.on_layout is None and s not in chosen]
        results = [first, *(s.search(model) for s in chosen[1:])]
        best = min(results, key=lambda r: r.rank)
        lines = {name: c for r in results for name, c in r.meshes.items()}
        lines.update({s.name: s.best for s in screened if s not in chosen})
        evaluated = sum(r.evaluated for r in results) + len(screened) - len(chosen)
        flat = next(((s.policy, s.trace, r) for s, r in zip(chosen, results, strict=True)
                     if s.policy.on_layout is None), None)
        return replace(best, meshes=lines, evaluated=evaluated, seconds=time.perf_counter() - started,
                       without_tp=flat if best.plan.tp_degree > 1 else None)

    def screen_layouts(self, trace: Trace, model: str) -> list[ScreenedLayout]:
        """Each TP layout of ``tensor_parallel`` (none: no TP) screened on one TP rank's view, in their order."""
        out = []
        for choice in self.tensor_parallel or (TPChoice(TensorParallel(1)),):
            policy, view = self._on_tp(choice.trace or trace, choice.tp)
            found = policy._screen(view, model)
            out.append(ScreenedLayout(policy, view, *(found or ())))
        return out

    def _on_tp(self, trace: Trace, tp: TensorParallel) -> tuple[AutoPolicy, Trace]:
        """This search on the view of one TP rank under ``tp`` (degree 1: the whole trace, no TP)."""
        if tp.degree == 1:
            return replace(self, tensor_parallel=()), trace
        view = tp_view(trace, tp, self.cluster, self.options.float8)
        return replace(self, cluster=view.cluster, tensor_parallel=(), on_layout=tp,
                       whole_model=(trace.fingerprint, trace.numel)), view.trace

    def _screen(self, trace: Trace, model: str) -> tuple[tuple, Candidate, Evaluator] | None:
        """The best classic plan on this search's layout (pure FSDP, or the fixed mesh), with the fewest
        checkpointed blocks that let it fit: its rank key and candidate, and the evaluator that simulated it; None
        when no classic plan runs."""
        base = self._evaluator(trace, model, self._budget(), self.mesh)
        ev, _ = self._fitting_baselines(base, trace, classic_plans(trace, model))
        ranked = ev.ranked()
        return (ev.key(ranked[0]), ranked[0], base) if ranked else None

    def layout_name(self, mesh: Mesh) -> str:
        """A layout as the search's lines name it: replicate x shard, and its TP degree."""
        return mesh.describe() + (f" x TP {self.on_layout.degree}" if self.on_layout is not None else "")

    def _offloads_activations(self, trace: Trace, result: AutoResult) -> bool:
        """Whether to search once more with every block's saved activations offloaded (``--ac offload``): only
        when nothing fits otherwise, auto chose the checkpointing, and the model has blocks, none of which its own
        checkpoint is around or inside (``check_checkpointing`` refuses offloading those)."""
        if result.fits or not self.choose_memory_options or self.checkpointing is not None \
                or self.target is not Target.FSDP2:
            return False
        try:
            blocks = checkpointed_blocks(trace, ACMode.OFFLOAD)
        except PlannerError:  # no repeated blocks
            return False
        # not around or inside the model's own checkpoint (``check_checkpointing``)
        return bool(blocks) and not any(own_overlap(trace, b) for b in blocks)

    def chooses_placement(self) -> bool:
        """Whether auto chooses the shard placement: not where the user gave it or offload, nor for FSDP1."""
        return self._chooses_offload() and not self.keeps_placement

    def _chooses_offload(self) -> bool:
        """Whether auto may turn CPU offload on where nothing fits: not where the user fixed the memory options
        (``--offload``, ``--shard-placement auto``), nor for FSDP1."""
        return self.choose_memory_options and self.target is not Target.FSDP1 and not self.options.offload \
            and self.options.shard_placement is ShardPlacement.DIM0

    def _faster_on_dim1(self, trace: Trace, model: str, result: AutoResult) -> AutoResult:
        """``result``, or auto's search with params sharded on dim 1 where dim 0 is smaller than the shard size
        (``ShardPlacement.AUTO``) where that is faster: dim 1 saves time too, not only memory. FSDP2 pads a
        dim 0 of 8 experts to one row per rank, so on 64 ranks the experts' all-gathers carry 8x their bytes and
        their padded shards take memory that checkpointing must win back; HSDP with 8-rank shard groups was the
        way around it, and a larger budget took it over dim-1 sharding on all 64 (hf:mixtral-8x7b on h100:64 with
        120 GiB: 1.53 s against 1.46 s within 70 GiB). Searched only where the pure FSDP layout's screening on
        dim 1 (its best classic plan, as ``_choose_meshes`` screens layouts) beats that layout's best plan on dim
        0 by ``DIM1_GAIN`` and comes within ``MESH_SLACK`` of ``result``: a model whose small params (a
        classifier's head) change nothing pays one screening, no search."""
        flat = Mesh.flat(self.cluster.world_size)
        on_dim0 = result.meshes.get(self.layout_name(flat))
        if not self.chooses_placement() or self.mesh is not None or on_dim0 is None \
                or not shard_dims(trace, flat.shard, ShardPlacement.AUTO):
            return result
        dim1 = replace(self, options=self.options.with_memory_options(False, ShardPlacement.AUTO),
                       choose_memory_options=False)
        found = dim1._screen(trace, model)
        if found is None:
            return result
        _, screened, ev = found
        step = screened.report.step_time
        if not ev.fits(screened) or step > on_dim0.report.step_time * (1 - DIM1_GAIN) \
                or step > result.report.step_time * (1 + MESH_SLACK):
            return result
        searched = dim1._search(trace, model, ev)
        if not searched.fits or searched.report.step_time >= result.report.step_time:
            return result
        return replace(searched, evaluated=result.evaluated + searched.evaluated,
                       seconds=result.seconds + searched.seconds)

    def _ways_out(self, trace: Trace, result: AutoResult) -> list[tuple[bool, ShardPlacement]]:
        """FSDP2's memory options to search with when ``result`` does not fit, cheapest first: dim-1 sharding (no
        extra traffic beyond a copy, where the model has params it applies to), offload, both. None when it fits,
        when the user fixed them, or when auto must plan for FSDP1 (which has no shard placement)."""
        if result.fits or not self._chooses_offload():
            return []
        if not self.chooses_placement():  # ``--shard-placement dim0`` given: offload only
            return [(True, ShardPlacement.DIM0)]
        dim1 = bool(shard_dims(trace, self.cluster.world_size, ShardPlacement.AUTO))
        ways = [(False, ShardPlacement.AUTO)] if dim1 else []
        return [*ways, (True, ShardPlacement.DIM0), *([(True, ShardPlacement.AUTO)] if dim1 else [])]

    def _search(self, trace: Trace, model: str, start: Evaluator | None = None) -> AutoResult:
        """The best plan on each layout worth a full search, the fastest that fits overall (``_choose_meshes``).
        ``start``: ``_screen``'s evaluator on ``trace``; the layout screening starts with the very simulations
        the TP screening made (the same classic plans and checkpointing search, on the same evaluator), so it goes
        on with them, where it screens layouts at all (else the search would start with plans it does not see)."""
        started = time.perf_counter()
        memory = self._budget()
        budget, source = memory.limit, memory.source
        reuse = start is not None and self.mesh is None and len(candidate_meshes(self.cluster, self.target)) > 1
        first = Search(start if reuse else self._evaluator(trace, model, memory, self.mesh), trace, model)
        screened: dict[str, Candidate] = {}
        evaluators = {first.ev.ctx.mesh: first.ev}
        if self.mesh is None:
            evaluators, screened = self._choose_meshes(trace, model, first, memory)
        # a layout searched in full goes on with what its screening simulated
        searches = [first if ev is first.ev else Search(ev, trace, model, shared=first) for ev in evaluators.values()]
        effort = self.search_effort if self.search_effort is not None else default_search_effort(trace)
        outcomes, left = [], effort
        for n, search in enumerate(searches):  # what one layout's refinement leaves, the next may use
            outcome, used = self._search_mesh(search, trace, left // (len(searches) - n))
            outcomes.append(outcome)
            left -= used
        best = min(outcomes, key=lambda o: (max(0, o.chosen.report.reserved_memory - budget),
                                            o.chosen.report.step_time))
        ev = best.search.ev
        opts = self.options
        run = RunOptions(opts.offload, shard_dims(ev.trace, ev.ctx.shard, opts.shard_placement),
                         opts.reduce_dtype.value if opts.reduce_dtype else "")
        return AutoResult(
            plan=self._labelled(best.chosen.plan, ev, run), report=best.chosen.report, budget=budget,
            budget_source=source, fits=ev.fits(best.chosen), baselines=best.baselines,
            evaluated=sum(o.search.ev.simulated for o in outcomes) + len(screened), effort=effort,
            refined=effort - left, cut=best.cut, seconds=time.perf_counter() - started, search=best.search,
            meshes={**{self.layout_name(o.search.ev.ctx.mesh): o.chosen for o in outcomes}, **screened},
            chosen=best.chosen, memory=memory, checkpointing=best.checkpointing, run=run,
            fixed_checkpointing=self.checkpointing is not None)

    def _evaluator(self, trace: Trace, model: str, budget: MemoryBudget, mesh: Mesh | None,
                   shared: Search | None = None) -> Evaluator:
        """An evaluator on ``mesh`` (``shared``: a search of the same model whose layout-free costs are reused),
        checkpointing what ``checkpointing`` fixes."""
        fixed = checkpointed_blocks(trace, self.checkpointing) if self.checkpointing is not None else []
        op, off = self.checkpointing is ACMode.OP, self.checkpointing is ACMode.OFFLOAD
        if op:  # (``--ac op``: every plan checkpoints the blocks so, which fails where a router modifies its topk)
            check_saved_topk(trace, dict.fromkeys(fixed, self.sac_policy))
        return Evaluator(trace, self.cluster, self.options, self.target, model, budget, mesh,
                         shared.ev.ctx if shared else None, checkpointed=[] if op or off else fixed,
                         selective=dict.fromkeys(fixed, self.sac_policy) if op else None,
                         offloaded=fixed if off else (), tensor_parallel=self.on_layout)

    def _labelled(self, plan: Plan, ev: Evaluator, run: RunOptions) -> Plan:
        hsdp = f", hsdp {ev.ctx.mesh.describe()}" if ev.ctx.mesh.replicate > 1 else ""
        op = f", ac op {self.sac_policy.value}" if self.checkpointing is ACMode.OP else \
            ", ac offload" if self.checkpointing is ACMode.OFFLOAD else ""
        memory = (", offload" if run.offload else "") + (", shard dim 1" if run.shard_dims else "")
        tp = f", {self.on_layout.describe()}" if self.on_layout is not None else ""
        cluster = self.cluster.name  # (a TP view keeps the cluster's name)
        if self.whole_model is not None:
            plan = replace(plan, fingerprint=self.whole_model[0], numel=self.whole_model[1])
        return replace(plan, policy=(f"auto({cluster}, {fmt_bytes(ev.budget)}"
                                     f"{', fsdp1' if self.target is Target.FSDP1 else ''}{hsdp}{tp}{op}{memory})"),
                       model=ev.model)

    def _choose_meshes(self, trace: Trace, model: str, first: Search, budget: MemoryBudget
                       ) -> tuple[dict[Mesh, Evaluator], dict[str, Candidate]]:
        """Screen every candidate layout by the best classic plan of the first (pure FSDP) on it, with the fewest
        checkpointed blocks that make it fit when it does not (as a user would run it). The best is searched in
        full, and so are the next ones up to ``MESH_SEARCHES`` whose screening plan is within ``MESH_SLACK`` of the
        best's (a search gains less than that over the classic plans it starts from). Returns the evaluators of the
        layouts to search (with what their screening simulated) and the best screening plan of each layout left
        out."""
        meshes = candidate_meshes(self.cluster, self.target)
        if len(meshes) == 1:  # nothing to screen (one node, or FSDP1, where no classic plan may be expressible)
            return {first.ev.ctx.mesh: first.ev}, {}
        screen: list[tuple[tuple, Evaluator, Candidate]] = []
        plans = first.classics  # on the first layout; then only the best of them (the layouts rank alike)
        for mesh in meshes:
            flat = mesh == first.ev.ctx.mesh
            # each layout's search chooses its own checkpointing: the screening's setting stays on a view
            base = first.ev if flat else self._evaluator(trace, model, budget, mesh, first)
            ev, baselines = self._fitting_baselines(base, trace, plans)
            if flat and not baselines:  # no classic plan runs: screen with the root's plan, which does
                plans = {ROOT_ONLY: root_plan(trace, model)}
                ev, baselines = self._fitting_baselines(base, trace, plans)
            if flat:
                best = min(baselines, key=lambda k: ev.key(baselines[k]), default=None)
                plans = {best: plans[best]} if best is not None else {}
            ranked = ev.ranked()  # empty: not even the root's plan runs (the flat layout's search says why)
            if ranked:
                screen.append((ev.key(ranked[0]), base, ranked[0]))
        if not screen:
            return {first.ev.ctx.mesh: first.ev}, {}
        screen.sort(key=lambda x: x[0])
        fastest = screen[0][2].report.step_time
        searched = [ev for i, (key, ev, c) in enumerate(screen[:MESH_SEARCHES])
                    if i == 0 or (key[0] == 0 and c.report.step_time <= fastest * (1 + MESH_SLACK))]
        return ({ev.ctx.mesh: ev for ev in searched},
                {self.layout_name(ev.ctx.mesh): c for _, ev, c in screen if ev not in searched})

    def _fitting_baselines(self, ev: Evaluator, trace: Trace, plans: dict[str, Plan]
                           ) -> tuple[Evaluator, dict[str, Candidate]]:
        """The classic ``plans`` on ``ev``, with the fewest leading blocks checkpointed that let one fit when none
        does and auto chooses the checkpointing; the evaluator they were simulated with."""
        baselines = classic_baselines(ev, plans)
        blocks = block_instances(trace)
        if self.checkpointing is None and blocks and baselines and not ev.fits(ev.best()):
            ev = ev.checkpointing(blocks[:self._fewest_checkpointed(ev, blocks, self._start(ev, baselines))])
            baselines = classic_baselines(ev, plans)
        return ev, baselines

    def _search_mesh(self, search: Search, trace: Trace, effort: int) -> tuple[MeshOutcome, int]:
        """The best plan on one layout, refining with at most ``effort`` plans; with the plans refinement used. Without
        a fixed checkpointing, on a model with blocks: when nothing fits without activation checkpointing, the
        fastest mix of full and op-level checkpointing of the first blocks that lets the per-block plan fit
        (``checkpointing.py``), the fewest in full alone, and all in full, each setting's groupings searched. Then,
        where a faster grouping misses the budget (``_held_back``), the same checkpointing search on that grouping,
        and refinement under its setting where it fits faster: keeping more params gathered can pay for the
        recomputation that makes room (toy-llama on h100:8 within 1.8 MB: 3 groups with a block in full and 2
        op-level, 3.5% faster than what the per-block plan's settings gave). It comes last, so the plans found before
        are the bar it must beat and no refinement before starts from its plans."""
        ev = search.ev
        blocks = block_instances(trace)
        baselines = self._explore(search, ev, search.granularities())
        choice, settings = None, []
        if self.checkpointing is None and blocks and not fits_unchecked(ev):
            choice = self._checkpoint_choice(ev, blocks, self._start(ev, baselines))
            first = [choice.setting, choice.full_only] if choice else []
            settings = list(dict.fromkeys([*first, Setting(len(blocks), 0)]))
            used, cut = self._search_settings(search, settings, effort)
        else:
            used, cut = search.refiner.refine(effort), search.refiner.cut
        before = ev.best()
        held_back = self._held_back(ev, blocks)[:HELD_BACK] if self.checkpointing is None and blocks else []
        # each one's settings tried on it join the evaluator's plans
        regrouped = [self._checkpoint_choice(ev, blocks, start) for start in held_back]
        best = ev.best()
        if best is not before:  # a held-back grouping fits faster: refined under its checkpointing (as it has it:
            # a group inside a block leaves that block's op-level checkpointing out, ``with_checkpointing``); it may be
            # ``_held_back``'s own measure, the fastest grouping with every block in full, which no choice tried
            choice = choice or next((c for c in regrouped if c is not None and best in c.tried.values()), None)
            setting = ev.checkpointing(best.plan.activation_checkpointing, best.plan.selective_checkpointing)
            refiner = Refiner(setting, search.atoms, search.fine_atoms)
            used, cut = used + refiner.refine(effort - used), cut or refiner.cut
        kept, refined = self._classics_kept(search, effort - used)
        chosen = self._preferred(search, ev.best(), [*baselines.values(), *kept])
        return MeshOutcome(search, chosen, baselines, cut, choice), used + refined

    def _classics_kept(self, search: Search, effort: int) -> tuple[list[Candidate], int]:
        """The classic groupings with every group kept gathered after forward (``reshard_after_forward=False``,
        torchtitan's ``fsdp_reshard_after_forward = "never"``) under the best plan's checkpointing, and refinement
        from one where it is faster: the DP tries its own groupings so, the classic ones are tried as their
        policies set them. They join the classic plans auto's preference for fewer groups must not be slower than
        (``_preferred``): a torchtitan job edited to "never" without checkpointing was 0.3% faster than auto's plan of
        8 groups (llama3-8b, TP 2, compiled, on h100:8), which the preference took over 35 groups 0.5% faster.
        Last, as ``_held_back``: the plans found before are the bar. Those plans, and the plans refinement used."""
        if self.target is not Target.FSDP2:
            return [], 0
        ev, before = search.ev, search.ev.best()
        setting = ev.checkpointing(before.plan.activation_checkpointing, before.plan.selective_checkpointing)
        kept = [setting.evaluate(plan.with_every_group(reshard_after_forward=False), f"{name}, every group kept "
                                 "gathered") for name, plan in search.classics.items()
                if any(g.reshard_after_forward is not False for g in plan.groups)]
        kept = [c for c in kept if c.runs and ev.fits(c)]  # (one over the budget is no bar to a plan that fits)
        if ev.best() is before:
            return kept, 0
        return kept, Refiner(setting, search.atoms, search.fine_atoms).refine(effort)

    def _search_settings(self, search: Search, settings: list[Setting], effort: int) -> tuple[int, bool]:
        """Each checkpointing setting's groupings searched (explored, then refined with a share of ``effort``):
        the plans refinement used, and whether the effort cut one short."""
        blocks = block_instances(search.ev.trace)
        used, cut = 0, False
        for n, s in enumerate(settings):
            setting = setting_view(search.ev, blocks, s, self.sac_policy)
            # whole blocks: a group inside a block forbids its op-level checkpointing (``inside_selective``)
            self._explore(search, setting, [search.atoms])
            refiner = Refiner(setting, search.atoms, search.fine_atoms)
            used += refiner.refine((effort - used) // (len(settings) - n))
            cut = cut or refiner.cut
        return used, cut

    def _held_back(self, ev: Evaluator, blocks: list[str]) -> list[Candidate]:
        """The plans without checkpointing, over the budget and faster than the best that fits, that checkpointing
        may let fit faster, likeliest first: by the step each would take with just enough blocks in full to fit
        (its excess over the budget in blocks, at what checkpointing a block saves and costs), where that beats the
        best and needs no more blocks than there are. What a block saves and costs is measured once, on the
        fastest such plan with every block in full (the blocks' saved activations are alike): one simulation, so
        a layout where no plan qualifies costs little more."""
        ranked = ev.ranked()  # (those over the budget last: the first is the best that fits, if one does)
        bar = ranked[0].report.step_time if ranked and ev.fits(ranked[0]) else float("inf")
        over = sorted((c for c in ranked if not ev.fits(c) and c.report.step_time < bar
                       and not c.plan.checkpoints),
                      key=lambda c: (c.report.step_time, c.report.reserved_memory))
        if not over:
            return []
        fastest = over[0]
        full = ev.checkpointing(blocks).evaluate(fastest.plan, f"{fastest.origin} + checkpoint every block")
        saves = (fastest.report.reserved_memory - full.report.reserved_memory) / len(blocks)
        costs = (full.report.step_time - fastest.report.step_time) / len(blocks)
        if saves <= 0:
            return []
        estimated, seen = [], set()
        for c in over:
            if (c.report.step_time, c.report.reserved_memory) in seen:  # one grouping under two names (a group
                continue  # of every module, or the root's alone)
            seen.add((c.report.step_time, c.report.reserved_memory))
            needed = (c.report.reserved_memory - ev.budget) / saves
            step = c.report.step_time + needed * costs
            if needed <= len(blocks) and step < bar:
                estimated.append((step, len(estimated), c))
        return [c for _, _, c in sorted(estimated)]

    @staticmethod
    def _start(ev: Evaluator, baselines: dict[str, Candidate]) -> Candidate | None:
        """The plan checkpointing settings are judged on: torchtitan's grouping, or the best classic plan."""
        return baselines.get("titan") or min(baselines.values(), key=ev.key, default=None)

    def _checkpoint_choice(self, ev: Evaluator, blocks: list[str], start: Candidate | None) -> Choice | None:
        """The fastest setting of full and op-level checkpointing of the first blocks for ``start``'s grouping to
        fit; None when there is no plan to judge on."""
        if start is None:
            return None
        fewest = self._fewest_checkpointed(ev, blocks, start)
        return CheckpointSearch(ev, blocks, start, self.sac_policy,
                                op_level_runs(ev.trace, blocks, self.sac_policy)).choose(fewest)

    def _preferred(self, search: Search, best: Candidate, classics: list[Candidate]) -> Candidate:
        """Among the plans as fast as ``best`` (within a slack) and no slower than any of ``classics``, one whose
        root manages only what it must, then one with the fewest groups."""
        classic_step = min((c.report.step_time for c in classics), default=float("inf"))
        if self.target is Target.FSDP2 and best.plan.root.params:
            best = search.refiner.prefer_empty_root(best, classic_step)
        if search.ev.fits(best):
            best = search.refiner.prefer_fewer_groups(best, classic_step)
        return best

    def _explore(self, search: Search, ev: Evaluator, granularities: list[list[Atom]]) -> dict[str, Candidate]:
        """The structured candidates on ``ev``: classic plans (returned), the frugal plans and the DP, then
        module-tree cuts. The DP's plans come first: they have few groups, simulate fast and set the bar that lets
        ``could_rank`` skip the cuts with thousands of groups (a per-leaf cut of a 10,000-module model costs more
        than all DP plans together)."""
        classics = classic_baselines(ev, search.classics)
        if self.target is Target.FSDP2 and several_kinds(ev.trace):
            # the size cuts hold the root-only plan, but with several dtypes it has groups that must not reshard
            ev.evaluate(root_plan(ev.trace, ev.model), ROOT_ONLY)
        if self.target is Target.FSDP2:
            for atoms in granularities:
                deferred = frugal_and_dp(ev, atoms)
                if deferred is not None:
                    search.deferred.append(deferred)
        search.cuts.evaluate(ev)
        return classics

    @staticmethod
    def _fewest_checkpointed(ev: Evaluator, blocks: list[str], start: Candidate | None) -> int:
        """The fewest leading blocks to checkpoint for ``start``'s grouping (``_start``: torchtitan's, or the best
        classic plan) to fit; all of them when even that does not fit, or there is no plan to judge on."""
        if start is None:
            return len(blocks)
        lo, hi = 1, len(blocks)
        while lo < hi:
            mid = (lo + hi) // 2
            tried = ev.checkpointing(blocks[:mid]).evaluate(start.plan, f"{start.origin} + checkpoint {mid} blocks")
            if ev.fits(tried):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _state_over_budget(self, trace: Trace) -> bool:
        """Whether the model's params, grads and optimizer state alone, spread over the cluster's GPUs, are over the
        budget (``state_floor``): then no plan fits without CPU offload, dim-1 sharding or not."""
        return state_floor(trace, self.options, self.cluster.world_size) > self._budget().limit

    def _budget(self) -> MemoryBudget:
        gpu = self.cluster.gpu
        return MemoryBudget.given(self.memory_budget, gpu.memory_bytes, gpu.name, self.headroom)


@dataclass(frozen=True, eq=False)  # (one layout is itself: compared by identity)
class ScreenedLayout:
    """One TP layout of a search, screened (``AutoPolicy.screen_layouts``): the search on its view (``policy``,
    ``trace``: one TP rank's), its best classic plan with the fewest checkpointed blocks that let it fit, that
    plan's rank key, and the evaluator that simulated it, which a full search goes on with (``best`` None: no
    classic plan runs)."""

    policy: AutoPolicy
    trace: Trace
    key: tuple = ()
    best: Candidate | None = None
    ev: Evaluator | None = None

    @property
    def step_time(self) -> float:
        assert self.best is not None
        return self.best.report.step_time

    @property
    def name(self) -> str:
        """The layout as the search's lines name it (its best classic plan's data-parallel mesh, and TP)."""
        assert self.best is not None
        return self.policy.layout_name(self.best.plan.mesh or Mesh.flat(self.policy.cluster.world_size))

    def search(self, model: str) -> AutoResult:
        """The full search of this layout, going on with what its screening simulated."""
        return self.policy.search(self.trace, model, screened=self.ev)


def fits_unchecked(ev: Evaluator) -> bool:
    """Whether a plan that checkpoints nothing fits (the layout screening's checkpointed plans, shared with ``ev``,
    do not count: the search must choose its own checkpointing)."""
    return any(ev.fits(c) for c in ev.ranked()
               if not c.plan.checkpoints)


HELD_BACK = 2  # plans over the budget whose checkpointing auto searches when it looks faster (``_held_back``):
# the likeliest may need a setting searched already, the next one of its own (toy-llama within 1.8 MB: 2 groups
# need every block in full, 3 groups one in full and 2 op-level)
TP_SEARCHES = 2  # TP layouts searched in full at most, the best by their screening (``_choose_tp``)
TP_SLACK = 0.03  # ... the second when its screening plan is within this of the best's, or of what the best's
# search gained over it if more: each full search costs as much as a search without TP (a fixed 10%, as
# ``MESH_SLACK``, made llama3-8b on h100:64 plan 3x slower for the same plan)
MESH_SEARCHES = 2  # layouts searched in full at most, the best by their classic plans; the others keep those plans'
MESH_SLACK = 0.10  # a layout is searched in full when its classic plans are within this of the best layout's
DIM1_GAIN = 0.01  # dim-1 sharding is searched when the flat layout's classic plan on dim 1 beats its best on dim
# 0 by this (``AutoPolicy._faster_on_dim1``): a dim 0 padded to the shard size costs far more (8 experts on 64
# ranks: 8x their all-gather bytes)


def candidate_meshes(cluster: Cluster, target: Target) -> list[Mesh]:
    """The layouts auto considers on ``cluster``: pure FSDP over every GPU, and HSDP with shard groups of whole
    nodes (one, two, four... nodes: what people run at scale, torchtitan's ``dp_shard`` a multiple of the node).
    Shard groups smaller than a node would all-reduce the grads over NVLink-free strided groups and hold more
    state per GPU, for no collective saved; FSDP1's HYBRID_SHARD is not modelled."""
    world, node = cluster.world_size, cluster.gpus_per_node
    flat = Mesh.flat(world)
    if target is Target.FSDP1 or world <= node:
        return [flat]
    return [flat] + [Mesh(world // s, s) for s in divisors(world) if s % node == 0 and s < world]


class PeakTerm(Enum):
    """What a no-fit message names in the smallest peak, each with the way out it calls for."""

    LOSS = "logits and loss outside the model"
    ACTIVATIONS = "activations"
    SHARDED = "sharded state (params, grads, optimizer)"
    BUFFERS = "buffers (whole on every rank)"
    OPTIMIZER_STEP = "optimizer step's temporaries"
    UNSHARDED_PARAMS = "unsharded params"
    UNSHARDED_GRADS = "unsharded grads"
    COPIES = "low-precision weight copies"
    ALLOCATOR = "collective streams' pools beyond the allocated peak"


# the memory model's categories, summed into the terms a user can act on
_CATEGORIES = {PeakTerm.SHARDED: ("params", "grads", "optimizer_state"), PeakTerm.BUFFERS: ("buffers",),
               PeakTerm.UNSHARDED_PARAMS: ("unsharded_params", "all_gather_buffers"),
               PeakTerm.UNSHARDED_GRADS: ("unsharded_grads", "reduce_scatter_buffers", "gradient_buckets"),
               PeakTerm.COPIES: ("compute_copies",), PeakTerm.ACTIVATIONS: ("activations",),
               PeakTerm.OPTIMIZER_STEP: ("optimizer_temporaries",)}
_WAY_OUT = {
    PeakTerm.LOSS: "they grow with batch x seq x vocab and no sharding shrinks them: use a smaller --batch or --seq "
                   "(or --loss-chunks 8: the output layer and the loss in chunks, as torchtitan's ChunkedLossWrapper)",
    PeakTerm.ACTIVATIONS: "they grow with batch x seq and FSDP does not shard them: use a smaller --batch or --seq",
    PeakTerm.SHARDED: "it shrinks with the number of ranks sharding it: use more GPUs",
    PeakTerm.BUFFERS: "FSDP2 shards no buffer, so no plan and no GPU count shrinks them",
}


def peak_terms(ev: Evaluator, c: Candidate) -> dict[PeakTerm, int]:
    """The candidate's reserved peak by term, largest first: the memory model's categories at the peak, the loss
    region taken out of the activations, and what the all-gather and reduce-scatter streams' pools reserve beyond
    them (``sim/memory.py``: allocated vs reserved)."""
    terms = _report_terms(c.report)
    schedule = build_schedule(ev.trace, c.plan, ev.ctx.world, ev.ctx.sizing.group_params(c.plan))
    at_step = c.report.memory_at_peak.get("optimizer_temporaries", 0) > 0  # only the batch is left of activations
    loss = 0 if at_step else min(ev.ctx.memory.loss_at_peak(c.plan, schedule), terms.get(PeakTerm.ACTIVATIONS, 0))
    if loss:
        terms[PeakTerm.ACTIVATIONS] -= loss
        terms[PeakTerm.LOSS] = loss
    return dict(sorted(((t, b) for t, b in terms.items() if b > 0), key=lambda tb: -tb[1]))


def _report_terms(report: StepReport) -> dict[PeakTerm, int]:
    """A step's reserved peak by the memory model's categories, and the allocator's share beyond them."""
    at = report.memory_at_peak
    terms = {t: sum(at[k] for k in keys) for t, keys in _CATEGORIES.items()}
    terms[PeakTerm.ALLOCATOR] = report.reserved_memory - report.peak_memory
    return terms


def infeasible_message(result: AutoResult) -> str:
    """Why no plan fits, from the plan with the smallest peak: its largest terms by name, and the way out the
    largest calls for."""
    ev = result.search.ev
    floor = result.min_peak  # (simulates the frugal plans skipped so far: they may hold the smallest peak)
    smallest = min(ev.seen, key=lambda c: c.report.reserved_memory)
    terms = peak_terms(ev, smallest)
    ep_after = result.ep_given and smallest.plan.expert_parallel is None
    if result.report.reserved_memory < floor or ep_after:  # a screen after the search (EP) held less than any plan
        # it searched, or the EP asked for was laid on the searched groups after: its options are the plans there
        floor, smallest = result.report.reserved_memory, Candidate(result.plan, result.report, "screen")
        terms = dict(sorted(((t, b) for t, b in _report_terms(result.report).items() if b > 0),
                            key=lambda tb: -tb[1]))
    largest = next(iter(terms))
    shown = ", ".join(f"{t.value} {fmt_bytes(b)}" for t, b in list(terms.items())[:4])
    ac = smallest.plan.activation_checkpointing
    checkpointed = f"; {fmt_count(len(ac), 'module')} checkpointed" if ac else ""
    hint = _budget_hint(result, floor)
    if result.also_tried:
        hint += f" ({', '.join(result.also_tried)} did not fit either)"
    if terms.get(PeakTerm.OPTIMIZER_STEP):  # never the largest (the state it sits beside is more), still a way out
        hint += (f"; the peak is the optimizer step, whose temporaries a fused optimizer does not make (--optimizer "
                 f"{ev.ctx.options.optimizer.name}-fused)")
    return (f"no plan fits the memory budget of {fmt_bytes(result.budget)} per rank on {ev.cluster.name}: the "
            f"smallest peak any plan reaches is {fmt_bytes(floor)} ({shown}{checkpointed}); the largest part is the "
            f"{largest.value}: {_way_out(largest, ev.trace.loss_chunks)}{hint}")


def _way_out(term: PeakTerm, chunks: int) -> str:
    """What shrinks the largest term of the smallest peak: for the loss's, more chunks where it runs in some."""
    if term is PeakTerm.LOSS and chunks:
        return (f"they grow with batch x seq x vocab / the loss's {chunks} chunks and no sharding shrinks them: use "
                f"more --loss-chunks, or a smaller --batch or --seq")
    return _WAY_OUT.get(term, "use more GPUs or a smaller --batch or --seq")


def _budget_hint(result: AutoResult, floor: int) -> str:
    """What budget option would let the smallest peak fit: a larger --memory-budget, or a smaller --headroom when
    the peak is within the GPU's capacity."""
    if result.budget_source == "--memory-budget":
        return ", or raise --memory-budget to at least that"
    memory = result.memory
    if memory.headroom is not None and floor <= memory.capacity:
        return (f", or lower --headroom (it fits the {fmt_bytes(memory.capacity)} of the GPU with "
                f"{fmt_bytes(memory.capacity - floor)} to spare, under the {memory.headroom.describe()})")
    return ""


__all__ = ["AutoPolicy", "AutoResult", "PeakTerm", "Search", "Target", "infeasible_message", "peak_terms"]


def best_fitting_baseline(result: AutoResult) -> Candidate | None:
    """The fastest classic policy's plan (with its defaults) that fits the budget on the chosen layout, runs, and
    the target can express (a plan FSDP1 cannot express is no rival): what auto's plan is measured against."""
    ev = result.search.ev
    fitting = [c for c in result.baselines.values()
               if ev.fits(c) and c.runs and ev.allowed(c.plan)]
    return min(fitting, key=lambda c: c.report.step_time, default=None)
