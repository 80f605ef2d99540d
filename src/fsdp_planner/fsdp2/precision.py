"""The mixed-precision setting FSDP2 runs with: the bytes per element of each copy of a param and its grad."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsdp_planner.errors import PlannerError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

_DTYPES = {2: torch.bfloat16, 4: torch.float32}  # the floating dtype of each size the precisions use


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

    def fsdp_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` for params stored in ``param_bytes``: None where FSDP2
        keeps the dtype it already has. Autocast casts outside FSDP2, which then runs in the params' own dtype."""
        if self.autocast:
            return None, None
        storage, compute, reduce = (_DTYPES[n] for n in (self.param_bytes, self.compute_bytes, self.reduce_bytes))
        return None if compute == storage else compute, None if reduce == compute else reduce

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the (sharded) params are stored in."""
        return _DTYPES[self.param_bytes]

    @property
    def gather_bytes(self) -> int:
        """Bytes per element of an all-gathered (unsharded) param."""
        return self.param_bytes if self.autocast else self.compute_bytes


def check_precision(precision: Precision) -> None:
    """What ``verify`` can run: FSDP2's own mixed precision, not torch.autocast."""
    if precision.autocast:
        raise PlannerError(f"verify runs FSDP2's own mixed precision (MixedPrecisionPolicy); '{precision.name}' uses "
                           "torch.autocast, which it does not: use fp32, bf16-mixed or pure-bf16")


def check_param_dtypes(precision: Precision, built: set[str]) -> None:
    """FSDP2 keeps sharded params in the dtype they were built in: ``built`` (floating dtype names, as a trace's
    params give them) must be the precision's param dtype."""
    check_precision(precision)
    storage = str(precision.storage_dtype).removeprefix("torch.")
    if len(built) > 1:
        raise PlannerError(f"the model builds its params in {' and '.join(sorted(built))}: the planner models one "
                           "stored dtype for every param (FSDP2 itself needs one per group: 'FSDP expects uniform "
                           "original parameter dtype'), so no --precision checks it; build the params in one dtype "
                           "and let the precision's MixedPrecisionPolicy cast them for compute")
    if built - {storage}:
        raise PlannerError(f"precision '{precision.name}' stores params in {storage} but the model builds them in "
                           f"{', '.join(sorted(built))}: build the model in that dtype or pick a precision that "
                           "matches it (--precision)")


def check_complex_params(precision: Precision, model: torch.nn.Module) -> None:
    """Refuse, before any rank starts, what ``complex_reduce_problem`` names of ``model``'s params."""
    names = [n for n, p in model.named_parameters() if p.is_complex() and p.requires_grad]
    if (problem := complex_reduce_problem(precision, names)) is not None:
        raise PlannerError(problem)


def complex_reduce_problem(precision: Precision, complex_params: list[str]) -> str | None:
    """FSDP2 reduce-scatters a complex param's grads in the policy's reduce dtype (its mixed precision leaves the
    param's own dtype alone, not the reduce dtype), and ``foreach_reduce``'s copy into that real buffer raises on
    the ranks: the sentence saying so, for the trainable complex params ``complex_params``; None when they run."""
    reduce = precision.fsdp_dtypes()[1]
    if reduce is None or not complex_params:
        return None
    return (f"{complex_params[0]} is a complex param, and precision '{precision.name}' reduce-scatters grads in "
            f"{str(reduce).removeprefix('torch.')}, which FSDP2 cannot copy complex grads into: train it with "
            "--precision fp32")


def built_dtypes(model: torch.nn.Module) -> set[str]:
    """The floating dtypes ``model``'s trainable params are built in, named as a trace names them ("float32"):
    frozen ones may differ (FSDP2 checks one dtype per group among params that require grad, and a frozen bf16
    encoder beside an fp32 model trains as built)."""
    return {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()
            and p.requires_grad}


def mixed_precision(precision: Precision, model: torch.nn.Module) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for ``precision``, on a model whose params are stored as built (the
    precision's param dtype: FSDP2 keeps the sharded params in the dtype they were built in)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # the distributed stack: for a run only

    check_param_dtypes(precision, built_dtypes(model))
    check_complex_params(precision, model)
    param_dtype, reduce_dtype = precision.fsdp_dtypes()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def full_precision_policy(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of a group with ``param_dtype="fp32"`` beside the plan's ``policy``: params all-gathered and computed
    in fp32, the group's inputs cast to fp32 (``cast_forward_inputs``) and its outputs back to the plan's compute
    dtype (``output_dtype``) for the modules after it, grads reduced as the plan's. ``policy`` itself when the plan
    computes in its params' dtype."""
    import torch.distributed.fsdp as fsdp  # the distributed stack: for a run only

    if policy.param_dtype is None:
        return policy
    return fsdp.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=policy.reduce_dtype,
                                     output_dtype=policy.param_dtype, cast_forward_inputs=True)
