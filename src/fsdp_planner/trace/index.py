"""Views of a trace that planners and the FSDP2 replay ask for again and again, each computed once.

Everything here depends on the trace only (not on a plan or a cluster), so one index serves every plan
simulated for a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.tree import ROOT

if TYPE_CHECKING:
    from fsdp_planner.trace.records import ModuleInfo, ParamInfo

Call = tuple[str, int]  # (module, call number)


class TraceIndex:
    def __init__(self, params: Sequence[ParamInfo], modules: Mapping[str, ModuleInfo],
                 events: Sequence[Event]) -> None:
        self._params, self._modules, self._events = params, modules, events

    # -- params ------------------------------------------------------------------------------------------
    @cached_property
    def param_index(self) -> dict[str, int]:
        """Param name (canonical or alias) -> index into ``Trace.params``."""
        out: dict[str, int] = {}
        for i, p in enumerate(self._params):
            out[p.fqn] = i
            for alias in p.aliases:
                out[alias] = i
        return out

    @cached_property
    def param_uses(self) -> list[list[int]]:
        """Per param: the indices of the ops reading it, in order."""
        uses: list[list[int]] = [[] for _ in self._params]
        for i, e in enumerate(self._events):
            if e.kind is EventKind.OP:
                for p in e.params:
                    uses[p].append(i)
        return uses

    @cached_property
    def first_use(self) -> dict[int, int]:
        """Param index -> its first op (a forward one when it has any); params never read are absent."""
        return {p: uses[0] for p, uses in enumerate(self.param_uses) if uses}

    @cached_property
    def first_backward_use(self) -> list[int]:
        """Per param: its first backward op, or ``len(events) + 1`` when backward never reads it."""
        never = len(self._events) + 1
        return [next((i for i in uses if self._events[i].backward), never) for uses in self.param_uses]

    @cached_property
    def forward_users(self) -> list[frozenset[Call]]:
        """Per param, the module calls (innermost) whose forward ops read it: autograd completes its grad once
        all of their backward passes are done."""
        users: list[set[Call]] = [set() for _ in self._params]
        stack: list[Call] = []
        for e in self._events:
            if e.kind is EventKind.FWD_PRE:
                stack.append((e.module, e.call))
            elif e.kind is EventKind.FWD_POST:
                stack.pop()
            elif e.kind is EventKind.OP and not e.backward:
                caller = stack[-1] if stack else (ROOT, 0)
                for p in e.params:
                    users[p].add(caller)
        return [frozenset(u) for u in users]

    @cached_property
    def reducible(self) -> list[bool]:
        """Per param: whether it gets a gradient to reduce-scatter (trainable and read in forward)."""
        return [p.requires_grad and bool(u) for p, u in zip(self._params, self.forward_users, strict=True)]

    @cached_property
    def grad_ready_at(self) -> list[int]:
        """Per param: the event after which autograd has finished its grad, the last ``BWD_POST`` of its
        forward users (``len(events)``, the end of backward, when one of them never gets one)."""
        end = len(self._events)
        post_at = {(e.module, e.call): i for i, e in enumerate(self._events) if e.kind is EventKind.BWD_POST}
        return [max((post_at.get(u, end) for u in users), default=end) for users in self.forward_users]

    # -- events ------------------------------------------------------------------------------------------
    @cached_property
    def boundaries_by_module(self) -> dict[str, list[int]]:
        """Module -> the indices of its boundary events (where FSDP2's hooks would run), in order."""
        out: dict[str, list[int]] = {}
        for i, e in enumerate(self._events):
            if e.kind is not EventKind.OP:
                out.setdefault(e.module, []).append(i)
        return out

    @cached_property
    def forward_end(self) -> int:
        """Index of the first backward event (``len(events)`` if there is none)."""
        return next((i for i, e in enumerate(self._events) if e.backward), len(self._events))

    @cached_property
    def op_count(self) -> int:
        return sum(1 for e in self._events if e.kind is EventKind.OP)

    # -- modules -----------------------------------------------------------------------------------------
    @cached_property
    def parents(self) -> dict[str, tuple[str, ...]]:
        """Module -> the modules that hold it as a child (several for a shared submodule)."""
        out: dict[str, list[str]] = {m: [] for m in self._modules}
        for m, info in self._modules.items():
            for c in info.children:
                out[c].append(m)
        return {m: tuple(ps) for m, ps in out.items()}

    @cached_property
    def subtree_params(self) -> dict[str, frozenset[str]]:
        """Module -> canonical names of every param reachable below it (itself included), following the
        module objects' real children as FSDP2 does."""
        out: dict[str, frozenset[str]] = {}
        for m in self._post_order():
            info = self._modules[m]
            acc = set(info.params)
            for c in info.children:
                acc |= out[c]
            out[m] = frozenset(acc)
        return out

    @cached_property
    def subtree_numel(self) -> dict[str, int]:
        numel = {p.fqn: p.numel for p in self._params}
        return {m: sum(numel[p] for p in ps) for m, ps in self.subtree_params.items()}

    @cached_property
    def owning_modules(self) -> list[str]:
        """Modules that directly register at least one parameter, in registration order."""
        return [m for m, info in self._modules.items() if info.params]

    def _post_order(self) -> list[str]:
        """Every module after all of its children (iterative: no recursion limit on deep models)."""
        done: set[str] = set()
        order: list[str] = []
        for start in self._modules:
            stack = [(start, False)]
            while stack:
                m, expanded = stack.pop()
                if m in done:
                    continue
                if expanded:
                    done.add(m)
                    order.append(m)
                    continue
                stack.append((m, True))
                stack.extend((c, False) for c in self._modules[m].children if c not in done)
        return order
