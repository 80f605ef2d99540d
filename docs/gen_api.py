"""Generate docs/api.md from the docstrings: ``python docs/gen_api.py [OUT]`` (default: docs/api.md beside this file).

The reference is the public API's signatures and the first paragraph of each docstring, read with ``inspect``
only, so it cannot drift from the code: ``tests/test_docs.py`` regenerates it and fails when docs/api.md differs.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
import sys
from pathlib import Path

# (module, names, what the section is for): the package's __all__ first, then the entry points a user reaches for
# beyond it. A name listed here that disappears from the code fails the generator, and so the test.
SECTIONS: list[tuple[str, list[str] | None, str]] = [
    ("fsdp_planner", None, "The package's public API (`fsdp_planner.__all__`)."),
    ("fsdp_planner.trace", ["record"],
     "The recorder the public `fsdp_planner.trace` calls: the step in an explicit `compute_dtype` (None: the model's "
     "own dtypes), or timed for real (`measure=True`)."),
    ("fsdp_planner.models", ["load_model", "LoadedModel", "ModelSpec"],
     "Building a model from a MODEL spec (built-in name, `path/file.py:fn`, `package.module:fn`, `hf:...`)."),
    ("fsdp_planner.planners", ["Target", "PolicyName", "PolicyRequest", "make_policy", "AutoResult"],
     "Policies by name, as the CLI builds them."),
    ("fsdp_planner.service.validate", ["Keywords", "Spelling", "plan_job"],
     "The one validator: the API's keywords and the command line's options, checked alike, into a `PlanJob`."),
    ("fsdp_planner.service.job", ["PlanJob"], "One planning job, as every front end hands it to the service."),
    ("fsdp_planner.service.planning", ["plan", "Reporter"],
     "The planning use case: a `PlanJob` in, a `PlanOutcome` out (what `fsdp-planner plan` and "
     "`fsdp_planner.plan` run)."),
    ("fsdp_planner.service.outcome", ["PlanOutcome", "SearchSummary"], "What the service returns."),
    ("fsdp_planner.configs.job_config", ["read_config", "from_data", "JobConfig"],
     "Training-job configs (`--from-torchtitan`, `--from-accelerate`) read, torch-free."),
    ("fsdp_planner.apply", ["device_mesh", "fsdp1_policy"],
     "The mesh `apply_plan` builds when given none, and a plan as FSDP1's `auto_wrap_policy`."),
    ("fsdp_planner.runtime.verify", ["run_verify", "VerifyResult", "predict_collectives"],
     "`verify` on torchrun ranks (gloo on CPU, NCCL on GPUs)."),
    ("fsdp_planner.runtime.fake_world", ["run_fake_world", "FakeWorldResult"],
     "`verify --fake-world-size`: real FSDP2 on PyTorch's fake process group."),
    ("fsdp_planner.calibrate.nccl_logs", ["calibrate", "fit_logs"], "`calibrate` from nccl-tests logs."),
    ("fsdp_planner.calibrate.overhead", ["measure_overhead", "OverheadMeasurement"],
     "`calibrate --overhead`: FSDP2's host cost, timed."),
]

HEADER = """# API reference

Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand (`tests/test_docs.py` fails when
this file is out of date). Each entry: the signature and the first paragraph of the docstring; the source has the
rest. See [the docs index](README.md) for guides.
"""


def first_paragraph(obj: object) -> str:
    """The docstring's first paragraph on one line, or an empty string when there is none of its own."""
    doc = obj.__doc__ if isinstance(obj, (type, property)) or callable(obj) else None
    if isinstance(obj, type) and doc == _inherited_doc(obj):
        doc = None  # a dataclass or enum without a docstring gets a generated one; say nothing rather than that
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n", 1)[0]
    return " ".join(line.strip() for line in para.splitlines())


def _inherited_doc(cls: type) -> str | None:
    """The docstring a class gets without writing one: its base's, or the dataclass-generated signature."""
    own = cls.__dict__.get("__doc__")
    if own is None:
        return cls.__doc__
    if own.startswith(f"{cls.__name__}("):  # dataclasses write "Name(field: type, ...)"
        return own
    if issubclass(cls, enum.Enum) and own == "An enumeration.":
        return own
    return None


class _Written(str):
    """An annotation as the source writes it: ``from __future__ import annotations`` keeps them as strings, which
    ``inspect`` would print quoted."""

    def __repr__(self) -> str:
        return str(self)


def _written(annotation: object) -> object:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def signature(obj: object, name: str) -> str:
    """``name(params) -> return`` with annotations as written; object addresses removed (not stable)."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return name
    sig = sig.replace(parameters=[p.replace(annotation=_written(p.annotation)) for p in sig.parameters.values()],
                      return_annotation=_written(sig.return_annotation))
    return re.sub(r" at 0x[0-9a-f]+", "", f"{name}{sig}")


def class_members(cls: type) -> list[tuple[str, object]]:
    """The public methods and properties a class defines itself, in source order."""
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property) or inspect.isfunction(member):
            out.append((name, member))
    return out


def render_class(cls: type, qualname: str) -> list[str]:
    lines = [f"### `{qualname}`", ""]
    short = cls.__name__
    if issubclass(cls, enum.Enum):
        lines += ["```python", f"class {cls.__name__}({cls.__bases__[0].__name__})", "```", ""]
        members = ", ".join(f"`{m.name}` = {m.value!r}" for m in cls)
        lines += [p + "\n" for p in (first_paragraph(cls), f"Members: {members}.") if p]
        return lines
    lines += ["```python", f"class {signature(cls, cls.__name__)}", "```", ""]
    if para := first_paragraph(cls):
        lines += [para, ""]
    for name, member in class_members(cls):
        if isinstance(member, property):
            lines += [f"- `{short}.{name}` (property)" + (f": {p}" if (p := first_paragraph(member)) else "")]
        else:
            sig = signature(member, name)
            lines += [f"- `{short}.{sig}`" + (f": {p}" if (p := first_paragraph(member)) else "")]
    return [*lines, ""]


def render_function(fn: object, qualname: str) -> list[str]:
    lines = [f"### `{qualname}`", "", "```python", signature(fn, qualname), "```", ""]
    if para := first_paragraph(fn):
        lines += [para, ""]
    return lines


def render() -> str:
    """The whole of docs/api.md."""
    lines = [HEADER]
    for module_name, names, purpose in SECTIONS:
        module = importlib.import_module(module_name)
        names = sorted(module.__all__, key=str.lower) if names is None else names
        lines += [f"## `{module_name}`", "", purpose, ""]
        for name in names:
            obj = getattr(module, name)  # AttributeError here: SECTIONS names something the code dropped
            qualname = name if module_name == "fsdp_planner" else f"{module_name}.{name}"
            if isinstance(obj, type):
                lines += render_class(obj, qualname)
            elif callable(obj):
                lines += render_function(obj, qualname)
            else:
                lines += [f"### `{qualname}`", "", f"`{qualname}` = `{obj!r}`", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> None:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).with_name("api.md")
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv)
