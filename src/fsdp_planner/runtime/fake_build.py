"""The model a spec names, built for the fake ranks (``fake_world.py``): its params, buffers and inputs fake tensors.

The factory runs under the ``FakeTensorMode``. A constructor that reads a tensor's value (ConvNeXt's drop-path
rates, ``torch.linspace(0, rate, depth, device="cpu").tolist()``; an ``.item()``) cannot run there: a fake tensor
has no value to give (``DataDependentOutputException``). Such a model is built again as ``plan`` builds it, on the
meta device (``meta_init``), where a tensor made on an explicit device is real and its values readable, and then
made fake: each meta or real param, buffer and input becomes a fake CPU tensor of its shape and dtype, ties kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from fsdp_planner.errors import PlannerError
from fsdp_planner.models.hf import own_checkpointing_off
from fsdp_planner.models.on_meta import meta_init
from fsdp_planner.patching import patched
from fsdp_planner.trace.recorder import default_loss

# What a fake tensor raises when asked for a value (or for a shape that depends on one)
VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)


@dataclass(frozen=True)
class FakeModel:
    """What the factory returned, made of fake tensors: the model, its example inputs and its loss."""

    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any], torch.Tensor]
    on_meta: bool = False  # built on meta (its constructor reads a tensor value), then made fake


def build_fake(factory: Callable[[], tuple], spec: str, mode: FakeTensorMode) -> FakeModel:
    """``factory()`` (the spec's, with its workload's arguments) under ``mode``, which is active; on meta where its
    constructor reads a tensor value (module docstring). What the factory raises is one line."""
    try:
        with swappable_params(mode):
            return _as_fake_model(factory())
    except VALUE_READS:
        pass  # built again on meta, below, outside this handler: its failure is not "during" this one
    except (Exception, SystemExit) as e:
        raise PlannerError(f"model factory '{spec}' raised {type(e).__name__} under fake tensors: {e}") from e
    try:
        with unset_fake_temporarily(), meta_init():
            built = factory()
    except (Exception, SystemExit) as e:
        raise PlannerError(f"model factory '{spec}' reads a tensor value, which fake tensors cannot give, and on "
                           f"meta raised {type(e).__name__}: {e}") from e
    return _made_fake(_as_fake_model(built), mode)


def _as_fake_model(built: tuple) -> FakeModel:
    own_checkpointing_off(built[0])  # the plan checkpoints, as apply_plan has it (``hf.own_checkpointing_off``)
    return FakeModel(built[0], built[1], built[2] if len(built) == 3 else default_loss)


def _made_fake(built: FakeModel, mode: FakeTensorMode) -> FakeModel:
    """``built`` with every param, buffer and input tensor that is not fake replaced by a fake CPU tensor of the
    same shape, dtype and ``requires_grad``; in place, so a param shared by several modules stays shared and a
    ``loss_fn`` that reads the model reads the fake one. What the loss reads from the factory's closure (labels
    made on meta beside the model) is read as fake too (``_MetaReadAsFake``)."""
    fakes: dict[int, torch.Tensor] = {}
    for module in built.model.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if is_fake(t):
                continue
            if id(t) not in fakes:
                fake = _fake(t, mode)
                fakes[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
            setattr(module, name, fakes[id(t)])  # a buffer stays a buffer, persistent or not
    inputs = tree_map_only(torch.Tensor, lambda t: t if is_fake(t) else _fake(t, mode).requires_grad_(t.requires_grad),
                           built.inputs)
    return FakeModel(built.model, inputs, _reading_meta_as_fake(built.loss_fn), on_meta=True)


def _fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor like ``t`` (meta or real; no values are copied: the fake ranks have none)."""
    with mode:
        return _empty_like(t)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


class _MetaReadAsFake(TorchFunctionMode):
    """Each meta tensor a torch function reads is read as a new fake CPU tensor like it, the step's tracker counting
    it as a real step counts labels moved to the device. A function mode, above autograd: what an op saves for
    backward (``nll_loss``'s target) is the fake tensor."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map_only(torch.Tensor, lambda t: _empty_like(t) if t.is_meta else t, (args, kwargs or {}))
        return func(*args, **kwargs)


def _reading_meta_as_fake(loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    def loss(out: Any) -> torch.Tensor:
        with _MetaReadAsFake():
            return loss_fn(out)

    return loss


@contextlib.contextmanager
def swappable_params(mode: FakeTensorMode) -> Iterator[None]:
    """A factory's ``.to(dtype)``, ``.float()`` or ``.half()`` under the fake mode: ``Module._apply`` swaps a fake
    param with its converted copy (``torch.utils.swap_tensors``), which refuses a tensor with a weak reference, and
    the fake mode's converter memo holds one to every tensor it made. The memo is a cache: the two tensors' entries
    are dropped before each swap, only while the factory runs."""
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo
    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
            del memo[key]
        original(t1, t2)

    with patched(torch.utils, "swap_tensors", swap):
        yield
