"""Expert parallelism in a plan: the EP degree and the expert modules whose grouped weights it shards.

FSDP2 composes with EP the way torchtitan's ``parallelize`` does for its MoE models: each expert module (a grouped
experts module: its params stacked on dim 0, one slice per expert) is distributed over the ``ep`` mesh dim, its
params DTensors sharded on the expert dim (``Shard(0)``: each EP rank holds E / ep experts), and the tokens routed
to an expert are sent to the rank that holds it by an all-to-all before the experts run and sent back by another
after (torchtitan's ``ExpertParallel``: ``all_to_all_single_autograd``, so backward runs both again, reversed).
Then each expert module is ``fully_shard``-ed alone over the data-parallel ranks that hold the same experts (the
EP-reduced mesh, torchtitan's ``dp_shard_mod_ep``: dp_shard / ep ranks, ep apart), and the rest of the model over
the whole data-parallel mesh as without EP. EP's ranks come out of ``dp_shard`` (innermost, consecutive ranks);
with tensor parallelism out of dp_shard x tp (torchtitan's expert TP of 1: EP a multiple of TP, each TP rank
dispatching its 1/TP of the routed tokens, the experts sharded over dp_shard x tp / ep ranks).

This module holds the EP part of a plan and its JSON form; what it does to a step is ``sim/expert_parallel.py``.
Module names are patterns as for tensor parallelism (``layers.*.moe.experts``; ``tensor_parallel.matches``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.tensor_parallel import is_literal, matches
from fsdp_planner.limits import MAX_EP_DEGREE
from fsdp_planner.userfiles import shown_json

MAX_EXPERT_PATTERNS = 10_000
MAX_SKEW = 1024.0
EP_KEYS = ("degree", "modules", "skew", "per_param_mesh")


@dataclass(frozen=True)
class ExpertParallel:
    """The EP part of a plan: ``degree`` ranks in an EP group and the expert modules (name patterns) it shards.
    ``skew``: the tokens the busiest EP rank's experts process over a balanced router's share (1: balanced, as the
    routing stand-in dispatches; at most ``degree``: every routed token on one rank) -- the rank the step waits
    for. ``per_param_mesh``: the experts' params are sharded in their block's ``fully_shard`` call, on the EP-reduced
    mesh by ``shard_placement_fn`` (torch's ``ShardPlacementResult``; FSDP2 makes them a second param group of the
    block's state, gathered and reduced at the block's hooks), as torchtitan does since pytorch/torchtitan#2281
    (March 2026); False: each expert module ``fully_shard``-ed alone, with hooks of its own, as before it. Either
    way the plan lists the experts' params as a group of their own (``expert_groups.py``)."""

    degree: int
    modules: tuple[str, ...] = ()
    skew: float = 1.0
    per_param_mesh: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.modules, tuple):
            object.__setattr__(self, "modules", tuple(self.modules))

    def experts(self, module_names: Iterable[str]) -> list[str]:
        """The modules of ``module_names`` the patterns name, in their order; a pattern that names none is refused."""
        names = list(module_names)
        known = set(names)
        hits: dict[str, None] = {}
        for pattern in self.modules:  # (a name without wildcards looked up: a 671B plan lists 58, each matched
            # against 1,215 modules 230 times a search took a third of DeepSeek-V3's planning time)
            found = ([pattern] if pattern in known else []) if is_literal(pattern) else \
                [n for n in names if matches(pattern, n)]
            if not found:
                raise PlannerError(f"the expert-parallel modules name {shown_json(pattern)}, which matches no module "
                                   "of this model: give the grouped experts modules as `named_modules()` spells "
                                   "them ('*' for one part, e.g. layers.*.moe.experts)")
            hits.update(dict.fromkeys(found))
        return [n for n in names if n in hits]

    def describe(self) -> str:
        """"EP 8", "EP 8 (skew 1.5)"; the experts' own calls said ("EP 8 (experts' own calls)"): torchtitan's
        layout since March 2026 goes without saying."""
        said = [f"skew {self.skew:g}"] * (self.skew != 1.0) + ["experts' own calls"] * (not self.per_param_mesh)
        return f"EP {self.degree}" + (f" ({', '.join(said)})" if said else "")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"degree": self.degree, "modules": list(self.modules)}
        if self.skew != 1.0:
            d["skew"] = self.skew
        if self.per_param_mesh:  # absent: the experts' own fully_shard calls, as plans written before it
            d["per_param_mesh"] = True
        return d

    def signature(self) -> tuple:
        """What a trace's EP view depends on: where the experts' params are gathered is the replay's, not the
        view's."""
        return self.degree, self.modules, self.skew


def expert_parallel_from_dict(data: Any) -> ExpertParallel | None:
    """A plan's ``expert_parallel`` object; absent (None): no EP."""
    if data is None:
        return None
    if not isinstance(data, dict) or any(k not in EP_KEYS for k in data):
        raise PlannerError(f"plan 'expert_parallel' must be an object with the keys {', '.join(EP_KEYS)} (degree "
                           f"and modules required), got {shown_json(data)}")
    degree, modules, skew = data.get("degree"), data.get("modules"), data.get("skew", 1.0)
    per_param_mesh = data.get("per_param_mesh", False)
    if not isinstance(per_param_mesh, bool):
        raise PlannerError(f"plan 'expert_parallel.per_param_mesh' must be true or false, got "
                           f"{shown_json(per_param_mesh)}")
    if isinstance(degree, bool) or not isinstance(degree, int) or not 1 <= degree <= MAX_EP_DEGREE:
        raise PlannerError(f"plan 'expert_parallel.degree' must be a whole number from 1 to {MAX_EP_DEGREE}, got "
                           f"{shown_json(degree)}")
    if not isinstance(modules, list) or len(modules) > MAX_EXPERT_PATTERNS or \
            not all(isinstance(m, str) and 0 < len(m) <= 10_000 and "" not in m.split(".") for m in modules):
        raise PlannerError("plan 'expert_parallel.modules' must be a list of module names or patterns with '*' "
                           f"(non-empty parts separated by dots), at most {MAX_EXPERT_PATTERNS:,}")
    if degree > 1 and not modules:
        raise PlannerError(f"plan 'expert_parallel' has degree {degree} but no modules: name the grouped experts "
                           "modules (e.g. layers.*.moe.experts)")
    if isinstance(skew, bool) or not isinstance(skew, int | float) or not 1.0 <= skew <= min(MAX_SKEW, degree):
        raise PlannerError(f"plan 'expert_parallel.skew' must be a number from 1 (balanced routing) to the EP degree "
                           f"{degree} (every token on one rank), got {shown_json(skew)}")
    if len(set(modules)) != len(modules):
        twice = next(m for i, m in enumerate(modules) if m in modules[:i])
        raise PlannerError(f"plan 'expert_parallel.modules' names {shown_json(twice)} twice: name each once")
    return ExpertParallel(degree, tuple(modules), float(skew), per_param_mesh)
