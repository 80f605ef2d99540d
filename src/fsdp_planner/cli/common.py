"""What several commands do: load and trace the model a spec names, and get the plan they were asked for."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.markup import escape

import fsdp_planner.cli.render as render
from fsdp_planner.attention import Kernel, kernel
from fsdp_planner.choices import ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.claim import check_plan_matches, with_claimed_params
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.validity import check_forward_methods, check_plan_runs
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import BUILTINS, ModelSpec, as_spec, exit_message, hf, load_model
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, infeasible_message
from fsdp_planner.planners.registry import PolicyName, PolicyRequest, make_policy
from fsdp_planner.routing import DEFAULT_CAPACITY, WAY_OUT, consulted, data_dependent
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.sizing import with_memory_options
from fsdp_planner.sim.tracing import trace
from fsdp_planner.trace.failures import failed_at
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import shown_json


def load_trace(spec: ModelSpec | str, notes: Console, measure: bool = False, full: bool = False,
               precision: Precision | None = None, threads: int | None = None, repeats: int = 3) -> Trace:
    """The model's trace on meta tensors, in ``precision``'s compute dtype (default: the default precision's);
    with ``measure``, then timed for real on the local device (median of ``repeats`` steps, with ``threads`` CPU
    threads when given).
    ``full``: every module call traced (no replay of repeated blocks)."""
    with render.progress(f"tracing {spec}"):
        return _load_trace(spec, notes, measure, full, precision, threads, repeats)


def _load_trace(spec: ModelSpec | str, notes: Console, measure: bool, full: bool, precision: Precision | None,
                threads: int | None = None, repeats: int = 3) -> Trace:
    spec = as_spec(spec)
    lm = load_model(spec, meta=True)
    try:
        with kernel(spec.attention) as attention, consulted() as routed:
            tr = trace(lm.model, lm.example_inputs, lm.loss_fn, precision=precision or SimOptions().precision,
                       reuse=not full, routing=spec.routing or DEFAULT_CAPACITY)
    except PlannerError:  # a PrecisionError among them: the model fails in the compute dtype only
        raise
    except SystemExit as e:  # the model's forward or loss_fn: an error, never a silent exit with its status
        raise PlannerError(exit_message(e, f"running the forward, backward or loss_fn of '{spec}'")) from e
    except Exception as e:
        failed = failed_at(e)
        if data_dependent(e, failed.op if failed else None):
            raise PlannerError(f"tracing '{spec}' failed: {failed.describe() if failed else 'an op'} {WAY_OUT}") from e
        raise PlannerError(f"tracing '{spec}' failed: {model_error(e)}{_device_hint(e)}") from e
    for line in (*tr.notes, attention_note(spec, lm.model, attention), routing_note(spec, routed[0])):
        if line:
            notes.print(f"[dim]note: {escape(line)}[/dim]", highlight=False)
    if not measure:
        return tr
    from fsdp_planner.runtime.measure import check_fits, local_device
    from fsdp_planner.runtime.measure import measure as measure_ops

    device = local_device()
    check_fits(tr, device, spec)
    real = load_model(spec, meta=False)
    try:
        measured = measure_ops(real.model, real.example_inputs, real.loss_fn, repeats=repeats, device=device,
                              threads=threads)
    except PlannerError:
        raise
    except SystemExit as e:
        raise PlannerError(exit_message(e, f"measuring '{spec}' on {device.type}")) from e
    except Exception as e:
        raise PlannerError(f"measuring '{spec}' on {device.type} failed: {model_error(e)}") from e
    notes.print(f"[dim]compute times measured on this machine's {device.type} "
                f"({sum(measured.op_seconds or ()) * 1e3:.1f} ms of ops per step)"
                f"{'; CPU times, not the cluster GPUs' if device.type == 'cpu' else ''}[/dim]", highlight=False)
    return measured


def model_error(e: Exception) -> str:
    """What the model raised, led by the op and the module it failed in when an op of the step raised it."""
    failed = failed_at(e)
    return f"{failed.describe() + ' raised ' if failed else ''}{type(e).__name__}: {e}"


def attention_note(spec: ModelSpec, model: object, attention: Kernel) -> str | None:
    """Which attention kernel the trace assumed: transformers' implementation for an ``hf:`` model, else the
    kernel its SDPA calls ran. None for a built-in without ``--attention`` (they call the fused kernels, as the
    README says) and for a model that calls no SDPA, unless ``--attention`` was given: then it says the option
    changes nothing."""
    built = hf.attention_of(model) if hf.is_hf(spec.name) else None  # type: ignore[arg-type]
    if attention.calls == 0 and built is not None and (built != "eager" or not hf.has_attention(model)):  # type: ignore[arg-type]
        built = None  # a model without attention (a CNN): transformers records an implementation all the same
    if built is not None:
        kernel_name = spec.attention or ("eager" if built == "eager" else "sdpa")
        saved = "score matrices saved, O(seq^2)" if built == "eager" else "fused kernel, O(seq) saved"
        built = "flash stand-in" if built == hf.hf_attention.FUSED else built
        return (f"attention traced as {kernel_name} (transformers' attn_implementation '{built}': {saved}; "
                "--attention sdpa|flash|eager plans for another)")
    if attention.calls == 0 and spec.attention is not None:
        # said rather than ignored: the option changes nothing for a model whose step calls no SDPA
        return (f"--attention {spec.attention} changes nothing here: the step calls no scaled_dot_product_attention "
                "(the kernel --attention picks)")
    if attention.calls == 0 or (spec.name in BUILTINS and spec.attention is None):
        return None
    saved = "score matrices saved, O(seq^2)" if attention.name == "eager" else "fused kernel, O(seq) saved"
    return f"attention traced as {attention.name} ({saved}; --attention changes it)"


def routing_note(spec: ModelSpec, consulted: int) -> str | None:
    """Said rather than ignored: ``--routing`` on a step that routes nothing (a dense model) changes nothing."""
    if spec.routing is None or consulted:
        return None
    return (f"--routing {spec.routing:g} changes nothing here: nothing in the step routes tokens by their values (no "
            "data-dependent op or Hugging Face experts layer, what the balanced-routing stand-in sizes)")


def _device_hint(e: Exception) -> str:
    """Why a device mismatch happens while planning, and what to change."""
    text = f"{type(e).__name__} {e}"
    if "meta" not in text or "device" not in text.lower():
        return ""
    return ("; the model is built on the meta device for planning, so every tensor the forward or loss_fn uses "
            "must be made inside the factory (not at module level, and without an explicit device='cpu'/'cuda')")


def run_auto(tr: Trace, request: PolicyRequest, cluster: Cluster, options: SimOptions, model: str,
             must_fit: bool = True) -> AutoResult:
    """Auto's search; a result over the budget is an error unless ``must_fit`` is False (the caller reports it)."""
    capacity = cluster.gpu.memory_bytes
    if request.memory_budget is not None and request.memory_budget > capacity:
        render.note(f"--memory-budget {fmt_bytes(request.memory_budget)} is more than one {cluster.gpu.name} holds "
                    f"({fmt_bytes(capacity)}): a plan within it may not fit on the GPU")
    with render.progress(f"auto: searching plans for {cluster.name}"):
        policy = make_policy(request, cluster, options)
        assert isinstance(policy, AutoPolicy)
        result = policy.search(tr, model)
    if must_fit and not result.fits:
        raise PlannerError(infeasible_message(result))
    return result


def stamped(plan: Plan, tr: Trace, world: int | None, options: SimOptions | None) -> Plan:
    """``plan`` recording the memory options the command line asked for beside those it has (a plan file's offload
    or shard dims are kept; a --reduce-dtype replaces its reduce dtype). Shard dims need the shard size: none
    without ``world``."""
    if options is None:
        return plan
    placement = options.shard_placement if world is not None and not plan.shard_dims else ShardPlacement.DIM0
    shard = plan.shard_size(world) if world is not None else 1
    reduce = options.reduce_dtype.value if options.reduce_dtype else plan.reduce_dtype
    out = with_memory_options(plan, tr, shard, plan.offload or options.offload, placement, reduce)
    return out if not plan.shard_dims else replace(out, shard_dims=plan.shard_dims)


def policy_plan(tr: Trace, request: PolicyRequest, model: str, cluster: Cluster | None = None,
                options: SimOptions | None = None) -> Plan:
    """The plan a policy makes for the traced model (auto: for ``cluster``)."""
    if request.name is PolicyName.AUTO:
        if cluster is None:
            raise PlannerError("--policy auto plans for a cluster: add --cluster, e.g. --cluster h100:8")
        return run_auto(tr, request, cluster, options or SimOptions(), model).written_plan
    plan = make_policy(request).plan(tr, model)
    if cluster is not None:
        check_plan_world_size(plan, cluster.world_size)
    return stamped(plan, tr, cluster.world_size if cluster else None, options)


def load_plan(path: str, tr: Trace, model: ModelSpec | str) -> Plan:
    """The plan file for the traced ``model``; a hand-written one (module lists) gets its params derived."""
    plan = with_claimed_params(Plan.load(path), tr)
    check_hf_config(plan, as_spec(model), path)
    check_plan_matches(plan, tr)
    check_plan_runs(tr, plan)
    check_plan_methods(plan, model)
    asked = as_spec(model).attention or ""
    if plan.attention and plan.attention != asked:
        render.note(f"the plan was made for --attention {plan.attention} and this command traced "
                    f"{asked or 'the default kernel'}: add --attention {plan.attention} for the figures it was "
                    "planned with")
    return plan


def check_hf_config(plan: Plan, model: ModelSpec, path: str) -> None:
    """The plan was made for the model with the same ``--hf-config`` fields (use_cache changes the step's
    memory, a layer count its groups): else one line with the options that rebuild that model. A hand-written
    plan (no fingerprint) is for any model."""
    if not plan.fingerprint or plan.hf_config == dict(model.hf_config):
        return
    planned = " ".join(f"--hf-config {k}={shown_json(v)}" for k, v in plan.hf_config.items()) or "no --hf-config"
    raise PlannerError(f"plan file '{path}' was made with {planned}; give the same to run it on the same model")


def check_plan_methods(plan: Plan, model: ModelSpec | str) -> None:
    """The plan's ``forward_methods`` are methods of their modules, checked on the model built on meta (as verify
    does): the trace records only the methods the step called, and apply_plan would fail on the ranks."""
    if plan.forward_methods:
        check_forward_methods(plan, load_model(model, meta=True).model)
