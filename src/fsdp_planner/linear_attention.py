"""Gated DeltaNet's linear attention as a GPU runs it, for steps that are only planned.

Qwen3.5, Qwen3-Next and OLMo-Hybrid (transformers) put Gated DeltaNet layers between their attention layers. On a GPU
their chunked gated delta rule runs flash-linear-attention's fused Triton kernels (FLA's
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``: transformers takes them where FLA is installed, torchtitan's
qwen3_5 always). Without FLA (a CPU, a meta device) transformers runs its reference PyTorch implementation
(``torch_chunk_gated_delta_rule``): a Python loop over 64-token chunks of small ops that saves each chunk's
intermediates. Traced as it is, a 9B Qwen3.5 step at 4,096 tokens was 199,000 ops, planned in 135 s, and its simulated
eager step (1.71 s on 8 H100s) bound by the launches of the loop's small kernels.

``install`` wraps the reference function of a transformers model's modules: on planned tensors it runs two ops that
stand for FLA's autograd function (``ChunkGatedDeltaRuleFunction``), with its outputs and what it saves for backward
(the l2-normalised queries and keys with their reciprocal norms, the values, the chunk-local cumulative gates in fp32,
beta, and the chunks' inverted (T, 64) matrices ``A``); on real tensors (``verify``) the reference itself. The
backward op's workspace holds what FLA's ``chunk_gated_delta_rule_bwd`` makes again: the chunk states ``h`` and their
gradients ``dh`` (one dk x dv matrix per chunk and value head each), and the (T, head dim) tensors ``w``, ``u``,
``v_new``, the new ``dv``, ``dw`` and dq and dk at the value heads' width. FLOPs: ``chunk_flops``. Time: an
attention kernel's, at ``FLA_SHARE_OF_FLASH`` of its efficiency (``sim/compute.py``). Not modelled: FLA's dispatch
to FlashQLA's kernels on SM90 and newer where the ``flash_qla`` package is installed.

Kimi delta attention (KDA: Kimi Linear, Bailing hybrid, GLM-5-Next's layers in transformers) is the same delta rule
with a decay per key channel. transformers' reference (``chunk_kimi_delta_attention``) is a loop too; on a GPU it
runs FLA's ``chunk_kda``, whose ``ChunkKDAFunction`` saves q and k (normalised, with reciprocal norms), v, the fp32
chunk-local cumulative gates, the gates it was given, beta and two (T, 64) matrices per value head (``Aqk`` and
``Akk``), and makes ``w``, ``u``, ``qg``, ``kg``, ``v_new`` and ``h`` again in backward (``disable_recompute`` off,
its default). Its ``tl.dot`` shapes are the gated delta rule's (the per-channel decay scales q and k elementwise
before them), so its FLOPs are ``chunk_flops`` too; FLA publishes no KDA row beside FlashAttention, so its time is
GDN's ``FLA_SHARE_OF_FLASH``: an estimate.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import register_flop_formula

from fsdp_planner.attention import planned

CHUNK = 64  # FLA's and transformers' chunk_size default
# FLA's GDN kernels achieve this share of what FlashAttention-2 achieves on the same GPU, in FLOPs per second as
# ``chunk_flops`` and the trace count them (FLA's README, "Benchmarks": one GB200, chunk_gdn with
# use_qk_l2norm_in_kernel against flash_attn_func causal, forward; the median of its three rows of head dim 128 and
# 4,096 tokens or more: 0.26, 0.21 and 0.28; tests/test_linear_attention.py recomputes them)
FLA_SHARE_OF_FLASH = 0.26
REFERENCE = "torch_chunk_gated_delta_rule"  # the name transformers' modeling modules give the reference
ATTRIBUTE = "chunk_gated_delta_rule"  # the layer's own attribute holding the rule (transformers before 5.25)
KDA_REFERENCE = "chunk_kimi_delta_attention"  # transformers' reference of Kimi delta attention


def chunk_macs(dk: int, dv: int, chunk: int = CHUNK) -> tuple[int, int]:
    """Multiply-adds per token and value head of FLA's chunked gated delta rule, (forward, backward), every
    ``tl.dot`` of its kernels counted. Forward (``chunk_gated_delta_rule_fwd``): the chunk's k.k^T (A), its
    triangular inverse, w = A.k and u = A.v, the state recurrence (w.h and k^T.v_new per chunk), and the output (q.h,
    q.k^T and its product with v_new). Backward (``chunk_gated_delta_rule_bwd``): w, u and h again, the local dv
    (q.k^T, its product with do), dh's recurrence (three dk x dv products), dq, dk and dw (three more, two chunk x dk
    and one chunk x dv), and the WY representation's backward (``prepare_wy_repr_bwd``: three chunk x dk and two
    chunk x dv products, and dA through A on both sides, chunk x chunk each)."""
    forward = chunk * (3 * dk + 2 * dv) + 3 * dk * dv + chunk * chunk // 3
    backward = 8 * dk * dv + chunk * (9 * dk + 5 * dv) + 2 * chunk * chunk
    return forward, backward


def chunk_flops(batch: int, tokens: int, v_heads: int, dk: int, dv: int, backward: bool) -> int:
    """FLOPs (two per multiply-add, as torch's counter counts) of one forward or backward call."""
    return 2 * batch * tokens * v_heads * chunk_macs(dk, dv)[backward]


@torch.library.custom_op("fsdp_planner::chunk_gated_delta_rule", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             l2norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    """(o, q normalised, q's reciprocal norms, k normalised, k's, the cumulative gates, A): FLA's forward. Run only on
    planned tensors (``chunk_rule`` takes the reference on real ones)."""
    raise RuntimeError("fsdp_planner::chunk_gated_delta_rule stands for FLA's kernels on planned tensors only")


@_forward.register_fake
def _forward_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  l2norm: bool) -> tuple[torch.Tensor, ...]:
    batch, tokens, _, _ = q.shape
    return (*_normed_outputs(q, k, v, l2norm), g.new_empty(batch, tokens, v.shape[-2], dtype=torch.float32),
            k.new_empty(batch, tokens, v.shape[-2], CHUNK))


def _normed_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, l2norm: bool) -> tuple[torch.Tensor, ...]:
    """(o, q normalised, q's reciprocal norms, k normalised, k's): what FLA's delta-rule functions (GDN's and KDA's)
    return and save first; without the norm they save the inputs themselves, nothing new."""
    batch, tokens, k_heads, _ = q.shape
    v_heads, dv = v.shape[-2:]
    normed = 1 if l2norm else 0
    return (q.new_empty(batch, tokens, v_heads, dv),
            q.new_empty(q.shape if l2norm else (0,)), q.new_empty(batch * normed, tokens, k_heads, dtype=torch.float32),
            k.new_empty(k.shape if l2norm else (0,)), k.new_empty(batch * normed, tokens, k_heads, dtype=torch.float32))


@torch.library.custom_op("fsdp_planner::chunk_gated_delta_rule_backward", mutates_args=())
def _backward(do: torch.Tensor, q: torch.Tensor, q_rstd: torch.Tensor, k: torch.Tensor, k_rstd: torch.Tensor,
              v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, a: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta): FLA's backward, on planned tensors only."""
    raise RuntimeError("fsdp_planner::chunk_gated_delta_rule_backward stands for FLA's kernels on planned tensors only")


@_backward.register_fake
def _backward_fake(do: torch.Tensor, q: torch.Tensor, q_rstd: torch.Tensor, k: torch.Tensor, k_rstd: torch.Tensor,
                   v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, g, beta, l2norm = inputs
    _, qn, q_rstd, kn, k_rstd, g_cum, a = output
    ctx.save_for_backward(qn if l2norm else q, q_rstd, kn if l2norm else k, k_rstd, v, g_cum, beta, a)
    ctx.g_dtype = g.dtype


def _grads(ctx: Any, do: torch.Tensor, *_: Any) -> tuple:
    q, q_rstd, k, k_rstd, v, g_cum, beta, a = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = _backward(do.contiguous(), q, q_rstd, k, k_rstd, v, g_cum, beta, a)
    return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None


torch.library.register_autograd("fsdp_planner::chunk_gated_delta_rule", _grads, setup_context=_setup)


def _forward_flops(q_shape: tuple, k_shape: tuple, v_shape: tuple, *args: Any, **kwargs: Any) -> int:
    batch, tokens, _, dk = q_shape
    return chunk_flops(batch, tokens, v_shape[-2], dk, v_shape[-1], backward=False)


def _backward_flops(do_shape: tuple, q_shape: tuple, *args: Any, **kwargs: Any) -> int:
    batch, tokens, v_heads, dv = do_shape
    return chunk_flops(batch, tokens, v_heads, q_shape[-1], dv, backward=True)


def backward_workspace(do: torch.Tensor, q: torch.Tensor) -> int:
    """Bytes FLA's backward holds besides its outputs at its peak (``chunk_bwd_dqkwg``: ``chunk_gated_delta_rule_bwd``
    keeps its locals to the end): h and dh, one dk x dv matrix per chunk and value head each; w, u, v_new, the new
    dv, dw, and dq and dk at the value heads' width (summed to the key heads' after), in the queries' dtype; and the
    fp32 dg. The forward's own (h, w, u and v_new while it runs) is not counted: the trace keeps no forward
    workspace, and a step's peak is in backward."""
    batch, tokens, v_heads, dv = do.shape
    k_heads, dk = q.shape[-2:]
    chunks = -(-tokens // CHUNK)
    states = 2 * batch * chunks * v_heads * dk * dv
    per_token = batch * tokens * (v_heads * (4 * dk + 3 * dv) + 2 * k_heads * dk)
    return (states + per_token) * q.element_size() + batch * tokens * v_heads * 4


@torch.library.custom_op("fsdp_planner::chunk_kda", mutates_args=())
def _kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 l2norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, q normalised, q's reciprocal norms, k normalised, k's, the cumulative gates, Aqk, Akk): FLA's
    ``chunk_kda`` forward, on planned tensors only."""
    raise RuntimeError("fsdp_planner::chunk_kda stands for FLA's kernels on planned tensors only")


@_kda_forward.register_fake
def _kda_forward_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      l2norm: bool) -> tuple[torch.Tensor, ...]:
    batch, tokens, _, _ = q.shape
    a = k.new_empty(batch, tokens, v.shape[-2], CHUNK)
    return (*_normed_outputs(q, k, v, l2norm), g.new_empty(g.shape, dtype=torch.float32), a, torch.empty_like(a))


@torch.library.custom_op("fsdp_planner::chunk_kda_backward", mutates_args=())
def _kda_backward(do: torch.Tensor, q: torch.Tensor, q_rstd: torch.Tensor, k: torch.Tensor, k_rstd: torch.Tensor,
                  v: torch.Tensor, g_cum: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, aqk: torch.Tensor,
                  akk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta): FLA's ``chunk_kda`` backward, on planned tensors only."""
    raise RuntimeError("fsdp_planner::chunk_kda_backward stands for FLA's kernels on planned tensors only")


@_kda_backward.register_fake
def _kda_backward_fake(do: torch.Tensor, q: torch.Tensor, q_rstd: torch.Tensor, k: torch.Tensor,
                       k_rstd: torch.Tensor, v: torch.Tensor, g_cum: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, aqk: torch.Tensor, akk: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta))


def _kda_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, g, beta, l2norm = inputs
    _, qn, q_rstd, kn, k_rstd, g_cum, aqk, akk = output
    ctx.save_for_backward(qn if l2norm else q, q_rstd, kn if l2norm else k, k_rstd, v, g_cum, g, beta, aqk, akk)


def _kda_grads(ctx: Any, do: torch.Tensor, *_: Any) -> tuple:
    dq, dk, dv, dg, dbeta = _kda_backward(do.contiguous(), *ctx.saved_tensors)
    return dq, dk, dv, dg, dbeta, None


torch.library.register_autograd("fsdp_planner::chunk_kda", _kda_grads, setup_context=_kda_setup)


# (one registration each: the formula registered is wrapped, and the name left bound to it)
register_flop_formula([torch.ops.fsdp_planner.chunk_gated_delta_rule, torch.ops.fsdp_planner.chunk_kda])(_forward_flops)
register_flop_formula([torch.ops.fsdp_planner.chunk_gated_delta_rule_backward,
                       torch.ops.fsdp_planner.chunk_kda_backward])(_backward_flops)


def kda_backward_workspace(do: torch.Tensor, q: torch.Tensor) -> int:
    """Bytes FLA's ``chunk_kda_bwd`` holds besides its outputs at its peak (``chunk_kda_bwd_intra``, its locals kept
    to the end): h and dh, one dk x dv matrix per chunk and value head each, in the queries' dtype; w, qg and kg (dk
    wide) and u and v_new (dv wide) in it too; dAqk and dAkk (64 wide) in fp32; dq, dk and dg, and the intra pass's
    dq, dk and dg again, in fp32 (dk wide each); db twice in fp32. The dv it returns is an output (the earlier dv
    passes are dropped as each replaces the last); its other outputs are those cast to the inputs' dtypes."""
    batch, tokens, v_heads, dv = do.shape
    dk = q.shape[-1]
    chunks = -(-tokens // CHUNK)
    states = 2 * batch * chunks * v_heads * dk * dv * q.element_size()
    rows = batch * tokens * v_heads
    return states + rows * ((3 * dk + 2 * dv) * q.element_size() + 4 * (2 * CHUNK + 6 * dk + 2))


def chunk_rule(reference: Callable[..., Any], op: Callable[..., tuple] = _forward) -> Callable[..., Any]:
    """``reference`` (transformers' ``torch_chunk_gated_delta_rule``, or ``chunk_kimi_delta_attention`` with ``op``
    KDA's) on real tensors; FLA's kernels (``op``) on planned ones, a cache's final state too (a training step with
    ``use_cache``: its layers take the kernels whether or not they are checkpointed, as they do on a GPU). Sequences
    packed together (``cu_seqlens``) and a recurrent state carried in are generation's: the reference takes them."""

    def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             chunk_size: int = CHUNK, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
             use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not planned(query) or initial_state is not None or chunk_size != CHUNK or \
                kwargs.get("cu_seqlens") is not None:
            return reference(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                             output_final_state=output_final_state,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        out = op(query.contiguous(), key.contiguous(), value.contiguous(), g, beta, use_qk_l2norm_in_kernel)
        # a cache's final state (use_cache): FLA's fp32 (value heads, dk, dv) state a sequence, the kernel's last
        batch, _, v_heads, dv = value.shape
        final = query.new_empty(batch, v_heads, query.shape[-1], dv, dtype=torch.float32) \
            if output_final_state else None
        return out[0], final

    rule.__wrapped_by_fsdp_planner__ = True  # type: ignore[attr-defined]
    rule.__wrapped__ = reference  # type: ignore[attr-defined]
    return rule


def install(model: nn.Module) -> int:
    """Wrap the reference gated delta rule and Kimi delta attention of every modeling module ``model``'s classes
    come from (``chunk_rule``), once per module, and the rule a layer holds as its own attribute (transformers before
    5.25 binds it in the layer's constructor: ``self.chunk_gated_delta_rule``); how many modules of ``model`` run
    one (0: none has linear attention)."""
    runs = 0
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        reference = getattr(module, REFERENCE, None)
        kda = getattr(module, KDA_REFERENCE, None)
        if callable(kda) and _calls(m, KDA_REFERENCE):
            runs += 1
            if not getattr(kda, "__wrapped_by_fsdp_planner__", False):
                setattr(module, KDA_REFERENCE, chunk_rule(kda, _kda_forward))
        if not _reads_rule(m) or (reference is None and not callable(getattr(m, ATTRIBUTE, None))):
            continue
        runs += 1
        if callable(reference) and not getattr(reference, "__wrapped_by_fsdp_planner__", False):
            setattr(module, REFERENCE, chunk_rule(reference))
        own = m.__dict__.get(ATTRIBUTE)
        if callable(own) and not getattr(own, "__wrapped_by_fsdp_planner__", False):
            setattr(m, ATTRIBUTE, chunk_rule(own))
    return runs


def kda_layers(model: nn.Module) -> int:
    """How many of ``model``'s modules call Kimi delta attention (their forward names transformers' reference)."""
    return sum(1 for m in model.modules() if _calls(m, KDA_REFERENCE))


def _calls(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward names ``name`` (a module-global function it calls)."""
    forward = inspect.unwrap(type(module).forward)
    return name in getattr(getattr(forward, "__code__", None), "co_names", ())


def layers(model: nn.Module) -> int:
    """How many of ``model``'s modules are gated DeltaNet layers (``_reads_rule``)."""
    return sum(1 for m in model.modules() if _reads_rule(m))


def _reads_rule(module: nn.Module) -> bool:
    """A linear-attention layer by what transformers' gated DeltaNet layers hold: a depthwise conv1d over q, k and v,
    the per-head decay ``A_log`` and its bias ``dt_bias``, and no skip ``D`` (Mamba-2's mixers have one)."""
    return isinstance(getattr(module, "conv1d", None), nn.Conv1d) and \
        all(isinstance(getattr(module, name, None), torch.Tensor) for name in ("A_log", "dt_bias")) and \
        getattr(module, "D", None) is None
