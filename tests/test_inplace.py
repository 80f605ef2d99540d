"""Issue 11: models with in-place ops (``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``x.relu_()``,
``out += identity``) trace, plan and train, and their traces match the same models run out of place."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import run_main

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches, make_plan
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.models import load_model
from fsdp_planner.trace import EventKind, Trace, record
from fsdp_planner.trace import reuse as reuse_mod
from fsdp_planner.trace.hooks import ModuleHooks
from fsdp_planner.trace.step import Slot, StepRecorder
from fsdp_planner.trace.walk import ModuleWalk

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "inplace_models.py"


def _trace(fn: str, reuse: bool = True, meta: bool = True) -> Trace:
    lm = load_model(f"{MODELS}:{fn}", meta=meta)
    return record(lm.model, lm.example_inputs, lm.loss_fn, reuse=reuse)


def _same_but_inputs(a: Trace, b: Trace) -> set[str]:
    """Assert the traces (``a`` in place, ``b`` out of place) are equal but for FWD_PRE's inputs_nbytes,
    FWD_POST's held (an in-place op's result shares its input's storage: a call's frame holds one storage where
    out of place it holds two, never more), what it saved of its inputs (an in-place ReLU saves its input) and its
    height mid-way (``Event.rise``), forward ops' live (their temporaries: the same one storage against two)
    and backward ops' freed (a saved storage that is the call's input is left to its caller: freed at the call's
    post-backward, never earlier); and what made a storage a call keeps or an op saves (``Event.made_at``: in place,
    the ReLU's result is the storage its input's matmul made); the modules whose inputs_nbytes differ."""
    assert len(a.events) == len(b.events)
    differ = set()
    for x, y in zip(a.events, b.events, strict=True):
        if x != y and x.kind is EventKind.FWD_POST:  # (and what its kept inputs saved: the ReLU's, in place)
            assert x._replace(held=y.held, saved_inputs=y.saved_inputs, rise=y.rise) == y and x.held <= y.held \
                and x.saved_inputs >= y.saved_inputs, (x, y)
        elif x != y and x.kind is EventKind.OP:
            assert x._replace(freed=y.freed, live=y.live, made_at=y.made_at) == y and x.freed <= y.freed \
                and x.live <= y.live, (x, y)
        elif x != y:
            assert x.kind is EventKind.FWD_PRE and x._replace(inputs_nbytes=y.inputs_nbytes, made_at=y.made_at) == y, \
                (x, y)
            if x.inputs_nbytes != y.inputs_nbytes:
                differ.add(x.module)
    # (the modules whose output an in-place op modified are noted, ``ModuleInfo.output_modified``: out of place none)
    assert not any(m.output_modified for m in b.modules.values())
    assert a.params == b.params and {n: replace(m, output_modified=False) for n, m in a.modules.items()} == b.modules
    return differ


# The modules whose input is what an in-place ReLU returned: the storage of that ReLU's input, which the ReLU's
# call counted already (out of place, the ReLU's output is a new tensor: a second storage)
RELU_FED = {"maxpool", "layer1.0.conv2", "layer1.1", "layer1.1.conv2", "layer2", "layer2.0.conv2",
            "layer2.1", "layer2.1.conv2", "avgpool"}


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("meta", [True, False])
def test_resnet_with_inplace_relu_traces_like_the_out_of_place_one(reuse, meta):
    inplace, out_of_place = _trace("build", reuse, meta), _trace("build_not_inplace", reuse, meta)
    # same ops in the same modules, same params read, FLOPs, bytes moved and activation bytes saved per op
    # (an in-place ReLU saves its result as the out-of-place one does: the same bytes, in its input's storage)
    differ = _same_but_inputs(inplace, out_of_place)
    assert differ == RELU_FED
    by_module = {e.module: e.inputs_nbytes for e in inplace.events if e.kind is EventKind.FWD_PRE}
    assert all(by_module[m] == 0 for m in RELU_FED)  # no new storage: nothing to count again
    assert inplace.modules["layer1.0.relu"].calls == 2
    assert all(m.shardable for m in inplace.modules.values())  # no module modifies its own input


def test_resnet_reuse_replays_the_same_events():
    assert _trace("build", reuse=True).events == _trace("build", reuse=False).events


@pytest.mark.parametrize("reuse", [True, False])
def test_inplace_ops_in_forward_and_on_block_outputs(reuse):
    inplace, out_of_place = _trace("functional", reuse), _trace("functional_not_inplace", reuse)
    # the in-place ops write tensors no later call takes as a new input: the traces are equal, input bytes too
    assert _same_but_inputs(inplace, out_of_place) == set()
    assert sum(e.saved for e in inplace.events) == sum(e.saved for e in out_of_place.events)
    assert inplace.events == _trace("functional", not reuse).events


def test_a_module_modifying_its_own_input_is_not_a_group_of_its_own(monkeypatch):
    replayed: list[str] = []
    original = reuse_mod._replay_actions

    def spy(main, actions, prefix, params, sources, *outside, **where):
        replayed.extend(prefix + a[1] for a in actions if a[0] == "modified_input")
        return original(main, actions, prefix, params, sources, *outside, **where)

    monkeypatch.setattr(reuse_mod, "_replay_actions", spy)
    tr = _trace("modifies_inputs")
    shardable = {m: info.shardable for m, info in tr.modules.items()}
    refused = {m for m, ok in shardable.items() if not ok}
    # a, b: relu_ / += on their input; wraps.i.pre: on the wrapper's fc output; a wrapper modifies no input
    assert refused == {"a", "b", "wraps.0.pre", "wraps.1.pre", "wraps.2.pre"}
    assert set(replayed) == {"wraps.0.pre", "wraps.1.pre", "wraps.2.pre"}  # from the template, replayed
    assert tr.events == _trace("modifies_inputs", reuse=False).events
    assert tr.modules == _trace("modifies_inputs", reuse=False).modules
    plan = make_plan(tr, [["a"], ["b"], ["wraps.0"], ["wraps.1.pre"]])
    assert [list(g.modules) for g in plan.groups] == [["a.fc"], ["b.fc"], ["wraps.0"], ["wraps.1.pre.fc"], [""]]
    by_hand = Plan([Group(["a"], [p.fqn for p in tr.params if p.fqn.startswith("a.")]),
                    Group([""], [p.fqn for p in tr.params if not p.fqn.startswith("a.")], False)],
                   tr.fingerprint, tr.numel)
    with pytest.raises(PlannerError, match=r"change their own inputs \(an in-place op on a tensor.*: a; shard their "
                                           r"children"):
        check_plan_matches(by_hand, tr)


def test_a_saved_tensor_modified_in_place_fails_as_without_the_tracer():
    lm = load_model(f"{MODELS}:modifies_saved", meta=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lm.model(*lm.example_inputs).sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _trace("modifies_saved")


@pytest.mark.parametrize("fn", ["build", "functional", "modifies_inputs"])
def test_the_tracers_hooks_keep_the_models_grads(fn):
    """On real tensors, a step under the tracer's module hooks (markers on every call's inputs) gives the grads
    of the plain model: the in-place ops on the markers' aliases are differentiated as on the inputs."""
    grads = []
    for hooked in (False, True):
        lm = load_model(f"{MODELS}:{fn}", meta=False)
        x = lm.example_inputs[0].clone().requires_grad_()
        hooks = ModuleHooks(ModuleWalk(lm.model), Slot(StepRecorder(set())))
        with hooks.installed() if hooked else contextlib.nullcontext():
            lm.model(x).pow(2).mean().backward()
        grads.append([x.grad, *(p.grad for p in lm.model.parameters())])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.integration
def test_plan_and_verify_a_resnet_with_inplace_relu_from_the_cli():
    spec = f"{MODELS}:build"
    # in fp32 (under bf16-mixed the BatchNorms get fp32 groups of their own: test_group_precision.py)
    out = run_main("plan", spec, "--precision", "fp32")
    assert out.returncode == 0, out.stdout + out.stderr
    out = run_main("verify", spec, "--policy", "order", "--nproc", "2", "--precision", "fp32")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


@pytest.mark.integration
def test_modules_modifying_their_inputs_train_on_a_real_run():
    """Listing every module (a and b too) still trains: a and b are replaced by their children, which FSDP2 can
    shard; sharding a or b themselves fails on a real run (autograd refuses the in-place op on their input)."""
    from fsdp_planner.runtime.verify import run_verify

    spec = f"{MODELS}:modifies_inputs"
    lm = load_model(spec)
    tr = record(lm.model, lm.example_inputs)
    plan = make_plan(tr, [["inp"], ["a"], ["b"], ["wraps.0"], ["wraps.1"], ["wraps.2.pre"], ["out"]])
    result = run_verify(spec, tr, plan, nproc=2, steps=2)
    assert result.ok, (result.counted, result.predicted, result.max_abs_diff)


POP_NET = "tests/fixtures/list_models.py:pop_net"


def test_a_module_popping_from_a_list_its_caller_gives_traces_and_is_not_sharded():
    """A new user's UNet whose up blocks pop their skips from their parent's list could not be planned at all: the
    tracer gave every call a copy of its list (as FSDP2 does a sharded module's call), so the pops never reached
    the parent and a later block took the wrong skip. The caller's list is kept (the step runs as written, in
    bf16-mixed too, where FSDP2's input casts are traced), and the up blocks, whose calls change it, are no group of
    their own: the module policy shards their children, and a plan listing one is refused in one sentence."""
    from fsdp_planner.models import ModelSpec
    from fsdp_planner.service.tracing import trace_spec

    tr = trace_spec(ModelSpec(POP_NET))
    assert [m for m, info in tr.modules.items() if not info.shardable] == ["downs", "ups", "ups.0", "ups.1"]
    r = run_main("plan", POP_NET, "--policy", "module", "--module-classes", "Up", "--json")
    assert r.returncode == 0, r.stderr
    groups = [g["modules"] for g in json.loads(r.stdout)["plans"][0]["plan"]["groups"]]
    assert ["ups.0.proj", "ups.0.out"] in groups and not any("ups.0" in g for g in groups)
    # ('embed' too: the cast of its float32 input, ``Trace.cast_inputs``)
    made = make_plan(tr, [["ups.0"]])
    assert [list(g.modules) for g in made.inner_groups] == [["embed"], ["ups.0.proj", "ups.0.out"]]
    by_hand = Plan([Group(["ups.0"], [p.fqn for p in tr.params if p.fqn.startswith("ups.0.")]),
                    Group([""], [p.fqn for p in tr.params if not p.fqn.startswith("ups.0.")], False)],
                   tr.fingerprint, tr.numel)
    with pytest.raises(PlannerError, match=r"a pop from a list they are given.*: ups.0; shard their children"):
        check_plan_matches(by_hand, tr)


@pytest.mark.integration  # a 2-rank torchrun job: ~10 s
def test_a_module_popping_from_its_caller_s_list_trains_with_its_children_sharded():
    """The same model on 2 gloo ranks, its up blocks' children sharded: parity with one process."""
    r = run_main("verify", POP_NET, "--policy", "module", "--module-classes", "Up", "--nproc", "2", "--steps", "2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
