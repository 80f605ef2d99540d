"""Data-dependent ops in a planned step (routing.py): a user's torch.where router and a vision-language model's
placeholder check trace with the balanced stand-in, say so, and a refused op names the way out."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_main

from fsdp_planner.cli import main
from fsdp_planner.trace import record

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import routing_models as rm

FIXTURE = Path(__file__).parent / "fixtures" / "routing_models.py"


def _expert_rows(tr) -> int:  # type: ignore[no-untyped-def]
    """Rows the experts' first projections ran on: their forward FLOPs over 2 x in x out."""
    first = rm.DIM * 4 * rm.DIM
    return sum(e.flops for e in tr.events if not e.backward) // (2 * first)


@pytest.mark.parametrize("on_meta", [True, pytest.param(False, marks=pytest.mark.integration)])  # fake: seconds
def test_a_where_router_traces_with_an_equal_share_per_expert(on_meta: bool):
    if on_meta:
        with torch.device("meta"):
            model, inputs = rm.where_moe()
    else:
        model, inputs = rm.where_moe()
    tr = record(model, inputs)
    assert len(tr.notes) == 1 and "aten.nonzero" in tr.notes[0] and "'layers.1'" in tr.notes[0]
    assert all(p.gets_grad for p in tr.params)  # every expert ran
    tokens = 2 * 64
    # each layer: 2 x tokens x top_k rows through the experts' two projections (4 x DIM wide), plus gate and head
    assert _expert_rows(tr) >= 2 * tokens * rm.TOP_K


def test_the_capacity_factor_scales_each_expert_s_rows():
    with torch.device("meta"):
        model, inputs = rm.where_moe()
    base, wide = record(model, inputs), record(model, inputs, routing=1.5)
    assert "capacity factor 1.5" in wide.notes[0]
    assert _expert_rows(wide) > _expert_rows(base)


def test_a_placeholder_check_passes_and_is_noted():
    with torch.device("meta"):
        model, inputs = rm.placeholders()
    tr = record(model, inputs)
    assert "aten._local_scalar_dense" in tr.notes[0] and "stand-in values (a mask's every element true)" in tr.notes[0]


@pytest.mark.integration  # whole commands or two model builds: kept out of the fast subset
def test_plan_prints_the_note_and_a_refused_op_names_the_way_out(tmp_path, capsys):
    assert main(["plan", f"{FIXTURE}:where_moe", "--policy", "module", "--module-classes", "WhereMoE",
                 "--routing", "1.25"]) == 0
    err = capsys.readouterr().err
    assert "balanced-routing stand-in" in err and "changes nothing" not in err
    factory = tmp_path / "bincount.py"
    factory.write_text("import torch\n"
                       "class M(torch.nn.Module):\n"
                       "    def __init__(self):\n"
                       "        super().__init__(); self.w = torch.nn.Linear(4, 4)\n"
                       "    def forward(self, x):\n"
                       "        counts = torch.unique(x.argmax(-1))\n"
                       "        return self.w(x) * counts.numel()\n"
                       "def make():\n"
                       "    return M(), (torch.randn(8, 4),)\n")
    assert main(["plan", f"{factory}:make", "--policy", "module"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fixed capacity" in err[0], err
    # repeat_interleave by a tensor of counts (a router's per-expert rows): the same way out
    factory.write_text(factory.read_text().replace("counts = torch.unique(x.argmax(-1))",
                                                   "counts = torch.repeat_interleave(x, x.argmax(-1), dim=0)"))
    assert main(["plan", f"{factory}:make", "--policy", "module"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fixed capacity" in err[0], err


def test_a_loop_on_a_tensor_s_value_stops_with_one_line(monkeypatch):
    """``while x.abs().max() < 100`` on meta tensors: the stand-in answers the condition alike every time, so the
    trace looped forever at 100% CPU (a new user's model); it stops at ``MAX_ANSWERS`` reads of one op in one
    module (lowered here: 10,000 take half a minute) with one line that says why."""
    import fsdp_planner.routing as routing

    monkeypatch.setattr(routing, "MAX_ANSWERS", 50)
    done = run_main("plan", f"{FIXTURE}:normalising", "--policy", "order")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "read a meta tensor's value 50 times in one step" in done.stderr and "while x.max() < 100" in done.stderr


def test_routing_out_of_range_is_one_line(capsys):
    assert main(["plan", "toy-llama", "--policy", "module", "--routing", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--routing" in err[0], err


@pytest.mark.integration  # building transformers' LLaVA and CLIP modules: seconds
def test_a_transformers_llava_traces_past_its_placeholder_check():
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model, inputs = rm.llava()
    tr = record(model, inputs)
    assert "aten._local_scalar_dense" in tr.notes[0] and tr.numel == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("on_meta", [True, pytest.param(False, marks=pytest.mark.integration)])  # fake: seconds
def test_a_sorted_router_reads_balanced_counts(on_meta: bool):
    """``.tolist()`` of per-expert counts: each expert's balanced row count, so the split covers every token."""
    if on_meta:
        with torch.device("meta"):
            model, inputs = rm.sorted_moe()
    else:
        model, inputs = rm.sorted_moe()
    tr = record(model, inputs)
    assert "(.tolist()" in tr.notes[0] or "_local_scalar_dense" in tr.notes[0]
    assert _expert_rows(tr) >= 2 * 2 * 64 * rm.TOP_K


class _SwitchMoE(torch.nn.Module):
    """A top-1 router written with argmax (Switch Transformer's), each expert's tokens picked by torch.where."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = torch.where(top == i)[0]
            out = out.index_add(0, idx, expert(x[idx]))
        return out


def test_an_argmax_router_gives_each_expert_its_share():
    """Each expert of a top-1 argmax router gets tokens / experts rows, not every token (4x the expert FLOPs)."""
    with torch.device("meta"):
        model, x = _SwitchMoE(), torch.randn(64, 16)
    tr = record(model, (x,))
    expert_flops = sum(e.flops for e in tr.events if not e.backward and e.module.startswith("experts."))
    assert expert_flops == 2 * 64 * 16 * 16  # 64 tokens through one 16 x 16 expert each, shared out


class _MaxSwitchMoE(_SwitchMoE):
    """The same top-1 router written with ``max`` over the experts (values and indices: a trial's router); with
    ``keepdim`` a hand-written softmax's max instead, before a mask of the rows the stand-in must take whole."""

    def __init__(self, keepdim: bool = False) -> None:
        super().__init__()
        self.keepdim = keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x)
        if self.keepdim:  # (a softmax by hand, then rows picked by a mask that routes nothing)
            p = (scores - scores.max(-1, keepdim=True).values).exp()
            rows = torch.where(p.sum(-1) > 0)[0]
            return self.experts[0](x[rows]) * p[rows, :1]
        weight, top = scores.softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = torch.where(top == i)[0]
            out = out.index_add(0, idx, expert(x[idx]) * weight[idx, None])
        return out


def test_a_max_router_gives_each_expert_its_share_and_a_softmax_s_max_routes_nothing():
    """``w, idx = p.max(-1)`` picks each token's one expert as argmax does: each expert got every token (a trial:
    4x the expert FLOPs, and check missed the loop's skip of an expert without tokens, which crashed on gloo). A
    max kept for a hand-written softmax (keepdim) is no routing: a later mask keeps every row."""
    for keepdim, rows in ((False, 64 // 4), (True, 64)):
        with torch.device("meta"):
            model, x = torch.nn.Sequential(_MaxSwitchMoE(keepdim)), torch.randn(64, 16)
        tr = record(model, (x,))
        expert_flops = sum(e.flops for e in tr.events if not e.backward and e.module.startswith("0.experts.")
                           and e.kernel > 0)
        assert expert_flops == 2 * rows * 16 * 16 * (1 if keepdim else 4)


def test_a_max_outside_a_module_or_over_a_vocab_routes_nothing():
    """A max over a vocab's logits (an accuracy beside the loss) or at the loss's top level is no router's: it set
    the stand-in's experts to the vocab, and a mask of the labels after it kept one row in 4,096 (a review)."""
    from fsdp_planner.routing import StandIn

    aten = torch.ops.aten
    for shape, module, routes in (((4096, 8), "layers.0.moe", True), ((4096, 8), "", False),
                                  ((4096, 32000), "layers.0.head", False)):
        stand_in = StandIn()
        scores = torch.empty(shape, device="meta")
        stand_in.call(aten.max.dim, (scores, -1), {}, module)
        assert (stand_in.experts == shape[1]) is routes and (stand_in.experts is None) is not routes


def test_only_ops_that_read_values_pass_through_the_stand_in(monkeypatch):
    """A ReLU's backward (``where``), a matmul, a norm never reach the stand-in's Python (issue 34: 38,000 such
    calls were most of a 10,000-module trace); the router's topk and nonzero still do, and stand in as before, and
    comparisons (whose scalar verdicts a later boolean read answers with)."""
    from fsdp_planner.routing import StandIn

    seen: list[str] = []
    original = StandIn.call

    def counting(self, func, args, kwargs, module):  # type: ignore[no-untyped-def]
        seen.append(func._overloadpacket.__name__)
        return original(self, func, args, kwargs, module)

    monkeypatch.setattr(StandIn, "call", counting)
    with torch.device("meta"):
        model, inputs = rm.where_moe()
    tr = record(model, inputs, reuse=False)
    assert "aten.nonzero" in tr.notes[0]
    assert {"topk", "nonzero"} <= set(seen) <= {"topk", "argmax", "max", "nonzero", "index", "masked_select",
                                                "_local_scalar_dense", "_to_copy",
                                                "eq", "ne", "lt", "le", "gt", "ge"}  # a check's verdict
    assert len(seen) < len([e for e in tr.events if e.is_op]) / 4


def test_routing_on_a_dense_model_is_said(capsys):
    """--routing on a step that routes nothing by data changes nothing: a note says so instead of silence."""
    assert main(["plan", "seed-net", "--policy", "titan", "--routing", "4"]) == 0
    assert "note: --routing 4 changes nothing here: nothing in the step routes tokens by their values" in \
        capsys.readouterr().err


@pytest.mark.parametrize("on_meta", [True, pytest.param(False, marks=pytest.mark.integration)])  # fake: seconds
def test_a_dbrx_like_router_indexes_every_expert_in_range(on_meta: bool):
    """``.item()`` of the experts hit (``nonzero`` of a per-expert mask) is an expert index in range, and each
    expert is visited once: every expert's slice of the stacked weights gets a gradient."""
    if on_meta:
        with torch.device("meta"):
            model, inputs = rm.dbrx_like()
    else:
        model, inputs = rm.dbrx_like()
    tr = record(model, inputs)
    assert "aten._local_scalar_dense" in tr.notes[0] and "'layers.0'" in tr.notes[0]
    assert all(p.gets_grad for p in tr.params)
    # each layer: each of the EXPERTS experts runs its share (tokens x top_k / experts rows) through w1 and w2
    tokens, w1 = 2 * 32, 2 * rm.DIM * rm.DIM
    matmul_flops = sum(e.flops for e in tr.events if not e.backward and e.module == "layers.0" and e.kernel > 0)
    assert matmul_flops >= 2 * 2 * tokens * rm.TOP_K * w1, matmul_flops


def test_transformers_dbrx_one_hot_of_experts_plus_one_hits_every_expert(tmp_path):
    """transformers' DBRX one-hots its top-k into E + 1 classes and loops over the experts its mask hits: that mask
    of E + 1 elements was taken for a token selection, so 2 of 4 experts ran in the trace (half the experts'
    FLOPs) and the starved step ran none, which check called a routing skip (an error, exit 1; a new user's
    finding). Each of the E experts now runs its balanced share, and no routing skip is found."""
    import json

    from fsdp_planner.models import ModelSpec, load_model
    from fsdp_planner.service.tracing import routing_skips

    config = tmp_path / "dbrx.json"
    config.write_text(json.dumps({"model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 2,
                                  "max_seq_len": 256, "vocab_size": 512,
                                  "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000.0},
                                  "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}}))
    spec = ModelSpec(f"hf:{config}", batch_size=1, seq_len=64)
    lm = load_model(spec, meta=True)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    experts = "transformer.blocks.0.ffn.experts"
    flops = sum(e.flops for e in tr.events if e.is_op and not e.backward and e.module.startswith(experts)
                and e.kernel > 0)
    assert flops == 64 * 2 * 3 * 2 * 64 * 128  # tokens x top-k x (w1, v1, w2) x 2 x d x ffn: every expert's share
    assert routing_skips(spec, tr) == ()


def test_a_bounds_check_on_valid_labels_passes():
    """``labels.max() >= vocab_size`` (Wav2Vec2's CTC check) answers False: a valid input never trips a check that
    raises; the placeholder count check (``==``) still holds."""
    with torch.device("meta"):
        model, inputs, loss_fn = rm.wav2vec2_like()
    tr = record(model, inputs, loss_fn)
    assert "aten._local_scalar_dense" in tr.notes[0] and all(p.gets_grad for p in tr.params)


def test_a_scalar_comparison_answers_from_just_inside_its_bound():
    """The rule per comparison: an unknown value lies just inside the bound it is compared with."""
    with torch.device("meta"):
        x = torch.randint(0, 8, (4, 4))
    answers = {}

    class Checks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(4, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            answers.update(max_ge=bool(t.max() >= 8), max_lt=bool(t.max() < 8), min_lt=bool(t.min() < 0),
                           min_ge=bool(t.min() >= 0), sum_gt=bool(t.sum() > 0), eq=bool(t.sum() == 16),
                           ne=bool(t.sum() != 16))
            return self.w(t.float())

    with torch.device("meta"):
        model = Checks()
    record(model, (x,))
    assert answers == dict(max_ge=False, max_lt=True, min_lt=False, min_ge=True, sum_gt=True, eq=True, ne=False)


@pytest.mark.integration  # whole commands and 2-rank gloo runs
@pytest.mark.parametrize("spec, blocks", [("dbrx_like", "DbrxLikeExperts"),
                                          ("wav2vec2_like", "TransformerEncoderLayer")])
def test_value_reading_models_plan_and_verify(spec: str, blocks: str, capsys):
    assert main(["plan", f"{FIXTURE}:{spec}", "--policy", "module", "--module-classes", blocks]) == 0
    # (a dense model's stand-in values are not said as routing)
    said = "balanced-routing stand-in" if spec == "dbrx_like" else "stand-in values (a mask's every element true)"
    assert said in capsys.readouterr().err
    out = run_main("verify", f"{FIXTURE}:{spec}", "--policy", "module", "--module-classes", blocks, "--nproc", "2",
                   "--steps", "2", "--time-steps", "0")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


def test_the_host_waits_for_each_value_a_router_reads():
    """Each op the stand-in answers is one whose output the host reads (a ``torch.where``'s row count, ``.any()``):
    on a GPU the host waits for it. Recorded as such in forward, the same whether each block is traced or
    replayed; a model reading no values has none."""
    with torch.device("meta"):
        model, inputs = rm.where_moe()
    tr = record(model, inputs)
    syncs = [tr.events[i] for i in tr.index.host_syncs]
    # 2 layers x 4 experts x (torch.where's nonzero, and .any()'s value)
    assert len(syncs) == 2 * rm.EXPERTS * 2 and not any(e.backward for e in syncs)
    assert {e.module for e in syncs} == {"layers.0", "layers.1"}
    assert record(model, inputs, reuse=False).index.host_syncs == tr.index.host_syncs
    with torch.device("meta"):
        dense, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)), torch.randn(4, 8)
    assert record(dense, (x,)).index.host_syncs == []


def test_a_router_s_host_waits_expose_the_next_block_s_all_gather():
    """FSDP2 issues a block's all-gather from its pre-forward hook, which the host reaches only once it has
    waited for the previous block's last router read: the all-gather no longer hides behind that block's compute
    (a 2.3B where-routed MoE on 64 H100s, a group per block). An explicit forward prefetch, issued before those
    reads, hides it again (why torchtitan prefetches explicitly under EP); on a host that never falls behind the
    waits cost nothing."""
    from dataclasses import replace

    from fsdp_planner.hardware.cluster import Overhead, parse_cluster
    from fsdp_planner.planners.classic import ModuleWrapPolicy
    from fsdp_planner.sim.simulate import simulate

    with torch.device("meta"):
        model, inputs = rm.routed_lm()
    tr = record(model, inputs)
    unread = replace(tr, events=tuple(e._replace(syncs=False) for e in tr.events))
    plan = ModuleWrapPolicy(["RoutedBlock"]).build(tr, "routed_lm")
    blocks = [i for i, g in enumerate(plan.groups) if not g.is_root]
    groups = list(plan.groups)
    for i, after in itertools.pairwise(blocks):
        groups[i] = replace(groups[i], forward_prefetch=[after])
    prefetched = replace(plan, groups=groups)
    cluster = parse_cluster("h100:64")
    waiting, free = simulate(tr, plan, cluster), simulate(unread, plan, cluster)
    assert waiting.exposed_comm > 1.5 * free.exposed_comm and waiting.step_time > 1.05 * free.step_time
    assert waiting.host_time == pytest.approx(free.host_time)  # its own work: waiting is not busy
    ahead = simulate(tr, prefetched, cluster)
    assert ahead.exposed_comm == pytest.approx(simulate(unread, prefetched, cluster).exposed_comm)
    assert ahead.step_time < waiting.step_time
    ideal = replace(cluster, overhead=Overhead(0.0, 0.0, cluster.overhead.copy_bandwidth))
    assert simulate(tr, plan, ideal).step_time == simulate(unread, plan, ideal).step_time


@pytest.mark.parametrize("factory, block", [("where_moe", "WhereMoE"), ("sorted_moe", "SortedMoE"),
                                            ("routed_lm", "RoutedBlock")])
def test_a_routed_moe_block_is_the_block_not_its_experts(factory: str, block: str):
    """An MoE block holding its experts in a ModuleList is no stage stacking layers: its router reads token
    counts (host syncs inside it), so the experts, which split the tokens, are not taken for the blocks (they were:
    every expert MLP a titan group and a checkpointed block, the root Sequential among them)."""
    with torch.device("meta"):
        model, inputs = getattr(rm, factory)()
    tr = record(model, inputs)
    assert tr.index.block_class == block
    assert all(tr.modules[m].cls == block for m in tr.index.block_instances)


def test_the_host_line_adds_up_and_names_the_waits_where_the_host_reads_values():
    """The host line's terms still sum to the host time the engine charged (its waits for the GPU are no work of
    its own: they were counted in it once), and it says how often the host waits."""
    from fsdp_planner.cli.render import host_line
    from fsdp_planner.hardware.cluster import parse_cluster
    from fsdp_planner.planners.classic import ModuleWrapPolicy
    from fsdp_planner.sim.context import SimContext
    from fsdp_planner.sim.host_work import host_work
    from fsdp_planner.sim.simulate import simulate

    with torch.device("meta"):
        model, inputs = rm.routed_lm()
    tr = record(model, inputs)
    plan = ModuleWrapPolicy(["RoutedBlock"]).build(tr, "routed_lm")
    cluster = parse_cluster("h100:64")
    ctx = SimContext(tr, cluster)
    report, work = simulate(tr, plan, context=ctx), host_work(ctx, plan)
    o = cluster.overhead
    total = work.hooks * o.hook_seconds + work.params * o.param_seconds + work.ops * o.op_seconds
    assert total == pytest.approx(report.host_time, rel=1e-9)
    assert work.waits == 64 and report.host_wait > 0
    line = host_line(report, cluster, work)
    assert "the host waits for the GPU 64 times (64 in forward) to read an op's output" in line


class _CountedSplit(torch.nn.Module):
    """Experts fed by ``torch.split`` of the tokens sorted by expert, sizes from each expert's token count."""

    def __init__(self, bincount: bool) -> None:
        super().__init__()
        self.router, self.bincount = torch.nn.Linear(rm.DIM, rm.EXPERTS, bias=False), bincount
        self.experts = torch.nn.ModuleList(torch.nn.Linear(rm.DIM, rm.DIM) for _ in range(rm.EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.router(x).topk(rm.TOP_K, -1)[1].reshape(-1)
        counts = torch.bincount(ids, minlength=rm.EXPERTS) if self.bincount else \
            torch.nn.functional.one_hot(ids, rm.EXPERTS).sum(0)
        ordered = x.repeat_interleave(rm.TOP_K, 0)[ids.argsort()]
        return torch.cat([e(chunk) for e, chunk in zip(self.experts, ordered.split(counts.tolist()), strict=True)])


def test_a_bincount_of_expert_ids_stands_in_as_their_one_hot_sum():
    """``torch.bincount(ids, minlength=E)``, a common way to count each expert's tokens, has no meta kernel: it
    stood in for nothing and the trace failed (a new user's trial). With ``minlength`` its size is fixed: each
    expert's balanced count, as the one-hot sum gives, and the host waits for it on a GPU."""
    traces = {}
    for bincount in (False, True):
        with torch.device("meta"):
            model, x = _CountedSplit(bincount), torch.randn(64, rm.DIM)
        traces[bincount] = record(model, (x,))
    flops = {k: [e.flops for e in tr.events if e.flops and not e.backward and e.module.startswith("experts.")]
             for k, tr in traces.items()}
    assert flops[True] == flops[False] and len(flops[True]) == rm.EXPERTS
    assert "aten.bincount" in traces[True].notes[0]
    assert any(traces[True].events[i].module == "" for i in traces[True].index.host_syncs)
