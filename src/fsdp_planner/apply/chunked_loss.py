"""A step whose output layer and loss run in chunks of the tokens, as torchtitan's ``ChunkedLossWrapper`` runs
them (``torchtitan/components/loss.py``), on an FSDP2-sharded model of any architecture: what the fake ranks run
for a plan with ``--loss-chunks`` (``runtime/fake_world.py``), so its memory and collectives are FSDP2's own.

The model's forward runs without its output layer (torchtitan's ``_skip_lm_head``: here the layer is taken out of
its parent for the forward's duration, after FSDP2's root pre-forward has seen the whole model); the hidden
states, flattened to tokens x width and detached, are split into equal chunks; each chunk runs the output layer,
a cross-entropy summed over its tokens (torchtitan's ``CrossEntropyLoss``) and its backward, its gradient written
into an fp32 buffer; the model's backward then runs once from that buffer, cast to the hidden states' dtype, when
the step's loss it returns is backwarded.
FSDP2 keeps the output layer unsharded through the chunks and syncs its gradient at the last one only, as the
wrapper asks it to.

Every function here needs torch alone: the Python, Accelerate and Lightning exports of a plan with chunks write them
into the exported file as they are (``CHUNKED_LOSS_FUNCTIONS``), for a training loop to run the step the plan's
memory is of.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from fsdp_planner.trace.chunked_loss import logits_of


def chunked_loss_step(model: nn.Module, head: str, chunks: int, args: tuple, kwargs: dict[str, Any],
                      labels: torch.Tensor | None = None, loss_parallel: bool = False) -> torch.Tensor:
    """Forward, loss and the chunks' backward of one micro-batch with ``model``'s output layer ``head`` (its module
    name) and a cross-entropy run in ``chunks`` equal chunks of the tokens, as torchtitan's ChunkedLossWrapper runs:
    ``model(*args, **kwargs)`` without the layer, each chunk through the layer, the loss (summed over the chunk's
    tokens, divided by the labelled tokens of all of them) and its backward. Returns the step's loss, whose
    ``backward()`` runs the model's backward from the chunks' gradient and gives the output layer its gradient (call
    it as you would the whole loss's, or let a framework: Lightning's automatic optimization, which zeroes the
    grads between the step and its backward). ``labels``: the target class of each token, already
    aligned with the model's outputs (a causal LM's shifted), -100 where ignored, in any shape of that many (None:
    zeros, what the fake ranks train). ``loss_parallel``: the layer's logits are sharded over the vocabulary (a TP
    plan's loss parallel): each chunk's loss runs under ``loss_parallel()``. The model must return the layer's
    output as it is (or in ``.logits``)."""
    if not head:
        raise ValueError("name the model's output layer (its module name) for its loss to run in chunks")
    layer = model.get_submodule(head)
    with _without(model, head):
        output = model(*args, **kwargs)
    hidden = logits_of(output)
    if hidden is None:
        raise ValueError(f"without '{head}' the model returns no hidden states (a tensor of tokens x width) to run "
                         "it on in chunks")
    del output  # (what else the model returned; and a sequence shard, torchtitan's norm's own temporary)
    hidden = _replicated(hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])
    tokens = flat.shape[0]
    if tokens % chunks:
        raise ValueError(f"{tokens:,} tokens do not split into {chunks} equal chunks")
    size = tokens // chunks
    if labels is None:
        labels, labelled = torch.zeros(tokens, dtype=torch.long, device=flat.device), tokens
    else:
        labels = labels.reshape(-1)
        if labels.numel() != tokens:
            raise ValueError(f"{labels.numel():,} labels for {tokens:,} tokens")
        labelled = max(1, int((labels != -100).sum()))  # (F.cross_entropy's mean: over the tokens it counts)
    local = _local(flat)
    buffer = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
    total = torch.zeros((), dtype=torch.float32, device=local.device)
    placements = None

    from torch.distributed.tensor.parallel import loss_parallel as vocab_parallel

    with _unsharded_through(layer), vocab_parallel() if loss_parallel else contextlib.nullcontext():
        for i, piece in enumerate(flat.detach().split(size)):
            if i == chunks - 1 and isinstance(layer, FSDPModule):  # one reduce-scatter, at the last chunk
                layer.set_requires_gradient_sync(True, recurse=False)
            piece.requires_grad_(True)
            loss = F.cross_entropy(layer(piece).float(), labels[i * size:(i + 1) * size], reduction="sum") / labelled
            loss.backward()
            placements = getattr(piece.grad, "placements", None)
            buffer[i * size:(i + 1) * size] = _local(piece.grad)
            total = total + _local(loss.detach())
            piece.grad = None  # (the split's tuple holds every chunk through the loop: not their grads)
            del piece, loss
    grad = _like(flat, buffer.to(local.dtype), placements)
    # nothing but the autograd graph holds the hidden states and their gradient through the model's backward
    # (torchtitan's trainer deletes its pred before loss.backward(); the wrapper's locals are gone by then)
    return _ModelBackward.apply(flat, grad, total, _held_grads(layer))


def _held_grads(layer: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The layer's grads taken off its params, for the step's loss to give back in its backward: a framework
    zeroing the grads between the step and its backward (Lightning's automatic optimization) dropped them, and the
    layer never trained."""
    held = [(p, p.grad) for p in layer.parameters() if p.grad is not None]
    for p, _ in held:
        p.grad = None
    return held


class _ModelBackward(torch.autograd.Function):
    """The step's loss as the hidden states' function whose backward hands them the chunks' gradient: the model's
    backward runs from ``loss.backward()`` with that gradient held by this node alone (freed once the hidden
    states' own backward has it), as torchtitan's wrapper bridges its chunks to the decoder's backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor,
                held: list[tuple[nn.Parameter, torch.Tensor]]) -> torch.Tensor:
        ctx.save_for_backward(grad)
        ctx.held = held  # the output layer's grads, given back to its params as the backward starts
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        for p, g in ctx.held:
            p.grad = g if p.grad is None else p.grad + g
        ctx.held = []
        return grad, None, None, None


def _replicated(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden states whole on every TP rank: a sequence-parallel norm's output (a DTensor sharded on the
    sequence) all-gathered once before the chunks, as torchtitan's norm before its output layer emits them
    (``Replicate()`` on the TP dim); its gradient, partial over TP, is reduce-scattered once by the backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(hidden, DTensor) and any(isinstance(p, Shard) for p in hidden.placements):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
    return hidden


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (a chunk's grad, its loss), a plain tensor itself: the buffer holds this rank's."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(flat: torch.Tensor, grad: torch.Tensor, placements: Any) -> torch.Tensor:
    """The buffer as the gradient of ``flat``: a DTensor on its mesh with the chunks' grads' placements (partial
    under loss parallel) where the hidden states are one, as torchtitan's ``GradAccumulator`` returns it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(flat, DTensor):
        return grad
    return DTensor.from_local(grad, flat.device_mesh, placements or flat.placements, run_check=False)


@contextlib.contextmanager
def _without(model: nn.Module, head: str) -> Iterator[None]:
    """The model's forward with ``head`` replaced by an identity: swapped in by a forward pre-hook that runs after
    FSDP2's (which initialises the root over the whole model on the first step) and back by a forward hook."""
    parent_name, _, name = head.rpartition(".")
    parent = model.get_submodule(parent_name)
    layer = getattr(parent, name)

    def swap(*_: Any) -> None:
        setattr(parent, name, nn.Identity())

    def restore(*_: Any) -> None:
        setattr(parent, name, layer)

    handles = (model.register_forward_pre_hook(swap), model.register_forward_hook(restore))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        setattr(parent, name, layer)


@contextlib.contextmanager
def _unsharded_through(layer: nn.Module) -> Iterator[None]:
    """The output layer gathered once for every chunk, its gradient synced at the last only (the caller turns it
    on there), resharded after: ``ChunkedLossWrapper``'s calls on an FSDP2 module; nothing for another."""
    if not isinstance(layer, FSDPModule):
        yield
        return
    layer.set_reshard_after_forward(False)
    layer.set_reshard_after_backward(False)
    layer.set_requires_gradient_sync(False, recurse=False)
    layer.unshard()
    try:
        yield
    finally:
        layer.set_reshard_after_forward(True)
        layer.set_reshard_after_backward(True)
        layer.set_requires_gradient_sync(True, recurse=False)
        layer.reshard()


# what an export of a plan with chunks writes into its file (``apply/export.py``), in this order
CHUNKED_LOSS_FUNCTIONS = (logits_of, chunked_loss_step, _held_grads, _ModelBackward, _replicated, _local, _like,
                          _without, _unsharded_through)
