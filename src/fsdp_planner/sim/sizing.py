"""Bytes: the one place that turns params into the sizes FSDP2 moves and holds.

FSDP2 shards every param on dim 0 and pads dim 0 to a multiple of the shard world size
(``FSDPParam._init_sharded_param``). The all-gather output, hence the unsharded params that are views into it,
and the reduce-scatter input (a buffer of the reduce dtype, ``foreach_reduce``) all have the padded size; each
rank's shard is the padded size divided by the world size. The unsharded gradients autograd produces have the
param's own (unpadded) shape. With one rank nothing is padded.

``fully_shard(shard_placement_fn=...)`` may shard a param on another dim instead (``ShardPlacement.AUTO``: dim 1
where dim 0 has fewer rows than the shard size, as torchtitan does for MoE experts). FSDP2 refuses uneven sharding
on a dim other than 0 (``FSDPParam._init_sharded_param``: "FSDP does not support uneven sharding on dim"), so such
a param is not padded; instead its all-gather is copied out through a temporary of its unsharded size
(``foreach_all_gather_copy_out``: ``torch.empty_like`` then ``torch.cat(chunks, dim)``), and its unsharded grad is
re-laid out by ``torch.cat(torch.chunk(grad, world_size, dim), dim=0)`` before the reduce-scatter copy-in
(``foreach_reduce``): one extra copy each way (``shard1_gather_bytes``, ``shard1_grad_bytes``). The gather's
temporaries are all held until the copy-out returns (their sum); each re-laid-out grad replaces its source in
the list that owns it (``post_backward`` sets the param's grad to None first), so only one source is held beside
its copy at a time (``shard1_grad_peak_bytes``: the largest).

Under a mixed precision FSDP2 first casts each rank's shards into one flat buffer of the all-gather dtype
(``_get_param_all_gather_inputs``'s foreach copy), alive beside the all-gather output while its copy-in runs
(``gather_cast_bytes``).

Params of modules traced in fp32 (``Trace.full_precision``: an fp32 group's) are all-gathered and get grads in fp32
whatever the precision's compute dtype.

Under expert parallelism (an EP view's ``Trace.expert_params``) the expert params are sharded over the EP-reduced
mesh, world size / EP ranks (``param_shards``), the rest over the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from fsdp_planner.choices import ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.trace.infos import ParamInfo
from fsdp_planner.trace.records import Trace


def shard_dim(param: ParamInfo, shard: int, placement: ShardPlacement) -> int:
    """The dim ``placement`` shards ``param`` on over ``shard`` ranks: 1 under ``AUTO`` where dim 0 is smaller than
    the shard size (so Shard(0) would pad it past its size) and dim 1 divides evenly (FSDP2 requires it); else 0."""
    if placement is ShardPlacement.AUTO and shard > 1 and len(param.shape) >= 2 and param.shape[0] < shard \
            and param.shape[1] % shard == 0:
        return 1
    return 0


def param_shards(trace: Trace, shard: int) -> list[int]:
    """Ranks each param is sharded over: ``shard``, and for an EP view's expert params ``shard`` / EP."""
    out = [shard] * len(trace.params)
    for i in trace.expert_params:
        out[i] = max(1, shard // trace.ep_shard_degree)
    return out


def shard_dims(trace: Trace, shard: int, placement: ShardPlacement) -> dict[str, int]:
    """The params ``placement`` shards on a dim other than 0, by name (what a plan's ``shard_dims`` records)."""
    dims = {p.fqn: shard_dim(p, n, placement) for p, n in zip(trace.params, param_shards(trace, shard), strict=True)}
    return {name: d for name, d in dims.items() if d}


def with_memory_options(plan: Plan, trace: Trace, shard: int, offload: bool, placement: ShardPlacement,
                        reduce_dtype: str) -> Plan:
    """``plan`` recording FSDP2's memory options it was made with: what ``apply_plan`` and export then apply."""
    return replace(plan, offload=offload, shard_dims=shard_dims(trace, shard, placement), reduce_dtype=reduce_dtype)


def check_shard_dims(plan: Plan, trace: Trace, shard: int) -> None:
    """The simulator models ``ShardPlacement.AUTO``'s rule only: a plan whose ``shard_dims`` differ from what the
    rule gives at this shard size is refused rather than simulated wrongly."""
    if plan.shard_dims and plan.shard_dims != shard_dims(trace, shard, ShardPlacement.AUTO):
        raise PlannerError(f"the plan's shard_dims differ from 'dim 1 where dim 0 has fewer rows than the shard size "
                           f"({shard}) and dim 1 divides evenly', the only placement the simulator models; make the "
                           "plan again for this cluster with --shard-placement auto")


def sharded_numel(param: ParamInfo, shard: int, dim: int) -> int:
    """Elements of ``param``'s all-gather output over ``shard`` ranks sharded on ``dim``: dim 0 padded to a multiple
    of the shard size, another dim as it is (FSDP2 requires it to divide evenly)."""
    return param.padded_numel(shard) if dim == 0 else param.numel


FULL_PRECISION_BYTES = 4  # an fp32 group's all-gather and grads (``Group.param_dtype``)


@dataclass(frozen=True)
class GroupFacts:
    """What a group's params are, wherever the group appears: computed once per distinct set of params."""

    params: tuple[int, ...]  # indices into Trace.params
    gather_bytes: int  # its all-gather output: the bytes its params occupy unsharded
    uses: list[int]  # the ops reading any of them, in order
    first_backward: int  # its first backward op (len(events) + 1 when backward reads none of them)


class Sizing:
    """Sizes for a world of ``world_size`` ranks, at ``precision``'s dtypes (each param's own dtype without one).

    Planners size thousands of plans whose groups recur; per-group facts and per-collective bytes are cached."""

    def __init__(self, trace: Trace, world_size: int = 1, precision: Precision | None = None,
                 like: Sizing | None = None, placement: ShardPlacement = ShardPlacement.DIM0,
                 dims: dict[str, int] | None = None, reduce_itemsize: int | None = None,
                 float8_gathered: frozenset[int] = frozenset()) -> None:
        """``like``: the sizing of the same trace at another world size, whose per-group uses (they do not depend on
        the world size) are shared. ``placement``: the dim each param is sharded on (module docstring); ``dims``:
        a plan's own ``shard_dims`` instead. ``reduce_itemsize``: the reduce dtype's bytes when ``precision`` is
        None (a plan's ``reduce_dtype`` over the params' own dtypes). ``float8_gathered``: the params FSDP2
        all-gathers in float8, one byte an element (``float8.py``)."""
        self.trace, self.world_size = trace, world_size
        # bytes per param (padded to the world size, at the precision's dtypes or each param's own), for sums over
        # thousands of params at C speed (a plan's root or large groups)
        cast = np.array([p.is_floating_point for p in trace.params], dtype=bool)
        itemsize = _itemsizes(trace, precision, cast)
        shards = param_shards(trace, world_size)
        on = [dims.get(p.fqn, 0) if dims is not None else shard_dim(p, n, placement)
              for p, n in zip(trace.params, shards, strict=True)]
        self._padded = np.array([sharded_numel(p, n, d) for p, n, d in zip(trace.params, shards, on, strict=True)],
                                dtype=np.int64)
        self._shard_numel = self._padded // np.array(shards, dtype=np.int64)  # each rank's elements
        self._dim1 = np.array([d != 0 for d in on], dtype=bool)  # the params copied once more each way
        self.stored_shard_bytes = int((self._shard_numel * itemsize("param_bytes")).sum())  # every param's shards
        self._gather = self._padded * itemsize("gather_bytes")
        if float8_gathered:
            at = np.fromiter(float8_gathered, dtype=np.intp)
            self._gather[at] = self._padded[at]
        self._reduce_per = self._padded * (itemsize("reduce_bytes") if reduce_itemsize is None else reduce_itemsize)
        self._grad_per = np.array([p.numel for p in trace.params], dtype=np.int64) * \
            itemsize("compute_bytes")
        if precision is not None and trace.full_precision_params:  # fp32 groups: gathered and computed in fp32
            at = np.fromiter(trace.full_precision_params, dtype=np.intp)
            self._gather[at] = self._padded[at] * FULL_PRECISION_BYTES
            self._grad_per[at] = np.array([trace.params[i].numel for i in at], dtype=np.int64) * FULL_PRECISION_BYTES
        recast = _recast(trace, itemsize("gather_bytes"), itemsize("param_bytes"), cast, float8_gathered,
                         precision is not None)
        self._cast_padded, self._cast_shard = self._padded * recast, self._shard_numel * recast
        self._cast_of: dict[tuple[tuple[int, ...], int], int] = {}
        # a TP view's params whose grad DTensor makes whole on each TP rank: TP times the rank's grad bytes
        self._replicated = {i: int(self._grad_per[i]) for i in trace.replicated_grads}
        self._any_dim1 = bool(self._dim1.any())  # checked per collective: most models have none
        self._gather1 = np.where(self._dim1, self._gather, 0)
        self._grad1 = np.where(self._dim1, self._grad_per, 0)
        self._facts: dict[tuple[str, ...], GroupFacts] = {}
        # param names -> (their indices, the ops reading them, the first backward one): the same at any world size
        self._uses: dict[tuple[str, ...], tuple[tuple[int, ...], list[int], int]] = \
            like._uses if like is not None else {}
        self._reduce: dict[tuple[int, ...], int] = {}
        self._grads: dict[tuple[int, ...], int] = {}
        # a group's dim-1 copies and shard elements, asked for at each of its collectives in every plan it is in
        self._gather1_of: dict[tuple[int, ...], int] = {}
        self._grad1_of: dict[tuple[int, ...], int] = {}
        self._grad1_peak_of: dict[tuple[int, ...], int] = {}
        self._shard_numel_of: dict[tuple[int, ...], int] = {}

    def groups(self, plan: Plan) -> list[GroupFacts]:
        return [self.facts(tuple(g.params)) for g in plan.groups]

    def facts(self, names: tuple[str, ...]) -> GroupFacts:
        if names not in self._facts:
            params, uses, first_bwd = self._usage(names)
            self._facts[names] = GroupFacts(params, self.gather_bytes(params), uses, first_bwd)
        return self._facts[names]

    def _usage(self, names: tuple[str, ...]) -> tuple[tuple[int, ...], list[int], int]:
        if names not in self._uses:
            index = self.trace.index
            param_index, param_uses, first_backward = index.param_index, index.param_uses, index.first_backward_use
            params = tuple(param_index[p] for p in names)
            uses = param_uses[params[0]] if len(params) == 1 else sorted({i for p in params for i in param_uses[p]})
            first_bwd = min((first_backward[p] for p in params), default=len(self.trace.events) + 1)
            self._uses[names] = (params, uses, first_bwd)
        return self._uses[names]

    def group_params(self, plan: Plan) -> list[tuple[int, ...]]:
        """Each group's params as indices into ``Trace.params``."""
        return [f.params for f in self.groups(plan)]

    def gather_bytes(self, params: Iterable[int]) -> int:
        """All-gather output of these params: the bytes they occupy unsharded (padded)."""
        return _sum(self._gather, params)

    def gather_cast_bytes(self, params: tuple[int, ...], ranks: int = 0) -> int:
        """The flat buffer of these params' shards cast to the all-gather dtype, alive beside the all-gather output
        while FSDP2 copies it in (module docstring); ``ranks``: gathered from the post-forward shards over that
        many ranks (an int ``reshard_after_forward``), copied into the buffer all the same."""
        key = (params, ranks)
        if key not in self._cast_of:
            self._cast_of[key] = _sum(self._cast_padded, params) // ranks if ranks else _sum(self._cast_shard, params)
        return self._cast_of[key]

    def reduce_bytes(self, params: tuple[int, ...]) -> int:
        """Reduce-scatter input for these params' grads (padded, reduce dtype)."""
        if params not in self._reduce:
            self._reduce[params] = _sum(self._reduce_per, params)
        return self._reduce[params]

    def grad_bytes(self, params: tuple[int, ...]) -> int:
        """Unsharded grads of these params as autograd makes them (the params' shapes, compute dtype)."""
        if params not in self._grads:
            self._grads[params] = _sum(self._grad_per, params)
        return self._grads[params]

    def grad_bytes_each(self, params: np.ndarray) -> np.ndarray:
        """``grad_bytes((p,))`` of each of ``params`` (param indices), in one array lookup."""
        return self._grad_per[params]

    def replicated_grads(self, params: Iterable[int]) -> list[tuple[int, int, int]]:
        """(param, bytes of its whole grad, of the rank's shard of it) for those of ``params`` whose grad DTensor
        makes whole on each TP rank (``Trace.replicated_grads``, ``sim/tensor_parallel.py``)."""
        if not self._replicated:
            return []
        t = self.trace.tp_degree
        return [(p, self._replicated[p] * t, self._replicated[p]) for p in params if p in self._replicated]

    def tp_local_grads(self, params: tuple[int, ...]) -> tuple[int, ...]:
        """``params`` less those whose grad DTensor makes whole (``replicated_grads``): the params whose unsharded
        grads autograd makes in their TP-local shapes."""
        if not self._replicated or not any(p in self._replicated for p in params):
            return params
        return tuple(p for p in params if p not in self._replicated)

    def shard1_gather_bytes(self, params: Iterable[int]) -> int:
        """The copy-out temporary of these params' all-gather: the unsharded bytes of those sharded on dim > 0."""
        return _cached_sum(self._gather1_of, self._gather1, params) if self._any_dim1 else 0

    def shard1_grad_bytes(self, params: tuple[int, ...]) -> int:
        """The re-laid-out grads of these params sharded on dim > 0 (``torch.cat`` before the copy-in): the bytes
        copied."""
        return _cached_sum(self._grad1_of, self._grad1, params) if self._any_dim1 else 0

    def shard1_grad_peak_bytes(self, params: tuple[int, ...]) -> int:
        """The memory those re-laid-out grads add at their peak: the largest one, each replacing its source."""
        if not self._any_dim1 or not params:
            return 0
        if params not in self._grad1_peak_of:
            self._grad1_peak_of[params] = int(self._grad1[np.fromiter(params, dtype=np.intp)].max())
        return self._grad1_peak_of[params]

    def shard_numel(self, params: Iterable[int]) -> int:
        """Elements of these params each rank holds sharded."""
        return _cached_sum(self._shard_numel_of, self._shard_numel, params)


def _itemsizes(trace: Trace, precision: Precision | None, cast: np.ndarray) -> Callable[[str], np.ndarray]:
    """Per param, the bytes an element of one of the precision's fields (``param_bytes``, ``gather_bytes``, ...)
    takes, else each param's own. FSDP2 casts floating-point params alone (``cast``; FSDPParam.init_dtype_attrs):
    an int or complex param is gathered, computed and reduced in its own dtype whatever the precision. Frozen params
    built in a dtype no trainable param has (a frozen bf16 encoder beside an fp32 model) stay as built: stored so,
    and gathered so where FSDP2's policy casts nothing (``param_dtype`` None)."""
    own = np.array([p.itemsize for p in trace.params], dtype=np.int64)
    trainable = trace.index.trainable_dtypes
    kept = np.array([p.is_floating_point and not p.requires_grad and bool(trainable) and p.dtype not in trainable
                     for p in trace.params], dtype=bool)
    uncast = precision is not None and precision.fsdp_dtypes()[0] is None

    def itemsize(field: str) -> np.ndarray:
        if precision is None:
            return own
        out = np.where(cast, getattr(precision, field), own)
        return np.where(kept, own, out) if field == "param_bytes" or (field == "gather_bytes" and uncast) else out

    return itemsize


def _recast(trace: Trace, gather: np.ndarray, stored: np.ndarray, cast: np.ndarray, float8_gathered: frozenset[int],
            full_precision: bool) -> np.ndarray:
    """Per param, the itemsize of the flat buffer FSDP2's mixed-precision all-gather casts its shards into first
    (``_get_param_all_gather_inputs``), 0 where none: a param gathered in its stored dtype, in float8 (its own
    pre-all-gather) or in an fp32 group."""
    recast = np.where(cast & (gather != stored), gather, 0)
    if float8_gathered:
        recast[np.fromiter(float8_gathered, dtype=np.intp)] = 0
    if full_precision and trace.full_precision_params:
        recast[np.fromiter(trace.full_precision_params, dtype=np.intp)] = 0
    return recast


def _cached_sum(cache: dict[tuple[int, ...], int], per_param: np.ndarray, params: Iterable[int]) -> int:
    """``_sum``, remembered for a tuple of params (a group's: the same sum is asked for at each of its collectives)."""
    if not isinstance(params, tuple):
        return _sum(per_param, params)
    if params not in cache:
        cache[params] = _sum(per_param, params)
    return cache[params]


def _sum(per_param: np.ndarray, params: Iterable[int]) -> int:
    """The sum of ``per_param`` over ``params`` (indices), exact in int64."""
    index = np.fromiter(params, dtype=np.intp) if not isinstance(params, range) else np.arange(
        params.start, params.stop, params.step)
    return int(per_param[index].sum()) if len(index) else 0
