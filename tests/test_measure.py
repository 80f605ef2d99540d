"""--measure: real per-op timings on the local device replace the roofline estimate."""

from __future__ import annotations

import pytest
from conftest import policy, traced

from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.runtime.measure import check_fits, local_device, measure
from fsdp_planner.sim.simulate import simulate


def test_measured_trace_has_the_planning_trace_events_and_drives_the_simulator():
    lm = load_model("seed-net", meta=False)
    measured = measure(lm.model, lm.example_inputs, lm.loss_fn, repeats=2)
    planned = traced("seed-net")
    assert [(e.kind, e.module, e.backward) for e in measured.events] == \
        [(e.kind, e.module, e.backward) for e in planned.events]
    seconds = measured.op_seconds
    assert seconds is not None and len(seconds) == len(measured.events)
    ops = [s for s, e in zip(seconds, measured.events, strict=True) if e.is_op]
    assert all(s >= 0 for s in seconds) and sum(ops) > 0
    assert all(s == 0 for s, e in zip(seconds, measured.events, strict=True) if not e.is_op)
    plan = policy("order").plan(measured)
    report = simulate(measured, plan, parse_cluster("h100:8"))
    assert report.compute_time == pytest.approx(sum(seconds))
    estimated = simulate(planned, policy("order").plan(planned), parse_cluster("h100:8"))
    assert report.compute_time != estimated.compute_time


def test_measure_refuses_a_model_that_does_not_fit():
    with pytest.raises(PlannerError, match=r"--measure runs llama3-405b unsharded .* GiB"):
        check_fits(traced("llama3-405b"), local_device(), "llama3-405b")


def test_cli_measure(tmp_path):
    from fsdp_planner.cli import main

    assert main(["simulate", "seed-net", "--policy", "order", "--cluster", "h100:8", "--measure", "--json"]) == 0
    assert main(["simulate", "llama3-405b", "--policy", "order", "--cluster", "h100:8", "--measure"]) == 2


def test_measure_refuses_a_compiled_or_chunked_step(capsys):
    """--measure times the ops of the model run eager, its loss whole: a compiled plan's step was predicted from
    that eager trace, and said to be traced eager though --compile was given (a trial); refused before any work."""
    from fsdp_planner.cli import main

    for flags in (["--compile"], ["--loss-chunks", "2"]):
        assert main(["simulate", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--measure", *flags]) == 2
        assert "--measure times the model's ops as they run eager" in capsys.readouterr().err
