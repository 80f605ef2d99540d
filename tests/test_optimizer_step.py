"""The GPU optimizer step (``sim/optimizer_step.py``): its bytes per param counted in torch's own foreach steps,
its shard (HSDP's replicate x FSDP's), nothing on the GPU under offload, once a step of micro-batches."""

from __future__ import annotations

import pytest
import torch
from conftest import traced
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.optimizer_step import GRAD_CLIP_BYTES, STEP_BYTES
from fsdp_planner.sim.options import OPTIMIZERS, SimOptions
from fsdp_planner.sim.simulate import simulate

NUMEL = 4096  # per param; the optimizer's scalars (its step counts, the norms) are 0-dim and not counted

# each optimizer the simulator names, as torch builds it with its defaults and the foreach implementation
TORCH_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, foreach=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
    "adam": lambda params: torch.optim.Adam(params, foreach=True),
    "adamw": lambda params: torch.optim.AdamW(params, foreach=True),
}


class ForeachBytes(TorchDispatchMode):
    """Bytes the ``_foreach_*`` kernels read (each distinct input tensor once: one passed twice, as addcmul_'s
    grads, is one read) and write (an in-place op's self, an out-of-place op's outputs), over tensors of at least
    ``NUMEL`` elements."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith("_foreach_"):
            big = {id(t): t for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and t.numel() >= NUMEL}
            self.nbytes += sum(t.numel() * t.element_size() for t in big.values())
            written = args[0] if func._schema.name.endswith("_") else out
            self.nbytes += sum(t.numel() * t.element_size() for t in tree_leaves(written)
                               if isinstance(t, torch.Tensor) and t.numel() >= NUMEL)
        return out


def _counted_step(name: str) -> tuple[float, float]:
    """Bytes per fp32 element of torch's clip_grad_norm_ and of one steady-state step of ``name`` (the first step
    makes the state)."""
    params = [torch.nn.Parameter(torch.randn(NUMEL)) for _ in range(3)]
    opt = TORCH_OPTIMIZERS[name](params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(NUMEL)
        clip, step = ForeachBytes(), ForeachBytes()
        with clip:
            torch.nn.utils.clip_grad_norm_(params, max_norm=1e-3, foreach=True)
        with step:
            opt.step()
    elements = 3 * NUMEL
    return clip.nbytes / elements, step.nbytes / elements


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_bytes_per_param_are_torchs_foreach_steps(name: str) -> None:
    """The constants are what torch's own foreach kernels move (torch/optim/{sgd,adam}.py, clip_grad.py)."""
    clip, step = _counted_step(name)
    assert OPTIMIZERS[name].step_bytes == STEP_BYTES[name] == step
    assert clip == GRAD_CLIP_BYTES


def _titan(trace, mesh: Mesh | None = None):
    return make_policy(PolicyRequest(PolicyName.TITAN, mesh=mesh)).plan(trace, "toy-llama")


def test_hsdp_steps_replicate_times_fsdps_optimizer() -> None:
    """At equal world, HSDP 2x4 shards the optimizer over 4 ranks, FSDP over 8: twice its work per rank."""
    tr, cluster = traced("toy-llama"), parse_cluster("h100:8")
    fsdp = simulate(tr, _titan(tr), cluster, timeline=False)
    hsdp = simulate(tr, _titan(tr, Mesh(2, 4)), cluster, timeline=False)
    assert fsdp.gpu_optimizer_time > 0 and fsdp.cpu_optimizer_time == 0
    assert hsdp.gpu_optimizer_time == pytest.approx(2 * fsdp.gpu_optimizer_time, rel=1e-3)
    ctx = SimContext(tr, cluster, mesh=Mesh(2, 4))
    assert ctx.optimizer_seconds() == hsdp.gpu_optimizer_time
    assert ctx.lower_bound >= ctx.compute_total + hsdp.gpu_optimizer_time  # serial after backward


def test_offload_leaves_the_gpu_no_optimizer_step() -> None:
    tr, cluster = traced("toy-llama"), parse_cluster("h100:8")
    off = simulate(tr, _titan(tr).replace(offload=True), cluster, timeline=False)
    assert off.gpu_optimizer_time == 0 and off.cpu_optimizer_time > 0
    assert "gpu_optimizer_time" not in off.summary() and "cpu_optimizer_time" in off.summary()


def test_optimizer_step_is_once_per_step_of_micro_batches() -> None:
    """Three micro-batches, AdamW against SGD: the steps differ by one optimizer step's difference, not three."""
    tr, cluster = traced("toy-llama"), parse_cluster("h100:8")
    plan = _titan(tr)
    adamw, sgd = (simulate(tr, plan, cluster, SimOptions.named(optimizer=o, micro_batches=3), timeline=False)
                  for o in ("adamw", "sgd"))
    one = simulate(tr, plan, cluster, SimOptions.named(optimizer="adamw"), timeline=False)
    assert adamw.gpu_optimizer_time == one.gpu_optimizer_time
    assert adamw.gpu_optimizer_time / sgd.gpu_optimizer_time == pytest.approx(
        (STEP_BYTES["adamw"] + GRAD_CLIP_BYTES) / (STEP_BYTES["sgd"] + GRAD_CLIP_BYTES))
    assert adamw.step_time - sgd.step_time == pytest.approx(adamw.gpu_optimizer_time - sgd.gpu_optimizer_time)
