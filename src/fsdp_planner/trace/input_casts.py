"""FSDP2's cast of a group's module inputs to the compute dtype, traced where the model makes float32 activations.

``MixedPrecisionPolicy(cast_forward_inputs=True)`` (FSDP2's default) casts the floating inputs of each module a
``fully_shard`` call lists to ``param_dtype`` at that module's pre-forward. A forward that adds a float32 buffer (a
sinusoidal position table) to bfloat16 activations makes float32 activations, and the next module's bfloat16
weights then meet them: the real run works only where a group lists that module, whose pre-forward casts them
back. A step that fails in the compute dtype is traced again with that cast at every module holding params (the
modules a group can list); the modules where it changed a dtype, in call order, are ``Trace.cast_inputs``: every
plan of the trace lists them (``make_plan`` gives each a group where a policy did not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from fsdp_planner.trace.leaves import into_callers
from fsdp_planner.trace.tree import ROOT, proper_ancestors


@contextlib.contextmanager
def group_input_casts(modules: Mapping[str, nn.Module], full_precision: Collection[str], compute: torch.dtype,
                      cast: list[str]) -> Iterator[None]:
    """Each module holding params casts its floating inputs to ``compute`` before its call, as FSDP2's pre-forward
    of a listed module does; ``cast`` gets, in call order, each module where that changed an input's dtype. Not
    the root (the step's inputs are cast already) nor the ``full_precision`` modules and those inside them (their
    fp32 groups cast to fp32: ``full_precision.py``)."""

    def hook_for(name: str):
        def cast_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            changed = False

            def one(t: torch.Tensor) -> torch.Tensor:
                nonlocal changed
                if not t.is_floating_point() or t.dtype == compute:
                    return t
                changed = True
                return t.to(compute)

            out = into_callers((args, kwargs), tree_map_only(torch.Tensor, one, (args, kwargs)))
            if changed and name not in cast:
                cast.append(name)
            return out  # type: ignore[return-value]
        return cast_in

    kept = set(full_precision)
    handles = []
    try:
        for name, module in modules.items():
            if name == ROOT or name in kept or kept & set(proper_ancestors(name)):
                continue
            if next(module.parameters(), None) is None:  # no group can list it (it would manage nothing)
                continue
            handles.append(module.register_forward_pre_hook(hook_for(name), with_kwargs=True, prepend=True))
        yield
    finally:
        for h in handles:
            h.remove()
