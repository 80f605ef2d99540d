"""Data-dependent ops in a planned step: one documented stand-in, so a router written the common way traces.

A mixture-of-experts router picks each expert's tokens with ``torch.where(mask)``, ``nonzero``, a boolean index
``x[mask]`` or ``masked_select``, and asks Python about the counts (``.item()``, ``.tolist()``, ``if mask.any()``);
a vision-language model checks its image placeholders the same way. Their outputs' sizes or values depend on data
that meta and fake tensors do not have, so PyTorch refuses them there. While a step is planned the trace runs them
as a balanced router would have them:

- a selection (``nonzero``, ``torch.where(cond)``, boolean indexing, ``masked_select``) takes ``ceil(n / E x
  capacity)`` of a mask's ``n`` elements, where ``E`` is the choice count of the last ``topk`` (or top-1
  ``argmax`` over a dim) the step ran (the
  experts; each expert gets ``tokens x top_k / E`` rows, as ``models/hf_experts.py`` dispatches Hugging Face
  experts), or all ``n`` when no ``topk`` ran (a placeholder mask: the most memory);
- a Python value read from a tensor (``.item()``, ``bool()``, ``.tolist()``): ``True`` for a boolean (a check
  passes, a branch is taken), an expert's balanced row count for an integer, ``0.0`` for a float.

``capacity`` is the capacity factor (``--routing``, default 1: perfectly balanced). Each op that stood in is
recorded with the module it ran in, for the note the commands print. Real tensors never stand in.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_CAPACITY = 1.0
NOT_HANDLED = object()

_aten = torch.ops.aten
# What a user wrote, for the note: the aten op says less than the Python it came from.
_SPELLED = {
    "aten.nonzero": "aten.nonzero (torch.where(cond), nonzero)",
    "aten.index": "aten.index (x[mask])",
    "aten.masked_select": "aten.masked_select",
    "aten._local_scalar_dense": "aten._local_scalar_dense (.item(), bool(), int())",
    "aten._to_copy": "aten._to_copy (.tolist(), .cpu() of a meta tensor)",
}
# The only ops the stand-in acts on: those it stands in for (``StandIn.run``) and the routing it notes
# (``StandIn.saw``). Every other op (a ReLU's backward, ``where``, a matmul) reads no values: the op recorder runs
# it directly, without the stand-in's Python (``intercepts``).
_INTERCEPTED = frozenset({_aten.nonzero, _aten.index, _aten.masked_select, _aten._local_scalar_dense, _aten._to_copy,
                          _aten.topk, _aten.argmax})
# The errors PyTorch raises for a data-dependent op on tensors without data (meta, or fake without a shape env).
_REFUSALS = ("DynamicOutputShapeException", "DataDependentOutputException")
_REFUSAL_TEXTS = ("register_meta function for torch.nonzero", "cannot be called on meta tensors",
                  "Cannot copy out of meta tensor", "with Meta tensors, but there was no fake impl")


@dataclass
class StandIn:
    """The stand-in's state for one traced step: the capacity, the routing seen so far and what stood in."""

    capacity: float = DEFAULT_CAPACITY
    experts: int | None = None  # choices of the last topk: the experts
    per_expert: int = 1  # an expert's balanced row count at that topk
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, module) -> times

    def saw(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Note a ``topk``'s expert count and per-expert rows (its input is (tokens, experts) scores); an
        ``argmax`` over a dim is a top-1 router's (Switch Transformer's), k = 1 (not ``max``: a hand-written softmax
        takes one over the keys, and would make a later placeholder mask look routed)."""
        packet = getattr(func, "_overloadpacket", None)
        if not args or not isinstance(args[0], torch.Tensor):
            return
        if packet is _aten.topk:
            scores, k = args[0], int(args[1]) if len(args) > 1 else int(kwargs.get("k", 1))
            dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
        elif packet is _aten.argmax and (len(args) > 1 or kwargs.get("dim") is not None):
            found = args[1] if len(args) > 1 else kwargs["dim"]
            if not isinstance(found, int):  # argmax() over every element: no routing
                return
            scores, k, dim = args[0], 1, found
        else:
            return
        if scores.dim() == 0 or scores.shape[dim] == 0:
            return
        self.experts = int(scores.shape[dim])
        tokens = scores.numel() // self.experts
        self.per_expert = max(1, math.ceil(tokens * k / self.experts * self.capacity))

    def selected(self, n: int) -> int:
        """Of a mask's ``n`` elements, how many the stand-in takes."""
        if self.experts is None:
            return n
        return min(n, max(1, math.ceil(n / self.experts * self.capacity)))

    @staticmethod
    def intercepts(func: Any) -> bool:
        """Whether ``call`` can do anything but run ``func`` (an aten OpOverload): only then is it worth calling."""
        return getattr(func, "_overloadpacket", None) in _INTERCEPTED

    def call(self, func: Any, args: tuple, kwargs: dict, module: str) -> Any:
        """``func`` itself; where PyTorch refuses it as data-dependent on planned tensors, its stand-in (a fake
        tensor that knows its value, such as an optimizer's step count, answers for itself)."""
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if not refused(e):
                raise
            out = self.run(func, args, kwargs, module)
            if out is NOT_HANDLED:
                raise
            return out
        self.saw(func, args, kwargs)
        return out

    def run(self, func: Any, args: tuple, kwargs: dict, module: str) -> Any:
        """``func``'s stand-in output on planned tensors, or ``NOT_HANDLED``."""
        packet = func._overloadpacket
        out: Any = NOT_HANDLED
        if packet is _aten.nonzero and _planned(args[0]):
            out = self._nonzero(args[0])
        elif packet is _aten.index and _planned(args[0]) and any(_is_mask(i) for i in args[1]):
            indices = []
            for i in args[1]:
                indices.extend(self._nonzero(i).unbind(1) if _is_mask(i) else [i])
            out = func(args[0], indices)
        elif packet is _aten.masked_select and _planned(args[0]):
            n = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
            out = args[0].new_empty((self.selected(n),))
        elif packet is _aten._local_scalar_dense and _planned(args[0]):
            out = self._value(args[0])
        elif packet is _aten._to_copy and args[0].is_meta and kwargs.get("device") not in (None, torch.device("meta")) \
                and not args[0].is_floating_point():
            t = args[0]
            dtype = kwargs.get("dtype") or t.dtype
            out = torch.full(t.shape, self._value(t), dtype=dtype, device=kwargs["device"])
        if out is not NOT_HANDLED:
            key = (_SPELLED.get(f"aten.{packet.__name__}", f"aten.{packet.__name__}"), module)
            self.used[key] = self.used.get(key, 0) + 1
            _consult()
        return out

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros((self.selected(mask.numel()), mask.dim()), dtype=torch.long, device=mask.device)

    def _value(self, t: torch.Tensor) -> bool | int | float:
        if t.dtype == torch.bool:
            return True
        if not t.is_floating_point() and not t.is_complex():
            return self.per_expert
        return 0.0

    def note(self) -> str | None:
        """One line naming what stood in, where; None when nothing did."""
        if not self.used:
            return None
        by_op: dict[str, list[str]] = {}
        for op, module in self.used:
            by_op.setdefault(op, []).append("the model" if not module else repr(module))
        places = "; ".join(f"{op} in {', '.join(ms[:3])}" + (f" and {len(ms) - 3} more modules" if len(ms) > 3 else "")
                           for op, ms in by_op.items())
        share = "an equal share per expert" if self.experts is not None else "every element of a mask"
        return (f"data-dependent ops traced with the balanced-routing stand-in ({share}, capacity factor "
                f"{self.capacity:g}; --routing sets it): {places}")


def _planned(t: Any) -> bool:
    from fsdp_planner.attention import planned

    return isinstance(t, torch.Tensor) and planned(t)


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) and _planned(t)


_CAPACITY: contextvars.ContextVar[float] = contextvars.ContextVar("fsdp_planner_routing", default=DEFAULT_CAPACITY)


@contextlib.contextmanager
def capacity(factor: float) -> Iterator[None]:
    """The capacity factor the stand-ins use inside (``--routing``); Hugging Face experts read it too."""
    token = _CAPACITY.set(factor)
    try:
        yield
    finally:
        _CAPACITY.reset(token)


def current_capacity() -> float:
    _consult()
    return _CAPACITY.get()


_CONSULTED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("fsdp_planner_routing_consulted",
                                                                               default=None)


@contextlib.contextmanager
def consulted() -> Iterator[list[int]]:
    """Counts, in the one-item list it yields, the times a stand-in or an experts layer used the capacity factor
    inside: zero, and ``--routing`` changed nothing (a dense model routes no tokens)."""
    count = [0]
    token = _CONSULTED.set(count)
    try:
        yield count
    finally:
        _CONSULTED.reset(token)


def _consult() -> None:
    count = _CONSULTED.get()
    if count is not None:
        count[0] += 1


def refused(e: BaseException) -> bool:
    """PyTorch refused a data-dependent op on a tensor without data (what the stand-in did not cover)."""
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ in _REFUSALS or any(s in text for s in _REFUSAL_TEXTS)


# Ops whose output's size or value depends on the data: what a refusal of one of them means.
DATA_DEPENDENT_OPS = frozenset({"aten.nonzero", "aten.masked_select", "aten.index", "aten._local_scalar_dense",
                                "aten._to_copy", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
                                "aten.bincount", "aten.histc", "aten.repeat_interleave", "aten.argwhere"})
WAY_OUT = ("depends on tensor values, which a planned step does not have, and the balanced-routing stand-in does not "
           "cover it: write the router with a fixed capacity (tokens x top_k / experts rows per expert, e.g. topk "
           "then index_select on sorted indices), or compute the value in the factory rather than in forward")


def data_dependent(e: BaseException, op: str | None) -> bool:
    """``e`` is PyTorch refusing a data-dependent op (``op``, as ``failures.op_name`` names it) on planned tensors."""
    return refused(e) and (type(e).__name__ in _REFUSALS or op in DATA_DEPENDENT_OPS)
