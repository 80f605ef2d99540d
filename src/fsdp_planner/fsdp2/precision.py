"""The mixed-precision setting FSDP2 runs with: the bytes per element of each copy of a param and its grad."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """A mixed-precision setting; sizes are bytes per element.

    ``param_bytes``: the (sharded) params the optimizer updates. ``compute_bytes``: the dtype forward and
    backward compute in, which is also FSDP's all-gather dtype (``MixedPrecisionPolicy.param_dtype``) unless
    ``autocast``, where the all-gather stays at ``param_bytes`` and autocast makes the low-precision copies.
    ``grad_bytes``: the grads the optimizer reads. ``reduce_bytes``: gradient communication (DDP buckets,
    reduce-scatter). ``weight_cache``: autocast keeps its low-precision weight copies for the whole autocast
    region (its default ``cache_enabled=True``).
    """

    name: str
    param_bytes: int
    compute_bytes: int
    grad_bytes: int
    reduce_bytes: int
    autocast: bool = False
    weight_cache: bool = False
    description: str = ""

    @property
    def trace_dtype(self) -> torch.dtype | None:
        """What to trace the step in (``trace(compute_dtype=)``): the 16-bit compute dtype FSDP2's
        ``MixedPrecisionPolicy`` casts params and inputs to; None for fp32 compute and for autocast, which picks
        a dtype per op."""
        return torch.bfloat16 if self.compute_bytes == 2 and not self.autocast else None

    @property
    def gather_bytes(self) -> int:
        """Bytes per element of an all-gathered (unsharded) param."""
        return self.param_bytes if self.autocast else self.compute_bytes
