"""The tracer's own tensor work, kept out of the torch-function modes the step runs under."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)


def bookkeeping(fn: Fn) -> Fn:
    """``fn`` run with torch-function modes off. The hooks and replays query storages, versions and metadata and
    make placeholder tensors, about twenty calls per module call; under ``GpuAttention`` (a mode for the model's
    SDPA calls) each of them went through Python: a sixth of tracing 10,000 sibling Linears. Dispatch modes (the op
    recorder, the fake mode) still see every op, so nothing recorded changes."""

    @functools.wraps(fn)
    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
