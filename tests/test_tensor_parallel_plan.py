"""Tensor parallelism in planning: where a layout comes from (transformers' plan, torchtitan's Llama, detected
column-then-row pairs), the degrees refused, ``--tp`` through the validator, job configs that keep their TP, and
auto's choice of the degree."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch.nn as nn

from fsdp_planner.configs.job_config import ACCELERATE, TORCHTITAN, read_config
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle, tensor_parallel_from_dict
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.registry import PolicyName, PolicyRequest
from fsdp_planner.planners.tensor_parallel import (
    PAIRS,
    PLAN_FILE,
    Layout,
    check_layout,
    head_linears,
    plan_layout,
    titan_llama_layout,
    tp_degrees,
    tp_layout,
)
from fsdp_planner.service.configured import configured
from fsdp_planner.service.planning import plan as plan_job
from fsdp_planner.service.planning import search
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.service.validate import Keywords, Spelling
from fsdp_planner.service.validate import plan_job as checked_job
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.tracing import trace

FIXTURES = Path(__file__).parent / "fixtures" / "torchtitan"
H100_8 = parse_cluster("h100:8")


class Pair(nn.Module):
    """A column-then-row pair: hidden -> inner -> hidden, with an element-wise op between."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.down(self.up(x).relu())


def traced(module: nn.Module, hidden: int):  # type: ignore[no-untyped-def]
    import torch

    return trace(module, (torch.randn(2, 4, hidden),))


# -- where a layout comes from ----------------------------------------------------------------------------------------
def test_transformers_plan_for_hf_models():
    """transformers' own plan of the config class, under the base model's prefix, with the vocab-sharded input
    embedding and the LM head's gathered output (colwise_gather_output: it was left whole with a note)."""
    from transformers import LlamaConfig

    spec = ModelSpec("hf:llama3-8b", seq_len=64, hf_config=(("num_hidden_layers", 2),))
    layout = tp_layout(trace_spec(spec), 4, spec)
    expected = {f"model.{k}": v for k, v in LlamaConfig.base_model_tp_plan.items()}
    assert {k: s.value for k, s in layout.tp.layout.items() if k.startswith("model.") and k != "model.embed_tokens"} \
        == expected
    assert layout.tp.layout["model.embed_tokens"] is TPStyle.EMBEDDING
    assert layout.tp.layout["lm_head"] is TPStyle.COLWISE_GATHER
    assert layout.heads == (32, 8) and not layout.tp.loss_parallel
    (note,) = layout.notes  # what a user comparing it with torchtitan's TP must know (a new user's trial)
    assert "base_model_tp_plan has no sequence parallelism" in note and "logits" in note


def test_a_plan_sharding_a_modules_own_param_beside_its_heads_is_refused(tmp_path):
    """GraniteSWA's plan shards each attention's sinks (one per head, a param, no module) colwise with its heads:
    the planner shards modules, so it refuses rather than leave the sinks whole beside 1/TP of the heads; a
    Qwen3-MoE's packed experts take transformers' moe_tp_experts where its plan gives it (5.24's class plan; 5.25's
    leaves them out)."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "granite_swa", "hidden_size": 64, "intermediate_size": 128, '
                      '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}')
    spec = ModelSpec(f"hf:{config}", batch_size=2, seq_len=16)
    with pytest.raises(PlannerError, match=r"self_attn's own param sinks \(colwise\) beside its colwise heads"):
        tp_layout(trace_spec(spec), 2, spec)
    moe = tmp_path / "moe.json"
    moe.write_text('{"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, '
                   '"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, '
                   '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128, '
                   '"base_model_tp_plan": {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", '  # (5.24's plan)
                   '"layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}}')
    spec = ModelSpec(f"hf:{moe}", batch_size=2, seq_len=16)
    layout = tp_layout(trace_spec(spec), 2, spec)
    assert TPStyle.MOE_TP_EXPERTS in layout.tp.layout.values()  # (was left whole: tests/test_moe_tp_hf.py)
    assert not any("experts" in n for n in layout.notes)


def test_a_per_head_param_left_whole_beside_split_heads_is_refused(tmp_path):
    """Cohere's q_norm and k_norm under use_qk_norm hold a row per head ([heads, head dim]) and transformers' plan
    leaves them whole: the planner refuses the layout (the ranks raised a broadcast error: a new user's trial),
    and without qk norm the same model takes the plan."""
    config = tmp_path / "config.json"
    fields = {"model_type": "cohere", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128}
    config.write_text(json.dumps({**fields, "use_qk_norm": True}))
    spec = ModelSpec(f"hf:{config}", batch_size=2, seq_len=16)
    with pytest.raises(PlannerError, match=r"q_norm\.weight \[4, 16\] holds a row per head and no style shards it"):
        check_layout(trace_spec(spec), tp_layout(trace_spec(spec), 2, spec))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(fields))
    spec = ModelSpec(f"hf:{plain}", batch_size=2, seq_len=16)
    check_layout(trace_spec(spec), tp_layout(trace_spec(spec), 2, spec))


def _deepseek_v2(tmp_path, **extra) -> ModelSpec:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "n_group": 1,
        "topk_group": 1, "topk_method": "greedy", "vocab_size": 128, **extra}))
    return ModelSpec(f"hf:{config}", batch_size=2, seq_len=16)


def test_deepseek_v2s_mla_key_takes_the_style_mla_kv_a_proj(tmp_path):
    """DeepSeek-V2's plan gives kv_a_proj_with_mqa 'mla_kv_a_proj' (its output holds the rope key every head
    reads): left whole beside the sharded heads, its gradient was one rank's heads' only and the TP ranks' copies
    drifted (verify --nproc 4: 18x the parity bound), so it was refused. It is now laid out: whole on each rank,
    the config's qk_rope_head_dim features' grad all-reduced (tests/test_moe_tp_hf.py runs it)."""
    spec = _deepseek_v2(tmp_path)
    tr = trace_spec(spec)
    tp = tp_layout(tr, 2, spec).tp
    assert tp.styles(tr.modules)["model.layers.0.self_attn.kv_a_proj_with_mqa"] is TPStyle.MLA_KV_A_PROJ
    assert tp.mla_rope_dim == 8 and tp.to_dict()["mla_rope_dim"] == 8
    assert tensor_parallel_from_dict(tp.to_dict()) == tp


def test_mlas_kv_b_proj_gives_whole_heads_of_its_own_width(tmp_path):
    """MLA's kv_b_proj makes each head's key part and value (16 + 24 wide here; DeepSeek-V3's 128 + 128) while its
    attention runs at 24 (its 192): --tp 4 gives each rank one whole head of 40, where the head-dim check refused
    it (160 features are 6.67 heads of 24; DeepSeek-V3 at TP 8: 170.667 heads of 192); 8 ranks do not divide 4
    heads."""
    spec = _deepseek_v2(tmp_path)
    tr = trace_spec(spec)
    assert trace_spec(spec).param("model.layers.0.self_attn.kv_b_proj.weight").shape[0] == 160
    check_layout(tr, tp_layout(tr, 4, spec), parse_cluster("h100:4"))
    with pytest.raises(PlannerError, match="must divide the model's 4 attention heads"):
        check_layout(tr, tp_layout(tr, 8, spec), parse_cluster("h100:8"))


def test_a_plan_file_cannot_shard_a_transformers_models_embedding_output_on_the_sequence():
    """transformers' forward builds its positions and causal mask from the embedding's output length: sequence-
    sharded, its first attention ran on the gathered sequence with one rank's share of positions, and every fake
    rank failed in a broadcast (a Qwen3 layout in torchtitan's style, written by hand)."""
    spec = ModelSpec("hf:titan-qwen3-debugmodel")
    tr = trace_spec(spec)
    tp = TensorParallel(2, {"model.embed_tokens": TPStyle.EMBEDDING_SEQUENCE,
                            "model.layers.*.input_layernorm": TPStyle.SEQUENCE_PARALLEL})
    with pytest.raises(PlannerError, match=r"embedding_sequence of model\.embed_tokens .* builds the positions and "
                                           r"the attention mask from that output's length"):
        plan_layout(tr, tp, spec)
    plan_layout(tr, TensorParallel(2, {"model.embed_tokens": TPStyle.EMBEDDING}), spec)


def test_a_plan_files_mla_style_is_checked_against_the_model(tmp_path):
    """A plan file's mla_rope_dim is the config's qk_rope_head_dim (12 summed four latent features' grads twice),
    the style goes to an nn.Linear (an Embedding's 'features' were its vocab: the all-reduce bytes were wrong), and
    the per-head width relaxation holds for transformers' own per-head Linears only (kv_a_proj colwise passed it:
    its 24 features are 4 heads of 6)."""
    spec = _deepseek_v2(tmp_path)
    tr = trace_spec(spec)
    tp = tp_layout(tr, 2, spec).tp
    for rope in (7, 12):
        with pytest.raises(PlannerError, match=f"mla_rope_dim' is {rope}, and .* rope key is 8 features"):
            plan_layout(tr, dataclasses.replace(tp, mla_rope_dim=rope), spec)
    check_layout(tr, plan_layout(tr, tp, spec), parse_cluster("h100:2"))  # (transformers' own: checked)
    embedding = TensorParallel(2, {"model.embed_tokens": TPStyle.MLA_KV_A_PROJ}, mla_rope_dim=8)
    with pytest.raises(PlannerError, match=r"model\.embed_tokens is a Embedding: give it to the Linear making"):
        check_layout(tr, plan_layout(tr, embedding, None), parse_cluster("h100:2"))  # (a model of one's own)
    # the key left whole beside the sharded heads, or the style on another Linear (both trained wrong on gloo and
    # passed the fake process group: a new user's trial), and the rope dim left out
    whole = {k: v for k, v in tp.layout.items() if v is not TPStyle.MLA_KV_A_PROJ}
    with pytest.raises(PlannerError, match=r"kv_a_proj_with_mqa makes .* rope key, which every head reads"):
        plan_layout(tr, TensorParallel(2, whole), spec)
    moved = {**whole, "model.layers.*.self_attn.kv_b_proj": TPStyle.MLA_KV_A_PROJ}
    with pytest.raises(PlannerError, match=r"style mla_kv_a_proj of model\.layers\.0\.self_attn\.kv_b_proj: .* "
                                           r"rope key is made by model\.layers\.0\.self_attn\.kv_a_proj_with_mqa"):
        plan_layout(tr, TensorParallel(2, moved, mla_rope_dim=8), spec)
    with pytest.raises(PlannerError, match="mla_rope_dim' is missing, and the layout gives the style"):
        tensor_parallel_from_dict({"degree": 2, "layout": {"a": "mla_kv_a_proj"}})
    kv_a = TensorParallel(2, {**tp.layout, "model.layers.*.self_attn.kv_a_proj_with_mqa": TPStyle.COLWISE})
    with pytest.raises(PlannerError, match=r"kv_a_proj_with_mqa makes .* rope key"):  # (against transformers')
        check_layout(tr, plan_layout(tr, kv_a, spec), parse_cluster("h100:2"))
    kv_a = Layout(kv_a, PLAN_FILE, heads=(4, 4), per_head=frozenset({"model.layers.0.self_attn.kv_b_proj",
                                                                      "model.layers.1.self_attn.kv_b_proj"}))
    with pytest.raises(PlannerError, match=r"whole attention heads of model\.layers\.0\.self_attn\.kv_a_proj_with_mqa"):
        check_layout(tr, kv_a, parse_cluster("h100:2"))  # (its 40 features are 4 heads of 10: not per head)


def test_a_transformers_style_that_cannot_stay_whole_refuses_the_layout(tmp_path):
    """A plan with a style the planner does not model ('all_reduce': a module's partial output summed) is refused
    in one sentence, not laid out with that module whole."""
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.kv_a_proj_with_mqa": "all_reduce",
            "layers.*.self_attn.kv_b_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    spec = _deepseek_v2(tmp_path, base_model_tp_plan=plan)
    with pytest.raises(PlannerError, match=r"kv_a_proj_with_mqa \(all_reduce\), which fsdp-planner does not "
                                           r"model, and left whole"):
        tp_layout(trace_spec(spec), 2, spec)


def test_mla_rope_dim_goes_with_the_style_only():
    """A layout with mla_kv_a_proj needs its rope features, and only such a layout takes them: both refused in one
    sentence, from Python and from a plan file."""
    with pytest.raises(PlannerError, match="needs its rope features"):
        TensorParallel(2, {"a": TPStyle.MLA_KV_A_PROJ})
    with pytest.raises(PlannerError, match="mla_rope_dim' is for a layout with the style mla_kv_a_proj"):
        tensor_parallel_from_dict({"degree": 2, "layout": {"a": "colwise"}, "mla_rope_dim": 8})
    for bad in (-1, True, 2.5, "8"):
        with pytest.raises(PlannerError, match="mla_rope_dim' must be a whole number"):
            tensor_parallel_from_dict({"degree": 2, "layout": {"a": "mla_kv_a_proj"}, "mla_rope_dim": bad})


def test_torchtitan_layout_found_by_the_trace_not_the_name():
    """The built-in Llama gets torchtitan's layout from its module names and classes, whatever it is called."""
    tr = trace_spec("toy-llama")
    layout = tp_layout(tr, 2, ModelSpec("my-own-name"))
    assert layout.tp.layout == titan_llama_layout(2).layout and layout.tp.loss_parallel
    assert layout.heads == (4, 2)
    assert not tp_layout(tr, 2, None, loss_parallel=False).tp.loss_parallel


def test_tied_embeddings_stay_whole():
    layout = tp_layout(trace_spec(ModelSpec("llama32-3b", seq_len=64)), 8)
    assert "tok_embeddings" not in layout.tp.layout and "output" not in layout.tp.layout
    assert not layout.tp.loss_parallel and any("share a weight" in n for n in layout.notes)


def test_detected_pairs_with_a_note():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Pair(16, 64) for _ in range(2))
            self.head = nn.Linear(16, 16)

        def forward(self, x):  # type: ignore[no-untyped-def]
            for b in self.blocks:
                x = x + b(x)
            return self.head(x)

    layout = tp_layout(traced(Model(), 16), 4)
    assert layout.source == PAIRS
    assert dict(layout.tp.layout) == {"blocks.0.up": TPStyle.COLWISE, "blocks.0.down": TPStyle.ROWWISE,
                                      "blocks.1.up": TPStyle.COLWISE, "blocks.1.down": TPStyle.ROWWISE}
    assert "2 column-then-row Linear pairs in Pair" in layout.notes[0] and "is run on random values" in layout.notes[0]


def test_no_sound_layout_is_refused():
    with pytest.raises(PlannerError, match="no sound tensor-parallel layout"):
        tp_layout(trace_spec("seed-net"), 2)
    with pytest.raises(PlannerError, match="transformers has no tensor-parallel plan"):
        spec = ModelSpec("hf:gpt2", seq_len=32, hf_config=(("n_layer", 1),))
        tp_layout(trace_spec(spec), 2, spec)


def test_a_base_plan_is_named_where_the_built_model_holds_its_base_model(tmp_path):
    """Llama 4's causal LM loads its text model as 'language_model' (its base_model_prefix) but holds it as 'model',
    where transformers' own plan (``init_parallel_plans``: each child's plan under its name) puts it: the planner
    refused the model for a prefix it does not hold (a new user's finding). Dense, the layout is transformers'."""
    fixture = Path(__file__).parent / "fixtures" / "llama4_tiny.json"
    dense = tmp_path / "llama4_dense.json"
    dense.write_text(json.dumps({**json.loads(fixture.read_text()), "moe_layers": []}))
    spec = ModelSpec(f"hf:{dense}", seq_len=16)
    styles = tp_layout(trace_spec(spec), 2, spec).tp.styles(trace_spec(spec).modules)
    assert styles["model.layers.0.self_attn.q_proj"] is TPStyle.COLWISE
    assert styles["model.layers.1.feed_forward.down_proj"] is TPStyle.ROWWISE


# -- divisibility -----------------------------------------------------------------------------------------------------
def test_degrees_refused():
    tr = trace_spec("toy-llama")
    with pytest.raises(PlannerError, match="4 attention heads and 2 kv heads"):
        check_layout(tr, tp_layout(tr, 4), H100_8)
    with pytest.raises(PlannerError, match=r"the 1 GPU of a node of h100:2x1 \(TP stays inside a node, on NVLink\)$"):
        check_layout(tr, tp_layout(tr, 2), parse_cluster("h100:2x1"))
    with pytest.raises(PlannerError, match="--seq 31 must be a multiple of 2"):
        check_layout(tr, tp_layout(tr, 2), H100_8, seq_len=31)
    check_layout(tr, tp_layout(tr, 2), H100_8, seq_len=32)  # all divide
    pairs = traced(Pair(8, 6), 8)
    with pytest.raises(PlannerError, match="6 output features of up"):
        check_layout(pairs, tp_layout(pairs, 4), H100_8)


def test_auto_tries_the_degrees_that_divide():
    tr = trace_spec("toy-llama")
    assert [x.tp.degree for x in tp_degrees(tr, ModelSpec("toy-llama"), H100_8)] == [1, 2]  # 2 kv heads
    assert [x.tp.degree for x in tp_degrees(traced(Pair(8, 16), 8), None, H100_8)] == [1]  # detected: only --tp


def _own_llama(monkeypatch=None):  # type: ignore[no-untyped-def]
    """A Llama of torchtitan's structure with no built-in config (8 heads, 4 kv heads); with ``monkeypatch``, its
    attention written by hand (no fused kernel, so no call tells the heads)."""
    import torch

    from fsdp_planner.models import llama

    if monkeypatch is not None:
        def by_hand(q, k, v):  # type: ignore[no-untyped-def]
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        monkeypatch.setattr(llama, "attention", by_hand)
    cfg = llama.LlamaConfig(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_dim=256)
    model, args, loss_fn = llama.build(cfg, 2, 16)
    return trace(model, args, loss_fn=loss_fn)


def test_heads_read_from_the_attention_calls():
    """A model of torchtitan's structure that no built-in config matches: its heads come from the head dim its
    fused attention ran at, so auto tries only the degrees that divide its 4 kv heads (TP 8 would fail in DTensor's
    view of the kv heads)."""
    tr = _own_llama()
    assert (8, 8, 16) in tr.attention  # k repeated to the query heads before attention, as torchtitan does
    layout = tp_layout(tr, 2, None)
    assert layout.heads == (8, 4) and layout.checked and not layout.notes
    assert [x.tp.degree for x in tp_degrees(tr, None, H100_8)] == [1, 2, 4]
    with pytest.raises(PlannerError, match="8 attention heads and 4 kv heads"):
        check_layout(tr, tp_layout(tr, 8, None), H100_8)


def test_unknown_heads_are_the_users_to_assume(monkeypatch):
    """Attention written by hand: no call tells the heads, so auto leaves TP to ``--tp`` (said in its note)."""
    tr = _own_llama(monkeypatch)
    assert tr.attention == ()
    layout = tp_layout(tr, 2, None)
    assert layout.heads is None and not layout.checked and any("assumed to divide" in n for n in layout.notes)
    assert [x.tp.degree for x in tp_degrees(tr, None, H100_8)] == [1]


class SixHeads(nn.Module):
    """A user's attention: 6 heads of 16 through SDPA; no built-in structure, so a detected layout."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(96, 96) for _ in range(4))

    def forward(self, x):  # type: ignore[no-untyped-def]
        import torch.nn.functional as F

        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, -1, 16).transpose(1, 2) for lin in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = SixHeads(), Pair(96, 384)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.mlp(x + self.attn(x))


def test_detected_attention_pairs_need_whole_heads():
    """A detected layout's colwise Linears that make heads give each rank whole heads (6 heads of 16: TP 2, not
    4); an MLP pair has no heads to keep whole."""
    tr = traced(Block(), 96)
    layout = tp_layout(tr, 4, None)
    assert layout.source == PAIRS and head_linears(tr, layout.tp) == (16, ("attn.q", "attn.k", "attn.v"))
    with pytest.raises(PlannerError, match=r"heads of attn\.q: its 96 output features are 6 heads of 16"):
        check_layout(tr, layout, H100_8)
    check_layout(tr, tp_layout(tr, 2, None), H100_8)
    pair = traced(Pair(8, 16), 8)
    assert head_linears(pair, tp_layout(pair, 4, None).tp) == (0, ())


# -- a plan file's layout meets the same checks ----------------------------------------------------------------------
TINY_QWEN3 = {"model_type": "qwen3", "hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 6,
              "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
              "max_position_embeddings": 64, "tie_word_embeddings": True}
QWEN3_LAYOUT = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise"}


def _plan_file(tmp_path: Path, groups: list[list[str]], degree: int, layout: dict[str, str]) -> str:
    """A hand-written plan (module lists: its params derived) with the tensor parallelism given."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": 1, "groups": [{"modules": g} for g in groups],
                                "tensor_parallel": {"degree": degree, "layout": layout}}))
    return str(path)


def test_an_edited_plan_file_s_title_says_its_tp_as_it_is(tmp_path):
    """A plan made with --tp 2 is titled "TP 2 (SP, loss parallel)": with loss parallel edited off (or TP taken
    out) the tables kept the old title."""
    from fsdp_planner.service.plan_files import load_plan

    spec = ModelSpec("toy-llama")
    tr = trace_spec(spec)
    job = checked_job(Keywords(model="toy-llama", policy="titan", tp=2, cluster="h100:8"), Spelling.API)
    made = plan_job(job, lambda spec, options: trace_spec(spec, options.precision)).plan
    assert made is not None and made.policy.endswith(", TP 2 (SP, loss parallel)")
    data = json.loads(made.to_json())
    data["tensor_parallel"]["loss_parallel"] = False
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_plan(str(path), tr, spec, lambda line: None).policy == "titan(TransformerBlock), TP 2 (SP)"
    del data["tensor_parallel"]
    path.write_text(json.dumps(data))
    assert load_plan(str(path), tr, spec, lambda line: None).policy == "titan(TransformerBlock)"


def test_a_plan_files_degree_must_divide_the_heads(tmp_path):
    """A plan file's TP 4 on a Qwen3 of 6 heads and 2 kv heads is refused where the plan meets the model (load,
    check), as --tp 4 is, before DTensor's view fails on the ranks; TP 2 passes."""
    from fsdp_planner.service.plan_files import load_plan, plan_to_check

    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    spec = ModelSpec(f"hf:{tmp_path}", batch_size=1, seq_len=16)
    tr = trace_spec(spec)
    groups = [["model.layers.0"], ["model.layers.1"]]
    bad = _plan_file(tmp_path, groups, 4, QWEN3_LAYOUT)
    for read in (lambda: load_plan(bad, tr, spec, lambda line: None), lambda: plan_to_check(bad, tr, spec)):
        with pytest.raises(PlannerError, match=r"^the plan's tensor-parallel degree 4 must divide the model's 6 "
                                               "attention heads and 2 kv heads"):
            read()
    plan = load_plan(_plan_file(tmp_path, groups, 2, QWEN3_LAYOUT), tr, spec, lambda line: None)
    assert plan.tensor_parallel is not None and plan.tensor_parallel.degree == 2
    mlp_only = {k: v for k, v in QWEN3_LAYOUT.items() if ".mlp." in k}  # attention whole: its heads not split
    assert load_plan(_plan_file(tmp_path, groups, 4, mlp_only), tr, spec, lambda line: None).tensor_parallel


def test_any_layout_gives_each_rank_whole_heads():
    """A layout of the user's (not detected) on a model of no known structure: the colwise Linears whose module
    runs the fused attention call split into whole heads of its head dim; an MLP's colwise Linear has none."""
    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
    from fsdp_planner.planners.tensor_parallel import plan_layout

    tr = traced(Block(), 96)
    styles = {"attn.q": TPStyle.COLWISE, "attn.k": TPStyle.COLWISE, "attn.v": TPStyle.COLWISE,
              "attn.o": TPStyle.ROWWISE, "mlp.up": TPStyle.COLWISE, "mlp.down": TPStyle.ROWWISE}
    assert head_linears(tr, TensorParallel(4, styles)) == (16, ("attn.q", "attn.k", "attn.v"))
    with pytest.raises(PlannerError, match=r"^the plan's tensor-parallel degree 4 must give each rank whole "
                                           r"attention heads of attn\.q: its 96 output features are 6 heads of 16"):
        check_layout(tr, plan_layout(tr, TensorParallel(4, styles), None))
    check_layout(tr, plan_layout(tr, TensorParallel(2, styles), None))
    mlp = {k: v for k, v in styles.items() if k.startswith("mlp.")}
    check_layout(tr, plan_layout(tr, TensorParallel(4, mlp), None))  # 384 hidden units over 4: whole heads moot


def test_a_plan_files_layout_runs_one_ranks_step(tmp_path):
    """A plan file's colwise / rowwise layout on a model whose attention views into its fixed head count (T5; no
    fused call tells its heads): one TP rank's step runs on meta where the plan meets the model, and fails there in
    one sentence, not on the ranks; an MLP stack's pairs run."""
    from fsdp_planner.service.plan_files import load_plan

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    for name, runs in (("tiny_t5", False), ("pairs_mlp", True)):
        spec = ModelSpec(f"{fixtures}:{name}")
        tr = trace_spec(spec)
        layout = {k: s.value for k, s in tp_layout(tr, 2, spec).tp.layout.items()}
        path = _plan_file(tmp_path, [[""]], 2, layout)
        if runs:
            assert load_plan(path, tr, spec, lambda line: None).tensor_parallel.degree == 2
            continue
        with pytest.raises(PlannerError, match=r"^the plan's tensor-parallel layout \(degree 2\) does not run on "
                                               r"this model: one TP rank's step fails \(aten\.view in module "):
            load_plan(path, tr, spec, lambda line: None)


def test_a_tied_moe_under_torchtitan_s_layout_is_refused_and_a_tied_llama_has_no_loss_parallel():
    """A tied embedding and head stay whole over TP: a Llama's layout then runs without sequence parallelism, and
    without loss parallel (no vocab-sharded head is left); torchtitan's MoE layout takes and gives the sequence
    sharded in every MoE layer, so it cannot drop it: refused in one sentence, not with advice to shard the tied
    embedding."""
    fixtures = Path(__file__).parent / "fixtures"
    llama = ModelSpec(f"{fixtures / 'tp_llama.py'}:tied_llama")
    found = tp_layout(trace_spec(llama), 2, llama)
    assert not found.tp.loss_parallel and TPStyle.SEQUENCE_PARALLEL not in found.tp.layout.values()
    moe = ModelSpec(f"{fixtures / 'ep_moe.py'}:tied_tiny_mixtral")
    with pytest.raises(PlannerError, match="^output and tok_embeddings share a weight, which TP must leave whole, and "
                                           r"this model's tensor-parallel layout \(torchtitan's MoE\) needs"):
        tp_layout(trace_spec(moe), 2, moe)


def test_an_mlp_written_inline_beside_attention_is_a_pair():
    """A block holding fc1 and fc2 itself, beside its norms and attention: the two Linears run one after the other
    make the pair (it was refused as "no sound layout", while a hand-written fc1 colwise / fc2 rowwise trained with
    parity); a norm run between them is something the pair's assumption does not cover, so no pair there."""
    from fsdp_planner.planners.tensor_parallel import PAIRS

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    spec = ModelSpec(f"{fixtures}:inline_mlp")
    found = tp_layout(trace_spec(spec), 2, spec)
    assert found.source == PAIRS
    assert found.tp.layout == {f"{b}.fc{i}": s for b in ("0", "1") for i, s in ((1, TPStyle.COLWISE),
                                                                             (2, TPStyle.ROWWISE))}
    normed = ModelSpec(f"{fixtures}:inline_mlp_normed")
    with pytest.raises(PlannerError, match=r"^no sound tensor-parallel layout for this model"):
        tp_layout(trace_spec(normed), 2, normed)
    # beside a fused qkv projection (3 x width out, which a contiguous split of its columns would not cut into
    # whole heads): the MLP's two Linears are the block's column-then-row pair (the block was refused as having
    # none), and qkv and proj a gathered one (tests/test_tp_gathered_styles.py)
    # its norms without params split the runs too (a DiT's: qkv, proj and fc1 were one run before fc2, and the
    # layout failed on the ranks: a new user's trial)
    for fn in ("fused_qkv", "fused_qkv_plain_norms"):
        fused = ModelSpec(f"{fixtures}:{fn}")
        found = tp_layout(trace_spec(fused), 2, fused)
        assert found.tp.layout == {f"{b}.{m}": s for b in ("0", "1") for m, s in (
            ("fc1", TPStyle.COLWISE), ("fc2", TPStyle.ROWWISE), ("qkv", TPStyle.COLWISE_GATHER),
            ("proj", TPStyle.ROWWISE_SPLIT))}, fn


class NormedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.pair = nn.LayerNorm(8), Pair(8, 16)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.pair(self.norm(x))


def test_a_style_torch_cannot_apply_is_refused():
    """torch's ColwiseParallel / RowwiseParallel take an nn.Linear or nn.Embedding only (else NotImplementedError on
    the ranks): a LayerNorm given colwise is refused wherever the plan meets the model. sequence_parallel is a norm's
    style, refused here for what comes before it alone: the model's input, whole, which it would take for a shard."""
    from fsdp_planner.fsdp2.claim import make_plan
    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
    from fsdp_planner.planners.tensor_parallel import plan_layout

    tr = traced(NormedPair(), 8)
    pair = {"pair.up": TPStyle.COLWISE, "pair.down": TPStyle.ROWWISE}
    for style in (TPStyle.COLWISE, TPStyle.ROWWISE_SEQUENCE):
        tp = TensorParallel(2, {**pair, "norm": style})
        with pytest.raises(PlannerError, match=r"^the tensor-parallel style \w+ of norm is torch's \w+Parallel, "
                                               "which shards an nn.Linear or nn.Embedding only, and norm is a "
                                               "LayerNorm"):
            check_layout(tr, plan_layout(tr, tp, None))
        plan = make_plan(tr, [["pair"]]).replace(tensor_parallel=tp)
        with pytest.raises(PlannerError, match="norm is a LayerNorm"):
            check_plan_matches(plan, tr)
    with pytest.raises(PlannerError, match=r"^the tensor-parallel style sequence_parallel of norm takes its input "
                                           r"sharded on the sequence .* nothing before it shards the sequence"):
        check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "norm": TPStyle.SEQUENCE_PARALLEL}), None))


class TorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.pair = nn.MultiheadAttention(8, 2, batch_first=True), Pair(8, 16)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.pair(self.attn(x, x, x, need_weights=False)[0])


class TorchAttentionAndSpare(TorchAttention):
    def __init__(self) -> None:
        super().__init__()
        self.spare = Pair(8, 16)


def test_a_style_on_a_module_whose_forward_the_step_never_calls_is_refused():
    """nn.MultiheadAttention reads its out_proj's weight itself and never calls out_proj: a style on it passed check
    and simulate (its TP costing nothing) and failed the ranks with 'mixed torch.Tensor and DTensor' (a trial)."""
    from fsdp_planner.planners.tensor_parallel import plan_layout

    tr = traced(TorchAttention(), 8)
    pair = {"pair.up": TPStyle.COLWISE, "pair.down": TPStyle.ROWWISE}
    check_layout(tr, plan_layout(tr, TensorParallel(2, pair), None))  # the called pair alone is sound
    for style in (TPStyle.COLWISE_GATHER, TPStyle.ROWWISE):
        with pytest.raises(PlannerError, match=rf"^the tensor-parallel style {style.value} of attn.out_proj: the "
                                               "step never calls its forward"):
            check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "attn.out_proj": style}), None))
    # a module the step never uses at all: its sharded params meet nothing (a review: refused as read elsewhere)
    tr = traced(TorchAttentionAndSpare(), 8)
    check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "spare.up": TPStyle.COLWISE,
                                                         "spare.down": TPStyle.ROWWISE}), None))


def test_a_rowwise_linear_is_fed_by_a_colwise_one():
    """A rowwise Linear takes its input sharded on the features: a feed-forward's first Linear made rowwise after
    attention's rowwise output projection (its output whole) is refused; colwise then rowwise passes."""
    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
    from fsdp_planner.planners.tensor_parallel import plan_layout

    tr = traced(Block(), 96)
    attn = {"attn.q": TPStyle.COLWISE, "attn.k": TPStyle.COLWISE, "attn.v": TPStyle.COLWISE,
            "attn.o": TPStyle.ROWWISE}
    rowrow = TensorParallel(2, {**attn, "mlp.up": TPStyle.ROWWISE, "mlp.down": TPStyle.ROWWISE})
    with pytest.raises(PlannerError, match=r"^the tensor-parallel style rowwise of mlp\.up takes its input sharded "
                                           r"on the features, as a colwise Linear's output is, and the module run "
                                           r"before it whose weight TP shards, attn\.o, is rowwise"):
        check_layout(tr, plan_layout(tr, rowrow, None))
    with pytest.raises(PlannerError, match=r"rowwise of mlp\.up .* no colwise Linear runs before it"):
        check_layout(tr, plan_layout(tr, TensorParallel(2, {"mlp.up": TPStyle.ROWWISE}), None))
    check_layout(tr, plan_layout(tr, TensorParallel(2, {**attn, "mlp.up": TPStyle.COLWISE,
                                                        "mlp.down": TPStyle.ROWWISE}), None))

    # the converse: a colwise Linear's sharded output needs a rowwise one after it (the head's style differs)
    with pytest.raises(PlannerError, match=r"^the output of mlp\.up, tensor-parallel style colwise, stays sharded "
                                           r"on its features over TP, and no module after it"):
        check_layout(tr, plan_layout(tr, TensorParallel(2, {**attn, "mlp.up": TPStyle.COLWISE}), None))


class _Tied(nn.Module):
    """An embedding, a Linear pair and an output head: what a hand-written layout may wrongly style."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.pair, self.head = nn.Embedding(64, 32), Pair(32, 64), nn.Linear(32, 64)

    def forward(self, ids):  # type: ignore[no-untyped-def]
        return self.head(self.pair(self.emb(ids)))


def test_embedding_and_head_styles_that_fail_on_the_ranks_are_refused():
    """A Linear's style on an nn.Embedding (torch shards another dim of it than of a Linear), a plain colwise
    output head (the loss would get 1/TP of the logits), and a sequence_colwise head after a region that leaves the
    sequence whole (the head's all-gather made it TP times too long): each crashed on real ranks after passing
    ``check``."""
    import torch

    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
    from fsdp_planner.planners.tensor_parallel import plan_layout

    tr = trace(_Tied(), (torch.zeros(2, 8, dtype=torch.long),))
    pair = {"pair.up": TPStyle.COLWISE, "pair.down": TPStyle.ROWWISE}
    for style in (TPStyle.ROWWISE, TPStyle.COLWISE):
        with pytest.raises(PlannerError, match=f"^emb is an nn.Embedding and its tensor-parallel style {style.value} "
                                               "is a Linear's: give it embedding"):
            check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "emb": style}), None))
    with pytest.raises(PlannerError, match=r"^the output of head, .* an output head takes colwise_gather .its logits "
                                           r"gathered whole., or sequence_colwise where"):
        check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "head": TPStyle.COLWISE}), None))
    with pytest.raises(PlannerError, match=r"^the tensor-parallel style sequence_colwise of head takes its input "
                                           r"sharded on the sequence .* pair\.down \(rowwise\), leaves it whole"):
        check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "head": TPStyle.SEQUENCE_COLWISE}), None))
    sequence = {"pair.up": TPStyle.COLWISE, "pair.down": TPStyle.ROWWISE_SEQUENCE, "head": TPStyle.SEQUENCE_COLWISE}
    check_layout(tr, plan_layout(tr, TensorParallel(2, sequence), None))
    check_layout(tr, plan_layout(tr, TensorParallel(2, {**pair, "emb": TPStyle.EMBEDDING}), None))


def test_a_detected_layout_whose_local_shapes_fail_is_refused_or_left_whole_where_it_fails():
    """T5 views its projections into its fixed head count: the detected pairs pass every divisibility check, but
    one TP rank's step (the sharded Linears at their local shapes, on meta) fails. Attention alone is refused in one
    sentence before anything runs (it failed in the fake world and on the ranks); T5's attention is left whole with
    a note and its MLPs kept (it was refused whole); an MLP's pairs run."""
    from fsdp_planner.service.planning import SILENT, requested_layout

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    request = PolicyRequest(PolicyName.TITAN, tp=2)
    attention = ModelSpec(f"{fixtures}:attention_fixed_heads")
    with pytest.raises(PlannerError, match=r"one TP rank's step fails \(aten\.view in module '0'"):
        requested_layout(trace_spec(attention), request, attention, H100_8, SILENT)
    spec = ModelSpec(f"{fixtures}:tiny_t5")
    tr = trace_spec(spec)
    assert tp_layout(tr, 2, spec).source == PAIRS
    notes: list[str] = []
    kept = requested_layout(tr, request, spec, H100_8, dataclasses.replace(SILENT, note=notes.append))
    assert kept.layout and all(".DenseReluDense.w" in n for n in kept.layout)
    assert any("in T5Attention left whole over TP: one TP rank's step fails (aten.view" in n for n in notes)
    mlp = ModelSpec(f"{fixtures}:pairs_mlp")
    assert requested_layout(trace_spec(mlp), request, mlp, H100_8, SILENT).degree == 2


@pytest.mark.parametrize("mix", ["softmax", "normalize", "heads"])
def test_a_detected_layout_that_computes_something_else_is_refused(mix):
    """A softmax or a normalize over the features between a pair's Linears, or a view into a fixed head count whose
    size is inferred, runs at the local shapes and computes something else: bf16 verify runs passed such layouts
    within their bound (a new user's finding). Each module with a pair is run on numbers, whole and as the TP ranks
    run it, and the layout is refused; the MLP pairs and two pairs in one module (a rowwise sum feeding the next
    pair) agree."""
    from fsdp_planner.service.planning import SILENT, Reporter, requested_layout

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    spec = ModelSpec(f"{fixtures}:mixing_{mix}")
    request = PolicyRequest(PolicyName.TITAN, tp=2)
    with pytest.raises(PlannerError, match=r"--tp 2 with the detected layout \(column-then-row Linear pairs\) "
                                           r"computes something else on this model: 0 \(_Mixing\) run as 2 TP "
                                           r"ranks run it \(each rowwise output summed over them\) differs from its "
                                           r"whole run by \d\.\de[-+]\d\d of its output"):
        requested_layout(trace_spec(spec), request, spec, H100_8, SILENT)
    for sound in ("pairs_mlp", "two_pairs", "inline_mlp", "in_place"):
        ok = ModelSpec(f"{fixtures}:{sound}")
        notes: list[str] = []
        assert requested_layout(trace_spec(ok), request, ok, H100_8, Reporter(notes.append)).degree == 2
        assert not any("not checked on numbers" in n for n in notes), notes


def test_the_numeric_check_judges_a_root_pair_and_leaves_random_forwards_unjudged():
    """A pair held by the root was compared with itself (its Linears were looked up under "." and none split); a
    forward drawing random numbers (F.dropout, whose training flag eval() leaves on) was refused where it is sound:
    it is not judged, and a note says so (a reviewer's findings)."""
    from fsdp_planner.service.planning import Reporter, requested_layout

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    request = PolicyRequest(PolicyName.TITAN, tp=2)
    root = ModelSpec(f"{fixtures}:root_softmax")
    with pytest.raises(PlannerError, match=r"computes something else on this model: \(root\) \(_Mixing\)"):
        requested_layout(trace_spec(root), request, root, H100_8, Reporter())
    random = ModelSpec(f"{fixtures}:mixing_dropout")
    notes: list[str] = []
    assert requested_layout(trace_spec(random), request, random, H100_8, Reporter(notes.append)).degree == 2
    assert any("not checked on numbers in 0, 1 (its forward draws random numbers)" in n for n in notes), notes


def test_a_tp_plan_s_counts_and_bytes_without_a_cluster_are_one_tp_rank_s(capsys):
    """``plan --tp 2`` without --cluster printed the whole model's all-gather bytes and unsharded peak (those of the
    plan without TP; a new user's trial), with one they were halved: one TP rank's, either way."""
    from fsdp_planner.cli import main

    metrics = []
    for cluster in ((), ("--cluster", "h100:4")):
        assert main(["plan", "toy-llama", "--policy", "titan", "--tp", "2", *cluster, "--json"]) == 0
        metrics.append(json.loads(capsys.readouterr().out)["plans"][0]["metrics"])
    assert metrics[0] == metrics[1]
    assert main(["plan", "toy-llama", "--policy", "titan", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["plans"][0]["metrics"]
    assert metrics[0]["all_gather_bytes"] < whole["all_gather_bytes"]


def test_detected_pairs_holding_a_shared_weight_stay_whole():
    """Two blocks sharing their first Linear's weight: the detected layout split them, and the tie check refused
    the whole layout (a new user's model, whom the message left without a way out but a plan file). Those pairs
    stay whole, said in the note; the others split."""
    from fsdp_planner.service.planning import Reporter, requested_layout

    spec = ModelSpec(f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:shared_mid")
    notes: list[str] = []
    found = requested_layout(trace_spec(spec), PolicyRequest(PolicyName.TITAN, tp=2), spec, H100_8,
                             Reporter(notes.append))
    assert found.degree == 2 and set(found.layout) == {"0.up", "0.down", "2.up", "2.down"}
    assert any("2 pairs holding a weight shared with another module left whole (1.up, 3.up): TP would untie it" in n
               for n in notes), notes


def test_a_masked_block_is_judged_with_its_mask_all_false_where_all_true_gives_nan():
    """A block taking a key padding mask ran its check with the mask all true: every key masked, its output NaN, and
    NaN != NaN read as "its forward draws random numbers": a softmax between its Linears was accepted unjudged and a
    bf16 verify passed it (a new user's finding). The mask is now all false where all true gives NaN: the softmax
    is refused, the GELU pair judged sound with no note."""
    from fsdp_planner.service.planning import Reporter, requested_layout

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    request = PolicyRequest(PolicyName.TITAN, tp=2)
    wrong = ModelSpec(f"{fixtures}:masked_softmax")
    with pytest.raises(PlannerError, match=r"computes something else on this model: blocks\.0 \(_MaskedBlock\)"):
        requested_layout(trace_spec(wrong), request, wrong, H100_8, Reporter())
    sound = ModelSpec(f"{fixtures}:masked")
    notes: list[str] = []
    assert requested_layout(trace_spec(sound), request, sound, H100_8, Reporter(notes.append)).degree == 2
    assert not any("not checked on numbers" in n for n in notes), notes
    # torch's nn.TransformerEncoderLayer, handed a float mask: judged on the path training takes (its inference
    # fast path, which eval mode without grad takes, made NaN of it and left every layer unchecked: a trial)
    encoder = ModelSpec(f"{fixtures}:torch_encoder")
    notes.clear()
    assert requested_layout(trace_spec(encoder), request, encoder, H100_8, Reporter(notes.append)).degree == 2
    assert any("column-then-row Linear pairs in TransformerEncoderLayer" in n for n in notes), notes
    assert not any("not checked on numbers" in n for n in notes), notes


# -- options --------------------------------------------------------------------------------------------------------
def test_tp_through_the_validator():
    job = checked_job(Keywords(model="toy-llama", policy="titan", tp=2, async_tp=True, compile=True), Spelling.API)
    (request,) = job.policies
    assert (request.tp, request.async_tp, request.loss_parallel) == (2, True, None)
    auto = checked_job(Keywords(model="toy-llama", policy="auto", loss_parallel=True), Spelling.API).policies[0]
    assert (auto.tp, auto.loss_parallel) == (None, True)  # auto may choose a degree: the setting is for it
    for bad, message in (({"tp": 0}, "tp must be from 1"), ({"tp": True}, "tp must be a whole number"),
                         ({"tp": 1, "async_tp": True}, "async_tp is a setting of tensor parallelism"),
                         # no degree and no auto to choose one: TP never runs, the setting would be dropped
                         ({"loss_parallel": True}, "loss_parallel is a setting of tensor parallelism: .* the auto"),
                         ({"loss_parallel": "yes"}, "loss_parallel must be True or False")):
        with pytest.raises(PlannerError, match=message):
            checked_job(Keywords(model="toy-llama", policy="titan", **bad), Spelling.API)


@pytest.mark.parametrize("spell", [Spelling.CLI, Spelling.API])
def test_async_tp_needs_compile(spell):
    """Async TP is an inductor pass over the compiled model (torchtitan refuses it without compile): refused
    without --compile, before a step is simulated faster than the job could run."""
    message = ("--async-tp overlaps TP's collectives with the matmuls in compiled code, which torchtitan refuses "
               "without compile: add --compile") if spell is Spelling.CLI else "async_tp overlaps .* add compile$"
    with pytest.raises(PlannerError, match=f"^{message}"):
        checked_job(Keywords(model="toy-llama", policy="titan", tp=2, async_tp=True, cluster="h100:8"), spell)
    checked_job(Keywords(model="toy-llama", policy="titan", tp=2, async_tp=True, compile=True, cluster="h100:8"),
                spell)


@pytest.mark.parametrize("compile_table", ["", "[compile]\nenable = false\n",
                                           "[compile]\nenable = true\ncomponents = [\"loss\"]\n"])
def test_torchtitan_async_tp_without_the_model_compiled_refused(tmp_path, compile_table):
    """torchtitan's maybe_enable_async_tp raises unless compile.enable and "model" in compile.components."""
    path = tmp_path / "job.toml"
    job = ("[model]\nname = \"llama3\"\nflavor = \"8B\"\n[parallelism]\ntensor_parallel_degree = 2\n"
           "enable_async_tensor_parallel = true\n")
    path.write_text(job + compile_table)
    with pytest.raises(PlannerError, match="turns on enable_async_tensor_parallel without compiling the model, "
                                           "which torchtitan refuses"):
        read_config(TORCHTITAN, str(path))
    path.write_text(job + "[compile]\nenable = true\n")
    assert read_config(TORCHTITAN, str(path)).async_tp


def test_a_plan_files_async_tp_needs_compiled_modules():
    from fsdp_planner.fsdp2.plan import Plan

    plan = {"version": 1, "groups": [{"modules": ["layers.0"]}],
            "tensor_parallel": {"degree": 2, "layout": {"layers.*.attention.wq": "colwise"}, "async_tp": True}}
    with pytest.raises(PlannerError, match=r"^plan 'tensor_parallel.async_tp' overlaps .* compiles no module"):
        Plan.from_json(json.dumps(plan))
    assert Plan.from_json(json.dumps({**plan, "compiled": ["layers.0"]})).tensor_parallel.async_tp


def test_a_classic_plan_carries_the_layout():
    job = checked_job(Keywords(model="toy-llama", policy="titan", tp=2, cluster="h100:8"), Spelling.CLI)
    outcome = plan_job(job, lambda spec, options: trace_spec(spec, options.precision))
    plan, _, report = outcome.rows[0]
    assert plan.tensor_parallel == titan_llama_layout(2) and plan.layout(8).shard == 4
    assert report is not None and report.tp_degree == 2 and report.tp_all_gathers > 0


# -- job configs ----------------------------------------------------------------------------------------------------
def test_torchtitan_70b_keeps_its_tp():
    cfg = read_config(TORCHTITAN, f"{FIXTURES / 'llama3' / 'config_registry.py'}:llama3_70b")
    kw = configured(Keywords(cluster="h100:64"), cfg, "plan", lambda line: None)
    assert (kw.model, kw.tp, kw.batch, kw.cluster) == ("llama3-70b", 8, 8, "h100:64")
    job = checked_job(kw, Spelling.CLI)
    assert {p.tp for p in job.policies} == {8}


def test_torchtitan_405b_keeps_async_tp():
    cfg = read_config(TORCHTITAN, str(FIXTURES / "llama3_405b.toml"))
    assert (cfg.tp, cfg.async_tp) == (8, True)


@pytest.mark.parametrize("key", ["pipeline_parallel_degree", "context_parallel_degree"])
def test_pipeline_and_context_parallel_refused(tmp_path, key):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\n{key} = 2\n')
    with pytest.raises(PlannerError, match=f"{key} = 2: .* about another job"):
        read_config(TORCHTITAN, str(path))


def test_accelerate_tp_hsdp(tmp_path):
    """Accelerate's tp_hsdp.yaml: dp_replicate 2 x dp_shard 2 x tp 2 on 8 processes."""
    path = tmp_path / "tp_hsdp.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n"
                    "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                    "  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n")
    kw = configured(Keywords(model="toy-llama", cluster="h100"), read_config(ACCELERATE, str(path)), "plan",
                    lambda line: None)
    assert (kw.tp, kw.mesh, kw.cluster) == (2, "2x2", "h100:8")


@pytest.mark.parametrize(("sizes", "processes"), [((1, 8, 2), 8), ((2, 2, 2), 16), ((1, 4, 2), 16)])
def test_accelerate_sizes_must_make_num_processes(tmp_path, sizes, processes):
    """Accelerate's ParallelismConfig refuses a total size (dp_replicate x dp_shard x tp x cp x sp) other than
    num_processes (all machines' processes): dp_shard 8 x tp 2 on 8 processes is 16 ranks, refused before a plan."""
    replicate, shard, tp = sizes
    path = tmp_path / "job.yaml"
    path.write_text(f"distributed_type: FSDP\nnum_machines: 2\nnum_processes: {processes}\nfsdp_config:\n"
                    f"  fsdp_version: 2\nparallelism_config:\n  parallelism_config_dp_replicate_size: {replicate}\n"
                    f"  parallelism_config_dp_shard_size: {shard}\n  parallelism_config_tp_size: {tp}\n"
                    "  parallelism_config_cp_size: 1\n")
    with pytest.raises(PlannerError, match=rf"parallelism_config's dp_replicate_size {replicate} x dp_shard_size "
                                           rf"{shard} x tp_size {tp} x cp_size 1 x sp_size 1 make "
                                           rf"{replicate * shard * tp} ranks, "
                                           rf"and num_processes is {processes}, which Accelerate refuses"):
        read_config(ACCELERATE, str(path))
    path.write_text(path.read_text().replace(f"dp_shard_size: {shard}", f"dp_shard_size: {processes // 2 // replicate}"
                                             ).replace(f"tp_size: {tp}", "tp_size: 2"))
    assert read_config(ACCELERATE, str(path)).tp == 2


# -- auto's choice ---------------------------------------------------------------------------------------------------
# a budget (of the TP 2 layout's best plan's reserve without one) under which TP 2's fastest fitting plan beats every
# TP 1 plan that fits (0.5, 0.6 and 0.7 all do)
TIGHT = 0.6


def _auto(budget: int | None = None):  # type: ignore[no-untyped-def]
    request = PolicyRequest(PolicyName.AUTO, memory_budget=budget)
    spec = ModelSpec("toy-llama")
    return search(trace_spec(spec), request, H100_8, SimOptions(), spec)


def test_auto_chooses_the_degree_deterministically():
    first, second = _auto(), _auto()
    assert first.written_plan == second.written_plan and first.meshes.keys() == second.meshes.keys()
    assert "1x4 x TP 2" in first.meshes and "1x8" in first.meshes
    fitting = [c.report.step_time for c in first.meshes.values() if first.memory.fits(c.report.reserved_memory)]
    assert first.report.step_time == min(fitting)


def test_auto_takes_tp_under_a_tight_budget():
    """Under a budget well below what the free search's plans reserve, TP 2 (which shards the params once more and
    the activations between the blocks) is the fastest layout that fits, and auto takes it."""
    free = _auto()
    tight = _auto(budget=int(free.meshes["1x4 x TP 2"].report.reserved_memory * TIGHT))
    assert tight.fits and tight.plan.tp_degree == 2 and tight.plan.tensor_parallel == titan_llama_layout(2)
    check_plan_matches(tight.written_plan, trace_spec("toy-llama"))  # the whole model's plan, not the view's
    fitting = [c.report.step_time for c in tight.meshes.values() if tight.memory.fits(c.report.reserved_memory)]
    assert tight.report.step_time == min(fitting)


BUDGETS = [n * 100_000 for n in range(12, 29)]  # 1.2 to 2.8 MB per rank: TP 1 fits from 1.2, every plan at 2.8


@pytest.mark.integration  # 17 searches of each layout, about 20 s
def test_a_larger_budget_gives_a_plan_as_fast():
    """Over budgets from where TP 1 first fits to where its fastest plan does, each layout's search (TP 1; TP 2 at twice
    the batch per data-parallel rank) and auto's choice between them. TP 1's search was slower at 1.8 MB than at 1.7
    (7.85 against 7.60 ms: the settings searched came from the per-block plan, which fits with 2 blocks in full, while 3
    groups fit with 3) and at 2.3 than at 2.2 (7.48 against 6.55 ms: a plan without checkpointing fit, so none was
    searched, while one group with 2 blocks in full and one op-level takes 6.29): now it never is. Auto kept TP 1 where
    TP 2's screening plan was 5.8% behind and its search ahead (1.8 MB: 7.85 against 6.54 ms), 15% slower than at a
    smaller budget at worst; it now searches TP 2 too where TP 1's search gained more than that over its screening plan,
    and takes the faster layout at every budget. The searches are heuristic: TP 2's can still be slower than at a
    smaller budget (1.9 MB: 6.80 against 6.54 ms), on this model whose step is the host's hooks and launches, where one
    group fewer outweighs a block's recomputation; and since a block its refinement checkpoints in full is no longer
    also op-level (a plan listing it both ways, which commands refuse, was simulated slower), TP 1's finds faster plans
    at 1.9 and 2.0 MB (6.69 and 6.68 against 6.94 and 6.93 ms) but not at 2.1 (6.92 ms, 3.5% slower than at 2.0)."""
    cluster = H100_8
    batch = ModelSpec("toy-llama").workload()["batch_size"]
    specs = {1: ModelSpec("toy-llama"), 2: ModelSpec("toy-llama", batch_size=2 * batch)}
    traces = {tp: trace_spec(spec) for tp, spec in specs.items()}

    def step(budget: int, tp: int | None) -> float:
        spec = specs[tp or 1]
        result = search(traces[tp or 1], PolicyRequest(PolicyName.AUTO, memory_budget=budget, tp=tp), cluster,
                        SimOptions(), spec)
        return result.report.step_time if result.fits else float("inf")

    tp1 = [step(b, 1) for b in BUDGETS]
    assert all(later <= min(tp1[:i + 1]) * 1.04 for i, later in enumerate(tp1[1:])), tp1
    tp2 = [step(b, 2) for b in BUDGETS]
    chosen = [step(b, None) for b in BUDGETS]
    assert chosen == [min(a, b) for a, b in zip(tp1, tp2, strict=True)]
    assert all(later <= min(chosen[:i + 1]) * 1.04 for i, later in enumerate(chosen[1:])), chosen


def test_the_api_takes_tp():
    import fsdp_planner

    plan = fsdp_planner.plan("toy-llama", policy="titan", cluster="h100:8", tp=2, loss_parallel=False)
    assert plan.tensor_parallel is not None and plan.tp_degree == 2 and not plan.tensor_parallel.loss_parallel
    assert plan.mesh_dims(8) == {"dp_shard": 4, "tp": 2}


def test_each_tp_layout_searched_as_if_alone():
    """On two nodes (where each layout's search screens its data-parallel layouts, starting with the very plans the
    TP screening simulated, which it goes on with) every layout searched in full has the plan a search of that
    layout alone gives, at the batch each of its data-parallel ranks runs."""
    cluster = parse_cluster("h100:16")
    spec = ModelSpec("toy-llama", batch_size=1)
    budget = 900_000  # below what the plans without checkpointing reserve on every layout
    chosen = search(trace_spec(spec), PolicyRequest(PolicyName.AUTO, memory_budget=budget), cluster, SimOptions(),
                    spec)
    for degree in (1, 2):
        alone_spec = ModelSpec("toy-llama", batch_size=degree)
        alone = search(trace_spec(alone_spec), PolicyRequest(PolicyName.AUTO, memory_budget=budget, tp=degree),
                       cluster, SimOptions(), alone_spec)
        for name, c in alone.meshes.items():
            assert chosen.meshes[name].plan == c.plan and chosen.meshes[name].report == c.report, name


def test_plan_what_ifs_answer_for_the_job_auto_took_tp_for(capsys, tmp_path):
    """Where auto takes TP 2 itself, each data-parallel rank runs twice the batch: the float8 what-if is the
    written plan's step at that batch (it was the step at the per-GPU batch, half the job, once: 405B on 512
    H100s read '23 s a step against 49.5 s' where the same plan with float8 takes 45.2 s)."""
    from fsdp_planner.cli import main
    from fsdp_planner.fmt import fmt_bytes, fmt_time

    budget = int(_auto().meshes["1x4 x TP 2"].report.reserved_memory * TIGHT)
    out_plan = tmp_path / "p.json"
    assert main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", str(budget),
                 "--out", str(out_plan)]) == 0
    printed, notes = capsys.readouterr()
    assert "auto's layout has TP 2" in notes
    batch = ModelSpec("toy-llama").workload()["batch_size"]
    assert main(["simulate", "toy-llama", "--plan", str(out_plan), "--cluster", "h100:8", "--batch", str(2 * batch),
                 "--float8", "tensorwise", "--json"]) == 0
    alt = json.loads(capsys.readouterr().out)
    line = next(x for x in printed.splitlines() if x.startswith("float8 training (--float8 tensorwise"))
    assert f": {fmt_time(alt['step_time'])} a step against " in line
    assert f"reserved {fmt_bytes(alt['reserved_memory'])} against " in line


def test_plan_what_ifs_of_a_comparison_are_autos(capsys):
    """``plan`` without ``--policy`` compares the classic policies with auto: its float8 what-if is auto's plan
    against auto's step, as with ``--policy auto`` (it simulated the first row's classic plan with float8 against
    auto's step: "6.47 ms a step against 4.52 ms (43.2% slower)" on a small ViT, a new user's finding)."""
    from fsdp_planner.cli import main

    def float8_line(*policy: str) -> str:
        assert main(["plan", "toy-llama", "--cluster", "h100:8", *policy]) == 0
        out = capsys.readouterr().out
        return next(x for x in out.splitlines() if x.startswith("float8 training (--float8 tensorwise"))

    assert float8_line() == float8_line("--policy", "auto")


def test_the_groups_table_says_its_bytes_are_the_model_s_under_tp(capsys):
    """Under TP the groups table and the order policy's label count a group's bytes before TP splits them (a
    trial: "order(832 MiB)" at TP 2, whose ranks hold 416 MiB of each block): its caption says so; without TP none."""
    from fsdp_planner.cli import main

    def caption(*tp: str) -> list[str]:
        assert main(["plan", "toy-llama", "--policy", "order", "--cluster", "h100:8", *tp]) == 0
        return [x for x in capsys.readouterr().out.splitlines() if x.startswith("params and bytes: the model's")]

    assert caption("--tp", "2") == ["params and bytes: the model's, in its own dtype, before TP 2 split them across "
                                    "ranks (as --target-bytes counts them); what one rank holds and gathers: the "
                                    "table below"]
    assert caption() == []


LITTLE_TP_MODEL = """
import torch
from torch import nn


class Pair(nn.Module):
    def __init__(self, d, inner):
        super().__init__()
        self.up, self.down = nn.Linear(d, inner), nn.Linear(inner, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, vocab, inner):
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.blocks = nn.ModuleList(Pair(32, inner) for _ in range(2))
        self.head = nn.Linear(32, vocab)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def little():  # the vocab's embedding and head hold 94% of the params, whole over TP
    return Net(2048, 64), (torch.randint(0, 2048, (4, 8)),)


def most():
    return Net(64, 1024), (torch.randint(0, 64, (4, 8)),)
"""


def test_a_tp_degree_that_shards_little_says_so(tmp_path, capsys):
    """--tp on a model whose found pairs hold a small share of the params: TP's collectives and a data-parallel
    group TP times smaller buy little, which the user learns from a note."""
    from fsdp_planner.cli import main

    path = tmp_path / "net.py"
    path.write_text(LITTLE_TP_MODEL)
    for fn, share in (("little", "6%"), ("most", None)):
        assert main(["plan", f"{path}:{fn}", "--policy", "module", "--module-classes", "Pair", "--tp", "2", "--cluster",
                     "h100:8"]) == 0
        err = capsys.readouterr().err
        said = f"--tp 2 shards {share} of the params (the rest is whole on each TP rank): plan it without --tp too"
        assert (said in err) if share else ("of the params (the rest is whole" not in err), err


@pytest.mark.integration  # inductor partitions the two blocks: seconds
def test_async_tp_on_a_layout_of_all_reduces_says_it_changes_nothing(tmp_path, capsys):
    from fsdp_planner.cli import main

    path = tmp_path / "net.py"
    path.write_text(LITTLE_TP_MODEL)
    argv = ["simulate", f"{path}:most", "--policy", "module", "--module-classes", "Pair", "--tp", "2", "--compile",
            "--cluster", "h100:8", "--json"]
    assert main([*argv, "--async-tp"]) == 0
    out, err = capsys.readouterr()
    assert ("this --tp 2 layout has none (its collectives are all-reduces, and gathers of whole outputs no matmul "
            "reads): it would change nothing, and is left out of the plan") in err
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["step_time"] == json.loads(out)["step_time"]
    assert main([*argv[:-1], "--async-tp"]) == 0  # the label said async all the same (a new user's finding)
    assert "TP 2" in (shown := capsys.readouterr().out) and "(async)" not in shown and "TP 2 (" not in shown


def test_check_of_a_tp_degree_that_cannot_run_is_an_error_finding(capsys):
    """``check --tp 2`` on a model whose attention views into a fixed head count printed "no findings" and exited 0
    (the reason a note), where plan and verify refuse the job: a CI gate on check passed a job that cannot run."""
    from fsdp_planner.cli import main

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:attention_fixed_heads"
    assert main(["check", spec, "--tp", "2", "--cluster", "h100:2", "--json"]) == 1
    (finding,) = json.loads(capsys.readouterr().out)
    assert finding["severity"] == "error" and finding["code"] == "does-not-run"
    assert "one TP rank's step fails (aten.view" in finding["message"]
    assert main(["check", spec, "--cluster", "h100:2", "--json"]) == 0  # without --tp: the model's own findings


def test_check_of_a_plan_file_whose_layout_computes_something_else_is_an_error_finding(tmp_path, capsys):
    """A plan file's layout that fails on the model, or runs and computes something else, is the same finding as
    --tp's (it was an unreadable file's error, exit 2, where --tp gave a finding, exit 1: a new user's finding)."""
    from fsdp_planner.cli import main

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:mixing_softmax"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "groups": [["0"], ["1"]], "tensor_parallel": {
        "degree": 2, "layout": {"*.up": "colwise", "*.down": "rowwise"}}}))
    assert main(["check", spec, "--plan", str(plan), "--cluster", "h100:2", "--json"]) == 1
    (finding,) = json.loads(capsys.readouterr().out)
    assert finding["code"] == "does-not-run" and "the plan's tensor-parallel layout (degree 2) computes something " \
        "else on this model: 0 (_Mixing)" in finding["message"]


def test_auto_says_why_it_screens_no_tp_on_a_model_of_one_s_own(capsys, tmp_path):
    """auto screened no TP on a user's model and said nothing (a new user's finding): it weighs TP d at d times
    the batch, which a factory's default does not give without importing it again, and a detected layout must
    first run on the model, which --tp asks for. A detected layout says so with or without --batch (the note asked
    for --batch, and then said auto takes no detected layout: a later trial's finding)."""
    from fsdp_planner.cli import main

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:pairs_mlp"
    run = ["plan", spec, "--policy", "auto", "--cluster", "h100:16"]
    detected = ("this model's layout would be detected (column-then-row Linear pairs), which auto does not take on "
                "its own; give --tp 2")
    for batch in ([], ["--batch", "2"]):
        assert main([*run, *batch]) == 0
        err = capsys.readouterr().err
        assert detected in err and "give --batch N" not in err
    own = tmp_path / "own_llama.py"  # torchtitan's Llama layout, in a factory of one's own: its batch is not known
    own.write_text("from fsdp_planner.models import ModelSpec, load_model\n\n\ndef build():\n"
                   "    lm = load_model('toy-llama')\n    return lm.model, lm.example_inputs, lm.loss_fn\n\n\n"
                   "def batched(batch_size=4, seq_len=32):\n"
                   "    lm = load_model(ModelSpec('toy-llama', batch_size, seq_len))\n"
                   "    return lm.model, lm.example_inputs, lm.loss_fn\n")
    assert main(["plan", f"{own}:build", "--policy", "auto", "--cluster", "h100:16"]) == 0
    assert "this model's batch is not known (give --batch N to screen TP" in capsys.readouterr().err
    # a factory's default batch is read where it can be given back by name and is within --batch's bounds (a review:
    # a positional-only one failed the factory)
    from fsdp_planner.models import ModelSpec, with_own_batch

    odd = tmp_path / "odd.py"
    odd.write_text("def positional(batch_size=4, /):\n    pass\n\n\ndef huge(batch_size=10**9):\n    pass\n")
    assert [with_own_batch(ModelSpec(s)).batch_size for s in (f"{odd}:positional", f"{odd}:huge", f"{own}:batched",
                                                               "toy-llama")] == [None, None, 4, None]
    # a factory with a default batch: screened at it without --batch (auto screened none, asking for --batch)
    assert main(["plan", f"{own}:batched", "--policy", "auto", "--cluster", "h100:16"]) == 0
    out = capsys.readouterr()
    assert "1x8 x TP 2" in out.out and "give --batch N" not in out.err, out.out + out.err


def test_a_plan_file_s_layout_names_the_modules_not_checked_on_numbers(tmp_path, capsys):
    """A plan file's layout meets the numeric check as --tp's does, and the modules it could not run are said
    (the note was dropped for plan files: a reviewer's finding)."""
    from fsdp_planner.cli import main

    spec = f"{Path(__file__).parent / 'fixtures' / 'tp_detected.py'}:mixing_dropout"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "groups": [["0"], ["1"]], "tensor_parallel": {
        "degree": 2, "layout": {"*.up": "colwise", "*.down": "rowwise"}}}))
    assert main(["simulate", spec, "--plan", str(plan), "--cluster", "h100:8"]) == 0
    assert "not checked on numbers in 0, 1 (its forward draws random numbers)" in capsys.readouterr().err
    assert main(["check", spec, "--plan", str(plan)]) == 0  # (check said nothing of them: a new user's finding)
    assert "not checked on numbers in 0, 1 (its forward draws random numbers)" in capsys.readouterr().err


def test_a_large_module_is_judged_in_float32_and_a_larger_one_is_named(monkeypatch):
    """A module over float64's 64M params was not run at all: a new user's 4,096-wide attention viewing a fixed head
    count (67M params) was sharded and its plan passed ``check``. Judged in float32 up to 256M params: here with the
    float64 tier shrunk below the fixtures, the head-count view is still refused and the sound pairs still agree
    (float32's rounding is far below its bound); past the last tier the module is named in a note."""
    from fsdp_planner.service import tp_numerics
    from fsdp_planner.service.planning import SILENT, Reporter, requested_layout

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    request = PolicyRequest(PolicyName.TITAN, tp=2)
    float64, float32 = tp_numerics.TIERS
    monkeypatch.setattr(tp_numerics, "TIERS", (dataclasses.replace(float64, max_numel=10), float32))
    heads = ModelSpec(f"{fixtures}:mixing_heads")
    with pytest.raises(PlannerError, match=r"computes something else on this model: 0 \(_Mixing\)"):
        requested_layout(trace_spec(heads), request, heads, H100_8, SILENT)
    for sound in ("pairs_mlp", "two_pairs"):
        ok = ModelSpec(f"{fixtures}:{sound}")
        notes: list[str] = []
        assert requested_layout(trace_spec(ok), request, ok, H100_8, Reporter(notes.append)).degree == 2
        assert not any("not checked on numbers" in n for n in notes), notes
    # a sequence as long as the features are wide (32 here; 4,096 in a Llama 3 8B-wide block at 4,096 tokens) is
    # shortened as another is, the features kept: judged within FLOPs its whole sequence would exceed
    square = ModelSpec(f"{fixtures}:mixing_heads", seq_len=32)
    monkeypatch.setattr(tp_numerics, "TIERS", (dataclasses.replace(float64, max_flops=4e5),))
    with pytest.raises(PlannerError, match=r"computes something else on this model: 0 \(_Mixing\)"):
        requested_layout(trace_spec(square), request, square, H100_8, SILENT)
    monkeypatch.setattr(tp_numerics, "TIERS", (dataclasses.replace(float64, max_numel=10),))
    notes = []
    assert requested_layout(trace_spec(heads), request, heads, H100_8, Reporter(notes.append)).degree == 2
    assert any(re.search(r"not checked on numbers in 0, 1 \([\d,]+ params, over the 10 params this check runs", n)
               for n in notes), notes


def test_auto_says_the_tp_batch_of_the_split_it_chose_only(capsys):
    """auto searches each split of the batch, and each search's TP note was said: the discarded split's "give
    --batch 16" beside the chosen one's "give --batch 32", for one job."""
    from fsdp_planner.cli import main

    assert main(["plan", "hf:titan-qwen3-debugmodel", "--policy", "auto", "--batch", "4", "--seq", "256",
                 "--cluster", "h100:8"]) == 0
    err = capsys.readouterr().err
    assert err.count("auto's layout has TP") == 1 and "give --batch 32 for the same job" in err, err


def _detected_tp2(capsys, factory: str) -> tuple[dict[str, str], str]:
    """``plan FACTORY --policy titan --tp 2`` of a tests/fixtures/tp_detected.py model: its layout and stderr."""
    from fsdp_planner.cli import main

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    assert main(["plan", f"{fixtures}:{factory}", "--policy", "titan", "--tp", "2", "--cluster", "h100:8",
                 "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out)["plans"][0]["plan"]["tensor_parallel"]["layout"], out.err


def test_a_hand_written_llama_block_keeps_the_pairs_its_code_takes(capsys):
    """A Llama block written inline (norms beside q, k, v, o and w1, w3, w2): runs of more than two Linears made no
    pair, so --tp laid out nothing of it (a new user's LLaVA: only its vision tower's MLPs, 11% of the params).
    Each run is a pair now; where its attention views into a fixed head count (which a colwise wq cannot take),
    that kind is left whole with a note and the MLP kept; with heads inferred from the width both are kept."""
    styles, _ = _detected_tp2(capsys, "llama_blocks")
    assert {k: v for k, v in styles.items() if k.startswith("0.")} == {
        "0.wq": "colwise", "0.wk": "colwise", "0.wv": "colwise", "0.wo": "rowwise", "0.w1": "colwise",
        "0.w3": "colwise", "0.w2": "rowwise"}
    styles, err = _detected_tp2(capsys, "llama_blocks_fixed_heads")
    assert set(styles) == {f"{b}.{m}" for b in "01" for m in ("w1", "w3", "w2")}
    assert "tensor-parallel pairs wq, wk, wv -> wo in _LlamaBlock left whole over TP: one TP rank's step fails " \
        "(aten.view in module '0'" in err


def test_a_parallel_attention_and_mlp_block_makes_two_pairs_split_at_its_attention(capsys):
    """A GPT-J block (attention and MLP from one norm): its six Linears ran as one run, all but fc_out colwise, and
    --tp failed one TP rank's step blaming a fixed shape. The first Linear after the block's attention call ends its
    pair (q, k, v -> o), the rest make the MLP's; the layout runs on one TP rank's step and on the fake ranks."""
    from fsdp_planner.cli import main

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    styles, _ = _detected_tp2(capsys, "parallel_blocks")
    assert {k: v for k, v in styles.items() if k.startswith("0.")} == {
        "0.wq": "colwise", "0.wk": "colwise", "0.wv": "colwise", "0.wo": "rowwise", "0.fc_in": "colwise",
        "0.fc_out": "rowwise"}
    assert main(["verify", f"{fixtures}:parallel_blocks", "--policy", "titan", "--tp", "2", "--fake-world-size", "4",
                 "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts_and_bytes_exact"]


def test_a_pair_kind_no_degree_splits_by_heads_is_left_whole_and_the_others_kept(capsys):
    """Multi-query attention (one kv head) beside an MLP: --tp 2 refused the whole detected layout ("1 heads of 8"),
    where each kind of pair is judged alone for a fixed shape. The attention's pair is left whole with the reason,
    the MLP's kept; verify runs it on fake ranks."""
    from fsdp_planner.cli import main

    fixtures = Path(__file__).parent / "fixtures" / "tp_detected.py"
    styles, err = _detected_tp2(capsys, "mqa_blocks")
    assert set(styles) == {f"{b}.mlp.{m}" for b in "01" for m in ("up", "down")}
    said = " ".join(err.split())
    assert "tensor-parallel pairs wq, wk, wv -> wo in _MqaAttention left whole over TP: --tp 2 must give each rank " \
        "whole attention heads of 0.attn.wk: its 8 output features are 1 head of 8" in said, err
    assert main(["verify", f"{fixtures}:mqa_blocks", "--policy", "titan", "--tp", "2", "--fake-world-size", "4",
                 "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts_and_bytes_exact"]
    # a kind another degree splits refuses the degree asked for, not left whole (a review: --tp 3 of 32 heads)
    assert main(["plan", f"{fixtures}:llama_blocks", "--policy", "titan", "--tp", "8", "--cluster", "h100:8"]) == 2
    assert "--tp 8 must give each rank whole attention heads of 0.wq: its 32 output features are 4 heads of 8" in \
        capsys.readouterr().err


def test_simulate_refuses_a_sequence_sequence_parallelism_cannot_split(capsys):
    """``simulate --tp 4 --seq 1001`` simulated a layout whose sequence parallelism cannot split the sequence (the
    policy's plan was made for the model's default workload, 8,192): refused, as plan refuses it."""
    from fsdp_planner.cli import main

    assert main(["simulate", "llama3-8b", "--policy", "titan", "--tp", "4", "--seq", "1001", "--batch", "1",
                 "--cluster", "h100:8"]) == 2
    assert "--seq 1,001 must be a multiple of 4" in capsys.readouterr().err


def test_a_sequence_as_wide_as_the_features_is_judged_beside_a_conditioning_vector(monkeypatch):
    """A reviewer's DiT-style block, ``x + fc2(softmax(fc1(x * c)))`` with a conditioning vector c (b, f), at a
    sequence as long as the features are wide: shortening every dim of that length made c (1, 16) and the run raised,
    so the unsound layout was a note, not refused. c keeps its width, and a module that raises on the shortened
    sample runs on the whole sequence; token ids count as rows of its FLOPs."""
    import torch

    from fsdp_planner.service import tp_numerics as tn

    class Conditioned(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x, c):
            return x + self.fc2(torch.softmax(self.fc1(x * c[:, None, :]), -1))

    styles = {"fc1": TPStyle.COLWISE, "fc2": TPStyle.ROWWISE}
    for seq in (48, 32):  # (32: as wide as the features)
        args = (tn.TensorSpec((2, seq, 32), torch.float32), tn.TensorSpec((2, 32), torch.float32))
        assert isinstance(tn.check_module("b", Conditioned(32), styles, 2, args, {}), tn.Mismatch), seq

    class Embedded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.up, self.down = nn.Embedding(64, 32), nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, ids):
            return self.down(torch.relu(self.up(self.embed(ids))))

    ids = (tn.TensorSpec((4, 4096), torch.int64),)  # a batch of one: 2 x 4,096 rows x 8,288 params = 6.8e7 FLOPs
    monkeypatch.setattr(tn, "TIERS", (dataclasses.replace(tn.TIERS[0], max_flops=1e7),))
    verdict = tn.check_module("e", Embedded(), {"up": TPStyle.COLWISE, "down": TPStyle.ROWWISE}, 2, ids, {})
    assert isinstance(verdict, tn.Unchecked) and "FLOPs a run" in verdict.reason, verdict


def test_a_wide_normed_attention_viewed_into_a_fixed_head_count_is_judged():
    """A new user's LLaVA-style block, ``x + wo(sdpa(view(wq(norm(x)), b, s, heads, -1), ...))``: at width 64 the
    check refused its layout, at 4,096 it passed it (the TP ranks then run 2 x 32 half-width heads, another model).
    Every param was random at 1 / sqrt(its last dim), the norm's weight too: 1/64 at 4,096, so the scores were
    nearly zero, every softmax uniform and any head split alike. A vector param is random at scale 1; the same
    block with a head count of its own (``view(b, s, -1, head_dim)``) is sound at both widths."""
    import torch

    from fsdp_planner.service import tp_numerics as tn

    class Block(nn.Module):
        def __init__(self, width: int, heads: int | None, head_dim: int | None) -> None:
            super().__init__()
            self.heads, self.head_dim = heads, head_dim
            self.norm = nn.RMSNorm(width)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False) for _ in range(4))

        def forward(self, x):
            b, s, _ = x.shape
            y = self.norm(x)
            q, k, v = (w(y).view(b, s, self.heads or -1, self.head_dim or -1).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.wo(out.transpose(1, 2).reshape(b, s, -1))

    styles = {"wq": TPStyle.COLWISE, "wk": TPStyle.COLWISE, "wv": TPStyle.COLWISE, "wo": TPStyle.ROWWISE}
    for width in (64, 4096):
        args = (tn.TensorSpec((1, 16, width), torch.float32),)
        fixed = tn.check_module("b", Block(width, heads=width // 128 or 4, head_dim=None).to("meta"), styles, 2,
                                args, {})
        assert isinstance(fixed, tn.Mismatch) and fixed.error > 0.01, (width, fixed)
        own = tn.check_module("b", Block(width, heads=None, head_dim=16).to("meta"), styles, 2, args, {})
        assert own is None, (width, own)


def test_a_loss_loss_parallel_cannot_run_fails_with_the_way_out(capsys):
    """A masked mean of the per-token cross-entropy under --tp's default loss parallel failed on fake ranks with
    "aten.mul at the model's top level raised ... mixed torch.Tensor and DTensor" and no word of why (a trial): the
    error says the loss runs on vocabulary-sharded logits and names --no-loss-parallel, with which it runs."""
    from fsdp_planner.cli import main

    spec = "tests/fixtures/tp_detected.py:toy_llama_masked_loss"
    argv = ["verify", spec, "--policy", "titan", "--tp", "2", "--fake-world-size", "4"]
    assert main(argv) == 2
    assert "plan with --no-loss-parallel for this loss" in " ".join(capsys.readouterr().err.split())
    assert main([*argv, "--no-loss-parallel"]) == 0


def test_a_tp_plan_s_out_line_names_the_batch_it_records(tmp_path):
    """TP d runs d x the batch on each data-parallel rank, which the plan records: the --out line names it for
    simulate and verify (a trial's simulate of auto's TP 2 plan ran the command's batch, 121 ms for the plan's
    188), and simulate given the line's flags reads the plan's step."""
    import json

    from conftest import run_main

    out = tmp_path / "tp.json"
    r = run_main("plan", "toy-llama", "--policy", "titan", "--tp", "2", "--cluster", "h100:4", "--precision", "fp32",
                 "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    step = json.loads(r.stdout)["plans"][0]["simulation"]["step_time"]
    recorded = json.loads(out.read_text())["workload"]["batch"]
    r = run_main("plan", "toy-llama", "--policy", "titan", "--tp", "2", "--cluster", "h100:4", "--precision", "fp32",
                 "--out", str(out), "--force")
    line = r.stdout.strip().splitlines()[-1]
    assert f"(simulated with --batch {recorded} --precision fp32: give simulate and verify the same)" in line, line
    flags = line.split("(simulated with ")[1].split(":")[0].split()
    r = run_main("simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:4", *flags, "--json")
    assert json.loads(r.stdout)["step_time"] == step


FUSED_QKV = '''import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(64, 128), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).split([64, 32, 32], dim=-1)  # a fused projection split into fixed widths
        return self.proj(q * torch.cat([k, v], dim=-1))


def build(batch_size: int = 2):
    model = nn.Sequential(Attn(), Attn())
    return model, (torch.randn(batch_size, 4, 64),), lambda o: o.square().mean()
'''


def test_a_plan_file_s_colwise_fused_projection_is_told_colwise_gather(tmp_path):
    """A fused qkv given colwise splits its output by the whole widths on a TP rank: the one-rank step fails, and
    the sentence names colwise_gather (its output gathered whole), which runs (a trial's fused LM)."""
    from fsdp_planner.service.tracing import LayoutDoesNotRun, check_local_shapes

    path = tmp_path / "fused.py"
    path.write_text(FUSED_QKV)
    spec = ModelSpec(f"{path}:build")
    bad = TensorParallel(2, {"*.qkv": TPStyle.COLWISE, "*.proj": TPStyle.ROWWISE})
    with pytest.raises(LayoutDoesNotRun, match=r"split_with_sizes.*give it colwise_gather, its output gathered whole"):
        check_local_shapes(spec, bad, plan_file=True)
    check_local_shapes(spec, TensorParallel(2, {"*.qkv": TPStyle.COLWISE_GATHER, "*.proj": TPStyle.ROWWISE_SPLIT}),
                       plan_file=True)
