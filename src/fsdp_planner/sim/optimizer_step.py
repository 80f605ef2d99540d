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

Before it the grads are clipped (``GRAD_CLIP_BYTES``): torchtitan clips every step (``max_norm`` 1.0), as Hugging
Face's Trainer does (``max_grad_norm`` 1.0). A fused optimizer (``fused=True``: one kernel reading and writing each
tensor once) moves less; no option here says so.
"""

from __future__ import annotations

from fsdp_planner.hardware.cluster import Cluster, slowest_rank_factor

STEP_BYTES = {"sgd": 12, "sgd-momentum": 32, "adam": 72, "adamw": 80}
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
