"""A plan as code a training script can use without fsdp-planner: ``fsdp-planner export PLAN --format F``.

``python``: a module with ``apply(model, mesh)`` that checkpoints (``torch.utils.checkpoint``; op-level selective
checkpointing with its own copy of the policy, only in plans that have it), runs the offloaded modules' forward under
``save_on_cpu`` (only in plans that offload activations), calls ``fully_shard`` per group (children
first, lists as lists, each group's ``reshard_after_forward``, the mixed precision the plan was simulated with), the
root last, then registers the plan's forward methods and sets the prefetch lists. It never makes a process group:
the launcher's or the framework's is used, and without one ``make_mesh`` refuses in one line.
The other formats wrap that function the way each framework takes a model-sharding hook: Accelerate (``shard`` on
the processes ``accelerate launch`` started, before ``accelerator.prepare``, which keeps an ``FSDPModule`` as it
is; the launch config itself is ``accelerate_config.py``'s YAML), Lightning (a ``ModelParallelStrategy`` and
``configure_model(module, device_mesh)``) and torchtitan (a ``parallelize``-style function taking the model and its
``world_mesh``).

Names in a plan file are data, never code: every value from the plan is written as an ASCII Python literal by
``py_literal`` (the one way a plan's value enters the source), never into a docstring or a comment. A model file
is named relative to the export (``portable_model``), never by an absolute path.
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import Any

import torch

import fsdp_planner.apply.torchtitan_parallelize as titan
from fsdp_planner.apply.chunked_loss import CHUNKED_LOSS_FUNCTIONS
from fsdp_planner.apply.compile import waited_inputs
from fsdp_planner.apply.expert_parallel import expert_reduction, local_forward
from fsdp_planner.apply.fully_shard import module_parents
from fsdp_planner.apply.tensor_parallel import required_inputs_positional
from fsdp_planner.apply.torchtitan_job import torchtitan_job
from fsdp_planner.choices import DEFAULT_PRECISION, KERNEL_PACKAGES, ExportFormat, ReduceDtype
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.claim import dag_ancestors, hooked_modules, shard_order, topological_order
from fsdp_planner.fsdp2.expert_groups import alone_refusal, check_no_prefetch, hosts_or_refusal, named_parent
from fsdp_planner.fsdp2.float8 import FLOAT8_DIM_MULTIPLE, Float8
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.selective import POLICIES
from fsdp_planner.fsdp2.tensor_parallel import (
    EXPERT_TENSOR_DIMS,
    MOE_TP_EXPERT_DIMS,
    MOE_TP_EXPERT_IN_OUT_DIMS,
    TensorParallel,
    TPStyle,
    matches,
)
from fsdp_planner.models import hf
from fsdp_planner.models.hf_experts import NO_EP_TP
from fsdp_planner.sim.options import PRECISIONS, with_reduce_dtype
from fsdp_planner.trace.ops import ROUTER_GATES, op_names

APPLY_BODY = '''

def apply(model: nn.Module, mesh: DeviceMesh | None = None, **fsdp_kwargs: Any) -> nn.Module:
    """Shard ``model`` in place as the plan says and return it. ``fsdp_kwargs`` go to every ``fully_shard``: an
    mp_policy in place of ``mixed_precision()`` (the precision the plan was simulated with), an offload_policy or a
    shard_placement_fn in place of the plan's (OFFLOAD, SHARD_DIMS)."""
    mesh = mesh or make_mesh()
    fsdp_kwargs.setdefault("mp_policy", mixed_precision())
    fsdp_kwargs.setdefault("offload_policy", CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if OFFLOAD
                           else OffloadPolicy())
    fsdp_kwargs.setdefault("shard_placement_fn", shard_placement(model))
    if hasattr(type(model), "is_activation_checkpointing"):  # transformers' own, the plan's replaces it (5.x)
        if model.is_activation_checkpointing:
            model.activation_checkpointing_disable()
    elif getattr(model, "is_gradient_checkpointing", False) is True:  # (transformers 4.x)
        model.gradient_checkpointing_disable()
    modules = dict(model.named_modules())
    named = {n for names, _ in GROUPS for n in names} | set(CHECKPOINTED) | set(COMPILED) | {n for n, _ in
                                                                                           FORWARD_METHODS}
    missing = sorted(n for n in named if n not in modules)
    if missing:  # before any module is changed
        raise ValueError(f"the plan names modules this model does not have: {missing[:5]} (a plan made for another "
                         "model, or an edited one)")
    for name in CHECKPOINTED:  # activation checkpointing before sharding, as torchtitan does
        _checkpoint(modules[name])
    for name in COMPILED:  # then torch.compile, each module on its own, as torchtitan compiles its blocks
        modules[name].forward = torch.compile(modules[name].forward, fullgraph=True)
    targets = [[modules[n] for n in names] for names, _ in GROUPS]
    order, hooked = fully_shard_order(model, targets)  # children first, as fsdp-planner's apply_plan
    for i in order:
        names, reshard = GROUPS[i]
        fully_shard(targets[i] if len(targets[i]) > 1 else targets[i][0], mesh=mesh, reshard_after_forward=reshard,
                    **fsdp_kwargs)
    fully_shard(model, mesh=mesh, reshard_after_forward=ROOT_RESHARD_AFTER_FORWARD, **fsdp_kwargs)
    for name, method in FORWARD_METHODS:  # methods other than forward the step calls on a sharded module
        register_fsdp_forward_method(modules[name], method)
    groups = [*hooked, model]  # by the plan's group numbers: the root, last, is one a prefetch list may name
    for i, later in FORWARD_PREFETCH.items():
        groups[i].set_modules_to_forward_prefetch([groups[j] for j in later])
    for i, earlier in BACKWARD_PREFETCH.items():
        groups[i].set_modules_to_backward_prefetch([groups[j] for j in earlier])
    return model


def mixed_precision() -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for PRECISION: params all-gathered and computed in PARAM_DTYPE, grads reduced in
    REDUCE_DTYPE (None: FSDP2 keeps the dtype it has)."""
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)


def shard_placement(model: nn.Module) -> Callable[[nn.Parameter], Shard | None] | None:
    """Shard(dim) for the params SHARD_DIMS names (each dim must divide evenly by the shard size), FSDP2's default
    Shard(0) for the others; None when the plan shards every param on dim 0."""
    if not SHARD_DIMS:
        return None
    dims = {id(p): SHARD_DIMS[n] for n, p in model.named_parameters(remove_duplicate=False) if n in SHARD_DIMS}
    return lambda param: Shard(dims[id(param)]) if id(param) in dims else None


def _checkpoint(module: nn.Module) -> None:
    """Full activation checkpointing of ``module``'s every call (``torch.utils.checkpoint``, non-reentrant): only
    its inputs are kept after forward, and backward runs its forward again. The forward is wrapped in place, so
    FSDP2's hooks stay outside the checkpointed region: the recomputation runs in backward, after FSDP2 has
    gathered the params for it, as under torchtitan's ``checkpoint_wrapper``."""
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, early_stop=CHECKPOINT_EARLY_STOP, **kwargs)

    module.forward = checkpointed


def _world_size() -> int:
    if not dist.is_initialized():
        raise RuntimeError("no default process group: launch with torchrun (and call "
                           "torch.distributed.init_process_group()) or with your framework's launcher")
    return dist.get_world_size()


def make_mesh(device_type: str | None = None) -> DeviceMesh:
    """The plan's data-parallel mesh over the default process group (never made here: the launcher's or the
    framework's): 1-D, or (replicate, shard) for HSDP."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world = _world_size()
    if MESH is not None and MESH[0] * MESH[1] != world:
        raise ValueError(f"this plan was made for a {MESH[0]}x{MESH[1]} mesh ({MESH[0] * MESH[1]} ranks) and the job "
                         f"has {world}: make the plan again for {world} ranks")
    if MESH is None or MESH[0] == 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, MESH, mesh_dim_names=("dp_replicate", "dp_shard"))


def fully_shard_order(model: nn.Module, targets: list[list[nn.Module]]) -> tuple[list[int], list[nn.Module]]:
    """The order of the GROUPS' ``fully_shard`` calls on ``model`` (``targets``: each group's modules) and each
    group's FSDP module, as fsdp-planner's ``apply_plan`` has them, by its own functions below: a group holding a
    module below another group's module comes first (FSDP2's call claims every param below its modules down to the
    modules sharded before it: sharded after, the child's params would be the parent's); a group's FSDP module is
    its first module not below another of its own (``fully_shard`` hooks only those)."""
    named = {id(m): n for n, m in model.named_modules()}
    groups = [[named[id(m)] for m in ms] for ms in targets]
    parents = module_parents(model)
    order = shard_order(groups, parents)
    if len(order) < len(groups):
        raise ValueError("the plan's groups nest inside each other in a cycle: no fully_shard order exists (an "
                         "edited plan, or one made for another model)")
    modules = dict(model.named_modules())
    return order, [modules[hooked_modules(g, parents)[0]] for g in groups]
'''

HEADER = '''"""{title}

Generated by fsdp-planner from a plan file ({groups}). POLICY and MODEL name the plan and its model (a
model file relative to this file), PRECISION the mixed precision its step time and memory were simulated with
(apply() sets it unless given an mp_policy).
Each entry of GROUPS is one ``fully_shard`` call: (module names, reshard_after_forward); the root is sharded last
(with expert parallelism, the EXPERTS' entries are sharded as EXPERTS says).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint

'''


def py_literal(value: Any) -> str:
    """``value`` as an ASCII Python literal that evaluates back to it: the one way a plan's value enters the exported
    source. Built from the plain types only (a subclass's own ``__repr__`` could write anything), and a value of
    any other type is refused rather than written as its repr."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if not math.isfinite(value):  # no literal spells it, and no plan holds one (--hf-config refuses it)
            raise PlannerError(f"cannot export a plan holding {value}: a value must be a finite number")
        return float.__repr__(value)  # the shortest text that reads back to the same float, bit for bit
    if isinstance(value, str):
        # str's repr quotes and escapes quotes, backslashes and control characters; ascii escapes the rest
        return str.__repr__(value).encode("ascii", "backslashreplace").decode("ascii")
    if isinstance(value, (list, tuple)):
        items = ", ".join(py_literal(v) for v in value)
        if isinstance(value, list):
            return f"[{items}]"
        return f"({items}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py_literal(k)}: {py_literal(v)}" for k, v in value.items()) + "}"
    raise PlannerError(f"cannot export a plan holding a {type(value).__name__}: plans hold names, numbers and lists")


def portable_model(name: str, where: str | os.PathLike[str] | None = None) -> str:
    """The model as an export names it: a model file (``path/file.py:fn``, ``hf:path``) relative to ``where`` (the
    export's directory; None: this one), so the export holds no absolute path and moves with its model; a built-in,
    a module, a Hub name or a file not found from this directory as it is."""
    if name.startswith("hf:"):
        prefix, target, rest = "hf:", name[3:], ""
        if not os.path.exists(target):  # a Hub id, or a shipped config's name
            return name
    else:
        target, colon, function = name.rpartition(":")
        if not target.endswith(".py") or not os.path.exists(target):  # a file not found from here (the plan was
            return name  # made in another directory): named as the plan names it, not by a path that misses it
        prefix, rest = "", colon + function
    relative = os.path.relpath(os.path.abspath(target), os.path.abspath(where or os.curdir))
    return prefix + Path(relative).as_posix() + rest


def _dtype(dtype: torch.dtype | None) -> str:
    """A torch dtype as source (``torch.bfloat16``); only the precisions' own dtypes reach here."""
    return "None" if dtype is None else str(dtype)


ROOT_SHARD_END = "    fully_shard(model, mesh=mesh, reshard_after_forward=ROOT_RESHARD_AFTER_FORWARD, **fsdp_kwargs)\n"
GROUP_SHARD = ("        fully_shard(targets[i] if len(targets[i]) > 1 else targets[i][0], mesh=mesh, "
               "reshard_after_forward=reshard,\n                    **fsdp_kwargs)\n")
# plans with fp32 groups only (Group.param_dtype): those groups get their own policy
FP32_GROUP_SHARD = ("        kwargs = {**fsdp_kwargs, \"mp_policy\": full_precision(fsdp_kwargs[\"mp_policy\"])} "
                    "if i in FP32_GROUPS \\\n            else fsdp_kwargs\n"
                    "        fully_shard(targets[i] if len(targets[i]) > 1 else targets[i][0], mesh=mesh, "
                    "reshard_after_forward=reshard,\n                    **kwargs)\n")
FP32_TAIL = """

def full_precision(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    \"\"\"The policy of the FP32_GROUPS beside ``policy``: params all-gathered and computed in fp32, the group's
    inputs cast to fp32 and its outputs back to ``policy``'s compute dtype for the modules after it (BatchNorm's
    running stats are fp32 buffers, which FSDP2 does not cast).\"\"\"
    if policy.param_dtype is None:
        return policy
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=policy.reduce_dtype,
                                output_dtype=policy.param_dtype, cast_forward_inputs=True)
"""

MESH_LINE = "    mesh = mesh or make_mesh()\n"
KERNELS_LINE = "    check_kernels()\n"
KERNELS_TAIL = '''

def check_kernels() -> None:
    """A warning for each kernel package (KERNELS: pip name -> module) the plan's time and memory assume that this
    Python cannot import: transformers then runs its PyTorch reference of those layers, whose activations are far
    larger than the plan's."""
    import importlib.util
    import warnings

    for package, module in KERNELS.items():
        if importlib.util.find_spec(module) is None:
            warnings.warn(f"the plan's step time and memory assume {package}'s kernels, which this Python lacks "
                          f"(pip install {package}): transformers runs its PyTorch reference of those layers instead, "
                          "far slower and holding far more memory", stacklevel=2)
'''
CHECKPOINT_LINE = "        _checkpoint(modules[name])\n"
SELECTIVE_LOOP = """    for name, policy in SELECTIVE.items():  # op-level selective activation checkpointing
        _checkpoint_selective(modules[name], policy)
"""

OFFLOAD_LOOP = """    for name in OFFLOADED_ACTIVATIONS:  # saved activations copied to the host, not overlapped
        _offload_activations(modules[name])
"""

OFFLOAD_TAIL = '''

def _offload_activations(module: nn.Module) -> None:
    """``module``'s forward runs under ``torch.autograd.graph.save_on_cpu``: each tensor it saves for backward is
    copied to pinned host memory and copied back when backward needs it, both on the current stream."""
    from torch.autograd.graph import save_on_cpu

    forward = module.forward
    pin = torch.cuda.is_available()

    def offloaded(*args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=pin):
            return forward(*args, **kwargs)

    module.forward = offloaded
'''

SELECTIVE_TAIL = '''

def _checkpoint_selective(module: nn.Module, policy: str) -> None:
    """Op-level selective activation checkpointing (torchtitan's "op" option): ``module``'s forward runs under
    non-reentrant checkpoint; the outputs of the ops ``policy`` saves are kept for backward, every other op (and
    every second op of EVERY_SECOND within one call) runs again, and an mm of a weight shaped as a router gate's
    (a Linear whose name ends with one of RECOMPUTE_FQNS), uncounted. Not the composable ``checkpoint(context_fn=...)``:
    its recomputation reruns FSDP2's pre-forward inside SAC's replay, which SAC refuses."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    from torch.utils.checkpoint import checkpoint as run_checkpointed

    save, every_second = _ops(SAVED_OPS[policy]), _ops(EVERY_SECOND[policy])
    forced = {(p.shape[1], p.shape[0]) for n, p in module.named_parameters()
              if p.dim() == 2 and n.endswith(".weight") and any(
                  n[:-7] == g or n[:-7].endswith("." + g) for g in RECOMPUTE_FQNS[policy])}

    def context_fn() -> Any:
        counts = {False: 0, True: 0}  # per call, forward and recomputation apart

        def policy_fn(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in every_second and tuple(args[1].shape) in forced:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if func in every_second:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy_fn)

    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return run_checkpointed(forward, *args, use_reentrant=False, context_fn=context_fn,
                                early_stop=CHECKPOINT_EARLY_STOP, **kwargs)

    module.forward = checkpointed


def _ops(names: list[str]) -> set[Any]:
    """The ops of this torch among ``names`` ("namespace.op.overload"; one this torch lacks never runs)."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(getattr(packet, overload))
    return found
'''


def selective_constants(plan: Plan) -> str:
    """The plan's op-level checkpointing as Python literals: modules, and each policy's ops by name."""
    used = dict.fromkeys(plan.selective_checkpointing.values())
    saved = {p.value: op_names(POLICIES[p].saves) for p in used}
    every_second = {p.value: op_names(POLICIES[p].every_second) for p in used}
    forced = {p.value: list(ROUTER_GATES) if POLICIES[p].recompute_router else [] for p in used}
    modules = {m: p.value for m, p in plan.selective_checkpointing.items()}
    return "\n".join([f"SELECTIVE: dict[str, str] = {py_literal(modules)}",
                      f"SAVED_OPS: dict[str, list[str]] = {py_literal(saved)}",
                      f"EVERY_SECOND: dict[str, list[str]] = {py_literal(every_second)}",
                      f"RECOMPUTE_FQNS: dict[str, list[str]] = {py_literal(forced)}"])


# each optimizer as torch makes it (foreach: torch's default on GPUs, ``_default_to_fused_or_foreach``)
OPTIMIZER_CALLS = {"sgd": "torch.optim.SGD(params, lr) (foreach)",
                   "sgd-momentum": "torch.optim.SGD(params, lr, momentum) (foreach)",
                   "adam": "torch.optim.Adam (foreach)", "adamw": "torch.optim.AdamW (foreach)",
                   "adam-fused": "torch.optim.Adam(..., fused=True)",
                   "adamw-fused": "torch.optim.AdamW(..., fused=True)",
                   "adam-fused-bf16-states": "fused Adam with its two states in bf16 (torchtitan's "
                                             "fused_opt_states_bf16)",
                   "adamw-fused-bf16-states": "fused AdamW with its two states in bf16 (torchtitan's "
                                              "fused_opt_states_bf16)"}


def plan_constants(plan: Plan, precision: Precision) -> str:
    """The plan, and the precision its numbers assumed, as Python literals."""
    # by the plan's group numbers, the root's (the last) among them, as apply_plan sets them
    fwd = {i: list(g.forward_prefetch) for i, g in enumerate(plan.groups) if g.forward_prefetch}
    bwd = {i: list(g.backward_prefetch) for i, g in enumerate(plan.groups) if g.backward_prefetch}
    mesh = (plan.mesh.replicate, plan.mesh.shard) if plan.mesh is not None else None
    param_dtype, reduce_dtype = precision.fsdp_dtypes()
    lines = [f"POLICY: str = {py_literal(plan.policy)}",
             f"MODEL: str = {py_literal(plan.model)}",
             f"PRECISION: str = {py_literal(precision.name)}",
             f"PARAM_DTYPE: torch.dtype | None = {_dtype(param_dtype)}",
             f"REDUCE_DTYPE: torch.dtype | None = {_dtype(reduce_dtype)}"]
    if plan.optimizer:  # the optimizer the plan's step time and memory were simulated with: the loop makes it
        lines.append(f"OPTIMIZER: str = {py_literal(plan.optimizer)}  # the plan's figures assume "
                     f"{OPTIMIZER_CALLS[plan.optimizer]}: make your optimizer so")
    if plan.zero_grad:  # the grads' lifetime the plan's memory assumed: the loop clears them so
        lines.append("SET_TO_NONE: bool = False  # the plan's memory assumes optimizer.zero_grad(set_to_none=False): "
                     "the sharded grads kept all step")
    w = plan.workload
    if w is not None and w.micro_batches > 1:  # gradient accumulation: the step the figures are of
        sync = ("every micro-batch's backward reduce-scatters its gradients (torchtitan's loop)" if w.sync_every else
                "only the last micro-batch's backward reduce-scatters: model.set_requires_gradient_sync(False) "
                "before the others, True before the last")
        lines.append(f"MICRO_BATCHES: int = {w.micro_batches}  # forward and backward passes an optimizer step "
                     f"(batch {w.batch // w.micro_batches:,} each): the plan's figures assume them, and that {sync}")
    if plan.hf_config:  # the --hf-config fields the plan was made with: the same model needs them
        lines.append(f"HF_CONFIG: dict[str, object] = {py_literal(dict(plan.hf_config))}  # set on the model's "
                     "config before building it")
    if plan.model.startswith("hf:") and plan.checkpoints:
        lines.append("# a transformers model trains with config.use_cache = False under CHECKPOINTED (whatever "
                     "HF_CONFIG says): a checkpointed layer must not write its KV cache twice")
    if precision.autocast:
        lines.append("# PRECISION casts with torch.autocast in the training loop; FSDP2 runs in the params' dtype")
    if precision.storage_dtype != torch.float32:
        lines.append(f"# PRECISION keeps the params in {_dtype(precision.storage_dtype)}: build the model in it")
    lines.append("GROUPS: list[tuple[list[str], bool | int]] = [")
    lines += [f"    {py_literal((list(g.modules), g.reshard_after_forward))}," for g in plan.inner_groups]
    lines.append("]")
    lines.append(f"ROOT_RESHARD_AFTER_FORWARD: bool | int = {py_literal(plan.root.reshard_after_forward)}")
    lines.append(f"CHECKPOINTED: list[str] = {py_literal(list(plan.activation_checkpointing))}")
    lines.append(f"CHECKPOINT_EARLY_STOP: bool = {py_literal(plan.checkpoint_early_stop)}  # False: each checkpointed "
                 "forward runs again whole in backward")
    lines.append(f"COMPILED: list[str] = {py_literal(list(plan.compiled))}")
    lines.append(f"COMPILED_LOSS: bool = {py_literal(plan.compiled_loss)}  # True: the plan's memory is of the loss "
                 "torch.compile'd: run yours as loss_fn = torch.compile(loss_fn)")
    lines.append(f"LOSS_CHUNKS: int = {py_literal(plan.loss_chunks)}  # > 0: the plan's memory is of the output layer "
                 "and the loss run in that many chunks of the tokens, each with its backward (torchtitan's "
                 "ChunkedLossWrapper)")
    lines.append(f"FORWARD_METHODS: list[tuple[str, str]] = {py_literal([tuple(m) for m in plan.forward_methods])}")
    lines.append(f"FORWARD_PREFETCH: dict[int, list[int]] = {py_literal(fwd)}")
    lines.append(f"BACKWARD_PREFETCH: dict[int, list[int]] = {py_literal(bwd)}")
    lines.append(f"MESH: tuple[int, int] | None = {py_literal(mesh)}  # (replicate, shard); None: pure FSDP over the "
                 "world")
    lines.append(f"OFFLOAD: bool = {py_literal(plan.offload)}  # CPUOffloadPolicy: sharded state and the optimizer "
                 "step on the CPU")
    lines.append(f"SHARD_DIMS: dict[str, int] = {py_literal(dict(plan.shard_dims))}  # param -> dim it is sharded on, "
                 "where not 0")
    return "\n".join(lines)


ACCELERATE_TAIL = '''

def shard(accelerator: Any, model: nn.Module) -> nn.Module:
    """Shard ``model`` as the plan says over the processes ``accelerate launch --config_file`` started (the YAML
    written beside this file) and return it; make the optimizer after this, on its params, then ``prepare`` both.
    Uses Accelerate's process group and never makes one: without one (``distributed_type`` NO, e.g. a plain
    ``python`` run) it refuses."""
    kind = str(accelerator.distributed_type.value)
    if kind == "NO" or not dist.is_initialized():
        raise RuntimeError(f"Accelerate runs no distributed job here (distributed_type {kind}): launch the script "
                           "with accelerate launch --config_file and the YAML written beside this file (on a machine "
                           "without GPUs, with ACCELERATE_USE_CPU=true)")
    return apply(model, make_mesh(accelerator.device.type))


def prepare(accelerator: Any, model: nn.Module, *objects: Any) -> Any:
    """``accelerator.prepare(model, *objects)`` for a model ``shard`` sharded, returned as Accelerate returns them.
    Accelerate's FSDP2 (``distributed_type`` FSDP) keeps a model that is already sharded as it is; where Accelerate
    has no FSDP (it runs FSDP on accelerators only: on CPU it is MULTI_CPU, whose DDP refuses DTensor params) the
    model is returned as sharded and only ``objects`` are prepared."""
    if not isinstance(model, FSDPModule):
        raise RuntimeError("prepare takes the model shard(accelerator, model) returned: call shard first")
    if str(accelerator.distributed_type.value) == "FSDP":
        return accelerator.prepare(model, *objects)
    prepared = accelerator.prepare(*objects) if objects else ()
    return (model, *(prepared if isinstance(prepared, tuple) else (prepared,))) if objects else model
'''

LIGHTNING_TAIL = '''

def strategy(devices: int, num_nodes: int = 1, **kwargs: Any) -> Any:
    """Lightning's ``ModelParallelStrategy`` for the plan on ``devices`` per node x ``num_nodes`` (give the Trainer
    the same): FSDP2 over every rank, no tensor parallelism; ``kwargs`` go to the strategy."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=devices * num_nodes, tensor_parallel_size=1, **kwargs)


def configure_model(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` as the plan says: call ``configure_model(self.model, self.device_mesh)`` (or the module
    to shard) from ``LightningModule.configure_model``. The groups go on the mesh's ``data_parallel`` dim; an
    HSDP plan (MESH) builds its (replicate, shard) mesh over Lightning's process group."""
    if MESH is not None and MESH[0] > 1:
        return apply(model, make_mesh(device_mesh.device_type))
    names = device_mesh.mesh_dim_names or ()
    return apply(model, device_mesh["data_parallel"] if "data_parallel" in names else device_mesh)
'''

TORCHTITAN_TAIL = '''

def parallelize(model: nn.Module, world_mesh: DeviceMesh, **fsdp_kwargs: Any) -> nn.Module:
    """A torchtitan-style ``parallelize`` (in place of ``apply_fsdp``): shard the model with the plan's groups on
    the data-parallel part of ``world_mesh`` (``dp_shard`` or torchtitan's ``fsdp``, and ``dp_replicate`` for
    HSDP)."""
    names = world_mesh.mesh_dim_names or ()
    shard = next((n for n in ("dp_shard", "fsdp") if n in names), None)  # (torchtitan's name for it since 2026)
    if "dp_replicate" in names and shard:
        dp = world_mesh["dp_replicate", shard]
    elif shard:
        dp = world_mesh[shard]
    else:
        dp = world_mesh
    return apply(model, dp, **fsdp_kwargs)
'''

# a TP plan's prepare refuses a DataLoader: the YAML gives Accelerate no parallelism_config (its TP is transformers'
# own), so Accelerate has no mesh and gave each process batches of its own, silently, where the ranks of a TP
# group train the same ones (a trial)
ACCELERATE_TP_CHECK = '''    if any(isinstance(o, torch.utils.data.DataLoader) for o in objects):
        raise RuntimeError(f"prepare takes no DataLoader for this plan's TP {TP_DEGREE}: Accelerate would give each "
                           "process batches of its own, and the ranks of a TP group must train the same ones; give "
                           "the loader a sampler over the data-parallel ranks (num_replicas=accelerator.num_processes "
                           f"// {TP_DEGREE}, rank=accelerator.process_index // {TP_DEGREE}) and use it unprepared")
'''
ACCELERATE_TP_TAIL = ACCELERATE_TAIL.replace(
    '    if str(accelerator.distributed_type.value) == "FSDP":\n',
    ACCELERATE_TP_CHECK + '    if str(accelerator.distributed_type.value) == "FSDP":\n')
TAILS = {ExportFormat.PYTHON: "", ExportFormat.ACCELERATE: ACCELERATE_TAIL, ExportFormat.LIGHTNING: LIGHTNING_TAIL,
         ExportFormat.TORCHTITAN: TORCHTITAN_TAIL}
# with TP, ``apply`` takes the whole mesh (its dp and tp dims): torchtitan's world mesh, Lightning's device mesh
TP_TAILS = {ExportFormat.LIGHTNING: '''

def strategy(devices: int, num_nodes: int = 1, **kwargs: Any) -> Any:
    """Lightning's ``ModelParallelStrategy`` for the plan on ``devices`` per node x ``num_nodes`` (give the Trainer
    the same): TP over TP_DEGREE consecutive ranks, FSDP2 over the rest; ``kwargs`` go to the strategy."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=devices * num_nodes // TP_DEGREE, tensor_parallel_size=TP_DEGREE,
                                 **kwargs)


def configure_model(model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """TP and FSDP2 as the plan says: call ``configure_model(self.model, self.device_mesh)`` (or the module to
    shard) from ``LightningModule.configure_model``; TP_LAYOUT goes over the mesh's ``tensor_parallel`` dim, the
    groups over its ``data_parallel`` dim. With LOSS_PARALLEL the training_step's loss runs under loss_context(),
    and so does its backward, which Lightning runs outside training_step: override ``LightningModule.backward``
    (see LOSS_PARALLEL), or the backward fails ("got mixed torch.Tensor and DTensor"). Lightning's mesh has one
    data-parallel dim: an HSDP plan (MESH) builds its (dp_replicate, dp_shard, tp) mesh over Lightning's process
    group, TP over the same consecutive ranks."""
    if MESH is not None and MESH[0] > 1:
        return apply(model, make_mesh(device_mesh.device_type))
    return apply(model, device_mesh)
''',
            ExportFormat.TORCHTITAN: '''

def parallelize(model: nn.Module, world_mesh: DeviceMesh, **fsdp_kwargs: Any) -> nn.Module:
    """A torchtitan-style ``parallelize`` (in place of ``apply_tp`` and ``apply_fsdp``): TP_LAYOUT over the ``tp``
    dim of ``world_mesh``, then the plan's groups sharded on its ``dp_shard`` (and ``dp_replicate``) dims."""
    return apply(model, world_mesh, **fsdp_kwargs)
''', ExportFormat.ACCELERATE: ACCELERATE_TP_TAIL}
TITLES = {ExportFormat.PYTHON: "An FSDP2 plan as code: apply(model, mesh).\n\nIn a training script launched by "
                               "torchrun (torchrun --nproc-per-node N train.py): dist.init_process_group(),\nbuild "
                               "the model, "
                               "then model = apply(model, make_mesh()) before the optimizer is made over\n"
                               "model.parameters(); a model built on the meta device is materialized after apply "
                               "(to_empty, then\nits init).",
          ExportFormat.ACCELERATE: "An FSDP2 plan for Hugging Face Accelerate: shard(accelerator, model), then "
                                   "prepare(accelerator, model, ...).",
          ExportFormat.LIGHTNING: "An FSDP2 plan for Lightning: Trainer(strategy=strategy(devices)) and "
                                  "configure_model(self.model, self.device_mesh).",
          ExportFormat.TORCHTITAN: "An FSDP2 plan for a torchtitan-style trainer: parallelize(model, world_mesh)."}


FLOAT8_LINE = "    convert_float8(model)  # float8 training: torchao swaps the Linears before TP and fully_shard\n"
FLOAT8_TAIL = '''

def convert_float8(model: nn.Module) -> None:
    """torchao's float8 training on the Linears torchtitan's filter keeps (both weight dims multiples of
    FLOAT8["dim_multiple"], no FLOAT8["filter_fqns"] entry in the name), plain nn.Linear whose weight is not tied
    (a subclass's own forward, or a tie, would not survive the swap); emulated where the device has no float8
    matmul (a CPU, a GPU before sm89). torchao is needed: pip install torchao."""
    import collections
    import dataclasses

    import torchao.float8 as float8
    from torchao.float8.float8_linear import Float8Linear

    if any(isinstance(m, Float8Linear) for m in model.modules()):
        return  # converted already: torchtitan's Float8LinearConverter ran at the model's build
    cuda = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(FLOAT8["recipe"]), emulate=not cuda,
                                 enable_fsdp_float8_all_gather=FLOAT8["fsdp_float8_all_gather"])

    owners = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def kept(module: nn.Module, fqn: str) -> bool:  # a Linear torchtitan's filter keeps, of any class
        return isinstance(module, nn.Linear) and owners[id(module.weight)] == 1 \\
            and all(d % FLOAT8["dim_multiple"] == 0 for d in module.weight.shape) \\
            and not any(f in fqn for f in FLOAT8["filter_fqns"])

    subclassed = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for n, m in model.named_modules()
                         if kept(m, n) and type(m) is not nn.Linear})
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, n: type(m) is nn.Linear and kept(m, n),
                                      config=config)
    if subclassed and not any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError(f"the plan trains the Linears in float8 and this model's are {subclassed[0]}, a subclass "
                         "of nn.Linear whose own forward torchao's swap would lose: none was converted (torchtitan's "
                         "model: make the plan with --float8 rowwise, which its own converter applies)")


def after_optimizer_step(model: nn.Module) -> None:
    """Call after each optimizer.step(): with precomputed scales, the converted weights' one amax all-reduce for
    the next step's float8 all-gathers."""
    if FLOAT8["precompute_scale"]:
        import torchao.float8 as float8

        float8.precompute_float8_dynamic_scale_for_fsdp(model)
'''


def float8_constants(f8: Float8) -> str:
    settings = {**f8.to_dict(), "dim_multiple": FLOAT8_DIM_MULTIPLE}
    return f"FLOAT8: dict[str, Any] = {py_literal(settings)}  # float8 training (torchao), as the plan was simulated\n"


TP_APPLY_LINE = MESH_LINE
COMPILE_LINE = ("    for name in COMPILED:  # then torch.compile, each module on its own, as torchtitan compiles its "
                "blocks\n")
COMPILE_ASSIGN = "        modules[name].forward = torch.compile(modules[name].forward, fullgraph=True)\n"
# (written where the plan compiles: blocks of one class whose params differ in shape need a graph each)
RECOMPILE_ROOM = (
    "    # blocks of one class with params of other shapes each need a graph of their own in dynamo's cache of their\n"
    "    # shared forward: room for two each (a new batch size recompiles once), or fullgraph=True fails at the limit\n"
    "    codes = [getattr(getattr(modules[n].forward, \"__func__\", modules[n].forward), \"__code__\", n)\n"
    "             for n in COMPILED]\n"
    "    dynamo = torch._dynamo.config\n"
    "    dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * max(codes.count(c) for c in codes))\n"
    "    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 2 * len(COMPILED))\n"
)
# (as apply_compile sets it, and torchtitan's: EP's local_forward swaps the experts' params inside a checkpointed block)
EP_SIDE_EFFECT = (
    "    # EP's experts swap their DTensor params for local tensors while they run: dynamo refuses that side\n"
    "    # effect under a checkpoint unless it is not replayed in the recomputation (undone after each call)\n"
    "    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True\n")
TP_SPLIT = """    mesh, tp_mesh = split_mesh(mesh)  # TP: parallelize_module over tp first, then FSDP over the dp dims
    tensor_parallel(model, tp_mesh)
"""
TP_CONSTANTS = """TP_DEGREE: int = {degree}  # tensor parallelism over the innermost mesh dim (consecutive ranks): the
# ranks of a TP group train one batch (their data-parallel rank's), so give them the same one
TP_LAYOUT: dict[str, str] = {layout}  # module name or pattern ('*': one part) -> style
# LOSS_PARALLEL: the output head keeps vocab-sharded logits: the loss and its backward run under loss_context()
# (Lightning runs the backward outside training_step: give the LightningModule
# def backward(self, loss, *args, **kwargs): with loss_context(): loss.backward(*args, **kwargs))
LOSS_PARALLEL: bool = {loss_parallel}
ASYNC_TP: bool = {async_tp}  # torchtitan's async TP (takes effect under torch.compile)
FLOAT8_TP: bool = {float8_tp}  # torchao's float8 TP styles: activations all-gathered in float8 (float8 Linears)
MLA_ROPE_DIM: int = {mla_rope_dim}  # mla_kv_a_proj: its output's last features (the rope key), grad all-reduced
"""

TP_TAIL = '''

def make_mesh(device_type: str | None = None) -> DeviceMesh:
    """The plan's device mesh over the default process group (never made here), with named dims: (dp_replicate,)
    dp_shard, tp."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    world = _world_size()
    if MESH is None and world % TP_DEGREE:  # (any multiple of TP_DEGREE runs: FSDP over the rest)
        raise ValueError(f"this plan's tensor parallelism over {TP_DEGREE} ranks does not divide the job's {world} "
                         f"ranks: launch a multiple of {TP_DEGREE}, or make the plan again for {world} ranks")
    replicate, shard = MESH if MESH is not None else (1, world // TP_DEGREE)
    if replicate * shard * TP_DEGREE != world:
        raise ValueError(f"this plan was made for {replicate}x{shard} data-parallel ranks x TP {TP_DEGREE} "
                         f"({replicate * shard * TP_DEGREE} ranks) and the job has {world}: make the plan again for "
                         f"{world} ranks")
    dims = {"dp_replicate": replicate, "dp_shard": shard, "tp": TP_DEGREE}
    dims = {k: v for k, v in dims.items() if v > 1 or k == "dp_shard"}
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """(data-parallel mesh, TP mesh) of a mesh with named dims: torchtitan's ((dp_replicate,) fsdp, tp; dp_shard
    before 2026), Accelerate's (dp_replicate, dp_shard, tp) or Lightning's (data_parallel, tensor_parallel)."""
    names = mesh.mesh_dim_names or ()
    tp = next((n for n in ("tp", "tensor_parallel") if n in names), None)
    dp = tuple(n for n in ("dp_replicate", "dp_shard", "fsdp", "data_parallel") if n in names)
    if tp is None or not dp:
        raise ValueError(f"this plan has tensor parallelism: give a mesh with data-parallel and 'tp' dims, got {names}")
    return mesh[dp if len(dp) > 1 else dp[0]], mesh[tp]


def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``parallelize_module`` over ``tp_mesh`` with each TP_LAYOUT style as torch names it; torchtitan's MoE
    styles, which no torch style stands for, with ``distribute_module`` (token_split: by EP's dispatch)."""
    modules = dict(model.named_modules())
    styles = {}
    for pattern, style in TP_LAYOUT.items():
        hits = [n for n in modules if _matches(pattern, n)]
        if not hits:
            raise ValueError(f"TP_LAYOUT names {pattern!r}, which matches no module of this model")
        styles.update(dict.fromkeys(hits, style))
    moe = ("moe_sequence", "replicate", "token_split", "expert_tensor", *PACKED_DIMS, "mla_kv_a_proj")
    float8 = _float8_styled(modules, styles) if FLOAT8_TP else set()
    for name, style in styles.items():  # (before the styles' own hooks, which read positional inputs)
        if style in ("gather_input", "moe_sequence"):
            modules[name].register_forward_pre_hook(required_inputs_positional, with_kwargs=True)
    parallelize_module(model, tp_mesh, {n: _tp_style(s, modules[n], n in float8) for n, s in styles.items()
                                        if s not in moe})
    for name, style in styles.items():  # experts first: the MoE layer's distribute_module replicates the rest
        if style == "expert_tensor":  # each expert's hidden units sharded over tp, every routed token run
            distribute_module(modules[name], tp_mesh, _shard_hidden, _experts_input, _experts_output)
        elif style in PACKED_DIMS:  # transformers' packed experts, run on their local shards
            distribute_module(modules[name], tp_mesh, functools.partial(_shard_packed, PACKED_DIMS[style]),
                              _local_experts_input, _local_experts_output)
    for name, style in styles.items():
        if style == "moe_sequence":  # the MoE layer: input all-gathered, partial output reduce-scattered
            # (every param below it not yet a DTensor is replicated: the experts are distributed over ep before)
            distribute_module(modules[name], tp_mesh, None, _moe_input, _moe_output)
        elif style == "replicate":  # replicated params (a router gate, per-head norms): their grads summed over tp
            distribute_module(modules[name], tp_mesh, None, _replicated_input, _replicated_output)
        elif style == "mla_kv_a_proj":  # whole on each rank; the rope key's grad (every head reads it) summed over tp
            if not isinstance(modules[name], nn.Linear) or modules[name].out_features <= MLA_ROPE_DIM:
                raise ValueError(f"mla_kv_a_proj: {name} is no nn.Linear of more than MLA_ROPE_DIM output features")
            modules[name].register_forward_hook(lambda m, args, out: _rope_grad_all_reduced(out, tp_mesh))
    if ASYNC_TP:  # torchtitan's switch: the all-gathers and reduce-scatters fused with their matmuls by compile
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def _float8_styled(modules: dict[str, nn.Module], styles: dict[str, str]) -> set[str]:
    """The modules torchao's float8 TP styles take (FLOAT8_TP): the float8 Linears in a colwise or rowwise style,
    and each gather_input module whose colwise Linears all are (its input cast once, before the all-gather)."""
    from torchao.float8.float8_linear import Float8Linear

    out = {n for n, s in styles.items()
           if s in ("colwise", "rowwise", "rowwise_sequence") and isinstance(modules[n], Float8Linear)}
    for name, style in styles.items():
        readers = [m for m, s in styles.items() if s == "colwise" and m.startswith(name + ".")]
        if style == "gather_input" and readers and all(m in out for m in readers):
            out.add(name)
    return out


def _tp_style(style: str, module: nn.Module, float8: bool = False) -> Any:
    """The torch style a TP_LAYOUT style names (torchao's float8 one where ``float8``); gather_input redistributes
    the module's first input only."""
    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    if style == "gather_input":  # one layout per required positional input; the rest and keywords pass through
        params = inspect.signature(module.forward).parameters.values()
        others = (None,) * (max(1, sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                                       and p.default is p.empty for p in params)) - 1)
        return prepare(input_layouts=(Shard(1), *others), desired_input_layouts=(Replicate(), *others),
                       input_kwarg_layouts={}, desired_input_kwarg_layouts={})
    return {
        "colwise": lambda: colwise(),
        "rowwise": lambda: rowwise(),
        "rowwise_sequence": lambda: rowwise(output_layouts=Shard(1)),
        "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split": lambda: RowwiseParallel(input_layouts=Replicate()),
        # (its input whole under a chunked loss: chunked_loss_step gathers the hidden states once)
        "sequence_colwise": lambda: ColwiseParallel(input_layouts=Replicate() if LOSS_CHUNKS else Shard(1),
                                                    use_local_output=not LOSS_PARALLEL,
                                                    output_layouts=Shard(-1) if LOSS_PARALLEL else Replicate()),
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_sequence": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "sequence_parallel": lambda: SequenceParallel(),
    }[style]()


def _moe_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """The MoE layer's first input all-gathered from its sequence shard; its grad, partial, reduce-scattered."""
    x, *rest = inputs
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return (x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()]), *rest)


def _moe_output(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The MoE layer's partial output (each TP rank's experts' tokens) reduce-scattered onto the sequence dim."""
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


EXPERT_TENSOR_DIMS = {expert_dims}  # expert_tensor: the hidden dim of each grouped-experts param


def _shard_hidden(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, p in list(module.named_parameters(recurse=False)):
        if pname not in EXPERT_TENSOR_DIMS:
            raise ValueError(f"expert_tensor shards grouped experts' {sorted(EXPERT_TENSOR_DIMS)}, not {pname!r}")
        sharded = distribute_tensor(p.data, mesh, [Shard(EXPERT_TENSOR_DIMS[pname])])
        module.register_parameter(pname, nn.Parameter(sharded, requires_grad=p.requires_grad))


def _experts_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """The experts' routed rows, whole on every TP rank; their grad partial (this rank's hidden units' share)."""
    x, *rest = inputs
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False, grad_placements=[Partial()]), *rest)


def _experts_output(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """Partial over TP (summed by the MoE layer's reduce-scatter); its grad whole on every rank."""
    return out.to_local(grad_placements=[Replicate()])


# the packed experts' styles: (dim, split factor) of each packed experts' param
PACKED_DIMS = {packed_dims}


def _shard_packed(dims: dict, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """gate_up_proj's gate and up units each split over tp (a rank's local shard: its gate units, then its up
    units), down_proj's on the same hidden units, as transformers' packed styles place them."""
    from torch.distributed.tensor.placement_types import _StridedShard

    for pname, p in list(module.named_parameters(recurse=False)):
        if pname not in dims:
            raise ValueError(f"packed experts' styles shard {sorted(dims)}, not {pname!r}")
        dim, split = dims[pname]
        placement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [placement]),
                                                      requires_grad=p.requires_grad))


_HELD: dict[int, dict[str, DTensor]] = {}  # a packed experts module's DTensor params while it runs on local ones


def _local_experts_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """The experts run on their params' local shards; the hidden states and routing weights replicated, their
    grads partial (this rank's units' share) and all-reduced."""
    held = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    _HELD[id(module)] = held
    for n, p in held.items():
        module._parameters[n] = p.to_local()
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
                 if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)


def _local_experts_output(module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The DTensor params back; the partial output all-reduced."""
    module._parameters.update(_HELD.pop(id(module), {}))
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    x, *rest = inputs
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False, grad_placements=[Partial()]), *rest)


def _replicated_output(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    """Local, its grad partial: the weight's grad partial, all-reduced over TP by FSDP2."""
    return out.to_local(grad_placements=[Partial()])


def _rope_grad_all_reduced(out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The same values; the grad of the last MLA_ROPE_DIM features (MLA's rope key) all-reduced over tp."""
    kept, rope = out.split([out.shape[-1] - MLA_ROPE_DIM, MLA_ROPE_DIM], dim=-1)
    rope = DTensor.from_local(rope, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return torch.cat([kept, rope], dim=-1)


def _matches(pattern: str, name: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms))


def loss_context() -> Any:
    """What the training step's loss and its backward run under: loss_parallel() where LOSS_PARALLEL."""
    return loss_parallel() if LOSS_PARALLEL else contextlib.nullcontext()
'''

TP_IMPORTS = """import contextlib
import fnmatch
import functools
import inspect

from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

"""


def tp_constants(tp: TensorParallel, float8: Float8 | None) -> str:
    """The plan's tensor parallelism as Python literals (module names and patterns through ``py_literal``)."""
    return TP_CONSTANTS.format(degree=py_literal(tp.degree),
                               layout=py_literal({k: s.value for k, s in tp.layout.items()}),
                               loss_parallel=py_literal(tp.loss_parallel), async_tp=py_literal(tp.async_tp),
                               float8_tp=py_literal(float8 is not None and float8.tp_float8_all_gather),
                               mla_rope_dim=py_literal(tp.mla_rope_dim))


def with_tensor_parallel(header: str, constants: str, body: str, tp: TensorParallel, float8: Float8 | None
                         ) -> tuple[str, str, str]:
    """The export's header, constants and ``apply`` body for a plan with TP: the mesh split into its dp and tp
    dims, ``parallelize_module`` before checkpointing and ``fully_shard``; ``make_mesh`` of the TP tail in place
    of the data-parallel one."""
    body = body.replace(TP_APPLY_LINE, TP_APPLY_LINE + TP_SPLIT)
    start, end = body.index("\n\ndef make_mesh("), body.index("\n\ndef fully_shard_order(")
    tail = TP_TAIL.replace("{expert_dims}", py_literal(EXPERT_TENSOR_DIMS)).replace(
        "{packed_dims}", py_literal({TPStyle.MOE_TP_EXPERTS.value: MOE_TP_EXPERT_DIMS,
                                     TPStyle.MOE_TP_EXPERTS_IN_OUT.value: MOE_TP_EXPERT_IN_OUT_DIMS}))
    tail += "\n\n" + inspect.getsource(required_inputs_positional)  # (apply's own, written in)
    return header + TP_IMPORTS, constants + tp_constants(tp, float8), body[:start] + body[end:] + tail


EP_TAIL = '''

def split_expert_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dp, experts' FSDP mesh, ep) over the ranks of ``mesh`` (1-D, or HSDP's (dp_replicate, dp_shard)): ``mesh``
    for the other groups; for the experts, the dp_shard ranks holding the same experts (EP_DEGREE apart), under
    HSDP also over dp_replicate; EP's, consecutive ranks out of dp_shard (torchtitan's sparse mesh)."""
    world = mesh.size()
    names = mesh.mesh_dim_names or ()
    if EP_TOKEN_SPLIT > 1:  # the whole mesh, before TP's split: EP's ranks out of dp_shard x tp
        replicate = mesh["dp_replicate"].size() if "dp_replicate" in names else 1
    else:
        replicate = mesh.size(0) if mesh.ndim == 2 else 1
    if mesh.ndim > 2 and EP_TOKEN_SPLIT == 1:
        raise ValueError(f"this plan has expert parallelism of degree {EP_DEGREE}: give a 1-D or (dp_replicate, "
                         f"dp_shard) mesh, got {mesh.ndim} dims")
    if (world // replicate) % EP_DEGREE:
        raise ValueError(f"this plan's expert parallelism over {EP_DEGREE} ranks does not divide the "
                         f"{world // replicate} data-parallel shard ranks of the job's {world}: launch a multiple of "
                         f"{EP_DEGREE * replicate}, or make the plan again for {world} ranks")
    whole = init_device_mesh(mesh.device_type, (world,), mesh_dim_names=("world",))
    dims = (replicate, world // replicate // EP_DEGREE, EP_DEGREE)
    sparse = whole._unflatten(0, dims, ("dp_replicate", "dp_shard_mod_ep", "ep"))
    experts = sparse["dp_replicate", "dp_shard_mod_ep"] if replicate > 1 else sparse["dp_shard_mod_ep"]
    return mesh, experts, sparse["ep"]


def expert_placement(module: nn.Module, name: str) -> Callable[[nn.Parameter], Shard | None] | None:
    """Shard(dim) for the expert module ``name``'s params SHARD_DIMS names (dim 1 where its E / EP_DEGREE experts
    are fewer than the ranks sharding them, as torchtitan places experts), once EP made them DTensors; None: all
    on dim 0."""
    dims = {id(p): SHARD_DIMS[f"{name}.{n}"] for n, p in module.named_parameters() if f"{name}.{n}" in SHARD_DIMS}
    return (lambda param: Shard(dims[id(param)]) if id(param) in dims else None) if dims else None
'''
# the experts' EP: grouped experts taking (experts, tokens per expert, dim) with the dispatch and combine around them
# (models/moe.py's), transformers' experts layers (routing inside their forward) through transformers' own EP, as
# apply_plan runs them (apply/expert_parallel.py, models/hf_experts.py)
EP_EXPERTS = '''

def expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """``module``'s params sharded on their expert dim 0 over ``ep_mesh`` (E / EP_DEGREE experts a rank), the routed
    tokens sent to their experts' ranks by an all-to-all before it runs and back by another after. The module takes
    (experts, tokens per expert, dim) and gives the same shape; transformers' experts layers, which route inside
    their forward, take transformers' own EP (``_transformers_expert_parallel``)."""
    from torch.distributed.tensor import distribute_module, distribute_tensor

    if type(module).__module__.startswith("transformers."):
        _transformers_expert_parallel(module, ep_mesh)
        return

    def shard(name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, device_mesh, [Shard(0)]),
                                                       requires_grad=p.requires_grad))

    distribute_module(module, ep_mesh, shard, _dispatch, _combine)
    _on_local_shards(module)


def _on_local_shards(module: nn.Module) -> None:
    """The module's forward run on its params' local shards (to_local: E / EP_DEGREE experts, their grads flowing
    back to the sharded params), its input the dispatch's local rows: batched matmuls and loops over the experts
    alike, as torchtitan's GroupedExperts reads its params."""
    import types

    module.forward = types.MethodType(local_forward, module)  # (bound: a deep copy rebinds it to the copy)


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """(E, n, dim) rows on this rank -> its local experts' (E / EP, EP x n, dim) rows from every EP rank."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    x, *rest = inputs
    if x.dim() != 3:
        raise ValueError(f"{type(module).__name__} takes a {x.dim()}-D input: expert parallelism here needs experts "
                         "taking (experts, tokens per expert, dim)")
    ep = mesh.size()
    if EP_TOKEN_SPLIT > 1:  # this TP rank's share of each expert's rows (TP ranks: the innermost of EP's)
        rows = x.shape[1] // EP_TOKEN_SPLIT
        at = mesh.get_local_rank() % EP_TOKEN_SPLIT * rows
        x = x[:, at:at + rows]
    e, n, dim = x.shape
    got = all_to_all_single_autograd(x.contiguous().view(e * n, dim), None, None, mesh)
    return (got.view(ep, e // ep, n, dim).transpose(0, 1).reshape(e // ep, ep * n, dim), *rest)


def _combine(module: nn.Module, out: Any, mesh: DeviceMesh) -> torch.Tensor:
    """The local experts' (E / EP, EP x n, dim) rows back to the ranks that routed them: (E, n, dim)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.tensor import DTensor

    local = out.to_local() if isinstance(out, DTensor) else out
    ep = mesh.size()
    e_local, rows, dim = local.shape
    n = rows // ep
    sent = local.view(e_local, ep, n, dim).transpose(0, 1).reshape(ep * e_local * n, dim)
    back = all_to_all_single_autograd(sent, None, None, mesh).view(ep * e_local, n, dim)
    if EP_TOKEN_SPLIT == 1:
        return back
    at = mesh.get_local_rank() % EP_TOKEN_SPLIT  # among the whole layer's rows, zeros for the other TP ranks'
    return torch.nn.functional.pad(back, (0, 0, at * n, (EP_TOKEN_SPLIT - 1 - at) * n))


_ONE_RANK: dict[DeviceMesh, DeviceMesh] = {}  # ep mesh -> this rank alone (made once: each makes process groups)


def _transformers_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """transformers' own expert parallelism of its experts layer ``module`` (transformers.distributed
    .expert_parallel): its params Shard(0) over ``ep_mesh`` (E / EP_DEGREE experts a rank) and its all-to-all
    dispatch of every (token, expert) pair to its expert's rank and back; its TP mesh (the ranks sharing this
    rank's batch): this rank alone."""
    if EP_TOKEN_SPLIT > 1 or not (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")):
        raise ValueError(f"{type(module).__name__}: transformers' expert parallelism is applied here to its "
                         "standard experts layers (use_experts_implementation), without tensor parallelism")
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel, MoEParamShard

    shard = MoEParamShard(Shard(0), shards_expert_dim=True)
    for pname, _ in list(module.named_parameters(recurse=False)):
        shard.shard_param(module, pname, ep_mesh)
    if ep_mesh not in _ONE_RANK:
        _ONE_RANK[ep_mesh] = ep_mesh._unflatten(0, (ep_mesh.size(), 1), ("ep", "own_batch"))["own_batch"]
    EpDispatchExpertsParallel().install_forward(module, ep_mesh, tp_mesh=_ONE_RANK[ep_mesh])
'''
# with EP, torchtitan's world mesh is taken whole: the plan's own (dp, dp_shard_mod_ep, ep) meshes are built from
# its ranks, as apply_plan builds them
EP_TAILS = {ExportFormat.TORCHTITAN: '''

def parallelize(model: nn.Module, world_mesh: DeviceMesh, **fsdp_kwargs: Any) -> nn.Module:
    """A torchtitan-style ``parallelize`` (in place of ``apply_moe_ep_tp`` and ``apply_fsdp``): the EXPERTS over
    an ``ep`` mesh of EP_DEGREE consecutive ranks of ``world_mesh``, each sharded over the ranks holding the same
    experts (and over dp_replicate under HSDP), and the plan's other groups over its data-parallel mesh (MESH)."""
    return apply(model, make_mesh(world_mesh.device_type), **fsdp_kwargs)
'''}


EP_SPLIT = """    mesh, expert_mesh, ep_mesh = split_expert_mesh(mesh)  # EP: the experts first, on meshes of their own
    expert_kwargs = {k: v for k, v in fsdp_kwargs.items() if k != "shard_placement_fn"}
    for names, reshard in GROUPS:
        if names[0] in EXPERTS:  # over ep, then sharded over the ranks that hold the same experts
            expert_parallel(modules[names[0]], ep_mesh)
            fully_shard(modules[names[0]], mesh=expert_mesh, reshard_after_forward=reshard,
                        shard_placement_fn=expert_placement(modules[names[0]], names[0]), **expert_kwargs)
            # its grad sums every EP rank's tokens: averaged over all data-parallel ranks, as the other groups'
            modules[names[0]].set_gradient_divide_factor(float(mesh.size() // EP_TOKEN_SPLIT))  # TP's share a batch
            # gloo has no PREMUL_SUM: SUM, then divide (not over a shard dim of one rank: FSDP2 divides that copy)
            if expert_mesh.size(expert_mesh.ndim - 1) > 1 and dist.get_backend(ep_mesh.get_group()) == "gloo":
                modules[names[0]].set_force_sum_reduction_for_comms(True)
"""
# a plan whose experts are sharded in their blocks' calls (ExpertParallel.per_param_mesh, torchtitan's since
# pytorch/torchtitan#2281): distributed over ep here, then placed on their own mesh by each call's shard_placement_fn
EP_PER_PARAM_SPLIT = """    try:  # FSDP2's per-param mesh (torch 2.13's private names, as torchtitan imports them)
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    except ImportError as e:
        raise ImportError(f"this plan shards the experts in their blocks' fully_shard calls on a per-param mesh, "
                          f"which this torch {torch.__version__} does not have (2.13 does): {e}") from e

    mesh, expert_mesh, ep_mesh = split_expert_mesh(mesh)  # EP: the experts first, on meshes of their own
    expert_divide_factor = float(mesh.size() // EP_TOKEN_SPLIT)  # all data-parallel ranks (TP's share a batch)
    expert_mesh_info = _get_mesh_info(expert_mesh)  # FSDP2's own, one for every expert param (torchtitan's way)
    placed = {}
    for name in EXPERTS:  # over ep, then placed on the ranks that hold the same experts by their block's call
        expert_parallel(modules[name], ep_mesh)
        dims = expert_placement(modules[name], name)
        placed.update({id(p): ShardPlacementResult(dims(p) if dims else None, expert_mesh_info)
                       for p in modules[name].parameters()})
    placement = fsdp_kwargs["shard_placement_fn"]
    fsdp_kwargs["shard_placement_fn"] = lambda p: placed.get(id(p)) or (placement(p) if placement else None)
"""
EP_PER_PARAM_REDUCTION = """    expert_reduction(modules, EXPERTS, expert_divide_factor)
"""

GROUP_LINE = "        names, reshard = GROUPS[i]\n"
# the last line of apply()'s check of the plan's names, before which no module is changed
NAMES_CHECKED = """                         "model, or an edited one)")\n"""
EP_SKIP = """        if names[0] in EXPERTS:  # sharded above
            continue
"""
EP_CONSTANTS = """EP_DEGREE: int = {degree}  # expert parallelism: EP ranks out of dp_shard (x tp), consecutive ranks
EXPERTS: list[str] = {experts}  # grouped experts modules: params Shard(0) over ep, FSDP over the EP-reduced mesh{how}
EP_TOKEN_SPLIT: int = {split}  # with TP: the TP ranks each dispatch their 1/TP of the routed tokens (expert TP 1)
"""


def with_expert_parallel(plan: Plan, constants: str, body: str) -> tuple[str, str]:
    """The export's constants and ``apply`` body for a plan with EP, as ``apply_plan`` applies it: each expert
    module distributed over ``ep`` (all-to-all dispatch and combine) and ``fully_shard``-ed over the EP-reduced
    mesh before checkpointing, the other groups over the whole data-parallel mesh."""
    ep = plan.expert_parallel
    assert ep is not None
    check_no_prefetch(plan)
    if plan.tp_degree > 1 and hf.is_hf(plan.model):
        raise PlannerError(f"{plan.model}: {NO_EP_TP}; export a plan without expert parallelism or without TP")
    experts = [m for g in plan.inner_groups if (len(g.modules) == 1 or ep.per_param_mesh)
               and all(any(matches(p, m) for p in ep.modules) for m in g.modules) for m in g.modules]
    # (the model is not built here: the plan's names say its experts modules and their calls)
    named = [m for m in ep.modules if "*" not in m]
    refused = hosts_or_refusal(plan, named or experts, named_parent) if ep.per_param_mesh else \
        alone_refusal(plan, named)
    if isinstance(refused, str):
        raise PlannerError(refused)
    if not experts:
        raise PlannerError("the plan's expert-parallel modules are not groups of their own: give each one (plan --ep "
                           "makes them)")
    split = EP_PER_PARAM_SPLIT if ep.per_param_mesh else EP_SPLIT
    if plan.tp_degree > 1:  # the experts over the whole mesh first (as apply_plan: TP's styles replicate every
        # param not yet distributed), then TP, then the other groups over the mesh's dp dims
        assert TP_APPLY_LINE + TP_SPLIT in body
        body = body.replace(TP_APPLY_LINE + TP_SPLIT, TP_APPLY_LINE, 1)
        split += TP_SPLIT
    assert NAMES_CHECKED in body  # the experts are changed after the names are checked, as every other module
    body = body.replace(NAMES_CHECKED, NAMES_CHECKED + split, 1).replace(GROUP_LINE, GROUP_LINE + EP_SKIP, 1)
    tail = EP_TAIL + EP_EXPERTS + "\n\n" + inspect.getsource(local_forward)  # (apply's own, written in)
    if ep.per_param_mesh:
        assert ROOT_SHARD_END in body  # (the grads of the experts would be EP times too large without it)
        body = body.replace(ROOT_SHARD_END, ROOT_SHARD_END + EP_PER_PARAM_REDUCTION, 1)
        tail += "\n\n" + inspect.getsource(expert_reduction)
    how = (" (in their blocks' fully_shard calls: a per-param mesh)" if ep.per_param_mesh
           else " (each its own fully_shard call)")
    return constants + EP_CONSTANTS.format(degree=py_literal(ep.degree), experts=py_literal(experts),
                                           split=py_literal(plan.tp_degree), how=how), body + tail


# fsdp-planner's own functions that order the groups' fully_shard calls (apply_plan's), written into every export
# as they are: the exported code orders the model it is given exactly as apply_plan would
ORDER_FUNCTIONS = (module_parents, dag_ancestors, hooked_modules, shard_order, topological_order)


def order_functions() -> str:
    """The source of ``ORDER_FUNCTIONS``, each as ``fully_shard_order`` calls it."""
    return "".join("\n\n" + inspect.getsource(f) for f in ORDER_FUNCTIONS)


def with_chunked_loss(header: str, constants: str, tails: str, loss_head: str | None) -> tuple[str, str, str]:
    """A plan with its loss in chunks: the step that runs them (``CHUNKED_LOSS_FUNCTIONS``, fsdp-planner's own, as
    the fake ranks run them) and the output layer's name (``loss_head``; None where the model was not traced here,
    for the user to set)."""
    for old, new in (("import heapq\n", "import contextlib\nimport heapq\n"),
                     ("Callable, Mapping, Sequence", "Callable, Iterator, Mapping, Sequence"),
                     ("import torch.nn as nn\n", "import torch.nn as nn\nimport torch.nn.functional as F\n")):
        if old not in header:  # (the header every format starts from: HEADER)
            raise PlannerError(f"the export's header has no {old.strip()!r} to add the chunked loss's imports to")
        if new.replace(old, "") not in header:  # (TP's imports have some of them)
            header = header.replace(old, new, 1)
    said = "the output layer's module name" if loss_head else "set it to your output layer's module name (none " \
        "found where this file was written)"
    vocab = ", loss_parallel=LOSS_PARALLEL" if "\nLOSS_PARALLEL: bool" in constants else ""
    constants += (f"OUTPUT_LAYER: str = {py_literal(loss_head or '')}  # {said}: run each micro-batch's forward and "
                  f"loss as loss = chunked_loss_step(model, OUTPUT_LAYER, LOSS_CHUNKS, args, kwargs, labels{vocab}), "
                  "then loss.backward() as ever (or return it from a LightningModule's training_step); it leaves the "
                  "layer's group resharding after forward from the next step on, whatever GROUPS says, as "
                  "torchtitan's wrapper does\n")
    return header, constants, tails + "".join("\n\n" + inspect.getsource(f) for f in CHUNKED_LOSS_FUNCTIONS)


def _with_step_options(plan: Plan, constants: str, body: str, tails: str) -> tuple[str, str, str]:
    """The export's constants, ``apply`` body and functions with what the plan's step needs beyond its groups:
    op-level checkpointing, activation offloading, kernels, fp32 groups, compiled modules (plans without them export
    as before)."""
    if plan.selective_checkpointing:
        constants += selective_constants(plan) + "\n"
        body = body.replace(CHECKPOINT_LINE, CHECKPOINT_LINE + SELECTIVE_LOOP)
        tails += SELECTIVE_TAIL
    if plan.activation_offloading:
        constants += f"OFFLOADED_ACTIVATIONS: list[str] = {py_literal(list(plan.activation_offloading))}\n"
        loop = SELECTIVE_LOOP if plan.selective_checkpointing else ""
        body = body.replace(CHECKPOINT_LINE + loop, CHECKPOINT_LINE + loop + OFFLOAD_LOOP)
        tails += OFFLOAD_TAIL
    if plan.kernels:  # the kernels its figures assume: said at run time where this Python lacks them
        constants += f"KERNELS: dict[str, str] = {py_literal({k: KERNEL_PACKAGES[k] for k in plan.kernels})}\n"
        body = body.replace(MESH_LINE, KERNELS_LINE + MESH_LINE)
        tails += KERNELS_TAIL
    fp32 = [i for i, g in enumerate(plan.inner_groups) if g.param_dtype == "fp32"]
    if fp32:
        constants += f"FP32_GROUPS: list[int] = {py_literal(fp32)}  # groups computing in fp32 (full_precision)\n"
        body = body.replace(GROUP_SHARD, FP32_GROUP_SHARD)
        tails += FP32_TAIL
    if plan.compiled and plan.tensor_parallel is not None:  # (the TP embedding's output reaches a compiled block)
        assert COMPILE_ASSIGN in body
        body = body.replace(COMPILE_ASSIGN, COMPILE_ASSIGN.replace("= torch.compile(", "= waited_inputs(torch.compile(")
                            .replace("fullgraph=True)", "fullgraph=True))"))
        tails += "\n\n" + inspect.getsource(waited_inputs)
    if plan.compiled:
        assert COMPILE_LINE in body
        room = RECOMPILE_ROOM + (EP_SIDE_EFFECT if plan.expert_parallel is not None and plan.checkpoints else "")
        body = body.replace(COMPILE_LINE, room + COMPILE_LINE)
    return constants, body, tails


def export_plan(plan: Plan, fmt: ExportFormat, precision: Precision = PRECISIONS[DEFAULT_PRECISION],
                where: str | os.PathLike[str] | None = None, loss_head: str | None = None) -> str:
    """The source of a module that applies ``plan`` in the ``fmt`` framework's way, in ``precision`` (what the
    plan's numbers were simulated with: a plan file does not record it); ``where``: the directory it is written to
    (None: this one), which a model file is named relative to; ``loss_head``: a plan with its loss in chunks, the
    model's output layer (the step that runs the chunks is written in too)."""
    plan = plan.replace(model=portable_model(plan.model, where))
    header = HEADER.format(title=TITLES[fmt], groups=f"{fmt_count(len(plan.inner_groups), 'group')} and the root")
    # a plan made with --reduce-dtype records it: the reduce dtype is part of the precision the plan runs in
    precision = with_reduce_dtype(precision, ReduceDtype(plan.reduce_dtype) if plan.reduce_dtype else None)
    constants, body, tails = _with_step_options(plan, plan_constants(plan, precision) + "\n", APPLY_BODY,
                                                order_functions())
    tail = TAILS[fmt]
    if plan.tensor_parallel is not None:
        header, constants, body = with_tensor_parallel(header, constants, body, plan.tensor_parallel, plan.float8)
        tail = TP_TAILS.get(fmt, TAILS[fmt])
    if plan.expert_parallel is not None:  # with TP: after TP's split of the mesh, which it keeps whole for EP
        constants, body = with_expert_parallel(plan, constants, body)
        tail = tail if plan.tensor_parallel is not None else EP_TAILS.get(fmt, TAILS[fmt])
    if plan.float8 is not None:  # after TP's mesh split: the conversion runs before parallelize_module
        constants += float8_constants(plan.float8)
        body = body.replace(TP_APPLY_LINE, TP_APPLY_LINE + FLOAT8_LINE)
        tails += FLOAT8_TAIL
    if fmt is not ExportFormat.TORCHTITAN:
        if plan.loss_chunks:
            header, constants, tails = with_chunked_loss(header, constants, tails, loss_head)
        return header + constants + body + tails + tail
    # torchtitan: parallelize_fn as torchtitan calls it, on its own module names, and the job in its registry form
    constants += titan.DIMS_CONSTANT.format(dims=py_literal(titan.torchtitan_dims(
        plan.mesh.replicate if plan.mesh else 1, plan.tp_degree, plan.ep_degree,
        plan.workload.ranks if plan.workload else 0)))
    for line, titan_line in ((titan.MODULES_LINE, titan.TITAN_MODULES_LINE), (titan.TP_LINE, titan.TITAN_TP_LINE),
                             (titan.MISSING_LINE, titan.TITAN_MISSING_LINE),
                             (titan.SHARD_DIMS_LINE, titan.TITAN_SHARD_DIMS_LINE),
                             (titan.TARGETS_LINE, titan.TITAN_TARGETS_LINE)):
        body = body.replace(line, titan_line, 1)
    tail += titan.TAIL.replace("{names}", py_literal(titan.TORCHTITAN_NAMES))
    if plan.float8 is not None:
        tail = tail.replace(titan.MODEL_TP_LINE, titan.FLOAT8_MODEL_TP_LINE, 1)
    constants += titan.PLAN_CONSTANT.format(plan=py_literal(plan.to_json()))
    return header + constants + body + tails + tail + torchtitan_job(plan, precision, py_literal)
