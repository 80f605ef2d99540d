"""Global patches are undone on every path (``patching.py``): a failure while entering, or inside, leaves the
library as it was, and no module of the package patches a library any other way."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from fsdp_planner.patching import patched
from fsdp_planner.runtime.fake_world import LiveBytes
from fsdp_planner.runtime.worker import _COUNTED, CollectiveCounter

PACKAGE = "fsdp_planner"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE


def test_a_patch_is_undone_when_its_body_raises() -> None:
    owner = types.SimpleNamespace(f="original")
    with pytest.raises(RuntimeError), patched(owner, "f", "patched"):
        assert owner.f == "patched"
        raise RuntimeError
    assert owner.f == "original"


def test_an_inherited_attribute_is_inherited_again_after_the_patch() -> None:
    class Base:
        def f(self) -> str:
            return "base"

    class Child(Base):
        pass

    with patched(Child, "f", lambda self: "patched"):
        assert Child().f() == "patched"
    assert "f" not in vars(Child) and Child().f() == "base"


class _RefusingMode(TorchDispatchMode):
    def __enter__(self) -> None:
        raise RuntimeError("refused")


class _RefusedLiveBytes(LiveBytes, _RefusingMode):
    """LiveBytes whose dispatch mode cannot be entered: its ``super().__enter__()`` reaches ``_RefusingMode``."""


def test_live_bytes_restores_resize_when_entering_fails() -> None:
    original, own = torch.UntypedStorage.resize_, vars(torch.UntypedStorage).get("resize_")
    with pytest.raises(RuntimeError, match="refused"), _RefusedLiveBytes():
        pass
    assert torch.UntypedStorage.resize_ is original and vars(torch.UntypedStorage).get("resize_") is own
    assert not _get_current_dispatch_mode_stack()


def test_live_bytes_restores_resize_when_the_step_raises() -> None:
    original = torch.UntypedStorage.resize_
    with pytest.raises(ValueError), LiveBytes():
        assert torch.UntypedStorage.resize_ is not original
        raise ValueError
    assert torch.UntypedStorage.resize_ is original
    assert not _get_current_dispatch_mode_stack()


class _BrokenCounter(CollectiveCounter):
    """Wrapping its third function fails, after two are wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped = 0

    def _wrap(self, kind, fn):  # type: ignore[no-untyped-def]
        self.wrapped += 1
        if self.wrapped == 3:
            raise RuntimeError("cannot wrap")
        return super()._wrap(kind, fn)


def test_collective_counter_unwraps_what_it_wrapped_when_entering_fails() -> None:
    originals = {name: getattr(dist, name) for name in _COUNTED if hasattr(dist, name)}
    assert len(originals) >= 3
    counter = _BrokenCounter()
    with pytest.raises(RuntimeError, match="cannot wrap"), counter:
        pass
    assert counter.wrapped == 3
    assert all(getattr(dist, name) is fn for name, fn in originals.items())


def _library_names(tree: ast.Module) -> set[str]:
    """Names a module binds to imports of other libraries (``torch``, ``dist``, ``F``, ``nn_init``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith(PACKAGE):
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _patches(source: str) -> list[int]:
    """Lines that assign to (or ``setattr``/``delattr`` on) attributes of an imported library in one module."""
    tree = ast.parse(source)
    libraries = _library_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [t for t in targets if isinstance(t, ast.Attribute)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args):
            targets = [node.args[0]]
        found += [node.lineno for t in targets if _root(t) in libraries]
    return sorted(found)


# Installed for the life of the process on purpose, never undone: a closed stdout/stderr replaced by the null
# device, transformers' packed-sequence check answering meta and fake tensors (real ones asked as before), a
# forked rank's temp directory put back as a fresh interpreter has it, a launcher forked by the zygote made what
# a fresh one is (its stdout and stderr, temp directory and argv), and a plan's async TP switched on for the
# training process that applies it to CUDA ranks (inductor's ``_micro_pipeline_tp``, as torchtitan sets it), and
# dynamo's leave to skip replaying a checkpointed block's forward side effects for the process that compiles a plan's
# blocks (``skip_fwd_side_effects_in_bwd_under_checkpoint``, as torchtitan's ``apply_compile`` sets it).
PERMANENT = {"cli/__init__.py": 2, "models/hf.py": 1, "runtime/launch.py": 1, "runtime/zygote.py": 3,
             "apply/tensor_parallel.py": 1, "apply/compile.py": 1}


def test_libraries_are_patched_only_through_patched() -> None:
    """A library attribute set any other way may be left behind by a failure: ``patching.patched`` undoes it."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC))
        lines = _patches(path.read_text())
        if name != "patching.py" and lines and len(lines) != PERMANENT.get(name):
            found[name] = lines
    assert not found, f"library attributes set outside patching.patched: {found}"


def test_the_patch_finder_sees_patches_and_nothing_else() -> None:
    source = ("import torch\nimport torch.nn.functional as F\nfrom torch import utils\nfrom fsdp_planner import fmt\n"
              "torch.UntypedStorage.resize_ = None\nsetattr(F, 'relu', None)\nutils.swap_tensors = None\n"
              "fmt.x = 1\nobj = object()\nobj.x = 1\n")
    assert _patches(source) == [5, 6, 7]


def test_quiet_loggers_report_errors_only_inside_and_get_their_levels_back(caplog):
    """torchao's import-time lines (its CUDA kernels missing on a CPU build) are warnings; errors still pass."""
    import logging

    from fsdp_planner.patching import quiet_loggers

    log = logging.getLogger("torchao")
    log.setLevel(logging.INFO)
    with pytest.raises(RuntimeError), quiet_loggers("torchao"):
        log.warning("Failed to load _C_mxfp8.so")
        log.error("a real error")
        raise RuntimeError("a failure inside")
    assert [r.getMessage() for r in caplog.records] == ["a real error"]
    assert log.level == logging.INFO
    log.setLevel(logging.NOTSET)
