"""Global patches in one place: an attribute of a library (a ``torch`` function, a method of a torch class) replaced
for a while and put back on every way out, a failure while entering included. A patch left behind would change
what every later call in the process does, long after the run that made it failed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

_ABSENT = object()
# torchao's on import (CUDA kernels a CPU build cannot load) and torch's pytree (torchao's deprecated registrations)
TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")


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


FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"  # logs each op's error, with its stack, before raising it


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """The named loggers report ``level`` and above only inside, their own levels back on every way out: for lines
    a library prints that say nothing about the user's job (torchao's CUDA kernels a CPU build cannot load; fake
    tensors' stack of an op that failed, which the one-line error names)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, own in zip(loggers, levels, strict=True):
            lg.setLevel(own)
