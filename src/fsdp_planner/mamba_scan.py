"""Mamba-2's fused layer as a GPU trains it, for steps that are only planned.

Mamba-2 and the hybrids built on its mixer (NemotronH, Granite 4.0's granitemoehybrid, Bamba, Falcon-H1, Zamba2 in
transformers) train through ``mamba2_split_conv1d_scan_combined``: with mamba_ssm installed, one autograd function
(``MambaSplitConv1dScanCombinedFn``, mamba_ssm/ops/triton/ssd_combined.py) that runs the causal conv1d, the chunked
state-space scan (SSD), the gated RMSNorm and the output projection, and saves for backward only its input (the
in-projection's output ``zxbcdt``), the scan's output before the norm, the norm's reciprocal std and the weights: the
rest is made again in backward. Without mamba_ssm (a CPU, a meta device) that function returns None and transformers
runs its PyTorch reference, whose einsums save fp32 chunk-by-chunk matrices: a 2048-wide, 8-layer Mamba-2 at 4,096
tokens held 20.5 GiB of activations traced so, 3.65 GiB as the fused function saves them.

``install`` wraps the fused entry point of a transformers model's modules: on planned tensors it runs
``_SplitConv1dScan``, whose forward and backward each run one op standing for mamba_ssm's conv and scan kernels
(with the chunk states and chunk-by-chunk products they write as outputs, freed at once) beside the output
projection's matmuls, which torch runs as its own kernels; it saves what mamba_ssm saves. Real tensors (``verify``)
take transformers' own path. FLOPs: ``scan_macs``; time: the op's FLOPs at the matmul efficiency or its bytes at the
memory one, as a matmul's (``KERNEL_MAMBA_SCAN``). mamba_ssm runs about 5 kernels forward and 12 backward, each
reading and writing memory, mostly bound by its bandwidth
(https://pytorch.org/blog/accelerating-mamba2-with-kernel-fusion): one op's inputs and outputs undercount their
traffic, so the time is a floor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from fsdp_planner.attention import planned

FUSED = "mamba2_split_conv1d_scan_combined"  # the name transformers' modeling modules give the fused entry point


def scan_macs(heads: int, headdim: int, dstate: int, groups: int, chunk: int, conv_dim: int, kernel: int,
              backward: bool) -> int:
    """Multiply-adds per token of mamba_ssm's conv and scan kernels, every ``tl.dot`` counted. Forward
    (``_mamba_chunk_scan_combined_fwd``): the conv, each group's C.B^T within its chunk, each head's chunk state
    B^T.x and output C.state, and the chunk-by-chunk product with x. Backward (``_mamba_chunk_scan_combined_bwd``,
    whose output the norm's backward makes again, not the scan): the conv, C.B^T and the states again, then dstates,
    dx through the states and through C.B^T, dB, dC, d(C.B^T) and ``ddAcs_stable``'s dout.x^T, two products for
    C.B^T's gradients, and the conv's. The chunk-by-chunk products are causal, and their kernels skip the blocks
    above the diagonal (about a third of them): counted whole, as a sequence shorter than a chunk is."""
    per_head = 2 * dstate * headdim + chunk * headdim
    if not backward:
        return conv_dim * kernel + heads * per_head + groups * chunk * dstate
    return 3 * conv_dim * kernel + heads * (5 * dstate * headdim + 3 * chunk * headdim) + 3 * groups * chunk * dstate


def _geometry(zxbcdt: torch.Tensor, conv_w: torch.Tensor, D: torch.Tensor, headdim: int, groups: int
              ) -> tuple[int, int, int, int]:
    """(heads, dim = heads x headdim, dstate, d_nonssm) as mamba_ssm reads them from the shapes."""
    heads = D.shape[0]
    dim = heads * headdim
    dstate = (conv_w.shape[0] - dim) // groups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * groups * dstate - heads) // 2
    return heads, dim, dstate, d_nonssm


@torch.library.custom_op("fsdp_planner::mamba_conv_scan", mutates_args=())
def _forward(zxbcdt: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, dt_bias: torch.Tensor,
             A: torch.Tensor, D: torch.Tensor, norm_w: torch.Tensor | None, headdim: int, groups: int, chunk: int
             ) -> list[torch.Tensor]:
    """(y: the normed, gated scan output the output projection reads; the scan's output before the norm; the norm's
    reciprocal std; then what the kernels write and drop: the conv's output, the chunk states in fp32 and in the
    input's dtype, each group's chunk-by-chunk C.B^T in fp32): mamba_ssm's conv and scan kernels. Run only on
    planned tensors."""
    raise RuntimeError("fsdp_planner::mamba_conv_scan stands for mamba_ssm's kernels on planned tensors only")


@_forward.register_fake
def _forward_fake(zxbcdt: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, dt_bias: torch.Tensor,
                  A: torch.Tensor, D: torch.Tensor, norm_w: torch.Tensor | None, headdim: int, groups: int, chunk: int
                  ) -> list[torch.Tensor]:
    batch, seq, _ = zxbcdt.shape
    heads, dim, dstate, d_nonssm = _geometry(zxbcdt, conv_w, D, headdim, groups)
    chunks = -(-seq // chunk)
    normed = batch * seq * groups if norm_w is not None else 0
    states = (batch, chunks, heads, headdim, dstate)
    return [zxbcdt.new_empty(batch, seq, d_nonssm + dim), zxbcdt.new_empty(batch, seq, heads, headdim),
            zxbcdt.new_empty(normed, dtype=torch.float32), zxbcdt.new_empty(batch, seq, conv_w.shape[0]),
            zxbcdt.new_empty(states, dtype=torch.float32), zxbcdt.new_empty(states),
            zxbcdt.new_empty(batch, chunks, groups, chunk, chunk, dtype=torch.float32)]


@torch.library.custom_op("fsdp_planner::mamba_conv_scan_backward", mutates_args=())
def _backward(d_y: torch.Tensor, zxbcdt: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
              out_x: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor | None,
              rstd: torch.Tensor, headdim: int, groups: int, chunk: int) -> list[torch.Tensor]:
    """(dzxbcdt, dconv_w, dconv_b, ddt_bias, dA, dD, dnorm_w, y made again for the output projection's weight
    gradient), an absent bias's or norm's gradient empty: mamba_ssm's backward kernels, on planned tensors only."""
    raise RuntimeError("fsdp_planner::mamba_conv_scan_backward stands for mamba_ssm's kernels on planned tensors only")


@_backward.register_fake
def _backward_fake(d_y: torch.Tensor, zxbcdt: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                   out_x: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                   norm_w: torch.Tensor | None, rstd: torch.Tensor, headdim: int, groups: int, chunk: int
                   ) -> list[torch.Tensor]:
    def like(t: torch.Tensor | None) -> torch.Tensor:
        return torch.empty_like(t) if t is not None else zxbcdt.new_empty(0)

    return [torch.empty_like(zxbcdt), torch.empty_like(conv_w), like(conv_b), torch.empty_like(dt_bias),
            torch.empty_like(A), torch.empty_like(D), like(norm_w), torch.empty_like(d_y)]


def _op_flops(zxbcdt_shape: tuple, conv_w_shape: tuple, D_shape: tuple, headdim: int, groups: int, chunk: int,
              backward: bool) -> int:
    batch, seq = zxbcdt_shape[:2]
    heads = D_shape[0]
    dstate = (conv_w_shape[0] - heads * headdim) // groups // 2
    macs = scan_macs(heads, headdim, dstate, groups, chunk, conv_w_shape[0], conv_w_shape[-1], backward)
    return 2 * batch * seq * macs


@register_flop_formula(torch.ops.fsdp_planner.mamba_conv_scan)
def _forward_flops(zxbcdt_shape: tuple, conv_w_shape: tuple, conv_b_shape: Any, dt_bias_shape: tuple,
                   A_shape: tuple, D_shape: tuple, norm_w_shape: Any, headdim: int, groups: int, chunk: int,
                   **kwargs: Any) -> int:
    return _op_flops(zxbcdt_shape, conv_w_shape, D_shape, headdim, groups, chunk, backward=False)


@register_flop_formula(torch.ops.fsdp_planner.mamba_conv_scan_backward)
def _backward_flops(d_y_shape: tuple, zxbcdt_shape: tuple, conv_w_shape: tuple, conv_b_shape: Any,
                    out_x_shape: tuple, A_shape: tuple, D_shape: tuple, dt_bias_shape: tuple, norm_w_shape: Any,
                    rstd_shape: tuple, headdim: int, groups: int, chunk: int, **kwargs: Any) -> int:
    return _op_flops(zxbcdt_shape, conv_w_shape, D_shape, headdim, groups, chunk, backward=True)


def backward_workspace(zxbcdt: torch.Tensor, conv_w: torch.Tensor, D: torch.Tensor, headdim: int, groups: int,
                       chunk: int) -> int:
    """Bytes mamba_ssm's backward holds besides its outputs at its peak: the conv's output made again and its
    gradient, the norm backward's dx (alive through the scan's backward), ``ddAcs_stable``'s fp32 buffer, and the
    larger of its two moments: the state passing's (the chunk states and their gradients in fp32, each with a copy
    in the input's dtype beside it) and C.B^T's (its fp32 product, two buffers of its gradient, and the fp32 dB and
    dC partial sums)."""
    batch, seq, _ = zxbcdt.shape
    heads, dim, dstate, _ = _geometry(zxbcdt, conv_w, D, headdim, groups)
    chunks = -(-seq // chunk)
    itemsize = zxbcdt.element_size()
    conv = 2 * batch * seq * conv_w.shape[0] * itemsize
    norm_dx = batch * seq * dim * itemsize
    dda = batch * heads * chunks * -(-chunk // 32) * chunk * 4
    states = 2 * batch * chunks * heads * headdim * dstate * (4 + itemsize)
    cb = 3 * batch * chunks * groups * chunk * chunk * 4 + 2 * batch * seq * groups * dstate * 4
    return conv + norm_dx + dda + max(states, cb)


class _SplitConv1dScan(torch.autograd.Function):
    """``MambaSplitConv1dScanCombinedFn`` on planned tensors: its outputs, what it saves, its kernels' work."""

    @staticmethod
    def forward(ctx: Any, zxbcdt: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, norm_w: torch.Tensor | None,
                out_w: torch.Tensor | None, out_b: torch.Tensor | None, shape: tuple[int, int, int]) -> torch.Tensor:
        y, out_x, rstd = _forward(zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, *shape)[:3]  # (the kernels'
        # own buffers die here, as mamba_ssm frees them before the norm)
        out = F.linear(y, out_w, out_b) if out_w is not None else y
        ctx.save_for_backward(zxbcdt, conv_w, conv_b, out_x, A, D, dt_bias, norm_w, rstd, out_w)
        ctx.shape, ctx.has_out_bias = shape, out_b is not None
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:
        zxbcdt, conv_w, conv_b, out_x, A, D, dt_bias, norm_w, rstd, out_w = ctx.saved_tensors
        d_y = dout @ out_w if out_w is not None else dout
        grads = _backward(d_y, zxbcdt, conv_w, conv_b, out_x, A, D, dt_bias, norm_w, rstd, *ctx.shape)
        dzxbcdt, dconv_w, dconv_b, ddt_bias, dA, dD, dnorm_w, y = grads
        d_out_w = d_out_b = None
        if out_w is not None:
            d_out_w = dout.reshape(-1, dout.shape[-1]).t() @ y.reshape(-1, y.shape[-1])
            d_out_b = dout.reshape(-1, dout.shape[-1]).sum(0) if ctx.has_out_bias else None
        return (dzxbcdt, dconv_w, dconv_b if conv_b is not None else None, ddt_bias, dA, dD,
                dnorm_w if norm_w is not None else None, d_out_w, d_out_b, None)


def fused_scan(entry: Callable[..., Any]) -> Callable[..., Any]:
    """``entry`` (transformers' ``mamba2_split_conv1d_scan_combined``) on real tensors; on planned ones
    ``_SplitConv1dScan``. A recurrent state carried in or out, packed sequences (``seq_idx``) and a layer whose
    norm or projection the fused function would not take are left to ``entry``."""

    def scan(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
             dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, chunk_size: int,
             initial_states: torch.Tensor | None = None, dt_limit: tuple[float, float] = (0.0, float("inf")),
             return_final_states: bool = False, activation: str = "silu", rmsnorm_weight: torch.Tensor | None = None,
             rmsnorm_eps: float = 1e-6, outproj_weight: torch.Tensor | None = None,
             outproj_bias: torch.Tensor | None = None, headdim: int | None = None, ngroups: int = 1,
             norm_before_gate: bool = True, **kwargs: Any) -> Any:
        if not planned(zxbcdt) or initial_states is not None or return_final_states or \
                kwargs.get("seq_idx") is not None or D.dim() != 1 or headdim is None:
            return entry(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=initial_states,
                         dt_limit=dt_limit, return_final_states=return_final_states, activation=activation,
                         rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=rmsnorm_eps, outproj_weight=outproj_weight,
                         outproj_bias=outproj_bias, headdim=headdim, ngroups=ngroups,
                         norm_before_gate=norm_before_gate, **kwargs)
        return _SplitConv1dScan.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight,
                                      outproj_weight, outproj_bias, (headdim, ngroups, chunk_size))

    scan.__wrapped_by_fsdp_planner__ = True  # type: ignore[attr-defined]
    scan.__wrapped__ = entry  # type: ignore[attr-defined]
    return scan


def install(model: nn.Module) -> int:
    """Wrap the fused Mamba-2 entry point of every modeling module ``model``'s classes come from (``fused_scan``),
    once per module; how many modeling modules have it (0: none)."""
    found = _modules(model)
    for module in found:
        entry = getattr(module, FUSED)
        if not getattr(entry, "__wrapped_by_fsdp_planner__", False):
            setattr(module, FUSED, fused_scan(entry))
    return len(found)


def mixers(model: nn.Module) -> int:
    """How many of ``model``'s modules are Mamba-2 mixers (``_mixer``)."""
    return sum(1 for m in model.modules() if _mixer(m))


def _modules(model: nn.Module) -> list[Any]:
    """The modeling modules (Python's) of ``model``'s Mamba-2 mixers that have the fused entry point, each once."""
    found: dict[str, Any] = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if _mixer(m) and module is not None and callable(getattr(module, FUSED, None)):
            found[module.__name__] = module
    return list(found.values())


def _mixer(module: nn.Module) -> bool:
    """A Mamba-2 mixer by what transformers' hold: a depthwise conv1d, the skip ``D`` and the decay ``A_log``, one per
    head (Mamba-1's mixers hold one per channel and state: a matrix)."""
    a_log = getattr(module, "A_log", None)
    return isinstance(getattr(module, "conv1d", None), nn.Conv1d) and isinstance(a_log, torch.Tensor) and \
        a_log.dim() == 1 and isinstance(getattr(module, "D", None), torch.Tensor)
