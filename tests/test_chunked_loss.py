"""The output layer and the loss run in chunks of the tokens, as torchtitan's ChunkedLossWrapper runs them
(``--loss-chunks``): the trace's bytes (``trace/chunked_loss.py``), FSDP2's hooks around the chunks
(``fsdp2/replay.py``) and the grads they keep (``sim/memory.py``), against real FSDP2 running the wrapper's loop on
fake ranks (``apply/chunked_loss.py``); and how options, plans, configs and exports carry it."""

from __future__ import annotations

import json

import pytest
from conftest import run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.registry import PolicyName, PolicyRequest
from fsdp_planner.service.planning import policy_plan
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace.chunked_loss import output_layer

# a small Qwen3 whose 151,936-token vocabulary dwarfs its two layers: the loss is the step's peak
SMALL_QWEN = ("hf:qwen3-0.6b", "--hf-config", "num_hidden_layers=2", "--hf-config", "hidden_size=256",
              "--hf-config", "intermediate_size=512", "--hf-config", "num_attention_heads=4",
              "--hf-config", "num_key_value_heads=2", "--batch", "2", "--seq", "512")
UNTIED = ("--hf-config", "tie_word_embeddings=false")


def _verified(*args: str) -> dict:
    """``verify ARGS --json`` on 8 fake ranks: the prediction beside real FSDP2's run."""
    r = run_main("verify", *args, "--cluster", "h100:8", "--fake-world-size", "8", "--json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.integration
@pytest.mark.parametrize("args", [
    # [norm, lm_head] in one group (torchtitan's): the wrapper's reshard after the chunks gathers it again for the
    # norm's backward, and its grads reduce in two reduce-scatters
    ("--policy", "titan", "--loss-chunks", "4", *UNTIED),
    # lm_head alone with explicit prefetch lists: its pre-backward runs in each chunk, whose root final callback
    # drops the prefetches and the post-forward order (the model's backward prefetches nothing by default)
    ("--policy", "auto", "--loss-chunks", "4", *UNTIED),
    # lm_head in the root's group (not an FSDP module): autograd accumulates its grad through the chunks
    ("--policy", "module", "--loss-chunks", "4", *UNTIED),
    ("--policy", "titan", "--loss-chunks", "2", "--precision", "fp32", *UNTIED),
    # tied: the embedding's weight reduce-scattered after the chunks and again after the embedding's backward
    ("--policy", "titan", "--loss-chunks", "8"),
    ("--policy", "titan", "--loss-chunks", "4", "--tp", "2", *UNTIED),
    ("--policy", "titan", "--loss-chunks", "4", "--micro-batches", "2", "--batch", "4", *UNTIED),
    # tied, the layer in the root's group: autograd adds each chunk's grad into the ones before; at 32 chunks the
    # embedding's backward, not the loss, is the peak (a new user's trial: +10% and -8% before)
    ("--policy", "module", "--loss-chunks", "32"),
    ("--policy", "auto", "--loss-chunks", "8"),
])
def test_the_prediction_is_real_fsdp2_running_the_chunks(args):
    """Every FSDP2 and TP collective count and byte exact, the peak within 2%, for each way a plan can hold the
    output layer (measured here: -0.5% to +0.1% on these)."""
    result = _verified(*SMALL_QWEN, *args)
    assert result["counts_and_bytes_exact"], result
    assert abs(result["peak_error"]) < 0.02, result


@pytest.mark.integration
def test_sequence_parallel_hidden_states_are_gathered_once_for_every_chunk():
    """torchtitan's TP layout with sequence parallelism: the hidden states all-gathered once before the chunks and
    their grad reduce-scattered once after (not once a chunk), each chunk's input grad left partial (no all-reduce
    a chunk); loss parallel's temporaries a chunk's. Measured here: -0.4%."""
    whole = _verified("toy-llama", "--policy", "titan", "--tp", "2", "--seq", "128")
    chunked = _verified("toy-llama", "--policy", "titan", "--tp", "2", "--seq", "128", "--loss-chunks", "4")
    assert chunked["counts_and_bytes_exact"], chunked
    assert abs(chunked["peak_error"]) < 0.02, chunked
    tp = {k: chunked["measured"][k] - whole["measured"][k] for k in ("tp_all_gathers", "tp_reduce_scatters")}
    assert tp == {"tp_all_gathers": 0, "tp_reduce_scatters": 0}, tp


@pytest.mark.integration
def test_chunks_hold_less_than_the_whole_loss():
    """The same job with its loss whole and in 4 and 8 chunks: real FSDP2's peak falls with the chunks, and the
    prediction with it."""
    peaks = [_verified(*SMALL_QWEN, "--policy", "titan", *UNTIED, *(["--loss-chunks", str(n)] if n else []))
             for n in (0, 4, 8)]
    measured = [p["measured"]["peak_memory"] for p in peaks]
    assert measured[0] > 1.5 * measured[1] > 1.5 * measured[2] * 0.9
    assert all(abs(p["peak_error"]) < 0.02 for p in peaks)


def _traced(chunks: int, name: str = "toy-llama", **kw: object) -> object:
    return trace_spec(ModelSpec(name, loss_chunks=chunks, **kw))


def test_the_trace_keeps_its_ops_and_takes_a_chunk_s_bytes():
    """In 2 chunks and in 4 the step has the same events, FLOPs and bytes moved (the loss: torchtitan's
    cross-entropy either way); the loss region's live bytes halve from 2 to 4, and the fp32 buffer of the hidden
    states' gradient is a term of its own (whole on each TP rank); the output layer's matmuls run on a chunk's
    tokens."""
    two, four = _traced(2), _traced(4)
    head = output_layer(four)
    assert head is not None and head.module == "output" and four.loss_chunks == 4
    assert len(two.events) == len(four.events)
    assert [e.flops for e in two.events] == [e.flops for e in four.events]
    assert [e.nbytes for e in two.events] == [e.nbytes for e in four.events]
    region = four.index.loss_region
    lives = [(a.live, b.live) for a, b, inside in zip(two.events, four.events, region, strict=True) if inside]
    assert lives and all(abs(a - 2 * b) <= 2 for a, b in lives)
    assert four.loss_buffer == two.loss_buffer == head.hidden_numel * 4 == 128 * 64 * 4  # batch 4 x seq 32, width 64
    tokens = head.hidden_numel // 64  # toy-llama's width
    kernels = [c.kernel for c in four.events[head.forward.start:head.forward.stop] if c.kernel > 0]
    assert kernels and max(kernels) <= tokens // 4


def test_torchtitan_s_grouping_gathers_the_head_again_and_reduces_it_twice():
    """The replay of [norm, output] in one group (torchtitan's): the whole step gathers it once and reduces it
    once; with the loss in chunks it is gathered after the norm's forward (the wrapper left it resharding after
    forward), at the chunks' start and again for the norm's backward, and reduced at the last chunk and after the
    norm's backward (as the fake ranks count: the integration test above)."""
    def head_collectives(chunks: int) -> tuple[int, int]:
        tr = _traced(chunks)
        plan = policy_plan(tr, PolicyRequest(PolicyName.TITAN), "toy-llama", parse_cluster("h100:8"), SimOptions())
        group = next(i for i, g in enumerate(plan.groups) if "output" in g.modules)
        schedule = build_schedule(tr, plan, 8)
        kinds = [c.kind.value for c in schedule.collectives if c.group == group]
        return kinds.count("all_gather"), kinds.count("reduce_scatter")

    assert head_collectives(0) == (1, 1)
    assert head_collectives(4) == (3, 2)


def test_a_chunked_loss_plans_within_less_memory():
    """llama3-8b on 8 H100s at its default sequence: the whole loss's fp32 logits are gigabytes; in 8 chunks the
    same plan's reserved memory is lower, its step within a few percent."""
    cluster = parse_cluster("h100:8")
    reports = []
    for chunks in (0, 8):
        tr = _traced(chunks, "llama3-8b")
        plan = policy_plan(tr, PolicyRequest(PolicyName.TITAN), "llama3-8b", cluster, SimOptions())
        reports.append(simulate(tr, plan, cluster, SimOptions(), timeline=False))
    assert reports[1].reserved_memory < reports[0].reserved_memory - 4 * 2**30
    assert reports[1].step_time == pytest.approx(reports[0].step_time, rel=0.05)


@pytest.mark.parametrize(("args", "says"), [
    (("--loss-chunks", "1"), "--loss-chunks must be from 2 to 1,024, got 1"),
    (("--loss-chunks", "2000"), "--loss-chunks must be from 2 to 1,024, got 2000"),
    (("--loss-chunks", "3"), "runs on 128 tokens, which do not split into that many equal chunks"),
    (("--loss-chunks", "4", "--micro-batches", "2", "--batch", "8", "--gradient-sync", "last"),
     "turns the output layer's gradient sync back on at its last chunk"),
    (("--loss-chunks", "4", "--micro-batches", "2", "--batch", "8", "--no-reshard-after-backward"),
     "sets its output layer's group to reshard after backward when its chunks are done"),
])
def test_a_chunk_count_it_cannot_run_is_one_sentence(args, says):
    r = run_main("plan", "toy-llama", "--cluster", "h100:8", "--policy", "titan", *args)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_model_computing_its_loss_in_its_forward_is_refused_as_such():
    """A Hugging Face classifier given labels computes its cross-entropy after its output layer, inside its forward:
    refused as that (a new user's trial: the sentence said it soft-capped or scaled its logits)."""
    r = run_main("plan", "hf:vit-h14", "--hf-config", "num_hidden_layers=1", "--policy", "titan", "--loss-chunks",
                 "8")
    assert r.returncode == 2, r.stderr
    assert "the model computes its loss in its own forward, after 'classifier'" in r.stderr


def test_a_model_computing_its_logits_in_its_own_forward_is_refused(tmp_path):
    """A tied LM whose root computes ``F.linear(h, self.embed.weight)`` has no output layer the wrapper can leave
    out: every op was scaled as the head's, 15.7 -> 6.2 MiB (a reviewer's finding); refused."""
    path = tmp_path / "rootlm.py"
    path.write_text("import torch, torch.nn as nn, torch.nn.functional as F\n\n"
                    "class LM(nn.Module):\n"
                    "    def __init__(self):\n"
                    "        super().__init__()\n"
                    "        self.embed, self.block = nn.Embedding(512, 32), nn.Linear(32, 32)\n"
                    "    def forward(self, ids):\n"
                    "        return F.linear(self.block(self.embed(ids)), self.embed.weight)\n\n"
                    "def build(batch_size=2, seq_len=16):\n"
                    "    ids = torch.randint(0, 512, (batch_size, seq_len))\n"
                    "    return LM(), (ids,), lambda out: F.cross_entropy(out.flatten(0, 1).float(), ids.flatten())\n")
    r = run_main("plan", f"{path}:build", "--cluster", "h100:8", "--policy", "module", "--module-classes", "Linear",
                 "--loss-chunks", "4")
    assert r.returncode == 2 and "computes its logits in its own forward, not in an output layer" in r.stderr


def test_a_plan_that_reshards_the_head_before_the_chunks_cannot_run(tmp_path):
    """The wrapper runs the output layer after the model's forward: a group holding its params without hooking it
    (here the root's) must keep them gathered, or real FSDP2 reads sharded params (a reviewer's plan: MixedDtypeError
    on fake ranks); refused in one sentence."""
    out = tmp_path / "plan.json"
    assert run_main("plan", "toy-llama", "--cluster", "h100:8", "--policy", "titan", "--loss-chunks", "4", "--out",
                    str(out)).returncode == 0
    data = json.loads(out.read_text())
    data["groups"] = [g for g in data["groups"] if g["modules"] != ["norm", "output"]]
    data["groups"].insert(-1, {"modules": ["norm"], "params": ["norm.weight"], "reshard_after_forward": True})
    data["groups"][-1] = {"modules": [""], "params": ["output.weight"], "reshard_after_forward": True}
    out.write_text(json.dumps(data))
    r = run_main("simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8", "--loss-chunks", "4")
    assert r.returncode == 2, r.stdout
    assert "runs 'output' after the model's forward, when group 6 ((root)) has resharded its params" in r.stderr


def test_a_model_that_transforms_its_logits_is_refused(tmp_path):
    """The wrapper runs the output layer alone on the hidden states: a model that soft-caps or scales its logits
    after it (Gemma 2's final soft-cap) would lose that, so its loss is planned whole."""
    with pytest.raises(PlannerError, match=r"transforms the output of 'lm_head' before returning it \(3 ops"):
        trace_spec(ModelSpec("hf:gemma2-9b", seq_len=64, hf_config=(("num_hidden_layers", 1),
                                                                     ("hidden_size", 64), ("intermediate_size", 128),
                                                                     ("num_attention_heads", 2),
                                                                     ("num_key_value_heads", 1), ("head_dim", 32)),
                             loss_chunks=4))


def test_plans_and_exports_carry_the_chunks(tmp_path):
    """The plan file records the chunks (and refuses a count it cannot run); simulate of it without them says
    so, and its JSON which it simulated; the torchtitan export sets ChunkedLossWrapper's num_chunks, the Python
    export its constant."""
    out = tmp_path / "plan.json"
    r = run_main("plan", "toy-llama", "--cluster", "h100:8", "--policy", "titan", "--loss-chunks", "4",
                 "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["loss_chunks"] == 4
    r = run_main("simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8")
    assert "the plan runs the loss in 4 chunks and this command traced it whole: add --loss-chunks 4" in r.stderr
    r = run_main("check", "toy-llama", "--plan", str(out))  # (check says it too: a new user's trial)
    assert "the plan runs the loss in 4 chunks and this command traced it whole" in r.stderr
    runs = [json.loads(run_main("simulate", "toy-llama", "--plan", str(out), "--cluster", "h100:8", "--json",
                                *flags).stdout)["loss_chunks"] for flags in ((), ("--loss-chunks", "4"))]
    assert runs == [0, 4]
    data = json.loads(out.read_text())
    data["loss_chunks"] = 3  # (not advised where the workload's tokens do not split: --loss-chunks 3 is refused)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(data))
    r = run_main("simulate", "toy-llama", "--plan", str(odd), "--cluster", "h100:8")
    assert "traced it whole: this workload's 128 tokens do not split into that many" in r.stderr, r.stderr
    data["loss_chunks"] = 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlannerError, match="plan 'loss_chunks' must be a whole number from 2 to 1,024"):
        Plan.load(str(bad))
    python = tmp_path / "plan_fsdp.py"
    assert run_main("export", str(out), "--format", "python", "--out", str(python)).returncode == 0
    assert "LOSS_CHUNKS: int = 4" in python.read_text()
    plan = tmp_path / "l8.json"
    assert run_main("plan", "llama3-8b", "--cluster", "h100:8", "--policy", "titan", "--loss-chunks", "8",
                    "--out", str(plan)).returncode == 0
    job = tmp_path / "job.py"
    assert run_main("export", str(plan), "--format", "torchtitan", "--out", str(job)).returncode == 0
    assert "config.loss = ChunkedLossWrapper.Config(num_chunks=8)" in job.read_text()


@pytest.mark.integration
def test_a_torchrun_job_of_a_chunked_plan_says_it_trains_the_whole_loss(tmp_path):
    """verify --nproc trains the model's own loss (parity with one process): a plan file's chunks are said once,
    with the command that checks them, and not claimed in its banner (a new user's trial: "loss in 4 chunks", and
    advice to add --loss-chunks, which --nproc refuses)."""
    out = tmp_path / "plan.json"
    assert run_main("plan", "toy-llama", "--cluster", "h100:8", "--policy", "titan", "--loss-chunks", "4",
                    "--out", str(out)).returncode == 0
    r = run_main("verify", "toy-llama", "--plan", str(out), "--nproc", "2", "--steps", "2")
    assert r.returncode == 0, r.stderr
    assert "the torchrun job trains the model's own loss over the whole sequence" in r.stderr
    assert "add --loss-chunks" not in r.stderr and "loss in 4 chunks" not in r.stdout


@pytest.mark.parametrize("fmt", ["python", "lightning"])
def test_the_export_s_chunked_step_trains_as_the_whole_loss(tmp_path, fmt):
    """A plan with chunks exports the step that runs them (fsdp-planner's own ``chunked_loss_step``, written into
    the file with the output layer's name): imported alone, on the real toy-llama, its loss and every grad are the
    whole cross-entropy's, ignored labels left out (a new user had only a LOSS_CHUNKS constant to go by)."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    from fsdp_planner.models import load_model

    out = tmp_path / "plan.json"
    assert run_main("plan", "toy-llama", "--cluster", "h100:8", "--policy", "titan", "--loss-chunks", "4",
                    "--out", str(out)).returncode == 0
    code = tmp_path / f"exported_{fmt}.py"
    assert run_main("export", str(out), "--format", fmt, "--out", str(code)).returncode == 0
    found = importlib.util.spec_from_file_location(code.stem, code)
    exported = importlib.util.module_from_spec(found)
    found.loader.exec_module(exported)
    assert (exported.OUTPUT_LAYER, exported.LOSS_CHUNKS) == ("output", 4)
    chunked, whole = (load_model("toy-llama", meta=False, seed=0) for _ in range(2))
    ids = chunked.example_inputs[0]
    labels = torch.randint(0, 256, ids.shape, generator=torch.Generator().manual_seed(1))
    labels[:, :5] = -100  # (ignored: the loss is the mean over the others, as F.cross_entropy's)
    loss = exported.chunked_loss_step(chunked.model, "output", 4, (ids,), {}, labels)
    # Lightning's automatic optimization zeroes the grads between training_step and its backward
    # (lightning/pytorch/loops/optimization/automatic.py, Closure.closure): the output layer's grads, made by the
    # chunks inside the step, were dropped there (a new user's Lightning run trained every layer but it)
    chunked.model.zero_grad(set_to_none=True)
    loss.backward()  # (the model's backward, from the chunks' gradient: as a framework calls it)
    logits = whole.model(ids)
    reference = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    reference.backward()
    assert torch.allclose(loss, reference.detach(), rtol=1e-5)
    for (name, p), q in zip(chunked.model.named_parameters(), whole.model.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_a_factory_model_s_export_names_the_output_layer_its_plan_recorded(tmp_path):
    """export does not run a plan's Python factory, so the plan file records the output layer (``loss_head``) for
    the export's OUTPUT_LAYER (a new user's trial: '' and a ValueError when the step ran)."""
    out = tmp_path / "plan.json"
    assert run_main("plan", "docs/examples/my_model.py:build", "--cluster", "h100:8", "--policy", "auto",
                    "--loss-chunks", "2", "--out", str(out)).returncode == 0
    assert json.loads(out.read_text())["loss_head"] == "head"
    code = tmp_path / "exported.py"
    assert run_main("export", str(out), "--format", "python", "--out", str(code)).returncode == 0
    assert "OUTPUT_LAYER: str = 'head'" in code.read_text()
    # a plan naming another module was read past, the traced one exported (a trial's hostile plan file)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(out.read_text()), "loss_head": "blocks.0"}))
    r = run_main("simulate", "docs/examples/my_model.py:build", "--plan", str(other), "--cluster", "h100:8",
                 "--loss-chunks", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: plan 'loss_head' names \"blocks.0\", and the model's output layer is head: give the output layer "
        "whose logits the loss reads, or drop the key")


def test_the_tp_export_runs_the_chunks_as_the_fake_ranks_do(tmp_path):
    """A TP plan with chunks, exported: its apply() and chunked_loss_step (loss_parallel=LOSS_PARALLEL: a new
    user's trial ran it without loss_parallel(), which DTensor refused) issue the same TP collectives as apply_plan
    and the package's step on fake ranks, the hidden states gathered once (the exported head took a sequence
    shard: every chunk's input grad all-reduced, a reviewer's finding)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_planner.apply.chunked_loss import chunked_loss_step
    from fsdp_planner.apply.export import ExportFormat, export_plan
    from fsdp_planner.apply.fully_shard import apply_plan
    from fsdp_planner.models import load_model
    from fsdp_planner.runtime.fake_world import FunctionalCounter, fake_process_group

    out = tmp_path / "plan.json"
    assert run_main("plan", "toy-llama", "--cluster", "h100:4", "--policy", "titan", "--tp", "2", "--loss-chunks",
                    "4", "--out", str(out)).returncode == 0
    plan = Plan.load(str(out))
    scope: dict = {"__name__": "exported"}
    source = export_plan(plan, ExportFormat.PYTHON, loss_head=plan.loss_head)
    assert "labels, loss_parallel=LOSS_PARALLEL)" in source and plan.loss_head == "output"
    exec(compile(source, "exported.py", "exec"), scope)
    bf16_mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # the export's
    seen = []
    with fake_process_group(4):
        for shard, step in ((lambda m: scope["apply"](m, scope["make_mesh"]("cpu")), scope["chunked_loss_step"]),
                            (lambda m: apply_plan(m, plan, mp_policy=bf16_mixed), chunked_loss_step)):
            lm = load_model("toy-llama", meta=False)
            model = shard(lm.model)
            counter = FunctionalCounter()
            with counter.counting():
                step(model, "output", 4, lm.example_inputs, {}, loss_parallel=True).backward()
            seen.append(counter.take())
    assert seen[0] == seen[1] and seen[0][0]["all_gather"] > 0, seen


def test_the_python_api_plans_a_module_s_loss_in_chunks():
    """``fsdp_planner.plan(model, inputs, loss_fn, loss_chunks=N)``: a training script's own model, traced as its
    meta twin, with its output layer and loss in chunks; the plan records them; a bool is refused, 0 is whole."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from fsdp_planner.api import plan

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.block, self.head = nn.Embedding(4096, 64), nn.Linear(64, 64), nn.Linear(64, 4096)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.embed(ids)))

    ids = torch.randint(0, 4096, (2, 128))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    got = plan(LM(), (ids,), loss_fn, cluster="h100:8", policy="module", module_classes=("Linear",), loss_chunks=4)
    assert got.loss_chunks == 4
    with pytest.raises(PlannerError, match="loss_chunks must be a whole number, got True"):
        plan("toy-llama", cluster="h100:8", loss_chunks=True)
    assert plan("toy-llama", cluster="h100:8", policy="titan", loss_chunks=0).loss_chunks == 0  # (a plan file's 0)


@pytest.mark.integration
def test_fit_searches_the_workloads_whose_tokens_split_into_the_chunks():
    """``fit --loss-chunks 64`` on toy-llama (seq 32): batch 1's 32 tokens do not split into 64 chunks, which
    stopped the whole search (a new user's trial); the search steps by the batches that split (even ones)."""
    r = run_main("fit", "toy-llama", "--cluster", "h100:8", "--loss-chunks", "64", "--find", "batch", "--json")
    assert r.returncode == 0, r.stderr
    batch = json.loads(r.stdout)["batch"]
    assert batch["largest_without_offload"] % 2 == 0 and batch["largest"] % 2 == 0
    # the sequence search starts at the first sequence after the default whose tokens split (batch 3: 96 tokens
    # do not split into 128; a new user's trial: refused)
    r = run_main("fit", "toy-llama", "--cluster", "h100:8", "--loss-chunks", "128", "--batch", "3", "--find", "seq",
                 "--json")
    assert r.returncode == 0, r.stderr
    seq = json.loads(r.stdout)["seq"]
    assert seq["longest_without_offload"] % 128 == 0 and seq["longest"] * 3 % 128 == 0, seq
