"""The per-rank memory budget a plan must fit, and the margin each plan keeps below it.

The memory model predicts the reserved peak from what FSDP2 and autograd allocate; it does not know the CUDA caching
allocator's fragmentation beyond its per-stream pools and the loss region's packing, and it is off by up to a few
percent against real FSDP2 (``benchmarks/fidelity_memory.md``). A plan predicted to sit a few MB under the GPU's
capacity can therefore run out of memory. The budget is the GPU's capacity less a headroom for that
(``DEFAULT_HEADROOM``), or an explicit ``--memory-budget``, taken as given: whoever names a budget has chosen their
own margin.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, fmt_bytes, parse_size

# The default headroom, a fraction of the GPU's capacity. benchmarks/fidelity_memory.md: the prediction is at most
# 3.0% below real FSDP2's peak (toy-llama, W=64, auto: 2.59 against 2.67 MiB), and verify --fake-world-size passes
# a plan within 5% (cli/commands.py MEMORY_TOLERANCE), so a plan that passes the check may need 5% more than
# predicted. Allocator fragmentation beyond the inter-stream pools is not measured on a GPU yet (docs/model.md):
# a fraction, since both errors grow with the peak, rather than a fixed size.
DEFAULT_HEADROOM = 0.05
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
_PLAIN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Headroom:
    """What the budget holds back below the GPU's capacity: a fraction of it, or a size in bytes."""

    fraction: float = DEFAULT_HEADROOM
    nbytes: int | None = None  # a fixed size instead of the fraction

    def __post_init__(self) -> None:
        if self.nbytes is None and not 0 <= self.fraction < 1:  # NaN too
            raise PlannerError(f"a headroom fraction must be from 0 to below 1, got {self.fraction}")
        if self.nbytes is not None and self.nbytes < 0:
            raise PlannerError(f"a headroom size must not be negative, got {self.nbytes}")

    def of(self, capacity: int) -> int:
        """The bytes held back of ``capacity``."""
        return self.nbytes if self.nbytes is not None else math.ceil(capacity * self.fraction)

    def describe(self) -> str:
        if self.nbytes is not None:
            return f"{fmt_bytes(self.nbytes)} headroom"
        return f"{self.fraction * 100:g}% headroom"


def parse_headroom(text: str, what: str = "--headroom") -> Headroom:
    """``0.05`` or ``5%``: a fraction of the capacity; ``4GiB``, ``500MB``: a size. A bare number of 1 or more is
    refused: it could mean bytes or a percentage."""
    s = str(text)
    if m := _PERCENT.match(s):
        return _fraction(float(m.group(1)) / 100, text, what)
    if m := _PLAIN.match(s):
        value = float(m.group(1))
        if value < 1:
            return _fraction(value, text, what)
        raise PlannerError(f"{what} '{cut_short(text)}' is ambiguous: give a fraction below 1 (0.05 or 5%) or a size "
                           "with a unit (4GiB)")
    return Headroom(nbytes=parse_size(s, what))


def _fraction(value: float, text: str, what: str) -> Headroom:
    if not 0 <= value < 1:
        raise PlannerError(f"{what} '{cut_short(text)}' must be below 100% of the GPU's memory")
    return Headroom(fraction=value)


@dataclass(frozen=True)
class MemoryBudget:
    """The bytes per rank a plan's reserved peak must fit: ``capacity`` less ``headroom``, or an explicit budget
    (``headroom`` None)."""

    limit: int
    capacity: int  # one GPU's memory (its spec sheet's decimal capacity)
    gpu: str
    headroom: Headroom | None

    @classmethod
    def of_gpu(cls, capacity: int, gpu: str, headroom: Headroom | None = None) -> MemoryBudget:
        """The GPU's capacity less ``headroom`` (default ``DEFAULT_HEADROOM``)."""
        room = headroom or Headroom()
        limit = capacity - room.of(capacity)
        if limit <= 0:
            raise PlannerError(f"a headroom of {room.describe().removesuffix(' headroom')} leaves nothing of the "
                               f"{fmt_bytes(capacity)} of one {gpu}")
        return cls(limit, capacity, gpu, room)

    @classmethod
    def explicit(cls, limit: int, capacity: int, gpu: str) -> MemoryBudget:
        """``--memory-budget``: the bytes given, no headroom taken off."""
        if limit <= 0:
            raise PlannerError("the memory budget must be positive")
        return cls(limit, capacity, gpu, None)

    @classmethod
    def given(cls, memory_budget: int | None, capacity: int, gpu: str, headroom: Headroom | None = None
              ) -> MemoryBudget:
        """``memory_budget`` where given (``explicit``), else the GPU's capacity less ``headroom`` (``of_gpu``)."""
        return cls.explicit(memory_budget, capacity, gpu) if memory_budget is not None else \
            cls.of_gpu(capacity, gpu, headroom)

    @property
    def source(self) -> str:
        """Where the budget comes from, e.g. ``one H100 (80 GB) less 5% headroom``."""
        if self.headroom is None:
            return "--memory-budget"
        whole = f"one {self.gpu} ({self.capacity / 1e9:.4g} GB)"
        return f"{whole}, no headroom" if self.limit == self.capacity else f"{whole} less {self.headroom.describe()}"

    def fits(self, reserved: int) -> bool:
        return reserved <= self.limit

    def margin(self, reserved: int) -> str:
        """How far a reserved peak sits below (or over) the budget, e.g. ``4.4 GiB (5.9%) below the 74.5 GiB
        budget (one H100 (80 GB) less 5% headroom)``."""
        gap = self.limit - reserved
        where = "below" if gap >= 0 else "over"
        return (f"{fmt_bytes(abs(gap))} ({abs(gap) / self.limit:.1%}) {where} the {fmt_bytes(self.limit)} budget "
                f"({self.source})")

    def to_dict(self, reserved: int) -> dict[str, Any]:
        """The budget and a reserved peak's margin, for ``--json``."""
        return {"budget": self.limit, "capacity": self.capacity,
                "headroom": self.capacity - self.limit if self.headroom is not None else None,
                "source": self.source, "reserved_memory": reserved, "margin": self.limit - reserved,
                "fits": self.fits(reserved)}
