"""Apply a plan's tensor parallelism: ``parallelize_module`` over the mesh's ``tp`` dim with the torch style each
``TPStyle`` names, before activation checkpointing and ``fully_shard`` (torchtitan's ``parallelize`` order: TP,
then AC, then FSDP over the data-parallel dims). The loss of a loss-parallel plan runs under
``torch.distributed.tensor.parallel.loss_parallel()`` (``loss_context``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.apply.float8 import float8_module
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.tensor_parallel import (
    PACKED_EXPERT_STYLES,
    TensorParallel,
    TPStyle,
    check_moe_styles,
    expert_tensor_dim,
    float8_styled,
    moe_tp_expert_dim,
)

DP_DIMS = ("dp_replicate", "dp_shard")  # the data-parallel dims of the mesh, outermost first
TP_DIM = "tp"


def positional_inputs(module: nn.Module) -> int:
    """How many positional inputs a call of ``module`` passes: ``PrepareModuleInput`` wants one layout per
    positional input, so the inputs its forward requires (those without a default; the optional ones are taken to
    come as keywords). A forward taking ``*args`` has no fixed count and is refused."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        raise PlannerError(f"the tensor-parallel style gather_input needs a module whose forward names its inputs; "
                           f"{type(module).__name__}.forward takes *args")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return max(1, sum(p.kind in positional and p.default is inspect.Parameter.empty for p in params))


def required_inputs_positional(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """A forward pre-hook putting the required inputs a call gave as keywords in their positional places:
    ``GATHER_INPUT`` and ``MOE_SEQUENCE`` redistribute the first positional input, one layout per required one
    (``positional_inputs``), and transformers' decoder layers call their attention with keywords
    (``self_attn(hidden_states=...)``), which ``PrepareModuleInput`` would refuse ("module inputs and input_layouts
    should have same length")."""
    params = list(inspect.signature(module.forward).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    moved = [n for n in required[len(args):] if n in kwargs]
    if not moved or moved != required[len(args):len(args) + len(moved)]:
        return args, kwargs
    return (*args, *(kwargs[n] for n in moved)), {k: v for k, v in kwargs.items() if k not in moved}


def torch_style(style: TPStyle, loss_parallel: bool, module: nn.Module, float8: bool = False,
                whole_input: bool = False) -> Any:
    """The ``torch.distributed.tensor.parallel`` style ``style`` stands for (its comment in
    ``fsdp2/tensor_parallel.py``). ``SEQUENCE_COLWISE`` (the output head) keeps its vocab-sharded logits as a
    DTensor under loss parallel, for the loss to run on them; with ``whole_input`` (a chunked loss: the hidden
    states gathered once before the chunks, ``apply/chunked_loss.py``) it takes its input replicated, as
    torchtitan's output layer does, so no chunk's grad is all-reduced on its way out; ``GATHER_INPUT``
    redistributes the first positional input only, every other input (positional or keyword) passing through as it
    came. ``float8``: torchao's float8 style of the same layout (``float8_styles``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    if float8:
        ColwiseParallel, RowwiseParallel, PrepareModuleInput = float8_styles()
    if style is TPStyle.COLWISE:
        return ColwiseParallel()
    if style is TPStyle.ROWWISE:
        return RowwiseParallel()
    if style is TPStyle.COLWISE_GATHER:
        return ColwiseParallel(output_layouts=Replicate())
    if style is TPStyle.ROWWISE_SPLIT:
        return RowwiseParallel(input_layouts=Replicate())
    if style is TPStyle.ROWWISE_SEQUENCE:
        return RowwiseParallel(output_layouts=Shard(1))
    if style is TPStyle.SEQUENCE_COLWISE:
        return ColwiseParallel(input_layouts=Replicate() if whole_input else Shard(1),
                               output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
    if style is TPStyle.EMBEDDING:
        return RowwiseParallel(input_layouts=Replicate())
    if style is TPStyle.EMBEDDING_SEQUENCE:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if style is TPStyle.SEQUENCE_PARALLEL:
        return SequenceParallel()
    others = (None,) * (positional_inputs(module) - 1)
    # input_kwarg_layouts={}: keyword inputs reach the module untouched (a hook with kwargs, no layouts for them)
    return PrepareModuleInput(input_layouts=(Shard(1), *others), desired_input_layouts=(Replicate(), *others),
                              input_kwarg_layouts={}, desired_input_kwarg_layouts={})


# the styles no torch style stands for (torchtitan's MoE ones, transformers' packed experts and MLA key): applied
# with ``distribute_module`` or a forward hook here, the experts' token split by EP's dispatch and combine
# (apply/expert_parallel.py)
OWN_STYLES = (TPStyle.MOE_SEQUENCE, TPStyle.REPLICATE, TPStyle.TOKEN_SPLIT, TPStyle.EXPERT_TENSOR,
              *PACKED_EXPERT_STYLES, TPStyle.MLA_KV_A_PROJ)


def float8_styles() -> tuple[Any, Any, Any]:
    """torchao's float8 TP styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
    ``PrepareFloat8ModuleInput``): the same layouts, a region's input and a rowwise output's grad cast to float8
    before their all-gathers (``fsdp2/float8.py``)."""
    float8_module()  # (torchao imported quietly, or one line saying to install it)
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def float8_modules(modules: dict[str, nn.Module], styles: dict[str, TPStyle]) -> frozenset[str]:
    """The styled modules torchao's float8 styles take (``float8_styled``), by the Linears converted to float8."""
    linear = float8_module().float8_linear.Float8Linear
    return float8_styled(styles, (n for n, m in modules.items() if isinstance(m, linear)))


def torch_plan(model: nn.Module, tp: TensorParallel, float8: bool = False, loss_head: str | None = None
               ) -> dict[str, Any]:
    """``parallelize_module``'s plan: each module the layout matches (by canonical name) -> its torch style;
    with ``float8``, torchao's float8 styles where they apply (``float8_modules``); with ``loss_head``, the
    output layer a chunked loss runs alone, its input whole (``torch_style``; "": the plan did not record it, every
    output head's)."""
    modules = dict(model.named_modules())
    styles = tp.styles(modules)
    f8 = float8_modules(modules, styles) if float8 else set()
    return {name: torch_style(style, tp.loss_parallel, modules[name], name in f8,
                              loss_head is not None and loss_head in ("", name))
            for name, style in styles.items() if style not in OWN_STYLES}


def _gathered(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    """An MoE layer's first input all-gathered from its sequence shard; its grad comes back partial (the router's
    and the TP rank's own experts' share) and is reduce-scattered onto the sequence shard."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x, *rest = inputs
    if not isinstance(x, DTensor):  # a sequence-parallel norm's output is one already
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    whole = x.redistribute(mesh, [Replicate()])
    return (whole.to_local(grad_placements=[Partial()]), *rest)


def _scattered(module: nn.Module, out: Any, mesh: Any) -> Any:
    """An MoE layer's partial output (each TP rank's experts' tokens) summed and reduce-scattered onto the sequence
    dim; its grad all-gathered back."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def _replicated_in(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    """A replicated module's input (the router gate's, whole on every TP rank; a per-head norm's, this rank's heads);
    its grad left partial (summed where the layer's is) or this rank's own."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    x, *rest = inputs
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False, grad_placements=[Partial()]), *rest)


def _replicated_out(module: nn.Module, out: Any, mesh: Any) -> Any:
    """A replicated module's output as a local tensor whose grad is partial: the weight's grad is then partial, and
    FSDP2 all-reduces it over TP into the replicated param's."""
    from torch.distributed.tensor import Partial

    return out.to_local(grad_placements=[Partial()])


def _shard_hidden(name: str, module: nn.Module, mesh: Any) -> None:
    """Each of the experts' own params sharded over TP on its hidden dim (``EXPERT_TENSOR_DIMS``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for pname, p in list(module.named_parameters(recurse=False)):
        placement = Shard(expert_tensor_dim(pname))
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [placement]),
                                                      requires_grad=p.requires_grad))


def _experts_in(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    """The experts' routed rows, whole on every TP rank (the MoE layer's all-gathered input), as a replicated
    DTensor for their matmuls with the hidden-sharded params; its grad partial (this rank's hidden units' share)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    x, *rest = inputs
    return (DTensor.from_local(x, mesh, [Replicate()], run_check=False, grad_placements=[Partial()]), *rest)


def _experts_out(module: nn.Module, out: Any, mesh: Any) -> Any:
    """The experts' output, partial over TP (each rank summed its own hidden units), as a local tensor: the MoE
    layer's reduce-scatter sums it; its grad comes whole (replicated) to every rank."""
    from torch.distributed.tensor import Replicate

    return out.to_local(grad_placements=[Replicate()])


def _shard_packed(style: TPStyle, name: str, module: nn.Module, mesh: Any) -> None:
    """transformers' packed experts' params over TP (``moe_tp_expert_dim`` of ``style``): gate and up each split,
    so a rank's local gate_up_proj is its gate units then its up units, as the forward's ``chunk(2)`` reads them."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    for pname, p in list(module.named_parameters(recurse=False)):
        dim, split = moe_tp_expert_dim(pname, style)
        placement = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [placement]),
                                                      requires_grad=p.requires_grad))


class _LocalExperts:
    """transformers' ``moe_tp_experts`` as forward hooks: the experts run on their params' local shards (swapped
    in before, the DTensors back after: FSDP2 unshards them before and frees them after) and on the replicated
    hidden states and routing weights, whose grads come back partial and are all-reduced; the partial output is
    all-reduced."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, Any]] = {}

    def inputs(self, module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        dtensors = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
        self.held[id(module)] = dtensors
        for n, p in dtensors.items():
            module._parameters[n] = p.to_local()  # (a view of the unsharded param: its grad flows back to it)

        def replicated(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                return x
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

        return tuple(replicated(x) for x in inputs)

    def output(self, module: nn.Module, out: Any, mesh: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        module._parameters.update(self.held.pop(id(module), {}))
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _rope_grad_all_reduced(out: torch.Tensor, rope_dim: int, mesh: Any) -> torch.Tensor:
    """``out`` with the grad of its last ``rope_dim`` features all-reduced over ``mesh`` in backward (a replicated
    DTensor's local tensor whose grad is taken as partial), the rest's passed on as it comes: MLA's rope key,
    which every head reads straight (``MLA_KV_A_PROJ``). The same values, a new tensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    kept, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
    rope = DTensor.from_local(rope, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return torch.cat([kept, rope], dim=-1)


def apply_own_styles(model: nn.Module, tp: TensorParallel, tp_mesh: Any) -> None:
    """The layout's styles no torch style stands for (``OWN_STYLES``) over ``tp_mesh``: the MoE layers and router
    gates (their params replicated), the experts' hidden units sharded first where the layout says so
    (``EXPERT_TENSOR``); an MLA kv_a_proj's rope key's grad all-reduced by a forward hook (its params left
    plain)."""
    from torch.distributed.tensor import distribute_module

    modules = dict(model.named_modules())
    styles = tp.styles(modules)
    local = _LocalExperts()
    for name, style in styles.items():
        if style is TPStyle.EXPERT_TENSOR:
            distribute_module(modules[name], tp_mesh, _shard_hidden, _experts_in, _experts_out)
        elif style in PACKED_EXPERT_STYLES:
            distribute_module(modules[name], tp_mesh, functools.partial(_shard_packed, style), local.inputs,
                              local.output)
    for name, style in styles.items():
        if style is TPStyle.MOE_SEQUENCE:
            # (every param below it not yet a DTensor is replicated: the experts are distributed over ep before)
            distribute_module(modules[name], tp_mesh, None, _gathered, _scattered)
        elif style is TPStyle.REPLICATE:
            distribute_module(modules[name], tp_mesh, None, _replicated_in, _replicated_out)
        elif style is TPStyle.MLA_KV_A_PROJ:
            modules[name].register_forward_hook(
                lambda module, args, out: _rope_grad_all_reduced(out, tp.mla_rope_dim, tp_mesh))


def _check_rope_keys(model: nn.Module, tp: TensorParallel) -> None:
    """Each ``mla_kv_a_proj`` module an nn.Linear of more output features than ``mla_rope_dim``, refused before
    any module changes (its hook would raise mid-forward, on a model already parallelized)."""
    for name, style in tp.styles(dict(model.named_modules())).items():
        module = model.get_submodule(name)
        if style is TPStyle.MLA_KV_A_PROJ and (not isinstance(module, nn.Linear)
                                               or module.out_features <= tp.mla_rope_dim):
            what = f"has {module.out_features} output features" if isinstance(module, nn.Linear) \
                else f"is a {type(module).__name__}"
            raise PlannerError(f"the tensor-parallel style mla_kv_a_proj of {name} all-reduces the grad of the last "
                               f"{tp.mla_rope_dim} output features of an nn.Linear, and {name} {what}")


def apply_tp(model: nn.Module, tp: TensorParallel, tp_mesh: Any, expert_parallel: bool = False,
             float8: bool = False, loss_head: str | None = None) -> None:
    """``parallelize_module`` over ``tp_mesh`` (1-D, the TP degree ranks): params become DTensors sharded over it.
    A layout that splits the experts' tokens needs ``expert_parallel`` (EP's dispatch splits them); ``float8``:
    the float8 Linears' activations all-gathered in float8 (torchao's styles, ``torch_plan``); ``loss_head``: the
    output layer of a plan's loss in chunks (its input whole: ``torch_plan``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.size() != tp.degree:
        raise PlannerError(f"the plan's TP degree is {tp.degree} but the mesh's 'tp' dim has {tp_mesh.size()} ranks")
    modules = dict(model.named_modules())
    check_moe_styles(tp, modules, expert_parallel)
    _check_rope_keys(model, tp)
    for name, style in tp.styles(modules).items():  # (before the styles' own hooks, which read positional inputs)
        if style in (TPStyle.GATHER_INPUT, TPStyle.MOE_SEQUENCE):
            modules[name].register_forward_pre_hook(required_inputs_positional, with_kwargs=True)
    parallelize_module(model, tp_mesh, torch_plan(model, tp, float8, loss_head))
    apply_own_styles(model, tp, tp_mesh)
    if tp.async_tp and async_tp_runs(tp_mesh.device_type):
        enable_async_tp(tp_mesh)


def async_tp_runs(device_type: str) -> bool:
    """Whether async TP runs on ranks of ``device_type``: compile fuses TP's collectives with their matmuls through
    CUDA's symmetric memory; elsewhere (gloo's CPU ranks) the plan's TP runs synchronous."""
    return device_type == "cuda"


def enable_async_tp(tp_mesh: Any) -> None:
    """torchtitan's switch (distributed/compile.py): inductor's micro-pipelined TP, symmetric memory on TP's group
    (its registration is deprecated in torch 2.13, which needs it no longer; torchtitan still makes it). The plan's
    async TP was simulated, exported, and dropped by apply: a trial's ``verify --async-tp`` ran synchronous TP."""
    import warnings

    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def split_mesh(mesh: Any, plan: Plan) -> tuple[Any, Any]:
    """(data-parallel mesh, TP mesh or None) of a device mesh: without TP, ``mesh`` is the data-parallel mesh as
    given; with TP, a mesh with named dims (``device_mesh``), its dp dims (1-D ``dp_shard`` or the 2-D HSDP mesh)
    for ``fully_shard`` and its ``tp`` dim for ``parallelize_module``."""
    if plan.tensor_parallel is None:
        return mesh, None
    names = tuple(mesh.mesh_dim_names or ())
    if TP_DIM not in names:
        raise PlannerError("the plan has tensor parallelism but the device mesh has no 'tp' dim: give a mesh with "
                           "named dims (dp_replicate, dp_shard, tp) or none")
    dp = tuple(n for n in DP_DIMS if n in names)
    return mesh[dp if len(dp) > 1 else dp[0]], mesh[TP_DIM]


def loss_context(plan: Plan) -> contextlib.AbstractContextManager[None]:
    """What a plan's loss and its backward run under: ``loss_parallel()`` when the plan keeps the logits
    vocab-sharded (the cross-entropy then reduces across the TP ranks without gathering them)."""
    if plan.tensor_parallel is None or not plan.tensor_parallel.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def data_rank(plan: Plan, rank: int) -> int:
    """Which data-parallel rank ``rank`` is: the TP ranks of a group (consecutive, TP innermost) see one batch."""
    return rank // plan.tp_degree
