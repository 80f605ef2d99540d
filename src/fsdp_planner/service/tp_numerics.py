"""A detected tensor-parallel layout checked on numbers, not just shapes: each module holding a rowwise Linear of
the layout is run in float64 (float32 for a large one: ``TIERS``) on random values, whole and as the TP ranks would
run it (each rank's colwise Linears with their 1/TP of the output features, its rowwise ones with their 1/TP of the
input features, each rowwise output summed over the ranks, as ``RowwiseParallel``'s all-reduce does, its bias added
once), and the two outputs must agree.

Why: a column-then-row pair is sound only where the ops between its Linears are element-wise or per head. A
softmax or a normalize over the hidden features between them, or a view into a fixed head count whose head size
is inferred (``view(b, s, n_heads, -1)``), runs on a rank's shard without any shape error and computes something
else; in bf16 the drift it makes can hide within a short verify's bound (a new user's finding). Shapes alone
(``tracing.check_local_shapes``) cannot see it.

The module's inputs are random tensors of the shapes and dtypes its call took in the traced step (integers zero,
booleans true, or false where true makes the output not finite: a key padding mask all true masks every key), a
batch of one and a short sequence where the inputs tell them (``_samples``); params and
buffers are random. Not judged
(``Unchecked``, said in a note): a module larger than the last tier's params, one that cannot be copied, whose inputs
are not tensors, Python scalars, None or tuples and dicts of them, whose forward draws random numbers (two whole runs
differ), whose run raises or whose output is not finite, or that returns a tensor of the features TP splits
(its caller's use of it is not run here).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves, tree_map

from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.tensor_parallel import TPStyle

SEED = 0


@dataclass(frozen=True)
class Tier:
    """The precision a module of up to ``max_numel`` params is judged in: its copy's dtype, the matmul FLOPs one
    run may take, and the relative difference below which the TP run agrees with the whole one."""

    dtype: torch.dtype
    max_numel: int
    max_flops: float
    rtol: float


# float64 while its copy is 512 MB (a 70B model's block, 856M params, took 17 GB and 7 minutes on a 2-core host);
# float32 up to 1 GiB, so a 4,096-wide attention (67M params: a new user's view into a fixed head count there was
# assumed, not checked) is judged too. What summing partial products in another order leaves: ~1e-15 of the output
# in float64, 3-4e-7 in float32 (measured: sound GQA attention and SwiGLU MLPs 8,192 and 16,384 wide). A layout that
# mixes the features TP splits: 0.1-1 of it for a norm or a head-count view, but a softmax over them inside a
# residual module only 1.3-1.8e-4 (4,096-7,168 wide: a reviewer's measurements), hence float32's 1e-5. FLOPs:
# float64 on a CPU core runs ~1e9 a second, float32 ~4e9, and the check makes 2 + TP x (rowwise calls + 1) runs
TIERS = (Tier(torch.float64, 64_000_000, 2e9, 1e-6), Tier(torch.float32, 256_000_000, 8e9, 1e-5))
MAX_NUMEL = TIERS[0].max_numel  # what the modules judged beside each other add up to (``tracing._judged_modules``)
MAX_ROWWISE_CALLS = 16  # rowwise calls followed in one forward (a pass each)


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


@dataclass(frozen=True)
class Mismatch:
    """A module whose TP run differs from its whole run: the layout is not sound on it."""

    module: str
    error: float  # the largest difference relative to that output's largest magnitude


@dataclass(frozen=True)
class Unchecked:
    """A module the check could not run (``reason``): the layout's assumption stands unchecked there."""

    module: str
    reason: str


Verdict = Mismatch | Unchecked | None


def check_module(name: str, module: nn.Module, styles: Mapping[str, TPStyle], degree: int, args: Any,
                 kwargs: Any) -> Verdict:
    """Run ``module`` (on meta or any device: a random copy is made, in the first ``Tier`` that takes its params
    and its run's FLOPs) whole and as ``degree`` TP ranks run it under ``styles`` (its descendants' names, relative
    to it, to COLWISE or ROWWISE); None when they agree. Where the shortened inputs are a guess (``_samples``) and
    the module raises on them, it runs on the next sample."""
    numel = sum(p.numel() for p in module.parameters())
    if numel > TIERS[-1].max_numel:
        return Unchecked(name, f"{fmt_count(numel, 'param')}, over the {fmt_count(TIERS[-1].max_numel, 'param')} "
                               "this check runs on a CPU")
    verdict: Verdict = None
    for inputs in _samples(args, kwargs):
        work = 2 * _tokens(inputs) * numel
        tier = next((t for t in TIERS if numel <= t.max_numel and work <= t.max_flops), None)
        if tier is None:
            verdict = Unchecked(name, f"{work:.1e} FLOPs a run on its inputs' shapes, over the "
                                      f"{TIERS[-1].max_flops:.0e} this check runs on a CPU")
            continue
        try:
            with _training_paths():
                return _judged(name, module, styles, degree, inputs, tier)
        except Exception as e:  # the module's own code on inputs it was not built for, or a copy it refuses
            verdict = Unchecked(name, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    return verdict


def _judged(name: str, module: nn.Module, styles: Mapping[str, TPStyle], degree: int, inputs: Any, tier: Tier
            ) -> Verdict:
    """``check_module``'s run of ``module`` on ``inputs`` in ``tier`` (what the module raises propagates). Boolean
    inputs are all true, then all false where that run's output is not finite: a mask's meaning is the module's
    (a key padding mask all true masks every key, an SDPA mask all false does), and a NaN output hides a mismatch."""
    whole = _materialized(module, tier.dtype)
    masks = any(x.dtype == torch.bool for x in _specs(inputs))
    verdict: Verdict = None
    for fill in (True, False) if masks else (True,):
        with torch.no_grad():
            expected, again = _output(whole, inputs, SEED, fill), _output(whole, inputs, SEED + 1, fill)
            if not _alike(expected, again):  # (NaN where the first run has NaN is alike: not a random draw)
                return Unchecked(name, "its forward draws random numbers")
            if not all(torch.isfinite(t).all() for t in expected):
                verdict = Unchecked(name, "its output on random values is not finite" + (
                    " with its boolean inputs all true or all false" if masks else ""))
                continue
            got = _ranks_output(whole, styles, degree, inputs, fill)
        if [t.shape for t in got] != [t.shape for t in expected]:
            return Unchecked(name, "it returns a tensor of the features TP splits, whose use is its caller's")
        if not all(torch.isfinite(t).all() for t in got):  # finite whole, not on the ranks: the layout's doing
            return Mismatch(name, math.inf)
        error = max((float((e - g).abs().max()) / max(float(e.abs().max()), 1e-30) for e, g in
                     zip(expected, got, strict=True) if e.numel()), default=0.0)
        return Mismatch(name, error) if error > tier.rtol else None
    return verdict


@contextlib.contextmanager
def _training_paths() -> Iterator[None]:
    """The inference fast path of nn.MultiheadAttention and nn.TransformerEncoderLayer off: the check's copies run
    in eval mode (no dropout) without grad, where torch takes it, and a training step never does (it made NaN of
    a random float key padding mask: a trial's nn.TransformerEncoder went unchecked)."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


def _alike(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Two runs' outputs equal, NaN for NaN."""
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x.isnan(), y.isnan())
                                    and torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(a, b, strict=True))


def _materialized(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A ``dtype`` CPU copy of ``module`` in eval mode (no dropout module), params and floating buffers random (each
    matrix's scale 1 / sqrt(its last dim), as an initializer's; a vector's, a norm's weight or a bias, 1: at 1 /
    sqrt(its length) a 4,096-wide norm scaled the attention's scores to nothing, every head's softmax was uniform
    and a view into a fixed head count passed, where its whole and TP runs differ by 0.37), integer buffers zero,
    boolean ones true."""
    generator = torch.Generator().manual_seed(SEED)
    copy = deepcopy(module).to_empty(device="cpu").to(dtype).eval()
    with torch.no_grad():
        for p in copy.parameters():
            scale = math.sqrt(max(1, p.shape[-1])) if p.dim() > 1 else 1.0
            p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) / scale)
        for b in copy.buffers():
            if b.dtype.is_floating_point:
                b.copy_(torch.randn(b.shape, generator=generator, dtype=b.dtype))
            else:
                b.fill_(True if b.dtype == torch.bool else 0)
    return copy


def _samples(args: Any, kwargs: Any) -> list[tuple[Any, Any]]:
    """The captured inputs made small: their first dim 1 where every input tensor shares it (the batch), and the
    sequence ``SHORT_SEQ`` long where the first 3-D input is (batch, sequence, features) with the sequence longer
    than that (every dim of that length shortened: masks, positions). The check is as sound on a short sample, and a
    block at 8,192 tokens is minutes of float64 on a CPU. A sequence as long as the features are wide (Llama 3 8B at
    4,096 tokens: a new user's block was left unjudged) makes the shortening a guess: the last dim of a 2-D or 3-D
    floating input is kept (features, a conditioning vector), and the sample with the whole sequence follows."""
    specs = list(_specs((args, kwargs)))
    firsts = {x.shape[0] for x in specs if x.shape}
    batch = next(iter(firsts)) if len(firsts) == 1 else None
    hidden = next((x for x in specs if len(x.shape) == 3 and x.dtype.is_floating_point), None)
    seq = hidden.shape[1] if hidden is not None and hidden.shape[1] > SHORT_SEQ else None
    square = seq is not None and seq == hidden.shape[2]

    def small(shortened: int | None) -> tuple[Any, Any]:
        """The inputs with the batch one and each dim of length ``shortened`` (None: none) ``SHORT_SEQ`` long."""
        def one(x: Any) -> Any:
            if not isinstance(x, TensorSpec) or not x.shape:
                return x
            kept = len(x.shape) - 1 if square and len(x.shape) in (2, 3) and x.dtype.is_floating_point else None
            return TensorSpec(tuple(1 if k == 0 and batch is not None else SHORT_SEQ if d == shortened and k != kept
                                    else d for k, d in enumerate(x.shape)), x.dtype)
        return tree_map(one, (args, kwargs))
    return [small(seq), small(None)] if square else [small(seq)]


SHORT_SEQ = 16


def _tokens(inputs: Any) -> int:
    """The rows the module's matmuls run on: its largest floating input's elements over its last dim, or an
    integer input's elements (token ids: a module embedding them; counted as 1 row, its 7e11 FLOPs ran for minutes
    within a 2e9 bound)."""
    specs = [x for x in _specs(inputs) if x.shape]
    rows = [math.prod(x.shape[:-1]) for x in specs if x.dtype.is_floating_point]
    ids = [math.prod(x.shape) for x in specs if not x.dtype.is_floating_point and x.dtype != torch.bool]
    return max([*rows, *ids], default=1)


def _specs(value: Any) -> Iterator[TensorSpec]:
    for x in tree_leaves(value):
        if isinstance(x, TensorSpec):
            yield x


def _stand_in(value: Any, dtype: torch.dtype, fill: bool) -> Any:
    """Random tensors for ``value``'s specs (floating ones in ``dtype``, booleans ``fill``, integers zero), the same
    on every call (each run gets its own copies: a module may change its inputs in place)."""
    generator = torch.Generator().manual_seed(SEED)

    def one(x: Any) -> Any:
        if not isinstance(x, TensorSpec):
            return x
        if x.dtype.is_floating_point:
            return torch.randn(x.shape, generator=generator, dtype=dtype)
        if x.dtype == torch.bool:
            return torch.full(x.shape, fill, dtype=torch.bool)
        return torch.zeros(x.shape, dtype=x.dtype)
    return tree_map(one, value)


def _output(module: nn.Module, inputs: tuple[Any, Any], seed: int, fill: bool,
            params: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The floating tensors of one run's output, on fresh stand-ins (boolean ones ``fill``) and under ``seed``
    (``params``: some of the module's params replaced, as a TP rank holds them)."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float64)
    args, kwargs = _stand_in(inputs, dtype, fill)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = functional_call(module, dict(params or {}), tuple(args), kwargs, strict=False)
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _ranks_output(whole: nn.Module, styles: Mapping[str, TPStyle], degree: int, inputs: Any, fill: bool
                  ) -> list[torch.Tensor]:
    """Rank 0's output when every rank runs its shard of ``whole`` and each rowwise Linear's output is the sum of
    the ranks' (its bias added once). The ranks run one after another: a pass stops each rank at its first rowwise
    call whose sum is not known yet, and sums the ranks' partial outputs there; so a module calling k rowwise
    Linears takes k + 1 passes (bounded: ``MAX_ROWWISE_CALLS``)."""
    shards = [_shard(whole, styles, degree, r) for r in range(degree)]
    rows = [n for n, s in styles.items() if s is TPStyle.ROWWISE]
    sums: list[torch.Tensor] = []
    for _ in range(MAX_ROWWISE_CALLS + 1):
        runs = [_run(whole, shard, rows, sums, inputs, fill) for shard in shards]
        if all(isinstance(r, list) for r in runs):
            return runs[0]
        if not all(isinstance(r, tuple) for r in runs):
            raise ValueError("the ranks called their rowwise Linears differently")
        sums.append(sum(r[0] for r in runs) + runs[0][1])
    raise ValueError(f"more than {MAX_ROWWISE_CALLS} rowwise calls in one forward")


def _run(whole: nn.Module, shard: dict[str, torch.Tensor], rows: list[str], sums: list[torch.Tensor], inputs: Any,
         fill: bool) -> list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
    """One pass of one rank: its rowwise calls' outputs replaced by (copies of) the sums known, in call order; its
    output, or, where it reaches a call past them, that call's (partial output without the bias, bias)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        bias = module.bias if module.bias is not None else torch.zeros((), dtype=out.dtype)
        calls.append((out - bias, bias))
        if len(calls) <= len(sums):
            return sums[len(calls) - 1].clone()  # (the module may change it in place)
        raise _Stop

    handles = [whole.get_submodule(n).register_forward_hook(hook) for n in rows]
    try:
        return _output(whole, inputs, SEED, fill, shard)
    except _Stop:
        return calls[-1]
    finally:
        for h in handles:
            h.remove()


class _Stop(BaseException):  # (not an Exception: a model's own "except Exception" must not swallow it)
    """A pass reached a rowwise call whose sum is not known yet."""


def _shard(whole: nn.Module, styles: Mapping[str, TPStyle], degree: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s params of ``whole`` where they differ from the whole's: its colwise Linears' rows and biases,
    its rowwise Linears' columns (views: no copy of the module)."""
    out: dict[str, torch.Tensor] = {}
    for name, style in styles.items():
        linear = whole.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is not an nn.Linear")
        w = linear.weight
        if style is TPStyle.COLWISE:
            rows = w.shape[0] // degree
            out[f"{name}.weight"] = w[rank * rows:(rank + 1) * rows]
            if linear.bias is not None:
                out[f"{name}.bias"] = linear.bias[rank * rows:(rank + 1) * rows]
        else:
            cols = w.shape[1] // degree
            out[f"{name}.weight"] = w[:, rank * cols:(rank + 1) * cols]
    return out
