"""After planning: a plan applied for real, with FSDP2's ``fully_shard`` (``fully_shard.py``) or as FSDP1
units (``fsdp1.py``), or written out as code a training script runs without fsdp-planner (``export.py``; for
``accelerate launch``, with its launch config: ``accelerate_config.py``)."""

from fsdp_planner.apply.accelerate_config import accelerate_config
from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.apply.fsdp1 import fsdp1_kwargs, fsdp1_policy
from fsdp_planner.apply.fully_shard import apply_plan, device_mesh

__all__ = ["ExportFormat", "accelerate_config", "apply_plan", "device_mesh", "export_plan", "fsdp1_kwargs",
           "fsdp1_policy"]
