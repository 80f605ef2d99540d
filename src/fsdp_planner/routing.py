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
- a Python value read from a tensor (``.item()``, ``bool()``, ``.tolist()``) answers as a valid input would:
  - an integer read from an index the stand-in can place (a ``topk``/``argmax`` index over ``E`` choices, a row of
    its own ``nonzero``) is that index's value in a balanced routing (token ``t``'s slot ``j`` picks expert
    ``(t x k + j) mod E``; ``nonzero`` picks evenly spread elements of the mask), so it is in range of the dim it
    came from and a DBRX-style ``for e in hit.nonzero(): w[e.item()]`` visits every expert once; any other integer
    is an expert's balanced row count (a size: the sorted router's ``.tolist()`` counts);
  - a boolean read of a scalar comparison (``labels.max() >= vocab``, ``mask.sum() > 0``) compares a value that lies
    just inside the bound it is compared with (one below a positive bound, one above a bound <= 0) unless the
    stand-in knows the value; ``==`` holds and ``!=`` does not (counts that must match do): a valid input never
    trips a check that raises. Any other boolean is ``True`` (``if mask.any()``: the branch with work is taken);
  - ``0.0`` for a float.

``capacity`` is the capacity factor (``--routing``, default 1: perfectly balanced). Each op that stood in is
recorded with the module it ran in, for the note the commands print. Real tensors never stand in.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_planner.errors import PlannerError
from fsdp_planner.patching import patched

DEFAULT_CAPACITY = 1.0
NOT_HANDLED = object()
# Answers the stand-in gives one op in one module call site a step: a router reads at most a few per expert in its
# module (DeepSeek-V3's 256 experts: a nonzero each), while a loop whose condition reads a tensor (``while x.max()
# < 100``) reads forever on the stand-in's constant answers: the trace stops there with one line (about 20 s of
# tracing on a 2-core host), not a hang
MAX_ANSWERS = 10_000

_aten = torch.ops.aten
# What a user wrote, for the note: the aten op says less than the Python it came from.
_SPELLED = {
    "aten.nonzero": "aten.nonzero (torch.where(cond), nonzero)",
    "aten.index": "aten.index (x[mask])",
    "aten.masked_select": "aten.masked_select",
    "aten._local_scalar_dense": "aten._local_scalar_dense (.item(), bool(), int(), a scalar formatted)",
    "aten._to_copy": "aten._to_copy (.tolist(), .cpu() of a meta tensor)",
    "aten.bincount": "aten.bincount (an expert's token count, minlength given)",
}
# The only ops the stand-in acts on: those it stands in for (``StandIn.run``) and the routing it notes
# (``StandIn.saw``). Every other op (a ReLU's backward, ``where``, a matmul) reads no values: the op recorder runs
# it directly, without the stand-in's Python (``intercepts``).
_COMPARISONS = {_aten.eq: lambda a, b: a == b, _aten.ne: lambda a, b: a != b, _aten.lt: lambda a, b: a < b,
                _aten.le: lambda a, b: a <= b, _aten.gt: lambda a, b: a > b, _aten.ge: lambda a, b: a >= b}
_INTERCEPTED = frozenset({_aten.nonzero, _aten.index, _aten.masked_select, _aten._local_scalar_dense, _aten._to_copy,
                          _aten.bincount, _aten.topk, _aten.argmax, _aten.max, *_COMPARISONS})
# The errors PyTorch raises for a data-dependent op on tensors without data (meta, or fake without a shape env).
_REFUSALS = ("DynamicOutputShapeException", "DataDependentOutputException")
_REFUSAL_TEXTS = ("register_meta function for torch.nonzero", "cannot be called on meta tensors",
                  "Cannot copy out of meta tensor", "with Meta tensors, but there was no fake impl",
                  "a meta tensor without output_size")  # repeat_interleave by a tensor of counts


MAX_ROUTED_EXPERTS = 1024  # a max over more scores is no router's (a vocab's: a loss's accuracy over its logits)


def _top1_max(args: tuple, kwargs: dict, module: str) -> bool:
    """Whether a ``max`` call is a top-1 router's: in a module (not the loss's top level), over the last dim of 2-D
    (tokens, experts) scores of at most ``MAX_ROUTED_EXPERTS``, without keepdim (``max(dim)`` returns the indices
    beside the values)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return bool(module) and isinstance(dim, int) and dim in (-1, 1) and not keepdim and args[0].dim() == 2 \
        and args[0].shape[-1] <= MAX_ROUTED_EXPERTS


@dataclass
class StandIn:
    """The stand-in's state for one traced step: the capacity, the routing seen so far and what stood in."""

    capacity: float = DEFAULT_CAPACITY
    starved: bool = field(default_factory=lambda: _STARVED.get())  # ``starved()``: the first routed selection
    # after each routing (the first expert's) takes nothing, or a mask of the experts hit leaves the last out
    selections: int = 0  # routed selections since the last topk
    reads: int = 0  # values read since the last topk that the stand-in answers for itself (``_value``)
    experts: int | None = None  # choices of the last topk: the experts
    per_expert: int = 1  # an expert's balanced row count at that topk
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, module) -> times
    answers: int = 0  # ops it answered this step: each one the host would wait for on a GPU (``Event.syncs``)
    # the values the stand-in gives tensors it can place: storage -> value of the element at a storage offset
    values: dict[StorageWeakRef, tuple[StorageWeakRef, Callable[[int], int | bool]]] = field(default_factory=dict)

    def saw(self, func: Any, args: tuple, kwargs: dict, out: Any, module: str) -> None:
        """Note a ``topk``'s expert count and per-expert rows (its input is (tokens, experts) scores); an
        ``argmax`` over a dim is a top-1 router's (Switch Transformer's), k = 1, and so is a ``max`` over the last
        dim of (tokens, experts) scores without keepdim (``w, idx = p.max(-1)``: a trial's router, whose every
        expert was charged every token). Not another ``max``: a hand-written softmax takes one over the keys with
        keepdim, to subtract it, and would make a later placeholder mask look routed."""
        packet = getattr(func, "_overloadpacket", None)
        if not args or not isinstance(args[0], torch.Tensor):
            return
        if packet in _COMPARISONS:
            self._compared(packet, args, out)
            return
        if packet is _aten.topk:
            scores, k = args[0], int(args[1]) if len(args) > 1 else int(kwargs.get("k", 1))
            dim = int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
        elif packet is _aten.argmax and (len(args) > 1 or kwargs.get("dim") is not None):
            found = args[1] if len(args) > 1 else kwargs["dim"]
            if not isinstance(found, int):  # argmax() over every element: no routing
                return
            scores, k, dim = args[0], 1, found
        elif packet is _aten.max and _top1_max(args, kwargs, module):
            scores, k, dim = args[0], 1, -1
        else:
            return
        if scores.dim() == 0 or scores.shape[dim] == 0:
            return
        self.experts, self.selections, self.reads = int(scores.shape[dim]), 0, 0
        tokens = scores.numel() // self.experts
        self.per_expert = max(1, math.ceil(tokens * k / self.experts * self.capacity))
        index = out[1] if packet in (_aten.topk, _aten.max) else out
        if isinstance(index, torch.Tensor) and _planned(index):  # contiguous (..., k): element o is (t x k + j)
            experts = self.experts
            self._remember(index, lambda o: o % experts)

    def _compared(self, packet: Any, args: tuple, out: Any) -> None:
        """A scalar comparison's verdict, for the boolean read that follows (the module docstring's rule)."""
        if not (isinstance(out, torch.Tensor) and out.dim() == 0 and _planned(out)) or len(args) < 2:
            return
        a, b = (self._known(x) for x in args[:2])
        if self.experts is not None and (a is None) != (b is None) and (b if a is None else a) == 0:
            # a count compared with zero after a routing, an emptiness guard (``if mask.sum() > 0``, ``if mask.sum()
            # == 0: continue``): an expert's rows, or none for the first such question when starved
            count = self._count_read()
            a, b = (count, b) if a is None else (a, count)
        elif a is None or b is None:
            if packet in (_aten.eq, _aten.ne):  # counts that must match do
                a, b = 0, 0
            elif a is None and b is not None:  # just inside the bound it is compared with
                a = b - 1 if b > 0 else b + 1
            elif b is None and a is not None:
                b = a + 1 if a >= 0 else a - 1
        verdict = bool(_COMPARISONS[packet](a, b)) if a is not None and b is not None else None
        if verdict is not None:
            self._remember(out, lambda o, v=verdict: v)

    def _known(self, x: Any) -> int | float | None:
        """A Python number, or the value the stand-in gave a one-element tensor; None when it has none."""
        if isinstance(x, bool) or not isinstance(x, (int, float, torch.Tensor)):
            return None
        if not isinstance(x, torch.Tensor):
            return x
        if x.numel() != 1:
            return None
        if not _planned(x):
            return x.item()
        found = self._recalled(x)
        return None if found is None else found(x.storage_offset())

    def _remember(self, t: torch.Tensor, value: Callable[[int], int | bool]) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        self.values[ref] = (ref, value)

    def _recalled(self, t: torch.Tensor) -> Callable[[int], int | bool] | None:
        """The value the stand-in gave ``t``'s storage; None for another storage (one that died and whose address
        a new one took: its weak reference has expired)."""
        found = self.values.get(StorageWeakRef(t.untyped_storage()))
        if found is None or found[0].expired():
            return None
        return found[1]

    def selected(self, n: int) -> int:
        """Of a mask's ``n`` elements, how many the stand-in takes."""
        if self.experts is None:  # no routing
            return n
        if n in (self.experts, self.experts + 1):  # a per-expert mask: each expert is hit (with one class more,
            # transformers' DBRX one-hots its top-k into E + 1 classes: the extra class never is); starved, one
            # expert is not, as the first selection would take nothing (Switch Transformers' loop over the hit
            # experts calls only those)
            if self.starved and self.selections == 0 and not self.reads:
                self.selections += 1
                return self.experts - 1
            return self.experts
        self.selections += 1
        if self.starved and self.selections == 1 and not self.reads:  # (a guard read first asked for that expert)
            return 0
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
        self.saw(func, args, kwargs, out, module)
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
            out = self._value(args[0], read=True)
        elif packet is _aten.bincount and _planned(args[0]):
            out = self._bincount(args[0], *args[1:], **kwargs)
        elif packet is _aten._to_copy and args[0].is_meta and kwargs.get("device") not in (None, torch.device("meta")) \
                and not args[0].is_floating_point():
            t = args[0]
            dtype = kwargs.get("dtype") or t.dtype
            out = self._copied(t, dtype, kwargs["device"])
        if out is not NOT_HANDLED:
            self.answers += 1
            key = (_SPELLED.get(f"aten.{packet.__name__}", f"aten.{packet.__name__}"), module)
            self.used[key] = self.used.get(key, 0) + 1
            if self.used[key] > MAX_ANSWERS:
                where = f"module {module!r}" if module else "the model's top level"
                raise PlannerError(f"{key[0]} in {where} read a meta tensor's value {MAX_ANSWERS:,} times in one "
                                   "step: a loop whose condition reads a tensor (while x.max() < 100) never ends on "
                                   "the stand-in's answers, which no value changes; bound the loop by a Python count")
            _consult()
        return out

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        """Rows of evenly spread elements of the mask (row ``r`` of ``m`` is flat element ``r x n // m``), each
        coordinate in range of its dim: their values are known (``values``) for a later read."""
        n, shape = mask.numel(), tuple(mask.shape)
        rows = self.selected(n)
        out = torch.zeros((rows, mask.dim()), dtype=torch.long, device=mask.device)
        if mask.dim():
            self._remember(out, lambda o: _unravel(o // len(shape) * n // rows, shape)[o % len(shape)])
        return out

    def _bincount(self, ids: torch.Tensor, weights: Any = None, minlength: int = 0) -> Any:
        """``torch.bincount(ids, minlength=m)`` of expert ids, as a router counts each expert's tokens: m counts of
        an equal share (an expert's rows where m is the routing's experts), the values a later ``.tolist()`` reads.
        Without ``minlength`` the size is the largest id's, and weighted counts are no token counts: not stood in."""
        if weights is not None or not minlength or ids.is_floating_point():
            return NOT_HANDLED
        count = self.per_expert if self.experts == minlength else -(-ids.numel() // minlength)
        out = torch.zeros((minlength,), dtype=torch.long, device=ids.device)
        self._remember(out, lambda o, c=count: c)
        return out

    def _copied(self, t: torch.Tensor, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """``t`` copied off the meta device (``.tolist()``), each element its known value or ``_value``'s."""
        found = self._recalled(t)
        if found is None or t.numel() == 0:
            return torch.full(t.shape, self._value(t), dtype=dtype, device=device)
        offsets = torch.as_strided(torch.arange(t.untyped_storage().nbytes() // t.element_size() + 1),
                                   t.shape, t.stride(), t.storage_offset())
        return torch.tensor([found(int(o)) for o in offsets.flatten().tolist()], dtype=dtype,
                            device=device).view(t.shape)

    def _value(self, t: torch.Tensor, read: bool = False) -> bool | int | float:
        """The value the stand-in gives ``t`` (one element): the one it placed there, else a mask's element true
        and a count an expert's rows. ``read``: the model reads it (``.item()``, ``bool()``, ``int()``); when
        ``starved``, the first such read after each routing of a value not placed there (a guard such as ``if
        mask.any()`` or ``if int(mask.sum())``, which counts the first expert's tokens) answers none."""
        found = self._recalled(t) if t.numel() == 1 else None
        if found is not None and not t.is_floating_point() and not t.is_complex():
            return found(t.storage_offset())
        if t.is_floating_point() or t.is_complex():
            return 0.0
        if read and self.experts is not None:
            count = self._count_read()
            return bool(count) if t.dtype == torch.bool else count
        return True if t.dtype == torch.bool else self.per_expert

    def _count_read(self) -> int:
        """The token count the model reads after a routing: an expert's rows, but when ``starved`` none for the first
        question asked after it, which is about the first expert (a guard read before any selection, or right after
        the first: ``torch.where`` then ``if not mask.any(): continue``)."""
        self.reads += 1
        if self.starved and self.reads == 1 and self.selections <= 1:
            return 0
        return self.per_expert

    def host_reads(self) -> tuple[str, ...]:
        """The modules where a model without routing read a value on the host (``.item()``, ``bool()``), sorted:
        a branch or a loop count on the data, which the stand-in answered one way (no experts: no routing)."""
        if self.experts is not None:
            return ()
        return tuple(sorted({m for op, m in self.used if op.startswith("aten._local_scalar_dense")}))

    def note(self) -> str | None:
        """One line naming what stood in, where; None when nothing did."""
        if not self.used:
            return None
        by_op: dict[str, list[str]] = {}
        for op, module in self.used:
            by_op.setdefault(op, []).append("the model" if not module else repr(module))
        places = "; ".join(f"{op} in {', '.join(ms[:3])}" + (f" and {len(ms) - 3} more modules" if len(ms) > 3 else "")
                           for op, ms in by_op.items())
        if self.experts is None:  # a dense model's (a check on its ids, a count): no routing to speak of
            return f"data-dependent ops traced with stand-in values (a mask's every element true): {places}"
        return (f"data-dependent ops traced with the balanced-routing stand-in (an equal share per expert, capacity "
                f"factor {self.capacity:g}; --routing sets it): {places}")


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinates of element ``flat`` of a contiguous tensor of ``shape``."""
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat //= size
    return tuple(reversed(coords))


def _planned(t: Any) -> bool:
    from fsdp_planner.attention import planned

    return isinstance(t, torch.Tensor) and planned(t)


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) and _planned(t)


_TENSOR_FORMAT = torch.Tensor.__format__


def _format(self: torch.Tensor, spec: str) -> str:
    """``Tensor.__format__``, but a one-element integer or boolean tensor without data formats as the value the
    stand-in reads for it (``.item()``), as a real one formats as its value: torch formats a meta or fake scalar
    as its repr, so Switch Transformers' ``self[f"expert_{idx[0]}"]`` looked up the key "expert_tensor(...)"."""
    if self.dim() == 0 and not self.is_floating_point() and not self.is_complex() and _planned(self):
        return format(self.item(), spec)
    return _TENSOR_FORMAT(self, spec)


@contextlib.contextmanager
def values_formatted() -> Iterator[None]:
    """Inside, a planned scalar index formats as its stand-in value (``_format``): entered with the stand-in."""
    with patched(torch.Tensor, "__format__", _format):
        yield


_STARVED: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp_planner_starved", default=False)


@contextlib.contextmanager
def starved() -> Iterator[None]:
    """Stand-ins made inside route no token to one expert (the first routed selection after each routing takes
    nothing, or the first mask of the experts hit leaves one out): what a rank whose batch skips an expert runs,
    where a model that skips an expert without tokens skips its call (``check``'s ``routing-skips``)."""
    token = _STARVED.set(True)
    try:
        yield
    finally:
        _STARVED.reset(token)


_GROUPED_MM: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp_planner_grouped_mm", default=False)


def grouped_bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(x, weight)`` that the tracer classes as the ``_grouped_mm`` it stands in for (transformers'
    experts path on real tensors, ``models/hf_experts.py``): no op-level checkpointing list names ``_grouped_mm``,
    while torchtitan's of 2026 saves every ``bmm`` (``fsdp2/selective.py``). Under torch.compile the class is the
    eager trace's, and dynamo does not read ContextVars: a plain ``bmm`` there."""
    if torch.compiler.is_compiling():
        return torch.bmm(x, weight)
    token = _GROUPED_MM.set(True)
    try:
        return torch.bmm(x, weight)
    finally:
        _GROUPED_MM.reset(token)


def in_grouped_bmm() -> bool:
    """Inside ``grouped_bmm``: its matmul stands for a ``_grouped_mm``."""
    return _GROUPED_MM.get()


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
    """The capacity factor in force (counted as consulted); a constant to dynamo after ``compilable()``."""
    return _capacity_reader()


def _read_capacity() -> float:
    _consult()
    return _CAPACITY.get()


_capacity_reader: Callable[[], float] = _read_capacity


def compilable() -> None:
    """Before ``torch.compile`` of a block holding an experts stand-in: dynamo cannot read the ContextVars
    ``current_capacity`` reads (a Qwen3-MoE block failed ``--compile`` with "Unsupported method call ...
    ContextVar.get"), so it takes the factor as a constant (``assume_constant_result``), as the attention kernel's
    name (``attention.compilable``); not done at import, for the same reason."""
    global _capacity_reader
    _capacity_reader = torch.compiler.assume_constant_result(_read_capacity)


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
           "cover it (torch.bincount it covers with minlength given): write the router with a fixed capacity (tokens "
           "x top_k / experts rows per expert, e.g. topk then index_select on sorted indices), or compute the value "
           "in the factory rather than in forward")


def data_dependent(e: BaseException, op: str | None) -> bool:
    """``e`` is PyTorch refusing a data-dependent op (``op``, as ``failures.op_name`` names it) on planned tensors."""
    return refused(e) and (type(e).__name__ in _REFUSALS or op in DATA_DEPENDENT_OPS)
