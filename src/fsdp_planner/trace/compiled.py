"""What a ``torch.compile``'d block saves for backward, from AOTAutograd's own partitioner on tensors without data.

torchtitan compiles each transformer block on its own (``torch.compile(block, fullgraph=True)``). The compiled
block is one autograd node: AOTAutograd traces its forward and backward into one joint graph, and inductor's
partitioner (``min_cut_rematerialization_partition``, ``compiler="inductor"``) cuts it in two, saving for backward
the tensors of a minimum cut and recomputing cheap pointwise ops in backward instead of saving their outputs (a
norm's output, SiLU's). What eager saves op by op (the trace's ``Event.saved``) is therefore not what a compiled
block holds between its forward and its backward: this module runs the real partitioner, with inductor's
decompositions, on the block as the step calls it (its first call's arguments, on meta tensors), once per
distinct block (``alike_blocks``: blocks of one class whose eager calls ran alike share it), and counts the storages of
the backward graph's inputs that are neither its tangents nor the block's params and buffers (FSDP2's, not
activations), each storage once, as the tracer counts eager's saved tensors (``step.StepRecorder.save``).

Time: inductor fuses the memory-bound ops of each graph (pointwise ops and reductions) into kernels that read their
inputs and write their outputs once, and leaves matmuls and fused attention to their libraries (extern kernels).
The model here, from the partitioned graphs themselves: every memory-bound op between extern kernels is fused, so
a graph's memory-bound kernels move each tensor that crosses into a fused region once (a graph input or an extern
kernel's output that a memory-bound op reads) and each tensor one writes that leaves it once (read by an extern
kernel, or an output of the graph: a saved activation, a gradient); views move nothing. It assumes inductor fuses
whatever lies between two extern kernels (its scheduler may split a region at a reduction it cannot fuse, which
moves more), so it is a floor on the bytes. The kernels launched are the extern ones plus one per fused region
(memory-bound ops joined by their edges).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_unflatten

import fsdp_planner.routing as routing
from fsdp_planner.attention import GpuAttention, compilable, fused_sdpa_everywhere
from fsdp_planner.errors import PlannerError
from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.failures import compile_error
from fsdp_planner.trace.records import CompiledBlock, LazyVariants, Trace
from fsdp_planner.trace.reuse import static_signatures

# what inductor leaves to a library kernel rather than fusing (by the op's name): matmuls, convolutions, attention,
# and the linear-time mixers' kernels (``linear_attention.py``, ``mamba_scan.py``: opaque custom ops, as FLA's and
# mamba_ssm's own are to inductor)
EXTERN = ("mm", "convolution", "attention", "chunk_gated_delta_rule", "chunk_kda", "mamba_conv_scan",
          "selective_scan")


class BlockNotCompiled(PlannerError):
    """A block AOTAutograd or dynamo could not trace, by name (the error said the first block's otherwise): when
    the step is traced, or when a plan first reads a selective checkpointing variant (``LazyVariants``)."""

    def __init__(self, block: str, cause: Exception) -> None:
        super().__init__(f"--compile: AOTAutograd could not trace block '{block}' ({compile_error(cause)}); the "
                         "block does not compile with fullgraph=True as the step calls it: plan it eager (without "
                         "--compile), or make the block traceable (no data-dependent shapes: e.g. routing of a fixed "
                         "capacity)")
        self.block = block
        self.cause = cause


class _Captured(Exception):
    """Raised by the capture hook once every distinct block's arguments are held: the rest of the forward is
    not needed."""


def block_arguments(model: nn.Module, example_args: tuple, example_kwargs: dict,
                    names: Sequence[str]) -> dict[str, tuple[tuple, dict]]:
    """The arguments of the first call of each module of ``names``, captured by running the model's forward on its
    (meta) inputs up to the last such first call; name -> (args, kwargs)."""
    modules = dict(model.named_modules())
    captured: dict[str, tuple[tuple, dict]] = {}

    def hook(name: str):
        def capture(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            captured.setdefault(name, (args, kwargs))
            if len(captured) == len(names):
                raise _Captured

        return capture

    handles = [modules[n].register_forward_pre_hook(hook(n), with_kwargs=True) for n in dict.fromkeys(names)]
    try:
        model(*example_args, **example_kwargs)
    except _Captured:
        pass
    finally:
        for h in handles:
            h.remove()
    return captured


def alike_blocks(tr: Trace, names: Sequence[str]) -> dict[str, str]:
    """Each of ``names`` -> the first of them whose eager call traced alike (``_call_events``): the same class and
    params, and the same events relative to the block, forward and backward (every op's FLOPs, bytes, saved
    bytes, kernel and class, the params it reads by relative name). AOTAutograd traces the same code on the same
    shapes into the same graphs there, so the partitioner runs once for them all. transformers' decoder layers
    differ in an attribute (``layer_idx``, read by the KV cache only), which the trace's block reuse compares, and
    each was partitioned on its own: Qwen3-30B-A3B's 48 MoE blocks took minutes each with the checkpointing
    variants."""
    first: dict[tuple, str] = {}
    out = {}
    for name in names:
        key = (tr.modules[name].cls, _call_events(tr, name))
        out[name] = first.setdefault(key, name)
    return out


def _call_events(tr: Trace, name: str) -> tuple:
    """The events of ``name``'s first call, forward and backward, relative to it: each op's graph-side facts
    (``_GRAPH_FIELDS``), not the trace's storage accounting, which differs where one storage is first seen (the
    first block saves the rotary tables the others share). A block not traced as one call is never alike another."""
    spans = tr.index.boundaries_by_module.get(name, [])
    kinds = [tr.events[i].kind for i in spans[:4]]
    if len(kinds) < 2 or kinds != [EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_PRE,
                                   EventKind.BWD_POST][:len(kinds)]:
        return (name,)
    prefix = f"{name}."

    def relative(e: Event) -> tuple:
        params = tuple((tr.params[i].fqn.removeprefix(prefix), tr.params[i].requires_grad) for i in e.params)
        module = "" if e.module == name else e.module.removeprefix(prefix)
        return (module, params, *(getattr(e, f) for f in _GRAPH_FIELDS))

    forward = tuple(relative(e) for e in tr.events[spans[0] + 1:spans[1]])
    backward = tuple(relative(e) for e in tr.events[spans[2] + 1:spans[3]]) if len(kinds) == 4 else ()
    return forward, backward


# what an event says of the op itself (its shapes and kind), which AOTAutograd's graph of the call is made of
_GRAPH_FIELDS = ("kind", "call", "flops", "nbytes", "backward", "op_class", "out_nbytes", "packs", "kernel",
                 "grad_live", "workspace", "grad_inputs")


def _keeping(graphs: dict[str, torch.fx.GraphModule], kind: str) -> Callable[..., Any]:
    """A compiler for AOTAutograd that keeps the graph it is given as ``graphs[kind]`` and runs it as it is."""
    from torch._functorch.aot_autograd import make_boxed_func

    def compiler(gm: torch.fx.GraphModule, _inputs: list) -> Any:
        graphs[kind] = gm
        return make_boxed_func(gm)

    return compiler


def partitioned_graphs(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> dict[str, torch.fx.GraphModule]:
    """``fn``'s forward ("fw") and backward ("bw", absent when nothing needs a gradient) graphs as AOTAutograd
    partitions them for inductor (``min_cut_rematerialization_partition``, inductor's decompositions), traced by
    calling ``fn(*inputs)`` and a backward of every output that needs a gradient."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict[str, torch.fx.GraphModule] = {}
    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    run = aot_function(fn, fw_compiler=_keeping(graphs, "fw"), bw_compiler=_keeping(graphs, "bw"),
                       partition_fn=partition, decompositions=select_decomp_table())
    out = run(*inputs)
    grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.backward([t.sum() for t in grads])
    return graphs


def compiled_block(module: nn.Module, args: tuple, kwargs: dict) -> CompiledBlock:
    """``module``'s call compiled: the activations it saves for backward (the partitioned backward graph's inputs
    less its tangents and the module's params and buffers, each storage once) and its graphs' fused bytes and
    launches (module docstring)."""
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

    inputs = [leaves[i].detach().requires_grad_(leaves[i].requires_grad) for i in at]
    graphs = partitioned_graphs(step, [*inputs, *state.values()])
    fused = (fused_bytes(graphs["fw"]), fused_bytes(graphs["bw"]) if "bw" in graphs else (0, 0))
    return CompiledBlock(_saved_nbytes(graphs, set(range(len(at), len(at) + len(names)))),
                         (fused[0][0], fused[1][0]), (fused[0][1], fused[1][1]))


def saved_under_dynamo(module: nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes ``module``'s call saves for backward when ``torch.compile`` traces it (dynamo, then AOTAutograd with
    the same partitioner): for a forward AOTAutograd alone cannot trace, such as one under selective
    checkpointing, whose policy the partitioner applies (dynamo turns the checkpoint into a tagged region). Resets
    dynamo's caches: each distinct block is a new compile."""
    compilable()
    routing.compilable()
    # transformers 5.25's kernels-package forward wrapper sets a context variable inside the block, a side effect
    # dynamo refuses under a checkpoint unless told not to replay it in backward: what the block saves does not
    # depend on it
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        traced = dynamo_graphs(module, *_grad_leaves(args, kwargs))
    # dynamo names the inputs it lifts from the module's state after it: ..._parameters_... / _buffers_
    params = {i for i, name in enumerate(traced.names) if "_parameters_" in name or "_buffers_" in name}
    return _saved_nbytes(traced.graphs, params)


@dataclasses.dataclass(frozen=True)
class DynamoGraphs:
    """A call as ``torch.compile`` traces it: its partitioned graphs ("fw", "bw"), and the graph's inputs as
    dynamo lifted them (its placeholders' names, and the tensors the call passed there, in the same order, which
    is the forward graph's)."""

    graphs: dict[str, torch.fx.GraphModule]
    names: list[str]
    inputs: list[Any]


def dynamo_graphs(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> DynamoGraphs:
    """``fn(*args, **kwargs)`` compiled with fullgraph=True through dynamo and AOTAutograd with inductor's
    partitioner and decompositions, and a backward of every output that needs a gradient (``DynamoGraphs``).
    Dynamo lifts what ``fn`` reads besides its arguments (a module's state, the tensors a closure holds) as graph
    inputs. Resets dynamo's caches before and after."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict[str, torch.fx.GraphModule] = {}
    lifted: dict[str, list] = {}
    aot = aot_autograd(fw_compiler=_keeping(graphs, "fw"), bw_compiler=_keeping(graphs, "bw"),
                       decompositions=select_decomp_table(),
                       partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))

    def backend(gm: torch.fx.GraphModule, inputs: list) -> Any:
        lifted["names"] = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        lifted["inputs"] = list(inputs)
        return aot(gm, inputs)

    torch._dynamo.reset()
    quiet = logging.getLogger("torch")  # dynamo's advice on checkpoints under compile is for the user's own code
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
        grads = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.backward([t.sum() for t in grads])
    finally:
        quiet.setLevel(level)
        torch._dynamo.reset()
    return DynamoGraphs(graphs, lifted.get("names", []), lifted.get("inputs", []))


def _grad_leaves(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's tensors as leaves of their own: the captured forward's graph behind them is not this backward's
    (a decoder block's ``memory=`` keyword, the encoder's output: each variant's backward ran through the
    encoder's graph again, which the first had freed)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (args, kwargs))


def node_kind(n: torch.fx.Node, extern: tuple[str, ...] = EXTERN) -> str:
    """``view`` (moves nothing), ``extern`` (a kernel of its own, by the op's name: ``extern``), ``fused`` (a
    memory-bound op), or the node's op (``placeholder``, ``output``)."""
    if n.op != "call_function":
        return n.op
    name = str(n.target).split(".")[-2 if str(n.target).count(".") > 1 else -1]
    if getattr(n.target, "is_view", False) or n.target is operator.getitem:
        return "view"
    return "extern" if any(word in name for word in extern) else "fused"


class Kernels:
    """A partitioned graph as inductor runs it: kernels of their own (``kind`` "extern": library kernels) and fused
    regions (memory-bound ops joined by their edges), each region's kernel running where its last op is."""

    def __init__(self, gm: torch.fx.GraphModule, kind: Callable[[torch.fx.Node], str] = node_kind) -> None:
        self.nodes = list(gm.graph.nodes)
        self.kind = {n: kind(n) for n in self.nodes}
        self._parent = {n: n for n in self.nodes if self.kind[n] == "fused"}
        for n in self._parent:
            for i in n.all_input_nodes:
                if self.kind[self.root(i)] == "fused":
                    self._parent[self.region(self.root(i))] = self.region(n)
        self._position = {n: i for i, n in enumerate(self.nodes)}
        self._runs: dict[torch.fx.Node, int] = {}
        for n in self._parent:
            self._runs[self.region(n)] = max(self._runs.get(self.region(n), 0), self._position[n])
        out = next(n for n in self.nodes if n.op == "output")
        self.outputs = [n for n in tree_flatten(out.args)[0] if isinstance(n, torch.fx.Node)]

    @property
    def fused(self) -> list[torch.fx.Node]:
        return list(self._parent)

    def region(self, n: torch.fx.Node) -> torch.fx.Node:
        """The fused region of memory-bound op ``n`` (one of its ops stands for it)."""
        while self._parent[n] is not n:
            n = self._parent[n]
        return n

    def root(self, n: torch.fx.Node) -> torch.fx.Node:
        """The node whose storage ``n`` is (through views)."""
        while self.kind[n] == "view" and n.all_input_nodes:
            n = n.all_input_nodes[0]
        return n

    def readers(self, n: torch.fx.Node) -> list[torch.fx.Node]:
        """The ops that read ``n``, through views."""
        out: list[torch.fx.Node] = []
        for u in n.users:
            out.extend(self.readers(u) if self.kind[u] == "view" else [u])
        return out

    def leaves_region(self, n: torch.fx.Node) -> bool:
        """Whether memory-bound op ``n``'s output is read outside its region (written to memory)."""
        return any(self.kind[u] != "fused" for u in self.readers(n))

    def at(self, n: torch.fx.Node) -> int:
        """Where the kernel computing ``n`` runs."""
        return self._runs[self.region(n)] if n in self._parent else self._position[n]

    def last_read(self, n: torch.fx.Node) -> int:
        """Where the last kernel reading ``n`` runs (its own where nothing reads it)."""
        return max((self.at(u) for u in self.readers(n)), default=self.at(n))


def fused_bytes(gm: torch.fx.GraphModule, kind: Callable[[torch.fx.Node], str] = node_kind) -> tuple[int, int]:
    """Bytes the graph's memory-bound kernels move and the kernels it launches (module docstring); ``kind`` says
    what each node is (``node_kind``'s)."""
    k = Kernels(gm, kind)
    read = {k.root(i) for n in k.fused for i in n.all_input_nodes if k.kind[k.root(i)] != "fused"}
    written = sum(node_nbytes(n) for n in k.fused if k.leaves_region(n))
    return sum(node_nbytes(r) for r in read) + written, \
        sum(1 for kind in k.kind.values() if kind == "extern") + len({k.region(n) for n in k.fused})


def node_nbytes(n: torch.fx.Node) -> int:
    vals = n.meta.get("val")
    return sum(v.numel() * v.element_size() for v in tree_flatten(vals)[0] if isinstance(v, torch.Tensor))


def _saved_nbytes(graphs: Mapping[str, torch.fx.GraphModule], params: set[int]) -> int:
    """What a compiled call saves for backward: nothing when it has no backward graph (a frozen block whose
    input needs no gradient, as in a frozen backbone, runs forward only and keeps nothing)."""
    return _backward_inputs_nbytes(graphs["fw"], graphs["bw"], params) if "bw" in graphs else 0


def _backward_inputs_nbytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, params: set[int]) -> int:
    """Storage bytes of ``bw``'s saved inputs (not tangents), less the storages of ``fw``'s inputs at positions
    ``params`` (the params and buffers)."""
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    static = {StorageWeakRef(n.meta["val"].untyped_storage()) for i, n in enumerate(placeholders)
              if i in params and isinstance(n.meta.get("val"), torch.Tensor)}
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


def _compiled_with_variants(name: str, module: nn.Module, args: tuple, kwargs: dict,
                            variants: Mapping[str, Callable[[nn.Module], nn.Module]]) -> CompiledBlock:
    with GpuAttention():  # a model calling F.scaled_dot_product_attention (transformers') gets the kernel a GPU
        block = compiled_block(module, args, kwargs)  # picks, as its eager trace did, not the math path
    if not variants:
        return block
    # Each variant is a dynamo compile of seconds (a Qwen3 8B block: ~6 s on a CPU), and a plan reads the one
    # policy it checkpoints with. The first is measured now: dynamo refuses what torch.compile(fullgraph=True)
    # refuses (a print in the forward), which AOTAutograd alone lets through, and the step is refused so when
    # traced. The others when first read, on a copy of the block as it is now (its params in the step's compute
    # dtype) and under the context variables set now (the attention kernel planned).
    copy, context = deepcopy(module), contextvars.copy_context()

    def measure(make: Callable[[nn.Module], nn.Module]) -> int:
        try:
            return context.run(_saved_variant, make(copy), args, kwargs)
        except Exception as e:
            raise BlockNotCompiled(name, e) from e

    lazy = LazyVariants({v: functools.partial(measure, make) for v, make in variants.items()})
    lazy[next(iter(lazy))]
    return dataclasses.replace(block, variants=lazy)


def _saved_variant(module: nn.Module, args: tuple, kwargs: dict) -> int:
    with fused_sdpa_everywhere():  # (dynamo runs no torch function mode: the name bound instead) a transformers
        # block under SAC saved its math path's score matrices, every head's seq x seq (hf:llama3-8b --ac op
        # --compile: 4.6 GB a block at batch 2 x 4096, where the fused kernel's saves are 0.37 GB)
        return saved_under_dynamo(module, args, kwargs)


def compiled_blocks(model: nn.Module, example_args: tuple, example_kwargs: dict, names: Sequence[str],
                    variants: Mapping[str, Callable[[nn.Module], nn.Module]] | None = None,
                    alike: Mapping[str, str] | None = None) -> dict[str, CompiledBlock]:
    """Name -> its call compiled (``compiled_block``), for every module in ``names`` (the model on meta, in the
    step's compute dtype); the partitioner runs once per distinct one: ``alike`` (``alike_blocks``: each name ->
    the one it compiles as), else once per static signature (``reuse.static_signatures``). ``variants``: name -> a
    function making another module of a block (a copy under selective checkpointing), whose compiled saved bytes
    go to ``CompiledBlock.variants`` (``saved_under_dynamo``)."""
    modules = dict(model.named_modules())
    if alike is None:
        signatures = static_signatures(model)
        firsts: dict[int, str] = {}
        alike = {n: firsts.setdefault(signatures[modules[n]], n) for n in names}
    compiled = {}
    distinct = list(dict.fromkeys(alike.values()))
    for n, (args, kwargs) in block_arguments(model, example_args, example_kwargs, distinct).items():
        try:
            compiled[n] = _compiled_with_variants(n, modules[n], args, kwargs, variants or {})
        except BlockNotCompiled:  # (its default variant's: said once, not wrapped again)
            raise
        except Exception as e:
            raise BlockNotCompiled(n, e) from e
    return {n: compiled[first] for n, first in alike.items() if first in compiled}
