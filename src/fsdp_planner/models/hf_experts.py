"""Hugging Face mixture-of-experts layers, traced with token-balanced routing.

transformers runs an experts layer (``@use_experts_implementation``: Mixtral, Qwen-MoE, ...) through the function
``config._experts_implementation`` names. Neither of its own paths traces on tensors without data: the eager
loop asks which experts got tokens (``nonzero``, then one Python branch per expert), and ``grouped_mm`` sizes its
groups from the routing (data-dependent offsets; its kernel on meta takes bf16 only). ``balanced_experts_forward``
is registered as one more implementation: while the step is planned (meta or fake tensors) the router still runs
(its FLOPs and gradient are real) but tokens are dispatched as if the load were perfectly even, ``top_k`` copies
of every token spread over the experts, so the expert matmuls cost exactly the real top-k compute and every
expert's weights are read, as in the built-in ``mixtral-8x7b``. The capacity factor of ``--routing``
(``routing.py``) scales each expert's rows, as it does for a user's router. On real tensors (``verify``,
``--measure``) it is transformers' own ``grouped_mm`` path, routing and all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.attention import planned
from fsdp_planner.errors import PlannerError
from fsdp_planner.routing import current_capacity, grouped_bmm

BALANCED = "fsdp_planner_balanced"


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Per-expert linear on ``x`` (E, tokens, in): ``weight`` is (E, out, in), or (E, in, out) when transposed.
    Classed as transformers' ``_grouped_mm``, which it stands in for (``routing.grouped_bmm``)."""
    out = grouped_bmm(x, weight if transposed else weight.transpose(1, 2))
    return out if bias is None else out + bias.unsqueeze(1)


def _routed_rows(hidden_states: torch.Tensor, top_k: int, n_experts: int) -> torch.Tensor:
    """(experts, rows per expert, dim): ``top_k`` copies of every token, an equal share each expert, times the
    capacity factor (--routing: room for an uneven load, as a capacity-bound dispatch pads it), as the stand-in
    for users' routers (routing.py)."""
    tokens, dim = hidden_states.shape
    n = tokens * top_k
    per_expert = math.ceil(n / n_experts * current_capacity())
    routed = hidden_states.repeat_interleave(top_k, dim=0)  # (tokens * top_k, dim), as a real dispatch copies
    if per_expert * n_experts > n:
        routed = F.pad(routed, (0, 0, 0, per_expert * n_experts - n))
    elif per_expert * n_experts < n:  # a capacity factor under 1: tokens beyond it dropped
        routed = routed[:per_expert * n_experts]
    return routed.view(n_experts, per_expert, dim)


def _expert_rows(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts' MLPs on their rows ``x`` (experts, rows, dim), with the module's params as local tensors (E / EP
    experts each under expert parallelism, whose params are DTensors sharded on the expert dim)."""
    def param(name: str) -> torch.Tensor | None:
        p = getattr(self, name)
        return p.to_local() if hasattr(p, "to_local") else p

    if self.has_gate:
        up = _project(x, param("gate_up_proj"), param("gate_up_proj_bias") if self.has_bias else None,
                      self.is_transposed)
        h = self._apply_gate(up)
    else:
        up = _project(x, param("up_proj"), param("up_proj_bias") if self.has_bias else None, self.is_transposed)
        h = self.act_fn(up)
    out = _project(h, param("down_proj"), param("down_proj_bias") if self.has_bias else None, self.is_transposed)
    return self.post_expert_norm(out) if self.has_post_expert_norm else out


def _combined(out: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every expert's rows (experts, rows per expert, dim) back to their tokens: weighted and summed per token."""
    tokens, top_k = top_k_weights.shape
    n, dim = tokens * top_k, out.shape[-1]
    out = out.reshape(-1, dim)[:n]
    if out.shape[0] < n:
        out = F.pad(out, (0, 0, 0, n - out.shape[0]))
    out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return out.view(tokens, top_k, dim).sum(dim=1).to(dtype)


def balanced_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts layer's forward (transformers' signature): (tokens, dim) -> (tokens, dim)."""
    if not planned(hidden_states):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    x = _routed_rows(hidden_states, top_k_index.shape[-1], self.num_experts)
    return _combined(_expert_rows(self, x), top_k_weights, hidden_states.dtype)


def register() -> str:
    """Make ``balanced_experts_forward`` an experts implementation transformers accepts; its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(BALANCED, balanced_experts_forward)
    return BALANCED


def one_rank_mesh(ep_mesh: Any) -> Any:
    """A mesh of this rank alone, out of ``ep_mesh``: the ranks sharing its batch, which transformers' EP takes as
    its TP mesh (EP of transformers' experts runs without TP here). Made once for all the layers: each
    ``_unflatten`` makes its own process groups."""
    return ep_mesh._unflatten(0, (ep_mesh.size(), 1), ("ep", "own_batch"))["own_batch"]


def standard_experts_class(cls: type) -> bool:
    """Whether ``cls`` is one of transformers' standard experts layers: made by its ``use_experts_implementation``
    (which wraps ``__init__`` and gives ``_apply_gate``), hidden states, top-k indices and weights in, the layers
    whose expert parallelism transformers runs."""
    return hasattr(cls.__init__, "__wrapped__") and hasattr(cls, "_apply_gate")


def check_runs_ep(name: str, module: nn.Module, degree: int) -> None:
    """Refuse, in one sentence, EP of the transformers experts layer ``module`` that ``distribute_experts`` cannot
    run: one not built by transformers' ``use_experts_implementation`` (its forward takes another signature:
    Llama 4's pre-routed rows, JetMoE's expert sizes), one whose children hold params (EP would leave their
    grads partial), experts ``degree`` does not divide, or a transformers without its EP."""
    what = f"{name} ({type(module).__name__})"
    if not standard_experts_class(type(module)):
        raise PlannerError(f"{what} is not one of transformers' standard experts layers (use_experts_implementation: "
                           "hidden states, top-k indices and weights in), the kind whose expert parallelism "
                           "transformers runs: plan it without --ep")
    if len(list(module.parameters())) != len(list(module.parameters(recurse=False))):
        raise PlannerError(f"{what} holds params in its children, which expert parallelism would leave "
                           "unsummed over the EP ranks: plan it without --ep")
    if module.num_experts % degree:
        raise PlannerError(f"{what} has {module.num_experts} experts, which expert parallelism of degree {degree} "
                           "cannot split evenly: choose a degree that divides them")
    try:
        import transformers.distributed.expert_parallel  # noqa: F401
    except ImportError:
        raise PlannerError(NO_TRANSFORMERS_EP) from None


def distribute_experts(module: nn.Module, ep_mesh: Any, own_batch: Any) -> None:
    """Expert parallelism of a transformers experts layer (``check_runs_ep``) as transformers runs it
    (``transformers.distributed.expert_parallel``): each of its own params ``Shard(0)`` over ``ep_mesh`` (its
    ``grouped_gemm`` style: E / EP experts a rank, ``num_experts`` made the local count) and its
    ``ep_dispatch_experts`` forward, whose all-to-all sends every (token, expert) pair to its expert's rank and the
    outputs back, with the split sizes the routing gives; ``own_batch``: its TP mesh, this rank alone
    (``one_rank_mesh``). On a planned step (the fake world: no routing to read) the same two all-to-alls carry the
    routing stand-in's rows (``_routed_rows``), as the simulator prices them."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel, MoEParamShard

    experts = module.num_experts
    shard = MoEParamShard(Shard(0), shards_expert_dim=True)
    for name, _ in list(module.named_parameters(recurse=False)):
        shard.shard_param(module, name, ep_mesh)
    EpDispatchExpertsParallel().install_forward(module, ep_mesh, tp_mesh=own_batch)
    run = module.forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if not planned(hidden_states):
            return run(hidden_states, top_k_index, top_k_weights)
        return _planned_ep_forward(module, ep_mesh, experts, hidden_states, top_k_index, top_k_weights)

    module.forward = forward


def _planned_ep_forward(module: nn.Module, ep_mesh: Any, experts: int, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``distribute_experts``' forward on a planned step: the stand-in's rows of all ``experts`` to their EP
    ranks, this rank's E / EP experts on the rows every EP rank sent them, the outputs back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    routed = _routed_rows(hidden_states, top_k_index.shape[-1], experts)
    e, rows, dim = routed.shape
    ep = ep_mesh.size()
    # each buffer dropped once the next is made, as a dispatch frees its send buffer once sent
    got = all_to_all_single_autograd(routed.reshape(e * rows, dim), None, None, ep_mesh)
    del routed
    local = got.view(ep, e // ep, rows, dim).transpose(0, 1).reshape(e // ep, ep * rows, dim)
    del got
    out = _expert_rows(module, local)
    del local
    sent = out.view(e // ep, ep, rows, dim).transpose(0, 1).reshape(e * rows, dim)
    del out
    back = all_to_all_single_autograd(sent, None, None, ep_mesh)
    del sent
    return _combined(back.view(e, rows, dim), top_k_weights, hidden_states.dtype)


NO_TRANSFORMERS_EP = ("expert parallelism of transformers' experts layers runs through transformers' own "
                      "(transformers.distributed.expert_parallel, in its 5.x releases of 2026), which this "
                      "transformers lacks: upgrade transformers, or plan it without --ep")
# EP x TP is modelled for torchtitan's MoE layout (EP's ranks spanning TP's, each TP rank dispatching its share of
# the routed rows), which transformers' experts under its own TP styles (``packed_colwise`` / ``moe_tp_experts``)
# are not: a plan file asking for it on them is refused before anything runs
NO_EP_TP = ("expert parallelism of transformers' experts layers runs without tensor parallelism only (EP x TP "
            "is modelled for torchtitan's MoE layout, the built-in MoE models)")


# transformers' EP under torch.compile: its dispatch branches on the token counts the routing gives
COMPILED_EP = ("expert parallelism of transformers' experts layers inside compiled blocks is simulated as torchtitan "
               "runs it (its MoE blocks compile whole with EP), not applied: transformers' EP dispatch branches on "
               "the routed token counts, which torch.compile(fullgraph=True) cannot trace, so apply, verify on "
               "torchrun and the exports that run transformers' modules refuse it (verify --fake-world-size checks "
               "it with the blocks eager; a torchtitan job of torchtitan's own MoE model runs its own modules, which "
               "compile with EP; plan the blocks eager to run transformers')")
# transformers' other experts layers (Llama 4's take pre-routed rows, JetMoE's expert sizes): EP simulated only
OTHER_EXPERTS = ("expert parallelism of this model's experts layers is simulated as torchtitan runs it, not applied: "
                 "transformers runs it on its standard experts layers (use_experts_implementation) only, so apply, "
                 "export and verify refuse it")
# what transformers' dispatch does beyond the simulated all-to-alls
UNPRICED_EP = ("transformers' EP dispatch also sends each layer's per-expert token counts by a small all-to-all "
               "and reads its split sizes back to the host (a sync a layer), which the step does not price")


def is_transformers_module(module: nn.Module) -> bool:
    """Whether ``module``'s class is transformers' (its experts' EP runs through transformers' own:
    ``distribute_experts``)."""
    return type(module).__module__.startswith("transformers.")
