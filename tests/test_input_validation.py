"""Bad user input is one clear line and exit code 2, never a traceback, an internal error or a silently wrong result:
cluster specs and files, nccl-tests logs for calibrate, and plan files (found by a new-user break test)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import traced

from fsdp_planner.calibrate.nccl_logs import fit_samples, parse_nccl_tests
from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.planners import SizeBasedPolicy


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> str:
    """Run the CLI: exit code 2 and one ``error: ...`` line containing ``message``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "internal error" not in err and "Traceback" not in err
    assert message in lines[0], lines[0]
    return lines[0]


# ---- clusters: --cluster specs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [
    "h100:1" + "0" * 300,  # a multiple of 8: used to reach the cost model and overflow it
    "h100:" + "9" * 300,
    "h100:" + "1" * 5000,  # more digits than int() reads
    "h100:2000000",
    "h100:200000x8",
    "a100:1" + "0" * 20 + "x8",
], ids=["1e300", "300-nines", "5000-digits", "2e6", "200000x8", "1e20x8"])
def test_huge_gpu_counts_are_refused(capsys, spec: str) -> None:
    line = _fails(capsys, ["cost", "all-gather", "1GiB", "--cluster", spec], "at most 1,000,000 GPUs are supported")
    assert len(line) < 300  # the 5000-digit spec is not echoed whole


def test_largest_supported_preset_still_parses() -> None:
    assert parse_cluster("h100:1000000").world_size == 1_000_000


# ---- clusters: JSON files -------------------------------------------------------------------------------------------
def _cluster_file(tmp_path: Path, change: Callable[[dict[str, Any]], None] | None = None) -> Path:
    d = parse_cluster("h100:16").to_dict()
    if change:
        change(d)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(d))  # NaN and Infinity written as JavaScript spells them, as Python's json reads
    return path


def _set(dotted: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        *parents, last = dotted.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return change


@pytest.mark.parametrize(("field", "value", "message"), [
    ("gpu.memory_bytes", math.nan, "field 'gpu.memory_bytes' is NaN, outside 1e8..1e13 B"),
    ("gpu.memory_bytes", 0, "field 'gpu.memory_bytes' is 0 B, outside 1e8..1e13 B"),
    ("gpu.memory_bytes", -80e9, "field 'gpu.memory_bytes' is -8e10 B, outside 1e8..1e13 B"),
    ("gpu.memory_bytes", math.inf, "field 'gpu.memory_bytes' is infinity, outside 1e8..1e13 B"),
    ("gpu.hbm_bandwidth", 0, "field 'gpu.hbm_bandwidth' is 0 B/s, outside 1e8..1e14 B/s"),
    ("gpu.hbm_bandwidth", 1e-9, "field 'gpu.hbm_bandwidth' is 1e-9 B/s, outside 1e8..1e14 B/s"),
    ("gpu.hbm_bandwidth", 10**400, "field 'gpu.hbm_bandwidth' is infinity, outside 1e8..1e14 B/s"),
    ("gpu.hbm_bandwidth", math.inf, "field 'gpu.hbm_bandwidth' is infinity, outside 1e8..1e14 B/s"),
    ("gpu.peak_bf16_flops", 0, "field 'gpu.peak_bf16_flops' is 0 FLOP/s, outside 1e8..1e17 FLOP/s"),
    ("gpu.peak_bf16_flops", 1e-300, "field 'gpu.peak_bf16_flops' is 1e-300 FLOP/s, outside 1e8..1e17 FLOP/s"),
    ("gpu.peak_fp32_flops", -1, "field 'gpu.peak_fp32_flops' is -1 FLOP/s, outside 1e8..1e17 FLOP/s"),
    ("gpu.peak_bf16_flops", math.nan, "field 'gpu.peak_bf16_flops' is NaN, outside 1e8..1e17 FLOP/s"),
    ("gpu.name", ["H100"], "field 'gpu.name' must be a string, got ['H100']"),
    ("name", {"a": 1}, "field 'name' must be a string, got {'a': 1}"),
    ("name", "x" * 5000, "field 'name' is 5,000 characters long; at most 1,000 are accepted"),
    ("engine", ["streams"], "field 'engine' must be one of streams, host, got ['streams']"),
    ("version", 2, 'has format version 2: this fsdp-planner reads cluster files with "version": 1'),
    ("version", "1", "has format version '1'"),
    ("intra.bus_bandwidth", math.nan, "field 'intra.bus_bandwidth' is NaN, outside 1e6..1e14 B/s (or infinity"),
    ("inter.bus_bandwidth", -5, "field 'inter.bus_bandwidth' is -5 B/s, outside 1e6..1e14 B/s"),
    ("inter.bus_bandwidth", 1e-300, "field 'inter.bus_bandwidth' is 1e-300 B/s, outside 1e6..1e14 B/s"),
    ("inter.hop_latency", math.inf, "field 'inter.hop_latency' is infinity, outside 0..1 s"),
    ("inter.base_latency", 1e300, "field 'inter.base_latency' is 1e300 s, outside 0..1 s"),
    ("intra.base_latency", -1e-6, "field 'intra.base_latency' is -1e-6 s, outside 0..1 s"),
    ("intra.ring_overhead", math.nan, "field 'intra.ring_overhead' is NaN, outside 0..2"),
    ("overhead.copy_bandwidth", 1e-300, "field 'overhead.copy_bandwidth' is 1e-300 B/s, outside 1e6..1e14 B/s"),
    ("overhead.hook_seconds", 5, "field 'overhead.hook_seconds' is 5 s, outside 0..1 s"),
    ("gpus_per_node", 0, "field 'gpus_per_node' must be a whole number from 1 to 72, got 0"),
    ("gpus_per_node", -8, "field 'gpus_per_node' must be a whole number from 1 to 72, got -8"),
    ("gpus_per_node", 1000, "field 'gpus_per_node' must be a whole number from 1 to 72, got 1000"),
    ("nodes", 0, "field 'nodes' must be a whole number from 1 to 1,000,000, got 0"),
    ("nodes", 200_000, "has 1,600,000 GPUs (200,000 nodes x 8); at most 1,000,000 are supported"),
    ("nics_per_node", 0, "field 'nics_per_node' must be a whole number from 1 to 64, got 0"),
    ("nics_per_node", 1_000_000, "field 'nics_per_node' must be a whole number from 1 to 64, got 1000000"),
    ("fits", {"all_gather": {"8": [math.nan, 3e11]}}, "field 'fits.all_gather.8 latency' is NaN, outside 0..1 s"),
    ("fits", {"all_gather": {"8": [1e-5, math.inf]}}, "field 'fits.all_gather.8 bandwidth' is infinity, outside "
                                                      "1e6..1e14 B/s"),
    ("fits", {"all_gather": {"8": [1e-5, 0]}}, "field 'fits.all_gather.8 bandwidth' is 0 B/s, outside 1e6..1e14"),
    ("fits", {"all_gather": {"8": ["x" * 100_000, 3e11]}}, "field 'fits' must map each collective to"),
    ("tables", {"all_gather": [[1, 1e-4], [2, 1e9]]}, "field 'tables.all_gather.1.seconds' is 1e9 s, outside "
                                                       "0..1000 s (0 excluded)"),
    ("fits", {"all_gather": {"1": [1e-5, 3e11]}}, "has a fit for 1 ranks; fits are for 2 to 1,000,000 ranks"),
    # a wrong type is no "none" (the fitted lines were dropped without a word: a trial)
    ("fits", 0, "to {\"RANKS\": [latency, bandwidth]}, e.g. {\"all_gather\": {\"8\": [2e-05, 3e11]}}; got 0"),
    ("fits", None, "e.g. {\"all_gather\": {\"8\": [2e-05, 3e11]}}; got null"),
    ("fits", [], "e.g. {\"all_gather\": {\"8\": [2e-05, 3e11]}}; got []"),
    ("fits", {"all_gather": {}}, "e.g. {\"all_gather\": {\"8\": [2e-05, 3e11]}}; got {\"all_gather\": {}}"),
    ("tables", [], "field 'tables' must map each collective to [[bytes, seconds], ...] (whole bytes); got []"),
    # a typo leaves a default in place silently unless unknown fields are refused
    ("ring_overhed", 1.9, "has an unknown field 'ring_overhed' (a typo?)"),
    ("inter.ring_overhed", 1.9, "has an unknown field 'inter.ring_overhed' (a typo?)"),
])
def test_every_cluster_number_is_checked_and_named(capsys, tmp_path: Path, field: str, value: Any,
                                                    message: str) -> None:
    path = _cluster_file(tmp_path, _set(field, value))
    line = _fails(capsys, ["cost", "all-gather", "1GiB", "--cluster", str(path)], message)
    assert f"the cluster file {path} field" in line or f"the cluster file {path} has" in line
    assert len(line) - len(str(path)) < 250  # a long value is not echoed whole (the path is the test's own)
    with pytest.raises(PlannerError, match="cluster file"):
        Cluster.load(path)


def test_physical_ranges_hold_for_files_not_for_studies_in_code(tmp_path: Path) -> None:
    """A study of an ideal machine in code may use 1e30 for 'free'; a file may not (Cluster.save refuses to write
    what Cluster.load would refuse to read)."""
    from dataclasses import replace

    c = parse_cluster("h100:8")
    free = replace(c, gpu=replace(c.gpu, hbm_bandwidth=1e30))
    assert free.gpu.hbm_bandwidth == 1e30
    with pytest.raises(PlannerError, match=r"^the cluster to write to .* field 'gpu\.hbm_bandwidth' is 1e30 B/s, "
                                           r"outside 1e8\.\.1e14 B/s$"):
        free.save(tmp_path / "free.json")
    assert not (tmp_path / "free.json").exists()
    with pytest.raises(PlannerError, match=r"field 'gpu\.hbm_bandwidth' is 1e30 B/s, outside"):
        Cluster.from_dict(free.to_dict())


def test_an_nvl72_node_is_a_valid_cluster(tmp_path: Path) -> None:
    path = _cluster_file(tmp_path, lambda d: d.update(gpus_per_node=72, nodes=2))
    assert Cluster.load(path).world_size == 144


def test_presets_pass_the_same_checks() -> None:
    from dataclasses import replace

    c = parse_cluster("h100:8")
    with pytest.raises(PlannerError, match=r"the cluster 'h100:8' field 'gpu\.hbm_bandwidth' is 0 B/s; it must be a "
                                           "finite number above 0"):
        replace(c, gpu=replace(c.gpu, hbm_bandwidth=0.0))
    with pytest.raises(PlannerError, match="'gpus_per_node' must be a whole number from 1 to 72"):
        replace(c, gpus_per_node=73)
    assert replace(c, name="renamed").name == "renamed"  # replace() still works with the validating InitVar


def test_cluster_file_that_is_not_text(capsys, tmp_path: Path) -> None:
    for data in (b"\xff\xfe\x00\x01binary", "{\"name\": \"caf\xe9\"}".encode("latin-1")):
        path = tmp_path / "cluster.json"
        path.write_bytes(data)
        _fails(capsys, ["cost", "all-gather", "1GiB", "--cluster", str(path)],
               f"cluster file {path} is not text: expected a cluster JSON")


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON (it nests too deeply to read)"),
    ('{"nodes": ' + "9" * 5000 + "}", "is not valid JSON (it holds a number too long to read, over 4300 digits)"),
    ('{"name": "a", "nodes": 1, "nodes": 8}', 'is not valid JSON (the key "nodes" appears twice in one object'),
    ('{"name": "H\\udc80", "nodes": 1}', "is not valid JSON (the string 'H\\udc80' holds a lone surrogate escape"),
], ids=["deep", "long-int", "duplicate-key", "lone-surrogate"])
def test_unreadable_cluster_json(capsys, tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(text)
    _fails(capsys, ["cost", "all-gather", "1GiB", "--cluster", str(path)], f"the cluster file {path} {message}")


def test_a_name_with_a_line_break_is_refused(capsys, tmp_path: Path) -> None:
    """A cluster or plan name is printed in headers and notes: a line of its own ('error: ...') would pose as the
    program's."""
    cluster = tmp_path / "cluster.json"
    parse_cluster("h100:8").save(cluster)
    cluster.write_text(cluster.read_text().replace('"name": "h100:8"', '"name": "a\\nerror: fake"'))
    _fails(capsys, ["cost", "all-gather", "1GiB", "--cluster", str(cluster)], "field 'name' must be one line")
    plan = tmp_path / "plan.json"
    assert main(["plan", "seed-net", "--policy", "order", "--out", str(plan)]) == 0
    capsys.readouterr()
    data = json.loads(plan.read_text())
    data["model"]["name"] = "seed-net\nerror: fake"
    plan.write_text(json.dumps(data))
    _fails(capsys, ["export", str(plan), "--format", "python", "--out", str(tmp_path / "p.py")],
           "plan 'model.name' must be one line")


@pytest.mark.parametrize(("text", "message"), [
    ("num_processes: 8\x00\n", "is not valid YAML: special characters are not allowed"),
    ("num_processes: 8\nnum_processes: 16\n", 'the key "num_processes" appears twice in one mapping'),
], ids=["control-character", "duplicate-key"])
def test_unreadable_accelerate_yaml(capsys, tmp_path: Path, text: str, message: str) -> None:
    """A NUL byte ended in "internal error" (PyYAML's reader refuses it before parsing); a repeated key was read
    as its last value (2 nodes of 8 where the file also said 8 processes)."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    _fails(capsys, ["simulate", "toy-llama", "--from-accelerate", str(path), "--cluster", "h100"], message)


# ---- calibrate: nccl-tests logs -------------------------------------------------------------------------------------
HEADER = "# nThread 1 nGpus 8 minBytes 8 maxBytes 8589934592 step: 2(factor)\n"


def _row(size: int | str, t: float | str, count: int | str | None = None, ip: float | str | None = None) -> str:
    count = size // 32 if count is None and isinstance(size, int) else (count if count is not None else 1)
    ip = t if ip is None else ip
    return f"  {size}  {count}  float  none  -1  {t}  1.0  1.0  0  {ip}  1.0  1.0  0"


def _good_rows() -> list[str]:
    return [_row(s, round(30 + s / 300e3, 2)) for s in (1 << 10, 1 << 20, 1 << 24, 1 << 28, 1 << 30)]


@pytest.mark.parametrize(("bad", "message"), [
    (_row(4096, "1e-300"), "line 3 of {log} has an out-of-place time of 1e-300 us, which no nccl-tests run prints"),
    (_row(4096, "1e300"), "line 3 of {log} has an out-of-place time of 1e300 us"),
    (_row(4096, "nan"), "line 3 of {log} has an out-of-place time of nan us"),
    (_row(4096, "inf"), "line 3 of {log} has an out-of-place time of inf us"),
    (_row(4096, "-12.5"), "line 3 of {log} has an out-of-place time of -12.5 us"),
    (_row(4096, "0.00"), "line 3 of {log} has an out-of-place time of 0.00 us"),
    (_row(4096, 31.0, ip="NaN"), "line 3 of {log} has an in-place time of NaN us"),
    (_row("-4096", 31.0, count=128), "line 3 of {log} has size -4096 and count 128, but nccl-tests prints them as"),
    (_row("4096.5", 31.0, count=128), "line 3 of {log} has size 4096.5 and count 128"),
    (_row(1 << 60, 31.0), "line 3 of {log} has a size of 1152921504606846976 bytes, more than the"),
    (_row("1" + "0" * 5000, 31.0, count=1), "more than the 1,125,899,906,842,624 bytes (1 PiB)"),
], ids=["1e-300", "1e300", "nan", "inf", "negative", "zero", "in-place-nan", "negative-size", "fractional-size",
        "2^60-size", "5000-digit-size"])
def test_calibrate_refuses_impossible_rows_naming_the_line(capsys, tmp_path: Path, bad: str, message: str) -> None:
    log = tmp_path / "ag.log"
    rows = _good_rows()
    log.write_text(HEADER + rows[0] + "\n" + bad + "\n" + "\n".join(rows[1:]) + "\n")
    _fails(capsys, ["calibrate", str(log), "--base", "h100:8", "--out", str(tmp_path / "c.json")],
           message.format(log=log))
    assert not (tmp_path / "c.json").exists()


def test_size_zero_rows_are_still_skipped_quietly(tmp_path: Path) -> None:
    log = tmp_path / "ag.log"
    log.write_text(HEADER + "  0  0  float  none  -1  0.00  0.00  0.00  0  0.00  0.00  0.00  0\n"
                   + "\n".join(_good_rows()) + "\n")
    (table,) = parse_nccl_tests(log.read_text())
    assert len(table.samples()) == 10


@pytest.mark.parametrize("sizes", [1, 2])
def test_calibrate_needs_three_sizes(capsys, tmp_path: Path, sizes: int) -> None:
    log = tmp_path / "ag.log"
    # one absurd-but-possible row next to a real one used to fit exactly (a line through two points) and be written
    rows = [_row(1024, 30.0), _row(2048, 9e9)][:sizes]
    log.write_text(HEADER + "\n".join(rows) + "\n")
    _fails(capsys, ["calibrate", str(log), "--base", "h100:8", "--out", str(tmp_path / "c.json")],
           f"it needs measurements at 3 or more sizes and found {sizes}")


def test_fit_samples_refuses_implausible_samples() -> None:
    good = [(1 << 20, 40e-6), (1 << 24, 80e-6), (1 << 28, 900e-6)]
    for bad in ((1 << 30, 1e-300), (1 << 30, math.nan), (1 << 30, math.inf), (-1, 1e-3)):
        with pytest.raises(PlannerError, match="is not a plausible measurement"):
            fit_samples([*good, bad], 8)
    alpha, busbw, _, _ = fit_samples(good, 8)
    assert math.isfinite(alpha) and math.isfinite(busbw) and busbw > 0


def test_calibrate_out_cannot_overwrite_its_input(capsys, tmp_path: Path) -> None:
    # the --out check itself is cli/requests.py's (check_paths); this pins the behaviour for calibrate
    log = tmp_path / "ag.json"  # a log with a .json name: --out would otherwise be allowed to replace it
    text = HEADER + "\n".join(_good_rows()) + "\n"
    log.write_text(text)
    _fails(capsys, ["calibrate", str(log), "--base", "h100:8", "--out", str(log)], f"--out '{log}'")
    assert log.read_text() == text


# ---- plan files ------------------------------------------------------------------------------------------------------
def _plan_dict() -> dict[str, Any]:
    return SizeBasedPolicy(2000).plan(traced("seed-net"), "seed-net").to_dict()


def _plan_file(tmp_path: Path, change: Callable[[dict[str, Any]], None] | None = None) -> Path:
    d = _plan_dict()
    if change:
        change(d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(grups=[]),
     "plan JSON has an unknown key 'grups' (did you mean 'groups'?); the accepted keys are version, model, policy, "
     "groups"),
    (lambda d: d["groups"][0].update(reshard_after_foward=False),
     "plan group 0 has an unknown key 'reshard_after_foward' (did you mean 'reshard_after_forward'?); the accepted "
     "keys are modules, params, reshard_after_forward, forward_prefetch, backward_prefetch"),
    (lambda d: d["groups"][-1].update(comment="root"), "plan group 2 has an unknown key 'comment'; the accepted keys"),
    (lambda d: d["model"].update(fingerprnt="x"), "plan 'model' object has an unknown key 'fingerprnt' (did you mean"),
    (lambda d: d.update(version=True),
     'unsupported plan version true: this fsdp-planner reads plans with "version": 1'),
    (lambda d: d.update(version=1.0), "unsupported plan version 1.0"),
    (lambda d: d.update(version="1"), 'unsupported plan version "1"'),
    (lambda d: d["groups"][0].update(reshard_after_forward=0), "reshard_after_forward must be true, false or a "
                                                               "positive whole number"),
    (lambda d: d["groups"][0].update(reshard_after_forward=-2), "got -2"),
    (lambda d: d["groups"][0].update(reshard_after_forward=2.0), "got 2.0"),
    (lambda d: d["groups"][0].update(reshard_after_forward="2"), 'got "2"'),
    (lambda d: d["model"].update(numel=-1), "plan 'model.numel' must be a whole number of 0 or more, got -1"),
    # sizes and names: bounded, and never echoed whole
    (lambda d: d["model"].update(numel=10**40), "plan 'model.numel' 100000000000000000000000000000...(41 characters) "
                                                "is more than 9,223,372,036,854,775,807 parameters"),
    (lambda d: d["groups"][0].update(reshard_after_forward=int("9" * 4000)),
     "reshard_after_forward 999999999999999999999999999999...(4000 characters) is more ranks than the 1,000,000"),
    (lambda d: d.update(policy="a" * 100_000), "plan 'policy' must be a string of at most 10,000 characters, got "
                                               '"aaaaaaaaaaaaaaaaaaaaaaaaaaaaa...(100002 characters)'),
    (lambda d: d.update(policy=["size"]), "plan 'policy' must be a string of at most 10,000 characters, got "
                                          "[\"size\"]"),
    (lambda d: d["model"].update(name={"a": 1}), "plan 'model.name' must be a string"),
    (lambda d: d["model"].update(fingerprint=7), "plan 'model.fingerprint' must be a string"),
    (lambda d: d.update(policy=None), "plan 'policy' must be a string of at most 10,000 characters, got null"),
    (lambda d: d["model"].update(name=None), "plan 'model.name' must be a string of at most 10,000 characters, got "
                                             "null"),
    (lambda d: d.update(groups=[{"modules": [f"m{i}"]} for i in range(100_001)]),
     "the plan has 100,001 groups; at most 100,000 are accepted"),
    (lambda d: d.update(mesh={"replicate": 10**30, "shard": 2}), "has more ranks than the 1,000,000 a cluster may"),
    (lambda d: d["groups"][0].update(forward_prefetch=[10**400]), "forward_prefetch names 10000000000000000000000000"),
    # names: module paths and public method names, refused at load time rather than inside the ranks
    (lambda d: d["groups"][0].update(modules=["a..b"]), "plan group 0 'modules': \"a..b\" is not a module path"),
    (lambda d: d["groups"][0].update(modules=["a."]), "plan group 0 'modules': \"a.\" is not a module path"),
    (lambda d: d["groups"][0].update(params=["x" * 100_001]), "plan group 0 'params': \"xxxxxxxxxxxxxx"),
    (lambda d: d.update(activation_checkpointing=[".x"]), "plan 'activation_checkpointing': \".x\" is not a module"),
    (lambda d: d.update(forward_methods=[{"module": "", "method": "__init__"}]),
     "plan 'forward_methods': method \"__init__\" is not a public method name"),
    (lambda d: d.update(forward_methods=[{"module": "", "method": "__class__"}]), 'method "__class__" is not a'),
    (lambda d: d.update(forward_methods=[{"module": "", "method": "_helper"}]), 'method "_helper" is not a public'),
    (lambda d: d.update(forward_methods=[{"module": "", "method": "class"}]), 'method "class" is not a public'),
    (lambda d: d.update(forward_methods=[{"module": "a..b", "method": "loss"}]), 'module "a..b" is not a module'),
])
def test_plan_json_is_read_strictly(capsys, tmp_path: Path, change, message: str) -> None:
    path = _plan_file(tmp_path, change)
    with pytest.raises(PlannerError, match=None) as e:
        Plan.load(path)
    assert message in str(e.value)
    line = _fails(capsys, ["simulate", "seed-net", "--plan", str(path), "--cluster", "h100:8"], message)
    assert len(line) < 300


def test_plan_numel_is_compared_with_the_model(capsys, tmp_path: Path) -> None:
    path = _plan_file(tmp_path, lambda d: d["model"].update(numel=d["model"]["numel"] + 1))
    numel = traced("seed-net").numel
    _fails(capsys, ["simulate", "seed-net", "--plan", str(path), "--cluster", "h100:8"],
           f"the plan's 'model.numel' is {numel + 1:,} but this model has {numel:,} parameters")


def test_module_dict_keys_that_are_not_identifiers_read_back(tmp_path: Path) -> None:
    """torch allows any key without a dot in an nn.ModuleDict: a plan written for such a model must load."""
    plan = Plan.from_json(json.dumps(_plan_dict()))
    plan = plan.with_group(0, modules=["blocks.block-1", "blocks.2"]).replace(
        forward_methods=[("blocks.block-1", "loss")])
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert list(again.groups[0].modules) == ["blocks.block-1", "blocks.2"]
    assert list(again.forward_methods) == [("blocks.block-1", "loss")]


def test_plan_as_written_still_loads(tmp_path: Path) -> None:
    path = _plan_file(tmp_path, lambda d: d["groups"][0].update(reshard_after_forward=4))
    plan = Plan.load(path)
    assert plan.groups[0].reshard_after_forward == 4
    check_plan_world_size(plan, 8)


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 100_000 + "]" * 100_000, "is not valid JSON: it nests too deeply to read"),
    ('{"version": 1, "model": {"numel": ' + "9" * 5000 + "}}", "is not valid JSON: it holds a number too long"),
    ('{"version": 1, "groups": [' + "{}," * 4_000_000 + "{}]}", "is not valid JSON: it holds more than 4,000,000 "
     "values (counted from its commas and brackets), far more than any plan or config holds"),  # (a trial's 198 MB
    # of them took 5.2 GB before it was refused)
], ids=["deep", "long-int", "many-values"])
def test_unreadable_plan_json(capsys, tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    _fails(capsys, ["simulate", "seed-net", "--plan", str(path), "--cluster", "h100:8"],
           f"plan file '{path}' {message}")


def test_check_plan_world_size() -> None:
    plan = Plan.from_json(json.dumps(_plan_dict()))
    for ok, world in ((True, 3), (False, 3), (1, 3), (4, 8), (8, 8), (2, 64)):
        check_plan_world_size(plan.with_group(0, reshard_after_forward=ok), world)
    for bad, world in ((3, 8), (16, 8), (5, 64)):
        bad_plan = plan.with_group(0, reshard_after_forward=bad)
        with pytest.raises(PlannerError, match=f"plan group 0 has reshard_after_forward={bad}, which FSDP2 needs to "
                                               f"divide the world size of {world} ranks"):
            check_plan_world_size(bad_plan, world)
    with pytest.raises(PlannerError, match=r"use true, false or one of 1, 2, 3, 4, 5, 6, 8, 9, \.\.\., 720"):
        check_plan_world_size(plan.with_group(0, reshard_after_forward=7), 720)


@pytest.mark.parametrize(("argv", "world"), [
    (["simulate", "seed-net", "--cluster", "h100:8"], 8),
    (["simulate", "seed-net", "--cluster", "h100:64"], 64),
    (["verify", "seed-net", "--nproc", "2"], 2),  # refused before any torchrun starts
])
def test_plan_file_meets_the_world_size(capsys, tmp_path: Path, argv: list[str], world: int) -> None:
    path = _plan_file(tmp_path, lambda d: d["groups"][0].update(reshard_after_forward=3))
    _fails(capsys, [*argv, "--plan", str(path)],
           f"plan group 0 has reshard_after_forward=3, which FSDP2 needs to divide the world size of {world} ranks")


# ---- sizes on the command line ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "toy-llama", "--policy", "size", "--batch", "99999999999999999999"],
     "--batch must be at most 1,000,000, got 99999999999999999999"),
    (["plan", "toy-llama", "--policy", "size", "--seq", "1e30"], "--seq must be at most 10,000,000, got 1e30"),
    (["plan", "toy-llama", "--policy", "size", "--batch", "1000", "--seq", "1e7"],
     "--batch 1,000 x --seq 10,000,000 is 10,000,000,000 tokens per rank; at most 1,000,000,000 are supported"),
    (["plan", "toy-llama", "--policy", "size", "--batch", "9" * 20_000], "--batch '999999999999999999999999999999..."
                                                                         "(20000 characters)' is 20,000 characters"),
    (["cost", "all-gather", "9" * 20_000 + "!", "--cluster", "h100:8"], "is 20,001 characters long: not a size"),
    (["cost", "all-gather", "1e300", "--cluster", "h100:8"], "the size '1e300' is too large: at most 1 EiB"),
    (["plan", "seed-net", "--policy", "auto", "--memory-budget", "1e300"], "--memory-budget '1e300' is too large"),
    (["plan", "seed-net", "--policy", "auto", "--search-effort", "1e100"], "--search-effort must be at most "
                                                                          "1,000,000,000, got 1e100"),
    (["plan", "seed-net", "--policy", "size", "--min-nonwrapped-numel", "1e100"],
     "--min-nonwrapped-numel must be at most 1,000,000,000,000,000 parameters, got 1e100"),
    (["simulate", "seed-net", "--policy", "size", "--cluster", "h100:8", "--mfu", "1e-300"],
     "--mfu must be from 0.001 to 1"),
    (["simulate", "seed-net", "--policy", "size", "--cluster", "h100:8", "--mfu", "nan"], "got nan"),
    (["verify", "seed-net", "--policy", "size", "--nproc", "99999999999"], "--nproc must be from 1 to 64"),
    (["verify", "seed-net", "--policy", "size", "--steps", "1000000000"], "--steps must be from 1 to 100,000"),
    (["verify", "seed-net", "--policy", "size", "--time-steps", "1000000000"], "--time-steps must be from 0 to"),
], ids=["batch-1e20", "seq-1e30", "tokens", "batch-20000-digits", "size-20000-digits", "size-1e300", "budget-1e300",
        "effort-1e100", "numel-1e100", "mfu-tiny", "mfu-nan", "nproc", "steps", "time-steps"])
def test_sizes_are_bounded_in_one_line(capsys, argv: list[str], message: str) -> None:
    line = _fails(capsys, argv, message)
    assert len(line) < 300


def test_parse_size_answers_at_once_on_a_long_run_of_digits() -> None:
    """The size pattern backtracks quadratically: 20,000 digits and a stray character took 33 s before the length
    bound."""
    import time

    from fsdp_planner.fmt import parse_size

    start = time.perf_counter()
    with pytest.raises(PlannerError, match="characters long: not a size"):
        parse_size("9" * 1_000_000 + "!")
    assert time.perf_counter() - start < 1.0
    assert parse_size("1.5e6GiB") == round(1.5e6 * 2**30)


def test_the_size_limit_is_said_in_units_the_parser_reads() -> None:
    """The limit is "1 EiB": 1EiB and 1PiB are read, 2EiB is too large (all three were "cannot read": a new user's
    finding); a bare "e" is no unit ("1e" is a cut exponent, not an exbibyte)."""
    from fsdp_planner.fmt import parse_size

    assert (parse_size("1EiB"), parse_size("1PiB"), parse_size("2PB")) == (2**60, 2**50, 2 * 10**15)
    with pytest.raises(PlannerError, match=re.escape("--memory-budget '2EiB' is too large: at most 1 EiB")):
        parse_size("2EiB", "--memory-budget")
    with pytest.raises(PlannerError, match="cannot read --memory-budget '1e' as a size"):
        parse_size("1e", "--memory-budget")


# ---- long arguments are never echoed whole --------------------------------------------------------------------------
LONG = "x" * 100_000


@pytest.mark.parametrize("argv", [
    ["plan", "seed-net", "--policy", LONG],
    ["plan", LONG, "--policy", "size"],
    ["simulate", "seed-net", "--policy", "size", "--cluster", "h100:8", "--precision", LONG],
    ["plan", "seed-net", "--policy", "titan", "--module-classes", LONG],
    ["plan", "seed-net", "--policy", "size", "--out", LONG],
    ["plan", "seed-net", f"--{LONG}"],
    [LONG],
], ids=["choice", "model", "precision", "module-classes", "out", "option", "command"])
def test_a_long_argument_is_cut_short_in_the_error(capsys, argv: list[str]) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[:300]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in err, err[:300]
    assert "...(100,0" in lines[0] and len(lines[0]) < 1000, lines[0][:300]


def test_one_line_keeps_the_first_line_of_a_multi_line_error() -> None:
    from fsdp_planner.errors import one_line

    backtrace = "randn(): Overflow when unpacking long long\nException raised from THPUtils_unpackLong\nframe #0: ..."
    assert one_line(backtrace) == ("randn(): Overflow when unpacking long long (+2 more lines: FSDP_PLANNER_DEBUG=1 "
                                   "shows them)")
    assert one_line("a short line") == "a short line"
    assert len(one_line(" ".join(["word"] * 1000))) <= 1000


def test_memory_world_size_is_bounded(capsys) -> None:
    """`memory --world-size 2**63` ended in 'internal error: OverflowError', 1e15 printed PiB figures."""
    for world in ("9223372036854775808", "1000000000000000", "0"):
        _fails(capsys, ["memory", "seed-net", "--world-size", world], "--world-size must be from 1 to 1,000,000")


def test_the_plan_writer_writes_only_what_reads_back(capsys, tmp_path: Path) -> None:
    """A plan the reader would refuse is one line at write time (a module name beyond MAX_NAME), and what the tool
    produces for real models reads back: a 2e15-element model's numel, a 5,000-character ModuleDict key, a policy
    of a class named 3,000 times (each named once)."""
    from fsdp_planner.fsdp2.plan import MAX_NAME

    d = _plan_dict()
    d["groups"][0]["modules"] = ["k" * 5000]
    plan = Plan.from_json(json.dumps(d))
    assert Plan.from_json(plan.replace(numel=2 * 10**15).checked_json()).numel == 2 * 10**15
    assert list(Plan.from_json(plan.checked_json()).groups[0].modules) == ["k" * 5000]
    plan = plan.with_group(0, modules=["k" * (MAX_NAME + 1)])
    with pytest.raises(PlannerError, match="cannot write this plan: it would not read back"):
        plan.checked_json()
    out = tmp_path / "mc.json"
    assert main(["plan", "toy-llama", "--policy", "module", "--module-classes", ",".join(["Linear"] * 3000),
                 "--out", str(out), "-q"]) == 0
    capsys.readouterr()
    assert Plan.load(out).policy == "module(Linear)"


@pytest.mark.parametrize("method", ["nosuch", "training"])
def test_check_and_simulate_refuse_a_forward_method_the_module_lacks(capsys, tmp_path: Path, method: str) -> None:
    """verify refused it; check and simulate accepted it (the trace records only the methods the step called)."""
    out = tmp_path / "t.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--out", str(out), "-q"]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    d["forward_methods"] = [{"module": "layers.0", "method": method}]
    out.write_text(json.dumps(d))
    message = f"registers 'layers.0.{method}' but TransformerBlock 'layers.0' has no method '{method}'"
    _fails(capsys, ["check", "toy-llama", "--plan", str(out)], message)
    _fails(capsys, ["simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8"], message)


def test_check_warns_of_a_method_registered_on_a_module_no_group_lists(capsys, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--out", str(out), "-q"]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    # (nn.Linear defines its own extra_repr: nn.Module's own methods are refused as forward methods)
    d["forward_methods"] = [{"module": "layers.0.attention.wq", "method": "extra_repr"}]
    out.write_text(json.dumps(d))
    assert main(["check", "toy-llama", "--plan", str(out), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)
    assert [(f["severity"], f["module"]) for f in findings if f["code"] == "forward-method"] == \
        [("warning", "layers.0.attention.wq")]
    assert "no group lists layers.0.attention.wq" in findings[-1]["message"]


def test_the_lines_an_error_leaves_out_are_shown_under_debug(monkeypatch, capsys) -> None:
    """A failed torchrun job's error names the cause on its first line and the other ranks' failures below: the
    line says how many it leaves out and FSDP_PLANNER_DEBUG=1 shows them (they were never shown)."""
    import fsdp_planner.cli as cli

    def failing(argv):  # type: ignore[no-untyped-def]
        raise PlannerError("verify job failed: rank 0 raised X\n  then rank 1 failed in a collective: Y")

    monkeypatch.setattr(cli, "_run", failing)
    assert cli.main(["plan"]) == 2
    assert capsys.readouterr().err == ("error: verify job failed: rank 0 raised X (+1 more lines: FSDP_PLANNER_DEBUG=1 "
                                       "shows them)\n")
    monkeypatch.setenv("FSDP_PLANNER_DEBUG", "1")
    assert cli.main(["plan"]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == ["  then rank 1 failed in a collective: Y"]


def test_check_without_a_cluster_meets_the_ranks_the_plan_was_made_for(tmp_path: Path) -> None:
    """A plan made for 8 ranks whose group 0 is given reshard_after_forward=3: check without --cluster reports the
    error on those 8 ranks (it said "FSDP2 accepts this plan": a new user's trial)."""
    from conftest import run_main

    made = tmp_path / "p.json"
    assert run_main("plan", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--out", str(made)).returncode == 0
    data = json.loads(made.read_text())
    assert data["workload"]["ranks"] == 8
    data["groups"][0]["reshard_after_forward"] = 3
    edited = tmp_path / "raf3.json"
    edited.write_text(json.dumps(data))
    done = run_main("check", "toy-llama", "--plan", str(edited), "--json")
    assert done.returncode == 1
    found = json.loads(done.stdout)
    (error,) = [f for f in found if f["severity"] == "error"]
    assert error["code"] == "reshard-after-forward" and "divide the world size of 8 ranks" in error["message"]


def test_calibrate_refuses_a_base_preset_of_another_gpu_than_the_logs(capsys, tmp_path: Path) -> None:
    """H100 logs fitted onto the A100 preset (a trial: exit 0, 346 GB/s on the A100's 235 GB/s NVLink) are refused;
    the logs' own GPU, or a cluster JSON of a GPU none of the presets is (the user's word), is taken."""
    log = Path(__file__).parent / "fixtures" / "nccl" / "all_gather_perf_8xh100.log"
    _fails(capsys, ["calibrate", str(log), "--base", "a100:8", "--out", str(tmp_path / "c.json")],
           "the logs ran on \"NVIDIA H100 80GB HBM3\" (the h100 preset's H100-SXM-80GB) but the base cluster "
           "\"a100:8\" has A100-SXM4-80GB GPUs")
    assert not (tmp_path / "c.json").exists()
    assert main(["calibrate", str(log), "--base", "h100:8", "--out", str(tmp_path / "c.json")]) == 0
    own = json.loads((tmp_path / "c.json").read_text())
    own["gpu"]["name"] = "my-h100"
    (tmp_path / "own.json").write_text(json.dumps(own))
    assert main(["calibrate", str(log), "--base", str(tmp_path / "own.json"), "--out", str(tmp_path / "d.json")]) == 0
    # a variant of the logs' GPU (h100e of an H100's) is the user's word, and so is any base of mixed GPUs' logs,
    # which only a base can calibrate (a review: both refused, the second after being told to give one)
    assert main(["calibrate", str(log), "--base", "h100e:8", "--out", str(tmp_path / "e.json")]) == 0
    h200 = tmp_path / "h200.log"
    h200.write_text(log.read_text().replace("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    assert main(["calibrate", str(log), str(h200), "--base", "h100:8", "--out", str(tmp_path / "f.json")]) == 0
