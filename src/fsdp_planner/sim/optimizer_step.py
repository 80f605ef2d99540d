"""The optimizer step on the GPU: a memory-bound pass over this rank's trainable shard, priced like inductor's
``comm_analysis`` prices a collective: a cited constant (bytes of HBM traffic per param element) over the bandwidth
that bounds it.

On CUDA, torch's optimizers default to their foreach implementation (``foreach=None``:
``torch/optim/optimizer.py`` ``_default_to_fused_or_foreach``; FSDP2's DTensor params qualify, ``torch/distributed/
tensor/__init__.py`` registers DTensor for it; ``fused`` is opt-in). Each ``torch._foreach_*`` op is a kernel over
the whole tensor list that reads its inputs from HBM and writes its outputs back, so the step is its bytes at the
memory-bound rate. Bytes per fp32 element (params, grads and state share the params' dtype; with the defaults'
hyper-parameters), counted from torch 2.13's steady-state steps:

- SGD (``torch/optim/sgd.py`` ``_multi_tensor_sgd``): ``_foreach_add_(params, grads, alpha=-lr)``: reads p and g,
  writes p: 12.
- SGD with momentum: ``_foreach_mul_(bufs, momentum)`` 8, ``_foreach_add_(bufs, grads)`` 12, then the params' add
  from the bufs 12: 32.
- Adam (``torch/optim/adam.py`` ``_multi_tensor_adam``, not capturable, weight_decay 0): ``_foreach_lerp_(exp_avgs,
  grads)`` 12, ``_foreach_mul_(exp_avg_sqs)`` 8, ``_foreach_addcmul_(exp_avg_sqs, grads, grads)`` 12,
  ``_foreach_sqrt(exp_avg_sqs)`` into a new list 8, its ``_foreach_div_`` 8 and ``_foreach_add_(eps)`` 8,
  ``_foreach_addcdiv_(params, exp_avgs, denom)`` 16: 72.
- AdamW: Adam's and the decoupled weight decay's ``_foreach_mul_(params)`` 8: 80.

The fused implementation (``fused=True``; torchtitan's default, ``optimizer.implementation = "fused"``, and Hugging
Face's Trainer's, ``adamw_torch_fused``, from torch 2.8) is one kernel (``_fused_adamw_``) that reads p, g, exp_avg
and exp_avg_sq once and writes p, exp_avg and exp_avg_sq once: 28 for Adam and AdamW. With torchtitan's
``fused_opt_states_bf16`` the two states are bf16 beside fp32 params and grads (the kernel's mixed-precision path,
``FusedAdamMathFunctorMP``): p 4 + g 4 + 2 + 2 read, p 4 + 2 + 2 written: 20 (with bf16 params it is the plain
fused step, 14 bytes a bf16 element, which the scaling below prices at 10: name ``adamw-fused`` there).

Memory (``STEP_TEMPORARIES``): foreach Adam's ``_foreach_sqrt(exp_avg_sqs)`` makes a new list the size of the
rank's whole trainable shard (exp_avg_sq's dtype) and holds it to the step's end, beside the params, grads and
state: on one H200 (``benchmarks/gpu_step.md``) Llama 3.2 3B with full checkpointing peaked there, 59.9 GiB. The
fused kernel and foreach SGD (default hyper-parameters: everything in place) make none.

Before it the grads are clipped (``GRAD_CLIP_BYTES``): torchtitan clips every step (``max_norm`` 1.0), as Hugging
Face's Trainer does (``max_grad_norm`` 1.0).
"""

from __future__ import annotations

from fsdp_planner.hardware.cluster import Cluster, slowest_rank_factor

STEP_BYTES = {"sgd": 12, "sgd-momentum": 32, "adam": 72, "adamw": 80, "adam-fused": 28, "adamw-fused": 28,
              "adam-fused-bf16-states": 20, "adamw-fused-bf16-states": 20}
# state-sized tensors the step makes and holds at once, per trainable element (module docstring)
STEP_TEMPORARIES = {"adam": 1, "adamw": 1}
# torch/nn/utils/clip_grad.py (foreach): ``_foreach_norm(grads)`` reads them (4), ``_foreach_mul_(grads, coef)``
# scales them in place (8)
GRAD_CLIP_BYTES = 12
FP32_BYTES = 4


def gpu_optimizer_seconds(numel: int, step_bytes: int, param_bytes: int, cluster: Cluster) -> float:
    """Seconds of the optimizer step (its grad clipping included) over ``numel`` elements of ``param_bytes`` each on
    one of ``cluster``'s GPUs: ``step_bytes`` + ``GRAD_CLIP_BYTES`` per fp32 element, scaled to the params' dtype,
    at the HBM bandwidth x the memory-bound efficiency, on the slowest rank (as every op: ``sim/compute.py``)."""
    nbytes = numel * (step_bytes + GRAD_CLIP_BYTES) * param_bytes / FP32_BYTES
    rate = cluster.gpu.hbm_bandwidth * cluster.compute.memory_efficiency
    return nbytes / rate * slowest_rank_factor(cluster.compute.variation, cluster.world_size)
