"""Built-in models and loading of user model factories.

A MODEL spec is a built-in name, ``path/to/file.py:fn``, ``package.module:fn`` or a Hugging Face config
(``hf:NAME``, ``hf:path/config.json``, ``hf:path/dir``: ``hf.py``); ``fn()`` returns
``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``. For planning the factory runs under
``torch.device("meta")`` so even a 405B model costs no memory, with ``torch.nn.init``'s fills skipped on meta
tensors (``meta_init``).

The workload is the user's: ``--batch`` and ``--seq`` reach the factory as its ``batch_size`` and ``seq_len``
keyword arguments (every built-in that has them takes them; a user's factory opts in by declaring them).
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_planner.choices import ATTENTION_NAMES
from fsdp_planner.errors import PlannerError, raised_at
from fsdp_planner.limits import MAX_BATCH, MAX_LOSS_CHUNKS
from fsdp_planner.models import encdec, gpt2, hf, llama, lora, moe, seed, vit
from fsdp_planner.models.on_meta import meta_init
from fsdp_planner.patching import TORCHAO_LOGGERS, patched, quiet_loggers
from fsdp_planner.userfiles import MAX_SOURCE_BYTES


@dataclass(frozen=True)
class Builtin:
    factory: Callable[..., tuple]
    description: str
    trainable: bool  # small enough to train on CPU (verify)


def _llama(cfg: llama.LlamaConfig, batch_size: int, seq_len: int) -> Callable[..., tuple]:
    return functools.partial(llama.build, cfg, batch_size=batch_size, seq_len=seq_len)


BUILTINS: dict[str, Builtin] = {
    "seed-net": Builtin(seed.seed_net, "the seed's CNN (conv1, conv2, fc1, fc2), MNIST-sized input", True),
    "toy-llama": Builtin(_llama(llama.TOY_LLAMA, 4, 32), "4-layer Llama-style decoder, trains on CPU in seconds",
                         True),
    "toy-gpt2-tied": Builtin(gpt2.toy_gpt2_tied, "3-layer GPT-2-style decoder, lm_head tied to wte", True),
    "toy-llama-lora": Builtin(lora.toy_llama_lora, "toy-llama with rank-8 LoRA adapters on wq/wk/wv/wo, base frozen "
                                                   "(needs peft)", True),
    "seed-linear10": Builtin(seed.seed_linear10, "seed 002's 10 x Linear(10000, 10000) memory study", False),
    "llama3-8b": Builtin(_llama(llama.LLAMA3_8B, 1, 8192), "Llama 3 8B", False),
    "llama3-70b": Builtin(_llama(llama.LLAMA3_70B, 1, 8192), "Llama 3 70B", False),
    "llama3-405b": Builtin(_llama(llama.LLAMA3_405B, 1, 8192), "Llama 3 405B", False),
    "llama32-3b": Builtin(_llama(llama.LLAMA32_3B, 1, 8192), "Llama 3.2 3B, tied embeddings", False),
    "llama32-1b": Builtin(_llama(llama.LLAMA32_1B, 1, 8192), "Llama 3.2 1B, tied embeddings", False),
    "llama3-debugmodel": Builtin(_llama(llama.LLAMA3_DEBUG, 8, 2048),
                                 "torchtitan's llama3 debugmodel, 6 layers, dim 256, vocab 2,048", True),
    "t5-3b": Builtin(encdec.t5_3b, "T5 v1.1 XL encoder-decoder, shared embedding; the decoder reads seq_len / 4 "
                                   "tokens", False),
    "vit-h14": Builtin(vit.vit_h14, "ViT-H/14 at 224px", False),
    "mixtral-8x7b": Builtin(moe.mixtral_8x7b, "Mixtral 8x7B MoE, 8 experts top-2", False),
}

MIN_ROUTING, MAX_ROUTING = 0.1, 64.0  # --routing: below, an expert gets almost nothing; above, more than all tokens

# The workload options and the factory keyword each one sets.
WORKLOAD_OPTIONS = {"batch_size": "--batch", "seq_len": "--seq"}

MAX_FP32_MODULES = 10_000  # --fp32-modules names (a model's modules are far fewer that need it)
MAX_FP32_NAME = 100_000  # characters of one (a plan's module-name limit, fsdp2/plan.py's MAX_NAME)


@dataclass(frozen=True)
class ModelSpec:
    """The model to build: a MODEL spec and the workload the user set for it (None: the factory's default)."""

    name: str
    batch_size: int | None = None
    seq_len: int | None = None
    attention: str | None = None  # --attention (choices.ATTENTION_NAMES); None: sdpa, or an hf: model's own
    routing: float | None = None  # --routing: the stand-in's capacity factor (routing.py); None: 1
    hf_config: hf.Overrides = ()  # ``--hf-config KEY=VALUE``: config fields of an ``hf:`` model, set over its file's
    compile: bool = False  # --compile: the repeated blocks run torch.compile'd (what they save: trace/compiled.py)
    fp32_modules: tuple[str, ...] = ()  # --fp32-modules: modules kept in fp32 groups under a mixed precision (a
    # router, as torchtitan keeps MoE routers; sim/tracing.py)
    compile_loss: bool = False  # --compile-loss: the loss runs torch.compile'd, apart from the model (what it holds:
    # trace/compiled_loss.py)
    loss_chunks: int = 0  # --loss-chunks: the output layer and the loss run in chunks of the tokens, each with its
    # backward (torchtitan's ChunkedLossWrapper: trace/chunked_loss.py); 0: the whole sequence at once

    def __post_init__(self) -> None:
        if self.attention is not None and self.attention not in ATTENTION_NAMES:
            raise PlannerError(f"--attention must be one of {', '.join(ATTENTION_NAMES)}, got {self.attention!r}")
        if self.routing is not None and not (isinstance(self.routing, (int, float)) and not isinstance(
                self.routing, bool) and MIN_ROUTING <= self.routing <= MAX_ROUTING):
            raise PlannerError(f"--routing must be a capacity factor from {MIN_ROUTING} to {MAX_ROUTING:g}, got "
                               f"{self.routing!r}")
        for key, option in WORKLOAD_OPTIONS.items():
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PlannerError(f"{option} must be a positive whole number, got {value!r}")
        if isinstance(self.loss_chunks, bool) or not isinstance(self.loss_chunks, int) or not (
                self.loss_chunks == 0 or 2 <= self.loss_chunks <= MAX_LOSS_CHUNKS):
            raise PlannerError(f"--loss-chunks must be a whole number from 2 to {MAX_LOSS_CHUNKS:,} (0: the whole "
                               f"sequence at once), got {self.loss_chunks!r}")
        if self.hf_config and not hf.is_hf(self.name):
            raise PlannerError(f"--hf-config sets fields of a Hugging Face config: it applies to hf: models, not "
                               f"'{self.name}'")
        if len(self.hf_config) > hf.MAX_OVERRIDES:
            raise PlannerError(f"--hf-config: at most {hf.MAX_OVERRIDES} fields, got {len(self.hf_config)}")
        if not isinstance(self.fp32_modules, tuple) or len(self.fp32_modules) > MAX_FP32_MODULES or not all(
                isinstance(m, str) and 0 < len(m) <= MAX_FP32_NAME for m in self.fp32_modules):
            raise PlannerError(f"--fp32-modules: at most {MAX_FP32_MODULES:,} module names of at most "
                               f"{MAX_FP32_NAME:,} characters each")

    def __str__(self) -> str:
        return self.name

    def kwargs(self) -> dict[str, int]:
        """The workload keyword arguments the user set."""
        return {k: getattr(self, k) for k in WORKLOAD_OPTIONS if getattr(self, k) is not None}

    def config_text(self) -> str:
        """The ``--hf-config`` fields as the user writes them (``use_cache=true``); "" when none."""
        return " ".join(f"{k}={json.dumps(v)}" for k, v in self.hf_config)

    def label(self) -> str:
        """The name with its workload: what the user set, and a built-in's defaults ("llama3-8b, batch 1, seq
        8192"); a user factory's defaults are its own business and not read here (that would import it again)."""
        words = {"batch_size": "batch", "seq_len": "seq"}
        config = [self.config_text()] if self.hf_config else []
        return ", ".join([self.name, *(f"{words[k]} {v:,}" for k, v in self.workload().items()), *config])

    def workload(self) -> dict[str, Any]:
        """``batch_size`` and ``seq_len`` as the step runs them: what the user set over a built-in's or a shipped
        config's defaults (a user factory's are not read: that would import it again)."""
        values = workload_defaults(BUILTINS[self.name].factory) if self.name in BUILTINS else {}
        if hf.is_hf(self.name):
            values = _hf_workload(self.name)
            positions = dict(self.hf_config).get("max_position_embeddings")
            if isinstance(positions, int) and isinstance(values.get("seq_len"), int):  # the override's positions:
                # the default sequence follows them as it follows the file's (at most the shipped one, or the cap)
                cap = values["seq_len"] if self.name.removeprefix(hf.PREFIX) in hf.SHIPPED else hf.DEFAULT_SEQ_CAP
                values["seq_len"] = max(1, min(positions, cap))
        values.update(self.kwargs())
        return values

    def to_json(self) -> dict[str, Any]:
        extra = {k: getattr(self, k) for k in ("attention", "routing") if getattr(self, k) is not None}
        config = {"hf_config": dict(self.hf_config)} if self.hf_config else {}
        compiled = {**({"compile": True} if self.compile else {}),
                    **({"compile_loss": True} if self.compile_loss else {}),
                    **({"loss_chunks": self.loss_chunks} if self.loss_chunks else {})}
        fp32 = {"fp32_modules": list(self.fp32_modules)} if self.fp32_modules else {}
        return {"name": self.name, **self.kwargs(), **extra, **config, **compiled, **fp32}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        fields = dict(data)
        fields["hf_config"] = tuple(fields.get("hf_config", {}).items())
        fields["fp32_modules"] = tuple(fields.get("fp32_modules", ()))
        return cls(**fields)


def _hf_workload(spec: str) -> dict[str, Any]:
    """An ``hf:`` model's default workload; none when its config cannot be read (the command will say why)."""
    source = spec.removeprefix(hf.PREFIX)
    if source in hf.SHIPPED:  # known without importing transformers
        return hf.SHIPPED[source].workload()
    try:
        return workload_defaults(hf.factory(spec.removeprefix(hf.PREFIX)))
    except PlannerError:
        return {}


def shipped(spec: str) -> bool:
    """A built-in model or a shipped Hugging Face config: code and files that come with the package, the same for
    the whole of a process (a model file or a config.json of the user's may change)."""
    return spec in BUILTINS or (hf.is_hf(spec) and spec.removeprefix(hf.PREFIX) in hf.SHIPPED)


def planning_only(spec: str) -> bool:
    """A model too large to train on this machine: a built-in marked so, or a config shipped for planning."""
    if spec in BUILTINS:
        return not BUILTINS[spec].trainable
    return hf.is_hf(spec) and spec.removeprefix(hf.PREFIX) in hf.SHIPPED


def as_spec(spec: ModelSpec | str) -> ModelSpec:
    return spec if isinstance(spec, ModelSpec) else ModelSpec(spec)


def with_own_batch(spec: ModelSpec) -> ModelSpec:
    """A user factory's spec with the batch its factory runs by default written in (``workload`` reads no user
    factory's defaults, and auto weighs TP d at d times the batch per data-parallel rank: a trial's model got no TP
    screen without --batch); any other spec, or a factory without an int default, as it is. Imports the factory's
    file (again)."""
    if spec.batch_size is not None or spec.name in BUILTINS or hf.is_hf(spec.name):
        return spec
    factory = resolve_factory(spec.name)
    default = workload_defaults(factory).get("batch_size")
    if not isinstance(default, int) or isinstance(default, bool) or not 1 <= default <= MAX_BATCH or \
            inspect.signature(factory).parameters["batch_size"].kind is inspect.Parameter.POSITIONAL_ONLY:
        return spec  # (a positional-only one cannot be given back by name: a review)
    return replace(spec, batch_size=default)


def workload_defaults(factory: Callable[..., tuple]) -> dict[str, Any]:
    """The workload keywords a factory takes, with their defaults (``inspect.Parameter.empty`` when required)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return {}
    return {k: params[k].default for k in WORKLOAD_OPTIONS if k in params}


def takes(factory: Callable[..., tuple], key: str) -> bool:
    """Whether ``factory`` takes the workload keyword ``key`` (``seq_len``): by name, or as any keyword."""
    try:
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD
                        for p in inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        takes_any = False
    return takes_any or key in workload_defaults(factory)


def factory_kwargs(factory: Callable[..., tuple], spec: ModelSpec) -> dict[str, Any]:
    """The keyword arguments ``factory`` gets for ``spec``; a workload option it cannot take is an error, never
    silently ignored (the plan would be for another step)."""
    wanted: dict[str, Any] = spec.kwargs()
    config = {"hf_config": spec.hf_config} if spec.hf_config else {}  # the hf factories take it (hf.py)
    if hf.is_hf(spec.name) and "seq_len" not in wanted and "max_position_embeddings" in dict(spec.hf_config):
        default = spec.workload().get("seq_len")  # the override's positions, not the file's (``workload``)
        wanted.update({"seq_len": default} if default is not None else {})
    if not wanted:
        return config
    for key in wanted:
        if takes(factory, key):
            continue
        option = WORKLOAD_OPTIONS[key]
        if spec.name in BUILTINS:
            others = ", ".join(n for n, b in BUILTINS.items() if key in workload_defaults(b.factory))
            raise PlannerError(f"{option} does not apply to '{spec.name}' (it has no {key}); built-ins that take "
                               f"it: {others}")
        if hf.is_hf(spec.name):
            raise PlannerError(f"{option} does not apply to '{spec.name}': its inputs have no {key} (images)")
        raise PlannerError(f"{option} does not apply to '{spec.name}': its factory takes no '{key}' keyword "
                           f"argument (add one, e.g. def {spec.name.rpartition(':')[2]}({key}=...), to set it "
                           f"from the command line)")
    return {**wanted, **config}


@dataclass
class LoadedModel:
    """What a factory returned, checked: the model, its example inputs and its loss (None: the mean of squares of
    the output)."""

    name: str
    model: nn.Module
    example_inputs: Any
    loss_fn: Callable[[Any], torch.Tensor] | None
    own_checkpointing: tuple[str, ...] = ()  # the layers transformers' gradient checkpointing took, now off
    # (``hf.own_checkpointing_off``: the plan checkpoints)

    def loss_reads_model(self) -> str | None:
        """The name by which the loss reaches the params of the model it was built with, else None: a closure over
        a part of it, or over the model where the loss's code names one of its submodules or params or a method
        of its own class (``m.aux(out)``, ``m.logit_scale``, ``m.contrastive(h)``; not transformers'
        ``model.loss_function``, which reads the config alone), or a bound method of it. Such a loss reads that
        model's params whatever model made its input."""
        fn = self.loss_fn
        if fn is None:
            return None
        model = self.model
        parts = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}
        owner = getattr(fn, "__self__", None)
        if owner is not None and id(owner) in parts:
            return getattr(fn, "__name__", "the loss")
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        names = set(_code_names(code))
        own = {*model._modules, *model._parameters} | {  # (the model's own methods: not a library's)
            n for n in names for c in type(model).__mro__ if n in vars(c)
            and not c.__module__.startswith(("torch.", "transformers."))}
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if (value is model and names & own) or (value is not model and (
                    id(value) in parts or id(getattr(value, "__self__", None)) in parts)):
                return name
        return None


def _code_names(code: Any) -> Iterator[str]:
    """The attribute and global names a function's code uses, its nested functions' too."""
    yield from code.co_names
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from _code_names(const)


class HardExit(SystemExit):
    """``os._exit`` called by a model's code (``no_hard_exit``)."""


SLOW_USER_CODE_S = 30.0  # a model's import and factory take seconds on meta; past this, the user is told what runs


@contextlib.contextmanager
def user_code(doing: str) -> Iterator[None]:
    """Around a model's own code: ``os._exit`` refused (``no_hard_exit``), torchao's CPU-build warnings quiet, stdin
    empty (a trial's ``input()`` at import waited unseen for a line: now EOFError, reported), and a note on stderr
    once it has run ``SLOW_USER_CODE_S`` (a factory that downloads a checkpoint, or loops, looked like a hung
    planner)."""
    timer = threading.Timer(SLOW_USER_CODE_S, _say_slow, (doing,))
    timer.daemon = True
    timer.start()
    # (the null device, not a StringIO: a real file, with fileno() and encoding, for code that hands stdin on)
    with open(os.devnull, encoding="utf-8") as empty:
        try:
            with no_hard_exit(), quiet_loggers(*TORCHAO_LOGGERS), patched(sys, "stdin", empty):
                yield
        finally:
            timer.cancel()


def _say_slow(doing: str) -> None:
    print(f"note: {doing} has run for {SLOW_USER_CODE_S:g} s: that is the model's own code (a download, a loop, "
          "a wait?), not the planner's; Ctrl-C stops it", file=sys.stderr, flush=True)


def _user_error(e: Exception) -> str:
    """``type: message`` of what a model's code raised; where it read stdin, that the planner gives it none."""
    said = f"{type(e).__name__}: {e}"  # (input()'s own words: a truncated pickle's EOFError is not stdin's)
    return f"{said} (it reads stdin, which fsdp-planner does not give a model's code)" \
        if isinstance(e, EOFError) and str(e) == "EOF when reading a line" else said


@contextlib.contextmanager
def no_hard_exit() -> Iterator[None]:
    """``os._exit`` raises ``SystemExit`` inside, as ``sys.exit`` does: a model's code that calls it would end the
    command at once with its code (0: a plan that printed nothing looked like success)."""
    def refused(code: int) -> None:
        raise HardExit(code)

    with patched(os, "_exit", refused):
        yield


def exit_message(e: SystemExit, while_doing: str) -> str:
    """What to say when the user's code calls ``sys.exit``: it would otherwise end the planner silently, with the
    status the model chose (often 0, as if the command had succeeded)."""
    code = "" if e.code is None else repr(e.code)
    call = "os._exit" if isinstance(e, HardExit) else "sys.exit"
    return f"the model's code called {call}({code}) while {while_doing} (raised SystemExit: {e.code})"


def _check_model_file(target: str) -> Path:
    path = Path(target)
    if path.is_file():
        if path.stat().st_size > MAX_SOURCE_BYTES:  # imported whole: a model's code is kilobytes
            raise PlannerError(f"model file '{target}' is {path.stat().st_size / 2**20:,.0f} MiB: at most "
                               f"{MAX_SOURCE_BYTES >> 20} MiB of Python is read")
        return path
    if path.is_dir():
        raise PlannerError(f"model file '{target}' is a directory: give path/to/file.py:fn")
    if path.exists():
        raise PlannerError(f"model file '{target}' is not a regular file")
    raise PlannerError(f"model file '{target}' does not exist")


def written_defaults(spec: ModelSpec) -> dict[str, int]:
    """The workload defaults a ``file.py:fn`` factory's signature writes as whole-number literals
    (``def build(batch_size: int = 4, seq_len: int = 32)``), read without running the file; with what the spec sets
    over them. Any other model, or a default that is no literal: ``spec.workload()`` as it is (a factory's defaults
    run as code are its own business)."""
    known = spec.workload()
    target, _, fn_name = spec.name.rpartition(":")
    if not target.endswith(".py") or spec.name in BUILTINS or hf.is_hf(spec.name):
        return known
    return {**_literal_defaults(target, fn_name), **known}


def takes_sequence(spec: str) -> bool:
    """Whether the model ``spec`` names takes a sequence length (``seq_len``), a ``file.py:fn`` factory's read from
    its signature without running the file (its import runs once, when the model is built); True where that
    cannot be told (a factory that is not a plain ``def``: the model is asked when built)."""
    target, _, fn_name = spec.rpartition(":")
    if spec in BUILTINS or hf.is_hf(spec) or not target.endswith(".py"):
        return takes(resolve_factory(spec), "seq_len")
    try:
        mtime = Path(target).stat().st_mtime_ns
    except OSError:
        return True
    return _takes_sequence_of(str(Path(target).resolve()), mtime, fn_name)


@functools.lru_cache(maxsize=64)
def _takes_sequence_of(path: str, mtime_ns: int, fn_name: str) -> bool:
    fn = _function_def(path, fn_name)
    if fn is None:
        return True
    args = fn.args
    return args.kwarg is not None or "seq_len" in {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}


def _function_def(path: str, fn_name: str) -> ast.FunctionDef | None:
    """The top-level ``def fn_name`` of the Python file ``path``, parsed, not run; None where there is none."""
    try:
        if Path(path).stat().st_size > MAX_SOURCE_BYTES:
            return None
        tree = ast.parse(Path(path).read_bytes(), path)  # (bytes: its coding line or BOM decodes it, as import does)
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn_name), None)


@functools.lru_cache(maxsize=64)
def _literal_defaults_of(path: str, mtime_ns: int, fn_name: str) -> tuple[tuple[str, int], ...]:
    fn = _function_def(path, fn_name)
    if fn is None:
        return ()
    args = [*fn.args.posonlyargs, *fn.args.args]
    pairs = list(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d is not None]
    return tuple((a.arg, d.value) for a, d in pairs if a.arg in WORKLOAD_OPTIONS and isinstance(d, ast.Constant)
                 and type(d.value) is int and d.value > 0)


def _literal_defaults(target: str, fn_name: str) -> dict[str, int]:
    try:
        mtime = Path(target).stat().st_mtime_ns
    except OSError:
        return {}
    return dict(_literal_defaults_of(str(Path(target).resolve()), mtime, fn_name))


def _factories_hint(path: Path) -> str:
    """The file's top-level functions, read without running it (what FN can be)."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return ""
    return _functions_hint([n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")])


def _closest_first(module: Any, fn_name: str) -> str:
    """The imported module's own public functions, those nearest a misspelt ``fn_name`` first (what FN can be)."""
    names = [n for n, v in vars(module).items()
             if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")]
    close = difflib.get_close_matches(fn_name, names, n=3)
    return _functions_hint([*close, *(n for n in names if n not in close)], "closest first" if close else "")


def _functions_hint(names: list[str], order: str = "") -> str:
    """`` (its functions: a, b, ...)``, the first 8 of ``names``; none when there are none."""
    shown = f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"
    return f" (its functions{f', {order}' if order else ''}: {shown})" if names else ""


def resolve_factory(spec: str) -> Callable[..., tuple]:
    """The factory function a MODEL spec names."""
    if spec in BUILTINS:
        return BUILTINS[spec].factory
    if hf.is_hf(spec):
        return hf.factory(spec.removeprefix(hf.PREFIX))
    if ":" not in spec and spec.endswith(".py"):
        if not Path(spec).is_file():
            raise PlannerError(f"model file '{spec}' does not exist (a model file is given as path/file.py:FN)")
        raise PlannerError(f"model '{spec}' names a file but not its factory: give '{spec}:FN'"
                           + _factories_hint(Path(spec)))
    if ":" not in spec:
        known = ", ".join(BUILTINS)
        shipped = f" (a shipped Hugging Face config: hf:{spec})" if spec in hf.SHIPPED else ""
        raise PlannerError(f"unknown model '{spec}'{shipped}: use a built-in ({known}), 'file.py:fn' / 'module:fn' "
                           "or 'hf:NAME' / 'hf:path/config.json'")
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
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # as ``python file.py`` does: the file imports what lies beside it
            sys.path.insert(0, folder)
        try:
            # (a factory's transformers may import torchao, whose CUDA kernels a CPU build cannot load: lines on
            # stderr that say nothing of the job)
            with user_code(f"importing '{target}'"):
                module_spec.loader.exec_module(module)
        except SystemExit as e:
            raise PlannerError(exit_message(e, f"importing '{target}'")) from e
        except Exception as e:  # user code: report, never a traceback
            raise PlannerError(f"importing '{target}' failed: {_user_error(e)}") from e
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:  # as ``python -m``: modules in this directory too
            sys.path.insert(0, os.getcwd())
        try:
            with user_code(f"importing module '{target}'"):
                module = importlib.import_module(target)
        except SystemExit as e:
            raise PlannerError(exit_message(e, f"importing module '{target}'")) from e
        except Exception as e:
            raise PlannerError(f"cannot import module '{target}': {_user_error(e)}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise PlannerError(f"'{target}' has no callable '{fn_name}'{_closest_first(module, fn_name)}")
    return fn


# what torch says when a value is read from a meta tensor (``.tolist()``, ``.item()``, ``float(t)``)
META_VALUE_READ = re.compile(r"meta tensor|on meta tensors|meta device", re.I)


def _meta_hint(e: Exception) -> str:
    """Where building read a value from a tensor made on the meta device (planning builds the model there): how to
    make that tensor (a trial's ``torch.linspace(...).tolist()`` of drop-path rates)."""
    if not META_VALUE_READ.search(str(e)):
        return ""
    return ("; fsdp-planner builds the model under torch.device('meta'), where a tensor holds no values: make a "
            "tensor the constructor reads values from (.tolist(), .item()) with device='cpu'")


def _check_callable_so(factory: Callable[..., Any], kwargs: dict[str, Any], spec: str) -> None:
    """Refuse a factory that the keyword arguments fsdp-planner gives cannot call, before calling it: its
    TypeError was reported at fsdp-planner's own line, as if the planner had failed (a trial's ``def build(x)``)."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        given = f"with {', '.join(f'{k}=' for k in kwargs)} only" if kwargs else "with no arguments"
        raise PlannerError(f"model factory '{spec}' cannot be called {given}, as fsdp-planner calls it ({e}): give "
                           "its other parameters defaults (batch_size and seq_len are given where it takes "
                           "them)") from None
    except ValueError:  # no signature to read (a builtin's): called, and its own error said
        pass


def load_model(model_spec: ModelSpec | str, meta: bool = True, seed: int = 0) -> LoadedModel:
    """Build the model a spec names, for the workload it sets; on the meta device when ``meta`` (planning only)."""
    model_spec = as_spec(model_spec)
    spec = model_spec.name
    factory = resolve_factory(spec)
    kwargs = factory_kwargs(factory, model_spec)
    if hf.is_hf(spec) and model_spec.attention is not None:
        kwargs["attention"] = model_spec.attention  # transformers' attn_implementation (hf.build_model)
    _check_callable_so(factory, kwargs, spec)
    torch.manual_seed(seed)
    try:
        with user_code(f"building the model '{spec}'"):
            if meta:
                with meta_init():  # on meta, initialisers fill nothing: skipped (on_meta.py)
                    result = factory(**kwargs)
            else:
                result = factory(**kwargs)
    except PlannerError:
        raise
    except SystemExit as e:  # sys.exit or argparse in a factory is an error too, never a silent exit
        raise PlannerError(exit_message(e, f"building the model '{spec}'")) from e
    except Exception as e:  # user code: report, never a traceback
        raise PlannerError(f"model factory '{spec}' raised {_user_error(e)}{raised_at(e)}"
                           f"{_meta_hint(e) if meta else ''}") from e
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise PlannerError(
            f"model factory '{spec}' must return (model, example_inputs) or (model, example_inputs, loss_fn)"
        )
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise PlannerError(f"model factory '{spec}' returned a loss_fn that is not callable: "
                           f"{type(loss_fn).__name__}")
    _check_names_encode(model, spec)
    params = list(model.parameters())
    if not params:
        raise PlannerError(f"model '{spec}' has no parameters: there is nothing for FSDP to shard")
    if not any(p.requires_grad for p in params):
        raise PlannerError(f"model '{spec}' has no trainable parameters (all {len(params)} have requires_grad="
                           "False): FSDP plans are for training; leave some parameters trainable")
    if meta:
        inputs = _onto_meta(model, inputs)
    return LoadedModel(spec, model, inputs, loss_fn, hf.own_checkpointing_off(model))


def _check_names_encode(model: nn.Module, spec: str) -> None:
    """Every module, param and buffer name is text a file can hold: a lone surrogate (``"\\ud800"``, which Python's str
    takes) failed deep in tracing as "UnicodeEncodeError" (a trial); it is named here instead."""
    for name, _ in chain(model.named_modules(remove_duplicate=False), model.named_parameters(remove_duplicate=False),
                         model.named_buffers(remove_duplicate=False)):  # (every alias: tracing reads them all)
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise PlannerError(f"model '{spec}' names a module, param or buffer {ascii(name)[:80]}, which is no valid "
                               "text (a lone surrogate: UTF-8 cannot hold it, nor a plan file): rename it") from None


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
