"""Every command's ``--json``: one parseable document on stdout with the keys docs/json.md promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_planner.cli import build_parser, main

STEP = {"step_time", "compute_time", "exposed_comm", "copy_time", "host_wait", "host_time", "hooks", "lower_bound",
        "peak_memory", "reserved_memory", "memory_at_peak", "all_gathers", "reduce_scatters", "all_reduces",
        "all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "comm_time", "recompute_time", "mesh"}
MEMORY = {"params", "buffers", "optimizer_state", "grads", "unsharded_params", "unsharded_grads",
          "all_gather_buffers", "reduce_scatter_buffers", "gradient_buckets", "compute_copies", "activations",
          "optimizer_temporaries"}


def run_json(capsys, *argv: str, status: int = 0):
    assert main([*argv, "--json"]) == status
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one document: json.loads refuses anything after it


def test_every_command_takes_json_and_quiet():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings}
        assert {"--json", "--quiet"} <= options, name


def test_documented_commands_are_the_commands():
    doc = (Path(__file__).parent.parent / "docs" / "json.md").read_text()
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in commands:
        assert f"| `{name}` |" in doc, name


def test_plan_simulate_cost_memory_models(capsys):
    d = run_json(capsys, "plan", "toy-llama", "--cluster", "h100:8")
    assert set(d) == {"model", "micro_batches", "gradient_sync", "loss_chunks", "plans", "auto"}
    assert {"name", "fingerprint", "numel"} <= set(d["model"])
    assert all({"plan", "metrics", "simulation"} <= set(p) and set(p["simulation"]) >= STEP for p in d["plans"])
    assert {"budget", "budget_source", "fits", "plans_simulated", "plans_refined", "search_effort",
            "seconds"} <= set(d["auto"])
    assert 0 <= d["auto"]["plans_refined"] <= d["auto"]["search_effort"]
    d = run_json(capsys, "plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--explain")
    rows = d["auto"]["explanation"]
    assert len(rows) == len(d["plans"][0]["plan"]["groups"]) - 1  # one per inner group
    assert all({"group", "modules", "held_by", "why", "alternative", "alternative_step"} <= set(r) for r in rows)
    d = run_json(capsys, "simulate", "toy-llama", "--policy", "order", "--cluster", "h100:8", "--compare", "titan")
    assert set(d) >= STEP and set(d["compare"]) >= STEP and set(d["memory_at_peak"]) >= MEMORY
    assert set(run_json(capsys, "cost", "all-gather", "1GiB", "--cluster", "h100:8")) == {
        "collective", "bytes", "ranks", "seconds"}
    d = run_json(capsys, "memory", "seed-net", "--world-size", "8")
    assert set(d) == {"single", "ddp", "zero1", "zero2", "fsdp"} and all(MEMORY | {"total"} <= set(v)
                                                                        for v in d.values())
    d = run_json(capsys, "models")
    assert {"toy-llama", "llama3-8b", "hf:llama3-8b"} <= {m["name"] for m in d["models"]}
    assert all(set(m) == {"name", "description", "workload", "trainable", "needs"} for m in d["models"])
    assert {p["name"] for p in d["cluster_presets"]} == {"h100", "h100e", "h200", "a100", "b200"}
    assert all("2-core x86 host" in p["host_figures"] for p in d["cluster_presets"])  # where they were measured


@pytest.mark.integration  # real FSDP2 on fake ranks or a subprocess: the full suite runs it
def test_check_and_fake_world_verify(capsys):
    findings = run_json(capsys, "check", "toy-llama")
    assert isinstance(findings, list)
    assert all(set(f) == {"severity", "code", "message", "fix", "module"} for f in findings)
    d = run_json(capsys, "verify", "toy-llama", "--policy", "order", "--fake-world-size", "8")
    assert {"world_size", "precision", "plan", "predicted", "measured", "counts_and_bytes_exact", "peak_error",
            "ok", "seconds"} <= set(d) and d["ok"]


def test_export_json(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--out", str(plan), "--quiet"]) == 0
    capsys.readouterr()
    d = run_json(capsys, "export", str(plan), "--format", "python", "--precision", "fp32")
    assert set(d) == {"format", "precision", "out", "source"} and d["out"] is None and d["precision"] == "fp32"
    assert "PRECISION: str = 'fp32'" in d["source"]
    compile(d["source"], "plan.py", "exec")


def test_calibrate_json(capsys, tmp_path):
    logs = Path(__file__).parent / "fixtures" / "nccl"
    d = run_json(capsys, "calibrate", *map(str, sorted(logs.iterdir())[:1]), "--base", "h100:8",
                 "--out", str(tmp_path / "c.json"))
    assert set(d) == {"out", "cluster", "overhead_measurement"} and d["overhead_measurement"] is None
    assert json.loads((tmp_path / "c.json").read_text()) == d["cluster"]


@pytest.mark.integration  # traces llama3-8b and searches: ~10 s
def test_demo_json(capsys, tmp_path):
    d = run_json(capsys, "demo", "--out-dir", str(tmp_path))
    assert [s["model"] for s in d["seed"]] == ["seed-net", "toy-llama"]
    assert d["seed"][0]["root_holds"]["modules"] == ["conv1", "fc2"]
    main_job = d["main"]
    assert {"model", "cluster", "capacity", "plans", "auto", "rival", "timelines"} <= set(main_job)
    assert main_job["auto"]["fits"] and main_job["auto"]["step_time"] <= main_job["rival"]["step_time"]
    assert all(Path(p).is_file() for p in main_job["timelines"])


def test_quiet_silences_notes_but_not_errors(capsys):
    assert main(["plan", "toy-llama", "--mfu", "0.4", "--quiet"]) == 0
    assert "note" not in capsys.readouterr().err
    assert main(["plan", "toy-llama", "--mfu", "0.4"]) == 0
    assert "no effect" in capsys.readouterr().err
    assert main(["plan", "no-such-model", "--quiet"]) == 2
    assert "error" in capsys.readouterr().err
