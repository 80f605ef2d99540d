"""``check --cluster``'s answers: questions people ask about a plan that the simulator answers without a new
model, each as an ``info`` finding with the step time (and reserved peak) both ways.

- Reduce in bf16 or fp32? ``MixedPrecisionPolicy.reduce_dtype`` sets the reduce-scatter's bytes (and HSDP's
  all-reduce): bf16 halves them and rounds the sums to bf16, which changes numerics, so only the user chooses it.
- Does HSDP pay on this cluster? The plan's grouping on each HSDP layout auto considers (shard groups of whole
  nodes, ``auto.candidate_meshes``) against pure FSDP over every GPU.
- Does resharding to the node pay? ``reshard_after_forward=<GPUs per node>`` on the groups that reshard fully:
  after forward each keeps its params sharded within the node only, so backward's all-gathers stay on NVLink, for
  more memory.
- Does torch.compile pay? The plan on the step with its repeated blocks compiled as torchtitan compiles them
  (``--compile``), against eager (or the reverse): fused memory-bound kernels and what AOTAutograd saves. Needs
  the other trace, which the caller makes (``compile_answer``).
- Does explicit forward prefetch pay? Only where the host waits in forward (``Event.syncs``: a router reading its
  token counts): FSDP2 issues a group's all-gather from its pre-forward hook, which the host reaches late after a
  wait; each group prefetching the next (``set_modules_to_forward_prefetch``) issues it before the waits.
- Does float8 training pay? torchao's tensorwise float8 Linears with FSDP2's float8 all-gather (``--float8``) on a
  GPU with float8 tensor cores, against bf16 matmuls (or, for a plan that has it, the reverse): faster matmuls and
  half the converted weights' all-gather bytes, for float8's numerics, so only the user chooses it.
"""

from __future__ import annotations

import dataclasses
import itertools

from fsdp_planner.choices import Float8Recipe, ReduceDtype, Target
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.pitfalls import Code, Finding, Severity
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.fsdp2.validity import check_compiled_groups
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.planners.auto import candidate_meshes
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.float8 import converted_linears
from fsdp_planner.sim.options import SimOptions, plan_options, with_reduce_dtype
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.tensor_parallel import dp_cluster
from fsdp_planner.trace.records import Trace

NEGLIGIBLE = 0.01  # a step time difference below this fraction is reported as not worth a change


def answers(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, budget: MemoryBudget) -> list[Finding]:
    """The answers for ``plan`` on ``cluster`` (a question that does not arise there is left out: HSDP and a
    node-sized reshard on one node, explicit forward prefetch where the host never waits); where the plan cannot
    run there, that is the one finding (an error: the other findings had none)."""
    try:
        base = simulate(tr, plan, cluster, options, timeline=False)
    except PlannerError as e:
        return [Finding(Severity.ERROR, Code.DOES_NOT_RUN, f"the plan cannot run on {cluster.name}: {e}",
                        "change the plan as the message says, or make it again with plan --out")]
    found = [_over_budget_finding(base, budget, _all_blocks_checkpointed(tr, plan)),
             _reduce_dtype(tr, plan, cluster, options, base, budget),
             _forward_prefetch(tr, plan, cluster, options, base, budget),
             float8_answer(tr, plan, cluster, options, base, budget)]
    if cluster.world_size > cluster.gpus_per_node:
        found += [_hsdp(tr, plan, cluster, options, base, budget), _reshard_to_node(tr, plan, cluster, options,
                                                                                    base, budget)]
    return [f for f in found if f is not None]


def _all_blocks_checkpointed(tr: Trace, plan: Plan) -> bool:
    """Whether every repeated block is checkpointed in full already: then "checkpoint more" is no advice."""
    blocks = block_instances(tr)
    return bool(blocks) and set(blocks) <= set(plan.activation_checkpointing)


def _over_budget_finding(base: StepReport, budget: MemoryBudget, checkpointed: bool) -> Finding | None:
    """The plan's reserved peak over the budget: an error past the GPU's memory (the step runs out of it), else a
    warning (it leaves less than the headroom); None within it. (The answers below only spoke of it in passing.)
    ``checkpointed``: every block is checkpointed in full already."""
    reserved = base.reserved_memory
    if budget.fits(reserved):
        return None
    past_gpu = reserved > budget.capacity
    fix = "plan it with --policy auto (it fits the budget or says why nothing does), " + (
        "or give each GPU less work (a smaller --batch or --seq, more GPUs)" if checkpointed
        else "or checkpoint more blocks")
    if past_gpu:
        return Finding(Severity.ERROR, Code.OVER_BUDGET, f"the plan reserves {fmt_bytes(reserved)} per rank, more "
                       f"than one {budget.gpu} holds ({fmt_bytes(budget.capacity)}): the step runs out of memory", fix)
    return Finding(Severity.WARNING, Code.OVER_BUDGET, f"the plan reserves {fmt_bytes(reserved)} per rank, "
                   f"{budget.margin(reserved)}", fix)


def _step(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions) -> StepReport | None:
    """An alternative's simulated step; None when it cannot run there (that alternative is not an answer)."""
    try:
        check_compiled_groups(plan, tr.compiled)  # (EP's dispatch or a group inside a compiled block: not modelled)
        return simulate(tr, plan, cluster, options, timeline=False)
    except PlannerError:
        return None


def _versus(base: StepReport, other: StepReport, budget: MemoryBudget) -> str:
    """``other`` against ``base``: step time and reserved peak, and whether it fits the budget."""
    gain = 1 - other.step_time / base.step_time if base.step_time > 0 else 0.0
    speed = f"{abs(gain):.1%} {'faster' if gain >= 0 else 'slower'}"
    over = [name for name, r in (("the change's", other), ("the plan's", base)) if not budget.fits(r.reserved_memory)]
    fits = f"; {' and '.join(over)} over the {fmt_bytes(budget.limit)} budget" if over else ""
    return (f"{fmt_time(other.step_time)} a step against {fmt_time(base.step_time)} ({speed}), reserved "
            f"{fmt_bytes(other.reserved_memory)} against {fmt_bytes(base.reserved_memory)}{fits}")


def _pays(base: StepReport, other: StepReport, budget: MemoryBudget) -> bool:
    return other.step_time < base.step_time * (1 - NEGLIGIBLE) and budget.fits(other.reserved_memory)


def _over_budget(base: StepReport, other: StepReport, budget: MemoryBudget) -> bool:
    """Faster enough to pay, but its peak is over the budget: the reason a fix keeps the plan is then memory."""
    return other.step_time < base.step_time * (1 - NEGLIGIBLE) and not budget.fits(other.reserved_memory)


def _without_fix(base: StepReport, alt: StepReport, budget: MemoryBudget, feature: str, other: str,
                 hint: str = "") -> str:
    """The fix for a plan with ``feature`` against ``alt``, the same plan with ``other`` instead."""
    if alt.step_time >= base.step_time * (1 + NEGLIGIBLE):
        return f"keep {feature}: {other} costs that much"
    if alt.step_time > base.step_time * (1 - NEGLIGIBLE):
        return f"{other} is as fast here: {feature} buys nothing on this job"
    if not budget.fits(alt.reserved_memory) and budget.fits(base.reserved_memory):
        return f"keep {feature}: {other} is faster, but over the {fmt_bytes(budget.limit)} budget"
    return f"drop {feature}: {other} is faster here" + hint


def _reduce_dtype(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                  budget: MemoryBudget) -> Finding | None:
    """The step with grads reduced in the other dtype (fp32 <-> bf16); none for a precision that computes in
    fp32 or casts with autocast (no MixedPrecisionPolicy reduce dtype to choose)."""
    run = plan_options(plan, options)
    precision = run.precision
    if precision.compute_bytes > 2 or precision.autocast:
        return None
    now = ReduceDtype.BF16 if precision.reduce_bytes == 2 else ReduceDtype.FP32
    other = ReduceDtype.FP32 if now is ReduceDtype.BF16 else ReduceDtype.BF16
    swapped = dataclasses.replace(run, precision=with_reduce_dtype(precision, other), reduce_dtype=other)
    alt = _step(tr, dataclasses.replace(plan, reduce_dtype=other.value), cluster, swapped)
    if alt is None:
        return None
    what = f"reducing grads in {other.value} instead of {now.value}: {_versus(base, alt, budget)}"
    if other is ReduceDtype.BF16:
        fix = ("MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) (--reduce-dtype bf16) saves that, and rounds the "
               "summed grads to bf16: check the loss curve" if _pays(base, alt, budget)
               else f"keep fp32: bf16 is faster, but over the {fmt_bytes(budget.limit)} budget"
               if _over_budget(base, alt, budget) else "keep fp32: bf16 saves too little here to be worth its rounding")
    else:
        fix = ("consider fp32 (--reduce-dtype fp32): exact sums for that cost" if alt.step_time <= base.step_time
               * (1 + NEGLIGIBLE) else "bf16 is faster here; keep it if the loss curve matches fp32's")
    return Finding(Severity.INFO, Code.REDUCE_DTYPE_COST, what, fix)


def _hsdp(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
          budget: MemoryBudget) -> Finding | None:
    """The plan's grouping on the best HSDP layout against pure FSDP (or, for an HSDP plan, the reverse); under TP,
    layouts of the data-parallel ranks TP leaves (its groups stay inside a node: ``dp_cluster``)."""
    dp = _data_parallel(plan, cluster)
    now = plan.layout(cluster.world_size)
    layouts = [m for m in candidate_meshes(dp, Target.FSDP2) if m != now]
    on = {m: dataclasses.replace(plan, mesh=None if m == Mesh.flat(dp.world_size) else m) for m in layouts}
    tried = [(m, r) for m in layouts if (r := _step(tr, on[m], cluster, options)) is not None]
    if not tried:
        return None
    mesh, best = min(tried, key=lambda t: (not budget.fits(t[1].reserved_memory), t[1].step_time))
    tp = f" x TP {plan.tp_degree}" if plan.tp_degree > 1 else ""
    what = f"this grouping as HSDP {mesh.describe()}{tp} instead of {now.describe()}{tp}: {_versus(base, best, budget)}"
    if mesh.replicate == 1:
        what = (f"this grouping as pure FSDP ({mesh.describe()}{tp}) instead of HSDP {now.describe()}{tp}: "
                f"{_versus(base, best, budget)}")
    fix = (f"use the {mesh.describe()} layout (--mesh {mesh.describe()}, init_device_mesh(..., "
           f"({mesh.replicate}, {mesh.shard}{', ' + str(plan.tp_degree) if tp else ''}))) "
           if _pays(base, best, budget)
           else f"keep {now.describe()}{tp}: {mesh.describe()}{tp} is faster, but over the "
           f"{fmt_bytes(budget.limit)} budget" if _over_budget(base, best, budget)
           else f"keep {now.describe()}{tp}: no other layout pays on {cluster.name}")
    return Finding(Severity.INFO, Code.HSDP_PAYS, what, fix.strip())


def _data_parallel(plan: Plan, cluster: Cluster) -> Cluster:
    """The cluster as the plan's data-parallel ranks see it: under TP, a node holds gpus_per_node / TP of them."""
    return dp_cluster(cluster, plan.tp_degree) if plan.tp_degree > 1 else cluster


def _forward_prefetch(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                      budget: MemoryBudget) -> Finding | None:
    """Each group used in forward that prefetches nothing explicitly prefetching the next in forward order (FSDP2's
    explicit forward prefetch), where the host waits for the GPU in forward (not for an EP plan, which cannot yet:
    ``expert_groups.check_no_prefetch``)."""
    waits = sum(1 for i in tr.index.host_syncs if not tr.events[i].backward)
    if not waits or plan.expert_parallel is not None:
        return None
    first = {i: min((u for m in g.modules if (u := tr.modules[m].first_use) >= 0), default=-1)
             for i, g in enumerate(plan.groups) if not g.is_root and g.params}
    order = sorted((i for i, u in first.items() if u >= 0), key=first.__getitem__)
    if len(order) < 2:
        return None
    groups = list(plan.groups)
    for i, after in itertools.pairwise(order):
        if not groups[i].forward_prefetch:
            groups[i] = dataclasses.replace(groups[i], forward_prefetch=[after])
    if groups == list(plan.groups):  # each prefetches already
        return None
    alt = _step(tr, dataclasses.replace(plan, groups=groups), cluster, options)
    if alt is None:
        return None
    some = any(g.forward_prefetch for g in plan.groups)
    what = (f"each group {'that prefetches nothing ' if some else ''}prefetching the next in forward (the host waits "
            f"for the GPU {waits:,} times in forward, reading values such as a router's token counts): "
            f"{_versus(base, alt, budget)}")
    fix = (("give each group that has none a forward prefetch of the next" if some else
            "set each group's forward prefetch to the next group") + " (module.set_modules_to_forward_prefetch("
           "[next]), a plan's forward_prefetch): FSDP2 issues an all-gather from the group's pre-forward hook, "
           "which the host reaches only after those waits" if _pays(base, alt, budget) else
           f"keep implicit prefetch: explicit is faster, but over the {fmt_bytes(budget.limit)} budget"
           if _over_budget(base, alt, budget) else "keep implicit prefetch: explicit does not pay here")
    return Finding(Severity.INFO, Code.FORWARD_PREFETCH, what, fix)


def _reshard_to_node(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                     budget: MemoryBudget) -> Finding | None:
    """The groups that reshard fully after forward resharding to the node instead (an int
    ``reshard_after_forward``); only where the node divides the shard group and is smaller than it."""
    node, shard = _data_parallel(plan, cluster).gpus_per_node, plan.shard_size(cluster.world_size)
    if shard <= node or shard % node:
        return None
    # the root's params are resharded after backward only (FSDP2 keeps them)
    groups = [dataclasses.replace(g, reshard_after_forward=node) if g.reshard_after_forward is True else g
              for g in plan.inner_groups]
    changed = dataclasses.replace(plan, groups=[*groups, plan.root])
    if changed.signature() == plan.signature():
        return None
    alt = _step(tr, changed, cluster, options)
    if alt is None:
        return None
    what = f"reshard_after_forward={node} (the node) on the fully resharding groups: {_versus(base, alt, budget)}"
    fix = (f"set reshard_after_forward={node} on those groups: backward's all-gathers stay within the node"
           if _pays(base, alt, budget) else f"keep reshard_after_forward=True: resharding to the node is faster, "
           f"but over the {fmt_bytes(budget.limit)} budget" if _over_budget(base, alt, budget)
           else "keep reshard_after_forward=True: resharding to the node does not pay here")
    return Finding(Severity.INFO, Code.RESHARD_TO_NODE, what, fix)


def float8_answer(tr: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                  budget: MemoryBudget) -> Finding | None:
    """The step with float8 training against the plan's bf16 matmuls, or without it for a float8 plan; none on
    a GPU without float8 tensor cores or a precision that computes in fp32."""
    run = plan_options(plan, options)
    f8 = None if run.float8 is not None else Float8.named(Float8Recipe.TENSORWISE.value)
    alt = _float8_step(tr, plan, cluster, run, f8)
    if alt is None:
        return None
    if f8 is not None:
        what = f"float8 training (--float8 tensorwise, torchao, float8 all-gather): {_versus(base, alt, budget)}"
        fix = ("torchao's convert_to_float8_training (--float8 tensorwise) saves that, with float8's numerics: "
               "check the loss curve" if _pays(base, alt, budget)
               else f"keep bf16: float8 is faster, but over the {fmt_bytes(budget.limit)} budget"
               if _over_budget(base, alt, budget) else "keep bf16: float8 saves too little here"
               if alt.step_time <= base.step_time * (1 + NEGLIGIBLE) else "keep bf16: float8 is slower here")
        # eager torchao runs each cast as several unfused kernels: compiled, they fuse (``compiled_float8_answer``)
        fix += "" if tr.compiled else " (eager: its casts run unfused; plan --explain compares it compiled)"
    elif plan.compiled and not tr.compiled:  # (a trial: plan --compile said keep float8, check of its file drop it)
        what = f"the same plan without float8 training (bf16 matmuls), its blocks traced eager: " \
               f"{_versus(base, alt, budget)}"
        fix = ("check it with --compile, as the plan runs its blocks: float8's casts fuse there and run unfused in "
               "eager, so eager figures say nothing of whether float8 pays in the plan's job")
    else:
        what = f"the same plan without float8 training (bf16 matmuls): {_versus(base, alt, budget)}"
        fix = _without_fix(base, alt, budget, "float8", "bf16",
                           "" if tr.compiled else " (float8's casts run unfused in eager: compare it with --compile)")
    return Finding(Severity.INFO, Code.FLOAT8_PAYS, what, fix)


def _float8_step(tr: Trace, plan: Plan, cluster: Cluster, run: SimOptions, f8: Float8 | None) -> StepReport | None:
    """The plan's step with float8 training ``f8`` (None: without it); None where the question does not arise: a
    GPU without float8 tensor cores, a precision that computes in fp32, no Linear float8 converts (dims multiples
    of 16), or a step that cannot run."""
    if cluster.gpu.peak_fp8_flops <= 0 or run.precision.compute_bytes > 2:
        return None
    if f8 is not None and not converted_linears(tr, f8):
        return None
    return _step(tr, plan.replace(float8=f8), cluster, dataclasses.replace(run, float8=f8))


def compiled_float8_answer(compiled: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                           budget: MemoryBudget) -> Finding | None:
    """An eager bf16 plan against the same plan compiled with float8 training, the two together, as torchtitan
    runs its largest jobs: each alone can pay little (eager float8's casts cost what its matmuls save; compiling
    a matmul-bound step fuses little), together much (Llama 3 405B on h100:512, auto's plan: 2.6% and 3.7%
    alone, 36% together). None for a plan that has either, or where float8 does not apply (``float8_answer``)."""
    run = plan_options(plan, options)
    if run.float8 is not None or not compiled.compiled:
        return None
    alt = _float8_step(compiled, plan, cluster, run, Float8.named(Float8Recipe.TENSORWISE.value))
    alone = _step(compiled, plan, cluster, run)  # compiled, bf16: what float8 must add to
    if alt is None or alone is None:
        return None
    what = f"torch.compile and float8 training together (--compile --float8 tensorwise): {_versus(base, alt, budget)}"
    fix = (f"keep eager bf16: the two are faster, but over the {fmt_bytes(budget.limit)} budget"
           if _over_budget(base, alt, budget) else "keep eager bf16: the two together save too little here"
           if not _pays(base, alt, budget) else "compile alone: float8 adds too little to it here"
           if alt.step_time >= alone.step_time * (1 - NEGLIGIBLE) and budget.fits(alone.reserved_memory)
           else "compile each block and convert its Linears to float8 as torchtitan's largest jobs do, with "
           "float8's numerics: check the loss curve")
    return Finding(Severity.INFO, Code.FLOAT8_PAYS, what, fix)


def compile_answer(other: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                   budget: MemoryBudget) -> Finding | None:
    """The plan's step on ``other``, the same model traced with its blocks compiled (or eager, for a trace that
    compiles them), against ``base``."""
    if other.compiled:
        try:
            check_compiled_groups(plan, other.compiled)
        except PlannerError as e:  # said, not silent: the user would otherwise try --compile on this plan
            return Finding(Severity.INFO, Code.COMPILE_PAYS, "torch.compile of the repeated blocks (what --compile "
                           "runs): not compared for this plan", str(e))
    alt = _step(other, plan, cluster, options)
    if alt is None:
        return None
    if other.compiled:
        what = f"torch.compile of the repeated blocks (--compile, fullgraph): {_versus(base, alt, budget)}"
        fix = ("compile each block as torchtitan does (torch.compile(block, fullgraph=True); --compile records it)"
               if _pays(base, alt, budget) else f"keep eager: compiling is faster, but over the "
               f"{fmt_bytes(budget.limit)} budget" if _over_budget(base, alt, budget)
               else "keep eager: compiling saves too little here"
               if alt.step_time <= base.step_time * (1 + NEGLIGIBLE) else "keep eager: compiling is slower here")
    else:
        what = f"the same plan in eager mode (no torch.compile): {_versus(base, alt, budget)}"
        fix = _without_fix(base, alt, budget, "compiling", "eager")
    return Finding(Severity.INFO, Code.COMPILE_PAYS, what, fix)


# a compiled loss's memory is worth planning for where it frees this much of the plan's reserved peak
LOSS_MEMORY_PAYS = 0.05
# ... and where the plan has a use for it: it spends step time on memory (checkpointing, offloading), or its peak
# holds over this share of the budget (auto would group or prefetch otherwise with the room)
MEMORY_BOUND_SHARE = 0.5


def _memory_spendable(plan: Plan, base: StepReport, budget: MemoryBudget) -> bool:
    """Whether memory freed buys ``plan`` anything: it checkpoints or offloads (time spent on memory auto could take
    back), or its peak is over ``MEMORY_BOUND_SHARE`` of the budget."""
    return bool(plan.activation_checkpointing or plan.selective_checkpointing or plan.activation_offloading
                or plan.offload or base.reserved_memory > MEMORY_BOUND_SHARE * budget.limit)


def _buys_nothing(keep: str, base: StepReport, budget: MemoryBudget, freed: float) -> str:
    """The fix of a change whose only gain is memory the plan cannot spend (``_memory_spendable``)."""
    return (f"{keep}: the {freed:.0%} of the peak it frees buys nothing here (no checkpointing or offloading to "
            f"drop, the peak {fmt_bytes(base.reserved_memory)} of the {fmt_bytes(budget.limit)} budget)")


def compile_loss_answer(other: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                        budget: MemoryBudget) -> Finding | None:
    """The plan's step on ``other``, the same model traced with its loss compiled (or eager, for a trace that
    compiles it), against ``base``. What a compiled loss buys is memory (the logits' fp32 copies): room that auto,
    planning with it, spends on less checkpointing or fewer groups; None where it frees under ``LOSS_MEMORY_PAYS``
    of the peak and is not faster (the loss is not the plan's peak)."""
    alt = _step(other, plan, cluster, options)
    if alt is None:
        return None
    if other.compiled_loss is not None:
        freed = 1 - alt.reserved_memory / base.reserved_memory if base.reserved_memory else 0.0
        if freed < LOSS_MEMORY_PAYS and not _pays(base, alt, budget):
            return None  # (the loss is not the plan's peak: nothing to say)
        what = f"torch.compile of the loss (--compile-loss): {_versus(base, alt, budget)}"
        change = ("compile the loss (loss_fn = torch.compile(loss_fn); torchtitan's compile.components \"loss\") "
                  "and plan with --compile-loss")
        fix = (f"{change}: it is faster" if _pays(base, alt, budget) else
               f"{change}: {freed:.0%} of the peak freed for auto to spend" if _memory_spendable(plan, base, budget)
               else _buys_nothing("keep the loss eager", base, budget, freed))
    else:
        what = f"the same plan with the loss eager (no torch.compile): {_versus(base, alt, budget)}"
        fix = ("keep the loss compiled: eager, the plan is over the budget" if not budget.fits(alt.reserved_memory)
               else _without_fix(base, alt, budget, "the compiled loss", "eager"))
    return Finding(Severity.INFO, Code.COMPILE_LOSS_PAYS, what, fix)


ANSWER_LOSS_CHUNKS = 8  # the chunks ``loss_chunks_answer`` tries: torchtitan's ChunkedLossWrapper's default


def loss_chunks_answer(other: Trace, plan: Plan, cluster: Cluster, options: SimOptions, base: StepReport,
                       budget: MemoryBudget) -> Finding | None:
    """The plan's step on ``other``, the same model traced with its output layer and loss in chunks (or whole,
    for a trace that chunks them), against ``base``. Chunks buy memory (one chunk's logits alive, not the
    sequence's) for a few more launches and, in torchtitan's grouping, two more gathers of the output layer's
    group; None where they free under ``LOSS_MEMORY_PAYS`` of the peak and are not faster."""
    alt = _step(other, plan, cluster, options)
    if alt is None:
        return None
    if other.loss_chunks:
        freed = 1 - alt.reserved_memory / base.reserved_memory if base.reserved_memory else 0.0
        if freed < LOSS_MEMORY_PAYS and not _pays(base, alt, budget):
            return None
        n = other.loss_chunks
        what = f"the loss in {n} chunks (--loss-chunks {n}): {_versus(base, alt, budget)}"
        slower = alt.step_time > base.step_time * (1 + NEGLIGIBLE)
        change = f"run the output layer and the loss in chunks (torchtitan's ChunkedLossWrapper) and plan with " \
            f"--loss-chunks {n}"
        if _pays(base, alt, budget):
            fix = f"{change}: it is faster"
        elif not _memory_spendable(plan, base, budget):
            fix = _buys_nothing("keep the loss whole", base, budget, freed)
        else:
            fix = (f"{change}: {freed:.0%} of the peak freed for auto to spend"
                   + ("; on this plan's groups they cost time (a group of the output layer alone queues FSDP2's "
                      "final callback after each chunk, which drops the model's backward prefetches; one shared "
                      "with the norm is gathered twice more): auto, planning with them, groups around that"
                      if slower else ""))
    else:
        what = f"the same plan with the loss whole (no chunks): {_versus(base, alt, budget)}"
        more = alt.reserved_memory - base.reserved_memory
        fix = ("keep the loss in chunks: whole, the plan is over the budget" if not budget.fits(alt.reserved_memory)
               else f"keep the loss in chunks: whole is as fast here and holds {fmt_bytes(more)} more"
               if abs(alt.step_time / base.step_time - 1) < NEGLIGIBLE and more > 0
               else _without_fix(base, alt, budget, "the chunked loss", "whole"))
    return Finding(Severity.INFO, Code.LOSS_CHUNKS_PAY, what, fix)
