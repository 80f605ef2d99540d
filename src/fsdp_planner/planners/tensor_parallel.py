"""Where a plan's tensor-parallel layout comes from, in order: the user's plan file (read with the plan, not here);
transformers' own ``base_model_tp_plan`` for ``hf:`` models; torchtitan's Llama convention for a model with the
built-in Llama's structure (``torchtitan/models/llama3/parallelize.py``'s ``apply_tp``: sequence parallelism around
the norms, colwise then rowwise Linears in attention and the feed-forward, a vocab-sharded embedding and output);
for any other model, the column-then-row Linear pairs found in its trace, with a note naming what that assumes.
Where none gives a sound layout, a ``PlannerError`` says so. ``check_layout`` refuses a degree the model's heads,
dims, vocab or sequence, or the cluster's nodes, do not divide, and a style torch cannot apply to its module; a
plan file's layout meets the same checks (``plan_layout``, the heads its model has)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.tensor_parallel import (
    MOE_TP_EXPERT_DIMS,
    PACKED_EXPERT_STYLES,
    TRANSFORMERS_STYLES,
    WEIGHT_STYLES,
    TensorParallel,
    TPStyle,
    check_style_classes,
    expert_tensor_dim,
    matches,
    moe_tp_expert_dim,
    packed_style_of,
)
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec, hf, llama, moe
from fsdp_planner.trace.events import ATTENTION_KERNELS, EventKind
from fsdp_planner.trace.infos import ModuleInfo
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, is_within, parent_of, proper_ancestors

TP_DEGREES = (1, 2, 4, 8)  # what auto tries, where they divide the node and the model
PAIRS = "column-then-row Linear pairs"  # the source of a detected layout
PLAN_FILE = "the plan file's 'tensor_parallel'"  # the source of a layout the user wrote
TITAN_LLAMA, TITAN_MOE = "torchtitan's Llama layout", "torchtitan's MoE layout"  # layouts taken by module names
TITAN_LAYOUTS = (TITAN_LLAMA, TITAN_MOE)

_LLAMA_BLOCK = {
    "attention_norm": TPStyle.SEQUENCE_PARALLEL,
    "attention": TPStyle.GATHER_INPUT,
    "attention.wq": TPStyle.COLWISE,
    "attention.wk": TPStyle.COLWISE,
    "attention.wv": TPStyle.COLWISE,
    "attention.wo": TPStyle.ROWWISE_SEQUENCE,
    "ffn_norm": TPStyle.SEQUENCE_PARALLEL,
    "feed_forward": TPStyle.GATHER_INPUT,
    "feed_forward.w1": TPStyle.COLWISE,
    "feed_forward.w2": TPStyle.ROWWISE_SEQUENCE,
    "feed_forward.w3": TPStyle.COLWISE,
}
_LLAMA_TOP = {"tok_embeddings": TPStyle.EMBEDDING_SEQUENCE, "norm": TPStyle.SEQUENCE_PARALLEL,
              "output": TPStyle.SEQUENCE_COLWISE}
_LLAMA_CLASSES = {"tok_embeddings": "Embedding", "output": "Linear", "attention.wq": "Linear",
                  "attention.wk": "Linear", "attention.wv": "Linear", "attention.wo": "Linear",
                  "feed_forward.w1": "Linear", "feed_forward.w2": "Linear", "feed_forward.w3": "Linear"}

# torchtitan's MoE block under TP (its MoE sharding config) on ``models/moe.py``'s names: attention as in a Llama
# block; the MoE layer's input all-gathered and its partial output reduce-scattered, the router's gate replicated;
# with EP the routed tokens split over the TP ranks before EP's dispatch (EP's ranks span TP's), without EP the
# experts' hidden units sharded over TP
_MOE_BLOCK = {**{k: v for k, v in _LLAMA_BLOCK.items() if not k.startswith("feed_forward")},
              "moe": TPStyle.MOE_SEQUENCE, "moe.router.gate": TPStyle.REPLICATE, "moe.experts": TPStyle.TOKEN_SPLIT}
_MOE_CLASSES = {"moe": "MoE", "moe.router.gate": "Linear", "moe.experts": "GroupedExperts"}


def titan_moe_layout(degree: int, loss_parallel: bool = True, expert_parallel: bool = True) -> TensorParallel:
    """torchtitan's TP of an MoE model (``models/moe.py``'s module names), with sequence parallelism. Under EP
    (``expert_parallel``) EP's ranks span the TP ranks, each TP rank dispatching its 1/TP of the routed tokens;
    without it each TP rank holds 1/TP of every expert's hidden units (``TPStyle.EXPERT_TENSOR``), as torchtitan
    shards the experts over TP when expert parallelism is off."""
    block = dict(_MOE_BLOCK)
    if not expert_parallel:
        block["moe.experts"] = TPStyle.EXPERT_TENSOR
    layout = dict(_LLAMA_TOP)
    layout.update({f"layers.*.{name}": style for name, style in block.items()})
    return TensorParallel(degree, layout, loss_parallel=loss_parallel)


def is_titan_moe(trace: Trace) -> bool:
    """Whether the model has the built-in MoE's structure (``models/moe.py``): Llama's attention and norms in each
    block ``layers.N``, its ``moe`` with a ``router.gate`` Linear and grouped ``experts``, under a
    ``tok_embeddings`` Embedding, a final ``norm`` and an ``output`` Linear."""
    return _has_titan_structure(trace, _MOE_BLOCK, {**_LLAMA_CLASSES, **_MOE_CLASSES})


def titan_llama_layout(degree: int, loss_parallel: bool = True) -> TensorParallel:
    """torchtitan's TP of a Llama (``models/llama.py``'s module names), with sequence parallelism; loss parallel is
    torchtitan's default (``parallelism.disable_loss_parallel`` false)."""
    layout = dict(_LLAMA_TOP)
    layout.update({f"layers.*.{name}": style for name, style in _LLAMA_BLOCK.items()})
    return TensorParallel(degree, layout, loss_parallel=loss_parallel)


@dataclass(frozen=True)
class TPChoice:
    """A TP layout auto may choose, and the step it is judged on: ``trace``, the model at the batch each of its
    data-parallel ranks runs (None: the search's own trace)."""

    tp: TensorParallel
    trace: Trace | None = None


@dataclass(frozen=True)
class Layout:
    """A TP layout, where it came from, and what it assumed or left out (one line each, for the commands)."""

    tp: TensorParallel
    source: str
    notes: tuple[str, ...] = ()
    heads: tuple[int, int] | None = None  # (attention heads, kv heads) where known: what the degree must divide
    named: str = ""  # the config key that gave the degree ("": the --tp option, or a plan file's)
    per_head: frozenset[str] = frozenset()  # colwise Linears transformers' own plan shards by heads: a head of
    # their output may be another width than the attention's head dim (MLA's kv_b_proj: key part and value)

    @property
    def asked(self) -> str:
        """The degree as the user gave it, for the refusals."""
        d = self.tp.degree
        if self.named:
            return f"{self.named} = {d}"
        return f"the plan's tensor-parallel degree {d}" if self.source == PLAN_FILE else f"--tp {d}"

    @property
    def checked(self) -> bool:
        """Whether the layout was checked against the model itself, so auto may take it on its own: not a
        detected one (``PAIRS``), nor one whose head counts are unknown (the degree assumed to divide them): those
        assumptions are the user's to accept, with ``--tp``."""
        return self.source != PAIRS and _UNKNOWN_HEADS not in self.notes


def tp_layout(trace: Trace, degree: int, model: ModelSpec | None = None, loss_parallel: bool | None = None,
              async_tp: bool = False, ep: int = 1, left_whole: frozenset[str] = frozenset()) -> Layout:
    """The layout of ``degree``-way TP for the traced model, from the first source that has one (module
    docstring). ``loss_parallel``: None takes the source's default (torchtitan's on, where the output head is
    vocab-sharded). A model with torchtitan's MoE structure takes its MoE layout, with expert parallelism (``ep``
    > 1) the only one modelled. ``left_whole``: the rowwise Linears of detected pairs to leave out (``pair_kinds``:
    those whose module's code does not take the split)."""
    if ep > 1 and degree > 1 and not is_titan_moe(trace):
        # (a torchtitan job's MoE model is built as transformers' of the same config: hf:titan-..., models/hf.py)
        name = model.name if model is not None else ""
        built = f"fsdp-planner builds torchtitan's model ({name}) as transformers' of its config, whose experts" \
            if name.startswith(f"{hf.PREFIX}titan-") else "transformers' experts" if hf.is_hf(name) else \
            "this model's experts"
        raise PlannerError("expert parallelism with tensor parallelism is modelled for the MoE layout of the "
                           f"built-in MoE models (models/moe.py, torchtitan's own module structure) only, and "
                           f"{built} take another: give one of them, not both (--ep or --tp; a torchtitan job's "
                           "expert_parallel_degree or tensor_parallel_degree)")
    if degree > 1 and is_titan_moe(trace):
        heads = _llama_heads(trace)
        notes = () if heads else (_UNKNOWN_HEADS,)
        found = Layout(titan_moe_layout(degree, loss_parallel is not False, expert_parallel=ep > 1),
                       TITAN_MOE + ("" if ep > 1 else " (experts tensor-parallel: no EP)"),
                       notes, heads)
    elif model is not None and hf.is_hf(model.name):
        found = _hf_layout(trace, degree, model)
    elif is_titan_llama(trace):
        found = _titan_layout(trace, degree, loss_parallel is not False)
    else:
        found = _pairs_layout(trace, degree, left_whole)
    found = _without_split_ties(trace, _without_modified_outputs(trace, found))
    if loss_parallel and not found.tp.loss_parallel:
        found = _note(found, "loss parallel is left off: this layout does not shard the output head on the vocab")
    return replace(found, tp=replace(found.tp, degree=degree, async_tp=async_tp))


def is_titan_llama(trace: Trace) -> bool:
    """Whether the model has the built-in Llama's structure (torchtitan's names and module classes): its blocks
    ``layers.N`` each with ``attention.{wq,wk,wv,wo}``, ``feed_forward.{w1,w2,w3}`` and the two norms, under a
    ``tok_embeddings`` Embedding, a final ``norm`` and an ``output`` Linear."""
    return _has_titan_structure(trace, _LLAMA_BLOCK, _LLAMA_CLASSES)


def _has_titan_structure(trace: Trace, block: dict[str, TPStyle], classes: dict[str, str]) -> bool:
    """Whether every block ``layers.N`` holds ``block``'s modules, under ``_LLAMA_TOP``'s, each module ``classes``
    names of that class; each Linear / Embedding holding its weight itself (a tied output head shares the
    embedding's): a wrapped one (peft's LoRA ``Linear`` keeps it in its ``base_layer``) is no module torch's styles
    parallelize."""
    modules = trace.modules
    blocks = [n for n in modules if n.startswith("layers.") and n.count(".") == 1]
    names = [*(f"{b}.{name}" for b in blocks for name in block), *_LLAMA_TOP]
    if not blocks or any(n not in modules for n in names):
        return False
    tied = {o for p in trace.params if p.is_shared for o in p.owners}
    for n in names:
        cls = classes.get(n.split(".", 2)[-1] if n.startswith("layers.") else n)
        if cls is None:
            continue
        owns = cls not in ("Linear", "Embedding") or f"{n}.weight" in modules[n].params or n in tied
        if modules[n].cls != cls or not owns:
            return False
    return True


_UNKNOWN_HEADS = ("the head counts are not known for this model: the degree is assumed to divide its attention "
                  "and kv heads")


def _titan_layout(trace: Trace, degree: int, loss_parallel: bool) -> Layout:
    heads = _llama_heads(trace)
    notes = () if heads else (_UNKNOWN_HEADS,)
    return Layout(titan_llama_layout(degree, loss_parallel), TITAN_LLAMA, notes, heads)


def _llama_heads(trace: Trace) -> tuple[int, int] | None:
    """(heads, kv heads) of a model with torchtitan's Llama or MoE structure: a built-in config's where the shapes
    are one's, else from the head dim its attention calls ran at (``Trace.attention``; torchtitan's attention views
    wq's and wk's outputs as heads of that dim); None where neither tells (no fused attention call, or several
    head dims)."""
    wq, wk = trace.param("layers.0.attention.wq.weight").shape, trace.param("layers.0.attention.wk.weight").shape
    blocks = sum(1 for n in trace.modules if n.startswith("layers.") and n.count(".") == 1)
    for cfg in (*llama.CONFIGS, *moe.CONFIGS):
        head_dim = cfg.dim // cfg.n_heads
        if (cfg.dim, cfg.n_layers, cfg.n_heads * head_dim, cfg.n_kv_heads * head_dim) == (wq[1], blocks, wq[0], wk[0]):
            return cfg.n_heads, cfg.n_kv_heads
    hd = _head_dim(trace)
    return (wq[0] // hd, wk[0] // hd) if hd and wq[0] % hd == 0 and wk[0] % hd == 0 else None


def _head_dim(trace: Trace) -> int:
    """The head dim the model's fused attention calls ran at (``Trace.attention``); 0 where none ran or several."""
    head_dims = {hd for _, _, hd in trace.attention}
    return head_dims.pop() if len(head_dims) == 1 else 0


def _hf_layout(trace: Trace, degree: int, model: ModelSpec) -> Layout:
    """transformers' plan for the model's class, in ``TPStyle``s: the patterns that match a module of this model;
    a style without a ``TPStyle`` is refused (left whole, its module need not train right beside the others)."""
    plan = hf.parallel_plan(model.name.removeprefix(hf.PREFIX), model.hf_config, _top(trace))
    names = list(trace.modules)
    layout: dict[str, TPStyle] = {}
    left: dict[str, str] = {}
    for pattern, style in plan.styles.items():
        if not any(matches(pattern, n) for n in names):
            continue
        if style in TRANSFORMERS_STYLES:
            layout[pattern] = TRANSFORMERS_STYLES[style]
        elif style == "moe_tp_experts" and (packed := _packed_experts(trace, plan.styles, pattern)):
            layout[pattern] = packed
        elif style == "mla_kv_a_proj" and plan.rope_dim:
            layout[pattern] = TPStyle.MLA_KV_A_PROJ
        else:
            left[pattern] = style
    if not any(s in (TPStyle.ROWWISE, TPStyle.ROWWISE_SPLIT, *PACKED_EXPERT_STYLES) for s in layout.values()):
        # (a plan of the blocks, not the output head's alone)
        raise PlannerError(_no_plan_reason(plan, names, model.name, left))
    _refuse_own_params_on_heads(trace, plan, layout, model.name)
    if left:
        raise PlannerError(f"transformers' tensor-parallel plan for {model.name} gives {_listed(left)}, which "
                           "fsdp-planner does not model, and left whole such a module need not train right beside "
                           "the sharded ones (whole, a module that every rank's heads read has its gradient summed "
                           "over one rank's heads only, and the TP ranks' copies drift): plan it without --tp, or "
                           "give a layout in a plan file's 'tensor_parallel'")
    tp = TensorParallel(degree, layout, mla_rope_dim=plan.rope_dim if TPStyle.MLA_KV_A_PROJ in layout.values() else 0)
    # (a layout that gathers its q/k/v whole, Phi-3's and Olmo2's, splits no heads: their count need not divide)
    heads = (plan.heads, plan.kv_heads) if plan.heads and plan.kv_heads and head_linears(trace, tp)[1] else None
    notes = () if tp.sequence_parallel else (
        "transformers' base_model_tp_plan has no sequence parallelism: the norms, residuals and every block's "
        "output are whole on each TP rank (and the logits too, without loss parallel), where torchtitan's layout "
        "shards them by the TP degree (transformers' forward builds its positions and mask from the embedding's "
        "output, which sequence parallelism would shard; the built-in llama3-* models, which torchtitan's llama3 "
        "jobs run, have torchtitan's layout)",)
    return Layout(tp, "transformers' base_model_tp_plan", notes, heads=heads, per_head=_hf_colwise(trace, plan))


def _check_rope_keys(trace: Trace, tp: TensorParallel, plan: hf.HfParallelPlan, model_name: str) -> None:
    """A plan file's ``mla_kv_a_proj`` modules are the ones transformers' plan gives it (the Linears making MLA's
    rope key) wherever the layout shards the heads beside them: left whole there, a key's grad is one rank's heads'
    share; on another Linear, that Linear's grad is summed twice (both trained wrong on gloo and passed the fake
    process group, which counts collectives, not values: a new user's trial)."""
    keys = {n for n in trace.modules
            if any(matches(p, n) for p, style in plan.styles.items() if style == "mla_kv_a_proj")}
    styles = tp.styles(trace.modules)
    elsewhere = sorted(n for n, style in styles.items() if style is TPStyle.MLA_KV_A_PROJ and n not in keys)
    if elsewhere:
        where = f"is made by {sorted(keys)[0]} (transformers' plan), and only that Linear takes the style" if keys \
            else "is made by no module transformers' plan gives the style"
        raise PlannerError(f"the tensor-parallel style mla_kv_a_proj of {elsewhere[0]}: {model_name}'s rope key "
                           f"{where}")
    sharding = {parent_of(m) for m, style in styles.items() if style in _COLWISE}  # modules whose heads are split
    for key in sorted(keys):
        if parent_of(key) in sharding and styles.get(key) is not TPStyle.MLA_KV_A_PROJ:
            raise PlannerError(f"{key} makes {model_name}'s rope key, which every head reads, and the layout shards "
                               "the heads beside it: give it the style mla_kv_a_proj (its grad is one rank's heads' "
                               "share without it)")


def _hf_colwise(trace: Trace, plan: hf.HfParallelPlan) -> frozenset[str]:
    """The model's modules transformers' plan gives ``colwise``."""
    patterns = [p for p, style in plan.styles.items() if style == "colwise"]
    return frozenset(n for n in trace.modules if any(matches(p, n) for p in patterns))


def _packed_experts(trace: Trace, styles: dict[str, str], pattern: str) -> TPStyle | None:
    """The packed experts' style (``PACKED_EXPERT_STYLES``) of the experts ``pattern`` names, if transformers' plan
    shards them as it does: gate_up_proj and down_proj their only params (a bias, gpt-oss's, is left whole with its
    module), their hidden units sharded (``packed_colwise`` and ``rowwise`` on Mixtral's [E, out, in] layout,
    ``packed_rowwise`` and ``colwise`` on Llama 4's [E, in, out]), each module's shapes of that layout."""
    params: dict[str, dict[str, tuple[int, ...]]] = {}
    for fqn in trace.index.param_index:
        owner, _, name = fqn.rpartition(".")
        if matches(pattern, owner):
            params.setdefault(owner, {})[name] = tuple(trace.param(fqn).shape)
    asked = {("packed_colwise", "rowwise"): TPStyle.MOE_TP_EXPERTS,
             ("packed_rowwise", "colwise"): TPStyle.MOE_TP_EXPERTS_IN_OUT}.get(
        (styles.get(f"{pattern}.gate_up_proj"), styles.get(f"{pattern}.down_proj")))
    if asked is None or not params or any(set(owned) != set(MOE_TP_EXPERT_DIMS) for owned in params.values()):
        return None
    fits = all(packed_style_of(owned["gate_up_proj"], owned["down_proj"]) is asked for owned in params.values())
    return asked if fits else None


def _refuse_own_params_on_heads(trace: Trace, plan: hf.HfParallelPlan, layout: dict[str, TPStyle],
                                model_name: str) -> None:
    """Refuse a plan that shards a module's own param (not a submodule: attention sinks, one per head) of a module
    whose colwise children split its heads: the planner shards modules only, so the param would stay whole beside
    this rank's heads (a shape error on the ranks, or a wrong step). A param of a module left whole (grouped
    experts) is whole with its module."""
    colwise = [n for n in trace.modules if any(matches(p, n) for p, st in layout.items() if st is TPStyle.COLWISE)]
    for pattern, style in plan.styles.items():
        for fqn in trace.index.param_index:
            owner = fqn.rpartition(".")[0]
            if matches(pattern, fqn) and fqn.rpartition(".")[2] not in ("weight", "bias") and \
                    any(c.rpartition(".")[0] == owner for c in colwise):
                raise PlannerError(f"transformers' tensor-parallel plan for {model_name} shards {owner}'s own param "
                                   f"{fqn.rpartition('.')[2]} ({style}) beside its colwise heads, which the planner "
                                   "does not model: plan it without tensor parallelism, or give a layout in a plan "
                                   "file's 'tensor_parallel'")


def _top(trace: Trace) -> tuple[tuple[str, str], ...]:
    """(name, class name) of the model's root and its children: where transformers' plan names its base model."""
    root = trace.modules[ROOT]
    return ((ROOT, root.cls), *((c, trace.modules[c].cls) for c in root.children if c in trace.modules))


def _no_plan_reason(plan: hf.HfParallelPlan, names: list[str], model_name: str, left: dict[str, str]) -> str:
    """Why transformers' plan gives no layout: its base plan named under a prefix this model's root does not hold
    (Llama 4's causal LM loads its text model as ``language_model`` but keeps it in ``model``; the planner does not
    rename the plan: what runs under it was not checked), or styles the planner does not model."""
    ways = "plan it without tensor parallelism, or give a layout in a plan file's 'tensor_parallel'"
    children = [n for n in names if n and "." not in n]
    base = [p for p in plan.styles if plan.prefix and p.startswith(f"{plan.prefix}.")]
    if base and plan.prefix not in children:
        return (f"transformers' tensor-parallel plan for {model_name} names its base model '{plan.prefix}' (the "
                f"class's base_model_prefix), which is not among the model's children ({', '.join(children)}), so "
                f"none of its {len(base)} base patterns matches a module: {ways}")
    if left:
        return (f"transformers has no tensor-parallel plan for {model_name} that the planner models "
                f"({_listed(left)}): {ways}")
    matched = {p: s for p, s in plan.styles.items() if any(matches(p, n) for n in names)}
    if matched:  # (gpt-oss's shards its embedding alone, PhiMoE's its experts alone: refused beside)
        return (f"transformers' tensor-parallel plan for {model_name} shards no Linear of its blocks rowwise, nor "
                f"their experts (it gives {_listed(matched)}): {ways}")
    return (f"transformers has no tensor-parallel plan for {model_name} (its config class has no "
            f"base_model_tp_plan): {ways}")


def _listed(styles: dict[str, str]) -> str:
    return ", ".join(f"{p} ({s})" for p, s in styles.items())


@dataclass(frozen=True)
class _Pair:
    parent: str
    cols: tuple[str, ...]
    row: str
    gathered: bool = False  # no colwise output is the rowwise input's size (a fused qkv the model splits by its
    # own widths): colwise_gather and rowwise_split, what reads the outputs run whole on every rank


def pair_kinds(trace: Trace) -> list[tuple[str, frozenset[str]]]:
    """The detected pairs by kind (their module's class and their Linears' names in it: every block's attention
    is one kind), each as ("wq, wk, wv -> wo in DecoderLayer", the rowwise Linears of its pairs)."""
    kinds: dict[str, set[str]] = {}
    for m in trace.modules.values():
        for p in _pairs(trace, m):
            cols, row = (c.removeprefix(f"{p.parent}.") for c in p.cols), p.row.removeprefix(f"{p.parent}.")
            label = f"{', '.join(cols)} -> {row} in {m.cls}"
            kinds.setdefault(label, set()).add(p.row)
    return [(label, frozenset(rows)) for label, rows in kinds.items()]


def _pairs_layout(trace: Trace, degree: int, left_whole: frozenset[str] = frozenset()) -> Layout:
    """Column-then-row Linear pairs: in a module whose Linear children are all called from the hidden size in, the
    last of them back to it (rowwise) after the others (colwise), one of which makes the rowwise one's input size;
    where none does (a fused qkv), a gathered pair (``_pair``). Pairs whose rowwise Linear is in ``left_whole``
    stay whole."""
    pairs = [p for m in trace.modules.values() for p in _pairs(trace, m) if p.row not in left_whole]
    # a pair one of whose Linears shares a weight with another module stays whole: torch would give each styled
    # module a weight of its own, untying them (``_check_ties``), and half a pair cannot run
    shared = {o for q in trace.params if q.is_shared for o in q.owners}
    tied = [p for p in pairs if shared & {*p.cols, p.row}]
    pairs = [p for p in pairs if p not in tied]
    if not pairs:
        raise PlannerError("no sound tensor-parallel layout for this model: no module holds Linears called as a "
                           "column-then-row pair (Linears from the hidden size, then one Linear back to it, and "
                           "nothing else with params, or two such Linears run one after the other, the first's "
                           "outputs the second's inputs): plan it without --tp, or give a layout in a plan file's "
                           "'tensor_parallel'")
    layout: dict[str, TPStyle] = {}
    for p in pairs:
        layout.update({c: TPStyle.COLWISE_GATHER if p.gathered else TPStyle.COLWISE for c in p.cols})
        layout[p.row] = TPStyle.ROWWISE_SPLIT if p.gathered else TPStyle.ROWWISE
    share = sharded_share(trace, TensorParallel(degree, layout))
    found = [f"{fmt_count(len(some), what)} in {', '.join(sorted({trace.modules[p.parent].cls for p in some}))}"
             for what, some in (("column-then-row Linear pair", [p for p in pairs if not p.gathered]),
                                ("gathered pair", [p for p in pairs if p.gathered])) if some]
    gathered = ("; a gathered pair's first Linears make no width its last one reads (a fused projection such as "
                "qkv, which the model splits by its own widths): their outputs are all-gathered (colwise_gather) "
                "and the last one splits its whole input (rowwise_split), so what runs between them runs whole on "
                "every rank, only their matmuls and weights on 1/TP") if any(p.gathered for p in pairs) else ""
    note = (f"tensor-parallel layout detected: {' and '.join(found)}, {share:.0%} of the params (a module of each "
            "class holding a column-then-row pair is run on random values whole and as the TP ranks run it, and the "
            "layout is refused where the outputs differ: the ops between its Linears must be element-wise or per "
            f"head; a module not run is named in a note{gathered}; every "
            "other module, embeddings, norms and the output head among them, stays whole over TP, sharded by FSDP "
            "alone over 1/TP of the ranks)")
    if tied:
        note += (f"; {fmt_count(len(tied), 'pair')} holding a weight shared with another module left whole "
                 f"({', '.join(sorted(m for p in tied for m in (*p.cols, p.row) if m in shared)[:4])}): TP would "
                 "untie it")
    return Layout(TensorParallel(degree, layout), PAIRS, (note,))


def sharded_share(trace: Trace, tp: TensorParallel) -> float:
    """The share of the model's params a TP layout shards (those of the modules it gives a Linear's or an
    embedding's style); the rest is whole on every TP rank."""
    styled = {m for m, style in tp.styles(trace.modules).items()
              if style in (*WEIGHT_STYLES, TPStyle.EXPERT_TENSOR, *PACKED_EXPERT_STYLES)}
    return sum(q.numel for q in trace.params if any(o in styled for o in q.owners)) / max(1, trace.numel)


_COLWISE = (TPStyle.COLWISE, TPStyle.SEQUENCE_COLWISE)


def _attending(trace: Trace) -> set[str]:
    """The modules that run a fused attention call themselves (an SDPA call in their forward)."""
    return {e.module for e in trace.events if e.kind is EventKind.OP and e.kernel in ATTENTION_KERNELS}


def head_linears(trace: Trace, tp: TensorParallel) -> tuple[int, tuple[str, ...]]:
    """The head dim of the model's fused attention calls (``Trace.attention``, where they share one) and the
    Linears ``tp`` gives a colwise style whose parent module runs such a call: they make its heads, so a rank must
    get whole heads of each (a colwise shard of 6 heads over 4 ranks leaves no whole head to view, whatever the
    model's code). Any layout's: torchtitan's, transformers', a detected one or a plan file's."""
    hd = _head_dim(trace)
    if not hd:
        return 0, ()
    attends = _attending(trace)
    cols = tuple(m for m, s in tp.styles(trace.modules).items()
                 if s in _COLWISE and trace.modules[m].torch_class == "Linear" and parent_of(m) in attends
                 and f"{m}.weight" in trace.index.param_index)
    return hd, cols


def plan_layout(trace: Trace, tp: TensorParallel, model: ModelSpec | None) -> Layout:
    """A plan file's layout as ``check_layout`` takes it: with the model's heads (a built-in config's or
    transformers' config's, as ``tp_layout`` finds them) where the layout shards attention: a colwise Linear in a
    module that runs a fused attention call, or, where no call tells which modules attend (attention written by
    hand, or eager), any colwise Linear."""
    colwise = [m for m, s in tp.styles(trace.modules).items() if s in _COLWISE and trace.modules[m].torch_class]
    attends = _attending(trace)
    shards_attention = any(parent_of(m) in attends for m in colwise) if attends else bool(colwise)
    per_head: frozenset[str] = frozenset()
    plan = hf.parallel_plan(model.name.removeprefix(hf.PREFIX), model.hf_config, _top(trace)) \
        if model is not None and hf.is_hf(model.name) else None
    if plan is not None and model is not None:
        sharded = [m for m, s in tp.styles(trace.modules).items() if s is TPStyle.EMBEDDING_SEQUENCE]
        if sharded:  # (a shape read no trace sees: the fake world's ranks failed in the first attention)
            raise PlannerError(f"the tensor-parallel style embedding_sequence of {sharded[0]} shards its output on "
                               f"the sequence, and {model.name}'s forward (transformers') builds the positions and "
                               "the attention mask from that output's length, which would then be one rank's share "
                               "of the sequence: plan it without sequence parallelism (embedding, colwise and "
                               "rowwise styles, the norms left out), as transformers' own plan does (--tp without a "
                               "plan file)")
        per_head = _hf_colwise(trace, plan)
        _check_rope_keys(trace, tp, plan, model.name)
        if tp.mla_rope_dim and plan.rope_dim and tp.mla_rope_dim != plan.rope_dim:
            raise PlannerError(f"plan 'tensor_parallel.mla_rope_dim' is {tp.mla_rope_dim}, and {model.name}'s rope "
                               f"key is {plan.rope_dim} features (its config's qk_rope_head_dim): give "
                               f"{plan.rope_dim}")
    return Layout(tp, PLAN_FILE, heads=_model_heads(trace, plan) if shards_attention else None, per_head=per_head)


def _model_heads(trace: Trace, plan: hf.HfParallelPlan | None) -> tuple[int, int] | None:
    """(heads, kv heads) of the model where known: transformers' config's for an ``hf:`` model (``plan``), a
    built-in config's (or its attention calls') for torchtitan's structures; None for any other."""
    if plan is not None:
        return (plan.heads, plan.kv_heads) if plan.heads and plan.kv_heads else None
    if is_titan_llama(trace) or is_titan_moe(trace):
        return _llama_heads(trace)
    return None


def _pairs(trace: Trace, parent: ModuleInfo) -> list[_Pair]:
    """The module's column-then-row pairs, where its children make them (``_pairs_layout``): its Linear children
    alone among those with params make one; beside others (a block's norms around its attention and MLP written
    inline, as a hand-written Llama block has them), each run of Linears called one after the other, with no other
    child with params (nor a norm) run between them, makes one where its shapes do (``_pair``: q, k, v then o; w1,
    w3 then w2). Which of them reads which is not known from shapes: the numbers check (``check_local_shapes``)
    judges each kind, and one whose code does not take the split is left whole."""
    if parent.params:
        return []
    children = [trace.modules[c] for c in parent.children if c in trace.modules]
    linears = sorted((c for c in children if c.cls == "Linear" and c.first_use >= 0), key=lambda c: c.first_use)
    # (a norm splits a run even without params: a DiT block's LayerNorm(elementwise_affine=False) between its
    # attention and its MLP made one run of qkv, proj and fc1 before fc2: a new user's trial)
    others = [c for c in children if c.cls != "Linear" and (trace.index.subtree_numel.get(c.fqn, 0)
                                                            or "Norm" in c.cls)]
    if not others:
        pair = _pair(trace, parent.fqn, linears)
        return [pair] if pair else []
    called = trace.index.boundaries_by_module  # (by first call, event positions as first_use: a norm without
    # params reads none; a ModuleList, never called, by its subtree's first use)

    def first(c: ModuleInfo) -> int:
        return called[c.fqn][0] if called.get(c.fqn) else c.first_use

    runs: list[list[ModuleInfo]] = [[]]
    for c in sorted(linears + [c for c in others if first(c) >= 0], key=first):
        if c.cls == "Linear":
            runs[-1].append(c)
        elif runs[-1]:
            runs.append([])
    runs = [part for run in runs for part in _split_at_attention(trace, parent.fqn, run)]
    return [p for p in (_pair(trace, parent.fqn, run) for run in runs if len(run) >= 2) if p]


def _split_at_attention(trace: Trace, parent: str, run: list[ModuleInfo]) -> list[list[ModuleInfo]]:
    """A run of Linears with a fused attention call of the module's among them: the first Linear after the call
    reads the attention's output (o), and ends the run's first pair (q, k, v then o); the Linears after it make
    their own (a GPT-J block's parallel MLP from the same norm: fc_in, fc_out; as one run, o was made colwise and
    one TP rank's step failed)."""
    if len(run) < 3:
        return [run]
    lo, hi = run[0].first_use, run[-1].first_use
    attention = next((i for i in range(lo, hi) if trace.events[i].kind is EventKind.OP and not trace.events[i].backward
                      and trace.events[i].kernel in ATTENTION_KERNELS and is_within(trace.events[i].module, parent)),
                     None)
    if attention is None:
        return [run]
    k = next(i for i, c in enumerate(run) if c.first_use > attention)
    return [run[:k + 1], run[k + 1:]]


def _pair(trace: Trace, parent: str, linears: list[ModuleInfo]) -> _Pair | None:
    """``linears`` (in call order) as one pair: all but the last colwise, from the hidden size, one of them making
    the last one's input; the last rowwise, back to the hidden size. Where none makes its input size (a fused qkv,
    3 x width, which the model splits by its own widths: a contiguous split of its columns gives no whole heads),
    a gathered pair: sound whatever runs between them, which runs whole."""
    if len(linears) < 2:
        return None
    shapes = {m.fqn: trace.param(f"{m.fqn}.weight").shape for m in linears if f"{m.fqn}.weight" in
              trace.index.param_index}
    if len(shapes) != len(linears) or any(len(s) != 2 for s in shapes.values()):
        return None
    hidden = shapes[linears[0].fqn][1]
    row = linears[-1].fqn
    cols = tuple(m.fqn for m in linears[:-1])
    if shapes[row][0] != hidden or any(shapes[c][1] != hidden for c in cols):
        return None
    return _Pair(parent, cols, row, gathered=not any(shapes[c][0] == shapes[row][1] for c in cols))


def _modified_region(trace: Trace, module: str) -> str:
    """The outermost module returning ``module``'s output as its own (each of them ``output_modified``)."""
    while module != ROOT and parent_of(module) != ROOT and trace.modules[parent_of(module)].output_modified:
        module = parent_of(module)
    return module


def _without_modified_outputs(trace: Trace, found: Layout) -> Layout:
    """Leave whole over TP each region whose output the model modifies in place after it returns (Llama 4's MoE
    adds the routed experts' sum into its shared expert's output): the output of a TP style is a DTensor's local
    tensor, a view autograd refuses to modify in place (transformers' own TP of Llama 4 raises there). Whole, the
    region runs on the replicated input every TP rank has and trains as without TP; a layout that shards the
    sequence between the blocks would hand it a shard, and is refused."""
    styles = found.tp.styles(trace.modules)
    regions = sorted({_modified_region(trace, m) for m in styles if trace.modules[m].output_modified})
    if not regions:
        return found
    cleared = {m for m in styles if any(is_within(m, r) for r in regions)}
    where = _patterns(regions)
    if found.tp.sequence_parallel:
        raise PlannerError(f"the model modifies the output of {where} in place after it returns, which no "
                           "tensor-parallel style's output can take (autograd refuses it on a DTensor's local "
                           f"tensor), and {found.source} shards the sequence around it: plan it without --tp")
    layout: dict[str, TPStyle] = {}
    for pattern, style in found.tp.layout.items():
        hits = [m for m in styles if matches(pattern, m)]
        kept = [m for m in hits if m not in cleared]
        if len(kept) == len(hits):
            layout[pattern] = style
        else:  # (only some of its modules left whole: the others by name)
            layout.update(dict.fromkeys(kept, style))
    note = (f"{where} left whole over TP: the model modifies its output in place after it returns, which no TP "
            "style's output can take (a DTensor's local tensor is a view autograd refuses to modify in place; "
            "transformers' own TP raises there)")
    # (loss parallel runs with a sequence-parallel layout's head only: none here)
    tp = replace(found.tp, layout=layout,
                 mla_rope_dim=found.tp.mla_rope_dim if TPStyle.MLA_KV_A_PROJ in layout.values() else 0)
    return replace(found, tp=tp, notes=(*found.notes, note))


def _patterns(modules: list[str]) -> str:
    """``modules`` named as patterns, each block index a ``*`` (``model.layers.*.feed_forward.shared_expert``)."""
    named = dict.fromkeys(".".join("*" if part.isdigit() else part for part in m.split(".")) for m in modules)
    return " and ".join(named)


def _without_split_ties(trace: Trace, found: Layout) -> Layout:
    """A param shared by several modules (tied embeddings) is sharded one way or left whole: when the layout would
    give its owners different styles, all of them stay whole over TP (said in a note)."""
    styles = found.tp.styles(trace.modules)
    split = sorted({o for p in trace.params if p.is_shared
                    for o in p.owners if len({styles.get(x) for x in p.owners}) > 1})
    if not split:
        return found
    layout = {k: s for k, s in found.tp.layout.items() if not any(matches(k, o) for o in split)}
    note = f"{' and '.join(split)} share a weight: left whole over TP"
    whole = {found.tp.layout[k] for k in found.tp.layout.keys() - layout.keys()}
    if whole & {TPStyle.EMBEDDING_SEQUENCE, TPStyle.SEQUENCE_COLWISE}:
        # the embedding no longer shards the sequence for the first norm, nor does the head gather it after the last
        # (torchtitan's Llama on a tied model: every rank failed, "got mixed torch.Tensor and DTensor")
        if TPStyle.MOE_SEQUENCE in layout.values():  # (its MoE layers take and give the sequence sharded)
            raise PlannerError(f"{' and '.join(split)} share a weight, which TP must leave whole, and this model's "
                               "tensor-parallel layout (torchtitan's MoE) needs the sequence sharded from the "
                               "embedding on: plan it without --tp, or untie them")
        layout = {k: _WITHOUT_SP.get(s, s) for k, s in layout.items() if _WITHOUT_SP.get(s, s) is not None}
        note += ", so the layout runs without sequence parallelism (norms whole, each block's output all-reduced)"
    # loss parallel needs the head's vocab-sharded output: a head left whole, or one that lost its style, has none
    tp = replace(found.tp, layout=layout,
                 loss_parallel=found.tp.loss_parallel and TPStyle.SEQUENCE_COLWISE in layout.values(),
                 mla_rope_dim=found.tp.mla_rope_dim if TPStyle.MLA_KV_A_PROJ in layout.values() else 0)
    return replace(found, tp=tp, notes=(*found.notes, note))


# a sequence-parallel style -> the same region's style without sequence parallelism (None: left whole)
_WITHOUT_SP: dict[TPStyle, TPStyle | None] = {
    TPStyle.ROWWISE_SEQUENCE: TPStyle.ROWWISE, TPStyle.EMBEDDING_SEQUENCE: TPStyle.EMBEDDING,
    TPStyle.SEQUENCE_PARALLEL: None, TPStyle.GATHER_INPUT: None, TPStyle.SEQUENCE_COLWISE: None}


def _note(found: Layout, line: str) -> Layout:
    return replace(found, notes=(*found.notes, line))


def check_layout(trace: Trace, layout: Layout, cluster: Cluster | None = None, seq_len: int | None = None) -> None:
    """Refuse a degree that does not divide what TP splits: the heads, each sharded param's dim (hidden and
    feed-forward sizes, the vocab of an embedding or output head), the sequence under sequence parallelism, and
    the GPUs of a node (TP stays inside one) and the world; and a style torch cannot apply to its module."""
    tp = layout.tp
    d = tp.degree
    if d == 1:
        return
    asked = layout.asked
    if cluster is not None and (cluster.gpus_per_node % d or cluster.world_size % d):
        world = f" and its {fmt_count(cluster.world_size, 'GPU')}" \
            if cluster.world_size % d and cluster.world_size != cluster.gpus_per_node else ""
        raise PlannerError(f"{asked} must divide the {fmt_count(cluster.gpus_per_node, 'GPU')} of a node of "
                           f"{cluster.name} (TP stays inside a node, on NVLink){world}")
    check_style_classes(tp, trace.modules)
    if layout.heads is not None and any(h % d for h in layout.heads):
        raise PlannerError(f"{asked} must divide the model's {layout.heads[0]} attention heads and "
                           f"{layout.heads[1]} kv heads: choose a degree that divides both")
    if seq_len is not None and tp.sequence_parallel and seq_len % d:
        raise PlannerError(f"{asked} shards the sequence between the blocks (sequence parallelism): --seq "
                           f"{seq_len:,} must be a multiple of {d}")
    head_dim, linears = head_linears(trace, tp)
    for module in linears:
        features = trace.param(f"{module}.weight").shape[0]
        # a head's width in this Linear: the attention's head dim, or, for a Linear transformers' own plan shards
        # by heads where the model's head counts are known, what it makes per head (MLA's kv_b_proj makes each
        # head's key part and its value: 128 + 128 wide in DeepSeek-V3, whose attention runs at 192)
        widths = [head_dim, *(features // h for h in layout.heads or () if h and features % h == 0
                              and module in layout.per_head)]
        if all(features % (w * d) for w in widths):
            heads = features / head_dim
            raise PlannerError(f"{asked} must give each rank whole attention heads of {module}: its {features:,} "
                               f"output features are {heads:g} head{'' if heads == 1 else 's'} of {head_dim} "
                               "(the head dim its attention runs at): choose a degree that divides them")
    _check_per_head_params(trace, tp, layout.heads, head_dim, linears, asked)
    for module, style in tp.styles(trace.modules).items():
        if not trace.forward_calls(module) and _params_read(trace, module):  # (a module the step never uses
            # at all: its sharded params meet nothing)
            raise PlannerError(f"the tensor-parallel style {style.value} of {module}: the step never calls its "
                               "forward (its params are read by another module's forward, as nn.MultiheadAttention "
                               "reads its out_proj's), so the style's hooks would never run and its sharded params "
                               "would meet whole tensors: give it no style")
        _check_module(trace, module, style, d, asked)
        if trace.modules[module].output_modified:
            raise PlannerError(f"the tensor-parallel style {style.value} of {module}: the model modifies its output "
                               "in place after it returns, which autograd refuses on the local tensor of the DTensor "
                               f"a TP style returns: leave {_modified_region(trace, module)} whole (no style on it "
                               "or the Linears in it)")
    _check_ties(trace, tp)
    _check_embeddings(trace, tp)
    _check_rowwise_inputs(trace, tp)
    _check_colwise_outputs(trace, tp)
    _check_sequence_inputs(trace, tp)


def _check_per_head_params(trace: Trace, tp: TensorParallel, heads: tuple[int, int] | None, head_dim: int,
                           linears: tuple[str, ...], asked: str) -> None:
    """Refuse a module left whole (or replicated) beside the Linears that split the heads when a param of it holds
    a row per head ([heads, head dim]: Cohere's q_norm and k_norm with use_qk_norm, which transformers' plan leaves
    whole): every rank would apply all the heads' rows to its own heads (a shape error on the ranks: a new user's
    trial). A Linear's weight is its style's to split, whatever its shape."""
    counts = set(heads or ()) or {trace.param(f"{m}.weight").shape[0] // head_dim for m in linears}
    parents = {parent_of(m) for m in linears}
    styled = tp.styles(trace.modules)
    for fqn in trace.index.param_index:
        owner = fqn.rpartition(".")[0]
        shape = tuple(trace.param(fqn).shape)
        if len(shape) != 2 or shape[0] not in counts or shape[1] != head_dim or owner in parents or \
                trace.modules[owner].torch_class == "Linear" or styled.get(owner, TPStyle.REPLICATE) is not \
                TPStyle.REPLICATE or any(owner.startswith(f"{m}.") for m in styled):
            continue
        parent = next((p for p in parents if owner.startswith(f"{p}.")), None)
        if parent is not None:
            raise PlannerError(f"{asked} splits {parent}'s heads, but {fqn} {list(shape)} holds a row per head and "
                               "no style shards it: each rank would apply every head's row to its own heads (a "
                               "shape error on the ranks): plan it without tensor parallelism, or give a layout in "
                               f"a plan file's 'tensor_parallel' that keeps {parent}'s heads whole")


_ROWWISE = (TPStyle.ROWWISE, TPStyle.ROWWISE_SEQUENCE)
_LINEAR_STYLES = (*_COLWISE, *_ROWWISE)


def _weight_order(trace: Trace, styles: dict[str, TPStyle]) -> list[str]:
    """The modules whose weight TP shards, in the order the forward first runs them."""
    return _forward_order(trace, [m for m, s in styles.items() if s in WEIGHT_STYLES])


def _forward_order(trace: Trace, modules: list[str]) -> list[str]:
    """Of ``modules``, those whose forward reads a param, in the order it first does (a holder before what it
    holds)."""
    return [m for _, m in sorted((trace.modules[m].first_use, m) for m in modules if trace.modules[m].first_use >= 0)]

def _check_ties(trace: Trace, tp: TensorParallel) -> None:
    """A param several modules share (tied embeddings) stays whole over TP: ``parallelize_module`` makes each
    styled module's weight a DTensor of its own, untying them (a tied head given colwise_gather in a plan file
    trained two weights where the plan holds one: FSDP's bytes 20-27% off on the fake process group)."""
    styles = tp.styles(trace.modules)
    for p in trace.params:
        styled = sorted(o for o in p.owners if styles.get(o) in WEIGHT_STYLES) if p.is_shared else []
        if styled:
            raise PlannerError(f"{' and '.join(p.owners)} share {p.fqn}, and the tensor-parallel style "
                               f"{styles[styled[0]].value} of {styled[0]} would untie it (torch gives each styled "
                               "module a weight of its own): leave the tied modules out of the layout")


def _check_embeddings(trace: Trace, tp: TensorParallel) -> None:
    """An nn.Embedding takes the embedding styles: torch's RowwiseParallel shards an embedding's vocab and its
    ColwiseParallel the embedding dim, not the dims they shard of a Linear, which is what the Linear styles mean
    here (a step modelled on the wrong dim, or a shape error on the ranks)."""
    for m, style in sorted(tp.styles(trace.modules).items()):
        if style in _LINEAR_STYLES and trace.modules[m].torch_class == "Embedding":
            raise PlannerError(f"{m} is an nn.Embedding and its tensor-parallel style {style.value} is a Linear's: "
                               "give it embedding (the vocab sharded, the output all-reduced) or embedding_sequence "
                               "(under sequence parallelism), or no style")


def _check_colwise_outputs(trace: Trace, tp: TensorParallel) -> None:
    """A colwise Linear's output is sharded on the features (``ColwiseParallel``'s ``Shard(-1)``, local tensors),
    which only a rowwise Linear after it takes back whole: in the forward's order of the modules whose weight TP
    shards, the next one after a colwise Linear that is not colwise itself must be a rowwise Linear. An output head
    given colwise would hand the loss 1/TP of the logits (a shape or target error on the ranks): the head's style is
    sequence_colwise (its output sharded only under loss parallel, else gathered whole)."""
    styles = tp.styles(trace.modules)
    order = _weight_order(trace, styles)
    for k, m in enumerate(order):
        if styles[m] is not TPStyle.COLWISE or trace.modules[m].torch_class != "Linear":
            continue
        after = next((x for x in order[k + 1:] if styles[x] is not TPStyle.COLWISE), None)
        if after is None or styles[after] not in _ROWWISE or trace.modules[after].torch_class != "Linear":
            then = (f"the next module whose weight TP shards, {after}, is {styles[after].value}" if after is not None
                    else "no module after it has a weight TP shards")
            way = ("pair it with a rowwise Linear that takes it, or give it colwise_gather (its output gathered "
                   "whole) where what reads it takes a whole input" if after is not None else
                   "an output head takes colwise_gather (its logits gathered whole), or sequence_colwise where the "
                   "layout shards the sequence before it, else leave it out of the layout")
            raise PlannerError(f"the output of {m}, tensor-parallel style colwise, stays sharded on its features over "
                               f"TP, and {then}: {way}")


# styles that take their input sharded on the sequence (``Shard(1)``), and those whose output is
_SEQUENCE_IN = (TPStyle.SEQUENCE_COLWISE, TPStyle.GATHER_INPUT, TPStyle.SEQUENCE_PARALLEL, TPStyle.MOE_SEQUENCE)
_SEQUENCE_OUT = (TPStyle.ROWWISE_SEQUENCE, TPStyle.EMBEDDING_SEQUENCE, TPStyle.SEQUENCE_PARALLEL, TPStyle.MOE_SEQUENCE)


def _check_sequence_inputs(trace: Trace, tp: TensorParallel) -> None:
    """A style that takes its input sharded on the sequence (sequence_colwise, gather_input, sequence_parallel,
    moe_sequence: torch's ``input_layouts=Shard(1)``) reads each rank's local tensor as 1/TP of the sequence, which
    only a sequence-parallel region's output is (rowwise_sequence, embedding_sequence, a sequence_parallel norm, an
    MoE layer's moe_sequence); a whole activation there is taken for a shard, and the gathered sequence is TP times
    too long (a tied head given sequence_colwise after plain colwise / rowwise pairs: "Expected input batch_size (256)
    to match target batch_size (128)" on every rank). So the region run before it, in the forward's order of the
    modules TP styles, must end sequence-sharded: the outermost styled module holding the last one run."""
    styles = tp.styles(trace.modules)
    order = _forward_order(trace, list(styles))
    for k, m in enumerate(order):
        if styles[m] not in _SEQUENCE_IN:
            continue
        before = next((x for x in reversed(order[:k]) if not m.startswith(x + ".")), None)  # not one holding m
        if before is not None:  # what leaves the region: the output of its outermost holder that sets one
            before = next((a for a in reversed(list(proper_ancestors(before)))
                           if styles.get(a) is TPStyle.MOE_SEQUENCE), before)
        if before is None or styles[before] not in _SEQUENCE_OUT:
            fed = (f"the region run before it, {before} ({styles[before].value}), leaves it whole on every rank"
                   if before is not None else "nothing before it shards the sequence")
            raise PlannerError(f"the tensor-parallel style {styles[m].value} of {m} takes its input sharded on the "
                               f"sequence (sequence parallelism), and {fed}: shard the sequence before it (the "
                               "Linear before it rowwise_sequence, its embedding embedding_sequence, a norm between "
                               "them sequence_parallel), or give it a style that takes its input whole")


def _check_rowwise_inputs(trace: Trace, tp: TensorParallel) -> None:
    """A rowwise Linear takes its input sharded on the features (``RowwiseParallel``'s ``Shard(-1)``), which only
    a colwise Linear's output is (then ops element-wise or per head); the output of a rowwise one, an embedding's
    or the model's input is whole on every TP rank. So, in the forward's order of the modules whose weight TP
    shards, the one run just before a rowwise Linear must be a colwise Linear. (What it assumes: a colwise output is
    consumed before the next rowwise Linear runs, as in every attention and feed-forward block the planner knows.)"""
    styles = tp.styles(trace.modules)
    before: str | None = None
    for m in _weight_order(trace, styles):
        if styles[m] in _ROWWISE and trace.modules[m].torch_class == "Linear" and not (
                before is not None and styles[before] in _COLWISE and trace.modules[before].torch_class == "Linear"):
            fed = (f"the module run before it whose weight TP shards, {before}, is {styles[before].value} (its output "
                   "whole on every rank)") if before is not None else "no colwise Linear runs before it"
            raise PlannerError(f"the tensor-parallel style {styles[m].value} of {m} takes its input sharded on the "
                               f"features, as a colwise Linear's output is, and {fed}: give {m} colwise, or give the "
                               "Linear that feeds it colwise")
        before = m


_SHARDED_DIM = {TPStyle.COLWISE: 0, TPStyle.SEQUENCE_COLWISE: 0, TPStyle.EMBEDDING: 0,
                TPStyle.EMBEDDING_SEQUENCE: 0, TPStyle.ROWWISE: 1, TPStyle.ROWWISE_SEQUENCE: 1,
                TPStyle.COLWISE_GATHER: 0, TPStyle.ROWWISE_SPLIT: 1}


def _check_packed_layout(trace: Trace, module: str, style: TPStyle) -> None:
    """A packed experts' style on experts of its layout (``packed_style_of``): on the other, it would shard their
    model dim, not their hidden units (a shape error on the ranks)."""
    shapes = {fqn.rpartition(".")[2]: tuple(trace.param(fqn).shape) for fqn in trace.modules[module].params}
    for name in shapes:
        moe_tp_expert_dim(name, style)  # (a param of another name: refused, named)
    fits = packed_style_of(shapes.get("gate_up_proj", ()), shapes.get("down_proj", ()))
    if fits is not style:
        layout = {TPStyle.MOE_TP_EXPERTS: "[experts, out, in] (Mixtral's)",
                  TPStyle.MOE_TP_EXPERTS_IN_OUT: "[experts, in, out] (Llama 4's)"}
        theirs = f"; its experts' are {layout[fits]}: give it the style {fits.value}" if fits else \
            " (gate_up_proj packing gate and up on the dim down_proj reads)"
        raise PlannerError(f"the tensor-parallel style {style.value} of {module} shards packed experts stored "
                           f"{layout[style]}, and {module} holds gate_up_proj {list(shapes.get('gate_up_proj', ()))}"
                           f" and down_proj {list(shapes.get('down_proj', ()))}{theirs}")


def _params_read(trace: Trace, module: str) -> bool:
    """Whether a forward op reads a param registered on ``module``."""
    first, index = trace.index.first_use, trace.index.param_index
    return any(index[p] in first for p in trace.modules[module].params)


def _check_module(trace: Trace, module: str, style: TPStyle, degree: int, asked: str) -> None:
    """``asked``: the degree as the user gave it (``Layout.asked``)."""
    if style in (TPStyle.EXPERT_TENSOR, *PACKED_EXPERT_STYLES):
        if style in PACKED_EXPERT_STYLES:
            _check_packed_layout(trace, module, style)
        for fqn in trace.modules[module].params:
            shape = trace.param(fqn).shape
            name = fqn.rpartition(".")[2]
            dim, split = (expert_tensor_dim(name), 1) if style is TPStyle.EXPERT_TENSOR \
                else moe_tp_expert_dim(name, style)
            if len(shape) <= dim or shape[dim] % (degree * split):  # (packed: each of gate and up split)
                raise PlannerError(f"{asked} must divide the {shape[dim] if len(shape) > dim else 0:,} hidden "
                                   f"units of each expert of {module} ({style.value}): choose a degree that divides "
                                   "them")
        return
    dim = _SHARDED_DIM.get(style)
    weight = f"{module}.weight"
    if dim is None or weight not in trace.index.param_index:
        return
    shape = trace.param(weight).shape
    if len(shape) > dim and shape[dim] % degree:
        what = "vocab" if style in (TPStyle.EMBEDDING, TPStyle.EMBEDDING_SEQUENCE, TPStyle.SEQUENCE_COLWISE) \
            else ("output features" if dim == 0 else "input features")
        raise PlannerError(f"{asked} must divide the {shape[dim]:,} {what} of {module} ({style.value}): "
                           "choose a degree that divides it")


def tp_degrees(trace: Trace, model: ModelSpec | None, cluster: Cluster, loss_parallel: bool | None = None,
               async_tp: bool = False) -> list[Layout]:
    """The layouts auto tries: each degree of ``TP_DEGREES`` (no TP among them) whose layout exists and passes
    ``check_layout`` on ``cluster``; none beyond no TP for a model with no sound layout, or whose layout is only
    detected or whose heads are unknown (``Layout.checked``)."""
    seq = model.workload().get("seq_len") if model is not None else None
    out = [Layout(TensorParallel(1), "no TP")]
    for degree in TP_DEGREES[1:]:
        try:
            layout = tp_layout(trace, degree, model, loss_parallel, async_tp)
            check_layout(trace, layout, cluster, seq)
        except PlannerError:
            continue
        if not layout.checked:
            break
        out.append(layout)
    return out
