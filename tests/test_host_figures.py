"""The CPU optimizer rate is a figure of the host the user names (a cluster file's field or --cpu-optimizer-rate), it
carries its source, and an offload plan's step shows both."""

from __future__ import annotations

import json

import pytest
from conftest import run_main

from fsdp_planner.hardware.cluster import CPU_ADAMW_SOURCE, PRESETS, Cluster, parse_cluster

SIMULATE = ("simulate", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--offload")


def test_each_preset_host_has_a_sourced_rate_and_files_keep_it(tmp_path) -> None:
    for name in PRESETS:
        c = parse_cluster(f"{name}:16")
        assert c.cpu_optimizer_source.startswith("preset") and "cpu_adamw.md" in c.cpu_optimizer_source
        path = tmp_path / f"{name}.json"
        c.save(path)
        again = Cluster.load(path)
        assert (again.cpu_optimizer_rate, again.cpu_optimizer_source) == (c.cpu_optimizer_rate,
                                                                           c.cpu_optimizer_source)


def test_a_file_names_the_source_of_its_rate(tmp_path) -> None:
    d = parse_cluster("h100:8").to_dict()
    del d["cpu_optimizer_source"]
    d["cpu_optimizer_rate"] = 5e8
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(d))
    assert Cluster.load(path).cpu_optimizer_source == f"cluster file {path}"
    del d["cpu_optimizer_rate"]  # neither: the measured 2-core host, as before the field had a source
    path.write_text(json.dumps(d))
    assert Cluster.load(path).cpu_optimizer_source == CPU_ADAMW_SOURCE


def test_the_rate_given_on_the_command_line_sets_the_offload_step() -> None:
    preset = run_main(*SIMULATE, "--json")
    slow = run_main(*SIMULATE, "--json", "--cpu-optimizer-rate", "30.9e6")
    assert preset.returncode == slow.returncode == 0, preset.stderr + slow.stderr
    t_preset = json.loads(preset.stdout)["cpu_optimizer_time"]
    t_slow = json.loads(slow.stdout)["cpu_optimizer_time"]
    rate = parse_cluster("h100:8").cpu_optimizer_rate
    assert t_slow == pytest.approx(t_preset * rate / 30.9e6, rel=1e-9)
    assert json.loads(slow.stdout)["step_time"] > json.loads(preset.stdout)["step_time"]
    text = run_main(*SIMULATE, "--cpu-optimizer-rate", "30.9e6").stdout
    assert "optimizer step on the CPU at 30.9 M elements/s per rank (given with --cpu-optimizer-rate)" in text
    assert "preset: 14 host cores per GPU" in run_main(*SIMULATE).stdout


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_a_bad_rate_is_one_clear_error(value: str) -> None:
    r = run_main(*SIMULATE, "--cpu-optimizer-rate", value)
    assert r.returncode != 0 and "cpu_optimizer_rate" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_calibrate_writes_the_measured_rate_with_its_source(tmp_path) -> None:
    out = tmp_path / "host.json"
    r = run_main("calibrate", "--cpu-optimizer", "--base", "h100:2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    c = Cluster.load(out)
    assert c.cpu_optimizer_source.startswith("calibrate --cpu-optimizer") and "of 2 ranks" in c.cpu_optimizer_source
    assert c.cpu_optimizer_rate != parse_cluster("h100:2").cpu_optimizer_rate
    assert c.name == "h100:2+calibrated"  # a simulation's header does not read as the preset's
    assert f"{c.cpu_optimizer_rate / 1e6:,.1f} M elements/s per rank" in r.stdout
