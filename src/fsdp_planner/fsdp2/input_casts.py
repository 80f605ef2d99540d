"""The modules every plan must list so that FSDP2 casts their float32 inputs (``Trace.cast_inputs``).

FSDP2 casts a module's floating inputs to the compute dtype at its pre-forward only where a ``fully_shard`` call
lists it (and hooks it: not below another module of the same call). A model that makes float32 activations before
such a module (``trace/input_casts.py``) runs in mixed precision only so: the policies give each a group where
they did not list it, and a plan file that does not is refused with the module named.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from fsdp_planner.errors import PlannerError
from fsdp_planner.trace.records import Trace


class UncastInputsError(PlannerError):
    """A plan that hooks no module where the step needs FSDP2's cast of float32 inputs."""


def with_cast_targets(trace: Trace, groups: list[list[str]], ancestors: Callable[[str], set[str]]
                      ) -> list[list[str]]:
    """``groups`` (module lists) with every module of ``Trace.cast_inputs`` hooked: one no group lists, or one a
    group lists beside a module above it (``ancestors``: FSDP2 hooks only the module above), gets a group of its
    own (nested in that group's, which keeps the rest)."""
    cast = set(trace.cast_inputs)
    out: list[list[str]] = []
    hooked: set[str] = set()
    for ms in groups:
        listed = set(ms)
        kept = [m for m in ms if m not in cast or not ancestors(m) & listed]
        out.append(kept)
        hooked.update(kept)
    return [*out, *([m] for m in trace.cast_inputs if m not in hooked)]


def check_input_casts(trace: Trace, hooked: Collection[str], policy: bool = False) -> None:
    """Refuse a plan whose groups do not hook a module of ``Trace.cast_inputs`` (``hooked``: the modules the
    plan's ``fully_shard`` calls hook): its float32 inputs would meet the compute dtype's weights uncast.
    ``policy``: the plan is a policy's, not the user's."""
    missing = unhooked_casts(trace, hooked)
    if not missing:
        return
    subject = f"{float32_subject(missing)} activations, which FSDP2 casts to the compute dtype only at the " \
        "pre-forward of a module it hooks"
    if policy:
        raise UncastInputsError(f"{subject}, and the policy's groups leave {'it' if len(missing) == 1 else 'them'} "
                                "unhooked (listed in one fully_shard call beside a module above, or unshardable): "
                                "plan with another policy, or cast in the model's forward (x.to(weight.dtype))")
    raise UncastInputsError(f"{subject}, and no group of the plan hooks {'it' if len(missing) == 1 else 'them'} "
                            "(a module listed in one fully_shard call beside a module above it is not hooked): give "
                            "each a group (one without params of its own is fine) or list it in one, or cast in "
                            "the model's forward (x.to(weight.dtype)) before it")


def unhooked_casts(trace: Trace, hooked: Collection[str]) -> list[str]:
    """The modules of ``Trace.cast_inputs`` that no ``fully_shard`` call hooks (``hooked``: those it does)."""
    return [m for m in trace.cast_inputs if m not in hooked]


def float32_subject(names: Sequence[str]) -> str:
    """The subject of the notes and errors about ``names``: "'blocks.0' gets float32", "'a', 'b' get float32"."""
    listed = ", ".join(f"'{m}'" for m in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{listed} {'gets' if len(names) == 1 else 'get'} float32"
