"""Distributed checkpoints of a verify run, loadable at another world size under another plan.

The sharded model and its optimizer are saved with ``torch.distributed.checkpoint`` (DCP) from the state dicts
``get_state_dict`` gives: keys are parameter names (FQNs), values DTensors, so the files do not depend on the
world size or on the grouping, and ``dcp.load`` + ``set_state_dict`` reshard them onto any plan. This is the
format a training script reads with the same two calls. Beside it:

- ``fsdp-planner.json``: the step reached, the world size and plan it was saved from, and a sha256 of every
  tensor of the full (gathered) model and optimizer state, so a load can prove it restored the same bytes;
- ``reference.pt``: the unsharded reference model and optimizer of the run, so verify's parity check spans the
  whole chain of runs (the reference never stops: it is one uninterrupted single-process training).

Loading reads data only: DCP's ``.metadata`` is a pickle, read with an allow-list of DCP's own classes, and every
value with ``weights_only`` (``checkpoint_pickle.py``), so a crafted checkpoint runs nothing; ``verify`` refuses a
directory without ``fsdp-planner.json`` of this format, or whose metadata names anything else, before any rank
starts. A file that cannot be read (missing, truncated, not DCP's) fails the ranks that read it with
``CheckpointLoadError``, naming the directory and the underlying error.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fsdp_planner.errors import PlannerError
from fsdp_planner.runtime.checkpoint_pickle import SafeLoadPlanner, SafeReader
from fsdp_planner.runtime.failures import checkpoint_cause, is_backend_error
from fsdp_planner.userfiles import parse_json, read_text, shown_json, write_atomic

META = "fsdp-planner.json"
REFERENCE = "reference.pt"
VERSION = 1


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value


def digests(state: dict[str, Any]) -> dict[str, str]:
    """sha256 of each tensor of a (full) state dict, and the repr of each other value, by flattened key
    (``model.<fqn>``, ``optim.state.<fqn>.momentum_buffer``, ``optim.param_groups.0.lr``)."""
    flat: dict[str, Any] = {}
    _flatten("", state, flat)
    return {k[1:]: _digest(v) if isinstance(v, torch.Tensor) else repr(v) for k, v in sorted(flat.items())}


def state_digests(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """``digests`` of the full model and optimizer state: what must be equal whatever world size and plan hold the
    state. A collective: every rank calls it."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return digests({"model": model_sd, "optim": optim_sd})


def save_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, reference: nn.Module,
                    ref_optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    """Every rank calls it; rank 0 writes the metadata and the reference."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    digests = state_digests(model, optimizer)
    # buffers each rank holds its own of (BatchNorm's running stats: FSDP2 syncs no buffer): DCP writes one rank's
    # copy, which a load must find among theirs (a param or optimizer state differing by rank is a mismatch)
    mine = {k: digests[k] for k in (f"model.{name}" for name, _ in model.named_buffers()) if k in digests}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank_local = {k: sorted({theirs.get(k, "") for theirs in everyone}) for k in sorted(mine)
                  if any(theirs.get(k) != mine[k] for theirs in everyone)}
    if dist.get_rank() == 0:
        torch.save({"model": reference.state_dict(), "optim": ref_optimizer.state_dict()}, directory / REFERENCE)
        write_atomic(directory / META, json.dumps({"version": VERSION, **meta, "digests": digests,
                                                   "rank_local": rank_local}, indent=1))
    dist.barrier()


def read_meta(directory: Path) -> dict[str, Any]:
    """The metadata verify wrote beside a checkpoint, checked: a hand-edited or foreign file is one line."""
    where = f"the checkpoint's {META} in '{directory}'"
    return parse_meta(read_text(directory / META, where, "the JSON verify --save-checkpoint writes"), where)


# What the metadata may hold: far beyond any real run, small enough that nothing built from it overflows.
MAX_STEP = 10**12
MAX_WORLD = 1 << 20  # the most ranks a checkpoint may say it was saved from (far beyond any job this tool runs)
MAX_LABEL = 10_000  # characters of the fingerprint, policy (fsdp2.plan.MAX_LABEL), and each digest key and value
MAX_DIGESTS = 10_000_000


def parse_meta(text: str, where: str) -> dict[str, Any]:
    """``fsdp-planner.json``'s fields, each of the type and range ``save_checkpoint`` writes; nesting, non-finite
    and over-long numbers are refused by ``parse_json``'s limits and the checks here, one line each."""
    meta = parse_json(text, lambda detail: f"{where} is not valid JSON: {detail}")
    if not isinstance(meta, dict):
        raise PlannerError(f"{where} is not a JSON object: it was not written by verify --save-checkpoint")
    if meta.get("version") != VERSION or isinstance(meta.get("version"), bool):
        raise PlannerError(f"{where} has format version {shown_json(meta.get('version'))}: this fsdp-planner reads "
                           f"version {VERSION}")
    for key, low, high in (("step", 0, MAX_STEP), ("world", 1, MAX_WORLD)):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise PlannerError(f"{where}: '{key}' must be a whole number from {low} to {high:,}, got {shown_json(v)}")
    for key in ("fingerprint", "policy"):
        if not _label(meta.get(key)):
            raise PlannerError(f"{where}: '{key}' must be a string of at most {MAX_LABEL:,} characters, got "
                               f"{shown_json(meta.get(key))}")
    digests = meta.get("digests")
    if not isinstance(digests, dict) or len(digests) > MAX_DIGESTS or \
            not all(_label(k) and _label(v) for k, v in digests.items()):
        raise PlannerError(f"{where}: 'digests' must map each tensor's name to its sha256 (strings)")
    local = meta.get("rank_local", {})  # (absent in checkpoints written before it was recorded)
    if not isinstance(local, dict) or len(local) > MAX_DIGESTS or not all(
            _label(k) and isinstance(v, list) and len(v) <= MAX_WORLD and all(map(_label, v))
            for k, v in local.items()):
        raise PlannerError(f"{where}: 'rank_local' must map each buffer's name to its ranks' sha256 (strings)")
    return meta


def _label(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_LABEL




class CheckpointLoadError(RuntimeError):
    """A checkpoint whose files cannot be read: one missing, truncated, or not what verify --save-checkpoint
    wrote."""


@contextmanager
def reading(directory: Path) -> Iterator[None]:
    """Errors reading ``directory``'s files as ``CheckpointLoadError`` naming it and the underlying error (DCP's
    ``CheckpointException`` unwrapped). A backend error passes as it is: a peer that died is an echo, not the
    checkpoint's fault (``failures.py``)."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        cause = checkpoint_cause(e)
        if is_backend_error(cause):
            raise cause from None
        message = str(cause).replace(f"{directory}{os.sep}", "")  # its files by name: the directory is said once
        detail = f"{type(cause).__name__}: {message}" if message else f"{type(cause).__name__} (a file ends early)"
        raise CheckpointLoadError(f"checkpoint '{directory}' cannot be loaded (a file missing, truncated or not "
                                  f"written by verify): {detail}") from None


def load_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, reference: nn.Module,
                    ref_optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore the sharded state (resharded onto this world size and plan) and the reference; report whether the
    restored full state is the saved one, tensor by tensor."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this plan's shards: DCP fills them in place
    state = {"model": model_sd, "optim": optim_sd}
    with reading(directory):
        dcp.load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner())  # data, never code
        meta = read_meta(directory)
        saved = meta["digests"]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    digests = state_digests(model, optimizer)
    rank_local = meta.get("rank_local", {})  # each rank's digests of a buffer DCP saved one rank's copy of
    mismatched = sorted(k for k in saved.keys() | digests.keys()
                        if (digests.get(k) not in rank_local[k] if k in rank_local else saved.get(k) != digests.get(k)))
    device = next(reference.parameters()).device
    with reading(directory):
        ref = torch.load(directory / REFERENCE, map_location=device, weights_only=True)
    reference.load_state_dict(ref["model"])
    ref_optimizer.load_state_dict(ref["optim"])
    return {"step": meta["step"], "world": meta["world"], "policy": meta["policy"], "tensors": len(digests),
            "mismatched": mismatched, "rank_local": sorted(rank_local)}
