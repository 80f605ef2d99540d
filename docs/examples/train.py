"""Train with a plan: ``torchrun --standalone --nproc-per-node 2 docs/examples/train.py plan.json``.

Each rank builds the model for real, ``apply_plan`` shards it with ``fully_shard`` as the plan says, then it trains
a few steps. gloo on CPU, NCCL when GPUs are there.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist

import fsdp_planner as fp

sys.path.insert(0, os.path.dirname(__file__))
from my_model import build


def main(plan_path: str, steps: int = 3) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    train(plan_path, steps, cuda)
    # the sharded model holds the process group: gone (with train's frame, its cycles collected) before it is
    # destroyed, or gloo may abort the exiting rank
    gc.collect()
    dist.destroy_process_group()


def train(plan_path: str, steps: int, cuda: bool) -> None:
    """Build the model, shard it as the plan says, train ``steps`` steps."""
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)  # every rank builds the same initial model
    device = torch.device("cuda" if cuda else "cpu")
    with device:
        model, (tokens,), loss_fn = build()
    fp.apply_plan(model, fp.Plan.load(plan_path))  # one fully_shard per group, the root last
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        loss = loss_fn(model(tokens.to(device)))
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
