"""Float8 training in a plan: which Linears torchao converts, with which recipe, and how FSDP2 all-gathers them.

torchtitan's float8 converter swaps each ``nn.Linear`` its filter keeps for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training``) before the model is parallelized: the filter keeps a Linear whose
weight dims are both multiples of 16 (float8 tensor-core matmuls need them) and whose name holds none of
``filter_fqns`` (the output head: torchtitan's Llama jobs name ``output``; the default here names transformers'
``lm_head`` too). A converted Linear's three matmuls (output, input grad, weight grad) run in float8, each operand
cast from bf16 first by a dynamic scale (the amax of the tensor, tensorwise, or of each row, rowwise); its param
stays in the precision's dtype.

With ``fsdp_float8_all_gather`` (tensorwise only: torchao refuses it for other scalings) FSDP2 all-gathers a
converted weight in float8, one byte an element: torchao's weight subclass casts the local shard before the
all-gather (``fsdp_pre_all_gather``) and the forward uses the gathered float8 weight as is. The cast needs the
scale of the whole weight: either each all-gather all-reduces its weights' amaxes, one small all-reduce per weight,
or, with ``precompute_scale`` (``torchao.float8.precompute_float8_dynamic_scale_for_fsdp`` after each optimizer
step), one all-reduce of every weight's amax a step.

With ``tp_float8_all_gather`` (tensorwise only, under tensor parallelism) the TP layout's converted Linears take
torchao's float8 styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``): a
region's sequence-sharded input is cast to float8 before its all-gather, and a rowwise Linear's output grad before
its backward all-gather, so both move one byte an element. torchtitan applied these with every tensorwise float8
job under TP until its config-based sharding (April 2026, pytorch/torchtitan 1786292), whose TP is dtype-agnostic:
its Llama 3 Table 4 runs (December 2024) ran them; its jobs since gather bf16 (the default here).

This module holds the policy and its JSON form; what it does to a step is ``sim/float8.py``, how it is applied
``apply/float8.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_planner.choices import FLOAT8_RECIPES, Float8Recipe
from fsdp_planner.errors import PlannerError
from fsdp_planner.userfiles import shown_json

FLOAT8_KEYS = ("recipe", "fsdp_float8_all_gather", "precompute_scale", "filter_fqns", "tp_float8_all_gather")
# the output head stays in bf16: torchtitan's Llama 3 float8 jobs filter "output", its name there; "lm_head" is
# transformers' name for it (a converted head TP leaves whole also breaks the precomputed scales under TP)
OUTPUT_HEAD_FQNS = ("output", "lm_head")
FLOAT8_DIM_MULTIPLE = 16  # a float8 matmul's dims must be multiples of 16 (torchtitan's filter skips the rest)
MAX_FILTER_FQNS = 1_000


@dataclass(frozen=True)
class Float8:
    """The float8 part of a plan: torchao's recipe, FSDP2's float8 all-gather of converted weights (tensorwise
    only), their scales precomputed once a step (with the float8 all-gather only), and the names of the Linears
    left in the precision's dtype (a Linear is skipped when its name holds any of them)."""

    recipe: Float8Recipe = Float8Recipe.TENSORWISE
    fsdp_float8_all_gather: bool = True
    precompute_scale: bool = True
    filter_fqns: tuple[str, ...] = OUTPUT_HEAD_FQNS
    tp_float8_all_gather: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.filter_fqns, tuple):
            object.__setattr__(self, "filter_fqns", tuple(self.filter_fqns))
        if self.fsdp_float8_all_gather and self.recipe is not Float8Recipe.TENSORWISE:
            raise PlannerError(f"float8 {self.recipe.value} cannot all-gather its weights in float8: torchao's FSDP2 "
                               "float8 all-gather is for tensorwise scaling only; turn it off (--no-float8-all-gather) "
                               "or use --float8 tensorwise")
        if self.tp_float8_all_gather and self.recipe is not Float8Recipe.TENSORWISE:
            raise PlannerError(f"float8 {self.recipe.value} cannot all-gather TP activations in float8: torchao's "
                               "float8 TP styles assume tensorwise scaling; use --float8 tensorwise or leave it out")
        if self.precompute_scale and not self.fsdp_float8_all_gather:
            raise PlannerError("precomputed float8 scales are the scales of FSDP2's float8 all-gather: turn on the "
                               "float8 all-gather, or precompute_scale off")

    @classmethod
    def named(cls, recipe: str, all_gather: bool | None = None, tp_all_gather: bool = False,
              skip: tuple[str, ...] = ()) -> Float8:
        """``--float8 RECIPE``: the float8 all-gather with precomputed scales where the recipe allows it (as
        torchtitan's published float8 runs), unless ``all_gather`` is False; the output head's filter
        (``OUTPUT_HEAD_FQNS``) and ``skip``'s names (``--float8-skip``: a head of another name);
        ``tp_all_gather``: torchao's float8 TP styles."""
        r = Float8Recipe(recipe)
        gather = r is Float8Recipe.TENSORWISE if all_gather is None else all_gather
        fqns = tuple(dict.fromkeys((*OUTPUT_HEAD_FQNS, *skip)))
        return cls(r, gather, gather, fqns, tp_float8_all_gather=tp_all_gather)

    def converts(self, fqn: str, weight_shape: tuple[int, ...], *, plain: bool, tied: bool) -> bool:
        """Whether the Linear ``fqn`` with a weight of ``weight_shape`` is converted: torchtitan's filter, and a
        plain ``nn.Linear`` (``plain``: not a subclass, whose own forward ``Float8Linear`` would drop, such as
        ``nn.MultiheadAttention``'s ``out_proj``, whose weight the attention reads itself) whose weight no other
        module shares and that is registered under one name only (``tied``: torchao's swap gives the Linear a
        weight of its own, untying a tied output head from its embedding, and swaps one registration of a module
        registered twice)."""
        return plain and not tied and len(weight_shape) == 2 \
            and all(d % FLOAT8_DIM_MULTIPLE == 0 for d in weight_shape) and not any(f in fqn for f in self.filter_fqns)

    def filtering_nothing(self, linears: list[str]) -> list[str]:
        """The filter's entries in none of ``linears``' names: a typo that keeps nothing in bf16. A default head's
        name is one only where no head name matches (torchtitan's ``output`` and transformers' ``lm_head`` are never
        both there; ``output`` alone on a transformers model leaves its ``lm_head`` in float8)."""
        if self.filter_fqns == OUTPUT_HEAD_FQNS:  # (the default, not the user's: a model may have no head)
            return []
        idle = [f for f in self.filter_fqns if not any(f in n for n in linears)]
        head = any(f in n for f in OUTPUT_HEAD_FQNS if f in self.filter_fqns for n in linears)
        return [f for f in idle if not (head and f in OUTPUT_HEAD_FQNS)]

    def describe(self) -> str:
        gather = ", float8 all-gather" + (" (precomputed scales)" if self.precompute_scale else "") \
            if self.fsdp_float8_all_gather else ""
        tp = ", TP all-gathers in float8" if self.tp_float8_all_gather else ""
        return f"float8 {self.recipe.value}{gather}{tp}"

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.value, "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
                "precompute_scale": self.precompute_scale, "filter_fqns": list(self.filter_fqns),
                **({"tp_float8_all_gather": True} if self.tp_float8_all_gather else {})}

    def signature(self) -> tuple:
        return (self.recipe, self.fsdp_float8_all_gather, self.precompute_scale, self.filter_fqns,
                self.tp_float8_all_gather)


def float8_from_dict(data: Any) -> Float8 | None:
    """A plan's ``float8`` object; absent (None): no float8 training."""
    if data is None:
        return None
    if not isinstance(data, dict) or any(k not in FLOAT8_KEYS for k in data):
        raise PlannerError(f"plan 'float8' must be an object with the keys {', '.join(FLOAT8_KEYS)} (recipe "
                           f"required), got {shown_json(data)}")
    recipe = data.get("recipe")
    if recipe not in FLOAT8_RECIPES:
        raise PlannerError(f"plan 'float8.recipe' must be one of {', '.join(FLOAT8_RECIPES)}, got {shown_json(recipe)}")
    gather = data.get("fsdp_float8_all_gather", recipe == Float8Recipe.TENSORWISE.value)
    precompute = data.get("precompute_scale", gather)
    fqns = data.get("filter_fqns", list(OUTPUT_HEAD_FQNS))
    tp = data.get("tp_float8_all_gather", False)
    for key, value in (("fsdp_float8_all_gather", gather), ("precompute_scale", precompute),
                       ("tp_float8_all_gather", tp)):
        if not isinstance(value, bool):
            raise PlannerError(f"plan 'float8.{key}' must be true or false, got {shown_json(value)}")
    if not isinstance(fqns, list) or len(fqns) > MAX_FILTER_FQNS or \
            not all(isinstance(f, str) and 0 < len(f) <= 10_000 for f in fqns):
        raise PlannerError(f"plan 'float8.filter_fqns' must be a list of at most {MAX_FILTER_FQNS:,} non-empty "
                           f"names (a Linear whose name holds one stays unconverted), got {shown_json(fqns)}")
    return Float8(Float8Recipe(recipe), gather, precompute, tuple(fqns), tp)
