"""Step simulator: invariants and hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import policy, traced

from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import NO_OVERHEAD, Link, Overhead, parse_cluster, slowest_rank_factor
from fsdp_planner.hardware.collectives import alpha_beta
from fsdp_planner.hardware.cost import collective_time
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.sim.optimizer_step import GRAD_CLIP_BYTES, STEP_BYTES
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.sim.timeline import Stream

POLICIES = ["module", "size", "titan", "order"]


@pytest.mark.parametrize("spec", ["seed-net", "toy-llama", "toy-gpt2-tied"])
def test_counts_and_bytes_equal_trace_metrics_and_memory_is_sane(spec):
    tr = traced(spec)
    cluster = parse_cluster("h100:16")
    for name in POLICIES:
        plan = policy(name, min_nonwrapped_numel=2000).plan(tr)
        m = plan_metrics(tr, plan)
        r = simulate(tr, plan, cluster, SimOptions.named("fp32"))
        assert (r.all_gathers, r.reduce_scatters) == (m.all_gathers, m.reduce_scatters)
        assert r.reduce_scatter_bytes == plan_metrics(tr, plan, 16).reduce_scatter_bytes  # fp32: the traced dtype
        assert all(v >= 0 for v in r.memory_at_peak.values())
        assert r.peak_memory >= r.memory_at_peak["params"] + r.memory_at_peak["optimizer_state"]
        assert r.lower_bound <= r.step_time + 1e-12
        assert r.step_time >= r.compute_time


def test_free_network_gives_step_time_equal_to_compute():
    tr = traced("toy-llama")
    fast = Link(bus_bandwidth=1e30, base_latency=0.0, hop_latency=0.0)
    h100 = parse_cluster("h100:8")
    cluster = dataclasses.replace(h100, intra=fast, inter=fast, overhead=NO_OVERHEAD,
                                  gpu=dataclasses.replace(h100.gpu, hbm_bandwidth=1e30))
    for name in POLICIES:
        r = simulate(tr, policy(name).plan(tr), cluster)
        assert r.step_time == pytest.approx(r.compute_time, rel=1e-9)
        assert r.exposed_comm == pytest.approx(0.0, abs=1e-15)


def test_one_group_by_hand(seed_trace):
    """Root only: gather everything before the first op (copy-in), copy it out on the compute stream, compute,
    copy the grads into the reduce-scatter's input, reduce-scatter after the last op, then AdamW's foreach step
    over the rank's shard (sim/optimizer_step.py). The host is free here."""
    h100 = parse_cluster("h100:8")
    copy = 500e9
    cluster = dataclasses.replace(h100, overhead=Overhead(0.0, 0.0, copy))
    plan = make_plan(seed_trace, [])
    r = simulate(seed_trace, plan, cluster, SimOptions.named("fp32"))
    world = 8
    gathered = sum(p.padded_numel(world) * 4 for p in seed_trace.params)
    ag = collective_time(cluster, "all_gather", gathered) + gathered / world / copy + gathered / copy
    rs = gathered / copy + collective_time(cluster, "reduce_scatter", gathered)  # FSDP2 pads its input too
    shard = sum(p.padded_numel(world) for p in seed_trace.params if p.requires_grad) / world
    optimizer = shard * (STEP_BYTES["adamw"] + GRAD_CLIP_BYTES) / (h100.gpu.hbm_bandwidth
                                                                   * h100.compute.memory_efficiency)
    optimizer *= slowest_rank_factor(h100.compute.variation, world)
    assert r.gpu_optimizer_time == pytest.approx(optimizer, rel=1e-9)
    assert r.step_time == pytest.approx(ag + r.compute_time + rs + optimizer, rel=1e-9)
    assert r.memory_at_peak["unsharded_params"] == gathered


def test_host_overhead_by_hand(seed_trace):
    """A host far slower than the GPU is the step: the root's four hooks (pre/post-forward, pre/post-backward)
    and every op's launch, the reduce-scatter issued by the last hook, on an ideal network and GPU."""
    fast = Link(bus_bandwidth=1e30, base_latency=0.0, hop_latency=0.0)
    h100 = parse_cluster("h100:8")
    gpu = dataclasses.replace(h100.gpu, hbm_bandwidth=1e30, peak_bf16_flops=1e30, peak_fp32_flops=1e30)
    hook, op = 1e-3, 1e-6
    cluster = dataclasses.replace(h100, intra=fast, inter=fast, gpu=gpu, overhead=Overhead(hook, op, 1e30))
    r = simulate(seed_trace, make_plan(seed_trace, []), cluster)
    assert r.compute_time < 1e-9
    # the last hook (the root's post-backward, in the final callback) runs once every op was launched
    ops = sum(e.is_op for e in seed_trace.events)
    assert r.step_time == pytest.approx(4 * hook + ops * op, rel=1e-9)
    free = simulate(seed_trace, make_plan(seed_trace, []), dataclasses.replace(cluster, overhead=NO_OVERHEAD))
    assert free.step_time < 1e-6


def test_reshard_trades_memory_for_collectives():
    tr = traced("toy-llama")
    groups = [["tok_embeddings"], *[[f"layers.{i}"] for i in range(4)], ["norm", "output"]]
    cluster = parse_cluster("h100:64")
    keep = simulate(tr, make_plan(tr, groups, [False] * 6), cluster)
    free = simulate(tr, make_plan(tr, groups, [True] * 6), cluster)
    assert free.all_gathers > keep.all_gathers
    assert free.memory_at_peak["unsharded_params"] < keep.memory_at_peak["unsharded_params"]


def test_tied_group_costs_two_forward_holds():
    tr = traced("toy-gpt2-tied")
    plan = policy("titan").plan(tr)
    r = simulate(tr, plan, parse_cluster("h100:8"))
    tied = [e for e in r.timeline if e.stream is Stream.ALL_GATHER and e.name.startswith("wte")]
    assert len(tied) == 1  # kept unsharded after forward: gathered once per step


def test_llama3_70b_on_1024_gpus_is_communication_bound_for_every_classic_policy():
    tr = traced("llama3-70b")
    cluster = parse_cluster("h100:1024")
    reports = [simulate(tr, policy(n).plan(tr), cluster) for n in POLICIES]
    assert all(r.step_time > r.compute_time for r in reports)


@pytest.mark.parametrize("spec", ["toy-llama", "toy-gpt2-tied", "t5-3b"])
def test_fast_path_equals_full_timeline(spec):
    tr = traced(spec)
    cluster = parse_cluster("h100:64")
    for name in POLICIES:
        plan = policy(name).plan(tr)
        full = simulate(tr, plan, cluster)
        fast = simulate(tr, plan, cluster, timeline=False)
        assert fast.step_time == pytest.approx(full.step_time, rel=1e-12)
        assert fast.peak_memory == full.peak_memory and not fast.timeline


def test_communication_streams_share_the_links():
    """All-gather and reduce-scatter bytes cross the same links. On a network-bound cluster (free compute, no
    latency) the step is exactly every collective's data back to back; with independent streams it would be
    shorter wherever a reduce-scatter overlaps an all-gather."""
    tr = traced("toy-llama")
    h100 = parse_cluster("h100:8")
    slow = Link(bus_bandwidth=1e6, base_latency=0.0, hop_latency=0.0, half_bw_bytes=0)
    fast_gpu = dataclasses.replace(h100.gpu, hbm_bandwidth=1e30, peak_bf16_flops=1e30, peak_fp32_flops=1e30)
    cluster = dataclasses.replace(h100, intra=slow, inter=slow, gpu=fast_gpu, overhead=NO_OVERHEAD)
    for name in POLICIES:
        r = simulate(tr, policy(name).plan(tr), cluster)
        data = sum(7 / 8 * b / alpha_beta(cluster, k)[1]
                   for k, b in (("all_gather", r.all_gather_bytes), ("reduce_scatter", r.reduce_scatter_bytes)))
        assert r.step_time == pytest.approx(data, rel=1e-9)
        assert r.lower_bound <= data * (1 + 1e-9)


def test_all_gather_buffer_is_counted_at_copy_out(seed_trace):
    cluster = parse_cluster("h100:8")
    plan = make_plan(seed_trace, [])
    r = simulate(seed_trace, plan, cluster, SimOptions.named("fp32"))
    static = r.memory_at_peak["params"] + r.memory_at_peak["grads"] + r.memory_at_peak["optimizer_state"]
    assert r.peak_memory >= static + 2 * seed_trace.nbytes  # unsharded params + the all-gather output


def reference_step_time(tr, plan, ctx):
    """The step clock advanced op by op, every op waiting for every group it reads and for its launch (what the
    simulator's sparse visit must reproduce)."""
    from fsdp_planner.sim.streams import HostClock, Streams

    sched = build_schedule(tr, plan, ctx.world)
    group_params = ctx.sizing.group_params(plan)
    gather = [g.gather_bytes for g in ctx.sizing.groups(plan)]
    group_of = {p: g for g, ps in enumerate(group_params) for p in ps}
    host = HostClock(ctx, sched.hooks, [len(ps) for ps in group_params], {})
    streams = Streams(ctx, plan, gather, timeline=False, host=host)
    issued = {}
    for c in sched.collectives:
        issued.setdefault(c.event, []).append(c)
    for idx in range(len(tr.events) + 1):  # one op a stretch: its own launch lead, then the ops before it
        streams.compute_until(idx, float(host.lead[idx - 1]) + ctx.cum[idx] if idx else None)
        for c in issued.get(idx, ()):
            streams.issue(c)
        if idx < len(tr.events):
            streams.wait_for([group_of[p] for p in tr.events[idx].params])
    return max(streams.t, *streams.free.values()) + ctx.optimizer_seconds()  # then the optimizer step


@pytest.mark.parametrize("spec", ["seed-net", "toy-gpt2-tied", "t5-3b"])
def test_sparse_simulation_equals_op_by_op(spec):
    tr = traced(spec)
    for cluster in ("h100:8", "h100:512"):
        ctx = SimContext(tr, parse_cluster(cluster))
        for name in POLICIES:
            plan = policy(name).plan(tr)
            assert simulate(tr, plan, context=ctx).step_time == pytest.approx(reference_step_time(tr, plan, ctx),
                                                                                rel=1e-12)
