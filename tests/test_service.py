"""The planning service: the command line, ``fsdp_planner.plan`` and a job config's plan are one use case (the same
plan, byte for byte, for the same job), checked by one validator (the API's keywords and the CLI's options take the
same types and ranges: a bool is a bool), and ``plan`` loads none of the job machinery."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdp_planner as fp
from fsdp_planner import cli
from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.registry import PolicyName, PolicyRequest
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.planning import plan
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.service.validate import Keywords, Spelling, plan_job
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.options import SimOptions

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration  # (about 3 s: three auto searches of toy-llama)
def test_the_api_the_command_and_a_torchtitan_job_give_one_plan(tmp_path, capsys):
    """``fsdp_planner.plan``, ``plan --policy auto --out`` and ``plan --from-torchtitan --out`` for the same model,
    workload, optimizer and cluster write the same bytes (torchtitan's default optimizer is fused AdamW, the
    command's foreach: the job names foreach)."""
    by_cli, by_config = tmp_path / "cli.json", tmp_path / "config.json"
    assert cli.main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--batch", "2", "--seq", "64",
                     "--out", str(by_cli)]) == 0
    job = tmp_path / "job.toml"
    job.write_text("[training]\nlocal_batch_size = 2\nseq_len = 64\n"
                   "[parallelism]\ndata_parallel_shard_degree = 8\n[optimizer]\nimplementation = \"foreach\"\n")
    assert cli.main(["plan", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100", "--out",
                     str(by_config)]) == 0
    capsys.readouterr()
    by_api = fp.plan("toy-llama", cluster="h100:8", batch=2, seq=64).checked_json() + "\n"
    assert by_cli.read_bytes() == by_config.read_bytes() == by_api.encode()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"offload": "false"}, "offload must be True or False (a bool), got 'false'"),
    ({"offload": 2}, "offload must be True or False (a bool), got 2"),
    ({"batch": True}, "batch must be a whole number, got True"),
    ({"batch": 0}, "batch must be from 1 to 1,000,000, got 0"),
    ({"seq": 10**12}, "seq must be from 1 to 10,000,000, got 1000000000000"),
    ({"micro_batches": True}, "micro_batches must be a whole number, got True"),
    ({"search_effort": -1}, "search_effort must be from 0 to 1,000,000,000, got -1"),
    ({"search_effort": 2.0}, "search_effort must be a whole number, got 2.0"),
    ({"memory_budget": True}, "memory_budget must be bytes (an int) or a size such as '60GiB', got True"),
    ({"headroom": False}, "headroom must be a fraction (0.05, '5%') or a size ('4GiB'), got False"),
    ({"routing": True}, "routing must be a capacity factor from 0.1 to 64, got True"),
    ({"module_classes": 3, "policy": "module"}, "module_classes must be class names"),
    ({"gradient_sync": "each", "micro_batches": 2, "batch": 4}, "gradient_sync must be one of last, every"),
])
def test_api_arguments_are_typed_and_bounded_in_one_sentence(kwargs, message):
    with pytest.raises(PlannerError) as e:
        fp.plan("toy-llama", **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("given", [{"offload": "false"}, {"micro_batches": 0}, {"batch": 4, "micro_batches": 3},
                                   {"seq": 0}, {"memory_budget": "60GiB", "headroom": "5%"},
                                   {"ac_policy": "titan", "ac": "full"}, {"mfu": 2.0}, {"search_effort": -1}])
def test_the_api_and_the_command_line_are_checked_by_one_validator(given):
    """The same values refused with the same sentence, each setting named as its user spells it."""
    errors = []
    for spell in Spelling:
        with pytest.raises(PlannerError) as e:
            plan_job(Keywords(model="toy-llama", policy="auto", **given), spell)
        errors.append(str(e.value))
    cli_error, api_error = errors
    for key in [*given, "ac"]:
        cli_error = cli_error.replace("--" + key.replace("_", "-"), key)
        api_error = api_error.replace(f"{key}=", f"{key} ")
    assert cli_error.replace("'", "") == api_error.replace("'", "")


def test_the_command_line_refuses_what_the_validator_refuses(capsys):
    """An option argparse lets through (any text) meets the same check as the keyword."""
    assert cli.main(["plan", "toy-llama", "--policy", "auto", "--batch", "4", "--micro-batches", "3"]) == 2
    assert "--micro-batches 3 must divide --batch 4" in capsys.readouterr().err
    with pytest.raises(PlannerError, match=r"micro_batches=3 must divide batch=4"):
        fp.plan("toy-llama", batch=4, micro_batches=3)


@pytest.mark.integration  # seconds of planning (the fast subset stays near a minute)
def test_plan_loads_no_job_machinery():
    """``plan toy-llama`` imports no module of apply/, calibrate/ or runtime/ (torchrun, DCP, the fake world)."""
    code = ("import sys; from fsdp_planner import cli; code = cli.main(['plan', 'toy-llama', '--json']); "
            "loaded = sorted(m for m in sys.modules if m.split('.')[1:2] in (['apply'], ['calibrate'], ['runtime']) "
            "and m.startswith('fsdp_planner.')); print(code, loaded, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == "0 []", out.stderr[-2000:]


@pytest.mark.integration  # seconds of planning (the fast subset stays near a minute)
def test_a_comparison_shows_autos_plan_over_the_budget_only_when_it_need_not_fit():
    """A comparison (the demo's) with ``must_fit=False`` keeps auto's best plan as its last row, simulated as the
    search did, beside ``no_fit``; with ``must_fit`` that plan is left out."""
    cluster = parse_cluster("h100:2")
    budget = 1 << 10  # 1 KiB: nothing fits
    policies = (PolicyRequest(PolicyName.ORDER), PolicyRequest(PolicyName.AUTO, memory_budget=budget))
    within = MemoryBudget(budget, cluster.gpu.memory_bytes, cluster.gpu.name, None)
    job = PlanJob(ModelSpec("toy-llama"), policies, cluster, SimOptions(), within, compare=True, must_fit=False)
    traced = trace_spec("toy-llama")
    shown = plan(job, lambda spec, options: traced)
    assert shown.no_fit is not None and shown.search is not None and not shown.search.fits
    assert shown.rows[0][0].policy.startswith("order")
    auto_plan, _, auto_report = shown.rows[-1]
    assert len(shown.rows) == 2 and auto_plan == shown.search.plan and auto_report is shown.search.report
    order_plan, _, order_report = shown.rows[0]
    assert shown.baselines == shown.rows[:1] and shown.fastest_baseline() == (order_plan, order_report, False)
    left_out = plan(dataclasses.replace(job, must_fit=True), lambda spec, options: traced)
    assert left_out.no_fit == shown.no_fit and len(left_out.rows) == 1


SELF_CHECKPOINTING = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class B(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.ada = nn.Linear(16, 32)

    def forward(self, x, c):
        s, g = self.ada(c).chunk(2, dim=1)
        q, k, v = self.qkv(x * (1 + s.unsqueeze(1))).view(2, 4, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 4, 16)
        return x + g.unsqueeze(1) * a


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(B() for _ in range(2))
        self.c = nn.Linear(16, 16)

    def forward(self, x, t):
        c = self.c(t)
        for b in self.blocks:
            x = checkpoint(b, x, c, use_reentrant=False)  # as diffusion models and torchtune do
        return x


def build():
    return Net(), (torch.randn(2, 4, 16), torch.randn(2, 16))
'''


def test_a_model_that_checkpoints_its_attention_itself_traces(tmp_path):
    """The tracer could not replay a model's own torch.utils.checkpoint of a block with attention (issue 39: torch's
    18-line CheckpointError, then a refusal): it traces, its blocks recorded as the model checkpoints them."""
    path = tmp_path / "self_ckpt.py"
    path.write_text(SELF_CHECKPOINTING)
    notes = []
    tr = trace_spec(f"{path}:build", note=notes.append)
    assert [(c.module, c.call) for c in tr.own_checkpointed] == [("blocks.0", 0), ("blocks.1", 0)]
    assert any("checkpoints 2 module call(s) itself" in n for n in notes)


def test_a_checkpoint_error_from_the_models_own_copy_of_checkpoint_is_one_line(tmp_path):
    """A CheckpointError the trace's stand-ins did not prevent (the model's own copy of torch's checkpoint code):
    one line saying what to change, not torch's message."""
    path = tmp_path / "own_copy.py"
    path.write_text(SELF_CHECKPOINTING.replace("x = checkpoint(b, x, c, use_reentrant=False)", "x = b(x, c)\n"
                    "            raise torch.utils.checkpoint.CheckpointError('a different number of tensors')"))
    with pytest.raises(PlannerError, match=r"its own copy of torch's checkpoint code, .* --ac full or --ac op") as e:
        trace_spec(f"{path}:build")
    assert "\n" not in str(e.value)

def test_a_built_in_models_trace_is_kept_with_its_notes_and_a_model_file_is_traced_again(tmp_path):
    """A process keeps a built-in model's trace (its code ships with the package: the API's plan and fit of one
    model, the suite's commands, trace it once) and says its notes on every call; a model file may change between
    two calls, so its step is traced again."""
    first, again = [], []
    spec = ModelSpec("toy-llama", attention="eager", batch_size=3)
    tr = trace_spec(spec, note=first.append)
    assert trace_spec(spec, note=again.append) is tr and again == first and "attention traced as eager" in first[0]
    assert trace_spec(ModelSpec("toy-llama", attention="eager", batch_size=2)) is not tr
    model = tmp_path / "net.py"
    for width in (8, 16):
        model.write_text("import torch\nimport torch.nn as nn\n\n\ndef build():\n"
                         f"    return nn.Linear({width}, 4), (torch.randn(2, {width}),)\n")
        assert sum(p.numel for p in trace_spec(f"{model}:build").params) == width * 4 + 4
