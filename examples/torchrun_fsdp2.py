"""Plain torchrun + FSDP2 with a plan exported as code.

    fsdp-planner plan toy-llama --policy auto --precision fp32 --out plan.json
    fsdp-planner export plan.json --format python --precision fp32 --out toy_plan.py
    torchrun --nproc_per_node 2 examples/torchrun_fsdp2.py toy_plan.py

Builds the model, applies the exported ``apply(model, mesh)``, trains three SGD steps beside an unsharded copy on
the same data and prints the largest parameter difference (gloo on CPU, NCCL on GPUs). A plan with tensor
parallelism (``TP_DEGREE``) gives each TP group of consecutive ranks one batch and runs the loss under the
export's ``loss_context()`` (loss parallel). A plan with expert parallelism (``EP_DEGREE``) gives each rank its own
batch, as without it: the experts' tokens travel by all-to-all inside ``apply``'s dispatch. The reference trains in
fp32, hence fp32 for the plan too (``apply`` sets the precision the plan was exported with, bf16-mixed by default).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_planner.models import LoadedModel, load_model
from fsdp_planner.trace import default_loss, run_model


def load_plan_module(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("exported_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loss_of(lm: LoadedModel) -> Callable[[Any], torch.Tensor]:
    """The model's loss function; a factory that returns none is trained on the mean square of its output."""
    return lm.loss_fn or default_loss


def main(plan_code: str, model_name: str = "toy-llama") -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train(plan_code, model_name)
    # FSDP2's modules and DTensors hold the process group: every one of them gone (the training's locals with its
    # frame, their reference cycles collected) before it is destroyed, or gloo may abort the exiting rank
    gc.collect()
    dist.destroy_process_group()


def train(plan_code: str, model_name: str) -> None:
    """Three steps of the sharded model beside the unsharded reference; each rank prints what it holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = load_model(model_name, meta=False, seed=0)
    model, reference = lm.model, copy.deepcopy(lm.model)
    plan = load_plan_module(plan_code)
    plan.apply(model)  # the plan's fully_shard calls, root last (after parallelize_module, with TP)
    tp = getattr(plan, "TP_DEGREE", 1)  # a TP group's ranks train on one batch
    loss_context = getattr(plan, "loss_context", contextlib.nullcontext)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(3):
        batches = [load_model(model_name, meta=False, seed=100 + 10 * step + r) for r in range(world // tp)]
        mine = batches[rank // tp]
        with loss_context():
            loss_of(mine)(run_model(model, mine.example_inputs)).backward()
        opt.step()
        opt.zero_grad()
        for b in batches:  # the same global batch, unsharded: mean of the data-parallel ranks' losses
            (loss_of(b)(run_model(reference, b.example_inputs)) / len(batches)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = dict(reference.named_parameters())
    diff = max((p.full_tensor() - ref[n]).abs().max().item() for n, p in model.named_parameters())
    shards = [p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor)]
    print(f"rank {rank} of {world}: {len(shards)} of {len(ref)} params DTensors, local numel {sum(shards)}", flush=True)
    if rank == 0:
        print(f"fsdp modules: {sum(1 for m in model.modules() if type(m).__name__.startswith('FSDP'))}", flush=True)
        print(f"max_abs_diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
