"""The step as a sequence of events: module boundaries (where FSDP2's hooks run) and aten ops."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class EventKind(Enum):
    """What happened, in the order FSDP2 sees it (its hooks run at the four boundaries)."""

    FWD_PRE = "fwd_pre"  # a module call starts its forward (FSDP2: pre_forward)
    FWD_POST = "fwd_post"  # ... finishes it (post_forward)
    BWD_PRE = "bwd_pre"  # the first grad of that call's outputs is ready (pre_backward)
    BWD_POST = "bwd_post"  # the grads of its inputs are ready (post_backward)
    OP = "op"  # one aten op


class OpClass(Enum):
    """What an op-level selective checkpointing policy tells apart in an aten op (``trace/ops.op_class``): the
    op classes of torchtitan's save lists, and the loss ops that loss parallel runs otherwise; the rest OTHER."""

    OTHER = 0
    MM = 1  # aten.mm: what nn.Linear runs without a bias (every second one is recomputed)
    SDPA = 2  # fused attention: flash or memory-efficient (attention.py runs them on planned tensors)
    SDPA_MORE = 3  # cuDNN, math and "overrideable" SDPA: in torchtitan's later list only
    REDUCE_SCATTER = 4  # _c10d_functional.reduce_scatter_tensor (tensor parallelism inside a block)
    MAX = 5  # aten.max: float8's amax
    # the loss's ops that ``loss_parallel()`` runs through DTensor handlers of its own, which allocate otherwise than
    # aten's kernels (``sim/tensor_parallel.py``); no save list names them
    LOG_SOFTMAX = 6  # aten._log_softmax
    NLL_LOSS_BACKWARD = 7  # aten.nll_loss_backward
    LOG_SOFTMAX_BACKWARD = 8  # aten._log_softmax_backward_data
    # in torchtitan's list of 2026 only (it saves AOTAutograd's compute-intensive ops): aten.addmm (a Linear with a
    # bias), bmm, _scaled_mm (called directly: torchao's Float8Linear shows SAC an aten.mm on its tensor subclass),
    # convolution and upsample_bilinear2d, each saved, none counted
    COMPUTE_MORE = 9
    TOPK = 10  # aten.topk: a router's choice of experts, saved so that the recomputation cannot choose others
    ALL_TO_ALL = 11  # _c10d_functional.all_to_all_single: EP's dispatch and combine (sim/expert_parallel.py)
    # aten.mm of a weight shaped as a router gate's (``trace/ops.router_shapes``): torchtitan's 2026 policy
    # recomputes it uncounted, the others take it for any mm
    ROUTER_MM = 12
    # an op making a boolean attention mask the memory-efficient kernel's additive bias (``attention.py``): batch x
    # 1 x query x key, no head in it, so tensor parallelism runs it (and saves its bias) whole on every rank
    ATTENTION_MASK = 13


KERNEL_OTHER = 0
KERNEL_ATTENTION = -1
# a causal fused attention kernel (``is_causal``): it skips the blocks above the diagonal, about half the FLOPs that
# torch's FLOP counter counts for it ("We aren't accounting for causal attention here", torch/utils/flop_counter.py)
KERNEL_CAUSAL_ATTENTION = -7
ATTENTION_KERNELS = (KERNEL_ATTENTION, KERNEL_CAUSAL_ATTENTION)
# tensor parallelism's collectives, put into the step by ``sim/tensor_parallel.py`` as ops on the compute stream
# (eager DTensor waits on them): ``Event.nbytes`` is the collective's size as nccl-tests counts it
KERNEL_TP_ALL_GATHER = -2
KERNEL_TP_REDUCE_SCATTER = -3
KERNEL_TP_ALL_REDUCE = -4
# a replicated param's partial grad made whole over TP: in FSDP2's post-backward of a micro-batch that reduce-scatters
# (``FSDPParam._get_grad_inner_tensor``), none in one that accumulates
KERNEL_TP_GRAD_ALL_REDUCE = -6
TP_KERNELS = (KERNEL_TP_ALL_GATHER, KERNEL_TP_REDUCE_SCATTER, KERNEL_TP_ALL_REDUCE, KERNEL_TP_GRAD_ALL_REDUCE)
# expert parallelism's all-to-all (dispatch, combine and their backwards), put into the step by
# ``sim/expert_parallel.py`` as an op on the compute stream: ``Event.nbytes`` is one rank's send buffer
KERNEL_EP_ALL_TO_ALL = -5
# the copy funcol makes of a sequence-dim TP collective's whole tensor (NCCL works on dim 0), put into a TP rank's step
# by ``sim/tensor_parallel.py`` beside its collective: a memory-bound op of the compute stream that compiled blocks'
# fusion leaves as it is (inductor makes a ``cat`` kernel of it, not in a whole-model compile of the block)
KERNEL_TP_RELAYOUT = -8
# Gated DeltaNet's chunked linear attention as flash-linear-attention's kernels run it (``linear_attention.py``):
# its FLOPs at a share of a fused attention kernel's efficiency
KERNEL_LINEAR_ATTENTION = -9
# Mamba-2's conv and chunked-scan kernels as mamba_ssm runs them (``mamba_scan.py``): FLOPs at the matmul efficiency,
# bytes at the memory one, as a matmul's; never fused by inductor
KERNEL_MAMBA_SCAN = -10
# Mamba-1's selective scan as mamba_ssm's CUDA kernel runs it (``selective_scan.py``): memory-bound, timed by its
# bytes; never fused by inductor
KERNEL_SELECTIVE_SCAN = -11


class OwnCall(NamedTuple):
    """A module call the model's own ``torch.utils.checkpoint`` holds: outermost in the ``region``-th region (0-based,
    in forward order; ``checkpoint_sequential``'s segment holds several calls), ``reentrant`` or not."""

    module: str
    call: int
    reentrant: bool
    region: int


class Event(NamedTuple):
    """One step of the timeline: a module boundary or an op. (A NamedTuple: a trace holds hundreds of thousands.)"""

    kind: EventKind
    module: str  # boundary: the module; op: the innermost module running
    call: int = 0  # which call of ``module`` (0-based); boundaries only
    params: tuple[int, ...] = ()  # op: indices into Trace.params that it read
    flops: int = 0
    nbytes: int = 0  # op: bytes read + written (for memory-bound ops)
    saved: int = 0  # op (forward): activation bytes it saved for backward
    grad_inputs: bool = True  # FWD_PRE: whether any input requires grad (else post-backward runs at the end)
    backward: bool = False
    live: int = 0  # op outside every module call (the loss and its backward): bytes of the loss's tensors alive
    # after it (the model's outputs, what the loss ops made and have not freed; ``step.LossRegion``); forward op
    # inside the model: bytes of its temporaries alive after it (made, not saved, no call's input; ``step.Temporaries``)
    inputs_nbytes: int = 0  # FWD_PRE: bytes of the call's tensor inputs first seen here (what a checkpoint of
    # the call keeps alive instead of its activations); params, buffers and storages an earlier call took are 0
    kept_inputs: int = 0  # FWD_PRE: bytes of the call's tensor inputs a checkpoint of it keeps alive: as
    # ``inputs_nbytes``, and those a paramless call or a running ancestor took first (``StepRecorder.call_inputs``);
    # not the batch, which ``Trace.inputs_nbytes`` holds all step
    op_class: OpClass = OpClass.OTHER  # forward op (and the loss's backward ops): what a selective checkpointing
    # policy sees (``OpClass``)
    out_nbytes: int = 0  # forward op (and the loss's backward ops): bytes of its outputs' storages (what such a
    # policy keeps when it saves it)
    packs: bool = False  # forward: a tensor (any, a param or a storage saved before too) was packed for backward
    # after this event and before the next (an op's outputs, or the next op's inputs, which autograd saves before
    # running it): a checkpoint's recomputation stops after the last such pack (``CheckpointedCall.stop``)
    kernel: int = 0  # op: which kind of GPU kernel runs it, for the compute model (``sim/compute.py``): k > 0 a
    # matmul whose smallest dim (of M, N, K) is k; ``KERNEL_ATTENTION`` a fused attention kernel (forward or
    # backward), ``KERNEL_CAUSAL_ATTENTION`` a causal one; ``KERNEL_OTHER`` anything else (its FLOPs, if any, at
    # the matmul rate; its bytes at HBM's)
    grad_live: int = 0  # backward op inside the model: bytes of the gradients it reads and makes (the gradient
    # flowing in and the one flowing out, alive together while it runs; ``trace/ops.py``)
    workspace: int = 0  # backward op: bytes its CUDA kernel allocates for itself while it runs (``workspaces.py``),
    # in its own accumulate dtype: neither scaled to the compute dtype nor held on CPU ranks
    held: int = 0  # FWD_POST: bytes of the storages its forward made that were alive and not saved for backward at
    # its last pack (its frame's locals and temporaries), plus its grad-requiring outputs' (their gradients, alive
    # when its backward starts): what a recomputation of the call holds besides its saved activations when it
    # stops (``sim/recompute.py``); the root call's is 0 (never checkpointed)
    freed: int = 0  # backward op: bytes of activations saved in the forward of the module call whose backward runs
    # it, which autograd freed once this op's node ran (it releases a node's saved tensors then): freed here, not
    # when that call's backward is done (``sim/recompute.py``)
    rise: int = 0  # FWD_POST: how much more than at its last pack (its saves and ``held``'s frame) the call's
    # forward held at the height of its ops before then: what its recomputation holds mid-way (a BatchNorm's fp32
    # output beside its input and its bf16 cast, freed before the last pack) beyond what it holds when it stops
    saved_inputs: int = 0  # FWD_POST: bytes of the call's kept inputs (``kept_inputs``) that its ops saved first: a
    # checkpoint of it keeps them, and its recomputation saves the same storages again, not copies
    resaved: tuple[tuple[int, int, int], ...] = ()  # forward op: (position of the event before the first save,
    # which storage first saved from there, bytes) of each storage saved before that it (or the op before it,
    # packing its inputs) saves again: a checkpointed
    # call's output a pooling op or the next layer outside it saves, which the call's recomputation does not
    # re-create in its place (``sim/recompute.resave_deltas``)
    made_at: tuple[tuple[int, int], ...] = ()  # FWD_PRE: (position of the forward op that made it, bytes) of each of
    # the call's kept inputs (``kept_inputs``) an op of a class an op-level policy can keep (``OpClass`` other than
    # OTHER) made; forward op: the same of each storage it saves first that a call running took as its input (the
    # next module's save of a block's output). Where a checkpointed call keeps that op, SAC's cache holds the storage
    # from it: one storage, not a second beside the cache (``sim/recompute.shared_deltas``)
    syncs: bool = False  # op: the host reads its output (the size nonzero or a boolean index makes, ``.item()``, a
    # copy to the CPU: what the routing stand-in answers, ``routing.py``), so on a GPU it waits for the op to finish
    # before launching more: the host's lead is gone there (``sim/streams.py``)
    passed: tuple[int, ...] = ()  # FWD_PRE: params given to the call as arguments (``self.borrower(h,
    # self.mix.weight)``): the caller read them before the call's hooks ran, so FSDP2 must have their groups
    # unsharded then (``fsdp2/validity.py``)

    @property
    def is_op(self) -> bool:
        return self.kind is EventKind.OP
