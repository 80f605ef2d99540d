"""CPU ranks on gloo (``Engine.HOST``): the step is the sum of its parts, the measured collective tables are what the
simulator charges, and ``calibrate --backend gloo``'s fit recovers the figures that made its measurements."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import policy, traced

from fsdp_planner.calibrate.gloo import fit, monotone
from fsdp_planner.calibrate.overhead import chain_plan, chain_trace
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import GPU, Cluster, Engine, Link, Overhead
from fsdp_planner.hardware.cost import table_seconds
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace.events import EventKind

AG, RS = CollectiveKind.ALL_GATHER.value, CollectiveKind.REDUCE_SCATTER.value
TABLES = {AG: [(4096, 3e-4), (1 << 20, 1e-3), (16 << 20, 12e-3)],
          RS: [(4096, 4e-4), (1 << 20, 2e-3), (16 << 20, 20e-3)]}
OVERHEAD = Overhead(hook_seconds=5e-4, op_seconds=-1e-6, copy_bandwidth=10e9, param_seconds=6e-5, source="test",
                    module_seconds=7e-5)


def host_cluster(world: int = 2, tables: dict | None = None, overhead: Overhead = OVERHEAD) -> Cluster:
    link = Link(0.5e9, 3e-4, 0.0)
    return Cluster(name=f"gloo:{world}", gpu=GPU("CPU", 50e9, 50e9, 10e9, 8 << 30), gpus_per_node=world, nodes=1,
                   intra=link, inter=link, nics_per_node=1, overhead=overhead, engine=Engine.HOST,
                   tables=TABLES if tables is None else tables)


def with_op_times(tr, seconds: float = 1e-5):
    return tr.with_op_seconds(tuple(seconds if e.is_op else 0.0 for e in tr.events))


def test_table_seconds_interpolates_and_extrapolates() -> None:
    rows = TABLES[AG]
    assert table_seconds(rows, 100) == 3e-4  # below the smallest size: its time
    assert table_seconds(rows, 1 << 20) == pytest.approx(1e-3)
    assert table_seconds(rows, (4096 + (1 << 20)) / 2) == pytest.approx((3e-4 + 1e-3) / 2)
    slope = (12e-3 - 1e-3) / ((16 << 20) - (1 << 20))
    assert table_seconds(rows, 32 << 20) == pytest.approx(12e-3 + slope * (16 << 20))


def test_monotone_takes_the_least_time_at_or_above_each_size() -> None:
    spiky = [(1, 0.4), (2, 3.6), (3, 0.5), (4, 0.45), (5, 2.0)]
    assert monotone(spiky) == [(1, 0.4), (2, 0.45), (3, 0.45), (4, 0.45), (5, 2.0)]
    assert [t for _, t in monotone(spiky)] == sorted(t for _, t in monotone(spiky))


@pytest.mark.parametrize("spec,name", [("toy-llama", "titan"), ("toy-llama", "order"), ("seed-net", "size")])
def test_host_step_is_the_sum_of_its_parts(spec: str, name: str) -> None:
    """Nothing overlaps on a CPU rank: ops (corrected per op), hooks, the measured collectives and the copies add
    up to the step, counted here from the replay's own schedule."""
    tr = with_op_times(traced(spec))
    plan = policy(name).plan(tr, spec)
    cluster = host_cluster()
    report = simulate(tr, plan, cluster)
    sched = build_schedule(tr, plan, 2)
    sizing = SimContext(tr, cluster).sizing  # the default precision's bytes, as simulate sizes them
    groups = sizing.groups(plan)
    ops = sum(e.is_op for e in tr.events)
    expected = sum(tr.op_seconds) + ops * OVERHEAD.op_seconds
    expected += sum(OVERHEAD.hook_seconds + len(groups[g].params) * OVERHEAD.param_seconds / 4 for _, g in sched.hooks)
    fully_sharded = {m for g in plan.groups for m in g.modules}
    expected += OVERHEAD.module_seconds * sum(e.kind is EventKind.FWD_PRE and e.module in fully_sharded
                                              for e in tr.events)
    for c in sched.collectives:
        if c.kind is CollectiveKind.ALL_GATHER:
            nbytes = groups[c.group].gather_bytes
            expected += table_seconds(TABLES[AG], nbytes) + nbytes / OVERHEAD.copy_bandwidth  # + copy-out
        else:
            expected += table_seconds(TABLES[RS], sizing.reduce_bytes(c.params))
    expected += SimContext(tr, cluster).optimizer_seconds()  # then the optimizer step (sim/optimizer_step.py)
    assert report.step_time == pytest.approx(expected, rel=1e-9)
    assert report.exposed_comm == pytest.approx(sum(report.comm_time.values()))
    assert report.hooks == len(sched.hooks)
    # the same costs on streams overlap: never slower
    streams = dataclasses.replace(cluster, engine=Engine.STREAMS, tables={},
                                  overhead=dataclasses.replace(OVERHEAD, op_seconds=0.0))
    assert simulate(tr, plan, streams, timeline=False).step_time < report.step_time


def test_one_rank_issues_no_collectives() -> None:
    tr = with_op_times(traced("toy-llama"))
    plan = policy("titan").plan(tr, "toy-llama")
    one = host_cluster(world=1, tables={})
    report = simulate(tr, plan, one)
    assert report.comm_time[AG] == report.comm_time[RS] == 0.0


def test_cluster_json_round_trip_and_validation(tmp_path) -> None:
    cluster = host_cluster()
    path = tmp_path / "gloo.json"
    cluster.save(path)
    again = Cluster.load(path)
    assert again.engine is Engine.HOST and again.tables == cluster.tables and again.overhead == cluster.overhead
    assert "CPU ranks on gloo" in again.describe()
    d = json.loads(path.read_text())
    with pytest.raises(PlannerError, match="field 'engine' must be one of streams, host"):
        Cluster.from_dict({**d, "engine": "tpu"})
    with pytest.raises(PlannerError, match=r"tables\.all_gather"):
        Cluster.from_dict({**d, "tables": {AG: [[4096, 1e-3], [1024, 2e-3]]}})
    # a time that falls as the size grows (1 GiB costed as 2 bytes: 940 GB/s on gloo, a trial); an equal one stands
    with pytest.raises(PlannerError, match=r"'tables\.all_gather' has a time that falls as the size grows \(row 1: "
                                           r"2 bytes in 0\.001 s, after 1 in 1 s\)"):
        Cluster.from_dict({**d, "tables": {AG: [[1, 1.0], [2, 1e-3]]}})
    assert list(Cluster.from_dict({**d, "tables": {AG: [[1, 1e-3], [2, 1e-3]]}}).tables[AG]) == [(1, 1e-3), (2, 1e-3)]
    streams = {**d, "engine": "streams"}  # a negative op time only corrects measured CPU ops
    with pytest.raises(PlannerError, match=r"overhead\.op_seconds' is -.* s, outside 0\.\.1 s"):
        Cluster.from_dict(streams)
    old = {k: v for k, v in d.items() if k not in ("engine", "tables")}  # a file from before the host engine
    old["overhead"] = {**d["overhead"], "op_seconds": 0.0}
    assert Cluster.from_dict(old).engine is Engine.STREAMS


def _synthetic_job(truth: Cluster, group_sizes: list[int]) -> dict:
    """What a calibration job would write if the machine behaved exactly as ``truth`` says."""
    tr = chain_trace()
    ops = sum(e.is_op for e in tr.events)
    measured = with_op_times(tr, 4e-6)
    plans = [chain_plan(tr, k) for k in group_sizes]
    o = truth.overhead
    return {"world": 2, "threads": 1, "matmul_flops": 50e9, "copy_bandwidth": o.copy_bandwidth,
            "collectives": {k: [list(r) for r in rows] for k, rows in truth.tables.items()},
            "op_seconds": list(measured.op_seconds), "plain_seconds": sum(measured.op_seconds) + ops * o.op_seconds,
            "plan_seconds": [simulate(measured, p, truth, timeline=False).step_time for p in plans]}


def test_fit_recovers_the_figures_behind_the_measurements() -> None:
    rows = {AG: [(4096 << i, 3e-4 * (1 + i)) for i in range(6)], RS: [(4096 << i, 4e-4 * (1 + i)) for i in range(6)]}
    truth = host_cluster(tables=rows)
    sizes = [0, 256, 64, 16, 4, 1]
    cluster, m = fit(_synthetic_job(truth, sizes), sizes)
    assert cluster.engine is Engine.HOST and cluster.tables == rows
    assert cluster.overhead.hook_seconds == pytest.approx(OVERHEAD.hook_seconds, rel=1e-6)
    assert cluster.overhead.param_seconds == pytest.approx(OVERHEAD.param_seconds, rel=1e-6)
    assert cluster.overhead.op_seconds == pytest.approx(OVERHEAD.op_seconds, rel=1e-6)
    assert cluster.overhead.module_seconds == pytest.approx(OVERHEAD.module_seconds, rel=1e-6)
    assert m.worst_residual < 1e-6
    assert {f.kind for f in m.collectives} == {AG, RS} and all(f.busbw > 0 for f in m.collectives)


def test_fit_refuses_a_step_that_does_not_grow_with_groups() -> None:
    truth = host_cluster(tables={AG: [(4096 << i, 3e-4 * (1 + i)) for i in range(4)],
                                 RS: [(4096 << i, 4e-4 * (1 + i)) for i in range(4)]})
    data = _synthetic_job(truth, [0, 256, 16, 1])
    data["plan_seconds"] = [1.0, 1.0, 0.5, 0.1]  # fewer seconds with more groups: not a measurement of FSDP2
    with pytest.raises(PlannerError, match="did not grow with the number of groups"):
        fit(data, [0, 256, 16, 1])


@pytest.mark.parametrize("engine", [Engine.STREAMS, Engine.HOST])
def test_the_host_line_is_a_sum_that_adds_up(engine: Engine) -> None:
    """``plan --explain``'s host line names each count and figure: they multiply and add to the host time the
    engine charged (GPU: ops launched, a checkpointed block's launched again; CPU ranks: hooks only)."""
    from fsdp_planner.cli.render import host_line
    from fsdp_planner.fsdp2.claim import make_plan
    from fsdp_planner.sim.host_work import host_work

    tr = traced("toy-llama")
    plan = make_plan(tr, [["layers.0", "layers.1"], ["layers.2"], ["layers.3"]]).replace(
        activation_checkpointing=["layers.3"])
    overhead = dataclasses.replace(OVERHEAD, op_seconds=2e-6)
    cluster = dataclasses.replace(host_cluster(overhead=overhead), engine=engine)
    ctx = SimContext(tr, cluster)
    report, work = simulate(tr, plan, context=ctx), host_work(ctx, plan)
    total = work.hooks * overhead.hook_seconds + work.params * overhead.param_seconds \
        + work.module_calls * overhead.module_seconds \
        + (work.ops * overhead.op_seconds if engine is Engine.STREAMS else 0)
    assert total == pytest.approx(report.host_time, rel=1e-9)
    assert work.module_calls == 4 + 1  # each block called once (layers.0 and layers.1 in one list group), the root
    line = host_line(report, cluster, work)
    assert f"{work.hooks} FSDP2 hooks x " in line and "5 module calls x 70 us" in line
    assert (f"{work.ops:,} ops x" in line) is (engine is Engine.STREAMS)
