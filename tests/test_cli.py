"""The CLI as a user runs it: exit codes, one-line errors; the demo in a real subprocess, the other commands in
process (``run_main``: their torchrun jobs are real all the same)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_main, traced

from fsdp_planner.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.integration  # the CLI in a subprocess, or many cases of it in process


def run(*args: str) -> subprocess.CompletedProcess:
    """The command in a process of its own, as a user runs it (``run_main`` runs the others in this one)."""
    return subprocess.run([sys.executable, "-m", "fsdp_planner", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_shows_the_seed_problem_then_auto_on_a_cluster(tmp_path):
    r = run("demo", "--out-dir", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr
    seed, main = r.stdout.split("2. The main job")
    assert "size(2000)" in seed and "order(per-module)" in seed
    assert "the root unit holds conv1, fc2 together" in seed
    assert "the root unit holds norm, output, tok_embeddings together" in seed
    assert "llama3-8b on h100:8" in main and "step time" in main and "exposed comm" in main
    assert "auto: 34 groups," in main
    assert re.search(r"auto against titan\(TransformerBlock\) \+ ac full, the fastest classic plan that fits: "
                     r"step (\d+ ms|1\.\d+ s) against 1\.\d+ s \(\d+\.\d% faster\)", main)
    assert "held by:" in main and "balance:" in main
    for name in ("timeline.png", "timeline.html"):
        assert (tmp_path / "demo" / name).stat().st_size > 10_000
        assert str(tmp_path / "demo" / name) in main


def test_simulate_draws_a_timeline_compared_with_another_plan(tmp_path):
    plan = tmp_path / "size.json"
    assert run_main("plan", "toy-llama", "--policy", "size", "--min-nonwrapped-numel", "20000", "--out",
               str(plan)).returncode == 0
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    r = run_main("simulate", "toy-llama", "--policy", "order", "--cluster", "h100:16", "--compare", str(plan),
            "--timeline", str(png), "--html", str(page))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("step time") == 2 and f"timeline written to {png}" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and "size(20000)" in page.read_text()
    j = run_main("simulate", "toy-llama", "--policy", "order", "--cluster", "h100:16", "--compare", "titan", "--json")
    assert j.returncode == 0 and json.loads(j.stdout)["compare"]["step_time"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (("--timeline", "t.txt"), "--timeline 't.txt' must end in .png or .svg or .pdf"),
    (("--html", "nodir/t.html"), "directory 'nodir' does not exist"),
    (("--compare", "nosuch"), "--compare 'nosuch' is neither a policy"),
])
def test_simulate_picture_options_are_checked_before_any_work(args, message):
    r = run_main("simulate", "toy-llama", "--policy", "order", "--cluster", "h100:8", *args)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {r.stderr.strip()[7:]}"
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plan_json_lists_every_policy():
    r = run_main("plan", "seed-net", "--json", "--min-nonwrapped-numel", "2000")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    names = [p["plan"]["policy"].split("(")[0] for p in data["plans"]]
    assert names == ["module", "size", "titan", "order"]
    size = data["plans"][1]
    assert [g["modules"] for g in size["plan"]["groups"]] == [["conv2"], ["fc1"], [""]]
    assert size["metrics"]["all_gathers"] == 5


def test_plan_out_then_verify_the_file(tmp_path):
    out = tmp_path / "plan.json"
    r = run_main("plan", "toy-llama", "--policy", "order", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["groups"][-1]["modules"] == [""]
    v = run_main("verify", "toy-llama", "--plan", str(out), "--nproc", "2", "--steps", "2")
    assert v.returncode == 0, v.stdout + v.stderr
    assert "PASS" in v.stdout


def test_module_classes_option():
    r = run_main("plan", "seed-net", "--policy", "module", "--module-classes", "Conv2d", "--json")
    groups = [g["modules"] for g in json.loads(r.stdout)["plans"][0]["plan"]["groups"]]
    assert groups == [["conv1"], ["conv2"], [""]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("plan", "no-such-model"), "unknown model 'no-such-model'"),
        (("plan", f"{FIXTURES / 'factories.py'}:broken"), "raised RuntimeError: factory exploded"),
        # raised in torch: the user's line beside it, and what to change (a trial was told neither)
        (("plan", f"{FIXTURES / 'factories.py'}:reads_meta_values"), "in __torch_function__, from factories.py:"),
        (("plan", f"{FIXTURES / 'factories.py'}:reads_meta_values"), "in __init__); fsdp-planner builds the model "
         "under torch.device('meta'), where a tensor holds no values: make a tensor the constructor reads values "
         "from (.tolist(), .item()) with device='cpu'"),
        (("plan", f"{FIXTURES / 'factories.py'}:not_a_model"), "must return (model, example_inputs)"),
        (("plan", f"{FIXTURES / 'factories.py'}:missing"), "has no callable 'missing'"),
        (("plan", "nowhere/model.py:fn"), "does not exist"),
        (("plan", "seed-net", "--policy", "module", "--module-classes", "Nope"), "module class Nope not found"),
        (("verify", "seed-net", "--plan", "does-not-exist.json"), "does not exist"),
        (("verify", "llama3-8b", "--policy", "order"), "planning only"),
    ],
)
def test_bad_input_is_one_clear_line(args, message):
    r = run_main(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_plan_for_another_model_and_corrupt_json(tmp_path):
    other = tmp_path / "other.json"
    assert run_main("plan", "toy-llama", "--policy", "order", "--out", str(other)).returncode == 0
    r = run_main("verify", "seed-net", "--plan", str(other))
    assert r.returncode == 2 and "another model" in r.stderr and "missing parameters" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{ nope")
    r = run_main("verify", "seed-net", "--plan", str(bad))
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    bad.write_text('{"version": 1, "groups": [["conv1"]], "groups": [["fc1"]]}')  # json.loads keeps the last
    r = run_main("simulate", "seed-net", "--plan", str(bad), "--cluster", "h100:2")
    assert r.returncode == 2 and 'the key "groups" appears twice in one object' in r.stderr


def test_cost_simulate_memory_calibrate_commands(tmp_path):
    r = run_main("cost", "all-gather", "1GiB", "--cluster", "h100:8", "--json")
    assert r.returncode == 0, r.stderr
    assert 2.7e-3 <= json.loads(r.stdout)["seconds"] <= 3.0e-3
    r = run_main("simulate", "toy-llama", "--policy", "order", "--cluster", "h100:64", "--json")
    report = json.loads(r.stdout)
    assert report["all_gathers"] == 11 and report["step_time"] >= report["compute_time"]
    r = run_main("plan", "seed-net", "--cluster", "a100:16", "--json")
    assert all("simulation" in p for p in json.loads(r.stdout)["plans"])
    r = run_main("memory", "seed-linear10", "--world-size", "1", "--precision", "fp32", "--optimizer", "sgd-momentum",
            "--json")
    assert json.loads(r.stdout)["single"]["total"] == pytest.approx(12.035e9, rel=0.02)
    out = tmp_path / "cluster.json"
    log = FIXTURES / "nccl" / "all_gather_perf_8xh100.log"
    r = run_main("calibrate", str(log), "--out", str(out))
    assert r.returncode == 0, r.stderr
    r = run_main("cost", "all-gather", "1GiB", "--cluster", str(out), "--json")
    assert r.returncode == 0, r.stderr


def test_memory_s_hint_plans_the_same_job():
    """The plan command ``memory`` suggests for a plan's own peaks repeats the model's, workload's and precision
    options given (a new user's trial: it named the model alone), and runs; with a cluster it names the budget
    plans are held to (a trial read 69.2 GiB against the GPU's 74.5 GiB as fitting, where plans are held to
    70.8 GiB of reserved memory and the module policy's was 79 GiB)."""
    job = ("--seq", "64", "--loss-chunks", "4", "--precision", "fp32", "--optimizer", "sgd-momentum")
    r = run_main("memory", "toy-llama", "--world-size", "8", *job)
    hint = re.search(r"and the allocator's: plan (.+) \(or --policy module", " ".join(r.stdout.split()))
    assert hint is not None, r.stdout
    args = shlex.split(hint.group(1))
    assert args[:5] == ["toy-llama", "--policy", "auto", "--cluster", "h100:8"] and set(job) <= set(args), args
    r = run_main("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plans"][0]["plan"]["loss_chunks"] == 4
    r = run_main("memory", "toy-llama", "--cluster", "h100:8")
    assert "is held to 70.8 GiB of it (one H100-SXM-80GB (80 GB) less 5% headroom)" in " ".join(r.stdout.split())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("cost", "all-gather", "lots", "--cluster", "h100:8"), "size"),
        (("cost", "all-gather", "1GiB", "--cluster", "tpu:8"), "cluster"),
        (("simulate", "toy-llama", "--policy", "order", "--cluster", "h100:8", "--precision", "fp8"), "precision"),
        (("calibrate", str(FIXTURES / "factories.py"), "--out", "/tmp/x.json"), ""),
    ],
)
def test_cost_model_bad_input(args, message):
    r = run_main(*args)
    assert r.returncode == 2
    assert message in r.stderr.lower() and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_plan_auto_with_budget_explain_and_json(tmp_path):
    r = run_main("plan", "toy-llama", "--policy", "auto", "--cluster", "h100:64", "--explain")
    assert r.returncode == 0, r.stderr
    assert "ties with the best classic policy" in r.stdout and "held by" in r.stdout  # one group: nothing to gain
    r = run_main("plan", "toy-llama", "--cluster", "h100:64", "--json")
    data = json.loads(r.stdout)
    assert [p["plan"]["policy"].split("(")[0] for p in data["plans"]] == ["module", "size", "titan", "order", "auto"]
    steps = [p["simulation"]["step_time"] for p in data["plans"]]
    assert steps[-1] <= min(steps[:-1]) * (1 + 1e-9)
    assert data["auto"]["fits"] and data["auto"]["plans_simulated"] >= 5
    out = tmp_path / "auto.json"
    r = run_main("plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "3.2MiB",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    r = run_main("simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8", "--json")
    assert json.loads(r.stdout)["reserved_memory"] <= 3.2 * 2**20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "1KiB"),
         "no plan fits the memory budget"),
        (("plan", "toy-llama", "--policy", "auto", "--memory-budget", "lots"), "size"),
        (("plan", "toy-llama", "--policy", "order", "--explain"), "--explain"),
        (("plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "0"), "positive"),
    ],
)
def test_auto_bad_input(args, message):
    r = run_main(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("plan", f"{FIXTURES / 'factories.py'}:broken", "--policy", "order", "--out", "/nonexistent/dir/p.json"),
         "directory '/nonexistent/dir' does not exist"),
        (("plan", f"{FIXTURES / 'factories.py'}:broken", "--policy", "order", "--out", "/tmp"), "is a directory"),
        (("calibrate", str(FIXTURES / "nccl" / "all_gather_perf_8xh100.log"), "--out", "/nonexistent/c.json"),
         "does not exist"),
        (("plan", "toy-llama", "--policy", "order", "--target-bytes", "0"), "--target-bytes must be positive"),
        (("plan", "toy-llama", "--policy", "size", "--min-nonwrapped-numel", "-5"), "must be positive, got -5"),
        (("plan", "toy-llama", "--policy", "module", "--module-classes", ","), "names no class"),
        (("plan", f"{FIXTURES / 'factories.py'}:exits"), "raised SystemExit: 3"),
        (("plan", f"{FIXTURES / 'factories.py'}:exits_hard"), "the model's code called os._exit(0) while building"),
        (("cost", "all-gather", "1GiB", "--cluster", "h100:8", "--ranks", "0"), "positive whole number of ranks"),
        (("verify", f"{FIXTURES / 'factories.py'}:broken", "--policy", "order", "--fsdp1", "--save-checkpoint",
          "/tmp/never-written"), "--save-checkpoint and --load-checkpoint run with FSDP2 only: drop --fsdp1"),
    ],
)
def test_bad_options_fail_before_any_work(args, message):
    r = run_main(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "shown"), [
    (("all-gather", "0", "--cluster", "h100:8"), "0 s (nothing to move)"),
    (("reduce-scatter", "1GiB", "--cluster", "h100:8", "--ranks", "1"), "0 s (one rank holds everything)"),
])
def test_collectives_that_move_nothing_cost_nothing(args, shown):
    r = run_main("cost", *args)
    assert r.returncode == 0, r.stderr
    assert shown in r.stdout


def test_bad_plan_files_are_one_line_errors(tmp_path):
    good = tmp_path / "good.json"
    assert run_main("plan", "toy-llama", "--policy", "order", "--out", str(good)).returncode == 0
    data = json.loads(good.read_text())
    data["groups"][0]["forward_prefetch"] = [99]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    binary = tmp_path / "binary.json"
    binary.write_bytes(bytes(range(256)))
    data = json.loads(good.read_text())
    data["groups"][1]["params"] = data["groups"][1]["params"][:1]  # this model's plan, edited by hand
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    for path, message in ((bad, "forward_prefetch names 99"), (binary, "is not text"),
                          (edited, "the plan's groups do not list every param of this model (missing parameters: ")):
        r = run_main("simulate", "toy-llama", "--plan", str(path), "--cluster", "h100:8")
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_full_trace_plans_the_same_model_without_replaying_blocks():
    fast = run_main("plan", "toy-llama", "--policy", "order", "--json")
    full = run_main("plan", "toy-llama", "--policy", "order", "--json", "--full-trace")
    assert fast.returncode == 0 and full.returncode == 0, fast.stderr + full.stderr
    assert json.loads(fast.stdout) == json.loads(full.stdout)


def test_auto_line_says_cpu_offload(capsys) -> None:
    """An offload plan's step is mostly the CPU optimizer's: auto's summary line says offload, beside the step."""
    assert main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--offload"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("auto:"))
    assert ", CPU offload (optimizer step on the CPU " in line and "M elements/s per rank: preset" in line
    assert "), step " in line  # the host's rate and its source, then the step


def test_explain_shows_a_tie_as_no_change_not_float_noise():
    """A tie's step differs from the plan's by float noise: it read "(-1.7e-14%)" (a new user's trial); a change
    too small for two decimals still reads in two significant digits."""
    from rich.console import Console

    from fsdp_planner.cli.render import explain_table
    from fsdp_planner.planners.auto.explain import GroupExplanation, Reason
    from fsdp_planner.planners.auto.refine import Move

    def row(step: float) -> GroupExplanation:
        return GroupExplanation(0, ["layers.0"], 2**20, 1e-4, 0.1, 2e-4, Reason.TIE, Move.MERGED, step, 2**30)

    console = Console(width=300, record=True)
    console.print(explain_table([row(0.32 * (1 - 5e-16)), row(0.32 * (1 - 3e-6))], 0.32, 2**30))
    text = console.export_text()
    assert "320 ms (+0.00%)" in text and "e-14" not in text and "(-0.0003%)" in text


def test_the_groups_table_says_how_a_group_s_checkpointed_modules_are_checkpointed():
    """A group whose modules are all checkpointed reads "full"; one with some of them read their names alone, which
    a trial took for another kind than the "full" below it: how, then which."""
    from rich.console import Console

    from fsdp_planner.cli.render import groups_table
    from fsdp_planner.fsdp2.claim import make_plan

    tr = traced("toy-llama")
    plan = make_plan(tr, [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3"]]).replace(
        activation_checkpointing=("layers.0", "layers.1", "layers.2", "layers.3"))
    console = Console(width=300, record=True)
    console.print(groups_table(plan, tr))
    rows = [line for line in console.export_text().splitlines() if line.startswith(("│ 0 ", "│ 1 "))]
    cells = [[c.strip() for c in row.split("│")][-2] for row in rows]
    assert cells == ["full: layers.0, layers.1", "full"], rows
    # an offloaded module beside them is said so, not as checkpointed in full (a review)
    mixed = plan.replace(activation_checkpointing=("layers.0", "layers.2", "layers.3"),
                         activation_offloading=("layers.1",))
    console = Console(width=300, record=True)
    console.print(groups_table(mixed, tr))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│ 0 ")]
    assert [c.strip() for c in rows[0].split("│")][-2] == "full and offload: layers.0, layers.1", rows


def test_one_rank_s_reduce_scatter_stream_is_said_as_the_grads_copy(capsys) -> None:
    """On one GPU FSDP2 reduce-scatters nothing, yet copies the grads into the reduce-scatter buffer: "0
    reduce-scatters ... reduce-scatter 36.5 us" read as a contradiction (a trial)."""
    for cluster, one in (("h100:1", True), ("h100:2", False)):
        assert main(["simulate", "toy-llama", "--policy", "titan", "--cluster", cluster]) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if "comm busy" in s)
        assert ("reduce-scatter none (the grads' copy into its buffer " in line) is one, line
        assert line.startswith("0 all-gathers (0 B), 0 reduce-scatters") is one, line
