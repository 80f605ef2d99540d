"""Verify a plan on a real multi-process run: same parameters as unsharded training, predicted collectives.

``run_verify`` (the CLI side) traces the model, predicts the step's collectives, writes a job file and launches
``torchrun --standalone --nproc_per_node N -m fsdp_planner.verify JOB``. Every rank builds the same model, keeps
an unsharded reference copy, applies the plan with FSDP2 and trains K steps on its own micro-batch while the
reference trains on all ranks' micro-batches (loss divided by the world size, as FSDP averages gradients).
Collectives are counted by wrapping the ``torch.distributed`` functions FSDP2 calls.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from fsdp_planner.errors import PlannerError
from fsdp_planner.plan import Plan
from fsdp_planner.schedule import ALL_GATHER, REDUCE_SCATTER, build_schedule
from fsdp_planner.trace import Trace

FP32_TOLERANCE = 1e-5


@dataclass
class VerifyResult:
    world_size: int
    steps: int
    backend: str
    predicted: dict[str, int]
    counted: list[dict[str, int]]  # per step
    counted_bytes: list[dict[str, int]]
    predicted_bytes: dict[str, int]
    losses: list[float]
    reference_losses: list[float]
    max_abs_diff: float
    tolerance: float = FP32_TOLERANCE
    notes: list[str] = field(default_factory=list)

    @property
    def params_match(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    @property
    def counts_match(self) -> bool:
        return all(c == self.predicted for c in self.counted)

    @property
    def ok(self) -> bool:
        return self.params_match and self.counts_match


def predict_collectives(trace: Trace, plan: Plan, world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """Per-step all-gather/reduce-scatter counts, and their bytes as FSDP2 sends them (dim 0 padded)."""
    sched = build_schedule(trace, plan, world_size)
    counts = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
    nbytes = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
    padded = [sum(trace.param(p).padded_numel(world_size) * trace.param(p).itemsize for p in g.params)
              for g in plan.groups]
    for c in sched.collectives:
        counts[c.kind] += 1
        if c.kind == ALL_GATHER:
            nbytes[c.kind] += padded[c.group]
        else:
            nbytes[c.kind] += sum(trace.params[p].padded_numel(world_size) * trace.params[p].itemsize
                                  for p in c.params)
    return counts, nbytes


# -- collective counting (worker side) -------------------------------------------------------------
_COUNTED = {
    "all_gather_single": ALL_GATHER,
    "all_gather_into_tensor": ALL_GATHER,
    "reduce_scatter_single": REDUCE_SCATTER,
    "reduce_scatter_tensor": REDUCE_SCATTER,
}


class CollectiveCounter:
    """Counts FSDP2's collectives by wrapping the ``torch.distributed`` functions it calls (outermost only)."""

    def __init__(self) -> None:
        self.counts = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
        self.nbytes = {ALL_GATHER: 0, REDUCE_SCATTER: 0}
        self._orig: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()

    def _wrap(self, name: str, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.counts[kind] += 1
                big = output if kind == ALL_GATHER else input
                self.nbytes[kind] += big.numel() * big.element_size()
            self._local.depth = depth + 1
            try:
                return fn(output, input, *args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper

    def __enter__(self) -> CollectiveCounter:
        import torch.distributed as dist

        for name, kind in _COUNTED.items():
            if hasattr(dist, name):
                self._orig[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, kind, self._orig[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        out = dict(self.counts), dict(self.nbytes)
        self.counts = dict.fromkeys(self.counts, 0)
        self.nbytes = dict.fromkeys(self.nbytes, 0)
        return out


def _batch(spec: str, step: int, rank: int, base_seed: int) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    """Micro-batch for (step, rank): the factory's example inputs and loss, drawn under a fixed seed."""
    from fsdp_planner.models import load_model
    from fsdp_planner.trace import default_loss

    lm = load_model(spec, meta=False, seed=base_seed + 1000 * (step + 1) + rank)
    return lm.example_inputs, lm.loss_fn or default_loss


def _call(model: torch.nn.Module, inputs: Any, device: torch.device) -> Any:
    from torch.utils._pytree import tree_map_only

    inputs = tree_map_only(torch.Tensor, lambda t: t.to(device), inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def worker(job_path: str) -> None:
    """One rank of a verify job (run under torchrun)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_planner.apply import apply_plan
    from fsdp_planner.models import load_model

    job = json.loads(Path(job_path).read_text())
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        lm = load_model(job["model"], meta=False, seed=job["seed"])
        model = lm.model.to(device)
        reference = copy.deepcopy(model)
        plan = Plan.from_json(job["plan"])
        apply_plan(model, plan, mesh=init_device_mesh(device.type, (world,)))
        lr = job["lr"]
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
        counted, counted_bytes, losses, ref_losses = [], [], [], []
        counter = CollectiveCounter()
        for step in range(job["steps"]):
            batches = [_batch(job["model"], step, r, job["seed"]) for r in range(world)]
            inputs, loss_fn = batches[rank]
            with counter:
                torch.manual_seed(job["seed"] + 7 * step + rank)
                loss = loss_fn(_call(model, inputs, device))
                loss.backward()
            c, b = counter.take()
            counted.append(c)
            counted_bytes.append(b)
            opt.step()
            opt.zero_grad()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            losses.append(mean_loss.item() / world)
            ref_total = 0.0
            for r, (r_inputs, r_loss_fn) in enumerate(batches):
                torch.manual_seed(job["seed"] + 7 * step + r)
                r_loss = r_loss_fn(_call(reference, r_inputs, device)) / world
                r_loss.backward()
                ref_total += r_loss.item()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_total)
        ref_params = dict(reference.named_parameters())
        max_diff = 0.0
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            max_diff = max(max_diff, (full.detach() - ref_params[name].detach()).abs().max().item())
        if rank == 0:
            out = {"counted": counted, "counted_bytes": counted_bytes, "losses": losses,
                   "reference_losses": ref_losses, "max_abs_diff": max_diff, "backend": backend, "world": world}
            Path(job["result"]).write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_verify(spec: str, trace: Trace, plan: Plan, nproc: int, steps: int = 3, lr: float = 0.05,
               seed: int = 0, timeout: float = 600.0) -> VerifyResult:
    """Launch the torchrun job and compare its results with the plan's predictions."""
    from fsdp_planner.models import BUILTINS

    if nproc < 1:
        raise PlannerError("--nproc must be at least 1")
    if steps < 1:
        raise PlannerError("--steps must be at least 1")
    if spec in BUILTINS and not BUILTINS[spec].trainable:
        raise PlannerError(f"'{spec}' is for planning only (too large to train here); verify a trainable model")
    if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
        path, _, fn = spec.rpartition(":")
        spec = f"{Path(path).resolve()}:{fn}"
    predicted, predicted_bytes = predict_collectives(trace, plan, nproc)
    with tempfile.TemporaryDirectory(prefix="fsdp-planner-verify-") as tmp:
        job_path = Path(tmp) / "job.json"
        result_path = Path(tmp) / "result.json"
        job_path.write_text(json.dumps({"model": spec, "plan": plan.to_json(), "steps": steps, "lr": lr,
                                        "seed": seed, "result": str(result_path)}))
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "fsdp_planner.verify", str(job_path)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise PlannerError(f"verify job did not finish within {timeout:.0f} s") from e
        if not result_path.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise PlannerError(f"verify job failed (exit {proc.returncode}):\n{tail}")
        data = json.loads(result_path.read_text())
    notes = []
    if proc.returncode != 0:
        notes.append(f"torchrun exited {proc.returncode} after the results were written (exit noise ignored)")
    return VerifyResult(
        world_size=data["world"], steps=steps, backend=data["backend"], predicted=predicted,
        counted=data["counted"], counted_bytes=data["counted_bytes"], predicted_bytes=predicted_bytes,
        losses=data["losses"], reference_losses=data["reference_losses"], max_abs_diff=data["max_abs_diff"],
        notes=notes,
    )


def result_dict(result: VerifyResult) -> dict[str, Any]:
    d = asdict(result)
    d.update(params_match=result.params_match, counts_match=result.counts_match, ok=result.ok)
    return d


if __name__ == "__main__":
    worker(sys.argv[1])
