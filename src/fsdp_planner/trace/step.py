"""The trace's state machine: what the module hooks, the op recorder and the saved-tensor hooks see, turned
into the step's events.

Every callback goes through a ``Slot``: the step's ``StepRecorder`` most of the time, a ``NullRecorder`` while the
tracer makes tensors of its own, or a template's log while a repeated module is traced on its own (``reuse.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_planner.trace.events import Event, EventKind, OpClass, OwnCall
from fsdp_planner.trace.tree import ROOT, innermost_call, is_within

Call = tuple[str, int]


class StepRecorder:
    """The trace's state machine: turns hook and dispatch callbacks into events."""

    def __init__(self, static_storages: set[StorageWeakRef], step_inputs: frozenset[StorageWeakRef] = frozenset()
                 ) -> None:
        self.events: list[Event] = []
        self.static_storages = static_storages  # params' and buffers': what they save or take is not activations
        self.step_inputs = step_inputs  # the batch as the model takes it: ``Trace.inputs_nbytes`` holds it all
        # step, so an op saving it charges nothing (a first Linear saves its cast input: it was charged twice)
        # storages some call's inputs_nbytes already counts -> the param-holding call that took one last (None:
        # only paramless calls did): what a checkpoint of a later call keeps (``call_inputs``)
        self.input_storages: dict[StorageWeakRef, str | None] = {}
        # such storages -> the module calls that took them (``watch_saved``: one that none of the calls running
        # took was made inside the saving call, and handed only to calls inside it)
        self.takers: dict[StorageWeakRef, set[Call]] = {}
        self.fwd_stack: list[str] = []
        self.bwd_active: list[Call] = []  # module calls whose backward is running
        self.bwd_pending_post: set[Call] = set()  # calls that will get a post-backward marker
        self.calls: dict[str, int] = {}
        self.backward = False
        self.last_op, self.last_op_module = -1, ROOT  # the last op's position and the module it ran in
        # bytes a caller saved of a call that returned (its output, or anything it made), charged to the next op
        # where it is the caller's: autograd saves an op's inputs before the op runs, so the last op is the
        # returned call's (``save``). (the last op's position, the saving call's module, the bytes, their made_at)
        self.pending: tuple[int, str, int, tuple] | None = None
        self.mask_storages: set[StorageWeakRef] = set()  # made by ``OpClass.ATTENTION_MASK`` ops
        self.last_mask_op = -1  # the last of them: a save of what they made is charged to it (``save``)
        self.grads: set[int] = set()  # params whose grads replayed calls produced (see reuse.py)
        self.bwd_started = False  # a module's pre-backward has run
        self.loss = LossRegion(lambda: len(self.events))
        self.temporaries = Temporaries()
        # temporaries that became a call's inputs since the last op (``inputs_nbytes``): a save of one before the
        # next op takes it off that op's live too, as a save of a temporary does (``unsaved``)
        self.new_inputs: dict[StorageWeakRef, int] = {}
        self.frame = FrameBytes()  # storages forward ops made, alive and not saved for backward
        # per call running: the inputs its checkpoint keeps, and the bytes of them its ops saved first
        self.kept_stack: list[KeptInputs] = []
        self.kept_next: dict[StorageWeakRef, int] = {}  # ``call_inputs``' for the call about to begin
        self.makers: dict[StorageWeakRef, Any] = {}  # storage -> the op a policy can keep that made it (``maker``)
        # every storage saved for backward -> the position of the event before its first save, and which of the
        # storages first saved from there it is; the saves again of those since the last forward op, for the next
        # (``Event.resaved``)
        self.first_saves: dict[StorageWeakRef, tuple[int, int]] = {}
        self.saves_at: dict[int, int] = {}  # position -> the first saves charged from it so far
        self.resaves: dict[StorageWeakRef, tuple[int, int, int]] = {}
        self.grad_storages: set[StorageWeakRef] = set()  # storages backward ops made: gradients
        self.gradients = Gradients(lambda: self.position())  # those of them alive now (``Event.grad_live``)
        self.param_grads: set[StorageWeakRef] = set()  # storages that became params' grads
        self.grads_made: dict[StorageWeakRef, tuple[int, int]] = {}  # such a storage -> (event, bytes) that made it
        self.modified_inputs, self.aliased_inputs = set[str](), set[str]()  # (``modified_input``, ``aliased_input``)
        self.input_dims: dict[str, int] = {}  # module -> dims of the first tensor its first call was given (-1: none)
        # modules whose output an op after their call modified in place, and whose topk's outputs one did (``Slot``)
        self.modified_outputs, self.modified_topks = set[str](), set[str]()
        # set on the step's recorder: told of every forward op reading params (methods.MethodFinder.check)
        self.check_methods: Callable[[tuple[int, ...], Sequence[str]], None] | None = None
        self.method_calls: dict[Call, str] = {}  # module calls that were a wrapped non-forward method (methods.py)
        self._watched: dict[int, weakref.ref] = {}  # saved storages charged, until autograd frees them (``freed``)
        self._watch_count = 0
        # the model's own torch.utils.checkpoint (``own_checkpoint.py``): the forward depth each open region began
        # at, and the module calls outermost in a region, which the model checkpoints itself
        self.own_bases: list[tuple[int, bool]] = []  # (depth, reentrant)
        self.own_calls: list[OwnCall] = []
        self.own_regions = 0  # outermost regions begun

    def position(self) -> int:
        """The position the next event takes."""
        return len(self.events)

    def current_module(self) -> str:
        if self.backward:
            inner = self.innermost_backward()
            return inner[0] if inner else ROOT
        return self.fwd_stack[-1] if self.fwd_stack else ROOT

    def op(self, params: tuple[int, ...], flops: int, nbytes: int, live: int = 0,
           op_class: OpClass = OpClass.OTHER, out_nbytes: int = 0, kernel: int = 0, grad_live: int = 0,
           workspace: int = 0, syncs: bool = False) -> None:
        module = self.current_module()
        saved, made = self.take_pending(module)
        self.last_op, self.last_op_module = len(self.events), module
        if op_class is OpClass.ATTENTION_MASK:
            self.last_mask_op = self.last_op
        self.new_inputs.clear()
        resaved = ()
        if not self.backward:
            self.frame.op_done()
            resaved, self.resaves = tuple(self.resaves.values()), {}
        self.events.append(Event(EventKind.OP, module, params=params, flops=flops, nbytes=nbytes, saved=saved,
                                 backward=self.backward, live=live, op_class=op_class, out_nbytes=out_nbytes,
                                 kernel=kernel, grad_live=grad_live, workspace=workspace, resaved=resaved,
                                 made_at=made, syncs=syncs))

    def take_pending(self, module: str) -> tuple[int, tuple]:
        """The caller's saved bytes (and their ``Event.made_at``) an op of ``module`` about to be recorded takes: all
        of them where it is a forward op of the call that saved them; else none, and they stay the returned call's
        last op's, as any save before an op of another call (a custom autograd Function packs after its forward's
        own calls ran)."""
        if self.pending is None:
            return 0, ()
        _, saving, nbytes, made = self.pending
        if not self.backward and module == saving:
            self.pending = None
            return nbytes, made
        self.flush_pending()
        return 0, ()

    def flush_pending(self) -> None:
        """Leave the caller's saved bytes no op of it took on the last op before them."""
        if self.pending is not None:
            at, _, nbytes, made = self.pending
            self._charge(at, nbytes, made)
            self.pending = None

    def saved_by_caller(self) -> bool:
        """Whether a save now is for an op of a call that a child of which made the last op (that child returned):
        the op about to run, its caller's, saves it (``gate * mlp(x)`` saves mlp's output), at the caller's TP
        share and outside any checkpoint of the child, as the real step keeps it."""
        return not self.backward and bool(self.fwd_stack) and self.last_op_module != self.fwd_stack[-1] \
            and is_within(self.last_op_module, self.fwd_stack[-1])

    def watch_saved(self, storage: torch.UntypedStorage | None, nbytes: int) -> None:
        """A storage just charged as saved by an op of the innermost call running: when autograd frees it in that
        call's backward (once the node that saved it last has run), the backward op just recorded gets its bytes
        as ``Event.freed``."""
        owner = self.saving_call()
        if storage is None or owner is None or self.made_outside(StorageWeakRef(storage)):
            return  # the saving call's input (or an ancestor's): its lifetime is its caller's
        key = self._watch_count
        self._watch_count += 1
        self._watched[key] = weakref.ref(storage, lambda _: self.saved_freed(key, owner, nbytes))

    def made_outside(self, ref: StorageWeakRef) -> bool:
        """Whether a storage a call's input took came from outside the call saving it now: one of the calls running
        took it (or it is counted as an input otherwise: a template's own inputs, a replayed call's outputs). A
        storage the saving call made and handed only to calls inside it (Bloom's attention probabilities, given to
        its dropout module and saved by the next ``bmm``) is its own: autograd frees it in its backward."""
        if ref not in self.input_storages:
            return False
        takers = self.takers.get(ref)
        return takers is None or any((f, self.calls.get(f, 1) - 1) in takers for f in self.fwd_stack)

    def unwatch(self) -> None:
        self._watched.clear()

    def saved_freed(self, key: int, owner: Call, nbytes: int) -> None:
        if self._watched.pop(key, None) is not None:
            self.freed_by(owner, nbytes)

    def freed_by(self, owner: Call, nbytes: int) -> None:
        """Saved bytes of ``owner`` freed now: the last op's ``Event.freed`` when it is ``owner``'s, a backward one."""
        if self.backward and self.innermost_backward() == owner:
            self.add_freed(nbytes)

    def saving_call(self) -> Call | None:
        """The module call a save is charged to (``sim/recompute.py``: the innermost running)."""
        return (self.fwd_stack[-1], self.calls[self.fwd_stack[-1]] - 1) if self.fwd_stack else None

    def innermost_backward(self) -> Call | None:
        return innermost_call(self.bwd_active)

    def add_freed(self, nbytes: int) -> None:
        """``Event.freed`` of the last op, a backward one."""
        if self.last_op >= 0 and self.events[self.last_op].backward:
            e = self.events[self.last_op]
            self.events[self.last_op] = e._replace(freed=e.freed + nbytes)

    def outside_modules(self) -> bool:
        """Whether an op now runs outside every module call: the loss, or its backward before the model's."""
        return not self.fwd_stack and not self.bwd_active and not (self.backward and self.bwd_started)

    def ops(self, batch: list[tuple[tuple[int, ...], int, int, OpClass, int, int, bool, int, int, int, int]]
            ) -> None:
        """Several ops in a row in the same module (replayed calls): (params, flops, bytes, class, output bytes,
        kernel, host sync, temporaries made in the call, kernel workspace, gradient bytes, saved bytes freed) each;
        those alive from before the call (``Temporaries``) are alive during it too."""
        module, backward = self.current_module(), self.backward
        outer = 0 if backward else self.temporaries.current
        first = len(self.events)
        self.events.extend([Event(EventKind.OP, module, 0, params, flops, nbytes, 0, True, backward,
                                  live=live + outer if live or outer else 0, op_class=op_class,
                                  out_nbytes=out_nbytes, kernel=kernel, grad_live=grad_live, freed=freed,
                                  workspace=workspace, syncs=syncs)
                            for params, flops, nbytes, op_class, out_nbytes, kernel, syncs, live, workspace, grad_live,
                            freed in batch])
        masks = [i for i, b in enumerate(batch) if b[3] is OpClass.ATTENTION_MASK]
        if masks:
            self.last_mask_op = first + masks[-1]
        saved, made = self.take_pending(module) if batch else (0, ())
        if saved:
            self.events[first] = self.events[first]._replace(saved=saved, made_at=made)
        if batch and self.resaves and not backward:
            self.events[first] = self.events[first]._replace(resaved=tuple(self.resaves.values()))
            self.resaves = {}
        self.last_op, self.last_op_module = len(self.events) - 1, module
        self.new_inputs.clear()

    def made_grads(self, made: list[tuple[StorageWeakRef, int]]) -> None:
        """The storages (and bytes) the op just recorded made in backward, in case one becomes a param's grad."""
        for ref, nbytes in made:
            self.grads_made[ref] = (self.last_op, nbytes)

    def gradients_made(self, tensors: list[torch.Tensor]) -> None:
        """Gradients made apart from any op (a replayed call's input grads): gradients, alive as an op's would be
        (``Event.grad_live``)."""
        for g in tensors:
            self.grad_storages.add(StorageWeakRef(g.untyped_storage()))
            self.gradients.track(g)

    def param_grad(self, ref: StorageWeakRef) -> None:
        """A param's grad is this storage: not a gradient of an activation (the FSDP2 replay counts one param
        grad from the param's first backward use), so one param grad's bytes leave the ``grad_live`` of each op
        it or a contribution autograd summed into it was counted at (a tied weight's, one per use,
        ``Gradients.summed``). Only one: where contributions are alive together, the rest are bytes beside the
        replay's (a tied embedding's out-of-place sum holds the head's contribution, the embedding's and their
        sum: three embedding-sized tensors, -19% on Qwen3-0.6B's peak when all were taken off)."""
        self.param_grads.add(ref)
        self.grads_made.pop(ref, None)
        counted: dict[int, int] = {}  # op position -> the largest of them counted there
        for born, died, nbytes in self.gradients.forget(ref):
            for i in range(born, min(died, self.position())):  # every op counts every gradient alive
                counted[i] = max(counted.get(i, 0), nbytes)
        for i, nbytes in counted.items():
            self.uncount(i, nbytes)

    def uncount(self, i: int, nbytes: int) -> None:
        """Takes ``nbytes`` off the ``grad_live`` of the op at position ``i``."""
        e = self.events[i]
        if e.grad_live:
            self.events[i] = e._replace(grad_live=max(0, e.grad_live - nbytes))

    def made(self, tensors: Iterable[Any]) -> None:
        """A forward op's or module call's outputs: in the frames of the calls running until they are saved or
        freed (``Event.held``); a param's, a buffer's or a saved storage is no such output."""
        if not self.backward:
            self.frame.track(t for t in tensors if isinstance(t, torch.Tensor) and StorageWeakRef(
                t.untyped_storage()) not in self.first_saves and StorageWeakRef(
                t.untyped_storage()) not in self.static_storages)

    def made_by_keepable(self, tensors: Iterable[Any]) -> None:
        """The outputs of the forward op about to be recorded, one an op-level policy can keep (``OpClass`` other
        than OTHER): their storages' maker, for the calls that keep them and the ops that save them
        (``Event.made_at``). Each storage's first maker (a view's op made none); the weak reference kept keeps
        its address from being reused (``Slot.returned``)."""
        if not self.backward:
            where = self.maker()
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self.makers.setdefault(StorageWeakRef(t.untyped_storage()), where)

    def maker(self) -> Any:
        """What ``makers`` names the op about to be recorded by: its position (``ActionLog``'s: its place among the
        recorded call's forward ops)."""
        return self.position()

    def made_at(self, ref: StorageWeakRef, nbytes: int) -> tuple:
        """A storage saved first now: its ``Event.made_at`` entry when a call running took it as its input (its
        lifetime is not the saving call's: ``watch_saved``) and an op a policy can keep made it."""
        maker = self.makers.get(ref)
        return ((maker, nbytes),) if maker is not None and self.made_outside(ref) else ()

    def temporary(self, tensors: Iterable[torch.Tensor]) -> int:
        """A forward op's outputs inside the model, tracked as temporaries (``Temporaries``) unless their storage
        is counted elsewhere: a param's or a buffer's, a saved one, or one a call's ``inputs_nbytes`` counted (a
        checkpoint holds it). Returns the temporaries' bytes alive now (``Event.live``)."""
        self.temporaries.track(t for t in tensors if self.unclaimed(StorageWeakRef(t.untyped_storage())))
        return self.temporaries.current

    def outlived(self, storages: Iterable[weakref.ref]) -> None:
        """Temporaries a template's recording made (``reuse.py``) that outlived the call (a mask a cache keeps):
        the step's from now on, as they are when the call is traced in it."""
        for ref in storages:
            storage = ref()
            if storage is not None and self.unclaimed(StorageWeakRef(storage)):
                self.temporaries.track_storage(storage)

    def unclaimed(self, ref: StorageWeakRef) -> bool:
        return ref not in self.static_storages and ref not in self.first_saves and ref not in self.input_storages

    def packed(self, ref: StorageWeakRef) -> bool:
        """A storage packed for backward in forward leaves the frame's count; each open call notes what its frame
        holds now, at its latest pack (where a recomputation of it stops, ``Event.held``). Whether the frame
        tracked it."""
        if self.backward:
            return True
        tracked = self.frame.untrack(ref, saved=True)
        self.frame.packed()
        return tracked

    def first_saved(self, ref: StorageWeakRef, nbytes: int, tracked: bool) -> None:
        """A storage saved for the first time: the kept inputs' (``Event.saved_inputs``); one the frame did not
        track, the saves of the running calls that did not keep it (``FrameBytes.saved_untracked``)."""
        for kept in self.kept_stack:
            if ref in kept.refs:
                kept.saved += nbytes
        if not tracked:
            self.frame.saved_untracked(nbytes, [ref not in kept.refs for kept in self.kept_stack])

    def closed(self, grads_nbytes: int) -> tuple[int, int, int]:
        """``Event.held``, ``rise`` and ``saved_inputs`` of the call ending now (its marks popped)."""
        held, rise, _ = self.frame.close()
        kept = self.kept_stack.pop() if self.kept_stack else KeptInputs({})
        return held + grads_nbytes, rise, kept.saved

    def opened(self) -> None:
        """A call begins: its frame, and the inputs ``call_inputs`` found its checkpoint keeps."""
        self.frame.open()
        self.kept_stack.append(KeptInputs(self.kept_next))
        self.kept_next = {}


    def mask_made(self, tensors: Iterable[Any]) -> None:
        """The outputs of the attention-mask op about to be recorded (``OpClass.ATTENTION_MASK``)."""
        self.mask_storages.update(StorageWeakRef(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor))

    def save(self, ref: StorageWeakRef, nbytes: int, storage: torch.UntypedStorage | None = None,
             mask: bool = False, made: tuple | None = None) -> None:
        """Activation bytes saved for backward, once per storage, charged to the op that saved them; every pack is
        marked (``pack``); ``storage``: the storage itself, watched until autograd frees it (``watch_saved``).
        A mask's bias (``mask``, or made by a mask op) is charged to the mask op that made it: the attention packs
        it with its queries, keys and values, which tensor parallelism shards where it does not shard the bias.
        The charged op gets the save's ``Event.made_at`` too (``made``: a replayed call's, as its recording found
        it; else found here)."""
        tracked = self.packed(ref)
        self.pack()
        if self.backward or ref in self.static_storages:
            return
        first = self.first_saves.get(ref)
        if first is not None:
            if first[0] != self.position() - 1:
                self.resaves[ref] = (*first, nbytes)
            return
        if storage is not None and self.outside_modules() and self.loss.holds(storage):
            # the loss saves what its region counts alive until autograd frees it (the model's output, which an
            # op's input save would charge to the model's last op, held until that module's backward: twice)
            return
        at = self.position() - 1  # (the k-th storage first saved from there: two an op saves are two)
        self.saves_at[at] = self.saves_at.get(at, -1) + 1
        self.first_saves[ref] = (at, self.saves_at[at])
        self.first_saved(ref, nbytes, tracked)
        # a temporary until now: the op that saves it counted it alive, and charges it as saved instead
        unsaved = self.unsaved(ref)
        if self.last_op < 0 or ref in self.step_inputs:  # an input (saved before any op ran, or the batch
            return  # itself): seen, not charged
        e = self.events[self.last_op]  # (no longer its temporary, whichever op the bytes are charged to)
        self.events[self.last_op] = e._replace(live=max(0, e.live - unsaved))
        made = self.made_at(ref, nbytes) if made is None else made
        if (mask or ref in self.mask_storages) and self.last_mask_op >= 0:
            self._charge(self.last_mask_op, nbytes, made)
        elif self.saved_by_caller():
            saving = self.current_module()
            if self.pending is not None and self.pending[:2] != (self.last_op, saving):
                self.flush_pending()
            before = self.pending[2:] if self.pending else (0, ())
            self.pending = (self.last_op, saving, nbytes + before[0], before[1] + made)
        else:
            self._charge(self.last_op, nbytes, made)
        self.watch_saved(storage, nbytes)

    def _charge(self, i: int, nbytes: int, made: tuple = ()) -> None:
        """Saved bytes (and their ``Event.made_at``) on the event at ``i``."""
        e = self.events[i]
        self.events[i] = e._replace(saved=e.saved + nbytes, made_at=e.made_at + made)

    def unsaved(self, ref: StorageWeakRef) -> int:
        """Bytes of a storage just saved that the last op counted as a temporary (``Event.live``)."""
        return self.temporaries.forget(ref) or self.new_inputs.pop(ref, 0)

    def pack(self) -> None:
        """A tensor packed for backward in forward: marks the last event (``Event.packs``), not the last op, so that
        a pack after a module call's pre-forward (its first op's inputs) is not charged to the call before."""
        if not self.backward and self.events and not self.events[-1].packs:
            self.events[-1] = self.events[-1]._replace(packs=True)

    def call_inputs(self, fqn: str, tensors: list[torch.Tensor], holder: bool) -> tuple[int, int, tuple]:
        """A call's tensor inputs (params excluded): (bytes of the storages no earlier call counted, ``inputs_nbytes``;
        bytes of those a checkpoint of the call keeps, ``kept_inputs``; the ops a policy can keep that made those,
        ``Event.made_at``). A checkpoint keeps a storage that no param-holding call took before, or that one of the
        calls running took (the call's ancestor: an encoder hands its input to its first block): a paramless call
        (a rotary embedding given the hidden states for their dtype, a dropout) is no checkpoint a plan makes, and
        an ancestor checkpointed holds the call's checkpoint inside its own. A ``holder`` (the call holds params,
        its own or below it) takes the storages. The batch (``step_inputs``) is no kept input: ``Trace.inputs_nbytes``
        holds it all step (a chain's first block given it as it is, checkpointed, held it twice: +4.9% on 8 fake
        ranks)."""
        nbytes = kept = 0
        seen: set[StorageWeakRef] = set()
        kept_refs: dict[StorageWeakRef, int] = {}
        made: list[tuple[Any, int]] = []
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            if ref in self.static_storages or ref in seen:
                continue
            seen.add(ref)
            size = t.untyped_storage().nbytes()
            first = ref not in self.input_storages
            if first:
                # counted here from now on (a checkpointed call's inputs), no longer as a temporary
                forgotten = self.temporaries.forget(ref)
                if forgotten:
                    self.new_inputs[ref] = forgotten
                nbytes += size
            if (first or (owner := self.input_storages[ref]) is None or owner in self.fwd_stack) \
                    and ref not in self.step_inputs:
                kept += size
                kept_refs[ref] = size
                if ref in self.makers:
                    made.append((self.makers[ref], size))
            if holder or first:
                self.input_storages[ref] = fqn if holder else None
            self.takers.setdefault(ref, set()).add((fqn, self.calls.get(fqn, 0)))
        self.kept_next = kept_refs
        return nbytes, kept, tuple(made)

    def own_region(self, begin: bool, reentrant: bool = False) -> None:
        """A region of the model's own ``torch.utils.checkpoint`` begins (or ends) here (``own_checkpoint.py``)."""
        if begin:
            self.own_regions += not self.own_bases
            self.own_bases.append((len(self.fwd_stack), reentrant))
        elif self.own_bases:
            self.own_bases.pop()

    def enter_forward(self, fqn: str, grad_inputs: bool, inputs_nbytes: int = 0, kept_inputs: int = 0,
                      made_at: tuple = (), input_dims: int = -1, passed: tuple[int, ...] = ()) -> int:
        call = self.calls.get(fqn, 0)
        self.calls[fqn] = call + 1
        self.input_dims.setdefault(fqn, input_dims)
        if self.own_bases and len(self.fwd_stack) == self.own_bases[0][0] and not self.backward:
            # outermost in the outermost region: what its checkpoint holds
            self.own_calls.append(OwnCall(fqn, call, self.own_bases[0][1], self.own_regions - 1))
        self.events.append(Event(EventKind.FWD_PRE, fqn, call=call, grad_inputs=grad_inputs,
                                 inputs_nbytes=inputs_nbytes, kept_inputs=kept_inputs, made_at=made_at,
                                 passed=passed))
        self.fwd_stack.append(fqn)
        self.opened()
        if grad_inputs:
            self.bwd_pending_post.add((fqn, call))
        return call

    def modified_input(self, fqn: str) -> None:
        """A call of ``fqn`` (now ending) modified one of its grad-requiring inputs in place."""
        self.modified_inputs.add(fqn)

    def aliased_input(self, fqn: str) -> None:
        """A call of ``fqn`` (now starting) was given one grad-requiring tensor in two inputs or more."""
        self.aliased_inputs.add(fqn)

    def modified_output(self, fqns: tuple[str, ...]) -> None:
        """The output of these modules' calls (one tensor, that each returned) was modified in place after: no TP
        style can return it (a DTensor's local tensor is a view autograd refuses to modify in place)."""
        self.modified_outputs.update(fqns)

    def modified_topk(self, fqn: str) -> None:
        """What a ``topk`` in ``fqn`` returned was modified in place after (transformers' Qwen MoE routers divide
        the top-k weights in place): op-level checkpointing that saves topk fails there."""
        self.modified_topks.add(fqn)

    def exit_forward(self, fqn: str, grads_nbytes: int = 0, replayed: tuple[int, int] | None = None) -> int:
        """The call ends; ``grads_nbytes``: its grad-requiring outputs' bytes; ``replayed``: its ``Event.held``
        and ``rise`` as a replayed template recorded them."""
        call = self.calls[fqn] - 1
        self.flush_pending()  # (saved by the call ending, and no op of it ran after)
        self.fwd_stack.pop()
        held, rise, saved_inputs = self.closed(grads_nbytes)
        if replayed is not None:
            held, rise = replayed
        if fqn == ROOT:
            held = rise = saved_inputs = 0
        self.events.append(Event(EventKind.FWD_POST, fqn, call=call, held=held, rise=rise,
                                 saved_inputs=saved_inputs))  # (the root: never checkpointed)
        return call

    def enter_backward(self, key: Call) -> None:
        # A module whose backward started earlier and that gets no post-backward marker (no grad inputs) is
        # finished once an unrelated module starts: close it so ops are attributed correctly.
        for k in list(self.bwd_active):
            if k not in self.bwd_pending_post and not is_within(key[0], k[0]):
                self.bwd_active.remove(k)
                self.events.append(Event(EventKind.BWD_POST, k[0], call=k[1], backward=True))
        self.bwd_active.append(key)
        self.bwd_started = True
        self.events.append(Event(EventKind.BWD_PRE, key[0], call=key[1], backward=True))

    def exit_backward(self, key: Call) -> None:
        self.bwd_pending_post.discard(key)
        if key in self.bwd_active:
            self.bwd_active.remove(key)
        self.events.append(Event(EventKind.BWD_POST, key[0], call=key[1], backward=True))

    def outputs(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """The grad-requiring outputs of the module call that just ended (templates compare them, see reuse.py)."""

    def finish_backward(self) -> None:
        for k in reversed(self.bwd_active):
            self.events.append(Event(EventKind.BWD_POST, k[0], call=k[1], backward=True))
        self.bwd_active.clear()


@dataclass
class KeptInputs:
    """A running call's inputs that a checkpoint of it keeps, as its forward uses them."""

    refs: dict[StorageWeakRef, int]  # storage -> bytes
    saved: int = 0  # bytes of them its ops saved first (``Event.saved_inputs``)


@dataclass
class _OpenCall:
    """A module call running, as ``FrameBytes`` sees it."""

    order: int  # storages tracked before it began
    start: int  # the frame's bytes when it began
    gone: int = 0  # bytes of older storages saved or freed since
    at_pack: int = 0  # its own frame's bytes at its latest pack
    saved: int = 0  # bytes of the storages it made that a pack saved
    peak: int = 0  # the most its own frame and those saves held together after any of its ops
    peak_at_pack: int = 0  # ``peak`` at its latest pack

    def own(self, current: int) -> int:
        return current + self.gone - self.start


class FrameBytes:
    """Bytes of live storages forward ops made that no pack has saved (``Event.held``), freed storages seen through
    weak references; and, per module call running, those of them made since it began, noted at each pack, and the
    most they and the call's own saves held together (``Event.rise``): a recomputation runs the same ops, so it
    holds that much at its height."""

    def __init__(self) -> None:
        self.current = 0
        self._sizes: dict[StorageWeakRef, int] = {}
        self._born: dict[StorageWeakRef, int] = {}  # storage -> its place in the order storages were tracked
        self._refs: dict[StorageWeakRef, weakref.ref] = {}
        self._order = 0
        self._calls: list[_OpenCall] = []

    def track(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            key = StorageWeakRef(storage)
            if key not in self._sizes:
                self._add(key, storage)

    def _add(self, key: StorageWeakRef, storage: torch.UntypedStorage) -> None:
        self._sizes[key] = storage.nbytes()
        self._born[key] = self._order
        self._order += 1
        self.current += self._sizes[key]
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self.untrack(key))

    def untrack(self, key: StorageWeakRef, saved: bool = False) -> bool:
        """Saved or freed: a storage made before a running call began leaves no bytes of that call's; one it made
        and a pack ``saved`` is its saves' from now on. Whether it was tracked."""
        if key not in self._sizes:
            return False
        nbytes = self._sizes.pop(key)
        born = self._born.pop(key, 0)
        self._refs.pop(key, None)
        self.current -= nbytes
        for call in self._calls:
            if born < call.order:
                call.gone += nbytes
            elif saved:
                call.saved += nbytes
        return True

    def saved_untracked(self, nbytes: int, own: Sequence[bool]) -> None:
        """A first save of a storage no op here made (a replayed call's output): the saves of the running calls
        ``own`` marks, innermost last (those it was no kept input of), from now on."""
        for call, mine in zip(reversed(self._calls), reversed(own), strict=False):
            if mine:
                call.saved += nbytes

    def open(self) -> None:
        self._calls.append(_OpenCall(self._order, self.current))

    def op_done(self) -> None:
        """A forward op ran, its outputs tracked: each running call's height so far."""
        for call in self._calls:
            call.peak = max(call.peak, call.own(self.current) + call.saved)

    def packed(self) -> None:
        for call in self._calls:
            call.at_pack = call.own(self.current)
            call.peak_at_pack = call.peak

    def replayed(self, held: int, rise: int) -> None:
        """A replayed call packed last: what its recording's frame held then, which no op here made, counts too;
        and its recording's height before then, held then and ``rise`` more (its saves are counted as they are
        replayed)."""
        for call in self._calls:
            height = call.own(self.current) + call.saved + held + rise
            call.peak_at_pack, call.peak = max(call.peak_at_pack, height), max(call.peak, height)
            call.at_pack += held

    def replayed_height(self, excess: int) -> None:
        """A replayed call ran: its recording's height beyond its saves (``close``) counts in the running calls'."""
        for call in self._calls:
            call.peak = max(call.peak, call.own(self.current) + call.saved + excess)

    def close(self) -> tuple[int, int, int]:
        """The call ending now: the bytes of the storages it made that were alive and unsaved at its last pack, how
        much more it held before then (``Event.rise``), and its height less all its saves (a replay's, which
        replays the saves: ``replayed_height``)."""
        if not self._calls:
            return 0, 0, 0
        call = self._calls.pop()
        held = max(0, call.at_pack)
        return held, max(0, call.peak_at_pack - held - call.saved), call.peak - call.saved


class LossRegion:
    """Live bytes of the tensors the loss works on, outside the model: its outputs and what the loss's ops and
    their backward make, counted from the model's last output until backward reaches a module. A saved-tensor
    view misses most of it (a language model's logits in bf16 and fp32, the loss's gradient), and at the loss
    it is often the step's peak. Freed storages are seen through weak references, as ``fake_world.LiveBytes``
    counts. Each storage's lifetime is kept too (``blocks``): the order of these few large blocks decides how
    the caching allocator packs them (``sim/allocator.py``)."""

    def __init__(self, clock: Callable[[], int] = lambda: 0) -> None:
        self.current = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._clock = clock  # the position the next event will take
        self._born: dict[int, int] = {}
        self._ended: list[tuple[int, int, int]] = []

    def track(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.current += self._sizes[key]
                    self._born[key] = self._clock()
                    self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether this storage is one the region counts."""
        return id(storage) in self._sizes

    def _free(self, key: int) -> None:
        size = self._sizes.pop(key, 0)
        self.current -= size
        self._refs.pop(key, None)
        if key in self._born:
            self._ended.append((self._born.pop(key), self._clock(), size))

    @property
    def blocks(self) -> tuple[tuple[int, int, int], ...]:
        """(position of the event that made it, position before whose allocations it was freed or -1 if it was
        not, bytes) of each storage tracked, in the order they were freed (the still live ones last)."""
        alive = [(born, -1, self._sizes[key]) for key, born in self._born.items()]
        return tuple(self._ended + alive)


class Temporaries:
    """Live bytes of the storages forward ops inside the model made that no op saved for backward and no call
    took as an input (``StepRecorder.temporary``): index and mask arithmetic a module holds in Python while it
    works (T5's relative-position buckets, seq x seq int64 tensors, five of them alive at once: 196 MiB of a 200 MiB
    peak at seq 2,048), and float tensors held in locals (a loss computed in the model's forward: the logits in
    the compute dtype and their fp32 copy, neither saved; -12.6% on a tiny transformers Llama given labels without
    them). Saved ones are counted where they are saved, a call's inputs by the call (``Event.inputs_nbytes``);
    these were counted nowhere. Counted at the trace's dtypes (the plan's compute dtype). Freed storages are seen
    through weak references, as ``LossRegion`` sees them."""

    def __init__(self) -> None:
        self.current = 0
        self._sizes: dict[int, int] = {}  # storage (``StorageWeakRef.cdata``) -> bytes
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self.track_storage(t.untyped_storage())

    def track_storage(self, storage: torch.UntypedStorage) -> None:
        key = StorageWeakRef(storage).cdata
        if key not in self._sizes:
            self._sizes[key] = storage.nbytes()
            self.current += self._sizes[key]
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self.forget_key(key))

    def alive(self) -> list[weakref.ref]:
        """The storages tracked and alive, held weakly."""
        return list(self._refs.values())

    def forget(self, ref: StorageWeakRef) -> int:
        """A storage saved for backward: an activation from now on, counted as one. Returns the bytes it held here."""
        return self.forget_key(ref.cdata)

    def forget_key(self, key: int) -> int:
        nbytes = self._sizes.pop(key, 0)
        self.current -= nbytes
        self._refs.pop(key, None)
        return nbytes


class Gradients:
    """Live bytes of the gradients backward ops make (``Event.grad_live``), seen freed through weak references as
    ``LossRegion`` sees storages; and per gradient, its lifetime (the positions of the op that made it and of the
    event before which it was freed) and, for autograd's accumulation (an add of gradients), the gradients it
    summed: a param's grad summed from several contributions (a tied weight, read by the embedding and the head)
    is counted by the FSDP2 replay from the param's first backward use, so those contributions are not counted
    here (``StepRecorder.param_grad``)."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.current = 0
        self._clock = clock  # the position of the event being recorded
        self._records: dict[int, list] = {}  # storage (``StorageWeakRef.cdata``) -> [born, died, bytes, summed]
        self._refs: dict[int, weakref.ref] = {}

    def track(self, t: torch.Tensor, summed: Iterable[StorageWeakRef] = ()) -> list:
        """Counts ``t``'s storage from now until it is freed; its record, [born, died (-1 until then), bytes,
        summed]."""
        storage = t.untyped_storage()
        key = StorageWeakRef(storage).cdata
        if key not in self._records:  # records, not keys: a freed storage's key may be a new one's
            sources = [self._records[r.cdata] for r in summed if r.cdata in self._records]
            self._records[key] = [self._clock(), -1, storage.nbytes(), sources]
            self.current += storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._end(key))
        return self._records[key]

    def holds(self, ref: StorageWeakRef) -> bool:
        return ref.cdata in self._records

    def nbytes(self, tensors: Iterable[Any]) -> int:
        """Bytes of the gradients alive among these tensors' storages (each once)."""
        keys = {StorageWeakRef(t.untyped_storage()).cdata for t in tensors if isinstance(t, torch.Tensor)}
        return sum(self._records[k][2] for k in keys if k in self._records)

    def _end(self, key: int) -> list | None:
        record = self._records.pop(key, None)
        self._refs.pop(key, None)
        if record is not None:
            self.current -= record[2]
            record[1] = self._clock()
        return record

    def forget(self, ref: StorageWeakRef) -> list[tuple[int, int, int]]:
        """A storage that became a param's grad leaves the count: (born, died, bytes) of it and of what it summed,
        each over the positions it was counted at."""
        record = self._end(ref.cdata)
        out, todo = [], [record] if record is not None else []
        while todo:
            born, died, nbytes, sources = todo.pop()
            out.append((born, died if died >= 0 else self._clock(), nbytes))
            todo.extend(sources)
        return out


class NullRecorder(StepRecorder):
    """Records nothing: the target while the tracer makes tensors of its own (templates' inputs and grads)."""

    def __init__(self) -> None:
        super().__init__(set())

    def op(self, params: tuple[int, ...], flops: int, nbytes: int, live: int = 0,
           op_class: OpClass = OpClass.OTHER, out_nbytes: int = 0, kernel: int = 0, grad_live: int = 0,
           workspace: int = 0, syncs: bool = False) -> None:
        pass

    def outside_modules(self) -> bool:
        return False

    def save(self, ref: StorageWeakRef, nbytes: int, storage: torch.UntypedStorage | None = None,
             mask: bool = False, made: tuple | None = None) -> None:
        pass

    def made_by_keepable(self, tensors: Iterable[Any]) -> None:
        pass

    def mask_made(self, tensors: Iterable[Any]) -> None:
        pass

    def made_grads(self, made: list[tuple[StorageWeakRef, int]]) -> None:
        pass

    def param_grad(self, ref: StorageWeakRef) -> None:
        pass

    def modified_input(self, fqn: str) -> None:
        pass

    def aliased_input(self, fqn: str) -> None:
        pass

    def modified_output(self, fqns: tuple[str, ...]) -> None:
        pass

    def modified_topk(self, fqn: str) -> None:
        pass

    def call_inputs(self, fqn: str, tensors: list[torch.Tensor], holder: bool) -> tuple[int, int, tuple]:
        return 0, 0, ()

    def own_region(self, begin: bool, reentrant: bool = False) -> None:
        pass


NULL = NullRecorder()


class Slot:
    """Where the hooks, the dispatch mode and the saved-tensor hook send what they see: the step's recorder,
    or (while a repeated module is traced once on its own, see ``reuse.py``) something else."""

    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder
        self.produced: set[StorageWeakRef] | None = None  # when set: storages of every op's outputs are added
        # the storages forward calls returned -> the modules that returned them (a call returning its child's output
        # as-is too; a replayed call's inner ones from its template), whichever recorder saw the call
        self.returned_by: dict[StorageWeakRef, tuple[str, ...]] = {}
        self.topk_by: dict[StorageWeakRef, str] = {}  # the storages topk made -> the module it ran in

    def topk_made(self, fqn: str, tensors: Iterable[Any]) -> None:
        """A ``topk`` in ``fqn`` made ``tensors`` (its values and indices)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.topk_by[StorageWeakRef(t.untyped_storage())] = fqn

    def returned(self, fqn: str, tensors: Iterable[torch.Tensor]) -> None:
        """A forward call of ``fqn`` returned ``tensors``. (The weak reference kept keeps the storage's address
        from being reused while it is held: a later tensor is never taken for one freed.)"""
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            known = self.returned_by.get(ref, ())
            if fqn not in known:
                self.returned_by[ref] = (*known, fqn)

    def written(self, tensors: Iterable[torch.Tensor]) -> None:
        """A forward op modified ``tensors`` in place: the calls that had returned one of them, and are not running
        again (a call writing its own earlier output), are told to the recorder (``modified_output``)."""
        running = set(self.recorder.fwd_stack)
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            fqns = tuple(f for f in self.returned_by.get(ref, ()) if f not in running)
            if fqns:
                self.recorder.modified_output(fqns)
            if ref in self.topk_by:  # (op-level checkpointing's cache of it would be modified: torch refuses)
                self.recorder.modified_topk(self.topk_by[ref])
