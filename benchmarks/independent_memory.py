"""An independent measurement of one plan's peak memory: torch's own ``FSDPMemTracker``, in its own process.

Run: python benchmarks/independent_memory.py FILE.py:FACTORY PLAN.json WORLD [--precision bf16-mixed|fp32]

Nothing of fsdp_planner's runtime is used: the factory's file is imported by path and its model built with real
(CPU) tensors, on rank 0 of torch's fake process group of WORLD ranks (collectives return at once, shapes real).
This script reads the plan file (what ``plan --out`` writes) and applies it itself: checkpointing first (a named
module's forward under non-reentrant ``torch.utils.checkpoint``; for ``selective_checkpointing`` with op-level
SAC, its own save policy, written from torchtitan's description: keep mm outputs but recompute every second mm of
a block call, keep SDPA's and ``max``'s), then ``fully_shard`` on each group (deepest first, the root last) with
the group's ``reshard_after_forward`` and a ``MixedPrecisionPolicy`` of the precision (bf16 params, fp32 reduce;
a group's ``param_dtype`` fp32 gets an fp32 one). One step of AdamW (lr 1e-3) creates the optimizer state, then
the second step (forward, loss, backward, ``step``, ``zero_grad(set_to_none=True)``) runs under
``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``), whose peak (bytes on the CPU device: the
params, grads, optimizer state, inputs, activations and FSDP2's buffers it tracks) is printed as one JSON line.
SDPA takes the kernel the CPU picks (its flash kernel where it applies: outputs and log-sum-exp saved, as on a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
SAVED_OPS = {aten.mm.default, aten.max.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_fused_attention_overrideable.default}


def factory(spec: str):
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(Path(path).stem + "_independent", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def sac_context():
    """A fresh mm count per block call: odd-numbered mm outputs kept, even-numbered recomputed."""
    count = {"mm": 0}

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default and not ctx.is_recompute:
            count["mm"] += 1
            if count["mm"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_forward(module: nn.Module, selective: bool) -> None:
    forward = module.forward

    def run(*args, **kwargs):
        extra = {"context_fn": sac_context} if selective else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = run


def called_modules(model: nn.Module, inputs) -> set[nn.Module]:
    """The modules whose forward runs in a step (one forward without grad, before sharding)."""
    called: set[nn.Module] = set()
    hooks = [m.register_forward_pre_hook(lambda m, _: called.add(m)) for m in model.modules()]
    with torch.no_grad():
        model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    for h in hooks:
        h.remove()
    return called


class Tracker(FSDPMemTracker):
    """FSDPMemTracker that does not instrument the backward of a module whose forward never runs.

    Why: FSDPMemTracker wraps a group's ``pre_backward`` and ``post_backward`` once per module of a multi-module
    ``fully_shard`` and looks each module up in ``memory_tracking``, which only that module's own forward fills
    (torch/distributed/_tools/fsdp2_mem_tracker.py, ``_fsdp_param_group_pre_backward``: ``mod_stat =
    self.memory_tracking[fsdp_mod]``, no check): a KeyError for BART's ``model.shared``, whose weight the
    encoder's and the decoder's ``embed_tokens`` hold and call, so ``shared`` itself never runs. A torch bug (a
    tied module in a group is what FSDP2 asks for: ``fully_shard([module_a, module_b])``). The group's other
    modules wrap the same methods, so its snapshots and peak are taken all the same; what FSDP2 does is untouched
    (``shared`` stays in the group: left out, FSDP2 refuses its weight in the root group as a shared param)."""

    def __init__(self, mod: nn.Module, optm, never_called: set[nn.Module]) -> None:
        super().__init__(mod, optm)
        self.never_called = never_called

    def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
        return orig if fsdp_mod in self.never_called else super()._fsdp_param_group_pre_backward(fsdp_mod, orig)

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
        return orig if fsdp_mod in self.never_called else super()._fsdp_param_group_post_backward(fsdp_mod, orig)


def shard(model: nn.Module, plan: dict, world: int, precision: str) -> None:
    modules = dict(model.named_modules())
    for name in plan.get("activation_checkpointing", []):
        checkpoint_forward(modules[name], selective=False)
    for name in plan.get("selective_checkpointing", {}):
        checkpoint_forward(modules[name], selective=True)
    mesh = init_device_mesh("cpu", (world,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=True)
    groups = sorted(plan["groups"], key=lambda g: -min(m.count(".") + bool(m) for m in g["modules"]))  # root last
    for g in groups:
        targets = [modules[m] for m in g["modules"]]
        mp = fp32 if g.get("param_dtype") == "fp32" else bf16 if precision == "bf16-mixed" else MixedPrecisionPolicy()
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, mp_policy=mp,
                    reshard_after_forward=g["reshard_after_forward"])
    if not any(g["modules"] == [""] for g in plan["groups"]):
        fully_shard(model, mesh=mesh, mp_policy=bf16 if precision == "bf16-mixed" else MixedPrecisionPolicy())


def step(model: nn.Module, inputs, loss_fn, optimizer) -> None:
    """The output is dropped once the loss is made, as a training loop's ``loss = loss_fn(model(x))`` does: only
    what autograd saved of it stays through backward."""
    loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("plan")
    parser.add_argument("world", type=int)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    torch.manual_seed(0)
    built = factory(args.model)()
    model, inputs, loss_fn = built if len(built) == 3 else (*built, lambda out: out.float().pow(2).mean())
    called = called_modules(model, inputs)
    shard(model, plan, args.world, plan.get("precision", args.precision))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, inputs, loss_fn, optimizer)  # creates the optimizer state
    tracker = Tracker(model, optimizer, {m for m in model.modules() if m not in called})
    tracker.track_inputs(tuple(inputs.values()) if isinstance(inputs, dict) else tuple(inputs))
    with tracker:
        step(model, inputs, loss_fn, optimizer)
    peak = tracker.get_tracker_snapshot("peak")
    snap = peak[torch.device("cpu")]
    print(json.dumps({"peak": snap["Total"], "by_kind": {str(k.value if hasattr(k, "value") else k): v
                                                          for k, v in snap.items()}}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
