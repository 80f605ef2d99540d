"""The collectives FSDP issues, by kind: what the replay schedules and the cost layer prices."""

from __future__ import annotations

from enum import Enum

from fsdp_planner.errors import PlannerError


class CollectiveKind(Enum):
    """The collectives FSDP2 issues per group: its params' all-gather and its grads' reduce-scatter, and with
    HSDP the all-reduce of the reduced grads across replicas."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    @classmethod
    def parse(cls, text: str | CollectiveKind) -> CollectiveKind:
        """``all-gather``, ``all_gather``, ``allgather`` (and the reduce-scatter spellings)."""
        if isinstance(text, CollectiveKind):
            return text
        k = text.strip().lower().replace("-", "_")
        k = {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}.get(k, k)
        try:
            return cls(k)
        except ValueError:
            raise PlannerError(f"unknown collective '{text}': use one of {', '.join(COLLECTIVES)}") from None


COLLECTIVES = tuple(k.value for k in CollectiveKind)
