"""The one validator of what a user asks the planner for: the API's keywords and the command line's options (once
argparse has read their text) are checked here, by the same code with the same types and ranges, before anything
is traced. A bool is a bool (``offload='false'`` is refused, not read as true); each error is one sentence that
names the setting as its user spells it (``--micro-batches`` on the command line, ``micro_batches`` in Python)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from fsdp_planner.choices import (
    DEFAULT_PRECISION,
    DEFAULT_SAC_POLICY,
    ACMode,
    AttentionKernel,
    ExpertPlacement,
    Float8Recipe,
    GradientSync,
    PolicyName,
    ReduceDtype,
    SacPolicy,
    ShardPlacement,
    Target,
    ZeroGrad,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import MAX_BYTES, cut_short, parse_count, parse_size
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.hardware.cluster import Cluster, parse_cluster, with_cpu_optimizer_rate
from fsdp_planner.limits import (
    MAX_BATCH,
    MAX_EP_DEGREE,
    MAX_LOSS_CHUNKS,
    MAX_NUMEL,
    MAX_SEARCH_EFFORT,
    MAX_SEQ,
    MAX_TOKENS,
    MAX_TP_DEGREE,
    MIN_MFU,
)
from fsdp_planner.models import MAX_ROUTING, MIN_ROUTING, ModelSpec, with_own_batch
from fsdp_planner.models.hf import MAX_OVERRIDES, is_hf
from fsdp_planner.planners.registry import CLASSIC_POLICIES, PolicyRequest
from fsdp_planner.service.job import PlanJob, default_cluster
from fsdp_planner.sim.budget import Headroom, MemoryBudget, parse_headroom
from fsdp_planner.sim.options import SimOptions

SPLIT_AUTO = "auto"  # micro_batches 'auto': auto chooses the split of the batch


class Spelling(Enum):
    """How the user wrote a setting: as a command-line option or as a keyword of ``fsdp_planner.plan``."""

    CLI = "cli"
    API = "api"

    def name_of(self, key: str) -> str:
        return "--" + key.replace("_", "-") if self is Spelling.CLI else key

    def given(self, key: str, value: object) -> str:
        """The setting with a value, as the user writes it: ``--ac op`` or ``ac='op'``, ``--batch 1,024`` or
        ``batch=1024``."""
        if self is Spelling.API:
            return f"{key}={value!r}"
        return f"{self.name_of(key)} {value:,}" if isinstance(value, int) else f"{self.name_of(key)} {value}"


@dataclass(frozen=True)
class Keywords:
    """What the user asked for, unchecked: the API's keywords, or the command line's options as argparse read them
    (the same names; None: not given)."""

    model: object = None
    cluster: object = None
    policy: object = None
    precision: object = DEFAULT_PRECISION
    optimizer: object = None  # None: the default, unless a job config names one
    batch: object = None
    seq: object = None
    ac: object = None
    ac_policy: object = None
    early_stop: object = None  # checkpoint(early_stop=...) (command line: --no-early-stop); None: torch's, True
    mesh: object = None
    tp: object = None  # the TP degree; None: none (auto: chosen)
    tp_key: object = None  # the config key that gave ``tp`` (``--from-torchtitan``), named by its refusals
    loss_parallel: object = None  # None: the layout's default
    async_tp: object = False
    ep: object = None  # the expert-parallel degree; None: none
    ep_placement: object = None  # where FSDP2 shards the experts (``ExpertPlacement``); None: auto chooses, else
    # their blocks' calls
    memory_budget: object = None
    headroom: object = None
    micro_batches: object = None
    offload: object = False
    module_classes: object = None
    min_nonwrapped_numel: object = None
    target_bytes: object = None
    search_effort: object = None
    target: object = None
    reduce_dtype: object = None
    shard_placement: object = None
    attention: object = None
    routing: object = None
    fp32_modules: object = None  # modules kept in fp32 groups (command line: --fp32-modules A,B); None: none
    hf_config: object = None
    compile: object = False  # the repeated blocks torch.compile'd (command line: --compile)
    compile_loss: object = False  # the loss torch.compile'd (command line: --compile-loss)
    loss_chunks: object = None  # the output layer and the loss in chunks (command line: --loss-chunks N); None: whole
    float8: object = None  # float8 training's recipe (command line: --float8); None: none
    float8_all_gather: object = None  # with float8: FSDP2's float8 all-gather (None: the recipe's default)
    float8_skip: object = None  # with float8: Linears left in bf16 besides the output head (--float8-skip A,B)
    float8_tp_all_gather: object = None  # with float8 tensorwise and TP: torchao's float8 TP styles (None: off, or
    # a torchtitan TOML's reading)
    gradient_sync: object = None
    mfu: object = None
    zero_grad: object = ZeroGrad.NONE.value
    reshard_after_backward: object = True
    full_trace: object = False
    measure: object = False
    cpu_optimizer_rate: object = None  # the host's optimizer rate (command line: --cpu-optimizer-rate)
    inputs_batch: bool = False  # the API's nn.Module: its example inputs are one micro-batch, so micro_batches N
    # needs no batch to divide (the step runs N of them)

    @classmethod
    def of(cls, values: Any) -> Keywords:
        """The keywords an object carries as attributes of the same names (an argparse Namespace; read only)."""
        return cls(**{f.name: getattr(values, f.name, f.default) for f in fields(cls)})


def _bad(spell: Spelling, key: str, expected: str, value: object) -> PlannerError:
    return PlannerError(f"{spell.name_of(key)} must be {expected}, got {cut_short(repr(value))}")


def flag(value: object, key: str, spell: Spelling) -> bool:
    """A bool, and only a bool: ``'false'`` and ``2`` are no answers to a yes-or-no setting."""
    if not isinstance(value, bool):
        raise _bad(spell, key, "True or False (a bool)", value)
    return value


def whole(value: object, key: str, spell: Spelling, low: int = 1, high: int | None = None) -> int:
    """A whole number (an int, never a bool) from ``low`` to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(spell, key, "a whole number", value)
    if value < low or (high is not None and value > high):
        upper = f" to {high:,}" if high is not None else " or more"
        raise PlannerError(f"{spell.name_of(key)} must be from {low}{upper}, got {cut_short(repr(value))}")
    return value


def text(value: object, key: str, spell: Spelling) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(spell, key, "a non-empty string", value)
    return value


def choice(kind: type[Enum], value: object, key: str, spell: Spelling) -> Any:
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(str(m.value) for m in kind)
        raise _bad(spell, key, f"one of {names}", value) from None


def number(value: object, key: str, spell: Spelling, low: float, high: float, expected: str) -> float:
    """A real number (int or float, never a bool) from ``low`` to ``high`` (NaN is none); ``expected`` says so."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _bad(spell, key, expected, value)
    return value


def _count(value: object, key: str, spell: Spelling) -> int:
    """A whole number given as an int or written as text (``1e8``)."""
    if isinstance(value, str):
        return parse_count(value, spell.name_of(key))
    return whole(value, key, spell, 0)


def _size(value: object, key: str, spell: Spelling) -> int:
    """Bytes given as an int or written as a size (``60GiB``)."""
    if isinstance(value, str):
        return parse_size(value, spell.name_of(key))
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(spell, key, "bytes (an int) or a size such as '60GiB'", value)
    if value > MAX_BYTES:  # (as a size written out is bounded: parse_size)
        raise PlannerError(f"{spell.name_of(key)} {value:,} is too large: at most 1 EiB (2^60 bytes)")
    return value


def module_classes(value: object, spell: Spelling) -> tuple[str, ...]:
    """Class names, comma-separated text or a sequence of names, each once (the policy's label names them)."""
    return _names(value, spell, "module_classes", "class", "TransformerBlock,Embedding")


def fp32_modules(value: object, spell: Spelling) -> tuple[str, ...]:
    """Module names, comma-separated text or a sequence of names, each once (which modules exist is the trace's
    to check)."""
    return _names(value, spell, "fp32_modules", "module", "layers.0.moe.router")


def _names(value: object, spell: Spelling, key: str, what: str, example: str) -> tuple[str, ...]:
    """Comma-separated text or a sequence of ``what`` names, stripped, each once; () for None."""
    if value is None:
        return ()
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise _bad(spell, key, f"{what} names (a string or a tuple of strings)", value)
    out = tuple(dict.fromkeys(n.strip() for n in names if n.strip()))
    if not out:
        raise PlannerError(f"{spell.name_of(key)} {cut_short(repr(value))} names no {what}: give "
                           f"comma-separated {what} names such as {example}")
    return out


def headroom(kw: Keywords, spell: Spelling) -> Headroom | None:
    """The headroom, read; refused beside a memory budget, which is a budget taken as given."""
    if kw.headroom is None:
        return None
    if kw.memory_budget is not None:
        raise PlannerError(f"give {spell.name_of('memory_budget')} or {spell.name_of('headroom')}, not both: an "
                           "explicit budget is taken as given, no headroom taken off it")
    if isinstance(kw.headroom, bool) or not isinstance(kw.headroom, int | float | str):
        raise _bad(spell, "headroom", "a fraction (0.05, '5%') or a size ('4GiB')", kw.headroom)
    return parse_headroom(str(kw.headroom), spell.name_of("headroom"))


def _check_ac_policy(kw: Keywords, policy: PolicyName, spell: Spelling) -> None:
    """An op-level save list is given where op-level checkpointing runs: ``--ac op``, or auto without ``--ac``,
    which chooses each block's checkpointing, op-level among its choices (a trial found it refused there)."""
    if kw.ac_policy is not None and kw.ac != ACMode.OP.value and not (policy is PolicyName.AUTO and kw.ac is None):
        raise PlannerError(f"{spell.name_of('ac_policy')} chooses what op-level checkpointing saves: give it with "
                           f"{spell.given('ac', ACMode.OP.value)}, or to the auto policy without "
                           f"{spell.name_of('ac')} (its op-level blocks then save so)")


def policy_request(kw: Keywords, name: object, spell: Spelling) -> PolicyRequest:
    """The request for one policy, with only the settings that policy reads (the others are checked all the same,
    and the command line notes them as ignored)."""
    policy = PolicyRequest.named(text(name, "policy", spell)).name
    _check_ac_policy(kw, policy, spell)
    classes = module_classes(kw.module_classes, spell)
    numel = _count(kw.min_nonwrapped_numel, "min_nonwrapped_numel", spell) \
        if kw.min_nonwrapped_numel is not None else None
    if numel is not None and numel > MAX_NUMEL:
        raise PlannerError(f"{spell.name_of('min_nonwrapped_numel')} must be at most {MAX_NUMEL:,} parameters, got "
                           f"{cut_short(str(kw.min_nonwrapped_numel))}")
    target_bytes = _size(kw.target_bytes, "target_bytes", spell) if kw.target_bytes is not None else None
    budget = _size(kw.memory_budget, "memory_budget", spell) if kw.memory_budget is not None else None
    room = headroom(kw, spell)
    effort = whole(kw.search_effort, "search_effort", spell, 0, MAX_SEARCH_EFFORT) \
        if kw.search_effort is not None else None
    auto = policy is PolicyName.AUTO
    for key, size, used in (("target_bytes", target_bytes, policy is PolicyName.ORDER),
                            ("memory_budget", budget, auto)):
        if used and size is not None and size < 1:  # (in the caller's spelling; an ignored one is only noted)
            raise _bad(spell, key, "positive", getattr(kw, key))
    return PolicyRequest(
        policy,
        module_classes=classes if policy in (PolicyName.MODULE, PolicyName.TITAN) else (),
        min_nonwrapped_numel=numel if policy is PolicyName.SIZE else None,
        target_bytes=target_bytes if policy is PolicyName.ORDER else None,
        memory_budget=budget if auto else None, headroom=room if auto else None,
        search_effort=effort if auto else None, keeps_placement=kw.shard_placement is not None,
        target=choice(Target, kw.target, "target", spell) if kw.target is not None and auto else Target.FSDP2,
        checkpointing=choice(ACMode, kw.ac, "ac", spell) if kw.ac is not None else None,
        sac_policy=choice(SacPolicy, kw.ac_policy, "ac_policy", spell) if kw.ac_policy is not None
        else DEFAULT_SAC_POLICY,
        mesh=Mesh.parse(text(kw.mesh, "mesh", spell)) if kw.mesh is not None else None,
        **tensor_parallel(kw, spell, auto))


def tensor_parallel(kw: Keywords, spell: Spelling, auto: bool = True) -> dict[str, Any]:
    """``PolicyRequest``'s TP settings: the degree (None: none, or auto's choice), loss parallel (None: the layout's
    default) and async TP; the last two only where TP may run (a degree given, or ``auto`` to choose one)."""
    degree = whole(kw.tp, "tp", spell, 1, MAX_TP_DEGREE) if kw.tp is not None else None
    loss = flag(kw.loss_parallel, "loss_parallel", spell) if kw.loss_parallel is not None else None
    async_tp = flag(kw.async_tp, "async_tp", spell)
    if (degree == 1 or (degree is None and not auto)) and (loss or async_tp):
        on = spell.name_of("async_tp" if async_tp else "loss_parallel")
        raise PlannerError(f"{on} is a setting of tensor parallelism: give {spell.name_of('tp')} 2 or more"
                           + ("" if degree == 1 else " (or the auto policy, which chooses the degree)"))
    if async_tp and not flag(kw.compile, "compile", spell):  # torchtitan raises without it (configs/job_config.py)
        raise PlannerError(f"{spell.name_of('async_tp')} overlaps TP's collectives with the matmuls in compiled code, "
                           f"which torchtitan refuses without compile: add {spell.name_of('compile')}")
    ep = whole(kw.ep, "ep", spell, 1, MAX_EP_DEGREE) if kw.ep is not None else None
    placement = choice(ExpertPlacement, kw.ep_placement, "ep_placement", spell) if kw.ep_placement is not None \
        else None
    if placement is not None and (ep == 1 or (ep is None and not auto)):
        raise PlannerError(f"{spell.name_of('ep_placement')} says where FSDP2 shards the experts of expert "
                           f"parallelism: give {spell.name_of('ep')} 2 or more" +
                           ("" if ep == 1 else " (or the auto policy, which chooses the degree)"))
    return {"tp": degree, "loss_parallel": loss, "async_tp": async_tp, "ep": ep, "ep_placement": placement,
            "tp_key": kw.tp_key if isinstance(kw.tp_key, str) else "tp" if spell is Spelling.API else ""}


def memory_budget(kw: Keywords, cluster: Cluster, spell: Spelling) -> MemoryBudget:
    """What every fits verdict compares a plan's reserved peak with: the memory budget as given, else one GPU of
    ``cluster`` less the headroom."""
    gpu = cluster.gpu
    if kw.memory_budget is not None:
        budget = _size(kw.memory_budget, "memory_budget", spell)
        if budget < 1:  # where a budget is used (an ignored one is only noted)
            raise _bad(spell, "memory_budget", "positive", kw.memory_budget)
        return MemoryBudget.explicit(budget, gpu.memory_bytes, gpu.name)
    return MemoryBudget.of_gpu(gpu.memory_bytes, gpu.name, headroom(kw, spell))


def is_split(kw: Keywords) -> bool:
    """``micro_batches='auto'``: auto's choice of the split of the batch."""
    return splits(kw.micro_batches)


def splits(micro_batches: object) -> bool:
    """Whether a ``micro_batches`` value is 'auto' (``is_split``), any case, spaces around it."""
    return isinstance(micro_batches, str) and micro_batches.strip().lower() == SPLIT_AUTO


def micro_batches(kw: Keywords, spell: Spelling, auto: bool = False) -> int:
    """The micro-batches a step is split into: a whole number dividing the batch, which it needs (1 when not
    given). ``auto``: 1 for 'auto' (the whole batch, before auto splits it), else that is refused."""
    given = kw.micro_batches
    if given is None:
        return 1
    if is_split(kw):
        if not auto:
            raise PlannerError(f"{spell.given('micro_batches', SPLIT_AUTO)} is plan {spell.given('policy', 'auto')}'s "
                               "choice of the split: give a number here")
        return 1
    n = parse_count(given, spell.name_of("micro_batches")) if isinstance(given, str) else given
    n = whole(n, "micro_batches", spell, 1, MAX_BATCH)
    batch = workload_int(kw.batch, "batch", spell, MAX_BATCH)
    if n > 1 and batch is None and not kw.inputs_batch:
        raise PlannerError(f"{spell.given('micro_batches', n)} splits {spell.name_of('batch')}, the per-GPU "
                           f"batch of the step: give {spell.name_of('batch')}, a multiple of {n}")
    if n > 1 and batch is not None and batch % n:
        raise PlannerError(f"{spell.given('micro_batches', n)} must divide {spell.given('batch', batch)} "
                           f"(each micro-batch is {spell.name_of('batch')} / N)")
    return n


def workload_int(value: object, key: str, spell: Spelling, high: int) -> int | None:
    return None if value is None else whole(value, key, spell, 1, high)


def hf_config(value: object, spell: Spelling) -> tuple[tuple[str, Any], ...]:
    """Config fields of an ``hf:`` model: a dict of JSON scalars keyed by field name."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise _bad(spell, "hf_config", "a dict of config fields by name", value)
    if len(value) > MAX_OVERRIDES:
        raise PlannerError(f"{spell.name_of('hf_config')}: at most {MAX_OVERRIDES} fields, got {len(value)}")
    bad = [k for k, v in value.items() if v is not None and not isinstance(v, bool | int | float | str)]
    if bad:
        raise PlannerError(f"{spell.name_of('hf_config')} values must be JSON scalars (bool, number, string or "
                           f"None): {cut_short(repr(bad[0]))} is not")
    return tuple(value.items())


def model_spec(kw: Keywords, spell: Spelling, name: str | None = None) -> ModelSpec:
    """The model and the workload the job runs: with N micro-batches, one micro-batch's (batch / N). ``name``: the
    model's name when ``kw.model`` is no MODEL spec (an ``nn.Module``)."""
    batch = workload_int(kw.batch, "batch", spell, MAX_BATCH)
    seq = workload_int(kw.seq, "seq", spell, MAX_SEQ)
    if batch is not None and seq is not None and batch * seq > MAX_TOKENS:
        raise PlannerError(f"{spell.name_of('batch')} {batch:,} x {spell.name_of('seq')} {seq:,} is {batch * seq:,} "
                           f"tokens per rank; at most {MAX_TOKENS:,} are supported")
    n = micro_batches(kw, spell, auto=True)
    attention = choice(AttentionKernel, kw.attention, "attention", spell).value if kw.attention is not None else None
    routing = number(kw.routing, "routing", spell, MIN_ROUTING, MAX_ROUTING,
                     f"a capacity factor from {MIN_ROUTING} to {MAX_ROUTING:g}") \
        if kw.routing is not None else None
    fields = hf_config(kw.hf_config, spell)
    model = name or text(kw.model, "model", spell)
    if fields and not is_hf(model):  # (said in the caller's spelling: ModelSpec says --hf-config)
        raise PlannerError(f"{spell.name_of('hf_config')} sets fields of a Hugging Face config: it applies to hf: "
                           f"models, not {cut_short(repr(model))}")
    return ModelSpec(model, batch // n if batch is not None else None, seq, attention, routing, fields,
                     flag(kw.compile, "compile", spell),
                     fp32_modules(kw.fp32_modules, spell), flag(kw.compile_loss, "compile_loss", spell),
                     whole(kw.loss_chunks, "loss_chunks", spell, 2, MAX_LOSS_CHUNKS) if kw.loss_chunks is not None
                     else 0)


def _needs_micro_batches(kw: Keywords, spell: Spelling) -> None:
    """Settings of how micro-batches run need micro-batches (and, with a chunked loss, its wrapper's
    ``set_reshard_after_backward(True)`` on the output layer after its chunks overrides keeping it gathered)."""
    if kw.loss_chunks is not None and not flag(kw.reshard_after_backward, "reshard_after_backward", spell):
        kept = "--no-reshard-after-backward" if spell is Spelling.CLI else "reshard_after_backward=False"
        raise PlannerError(f"{kept} with {spell.name_of('loss_chunks')}: torchtitan's ChunkedLossWrapper sets its "
                           "output layer's group to reshard after backward when its chunks are done, whatever the "
                           "job set: plan the micro-batches resharding after backward")
    if not flag(kw.reshard_after_backward, "reshard_after_backward", spell) and kw.micro_batches is None:
        kept = "--no-reshard-after-backward" if spell is Spelling.CLI else "reshard_after_backward=False"
        raise PlannerError(f"{kept} keeps params gathered between micro-batches: add "
                           f"{spell.name_of('micro_batches')} N")
    if kw.gradient_sync is not None and kw.micro_batches is None:
        raise PlannerError(f"{spell.given('gradient_sync', str(kw.gradient_sync))} says which micro-batches "
                           f"reduce-scatter: add {spell.name_of('micro_batches')} N")


def gradient_sync(kw: Keywords, spell: Spelling) -> GradientSync:
    """How micro-batches sync (default: the last one reduce-scatters; with a chunked loss each one, as torchtitan
    runs them: its ``ChunkedLossWrapper`` turns the output layer's sync back on at its last chunk, so the layer's
    group reduce-scatters in every micro-batch whatever the model was set to), and that the job has micro-batches
    when a setting of how they run is given."""
    _needs_micro_batches(kw, spell)
    if kw.gradient_sync is None:
        return GradientSync.EVERY if kw.loss_chunks is not None else GradientSync.LAST
    sync = choice(GradientSync, kw.gradient_sync, "gradient_sync", spell)
    if sync is GradientSync.LAST and kw.loss_chunks is not None:
        raise PlannerError(f"{spell.given('gradient_sync', str(kw.gradient_sync))} with "
                           f"{spell.name_of('loss_chunks')}: torchtitan's ChunkedLossWrapper turns the output "
                           "layer's gradient sync back on at its last chunk, so its group reduce-scatters in every "
                           "micro-batch: give every (the default with a chunked loss)")
    return sync


def float8(kw: Keywords, spell: Spelling) -> Float8 | None:
    """Float8 training: the recipe, and FSDP2's float8 all-gather where the recipe allows it (``Float8.named``)."""
    gather = flag(kw.float8_all_gather, "float8_all_gather", spell) if kw.float8_all_gather is not None else None
    if kw.float8 is None:
        if kw.float8_skip is not None:
            raise PlannerError(f"{spell.name_of('float8_skip')} names Linears float8 training leaves in bf16: give "
                               f"{spell.name_of('float8')} tensorwise or rowwise too")
        if kw.float8_tp_all_gather is not None:
            given = spell.given("float8_tp_all_gather", kw.float8_tp_all_gather) if spell is Spelling.API \
                else "--float8-tp-all-gather" if kw.float8_tp_all_gather else "--no-float8-tp-all-gather"
            raise PlannerError(f"{given} is a setting of float8 training: give {spell.name_of('float8')} tensorwise "
                               "too")
        if gather is not None:
            given = "--no-float8-all-gather" if spell is Spelling.CLI else spell.given("float8_all_gather", gather)
            raise PlannerError(f"{given} is a setting of float8 training: give {spell.name_of('float8')} tensorwise "
                               "too")
        return None
    recipe = choice(Float8Recipe, kw.float8, "float8", spell)
    if gather is False and recipe is not Float8Recipe.TENSORWISE and spell is Spelling.CLI:  # (a file may spell
        # torchtitan's default out)
        raise PlannerError(f"--no-float8-all-gather changes nothing with --float8 {recipe.value}: that recipe "
                           "all-gathers its weights in bf16 anyway; leave the flag out")
    if gather and recipe is not Float8Recipe.TENSORWISE:
        raise PlannerError(f"{spell.given('float8', recipe.value)} all-gathers its weights in bf16: torchao's FSDP2 "
                           "float8 all-gather is for tensorwise scaling only")
    return Float8.named(recipe.value, gather, _float8_tp(kw, spell, recipe),
                        _names(kw.float8_skip, spell, "float8_skip", "Linear", "lm_out"))


def _float8_tp(kw: Keywords, spell: Spelling, recipe: Float8Recipe) -> bool:
    """``--float8-tp-all-gather``: TP's activation all-gathers in float8, with tensorwise float8 and TP only."""
    if kw.float8_tp_all_gather is None or not flag(kw.float8_tp_all_gather, "float8_tp_all_gather", spell):
        return False
    on = spell.name_of("float8_tp_all_gather")
    if recipe is not Float8Recipe.TENSORWISE:
        raise PlannerError(f"{on} needs {spell.given('float8', 'tensorwise')}: torchao's float8 TP styles assume "
                           f"tensorwise scaling (torchtitan ran rowwise recipes with bf16 TP)")
    if kw.tp == 1 or (kw.tp is None and kw.policy != PolicyName.AUTO.value):
        raise PlannerError(f"{on} casts TP's activations to float8 before their all-gathers: give "
                           f"{spell.name_of('tp')} 2 or more" + ("" if kw.tp == 1 else
                                                               " (or the auto policy, which chooses the degree)"))
    return True


def memory_options(kw: Keywords, spell: Spelling) -> dict[str, Any]:
    """FSDP2's memory options (``SimOptions.named``'s keywords): CPU offload, shard placement, reduce dtype; and
    float8 training, whose all-gather is FSDP2's."""
    return {"float8": float8(kw, spell), "offload": flag(kw.offload, "offload", spell),
            "shard_placement": choice(ShardPlacement, kw.shard_placement or ShardPlacement.DIM0.value,
                                      "shard_placement", spell).value,
            "reduce_dtype": choice(ReduceDtype, kw.reduce_dtype, "reduce_dtype", spell).value
            if kw.reduce_dtype is not None else None}


def sim_options(kw: Keywords, spell: Spelling) -> SimOptions:
    """The step's options: precision, optimizer, op times, micro-batches and FSDP2's memory options."""
    mfu = number(kw.mfu, "mfu", spell, MIN_MFU, 1,
                 f"from {MIN_MFU} to 1 (the fraction of peak FLOP/s matmuls reach)") if kw.mfu is not None else None
    if mfu is not None and flag(kw.measure, "measure", spell):  # measured op times replace the roofline whole
        raise PlannerError(f"{spell.name_of('mfu')} and {spell.name_of('measure')} both set the op times: give "
                           f"{spell.name_of('mfu')} (every op at that fraction of peak) or "
                           f"{spell.name_of('measure')} (the ops timed on this machine), not both")
    sync = gradient_sync(kw, spell)
    optimizer = None if kw.optimizer is None else text(kw.optimizer, "optimizer", spell)
    options = SimOptions.named(text(kw.precision, "precision", spell), optimizer, mfu,
                               choice(ZeroGrad, kw.zero_grad, "zero_grad", spell).value,
                               micro_batches(kw, spell, auto=True), kw.reshard_after_backward,  # type: ignore[arg-type]
                               gradient_sync=sync.value, **memory_options(kw, spell),
                               early_stop=True if kw.early_stop is None else flag(kw.early_stop, "early_stop", spell))
    if options.float8 is not None and options.float8.tp_float8_all_gather and options.precision.compute_bytes != 2:
        raise PlannerError(f"{spell.name_of('float8_tp_all_gather')} is modelled with a 16-bit compute dtype (its "
                           f"float8 all-gathers move half the bytes), as torchtitan's float8 jobs run: not with "
                           f"{spell.given('precision', options.precision.name)}")
    return options


def cluster(value: object, spell: Spelling, rate: object = None) -> Cluster | None:
    """The cluster ``value`` names, with the host's CPU optimizer rate when one is given."""
    if value is None or isinstance(value, Cluster):
        return value
    if not isinstance(value, str) or not value.strip():
        raise _bad(spell, "cluster", "a Cluster or a non-empty string (a preset such as 'h100:8', or a cluster JSON "
                   "path)" if spell is Spelling.API else "a non-empty string", value)
    return named(value, rate, spell)


def named(spec: str, rate: object, spell: Spelling) -> Cluster:
    """The cluster ``spec`` names; ``rate`` is checked where every cluster figure is (``hardware/cluster.py``)."""
    return with_cpu_optimizer_rate(parse_cluster(spec), rate, f"given with {spell.name_of('cpu_optimizer_rate')}")


def _splits_by_default(kw: Keywords, spell: Spelling) -> bool:
    """Auto alone, a whole batch of more than one and no split given: auto compares splits of the batch too."""
    if kw.policy != PolicyName.AUTO.value or kw.micro_batches is not None:
        return False
    batch = workload_int(kw.batch, "batch", spell, MAX_BATCH)
    return batch is not None and batch > 1


def _check_ep_ranks(policy: PolicyRequest, cluster: Cluster, spell: Spelling) -> None:
    """An EP degree no layout of the cluster's data-parallel ranks takes, refused once, before any policy: the
    comparison left every classic policy out with a note on all the ranks, then auto failed on its HSDP layout's
    shard ranks, another count (a new user's finding)."""
    ep, tp = policy.ep or 1, policy.tp or 1
    if ep == 1 or ep % tp or cluster.world_size % tp:
        return  # (other errors: EP not a multiple of TP, TP not dividing the GPUs)
    dp = cluster.world_size // tp
    if dp % (ep // tp):
        divisors = [str(d * tp) for d in range(2, dp + 1) if dp % d == 0][:8]
        raise PlannerError(f"{spell.given('ep', ep)} does not divide the {dp:,} data-parallel ranks of "
                           f"{cluster.name} (EP's ranks come out of them{' x TP' if tp > 1 else ''}): choose one of "
                           f"{', '.join(divisors)}{' ...' if len(divisors) == 8 else ''} that divides the model's "
                           "routed experts too")


def _check_float8_target(options: SimOptions, policies: list[PolicyRequest], spell: Spelling) -> None:
    """Refuse FSDP2's float8 all-gather under an FSDP1 target (it was planned so: a trial); torchao's float8 Linears
    themselves run under FSDP1."""
    if options.float8 is not None and options.float8.fsdp_float8_all_gather and \
            any(p.target is Target.FSDP1 for p in policies):
        off = "float8_all_gather=False" if spell is Spelling.API else "--no-float8-all-gather"
        raise PlannerError(f"{spell.name_of('float8')} {options.float8.recipe.value} all-gathers its weights in "
                           "float8 through FSDP2's fully_shard (torchao's float8 all-gather), which FSDP1 does not "
                           f"run: turn it off ({off}), or leave {spell.name_of('target')} fsdp1 out")


def plan_job(kw: Keywords, spell: Spelling, name: str | None = None, explain: bool = False,
             split_by_default: bool = False) -> PlanJob:
    """The job ``plan`` runs: ``kw.policy``'s plan (None: the classic policies side by side, and auto's with a
    cluster). Auto without a cluster plans for the default one. ``name``: the model's name when ``kw.model`` is no
    MODEL spec (an ``nn.Module``). ``split_by_default``: auto alone with a ``batch`` of more than one and no
    ``micro_batches`` also compares splits of it (the few smallest: ``DEFAULT_SPLITS``), as ``plan`` and the API
    do; a job from a config keeps the config's split."""
    for key in ("offload", "full_trace", "measure"):
        flag(getattr(kw, key), key, spell)
    if kw.policy is not None:
        text(kw.policy, "policy", spell)
    split = is_split(kw)
    by_default = split_by_default and not split and _splits_by_default(kw, spell)
    split = split or by_default
    if split and (kw.policy != PolicyName.AUTO.value or kw.batch is None):
        workload_int(kw.batch, "batch", spell, MAX_BATCH)
        missing = [x for x, absent in ((spell.given('policy', 'auto'), kw.policy != PolicyName.AUTO.value),
                                       (spell.name_of('batch'), kw.batch is None)) if absent]
        raise PlannerError(f"{spell.given('micro_batches', SPLIT_AUTO)} lets {spell.given('policy', 'auto')} split "
                           f"{spell.name_of('batch')}, the per-GPU batch of the step: add {' and '.join(missing)}")
    names = [PolicyRequest.named(kw.policy).name] if kw.policy is not None else list(CLASSIC_POLICIES)
    policies = [policy_request(kw, n.value, spell) for n in names]
    the_cluster = cluster(kw.cluster, spell, kw.cpu_optimizer_rate)
    options, model = sim_options(kw, spell), model_spec(kw, spell, name)
    default = None
    if names == [PolicyName.AUTO] and the_cluster is None:
        default = default_cluster(policies[0].mesh.size * (policies[0].tp or 1) if policies[0].mesh else None)
        the_cluster = named(default, kw.cpu_optimizer_rate, spell)
    if kw.policy is None and the_cluster is not None:
        policies.append(policy_request(kw, PolicyName.AUTO.value, spell))
    if name is None and any(p.name is PolicyName.AUTO for p in policies):  # (auto's TP screen needs the batch)
        model = with_own_batch(model)
    if the_cluster is not None:
        _check_ep_ranks(policies[0], the_cluster, spell)
    _check_float8_target(options, policies, spell)
    return PlanJob(model, tuple(policies), the_cluster, options,
                   memory_budget(kw, the_cluster, spell) if the_cluster is not None else None,
                   compare=kw.policy is None, split=split, whole_batch=kw.batch if split else None,  # type: ignore[arg-type]
                   split_by_default=by_default,
                   full_trace=bool(kw.full_trace), measure=bool(kw.measure), default_cluster=default,
                   explain=explain)

