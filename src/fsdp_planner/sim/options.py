"""How the step is run, and the one set of defaults every command uses.

Defaults (``SimOptions()``): ``bf16-mixed`` precision (FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``: fp32 sharded params and grads, bf16 all-gather and compute, fp32 reduce-scatter), the
AdamW optimizer (two states per trainable element in the params' dtype, fp32 here; torch's foreach implementation,
what a loop's own ``torch.optim.AdamW(params)`` runs on CUDA; ``adamw-fused`` is torchtitan's and Hugging Face
Trainer's default), ``zero_grad()`` with its default ``set_to_none=True``, and each op at the cluster's roofline.
To reproduce a measurement made another way, say so explicitly (e.g. ``--precision fp32 --optimizer sgd-momentum``
for an fp32 run with SGD and momentum).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fsdp_planner.arguments import check_fields, check_value
from fsdp_planner.choices import (
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    REDUCE_BYTES,
    GradientSync,
    ReduceDtype,
    ShardPlacement,
    ZeroGrad,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.sim.optimizer_step import STEP_BYTES, STEP_TEMPORARIES

PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4, 4, 4, 4, description="everything fp32"),
        Precision("bf16-mixed", 4, 2, 4, 4,
                  description="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 sharded params "
                              "and grads, bf16 all-gather and compute"),
        Precision("pure-bf16", 2, 2, 2, 2, description="params, grads and communication in bf16"),
        Precision("autocast", 4, 2, 4, 4, autocast=True, weight_cache=True,
                  description="torch.autocast: fp32 params and grads, fp16/bf16 compute copies, cached"),
        Precision("autocast-nocache", 4, 2, 4, 4, autocast=True, weight_cache=False,
                  description="torch.autocast(cache_enabled=False): compute copies made per op, not kept"),
    )
}


@dataclass(frozen=True)
class Optimizer:
    """Optimizer state per trainable param element, and the HBM traffic of its step.

    ``step_bytes``: what one ``step()`` reads and writes from HBM per fp32 element of the rank's trainable shard
    (torch's foreach implementation, its default on CUDA, or with ``fused`` its fused kernel; counted in
    ``sim/optimizer_step.py``); ``step_temporaries``: tensors of one state's size per element that the step makes
    and holds at once (foreach Adam's square roots).
    ``states`` tensors of a param's size, each ``state_bytes`` an element; None: the params' dtype, as torch's
    optimizers make them with ``torch.zeros_like(param)`` (SGD's momentum buffer; Adam's exp_avg and exp_avg_sq,
    ``torch/optim/adam.py`` ``_init_group``), so under pure-bf16 they are bf16 and no fp32 master copy exists.
    torchtitan's ``fused_opt_states_bf16`` makes Adam's two in bf16 beside fp32 params (a step pre-hook that fills
    the state before ``_init_group`` does; the fused CUDA kernel's mixed-precision path).
    """

    name: str
    step_bytes: int
    states: int = 0
    state_bytes: int | None = None
    fused: bool = False  # ``fused=True`` (else foreach)
    step_temporaries: int = 0

    def state_bytes_per_element(self, param_bytes: int) -> int:
        return self.states * (self.state_bytes or param_bytes)

    def step_temporary_bytes(self, param_bytes: int) -> int:
        """Bytes per trainable element of what the step holds beyond the state (in the states' dtype)."""
        return self.step_temporaries * (self.state_bytes or param_bytes)


BF16_BYTES = 2
OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer("sgd", STEP_BYTES["sgd"]),
        Optimizer("sgd-momentum", STEP_BYTES["sgd-momentum"], states=1),
        Optimizer("adam", STEP_BYTES["adam"], states=2, step_temporaries=STEP_TEMPORARIES["adam"]),
        Optimizer("adamw", STEP_BYTES["adamw"], states=2, step_temporaries=STEP_TEMPORARIES["adamw"]),
        Optimizer("adam-fused", STEP_BYTES["adam-fused"], states=2, fused=True),
        Optimizer("adamw-fused", STEP_BYTES["adamw-fused"], states=2, fused=True),
        Optimizer("adam-fused-bf16-states", STEP_BYTES["adam-fused-bf16-states"], states=2, state_bytes=BF16_BYTES,
                  fused=True),
        Optimizer("adamw-fused-bf16-states", STEP_BYTES["adamw-fused-bf16-states"], states=2,
                  state_bytes=BF16_BYTES, fused=True),
    )
}


def precision_named(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise PlannerError(f"unknown precision '{name}': use one of {', '.join(PRECISIONS)}") from None


def optimizer_named(name: str) -> Optimizer:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise PlannerError(f"unknown optimizer '{name}': use one of {', '.join(OPTIMIZERS)}") from None


def with_reduce_dtype(precision: Precision, reduce: ReduceDtype | None) -> Precision:
    """``precision`` with the user's ``MixedPrecisionPolicy.reduce_dtype``: it sets the reduce-scatter's bytes and
    the dtype of its input buffer. None, or the dtype it already has: unchanged."""
    if reduce is None or REDUCE_BYTES[reduce] == precision.reduce_bytes:
        return precision
    if precision.autocast:  # autocast runs FSDP2 without a MixedPrecisionPolicy (Precision.fsdp_dtypes)
        raise PlannerError(f"--reduce-dtype needs an FSDP2 mixed precision; {precision.name} casts outside FSDP2")
    # the name stays the precision's (a plan records it, and its reduce dtype apart)
    return replace(precision, reduce_bytes=REDUCE_BYTES[reduce],
                   description=f"{precision.description}; grads reduced in {reduce.value}")


@dataclass(frozen=True)
class SimOptions:
    """The training step being costed: precision, optimizer, how grads are cleared and how fast matmuls run, and
    FSDP2's memory options: ``offload`` (``CPUOffloadPolicy``) and where params are sharded (``shard_placement``)."""

    # None: the cluster's roofline (``hardware.cluster.Compute``); a number: every op's FLOPs at that fraction of the
    # dense peak, bytes at the full HBM bandwidth (``--mfu``, the single-constant model kept for old figures)
    mfu: float | None = None
    precision: Precision = field(default_factory=lambda: PRECISIONS[DEFAULT_PRECISION])
    optimizer: Optimizer = field(default_factory=lambda: OPTIMIZERS[DEFAULT_OPTIMIZER])
    zero_grad: ZeroGrad = ZeroGrad.NONE
    # forward + backward passes per optimizer step (gradient accumulation, ``gradient_sync``: simulate.py);
    # the trace is of one micro-batch
    micro_batches: int = 1
    # with micro_batches > 1: False is set_reshard_after_backward(False) on all but the last micro-batch, groups
    # kept unsharded between them (no re-all-gather before their first forward use)
    reshard_after_backward: bool = True
    # with micro_batches > 1: which micro-batches' backwards reduce-scatter (``GradientSync``)
    gradient_sync: GradientSync = GradientSync.LAST
    offload: bool = False
    shard_placement: ShardPlacement = ShardPlacement.DIM0
    reduce_dtype: ReduceDtype | None = None  # the user's MixedPrecisionPolicy.reduce_dtype, applied to ``precision``
    float8: Float8 | None = None  # float8 training of the converted Linears (--float8; ``sim/float8.py``)
    # torch.utils.checkpoint's early_stop (--no-early-stop: False, each checkpointed forward re-run whole, as
    # torchtitan runs it); a plan simulated so records it (``Plan.checkpoint_early_stop``)
    checkpoint_early_stop: bool = True

    def __post_init__(self) -> None:
        check_fields(self, f": {type(self).__name__}.named(precision=..., optimizer=..., ...) takes their names")
        if self.mfu is not None and (isinstance(self.mfu, bool) or not isinstance(self.mfu, int | float)
                                     or not 0 < self.mfu <= 1):
            raise PlannerError(f"the MFU must be in (0, 1], got {self.mfu!r}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise PlannerError(f"a step has at least one micro-batch, got {self.micro_batches!r}")

    @classmethod
    def named(cls, precision: str = DEFAULT_PRECISION, optimizer: str | None = None,
              mfu: float | None = None, zero_grad: str = ZeroGrad.NONE.value, micro_batches: int = 1,
              reshard_after_backward: bool = True, offload: bool = False,
              shard_placement: str = ShardPlacement.DIM0.value, reduce_dtype: str | None = None,
              gradient_sync: str = GradientSync.LAST.value, float8: Float8 | None = None,
              early_stop: bool = True) -> SimOptions:
        def named(value: object, kind: type, key: str) -> object:  # (one sentence naming the choices)
            return check_value(value, kind, f"SimOptions.named's {key}")

        reduce = named(reduce_dtype, ReduceDtype, "reduce_dtype") if reduce_dtype else None
        return cls(mfu=mfu, precision=with_reduce_dtype(precision_named(precision), reduce),
                   # None: not named (the command line's --optimizer not given, and no job config's)
                   optimizer=optimizer_named(DEFAULT_OPTIMIZER if optimizer is None else optimizer),
                   zero_grad=named(zero_grad, ZeroGrad, "zero_grad"), micro_batches=micro_batches,
                   reshard_after_backward=reshard_after_backward, offload=offload,
                   shard_placement=named(shard_placement, ShardPlacement, "shard_placement"), reduce_dtype=reduce,
                   gradient_sync=named(gradient_sync, GradientSync, "gradient_sync"), float8=float8,
                   checkpoint_early_stop=early_stop)

    def with_memory_options(self, offload: bool, placement: ShardPlacement) -> SimOptions:
        """These options with FSDP2's offload and shard placement set (auto's way out when nothing fits)."""
        return replace(self, offload=offload, shard_placement=placement)


def with_early_stop(plan: Plan, options: SimOptions) -> Plan:
    """``plan`` as ``options`` run it: checkpointing without early stop where they ask for it (``--no-early-stop``),
    which the recomputations and FSDP2's replay of them read off the plan."""
    if plan.checkpoint_early_stop and not options.checkpoint_early_stop:
        return replace(plan, checkpoint_early_stop=False)
    return plan


def plan_options(plan: Plan, options: SimOptions) -> SimOptions:
    """The options a plan runs under: what it records (offload, dims other than 0, the reduce dtype, float8,
    checkpointing without early stop)
    added to ``options``. A plan's ``shard_dims`` are simulated as ``ShardPlacement.AUTO``'s rule
    (``check_shard_dims``)."""
    # the user's --reduce-dtype (already in ``options.precision``) wins over the one the plan recorded
    reduce = options.reduce_dtype or (ReduceDtype(plan.reduce_dtype) if plan.reduce_dtype else None)
    return replace(options, offload=options.offload or plan.offload,
                   shard_placement=ShardPlacement.AUTO if plan.shard_dims else options.shard_placement,
                   precision=with_reduce_dtype(options.precision, reduce), reduce_dtype=reduce,
                   float8=options.float8 or plan.float8,
                   checkpoint_early_stop=options.checkpoint_early_stop and plan.checkpoint_early_stop)
