"""Compile a plan's modules one by one, as torchtitan compiles its transformer blocks (``compile.enable``).

torchtitan's order is TP, activation checkpointing, then ``torch.compile(block, fullgraph=True)``, then
``fully_shard``. Here each module's ``forward`` is compiled in place (``fullgraph=True``, inductor), which keeps its
name and its params' names (torchtitan re-registers an ``OptimizedModule`` under the block's name): the hooks put on
the module (FSDP2's unshard and reshard, the checkpoint's) stay outside the compiled region and run eagerly, as
FSDP2's hooks on torchtitan's wrapper do, while the block's ops run as one compiled graph, which saves for backward
what AOTAutograd's partitioner chose (what the planner measured, ``trace/compiled.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

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
        make_room_for_recompiles([modules[n] for n in names])
        # as torchtitan's apply_compile sets it: a block under checkpointing whose forward has a Python side effect
        # (EP's experts swap their DTensor params for the local tensors while they run, ``local_forward``) is
        # refused by Dynamo unless the side effect is not replayed in the recomputation; the swap is undone after
        # each call, so nothing needs replaying
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for n in names:
        module = modules[n]
        module.forward = waited_inputs(torch.compile(module.forward, fullgraph=True))  # type: ignore[method-assign]


def waited_inputs(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` given a copy of each tensor argument that is a view of a functional collective's pending
    output (``AsyncCollectiveTensor``): under TP the embedding's sequence-sharded output reaches the first compiled
    block so (RowwiseParallel's reduce-scatter, ``to_local``), and a compiled graph given that view as its input
    returned no gradient to it on torch 2.13 (the embedding trained on zeros beside a correct loss: verify's
    parity, 2.5e-3 off after one step) or failed in DTensor's backward; a copy of it trains as eager does."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def waited(a: Any) -> Any:
        return a.clone() if isinstance(a, torch.Tensor) and isinstance(a._base, AsyncCollectiveTensor) else a

    def run(*args: Any, **kwargs: Any) -> Any:
        return forward(*map(waited, args), **{k: waited(v) for k, v in kwargs.items()})

    return run


# each compiled forward may need a second graph: automatic dynamic shapes recompile once for a new batch size
GRAPHS_PER_MODULE = 2


def make_room_for_recompiles(modules: Sequence[nn.Module]) -> None:
    """Dynamo caches compiled graphs per code object, ``recompile_limit`` (8) deep, and under ``fullgraph=True`` a
    miss past the limit raises. Modules of one class whose params differ in shape (a UNet's blocks of several
    widths) share their forward's code but each needs a graph of its own (params' shapes are static:
    ``force_parameter_static_shapes``): a trial's 10 ResBlocks failed with FailOnRecompileLimitHit. The limits are
    raised (never lowered) to ``GRAPHS_PER_MODULE`` graphs for every compiled module sharing a forward."""
    # (a forward that is no function, a partial or a hook's callable object, is counted as its own)
    forwards = Counter(getattr(getattr(m.forward, "__func__", m.forward), "__code__", id(m)) for m in modules)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, GRAPHS_PER_MODULE * max(forwards.values(), default=0))
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, GRAPHS_PER_MODULE * len(modules))
