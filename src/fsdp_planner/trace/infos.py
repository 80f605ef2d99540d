"""What a trace knows about the model itself: one ``ParamInfo`` per parameter, one ``ModuleInfo`` per module
object. ``records.Trace`` holds them beside the step's events, and ``index.TraceIndex`` derives views from them."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_planner.trace.tree import depth


@dataclass(frozen=True)
class ParamInfo:
    """One ``nn.Parameter`` (tied aliases share one entry)."""

    fqn: str  # canonical name: the first in named_parameters() order
    numel: int
    dtype: str
    itemsize: int
    requires_grad: bool
    owners: tuple[str, ...]  # canonical names of the modules registering it directly; more than one: tied
    aliases: tuple[str, ...] = ()  # its other names
    shape: tuple[int, ...] = ()
    gets_grad: bool = True  # autograd gave it a gradient in the traced step (FSDP2 reduce-scatters only those)

    @property
    def is_floating_point(self) -> bool:
        """A real floating-point dtype (not an int, bool or complex one): what mixed precision casts."""
        return self.dtype.startswith(("float", "bfloat"))

    def padded_numel(self, world_size: int) -> int:
        """Numel after FSDP2 pads dim 0 to a multiple of the world size (its all-gather size)."""
        if not self.shape:
            return self.numel if world_size == 1 else world_size
        rest = self.numel // self.shape[0] if self.shape[0] else 0
        return -(-self.shape[0] // world_size) * world_size * rest

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_shared(self) -> bool:
        return len(self.owners) > 1


@dataclass(frozen=True)
class ModuleInfo:
    """One module object of the model, under its canonical name. FLOPs include its subtree's (by name)."""

    fqn: str
    cls: str
    params: tuple[str, ...]  # canonical names of the params registered directly on it
    children: tuple[str, ...] = ()  # canonical names of its child module objects (a shared child: elsewhere)
    aliases: tuple[str, ...] = ()  # its other names (a module object registered under several parents)
    calls: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    first_use: int = -1  # first forward op run inside its subtree that read a param; -1 if none
    shardable: bool = True  # False: a ModuleList/ModuleDict without its own forward, which fully_shard refuses, or
    # a module managing params whose call modifies its grad-requiring inputs in place, which FSDP2's post-backward
    # function on them makes autograd refuse (see summary._fsdp2_refuses_inplace), or pops from (appends to) a list
    # its caller gave it, of which FSDP2's pre-forward gives the call a copy (``hooks.ModuleHooks.post_forward``)
    torch_class: str = ""  # "Linear" / "Embedding" for an instance of nn.Linear / nn.Embedding (a subclass too):
    # the modules torch's ColwiseParallel and RowwiseParallel shard; "" for any other
    plain_torch_class: bool = False  # an instance of ``torch_class`` itself, not a subclass (float8 converts only
    # plain nn.Linear: a subclass's own forward would be dropped by the swap)
    running_stats: bool = False  # a norm that updates running statistics in its training forward (BatchNorm):
    # a checkpointed call's recomputation updates them again
    aliased_inputs: bool = False  # an nn.MultiheadAttention a call of which was given one grad-requiring tensor as
    # query and key (self-attention), which FSDP2's pre-forward hands a module it shards as distinct tensors: it
    # then projects q, k and v apart instead of packed, another step than traced (other modules run alike)
    output_modified: bool = False  # an op after a forward call returned modified its output in place (Llama 4's
    # MoE adds the routed experts' sum into its shared expert's output): no TP style can make that output, whose
    # local tensor autograd refuses to modify in place
    topk_modified: bool = False  # a topk of its forward had its outputs modified in place after (transformers' Qwen
    # MoE routers divide the top-k weights in place): op-level checkpointing saving topk fails there
    input_dims: int = -1  # dims of the first tensor its first traced call was given (-1: none, or a call replayed
    # from an identical block's): EP's dispatch sends an experts module a 3-D (experts, rows, dim) block
    from_transformers: bool = False  # its class is transformers' (whose experts layers run transformers' own EP)
    records_outputs: bool = False  # a transformers model whose class lists outputs to record
    # (``_can_record_outputs``: hidden states, attentions), which transformers looks up by str(module.__class__)

    @property
    def unused(self) -> bool:
        """No forward op reads its subtree's params. In a list group such a module leaves the group's forward
        incomplete, which the root's post-forward completes by hooking the group's pre-backward on each of the
        root's outputs: an output whose grad arrives after the group's post-backward (hidden states a loss also
        reads) gathers the group again, one all-gather the replay does not make (measured on a new user's model)."""
        return self.first_use < 0

    @property
    def depth(self) -> int:
        return depth(self.fqn)
