"""What activation checkpointing changes in a step: the activations held, and the forward run again in backward.

A checkpointed module call (non-reentrant ``torch.utils.checkpoint``, ``fsdp2/checkpointing.py``) keeps its inputs
alive from its forward until its backward is done instead of the activations its ops save. Its backward starts by
running its forward again, up to the last tensor its forward packed for backward (``early_stop``, torch's default
``set_checkpoint_early_stop(True)``: the ops after it, such as a Llama block's residual add and, since autograd
saves an op's inputs before running it, a last matmul whose only saves are its inputs, are not run again;
``CheckpointedCall.stop``): the saved activations are then re-created where backward first unpacks one
(``CheckpointedCall.runs_again_at``: its pre-backward, or after the pre-backward hooks of the calls inside it that
ended after its last pack) and freed as before, when the backward of the module call that saved each is done; the
recomputation costs the call's forward op time there, after its group's params are gathered (FSDP2's pre-backward
unshards the group before autograd reaches the checkpoint). Until the recomputation stops, the call's forward frame
is alive too, with the unsaved outputs it still holds, beside the gradient of the call's outputs
(``recompute_levels``).

What the call keeps is not re-created: a kept input its ops saved is the same storage in the recomputation
(``Event.saved_inputs``), and a kept input's gradient, held through the call's backward in autograd's input
buffer (a residual block's), is a gradient alive at its ops (``Event.grad_live``); the recomputation's height,
beyond what it holds when it stops, is ``Event.rise``; and a storage the call saved that an op outside every
checkpointed call saves again stays beside the re-created copy (``resave_deltas``).

Under op-level selective checkpointing (``fsdp2/selective.py``) the call keeps, besides its inputs, the outputs
of the forward ops its policy saves (``kept``), in SAC's cache from each such op until the recomputation
(``runs_again_at``) takes them; the recomputation runs only the other forward ops (up to the early stop), so its time is
theirs. The saved
activations are re-created there as under full checkpointing: the cached outputs become the ones autograd saves
(the same storages, not a second copy) or are freed. A cached output that leaves the call (a block ending in a
Linear without a residual: its output) is the storage the next checkpointed call keeps as its input, or the next
module saves: one storage, counted once while the cache holds it (``Event.made_at``, ``shared``).

A compiled module call (``Trace.compiled``: torch.compile'd blocks) is one autograd node: what its ops save
one by one is replaced by what AOTAutograd's partitioner saves for the whole call, held from the end of its forward
until its backward is done (``compiled_calls``). A checkpointed block is modelled as checkpointed, compiled or not:
under full checkpointing the compiled call keeps its inputs, as eager's; under op-level checkpointing, what the
partitioner saves under the policy where it was measured (``compiled_under_sac``: the block's SAC variant, plus, in
an EP view, the dispatch's rows a policy keeping all-to-alls saves), else, and under offloading, the eager figures.

Under activation offloading (``Offloaded.HOST``, ``save_on_cpu``) a call is not checkpointed: nothing of what
its ops save stays on the device after the op (``save_on_cpu`` packs a host copy and autograd holds only that);
the copies are time, charged by the engines on the compute stream (``offload_bytes``); in its backward, the
device copies one backward node unpacks at a time (``unpack_deltas``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fsdp_planner.choices import Offloaded, SacPolicy
from fsdp_planner.fsdp2.checkpointing import backward_calls, early_stop, own_calls, own_regions, recomputed_at
from fsdp_planner.fsdp2.selective import saved_flags
from fsdp_planner.trace.events import KERNEL_EP_ALL_TO_ALL, EventKind
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import innermost_call, is_within

# A checkpointed module: its name (checkpointed in full), or (name, None for full, its op-level policy, or
# ``Offloaded.HOST``: not checkpointed, its saved activations offloaded), and for a checkpointed one without early
# stop a third item, ``WHOLE`` (``fsdp2/checkpointing.plan_checkpointing``).
Checkpointed = str | tuple[str, SacPolicy | Offloaded | None] | tuple[str, SacPolicy | None, bool]


@dataclass(frozen=True)
class CheckpointedCall:
    """One call of a checkpointed module, by the positions of its four boundaries in the trace."""

    module: str
    call: int
    fwd_pre: int
    fwd_post: int
    bwd_pre: int
    bwd_post: int
    inputs_nbytes: int  # traced bytes of the inputs the checkpoint keeps alive
    policy: SacPolicy | None = None  # op-level selective checkpointing's policy; None: full
    kept: tuple[int, ...] = ()  # op-level: the positions of the forward ops whose outputs SAC's cache keeps
    stop: int = -1  # the recomputation runs the events before this one (early stop); -1: up to ``fwd_post``
    offload: bool = False  # not checkpointed: its saved activations offloaded to the host (``save_on_cpu``)
    held: int = 0  # traced bytes its recomputation holds when it stops besides the saved ones (``Event.held``)
    rise: int = 0  # traced bytes it holds mid-way beyond that (``Event.rise``); 0 compiled (inductor fuses them)
    saved_inputs: int = 0  # traced bytes of its kept inputs its ops save: not re-created (``Event.saved_inputs``)
    outputs: int = 0  # a region the model checkpoints reentrantly: traced bytes of its outputs, which reentrant
    # checkpoint recomputes and holds through the call's backward (``reentrant_deltas``)
    whole: bool = False  # checkpointed without early stop: the recomputation runs the whole forward (torchtitan's)

    @property
    def end(self) -> int:
        """The position the recomputation stops at: after the call's last pack, else (or without early stop) its
        forward's end."""
        return self.fwd_post if self.stop < 0 or self.whole else self.stop

    @property
    def last_pack(self) -> int:
        """Just after the call's last pack (its forward's end where unknown): what decides where backward first
        unpacks, and so where the recomputation runs (``recomputed_at``), early stop or not."""
        return self.fwd_post if self.stop < 0 else self.stop

    def runs_again_at(self, trace: Trace) -> int:
        """Where its forward runs again (``recomputed_at``): every term that re-creates what it saved, or holds
        what the recomputation holds, puts it there (re-created at the call's pre-backward, they met the
        all-gather buffers FSDP2's hooks free before it: +6.1% on a per-param EP plan with TP 2 and full
        checkpointing on 32 fake ranks)."""
        return recomputed_at(trace, self.last_pack, self.fwd_post, self.bwd_pre, self.bwd_post)

    def recomputed(self, trace: Trace) -> list[int]:
        """The positions of the forward ops its recomputation runs: all of them up to the early stop, less the
        kept ones."""
        kept = set(self.kept)
        return [i for i in range(self.fwd_pre, self.end) if trace.events[i].kind is EventKind.OP
                and not trace.events[i].backward and i not in kept]


def kept_ops(trace: Trace, fwd_pre: int, fwd_post: int, policy: SacPolicy) -> tuple[int, ...]:
    """The forward ops of one call (between its boundaries) whose outputs ``policy`` keeps."""
    ops = [i for i in range(fwd_pre, fwd_post) if trace.events[i].kind is EventKind.OP
           and not trace.events[i].backward]
    flags = saved_flags(policy, [trace.events[i].op_class for i in ops])
    return tuple(i for i, saved in zip(ops, flags, strict=True) if saved)


def checkpointed_calls(trace: Trace, modules: Iterable[Checkpointed]) -> list[CheckpointedCall]:
    """The calls of ``modules`` that ran a backward (a call without one saves nothing to recompute), and the regions
    of the model's own ``torch.utils.checkpoint`` that none of them is or holds (``own_calls``), each one call in
    full (``own_regions``)."""
    items = [(item, None, False) if isinstance(item, str) else (*item, False)[:3] for item in modules]
    own = own_calls(trace, [m for m, _, _ in items])
    mine = {(c.module, c.call) for c in own}
    out = [_call(trace, m, how, *b, whole=whole)
           for m, how, whole in items for b in backward_calls(trace, m) if (m, b[0]) not in mine]
    for m, call, fwd_pre, fwd_post, bwd_pre, bwd_post, reentrant in own_regions(trace, own):
        c = _call(trace, m, None, call, fwd_pre, fwd_post, bwd_pre, bwd_post)
        out.append(replace(c, stop=-1, outputs=_outputs(trace, fwd_pre, fwd_post)) if reentrant else c)
    return sorted(out, key=lambda c: c.fwd_pre)


def _outputs(trace: Trace, fwd_pre: int, fwd_post: int) -> int:
    """Bytes of a call's outputs, as its last forward op made them (a block's residual add)."""
    return next((e.out_nbytes for e in reversed(trace.events[fwd_pre:fwd_post]) if e.is_op and not e.backward), 0)


def _call(trace: Trace, m: str, how: SacPolicy | Offloaded | None, call: int, fwd_pre: int, fwd_post: int,
          bwd_pre: int, bwd_post: int, whole: bool = False) -> CheckpointedCall:
    policy = how if isinstance(how, SacPolicy) else None
    kept = kept_ops(trace, fwd_pre, fwd_post, policy) if policy is not None else ()
    post = trace.events[fwd_post]
    inputs = trace.events[fwd_pre].kept_inputs
    return CheckpointedCall(m, call, fwd_pre, fwd_post, bwd_pre, bwd_post, inputs, policy, kept,
                            early_stop(trace, fwd_pre, fwd_post), how is Offloaded.HOST, post.held,
                            whole=whole, rise=0 if m in trace.compiled else post.rise,
                            saved_inputs=min(post.saved_inputs, inputs))


@dataclass(frozen=True)
class CompiledCall:
    """One call of a compiled module: where its forward ends and its backward is done, and what it saves."""

    fwd_pre: int
    fwd_post: int
    bwd_post: int
    saved: int  # bytes (at the trace's dtype) the partitioned forward saves for backward


def compiled_calls(trace: Trace, checkpointed: Sequence[CheckpointedCall]) -> list[CompiledCall]:
    """The calls of the trace's compiled modules that ran a backward, less those of modules that a checkpointed
    module holds, is, or lies inside (modelled as checkpointed: module docstring), except a compiled module under
    op-level checkpointing whose compiled saves under that policy were measured (``compiled_under_sac``)."""
    sac = compiled_under_sac(trace, checkpointed)
    ckpt = [c.module for c in checkpointed if c.module not in sac]
    out = []
    by_module = trace.index.boundaries_by_module
    for m, block in trace.compiled.items():
        if any(c == m or m.startswith(c + ".") or c.startswith(m + ".") or not c for c in ckpt):
            continue
        saved = sac.get(m, block.saved)
        pos: dict[tuple[EventKind, int], int] = {}
        for i in by_module.get(m, ()):
            e = trace.events[i]
            pos.setdefault((e.kind, e.call), i)
        for (kind, call), fwd_pre in pos.items():
            bwd_post = pos.get((EventKind.BWD_POST, call))
            if kind is EventKind.FWD_PRE and bwd_post is not None:
                out.append(CompiledCall(fwd_pre, pos[(EventKind.FWD_POST, call)], bwd_post, saved))
    return sorted(out, key=lambda c: c.fwd_pre)


def compiled_under_sac(trace: Trace, checkpointed: Sequence[CheckpointedCall]) -> dict[str, int]:
    """Compiled module -> what it saves compiled under its op-level checkpointing policy, where measured: the
    partitioner applies the policy inside the compiled graph, so the call holds that instead of SAC's eager
    inputs, cache and recomputed activations."""
    out = {}
    for c in checkpointed:
        block = trace.compiled.get(c.module)
        if c.policy is not None and block is not None and c.policy.value in block.variants:
            out[c.module] = block.variants[c.policy.value] + _kept_all_to_alls(trace, c)
    return out


def _kept_all_to_alls(trace: Trace, c: CheckpointedCall) -> int:
    """The rows EP's dispatch delivered to an EP view's compiled call (``sim/expert_parallel.py``), where its policy
    keeps all-to-all outputs (torchtitan's saves ``all_to_all_single``): the variant was measured on the block
    without EP, whose experts read rows gathered from the block's input (recomputed); under EP the partitioner keeps
    the dispatch's output, which the experts' backward reads. The combine's output takes the place of the experts'
    output that the policy keeps already (measured on a tiny Mixtral compiled by inductor under EP 2: the dispatch's
    rows more, the combine's not; ``tests/test_compile_ep.py``). Each expert call's first all-to-all is its
    dispatch."""
    events = trace.events
    dispatched: dict[str, int] = {}
    for k in c.kept:
        if events[k].kernel == KERNEL_EP_ALL_TO_ALL:
            dispatched.setdefault(events[k].module, events[k].out_nbytes)
    return sum(dispatched.values())


def loss_region_deltas(trace: Trace, scale: float) -> np.ndarray:
    """Change in the loss region's bytes at each event: outside the model (the loss, and its backward until
    backward reaches a module's pre-backward) the trace's live bytes are counted, not the saved tensors, which
    there are a fraction of what is alive (a language model's logits in two dtypes, the loss's gradient;
    ``recorder.LossRegion``). Part of ``activation_deltas``, and on its own what a no-fit message blames. Computed
    once per trace and scale (every checkpointing set a search tries has the same); the caller's own copy."""
    key = ("loss_region_deltas", scale)
    if key not in trace.index.memo:
        trace.index.memo[key] = _loss_region_deltas(trace, scale)
    return trace.index.memo[key].copy()


def _loss_region_deltas(trace: Trace, scale: float) -> np.ndarray:
    deltas = np.zeros(len(trace.events) + 1)
    outside = 0.0  # the loss region's live bytes (scaled) last counted
    for i, inside in enumerate(trace.index.loss_region):
        e = trace.events[i]
        if inside:
            deltas[i] += e.live * scale - outside
            outside = e.live * scale
        elif e.kind is EventKind.BWD_PRE and outside:  # backward reached the model: the loss region is done
            deltas[i] -= outside
            outside = 0.0
    return deltas


def activation_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """Change in activation bytes at each event (index ``len(events)``: after the final callback): saved in
    forward and freed when the saving module call's backward is done, or before, after the backward op whose node
    autograd releases them with (``Event.freed``: a T5's position bias, seq x seq x heads, saved by the first
    block's attention and freed after its backward, before the two blocks' bias gradients are summed: +16.6% on a
    tiny T5 at seq 2,048 in fp32 while held to the call's end); under a checkpointed call, its inputs held instead
    and its activations re-created where it runs again (``runs_again_at``; op-level: with the outputs of its kept
    ops, held from each until then, ``cache_deltas``); in the loss region, its live bytes (``loss_region_deltas``);
    at each forward op, the temporaries alive (``trace/step.Temporaries``)."""
    deltas = loss_region_deltas(trace, scale)
    compiled, inside_compiled = compiled_deltas(trace, compiled_calls(trace, calls), scale)
    sac = compiled_under_sac(trace, calls)
    calls = [c for c in calls if c.module not in sac]  # held as compiled calls
    start_at = {c.fwd_pre: c for c in calls}
    fwd_pre, fwd_post, bwd_post = EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_POST
    stack: list[tuple[str, int]] = []
    saved_by: dict[tuple[str, int], float] = {}
    inside: CheckpointedCall | None = None  # the checkpointed call whose forward is running
    recreated: dict[int, float] = {}  # position -> activations re-created there (``runs_again_at``)
    again = {c.fwd_pre: c.runs_again_at(trace) for c in calls}
    totals: dict[tuple[str, int], float] = {}  # call -> the activations its post-backward frees
    events = trace.events
    for i in _activation_events(trace):  # (the loss region's ops: counted by loss_region_deltas)
        e = events[i]
        kind = e.kind
        if kind is EventKind.OP:
            if e.live and not e.backward and not inside_compiled[i]:  # temporaries (``Temporaries``), alive
                deltas[i] += e.live  # while it runs, at the traced dtypes
                deltas[i + 1] -= e.live
            if e.saved and not e.backward and not inside_compiled[i] and not (inside is not None and inside.offload):
                key = stack[-1]
                nbytes = e.saved * scale
                saved_by[key] = saved_by.get(key, 0.0) + nbytes
                if inside is None:
                    deltas[i] += nbytes
                else:
                    at = again[inside.fwd_pre]
                    recreated[at] = recreated.get(at, 0.0) + nbytes
        elif kind is fwd_pre:
            stack.append((e.module, e.call))
            c = start_at.get(i)
            if c is not None and inside is None:
                inside = c
                if not c.offload:  # (offloaded: nothing kept on the device, no activations re-created)
                    _kept(deltas, c, scale, again[c.fwd_pre])
        elif kind is fwd_post:
            stack.pop()
            if inside is not None and i == inside.fwd_post:
                inside = None
        elif kind is bwd_post and (e.module, e.call) in saved_by:
            totals[(e.module, e.call)] = saved_by.pop((e.module, e.call))
            deltas[i] -= totals[(e.module, e.call)]
    for pos, nbytes in recreated.items():
        deltas[pos] += nbytes
    return deltas + compiled + cache_deltas(trace, calls, scale) + unpack_deltas(trace, calls, scale) \
        + early_frees(trace, totals, scale) + reentrant_deltas(trace, calls, scale) \
        + resave_deltas(trace, calls, scale) + shared_deltas(trace, calls, scale, inside_compiled)


def _kept(deltas: np.ndarray, c: CheckpointedCall, scale: float, again: int) -> None:
    """A checkpointed call's inputs, held from its forward until its backward is done: those its ops saved are
    re-created as saved (the same storages, counted there meanwhile) where it runs again (``again``). (The
    gradient of those two or more of its ops read, a residual's input, held through its backward in autograd's
    input buffer, is a gradient alive at each of its ops: ``Event.grad_live``.)"""
    deltas[c.fwd_pre] += c.inputs_nbytes * scale
    deltas[c.bwd_post] -= c.inputs_nbytes * scale
    deltas[again] -= c.saved_inputs * scale
    deltas[c.bwd_post] += c.saved_inputs * scale


def shared_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float, inside_compiled: np.ndarray
                  ) -> np.ndarray:
    """Storages SAC's cache holds (``cache_deltas``) that a checkpointed call keeps as its inputs (``_kept``) or an
    op outside every checkpointed call saves (``activation_deltas``, until the saving call's backward is done): the
    holder's ``Event.made_at`` names the kept op that made them; counted once while both hold them (``shared``;
    ``activation_deltas``' indexing)."""
    deltas = np.zeros(len(trace.events) + 1)
    releases = cache_releases(trace, calls)
    if not releases:
        return deltas
    events, posts, starts = trace.events, _backward_boundaries(trace), [c.fwd_pre for c in calls]
    for c in calls:
        if not c.offload:  # (offloaded: no inputs kept)
            shared(deltas, events[c.fwd_pre].made_at, releases, c.fwd_pre, c.bwd_post, scale)
    for i in _made_events(trace):
        if not inside_compiled[i] and _within(calls, starts, i) is None:  # charged where it runs (no recomputation)
            module, call = events[i].module, _running_call(trace, i)
            shared(deltas, events[i].made_at, releases, i, posts.get((module, call, EventKind.FWD_PRE), len(events)),
                   scale)
    return deltas


def _made_events(trace: Trace) -> list[int]:
    """The forward ops outside the loss region that save a storage an op a policy can keep made (``Event.made_at``;
    once per trace)."""
    key = ("made_events",)
    if key not in trace.index.memo:
        trace.index.memo[key] = [i for i, (e, in_loss) in enumerate(zip(trace.events, trace.index.loss_region,
                                                                        strict=True))
                                 if e.made_at and e.is_op and not e.backward and not in_loss]
    return trace.index.memo[key]


def _running_call(trace: Trace, i: int) -> int:
    """Which call of its module forward op ``i`` runs in: that of the module's last boundary before it (its
    pre-forward)."""
    boundaries = trace.index.boundaries_by_module.get(trace.events[i].module, [])
    k = bisect.bisect_left(boundaries, i) - 1
    return trace.events[boundaries[k]].call if k >= 0 else 0


def shared(deltas: np.ndarray, made_at: Iterable[tuple[int, int]], releases: dict[int, int], since: int, until: int,
           scale: float) -> None:
    """Storages a holder counts from ``since`` until ``until`` (a checkpointed call's kept inputs, an op's saves)
    that SAC's cache holds already (``Event.made_at``: made by a kept op, held until ``releases`` says): counted
    once while both hold them. A chain of blocks ending in a Linear without a residual under op-level SAC: each
    block's output, cached by its last Linear, is the next block's kept input, and the last block's the head's
    save (+12.0% on 8 fake ranks counted twice, 150 MiB for 134)."""
    for maker, nbytes in made_at:
        end = min(until, releases.get(maker, since))
        if end > since:
            deltas[since] -= nbytes * scale
            deltas[end] += nbytes * scale


def view_position(where: Sequence[int], position: int, events: int) -> int:
    """Where a position of the whole trace is in a rank's view (``where``: old -> new of each event, ``events``
    the view's): -1 stays -1 (never), the end stays the end."""
    if position < 0:
        return position
    return where[position] if position < len(where) else events


def made_in_view(made_at: Iterable[tuple[int, int]], trace: Trace, where: Sequence[int],
                 added: Sequence[tuple[int, str]], share: float) -> tuple[tuple[int, int], ...]:
    """``Event.made_at`` in a rank's view of the trace (``sim/tensor_parallel.py``, ``sim/expert_parallel.py``): each
    maker at its position there (``where``), the bytes at the holder's ``share``; none whose storage an op the view
    put in made again since (``added``: the position and module of each forward op it put in, in order; one of the
    maker's module or around it): a rowwise Linear's output all-reduced, an experts layer's combined by its
    all-to-all, is not its matmul's storage."""
    out = []
    for maker, nbytes in made_at:
        at, module = where[maker], trace.events[maker].module
        if not any(is_within(module, m) for _, m in added[bisect.bisect_right(added, at, key=lambda a: a[0]):]):
            out.append((at, int(nbytes * share)))
    return tuple(out)


def cache_releases(trace: Trace, calls: Sequence[CheckpointedCall]) -> dict[int, int]:
    """The position of each kept op of op-level checkpointed ``calls`` -> where SAC's cache lets its outputs go
    (``cache_deltas``)."""
    return {i: at if i < c.end else c.bwd_post for c in calls if c.kept for at in (c.runs_again_at(trace),)
            for i in c.kept}


def _activation_events(trace: Trace) -> list[int]:
    """The events ``activation_deltas`` acts on, whatever the checkpointing: module boundaries but pre-backwards,
    and the forward ops outside the loss region that hold temporaries or save something (once per trace: a search
    asks for the levels of many checkpointing sets)."""
    key = ("activation_events",)
    if key not in trace.index.memo:
        boundaries = (EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_POST)
        trace.index.memo[key] = [
            i for i, (e, in_loss) in enumerate(zip(trace.events, trace.index.loss_region, strict=True))
            if e.kind in boundaries or (e.kind is EventKind.OP and not in_loss and not e.backward
                                        and (e.live or e.saved))]
    return trace.index.memo[key]


def _freeing_events(trace: Trace) -> list[int]:
    """The events ``early_frees`` acts on: backward's module boundaries and the ops outside the loss region that
    free activations early (once per trace)."""
    key = ("freeing_events",)
    if key not in trace.index.memo:
        trace.index.memo[key] = [
            i for i, (e, in_loss) in enumerate(zip(trace.events, trace.index.loss_region, strict=True))
            if e.kind in (EventKind.BWD_PRE, EventKind.BWD_POST) or (e.freed and not in_loss)]
    return trace.index.memo[key]


def early_frees(trace: Trace, totals: dict[tuple[str, int], float], scale: float) -> np.ndarray:
    """Activations freed before their call's backward is done (``activation_deltas``' indexing): after each
    backward op, its ``Event.freed`` of the innermost call whose backward runs (at most what that call holds,
    ``totals``), which its post-backward then does not free."""
    deltas = np.zeros(len(trace.events) + 1)
    running: list[tuple[str, int]] = []  # the calls whose backward is running
    left, early = dict(totals), dict.fromkeys(totals, 0.0)
    events = trace.events
    for i in _freeing_events(trace):
        e = events[i]
        if e.kind is EventKind.BWD_PRE:
            running.append((e.module, e.call))
        elif e.kind is EventKind.BWD_POST:
            if (e.module, e.call) in running:
                running.remove((e.module, e.call))
            deltas[i] += early.pop((e.module, e.call), 0.0)
        elif running:  # (an op that frees early, outside the loss region; the call the trace charged it to)
            call = innermost_call(running)
            nbytes = min(e.freed * scale, left.get(call, 0.0))
            if nbytes:
                left[call] -= nbytes
                early[call] += nbytes
                deltas[i + 1] -= nbytes
    return deltas


def compiled_deltas(trace: Trace, calls: Sequence[CompiledCall], scale: float) -> tuple[np.ndarray, np.ndarray]:
    """What compiled calls hold (``activation_deltas``' indexing): each call's saved bytes from the end of its
    forward until its backward is done; and which events lie inside one's forward (their own saves not held)."""
    deltas = np.zeros(len(trace.events) + 1)
    inside = np.zeros(len(trace.events), dtype=bool)
    for c in calls:
        deltas[c.fwd_post] += c.saved * scale
        deltas[c.bwd_post] -= c.saved * scale
        inside[c.fwd_pre:c.fwd_post] = True
    return deltas, inside


def offload_bytes(trace: Trace, c: CheckpointedCall, scale: float, param_bytes: int) -> float:
    """Bytes ``save_on_cpu`` copies to the host in an offloaded call's forward (and back in its backward): the
    activations its ops save (each storage once, at the compute dtype: ``scale``), and each param its forward
    reads, at ``param_bytes`` each (a matmul saves its weight: FSDP2's unsharded param, copied whole). A tensor
    packed twice is copied twice by ``save_on_cpu``; the trace counts its storage once, so this is a floor."""
    events = trace.events[c.fwd_pre:c.fwd_post]
    params = {p for e in events if not e.backward for p in e.params}
    saved = sum(e.saved for e in events if e.kind is EventKind.OP and not e.backward)
    return saved * scale + sum(trace.params[p].numel for p in params) * param_bytes


def unpack_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """Under activation offloading, the device copies backward unpacks (``activation_deltas``' indexing): each
    backward node copies its saved tensors back and frees them when it is done, so an offloaded call's backward
    holds about one op's worth at a time: at each of its backward ops, the most bytes one forward op of the same
    module saved (``Event.saved``; the gradients around it are the gradient flow's, ``gradient_flow``). A norm's
    backward unpacks a norm's input, not the largest of the block's (+6.4% on toy-llama's offloaded blocks with
    the block's largest held through its whole backward)."""
    deltas = np.zeros(len(trace.events) + 1)
    for c in calls:
        if not c.offload:
            continue
        largest: dict[str, float] = {}
        for e in trace.events[c.fwd_pre:c.fwd_post]:
            if e.kind is EventKind.OP and not e.backward:
                largest[e.module] = max(largest.get(e.module, 0.0), e.saved * scale)
        for i in range(c.bwd_pre, c.bwd_post):
            e = trace.events[i]
            if e.kind is EventKind.OP and e.backward and largest.get(e.module):
                deltas[i] += largest[e.module]
                deltas[i + 1] -= largest[e.module]
    return deltas


def gradient_flow(trace: Trace, scale: float, workspaces: bool = True) -> np.ndarray:
    """Bytes of the gradients of activations each backward op inside the model reads and makes
    (``Event.grad_live``), at ``activation_deltas``' indexing: not saved tensors, so not in the deltas, but the
    gradient flowing into a layer and the one flowing out are alive together while it runs; in a conv net, where
    activations dwarf params, two activations' worth at the peak (-9.7% on a conv net with BatchNorm without
    it). A level at each op, nothing carried over to the next; with ``workspaces`` (GPU ranks), the buffers the
    op's CUDA kernel allocates besides (``Event.workspace``, in their own dtype: not scaled)."""
    key = ("gradient_flow", scale, workspaces)
    if key not in trace.index.memo:  # once per trace, scale and device kind (the same for every checkpointing)
        levels = np.zeros(len(trace.events) + 1)
        for i, e in enumerate(trace.events):
            if e.backward and (e.grad_live or (workspaces and e.workspace)):
                levels[i] = e.grad_live * scale + (e.workspace if workspaces else 0)
        levels.flags.writeable = False
        trace.index.memo[key] = levels
    return trace.index.memo[key]


def recompute_levels(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """What a recomputation holds when it stops, besides the activations it re-creates (``activation_deltas``' indexing,
    where it runs: ``recomputed_at``): non-reentrant checkpoint stops by raising from the pack hook of the call's
    last saved tensor (torch's ``_StopRecomputationError``), so until then the call's forward frame is alive, with
    the outputs its locals and temporaries still hold that nothing saved (a bottleneck's last BatchNorm output, its
    shortcut and their sum beside the final ReLU's output), and so is the gradient of the call's outputs that
    started its backward (``Event.held``). A level, gone once the frame unwinds: -22% on a ResNet under per-block
    full checkpointing without it, where the first block's recomputation at the highest resolution is the peak."""
    levels = np.zeros(len(trace.events) + 1)
    for c in calls:
        if not c.offload:  # where the recomputation runs (``recomputed_at``), with the inner groups' params
            # gathered again there (``fsdp2/replay.py``): EP 4 x full AC on 8 fake ranks -5.7% -> -4.6% there
            at = c.runs_again_at(trace)
            levels[at] = max(levels[at], (c.held + c.rise) * scale)
    return levels


def reentrant_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """What a region the model checkpoints reentrantly holds beside its re-created activations
    (``activation_deltas``' indexing): reentrant checkpoint runs the whole forward again (no early stop) and then
    autograd's backward on its outputs inside its own backward, so those outputs stay alive until the region's
    backward is done (a DiT's blocks reentrant on 8 fake ranks: -3.0% without, one block's output)."""
    deltas = np.zeros(len(trace.events) + 1)
    for c in calls:
        if c.outputs:
            deltas[c.runs_again_at(trace)] += c.outputs * scale
            deltas[c.bwd_post] -= c.outputs * scale
    return deltas


def resave_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """Storages a checkpointed call saved that an op outside every checkpointed call saves again (``Event.resaved``;
    ``activation_deltas``' indexing): its recomputation re-creates its own copy, so the original, which the op
    outside holds, is a second one, from that op until backward runs its node (``release``). A U-Net's encoder
    levels under per-level checkpointing: each level's output, saved by its last ReLU, is saved again by the max
    pool after it and, in the decoder, by the transposed conv (-8.8% without, the skips held twice)."""
    deltas = np.zeros(len(trace.events) + 1)
    if not calls:
        return deltas
    starts = [c.fwd_pre for c in calls]
    held: dict[tuple[int, int], tuple[int, int, int]] = {}  # storage (its first save) -> (bytes, from, until)
    for i in _resaving_events(trace):
        if _within(calls, starts, i) is not None:
            continue  # saved again inside a checkpointed call: its input, kept, or its own re-created
        for first, which, nbytes in trace.events[i].resaved:
            c = _within(calls, starts, first)
            if c is None or first in c.kept:  # (SAC's cache holds a kept op's output: the one copy)
                continue
            until = release(trace, i)
            _, since, end = held.get((first, which), (nbytes, i, until))
            held[(first, which)] = (nbytes, since, max(end, until))
    for nbytes, since, until in held.values():
        deltas[since] += nbytes * scale
        deltas[until] -= nbytes * scale
    return deltas


def _within(calls: Sequence[CheckpointedCall], starts: Sequence[int], position: int) -> CheckpointedCall | None:
    """The call (of ``calls``, sorted by ``fwd_pre``, whose forwards do not overlap) whose forward holds
    ``position``."""
    k = bisect.bisect_right(starts, position) - 1
    return calls[k] if k >= 0 and position < calls[k].fwd_post else None


def _resaving_events(trace: Trace) -> list[int]:
    """The forward ops that save again what an earlier op saved (once per trace)."""
    key = ("resaving_events",)
    if key not in trace.index.memo:
        trace.index.memo[key] = [i for i, e in enumerate(trace.events) if e.resaved]
    return trace.index.memo[key]


def release(trace: Trace, i: int) -> int:
    """Where backward runs the node of forward op ``i`` (and frees what it saved): autograd runs nodes newest
    first, so after the backward of what followed it and before that of what preceded it: at the counterpart of
    the last module boundary before it whose call ran a backward, a call's pre-backward for its post-forward (the
    op came after the call), its post-backward for its pre-forward (the op ran inside it); a call that ran none (a
    probe whose output needs no grad) is passed over. The step's end where none did."""
    events, counterpart = trace.events, _backward_boundaries(trace)
    for j in range(i - 1, -1, -1):
        e = events[j]
        if e.kind in (EventKind.FWD_PRE, EventKind.FWD_POST):
            k = counterpart.get((e.module, e.call, e.kind))
            if k is not None and k > i:
                return k
    return len(events)


def _backward_boundaries(trace: Trace) -> dict[tuple[str, int, EventKind], int]:
    """(module, call, forward boundary kind) -> the position of its backward counterpart: a post-forward's
    pre-backward, a pre-forward's post-backward (once per trace)."""
    key = ("backward_boundaries",)
    if key not in trace.index.memo:
        mate = {EventKind.BWD_PRE: EventKind.FWD_POST, EventKind.BWD_POST: EventKind.FWD_PRE}
        trace.index.memo[key] = {(e.module, e.call, mate[e.kind]): k for k, e in enumerate(trace.events)
                                 if e.kind in mate}
    return trace.index.memo[key]


def cache_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """What SAC's cache holds (``activation_deltas``' indexing): each kept op's outputs, from the op until its
    recomputation (``runs_again_at``), which takes them; a kept op's after the early stop, which the
    recomputation never reaches, until the call's backward is done, when the checkpoint's frame and its cache go
    (a Swin block's last Linear's output, the block's size: -0.9% on 8 fake ranks without it)."""
    deltas = np.zeros(len(trace.events) + 1)
    for i, release in cache_releases(trace, calls).items():
        nbytes = trace.events[i].out_nbytes * scale
        deltas[i] += nbytes
        deltas[release] -= nbytes
    return deltas
