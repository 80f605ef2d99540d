"""Activation checkpointing in a plan: which modules are checkpointed, whether FSDP2 can run it, and applying it.

A plan's ``activation_checkpointing`` lists modules whose every call is checkpointed in full: the call keeps only
its inputs alive after forward, and its forward is run again at the start of its backward (non-reentrant
``torch.utils.checkpoint``). Its ``selective_checkpointing`` maps modules to an op-level selective checkpointing
policy (``selective.py``): the call keeps its inputs and the outputs of the ops the policy saves, and runs the
others again. ``apply_checkpointing`` uses the composable ``torch.distributed._composable.checkpoint``
hooks, so module names (and the plan's, and the state dict's) stay as they are, unlike ``checkpoint_wrapper``; it
runs before ``fully_shard``, the order torchtitan uses, so the checkpointed module's own FSDP2 hooks run outside
the checkpointed region. The hooks of groups inside it (BatchNorms in fp32 groups, a block's attention and MLP
each a group) run inside it: FSDP2 runs their forward path again in the recomputation, before their pre-backward,
all-gathering again a group it resharded after forward (``fsdp2/replay.py``). Not under op-level checkpointing,
which real FSDP2 fails on some such groupings (``inside_selective``).

The ``--ac`` choices for whole-model policies, after torchtitan's ``activation_checkpoint`` config: ``full``
checkpoints every block; ``op`` checkpoints every block with op-level selective checkpointing (torchtitan's
``mode = "selective"``, ``selective_ac_option = "op"``, its default), the policy chosen by ``--ac-policy``;
``selective`` is torchtitan's removed layer-level option with frequency 2 (``selective_ac_option = "2"``): every
second block in full, counting from the first (blocks 1, 3, 5, ... 0-based).

Activation offloading (``--ac offload``, a plan's ``activation_offloading``): a listed module is not checkpointed;
its every call runs its forward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so each tensor its
ops save for backward is copied into pinned host memory as it is packed, and copied back to the device when its
backward unpacks it. Torch's ``save_on_cpu`` copies on the current stream (``copy_(non_blocking=True)`` in pack,
``.to(device, non_blocking=True)`` in unpack): the copies are stream-ordered with the compute, not overlapped with
it, and there is no prefetch; the simulator charges them on the compute stream (``sim/recompute.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdp_planner.choices import ACMode, Offloaded, SacPolicy
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable_name
from fsdp_planner.fsdp2.selective import POLICIES, sac_context_fn
from fsdp_planner.fsdp2.tensor_parallel import matches
from fsdp_planner.trace.events import EventKind, OpClass, OwnCall
from fsdp_planner.trace.ops import router_shapes
from fsdp_planner.trace.tree import ROOT, is_within

if TYPE_CHECKING:
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.trace.records import Trace


SELECTIVE_EVERY = 2  # torchtitan's layer-level selective frequency this mode reproduces

# What a plan checkpoints, as the simulator keys it: (module, None for full, its op-level policy, or
# ``Offloaded.HOST`` for a module whose saved activations are offloaded), full first, offloaded last; a checkpointed
# one run without early stop (``Plan.checkpoint_early_stop`` False) carries a third item, WHOLE.
Checkpointing = tuple[tuple[str, SacPolicy | Offloaded | None] | tuple[str, SacPolicy | None, bool], ...]
WHOLE = True  # the third item of a module whose recomputation runs its whole forward


def plan_checkpointing(plan: Plan) -> Checkpointing:
    """The plan's checkpointed modules and how each is checkpointed, then its offloaded ones."""
    whole = () if plan.checkpoint_early_stop else (WHOLE,)
    return (*((m, None, *whole) for m in plan.activation_checkpointing),
            *((m, p, *whole) for m, p in plan.selective_checkpointing.items()),
            *((m, Offloaded.HOST) for m in plan.activation_offloading))


def checkpoint_blocks(plan: Plan, trace: Trace, mode: ACMode, policy: SacPolicy) -> Plan:
    """``plan`` with its checkpointing set to what ``mode`` checkpoints (``op``: with ``policy``), and labelled."""
    blocks = checkpointed_blocks(trace, mode)
    if mode is ACMode.OP:
        return replace(plan, activation_checkpointing=(), selective_checkpointing=dict.fromkeys(blocks, policy),
                       policy=f"{plan.policy} + ac op {policy.value}")
    if mode is ACMode.OFFLOAD:
        return replace(plan, activation_checkpointing=(), selective_checkpointing={}, activation_offloading=blocks,
                       policy=f"{plan.policy} + ac offload")
    return replace(plan, activation_checkpointing=blocks, selective_checkpointing={},
                   policy=f"{plan.policy} + ac {mode.value}" if mode is not ACMode.NONE else plan.policy)


def checkpointed_blocks(trace: Trace, mode: ACMode) -> list[str]:
    """The modules ``mode`` checkpoints: none, every block (full or op-level), or every second block."""
    if mode is ACMode.NONE:
        return []
    blocks = list(trace.index.block_instances)  # an encoder-decoder's encoder layers too
    if not blocks:
        key = {ACMode.OP: "selective_checkpointing", ACMode.OFFLOAD: "activation_offloading"}.get(
            mode, "activation_checkpointing")
        raise PlannerError(f"--ac {mode.value} applies to the model's repeated blocks, and this model has none "
                           "(no repeated composite module class, in a ModuleList, a Sequential or as attributes); "
                           f"list the modules in a plan file's \"{key}\" instead")
    if mode in (ACMode.FULL, ACMode.OP, ACMode.OFFLOAD):
        return blocks
    return [b for k, b in enumerate(blocks, start=1) if k % SELECTIVE_EVERY == 0]


def check_checkpointing(plan: Plan, trace: Trace) -> None:
    """PlannerError when the plan's checkpointed modules are not something this planner models and FSDP2 runs:
    each must be a module of the model, called in the step, and not inside another checkpointed module; its
    offloaded modules likewise, and none checkpointed too. An FSDP group may lie inside a module checkpointed in
    full (its hooks run again in the recomputation, as ``fsdp2/replay.py`` replays them) or offloaded (nothing runs
    again), not inside one checkpointed op-level (``inside_selective``)."""
    names = [*plan.activation_checkpointing, *plan.selective_checkpointing]
    twice = next((m for m in plan.selective_checkpointing if m in plan.activation_checkpointing), None)
    if twice is not None:
        raise PlannerError(f"'{twice}' is in both activation_checkpointing and selective_checkpointing; a module is "
                           "checkpointed one way")

    both = next((m for m in plan.activation_offloading if m in names), None)
    if both is not None:
        raise PlannerError(f"'{both}' is both checkpointed and in activation_offloading; a module's saved activations "
                           "are either recomputed or offloaded")
    names = [*names, *plan.activation_offloading]

    def field(m: str) -> str:  # the plan key that names ``m``, for the message
        if m in plan.activation_offloading:
            return "activation_offloading"
        return "selective_checkpointing" if m in plan.selective_checkpointing else "activation_checkpointing"

    unknown = [m for m in names if m not in trace.modules]
    if unknown:
        raise PlannerError(f"{field(unknown[0])} names modules the model does not have: {', '.join(unknown[:5])}")
    for m in names:
        if m == ROOT:
            raise PlannerError(f"{field(m)} cannot name the root module ''; name its blocks")
        if not trace.modules[m].calls:
            raise PlannerError(f"{field(m)} names '{m}', which the step never calls")
        outer = next((o for o in names if o != m and is_within(m, o)), None)
        if outer is not None:
            offloaded = {m, outer} & set(plan.activation_offloading)
            which = f"{field(outer)} names too" if offloaded else "is checkpointed too"
            raise PlannerError(f"{field(m)} names '{m}' inside '{outer}', which {which}; name one of them")
    inside_selective(plan)
    check_saved_topk(trace, plan.selective_checkpointing)
    offloaded_own = next(((m, own) for m in plan.activation_offloading if (own := own_overlap(trace, m))), None)
    if offloaded_own is not None:
        m, own = offloaded_own
        raise PlannerError(f"activation_offloading names '{m}', and the model checkpoints '{own}' itself "
                           "(torch.utils.checkpoint): offloading inside or around the model's own checkpoint is not "
                           "modelled (measured 13-51% off on 8 fake ranks); plan without --ac offload")


_TITAN_ROUTERS: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp_planner_titan_routers", default=False)


@contextlib.contextmanager
def titan_routers() -> Iterator[None]:
    """Inside, the traced model stands for torchtitan's (a ``--from-torchtitan`` job planned or simulated on
    transformers' modules of the same numbers): torchtitan's routers divide their top-k weights out of place, so its
    op-level checkpointing saving topk runs (``check_saved_topk`` refuses nothing)."""
    token = _TITAN_ROUTERS.set(True)
    try:
        yield
    finally:
        _TITAN_ROUTERS.reset(token)


def check_saved_topk(trace: Trace, selective: Mapping[str, SacPolicy]) -> None:
    """PlannerError where a module checkpointed op-level (``selective``: module -> policy) holds a router that
    modifies the topk outputs its policy saves (``modified_topk``)."""
    for m, policy in selective.items():
        if (router := modified_topk(trace, m, policy)) is not None:
            raise PlannerError(f"op-level checkpointing of '{m}': its '{router}' modifies its topk's outputs in place "
                               f"(the top-k weights divided in place, as transformers' MoE routers do), and the "
                               f"{policy.value} policy saves topk's outputs: torch.utils.checkpoint refuses a saved "
                               "tensor modified in place (\"Tensor cached during selective activation checkpoint has "
                               f"been mutated\"); checkpoint '{m}' in full, or op-level with --ac-policy titan-2025, "
                               "which saves no topk")


def modified_topk(trace: Trace, module: str, policy: SacPolicy) -> str | None:
    """The module inside ``module`` (or itself) whose ``topk`` outputs the step modifies in place, where ``policy``
    saves topk's outputs (op-level checkpointing of ``module`` then fails); None where none does, it saves none, or
    the model stands for torchtitan's (``titan_routers``)."""
    if OpClass.TOPK not in POLICIES[policy].saves or _TITAN_ROUTERS.get():
        return None
    memo = trace.index.memo  # (asked per block by auto's checkpointing search: the model's modules walked once)
    key = ("topk_modified",)
    if key not in memo:
        memo[key] = tuple(m for m, info in trace.modules.items() if info.topk_modified)
    return next((m for m in memo[key] if is_within(m, module)), None)


def own_overlap(trace: Trace, module: str) -> str | None:
    """A module call the model's own checkpoint holds that is ``module``, lies inside it or holds it, if any."""
    return next((c.module for c in trace.own_checkpointed
                 if is_within(c.module, module) or is_within(module, c.module)), None)


def inside_selective(plan: Plan) -> None:
    """PlannerError when an FSDP group lies inside a module checkpointed op-level. Real FSDP2 fails on some such
    plans: the inner groups' hooks run ops inside the region (``record_function`` among them), on some groupings
    not the same in the recomputation as in the forward, and SAC's cache, which matches the two by op and order,
    raises "invocation index ... encountered during backward but not found in storage" (measured on fake ranks:
    toy-llama with groups on each block's w1 and w3, or on every Linear; groups on attention and feed_forward ran).
    EP's expert groups are allowed: torchtitan shards each MoE layer's experts apart inside its op-level checkpointed
    blocks, and the planner makes such plans (transformers' Qwen3-MoE so verified on fake ranks, exact and +1.8%)."""
    ep = plan.expert_parallel
    experts = ep.modules if ep is not None else ()
    for m in plan.selective_checkpointing:
        inner = next((g for grp in plan.groups for g in grp.modules if g != m and is_within(g, m)
                      and not any(matches(pattern, g) for pattern in experts)), None)
        if inner is not None:
            raise PlannerError(f"selective_checkpointing names '{m}', which holds the FSDP group module '{inner}': "
                               "with FSDP2's hooks inside an op-level checkpointed region, real FSDP2 fails on some "
                               "groupings (SAC finds the recomputation's ops differ from the forward's); checkpoint "
                               f"'{m}' in full (activation_checkpointing) or group nothing inside it")


def early_stop(trace: Trace, fwd_pre: int, fwd_post: int) -> int:
    """Where the recomputation of a checkpointed call stops: just after the last event of its forward after which
    a tensor was packed for backward (non-reentrant checkpoint counts the tensors its forward packed and stops the
    recomputation once it has packed as many: torch's ``_StopRecomputationError``); its pre-forward when nothing
    was."""
    events = trace.events
    return next((i + 1 for i in range(fwd_post - 1, fwd_pre - 1, -1) if events[i].packs), fwd_pre)


def backward_calls(trace: Trace, module: str) -> list[tuple[int, int, int, int, int]]:
    """The calls of ``module`` that ran a backward (a call without one saves nothing to recompute), each as (call,
    and the positions of its pre-forward, post-forward, pre-backward and post-backward)."""
    pos: dict[tuple[EventKind, int], int] = {}
    for i in trace.index.boundaries_by_module.get(module, ()):
        pos.setdefault((trace.events[i].kind, trace.events[i].call), i)
    out = []
    for (kind, call), fwd_pre in pos.items():
        bwd_pre, bwd_post = pos.get((EventKind.BWD_PRE, call)), pos.get((EventKind.BWD_POST, call))
        if kind is EventKind.FWD_PRE and bwd_pre is not None and bwd_post is not None and bwd_pre <= bwd_post:
            out.append((call, fwd_pre, pos[(EventKind.FWD_POST, call)], bwd_pre, bwd_post))
    return out


def own_calls(trace: Trace, planned: Iterable[str]) -> list[OwnCall]:
    """The calls the model's own ``torch.utils.checkpoint`` holds (``Trace.own_checkpointed``), checkpointed in full,
    less those of a module the plan checkpoints (``planned``) or that lie inside one: the two checkpoints nest, and
    the plan's, the same module's or an outer one, is what holds their memory; but a call the model checkpoints
    reentrantly stays its own: reentrant checkpoint runs the forward without grad, so the plan's checkpoint of the
    same module inside it saves nothing (measured on 8 fake ranks: a DiT's blocks reentrant, the plan's --ac op on
    them, as without it). A plan's call that is one of these is the model's (``checkpointed_calls``)."""
    names = list(planned)
    return [c for c in trace.own_checkpointed
            if not any(is_within(c.module, n) and not (c.reentrant and c.module == n) for n in names)]


# One region of the model's own checkpointing as a checkpointed call: (its first module call, that call's number,
# the positions of the region's pre-forward, post-forward, pre-backward and post-backward, and whether reentrant)
OwnRegion = tuple[str, int, int, int, int, int, bool]


def own_regions(trace: Trace, calls: Iterable[OwnCall]) -> list[OwnRegion]:
    """The regions of ``calls``, each one checkpointed call from its first call's pre-forward to its last call's
    post-forward, and from the first pre-backward among them to the last post-backward: a ``checkpoint_sequential``
    segment keeps its input alone and runs all its calls again at its first unpack (its two calls checkpointed each
    on their own: -8.6% on 8 fake ranks). Calls that ran no backward are left out."""
    parts: dict[int, list[OwnRegion]] = {}
    for c in calls:
        for call, fwd_pre, fwd_post, bwd_pre, bwd_post in backward_calls(trace, c.module):
            if call == c.call:
                parts.setdefault(c.region, []).append((c.module, call, fwd_pre, fwd_post, bwd_pre, bwd_post,
                                                       c.reentrant))
    out = []
    for region in parts.values():
        first = min(region, key=lambda r: r[2])
        out.append((*first[:3], max(r[3] for r in region), min(r[4] for r in region), max(r[5] for r in region),
                    first[6]))
    return out


def recomputed_spans(trace: Trace, plan: Plan) -> dict[int, tuple[int, int]]:
    """Each checkpointed call whose forward runs again in its backward (in full or op-level, the plan's or a region
    of the model's own; not an offloaded one), by the position where that happens: the span of its forward events
    that runs again there, [its pre-forward, its early stop or, without, its post-forward). FSDP2's hooks of the
    groups that lie inside it run again in that span (``fsdp2/replay.py``). Computed once per trace and
    checkpointing (``TraceIndex.memo``): a search replays thousands of plans that checkpoint the same modules; not
    to be changed by the caller."""
    key = ("recomputed_spans", plan.activation_checkpointing, tuple(plan.selective_checkpointing),
           plan.activation_offloading, plan.checkpoint_early_stop)
    memo = trace.index.memo
    if key not in memo:
        memo[key] = _recomputed_spans(trace, key[1] + key[2], plan.activation_offloading, plan.checkpoint_early_stop)
    return memo[key]


def _recomputed_spans(trace: Trace, planned: tuple[str, ...], offloaded: tuple[str, ...], stops: bool
                      ) -> dict[int, tuple[int, int]]:
    """``stops``: the plan's checkpoints stop early (the model's own regions do, as torch's default)."""
    own = own_calls(trace, (*planned, *offloaded))
    mine = {(c.module, c.call) for c in own}
    calls = [(*b[1:], stops) for m in planned for b in backward_calls(trace, m) if (m, b[0]) not in mine]
    calls += [(*r[2:6], True) for r in own_regions(trace, own)]
    out = {}
    for fwd_pre, fwd_post, bwd_pre, bwd_post, stopping in calls:
        stop = early_stop(trace, fwd_pre, fwd_post)
        out[recomputed_at(trace, stop, fwd_post, bwd_pre, bwd_post)] = (fwd_pre, stop if stopping else fwd_post)
    return out


def recomputed_at(trace: Trace, stop: int, fwd_post: int, bwd_pre: int, bwd_post: int) -> int:
    """Where a checkpointed call's forward runs again: when its backward first unpacks a saved tensor. The backward
    of the ops after its last pack unpacks nothing, so the pre-backward hooks of the calls inside it that ended
    after that pack (a Llama block's MLP, whose output only the residual add reads) run first: the position of
    the last of them, else the call's own pre-backward."""
    events = trace.events
    ended = {(events[i].module, events[i].call) for i in range(stop, fwd_post) if events[i].kind is EventKind.FWD_POST}
    return max((i for i in range(bwd_pre, bwd_post) if events[i].kind is EventKind.BWD_PRE
                and (events[i].module, events[i].call) in ended), default=bwd_pre)


def apply_checkpointing(model: nn.Module, names: list[str], selective: Mapping[str, SacPolicy] | None = None,
                        compiled: Collection[str] = (), early_stop: bool = True) -> None:
    """Checkpoint each named module in place, names unchanged (no ``checkpoint_wrapper``, which would rename the
    module's params); before ``fully_shard``. Full: the composable ``checkpoint`` hooks, except on the modules
    that will be ``compiled``. Op-level (``selective``), and full on a compiled module: the module's forward runs
    under ``torch.utils.checkpoint`` (with SAC's ``context_fn``; ``_checkpoint_forward``), which torch.compile
    then traces into the module's graph, as it traces torchtitan's ``checkpoint_wrapper``: AOTAutograd's
    partitioner recomputes in backward what backward reads. Hooks outside the compiled forward would recompute
    the whole compiled graph, which no early stop can cut short: on one H200 each Llama 3 70B block at TP 8 ran its
    last Linear and reduce-scatter again (32 calls of the largest GEMM a step against eager's 28;
    ``benchmarks/gpu_2d.md``). ``early_stop``: torch's (False: each recomputation runs the whole forward, as
    torchtitan's checkpoint wrapper does)."""
    from torch.distributed._composable import checkpoint

    modules = dict(model.named_modules())
    how: dict[str, SacPolicy | None] = {**dict.fromkeys(names), **(selective or {})}
    for name, policy in how.items():
        if name not in modules:
            key = "activation_checkpointing" if policy is None else "selective_checkpointing"
            raise PlannerError(f"{key} names a module the model does not have: '{printable_name(name)}'")
        modules[name].register_forward_pre_hook(_without_cache, with_kwargs=True)  # before checkpoint's hooks
        if policy is None and name not in compiled:
            checkpoint(modules[name], early_stop=early_stop)
        else:
            _checkpoint_forward(modules[name], policy, early_stop)


# The keyword arguments through which a Hugging Face layer writes its KV cache (names differ by model and version).
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """A checkpointed layer writes no KV cache: the recomputed forward would write it a second time (Gemma 2's
    mask then disagrees with the keys, T5's checkpoint saves a different number of tensors). What transformers'
    own ``GradientCheckpointingLayer`` does: ``use_cache=False`` and no cache for this call, unless the layer only
    reads the cache (``_can_checkpoint_with_cache``). Other modules' calls are left as they are."""
    if not kwargs or not torch.is_grad_enabled():
        return None
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(module, "_can_checkpoint_with_cache", False):
        for key in CACHE_KWARGS:
            if changed.get(key) is not None:
                changed[key] = None
    return (args, changed) if changed != kwargs else None


def apply_offloading(model: nn.Module, names: list[str]) -> None:
    """Run each named module's forward under ``save_on_cpu`` (module docstring), names unchanged; before
    ``fully_shard``, so FSDP2's hooks stay outside it. Pinned host memory where CUDA is there to pin it for."""
    modules = dict(model.named_modules())
    unknown = next((n for n in names if n not in modules), None)
    if unknown is not None:
        raise PlannerError(f"activation_offloading names a module the model does not have: "
                           f"'{printable_name(unknown)}'")
    for name in names:
        _offload_forward(modules[name])


def _offload_forward(module: nn.Module) -> None:
    """Set the instance's ``forward`` to run the original one under ``save_on_cpu``."""
    import torch
    from torch.autograd.graph import save_on_cpu

    forward = module.forward
    pin = torch.cuda.is_available()

    def offloaded(*args: object, **kwargs: object) -> object:
        with save_on_cpu(pin_memory=pin):
            return forward(*args, **kwargs)

    module.forward = offloaded  # type: ignore[method-assign]


def _checkpoint_forward(module: nn.Module, policy: SacPolicy | None, early_stop: bool = True) -> None:
    """Run ``module``'s forward under non-reentrant ``torch.utils.checkpoint`` with ``policy``'s SAC context (None:
    in full), as torchtitan's ``checkpoint_wrapper`` does, by setting the instance's ``forward``. Not the composable
    ``checkpoint`` with ``context_fn``: its recomputation calls the module with its hooks, so FSDP2's pre-forward
    (its ``record_function`` on casting inputs under mixed precision) runs inside SAC's replay but ran outside the
    caching forward, and SAC refuses the unknown op. Here FSDP2's hooks stay outside both."""
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    forward = module.forward
    # in full: no context_fn at all (torch.compile traces checkpoint's own default, not one passed in)
    extra = {} if policy is None else {"context_fn": sac_context_fn(policy, router=router_shapes(
        (name, tuple(p.shape)) for name, p in module.named_parameters()))}

    def checkpointed(*args: object, **kwargs: object) -> object:
        return run_checkpointed(forward, *args, use_reentrant=False, early_stop=early_stop, **extra, **kwargs)

    module.forward = checkpointed  # type: ignore[method-assign]
