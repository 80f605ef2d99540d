"""Tensors saved for backward, seen through saved-tensor hooks: their bytes are the step's activations, and their
versions are checked as autograd checks them without hooks."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_planner.trace.step import Slot


def saved_tensor_hooks(slot: Slot) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks charging each saved storage to the slot's recorder; a tensor modified in place after it was saved
    fails the trace as it fails the real step."""

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        storage = t.untyped_storage()
        slot.recorder.save(StorageWeakRef(storage), storage.nbytes(), storage)
        return t, t._version

    def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        # Autograd skips its own version check on tensors that saved-tensor hooks pack: done here, as it does it
        t, version = packed
        if t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.dtype} {list(t.shape)}] is at version {t._version}; expected version {version} instead (the "
                f"model's backward fails the same way without the tracer)")
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def foreign_saved_hooks() -> bool:
    """Whether saved-tensor hooks other than the tracer's are on top: the user's own (``save_on_cpu``) push theirs
    over the tracer's, and they count or move what a call saves, so such a call must run its real ops (a replayed
    stand-in saves other tensors). ``torch.utils.checkpoint``'s are not pushed while traced (``own_checkpoint.py``)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__module__", None) != __name__
