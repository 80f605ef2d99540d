"""``check --cluster``'s answers say why a faster change is kept out: memory, not "does not pay"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import answers
from fsdp_planner.sim.budget import MemoryBudget


def test_a_faster_layout_over_the_budget_is_kept_for_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """HSDP 3% faster but over the budget once read 'no other layout pays' (check llama3-8b on h100:4096)."""
    plan = Plan(groups=[], fingerprint="", numel=0)
    # pure FSDP: 1.0 s within the budget; every HSDP layout: 0.9 s, over it
    monkeypatch.setattr(answers, "_step", lambda tr, p, cluster, options: SimpleNamespace(
        step_time=1.0 if p.mesh is None else 0.9, reserved_memory=10 if p.mesh is None else 1000))
    budget = MemoryBudget(limit=100, capacity=200, gpu="GPU", headroom=None)
    base = SimpleNamespace(step_time=1.0, reserved_memory=10)
    found = answers._hsdp(None, plan, parse_cluster("h100:64"), None, base, budget)  # type: ignore[arg-type]
    assert found is not None and "is faster, but over the 100 B budget" in found.fix, found.fix
