"""A detected tensor-parallel layout checked on numbers, not just shapes: each module holding a rowwise Linear of
the layout (one instance per class) is run in float64 on random values, whole and as the TP ranks would run it
(each rank's colwise Linears with their 1/TP of the output features, its rowwise ones with their 1/TP of the input
features, each rowwise output summed over the ranks, as ``RowwiseParallel``'s all-reduce does, its bias added
once), and the two outputs must agree.

Why: a column-then-row pair is sound only where the ops between its Linears are element-wise or per head. A
softmax or a normalize over the hidden features between them, or a view into a fixed head count whose head size
is inferred (``view(b, s, n_heads, -1)``), runs on a rank's shard without any shape error and computes something
else; in bf16 the drift it makes can hide within a short verify's bound (a new user's finding). Shapes alone
(``tracing.check_local_shapes``) cannot see it.

The module's inputs are random tensors of the shapes and dtypes its call took in the traced step (integers zero,
booleans true); params and buffers are random. A module whose inputs are not tensors, Python scalars, None or
tuples and dicts of them, whose output is not finite, or whose run raises, is not judged here (``Unchecked``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from fsdp_planner.fsdp2.tensor_parallel import TPStyle

SEED = 0
RTOL = 1e-6  # float64: what summing a product's partial sums in another order leaves is ~1e-15 of it


@dataclass(frozen=True)
class TensorSpec:
    """A captured input tensor: what a random stand-in needs."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class Unreadable(Exception):
    """An input the check cannot make a stand-in for."""


def capture(value: Any) -> Any:
    """``value`` (a module call's args or kwargs) with each tensor replaced by its ``TensorSpec``."""
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return TensorSpec(tuple(x.shape), x.dtype)
        if x is None or isinstance(x, (bool, int, float, str, TensorSpec)):
            return x
        raise Unreadable(type(x).__name__)
    return tree_map(one, value)


def _stand_in(value: Any, generator: torch.Generator) -> Any:
    def one(x: Any) -> Any:
        if not isinstance(x, TensorSpec):
            return x
        if x.dtype.is_floating_point:
            return torch.randn(x.shape, generator=generator, dtype=torch.float64)
        if x.dtype == torch.bool:
            return torch.ones(x.shape, dtype=torch.bool)
        return torch.zeros(x.shape, dtype=x.dtype)
    return tree_map(one, value)


@dataclass(frozen=True)
class Mismatch:
    """A module whose TP run differs from its whole run: the layout is not sound on it."""

    module: str
    error: float  # the largest difference relative to the whole output's largest magnitude


@dataclass(frozen=True)
class Unchecked:
    """A module the check could not run (``reason``): the layout's assumption stands unchecked there."""

    module: str
    reason: str


Verdict = Mismatch | Unchecked | None


def check_module(name: str, module: nn.Module, styles: Mapping[str, TPStyle], degree: int, args: Any,
                 kwargs: Any) -> Verdict:
    """Run ``module`` (on meta or any device: a random float64 copy is made) whole and as ``degree`` TP ranks run it
    under ``styles`` (its descendants' names, relative to it, to COLWISE or ROWWISE); None when they agree."""
    generator = torch.Generator().manual_seed(SEED)
    try:
        whole = _materialized(module, generator)
        inputs = _stand_in((args, kwargs), generator)
        with torch.no_grad():
            expected = _output(whole(*inputs[0], **inputs[1]))
            got = _ranks_output(whole, styles, degree, inputs)
    except Exception as e:  # the module's own code on inputs it was not built for: not judged
        return Unchecked(name, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    if not (torch.isfinite(expected).all() and torch.isfinite(got).all()):
        return Unchecked(name, "its output on random values is not finite")
    scale = max(float(expected.abs().max()), 1e-30)
    error = float((expected - got).abs().max()) / scale
    return Mismatch(name, error) if error > RTOL else None


def _materialized(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """A float64 CPU copy of ``module`` in eval mode (no dropout), params and floating buffers random (each
    weight's scale 1 / sqrt(its last dim), as an initializer's), integer buffers zero, boolean ones true."""
    copy = deepcopy(module).to_empty(device="cpu").to(torch.float64).eval()
    with torch.no_grad():
        for p in copy.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) / math.sqrt(max(1, p.shape[-1])))
        for b in copy.buffers():
            if b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=generator, dtype=b.dtype))
            else:
                b.fill_(True if b.dtype == torch.bool else 0)
    return copy


def _output(out: Any) -> torch.Tensor:
    """The call's tensors, flattened into one (a module may return a tuple)."""
    leaves = [t.reshape(-1) for t in _tensors(out) if t.is_floating_point()]
    if not leaves:
        raise ValueError("no floating-point output")
    return torch.cat(leaves)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _ranks_output(whole: nn.Module, styles: Mapping[str, TPStyle], degree: int, inputs: Any) -> torch.Tensor:
    """Rank 0's output when every rank runs its shard of ``whole`` and each rowwise Linear's output is the sum of
    the ranks' (its bias added once). The ranks run one after another: a pass stops each rank at its first rowwise
    call whose sum is not known yet, and sums the ranks' partial outputs there; so a module calling k rowwise
    Linears takes k + 1 passes (bounded: ``MAX_ROWWISE_CALLS``)."""
    ranks = [_shard(whole, styles, degree, r) for r in range(degree)]
    rows = [n for n, s in styles.items() if s is TPStyle.ROWWISE]
    sums: list[torch.Tensor] = []
    for _ in range(MAX_ROWWISE_CALLS + 1):
        runs = [_run(rank, rows, sums, inputs) for rank in ranks]
        if all(isinstance(r, torch.Tensor) for r in runs):
            return runs[0]
        if not all(isinstance(r, tuple) for r in runs):
            raise ValueError("the ranks called their rowwise Linears differently")
        sums.append(sum(r[0] for r in runs) + runs[0][1])
    raise ValueError(f"more than {MAX_ROWWISE_CALLS} rowwise calls in one forward")


MAX_ROWWISE_CALLS = 16


def _run(rank: nn.Module, rows: list[str], sums: list[torch.Tensor], inputs: Any
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One pass of one rank: its rowwise calls' outputs replaced by the sums known, in call order; its output, or,
    where it reaches a call past them, that call's (partial output without the bias, bias)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        bias = module.bias if module.bias is not None else torch.zeros((), dtype=out.dtype)
        calls.append((out - bias, bias))
        if len(calls) <= len(sums):
            return sums[len(calls) - 1]
        raise _Stop

    handles = [rank.get_submodule(n).register_forward_hook(hook) for n in rows]
    try:
        return _output(rank(*inputs[0], **inputs[1]))
    except _Stop:
        return calls[-1]
    finally:
        for h in handles:
            h.remove()


class _Stop(BaseException):  # (not an Exception: a model's own "except Exception" must not swallow it)
    """A pass reached a rowwise call whose sum is not known yet."""


def _shard(whole: nn.Module, styles: Mapping[str, TPStyle], degree: int, rank: int) -> nn.Module:
    """Rank ``rank``'s copy of ``whole``: its colwise Linears' rows and biases, its rowwise Linears' columns."""
    copy = deepcopy(whole)
    for name, style in styles.items():
        linear = copy.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is not an nn.Linear")
        w = linear.weight
        if style is TPStyle.COLWISE:
            rows = w.shape[0] // degree
            linear.weight = nn.Parameter(w[rank * rows:(rank + 1) * rows].clone())
            if linear.bias is not None:
                linear.bias = nn.Parameter(linear.bias[rank * rows:(rank + 1) * rows].clone())
        else:
            cols = w.shape[1] // degree
            linear.weight = nn.Parameter(w[:, rank * cols:(rank + 1) * cols].clone())
    return copy
