"""The TP collectives of one forward and backward of a plan's Python export (its ``apply()``) beside
``apply_plan``'s, on fake ranks: what the export tests of each TP style compare."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.apply.fully_shard import apply_plan
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.runtime.fake_world import FunctionalCounter, fake_process_group
from fsdp_planner.trace.recorder import split_inputs


def export_and_apply_collectives(spec: ModelSpec, plan: Plan, world: int = 4) -> tuple[str, list[Any]]:
    """The export's source, and (counts, bytes) of DTensor's collectives by kind under the export's ``apply()``
    then under ``apply_plan`` (bf16-mixed, as the export runs it)."""
    source = export_plan(plan, ExportFormat.PYTHON)
    scope: dict = {"__name__": "exported"}
    exec(compile(source, "exported.py", "exec"), scope)
    bf16_mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # the export's
    seen = []
    with fake_process_group(world):
        for shard in (lambda m: scope["apply"](m, scope["make_mesh"]("cpu")),
                      lambda m: apply_plan(m, plan, mp_policy=bf16_mixed)):
            lm = load_model(spec, meta=False)
            model = shard(lm.model)
            counter = FunctionalCounter()
            args, kwargs = split_inputs(lm.example_inputs)
            with counter.counting():
                lm.loss_fn(model(*args, **kwargs)).backward()
            seen.append(counter.take())
    return source, seen
