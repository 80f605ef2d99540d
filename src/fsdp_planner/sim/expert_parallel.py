"""A step of a plan with expert parallelism, as one EP rank runs it: the data-parallel simulation of a per-rank view.

As for tensor parallelism (``tensor_parallel.py``), ``ep_view`` turns the traced step of the whole model into one
rank's step (``EPView``), and the rest of the simulator runs FSDP2 on it:

- params: each expert module's grouped params hold E / EP experts (dim 0 / EP: ``Shard(0)`` over ``ep``); FSDP2
  shards them again over the EP-reduced mesh (dp_shard / EP ranks, EP apart: ``Trace.expert_params``, which
  ``sizing.py`` divides by that many ranks and ``SimContext.cost`` prices on that group); the other params as
  without EP, over the whole data-parallel mesh;
- ops: with balanced routing (the routing stand-in's, ``routing.py``) each rank's E / EP experts process the tokens
  all EP ranks route to them: E / EP x EP x (routed rows / E), the same rows as the whole model's trace gives one
  rank, so the expert ops keep their FLOPs and activations; under a ``skew`` the busiest rank's experts process
  ``skew`` times that, and the step is that rank's;
- EP's all-to-alls, as ops of the compute stream (the experts wait for their tokens; ``KERNEL_EP_ALL_TO_ALL``): the
  dispatch after the expert module's pre-forward (FSDP2's hook is prepended to ``ExpertParallel``'s input hook) and
  the combine before its post-forward, or, for an experts layer that routes inside its forward (transformers'),
  around the ops that read its params (``_forward_at``); in backward the combine's gradient after the pre-backward
  and the dispatch's before the post-backward. Each moves one rank's routed rows x dim (``Event.nbytes``: its send
  buffer, as nccl-tests sizes an all-to-all), costed on the EP group (consecutive ranks: ``hardware/all_to_all.py``) at
  ``skew`` times the bytes (the busiest rank receives that much). Under activation checkpointing the forward ones
  run again with the recomputation, except under op-level checkpointing whose policy saves their outputs
  (torchtitan's of 2026: ``fsdp2/selective.py``), which keeps what they received instead.

With tensor parallelism (torchtitan's expert TP of 1), the EP view is taken of one TP rank's view
(``tensor_parallel.tp_view``): EP's ranks are dp_shard ranks x TP ranks (consecutive), each TP rank dispatching
its 1/TP of the routed tokens (``TPStyle.TOKEN_SPLIT``: the TP view's expert ops already run on that share), so
EP takes EP / TP ranks of dp_shard (``Trace.ep_shard_degree``), the experts are FSDP-sharded over
dp_shard x TP / EP ranks, and the combined rows are put back among the layer's whole rows (one op making the
whole output, zeros for the other TP ranks' rows: the layer's output is partial over TP).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.expert_groups import check_expert_groups, expert_param_indices
from fsdp_planner.fsdp2.expert_parallel import ExpertParallel
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.fsdp2.validity import SKEW_COMPILED, modules_inside
from fsdp_planner.hardware.all_to_all import all_to_all_cost
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.sim.recompute import CheckpointedCall, made_in_view, view_position
from fsdp_planner.sim.tensor_parallel import collective_runs, node_cluster
from fsdp_planner.trace.events import KERNEL_EP_ALL_TO_ALL, Event, EventKind, OpClass
from fsdp_planner.trace.infos import ParamInfo
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import is_within, proper_ancestors

A2A_PER_LAYER = 4  # dispatch and combine in forward, their gradients in backward


@dataclass(frozen=True)
class EPView:
    """What one EP rank holds and runs (``trace``); the cluster is the whole one (EP takes no ranks from FSDP's
    other params)."""

    trace: Trace
    expert_parallel: ExpertParallel


def ep_view(trace: Trace, plan: Plan) -> EPView:
    """One EP rank's step of ``trace`` (the whole model) under ``plan``'s EP (module docstring); its groups must
    hold each expert module alone (``expert_groups.with_expert_groups`` makes them so)."""
    ep = plan.expert_parallel
    if ep is None or ep.degree == 1:
        raise ValueError("ep_view needs a plan with expert parallelism")
    if trace.expert_parallel:
        raise ValueError("the trace is already an expert-parallel view")
    check_expert_groups(plan, trace)
    experts = ep.experts(trace.modules)
    if ep.skew != 1.0 and next(modules_inside(experts, trace.compiled), None) is not None:
        raise PlannerError(SKEW_COMPILED)  # (a compiled block's saves are measured once, for balanced routing)
    split = token_split(trace, experts, ep.degree)
    local = ep_params(trace, plan)
    chosen = local.expert_params
    events, where = _rank_events(trace, experts, ep.skew, set(chosen), split, ep.degree)
    view = replace(trace, params=local.params, events=tuple(events), op_seconds=None,
                   modules=_moved_modules(trace, where), expert_parallel=ep.signature(), expert_params=chosen,
                   fingerprint=f"{trace.fingerprint}/ep{ep.degree}",
                   # the loss region's storages where their events went (the allocator's replay of the loss)
                   loss_blocks=tuple((where[made], view_position(where, freed, len(events)), n)
                                     for made, freed, n in trace.loss_blocks))
    return EPView(view, ep)


def ep_params(trace: Trace, plan: Plan) -> Trace:
    """``ep_view``'s params alone (the experts' E / EP local shards), the step's events left as they are: what a
    param's shard placement reads, at a fraction of the view's cost (a 671B model's view rebuilds every event)."""
    ep = plan.expert_parallel
    chosen = expert_param_indices(plan, trace)
    params = list(trace.params)
    for i in chosen:
        params[i] = _local_param(params[i], ep.degree)
    return replace(trace, params=tuple(params), expert_parallel=ep.signature(), expert_params=chosen)


def token_split(trace: Trace, experts: Sequence[str], degree: int) -> int:
    """Over how many TP ranks the experts' routed tokens are split: 1 without TP; in a TP view, its degree, where
    its layout splits every expert module's tokens (``TPStyle.TOKEN_SPLIT``) and the EP degree is a multiple of
    it (EP's ranks span the TP ranks: dp_shard ranks x TP ranks, torchtitan's expert TP of 1)."""
    t = trace.tp_degree
    if t == 1:
        return 1
    styles = TensorParallel.from_signature(trace.tensor_parallel).styles(trace.modules)
    if any(styles.get(m) is not TPStyle.TOKEN_SPLIT for m in experts):
        raise PlannerError("expert parallelism with tensor parallelism needs the TP layout to split the experts' "
                           "routed tokens over the TP ranks (style token_split on each expert module, as "
                           "torchtitan's MoE layout does)")
    if degree % t:
        raise PlannerError(f"expert parallelism of degree {degree} with TP {t}: EP's ranks span the TP ranks "
                           f"(torchtitan's expert TP of 1), so the EP degree must be a multiple of {t}")
    return t


def _local_param(p: ParamInfo, degree: int) -> ParamInfo:
    """The expert param's EP-local shard: E / EP experts on dim 0."""
    if len(p.shape) < 2 or p.shape[0] % degree:
        raise PlannerError(f"expert parallelism of degree {degree} cannot shard {p.fqn} {list(p.shape)} on its expert "
                           f"dim 0: choose a degree that divides its {p.shape[0] if p.shape else 0} experts")
    return replace(p, shape=(p.shape[0] // degree, *p.shape[1:]), numel=p.numel // degree)


def _dispatch_bytes(trace: Trace, ops: list[Event], chosen: set[int], split: int) -> int:
    """One rank's routed rows x dim, from the expert matmuls of a call reading its first expert weight: their
    inputs (bytes read and written less the weight's and the output's; in a TP view whose ops run on 1/``split``
    of the tokens, their bytes counted so, the weight's too). One batched matmul reads the whole weight; a loop
    over the experts (``x[e] @ w1[e]``) makes one matmul an expert, each reading its slice of the weight."""
    first = next((p for e in ops if e.flops for p in e.params if p in chosen), None)
    if first is None:
        return 0
    reading = [e for e in ops if e.flops and first in e.params]
    weight = trace.params[first]
    share = weight.numel * (trace.compute_itemsize or weight.itemsize) // len(reading) // split
    return max(0, sum(e.nbytes - e.out_nbytes - share for e in reading))


def _forward_calls(trace: Trace, names: set[str]) -> Iterator[tuple[str, int, int, int]]:
    """Each forward call of the modules ``names``: (module, call, its pre-forward's position, its post-forward's)."""
    open_calls: dict[str, tuple[int, int]] = {}
    for i, e in enumerate(trace.events):
        if e.backward:
            break
        if e.kind is EventKind.FWD_PRE and e.module in names:
            open_calls[e.module] = (e.call, i)
        elif e.kind is EventKind.FWD_POST and e.module in open_calls:
            call, start = open_calls.pop(e.module)
            yield e.module, call, start, i


def _call_bytes(trace: Trace, experts: Sequence[str], chosen: set[int], split: int) -> dict[tuple[str, int], int]:
    """(expert module, call) -> its all-to-all's send buffer."""
    return {(m, call): _dispatch_bytes(trace, [x for x in trace.events[start:end] if x.is_op], chosen, split)
            for m, call, start, end in _forward_calls(trace, set(experts))}


def _a2a(module: str, nbytes: int, backward: bool, received: int = 0) -> Event:
    """An all-to-all of ``nbytes`` (its send buffer); a forward one's output (``received`` bytes) is what an
    op-level checkpoint that saves ``all_to_all_single`` keeps (``fsdp2/selective.py``)."""
    if backward:
        return Event(EventKind.OP, module, nbytes=nbytes, backward=True, kernel=KERNEL_EP_ALL_TO_ALL)
    return Event(EventKind.OP, module, nbytes=nbytes, kernel=KERNEL_EP_ALL_TO_ALL, op_class=OpClass.ALL_TO_ALL,
                 out_nbytes=received)


def _rank_events(trace: Trace, experts: Sequence[str], skew: float, chosen: set[int],
                 split: int = 1, degree: int = 1) -> tuple[list[Event], list[int]]:
    """The EP rank's events, the all-to-alls around each expert call and the expert ops at ``skew`` x their work;
    and where each of the trace's events went (old position -> new). In forward the dispatch goes before the
    call's first matmul and the combine after its last one (``_forward_at``); in backward, after the call's
    pre-backward and before its post-backward. Tokens split over ``split`` TP ranks: the combined rows put back
    among the whole layer's (zeros for the other TP ranks' rows: the output is partial), one op making the whole
    (experts, tokens per expert, dim) output after the combine. The expert matmuls as ``degree`` EP ranks run them
    (``_local_matmul``)."""
    sizes = _call_bytes(trace, experts, chosen, split)
    names = set(experts)
    weights = _expert_weights(trace, experts, chosen)
    before = _forward_at(trace, names)
    out: list[Event] = []
    where: list[int] = []
    added: list[tuple[int, str]] = []  # the forward ops put in: (position, module), for ``made_in_view``
    for i, e in enumerate(trace.events):
        skewed = e.is_op and skew != 1.0 and any(is_within(e.module, m) for m in names)
        e = _rank_op(e, skew if skewed else 1.0, weights, split, degree) if e.is_op else e
        for module, call, combine in before.get(i, ()):
            nbytes = sizes.get((module, call), 0)
            # the busiest rank receives ``skew`` times its rows in the dispatch, its own rows back in the combine
            added.append((len(out), module))
            out.append(_a2a(module, nbytes, False, nbytes if combine else int(nbytes * skew)))
            if combine and split > 1:
                added.append((len(out), module))
                out.append(Event(EventKind.OP, module, nbytes=split * nbytes, out_nbytes=split * nbytes))
        if e.made_at:  # its makers where they went (``Event.made_at``)
            e = e._replace(made_at=made_in_view(e.made_at, trace, where, added, skew if skewed else 1.0))
        if e.resaved:  # the first save where it went (``Event.resaved``; earlier, so mapped already)
            e = e._replace(resaved=tuple((where[first], k, int(nbytes * (skew if skewed else 1.0)))
                                         for first, k, nbytes in e.resaved))
        if e.module not in names or e.is_op or not e.backward:
            where.append(len(out))
            out.append(e)
            continue
        nbytes = sizes.get((e.module, e.call), next((n for (m, _), n in sizes.items() if m == e.module), 0))
        a2a = _a2a(e.module, nbytes, e.backward)
        where.append(len(out) + (0 if e.kind is EventKind.BWD_PRE else 1))
        out.extend([e, a2a] if e.kind is EventKind.BWD_PRE else [a2a, e])
    return out, where


@dataclass(frozen=True)
class _Weights:
    """An expert module's weights, as its matmuls multiply by them: each one's smallest non-expert dim and traced
    bytes, and which one a matmul multiplies by (``of``)."""

    dims: dict[int, int]
    nbytes: dict[int, int]
    by_flops: dict[int, int]  # a matmul's FLOPs -> the weight of the matmul reading it with those FLOPs
    stacked: tuple[int, ...] = ()  # traced bytes of each param stacked on an expert dim (transformers' packed
    # experts: Mixtral's gate_up_proj and its down_proj, half its size), largest first

    def of(self, e: Event) -> int:
        """The weight ``e`` multiplies by: the one it reads; a weight's gradient, which reads none, the one whose
        input-gradient matmul does its FLOPs (transformers' gate_up weight is twice its down weight); else the
        largest."""
        known = [p for p in e.params if p in self.nbytes]
        if known:
            return known[0]
        return self.by_flops.get(e.flops, max(self.nbytes, key=lambda p: (self.nbytes[p], -p)))


def _rank_op(e: Event, skew: float, weights: dict[str, _Weights], split: int, degree: int) -> Event:
    """An op as the EP rank runs it: an expert op's work ``skew`` times the balanced share (the busiest rank's),
    an expert matmul its local experts' (``_local_matmul``)."""
    w = weights.get(e.module)
    weight = w.of(e) if e.kernel > 0 and w is not None else None  # (by its traced FLOPs)
    if skew != 1.0:
        e = e._replace(flops=int(e.flops * skew), nbytes=int(e.nbytes * skew), saved=int(e.saved * skew),
                       freed=int(e.freed * skew), out_nbytes=int(e.out_nbytes * skew),
                       grad_live=int(e.grad_live * skew))
    stacked = next((b for b in w.stacked if e.grad_live >= b and e.nbytes >= b), 0) \
        if w is not None and e.backward else 0
    if stacked:
        # the backward of ``weight[e]`` (transformers' packed experts) makes a zero gradient of the whole stacked
        # param for autograd to add into its grad: traced at all the experts, a rank's holds its E / EP (a new
        # user's OLMoE at EP 8: +5.0% at 1,024 tokens, the peak there); of each stacked param, not the largest
        # alone (Mixtral's down_proj, half its gate_up_proj: +19% on 16 fake ranks, a trial's)
        e = e._replace(grad_live=e.grad_live - int(stacked * (1 - 1 / degree)))
    if w is not None and weight is not None:
        e = _local_matmul(e, w.dims[weight], w.nbytes[weight], degree / split * skew, skew / split - 1 / degree)
    return e


def _expert_weights(trace: Trace, experts: Sequence[str], chosen: set[int]) -> dict[str, _Weights]:
    """Each expert module, and each module inside one -> its expert params (``_Weights``); one pass over the
    modules, params and events (a pass per expert module was most of an EP view's time on DeepSeek-V3)."""
    names = set(experts)
    inside = {name: m for name in trace.modules
              if (m := next((a for a in (name, *proper_ancestors(name)) if a in names), None)) is not None}
    own: dict[str, dict[int, ParamInfo]] = {}
    for i in chosen:
        p = trace.params[i]
        m = next((inside[o] for o in p.owners if o in inside), None)
        if m is not None and len(p.shape) >= 2:
            own.setdefault(m, {})[i] = p
    by_flops: dict[str, dict[int, int | None]] = {m: {} for m in own}
    for e in trace.events:
        m = inside.get(e.module)
        if m in own and e.is_op and e.kernel > 0 and e.flops:
            by_flops[m].setdefault(e.flops, next((p for p in e.params if p in own[m]), None))
    itemsize = trace.compute_itemsize
    weights = {m: _Weights({i: min(p.shape[1:]) for i, p in params.items()},
                           {i: p.numel * (itemsize or p.itemsize) for i, p in params.items()},
                           {f: i for f, i in by_flops[m].items() if i is not None},
                           tuple(sorted((p.numel * (itemsize or p.itemsize) for p in params.values()
                                         if len(p.shape) >= 3), reverse=True))) for m, params in own.items()}
    return {name: weights[m] for name, m in inside.items() if m in weights}


def _local_matmul(e: Event, dims: int, nbytes: int, rows: float, weights: float) -> Event:
    """An expert matmul as one EP rank runs it: its local experts (E / EP) each multiply ``rows`` times the rows
    the trace gave one (the tokens all EP ranks route to them; the busiest rank's ``skew`` times more), so the
    matmul's smallest dim (``Event.kernel``, by which its efficiency goes) is that many times the traced one up to
    its weight's own smallest dim (``dims``), and it reads or writes E / EP experts' weights (``weights``: the
    fraction of the traced weight's ``nbytes`` to take off the op's, the rest its skew and TP split). Its FLOPs are
    unchanged. On DeepSeek-V3 (256 experts, 128 rows each in the trace) a rank's expert matmuls were priced reading
    all 256 experts' weights at 128 rows' efficiency under any EP degree."""
    kernel = e.kernel if e.kernel >= dims else min(dims, max(1, round(e.kernel * rows)))
    return e._replace(kernel=kernel, nbytes=max(0, int(e.nbytes - nbytes * weights)))


def _forward_at(trace: Trace, names: set[str]) -> dict[int, list[tuple[str, int, bool]]]:
    """Where each forward call of the expert modules ``names`` gets its all-to-alls: position -> (module, call,
    whether it is the combine), the all-to-all going before that event. The dispatch before the call's first op
    that reads its params (and the ops that cost nothing just before it), after any ops that lay out the routed
    rows (transformers' experts layers route inside their forward); the combine after the last op reading them and
    the child calls that follow it (a post-experts norm), before the call's own ops that weigh and sum the rows
    back into tokens (the built-in's experts start and end with their matmuls: at the call's boundaries)."""
    out: dict[int, list[tuple[str, int, bool]]] = {}
    events = trace.events
    for m, call, start, end in _forward_calls(trace, names):
        reads = [k for k in range(start + 1, end) if events[k].is_op and events[k].params]
        first, combine = start + 1, end
        if reads:
            first = reads[0]
            while first > start + 1 and _costs_nothing(events[first - 1]):
                first -= 1
            combine = next(k for k in range(reads[-1] + 1, end + 1) if events[k].module == m)
        out.setdefault(first, []).append((m, call, False))
        out.setdefault(combine, []).append((m, call, True))
    return out


def _costs_nothing(e: Event) -> bool:
    """An op that moves no bytes and runs no FLOPs (a view of the call's input)."""
    return e.is_op and not e.flops and not e.nbytes


def _moved_modules(trace: Trace, where: list[int]) -> dict:
    """The modules with their first use at its new position (the all-to-alls inserted)."""
    return {name: replace(info, first_use=where[info.first_use] if info.first_use >= 0 else -1)
            for name, info in trace.modules.items()}


def ep_positions(trace: Trace) -> np.ndarray:
    """Positions of EP's all-to-alls in an EP rank's trace."""
    return np.flatnonzero(trace.index.op_kernel == KERNEL_EP_ALL_TO_ALL)


def ep_seconds(trace: Trace, cluster: Cluster, times: list[float], scale: float) -> list[float]:
    """``times`` with each all-to-all's seconds on its EP group (consecutive ranks) at the busiest rank's bytes.
    ``scale``: traced to compute bytes."""
    degree, skew = trace.ep_degree, float(trace.expert_parallel[2])
    cluster = node_cluster(cluster, trace.tp_degree)  # a TP view's cluster is the data-parallel one
    cost = all_to_all_cost(cluster, degree, min(degree, cluster.gpus_per_node))
    out = list(times)
    for i in ep_positions(trace).tolist():
        nbytes = trace.events[i].nbytes * scale * skew
        out[i] = float(cost.seconds(nbytes)) if nbytes > 0 else 0.0
    return out


def expert_ranks(cluster: Cluster, shard: int, degree: int) -> tuple[int, int]:
    """(ranks, ranks per node) of the experts' FSDP group: dp_shard / EP ranks, EP apart."""
    ranks = shard // degree
    per_node = max(1, min(ranks, cluster.gpus_per_node // degree))
    return ranks, per_node


@dataclass(frozen=True)
class EPCollectives:
    """EP's all-to-alls in a step: count and bytes (send buffers), recomputations included."""

    count: int
    nbytes: int


def ep_collectives(trace: Trace, recomputed: Sequence[CheckpointedCall], scale: float) -> EPCollectives:
    """EP's all-to-alls of an EP rank's step: each once, and again where a checkpointed call's forward runs again."""
    positions = ep_positions(trace)
    runs = collective_runs(positions, recomputed)
    nbytes = sum(n * int(trace.events[p].nbytes * scale) for p, n in zip(positions.tolist(), runs.tolist(),
                                                                          strict=True))
    return EPCollectives(int(runs.sum()), nbytes)
