"""Notes that say what a Hugging Face model's plan leaves out or prices as transformers runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fsdp_planner.models import ModelSpec, hf, load_model
from fsdp_planner.trace import record

# a Llama 4 text model: MoE every second layer, 4 experts, top-1 (a new user's trial config)
TINY_LLAMA4 = {"model_type": "llama4_text", "attention_chunk_size": 64, "bos_token_id": 0, "eos_token_id": 1,
               "pad_token_id": 2, "head_dim": 16, "hidden_size": 64, "interleave_moe_layer_step": 2,
               "intermediate_size": 64, "intermediate_size_mlp": 128, "max_position_embeddings": 256,
               "num_attention_heads": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
               "num_local_experts": 4, "vocab_size": 512, "no_rope_layers": []}


def write(tmp_path: Path, config: dict, name: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def test_llama4_s_dense_experts_are_said_and_are_what_the_trace_counts(tmp_path):
    """transformers' Llama4TextMoe runs every token through all 4 experts: the note says 4x a routed dispatch's
    (top-1), and the trace's expert FLOPs are the dense ones, 2 x tokens x every expert's params."""
    lm = load_model(ModelSpec(write(tmp_path, TINY_LLAMA4, "llama4"), batch_size=2, seq_len=64), meta=True)
    said = hf.dense_experts_note(lm.model)
    assert said is not None and "all 4 experts" in said and "4x a routed dispatch's (1 of 4)" in said
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    experts = [m for m, info in tr.modules.items() if info.cls == "Llama4TextExperts"]
    assert len(experts) == 2
    numel = sum(p.numel() for p in lm.model.get_submodule(experts[0]).parameters())
    assert tr.modules[experts[0]].fwd_flops == 2 * 2 * 64 * numel
    assert hf.dense_experts_note(load_model(ModelSpec("hf:qwen3-0.6b"), meta=True).model) is None


@pytest.mark.parametrize("layers", [1, 0])
def test_mtp_layers_transformers_does_not_build_are_said(tmp_path, layers):
    config = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
              "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "qk_nope_head_dim": 16, "first_k_dense_replace": 1, "num_nextn_predict_layers": layers}
    model = load_model(write(tmp_path, config, "dsv3"), meta=True).model
    said = hf.mtp_note(model)
    assert (said is not None and said.startswith("the config's num_nextn_predict_layers = 1")) == (layers == 1)


def test_an_integer_given_to_a_float_field_is_taken_as_the_float(tmp_path):
    """``--hf-config router_jitter_noise=0`` failed in transformers' strict config ("expected float, got int")."""
    config = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
              "router_jitter_noise": 0.01}
    spec = ModelSpec(write(tmp_path, config, "mixtral"), batch_size=1, seq_len=16,
                     hf_config=(("router_jitter_noise", 0), ("num_local_experts", 2)))
    model = load_model(spec, meta=True).model
    assert model.config.router_jitter_noise == 0.0 and model.config.num_local_experts == 2


def test_an_expert_count_is_named_by_the_field_the_config_has(tmp_path):
    """Jamba stores num_experts, which transformers also answers as num_local_experts (an alias): the message named
    the alias, a field the user's config does not have (a new user's trial)."""
    from fsdp_planner.errors import PlannerError

    config = {"model_type": "jamba", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    spec = ModelSpec(write(tmp_path, config, "jamba"), hf_config=(("num_experts", 1),))
    with pytest.raises(PlannerError, match=r"num_experts_per_tok \(2\) must be from 1 to its num_experts \(1\)"):
        load_model(spec, meta=True)
