"""Tensors and other leaves of an argument list, found without pytree's full traversal where it can be avoided
(every op and every module call of a step is flattened at least once)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


def containers(value: Any) -> Iterator[list | dict]:
    """The lists and dicts in a call's args (tuples, lists and dicts walked), outermost first."""
    if isinstance(value, (list, dict)):
        yield value
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from containers(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from containers(v)


def into_callers(given: Any, made: Any) -> Any:
    """``made`` (a copy of a call's args ``given``, its tensors replaced: marked, or cast) with ``given``'s own lists
    and dicts, their items set to ``made``'s in place: a module that pops from a list its caller gave it (a UNet's
    up blocks taking the skips) changes the caller's list, as it does without the tracer, where a copy left the
    caller's list whole and the step failed (FSDP2 copies it for a sharded module's call: ``hooks.post_forward``
    sees the change and marks the module so)."""
    if isinstance(given, list) and isinstance(made, list) and len(given) == len(made):
        for i, (g, m) in enumerate(zip(given, made, strict=True)):
            given[i] = into_callers(g, m)
        return given
    if isinstance(given, dict) and isinstance(made, dict) and given.keys() == made.keys():
        for k in given:
            given[k] = into_callers(given[k], made[k])
        return given
    if isinstance(given, tuple) and isinstance(made, tuple) and len(given) == len(made) and type(given) is type(made):
        items = [into_callers(g, m) for g, m in zip(given, made, strict=True)]
        if all(a is b for a, b in zip(items, made, strict=True)):
            return made
        return type(made)(*items) if hasattr(made, "_fields") else type(made)(items)
    return made
