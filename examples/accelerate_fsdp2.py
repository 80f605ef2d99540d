"""Hugging Face Accelerate with a plan: ``fsdp-planner export plan.json --format accelerate --out acc_plan.py``,
then ``accelerate launch examples/accelerate_fsdp2.py acc_plan.py`` (or torchrun). The exported ``prepare`` shards
the model with the plan's groups and then calls ``accelerator.prepare`` (which keeps an FSDP2 model as it is). A plan
with tensor parallelism (``TP_DEGREE``) builds its own (dp_shard, tp) mesh: one batch per TP group, the loss and its
backward under the export's ``loss_context()``."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys

import torch
from accelerate import Accelerator

from fsdp_planner.models import load_model


def main(plan_code: str, model_name: str = "toy-llama") -> None:
    spec = importlib.util.spec_from_file_location("exported_plan", plan_code)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    tp = getattr(plan, "TP_DEGREE", 1)
    loss_context = getattr(plan, "loss_context", contextlib.nullcontext)
    accelerator = Accelerator(fsdp_plugin=plan.fsdp_plugin())
    lm = load_model(model_name, meta=False, seed=0)
    model = plan.prepare(accelerator, lm.model)  # accelerate returns a single object unpacked
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05))
    for step in range(3):
        batch = load_model(model_name, meta=False, seed=100 + 10 * step + accelerator.process_index // tp)
        with loss_context():
            accelerator.backward(batch.loss_fn(model(*batch.example_inputs)))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print("trained 3 steps")
    # FSDP2's modules hold the process group: drop them before destroying it (gloo may abort the exiting
    # rank when they outlive it)
    accelerator.free_memory()
    del model, optimizer, lm
    gc.collect()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main(*sys.argv[1:])
