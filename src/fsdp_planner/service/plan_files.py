"""A plan file run on a model: read, its params derived for a hand-written one, and checked against the model the
command traced (the same hf_config fields, params that match, a plan FSDP2 can run, forward methods that exist,
tensor parallelism that divides what it shards)."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches, check_same_model, short_list, with_claimed_params
from fsdp_planner.fsdp2.expert_groups import alone_refusal, check_expert_groups
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
from fsdp_planner.fsdp2.validity import check_compiled_groups, check_forward_methods, check_plan_runs
from fsdp_planner.models import BUILTINS, ModelSpec, as_spec, hf, load_model, written_defaults
from fsdp_planner.planners.expert_parallel import check_ep_applies, ep_note, expert_modules
from fsdp_planner.planners.tensor_parallel import check_layout, plan_layout, tp_layout
from fsdp_planner.service.tracing import LOCAL_STYLES, WHOLE_ON_EACH_RANK, check_local_shapes
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.chunked_loss import output_layer, output_tokens
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import shown_json

CHUNKS_DIFFER = "the plan runs the loss in"  # how the note on a plan's chunks the trace lacks begins (a torchrun
# job, which trains the whole loss, says its own instead)


def load_plan(path: str, tr: Trace, model: ModelSpec | str, note: Callable[[str], None],
              world: int | None = None, options: SimOptions | None = None, text: str | None = None) -> Plan:
    """The plan file for the traced ``model``, checked (against ``world`` ranks too, when given) before its notes
    (what its EP leaves out; a plan made for another attention kernel, precision, optimizer or zero_grad than the
    command's ``options``, or another step than their micro-batches of the model's workload on ``world`` ranks); a
    hand-written one (module lists) gets its params derived. ``text``: the plan's JSON held elsewhere (an export's),
    ``path`` naming where."""
    read = Plan.load(path) if text is None else Plan.from_json(text, path)
    plan = checked_on_model(read, path, tr, model, note, world)
    if (said := ep_note(plan, tr, as_spec(model))) is not None:
        note(said)
    asked = as_spec(model).attention or ""
    if plan.attention and plan.attention != asked:
        note(f"the plan was made for --attention {plan.attention} and this command traced "
                    f"{asked or 'the default kernel'}: add --attention {plan.attention} for the figures it was "
                    "planned with")
    if (said := _other_workload(plan, as_spec(model), world, options and options.micro_batches)) is not None:
        note(said)
    for flag, made, runs in (("precision", plan.precision, options and options.precision.name),
                             ("optimizer", plan.optimizer, options and options.optimizer.name),
                             ("zero-grad", plan.zero_grad, options and options.zero_grad.value)):
        if runs and made and made != runs:  # (a command runs what it is told; the plan's is said)
            note(f"the plan was made with --{flag} {made} and this command runs {runs}: add --{flag} {made} for "
                 "the figures it was planned with")
    for said in traced_otherwise(plan, tr):
        note(said)
    return plan


def check_loss_head(plan: Plan, tr: Trace) -> None:
    """The plan's ``loss_head`` (its output layer, for a loss in chunks) is the one the model's step has: a plan
    naming another module was read past, its exports writing the traced one (a trial's hostile plan file)."""
    if not plan.loss_head:
        return
    head = output_layer(tr)
    if head is None or head.module != plan.loss_head:
        found = f"the model's output layer is {head.module}" if head is not None else "the model has none it can find"
        raise PlannerError(f"plan 'loss_head' names {shown_json(plan.loss_head)}, and {found}: give the output layer "
                           "whose logits the loss reads, or drop the key")


def traced_otherwise(plan: Plan, tr: Trace) -> list[str]:
    """Notes on what the plan runs compiled or in chunks that this command traced otherwise: its figures are of
    the trace (``load_plan``, and ``check``'s plan file)."""
    out: list[str] = []
    if plan.compiled and not tr.compiled:
        out.append(f"the plan compiles {len(plan.compiled)} modules and this command traced them eager: add "
                   "--compile for the figures it was planned with")
    elif tr.compiled and set(tr.compiled) != set(plan.compiled):
        out.append(f"--compile traced every repeated block compiled ({len(tr.compiled)} modules) and the plan "
                   f"compiles {len(plan.compiled)}{' of them' if set(plan.compiled) < set(tr.compiled) else ''}: "
                   "these figures are of every block compiled, not of the plan's job")
    if plan.compiled_loss != (tr.compiled_loss is not None):
        out.append("the plan compiles the loss and this command traced it eager: add --compile-loss for the figures "
                   "it was planned with" if plan.compiled_loss else "--compile-loss traced the loss compiled and the "
                   "plan runs it eager: these figures are of the compiled loss, not of the plan's job")
    if plan.loss_chunks != tr.loss_chunks:
        head = output_layer(tr) if plan.loss_chunks else None
        tokens = output_tokens(tr, head) if head is not None else 0
        advice = f"add --loss-chunks {plan.loss_chunks} for the figures it was planned with" if not tokens or \
            tokens % plan.loss_chunks == 0 else f"this workload's {tokens:,} tokens do not split into that many"
        out.append(f"{CHUNKS_DIFFER} {plan.loss_chunks} chunks and this command traced "
                   f"{f'{tr.loss_chunks}' if tr.loss_chunks else 'it whole'}: {advice}" if plan.loss_chunks else
                   f"--loss-chunks traced the loss in {tr.loss_chunks} chunks and the plan runs it whole: these "
                   "figures are of the chunked loss")
    return out


def checked_on_model(read: Plan, path: str, tr: Trace, model: ModelSpec | str,
                     note: Callable[[str], None] = lambda line: None, world: int | None = None) -> Plan:
    """A plan file as read (``path``) checked against the traced ``model`` as ``simulate`` and ``export`` check it:
    the same hf_config fields, the params its groups list those the model has and FSDP2 claims, shard dims the
    params have, TP and EP that apply, a step that reads no sharded param, forward methods that exist, and (given
    ``world``) a layout and int ``reshard_after_forward`` FSDP2 applies on that many ranks. A hand-written plan
    (module lists) is returned with its params derived."""
    check_hf_config(read, as_spec(model), path)  # (as read: a hand-written plan has no fingerprint until derived)
    plan = checked_on_trace(read, tr, note, lambda p: check_plan_tp(p, tr, as_spec(model), note))
    check_plan_methods(plan, model)
    if world is not None:
        check_plan_world_size(plan, world, plan_file=True)
    return plan


def checked_on_trace(read: Plan, tr: Trace, note: Callable[[str], None] = lambda line: None,
                     check_tp: Callable[[Plan], None] | None = None) -> Plan:
    """What of ``checked_on_model`` the trace alone decides (the Python API's ``simulate`` has no model spec):
    the params its groups list those the traced model has and FSDP2 claims (derived for a hand-written plan),
    shard dims the params have, EP that applies, a step that reads no sharded param. ``check_tp``: the TP check,
    which needs the model's spec (a trace alone: checked by the TP view it is simulated on)."""
    check_loss_head(read, tr)
    plan = _titled(with_claimed_params(read, tr))
    if (said := _filtering_nothing(plan, tr)) is not None:  # (before a refusal it may explain)
        note(said)
    check_shard_dims(plan, tr)
    check_same_model(plan, tr)  # (before the TP and EP checks, which read the groups)
    if check_tp is not None:
        check_tp(plan)
    check_plan_ep(plan, tr)
    # the blocks the step compiles: --compile's, and the plan's own, which apply and export compile whatever the
    # command traced (no group, no experts in calls of their own, inside them)
    check_compiled_groups(plan, {*tr.compiled, *plan.compiled})
    check_plan_matches(plan, tr)
    check_plan_runs(tr, plan)
    return plan


def _other_workload(plan: Plan, spec: ModelSpec, world: int | None, micro_batches: int | None) -> str | None:
    """A note where the command runs another step than the plan was made for (its micro-batch, sequence or world):
    the plan's verdict is that step's."""
    w, known = plan.workload, written_defaults(spec)
    if w is None:
        return None
    micro = w.batch // w.micro_batches
    options = f"--batch {w.batch}" + (f" --micro-batches {w.micro_batches}" if w.micro_batches > 1 else "") + \
        (f" --seq {w.seq}" if w.seq else "")
    made = f"batch {w.batch:,}" + (f" ({w.micro_batches} micro-batches of {micro:,})" if w.micro_batches > 1 else "") \
        + (f", seq {w.seq:,}" if w.seq else "") + (f" on {w.ranks:,} ranks" if w.ranks else "")
    seq = known.get("seq_len") if w.seq else 0  # (a plan without one: the factory's sequence, if any, is not known)
    step = (known.get("batch_size"), seq, micro_batches or w.micro_batches)
    elsewhere = f" (this command runs {world:,})" if world is not None and w.ranks and world != w.ranks else ""
    if step != (micro, w.seq, w.micro_batches):
        return f"the plan was made for {made}{elsewhere}: add {options} for the step it was planned for"
    if world is not None and w.ranks and world != w.ranks:
        return f"the plan was made for {made} and this command runs {world:,}: its memory verdict was for " \
            f"{w.ranks:,} ranks' shards"
    return None


_TP_TITLE = re.compile(r", TP \d+(?: \([^)]*\))?")  # ``TensorParallel.describe()`` as ``with_tp`` appends it


def _titled(plan: Plan) -> Plan:
    """The plan with its policy's TP part as its TP is: an edited file (loss parallel off, another degree, TP
    removed) kept the title its maker wrote ("TP 2 (SP, loss parallel)"), which every table then showed."""
    tp = plan.tensor_parallel
    now = f", {tp.describe()}" if tp is not None and tp.degree > 1 else ""
    title = _TP_TITLE.sub(lambda _: now, plan.policy, count=1) if plan.policy else plan.policy
    return plan if title == plan.policy else plan.replace(policy=title)


def _filtering_nothing(plan: Plan, tr: Trace) -> str | None:
    """A note naming the float8 ``filter_fqns`` entries no Linear's name holds (a typo keeps nothing in bf16); the
    default's two names (torchtitan's head and transformers') are never both there and go unsaid."""
    f8 = plan.float8
    idle = f8.filtering_nothing([n for n, m in tr.modules.items() if m.cls == "Linear"]) if f8 is not None else []
    if not idle:
        return None
    return (f"plan float8.filter_fqns {shown_json(idle[:5])} {'is' if len(idle) == 1 else 'are'} in no Linear's "
            "name: filtering nothing (a Linear is kept in bf16 when its name holds an entry, e.g. \"output\")")


def checked_modules(plan: Plan) -> dict[str, nn.Module] | None:
    """``export``'s check of a plan file against the model it names, where that model is data (a built-in, or a
    transformers config built on meta; a Python factory is code, which a plan file does not get to run): every
    module it names exists, and each expert module of its EP is a group of its own. The model's modules, for the
    export's other checks; None where the model was not built (the generated code checks the names when it
    runs)."""
    if not plan.model or not (plan.model in BUILTINS or hf.is_hf(plan.model)):
        return None
    spec = ModelSpec(plan.model, hf_config=tuple(plan.hf_config.items()) if hf.is_hf(plan.model) else ())
    modules = dict(load_model(spec, meta=True).model.named_modules())
    named = {m for g in plan.groups for m in g.modules} | set(plan.activation_checkpointing) | \
        set(plan.selective_checkpointing) | set(plan.compiled) | set(plan.activation_offloading)
    unknown = named - set(modules)
    if unknown:
        raise PlannerError(f"the plan names modules {plan.model} does not have: {short_list(unknown)} (an edited "
                           "plan file, or one made for another model): make it again with plan --out")
    ep = plan.expert_parallel
    if ep is not None and not ep.per_param_mesh and (said := alone_refusal(plan, ep.experts(modules))) is not None:
        raise PlannerError(said)  # (on a per-param mesh the experts one call holds share its second param group)
    return modules


def plan_to_check(path: str, tr: Trace, model: ModelSpec | str, note: Callable[[str], None] = lambda line: None,
                  world: int | None = None, micro_batches: int | None = None) -> Plan:
    """The plan file as ``check`` reads it: params derived for a hand-written one and made for this model (the
    same hf_config fields, forward methods that exist); what FSDP2 would refuse is left for check's findings. A
    plan made for another step than the command's (``micro_batches`` of the model's workload on ``world`` ranks)
    is ``note``d, as ``load_plan`` notes it."""
    read = Plan.load(path)
    check_hf_config(read, as_spec(model), path)  # (as read: a hand-written plan has no fingerprint until derived)
    plan = _titled(with_claimed_params(read, tr))
    if (said := _other_workload(plan, as_spec(model), world, micro_batches)) is not None:
        note(said)
    for said in traced_otherwise(plan, tr):
        note(said)
    check_shard_dims(plan, tr)
    check_plan_tp(plan, tr, as_spec(model), note)  # (the modules not checked on numbers: check said nothing of them)
    check_plan_ep(plan, tr)
    check_plan_methods(plan, model)
    return plan


def check_shard_dims(plan: Plan, tr: Trace) -> None:
    """Each param the plan's ``shard_dims`` names is one of the model's, with the dim it is sharded on (FSDP2's
    ``Shard(dim)`` of a dim the param lacks fails on the ranks)."""
    for name, dim in plan.shard_dims.items():
        if name not in tr.index.param_index:
            raise PlannerError(f"plan 'shard_dims' names {shown_json(name)}, which is not a parameter of the model")
        shape = tr.param(name).shape
        if dim >= len(shape):
            raise PlannerError(f"plan 'shard_dims' shards {name} {list(shape)} on dim {dim}, which it does not have "
                               f"({len(shape)} dims): give a dim below {len(shape)}, or make the plan again with "
                               "--shard-placement auto")


def check_plan_tp(plan: Plan, tr: Trace, model: ModelSpec, note: Callable[[str], None] = lambda line: None) -> None:
    """The plan's tensor parallelism meets the checks ``--tp`` does (``planners/tensor_parallel.py``'s
    ``check_layout``): a degree that divides the model's heads, whole heads of each colwise Linear that feeds a
    fused attention call, every sharded dim and the sequence, and styles torch applies to their modules; a layout
    of colwise and rowwise Linears, beside styles whose modules are whole on each rank (``WHOLE_ON_EACH_RANK``),
    then runs one TP rank's step and its pairs on numbers (``check_local_shapes``: a hand-written attention's view
    into its fixed head count, which no fused call tells, fails there)."""
    tp = plan.tensor_parallel
    if plan.float8 is not None and plan.float8.tp_float8_all_gather and (tp is None or tp.degree == 1):
        raise PlannerError("plan 'float8.tp_float8_all_gather' casts TP's activations to float8 before their "
                           "all-gathers, and the plan has no tensor parallelism: drop it or give the plan a "
                           "'tensor_parallel' of degree 2 or more")
    if tp is None or tp.degree == 1:
        return
    check_layout(tr, plan_layout(tr, tp, model), None, model.workload().get("seq_len"))
    styles = set(tp.layout.values())
    checkable = styles & set(LOCAL_STYLES) and styles <= {*LOCAL_STYLES, *WHOLE_ON_EACH_RANK}
    if checkable and not _transformers_own(tp, tr, model):
        for line in check_local_shapes(model, tp, plan_file=True):  # (the modules not checked on numbers)
            note(line)


def _transformers_own(tp: TensorParallel, tr: Trace, model: ModelSpec) -> bool:
    """Whether ``tp`` is transformers' own plan for an ``hf:`` model as ``--tp`` takes it (what ``plan`` wrote):
    trusted as ``--tp`` trusts it, not run on numbers again (its large blocks would each be a note)."""
    if not hf.is_hf(model.name):
        return False
    try:
        own = tp_layout(tr, tp.degree, model).tp
    except PlannerError:
        return False
    return dict(own.layout) == dict(tp.layout)


def check_plan_ep(plan: Plan, tr: Trace) -> None:
    """The plan's expert parallelism names grouped experts modules only (``expert_modules``: what ``--ep`` finds),
    not a router or a block, whose params EP would split as if stacked by expert, nor experts that select their own
    tokens (``check_ep_applies``); each in a group of its own
    (``check_expert_groups``: FSDP2 shards a group over one mesh, the experts over the EP-reduced one)."""
    ep = plan.expert_parallel
    if ep is None or ep.degree == 1:
        return
    check_ep_applies(tr)
    grouped = set(expert_modules(tr))
    other = [m for m in ep.experts(tr.modules) if m not in grouped]
    if other:
        raise PlannerError(f"the plan's expert parallelism names {shown_json(other[0])}, which is not a grouped "
                           "experts module (a class named ...Experts whose params are stacked on an expert dim): name "
                           "the experts modules only")
    check_expert_groups(plan, tr)


def check_hf_config(plan: Plan, model: ModelSpec, path: str) -> None:
    """The plan was made for the model with the same ``--hf-config`` fields (use_cache changes the step's
    memory, a layer count its groups): else one line with the options that rebuild that model. A hand-written
    plan (no fingerprint) is for any model."""
    if not plan.fingerprint or plan.hf_config == dict(model.hf_config):
        return
    planned = " ".join(f"--hf-config {k}={shown_json(v)}" for k, v in plan.hf_config.items()) or "no --hf-config"
    raise PlannerError(f"plan file '{path}' was made with {planned}; give the same to run it on the same model")


def check_plan_methods(plan: Plan, model: ModelSpec | str) -> None:
    """The plan's ``forward_methods`` are methods of their modules, checked on the model built on meta (as verify
    does): the trace records only the methods the step called, and apply_plan would fail on the ranks."""
    if plan.forward_methods:
        check_forward_methods(plan, load_model(model, meta=True).model)
