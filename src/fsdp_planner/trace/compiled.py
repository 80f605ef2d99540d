"""What a ``torch.compile``'d block saves for backward, from AOTAutograd's own partitioner on tensors without data.

torchtitan compiles each transformer block on its own (``torch.compile(block, fullgraph=True)``). The compiled
block is one autograd node: AOTAutograd traces its forward and backward into one joint graph, and inductor's
partitioner (``min_cut_rematerialization_partition``, ``compiler="inductor"``) cuts it in two, saving for backward
the tensors of a minimum cut and recomputing cheap pointwise ops in backward instead of saving their outputs (a
norm's output, SiLU's). What eager saves op by op (the trace's ``Event.saved``) is therefore not what a compiled
block holds between its forward and its backward: this module runs the real partitioner, with inductor's
decompositions, on the block as the step calls it (its first call's arguments, on meta tensors), once per
distinct block (``reuse.static_signatures``, what the trace's block reuse compares), and counts the storages of
the backward graph's inputs that are neither its tangents nor the block's params and buffers (FSDP2's, not
activations), each storage once, as the tracer counts eager's saved tensors (``step.StepRecorder.save``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_planner.trace.reuse import static_signatures


class _Captured(Exception):
    """Raised by the capture hook once every distinct block's arguments are held: the rest of the forward is
    not needed."""


def block_arguments(model: nn.Module, example_args: tuple, example_kwargs: dict,
                    names: Sequence[str]) -> dict[str, tuple[tuple, dict]]:
    """The arguments of the first call of each distinct module among ``names`` (by static signature), captured by
    running the model's forward on its (meta) inputs up to the last such first call; name -> (args, kwargs)."""
    modules = dict(model.named_modules())
    signatures = static_signatures(model)
    wanted = {signatures[modules[n]]: n for n in reversed(names)}  # the first name of each signature
    captured: dict[str, tuple[tuple, dict]] = {}

    def hook(name: str):
        def capture(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            captured[name] = (args, kwargs)
            if len(captured) == len(wanted):
                raise _Captured

        return capture

    handles = [modules[n].register_forward_pre_hook(hook(n), with_kwargs=True) for n in wanted.values()]
    try:
        model(*example_args, **example_kwargs)
    except _Captured:
        pass
    finally:
        for h in handles:
            h.remove()
    return captured


def saved_nbytes(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes of the activations ``module``'s compiled call saves for backward: the partitioned backward graph's
    inputs less its tangents and the module's params and buffers, each storage once (module docstring)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    state = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    leaves, spec = tree_flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    names = list(state)

    def step(*flat: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(at, flat[:len(at)], strict=True):
            filled[i] = t
        a, k = tree_unflatten(filled, spec)
        return torch.func.functional_call(module, dict(zip(names, flat[len(at):], strict=True)), a, k)

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(kind: str):
        def compiler(gm: torch.fx.GraphModule, _inputs: list) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm)

        return compiler

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    run = aot_function(step, fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=partition,
                       decompositions=select_decomp_table())
    inputs = [leaves[i].detach().requires_grad_(leaves[i].requires_grad) for i in at]
    out = run(*inputs, *state.values())
    grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward([t.sum() for t in grads])
    return _backward_inputs_nbytes(graphs["fw"], graphs["bw"], len(at))


def _backward_inputs_nbytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, n_inputs: int) -> int:
    """Storage bytes of ``bw``'s saved inputs (not tangents), less the storages of ``fw``'s inputs past the first
    ``n_inputs`` (the params and buffers)."""
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    static = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in placeholders[n_inputs:]
              if isinstance(n.meta.get("val"), torch.Tensor)}
    seen: set[StorageWeakRef] = set()
    nbytes = 0
    for n in bw.graph.nodes:
        val = n.meta.get("val")
        if n.op != "placeholder" or n.name.startswith("tangents") or not isinstance(val, torch.Tensor):
            continue
        ref = StorageWeakRef(val.untyped_storage())
        if ref not in static and ref not in seen:
            seen.add(ref)
            nbytes += val.untyped_storage().nbytes()
    return nbytes


def compiled_saved(model: nn.Module, example_args: tuple, example_kwargs: dict,
                   names: Sequence[str]) -> dict[str, int]:
    """Name -> bytes its compiled call saves for backward, for every module in ``names`` (the model on meta, in
    the step's compute dtype); the partitioner runs once per distinct module."""
    modules = dict(model.named_modules())
    signatures = static_signatures(model)
    by_signature = {signatures[modules[n]]: saved_nbytes(modules[n], *call)
                    for n, call in block_arguments(model, example_args, example_kwargs, names).items()}
    return {n: by_signature[signatures[modules[n]]] for n in names if signatures[modules[n]] in by_signature}
