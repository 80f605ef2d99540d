"""The planning use case: a ``PlanJob`` in, a ``PlanOutcome`` out. The command line's ``plan`` (with or without a
job config), ``fsdp_planner.plan`` and ``fit`` all run this, so they give the same plan for the same job.

How the model is traced is the caller's (``Tracer``): the command line may time the ops (``--measure``), the API
traces a live module; a spec's meta trace is ``tracing.trace_spec``. What a run has to say on the way (a note, a
spinner) goes to a ``Reporter``; the API's is silent."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from fsdp_planner.choices import ExpertPlacement, GradientSync, ShardPlacement, Target, ZeroGrad
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.claim import short_list
from fsdp_planner.fsdp2.expert_groups import root_held_experts
from fsdp_planner.fsdp2.float8 import FLOAT8_DIM_MULTIPLE, Float8
from fsdp_planner.fsdp2.plan import Plan, Workload, check_plan_world_size
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.fsdp2.validity import check_compiled_groups
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import BUILTINS, ModelSpec, as_spec, written_defaults
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, ScreenedLayout, faster, infeasible_message
from fsdp_planner.planners.auto.evaluator import Candidate
from fsdp_planner.planners.auto.split import DEFAULT_SPLITS, MAX_SPLITS, choose_split
from fsdp_planner.planners.blocks import default_block_class
from fsdp_planner.planners.expert_parallel import (
    compiled_experts,
    ep_note,
    ep_tp_degrees,
    expert_modules,
    no_experts,
    per_param_meshes,
    runs_ep,
    screen_ep_tp,
    screen_placement,
    token_list_experts,
    with_auto_ep,
    with_expert_parallel,
    with_own_ep,
)
from fsdp_planner.planners.registry import PolicyName, PolicyRequest, make_baseline, make_policy
from fsdp_planner.planners.tensor_parallel import (
    PAIRS,
    TITAN_LAYOUTS,
    TP_DEGREES,
    Layout,
    TPChoice,
    check_layout,
    pair_kinds,
    sharded_share,
    tp_degrees,
    tp_layout,
)
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.outcome import PlanOutcome, Row, Split, explained, summarize
from fsdp_planner.service.tracing import LayoutDoesNotRun, check_local_shapes, trace_spec
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.expert_parallel import ep_view
from fsdp_planner.sim.float8 import check_float8_scales, converted_linears
from fsdp_planner.sim.metrics import PlanMetrics, plan_metrics
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.sizing import shard_dims, sharded_numel, with_memory_options
from fsdp_planner.sim.tensor_parallel import data_parallel_plan, tp_trace, tp_view, view_key
from fsdp_planner.trace.chunked_loss import output_layer
from fsdp_planner.trace.events import KERNEL_LINEAR_ATTENTION, KERNEL_MAMBA_SCAN, KERNEL_SELECTIVE_SCAN
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
    tracer = memoised(tracer)
    splits: tuple[Split, ...] = ()
    searched: AutoResult | None = None
    if job.split:
        job, splits, searched = _split(job, tracer, reporter)
    tr = tracer(job.model, job.options)
    _dtype_notes(tr, job, reporter)
    plans, auto, no_fit = _plans(tr, job, reporter, tracer, searched)
    rows = _rows(tr, plans, job, auto)
    kept = as_written(plans[0], job, tr) if plans else None
    why = explained(auto) if job.explain and auto is not None and no_fit is None and \
        auto.plan.expert_parallel is None else None  # (the explanation reads the whole model's search, not EP's)
    if job.explain and auto is not None and no_fit is None and auto.plan.expert_parallel is not None:
        reporter.note("--explain's table of why the groups are where they are is left out: auto's groups were "
                      "searched without EP and its EP screen laid the experts out after (its line above says how)")
    tp_fixed = any(p.name is PolicyName.AUTO and p.tp is not None for p in job.policies)
    return PlanOutcome(job, tr, tuple(rows), kept, auto, summarize(auto, tp_fixed) if auto else None, no_fit, splits,
                       why)


def given_outcome(job: PlanJob, tr: Trace, plan: Plan) -> PlanOutcome:
    """The job's figures of a plan it was given rather than a policy's (an fsdp-planner export's own, read back
    with the job: ``configured.compare_config``), as ``plan`` gives a policy's."""
    return PlanOutcome(job, tr, tuple(_rows(tr, [plan], job, None)), as_written(plan, job, tr), None, None, None, (),
                       None)


def _dtype_notes(tr: Trace, job: PlanJob, reporter: Reporter) -> None:
    """What the figures assume of the model's dtypes that the model does not do itself: params stored in another
    dtype than built, a --float8 that converts no Linear."""
    built, storage = sorted(tr.index.trainable_dtypes), str(job.options.precision.storage_dtype).removeprefix("torch.")
    if built and built != [storage]:
        reporter.note(f"the model builds its trainable params in {' and '.join(built)} and precision "
                      f"'{job.options.precision.name}' stores them in {storage}: these figures are of the model so "
                      f"converted (model.to(torch.{storage}) in the factory), as verify and apply_plan need it")
    f8 = job.options.float8
    if f8 is None:
        return
    idle = f8.filtering_nothing([name for name, m in tr.modules.items() if m.cls == "Linear"])
    if idle:  # (a typo in --float8-skip kept nothing in bf16, without a word: a trial)
        reporter.note(f"--float8-skip {','.join(idle[:5])}: in no Linear's name, so it keeps nothing in bf16 (a "
                      "Linear whose name holds an entry is, e.g. layers.0.attention.wq)")
    converted = converted_linears(tr, f8)
    if (head := output_layer(tr)) is not None and head.module in converted:  # (a head of another name than
        # torchtitan's filter knows went to float8 without a word: a trial)
        also = [n for n in converted if head.module in n and n != head.module]  # (the filter matches parts of
        # names: "out" keeps every out_proj in bf16 too: a review)
        reporter.note(f"float8 converts the output head {head.module} (the Linear the loss reads) as well: "
                      "torchtitan's jobs keep theirs in bf16 by naming it in float8's filter_fqns (here "
                      f"{', '.join(f8.filter_fqns) or 'none'}); --float8-skip {head.module} keeps it so"
                      + (f", and every Linear whose name holds it ({short_list(also)})" if also else ""))
    if not converted:
        reporter.note("--float8 converts nothing in this model: torchao swaps plain nn.Linear layers whose dims are "
                      f"multiples of {FLOAT8_DIM_MULTIPLE} (and not filtered out), and it has none, so the step is "
                      f"the {job.options.precision.name} one")


def as_written(plan: Plan, job: PlanJob, tr: Trace) -> Plan:
    """``plan`` as it leaves the program (``--out``, the API's return): with the precision and the optimizer (export
    sets them, so the code runs as the numbers assumed), the attention kernel it was planned for (absent: the
    default), the hf_config fields (verify rebuilds that model), the modules it compiles (the trace's,
    ``--compile``), its loss in chunks (``--loss-chunks``), its float8 training (``--float8``), checkpointing
    without early stop (``--no-early-stop``) and grads kept all step (``--zero-grad zeros``)."""
    check_compiled_groups(plan, tr.compiled)
    float8 = job.options.float8 or plan.float8
    if float8 is not None and float8.tp_float8_all_gather and plan.tp_degree == 1:  # auto chose no TP: nothing
        float8 = dataclasses.replace(float8, tp_float8_all_gather=False)  # to gather (a plan file without TP
        # refuses the setting)
    return dataclasses.replace(plan, precision=job.options.precision.name, optimizer=job.options.optimizer.name,
                               attention=job.model.attention or "", kernels=assumed_kernels(tr),
                               hf_config=dict(job.model.hf_config), compiled=tuple(tr.compiled),
                               compiled_loss=tr.compiled_loss is not None, loss_chunks=tr.loss_chunks,
                               loss_head=head.module if tr.loss_chunks and (head := output_layer(tr)) else "",
                               float8=float8,
                               zero_grad="zeros" if job.options.zero_grad is ZeroGrad.ZEROS else "",
                               workload=_workload(plan, job),
                               checkpoint_early_stop=_early_stop(plan, job.options))


def assumed_kernels(tr: Trace) -> tuple[str, ...]:
    """The kernel packages (``choices.KERNEL_PACKAGES``) whose stand-ins the trace ran: FLA's for linear attention
    (``linear_attention.py``), mamba_ssm's for Mamba's scans (``mamba_scan.py``, ``selective_scan.py``)."""
    kernels = {e.kernel for e in tr.events if e.is_op and not e.backward}
    return (*(["flash-linear-attention"] if KERNEL_LINEAR_ATTENTION in kernels else []),
            *(["mamba-ssm"] if kernels & {KERNEL_MAMBA_SCAN, KERNEL_SELECTIVE_SCAN} else []))


def _early_stop(plan: Plan, options: SimOptions) -> bool:
    """The plan's ``checkpoint_early_stop`` as it runs under ``options``: recorded off only where it checkpoints
    something (a plan without checkpointing reads the same either way)."""
    if not plan.checkpoints:
        return True
    return plan.checkpoint_early_stop and options.checkpoint_early_stop


def _workload(plan: Plan, job: PlanJob) -> Workload | None:
    """The step ``plan`` was judged at (its TP degree's batch per data-parallel rank where auto chose it, the
    micro-batches of the split), on the job's cluster; None where the batch is not known (a user factory's default).
    A model without a sequence length (or whose default is not known) records none."""
    model = judged_model(job.model, job.auto, plan) if job.auto is not None else job.model
    known = written_defaults(model)
    batch, seq = known.get("batch_size"), known.get("seq_len")
    if not (isinstance(batch, int) and batch > 0):
        return None
    seq = seq if isinstance(seq, int) and seq > 0 else 0  # (0: a model without a sequence length)
    micro = job.options.micro_batches
    cluster = job.cluster
    return Workload(batch * micro, seq, micro, cluster.world_size if cluster else 0, cluster.nodes if cluster else 0,
                    micro > 1 and job.options.gradient_sync is GradientSync.EVERY)


def memoised(tracer: Tracer) -> Tracer:
    """``tracer``, each model traced once per compute dtype: a job traces the same workload again and again (each
    split at its micro-batch, each TP degree d at d times it, the EP x TP screen's degrees, the chosen split once
    more), and a trace is a function of the spec and the precision alone (the tracers read no other option)."""
    traces: dict[tuple[ModelSpec, Precision], Trace] = {}

    def traced(model: ModelSpec, options: SimOptions) -> Trace:
        key = (model, options.precision)
        if key not in traces:
            traces[key] = tracer(model, options)
        return traces[key]
    return traced


def _split(job: PlanJob, tracer: Tracer, reporter: Reporter) -> tuple[PlanJob, tuple[Split, ...], AutoResult]:
    """``split``: the job at the split of the batch whose auto plan is fastest within the budget
    (``planners/auto/split.py``), each split traced at its micro-batch and searched; and that split's search,
    which is the job's (the search is deterministic: searching it again would give the same result)."""
    (policy,), cluster, batch = job.policies, job.cluster, job.whole_batch
    assert cluster is not None and batch is not None

    def at(n: int) -> PlanJob:
        return dataclasses.replace(job, model=dataclasses.replace(job.model, batch_size=batch // n),
                                   options=dataclasses.replace(job.options, micro_batches=n), split=False)

    heard: dict[int, list[str]] = {}  # each split's notes: the chosen one's are the job's (a discarded split's
    # "give --batch N" for its own TP degree misled)

    norms: list[str] = []  # the whole batch's modules that normalise by batch statistics (BatchNorm's)

    def searched(n: int) -> AutoResult:
        one = at(n)
        quiet = dataclasses.replace(reporter, note=heard.setdefault(n, []).append)
        tr = tracer(one.model, one.options)
        if n == 1:  # (searched first: ``choose_split``)
            norms.extend(m.fqn for m in tr.modules.values() if m.running_stats)
        return search(tr, policy, cluster, one.options, one.model, quiet, tracer)

    seq, chunks = job.model.workload().get("seq_len"), job.model.loss_chunks

    def runs(n: int) -> bool:  # a chunked loss splits each micro-batch's tokens into equal chunks; by default, a
        # BatchNorm's statistics stay of the whole batch (a split would change what the model trains: a new user's
        # U-Net at --batch 89 got 89 micro-batches of 1)
        return (not norms or not job.split_by_default) and (
            not chunks or not isinstance(seq, int) or (batch // n * seq) % chunks == 0)

    best, tried = choose_split(batch, searched, DEFAULT_SPLITS if job.split_by_default else MAX_SPLITS, runs)
    if norms and job.split_by_default:
        others = f" and {len(norms) - 1} other module{'s' if len(norms) > 2 else ''}" if len(norms) > 1 else ""
        reporter.note(f"auto keeps --batch {batch} whole: module '{norms[0]}'{others} normalise"
                      f"{'s' if len(norms) == 1 else ''} by the batch's statistics (BatchNorm), which micro-batches "
                      "would change: --micro-batches N or auto splits it all the same")
    for line in dict.fromkeys(heard.get(best.micro_batches, ())):
        reporter.note(line)
    return at(best.micro_batches), tuple(Split(s.micro_batches, s.result.report.step_time, s.result.fits)
                                         for s in tried), best.result


def search(tr: Trace, request: PolicyRequest, cluster: Cluster, options: SimOptions, model: ModelSpec | str,
           reporter: Reporter = SILENT, tracer: Tracer | None = None) -> AutoResult:
    """Auto's search on ``cluster`` (a result over the budget is the caller's to report). ``tracer``: how the model
    is traced at another batch, for auto's choice of the TP degree (default: the spec's meta trace)."""
    capacity = cluster.gpu.memory_bytes
    if request.memory_budget is not None and request.memory_budget > capacity:
        reporter.note(f"--memory-budget {fmt_bytes(request.memory_budget)} is more than one {cluster.gpu.name} "
                      f"holds ({fmt_bytes(capacity)}): a plan within it may not fit on the GPU")
    spec = as_spec(model)
    tracer = tracer or _spec_tracer
    ep_tp = ep_tp_layouts(tr, request, spec, cluster)
    result = _auto_search(tr, request, spec, cluster, options, reporter, tracer)
    if ep_tp and request.tp is not None:  # --tp N alone on an MoE model: the EP degrees at that TP beside it
        result = with_ep_at_tp(result, tr, request, spec, cluster, options, reporter, tracer, ep_tp[request.tp])
    elif ep_tp:  # auto's own EP x TP screen beside it
        result = with_ep_tp(result, tr, request, spec, cluster, options, reporter, tracer, ep_tp)
    degree, judged = result.plan.tp_degree, judged_model(spec, request, result.plan)
    if judged is not spec and result.fits:  # (a result over the budget is an error)
        batch = spec.workload()["batch_size"]
        reporter.note(f"auto's layout has TP {degree}: each data-parallel rank runs batch {judged.batch_size:,} "
                      f"(the step's {batch * cluster.world_size:,} sequences of batch {batch:,} per GPU kept); "
                      f"with --tp {degree} give --batch {judged.batch_size:,} for the same job")
    return result


def judged_model(model: ModelSpec, request: PolicyRequest, plan: Plan) -> ModelSpec:
    """The workload auto judged ``plan`` at: where it chose the TP degree d itself (no ``--tp``), d times the
    batch per data-parallel rank, the step's sequences kept (``auto_layouts``); else ``model`` itself."""
    batch = model.workload().get("batch_size")
    if request.tp is not None or plan.tp_degree == 1 or not batch:
        return model
    return dataclasses.replace(model, batch_size=batch * plan.tp_degree)


def _auto_search(tr: Trace, request: PolicyRequest, spec: ModelSpec, cluster: Cluster, options: SimOptions,
                       reporter: Reporter, tracer: Tracer) -> AutoResult:
    """Auto's search over the TP layouts of ``auto_layouts`` (an MoE model's EP x TP layouts apart, ``with_ep_tp``:
    with ``--ep``, none), then its EP screen: the EP asked for, or without ``--ep`` each degree (with no TP only)."""
    ep = request.ep or 1
    if ep > 1 and request.tp is None:  # EP x TP: torchtitan's MoE layout only, screened by ``with_ep_tp``
        request = dataclasses.replace(request, tp=1)
    layouts = auto_layouts(tr, request, spec, cluster, options, reporter, tracer)
    with reporter.progress(f"auto: searching plans for {cluster.name}"):
        policy = make_policy(request, cluster, options, layouts)
        assert isinstance(policy, AutoPolicy)
        searched = policy.search(tr, spec.name)
        own = request.ep is None and expert_modules(tr) and token_list_experts(tr) is None

        def screened(found: AutoResult, note: Callable[[str], None] | None) -> AutoResult:
            if ep > 1:  # its groups under the EP asked for (planners/expert_parallel.py)
                return with_auto_ep(found, tr, cluster, options, (ep,),
                                    per_param=per_param_meshes(request.ep_placement, tr),
                                    placement=screen_placement(policy))
            if own and (runs_ep(spec, tr, 1) or not found.fits):
                # auto's own EP screen (no TP); of experts EP is simulated for only (``runs_ep``), where nothing fits
                return with_own_ep(found, policy, tr, spec.name, cluster, options, note)
            return found

        notes: list[str] = []
        if request.ep is None and not expert_modules(tr) and \
                any(info.cls.endswith("Experts") for info in tr.modules.values()):
            # an MoE whose experts EP cannot split (DBRX's, flattened in a child): no screen, and why (a trial read
            # auto's silence as an oversight)
            notes.append("auto screens no expert parallelism: " + no_experts(tr).removesuffix(": plan this model "
                                                                                              "without --ep"))
        result = screened(searched, notes.append)
        if (ep > 1 or own) and searched.run.offload and not options.offload and policy.choose_memory_options:
            result, notes = _ep_without_offload(result, notes, policy, tr, spec.name, screened)
        for line in notes:  # (the screen's of the result kept)
            reporter.note(line)
    _ep_notes(result.plan, tr, spec, reporter)
    return result


def _ep_without_offload(result: AutoResult, notes: list[str], policy: AutoPolicy, tr: Trace, model: str,
                        screened: Callable[[AutoResult, Callable[[str], None] | None], AutoResult]
                        ) -> tuple[AutoResult, list[str]]:
    """``result`` (auto's search turned to CPU offload, nothing fitting without it or EP, then screened for EP) or
    the EP screen of the search without FSDP2's memory options, whichever is faster within the budget, with its EP
    screen's ``notes``: the search turns to offload before EP is screened, and EP, which shrinks the experts' shards,
    can fit without it (Qwen3.5-397B-A17B on 256 H100s: offloaded at 7.81 s a step where EP 64 fits without offload,
    5.57 s)."""
    said: list[str] = []
    found = screened(dataclasses.replace(policy, choose_memory_options=False).search(tr, model), said.append)
    chosen = faster(result, found) if found.fits else result  # (the chosen one's layout lines last: they win)
    return (chosen, said) if chosen.plan is found.plan else (result, notes)


def _ep_notes(plan: Plan, tr: Trace, model: ModelSpec, reporter: Reporter) -> None:
    if (note := ep_note(plan, tr, model)) is not None:
        reporter.note(note)


def with_ep_at_tp(result: AutoResult, tr: Trace, request: PolicyRequest, spec: ModelSpec, cluster: Cluster,
                  options: SimOptions, reporter: Reporter, tracer: Tracer, degrees: tuple[int, ...]) -> AutoResult:
    """``--tp N`` alone on an MoE model with torchtitan's layout: ``result`` (its experts tensor-parallel, no EP,
    torchtitan's layout with EP off) or the best of ``degrees`` at that TP (EP's ranks spanning TP's, the routed
    tokens split), whichever is faster within the budget (else holds least)."""
    layouts = auto_layouts(tr, dataclasses.replace(request, ep=degrees[0]), spec, cluster, options, reporter, tracer)
    with reporter.progress(f"auto: searching plans for {cluster.name} with EP"):
        policy = make_policy(request, cluster, options, layouts)
        assert isinstance(policy, AutoPolicy)
        found = with_auto_ep(policy.search(tr, spec.name), tr, cluster, options, degrees, reporter.note,
                             per_param_meshes(request.ep_placement, tr), screen_placement(policy))
    return faster(result, found)


def ep_tp_layouts(tr: Trace, request: PolicyRequest, spec: ModelSpec, cluster: Cluster) -> dict[int, tuple[int, ...]]:
    """The EP x TP layouts auto screens itself (TP degree -> EP degrees, ``ep_tp_degrees``): for a model with
    torchtitan's MoE layout, unless both degrees are given, one of them is 1, or the mesh or the FSDP1 target
    fixes the layout; without ``--tp`` only where the batch is known (TP d is judged at d times it)."""
    if request.target is not Target.FSDP2 or request.mesh is not None or 1 in (request.tp, request.ep) or \
            (request.tp is not None and request.ep is not None) or not expert_modules(tr):
        return {}
    if request.tp is None and not spec.workload().get("batch_size"):
        return {}
    try:
        return ep_tp_degrees(tr, spec, cluster, request.tp, request.ep, request.loss_parallel)
    except PlannerError:  # experts of several counts: EP only as the user names it
        return {}


def with_ep_tp(result: AutoResult, tr: Trace, request: PolicyRequest, spec: ModelSpec, cluster: Cluster,
                options: SimOptions, reporter: Reporter, tracer: Tracer, ep_tp: dict[int, tuple[int, ...]]
                ) -> AutoResult:
    """``result`` (no TP) or the best of auto's EP x TP layouts, whichever is faster within the budget. Each TP
    degree d is traced at d times the batch per data-parallel rank (the same step), screened by its best classic
    plan under each of its EP degrees (``screen_ep_tp``); the best layout is searched in full and its groups
    screened under its EP degrees (``with_auto_ep``). Every layout's line is kept: the searched ones', each
    screened one's best option."""
    started = time.perf_counter()
    batch = spec.workload()["batch_size"]
    choices = tuple(TPChoice(tp_layout(tr, d, spec, request.loss_parallel, request.async_tp, degrees[0]).tp,
                             tracer(dataclasses.replace(spec, batch_size=batch * d), options))
                    for d, degrees in ep_tp.items())
    with reporter.progress(f"auto: screening EP x TP layouts for {cluster.name}"):
        policy = make_policy(dataclasses.replace(request, tp=None), cluster, options, choices)
        assert isinstance(policy, AutoPolicy)
        screens = [x for x in (screen_ep_tp(s, degrees, options) for s, degrees in
                               zip(policy.screen_layouts(tr, spec.name), ep_tp.values(), strict=True))
                   if x is not None and x.options]
    lines = {**result.meshes, **{name: c for x in screens for name, c in x.lines().items()}}
    best = min(screens, key=lambda x: x.key(), default=None)
    if best is None or (best.key()[0] and result.fits):
        return dataclasses.replace(result, meshes=lines)
    choice = choices[[c.tp.degree for c in choices].index(best.layout.policy.on_layout.degree)]
    with reporter.progress(f"auto: searching plans for {cluster.name} with {choice.tp.describe()}"):
        searched = _full_search(best.layout, spec.name)
        found = with_auto_ep(searched, choice.trace, cluster, options, ep_tp[choice.tp.degree],
                             per_param=per_param_meshes(request.ep_placement, choice.trace),
                             placement=screen_placement(best.layout.policy))
    found = best.faster(found, searched.plan.policy)
    for name, c in found.meshes.items():  # its EP screen's lines, of its searched groups, where faster
        if name not in lines or _ahead(c, lines[name], found):
            lines[name] = c
    lines[best.name(found.plan)] = Candidate(found.plan, found.report, "auto")
    chosen = min((result, found), key=lambda r: r.rank)
    return dataclasses.replace(chosen, meshes=lines, evaluated=result.evaluated + found.evaluated,
                               seconds=result.seconds + time.perf_counter() - started)


def _full_search(layout: ScreenedLayout, model: str) -> AutoResult:
    """An EP x TP layout searched in full. Where auto chooses the memory options, it starts with dim-1 sharding
    where dim 0 would pad, as its screen did (E / EP experts can be fewer than the shard ranks; the search, on the
    view without EP, would find that only after a search with dim 0: twice the time)."""
    policy = layout.policy
    if not policy.chooses_placement():
        return layout.search(model)
    dim1 = dataclasses.replace(policy, options=policy.options.with_memory_options(False, ShardPlacement.AUTO))
    return dim1.search(layout.trace, model)


def _ahead(c: Candidate, other: Candidate, result: AutoResult) -> bool:
    """Whether ``c`` ranks before ``other``: within the budget first, then the faster (else the smaller)."""
    def key(x: Candidate) -> tuple[bool, float]:
        fits = result.memory.fits(x.report.reserved_memory)
        return not fits, x.report.step_time if fits else x.report.reserved_memory
    return key(c) < key(other)


def _spec_tracer(spec: ModelSpec, options: SimOptions) -> Trace:
    return trace_spec(spec, options.precision)


def auto_layouts(tr: Trace, request: PolicyRequest, model: ModelSpec, cluster: Cluster, options: SimOptions,
                 reporter: Reporter, tracer: Tracer) -> tuple[TPChoice, ...]:
    """The TP layouts auto searches: the one ``--tp`` asks for (checked; what it assumed noted; ``--batch`` per
    data-parallel rank, as torchtitan's local batch); without ``--tp`` (and without ``--mesh``, which fixes the
    data-parallel ranks), no TP and each degree of ``TP_DEGREES`` that divides the node and the model
    (``tp_degrees``), each judged at the same step: TP d runs d times the batch per data-parallel rank (traced at
    it), so every layout trains the batch of the GPU count a step."""
    if request.tp is None and request.mesh is None and request.target is Target.FSDP2:
        batch = model.workload().get("batch_size")
        layouts = tp_degrees(tr, model, cluster, request.loss_parallel, request.async_tp) if batch else []
        layouts = _names_screened(layouts, model, request.loss_parallel, reporter)
        if len(layouts) <= 1:
            _no_tp_screened(tr, model, batch is not None, reporter, cluster)
        layouts = _with_float8_scales(tr, layouts, options.float8, reporter)
        if len(layouts) > 1:  # what the layouts weighed assume, as --tp says it (a 70B's TP rows "do not fit"
            # under transformers' layout, without sequence parallelism: a new user read it as TP not working)
            for line in dict.fromkeys(n for x in layouts for n in x.notes):
                reporter.note(f"auto's TP layouts: {line}")
        return tuple(TPChoice(x.tp, None if x.tp.degree == 1 else
                              tracer(dataclasses.replace(model, batch_size=batch * x.tp.degree), options))
                     for x in layouts) if len(layouts) > 1 else ()
    if request.tp is None or request.tp == 1:
        return ()
    return (TPChoice(requested_layout(tr, request, model, cluster, reporter, options.float8)),)


def _no_tp_screened(tr: Trace, model: ModelSpec, batch: bool, reporter: Reporter, cluster: Cluster) -> None:
    """Say why auto screens no TP where the model has a layout: auto weighs TP d at d times the batch per
    data-parallel rank, which needs the batch (a user factory's int default is read: ``with_own_batch``);
    a layout only detected (column-then-row pairs) must first run on the model (``check_local_shapes``), which
    ``--tp`` asks for; a layout no degree divides (Gemma 3 1B's one kv head): the smallest degree's reason."""
    with contextlib.suppress(PlannerError):
        layout = tp_layout(tr, TP_DEGREES[1], model)
        source = layout.source
        if batch and source != PAIRS:
            try:
                check_layout(tr, layout, cluster, model.workload().get("seq_len"))
            except PlannerError as e:
                reporter.note(f"auto screens no tensor parallelism here: {layout.asked} is refused ({e}), and so is "
                              "every larger degree")
                return
        if source == PAIRS:  # (with or without the batch: --batch alone led a new user to this note next)
            reporter.note("auto screens no tensor parallelism here: this model's layout would be detected "
                          "(column-then-row Linear pairs), which auto does not take on its own; give --tp 2 (or "
                          "another degree) to plan and weigh it")
        elif not batch:
            reporter.note("auto screens no tensor parallelism here: it weighs TP d at d times the batch per "
                          "data-parallel rank, and this model's batch is not known (give --batch N to screen TP, "
                          "or --tp N to plan one degree)")


def _with_float8_scales(tr: Trace, layouts: list[Layout], f8: Float8 | None, reporter: Reporter) -> list[Layout]:
    """The layouts whose converted Linears float8's precomputed scales can stack (``check_float8_scales``); the
    others named in a note."""
    kept, left = [], []
    for x in layouts:
        try:
            check_float8_scales(tr, x.tp, f8)
            kept.append(x)
        except PlannerError as e:
            left.append(f"TP {x.tp.degree}")
            why = str(e)
    if left:
        reporter.note(f"auto leaves out {', '.join(left)}: {why}")
    return kept


LITTLE_SHARDED = 0.5  # a --tp layout sharding less of the params than this is named as such


def requested_layout(tr: Trace, request: PolicyRequest, spec: ModelSpec, cluster: Cluster | None,
                     reporter: Reporter, float8: Float8 | None = None) -> TensorParallel:
    """The layout of ``--tp``: from the first source that has one for this model (``planners/tensor_parallel.py``),
    checked against the model, ``cluster`` and the job's ``float8`` (``check_float8_scales``); a detected one's
    local shapes run (``check_local_shapes``); what it assumed goes to the reporter."""
    assert request.tp is not None
    if (request.ep or 1) > 1 and not expert_modules(tr):  # (before EP x TP's refusal: a dense model's job was told
        raise PlannerError(no_experts(tr))  # to give one of the two, not that it has no experts: a new user's trial)
    layout = dataclasses.replace(tp_layout(tr, request.tp, spec, request.loss_parallel, request.async_tp,
                                           request.ep or 1), named=request.tp_key)
    unchecked: tuple[str, ...] = ()
    if layout.source == PAIRS:
        layout, unchecked = _checked_pairs(tr, request, spec, layout, cluster)
    else:
        check_layout(tr, layout, cluster, spec.workload().get("seq_len"))
    check_float8_scales(tr, layout.tp, float8)
    if _by_names(layout, spec):
        unchecked = (*_names_verdict(spec, layout), *_loss_parallel_said(layout, request.loss_parallel))
    for line in (*layout.notes, *unchecked):
        reporter.note(line)
    if layout.tp.async_tp and not layout.tp.sequence_parallel:  # torch's micro-pipelining fuses all-gathers and
        # reduce-scatters into the matmuls: a layout of all-reduces has nothing it fuses
        reporter.note(f"--async-tp overlaps sequence parallelism's all-gathers and reduce-scatters with the matmuls, "
                      f"and this --tp {request.tp} layout has none (its collectives are all-reduces, and gathers of "
                      "whole outputs no matmul reads): it would "
                      "change nothing, and is left out of the plan")
        layout = dataclasses.replace(layout, tp=dataclasses.replace(layout.tp, async_tp=False))
    if float8 is not None and float8.tp_float8_all_gather and not layout.tp.sequence_parallel:
        reporter.note(f"--float8-tp-all-gather casts sequence parallelism's all-gathers to float8, and this --tp "
                      f"{request.tp} layout has none (its all-reduces, and the gathers of transformers' gathered "
                      "styles, stay bf16): only where "
                      "the casts run changes (torchao's float8 styles cast each Linear's input and output grad in "
                      "their hooks)")
    share = sharded_share(tr, layout.tp)
    if share < LITTLE_SHARDED and request.mesh is None and (request.ep or 1) == 1:  # (EP shards the experts)
        # TP's collectives and a smaller data-parallel group
        # for little saved: worth saying (auto weighs no detected layout itself: Layout.checked)
        reporter.note(f"--tp {request.tp} shards {share:.0%} of the params (the rest is whole on each TP rank): "
                      "plan it without --tp too, to weigh TP against pure FSDP")
    return layout.tp


def _by_names(layout: Layout, spec: ModelSpec) -> bool:
    """A torchtitan layout taken by module names alone on a model of one's own (not a built-in, whose code is
    torchtitan's): its code may still view into a fixed head count (a trial's Llama: every rank failed in its
    attention's view under verify, where plan and auto had said nothing)."""
    return layout.source.startswith(TITAN_LAYOUTS) and spec.name not in BUILTINS


def _names_checked(spec: ModelSpec, layout: Layout) -> tuple[str, ...]:
    """``check_local_shapes`` of a ``_by_names`` layout: its sequence-parallel rowwise Linears' local shapes are
    rowwise ones (only their output's collective differs)."""
    local = TensorParallel(layout.tp.degree, {m: TPStyle.ROWWISE if s is TPStyle.ROWWISE_SEQUENCE else s
                                              for m, s in layout.tp.layout.items()})
    return check_local_shapes(spec, local, source=f"{layout.source} (taken by its module names)")


def _names_verdict(spec: ModelSpec, layout: Layout) -> tuple[str, ...]:
    """``_names_checked`` at the factory's own workload (a head count the code fixes fails at any), once a
    process: ``fit`` plans at each point it tries (a 70B factory's check took ~25 s). Its notes; its
    ``LayoutDoesNotRun`` raised again."""
    verdict = _names_cached(dataclasses.replace(spec, batch_size=None, seq_len=None), layout)
    if isinstance(verdict, LayoutDoesNotRun):  # (a fresh one: a caller may reword its own, as the API does)
        raise LayoutDoesNotRun(str(verdict), verdict.reason) from verdict
    return verdict


@functools.lru_cache(maxsize=16)
def _names_cached(spec: ModelSpec, layout: Layout) -> tuple[str, ...] | LayoutDoesNotRun:
    try:
        return _names_checked(spec, layout)
    except LayoutDoesNotRun as e:
        return e


def _loss_parallel_said(layout: Layout, asked: bool | None) -> tuple[str, ...]:
    """Where a ``_by_names`` layout takes torchtitan's loss parallel by default: what that asks of the model's own
    loss (a trial's masked mean and weighted, label-smoothed cross-entropy failed on every rank)."""
    if asked is not None or not layout.tp.loss_parallel:
        return ()
    return ("loss parallel (torchtitan's default) runs the loss on vocab-sharded logits under torch's "
            "loss_parallel(), which takes F.cross_entropy without class weights or label smoothing, and arithmetic "
            "with numbers after it: a loss that mixes in other tensors (a mask, weights) fails on the ranks; "
            "--no-loss-parallel (loss_parallel=False) plans the logits gathered instead",)


def _names_screened(layouts: list[Layout], spec: ModelSpec, asked: bool | None, reporter: Reporter
                    ) -> list[Layout]:
    """Auto's layouts, but for a ``_by_names`` one whose local shapes fail (checked at the first degree, assumed
    to hold at the others: a head count the code fixes fails at each): then no TP, said; what the check could not
    run, and the loss parallel the layouts take unless ``asked``, said too."""
    first = next((x for x in layouts if x.tp.degree > 1), None)
    if first is None or not _by_names(first, spec):
        return layouts
    try:
        unchecked = _names_verdict(spec, first)
    except LayoutDoesNotRun as e:
        reporter.note(f"auto weighs no TP: {first.source} (taken by its module names) does not run on this model: "
                      f"{e.reason}")
        return layouts[:1]
    for line in (*unchecked, *_loss_parallel_said(first, asked)):
        reporter.note(f"auto's TP layouts: {line}")
    return layouts


def _checked_pairs(tr: Trace, request: PolicyRequest, spec: ModelSpec, layout: Layout, cluster: Cluster | None
                   ) -> tuple[Layout, tuple[str, ...]]:
    """A detected layout that the model, ``cluster`` and the workload take (``check_layout``) and whose local shapes
    and numbers check (``check_local_shapes``); where the whole does not, each kind of pair checked alone and those
    that fail left whole, said in a note (a hand-written Llama block's attention that views into a fixed head count
    beside its SwiGLU MLP, or a multi-query attention whose one kv head no degree splits: the MLP kept). Refused as
    before where no kind checks."""
    seq = spec.workload().get("seq_len")

    def checked(x: Layout) -> tuple[str, ...]:
        check_layout(tr, x, cluster, seq)
        return check_local_shapes(spec, x.tp)

    try:
        return layout, checked(layout)
    except PlannerError as whole:
        kinds = pair_kinds(tr)
        if len(kinds) < 2:
            raise
        failed: dict[str, str] = {}
        every = frozenset().union(*(rows for _, rows in kinds))
        for label, rows in kinds:
            alone = tp_layout(tr, request.tp, spec, request.loss_parallel, request.async_tp, request.ep or 1,
                              left_whole=every - rows)
            try:
                checked(alone)
            except LayoutDoesNotRun as e:
                failed[label] = e.reason
            except PlannerError as e:  # a kind the layout check refuses at every degree (one kv head) is left
                # whole; one that another degree splits refuses the degree asked for (--tp 3 of 32 heads)
                if request.tp > 2 and _takes_degree_2(tr, request, spec, every - rows):
                    raise whole from None
                failed[label] = str(e)
        if len(failed) == len(kinds):
            raise whole from None
        left = frozenset().union(*(rows for label, rows in kinds if label in failed))
        kept = dataclasses.replace(tp_layout(tr, request.tp, spec, request.loss_parallel, request.async_tp,
                                             request.ep or 1, left_whole=left), named=request.tp_key)
        said = tuple(f"tensor-parallel pairs {label} left whole over TP: {why}" for label, why in failed.items())
        return dataclasses.replace(kept, notes=(*kept.notes, *said)), checked(kept)


def _takes_degree_2(tr: Trace, request: PolicyRequest, spec: ModelSpec, left_whole: frozenset[str]) -> bool:
    """Whether the detected layout less ``left_whole`` passes the model's own layout checks at TP 2 (no cluster or
    sequence asked of it): the smallest degree, so a kind it refuses no degree takes."""
    try:
        check_layout(tr, tp_layout(tr, 2, spec, request.loss_parallel, request.async_tp, request.ep or 1,
                                   left_whole=left_whole))
    except PlannerError:
        return False
    return True


def fitting(result: AutoResult) -> AutoResult:
    """``result``, or the one sentence saying why no plan fits the budget."""
    if not result.fits:
        raise PlannerError(infeasible_message(result))
    return result


def stamped(plan: Plan, tr: Trace, world: int | None, options: SimOptions | None) -> Plan:
    """``plan`` recording the memory options asked for beside those it has (a plan file's offload or shard dims are
    kept; a reduce dtype or float8 training asked for replaces its own). Shard dims need the shard size: none
    without ``world``."""
    check_compiled_groups(plan, tr.compiled)
    if options is None:
        return plan
    placement = options.shard_placement if world is not None and not plan.shard_dims else ShardPlacement.DIM0
    shard = plan.shard_size(world) if world is not None else 1
    reduce = options.reduce_dtype.value if options.reduce_dtype else plan.reduce_dtype
    out = with_memory_options(plan, tr, shard, plan.offload or options.offload, placement, reduce)
    out = out.replace(float8=options.float8 or plan.float8,  # float8 training asked for, or the plan's own
                      checkpoint_early_stop=_early_stop(plan, options))
    return out if not plan.shard_dims else dataclasses.replace(out, shard_dims=plan.shard_dims)


def with_reshard(plan: Plan, rule: str) -> Plan:
    """``plan`` with a job config's ``reshard_after_forward`` rule ("always": every group; "never": none;
    "default": the policy's own)."""
    if rule == "default":
        return plan
    return plan.with_every_group(reshard_after_forward=rule == "always").replace(
        policy=f"{plan.policy}, reshard_after_forward {rule}")


def with_tp(plan: Plan, tr: Trace, request: PolicyRequest, model: ModelSpec | str, cluster: Cluster | None,
            reporter: Reporter = SILENT, float8: Float8 | None = None) -> Plan:
    """``plan`` with the tensor parallelism ``request.tp`` asks for: the layout of the first source that has one
    for this model (``planners/tensor_parallel.py``), checked against the model and ``cluster``; what it assumed
    goes to the reporter. A plan that has TP already (a plan file's) keeps its own."""
    if plan.tensor_parallel is not None or request.tp is None or request.tp == 1:
        return plan
    tp = requested_layout(tr, request, as_spec(model), cluster, reporter, float8)
    return plan.replace(tensor_parallel=tp, policy=f"{plan.policy}, {tp.describe()}")


def expert_placement(plan: Plan, request: PolicyRequest) -> ShardPlacement | None:
    """How an EP plan of a classic policy shards its params: torchtitan's ``apply_fsdp`` shards the experts on dim 1
    where their FSDP ranks x EP exceed the experts (its ``efsdp_ep_size > num_experts``), which is where dim 0 would
    pad: ``ShardPlacement.AUTO``'s rule on the EP view (Mixtral's 8 experts, 1 a rank under EP 8, were padded 8x
    over 8 ranks on 64 GPUs: titan with EP 8 7.2 s and 109 GiB a step, 1.14 s and 15.3 GiB so; with TP 2 too,
    7.1 s and 117 GiB). Not where the user gave ``--shard-placement`` or the plan has its dims."""
    if plan.shard_dims or request.keeps_placement:
        return None
    return ShardPlacement.AUTO


def with_ep(plan: Plan, tr: Trace, request: PolicyRequest, world: int | None, model: ModelSpec | str,
            reporter: Reporter = SILENT) -> Plan:
    """``plan`` with the expert parallelism ``request.ep`` asks for (each expert module its own group); a plan that
    has EP already keeps its own. Of experts apply does not run (``runs_ep``), with a note saying so."""
    if plan.expert_parallel is not None or request.ep is None or request.ep == 1:
        return plan
    # the experts on dim 1 where dim 0 would pad, as torchtitan's apply_fsdp places them, unless the user chose
    # (``expert_placement``)
    def made(per_param_mesh: bool) -> Plan:
        return with_expert_parallel(plan, tr, request.ep, shard=plan.shard_size(world) if world else 0,
                                    placement=expert_placement(plan, request), per_param_mesh=per_param_mesh)

    out = made(request.ep_placement is not ExpertPlacement.OWN)
    held = root_held_experts(out, tr) if request.ep_placement is None else []
    if held and compiled_experts(tr) is not None:  # (calls of their own cannot run inside compiled blocks)
        reporter.note(f"{plan.policy} wraps no module above the experts ({short_list(held, 2)}), so the root's "
                      "fully_shard call shards them and keeps them gathered through the step (under --compile they "
                      "cannot be sharded in calls of their own, inside the compiled blocks): a policy grouping the "
                      "blocks (titan) shards them in the blocks' calls")
    elif held:
        # a policy that wraps no block (size) leaves the experts to the root's call, which keeps them gathered all
        # step (Mixtral's 32 under size: 11 GiB a rank): each sharded in a call of its own instead
        reporter.note(f"{plan.policy} wraps no module above the experts ({short_list(held, 2)}), so their blocks' "
                      "fully_shard call would be the root's, which keeps them gathered through the step: each experts "
                      "module is sharded in a call of its own (--ep-placement own; --ep-placement blocks keeps the "
                      "root's)")
        out = made(False)
    _ep_notes(out, tr, as_spec(model), reporter)
    return out.replace(policy=f"{plan.policy}, {out.expert_parallel.describe()}")


def policy_plan(tr: Trace, request: PolicyRequest, model: ModelSpec | str, cluster: Cluster | None = None,
                options: SimOptions | None = None, reporter: Reporter = SILENT, world: int | None = None) -> Plan:
    """The plan a policy makes for the traced model (auto: for ``cluster``, within its budget). A classic
    policy's is checked against the ``world`` ranks it runs on (default: the cluster's) before any note on what
    its EP leaves out; auto's is made for the cluster, and its caller checks it against other ranks."""
    name = str(model)
    if request.name is PolicyName.AUTO:
        if cluster is None:
            raise PlannerError("--policy auto plans for a cluster: add --cluster, e.g. --cluster h100:8")
        return fitting(search(tr, request, cluster, options or SimOptions(), model, reporter)).written_plan
    plan = with_tp(make_policy(request).plan(tr, name), tr, request, model, cluster, reporter,
                   options.float8 if options else None)
    world = world or (cluster.world_size if cluster else None)
    if world is not None:
        check_plan_world_size(plan, world)
    return with_ep(stamped(plan, tr, world, options), tr, request, world, model, reporter)


def grouping_to_check(tr: Trace, request: PolicyRequest, model: str, cluster: Cluster | None = None,
                      options: SimOptions | None = None, reporter: Reporter = SILENT) -> Plan:
    """The plan ``check`` looks for faults in: auto's for ``cluster`` (as ``policy_plan``), a classic policy's
    grouping unchecked (a param it would read sharded is one of check's findings, not an error)."""
    if request.name is PolicyName.AUTO:
        return policy_plan(tr, request, model, cluster, options, reporter)
    plan = with_tp(make_baseline(request).build(tr, model), tr, request, model, cluster, reporter,
                   options.float8 if options else None)
    return with_ep(plan, tr, request, cluster.world_size if cluster else None, model, reporter)


def _compared(tr: Trace, job: PlanJob, reporter: Reporter) -> tuple[PolicyRequest, ...]:
    """The policies to run: in a comparison, module and titan only when the model has a block class to wrap (the
    module classes asked for, or a repeated one)."""
    named = any(p.module_classes for p in job.policies)
    if not job.compare or named or default_block_class(tr) is not None:
        return job.policies
    reporter.note("the module and titan policies are left out of the comparison: the model has no repeated "
                  "block class (name the classes to wrap with --module-classes to compare them)")
    return tuple(p for p in job.policies if p.name not in (PolicyName.MODULE, PolicyName.TITAN))


def _plans(tr: Trace, job: PlanJob, reporter: Reporter, tracer: Tracer, searched: AutoResult | None = None
           ) -> tuple[list[Plan], AutoResult | None, str | None]:
    """Each policy's plan, auto's search result, and why auto found no plan within the budget (in a comparison
    that is a result, not an error). ``searched``: auto's search of this job already run (the chosen split's)."""
    auto: AutoResult | None = None
    plans: list[Plan] = []
    no_fit: str | None = None
    refused: dict[str, list[str]] = {}  # why -> the policies left out for it (said once: a --tp layout refuses all)
    try:
        for policy in _compared(tr, job, reporter):
            if policy.name is not PolicyName.AUTO:
                try:
                    plans.append(_classic(tr, policy, job, reporter))
                except PlannerError as e:
                    if not job.compare:
                        raise
                    refused.setdefault(str(e), []).append(policy.name.value)
                continue
            assert job.cluster is not None
            auto = searched if searched is not None else \
                search(tr, policy, job.cluster, job.options, job.model, reporter, tracer)
            if not job.compare and job.must_fit:
                fitting(auto)
            if not auto.fits:
                no_fit = infeasible_message(auto)
                if job.must_fit or not job.compare:
                    continue
            plans.append(auto.written_plan)  # with auto's run options (offload, shard dims, reduce dtype)
        if refused and not plans and auto is None:  # nothing left to compare (plan toy-llama --tp 3 crashed on it)
            first = next(iter(refused))
            raise PlannerError(first if len(refused) == 1 else "every policy of the comparison was left out (the "
                               f"notes say why), the first: {first}")
    except PlannerError as e:
        refused.pop(str(e), None)  # the error says it
        raise
    finally:
        for why, names in refused.items():
            which = f"the {names[0]} policy is" if len(names) == 1 else \
                f"the {', '.join(names[:-1])} and {names[-1]} policies are"
            reporter.note(f"{which} left out of the comparison: {why}")
    return plans, auto, no_fit


def _classic(tr: Trace, policy: PolicyRequest, job: PlanJob, reporter: Reporter) -> Plan:
    """A classic policy's plan; a PlannerError when the policy cannot take the requested settings or FSDP2 would
    fail on its plan (in a comparison, that policy is left out: it is no baseline)."""
    plan = with_tp(make_policy(policy).plan(tr, job.model.name), tr, policy, job.model, job.cluster, reporter,
                   job.options.float8)
    # (its world size is checked where it is simulated)
    world = job.cluster.world_size if job.cluster else None
    out = with_ep(with_reshard(stamped(plan, tr, world, job.options), job.reshard), tr, policy, world,
                  job.model, reporter)
    if world and not (out.shard_dims or out.tp_degree > 1 or out.expert_parallel or policy.keeps_placement) and \
            (said := padding_note(tr, out.shard_size(world))) is not None:
        reporter.note(said)
    return out


PADDING_SAID = 1.25  # all-gathered bytes over the params' from which dim 0's padding is said


def padding_note(tr: Trace, shard: int) -> str | None:
    """Said where FSDP2's dim-0 sharding pads the params' all-gathers by a quarter or more and another dim would
    divide (``--shard-placement auto``): Mixtral's 8 experts over 64 ranks are padded 8x, its titan plan gathering
    1.32 TiB a step and holding 211 GiB, where dim 1 takes 1.46 s and 64 GiB (a trial found no word of it)."""
    moved = shard_dims(tr, shard, ShardPlacement.AUTO)
    padded, after, whole = (sum(sharded_numel(p, shard, dims.get(p.fqn, 0)) * p.itemsize for p in tr.params)
                            for dims in ({}, moved, {p.fqn: 1 for p in tr.params}))
    if not moved or padded < PADDING_SAID * whole:
        return None
    worst = max((p for p in tr.params if p.fqn in moved), key=lambda p: p.padded_numel(shard) - p.numel)
    return (f"FSDP2 shards each param on dim 0, padded to a multiple of its {shard:,} ranks: its all-gathers move "
            f"{padded / whole:.1f}x the params' bytes ('{worst.fqn}', {' x '.join(f'{d:,}' for d in worst.shape)}, "
            f"{worst.padded_numel(shard) / worst.numel:.0f}x); --shard-placement auto shards {len(moved):,} such "
            f"params on dim 1, which divides: {after / whole:.1f}x (FSDP2's shard_placement_fn, as torchtitan places "
            "its experts)")


def _rows(tr: Trace, plans: list[Plan], job: PlanJob, auto: AutoResult | None) -> list[Row]:
    """Each plan's metrics and, with a cluster, its simulated step (one context per layout: the comparison may mix
    auto's HSDP with pure FSDP); auto's step is the one its search simulated."""
    cluster = job.cluster
    world = cluster.world_size if cluster else None
    contexts: dict[tuple, SimContext] = {}
    views: dict[tuple, tuple[Trace, Cluster | None]] = {}  # one TP rank's trace and data-parallel cluster
    ep_views: dict[tuple, Trace] = {}

    def view(p: Plan) -> tuple[Trace, Cluster | None]:
        """The trace and cluster ``p`` runs on: one TP rank's view under its TP, or one EP rank's under its EP
        (built once per layout)."""
        tp, ep = p.tensor_parallel, p.expert_parallel
        on, dp = tr, cluster
        if tp is not None and tp.degree > 1:
            float8 = job.options.float8 or p.float8
            key = view_key(tp, float8)
            if key not in views and cluster is not None:
                found = tp_view(tr, tp, cluster, float8)
                views[key] = found.trace, found.cluster
            elif key not in views:  # (without a cluster, the view's trace alone: the counts and bytes are of it)
                views[key] = tp_trace(tr, tp, float8), None
            on, dp = views[key]
        if ep is not None and ep.degree > 1:  # one EP rank's step of one TP rank's (EP's ranks span TP's)
            key = (ep.signature(), tp.signature() if tp is not None else ())
            if key not in ep_views:
                ep_views[key] = ep_view(on, p).trace
            on = ep_views[key]
        return on, dp

    def simulated(p: Plan) -> StepReport | None:
        if cluster is None:
            return None
        if auto is not None and (auto.fits or not job.must_fit) and p == auto.written_plan:
            return auto.report
        check_plan_world_size(p, cluster.world_size)
        on, dp = view(p)
        assert dp is not None
        # one context per layout (auto may have chosen offload)
        key = (p.layout(cluster.world_size), plan_options(p, job.options), p.tensor_parallel, p.expert_parallel)
        if key not in contexts:
            contexts[key] = SimContext(on, dp, key[1], mesh=key[0])
        return simulate(on, p, context=contexts[key], timeline=False)

    def metrics(p: Plan) -> PlanMetrics:
        on, dp = view(p)  # a TP plan's figures are one TP rank's: its local params on its data-parallel ranks
        plain = p if on is tr else data_parallel_plan(p, dp.world_size * p.tp_degree) if dp else p
        return plan_metrics(on, plain, dp.world_size if dp else world, precision)

    precision = job.options.precision  # the table's bytes in the job's dtypes (the simulation's, given a cluster)
    return [(p, metrics(p), simulated(p)) for p in plans]
