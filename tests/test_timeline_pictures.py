"""The step pictures: the data behind them (lanes, exposed communication, the memory curve) and the PNG and HTML
files drawn from it."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest
from conftest import policy, traced
from test_host_engine import host_cluster

from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners import PolicyName, PolicyRequest, make_policy
from fsdp_planner.report.step_view import Bar, BarKind, StepView, merge_thin, step_view, thin_curve
from fsdp_planner.report.timeline_html import render_html, write_html
from fsdp_planner.report.timeline_png import CAPACITY_IN_VIEW, DPI, figure_size, memory_scale, write_png

CLUSTER = parse_cluster("h100:16")


def _views() -> list[StepView]:
    """Plans that exercise every lane and bar kind: flat, checkpointed, HSDP."""
    tr = traced("toy-llama")
    plans = [policy(name, min_nonwrapped_numel=20000).plan(tr) for name in ("order", "size")]
    plans.append(make_policy(PolicyRequest(PolicyName.TITAN, checkpointing=ACMode.FULL)).plan(tr, "toy-llama"))
    plans.append(make_policy(PolicyRequest(PolicyName.TITAN, mesh=Mesh(2, 8))).plan(tr, "toy-llama"))
    seed = traced("seed-net")
    return [*(step_view(tr, p, CLUSTER) for p in plans),
            step_view(seed, policy("size", min_nonwrapped_numel=2000).plan(seed), CLUSTER)]


@pytest.fixture(scope="module")
def views() -> list[StepView]:
    return _views()


def test_memory_curve_peaks_at_the_reported_peak(views):
    for v in views:
        assert v.memory_bytes.max() == pytest.approx(v.report.peak_memory, abs=2), v.label
        times, levels = thin_curve(v.memory_times, v.memory_bytes, 50)
        assert len(times) <= 51 and levels.max() == v.memory_bytes.max()  # thinning keeps the peak
        assert levels.min() >= v.memory_bytes.min()


def test_memory_curve_spans_the_step_in_order(views):
    for v in views:
        t = v.memory_times
        assert t[0] == 0.0 and t[-1] == pytest.approx(v.report.step_time)
        assert np.all(np.diff(t) >= -1e-15), v.label
        # the step starts with what is allocated all step (sharded params, optimizer state) and nothing gathered
        static = v.report.memory_at_peak["params"] + v.report.memory_at_peak["optimizer_state"]
        assert v.memory_bytes[0] >= static


def test_exposed_bars_are_the_step_minus_compute(views):
    for v in views:
        compute = v.lanes[0].bars
        assert sum(b.seconds for b in v.exposed) == pytest.approx(v.report.exposed_comm, rel=1e-9, abs=1e-15)
        assert sum(b.seconds for b in compute) == pytest.approx(v.report.step_time, rel=1e-9)
        assert all(a.end <= b.start + 1e-15 for a, b in itertools.pairwise(compute))  # no overlap
        assert all(b.name.startswith(("all-gather", "reduce-scatter", "all-reduce")) for b in v.exposed)


def test_lanes_hold_every_collective(views):
    for v in views:
        names = [lane.name for lane in v.lanes]
        hsdp = v.report.all_reduces > 0
        assert names == ["compute", "all-gather", "reduce-scatter", *(["all-reduce"] if hsdp else [])]
        assert len(v.lanes[1].bars) == v.report.all_gathers
        assert len(v.lanes[2].bars) == v.report.reduce_scatters
        assert not hsdp or len(v.lanes[3].bars) == v.report.all_reduces
    checkpointed = views[2]
    recompute = [b for b in checkpointed.lanes[0].bars if b.kind is BarKind.RECOMPUTE]
    assert sum(b.seconds for b in recompute) == pytest.approx(checkpointed.report.recompute_time, rel=1e-9)
    assert {b.kind for b in views[0].lanes[0].bars} >= {BarKind.FORWARD, BarKind.BACKWARD, BarKind.EXPOSED}


@pytest.mark.parametrize("ac", ["full", "op"])
def test_tp_collectives_are_drawn_where_compute_waits_for_them(ac):
    """A TP plan's picture draws its collectives on a lane of their own, each inside the compute bar that runs it:
    once in forward or backward, and again inside the recomputation of a checkpointed block (not the outputs an
    op-level policy keeps). They add up to the report's TP seconds (the pictures drew none: the text said them)."""
    from fsdp_planner import api
    from fsdp_planner.report.step_view import event_times, parallel_bars
    from fsdp_planner.sim.context import SimContext
    from fsdp_planner.sim.options import SimOptions, plan_options
    from fsdp_planner.sim.tensor_parallel import tp_view
    from fsdp_planner.sim.timeline import Work

    tr, cluster = traced("toy-llama"), parse_cluster("h100:8")
    plan = api.plan("toy-llama", cluster=cluster, policy="titan", tp=2, ac=ac)
    v = step_view(tr, plan, cluster)
    r = v.report
    assert [lane.name for lane in v.lanes] == ["compute", "all-gather", "reduce-scatter", "TP"]
    tp = v.lanes[3].bars
    assert {b.kind for b in tp} == {BarKind.TP_COLLECTIVE}
    assert sum(b.seconds for b in tp) == pytest.approx(r.tp_time, rel=1e-9)
    compute = [b for b in v.lanes[0].bars if b.kind in (BarKind.FORWARD, BarKind.BACKWARD, BarKind.RECOMPUTE)]
    tol = r.step_time * 1e-12
    assert all(any(c.start - tol <= b.start and b.end <= c.end + tol for c in compute) for b in tp)
    # one bar a collective run, recomputations included (before thin ones merge), on the TP rank's view
    view = tp_view(tr, plan.tensor_parallel, cluster, None)
    ctx = SimContext(view.trace, view.cluster, plan_options(view.plan(plan), SimOptions()))
    times = event_times(r.timeline, ctx.cum, len(view.trace.events))
    bars = parallel_bars(ctx, view.plan(plan), r.timeline, times)
    assert len(bars) == r.tp_all_gathers + r.tp_reduce_scatters + r.tp_all_reduces > 0
    recomputes = [e for e in r.timeline if e.work is Work.RECOMPUTE]
    assert any(e.start <= b.start < e.end for b in bars for e in recomputes)  # (op: those not kept run again)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_coarse_plans_colour_each_phase_by_the_step_s_own_boundary(groups):
    """With a few large groups, few collectives stop the clocks, and a run of ops used to cross from the loss into
    backward, drawn as forward. Every forward bar ends by the step's forward/backward boundary, every backward
    bar starts at or after it, and both phases are drawn (the lanes are what the PNG and the HTML draw)."""
    tr = traced("toy-llama")
    layers = [m for m in tr.modules if m.startswith("layers.") and m.count(".") == 1]
    plan = make_plan(tr, [[m] for m in layers[:groups - 1]], policy="coarse")
    assert len(plan.groups) == groups
    for cluster in (CLUSTER, host_cluster()):
        v = step_view(tr, plan, cluster)
        tol = v.report.step_time * 1e-12
        forward = [b for b in v.lanes[0].bars if b.kind is BarKind.FORWARD]
        backward = [b for b in v.lanes[0].bars if b.kind is BarKind.BACKWARD]
        assert forward and backward
        assert 0 < v.backward_start < v.report.step_time
        assert all(b.end <= v.backward_start + tol for b in forward), cluster.name
        assert all(b.start >= v.backward_start - tol for b in backward), cluster.name
        # the boundary is where the trace's first backward event runs: the memory curve's time for it
        assert v.backward_start == v.memory_times[tr.index.forward_end]


def test_thin_abutting_bars_merge_but_gaps_and_wide_bars_stay():
    f, e = BarKind.FORWARD, BarKind.EXPOSED
    bars = [Bar(f, "a", 0, 1), Bar(f, "b", 1, 2), Bar(f, "c", 2, 3), Bar(e, "wait", 3, 3.5), Bar(f, "d", 3.5, 4),
            Bar(f, "wide", 4, 20)]
    merged = merge_thin(bars, min_width=2.5)
    assert [(b.name, b.start, b.end) for b in merged] == [
        ("a … b", 0, 2), ("c", 2, 3), ("wait", 3, 3.5), ("d", 3.5, 4), ("wide", 4, 20)]


def test_a_small_model_s_memory_axis_spans_its_curve_not_the_gpu(views):
    """toy-llama peaks at a few MiB on an 80 GB H100: the budget line alone set the axis to 80,000 MiB, the curve a
    flat line at its foot (a trial). Lines far above the curve are left off the scale; near it, they are drawn."""
    from dataclasses import replace

    for v in views:
        top, budget, capacity = memory_scale(v)
        curve = max(float(v.memory_bytes.max()), v.report.reserved_memory)
        assert top == curve and not budget.drawn and not capacity.drawn, v.label
        near = replace(v, capacity=int(curve * 2), budget=replace(v.budget, limit=int(curve * 1.5)))
        assert memory_scale(near)[0] == curve * 2 and all(line.drawn for line in memory_scale(near)[1:])
        apart = replace(near, capacity=int(curve * CAPACITY_IN_VIEW * 1.01))  # the budget drawn, the GPU named
        top, budget, capacity = memory_scale(apart)
        assert (top, budget.drawn, capacity.drawn) == (int(curve * 1.5), True, False)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


@pytest.mark.parametrize("count", [1, 2])
def test_png_is_written_at_its_size(views, tmp_path, count):
    path = tmp_path / "step.png"
    shown = views[:count]
    write_png(shown, path, "toy-llama on h100:16")
    width, height = figure_size(shown)
    assert _png_size(path.read_bytes()) == (round(width * DPI), round(height * DPI))
    assert path.stat().st_size > 20_000  # lanes, curves and text, not an empty canvas


def test_html_is_self_contained(views):
    page = render_html(views[:2], "toy-llama <on> h100:16")
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert set(re.findall(r"https?://[^\s\"'`)]+", page)) == {"http://www.w3.org/2000/svg"}  # the SVG namespace
    assert "toy-llama &lt;on&gt; h100:16" in page
    data = json.loads(re.search(r'id="timeline-data">(.*?)</script>', page, re.S).group(1))
    assert [len(v["lanes"]) for v in data["views"]] == [3, 3]
    assert max(data["views"][0]["memory"]["b"]) == views[0].report.peak_memory


@pytest.mark.integration
def test_html_renders_in_chromium_without_errors(views, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    path = tmp_path / "step.html"
    write_html([views[0], views[3]], path, "toy-llama on h100:16")  # flat and HSDP: all four lanes
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Uncaught" not in r.stderr and ":CONSOLE" not in r.stderr, r.stderr[-2000:]  # the page logs nothing
    assert 'data-rendered="1"' in r.stdout  # the script ran to its end
    bars = int(re.search(r'data-bars="(\d+)"', r.stdout).group(1))
    assert bars >= views[0].report.all_gathers + views[3].report.all_reduces
    assert r.stdout.count('class="memory"') == 2 and "all-reduce" in r.stdout
    assert r.stdout.count('class="key"') >= 7  # the legend: bar kinds and the memory lines
