"""RMSNorm as a GPU runs it (``norms.py``): CUDA's fused kernel, one op a call that saves the input and the per-row
statistics, in the trace and on fake ranks; real tensors keep torch's ``F.rms_norm``."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_planner.norms import fused_rms_norm_everywhere
from fsdp_planner.trace import record

DIM, ROWS = 64, 24


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def test_a_planned_rms_norm_is_one_op_saving_the_input_and_its_statistics() -> None:
    """Traced in bf16: the norm's forward is one kernel that saves the bf16 input and fp32 per-row statistics (2 bytes
    an element and 8 a row; CPU's decomposition saved 8 an element) and moves the input and output once; its
    backward one op reading the grad, the input, the statistics and the weight and writing the two grads."""
    with torch.device("meta"):
        model = Norms()
    x = torch.randn(ROWS, DIM, device="meta")
    tr = record(model, (x,), lambda y: y.float().sum(), compute_dtype=torch.bfloat16)
    forward = [e for e in tr.events if e.is_op and e.module == "norm" and not e.backward and e.nbytes]
    elements, stats, weight = ROWS * DIM * 2, ROWS * 8, DIM * 2
    assert [(e.saved, e.nbytes) for e in forward] == [(stats, 2 * elements + weight + stats)]
    # the projection's output (saved by the norm: counted once, where it was made); its input, the batch as the
    # model takes it, is held all step (``Trace.inputs_nbytes``), not charged where the projection saves it
    assert sum(e.saved for e in tr.events) == elements + stats
    assert tr.inputs_nbytes == ROWS * DIM * 4 + elements  # the fp32 batch and its bf16 copy
    backward = [e.nbytes for e in tr.events if e.is_op and e.backward]
    assert 3 * elements + stats + 2 * weight in backward


def test_real_tensors_and_other_weight_dtypes_keep_torchs_rms_norm() -> None:
    """On real tensors, or with a weight of another dtype than the input (CUDA's own fallback to the composite),
    ``F.rms_norm`` inside the binding is torch's."""
    x, w = torch.randn(ROWS, DIM), torch.randn(DIM)
    meta_x = x.to("meta", torch.bfloat16).requires_grad_()
    with fused_rms_norm_everywhere(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "Mismatch dtype between input and weight"
        real = F.rms_norm(x, (DIM,), w, 1e-6)
        mixed = F.rms_norm(meta_x, (DIM,), w.to("meta"), 1e-6)
        fused = F.rms_norm(meta_x, (DIM,), w.to("meta", torch.bfloat16), 1e-6)
    torch.testing.assert_close(real, torch.rms_norm(x, (DIM,), w, 1e-6))
    assert mixed.grad_fn.name() != "NativeLayerNormBackward0" and fused.grad_fn.name() == "NativeLayerNormBackward0"
    assert F.rms_norm.__module__ == "torch.nn.functional"  # put back on exit
