"""Tensor parallelism in a plan: the TP degree and, per module, the style ``parallelize_module`` applies to it.

FSDP2 composes with TP the way torchtitan's ``parallelize`` does: the model is first parallelized over the ``tp``
dim of a 2-D (or 3-D, with HSDP) device mesh, its params becoming DTensors sharded over ``tp``, then each FSDP group
is ``fully_shard``-ed over the data-parallel dims, which shards those local shards again (dim 0 of a colwise weight:
FSDP2's strided sharding). This module holds the layout and its JSON form, in torch's vocabulary; what the layout
does to a step is ``sim/tensor_parallel.py``, how it is applied ``apply/``.

Layout keys are module-name patterns as ``parallelize_module`` takes them: dotted names whose parts may hold
``fnmatch`` wildcards (``layers.*.attention.wq``). A pattern that matches no module of the model is refused where a
plan meets its model, as ``parallelize_module`` only warns there.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.frozen import FrozenDict
from fsdp_planner.limits import MAX_TP_DEGREE
from fsdp_planner.trace.infos import ModuleInfo, ParamInfo
from fsdp_planner.trace.tree import proper_ancestors
from fsdp_planner.userfiles import shown_json

MAX_LAYOUT_ENTRIES = 100_000
TP_KEYS = ("degree", "layout", "loss_parallel", "async_tp", "mla_rope_dim")
MAX_ROPE_DIM = 1 << 20


class TPStyle(Enum):
    """How one module is parallelized: each value names the ``torch.distributed.tensor.parallel`` style it stands
    for. "SP" is sequence parallelism: activations between the TP regions sharded on the sequence dim (dim 1)."""

    COLWISE = "colwise"  # ColwiseParallel(): weight rows sharded; Replicate in, Shard(-1) out
    ROWWISE = "rowwise"  # RowwiseParallel(): weight columns sharded; Shard(-1) in, output all-reduced (Replicate)
    COLWISE_GATHER = "colwise_gather"  # ColwiseParallel(output_layouts=Replicate()): weight rows sharded; Replicate
    # in, the output all-gathered on its last dim (transformers' colwise_gather_output: Phi-3's fused qkv_proj and
    # gate_up_proj, Olmo2's q/k/v before their whole-width norms, every causal LM's lm_head); what reads it runs whole
    ROWWISE_SPLIT = "rowwise_split"  # RowwiseParallel(input_layouts=Replicate()): weight columns sharded; the whole
    # input split locally (no collective; its grad all-gathered in backward), the output all-reduced (transformers'
    # rowwise_split_input, after a gathered region)
    ROWWISE_SEQUENCE = "rowwise_sequence"  # RowwiseParallel(output_layouts=Shard(1)): output reduce-scattered onto
    # the sequence dim (SP: torchtitan's attention.wo and feed_forward.w2)
    SEQUENCE_COLWISE = "sequence_colwise"  # ColwiseParallel(input_layouts=Shard(1)): the sequence-sharded input
    # all-gathered first (SP: torchtitan's output head); output Shard(-1) under loss parallel, else Replicate
    EMBEDDING = "embedding"  # RowwiseParallel(input_layouts=Replicate()): a vocab-sharded embedding, output
    # all-reduced
    EMBEDDING_SEQUENCE = "embedding_sequence"  # RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)):
    # ... output reduce-scattered onto the sequence dim (SP: torchtitan's tok_embeddings)
    SEQUENCE_PARALLEL = "sequence_parallel"  # SequenceParallel(): a norm run on its sequence shard, params replicated
    GATHER_INPUT = "gather_input"  # PrepareModuleInput(input_layouts=(Shard(1), None...), desired_input_layouts=
    # (Replicate(), None...)): the module's first input all-gathered from its sequence shard (SP: the attention and
    # feed-forward modules, before their colwise Linears)
    # Under expert parallelism (torchtitan's MoE layout with expert TP 1: EP's ranks span the TP ranks):
    MOE_SEQUENCE = "moe_sequence"  # PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=
    # Replicate(), output_layouts=Partial(), desired_output_layouts=Shard(1)): an MoE layer's input all-gathered
    # from its sequence shard (its grad, partial, reduce-scattered back) and its partial output reduce-scattered
    # onto the sequence dim
    REPLICATE = "replicate"  # torchtitan's NoParallel (the router's gate), transformers'
    # replicated_with_grad_allreduce (Qwen3's per-head q_norm / k_norm): params replicated over TP, run on what
    # this rank has (the whole input, or its own heads), its output's grad partial (each TP rank's experts see their
    # own tokens; each rank's heads are its own): the weight's grads all-reduced over TP, the input's passed on
    TOKEN_SPLIT = "token_split"  # torchtitan's ReordererSequenceParallel (the experts): each TP rank sends only
    # its 1/TP of the routed tokens to EP's dispatch, and gets only those back (its output partial); with EP only
    # Without expert parallelism (torchtitan's MoE layout with EP off: the experts' params sharded on the TP dim):
    EXPERT_TENSOR = "expert_tensor"  # the experts' hidden units sharded (``EXPERT_TENSOR_DIMS``), each TP rank
    # running every routed token of the MoE layer's all-gathered input through its share: input replicated (its grad
    # partial), output partial (summed by the layer's reduce-scatter); without EP only
    MOE_TP_EXPERTS = "moe_tp_experts"  # transformers' TP of its packed experts (``moe_tp_experts`` on the module,
    # ``packed_colwise`` gate_up_proj, ``rowwise`` down_proj: ``MOE_TP_EXPERT_DIMS``): each TP rank runs every routed
    # token through its 1/TP of each expert's intermediate units on local tensors; input and routing weights
    # replicated (their grads all-reduced in backward), output partial, all-reduced; without EP only
    MOE_TP_EXPERTS_IN_OUT = "moe_tp_experts_in_out"  # the same on experts whose params are stored [experts, in,
    # out] (Llama 4's Llama4TextExperts, ``x @ w``; transformers' ``packed_rowwise`` gate_up_proj and ``colwise``
    # down_proj: ``MOE_TP_EXPERT_IN_OUT_DIMS``), which take the routed rows alone (no routing weights)
    MLA_KV_A_PROJ = "mla_kv_a_proj"  # transformers' MlaKvAProjParallel (DeepSeek-V2/V3's kv_a_proj_with_mqa): the
    # Linear whole on every TP rank (plain params, no collective in forward); its output's last ``mla_rope_dim``
    # features (the rope key, which every head reads without kv_b_proj's colwise all-reduce) get their grad
    # all-reduced over TP in backward: each rank's is its own heads' share

    @property
    def sequence_parallel(self) -> bool:
        """Whether the style keeps activations sharded on the sequence dim around it."""
        return self in (TPStyle.ROWWISE_SEQUENCE, TPStyle.SEQUENCE_COLWISE, TPStyle.EMBEDDING_SEQUENCE,
                        TPStyle.SEQUENCE_PARALLEL, TPStyle.GATHER_INPUT, TPStyle.MOE_SEQUENCE)


TP_STYLE_NAMES = tuple(s.value for s in TPStyle)
# transformers' style names (``ALL_PARALLEL_STYLES``) that are one of torch's styles as a ``TPStyle`` has it
# (``planners/tensor_parallel.py`` reads its plans with them, refusing a plan with another: its packed, MLA and
# other styles; a plan file naming one is told its name here). The gathered-output and split-input ones are torch's
# ColwiseParallel(output_layouts=Replicate()) and RowwiseParallel(input_layouts=Replicate()); replicated_with_grad_
# allreduce (Qwen3's and Gemma 3's per-head q_norm / k_norm between a colwise and a rowwise Linear: params
# replicated, run on this rank's heads, grads all-reduced over TP) is ``REPLICATE``: left whole it trained each
# rank's norm on its own heads' grads alone (transformers/distributed/tensor_parallel.py)
TRANSFORMERS_STYLES = {"colwise": TPStyle.COLWISE, "rowwise": TPStyle.ROWWISE, "embedding_rowwise": TPStyle.EMBEDDING,
                       "sequence_parallel": TPStyle.SEQUENCE_PARALLEL,
                       "replicated_with_grad_allreduce": TPStyle.REPLICATE,
                       "colwise_gather_output": TPStyle.COLWISE_GATHER, "colwise_rep": TPStyle.COLWISE_GATHER,
                       "rowwise_split_input": TPStyle.ROWWISE_SPLIT, "rowwise_rep": TPStyle.ROWWISE_SPLIT}

# The dim of each grouped-experts param that ``EXPERT_TENSOR`` shards: their hidden (ffn) dim, as torchtitan's
# dense expert placement does (``Shard(1)`` of its w1/w3 [E, ffn, dim], ``Shard(2)`` of w2 [E, dim, ffn]) on
# ``models/moe.py``'s layout: w1 and w3 [E, dim, ffn], w2 [E, ffn, dim].
EXPERT_TENSOR_DIMS = {"w1": 2, "w2": 1, "w3": 2}


# transformers' packed experts (Mixtral, Qwen3-MoE, DeepSeek-V3: gate_up_proj [E, 2 x ffn, dim], down_proj
# [E, dim, ffn]): the dim each shards and its split factor (gate and up packed on one dim: each rank takes its
# share of both, torch's ``_StridedShard`` as transformers' ``packed_colwise`` places it)
MOE_TP_EXPERT_DIMS = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}
# Llama 4's (``MOE_TP_EXPERTS_IN_OUT``: gate_up_proj [E, dim, 2 x ffn], down_proj [E, ffn, dim]), the same units
MOE_TP_EXPERT_IN_OUT_DIMS = {"gate_up_proj": (2, 2), "down_proj": (1, 1)}
PACKED_EXPERT_STYLES = (TPStyle.MOE_TP_EXPERTS, TPStyle.MOE_TP_EXPERTS_IN_OUT)


def packed_style_of(gate_up: tuple[int, ...], down: tuple[int, ...]) -> TPStyle | None:
    """The packed experts' style whose layout a gate_up_proj and down_proj of these shapes have (gate and up
    packed on the hidden units' dim: twice down_proj's), None for neither. The two cannot both fit: that would take
    down_proj's model dim to be twice itself."""
    if len(gate_up) != 3 or len(down) != 3:
        return None
    if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
        return TPStyle.MOE_TP_EXPERTS
    if gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
        return TPStyle.MOE_TP_EXPERTS_IN_OUT
    return None


def moe_tp_expert_dim(param_name: str, style: TPStyle = TPStyle.MOE_TP_EXPERTS) -> tuple[int, int]:
    """(dim, split factor) a packed experts' style (``PACKED_EXPERT_STYLES``) shards the experts' param
    ``param_name`` on; another is refused."""
    dims = MOE_TP_EXPERT_IN_OUT_DIMS if style is TPStyle.MOE_TP_EXPERTS_IN_OUT else MOE_TP_EXPERT_DIMS
    if param_name not in dims:
        raise PlannerError(f"the tensor-parallel style {style.value} shards transformers' packed experts' "
                           f"gate_up_proj and down_proj, and this expert module holds {shown_json(param_name)}: "
                           "leave its experts whole over TP or plan without TP")
    return dims[param_name]


def expert_tensor_dim(param_name: str) -> int:
    """The dim ``EXPERT_TENSOR`` shards of the experts' param ``param_name`` (its own name, not the fqn); a
    param of another name is refused: no layout of it is known."""
    if param_name not in EXPERT_TENSOR_DIMS:
        raise PlannerError(f"the tensor-parallel style expert_tensor shards grouped experts' w1, w2 and w3 (models/"
                           f"moe.py's GroupedExperts, torchtitan's), and this expert module holds "
                           f"{shown_json(param_name)}: give its experts another style or plan without TP")
    return EXPERT_TENSOR_DIMS[param_name]


@dataclass(frozen=True)
class TensorParallel:
    """The TP part of a plan: ``degree`` ranks in a TP group (innermost in the mesh: consecutive ranks, within a
    node) and the style of each module pattern. ``loss_parallel``: the output head keeps its vocab-sharded logits
    and the loss runs under ``torch.distributed.tensor.parallel.loss_parallel()``. ``async_tp``: torchtitan's async
    TP (the all-gather / reduce-scatter overlapped with the matmuls they feed; it needs compile). ``mla_rope_dim``:
    the trailing output features of the ``mla_kv_a_proj`` modules whose grad is all-reduced (0 without them)."""

    degree: int
    layout: Mapping[str, TPStyle] = field(default_factory=dict)
    loss_parallel: bool = False
    async_tp: bool = False
    mla_rope_dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, FrozenDict):
            object.__setattr__(self, "layout", FrozenDict(self.layout))
        mla = TPStyle.MLA_KV_A_PROJ in self.layout.values()
        if mla != (self.mla_rope_dim > 0):
            raise PlannerError("a tensor-parallel layout with the style mla_kv_a_proj needs its rope features "
                               "('mla_rope_dim': transformers' qk_rope_head_dim), and only such a layout takes them"
                               if mla else "plan 'tensor_parallel.mla_rope_dim' is for a layout with the style "
                               "mla_kv_a_proj, which this one does not give")

    @property
    def sequence_parallel(self) -> bool:
        return any(s.sequence_parallel for s in self.layout.values())

    def styles(self, module_names: Iterable[str]) -> dict[str, TPStyle]:
        """Each module of ``module_names`` the layout parallelizes, with its style (a later pattern wins, as a
        later ``parallelize_module`` call would); a pattern that matches none is refused."""
        return dict(_styles(tuple(self.layout.items()), tuple(module_names)))

    def describe(self) -> str:
        extras = [x for x, on in (("SP", self.sequence_parallel), ("loss parallel", self.loss_parallel),
                                  ("async", self.async_tp)) if on]
        return f"TP {self.degree}" + (f" ({', '.join(extras)})" if extras else "")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"degree": self.degree, "layout": {k: s.value for k, s in self.layout.items()}}
        if self.loss_parallel:
            d["loss_parallel"] = True
        if self.async_tp:
            d["async_tp"] = True
        if self.mla_rope_dim:
            d["mla_rope_dim"] = self.mla_rope_dim
        return d

    def signature(self) -> tuple:
        return self.degree, tuple(self.layout.items()), self.loss_parallel, self.async_tp, self.mla_rope_dim

    @classmethod
    def from_signature(cls, signature: tuple) -> TensorParallel:
        """The layout a TP view was made for (``Trace.tensor_parallel`` holds its ``signature``)."""
        degree, layout, loss_parallel, async_tp, mla_rope_dim = signature
        return cls(degree, dict(layout), loss_parallel, async_tp, mla_rope_dim)


# The styles that shard a module's own weight with torch's ColwiseParallel or RowwiseParallel, whose ``_apply``
# (torch 2.13's ``distributed/tensor/parallel/style.py``) takes an nn.Linear or an nn.Embedding only and raises
# NotImplementedError for any other module; SequenceParallel and PrepareModuleInput take any module
WEIGHT_STYLES = (TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.ROWWISE_SEQUENCE, TPStyle.SEQUENCE_COLWISE,
                 TPStyle.EMBEDDING, TPStyle.EMBEDDING_SEQUENCE, TPStyle.COLWISE_GATHER, TPStyle.ROWWISE_SPLIT)


_FLOAT8_LINEAR_STYLES = (TPStyle.COLWISE, TPStyle.ROWWISE, TPStyle.ROWWISE_SEQUENCE)


# the dim of its weight a style shards (the bias of a dim-0 style too): what one TP rank holds of the param
_DIM0_STYLES = (TPStyle.COLWISE, TPStyle.SEQUENCE_COLWISE, TPStyle.EMBEDDING, TPStyle.EMBEDDING_SEQUENCE,
                TPStyle.COLWISE_GATHER)
_DIM1_STYLES = (TPStyle.ROWWISE, TPStyle.ROWWISE_SEQUENCE, TPStyle.ROWWISE_SPLIT)


def param_style(p: ParamInfo, styles: Mapping[str, TPStyle]) -> TPStyle | None:
    """The style of the first of the param's owners that has one (None: whole on every TP rank)."""
    return next((styles[o] for o in p.owners if o in styles), None)


def local_param(p: ParamInfo, style: TPStyle | None, degree: int) -> ParamInfo:
    """The param's TP-local shard: the dim its style shards, divided by the degree."""
    if style is TPStyle.EXPERT_TENSOR:
        dim = expert_tensor_dim(p.fqn.rpartition(".")[2])
    elif style in PACKED_EXPERT_STYLES:
        dim = moe_tp_expert_dim(p.fqn.rpartition(".")[2], style)[0]
    elif style in _DIM0_STYLES:
        dim = 0
    elif style in _DIM1_STYLES and len(p.shape) >= 2:
        dim = 1
    else:
        return p
    if len(p.shape) <= dim or p.shape[dim] % degree:
        raise PlannerError(f"tensor parallelism of degree {degree} cannot shard {p.fqn} {list(p.shape)} on dim {dim} "
                           f"({style.value}): choose a degree that divides it")
    shape = (*p.shape[:dim], p.shape[dim] // degree, *p.shape[dim + 1:])
    return replace(p, shape=shape, numel=p.numel // degree)


def float8_styled(styles: Mapping[str, TPStyle], converted: Iterable[str]) -> frozenset[str]:
    """The styled modules torchao's float8 TP styles take (a plan's ``float8.tp_float8_all_gather``): the
    ``converted`` Linears (float8's) in a colwise or rowwise style, and each module gathering its input
    (``GATHER_INPUT``) whose colwise Linears are all converted: its input is cast once, on its sequence shard, for
    all of them (``PrepareFloat8ModuleInput``). The output head keeps torch's ``ColwiseParallel``, as torchtitan's
    layout did."""
    converted = set(converted)
    out = {m for m, s in styles.items() if s in _FLOAT8_LINEAR_STYLES and m in converted}
    for name, style in styles.items():
        if style is TPStyle.GATHER_INPUT:
            readers = [m for m, s in styles.items() if s is TPStyle.COLWISE and name in proper_ancestors(m)]
            if readers and all(m in out for m in readers):
                out.add(name)
    return frozenset(out)


def check_style_classes(tp: TensorParallel | None, modules: Mapping[str, ModuleInfo]) -> None:
    """Refuse a weight-sharding style (``WEIGHT_STYLES``) on a module that is no nn.Linear or nn.Embedding, before
    ``parallelize_module`` raises on the ranks, and ``mla_kv_a_proj`` on one that is no nn.Linear. No TP (None):
    nothing to check."""
    if tp is None:
        return
    for m, s in sorted(tp.styles(modules).items()):
        if s is TPStyle.MLA_KV_A_PROJ and modules[m].torch_class != "Linear":
            raise PlannerError(f"the tensor-parallel style mla_kv_a_proj of {m} all-reduces the grad of the last "
                               f"features of an nn.Linear's output (MLA's rope key), and {m} is a {modules[m].cls}: "
                               "give it to the Linear making the rope key (kv_a_proj_with_mqa)")
        if s in WEIGHT_STYLES and not modules[m].torch_class:
            torch_name = "ColwiseParallel" if s in (TPStyle.COLWISE, TPStyle.SEQUENCE_COLWISE,
                                                    TPStyle.COLWISE_GATHER) else "RowwiseParallel"
            raise PlannerError(f"the tensor-parallel style {s.value} of {m} is torch's {torch_name}, which shards "
                               f"an nn.Linear or nn.Embedding only, and {m} is a {modules[m].cls}: give it no style "
                               "(a norm under sequence parallelism takes sequence_parallel) or style its Linears")


def check_moe_styles(tp: TensorParallel | None, module_names: Iterable[str], expert_parallel: bool | None) -> None:
    """Refuse the MoE styles where they cannot run (before any module is changed): ``token_split`` needs expert
    parallelism (EP's dispatch splits the tokens), ``expert_tensor`` runs without it (EP shards the experts on
    dim 0 instead) and inside a module of style ``moe_sequence`` (the layer's input whole on every TP rank). No
    TP (None): nothing to check; ``expert_parallel`` None (a TP view, EP's added after it): the layout alone."""
    if tp is None:
        return
    styles = tp.styles(module_names)
    gathered = {m for m, s in styles.items() if s is TPStyle.MOE_SEQUENCE}
    for m, s in sorted(styles.items()):
        if s is TPStyle.TOKEN_SPLIT and expert_parallel is False:
            raise PlannerError(f"the tensor-parallel style token_split of {m} splits the experts' routed tokens for "
                               "expert parallelism's dispatch: give the plan expert parallelism too, or give the "
                               "experts the style expert_tensor")
        if s in PACKED_EXPERT_STYLES and expert_parallel is True:
            raise PlannerError(f"the tensor-parallel style {s.value} of {m} shards the experts over TP without "
                               "expert parallelism; under EP transformers' plan runs them whole on each EP rank")
        if s is TPStyle.EXPERT_TENSOR and expert_parallel is True:
            raise PlannerError(f"the tensor-parallel style expert_tensor of {m} shards the experts over TP without "
                               "expert parallelism (torchtitan's layout with EP off); under EP give them the style "
                               "token_split")
        if s is TPStyle.EXPERT_TENSOR and not any(a in gathered for a in proper_ancestors(m)):
            raise PlannerError(f"the tensor-parallel style expert_tensor of {m} needs its MoE layer's input whole "
                               "on every TP rank: give the module around it the style moe_sequence")


@functools.lru_cache(maxsize=32)
def _styles(layout: tuple[tuple[str, TPStyle], ...], names: tuple[str, ...]) -> tuple[tuple[str, TPStyle], ...]:
    """``TensorParallel.styles``, once per layout and model: the views, checks and simulations of one layout ask it
    tens of times (matching every pattern against every module name: ~45 ms on Llama 3 8B each time)."""
    out: dict[str, TPStyle] = {}
    for pattern, style in layout:
        hits = [n for n in names if matches(pattern, n)]
        if not hits:
            raise PlannerError(f"the tensor-parallel layout names {shown_json(pattern)}, which matches no module "
                               "of this model: give module names as `named_modules()` spells them ('*' for "
                               "one part, e.g. layers.*.attention.wq)")
        out.update(dict.fromkeys(hits, style))
    return tuple(out.items())


def is_literal(pattern: str) -> bool:
    """Whether ``pattern`` has no ``fnmatch`` wildcard, so that it ``matches`` its own name alone."""
    return not any(c in pattern for c in "*?[")


def matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s matching: as many dotted parts, each matched with ``fnmatch``."""
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True))


def tensor_parallel_from_dict(data: Any) -> TensorParallel | None:
    """A plan's ``tensor_parallel`` object; absent (None): no TP."""
    if data is None:
        return None
    if not isinstance(data, dict) or any(k not in TP_KEYS for k in data):
        raise PlannerError(f"plan 'tensor_parallel' must be an object with the keys {', '.join(TP_KEYS)} (degree "
                           f"and layout required), got {shown_json(data)}")
    degree, layout = data.get("degree"), data.get("layout")
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= MAX_TP_DEGREE:
        raise PlannerError(f"plan 'tensor_parallel.degree' must be a whole number from 1 to {MAX_TP_DEGREE}, got "
                           f"{shown_json(degree)}")
    _check_layout(layout)
    flags = {k: data.get(k, False) for k in ("loss_parallel", "async_tp")}
    bad = next((k for k, v in flags.items() if not isinstance(v, bool)), None)
    if bad is not None:
        raise PlannerError(f"plan 'tensor_parallel.{bad}' must be true or false, got {shown_json(flags[bad])}")
    if degree > 1 and not layout:
        raise PlannerError(f"plan 'tensor_parallel' has degree {degree} but an empty layout: name the modules to "
                           "parallelize and their styles")
    rope = data.get("mla_rope_dim", 0)
    mla = TPStyle.MLA_KV_A_PROJ.value in layout.values()
    if mla and "mla_rope_dim" not in data:
        raise PlannerError("plan 'tensor_parallel.mla_rope_dim' is missing, and the layout gives the style "
                           "mla_kv_a_proj: give the rope features of its output (transformers' qk_rope_head_dim)")
    if isinstance(rope, bool) or not isinstance(rope, int) or not (1 if mla else 0) <= rope <= MAX_ROPE_DIM:
        raise PlannerError(f"plan 'tensor_parallel.mla_rope_dim' must be a whole number from 1 to {MAX_ROPE_DIM:,} "
                           "(the rope features of the mla_kv_a_proj modules' output: transformers' "
                           f"qk_rope_head_dim), given with that style, got {shown_json(rope)}")
    return TensorParallel(degree, {k: TPStyle(v) for k, v in layout.items()}, **flags, mla_rope_dim=rope)


def _check_layout(layout: Any) -> None:
    """A plan file's ``tensor_parallel.layout``: module names or patterns -> known style names, bounded."""
    if not isinstance(layout, dict) or len(layout) > MAX_LAYOUT_ENTRIES:
        raise PlannerError("plan 'tensor_parallel.layout' must be an object mapping module names (or patterns "
                           f"with '*') to a style ({', '.join(TP_STYLE_NAMES)}), at most {MAX_LAYOUT_ENTRIES:,}")
    for key, value in layout.items():
        if not isinstance(key, str) or not 0 < len(key) <= 10_000 or "" in key.split("."):
            raise PlannerError(f"plan 'tensor_parallel.layout' key {shown_json(key)} is not a module name or pattern "
                               "(non-empty parts separated by dots)")
        if value not in TP_STYLE_NAMES:
            known = TRANSFORMERS_STYLES.get(value) if isinstance(value, str) else None
            hint = f" (transformers' name for {known.value})" if known is not None else ""
            raise PlannerError(f"plan 'tensor_parallel.layout' gives {shown_json(key)} the unknown style "
                               f"{shown_json(value)}{hint}: choose one of {', '.join(TP_STYLE_NAMES)}")
