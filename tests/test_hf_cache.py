"""Hugging Face models under checkpointing (issue 26): no KV cache in a training step, ``--hf-config``, the
recorded-outputs finding of ``check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import run_main

pytest.importorskip("transformers")

from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.checkpointing import apply_checkpointing
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.models.hf import parse_override

# Tiny configs of the families that crashed under --ac full with a cache: Gemma 2 (its mask and the keys of the
# recomputed forward disagree), T5 (checkpoint saved a different number of tensors); Qwen 3 records outputs.
TINY = {
    "gemma2": {"model_type": "gemma2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "max_position_embeddings": 128, "sliding_window": 16},
    "t5": {"model_type": "t5", "vocab_size": 256, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
           "num_decoder_layers": 2, "num_heads": 4, "decoder_start_token_id": 0, "pad_token_id": 0},
    "qwen3": {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128, "use_cache": True},
}


def tiny(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(TINY[name]))
    return f"hf:{path}"


@pytest.mark.parametrize(("text", "expected"), [
    ("use_cache=false", ("use_cache", False)), ("use_cache=true", ("use_cache", True)),
    ("num_hidden_layers=3", ("num_hidden_layers", 3)), ("rope_theta=1e4", ("rope_theta", 10000.0)),
    ("hidden_act=silu", ("hidden_act", "silu")), ('hidden_act="gelu"', ("hidden_act", "gelu")),
    ("pad_token_id=null", ("pad_token_id", None)),
])
def test_hf_config_values_read_as_json_scalars(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("use_cache", "takes KEY=VALUE"), ("=1", "takes KEY=VALUE"), ("a-b=1", "takes KEY=VALUE"),
    ("model_type=llama", "cannot change model_type"), ("layer_types=[1]", "must be true/false, a number or"),
    ("rope_theta=NaN", "must be a finite number"), ("hidden_size=1e400", "must be a finite number"),
    ("x=" + "1" * 300, "longer than 200"),
])
def test_bad_hf_config_is_one_line(text, message):
    with pytest.raises(PlannerError, match=message):
        parse_override(text)


@pytest.mark.integration  # builds and traces transformers models: about a second or more
def test_training_builds_without_a_cache_unless_asked(tmp_path):
    spec = tiny(tmp_path, "qwen3")  # its file says use_cache: true, as every Hub checkpoint does
    assert load_model(spec).model.config.use_cache is False
    asked = load_model(ModelSpec(spec, hf_config=(("use_cache", True), ("num_hidden_layers", 1))))
    assert asked.model.config.use_cache is True and len(asked.model.model.layers) == 1
    with pytest.raises(PlannerError, match="the 'qwen3' config has no field 'use_cash'"):
        load_model(ModelSpec(spec, hf_config=(("use_cash", False),)))
    for method in ("to_dict", "__class__", "__dict__"):  # attributes, not fields: transformers raised on them
        with pytest.raises(PlannerError, match=f"the 'qwen3' config has no field '{method}'"):
            load_model(ModelSpec(spec, hf_config=((method, 1),)))
    with pytest.raises(PlannerError, match="applies to hf: models, not 'toy-llama'"):
        ModelSpec("toy-llama", hf_config=(("use_cache", False),))


@pytest.mark.integration  # builds and traces transformers models: about a second or more
def test_hf_config_round_trips_through_the_job_and_the_plan(tmp_path, capsys):
    spec = ModelSpec(tiny(tmp_path, "qwen3"), 2, 16, hf_config=(("use_cache", True),))
    assert ModelSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.label().endswith("use_cache=true")
    out = tmp_path / "plan.json"
    common = [spec.name, "--batch", "2", "--seq", "16"]
    assert main(["plan", *common, "--policy", "module", "--hf-config", "use_cache=true", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["model"]["hf_config"] == {"use_cache": True}
    assert Plan.load(out).hf_config == {"use_cache": True}
    capsys.readouterr()
    assert main(["check", *common, "--plan", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the note naming the attention traced
    assert err == (f"error: plan file '{out}' was made with --hf-config use_cache=true; give the same to run it on "
                   "the same model")
    assert main(["check", *common, "--plan", str(out), "--hf-config", "use_cache=true"]) == 0
    hand = tmp_path / "hand.json"  # a hand-written plan (no 'model' key) is for any model: a new user's trial
    hand.write_text(json.dumps({"version": 1, "groups": [["model.layers.0"]]}))
    for command in (["check"], ["simulate", "--cluster", "h100:8"]):
        assert main([*command, *common, "--plan", str(hand), "--hf-config", "use_cache=true", "--quiet"]) == 0
    capsys.readouterr()
    code = tmp_path / "plan.py"
    assert main(["export", str(out), "--out", str(code)]) == 0
    assert "HF_CONFIG: dict[str, object] = {'use_cache': True}" in code.read_text()


def test_a_plan_file_s_hf_config_is_checked(tmp_path):
    doc = {"version": 1, "model": {"name": "hf:x", "hf_config": {"use_cache": [1]}}, "groups": [{"modules": [""]}]}
    with pytest.raises(PlannerError, match=r"'model\.hf_config' field \"use_cache\" must be a config field name"):
        Plan.from_json(json.dumps(doc))


class CacheWriter(nn.Module):
    """Records the cache arguments each call sees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[object, object]] = []

    def forward(self, x: torch.Tensor, cache: object = None, use_cache: bool = False) -> torch.Tensor:
        self.seen.append((cache, use_cache))
        return self.lin(x)


@pytest.mark.parametrize("selective", [False, True])
def test_a_checkpointed_layer_writes_no_cache(selective):
    """As transformers' GradientCheckpointingLayer: a checkpointed call gets use_cache=False and no cache, in
    the forward and in its recomputation; an uncheckpointed one keeps them."""
    from fsdp_planner.choices import SacPolicy

    model = nn.Sequential(CacheWriter(), CacheWriter())
    if selective:
        apply_checkpointing(model, [], {"0": SacPolicy.TITAN})
    else:
        apply_checkpointing(model, ["0"])
    x = torch.randn(2, 4, requires_grad=True)
    cache = object()
    model[1](model[0](x, cache=cache, use_cache=True), cache=cache, use_cache=True).sum().backward()
    assert model[0].seen == [(None, False), (None, False)]  # forward, then the recomputation in backward
    assert model[1].seen == [(cache, True)]


@pytest.mark.integration  # builds and traces transformers models: about a second or more
def test_check_warns_when_a_sub_model_that_records_outputs_is_sharded(tmp_path, capsys):
    spec = tiny(tmp_path, "qwen3")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "groups": [{"modules": ["model.layers.0"]}, {"modules": ["model"]},
                                                         {"modules": [""]}]}))
    assert main(["check", spec, "--seq", "16", "--plan", str(plan), "--json"]) == 0
    [found] = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "recorded-outputs"]
    assert (found["severity"], found["module"]) == ("warning", "model")
    assert "FSDPQwen3Model" in found["message"] and "_CAN_RECORD_REGISTRY[model.model]" in found["fix"]
    assert main(["check", spec, "--seq", "16", "--policy", "module", "--json"]) == 0  # layers and root only
    assert "recorded-outputs" not in [f["code"] for f in json.loads(capsys.readouterr().out)]


@pytest.mark.integration  # real FSDP2 on fake ranks, about 2 s each
@pytest.mark.parametrize(("name", "ac", "config"), [
    ("gemma2", "full", []), ("gemma2", "op", []), ("gemma2", "full", ["--hf-config", "use_cache=true"]),
    ("t5", "op", ["--hf-config", "use_cache=true"]),
])
def test_checkpointed_hf_models_pass_the_fake_world_check(tmp_path, capsys, name, ac, config):
    """Gemma 2 and T5 crashed under --ac full with transformers' default cache; now they run and their
    collectives and peak match real FSDP2 (exit 0: within the tolerance)."""
    args = ["verify", tiny(tmp_path, name), "--batch", "2", "--seq", "32", "--policy", "auto", "--ac", ac,
            "--fake-world-size", "8", *config]
    assert main(args) == 0, capsys.readouterr()


def test_a_sequence_past_max_position_embeddings_is_noted(tmp_path) -> None:
    """Rotary positions compute any length, so the step is planned as asked; past the config's
    max_position_embeddings a note says the model was configured for fewer (nothing said it before)."""

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 128, "max_position_embeddings": 256}))
    said = "longer than the config's max_position_embeddings (256)"
    r = run_main("plan", f"hf:{config}", "--policy", "titan", "--cluster", "h100:2", "--seq", "512")
    assert r.returncode == 0 and said in " ".join(r.stderr.split()), r.stderr[-2000:]
    r = run_main("plan", f"hf:{config}", "--policy", "titan", "--cluster", "h100:2", "--seq", "256")
    assert r.returncode == 0 and "max_position_embeddings" not in r.stderr
    # fit plans many lengths past it: said once (it was one note per length tried)
    r = run_main("fit", f"hf:{config}", "--cluster", "h100:2", "--find", "seq", "--batch", "1")
    assert r.returncode == 0 and " ".join(r.stderr.split()).count("max_position_embeddings") == 1, r.stderr[-2000:]


LLAVA = '''
import torch
from transformers import AutoConfig, LlavaForConditionalGeneration

TEXT = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
VISION = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 32}


def build(batch_size: int = 2, seq_len: int = 32):
    cfg = AutoConfig.for_model("llava", text_config=TEXT, vision_config=VISION, image_token_index=1000,
                               vision_feature_layer=-1, projector_hidden_act="gelu")
    cfg.text_config.use_cache = False
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    ids = torch.randint(0, 999, (batch_size, seq_len))
    ids[:, :16] = 1000  # (32 / 8)^2 patches, CLS dropped by the 'default' strategy
    labels = ids.clone()
    labels[:, :16] = -100
    inputs = {"input_ids": ids, "pixel_values": torch.randn(batch_size, 3, 32, 32), "labels": labels,
              "use_cache": False}
    return model, inputs, lambda out: out.loss
'''


@pytest.mark.integration  # plans and runs a transformers LLaVA under FSDP2 on fake ranks: seconds
@pytest.mark.parametrize("policy", ["auto", "titan", "order", "size", "module"])
def test_every_policy_shards_llava_so_its_vision_tower_still_records_hidden_states(tmp_path, policy):
    """LLaVA reads its vision tower's hidden states (transformers records them by the tower's class, which
    fully_shard swaps for FSDP<class>): no policy makes the tower a fully_shard target, and each plan runs."""
    (tmp_path / "llava.py").write_text(LLAVA)
    model, plan = f"{tmp_path / 'llava.py'}:build", tmp_path / f"{policy}.json"
    made = run_main("plan", model, "--policy", policy, "--cluster", "h100:8", "--out", str(plan))
    assert made.returncode == 0, made.stderr
    done = run_main("verify", model, "--plan", str(plan), "--fake-world-size", "8")
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    groups = [g["modules"] for g in json.loads(plan.read_text())["groups"]]
    assert not [m for ms in groups for m in ms if m in ("model.vision_tower", "model.language_model")], groups
    checked = run_main("check", model, "--plan", str(plan), "--json")
    assert "recorded-outputs" not in [f["code"] for f in json.loads(checked.stdout)]
