from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import policy, traced

from fsdp_planner.fsdp2.claim import validate_plan
from fsdp_planner.models import load_model
from fsdp_planner.planners import ExecutionOrderPolicy, ModuleWrapPolicy, SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.planners.blocks import default_block_class
from fsdp_planner.sim.metrics import plan_metrics
from fsdp_planner.trace import record


def groups_of(plan):
    return [list(g.modules) for g in plan.groups]


def test_size_based_reproduces_the_seed_grouping(seed_trace):
    plan = SizeBasedPolicy(2000).plan(seed_trace)
    assert groups_of(plan) == [["conv2"], ["fc1"], [""]]
    assert set(plan.root.params) == {"conv1.weight", "conv1.bias", "fc2.weight", "fc2.bias"}


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("spec", "threshold"), [("seed-net", 2000), ("toy-llama", 20_000), ("toy-llama", 5000)])
def test_size_based_matches_real_fsdp1_wrapping(one_rank_group, spec, threshold):
    """The replay of _recursive_wrap wraps exactly the modules real FSDP1 wraps."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    lm = load_model(spec, meta=False)
    wrapped = FSDP(lm.model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy,
                                                                min_num_params=threshold),
                   device_id=torch.device("cpu"))
    real = sorted(n.replace("_fsdp_wrapped_module.", "") for n, m in wrapped.named_modules()
                  if isinstance(m, FSDP) and n)
    ours = sorted(SizeBasedPolicy(threshold).wrapped_modules(traced(spec)))
    assert ours == real


def test_module_wrap_policy_root_takes_the_rest():
    tr = traced("toy-llama")
    assert default_block_class(tr) == "TransformerBlock"
    plan = ModuleWrapPolicy().plan(tr)
    assert groups_of(plan)[:-1] == [[f"layers.{i}"] for i in range(4)]
    assert set(plan.root.params) == {"tok_embeddings.weight", "norm.weight", "output.weight"}


class _Layer(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.mlp(x + self.attn(x))


class _Stage(torch.nn.Module):
    """Swin's nesting: a stage stacks its layers in a ModuleList of its own, then merges patches."""

    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Layer(dim) for _ in range(depth))
        self.downsample = torch.nn.Linear(dim, dim)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.downsample(x)


class _Staged(torch.nn.Module):
    def __init__(self, depths: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Stage(16, d) for d in depths)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for s in self.layers:
            x = s(x)
        return self.head(x)


@pytest.mark.parametrize("depths", [(2, 2, 6, 2), (1, 1)])
def test_block_class_is_the_layer_a_stage_stacks(depths):
    """A stage holding a stack of layers (Swin's SwinStage.blocks) is not the block: wrapping it would make one
    FSDP group of several layers; the stacked layer is, even at one layer a stage."""
    model = _Staged(depths)
    tr = record(model, (torch.randn(2, 16),))
    assert default_block_class(tr) == "_Layer"
    plan = ModuleWrapPolicy().plan(tr)
    assert len(plan.groups) - 1 == sum(depths)


class _SharedLayer(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.ff1, self.ff2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.ff2(torch.relu(self.ff1(self.norm(x))))


class _Albert(torch.nn.Module):
    """ALBERT's layout: one layer whose weights every step of the stack shares, no container."""

    def __init__(self, dim: int = 16, repeats: int = 6) -> None:
        super().__init__()
        self.embed, self.proj = torch.nn.Linear(8, dim), torch.nn.Linear(dim, dim)
        self.layer, self.repeats = _SharedLayer(dim), repeats
        self.pool, self.cls = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 2)

    def forward(self, x):
        x = self.proj(self.embed(x))
        for _ in range(self.repeats):
            x = self.layer(x)
        return self.cls(torch.tanh(self.pool(x)))


def test_block_class_is_the_layer_a_model_calls_again_and_again():
    """A layer the step calls six times (ALBERT's shared layer) is the block: its Linears, the repeated class with
    the most params, were taken for it, and module wrapping left half the params in the root (a trial)."""
    tr = record(_Albert(), (torch.randn(2, 8),))
    assert default_block_class(tr) == "_SharedLayer"
    assert [g.modules for g in ModuleWrapPolicy().plan(tr).groups] == [("layer",), ("",)]


class _TwoTowers(torch.nn.Module):
    """Three large blocks as attributes (no container) and a small projector run on both inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.b1, self.b2, self.b3 = (_SharedLayer(32) for _ in range(3))
        self.up = torch.nn.Linear(8, 32)

    def forward(self, x, y):
        h = self.up(self.proj(x) + self.proj(y))
        return self.b3(self.b2(self.b1(h)))


def test_a_small_module_called_twice_is_no_block_beside_larger_repeated_ones():
    tr = record(_TwoTowers(), (torch.randn(2, 8), torch.randn(2, 8)))
    assert default_block_class(tr) == "_SharedLayer"


class _Mixer(torch.nn.Module):
    """A Mamba-like mixer: it reads its child's weight itself (as Jamba's reads ``dt_proj.weight``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_proj, self.dt_proj, self.out_proj = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):
        return self.out_proj(torch.nn.functional.linear(self.in_proj(x), self.dt_proj.weight))


class _AttentionLayer(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.o = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x):
        return x + self.o(torch.softmax(self.q(x), -1))


class _MixerLayer(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mixer = _Mixer(d)

    def forward(self, x):
        return x + self.mixer(x)


def test_a_stack_of_one_layer_of_each_kind_has_its_layers_for_blocks():
    """A 2-layer hybrid (one Mamba layer, one attention layer): no layer class repeats, so the block class fell to
    the Linear repeated inside them, and module and titan gave the mixer's dt_proj a group of its own that the
    mixer reads outside its hooks (their plans could not run; a new user's finding on Jamba)."""
    model = torch.nn.Sequential()
    model.layers = torch.nn.ModuleList([_MixerLayer(16), _AttentionLayer(16)])
    model.forward = lambda x: model.layers[1](model.layers[0](x))
    tr = record(model, (torch.randn(2, 16),))
    assert tr.index.checkpoint_block_classes == ("_MixerLayer", "_AttentionLayer")
    for chosen in (ModuleWrapPolicy(), TorchtitanPolicy()):
        plan = chosen.plan(tr)
        validate_plan(plan, tr)
        assert ["layers.0"] in groups_of(plan) and ["layers.1"] in groups_of(plan), groups_of(plan)
        assert not any("layers.0.mixer.dt_proj" in g for g in groups_of(plan)), groups_of(plan)


def test_a_hybrid_s_few_layers_of_another_kind_are_blocks_too():
    """Jamba stacks 4 attention layers among 28 Mamba layers: the attention layers hold far less than a quarter of
    the Mamba layers' params, so they were no peer block class, and titan grouped them with the norm and the output
    head, kept unsharded after forward (a new user's finding). A class stacked between the block class's instances
    in their container is a block whatever its share, as torchtitan's loop over the stack shards each layer; a
    module at the stack's end (a head) is not (a reviewer's case)."""
    model = torch.nn.Sequential()
    model.layers = torch.nn.ModuleList([*(_MixerLayer(16) for _ in range(3)), _AttentionLayer(16),
                                        *(_MixerLayer(16) for _ in range(4)), _AttentionLayer(16)])
    model.forward = lambda x: functools.reduce(lambda h, m: m(h), model.layers, x)
    tr = record(model, (torch.randn(2, 16),))
    assert tr.index.checkpoint_block_classes == ("_MixerLayer", "_AttentionLayer")
    for chosen in (ModuleWrapPolicy(), TorchtitanPolicy()):
        plan = chosen.plan(tr)
        validate_plan(plan, tr)
        assert ["layers.3"] in groups_of(plan) and ["layers.8"] in groups_of(plan), groups_of(plan)
    model.layers = torch.nn.ModuleList([*(_MixerLayer(16) for _ in range(7)), _AttentionLayer(16)])  # at the end
    assert record(model, (torch.randn(2, 16),)).index.checkpoint_block_classes == ("_MixerLayer",)


class DoubleConv(torch.nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.ReLU(),
                                       torch.nn.Conv2d(cout, cout, 3, padding=1), torch.nn.ReLU())

    def forward(self, x):
        return self.net(x)


class _UNet(torch.nn.Module):
    def __init__(self, w: int = 4) -> None:
        super().__init__()
        self.downs = torch.nn.ModuleList([DoubleConv(3, w), DoubleConv(w, 2 * w)])
        self.bottleneck = DoubleConv(2 * w, 4 * w)
        self.upconvs = torch.nn.ModuleList([torch.nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2),
                                            torch.nn.ConvTranspose2d(2 * w, w, 2, stride=2)])
        self.ups = torch.nn.ModuleList([DoubleConv(4 * w, 2 * w), DoubleConv(2 * w, w)])
        self.head = torch.nn.Conv2d(w, 2, 1)

    def forward(self, x):
        skips = []
        for d in self.downs:
            x = d(x)
            skips.append(x)
            x = torch.nn.functional.max_pool2d(x, 2)
        x = self.bottleneck(x)
        for up, dc, s in zip(self.upconvs, self.ups, reversed(skips), strict=True):
            x = dc(torch.cat([up(x), s], 1))
        return self.head(x)


def test_a_u_net_s_blocks_are_its_double_convs():
    """A U-Net's DoubleConv stacks its convs in a Sequential of its own: the convs, in every block and in the
    bottleneck, held more params than the blocks and were taken for them (every conv a group, --ac checkpointing
    each conv)."""
    tr = record(_UNet(), (torch.randn(2, 3, 16, 16),))
    assert default_block_class(tr) == "DoubleConv"
    assert groups_of(ModuleWrapPolicy().plan(tr)).count(["head"]) == 0


class ConvNeXtBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dw, self.pw = torch.nn.Conv2d(d, d, 3, padding=1, groups=d), torch.nn.Conv2d(d, d, 1)

    def forward(self, x):
        return x + self.pw(self.dw(x))


class _ConvNeXt(torch.nn.Module):
    """Stages of blocks in Sequentials, in a ModuleList (torchvision's ConvNeXt nests them so)."""

    def __init__(self, dims: tuple[int, ...] = (8, 16)) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, dims[0], 2, 2)
        self.stages = torch.nn.ModuleList(torch.nn.Sequential(ConvNeXtBlock(d), ConvNeXtBlock(d)) for d in dims)
        self.downs = torch.nn.ModuleList(torch.nn.Conv2d(a, b, 2, 2) for a, b in itertools.pairwise(dims))

    def forward(self, x):
        x = self.stem(x)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            x = self.downs[i](x) if i < len(self.downs) else x
        return x.mean()


def test_a_stage_of_blocks_gives_way_to_its_blocks():
    """A Sequential stage holds exactly its blocks' params, and the class name broke the tie ('Sequential' after
    'ConvNeXtBlock'): a trial's ConvNeXt was wrapped by stage, two groups of two blocks."""
    tr = record(_ConvNeXt(), (torch.randn(2, 3, 16, 16),))
    assert default_block_class(tr) == "ConvNeXtBlock"
    assert len(ModuleWrapPolicy().plan(tr).inner_groups) == 4


class _Attention(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return x + self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v))


class _FeedForward(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_a_block_built_as_a_sequential_of_other_layers_stays_one_block():
    """Sequential(Attention, FeedForward) in a ModuleList is a block, not a stage: its layers are of two classes (a
    review of the stage rule above split each block in two)."""
    layers = torch.nn.ModuleList(torch.nn.Sequential(_Attention(16), _FeedForward(16)) for _ in range(3))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    tr = record(Net(), (torch.randn(2, 8, 16),))
    assert default_block_class(tr) == "Sequential"
    assert groups_of(ModuleWrapPolicy().plan(tr))[:3] == [["layers.0"], ["layers.1"], ["layers.2"]]


def test_nested_sequential_stages_of_childless_blocks_plan_with_every_policy(capsys):
    """A CNN whose stages stack Sequential(Conv2d, Identity, ReLU): its block class is the Conv2d, which has no
    children; every policy (and check) raised KeyError: 'Conv2d' in the checkpointing blocks' peers."""
    from fsdp_planner.cli import main

    spec = f"{Path(__file__).parent / 'fixtures' / 'conv_models.py'}:nested_stages"
    for args in (["--policy", "titan"], ["--policy", "order"], ["--policy", "auto", "--cluster", "h100:8"]):
        assert main(["plan", spec, *args]) == 0, capsys.readouterr().err
    assert main(["check", spec]) == 0, capsys.readouterr().err


def test_torchtitan_policy_groups_norm_and_output():
    plan = TorchtitanPolicy().plan(traced("toy-llama"))
    assert groups_of(plan) == [["tok_embeddings"], *[[f"layers.{i}"] for i in range(4)], ["norm", "output"], [""]]
    assert plan.groups[-2].reshard_after_forward is False
    assert list(plan.root.params) == []


def test_torchtitan_policy_shards_modules_between_blocks_alone():
    """A U-Net's middle blocks run between its Down and Up blocks: they were one list group with the output
    conv, kept unsharded after forward (44M params gathered from the middle's forward to its backward)."""
    lm = load_model(f"{Path(__file__).parent / 'fixtures' / 'unet_models.py'}:build")
    plan = TorchtitanPolicy().plan(record(lm.model, lm.example_inputs, lm.loss_fn))
    grouped = groups_of(plan)
    assert [g for g in grouped if g[0].startswith("mid")] == [["mid1"], ["mid_attn"], ["mid2"]]
    assert ["out_norm", "out"] in grouped
    assert [g.reshard_after_forward for g in plan.groups if "out" in g.modules] == [False]
    assert all(g.reshard_after_forward for g in plan.groups if g.modules[0].startswith("mid"))


def test_torchtitan_policy_groups_a_decoder_s_tied_embedding_with_the_output():
    """An encoder-decoder whose decoder embedding (run between the two stacks) is tied to the head: one group with
    the final norm and the head, kept unsharded after forward, as torchtitan groups a tied embedding."""
    lm = load_model(f"{Path(__file__).parent / 'fixtures' / 'keyword_encdec.py'}:tied_decoder")
    plan = TorchtitanPolicy().plan(record(lm.model, lm.example_inputs, lm.loss_fn))
    (tail,) = [g for g in plan.groups if "head" in g.modules]
    assert sorted(tail.modules) == ["decoder_embed", "head", "norm"] and tail.reshard_after_forward is False


def test_torchtitan_policy_groups_tied_weights_with_embedding():
    plan = TorchtitanPolicy().plan(traced("toy-gpt2-tied"))
    assert ["wte", "ln_f", "lm_head"] in groups_of(plan)


def test_tied_weights_are_never_split():
    tr = traced("toy-gpt2-tied")
    for chosen in (SizeBasedPolicy(2000), ModuleWrapPolicy(("Embedding", "Linear")), ExecutionOrderPolicy(1)):
        plan = chosen.plan(tr)
        holders = [i for i, g in enumerate(plan.groups) if "wte.weight" in g.params]
        assert len(holders) == 1
        assert {"wte", "lm_head"} <= set(plan.groups[holders[0]].modules) or plan.groups[holders[0]].is_root


def test_execution_order_plan_fixes_the_seed_waste(seed_trace):
    size = SizeBasedPolicy(2000).plan(seed_trace)
    order = ExecutionOrderPolicy().plan(seed_trace)
    assert not any({"conv1", "fc2"} <= set(g.modules) for g in order.groups)
    assert list(order.root.params) == []
    m_size, m_order = plan_metrics(seed_trace, size), plan_metrics(seed_trace, order)
    assert m_size.idle_byte_ops > 0
    assert m_order.idle_byte_ops < m_size.idle_byte_ops / 10


def test_execution_order_groups_are_contiguous_blocks():
    plan = ExecutionOrderPolicy().plan(traced("toy-llama"))
    assert groups_of(plan) == [["tok_embeddings"], *[[f"layers.{i}"] for i in range(4)], ["norm", "output"], [""]]
    assert plan.groups[-2].reshard_after_forward is False
    small = ExecutionOrderPolicy(target_bytes=60_000).plan(traced("toy-llama"))
    assert len(small.groups) > len(plan.groups) and list(small.root.params) == []


FIXTURES = Path(__file__).parent / "fixtures"


def fixture_trace(name: str):
    lm = load_model(f"{FIXTURES / 'factories.py'}:{name}")
    return record(lm.model, lm.example_inputs, lm.loss_fn)


@pytest.mark.parametrize("name", ["module", "size", "titan", "order"])
def test_param_on_the_root_stays_with_the_root(name):
    """A parameter registered on the root beside children: every policy plans, only the root holds it (it once
    raised a false tied-weights error for order)."""
    tr = fixture_trace("root_param")
    if name in ("module", "titan"):
        plan = policy(name, module_classes=("Linear",)).plan(tr)
    else:
        plan = policy(name, min_nonwrapped_numel=100).plan(tr)
    validate_plan(plan, tr)
    assert "scale" in plan.root.params
    if name == "order":
        assert list(plan.root.params) == ["scale"]


@pytest.mark.parametrize("name", ["module", "size", "titan", "order"])
def test_submodule_shared_by_blocks_is_claimed_once(name):
    """Blocks sharing one submodule object: FSDP2 reaches it from every block, so it must be claimed by one group
    applied first (once a KeyError / false tied-weights error)."""
    tr = fixture_trace("shared_submodule")
    assert tr.modules["proj"].aliases == ("blocks.0.proj", "blocks.1.proj", "blocks.2.proj")
    assert set(tr.index.parents["proj"]) == {"", "blocks.0", "blocks.1", "blocks.2"}
    plan = policy(name, min_nonwrapped_numel=200).plan(tr)
    validate_plan(plan, tr)
    holders = [g for g in plan.groups if "proj.weight" in g.params]
    assert len(holders) == 1
    # proj runs in every block: in a list group it would be reused after its group's forward (pytorch#183702)
    assert list(holders[0].modules) == ["proj"] or holders[0].is_root


def test_module_called_twice_is_never_in_a_list_group():
    tr = traced("t5-3b")
    plan = ExecutionOrderPolicy().plan(tr)
    (shared,) = [g for g in plan.groups if "shared.weight" in g.params]
    assert list(shared.modules) == ["shared"]


@pytest.mark.parametrize("name", ["titan", "order"])
def test_params_the_root_reads_itself_stay_on_the_root_and_the_blocks_keep_their_groups(name):
    """A trial's GPT-2 with the tie written as ``F.linear(h, wte.weight)`` in the root's forward: the order policy
    joined wte's group to the next until it ran, one group of the whole model; titan listed a ParameterList the
    root indexes with the heads and refused its own plan. Both now leave those params to the root."""
    spec = str(Path(__file__).parent / "fixtures" / "factories.py") + ":functional_tie"
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs)
    plan = policy(name).plan(tr, spec)
    assert {f"blocks.{i}" for i in range(4)} <= {m for g in plan.inner_groups for m in g.modules}
    assert {"wte.weight", *(f"shifts.{i}" for i in range(4))} <= set(plan.root.params)
    assert "joined" not in plan.policy
