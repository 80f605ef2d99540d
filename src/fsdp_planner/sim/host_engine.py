"""One training step on CPU ranks with gloo (``Engine.HOST``): everything in one thread, nothing overlaps.

On a GPU the host runs ahead and the streams overlap (``streams.py``). On a CPU rank the thread that runs the
ops also runs FSDP2's hooks and copies, and each collective blocks it: FSDP2 issues all-gathers with
``async_op=False`` (``FSDPParamGroup.unshard_async_op`` is False by default, prefetches included) and
``foreach_reduce`` runs the reduce-scatter synchronously, which on a GPU only orders streams but on gloo waits
for the network. So the step is a sum, in the order the replay issues things:
- each op: its time (measured with ``--measure``) plus ``Overhead.op_seconds``: ``calibrate --backend gloo`` fits
  it as the step without FSDP less its measured ops, per op: what the framework spends around an op (autograd,
  module calls) less what timing each op adds to its measured time (negative on this project's host: -2 us);
- each FSDP2 hook: ``hook_seconds`` plus ``param_seconds`` / 4 per param its group manages (as on a GPU host),
  and each call of a module ``fully_shard`` was applied to ``module_seconds`` (its FSDPState's hooks);
- each collective: its copy-in and its cost (``hardware/cost.py``: the gloo line, or where the cluster measured
  it, ``Cluster.tables``, its measured time at that size, copy-in included); an all-gather's copy-out into the
  params at ``copy_bandwidth``;
- a checkpointed forward run again at its pre-backward boundary.
A shard group of one rank issues no collective (as ``verify`` predicts). Memory is the same model as on a GPU.
"""

from __future__ import annotations

import numpy as np

from fsdp_planner.fmt import fmt_modules
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Collective, Schedule, state_hook_calls
from fsdp_planner.sim.context import Recompute, SimContext, collective_bytes
from fsdp_planner.sim.timeline import AG, AR, RS, StepTimes, Stream, Timeline, Work


class HostRank:
    """The one clock of a CPU rank, and what it spent on each kind of work."""

    def __init__(self, ctx: SimContext, plan: Plan, gather: list[int], group_params: list[int],
                 timeline: bool) -> None:
        self.ctx, self.plan, self.gather, self.group_params = ctx, plan, gather, group_params
        self.overhead = ctx.cluster.overhead
        through = ctx.trace.index.ops_through  # ops among events 0..i
        self.ops_before = np.concatenate([[0], through[:-1]])  # ops among events 0..i-1
        self.t = 0.0
        self.pos = 0
        self.host = 0.0  # FSDP2's hooks
        self.compute = 0.0  # the ops, corrected
        self.copy = 0.0
        self.busy = {AG: 0.0, RS: 0.0, AR: 0.0}
        self.timeline = Timeline(timeline)

    def _spend(self, seconds: float, stream: Stream, name: str, work: Work = Work.OPS, group: int = -1,
               op: int = -1) -> None:
        if seconds > 0:
            self.timeline.add(stream, name, self.t, self.t + seconds, group, op, work)
        self.t += seconds

    def run_ops(self, idx: int) -> None:
        """The ops before ``idx``, each corrected by ``op_seconds`` (module docstring)."""
        if idx <= self.pos:
            return
        ops = float(self.ops_before[idx] - self.ops_before[self.pos])
        run = self.ctx.cum[idx] - self.ctx.cum[self.pos]
        seconds = max(0.0, run + ops * self.overhead.op_seconds)
        self.compute += seconds
        self._ran(run, seconds, Stream.COMPUTE, self.ctx.trace.events[self.pos].module or "(root)", Work.OPS,
                  self.pos)
        self.pos = idx

    def _ran(self, run: float, seconds: float, stream: Stream, name: str, work: Work, op: int = -1) -> None:
        """Ops that run ``run`` seconds and take ``seconds`` with their dispatch (``op_seconds``): the ops drawn,
        the dispatch after them left blank, as a profile shows it (gaps between ops: ``simulate --against``'s
        idle, which calibrate's fitted ``op_seconds`` stands for)."""
        drawn = min(run, seconds) if run > 0 else seconds
        self._spend(drawn, stream, name, work, op=op)
        self.t += seconds - drawn

    def _host(self, seconds: float, name: str) -> None:
        self.host += seconds
        self._spend(seconds, Stream.COMPUTE, name, Work.HOST)

    def hook(self, group: int) -> None:
        """One FSDP2 lifecycle call of ``group``."""
        self._host(self.overhead.hook_seconds + self.group_params[group] * self.overhead.param_seconds / 4,
                   f"FSDP2 hook {fmt_modules(self.plan.groups[group].modules, 1)}")

    def state_hooks(self) -> None:
        """A call of a module ``fully_shard`` was applied to: its FSDPState's hooks, forward and backward."""
        self._host(self.overhead.module_seconds, "FSDP2 module hooks")

    def collective(self, c: Collective) -> None:
        """Copy-in, the blocking collective, and an all-gather's copy-out."""
        ctx = self.ctx
        nbytes = collective_bytes(ctx, c, self.gather)
        if c.kind is not AR and ctx.shard == 1:
            return  # FSDP2 issues no all-gather or reduce-scatter over one rank
        bandwidth = self.overhead.copy_bandwidth
        name = fmt_modules(self.plan.groups[c.group].modules, 1)
        cost = ctx.cost(c.kind, c.ranks)
        # a measured table timed it as FSDP2 runs it, copy-in included (calibrate/worker.py: sweep)
        copy_in = 0.0 if cost.table is not None else ctx.copy_in_seconds(c.kind, nbytes)
        self.copy += copy_in
        self._spend(copy_in, Stream.COMPUTE, f"copy-in {name}", Work.COPY_OUT, c.group)
        seconds = cost.seconds(nbytes)
        self.busy[c.kind] += seconds
        self._spend(seconds, Stream(c.kind.value), name, group=c.group)
        if c.kind is AG:
            self.copy += nbytes / bandwidth
            self._spend(nbytes / bandwidth, Stream.COMPUTE, f"copy-out {name}", Work.COPY_OUT, c.group)

    def recompute(self, r: Recompute, at: int) -> float:
        """A checkpointed forward run again at boundary ``at``; its seconds."""
        seconds = max(0.0, r.seconds + r.ops * self.overhead.op_seconds)
        self._ran(r.seconds, seconds, Stream.COMPUTE, f"recompute {fmt_modules(r.modules, 1)}", Work.RECOMPUTE, at)
        # no ``copy_seconds``: on CPU ranks ``save_on_cpu`` packs a CPU tensor as itself (``tensor.cpu()``), no copy
        return seconds


def simulate_host(ctx: SimContext, plan: Plan, sched: Schedule, gather: list[int], group_params: list[int],
                  recompute: dict[int, Recompute], timeline: bool) -> StepTimes:
    """The step of ``plan`` on CPU ranks: ops, hooks, copies and collectives one after another."""
    rank = HostRank(ctx, plan, gather, group_params, timeline)
    hooks: dict[int, list[int]] = {}
    for at, group in sched.hooks:
        hooks.setdefault(at, []).append(group)
    issued: dict[int, list[Collective]] = {}
    for c in sched.collectives:
        issued.setdefault(c.event, []).append(c)
    calls = set(state_hook_calls(ctx.trace, plan)) if ctx.cluster.overhead.module_seconds else set()
    n = len(ctx.trace.events)
    recomputed = 0.0
    # forward_end: no run of ops spans the forward/backward boundary, so each run has one phase (pictures)
    for idx in sorted({*hooks, *issued, *recompute, *calls, ctx.trace.index.forward_end, n}):
        rank.run_ops(idx)
        if idx in calls:
            rank.state_hooks()
        for group in hooks.get(idx, ()):
            rank.hook(group)
        for c in issued.get(idx, ()):
            rank.collective(c)
        if idx in recompute:
            recomputed += rank.recompute(recompute[idx], idx)
    exposed = sum(rank.busy.values())
    return StepTimes(step=rank.t, recompute=recomputed, exposed=exposed, busy=rank.busy, host_time=rank.host,
                     host_wait=rank.host, copy_time=rank.copy, events=rank.timeline.events,
                     compute=rank.compute + recomputed)

