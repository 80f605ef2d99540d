"""A model that reads images beside text, planned whole: transformers' LLaVA built from its config, given what
its step reads (token ids holding the image's placeholder tokens, the pixel values, labels that skip them).
fsdp-planner makes a step's inputs from a config alone for text models only; a factory like this one plans the
vision tower, the projector and the language model together.

    fsdp-planner plan docs/examples/llava.py:build --policy auto --cluster h100:8
    LLAVA_CONFIG=path/to/config.json fsdp-planner plan docs/examples/llava.py:build --seq 2048 --policy auto \
        --cluster h100:64

``LLAVA_CONFIG`` names a LLaVA config.json (llava-hf/llava-1.5-7b-hf's plans 7,063,427,072 params; its image is
576 tokens of the sequence, so give --seq); without it, a tiny one (CPU-sized: ``verify --nproc 2`` runs it).
The vision tower is frozen, as LLaVA's fine-tuning keeps it.
"""

import json
import os

import torch
from transformers import LlavaConfig, LlavaForConditionalGeneration

TINY = {"image_token_index": 300, "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
        "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                        "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 320, "pad_token_id": 0},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 4, "num_hidden_layers": 3, "patch_size": 8, "image_size": 32}}


def build(batch_size: int = 2, seq_len: int = 64):
    path = os.environ.get("LLAVA_CONFIG")
    if path:
        with open(path) as f:
            config = LlavaConfig(**json.load(f))
    else:
        config = LlavaConfig(**TINY)
    config.text_config.use_cache = False
    model = LlavaForConditionalGeneration(config)
    model.model.vision_tower.requires_grad_(False)
    vision = config.vision_config
    image_tokens = (vision.image_size // vision.patch_size) ** 2  # one per patch ("default" drops the CLS token)
    if seq_len <= image_tokens + 1:
        raise ValueError(f"seq_len must exceed the image's {image_tokens} tokens and a BOS token")
    ids = torch.randint(1, min(1000, config.text_config.vocab_size), (batch_size, seq_len))
    ids[ids == config.image_token_index] = 1
    ids[:, 1:1 + image_tokens] = config.image_token_index
    labels = ids.clone()
    labels[:, :1 + image_tokens] = -100  # no loss on the image's tokens
    pixels = torch.randn(batch_size, 3, vision.image_size, vision.image_size)
    inputs = {"input_ids": ids, "pixel_values": pixels, "labels": labels}
    return model, inputs, lambda out: out.loss
