from __future__ import annotations

import ast
import importlib
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import traced
from torch.utils.flop_counter import FlopCounterMode

from fsdp_planner.models import load_model
from fsdp_planner.trace import EventKind, record

trace_package = importlib.import_module("fsdp_planner.trace")  # the package (its ``trace`` attribute is the function)


def test_seed_net_order_params_and_flops(seed_trace):
    tr = seed_trace
    assert [p.fqn for p in tr.params] == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                          "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    fwd_order = [e.module for e in tr.events if e.kind is EventKind.FWD_PRE]
    assert fwd_order == ["", "conv1", "conv2", "dropout1", "fc1", "dropout2", "fc2"]
    layers = ("conv1", "conv2", "fc1", "fc2")
    bwd_order = [e.module for e in tr.events if e.kind is EventKind.BWD_PRE and e.module in layers]
    assert bwd_order == ["fc2", "fc1", "conv2", "conv1"]
    first = {tr.params[i].fqn: idx for i, idx in tr.index.first_use.items()}
    assert first["conv1.weight"] < first["conv2.weight"] < first["fc1.weight"] < first["fc2.weight"]
    # backward ops read the weights through saved views (found by storage, not identity)
    bwd_users = {tr.params[p].fqn for e in tr.events if e.is_op and e.backward for p in e.params}
    assert {"conv2.weight", "fc1.weight", "fc2.weight"} <= bwd_users
    assert tr.modules["fc1"].fwd_flops == 2 * 8 * 9216 * 128
    assert tr.modules["conv1"].calls == 1 and tr.modules["dropout1"].calls == 1


def test_flops_match_flop_counter_mode():
    lm = load_model("toy-llama", meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    lm2 = load_model("toy-llama", meta=True)
    with FlopCounterMode(display=False) as fc:
        lm2.loss_fn(lm2.model(*lm2.example_inputs)).backward()
    assert tr.fwd_flops + tr.bwd_flops == fc.get_total_flops()
    assert tr.modules[""].fwd_flops == tr.fwd_flops
    assert 1.8 < tr.bwd_flops / tr.fwd_flops < 2.2


@pytest.mark.parametrize("groups", [1, 4, 64])
def test_a_grouped_conv_s_backward_is_twice_its_forward(groups: int) -> None:
    """FlopCounterMode counts a grouped conv's weight gradient over every channel (torch 2.13's
    ``conv_backward_flop`` leaves groups out): a depthwise conv's backward read 65x its forward; it is 2x."""
    conv = nn.Conv2d(64, 64, 3, padding=1, groups=groups, bias=False)
    x = torch.randn(8, 64, 16, 16, requires_grad=True)
    tr = record(conv, (x,), lambda y: y.sum())
    assert tr.fwd_flops == 2 * 8 * 64 * (64 // groups) * 9 * 16 * 16
    assert tr.bwd_flops == 2 * tr.fwd_flops


def test_tied_weights_detected():
    tr = traced("toy-gpt2-tied")
    shared = [p for p in tr.params if p.is_shared]
    assert len(shared) == 1
    assert shared[0].fqn == "wte.weight" and shared[0].aliases == ("lm_head.weight",)
    assert set(shared[0].owners) == {"wte", "lm_head"}
    assert tr.param("lm_head.weight") is shared[0]
    wte = tr.index.param_index["wte.weight"]
    users = {e.module for e in tr.events if e.is_op and not e.backward and wte in e.params}
    assert users == {"wte", "lm_head"}


class _UsesOutside(nn.Module):
    """A parent reading a child's weight directly: module hooks alone would miss this use."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) @ self.b.weight


def test_param_used_outside_its_module_and_module_called_twice():
    with torch.device("meta"):
        m = nn.Sequential(_UsesOutside())
        shared_block = nn.Linear(4, 4)
        twice = nn.Sequential(shared_block, nn.ReLU(), shared_block)
        x = torch.randn(2, 4)
    tr = record(m, (x,))
    b = tr.index.param_index["0.b.weight"]
    users = {e.module for e in tr.events if e.is_op and not e.backward and b in e.params}
    assert users == {"0"}
    tr2 = record(twice, (x,))
    assert tr2.modules["0"].calls == 2
    assert "2" not in tr2.modules  # the same module object keeps its first FQN


def test_real_model_traced_under_fake_tensors():
    lm = load_model("seed-net", meta=False)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    assert tr.fwd_flops == traced("seed-net").fwd_flops
    assert all(p.grad is None for p in lm.model.parameters())


def test_llama3_8b_traces_without_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tr = traced("llama3-8b")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert abs(tr.numel - 8_030_261_248) < 1e6
    assert grown_mb < 1024
    # activations saved for backward are recorded (flash attention on meta keeps them linear in seq)
    assert sum(e.saved for e in tr.events) > 0


_LIVE_BYTES = """
import sys
{first}
from fsdp_planner.models import load_model
from fsdp_planner.trace import record
lm = load_model("toy-llama")
imported = "torch._dynamo" in sys.modules  # before the trace
print(imported, max(e.live for e in record(lm.model, lm.example_inputs, lm.loss_fn).events))
"""


@pytest.mark.integration  # seconds of real FSDP2 or tracing: the full suite runs it
def test_a_trace_does_not_depend_on_what_ran_before_it():
    """Building on meta imports nothing of torch._dynamo; were its first import made by a decomposition inside the
    traced step, the frames it keeps in reference cycles would hold the model's output alive through the loss (the
    collector is paused): the loss's live bytes would depend on whether something had imported it before."""
    runs = [subprocess.run([sys.executable, "-c", _LIVE_BYTES.format(first=first)], capture_output=True, text=True,
                           timeout=120) for first in ("", "import torch._dynamo")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    (lazy, lazy_live), (_, first_live) = (r.stdout.split() for r in runs)
    assert lazy == "False" and lazy_live == first_live


def test_the_trace_layer_has_no_import_cycles():
    """Each module of trace/ imports the others at its top, and the imports form no cycle."""
    folder = Path(trace_package.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = {n.module.rpartition(".")[2] for n in tree.body
               if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fsdp_planner.trace.")}
        every = {n.module.rpartition(".")[2] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fsdp_planner.trace.")}
        assert every == top, f"{path.name} imports {every - top} inside a function"
        graph[path.stem] = top
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module not in done:
            for dep in graph.get(module, ()):
                visit(dep, (*path, module))
            done.add(module)

    for module in graph:
        visit(module, ())


def test_a_real_model_reads_its_params_as_on_meta():
    """Under the fake mode, a real param's fake copy must stay alive for the trace: its storage is how a read
    through a view (``weight.t()`` into a matmul) is told to be the param's. Once it died, the matmuls read no
    param, the views counted as saved activations, and toy-llama's reserved peak came out 15% high."""
    from fsdp_planner.models import load_model
    from fsdp_planner.sim.tracing import trace as traced

    events = []
    for meta in (True, False):
        lm = load_model("toy-llama", meta=meta)
        events.append([(e.kind, e.module, e.params, e.flops) for e in traced(lm.model, lm.example_inputs,
                                                                             lm.loss_fn).events])
    assert events[0] == events[1]


def test_a_real_batch_is_the_batch_as_on_meta():
    """Under the fake mode the first op reads a real input through its fake copy: counted by its storage alone,
    its save was an activation, and a real model's peak came out one input above its meta twin's (a trial of the
    API: 524,288 bytes, the input's)."""
    from fsdp_planner.sim.tracing import trace as traced

    def build() -> tuple[nn.Module, torch.Tensor]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), torch.randn(4, 256, 64)

    model, x = build()
    with torch.device("meta"):
        twin, meta_x = build()
    saved = [[e.saved for e in traced(m, (i,), lambda out: out.square().mean(), precision="fp32").events]
             for m, i in ((model, x), (twin, meta_x))]
    assert saved[0] == saved[1] and sum(saved[0]) > 0


class _Gated(nn.Module):
    """A product of two projections: its backward makes the grads of both factors, one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = (nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False),
                                    nn.Linear(16, 8, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x) * self.b(x))


def test_gradient_flow_counts_the_gradients_still_alive_at_a_backward_op() -> None:
    """The second grad of a product's backward is made while the first is alive, beside the grad it reads: three
    (batch, 16) gradients at once (``Event.grad_live`` counts every gradient still alive, wherever it was made);
    and a weight's grad leaves the count once autograd accumulates it."""
    with torch.device("meta"):  # a module after it: the product's backward runs after the output Linear's
        model = nn.Sequential(_Gated(), nn.Linear(8, 8, bias=False))
        x = torch.randn(32, 8)
    tr = record(model, (x,), lambda out: out.sum())
    grad, out_grad = 32 * 16 * 4, 32 * 8 * 4  # fp32 gradients of the product and of the output
    ops = [e for e in tr.events if e.backward and e.kind is not EventKind.BWD_PRE]
    out_done = next(k for k, e in enumerate(ops) if e.kind is EventKind.BWD_POST and e.module == "0.out")
    # the output Linear: its input grad's matmul reads the output grad and makes the product's, and its weight's
    # grad, made just before, is not counted (the replay counts param grads)
    loss_grad = 4  # the loss's scalar gradient (``sum``'s backward expands it): alive all backward
    assert max(e.grad_live for e in ops[:out_done]) == out_grad + grad + loss_grad
    product = max(e.grad_live for e in ops[out_done:] if e.kind is EventKind.OP and not e.module.startswith("0."))
    assert product == 3 * grad + loss_grad
