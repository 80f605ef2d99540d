"""Batch work: Python's cyclic garbage collector paused while a trace or a search builds its many objects.

A 10,000-module trace creates ~200,000 events and the search thousands of plans; generational collections
triggered by those allocations took ~1 s of a 3 s trace and ~1.4 s of a 7 s search (measured on the benchmark's
1,000-block model). Reference counting still frees everything that is not in a cycle; the collector runs again,
as before, once the block ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
