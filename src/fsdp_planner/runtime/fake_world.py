"""Real FSDP2 at any world size, in this one process: the ground truth for counts, bytes and memory.

The model is built by its factory under ``FakeTensorMode`` (no real memory; where its constructor reads a tensor
value, on meta as ``plan`` builds it, then made fake: ``fake_build.py``), the plan applied with real
``fully_shard`` over a mesh of the fake process group (``dist.init_process_group("fake")``: collectives return
at once, with their real shapes), and real training steps run: forward, loss, backward, the optimizer's step
(foreach or fused, as on a GPU), ``zero_grad()`` (``set_to_none`` as asked). What FSDP2 does is what it would do on
W GPUs; only the values are missing.

Measured, on the last step (the first creates the optimizer state):
- collectives and their bytes, by wrapping the ``torch.distributed`` functions FSDP2 calls (``worker.py``): those
  over the data-parallel dims; with tensor parallelism (the plan's ``tensor_parallel``, applied by ``apply_plan``
  over the ``tp`` dim of the mesh) also DTensor's own over ``tp``, apart (``FunctionalCounter``), the loss under
  ``loss_parallel()`` when the plan asks for it; with expert parallelism (the plan's ``expert_parallel``, applied
  by ``apply_plan``: the experts over ``ep`` and their EP-reduced FSDP mesh) EP's all-to-alls, apart;
- attention: SDPA takes the kernel a GPU picks (``attention.fused_sdpa_everywhere``), as the trace assumed, and so
  does ``F.rms_norm`` (``norms.fused_rms_norm_everywhere``);
  the CPU's own choice would be the math path for some shapes (query/key heads wider than value heads);
- peak memory: every live tensor storage, counted when an op makes it and when FSDP2 resizes it (its
  unsharded params are storages resized between 0 and their size), uncounted when Python frees it; plus what was
  alive when the step began (sharded params, optimizer state, inputs). ``FSDPMemTracker`` would re-register
  FSDP2's hooks and change what list groups do; ``MemTracker`` counts the same storages but sums all of them on
  every op (100 s of a 140 s llama3-8b step), so this running total does the same in O(1) per tensor. This is
  the allocator's *allocated* bytes, compared with the prediction's allocated peak (a CUDA kernel's own buffer,
  ``workspaces.py``: the embedding backward's partial sums, counted beside what is alive while its op runs, as the
  trace counts it); what the allocator reserves
  on a GPU (``sim/memory.py``) needs a GPU to measure.
- with CPU offload (``CPUOffloadPolicy``), the device's share of that: the fake ranks run on this CPU, where the
  offloaded state sits beside everything else, so the storages that a GPU rank keeps in host memory are told apart
  by what they are and counted apart (``LiveBytes.mark_host``): the sharded params, the optimizer state and every
  tensor the optimizer step makes (it runs on the CPU), and each sharded grad once FSDP2 has made it (its
  ``post_accumulate_grad`` hooks, which it runs after assigning the grad: on a GPU the reduce-scatter output is
  copied to the host there and its device copy freed). Not seen: the transient device copy of each offloaded shard
  before its all-gather (on this CPU ``.to(device)`` makes none), a shard's size per group.
- with activation offloading (a plan's ``activation_offloading``), likewise: on this CPU ``save_on_cpu`` packs a
  tensor as itself (``tensor.cpu()``), so the fake world runs it as it runs on a GPU: its pack copies each saved
  tensor into a storage counted as host memory, its unpack copies it back into a new device storage
  (``HostCopies``); the rest of what apply_plan set up (the blocks' forward under the hooks) is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from fsdp_planner.apply.chunked_loss import chunked_loss_step
from fsdp_planner.apply.float8 import after_optimizer_step
from fsdp_planner.apply.fully_shard import apply_plan, device_mesh
from fsdp_planner.apply.tensor_parallel import loss_context
from fsdp_planner.attention import fused_sdpa_everywhere, kernel
from fsdp_planner.choices import DEFAULT_OPTIMIZER
from fsdp_planner.errors import MAX_MESSAGE, PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision, mixed_precision
from fsdp_planner.models import ModelSpec, as_spec, factory_kwargs, hf, resolve_factory
from fsdp_planner.norms import fused_rms_norm_everywhere
from fsdp_planner.patching import FAKE_TENSOR_LOGGER, patched, quiet_loggers
from fsdp_planner.routing import DEFAULT_CAPACITY, StandIn, values_formatted
from fsdp_planner.runtime.fake_build import FakeModel, build_fake
from fsdp_planner.runtime.worker import CollectiveCounter, Counts
from fsdp_planner.sim.options import OPTIMIZERS, GradientSync, Optimizer, ZeroGrad
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.trace.failures import FailedOp, check_operand_dtypes, failed_at, first_line, mark, op_name
from fsdp_planner.trace.recorder import split_inputs
from fsdp_planner.trace.tree import ROOT
from fsdp_planner.workspaces import workspace_bytes

MAX_FAKE_WORLD = 1 << 16  # FSDP2 makes a fake chunk of every param for each rank (``_chunk_with_empty``): 0.2 ms a
# chunk on a 2-core host, so 16,384 ranks of a 76-param toy took 5 minutes; this bound keeps a small model's run to
# tens of minutes and ``slow_note`` says so first
SLOW_CHUNKS = 1_000_000  # params x ranks past which the run takes minutes (``slow_note``)


def slow_note(params: int, world_size: int) -> str | None:
    """A note that FSDP2's sharding alone takes minutes: it chunks each of ``params`` params ``world_size`` ways."""
    if params * world_size <= SLOW_CHUNKS:
        return None
    return (f"FSDP2 splits each of the model's {params:,} params into {world_size:,} fake chunks "
            f"({params * world_size:,} tensors): expect minutes before the first step")


@dataclass(frozen=True)
class FakeWorldResult:
    """What real FSDP2 did on the fake ranks in the last step: collectives, their bytes, peak allocated bytes."""

    world_size: int
    counts: Counts  # per step, by collective kind
    nbytes: Counts
    peak_memory: int  # bytes allocated per rank at the step's peak (with offload: on the device, module docstring)
    seconds: float
    total_peak_memory: int = 0  # with offload: device and host bytes together at their peak (else peak_memory)
    tp_counts: Counts | None = None  # with TP: DTensor's collectives over the tp dim, by kind (else None)
    tp_nbytes: Counts | None = None
    ep_all_to_alls: int | None = None  # with EP: the dispatch and combine all-to-alls (else None)
    ep_all_to_all_bytes: int | None = None
    float8_all_reduces: int | None = None  # with float8 all-gather: the amax all-reduces (else None)
    float8_all_reduce_bytes: int | None = None
    view_outputs: int = 0  # FSDP2's warnings that a group's module returned a view (``_held_view_warnings``)
    sequential_reductions: int = 0  # DTensor's warnings of one reduction per mesh dim (``_held_redistribute_warnings``)


def beside_prediction(predicted: StepReport, measured: FakeWorldResult) -> dict[str, tuple[int, int]]:
    """(predicted, measured) per quantity the check compares: counts, bytes and the peak."""
    rows = {
        "all_gathers": (predicted.all_gathers, measured.counts["all_gather"]),
        "reduce_scatters": (predicted.reduce_scatters, measured.counts["reduce_scatter"]),
        "all_gather_bytes": (predicted.all_gather_bytes, measured.nbytes["all_gather"]),
        "reduce_scatter_bytes": (predicted.reduce_scatter_bytes, measured.nbytes["reduce_scatter"]),
    }
    if predicted.all_reduces or measured.counts["all_reduce"]:  # HSDP
        rows["all_reduces"] = (predicted.all_reduces, measured.counts["all_reduce"])
        rows["all_reduce_bytes"] = (predicted.all_reduce_bytes, measured.nbytes["all_reduce"])
    if measured.tp_counts is not None and measured.tp_nbytes is not None:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            rows[f"tp_{kind}s"] = (getattr(predicted, f"tp_{kind}s"), measured.tp_counts[kind])
            rows[f"tp_{kind}_bytes"] = (getattr(predicted, f"tp_{kind}_bytes"), measured.tp_nbytes[kind])
    if measured.float8_all_reduces is not None and measured.float8_all_reduce_bytes is not None:
        rows["float8_all_reduces"] = (predicted.float8_all_reduces, measured.float8_all_reduces)
        rows["float8_all_reduce_bytes"] = (predicted.float8_all_reduce_bytes, measured.float8_all_reduce_bytes)
    if measured.ep_all_to_alls is not None and measured.ep_all_to_all_bytes is not None:
        rows["ep_all_to_alls"] = (predicted.ep_all_to_alls, measured.ep_all_to_alls)
        rows["ep_all_to_all_bytes"] = (predicted.ep_all_to_all_bytes, measured.ep_all_to_all_bytes)
    return {**rows, "peak_memory": (predicted.peak_memory, measured.peak_memory)}


class FunctionalCounter:
    """DTensor's collectives over the ``tp`` dim and EP's all-to-alls, and their bytes (nccl-tests' size, as
    ``CollectiveCounter``): redistributions and EP's dispatch and combine issue ``_c10d_functional`` ops, seen by a
    dispatch mode (all-gathers, reduce-scatters, all-to-alls: the input buffer, what each rank sends); an
    all-reduce (a partial value made whole: sequence-parallel norms' weight grads, loss parallel's reductions) is
    also issued from inside DTensor's own dispatch, below any mode, so ``funcol.all_reduce`` is wrapped instead.
    FSDP2's collectives go through ``torch.distributed``'s functions, never these: the two counts stay apart."""

    def __init__(self) -> None:
        self.counts: Counts = dict.fromkeys(FUNCTIONAL_KINDS, 0)
        self.nbytes: Counts = dict.fromkeys(FUNCTIONAL_KINDS, 0)

    def add(self, kind: str, t: torch.Tensor) -> None:
        self.counts[kind] += 1
        self.nbytes[kind] += wire_bytes(t)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        import torch.distributed._functional_collectives as funcol

        all_reduce = funcol.all_reduce

        def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.add("all_reduce", t)
            return all_reduce(t, *args, **kwargs)

        with patched(funcol, "all_reduce", counted), _FunctionalOps(self):
            yield

    def take(self) -> tuple[Counts, Counts]:
        out = dict(self.counts), dict(self.nbytes)
        self.counts, self.nbytes = dict.fromkeys(FUNCTIONAL_KINDS, 0), dict.fromkeys(FUNCTIONAL_KINDS, 0)
        return out


def wire_bytes(t: torch.Tensor) -> int:
    """The bytes a collective of ``t`` moves: its own, or a wrapper subclass's largest inner tensor's (torchao's
    float8 tensor all-gathers its float8 data, one byte an element, and keeps its one-value scale: its outer
    ``element_size`` is the original dtype's)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    return max((wire_bytes(x) for x in inner_tensors(t)), default=0)


TP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
FUNCTIONAL_KINDS = (*TP_KINDS, "all_to_all")


class _FunctionalOps(TorchDispatchMode):
    """``FunctionalCounter``'s view of the functional all-gathers (their output), reduce-scatters and all-to-alls
    (their input)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as ``LiveBytes``: the fake world never compiles

    def __init__(self, counter: FunctionalCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name == "_c10d_functional::all_gather_into_tensor":
            self.counter.add("all_gather", out)
        elif name == "_c10d_functional::reduce_scatter_tensor":
            self.counter.add("reduce_scatter", args[0])
        elif name == "_c10d_functional::all_to_all_single":
            self.counter.add("all_to_all", args[0])
        return out


class Float8Counter:
    """float8 training's amax all-reduces (``sim/float8.py``) and their bytes: those torchao issues before each
    float8 all-gather (``float8_utils.all_reduce``, wrapped while the step runs) and the one of the precomputed
    scales after the optimizer step (DTensor's, counted by a ``FunctionalCounter`` of its own)."""

    def __init__(self) -> None:
        self.count = self.nbytes = 0

    @contextlib.contextmanager
    def counting(self, on: bool) -> Iterator[None]:
        if not on:
            yield
            return
        from torchao.float8 import float8_utils

        all_reduce = float8_utils.all_reduce

        def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count, self.nbytes = self.count + 1, self.nbytes + t.numel() * t.element_size()
            return all_reduce(t, *args, **kwargs)

        with patched(float8_utils, "all_reduce", counted):
            yield

    def precompute(self, model: torch.nn.Module, plan: Plan) -> None:
        """``after_optimizer_step``, its all-reduce counted."""
        functional = FunctionalCounter()
        with functional.counting():
            after_optimizer_step(model, plan.float8)
        counts, nbytes = functional.take()
        self.count, self.nbytes = self.count + counts["all_reduce"], self.nbytes + nbytes["all_reduce"]

    def take(self) -> tuple[int, int]:
        out = self.count, self.nbytes
        self.count = self.nbytes = 0
        return out


class HostCopies:
    """``save_on_cpu`` as a GPU runs it, for the fake ranks on this CPU (module docstring): installed while
    ``apply_plan`` wraps the offloaded modules' forward, it stands in for ``torch.autograd.graph.save_on_cpu``."""

    def __init__(self) -> None:
        self.tracker: LiveBytes | None = None  # the step's tracker (a new one each step)

    @contextlib.contextmanager
    def installed(self, on: bool) -> Iterator[None]:
        if not on:
            yield
            return
        with patched(torch.autograd.graph, "save_on_cpu", self.hooks):
            yield

    def hooks(self, pin_memory: bool = False) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            tracker = self.tracker
            with torch.no_grad():
                if tracker is None:
                    return t.clone()
                on_host, tracker.on_host = tracker.on_host, True
                try:
                    return t.clone()  # the pinned host copy
                finally:
                    tracker.on_host = on_host

        def unpack(host: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return host.clone()  # the device copy backward uses

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def inner_tensors(t: torch.Tensor) -> list[Any]:
    """The tensors a wrapper subclass (a DTensor, torchao's float8 weight) holds. torchao 0.18's float8 weight asks
    in ``__tensor_flatten__`` whether its precomputed scale is true, a value a fake tensor does not have: its
    tensors are then its tensor attributes (its data and that one-value scale)."""
    try:
        return [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    except DataDependentOutputException:
        return [v for v in vars(t).values() if isinstance(v, torch.Tensor)]


# funcol's wait on a collective's output: on a GPU it returns that tensor itself (c10d's Functional.cpp), where a
# fake tensor's kernel makes a new storage of its size, which counted a second copy of every gathered tensor while
# both lived (a tiny Llama's all-gathered logits at TP 2: +1 MiB, the step's peak 5% above the GPU's)
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages: a running total and its peak (module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless a mode opts out, at ~60 us an
        # op (``trace.ops.OpRecorder``); the fake world runs compiled blocks eager (torch.compile cannot run on fake
        # tensors), so no dynamo frame ever reaches it
        return False

    def __init__(self, capacity: float = DEFAULT_CAPACITY) -> None:
        super().__init__()
        self.stand_in = StandIn(capacity)  # data-dependent ops run the trace's stand-in (routing.py)
        self.current = self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self._undo = contextlib.ExitStack()  # what __enter__ set up, undone by __exit__
        self.calls: list[str] = []  # the module calls running now (``module_calls``), innermost last
        # CPU offload: storages a GPU rank keeps in host memory, their bytes, and the peak of the rest (the device's)
        self.host: set[int] = set()
        self.host_current = self.device_peak = 0
        self.on_host = False  # storages made now are host memory (the optimizer step under offload)

    def track(self, tensors: Iterable[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if is_traceable_wrapper_subclass(t):  # a DTensor: its local shard holds the bytes
                self.track(inner_tensors(t))
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self._sizes:
                self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
                self._sizes[key] = 0
                if self.on_host:
                    self.host.add(key)
                self._resized(key, storage.nbytes())

    def mark_host(self, tensors: Iterable[Any]) -> None:
        """These tensors' storages are host memory from now on (tracked first when they are not yet)."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if is_traceable_wrapper_subclass(t):
                self.mark_host(inner_tensors(t))
                continue
            key = id(t.untyped_storage())
            if key not in self._sizes:  # new: host memory from the start, never on the device
                on_host, self.on_host = self.on_host, True
                self.track([t])
                self.on_host = on_host
            elif key not in self.host:
                self.host.add(key)
                self.host_current += self._sizes[key]

    def _resized(self, key: int, nbytes: int) -> None:
        delta = nbytes - self._sizes[key]
        self.current += delta
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.current)
        if key in self.host:
            self.host_current += delta
        self.device_peak = max(self.device_peak, self.current - self.host_current)

    def _free(self, key: int) -> None:
        nbytes = self._sizes.pop(key, 0)
        self.current -= nbytes
        if key in self.host:
            self.host.discard(key)
            self.host_current -= nbytes
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _WAIT_TENSOR:  # (``_WAIT_TENSOR``)
            return args[0]
        try:
            check_operand_dtypes(func, args)  # fake kernels let a mixed-dtype matmul through; real ones do not
            out = self.stand_in.call(func, args, kwargs or {}, self.calls[-1] if self.calls else ROOT)
        except Exception as e:
            mark(e, op_name(func), self.calls[-1] if self.calls else ROOT)
            raise
        self.track(tree_flatten(out)[0])
        extra = workspace_bytes(func, args, kwargs)  # what its GPU kernel holds beside the outputs while it runs
        if extra:
            self.peak = max(self.peak, self.current + extra)
            self.device_peak = max(self.device_peak, self.current - self.host_current + extra)
        return out

    def __enter__(self) -> LiveBytes:
        # FSDP2 frees and refills its unsharded params by resizing their storages: counted as they happen. The patch
        # is undone however entering or leaving ends (``patching.py``).
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch.UntypedStorage, "resize_", self._counting_resize()))
            stack.enter_context(values_formatted())  # (a data-dependent scalar index, as the trace reads it)
            super().__enter__()
            stack.push(lambda *exc: super(LiveBytes, self).__exit__(*exc))
            self._undo = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._undo.__exit__(*exc)

    def _counting_resize(self) -> Callable[[torch.UntypedStorage, int], Any]:
        """``UntypedStorage.resize_`` that tells this tracker the storage's new size."""
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
            result = original(storage, nbytes)
            key = id(storage)
            if key in self._sizes:
                self._resized(key, storage.nbytes())
            else:
                self.track([torch.empty(0, device=storage.device).set_(storage)])
            return result

        return resize_


@contextlib.contextmanager
def counted_in_handlers(tracker: LiveBytes) -> Iterator[None]:
    """``loss_parallel()``'s DTensor op handlers (log-softmax, the NLL loss and their backwards) run under
    ``tracker``: a dispatch mode is off while the op it intercepts runs, so the local tensors a handler makes and
    frees inside (loss parallel's shifted logits, their exponentials, its fused backward's vocab-sharded
    temporaries) would go unseen, where DTensor's ordinary ops make one local output, which the mode counts. The
    output metadata a handler asks the sharding propagator for is computed on global-shaped fake tensors (no
    memory on a GPU, ``_propagate_tensor_meta_non_cached``): not counted."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.parallel.loss import customized_loss_ops
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    handlers = DTensor._op_dispatcher._custom_op_handlers
    originals, inside = {op: handlers[op] for op in customized_loss_ops if op in handlers}, [0]
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def under_tracker(handler: Callable[..., Any], op: Any, args: Any, kwargs: Any) -> Any:
        _push_mode(tracker)
        inside[0] += 1
        try:
            return handler(op, args, kwargs)
        finally:
            inside[0] -= 1
            _pop_mode()

    def uncounted(self: ShardingPropagator, schema: Any) -> Any:
        if not inside[0]:
            return propagate(self, schema)
        _pop_mode()
        try:
            return propagate(self, schema)
        finally:
            _push_mode(tracker)

    handlers.update({op: functools.partial(under_tracker, h) for op, h in originals.items()})
    try:
        with patched(ShardingPropagator, "_propagate_tensor_meta_non_cached", uncounted):
            yield
    finally:
        handlers.update(originals)


@contextlib.contextmanager
def module_calls(model: torch.nn.Module, calls: list[str]) -> Iterator[None]:
    """``calls`` kept as the stack of ``model``'s module calls running now; a call that raises marks its exception
    with its module (``trace.failures``), so the user's error names where it happened."""
    names = {id(m): n for n, m in model.named_modules()}

    def pre(module: torch.nn.Module, args: Any) -> None:
        if id(module) in names:
            calls.append(names[id(module)])

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if id(module) not in names:
            return
        failure = sys.exc_info()[1]
        if failure is not None and output is None:  # always_call: torch runs this in its except clause
            mark(failure, None, names[id(module)], type(module).__name__)
        if calls:
            calls.pop()

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class FakeSteps:
    """How the fake ranks train (``run_fake_world``'s arguments)."""

    steps: int = 2
    zero_grad: ZeroGrad = ZeroGrad.NONE
    micro_batches: int = 1
    reshard_after_backward: bool = True
    gradient_sync: GradientSync = GradientSync.LAST
    optimizer: Optimizer = OPTIMIZERS[DEFAULT_OPTIMIZER]
    loss_head: str | None = None  # with the spec's loss_chunks: the output layer run in chunks (``chunked_loss_step``)


# torch's optimizer for each of fsdp-planner's, with its hyper-parameters where they change its bytes
TORCH_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, float]]] = {
    "sgd": (torch.optim.SGD, {}), "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}), "adamw": (torch.optim.AdamW, {}),
    "adam-fused": (torch.optim.Adam, {}), "adamw-fused": (torch.optim.AdamW, {}),
    "adam-fused-bf16-states": (torch.optim.Adam, {}), "adamw-fused-bf16-states": (torch.optim.AdamW, {})}


def torch_optimizer(optimizer: Optimizer, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer`` as a GPU runs it: foreach or fused as it says (a CPU's default would be the for-loop, whose
    temporaries are one param's, not the whole shard's); states of a dtype of their own made before its first step,
    as torchtitan's ``fused_opt_states_bf16`` makes them (the fake tensors' fused kernel takes the mix, as CUDA's
    does; CPU's does not)."""
    cls, kwargs = TORCH_OPTIMIZERS[optimizer.name]
    how = {"fused": True} if optimizer.fused else {"foreach": True}
    made = cls(params, lr=1e-3, **kwargs, **how)
    if optimizer.state_bytes is not None:
        made.register_step_pre_hook(functools.partial(_states_in, STATE_DTYPES[optimizer.state_bytes]))
    return made


STATE_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def _states_in(dtype: torch.dtype, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Adam's state for each param with a grad and no state yet, its moments in ``dtype``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not optimizer.state[p]:
                optimizer.state[p].update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                                          exp_avg=torch.zeros_like(p, dtype=dtype),
                                          exp_avg_sq=torch.zeros_like(p, dtype=dtype))


class FakeTraining:
    """The sharded model on the fake ranks with its optimizer, trained one step at a time (``step``); each step
    gets a new tracker, so the last one holds the last step's peak."""

    def __init__(self, built: FakeModel, plan: Plan, how: FakeSteps, spec: ModelSpec, host_copies: HostCopies
                 ) -> None:
        """``built``'s model already sharded (``shard``): the optimizer holds the sharded params."""
        self.model, self.loss_fn, self.plan, self.how, self.spec = built.model, built.loss_fn, plan, how, spec
        self.args, self.kwargs = split_inputs(built.inputs)
        self.optimizer = torch_optimizer(how.optimizer, self.model.parameters())
        self.counter = CollectiveCounter()
        self.tp_counter = FunctionalCounter()
        self.tp_figures = self.tp_counter.take()  # the last step's TP collectives (counts, bytes)
        self.float8_counter = Float8Counter()
        self.float8_figures = self.float8_counter.take()  # the last step's amax all-reduces (count, bytes)
        self.host_copies = host_copies
        self.capacity = spec.routing or DEFAULT_CAPACITY
        self.tracker = LiveBytes(self.capacity)
        if plan.offload:  # each sharded grad is host memory once FSDP2 has made it (module docstring)
            for p in self.model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: self.tracker.mark_host([p.grad]))

    def step(self) -> tuple[Counts, Counts]:
        """One step (its micro-batches, the optimizer step, ``zero_grad``); its FSDP2 collectives' counts and bytes
        (TP's: ``tp_figures``)."""
        self.tracker = self.host_copies.tracker = LiveBytes(self.capacity)
        with self.tracker, self.counter, self.tp_counter.counting(), kernel(self.spec.attention), \
                fused_sdpa_everywhere(), fused_rms_norm_everywhere(), \
                self.float8_counter.counting(self.plan.float8 is not None):
            self._track_what_the_step_starts_with()
            for k in range(self.how.micro_batches):
                self._micro_batch(k)
            self.tracker.on_host = self.plan.offload  # the optimizer step runs where the state is
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=self.how.zero_grad is ZeroGrad.NONE)
        self.float8_counter.precompute(self.model, self.plan)  # its all-reduce apart from TP's
        self.tp_figures, self.float8_figures = self.tp_counter.take(), self.float8_counter.take()
        return self.counter.take()

    def _track_what_the_step_starts_with(self) -> None:
        """Sharded params, buffers, inputs, optimizer state and kept grads: alive before the step's first op."""
        state = [t for s in self.optimizer.state.values() for t in s.values()]
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.plan.offload:
            self.tracker.mark_host([*self.model.parameters(), *state, *grads])
        self.tracker.track([*self.model.parameters(), *self.model.buffers(),
                            *tree_flatten((self.args, self.kwargs))[0], *state, *grads])

    def _micro_batch(self, k: int) -> None:
        """Forward, loss and backward of micro-batch ``k``; gradients synced in the last only (LAST: the
        reduce-scatters run in the last backward only) or in each (EVERY)."""
        last = k == self.how.micro_batches - 1
        self.model.set_requires_gradient_sync(self.how.gradient_sync is GradientSync.EVERY or last)
        if not self.how.reshard_after_backward:
            self.model.set_reshard_after_backward(last)
        try:
            with module_calls(self.model, self.tracker.calls), loss_context(self.plan), \
                    counted_in_handlers(self.tracker):
                if self.spec.loss_chunks and self.how.loss_head is not None:
                    chunked_loss_step(self.model, self.how.loss_head, self.spec.loss_chunks, self.args,
                                      self.kwargs).backward()  # (loss parallel: loss_context's, above)
                else:
                    self.loss_fn(self.model(*self.args, **self.kwargs)).backward()
        except (Exception, SystemExit) as e:  # what the user's model raises is one line naming the op and module
            failed = failed_at(e)
            where = f"{failed.describe()} raised " if failed is not None else ""
            # the planner's own refusal (apply's) is a sentence written for the user: whole, not cut at 200
            said = first_line(e, MAX_MESSAGE if isinstance(e, PlannerError) else 200)
            raise PlannerError(f"'{self.spec.name}' failed under real FSDP2 on fake ranks: {where}"
                               f"{type(e).__name__}: {said}{self._loss_parallel_hint(e, failed)}") from e

    def _loss_parallel_hint(self, e: BaseException, failed: FailedOp | None) -> str:
        """What to do where the loss failed under loss parallel: its logits are DTensors sharded over the vocabulary,
        and a loss mixing them with plain tensors (a mask's mean, label smoothing's fill) fails there (a trial's two
        losses, whose error said nothing of it)."""
        tp = self.plan.tensor_parallel
        outside = failed is None or failed.module == ROOT
        if tp is None or not tp.loss_parallel or not outside or "DTensor" not in str(e):
            return ""
        return ("; the loss runs under loss parallel (--tp's default: the logits sharded over the vocabulary), "
                "which takes torch's cross-entropy over them alone: plan with --no-loss-parallel for this loss")

    def result(self, world_size: int, counts: Counts, nbytes: Counts, seconds: float) -> FakeWorldResult:
        """The last step's figures; with offload (of params or activations) the device's share is the peak. TP's
        collectives are shown with TP, or where any ran without it (a layout that redistributes what it should
        not: compared with the prediction's none); EP's all-to-alls with EP."""
        offloaded = self.plan.offload or self.plan.activation_offloading
        tracker = self.tracker
        counted, counted_bytes = self.tp_figures
        functional = {k: counted[k] for k in TP_KINDS}
        functional_bytes = {k: counted_bytes[k] for k in TP_KINDS}
        a2a, a2a_bytes = counted["all_to_all"], counted_bytes["all_to_all"]
        shown = self.plan.tensor_parallel is not None or any(functional.values())
        tp_counts, tp_nbytes = (functional, functional_bytes) if shown else (None, None)
        ep = self.plan.expert_parallel is not None or a2a > 0
        f8 = self.plan.float8 is not None
        return FakeWorldResult(world_size, counts, nbytes, tracker.device_peak if offloaded else tracker.peak,
                               seconds, tracker.peak, tp_counts, tp_nbytes, a2a if ep else None,
                               a2a_bytes if ep else None, self.float8_figures[0] if f8 else None,
                               self.float8_figures[1] if f8 else None)


def shard(model: torch.nn.Module, plan: Plan, world_size: int, precision: Precision, host_copies: HostCopies
          ) -> None:
    """``fully_shard`` as the plan says (with EP, ``apply_plan``, which builds its own meshes), outside
    the fake mode: an int reshard_after_forward's post-forward mesh is built from a tensor's .tolist(), which a fake
    tensor cannot answer; the fake params still dispatch to their mode, so every sharded param and buffer FSDP2
    makes from them stays fake."""
    with unset_fake_temporarily(), host_copies.installed(bool(plan.activation_offloading)):
        mp = mixed_precision(precision, model)
        apply_plan(model, plan, mesh=device_mesh(plan, "cpu", world_size), mp_policy=mp)


def check_fake_world(world_size: int, steps: int) -> None:
    """Refuse what the fake-world check cannot run, before any process group exists."""
    if not 1 <= world_size <= MAX_FAKE_WORLD:
        raise PlannerError(f"--fake-world-size must be between 1 and {MAX_FAKE_WORLD}, got {world_size}")
    if steps < 2:
        raise PlannerError("the fake-world check needs at least 2 steps (the first creates the optimizer state)")
    if dist.is_initialized():
        raise PlannerError("the fake-world check needs a process without a torch.distributed process group")


def factory_call(spec: ModelSpec) -> Callable[[], tuple]:
    """The spec's factory with its workload's arguments (``--attention`` reaches a Hugging Face model's)."""
    factory = resolve_factory(spec.name)
    kwargs = factory_kwargs(factory, spec)
    if hf.is_hf(spec.name) and spec.attention is not None:
        kwargs["attention"] = spec.attention
    return functools.partial(factory, **kwargs)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` on the fake backend (collectives return at once), destroyed on
    every way out, with DTensor's caches of its meshes (``forget_meshes``)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation and redistribute-planner caches. Their keys hold device meshes, which
    compare equal by shape and dim names, not by process group: a later world's equal mesh (the ``tp`` dim of
    another layout) would get this world's cached mesh back, whose groups are destroyed ("Could not resolve the
    process group") or, worse, other groups of the new world under the same names. torch offers no public call
    for it; this is what its own debug module does."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()


def run_fake_world(model_spec: ModelSpec | str, plan: Plan, world_size: int, precision: Precision,
                   steps: int = 2, zero_grad: ZeroGrad = ZeroGrad.NONE, micro_batches: int = 1,
                   reshard_after_backward: bool = True, gradient_sync: GradientSync = GradientSync.LAST,
                   optimizer: Optimizer = OPTIMIZERS[DEFAULT_OPTIMIZER], loss_head: str | None = None
                   ) -> FakeWorldResult:
    """Apply ``plan`` to the model ``spec`` names with real FSDP2 on ``world_size`` fake ranks and train
    ``steps`` steps (at least 2) of ``micro_batches`` forward + backward passes each (of the batch ``spec`` names;
    gradient sync off on all but the last, ``set_requires_gradient_sync``, unless ``gradient_sync`` is EVERY;
    with ``reshard_after_backward`` False
    also ``set_reshard_after_backward(False)`` on all but the last), each ending with ``optimizer``'s step;
    counts, bytes and memory are the last step's. ``loss_head``: with the spec's ``loss_chunks``, the output layer
    the loss runs in chunks (``apply/chunked_loss.py``)."""
    check_fake_world(world_size, steps)
    spec = as_spec(model_spec)
    factory = factory_call(spec)
    how = FakeSteps(steps, zero_grad, micro_batches, reshard_after_backward, gradient_sync, optimizer, loss_head)
    # what the ranks run decides the layout apply gives the output head (its input whole under a chunked loss)
    plan = plan.replace(loss_chunks=spec.loss_chunks if loss_head is not None else 0, loss_head=loss_head or "")
    started = time.perf_counter()
    # (an op that fails on the fake ranks is said in one line: not also as fake tensors' logged stack)
    with fake_process_group(world_size), FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            _held_view_warnings() as views, _held_redistribute_warnings() as reductions, \
            quiet_loggers(FAKE_TENSOR_LOGGER, level=logging.CRITICAL):
        built, host_copies = build_fake(factory, spec.name, mode), HostCopies()
        shard(built.model, plan, world_size, precision, host_copies)
        training = FakeTraining(built, plan, how, spec, host_copies)
        for _ in range(steps):
            counts, nbytes = training.step()
    result = training.result(world_size, counts, nbytes, time.perf_counter() - started)
    return dataclasses.replace(result, view_outputs=views[0], sequential_reductions=reductions.held)


# DTensor's warning (_redistribute.py) when a value partial over several mesh dims is reduced one dim at a time:
# torchao's float8 amax of a weight sharded over FSDP x TP (precompute_float8_dynamic_scale_for_fsdp), as on a GPU
SEQUENTIAL_REDUCTIONS = re.compile(r"sequential \w+ operations will be performed")
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


class _HeldRecords(logging.Filter):
    """Drops and counts the records ``pattern`` matches; lets the others through."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern, self.held = pattern, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern.search(record.getMessage()):
            self.held += 1
            return False
        return True


@contextlib.contextmanager
def _held_redistribute_warnings() -> Iterator[_HeldRecords]:
    """DTensor's sequential-reduction warnings held back and counted: the caller says it once, beside the float8
    all-reduce counts that are those reductions (one a mesh dim, as the model counts them), not once a rank.
    DTensor warns once a process per (mesh, dims, reason), and its meshes compare equal across worlds: its record
    of what it warned of is emptied for this world (and put back after), so each run counts its own."""
    import torch.distributed.tensor._redistribute as redistribute

    held = _HeldRecords(SEQUENTIAL_REDUCTIONS)
    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    logger.addFilter(held)
    try:
        with patched(redistribute, "_warned_flatten_issues", set()):
            yield held
    finally:
        logger.removeFilter(held)


# FSDP2's warning (_fsdp_state.py) when a module it hooks returns a view: an in-place op on that view would drop the
# pre-backward hook registered on it (the group's backward all-gather skipped)
VIEW_WARNING = re.compile(r"FSDP2-wrapped module .* returned a view tensor")


@contextlib.contextmanager
def _held_view_warnings() -> Iterator[list[int]]:
    """FSDP2's view warnings held back and counted, one per module call (the caller says it once, beside the counts
    that show whether a hook was skipped); every other warning shown as and when the filters in force show it.
    Nothing is kept: a library may warn millions of times (peft's ``modules_to_save`` copy on fake tensors)."""
    held = [0]
    with warnings.catch_warnings():  # (restores the filters on the way out)
        shown = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: Any = None, line: str | None = None) -> None:
            if VIEW_WARNING.search(str(message)):
                held[0] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=VIEW_WARNING.pattern)  # each call (Python's would show it once)
        # a model that deep-copies its layers as it is built (nn.TransformerEncoder's clones) copies fake tensors,
        # whose data pointer torch's Tensor.__deepcopy__ reads and warns of: nothing the user can act on
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with patched(warnings, "showwarning", show):
            yield held
