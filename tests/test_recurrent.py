"""torch's own RNNs: traced cell by cell on meta tensors, which neither a GPU (cuDNN) nor a CPU runs; said."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_main

MODELS = Path(__file__).parent / "fixtures" / "rnn_models.py"


@pytest.mark.parametrize(("factory", "kind", "count"), [("gru", "GRU", 2), ("lstm", "LSTM", 1)])
def test_a_plan_of_a_model_with_torch_rnns_says_they_are_approximate(factory, kind, count):
    r = run_main("plan", f"{MODELS}:{factory}", "--policy", "order", "--cluster", "h100:8")
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join((r.stdout + r.stderr).split())
    modules = f"{count} {kind} {'modules' if count > 1 else 'module'}"
    assert f"note: {modules} ('rnns.0' first) traced as ATen's cell-by-cell recurrence" in out
    assert "cuDNN's fused RNN kernel" in out


def test_a_model_without_rnns_has_no_such_note():
    r = run_main("plan", "toy-llama", "--policy", "titan", "--cluster", "h100:8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cell-by-cell" not in r.stdout + r.stderr
