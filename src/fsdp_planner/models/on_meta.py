"""Building a model on the meta device without paying for its initialisers.

Under ``torch.device("meta")`` every ``nn.Linear`` still runs ``reset_parameters``: ``kaiming_uniform_`` and
``uniform_`` go through the device's torch-function mode and the meta decompositions of the random fills, most
of the time of building a 10,000-module model, to fill tensors that hold no values. Inside ``meta_init`` the
``torch.nn.init`` fills return a meta tensor as it is; the factory's own code (its ``reset_parameters``, its own
fills, ``_init_weights`` of a Hugging Face model) runs unchanged, and a fill on a real tensor (an input made with
``device="cpu"``) still fills it. The cyclic garbage collector is paused meanwhile, as for a trace
(``batch.paused_gc``): its generational passes over the growing module tree took about half of what was left.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.init as nn_init

from fsdp_planner.batch import paused_gc
from fsdp_planner.patching import patched

# The public in-place initialisers (``*_``: uniform_, kaiming_uniform_, orthogonal_, ...), looked up when the
# module is imported: each takes the tensor to fill first and returns it.
_INITS = tuple(name for name, fn in vars(nn_init).items()
               if name.endswith("_") and not name.startswith("_") and inspect.isfunction(fn))


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build modules on the meta device, their ``torch.nn.init`` fills of meta tensors skipped."""
    with contextlib.ExitStack() as stack:
        for name in _INITS:
            stack.enter_context(patched(nn_init, name, _skipping_meta(getattr(nn_init, name))))
        stack.enter_context(torch.device("meta"))
        stack.enter_context(paused_gc())
        yield


def _skipping_meta(init: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``init`` for real tensors; a meta tensor is returned unfilled (it has no values to fill)."""

    @functools.wraps(init)
    def fill(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return init(tensor, *args, **kwargs)

    return fill
