"""Built-in models and loading of user model factories.

A MODEL spec is a built-in name, ``path/to/file.py:fn`` or ``package.module:fn``; ``fn()`` returns
``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``. For planning the factory runs under
``torch.device("meta")`` so even a 405B model costs no memory.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.errors import PlannerError
from fsdp_planner.models import encdec, gpt2, llama, moe, seed, vit


@dataclass(frozen=True)
class Builtin:
    factory: Callable[[], tuple]
    description: str
    trainable: bool  # small enough to train on CPU (verify)


BUILTINS: dict[str, Builtin] = {
    "seed-net": Builtin(seed.seed_net, "the seed's CNN (conv1, conv2, fc1, fc2), MNIST-sized input", True),
    "toy-llama": Builtin(lambda: llama.build(llama.TOY_LLAMA, batch_size=4, seq_len=32),
                         "4-layer Llama-style decoder, trains on CPU in seconds", True),
    "toy-gpt2-tied": Builtin(gpt2.toy_gpt2_tied, "3-layer GPT-2-style decoder, lm_head tied to wte", True),
    "seed-linear10": Builtin(seed.seed_linear10, "seed 002's 10 x Linear(10000, 10000) memory study", False),
    "llama3-8b": Builtin(lambda: llama.build(llama.LLAMA3_8B, 1, 8192), "Llama 3 8B, seq 8192 (planning)", False),
    "llama3-70b": Builtin(lambda: llama.build(llama.LLAMA3_70B, 1, 8192), "Llama 3 70B, seq 8192 (planning)",
                          False),
    "llama3-405b": Builtin(lambda: llama.build(llama.LLAMA3_405B, 1, 8192), "Llama 3 405B, seq 8192 (planning)",
                           False),
    "llama32-3b": Builtin(lambda: llama.build(llama.LLAMA32_3B, 1, 8192),
                          "Llama 3.2 3B, tied embeddings, seq 8192 (planning)", False),
    "t5-3b": Builtin(encdec.t5_3b,
                     "T5 v1.1 XL encoder-decoder, shared embedding, enc 1024 / dec 256 (planning)", False),
    "vit-h14": Builtin(vit.vit_h14,
                       "ViT-H/14, batch 32 at 224px (planning)", False),
    "mixtral-8x7b": Builtin(moe.mixtral_8x7b,
                            "Mixtral 8x7B MoE, 8 experts top-2, seq 4096 (planning)", False),
}


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    example_inputs: Any
    loss_fn: Callable[[Any], torch.Tensor] | None


def resolve_factory(spec: str) -> Callable[[], tuple]:
    """The factory function a MODEL spec names."""
    if spec in BUILTINS:
        return BUILTINS[spec].factory
    if ":" not in spec:
        known = ", ".join(BUILTINS)
        raise PlannerError(f"unknown model '{spec}': use a built-in ({known}) or 'file.py:fn' / 'module:fn'")
    target, _, fn_name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise PlannerError(f"model file '{target}' does not exist")
        mod_name = f"_fsdp_planner_user_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise PlannerError(f"cannot import '{target}'")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # user code: report, never a traceback
            raise PlannerError(f"importing '{target}' failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise PlannerError(f"cannot import module '{target}': {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise PlannerError(f"'{target}' has no callable '{fn_name}'")
    return fn


def load_model(spec: str, meta: bool = True, seed: int = 0) -> LoadedModel:
    """Build the model a spec names; on the meta device when ``meta`` (planning only)."""
    factory = resolve_factory(spec)
    torch.manual_seed(seed)
    try:
        if meta:
            with torch.device("meta"):
                result = factory()
        else:
            result = factory()
    except PlannerError:
        raise
    except (Exception, SystemExit) as e:  # user code: a SystemExit (argparse in a factory) is an error too
        raise PlannerError(f"model factory '{spec}' raised {type(e).__name__}: {e}") from e
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise PlannerError(
            f"model factory '{spec}' must return (model, example_inputs) or (model, example_inputs, loss_fn)"
        )
    loss_fn = result[2] if len(result) == 3 else None
    return LoadedModel(spec, result[0], result[1], loss_fn)
