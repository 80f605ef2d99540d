"""An independent measurement of one plan's peak memory: torch's own ``FSDPMemTracker``, in its own process.

Run: python benchmarks/independent_memory.py MODEL PLAN.json WORLD [--precision bf16-mixed|fp32] [--fake]

MODEL: FILE.py:FACTORY or a built-in name (``toy-llama``, ``llama3-70b``: the factory of
``fsdp_planner.models.BUILTINS``, called with its defaults as the fake-world check calls it; the model definition
is the input, nothing else of fsdp_planner is used: not its runtime, simulator or apply code). A factory's file
is imported by path and its model built with real (CPU) tensors, on rank 0 of torch's fake process group of WORLD
ranks (collectives return at once, shapes real); with ``--fake``, for models too large for this host's memory,
the model, its inputs and every step run under torch's ``FakeTensorMode`` (no values, no memory: what the tracker
counts is each fake storage's size). The plan's ``mesh`` (replicate x shard) gives a 2-D mesh, as HSDP runs it.
This script reads the plan file (what ``plan --out`` writes) and applies it itself: checkpointing first (a named
module's forward under non-reentrant ``torch.utils.checkpoint``; for ``selective_checkpointing`` with op-level
SAC, its own save policy for the plan's policy name, written from torchtitan's description: 2026's keeps the
outputs of AOTAutograd's compute-intensive ops (torch's own list), SDPA's, ``max``'s, ``topk``'s and the
collectives', the earlier lists mm's, SDPA's and ``max``'s; every second mm of a block call recomputed), then
``fully_shard`` on each group (deepest first, the root last) with
the group's ``reshard_after_forward`` (an int: FSDP2's post-forward mesh of that many ranks, 1 meaning False and
the shard size True), its prefetch lists, and a ``MixedPrecisionPolicy`` of the precision (bf16 params, fp32 reduce;
a group's ``param_dtype`` fp32 gets an fp32 one). One step of AdamW (lr 1e-3) creates the optimizer state, then
the second step (forward, loss, backward, ``step``, ``zero_grad(set_to_none=True)``) runs under
``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``), whose peak (bytes on the CPU device: the
params, grads, optimizer state, inputs, activations and FSDP2's buffers it tracks) is printed as one JSON line.
SDPA takes the kernel the CPU picks (its flash kernel where it applies: outputs and log-sum-exp saved, as on a GPU;
where it does not, the math path, whose ops, fp32 scores included, are the ones the product runs for a GPU's math
path). The tracker is ``GroupMemTracker``: FSDPMemTracker as torch ships it changes FSDP2's backward schedule for a
group of several modules (its docstring), and measured 1-14% less than FSDP2 allocates on the U-Net, Swin and Falcon.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._functorch.partitioners import get_default_op_list
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _SavedFSDPMethods
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
SDPA_OPS = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_fused_attention_overrideable.default}
# the plan's op-level policy -> the ops whose outputs it saves: torchtitan's lists as its sources describe them
# (2026's SelectiveAC: AOTAutograd's compute-intensive ops, taken from torch itself, the SDPA kernels, max, topk,
# the collectives; 2025's and 2024's llama3 lists: mm, SDPA, max), every second mm of a block call recomputed
SAVED_OPS = {
    "titan": {op for packet in get_default_op_list().compute_intensive_ops for op in
              (getattr(packet, name) for name in packet.overloads())}
    | SDPA_OPS | {aten.max.default, aten.topk.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
                  torch.ops._c10d_functional.all_to_all_single.default},
    "titan-2025": {aten.mm.default, aten.max.default, *SDPA_OPS},
    "titan-early": {aten.mm.default, aten.max.default, *SDPA_OPS},
}


def factory(spec: str):
    """A FILE.py:FACTORY's function, or a built-in model's factory (its workload defaults)."""
    if ":" not in spec:
        from fsdp_planner.models import BUILTINS  # the model definition only: the input, not the harness

        return BUILTINS[spec].factory
    path, name = spec.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(Path(path).stem + "_independent", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return getattr(module, name)


class GroupMemTracker(FSDPMemTracker):
    """``FSDPMemTracker`` that keeps a group of several modules (``fully_shard([pool.0, pool.1, head])``) one group.

    FSDPMemTracker re-registers every FSDP module's forward hooks with its own wrappers, one module at a time; on a
    group of several modules that runs the group's whole post-forward after each member (where fully_shard runs it
    once, after the last), so backward then runs the group's pre- and post-backward, a reduce-scatter included, per
    member: FSDP2's schedule changes under the tool. On the U-Net (``pool.0, pool.1, head`` in one group) its extra
    post-backward after ``pool.1`` freed the previous group's reduce-scatter input before the next block's
    recomputation, where real FSDP2 holds it through it: 13-14% below the run without the tool under ``--ac full``.
    Here the same wrappers are registered as fully_shard registers its own: through FSDP2's group hooks for a
    group, plainly for one module; backward's wrappers once per group, on a member whose forward ran. Only the
    peak is read, so the hooks put back on exit (plain, per module) never run."""

    def _instrument_fsdp_module(self) -> None:
        states = {}  # each FSDP state with params, and its first module
        for module in self._root_mod.modules():
            if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_group:
                states.setdefault(module._get_fsdp_state(), module)
        for state, first in states.items():
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            group = state._fsdp_param_group
            self._instrument_fsdp_sharded_params_grads(group)
            pre = {m: self._fsdp_state_pre_forward(m, state._pre_forward) for m in state._modules}
            post = {m: self._fsdp_state_post_forward(m, state._post_forward) for m in state._modules}
            if len(state._modules) == 1:
                state._pre_forward_hook_handle = first.register_forward_pre_hook(pre[first], prepend=True,
                                                                                 with_kwargs=True)
                state._post_forward_hook_handle = first.register_forward_hook(post[first], prepend=False,
                                                                              always_call=True)
            else:
                state._pre_forward_hook_handle = state._post_forward_hook_handle = _register_group_forward_hooks(
                    state._modules, lambda m, args, kwargs, pre=pre: pre[m](m, args, kwargs),
                    lambda m, args, out, post=post: post[m](m, args, out), state._modules_to_run_forward,
                    state._cast_output_dtype)
            self._fsdp_mod_to_saved_methods[first] = saved = _SavedFSDPMethods(group.pre_backward,
                                                                                 group.post_backward)
            group.pre_backward = functools.partial(self._backward_hook, state, saved.pre_backward, pre=True)
            group.post_backward = functools.partial(self._backward_hook, state, saved.post_backward, pre=False)
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    def _backward_hook(self, state, original, *args, pre: bool, **kwargs):
        """The tool's backward wrapper, on the first member whose forward ran (its stats are kept per module: a
        member never called, such as BART's ``model.shared`` beside the ``embed_tokens`` that run, has none)."""
        module = next((m for m in state._modules if m in self.memory_tracking), state._modules[0])
        wrap = self._fsdp_param_group_pre_backward if pre else self._fsdp_param_group_post_backward
        return wrap(module, original)(*args, **kwargs)


def sac_context(saved: set) -> object:
    """A fresh mm count per block call: odd-numbered mm outputs kept, even-numbered recomputed; ``saved``'s ops
    kept."""
    count = {"mm": 0}

    def policy(ctx, op, *args, **kwargs):
        if op == aten.mm.default and not ctx.is_recompute:
            count["mm"] += 1
            if count["mm"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_forward(module: nn.Module, policy: str | None) -> None:
    """The module's forward under non-reentrant ``checkpoint``, op-level under the plan's ``policy`` where given; a
    Hugging Face layer by transformers' own gradient checkpointing (``GradientCheckpointingLayer``), which drops the
    KV cache the layer would write (the recomputation would write it again), as ``gradient_checkpointing_enable()``
    does for a user."""
    extra = {"context_fn": functools.partial(sac_context, SAVED_OPS[policy])} if policy else {}
    if hf_checkpointing_layer(module):
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False, **extra)
        return
    forward = module.forward

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    module.forward = run


def hf_checkpointing_layer(module: nn.Module) -> bool:
    if "transformers" not in sys.modules:
        return False
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer)


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def gpu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` by the kernel SDPA's CUDA dispatcher picks, for ``--gpu-attention``
    (fake tensors only: the GPU kernels' fake implementations give their outputs' and saved tensors' shapes). The
    CPU has no memory-efficient kernel and its flash kernel takes no value head size other than the query's: a
    model the GPU runs fused (MLA's narrower values, a mask) runs the math path there, saving its score matrices.
    The constraints are SDPA's documented ones: every kernel wants a last dim of stride 1; flash wants fp16/bf16,
    no mask, one head size of at most 256, and the same heads for keys (or ``enable_gqa``); the memory-efficient
    kernel takes a mask (an additive bias in the query's dtype) and a value head size of its own, but not
    ``enable_gqa``; anything else runs the math path, as on the CPU."""
    if any(t.stride(-1) != 1 for t in (q, k, v)) or (k.size(-3) != q.size(-3) and not enable_gqa):
        return math_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is None and q.dtype in FLASH_DTYPES and q.size(-1) == v.size(-1) <= 256:
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if enable_gqa and k.size(-3) != q.size(-3):
        return math_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # True takes part: 0 there, -inf elsewhere
            bias = torch.zeros(bias.shape, dtype=q.dtype).masked_fill(bias.logical_not(), float("-inf"))
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(*q.shape[:-1], k.size(-2))
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


CPU_SDPA = torch.nn.functional.scaled_dot_product_attention
CPU_RMS_NORM = torch.nn.functional.rms_norm


class FusedRMSNorm(torch.autograd.Function):
    """CUDA's ``aten::_fused_rms_norm`` as autograd sees it: one kernel whose backward needs the input, the weight
    and the per-row fp32 reciprocal RMS, which is all it saves (the fp32 work stays inside the kernel). Written
    here from that contract (on a CPU device the op decomposes, so calling it would save what the CPU saves)."""

    @staticmethod
    def forward(ctx, x, weight, dims: tuple[int, ...], eps: float):
        rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.dims = dims
        out = x.float() * rstd
        return (out * weight if weight is not None else out).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float() * weight if weight is not None else grad.float()
        grad_x = rstd * (g - xhat * (g * xhat).mean(ctx.dims, keepdim=True))
        lead = tuple(range(x.dim() - len(ctx.dims)))
        grad_w = (grad.float() * xhat).sum(lead).to(weight.dtype) if weight is not None else None
        return grad_x.to(x.dtype), grad_w, None, None


def gpu_rms_norm(input, normalized_shape, weight=None, eps=None):
    """``F.rms_norm`` as CUDA runs it, for ``--gpu-attention`` (fake tensors only): torch's layer_norm.cpp calls
    its one fused kernel, ``aten::_fused_rms_norm``, when the weight's dtype is the input's (``FusedRMSNorm``);
    a CPU decomposes the op into upcast, pow, mean, rsqrt and two multiplies, which save the input upcast to fp32
    and the normalized product. Other weights take the composite path there too."""
    if weight is not None and weight.dtype != input.dtype:
        return CPU_RMS_NORM(input, normalized_shape, weight, eps)
    if eps is None:  # torch's default: the epsilon of the dtype it computes in (fp32 for 16-bit inputs)
        eps = torch.finfo(torch.promote_types(input.dtype, torch.float32)).eps
    dims = tuple(range(-len(normalized_shape), 0))
    return FusedRMSNorm.apply(input, weight, dims, float(eps))


def math_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA's math path (the CPU would take its flash kernel for some of these: a mask, grouped-query keys)."""
    with sdpa_kernel(SDPBackend.MATH):
        return CPU_SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def gpu_attention(on: bool):
    """The GPU's kernels where the CPU's differ: ``gpu_sdpa`` bound as ``F.scaled_dot_product_attention`` and
    ``gpu_rms_norm`` as ``F.rms_norm`` (bindings, not a torch function mode, which a checkpointed block's
    recomputation in backward would run outside of)."""
    if on:
        torch.nn.functional.scaled_dot_product_attention = gpu_sdpa
        torch.nn.functional.rms_norm = gpu_rms_norm
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = CPU_SDPA
        torch.nn.functional.rms_norm = CPU_RMS_NORM


def device_mesh(plan: dict, world: int):
    """The plan's data-parallel mesh: 1-D, or (replicate, shard) for HSDP (``fully_shard`` shards over the last
    dim and all-reduces over the first)."""
    mesh = plan.get("mesh") or {"replicate": 1, "shard": world}
    if mesh["replicate"] == 1:
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (mesh["replicate"], mesh["shard"]), mesh_dim_names=("dp_replicate", "dp_shard"))


def reshard(value, shard_size: int):
    """FSDP2's argument for a plan's ``reshard_after_forward``: an int is a post-forward mesh size, 1 False."""
    if isinstance(value, bool) or value is None:
        return value
    return False if value <= 1 else True if value >= shard_size else value


def shard(model: nn.Module, plan: dict, mesh, precision: str) -> None:
    modules = dict(model.named_modules())
    for name in plan.get("activation_checkpointing", []):
        checkpoint_forward(modules[name], None)
    for name, policy in plan.get("selective_checkpointing", {}).items():
        checkpoint_forward(modules[name], policy)
    shard_size = mesh.size(mesh.ndim - 1)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=True)
    plain = bf16 if precision == "bf16-mixed" else MixedPrecisionPolicy()
    groups = sorted(plan["groups"], key=lambda g: -min(m.count(".") + bool(m) for m in g["modules"]))  # root last
    for g in groups:
        targets = [modules[m] for m in g["modules"]]
        mp = fp32 if g.get("param_dtype") == "fp32" else plain
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard(g["reshard_after_forward"], shard_size))
    if not any(g["modules"] == [""] for g in plan["groups"]):
        fully_shard(model, mesh=mesh, mp_policy=plain, reshard_after_forward=False)
    prefetch(modules, plan["groups"])


def prefetch(modules: dict, groups: list[dict]) -> None:
    """The plan's explicit prefetching: a group's FSDP module is its first module that holds FSDP state."""
    states = [next(modules[m] for m in g["modules"] if isinstance(modules[m], FSDPModule)) for g in groups]
    for g, first in zip(groups, states, strict=True):
        if g.get("forward_prefetch"):
            first.set_modules_to_forward_prefetch([states[j] for j in g["forward_prefetch"]])
        if g.get("backward_prefetch"):
            first.set_modules_to_backward_prefetch([states[j] for j in g["backward_prefetch"]])


def step(model: nn.Module, inputs, loss_fn, optimizer) -> None:
    """The output is dropped once the loss is made, as a training loop's ``loss = loss_fn(model(x))`` does: only
    what autograd saved of it stays through backward."""
    loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args, plan: dict) -> dict:
    """Build, shard, train one step, then measure the second under the tracker; under ``FakeTensorMode`` with
    ``--fake`` (the mesh made before it: its rank tensors must be real)."""
    mesh = device_mesh(plan, args.world)
    mode = FakeTensorMode(allow_non_fake_inputs=True) if args.fake else contextlib.nullcontext()
    with mode, gpu_attention(args.gpu_attention):
        torch.manual_seed(0)
        built = factory(args.model)()
        model, inputs, loss_fn = built if len(built) == 3 else (*built, default_loss)
        # FSDP2's int reshard_after_forward builds its post-forward mesh from a tensor's values: real ones (the
        # fake params still dispatch to their mode, so what FSDP2 makes from them stays fake)
        with unset_fake_temporarily() if args.fake else contextlib.nullcontext():
            shard(model, plan, mesh, plan.get("precision", args.precision))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step(model, inputs, loss_fn, optimizer)  # creates the optimizer state
        tracker = GroupMemTracker(model, optimizer)
        tracker.track_inputs(tuple(inputs.values()) if isinstance(inputs, dict) else tuple(inputs))
        with tracker:
            step(model, inputs, loss_fn, optimizer)
    snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {"peak": snap["Total"], "fake": bool(args.fake), "gpu_attention": bool(args.gpu_attention),
            "by_kind": {str(k.value if hasattr(k, "value") else k): v for k, v in snap.items()}}


def default_loss(out) -> torch.Tensor:
    """The loss for a factory that gives none: the mean square of the (first) floating output, its logits for a
    Hugging Face output."""
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = next(t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point())
    return out.float().pow(2).mean()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("plan")
    parser.add_argument("world", type=int)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--fake", action="store_true", help="run under FakeTensorMode (no real memory)")
    parser.add_argument("--gpu-attention", action="store_true",
                        help="with --fake: SDPA and RMSNorm take the kernels a GPU runs (gpu_sdpa, gpu_rms_norm), "
                             "not the CPU's")
    args = parser.parse_args()
    if args.gpu_attention and not args.fake:
        parser.error("--gpu-attention needs --fake: the CPU has no implementation of the GPU's kernels")
    plan = json.loads(Path(args.plan).read_text())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    try:
        print(json.dumps(measure(args, plan)))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
