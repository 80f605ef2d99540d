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


def exit_message(e: SystemExit, while_doing: str) -> str:
    """What to say when the user's code calls ``sys.exit``: it would otherwise end the planner silently, with the
    status the model chose (often 0, as if the command had succeeded)."""
    code = "" if e.code is None else repr(e.code)
    return f"the model's code called sys.exit({code}) while {while_doing} (raised SystemExit: {e.code})"


def _check_model_file(target: str) -> Path:
    path = Path(target)
    if path.is_file():
        return path
    if path.is_dir():
        raise PlannerError(f"model file '{target}' is a directory: give path/to/file.py:fn")
    if path.exists():
        raise PlannerError(f"model file '{target}' is not a regular file")
    raise PlannerError(f"model file '{target}' does not exist")


def resolve_factory(spec: str) -> Callable[[], tuple]:
    """The factory function a MODEL spec names."""
    if spec in BUILTINS:
        return BUILTINS[spec].factory
    if ":" not in spec:
        known = ", ".join(BUILTINS)
        raise PlannerError(f"unknown model '{spec}': use a built-in ({known}) or 'file.py:fn' / 'module:fn'")
    target, _, fn_name = spec.rpartition(":")
    if not target.endswith(".py") and ("/" in target or Path(target).is_dir()):
        kind = "a directory" if Path(target).is_dir() else "not a .py file"
        raise PlannerError(f"model '{spec}': '{target}' is {kind}; give path/to/file.py:fn or package.module:fn")
    if target.endswith(".py"):
        path = _check_model_file(target)
        mod_name = f"_fsdp_planner_user_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise PlannerError(f"cannot import '{target}'")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except SystemExit as e:
            raise PlannerError(exit_message(e, f"importing '{target}'")) from e
        except Exception as e:  # user code: report, never a traceback
            raise PlannerError(f"importing '{target}' failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except SystemExit as e:
            raise PlannerError(exit_message(e, f"importing module '{target}'")) from e
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
    except SystemExit as e:  # sys.exit or argparse in a factory is an error too, never a silent exit
        raise PlannerError(exit_message(e, f"building the model '{spec}'")) from e
    except Exception as e:  # user code: report, never a traceback
        raise PlannerError(f"model factory '{spec}' raised {type(e).__name__}: {e}") from e
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise PlannerError(
            f"model factory '{spec}' must return (model, example_inputs) or (model, example_inputs, loss_fn)"
        )
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise PlannerError(f"model factory '{spec}' returned a loss_fn that is not callable: "
                           f"{type(loss_fn).__name__}")
    params = list(model.parameters())
    if not params:
        raise PlannerError(f"model '{spec}' has no parameters: there is nothing for FSDP to shard")
    if not any(p.requires_grad for p in params):
        raise PlannerError(f"model '{spec}' has no trainable parameters (all {len(params)} have requires_grad="
                           "False): FSDP plans are for training; leave some parameters trainable")
    if meta:
        inputs = _onto_meta(model, inputs)
    return LoadedModel(spec, model, inputs, loss_fn)


def _onto_meta(model: nn.Module, inputs: Any) -> Any:
    """Example inputs the factory made outside ``torch.device("meta")`` (a module-level tensor, an explicit
    ``device="cpu"``) moved onto the meta device with the model, as the model's own device would need them."""
    from torch.utils._pytree import tree_map_only

    if not all(p.is_meta for p in model.parameters()):
        return inputs  # a model built outside the meta device: its inputs stay where the factory put them

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        return t.detach().to("meta").requires_grad_(t.requires_grad)

    return tree_map_only(torch.Tensor, to_meta, inputs)
