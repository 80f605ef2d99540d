"""Finding a model's repeated blocks and the instances of a module class, by the names people pass."""

from __future__ import annotations

from collections.abc import Iterable

from fsdp_planner.errors import PlannerError
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT


def default_block_class(trace: Trace, in_container_only: bool = False) -> str | None:
    """The model's repeated block class (``TraceIndex.block_class``); with ``in_container_only`` only a class
    whose instances are children of a container (ModuleList/Sequential) counts."""
    return trace.index.container_block_class if in_container_only else trace.index.block_class


def block_instances(trace: Trace) -> list[str]:
    """Instances of the repeated block classes that sit in containers (``TraceIndex.checkpoint_block_classes``:
    an encoder-decoder's two layer kinds), in the model's order; empty when there is none."""
    return list(trace.index.block_instances)


class ClassesNotFound(PlannerError):
    """A module class a policy is given is not in the model: where a job config gave it, its reader names the key."""


def find_class_instances(trace: Trace, classes: Iterable[str]) -> list[str]:
    classes = list(classes)
    present = {m.cls for m in trace.modules.values()}
    missing = [c for c in classes if c not in present]
    if missing:
        numel = trace.index.subtree_numel
        with_params = sorted({m.cls for f, m in trace.modules.items() if f != ROOT and numel[f]})
        raise ClassesNotFound(f"module class {', '.join(missing)} not found in the model; classes with params: "
                              f"{', '.join(with_params)}")
    return [f for f, m in trace.modules.items() if f != ROOT and m.cls in classes]
