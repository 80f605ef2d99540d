"""Every aten op of the step, seen by a dispatch mode: the params it reads, its FLOPs and bytes (and, when
measuring, its time).

Param reads are caught on op inputs by identity and by storage, so views such as ``weight.t()`` saved for backward
count too; module hooks alone would miss tied weights and params read outside their own module.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fsdp_planner.attention import in_mask
from fsdp_planner.choices import TITAN_RECOMPUTE_FQNS
from fsdp_planner.routing import StandIn, in_grouped_bmm
from fsdp_planner.trace.bookkeeping import bookkeeping
from fsdp_planner.trace.events import (
    ATTENTION_KERNELS,
    KERNEL_ATTENTION,
    KERNEL_CAUSAL_ATTENTION,
    KERNEL_LINEAR_ATTENTION,
    KERNEL_MAMBA_SCAN,
    KERNEL_OTHER,
    KERNEL_SELECTIVE_SCAN,
    OpClass,
)
from fsdp_planner.trace.failures import check_operand_dtypes, mark, op_name
from fsdp_planner.trace.leaves import flat_leaves
from fsdp_planner.trace.step import NullRecorder, Slot, StepRecorder
from fsdp_planner.workspaces import workspace_bytes

# Ops that move no data: their inputs and outputs are not counted as traffic.
_NO_TRAFFIC_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
}

_aten = torch.ops.aten
# The ops each ``OpClass`` stands for: torchtitan's save lists (``fsdp2/selective.py``) name them. The fused SDPA
# kernels are what a GPU runs and what the trace sees (``attention.py`` runs them on planned tensors);
# ``_scaled_dot_product_flash_attention_for_cpu`` is the same flash kernel on a CPU, where the runtime checks run:
# classed with it so that a CPU run keeps what the GPU run keeps (torchtitan's list does not name it).
_OP_CLASSES: dict[object, OpClass] = {
    _aten.mm.default: OpClass.MM,
    _aten._scaled_dot_product_flash_attention.default: OpClass.SDPA,
    _aten._scaled_dot_product_efficient_attention.default: OpClass.SDPA,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: OpClass.SDPA,
    _aten._scaled_dot_product_cudnn_attention.default: OpClass.SDPA_MORE,
    _aten._scaled_dot_product_attention_math.default: OpClass.SDPA_MORE,
    _aten._scaled_dot_product_fused_attention_overrideable.default: OpClass.SDPA_MORE,
    torch.ops._c10d_functional.reduce_scatter_tensor.default: OpClass.REDUCE_SCATTER,
    _aten.max.default: OpClass.MAX,
    _aten.addmm.default: OpClass.COMPUTE_MORE,
    _aten.bmm.default: OpClass.COMPUTE_MORE,
    _aten._scaled_mm.default: OpClass.COMPUTE_MORE,
    _aten.convolution.default: OpClass.COMPUTE_MORE,
    _aten.upsample_bilinear2d.default: OpClass.COMPUTE_MORE,
    _aten._flash_attention_forward.default: OpClass.COMPUTE_MORE,  # SDPA's kernels, where a model calls them itself
    _aten._efficient_attention_forward.default: OpClass.COMPUTE_MORE,
    _aten.topk.default: OpClass.TOPK,
    torch.ops._c10d_functional.all_to_all_single.default: OpClass.ALL_TO_ALL,
    _aten._log_softmax.default: OpClass.LOG_SOFTMAX,
    _aten.nll_loss_backward.default: OpClass.NLL_LOSS_BACKWARD,
    _aten._log_softmax_backward_data.default: OpClass.LOG_SOFTMAX_BACKWARD,
}


def op_class(func: object) -> OpClass:
    """The class a selective checkpointing policy sees ``func`` (an aten OpOverload) as; a stand-in's ``bmm`` for
    a ``_grouped_mm`` (``routing.grouped_bmm``) as that."""
    if in_mask():
        return OpClass.ATTENTION_MASK
    cls = _OP_CLASSES.get(func, OpClass.OTHER)
    return OpClass.OTHER if cls is OpClass.COMPUTE_MORE and in_grouped_bmm() else cls


# The router gates an MoE layer scores its experts with, by module name: torchtitan's (its SelectiveAC's default
# force_recompute_mm_shapes_by_fqns), and transformers' for the MoE models torchtitan's jobs are simulated on
# (Qwen3-MoE's and DeepSeek-V3's ``mlp.gate``; not ``mlp.gate_proj``: a module's name ends with one)
ROUTER_GATES = (*TITAN_RECOMPUTE_FQNS, "mlp.gate")


def router_shapes(weights: Iterable[tuple[str, tuple[int, ...]]]) -> frozenset[tuple[int, int]]:
    """The right-hand shapes (in, out) of an mm by a router gate's weight, of ``weights`` (param name, shape as a
    Linear holds it: out x in): what torchtitan's policy recomputes by shape, whichever tensor it is (a cast copy)."""
    out = set()
    for name, shape in weights:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and any(module == g or module.endswith("." + g) for g in ROUTER_GATES):
            out.add((shape[1], shape[0]))
    return frozenset(out)


def forward_class(func: object, args: tuple, router: frozenset[tuple[int, int]]) -> OpClass:
    """``op_class``, an mm by a router gate's weight (``router``: ``router_shapes``) told apart."""
    cls = op_class(func)
    if cls is OpClass.MM and router and len(args) > 1 and isinstance(args[1], torch.Tensor) and \
            tuple(args[1].shape) in router:
        return OpClass.ROUTER_MM
    return cls


def op_names(classes: frozenset[OpClass]) -> list[str]:
    """The aten ops (``namespace.name.overload``) of ``classes``, sorted: what exported code saves by name."""
    return sorted(str(op) for op, cls in _OP_CLASSES.items() if cls in classes)


# Matmuls, by where their two matrices sit in the arguments (``mm(a, b)``, ``addmm(bias, a, b)``; the batched
# forms multiply the last two dims): what ``kernel_of`` reads M, N and K from.
_MATMULS: dict[object, int] = {
    _aten.mm.default: 0, _aten.bmm.default: 0, _aten.addmm.default: 1, _aten.baddbmm.default: 1,
}
_ATTENTION_WORDS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_ATTENTION = -1  # _kernel_kinds' mark of an attention op
_LINEAR_ATTENTION = -2  # ... of linear attention's (``linear_attention.py``: its forward and backward ops)
_MAMBA_SCAN = -3  # ... of Mamba-2's conv and scan (``mamba_scan.py``)
_SELECTIVE_SCAN = -4  # ... of Mamba-1's selective scan (``selective_scan.py``)
_GROUPED = -5  # ... of a ``_grouped_mm`` (``grouped_mm_dims``)
_kernel_kinds: dict[object, int | None] = {}  # func -> its first matrix's argument index, _ATTENTION, or None


def _kind(func: Any) -> int | None:
    """How ``kernel_of`` reads ``func``, found once per op overload (tracing speed: benchmarks/trace_speed.md)."""
    try:
        return _kernel_kinds[func]
    except KeyError:
        name = str(getattr(func, "__name__", func))
        kind = _GROUPED if func is _GROUPED_MM else \
            _MATMULS.get(func, _ATTENTION if any(w in name for w in _ATTENTION_WORDS) else
                            _LINEAR_ATTENTION if "chunk_gated_delta_rule" in name or "chunk_kda" in name else
                            _MAMBA_SCAN if "mamba_conv_scan" in name else
                            _SELECTIVE_SCAN if "selective_scan" in name else None)
        _kernel_kinds[func] = kind
        return kind


def kernel_of(func: Any, args: tuple, kwargs: dict) -> int:
    """The ``Event.kernel`` of an op: a matmul's smallest dim, ``KERNEL_ATTENTION`` for a fused attention kernel
    (forward or backward; ``KERNEL_CAUSAL_ATTENTION`` when causal), ``KERNEL_LINEAR_ATTENTION`` for Gated DeltaNet's,
    ``KERNEL_MAMBA_SCAN`` for Mamba-2's scan, ``KERNEL_SELECTIVE_SCAN`` for Mamba-1's, else ``KERNEL_OTHER``."""
    kind = _kind(func)
    if kind is None:
        return KERNEL_OTHER
    if kind == _LINEAR_ATTENTION:
        return KERNEL_LINEAR_ATTENTION
    if kind == _MAMBA_SCAN:
        return KERNEL_MAMBA_SCAN
    if kind == _SELECTIVE_SCAN:
        return KERNEL_SELECTIVE_SCAN
    if kind == _ATTENTION:
        return KERNEL_CAUSAL_ATTENTION if _is_causal(func, args, kwargs) else KERNEL_ATTENTION
    if kind == _GROUPED:
        return _grouped_kernel(args, kwargs)
    a, b = args[kind], args[kind + 1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2 or b.dim() < 2:
        return KERNEL_OTHER
    try:
        return max(1, min(int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])))
    except Exception:  # a symbolic size with no value (an unbacked SymInt): shape unknown
        return KERNEL_OTHER


def _grouped_kernel(args: tuple, kwargs: dict) -> int:
    """A ``_grouped_mm``'s smallest dim of one group's matmul (the groups split one dim evenly, as balanced routing
    gives each expert its share)."""
    a, b = args[0], args[1]
    dims = grouped_mm_dims(args, kwargs)
    if dims is None:
        return KERNEL_OTHER
    groups, rows, inner, cols = dims
    if b.dim() == 3:  # (the experts' weights: each expert its share of the rows)
        rows //= groups
    elif a.dim() == 3:
        cols //= groups
    else:
        inner //= groups
    return max(1, min(rows, inner, cols))


_causal_at: dict[object, int | None] = {}  # func -> the position of its ``is_causal`` argument, or None


def _is_causal(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a fused attention op (forward or backward) is causal, by its schema's ``is_causal`` argument."""
    try:
        at = _causal_at[func]
    except KeyError:
        names = [a.name for a in getattr(getattr(func, "_schema", None), "arguments", ())]
        at = _causal_at[func] = names.index("is_causal") if "is_causal" in names else None
    if at is None:
        return False
    return (args[at] if at < len(args) else kwargs.get("is_causal", False)) is True


def outputs_nbytes(flat_out: list) -> int:
    """Bytes of the distinct storages of an op's tensor outputs: what keeping its outputs holds."""
    seen: dict[StorageWeakRef, int] = {}
    for t in flat_out:
        if isinstance(t, torch.Tensor):
            seen[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(seen.values())


class OpRecorder(TorchDispatchMode):
    """Records every aten op with the params it reads, its FLOPs and bytes (and, when measuring, its time)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless a mode opts out; the wrapper
        # costs ~60 us an op (70 vs 9 us measured on torch 2.13), and a trace never runs under torch.compile.
        return False

    def __init__(self, slot: Slot, param_by_id: dict[int, int],
                 param_by_storage: dict[StorageWeakRef, int], sync: Callable[[], None] | None,
                 stand_in: StandIn | None = None, router: frozenset[tuple[int, int]] = frozenset()) -> None:
        super().__init__()
        self.router = router  # the router gates' mm shapes (``router_shapes``)
        self.stand_in = stand_in or StandIn()  # data-dependent ops on planned tensors (routing.py)
        self.slot = slot
        self.param_by_id, self.param_by_storage = param_by_id, param_by_storage
        self.sync = sync  # set when timing ops: waits for the device
        self.seconds: dict[int, float] = {}  # event index -> measured seconds of that op
        self.attention: set[tuple[int, int, int]] = set()  # each fused attention call's heads (``Trace.attention``)
        self.attention_batch = 0  # the largest of their batches (``Trace.attention_batch``)
        self.offset_rows: set[str] = set()  # modules a 2-D ``_grouped_mm`` ran in (``Trace.offset_rows``)

    def _params_read(self, flat_in: list) -> set[int]:
        """Indices of the params among an op's inputs, by identity or by storage (a view of one)."""
        used: set[int] = set()
        for a in flat_in:
            if isinstance(a, torch.Tensor):
                idx = self.param_by_id.get(id(a))
                if idx is None:
                    idx = self.param_by_storage.get(StorageWeakRef(a.untyped_storage()))
                if idx is not None:
                    used.add(idx)
        return used

    @bookkeeping
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if type(self.slot.recorder) is NullRecorder or func.namespace == "prim":
            # the tracer's own tensors (replayed calls), or a metadata query (prim.device on a fake tensor): no op
            return func(*args, **kwargs)
        answers = self.stand_in.answers
        try:
            out = self._run(func, args, kwargs)
        except Exception as e:
            mark(e, op_name(func), self.slot.recorder.current_module())
            raise
        flat_in = flat_leaves(args, kwargs)
        flat_out = flat_leaves((out,))
        if self.slot.produced is not None:
            self.slot.produced.update(StorageWeakRef(t.untyped_storage()) for t in flat_out
                                      if isinstance(t, torch.Tensor))
        used = self._params_read(flat_in)
        nbytes = 0
        if not (getattr(func, "is_view", False) or func in _NO_TRAFFIC_OPS):
            for a in flat_in + flat_out:
                if isinstance(a, torch.Tensor):
                    nbytes += a.numel() * a.element_size()
        flops = op_flops(func, args, kwargs, out)
        recorder = self.slot.recorder
        if used and recorder.check_methods is not None and not recorder.backward:
            recorder.check_methods(tuple(used), recorder.fwd_stack)
        live = 0
        outside = recorder.outside_modules()
        if outside:
            recorder.loss.track(flat_out)
            live = recorder.loss.current
        elif not recorder.backward:  # inside the model: its gradient-free temporaries alive now (``Temporaries``)
            # a buffer updated in place (BatchNorm's num_batches_tracked) is no temporary: the model holds it
            live = recorder.temporary(t for t in flat_out if isinstance(t, torch.Tensor) and self.param_by_id.get(
                id(t)) is None)
        kernel = kernel_of(func, args, kwargs)
        syncs = self.stand_in.answers > answers  # the stand-in read values: on a GPU, the host waits for them
        if kernel in ATTENTION_KERNELS and not recorder.backward:
            self._attention_heads(args)
        if recorder.backward:
            sums = func is torch.ops.aten.add.Tensor  # autograd's accumulation of a gradient's contributions
            grad_live, made = _gradient_bytes(recorder, flat_in, flat_out, not outside, sums)
            # the loss's backward ops keep their class and output bytes: loss parallel runs some otherwise
            cls, out_nbytes = (op_class(func), outputs_nbytes(flat_out)) if outside else (OpClass.OTHER, 0)
            recorder.op(tuple(sorted(used)), flops, nbytes, live, cls, out_nbytes, kernel=kernel,
                        grad_live=grad_live, workspace=workspace_bytes(func, args, kwargs), syncs=syncs)
            recorder.made_grads(made)
        else:
            self._forward_op(func, args, kwargs, flat_in, flat_out, (tuple(sorted(used)), flops, nbytes, live), kernel,
                             syncs)
        return out

    def _forward_op(self, func: Any, args: tuple, kwargs: dict, flat_in: list, flat_out: list,
                    counted: tuple[tuple[int, ...], int, int, int], kernel: int, syncs: bool) -> None:
        """A forward op: what it read and made, and what selective checkpointing needs (it never sees backward's);
        ``counted``: the params it read, its FLOPs, bytes and temporaries alive."""
        recorder = self.slot.recorder
        recorder.made(flat_out)
        if func._schema.is_mutable:
            self.slot.written(written_tensors(func, args, kwargs))
        cls = forward_class(func, args, self.router)
        if cls is OpClass.TOPK:  # a router's choice, which op-level checkpointing saves (``Slot.written``)
            self.slot.topk_made(recorder.current_module(), flat_out)
        if cls is OpClass.ATTENTION_MASK:
            recorder.mask_made(flat_out)
        if func is _GROUPED_MM and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:
            self.offset_rows.add(recorder.current_module())
        if cls is not OpClass.OTHER:  # one an op-level policy can keep (``Event.made_at``)
            recorder.made_by_keepable(flat_out)
        params, flops, nbytes, live = counted
        recorder.op(params, flops, nbytes, live, cls, outputs_nbytes(flat_out), kernel, syncs=syncs)

    def _attention_heads(self, args: tuple) -> None:
        """(query heads, key heads, head dim) of a fused attention call, from its (batch, heads, seq, head dim)
        query and key: what tells a TP degree that divides the heads from one that does not (a model's attention
        module holds no head count a trace can read otherwise)."""
        q, k = (*args, None, None)[:2]
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4:
            with contextlib.suppress(Exception):  # a symbolic size with no value: no head count
                self.attention.add((int(q.shape[1]), int(k.shape[1]), int(q.shape[3])))
                self.attention_batch = max(self.attention_batch, int(q.shape[0]))

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The op itself (timed when measuring), refused first where a real kernel would refuse it and a meta
        kernel would not (``failures.check_operand_dtypes``; forward only: backward follows what forward did).
        A data-dependent op on planned tensors runs its stand-in (``routing.py``)."""
        if not self.slot.recorder.backward:
            check_operand_dtypes(func, args)
        if self.sync is None:
            if not self.stand_in.intercepts(func):
                return func(*args, **kwargs)
            return self.stand_in.call(func, args, kwargs, self.slot.recorder.current_module())
        self.sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        self.seconds[len(self.slot.recorder.events)] = time.perf_counter() - start
        return out


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a mutable op writes (its schema's arguments marked ``(a!)``: an in-place op's self, an out=)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            out += [t for t in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(t, torch.Tensor)]
    return out


def _gradient_bytes(recorder: StepRecorder, flat_in: list, flat_out: list, inside: bool, sums: bool
                    ) -> tuple[int, list[tuple[StorageWeakRef, int]]]:
    """A backward op's gradient bytes: every gradient alive while it runs, the ones it reads and makes and the
    ones waiting for more contributions, which saved-activation accounting never sees: the gradient flowing into a
    layer and the one flowing out (two activations' worth in a conv net), and autograd's accumulation of a
    tensor's gradient over its readers (a Mamba-like scan reads its decay and drive tensors once per position:
    both full-size gradients grow in autograd's input buffers for the whole loop, -5% without them), wherever it
    was made: a U-Net's skip gradient, which a concat's backward hands on as a view of the decoder's and which
    waits for the pooling conv's, and a residual's pass-through gradient, which waits for its branch's, are alive
    across other calls' backwards (-3.1% on an attention U-Net without them). Those alive (``StepRecorder.gradients``,
    weak references; a replayed call adds those from outside it, ``reuse.py``) and those it reads. A gradient is a
    storage a backward op made (or, in a template, the gradient the tracer feeds it, ``reuse.py``) that is no
    param's grad. Outside the model (``inside`` False) the loss region's live bytes count them. With the storages
    it made: one that becomes a param's grad leaves the count (``StepRecorder.param_grad``), with what it summed
    (``sums``: the op is an add, autograd's accumulation of contributions)."""
    grads, param_grads, alive = recorder.grad_storages, recorder.param_grads, recorder.gradients
    read: dict[StorageWeakRef, int] = {}
    for a in flat_in:  # by the tensor's own bytes: a gradient may reach an op as a view of a larger one
        if isinstance(a, torch.Tensor):
            ref = StorageWeakRef(a.untyped_storage())
            read[ref] = max(read.get(ref, 0), a.numel() * a.element_size())
    made: list[tuple[StorageWeakRef, int]] = []
    for t in flat_out:
        if isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in read:  # a view or in-place result is its input's storage (a saved activation that
                # backward detaches is no gradient)
                made.append((ref, t.untyped_storage().nbytes()))
                grads.add(ref)
                alive.track(t, [r for r in read if r in grads] if sums else ())
    if not inside or not made:  # a view, an in-place op or a detach allocates nothing
        return 0, made
    return alive.current + sum(n for ref, n in read.items() if ref in grads and ref not in param_grads
                               and not alive.holds(ref)), made


def device_sync(param_objs: list[nn.Parameter]) -> Callable[[], None]:
    """A barrier for timing: CUDA kernels run asynchronously, CPU ops do not."""
    if any(p.is_cuda for p in param_objs):
        return torch.cuda.synchronize
    return lambda: None


_GROUPED_MM = torch.ops.aten._grouped_mm.default


def grouped_mm_dims(args: tuple, kwargs: dict) -> tuple[int, int, int, int] | None:
    """(groups, rows, inner, cols) a ``torch._grouped_mm`` multiplies in all (rows x inner x cols multiply-adds),
    by its operands' dims: 2-D x 3-D splits the rows by ``offs`` (torchtitan's experts: tokens x dim by experts x
    dim x hidden), 3-D x 2-D the columns, 2-D x 2-D the inner dim (the weight gradient), 3-D x 3-D batches.
    FlopCounterMode counts none (torch 2.13 registers no formula): an expert layer's matmuls were priced at 0."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return None
    try:
        if a.dim() == 3 and b.dim() == 3:
            return int(a.shape[0]), int(a.shape[0]) * int(a.shape[1]), int(a.shape[2]), int(b.shape[2])
        groups = int(b.shape[0]) if b.dim() == 3 else int(a.shape[0]) if a.dim() == 3 else \
            int(offs.shape[0]) if isinstance(offs, torch.Tensor) else 1
        return groups, int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
    except Exception:  # a symbolic size with no value: shape unknown
        return None


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FlopCounterMode's count of one op, its grouped convolutions' weight gradient divided by the groups: torch
    2.13's ``conv_backward_flop`` counts that part as conv(input, grad_output) over every channel, ignoring groups
    (a depthwise conv's backward was 65x its forward at 64 groups, not 2x); a ``_grouped_mm``'s by
    ``grouped_mm_dims``."""
    if func is _GROUPED_MM:
        dims = grouped_mm_dims(args, kwargs)
        return 0 if dims is None else 2 * math.prod(dims[1:])
    fn = flop_registry.get(func._overloadpacket)
    if fn is None:
        return 0
    flops = int(fn(*args, **kwargs, out_val=out))
    if func._overloadpacket is torch.ops.aten.convolution_backward and len(args) == 11 and args[9] > 1 \
            and args[10][1]:
        weight_only = int(fn(*args[:10], [False, True, False], out_val=out))
        flops -= weight_only - weight_only // args[9]
    return flops

