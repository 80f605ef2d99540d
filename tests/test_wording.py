"""What people read: text that the terminal must not swallow (rich markup), counts that agree with the tables,
ties called ties, one-rank steps with no collectives, a model with nothing to explain."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.cli import main, render
from fsdp_planner.fmt import fmt_count, fmt_gain, fmt_modules
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.pitfalls import Code, model_findings, plan_findings
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace import record

ROOT_ONLY = """import torch


class OneMatrix(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return x @ self.w


def build():
    return OneMatrix(), (torch.randn(4, 64),)
"""


def _traced(spec: str):
    lm = load_model(spec)
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def _shown(renderable) -> str:
    console = Console(width=300, record=True)
    console.print(renderable)
    return console.export_text()


def test_a_fix_in_square_brackets_is_shown_as_written():
    """rich reads ``[a, b]`` as markup and would print ``fully_shard()``: the fix of an error finding, lost."""
    tr = _traced("toy-gpt2-tied")
    # a plan written by hand that splits the tied embedding and head (what fully_shard refuses)
    groups = [Group([m], [p.fqn for p in tr.params if p.fqn.startswith(m + ".")]) for m in ("wte", "lm_head")]
    listed = {p for g in groups for p in g.params}
    plan = Plan([*groups, Group([""], [p.fqn for p in tr.params if p.fqn not in listed], False)], tr.fingerprint,
                tr.numel)
    finding = next(f for f in plan_findings(tr, plan) if f.code is Code.TIED_ACROSS_GROUPS)
    assert "fully_shard([model.wte, model.lm_head])" in _shown(render.findings_table([finding]))


def test_counts_and_gains_read_as_english():
    assert [fmt_count(n, "group") for n in (0, 1, 2, 1000)] == ["0 groups", "1 group", "2 groups", "1,000 groups"]
    assert fmt_gain(1.0, 1.0) is fmt_gain(1.0, 1.0004) is None  # a tie
    assert fmt_gain(0.9, 1.0) == "10.0% faster" and fmt_gain(1.1, 1.0) == "10.0% slower"
    assert fmt_modules(["a", "b"], 1) == "a, b" and fmt_modules(["a", "b", "c"], 1) == "a, +2"


def test_one_rank_issues_no_collectives_on_gpus_either():
    """FSDP2 over a shard group of one rank all-gathers and reduce-scatters nothing (it copies the params out of
    their shards): simulate says so, as verify --nproc 1 and the CPU-rank engine already do."""
    tr = _traced("toy-llama")
    plan = make_plan(tr, [["layers.0"], ["layers.1"]])
    one = simulate(tr, plan, parse_cluster("h100:1"), SimOptions())
    two = simulate(tr, plan, parse_cluster("h100:2"), SimOptions())
    assert (one.all_gathers, one.reduce_scatters, one.all_gather_bytes, one.comm_time["all_gather"]) == (0, 0, 0, 0)
    assert two.all_gathers > 0 and two.comm_time["all_gather"] > 0
    assert not [e for e in one.timeline if e.stream.value == "all_gather"]


@pytest.fixture
def root_only(tmp_path: Path) -> str:
    (tmp_path / "root_only.py").write_text(ROOT_ONLY)
    return f"{tmp_path / 'root_only.py'}:build"


def test_auto_on_a_model_only_the_root_can_hold(capsys, root_only):
    assert main(["plan", root_only, "--policy", "auto", "--cluster", "h100:2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "auto: the root alone," in out and "1 plan simulated" in out and "ties with the best classic" in out
    assert "why: every param stays with the root" in out and "held by:" not in out
    assert "1 module," in out and "0.0% faster" not in out


def test_check_says_when_no_plan_was_checked(capsys, root_only):
    assert main(["check", root_only]) == 0
    captured = capsys.readouterr()
    assert "the model only (no plan to check)" in captured.out and "no findings in the model" in captured.out
    assert "FSDP2 accepts this plan" not in captured.out


def test_a_negative_positional_value_is_named(capsys):
    assert main(["cost", "all-gather", "-5MB", "--cluster", "h100:8"]) == 2
    assert "'-5MB' reads as an option: a size or count cannot be negative" in capsys.readouterr().err


def test_exported_code_counts_the_groups_it_lists():
    tr = _traced("toy-llama")
    plan = make_plan(tr, [["layers.0"], ["layers.1"]])
    assert "(2 groups and the root)" in export_plan(plan, ExportFormat.PYTHON)


def test_a_budget_larger_than_the_gpu_is_noted(capsys):
    assert main(["plan", "seed-net", "--policy", "auto", "--cluster", "h100:8", "--memory-budget", "1TiB"]) == 0
    assert "note: --memory-budget 1 TiB is more than one H100-SXM-80GB holds" in capsys.readouterr().err


UNUSED = """import torch


class WithSpare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out, self.spare = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.out(self.inp(x))


def build():
    return WithSpare(), (torch.randn(2, 16),)
"""


def test_a_module_the_step_never_runs_is_to_remove_not_to_group(tmp_path):
    (tmp_path / "spare.py").write_text(UNUSED)
    tr = _traced(f"{tmp_path / 'spare.py'}:build")
    plan = make_plan(tr, [["out"]])  # the root keeps inp and spare
    found = {f.code: f for f in [*model_findings(tr, SimOptions().precision), *plan_findings(tr, plan)]}
    assert found[Code.ROOT_PARAMS].fix.startswith("give inp a group of its own") and "spare" not in \
        found[Code.ROOT_PARAMS].fix + found[Code.ROOT_PARAMS].message
    assert found[Code.UNUSED_PARAMS].module == "spare"


@pytest.mark.integration
def test_quiet_silences_library_warnings_too(tmp_path):
    import subprocess
    import sys

    (tmp_path / "warns.py").write_text(ROOT_ONLY.replace("def build():\n", "def build():\n    import warnings\n"
                                                         "    warnings.warn('a library speaks')\n"))
    spec = f"{tmp_path / 'warns.py'}:build"
    loud, quiet = (subprocess.run([sys.executable, "-m", "fsdp_planner", "plan", spec, "--policy", "order", *flag],
                                  capture_output=True, text=True, timeout=120) for flag in ([], ["-q"]))
    assert loud.returncode == quiet.returncode == 0 and loud.stdout == quiet.stdout
    assert "a library speaks" in loud.stderr and quiet.stderr == ""
