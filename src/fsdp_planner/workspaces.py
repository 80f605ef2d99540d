"""Device memory a GPU kernel allocates for itself while it runs, which a meta or CPU run of the same op never makes.

The trace (meta tensors) and the fake-world check (fake tensors on this CPU) see each op's inputs and outputs, not
the buffers its CUDA kernel allocates inside: those are counted here, by op and shapes, as a level beside what is
alive while the op runs (``Event.workspace`` in the trace, beside ``Event.grad_live``; ``LiveBytes`` on the fake
ranks). The CPU kernels of CPU ranks (``Engine.HOST``) allocate none of them.

- ``aten::embedding_dense_backward`` (``EmbeddingBackwardKernel.cu``, reached from ``Embedding.cu``'s
  ``embedding_dense_backward_cuda`` past 3,072 indices or with ``scale_grad_by_freq``): the grad rows of equal
  indices are summed in partial segments of ``NROWS_PER_THREAD`` = 10 rows into ``grad_weight_per_segment``, an
  ``(numel / 10 + min(numel, num_weights)) x dim`` tensor of the accumulate type (fp32 for 16-bit and fp32 grads),
  then scattered into the grad it returns (allocated first, so both are alive). One H200, Llama 3.1 405B's
  vocab-parallel embedding at TP 8 (16,384 tokens, dim 16,384): a 1,126.4 MiB block alive at the step's peak
  (``benchmarks/gpu_2d.md``), 18,022 x 16,384 x 4 bytes. Its int64 index arrays (a few times ``numel`` x 8 bytes)
  are left out.
- flash-linear-attention's gated delta rule and Kimi delta attention backward (``linear_attention.py``): the chunk
  states and their gradients
  it makes again; mamba_ssm's conv and scan backward (``mamba_scan.py``): the conv's output, the chunk states and
  the chunk-by-chunk products made again, and their gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_planner.linear_attention import backward_workspace, kda_backward_workspace
from fsdp_planner.mamba_scan import backward_workspace as scan_workspace

EMBEDDING_ATOMIC_MAX_INDICES = 3072  # at most this many indices (and no scale_grad_by_freq): one kernel, no buffer
EMBEDDING_ROWS_PER_PARTIAL = 10  # NROWS_PER_THREAD


def workspace_bytes(func: Any, args: tuple, kwargs: dict | None = None) -> int:
    """Bytes the CUDA kernel of ``func`` on these arguments allocates besides its outputs (module docstring);
    0 for every op this module does not name."""
    if func is torch.ops.fsdp_planner.chunk_gated_delta_rule_backward.default:
        return backward_workspace(args[0], args[1])
    if func is torch.ops.fsdp_planner.chunk_kda_backward.default:
        return kda_backward_workspace(args[0], args[1])
    if func is torch.ops.fsdp_planner.mamba_conv_scan_backward.default:
        return scan_workspace(args[1], args[2], args[6], *args[10:13])
    if func is not torch.ops.aten.embedding_dense_backward.default:
        return 0
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    bound = {**dict(zip(names, args, strict=False)), **(kwargs or {})}
    grad, indices, num_weights = bound["grad_output"], bound["indices"], int(bound["num_weights"])
    numel = indices.numel()
    if numel <= EMBEDDING_ATOMIC_MAX_INDICES and not bound.get("scale_grad_by_freq", False):
        return 0
    accumulate = max(4, grad.element_size())  # acc_type: float for half, bfloat16 and float; double for double
    rows = numel // EMBEDDING_ROWS_PER_PARTIAL + min(numel, num_weights)
    return int(rows * grad.shape[-1] * accumulate)
