"""Global patches in one place: an attribute of a library (a ``torch`` function, a method of a torch class) replaced
for a while and put back on every way out, a failure while entering included. A patch left behind would change
what every later call in the process does, long after the run that made it failed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ABSENT = object()


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside; on exit, however it comes, ``owner``'s own attribute is what it was (an
    attribute ``owner`` only inherited is deleted again rather than copied onto it)."""
    own = vars(owner).get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)
