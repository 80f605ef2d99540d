"""Plan and train in one script: ``fsdp_planner.plan`` on the model the script builds, then ``apply_plan`` and a few
training steps, under torchrun.

    torchrun --nproc_per_node 2 examples/plan_and_train.py                   # gloo on CPU, NCCL on GPUs
    torchrun --nproc_per_node 8 examples/plan_and_train.py --cluster h100:64  # plan for the cluster you train on

Every rank plans (the planner is deterministic: the same model and options give the same plan on every rank, which
the script checks), the model is built for real with its initial weights, and planning leaves them untouched (it
traces a meta twin). On CPU the plan is made for fp32 (``--precision``): gloo's CPU ranks train in fp32 here.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_planner as fp


class Block(nn.Module):
    """A pre-norm MLP block: what a transformer block costs FSDP, without attention's code."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch x seq, vocab). The tokens go in flattened: on 3-D activations nn.Embedding and
        nn.Linear return views of 2-D results, and FSDP2 warns about a wrapped module returning a view (an in-place
        op on it would skip its pre-backward hook); on 2-D ones they return fresh tensors."""
        x = self.embed(tokens.flatten())
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(tokens: torch.Tensor):  # type: ignore[no-untyped-def]
    def loss(logits: torch.Tensor) -> torch.Tensor:
        per_sequence = logits.unflatten(0, tokens.shape)
        return F.cross_entropy(per_sequence[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", help="the cluster to plan for (default: h100 with one GPU per rank)")
    ap.add_argument("--precision", default="fp32" if not torch.cuda.is_available() else "bf16-mixed")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    train(args, device)
    # FSDP2's modules, their DTensors and the mesh hold the process group: every one gone (the training's locals
    # with its frame, their reference cycles collected) before it is destroyed, or gloo may abort the exiting rank
    gc.collect()
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: str) -> None:
    """Plan on every rank (the same plan), shard the model as it says, and train a few steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM().to(device)
    tokens = torch.randint(0, 256, (args.batch, args.seq), device=device)

    plan = fp.plan(model, (tokens,), next_token_loss(tokens), cluster=args.cluster or f"h100:{world}",
                   precision=args.precision)
    plans: list[str] = [""] * world
    dist.all_gather_object(plans, plan.to_json())
    assert len(set(plans)) == 1, "the ranks planned differently"
    if rank == 0:
        print(f"plan: {plan.policy}, {len(plan.groups)} groups: "
              + " | ".join(",".join(m or "(root)" for m in g.modules) for g in plan.groups))

    mesh = init_device_mesh(device, (world,))
    fp.apply_plan(model, plan, mesh=mesh)  # fully_shard per group, root last, in the plan's precision
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)  # each rank its own data, one batch learnt over the steps: the loss falls
    batch = torch.randint(0, 256, (args.batch, args.seq), device=device)
    for step in range(args.steps):
        loss = next_token_loss(batch)(model(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item() / world:.4f}")


if __name__ == "__main__":
    main()
