"""Random tiny models and random plans for the validity property test (``test_validity_property.py``).

A model is a tree of ``Node`` modules (nesting depth 1-3) over ``Leaf`` linears. Each node's forward runs a random
program of steps: call a child, call a submodule of a child directly (outside the child's forward), call a module
again (reuse), or read a leaf's weight directly. Leaves may share their weight (tied), be frozen, or hold their
params in the other floating dtype than the model's (they cast their input and output). Everything is drawn from
one seed, so the same seed builds the same model under meta tensors (to trace) and fake tensors (to run FSDP2).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from fsdp_planner.apply.fully_shard import apply_plan, device_mesh
from fsdp_planner.fsdp2.plan import Plan

WIDTH = 8


class Leaf(nn.Module):
    """A linear whose params may be of another dtype than its input: it computes in theirs, returns in the input's."""

    def __init__(self, dtype: torch.dtype, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=dtype) / WIDTH)
        self.bias = nn.Parameter(torch.zeros(WIDTH, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x.to(self.weight.dtype), self.weight, self.bias)).to(x.dtype)


@dataclass(frozen=True)
class Step:
    """One step of a node's forward: ``x = path(x)``, or with ``read``, ``x = x @ path.weight.T``."""

    path: tuple[str, ...]  # attribute names from the node down to the module
    read: bool = False


class Node(nn.Module):
    """A module whose forward runs ``program`` (steps over its children and their submodules)."""

    def __init__(self) -> None:
        super().__init__()
        self.program: list[Step] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.program:
            target: nn.Module = self
            for name in step.path:
                target = getattr(target, name)
            if step.read:
                w = target.weight
                x = torch.tanh(x.to(w.dtype) @ w.t()).to(x.dtype)
            else:
                x = target(x)
        return x


@dataclass
class Drawn:
    """What a seed drew, besides the model itself (for failure messages)."""

    seed: int
    dtype: torch.dtype
    depth: int
    features: list[str] = field(default_factory=list)


def _node(rng: random.Random, depth: int, dtype: torch.dtype, leaves: list[Leaf]) -> Node:
    """A node with 1-3 children, nodes down to ``depth`` more levels, leaves at the bottom."""
    node = Node()
    for i in range(rng.randint(1, 3)):
        if depth > 1 and (i == 0 or rng.random() < 0.5):
            child: nn.Module = _node(rng, depth - 1, dtype, leaves)
        else:
            other = torch.bfloat16 if dtype == torch.float32 else torch.float32
            child = Leaf(other if rng.random() < 0.15 else dtype, bias=rng.random() < 0.7)
            leaves.append(child)
        node.add_module(f"c{i}", child)
    return node


def _program(rng: random.Random, node: Node, features: list[str]) -> None:
    """Each node's steps: its children in a random order, sometimes a grandchild called or a weight read directly,
    sometimes a step repeated (a module called twice); then the same for each child node."""
    children = callable_children(node)
    steps = [Step(path) for path, _ in children]
    rng.shuffle(steps)
    for path, child in children:
        if isinstance(child, Node):
            for sub, grandchild in child.named_children():
                if rng.random() < 0.25:
                    steps.insert(rng.randint(0, len(steps)), Step((*path, sub)))
                    features.append("direct call")
                elif isinstance(grandchild, Leaf) and rng.random() < 0.1:
                    steps.insert(rng.randint(0, len(steps)), Step((*path, sub), read=True))
                    features.append("weight read")
    if steps and rng.random() < 0.2:
        steps.insert(rng.randint(0, len(steps)), rng.choice(steps))
        features.append("reuse")
    if rng.random() < 0.1 and len(steps) > 1:
        steps.pop(rng.randrange(len(steps)))  # a child never called
        features.append("unused")
    node.program = steps
    for _, child in children:
        if isinstance(child, Node):
            _program(rng, child, features)


def callable_children(node: nn.Module) -> list[tuple[tuple[str, ...], nn.Module]]:
    """A node's children with their paths, a ModuleList's items in its place (the list itself has no forward)."""
    out: list[tuple[tuple[str, ...], nn.Module]] = []
    for name, child in node.named_children():
        if isinstance(child, nn.ModuleList):
            out += [((name, i), block) for i, block in child.named_children()]
        else:
            out.append(((name,), child))
    return out


def build(seed: int) -> tuple[nn.Module, tuple[torch.Tensor], Drawn]:
    """The model of ``seed`` and its input, on the current default device (meta or under a fake mode)."""
    rng = random.Random(seed)
    dtype = torch.float32 if rng.random() < 0.75 else torch.bfloat16
    drawn = Drawn(seed, dtype, rng.randint(1, 3))
    leaves: list[Leaf] = []
    model = _node(rng, drawn.depth, dtype, leaves)
    blocks = random.Random(f"blocks {seed}")  # its own stream: the draws below stay those of a model without
    if blocks.random() < 0.35:  # repeated blocks in a ModuleList (the block class the policies and --ac look for)
        count, depth = blocks.randint(2, 3), max(1, drawn.depth - 1)
        model.add_module("blocks", nn.ModuleList(_node(blocks, depth, dtype, leaves) for _ in range(count)))
        drawn.features.append("blocks")
    _program(rng, model, drawn.features)
    if len(leaves) > 1 and rng.random() < 0.3:  # a tied weight: two leaves of one dtype share it
        a, b = rng.sample(leaves, 2)
        if a.weight.dtype == b.weight.dtype:
            b.weight = a.weight
            drawn.features.append("tied")
    for leaf in leaves:
        if rng.random() < 0.15:
            leaf.requires_grad_(False)
            drawn.features.append("frozen")
    if all(not p.requires_grad for p in model.parameters()):
        leaves[0].requires_grad_(True)  # something to train
    if any(leaf.weight.dtype != dtype for leaf in leaves):
        drawn.features.append("mixed dtypes")
    # an input with a grad: backward runs even when every trainable leaf goes unused (and FSDP2 then hooks the
    # post-backward on the inputs)
    grad_input = rng.random() < 0.3 or any(f in drawn.features for f in ("frozen", "unused"))
    x = torch.randn(2, WIDTH, dtype=dtype, requires_grad=grad_input)
    return model, (x,), drawn


def loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def random_groups(rng: random.Random, candidates: list[str], first_use: dict[str, int]) -> list[list[str]]:
    """1-4 groups of modules: each a run of consecutive modules in first-use order, or any random set."""
    ordered = sorted(candidates, key=lambda m: (first_use.get(m, 1 << 30), m))
    groups = []
    for _ in range(rng.randint(1, min(4, len(ordered)))):
        if rng.random() < 0.5:
            i = rng.randrange(len(ordered))
            groups.append(ordered[i:i + rng.randint(1, 3)])
        else:
            groups.append(rng.sample(ordered, rng.randint(1, min(3, len(ordered)))))
    return groups


class FreedRead(TorchDispatchMode):
    """Records the first op that reads a tensor whose storage FSDP2 has freed (an unsharded param resized to 0
    bytes after its group resharded): under fake tensors that read raises nothing, on GPUs it reads garbage."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.first is None:
            for t in tree_flatten((args, kwargs or {}))[0]:
                if (isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t) and t.numel()
                        and t.untyped_storage().nbytes() == 0):
                    self.first = str(func)
                    break
        return func(*args, **(kwargs or {}))


def train_on_fake_ranks(seed: int, plan: Plan, world_size: int = 8, steps: int = 2) -> str | None:
    """Apply ``plan`` to the model of ``seed`` with real ``fully_shard`` on ``world_size`` fake ranks and train
    ``steps`` steps (forward, loss, backward, AdamW); None when they ran, else what went wrong."""
    return _trained(lambda: build(seed)[:2], plan, world_size, steps)


def apply_on_fake_ranks(spec: str, plan: Plan, world_size: int = 2, steps: int = 2) -> str | None:
    """``train_on_fake_ranks`` for the model of a factory spec (``file.py:fn`` returning (model, (x,)))."""
    from fsdp_planner.models import resolve_factory

    return _trained(lambda: resolve_factory(spec)()[:2], plan, world_size, steps)


def _trained(make: Callable[[], tuple[nn.Module, tuple[torch.Tensor]]], plan: Plan, world_size: int,
             steps: int) -> str | None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = device_mesh(plan, "cpu", world_size)
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            model, (x,) = make()
        # fully_shard outside the fake mode: the mesh of an int reshard_after_forward's sub-groups is built from a
        # tensor, whose .tolist() a fake tensor cannot answer (the model's fake params still dispatch to their mode)
        apply_plan(model, plan, mesh=mesh)
        with fake:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            freed = FreedRead()
            for _ in range(steps):
                with freed:
                    loss(model(x)).backward()
                optimizer.step()
                optimizer.zero_grad()
            return f"read a freed unsharded param in {freed.first}" if freed.first else None
    except Exception as e:  # what real FSDP2 raises is the finding
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
