"""The ranges the user's numbers are held to, wherever they come from (a command-line option, an API keyword, a
job config, a Hugging Face config.json or ``--hf-config``, a plan file): one home so every reader refuses the same
values.

The workload a model is traced with: beyond these the factory's tensors overflow torch's int64 sizes (a 16-line
C++ error once) or no machine could hold one micro-batch. 10M tokens is the longest context any model offers.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.userfiles import shown_json

MAX_BATCH = 1_000_000
MAX_SEQ = 10_000_000
MAX_TOKENS = 1_000_000_000  # batch x seq: a micro-batch per rank
MAX_NUMEL = 10**15  # min_nonwrapped_numel: parameters, a thousand times the largest model trained
MAX_SEARCH_EFFORT = 10**9  # search_effort: plans; the default is at most a few thousand
MAX_LOSS_CHUNKS = 1024  # loss_chunks: torchtitan's ChunkedLossWrapper defaults to 8; each chunk a few launches
MIN_MFU = 1e-3  # mfu: below 0.1% of peak no GPU runs, and step times grow past any meaning

# A model's architecture numbers (layers, hidden sizes, heads, vocabulary), from a Hugging Face config.json,
# ``--hf-config KEY=VALUE`` or a plan's ``model.hf_config``: checked before transformers sees them, as cluster figures
# are before a simulation (``num_hidden_layers=99999999999999999999`` made a config build a per-layer list for ever,
# ``num_hidden_layers=-1`` planned a model with no layers).

# (config field names, as transformers' configs spell them, aliases included; the least and the most; what they
# count). Far beyond any published model, small enough that nothing built from them runs for minutes.
RANGES: tuple[tuple[tuple[str, ...], int, int, str], ...] = (
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "num_encoder_layers",
      "encoder_layers", "decoder_layers", "depths"), 1, 2_048, "layers"),  # (DeepNet's 1,000-layer Transformer the
    # deepest published; 10,000 Llama layers took 5 minutes and 3.5 GB to plan titan's way, a trial: 2,048 ~70 s)
    (("hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim",
      "decoder_ffn_dim", "moe_intermediate_size", "head_dim", "d_kv", "kv_lora_rank", "q_lora_rank",
      "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "embedding_size", "embed_dim"), 1, 1 << 20,
     "a hidden size"),
    (("num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "encoder_attention_heads",
      "decoder_attention_heads"), 1, 1 << 16, "attention heads"),
    (("vocab_size",), 1, 1 << 24, "a vocabulary"),
    (("max_position_embeddings", "n_positions", "n_ctx"), 1, 1 << 27, "positions"),
    (("num_local_experts", "n_routed_experts", "num_experts", "n_shared_experts", "num_experts_per_tok"), 0,
     1 << 16, "experts"),
    (("image_size", "patch_size", "num_channels"), 1, 1 << 16, "pixels or channels"),
    (("num_labels",), 1, 1 << 24, "labels"),
)
_BY_NAME = {name: (low, high, what) for names, low, high, what in RANGES for name in names}
MAX_INT = 2**53  # any other whole number of a config: beyond it, no architecture number (a float's exact range)
# the fields whose value may be Infinity, meaning no bound: the upper end of Mamba-2's clamp of its time step
# (transformers' default (0.0, inf), which its configs write as Infinity)
UNBOUNDED = frozenset({"time_step_limit[1]"})


def check_field(name: str, value: Any, where: str) -> None:
    """One config field (``name``, dotted in a sub-config): an architecture number (``RANGES``) is a whole number
    in its range, or null (the architecture's default); any other whole number is at most ``MAX_INT`` in size.
    ``where`` names the source in the message ("--hf-config", "config file 'c.json'"). A list is checked item by
    item, one level deep: Swin's ``num_heads`` and ``depths`` give one number per stage."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, list):
                check_field(f"{name}[{index}]", item, where)
        return
    known = _BY_NAME.get(name.rpartition(".")[2].partition("[")[0])
    # a field name from a file is shown as typed when it is a plain name, else quoted and escaped
    plain = name.rstrip("]0123456789").removesuffix("[")
    shown = name if len(name) <= 100 and plain.replace(".", "_").isidentifier() else shown_json(name)
    unbounded = value == math.inf and name.rpartition(".")[2] in UNBOUNDED
    # (Python's JSON reader takes NaN and Infinity)
    if isinstance(value, float) and not math.isfinite(value) and not unbounded:
        raise PlannerError(f"{where}: {shown} = {shown_json(value)} is not a finite number")
    if known is not None and value is not None:
        low, high, what = known
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlannerError(f"{where}: {shown} = {shown_json(value)} is not a whole number: give one from {low:,} "
                               f"to {high:,} ({what})")
        if not low <= value <= high:
            raise PlannerError(f"{where}: {shown} = {shown_json(value)} is out of range: a whole number from {low:,} "
                               f"to {high:,} ({what})")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise PlannerError(f"{where}: {shown} = {shown_json(value)} is out of range: at most 2^53 in size")


def check_config(data: dict[str, Any], where: str) -> None:
    """Every field of a config and of its sub-configs one level down (a multimodal model's ``text_config``)."""
    for key, value in data.items():
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                check_field(f"{key}.{sub_key}", sub_value, where)
        else:
            check_field(str(key), value, where)

# parallel degrees a plan or an option may give (a TP group inside a node, an EP group of experts): far beyond any
# cluster's, small enough that no loop or message built from them can blow up
MAX_TP_DEGREE = 1024
MAX_EP_DEGREE = 1024
