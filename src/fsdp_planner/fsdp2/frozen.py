"""An immutable dict: the mappings of frozen plans and policies."""

from __future__ import annotations

from typing import Any


class FrozenDict(dict):  # type: ignore[type-arg]
    """A dict that refuses changes: a plan's mappings (checkpointing policies, shard dims, config fields) cannot be
    changed under the plans that share them. It pickles (plans cross process boundaries) and hashes by its items."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a plan's mappings cannot be changed: build a new plan with dataclasses.replace")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenDict:
        return self
