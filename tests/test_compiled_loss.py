"""The loss torch.compile'd apart from the model (``--compile-loss``, torchtitan's ``compile.components`` "loss"):
what it holds against what inductor allocates, how the step takes it, and how plans, configs and exports carry it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fsdp_planner.apply.export import ExportFormat, export_plan
from fsdp_planner.configs.job_config import TORCHTITAN, read_config
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Group, Plan, Workload
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.registry import PolicyName, PolicyRequest
from fsdp_planner.service.planning import policy_plan
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace.compiled_loss import LossInputs, compiled_loss

N, V, D = 2048, 16000, 64  # tokens, vocabulary, width: the logits 64 MiB in bf16


def _losses(labels: torch.Tensor, weight: torch.Tensor) -> dict:
    """Losses as training scripts write them: torchtitan's cross-entropy on fp32 logits, with a z-loss, with label
    smoothing, a regression loss, and one that runs the output layer itself (a library matmul inside)."""
    def ce(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x.flatten(0, 1).float(), labels.flatten(0, 1))

    return {"ce": ce,
            "ce_zloss": lambda x: ce(x) + 1e-4 * torch.logsumexp(x.float(), -1).pow(2).mean(),
            # a per-token log-probability (RL jobs'): the gather's backward scatters into a zeros buffer
            "logprob": lambda x: -F.log_softmax(x.float(), -1).gather(-1, labels[..., None]).mean(),
            "ce_topk": lambda x: ce(x) + x.float().topk(5, -1).values.mean(),
            "smoothing": lambda x: F.cross_entropy(x.flatten(0, 1).float(), labels.flatten(0, 1), label_smoothing=0.1),
            "mse": lambda x: (x.float() - 1).pow(2).mean(),
            "head_ce": lambda h: ce(F.linear(h, weight))}


MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def _measured(loss_fn, x: torch.Tensor) -> int:
    """Most bytes inductor's compiled loss holds above what existed before it (forward and backward), from the
    profiler's memory events on this CPU build: x, the labels and the weight are the caller's. What a matmul
    allocates and frees inside its own call is the CPU library's scratch, not counted: oneDNN's AMX bf16 kernels
    pack their operands there (2 MiB in head_ce's backward on a Sapphire Rapids CPU, none on an AVX2 one), which
    a GPU's cuBLAS does not allocate from the caching allocator. Live bytes are read between such calls and at
    each one's end, where its output stays and its scratch is gone."""
    compiled = torch.compile(loss_fn)
    compiled(x).backward()  # (compiled and warmed up outside the profile)
    x.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        compiled(x).backward()
    events = prof.profiler.kineto_results.events()
    calls = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() in MATMULS]
    # (a call's end sorts after an allocation at the same instant: its output is in what is read there)
    points = sorted([(e.start_ns(), 0, e.nbytes()) for e in events if e.name() == "[memory]"] +
                    [(end, 1, 0) for _, end in calls])
    live = peak = 0
    for at, is_end, nbytes in points:
        live += nbytes
        if is_end or not any(start <= at < end for start, end in calls):
            peak = max(peak, live)
    return peak


@pytest.mark.integration
@pytest.mark.parametrize(("name", "tolerance"), [("ce", 0.01), ("ce_zloss", 0.01), ("smoothing", 0.01), ("mse", 0.01),
                                                 ("logprob", 0.01), ("ce_topk", 0.01), ("head_ce", 0.01)])
def test_a_compiled_loss_holds_what_inductor_allocates(name, tolerance):
    """The model (the partitioner's graphs, fused regions alive only at their edges, inductor's in-place reuse)
    against inductor's real kernels on this CPU: each loss's peak above its caller's tensors is 1.0x the bf16
    logits compiled (eager: 6.0x, three fp32 copies). head_ce's width is small (64): at 256 the CPU's bf16 matmul
    allocated 8% of the logits for itself, which a GPU's does not (the model has 1.6% above)."""
    torch.manual_seed(0)
    # the output weight stored (D, V), seen as (V, D): an AVX2 CPU's bf16 matmuls of the loss's backward take
    # ~4x longer with the (V, D) layout, and the memory is the same
    labels, weight = torch.randint(0, V, (1, N)), torch.randn(D, V, dtype=torch.bfloat16).t()
    x = torch.randn(1, N, D if name == "head_ce" else V, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    measured = _measured(_losses(labels, weight)[name], x)
    # planned as the step plans it: on meta, the labels and the weight on meta too
    loss = compiled_loss(_losses(labels.to("meta"), weight.to("meta"))[name], LossInputs.of(x.to("meta")))
    # the caller holds x throughout (the model's outputs are the loss's to free in a step)
    predicted = max(loss.forward_peak - loss.inputs, loss.backward_peak - loss.kept_inputs)
    # the bf16 logits once; a scatter's zeros buffer (fp32) beside the bf16 gradient: three times
    assert measured == pytest.approx(N * V * 2 * (3 if name in ("logprob", "ce_topk") else 1), rel=0.09)
    assert predicted == pytest.approx(measured, rel=tolerance)


def test_a_cross_entropy_traced_on_meta_has_its_backward():
    """aten.nll_loss's Python meta kernel ran below autograd under AOTAutograd on meta tensors: the compiled
    cross-entropy had no backward graph at all (nothing saved, no gradient counted)."""
    labels = torch.zeros(1, 64, dtype=torch.long, device="meta")
    x = torch.empty(1, 64, 1000, dtype=torch.bfloat16, device="meta", requires_grad=True)
    loss = compiled_loss(_losses(labels, labels)["ce"], LossInputs.of(x))
    assert loss.grads == x.numel() * 2 and loss.kept_inputs == x.numel() * 2  # bf16 gradient; the logits kept
    assert loss.backward_peak >= loss.kept_inputs + loss.grads  # read and written by one kernel: together
    assert torch.ops.aten.nll_loss.default.py_kernels  # (its meta kernel back in place)


def test_the_step_with_a_compiled_loss_holds_what_the_loss_does():
    """The loss region's live bytes are the compiled loss's: its forward's peak at the first op, what it keeps
    after; its backward's peak at the first backward op, the gradients after. torchtitan's debug Llama (vocab
    2,048) at batch 8 x 2,048: the eager loss holds three fp32 copies of the logits, the compiled one none."""
    eager = trace_spec("llama3-debugmodel")
    compiled = trace_spec(ModelSpec("llama3-debugmodel", compile_loss=True))
    loss = compiled.compiled_loss
    assert eager.compiled_loss is None and loss is not None
    logits = 8 * 2048 * 2048 * 2  # (in bf16: the default precision traces in its compute dtype)
    assert loss.inputs == logits and loss.grads == logits
    region = compiled.index.loss_region
    forward = [e.live for e, inside in zip(compiled.events, region, strict=True) if inside and not e.backward]
    backward = [e.live for e, inside in zip(compiled.events, region, strict=True) if inside and e.backward]
    assert forward[0] == loss.forward_peak and set(forward[1:]) <= {loss.kept_inputs + loss.saved}
    assert backward[0] == loss.backward_peak and set(backward[1:]) <= {loss.grads}
    eager_peak = max(e.live for e, inside in zip(eager.events, eager.index.loss_region, strict=True) if inside)
    assert eager_peak >= 3 * logits and max(forward + backward) <= 2 * logits + logits // 64
    cluster = parse_cluster("h100:8")
    peaks = []
    for tr in (eager, compiled):
        plan = policy_plan(tr, PolicyRequest(PolicyName.TITAN), "llama3-debugmodel", cluster)
        peaks.append(simulate(tr, plan, cluster, SimOptions()).peak_memory)
    assert peaks[1] < peaks[0]


def test_a_plan_records_its_compiled_loss_and_reads_it_back():
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                compiled_loss=True)
    assert '"compiled_loss": true' in plan.to_json() and Plan.from_json(plan.to_json()).compiled_loss
    assert "compiled_loss" not in plan.replace(compiled_loss=False).to_json()  # (plans before it read as before)
    with pytest.raises(PlannerError, match=r"^plan 'compiled_loss' must be true .* or false, got \"yes\"$"):
        Plan.from_json(plan.to_json().replace('"compiled_loss": true', '"compiled_loss": "yes"'))


@pytest.mark.parametrize(("compiled", "compiled_loss", "read"), [
    ((), True, (False, True)), (("layers.0",), True, (True, True)), (("layers.0",), False, (True, False)),
    ((), False, (False, False))])
def test_a_torchtitan_export_compiles_what_the_plan_does(tmp_path, compiled, compiled_loss, read):
    """CompileConfig's default components compile the loss too: an export of a plan with compiled blocks and an
    eager loss compiled both (its memory below the plan's, unsaid). The export names its components, and reads
    back as the plan."""
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                workload=Workload(1, 8192), compiled=compiled, compiled_loss=compiled_loss)
    path = tmp_path / "titan_plan.py"
    path.write_text(export_plan(plan, ExportFormat.TORCHTITAN))
    cfg = read_config(TORCHTITAN, f"{path}:fsdp_planner_job")
    assert (cfg.compile, cfg.compile_loss) == read


def test_plan_says_what_compiling_the_loss_frees():
    """`plan --explain` (and a --compile-loss job) compares the loss compiled and eager under auto's plan: on the
    debug Llama the loss is the peak (64 MiB of bf16 logits, three fp32 copies eager), so compiling it is said to
    free most of it where the plan is short of memory (a budget just above its peak); with an H100's budget, and
    neither checkpointing nor offloading to drop, the memory buys nothing and the fix says to keep the loss eager
    (a trial's --explain recommended it at 0.0% faster, 62 MiB of 70.8 GiB); the reverse answer names the eager
    loss's cost."""
    from fsdp_planner.planners.answers import compile_loss_answer, loss_chunks_answer
    from fsdp_planner.sim.budget import MemoryBudget

    cluster = parse_cluster("h100:8")
    eager = trace_spec("llama3-debugmodel")
    compiled = trace_spec(ModelSpec("llama3-debugmodel", compile_loss=True))
    plan = policy_plan(eager, PolicyRequest(PolicyName.TITAN), "llama3-debugmodel", cluster)
    budget = MemoryBudget.of_gpu(cluster.gpu.memory_bytes, cluster.gpu.name)
    base = simulate(eager, plan, cluster, SimOptions(), timeline=False)
    found = compile_loss_answer(compiled, plan, cluster, SimOptions(), base, budget)
    assert found is not None and found.message.startswith("torch.compile of the loss (--compile-loss)")
    assert found.fix.startswith("keep the loss eager: the ") and "buys nothing here" in found.fix
    short = MemoryBudget.explicit(int(base.reserved_memory * 1.2), cluster.gpu.memory_bytes, cluster.gpu.name)
    found = compile_loss_answer(compiled, plan, cluster, SimOptions(), base, short)
    assert found is not None and "plan with --compile-loss" in found.fix and "freed for auto to spend" in found.fix
    chunked = trace_spec(ModelSpec("llama3-debugmodel", loss_chunks=8))  # chunks buy memory alike
    roomy, tight = (loss_chunks_answer(chunked, plan, cluster, SimOptions(), base, b) for b in (budget, short))
    assert roomy is not None and roomy.fix.startswith("keep the loss whole: the ")
    assert tight is not None and "plan with --loss-chunks 8" in tight.fix
    back = compile_loss_answer(eager, plan, cluster, SimOptions(),
                               simulate(compiled, plan, cluster, SimOptions(), timeline=False), budget)
    assert back is not None and back.message.startswith("the same plan with the loss eager")


def _factory(tmp_path, body: str) -> str:
    path = tmp_path / "loss_model.py"
    path.write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n\n" + body)
    return f"{path}:build"


def test_a_model_that_computes_its_loss_in_forward_is_left_as_it_runs(tmp_path):
    """A forward that returns its loss (transformers' seq2seq and image models given labels) leaves nothing for a
    compiled loss to hold: a note, the trace as it was (it was an error: "no gradient for the model's outputs")."""
    spec = _factory(tmp_path, """class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x).float().pow(2).mean()


def build(batch_size=4):
    return M(), (torch.randn(batch_size, 64),), lambda out: out
""")
    notes: list[str] = []
    tr = trace_spec(ModelSpec(spec, compile_loss=True), note=notes.append)
    assert tr.compiled_loss is None and any("computes its loss in its forward" in n for n in notes)
    assert tr.events == trace_spec(spec).events


def test_a_loss_that_reads_a_param_reads_it_in_the_compute_dtype(tmp_path):
    """A loss running the output layer itself (a tied head's weight) reads the param as the step does, in bf16; the
    gradients it returns to the model are its inputs' (the param's is FSDP2's to count): it counted the weight's
    fp32 gradient too."""
    spec = _factory(tmp_path, """class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4096, bias=False)

    def forward(self, x):
        return self.body(x)


def build(batch_size=8):
    model = M()
    labels = torch.zeros(batch_size, dtype=torch.long)
    return model, (torch.randn(batch_size, 64),), lambda h: F.cross_entropy(model.head(h).float(), labels)
""")
    loss = trace_spec(ModelSpec(spec, compile_loss=True)).compiled_loss
    assert loss is not None and loss.inputs == 8 * 64 * 2 and loss.grads == loss.inputs  # bf16 h, its gradient


def test_a_torchtitan_export_s_flags_give_the_components_as_tyro_takes_a_list():
    """TORCHTITAN_FLAGS wrote the list as one value, "['loss']", which tyro reads as one component of that name."""
    from fsdp_planner.apply.torchtitan_job import flags, job_settings
    from fsdp_planner.sim.options import PRECISIONS

    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                workload=Workload(1, 8192), compiled=("layers.0",), compiled_loss=True)
    settings = job_settings(plan, PRECISIONS["bf16-mixed"])
    assert ("--compile.components", "model", "loss") in flags(settings)


def test_a_loss_that_does_not_compile_whole_is_simulated_eager_with_a_note(tmp_path):
    """A loss reading a value back to the host (``.item()``) breaks torch.compile's graph: it ran in pieces, and the
    command refused it; now it is simulated eager (at least what the pieces hold), said in a note."""
    spec = _factory(tmp_path, """class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(x)


def build(batch_size=4):
    def loss(out):
        value = out.float().pow(2).mean()
        return value * 2 if value.item() > 100 else value

    return M(), (torch.randn(batch_size, 64),), loss
""")
    notes: list[str] = []
    tr = trace_spec(ModelSpec(spec, compile_loss=True), note=notes.append)
    assert tr.compiled_loss is None and any("does not compile as one graph" in n for n in notes), notes


def test_a_python_export_says_the_plan_compiles_its_loss():
    """The export applies the plan to the model; the loss is the user's: the file says the plan's memory is of the
    loss compiled (it was said on the terminal only: a trial's finding)."""
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                compiled_loss=True)
    source = export_plan(plan, ExportFormat.PYTHON)
    assert "COMPILED_LOSS: bool = True" in source and "torch.compile(loss_fn)" in source
    assert "COMPILED_LOSS: bool = False" in export_plan(plan.replace(compiled_loss=False), ExportFormat.PYTHON)
