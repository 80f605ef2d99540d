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
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from fsdp_planner.errors import PlannerError
from fsdp_planner.patching import patched
from fsdp_planner.trace.events import OwnCall
from fsdp_planner.trace.step import Slot

COMPOSABLE = "torch.distributed._composable.checkpoint_activation"
# Op-level selective checkpointing of the model's own: what its policy keeps is not modelled (modelled in full, a
# DiT keeping its matmuls was predicted 46% low on 8 fake ranks)
SELECTIVE = ("the model passes a context_fn to torch.utils.checkpoint (op-level selective checkpointing of its own), "
             "which the planner does not model yet: call it without context_fn, or build the model without its own "
             "checkpointing and plan op-level checkpointing with --ac op")


class OwnCheckpoints:
    """While ``installed``, ``torch.utils.checkpoint`` (non-reentrant and reentrant, ``checkpoint_sequential`` and
    ``checkpoint_wrapper`` through it, and the composable ``checkpoint(module)`` a model applies itself) runs its
    function plainly, telling the slot's recorder where each region begins and ends (``StepRecorder.own_region``)."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch_checkpoint, "_checkpoint_without_reentrant_generator", self._plain))
            stack.enter_context(patched(torch_checkpoint, "CheckpointFunction", _Reentrant(self.slot)))
            composable = sys.modules.get(COMPOSABLE)
            if composable is not None:  # imported (a model applied it): it took torch's generator by name
                stack.enter_context(patched(composable, "_checkpoint_without_reentrant_generator", self._plain))
            yield

    def _plain(self, fn: Callable[..., Any], preserve_rng_state: bool = True,
               context_fn: Callable[..., Any] = torch_checkpoint.noop_context_fn, *args: Any,
               **kwargs: Any) -> Iterator[None]:
        """The non-reentrant generator: ``checkpoint`` runs the function between its two steps."""
        if context_fn is not torch_checkpoint.noop_context_fn and getattr(context_fn, "__module__", "") != COMPOSABLE:
            # (the composable checkpoint always passes one of its own)
            raise PlannerError(SELECTIVE)
        self.slot.recorder.own_region(True)
        try:
            yield
        finally:
            self.slot.recorder.own_region(False)

    def note(self, calls: tuple[OwnCall, ...]) -> str | None:
        """One line saying what the trace made of the model's own checkpointing, if it has any."""
        if not calls:
            return None
        first = calls[0].module
        return (f"the model checkpoints {len(calls)} module call(s) itself (torch.utils.checkpoint, '{first}' first): "
                "modelled as checkpointed in full, as --ac full models a block; a plan's --ac full or op on "
                "the same modules nests inside it and holds the memory instead (one recomputation), unless the "
                "model's is reentrant")


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
