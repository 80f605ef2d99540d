"""A model's own ``torch.utils.checkpoint`` (DiT's, SD3's and Flux's blocks, torchtune's ``checkpoint_wrapper``,
``checkpoint_sequential``), as the trace runs it: the region's function runs as it is, and its module calls are
marked checkpointed.

Run for real, the checkpoint hides what the trace measures: its saved-tensor hooks sit over the tracer's, so the
forward's saves are never seen, and its recomputation in backward runs outside the trace's function mode (SDPA
takes the math path there, not the fused kernel the forward took, and saves another number of tensors: torch's
CheckpointError) and saves under hooks of its own, so the activations it re-creates were never counted (a DiT
traced that way was predicted 29% low on 8 fake ranks). The trace records instead what the region would save
without the checkpoint and which module calls it ran (those outermost in it); the simulator then models each as
a call checkpointed in full, as it models a plan's ``--ac full`` (``fsdp2/checkpointing.own_calls``): its inputs
held after forward, its forward run again at its backward, the activations re-created there. Ops a region runs
outside any module call are modelled as not checkpointed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from fsdp_planner.patching import patched
from fsdp_planner.trace.step import Slot


@contextlib.contextmanager
def own_checkpoint_regions(slot: Slot) -> Iterator[None]:
    """Inside, ``torch.utils.checkpoint`` (non-reentrant and reentrant, ``checkpoint_sequential`` and
    ``checkpoint_wrapper`` through it) runs its function plainly, telling the slot's recorder where each region
    begins and ends (``StepRecorder.own_region``)."""

    def plain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
        # the non-reentrant generator: ``checkpoint`` runs the function between its two steps
        slot.recorder.own_region(True)
        try:
            yield
        finally:
            slot.recorder.own_region(False)

    with patched(torch_checkpoint, "_checkpoint_without_reentrant_generator", plain), \
            patched(torch_checkpoint, "CheckpointFunction", _Reentrant(slot)):
        yield


class _Reentrant:
    """Stands for ``CheckpointFunction`` (reentrant checkpoint): ``apply`` runs the function plainly, as a
    region."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    def apply(self, fn: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        self.slot.recorder.own_region(True, reentrant=True)
        try:
            return fn(*args)
        finally:
            self.slot.recorder.own_region(False)
