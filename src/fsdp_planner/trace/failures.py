"""Where a step failed: the op and the module call it ran in, so that an error from the user's model names both.

A failure keeps its own exception type (a model may catch it, and its message is the user's clue); the place is
attached to it (``mark``) and read back with ``failed_at``. Meta and fake kernels also let some ops through that
every real kernel refuses: a matmul or convolution whose floating operands differ in dtype (a tensor the forward
builds in float32 beside bfloat16 weights). ``check_operand_dtypes`` refuses them as a real device would, so a
traced step never calls fine what crashes on the cluster.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_planner.trace.tree import ROOT

_aten = torch.ops.aten
# Ops whose CPU and CUDA kernels require one dtype for all their operands (their meta kernels do not check).
SAME_DTYPE_OPS = frozenset({_aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.mv, _aten.addmv,
                            _aten.dot, _aten.vdot, _aten.convolution})
# Normalizations: the input first, then weight, bias (and a batch norm's running stats). Real kernels take params of
# the input's dtype, or float32 params for a 16-bit input; FSDP2's mixed precision casts the weight to bf16 but not
# the running stats (buffers), which no kernel takes.
NORM_OPS = frozenset({_aten.native_batch_norm, _aten._native_batch_norm_legit,
                      _aten._native_batch_norm_legit_functional, _aten._native_batch_norm_legit_no_training,
                      _aten.native_layer_norm, _aten.native_group_norm})
_ATTRIBUTE = "_fsdp_planner_failed_at"
LOSS = "\0loss"  # ``FailedOp.module`` of an op the factory's loss_fn ran, after the model's forward returned


class MixedDtypeError(RuntimeError):
    """A matmul or convolution on operands of different dtypes: every real kernel refuses it."""


@dataclass(frozen=True)
class FailedOp:
    """The op that failed and the module call it ran in (``ROOT``: the model's own forward, or the loss). ``op``
    is None when the module's forward failed before any op ran (``F.conv2d`` checks its operands' dtypes itself);
    ``kind`` is then the module's class."""

    op: str | None
    module: str
    kind: str = ""

    def describe(self) -> str:
        if self.op is None:
            return f"the forward of module '{self.module}'" + (f" ({self.kind})" if self.kind else "") \
                if self.module != ROOT else "the model's forward"
        if self.module == LOSS:
            return f"{self.op} in the factory's loss_fn (after the model's forward)"
        return f"{self.op} " + ("at the model's top level" if self.module == ROOT else f"in module '{self.module}'")


def op_name(func: Any) -> str:
    """``aten.mm``: the op's packet, as a user finds it in PyTorch's docs and error messages."""
    return f"{func.namespace}.{func._overloadpacket.__name__}"


def check_operand_dtypes(func: Any, args: tuple) -> None:
    """Raise ``MixedDtypeError`` for an op of ``SAME_DTYPE_OPS`` whose tensor operands differ in dtype,
    or a normalization (``NORM_OPS``) whose params no real kernel takes with its input."""
    packet = func._overloadpacket
    if packet not in SAME_DTYPE_OPS and packet not in NORM_OPS:
        return
    tensors = [a.dtype for a in args if isinstance(a, torch.Tensor)]
    floating = [d for d in tensors if d.is_floating_point]
    # a matmul's integer operand beside floating ones too (a batch of token ids fed to a Linear: a trial's model
    # planned and checked fine, then failed on every rank)
    dtypes = set(tensors if packet in SAME_DTYPE_OPS else floating)
    if len(dtypes) <= 1:
        return
    if packet in NORM_OPS:
        params = set(floating[1:])
        if len(params) == 1 and params == {torch.float32} and floating[0].itemsize < 4:
            return  # the mixed kernels: a 16-bit input normalized with float32 params
    names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    raise MixedDtypeError(f"{op_name(func)} got {names} operands, which real kernels refuse (expected one dtype)")


def mark_loss(e: BaseException) -> None:
    """``e`` was raised by the factory's loss_fn: an op it names ran there, not in the model's own forward."""
    failed = failed_at(e)
    if failed is not None and failed.module == ROOT and failed.op is not None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(e, _ATTRIBUTE, FailedOp(failed.op, LOSS))


def mark(e: BaseException, op: str | None, module: str, kind: str = "") -> None:
    """Attach where ``e`` was raised; the innermost place wins (the op, then each module call it leaves)."""
    if failed_at(e) is None:
        with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__: no place
            setattr(e, _ATTRIBUTE, FailedOp(op, module, kind))


def failed_at(e: BaseException) -> FailedOp | None:
    """Where ``e`` (or the exception it was raised from) failed, when an op of a traced step raised it."""
    while e is not None:
        found = getattr(e, _ATTRIBUTE, None)
        if found is not None:
            return found
        e = e.__cause__  # type: ignore[assignment]
    return None


def first_line(e: BaseException, limit: int = 200) -> str:
    """The exception's first line, cut to ``limit`` characters: one line of an error, whatever PyTorch wrote."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def compile_error(e: Exception) -> str:
    """``model_error``'s first line, and Dynamo's explanation of a graph break where it gives one: its message
    starts with the break's kind ("Failed to trace builtin operator") and names the cause (a ``print``) lines
    below."""
    first = model_error(e).splitlines()[0].strip()
    why = re.search(r"^\s*Explanation:\s*(\S.*)$", str(e), re.M)
    return f"{first.rstrip(':')}: {why.group(1).strip()}" if why else first


def model_error(e: Exception) -> str:
    """What the model raised, led by the op and the module it failed in when an op of the step raised it."""
    failed = failed_at(e)
    return f"{failed.describe() + ' raised ' if failed else ''}{type(e).__name__}: {e}"
