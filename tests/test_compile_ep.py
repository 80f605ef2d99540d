"""Expert parallelism inside torch.compile'd blocks, as torchtitan's ``apply_compile`` compiles its MoE blocks whole
with EP: the experts sharded in their blocks' calls (a per-param mesh, no hooks of their own), EP's all-to-alls
traced into the block's graph. What an inductor-compiled block saves under EP, measured on the fake process group
against the simulator's figure; real FSDP2 + EP training compiled blocks on gloo ranks with parity; and the plans
that stay refused (the experts in calls of their own, a skew)."""

from __future__ import annotations

import json

import pytest
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel

from fsdp_planner.apply import apply_plan
from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.expert_parallel import ExpertParallel
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.fsdp2.validity import check_compiled_groups
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.runtime.fake_world import fake_process_group
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.expert_parallel import ep_view
from fsdp_planner.sim.options import precision_named
from fsdp_planner.sim.recompute import checkpointed_calls, compiled_under_sac

TINY = "tests/fixtures/ep_moe.py:tiny_mixtral"
BLOCK = "layers.0"


def _plan(tmp_path, *args: str) -> Plan:
    out = tmp_path / "plan.json"
    assert main(["plan", TINY, "--policy", "titan", "--compile", "--precision", "fp32", "--attention", "eager",
                 "--cluster", "h100:2", *args, "--out", str(out)]) == 0
    return Plan.from_json(out.read_text())


def _predicted(plan: Plan) -> int:
    """What the simulator holds for the block's compiled call: measured on the model without EP (its SAC variant
    where op-level checkpointed), on the EP rank's view with what EP adds (``compiled_under_sac``)."""
    tr = trace_spec(ModelSpec(TINY, compile=True, attention="eager"), precision_named("fp32"))
    view = ep_view(tr, plan).trace if plan.expert_parallel is not None else tr
    calls = checkpointed_calls(view, tuple(plan.selective_checkpointing.items()))
    return compiled_under_sac(view, calls).get(BLOCK, view.compiled[BLOCK].saved)


def _measured(plan: Plan) -> int:
    """Bytes the block's inductor-compiled node saves for backward on rank 0 of 2 fake ranks (the plan applied as
    a user's script applies it), each storage once; FSDP2's unsharded params are freed after forward (resharded),
    so their storages count nothing."""
    with fake_process_group(2):
        lm = load_model(ModelSpec(TINY), meta=False)
        apply_plan(lm.model, plan)
        x = lm.model.tok_embeddings(*lm.example_inputs)
        with sdpa_kernel(SDPBackend.MATH):
            out = lm.model.layers[0](x)
        node, stack, seen = None, [out.grad_fn], set()
        while stack and node is None:  # (the checkpoint's node lies above the compiled one)
            n = stack.pop()
            if n is not None and n not in seen:
                seen.add(n)
                node = n if type(n).__name__ == "CompiledFunctionBackward" else None
                stack.extend(f for f, _ in n.next_functions)
        assert node is not None
        storages = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in node.saved_tensors}
        return sum(storages.values())


@pytest.mark.integration  # inductor compiles the tiny Mixtral's block four times (~1 min on 2 cores)
@pytest.mark.parametrize("ac", [(), ("--ac", "op")], ids=["no-ac", "op-level"])
def test_a_compiled_block_under_ep_saves_what_the_simulator_holds(tmp_path, ac) -> None:
    """Balanced routing gives each EP rank's experts the rows the whole model's trace gives one rank, so without
    checkpointing the compiled block saves the same bytes under EP 2 as without it (1,843,200 both, fp32), the
    simulator's figure; under torchtitan's op-level policy, which keeps all-to-all outputs, EP adds the dispatch's
    rows (131,072 bytes) and not the combine's."""
    plain, ep = _plan(tmp_path, *ac), _plan(tmp_path, *ac, "--ep", "2")
    assert ep.expert_parallel is not None and ep.expert_parallel.per_param_mesh and ep.compiled
    measured = [_measured(plain), _measured(ep)]
    assert measured == [_predicted(plain), _predicted(ep)]
    assert (measured[1] > measured[0]) == bool(ac)


@pytest.mark.integration  # auto's search of a compiled MoE with its TP and EP screens (~15 s)
def test_auto_screens_ep_under_compile_with_the_experts_in_their_blocks_calls(capsys) -> None:
    """Auto's EP screen runs under ``--compile`` (it screened none before), each option's experts in their blocks'
    calls; ``--ep`` plans so, and ``--ep-placement own`` (hooks of their own inside the compiled graph) is one
    sentence. (Auto's plan with EP under compile trains on gloo ranks: the export's test below.)"""
    assert main(["plan", TINY, "--policy", "titan", "--cluster", "h100:8", "--compile", "--ep", "2", "--json"]) == 0
    ep = json.loads(capsys.readouterr().out)["plans"][0]["plan"]["expert_parallel"]
    assert ep["degree"] == 2 and ep["per_param_mesh"] is True
    assert main(["plan", TINY, "--policy", "auto", "--cluster", "h100:8", "--compile"]) == 0
    assert "1x8, EP 2" in capsys.readouterr().out  # (the layouts line: EP screened)
    assert main(["plan", TINY, "--policy", "titan", "--cluster", "h100:8", "--compile", "--ep", "2",
                 "--ep-placement", "own"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the experts module 'layers.0.moe.experts' sharded in a fully_shard call of its "
                              "own lies inside the block 'layers.0' that --compile compiles whole"), err


def test_experts_in_own_calls_or_groups_inside_compiled_blocks_are_refused() -> None:
    experts = "layers.1.moe.experts"
    own = Plan([Group([experts]), Group(["layers.1"]), Group([""])], "", 0,
               expert_parallel=ExpertParallel(8, (experts,)))
    with pytest.raises(PlannerError, match=r"^the experts module 'layers.1.moe.experts' sharded in a fully_shard "
                                           r"call of its own .*; shard the experts in their blocks' calls "
                                           r"\(--ep-placement blocks, torchtitan's layout\) or plan the blocks eager$"):
        check_compiled_groups(own, ["layers.1"])
    blocks = own.replace(expert_parallel=ExpertParallel(8, (experts,), per_param_mesh=True))
    check_compiled_groups(blocks, ["layers.1"])  # torchtitan's layout: runs
    # a skew is the simulator's limit, not the job's: it runs (the simulator refuses it: the test below)
    check_compiled_groups(blocks.replace(expert_parallel=ExpertParallel(8, (experts,), 1.5, True)), ["layers.1"])
    with pytest.raises(PlannerError, match=r"^group 1 lists 'layers.1', inside the block \(the root\) that"):
        check_compiled_groups(blocks, [""])  # the root compiled whole around its groups' hooks


@pytest.mark.integration  # the tiny Mixtral traced compiled, by three commands (~5 s)
def test_the_plan_s_own_compiled_list_is_checked_by_every_command(tmp_path, capsys) -> None:
    """A plan file compiling blocks whose experts are sharded in calls of their own ran its ranks into Dynamo's
    refusal: verify without --compile compiled the plan's blocks anyway, export wrote the code and check found
    nothing (a new user's trial); the plan's ``compiled`` list is what apply compiles, so each command judges it.
    A skew there is the simulator's limit alone."""
    plan = _plan(tmp_path, "--ep", "2")
    data = plan.to_dict()
    data["expert_parallel"]["per_param_mesh"] = False  # (the plan's groups list the experts alone either way)
    own = tmp_path / "own.json"
    own.write_text(json.dumps(data))
    capsys.readouterr()
    said = "the experts module 'layers.0.moe.experts' sharded in a fully_shard call of its own lies inside the block"
    assert main(["export", str(own), "--format", "python", "--out", str(tmp_path / "own.py")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {said}")
    assert main(["verify", TINY, "--plan", str(own), "--nproc", "2"]) == 2  # (refused before any rank starts)
    assert said in capsys.readouterr().err
    assert main(["check", TINY, "--plan", str(own), "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)
    assert [(f["code"], f["module"]) for f in findings] == [("compiled-group", "layers.0.moe.experts")]
    # a skew: the simulator cannot price it on compiled blocks (their saves are measured for balanced routing), and
    # refuses it; the job it describes runs, so the code is exported
    data = plan.to_dict()
    data["expert_parallel"]["skew"] = 1.5
    skewed = tmp_path / "skewed.json"
    skewed.write_text(json.dumps(data))
    assert main(["simulate", TINY, "--plan", str(skewed), "--compile", "--cluster", "h100:2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: an EP skew with compiled blocks is not modelled")
    assert main(["export", str(skewed), "--format", "python", "--out", str(tmp_path / "skewed.py")]) == 0


@pytest.mark.integration  # a tiny Qwen3-MoE traced compiled, by three commands (~7 s)
def test_transformers_experts_under_compile_are_simulated_with_ep_and_refused_where_they_would_run(
        tmp_path, capsys) -> None:
    """transformers' EP dispatch branches on the routed token counts, which fullgraph compile cannot trace (its
    ranks failed: "Could not guard on data-dependent expression"): the plan simulates it with a note; verify on
    torchrun and the Python export refuse it in one sentence; the fake world runs the blocks eager and checks it."""
    from fsdp_planner.models.hf_experts import COMPILED_EP

    config = tmp_path / "qwen3_moe.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                                  "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                  "vocab_size": 128}))
    job = [f"hf:{config}", "--policy", "titan", "--ep", "2", "--compile", "--batch", "1", "--seq", "64"]
    out = tmp_path / "plan.json"
    assert main(["plan", *job, "--cluster", "h100:2", "--out", str(out)]) == 0
    assert f"note: {COMPILED_EP}" in capsys.readouterr().err
    assert main(["verify", *job, "--nproc", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"error: model.layers.0.mlp.experts (Qwen3MoeExperts): {COMPILED_EP}"
    for fmt in ("python", "torchtitan"):  # (torchtitan's: its parallelize_fn would run transformers' EP compiled)
        assert main(["export", str(out), "--format", fmt]) == 2
        assert capsys.readouterr().err.strip().endswith(COMPILED_EP)


@pytest.mark.integration  # torchrun, 2 gloo ranks compiling the exported plan's blocks (~40 s)
def test_the_exported_compiled_ep_plan_under_op_level_checkpointing_trains_with_parity(tmp_path) -> None:
    """The Python export of a plan compiling op-level checkpointed MoE blocks under EP 2 (EP's local forward swaps
    the experts' params, a side effect dynamo refuses under a checkpoint unless told not to replay it) trains on 2
    gloo ranks as one process does (examples/torchrun_fsdp2.py)."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import launch_env, max_abs_diff

    from fsdp_planner.apply.export import ExportFormat, export_plan

    root = Path(__file__).resolve().parents[1]
    code = tmp_path / "ep_plan.py"
    code.write_text(export_plan(_plan(tmp_path, "--ac", "op", "--ep", "2"), ExportFormat.PYTHON,
                                precision_named("fp32")))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(root / "examples" / "torchrun_fsdp2.py"), str(code), str(root / TINY)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=launch_env(tmp_path, PYTHONPATH=str(root / "src")))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert max_abs_diff(out.stdout) <= 1e-5


def test_a_toml_job_compiling_its_blocks_with_ep_is_refused_in_one_sentence(tmp_path, capsys) -> None:
    """A TOML job's torchtitan sharded the experts in calls of their own and compiled an MoE block's children
    apart around them, a granularity not modelled: refused naming both ways out (a trial's job got the own-calls
    sentence, which named neither the job's keys nor why)."""
    job = tmp_path / "moe_job.toml"
    job.write_text('[model]\nname = "mixtral"\nflavor = "8x7b"\n\n[training]\nlocal_batch_size = 1\nseq_len = 4096\n\n'
                   '[parallelism]\ndata_parallel_shard_degree = -1\nexpert_parallel_degree = 8\n\n'
                   '[compile]\nenable = true\ncomponents = ["model", "loss"]\n')
    assert main(["plan", "mixtral-8x7b", "--from-torchtitan", str(job), "--cluster", "h100"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: this TOML job runs EP (parallelism.expert_parallel_degree = 8) with compile.enable: the torchtitan "
        "of TOML jobs sharded each experts module in a fully_shard call of its own and compiled an MoE block's "
        "other children apart around it, which is not modelled (the planner compiles blocks whole, as torchtitan "
        "has since its config registry); plan it with -- --compile.enable false, or as torchtitan runs it now with "
        "--ep-placement blocks")
