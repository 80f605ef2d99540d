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

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_planner.attention import planned
from fsdp_planner.routing import current_capacity

BALANCED = "fsdp_planner_balanced"


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """Per-expert linear on ``x`` (E, tokens, in): ``weight`` is (E, out, in), or (E, in, out) when transposed."""
    out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
    return out if bias is None else out + bias.unsqueeze(1)


def balanced_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts layer's forward (transformers' signature): (tokens, dim) -> (tokens, dim)."""
    if not planned(hidden_states):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, dim = hidden_states.shape
    top_k, n_experts = top_k_index.shape[-1], self.num_experts
    n = tokens * top_k
    # an equal share each, times the capacity factor (--routing: room for an uneven load, as a capacity-bound
    # dispatch pads it), as the stand-in for users' routers (routing.py)
    per_expert = math.ceil(n / n_experts * current_capacity())
    routed = hidden_states.repeat_interleave(top_k, dim=0)  # (tokens * top_k, dim), as a real dispatch copies
    if per_expert * n_experts > n:
        routed = F.pad(routed, (0, 0, 0, per_expert * n_experts - n))
    elif per_expert * n_experts < n:  # a capacity factor under 1: tokens beyond it dropped
        routed = routed[:per_expert * n_experts]
    x = routed.view(n_experts, per_expert, dim)
    if self.has_gate:
        up = _project(x, self.gate_up_proj, self.gate_up_proj_bias if self.has_bias else None, self.is_transposed)
        h = self._apply_gate(up)
    else:
        up = _project(x, self.up_proj, self.up_proj_bias if self.has_bias else None, self.is_transposed)
        h = self.act_fn(up)
    out = _project(h, self.down_proj, self.down_proj_bias if self.has_bias else None, self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = out.reshape(-1, dim)[:n]
    if out.shape[0] < n:
        out = F.pad(out, (0, 0, 0, n - out.shape[0]))
    out = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return out.view(tokens, top_k, dim).sum(dim=1).to(hidden_states.dtype)


def register() -> str:
    """Make ``balanced_experts_forward`` an experts implementation transformers accepts; its name."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(BALANCED, balanced_experts_forward)
    return BALANCED


# Expert parallelism here is torchtitan's: the experts module takes (experts, tokens per expert, dim) and EP's
# dispatch splits that (``apply/expert_parallel.py``). transformers' experts layers take (tokens, dim) with the
# routing and route inside their forward (its own EP, ``ep_dispatch_experts``, is another dispatch), so EP of them is
# simulated torchtitan's way and not applied.
SIMULATED_EP = ("transformers' experts layers take (tokens, dim) and route inside their forward, so expert "
                "parallelism of them is simulated as torchtitan runs it, not applied: apply, export and verify shard "
                "grouped experts taking (experts, tokens per expert, dim) only (models/moe.py's)")


def is_transformers_module(module: nn.Module) -> bool:
    """Whether ``module``'s class is transformers' (an experts layer EP does not run, ``SIMULATED_EP``)."""
    return type(module).__module__.startswith("transformers.")
