"""One collective, one cost: what ``fsdp-planner cost`` prints (``hardware/cost.py:collective_time``) is what the
simulator charges for the same collective, on every preset and on calibrated clusters (NCCL-fitted and gloo-table)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_main, traced
from test_host_engine import host_cluster

from fsdp_planner.calibrate.nccl_logs import calibrate
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import PRESETS, Cluster, Engine, parse_cluster
from fsdp_planner.hardware.cost import collective_time
from fsdp_planner.sim.context import SimContext, replica_ranks_per_node
from fsdp_planner.sim.simulate import simulate

AG, RS, AR = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE
NCCL = Path(__file__).parent / "fixtures" / "nccl"
SIZES = [1, 3000, 64 << 10, 1 << 20, 5_000_000, 16 << 20, 1 << 30]  # every protocol's regime, and between table rows


def gloo_cluster(tmp_path: Path) -> Cluster:
    """tests/test_host_engine.py's measured 2-rank gloo cluster, through its JSON file as the CLI reads it."""
    path = tmp_path / "gloo.json"
    host_cluster().save(path)
    return Cluster.load(path)


def clusters(tmp_path: Path) -> list[Cluster]:
    presets = [parse_cluster(f"{p}:{n}") for p in PRESETS for n in (8, 32)] + [parse_cluster("h100:4x2")]
    fitted = calibrate([NCCL / "all_gather_perf_8xh100.log", NCCL / "reduce_scatter_perf_8xh100.log",
                        NCCL / "all_gather_perf_16xh100_2nodes.log"])
    return [*presets, fitted, gloo_cluster(tmp_path)]


def meshes(cluster: Cluster) -> list[Mesh]:
    """Flat and HSDP layouts whose shard groups span a part of a node, a node and several nodes."""
    world = cluster.world_size
    return [Mesh(world // s, s) for s in sorted({1, 2, cluster.gpus_per_node, world}) if world % s == 0]


def test_cost_is_what_the_simulator_charges_at_every_size_and_group(tmp_path: Path) -> None:
    tr = traced("seed-net")
    for cluster in clusters(tmp_path):
        for mesh in meshes(cluster):
            ctx = SimContext(tr, cluster, mesh=mesh)
            per_node = replica_ranks_per_node(cluster, mesh)
            for nbytes in SIZES:
                for kind, ranks, rpn in ((AG, mesh.shard, None), (RS, mesh.shard, None),
                                         (AR, mesh.replicate, per_node)):
                    charged = ctx.cost(kind).seconds(nbytes)
                    assert collective_time(cluster, kind, nbytes, ranks, rpn) == charged, \
                        (cluster.name, mesh, kind, nbytes)
                    # the planner's vector form agrees with the engines' scalar one
                    assert ctx.comm_time(kind, np.array([nbytes], dtype=float))[0] == pytest.approx(charged, rel=1e-12)


@pytest.mark.parametrize("spec", ["seed-net", "toy-llama"])
def test_the_engines_charge_what_cost_prints(tmp_path: Path, spec: str) -> None:
    """Each engine's busy time for a one-group plan (its collectives run alone) is the sum of what ``cost`` prints
    for them, plus FSDP2's copy-in on the GPU streams (charged on the collective's stream there)."""
    tr = traced(spec)
    plan = make_plan(tr, [], policy="root only", model=spec)
    for cluster in (parse_cluster("h100:16"), parse_cluster("a100:8"), gloo_cluster(tmp_path)):
        report = simulate(tr, plan, cluster, timeline=False)
        ctx = SimContext(tr, cluster)
        gather = ctx.sizing.groups(plan)[0].gather_bytes
        copy = cluster.overhead.copy_bandwidth
        expected = {AG.value: 0.0, RS.value: 0.0}
        for c in build_schedule(tr, plan, cluster.world_size).collectives:
            nbytes = gather if c.kind is AG else ctx.sizing.reduce_bytes(c.params)
            expected[c.kind.value] += collective_time(cluster, c.kind, nbytes)
            if cluster.engine is Engine.STREAMS:
                expected[c.kind.value] += nbytes / cluster.world_size / copy if c.kind is AG else nbytes / copy
        assert report.comm_time == pytest.approx(expected, rel=1e-9), cluster.name


@pytest.mark.integration  # seconds of planning (the fast subset stays near a minute)
def test_the_cost_command_prints_the_measured_time(tmp_path: Path) -> None:
    """The measured bug: on a gloo-table cluster the command printed the fitted line (17.1 ms at 16 MiB) while the
    simulator charged the measured 12.0 ms, and its bus bandwidth read 0 GB/s."""
    cluster = gloo_cluster(tmp_path)
    path = tmp_path / "gloo.json"
    run = ["cost", "all-gather", "16MiB", "--cluster", str(path)]
    r = run_main(*run, "--json")
    assert r.returncode == 0, r.stderr
    charged = SimContext(traced("seed-net"), cluster).cost(AG).seconds(16 << 20)
    assert json.loads(r.stdout)["seconds"] == charged == pytest.approx(12e-3)
    r = run_main(*run)
    assert r.returncode == 0 and "12 ms" in r.stdout and "bus bandwidth 0.699 GB/s" in r.stdout, r.stdout
