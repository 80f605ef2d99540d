"""Repeated modules traced once and replayed (trace/reuse.py): the trace must equal a full trace, event for event."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.models import BUILTINS, load_model
from fsdp_planner.trace import record
from fsdp_planner.trace import reuse as reuse_module

FIXTURES = Path(__file__).parent / "fixtures"
FACTORIES = ["twice", "reads_outside", "root_param", "shared_submodule", "param_free_prologue"]


def fingerprint(tr):
    events = [tuple(e) for e in tr.events]
    modules = {m: (i.calls, i.fwd_flops, i.bwd_flops, i.first_use, i.params, i.children) for m, i in tr.modules.items()}
    return events, modules, tr.params


@pytest.fixture
def replays(monkeypatch):
    """Counts the module calls replayed from a template."""
    counted = {"n": 0}
    original = reuse_module.BlockReuse._replay

    def counting(self, *args, **kwargs):
        counted["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(reuse_module.BlockReuse, "_replay", counting)
    return counted


def same_both_ways(model, inputs, loss_fn=None):
    full = record(model, inputs, loss_fn, reuse=False)
    fast = record(model, inputs, loss_fn, reuse=True)
    assert fingerprint(fast) == fingerprint(full)
    return fast


@pytest.mark.integration  # seconds of real FSDP2 or tracing: the full suite runs it
@pytest.mark.parametrize("spec", [n for n in BUILTINS if n not in ("llama3-70b", "llama3-405b")])
def test_builtins_trace_the_same_with_reuse(spec, replays):
    lm = load_model(spec)
    same_both_ways(lm.model, lm.example_inputs, lm.loss_fn)
    if spec in ("toy-llama", "llama3-8b", "vit-h14", "mixtral-8x7b", "t5-3b"):
        assert replays["n"] > 0  # repeated blocks were replayed, not traced again


@pytest.mark.parametrize("name", FACTORIES)
def test_fixture_models_trace_the_same_with_reuse(name):
    lm = load_model(f"{FIXTURES / 'factories.py'}:{name}")
    same_both_ways(lm.model, lm.example_inputs, lm.loss_fn)


@pytest.mark.parametrize("spec", ["seed-net", "toy-llama", "toy-gpt2-tied"])
def test_real_models_under_fake_tensors_trace_the_same(spec):
    lm = load_model(spec, meta=False)
    same_both_ways(lm.model, lm.example_inputs, lm.loss_fn)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.add_(1.0)
        x = x * 1.0
        return F.relu(y) + x


class ReturnsView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[..., :16]


GLOBAL = torch.ones(16, device="meta")


class SavesGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * GLOBAL


class Indexed(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> tuple:
        y = self.lin(x) * scale
        if self.index % 2:
            y = torch.tanh(y)
        return (y if mask is None else y * mask), None


class Stack(nn.Module):
    def __init__(self, make) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.blocks = nn.ModuleList(make(i) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            out = b(x, scale=0.5) if isinstance(b, Indexed) else b(x)
            x = out[0] if isinstance(out, tuple) else out
        return x


@pytest.mark.parametrize("make", [lambda i: InPlace(), lambda i: ReturnsView(), lambda i: SavesGlobal(),
                                  lambda i: Indexed(i)], ids=["in-place", "view", "global", "attribute"])
def test_calls_that_cannot_be_replayed_are_traced(make):
    with torch.device("meta"):
        model = Stack(make)
        x = torch.randn(4, 16, requires_grad=True)
    same_both_ways(model, (x,))


@functools.lru_cache
def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    return torch.full((n, n), float("-inf"), device=device).triu(1)


class MaskBlock(nn.Module):
    """Reads a cached global mask: only the first call computes it (a second identical call records otherwise,
    so the template is not used)."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(0, 1) + causal_mask(x.shape[0], x.device)
        return torch.softmax(s, -1) @ x + x


class RouterBlock(nn.Module):
    """Two outputs that need grads, the second unused by the loss: which gets a grad depends on the caller."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin, self.router = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.lin(x)) + x, self.router(x)


class MLPBlock(nn.Module):
    """Returns its last child's output tensor: that child's pre-backward hook fires first in a real run."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Table(nn.Module):
    """No params, called with an int: nothing to take a device from but its template."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.arange(16, dtype=torch.float32))

    def forward(self, n: int) -> torch.Tensor:
        return torch.outer(torch.arange(n, device=self.freq.device, dtype=torch.float32), self.freq).cos()


class TableBlock(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.index, self.table, self.lin = i, Table(), nn.Linear(16, 16)  # index: blocks differ, tables repeat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.table(x.shape[0]) + x


@pytest.mark.parametrize("make", [MaskBlock, RouterBlock, MLPBlock, TableBlock],
                         ids=["cached-global", "two-grad-outputs", "child-output", "no-tensor-argument"])
def test_review_counterexamples_trace_the_same(make):
    causal_mask.cache_clear()
    with torch.device("meta"):
        model = Stack(make)
        x = torch.randn(16, 16, requires_grad=True)
    full = record(model, (x,), reuse=False)
    causal_mask.cache_clear()
    assert fingerprint(record(model, (x,), reuse=True)) == fingerprint(full)


_CALLS = [0]


class _CountingBlock(torch.nn.Module):
    """Its forward depends on a global counter: outside what reuse can see (module state and arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS[0] += 1
        y = self.lin(x)
        return self.extra(y) if _CALLS[0] % 3 == 0 else y


def test_forward_reading_global_state_needs_a_full_trace():
    """The documented limit of reuse (and why ``--full-trace`` exists): a block whose forward reads state outside
    itself is replayed wrongly; the full trace sees which calls read ``extra``."""
    with torch.device("meta"):
        model = torch.nn.Sequential(*(_CountingBlock() for _ in range(6)))

    def extra_reads(reuse: bool) -> set[str]:
        _CALLS[0] = 0
        tr = record(model, (torch.randn(2, 8, device="meta"),), reuse=reuse)
        return {tr.params[p].fqn for e in tr.events if e.is_op and not e.backward for p in e.params
                if tr.params[p].fqn.endswith("extra.weight")}

    assert extra_reads(reuse=False) == {"2.extra.weight", "5.extra.weight"}
    assert extra_reads(reuse=True) != extra_reads(reuse=False)
