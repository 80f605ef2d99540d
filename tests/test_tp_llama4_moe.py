"""Llama 4's MoE layers under tensor parallelism. transformers' plan gives its experts ``moe_tp_experts`` on
params stored [experts, in, out] (``packed_rowwise`` gate_up_proj, ``colwise`` down_proj: the style
``moe_tp_experts_in_out``), and its shared expert colwise / rowwise Linears, whose output Llama4TextMoe then adds
the routed experts' sum into in place: autograd refuses that on the local tensor a TP style returns (transformers'
own TP raises there too), so the trace notes every output modified in place after its call returned and the layout
leaves those regions whole. Real DTensor + FSDP2 on the fake process group and gloo are the oracles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.tensor_parallel import Layout, check_layout, tp_layout
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.tracing import trace

FIXTURE = Path(__file__).parent / "fixtures" / "llama4_tiny.json"
SHARED = "model.layers.{}.feed_forward.shared_expert"


def test_the_trace_notes_outputs_modified_in_place_after_their_call_returned():
    """Llama 4's shared expert returns its down_proj's output, which the MoE layer adds into: both are noted, in
    every layer (the second layer's calls are replayed from the first's record), and nothing else is."""
    tr = trace_spec(ModelSpec(f"hf:{FIXTURE}", seq_len=16))
    noted = sorted(n for n, m in tr.modules.items() if m.output_modified)
    assert noted == [f"{SHARED.format(i)}{s}" for i in (0, 1) for s in ("", ".down_proj")]


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.down(self.up(x).relu())


class Scaled(nn.Module):
    """Two column-then-row pairs: the caller scales the first one's output in place, adds to the second's out of
    place."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Mlp(), Mlp()

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.first(x)
        h.mul_(0.5)  # in place, after first (and its down) returned
        return h + self.second(x)


def test_a_detected_pair_whose_output_is_modified_in_place_is_left_whole():
    """The pair that feeds an in-place op is left whole over TP with a note; the other pair keeps its styles; a
    plan file's layout that styles it anyway is refused before anything runs."""
    tr = trace(Scaled(), (torch.randn(2, 4, 8),))
    assert {n for n, m in tr.modules.items() if m.output_modified} == {"first", "first.down"}
    layout = tp_layout(tr, 2)
    styles = layout.tp.styles(tr.modules)
    assert not any(m.startswith("first") for m in styles)
    assert styles["second.up"] is TPStyle.COLWISE and styles["second.down"] is TPStyle.ROWWISE
    assert any(n.startswith("first left whole over TP: the model modifies its output in place") for n in layout.notes)
    forced = Layout(TensorParallel(2, {"*.up": TPStyle.COLWISE, "*.down": TPStyle.ROWWISE}), "a plan file")
    with pytest.raises(PlannerError, match=r"rowwise of first\.down: the model modifies its output in place after "
                                           r"it returns.*leave first whole"):
        check_layout(tr, forced, parse_cluster("h100:8"))


def test_transformers_layout_of_llama4_moe():
    """The experts take moe_tp_experts_in_out; the shared expert is left whole (said in a note); the attention is
    transformers' colwise / rowwise."""
    spec = ModelSpec(f"hf:{FIXTURE}", seq_len=16)
    tr = trace_spec(spec)
    layout = tp_layout(tr, 2, spec)
    styles = layout.tp.styles(tr.modules)
    assert styles["model.layers.0.feed_forward.experts"] is TPStyle.MOE_TP_EXPERTS_IN_OUT
    assert styles["model.layers.1.self_attn.o_proj"] is TPStyle.ROWWISE
    assert not any(m.startswith(SHARED.format(0)) for m in styles)
    assert any(n.startswith("model.layers.*.feed_forward.shared_expert left whole over TP") for n in layout.notes)
    check_layout(tr, layout, parse_cluster("h100:8"))


def test_a_packed_style_on_experts_of_the_other_layout_is_refused():
    """moe_tp_experts (Mixtral's [experts, out, in]) on Llama 4's experts would shard their model dim: refused,
    naming the style their layout takes."""
    spec = ModelSpec(f"hf:{FIXTURE}", seq_len=16)
    tr = trace_spec(spec)
    wrong = Layout(TensorParallel(2, {"model.layers.*.feed_forward.experts": TPStyle.MOE_TP_EXPERTS}), "a plan file")
    with pytest.raises(PlannerError, match=r"shards packed experts stored \[experts, out, in\] \(Mixtral's\), and "
                                           r"model\.layers\.0\.feed_forward\.experts holds gate_up_proj \[4, 64, 256\] "
                                           r"and down_proj \[4, 128, 64\]; its experts' are \[experts, in, out\] "
                                           r"\(Llama 4's\): give it the style moe_tp_experts_in_out"):
        check_layout(tr, wrong, parse_cluster("h100:8"))


@pytest.mark.integration
def test_llama4_moe_under_tp_is_exact_on_the_fake_process_group(capsys):
    """Every FSDP and TP collective count and byte exact, the peak within 1%, on 8 fake ranks (FSDP 4 x TP 2)."""
    assert main(["verify", f"hf:{FIXTURE}", "--tp", "2", "--policy", "titan", "--cluster", "h100:8", "--seq", "64",
                 "--batch", "2", "--fake-world-size", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ tp all reduce")]
    assert len(rows) == 2 and all("exact" in r for r in rows), out
    peak = next(line for line in out.splitlines() if line.startswith("│ peak memory"))
    assert abs(float(peak.split("│")[4].strip().rstrip("%"))) <= 1.0, peak


@pytest.mark.integration
def test_llama4_moe_under_tp_trains_with_parity_on_gloo(tmp_path, capsys):
    """FSDP 2 x TP 2 on 4 gloo ranks trains as one process does (fp32)."""
    config = tmp_path / "llama4.json"
    config.write_text(json.dumps({**json.loads(FIXTURE.read_text()), "num_hidden_layers": 1, "no_rope_layers": [1]}))
    assert main(["verify", f"hf:{config}", "--tp", "2", "--policy", "titan", "--cluster", "h100:8", "--seq", "16",
                 "--batch", "2", "--nproc", "4", "--precision", "fp32"]) == 0
    assert "PASS" in capsys.readouterr().out
