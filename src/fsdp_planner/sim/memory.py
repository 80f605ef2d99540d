"""Per-rank memory: the one model behind every peak the planner prints.

Static (all step): sharded params and optimizer state (padded, divided by the shard world size), and the model's
buffers (replicated). Over the step, from the FSDP2 replay: the groups' unsharded params while they are gathered
(``Residency``), the all-gather output beside them while it is copied out (just before the group's first use after
each all-gather; under a mixed precision with the shards cast for it beside it at its issue), each param's unsharded
grad from its own first backward op until its group's reduce-scatter (``_grads_from``; the last of them one event
longer, beside the reduce-scatter output: ``_last_grad``), the reduce-scatter input (padded, reduce dtype; FSDP2's
``foreach_reduce``) from its reduce-scatter until the next group's post-backward frees it
(``reduce_scatter_max_input_buffers=1``, the default) or the step ends (the final callback's groups one at a time:
``_final_callback``), the sharded grads from their reduce-scatter on (``zero_grad()`` sets them to None between
steps, its default; with ``set_to_none=False`` they live all step and each reduce-scatter output is a transient
added into them), and the activations saved for backward, from the op that saves them until the backward of the
module call that saved them is done, with activation checkpointing and the loss's live tensors as ``recompute.py``
says. After the last micro-batch, the optimizer step: the static part, the sharded grads, the batch and the step's
own temporaries (foreach Adam's square roots of exp_avg_sq, one state's size: ``sim/optimizer_step.py``). In a TP
view a vocab-parallel embedding's grad is made whole, TP times the rank's shard, and held until its group's
post-backward copies the shard out (``_replicated_grad``, ``sim/tensor_parallel.py``). Sizes come from
``sizing.py``.

The same terms give the classic strategies' rows (``strategy_table``): one device, DDP (plus gradient buckets,
one more copy of the grads), ZeRO-1 and ZeRO-2 (optimizer state, then grads too, divided by the world size),
and FSDP (ZeRO-3): a plan with one group per module that owns params, through the replay above. Each row is one
moment, its peak: without FSDP the activations (largest as forward ends) and the grads (set to None, each
allocated when autograd completes it) held at the same event, never both maxima. Low-precision
copies of the weights are a term of their own: autocast's weight cache (every trainable weight at the compute
dtype, kept for the autocast region), without the cache the largest one, and without FSDP's all-gather cast a
full compute-dtype copy of the model.

FSDP2's memory options. ``CPUOffloadPolicy`` (``offload``) keeps the sharded params, grads and optimizer state on
the CPU: none of them is on the GPU; each all-gather copies its shards in first (into the all-gather buffer, which
holds them anyway) and each reduce-scatter's output is a transient copied out to the CPU. A param sharded on dim 1
(``sizing.py``) is not padded, and costs a copy-out temporary of its unsharded size beside its all-gather output
(counted with the unsharded params, at the event where they are copied out) and a re-laid-out copy
of its unsharded grad at its reduce-scatter (counted with the unsharded grads).

Allocated vs reserved. The peak above is of *allocated* bytes, what real FSDP2 allocates (checked on the fake
process group). A GPU must hold what the CUDA caching allocator *reserves*, and its pools are per stream: a block
freed on one stream is reused only by allocations on that stream (PyTorch's CUDA semantics notes). FSDP2
allocates the all-gather buffers on its all-gather copy-in stream, the reduce-scatter outputs on its
reduce-scatter stream (``foreach_reduce``: ``with stream(reduce_scatter_stream): reduce_output = ...``; FSDP2's
2024 comment: "The RS output is allocated in the RS stream and used in the default stream (for optimizer)") and
everything else on the default stream. Under ``zero_grad()``'s default ``set_to_none=True`` the reduce-scatter
output *is* the sharded grads (they are views of it): when ``zero_grad()`` frees them their blocks stay cached in
that stream's pool, which the next step's activations cannot take. So reserved = the default stream's own peak +
the all-gather buffers' own peak + the reduce-scatter outputs' own peak (the whole sharded grads: 4 bytes per param
over the ranks under fp32 reduce, 3.7 GiB on Llama 3 8B at 8 ranks), peaks that need not coincide (FSDP2's author
on verl#3020: with expandable segments, FSDP2's remaining fragmentation is this inter-stream one). ``Peak.reserved``
is that sum; it assumes ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's and the FSDP2 authors'
recommendation). Without it, block splitting adds fragmentation that depends on the order of allocations and is
not modelled; with it, fragmentation inside the default stream's pool (a large tensor that no free block fits
grows the segment) is modelled for the loss region's few large blocks only (``allocator.py``, ``loss_slack``): the
rest of the step is taken as packed. Plans are fitted to the GPU by ``reserved``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum

import numpy as np

from fsdp_planner.choices import ShardPlacement
from fsdp_planner.fsdp2.checkpointing import plan_checkpointing
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.replay import ChunkedGrads, Collective, Schedule, build_schedule
from fsdp_planner.sim.allocator import loss_region_slack
from fsdp_planner.sim.changes import ONE_BY_ONE, Changes
from fsdp_planner.sim.compute import traced_itemsize
from fsdp_planner.sim.options import Optimizer, SimOptions, ZeroGrad
from fsdp_planner.sim.recompute import (
    Checkpointed,
    activation_deltas,
    checkpointed_calls,
    gradient_flow,
    loss_region_deltas,
    recompute_levels,
)
from fsdp_planner.sim.sizing import GroupFacts, Sizing
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank, by category, at one moment (the peak)."""

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    buffers: int = 0  # the model's registered buffers (not sharded)
    compute_copies: int = 0  # low-precision weight copies made outside FSDP (autocast, plain mixed precision)
    gradient_buckets: int = 0  # DDP
    unsharded_params: int = 0
    all_gather_buffers: int = 0
    unsharded_grads: int = 0
    reduce_scatter_buffers: int = 0
    activations: int = 0
    optimizer_temporaries: int = 0  # what the optimizer step makes beside the state (foreach Adam's square roots)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class Peak:
    """The step's peak of allocated bytes by category, and what the caching allocator reserves for the step."""

    at: MemoryBreakdown
    reserved: int

    @property
    def allocated(self) -> int:
        return self.at.total


class GradSync(Enum):
    """Which micro-batch of a step with gradient accumulation (``set_requires_gradient_sync``) the memory is of."""

    ONLY = "only"  # the step's one micro-batch: grads reduce-scattered in its backward
    FIRST = "first"  # sync off, nothing accumulated before it
    MIDDLE = "middle"  # sync off, the grads of the micro-batches before it accumulated
    LAST = "last"  # sync on: the accumulated grads reduce-scattered with its own


def micro_batch_phases(micro_batches: int) -> tuple[GradSync, ...]:
    """The distinct micro-batches of a step of ``micro_batches`` (memory differs between these only)."""
    if micro_batches == 1:
        return (GradSync.ONLY,)
    return (GradSync.FIRST, *((GradSync.MIDDLE,) if micro_batches > 2 else ()), GradSync.LAST)


# bytes of activation curves one trace keeps (``activation_levels``): a search's plans share a few checkpointing
# sets (58 distinct of 110 asked for in fit's verdict on an 8B Llama), a 671B model's curve is a few MB
ACTIVATION_MEMO_BYTES = 256 * 2**20


def activation_levels(trace: Trace, precision: Precision, checkpointed: Sequence[Checkpointed] = (),
                      workspaces: bool = True) -> np.ndarray:
    """Activation bytes held at each event (index ``len(events)``: after the final callback), at the compute
    dtype: saved in forward, freed when the saving module call's backward is done; the ``checkpointed`` modules'
    calls hold their inputs instead and re-create their activations in backward (``recompute.py``). Computed once
    per trace, checkpointing and dtype while the curves kept stay under ``ACTIVATION_MEMO_BYTES`` (the oldest go
    first): every context of a search on one trace asks for the same few; not to be changed by the caller.
    ``workspaces``: count the buffers GPU kernels allocate for themselves (``Event.workspace``); not on CPU ranks."""
    scale = precision.compute_bytes / traced_itemsize(trace)
    key = ("activation_levels", tuple(checkpointed), scale, workspaces)
    memo = trace.index.memo
    if key not in memo:
        calls = checkpointed_calls(trace, key[1])
        kept = [k for k in memo if k[0] == "activation_levels"]
        size = 8 * (len(trace.events) + 1)
        while kept and (len(kept) + 1) * size > ACTIVATION_MEMO_BYTES:
            del memo[kept.pop(0)]
        memo[key] = np.cumsum(activation_deltas(trace, calls, scale)) + gradient_flow(trace, scale, workspaces) \
            + recompute_levels(trace, calls, scale) + trace.inputs_nbytes  # the batch, held all step
        memo[key].flags.writeable = False
    return memo[key]


def compute_copies(trace: Trace, precision: Precision, sharded: bool) -> int:
    """Low-precision weight copies that FSDP's all-gather cast does not make (module docstring)."""
    trainable = [p.numel for p in trace.params if p.requires_grad]
    if precision.autocast:
        return (sum(trainable) if precision.weight_cache else max(trainable, default=0)) * precision.compute_bytes
    if precision.compute_bytes != precision.param_bytes and not sharded:
        return trace.numel * precision.compute_bytes
    return 0


class MemoryModel:
    """Per-rank memory of one model at one world size and precision: what does not depend on the plan is
    computed once; ``peak`` adds a plan's replay."""

    def __init__(self, trace: Trace, world_size: int, precision: Precision, optimizer: Optimizer,
                 zero_grad: ZeroGrad = ZeroGrad.NONE, like: MemoryModel | None = None,
                 offload: bool = False, placement: ShardPlacement = ShardPlacement.DIM0,
                 float8_gathered: frozenset[int] = frozenset(), float8_casts: np.ndarray | None = None,
                 workspaces: bool = True) -> None:
        """``like``: the model of the same trace and precision at another world size, whose activation levels (they
        do not depend on the world size) are shared. ``offload``, ``placement``: FSDP2's memory options (module
        docstring); ``float8_gathered``: the params all-gathered in float8, ``float8_casts``: the bytes float8's
        casts hold at each event (``sim/float8.py``), counted with the activations; ``workspaces``: GPU ranks,
        whose kernels allocate buffers of their own (``Event.workspace``)."""
        self.trace, self.precision, self.zero_grad, self.offload = trace, precision, zero_grad, offload
        self.workspaces = workspaces
        self.sizing = Sizing(trace, world_size, precision, like.sizing if like is not None else None, placement,
                             float8_gathered=float8_gathered)
        # an EP view's expert params over a shard dim of one rank (EP takes dp_shard whole): FSDP2 reduces them with
        # a gradient divide factor (apply/expert_parallel.py), which at one rank it applies by making the quotient
        # of the whole reduce input and copying it into the output
        self._divided_alone = frozenset(trace.expert_params) if world_size <= trace.ep_shard_degree else frozenset()
        trainable = [i for i, p in enumerate(trace.params) if p.requires_grad]
        shard = 0 if offload else self.sizing.shard_numel(trainable)  # offloaded: on the CPU
        self.static = MemoryBreakdown(
            params=0 if offload else self.sizing.stored_shard_bytes,
            grads=shard * precision.grad_bytes if zero_grad is ZeroGrad.ZEROS else 0,
            optimizer_state=shard * optimizer.state_bytes_per_element(precision.param_bytes),
            buffers=trace.buffers_nbytes,
            compute_copies=compute_copies(trace, precision, sharded=True),
        )
        self.grad_bytes = precision.grad_bytes
        # the step's own temporaries, on the GPU unless it runs on the CPU (offload)
        self.step_temporaries = 0 if offload else shard * optimizer.step_temporary_bytes(precision.param_bytes)
        self._activations: dict[tuple[Checkpointed, ...], np.ndarray] = like._activations if like is not None else {}
        self._casts = float8_casts
        self._loss: np.ndarray | None = None  # the loss region's levels, once asked for (``loss_at_peak``)
        # ``_grads_from``'s, by its arguments
        self._grad_starts: dict[tuple[tuple[int, ...], int, bool], tuple[Sequence[int], Sequence[float]]] = {}
        self._made: dict[int, int] = {}  # ``_backward_start``
        self._first_backward_uses = np.asarray(trace.index.first_backward_use, dtype=np.int64)  # ``_grads_from``
        self._slack: np.ndarray | None = like._slack if like is not None else None  # ``loss_slack``

    def activations(self, checkpointed: Sequence[Checkpointed]) -> np.ndarray:
        """``activation_levels`` for one set of checkpointed modules, computed once per set."""
        key = tuple(checkpointed)
        if key not in self._activations:
            levels = activation_levels(self.trace, self.precision, key, self.workspaces)
            self._activations[key] = levels if self._casts is None else levels + self._casts
        return self._activations[key]

    def peak(self, plan: Plan, schedule: Schedule, phase: GradSync = GradSync.ONLY, sync_every: bool = False) -> Peak:
        """The step's peak (of its micro-batch ``phase``), its breakdown at that moment, and the bytes reserved
        (module docstring). ``sync_every``: every micro-batch reduce-scatters (``GradientSync.EVERY``); after the
        first, the sharded grads it made are held all micro-batch and each reduce-scatter output is added in."""
        n = len(self.trace.events) + 1
        changes = self._changes(plan, schedule, GradSync.ONLY if sync_every else phase,
                                sharded_held=sync_every and phase is not GradSync.FIRST)
        stepped = phase in (GradSync.ONLY, GradSync.LAST)  # the optimizer steps after this micro-batch
        return self._peak_of(changes, n, self.activations(plan_checkpointing(plan)), self.kept_grads(plan),
                             self.loss_slack, stepped)

    @property
    def loss_slack(self) -> np.ndarray:
        """Per event, what the caching allocator reserves for the loss region's blocks beyond their live bytes
        (``allocator.loss_region_slack``), computed once."""
        if self._slack is None:
            self._slack = loss_region_slack(self.trace, self.precision.compute_bytes / traced_itemsize(self.trace))
        return self._slack

    def kept_grads(self, plan: Plan) -> int:
        """Bytes of the sharded grads the step ends with, each group's reduce-scatter output (``zero_grad()``'s
        default ``set_to_none=True``; none on the GPU with offload): what the reduce-scatter stream's pool keeps
        cached into the next step after ``zero_grad()`` frees them (module docstring: allocated vs reserved)."""
        if self.offload or self.zero_grad is not ZeroGrad.NONE:
            return 0
        reducible = self.trace.index.reducible
        shards = (self.sizing.shard_numel(tuple(i for i in g.params if reducible[i])) for g in self.sizing.groups(plan))
        return sum(shards) * self.grad_bytes

    def loss_at_peak(self, plan: Plan, schedule: Schedule) -> int:
        """Of the activations at the step's peak, the loss region's bytes (``loss_region_deltas``: the logits and
        the loss's tensors outside the model, which no sharding shrinks): what a no-fit message must name apart."""
        at = int(self.levels(plan, schedule).argmax())
        if self._loss is None:
            scale = self.precision.compute_bytes / traced_itemsize(self.trace)
            self._loss = np.cumsum(loss_region_deltas(self.trace, scale))
        return round(float(self._loss[at]))

    @property
    def _cache_freed(self) -> int:
        """Autocast's weight cache, gone by the optimizer step (the autocast region has exited)."""
        return self.static.compute_copies if self.precision.autocast else 0

    def _at_step_default(self, activations_left: float) -> float:
        """What the default stream holds while the optimizer steps: the static part less autocast's cache, what is
        left of the activations (the batch) and the step's temporaries (the sharded grads are on the
        reduce-scatter stream's)."""
        return self.static.total - self._cache_freed + activations_left + self.step_temporaries

    def step_level(self, plan: Plan) -> int:
        """Allocated bytes per rank while the optimizer steps after the step's last backward (``_peak_of``)."""
        return round(self._at_step_default(float(self.activations(plan_checkpointing(plan))[-1]))) \
            + self.kept_grads(plan)

    def levels(self, plan: Plan, schedule: Schedule) -> np.ndarray:
        """Allocated bytes per rank at each event position (``i``: while event ``i`` runs; the last: after the final
        callback), from the same terms as ``peak``: the memory curve of forward and backward, whose maximum is the
        peak unless the optimizer step's (``step_level``) is higher."""
        n = len(self.trace.events) + 1
        starts, table = self._changes(plan, schedule).by_position(n)
        dense = np.zeros(n)
        dense[starts] = _row_sums(table)
        return self.static.total + np.cumsum(dense)[:n] + self.activations(plan_checkpointing(plan))

    def _changes(self, plan: Plan, schedule: Schedule, phase: GradSync = GradSync.ONLY,
                 sharded_held: bool = False) -> Changes:
        """The changes of each dynamic category (``_DYNAMIC``) by event position, in the micro-batch ``phase``;
        ``sharded_held``: the sharded grads exist from before the micro-batch (an earlier one's reduce-scatters)."""
        n = len(self.trace.events) + 1
        groups = self.sizing.groups(plan)
        changes = Changes(len(_DYNAMIC))
        self._gathered(changes, schedule, groups)
        if schedule.chunked is not None:  # (every micro-batch runs the chunks)
            self._chunk_accumulated(changes, schedule.chunked)
        reduces = [c for c in schedule.collectives if c.kind is CollectiveKind.REDUCE_SCATTER]
        for c in reduces:  # a TP view's grads made whole: apart from the rest (``_replicated_grad``)
            for p, whole, shard in self.sizing.replicated_grads(c.params):
                self._replicated_grad(changes, p, c.event, whole, shard, phase, n)
        if phase in (GradSync.FIRST, GradSync.MIDDLE):
            for c in reduces:
                self._accumulate(changes, c.event, self.sizing.tp_local_grads(c.params),
                                 min(groups[c.group].first_backward, c.event), n, phase)
            return changes
        per_hook = Counter(c.event for c in reduces)  # post-backward hooks reducing more than one param group
        # HSDP: the reduce-scatters whose output FSDP2 all-reduces over the replicas (``_all_reduce_state``)
        all_reduced = {(c.group, c.event) for c in schedule.collectives if c.kind is CollectiveKind.ALL_REDUCE}
        freed_at, freed = [n] * len(reduces), n
        for k in range(len(reduces) - 1, -1, -1):
            # the next post-backward frees this input buffer before it allocates its own (of a state with several
            # param groups, its last param group's: the others keep it, ``Schedule.keeps_reduce_inputs``); the
            # final callback's, one at a time as replayed (``_final_callback`` puts its moment right)
            freed_at[k] = freed if reduces[k].event < n - 1 else reduces[k + 1].event if k + 1 < len(reduces) else n
            if reduces[k].group not in schedule.keeps_reduce_inputs:
                freed = reduces[k].event
        reduced_at: dict[int, int] = {}  # param -> the event of its last reduce-scatter so far (a chunked loss's)
        for c, end in zip(reduces, freed_at, strict=True):
            if schedule.chunked is not None:  # its tied output layer: reduced after the chunks, then after the
                # embedding's backward (no step without chunks reduces a param twice)
                again = {p: reduced_at[p] for p in c.params if p in reduced_at}
                reduced_at.update(dict.fromkeys(c.params, c.event))
                c = self._reduced_again(changes, c, again, end) if again else c
            self._reduced(changes, c, end, groups, phase, n, sharded_held, per_hook[c.event] > 1 and c.event < n - 1,
                          (c.group, c.event) in all_reduced)
            # (the final callback's param groups reduce one at a time: ``_final_callback``)
        finals = [c for c in reduces if c.event == n - 1]
        if finals and phase is GradSync.ONLY and not (self.offload or sharded_held) \
                and self.zero_grad is ZeroGrad.NONE:
            self._final_callback(changes, finals, plan, schedule, n - 1)
        return changes

    def _gathered(self, changes: Changes, schedule: Schedule,
                  groups: list[GroupFacts]) -> None:
        """The unsharded params (category 0) and the all-gather buffers (1) of the replay's all-gathers."""
        for r in schedule.residency:
            changes.add(0, r.start, r.end, groups[r.group].gather_bytes / r.divisor)
            # dim-1 params are copied out through a temporary of their unsharded size, freed once copied
            changes.add(0, r.start, r.start + 1, self.sizing.shard1_gather_bytes(groups[r.group].params) / r.divisor)
        for c in schedule.collectives:
            if c.kind is CollectiveKind.ALL_GATHER and not self._gathered_alone(groups[c.group].params):
                # the output buffer lives from the issue until FSDP2 frees it (``Collective.output_freed``); a
                # prefetch is issued in a hook after that hook's own copy-out, so it counts from the next event
                at = c.event + c.prefetch
                changes.add(1, at, c.output_freed, groups[c.group].gather_bytes)
                if not self.offload:  # the shards cast to the all-gather dtype, copied in beside it
                    changes.add(1, at, at + 1, self.sizing.gather_cast_bytes(groups[c.group].params, c.ranks))

    def _gathered_alone(self, params: Sequence[int]) -> bool:
        """Expert params over a shard dim of one rank (``_divided_alone``): FSDP2's unshard of a one-rank group
        gathers nothing (its all-gather output is an empty tensor) and copies the shards into the unsharded params
        at the wait, so there is no all-gather buffer; not even kept for the next copy-out (a per-param mesh's
        experts, gathered at their block's hooks and prefetched with it, held one 3.5% above the fake world)."""
        return bool(params) and params[0] in self._divided_alone

    def _chunk_accumulated(self, changes: Changes, chunked: ChunkedGrads) -> None:
        """A chunked loss's output layer (``Schedule.chunked``): its unsharded grads are alive from the first
        chunk's backward to the last's, in every chunk's forward and loss too, where the step counts them from the
        layer's backward on. A group of the layer's own call with gradient sync off but at the last chunk upcasts
        them after the first chunk into an accumulator of the reduce dtype (``FSDPParam.
        to_accumulated_grad_if_needed``), beside each chunk's own grads, which are added in and freed at its
        post-backward (at the last, before the reduce-scatter copies the accumulator in); elsewhere autograd adds
        each chunk's grads into the ones before, both alive at the op that makes them. Beside them, the
        wrapper's fp32 buffer of the hidden states' gradient (``Trace.loss_buffer``)."""
        changes.add(2, chunked.start, chunked.end + 1, self.trace.loss_buffer)  # the hidden states' fp32 gradient
        own = self.sizing.tp_local_grads(chunked.params)
        if chunked.own and self._separate_accumulation:
            changes.add(2, chunked.start, chunked.end + 1, self._accumulated(own))
            changes.add(2, chunked.end, chunked.end + 1, -self.sizing.grad_bytes(own))
        else:  # (and at the op making a chunk's, beside the ones before it is added to)
            changes.add(2, chunked.start, chunked.backward, self.sizing.grad_bytes(own))
            if chunked.weight_grad >= 0:
                changes.add(2, chunked.weight_grad, chunked.weight_grad + 1, self.sizing.grad_bytes(own))

    def _reduced_again(self, changes: Changes, c: Collective, again: dict[int, int], freed: int) -> Collective:
        """Of a reduce-scatter, the params an earlier one of the step reduced (``again``: param -> its event): each
        unsharded grad from the first backward op reading the param after that (autograd makes it anew) to this
        one, and the output added into the sharded grad the earlier one made (alive only in the hook); returns the
        collective with the rest of its params, which ``_reduced`` counts as ever (its reduce input excepted, the
        whole collective's, counted here for these params until ``freed``)."""
        uses, events = self.trace.index.param_uses, self.trace.events
        for p, earlier in again.items():
            start = next((i for i in uses[p] if i > earlier and events[i].backward), c.event)
            own = self.sizing.tp_local_grads((p,))
            changes.add(2, start, c.event + 1, self.sizing.grad_bytes(own))
            changes.add(4, c.event, c.event + 1, self.sizing.shard_numel((p,)) * self.precision.reduce_bytes)
            changes.add(3, c.event, freed, self.sizing.reduce_bytes((p,)))
        return replace(c, params=tuple(p for p in c.params if p not in again))

    def _reduced(self, changes: Changes, c: Collective, freed: int,
                 groups: list[GroupFacts], phase: GradSync, n: int, sharded_held: bool,
                 shared_hook: bool = False, all_reduced: bool = False) -> None:
        """A reduce-scatter's unsharded grads (category 2) up to it, its input buffer (3) until ``freed`` and its
        output, the sharded grads (4), in a micro-batch ``phase`` that syncs; ``shared_hook``: another param group
        reduces in the same post-backward hook; ``all_reduced``: HSDP all-reduces its output (``_sharded_grad``)."""
        first = min(groups[c.group].first_backward, c.event)
        own = self.sizing.tp_local_grads(c.params)
        # an accumulated grad that autograd adds into exists before its call's backward (``_grads_from``)
        own_call = phase is GradSync.ONLY or self._separate_accumulation
        starts, nbytes = self._grads_from(own, first, own_call)
        changes.add_each(2, starts, c.event + 1, nbytes, at_most=c.event)
        if phase is GradSync.LAST:  # the grads accumulated so far, reduce-scattered with this micro-batch's
            changes.add(2, 0, c.event + 1 if self._separate_accumulation else first, self._accumulated(own))
        changes.add(2, c.event, c.event + 1, self.sizing.shard1_grad_peak_bytes(c.params))  # dim-1 grads re-laid out
        changes.add(3, c.event, freed, self.sizing.reduce_bytes(c.params))
        if c.params and c.params[0] in self._divided_alone:  # the quotient FSDP2 copies into the output: after
            # the hook, or, where another param group of the call reduces in the same hook (a per-param mesh), in
            # it (the next event is the next block's pre-backward, which its copy never meets)
            at = c.event if shared_hook else c.event + 1
            changes.add(3, at, at + 1, self.sizing.reduce_bytes(c.params))
        self._sharded_grad(changes, c.event, self.sizing.shard_numel(c.params), n, sharded_held,
                           self.sizing.grad_bytes(own), all_reduced)
        if c.event < n - 1 and not (self.offload or sharded_held) and self.zero_grad is ZeroGrad.NONE \
                and own and len(own) == len(c.params):
            # its last grad beside the output, a moment of its own before the next event (the final callback's:
            # ``_final_callback``): more than the grads the input was copied from where one param dwarfs the rest.
            # Not where a TP view makes a grad whole (``_replicated_grad`` holds its shard)
            # what ``_changes`` holds there already: this micro-batch's grads, and those accumulated apart
            held = self.sizing.grad_bytes(own) + (self._accumulated(own) if phase is GradSync.LAST
                                                  and self._separate_accumulation else 0)
            output = self.sizing.shard_numel(c.params) * self.grad_bytes
            changes.add(2, c.event, c.event + 1, max(0, output + self._last_grad(own, phase) - held))

    def _final_callback(self, changes: Changes, finals: list[Collective], plan: Plan,
                        schedule: Schedule, end: int) -> None:
        """The groups that post-backward in the root's final callback (inputs without grad: an embedding's; the
        root's own params) do so one at a time, in ``named_modules`` order (FSDP2's ``all_states``, the root
        first; a call's param groups the last first: ``Schedule.final_order``): each reshards its params,
        allocates its reduce-scatter input, clears its grads but the last
        (``_last_grad``) and allocates its output, while the groups after it still hold their unsharded params and
        grads. ``_changes`` counts them all at ``end`` at once (every grad, the reduce input of the last it
        replayed); this moves ``end`` to the callback's fullest moment (a small untied LM with its embedding
        alone on 2 fake ranks: -16% without, the root's reduce-scatter beside the embedding's gathered param and
        grad)."""
        order = {g: k for k, g in enumerate(schedule.final_order)}
        replayed_last = finals[-1]
        finals = sorted(finals, key=lambda c: order.get(c.group, len(order)))
        sizes = self.sizing.groups(plan)
        held = dict.fromkeys((c.group for c in finals), 0.0)  # unsharded params held into the callback
        for r in schedule.residency:
            if r.group in held and r.start < end == r.end:
                held[r.group] += sizes[r.group].gather_bytes / r.divisor
        grads = [self.sizing.grad_bytes(self.sizing.tp_local_grads(c.params)) for c in finals]
        relaid = [self.sizing.shard1_grad_peak_bytes(c.params) for c in finals]
        outputs = [self.sizing.shard_numel(c.params) * self.grad_bytes for c in finals]
        moments = []  # (params, grads, reduce input, outputs) at each allocation: the input's, then the output's
        inputs: list[int] = []  # the reduce inputs still held: a call's last param group frees them all first
        for j, c in enumerate(finals):
            if c.group not in schedule.keeps_reduce_inputs:
                inputs.clear()
            inputs.append(self.sizing.reduce_bytes(c.params))
            params, later, reduce_input = sum(held[f.group] for f in finals[j + 1:]), sum(grads[j + 1:]), \
                sum(inputs)
            moments.append((params, later + grads[j] + relaid[j], reduce_input, sum(outputs[:j])))
            last = self._last_grad(self.sizing.tp_local_grads(c.params), GradSync.ONLY)
            moments.append((params, later + last, reduce_input, sum(outputs[:j + 1])))
            if c.params and c.params[0] in self._divided_alone:  # the quotient copied into its output
                moments.append((params, later + last, reduce_input + inputs[-1], sum(outputs[:j + 1])))
        params, grads_held, reduce_input, reduced = max(moments, key=sum)
        changes.add(0, end, end + 1, params)
        changes.add(2, end, end + 1, grads_held - sum(grads) - sum(relaid))
        changes.add(3, end, end + 1, reduce_input - self.sizing.reduce_bytes(replayed_last.params))
        changes.add(4, end, end + 1, reduced)

    def _last_grad(self, params: tuple[int, ...], phase: GradSync) -> int:
        """The unsharded grad FSDP2's ``foreach_reduce`` still holds when it allocates the reduce-scatter output:
        its loop over the group's grads (re-laying out dim-1 ones, run when the shard world has more than one rank)
        leaves its variable on the last one, freed when the function returns, after the copy-in cleared the rest
        (Qwen3-0.6B untied on 8 fake ranks: its embedding's, -4.8% at the peak without it). Reduced in the
        reduce dtype when accumulated apart (``_separate_accumulation``)."""
        if self.sizing.world_size <= 1 or not params or params[0] in self._divided_alone:
            return 0
        last = self.sizing.grad_bytes(params[-1:])  # a reduce-scatter's params are those with grads, in order
        if phase is GradSync.LAST and self._separate_accumulation:
            return last * self.precision.reduce_bytes // self.precision.compute_bytes
        return last

    def _sharded_grad(self, changes: Changes, event: int, shard: int, n: int,
                      sharded_held: bool, unsharded: int, all_reduced: bool = False) -> None:
        """The sharded grad a reduce-scatter at ``event`` makes (category 4), by where it lives; ``unsharded``:
        the bytes of the unsharded grads it reduces, held up to it. Under HSDP (``all_reduced``) FSDP2 keeps the
        output it all-reduced (``FSDPParamGroup._all_reduce_state``) until the root's final callback
        (``finalize_backward``): an output added into the grad, or one in a reduce dtype the grad is cast from,
        lives to the end of backward beside the grad (HSDP 2x4 with every micro-batch reduce-scattering: -5.9% to
        -6.8% on 8 fake ranks while freed in the hook; -4.7% with a bf16 reduce dtype and one micro-batch)."""
        output = shard * self.precision.reduce_bytes
        if self.offload:  # the output is copied to the CPU, where the sharded grads live (under HSDP the GPU's
            # output is kept all-reduced, offloaded or not)
            changes.add(4, event, n if all_reduced else event + 1, output)
        elif sharded_held and self.zero_grad is ZeroGrad.NONE:  # added into the grad an earlier one made
            changes.add(4, 0, n, shard * self.grad_bytes)
            # its output, allocated in the hook once the unsharded grads are freed (FSDP2's foreach_reduce clears
            # them first), added in: a moment of the hook's beyond what the grads held there (counted after it, in
            # the next hook's all-gather, 5.8% high on a per-param EP plan with every micro-batch reduce-scattering),
            # then, under HSDP, held to the end of backward
            changes.add(4, event, event + 1, max(0, output - unsharded))
            if all_reduced:
                changes.add(4, event + 1, n, output)
        elif self.zero_grad is ZeroGrad.NONE:  # the reduce-scatter output becomes the sharded grad
            # FSDP2 frees the unsharded grads after the copy-in, before it allocates the output
            changes.add(4, event + 1, n, shard * self.grad_bytes)
            if all_reduced and self.precision.reduce_bytes != self.grad_bytes:  # cast: the output is another tensor
                changes.add(4, event + 1, n, output)
        else:  # set_to_none=False: the output is added into the grad that lives all step, then freed
            changes.add(4, event, n if all_reduced else event + 1, output)

    def _grads_from(self, params: tuple[int, ...], first: int, own_call: bool) -> tuple[Sequence[int],
                                                                                        Sequence[float]]:
        """Events, sorted, and the bytes that start at each: each param's unsharded grad from its own first
        backward op; for a param backward never reads (a bias, an embedding table), with ``own_call`` from its
        module call's backward (``_backward_start``), else from ``first``, the group's. ``own_call`` is off where
        the grad exists before (an earlier micro-batch's, which autograd adds into: its own call's backward put
        toy-llama's fp32 micro-batches with params kept gathered 5.5% low); on, an embedding in the root group is
        no longer held all through backward (+3.4% on a small untied LM). Autograd makes a group's grads one layer
        at a time: a group spanning a whole encoder (the root of a Whisper-style model under ``--policy module``)
        holds at its first backward op only the grads made so far, not all of them (counted at once there, +18%
        on it)."""
        key = (params, first, own_call)
        if key not in self._grad_starts:
            never = len(self.trace.events) + 1
            if len(params) <= ONE_BY_ONE:  # a Python loop: numpy's per-call cost would be the larger
                uses, starts = self.trace.index.first_backward_use, {}
                for p, nbytes in zip(params, self.sizing.grad_bytes_each(np.array(params, dtype=np.intp)).tolist(),
                                     strict=True):
                    at = uses[p] if uses[p] != never else self._unused_grad_start(p, first, own_call)
                    starts[at] = starts.get(at, 0) + nbytes
                events = sorted(starts)
                self._grad_starts[key] = (events, [starts[e] for e in events])
                return self._grad_starts[key]
            ids = np.fromiter(params, dtype=np.intp, count=len(params))
            at = self._first_backward_uses[ids]
            unused = np.flatnonzero(at == never)  # no backward op reads the param
            at[unused] = [self._unused_grad_start(params[k], first, own_call) for k in unused]
            events, where = np.unique(at, return_inverse=True)
            # whole bytes, far below 2**53: a float sum of them in any order is exact
            self._grad_starts[key] = (events, np.bincount(where, weights=self.sizing.grad_bytes_each(ids)))
        return self._grad_starts[key]

    def _unused_grad_start(self, p: int, first: int, own_call: bool) -> int:
        """Where the grad of a param no backward op reads starts (``_grads_from``)."""
        return max(first, self._backward_start(p)) if own_call else first

    def _replicated_grad(self, changes: Changes, p: int, post: int, whole: int,
                         shard: int, phase: GradSync, n: int) -> None:
        """A TP view's param whose grad DTensor makes whole (``Trace.replicated_grads``): autograd makes the whole
        grad in its module call's backward (``made``). FSDP2's post-backward (``post``) copies the rank's shard
        out of it, or out of the grads accumulated so far (Replicate to Shard(0): a chunk's clone), and drops the
        whole before it allocates the reduce-scatter input: shard and whole held together just before it, then
        the shard alone until the copy-in. With sync off the whole grad is what accumulates (``_accumulate``'s
        terms, whole): upcast at the post-backward when ``_separate_accumulation``, else added into by autograd
        (the new grad held until its call's backward is done)."""
        made, done = self._backward_start(p), self.trace.index.grad_ready_at[p]
        if made >= post:
            return
        separate = self._separate_accumulation
        accumulated = whole * self.precision.reduce_bytes // self.precision.compute_bytes if separate else whole
        if phase in (GradSync.FIRST, GradSync.MIDDLE):
            if separate:  # the new grad until the post-backward upcasts it or adds it in
                changes.add(2, made, post + 1, whole)
                changes.add(2, post if phase is GradSync.FIRST else 0, n, accumulated)
            elif phase is GradSync.FIRST:  # param.grad, kept
                changes.add(2, made, n, whole)
            else:  # param.grad, kept, and the new grad until autograd has added it in
                changes.add(2, 0, n, whole)
                changes.add(2, made, max(done, made + 1), whole)
            return
        copied = max(made, post - 1)  # where the shard is copied out, beside what it is copied from
        if phase is GradSync.LAST:
            changes.add(2, 0, post, accumulated)
            if separate:  # the new grad added in and dropped before the copy: not beside the copy
                changes.add(2, made, max(copied, made + 1), whole)
                changes.add(2, copied, post + 1, shard * self.precision.reduce_bytes // self.precision.compute_bytes)
                return
            changes.add(2, made, max(done, made + 1), whole)  # autograd adds the new grad into param.grad
        else:
            changes.add(2, made, post, whole)
        changes.add(2, copied, post + 1, shard)

    def _backward_start(self, p: int) -> int:
        """The first backward op of a call of ``p``'s modules: where autograd makes its grad (its
        ``grad_ready_at`` where none has one). After the call's pre-backward: FSDP2 has freed its all-gather
        output by then."""
        if p not in self._made:
            events, bounds = self.trace.events, self.trace.index.boundaries_by_module
            pres = [i for m in self.trace.params[p].owners for i in bounds.get(m, ())
                    if events[i].kind is EventKind.BWD_PRE]
            ops = (next((j for j in range(i + 1, len(events)) if events[j].is_op), i) for i in pres)
            self._made[p] = min(ops, default=self.trace.index.grad_ready_at[p])
        return self._made[p]

    @property
    def _separate_accumulation(self) -> bool:
        """Whether FSDP2 accumulates unsharded grads in a tensor of their own: when the reduce dtype is not the
        dtype autograd makes them in (``FSDPParam.to_accumulated_grad_if_needed`` upcasts them); else autograd
        accumulates into ``param.grad`` itself."""
        return self.precision.reduce_bytes != self.precision.compute_bytes

    def _accumulated(self, params: tuple[int, ...]) -> int:
        """Bytes of these params' unsharded grads while sync is off: unpadded, in the reduce dtype."""
        return self.sizing.grad_bytes(params) * self.precision.reduce_bytes // self.precision.compute_bytes

    def _accumulate(self, changes: Changes, post: int, params: tuple[int, ...],
                    first: int, n: int, phase: GradSync) -> None:
        """A micro-batch without gradient sync (``set_requires_gradient_sync(False)``): FSDP2's post-backward
        reduce-scatters nothing; the group's unsharded grads stay to the step's end (in FIRST from its
        post-backward, upcast there when ``_separate_accumulation``; in MIDDLE from before the micro-batch), and
        each new grad lives from its backward until the post-backward adds it in."""
        acc = self._accumulated(params)
        if not self._separate_accumulation:  # autograd adds into param.grad: one tensor, kept
            changes.add(2, first if phase is GradSync.FIRST else 0, n, acc)
            return
        changes.add(2, first, post + 1, self.sizing.grad_bytes(params))
        changes.add(2, post if phase is GradSync.FIRST else 0, n, acc)

    def _peak_of(self, changes: Changes, n: int, activations: np.ndarray, kept_grads: int = 0,
                 slack: np.ndarray | None = None, stepped: bool = False) -> Peak:
        """The peak over the micro-batch's events and, when the optimizer steps after it (``stepped``), over its
        step: FSDP2's final callback has freed the last reduce-scatter input by then, so the
        step holds the static part, the sharded grads, what is left of the activations (the batch) and its own
        temporaries, on the default stream."""
        starts, table = changes.by_position(n)
        seg_max = np.maximum.reduceat(activations, starts)  # activations peak within each segment
        # what the default stream reserves for them: the loss region's blocks as the allocator packs them
        seg_reserved = seg_max if slack is None else np.maximum.reduceat(activations + slack, starts)
        # Each category's level after each segment's changes, and their sum, added in the order a running sum
        # over the segments adds them (cumsum is a sequential scan)
        level = np.cumsum(table, axis=0)
        total = self.static.total + _row_sums(level) + seg_max
        k = int(np.argmax(total))  # the first of equal peaks
        best_at = (*level[k].tolist(), float(seg_max[k]))
        # the three streams' own peaks (module docstring: allocated vs reserved); the previous step's sharded grads
        # stay cached in the reduce-scatter stream's pool
        default_pool = max(0.0, float(np.max(total - seg_max + seg_reserved - level[:, _GATHER] - level[:, _REDUCED])))
        gather_pool = max(0.0, float(level[:, _GATHER].max()))
        reduce_pool = max(float(kept_grads), float(level[:, _REDUCED].max()))
        static = asdict(self.static)  # a dynamic category adds to its static part (grads kept by zero_grad)
        at = {k: static[k] + round(x) for k, x in zip((*_DYNAMIC, "activations"), best_at, strict=True)}
        if stepped:
            on_default = self._at_step_default(float(activations[-1]))
            default_pool = max(default_pool, on_default)
            grads = float(kept_grads)  # every group's, the last reduce-scatter's output too
            if on_default + grads > float(total[k]):  # the optimizer step is the peak
                at = {**{c: static[c] for c in (*_DYNAMIC, "activations")}, "grads": static["grads"] + round(grads),
                      "activations": round(float(activations[-1])), "optimizer_temporaries": self.step_temporaries,
                      "compute_copies": static["compute_copies"] - self._cache_freed}
        return Peak(_replace(self.static, **at), round(default_pool + gather_pool + reduce_pool))


def _row_sums(table: np.ndarray) -> np.ndarray:
    """Each row's sum, its columns added left to right (as ``sum`` adds a list)."""
    total = table[:, 0]
    for column in range(1, table.shape[1]):
        total = total + table[:, column]
    return total


_DYNAMIC = ("unsharded_params", "all_gather_buffers", "unsharded_grads", "reduce_scatter_buffers", "grads")
_GATHER = _DYNAMIC.index("all_gather_buffers")  # the one category on FSDP2's all-gather stream
# the reduce-scatter outputs, which become the sharded grads: allocated on FSDP2's reduce-scatter stream
_REDUCED = _DYNAMIC.index("grads")


def first_at_or_after(uses: list[int], event: int, default: int) -> int:
    """The first of ``uses`` (sorted op indices) at or after ``event``."""
    k = bisect.bisect_left(uses, event)
    return uses[k] if k < len(uses) else default


STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp")


def strategy_table(trace: Trace, world_size: int, options: SimOptions) -> dict[str, MemoryBreakdown]:
    """Per-rank peak memory of one device, DDP, ZeRO-1, ZeRO-2 and FSDP (ZeRO-3, one group per module that owns
    params) at ``world_size`` ranks, all from the same terms (module docstring), each at its own peak moment."""
    prec, opt = options.precision, options.optimizer
    trainable = sum(p.numel for p in trace.params if p.requires_grad)
    full_grads, full_state = trainable * prec.grad_bytes, trainable * opt.state_bytes_per_element(prec.param_bytes)
    activations = activation_levels(trace, prec)
    # zero_grad(set_to_none=True): no grad before backward, each allocated as backward produces it; with zeros
    # the grads live all step
    produced = grads_produced(trace, prec) if options.zero_grad is ZeroGrad.NONE else np.zeros_like(activations)
    kept = full_grads if options.zero_grad is ZeroGrad.ZEROS else 0

    def shard(nbytes: int) -> int:
        return -(-nbytes // world_size)

    temporaries = trainable * opt.step_temporary_bytes(prec.param_bytes)
    stored = Sizing(trace, 1, prec).stored_shard_bytes  # every param whole (a frozen one kept in its own dtype)

    def row(optimizer_state: int, grads_divisor: int = 1, gradient_buckets: int = 0, state_divisor: int = 1
            ) -> MemoryBreakdown:
        static = MemoryBreakdown(params=stored, grads=-(-kept // grads_divisor),
                                 optimizer_state=optimizer_state, buffers=trace.buffers_nbytes,
                                 compute_copies=compute_copies(trace, prec, sharded=False),
                                 gradient_buckets=gradient_buckets)
        return peak_moment(static, activations, produced / grads_divisor, -(-temporaries // state_divisor),
                           static.compute_copies if prec.autocast else 0)

    model = MemoryModel(trace, world_size, prec, opt, options.zero_grad)
    plan = make_plan(trace, [[m] for m in trace.index.owning_modules if m != ROOT])
    return {
        "single": row(full_state),
        "ddp": row(full_state, gradient_buckets=trainable * prec.reduce_bytes),
        "zero1": row(shard(full_state), state_divisor=world_size),
        "zero2": row(shard(full_state), grads_divisor=world_size, state_divisor=world_size),
        "fsdp": model.peak(plan, build_schedule(trace, plan, world_size)).at,
    }


def state_floor(trace: Trace, options: SimOptions, world_size: int) -> float:
    """The params, grads and optimizer state of the whole model (as stored: the sharded params' dtype, frozen ones
    their own) over ``world_size`` ranks: no rank's peak without CPU offload is lower, whatever the grouping, mesh,
    TP or EP, since the optimizer step holds every element of them on some rank (HSDP: on a replica each) and
    padding only adds. Grads: of the params the step gives one (``reducible``), as ``kept_grads`` counts them;
    under ``zero_grad(set_to_none=False)`` of every trainable param, as the static grads are."""
    prec, opt = options.precision, options.optimizer
    trainable = sum(p.numel for p in trace.params if p.requires_grad)
    reducible = trace.index.reducible
    with_grads = trainable if options.zero_grad is ZeroGrad.ZEROS else \
        sum(p.numel for p, r in zip(trace.params, reducible, strict=True) if r)
    whole = Sizing(trace, 1, prec).stored_shard_bytes + trainable * opt.state_bytes_per_element(prec.param_bytes) + \
        with_grads * prec.grad_bytes
    return whole / world_size


def grads_produced(trace: Trace, precision: Precision) -> np.ndarray:
    """Bytes of grads held after each event (index ``len(events)``: after the final callback): each param that
    autograd gives a grad, from when its grad is complete (the ops computing a weight's grad need not read it)."""
    delta = np.zeros(len(trace.events) + 1)
    index = trace.index
    for p, ready, has_grad in zip(trace.params, index.grad_ready_at, index.reducible, strict=True):
        if has_grad:
            delta[min(ready + 1, len(trace.events))] += p.numel * precision.grad_bytes
    return np.cumsum(delta)


def peak_moment(static: MemoryBreakdown, activations: np.ndarray, grads: np.ndarray, step_temporaries: int = 0,
                cache_freed: int = 0) -> MemoryBreakdown:
    """A strategy without FSDP at its peak: the static part, and the activations and grads held at the event
    where together they are largest (activations peak as forward ends, grads once backward is done), or the
    optimizer step after backward, when its temporaries beside all the grads are more (autocast's weight cache,
    ``cache_freed``, gone by then)."""
    k = int(np.argmax(activations + grads))
    if step_temporaries - cache_freed + activations[-1] + grads[-1] > activations[k] + grads[k]:
        return _replace(static, activations=round(float(activations[-1])),
                        grads=static.grads + round(float(grads[-1])), optimizer_temporaries=step_temporaries,
                        compute_copies=static.compute_copies - cache_freed)
    return _replace(static, activations=round(float(activations[k])), grads=static.grads + round(float(grads[k])))


def _replace(b: MemoryBreakdown, **changes: int) -> MemoryBreakdown:
    return MemoryBreakdown(**{**asdict(b), **changes})
