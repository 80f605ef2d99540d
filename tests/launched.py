"""A training script that ``tests/test_export.py`` launches in each framework as its users launch it, on 2 CPU
gloo ranks, with an export (``fsdp-planner export --format accelerate|lightning``) left as it was written:

    accelerate launch --config_file plan.yaml --num_processes 2 tests/launched.py accelerate plan.py
    python tests/launched.py lightning plan.py      (Lightning's Trainer starts the second process)

It imports torch and the framework only, never fsdp-planner: the model is the factory the export's MODEL names (a
file relative to the export). It shards the model with the export, trains two SGD steps and prints one line per
rank, ``LAUNCHED {json}``: what the framework sees (processes, this one's index, its distributed type) and what
FSDP2 made of the model (its FSDP modules, each param's type and local numel).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(hook: ModuleType) -> tuple[nn.Module, tuple[Any, ...]]:
    """The model and example inputs of the factory ``hook.MODEL`` names, relative to the export's directory."""
    file, _, function = hook.MODEL.rpartition(":")
    model, inputs = getattr(load(Path(hook.__file__).parent / file, "launched_model"), function)()[:2]
    return model, inputs


def report(model: nn.Module, processes: int, index: int, kind: str) -> None:
    fsdp = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    params = {n: [type(p).__name__, p.to_local().numel() if hasattr(p, "to_local") else p.numel()]
              for n, p in model.named_parameters()}
    line = "LAUNCHED " + json.dumps({"processes": processes, "index": index, "distributed_type": kind,
                                     "fsdp": fsdp, "params": params}) + "\n"
    for rank in range(processes):  # one rank at a time: the ranks share one stdout pipe, and lines would interleave
        if rank == index:
            sys.stdout.write(line)
            sys.stdout.flush()
        dist.barrier()


def accelerate(hook: ModuleType) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, inputs = build(hook)
    model = hook.shard(accelerator, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = hook.prepare(accelerator, model, optimizer)
    for _ in range(2):
        accelerator.backward(model(*inputs).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    report(model, accelerator.num_processes, accelerator.process_index, accelerator.distributed_type.value)
    del model, optimizer  # FSDP2's modules hold the process group: gone before it is destroyed
    gc.collect()
    accelerator.end_training()


def lightning(hook: ModuleType) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.inputs = build(hook)

        def configure_model(self) -> None:
            hook.configure_model(self.model, self.device_mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(*self.inputs).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=hook.strategy(devices=2), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1))
    report(module.model, trainer.world_size, trainer.global_rank, type(trainer.strategy).__name__)
    del trainer, module
    gc.collect()
    if torch.distributed.is_initialized():  # Lightning leaves it initialized
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    framework, export = sys.argv[1:3]
    {"accelerate": accelerate, "lightning": lightning}[framework](load(Path(export).resolve(), "launched_export"))
