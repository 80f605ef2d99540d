"""The output layer and the loss run in chunks of the sequence, each with its own backward, as torchtitan's
``ChunkedLossWrapper`` runs them (``torchtitan/components/loss.py``; every config-registry job of 2026 uses it).

The wrapper takes the model's hidden states before the output layer, detached, and splits them along the tokens;
for each chunk it runs the output layer, the loss and their backward, writing the chunk's gradient into an fp32
buffer of the whole hidden states (its ``GradAccumulator``), then runs the model's backward from that buffer once.
FSDP2 keeps the output layer unsharded through the chunks (``set_reshard_after_forward(False)``) and reduce-scatters
its gradient once, at the last chunk (``set_requires_gradient_sync(False, recurse=False)`` before), so the
unsharded gradient accumulates in the reduce dtype (``FSDPParam.to_accumulated_grad_if_needed``: fp32 under
torchtitan's bf16 mixed precision) through the chunks.

A whole-sequence trace already runs these in the wrapper's order: the output layer's forward, the loss, its
backward, the output layer's backward, then the model's backward. What changes is what is alive while they run.
``with_chunked_loss`` keeps the events and rewrites their bytes: what the output layer and the loss make per token
(the logits in each dtype, their gradients: everything the loss region holds, the output layer's temporaries and
the gradients its backward reads and makes) is one chunk's share, and beside it, through the chunks, the wrapper's
fp32 buffer of the hidden states' gradient. FSDP2's part (the layer's group kept gathered, its gradient accumulated
in the reduce dtype and reduced at the last chunk, the root's final callback after each chunk where the layer's
state registered a pre-backward hook) is the plan's: ``fsdp2/replay.py`` and ``sim/memory.py`` take it from
``Trace.loss_chunks``. After the chunks the buffer is cast to the hidden states' dtype, the gradient the model's
backward reads as the whole step's did. FLOPs and bytes moved are the same summed over the chunks; each of the
output layer's matmuls runs on a chunk's tokens (``Event.kernel``: its smallest dim at most that).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_count
from fsdp_planner.trace.events import Event, EventKind, OpClass
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT


@dataclasses.dataclass(frozen=True)
class OutputLayer:
    """Where the output layer's last call runs in the step: its forward (FWD_PRE to FWD_POST) and backward
    (BWD_PRE to BWD_POST) positions, the loss's first op, the numel of its input (the hidden states) and the params
    it reads (indices into ``Trace.params``, a tied embedding's weight among them)."""

    module: str
    forward: range
    backward: range
    loss_start: int
    hidden_numel: int
    params: tuple[int, ...]
    weight_grad: int  # the position of its backward's matmul making its weight's grad (reading no param), or -1


def output_layer(trace: Trace) -> OutputLayer | None:
    """The module whose op last read params before the loss began (a language model's ``lm_head``, tied or not),
    or None where the trace has no loss region (a model computing its loss in its forward) or none reads params.
    Found once per trace (the replay and the TP view ask it of every plan)."""
    if "output_layer" not in trace.index.memo:
        trace.index.memo["output_layer"] = _output_layer(trace)
    return trace.index.memo["output_layer"]


def _output_layer(trace: Trace) -> OutputLayer | None:
    events = trace.events
    region = trace.index.loss_region
    start = next((i for i, (e, inside) in enumerate(zip(events, region, strict=True))
                  if inside and not e.backward), None)
    if start is None:
        return None
    last = next((i for i in range(start - 1, -1, -1) if events[i].kind is EventKind.OP and events[i].params
                 and not events[i].backward), None)
    if last is None:
        return None
    module = events[last].module
    pre = next(i for i in range(last, -1, -1) if events[i].kind is EventKind.FWD_PRE and events[i].module == module)
    call = events[pre].call
    post = next(i for i in range(last, len(events))
                if events[i].kind is EventKind.FWD_POST and events[i].module == module)
    bwd = [i for i in range(start, len(events)) if events[i].kind in (EventKind.BWD_PRE, EventKind.BWD_POST)
           and events[i].module == module and events[i].call == call]
    if len(bwd) < 2:
        return None
    itemsize = trace.traced_itemsize
    params = tuple(sorted({p for i in range(pre, post) for p in events[i].params}))
    weight_grad = max((i for i in range(bwd[0], bwd[-1]) if events[i].kind is EventKind.OP and events[i].kernel > 0
                       and not events[i].params and events[i].module == module), default=-1)
    return OutputLayer(module, range(pre, post + 1), range(bwd[0], bwd[-1] + 1), start,
                       events[pre].kept_inputs // itemsize, params, weight_grad)


def unchunkable(trace: Trace, head: OutputLayer) -> str | None:
    """Why the step cannot run its loss in chunks as ``ChunkedLossWrapper`` does, or None: the wrapper runs the
    output layer alone on the model's hidden states, so the model must return the layer's output as it is (no op
    after it: a soft-cap or a scale would be skipped) and call the layer once (not per prediction depth)."""
    events = trace.events
    if head.module == ROOT or not head.hidden_numel:
        return ("the model computes its logits in its own forward, not in an output layer of its own (a module "
                "whose forward the wrapper can leave out and run alone on the hidden states)")
    calls = sum(1 for e in events if e.kind is EventKind.FWD_PRE and e.module == head.module)
    if calls > 1:
        return f"the model calls its output layer '{head.module}' {calls} times a step"
    ops = [e for e in events[head.forward.stop:head.loss_start] if e.kind is EventKind.OP]
    if any(e.op_class is OpClass.LOG_SOFTMAX for e in ops) and ops[-1].out_nbytes <= 8:  # (to a scalar: a loss)
        return (f"the model computes its loss in its own forward, after '{head.module}' (given labels, as a Hugging "
                "Face model computes its own), where the wrapper runs the layer and the loss itself on the hidden "
                "states")
    if ops:
        return (f"the model transforms the output of '{head.module}' before returning it ({fmt_count(len(ops), 'op')} "
                "in its forward after it: a soft-cap, a scale, a log-softmax or another output layer), which the "
                f"wrapper, running '{head.module}' alone on the hidden states, would skip")
    return None


def logits_of(output: Any) -> torch.Tensor | None:
    """The tensor a language model returns its logits in (the output, or its ``.logits``); None for another."""
    found = output.logits if isinstance(getattr(output, "logits", None), torch.Tensor) else output
    return found if isinstance(found, torch.Tensor) and found.dim() >= 2 else None


def cross_entropy(output: Any) -> torch.Tensor:
    """torchtitan's CrossEntropyLoss over every token of the model's logits (upcast to fp32, summed over the
    tokens and divided by their count; the labels' values do not change what a step holds): the loss a chunked
    step runs, whole here as the trace runs it before ``trace/chunked_loss.py`` takes a chunk's share."""
    logits = logits_of(output)
    if logits is None:
        raise PlannerError("--loss-chunks: the model's output has no logits (a tensor of tokens x vocabulary, or "
                           "an output with .logits) for the cross-entropy torchtitan's ChunkedLossWrapper runs")
    flat = logits.reshape(-1, logits.shape[-1])
    labels = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return F.cross_entropy(flat.float(), labels, reduction="sum") / flat.shape[0]


def with_chunked_loss(trace: Trace, chunks: int) -> Trace:
    """The step with its output layer and loss run in ``chunks`` chunks (module docstring); unchanged where
    ``output_layer`` finds none. The output layer's gradient FSDP2 accumulates through the chunks is the plan's
    (where a group of the layer's own call holds it: ``sim/memory.py``)."""
    head = output_layer(trace)
    if head is None or chunks < 2:
        return trace
    tokens = output_tokens(trace, head)
    region = trace.index.loss_region
    events = list(trace.events)
    for i in range(head.forward.start, head.backward.stop):
        e = events[i]
        if e.kind is not EventKind.OP:
            continue
        if region[i]:
            events[i] = e._replace(live=_share(e.live, chunks))
        elif e.backward:
            events[i] = e._replace(grad_live=_share(e.grad_live, chunks), kernel=_kernel(e, tokens, chunks))
        else:  # the output layer's forward: its temporaries
            events[i] = e._replace(live=_share(e.live, chunks), kernel=_kernel(e, tokens, chunks))
    _tied_sums(trace, head, events)
    blocks = tuple((made, freed, _share(n, chunks)) for made, freed, n in trace.loss_blocks)
    # the GradAccumulator's fp32 buffer of the hidden states' gradient: whole on every TP rank (the hidden states
    # are replicated there), so not in the fields a TP view scales (``sim/memory.py`` holds it through the chunks)
    return dataclasses.replace(trace, events=tuple(events), loss_blocks=blocks, loss_chunks=chunks,
                               loss_buffer=head.hidden_numel * 4)


def _tied_sums(trace: Trace, head: OutputLayer, events: list[Event]) -> None:
    """A tied weight's contributions: whole, autograd sums the output layer's and the embedding's in the
    embedding's backward (three weight-sized tensors there, one of them the grad the FSDP2 replay counts); in
    chunks, the layer's is the param's grad already, which the embedding's is added into: one weight-sized tensor
    less at each of the embedding's backward ops that held two beside the grad."""
    for p in head.params:
        info = trace.params[p]
        others = [m for m in info.owners if m != head.module]
        nbytes = info.numel * trace.traced_itemsize
        for module in others:
            span = [i for i in range(head.backward.stop, len(events)) if events[i].module == module
                    and events[i].kind in (EventKind.BWD_PRE, EventKind.BWD_POST)]
            for i in range(span[0], span[-1]) if len(span) >= 2 else ():
                e = events[i]
                if e.kind is EventKind.OP and e.backward and e.grad_live >= 2 * nbytes:
                    events[i] = e._replace(grad_live=e.grad_live - nbytes)


def _share(nbytes: int, chunks: int) -> int:
    """One chunk's share of bytes made per token (rounded up: a scalar stays one)."""
    return -(-nbytes // chunks)


def output_tokens(trace: Trace, head: OutputLayer) -> int:
    """The tokens the output layer runs on: its input's numel over its weight's last dim (0 where unknown)."""
    shapes = [p.shape for p in trace.params if head.module in p.owners and len(p.shape) == 2]
    return head.hidden_numel // shapes[0][1] if shapes and shapes[0][1] else 0


def _kernel(e: Event, tokens: int, chunks: int) -> int:
    """A matmul of the output layer on one chunk: its smallest dim at most the chunk's tokens."""
    return min(e.kernel, max(1, tokens // chunks)) if e.kernel > 0 and tokens else e.kernel
