"""Where a plan's tensor-parallel layout comes from: torchtitan's Llama convention for the built-in Llama models
(``torchtitan/models/llama3/parallelize.py``'s ``apply_tp``: sequence parallelism around the norms, colwise then
rowwise Linears in attention and the feed-forward, a vocab-sharded embedding and output)."""

from __future__ import annotations

from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle

_LLAMA_BLOCK = {
    "attention_norm": TPStyle.SEQUENCE_PARALLEL,
    "attention": TPStyle.GATHER_INPUT,
    "attention.wq": TPStyle.COLWISE,
    "attention.wk": TPStyle.COLWISE,
    "attention.wv": TPStyle.COLWISE,
    "attention.wo": TPStyle.ROWWISE_SEQUENCE,
    "ffn_norm": TPStyle.SEQUENCE_PARALLEL,
    "feed_forward": TPStyle.GATHER_INPUT,
    "feed_forward.w1": TPStyle.COLWISE,
    "feed_forward.w2": TPStyle.ROWWISE_SEQUENCE,
    "feed_forward.w3": TPStyle.COLWISE,
}


def titan_llama_layout(degree: int, loss_parallel: bool = True) -> TensorParallel:
    """torchtitan's TP of a Llama (``models/llama.py``'s module names), with sequence parallelism; loss parallel is
    torchtitan's default (``parallelism.disable_loss_parallel`` false)."""
    layout = {"tok_embeddings": TPStyle.EMBEDDING_SEQUENCE, "norm": TPStyle.SEQUENCE_PARALLEL,
              "output": TPStyle.SEQUENCE_COLWISE}
    layout.update({f"layers.*.{name}": style for name, style in _LLAMA_BLOCK.items()})
    return TensorParallel(degree, layout, loss_parallel=loss_parallel)
