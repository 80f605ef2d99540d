"""Replay FSDP2's hook state machine over a trace: when each group all-gathers, reshards and reduce-scatters.

This mirrors ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py`` and ``_fsdp_param_group.py`` (2.13):
- a list group's pre-forward runs on every listed module (unshard is a no-op when already unsharded); its
  post-forward (reshard) runs once all listed modules have run in this pass;
- the pre-backward hook sits on the outputs of the module call that completed the group; a second pre-backward
  before the group's post-backward is a no-op;
- post-backward runs when the grads of the entering module call's inputs are ready, or in the root's final
  callback when those inputs did not require grad; it reshards and reduce-scatters the group's grads;
- the root (when it owns params) never reshards after forward; by default backward prefetches the group that
  finished forward just before this one.
The output is independent of hardware: ``metrics.py`` counts it, ``simulate.py`` puts times on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_planner.plan import Plan
from fsdp_planner.trace import BWD_POST, BWD_PRE, FWD_POST, FWD_PRE, OP, ROOT, Trace

ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class Collective:
    kind: str  # ALL_GATHER or REDUCE_SCATTER
    group: int
    nbytes: int  # full (unsharded) bytes of the collective
    event: int  # trace event index at whose boundary it is issued (len(events) = final callback)
    backward: bool
    prefetch: bool = False  # issued ahead, by a prefetch, not by the group's own hook
    ranks: int = 0  # 0: the group's full shard mesh; k: the post-forward sub-group of k ranks
    params: tuple[int, ...] = ()  # reduce-scatter: the params whose grads it carries (indices into Trace.params)


@dataclass(frozen=True)
class Residency:
    """Group ``group`` holds ``1/divisor`` of its unsharded bytes on each rank over events [start, end)."""

    group: int
    start: int
    end: int
    divisor: int = 1


@dataclass
class Schedule:
    collectives: list[Collective] = field(default_factory=list)
    residency: list[Residency] = field(default_factory=list)
    num_events: int = 0


@dataclass
class _GroupState:
    unsharded: bool = False
    post_forward_sharded: bool = False  # holding a reshard_after_forward=int shard
    since: int = -1
    gathered: bool = False  # all-gathered at least once this step, so its params can have grads
    training: str = "idle"  # idle | forward | pre_backward | post_backward
    to_run: set[str] = field(default_factory=set)
    post_forward_indices: list[int] = field(default_factory=list)


def group_bytes(plan: Plan, trace: Trace, param_itemsize: int | None = None) -> list[int]:
    """Unsharded bytes per group (optionally at a mixed-precision param dtype size)."""
    out = []
    for g in plan.groups:
        total = 0
        for p in g.params:
            info = trace.param(p)
            total += info.numel * (param_itemsize or info.itemsize)
        out.append(total)
    return out


def forward_users(trace: Trace) -> list[set[tuple[str, int]]]:
    """Per param, the module calls (innermost) whose forward ops read it: its grad is complete once all of
    their backward passes are done."""
    users: list[set[tuple[str, int]]] = [set() for _ in trace.params]
    stack: list[tuple[str, int]] = []
    for e in trace.events:
        if e.kind == FWD_PRE:
            stack.append((e.module, e.call))
        elif e.kind == FWD_POST:
            stack.pop()
        elif e.kind == OP and not e.backward:
            caller = stack[-1] if stack else (ROOT, 0)
            for p in e.params:
                users[p].add(caller)
    return users


def build_schedule(
    trace: Trace,
    plan: Plan,
    world_size: int | None = None,
    param_itemsize: int | None = None,
    reduce_itemsize: int | None = None,
) -> Schedule:
    """Replay FSDP2 over ``trace`` with ``plan``'s groups."""
    n = len(plan.groups)
    gbytes = group_bytes(plan, trace, param_itemsize)
    grad_users = trace.memo("forward_users", lambda: forward_users(trace))
    reducible = trace.memo("reducible", lambda: [p.requires_grad and bool(u) for p, u in
                                                 zip(trace.params, grad_users, strict=True)])
    index = trace.param_index
    grad_params = [[i for i in map(index, g.params) if reducible[i]] for g in plan.groups]
    reduced: set[int] = set()
    bwd_done: set[tuple[str, int]] = set()
    has_params = [bool(g.params) for g in plan.groups]
    group_of: dict[str, int] = {m: i for i, g in enumerate(plan.groups) for m in g.modules}
    root = n - 1
    st = [_GroupState() for _ in range(n)]
    sched = Schedule(num_events=len(trace.events))
    post_forward_order: list[int] = []
    pre_bw_at: dict[tuple[str, int], list[int]] = {}  # module call whose output grads trigger pre-backward
    post_bw_at: dict[tuple[str, int], int] = {}  # module call whose input grads trigger post-backward

    def reshard_after_forward(i: int) -> bool | int:
        g = plan.groups[i]
        if i == root and g.reshard_after_forward is False:
            return False  # root default: never reshard after forward
        r = g.reshard_after_forward
        if isinstance(r, bool):
            return r
        if world_size is not None and r >= world_size:
            return True
        return False if r == 1 else r

    def unshard(i: int, at: int, backward: bool, prefetch: bool) -> None:
        s = st[i]
        if s.unsharded or not has_params[i]:
            return
        ranks = 0
        if s.post_forward_sharded:
            ranks = int(reshard_after_forward(i))
            _close(i, at, divisor=ranks)
            s.post_forward_sharded = False
        sched.collectives.append(Collective(ALL_GATHER, i, gbytes[i], at, backward, prefetch, ranks))
        s.unsharded, s.since, s.gathered = True, at, True

    def _close(i: int, at: int, divisor: int = 1) -> None:
        sched.residency.append(Residency(i, st[i].since, at, divisor))

    def reshard(i: int, at: int, in_forward: bool) -> None:
        s = st[i]
        if not s.unsharded:
            return
        if in_forward:
            r = reshard_after_forward(i)
            if r is False:
                return
            _close(i, at)
            s.unsharded = False
            if r is not True:
                s.post_forward_sharded, s.since = True, at
            return
        _close(i, at)
        s.unsharded = False

    def post_backward(i: int, at: int) -> None:
        """Reshard, then reduce-scatter the grads that autograd has finished accumulating: a param read by
        several module calls gets its grad only after the backward of the last of them."""
        s = st[i]
        s.training = "post_backward"
        if not has_params[i]:
            return
        reshard(i, at, in_forward=False)
        if not s.gathered:
            return
        ready = [p for p in grad_params[i] if p not in reduced and grad_users[p] <= bwd_done]
        if ready:
            reduced.update(ready)
            nbytes = sum(trace.params[p].numel * (reduce_itemsize or trace.params[p].itemsize) for p in ready)
            sched.collectives.append(Collective(REDUCE_SCATTER, i, nbytes, at, True, params=tuple(ready)))

    def post_forward(i: int, at: int, key: tuple[str, int]) -> None:
        reshard(i, at, in_forward=True)
        post_forward_order.append(i)
        st[i].post_forward_indices.append(len(post_forward_order) - 1)
        st[i].training = "idle"
        pre_bw_at.setdefault(key, []).append(i)

    for idx in trace.boundary_events():
        e = trace.events[idx]
        if e.kind == FWD_PRE and e.module in group_of:
            i = group_of[e.module]
            s = st[i]
            if not s.to_run:
                s.to_run = set(plan.groups[i].modules)
            first_in_pass = s.training != "forward"
            s.training = "forward"
            unshard(i, idx, backward=False, prefetch=False)
            if first_in_pass:
                if e.grad_inputs:
                    post_bw_at[(e.module, e.call)] = i
                for j in plan.groups[i].forward_prefetch:
                    unshard(j, idx, backward=False, prefetch=True)
        elif e.kind == FWD_POST and e.module in group_of:
            i = group_of[e.module]
            s = st[i]
            if e.module in s.to_run:
                s.to_run.discard(e.module)
                if not s.to_run:
                    post_forward(i, idx, (e.module, e.call))
            if e.module == ROOT:
                # the root's post-forward completes groups whose listed modules did not all run
                for j in range(n):
                    if j != i and st[j].to_run:
                        st[j].to_run.clear()
                        post_forward(j, idx, (ROOT, e.call))
        elif e.kind == BWD_PRE:
            for j in pre_bw_at.get((e.module, e.call), []):
                s = st[j]
                if s.training == "pre_backward":
                    continue
                s.training = "pre_backward"
                unshard(j, idx, backward=True, prefetch=False)
                g = plan.groups[j]
                if g.backward_prefetch:
                    for k in g.backward_prefetch:
                        unshard(k, idx, backward=True, prefetch=True)
                elif s.post_forward_indices:
                    cur = s.post_forward_indices.pop()
                    if cur > 0:
                        unshard(post_forward_order[cur - 1], idx, backward=True, prefetch=True)
        elif e.kind == BWD_POST:
            bwd_done.add((e.module, e.call))
            if (e.module, e.call) in post_bw_at:
                post_backward(post_bw_at.pop((e.module, e.call)), idx)
    end = len(trace.events)
    bwd_done.update(u for users in grad_users for u in users)  # the final callback runs after all of backward
    for i in range(n):
        if st[i].training != "post_backward" and has_params[i]:
            post_backward(i, end)
        st[i].training = "idle"
    for i in range(n):  # anything still held at the end of the step (e.g. never resharded)
        if st[i].unsharded:
            _close(i, end)
        if st[i].post_forward_sharded:
            _close(i, end, divisor=int(reshard_after_forward(i)))
    return sched
