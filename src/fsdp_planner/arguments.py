"""The Python API's arguments checked at the door by their annotations: a value of another type is one
``PlannerError`` sentence naming the argument and what it takes, not an ``AttributeError`` from deep inside the
planner (a trial of the API met a dozen: a plan file's path given to ``apply_plan``, a precision's name to
``SimOptions``, a module to ``simulate``), and an enum's name converts to the enum (``checkpointing="full"`` was
kept as a string and planned as no fixed mode at all).

Checks are shallow: a container's own type, and its items where they are of one plain class (a tuple of names).
An annotation this module cannot resolve at run time (a name imported for type checkers only) is not checked.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import numbers
import operator
import sys
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

from fsdp_planner.errors import PlannerError

F = TypeVar("F", bound=Callable[..., Any])
MAX_ITEMS = 10_000  # a container's items checked one by one up to this many (a name list, not a tensor's data)
_UNRESOLVED = object()


def checked(fn: F) -> F:
    """``fn`` with its arguments checked against its annotations (``check_value``) before it runs; an enum-typed
    argument given the enum's value is passed on as the enum."""
    signature = inspect.signature(fn)
    where = fn.__qualname__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # (a missing or unknown argument: Python's own TypeError)
        hints = _hints(fn)
        for name, value in bound.arguments.items():
            hint = hints.get(name, _UNRESOLVED)
            if hint is not _UNRESOLVED and signature.parameters[name].kind not in (
                    inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                bound.arguments[name] = check_value(value, hint, f"{where}'s {name}")
        return fn(*bound.args, **bound.kwargs)

    return call  # type: ignore[return-value]


def check_fields(obj: Any, hint: str = "") -> None:
    """A dataclass's fields checked against their annotations, from its ``__post_init__``; an enum's value
    converted to the enum in place (frozen or not). ``hint``: what to say after a refusal (another constructor)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        annotation = hints.get(f.name, _UNRESOLVED)
        if annotation is _UNRESOLVED:
            continue
        value = getattr(obj, f.name)
        try:
            converted = check_value(value, annotation, f"{type(obj).__name__}'s {f.name}")
        except PlannerError as e:
            raise PlannerError(f"{e}{hint}") from None
        if converted is not value:
            object.__setattr__(obj, f.name, converted)


def check_value(value: Any, hint: Any, what: str) -> Any:
    """``value`` if it is of ``hint``'s type, the enum it names where ``hint`` takes an enum, else a
    PlannerError: "``what`` must be ``described``, not ``value's type``"."""
    if _matches(value, hint):
        return value
    coerced = _coerced(value, hint)
    if coerced is not None and _matches(coerced, hint):
        return coerced
    for enum in _enums(hint):
        if isinstance(value, str):
            try:
                return enum(value)
            except ValueError:
                choices = ", ".join(repr(m.value) for m in enum)
                raise PlannerError(f"{what} must be one of {choices} (or {enum.__name__}), not {value!r}"[:400]) \
                    from None
    item = _first_stray(value, hint)
    held = f" holding {_kind(item[0])}" if item else ""
    raise PlannerError(f"{what} must be {describe(hint)}, not {_kind(value)}{held}"[:400])


def describe(hint: Any) -> str:
    """``hint`` in words: "a Plan", "an int or None", "a tuple of str"."""
    if hint is type(None) or hint is None:
        return "None"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return "a callable"
    if origin is not None:
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        of = f" of {describe(items[0]).removeprefix('a ').removeprefix('an ')}" if len(items) == 1 else ""
        return f"{_article(origin.__name__)}{of}"
    name = getattr(hint, "__name__", str(hint))
    return _article(f"nn.{name}" if getattr(hint, "__module__", "").startswith("torch.nn") else name)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of ``hint``'s type; decided by the value's type alone, once per (hint, type), where the
    hint is of plain classes (a dataclass built in a planner's inner loop pays a dict lookup a field)."""
    try:
        verdict = _by_type(hint, type(value))
    except TypeError:  # (an unhashable hint)
        verdict = None
    return _matches_value(value, hint) if verdict is None else verdict


@functools.cache
def _by_type(hint: Any, kind: type) -> bool | None:
    """``hint`` of plain classes (a union of them too) against a value of type ``kind``; None where the value
    itself decides (a container's items, a literal, a callable)."""
    args = _alternatives(hint)
    if any(a is Any for a in args):  # (a class since Python 3.11, of which nothing is an instance)
        return True
    if not all(a is type(None) or (isinstance(a, type) and typing.get_origin(a) is None) for a in args):
        return None
    return any(_class_matches(kind, a) for a in args)


def _class_matches(kind: type, cls: type) -> bool:
    if cls is type(None):
        return kind is type(None)
    if cls in (int, float) and issubclass(kind, bool):
        return False  # (True is an int to Python, never a count or a size to a user)
    if cls is float:
        return issubclass(kind, int | float)
    return issubclass(kind, cls)


def _matches_value(value: Any, hint: Any) -> bool:
    if hint is Any or isinstance(hint, TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if origin is not None:
        return _matches_generic(value, origin, typing.get_args(hint))
    if not isinstance(hint, type):
        return True  # (a NewType, a string left over: not checked)
    return _class_matches(type(value), hint)


def _matches_generic(value: Any, origin: Any, args: tuple[Any, ...]) -> bool:
    """A container: its type (a list where a tuple is asked for too: the frozen classes keep it as a tuple), then
    (a tuple of one plain class, a sequence of one) each of its items."""
    if not isinstance(origin, type):
        return True
    if not isinstance(value, (tuple, list) if origin is tuple else origin):
        return False
    if isinstance(value, str) and origin is not str:
        return False  # a name where names are asked for: its letters are no list of names
    items = [a for a in args if a is not Ellipsis]
    if len(items) != 1 or not isinstance(value, collections.abc.Sequence) or len(value) > MAX_ITEMS:
        return True
    return all(_matches(v, items[0]) for v in value)


def _coerced(value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` takes where it plainly means one (None where not): an integral float or a
    numpy integer where an int is taken (``SizeBasedPolicy(1e8)``, FSDP1's idiom), a numpy number where a float is,
    a numpy bool where a bool is, any collection but a string where a tuple is (``ModuleWrapPolicy({"Block"})``)."""
    args = _alternatives(hint)
    if isinstance(value, bool) or value is None:
        return None
    if bool in args and getattr(value, "dtype", None) is not None and str(value.dtype) == "bool" and \
            getattr(value, "shape", None) == ():
        return bool(value)
    if bool in args and int not in args and type(value) is int and value in (0, 1):
        return bool(value)  # (``offload=0``)
    if int in args:
        if isinstance(value, float):
            return int(value) if value.is_integer() else None
        try:
            return operator.index(value)
        except TypeError:
            pass
    if float in args and isinstance(value, numbers.Real):
        return float(value)
    tuples = [a for a in args if typing.get_origin(a) is tuple]
    if tuples and isinstance(value, collections.abc.Iterable) and not isinstance(value, str | bytes | dict):
        return tuple(value)
    return None


def _first_stray(value: Any, hint: Any) -> tuple[Any] | None:
    """(the first item of ``value``, a container of ``hint``'s kind, that is not of its item type,) or None."""
    origin, args = typing.get_origin(hint), [a for a in typing.get_args(hint) if a is not Ellipsis]
    if origin is None or not isinstance(origin, type) or len(args) != 1 or isinstance(value, str) or \
            not isinstance(value, collections.abc.Sequence):
        return None
    return next(((v,) for v in value[:MAX_ITEMS] if not _matches(v, args[0])), None)


def _alternatives(hint: Any) -> tuple[Any, ...]:
    """A union's members; any other hint alone."""
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _enums(hint: Any) -> list[type[Enum]]:
    return [a for a in _alternatives(hint) if isinstance(a, type) and issubclass(a, Enum)]


@functools.cache
def _hints(owner: Any) -> dict[str, Any]:
    """``owner``'s annotations resolved in its module (each on its own: one name imported for type checkers only
    leaves that annotation unchecked, not every one)."""
    out: dict[str, Any] = {}
    classes = [c for c in reversed(owner.__mro__) if c is not object] if isinstance(owner, type) else [owner]
    for c in classes:
        module = sys.modules.get(c.__module__)
        namespace = {**vars(typing), **(vars(module) if module else {})}
        for name, annotation in getattr(c, "__annotations__", {}).items():
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, namespace)  # (the package's own annotations: source, never data)
                except Exception:  # (a name imported under TYPE_CHECKING)
                    continue
            out[name] = annotation
    return out


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__name__  # (a numpy scalar by its module: numpy's bool is no "bool")
    if kind.__module__.split(".")[0] == "numpy":
        name = f"{kind.__module__.split('.')[0]}.{name}"
    if isinstance(value, bool | int | float):
        return f"{name} {value!r}"
    if isinstance(value, str):
        return f"str {value[:60]!r}"
    return _article(name)


def _article(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' or name.startswith('nn.') else 'a'} {name}"
