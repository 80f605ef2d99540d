"""Compile a plan's modules one by one, as torchtitan compiles its transformer blocks (``compile.enable``).

torchtitan's order is TP, activation checkpointing, then ``torch.compile(block, fullgraph=True)``, then
``fully_shard``. Here each module's ``forward`` is compiled in place (``fullgraph=True``, inductor), which keeps its
name and its params' names (torchtitan re-registers an ``OptimizedModule`` under the block's name): the hooks put on
the module (FSDP2's unshard and reshard, the checkpoint's) stay outside the compiled region and run eagerly, as
FSDP2's hooks on torchtitan's wrapper do, while the block's ops run as one compiled graph, which saves for backward
what AOTAutograd's partitioner chose (what the planner measured, ``trace/compiled.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

import fsdp_planner.routing as routing
from fsdp_planner.attention import compilable
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable_name


def apply_compile(model: nn.Module, names: Sequence[str]) -> None:
    """Compile each named module's forward in place (``fullgraph=True``), before ``fully_shard``."""
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise PlannerError(f"plan 'compiled' names modules the model does not have: "
                           f"{', '.join(map(printable_name, unknown[:5]))}")
    if names:
        compilable()
        routing.compilable()
    for n in names:
        module = modules[n]
        module.forward = torch.compile(module.forward, fullgraph=True)  # type: ignore[method-assign]
