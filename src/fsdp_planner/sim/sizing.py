"""Bytes: the one place that turns params into the sizes FSDP2 moves and holds.

FSDP2 shards every param on dim 0 and pads dim 0 to a multiple of the shard world size
(``FSDPParam._init_sharded_param``). The all-gather output, hence the unsharded params that are views into it,
and the reduce-scatter input (a buffer of the reduce dtype, ``foreach_reduce``) all have the padded size; each
rank's shard is the padded size divided by the world size. The unsharded gradients autograd produces have the
param's own (unpadded) shape. With one rank nothing is padded.
"""

from __future__ import annotations

from collections.abc import Iterable

from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.sim.options import Precision
from fsdp_planner.trace.records import Trace


class Sizing:
    """Sizes for a world of ``world_size`` ranks, at ``precision``'s dtypes (each param's own dtype without one)."""

    def __init__(self, trace: Trace, world_size: int = 1, precision: Precision | None = None) -> None:
        self.trace, self.world_size = trace, world_size
        self.padded = [p.padded_numel(world_size) for p in trace.params]
        own = [p.itemsize for p in trace.params]
        self.gather_itemsize = own if precision is None else [precision.gather_bytes] * len(own)
        self.reduce_itemsize = own if precision is None else [precision.reduce_bytes] * len(own)
        self.grad_itemsize = own if precision is None else [precision.compute_bytes] * len(own)

    def group_params(self, plan: Plan) -> list[list[int]]:
        """Each group's params as indices into ``Trace.params``."""
        index = self.trace.index.param_index
        return [[index[p] for p in g.params] for g in plan.groups]

    def gather_bytes(self, params: Iterable[int]) -> int:
        """All-gather output of these params: the bytes they occupy unsharded (padded)."""
        return sum(self.padded[p] * self.gather_itemsize[p] for p in params)

    def reduce_bytes(self, params: Iterable[int]) -> int:
        """Reduce-scatter input for these params' grads (padded, reduce dtype)."""
        return sum(self.padded[p] * self.reduce_itemsize[p] for p in params)

    def grad_bytes(self, params: Iterable[int]) -> int:
        """Unsharded grads of these params as autograd makes them (the params' shapes, compute dtype)."""
        return sum(self.trace.params[p].numel * self.grad_itemsize[p] for p in params)

    def shard_numel(self, params: Iterable[int]) -> int:
        """Elements of these params each rank holds sharded."""
        return sum(self.padded[p] for p in params) // self.world_size
