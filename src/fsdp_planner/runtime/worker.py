"""One rank of a verify job, run under torchrun as ``__main__`` with JOB.json (``launch.rank_command``).

Every rank builds the same model, keeps an unsharded reference copy, applies the plan with FSDP2 and trains K
steps on its own micro-batch while the reference trains on all ranks' micro-batches (loss divided by the world
size, as FSDP averages gradients), both with SGD (momentum 0.9) and in the job's precision (FSDP2's
``MixedPrecisionPolicy``; the unsharded reference casts as FSDP2 does, ``fsdp2_casts``); then times the sharded
model's steps alone (``time_steps``). With tensor parallelism the ranks of a TP group (consecutive) share one
micro-batch, the data-parallel ranks are world / TP, and each loss runs under ``loss_parallel()`` when the plan
asks for it; the params are compared whole (``full_tensor``). With expert parallelism the plan is applied by
``apply_plan`` (the experts over ``ep`` with gloo's all-to-all, FSDP over the EP-reduced mesh); each rank
keeps its own micro-batch. Collectives are counted by wrapping the
``torch.distributed`` functions FSDP2 calls (TP's own, through DTensor's functional collectives, are not among
them). Rank 0 writes the results as JSON; ``rank.run_rank`` starts and ends the rank and reports a failure. Before
sharding, the ranks check that they build the same model and apply the same plan (a rank that differs would issue
other collectives: a hang or garbage, not an error). The job may start from a distributed checkpoint and save one
(``checkpoint.py``); the data of step s is the same whatever run reaches it.

Test-only fault injection (never set it otherwise; ``rank.injected_fault``): ``FSDP_PLANNER_TEST_FAULT=kill:R``
makes rank R SIGKILL itself at the start of step 1 (its peers are then in a collective); ``plan:R`` makes rank R
apply the plan with its first group's ``reshard_after_forward`` flipped.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import inspect
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fsdp_planner.apply.float8 import after_optimizer_step, apply_float8, float8_module
from fsdp_planner.apply.fully_shard import apply_plan, device_mesh
from fsdp_planner.apply.policies import plan_policies
from fsdp_planner.apply.tensor_parallel import data_rank, loss_context
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import mixed_precision
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.patching import patched
from fsdp_planner.runtime.checkpoint import load_checkpoint, save_checkpoint
from fsdp_planner.runtime.rank import injected_fault, run_rank
from fsdp_planner.sim.options import precision_named
from fsdp_planner.trace.full_precision import full_precision_casts, subtree_params
from fsdp_planner.trace.recorder import default_loss, split_inputs
from fsdp_planner.trace.walk import model_fingerprint
from fsdp_planner.userfiles import WRITTEN_BY

MOMENTUM = 0.9  # SGD with momentum: an optimizer with state, which a checkpoint must carry across world sizes

_COUNTED = {
    "all_gather_single": CollectiveKind.ALL_GATHER,
    "all_gather_into_tensor": CollectiveKind.ALL_GATHER,
    "reduce_scatter_single": CollectiveKind.REDUCE_SCATTER,
    "reduce_scatter_tensor": CollectiveKind.REDUCE_SCATTER,
    "all_reduce": CollectiveKind.ALL_REDUCE,  # HSDP's grads across replicas (FSDP2's foreach_reduce)
}

Counts = dict[str, int]  # collective kind's value -> count or bytes
Casts = Callable[[], contextlib.AbstractContextManager[None]]  # a context a reference micro-batch runs in


class CollectiveCounter:
    """Counts FSDP2's collectives by wrapping the ``torch.distributed`` functions it calls (outermost only)."""

    def __init__(self) -> None:
        self.counts: Counts = dict.fromkeys((k.value for k in CollectiveKind), 0)
        self.nbytes: Counts = dict.fromkeys((k.value for k in CollectiveKind), 0)
        self._undo = contextlib.ExitStack()  # the wrapped functions, put back by __exit__
        self._local = threading.local()

    def _wrap(self, kind: CollectiveKind, fn: Callable[..., Any]) -> Callable[..., Any]:
        # nccl-tests' size: the unsharded side (all-gather output, reduce-scatter input), an all-reduce's buffer
        signature = inspect.signature(fn)
        counted = list(signature.parameters)[1 if kind is CollectiveKind.REDUCE_SCATTER else 0]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.counts[kind.value] += 1
                full = signature.bind(*args, **kwargs).arguments[counted]
                self.nbytes[kind.value] += full.numel() * full.element_size()
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper

    def __enter__(self) -> CollectiveCounter:
        # every function wrapped or none: a failure half-way puts back the ones already wrapped (``patching.py``)
        with contextlib.ExitStack() as stack:
            for name, kind in _COUNTED.items():
                if hasattr(dist, name):
                    stack.enter_context(patched(dist, name, self._wrap(kind, getattr(dist, name))))
            self._undo = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._undo.close()

    def take(self) -> tuple[Counts, Counts]:
        out = dict(self.counts), dict(self.nbytes)
        self.counts = dict.fromkeys(self.counts, 0)
        self.nbytes = dict.fromkeys(self.nbytes, 0)
        return out


def batch(spec: ModelSpec, step: int, rank: int, base_seed: int, micro: int = 0
          ) -> tuple[Any, Callable[[Any], torch.Tensor]]:
    """Micro-batch ``micro`` for (step, rank): the factory's example inputs and loss, drawn under a fixed seed (the
    same in every run that reaches that step)."""
    lm = load_model(spec, meta=False, seed=base_seed + 1000 * (step + 1) + rank + MICRO_SEED_STRIDE * micro)
    loss = lm.loss_fn or default_loss
    return lm.example_inputs, torch.compile(loss) if spec.compile_loss else loss  # (--compile-loss: as planned)


MICRO_SEED_STRIDE = 7919  # a prime: micro-batch m of a step draws from its own seed, micro-batch 0 as without them


def call_model(model: torch.nn.Module, inputs: Any, device: torch.device) -> Any:
    """The model on one batch, moved to ``device`` (the example inputs' tuple or dict form)."""
    args, kwargs = split_inputs(tree_map_only(torch.Tensor, lambda t: t.to(device), inputs))
    return model(*args, **kwargs)


class RankBuffers:
    """Each data-parallel rank's own buffers, for the one-process reference: FSDP2 syncs no buffer, so a buffer the
    forward changes (a count of calls, running stats) moves on each rank with its own batches alone, while the
    reference runs every rank's batches through one model; it runs each rank's with that rank's buffers swapped in
    (a buffer counting forward calls advanced twice a step on 2 ranks: a parity FAIL FSDP2 did not cause, a
    trial's), and holds rank 0's between steps (what rank 0's sharded model holds, and saves)."""

    def __init__(self, model: torch.nn.Module, ranks: int) -> None:
        self.modules = dict(model.named_modules())
        live = [((m, k), b) for m, mod in self.modules.items() for k, b in mod._buffers.items() if b is not None]
        self.saved = []
        for _ in range(ranks):  # one copy of each tensor: a buffer two modules register stays one (a review's case)
            copies: dict[int, torch.Tensor] = {}
            self.saved.append({key: copies.setdefault(id(b), b.detach().clone()) for key, b in live})

    def install(self, rank: int) -> None:
        """Rank ``rank``'s buffers into the model (the tensors themselves: what its micro-batches change)."""
        for (m, k), b in self.saved[rank].items():
            self.modules[m]._buffers[k] = b

    def keep(self, rank: int) -> None:
        """What the model's buffers are now, as rank ``rank``'s (a forward may have replaced one)."""
        self.saved[rank] = {(m, k): self.modules[m]._buffers[k] for m, k in self.saved[rank]}


def reference_step(reference: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   batches: list[list[tuple[Any, Any]]], step: int, seed: int, device: torch.device,
                   precision: Casts = contextlib.nullcontext, buffers: RankBuffers | None = None) -> float:
    """One step of unsharded training on every rank's micro-batches (``batches[rank][micro]``; losses over the
    world size, as FSDP averages grads, and over the micro-batches, as the sharded loop scales them); the global
    loss. What a run on one process does, uninterrupted, for the same data; each micro-batch inside ``precision``
    (``fsdp2_casts``: as FSDP2's mixed precision runs it), each rank's with its own ``buffers``."""
    total = 0.0
    for r, micro_batches in enumerate(batches):
        if buffers is not None:
            buffers.install(r)
        for inputs, loss_fn in micro_batches:
            torch.manual_seed(seed + 7 * step + r)
            with precision():
                loss = loss_fn(call_model(reference, inputs, device)) / (len(batches) * len(micro_batches))
                loss.backward()
            total += loss.item()
        if buffers is not None:
            buffers.keep(r)
    if buffers is not None:
        buffers.install(0)
    optimizer.step()
    optimizer.zero_grad()
    return total


def train_steps(job: dict, model: torch.nn.Module, reference: torch.nn.Module, opt: torch.optim.Optimizer,
                ref_opt: torch.optim.Optimizer, device: torch.device, rank: int, world: int,
                counting: Callable[[CollectiveCounter], Any] = contextlib.nullcontext,
                precision: Casts = contextlib.nullcontext, tp: int = 1,
                loss_context: Casts = contextlib.nullcontext,
                after_step: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """K steps of the sharded model (FSDP2 or FSDP1) and, on rank 0, the unsharded reference on the same data: the
    collectives counted per step (``counting``: more the counter must see) and the global batch's losses of both
    (the reference's micro-batches inside ``precision``; rank 0's alone: it is the rank that reports and saves the
    reference, and each other rank would repeat its training of the whole global batch, the world size times its
    own step's work, for nothing). With ``tp`` ranks in a tensor-parallel group (consecutive
    ranks) the group shares one batch: the data-parallel ranks are ``world / tp``; each loss and its backward run
    inside ``loss_context`` (loss parallel). ``after_step``: what runs after each optimizer step of the sharded
    model (float8's precomputed scales)."""
    counted, counted_bytes, losses, ref_losses = [], [], [], []
    counter = CollectiveCounter()
    buffers = RankBuffers(reference, world // tp) if rank == 0 else None
    start = job.get("start_step", 0)
    for step in range(start, start + job["steps"]):
        if injected_fault(rank) == "kill" and step == start + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        micro = job.get("micro_batches", 1)
        batches = [[batch(ModelSpec.from_json(job["model"]), step, r, job["seed"], m) for m in range(micro)]
                   for r in range(world // tp)]
        with counter, counting(counter):
            loss = accumulate(model, batches[rank // tp], job["seed"] + 7 * step + rank // tp, device,
                              job.get("reshard_after_backward", True), job.get("gradient_sync", "last") == "every",
                              loss_context)
        c, b = counter.take()
        counted.append(c)
        counted_bytes.append(b)
        opt.step()
        opt.zero_grad()
        after_step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            ref_losses.append(reference_step(reference, ref_opt, batches, step, job["seed"], device, precision,
                                             buffers))
    return {"counted": counted, "counted_bytes": counted_bytes, "losses": losses, "reference_losses": ref_losses}


def accumulate(model: torch.nn.Module, micro_batches: list[tuple[Any, Any]], seed: int, device: torch.device,
               reshard_after_backward: bool = True, sync_every: bool = False,
               loss_context: Casts = contextlib.nullcontext) -> torch.Tensor:
    """Forward + backward of each micro-batch, losses scaled by their count; with more than one, FSDP2's gradient
    sync only on the last (``set_requires_gradient_sync``: the reduce-scatters run in its backward) unless
    ``sync_every`` (each backward reduce-scatters into the sharded grads, as torchtitan's train_step), and with
    ``reshard_after_backward`` False the params kept gathered until it (``set_reshard_after_backward``). Each loss
    and its backward inside ``loss_context`` (loss parallel: the loss is then a replicated DTensor). The mean
    loss."""
    total = torch.zeros((), device=device)
    for m, (inputs, loss_fn) in enumerate(micro_batches):
        if len(micro_batches) > 1:
            model.set_requires_gradient_sync(sync_every or m == len(micro_batches) - 1)  # type: ignore[operator]
            if not reshard_after_backward:
                model.set_reshard_after_backward(m == len(micro_batches) - 1)  # type: ignore[operator]
        torch.manual_seed(seed)
        with loss_context():
            loss = loss_fn(call_model(model, inputs, device)) / len(micro_batches)
            loss.backward()
        total += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
    return total


def _train(job: dict, model: torch.nn.Module, reference: torch.nn.Module, opt: torch.optim.Optimizer,
           ref_opt: torch.optim.Optimizer, device: torch.device, rank: int, world: int,
           policy: MixedPrecisionPolicy, plan: Plan) -> dict[str, Any]:
    """K steps of the FSDP2 model (under ``policy``) beside the reference, then parity (on rank 0, which trained
    the reference; every rank gathers the params); what rank 0 reports."""
    before = fingerprints(reference) if rank == 0 else []
    result = train_steps(job, model, reference, opt, ref_opt, device, rank, world,
                         precision=fsdp2_casts(reference, plan, policy), tp=plan.tp_degree,
                         loss_context=functools.partial(loss_context, plan),
                         after_step=functools.partial(after_optimizer_step, model, plan.float8))
    ref_params = dict(reference.named_parameters())
    fulls = [(name, p.full_tensor() if hasattr(p, "full_tensor") else p) for name, p in model.named_parameters()]
    compute = policy.param_dtype or policy.reduce_dtype  # a bf16 reduce bounds it too
    pairs = [(name, full, ref_params[name]) for name, full in fulls]
    copies = replicas(fulls) if plan.tp_degree > 1 else {}
    if rank != 0:
        return result
    return {**result, **parity(pairs, compute), **copies, "params_changed": params_changed(before, reference)}


def fsdp2_casts(reference: torch.nn.Module, plan: Plan, policy: MixedPrecisionPolicy) -> Casts:
    """How the unsharded reference runs a micro-batch as FSDP2 runs the sharded model under ``policy``: params in
    the compute dtype, each group's modules casting their floating inputs to it (``cast_forward_inputs``), grads
    cast to the reduce dtype and accumulated in the params' own. No casts without a compute dtype."""
    if policy.param_dtype is None:
        return contextlib.nullcontext
    modules = list(dict.fromkeys(reference.get_submodule(m) for g in plan.groups for m in g.modules
                                 if g.param_dtype != "fp32"))
    full = tuple(m for g in plan.groups if g.param_dtype == "fp32" for m in g.modules)  # fp32 groups' modules
    reduce = policy.reduce_dtype or policy.param_dtype
    return functools.partial(_in_compute_dtype, reference, modules, policy.param_dtype, reduce, full,
                             float8_gathered(reference, plan))


def float8_gathered(reference: torch.nn.Module, plan: Plan) -> frozenset[int]:
    """The float8 Linears' weights FSDP2 all-gathers in float8 (``fsdp_float8_all_gather``): cast from the fp32
    shard straight to float8, never to the compute dtype first, so the reference keeps them in fp32 and its
    Float8Linear casts them as the all-gather did (cast to bf16 first, they rounded twice: a trial's LM 1.46x its
    bound off, its losses apart from step 0)."""
    if plan.float8 is None or not plan.float8.fsdp_float8_all_gather:
        return frozenset()
    linear = float8_module().float8_linear.Float8Linear
    return frozenset(id(m.weight) for m in reference.modules() if isinstance(m, linear))


@contextlib.contextmanager
def _in_compute_dtype(model: torch.nn.Module, modules: list[torch.nn.Module], compute: torch.dtype,
                      reduce: torch.dtype, full: tuple[str, ...] = (), float8: frozenset[int] = frozenset()
                      ) -> Iterator[None]:
    """One micro-batch of ``model`` in ``compute`` (``fsdp2_casts``), the ``full`` modules in fp32 as their fp32
    groups run them (``full_precision_casts``) and the ``float8`` weights (ids) in their own dtype, which FSDP2
    casts to float8 whole (``float8_gathered``); its grads then join the params' own. Not mirrored: the casts FSDP2
    also makes for a group's registered non-forward methods (``plan.forward_methods``)."""
    kept = [(p, p.data, p.grad) for p in dict.fromkeys(model.parameters()) if p.is_floating_point()]
    in_fp32 = subtree_params(dict(model.named_modules()), full) | float8

    def cast(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tree_map_only(torch.Tensor, lambda t: t.to(compute) if t.is_floating_point() else t, (args, kwargs))

    hooks = [m.register_forward_pre_hook(cast, with_kwargs=True) for m in modules]
    try:
        for p, data, _ in kept:
            p.grad = None  # a grad of the params' dtype cannot sit on a param of the compute dtype
            p.data = data if id(p) in in_fp32 else data.to(compute)
        with full_precision_casts(dict(model.named_modules()), full, compute):
            yield
    finally:
        for h in hooks:
            h.remove()
        for p, data, grad in kept:
            new, p.grad = p.grad, None
            p.data = data
            if new is not None:  # FSDP2: reduced in the reduce dtype, accumulated in the sharded param's
                new = new.to(reduce).to(data.dtype)
            p.grad = new if grad is None else grad if new is None else grad + new


FP32_TOLERANCE = 1e-5  # params of 32 bits or more: a few roundings of fp32 over a few steps
LOW_PRECISION_ULPS = 4  # 16-bit params: grads reduced in another order round to a neighbouring value
LOW_PRECISION_SCALE = 1 / 16  # ... and a small param (a bias) moves by updates the size of its neighbours'


def allowed_diff(reference: torch.Tensor, eps: float | None) -> float:
    """How far a param may be from the unsharded reference's: ``FP32_TOLERANCE`` in an fp32 model; where the model
    trains 16-bit params (``eps``, their precision), what they compute carries their rounding into every param: a
    few steps of that precision at the param's scale, at least ``LOW_PRECISION_SCALE`` (one bf16 step at 0.2 is
    1e-3, a hundred times fp32's bound)."""
    if eps is None:
        return FP32_TOLERANCE
    scale = max(reference.detach().abs().max().item() if reference.numel() else 0.0, LOW_PRECISION_SCALE)
    return max(FP32_TOLERANCE, LOW_PRECISION_ULPS * eps * scale)


def _coarsest(pairs: list, compute: torch.dtype | None) -> torch.dtype | None:
    """The 16-bit dtype the parity bound comes from: the params' own, or the ``compute`` dtype of a mixed
    precision; None for fp32's."""
    low = {r.dtype for _, _, r in pairs if r.requires_grad and r.is_floating_point() and r.element_size() < 4}
    if compute is not None and compute.itemsize < 4:
        low.add(compute)  # computing in 16 bits rounds every activation and grad to them
    return max(low, key=lambda d: torch.finfo(d).eps, default=None)


REPLICA_ULPS = 4  # what the ranks' copies of one param may differ by, in steps of its own dtype at its scale: a
# param whole on every TP rank trains on the same all-reduced grads there, in any compute precision (on CPU the
# copies are bitwise equal); one whose grad misses the other ranks' share (a module every rank's heads read, left
# whole) drifts by its share of the update, which the parity bound need not see (a tiny DeepSeek-V3's MLA key at
# lr 0.05: 3.6e-6 apart after three steps, below fp32's 1e-5 and bf16-mixed's bound)


def replica_bound(param: torch.Tensor) -> float:
    """How far apart the ranks' copies of ``param`` may be (``REPLICA_ULPS``)."""
    largest = param.detach().abs().max().item() if param.numel() else 0.0
    scale = max(largest, LOW_PRECISION_SCALE) if math.isfinite(largest) else LOW_PRECISION_SCALE
    return REPLICA_ULPS * torch.finfo(param.dtype).eps * scale


def replicas(fulls: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """How far apart the ranks' copies of each gathered param are (the largest elementwise max minus min over
    all ranks: two all-reduces a param, every rank calls it), and the worst param in units of its
    ``replica_bound`` (above 1 fails)."""
    spread, error, worst = 0.0, 0.0, ""
    for name, full in fulls:
        if not full.is_floating_point():
            continue
        hi = full.detach().to(torch.float32).clone()
        lo = hi.clone()
        # a non-finite value on any rank (gloo's MAX and MIN pass a NaN by): the copies cannot be compared
        broken = torch.tensor([0.0 if bool(torch.isfinite(hi).all()) else 1.0], device=hi.device)
        for t, op in ((hi, dist.ReduceOp.MAX), (lo, dist.ReduceOp.MIN), (broken, dist.ReduceOp.MAX)):
            dist.all_reduce(t, op)
        diff = math.inf if broken.item() else (hi - lo).max().item() if hi.numel() else 0.0
        spread = max(spread, diff)
        ratio = diff / replica_bound(full) if math.isfinite(diff) else math.inf
        if ratio > error:
            error, worst = ratio, name
    return {"replica_diff": spread, "replica_error": error, "replica_param": worst}


def fingerprints(module: torch.nn.Module) -> list[torch.Tensor]:
    """Each param's sum and sum of squares in float64: whether training changed it (``params_changed``), without a
    copy of the model."""
    with torch.no_grad():
        return [torch.stack((p.double().sum(), p.double().square().sum())) for p in module.parameters()]


def params_changed(before: list[torch.Tensor], module: torch.nn.Module) -> int:
    """The params of ``module`` whose ``fingerprints`` differ from ``before``: a run that changed none (every
    gradient zero) has parity whatever the plan does, which verify says rather than takes as proof."""
    return sum(1 for b, a in zip(before, fingerprints(module), strict=True) if not torch.equal(b, a))


def parity(pairs: Any, compute: torch.dtype | None = None) -> dict[str, Any]:
    """(name, trained param, reference param) triples: the largest absolute difference, and the worst param in
    units of what it may differ by (``allowed_diff``; above 1 fails), and the 16-bit dtype that bound comes from
    (``bound``: the params' own, or the ``compute`` dtype of a mixed precision; "" for fp32's). NaN (a diverged
    run) proves no parity."""
    pairs = list(pairs)
    coarsest = _coarsest(pairs, compute)
    eps = torch.finfo(coarsest).eps if coarsest is not None else None
    max_diff, error, worst = 0.0, 0.0, ""
    for name, trained, reference in pairs:
        diff = (trained.detach() - reference.detach()).abs().max().item() if trained.numel() else 0.0
        diff = diff if diff == diff else math.inf
        max_diff = max(max_diff, diff)
        ratio = diff / allowed_diff(reference, eps)
        if ratio > error:
            error, worst = ratio, name
    return {"max_abs_diff": max_diff, "param_error": error, "worst_param": worst,
            "bound": str(coarsest).removeprefix("torch.") if coarsest is not None else ""}


def time_steps(model: torch.nn.Module, micro_batches: list[tuple[Any, Any]], device: torch.device,
               steps: int, reshard_after_backward: bool = True, sync_every: bool = False,
               loss_context: Casts = contextlib.nullcontext) -> list[float]:
    """Seconds of ``steps`` forward + loss + backward steps (of each micro-batch, ``accumulate``) of the sharded
    model alone, back to back on one batch
    (grads set to None between them, as ``zero_grad()`` does), in PyTorch's default (not deterministic) mode: a
    training loop's steps, without the reference's training or the next batch's making in between. The ranks start
    each step together (a barrier), so its time is the step's, not a wait for a peer."""

    # as a training job runs: the parity check's deterministic mode also fills every new tensor (FSDP2's buffers)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        return _timed_steps(model, micro_batches, device, steps, reshard_after_backward, sync_every, loss_context)
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)


def _timed_steps(model: torch.nn.Module, micro_batches: list[tuple[Any, Any]], device: torch.device,
                 steps: int, reshard_after_backward: bool, sync_every: bool, loss_context: Casts) -> list[float]:
    seconds = []
    for _ in range(steps + 1 if steps else 0):  # the first one untimed: it follows other work (warm-up)
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        accumulate(model, micro_batches, 0, device, reshard_after_backward, sync_every, loss_context)
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return seconds[1:]


PROFILED_STEPS = 3  # steps a --profile trace holds (after one warm-up step the profiler records nothing of)


def profile_steps(model: torch.nn.Module, micro_batches: list[tuple[Any, Any]], device: torch.device, out: Path,
                  reshard_after_backward: bool = True, sync_every: bool = False,
                  loss_context: Casts = contextlib.nullcontext) -> None:
    """``PROFILED_STEPS`` steps as ``time_steps`` runs them, under torch.profiler (CPU ops, and CUDA kernels on a
    GPU; shapes for the ops' sizes), each in its ``ProfilerStep#`` range, written as a Chrome trace to ``out``:
    what ``calibrate --trace`` reads. Apart from the timed steps: the profiler slows every op it records.
    Beside it, ``rankR.cpu.json``: each profiled step's wall and process CPU seconds (all the rank's threads): on a
    shared host a step the OS gave less of the CPU shows as a lower share of CPU to wall."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    wall, cpu = [], []
    try:
        with profile(activities=activities, record_shapes=True,
                     schedule=schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)) as prof:
            for _ in range(PROFILED_STEPS + 1):
                started = (time.perf_counter(), time.process_time())
                dist.barrier()
                accumulate(model, micro_batches, 0, device, reshard_after_backward, sync_every, loss_context)
                _synchronize(device)
                model.zero_grad(set_to_none=True)
                wall.append(time.perf_counter() - started[0])  # before prof.step(): the last one stops the profiler
                cpu.append(time.process_time() - started[1])
                prof.step()
        prof.export_chrome_trace(str(out))
        out.with_suffix(".cpu.json").write_text(json.dumps({"written_by": WRITTEN_BY, "wall": wall[1:],
                                                            "cpu": cpu[1:]}))  # [0]: warm-up
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_same_job(model: torch.nn.Module, plan: Plan, world: int) -> str:
    """Every rank must build the same model and apply the same plan; name the ranks that do not (as rank 0).
    Returns the model's fingerprint."""
    mine = (model_fingerprint(model), repr(plan.signature()))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    for what, i in (("model", 0), ("plan", 1)):
        differ = [r for r, theirs in enumerate(everyone) if theirs[i] != everyone[0][i]]
        if differ:
            ranks = ", ".join(map(str, differ))
            raise RuntimeError(f"rank{'s' if len(differ) > 1 else ''} {ranks} {'have' if len(differ) > 1 else 'has'}"
                               f" a different {what} than rank 0 (every rank must build the same model and apply "
                               "the same plan)")
    return mine[0]


def build_job(job: dict, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module, Plan]:
    """The job's model on ``device`` (seeded: every rank builds the same), an unsharded copy as the reference, and
    the plan."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = load_model(ModelSpec.from_json(job["model"]), meta=False, seed=job["seed"]).model.to(device)
    return model, copy.deepcopy(model), Plan.from_json(job["plan"])


def _run(job: dict, device: torch.device, rank: int, world: int) -> None:
    """The job on this rank: train beside the reference, check, checkpoint, time; rank 0 writes the result."""
    model, reference, plan = build_job(job, device)
    if plan.float8 is not None:  # a float8 reference: the same Linears in float8, no FSDP2 to all-gather them
        apply_float8(reference, dataclasses.replace(plan.float8, fsdp_float8_all_gather=False,
                                                    precompute_scale=False))
    if injected_fault(rank) == "plan":
        plan = plan.with_group(0, reshard_after_forward=not plan.groups[0].reshard_after_forward)
    fingerprint = _check_same_job(model, plan, world)
    policy = mixed_precision(precision_named(job.get("precision", "fp32")), model)
    policy = plan_policies(plan, policy, None)[0]  # with the plan's reduce dtype, which the reference mirrors
    # with EP, apply_plan puts the experts over ep and their EP-reduced FSDP mesh, the rest over all
    apply_plan(model, plan, mesh=device_mesh(plan, device.type, world), mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=job["lr"], momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=job["lr"], momentum=MOMENTUM)
    loaded = load_checkpoint(Path(job["load"]), model, opt, reference, ref_opt) if job.get("load") else None
    result = _train(job, model, reference, opt, ref_opt, device, rank, world, policy, plan)
    if job.get("save"):
        step = job.get("start_step", 0) + job["steps"]
        save_checkpoint(Path(job["save"]), model, opt, reference, ref_opt,
                        {"step": step, "world": world, "policy": plan.policy, "model": job["model"],
                         "fingerprint": fingerprint, "seed": job["seed"], "lr": job["lr"]})
    # timed last, with the reference and the optimizers gone: what stays in memory is what a training job keeps
    del reference, opt, ref_opt
    gc.collect()
    micro = [batch(ModelSpec.from_json(job["model"]), job.get("start_step", 0), data_rank(plan, rank), job["seed"],
                   m) for m in range(job.get("micro_batches", 1))]
    result["step_seconds"] = time_steps(model, micro, device, job.get("timed_steps", 0),
                                        job.get("reshard_after_backward", True),
                                        job.get("gradient_sync", "last") == "every",
                                        functools.partial(loss_context, plan))
    if job.get("profile"):
        profile_steps(model, micro, device, Path(job["profile"]) / f"rank{rank}.json",
                      job.get("reshard_after_backward", True), job.get("gradient_sync", "last") == "every",
                      functools.partial(loss_context, plan))
    if rank == 0:
        Path(job["result"]).write_text(json.dumps({**result, "backend": dist.get_backend(), "world": world,
                                                   "loaded": loaded}))
    dist.barrier()


if __name__ == "__main__":
    run_rank(sys.argv[1], _run)
