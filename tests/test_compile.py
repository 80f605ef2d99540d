"""torch.compile'd blocks (--compile): what the partitioner saves for backward, measured on meta tensors and checked
against what a block compiled by inductor on the CPU really saves; the simulator holding it; plans recording it;
apply_plan compiling the blocks and real FSDP2 training them."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel

from fsdp_planner.apply import apply_plan
from fsdp_planner.apply.compile import apply_compile
from fsdp_planner.attention import kernel
from fsdp_planner.choices import SacPolicy
from fsdp_planner.cli import main
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.checkpointing import apply_checkpointing
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.models.llama import LLAMA3_8B, TransformerBlock
from fsdp_planner.planners import PolicyRequest, make_policy
from fsdp_planner.runtime.verify import run_verify
from fsdp_planner.service.tracing import trace_spec
from fsdp_planner.sim.compute import fused_nbytes, launches_through
from fsdp_planner.sim.memory import activation_levels
from fsdp_planner.sim.options import SimOptions, precision_named
from fsdp_planner.sim.simulate import simulate
from fsdp_planner.trace.compiled import alike_blocks, compiled_block
from fsdp_planner.trace.events import KERNEL_OTHER, EventKind
from fsdp_planner.trace.recorder import record, record_compiled
from fsdp_planner.trace.records import CompiledBlock

BLOCKS = [f"layers.{i}" for i in range(4)]


def _selective(block: torch.nn.Module, policy: SacPolicy) -> torch.nn.Module:
    copy = __import__("copy").deepcopy(block)
    apply_checkpointing(copy, [], {"": policy})
    return copy


def _real_saved(out: torch.Tensor, module: torch.nn.Module) -> int:
    """Bytes of the activations the compiled node behind ``out`` saved (its saved tensors less the module's
    params, each storage once): what the compiled graph holds for backward."""
    node = out.grad_fn
    while type(node).__name__ != "CompiledFunctionBackward":
        node = node.next_functions[0][0]
    params = {StorageWeakRef(p.untyped_storage()) for p in module.parameters()}
    seen: set[StorageWeakRef] = set()
    nbytes = 0
    for t in node.saved_tensors:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params and ref not in seen:
            seen.add(ref)
            nbytes += t.untyped_storage().nbytes()
    return nbytes


def test_plan_records_its_compiled_modules():
    plan = make_policy(PolicyRequest.named("titan")).plan(trace_spec("toy-llama"), "toy-llama")
    compiled = plan.replace(compiled=BLOCKS)
    assert "compiled" not in plan.to_dict()  # plans without it read and write as before
    back = Plan.from_json(compiled.to_json())
    assert back.compiled == tuple(BLOCKS) and back.signature() == compiled.signature() != plan.signature()
    data = compiled.to_dict() | {"compiled": "layers.0"}
    with pytest.raises(PlannerError, match="'compiled' must be a list of module names"):
        Plan.from_json(__import__("json").dumps(data))


@pytest.mark.integration  # AOTAutograd partitions a llama3-8b block: seconds
def test_auto_never_groups_inside_a_compiled_block(capsys):
    """auto wrote a plan whose group listed layers.0.attention_norm, inside the block --compile compiles whole, and
    its own check refused it (a new user's finding, with --float8 tensorwise on 16 H100s): such a candidate does not
    run, and the compiled model's atoms are whole blocks."""
    from fsdp_planner.cli import main

    assert main(["plan", "llama3-8b", "--policy", "auto", "--compile", "--float8", "tensorwise", "--cluster",
                 "h100:16", "--batch", "2", "--seq", "4096", "--tp", "1", "--micro-batches", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["plans"]
    plan = row["plan"]
    assert all(m.count(".") <= 1 for g in plan["groups"] for m in g), plan["groups"]


def test_compile_needs_repeated_blocks():
    with pytest.raises(PlannerError, match="--compile compiles the model's repeated blocks"):
        trace_spec(ModelSpec("seed-net", compile=True))


@pytest.mark.integration  # seconds of inductor compiling (the fast subset stays near a minute)
def test_compiled_blocks_hold_the_partitioned_bytes_instead_of_their_ops_saves():
    precision = precision_named("fp32")
    eager = trace_spec("toy-llama", precision)
    compiled = trace_spec(ModelSpec("toy-llama", compile=True), precision)
    assert list(compiled.compiled) == BLOCKS and len(set(b.saved for b in compiled.compiled.values())) == 1
    # eager: each block's ops save their own inputs and outputs; compiled, the partitioner recomputes the norms'
    # and SiLU's outputs in backward instead
    boundary = eager.index.boundaries_by_module
    fwd = {m: [i for i in boundary[m] if eager.events[i].kind in (EventKind.FWD_PRE, EventKind.FWD_POST)]
           for m in BLOCKS}
    eager_saved = {m: sum(e.saved for e in eager.events[fwd[m][0]:fwd[m][1]] if e.is_op) for m in BLOCKS}
    assert all(compiled.compiled[m].saved < eager_saved[m] for m in BLOCKS)
    # at the end of the last block's forward every block holds its partitioned bytes, not its ops' saves
    end = fwd[BLOCKS[-1]][1] + 1
    lower = activation_levels(eager, precision)[end] - activation_levels(compiled, precision)[end]
    assert lower == sum(eager_saved.values()) - sum(b.saved for b in compiled.compiled.values())
    # checkpointed blocks are modelled as checkpointed, compiled or not
    both = activation_levels(compiled, precision, [(m, None) for m in BLOCKS])
    assert np.array_equal(both, activation_levels(eager, precision, [(m, None) for m in BLOCKS]))
    # under op-level SAC a compiled block holds what the partitioner saves with the policy applied
    block = compiled.compiled["layers.0"]
    assert set(block.variants) == {p.value for p in SacPolicy} and 0 < block.variants["titan"] < block.saved
    sac = activation_levels(compiled, precision, [(m, SacPolicy.TITAN) for m in BLOCKS])
    assert activation_levels(compiled, precision)[end] - sac[end] == len(BLOCKS) * (
        block.saved - block.variants["titan"])


def test_a_frozen_block_compiles_forward_only_and_saves_nothing():
    # a frozen backbone's block whose input needs no gradient: AOTAutograd makes no backward graph for it
    block = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 8)
    trainable = compiled_block(block, (x,), {})
    block.requires_grad_(False)
    frozen = compiled_block(block, (x,), {})
    assert trainable.saved > 0 and trainable.launches[1] > 0
    assert frozen.saved == 0 and frozen.launches[1] == 0 and frozen.launches[0] == trainable.launches[0]
    # its input needing a gradient (a trainable layer below) makes a backward again, params frozen or not
    assert compiled_block(block, (x.requires_grad_(),), {}).saved > 0


@pytest.mark.integration  # seconds of AOTAutograd partitioning
def test_a_frozen_backbone_plans_and_verifies_compiled():
    spec = ModelSpec("tests/fixtures/factories.py:frozen_backbone", compile=True)
    tr = trace_spec(spec)
    assert [tr.compiled[f"layers.{i}"].saved == 0 for i in range(4)] == [True, True, False, False]
    job = [spec.name, "--policy", "titan", "--compile"]
    assert main(["plan", *job, "--cluster", "h100:8"]) == 0
    assert main(["verify", *job, "--fake-world-size", "4"]) == 0


class _Pointwise(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin() * 2 + 1


def test_a_pointwise_chain_is_one_fused_kernel_reading_and_writing_once():
    x = torch.empty(64, 32, device="meta", requires_grad=True)
    block = compiled_block(_Pointwise(), (x,), {})
    size = 64 * 32 * 4
    # forward: reads x, writes y (x itself is saved: an input, no write); backward: reads the grad and x, writes
    # x's grad; one kernel each
    assert block == CompiledBlock(saved=size, fused_nbytes=(2 * size, 3 * size), launches=(1, 1))


@pytest.mark.integration  # seconds of inductor compiling (the fast subset stays near a minute)
def test_compiled_calls_move_their_fused_bytes_and_run_faster():
    precision = precision_named("bf16-mixed")
    eager = trace_spec("llama3-8b", precision)
    compiled = trace_spec(ModelSpec("llama3-8b", compile=True), precision)
    nbytes, block = fused_nbytes(compiled), compiled.compiled["layers.3"]
    kinds = [EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_PRE, EventKind.BWD_POST]
    at = {compiled.events[i].kind: i for i in compiled.index.boundaries_by_module["layers.3"]}
    other = compiled.index.op_kernel == KERNEL_OTHER
    for (start, end), fused in zip(((at[kinds[0]], at[kinds[1]]), (at[kinds[2]], at[kinds[3]])),
                                   block.fused_nbytes, strict=True):
        assert nbytes[start:end][other[start:end]].sum() == pytest.approx(fused)
        assert fused < eager.index.op_nbytes[start:end][other[start:end]].sum()  # the same events, eager
    cluster = parse_cluster("h100:8")
    options = SimOptions(precision=precision)
    plan = make_policy(PolicyRequest.named("titan")).plan(eager, "llama3-8b")
    assert simulate(compiled, plan, cluster, options).step_time < simulate(eager, plan, cluster, options).step_time
    # the host launches each compiled call's kernels, not one per op
    blocks = len(compiled.compiled)
    ops_in_blocks = sum(int(eager.index.ops_through[at[k1]] - eager.index.ops_through[at[k0]])
                        for k0, k1 in ((kinds[0], kinds[1]), (kinds[2], kinds[3])))
    assert launches_through(compiled)[-1] == pytest.approx(
        eager.index.op_count - blocks * (ops_in_blocks - sum(block.launches)))


@pytest.mark.integration
def test_predicted_saved_bytes_equal_what_the_inductor_compiled_toy_block_saves():
    """The planner's figure (the whole meta model, the block's input from the step) against ``apply_compile``'s
    block compiled by inductor on the CPU. Attention takes the math path on both sides (the CPU's fused kernel is
    not the GPU's that plans assume)."""
    spec = ModelSpec("toy-llama")
    meta = load_model(spec, meta=True)
    with kernel("eager"):
        predicted = record_compiled(meta.model, meta.example_inputs, BLOCKS,
                                    variants={"titan": functools.partial(_selective, policy=SacPolicy.TITAN)})
    real = load_model(spec, meta=False)
    apply_checkpointing(real.model, [], {"layers.1": SacPolicy.TITAN})  # checkpointing first, as apply_plan does
    apply_compile(real.model, ["layers.0", "layers.1"])
    x = real.model.tok_embeddings(*real.example_inputs)
    with sdpa_kernel(SDPBackend.MATH):
        measured = [_real_saved(real.model.layers[i](x), real.model.layers[i]) for i in (0, 1)]
    assert [predicted["layers.0"].saved, predicted["layers.1"].variants["titan"]] == measured
    assert all(measured)


def test_lazy_variants_measure_each_once_raise_a_failure_again_and_pickle_as_a_dict():
    import pickle

    from fsdp_planner.trace.records import LazyVariants

    calls = []

    def measured(n: int) -> int:
        calls.append(n)
        if n < 0:
            raise RuntimeError("dynamo refused it")
        return n

    lazy = LazyVariants({"a": functools.partial(measured, 7), "b": functools.partial(measured, -1)})
    assert list(lazy) == ["a", "b"] and "b" in lazy and calls == []
    assert lazy["a"] == lazy["a"] == 7 and calls == [7]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="dynamo refused it"):
            lazy["b"]
    assert calls == [7, -1]  # (the failure raised again, not measured again: seconds a read)
    assert pickle.loads(pickle.dumps(LazyVariants({"a": functools.partial(measured, 3)}))) == {"a": 3}


def test_a_variant_read_later_is_what_it_measures_when_traced():
    """The selective checkpointing variants past the first are measured when a plan first reads them (a dynamo
    compile of seconds each: torchtitan's Qwen3 8B job planned in 95 s of CPU, 28 s so): read after the trace, out
    of the attention kernel it planned and with the model's params back in float32, one is what it measures as the
    first, in the trace's compute dtype and kernel."""
    lm = load_model(ModelSpec("toy-llama"), meta=True)
    later, first = SacPolicy.TITAN_EARLY.value, SacPolicy.TITAN.value

    def recorded(*policies: str):
        with kernel("eager"):  # (the math path: its saves under SAC differ from the fused kernel's)
            return record_compiled(lm.model, lm.example_inputs, ["layers.1"], torch.bfloat16,
                                   {p: functools.partial(_selective, policy=SacPolicy(p)) for p in policies})

    lazy = recorded(first, later)["layers.1"].variants
    assert repr(lazy) == f"LazyVariants({{'{first}': {lazy[first]}, '{later}': '(not read)'}})"
    assert lazy[later] == recorded(later)["layers.1"].variants[later] > 0  # (measured on the block as it is
    # after the trace, in float32 and on the fused kernel, it would be 100,376 bytes, not 81,920)


@pytest.mark.integration
def test_predicted_saved_bytes_equal_what_an_inductor_compiled_llama3_8b_block_saves():
    """A Llama 3 8B block at its full width (a short sequence, so that it runs on a CPU)."""
    with torch.device("meta"):
        meta = TransformerBlock(LLAMA3_8B)
    shape = (1, 16, LLAMA3_8B.dim)
    with kernel("eager"):
        predicted = compiled_block(meta, (torch.empty(shape, device="meta", requires_grad=True),), {}).saved
    torch.manual_seed(0)
    block = TransformerBlock(LLAMA3_8B)
    apply_compile(block, [""])
    with sdpa_kernel(SDPBackend.MATH):
        measured = _real_saved(block(torch.randn(shape, requires_grad=True)), block)
    assert predicted == measured > 0


@pytest.mark.integration
def test_apply_plan_runs_the_blocks_compiled(tmp_path):
    plan = make_policy(PolicyRequest.named("titan")).plan(trace_spec("toy-llama"), "toy-llama").replace(
        compiled=BLOCKS)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'pg'}")
    try:
        lm = load_model("toy-llama", meta=False)
        apply_plan(lm.model, plan)
        out = lm.model(*lm.example_inputs)
        nodes, stack = set(), [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None and node not in nodes:
                nodes.add(node)
                stack.extend(f for f, _ in node.next_functions)
        assert sum(type(n).__name__ == "CompiledFunctionBackward" for n in nodes) == len(BLOCKS)
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_compiled_blocks_train_like_the_reference_on_real_ranks():
    spec = ModelSpec("toy-llama", compile=True)
    tr = trace_spec(spec)
    plan = make_policy(PolicyRequest.named("titan")).plan(tr, "toy-llama").replace(compiled=tuple(tr.compiled))
    result = run_verify(spec, tr, plan, nproc=2, steps=2)
    assert result.counted_bytes == [result.predicted_bytes] * 2
    # inductor's fused bf16 kernels round apart from eager's by the CPU's vector ISA: 1.04e-4 of the first loss on
    # one 2-core host (under 1e-4 on others); bf16's own step is 7.8e-3
    assert result.losses == pytest.approx(result.reference_losses, rel=5e-4)
    assert result.ok


@pytest.mark.integration  # ~40 s (loaded): a torchrun job of 2 gloo ranks compiling its blocks
def test_verify_with_a_policy_and_compile_compiles_on_the_ranks(capsys):
    """``verify --policy titan --compile`` once trained eager ranks beside a compiled prediction (a PASS for a
    check it never ran): the ranks now compile the blocks the trace compiled."""
    assert main(["verify", "toy-llama", "--policy", "titan", "--compile", "--nproc", "2", "--steps", "2",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiled"] == [f"layers.{i}" for i in range(4)] and report["ok"]


def test_blocks_keeping_their_layer_index_compile_once_when_their_calls_run_alike(tmp_path):
    # transformers' blocks keep a layer index (the KV cache's), so each is its own static signature: AOTAutograd
    # partitioned every one (Qwen3-30B-A3B's 48 MoE blocks ran past 20 minutes). Blocks whose eager calls traced
    # alike compile as one, and give what partitioning each on its own gives
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, '
                      '"num_hidden_layers": 3, "vocab_size": 32}')
    spec = ModelSpec(f"hf:{config}", batch_size=2, seq_len=8)
    names = [f"model.layers.{i}" for i in range(3)]
    tr = trace_spec(spec)
    assert alike_blocks(tr, names) == dict.fromkeys(names, names[0])
    lm = load_model(spec, meta=True)
    variants = {p.value: functools.partial(_selective, policy=p) for p in SacPolicy}
    one_by_one = record_compiled(lm.model, lm.example_inputs, names, None, variants)
    assert record_compiled(lm.model, lm.example_inputs, names, None, variants, alike=alike_blocks(tr, names)) \
        == one_by_one and len(one_by_one) == 3


def test_blocks_whose_calls_run_differently_compile_apart():
    # one class, one static signature but for an attribute that changes what forward runs (every other block
    # squares its hidden state): two compiles, not one; toy-llama's blocks are one
    class Block(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.linear, self.square = nn.Linear(8, 8), i % 2 == 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            return y * y if self.square else y

    model = nn.Sequential(*(Block(i) for i in range(4)))
    tr = record(model, torch.randn(2, 8, requires_grad=True))
    alike = alike_blocks(tr, ["0", "1", "2", "3"])
    assert alike["2"] == "0" and alike["1"] == "1" and alike["3"] != "0"
    toy = trace_spec("toy-llama")
    assert set(alike_blocks(toy, [f"layers.{i}" for i in range(4)]).values()) == {"layers.0"}


def test_full_checkpointing_of_a_compiled_block_recomputes_what_backward_reads() -> None:
    """A fully checkpointed compiled module runs ``torch.utils.checkpoint`` inside its graph, as torchtitan's
    compiled ``checkpoint_wrapper`` does: the backward recomputes the first Linear, whose output the second reads,
    and not the second, whose output only the residual add reads (5 matmuls in backward: 1 recomputed, 4 grads).
    Checkpoint hooks outside the compiled forward ran the whole graph again (6; on an H200 one more GEMM a block)."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(16, 64, bias=False), nn.Linear(64, 16, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.w2(torch.relu(self.w1(x)))

    model = nn.Sequential(Block())
    apply_checkpointing(model, ["0"], compiled=["0"])
    apply_compile(model, ["0"])
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()  # compiles
    y = model(x)
    with torch.profiler.profile() as prof:
        y.sum().backward()
    assert sum(1 for e in prof.events() if e.name in ("aten::mm", "aten::addmm")) == 5


def test_a_compiled_plan_s_out_line_says_to_compile_its_simulation(tmp_path, capsys):
    """The plan file names its compiled blocks, but its step is traced compiled only with --compile: the line that
    writes it says so (it left the option out, and simulate then simulated the blocks eager: a new user's
    finding)."""
    from fsdp_planner.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--compile", "--cluster", "h100:8", "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out.strip().splitlines()[-1].endswith("(simulated with --compile: give simulate and verify the same)")
    # and, once, that the compiled step is the model's optimistic figure
    assert said.err.count("read a compiled step time, its tokens/s and MFU as optimistic") == 1


@pytest.mark.integration  # ~40 s: a 48-block MoE model compiled, auto's full search with its TP layouts
def test_qwen3_moe_compiled_plans_in_seconds_and_auto_takes_a_probe_it_made(capsys):
    """``plan hf:qwen3-30b-a3b --compile --float8 rowwise`` ran past 20 minutes partitioning each of its 48 blocks
    (they differ in ``layer_idx`` alone; now one compile), and then auto's search crashed ("generator raised
    StopIteration"): the fastest plan that fit was the one ``_held_back`` simulates to measure what checkpointing
    every block saves, which no checkpointing choice had tried."""
    assert main(["plan", "hf:qwen3-30b-a3b", "--policy", "auto", "--cluster", "h100:64", "--compile", "--float8",
                 "rowwise", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["auto"]["fits"] and doc["plans"][0]["plan"]["compiled"]


@pytest.mark.integration  # a Dynamo trace of a block
def test_a_graph_break_says_its_cause(tmp_path):
    """A ``print`` in a block's forward was refused with Dynamo's first line cut mid-sentence ("Failed to trace
    builtin operator (+15 more lines..."): the refusal names the operator now (a new user's finding)."""
    path = tmp_path / "printing.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        print('block', x.shape)\n        return x + self.lin(x)\n\n"
        "def build(batch_size: int = 2):\n"
        "    model = nn.Sequential(*(Block() for _ in range(2)))\n"
        "    return model, (torch.randn(batch_size, 8),), lambda out: out.sum()\n")
    with pytest.raises(PlannerError, match=r"^--compile: AOTAutograd could not trace block '0' \(Unsupported: .*: "
                                           r"Dynamo does not know how to trace builtin operator `print`.*\); the "
                                           r"block does not compile") as e:
        trace_spec(ModelSpec(f"{path}:build", compile=True))
    assert str(e.value).count("could not trace") == 1  # (said once: the review found it wrapped in itself)


def test_a_transformers_block_under_selective_checkpointing_compiles_with_the_fused_attention(tmp_path):
    """Dynamo runs no torch function mode, so a transformers block (calling F.scaled_dot_product_attention) compiled
    under op-level SAC took the math path and the policy saved its score matrices, every head's seq x seq:
    hf:llama3-8b --ac op --compile held 156 GiB of activations for 37.6 GiB on the built-in (a new user's finding).
    What the SAC variant saves is now below what the block saves compiled without checkpointing, as on the
    built-in, and independent of the sequence's square."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
                      '"num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 32}')
    spec = ModelSpec(f"hf:{config}", batch_size=1, seq_len=512)
    lm = load_model(spec, meta=True)
    variants = {SacPolicy.TITAN.value: functools.partial(_selective, policy=SacPolicy.TITAN)}
    block = record_compiled(lm.model, lm.example_inputs, ["model.layers.0"], None, variants)["model.layers.0"]
    scores = 4 * 512 * 512 * 4  # one fp32 score matrix a head
    assert block.variants[SacPolicy.TITAN.value] < min(block.saved, scores)


@pytest.mark.integration  # (GPT-2's 12 blocks partitioned, plain and under each selective policy: ~30 s)
def test_a_block_with_dropout_compiles_under_selective_checkpointing():
    """GPT-2 (transformers, dropout 0.1) refused --compile ("AOTAutograd could not trace block ... Backend not
    supported for meta"): checkpointed dropout's RNG state, which the partitioner saves to draw the mask again,
    has no meta backend. The selective copies are traced without the dropout, whose mask is not saved either way."""
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec

    tr = trace_spec(ModelSpec("hf:gpt2", batch_size=1, seq_len=128, compile=True))
    assert tr.compiled and len(tr.compiled) == 12


@pytest.mark.integration  # (4 blocks partitioned, each under the selective policies too: ~15 s)
def test_a_block_taking_an_earlier_block_s_output_by_keyword_compiles():
    """A trial's encoder-decoder (``blk(y, memory=m)``) was refused, blaming its first encoder block ("Trying to
    backward through the graph a second time"): the selective variants' backward ran on through the encoder's
    captured graph behind the keyword's tensor. A block that does not compile is named as itself."""
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec

    spec = f"{Path(__file__).parent / 'fixtures' / 'keyword_encdec.py'}"
    tr = trace_spec(ModelSpec(f"{spec}:build", compile=True))
    assert sorted(tr.compiled) == ["decoder.0", "decoder.1", "encoder.0", "encoder.1"]
    with pytest.raises(PlannerError, match=r"could not trace block 'decoder\.0' \(Unsupported: Call to "
                                           r"`torch\._dynamo\.graph_break\(\)`"):
        trace_spec(ModelSpec(f"{spec}:breaking", compile=True))


class _Widening(nn.Module):
    """Blocks of one class with params of other shapes (a UNet's widths): each needs a graph of its own."""

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x)) + x

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.Block(d) for d in widths)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [block(x) for block, x in zip(self.blocks, xs, strict=True)]


@pytest.mark.integration  # four inductor compiles of a Linear, twice (apply_plan's and the export's)
def test_blocks_of_one_class_and_other_widths_compile_past_dynamo_s_recompile_limit(tmp_path) -> None:
    """Each compiled block of one class with params of another shape takes an entry of dynamo's cache of their shared
    forward: past ``recompile_limit`` under fullgraph=True the step raised FailOnRecompileLimitHit (a trial's UNet of
    10 ResBlocks, in verify and in the exported code). apply_compile and the export make room for them; the limit
    is set low here so four blocks cross it."""
    import importlib.util

    from fsdp_planner.apply.export import ExportFormat, export_plan

    widths = (4, 8, 12, 16)
    names = [f"blocks.{i}" for i in range(len(widths))]
    plan = Plan([Group([""], [], False)], "", 0, model="widening.py:build", compiled=names)
    path = tmp_path / "exported.py"
    path.write_text(export_plan(plan, ExportFormat.PYTHON))
    assert "dynamo.recompile_limit = max(" in path.read_text()
    assert "recompile_limit" not in export_plan(plan.replace(compiled=[]), ExportFormat.PYTHON)
    spec = importlib.util.spec_from_file_location("exported", path)
    exported = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exported)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29573")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'pg'}")
    try:
        for apply in (lambda m: apply_compile(m, names), exported.apply):
            model = _Widening(widths)
            with torch._dynamo.config.patch(recompile_limit=2):
                apply(model)
                model([torch.randn(2, d) for d in widths])
            torch._dynamo.reset()
    finally:
        dist.destroy_process_group()


def test_room_for_recompiles_counts_a_forward_that_is_no_function() -> None:
    """A hook's callable object or a partial as forward (accelerate's add_hook_to_module installs one) has no code
    object: counted as its own, not an AttributeError (a review)."""
    from fsdp_planner.apply.compile import make_room_for_recompiles

    block = _Widening.Block(4)
    block.forward = functools.partial(_Widening.Block.forward, block)  # type: ignore[method-assign]
    with torch._dynamo.config.patch(recompile_limit=1):
        make_room_for_recompiles([block, _Widening.Block(4)])
        assert torch._dynamo.config.recompile_limit == 2


@pytest.mark.integration  # torchrun, 2 gloo ranks compiling toy-llama's blocks under TP 2 (~35 s)
def test_compiled_blocks_under_tp_train_the_embedding_like_the_reference(tmp_path):
    """Under TP with sequence parallelism the embedding's output reaches the first compiled block as a view of a
    pending reduce-scatter (``to_local`` of an AsyncCollectiveTensor); torch 2.13's compiled graph returned no
    gradient to it, so the embedding trained on zeros while the loss matched (verify: 4.5e-4 off after three
    steps, a new user's trial). Each compiled forward is given a copy of such an input (``waited_inputs``), in
    apply and in the exported code alike."""
    from conftest import run_main

    from fsdp_planner.apply.export import ExportFormat, export_plan
    from fsdp_planner.sim.options import PRECISIONS

    out = tmp_path / "plan.json"
    assert main(["plan", "toy-llama", "--policy", "titan", "--tp", "2", "--compile", "--precision", "fp32",
                 "--cluster", "h100:2", "--out", str(out)]) == 0
    assert "waited_inputs(torch.compile(" in export_plan(Plan.load(str(out)), ExportFormat.PYTHON, PRECISIONS["fp32"])
    r = run_main("verify", "toy-llama", "--plan", str(out), "--compile", "--nproc", "2", "--precision", "fp32",
                 "--steps", "2", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["ok"] and result["params_match"] and result["max_abs_diff"] <= 1e-5
