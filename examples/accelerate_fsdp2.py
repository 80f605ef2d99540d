"""Hugging Face Accelerate with a plan: ``fsdp-planner export plan.json --format accelerate --out acc_plan.yaml``
writes the launch config (acc_plan.yaml) and the hook beside it (acc_plan.py), then

    accelerate launch --config_file acc_plan.yaml --num_processes 2 examples/accelerate_fsdp2.py acc_plan.py

Accelerate starts the processes and their process group; the hook's ``shard`` applies the plan's groups on it, the
optimizer is made on the sharded params, and ``prepare`` hands both to Accelerate (whose FSDP2 keeps the sharded
model as it is). On a machine without GPUs, ``ACCELERATE_USE_CPU=true accelerate launch ...`` runs the processes on
CPU (gloo; Accelerate calls that MULTI_CPU). A plan with tensor parallelism (``TP_DEGREE``) builds its own (dp_shard,
tp) mesh, which Accelerate does not know: ``prepare`` refuses a DataLoader there (Accelerate would give each rank
batches of its own), and the loader samples by the data-parallel rank instead, one batch per TP group (here: which
seed makes the step's batch); the loss and its backward run under the export's ``loss_context()``."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_planner.models import load_model
from fsdp_planner.trace import run_model


def main(plan_code: str, model_name: str = "toy-llama") -> None:
    accelerator = Accelerator()  # the FSDP2 plugin comes from the launch config
    train(accelerator, plan_code, model_name)
    # FSDP2's modules and DTensors hold the process group: every one gone (the training's locals with its frame,
    # the accelerator's references, their reference cycles collected) before it is destroyed, or gloo may abort
    # the exiting rank
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()  # destroys the process group


def train(accelerator: Accelerator, plan_code: str, model_name: str) -> None:
    """The hook's ``shard`` and ``prepare`` on the model and its optimizer, then three steps."""
    spec = importlib.util.spec_from_file_location("exported_plan", plan_code)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    tp = getattr(plan, "TP_DEGREE", 1)
    loss_context = getattr(plan, "loss_context", contextlib.nullcontext)
    lm = load_model(model_name, meta=False, seed=0)
    model = plan.shard(accelerator, lm.model)  # the plan's fully_shard calls, root last
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # on the sharded params
    data = TensorDataset(torch.arange(3 * accelerator.num_processes // tp))
    seeds = DataLoader(data, batch_size=1)
    if tp == 1:
        model, optimizer, seeds = plan.prepare(accelerator, model, optimizer, seeds)
    else:
        try:  # (Accelerate's split would give the ranks of a TP group batches of their own)
            plan.prepare(accelerator, model, optimizer, seeds)
            raise AssertionError("prepare took a DataLoader of a TP plan")
        except RuntimeError as e:
            assert "ranks of a TP group must train the same ones" in str(e), e
        sampler = DistributedSampler(data, num_replicas=accelerator.num_processes // tp,
                                     rank=accelerator.process_index // tp, shuffle=False)
        seeds = DataLoader(data, batch_size=1, sampler=sampler)
        model, optimizer = plan.prepare(accelerator, model, optimizer)
    trained = []
    for (seed,) in seeds:  # 3 a rank: one per data-parallel rank and step
        trained.append(int(seed))
        batch = load_model(model_name, meta=False, seed=100 + int(seed))
        with loss_context():
            accelerator.backward(batch.loss_fn(run_model(model, batch.example_inputs)))
        optimizer.step()
        optimizer.zero_grad()
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, trained)
    groups = [everyone[r:r + tp] for r in range(0, len(everyone), tp)]
    if any(g.count(g[0]) != tp for g in groups) or len({tuple(g[0]) for g in groups}) != len(groups):
        raise RuntimeError(f"the ranks' batches (consecutive ranks are a TP group): {everyone}")
    kind = accelerator.distributed_type.value
    accelerator.print(f"trained {len(trained)} steps on {accelerator.num_processes} processes ({kind}), each TP group "
                      "its own batches")


if __name__ == "__main__":
    main(*sys.argv[1:])
