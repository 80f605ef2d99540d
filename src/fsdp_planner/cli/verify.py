"""``fsdp-planner verify MODEL``: train with the plan under torchrun and check it against the prediction."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.apply.expert_parallel import check_model_runs_ep
from fsdp_planner.cli.common import REPORTER, load_trace
from fsdp_planner.cli.requests import (
    FakeWorldRequest,
    PlanSource,
    VerifyRequest,
    fake_world_request,
    verify_request,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_count, json_text
from fsdp_planner.fsdp2.pitfalls import routing_skip_findings
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.models.hf_experts import COMPILED_EP, NO_EP_TP, OTHER_EXPERTS
from fsdp_planner.planners.expert_parallel import DATA_SIZED_EXPERTS, check_dispatch_runs
from fsdp_planner.runtime.measure import CPU_RANK_REPEATS
from fsdp_planner.runtime.verify import VerifyResult, check_model_dtypes, run_verify
from fsdp_planner.service.job_plan import carried_plan, job_plan
from fsdp_planner.service.plan_files import CHUNKS_DIFFER
from fsdp_planner.service.planning import Reporter, judged_model, stamped
from fsdp_planner.service.tracing import routing_skips
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.trace.chunked_loss import output_layer
from fsdp_planner.trace.records import Trace

if TYPE_CHECKING:  # (the fake world imports torch.distributed's testing parts: loaded where it runs)
    from fsdp_planner.runtime.fake_world import FakeWorldResult


def run(args: argparse.Namespace) -> int:
    if args.fake_world_size is not None:
        return run_fake(fake_world_request(args))
    request = verify_request(args)  # every argument checked before the model is traced or auto searches
    if request.model.loss_chunks:
        raise PlannerError("--loss-chunks: the torchrun job trains the model's own loss over the whole sequence, "
                           "for parity with one process; the chunked loss's collectives and memory are checked "
                           "against real FSDP2 on fake ranks: add --fake-world-size N")
    for note in request.notes:
        render.note(note)
    predict_on = _prediction_cluster(request)
    if request.measure and predict_on is None:
        render.note("--measure has no effect without a --cluster of --nproc ranks to predict the step time on")
    elif request.measure and request.options.precision.trace_dtype is not None:
        render.note(f"--measure times the model's ops in its own dtypes, but the job trains in "
                    f"{request.options.precision.name}: add --precision fp32 to predict a job timed like them")
    options = request.options  # the job's precision: the trace's too, so a model failing in it is an error here
    _check_loss_alone(request.model)  # (first: such a loss also fails the dtype check, for the wrong reason)
    check_model_dtypes(request.model, options.precision)  # before the trace's notes, auto's search and torchrun
    model, tr, plan = _the_job(request, predict_on)
    for finding in routing_skip_findings(routing_skips(model, tr)):  # what makes such a job fail parity, said first
        render.note(f"{finding.message} (check's {finding.code.value}; {finding.fix}): the ranks' batches decide "
                    "whether this job's collectives match")
    if not request.json:
        transforms = plan.transforms()
        render.console.print(f"verifying [bold]{escape(str(plan.policy or request.source.plan_file))}[/bold] on "
                             f"{escape(model.name)} with {request.nproc} processes"
                             f"{_tp_label(plan, request.nproc)}"
                             f"{' (FSDP1)' if request.fsdp1 else ''}"
                             f"{escape(f', {transforms}') if transforms else ''}, {request.steps} steps"
                             f"{f' of {request.micro_batches} micro-batches' if request.micro_batches > 1 else ''}"
                             f" in {options.precision.name} ...")
    _note_oversubscribed(request.nproc)
    with render.progress(f"torchrun job: {request.nproc} ranks, {request.steps} steps"):
        result = run_verify(model, tr, plan, request.nproc, request.steps, fsdp1=request.fsdp1,
                            timed_steps=0 if request.fsdp1 else request.time_steps,
                            save_checkpoint=request.save_checkpoint, load_checkpoint=request.load_checkpoint,
                            precision=options.precision, micro_batches=request.micro_batches,
                            reshard_after_backward=request.reshard_after_backward,
                            gradient_sync=options.gradient_sync, profile=request.profile)
    if request.profile is not None:
        render.note(f"torch.profiler traces of each rank written to {request.profile}/rankR.json")
    if predict_on is not None and not request.fsdp1:
        # the timed steps are forward and backward (``worker.time_steps``): so is the prediction
        predicted = simulate(tr, plan, predict_on, options, timeline=False).step_seconds(optimizer=False)
        result = dataclasses.replace(result, predicted_step=predicted)
    _report(result, request, predict_on, plan)
    return 0 if result.ok else 1


def _traced(model: ModelSpec, request: VerifyRequest, predict_on: Cluster | None) -> Trace:
    """The model's trace, its ops timed on this machine with ``--measure`` (one thread a rank on a host cluster)."""
    host = predict_on is not None and predict_on.engine is Engine.HOST
    return load_trace(model, measure=request.measure and predict_on is not None, full=request.full_trace,
                      precision=request.options.precision, threads=1 if host else None,
                      repeats=CPU_RANK_REPEATS if host else 3)


def _the_job(request: VerifyRequest, predict_on: Cluster | None) -> tuple[ModelSpec, Trace, Plan]:
    """The model the ranks train, its trace and the plan they run: the plan file's or the policy's (auto plans in
    the job's precision and micro-batches, as plan would; at the batch it judged its TP layout at), with the run
    options stamped, refused before torchrun where it cannot run."""
    options = request.options
    tr = _traced(request.model, request, predict_on)
    planning = SimOptions(precision=options.precision, micro_batches=request.micro_batches,
                          reshard_after_backward=request.reshard_after_backward, gradient_sync=options.gradient_sync)
    model = request.model
    if request.plan_for:
        plan = _at_scale(tr, request, planning)
    else:
        plan = job_plan(tr, request.source.plan_file, request.source.policy, model, request.plan_cluster, planning,
                        request.nproc, TORCHRUN)
        if plan.loss_chunks:
            render.note(f"the plan runs the loss in {plan.loss_chunks} chunks; the torchrun job trains the model's own "
                        "loss over the whole sequence, for parity with one process, and its counts are predicted "
                        "for that: verify --fake-world-size N --loss-chunks "
                        f"{plan.loss_chunks} checks the chunks against real FSDP2")
            plan = plan.replace(loss_chunks=0)
        if (model := _judged(model, request.source, plan)) is not request.model:
            tr = _traced(model, request, predict_on)
    plan = stamped(plan, tr, request.nproc, options)  # --offload, --shard-placement, --reduce-dtype
    if tr.compiled and not plan.compiled:  # --compile: the ranks compile what the prediction compiled
        plan = plan.replace(compiled=tuple(tr.compiled))
    check_model_runs_ep(model, plan)
    check_dispatch_runs(plan, tr, model)  # real routing: the fake world's stand-in makes no such mismatch
    if request.fsdp1:
        from fsdp_planner.apply.fsdp1 import check_fsdp1

        check_fsdp1(plan, kinds={p.fqn: (p.dtype, p.requires_grad) for p in tr.params})
    return model, tr, plan


def _at_scale(tr: Trace, request: VerifyRequest, options: SimOptions) -> Plan:
    """``--plan-for``: auto's plan for the large cluster (of ``--plan-model`` when given), carried onto the job's
    model and ranks (``planners/at_scale.py``); what did not carry over is noted."""
    cluster, source = request.plan_cluster, request.source
    assert cluster is not None and source.policy is not None
    planned = tr if request.plan_model is None else load_trace(request.plan_model,
                                                                 precision=options.precision)
    name = request.plan_model.name if request.plan_model else request.model.name
    at_scale, plan, notes = carried_plan(planned, tr, source.policy, name, cluster, request.nproc, options,
                                         request.plan_model is not None, REPORTER)
    render.note(f"auto planned {fmt_count(_sharded(at_scale), 'group')} with params for {name} on {cluster.name}; "
                f"the job runs {fmt_count(_sharded(plan), 'group')} of them on {request.nproc} ranks")
    for note in notes:
        render.note(note)
    if request.plan_model is None and _sharded(plan) == 1:
        render.note(f"at {cluster.name} auto gives {name} one group: it is too small for more to pay; "
                    "--plan-model FULL (the same model code at full size, e.g. llama3-8b for toy-llama) proves the "
                    "grouping auto makes for that one")
    return plan


def _judged(model: ModelSpec, source: PlanSource, plan: Plan) -> ModelSpec:
    """The job auto planned: where it chose a TP degree d itself, each data-parallel rank runs d times the per-GPU
    batch (``judged_model``), and that job is the one verified (at the batch given, the ranks would check a job of
    1/d the sequences, whose peak says nothing of the budget auto planned for)."""
    if source.policy is None:
        return model
    judged = judged_model(model, source.policy, plan)
    if judged is not model:
        render.note(f"verifying the job auto planned: TP {plan.tp_degree}, batch {judged.batch_size:,} per "
                    "data-parallel rank")
    return judged


RANKS_PER_CORE = 4  # more CPU ranks a core than this is said (64 on 2 cores ran without a word)


def _check_loss_alone(spec: ModelSpec) -> None:
    """Refuse a factory loss that reads the model it was built with: the ranks draw each micro-batch's inputs and
    loss from a factory call of their own, and the reference is a copy, so such a loss would read another model
    than the one it trains (a new user's CLIP: a dtype error on the ranks; a closure over an auxiliary head: a
    parity that checked nothing)."""
    name = load_model(spec).loss_reads_model()
    if name is not None:
        raise PlannerError(f"the factory's loss_fn reads the model it built (through '{name}'), and the torchrun job "
                           "draws each micro-batch's loss from a factory call of its own: return what the loss "
                           "needs from the model's forward (the loss a function of the outputs alone), or check the "
                           "plan on fake ranks: --fake-world-size N")


def _note_oversubscribed(nproc: int) -> None:
    """Say when CPU ranks far outnumber the cores they share."""
    import os

    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and nproc > RANKS_PER_CORE * cores:
        render.note(f"--nproc {nproc} starts {nproc} CPU ranks on this host's {cores} core{'s' if cores > 1 else ''}: "
                    "they take turns, so the job is slow and its step times say nothing of a GPU's "
                    "(--fake-world-size checks the counts, bytes and peak at any size)")


def _sharded(plan: Plan) -> int:
    """The groups that manage params: an empty root issues no collective."""
    return sum(1 for g in plan.groups if g.params)


def _report(result: VerifyResult, request: VerifyRequest, predict_on: Cluster | None, plan: Plan) -> None:
    """The job's checks on stdout: a JSON document, or the table, FSDP1's units, the job's notes and the verdict."""
    # (a GPU cluster's prediction beside CPU ranks: _prediction_cluster's note says how to compare)
    comparable = not (predict_on is not None and predict_on.engine is Engine.STREAMS and result.backend == "gloo")
    if request.json:
        plan_for = request.plan_cluster.name if request.plan_for and request.plan_cluster else None
        shown = result.to_dict() if comparable else {**result.to_dict(), "step_error": None}
        print(json_text({**shown, "cluster": predict_on.name if predict_on else None,
                         "plan_for": plan_for, "plan_model": request.plan_model.name if request.plan_model else None,
                         "compiled": list(plan.compiled), "compiled_loss": request.model.compile_loss}, indent=2))
        return
    given = request.cluster.name if request.cluster else None  # only whether one was given is read when not used
    render.console.print(render.verify_table(result, predict_on.name if predict_on else given, comparable))
    if result.units is not None:
        differ = sorted(set(result.units) ^ set(result.expected_units or []))
        verdict = "exactly the plan's groups" if result.units_match else f"NOT the plan's groups: {differ}"
        render.plain(f"FSDP1 units: {len(result.units)} wrapped, {verdict}")  # module names
    if request.model.compile_loss:
        render.note("the ranks ran the loss torch.compile'd (--compile-loss), as the prediction holds it")
    for note in result.notes:
        render.plain(f"note: {note}")
    render.console.print("[green]PASS[/green]" if result.ok else "[red]FAIL[/red]")


def _prediction_cluster(request: VerifyRequest) -> Cluster | None:
    """The cluster to predict the job's step time on: the one given, when it has --nproc ranks (auto may plan for
    a larger one). Notes say when there is none, or when its GPUs are not what the job runs on."""
    given = request.cluster
    if given is None:
        return None
    if request.fsdp1:
        render.note("no step time with --fsdp1: the simulator models FSDP2 and the FSDP1 job is not timed")
        return None
    if given.world_size != request.nproc:
        render.note(f"no step-time prediction: --cluster {given.name} has {given.world_size} ranks and the job "
                    f"runs {request.nproc}")
        return None
    import torch

    if given.engine is Engine.STREAMS and not torch.cuda.is_available():
        render.note(f"the step time is predicted for {given.name}'s GPUs and measured on this machine's CPU ranks: "
                    f"not comparable; for CPU ranks run `fsdp-planner calibrate --backend gloo --nproc "
                    f"{request.nproc} --out gloo.json` and pass --cluster gloo.json")
    elif given.engine is Engine.HOST and not request.measure:
        render.note("op times from the roofline of this CPU's matmul rate: add --measure to time them")
    return given


def _fake_world_prediction(tr: Trace, plan: Plan, request: FakeWorldRequest) -> StepReport:
    """What the fake ranks are compared with: the plan's prediction (with CPU offload, the device's share, which
    the fake world counts apart from the offloaded state: ``runtime/fake_world.py``)."""
    if plan.offload:
        render.note("offload: the fake ranks run on this CPU; the storages a GPU rank keeps in host memory (sharded "
                    "params, sharded grads, optimizer state and step) are counted apart, and the rest is compared "
                    "with the device's predicted peak")
    return simulate(tr, plan, request.cluster, request.options, timeline=False)


def _eager(model: ModelSpec, plan: Plan, compiled: int) -> tuple[ModelSpec, Plan]:
    """The job the fake ranks run and are compared with: its compiled modules and loss eager. torch.compile cannot
    run on fake tensors (inductor's kernels read data), so the ranks ran the blocks eager beside a compiled
    prediction (peaks 6-10% apart); FSDP2's and TP's collectives are the same either way. Async TP needs compile:
    off too."""
    what = [fmt_count(compiled, "compiled module")] if compiled else []
    what += ["compiled loss"] if model.compile_loss else []
    render.note(f"the fake ranks run the job's {' and '.join(what)} eager "
                "(torch.compile's kernels cannot run on fake tensors): the collectives are the compiled job's, "
                "the peak is compared with the eager step's prediction (what compile saves and a compiled loss "
                "holds are checked against AOTAutograd's graphs and inductor's allocations in the tests)")
    tp = plan.tensor_parallel
    eager_tp = dataclasses.replace(tp, async_tp=False) if tp is not None and tp.async_tp else tp
    return dataclasses.replace(model, compile=False, compile_loss=False), \
        plan.replace(compiled=(), compiled_loss=False, tensor_parallel=eager_tp)


def _tp_label(plan: Plan, world: int) -> str:
    """How a plan with tensor or expert parallelism lays out the ranks: " (FSDP 2 x TP 2 (SP, loss parallel))",
    " (FSDP 8, experts FSDP 2 x EP 4)", " (HSDP 2x4, experts HSDP 2x2 x EP 2)"; else ""."""
    dp = plan.layout(world)
    fsdp = f"HSDP {dp.describe()}" if dp.replicate > 1 else f"FSDP {dp.shard}"
    if plan.expert_parallel is not None and plan.tensor_parallel is None:
        ep = plan.expert_parallel.degree
        experts = f"HSDP {dp.replicate}x{dp.shard // ep}" if dp.replicate > 1 else f"FSDP {dp.shard // ep}"
        return escape(f" ({fsdp}, experts {experts} x {plan.expert_parallel.describe()})")
    if plan.tensor_parallel is None:
        return ""
    return escape(f" ({fsdp} x {plan.tensor_parallel.describe()})")


def _note_what_runs(note: str) -> None:
    """A planning note, less the ones saying EP of these experts is only simulated: a job refuses them next
    (``check_model_runs_ep``) in the same words."""
    if note not in (NO_EP_TP, OTHER_EXPERTS, DATA_SIZED_EXPERTS, COMPILED_EP):
        render.note(note)


RUNNING = Reporter(_note_what_runs, REPORTER.progress)  # the planning notes of a job that runs


def _note_torchrun(note: str) -> None:
    """``_note_what_runs``, less the plan file's note on its chunks (``_the_job`` says what the job runs)."""
    if not note.startswith(CHUNKS_DIFFER):
        _note_what_runs(note)


TORCHRUN = Reporter(_note_torchrun, REPORTER.progress)  # a torchrun job's: it trains the model's own loss


def run_fake(request: FakeWorldRequest) -> int:
    """Real FSDP2 on ``--fake-world-size`` fake ranks beside the simulator's prediction for that world size."""
    from fsdp_planner.runtime.fake_world import beside_prediction, run_fake_world, slow_note

    for note in request.notes:
        render.note(note)
    world, options, precision = request.world, request.options, request.options.precision.name
    check_model_dtypes(request.model, options.precision)  # before the trace's notes and auto's search
    tr = load_trace(request.model, full=request.full_trace, precision=options.precision)
    source = request.source
    plan = job_plan(tr, source.plan_file, source.policy, request.model, request.cluster, options,
                    world if source.plan_file is not None else None, RUNNING)
    if (model := _judged(request.model, source, plan)) is not request.model:
        tr = load_trace(model, full=request.full_trace, precision=options.precision)
    plan = stamped(plan, tr, world, options)
    if tr.compiled or plan.compiled or model.compile_loss:
        model, plan = _eager(model, plan, len(plan.compiled or tr.compiled))
        tr = load_trace(model, full=request.full_trace, precision=options.precision)
    check_model_runs_ep(model, plan)  # (of the blocks the fake ranks run: eager)
    if (slow := slow_note(len(tr.params), world)) is not None:
        render.note(slow)
    if not request.json:
        render.console.print(f"running [bold]{escape(str(plan.policy or request.source.plan_file))}[/bold] on "
                             f"{escape(model.name)} "
                             f"with real FSDP2 on {world} fake ranks{_tp_label(plan, world)} ({precision}) ...")
    predicted = _fake_world_prediction(tr, plan, request)
    with render.progress(f"real FSDP2 on {world} fake ranks"):
        measured = run_fake_world(model, plan, world, options.precision, zero_grad=options.zero_grad,
                                  micro_batches=options.micro_batches,
                                  reshard_after_backward=options.reshard_after_backward,
                                  gradient_sync=options.gradient_sync, optimizer=options.optimizer,
                                  loss_head=head.module if (head := output_layer(tr)) is not None else None)
    rows = beside_prediction(predicted, measured)
    exact = all(p == m for k, (p, m) in rows.items() if k != "peak_memory")
    error = predicted.peak_memory / measured.peak_memory - 1 if measured.peak_memory else 0.0
    ok = exact and abs(error) <= request.memory_tolerance
    if request.json:
        print(json_text({"world_size": world, "precision": precision, "plan": plan.policy,
                         "micro_batches": options.micro_batches, "gradient_sync": options.gradient_sync.value,
                         "predicted": {k: p for k, (p, _) in rows.items()},
                         "measured": {k: m for k, (_, m) in rows.items()},
                         "predicted_memory_at_peak": predicted.memory_at_peak,
                         "predicted_reserved": predicted.reserved_memory, "counts_and_bytes_exact": exact,
                         "peak_error": error, "memory_tolerance": request.memory_tolerance, "ok": ok,
                         "fsdp2_view_warnings": measured.view_outputs,
                         "dtensor_sequential_reductions": measured.sequential_reductions,
                         "seconds": measured.seconds}, indent=2))
        return 0 if ok else 1
    _print_fake(rows, measured, predicted, options, model)
    render.console.print("[green]PASS[/green]" if ok else "[red]FAIL[/red]")
    return 0 if ok else 1


def _print_fake(rows: dict[str, tuple[int, int]], measured: FakeWorldResult, predicted: StepReport,
                options: SimOptions, model: ModelSpec) -> None:
    """The fake world's counts and peak beside the prediction, and the library warnings it held, each said once."""
    exact = all(p == m for k, (p, m) in rows.items() if k != "peak_memory")
    # (the label's batch is one micro-batch's: said so, or it reads as the --batch given)
    workload = render.workload_label(model.label(), options.micro_batches, options.gradient_sync)
    title = (f"{escape(workload)}: prediction vs real FSDP2 on {measured.world_size} fake ranks "
             f"({measured.seconds:.1f} s)")
    render.console.print(render.fake_world_table(title, rows))
    if measured.view_outputs:
        skipped = "none was, every count above exact" if exact else "see the counts above"
        render.note(f"FSDP2 warned {fmt_count(measured.view_outputs, 'time')} that a module it hooks returned a view "
                    f"(an in-place op on that view would skip its group's pre-backward all-gather): {skipped}")
    if measured.sequential_reductions:
        render.note(f"DTensor warned {fmt_count(measured.sequential_reductions, 'time')} that it reduces a value "
                    "partial over the FSDP and TP dims one mesh dim at a time (torchao's float8 amax of a weight "
                    "sharded over both, as on a GPU): the float8 all-reduces above, one a mesh dim")
    render.console.print(f"peak: bytes allocated per rank; on a GPU the caching allocator would reserve "
                         f"{fmt_bytes(predicted.reserved_memory)} (predicted: the default stream's peak plus the "
                         "all-gather and reduce-scatter streams')")
