"""The GPU engine (``Engine.STREAMS``): one training step under FSDP2 with the host ahead and the streams overlapping.

The FSDP2 decisions (what is gathered, resharded, reduce-scattered, when) come from ``fsdp2/replay.py``; this
module puts times on them with three streams, as FSDP2 runs them:
- host: eager PyTorch runs ahead of the GPU, launching each op (``Overhead.op_seconds``) and running FSDP2's
  hooks (``hook_seconds`` each, at the boundaries the replay lists); an op cannot start before the host launched
  it, and a collective not before its hook ran. While the host keeps ahead this costs nothing; with many tiny
  groups or ops it is the step (pytorch#173680). Where it reads an op's output (``Event.syncs``: a router's
  ``nonzero``, ``.item()``, a copy to the CPU) it waits for the GPU to finish that op: its lead is gone, and the
  next group's all-gather, which its pre-forward hook issues, waits for it too (torchtitan sets explicit forward
  prefetch under EP for this: "D2H syncs in EP could interfere with implicit prefetching in FSDP");
- compute: the trace's ops in order (``compute.py``); an op reading a param waits until that param's group is
  gathered, then pays the group's copy-out (FSDP2 runs ``split_with_sizes_copy`` on the compute stream);
- all-gather: collectives in issue order. Forward: the CPU runs one group ahead (FSDP2's implicit forward
  prefetch), so a group's all-gather may start once compute reached the previously gathered group. Backward and
  explicit prefetches start when compute reaches the boundary that issues them. Each pays a copy-in (FSDP2's
  copy-in stream) at ``Overhead.copy_bandwidth``;
- activation offloading (``save_on_cpu``): an offloaded call's saved tensors are copied to the host after its
  forward and back at its pre-backward, on the compute stream (``SimContext.recompute``), counted as copies;
- reduce-scatter: starts when compute finished the group's backward (its post-backward boundary), after the
  copy of the grads into its input;
- all-reduce (HSDP): FSDP2's ``all_reduce_stream`` all-reduces each reduce-scatter's output across the replicas
  once that reduce-scatter is done.
The communication streams share the links: latencies overlap, but the bytes of one collective wait for the
other streams' bytes on the same link (NVLink for groups within a node, the network otherwise).

Only two kinds of event can change the clocks: a collective being issued, and an op reading a group's params
for the first time after that group's all-gather (later reads find it ready). The simulation stops only there
and adds up the op times in between (the host's lead over such a stretch is one running maximum), so a plan
costs time in its collectives, not in the trace's length. Each collective is costed with the protocol NCCL
would run at its size, or as measured (``hardware/cost.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fsdp_planner.fmt import fmt_modules
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Collective, Schedule, state_hook_calls
from fsdp_planner.hardware.cost import LinkCost
from fsdp_planner.sim.compute import launches_through
from fsdp_planner.sim.context import Recompute, SimContext, collective_bytes
from fsdp_planner.sim.memory import first_at_or_after
from fsdp_planner.sim.sizing import GroupFacts
from fsdp_planner.sim.timeline import AG, AR, RS, StepTimes, Stream, Timeline, Work


class Streams:
    """The host and compute clocks, the communication streams and the links they share."""

    def __init__(self, ctx: SimContext, plan: Plan, gather: list[int], timeline: bool,
                 host: HostClock | None) -> None:
        self.ctx, self.plan, self.gather, self.host = ctx, plan, gather, host
        self.group_params = ctx.sizing.group_params(plan)  # (cached per group) what offload copies and dim 1 adds
        self.t = 0.0  # compute clock at the start of event ``pos``
        self.pos = 0
        self.free = {AG: 0.0, RS: 0.0, AR: 0.0}  # when each stream is idle again
        self.link_free = {"intra": 0.0, "inter": 0.0}  # when each link has carried the bytes queued on it
        self.ready = [0.0] * len(plan.groups)  # when each group's latest all-gather finished
        self.copy_out = [0.0] * len(plan.groups)  # its copy-out, paid on the compute stream by the first reader
        self.last_forward_gather = 0.0  # compute time at the pre-forward of the previously gathered group
        self.busy = {AG: 0.0, RS: 0.0, AR: 0.0}
        self.host_wait = 0.0
        self.copy_time = 0.0
        self.timeline = Timeline(timeline)

    def compute_until(self, idx: int, host_finish: float | None) -> None:
        """Run the ops before ``idx`` (none of them waits for a collective; each waits for its launch: where the
        host is behind, the wait is drawn before the run). ``host_finish``: the earliest the GPU can finish them,
        given when the host launched them (``HostClock.finishes``; None on an ideal host)."""
        busy = self.ctx.cum[idx] - self.ctx.cum[self.pos]
        if host_finish is not None and idx > self.pos:
            self.wait_for_host(host_finish - busy)
        if busy > 0:
            self.timeline.add(Stream.COMPUTE, self.ctx.trace.events[self.pos].module or "(root)", self.t,
                              self.t + busy, op=self.pos)
        self.t += busy
        self.pos = idx

    def wait_for_host(self, until: float) -> None:
        """Compute idle until the host reaches ``until`` (drawn as a wait for the host)."""
        if until > self.t:
            self.timeline.add(Stream.COMPUTE, "waiting for the host", self.t, until, work=Work.HOST)
            self.host_wait += until - self.t
            self.t = until

    def issue(self, c: Collective) -> None:
        nbytes = collective_bytes(self.ctx, c, self.gather)
        copy = self.ctx.cluster.overhead.copy_bandwidth
        # a shard group of one rank: FSDP2 issues no all-gather or reduce-scatter, yet copies the params out of
        # their shards on the compute stream and the grads into the reduce-scatter buffer (wait_for_unshard and
        # foreach_reduce at world size 1)
        params = self.group_params[c.group] if c.kind is AG else c.params
        one_rank = self.ctx.shard_of(params) == 1 and c.kind is not AR
        if c.kind is AG:
            copy_in = 0.0 if one_rank else self.ctx.copy_in_seconds(c.kind, nbytes)
            issued = self.t if (c.backward or c.prefetch) else self.last_forward_gather
        elif c.kind is AR:  # the reduce-scatter just issued for the same grads must be done
            copy_in, issued = 0.0, self.free[RS]
        else:  # the unsharded grads copied into the reduce-scatter's input (dim-1 ones re-laid out first)
            copy_in = self.ctx.copy_in_seconds(c.kind, nbytes + self.ctx.sizing.shard1_grad_bytes(params))
            issued = self.t
        # offload: the shards come from the host first (not for a backward all-gather from a post-forward shard,
        # ``ranks``, kept on the GPU); the reduced shard goes back (counted before the collective: the same time on
        # its stream)
        copy_in += 0.0 if c.ranks else self.ctx.host_copy_seconds(c.kind, params)
        if self.host is not None:  # launched by the hook at this boundary
            issued = max(issued, self.host.at(c.event))
        line = LinkCost(0.0, 0.0, "intra") if one_rank else self.ctx.line(c.kind, c.ranks, params, nbytes)
        start = max(self.free[c.kind], issued) + copy_in
        end = start + (line.alpha if nbytes else 0.0)
        if line.transfer(nbytes) > 0:  # the bytes queue behind the other stream's on the same link
            end = max(end, self.link_free[line.link]) + line.transfer(nbytes)
            self.link_free[line.link] = end
        self.free[c.kind] = end
        self.busy[c.kind] += end - start + copy_in
        if c.kind is AG:
            self.ready[c.group] = end
            # dim-1 params are copied out twice (through a temporary: sizing.py)
            self.copy_out[c.group] = (nbytes + self.ctx.sizing.shard1_gather_bytes(params)) / copy
            if not c.backward and not c.prefetch:
                self.last_forward_gather = self.t
        if end > start - copy_in and self.timeline.recording:  # (naming the group costs a planner's every plan)
            self.timeline.add(Stream(c.kind.value), fmt_modules(self.plan.groups[c.group].modules, 1), start - copy_in,
                              end, c.group)

    def run_extra(self, seconds: float, name: str, at: int, launched: float = 0.0) -> None:
        """Compute that is not one of the trace's ops (a checkpointed forward run again at boundary ``at``), its
        last op launched by the host at ``launched``."""
        if seconds > 0:
            self.timeline.add(Stream.COMPUTE, name, self.t, self.t + seconds, op=at, work=Work.RECOMPUTE)
        self.t += seconds
        self.wait_for_host(launched)

    def run_copy(self, seconds: float, name: str) -> None:
        """Activation offloading's host copies, on the compute stream (``save_on_cpu`` does not overlap them)."""
        if seconds > 0:
            self.timeline.add(Stream.COMPUTE, name, self.t, self.t + seconds, work=Work.COPY_OUT)
        self.t += seconds
        self.copy_time += seconds

    def wait_for(self, groups: list[int]) -> None:
        """Compute waits for each group's all-gather, then copies it out (once per all-gather)."""
        for g in groups:
            self.t = max(self.t, self.ready[g])
            copy = self.copy_out[g]
            if copy > 0 and self.timeline.recording:
                name = f"copy-out {fmt_modules(self.plan.groups[g].modules, 1)}"
                self.timeline.add(Stream.COMPUTE, name, self.t, self.t + copy, g, work=Work.COPY_OUT)
            self.t += copy
            self.copy_time += copy
            self.copy_out[g] = 0.0


class HostClock:
    """When the host has launched each op of the trace under one plan: ``op_seconds`` per op, and per FSDP2 hook
    (at its boundary, before the ops after it) ``hook_seconds`` plus ``param_seconds`` / 4 for each param its group
    manages (a group runs four hooks a step), ``module_seconds`` at each call of a module fully_shard was applied
    to, and the ops of a checkpointed forward launched again at its pre-backward boundary. The host never waits for
    the GPU within a step (FSDP2's stream waits are on the GPU) but where it reads an op's output (``waited``), so
    this is a running sum plus what it waited so far (``delay``), and the GPU finishes ops
    pos..idx-1 no earlier than the latest (launch of op j + the ops from j to idx)."""

    def __init__(self, ctx: SimContext, hooks: list[tuple[int, int]], group_params: list[int],
                 recompute: dict[int, Recompute], calls: Sequence[int] = ()) -> None:
        self.delay = 0.0  # how far behind the running sum the host is, from waiting for the GPU (``waited``)
        n = len(ctx.trace.events)
        overhead = ctx.cluster.overhead
        host = np.zeros(n + 1)  # host seconds spent at each event beyond launching its op
        for at, group in hooks:
            host[at] += overhead.hook_seconds + group_params[group] * overhead.param_seconds / 4
        for at in calls:  # its backward hooks charged with its forward ones
            host[at] += overhead.module_seconds
        for at, r in recompute.items():
            host[at] += r.ops * overhead.op_seconds
        # launched[i]: the host's time once event i is done (an op launched, a boundary's hooks run)
        self.launched = launches_through(ctx.trace) * overhead.op_seconds + np.cumsum(host)
        self.cum = ctx.cum
        self.lead = self.launched[:n] - ctx.cum_array[:n]  # launch of op j less the ops before it

    def at(self, idx: int) -> float:
        """The host's time once boundary ``idx``'s hooks ran (and any recomputation there was launched)."""
        return float(self.launched[idx]) + self.delay

    def work(self, idx: int) -> float:
        """The host's own work up to boundary ``idx`` (launches and hooks), its waits for the GPU left out."""
        return float(self.launched[idx])

    def waited(self, idx: int, gpu: float) -> None:
        """The host waited at event ``idx`` for the GPU to reach ``gpu`` (it read an op's output: ``Event.syncs``):
        it launches everything after later by what it waited."""
        self.delay = max(self.delay, gpu - float(self.launched[idx]))

    def finishes(self, stops: list[int]) -> list[float]:
        """The earliest the GPU can finish the ops of each stretch between consecutive ``stops`` (ascending, from
        0), given when they were launched: the stretch's largest lead plus the ops before its end, all stretches in
        one numpy call (one call each was a fifth of the engine's time). Entry k is for the stretch ending at
        ``stops[k]`` (an empty stretch: never asked), before any wait for the GPU (``delay``, which is constant
        within a stretch: an op the host waits for ends one)."""
        if not len(self.lead):
            return [self.cum[idx] for idx in stops]
        maxima = np.maximum.reduceat(self.lead, [0, *stops[:-1]])  # (the last stop is the step's end)
        return [m + self.cum[idx] for m, idx in zip(maxima.tolist(), stops, strict=True)]


def simulate_streams(ctx: SimContext, plan: Plan, sched: Schedule, groups: list[GroupFacts],
                     recompute: dict[int, Recompute], timeline: bool) -> StepTimes:
    """The step of ``plan`` on GPUs. Only two kinds of event can change the clocks, a collective issued and an op
    reading a group first after its all-gather (module doc): the clocks stop only there."""
    issued_at, waits = _stops(sched, groups, len(ctx.trace.events))
    group_of = {p: gi for gi, g in enumerate(groups) for p in g.params}
    host = _host_clock(ctx, plan, sched, groups, recompute)
    streams = Streams(ctx, plan, [g.gather_bytes for g in groups], timeline, host)
    n = len(ctx.trace.events)
    # forward_end: a run of ops never spans the step's forward/backward boundary, so each run has one phase
    # (pictures colour it by that; the clocks are unchanged, a run's time being the sum of its parts)
    # after each op the host waits for (``Event.syncs``): the host's lead is gone there (an ideal host: none)
    synced = {i + 1 for i in ctx.trace.index.host_syncs} if host is not None else set()
    stops = sorted({*issued_at, *waits, *recompute, *synced, ctx.trace.index.forward_end, n})
    finishes = host.finishes(stops) if host is not None else [None] * len(stops)
    for idx, finish in zip(stops, finishes, strict=True):
        streams.compute_until(idx, None if host is None else finish + host.delay)
        if idx in synced:
            host.waited(idx - 1, streams.t)
        for c in issued_at.get(idx, ()):
            streams.issue(c)
        if idx in recompute:  # the checkpointed forward runs again once the params it reads are gathered
            r = recompute[idx]
            streams.wait_for(sorted({group_of[p] for p in r.params if p in group_of}))
            streams.run_extra(r.seconds, f"recompute {fmt_modules(r.modules, 1)}", idx, host.at(idx) if host else 0.0)
            streams.run_copy(r.copy_seconds, f"activation copies {fmt_modules(r.modules, 1)}")
            if r.syncs and host is not None:  # it read outputs on the host again: taken as the recomputation's end
                host.waited(idx, streams.t)
        if idx < n and idx in waits:
            streams.wait_for(waits[idx])
    if host is not None:  # the step is not over before the host ran the final callback's hooks
        streams.wait_for_host(host.at(n))
    return _times(ctx, streams, recompute, host.work(n) if host else 0.0)


def _stops(sched: Schedule, groups: list[GroupFacts], n: int) -> tuple[dict[int, list[Collective]],
                                                                      dict[int, list[int]]]:
    """Where the clocks must stop: trace position -> the collectives issued there, and op -> the groups it is the
    first to read after their all-gather."""
    issued_at: dict[int, list[Collective]] = {}
    waits: dict[int, list[int]] = {}
    for c in sched.collectives:
        issued_at.setdefault(c.event, []).append(c)
        if c.kind is AG:
            use = first_at_or_after(groups[c.group].uses, c.event, default=n)
            if use < n:
                waits.setdefault(use, []).append(c.group)
    return issued_at, waits


def _host_clock(ctx: SimContext, plan: Plan, sched: Schedule, groups: list[GroupFacts],
                recompute: dict[int, Recompute]) -> HostClock | None:
    """The host's launch clock, or None on an ideal host (every overhead zero: it is always ahead)."""
    overhead = ctx.cluster.overhead
    if not (overhead.op_seconds or overhead.hook_seconds or overhead.param_seconds or overhead.module_seconds):
        return None
    calls = state_hook_calls(ctx.trace, plan) if overhead.module_seconds else []
    return HostClock(ctx, sched.hooks, [len(g.params) for g in groups], recompute, calls)


def _times(ctx: SimContext, streams: Streams, recompute: dict[int, Recompute], host_time: float) -> StepTimes:
    step = max(streams.t, *streams.free.values())
    recomputed = sum(r.seconds for r in recompute.values())
    # exposed: compute waiting for collectives, what is left of the step after compute, copy-outs and host waits
    exposed = step - ctx.compute_total - recomputed - streams.copy_time - streams.host_wait
    return StepTimes(step=step, recompute=recomputed, exposed=exposed, busy=streams.busy, host_time=host_time,
                     host_wait=streams.host_wait, copy_time=streams.copy_time, events=streams.timeline.events)
