"""Attention as a GPU runs it, for steps that are only planned.

On a GPU, ``F.scaled_dot_product_attention`` runs a fused kernel (flash attention, or memory-efficient attention
when there is a mask) that saves O(seq) for backward: the output and its log-sum-exp. On a meta device or a CPU
it takes the math path, which saves the O(seq^2) attention scores: at seq 8192 that is gigabytes per layer that
no GPU run allocates. The built-in models call ``sdpa``, which runs the fused kernels on
tensors without data (meta while tracing, fake in the fake-world check), so the trace and real FSDP2 on the fake
process group both see the GPU's program. ``GpuAttention`` does the same for a user's model while it is traced
(its SDPA calls are redirected, ``nn.MultiheadAttention``'s included); the fake-world check cannot use a torch
function mode (a checkpointed recomputation runs outside them), so it binds ``F.scaled_dot_product_attention`` to
``sdpa`` for the run (``fused_sdpa_everywhere``).

``kernel`` sets which kernel a planned step assumes (``--attention``): ``sdpa`` (the default) and ``flash`` run the
fused kernels above (flash-attn saves the same output and log-sum-exp; its soft-capping and sliding windows change
neither the memory nor, to first order, the time, so a model asking for them runs SDPA's fused kernel while
planned), ``eager`` the math path, which saves the score matrices. ``calls`` counts the attention calls that took
the kernel, for the trace's note.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from fsdp_planner.patching import patched


@dataclass
class Kernel:
    """The kernel a planned step's attention runs, and how many calls ran it."""

    name: str = "sdpa"
    calls: int = 0
    math_calls: int = 0  # of them, the ones a GPU's SDPA runs on its math path (``_math_on_gpu``)


_KERNEL: contextvars.ContextVar[Kernel | None] = contextvars.ContextVar("fsdp_planner_attention", default=None)


@contextlib.contextmanager
def kernel(name: str | None) -> Iterator[Kernel]:
    """Planned attention inside runs ``name``'s kernel (None: sdpa); yields the count of calls that did."""
    k = Kernel(name or "sdpa")
    token = _KERNEL.set(k)
    try:
        yield k
    finally:
        _KERNEL.reset(token)


_MASK: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp_planner_attention_mask", default=False)


def in_mask() -> bool:
    """Inside ``fused_attention``'s making of a mask's bias (``OpClass.ATTENTION_MASK``)."""
    return _MASK.get()


@contextlib.contextmanager
def _mask_ops() -> Iterator[None]:
    """The ops inside make the mask's bias: the trace tells them apart (not under dynamo, which reads no ContextVar
    and traces no step)."""
    token = None if torch.compiler.is_compiling() else _MASK.set(True)
    try:
        yield
    finally:
        if token is not None:
            _MASK.reset(token)


def current_kernel() -> str:
    k = _KERNEL.get()
    return k.name if k is not None else "sdpa"


def planned(t: torch.Tensor) -> bool:
    """A tensor with no data: the step is being planned, not run. Under ``torch.compile`` (dynamo's fake tensors
    stand for the real ones it compiles for) only a meta tensor is: the compiled block runs SDPA as eager does."""
    return t.is_meta or (not torch.compiler.is_compiling() and is_fake(t))


_kernel_name: Callable[[], str] = current_kernel  # what ``fused_attention`` reads: ``compilable`` makes it dynamo's


def compilable() -> None:
    """Before ``torch.compile`` of a model whose attention is ``fused_attention``: dynamo cannot read the ContextVar
    ``current_kernel`` reads, so it takes the kernel's name as a constant (``assume_constant_result``). Not done at
    import: that imports torch._dynamo, whose frames, made inside a planned step, would hold its tensors alive
    (tests/test_trace.py)."""
    global _kernel_name
    _kernel_name = torch.compiler.assume_constant_result(current_kernel)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """SDPA's arguments, run by the kernel a GPU would pick: flash without a mask, memory-efficient with one, the
    math path for keys of fewer heads that no fused kernel takes (``_math_on_gpu``) and under ``kernel("eager")``."""
    if not torch.compiler.is_compiling():  # dynamo (measuring a compiled block) neither reads nor counts here
        chosen = _KERNEL.get()
        if chosen is not None:
            chosen.calls += 1
    flash = attn_mask is None and v.shape[-1] == q.shape[-1]
    if _kernel_name() == "eager" or _math_on_gpu(q, k, v, enable_gqa, flash):
        if not torch.compiler.is_compiling() and (chosen := _KERNEL.get()) is not None:
            chosen.math_calls += 1
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]
    if flash:  # grouped-query keys and values as they are: the flash kernel reads them per group, copying none
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is None:  # the value's head size differs (MLA): SDPA's flash kernel takes one head size, the
        # memory-efficient one gives the output the value's (and saves as little)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                      scale=scale)[0]
    if attn_mask.dtype == torch.bool:  # SDPA's boolean mask: True takes part (the ops that make the bias marked,
        # not the views after: the attention's queries, keys and values are charged to the last op before it)
        with _mask_ops():  # (filled in place: a bias and the negated mask alive at once, as SDPA's own conversion)
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask,
                                                                                                 float("-inf"))
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    bias = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal,
                                                                  scale=scale)[0]


def _math_on_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, flash: bool) -> bool:
    """Whether SDPA's dispatcher on a GPU takes the math path (which saves the score matrices): for inputs whose
    last dim is strided, and for keys with fewer heads than the queries: the fused kernels refuse differing heads
    without ``enable_gqa`` (Falcon's multi-query attention passes one key head and lets matmul broadcast it), and
    with it only flash takes them (no mask, one head size; the memory-efficient kernel has no grouped-query
    support). Measured against the independent FSDPMemTracker run (benchmarks/fidelity_memory_heldout.md):
    Falcon 13-48% low before, GQA models 2-3% high (keys and values repeated)."""
    heads_differ = k.dim() >= 3 and k.shape[-3] != q.shape[-3]
    # every fused kernel also asks for a last dim of stride 1 (a map's channels viewed as heads, then transposed,
    # have not: a U-Net's attention was 20-60% above the product's fused-kernel run)
    strided = any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (q, k, v))
    return strided or (heads_differ and not (enable_gqa and flash))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, fused when the step is planned. The built-in models call this rather
    than rely on ``GpuAttention``: a checkpointed module's recomputation in backward runs outside any torch
    function mode, and must run the kernel its forward ran."""
    return fused_attention(q, k, v, **kwargs) if planned(q) else F.scaled_dot_product_attention(q, k, v, **kwargs)


def _planned_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
    """SDPA's positional signature, as ``F.multi_head_attention_forward`` calls it."""
    return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)


@contextlib.contextmanager
def _fused_inside_mha() -> Iterator[None]:
    """``F.multi_head_attention_forward`` calls SDPA by its module-level name, and a torch function mode runs the
    function it intercepts with itself switched off, so ``GpuAttention`` never sees that call: the name is bound to
    ``sdpa`` for the one call, and put back after."""
    with patched(F, "scaled_dot_product_attention", _planned_sdpa):
        yield


@contextlib.contextmanager
def fused_sdpa_everywhere() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` bound to ``sdpa`` while inside, for every caller, a checkpointed call's
    recomputation and ``nn.MultiheadAttention`` included: what the fake-world check runs, so that a user's model
    takes there the kernel a GPU picks (and the trace assumed), not the CPU's (the math path, where query/key and
    value heads differ). Put back on exit."""
    with _fused_inside_mha():
        yield


class GpuAttention(TorchFunctionMode):
    """Inside it, SDPA on planned tensors runs ``fused_attention``, ``nn.MultiheadAttention``'s included (when it is
    asked for no weights, the call that takes SDPA); real tensors are left to SDPA."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is F.scaled_dot_product_attention and first is not None and planned(first) and first.dim() == 4:
            return fused_attention(*args, **kwargs)
        if func is F.multi_head_attention_forward and first is not None and planned(first):
            with _fused_inside_mha():
                return func(*args, **kwargs)
        return func(*args, **kwargs)
