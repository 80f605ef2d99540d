"""The mixed-precision setting FSDP2 runs with: the bytes per element of each copy of a param and its grad."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsdp_planner.errors import PlannerError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


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


_DTYPES = {2: torch.bfloat16, 4: torch.float32}  # bytes per element -> the dtype FSDP2 runs them in


def check_precision(precision: Precision) -> None:
    """What ``verify`` can run: FSDP2's own mixed precision, not torch.autocast."""
    if precision.autocast:
        raise PlannerError(f"verify runs FSDP2's own mixed precision (MixedPrecisionPolicy); '{precision.name}' uses "
                           "torch.autocast, which it does not: use fp32, bf16-mixed or pure-bf16")


def check_param_dtypes(precision: Precision, built: set[str]) -> None:
    """FSDP2 keeps sharded params in the dtype they were built in: ``built`` (floating dtype names, as a trace's
    params give them) must be the precision's param dtype."""
    check_precision(precision)
    storage = str(_DTYPES[precision.param_bytes]).removeprefix("torch.")
    if built - {storage}:
        raise PlannerError(f"precision '{precision.name}' stores params in {storage} but the model builds them in "
                           f"{', '.join(sorted(built))}: build the model in that dtype or pick a precision that "
                           "matches it (--precision)")


def mixed_precision(precision: Precision, model: torch.nn.Module) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for ``precision``, on a model whose params are stored as built (the
    precision's param dtype: FSDP2 keeps the sharded params in the dtype they were built in)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # the distributed stack: for a run only

    check_precision(precision)
    check_param_dtypes(precision, {str(p.dtype).removeprefix("torch.") for p in model.parameters()
                                   if p.is_floating_point()})
    storage = _DTYPES[precision.param_bytes]
    compute, reduce = _DTYPES[precision.compute_bytes], _DTYPES[precision.reduce_bytes]
    return MixedPrecisionPolicy(param_dtype=None if compute == storage else compute,
                                reduce_dtype=None if reduce == compute else reduce)
