"""A torchtitan-style trainer with a plan: ``fsdp-planner export plan.json --format torchtitan --out tt_plan.py``,
then ``torchrun --nproc_per_node 2 examples/torchtitan_parallelize.py tt_plan.py``. The exported
``parallelize(model, world_mesh)`` takes torchtitan's named mesh (``dp_shard``; ``dp_replicate`` for HSDP) in place
of its ``apply_fsdp``; with tensor parallelism, torchtitan's (dp_shard, tp) mesh (the export's ``make_mesh``), one batch
per TP group and the loss under its ``loss_context()``."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_planner.models import load_model
from fsdp_planner.trace import run_model


def main(plan_code: str, model_name: str = "toy-llama") -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train(plan_code, model_name)
    # FSDP2's modules, their DTensors and the mesh hold the process group: every one gone (the training's locals
    # with its frame, their reference cycles collected) before it is destroyed, or gloo may abort the exiting rank
    gc.collect()
    dist.destroy_process_group()


def train(plan_code: str, model_name: str) -> None:
    """The export's ``parallelize`` on the model, then three steps."""
    spec = importlib.util.spec_from_file_location("exported_plan", plan_code)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tp = getattr(plan, "TP_DEGREE", 1)
    world_mesh = plan.make_mesh(device) if tp > 1 else \
        init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    model = plan.parallelize(load_model(model_name, meta=False, seed=0).model, world_mesh)
    loss_context = getattr(plan, "loss_context", contextlib.nullcontext)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        lm = load_model(model_name, meta=False, seed=100 + 10 * step + dist.get_rank() // tp)
        with loss_context():
            lm.loss_fn(run_model(model, lm.example_inputs)).backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print("trained 3 steps")


if __name__ == "__main__":
    main(*sys.argv[1:])
