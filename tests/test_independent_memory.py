"""benchmarks/independent_memory.py (the fidelity table's independent check): its fake-tensor mode, which the main
table's large rows use, measures what its real-tensor mode measures on a small model."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "independent_memory.py"
WORLD = 8


def harness():
    spec = importlib.util.spec_from_file_location("independent_memory_under_test", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_fake_mode_measures_what_real_tensors_do_on_hsdp_with_checkpointing_and_int_reshard():
    """toy-llama on a 2 x 4 HSDP mesh, one block checkpointed in full, one op-level, one resharding to 2 of the
    4 shard ranks after forward (FSDP2's int), one kept unsharded, a forward prefetch: the two modes' peaks agree to
    0.01% (the CPU's SDPA kernel and its fake counterpart differ by at most a few bytes of log-sum-exp: 96 of 2.5 MB
    on toy-llama's titan plan)."""
    plan = {"groups": [{"modules": ["tok_embeddings"], "reshard_after_forward": True},
                       {"modules": ["layers.0"], "reshard_after_forward": True},
                       {"modules": ["layers.1"], "reshard_after_forward": 2},
                       {"modules": ["layers.2"], "reshard_after_forward": False},
                       {"modules": ["layers.3"], "reshard_after_forward": True, "forward_prefetch": [0]},
                       {"modules": ["norm", "output"], "reshard_after_forward": False}],
            "activation_checkpointing": ["layers.0"], "selective_checkpointing": {"layers.3": "titan"},
            "mesh": {"replicate": 2, "shard": 4}, "precision": "bf16-mixed"}
    module = harness()
    peaks = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        for fake in (False, True):
            args = argparse.Namespace(model="toy-llama", world=WORLD, precision="bf16-mixed", fake=fake,
                                      gpu_attention=False)
            peaks[fake] = module.measure(args, plan)
    finally:
        dist.destroy_process_group()
    assert peaks[True]["fake"] and not peaks[False]["fake"]
    assert peaks[False]["peak"] > 1 << 20  # a real step's peak, not an empty tracker
    assert abs(peaks[True]["peak"] / peaks[False]["peak"] - 1) < 1e-4, peaks
    assert peaks[True]["by_kind"]["OptState"] == peaks[False]["by_kind"]["OptState"] > 0
