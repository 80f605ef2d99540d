"""The names a user chooses among: policies, targets, activation checkpointing, precisions, optimizers, how grads
are cleared, export formats, and the simulation's defaults.

Defined here, with nothing heavier than ``enum``, so the command line's parser (its ``choices`` and help) is built
without importing torch; the modules that act on a name (``planners/registry.py``, ``sim/options.py``, ...)
import it from here.
"""

from __future__ import annotations

from enum import Enum


class PolicyName(Enum):
    MODULE = "module"
    SIZE = "size"
    TITAN = "titan"
    ORDER = "order"
    AUTO = "auto"


POLICY_NAMES = tuple(p.value for p in PolicyName)


class Target(Enum):
    """What the plan will be applied with."""

    FSDP2 = "fsdp2"  # fully_shard: list groups, int reshard_after_forward, explicit prefetch
    FSDP1 = "fsdp1"  # FullyShardedDataParallel: one module per unit, uniform dtype and requires_grad per unit


class ACMode(Enum):
    """``--ac``: which blocks are checkpointed, and how (``fsdp2/checkpointing.py``)."""

    NONE = "none"
    FULL = "full"  # every block in full
    OP = "op"  # every block with op-level selective checkpointing (torchtitan's selective_ac_option = "op")
    SELECTIVE = "selective"  # every second block in full: torchtitan's layer-level option "2", which it removed;
    # kept under its old name so that commands and plans that say it mean what they meant
    OFFLOAD = "offload"  # no checkpointing: every block's saved activations go to the host (save_on_cpu)


class Offloaded(Enum):
    """Beside a checkpointing policy in the simulator's per-module list (``checkpointing.plan_checkpointing``):
    the module is not checkpointed, its saved activations are offloaded to the host."""

    HOST = "host"


class SacPolicy(Enum):
    """Which ops' outputs an op-level selective checkpoint keeps (``fsdp2/selective.py`` lists them)."""

    TITAN = "titan"  # torchtitan's SelectiveAC of 2026, for every model (its list before: titan-2025)
    TITAN_2025 = "titan-2025"  # torchtitan's llama3 save list of 2025
    TITAN_EARLY = "titan-early"  # its first save list (2024)


SAC_POLICY_NAMES = tuple(p.value for p in SacPolicy)
# torchtitan's SelectiveAC.Config default force_recompute_mm_shapes_by_fqns (b5bcd76): the mm of a weight shaped as
# a Linear whose name holds one of these is recomputed, uncounted (``fsdp2/selective.py``)
TITAN_RECOMPUTE_FQNS = ("moe.router.gate",)


class Float8Recipe(Enum):
    """``--float8``: torchao's float8 training recipe for the converted Linears (``fsdp2/float8.py``)."""

    TENSORWISE = "tensorwise"  # one dynamic scale per tensor (torchao's default; FSDP2's float8 all-gather needs it)
    ROWWISE = "rowwise"  # one scale per row (axiswise), power-of-2 scales; the weights all-gathered in bf16


FLOAT8_RECIPES = tuple(r.value for r in Float8Recipe)
DEFAULT_SAC_POLICY = SacPolicy.TITAN


class ZeroGrad(Enum):
    """How the training loop clears grads between steps (``optimizer.zero_grad(set_to_none=...)``)."""

    NONE = "none"  # set_to_none=True, the default since torch 2.0: sharded grads exist from their reduce-scatter
    ZEROS = "zeros"  # set_to_none=False: sharded grads live all step, each reduce-scatter output is added in


class GradientSync(Enum):
    """Which micro-batches of a gradient-accumulation step reduce-scatter their grads (``--gradient-sync``;
    FSDP2's ``set_requires_gradient_sync``)."""

    LAST = "last"  # set_requires_gradient_sync(False) on all but the last: unsharded grads kept between them
    EVERY = "every"  # never disabled (torchtitan's train_step): each backward reduce-scatters into the sharded grads


GRADIENT_SYNC_NAMES = tuple(g.value for g in GradientSync)


class ExpertPlacement(Enum):
    """Where FSDP2 shards the routed experts of an EP plan (``--ep-placement``; the plan's
    ``expert_parallel.per_param_mesh``)."""

    BLOCKS = "blocks"  # in their blocks' fully_shard calls on a per-param mesh (torchtitan since 2026-03)
    OWN = "own"  # each experts module fully_shard-ed alone (torchtitan before): kept unsharded apart from its block


EXPERT_PLACEMENT_NAMES = tuple(p.value for p in ExpertPlacement)


class ShardPlacement(Enum):
    """Which dim ``fully_shard(shard_placement_fn=...)`` shards a param on."""

    DIM0 = "dim0"  # FSDP2's default: Shard(0), dim 0 padded to a multiple of the shard size
    AUTO = "auto"  # Shard(1) where dim 0 is smaller than the shard size and dim 1 divides evenly (torchtitan's MoE
    # experts rule); Shard(0) elsewhere


class ReduceDtype(Enum):
    """``MixedPrecisionPolicy.reduce_dtype``: the dtype grads are reduce-scattered in (it changes numerics, so only
    the user changes it)."""

    FP32 = "fp32"
    BF16 = "bf16"


REDUCE_BYTES = {ReduceDtype.FP32: 4, ReduceDtype.BF16: 2}


class ExportFormat(str, Enum):
    PYTHON = "python"
    ACCELERATE = "accelerate"
    LIGHTNING = "lightning"
    TORCHTITAN = "torchtitan"


class AttentionKernel(Enum):
    """``--attention``: the attention kernel the user's GPU run uses (``attention.py``)."""

    SDPA = "sdpa"  # what F.scaled_dot_product_attention picks on a GPU: flash, or memory-efficient with a mask
    FLASH = "flash"  # flash-attn: the same O(seq) memory; soft-capping and sliding windows too
    EAGER = "eager"  # the math path: the O(seq^2) score matrices saved for backward


ATTENTION_NAMES = tuple(k.value for k in AttentionKernel)

# the GPU kernel packages a plan's figures can assume for linear-time mixers (a plan's ``kernels``), by the name pip
# installs them under -> the module Python imports: without them transformers runs PyTorch references, whose time
# and activations are far above the kernels'
KERNEL_PACKAGES = {"flash-linear-attention": "fla", "mamba-ssm": "mamba_ssm"}


# The keys of ``sim.options.PRECISIONS`` and ``OPTIMIZERS``, in their order (tests/test_cli_start.py keeps them equal).
PRECISION_NAMES = ("fp32", "bf16-mixed", "pure-bf16", "autocast", "autocast-nocache")
OPTIMIZER_NAMES = ("sgd", "sgd-momentum", "adam", "adamw", "adam-fused", "adamw-fused", "adam-fused-bf16-states",
                   "adamw-fused-bf16-states")

DEFAULT_PRECISION = "bf16-mixed"
DEFAULT_OPTIMIZER = "adamw"
