"""The package's layers are one-way: a module imports only from its own layer or lower ones, no two modules import
each other (directly or round a longer loop), and the functions people read stay small.

Read with ``ast`` (no import, no torch) so the check costs well under a second. Every import counts, a
function-local one too: a lazy import is still an edge. Only ``if TYPE_CHECKING:`` blocks are left out, since they
never run.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "fsdp_planner"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# Lowest layer first. Each entry: the component's name and the top-level names (packages or modules) it holds. A
# component imports from itself or from lower layers; the components of one layer are peers and import neither.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {"base": ("errors", "fmt", "userfiles", "batch", "attention", "linear_attention", "mamba_scan", "selective_scan",
              "norms", "workspaces", "routing", "choices", "patching", "limits", "signals", "arguments")},
    {"configs": ("configs",)},  # the training configs users have (torchtitan, Accelerate), read torch-free
    {"trace": ("trace",), "models": ("models",)},
    {"fsdp2": ("fsdp2",)},  # FSDP2's semantics only: no hardware
    {"hardware": ("hardware",)},
    {"sim": ("sim",)},
    {"planners": ("planners",)},
    {"report": ("report",), "apply": ("apply",)},
    {"service": ("service",)},  # the planning use case: PlanJob in, PlanOutcome out, and the one validator
    {"api": ("api",)},  # fsdp_planner.plan: trace, policy and auto's search in one call
    {"runtime": ("runtime",)},
    {"calibrate": ("calibrate",)},
    {"cli": ("cli",)},
)
EXEMPT = {PACKAGE, f"{PACKAGE}.__main__"}  # the public face of the package gathers from every layer

MAX_LINES = 60  # every function of every module of the package
MAX_COMPLEXITY = 25

# Each of these adds one path through a function; a BoolOp adds one per operand after the first.
BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.With, ast.AsyncWith, ast.Assert,
            ast.comprehension, ast.IfExp, ast.match_case)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, tuple[Path, ast.Module]]:
    """Every module of the package by dotted name, parsed once for all the tests."""
    return {_module_name(p): (p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(SRC.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def _imports(module: str) -> list[ast.Import | ast.ImportFrom]:
    return list(_import_nodes(_modules()[module][1]))


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import under ``tree``, however deep, but none under ``if TYPE_CHECKING:`` (its ``else`` still runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(reversed(node.orelse))
        else:
            todo.extend(reversed(list(ast.iter_child_nodes(node))))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The dotted name a ``from`` import names, with a relative one resolved against the importing module."""
    if not node.level:
        return node.module or ""
    path = _modules()[module][0]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The package's modules an import depends on. ``import a.b`` is module ``a.b``; ``from a.b import c`` is ``a.b``
    (its namespace is read, so its ``__init__`` must have run) and also ``a.b.c`` when that is a module."""
    known = _modules()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _absolute(module, node)
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    yield from (name for name in names if name in known)


@functools.cache
def _edges() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself left out)."""
    return {module: {t for node in _imports(module) for t in _targets(module, node)} - {module}
            for module in _modules()}


def _place(module: str) -> tuple[int, str] | None:
    """(layer, component) of a module; None for the exempt ones."""
    if module in EXEMPT:
        return None
    top = module.split(".")[1]
    for layer, components in enumerate(LAYERS):
        for component, names in components.items():
            if top in names:
                return layer, component
    raise AssertionError(f"{module} is in no layer: add its top-level name to LAYERS in tests/test_layers.py")


def _upward_edges() -> list[str]:
    bad = []
    for module, targets in sorted(_edges().items()):
        source = _place(module)
        for target in sorted(targets):
            dest = _place(target)
            if source is None or dest is None or dest[1] == source[1]:
                continue
            if dest[0] > source[0]:
                bad.append(f"{module} (layer {source[0]}, {source[1]}) imports {target} (layer {dest[0]}, {dest[1]})")
            elif dest[0] == source[0]:
                bad.append(f"{module} imports its peer {target} (both layer {source[0]})")
    return bad


def _cycles() -> list[tuple[list[str], set[str]]]:
    """The import graph's strongly connected components of more than one module (Tarjan's algorithm), each with one
    loop through it so the message names the edges to cut."""
    graph = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[list[str], set[str]]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append((_loop(set(component), graph), set(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _loop(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """One import loop inside a strongly connected component: the shortest path from its first module back to it."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"no loop through {start}")  # a strongly connected component always has one


def _own_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions and classes defined inside it (counted apart)."""
    todo = list(function.body)
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node)
                    if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))


def complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """McCabe-like: one path, plus one per branch, plus one per extra operand of ``and``/``or``."""
    return 1 + sum(isinstance(node, BRANCHES) + (len(node.values) - 1 if isinstance(node, ast.BoolOp) else 0)
                   for node in _own_nodes(function))


def _oversized() -> list[str]:
    bad = []
    for module, (_, tree) in _modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines, paths = node.end_lineno - node.lineno + 1, complexity(node)
            if lines > MAX_LINES or paths > MAX_COMPLEXITY:
                bad.append(f"{module}.{node.name} (line {node.lineno}): {lines} lines, complexity {paths}")
    return bad


def test_every_module_is_in_a_layer():
    for module in _modules():
        _place(module)


def test_every_import_of_the_package_names_a_module():
    """A moved module leaves no import behind (a function-local one would fail only when it runs)."""
    known = _modules()
    missing = []
    for module in known:
        for node in _imports(module):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [_absolute(module, node)]
            missing += [f"{module} imports {name}" for name in names
                        if name.split(".")[0] == PACKAGE and name not in known]
    assert not missing, "imports of modules that do not exist:\n  " + "\n  ".join(missing)


def test_no_module_imports_from_a_higher_layer_or_a_peer():
    bad = _upward_edges()
    assert not bad, "imports against the layers:\n  " + "\n  ".join(bad)


def _describe(cycles: list[tuple[list[str], set[str]]]) -> str:
    return "import cycles:\n  " + "\n  ".join(
        " -> ".join(loop) + (f" (also in it: {', '.join(sorted(scc - set(loop)))})" if scc - set(loop) else "")
        for loop, scc in cycles)


def test_no_import_cycles():
    cycles = _cycles()
    assert not cycles, _describe(cycles)


def test_functions_are_small():
    bad = _oversized()
    assert not bad, (f"functions over {MAX_LINES} lines or complexity {MAX_COMPLEXITY}:\n  " + "\n  ".join(bad))


def test_the_checks_see_what_they_should():
    """The reader resolves relative imports, skips TYPE_CHECKING, counts function-local imports and branches."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    assert [alias.name for node in _import_nodes(tree) for alias in node.names] == ["TYPE_CHECKING", "b", "c"]
    func = ast.parse("def f(x):\n    if x and x > 1 or x:\n        return [y for y in x if y]\n"
                     "    return 1 if x else 2\n").body[0]
    assert complexity(func) == 1 + 1 + 2 + 1 + 1  # if, a BoolOp of two and one of two, comprehension, IfExp
