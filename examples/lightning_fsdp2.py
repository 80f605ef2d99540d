"""Lightning with a plan: ``fsdp-planner export plan.json --format lightning --out pl_plan.py``, then
``python examples/lightning_fsdp2.py pl_plan.py`` (Lightning launches its own processes). The export's
``strategy(devices)`` is the Trainer's ``ModelParallelStrategy`` (``tensor_parallel_size=TP_DEGREE`` for a plan with
tensor parallelism), and its ``configure_model(module, device_mesh)`` applies the plan to the module it is given, on
the strategy's mesh; with TP the loss's backward runs under the export's ``loss_context()``."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import sys

import lightning as L
import torch

from fsdp_planner.models import load_model
from fsdp_planner.trace import run_model


def main(plan_code: str, model_name: str = "toy-llama", devices: int = 2) -> None:
    train(plan_code, model_name, int(devices))
    # FSDP2's modules and DTensors hold the process group: every one gone (the trainer and module with the
    # training's frame, their reference cycles collected) before it is destroyed, or gloo may abort the exiting rank
    gc.collect()
    if torch.distributed.is_initialized():  # Lightning leaves it initialized
        torch.distributed.destroy_process_group()


def train(plan_code: str, model_name: str, devices: int) -> None:
    """A LightningModule whose ``configure_model`` applies the export's plan, fitted three steps."""
    spec = importlib.util.spec_from_file_location("exported_plan", plan_code)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    loss_context = getattr(plan, "loss_context", contextlib.nullcontext)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = load_model(model_name, meta=False, seed=0).model

        def configure_model(self) -> None:
            plan.configure_model(self.model, self.device_mesh)  # the plan's fully_shard calls, root last

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            lm = load_model(model_name, meta=False, seed=100 + batch_idx)
            with loss_context():
                return lm.loss_fn(run_model(self.model, lm.example_inputs))

        def backward(self, loss: torch.Tensor, *args: object, **kwargs: object) -> None:
            with loss_context():  # loss parallel: the loss's backward too
                loss.backward(*args, **kwargs)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = torch.utils.data.DataLoader(torch.zeros(3, 1), batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=plan.strategy(devices=devices),
                        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module = Module()
    trainer.fit(module, data)


if __name__ == "__main__":
    main(*sys.argv[1:])
