"""Modules traced in full precision inside a mixed-precision step: what FSDP2 runs for a group with its own
``MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=<compute dtype>)``.

FSDP2 casts params to the compute dtype but never buffers: a BatchNorm's fp32 running stats meet bf16 activations
and its kernel refuses the mix. Such a module in a group of its own that computes in fp32 runs: the group's params
are all-gathered in fp32, its pre-forward casts the module's floating inputs to fp32 (``cast_forward_inputs``), and
its post-forward casts the outputs back to the compute dtype (``output_dtype``) for the modules after it. The trace
mirrors that: those modules' params keep their dtype and the same two casts wrap each call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from fsdp_planner.trace.leaves import into_callers


def subtree_params(modules: Mapping[str, nn.Module], names: Iterable[str]) -> set[int]:
    """``id`` of every param of the named modules and their submodules: what their fp32 groups keep in fp32."""
    return {id(p) for name in names for p in modules[name].parameters()}


def _cast(dtype: torch.dtype, tree: object) -> object:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


@contextlib.contextmanager
def full_precision_casts(modules: Mapping[str, nn.Module], names: Iterable[str], compute: torch.dtype | None
                         ) -> Iterator[None]:
    """Each named module's floating inputs cast to fp32 before its call, its floating outputs to ``compute`` after:
    the casts FSDP2's hooks make for an fp32 group, first on the way in (the input cast comes before FSDP2's
    post-backward registration) and last on the way out. Nothing without a compute dtype."""
    names = list(names)
    if compute is None or not names:
        yield
        return

    def cast_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return into_callers((args, kwargs), _cast(torch.float32, (args, kwargs)))  # type: ignore[return-value]

    def cast_out(module: nn.Module, args: tuple, output: object) -> object:
        return _cast(compute, output)

    handles = []
    try:
        for name in names:
            handles.append(modules[name].register_forward_pre_hook(cast_in, with_kwargs=True, prepend=True))
            handles.append(modules[name].register_forward_hook(cast_out))
        yield
    finally:
        for h in handles:
            h.remove()
