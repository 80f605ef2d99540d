"""The memory budget: the GPU's capacity less a headroom for what the memory model does not know, used by auto and
by every fits verdict, and the margin each plan keeps below it, printed and in ``--json``."""

from __future__ import annotations

import json
import math

import pytest
from conftest import traced

from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.planners.auto import AutoPolicy
from fsdp_planner.sim.budget import DEFAULT_HEADROOM, Headroom, MemoryBudget, parse_headroom


@pytest.mark.parametrize(("text", "fraction", "nbytes"), [
    ("0.05", 0.05, None), ("5%", 0.05, None), ("0", 0.0, None), ("12.5 %", 0.125, None),
    ("4GiB", DEFAULT_HEADROOM, 4 << 30), ("500MB", DEFAULT_HEADROOM, 500_000_000)])
def test_headroom_reads_a_fraction_or_a_size(text, fraction, nbytes):
    h = parse_headroom(text)
    assert h.nbytes == nbytes
    if nbytes is None:
        assert h.fraction == pytest.approx(fraction)


@pytest.mark.parametrize(("text", "why"), [("1", "ambiguous"), ("40", "ambiguous"), ("100%", "below 100%"),
                                           ("-0.1", "cannot read"), ("lots", "cannot read")])
def test_bad_headroom_is_one_sentence(text, why):
    with pytest.raises(PlannerError, match=why):
        parse_headroom(text)


def test_budget_is_capacity_less_headroom_and_a_headroom_of_everything_is_refused():
    assert MemoryBudget.of_gpu(80_000_000_000, "H100").limit == 76_000_000_000
    assert MemoryBudget.of_gpu(80_000_000_000, "H100", Headroom(nbytes=4 << 30)).limit == 80_000_000_000 - (4 << 30)
    assert MemoryBudget.of_gpu(80_000_000_000, "H100", Headroom(0.0)).limit == 80_000_000_000
    with pytest.raises(PlannerError, match="leaves nothing"):
        MemoryBudget.of_gpu(1 << 30, "tiny", Headroom(nbytes=2 << 30))


@pytest.mark.integration  # over a second: the full suite runs it, the fast subset does not
def test_auto_on_a_tight_row_stays_within_capacity_less_headroom():
    """llama3-8b on 8 H100s: with the whole GPU as budget auto's plan sits within 0.1% of it; under the default
    headroom it must keep the headroom free, and a size headroom the same."""
    tr = traced("llama3-8b")
    cluster = parse_cluster("h100:8")
    capacity = cluster.gpu.memory_bytes
    whole = AutoPolicy(cluster, headroom=Headroom(0.0), search_effort=40).search(tr, "llama3-8b")
    assert whole.fits and whole.report.reserved_memory > capacity * (1 - DEFAULT_HEADROOM)  # the headroom binds
    for headroom, held in ((None, math.ceil(capacity * DEFAULT_HEADROOM)), (Headroom(nbytes=6 << 30), 6 << 30)):
        result = AutoPolicy(cluster, headroom=headroom, search_effort=40).search(tr, "llama3-8b")
        assert result.fits and result.budget == capacity - held
        assert result.report.reserved_memory <= capacity - held
        assert "headroom" in result.budget_source


def test_headroom_zero_plans_as_the_whole_gpu_did():
    """``--headroom 0`` is the old behaviour: the budget is the GPU's capacity, the plan the one an explicit budget
    of the capacity gives."""
    tr = traced("toy-llama")
    cluster = parse_cluster("h100:8")
    zero = AutoPolicy(cluster, headroom=Headroom(0.0)).search(tr, "toy-llama")
    explicit = AutoPolicy(cluster, memory_budget=cluster.gpu.memory_bytes).search(tr, "toy-llama")
    assert zero.budget == cluster.gpu.memory_bytes
    assert zero.plan.to_json() == explicit.plan.to_json()


@pytest.mark.integration  # seconds of planning (the fast subset stays near a minute)
def test_plan_prints_and_reports_the_margin_of_the_simulated_peak(capsys):
    base = ["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--headroom", "4GiB"]
    assert main([*base, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    entry = doc["plans"][0]
    reserved, budget = entry["simulation"]["reserved_memory"], entry["budget"]
    assert budget["reserved_memory"] == reserved and budget["fits"]
    assert budget["budget"] == 80_000_000_000 - (4 << 30) == doc["auto"]["budget"]
    assert budget["margin"] == budget["budget"] - reserved and budget["headroom"] == 4 << 30
    assert main(base) == 0
    out = capsys.readouterr().out
    gap = budget["budget"] - reserved
    assert (f"peak {fmt_bytes(reserved)} reserved, {fmt_bytes(gap)} ({gap / budget['budget']:.1%}) below the "
            f"{fmt_bytes(budget['budget'])} budget (one H100-SXM-80GB (80 GB) less 4 GiB headroom)") in out
    assert "\nfloat8 training (--float8 tensorwise, torchao, float8 all-gather): " in out  # an H100: the what-ifs
    assert "torch.compile of the repeated blocks" not in out  # it compiles the blocks: with --explain
    assert main([*base, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "\ntorch.compile of the repeated blocks (--compile, fullgraph): " in out
    # the two together, judged against compiling alone: on the toy float8 adds nothing to it
    together = next(line for line in out.splitlines() if line.startswith("torch.compile and float8 training"))
    assert together.endswith(": compile alone: float8 adds too little to it here"), together


def test_simulate_judges_a_classic_plan_against_the_budget(capsys):
    """A plan over capacity less headroom but within the capacity is reported over the budget, by how much."""
    args = ["simulate", "toy-llama", "--policy", "titan", "--cluster", "h100:8", "--json"]
    assert main(args) == 0
    reserved = json.loads(capsys.readouterr().out)["reserved_memory"]
    assert main([*args, "--memory-budget", str(reserved - 1000)]) == 0
    over = json.loads(capsys.readouterr().out)["budget"]
    assert not over["fits"] and over["margin"] == -1000 and over["source"] == "--memory-budget"
    assert main([*args[:-1], "--memory-budget", str(reserved - 1000)]) == 0
    assert "over the" in capsys.readouterr().out


def test_headroom_beside_memory_budget_is_refused(capsys):
    assert main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "1GiB",
                 "--headroom", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "give --memory-budget or --headroom, not both" in err and "Traceback" not in err
