"""The caching allocator's best-fit packing of the loss region's blocks (``sim/allocator.py``)."""

from __future__ import annotations

from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.sim.allocator import BestFitSegment, loss_region_slack
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.sim.tracing import trace


def test_best_fit_takes_the_smallest_hole_and_grows_the_segment_when_none_fits() -> None:
    """torchtitan's loss by hand, in units of the bf16 logits: logits (1), their fp32 copy (2), log-softmax (2);
    the first two freed together leave a hole of 3; the loss's fp32 grad (2) takes it and leaves 1, so
    log-softmax's backward output (2) grows the segment: 7 reserved for 6 live."""
    seg = BestFitSegment()
    for key, size in enumerate((1, 2, 2)):
        seg.allocate(key, size)
    seg.free(0)
    seg.free(1)
    seg.allocate(3, 2)
    assert (seg.top, seg.live) == (5, 4)
    seg.allocate(4, 2)
    assert (seg.top, seg.live) == (7, 6)
    seg.free(2)
    seg.free(3)  # merges with the 1 left and log-softmax's 2 into one hole of 5 at the start
    seg.allocate(5, 5)
    assert (seg.top, seg.live) == (7, 7)
    seg.free(4)
    seg.allocate(6, 1)  # the free tail (2) is the best fit, not an extension
    assert seg.top == 7


def test_an_lm_loss_reserves_its_bf16_logits_beyond_its_live_peak() -> None:
    """On a Llama in bf16 the replay of the traced loss region reserves, at its largest, the live peak plus one
    bf16 logits (the hole the walk above leaves), and simulate's reserved memory holds that too."""
    batch, seq = 2, 64
    lm = load_model(ModelSpec("toy-llama", batch, seq), meta=True)
    tr = trace(lm.model, lm.example_inputs, lm.loss_fn, precision="bf16-mixed")
    logits = batch * seq * 256 * 2  # toy-llama's vocab, bf16
    region = [i for i, inside in enumerate(tr.index.loss_region) if inside]
    live = max(tr.events[i].live for i in region)
    assert 6 * logits <= live < 6 * logits + 4096  # log-softmax, the fp32 grad and its own (+ scalars)
    slack = loss_region_slack(tr, 1.0)
    extent = max(tr.events[i].live + slack[i] for i in region)
    assert extent == live + logits, (extent, live, logits)
    plan = make_plan(tr, [[m] for m in tr.index.owning_modules if m])
    options = SimOptions.named("bf16-mixed", "adamw")
    report = simulate(tr, plan, parse_cluster("h100:8"), options, timeline=False)
    assert report.reserved_memory >= report.peak_memory + logits
