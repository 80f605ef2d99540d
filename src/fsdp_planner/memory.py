"""Per-rank memory model: params, grads, optimizer state, gathered/cached copies, buffers and activations.

Used by the step simulator and by ``fsdp-planner memory MODEL --world-size N``. The model is analytic: a few
sizes taken from a :class:`~fsdp_planner.trace.Trace` (:func:`sizes_from_trace`) go through one pure function
(:func:`breakdown`) per strategy. 1 GB = 1e9 bytes throughout, as seed 002 reports.

Strategies (ZeRO paper naming; ``fsdp`` is FSDP's name for ZeRO-3 and gets the same row):

- ``single``: one device: params + grads + optimizer state (+ low-precision copies).
- ``ddp``: the same per rank, plus DDP's gradient buckets, one more copy of the grads (seed 002: 16.036 GB vs
  12.035 GB single).
- ``zero1``: optimizer state sharded / world size.
- ``zero2``: grads and optimizer state sharded.
- ``zero3`` / ``fsdp``: params, grads and optimizer state sharded, plus the unsharded working set: by default
  the largest unit gathered twice (current + prefetched) and that unit's unsharded gradient (reduce-scatter
  input). This is FSDP's documented BACKWARD_PRE peak: "the current set of parameters, next set of parameters,
  and current set of gradients". A plan simulation passes its own gathered-param peak instead.

Calibration against seed 002 (10 x Linear(10000, 10000), SGD momentum, one input vector; ``seed-linear10``),
model vs measured, single device: fp32 12.002 vs 12.035 GB, autocast 14.002 vs 14.035 GB, autocast with
``cache_enabled=False`` 12.201 vs 12.235 GB; DDP 16.002 vs 16.036 GB (fp32; the seed's DDP run used
autocast-nocache, which the model puts at 16.202 GB, +1.0%: the seed's DDP figure shows no trace of the 0.2 GB
per-op fp16 copy its single-device run does). The ~0.034 GB left in every figure is
not modelled: the CUDA caching allocator keeps each 400 MB tensor in a segment rounded up to 2 MiB
(+0.56 MB x 30 tensors = 17 MB) and cuBLAS/CUDA keep workspaces; that is 0.3% here. For the seed's
"FSDP 1.524 GB" see :func:`explain_seed_fsdp`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from rich.table import Table

from fsdp_planner.errors import PlannerError
from fsdp_planner.trace import OP, Trace

GB = 1e9  # seed 002 prints memory / 1e9
STRATEGIES: tuple[str, ...] = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp")


# -- precision -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """A named mixed-precision setting; all sizes are bytes per element.

    ``param_bytes``: storage of the (sharded) params the optimizer updates. ``compute_bytes``: dtype the
    forward/backward computes in; FSDP's all-gather dtype (MixedPrecisionPolicy.param_dtype) unless
    ``autocast``, where the all-gather stays at ``param_bytes`` and autocast makes the low-precision copies.
    ``grad_bytes``: the grads the optimizer reads. ``reduce_bytes``: dtype of gradient communication (DDP
    buckets, reduce-scatter input). ``weight_cache``: autocast keeps its low-precision weight copies for the
    whole autocast region (the default ``cache_enabled=True``).
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
    def gather_bytes(self) -> int:
        """Bytes per element of an all-gathered (unsharded) param."""
        return self.param_bytes if self.autocast else self.compute_bytes


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4, 4, 4, 4, description="everything fp32"),
        Precision("bf16-mixed", 4, 2, 4, 4,
                  description="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded "
                              "params and grads, bf16 all-gather and compute"),
        Precision("pure-bf16", 2, 2, 2, 2, description="params, grads and communication in bf16"),
        Precision("autocast", 4, 2, 4, 4, autocast=True, weight_cache=True,
                  description="torch.autocast: fp32 params and grads, fp16/bf16 compute copies, cached"),
        Precision("autocast-nocache", 4, 2, 4, 4, autocast=True, weight_cache=False,
                  description="torch.autocast(cache_enabled=False): compute copies made per op, not kept"),
    )
}


def precision_from_name(name: str) -> Precision:
    """The preset called ``name`` (see ``PRECISIONS``)."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise PlannerError(f"unknown precision '{name}': use one of {', '.join(PRECISIONS)}") from None


# -- optimizer -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer:
    """Optimizer state per trainable param element.

    ``param_dtype_states`` states live in the param storage dtype (SGD's momentum buffer); ``fp32_states``
    are always fp32 (Adam's exp_avg and exp_avg_sq); ``master_copy`` adds an fp32 copy of the weights when the
    params are stored in 16 bits (the ZeRO paper's mixed-precision Adam: 2 + 2 + 12 = 16 bytes/param).
    """

    name: str
    param_dtype_states: int = 0
    fp32_states: int = 0
    master_copy: bool = False

    def state_bytes_per_element(self, param_bytes: int) -> int:
        """Bytes of optimizer state per trainable element for params stored at ``param_bytes``."""
        master = 4 if self.master_copy and param_bytes < 4 else 0
        return self.param_dtype_states * param_bytes + self.fp32_states * 4 + master


OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer("sgd"),
        Optimizer("sgd-momentum", param_dtype_states=1),
        Optimizer("adam", fp32_states=2, master_copy=True),
        Optimizer("adamw", fp32_states=2, master_copy=True),
    )
}


def optimizer_from_name(name: str) -> Optimizer:
    """The optimizer called ``name`` (see ``OPTIMIZERS``)."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise PlannerError(f"unknown optimizer '{name}': use one of {', '.join(OPTIMIZERS)}") from None


# -- breakdown -------------------------------------------------------------------------------------------


@dataclass
class MemoryBreakdown:
    """Bytes per rank at the step's peak, by kind."""

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    unsharded_params: int = 0  # gathered FSDP units, low-precision weight copies / autocast cache
    buffers: int = 0  # DDP gradient buckets, unsharded grads being reduced, model buffers
    activations: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer_state + self.unsharded_params + self.buffers
                + self.activations)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class ModelSizes:
    """The few numbers the memory model needs from a model (element counts unless named bytes)."""

    param_numel: int
    grad_numel: int  # trainable elements
    largest_unit_numel: int = 0  # largest FSDP unit (gathered at once)
    largest_unit_grad_numel: int = 0  # its trainable elements
    largest_param_numel: int = 0  # largest trainable tensor (autocast's per-op copy without the cache)
    activation_bytes: int = 0  # saved for backward, at ``activation_itemsize`` bytes per element
    activation_itemsize: int = 4
    model_buffer_bytes: int = 0  # registered buffers (replicated on every rank)


def sizes_from_trace(trace: Trace, unit_numels: Sequence[int] | None = None,
                     unit_grad_numels: Sequence[int] | None = None) -> ModelSizes:
    """Sizes of a traced model. Units default to the modules that directly own params (per-module wrapping);
    a plan passes its groups' element counts instead."""
    trainable = [p for p in trace.params if p.requires_grad]
    if unit_numels is None:
        units: list[int] = []
        unit_grads: list[int] = []
        for m in trace.owning_modules():
            infos = [trace.param(f) for f in trace.modules[m].params]
            units.append(sum(p.numel for p in infos))
            unit_grads.append(sum(p.numel for p in infos if p.requires_grad))
    else:
        units = list(unit_numels)
        unit_grads = list(unit_grad_numels) if unit_grad_numels is not None else units
    floats = [p for p in trace.params if p.dtype.startswith(("float", "bfloat"))]
    itemsize = max(floats, key=lambda p: p.numel).itemsize if floats else 4
    saved = sum(e.saved for e in trace.events if e.kind == OP and not e.backward)
    return ModelSizes(
        param_numel=trace.numel,
        grad_numel=sum(p.numel for p in trainable),
        largest_unit_numel=max(units, default=0),
        largest_unit_grad_numel=max(unit_grads, default=0),
        largest_param_numel=max((p.numel for p in trainable), default=0),
        activation_bytes=saved,
        activation_itemsize=itemsize,
        model_buffer_bytes=trace.buffers_nbytes,
    )


def _shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def breakdown(strategy: str, sizes: ModelSizes, world_size: int, optimizer: Optimizer, precision: Precision,
              unsharded_peak_bytes: int | None = None) -> MemoryBreakdown:
    """Per-rank peak memory of one strategy (see the module docstring); pure arithmetic.

    ``unsharded_peak_bytes`` (ZeRO-3/FSDP only) replaces the default gathered-param working set (2 x the
    largest unit at the all-gather dtype) with a plan simulation's peak; the unit's unsharded gradient stays
    in ``buffers``.
    """
    if strategy not in STRATEGIES:
        raise PlannerError(f"unknown strategy '{strategy}': use one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise PlannerError(f"world size must be >= 1, got {world_size}")
    w = world_size if strategy != "single" else 1
    p = precision
    params = sizes.param_numel * p.param_bytes
    grads = sizes.grad_numel * p.grad_bytes
    opt = sizes.grad_numel * optimizer.state_bytes_per_element(p.param_bytes)
    sharded = strategy in ("zero3", "fsdp")
    # Low-precision copies of the weights.
    if p.autocast:
        # With the cache every trainable weight's copy lives until autocast exits (seed: +2.0 GB; with FSDP
        # the cache even keeps full copies of resharded params). Without it, the op being differentiated
        # still holds one weight-sized copy next to its fp32 gradient (seed: 12.235 - 12.035 = 0.2 GB).
        copies = (sizes.grad_numel if p.weight_cache else sizes.largest_param_numel) * p.compute_bytes
    elif p.compute_bytes != p.param_bytes and not sharded:
        copies = sizes.param_numel * p.compute_bytes  # a full compute-dtype copy of the unsharded model
    else:
        copies = 0
    activations = sizes.activation_bytes * p.compute_bytes // max(sizes.activation_itemsize, 1)
    out = MemoryBreakdown(params=params, grads=grads, optimizer_state=opt, unsharded_params=copies,
                          buffers=sizes.model_buffer_bytes, activations=activations)
    if strategy == "ddp":
        out.buffers += sizes.grad_numel * p.reduce_bytes  # gradient buckets: one more copy of the grads
    elif strategy == "zero1":
        out.optimizer_state = _shard(opt, w)
    elif strategy == "zero2":
        out.grads, out.optimizer_state = _shard(grads, w), _shard(opt, w)
    elif sharded:
        out.params, out.grads, out.optimizer_state = _shard(params, w), _shard(grads, w), _shard(opt, w)
        gathered = (2 * sizes.largest_unit_numel * p.gather_bytes if unsharded_peak_bytes is None
                    else unsharded_peak_bytes)
        out.unsharded_params += gathered
        out.buffers += sizes.largest_unit_grad_numel * p.reduce_bytes  # the unit's unsharded grad
    return out


def strategy_table(trace: Trace, world_size: int, optimizer: Optimizer, precision: Precision,
                   unsharded_peak_bytes: int | None = None,
                   unit_numels: Sequence[int] | None = None) -> dict[str, MemoryBreakdown]:
    """Per-rank memory of every strategy in ``STRATEGIES`` for ``trace``'s model at ``world_size``.

    ``unit_numels``: element counts of the FSDP units (a plan's groups); default: one unit per module that
    owns params. ``unsharded_peak_bytes``: gathered-param peak from a plan simulation (ZeRO-3/FSDP rows).
    """
    sizes = sizes_from_trace(trace, unit_numels)
    return {s: breakdown(s, sizes, world_size, optimizer, precision, unsharded_peak_bytes)
            for s in STRATEGIES}


# -- CLI table -------------------------------------------------------------------------------------------


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.3f}"


def format_table(rows: Mapping[str, MemoryBreakdown], title: str | None = None) -> Table:
    """A rich table, GB with 3 decimals; ``fsdp`` shares ``zero3``'s row when they are equal."""
    t = Table(title=title)
    for col in ("strategy", "params", "grads", "optimizer", "unsharded/buffers", "activations", "total"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    merged = "fsdp" in rows and "zero3" in rows and rows["fsdp"] == rows["zero3"]
    for name, b in rows.items():
        if merged and name == "fsdp":
            continue
        label = "zero3 / fsdp" if merged and name == "zero3" else name
        t.add_row(label, _gb(b.params), _gb(b.grads), _gb(b.optimizer_state),
                  f"{_gb(b.unsharded_params)} / {_gb(b.buffers)}", _gb(b.activations), _gb(b.total))
    return t


# -- seed 002 --------------------------------------------------------------------------------------------

SEED_002_GB: dict[str, float] = {
    "fp32": 12.035, "autocast": 14.035, "autocast-nocache": 12.235, "ddp": 16.036, "fsdp": 1.524,
}
_SEED_LAYER = 10_000 * 10_000 + 10_000  # one Linear(10000, 10000): weight + bias
_SEED_SIZES = ModelSizes(
    param_numel=10 * _SEED_LAYER, grad_numel=10 * _SEED_LAYER, largest_unit_numel=_SEED_LAYER,
    largest_unit_grad_numel=_SEED_LAYER, largest_param_numel=10_000 * 10_000,
    activation_bytes=10 * 10_000 * 4,  # the input vector of each Linear (what the trace records)
)


def seed_fsdp_gb(world_size: int, gathered_units: int = 2) -> float:
    """Seed 002's FSDP run (fp32, SGD momentum, one unit per Linear) on rank 0, in GB.

    ``gathered_units`` all-gathered Linears are resident at the peak next to the current unit's unsharded
    gradient: 2 = FSDP1's default BACKWARD_PRE (current + next params); 1 = BACKWARD_POST or no prefetch.
    """
    b = breakdown("fsdp", _SEED_SIZES, world_size, OPTIMIZERS["sgd-momentum"], PRECISIONS["fp32"],
                  unsharded_peak_bytes=gathered_units * _SEED_LAYER * 4)
    return b.total / GB


def _pct(gb: float, target: float) -> str:
    return f"{(gb / target - 1) * 100:+.1f}%"


def seed_fsdp_fits(gathered_units: int, tolerance: float = 0.02, max_world_size: int = 1024) -> list[int]:
    """World sizes for which :func:`seed_fsdp_gb` is within ``tolerance`` of the seed's 1.524 GB."""
    target = SEED_002_GB["fsdp"]
    return [w for w in range(1, max_world_size + 1)
            if abs(seed_fsdp_gb(w, gathered_units) / target - 1) <= tolerance]


def explain_seed_fsdp() -> str:
    """Which world size and assumptions give seed 002's 'FSDP 1.524 GB', with the arithmetic."""
    target = SEED_002_GB["fsdp"]
    layer = _SEED_LAYER * 4 / GB
    state = 3 * 10 * _SEED_LAYER * 4 / GB
    act = _SEED_SIZES.activation_bytes / GB

    def exact(units: int) -> float:  # real-valued world size that hits the target
        return state / (target - (units + 1) * layer - act)

    def case(units: int) -> list[str]:
        fits = seed_fsdp_fits(units)
        best = min(fits, key=lambda w: abs(seed_fsdp_gb(w, units) - target)) if fits else round(exact(units))
        pow2 = [w for w in fits if w & (w - 1) == 0]
        near = sorted({2 ** round(math.log2(exact(units))), 2 ** math.floor(math.log2(exact(units))),
                       2 ** math.ceil(math.log2(exact(units)))})
        pct = {w: _pct(seed_fsdp_gb(w, units), target) for w in near}
        out = [
            f"   exact fit W = {exact(units):.2f}; best integer W={best}: {state:.4f}/{best} + "
            f"{(units + 1) * layer:.4f} + {act:.4f} = {seed_fsdp_gb(best, units):.4f} GB "
            f"({_pct(seed_fsdp_gb(best, units), target)})",
            f"   within 2%: W = {fits[0]}..{fits[-1]}" if fits else "   no integer W within 2%",
            "   powers of two: " + ", ".join(
                f"W={w}: {seed_fsdp_gb(w, units):.3f} GB ({pct[w]})" for w in near),
        ]
        out.append(f"   -> power-of-two fits: {pow2}" if pow2 else "   -> no power-of-two W within 2%")
        return out

    at8 = seed_fsdp_gb(8, 0)
    lines = [
        "Seed 002, FSDP: 10 x Linear(10000, 10000), each its own FSDP unit; fp32 (no autocast),",
        "SGD momentum, zero_grad(set_to_none=True), one input vector; max_memory_allocated on rank 0",
        "= 1.524 GB.",
        "The seed does not state the world size W. Per rank at the end of backward (1 GB = 1e9 bytes):",
        f"  sharded params + grads + momentum = 3 x 4.0004 GB / W = {state:.4f} / W",
        f"  + k gathered Linears (1.0001e8 elements x 4 B = {layer:.4f} GB each)",
        f"  + the current unit's unsharded gradient ({layer:.4f} GB, the reduce-scatter input)",
        f"  + activations ({act:.4f} GB: ten 10000-float input vectors).",
        "A) k=2: FSDP1's default backward_prefetch=BACKWARD_PRE holds 'the current set of parameters,",
        "   next set of parameters, and current set of gradients' at the peak (this module's default",
        "   ZeRO-3 working set).",
        *case(2),
        "B) k=1: BACKWARD_POST or no prefetch: the current (or next) params and the current gradient.",
        *case(1),
        f"C) W=8 (one 8-GPU node): the sharded state alone is {state / 8:.4f} GB "
        f"({_pct(state / 8, target)}), a numerical",
        f"   coincidence: FULL_SHARD must hold at least one gathered {layer:.1f} GB Linear or its gradient,",
        f"   so rank 0 peaks at >= {at8:.3f} GB ({_pct(at8, target)}). W=8 does not fit.",
        "Conclusion: under FSDP1's defaults (A) the figure implies W ~ 37 (best integer fit), which is not a",
        "usual cluster size; the closest usual size is W=16 (two 8-GPU nodes) with one gathered unit at the",
        "peak (B). The seed's text cannot settle which one it ran.",
    ]
    return "\n".join(lines)


__all__: Sequence[str] = [
    "GB", "OPTIMIZERS", "PRECISIONS", "STRATEGIES", "MemoryBreakdown", "ModelSizes", "Optimizer", "Precision",
    "breakdown", "explain_seed_fsdp", "format_table", "optimizer_from_name", "precision_from_name",
    "seed_fsdp_fits", "seed_fsdp_gb", "sizes_from_trace", "strategy_table",
]
