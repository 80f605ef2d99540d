"""``fit``: the searches find the boundary of what fits, and each answer is what ``plan --policy auto`` says at that
workload or GPU count (the same trace, search and budget); ``check --cluster``'s answers."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from conftest import run_main

from fsdp_planner.cli import main
from fsdp_planner.hardware.cluster import preset_cluster
from fsdp_planner.planners.fit import (
    below_by_powers,
    largest_confirmed,
    largest_fitting,
    smallest_confirmed,
    smallest_fitting,
)

# toy-llama on 2 H100s at seq 256: batch 1 to ~11 fit, so the search takes 8 points (~0.3 s of CPU each)
BUDGET, SEQ = "12MiB", "256"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> dict:
    assert main([*argv, "--json", "--quiet"]) == status
    return json.loads(capsys.readouterr().out)


def test_largest_fitting_doubles_then_bisects():
    calls: list[int] = []

    def fits(v: int) -> bool:
        calls.append(v)
        return v <= 37

    assert largest_fitting(fits, 1, 10**6) == 37
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64] and len(calls) <= 13
    assert largest_fitting(lambda v: v <= 37, 1, 20) == 20  # the cap fits: the search stops there
    assert largest_fitting(lambda v: False, 1, 100) is None
    # from a start that does not fit: halving to a multiple of the step, then bisection to it
    assert largest_fitting(lambda v: v <= 5000, 8192, 10**6, step=128) == 4992
    assert largest_fitting(lambda v: v <= 50, 8192, 10**6, step=128) is None
    # to 1/16 of the answer's power of two: a few points, not log2(range / step)
    coarse = largest_fitting(lambda v: v <= 40000, 8192, 10**6, step=128, parts=16)
    assert coarse is not None and 40000 - 32768 // 16 <= coarse <= 40000


def test_smallest_fitting_doubles_then_bisects():
    assert smallest_fitting(lambda n: n >= 5, 512) == 5
    assert smallest_fitting(lambda n: n >= 1, 512) == 1
    assert smallest_fitting(lambda n: n >= 600, 512) is None


@pytest.mark.integration
def test_fit_batch_is_plans_boundary(capsys):
    """The largest batch fit finds fits with plan --policy auto, the next does not, and each row's figures are
    plan's at that batch, TP 2 screened as plan screens it (~9 s)."""
    doc = run_json(capsys, "fit", "toy-llama", "--cluster", "h100:2", "--memory-budget", BUDGET, "--seq", SEQ,
                   "--find", "batch")
    assert set(doc) >= {"model", "cluster", "budget", "batch", "points"} and "seq" not in doc
    largest = doc["batch"]["largest"]
    rows = {p["batch"]: p for p in doc["points"]}
    assert rows[largest]["fits"] and not rows[largest + 1]["fits"]
    tried = [p for p in doc["points"] if p["offload_tried"]]  # searched as plan searches (offload included)
    assert all(p["fits"] == (p["batch"] <= largest) for p in tried)  # monotone, as the search assumes
    assert doc["batch"]["next"]["batch"] == largest + 1
    plain = doc["batch"]["largest_without_offload"]  # auto offloads only when nothing else fits
    assert not rows[plain]["offload"] and all(p["offload"] for p in tried if plain < p["batch"] <= largest)
    # a point searched without offload only is past the answer without it
    assert all(not p["fits"] and p["batch"] > plain for p in doc["points"] if not p["offload_tried"])
    # (fit's batch is one forward's: plan without its default comparison of splits of the batch)
    plan = ("plan", "toy-llama", "--policy", "auto", "--cluster", "h100:2", "--memory-budget", BUDGET, "--seq", SEQ,
            "--micro-batches", "1")
    at = run_json(capsys, *plan, "--batch", str(largest))
    step = at["plans"][0]["simulation"]
    assert step["step_time"] == pytest.approx(rows[largest]["step_time"], rel=1e-9)
    assert step["reserved_memory"] == rows[largest]["reserved_memory"]
    assert rows[largest]["tokens_per_second_per_gpu"] == pytest.approx(largest * int(SEQ) / step["step_time"])
    assert main([*plan, "--batch", str(largest + 1), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: no plan fits the memory budget")
    for p in doc["points"]:
        assert set(p) >= {"batch", "seq", "gpus", "fits", "step_time", "reserved_memory", "budget", "margin",
                          "tokens_per_second_per_gpu", "tokens_per_second", "mfu", "layout", "checkpointed"}
        assert 0 <= p["mfu"] < 1


@pytest.mark.integration
def test_fit_seq_and_picture(capsys, tmp_path):
    """The longest sequence at --batch: it fits and the next sequence tried does not; the picture is written
    (3 s)."""
    picture = tmp_path / "fit.png"
    doc = run_json(capsys, "fit", "toy-llama", "--cluster", "h100:2", "--memory-budget", BUDGET, "--find", "seq",
                   "--batch", "2", "--seq", SEQ, "--picture", str(picture))
    longest = doc["seq"]["longest"]
    assert doc["seq"]["batch"] == 2 and "batch" not in doc
    seqs = {p["seq"]: p["fits"] for p in doc["points"] if p["offload_tried"]}
    assert seqs[longest] and all(fits == (s <= longest) for s, fits in seqs.items())
    assert any(not fits for fits in seqs.values())
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_fit_gpus_auto_is_plans_fewest(capsys, tmp_path):
    """--gpus auto on a cluster of 1-GPU nodes: one node fits only with CPU offload (auto's last resort), and the
    fewest nodes that fit without it are where plan --policy auto stops offloading (3 s)."""
    cluster = tmp_path / "one_gpu_nodes.json"
    preset_cluster("h100", nodes=1, gpus_per_node=1).save(cluster)
    budget = "2.6MB"
    doc = run_json(capsys, "fit", "toy-llama", "--cluster", str(cluster), "--gpus", "auto", "--batch", "1", "--seq",
                   "32", "--memory-budget", budget, "--max-gpus", "16")
    assert doc["gpus"]["fewest"] == 1 and doc["gpus"]["offload"] is True
    fewest = doc["gpus"]["fewest_without_offload"]
    rows = {p["gpus"]: p for p in doc["points"]}
    assert fewest > 1 and rows[fewest]["fits"] and not rows[fewest]["offload"]
    below = rows[fewest - 1]
    assert not below["fits"] or below["offload"]
    tried = [p for p in doc["points"] if p["offload_tried"]]  # searched as plan searches (offload included)
    assert all(p["offload"] == (p["gpus"] < fewest) for p in tried)  # monotone, as the search assumes
    plan = ("plan", "toy-llama", "--policy", "auto", "--batch", "1", "--seq", "32", "--memory-budget", budget)
    at = run_json(capsys, *plan, "--cluster", f"h100:{fewest}x1")
    assert at["plans"][0]["simulation"]["step_time"] == pytest.approx(rows[fewest]["step_time"], rel=1e-9)
    assert not at["plans"][0]["plan"].get("offload")
    below = run_json(capsys, *plan, "--cluster", f"h100:{fewest - 1}x1")
    assert below["plans"][0]["plan"]["offload"] is True
    # the doubled count the table adds is said to be for scale (a new user read it as the answer in doubt)
    doubled = rows[2 * fewest]
    ratio = doubled["tokens_per_second"] / rows[fewest]["tokens_per_second"]
    assert main(["fit", "toy-llama", "--cluster", str(cluster), "--gpus", "auto", "--batch", "1", "--seq", "32",
                 "--memory-budget", budget, "--max-gpus", "16"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"twice that, {2 * fewest} ({2 * fewest} nodes of 1), for scale: " in out, out
    assert f"({ratio:.2f}x the tokens/s)" in out, out


@pytest.mark.integration  # a fit twice in process: ~8 s
def test_the_state_floor_is_below_every_peak_and_spares_fit_the_searches_it_rules_out(capsys, tmp_path,
                                                                                     monkeypatch):
    """``state_floor`` (the model's params, grads and optimizer state over the GPUs) is below the reserved peak of
    every plan simulated (each precision and zero_grad, SGD and bf16 states, micro-batches, dim-1 sharding, frozen
    params, a trainable head no step calls); ``fit --gpus auto --no-offload`` answers
    without screening the counts it rules out (DeepSeek-V3 on 8-64 H100s: 5-12 s each), the same answer."""
    import torch.nn as nn
    from conftest import policy, traced

    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.models import load_model
    from fsdp_planner.service.fit import Points
    from fsdp_planner.sim.memory import state_floor
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import simulate
    from fsdp_planner.trace import record

    lm = load_model("tests/fixtures/unused_head.py:build", meta=True)
    lm.model.aux_head = nn.Linear(32, 1 << 16, device="meta")  # a head no step calls, most of the model: trainable,
    unused = record(lm.model, lm.example_inputs, lm.loss_fn)  # no grad (the floor counts none)
    traces = {spec: traced(spec) for spec in ("toy-llama", "toy-llama-lora", "toy-gpt2-tied")} | {"unused": unused}
    every = (SimOptions(), SimOptions.named("pure-bf16"), SimOptions.named("fp32"), SimOptions.named(zero_grad="zeros"),
             SimOptions.named(optimizer="sgd"), SimOptions.named(optimizer="adamw-fused-bf16-states"),
             SimOptions.named(micro_batches=2), SimOptions.named(shard_placement="auto"))
    for spec, tr in traces.items():
        for options in every:
            for world in (1, 2, 8):
                floor = state_floor(tr, options, world)
                for name in ("order", "size", *(("titan",) if spec != "unused" else ())):
                    plan = policy(name).plan(tr)
                    peak = simulate(tr, plan, parse_cluster(f"h100:{world}"), options, timeline=False)
                    assert 0 < floor <= peak.reserved_memory, (spec, options, world, name)
    cluster = tmp_path / "one_gpu_nodes.json"
    preset_cluster("h100", nodes=1, gpus_per_node=1).save(cluster)
    argv = ("fit", "toy-llama", "--cluster", str(cluster), "--gpus", "auto", "--batch", "1", "--seq", "32",
            "--memory-budget", "1.5MB", "--max-gpus", "16", "--no-offload")
    assert state_floor(traced("toy-llama"), SimOptions(), 2) > 1.5e6  # (1 and 2 GPUs ruled out)
    searched: list[tuple] = []
    search = Points._search

    def counted(self, key, screen, first):
        if screen:
            searched.append(key[2])
        return search(self, key, screen, first)

    monkeypatch.setattr(Points, "_search", counted)
    floored = run_json(capsys, *argv)
    screened = list(searched)
    monkeypatch.setattr(Points, "_state_over_budget", lambda self, key: False)
    searched.clear()
    assert run_json(capsys, *argv) == floored and floored["gpus"]["fewest"] > 2
    assert min(screened) > 2 and sorted(searched) == sorted([1, 2, *screened])


@pytest.mark.integration  # two fits and a plan in process: ~9 s
def test_fit_takes_tp_as_plan_does(capsys):
    """``fit --tp 2`` fits the TP layout (it searched without TP before, silently), and each point is ``plan --tp
    2``'s (without ``--tp`` fit screens the TP degrees plan's auto screens: test_fit_batch_is_plans_boundary)."""
    common = ("toy-llama", "--cluster", "h100:4", "--memory-budget", "6MiB", "--seq", "64")
    doc = run_json(capsys, "fit", *common, "--tp", "2", "--find", "batch")
    largest = doc["batch"]["largest"]
    rows = {p["batch"]: p for p in doc["points"]}
    assert rows[largest]["layout"].endswith("TP 2")
    # --batch under --tp is one data-parallel rank's, shared by its 2 TP GPUs (it was counted once per GPU: the
    # MFU of fit llama3-70b --tp 8 --batch 8 read 259%)
    point = rows[largest]
    assert point["tokens_per_second_per_gpu"] == pytest.approx(largest * 64 / point["step_time"] / 2)
    plan = run_json(capsys, "plan", *common, "--tp", "2", "--policy", "auto", "--batch", str(largest),
                    "--micro-batches", "1")
    assert plan["plans"][0]["simulation"]["step_time"] == pytest.approx(rows[largest]["step_time"], rel=1e-9)


_TITAN_JOB = """[model]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 2
seq_len = 131072
[parallelism]
data_parallel_shard_degree = {shard}
tensor_parallel_degree = 2
[activation_checkpoint]
mode = "full"
"""


@pytest.mark.integration  # two fits in process: ~25 s
def test_fit_from_torchtitan_is_fit_of_the_jobs_settings(capsys, tmp_path):
    """``fit --from-torchtitan JOB`` fits the job's model, sequence, GPU count and TP degree with auto, its
    torchtitan settings kept (its fused AdamW, its expert shard placement) and its checkpointing auto's to choose
    (its wrapper's early stop too, as plan --from-torchtitan's auto: fit kept early_stop=False, 1.2 s where plan's
    auto said 1.14 s at the same batch, a new user's trial): every point is the plain fit's of those settings."""
    job = tmp_path / "job.toml"
    job.write_text(_TITAN_JOB.format(shard=4))
    titan = run_json(capsys, "fit", "--from-torchtitan", str(job), "--cluster", "h100", "--find", "batch")
    plain = run_json(capsys, "fit", "llama3-debugmodel", "--cluster", "h100:8", "--tp", "2", "--seq", "131072",
                     "--optimizer", "adamw-fused", "--shard-placement", "auto", "--find", "batch")
    assert titan["batch"] == plain["batch"] and titan["points"] == plain["points"]
    assert titan["cluster"] == "h100:8" and all(p["layout"].endswith("TP 2") for p in titan["points"])


def test_fit_gpus_auto_takes_a_job_that_leaves_its_count_to_the_cluster(capsys, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(_TITAN_JOB.format(shard=4))
    assert main(["fit", "--from-torchtitan", str(job), "--cluster", "h100", "--gpus", "auto"]) == 2
    err = capsys.readouterr().err
    assert "--gpus auto chooses the GPU count, and the torchtitan job runs on 8 GPUs" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    job.write_text(_TITAN_JOB.format(shard=-1))  # (one node's worth of search: --max-gpus 8)
    assert main(["fit", "--from-torchtitan", str(job), "--gpus", "auto", "--max-gpus", "8", "--json",
                 "--", "--training.local_batch_size", "1"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["gpus"]["fewest"] == 8 and "gives no GPU count" not in err


def test_fit_gpus_auto_says_a_tp_jobs_batch_is_a_data_parallel_ranks(capsys):
    """Under --tp the batch is each TP group's, shared by its GPUs: the answer said "per GPU" (a new user's
    finding)."""
    assert main(["fit", "toy-llama", "--cluster", "h100", "--gpus", "auto", "--tp", "2", "--batch", "1", "--seq",
                 "32", "--max-gpus", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "fit batch 1 x seq 32 per data-parallel rank (each 2 TP GPUs') without CPU offload: 8" in out, out


def test_fit_from_torchtitan_runs_the_jobs_local_batch_and_the_users_own_flags(tmp_path):
    """A job's gradient accumulation is one micro-batch a step, at its local batch (it asked for --micro-batches
    and fitted twice the local batch); the command line's --ac and --offload are kept, not the job's dropped in
    their place (a review)."""
    from fsdp_planner.cli.fit import _job_of
    from fsdp_planner.cli.parser import build_parser
    from fsdp_planner.cli.requests import keywords

    job = tmp_path / "job.toml"
    job.write_text(_TITAN_JOB.format(shard=4).replace("local_batch_size = 2", "local_batch_size = 1\n"
                                                      "global_batch_size = 8"))
    args = build_parser().parse_args(["fit", "--from-torchtitan", str(job), "--cluster", "h100", "--ac", "full",
                                      "--offload"])
    args.torchtitan_flags = ()
    kw = keywords(_job_of(args))
    assert (kw.batch, kw.micro_batches, kw.gradient_sync) == (1, None, None)
    assert (kw.ac, kw.offload, kw.tp, kw.cluster) == ("full", True, 2, "h100:8")


@pytest.mark.parametrize(("argv", "says"), [
    (["--cluster", "h100:16", "--gpus", "auto"], "--gpus auto chooses the GPU count"),
    (["--cluster", "h100:2", "--picture", "fit.txt"], "--picture 'fit.txt' must end in"),
    (["--cluster", "h100:2", "--module-classes", "Block"], "unrecognized arguments: --module-classes"),
    (["--cluster", "h100:2", "--max-gpus", "0"], "--max-gpus must be at least 1"),
    (["--cluster", "h100:2", "--gpus", "2"], "argument --gpus: invalid choice"),
    (["--cluster", "h100", "--gpus", "auto", "--mesh", "2x4"], "--mesh fixes the GPU count"),
    # whole nodes only: it answered 8 GPUs under --max-gpus 7
    (["--cluster", "h100", "--gpus", "auto", "--max-gpus", "7"], "--max-gpus 7 is less than one node of 8 GPUs"),
])
def test_fit_bad_input_is_one_line(capsys, argv, says):
    assert main(["fit", "toy-llama", *argv]) == 2  # before anything is traced
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_fit_seq_of_a_model_without_one(capsys):
    assert main(["fit", "seed-net", "--cluster", "h100:2", "--find", "seq"]) == 2
    assert "--find seq searches the sequence length, and 'seed-net' takes none" in capsys.readouterr().err


@pytest.mark.integration
def test_fit_nothing_fits_names_the_breakdown(capsys):
    """Not even batch 1 fits (CPU offload tried too): auto's breakdown of the smallest peak, in one line (1 s)."""
    assert main(["fit", "toy-llama", "--cluster", "h100:2", "--memory-budget", "100KiB", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: nothing fits even at batch 1: no plan fits the memory budget of 100 KiB")
    assert len(err.strip().splitlines()) == 1


def test_check_answers_on_a_cluster(capsys):
    """check --cluster answers the reduce dtype, HSDP and node-sized reshard questions with the simulator."""
    findings = run_json(capsys, "check", "toy-llama", "--policy", "module", "--cluster", "h100:16")
    info = {f["code"]: f for f in findings if f["severity"] == "info"}
    assert set(info) == {"reduce-dtype-cost", "hsdp", "reshard-to-node", "float8"}
    assert "bf16 instead of fp32" in info["reduce-dtype-cost"]["message"]
    assert "HSDP 2x8 instead of 1x16" in info["hsdp"]["message"]
    assert "reshard_after_forward=8" in info["reshard-to-node"]["message"]
    assert info["float8"]["message"].startswith("float8 training (--float8 tensorwise")
    one_node = run_json(capsys, "check", "toy-llama", "--policy", "module", "--cluster", "h100:8", "--float8",
                        "tensorwise")
    info = {f["code"]: f for f in one_node if f["severity"] == "info"}
    assert set(info) == {"reduce-dtype-cost", "float8"} and "without float8" in info["float8"]["message"]
    a100 = run_json(capsys, "check", "toy-llama", "--policy", "module", "--cluster", "a100:8")  # no float8 cores
    assert {f["code"] for f in a100 if f["severity"] == "info"} == {"reduce-dtype-cost"}


def test_check_answers_explicit_forward_prefetch_where_the_host_waits(capsys, tmp_path):
    """A where-routed MoE's host waits for each expert's token count: check --cluster says each group prefetching
    the next in forward pays, with the step both ways (a model whose host never waits gets no such answer:
    ``test_check_answers_on_a_cluster``)."""
    from pathlib import Path

    model = f"{Path(__file__).parent / 'fixtures' / 'routing_models.py'}:routed_lm"
    findings = run_json(capsys, "check", model, "--module-classes", "RoutedBlock", "--cluster", "h100:64")
    answer = next(f for f in findings if f["code"] == "forward-prefetch")
    assert answer["severity"] == "info"
    assert "the host waits for the GPU 64 times in forward" in answer["message"]  # 8 blocks x 8 experts
    assert "faster)" in answer["message"] and answer["fix"].startswith("set each group's forward prefetch")
    # a plan whose first group prefetches the next already: the others are asked about
    written = tmp_path / "plan.json"
    assert main(["plan", model, "--policy", "module", "--module-classes", "RoutedBlock", "--cluster", "h100:64",
                 "--out", str(written), "--quiet"]) == 0
    capsys.readouterr()
    doc = json.loads(written.read_text())
    doc["groups"][0]["forward_prefetch"] = [1]
    written.write_text(json.dumps(doc))
    findings = run_json(capsys, "check", model, "--plan", str(written), "--cluster", "h100:64")
    answer = next(f for f in findings if f["code"] == "forward-prefetch")
    assert "each group that prefetches nothing" in answer["message"]
    assert answer["fix"].startswith("give each group that has none a forward prefetch of the next")


@pytest.mark.integration
def test_check_answers_are_simulates_figures(capsys):
    """The reduce-dtype and HSDP answers quote the step times simulate gives for the changed plan (1 s)."""
    from fsdp_planner.fmt import fmt_time

    findings = run_json(capsys, "check", "toy-llama", "--policy", "module", "--cluster", "h100:16")
    info = {f["code"]: f["message"] for f in findings if f["severity"] == "info"}
    sim = ("simulate", "toy-llama", "--policy", "module", "--cluster", "h100:16")
    fp32 = run_json(capsys, *sim)["step_time"]
    bf16 = run_json(capsys, *sim, "--reduce-dtype", "bf16")["step_time"]
    hsdp = run_json(capsys, *sim, "--mesh", "2x8")["step_time"]
    assert f"{fmt_time(bf16)} a step against {fmt_time(fp32)}" in info["reduce-dtype-cost"]
    assert f"{fmt_time(hsdp)} a step against {fmt_time(fp32)}" in info["hsdp"]


@pytest.mark.integration  # ~20 s: Llama 3 8B, where float8's eager casts cost more than its matmuls save
def test_check_answers_a_tp_plan_over_its_data_parallel_ranks(capsys):
    """Under TP 2 on 16 GPUs the HSDP question is about the 8 data-parallel ranks (it compared "pure FSDP (1x16)"
    with "HSDP 1x8" at the same step); a float8 plan that bf16 beats is told to drop float8 (it read "bf16 is as
    fast here" where bf16 was 44% faster)."""
    from fsdp_planner.fmt import fmt_time

    findings = run_json(capsys, "check", "llama3-8b", "--policy", "titan", "--tp", "2", "--cluster", "h100:16",
                        "--float8", "tensorwise")
    info = {f["code"]: f for f in findings if f["severity"] == "info"}
    assert "HSDP 2x4 x TP 2 instead of 1x8 x TP 2" in info["hsdp"]["message"]
    sim = ("simulate", "llama3-8b", "--policy", "titan", "--tp", "2", "--cluster", "h100:16", "--float8", "tensorwise")
    hsdp, now = run_json(capsys, *sim, "--mesh", "2x4")["step_time"], run_json(capsys, *sim)["step_time"]
    assert f"{fmt_time(hsdp)} a step against {fmt_time(now)}" in info["hsdp"]["message"]
    bf16 = run_json(capsys, *sim[:-2])["step_time"]
    assert bf16 < now * 0.99 and info["float8"]["fix"].startswith("drop float8: bf16 is faster here")
    assert "reshard_after_forward=4 " in info["reshard-to-node"]["message"]  # the node's 4 data-parallel ranks


def test_a_compiled_float8_plan_checked_eager_is_not_told_to_drop_float8() -> None:
    """A trial: ``plan --compile --float8`` said keep float8 (131 ms against 170), ``check --plan`` of its file,
    traced eager, said "drop float8: bf16 is faster here" (192 against 271 ms): eager's unfused casts are not the
    plan's job."""
    from conftest import traced

    from fsdp_planner.choices import Float8Recipe
    from fsdp_planner.fsdp2.float8 import Float8
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners import TorchtitanPolicy
    from fsdp_planner.planners.answers import float8_answer
    from fsdp_planner.sim.budget import MemoryBudget
    from fsdp_planner.sim.options import SimOptions
    from fsdp_planner.sim.simulate import simulate

    tr = traced("toy-llama")
    f8 = Float8.named(Float8Recipe.TENSORWISE.value)
    plan = TorchtitanPolicy().plan(tr).replace(float8=f8)
    cluster, options = parse_cluster("h100:8"), SimOptions(float8=f8)
    budget = MemoryBudget.of_gpu(80_000_000_000, "H100")
    eager = float8_answer(tr, plan, cluster, options, simulate(tr, plan, cluster, options), budget)
    compiled = plan.replace(compiled=tuple(tr.index.block_instances))
    said = float8_answer(tr, compiled, cluster, options, simulate(tr, compiled, cluster, options), budget)
    assert not eager.fix.startswith("check it with --compile")
    assert said.fix.startswith("check it with --compile, as the plan runs its blocks")
    assert "its blocks traced eager" in said.message


def test_batch_with_find_batch_is_said_to_have_no_effect(capsys) -> None:
    """--find batch searches the batch from 1: a --batch given beside it is said, never silently ignored."""
    from fsdp_planner.cli import build_parser
    from fsdp_planner.cli.fit import fit_request

    fit_request(build_parser().parse_args(["fit", "toy-llama", "--cluster", "h100:8", "--find", "batch",
                                           "--batch", "3"]))
    assert "--batch 3 has no effect with --find batch" in capsys.readouterr().err


@pytest.mark.integration  # about a second: the full suite runs it, the fast subset does not
def test_a_model_without_a_sequence_counts_samples(capsys, tmp_path) -> None:
    """seed-net takes no sequence length: its throughput is samples/s (the JSON keeps its tokens_ names), and a
    directory given to --picture gets fit.png suggested."""
    assert main(["fit", "seed-net", "--cluster", "h100:2", "--memory-budget", "24MiB", "--find", "batch",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "samples/s per GPU" in out and "samples/s/GPU" in out and "tokens" not in out
    assert main(["fit", "seed-net", "--cluster", "h100:2", "--picture", str(tmp_path)]) == 2
    assert f"e.g. {tmp_path / 'fit.png'}" in capsys.readouterr().err


def test_confirmed_searches_trust_the_screen_only_where_it_says_fits():
    """The screen (never True where the real test is False) locates the boundary; the real test confirms it on
    both sides: two real calls when the screen is right, a real search on where it was pessimistic."""
    real: list[int] = []

    def fits(v: int) -> bool:
        real.append(v)
        return v <= 37

    assert largest_confirmed(lambda v: v <= 37, fits, 1, 1000) == 37 and real == [37, 38]
    real.clear()
    assert largest_confirmed(lambda v: v <= 30, fits, 1, 1000) == 37  # pessimistic screen: searched on for real
    assert 31 in real and 38 in real
    assert largest_confirmed(lambda v: False, lambda v: False, 1, 100) is None
    assert largest_confirmed(lambda v: v <= 5000, lambda v: v <= 5000, 8192, 10**6, step=128) == 4992
    assert smallest_confirmed(lambda n: n >= 9, lambda n: n >= 5, 64) == 5
    assert smallest_confirmed(lambda n: n >= 5, lambda n: n >= 5, 64) == 5
    asked: list[int] = []
    assert smallest_confirmed(lambda n: False, lambda n: asked.append(n) or n >= 70, 64) is None
    assert asked == [64]  # the screen fits nowhere: one real test at the most answers (fits is monotone)
    assert smallest_confirmed(lambda n: False, lambda n: n >= 40, 64) == 40
    # a pessimistic screen: the real test confirms its answer and gallops down (59, 57, 53, then bisection), never
    # asked far below it as doubling up from 1 would
    asked.clear()
    assert smallest_confirmed(lambda n: n >= 60, lambda n: asked.append(n) or n >= 55, 120) == 55
    assert asked == [60, 59, 57, 53, 55, 54]
    # fitting not monotone (a count no EP degree divides fits worse than a smaller one: a trial's "fewest 1,024
    # GPUs" for a job 64 fit): the power-of-two counts below the answer are tried, and below the smallest that fits
    odd = lambda n: n in (6, 7, 8) or n >= 120  # noqa: E731
    found = smallest_confirmed(lambda n: False, odd, 128)
    assert found == 120 and below_by_powers(odd, found, [1, 2, 4, 8, 16, 32, 64, 128]) == 6
    assert below_by_powers(lambda n: n >= 120, 120, [1, 2, 4, 8, 16, 32, 64]) == 120  # monotone: unchanged


def test_fit_names_unknown_models_and_reads_a_factorys_batch(capsys, tmp_path):
    """'gpt2' is no model (hf:gpt2 is): said before anything is traced; a factory declaring batch_size=2 is not
    asked for --batch."""
    assert main(["fit", "gpt2", "--cluster", "h100:8"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt2' (a shipped Hugging Face config: hf:gpt2)" in err and len(err.splitlines()) == 1
    from fsdp_planner.cli import build_parser
    from fsdp_planner.cli.fit import fit_request

    factory = tmp_path / "factory.py"
    factory.write_text("from fsdp_planner.models import llama\n\n\ndef make(batch_size=2, seq_len=64):\n"
                       "    return llama.build(llama.TOY_LLAMA, batch_size=batch_size, seq_len=seq_len)\n")
    request = fit_request(build_parser().parse_args(["fit", f"{factory}:make", "--cluster", "h100:2"]))
    assert (request.batch, request.seq) == (2, 64)
    # a factory without batch_size: one sentence saying so, with or without --batch (a trial was told to give
    # --batch, then that --batch does not apply)
    factory.write_text(factory.read_text() + "\n\ndef fixed():\n    return make()\n")
    for more in ([], ["--batch", "2"]):
        assert main(["fit", f"{factory}:fixed", "--cluster", "h100:2", *more]) == 2
        err = capsys.readouterr().err
        assert "takes no batch_size keyword argument: give it batch_size (and seq_len) parameters" in err \
            and len(err.splitlines()) == 1, err


@pytest.mark.integration
def test_fit_sequence_stops_at_learned_positions(capsys):
    """toy-gpt2-tied has 64 learned positions: the sequence search answers at them instead of failing past them
    (2 s)."""
    doc = run_json(capsys, "fit", "toy-gpt2-tied", "--cluster", "h100:2", "--find", "seq", "--seq", "16")
    assert doc["seq"]["longest_without_offload"] == doc["seq"]["cap"] == 64
    assert max(p["seq"] for p in doc["points"]) == 64
    assert main(["fit", "toy-gpt2-tied", "--cluster", "h100:2", "--find", "seq", "--seq", "16", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "the model's 64 learned positions (wpe)" in out
    # --find seq: one table, of the lengths tried, the given one among them (an empty batch table came first)
    assert "at each sequence length tried" in out and "at each batch tried" not in out


@pytest.mark.integration
def test_fit_sequence_takes_learned_positions_that_are_no_multiple_of_its_step(capsys, tmp_path):
    """Whisper's decoder has 448 learned positions, which the search rounded down to its step (384) and called
    its own bound: the default sequence, 448, fitted and was answered as not tried (a trial's whisper-medium).
    The tiny one's 24 positions, searched in steps of 16 from 16 (3 s)."""
    from test_hf_models import TINY

    config = tmp_path / "whisper.json"
    config.write_text(json.dumps(TINY["tiny-whisper"]))
    doc = run_json(capsys, "fit", f"hf:{config}", "--cluster", "h100:2", "--find", "seq", "--seq", "16")
    assert doc["seq"]["longest_without_offload"] == doc["seq"]["cap"] == 24
    assert main(["fit", f"hf:{config}", "--cluster", "h100:2", "--find", "seq", "--seq", "16", "--quiet"]) == 0
    assert "24 (the model's 24 learned positions (model.decoder.embed_positions)" in capsys.readouterr().out


OWN_POSITIONS = """
import torch
import torch.nn as nn


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(64, 8))  # a position table of its own: no longer sequence runs
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x + self.pos[: x.shape[1]] if x.shape[1] <= 64 else x + self.pos)


def build(batch_size: int = 2, seq_len: int = 16):
    return Positions(), (torch.randn(batch_size, seq_len, 8),)
"""


def test_fit_sequence_stops_at_a_length_the_model_does_not_take(capsys, tmp_path):
    """A model whose code takes no longer sequence than its own table (not a learned-positions module fit knows):
    the search answers below the first length that does not trace and names it (a new user's encoder-decoder:
    fit printed the tracing error alone, the lengths that fit with it lost)."""
    path = tmp_path / "own_positions.py"
    path.write_text(OWN_POSITIONS)
    doc = run_json(capsys, "fit", f"{path}:build", "--cluster", "h100:2", "--find", "seq", "--seq", "16")
    assert doc["seq"]["longest_without_offload"] == 64
    assert main(["fit", f"{path}:build", "--cluster", "h100:2", "--find", "seq", "--seq", "16", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "64 (the longest the model takes: a longer one does not trace, below)" in out
    assert "and longer were not searched: tracing" in out


@pytest.mark.integration
def test_offload_verdict_comes_first(capsys, tmp_path):
    """plan and fit lead with the verdict when nothing fits without CPU offload: the fewest GPUs that fit without it
    (where plan stops offloading) and what offload costs; --no-offload makes it an error of one line (4 s)."""
    argv = ["--batch", "1", "--seq", "32", "--memory-budget", "2.6MB", "--cluster", "h100:1"]
    assert main(["plan", "toy-llama", "--policy", "auto", *argv, "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("nothing fits h100:1 without CPU offload: the fewest H100-SXM-80GB that fit it without: ")
    fewest = int(first.split("fit it without: ")[1].split(" ")[0])
    assert "with CPU offload on h100:1 auto's plan takes" in first
    plain = run_json(capsys, "plan", "toy-llama", "--policy", "auto", *argv[:-1], f"h100:{fewest}")
    assert not plain["plans"][0]["plan"].get("offload")
    assert main(["plan", "toy-llama", "--policy", "auto", *argv, "--no-offload", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: nothing fits h100:1 without CPU offload") and len(err.splitlines()) == 1
    assert main(["fit", "toy-llama", *argv, "--find", "batch", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("nothing fits h100:1 at batch 1 at seq 32 without CPU offload")
    assert main(["fit", "toy-llama", *argv, "--find", "batch", "--no-offload", "--quiet"]) == 2
    err = capsys.readouterr().err  # the verdict, not "nothing fits even at batch 1:" with nothing after it
    assert err.startswith("error: nothing fits h100:1 at batch 1 at seq 32 without CPU offload: the fewest ")
    assert err.rstrip().endswith("(--no-offload)") and len(err.splitlines()) == 1


@pytest.mark.integration
def test_fit_time_limit_prints_partial_results(capsys):
    """--time-limit: no search starts after it; what was found is printed, marked partial, exit 3 (2 s)."""
    assert main(["fit", "toy-llama", "--cluster", "h100:2", "--time-limit", "1", "--quiet"]) == 3
    assert capsys.readouterr().out.startswith("stopped by --time-limit after")


def test_memory_takes_cluster_like_every_command(capsys):
    """memory --cluster h100:2 is memory --world-size 2 (the same rows), and says what its figure is against plan's."""
    by_cluster = run_json(capsys, "memory", "toy-llama", "--cluster", "h100:2")
    assert by_cluster == run_json(capsys, "memory", "toy-llama", "--world-size", "2")
    assert main(["memory", "toy-llama", "--cluster", "h100:2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "on h100:2" in out and "allocated peaks without activation checkpointing" in out
    assert main(["memory", "toy-llama"]) == 2  # one of the two is required
    assert "one of the arguments --cluster --world-size is required" in capsys.readouterr().err


@pytest.mark.integration
def test_accelerate_fsdp_yaml_leads_with_the_no_offload_verdict(capsys):
    """Accelerate's fsdp.yaml (8B on 2 GPUs) without TP (--tp 1): auto's plan needs CPU offload, so plan
    --from-accelerate and simulate --from-accelerate say first that nothing fits without it and that 4 GPUs do;
    --no-offload exits 2. With TP left to auto the same: TP 2 runs both sequences on each rank (it once looked like
    it fit, simulated on the one-sequence trace of the config's job). The verdict is the fit's own searches: auto's
    refinement (``--search-effort``, tested in test_auto) is left out, a third of the time (30 s)."""
    from pathlib import Path

    config = str(Path(__file__).parent / "fixtures" / "accelerate" / "fsdp_2gpu.yaml")
    job = ["llama3-8b", "--from-accelerate", config, "--cluster", "h100", "--search-effort", "0"]
    verdict = "nothing fits h100:2 without CPU offload: the fewest H100-SXM-80GB that fit it without: 4 ("
    for command in ("plan", "simulate"):
        assert main([command, *job, "--tp", "1"]) == 0
        out, err = capsys.readouterr()
        assert out.startswith(verdict)
        # the search's notes, one per GPU count tried ("fit: the job on h100:4 ..."), follow the one that says
        # what they are (a trial read them as a fit nobody asked for)
        notes = [line for line in err.splitlines() if line.startswith(("note: fit:", "note: auto's plan offloads",
                                                                      "note: nothing fits"))]
        said = {"plan": "note: auto's plan offloads to the CPU on h100:2: searching the fewest H100-SXM-80GB that "
                        "fit it without (auto at each count tried, up to 1,024)",
                "simulate": "note: nothing fits h100:2 without CPU offload: searching the fewest H100-SXM-80GB that "
                            "fit it (auto at each count tried, up to 1,024: a large model takes a minute or two)"}
        assert notes.index(said[command]) < next(i for i, n in enumerate(notes) if "h100:4" in n), notes
    job.append("--quiet")
    assert main(["plan", *job, "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["verdict"].startswith(verdict) and auto["plan"].get("offload")  # auto's last resort
    assert main(["plan", *job, "--tp", "1", "--no-offload"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {verdict}") and len(err.splitlines()) == 1


def test_fit_picture_ticks_are_whole_numbers():
    """Batches 1-3 on a linear axis: matplotlib's default ticks would put 1.5 and 2.5 between them."""
    from matplotlib.figure import Figure

    from fsdp_planner.report.fit_png import whole_number_axis

    ax = Figure().subplots()
    ax.plot([1, 2, 3], [1.0, 2.0, 3.0])
    whole_number_axis(ax, [1, 2, 3])
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)


@pytest.mark.integration  # fit's boundary searches: 10 s
def test_an_offload_answer_at_the_search_s_cap_says_so(monkeypatch):
    """The largest batch with CPU offload at the search's cap is the largest tried, not a limit found, as the
    answer without offload says (it read "1,000,000" bare: a new user's finding)."""
    import fsdp_planner.cli.fit as fit

    monkeypatch.setattr(fit, "MAX_BATCH", 64)
    done = run_main("fit", "toy-llama", "--cluster", "h100:8", "--find", "batch", "--memory-budget", "8MiB")
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("largest batch with CPU offload")]
    assert ": 64 (the largest tried: the search stops there): " in line


def test_a_row_where_offload_did_not_fit_either_says_its_figures_are_without_it():
    """A row where nothing fits, CPU offload tried too, shows the closest plan without offload (auto's, as plan
    reports it): a new user read batch 8,636's "273 GiB > budget" beside 8,635's 70.8 GiB with offload as one
    more sample costing 200 GiB; the row now says whose figures they are."""
    from fsdp_planner.cli.fit import _described
    from fsdp_planner.planners.fit import FitPoint

    point = FitPoint(batch=9, seq=4096, gpus=8, nodes=1, fits=False, step_time=5.3, reserved_memory=101 << 30,
                     budget=70 << 30, model_flops=1, peak_flops=1.0, layout="1x8", checkpointed=36)
    assert _described(point) == "1x8, 36 AC, shown without CPU offload, which does not fit either"
    assert _described(dataclasses.replace(point, complete=False)) == "1x8, 36 AC, offload not tried"
    assert _described(dataclasses.replace(point, fits=True)) == "1x8, 36 AC"


@pytest.mark.integration  # ~10 s: auto's fit searched up to 1,024 GPUs
def test_a_config_job_offloading_over_the_budget_is_said_as_the_config_s_step(tmp_path, capsys):
    """simulate --from-torchtitan of a job that offloads and is still over the budget (8B at 131,072 tokens, never
    resharding): the verdict gave the config's own step as "auto's plan takes 59.9 s", a plan that held 486 GiB
    (a trial). It is the config's job's, with what it holds."""
    job = tmp_path / "offloading.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 131072\n'
                   'enable_cpu_offload = true\n[parallelism]\ndata_parallel_shard_degree = 8\n'
                   'fsdp_reshard_after_forward = "never"\n[activation_checkpoint]\nmode = "selective"\n'
                   'selective_ac_option = "op"\n')
    assert main(["simulate", "--from-torchtitan", str(job), "--cluster", "h100", "--quiet", "--search-effort",
                 "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(r"nothing fits h100:8 without CPU offload, nor on up to 1,024 H100-SXM-80GB; with CPU "
                        r"offload on h100:8 the config's job takes [\d.]+ s a step and holds \d+ GiB, over the "
                        r"budget", first), first
