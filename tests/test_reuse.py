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

RESNET_WIDE = str(Path(__file__).parent / "fixtures" / "resnet_models.py") + ":wide"

FIXTURES = Path(__file__).parent / "fixtures"
FACTORIES = ["twice", "reads_outside", "root_param", "shared_submodule", "param_free_prologue"]


def fingerprint(tr):
    events = [tuple(e) for e in tr.events]
    modules = {m: (i.calls, i.fwd_flops, i.bwd_flops, i.first_use, i.params, i.children) for m, i in tr.modules.items()}
    return events, modules, tr.params


@pytest.fixture
def replays(monkeypatch):
    """Counts the module calls replayed from a template."""
    counted = {"n": 0, "modules": []}
    original = reuse_module.BlockReuse._replay

    def counting(self, *args, **kwargs):
        counted["n"] += 1
        counted["modules"].append(args[0].module)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(reuse_module.BlockReuse, "_replay", counting)
    return counted


def same_both_ways(model, inputs, loss_fn=None):
    full = record(model, inputs, loss_fn, reuse=False)
    fast = record(model, inputs, loss_fn, reuse=True)
    assert fingerprint(fast) == fingerprint(full)
    return fast


@pytest.mark.parametrize("spec", ["toy-gpt2-tied", RESNET_WIDE])
def test_replayed_calls_hold_the_frame_their_real_call_holds(spec):
    """A replayed call's frame (``Event.held``) is its template's: a template's recording holds neither the
    arguments it replays from nor its inner calls' outputs past their real lifetime, its inputs count as made
    before it, and a call replayed inside one adds its own recording's frame at its last pack."""
    lm = load_model(spec, meta=True)
    full = record(lm.model, lm.example_inputs, lm.loss_fn, reuse=False)
    fast = record(lm.model, lm.example_inputs, lm.loss_fn, reuse=True)
    held = [e.held for e in full.events]
    assert [e.held for e in fast.events] == held
    assert any(held)


@pytest.mark.integration  # seconds of real FSDP2 or tracing: the full suite runs it
@pytest.mark.parametrize("spec", [n for n in BUILTINS if n not in ("llama3-70b", "llama3-405b", "llama32-1b")])
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


# Models of other shapes (issue 34): every repeated block class whose calls trace alike is replayed, whatever the
# model's shape, and the trace is the full trace's.
class NineLinearBlock(nn.Module):
    """The issue's block: nine Linear + ReLU and a LayerNorm, returning the LayerNorm's output."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(9))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.relu(lin(x))
        return self.norm(x)


class Stages(nn.Module):
    """Nested ModuleLists: stages of blocks, each a ModuleList of its own."""

    def __init__(self, stages: int, blocks: int, d: int = 16) -> None:
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(NineLinearBlock(d) for _ in range(blocks)) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x


def shaped(shape: str) -> nn.Module:
    if shape == "blocks":
        return nn.Sequential(*(NineLinearBlock() for _ in range(6)))
    if shape == "narrow-deep":  # many tiny layers, each a Sequential ending in its last child's output
        return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(40)))
    if shape == "flat":
        return nn.Sequential(*(m for _ in range(30) for m in (nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16))))
    if shape == "nested-sequential":  # the output is three nested calls' own
        return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.ReLU(), nn.Sequential(
            nn.Linear(16, 16)))) for _ in range(5)))
    if shape == "inplace-sequential":  # the block's output is an in-place ReLU's: its input's storage, counted
        return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU(inplace=True)) for _ in range(5)))
    return Stages(3, 4)


@pytest.mark.parametrize("shape", ["blocks", "narrow-deep", "flat", "nested-sequential", "nested-lists",
                                   "inplace-sequential"])
@pytest.mark.parametrize("grad_input", [False, True])
def test_models_of_any_shape_replay_their_blocks(shape, grad_input, replays):
    with torch.device("meta"):
        model = shaped(shape)
        x = torch.randn(8, 16, requires_grad=grad_input)
    same_both_ways(model, (x,))
    # every block call replayed but a signature's first two (recorded, then confirmed) and the first block's,
    # whose input alone may not need a grad
    blocks = [m for m in model.modules() if m is not model and m not in replays["modules"]
              and (m in model._modules.values() or isinstance(m, NineLinearBlock))]
    signatures = 3 if shape == "flat" else 1
    assert len(blocks) <= 3 * signatures


def test_replayed_block_returning_its_childs_output_to_a_parent_that_returns_it():
    """Three hooks on one tensor (the child's, the block's, the parent's): a replay keeps their order."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), *(nn.Sequential(nn.ReLU(), nn.LayerNorm(16)) for _ in range(4)))
        wrapped = nn.Sequential(model)
    fast = same_both_ways(wrapped, (torch.randn(8, 16, device="meta"),))
    pres = [e.module for e in fast.events if e.kind.name == "BWD_PRE"]
    assert pres[:3] == ["0.4.1", "0.4", "0"]  # the last block's LayerNorm, the block, the model


class Selector(nn.Module):
    """A data-dependent path: the rows it projects are the routing stand-in's share (routing.py), which depends on
    the last topk the step ran, outside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return x.index_add(0, rows, self.lin(x[rows]))


class Routed(nn.Module):
    """Selectors after a 4-expert topk, then after an 8-expert one: the same block calls, different shares."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList(Selector() for _ in range(4))
        self.second = nn.ModuleList(Selector() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for experts, blocks in ((4, self.first), (8, self.second)):
            x = x + x[:, :experts].topk(2, dim=-1).values.sum(-1, keepdim=True)
            for block in blocks:
                x = block(x)
        return x


def test_data_dependent_blocks_replay_what_the_stand_in_did(replays):
    """A replayed call tells the stand-in what its ops did (the note names every module), and a call after other
    routing is keyed apart (its selection is another share)."""
    with torch.device("meta"):
        model = Routed()
        x = torch.randn(64, 16, requires_grad=True)
    fast = same_both_ways(model, (x,))
    assert fast.notes == record(model, (x,), reuse=False).notes
    assert "'first.0', 'first.1', 'first.2' and 5 more modules" in fast.notes[0]
    assert sum(m is b for m in replays["modules"] for b in model.second) >= 2
