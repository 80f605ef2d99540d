"""RMSNorm as a GPU runs it, for steps that are only planned.

On CUDA, ``F.rms_norm`` (``nn.RMSNorm``'s forward) runs one fused kernel, ``aten::_fused_rms_norm`` (torch's
layer_norm.cpp takes it whenever the weight's dtype is the input's): the layer-norm kernel with its RMS flag
(``vectorized_layer_norm_kernel<..., rms_norm=true>`` in an H200's profile), whose autograd saves the input, the
weight and the per-row reciprocal RMS (fp32 for 16-bit inputs); its backward is the layer-norm backward kernels (the
input's grad, then the weight's). A CPU or meta build has no such kernel: the op decomposes (upcast, pow, mean,
rsqrt, two multiplies, downcast), which saves the input upcast to fp32 and the normalized fp32 product, 8 bytes an
element against the GPU's 2 for bf16 (one H200, Llama 1B and Llama 3.2 3B without checkpointing: 3.0 and 8.0 GiB of
the eager peak, predicted 7% and 11% high), and moves six kernels' bytes where the GPU moves one's.

``planned_rms_norm`` runs ``aten::native_layer_norm`` without a bias on tensors without data (meta while tracing,
fake in the fake-world check): the same kernel, so the same bytes moved and saved (with a per-row mean beside the
reciprocal RMS, 4 bytes a row), a standard op with its derivative, meta kernel and DTensor strategy (a
sequence-parallel norm's weight grad is Partial, as ``_fused_rms_norm``'s). Its values are a layer norm's, which
nothing planned reads. So the trace and real FSDP2 on the fake process group both see the GPU's program;
``fused_rms_norm_everywhere`` binds ``F.rms_norm`` to it for a run (a module attribute, so a checkpointed block's
recomputation in backward takes it too). Real tensors, and inputs whose weight has another dtype (the GPU's
composite path), keep ``F.rms_norm``. A hand-written RMSNorm (Hugging Face's ``LlamaRMSNorm``) is its ops on a GPU
as here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from fsdp_planner.attention import planned
from fsdp_planner.patching import patched

_rms_norm = F.rms_norm  # torch's, bound at import: what real tensors run


def planned_rms_norm(input: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
                     eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm``'s signature: the GPU's fused kernel when the step is planned (module docstring)."""
    if not planned(input) or (weight is not None and weight.dtype != input.dtype):
        return _rms_norm(input, normalized_shape, weight, eps)
    if eps is None:  # torch's default: the machine epsilon of the dtype it computes in (fp32 for 16-bit inputs)
        eps = torch.finfo(torch.promote_types(input.dtype, torch.float32)).eps
    return torch.native_layer_norm(input, list(normalized_shape), weight, None, float(eps))[0]


@contextlib.contextmanager
def fused_rms_norm_everywhere() -> Iterator[None]:
    """``F.rms_norm`` bound to ``planned_rms_norm`` while inside; put back on exit."""
    with patched(F, "rms_norm", planned_rms_norm):
        yield
