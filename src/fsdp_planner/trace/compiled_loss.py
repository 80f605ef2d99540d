"""What a ``torch.compile``'d loss holds and moves, from AOTAutograd's partitioner and inductor's fusion.

torchtitan compiles its loss apart from the model (``compile.components``: ``["model", "loss"]`` by default since
its #1608 of August 2025; its DeepSeek-V3 jobs compile the loss alone). Eager, a language model's cross-entropy
makes the logits' fp32 copy and log-softmax's fp32 output in forward and their fp32 gradients in backward, beside
the bf16 logits: at a 100K+ vocabulary the step's peak. Compiled, inductor fuses the upcast, the log-sum-exp and
the gradient: the forward keeps the bf16 logits and per-row statistics for backward, and the backward writes the
bf16 gradient in one kernel. Measured on this CPU build with the profiler's memory events
(``tests/test_compiled_loss.py``): eager holds 6.0x the bf16 logits above its inputs, compiled 1.0x.

This module runs the real partitioner on the loss as the step called it (its inputs: the model's outputs, on fake
tensors; what the loss closes over, the labels, as it is) and walks each partitioned graph in order, counting alive
the tensors a kernel writes to memory: a library kernel's (``compiled.node_kind`` "extern") and a fused region's
that something outside it reads (another kernel, the graph's output); a tensor inside a fused region never exists.
The forward's inputs are alive throughout it (the caller holds them); the backward's are freed at their last use
(inductor's boxed calling convention). It is the floor ``compiled.py`` takes for the bytes: inductor may split a
region at a reduction and write what its halves share.

The step then has the compiled loss in place of the eager one (``with_compiled_loss``): the loss region's live
bytes (``step.LossRegion``) at its first forward op the forward's peak and after it what the forward keeps, at
its first backward op the backward's peak and after it the gradients it returns; its memory-bound ops' bytes scaled
to the fused kernels' (each op keeping its share, as ``sim/compute.fused_nbytes`` scales a compiled block's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch._C import DispatchKey
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fsdp_planner.trace.compiled import EXTERN, Kernels, dynamo_graphs, fused_bytes, node_kind, node_nbytes
from fsdp_planner.trace.events import KERNEL_OTHER, EventKind
from fsdp_planner.trace.records import CompiledLoss, Trace


@dataclasses.dataclass(frozen=True)
class TensorLeaf:
    """A tensor the model gave its loss, without its data."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def make(self) -> torch.Tensor:
        """A fresh tensor like it (in whatever mode is active: a fake one under FakeTensorMode, none on meta)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return t.requires_grad_(self.requires_grad)


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """The model's outputs as the step passed them to the loss: each tensor a ``TensorLeaf``, anything else as it
    was, and the tree they make."""

    leaves: tuple[Any, ...]
    spec: TreeSpec

    @classmethod
    def of(cls, output: Any) -> LossInputs:
        leaves, spec = tree_flatten(output)
        return cls(tuple(TensorLeaf(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)
                         if isinstance(t, torch.Tensor) else t for t in leaves), spec)

    def tensors(self) -> list[torch.Tensor]:
        return [x.make() for x in self.leaves if isinstance(x, TensorLeaf)]

    def call(self, loss_fn: Callable[[Any], torch.Tensor], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``loss_fn`` on the output tree rebuilt around ``tensors``."""
        given = iter(tensors)
        leaves = [next(given) if isinstance(x, TensorLeaf) else x for x in self.leaves]
        return loss_fn(tree_unflatten(leaves, self.spec))


def capturing(loss_fn: Callable[[Any], torch.Tensor], into: list[LossInputs]) -> Callable[[Any], torch.Tensor]:
    """``loss_fn`` that records what it is given (``LossInputs``, no reference to the tensors kept: the step's
    memory is traced through their lifetimes) into ``into``."""
    def loss(output: Any) -> torch.Tensor:
        into.append(LossInputs.of(output))
        return loss_fn(output)

    return loss


def compiled_loss(loss_fn: Callable[[Any], torch.Tensor], given: LossInputs) -> CompiledLoss:
    """``loss_fn`` compiled, on tensors without data shaped as ``given`` (module docstring). Raises ``ValueError``
    where the compiled loss has no gradient for an input that needs one (what the partitioner saves would then be
    nothing)."""
    inputs = given.tensors()
    with _composites_above_autograd():
        traced = dynamo_graphs(lambda *flat: given.call(loss_fn, flat), inputs, {})
    fw, bw = traced.graphs["fw"], traced.graphs.get("bw")
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    mine = [n for n, x in zip(placeholders, traced.inputs, strict=False) if any(x is t for t in inputs)]
    needs = any(t.requires_grad for t in inputs)
    if needs and (bw is None or not any(n is not None for n in tree_flatten(_output(bw).args)[0])):
        raise ValueError("the compiled loss has no gradient for the model's outputs")
    primals = _storages(mine)
    closed_over = [n for n in placeholders if n not in mine]
    # what the loss closes over (the step's labels), and its copies onto the outputs' device: the Python API
    # traces a real model's loss on meta, moving what it reads there, where the GPU job finds it in place
    moved = [n for n in fw.graph.nodes
             if n.target is torch.ops.prims.device_put.default and _viewed(n.args[0]) in closed_over]
    others = _storages([*closed_over, *moved])
    kept: dict[StorageWeakRef, int] = {}
    saved: dict[StorageWeakRef, int] = {}
    if bw is not None:
        for ref, nbytes in _storages(n for n in bw.graph.nodes
                                     if n.op == "placeholder" and not n.name.startswith("tangents")).items():
            if ref in primals:
                kept[ref] = nbytes
            elif ref not in others:
                saved[ref] = nbytes
    return CompiledLoss(inputs=sum(primals.values()), kept_inputs=sum(kept.values()),
                        forward_peak=_peak(fw, held=set(placeholders), outside=set(others)),
                        saved=sum(saved.values()),
                        backward_peak=_peak(bw, held=set(), donated=_donated(bw, primals | others), outside=set(others))
                        if bw is not None else 0,
                        grads=_grads(bw, [placeholders.index(n) for n in mine]) if bw is not None else 0,
                        fused_nbytes=(fused_bytes(fw, loss_kind)[0],
                                      fused_bytes(bw, loss_kind)[0] if bw is not None else 0))


@functools.cache
def _composite_meta_kernels() -> tuple[torch._ops.OpOverload, ...]:
    """aten's ops that have a C++ CompositeImplicitAutograd decomposition and a Python meta kernel too."""
    import torch._decomp  # (each registers Python meta kernels)
    import torch._meta_registrations
    import torch._refs

    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            if DispatchKey.Meta in getattr(op, "py_kernels", {}) and \
                    torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
                found.append(op)
    return tuple(found)


@contextlib.contextmanager
def _composites_above_autograd() -> Iterator[None]:
    """Those ops' Python meta kernels set aside while the loss is traced: on meta tensors under AOTAutograd's
    Python dispatcher such a kernel runs in place of the decomposition, below autograd, and a cross-entropy
    (``aten.nll_loss``'s, torch/_refs/nn/functional) traces with no backward at all on torch 2.13; a real device
    decomposes above autograd, as these ops then do."""
    ops = _composite_meta_kernels()
    kernels = [op.py_kernels.pop(DispatchKey.Meta) for op in ops]
    for op in ops:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernel in zip(ops, kernels, strict=True):
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


def _donated(bw: torch.fx.GraphModule, callers: dict[StorageWeakRef, int]) -> set[torch.fx.Node]:
    """The backward's saved activations AOTAutograd donates to it: its inputs but the tangents and those of the
    caller's storages (the forward's inputs, what the loss closes over)."""
    return {n for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")
            and not set(_storages([n])) & set(callers)}


def _grads(bw: torch.fx.GraphModule, positions: list[int]) -> int:
    """Bytes of the gradients the backward returns for the forward's inputs at ``positions`` (the model's outputs;
    a parameter the loss reads gets its gradient where FSDP2 counts it)."""
    returned = tree_flatten(_output(bw).args)[0]
    return sum(node_nbytes(returned[i]) for i in positions
               if i < len(returned) and isinstance(returned[i], torch.fx.Node))


def _storages(nodes: Any) -> dict[StorageWeakRef, int]:
    """Each distinct storage of these nodes' tensors and its bytes."""
    out: dict[StorageWeakRef, int] = {}
    for n in nodes:
        for v in tree_flatten(n.meta.get("val"))[0]:
            if isinstance(v, torch.Tensor):
                out.setdefault(StorageWeakRef(v.untyped_storage()), v.untyped_storage().nbytes())
    return out


def _viewed(n: torch.fx.Node) -> torch.fx.Node:
    """The node whose tensor ``n`` views (an alias of an alias of a placeholder: the placeholder), or ``n``."""
    while node_kind(n) == "view" and n.args and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


def _output(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "output")


# ops inductor runs as kernels of their own, writing whole buffers, besides the library kernels: a scatter (the
# backward of a gather: a per-token log-probability's, in place into a zeros buffer), index_put, topk and sort
# (log_softmax + gather measured 3.0x the bf16 logits on this CPU, counted 1.0x as fused: a review's finding)
LOSS_EXTERN = (*EXTERN, "scatter", "index_put", "topk", "sort")


def loss_kind(n: torch.fx.Node) -> str:
    """``node_kind`` with ``LOSS_EXTERN``, with two exceptions: a move onto another device is a view (in the GPU job
    the labels are on the logits' device already), and a scalar scattered into a constant tensor (a cross-entropy's
    backward: nll_loss's one-hot) is fused, as inductor's joint-graph pass makes it a pointwise ``where``
    (``config.optimize_scatter_upon_const_tensor``, fx_passes/joint_graph.py ``scatter_upon_const_tensor``)."""
    if n.target is torch.ops.prims.device_put.default:  # the API's move of a real label onto meta (compiled_loss)
        return "view"
    kind = node_kind(n, LOSS_EXTERN)
    if kind == "extern" and n.target is torch.ops.aten.scatter.value and isinstance(n.args[0], torch.fx.Node) \
            and n.args[0].target is torch.ops.aten.full.default:
        return "fused"
    return kind


def _peak(gm: torch.fx.GraphModule, held: set[torch.fx.Node], donated: set[torch.fx.Node] = frozenset(),
          outside: set[StorageWeakRef] = frozenset()) -> int:
    """The most bytes alive at once while ``gm`` runs: its inputs, ``held`` to the end and the others until the
    last kernel that reads them has run, and the tensors its kernels write (``compiled.Kernels``, with
    ``LOSS_EXTERN``: a kernel's of its own, a fused region's read outside it, the graph's outputs), each from its kernel
    until the last kernel that reads it has run, its outputs to the end (what a kernel reads and writes are alive
    together); but for inductor's in-place reuse (``config.inplace_buffers``): a tensor a kernel writes takes the
    buffer of one it reads for the last time there, of the same dtype and bytes, where that buffer is inductor's
    own (made in the graph, or ``donated``: the backward's saved activations, which AOTAutograd donates to it)
    rather than its caller's. Inputs of the ``outside`` storages (what the loss closes over: labels, a weight) are
    counted where they live, not here."""
    k = Kernels(gm, loss_kind)
    outputs = {k.root(n) for n in k.outputs}
    written = {n for n in k.nodes if k.kind[n] == "extern" or (k.kind[n] != "placeholder" and n in outputs)
               or (k.kind[n] == "fused" and k.leaves_region(n))}
    inputs = {n for n in k.nodes if k.kind[n] == "placeholder" and not set(_storages([n])) & outside}
    made: dict[int, list[torch.fx.Node]] = {}
    freed: dict[int, list[torch.fx.Node]] = {}
    for n in written | inputs:
        made.setdefault(0 if n in inputs else k.at(n), []).append(n)
        if n not in outputs and n not in held:
            freed.setdefault(k.last_read(n), []).append(n)
    own = (written - outputs - held) | (set(donated) - held)
    live = peak = 0
    for i in range(len(k.nodes)):
        dying = [n for n in freed.get(i, ()) if n in own and i > 0]
        reused: set[torch.fx.Node] = set()
        for n in made.get(i, ()):
            buffer = next((d for d in dying if d not in reused and d is not n and _alike(d, n)), None)
            if buffer is None:
                live += node_nbytes(n)
            else:
                reused.add(buffer)
        peak = max(peak, live)
        live -= sum(node_nbytes(n) for n in freed.get(i, ()) if n not in reused)
    return peak


def _alike(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether ``b`` fits ``a``'s buffer in place: one tensor each, of one dtype and as many bytes."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype \
        and node_nbytes(a) == node_nbytes(b)


def with_compiled_loss(trace: Trace, loss: CompiledLoss) -> Trace:
    """The step with ``loss`` compiled in place of its eager loss (module docstring); unchanged where the trace
    has no loss region (a model whose output is its loss)."""
    region = trace.index.loss_region
    events = list(trace.events)
    forward = [i for i, (e, inside) in enumerate(zip(events, region, strict=True)) if inside and not e.backward]
    backward = [i for i, (e, inside) in enumerate(zip(events, region, strict=True)) if inside and e.backward]
    if not forward:
        return trace
    after_forward = loss.kept_inputs + loss.saved
    for positions, peak, after, moved in ((forward, loss.forward_peak, after_forward, loss.fused_nbytes[0]),
                                          (backward, loss.backward_peak, loss.grads, loss.fused_nbytes[1])):
        eager = sum(events[i].nbytes for i in positions if events[i].kernel == KERNEL_OTHER)
        for k, i in enumerate(positions):
            e = events[i]
            nbytes = round(e.nbytes * moved / eager) if eager and e.kernel == KERNEL_OTHER else e.nbytes
            events[i] = e._replace(live=peak if k == 0 else after, nbytes=nbytes)
    first_bwd = backward[0] if backward else len(events)
    end = next((i for i in range(first_bwd, len(events)) if events[i].kind is EventKind.BWD_PRE), -1)
    blocks = [(forward[0], first_bwd + 1 if loss.kept_inputs else forward[0] + 1, loss.inputs),
              (forward[0], first_bwd + 1, loss.saved), (first_bwd, end, loss.grads)]
    return dataclasses.replace(trace, events=tuple(events), compiled_loss=loss,
                               loss_blocks=tuple(b for b in blocks if b[2]))
