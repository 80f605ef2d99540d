"""What several commands do: load and trace the model a spec names, and get the plan they were asked for."""

from __future__ import annotations

from rich.console import Console

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import check_plan_matches
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, infeasible_message
from fsdp_planner.planners.registry import PolicyName, PolicyRequest, make_policy
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.recorder import trace
from fsdp_planner.trace.records import Trace


def load_trace(spec: str, notes: Console, measure: bool = False, full: bool = False) -> Trace:
    """The model's trace on meta tensors; with ``measure``, then timed for real on the local device. ``full``:
    every module call traced (no replay of repeated blocks)."""
    lm = load_model(spec, meta=True)
    try:
        tr = trace(lm.model, lm.example_inputs, lm.loss_fn, reuse=not full)
    except PlannerError:
        raise
    except Exception as e:
        raise PlannerError(f"tracing '{spec}' failed: {type(e).__name__}: {e}") from e
    if not measure:
        return tr
    from fsdp_planner.runtime.measure import check_fits, local_device
    from fsdp_planner.runtime.measure import measure as measure_ops

    device = local_device()
    check_fits(tr, device, spec)
    real = load_model(spec, meta=False)
    try:
        measured = measure_ops(real.model, real.example_inputs, real.loss_fn, device=device)
    except PlannerError:
        raise
    except Exception as e:
        raise PlannerError(f"measuring '{spec}' on {device.type} failed: {type(e).__name__}: {e}") from e
    notes.print(f"[dim]compute times measured on this machine's {device.type} "
                f"({sum(measured.op_seconds or ()) * 1e3:.1f} ms of ops per step)"
                f"{'; CPU times, not the cluster GPUs' if device.type == 'cpu' else ''}[/dim]", highlight=False)
    return measured


def run_auto(tr: Trace, request: PolicyRequest, cluster: Cluster, options: SimOptions, model: str) -> AutoResult:
    result = AutoPolicy(cluster, request.memory_budget, request.target, options).search(tr, model)
    if not result.fits:
        raise PlannerError(infeasible_message(result))
    return result


def policy_plan(tr: Trace, request: PolicyRequest, model: str, cluster: Cluster | None = None,
                options: SimOptions | None = None) -> Plan:
    """The plan a policy makes for the traced model (auto: for ``cluster``)."""
    if request.name is PolicyName.AUTO:
        if cluster is None:
            raise PlannerError("--policy auto plans for a cluster: add --cluster, e.g. --cluster h100:8")
        return run_auto(tr, request, cluster, options or SimOptions(), model).plan
    return make_policy(request).plan(tr, model)


def load_plan(path: str, tr: Trace) -> Plan:
    plan = Plan.load(path)
    check_plan_matches(plan, tr)
    return plan
