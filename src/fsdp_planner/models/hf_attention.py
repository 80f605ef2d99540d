"""Flash attention for Hugging Face models on a machine without flash-attn (``--attention flash``).

transformers' ``flash_attention_2`` needs the ``flash_attn`` package, which a CPU cannot load, and some models
(Gemma 2, for its soft-capping) refuse ``sdpa``. ``fused_attention_forward`` is registered as one more attention
implementation: while the step is planned it runs transformers' SDPA path, whose calls take the fused stand-in on
planned tensors (``attention.py``), so the trace keeps what flash-attn keeps (the output and its log-sum-exp, O(seq));
soft-capping, which flash-attn applies inside its kernel, changes neither memory nor shapes and is left out there.
On real tensors (``verify``) it runs the model's own eager attention (soft-capping included), else SDPA.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn
from torch._guards import detect_fake_mode

from fsdp_planner.attention import planned

FUSED = "fsdp_planner_fused"


def fused_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """An attention implementation (transformers' signature): (batch, heads, seq, dim) in, (batch, seq, heads,
    dim) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if planned(query):
        kwargs.pop("softcap", None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is not None:
        return eager(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Make ``fused_attention_forward`` an attention implementation transformers accepts, with SDPA's masks; its
    name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        """SDPA's mask on real tensors (the eager attention ``verify`` runs needs it); none while the step is
        planned (meta, or the fake world's fake tensors): flash-attn takes no mask, its causal or sliding window
        is inside the kernel, so SDPA's causal flash kernel stands for it (a windowed kernel does less work: the
        step's attention time is then an upper bound) and no sequence-squared mask is held."""
        if str(kwargs.get("device", "")) == "meta" or detect_fake_mode() is not None:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(FUSED, fused_attention_forward)
    AttentionMaskInterface.register(FUSED, mask)
    return FUSED
