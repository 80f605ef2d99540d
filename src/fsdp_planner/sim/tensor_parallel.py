"""A step of a plan with tensor parallelism, as one TP rank runs it: the data-parallel simulation of a per-rank view.

torchtitan's ``parallelize`` first parallelizes the model over the ``tp`` mesh dim, then ``fully_shard``s it over the
data-parallel dims, which shards each TP-local param again (FSDP2's strided sharding: dim 0 of the local shard).
So one TP rank is an FSDP2 rank of a smaller model on the data-parallel mesh, and ``tp_view`` turns the traced step
of the whole model into that rank's step (``TPView``):

- params: their TP-local shapes (colwise: dim 0 / TP, bias too; rowwise: weight dim 1 / TP, bias replicated;
  a vocab-parallel embedding: dim 0 / TP; sequence-parallel norms and the rest replicated);
- ops: those of the modules the layout parallelizes (and of the lowest module holding a colwise then a rowwise
  Linear: heads or hidden units local) run on 1/TP of the work; with sequence parallelism so do the ops between
  those regions (norms, residual adds: a sequence shard); an embedding's lookup makes its whole (partial) output;
  under loss parallel the loss runs on vocab-sharded logits. What a region's first Linear saves for backward is
  its input as the region sees it: all-gathered from the sequence shard (``PrepareModuleInput``), or replicated,
  the whole activation (real DTensor saves the all-gathered local tensor, checked on the fake process group); a
  rowwise Linear's matmul makes the whole output's partial sums on every rank (``_output_share``: what an
  op-level policy keeps of it), which its reduce-scatter makes a 1/TP sequence shard;
- TP's own collectives, as ops of the compute stream (eager DTensor waits on each; ``KERNEL_TP_*``): the all-gather
  of a region's sequence-sharded input and its reduce-scatter in backward; the reduce-scatter of a rowwise output
  onto the sequence dim (an all-reduce without sequence parallelism) and its all-gather in backward; a colwise
  Linear's input gradient all-reduced without sequence parallelism; a colwise_gather Linear's output all-gathered on
  its last dim and its input's grad all-reduced, a rowwise_split one's output all-reduced and its input's grad
  all-gathered (transformers' gathered styles: what reads their outputs runs whole on every TP rank, only their
  matmuls on 1/TP; the whole tensor's local chunk each takes is a clone); the sequence-parallel norms' weight gradients
  all-reduced (DTensor's partial gradients of replicated params: in FSDP2's post-backward, so only in a micro-batch
  that reduce-scatters, ``KERNEL_TP_GRAD_ALL_REDUCE``); loss parallel's three all-reduces of one value
  per token (max, sum of exponentials, target logit). Under activation checkpointing the forward ones run again
  with the recomputation, as they do for real;
- an attention's boolean mask made the memory-efficient kernel's bias (``OpClass.ATTENTION_MASK``: batch x 1 x
  query x key, no head in it) is made, saved and freed whole on every rank (Gemma 3's sliding-window layers: the
  peak was 12.8% low at seq 2,048 on the fake process group with it at 1/TP); what a region's caller saves of its
  output is charged to the caller's op (``StepRecorder.save``), at the caller's share: a rowwise output
  all-reduced whole (adaLN's ``gate * mlp(x)``), or its sequence shard;
- an MLA kv_a_proj (``MLA_KV_A_PROJ``): whole on every rank, its output split and made again (a copy), its rope
  key's grad all-reduced before its backward. Not modelled: what runs on that output before kv_b_proj (the
  kv_a_layernorm, the rope of the key) runs whole too, charged at 1/TP with its attention (DeepSeek-V3: a norm of
  512 features beside matmuls of 7,168);
- torchtitan's MoE layer under TP with EP (``MOE_SEQUENCE``, ``REPLICATE``, ``TOKEN_SPLIT``): the layer runs on its
  all-gathered input (the router on every token, replicated), its input's grad reduce-scattered back and its
  partial output reduce-scattered (its grad all-gathered), the router gate's weight grads all-reduced; the experts
  run on 1/TP of the routed tokens (the EP view, ``expert_parallel.py``, then sends them to their experts).

Under torchao's float8 TP styles (a plan's ``float8.tp_float8_all_gather``, ``Trace.float8_tp``) the converted
Linears' regions all-gather their input in float8 and their rowwise Linears their output grad, half the bytes
(``FLOAT8_SHARE``) of each and of its re-layout copy; a region saves its gathered input in float8 and a rowwise
Linear its input's float8 copy (``_float8_saved``). Their casts are ``float8.py``'s.

The cluster of that view is the data-parallel one: world / TP ranks, gpus_per_node / TP a node, the same links per
rank (each TP rank's data-parallel collectives run beside the others', on its own NIC). TP's collectives are
costed on the real cluster's TP group (consecutive ranks in a node: ``hardware/cost.py``), or with async TP
overlapped with the matmuls torch's micro-pipeline pass fuses them with (``_overlapped``: not every collective).

Under loss parallel the loss's log-softmax and NLL-loss backward run through DTensor handlers of their own, which
hold more vocab-sharded tensors at once than aten's kernels do (``_handler_extra``).

A vocab-parallel embedding's weight grad is made whole on each TP rank (``Trace.replicated_grads``): DTensor's
``embedding_dense_backward`` has no strategy that keeps the vocab dim sharded (colwise, batch-partial or replicated
only), and on the replicated grad of its output and the replicated token ids it runs replicated, the whole
vocab x dim table; FSDP2's post-backward then takes the rank's ``Shard(0)`` of it (``_get_grad_inner_tensor``:
Replicate to Shard(0), a chunk's clone, no collective) before it drops it (``memory.py``). Llama 3 8B at TP 8:
1,002 MiB of bf16 grad where the rank keeps 125 MiB, beside it at the step's peak.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.tensor_parallel import (
    PACKED_EXPERT_STYLES,
    TensorParallel,
    TPStyle,
    check_moe_styles,
    check_style_classes,
    float8_styled,
    local_param,
    param_style,
)
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.hardware.cost import collective_cost
from fsdp_planner.sim.compute import traced_itemsize
from fsdp_planner.sim.float8 import converted_linears
from fsdp_planner.sim.recompute import CheckpointedCall, made_in_view, view_position
from fsdp_planner.trace.chunked_loss import output_layer
from fsdp_planner.trace.events import (
    ATTENTION_KERNELS,
    KERNEL_OTHER,
    KERNEL_TP_ALL_GATHER,
    KERNEL_TP_ALL_REDUCE,
    KERNEL_TP_GRAD_ALL_REDUCE,
    KERNEL_TP_REDUCE_SCATTER,
    KERNEL_TP_RELAYOUT,
    TP_KERNELS,
    Event,
    EventKind,
    OpClass,
)
from fsdp_planner.trace.infos import ModuleInfo, ParamInfo
from fsdp_planner.trace.records import CompiledBlock, Trace, mapped_variants
from fsdp_planner.trace.tree import ROOT, is_within, parent_of, proper_ancestors

_COLWISE = (TPStyle.COLWISE, TPStyle.SEQUENCE_COLWISE)
_ROWWISE = (TPStyle.ROWWISE, TPStyle.ROWWISE_SEQUENCE)
_EMBEDDING = (TPStyle.EMBEDDING, TPStyle.EMBEDDING_SEQUENCE)
_GATHERED = (TPStyle.GATHER_INPUT, TPStyle.SEQUENCE_COLWISE)  # input all-gathered from its sequence shard
# output reduce-scattered onto the sequence dim (its grad all-gathered back)
_SCATTERED = (TPStyle.ROWWISE_SEQUENCE, TPStyle.EMBEDDING_SEQUENCE, TPStyle.MOE_SEQUENCE)
# a Linear on its own 1/TP of the weight between whole activations: its output gathered, or its input split. What
# a colwise_gather call saves is whole: its replicated input, and the inputs of the op after it that the trace counts
# at its matmul (a SwiGLU's product saves the gathered up_proj output: -5.6% of the peak at 1/TP); a rowwise_split
# call's matmul saves its input's chunk (``_split_saved``)
_WHOLE_AROUND = (TPStyle.COLWISE_GATHER, TPStyle.ROWWISE_SPLIT)
# torchao's float8 TP styles move a bf16 activation in float8: half its bytes (``--float8-tp-all-gather`` needs a
# bf16 compute dtype, ``service/validate.py``)
FLOAT8_SHARE = 2
LOSS_PARALLEL_ALL_REDUCES = 3  # max, sum of exponentials, target logit: one fp32 value per token each
KIND_OF = {KERNEL_TP_ALL_GATHER: CollectiveKind.ALL_GATHER, KERNEL_TP_REDUCE_SCATTER: CollectiveKind.REDUCE_SCATTER,
           KERNEL_TP_ALL_REDUCE: CollectiveKind.ALL_REDUCE, KERNEL_TP_GRAD_ALL_REDUCE: CollectiveKind.ALL_REDUCE}


@dataclass(frozen=True)
class TPView:
    """What one TP rank holds and runs (``trace``) on the data-parallel view of the cluster (``cluster``)."""

    trace: Trace
    cluster: Cluster
    tensor_parallel: TensorParallel

    def plan(self, plan: Plan) -> Plan:
        """``plan`` (with this view's TP, or its data-parallel part already) without its TP, on its data-parallel
        mesh: what FSDP2 does on this view."""
        return data_parallel_plan(plan.replace(tensor_parallel=self.tensor_parallel),
                                  self.cluster.world_size * self.tensor_parallel.degree)


def view_key(tp: TensorParallel, float8: Float8 | None) -> tuple:
    """What one TP rank's view depends on (``tp_view``): the layout, and float8 where its TP styles are torchao's."""
    return tp.signature(), float8.signature() if float8 is not None and float8.tp_float8_all_gather else None


def data_parallel_plan(plan: Plan, world: int) -> Plan:
    """The FSDP2 part of a plan with TP on ``world`` ranks: its groups on its data-parallel mesh."""
    return plan.replace(tensor_parallel=None, mesh=plan.layout(world))


def dp_cluster(cluster: Cluster, degree: int) -> Cluster:
    """The cluster as the data-parallel groups of one TP rank see it; TP stays inside a node. The ``degree``
    groups of a node (one per TP rank) run their collectives at once, so each has 1/``degree`` of the node's
    NICs and of its network bandwidth (a TP-8 group, one rank a node, gets one NIC's worth, as an HSDP replica
    group does)."""
    if cluster.gpus_per_node % degree:
        raise PlannerError(f"tensor parallelism of degree {degree} needs the {cluster.gpus_per_node} GPUs of a node of "
                           f"cluster {cluster.name} to split into TP groups of {degree} (TP stays inside a node)")
    whole = cluster.measured_on()
    return replace(cluster, gpus_per_node=cluster.gpus_per_node // degree,
                   nics_per_node=max(1, cluster.nics_per_node // degree),
                   inter=replace(cluster.inter, bus_bandwidth=cluster.inter.bus_bandwidth / degree),
                   whole_node=(whole.gpus_per_node, whole.nics_per_node, whole.inter))


def node_cluster(cluster: Cluster, degree: int) -> Cluster:
    """The whole cluster back from its data-parallel view (``dp_cluster``): where TP's groups are costed."""
    if degree == 1 and cluster.whole_node is None:
        return cluster
    if cluster.whole_node is None or cluster.whole_node[0] != cluster.gpus_per_node * degree:
        raise ValueError(f"cluster {cluster.name} is not a data-parallel view of TP degree {degree}")  # (a caller's
        # bug: the TP collectives are costed on the view's whole nodes)
    return cluster.measured_on()


class _Layout:
    """The layout on this model: each module's style, the regions whose ops run on TP shards, and the modules
    whose input enters such a region whole (saved whole by their first Linear)."""

    def __init__(self, trace: Trace, tp: TensorParallel, float8: Float8 | None) -> None:
        self.tp, self.t, self.sp = tp, tp.degree, tp.sequence_parallel
        self.styles = tp.styles(trace.modules)
        f8 = float8 is not None and float8.tp_float8_all_gather
        self.float8 = float8_styled(self.styles, converted_linears(trace, float8)) if f8 else frozenset()
        colwise = [m for m, s in self.styles.items() if s in _COLWISE]
        rowwise = {m for m, s in self.styles.items() if s in _ROWWISE}
        pairs = {parent_of(m) for m in colwise if any(parent_of(r) == parent_of(m) for r in rowwise)}
        # per pair's module: its colwise children (the span of its ops on TP shards opens at the first, backward
        # closes at the last) and its rowwise ones (``_outside_spans``)
        self.pair_cols = {p: {m for m in colwise if parent_of(m) == p} for p in pairs}
        self.no_input_grad = {(e.module, e.call) for e in trace.events
                              if e.kind is EventKind.FWD_PRE and e.module in self.styles and not e.grad_inputs}
        self.pair_rows = {p: {m for m in rowwise if parent_of(m) == p} for p in pairs}
        self.row_cols = _row_cols(trace, self.pair_cols, self.pair_rows)
        self.regions = pairs | {m for m, s in self.styles.items()
                                if s in (*_COLWISE, *_ROWWISE, *_GATHERED, *_WHOLE_AROUND)}
        self.embeddings = [m for m, s in self.styles.items() if s in _EMBEDDING]
        gathered = {m for m, s in self.styles.items() if s in _GATHERED}
        roots = gathered | {m for m in pairs if not self._inside(m, gathered)}
        roots |= {m for m in colwise if not self._inside(m, roots)}
        self.roots = roots
        self.gathered = gathered
        self.whole = {m for m, s in self.styles.items() if s is TPStyle.MOE_SEQUENCE}
        # the experts run on 1/TP of the work: of the routed tokens (EP's split) or of their hidden units (expert
        # TP, whose input, the layer's whole one, their first matmul saves whole: a root)
        self.split = {m for m, s in self.styles.items() if s in (TPStyle.TOKEN_SPLIT, TPStyle.EXPERT_TENSOR)}
        check_moe_styles(tp, trace.modules, None)
        self.roots |= {m for m, s in self.styles.items() if s is TPStyle.EXPERT_TENSOR}
        # transformers' packed experts: their ops run whole or on 1/TP op by op (``_packed_shares``)
        self.packed = {m for m, s in self.styles.items() if s in PACKED_EXPERT_STYLES}
        # MLA's kv_a_proj: whole on every rank, its output's rope features' share (their grad all-reduced)
        check_style_classes(tp, trace.modules)
        self.rope_share = {m: _rope_share(trace, m, tp.mla_rope_dim) for m, s in self.styles.items()
                           if s is TPStyle.MLA_KV_A_PROJ}
        self.after_mla = _after_mla(trace, self.styles)
        self._scale: dict[str, float] = {}

    @staticmethod
    def _inside(m: str, modules: set[str]) -> bool:
        return any(a in modules for a in proper_ancestors(m))

    def scale(self, module: str) -> float:
        """The share of the whole step's work that an op of ``module`` does on one TP rank."""
        if module not in self._scale:
            chain = [module, *proper_ancestors(module)] if module != ROOT else [ROOT]
            if any(m in self.embeddings or m in self.packed or m in self.rope_share or m in self.after_mla
                   for m in chain):
                self._scale[module] = 1.0
            elif any(m in self.split for m in chain):  # the experts: 1/TP of the routed tokens or hidden units
                self._scale[module] = 1.0 / self.t
            elif any(m in self.whole for m in chain):  # an MoE layer on its all-gathered input
                self._scale[module] = 1.0
            elif any(m in self.regions for m in chain) or self.sp:
                self._scale[module] = 1.0 / self.t
            else:
                self._scale[module] = 1.0
        return self._scale[module]

    def region_of(self, module: str) -> str | None:
        """The innermost region holding ``module`` (itself included), if any."""
        chain = [module, *proper_ancestors(module)] if module != ROOT else [ROOT]
        return next((m for m in chain if m in self.regions), None)


def _after_mla(trace: Trace, styles: dict[str, TPStyle]) -> frozenset[str]:
    """The modules an MLA attention runs on its kv_a_proj's output before its next colwise Linear (kv_b_proj):
    DeepSeek's kv_a_layernorm, unstyled inside the attention's region but run on the compressed kv whole on every
    rank, its params replicated (counted at 1/TP, its saved fp32 input was 25 MB a layer short on torchtitan's
    DeepSeek-V3 debug model at TP 2)."""
    found: set[str] = set()
    events, by_module = trace.events, trace.index.boundaries_by_module
    colwise = [m for m, s in styles.items() if s in _COLWISE]
    for m, style in styles.items():
        if style is not TPStyle.MLA_KV_A_PROJ:
            continue
        parent = parent_of(m)
        post = next((i for i in by_module.get(m, ()) if events[i].kind is EventKind.FWD_POST), len(events))
        for i in range(post + 1, len(events)):  # (by index: no copy of the events' tail a layer)
            e = events[i]
            if (e.kind is EventKind.FWD_POST and e.module == parent) or styles.get(e.module) in _COLWISE:
                break
            if e.kind is EventKind.FWD_PRE and e.module.startswith(f"{parent}.") and e.module not in styles \
                    and not any(c.startswith(f"{e.module}.") for c in colwise):  # (a wrapper of kv_b_proj is not)
                found.add(e.module)
    return frozenset(found)


def _rope_share(trace: Trace, module: str, rope_dim: int) -> float:
    """The share of an ``MLA_KV_A_PROJ`` Linear's output that is its rope key (its last ``rope_dim`` features)."""
    weight = trace.index.param_index.get(f"{module}.weight")  # (an nn.Linear: ``check_style_classes``)
    features = trace.params[weight].shape[0] if weight is not None else 0
    if features <= rope_dim:
        raise PlannerError(f"the tensor-parallel style mla_kv_a_proj of {module} all-reduces the grad of its "
                           f"output's last {rope_dim} features (mla_rope_dim), and its output has {features}")
    return rope_dim / features


def _outside_spans(trace: Trace, lay: _Layout) -> dict[int, str]:
    """Positions of the events (ops and calls' starts) of a pair's module outside the span from its first colwise
    Linear to its rowwise one (backward: from the rowwise one's start to the last colwise one's end), for a module
    that calls other modules there (the norms and attention of a block whose MLP is written inline): without
    sequence parallelism they run whole on every TP rank. A module holding its pair alone (torchtitan's Attention
    and FeedForward) keeps all its ops on 1/TP, as it always did: what runs outside its span there is a reshape and
    a sum of its inputs' grads, charged at 1/TP on every layout the fake process group checks. Each position ->
    the pair's module."""
    if lay.sp or not lay.pair_cols:
        return {}
    state: dict[str, str] = {}  # pair module -> "inside" its span or not, while a call of it runs
    remaining: dict[str, set[str]] = {}  # backward: its colwise Linears whose backward has not ended
    out: list[tuple[int, str]] = []
    for i, e in enumerate(trace.events):
        _span_state(e, lay, state, remaining)
        if e.is_op or (e.kind is EventKind.FWD_PRE and e.module != ROOT):
            region = lay.region_of(e.module if e.is_op else parent_of(e.module))
            if region in state and state[region] != "inside":
                out.append((i, region))
    calling = {region for i, region in out if trace.events[i].kind is EventKind.FWD_PRE}
    return {i: region for i, region in out if region in calling}


def _row_cols(trace: Trace, cols: dict[str, set[str]], rows: dict[str, set[str]]) -> dict[str, frozenset[str]]:
    """Each rowwise Linear of a pair's module -> the colwise ones of its pair: those first run after the rowwise one
    before it (a module holding two pairs, each two Linears run one after the other, closes one span's backward at
    its own colwise Linear, not at the other pair's)."""
    first = {m: trace.modules[m].first_use if m in trace.modules else -1 for p in cols for m in (*cols[p], *rows[p])}
    out = {}
    for p, rs in rows.items():
        before = -1
        for r in sorted(rs, key=first.__getitem__):
            mine = frozenset(c for c in cols[p] if before < first[c] < first[r])
            out[r], before = mine or frozenset(cols[p]), first[r]
    return out


def _span_state(e: Event, lay: _Layout, state: dict[str, str], remaining: dict[str, set[str]]) -> None:
    """``_outside_spans``' state after boundary ``e``."""
    if e.is_op or e.module == ROOT:
        return
    owner = parent_of(e.module)
    cols, rows = lay.pair_cols.get(owner, set()), lay.pair_rows.get(owner, set())
    if e.module in lay.pair_cols:  # the pair's module itself begins or ends
        if e.kind in (EventKind.FWD_PRE, EventKind.BWD_PRE):
            state.setdefault(e.module, "before")
        elif e.kind in (EventKind.FWD_POST, EventKind.BWD_POST):
            state.pop(e.module, None)
    elif (e.kind is EventKind.FWD_PRE and e.module in cols) or (e.kind is EventKind.BWD_PRE and e.module in rows):
        state[owner], remaining[owner] = "inside", set(lay.row_cols.get(e.module, ()))
    elif e.kind is EventKind.FWD_POST and e.module in rows:
        state[owner] = "after"
    elif e.kind is EventKind.BWD_POST and e.module in cols and state.get(owner) == "inside":
        remaining[owner].discard(e.module)
        if not remaining[owner]:
            state[owner] = "after"


def tp_view(trace: Trace, tp: TensorParallel, cluster: Cluster, float8: Float8 | None = None) -> TPView:
    """One TP rank's step of ``trace`` (the whole model) under ``tp`` on ``cluster``, and the cluster its
    data-parallel groups see (module docstring); ``float8``: the plan's, whose ``tp_float8_all_gather`` moves the
    converted Linears' activations in float8 (``view_key``). Deterministic; build it once per layout."""
    if trace.tensor_parallel:
        raise ValueError("the trace is already a tensor-parallel view")
    if tp.degree == 1:
        return TPView(trace, cluster, tp)
    if cluster.world_size % tp.degree:
        raise PlannerError(f"tensor parallelism of degree {tp.degree} does not divide the {cluster.world_size} GPUs of "
                           f"cluster {cluster.name}")
    return TPView(tp_trace(trace, tp, float8), dp_cluster(cluster, tp.degree), tp)


def tp_trace(trace: Trace, tp: TensorParallel, float8: Float8 | None = None) -> Trace:
    """``tp_view``'s trace alone: one TP rank's step, whatever the cluster (what a plan's counts and bytes without
    hardware are of)."""
    lay = _Layout(trace, tp, float8)
    params = _local_params(trace, lay.styles, tp.degree)
    events, where = _rank_events(trace, lay)
    replicated = tuple(i for i, p in enumerate(trace.params)
                       if p.requires_grad and param_style(p, lay.styles) in _EMBEDDING)
    view = replace(trace, params=params, events=tuple(events), op_seconds=None,
                   modules=_modules(trace.modules, events, where),
                   loss_blocks=_loss_blocks(trace, lay, where, len(events)), tensor_parallel=tp.signature(),
                   replicated_grads=replicated, float8_tp=lay.float8,
                   fingerprint=f"{trace.fingerprint}/tp{tp.degree}" + ("f8" if lay.float8 else ""))
    return view.with_compiled(_local_compiled(trace, view))


def tp_params(trace: Trace, tp: TensorParallel) -> Trace:
    """``tp_trace``'s params alone (each one TP rank's local shard), the events as they are: what a param's shard
    placement reads (FSDP2 shards the TP-local tensors), at a fraction of the view's cost. Its ``tp_degree`` is
    the view's: EP's ranks span TP's, so the experts' FSDP ranks are dp_shard x TP / EP (``ep_shard_degree``)."""
    return replace(trace, params=_local_params(trace, tp.styles(trace.modules), tp.degree),
                   tensor_parallel=tp.signature())


def _local_params(trace: Trace, styles: dict[str, TPStyle], degree: int) -> tuple[ParamInfo, ...]:
    return tuple(local_param(p, param_style(p, styles), degree) for p in trace.params)


def _local_compiled(trace: Trace, view: Trace) -> dict[str, CompiledBlock]:
    """Each compiled block as one TP rank runs it: the whole block's fused bytes and saved bytes scaled by the
    share of its eager memory-bound bytes and saved bytes the rank keeps (its first call). The compile ran on the
    whole block; inductor fuses the local shards the same way, so the fused/eager ratio carries over, where the
    whole block's figures would charge each rank TP times the bytes."""
    out = {}
    for m, block in trace.compiled.items():
        whole, local = _block_bytes(trace, m), _block_bytes(view, m)
        fused = tuple(_share(n, local[k], whole[k]) for k, n in enumerate(block.fused_nbytes))
        out[m] = replace(block, saved=_share(block.saved, local[2], whole[2]), fused_nbytes=fused,
                         variants=mapped_variants(block.variants, functools.partial(_share, local=local[2],
                                                                                    whole=whole[2])))
    return out


def _share(n: int, local: int, whole: int) -> int:
    return int(n * local / whole) if whole else n


def _block_bytes(trace: Trace, module: str) -> tuple[int, int, int]:
    """The memory-bound bytes of ``module``'s first call, forward then backward, and what its forward saves."""
    at = {(trace.events[i].kind, trace.events[i].call): i for i in trace.index.boundaries_by_module.get(module, ())}
    call = min((c for k, c in at if k is EventKind.FWD_PRE), default=None)
    memory_bound = trace.index.op_kernel == KERNEL_OTHER
    spans = [(at.get((pre, call)), at.get((post, call))) for pre, post in
             ((EventKind.FWD_PRE, EventKind.FWD_POST), (EventKind.BWD_PRE, EventKind.BWD_POST))]
    moved = [int(trace.index.op_nbytes[a:b][memory_bound[a:b]].sum()) if a is not None and b is not None else 0
             for a, b in spans]
    (a, b) = spans[0]
    saved = sum(e.saved for e in trace.events[a:b] if e.is_op) if a is not None and b is not None else 0
    return moved[0], moved[1], saved


def _call_bytes(trace: Trace, lay: _Layout) -> dict[tuple[str, int], tuple[int, int]]:
    """(module, call) -> (bytes of its input as the whole step has it, of its output) for the styled modules: the
    sizes of TP's collectives on them (traced dtype)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    stack: list[tuple[str, int, int, int]] = []  # (module, call, input bytes, FWD_PRE position)
    events = trace.events
    for i, e in enumerate(events):
        if e.backward:
            break
        if e.kind is EventKind.FWD_PRE and e.module in lay.styles:
            stack.append((e.module, e.call, e.inputs_nbytes, i))
        elif e.kind is EventKind.FWD_POST and stack and stack[-1][0] == e.module:
            m, call, inputs, start = stack.pop()
            ops = [x for x in events[start:i] if x.is_op]
            style = lay.styles[m]
            first = _routing_weights(trace, ops, inputs) if style is TPStyle.MOE_TP_EXPERTS \
                else 0 if style is TPStyle.MOE_TP_EXPERTS_IN_OUT else _linear_input(trace, ops) or inputs
            out[(m, call)] = (first, ops[-1].out_nbytes if ops else 0)
    return out


INDEX_BYTES = 8  # torch.topk's indices: int64


def _routing_weights(trace: Trace, ops: list[Event], inputs: int) -> int:
    """Bytes of the routing weights a packed experts call takes beside its routed indices (the inputs it sees
    first: the hidden states came before): inputs less the int64 indices, one per routed row, rows from the
    gate_up matmuls' FLOPs (2 x rows x the numel of one expert's gate_up_proj)."""
    rows = 0
    for e in ops:
        for p in e.params:
            info = trace.params[p]
            if e.flops and info.fqn.endswith(".gate_up_proj") and len(info.shape) == 3:
                rows += e.flops * info.shape[0] // (2 * info.numel)
    return max(0, inputs - INDEX_BYTES * rows)


def _linear_input(trace: Trace, ops: list[Event]) -> int:
    """Bytes of a Linear's input from its matmul: tokens (FLOPs / 2 / weight numel) x in-features; 0 if none."""
    for e in ops:
        for p in e.params:
            info = trace.params[p]
            if e.flops and len(info.shape) == 2:
                return e.flops // (2 * info.numel) * info.shape[1] * traced_itemsize(trace)
    return 0


def _tp_op(kernel: int, module: str, nbytes: int, backward: bool, t: int = 1) -> Event:
    # a forward reduce-scatter is what an op-level policy sees as _c10d_functional.reduce_scatter_tensor (torchtitan's
    # save list keeps its output, the rank's 1/``t`` sequence shard of the ``nbytes`` it sends: not run again in a
    # recomputation)
    forward_rs = kernel == KERNEL_TP_REDUCE_SCATTER and not backward
    return Event(EventKind.OP, module, nbytes=nbytes, backward=backward, kernel=kernel,
                 op_class=OpClass.REDUCE_SCATTER if forward_rs else OpClass.OTHER,
                 out_nbytes=nbytes // t if forward_rs else 0)


def _collectives(e: Event, lay: _Layout, sizes: dict, trace: Trace) -> tuple[list[Event], list[Event]]:
    """TP's collectives just before and just after boundary ``e`` (module docstring)."""
    style = lay.styles.get(e.module)
    if style is None or e.is_op:
        return [], []
    inputs, output = sizes.get((e.module, e.call), (0, 0))
    m, kind = e.module, e.kind
    f8 = FLOAT8_SHARE if m in lay.float8 else 1  # cast to float8 before its all-gather
    if kind is EventKind.FWD_PRE and style in (*_GATHERED, TPStyle.MOE_SEQUENCE):
        return [], [_tp_op(KERNEL_TP_ALL_GATHER, m, inputs // f8, False)]
    if style in PACKED_EXPERT_STYLES:
        return _packed_collectives(e, inputs, output), []
    if style is TPStyle.MLA_KV_A_PROJ:
        return _rope_collectives(e, output, lay.rope_share[m])
    whole_input_grad = (m, e.call) not in lay.no_input_grad  # (none where its input needs no grad: the model's
    # own input, a frozen embedding's output)
    if style in _WHOLE_AROUND:
        return _whole_around(e, style, lay, inputs, output, whole_input_grad)
    if kind is EventKind.FWD_POST:
        if style in _SCATTERED:
            return [_tp_op(KERNEL_TP_REDUCE_SCATTER, m, output, False, lay.t)], []
        if style in (TPStyle.ROWWISE, TPStyle.EMBEDDING):
            return [_tp_op(KERNEL_TP_ALL_REDUCE, m, output, False)], []
        if style is TPStyle.SEQUENCE_COLWISE and not lay.tp.loss_parallel:  # the logits made whole
            return [_tp_op(KERNEL_TP_ALL_GATHER, m, output, False)], []
    if kind is EventKind.BWD_PRE and style in _SCATTERED:
        return [], [_tp_op(KERNEL_TP_ALL_GATHER, m, output // f8, True)]
    if kind is EventKind.BWD_POST:
        if style in (*_GATHERED, TPStyle.MOE_SEQUENCE):
            return [_tp_op(KERNEL_TP_REDUCE_SCATTER, m, inputs, True)], []
        if style is TPStyle.COLWISE and not _Layout._inside(m, lay.gathered) \
                and whole_input_grad:  # a replicated input's partial grad
            return [_tp_op(KERNEL_TP_ALL_REDUCE, m, inputs, True)], []
        if style in (TPStyle.SEQUENCE_PARALLEL, TPStyle.REPLICATE):
            # unsharded grads in the compute dtype, as the trace's activations
            grads = sum(p.numel for p in trace.params if m in p.owners and p.requires_grad) * traced_itemsize(trace)
            return ([_tp_op(KERNEL_TP_GRAD_ALL_REDUCE, m, grads, True)] if grads else []), []
    return [], []


def _packed_collectives(e: Event, weights: int, output: int) -> list[Event]:
    """``_collectives`` of transformers' packed experts (``PACKED_EXPERT_STYLES``), before boundary ``e``: the
    partial output all-reduced; backward, the hidden states' (the output's size) and the routing weights' partial
    grads (``weights`` bytes: none for Llama 4's experts, which take the routed rows alone)."""
    if e.kind is EventKind.FWD_POST:
        return [_tp_op(KERNEL_TP_ALL_REDUCE, e.module, output, False)]
    if e.kind is EventKind.BWD_POST:
        return [_tp_op(KERNEL_TP_ALL_REDUCE, e.module, n, True) for n in (output, weights) if n]
    return []


def _rope_collectives(e: Event, output: int, share: float) -> tuple[list[Event], list[Event]]:
    """``_collectives`` of an MLA kv_a_proj (``MLA_KV_A_PROJ``): its output split and made again (a copy) after
    its forward; before its backward, its rope key's partial grad all-reduced and the output's grad made of the two
    parts (a copy)."""
    copy = Event(EventKind.OP, e.module, nbytes=2 * output, backward=e.kind is EventKind.BWD_PRE,
                 kernel=KERNEL_TP_RELAYOUT)
    if e.kind is EventKind.FWD_POST:
        return [copy], []
    if e.kind is EventKind.BWD_PRE:
        return [], [_tp_op(KERNEL_TP_ALL_REDUCE, e.module, int(output * share), True), copy]
    return [], []


def _whole_around(e: Event, style: TPStyle, lay: _Layout, inputs: int, output: int, input_grad: bool
                  ) -> tuple[list[Event], list[Event]]:
    """``_collectives`` of transformers' gathered styles (``_WHOLE_AROUND``): a colwise_gather Linear's output
    all-gathered and its (replicated) input's partial grad all-reduced, the output grad's local chunk taken first;
    a rowwise_split one's input chunk taken, its partial output all-reduced and its input's grad (sharded on its
    last dim) all-gathered. ``input_grad``: whether the call's input needs a grad."""
    m, kind, colwise = e.module, e.kind, style is TPStyle.COLWISE_GATHER
    if kind is EventKind.FWD_PRE and not colwise:  # the whole input's local chunk, cloned
        return [], [_split_copy(m, inputs, lay.t, False)]
    if kind is EventKind.FWD_POST:
        return [_tp_op(KERNEL_TP_ALL_GATHER if colwise else KERNEL_TP_ALL_REDUCE, m, output, False)], []
    if kind is EventKind.BWD_PRE and colwise:  # the whole output grad's local chunk
        return [], [_split_copy(m, output, lay.t, True)]
    if kind is EventKind.BWD_POST and input_grad and not (colwise and _Layout._inside(m, lay.gathered)):
        return [_tp_op(KERNEL_TP_ALL_REDUCE if colwise else KERNEL_TP_ALL_GATHER, m, inputs, True)], []
    return [], []


def _split_copy(module: str, whole: int, t: int, backward: bool) -> Event:
    """The clone of a whole tensor's last-dim chunk that DTensor's Replicate -> Shard(-1) makes (``Shard``'s
    ``_replicate_to_shard``: no collective): a rowwise_split Linear's input, a colwise_gather one's output grad."""
    return Event(EventKind.OP, module, nbytes=2 * whole // t, backward=backward, kernel=KERNEL_TP_RELAYOUT)


def _loss_all_reduces(trace: Trace, lay: _Layout) -> list[Event]:
    """Loss parallel's all-reduces of one fp32 value per token: tokens from the vocab-sharded head's matmul."""
    if not lay.tp.loss_parallel:
        return []
    heads = [m for m, s in lay.styles.items() if s in _COLWISE]
    head = next((e for e in reversed(trace.events) if e.is_op and not e.backward and e.flops and e.params
                 and e.module in heads), None)
    if head is None:
        return []
    weight = trace.params[head.params[0]]
    tokens = head.flops // (2 * weight.numel)
    return [_tp_op(KERNEL_TP_ALL_REDUCE, ROOT, tokens * 4, False)] * LOSS_PARALLEL_ALL_REDUCES


def _rank_events(trace: Trace, lay: _Layout) -> tuple[list[Event], list[int]]:
    """The TP rank's events, and where each of the trace's events went (old position -> new)."""
    sizes = _call_bytes(trace, lay)
    loss_ars, loss = _loss_all_reduces(trace, lay), trace.index.loss_region
    outside = _outside_spans(trace, lay)
    saved_whole, float8_saved = _saved_whole(trace, lay, outside), _float8_saved(trace, lay)
    split_saved, (mask_live, mask_freed) = _split_saved(trace, lay), _mask_bytes(trace, lay)
    t, out, where = lay.t, [], []
    added: list[tuple[int, str]] = []  # the forward ops put in: (position, module), for ``made_in_view``
    packed = _packed_shares(trace, lay)
    for i, e in enumerate(trace.events):
        before, after = _collectives(e, lay, sizes, trace)
        before = [x for c in before for x in _with_relayout(c, trace, lay, i, False)]
        after = [x for c in after for x in _with_relayout(c, trace, lay, i, True)]
        _put_in(out, before, added)
        where.append(len(out))
        if e.is_op:
            s = (1.0 / t if lay.tp.loss_parallel else 1.0) if loss[i] else _op_scale(lay, e.module, i in outside)
            kept = 1.0 if lay.styles.get(e.module) is TPStyle.COLWISE_GATHER or \
                e.op_class is OpClass.ATTENTION_MASK else s  # (``_WHOLE_AROUND``; a mask's bias: whole)
            whole = 1.0 if e.op_class is OpClass.ATTENTION_MASK else s
            e = e._replace(flops=int(e.flops * whole), nbytes=int(e.nbytes * whole), saved=int(e.saved * kept)
                           + saved_whole.get(i, 0) + float8_saved.get(i, 0) + split_saved.get(i, 0),
                           out_nbytes=int(e.out_nbytes * _output_share(lay, e, s)),
                           live=int((e.live - mask_live.get(i, 0)) * s) + mask_live.get(i, 0),
                           grad_live=int(e.grad_live * s),
                           freed=int(e.freed * (lay.scale(e.module) if i in outside else kept))  # (what the
                           + mask_freed.get(i, 0))  # call's own ops saved, at their scale)
            if e.resaved:  # the first save's position in this view, and its bytes at this rank's share
                e = e._replace(resaved=tuple((where[first], k, int(nbytes * kept)) for first, k, nbytes in e.resaved))
            e = e._replace(made_at=made_in_view(e.made_at, trace, where, added, kept))  # (likewise its makers')
            if i in packed:
                e = _packed_op(e, packed[i], t)
            if loss[i] and lay.tp.loss_parallel and trace.compiled_loss is None:  # (a compiled loss's graphs
                # run in the handlers' place: its live bytes are its kernels' already)
                e = e._replace(live=e.live + _handler_extra(e) // (trace.loss_chunks or 1))  # (a chunk's)
            if loss[i] and not e.backward and loss_ars:
                after, loss_ars = loss_ars, []
        elif e.kind is EventKind.FWD_PRE:
            scale = _op_scale(lay, parent_of(e.module), i in outside) if e.module != ROOT else 1.0
            e = e._replace(inputs_nbytes=int(e.inputs_nbytes * scale), kept_inputs=int(e.kept_inputs * scale),
                           made_at=made_in_view(e.made_at, trace, where, added, scale))
        out.append(e)
        _put_in(out, after, added)
    return out, where


def _output_share(lay: _Layout, e: Event, share: float) -> float:
    """The share of op ``e``'s outputs one TP rank makes: its work's ``share``, but all of a rowwise Linear's
    matmul's, the whole tensor's partial sums (``Partial``) on every TP rank until its reduce-scatter or
    all-reduce. What an op-level policy keeps of a Llama block's w2 (its 7th mm: saved) is that whole tensor."""
    partial = e.kernel > 0 and not e.backward and lay.styles.get(e.module) in (*_ROWWISE, TPStyle.ROWWISE_SPLIT)
    return 1.0 if partial else share


def _put_in(out: list[Event], ops: list[Event], added: list[tuple[int, str]]) -> None:
    """TP's ``ops`` put in the view after ``out``'s events, the forward ones noted in ``added`` (their positions and
    modules: ``recompute.made_in_view``)."""
    added += [(len(out) + k, x.module) for k, x in enumerate(ops) if not x.backward]
    out.extend(ops)


def _mask_bytes(trace: Trace, lay: _Layout) -> tuple[dict[int, int], dict[int, int]]:
    """What an attention mask's bias (``OpClass.ATTENTION_MASK``: no head in it) keeps whole on every TP rank: op
    position -> the mask's temporaries alive after a mask op (the run of them so far, each whole: they are freed
    together once the bias is made), and backward op position -> the bias bytes its attention frees beyond its
    scaled share."""
    masks: dict[str, int] = {}
    live: dict[int, int] = {}
    freed: dict[int, int] = {}
    run = 0
    for i, e in enumerate(trace.events):
        if not e.is_op:
            continue
        if not e.backward and e.op_class is OpClass.ATTENTION_MASK:
            run += e.out_nbytes
            live[i] = min(run, e.live)
            masks[e.module] = masks.get(e.module, 0) + e.saved
            continue
        run = 0
        if e.backward and e.kernel in ATTENTION_KERNELS and e.freed and masks.get(e.module):
            freed[i] = int(min(masks.pop(e.module), e.freed) * (1 - lay.scale(e.module)))
    return live, freed


def _packed_shares(trace: Trace, lay: _Layout) -> dict[int, bool]:
    """Op position -> whether it is a boundary (True) or runs wholly on 1/TP (False), for the ops of transformers'
    packed experts that do not run whole. An expert's rows pass its gate_up matmul, the activation and the down
    matmul on this rank's intermediate units; the routed rows before and the weighted, summed output after are
    whole (dim-sized). Forward, the split opens at a gate_up matmul and closes at the down matmul that reads
    down_proj; backward (reversed) at the first matmul and at the gate_up input-grad matmul that reads gate_up_proj.
    A closing matmul is a boundary: its FLOPs on 1/TP, its output whole."""
    if not lay.packed:
        return {}
    out: dict[int, bool] = {}
    split = False
    for i, e in enumerate(trace.events):
        if not e.is_op or not any(is_within(e.module, m) for m in lay.packed):
            split = False if not e.is_op and e.module in lay.packed else split
            continue
        names = [trace.params[p].fqn.rpartition(".")[2] for p in e.params]
        closing = e.flops > 0 and ("gate_up_proj" if e.backward else "down_proj") in names
        if closing:
            out[i], split = True, False
        elif split or e.flops > 0:
            out[i], split = False, True
    return out


def _packed_op(e: Event, boundary: bool, t: int) -> Event:
    """A packed experts' op on one TP rank (``_packed_shares``)."""
    s = 1.0 / t
    e = e._replace(flops=int(e.flops * s), nbytes=int(e.nbytes * s), saved=int(e.saved * s), freed=int(e.freed * s),
                   made_at=tuple((maker, int(nbytes * s)) for maker, nbytes in e.made_at))
    if boundary:
        return e
    return e._replace(out_nbytes=int(e.out_nbytes * s), live=int(e.live * s), grad_live=int(e.grad_live * s))


def _with_relayout(c: Event, trace: Trace, lay: _Layout, i: int, opening: bool) -> list[Event]:
    """TP collective ``c`` with its re-layout copy, if any (``_relayout``): a reduce-scatter's before it, an
    all-gather's after."""
    copy = _relayout(c, trace, lay, i, opening)
    return [*copy, c] if c.kernel == KERNEL_TP_REDUCE_SCATTER else [c, *copy]


def _relayout(c: Event, trace: Trace, lay: _Layout, i: int, opening: bool) -> list[Event]:
    """The copy funcol makes around TP collective ``c`` (put at boundary ``i`` of the trace), if any: NCCL gathers
    and scatters on dim 0, so a sequence-dim (dim 1) collective re-lays its whole tensor out. ``reduce_scatter_single``
    cats the input's dim-1 chunks on dim 0 first (``_chunk_or_narrow_cat``: always a copy);
    ``all_gather_single`` cats the gathered dim-0 chunks on dim 1 after (``_maybe_view_chunk_cat``: a view where the
    local batch is 1, and only there; a gather on the last dim, always a copy: ``_last_dim``). A
    memory-bound op that reads and writes the whole tensor (``KERNEL_TP_RELAYOUT``; a ``CatArrayBatchedCopy``
    kernel in eager, a fused triton ``cat`` compiled). Async TP's fused collectives have none: the micro-pipeline
    consumes and makes the chunks itself. One H200, Llama 3 70B's 4-layer block at TP 8 and local batch 8: 48 such
    kernels a step, 48.4 ms of 493 (``benchmarks/gpu_2d.md``)."""
    kind = KIND_OF.get(c.kernel)
    if kind not in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER) or not c.nbytes:
        return []
    last_dim = _last_dim(lay.styles.get(c.module), trace.events[i].kind)
    if kind is CollectiveKind.ALL_GATHER and trace.attention_batch == 1 and not last_dim:
        return []
    if lay.tp.async_tp and _fused_matmuls(trace.events, i, c.kernel, c.backward, opening, lay.styles):
        return []
    return [Event(EventKind.OP, c.module, nbytes=2 * c.nbytes, backward=c.backward, kernel=KERNEL_TP_RELAYOUT)]


def _last_dim(style: TPStyle | None, kind: EventKind) -> bool:
    """Whether a TP all-gather at a boundary of ``kind`` of a module in ``style`` gathers on the last dim (always a
    copy after it): the logits of an output head, a colwise_gather Linear's output, a rowwise_split one's input
    grad."""
    if kind is EventKind.FWD_POST:
        return style in (TPStyle.SEQUENCE_COLWISE, TPStyle.COLWISE_GATHER)
    return kind is EventKind.BWD_POST and style is TPStyle.ROWWISE_SPLIT


def _handler_extra(e: Event) -> int:
    """Bytes beyond aten's that ``loss_parallel()``'s DTensor handler for loss op ``e`` (already a TP rank's)
    holds at its peak (torch/distributed/tensor/parallel/loss.py). ``_log_softmax`` is decomposed to all-reduce
    the max and the sum of exponentials: ``shifted = x - x_max`` stays alive beside ``exp(shifted)`` and then the
    result, one vocab-sharded tensor more than aten's one-kernel output. ``nll_loss_backward`` computes
    log-softmax's backward with it, ``(grad_input + torch.exp(x)) * grad_output`` on a ``zeros_like(x)``
    ``grad_input``: that, the exponentials and their sum are alive beside its output's first form, two more than
    aten's one output; ``_log_softmax_backward_data`` then returns its gradient as it is, where aten makes one
    more (``live`` after it counts that output)."""
    if e.op_class is OpClass.LOG_SOFTMAX:
        return e.out_nbytes
    if e.op_class is OpClass.NLL_LOSS_BACKWARD:
        return 2 * e.out_nbytes
    if e.op_class is OpClass.LOG_SOFTMAX_BACKWARD:
        return -e.out_nbytes
    return 0


def _op_scale(lay: _Layout, module: str, outside: bool) -> float:
    """The share of an op of ``module`` one TP rank runs; ``outside``: in a pair's module outside its span
    (``_outside_spans``), as the module holding the pair's runs its ops."""
    if outside:
        region = lay.region_of(module)
        return lay.scale(parent_of(region)) if region and region != ROOT else 1.0
    return lay.scale(module)


def _saved_whole(trace: Trace, lay: _Layout, outside: dict[int, str]) -> dict[int, int]:
    """Op position -> bytes it saves beyond its scaled share: the first saving op of each call of a region root
    saves the root's input whole (all-gathered or replicated), which the scaling counted at 1/TP. A pair's module
    whose ops outside its span run whole (``_outside_spans``) has its span's first colwise Linear as that root:
    what it saves is its own input."""
    out: dict[int, int] = {}
    events, open_calls = trace.events, {}
    spans = set(outside.values())
    entered: dict[str, int] = {}  # a span's module -> its call's input bytes
    for i, e in enumerate(events):
        if e.backward:
            break
        if e.kind is EventKind.FWD_PRE and e.module in spans:
            entered[e.module] = e.inputs_nbytes
        if e.kind is EventKind.FWD_PRE and e.module in lay.roots and e.module not in spans:
            open_calls[e.module] = e.inputs_nbytes
        elif e.kind is EventKind.FWD_PRE and e.module != ROOT and parent_of(e.module) in spans \
                and e.module in lay.pair_cols[parent_of(e.module)]:  # the first colwise Linear of the span: its
            # input (counted where it is new; a view of the module's own input counts none: that one's size)
            open_calls.setdefault(e.module, e.inputs_nbytes or entered.get(parent_of(e.module), 0))
        elif e.kind is EventKind.FWD_POST:
            open_calls.pop(e.module, None)
        elif e.is_op and e.saved and open_calls:
            for m in [m for m in open_calls if is_within(e.module, m)]:
                whole = min(open_calls.pop(m), e.saved)  # (in float8 under torchao's styles: ``FLOAT8_SHARE``)
                kept = whole // FLOAT8_SHARE if m in lay.float8 else whole
                out[i] = out.get(i, 0) + kept - int(whole * _op_scale(lay, e.module, i in outside))
    return out


def _float8_saved(trace: Trace, lay: _Layout) -> dict[int, int]:
    """Op position -> bytes a rowwise Linear's call saves beyond its scaled share under torchao's float8 TP styles:
    the float8 copy of its last-dim-sharded input (its style cast it), in place of the input itself where the
    call was the first to save it (the trace counts a storage at its first saver, at whichever of the call's ops
    autograd packed it: a reshape's or the matmul's). Charged at the call's matmul."""
    out: dict[int, int] = {}
    kept = 0  # the call's saved bytes so far, one rank's share
    for i, e in enumerate(trace.events):
        if e.backward:
            break
        if not e.is_op or e.module not in lay.float8 or lay.styles[e.module] not in _ROWWISE:
            kept = 0 if e.kind is EventKind.FWD_PRE else kept
            continue
        kept += int(e.saved * lay.scale(e.module))
        if e.flops:
            local = _linear_input(trace, [e]) // lay.t
            out[i] = local // FLOAT8_SHARE - min(kept, local)
            kept = 0
    return out


def _split_saved(trace: Trace, lay: _Layout) -> dict[int, int]:
    """Op position -> bytes a rowwise_split Linear's matmul saves beyond its scaled share: the clone of its input's
    last-dim chunk (``_split_copy``), a storage of its own even where the whole input was saved before (Olmo2's
    o_proj reads the attention's output, which the trace counts at the attention: the chunk went uncounted)."""
    out: dict[int, int] = {}
    kept = 0  # the call's saved bytes so far, one rank's share (the trace counts its input at whichever of the
    # call's ops autograd packed it: a reshape's or the matmul's)
    for i, e in enumerate(trace.events):
        if e.backward:
            break
        if not e.is_op or lay.styles.get(e.module) is not TPStyle.ROWWISE_SPLIT:
            kept = 0 if e.kind is EventKind.FWD_PRE else kept
            continue
        kept += int(e.saved * lay.scale(e.module))
        if e.flops:
            local = _linear_input(trace, [e]) // lay.t
            out[i], kept = local - min(kept, local), 0
    return out


def _modules(modules: dict[str, ModuleInfo], events: Sequence[Event], where: list[int]) -> dict[str, ModuleInfo]:
    """The modules with their FLOPs on one TP rank and their first use at its new position."""
    fwd = dict.fromkeys(modules, 0)
    bwd = dict.fromkeys(modules, 0)
    for e in events:
        if e.is_op and e.flops and e.module in modules:
            for m in (e.module, *proper_ancestors(e.module)):
                if m in fwd:
                    (bwd if e.backward else fwd)[m] += e.flops
    return {name: replace(info, fwd_flops=fwd[name], bwd_flops=bwd[name],
                          first_use=where[info.first_use] if info.first_use >= 0 else -1)
            for name, info in modules.items()}


def _loss_blocks(trace: Trace, lay: _Layout, where: list[int], events: int) -> tuple[tuple[int, int, int], ...]:
    """The loss region's blocks at their new positions, vocab-sharded under loss parallel."""
    s = 1.0 / lay.t if lay.tp.loss_parallel else 1.0
    return tuple((where[made], view_position(where, freed, events), int(n * s))
                 for made, freed, n in trace.loss_blocks)


def tp_positions(trace: Trace, grad_sync: bool = True) -> np.ndarray:
    """Positions of TP's collectives in a TP rank's trace; without ``grad_sync`` (a micro-batch that accumulates
    grads) not the replicated params' grad all-reduces, which FSDP2 runs with its reduce-scatters."""
    kernels = TP_KERNELS if grad_sync else tuple(k for k in TP_KERNELS if k != KERNEL_TP_GRAD_ALL_REDUCE)
    return np.flatnonzero(np.isin(trace.index.op_kernel, kernels))


def grad_all_reduce_positions(trace: Trace) -> np.ndarray:
    """Positions of the replicated params' grad all-reduces in a TP rank's trace (``KERNEL_TP_GRAD_ALL_REDUCE``)."""
    return np.flatnonzero(trace.index.op_kernel == KERNEL_TP_GRAD_ALL_REDUCE)


def tp_seconds(trace: Trace, cluster: Cluster, times: list[float], scale: float) -> list[float]:
    """``times`` with each TP collective's seconds on its TP group of the whole cluster (``cluster`` is the
    data-parallel view); under async TP less the matmuls micro-pipelining fuses it with (``_overlapped``).
    ``scale``: traced to compute bytes."""
    t = trace.tp_degree
    node = node_cluster(cluster, t)
    costs = {k: collective_cost(node, kind, t, min(t, node.gpus_per_node)) for k, kind in KIND_OF.items()}
    tp = TensorParallel.from_signature(trace.tensor_parallel)
    styles = tp.styles(trace.modules) if tp.async_tp else {}
    async_tp = tp.async_tp
    out = list(times)
    for i in tp_positions(trace).tolist():
        e = trace.events[i]
        seconds = costs[e.kernel].seconds(e.nbytes * scale)
        if async_tp and KIND_OF[e.kernel] is not CollectiveKind.ALL_REDUCE:
            seconds = max(0.0, seconds - _overlapped(trace, times, i, styles))
        out[i] = seconds
    return out


def tp_amax_seconds(trace: Trace, cluster: Cluster) -> Callable[[float], float]:
    """Seconds of one float8 amax all-reduce of so many bytes (a tensorwise scalar, ``float8.TP_AMAX_BYTES``; a
    rowwise vector) on the TP group of the whole cluster (``cluster``: the data-parallel view)."""
    t = trace.tp_degree
    node = node_cluster(cluster, t)
    return collective_cost(node, CollectiveKind.ALL_REDUCE, t, min(t, node.gpus_per_node)).seconds


def _overlapped(trace: Trace, times: list[float], i: int, styles: dict[str, TPStyle]) -> float:
    """Seconds of the matmuls that async TP hides the collective at ``i`` behind: those torch's micro-pipeline
    pass fuses it with (torch/_inductor/fx_passes/micro_pipeline_tp.py). ``fuse_all_gather_matmul`` takes the
    matmuls that read the gathered tensor as their left operand: in forward a region's colwise Linears (not its
    rowwise one), in backward an output gradient's input-gradient matmul (it reads the weight), not the weight
    gradient, which reads it transposed. ``fuse_matmul_reduce_scatter`` needs a matmul to make the reduce-scatter's
    input (``_find_producer_matmul``): a rowwise Linear's output in forward; in backward a region's input gradient
    only when one Linear read its input (the output head): attention's three and the feed-forward's two sum theirs,
    so those reduce-scatters stay whole. Each rank's shard is one chunk of the decomposed matmul, and the chunk
    computed last has no transfer left to hide: (TP - 1) / TP of the fused matmuls' time."""
    events, e = trace.events, trace.events[i]
    opening = events[i - 1].kind in (EventKind.FWD_PRE, EventKind.BWD_PRE) and events[i - 1].module == e.module
    t = trace.tp_degree
    return sum(times[j] for j in _fused_matmuls(events, i, e.kernel, e.backward, opening, styles)) * (t - 1) / t


def _fused_matmuls(events: Sequence[Event], i: int, kernel: int, backward: bool, opening: bool,
                   styles: dict[str, TPStyle]) -> list[int]:
    """The matmuls async TP fuses the collective at ``i`` with (``_overlapped``): of the module call the collective
    opens (after ``i``) or closes (before it). ``i`` may be the collective's own position or, in the whole model's
    trace, the boundary it goes beside: the call's matmuls are found the same."""
    matmuls = _call_matmuls(events, i, opening)
    module = events[i].module
    if opening:
        return [j for j in matmuls if events[j].params] if backward else \
            [j for j in matmuls if styles.get(events[j].module) in _COLWISE]
    if backward:
        readers = [m for m, s in styles.items() if s in _COLWISE and is_within(m, module)]
        return [j for j in matmuls if events[j].params] if len(readers) == 1 else []
    # a forward reduce-scatter: the matmul just before it (the call's ops, last first); the head's logits
    # all-gathered at its end feed no matmul, which the pass would need to fuse it
    return matmuls[:1] if kernel == KERNEL_TP_REDUCE_SCATTER else []


def _call_matmuls(events: Sequence[Event], i: int, opening: bool) -> list[int]:
    """Positions of the matmuls of the module call a TP collective at ``i`` opens (after it, in order) or
    closes (before it, last first)."""
    module, step, j, out = events[i].module, (1 if opening else -1), i, []
    ends = (EventKind.FWD_POST, EventKind.BWD_POST) if opening else (EventKind.FWD_PRE, EventKind.BWD_PRE)
    while 0 <= j + step < len(events):
        j += step
        x = events[j]
        if x.kind in ends and x.module == module:
            break
        if x.is_op and x.kernel > 0:
            out.append(j)
    return out


@dataclass(frozen=True)
class TPCollectives:
    """TP's collectives in a step: counts and bytes (nccl-tests' sizes) by kind, recomputations included."""

    counts: dict[CollectiveKind, int]
    nbytes: dict[CollectiveKind, int]


def tp_collectives(trace: Trace, recomputed: Sequence[CheckpointedCall], scale: float,
                   positions: np.ndarray | None = None, grad_scale: float | None = None) -> TPCollectives:
    """TP's collectives of a TP rank's step: each once, and again where a checkpointed call's forward runs again.
    ``positions``: ``tp_positions(trace)``, when the caller has them; ``grad_scale``: the replicated params' grad
    all-reduces' bytes per traced byte where not ``scale``'s (grads accumulated in another dtype)."""
    counts = dict.fromkeys(KIND_OF.values(), 0)
    nbytes = dict.fromkeys(KIND_OF.values(), 0)
    positions = tp_positions(trace) if positions is None else positions
    runs = collective_runs(positions, recomputed)
    chunked = _per_chunk(trace, positions)
    runs[chunked] *= trace.loss_chunks or 1
    for p, n, c in zip(positions.tolist(), runs.tolist(), chunked.tolist(), strict=True):
        e = trace.events[p]
        kind = KIND_OF[e.kernel]
        counts[kind] += n
        at = grad_scale if grad_scale is not None and e.kernel == KERNEL_TP_GRAD_ALL_REDUCE else scale
        nbytes[kind] += n * int(e.nbytes * at) // (trace.loss_chunks if c else 1)
    return TPCollectives(counts, nbytes)


def _per_chunk(trace: Trace, positions: np.ndarray) -> np.ndarray:
    """Which of the TP collectives at ``positions`` (sorted) a chunked loss runs once a chunk, on its share: those of
    the output layer and the loss, but for the layer's input all-gathered from its sequence shard and its grad
    reduce-scattered back (``SEQUENCE_COLWISE``), which run once on the whole hidden states, as torchtitan's norm
    before the layer emits them replicated (``apply/chunked_loss.py``). All False without chunks."""
    chunked = np.zeros(len(positions), dtype=bool)
    head = output_layer(trace) if trace.loss_chunks else None
    if head is None:
        return chunked
    lo, hi = np.searchsorted(positions, (head.forward.start, head.backward.stop))
    chunked[lo:hi] = True
    events = trace.events
    matmul = next(i for i in head.forward if events[i].is_op and events[i].params)  # (the gather is before it)
    for j in range(lo, hi):
        e = events[positions[j]]
        if e.module == head.module and ((e.kernel == KERNEL_TP_ALL_GATHER and positions[j] < matmul)
                                        or (e.kernel == KERNEL_TP_REDUCE_SCATTER and e.backward)):
            chunked[j] = False
    return chunked


def collective_runs(positions: np.ndarray, recomputed: Sequence[CheckpointedCall]) -> np.ndarray:
    """How many times each collective op at ``positions`` (sorted) runs: once, and again where a checkpointed call's
    forward runs again (not the ops an op-level policy keeps; nothing under activation offloading)."""
    runs = np.ones(len(positions), dtype=np.int64)
    for c in recomputed:
        if c.offload:  # its saved tensors copied out and back: nothing runs again
            continue
        lo, hi = np.searchsorted(positions, (c.fwd_pre, c.end))  # (positions are sorted: a call's are a slice)
        kept = set(c.kept)
        runs[lo:hi] += np.array([p not in kept for p in positions[lo:hi].tolist()], dtype=np.int64)
    return runs
