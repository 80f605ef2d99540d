"""Hugging Face transformers models built from a config, never downloaded.

MODEL ``hf:NAME`` is a config shipped with the package (``hf_configs/NAME.json``: the architecture numbers of a
public checkpoint's config.json), ``hf:path/to/config.json`` or ``hf:path/to/model_dir`` (a directory holding a
config.json). The config goes through ``AutoConfig.for_model`` and the task's Auto class (``from_config``), so
nothing is fetched from the Hub and ``HF_HUB_OFFLINE=1`` changes nothing. The task follows the config's
``model_type``: causal LMs get token ids (labels = the ids), encoder-decoders encoder ids and a quarter as many
target ids (as the built-in ``t5-3b``), Whisper-like speech encoder-decoders log-mel frames and target ids, two-tower
image-text models (CLIP, SigLIP) ids and images on their contrastive loss, image classifiers pixel values at the
config's image size and one label per image; the loss is the model's own. Params are fp32 (the precision option
casts them as FSDP2 would) and initialised by transformers under the seed ``load_model`` sets, so every verify rank
builds the same weights.

A training step needs no KV cache, and a cache breaks activation checkpointing (the recomputed forward writes it a
second time: Gemma 2's masks then disagree, T5's checkpoint saves a different number of tensors), so the model is
built with ``use_cache=False``, as transformers' own gradient checkpointing does, unless ``--hf-config
use_cache=true`` asks for it. ``--hf-config KEY=VALUE`` (``overrides``) sets any field the config has.

transformers is the optional extra ``fsdp-planner[hf]``: it is imported only when an ``hf:`` model is asked for.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import fsdp_planner.models.hf_attention as hf_attention
import fsdp_planner.models.hf_experts as hf_experts
from fsdp_planner import linear_attention, mamba_scan, selective_scan
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable
from fsdp_planner.limits import check_config, check_field
from fsdp_planner.patching import TORCHAO_LOGGERS, quiet_loggers
from fsdp_planner.userfiles import MAX_SOURCE_BYTES, parse_json, read_text, shown_json, shown_key

PREFIX = "hf:"
CONFIG_DIR = Path(__file__).with_name("hf_configs")
INSTALL_HINT = "hf: models need Hugging Face transformers: pip install 'fsdp-planner[hf]'"
DEFAULT_SEQ_CAP = 2048  # a user config's default sequence: its maximum position count, at most this
TRAINING_FIELDS = {"use_cache": False}  # what a training step sets unless --hf-config says otherwise
MAX_OVERRIDES = 32  # --hf-config options on one command
MAX_OVERRIDE_CHARS = 200  # a key's or a value's length

# --hf-config values: JSON scalars (true, 3, 0.5, "text"); a value that is no JSON is the string itself.
Scalar = bool | int | float | str | None
Overrides = tuple[tuple[str, Scalar], ...]


class HfTask(Enum):
    CAUSAL_LM = "causal LM"
    SEQ2SEQ_LM = "encoder-decoder LM"
    SPEECH_SEQ2SEQ = "speech encoder-decoder"
    CONTRASTIVE = "image-text contrastive"
    IMAGE_CLASSIFICATION = "image classifier"


@dataclass(frozen=True)
class ShippedConfig:
    """A config in ``hf_configs/``: where its numbers come from and the workload it is planned for by default."""

    description: str
    batch_size: int
    seq_len: int | None = None  # None: the input has no sequence length (images)

    def workload(self) -> dict[str, int]:
        """The factory's default ``batch_size`` and ``seq_len``."""
        return {"batch_size": self.batch_size, **({"seq_len": self.seq_len} if self.seq_len is not None else {})}


SHIPPED: dict[str, ShippedConfig] = {
    "llama3-8b": ShippedConfig("Llama 3 8B (meta-llama/Meta-Llama-3-8B)", 1, 8192),
    "llama3-70b": ShippedConfig("Llama 3 70B (meta-llama/Meta-Llama-3-70B)", 1, 8192),
    "qwen2.5-3b": ShippedConfig("Qwen2.5 3B, tied embeddings (Qwen/Qwen2.5-3B)", 1, 4096),
    "gpt2": ShippedConfig("GPT-2 124M, tied embeddings (openai-community/gpt2)", 8, 1024),
    "mixtral-8x7b": ShippedConfig("Mixtral 8x7B MoE, 8 experts top-2 (mistralai/Mixtral-8x7B-v0.1)", 1, 4096),
    "deepseek-v3": ShippedConfig("DeepSeek-V3 671B MoE, multi-head latent attention, 256 experts top-8 "
                                 "(deepseek-ai/DeepSeek-V3)", 1, 4096),
    "gemma2-9b": ShippedConfig("Gemma 2 9B, soft-capping, sliding windows, tied embeddings (google/gemma-2-9b)", 1,
                               2048),
    "t5-3b": ShippedConfig("T5 3B, tied embeddings (google-t5/t5-3b); decoder reads seq_len / 4", 1, 1024),
    "vit-h14": ShippedConfig("ViT-H/14 at 224px, 1000 classes (google/vit-huge-patch14-224-in21k)", 32),
    # Qwen3, as torchtitan's qwen3 flavours give the released configs' numbers (torchtitan/models/qwen3/__init__.py)
    "qwen3-0.6b": ShippedConfig("Qwen3 0.6B, tied embeddings (Qwen/Qwen3-0.6B)", 1, 4096),
    "qwen3-1.7b": ShippedConfig("Qwen3 1.7B, tied embeddings (Qwen/Qwen3-1.7B)", 1, 4096),
    "qwen3-4b": ShippedConfig("Qwen3 4B, tied embeddings (Qwen/Qwen3-4B)", 1, 4096),
    "qwen3-8b": ShippedConfig("Qwen3 8B (Qwen/Qwen3-8B)", 1, 4096),
    "qwen3-14b": ShippedConfig("Qwen3 14B (Qwen/Qwen3-14B)", 1, 4096),
    "qwen3-32b": ShippedConfig("Qwen3 32B (Qwen/Qwen3-32B)", 1, 4096),
    "qwen3-30b-a3b": ShippedConfig("Qwen3 30B-A3B MoE, 128 experts top-8 (Qwen/Qwen3-30B-A3B)", 1, 4096),
    "qwen3-235b-a22b": ShippedConfig("Qwen3 235B-A22B MoE, 128 experts top-8 (Qwen/Qwen3-235B-A22B)", 1, 4096),
    "gpt-oss-20b": ShippedConfig("gpt-oss 20B MoE, 32 experts top-4, attention sinks, sliding windows "
                                 "(openai/gpt-oss-20b)", 1, 4096),
    "gpt-oss-120b": ShippedConfig("gpt-oss 120B MoE, 128 experts top-4, attention sinks, sliding windows "
                                  "(openai/gpt-oss-120b)", 1, 4096),
    # Phi (MIT): transformers' Phi3 class, fused qkv_proj and gate_up_proj (TP: transformers' gathered styles)
    "phi3-mini": ShippedConfig("Phi-3 mini 3.8B, fused QKV and gate-up projections (microsoft/Phi-3-mini-4k-instruct)",
                               1, 4096),
    "phi4": ShippedConfig("Phi-4 14B, fused QKV and gate-up projections (microsoft/phi-4)", 1, 4096),
    # Qwen3.5's text decoders (transformers' qwen3_5_text and qwen3_5_moe_text: the released models' text_config, their
    # vision encoders left out), as torchtitan's qwen3_5 flavours give their numbers (torchtitan/models/qwen3_5/
    # __init__.py): three gated DeltaNet layers to each attention layer, the linear attention FLA's kernels
    "qwen3.5-9b": ShippedConfig("Qwen3.5 9B text decoder, 3 gated DeltaNet layers to each attention layer "
                                "(Qwen/Qwen3.5-9B)", 1, 4096),
    "qwen3.5-27b": ShippedConfig("Qwen3.5 27B text decoder, 3 gated DeltaNet layers to each attention layer "
                                 "(Qwen/Qwen3.5-27B)", 1, 4096),
    "qwen3.5-35b-a3b": ShippedConfig("Qwen3.5 35B-A3B MoE text decoder, gated DeltaNet, 256 experts top-8, a shared "
                                     "expert (Qwen/Qwen3.5-35B-A3B)", 1, 4096),
    "qwen3.5-397b-a17b": ShippedConfig("Qwen3.5 397B-A17B MoE text decoder, gated DeltaNet, 512 experts top-10, a "
                                       "shared expert (Qwen/Qwen3.5-397B-A17B)", 1, 4096),
    # Qwen3-Next: transformers' Qwen3NextConfig defaults, the released model's numbers (every layer an MoE layer)
    "qwen3-next-80b-a3b": ShippedConfig("Qwen3-Next 80B-A3B MoE, 3 gated DeltaNet layers to each attention layer, "
                                        "512 experts top-10, a shared expert (Qwen/Qwen3-Next-80B-A3B-Instruct)", 1,
                                        4096),
    "moonlight-16b-a3b": ShippedConfig("Moonlight 16B-A3B MoE, MLA, 64 experts top-6 (moonshotai/Moonlight-16B-A3B)",
                                       1, 4096),
    # torchtitan's own flavours (torchtitan/models/*/__init__.py at b5bcd76, BSD-3-Clause), written as transformers
    # configs whose models hold exactly the params torchtitan's build of the flavour holds
    "titan-qwen3-debugmodel": ShippedConfig("torchtitan's qwen3 debugmodel (8 layers, width 256, tied embeddings)",
                                            8, 2048),
    "titan-qwen3-debugmodel-moe": ShippedConfig("torchtitan's qwen3 debugmodel_moe (8 layers, 64 experts top-8)",
                                                8, 2048),
    "titan-deepseek-v3-debugmodel": ShippedConfig("torchtitan's deepseek_v3 debugmodel (6 layers, MLA, 8 experts "
                                                  "top-3, 2 shared)", 8, 2048),
    "titan-deepseek-v3-16b": ShippedConfig("torchtitan's deepseek_v3 16B (DeepSeek-V2-Lite's numbers: MLA, 64 "
                                           "experts top-6, 2 shared)", 1, 4096),
    "titan-deepseek-v3-236b": ShippedConfig("torchtitan's deepseek_v3 236B (DeepSeek-V2's numbers: MLA, 160 "
                                            "experts top-6, 2 shared)", 1, 4096),
    "titan-gpt-oss-debugmodel": ShippedConfig("torchtitan's gpt_oss debugmodel (4 layers, 8 experts top-4)", 8,
                                              2048),
}


def is_hf(spec: str) -> bool:
    return spec.startswith(PREFIX)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise PlannerError(INSTALL_HINT) from None
    return transformers


def config_file(source: str) -> Path:
    """The config.json an ``hf:`` source names (the part after ``hf:``)."""
    if source in SHIPPED:
        return CONFIG_DIR / f"{source}.json"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlannerError(f"hf:{source} is a directory without a config.json")
        return path
    if path.is_file():
        return path
    raise PlannerError(f"hf:{source} is neither a shipped config ({', '.join(SHIPPED)}) nor a config.json file or a "
                       "directory holding one")


def read_config(source: str) -> dict[str, Any]:
    """The config's JSON object; it must name its ``model_type`` (what ``AutoConfig.for_model`` dispatches on)."""
    path = config_file(source)
    label = f"config file '{path}'"
    # a repeated key is refused: transformers would read its last value, and which one the user meant is unknown
    data = parse_json(read_text(path, label, "a Hugging Face config.json", MAX_SOURCE_BYTES),
                      lambda detail: f"{label} is not valid JSON: {detail}")
    if not isinstance(data, dict):
        raise PlannerError(f"{label} must hold a JSON object, got {type(data).__name__}")
    data = special_floats(data)
    if not isinstance(data.get("model_type"), str):
        raise PlannerError(f"{label} has no \"model_type\" (e.g. \"llama\"): transformers needs it to pick the "
                           "architecture")
    check_config(data, label)
    return data


FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def special_floats(value: Any) -> Any:
    """``value`` with transformers 5's tagged floats read: its configs write a float JSON cannot hold as
    ``{"__float__": "Infinity"}`` (Mamba-2's ``time_step_limit`` of (0.0, inf)), and its reader turns them back
    (``PreTrainedConfig``'s special floats); ``limits.check_field`` then judges the number."""
    if isinstance(value, dict):
        tag = value.get("__float__") if len(value) == 1 else None
        if isinstance(tag, str) and tag in FLOAT_TAGS:
            return FLOAT_TAGS[tag]
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value


def _config(data: dict[str, Any]) -> Any:
    """A fresh transformers config for ``data`` (from_config writes its choices into the config it is given)."""
    transformers = _transformers()
    fields = {k: v for k, v in data.items() if k != "model_type"}
    known = list(getattr(transformers, "CONFIG_MAPPING", {}).keys())
    if known and data["model_type"] not in known:  # transformers' own message lists all 800 types, cut short
        near = difflib.get_close_matches(data["model_type"][:100], known, n=3)
        raise PlannerError(f"transformers {transformers.__version__} has no model_type {shown_json(data['model_type'])}"
                           + (f": did you mean {' or '.join(near)}?" if near else
                              " (a newer transformers may: pip install -U transformers)"))
    try:
        config = transformers.AutoConfig.for_model(data["model_type"], **fields)
    except Exception as e:  # transformers' validators raise their own types for a bad config: the user's input
        first = " ".join(str(e).split())
        first = first if len(first) <= 300 else first[:300] + " ..."  # an unknown type lists every known one
        raise PlannerError(f"transformers cannot make a '{data['model_type']}' config: {first}") from None
    if data.get("tie_word_embeddings") is False and getattr(config, "tie_word_embeddings", False):
        config._fsdp_planner_untied = True  # (the config class forced the tie: ``tie_note`` says so)
    _check_heads(config)
    _check_pad_token(config)
    _check_activation(config)
    _check_rope(config)
    _check_experts(config)
    return config


def _check_rope(config: Any) -> None:
    """transformers looks a rotary embedding's ``rope_type`` up when it builds the model (``ROPE_INIT_FUNCTIONS``):
    an unknown one is a bare KeyError from inside the constructor, so the field is named here."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for field in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, field, None)
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if isinstance(kind, str) and kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise PlannerError(f"the '{config.model_type}' config's {field}.rope_type {kind[:100]!r} is not one "
                               f"transformers knows: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERT_TOP_K = ("num_experts_per_tok", "moe_top_k")


def _check_experts(config: Any) -> None:
    """A MoE config's expert count and the experts each token picks: a router's ``topk`` of more experts than
    there are fails in the forward ("k not in range"), so the fields are named here."""
    aliases = getattr(config, "attribute_map", {})  # (Jamba's num_local_experts reads its num_experts: named so)
    count = next(((f, v) for f in _EXPERT_COUNTS if f not in aliases and isinstance(v := getattr(config, f, None), int)
                  and not isinstance(v, bool)), None)
    top_k = next(((f, v) for f in _EXPERT_TOP_K if f not in aliases and isinstance(v := getattr(config, f, None), int)
                  and not isinstance(v, bool)), None)
    if count is not None and count[1] < 1:
        raise PlannerError(f"the '{config.model_type}' config's {count[0]} is {count[1]}: a MoE layer needs at "
                           "least one expert")
    if count is not None and top_k is not None and not 1 <= top_k[1] <= count[1]:
        raise PlannerError(f"the '{config.model_type}' config's {top_k[0]} ({top_k[1]}) must be from 1 to its "
                           f"{count[0]} ({count[1]}): each token picks that many of the experts")


_ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "activation_function")


def _check_activation(config: Any) -> None:
    """transformers looks an activation up by name when it builds a layer (``ACT2FN[name]``), so an unknown name
    would be a bare KeyError from inside the model's constructor."""
    from transformers.activations import ACT2FN

    for field in _ACTIVATION_FIELDS:
        name = getattr(config, field, None)
        if isinstance(name, str) and name not in ACT2FN:
            raise PlannerError(f"the '{config.model_type}' config's {field} {name!r} is not an activation "
                               "transformers knows (e.g. silu, gelu, gelu_pytorch_tanh, relu)")


def _check_pad_token(config: Any) -> None:
    """The embedding's ``padding_idx`` is the config's pad_token_id: a config shrunk to a small vocabulary that keeps
    the checkpoint's pad id fails in ``nn.Embedding`` ("Padding_idx must be within num_embeddings"), so the fields
    are named here, in the config or the sub-config (a multimodal model's text_config) holding them."""
    for sub in ("", "text_config"):
        cfg = getattr(config, sub, None) if sub else config
        pad, vocab = getattr(cfg, "pad_token_id", None), getattr(cfg, "vocab_size", None)
        if isinstance(pad, int) and isinstance(vocab, int) and not -vocab <= pad < vocab:
            where = f"{sub}'s " if sub else ""
            raise PlannerError(f"the '{config.model_type}' config's {where}pad_token_id ({pad}) is outside its "
                               f"vocab_size ({vocab}): set \"pad_token_id\" below {vocab} (or to null)")


def _check_heads(config: Any) -> None:
    """Grouped-query attention shares each key/value head among ``heads // kv_heads`` query heads; transformers
    accepts a config where that does not divide and fails deep in the forward, so the field is named here."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        raise PlannerError(f"the '{config.model_type}' config's num_key_value_heads ({kv}) must divide "
                           f"num_attention_heads ({heads}): set num_key_value_heads to a divisor of it "
                           f"(e.g. {heads} for plain multi-head attention)")


def _check_decoder_start(config: Any) -> None:
    """An encoder-decoder LM makes its decoder's inputs by shifting the labels right behind this token; transformers'
    config leaves the field out unless the file sets it, and the forward then fails on the missing attribute."""
    if getattr(config, "decoder_start_token_id", None) is None:
        pad = getattr(config, "pad_token_id", None)
        hint = f" (e.g. {pad}, its pad_token_id, as T5 does)" if isinstance(pad, int) else ""
        raise PlannerError(f"the '{config.model_type}' config has no decoder_start_token_id: set "
                           f"\"decoder_start_token_id\" in the config file to the token the decoder starts from{hint}")


def task_of(config: Any) -> HfTask:
    """The training task the planner runs for a config, from transformers' Auto mappings."""
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    if encoder_decoder and model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return HfTask.SEQ2SEQ_LM
    if encoder_decoder and model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        _check_speech_frames(config)
        return HfTask.SPEECH_SEQ2SEQ
    if encoder_decoder and model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        # transformers' causal LM of an encoder-decoder type is its decoder alone: a plan of another model
        raise PlannerError(f"hf: model type '{model_type}' is an encoder-decoder the planner cannot feed: its causal "
                           "LM class is the decoder alone, so a plan would leave the encoder out")
    if model_type in _CONTRASTIVE_TYPES:
        return HfTask.CONTRASTIVE
    if any(getattr(config, f, None) is not None for f in _MEDIA_CONFIGS):
        _refuse_multimodal(config)
    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return HfTask.CAUSAL_LM
    if model_type in auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return HfTask.IMAGE_CLASSIFICATION
    raise PlannerError(f"hf: model type '{model_type}' is not supported: the planner trains causal LMs, "
                       "encoder-decoder LMs, Whisper-like speech encoder-decoders, CLIP-like two-tower "
                       "models and image classifiers")


# Two-tower image-text models trained as they are pretrained, on their contrastive loss (``return_loss=True``) over
# token ids and pixel values; transformers also maps them to an image classifier, their vision tower alone.
_CONTRASTIVE_TYPES = ("clip", "siglip", "metaclip_2")


# The sub-configs of a model that reads images or audio beside text (Llama 3.2 Vision, Gemma 3, Gemma 3n, LLaVA):
# fed token ids alone, its media towers never run, and transformers' causal LM of some of them (Mllama) is the text
# model alone, so a plan would be of another step.
_MEDIA_CONFIGS = ("vision_config", "audio_config")


def _refuse_multimodal(config: Any) -> None:
    from transformers.models.auto import modeling_auto as auto

    text = getattr(getattr(config, "text_config", None), "model_type", None)
    alone = (f"; or its language model alone, with its text_config as a config of its own (\"model_type\": "
             f"\"{text}\"), without the media towers and their tokens" if text in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
             else "")
    media = " beside text" if text else ""
    raise PlannerError(f"hf: model type '{config.model_type}' reads images or audio{media}, which the planner cannot "
                       "make inputs for from a config alone: plan the whole model with a factory that builds it "
                       "from this config and returns its inputs (pixel values, the image tokens in the ids), as "
                       f"docs/your-model.md shows{alone}")


# A speech encoder-decoder the planner can feed takes log-mel frames (Whisper): num_mel_bins channels of a fixed
# length, twice the encoder's positions (its two convolutions, the second of stride 2); other speech front ends
# (Speech2Text's stacked filterbanks) take inputs of another shape.
_SPEECH_FIELDS = ("num_mel_bins", "max_source_positions", "max_target_positions")


def _check_speech_frames(config: Any) -> None:
    if not all(isinstance(getattr(config, f, None), int) for f in _SPEECH_FIELDS):
        raise PlannerError(f"hf: model type '{config.model_type}' is a speech encoder-decoder without Whisper's "
                           f"log-mel input ({', '.join(_SPEECH_FIELDS)}): the planner cannot make its inputs")


def encoder_note(model: nn.Module) -> str | None:
    """Said, not silent: an encoder (BERT, RoBERTa) is planned as transformers' causal-LM form of it."""
    config = getattr(model, "config", None)
    if config is None or not is_encoder(config.model_type) or task_of(config) is not HfTask.CAUSAL_LM:
        return None
    return (f"{config.model_type} is an encoder (a masked LM), planned as transformers builds it for causal LM "
            "(as a decoder: causal attention, a next-token loss): a masked-LM or classification step has the same "
            "blocks but attends both ways (about twice the causal attention's FLOPs) and another head")


def tie_note(model: nn.Module) -> str | None:
    """Said, not silent: a config asking for untied embeddings (``tie_word_embeddings: false``) whose model
    transformers builds tied anyway (T5 in transformers 5 forces the tie: a T5 v1.1 config built one 32.9M-param
    embedding fewer than its checkpoint, a trial)."""
    config = getattr(model, "config", None)
    untied = getattr(config, "_fsdp_planner_untied", None)
    if not untied or not hasattr(model, "get_output_embeddings") or not hasattr(model, "get_input_embeddings"):
        return None
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or out.weight is not inp.weight:
        return None
    return (f"the config sets tie_word_embeddings false, and transformers {_transformers().__version__} builds "
            f"{type(model).__name__} tied all the same: planned with one {inp.weight.numel():,}-param embedding fewer "
            "than an untied checkpoint holds")


# the heads of a causal LM's class names, which a config's ``architectures`` may name beside another task's
LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def head_note(model: nn.Module) -> str | None:
    """Said, not silent: a decoder config whose ``architectures`` names another head (a sequence or token classifier,
    question answering) is planned as transformers' causal LM of it, the task following ``model_type`` (a trial's
    Mistral classifier of 3 labels was planned with its 134M-param vocabulary head and logits without a word)."""
    config = getattr(model, "config", None)
    if config is None or task_of(config) is not HfTask.CAUSAL_LM or is_encoder(config.model_type):
        return None
    archs = [str(a) for a in getattr(config, "architectures", None) or []]
    if not archs or any(a.endswith(LM_HEADS) or "LMHead" in a for a in archs):
        return None
    head = getattr(model, "lm_head", None)
    numel = sum(p.numel() for p in head.parameters()) if isinstance(head, nn.Module) else 0
    # a bare backbone (an embedding model's MistralModel) has no head; a classifier's replaces the vocabulary's
    other = "which that backbone has not" if archs[0].endswith("Model") else "which that class replaces with its own"
    return (f"the config names {archs[0]}: planned as transformers' causal LM of it (the task follows model_type), "
            f"with its vocabulary head ({numel:,} params), logits and next-token loss, {other}: the plan's memory "
            "and step are a causal LM's")


IMAGENET_SIZE = 224  # the crop of ImageNet training, which a CNN config without image_size (ResNet, RegNet, BiT)
# leaves to its preprocessor (microsoft/resnet-50's preprocessor_config.json: crop_size 224)


def image_note(model: nn.Module) -> str | None:
    """Said, not silent: the resolution an image classifier whose config has no ``image_size`` is planned at, and
    the head a backbone's config (``architectures`` naming no classifier: DINOv2's ``Dinov2Model``) is planned with
    (a trial read 4,098 params past the published count)."""
    config = getattr(model, "config", None)
    if config is None or task_of(config) is not HfTask.IMAGE_CLASSIFICATION:
        return None
    said = []
    archs = getattr(config, "architectures", None) or []
    if archs and not any(str(a).endswith("ForImageClassification") for a in archs):
        head = getattr(model, "classifier", None)
        numel = sum(p.numel() for p in head.parameters()) if isinstance(head, nn.Module) else 0
        said.append(f"the config names {archs[0]}, no classifier: planned as transformers' image classifier of it, "
                    f"with a {config.num_labels}-class head ({numel:,} params) and its cross-entropy loss")
    image = getattr(config, "vision_config", None) or config
    if not hasattr(image, "image_size"):
        said.append(f"the {config.model_type} config gives no image size (its preprocessor does): planned at "
                    f"{IMAGENET_SIZE}x{IMAGENET_SIZE}, ImageNet's crop; for another, add \"image_size\": N to the "
                    "config file")
    return "; ".join(said) or None


def mtp_note(model: nn.Module) -> str | None:
    """Said, not silent: a config's multi-token-prediction layers (DeepSeek-V3's, GLM-4.5's, dots.llm1's
    ``num_nextn_predict_layers``), which transformers does not build, are left out of the plan."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # (a VLM's decoder's)
    layers = getattr(text, "num_nextn_predict_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        return None
    return (f"the config's num_nextn_predict_layers = {layers}: transformers builds no multi-token-prediction layer, "
            f"so the plan leaves out its {layers} layer(s) (their params, their step's work), which a job training "
            "with MTP runs too (torchtitan's deepseek_v3 where its MTP is on)")


def dense_experts_note(model: nn.Module) -> str | None:
    """Said, not silent: transformers' Llama 4 experts layer runs every token through every expert (the router's
    scores zero those it did not pick: ``Llama4TextMoe`` repeats the tokens once per expert), so its expert matmuls
    are experts / top-k times a routed dispatch's, as transformers trains it."""
    layers = [m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"]
    if not layers:
        return None
    experts, top_k = getattr(layers[0], "num_experts", None), getattr(layers[0], "top_k", None)
    if not (isinstance(experts, int) and isinstance(top_k, int) and top_k > 0):
        return None
    return (f"Llama 4's experts layers ({len(layers):,}; transformers' Llama4TextMoe) run every token through all "
            f"{experts} experts, the router's scores zeroing those it did not pick: their expert matmuls are "
            f"{experts / top_k:g}x a routed dispatch's ({top_k} of {experts}), as transformers trains them "
            "(torchtitan's llama4 runs the routed tokens only)")


def is_encoder(model_type: str) -> bool:
    """An encoder architecture (masked LM) that transformers also builds as a causal LM (BERT, RoBERTa)."""
    from transformers.models.auto import modeling_auto as auto

    return model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _auto_class(task: HfTask) -> Any:
    transformers = _transformers()
    return {HfTask.CAUSAL_LM: transformers.AutoModelForCausalLM,
            HfTask.SEQ2SEQ_LM: transformers.AutoModelForSeq2SeqLM,
            HfTask.SPEECH_SEQ2SEQ: transformers.AutoModelForSpeechSeq2Seq,
            HfTask.CONTRASTIVE: transformers.AutoModelForZeroShotImageClassification,
            HfTask.IMAGE_CLASSIFICATION: transformers.AutoModelForImageClassification}[task]


# The loss transformers would pick by the class name, for classes whose name does not say it.
_LOSS_TYPES = {HfTask.CAUSAL_LM: "ForCausalLM", HfTask.IMAGE_CLASSIFICATION: "ForImageClassification"}


# --attention -> transformers' attn_implementation. flash-attn cannot be loaded without its package (none on a CPU):
# "flash" builds with ``hf_attention``'s implementation, which runs the fused stand-in while planned (the same O(seq)
# memory) for any model, soft-capping ones (Gemma 2) included.
ATTN_IMPLEMENTATIONS = {"sdpa": "sdpa", "flash": hf_attention.FUSED, "eager": "eager"}


def parse_override(text: str) -> tuple[str, Scalar]:
    """One ``--hf-config KEY=VALUE``: the value read as a JSON scalar (``false``, ``8``, ``1e-5``, ``"x"``), or
    as the text itself when it is none (``silu``)."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key.isidentifier():
        raise PlannerError(f"--hf-config takes KEY=VALUE with a config field name as KEY (e.g. use_cache=false), "
                           f"got {text[:MAX_OVERRIDE_CHARS]!r}")
    if len(key) > MAX_OVERRIDE_CHARS or len(raw) > MAX_OVERRIDE_CHARS:
        raise PlannerError(f"--hf-config: a key or value longer than {MAX_OVERRIDE_CHARS} characters")
    if key == "model_type":
        raise PlannerError("--hf-config cannot change model_type: give another config file instead")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    if isinstance(value, float) and not math.isfinite(value):  # json reads 1e400 as inf
        raise PlannerError(f"--hf-config {key}: the value must be a finite number, got {raw[:MAX_OVERRIDE_CHARS]!r}")
    if not isinstance(value, bool | int | float | str | None):
        raise PlannerError(f"--hf-config {key}: the value must be true/false, a number or a string "
                           f"(lists and objects belong in a config file), got {raw[:MAX_OVERRIDE_CHARS]!r}")
    check_field(key, value, "--hf-config")
    return key, value


def with_overrides(data: dict[str, Any], overrides: Overrides) -> dict[str, Any]:
    """The config's fields with a training step's on top (no KV cache, whatever the file says: checkpoints ship
    ``use_cache: true`` for generation), then the user's ``--hf-config``; a key the config does not have is an
    error (a typo would otherwise be a silent no-op)."""
    given = dict(overrides)
    if overrides:
        known = _config(data)
        for key, value in overrides:
            # (a method or a dunder, to_dict or __class__, is no field: set, transformers raised on it)
            if key.startswith("_") or not hasattr(known, key) or callable(getattr(known, key)):
                raise PlannerError(f"--hf-config {key}: the '{data['model_type']}' config has no field '{key}'")
            if type(getattr(known, key)) is float and type(value) is int:  # (=0 for a float field: transformers'
                given[key] = float(value)  # strict dataclass refuses the int)
    return {**data, **TRAINING_FIELDS, **given}


def _fixed_sequences(find: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """transformers' packed-sequence check (``masking_utils.find_packed_sequence_indices``, reached when there is
    no cache and no attention mask, i.e. training) ends in a data-dependent ``.all()``: on meta tensors a crash,
    on fake ones a mask tensor a GPU run would not have. The planner's inputs hold one sequence per row, so the
    check's answer is known: None (not packed), what the real step takes. Real tensors are asked as before."""
    from torch._subclasses.fake_tensor import is_fake

    @functools.wraps(find)
    def checked(position_ids: torch.Tensor) -> Any:
        if position_ids.is_meta or is_fake(position_ids):
            return None
        return find(position_ids)

    checked.__wrapped_by_fsdp_planner__ = True  # type: ignore[attr-defined]
    return checked


def unpacked_inputs() -> None:
    """Install ``_fixed_sequences`` once (transformers versions without the check are left alone)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is not None and not getattr(find, "__wrapped_by_fsdp_planner__", False):
        masking_utils.find_packed_sequence_indices = _fixed_sequences(find)


def build_model(data: dict[str, Any], overrides: Overrides = (), attention: str | None = None) -> nn.Module:
    """The model of a config (on the current default device: meta while planning), fp32 params, training mode,
    no KV cache unless ``overrides`` ask for one. Experts layers take the token-balanced routing while planned
    (``hf_experts``), gated DeltaNet layers flash-linear-attention's kernels (``linear_attention``), Mamba-2 layers
    mamba_ssm's fused function (``mamba_scan``). ``attention``
    (``--attention``) sets the attention implementation; None leaves transformers' own choice."""
    config = _config(with_overrides(data, overrides))
    unpacked_inputs()
    if attention == "flash":
        with quiet_loggers(*TORCHAO_LOGGERS):  # its interface's module imports transformers' quantizers (torchao)
            hf_attention.register()
    chosen = {"attn_implementation": ATTN_IMPLEMENTATIONS[attention]} if attention is not None else {}
    task = task_of(config)
    if task in (HfTask.SEQ2SEQ_LM, HfTask.SPEECH_SEQ2SEQ):
        _check_decoder_start(config)
    if task is HfTask.CAUSAL_LM and is_encoder(config.model_type) and not getattr(config, "is_decoder", False):
        config.is_decoder = True  # an encoder (BERT) trained as a causal LM attends causally, as transformers asks
    # a model without experts layers accepts the option and ignores it
    experts = hf_experts.register()
    try:
        # transformers' quantizers import torchao building the first model; its generation config's checks warn of
        # sampling fields (Gemma 3's cache_implementation) that say nothing of a training step
        with quiet_loggers(*TORCHAO_LOGGERS, "transformers.generation.configuration_utils"):
            model = _auto_class(task).from_config(config, dtype=torch.float32, experts_implementation=experts,
                                                  **chosen)
    except ValueError as e:  # transformers refuses an implementation the class lacks (Gemma 2 and SDPA)
        if attention is None or "does not support" not in str(e):
            raise
        others = ", ".join(a for a in ATTN_IMPLEMENTATIONS if a != attention)
        raise PlannerError(f"--attention {attention}: transformers' {config.model_type} does not support it: give "
                           f"--attention {others.replace(', ', ' or ')}, or leave --attention out for transformers' "
                           "own choice") from None
    except KeyError as e:  # a class that picks its attention from its own table (Falcon's FALCON_ATTENTION_CLASSES)
        # never looks up an implementation registered with transformers' AttentionInterface
        if attention != "flash" or hf_attention.FUSED not in str(e):
            raise
        raise PlannerError(f"--attention flash: {config.model_type}'s attention is picked from its own classes, not "
                           "transformers' attention interface, and its flash_attention_2 needs the flash_attn "
                           "package (a GPU's): plan it with --attention sdpa (the default) or eager") from None
    except AttributeError as e:  # (only a config's missing field: what this package passes in raises otherwise)
        raise _refused_config(config, e) from None
    if getattr(model, "loss_type", "") is None and task in _LOSS_TYPES:
        model.loss_type = _LOSS_TYPES[task]  # a class name transformers cannot map (GPT2LMHeadModel) warns otherwise
    linear_attention.install(model)
    mamba_scan.install(model)
    selective_scan.install(model)
    return model.train()


def _refused_config(config: Any, e: AttributeError) -> BaseException:
    """An attribute building the model looked up and did not find: the config's fault where transformers' code
    read it from a config object (a field its modelling code reads that the config lacks, DBRX's
    attn_config.rope_theta), said in one line; anything else (this package's own code, an API change) as it is."""
    frames = traceback.extract_tb(e.__traceback__)
    config_classes = (type(config).__name__, *(type(v).__name__ for v in vars(config).values()))
    if not frames or f"{os.sep}transformers{os.sep}" not in frames[-1].filename or \
            not any(f"'{name}' object has no attribute" in str(e) for name in config_classes):
        return e
    said = printable(str(e).splitlines()[0] if str(e) else "")[:200]
    return PlannerError(f"transformers could not build its {config.model_type} model from this config "
                        f"({type(e).__name__}: {said}): the config lacks a field its code reads, or holds one of "
                        "another type; compare it with the model's published config.json")


def own_checkpointing_off(model: nn.Module) -> tuple[str, ...]:
    """The layers transformers' ``activation_checkpointing_enable()`` (4.x: ``gradient_checkpointing_enable()``)
    checkpoints in ``model`` (its ``GradientCheckpointingLayer`` blocks with the flag on), turned off: the
    planner plans the checkpointing itself. Left on, the model's own ``torch.utils.checkpoint`` would nest inside
    the plan's, and its recomputation runs outside the trace's modes (SDPA there takes another kernel). Empty for a
    model that is not a transformers model or does not checkpoint."""
    # transformers 5's names first: reading 4's deprecated aliases warns on every run
    new = hasattr(type(model), "is_activation_checkpointing")
    disable = getattr(model, "activation_checkpointing_disable" if new else "gradient_checkpointing_disable", None)
    on = getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False)
    if on is not True or not callable(disable):
        return ()
    layers = tuple(name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True
                   and any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__))
    disable()
    return layers


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation transformers built ``model`` with (None: not a transformers model)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has attention: its class takes an attention implementation other than eager, or (a model
    transformers gives eager attention only, Bloom's ALiBi attention) one of its modules is an attention module by
    its class name. A CNN (ResNet, ConvNeXt) or a state-space model (Mamba) has neither."""
    return other_attention(model) or any("Attention" in type(m).__name__ for m in model.modules())


def other_attention(model: nn.Module) -> bool:
    """Whether ``model``'s class takes an attention implementation other than eager (SDPA, flash, flex)."""
    return any(getattr(type(model), flag, False) for flag in ("_supports_sdpa", "_supports_flash_attn",
                                                              "_supports_flex_attn", "_supports_attention_backend"))


def model_loss(output: Any) -> torch.Tensor:
    """The model's own loss (it was given labels); a model that returns none: the sum of its logits."""
    if getattr(output, "loss", None) is not None:
        return output.loss
    return output.logits.float().sum()


def causal_lm_loss(model: nn.Module, ids: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """The model's own next-token loss (``loss_function``: logits upcast to fp32, labels shifted), applied to
    its logits after the forward rather than inside it: the trace then sees the fp32 logits and their gradient
    alive at the start of backward, as it does for the built-ins (gigabytes at a 128K vocabulary)."""

    def loss(output: Any) -> torch.Tensor:
        return model.loss_function(output.logits, ids, vocab_size=model.config.vocab_size)

    return loss


# learned (or fixed) absolute position tables (GPT-2, BERT, BART, Marian): a hard length limit
_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")


def _positions_taken(table: nn.Embedding) -> int:
    """The longest sequence a position table takes: its rows, less BART's offset (its learned positions start at
    2: ``BartLearnedPositionalEmbedding.offset``) or RoBERTa's (position ids start after the padding index,
    ``create_position_ids_from_input_ids``: 514 rows take 512 tokens)."""
    offset = getattr(table, "offset", 0)
    if isinstance(offset, int) and not isinstance(offset, bool) and offset > 0:
        return table.num_embeddings - offset
    pad = table.padding_idx
    return table.num_embeddings - (pad + 1) if isinstance(pad, int) and pad >= 0 else table.num_embeddings


def learned_positions(model: nn.Module) -> tuple[str, int] | None:
    """The model's learned absolute position table and its length (the longest sequence it takes); None for a
    model without one (rotary positions, as Llama's, have no such limit). Where ``--seq`` is one part's length
    (Whisper's decoder, a two-tower model's text tower), that part's table: the other's is fixed by its input."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in _CONTRASTIVE_TYPES:
        return "text_model.embeddings.position_embedding", config.text_config.max_position_embeddings
    if getattr(config, "is_encoder_decoder", False) and isinstance(getattr(config, "max_target_positions", None), int):
        return "model.decoder.embed_positions", config.max_target_positions
    for name, module in model.named_modules():  # (an encoder-decoder's encoder first: --seq is its length)
        if name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(module, nn.Embedding):
            return name, _positions_taken(module)
    return None


# the first transformers release the planner is not checked against (pyproject.toml's bound says why)
UNCHECKED_TRANSFORMERS = (5, 26)


def remote_code_note(source: str) -> str | None:
    """A config whose ``auto_map`` names its own modeling code (``trust_remote_code`` models): that code is never
    run here (data is not code), so the model planned is transformers' own class of its ``model_type``, which may
    differ from what the job trains: said (a trial's config was planned as plain Llama without a word)."""
    data = read_config(source)
    auto_map = data.get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        return None
    named = ", ".join(f"{shown_json(v)} for {shown_key(str(k))}" for k, v in list(auto_map.items())[:3])
    more = f" and {len(auto_map) - 3} more" if len(auto_map) > 3 else ""
    return (f"the config's auto_map names its own code ({named}{more}), which fsdp-planner never runs: the model "
            f"planned is transformers' own {shown_json(data['model_type'])} class, not that code's")


def version_note() -> str | None:
    """A transformers newer than the releases the planner is checked against: said, as its TP plans and attention
    classes may differ from what the planner reads."""
    import transformers

    release = tuple(int(p) if p.isdigit() else 0 for p in transformers.__version__.split(".")[:2])
    if release < UNCHECKED_TRANSFORMERS:
        return None
    bound = ".".join(map(str, UNCHECKED_TRANSFORMERS))
    return (f"transformers {transformers.__version__} is newer than the releases fsdp-planner is checked against "
            f"(below {bound}): its tensor-parallel plans and attention classes may be read otherwise "
            f"(pip install 'transformers<{bound}' for a checked one)")


def positions_note(model: nn.Module, seq_len: int) -> str | None:
    """Said, not refused: a sequence longer than the config's ``max_position_embeddings`` where no learned table
    limits it (rotary positions compute any length, and the step is planned as asked), which is past what the
    model was configured for."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or seq_len <= limit or learned_positions(model):
        return None
    # (one text for every length: fit, which plans many, says it once)
    return (f"a sequence longer than the config's max_position_embeddings ({limit:,}) is planned as asked (its "
            "positions are computed), but the model was configured for that many or fewer")


def check_positions(model: nn.Module, seq_len: int) -> None:
    """A sequence longer than a learned position table fails inside the model's forward (an IndexError in the
    embedding): say so before planning."""
    table = learned_positions(model)
    if table is not None and seq_len > table[1]:
        name, positions = table
        raise PlannerError(f"--seq {seq_len} is longer than the model's {positions} learned positions ({name}): "
                           f"give --seq {positions} or less")


def build_causal_lm(data: dict[str, Any], batch_size: int, seq_len: int, hf_config: Overrides = (),
                    attention: str | None = None) -> tuple[nn.Module, Any, Any]:
    model = build_model(data, hf_config, attention)
    check_positions(model, seq_len)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": ids}, causal_lm_loss(model, ids)


def build_seq2seq_lm(data: dict[str, Any], batch_size: int, seq_len: int, hf_config: Overrides = (),
                     attention: str | None = None) -> tuple[nn.Module, Any, Any]:
    """Encoder ids of ``seq_len`` and a quarter as many target ids (T5's span-corruption ratio); the decoder's
    inputs are the targets shifted right, made by the model."""
    model = build_model(data, hf_config, attention)
    check_positions(model, seq_len)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, seq_len))
    labels = torch.randint(0, vocab, (batch_size, max(1, seq_len // 4)))
    return model, {"input_ids": ids, "labels": labels}, model_loss


def build_speech_seq2seq(data: dict[str, Any], batch_size: int, seq_len: int, hf_config: Overrides = (),
                         attention: str | None = None) -> tuple[nn.Module, Any, Any]:
    """Whisper's inputs: log-mel frames of the fixed length its encoder takes (30 s of audio at the real sizes)
    and ``seq_len`` target ids, which the decoder reads shifted right behind its start token."""
    model = build_model(data, hf_config, attention)
    check_positions(model, seq_len)
    cfg = model.config
    frames = torch.randn(batch_size, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    labels = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, {"input_features": frames, "labels": labels}, model_loss


def build_contrastive(data: dict[str, Any], batch_size: int, seq_len: int, hf_config: Overrides = (),
                      attention: str | None = None) -> tuple[nn.Module, Any, Any]:
    """A batch of image-caption pairs: pixel values at the vision tower's image size and ``seq_len`` token ids per
    caption; the loss is the model's own contrastive loss over the batch."""
    model = build_model(data, hf_config, attention)
    check_positions(model, seq_len)
    text, image = model.config.text_config, model.config.vision_config
    pixels = torch.randn(batch_size, image.num_channels, image.image_size, image.image_size)
    ids = torch.randint(0, text.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": ids, "pixel_values": pixels, "return_loss": True}, model_loss


def build_image_classifier(data: dict[str, Any], batch_size: int, hf_config: Overrides = (),
                           attention: str | None = None) -> tuple[nn.Module, Any, Any]:
    model = build_model(data, hf_config, attention)
    cfg = model.config
    # a two-tower config (CLIP, SigLIP) classifies with its vision tower: the image numbers are that tower's
    image = getattr(cfg, "vision_config", None) or cfg
    size = getattr(image, "image_size", IMAGENET_SIZE)
    height, width = size if isinstance(size, list | tuple) and len(size) == 2 else (size, size)
    pixels = torch.randn(batch_size, getattr(image, "num_channels", 3), height, width)
    labels = torch.randint(0, cfg.num_labels, (batch_size,))
    return model, {"pixel_values": pixels, "labels": labels}, model_loss


def _default_workload(source: str, task: HfTask, config: Any) -> dict[str, int]:
    if source in SHIPPED:
        return SHIPPED[source].workload()
    if task is HfTask.IMAGE_CLASSIFICATION:
        return {"batch_size": 32}
    if task is HfTask.SPEECH_SEQ2SEQ:
        return {"batch_size": 1, "seq_len": min(config.max_target_positions, DEFAULT_SEQ_CAP)}
    if task is HfTask.CONTRASTIVE:  # a contrastive loss needs more than one pair in the batch
        return {"batch_size": 32, "seq_len": min(config.text_config.max_position_embeddings, DEFAULT_SEQ_CAP)}
    max_positions = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_CAP
    return {"batch_size": 1, "seq_len": min(int(max_positions), DEFAULT_SEQ_CAP)}


@functools.cache
def factory(source: str) -> Callable[..., tuple]:
    """The model factory of an ``hf:`` source: its workload keywords (``batch_size``, ``seq_len`` where the task
    has one) default to the shipped workload, or for a user config to batch 1 and its maximum position count
    (at most 2048)."""
    data = read_config(source)
    config = _config(data)
    task = task_of(config)
    build = {HfTask.CAUSAL_LM: build_causal_lm, HfTask.SEQ2SEQ_LM: build_seq2seq_lm,
             HfTask.SPEECH_SEQ2SEQ: build_speech_seq2seq, HfTask.CONTRASTIVE: build_contrastive,
             HfTask.IMAGE_CLASSIFICATION: build_image_classifier}[task]
    workload = _default_workload(source, task, config)
    seq = workload.get("seq_len")
    if source not in SHIPPED and isinstance(seq, int) and seq <= DEFAULT_SEQ_CAP and task is not HfTask.SPEECH_SEQ2SEQ:
        # a position table may take fewer than the config's count (RoBERTa's 514 take 512): the default is what the
        # model takes (built on meta once: a table's models are small)
        with torch.device("meta"):
            table = learned_positions(build_model(data))
        workload["seq_len"] = min(seq, table[1]) if table else seq
    return functools.partial(build, data, **workload)


@dataclass(frozen=True)
class HfParallelPlan:
    """What transformers itself would tensor-parallelize in an ``hf:`` model (``from_pretrained(tp_plan="auto")``):
    its style name per module pattern, named from the model's root as ``named_modules()`` spells them, and the
    config's head counts (None where the config has none), which the layout's divisibility is checked against."""

    styles: dict[str, str]
    heads: int | None
    kv_heads: int | None
    prefix: str = ""  # the task class's base_model_prefix, which the base plan's patterns are named under
    rope_dim: int = 0  # the config's qk_rope_head_dim (MLA's rope key, which mla_kv_a_proj reads); 0: none


def parallel_plan(source: str, overrides: Overrides = (), top: tuple[tuple[str, str], ...] = ()) -> HfParallelPlan:
    """The tensor-parallel plan transformers keeps for the config's model class: the config class's
    ``base_model_tp_plan`` under the base model's name (``model.``: ``_base_prefix``), the input embedding sharded
    on the vocab as transformers' ``init_parallel_plans`` adds it, and the task class's own ``_tp_plan`` (the LM
    head). ``top``: (name, class name) of the built model's root ("") and its children."""
    config = _config(with_overrides(read_config(source), overrides))
    model_class = _model_class(config)
    prefix = _base_prefix(config, model_class, top)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    styles: dict[str, str] = {}
    if base:
        styles["embed_tokens"] = "embedding_rowwise"
    styles.update(base)
    named = {f"{prefix}.{k}" if prefix else k: v for k, v in styles.items()}
    named.update(dict(getattr(model_class, "_tp_plan", None) or {}))
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    rope = getattr(config, "qk_rope_head_dim", None)
    return HfParallelPlan(named, heads if isinstance(heads, int) else None, kv if isinstance(kv, int) else None,
                          prefix, rope if isinstance(rope, int) and not isinstance(rope, bool) and rope > 0 else 0)


def _base_prefix(config: Any, model_class: Any, top: tuple[tuple[str, str], ...]) -> str:
    """Where transformers names the base plan: under the root's child that is the base model, as
    ``init_parallel_plans`` merges each child's own plan under the child's name; the class's ``base_model_prefix``
    where the built model does not say (Llama 4's causal LM names its checkpoint's text model ``language_model``
    and holds it as ``model``, where transformers' own plan has it)."""
    from transformers.models.auto import modeling_auto as auto

    base = auto.MODEL_MAPPING_NAMES.get(config.model_type)
    held = [name for name, cls in top if cls == base]
    if base is not None and len(held) == 1:
        return held[0]
    return getattr(model_class, "base_model_prefix", "") or ""


@functools.lru_cache(maxsize=64)
def standard_experts(source: str, overrides: Overrides, class_names: tuple[str, ...]) -> bool:
    """Whether each of the model's experts classes ``class_names`` is one of transformers' standard experts layers
    (``hf_experts.standard_experts_class``), looked up by name beside the model's class (no model is made)."""
    import sys

    model_class = _model_class(_config(with_overrides(read_config(source), overrides)))
    module = sys.modules.get(model_class.__module__) if model_class is not None else None
    classes = [getattr(module, name, None) for name in class_names]
    return all(c is not None and hf_experts.standard_experts_class(c) for c in classes)


def _model_class(config: Any) -> Any:
    """The class ``from_config`` builds for the config's task, looked up by name in transformers' Auto mappings
    (no model is made)."""
    from transformers.models.auto import modeling_auto as auto

    task = task_of(config)
    names = {HfTask.CAUSAL_LM: auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             HfTask.SEQ2SEQ_LM: auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
             HfTask.SPEECH_SEQ2SEQ: auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
             HfTask.CONTRASTIVE: auto.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES,
             HfTask.IMAGE_CLASSIFICATION: auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES}[task]
    name = names.get(config.model_type)
    return getattr(_transformers(), name, None) if isinstance(name, str) else None
