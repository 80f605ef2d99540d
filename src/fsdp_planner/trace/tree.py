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


def depth(fqn: str) -> int:
    return 0 if fqn == ROOT else fqn.count(".") + 1
