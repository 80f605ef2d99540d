"""``fsdp-planner check``: one small model per finding, a clean model with none, the CLI's exit codes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Done, policy, run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import SplitParamError, make_plan
from fsdp_planner.fsdp2.pitfalls import Code, Severity, has_errors, model_findings, plan_findings
from fsdp_planner.fsdp2.plan import Group, Mesh, Plan
from fsdp_planner.models import load_model
from fsdp_planner.planners import ExecutionOrderPolicy
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace import record

FACTORIES = "tests/fixtures/factories.py"
BF16_MIXED = SimOptions().precision


def traced(spec: str):
    lm = load_model(spec if ":" in spec or "-" in spec else f"{FACTORIES}:{spec}")  # a bare name: a factory
    return record(lm.model, lm.example_inputs, lm.loss_fn)


def codes(findings, severity: Severity | None = None) -> list[str]:
    return [f.code.value for f in findings if severity is None or f.severity is severity]


def by_hand(tr, *groups: list[str]) -> Plan:
    """A plan file as a user writes it: each group's params by prefix, the root the rest."""
    taken: set[str] = set()
    out = []
    for ms in groups:
        ps = [p.fqn for p in tr.params if any(p.fqn.startswith(m + ".") for m in ms) and p.fqn not in taken]
        taken.update(ps)
        out.append(Group(list(ms), ps))
    out.append(Group([""], [p.fqn for p in tr.params if p.fqn not in taken], False))
    return Plan(out, tr.fingerprint, tr.numel)


def test_a_clean_model_and_plan_have_no_findings():
    tr = traced("twice")
    plan = ExecutionOrderPolicy().plan(tr)
    assert model_findings(tr, BF16_MIXED) == [] and plan_findings(tr, plan) == []


def test_a_step_branching_on_its_data_is_a_warning_and_its_other_branch_no_dead_code():
    """``self.pos(h) if h.sum() > 0 else self.neg(h)``: the trace took one branch (the stand-in's answer), and a
    rank whose data takes the other calls other modules and collectives (gloo aborted on a trial's model); check
    said nothing of it, and advised removing the branch it did not take as unused params."""
    tr = traced("tests/fixtures/invalid_models.py:data_dependent")
    findings = {f.code: f for f in model_findings(tr, BF16_MIXED)}
    branch = findings[Code.DATA_DEPENDENT_STEP]
    assert branch.severity is Severity.WARNING and branch.module == "" and "reads tensor values on the host" in \
        branch.message
    assert "or a branch of a data-dependent if the trace did not take" in findings[Code.UNUSED_PARAMS].message
    assert not traced("toy-llama").host_reads  # (reads no value: no warning)


def test_titan_and_auto_keep_a_reused_side_module_out_of_a_list_group():
    """ALBERT's shared block applied four times, blocks detected as its Linears: titan listed the shared block's
    norm (called four times) beside the final norm, which check warns of (pytorch#183702), and auto took that
    baseline's grouping (a trial). A reused side module gets a group of its own."""
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners import AutoPolicy, TorchtitanPolicy

    tr = traced("tests/fixtures/factories.py:albert")
    assert tr.forward_calls("shared.norm") == 4
    for plan in (TorchtitanPolicy("Linear").plan(tr), AutoPolicy(parse_cluster("h100:8")).plan(tr)):
        listed = [m for g in plan.groups if len(g.modules) > 1 for m in g.modules]
        assert all(tr.forward_calls(m) == 1 for m in listed), [g.modules for g in plan.groups]
        assert Code.LIST_GROUP_REUSE not in {f.code for f in plan_findings(tr, plan)}


def test_sharded_read_names_the_module_and_the_fix():
    tr = traced("tests/fixtures/invalid_models.py:direct_call")
    [f] = plan_findings(tr, make_plan(tr, [["layer"], ["linear"]]))
    assert (f.severity, f.code, f.module) == (Severity.ERROR, Code.SHARDED_READ, "layer.proc")
    assert "'layer.proc.weight'" in f.message and "group 0 (layer)" in f.message
    assert "through layer's forward" in f.fix and "fully_shard(model.layer.proc)" in f.fix


def test_an_unregistered_forward_method_is_an_error_and_a_registered_one_a_warning():
    tr = traced("head_loss")
    plan = make_plan(tr, [["inp"], ["block"], ["head"]])
    [f] = plan_findings(tr, plan.replace(forward_methods=[]))  # its sharded reads are this finding, not another
    assert (f.severity, f.code, f.module) == (Severity.ERROR, Code.FORWARD_METHOD, "head")
    assert 'register_fsdp_forward_method(model.head, "loss")' in f.fix
    assert codes(plan_findings(tr, plan)) == ["forward-method"]
    assert not has_errors(plan_findings(tr, plan))


def test_tied_params_across_groups():
    tr = traced("toy-gpt2-tied")
    plan = by_hand(tr, ["wte"], ["lm_head"])
    found = [f for f in plan_findings(tr, plan) if f.code is Code.TIED_ACROSS_GROUPS]
    assert len(found) == 1 and found[0].severity is Severity.ERROR
    assert "fully_shard([model.wte, model.lm_head])" in found[0].fix


def test_a_module_shared_by_every_block_gets_a_group_of_its_own_as_the_fix():
    """One adapter registered in every block: its params are reachable from each block's group; the fix gives it a
    group of its own, as the module policy does (it said to list its holders together: every block in one group)."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.fc, self.shared = nn.Linear(8, 8), shared

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.fc(x) + self.shared(x)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.adapter = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8))
            self.blocks = nn.ModuleList(Block(self.adapter) for _ in range(3))

        def forward(self, x):  # type: ignore[no-untyped-def]
            for b in self.blocks:
                x = b(x)
            return x

    tr = record(Shared(), (torch.randn(2, 8),), lambda out: out.sum())
    with pytest.raises(SplitParamError) as split:  # (check's finding, tied-across-groups; other commands' error)
        plan_findings(tr, by_hand(tr, ["blocks.0"], ["blocks.1"], ["blocks.2"]))
    assert split.value.fix == "give adapter a group of its own (its fully_shard before its holders')"
    fixed = by_hand(tr, ["adapter"], ["blocks.0"], ["blocks.1"], ["blocks.2"])
    assert not has_errors(plan_findings(tr, fixed))
    # a shared ModuleList, which fully_shard refuses: its modules as one group (a review)
    listed = Shared()
    listed.adapter = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    for b in listed.blocks:
        b.shared = listed.adapter
        b.forward = (lambda blk: lambda x: blk.fc(x) + blk.shared[1](blk.shared[0](x)))(b)
    tr = record(listed, (torch.randn(2, 8),), lambda out: out.sum())
    with pytest.raises(SplitParamError) as split:
        plan_findings(tr, by_hand(tr, ["blocks.0"], ["blocks.1"], ["blocks.2"]))
    assert split.value.fix == "list adapter.0, adapter.1 in a group of their own (one fully_shard([...]) before " \
        "their holders')"
    assert not has_errors(plan_findings(tr, by_hand(tr, ["adapter.0", "adapter.1"], ["blocks.0"], ["blocks.1"],
                                                    ["blocks.2"])))


def test_a_hand_written_plan_file_that_splits_tied_params_is_check_s_finding(tmp_path):
    """A plan file listing a tied pair's modules in two groups is the tied-across-groups finding, exit 1 (its
    params cannot be claimed, which ended check as a file error, exit 2: a new user's finding)."""
    path = tmp_path / "plan.json"
    path.write_text('{"version": 1, "groups": [["wte"], ["lm_head"]]}')
    done = run_check("toy-gpt2-tied", "--plan", str(path), "--json")
    assert done.returncode == 1, done.stderr
    (found,) = json.loads(done.stdout)
    assert (found["code"], found["module"]) == ("tied-across-groups", "wte")
    assert "reachable from groups 0 and 1" in found["message"]
    assert found["fix"] == "list wte, lm_head together in one fully_shard([...])"  # every module it names
    assert "checked toy-gpt2-tied: the model, and the plan in" in run_check("toy-gpt2-tied", "--plan", str(path)).stdout
    assert run_main("simulate", "toy-gpt2-tied", "--plan", str(path)).returncode == 2  # elsewhere, an error


def test_a_module_reused_inside_a_list_group():
    tr = traced("twice")
    found = plan_findings(tr, make_plan(tr, [["inp", "block"]]))
    assert codes(found, Severity.WARNING)[0] == "list-group-reuse"  # real FSDP2 trains this one (verify passes)
    assert not has_errors(found)
    assert found[0].module == "block" and "pytorch#183702" in found[0].message


def test_a_list_group_whose_modules_run_apart_is_a_warning():
    """[layers.0, layers.3]: gathered at layers.0's forward, resharded after layers.3's, held while the groups
    between run (a trial's [blocks.0, blocks.5] had no finding); modules that run one after another, a tied pair
    (which must be one group) and a small group (the BatchNorms' fp32 one) are not said."""
    tr = traced("toy-llama")
    apart = [f for f in plan_findings(tr, by_hand(tr, ["layers.0", "layers.3"], ["layers.1"], ["layers.2"]))
             if f.code is Code.LIST_GROUP_APART]
    assert len(apart) == 1 and apart[0].severity is Severity.WARNING and apart[0].module == "layers.0"
    assert apart[0].message.startswith("list group 0 (layers.0, layers.3) is gathered at layers.0's forward and "
                                       "resharded after layers.3's: its ")
    assert apart[0].message.endswith("stay unsharded while 2 other groups run between them (layers.1, layers.2)")
    assert apart[0].fix.endswith("give layers.3 a group of its own (fully_shard(model.layers[3]))")
    together = by_hand(tr, ["layers.0", "layers.1"], ["layers.2"], ["layers.3"])
    assert Code.LIST_GROUP_APART not in {f.code for f in plan_findings(tr, together)}
    # a group around the list group (its parent's norm runs between them) is held around it whatever it lists
    around = make_plan(tr, [["layers.0.attention", "layers.0.feed_forward"], ["layers.0"], ["layers.1"]])
    assert Code.LIST_GROUP_APART not in {f.code for f in plan_findings(tr, around)}
    tied = traced("toy-gpt2-tied")
    found = plan_findings(tied, by_hand(tied, ["wte", "lm_head"], ["h.0"], ["h.1"], ["h.2"]))
    assert Code.LIST_GROUP_APART not in {f.code for f in found}
    done = run_check("tests/fixtures/resnet_models.py:build", "--policy", "size", "--json")  # the 15 BatchNorms'
    assert [f["code"] for f in json.loads(done.stdout)] == ["root-params"]  # fp32 group spans the step: 0.2%


def test_a_list_group_module_called_by_the_loss():
    """A list group one of whose modules the loss calls after the model's forward ([head, aux_head], the order
    policy's): FSDP2 runs the group's forward hooks again there, which the replay does not (a new user's: 7
    all-gathers measured, 6 predicted); a warning naming the module, none for it in a group of its own."""
    import torch.nn as nn

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head, self.aux = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 2)

        def forward(self, x):  # type: ignore[no-untyped-def]
            h = self.body(x)
            return self.head(h), h

    model = Heads()
    tr = record(model, (torch.randn(4, 8),), lambda out: out[0].sum() + model.aux(out[1]).sum())
    found = plan_findings(tr, make_plan(tr, [["body"], ["head", "aux"]]))
    assert codes(found, Severity.WARNING) == ["list-group-after-forward"] and found[0].module == "aux"
    assert "called after the model's forward (by the loss) inside list group 1 (head, aux)" in found[0].message
    assert "list-group-after-forward" not in codes(plan_findings(tr, make_plan(tr, [["body"], ["head"], ["aux"]])))


def test_a_list_group_holding_an_unused_module_beside_used_ones_warns():
    """An unused module in a list group with used ones leaves the group's forward incomplete (the root's
    post-forward completes it and gathers it again in backward: ModuleInfo.unused). No warning where nothing of
    the group runs (its forward never starts), nor for an unused module tied to a used one (it cannot be apart):
    both predicted exactly (a reviewer's cases)."""
    import torch.nn as nn

    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.body, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16, bias=False)
            self.aux, self.tower = nn.Linear(8, 2), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            self.tied = nn.Linear(8, 16, bias=False)
            self.tied.weight = self.embed.weight

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.head(self.body(self.embed(x)))

    tr = record(Towers(), (torch.randint(0, 16, (2, 4)),), lambda out: out.sum())

    def unused(groups: list[list[str]]) -> list[str]:
        return [f.module for f in plan_findings(tr, make_plan(tr, groups)) if f.code is Code.LIST_GROUP_UNUSED]

    assert unused([["embed", "tied"], ["body"], ["head", "aux"], ["tower"]]) == ["aux"]
    assert unused([["embed", "tied"], ["body"], ["head"], ["aux", "tower.0", "tower.1"]]) == []


def test_unused_and_float64_params():
    tr = traced("wasteful")
    found = model_findings(tr, BF16_MIXED)
    assert codes(found) == ["unused-params", "fp64-params"]
    assert all(f.severity is Severity.WARNING for f in found)
    assert found[0].module == "spare" and "spare.weight" in found[0].message


def test_root_params_with_their_bytes():
    tr = traced("toy-llama")
    [f] = [f for f in plan_findings(tr, make_plan(tr, [[f"layers.{i}"] for i in range(4)]))
           if f.code is Code.ROOT_PARAMS]
    nbytes = sum(p.nbytes for p in tr.params if not p.fqn.startswith("layers."))  # traced in fp32: its own bytes
    assert f.severity is Severity.WARNING and f"({nbytes // 1024} KiB unsharded)" in f.message
    assert "tied" not in f.fix and "auto's" not in f.fix
    # auto's plan keeps them there on purpose (its empty-root candidate was slower): the fix says so (a new user
    # could not tell whether to believe check or auto)
    auto = make_plan(tr, [[f"layers.{i}"] for i in range(4)], policy="auto(h100:8, 70.8 GiB)")
    [f] = [f for f in plan_findings(tr, auto) if f.code is Code.ROOT_PARAMS]
    assert f.fix.endswith("this plan is auto's, which keeps params on the root only where its search found them "
                          "grouped slower, larger or unable to run")
    # under TP 2 each rank holds half of the embedding and of the output head, the norm whole (check said the
    # whole model's bytes where plan said each rank's: a new user's trial)
    from fsdp_planner.fmt import fmt_bytes
    from fsdp_planner.planners.tensor_parallel import titan_llama_layout

    tp = make_plan(tr, [[f"layers.{i}"] for i in range(4)]).replace(tensor_parallel=titan_llama_layout(2))
    [f] = [f for f in plan_findings(tr, tp) if f.code is Code.ROOT_PARAMS]
    halved = sum(p.nbytes // (1 if p.fqn.startswith("norm.") else 2) for p in tr.params
                 if not p.fqn.startswith("layers."))
    assert f"({fmt_bytes(halved)} unsharded on each TP rank)" in f.message and halved < nbytes


def test_root_params_the_root_reads_say_why_they_stay():
    """A ParameterList the root's forward indexes cannot leave the root group: the fix column was empty."""
    tr = traced("gated")
    [f] = [f for f in plan_findings(tr, make_plan(tr, [["blocks.0"], ["blocks.1"]])) if f.code is Code.ROOT_PARAMS]
    assert f.fix.startswith("the root module's forward reads them, where only the root's group is gathered")


def test_root_params_name_a_tied_params_modules_together():
    """The fix for a tied embedding left to the root lists every module holding it in one call: sharding the
    embedding alone, as the plain advice says, is the tied-across-groups error."""
    tr = traced("toy-gpt2-tied")
    plan = make_plan(tr, [[f"h.{i}"] for i in range(3)])
    [f] = [f for f in plan_findings(tr, plan) if f.code is Code.ROOT_PARAMS]
    assert f.fix.endswith("; wte.weight is tied: fully_shard([model.wte, model.lm_head])")
    followed = make_plan(tr, [["wte", "lm_head"], *([f"h.{i}"] for i in range(3))])
    assert Code.TIED_ACROSS_GROUPS not in codes(plan_findings(tr, followed))


def test_fsdp1_unit_mixing_frozen_and_trainable_params():
    tr = traced("partly_frozen")
    plan = make_plan(tr, [["block"]])
    assert plan_findings(tr, plan) == []  # FSDP2 takes it
    [f] = plan_findings(tr, plan, fsdp1=True)
    assert (f.code, f.module) == (Code.FSDP1_MIXED_UNIT, "block") and "use_orig_params=True" in f.fix


def test_dtype_findings():
    tr = traced("mixed_dtype")
    assert codes(model_findings(tr, BF16_MIXED)) == ["upcast-reduce"]
    found = plan_findings(tr, by_hand(tr, ["layers.0"]))
    assert codes(found) == ["mixed-dtype-group"] * 2  # the block's group and the root's (inp in fp32, out in bf16)
    assert found[0].module == "layers.0" and "uniform original parameter dtype" in found[0].message
    assert codes(model_findings(traced("own_mixed"))) == ["mixed-dtype-module"]


def test_container_group_and_reshard_after_forward():
    tr = traced("mixed_dtype")
    plan = by_hand(tr, ["layers"])
    (found,) = [f for f in plan_findings(tr, plan) if f.code is Code.CONTAINER_GROUP]
    i = next(k for k, g in enumerate(plan.groups) if "layers" in g.modules)
    # (the group named by its modules too: the plan's numbering is not the plan file's, a trial's "group 1" was
    # the file's first)
    assert found.message.startswith(f"group {i} (layers) lists layers, a ModuleList without forward"), found.message
    plan = make_plan(tr, [["inp"]], reshard=[3])
    assert codes(plan_findings(tr, plan, world_size=8)) == ["reshard-after-forward"]
    # a mesh of another world size is no reshard_after_forward finding (it was, with that fix: a new user's finding)
    (found,) = plan_findings(tr, plan.replace(mesh=Mesh(3, 3)), world_size=8)
    assert found.code is Code.DOES_NOT_RUN and "mesh 3x3 has 9 ranks" in found.message
    assert found.fix.startswith("make the plan again for 8 ranks")


def run_check(*args: str) -> Done:
    return run_main("check", *args)


@pytest.mark.integration
def test_cli_exit_codes_and_json(tmp_path):
    clean = run_check(f"{FACTORIES}:twice", "--policy", "order")
    assert clean.returncode == 0 and "no findings" in clean.stdout, clean.stdout + clean.stderr
    tr = traced("head_loss")
    path = tmp_path / "plan.json"
    make_plan(tr, [["inp"], ["block"], ["head"]]).replace(forward_methods=[]).save(path)
    bad = run_check(f"{FACTORIES}:head_loss", "--plan", str(path), "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    findings = json.loads(bad.stdout)
    assert [sorted(f) for f in findings] == [["code", "fix", "message", "module", "severity"]] * len(findings)
    assert {"severity": "error", "code": "forward-method", "module": "head"}.items() <= findings[0].items()
    default = run_check("toy-llama")
    assert default.returncode == 0 and "--policy module (the default" in default.stdout
    assert "root-params" in default.stdout
    missing = run_check(f"{FACTORIES}:twice", "--plan", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_fix_s_code_reaches_each_module_as_python_does():
    """``fully_shard(...)`` in a fix is code that runs: a ModuleList's child is indexed (``model.layers[0]``),
    while the finding's prose names the module by its path."""
    tr = traced("toy-llama")
    plan = make_plan(tr, [["tok_embeddings"], ["layers.1"], ["layers.2"], ["layers.3"], ["norm", "output"]])
    [root] = [f for f in plan_findings(tr, plan) if f.code is Code.ROOT_PARAMS]
    assert "of layers.0.attention_norm, layers.0.attention.wq, " in root.message
    # the block holding them, not each of its modules (a LoRA model's fix named 27 modules of 4 blocks: a trial)
    assert root.fix == "give layers.0 a group of its own (fully_shard(model.layers[0]), ...)"
    inner = policy("module", module_classes=("Attention",)).plan(tr, "toy-llama")  # the blocks' norms and MLPs
    [root] = [f for f in plan_findings(tr, inner) if f.code is Code.ROOT_PARAMS]
    assert root.fix.startswith("give tok_embeddings, layers.0, layers.1, +4 groups of their own")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.out = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(self.norm(x)))


class _ReadOutside(torch.nn.Module):
    """Blocks of norm, fc and out; the model's forward reads the first block's out.weight outside its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x).sum() + self.layers[0].out.weight.square().sum()


def test_root_params_fix_names_no_block_whose_group_would_shard_a_param_read_outside_it():
    """The block holding root params stands for its modules only where its group would not claim a param read
    outside its calls: layers.0.out.weight is, so layers.0 as a group fails sharded-read (a review's finding)."""
    model = _ReadOutside()
    tr = record(model, (torch.randn(2, 8),), lambda y: y)
    plan = by_hand(tr, ["layers.0.fc"], ["layers.1"], ["layers.2"], ["head"])
    [root] = [f for f in plan_findings(tr, plan) if f.code is Code.ROOT_PARAMS]
    assert "layers.0.norm" in root.fix and "fully_shard(model.layers[0])" not in root.fix, root.fix
    [root] = [f for f in plan_findings(tr, by_hand(tr, ["layers.0.out"], ["layers.1"], ["layers.2"], ["head"]))
              if f.code is Code.ROOT_PARAMS]  # (the param read outside now a group's; fc and norm left)
    assert root.fix.startswith("give layers.0 a group of its own"), root.fix


class _Temperature(torch.nn.Module):
    """CLIP's shape: a learned 0-dim temperature beside a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale.exp()


def test_a_scalar_param_is_an_error_and_no_plan_is_made():
    """fully_shard raises "doesn't support scalar parameters" for any module managing one: every plan fails."""
    model = _Temperature()
    tr = record(model, (torch.randn(2, 4),), lambda y: y.sum())
    [f] = model_findings(tr, BF16_MIXED)
    assert (f.severity, f.code, f.module) == (Severity.ERROR, Code.SCALAR_PARAMS, "")
    assert "registers scale" in f.message and "reshape(1)" in f.fix
    with pytest.raises(PlannerError, match="fully_shard refuses 0-dim"):
        make_plan(tr, [["proj"]])


def test_a_plan_over_the_budget_is_a_finding():
    """check --cluster named a plan over the budget only inside its answers' prose ("the change's and the plan's
    over the 70.8 GiB budget") and exited 0 on one past the GPU's memory (llama3-8b's module plan on 8 H100s
    reserves 78.9 GiB of an H100's 74.5: a new user's finding). Past the GPU it is an error; past the budget
    alone, a warning."""
    done = run_check("llama3-8b", "--cluster", "h100:8", "--json")
    assert done.returncode == 1, done.stderr
    (over,) = [f for f in json.loads(done.stdout) if f["code"] == "over-budget"]
    assert over["severity"] == "error" and "more than one H100-SXM-80GB holds (74.5 GiB)" in over["message"]
    small = run_check("toy-llama", "--cluster", "h100:8", "--memory-budget", "1MiB", "--json")
    assert small.returncode == 0, small.stderr
    (over,) = [f for f in json.loads(small.stdout) if f["code"] == "over-budget"]
    assert over["severity"] == "warning" and "over the 1 MiB budget (--memory-budget)" in over["message"]
    fits = run_check("toy-llama", "--cluster", "h100:8", "--json")
    assert "over-budget" not in {f["code"] for f in json.loads(fits.stdout)}
    assert "checkpoint more blocks" in over["fix"]
    every = run_check("toy-llama", "--cluster", "h100:8", "--memory-budget", "1MiB", "--policy", "titan", "--ac",
                      "full", "--json")  # every block checkpointed already: no more to checkpoint
    (over,) = [f for f in json.loads(every.stdout) if f["code"] == "over-budget"]
    assert "checkpoint more" not in over["fix"] and "a smaller --batch or --seq, more GPUs" in over["fix"]


def test_checkpointed_batchnorm_is_a_warning():
    """torch's checkpoint runs a BatchNorm's training forward again in backward: its running statistics are updated
    twice a step (checked here on torch itself); check warns once for every checkpointed module holding one, and
    not where nothing is checkpointed or the norms are in eval mode."""
    from torch.utils.checkpoint import checkpoint

    bn = torch.nn.BatchNorm1d(4)
    checkpoint(bn, torch.randn(8, 4, requires_grad=True), use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2
    tr = traced("tests/fixtures/resnet_models.py:build")
    blocks = [m for m in tr.modules if m.count(".") == 1 and m.startswith("layer")]
    plan = make_plan(tr, [[b] for b in blocks])
    assert "checkpointed-running-stats" not in codes(plan_findings(tr, plan))
    [f] = [f for f in plan_findings(tr, plan.replace(activation_checkpointing=blocks))
           if f.code is Code.CHECKPOINTED_RUNNING_STATS]
    assert f.severity is Severity.WARNING and f.module == blocks[0]
    assert f"{len(blocks)} checkpointed modules" in f.message
    lm = load_model("tests/fixtures/resnet_models.py:build")
    lm.model.eval()
    evaluated = record(lm.model, lm.example_inputs, lm.loss_fn)
    assert not any(info.running_stats for info in evaluated.modules.values())


def test_root_params_read_by_a_parent_s_method_name_the_parent():
    """head.score() reads head.proj's weight outside proj's calls: the root-params fix names head (a group holding
    every read), not head.proj, whose own group check then refused as a sharded read."""
    tr = traced("scored")
    plan = make_plan(tr, [[f"blocks.{i}"] for i in range(2)])
    [f] = [f for f in plan_findings(tr, plan) if f.code is Code.ROOT_PARAMS]
    assert f.fix.startswith("give head a group of its own (fully_shard(model.head)")
    assert "sharded-read" not in codes(plan_findings(tr, make_plan(tr, [["blocks.0"], ["blocks.1"], ["head"]])))
    assert "sharded-read" in codes(plan_findings(tr, make_plan(tr, [["blocks.0"], ["blocks.1"], ["head.proj"]])))


def test_an_expert_skipped_without_tokens_is_an_error_and_one_called_on_an_empty_slice_is_not(capsys):
    """A hand-written MoE that skips an expert given no token (``if idx.numel() == 0: continue``) passed ``check``
    ("FSDP2 accepts this plan") and then trained wrong values on gloo (a new user's trial: 5,120x the parity bound,
    33 all-gathers predicted, 21 measured): the balanced stand-in calls every expert. ``check`` now also runs the
    step with the first expert of each routing given nothing and names the params that get no gradient there."""
    from fsdp_planner.cli import main

    assert main(["check", "tests/fixtures/skipping_moe.py:skipping_moe", "--json"]) == 1
    (skips,) = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "routing-skips"]
    assert skips["severity"] == "error" and skips["module"] == "1.experts.0"
    assert "1.experts.1" not in skips["message"] and "numel() == 0" in skips["fix"]
    assert main(["check", "tests/fixtures/skipping_moe.py:calling_moe", "--json"]) == 0
    assert "routing-skips" not in capsys.readouterr().out


@pytest.mark.parametrize("factory", ["guarded_moe", "counted_moe", "compared_moe", "equal_moe"])
def test_an_expert_skipped_by_a_guard_on_its_mask_is_an_error(capsys, factory: str):
    """A guard that reads the expert's mask before selecting its tokens (``if not mask.any()``, ``if
    int(mask.sum()) == 0``, ``if mask.sum() > 0``, ``if mask.sum() == 0``) skips it as ``numel() == 0`` does: a new
    user's trial found check silent on those and the gloo job aborting in a reduce-scatter. The starved step
    answers the first such read after the routing as no token; the balanced step runs every expert (``mask.sum() ==
    0`` was answered true, as counts that must match: every expert skipped, its params reported unused)."""
    from fsdp_planner.cli import main
    from fsdp_planner.models import load_model
    from fsdp_planner.trace import record

    lm = load_model(f"tests/fixtures/skipping_moe.py:{factory}")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    flops = {sum(e.flops for e in tr.events if e.is_op and e.module.startswith(f"1.experts.{k}")) for k in range(4)}
    assert len(flops) == 1 and flops.pop() > 0

    assert main(["check", f"tests/fixtures/skipping_moe.py:{factory}", "--json"]) == 1
    (skips,) = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "routing-skips"]
    assert skips["module"] == "1.experts.0" and "1.experts.1" not in skips["message"]


@pytest.mark.integration  # ~30 s: two torchrun jobs of 2 gloo ranks
def test_verify_says_first_that_an_expert_skipped_without_tokens_decides_parity(capsys):
    """verify of such a MoE passes or fails by what the ranks' batches route (the trial's: PASS at the default
    batch, 5,120x off at batch 1), so it says so before the job, as check's error; a MoE that calls every expert
    gets no such note."""
    from fsdp_planner.cli import main

    main(["verify", "tests/fixtures/skipping_moe.py:skipping_moe", "--policy", "titan", "--nproc", "2",
          "--steps", "2"])
    assert "(check's routing-skips; call every expert each step" in capsys.readouterr().err
    assert main(["verify", "tests/fixtures/skipping_moe.py:calling_moe", "--policy", "titan", "--nproc", "2",
                 "--steps", "2"]) == 0
    assert "routing-skips" not in capsys.readouterr().err


class _AttnBlock(torch.nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ff = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.norm(x)
        return self.ff(x + self.attn(h, h, h, need_weights=False)[0])


class _Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, x0):
        return self.a(x) + self.b(x0)


class _TwiceGiven(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(_Mix() for _ in range(3))

    def forward(self, x):
        x = x0 = self.inp(x)  # (requiring grad: the tensors FSDP2's hooks pass on)
        for b in self.blocks:
            x = b(x, x0)
        return x.sum()


@pytest.mark.parametrize("full_trace", [False, True])
def test_a_listed_module_given_one_tensor_twice_is_said(full_trace: bool) -> None:
    """nn.MultiheadAttention's self-attention gets one tensor as query, key and value; FSDP2's pre-forward hands a
    module it shards its inputs as distinct tensors, so listed alone it projects them apart, not packed as traced
    (a trial's ViT with each attention its own group: 7.7% over the predicted peak, real FSDP2 on fake ranks). Its
    blocks' other calls, replayed from the first block's (``full_trace`` off), are marked alike."""
    model = torch.nn.Sequential(_AttnBlock(), _AttnBlock(), torch.nn.Linear(16, 2))
    tr = record(model, (torch.randn(2, 4, 16),), reuse=not full_trace)
    assert [m for m, info in tr.modules.items() if info.aliased_inputs] == ["0.attn", "1.attn"]
    alone = make_plan(tr, [["0.attn"], ["1.attn"], ["0"], ["1"], ["2"]])
    found = [f for f in plan_findings(tr, alone) if f.code is Code.ALIASED_INPUTS]
    assert len(found) == 1 and found[0].severity is Severity.WARNING and found[0].module == "0.attn"
    assert "2 listed nn.MultiheadAttentions (0.attn, 1.attn) are given one tensor as query" in found[0].message
    blocks = make_plan(tr, [["0"], ["1"], ["2"]])
    assert not any(f.code is Code.ALIASED_INPUTS for f in plan_findings(tr, blocks))
    # the order policy (and auto's atoms) keep such a module with its caller, at any target: ALBERT's order plan,
    # its one layer's attention a group of its own, measured 6.9% over its predicted peak on fake ranks
    for target in (None, 1):
        plan = ExecutionOrderPolicy(target_bytes=target).plan(tr)
        assert not any(f.code is Code.ALIASED_INPUTS for f in plan_findings(tr, plan))
        assert not any(m.endswith("attn") for g in plan.groups for m in g.modules), plan.groups
        assert ["0"] in [list(g.modules) for g in plan.groups] or target is None  # its block, not the whole list
    # any other module given one tensor twice runs alike with distinct ones: not flagged (a review: a block called
    # as block(x, x0), x0 being x, made one atom of the whole stack)
    twice = record(_TwiceGiven(), (torch.randn(2, 16),))
    assert not any(info.aliased_inputs for info in twice.modules.values())
    assert len(ExecutionOrderPolicy(target_bytes=1).plan(twice).groups) > 2
