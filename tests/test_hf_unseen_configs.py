"""Configs of transformers models fsdp-planner ships none of (a new user's trial, 2026-12-03): BART's and RoBERTa's
position tables take fewer tokens than their rows, Falcon's attention is its own, and a sliding window under
``--attention flash``. Tiny configs written here, in the fields the Hub's configs of those models have."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.models import ModelSpec, hf, load_model

BART = {"model_type": "bart", "d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_position_embeddings": 96,
        "vocab_size": 256, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2,
        "is_encoder_decoder": True}
ROBERTA = {"model_type": "roberta", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "intermediate_size": 128, "max_position_embeddings": 66, "vocab_size": 256, "pad_token_id": 1,
           "bos_token_id": 0, "eos_token_id": 2, "type_vocab_size": 1}
FALCON = {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "bias": False,
          "alibi": False, "vocab_size": 256}
MISTRAL = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "vocab_size": 256,
           "sliding_window": 64}


def _config(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return f"hf:{path}"


@pytest.mark.parametrize(("data", "taken", "table"), [(BART, 96, "model.encoder.embed_positions"),
                                                      (ROBERTA, 64, "roberta.embeddings.position_embeddings")])
def test_a_position_table_takes_what_its_model_indexes(tmp_path, data, taken, table):
    """BART's learned positions start at 2 (98 rows take 96 tokens) and RoBERTa's after the padding index (66 rows,
    padding index 1: 64): planned past them, the real forward raised IndexError in the embedding (a trial's
    `verify --nproc 2`); the default sequence is what the model takes (RoBERTa's was 66)."""
    model = _config(tmp_path, data["model_type"], data)
    assert hf.learned_positions(load_model(ModelSpec(model), meta=True).model) == (table, taken)
    assert ModelSpec(model).workload()["seq_len"] == taken
    with pytest.raises(PlannerError, match=rf"^--seq {taken + 1} is longer than the model's {taken} learned "
                                           rf"positions \({table}\): give --seq {taken} or less$"):
        load_model(ModelSpec(model, seq_len=taken + 1), meta=True)
    assert load_model(ModelSpec(model, seq_len=taken), meta=True).example_inputs["input_ids"].shape[-1] == taken


@pytest.mark.integration  # a real forward and backward of each tiny model at its longest sequence: a few seconds
@pytest.mark.parametrize("data", [BART, ROBERTA])
def test_the_longest_sequence_runs(tmp_path, data):
    lm = load_model(ModelSpec(_config(tmp_path, data["model_type"], data), batch_size=1), meta=False)
    lm.loss_fn(lm.model(**lm.example_inputs)).backward()  # (IndexError past the table)


def test_falcon_s_own_attention_classes_refuse_the_flash_stand_in(tmp_path, capsys):
    """Falcon picks its attention class from FALCON_ATTENTION_CLASSES, which never looks up an implementation
    registered with transformers' interface: it raised KeyError 'fsdp_planner_fused' inside transformers. Its SDPA
    passes one key head without enable_gqa, which a GPU runs on the math path: the note says so (it said fused).
    transformers 5.25's Falcon takes the attention interface: the stand-in runs there."""
    from transformers.models.falcon import modeling_falcon

    model = _config(tmp_path, "falcon", FALCON)
    if not hasattr(modeling_falcon, "FALCON_ATTENTION_CLASSES"):  # transformers 5.25: the interface, as other models
        assert main(["plan", model, "--cluster", "h100:8", "--attention", "flash", "--policy", "titan"]) == 0
        assert "'flash stand-in': fused kernel" in capsys.readouterr().err
        return
    assert main(["plan", model, "--cluster", "h100:8", "--attention", "flash"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --attention flash: falcon's attention is picked from its own classes, not transformers' attention "
        "interface, and its flash_attention_2 needs the flash_attn package (a GPU's): plan it with --attention sdpa "
        "(the default) or eager")
    assert main(["plan", model, "--cluster", "h100:8", "--policy", "titan", "--seq", "32"]) == 0
    assert "'sdpa': SDPA's math path, as a GPU runs these calls (keys of fewer heads than the queries" \
        in capsys.readouterr().err


def test_a_sliding_window_under_flash_is_no_slower_than_none(tmp_path, capsys):
    """flash-attn takes a sliding window inside its kernel, with no mask: the stand-in ran SDPA's sequence-squared
    mask and its non-causal memory-efficient kernel for it, so a windowed Mistral planned slower and larger than
    the same model without a window (11.3 against 7.26 s at 32K). Now the same step, the window said as an upper
    bound."""
    windowed, full = _config(tmp_path, "w", MISTRAL), _config(tmp_path, "f", {**MISTRAL, "sliding_window": None})
    out = []
    for model in (windowed, full):
        capsys.readouterr()
        assert main(["simulate", model, "--policy", "titan", "--seq", "1024", "--attention", "flash", "--cluster",
                     "h100:8", "--json"]) == 0
        captured = capsys.readouterr()
        step = json.loads(captured.out)
        out.append((step["step_time"], step["peak_memory"]))
        said = "its sliding window of 64 charged as full causal attention" in captured.err
        assert said == (model == windowed)
    assert out[0] == out[1]


OLMOE = {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_attention_heads": 16,
         "num_key_value_heads": 16, "num_hidden_layers": 16, "num_experts": 64, "num_experts_per_tok": 8,
         "max_position_embeddings": 4096, "vocab_size": 50304, "pad_token_id": 1, "eos_token_id": 50279,
         "tie_word_embeddings": False, "norm_topk_prob": False}  # OLMoE-1B-7B's (allenai/OLMoE-1B-7B-0924)


def test_an_ep_degree_auto_s_hsdp_layout_cannot_take_runs_on_one_that_can(tmp_path, capsys):
    """A tiny OLMoE of 64 experts on 64 H100s: auto's groups choose HSDP 2x32, whose dp_shard EP 64 does not divide;
    `--ep 64` was refused there ("does not divide the 32 data-parallel shard ranks", a layout the user never chose)
    though 1x64 takes it. Now the EP asked for runs on the layout that takes it, and the label names that one."""
    model = _config(tmp_path, "olmoe", {**OLMOE, "hidden_size": 128, "intermediate_size": 64, "num_attention_heads":
                                        4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000,
                                        "num_experts_per_tok": 2, "eos_token_id": 2})
    out = tmp_path / "plan.json"
    assert main(["plan", model, "--policy", "auto", "--cluster", "h100:64", "--ep", "64", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["expert_parallel"]["degree"] == 64 and written.get("mesh", {"replicate": 1})["replicate"] == 1
    assert written["policy"] == "auto(h100:64, 70.8 GiB), EP 64"


@pytest.mark.integration  # OLMoE-1B-7B's auto plan on 64 H100s: ~15 s
def test_auto_screens_ep_on_pure_fsdp_beside_its_hsdp_choice(tmp_path, capsys):
    """OLMoE-1B-7B on 64 H100s: auto's groups chose HSDP 2x32 and its EP screen ran there and on the other HSDP
    layouts only (136 ms at EP 8); pure FSDP with EP 8 (127 ms, `--ep 8 --mesh 1x64`) was never tried. Now it is,
    and auto keeps the fastest option of its screen (with the experts in their blocks' calls, EP 8 on 2x32 138 ms
    beside 140 ms on 1x64 when written)."""
    model = _config(tmp_path, "olmoe", OLMOE)
    out = tmp_path / "plan.json"
    assert main(["plan", model, "--policy", "auto", "--cluster", "h100:64", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    err = captured.err
    screen = next(line for line in err.splitlines() if "auto's EP screen" in line)
    steps = {m[1]: float(m[2]) for m in re.finditer(r"(no EP|EP \d+(?: \([^()]*\))?(?: on \d+x\d+)?) ([\d.]+) ms",
                                                    screen)}
    assert any(name.startswith("EP 8") and name.endswith(" on 1x64") for name in steps), steps  # pure FSDP's too
    said = re.search(r"\bstep ([\d.]+) ms", captured.out + err)  # auto's own line
    written = json.loads(out.read_text())
    assert written["expert_parallel"]["degree"] == 8 and said is not None and float(said[1]) == min(steps.values())


@pytest.mark.integration  # a fit search of a tiny model: a few seconds
def test_fit_says_a_longest_sequence_past_the_configured_positions(tmp_path, capsys):
    """A rotary model's longest sequence is bounded by memory alone (Pythia's fit answered 86,016 where its config
    says 2,048, and said so only in a note --quiet hides): the answer line says it."""
    model = _config(tmp_path, "m", {**MISTRAL, "max_position_embeddings": 64, "sliding_window": None})
    assert main(["fit", model, "--cluster", "h100:2", "--find", "seq", "--batch", "1", "--seq", "32",
                 "--memory-budget", "40MB", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "(past the config's max_position_embeddings, 64: its rotary positions compute any length, but it was " \
           "not configured for this one)" in out, out


def test_an_encoder_planned_as_a_causal_lm_is_said(tmp_path, capsys):
    """RoBERTa was planned as transformers' causal-LM form without a word; a decoder's plan says nothing of it."""
    for data, said in ((ROBERTA, True), (MISTRAL, False)):
        capsys.readouterr()
        assert main(["plan", _config(tmp_path, data["model_type"], data), "--policy", "titan", "--cluster", "h100:8",
                     "--seq", "32"]) == 0
        assert ("roberta is an encoder (a masked LM), planned as transformers builds it for causal LM"
                in capsys.readouterr().err) == said


def test_auto_says_why_it_screens_no_tp(tmp_path, capsys):
    """Gemma 3 1B has one kv head: auto's layouts had no TP and no word why (``--tp 2`` said it)."""
    model = _config(tmp_path, "one_kv", {**MISTRAL, "num_key_value_heads": 1, "sliding_window": None})
    assert main(["plan", model, "--policy", "auto", "--cluster", "h100:8", "--seq", "32"]) == 0
    assert ("auto screens no tensor parallelism here: --tp 2 is refused (--tp 2 must divide the model's 4 attention "
            "heads and 1 kv heads: choose a degree that divides both), and so is every larger degree"
            ) in capsys.readouterr().err


def test_a_config_transformers_cannot_build_from_is_said_in_one_line(tmp_path, capsys):
    """A DBRX config without attn_config.rope_theta: transformers' own modelling code raised AttributeError while
    building it, which every command reported as "internal error" (a new user's trial). The config's fault, said in
    one line naming what transformers raised."""
    dbrx = {"model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 64, "vocab_size": 256,
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8},
            "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}}
    assert main(["plan", _config(tmp_path, "dbrx", dbrx), "--policy", "titan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err
    assert err.startswith("error: transformers could not build its dbrx model from this config (AttributeError: ")
    assert "rope_theta" in err



RESNET = {"architectures": ["ResNetForImageClassification"], "model_type": "resnet", "num_channels": 3,
          "embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "layer_type": "basic", "num_labels": 10}


def test_a_cnn_config_without_an_image_size_plans_at_imagenet_s(tmp_path, capsys):
    """ResNet's config leaves the resolution to its preprocessor: planning it raised AttributeError 'image_size'
    (a trial's microsoft/resnet-50), with no way round it. It is planned at 224x224 and says so; an image_size in
    the file is taken."""
    model = _config(tmp_path, "resnet", RESNET)
    pixels = load_model(ModelSpec(model, batch_size=2), meta=True).example_inputs["pixel_values"]
    assert pixels.shape == (2, 3, 224, 224)
    assert main(["plan", model, "--cluster", "h100:8", "--policy", "titan"]) == 0
    err = capsys.readouterr().err
    assert "the resnet config gives no image size (its preprocessor does): planned at 224x224" in err
    sized = _config(tmp_path, "resnet32", {**RESNET, "image_size": 32})
    assert load_model(ModelSpec(sized, batch_size=2), meta=True).example_inputs["pixel_values"].shape == (2, 3, 32, 32)
    assert main(["plan", sized, "--cluster", "h100:8", "--policy", "titan"]) == 0
    assert "gives no image size" not in capsys.readouterr().err


ZAMBA2 = {"model_type": "zamba2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4, "attention_head_dim": 16,
          "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "mamba_headdim": 16,
          "n_mamba_heads": 8, "num_mem_blocks": 1, "use_shared_attention_adapter": False, "adapter_rank": 8,
          "use_mem_rope": True, "max_position_embeddings": 4096, "hybrid_layer_ids": [2, 5],
          "layers_block_type": ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba", "mamba"],
          "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def test_a_hybrid_layer_holding_a_mamba_layer_leaves_no_plain_mamba_layer_to_the_root(tmp_path):
    """Zamba2's hybrid layers each wrap a Mamba layer of the class stacked between them: that class was taken for a
    piece of the hybrid block, and the module and titan policies left the 32 plain Mamba layers of Zamba2-1.2B (75%
    of its params) to the root (a trial). Both classes are blocks, as transformers' _no_split_modules says, and
    the blocks are the stack's layers, never a layer inside one."""
    from fsdp_planner.planners.classic import ModuleWrapPolicy, TorchtitanPolicy
    from fsdp_planner.service.tracing import trace_spec

    tr = trace_spec(ModelSpec(_config(tmp_path, "zamba2", ZAMBA2), seq_len=32))
    assert set(tr.index.checkpoint_block_classes) == {"Zamba2HybridLayer", "Zamba2MambaDecoderLayer"}
    assert tr.index.block_instances == tuple(f"model.layers.{i}" for i in range(8))
    titan = TorchtitanPolicy().plan(tr)
    # (the hybrid layers share one attention block: its params go with the first layer that holds it)
    assert [g.modules[0] for g in titan.inner_groups][1:9] == [f"model.layers.{i}" for i in range(8)]
    wrapped = {m for g in ModuleWrapPolicy().plan(tr).inner_groups for m in g.modules}
    assert {f"model.layers.{i}" for i in range(8)} | {"model.layers.2.mamba_decoder"} <= wrapped  # (as Accelerate)


SWITCH = {"model_type": "switch_transformers", "vocab_size": 256, "d_model": 32, "d_kv": 8, "d_ff": 64,
          "expert_capacity": 64, "num_layers": 2, "num_sparse_encoder_layers": 1, "num_decoder_layers": 2,
          "num_sparse_decoder_layers": 1, "num_heads": 4, "num_experts": 4, "router_bias": False,
          "router_jitter_noise": 0.0, "router_dtype": "float32", "relative_attention_num_buckets": 8,
          "relative_attention_max_distance": 16, "dropout_rate": 0.0, "is_encoder_decoder": True,
          "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}


def test_experts_looked_up_by_a_formatted_index_trace_and_their_skips_are_found(tmp_path, capsys):
    """Switch Transformers (and NLLB-MoE) look each hit expert up by name, ``self[f"expert_{idx[0]}"]``, with an
    index from ``nonzero``: torch formats a meta or fake scalar as its repr, so the key was "expert_tensor(...)"
    and planning failed with a KeyError that blamed the factory (a trial). The index formats as the stand-in's
    value. Their loop calls only the experts hit, so a rank whose batch routes an expert nothing reduce-scatters
    fewer grads than its peers (2 gloo ranks aborted in a reduce-scatter): check says so, as it does for a guard
    on an expert's tokens."""
    model = _config(tmp_path, "switch", SWITCH)
    assert main(["plan", model, "--cluster", "h100:8", "--policy", "titan", "--seq", "32"]) == 0
    err = capsys.readouterr().err
    assert "aten._local_scalar_dense (.item(), bool(), int(), a scalar formatted) in " \
        "'encoder.block.1.layer.1.mlp.experts'" in err
    assert main(["check", model, "--policy", "titan", "--seq", "32", "--json"]) == 1
    (skips,) = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "routing-skips"]
    assert skips["module"] == "encoder.block.1.layer.1.mlp.experts.expert_3"
    assert "decoder.block.1.layer.2.mlp.experts.expert_3" in skips["message"]


JETMOE = {"model_type": "jetmoe", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
          "num_key_value_heads": 4, "kv_channels": 16, "intermediate_size": 128, "max_position_embeddings": 128,
          "activation_function": "silu", "num_local_experts": 8, "num_experts_per_tok": 2,
          "tie_word_embeddings": True, "rms_norm_eps": 1e-06}


def test_a_layer_whose_experts_are_called_through_a_method_is_one_module_of_its_group(tmp_path):
    """JetMoE's attention calls its experts' ``map`` and ``reduce``, which call the experts' linears: those linears
    were taken as called outside every module above them, so the order policy listed each layer's eight pieces, not
    the layer, and FSDP2 gathered each group twice a forward and held it (JetMoE-8B on 8 H100s: 714 ms, every
    param unsharded at once; 427 ms and one layer's so). The layer encloses those calls: it is the group's module.
    Real FSDP2 on 8 fake ranks: one all-gather a group in forward and one in backward, every count exact."""
    from fsdp_planner.planners.order import ExecutionOrderPolicy
    from fsdp_planner.service.tracing import trace_spec

    spec = _config(tmp_path, "jetmoe", JETMOE)
    tr = trace_spec(ModelSpec(spec, batch_size=2, seq_len=32))
    assert "model.layers.0.self_attention.experts" in tr.index.not_enclosing  # (its map does not run its forward)
    assert "model.layers.0" not in tr.index.not_enclosing
    plan = ExecutionOrderPolicy().plan(tr)
    assert [list(g.modules) for g in plan.inner_groups] == [["model.embed_tokens", "lm_head", "model.layers.0"],
                                                           ["model.layers.1", "model.norm"]]
    assert main(["verify", spec, "--policy", "order", "--batch", "2", "--seq", "32", "--fake-world-size", "8"]) == 0


RECURRENT_GEMMA = {"model_type": "recurrent_gemma", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 192,
                   "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1, "lru_width": 64,
                   "attention_window_size": 64, "conv1d_width": 4, "logits_soft_cap": 30.0, "head_dim": 16,
                   "block_types": ["recurrent", "recurrent", "attention"], "partial_rotary_factor": 0.5}


def test_a_loop_over_the_tokens_in_the_model_s_code_is_said(tmp_path, capsys):
    """RecurrentGemma's RG-LRU scan runs in transformers as a Python loop over the sequence (about 9 ops a token):
    its step was priced launch-bound (2.84 s for the 2B on 8 H100s at 2,048 tokens) with nothing said. The note
    names the class and its ops a call; a model without such a loop (Mistral's) has none."""
    spec = _config(tmp_path, "recurrent_gemma", RECURRENT_GEMMA)
    assert main(["plan", spec, "--policy", "module", "--seq", "256", "--cluster", "h100:8"]) == 0
    said = re.search(r"RecurrentGemmaRglru runs ([\d,]+) ops a call \(([\d.]+) a token of 256", capsys.readouterr().err)
    assert said and int(said[1].replace(",", "")) >= 2 * 256 and float(said[2]) >= 2
    assert main(["plan", _config(tmp_path, "mistral", MISTRAL), "--policy", "module", "--seq", "4096"]) == 0
    assert "ops a call (" not in capsys.readouterr().err


@pytest.mark.integration  # a 2-rank torchrun job of the tiny LLaVA: ~20 s
def test_the_llava_example_plans_and_trains_its_towers_and_language_model():
    """Image-text models are refused from ``hf:`` (token ids alone would never run their towers); the docs' LLaVA
    factory plans the whole model: every param of the vision tower, projector and language model traced (the tower
    frozen, no grads), and it trains on 2 gloo ranks with parity."""
    import os

    from fsdp_planner.service.tracing import trace_spec

    os.environ.pop("LLAVA_CONFIG", None)
    tr = trace_spec(ModelSpec("docs/examples/llava.py:build"))
    prefixes = ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head.")
    assert {p.fqn.split(".")[0] + "." + p.fqn.split(".")[1] + "." if p.fqn.startswith("model.") else "lm_head."
            for p in tr.params} == set(prefixes)
    tower = [p for p in tr.params if p.fqn.startswith(prefixes[0])]
    assert tower and not any(p.requires_grad for p in tower) and all(p.requires_grad for p in tr.params
                                                                     if not p.fqn.startswith(prefixes[0]))
    assert main(["verify", "docs/examples/llava.py:build", "--policy", "titan", "--nproc", "2", "--steps", "2"]) == 0
    # (a fresh process: transformers' LLaVA imports torchao, whose CUDA kernels a CPU build cannot load, lines on
    # stderr that say nothing of the job)
    r = subprocess.run([sys.executable, "-m", "fsdp_planner", "plan", "docs/examples/llava.py:build", "--policy",
                        "titan"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "Failed to load" not in r.stderr and "register_constant" not in r.stderr, r.stderr


def test_a_backbone_config_planned_with_a_classifier_says_so(tmp_path, capsys):
    """DINOv2's config names Dinov2Model, a backbone: it was planned as transformers' image classifier, a 2-class
    head past the published count, with no word (a trial). Said with the head's params; a classifier's config
    (ViTForImageClassification) has no such note."""
    small = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128,
             "image_size": 32, "patch_size": 8}
    dino = _config(tmp_path, "dinov2", {"model_type": "dinov2", "architectures": ["Dinov2Model"], **small})
    assert main(["plan", dino, "--policy", "module", "--batch", "2"]) == 0
    assert "the config names Dinov2Model, no classifier: planned as transformers' image classifier of it, with a " \
        "2-class head (258 params)" in " ".join(capsys.readouterr().err.split())  # (2 x 2 x 64 + 2: CLS and patches)
    vit = _config(tmp_path, "vit", {"model_type": "vit", "architectures": ["ViTForImageClassification"], **small})
    assert main(["plan", vit, "--policy", "module", "--batch", "2"]) == 0
    assert "no classifier" not in capsys.readouterr().err


def test_a_decoder_config_naming_a_classifier_is_planned_as_its_causal_lm_and_says_so(tmp_path, capsys):
    """A Mistral config naming MistralForSequenceClassification (3 labels) was planned as the causal LM, its
    vocabulary head and logits included, without a word (a trial); said now, with the head's params; a config
    naming the causal LM has no such note."""
    cls = _config(tmp_path, "cls", {**MISTRAL, "architectures": ["MistralForSequenceClassification"], "num_labels": 3})
    assert main(["plan", cls, "--policy", "module", "--batch", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "the config names MistralForSequenceClassification: planned as transformers' causal LM of it (the task " \
           "follows model_type), with its vocabulary head (" in err
    backbone = _config(tmp_path, "backbone", {**MISTRAL, "architectures": ["MistralModel"]})  # (an embedding model)
    assert main(["plan", backbone, "--policy", "module", "--batch", "2"]) == 0
    assert "next-token loss, which that backbone has not" in " ".join(capsys.readouterr().err.split())
    lm = _config(tmp_path, "lm", {**MISTRAL, "architectures": ["MistralForCausalLM"]})
    assert main(["plan", lm, "--policy", "module", "--batch", "2"]) == 0
    assert "the config names" not in capsys.readouterr().err


def test_a_config_asking_for_untied_embeddings_that_transformers_ties_says_so(tmp_path, capsys):
    """T5's config class forces tie_word_embeddings (transformers 5): a T5 v1.1 config asking for untied
    embeddings was built tied, one embedding fewer than its checkpoint, without a word (a trial); said now, and not
    for a config that ties them itself."""
    t5 = {"model_type": "t5", "d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 1,
          "num_decoder_layers": 1, "vocab_size": 128, "decoder_start_token_id": 0}
    untied = _config(tmp_path, "untied", {**t5, "tie_word_embeddings": False})
    assert main(["plan", untied, "--policy", "module", "--batch", "2", "--seq", "16"]) == 0
    assert "the config sets tie_word_embeddings false, and transformers" in capsys.readouterr().err
    tied = _config(tmp_path, "tied", {**t5, "tie_word_embeddings": True})
    assert main(["plan", tied, "--policy", "module", "--batch", "2", "--seq", "16"]) == 0
    assert "tie_word_embeddings" not in capsys.readouterr().err


def test_a_config_naming_its_own_code_is_planned_as_transformers_class_and_says_so(tmp_path, capsys):
    """A config with ``auto_map`` (a ``trust_remote_code`` model) was planned as plain Mistral without a word: its
    code is never run (a marker it would write stays absent), and a note names what was planned instead."""
    marker = tmp_path / "ran"
    (tmp_path / "modeling_own.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    own = {**MISTRAL, "auto_map": {"AutoModelForCausalLM": "modeling_own.OwnForCausalLM"}}
    for data, said in ((own, True), (MISTRAL, False)):
        capsys.readouterr()
        assert main(["plan", _config(tmp_path, f"own{said}", data), "--policy", "titan", "--cluster", "h100:8",
                     "--seq", "32"]) == 0
        assert ("the config's auto_map names its own code (\"modeling_own.OwnForCausalLM\" for AutoModelForCausalLM), "
                "which fsdp-planner never runs: the model planned is transformers' own \"mistral\" class"
                in capsys.readouterr().err) == said
    assert not marker.exists()
