"""What activation checkpointing changes in a step: the activations held, and the forward run again in backward.

A checkpointed module call (non-reentrant ``torch.utils.checkpoint``, ``fsdp2/checkpointing.py``) keeps its inputs
alive from its forward until its backward is done instead of the activations its ops save. Its backward starts by
running its forward again (with ``early_stop``, stopping once the saved tensors are back): the saved activations
are then re-created at its pre-backward boundary and freed as before, when the backward of the module call that
saved each is done; the recomputation costs the call's forward op time there, after its group's params are
gathered (FSDP2's pre-backward unshards the group before autograd reaches the checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.records import Trace


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


def checkpointed_calls(trace: Trace, modules: Iterable[str]) -> list[CheckpointedCall]:
    """The calls of ``modules`` that ran a backward (a call without one saves nothing to recompute)."""
    out = []
    by_module = trace.index.boundaries_by_module
    for m in modules:
        pos: dict[tuple[EventKind, int], int] = {}
        for i in by_module.get(m, ()):
            e = trace.events[i]
            pos.setdefault((e.kind, e.call), i)
        for (kind, call), fwd_pre in pos.items():
            if kind is not EventKind.FWD_PRE:
                continue
            bwd_pre, bwd_post = pos.get((EventKind.BWD_PRE, call)), pos.get((EventKind.BWD_POST, call))
            if bwd_pre is None or bwd_post is None or bwd_post < bwd_pre:
                continue
            out.append(CheckpointedCall(m, call, fwd_pre, pos[(EventKind.FWD_POST, call)], bwd_pre, bwd_post,
                                        trace.events[fwd_pre].inputs_nbytes))
    return sorted(out, key=lambda c: c.fwd_pre)


def activation_deltas(trace: Trace, calls: Sequence[CheckpointedCall], scale: float) -> np.ndarray:
    """Change in activation bytes at each event (index ``len(events)``: after the final callback): saved in
    forward and freed when the saving module call's backward is done; under a checkpointed call, its inputs held
    instead and its activations re-created at its pre-backward. Outside the model (the loss, and its backward
    until a module's pre-backward) the trace's live bytes are used instead: saved tensors there are a fraction
    of what is alive."""
    n = len(trace.events)
    deltas = np.zeros(n + 1)
    start_at = {c.fwd_pre: c for c in calls}
    fwd_pre, fwd_post, bwd_post = EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_POST
    stack: list[tuple[str, int]] = []
    saved_by: dict[tuple[str, int], float] = {}
    inside: CheckpointedCall | None = None  # the checkpointed call whose forward is running
    recreated: dict[int, float] = {}  # pre-backward position -> activations re-created there
    outside = 0.0  # the loss region's live bytes (scaled) last counted
    reached = False  # backward has reached a module
    for i, e in enumerate(trace.events):
        kind = e.kind
        if kind is EventKind.OP:
            if (e.backward and not reached) or (not e.backward and not stack):
                # the loss region: its own live count replaces the saved-tensor view (``recorder.LossRegion``)
                deltas[i] += e.live * scale - outside
                outside = e.live * scale
            elif e.saved and not e.backward:
                key = stack[-1]
                nbytes = e.saved * scale
                saved_by[key] = saved_by.get(key, 0.0) + nbytes
                if inside is None:
                    deltas[i] += nbytes
                else:
                    recreated[inside.bwd_pre] = recreated.get(inside.bwd_pre, 0.0) + nbytes
        elif kind is fwd_pre:
            stack.append((e.module, e.call))
            c = start_at.get(i)
            if c is not None and inside is None:
                inside = c
                deltas[i] += c.inputs_nbytes * scale
                deltas[c.bwd_post] -= c.inputs_nbytes * scale
        elif kind is fwd_post:
            stack.pop()
            if inside is not None and i == inside.fwd_post:
                inside = None
        elif kind is EventKind.BWD_PRE and not reached:  # backward reached the model: the loss region is done
            reached = True
            deltas[i] -= outside
            outside = 0.0
        elif kind is bwd_post and (e.module, e.call) in saved_by:
            deltas[i] -= saved_by.pop((e.module, e.call))
    for pos, nbytes in recreated.items():
        deltas[pos] += nbytes
    return deltas
