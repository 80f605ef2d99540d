"""Tensors and other leaves of an argument list, found without pytree's full traversal where it can be avoided
(every op and every module call of a step is flattened at least once)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

ATOMS = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def flat_leaves(args: tuple | list, kwargs: dict | None = None) -> list:
    """The leaves ``tree_flatten((args, kwargs))`` gives, fast for the flat argument lists of ops and most module
    calls (order kept; anything nested deeper than one list falls back to pytree)."""
    out: list = []
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(a, ATOMS):
            out.append(a)
        elif type(a) in (list, tuple) and all(isinstance(b, ATOMS) for b in a):
            out.extend(a)
        else:
            return tree_flatten((args, kwargs or {}))[0]
    return out
