"""Finding a model's repeated blocks and the instances of a module class, by the names people pass."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from fsdp_planner.errors import PlannerError
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, parent_of

CONTAINERS = frozenset({"ModuleList", "Sequential", "ModuleDict"})


def default_block_class(trace: Trace, in_container_only: bool = False) -> str | None:
    """The model's repeated block class: the class of a container's (ModuleList/Sequential) children that repeats
    and holds the most params; else (unless ``in_container_only``) the repeated class holding the most params."""
    numel = trace.index.subtree_numel

    def best(candidates: Iterable[str]) -> str | None:
        count: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for fqn in candidates:
            if numel[fqn] > 0:
                cls = trace.modules[fqn].cls
                count[cls] += 1
                total[cls] += numel[fqn]
        repeated = [c for c in count if count[c] >= 2]
        return max(repeated, key=lambda c: total[c]) if repeated else None

    modules = [f for f in trace.modules if f != ROOT]
    in_container = [f for f in modules if parent_of(f) != ROOT and parent_of(f) in trace.modules
                    and trace.modules[parent_of(f)].cls in CONTAINERS]
    return best(in_container) or (None if in_container_only else best(modules))


def block_instances(trace: Trace) -> list[str]:
    """Instances of the repeated block class that sits in a container (empty when there is none)."""
    cls = default_block_class(trace, in_container_only=True)
    return [f for f, m in trace.modules.items() if cls and m.cls == cls]


def find_class_instances(trace: Trace, classes: Iterable[str]) -> list[str]:
    classes = list(classes)
    present = {m.cls for m in trace.modules.values()}
    missing = [c for c in classes if c not in present]
    if missing:
        numel = trace.index.subtree_numel
        with_params = sorted({m.cls for f, m in trace.modules.items() if f != ROOT and numel[f]})
        raise PlannerError(f"module class {', '.join(missing)} not found in the model; classes with params: "
                           f"{', '.join(with_params)}")
    return [f for f, m in trace.modules.items() if f != ROOT and m.cls in classes]
