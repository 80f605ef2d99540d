"""A checkpoint is data: DCP's pickles read without running anything from the files.

``dcp.load`` unpickles the checkpoint's ``.metadata`` with plain ``pickle.load``, and each non-tensor value of the
state (an optimizer's ``lr``) with ``torch.load(weights_only=False)``: a crafted checkpoint ran ``os.system`` in
every rank. Here ``.metadata`` goes through ``MetadataUnpickler``, which builds only DCP's own metadata classes,
torch's sizes, dtypes and layouts, paths and builtin containers (an allow-list: any other global is refused in one
line, before it is looked up), and the non-tensor values through ``torch.load(weights_only=True)``, as DCP already
reads the tensor shards. ``verify`` reads the metadata this way before any rank starts; the ranks read it again
the same way (``safe_reader``), so a file changed in between is refused too.
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fsdp_planner.errors import PlannerError
from fsdp_planner.userfiles import MAX_FILE_BYTES, read_bytes

DCP_METADATA = ".metadata"  # the pickle dcp.save writes beside its shards (FileSystemWriter's name)

# What DCP's metadata pickle names (torch 2.4 to 2.13): its dataclasses and enum, the storage index of the file
# system writer, and what their fields hold.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name (torch.strided)
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}


@functools.cache
def _torch_names() -> frozenset[str]:
    """``torch.Size`` and every dtype (``torch.float32``): what a tensor's metadata names in ``torch``."""
    return frozenset({"Size", *(name for name, v in vars(torch).items() if isinstance(v, torch.dtype))})


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A pickle that names a global outside the allow-list: nothing of it was built."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the allow-listed globals (``find_class`` is the one way a pickle
    reaches code: ``os.system``, ``builtins.eval``, ``subprocess.Popen`` are all globals)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _torch_names() if module == "torch" else _DCP_CLASSES.get(module, frozenset())
        if name not in allowed:
            shown = f"{module}.{name}"
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise UnsafeCheckpoint(f"{DCP_METADATA} names {shown!r}, which is not one of DCP's metadata classes: "
                                   "refusing to unpickle it (a checkpoint is data, never code)")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Any:
    """The unpickled metadata at ``path`` (a ``Metadata`` when DCP wrote it), at most ``MAX_FILE_BYTES``; raises
    ``UnsafeCheckpoint`` for a global outside the allow-list, and what pickle raises for a damaged file."""
    data = read_bytes(path, f"the checkpoint's {DCP_METADATA}", "the pickle dcp.save writes", MAX_FILE_BYTES)
    return MetadataUnpickler(io.BytesIO(data)).load()


def check_metadata(directory: Path, label: str) -> None:
    """Before any rank starts: refuse a ``.metadata`` that names anything but DCP's classes, in one line. A file
    that is merely damaged (truncated, not a pickle) is left to the ranks, which report it with DCP's cause as
    they do a damaged shard."""
    try:
        read_metadata(directory / DCP_METADATA)
    except UnsafeCheckpoint as e:
        raise PlannerError(f"{label}: {e}") from None
    except PlannerError:
        raise
    except Exception:  # a damaged file, whatever pickle raised for it: the ranks report it with DCP's cause
        pass


class SafeReader(FileSystemReader):
    """DCP's file system reader with ``.metadata`` read by ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"  # FileSystemReader's names
        metadata = read_metadata(Path(self.path) / name)
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with each non-tensor value read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # read here as plain values only, then handed on re-saved: DefaultLoadPlanner's own torch.load (no
        # weights_only) then reads what weights_only already built, and it places the value where it belongs
        plain = torch.load(value, weights_only=True)
        checked = io.BytesIO()
        torch.save(plain, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)
