"""Hugging Face models from configs (``hf:``): shipped numbers, workload options, MoE tracing, real training."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_main

pytest.importorskip("transformers")

from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.models import ModelSpec, hf, load_model
from fsdp_planner.trace import record

TINY = {
    "tiny-llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                   "max_position_embeddings": 32},
    "tiny-gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
                  "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0},
    "tiny-mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 32},
    # multi-head latent attention: query/key heads of 48 (32 + 16 rotary), value heads of 32
    "tiny-deepseek-v3": {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                         "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
                         "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "v_head_dim": 32,
                         "qk_nope_head_dim": 32, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                         "first_k_dense_replace": 1, "max_position_embeddings": 64},
    # soft-capping and sliding windows: transformers builds it eager and refuses sdpa
    "tiny-gemma2": {"model_type": "gemma2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "max_position_embeddings": 256, "sliding_window": 64, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    # a speech encoder-decoder: log-mel frames through two convolutions, a decoder of learned positions
    "tiny-whisper": {"model_type": "whisper", "vocab_size": 256, "d_model": 32, "encoder_layers": 1,
                     "decoder_layers": 1, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                     "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_mel_bins": 8, "max_source_positions": 16,
                     "max_target_positions": 24, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
                     "decoder_start_token_id": 1},
    # two towers, pretrained on their contrastive loss (SigLIP's temperature is a 1-element tensor, CLIP's 0-dim)
    "tiny-siglip": {"model_type": "siglip",
                    "text_config": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 16},
                    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8}},
}


def tiny(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(TINY[name]))
    return f"hf:{path}"


def flops(tr) -> int:  # type: ignore[no-untyped-def]
    return sum(e.flops for e in tr.events)


def traced(spec: str):  # type: ignore[no-untyped-def]
    lm = load_model(spec)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)


# The public checkpoints' parameter counts (their config.json numbers built by transformers).
SHIPPED_PARAMS = {
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "qwen2.5-3b": 3_085_938_688, "gpt2": 124_439_808,
    "mixtral-8x7b": 46_702_792_704, "deepseek-v3": 671_026_404_352,
    "gemma2-9b": 9_241_705_984, "t5-3b": 2_851_598_336, "vit-h14": 632_045_800,
    # Qwen3 (torchtitan's qwen3 flavours): what transformers builds, each its model card's total when rounded as it
    "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200, "qwen3-32b": 32_762_123_264, "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672, "moonlight-16b-a3b": 15_960_108_544,
    "phi3-mini": 3_821_079_552, "phi4": 14_659_507_200,  # the model cards' 3.8B and 14.7B
    # Qwen3.5's text decoders, built from torchtitan's qwen3_5 flavour numbers (the model cards' totals count the
    # vision encoder too)
    "qwen3.5-9b": 8_953_803_264, "qwen3.5-27b": 26_895_998_464, "qwen3.5-35b-a3b": 34_660_610_688,
    "qwen3.5-397b-a17b": 396_346_350_336, "qwen3-next-80b-a3b": 79_674_391_296,  # its card's "80B in total"
    # torchtitan's flavours (b5bcd76): the params of torchtitan's own build of each, on meta
    "titan-qwen3-debugmodel": 31_987_968, "titan-qwen3-debugmodel-moe": 315_758_848,
    "titan-deepseek-v3-debugmodel": 33_014_016, "titan-deepseek-v3-16b": 15_706_484_224,
    "titan-deepseek-v3-236b": 235_741_434_880, "titan-gpt-oss-debugmodel": 81_489_440,
}
# the Qwen3 model cards' "Number of Parameters" (huggingface.co/Qwen/Qwen3-*)
QWEN3_CARDS = {"qwen3-0.6b": "0.6", "qwen3-1.7b": "1.7", "qwen3-4b": "4.0", "qwen3-8b": "8.2", "qwen3-14b": "14.8",
               "qwen3-32b": "32.8", "qwen3-30b-a3b": "30.5", "qwen3-235b-a22b": "235"}


def test_every_shipped_config_builds_on_meta_with_its_checkpoints_parameter_count():
    assert set(SHIPPED_PARAMS) == set(hf.SHIPPED)
    for name, count in SHIPPED_PARAMS.items():
        model = load_model(f"hf:{name}").model
        params = list(model.parameters())
        assert all(p.is_meta and p.dtype == torch.float32 for p in params), name
        assert sum(p.numel() for p in params) == count, name
    for name, card in QWEN3_CARDS.items():  # billions, to the card's decimals
        assert f"{SHIPPED_PARAMS[name] / 1e9:.{len(card.partition('.')[2])}f}" == card, name


def test_tied_configs_tie_their_embeddings():
    qwen = load_model("hf:qwen2.5-3b").model
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    llama = load_model("hf:llama3-8b").model
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight


def test_hf_llama3_8b_traces_as_the_builtin_llama3_8b():
    ours, theirs = traced("hf:llama3-8b"), traced("llama3-8b")
    assert ours.numel == theirs.numel == 8_030_261_248
    assert flops(ours) == flops(theirs)
    # the loss runs outside the forward as for the built-in: the fp32 logits and their gradient are counted
    assert max(e.live for e in ours.events) == pytest.approx(max(e.live for e in theirs.events), rel=1e-3)


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
def test_hf_mixtral_traces_with_token_balanced_routing():
    """The router runs, experts get an even share: the built-in Mixtral's FLOPs, every expert weight gets a grad."""
    ours, theirs = traced("hf:mixtral-8x7b"), traced("mixtral-8x7b")
    assert ours.numel == theirs.numel
    assert flops(ours) == flops(theirs)
    experts = [p for p in ours.params if ".experts." in p.fqn or ".gate." in p.fqn]
    assert len(experts) == 3 * 32 and all(p.gets_grad for p in experts)


def test_real_tensors_take_transformers_own_expert_routing(tmp_path):
    spec = tiny(tmp_path, "tiny-mixtral")
    lm = load_model(spec, meta=False)
    ours = lm.model(**lm.example_inputs).logits
    lm.model.set_experts_implementation("eager")  # transformers' reference loop over the routed experts
    assert torch.allclose(ours, lm.model(**lm.example_inputs).logits, atol=1e-5)


def test_workload_options_reach_the_inputs(tmp_path):
    spec = tiny(tmp_path, "tiny-llama")
    assert load_model(spec).example_inputs["input_ids"].shape == (1, 32)  # max_position_embeddings
    lm = load_model(ModelSpec(spec, batch_size=3, seq_len=16))
    assert lm.example_inputs["input_ids"].shape == (3, 16)
    t5 = load_model(ModelSpec("hf:t5-3b", batch_size=2, seq_len=64)).example_inputs
    assert t5["input_ids"].shape == (2, 64) and t5["labels"].shape == (2, 16)
    vit = load_model(ModelSpec("hf:vit-h14", batch_size=4)).example_inputs
    assert vit["pixel_values"].shape == (4, 3, 224, 224) and vit["labels"].shape == (4,)
    assert ModelSpec("hf:llama3-8b").label() == "hf:llama3-8b, batch 1, seq 8,192"
    with pytest.raises(PlannerError, match="--seq does not apply to 'hf:vit-h14'"):
        load_model(ModelSpec("hf:vit-h14", seq_len=128))


def test_a_model_directory_is_read_through_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY["tiny-gpt2"]))
    model = load_model(f"hf:{tmp_path}").model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_real_builds_are_deterministic_per_seed(tmp_path):
    spec = tiny(tmp_path, "tiny-llama")
    a, b, c = (load_model(spec, meta=False, seed=s).model for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))


@pytest.mark.parametrize(("content", "message"), [
    (None, "is neither a shipped config"),
    ("[1, 2]", "must hold a JSON object"),
    ("{\"hidden_size\": 8}", "has no \"model_type\""),
    # transformers' own message lists its 800 types cut short: the closest are named instead (a new user's finding)
    ("{\"model_type\": \"no-such-architecture\"}", r"has no model_type \"no-such-architecture\" \(a newer "),
    ("{\"model_type\": \"lama\"}", r"has no model_type \"lama\": did you mean llama or "),
    ("{\"model_type\": \"llama\", \"rope_scaling\": 5}", "transformers cannot make a 'llama' config: "),
    ("{\"model_type\": \"wav2vec2\"}", "model type 'wav2vec2' is not supported"),
    ("{\"model_type\": ", "is not valid JSON"),
    # transformers reads a repeated key's last value: which one the user meant is unknown
    ("{\"model_type\": \"llama\", \"num_hidden_layers\": 2, \"num_hidden_layers\": 4}",
     "the key \"num_hidden_layers\" appears twice in one object"),
    ("{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_attention_heads\": 4, \"num_key_value_heads\": 8}",
     r"num_key_value_heads \(8\) must divide num_attention_heads \(4\): set num_key_value_heads"),
    # image-text models: token ids alone would trace the text model (Mllama's causal LM is it), never the step
    ("{\"model_type\": \"mllama\"}", r"'mllama' reads images or audio beside text, .* with a factory that builds "
     r"it from this config and returns its inputs .* as docs/your-model.md shows$"),
    ("{\"model_type\": \"gemma3\"}", r"text_config as a config of its own \(\"model_type\": \"gemma3_text\"\)"),
    ("{\"model_type\": \"llama\", \"hidden_act\": \"__import__('os')\"}",
     r"hidden_act \"__import__\('os'\)\" is not an activation transformers knows \(e.g. "),
    # a checkpoint's config shrunk to a small vocabulary, its pad id kept (SmolLM3's 128004)
    ("{\"model_type\": \"llama\", \"vocab_size\": 256, \"pad_token_id\": 128004}",
     r"pad_token_id \(128004\) is outside its vocab_size \(256\): set \"pad_token_id\" below 256"),
    # these raised KeyError: 'evil' and topk's "k not in range" from inside transformers (a trial's findings)
    ("{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": \"evil\"}}",
     r"rope_type 'evil' is not one transformers knows: default, dynamic, linear"),
    ("{\"model_type\": \"mixtral\", \"num_local_experts\": 0}", r"num_local_experts is 0: a MoE layer needs"),
    ("{\"model_type\": \"mixtral\", \"num_local_experts\": 4, \"num_experts_per_tok\": 100}",
     r"num_experts_per_tok \(100\) must be from 1 to its num_local_experts \(4\)"),
])
def test_bad_configs_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlannerError, match=message):
        load_model(f"hf:{path}")


def test_an_encoder_decoder_config_without_a_decoder_start_token_is_one_line():
    config = {"model_type": "t5", "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 1, "num_heads": 4,
              "vocab_size": 32, "pad_token_id": 0}
    with torch.device("meta"), pytest.raises(PlannerError, match=r"no decoder_start_token_id: set "
                                             r"\"decoder_start_token_id\" in the config file .* \(e.g. 0, its pad"):
        hf.build_model(config)


def test_whisper_trains_its_encoder_on_log_mel_frames_and_its_decoder_on_the_labels(tmp_path):
    """transformers also maps "whisper" to a causal LM, its decoder alone: the plan must be of the whole model."""
    lm = load_model(ModelSpec(tiny(tmp_path, "tiny-whisper"), batch_size=2, seq_len=10))
    assert type(lm.model).__name__ == "WhisperForConditionalGeneration"
    assert lm.example_inputs["input_features"].shape == (2, 8, 32)  # twice the encoder's 16 positions
    assert lm.example_inputs["labels"].shape == (2, 10)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    assert any(e.module.startswith("model.encoder.conv1") for e in tr.events)  # the conv front end is traced
    assert hf.learned_positions(lm.model) == ("model.decoder.embed_positions", 24)  # fit's longest --seq
    with pytest.raises(PlannerError, match=r"--seq 25 is longer than the model's 24 learned positions \(model.dec"):
        load_model(ModelSpec(tiny(tmp_path, "tiny-whisper"), seq_len=25))


def test_an_encoder_decoder_checkpoints_its_encoder_layers_too(tmp_path):
    """Whisper's encoder and decoder layers are two classes: the block class is the decoder's (more params), and
    checkpointing it alone left the encoder's activations saved in full (hf:whisper-large at batch 64: 137 GiB of
    activations under --ac full, 'nothing fits on 4,096 GPUs'). Both kinds are blocks now; real FSDP2 agrees."""
    from fsdp_planner.fsdp2.checkpointing import ACMode, checkpointed_blocks
    from fsdp_planner.service.tracing import trace_spec

    path = tmp_path / "whisper2.json"
    path.write_text(json.dumps({**TINY["tiny-whisper"], "encoder_layers": 2, "decoder_layers": 2}))
    spec = ModelSpec(f"hf:{path}", batch_size=2, seq_len=10)
    tr = trace_spec(spec)
    assert tr.index.checkpoint_block_classes == ("WhisperDecoderLayer", "WhisperEncoderLayer")
    assert checkpointed_blocks(tr, ACMode.FULL) == ["model.encoder.layers.0", "model.encoder.layers.1",
                                                     "model.decoder.layers.0", "model.decoder.layers.1"]
    # the order policy's first group (the two convs and embed_positions, whose weight the encoder adds itself,
    # never calling the module) cannot run: it joins the encoder's first layer's group, as one fixes it by hand
    from fsdp_planner.fsdp2.validity import check_plan_runs
    from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy

    for ac in (None, ACMode.FULL):
        plan = make_policy(PolicyRequest(PolicyName.ORDER, checkpointing=ac)).plan(tr)
        check_plan_runs(tr, plan)
        assert plan.policy.endswith(", 1 group joined to run")
        assert plan.inner_groups[0].modules[:3] == ("model.encoder.conv1", "model.encoder.conv2",
                                                     "model.encoder.embed_positions")
        assert "model.encoder.layers.0" in plan.inner_groups[0].modules


# the hidden states large beside the params: a block's checkpointed input is 2-3% of the peak, which is in the loss
# (with grouped-query attention; with four key-value heads it is in the second block's backward)
WIDE_HIDDEN = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 3, "vocab_size": 1024, "max_position_embeddings": 128}


@pytest.mark.integration
@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_full_checkpointing_keeps_the_first_blocks_input(tmp_path, model_type):
    """A transformers Llama hands the embeddings' output to its rotary embedding first, a BERT to its encoder: the
    first block's checkpoint keeps it all the same (peaks -3.0% and -2.8% on 8 fake ranks at batch 64 when the
    model did not count it; -2% at 32)."""
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **WIDE_HIDDEN}))
    r = run_main("verify", f"hf:{path}", "--batch", "32", "--seq", "64", "--policy", "titan", "--ac", "full",
                 "--fake-world-size", "8", "--cluster", "h100:8", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["counts_and_bytes_exact"] and abs(result["peak_error"]) <= 0.005, result["peak_error"]


@pytest.mark.integration
def test_an_encoder_decoder_checkpointed_in_both_halves_verifies(tmp_path, capsys):
    path = tmp_path / "whisper2.json"
    path.write_text(json.dumps({**TINY["tiny-whisper"], "encoder_layers": 2, "decoder_layers": 2}))
    spec = ModelSpec(f"hf:{path}", batch_size=2, seq_len=10)
    assert main(["verify", spec.name, "--batch", "2", "--seq", "10", "--policy", "titan", "--ac", "full",
                 "--fake-world-size", "8"]) == 0
    assert "PASS" in capsys.readouterr().out
    out = tmp_path / "compiled.json"  # --compile compiles both kinds, as it checkpoints them
    assert main(["plan", spec.name, "--batch", "2", "--seq", "10", "--policy", "titan", "--compile", "--out",
                 str(out)]) == 0
    assert json.loads(out.read_text())["compiled"] == ["model.encoder.layers.0", "model.encoder.layers.1",
                                                        "model.decoder.layers.0", "model.decoder.layers.1"]
    shown = capsys.readouterr().out
    assert shown.splitlines()[1].endswith("; 4 modules compiled"), shown  # the plan's title says what it compiles


def test_a_two_tower_model_trains_both_towers_on_its_contrastive_loss(tmp_path):
    """transformers also maps "siglip" to an image classifier, its vision tower alone: both towers are planned."""
    lm = load_model(ModelSpec(tiny(tmp_path, "tiny-siglip"), batch_size=4))
    assert type(lm.model).__name__ == "SiglipModel"
    inputs = lm.example_inputs
    assert inputs["input_ids"].shape == (4, 16) and inputs["pixel_values"].shape == (4, 3, 32, 32)
    tr = record(lm.model, inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
    read = {e.module.split(".")[0] for e in tr.events if e.module}
    assert {"text_model", "vision_model"} <= read
    assert hf.learned_positions(lm.model) == ("text_model.embeddings.position_embedding", 16)  # fit's longest --seq
    with pytest.raises(PlannerError, match=r"--seq 17 is longer than the model's 16 learned positions \(text_mod"):
        load_model(ModelSpec(tiny(tmp_path, "tiny-siglip"), seq_len=17))


def test_an_encoder_decoder_whose_inputs_cannot_be_made_is_one_line(tmp_path):
    path = tmp_path / "s2t.json"
    path.write_text(json.dumps({"model_type": "speech_to_text", "d_model": 16, "encoder_layers": 1,
                                "decoder_layers": 1, "vocab_size": 32}))
    with pytest.raises(PlannerError, match="speech encoder-decoder without Whisper's log-mel input"):
        load_model(f"hf:{path}")


def test_without_transformers_the_user_is_told_to_install_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    hf.factory.cache_clear()
    try:
        with pytest.raises(PlannerError) as e:
            load_model("hf:gpt2")
        assert str(e.value) == hf.INSTALL_HINT
        assert main(["plan", "hf:gpt2", "--policy", "titan"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {hf.INSTALL_HINT}"]
    finally:
        hf.factory.cache_clear()


def test_shipped_configs_are_for_planning_only():
    assert main(["verify", "hf:gpt2", "--policy", "titan"]) == 2


@pytest.mark.integration
def test_goal_command_plans_hf_llama3_8b_offline():
    """The command as typed, in a process of its own with the Hub turned off (huggingface_hub reads
    ``HF_HUB_OFFLINE`` as it is imported)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "fsdp_planner", "plan", "hf:llama3-8b", "--policy", "auto", "--cluster",
                        "h100:64"], capture_output=True, text=True, timeout=480, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "8,030,261,248 params" in r.stdout and "auto:" in r.stdout and "within the budget" in r.stdout


@pytest.mark.integration
def test_hf_mixtral_gets_every_plan():
    """No plan fits one H100 at 64 GPUs (the experts' dim-0 padding, as for the built-in): a larger budget."""
    r = run_main("plan", "hf:mixtral-8x7b", "--cluster", "h100:64", "--memory-budget", "250GiB", "--json")
    assert r.returncode == 0, r.stderr
    names = [p["plan"]["policy"].split("(")[0] for p in json.loads(r.stdout)["plans"]]
    assert {"module", "titan", "order", "auto"} <= set(names)


@pytest.mark.integration
@pytest.mark.parametrize(("name", "policy"), [("tiny-llama", "auto"), ("tiny-gpt2", "auto"), ("tiny-mixtral", "titan")])
def test_tiny_hf_models_train_on_two_gloo_ranks(tmp_path, name, policy, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the ranks (processes of their own) build the model offline
    r = run_main("verify", tiny(tmp_path, name), "--policy", policy, "--nproc", "2", "--steps", "2",
                 "--time-steps", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout


def test_an_encoder_config_trains_as_a_causal_lm_decoder(tmp_path, capsys):
    """BERT is in transformers' causal-LM mapping only as a decoder: built so, with no warning to print."""
    from fsdp_planner.models import load_model

    config = tmp_path / "bert.json"
    config.write_text(json.dumps({"model_type": "bert", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "intermediate_size": 64}))
    lm = load_model(f"hf:{config}")
    assert type(lm.model).__name__ == "BertLMHeadModel" and lm.model.config.is_decoder
    assert main(["plan", f"hf:{config}", "--policy", "order", "--seq", "16"]) == 0
    err = capsys.readouterr().err
    assert "is_decoder" not in err and "bert is an encoder (a masked LM), planned as transformers builds it" in err


def test_a_sequence_beyond_learned_positions_is_one_line(tmp_path, capsys):
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 1, "n_head": 2,
                                  "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}))
    assert main(["plan", f"hf:{config}", "--policy", "order", "--seq", "1000"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --seq 1000 is longer than the model's 64 learned positions "
                                               "(transformer.wpe): give --seq 64 or less")
    assert main(["plan", f"hf:{config}", "--policy", "order", "--seq", "64"]) == 0


def test_check_names_an_hf_model_s_modules_by_their_real_path(tmp_path):
    """An HF causal LM keeps its body in ``model.model``: findings name ``model.embed_tokens`` (its path in
    ``named_modules``), never ``model.model.embed_tokens``, and only the fix's code reaches it from ``model``."""
    from fsdp_planner.fsdp2.pitfalls import Code, plan_findings
    from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy

    tr = traced(tiny(tmp_path, "tiny-llama"))
    plan = make_policy(PolicyRequest(PolicyName.MODULE)).plan(tr, "tiny-llama")
    [root] = [f for f in plan_findings(tr, plan) if f.code is Code.ROOT_PARAMS]
    assert root.module == "model.embed_tokens"
    assert "of model.embed_tokens, model.norm, lm_head:" in root.message and "model.model." not in root.message
    assert root.fix.startswith("give model.embed_tokens, model.norm, lm_head groups of their own")
    assert "fully_shard(model.model.embed_tokens)" in root.fix  # code: the user's variable, then the path


def test_tiny_deepseek_v3_traces_its_latent_attention(tmp_path):
    """Query/key heads of 48, value heads of 32: the fused stand-in gives the output the value's head size."""
    tr = traced(tiny(tmp_path, "tiny-deepseek-v3"))
    assert tr.numel == sum(p.numel() for p in load_model(tiny(tmp_path, "tiny-deepseek-v3")).model.parameters())


@pytest.mark.integration  # whole commands or two model builds: kept out of the fast subset
def test_flash_attention_plans_a_soft_capping_model_for_less_than_eager(tmp_path):
    """Gemma 2 (soft-capping): transformers builds it eager and refuses sdpa; --attention flash takes the fused
    stand-in, which keeps no score matrices."""
    spec = tiny(tmp_path, "tiny-gemma2")
    saved = {}
    for attention in ("eager", "flash"):
        lm = load_model(ModelSpec(spec, seq_len=256, attention=attention))
        assert hf.attention_of(lm.model) == ("eager" if attention == "eager" else "fsdp_planner_fused")
        tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=torch.bfloat16)
        saved[attention] = sum(e.saved for e in tr.events)
    scores = 2 * 4 * 256 * 256 * 2  # layers x heads x seq^2, one bf16 score matrix each
    assert saved["eager"] - saved["flash"] >= scores
    # asked for sdpa, one line naming the ones to give (it was transformers' ValueError: a new user's trial)
    with pytest.raises(PlannerError, match=r"^--attention sdpa: transformers' gemma2 does not support it: give "
                                           r"--attention flash or eager"):
        load_model(ModelSpec(spec, attention="sdpa"))


@pytest.mark.integration  # two traces of an MoE: a second
def test_the_routing_capacity_factor_reaches_hugging_face_experts(tmp_path):
    lm = load_model(tiny(tmp_path, "tiny-mixtral"))
    base = record(lm.model, lm.example_inputs, lm.loss_fn)
    wide = record(lm.model, lm.example_inputs, lm.loss_fn, routing=1.5)
    assert flops(wide) > flops(base)


@pytest.mark.integration  # ~6 s: two traces, one compiled
def test_a_compiled_transformers_block_keeps_the_gpu_s_attention_kernel(tmp_path):
    """transformers calls F.scaled_dot_product_attention: compiled, the block takes the fused kernel a GPU picks,
    as its eager trace does, not the math path that saves the heads x seq x seq probabilities (HF llama3-8b's block
    saved 9.6 GiB compiled against 1.7 eager before; 1.2 GiB now)."""
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions

    path = tmp_path / "long.json"
    path.write_text(json.dumps({**TINY["tiny-llama"], "max_position_embeddings": 512}))
    spec = ModelSpec(f"hf:{path}", seq_len=512)
    precision = SimOptions.named("bf16-mixed").precision
    eager = trace_spec(spec, precision)
    compiled = trace_spec(dataclasses.replace(spec, compile=True), precision)
    block = "model.layers.0"
    saved_eager = sum(e.saved for e in eager.events if e.is_op and not e.backward and e.module.startswith(block + "."))
    assert 0 < compiled.compiled[block].saved <= saved_eager  # 4 heads x 512 x 512 fp32 would be 4 MiB alone


@pytest.mark.integration  # ~11 s on a shared 2-core host: one MoE block compiled, plain and checkpointed
def test_a_transformers_moe_block_compiles_under_selective_checkpointing(tmp_path):
    """The experts stand-in read the routing capacity from a ContextVar, which dynamo cannot trace inside the
    checkpoint's higher-order op: every hf: MoE (Mixtral, Qwen3-MoE, DeepSeek) failed --compile with "Unsupported
    method call ... ContextVar.get"."""
    import copy

    from fsdp_planner.choices import SacPolicy
    from fsdp_planner.fsdp2.checkpointing import apply_checkpointing
    from fsdp_planner.trace.recorder import record_compiled

    def selective(block: torch.nn.Module) -> torch.nn.Module:
        block = copy.deepcopy(block)
        apply_checkpointing(block, [], {"": SacPolicy.TITAN})
        return block

    lm = load_model(tiny(tmp_path, "tiny-mixtral"))
    block = record_compiled(lm.model, lm.example_inputs, ["model.layers.0"], None, {"titan": selective})
    assert block["model.layers.0"].saved > 0


def test_a_positions_override_sets_the_default_sequence(tmp_path):
    """``--hf-config max_position_embeddings=N`` left the default sequence at the file's positions: a user config
    of 128 positions refused its own override to 8 ("--seq 128 is longer than the model's 8 learned positions"),
    and a larger override kept the file's."""
    spec = tiny(tmp_path, "tiny-llama")
    positions = TINY["tiny-llama"].get("max_position_embeddings", hf.DEFAULT_SEQ_CAP)
    assert ModelSpec(spec).workload()["seq_len"] == min(positions, hf.DEFAULT_SEQ_CAP)
    for given, seq in ((8, 8), (100_000, hf.DEFAULT_SEQ_CAP)):
        model = ModelSpec(spec, hf_config=(("max_position_embeddings", given),))
        assert model.workload()["seq_len"] == seq
        assert load_model(dataclasses.replace(model, hf_config=(*model.hf_config, ("num_hidden_layers", 1))),
                          meta=True).example_inputs["input_ids"].shape[1] == seq
    assert ModelSpec(spec, seq_len=4, hf_config=(("max_position_embeddings", 8),)).workload()["seq_len"] == 4
    assert ModelSpec("hf:llama3-8b", hf_config=(("max_position_embeddings", 1024),)).workload()["seq_len"] == 1024


@pytest.mark.parametrize(("version", "said"), [("5.25.0", False), ("4.57.6", False), ("5.26.0", True),
                                               ("5.26.0.dev0", True), ("6.0.0rc1", True)])
def test_a_transformers_newer_than_the_checked_ones_is_said(monkeypatch, version, said):
    """Each transformers release may change its TP plans and attention classes (5.25 did: 4 tests failed on it
    until they were read): a user with a newer release than pyproject.toml's bound hears so instead of a plan read
    otherwise silently."""
    import transformers

    from fsdp_planner.models import hf

    monkeypatch.setattr(transformers, "__version__", version)
    note = hf.version_note()
    assert (note is not None) == said
    assert note is None or note.startswith(f"transformers {version} is newer than the releases")
