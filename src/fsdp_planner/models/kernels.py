"""The attention every built-in model calls, with the kernel a GPU would run.

A step that is only planned (meta tensors while tracing, fake tensors in the fake-world check) calls the fused
kernels directly: flash attention, or memory-efficient attention when there is an additive bias. They save
O(seq) activations (the output and its log-sum-exp) instead of the O(seq^2) scores of the math path, which is
what SDPA would pick on a CPU or a meta device. Both the trace and real FSDP2 on fake ranks must see the same
program, the one a GPU runs. On real tensors SDPA picks for the device as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake


def planned(t: torch.Tensor) -> bool:
    """A tensor with no data: the step is being planned, not run."""
    return t.is_meta or is_fake(t)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Attention on (batch, heads, seq, head_dim), with an optional additive ``bias`` (broadcast over batch)."""
    if planned(q):
        if bias is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[0]
        full = bias.expand(q.shape[0], -1, -1, -1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, full, True, 0.0, causal,
                                                                      scale=scale)[0]
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    mask = bias
    if causal:  # SDPA takes a mask or is_causal, not both
        tri = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = mask + torch.zeros(tri.shape, dtype=q.dtype, device=q.device).masked_fill(~tri, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
