"""calibrate --trace: torch.profiler traces read with bounds and read back exactly (``calibrate/kineto.py``), a
cluster fitted to them (``calibrate/trace_fit.py``), and real CPU traces of a verify job."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from conftest import run_main

from fsdp_planner.calibrate.kineto import Collective, OpClass, Step, matmul_flops, parse_trace, read_trace
from fsdp_planner.calibrate.trace_fit import cpu_base, fit_collectives
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.hardware.cost import collective_time
from tests.kineto_fixture import gpu_trace


def _read(data: object, tmp_path: Path, name: str = "t.json") -> object:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return read_trace(path)


def test_gpu_fixture_read_back_exactly(tmp_path: Path) -> None:
    data, expected = gpu_trace(steps=3)
    tr = _read(data, tmp_path)
    assert tr.device == "cuda" and tr.world == 8 and len(tr.steps) == 3
    assert [s.seconds for s in tr.steps] == pytest.approx(expected.steps, rel=1e-12)
    for step in tr.steps:
        assert {c.value: v for c, v in step.op_seconds.items()} == pytest.approx(expected.classes, rel=1e-12)
        assert {c.value: n for c, n in step.op_counts.items()} == expected.counts
        got = sorted((c.kind.value, c.nbytes, c.ranks, c.seconds) for c in step.collectives)
        assert got == pytest.approx(sorted(expected.collectives))
        assert step.forward > 0 and step.backward > 0


def test_epoch_timestamps_read_the_same(tmp_path: Path) -> None:
    """Older Kineto writes Unix-epoch microseconds (1.7e15 in 2024): read as any other clock."""
    data, expected = gpu_trace(steps=2)
    for e in data["traceEvents"]:
        if "ts" in e:
            e["ts"] += 1_700_000_000_000_000
    assert [s.seconds for s in _read(data, tmp_path).steps] == pytest.approx(expected.steps, rel=1e-9)


def test_gzip_trace_reads_the_same(tmp_path: Path) -> None:
    data, expected = gpu_trace(steps=2)
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    assert [s.seconds for s in read_trace(path).steps] == pytest.approx(expected.steps, rel=1e-12)


@pytest.mark.parametrize(("text", "words"), [
    ('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 1, "dur"', "truncated"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 1e999, "dur": 1}]}', "no profiler writes"),
    ('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": ' + "9" * 5000 + ', "dur": 1}]}',
     "no profiler writes"),
    ('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": NaN, "dur": 1}]}', "no profiler writes"),
    ('{"nodes": []}', "not a Chrome trace"),
    ('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 1}]}', "no ProfilerStep#"),
    ('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 1, "dur": -5}]}',
     "has ProfilerStep# ranges but none a profiler writes \\(the first: its 'dur' is not a non-negative number"),
    # (it said it had none; then, of a step whose args were a list, that its time was not one a profiler writes)
    ('{"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 1, "dur": 5, "args": [1]}]}',
     "the first: its 'args' is not an object"),
    ('{"traceEvents": [{"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 1, "dur": 5}]}',
     "has ProfilerStep# ranges on the GPU only"),  # (it said "the first: None")
    ("\x80\x04\x95pickle", "not text"),
    # the events are read one at a time (a trace parsed whole took 13x its size): json's own refusals still hold
    # (Python 3.13's json says "Illegal trailing comma before end of ..." where 3.11's says what it expected)
    ('{"traceEvents": [{"ph": "i", "name": "x"},]}', "not valid JSON: (Expecting value|Illegal trailing comma)"),
    ('{"traceEvents": [], }', "not valid JSON: (Expecting property name enclosed in double quotes|Illegal trailing)"),
    ('{"traceEvents": [] "x": 1}', "not valid JSON: Expecting ',' delimiter"),
    ('{"traceEvents" []}', "not valid JSON: Expecting ':' delimiter"),
    ('{"traceEvents": []} []', "not valid JSON: Extra data"),
    ('{"traceEvents": {"ph": "X"}}', "not a Chrome trace"),
    ("", "not valid JSON \\(truncated\\?\\): Expecting value"),
])
def test_bad_traces_are_one_line(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode("latin-1") if text.startswith("\x80") else text.encode())
    with pytest.raises(PlannerError, match=words) as e:
        read_trace(path)
    assert "\n" not in str(e.value) and "bad.json" in str(e.value)


def test_a_trace_reads_the_same_in_any_key_order_or_as_a_bare_list(tmp_path: Path) -> None:
    """The events are read as the reader reaches them: ``distributedInfo`` after them, or no object around them
    (a list of events, as Chrome's trace format allows), read as before."""
    data, expected = gpu_trace(steps=2)
    last = {"traceEvents": data["traceEvents"], **{k: v for k, v in data.items() if k != "traceEvents"}}
    assert list(last).index("traceEvents") < list(last).index("distributedInfo")
    read = _read(last, tmp_path)
    assert (read.world, [s.seconds for s in read.steps]) == (8, pytest.approx(expected.steps, rel=1e-12))
    (tmp_path / "list.json").write_text(json.dumps(data["traceEvents"]))
    with pytest.raises(PlannerError, match=r"has no distributedInfo\.world_size, and its steps run collectives"):
        read_trace(tmp_path / "list.json")  # (its steps and their collectives read: over how many ranks is not said)


def test_a_trace_of_too_many_events_is_refused_as_it_is_read(tmp_path: Path, monkeypatch) -> None:
    from fsdp_planner.calibrate import kineto

    monkeypatch.setattr(kineto, "MAX_EVENTS", 50)
    with pytest.raises(PlannerError, match=r"t\.json' has more than 50 events: profile fewer steps$"):
        _read(gpu_trace(steps=2)[0], tmp_path)


def test_hostile_values_are_skipped_or_refused(tmp_path: Path) -> None:
    data, _ = gpu_trace(steps=1)
    data["traceEvents"] += ["junk", None, {"ph": "i", "name": 5}]
    assert len(_read(data, tmp_path).steps) == 1  # events no profiler writes are not read
    # complete events without a name or time a profiler writes are refused: skipped, an op's time went missing and
    # the steps read as another job's ("its steps hold no ops": a new user's trial)
    data["traceEvents"] += [{"ph": "X", "name": 5, "ts": 1, "dur": 1}, {"ph": "X", "name": "x", "ts": "1"},
                            {"ph": "X", "name": "y", "ts": 1e20, "dur": 1}]
    with pytest.raises(PlannerError, match=r"has 3 complete events \('ph': 'X'\) a profiler would not write \(the "
                                           r"first: its 'name' is not a string\)"):
        _read(data, tmp_path)
    data["traceEvents"] = data["traceEvents"][:-3]
    # a kernel's correlation id that is no number is no launch (a list or a table was a TypeError: a review)
    kernel = next(e for e in data["traceEvents"] if e.get("cat") == "kernel" and "nccl" not in e["name"].lower())
    for odd in ([1], {"a": 1}):
        kernel["args"]["correlation"] = odd
        assert len(_read(data, tmp_path).steps) == 1
    comm = next(e for e in data["traceEvents"] if e.get("name") == "record_param_comms")
    comm["args"]["dtype"] = "Mystery"
    with pytest.raises(PlannerError, match="record_param_comms"):
        _read(data, tmp_path)
    del comm["args"]["Collective name"]  # as torch's older traces write it: no sizes at all
    with pytest.raises(PlannerError, match=r"no collective name or size.*newer torch"):
        _read(data, tmp_path)
    data["distributedInfo"]["world_size"] = -3
    with pytest.raises(PlannerError, match="world_size"):
        _read(data, tmp_path)


def test_damaged_traces_are_one_line(tmp_path: Path) -> None:
    """What a new user's edits of a trace made, each refused in one line (each had been read: a gzip header before
    junk gave "internal error", overlapping or repeated steps and a trace without its world size calibrated a
    cluster off by 25x)."""
    data, _ = gpu_trace(steps=2)
    steps = [e for e in data["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    steps[1]["ts"] = steps[0]["ts"] + 1
    with pytest.raises(PlannerError, match="has steps ProfilerStep#1 and ProfilerStep#2 that overlap"):
        _read(data, tmp_path)
    data, _ = gpu_trace(steps=2)
    del data["distributedInfo"]
    with pytest.raises(PlannerError, match=r"has no distributedInfo\.world_size, and its steps run collectives"):
        _read(data, tmp_path)
    (tmp_path / "t.json.gz").write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + b"\xff" * 64)
    with pytest.raises(PlannerError, match="is not a gzip file its header says it is"):
        read_trace(tmp_path / "t.json.gz")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(gpu_trace(steps=2)[0]).encode())
    assert len(read_trace(tmp_path / "bom.json").steps) == 2  # (an editor's BOM: Python's advice was the message)
    (tmp_path / "t.json").write_text('{"traceEvents": [{"name": "x')
    with pytest.raises(PlannerError, match=r"is not valid JSON \(truncated\?\): Unterminated string starting at line"):
        read_trace(tmp_path / "t.json")
    # a kernel's args not an object (its correlation gone: the step's phases read 10% off), a key twice (the last
    # traceEvents read): both had been read without a word (a trial)
    data, _ = gpu_trace(steps=2)
    next(e for e in data["traceEvents"] if e.get("cat") == "kernel")["args"] = "x"
    with pytest.raises(PlannerError, match=r"has 1 complete event \('ph': 'X'\) a profiler would not write \(the "
                                           r"first: its 'args' is not an object\): an edited or damaged trace"):
        _read(data, tmp_path)
    text = json.dumps(gpu_trace(steps=2)[0])
    (tmp_path / "twice.json").write_text(text[:-1] + ', "traceEvents": []}')
    with pytest.raises(PlannerError, match='has the key "traceEvents" twice in one object, which no profiler writes'):
        read_trace(tmp_path / "twice.json")


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=f"trace file '{tmp_path}/nope.json' does not exist"):  # the path given
        read_trace(tmp_path / "nope.json")
    with pytest.raises(PlannerError, match="is a directory: give the trace files in it"):  # (it said "does not exist")
        read_trace(tmp_path)
    os.mkfifo(tmp_path / "fifo")  # (these said "does not exist" too)
    with pytest.raises(PlannerError, match="is not a regular file"):
        read_trace(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(PlannerError, match=r"cannot read trace file .*loop'"):
        read_trace(tmp_path / "loop")


def test_gpu_optimizer_kernels_are_its_phase() -> None:
    """Kernels launched in an ``Optimizer.step#`` range: in no op class's sum (the simulator prices the optimizer
    apart), but the GPU busy then (compute, not idle); the GPU timeline's copy of ``ProfilerStep#`` is no step."""
    def kernel(name: str, launch: int, start: int, dur: int, corr: int) -> list[dict]:
        return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": launch, "dur": 2,
                 "args": {"correlation": corr}},
                {"ph": "X", "cat": "kernel", "name": name, "tid": 7, "ts": start, "dur": dur,
                 "args": {"correlation": corr}}]
    data = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "tid": 7, "ts": 100, "dur": 7_900},
        *kernel("sm90_xmma_gemm_bf16", 10, 100, 4_000, 1),
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "tid": 1, "ts": 5_000,
         "dur": 1_000},
        *kernel("multi_tensor_apply_kernel", 5_010, 5_000, 3_000, 2)]}
    (step,) = parse_trace(json.dumps(data).encode(), "t").steps
    assert step.op_seconds == {OpClass.MATMUL: 4e-3, OpClass.ATTENTION: 0.0, OpClass.MEMORY: 0.0}
    assert step.op_counts[OpClass.MEMORY] == 0 and step.optimizer == pytest.approx(1e-3)
    assert step.seconds == pytest.approx(10e-3) and step.idle == pytest.approx(3e-3)  # 7 of 10 ms busy


def test_cpu_trace_shape() -> None:
    """A CPU step: outermost aten ops by name, gloo collectives sized from their c10d op."""
    data = {"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "tid": 1, "ts": 10, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "tid": 1, "ts": 20, "dur": 80},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "tid": 1, "ts": 200, "dur": 50},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::all_gather (layers.0)", "tid": 1, "ts": 300,
         "dur": 300},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 1, "ts": 310, "dur": 20},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "tid": 1, "ts": 340, "dur": 10,
         "args": {"Input Dims": [[2048], [1024]], "Input type": ["c10::BFloat16", "c10::BFloat16"]}},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "tid": 2, "ts": 345, "dur": 200},
        {"ph": "X", "cat": "cpu_op", "name": "aten::_scaled_dot_product_flash_attention_for_cpu", "tid": 1,
         "ts": 700, "dur": 90}]}
    step = parse_trace(json.dumps(data).encode(), "t").steps[0]
    assert step.op_seconds == {OpClass.MATMUL: 100e-6, OpClass.ATTENTION: 90e-6, OpClass.MEMORY: 50e-6}
    (c,) = step.collectives
    assert (c.kind.value, c.nbytes, c.ranks) == ("all_gather", 4096, 2) and c.seconds == pytest.approx(205e-6)
    assert step.exposed_comm == pytest.approx(205e-6)


def test_a_gloo_list_collective_says_what_to_calibrate_from() -> None:
    """gloo's list collectives (FSDP2's HSDP all-reduce, TP's coalesced ones) carry no dtype: the trace was called
    one 'no profiler writes' (a trial's own verify --mesh 2x1 --profile trace)."""
    data = {"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::post_backward_reduce", "tid": 1, "ts": 300, "dur": 300},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "tid": 1, "ts": 340, "dur": 10,
         "args": {"Input Dims": [[[16448]], [], [], [], [], []], "Input type": ["TensorList", "", "", "", "Scalar",
                                                                                "Scalar"]}},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": 2, "ts": 345, "dur": 200}]}
    with pytest.raises(PlannerError, match=r"^t: collective c10d::allreduce_ takes a list of tensors .* calibrate from "
                                           r"a trace of the job's plan without HSDP or TP"):
        parse_trace(json.dumps(data).encode(), "t")


def _gloo_step(calls: dict[int, list[float]]) -> Step:
    """A CPU step whose all-gathers of each size took these seconds."""
    collectives = tuple(Collective(CollectiveKind.ALL_GATHER, n, 2, t) for n, ts in calls.items() for t in ts)
    zero = dict.fromkeys(OpClass, 0.0)
    return Step(0.1, zero, dict.fromkeys(OpClass, 0), collectives, 0.0, 0.05, 0.05, 0.0, 0.0, 0.0)


def test_gloo_collectives_are_the_least_delayed_calls_line_plus_the_mean_wait() -> None:
    """On CPU ranks a call's time is mostly waiting (behind earlier gloo calls, on a busy peer), which does not grow
    with the bytes: the line is fitted on each size's least-delayed quarter of calls, and each size is charged that
    line plus the mean call's wait, so the traced calls cost what they took in all and a larger size grows at the
    line's rate, not at the means' noisy slope."""
    rate = 1e9  # bytes/s of the transfer the least-delayed calls show, 100 us latency
    transfer = {n: 1e-4 + n / 2 / rate for n in (32 << 10, 96 << 10, 160 << 10)}
    waits = [0.0, 0.0, 0.0, 0.0, 2e-3, 4e-3]  # some calls wait, those of the largest size here three times as long
    calls = {n: [t + w * (1 + 2 * (i == 2)) for w in waits] for i, (n, t) in enumerate(transfer.items())}
    cluster = fit_collectives(cpu_base(2), [_gloo_step(calls)] * 3)
    alpha, busbw = cluster.fits["all_gather"][2]
    assert alpha == pytest.approx(1e-4, rel=1e-6) and busbw == pytest.approx(rate, rel=1e-6)
    every = [t for ts in calls.values() for t in ts]
    wait = sum(every) / len(every) - sum(transfer[n] for n, ts in calls.items() for _ in ts) / len(every)
    assert dict(cluster.tables["all_gather"]) == pytest.approx({n: t + wait for n, t in transfer.items()})
    charged = sum(collective_time(cluster, "all_gather", n, 2) for n, ts in calls.items() for _ in ts)
    assert charged == pytest.approx(sum(every))
    big = 1 << 20  # beyond the sizes measured: the line and the same wait
    assert collective_time(cluster, "all_gather", big, 2) == pytest.approx(1e-4 + big / 2 / rate + wait)
    # calls whose least-delayed times do not grow with the bytes show no bandwidth: the base cluster's line stays
    flat = fit_collectives(cpu_base(2), [_gloo_step({n: [3e-4] * 4 + [2e-3] for n in transfer})])
    assert "all_gather" not in flat.fits and "all_gather" in flat.tables
    # a group over strided ranks (a TP job's data-parallel one, one rank a node) is no packed run: not fitted (a
    # review found its fit read as a one-node one, and the view's group over 2 nodes on the preset's line)
    strided = fit_collectives(cpu_base(2), [_gloo_step(calls)] * 3, strided=frozenset({2}))
    assert "all_gather" not in strided.fits and "all_gather" not in strided.tables


@pytest.mark.integration
def test_verify_profile_then_calibrate(tmp_path: Path) -> None:
    """A real 2-rank gloo job's traces: its collectives are what verify counted, and calibrate fits a cluster that
    reproduces the traced step."""
    done = run_main("verify", "toy-llama", "--policy", "titan", "--nproc", "2", "--time-steps", "0", "--profile",
                    str(tmp_path / "p"), "--json")
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout)
    tr = read_trace(tmp_path / "p" / "rank0.json")
    assert tr.device == "cpu" and tr.world == 2 and len(tr.steps) == 3
    times = json.loads((tmp_path / "p" / "rank0.cpu.json").read_text())  # each step's wall and CPU seconds
    assert times["wall"] == pytest.approx([s.seconds for s in tr.steps], rel=0.2)
    assert len(times["cpu"]) == 3 and all(c > 0 for c in times["cpu"])
    for step in tr.steps:
        gathered = sum(c.nbytes for c in step.collectives if c.kind.value == "all_gather")
        assert gathered == counted["counted_bytes"][0]["all_gather"]
        assert step.op_seconds[OpClass.MATMUL] > 0 and step.seconds > step.compute_seconds
    out = tmp_path / "c.json"
    done = run_main("calibrate", "--trace", str(tmp_path / "p" / "rank0.json"), "--model", "toy-llama", "--policy",
                    "titan", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    fit = json.loads(done.stdout)["fit"]
    assert fit["optimizer"] is False  # verify --profile's steps run forward and backward alone
    assert fit["after_step"] == pytest.approx(fit["measured_step"], rel=0.02)
    assert fit["after_step"] == fit["after"]["step_time"] - fit["after"]["gpu_optimizer_time"]
    # before and after are STEPs as every command writes them: no timeline, no TP keys without TP
    assert not {"timeline", "tp_degree", "ep_degree"} & (fit["before"].keys() | fit["after"].keys())
    assert json.loads(out.read_text())["engine"] == "host"
    # the same traces given as another job's are refused, not fitted (a cluster fitted to them was written): another
    # model, another workload (its matmuls' FLOPs from their ops' shapes), another precision (FSDP2's bytes)
    trace = ["calibrate", "--trace", str(tmp_path / "p" / "rank0.json"), "--out", str(tmp_path / "x.json")]
    for job, says in ((["--model", "toy-gpt2-tied", "--policy", "titan"], "matmuls where the plan's runs"),
                      (["--model", "toy-llama", "--policy", "titan", "--batch", "8"], "GFLOP a step where the plan's"),
                      (["--model", "toy-llama", "--policy", "titan", "--precision", "fp32"], "all-gathers 11 times")):
        done = run_main(*trace, *job)
        assert done.returncode == 2 and says in done.stderr and "the traces are not of the job given" in done.stderr
        assert not (tmp_path / "x.json").exists()
    # one profiled step (a trial's trace cut to ProfilerStep#1, the slowest) was fitted as typical without a word
    assert "profiled step" not in run_main("calibrate", "--trace", str(tmp_path / "p" / "rank0.json"), "--model",
                                            "toy-llama", "--policy", "titan", "--out", str(out), "--force").stderr
    data = json.loads((tmp_path / "p" / "rank0.json").read_text())
    marks = sorted((e for e in data["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    data["traceEvents"] = [e for e in data["traceEvents"] if not any(e is m for m in marks[1:])]
    (tmp_path / "one.json").write_text(json.dumps(data))
    done = run_main("calibrate", "--trace", str(tmp_path / "one.json"), "--model", "toy-llama", "--policy", "titan",
                    "--out", str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert "the traces hold 1 profiled step: the fit takes each as typical" in " ".join(done.stderr.split())
    # every step of every trace is checked: a rank's trace of the job beside one whose collectives are gone (a
    # distributed job's step with none; with another job's trace the fit pooled both: a new user's trial) is
    # refused, by calibrate and by simulate --against alike
    data = json.loads((tmp_path / "p" / "rank1.json").read_text())
    data["traceEvents"] = [e for e in data["traceEvents"] if not str(e.get("name", "")).startswith("c10d::")]
    (tmp_path / "no_c10d.json").write_text(json.dumps(data))
    job = ["--model", "toy-llama", "--policy", "titan"]
    done = run_main("calibrate", "--trace", str(tmp_path / "p" / "rank0.json"), "--trace",
                    str(tmp_path / "no_c10d.json"), *job, "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and 'all-gathers 0 times a step (0 B) where the plan does 11 times' in done.stderr
    assert '(step 1 of "no_c10d.json")' in done.stderr and not (tmp_path / "x.json").exists()
    (tmp_path / "q").mkdir()  # two runs' rank0.json: the file named by its path (a trial could not tell which)
    (tmp_path / "q" / "rank0.json").write_text(json.dumps(data))
    done = run_main("calibrate", "--trace", str(tmp_path / "p" / "rank0.json"), "--trace",
                    str(tmp_path / "q" / "rank0.json"), *job, "--out", str(tmp_path / "x.json"))
    assert done.returncode == 2 and '(step 1 of "q/rank0.json")' in done.stderr, done.stderr
    simulated = ["simulate", "toy-llama", "--policy", "titan", "--cluster", str(out), "--against"]
    assert run_main(*simulated, str(tmp_path / "p" / "rank0.json")).returncode == 0
    done = run_main(*simulated, str(tmp_path / "no_c10d.json"))
    assert done.returncode == 2 and "the traces are not of the job given" in done.stderr
    done = run_main("simulate", "toy-llama", "--policy", "size", "--min-nonwrapped-numel", "20000", "--cluster",
                    str(out), "--against", str(tmp_path / "p" / "rank0.json"))  # another plan than the traced one
    assert done.returncode == 2 and "all-gathers 11 times a step" in done.stderr, done.stderr


def test_matmul_flops_from_input_dims() -> None:
    """A CPU op's FLOPs from its recorded shapes, as torch's counter counts them; None where they do not read as
    the op's (a foreign trace's values are data: never trusted to be shaped)."""
    assert matmul_flops("aten::mm", [[8, 16], [16, 4]]) == 2 * 8 * 16 * 4
    assert matmul_flops("aten::addmm", [[4], [8, 16], [16, 4], [], []]) == 2 * 8 * 16 * 4
    assert matmul_flops("aten::linear", [[2, 3, 16], [4, 16], [4]]) == 2 * 6 * 16 * 4
    assert matmul_flops("aten::bmm", [[2, 8, 16], [2, 16, 4]]) == 2 * 2 * 8 * 16 * 4
    for name, dims in (("aten::mm", [[8, 16], [15, 4]]), ("aten::mm", "x"), ("aten::mm", [[8, True], [1, 4]]),
                       ("aten::conv2d", [[1, 3, 8, 8], [4, 3, 3, 3]]), ("aten::mm", [[8, -16], [-16, 4]])):
        assert matmul_flops(name, dims) is None


def test_gpu_trace_calibrates_its_cluster(tmp_path: Path) -> None:
    """A GPU trace of Llama 3.2 3B's titan plan on an H100 node whose kernels run at other efficiencies than the
    preset's (written to the Kineto schema from the simulator's run on that truth): calibrating from the preset
    recovers the truth's efficiencies, and predicts the trace's step within 5%."""
    import dataclasses

    from fsdp_planner.calibrate.trace_fit import fit_trace
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners.registry import PolicyName, PolicyRequest
    from fsdp_planner.service.planning import policy_plan
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import simulate
    from tests.kineto_fixture import simulated_gpu_trace

    options = SimOptions.named("bf16-mixed")
    from fsdp_planner.models import ModelSpec

    spec = ModelSpec("llama32-3b", seq_len=2048)  # large enough that its matmuls are compute-bound on an H100
    tr = trace_spec(spec, options.precision, False, lambda line: None)
    base = parse_cluster("h100:8")
    truth = dataclasses.replace(base, compute=dataclasses.replace(
        base.compute, matmul_efficiency=0.45, attention_efficiency=0.3, memory_efficiency=0.55))
    plan = policy_plan(tr, PolicyRequest(PolicyName.TITAN), spec.name, truth, options)
    data = simulated_gpu_trace(tr, plan, truth, options)
    measured = _read(data, tmp_path)
    step = simulate(tr, plan, truth, options, timeline=False).step_time
    assert measured.step_seconds == pytest.approx(step, rel=1e-6)
    cluster, fit = fit_trace(tr, plan, [measured], base, options)
    for attr in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
        assert getattr(cluster.compute, attr) == pytest.approx(getattr(truth.compute, attr), rel=0.02), attr
    assert fit.before.step_time != pytest.approx(step, rel=0.05)  # the preset alone is off
    assert simulate(tr, plan, cluster, options, timeline=False).step_time == pytest.approx(step, rel=0.05)


def test_simulate_against_its_own_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``simulate --against`` a GPU trace the simulator wrote of the same plan on the same cluster: both steps on one
    axis in the PNG and the page, and phase by phase they agree (the measured side read from the trace, the
    simulated from the timeline)."""
    from fsdp_planner.cli import main
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners.registry import PolicyName, PolicyRequest
    from fsdp_planner.service.planning import policy_plan
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions
    from tests.kineto_fixture import simulated_gpu_trace

    options = SimOptions.named("bf16-mixed")
    tr = trace_spec("toy-llama", options.precision)
    cluster = parse_cluster("h100:8")
    plan = policy_plan(tr, PolicyRequest(PolicyName.TITAN), "toy-llama", cluster, options)
    (tmp_path / "t.json").write_text(json.dumps(simulated_gpu_trace(tr, plan, cluster, options)))
    args = ["simulate", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--against",
            str(tmp_path / "t.json")]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer_compared"] is True and out["measured"]["optimizer"] > 0  # the fixture's Optimizer.step#
    for phase in ("step", "forward", "backward", "compute", "optimizer"):
        assert out["measured"][phase] == pytest.approx(out["simulated"][phase], rel=0.01, abs=1e-6), phase
    assert len(out["gaps"]) == 3
    assert main([*args, "--html", str(tmp_path / "a.html"), "--timeline", str(tmp_path / "a.png")]) == 0
    page = (tmp_path / "a.html").read_text()
    assert "largest gaps" in page and "measured (rank 0): compute" in page and "simulated titan" in page
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_host_overhead_of_a_tp_plan_is_per_op_of_one_rank() -> None:
    """On CPU ranks the fitted per-op cost spreads what the step took beyond the simulated work over the ops one
    rank runs: its TP view's, with TP's collectives, not the whole model's (which differ in number), and the
    checkpointed blocks' recomputed ones, so the fitted cluster's step is the measured one."""
    from conftest import traced

    from fsdp_planner.calibrate.trace_fit import fit_overhead
    from fsdp_planner.planners.classic import TorchtitanPolicy
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import rank_step, simulate

    trace = traced("toy-llama")
    plan = TorchtitanPolicy("TransformerBlock").plan(trace).replace(tensor_parallel=titan_llama_layout(2))
    blocks = [m for m in trace.modules if m.count(".") == 1 and m.startswith("layers.")]
    plan = plan.replace(activation_checkpointing=blocks[:2])  # their recomputed ops are charged too
    base, options = cpu_base(4), SimOptions()
    assert rank_step(trace, plan, base)[0].index.ops_through[-1] != trace.index.ops_through[-1]
    bare = simulate(trace, plan, base, options, timeline=False).step_seconds(False)
    zero = dict.fromkeys(OpClass, 0.0)
    measured = Step(bare + 0.2, zero, dict.fromkeys(OpClass, 0), (), 0.05, 0.1, 0.1, 0.0, 0.0, 0.0)
    fitted = fit_overhead(trace, plan, base, [measured], options)
    assert fitted.overhead.op_seconds > 0
    assert simulate(trace, plan, fitted, options, timeline=False).step_seconds(False) == pytest.approx(bare + 0.2)


def test_traces_of_another_kind_of_job_are_refused(tmp_path: Path) -> None:
    """A CPU trace fitted against a GPU's peaks (efficiencies of a thousandth: a 567 s step), and a trace of a job
    without FSDP2 (no FSDP:: ranges), each one sentence, not a calibration (a new user's trial)."""
    from fsdp_planner.calibrate.trace_fit import fit_trace
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners.registry import PolicyName, PolicyRequest
    from fsdp_planner.service.planning import policy_plan
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.options import SimOptions
    from tests.kineto_fixture import simulated_gpu_trace

    options = SimOptions.named("bf16-mixed")
    tr = trace_spec("toy-llama", options.precision)
    cluster = parse_cluster("h100:8")
    plan = policy_plan(tr, PolicyRequest(PolicyName.TITAN), "toy-llama", cluster, options)
    data = simulated_gpu_trace(tr, plan, cluster, options)
    data["traceEvents"] = [e for e in data["traceEvents"] if not e["name"].startswith("FSDP::")]
    with pytest.raises(PlannerError, match=r"no FSDP:: ranges \(the job ran without FSDP2\)"):
        fit_trace(tr, plan, [_read(data, tmp_path)], cluster, options)
    cpu = {"distributedInfo": {"rank": 0, "world_size": 8}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "tid": 1, "ts": 20, "dur": 80}]}
    with pytest.raises(PlannerError, match=r"ran on the CPU \(no GPU kernels in them\) and --base h100:8 is a GPU"):
        fit_trace(tr, plan, [_read(cpu, tmp_path, "cpu.json")], cluster, options)
