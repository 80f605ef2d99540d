"""LoRA (frozen base weights, trainable adapters): what the planner charges for frozen params, term by term,
against real FSDP2 on the fake process group, and a real 2-rank run."""

from __future__ import annotations

import pytest
import torch
from conftest import run_main

pytest.importorskip("peft")

from fsdp_planner.apply.fully_shard import apply_plan, device_mesh
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners.auto import AutoPolicy, Target
from fsdp_planner.planners.classic import TorchtitanPolicy
from fsdp_planner.runtime.fake_world import run_fake_world
from fsdp_planner.sim.memory import MemoryModel
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record

MODEL = "toy-llama-lora"
WORLD = 8


def _traced(options: SimOptions):
    lm = load_model(MODEL)
    return record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=options.precision.trace_dtype)


def test_only_adapters_are_trainable() -> None:
    model = load_model(MODEL).model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) * 10 < \
        sum(p.numel() for p in model.parameters())


def _real_state_bytes(world: int) -> dict[str, int]:
    """Per-rank sharded params, sharded grads and AdamW state after one step of real FSDP2 on ``world`` fake
    ranks (fp32, grads kept: zero_grad(set_to_none=False))."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_planner.models.lora import toy_llama_lora

    options = SimOptions.named("fp32")
    plan = TorchtitanPolicy("TransformerBlock").plan(_traced(options))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = device_mesh(plan, "cpu", world)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model, inputs, loss_fn = toy_llama_lora()
            apply_plan(model, plan, mesh=mesh)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            loss_fn(model(*inputs)).backward()
            opt.step()

            def local(t: torch.Tensor) -> int:
                t = t.to_local() if hasattr(t, "to_local") else t
                return t.numel() * t.element_size()

            return {"params": sum(local(p) for p in model.parameters()),
                    "grads": sum(local(p.grad) for p in model.parameters() if p.grad is not None),
                    "optimizer_state": sum(local(t) for s in opt.state.values() for t in s.values() if t.dim())}
    finally:
        dist.destroy_process_group()


@pytest.mark.integration  # about a second: the full suite runs it, the fast subset does not
def test_frozen_params_sharded_but_no_grads_or_optimizer_state() -> None:
    """Each static term against real FSDP2: every param sharded, grads and AdamW state for adapters only."""
    options = SimOptions.named("fp32", optimizer="adamw", zero_grad="zeros")
    model = MemoryModel(_traced(options), WORLD, options.precision, options.optimizer, options.zero_grad)
    real = _real_state_bytes(WORLD)
    assert model.static.params == real["params"]
    assert model.static.grads == real["grads"]
    assert model.static.optimizer_state == real["optimizer_state"]
    assert real["grads"] < real["params"] / 10  # the test means something: the frozen base is most of the model


@pytest.mark.integration  # seconds of real FSDP2 or tracing: the full suite runs it
@pytest.mark.parametrize("policy", ["titan", "auto"])
def test_collectives_and_peak_match_real_fsdp2(policy: str) -> None:
    """Reduce-scatters only for groups holding adapters, of the adapters' bytes; all-gathers of everything."""
    options = SimOptions.named("bf16-mixed")
    tr = _traced(options)
    cluster = parse_cluster(f"h100:{WORLD}")
    plan = TorchtitanPolicy("TransformerBlock").plan(tr) if policy == "titan" else AutoPolicy(cluster).plan(tr)
    predicted = simulate(tr, plan, cluster, options, timeline=False)
    measured = run_fake_world(MODEL, plan, WORLD, options.precision)
    assert measured.counts == {"all_gather": predicted.all_gathers, "reduce_scatter": predicted.reduce_scatters,
                               "all_reduce": 0}
    assert measured.nbytes["all_gather"] == predicted.all_gather_bytes
    assert measured.nbytes["reduce_scatter"] == predicted.reduce_scatter_bytes
    trainable = sum(p.numel for p in tr.params if p.requires_grad)
    assert predicted.reduce_scatter_bytes < 2 * trainable * 4 * predicted.reduce_scatters  # adapters only
    assert predicted.peak_memory == pytest.approx(measured.peak_memory, rel=0.05)


def test_fsdp1_target_keeps_requires_grad_uniform_per_unit() -> None:
    """FSDP1's flat parameters need one requires_grad per unit: adapters and frozen weights never share one."""
    tr = _traced(SimOptions())
    plan = AutoPolicy(parse_cluster(f"h100:{WORLD}"), target=Target.FSDP1).plan(tr)
    for g in plan.groups:
        kinds = {tr.param(p).requires_grad for p in g.params}
        assert len(kinds) <= 1, (g.modules, kinds)


@pytest.mark.integration
def test_verify_lora_auto_on_two_gloo_ranks() -> None:
    out = run_main("verify", MODEL, "--policy", "auto", "--nproc", "2", "--time-steps", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout
