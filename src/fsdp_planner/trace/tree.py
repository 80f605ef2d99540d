"""Module names: the root is ``""``, a child of ``a.b`` is ``a.b.c``, as ``nn.Module.named_modules`` spells them.

These helpers look at names only. A module object registered under several names (a submodule shared by
blocks) has one canonical name, its first in ``named_modules()`` order; its real parents are in
``ModuleInfo.children`` (see ``records.py``), which the FSDP2 claim rule follows.
"""

from __future__ import annotations

from collections.abc import Iterator

ROOT = ""


def parent_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def is_within(fqn: str, ancestor: str) -> bool:
    """Whether ``fqn`` is ``ancestor`` or lies in its subtree (every module lies within the root)."""
    return ancestor == ROOT or fqn == ancestor or fqn.startswith(ancestor + ".")


def proper_ancestors(fqn: str) -> Iterator[str]:
    """The modules above ``fqn`` by name, nearest first, ending with the root (nothing for the root itself)."""
    while fqn != ROOT:
        fqn = parent_of(fqn)
        yield fqn


def outermost(fqns: list[str]) -> list[str]:
    """Those of ``fqns`` inside none of the others (the root aside: every module lies within it), in their order."""
    held = set(fqns)
    return [m for m in fqns if not any(a in held for a in proper_ancestors(m) if a != ROOT)]


def depth(fqn: str) -> int:
    return 0 if fqn == ROOT else fqn.count(".") + 1


def innermost_call(running: list[tuple[str, int]]) -> tuple[str, int] | None:
    """Of the module calls whose backward runs (in the order their pre-backward fired), the one whose backward ops
    run now: the last to begin, but for an ancestor that began after a descendant still running, which happens
    only where both hook one tensor (a parent returning its last child's output: its own ops ran before that
    child's in backward otherwise), the descendant."""
    i = len(running) - 1
    while i > 0 and running[i - 1][0] != running[i][0] and is_within(running[i - 1][0], running[i][0]):
        i -= 1
    return running[i] if running else None
