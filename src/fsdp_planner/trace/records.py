"""What a trace knows about a model: its params, its modules and the events of one training step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from fsdp_planner.trace.events import Event, EventKind, OwnCall
from fsdp_planner.trace.index import TraceIndex
from fsdp_planner.trace.infos import ModuleInfo, ParamInfo


@dataclass(frozen=True)
class CompiledBlock:
    """One torch.compile'd module call as AOTAutograd's partitioner and inductor's fusion make it
    (``compiled.py``): the activations it saves for backward, and per pass (forward, backward) the bytes its
    memory-bound kernels move and the kernels it launches."""

    saved: int
    fused_nbytes: tuple[int, int]
    launches: tuple[int, int]
    variants: Mapping[str, int] = field(default_factory=dict)  # what it saves compiled under selective
    # checkpointing: the policy's name -> bytes (the partitioner applying the policy)


class LazyVariants(Mapping[str, int]):
    """``CompiledBlock.variants`` measured when first read, each once: a variant is a dynamo compile of seconds
    (``compiled.py``), and a plan reads the one policy it checkpoints with."""

    def __init__(self, measure: Mapping[str, Callable[[], int]]) -> None:
        self._measure = dict(measure)
        self._measured: dict[str, int] = {}
        self._failed: dict[str, Exception] = {}  # (raised again: a caller that carries on reads it again)

    def __getitem__(self, policy: str) -> int:
        if policy in self._failed:
            raise self._failed[policy]
        if policy not in self._measured:
            try:
                self._measured[policy] = self._measure[policy]()
            except Exception as e:
                self._failed[policy] = e
                raise
        return self._measured[policy]

    def __reduce__(self) -> tuple:
        """Pickled as the plain dict of every variant, each measured (a closure does not pickle)."""
        return dict, (dict(self.items()),)

    def __iter__(self) -> Iterator[str]:
        return iter(self._measure)

    def __contains__(self, policy: object) -> bool:  # (Mapping's would measure it)
        return policy in self._measure

    def __len__(self) -> int:
        return len(self._measure)

    def __repr__(self) -> str:
        return f"LazyVariants({ {p: self._measured.get(p, '(not read)') for p in self._measure} })"


def mapped_variants(variants: Mapping[str, int], fn: Callable[[int], int]) -> Mapping[str, int]:
    """``fn`` of each of ``variants``, read (and measured, where lazy) only when read itself."""

    def one(policy: str) -> int:
        return fn(variants[policy])

    return LazyVariants({p: functools.partial(one, p) for p in variants})


@dataclass(frozen=True)
class CompiledLoss:
    """The loss torch.compile'd apart from the model (torchtitan's ``compile.components`` "loss") as AOTAutograd's
    partitioner and inductor's fusion make it (``compiled_loss.py``): storage bytes, at the trace's dtypes."""

    inputs: int  # the loss's inputs from the model (its outputs: a language model's logits)
    kept_inputs: int  # of those, what the forward keeps for backward (alive after it, whatever the caller frees)
    forward_peak: int  # the most alive while its forward runs, its inputs included
    saved: int  # what the forward keeps for backward besides its inputs (per-row statistics of the logits)
    backward_peak: int  # the most alive while its backward runs: what was kept, the loss's gradient, what it writes
    grads: int  # the gradients it returns to the model, alive until backward reaches the model
    fused_nbytes: tuple[int, int]  # bytes its fused kernels move, forward and backward (``compiled.py``'s floor)


@dataclass(frozen=True)
class Trace:
    """One traced training step. Immutable: derived views live in ``index``; measured op times make a new
    Trace (``with_op_seconds``)."""

    params: tuple[ParamInfo, ...]
    modules: Mapping[str, ModuleInfo]  # canonical name -> info, in registration (named_modules) order
    events: tuple[Event, ...]
    fingerprint: str
    buffers_nbytes: int = 0
    inputs_nbytes: int = 0  # the step's inputs, as given and cast (``session.inputs_nbytes``): alive all step
    op_seconds: tuple[float, ...] | None = None  # measured seconds per event (0 for boundaries), see measure.py
    compute_itemsize: int | None = None  # bytes per element params were cast to for the trace (None: their own)
    method_calls: Mapping[tuple[str, int], str] = field(default_factory=dict)  # (module, call) -> method name: calls
    # of a non-forward method that reads the module's params outside its forward (trace/methods.py); recorded as calls
    # of the module, which FSDP2 hooks only when the plan registers the method (Plan.forward_methods)
    loss_blocks: tuple[tuple[int, int, int], ...] = ()  # the loss region's storages: (made at, freed before or -1,
    # bytes), ``step.LossRegion.blocks``
    notes: tuple[str, ...] = ()  # what the trace assumed where the model could not tell it (a stand-in, a kernel),
    # one line each, for the commands to print
    compiled: Mapping[str, CompiledBlock] = field(default_factory=dict)  # module -> what its call saves and moves
    # when torch.compile'd (``compiled.py``): the modules the step runs compiled; empty: an eager step
    compiled_loss: CompiledLoss | None = None  # the loss torch.compile'd (``compiled_loss.py``), which the loss
    # region's live bytes and memory-bound bytes already are; None: the loss runs eager
    loss_chunks: int = 0  # the output layer and the loss run in this many chunks of the tokens, each with its
    # backward (``chunked_loss.py``: torchtitan's ChunkedLossWrapper), which the events' bytes already are; 0: whole
    loss_buffer: int = 0  # with loss_chunks: bytes of the wrapper's fp32 buffer of the hidden states' gradient,
    # alive through the chunks (``sim/memory.py``), whole on each TP rank
    tensor_parallel: tuple = ()  # a per-TP-rank view (``sim/tensor_parallel.py``): the TP layout's signature
    # (degree, layout, loss parallel, async TP); empty: the whole model on one rank
    float8_tp: frozenset[str] = frozenset()  # in a TP view: the modules in torchao's float8 TP styles
    # (``fsdp2/float8.py``'s ``tp_float8_all_gather``); empty: torch's styles
    expert_parallel: tuple = ()  # a per-EP-rank view (``sim/expert_parallel.py``): the EP signature (degree,
    # modules, skew); empty: every expert on every rank
    expert_params: tuple[int, ...] = ()  # in an EP view: the params of the expert modules (sharded by FSDP over
    # the EP-reduced mesh, dp_shard / EP ranks)
    replicated_grads: tuple[int, ...] = ()  # in a TP view: the params whose grad DTensor makes whole on each TP rank
    # (a vocab-parallel embedding's weight, ``sim/tensor_parallel.py``) until FSDP2's post-backward keeps its shard
    full_precision: tuple[str, ...] = ()  # modules traced in fp32 under the compute dtype (``full_precision.py``):
    # each needs an fp32 group (``Group.param_dtype``); empty: every module in the compute dtype
    cast_inputs: tuple[str, ...] = ()  # modules that get float32 activations under the compute dtype, which FSDP2
    # casts at their pre-forward only when a group lists them (``input_casts.py``): every plan lists them
    own_checkpointed: tuple[OwnCall, ...] = ()  # the calls the model's own torch.utils.checkpoint holds
    # (``own_checkpoint.py``), outermost in each region: each region modelled as one call checkpointed in full
    attention: tuple[tuple[int, int, int], ...] = ()  # (query heads, key heads, head dim) of the step's fused
    # attention calls (SDPA's), each distinct, sorted: what a TP degree must divide (``planners/tensor_parallel.py``)
    attention_batch: int = 0  # dim 0 of those calls' query (the largest): the local batch of the (batch, sequence,
    # dim) activations sequence parallelism shards, on which funcol's all-gather copies only past 1
    # (``sim/tensor_parallel.py``); 0: no fused attention seen
    stood_in: tuple[str, ...] = ()  # the modules a data-dependent op ran in as the balanced-routing stand-in
    # (``routing.py``), sorted ("" the root): where a real step's shapes may differ from rank to rank
    host_reads: tuple[str, ...] = ()  # a model without routing: the modules whose forward read a tensor's value on
    # the host (``.item()``, ``bool()``: an ``if`` or a loop count on the data), sorted: the trace followed the
    # stand-in's answer, and a rank whose data answers otherwise runs another step (``pitfalls.py``)
    offset_rows: tuple[str, ...] = ()  # the modules a ``torch._grouped_mm`` of 2-D rows split by offsets ran in
    # (torchtitan's GroupedExperts' form: the layer's token list, not an (experts, rows, dim) block)

    @property
    def traced_itemsize(self) -> int:
        """Bytes per element the model was traced in: the compute dtype it was cast to, else its widest param
        dtype."""
        return self.compute_itemsize or max((p.itemsize for p in self.params), default=4)

    @property
    def ep_degree(self) -> int:
        return self.expert_parallel[0] if self.expert_parallel else 1

    @property
    def tp_degree(self) -> int:
        return self.tensor_parallel[0] if self.tensor_parallel else 1

    @property
    def ep_shard_degree(self) -> int:
        """EP's ranks out of dp_shard: the EP degree, or EP / TP in an EP view of a TP view (EP's ranks span the
        TP ranks, torchtitan's expert TP of 1); the experts' FSDP mesh is dp_shard / this many ranks."""
        return self.ep_degree // self.tp_degree if self.expert_parallel else 1

    @property
    def forward_methods(self) -> list[tuple[str, str]]:
        """(module, method) pairs the step calls, in call order, each once."""
        return list(dict.fromkeys((m, name) for (m, _), name in self.method_calls.items()))

    def forward_calls(self, module: str) -> int:
        """The step's calls of ``module``'s forward (its calls less those of its other methods): where its hooks,
        FSDP2's and a TP style's, run."""
        return self.modules[module].calls - sum(1 for m, _ in self.method_calls if m == module)

    @cached_property
    def index(self) -> TraceIndex:
        return TraceIndex(self.params, self.modules, self.events)

    @cached_property
    def full_precision_params(self) -> frozenset[int]:
        """Indices of the params of ``full_precision`` modules and their submodules: all-gathered and computed in
        fp32 (their grads too) while the rest run in the compute dtype."""
        out: set[int] = set()
        stack = list(self.full_precision)
        index = self.index.param_index
        while stack:
            info = self.modules[stack.pop()]
            out.update(index[p] for p in info.params)
            stack.extend(info.children)
        return frozenset(out)

    @cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @cached_property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def param(self, fqn: str) -> ParamInfo:
        return self.params[self.index.param_index[fqn]]

    @property
    def fwd_flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind is EventKind.OP and not e.backward)

    @property
    def bwd_flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind is EventKind.OP and e.backward)

    def with_compiled(self, blocks: Mapping[str, CompiledBlock]) -> Trace:
        """This step with ``blocks``' modules compiled (``compiled``)."""
        return replace(self, compiled=dict(blocks))

    def with_op_seconds(self, seconds: tuple[float, ...]) -> Trace:
        if len(seconds) != len(self.events):
            raise ValueError(f"got {len(seconds)} op times for a trace of {len(self.events)} events")
        return replace(self, op_seconds=tuple(seconds))
