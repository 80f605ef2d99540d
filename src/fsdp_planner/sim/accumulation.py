"""A training step of N micro-batches (gradient accumulation) as FSDP2 runs it.

The loop: N forward + backward passes of one micro-batch each, ``model.set_requires_gradient_sync(False)`` on all
but the last, then one optimizer step. Without sync FSDP2's post-backward reduce-scatters nothing (nor does HSDP
all-reduce): it keeps each group's unsharded grads, upcast to the reduce dtype (``FSDPParam.
to_accumulated_grad_if_needed``), and the last micro-batch adds its grads in and reduce-scatters the sums
(``FSDPParamGroup.post_backward``). ``reshard_after_backward`` stays True, so every micro-batch all-gathers as a
step does.

The step is composed from two simulations of one micro-batch's trace: the ordinary step (the last micro-batch:
its collectives, time and memory with the accumulated grads beside it) and the same schedule without its
reduce-scatters and all-reduces (each other micro-batch). Memory is the largest of the micro-batches' peaks
(``memory.GradSync``: the first, a middle one, the last).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.replay import Schedule, build_schedule
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.memory import GradSync
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.timeline import AG
from fsdp_planner.trace.records import Trace


def micro_batch_phases(micro_batches: int) -> tuple[GradSync, ...]:
    """The distinct micro-batches of a step of ``micro_batches`` (memory differs between these only)."""
    if micro_batches == 1:
        return (GradSync.ONLY,)
    return (GradSync.FIRST, *((GradSync.MIDDLE,) if micro_batches > 2 else ()), GradSync.LAST)


def simulate_micro_batches(trace: Trace, plan: Plan, micro_batches: int, cluster: Cluster | None = None,
                           options: SimOptions | None = None, context: SimContext | None = None) -> StepReport:
    """One optimizer step of ``micro_batches`` forward + backward passes of the micro-batch ``trace`` was traced
    with (module docstring). One micro-batch is ``simulate``'s step."""
    if micro_batches < 1:
        raise ValueError("a step has at least one micro-batch")
    if context is None:
        if cluster is None:
            raise ValueError("simulate_micro_batches needs a cluster or a context")
        context = SimContext(trace, cluster, options, mesh=plan.layout(cluster.world_size))
    if micro_batches == 1:
        return simulate(trace, plan, context=context, timeline=False)
    groups = context.sizing.groups(plan)
    sched = build_schedule(trace, plan, context.world, [g.params for g in groups])
    last = simulate(trace, plan, context=context, schedule=sched, timeline=False)
    # the other micro-batches: the same hooks and all-gathers, no gradient collective
    quiet = Schedule([c for c in sched.collectives if c.kind is AG], sched.residency, sched.num_events, sched.hooks)
    other = simulate(trace, plan, context=context, schedule=quiet, timeline=False)
    peaks = [context.memory.peak(plan, sched, phase) for phase in micro_batch_phases(micro_batches)]
    top = max(peaks, key=lambda p: p.allocated)
    breakdown = top.at.to_dict()
    breakdown.pop("total")
    k = micro_batches - 1  # micro-batches without sync

    def total(name: str) -> float:
        return k * getattr(other, name) + getattr(last, name)

    return replace(
        last, step_time=total("step_time"), compute_time=total("compute_time"), exposed_comm=total("exposed_comm"),
        recompute_time=total("recompute_time"), host_wait=total("host_wait"), copy_time=total("copy_time"),
        host_time=total("host_time"), hooks=int(total("hooks")), all_gathers=int(total("all_gathers")),
        all_gather_bytes=int(total("all_gather_bytes")),
        lower_bound=last.lower_bound + k * other.compute_time,  # the last's bound, then the others' compute
        comm_time={s: k * other.comm_time.get(s, 0.0) + t for s, t in last.comm_time.items()},
        peak_memory=top.allocated, reserved_memory=max(p.reserved for p in peaks), memory_at_peak=breakdown)
