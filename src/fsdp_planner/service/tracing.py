"""The model a spec names, built on meta and traced as every front end traces it: in the precision's compute dtype,
under the spec's attention kernel and routing capacity, each failure one sentence naming what failed."""

from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from copy import deepcopy
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import CheckpointError

from fsdp_planner import linear_attention, routing, selective_scan
from fsdp_planner.attention import Kernel, kernel
from fsdp_planner.choices import DEFAULT_SAC_POLICY, SacPolicy
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.checkpointing import apply_checkpointing
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.linear_attention import FLA_SHARE_OF_FLASH
from fsdp_planner.mamba_scan import mixers
from fsdp_planner.models import BUILTINS, LoadedModel, ModelSpec, as_spec, exit_message, hf, load_model, shipped
from fsdp_planner.patching import quiet_loggers
from fsdp_planner.routing import DEFAULT_CAPACITY, WAY_OUT, consulted, data_dependent
from fsdp_planner.service import tp_numerics
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.tracing import trace
from fsdp_planner.trace.chunked_loss import cross_entropy, output_layer, output_tokens, unchunkable, with_chunked_loss
from fsdp_planner.trace.compiled import alike_blocks
from fsdp_planner.trace.compiled_loss import LossInputs, capturing, with_compiled_loss
from fsdp_planner.trace.events import KERNEL_LINEAR_ATTENTION, KERNEL_MAMBA_SCAN, KERNEL_SELECTIVE_SCAN
from fsdp_planner.trace.failures import LOSS, compile_error, failed_at, model_error
from fsdp_planner.trace.recorder import default_loss, record, record_compiled, record_compiled_loss
from fsdp_planner.trace.records import Trace

HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"


# the traces of built-in models a process keeps (the Python API's plan, fit and simulate of one model, a test
# suite's commands): their code and configs ship with the package, so the same spec traces the same step. A model
# file's (or a config.json's) may change between two calls, and is traced again each time
MEMO_SIZE = 8
_MEMO: OrderedDict[tuple[ModelSpec, Precision, bool], tuple[Trace, tuple[str, ...]]] = OrderedDict()


def trace_spec(spec: ModelSpec | str, precision: Precision | None = None, full: bool = False,
               note: Callable[[str], None] = lambda line: None) -> Trace:
    """The step of the model ``spec`` names, traced on meta tensors (``full``: every module call, no replay of
    repeated blocks); what the trace notes (and which attention kernel it assumed) goes to ``note``, on every call:
    a built-in model's trace is kept (``MEMO_SIZE``), its notes said again."""
    spec, precision = as_spec(spec), precision or SimOptions().precision
    key = (spec, precision, full)  # (the default precision named: the API's calls and the CLI's share entries)
    if not shipped(spec.name):
        return _traced_spec(spec, precision, full, note)
    if key in _MEMO:
        _MEMO.move_to_end(key)
        tr, said = _MEMO[key]
        for line in said:
            note(line)
        return tr
    kept: list[str] = []
    tr = _traced_spec(spec, precision, full, lambda line: (kept.append(line), note(line)))
    _MEMO[key] = tr, tuple(kept)
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return tr


def _traced_spec(spec: ModelSpec, precision: Precision, full: bool, note: Callable[[str], None]) -> Trace:
    lm = load_model(spec, meta=True)
    loss_fn, loss_inputs = step_loss(lm, spec, note)
    try:
        # transformers says on a CPU that its reference gated DeltaNet convolution is slower than the causal-conv1d
        # package's kernel: a planned step takes the GPU's kernels (``linear_attention.py``)
        with kernel(spec.attention) as attention, consulted() as routed, quiet_loggers(HUB_KERNELS_LOGGER):
            tr = trace(lm.model, lm.example_inputs, loss_fn, precision=precision,
                       reuse=not full, routing=spec.routing or DEFAULT_CAPACITY, fp32_modules=spec.fp32_modules)
    except PlannerError:  # a PrecisionError among them: the model fails in the compute dtype only
        raise
    except (SystemExit, Exception) as e:
        raise step_failure(e, f"'{spec}'", full) from e
    positions = hf.positions_note(lm.model, spec.seq_len) if spec.seq_len and hf.is_hf(spec.name) else None
    encoder = (hf.encoder_note(lm.model) or hf.image_note(lm.model) or hf.head_note(lm.model)) \
        if hf.is_hf(spec.name) else None
    for line in (*tr.notes, attention_note(spec, lm.model, attention), linear_attention_note(tr, lm.model),
                 mamba_note(tr, lm.model), selective_scan_note(tr, lm.model), token_loop_note(tr, spec.seq_len),
                 recurrent_note(tr, lm.model),
                 routing_note(spec, routed[0]),
                 own_checkpointing_note(lm.own_checkpointing), positions, encoder,
                 *((hf.mtp_note(lm.model), hf.dense_experts_note(lm.model), hf.tie_note(lm.model))
                   if hf.is_hf(spec.name) else ()),
                 *((hf.version_note(), hf.remote_code_note(spec.name.removeprefix(hf.PREFIX)))
                   if hf.is_hf(spec.name) else ())):
        if line:
            note(line)
    return as_the_job_runs(tr, lm, spec, loss_inputs, precision, note)


def step_failure(e: BaseException, label: str, full: bool = False) -> PlannerError:
    """The one sentence for an error of the model's own step (its forward, backward or loss_fn) while tracing the
    model ``label`` names: the op and module it failed in, and what to do where that is known."""
    if isinstance(e, SystemExit):  # an error, never a silent exit with its status
        return PlannerError(exit_message(e, f"running the forward, backward or loss_fn of {label}"))
    failed = failed_at(e)
    if data_dependent(e, failed.op if failed else None):
        return PlannerError(f"tracing {label} failed: {failed.describe() if failed else 'an op'} {WAY_OUT}")
    if isinstance(e, CheckpointError):
        return PlannerError(f"tracing {label} failed: {SELF_CHECKPOINTING}")
    return PlannerError(f"tracing {label} failed: {model_error(e)}{_device_hint(e)}{_loss_hint(e)}"
                        f"{'' if full else _replay_hint(e)}{_no_grad_hint(e)}")


def _no_grad_hint(e: BaseException) -> str:
    """What autograd's refusal of a loss without a graph means for the user's model (a trial's model returned
    ``x * 2``, its param unread: torch's own words alone)."""
    if "does not require grad and does not have a grad_fn" not in str(e):
        return ""
    return ("; the loss depends on no trainable param (the forward reads none of them, or under torch.no_grad, or "
            "on detached tensors): FSDP plans are for a step that trains them")


def step_loss(lm: LoadedModel, spec: ModelSpec, note: Callable[[str], None]
              ) -> tuple[Callable[[Any], Any] | None, list[LossInputs]]:
    """The loss the step is traced with (the model's own, or with ``--loss-chunks`` the wrapper's inner
    cross-entropy), and the list a compiled loss (``--compile-loss``) has the loss's inputs captured into."""
    if spec.loss_chunks and lm.loss_fn is not None:
        note("--loss-chunks: the loss is torchtitan's cross-entropy over the logits (ChunkedLossWrapper's inner "
             "loss, fp32), which the chunks run in place of the model's own loss_fn")
    own = cross_entropy if spec.loss_chunks else lm.loss_fn
    given: list[LossInputs] = []
    return (capturing(own or default_loss, given) if spec.compile_loss else own), given


def as_the_job_runs(tr: Trace, lm: LoadedModel, spec: ModelSpec, given: list[LossInputs], precision: Precision,
                    note: Callable[[str], None]) -> Trace:
    """The step ``step_loss``'s loss was traced in, as the job runs it: its loss compiled or in chunks, its
    repeated blocks compiled (every front end's one order: a MODEL spec's trace and the Python API's module)."""
    tr = _with_its_loss(tr, lm, spec, given, precision, note)
    return compiled_step(tr, lm, spec, precision, note) if spec.compile else tr


def _with_its_loss(tr: Trace, lm: LoadedModel, spec: ModelSpec, given: list[LossInputs], precision: Precision,
                   note: Callable[[str], None]) -> Trace:
    """The step with its loss as the job runs it: compiled (``--compile-loss``), in chunks (``--loss-chunks``)."""
    if spec.compile_loss:
        tr = _with_compiled_loss(tr, lm, spec, given, precision, note, cross_entropy if spec.loss_chunks else None)
    return with_loss_chunks(tr, spec, precision, note) if spec.loss_chunks else tr


def _with_compiled_loss(tr: Trace, lm: LoadedModel, spec: ModelSpec, given: list[LossInputs], precision: Precision,
                        note: Callable[[str], None], loss: Callable[[Any], Any] | None = None) -> Trace:
    """The step with its loss compiled (``--compile-loss``, ``trace/compiled_loss.py``), measured on what the
    traced step gave the loss; a model whose forward computes its loss (a loss region of no op) as it was."""
    region = tr.index.loss_region
    if not given or not any(inside and not e.backward for e, inside in zip(tr.events, region, strict=True)):
        note(f"--compile-loss: '{spec}' computes its loss in its forward (nothing runs between its output and its "
             "loss): the loss is traced as the forward runs it, eager")
        return tr
    from torch._dynamo.exc import Unsupported, UserError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        compiled = record_compiled_loss(lm.model, loss or lm.loss_fn or default_loss, given[0],
                                        precision.trace_dtype, tr.full_precision)
    except PlannerError:
        raise
    except (Unsupported, UserError, GuardOnDataDependentSymNode) as e:  # a graph break: torch.compile runs the
        # loss in pieces, eager between them; eager whole holds at least as much
        note(f"--compile-loss: the loss of '{spec}' does not compile as one graph ({compile_error(e)}): it is "
             "simulated eager, which holds at least what torch.compile's pieces would")
        return tr
    except Exception as e:
        # a value read in the graph (int(mask.sum()), captured as a scalar output), which the meta tensors it is
        # measured on have none of: a GPU's graph waits for it there, or breaks; eager holds at least as much (a
        # token count refused the loss before)
        if isinstance(e, RuntimeError) and any(text in str(e) for text in READS_A_VALUE):
            note(f"--compile-loss: the loss of '{spec}' reads a value from a tensor (.item(), int(), .tolist()), "
                 "which the graph measured on meta tensors cannot: it is simulated eager, which holds at least what "
                 "torch.compile's pieces would")
            return tr
        raise PlannerError(f"--compile-loss: AOTAutograd could not trace the loss of '{spec}' "
                           f"({compile_error(e)}); plan it without --compile-loss") from e
    return with_compiled_loss(tr, compiled)


# torch's meta kernel of _local_scalar_dense (.item(), int()), and a copy off meta (.tolist(), .cpu())
READS_A_VALUE = ("Tensor.item() cannot be called on meta tensors", "Cannot copy out of meta tensor")


def with_loss_chunks(tr: Trace, spec: ModelSpec, precision: Precision, note: Callable[[str], None]) -> Trace:
    """The step with its output layer and loss run in chunks (``--loss-chunks``, ``trace/chunked_loss.py``); a
    model whose loss runs in its forward, or whose output no param-reading layer makes, as it was."""
    head = output_layer(tr)
    if head is None:
        note(f"--loss-chunks: '{spec}' has no output layer between its last block and a loss outside its forward "
             "(it computes its loss in its forward, or no layer with params makes its output): its loss is traced "
             "whole")
        return tr
    refusal = unchunkable(tr, head)
    if refusal is not None:
        raise PlannerError(f"--loss-chunks: {refusal}: plan this model's loss whole")
    tokens = output_tokens(tr, head)
    if tokens and tokens % spec.loss_chunks:
        raise PlannerError(f"a loss in {spec.loss_chunks} chunks (--loss-chunks, or a torchtitan job's num_chunks): "
                           f"the output layer '{head.module}' runs on {tokens:,} tokens, which do not split into that "
                           "many equal chunks (torchtitan's ChunkedLossWrapper requires it)")
    note(f"loss in {spec.loss_chunks} chunks (torchtitan's ChunkedLossWrapper): '{head.module}' and the loss run on "
         f"1/{spec.loss_chunks} of the tokens at a time, each with its backward, beside an fp32 buffer of the hidden "
         "states' gradient; FSDP2 keeps the layer gathered through the chunks and reduce-scatters its gradient at the "
         "last (accumulated in the reduce dtype where the layer has a group of its own call)")
    return with_chunked_loss(tr, spec.loss_chunks)


LOCAL_STYLES = (TPStyle.COLWISE, TPStyle.ROWWISE)  # the styles whose one rank's step ``check_local_shapes`` runs
# styles whose module gives each rank what the whole module gives it (an output gathered or all-reduced, a
# replicated param run on what the rank has): ``check_local_shapes`` runs them whole beside the local ones (a plan
# file of transformers' layout, its embedding and gathered head among them, was never checked on numbers: a plain
# colwise Phi-3 gate_up_proj there trained wrong values, 144x the parity bound)
WHOLE_ON_EACH_RANK = (TPStyle.COLWISE_GATHER, TPStyle.ROWWISE_SPLIT, TPStyle.EMBEDDING, TPStyle.REPLICATE,
                      TPStyle.MLA_KV_A_PROJ)


class LayoutDoesNotRun(PlannerError):
    """A TP layout that fails on the model's code, or runs and computes something else (``check_local_shapes``):
    a plan that cannot run, which ``check`` reports as a finding rather than an unreadable file. ``reason``: what
    failed, without the layout's name or the way out (a note on a pair left whole says it)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


# how a job's model is built on meta where no MODEL spec builds it (the Python API's nn.Module): ``built_by``
_BUILDER: ContextVar[Callable[[ModelSpec], LoadedModel] | None] = ContextVar("model_builder", default=None)


@contextlib.contextmanager
def built_by(build: Callable[[ModelSpec], LoadedModel]) -> Iterator[None]:
    """While a job plans, the model its spec names is ``build``'s (a fresh meta twin each call, which
    ``check_local_shapes`` changes): the Python API's ``nn.Module`` has a spec of its class's name alone, which no
    factory builds."""
    token = _BUILDER.set(build)
    try:
        yield
    finally:
        _BUILDER.reset(token)


def meta_model(spec: ModelSpec) -> LoadedModel:
    """The model ``spec`` names, on meta: ``built_by``'s where one is set, else its factory's."""
    build = _BUILDER.get()
    return build(spec) if build is not None else load_model(spec, meta=True)


def check_local_shapes(spec: ModelSpec, tp: TensorParallel, plan_file: bool = False,
                       source: str = "the detected layout (column-then-row Linear pairs)") -> tuple[str, ...]:
    """Trace one TP rank's step of a detected layout (column-then-row pairs; ``source`` names another layout taken
    by module names, torchtitan's on a model of one's own), or of a plan file's made of ``LOCAL_STYLES`` only
    (``plan_file``): each colwise Linear with 1/TP of its output features, each rowwise one
    with 1/TP of its input features, on meta tensors, collectives aside. The detected layout assumes the ops
    between a pair's Linears take any head count (``view(b, s, -1, head_dim)``); a model whose code fixes the count
    its shapes split (T5's ``view(b, -1, n_heads, d)``, a relative-position bias of every head) fails here in one
    sentence, not on the ranks. Then each module holding a rowwise Linear (one of each class) is run on numbers,
    whole and as the ranks run it (``tp_numerics``): a layout that runs but computes something else is refused.
    Returns a note per module that check could not run."""
    lm = meta_model(spec)
    d = tp.degree
    styles = {n: s for n, s in tp.styles(dict(lm.model.named_modules())).items()
              if s in LOCAL_STYLES and isinstance(lm.model.get_submodule(n), nn.Linear)}
    judged = _judged_modules(lm.model, styles)
    whole = {name: _copied(name, lm.model.get_submodule(name)) for name in judged}
    called: dict[str, tuple] = {}
    handles = [lm.model.get_submodule(name).register_forward_pre_hook(
        functools.partial(_capture_call, called, name), with_kwargs=True) for name in judged]
    for name, style in styles.items():
        module = lm.model.get_submodule(name)
        out, inp = module.weight.shape
        shape = (out // d, inp) if style is TPStyle.COLWISE else (out, inp // d)
        module.weight = nn.Parameter(module.weight.new_empty(shape), module.weight.requires_grad)
        if module.bias is not None and style is TPStyle.COLWISE:
            module.bias = nn.Parameter(module.bias.new_empty(shape[0]), module.bias.requires_grad)
    layout = f"the plan's tensor-parallel layout (degree {d})" if plan_file else f"--tp {d} with {source}"
    fix = ("give the plan a layout or degree whose local shapes its code takes" if plan_file else
           "plan it without --tp, or give a layout in a plan file's 'tensor_parallel'")
    try:
        with kernel(spec.attention):
            trace(lm.model, lm.example_inputs, lm.loss_fn, routing=spec.routing or DEFAULT_CAPACITY)
    except Exception as e:
        said = model_error(e)
        fused = " (a fused projection split into fixed widths, a qkv's: give it colwise_gather, its output gathered " \
            "whole, as the detected layouts do)" if "split_with_sizes" in said and plan_file else ""
        reason = (f"one TP rank's step fails ({said}); its code fixes a shape the layout splits (e.g. a view into a "
                  f"fixed head count, or a reshape back to the whole width instead of -1){fused}")
        raise LayoutDoesNotRun(f"{layout} does not run on this model: {reason}: {fix}", reason) from e
    finally:
        for h in handles:
            h.remove()
    return _numbers_checked(whole, styles, d, called, layout, fix)


def _judged_modules(model: nn.Module, styles: dict[str, TPStyle]) -> list[str]:
    """The modules holding a rowwise Linear of ``styles``, in the model's order: each while their params add up to
    ``tp_numerics.MAX_NUMEL``, then the first of each class and param shapes (the others run the same code, unless
    an attribute tells them apart)."""
    seen: set[tuple] = set()
    out: list[str] = []
    total = 0
    for parent in dict.fromkeys(n.rpartition(".")[0] for n, s in styles.items() if s is TPStyle.ROWWISE):
        module = model.get_submodule(parent)
        numel = sum(p.numel() for p in module.parameters())
        key = (type(module).__module__, type(module).__qualname__,
               tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))
        if key not in seen or total + numel <= tp_numerics.MAX_NUMEL:
            out.append(parent)
            seen.add(key)
            total += numel
    return out


def _copied(name: str, module: nn.Module) -> nn.Module | tp_numerics.Unchecked:
    """A copy of ``module`` as it is before its Linears' shapes are split; one that cannot be copied (a lock it
    holds) is not judged."""
    try:
        return deepcopy(module)
    except Exception as e:
        return tp_numerics.Unchecked(name, f"it cannot be copied ({type(e).__name__}: {str(e)[:80]})")


def _capture_call(called: dict[str, tuple], name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
    if name not in called:
        try:
            called[name] = (tp_numerics.capture(args), tp_numerics.capture(kwargs))
        except tp_numerics.Unreadable as e:
            called[name] = (tp_numerics.Unchecked(name, f"it takes a {e}"),)


def _numbers_checked(whole: dict[str, nn.Module | tp_numerics.Unchecked], styles: dict[str, TPStyle], degree: int,
                     called: dict[str, tuple], layout: str, fix: str) -> tuple[str, ...]:
    """``tp_numerics.check_module`` on each module ``whole`` holds (a copy from before the shapes were split): a
    mismatch is an error; the modules not judged, one note."""
    unchecked: dict[str, list[str]] = {}  # why -> the modules
    for name, module in whole.items():
        call = called.get(name)
        if isinstance(module, tp_numerics.Unchecked):
            verdict: tp_numerics.Verdict = module
        elif call is None or len(call) == 1:
            verdict = call[0] if call else tp_numerics.Unchecked(name, "not called")
        else:
            prefix = f"{name}." if name else ""
            mine = {n.removeprefix(prefix): s for n, s in styles.items() if n.startswith(prefix)}
            verdict = tp_numerics.check_module(name, module, mine, degree, *call)
        shown = name or "(root)"
        if isinstance(verdict, tp_numerics.Mismatch):
            differs = "is not finite where its whole run is" if math.isinf(verdict.error) else \
                f"differs from its whole run by {verdict.error:.1e} of its output"
            reason = (f"{shown} ({type(module).__name__}) run as {degree} TP ranks run it (each rowwise output "
                      f"summed over them) {differs} (an op "
                      "between its colwise and rowwise Linears mixes the features TP splits: a softmax or norm over "
                      "them, or a view into a fixed head count whose size is inferred)")
            raise LayoutDoesNotRun(f"{layout} computes something else on this model: {reason}: {fix}", reason)
        if isinstance(verdict, tp_numerics.Unchecked):
            unchecked.setdefault(verdict.reason, []).append(shown)
    if not unchecked:
        return ()
    where = "; ".join(f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''} ({why})"
                      for why, names in unchecked.items())
    return (f"the tensor-parallel layout was not checked on numbers in {where}: that the ops between its colwise "
            "and rowwise Linears are element-wise or per head is assumed there",)


def routing_skips(spec: ModelSpec, tr: Trace) -> tuple[str, ...]:
    """The params that get a gradient in the traced step (the balanced-routing stand-in gives every expert
    tokens) but none when one expert of each routing gets no token (``routing.starved``): a model that skips
    an expert without tokens (``if idx.numel() == 0: continue``) skips its params' grads on a rank whose batch
    routes it nothing. () where nothing was routed, or the starved step does not run (it is the trace's question
    only)."""
    if not tr.stood_in:
        return ()
    lm = load_model(spec, meta=True)
    try:
        with routing.starved():
            starved = record(lm.model, lm.example_inputs, lm.loss_fn, routing=spec.routing or DEFAULT_CAPACITY)
    except Exception:  # (a model that cannot take an empty expert batch: it calls none with one)
        return ()
    got = {p.fqn for p in starved.params if p.gets_grad}
    return tuple(p.fqn for p in tr.params if p.gets_grad and p.requires_grad and p.fqn not in got)


def compiled_step(tr: Trace, lm: LoadedModel, spec: ModelSpec, precision: Precision,
                  note: Callable[[str], None] = lambda line: None) -> Trace:
    """The step with the model's repeated blocks compiled, as torchtitan compiles them (``--compile``): what each
    saves for backward measured from AOTAutograd's partitioner (``trace/compiled.py``)."""
    blocks = [f for f in tr.index.block_instances if tr.modules[f].calls]  # an encoder-decoder's encoder layers too
    if not blocks:
        raise PlannerError("--compile compiles the model's repeated blocks, as torchtitan does, and this model has "
                           "none (no repeated composite module class, in a ModuleList, a Sequential or as attributes): "
                           "plan it eager (without --compile)")
    alike = alike_blocks(tr, blocks)
    distinct = len(set(alike.values()))
    if distinct >= SLOW_COMPILES:
        note(f"compiling the blocks (--compile, or --explain comparing it): {distinct} of the model's {len(blocks)} "
             "blocks ran differently in the eager trace, so AOTAutograd partitions each, and again under the "
             "selective checkpointing a plan takes: seconds a block, minutes in all")
    try:
        with kernel(spec.attention):
            saved = record_compiled(lm.model, lm.example_inputs, blocks, precision.trace_dtype,
                                    {p.value: functools.partial(_selective_copy, policy=p) for p in SAC_POLICIES},
                                    tr.cast_inputs, alike)
    except PlannerError:  # (a block that does not compile: ``BlockNotCompiled``)
        raise
    except Exception as e:  # (capturing the blocks' arguments: the model's forward up to them)
        raise PlannerError(f"--compile: running the forward up to the blocks to compile failed ({compile_error(e)})"
                           ) from e
    note(COMPILE_GAIN_NOTE)
    return tr.with_compiled(saved)


# what no step time of a compiled plan says by itself: the model's compile gain has been larger than measured on
# every run it was checked on (published 8-GPU and 2-D H100 runs, one H200's traces), and a fit's MFU inherits that
COMPILE_GAIN_NOTE = ("--compile: what compiling saves is the model's (inductor's kernels at the fused bytes' floor, "
                     "trace/compiled.py), and it has saved more than was measured on every run it was checked on "
                     "(benchmarks/fidelity_published.md, benchmarks/gpu_step.md): read a compiled step time, its "
                     "tokens/s and MFU as optimistic, and weigh plans compiled alike against each other")


# the default first: the variant measured when the step is traced (``compiled._compiled_with_variants``), the others
# when a plan first reads them
SAC_POLICIES = (DEFAULT_SAC_POLICY, *(p for p in SacPolicy if p is not DEFAULT_SAC_POLICY))
SLOW_COMPILES = 8  # distinct blocks past which --compile's partitioning takes a minute or more (1-4 s a block on
# a CPU: DeepSeek-V3's 61 layers took 3 min)


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _selective_copy(block: nn.Module, policy: SacPolicy) -> nn.Module:
    """A copy of ``block`` (on meta) under op-level selective checkpointing with ``policy``, as ``apply_plan``
    checkpoints it: what the partitioner is measured on for compiled blocks under SAC."""
    copy = deepcopy(block)
    for m in copy.modules():  # checkpointed dropout: AOTAutograd's partitioner saves its RNG state (a few bytes,
        # functionalize_rng_ops) to draw the same mask again, which meta tensors cannot (run_and_save_rng_state has
        # no meta backend): traced without it, as the mask is not saved either way
        if isinstance(m, DROPOUTS) and m.p > 0:
            m.p = 0.0
    apply_checkpointing(copy, [], {"": policy})
    return copy


# The model's own checkpointing is traced as plain regions, modelled as checkpointed in full (trace/own_checkpoint.py:
# torch.utils.checkpoint, reentrant or not, checkpoint_sequential, checkpoint_wrapper, the composable checkpoint). A
# CheckpointError still means a checkpoint of its own that does not go through those (a copy of torch's code), whose
# recomputation runs outside the trace's function mode (SDPA takes the math path there) and saves other tensors.
SELF_CHECKPOINTING = ("the model checkpoints activations through its own copy of torch's checkpoint code, which the "
                      "planner's trace does not stand in for as it does for torch.utils.checkpoint (CheckpointError: a "
                      "different number of tensors saved in recomputation): call torch.utils.checkpoint instead, or "
                      "build it without its own checkpointing and plan that with --ac full or --ac op")


def own_checkpointing_note(layers: tuple[str, ...]) -> str | None:
    """What the planner did with the model's own transformers gradient checkpointing (``hf.own_checkpointing_off``)."""
    if not layers:
        return None
    return (f"the model turns on transformers' gradient checkpointing ({len(layers)} layers, '{layers[0]}' first): "
            "the plan checkpoints instead (--ac full checkpoints the same blocks; auto chooses) and apply_plan turns "
            "the model's off (gradient_checkpointing_disable()), so the two never nest")


def _fused_saved(model: object, attention: Kernel, built: str) -> str:
    """What a fused implementation's calls saved: SDPA's math path where a GPU takes it (keys of fewer heads
    passed without ``enable_gqa``, Falcon's multi-query), and what the flash stand-in leaves out of a sliding
    window."""
    if attention.calls and attention.math_calls == attention.calls:
        return ("SDPA's math path, as a GPU runs these calls (keys of fewer heads than the queries, which no fused "
                "kernel takes): score matrices saved, O(seq^2)")
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if built == hf.hf_attention.FUSED and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return (f"fused kernel, O(seq) saved; its sliding window of {window:,} charged as full causal attention, "
                "which flash-attn's windowed kernel does less of")
    return "fused kernel, O(seq) saved"


def attention_note(spec: ModelSpec, model: object, attention: Kernel) -> str | None:
    """Which attention kernel the trace assumed: transformers' implementation for an ``hf:`` model, else the
    kernel its SDPA calls ran. None for a built-in without ``--attention`` (they call the fused kernels, as the
    README says) and for a model that calls no SDPA, unless ``--attention`` was given: then it says the option
    changes nothing."""
    built = hf.attention_of(model) if hf.is_hf(spec.name) else None  # type: ignore[arg-type]
    if attention.calls == 0 and built is not None and (built != "eager" or not hf.has_attention(model)):  # type: ignore[arg-type]
        built = None  # a model without attention (a CNN): transformers records an implementation all the same
    if built is not None:
        kernel_name = spec.attention or ("eager" if built == "eager" else "sdpa")
        saved = "score matrices saved, O(seq^2)" if built == "eager" else _fused_saved(model, attention, built)
        built = "flash stand-in" if built == hf.hf_attention.FUSED else built
        other = ("--attention sdpa|flash|eager plans for another" if hf.other_attention(model)  # type: ignore[arg-type]
                 else "the only one transformers has for this model")
        return f"attention traced as {kernel_name} (transformers' attn_implementation '{built}': {saved}; {other})"
    if attention.calls == 0 and spec.attention is not None:
        # said rather than ignored: the option changes nothing for a model whose step calls no SDPA
        return (f"--attention {spec.attention} changes nothing here: the step calls no scaled_dot_product_attention "
                "(the kernel --attention picks)")
    if attention.calls == 0 or (spec.name in BUILTINS and spec.attention is None):
        return None
    saved = "score matrices saved, O(seq^2)" if attention.name == "eager" else "fused kernel, O(seq) saved"
    return f"attention traced as {attention.name} ({saved}; --attention changes it)"


def linear_attention_note(tr: Trace, model: nn.Module) -> str | None:
    """Which kernels the trace took for linear attention, gated DeltaNet's and Kimi delta attention's (None: the step
    has none)."""
    calls = sum(1 for e in tr.events if e.is_op and not e.backward and e.kernel == KERNEL_LINEAR_ATTENTION)
    if not calls and (layers := linear_attention.layers(model) + linear_attention.kda_layers(model)):
        return (f"{layers:,} linear attention layers traced as transformers' PyTorch reference "
                "(a loop over 64-token chunks, each chunk's intermediates saved), not flash-linear-attention's "
                "kernels, which a GPU with FLA runs: their time and memory are far above a GPU's (this transformers "
                "calls the rule in a way fsdp-planner does not stand in for)")
    if not calls:
        return None
    kda = linear_attention.kda_layers(model)
    kinds = "Kimi delta attention" if kda and not linear_attention.layers(model) else \
        "gated DeltaNet and Kimi delta attention" if kda else "gated DeltaNet"
    estimate = (": Kimi delta attention's time at gated DeltaNet's rate (FLA publishes no KDA benchmark), an "
                "estimate") if kda else ""
    return (f"linear attention ({calls:,} {kinds} calls) traced as flash-linear-attention's chunked kernels, "
            "what a GPU with FLA runs (transformers' PyTorch reference, which runs without it, launches tens of "
            f"kernels per chunk of 64 tokens): FLA's saved tensors, its FLOPs at {FLA_SHARE_OF_FLASH:.0%} of fused "
            f"attention's efficiency (FLA's published benchmark){estimate}")


def mamba_note(tr: Trace, model: nn.Module) -> str | None:
    """Which path the trace took for Mamba-2's mixers (None: the model has none): the stand-in's calls counted."""
    count = mixers(model)
    fused = sum(1 for e in tr.events if e.is_op and not e.backward and e.kernel == KERNEL_MAMBA_SCAN)
    if count > fused:
        return (f"{count - fused:,} of {count:,} Mamba-2 mixers traced as transformers' PyTorch reference, which "
                "saves fp32 chunk-by-chunk matrices, not as mamba_ssm's fused function a GPU trains with: their "
                "activations are far above a GPU's (a cache (use_cache) or a transformers calling another path)")
    if not fused:
        return None
    return (f"{fused:,} Mamba-2 mixers traced as mamba_ssm's fused function (mamba_split_conv1d_scan_combined, what "
            "transformers trains with on a GPU with mamba_ssm: its input, the scan's output and the weights saved, the "
            "rest made again in backward), not transformers' PyTorch reference, which saves fp32 chunk-by-chunk "
            "matrices")


def selective_scan_note(tr: Trace, model: nn.Module) -> str | None:
    """Which path the trace took for Mamba-1's mixers' scans (None: the model has none)."""
    count = selective_scan.mixers(model)
    fused = sum(1 for e in tr.events if e.is_op and not e.backward and e.kernel == KERNEL_SELECTIVE_SCAN)
    if count > fused:
        return (f"{count - fused:,} of {count:,} Mamba-1 mixers' scans traced as transformers' PyTorch reference, a "
                "loop over every token saving each step's state, not as mamba_ssm's selective_scan_fn a GPU trains "
                "with: their time and activations are far above a GPU's (a cache (use_cache) or a transformers "
                "calling another path)")
    if not fused:
        return None
    return (f"{fused:,} Mamba-1 mixers' scans traced as mamba_ssm's selective_scan_fn (what transformers trains with "
            "on a GPU with mamba_ssm: its inputs, the ungated output and fp32 chunk states saved, the rest made again "
            "in backward), timed by the bytes the memory-bound kernel moves")


def recurrent_note(tr: Trace, model: nn.Module) -> str | None:
    """torch's own RNNs (nn.RNN, nn.LSTM, nn.GRU) the step calls, said because none is traced as a GPU runs it
    (None: none). On meta tensors ATen runs them cell by cell, a few ops a timestep each saving its gates; a GPU runs
    cuDNN's fused kernel, whose reserve space (what backward keeps) no meta function sizes; a CPU precomputes the
    input projection of every timestep at once (``FullLayer`` in ATen's RNN.cpp), so even ``verify``'s CPU ranks
    save other tensors than the trace (a trial's GRU: peaks 2-13% apart by plan)."""
    called = [name for name, m in model.named_modules() if isinstance(m, nn.RNNBase)
              and name in tr.modules and tr.modules[name].calls]
    if not called:
        return None
    kinds = sorted({tr.modules[name].cls for name in called})
    modules = f"{len(called):,} {'/'.join(kinds)} module{'s' * (len(called) > 1)}"
    return (f"{modules} ('{called[0]}' first) traced as ATen's cell-by-cell recurrence (a few ops a timestep, "
            "each saving its gates), not as a GPU trains them (cuDNN's fused RNN kernel and its reserve space) nor "
            "as a CPU does (the input projection of every timestep at once): their activations and time are "
            "approximate, and verify's peak of a plan that splits them may differ by over 5%")


TOKEN_LOOP_MIN_OPS = 1024  # a call's forward ops from which a loop over the tokens is said (and 2 a token)


def token_loop_note(tr: Trace, seq_len: int | None) -> str | None:
    """The module class whose calls run the most forward ops, where each runs at least 2 a token and 1,024: a
    Python loop over the sequence in the model's own code (RecurrentGemma's RG-LRU scan in transformers), which a
    GPU runs as a kernel launch an op too. Said because the step it prices is launch-bound there (None: none)."""
    if not seq_len:
        return None
    ops: dict[str, int] = {}
    for e in tr.events:
        if e.is_op and not e.backward and e.module in tr.modules:
            cls = tr.modules[e.module].cls
            ops[cls] = ops.get(cls, 0) + 1
    calls: dict[str, int] = {}
    for info in tr.modules.values():
        calls[info.cls] = calls.get(info.cls, 0) + info.calls
    looped = [(n, c) for c, n in ops.items() if calls.get(c) and n / calls[c] >= max(2 * seq_len, TOKEN_LOOP_MIN_OPS)]
    if not looped:
        return None
    n, cls = max(looped)
    return (f"{cls} runs {n / calls[cls]:,.0f} ops a call ({n / calls[cls] / seq_len:.1f} a token of {seq_len:,}; "
            f"{n / sum(ops.values()):.0%} of the forward's ops): a Python loop in the model's own code (over the "
            "tokens, where its ops grow with the sequence), each op a kernel launch on a GPU too. The step is priced "
            "as that code runs; a fused kernel for it would take a small part of that time")


def routing_note(spec: ModelSpec, consulted: int) -> str | None:
    """Said rather than ignored: ``--routing`` on a step that routes nothing (a dense model) changes nothing."""
    if spec.routing is None or consulted:
        return None
    return (f"--routing {spec.routing:g} changes nothing here: nothing in the step routes tokens by their values (no "
            "data-dependent op or Hugging Face experts layer, what the balanced-routing stand-in sizes)")


def _loss_hint(e: Exception) -> str:
    """What to do when the factory's loss_fn runs an op planning's meta tensors have no kernel for (CTC's)."""
    failed = failed_at(e)
    if failed is None or failed.module != LOSS or not isinstance(e, NotImplementedError):
        return ""
    return ("; planning runs the step on tensors without data, which this op does not take: for planning, give the "
            "factory a loss_fn every op of which runs on the meta device (e.g. a cross-entropy over the same "
            "output), and train with the real one (a loss holds no params: the plan is the same, its memory may "
            "differ a little)")


def _replay_hint(e: Exception) -> str:
    """A second backward through a graph: what a block keeping its own state for the loss (``self.aux``, which
    the loss reads) meets when its identical calls are traced once and replayed (a new user's trial)."""
    if "backward through the graph a second time" not in str(e):
        return ""
    return ("; a repeated block is traced once and replayed by default, which assumes its forward depends on its own "
            "state and arguments alone: a block keeping a tensor for the loss (self.aux = ...) needs --full-trace")


def _device_hint(e: Exception) -> str:
    """Why a device mismatch happens while planning, and what to change."""
    text = f"{type(e).__name__} {e}"
    if "meta" not in text or "device" not in text.lower():
        return ""
    return ("; the model is built on the meta device for planning, so every tensor the forward or loss_fn uses "
            "must be made inside the factory (not at module level, and without an explicit device='cpu'/'cuda')")
