"""Non-forward methods that run a module's params: ``model.head.loss(h)``, ``model.generate()``.

FSDP2 unshards a group only around the forward of the modules it lists. A method other than ``forward`` that reads
the params of its module (or of the module's children) outside that module's forward gets sharded DTensors
("aten.mm.default got mixed torch.Tensor and DTensor") unless ``register_fsdp_forward_method(module, "name")``
wraps it with the module's pre/post-forward hooks.

The trace finds such calls in two passes. While an op reads a param whose owner, or one of the owner's ancestors,
is not running its forward (a gap in the call stack), ``MethodFinder`` looks at the Python frames above the op for
a method of one of the missing modules. The trace then runs again with those methods wrapped the way
``register_fsdp_forward_method`` wraps them (``forward_methods``): each call is recorded as a call of its module,
with FSDP2's pre-forward, post-forward, pre-backward and post-backward boundaries, and listed in
``Trace.method_calls`` so that a replay hooks it only when the plan registers it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.nn as nn
import torch.nn.modules.module as module_py

from fsdp_planner.trace.hooks import ModuleHooks
from fsdp_planner.trace.infos import ParamInfo
from fsdp_planner.trace.step import Slot
from fsdp_planner.trace.tree import ROOT, proper_ancestors

_MODULE_MACHINERY = module_py.__file__  # nn.Module's own frames (_call_impl, hooks): never a user's method


class MethodFinder:
    """Collects (module, method) pairs whose method read params of the module's subtree outside its forward."""

    def __init__(self, modules: Mapping[str, nn.Module], params: Sequence[ParamInfo]) -> None:
        self.module_name = {id(m): n for n, m in modules.items()}
        self.params = params
        self.chains: dict[int, tuple[tuple[str, ...], ...]] = {}  # made when a param is first read (replayed
        # calls read most params without an op, so most are never asked for)
        self.found: dict[str, str] = {}  # module -> the outermost method of it seen reading params

    def chains_of(self, p: int) -> tuple[tuple[str, ...], ...]:
        """Per owner of param ``p``: the modules whose forward must be running for a read to be inside all of them
        (the root excluded: its group is unsharded from its forward to its backward)."""
        if p not in self.chains:
            self.chains[p] = tuple(tuple(a for a in (o, *proper_ancestors(o)) if a != ROOT)
                                   for o in self.params[p].owners)
        return self.chains[p]

    def check(self, used: Sequence[int], fwd_stack: Sequence[str]) -> None:
        """Called for a forward op reading ``used`` params while ``fwd_stack`` modules run their forward."""
        for p in used:
            chains = self.chains_of(p)
            if any(all(a in fwd_stack for a in c) for c in chains):
                continue
            self._inspect({a for c in chains for a in c if a not in fwd_stack})

    def _inspect(self, gaps: set[str]) -> None:
        """Walk the Python stack for methods of the ``gaps`` modules; keep the outermost per module (it covers the
        inner ones once registered)."""
        outermost: dict[str, str] = {}
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self" and code.co_name != "forward" \
                    and code.co_filename != _MODULE_MACHINERY and code.co_name.isidentifier():
                obj = frame.f_locals.get("self")
                name = self.module_name.get(id(obj))
                if name in gaps and callable(getattr(obj, code.co_name, None)):
                    outermost[name] = code.co_name
            frame = frame.f_back
        for name, method in outermost.items():
            self.found.setdefault(name, method)


@contextlib.contextmanager
def forward_methods(modules: Mapping[str, nn.Module], methods: Mapping[str, str], hooks: ModuleHooks,
                    slot: Slot) -> Iterator[None]:
    """Wrap ``methods`` (module -> method name) as ``register_fsdp_forward_method`` does, with the tracer's module
    hooks in place of FSDP2's; each call is noted in the recorder's ``method_calls``. Restored on exit."""
    undo: list[tuple[nn.Module, str, Any]] = []
    try:
        for fqn, name in methods.items():
            module = modules[fqn]
            undo.append((module, name, module.__dict__.get(name, _ABSENT)))
            setattr(module, name, _wrapped(module, fqn, name, getattr(module, name), hooks, slot))
        yield
    finally:
        for module, name, before in reversed(undo):
            if before is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, before)


_ABSENT = object()


def _wrapped(module: nn.Module, fqn: str, name: str, method: Any, hooks: ModuleHooks, slot: Slot) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = hooks.pre_forward(module, args, kwargs)
        recorder = slot.recorder
        recorder.method_calls[(fqn, recorder.calls.get(fqn, 1) - 1)] = name
        out = method(*args, **kwargs)
        hooks.post_forward(module, args, out)
        return out

    return wrapper
