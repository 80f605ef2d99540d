"""Mamba-1's selective scan as a GPU trains it, for steps that are only planned.

Mamba, Falcon-Mamba and Jamba (transformers) run their mixers' scan through ``mamba_selective_scan``, which on a GPU
with mamba_ssm is its fused CUDA kernel (``selective_scan_fn``: ``SelectiveScanFn``, mamba_ssm/ops/
selective_scan_interface.py). Without it (a CPU, a meta device) transformers runs a PyTorch reference that loops over
every token, saving each step's state: a 52B Jamba at 2,048 tokens did not finish planning in 4 minutes, and at 1,024
its simulated step was 48 s with 60 GiB of activations a GPU never holds.

``install`` wraps the scan of a transformers model's modeling modules: on planned tensors it runs two ops standing for
``selective_scan_cuda``'s forward and backward, with what ``SelectiveScanFn`` saves (u, delta, A, B, C, D, z, the delta
bias, the ungated output and the fp32 chunk states ``x``: one (2 x dstate) pair per channel every 2,048 tokens) and
what its backward returns (dB and dC in fp32, cast back after). The kernel is memory-bound (the Mamba paper, 3.3.2:
the scan is fused to keep its expanded state out of HBM), so it is timed by the bytes it reads and writes
(``KERNEL_SELECTIVE_SCAN``: no FLOPs counted, never fused by inductor). Real tensors (``verify``) run the reference.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.attention import planned

SCAN = "mamba_selective_scan"  # the name transformers' modeling modules give the scan
CHUNK = 2048  # selective_scan_cuda's chunk of tokens: one saved state pair per channel per chunk


@torch.library.custom_op("fsdp_planner::selective_scan", mutates_args=())
def _forward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor, softplus: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the gated output, the ungated one, the chunk states ``x``): ``selective_scan_cuda.fwd``, on planned tensors
    only."""
    raise RuntimeError("fsdp_planner::selective_scan stands for mamba_ssm's kernel on planned tensors only")


@_forward.register_fake
def _forward_fake(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor, softplus: bool
                  ) -> tuple[torch.Tensor, ...]:
    batch, dim, tokens = u.shape
    x = u.new_empty(batch, dim, -(-tokens // CHUNK), 2 * A.shape[-1], dtype=A.dtype)
    return torch.empty_like(u), torch.empty_like(u), x


@torch.library.custom_op("fsdp_planner::selective_scan_backward", mutates_args=())
def _backward(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
              out: torch.Tensor, softplus: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(du, ddelta, dA, dB, dC, dD, dz, ddelta_bias): ``selective_scan_cuda.bwd``, on planned tensors only."""
    raise RuntimeError("fsdp_planner::selective_scan_backward stands for mamba_ssm's kernel on planned tensors only")


@_backward.register_fake
def _backward_fake(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor, dout: torch.Tensor, x: torch.Tensor,
                   out: torch.Tensor, softplus: bool) -> tuple[torch.Tensor, ...]:
    # (dB and dC accumulate in fp32: the kernel's atomic adds)
    return (torch.empty_like(u), torch.empty_like(delta), torch.empty_like(A), torch.empty_like(B, dtype=A.dtype),
            torch.empty_like(C, dtype=A.dtype), torch.empty_like(D), torch.empty_like(z), torch.empty_like(delta_bias))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    u, delta, A, B, C, D, z, delta_bias, softplus = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, output[2], output[1])
    ctx.softplus, ctx.dtypes = softplus, (B.dtype, C.dtype)


def _grads(ctx: Any, dout: torch.Tensor, *_: Any) -> tuple:
    u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
    du, ddelta, dA, dB, dC, dD, dz, ddelta_bias = _backward(u, delta, A, B, C, D, z, delta_bias, dout.contiguous(),
                                                            x, out, ctx.softplus)
    # (autograd casts a gradient to its input's dtype: the fp32 dB and dC are cast back)
    return du, ddelta, dA, dB.to(ctx.dtypes[0]), dC.to(ctx.dtypes[1]), dD, dz, ddelta_bias, None


torch.library.register_autograd("fsdp_planner::selective_scan", _grads, setup_context=_setup)


def fused_scan(reference: Callable[..., Any]) -> Callable[..., Any]:
    """``reference`` (transformers' ``mamba_selective_scan``) on real tensors; mamba_ssm's kernel on planned ones,
    with a cache's last state where asked (``use_cache``). A scan without D, a gate or a delta bias is another
    mixer's: the reference takes it."""

    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
             delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any) -> Any:
        if not planned(hidden_states) or D is None or z is None or delta_bias is None:
            return reference(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                             delta_softplus=delta_softplus, return_last_state=return_last_state, **kwargs)
        out, _, x = _forward(hidden_states.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(), D,
                             z.contiguous(), delta_bias, delta_softplus)
        # a cache's last state (use_cache): a view of the chunk states, as SelectiveScanFn returns it
        return (out, x[:, :, -1, 1::2]) if return_last_state else out

    scan.__wrapped_by_fsdp_planner__ = True  # type: ignore[attr-defined]
    scan.__wrapped__ = reference  # type: ignore[attr-defined]
    return scan


def install(model: nn.Module) -> int:
    """Wrap the selective scan of every modeling module ``model``'s Mamba-1 mixers come from (``fused_scan``), once
    per module; how many of ``model``'s modules are such mixers (0: none)."""
    found = [m for m in model.modules() if _runs_scan(m)]
    for m in found:
        module = sys.modules[type(m).__module__]
        scan = getattr(module, SCAN)
        if not getattr(scan, "__wrapped_by_fsdp_planner__", False):
            setattr(module, SCAN, fused_scan(scan))
    return len(found)


def mixers(model: nn.Module) -> int:
    """How many of ``model``'s modules are Mamba-1 mixers whose modeling module has the scan."""
    return sum(1 for m in model.modules() if _runs_scan(m))


def _runs_scan(module: nn.Module) -> bool:
    """A Mamba-1 mixer (``_mixer``) whose modeling module holds transformers' scan."""
    return _mixer(module) and callable(getattr(sys.modules.get(type(module).__module__), SCAN, None))


def _mixer(module: nn.Module) -> bool:
    """A Mamba-1 mixer by what transformers' hold: a depthwise conv1d, the skip ``D``, ``x_proj`` and ``dt_proj``,
    and ``A_log`` a (channel x state) matrix (Mamba-2's hold one per head)."""
    a_log = getattr(module, "A_log", None)
    return isinstance(getattr(module, "conv1d", None), nn.Conv1d) and isinstance(a_log, torch.Tensor) and \
        a_log.dim() == 2 and all(isinstance(getattr(module, n, None), nn.Linear) for n in ("x_proj", "dt_proj"))
