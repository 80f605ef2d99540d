"""torchtitan's current job configs, read without running them: a function of a ``config_registry.py`` that returns
``Trainer.Config(...)`` (torchtitan #2386 replaced the TOML jobs with these), and torchtitan's dotted command-line
overrides (``--parallelism.data_parallel_shard_degree 8``).

The file is parsed with ``ast``: the keywords of the ``Trainer.Config(...)`` call, of the dataclass calls inside it
and of the locals and module-level constants they name (``SEQ_LEN = 8192`` above the functions) are read with
``ast.literal_eval`` (and whole-number arithmetic such as ``8 * 8192``); nothing of the file is imported or run. A
job built on another of the file (``config = llama3_debugmodel()``, then ``config.training.steps = 5``) is read
through it. The result has the old TOML job's shape (sections ``model``, ``training``, ``parallelism``,
``activation_checkpoint``, ``compile``), so the TOML reader's mapping, notes and refusals apply to both.
Torch-free.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib.util
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short
from fsdp_planner.limits import MAX_LOSS_CHUNKS, MAX_SEQ, MAX_TOKENS
from fsdp_planner.userfiles import MAX_CONFIG_BYTES, read_text, shown_json, shown_key

# torchtitan's model flavours that are fsdp-planner's built-in models or shipped transformers configs (the same
# architecture numbers: torchtitan's deepseek_v3 "671B" flavour, models/deepseek_v3/__init__.py's _671b, is
# DeepSeek-V3's config.json)
# (model, flavour as torchtitan's model_registry spells it; a job's spelling is matched without case)
TITAN_MODELS = {("llama3", "debugmodel"): "llama3-debugmodel", ("llama3", "1B"): "llama32-1b",
                ("llama3", "3B"): "llama32-3b", ("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b",
                ("llama3", "405B"): "llama3-405b", ("deepseek_v3", "671B"): "hf:deepseek-v3",
                **{("qwen3", f): f"hf:qwen3-{f.lower()}" for f in ("0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B",
                                                                   "235B-A22B")},
                # torchtitan's own flavours, shipped as transformers configs of the same params (models/hf.py)
                ("qwen3", "debugmodel"): "hf:titan-qwen3-debugmodel",
                ("qwen3", "debugmodel_non_fused_qkv"): "hf:titan-qwen3-debugmodel",  # q, k, v apart: the same
                ("qwen3", "debugmodel_moe"): "hf:titan-qwen3-debugmodel-moe",
                ("deepseek_v3", "debugmodel"): "hf:titan-deepseek-v3-debugmodel",
                ("deepseek_v3", "16B"): "hf:titan-deepseek-v3-16b",
                ("deepseek_v3", "236B"): "hf:titan-deepseek-v3-236b",
                ("gpt_oss", "debugmodel"): "hf:titan-gpt-oss-debugmodel", ("gpt_oss", "20b"): "hf:gpt-oss-20b",
                ("gpt_oss", "120b"): "hf:gpt-oss-120b", ("kimi_k2_7", "moonlight-16B-A3B"): "hf:moonlight-16b-a3b"}
# torchtitan's multimodal flavours whose text decoder is a shipped transformers config (models/hf.py): not the job's
# model (its vision encoder is left out), so MODEL must name it
TITAN_DECODERS = {("qwen3_5", f): f"hf:qwen3.5-{f.lower()}" for f in ("9B", "27B", "35B-A3B", "397B-A17B")}
# transformers runs these models' attention eagerly (no SDPA path: gpt-oss's sinks), saving the seq x seq scores;
# torchtitan runs them with flex or varlen attention, fused, O(seq) saved: planned with --attention flash
TITAN_FUSED_ATTENTION = frozenset({"hf:titan-gpt-oss-debugmodel", "hf:gpt-oss-20b", "hf:gpt-oss-120b"})


def titan_model(name: str, flavor: str, models: dict[tuple[str, str], str] = TITAN_MODELS) -> str | None:
    """The model fsdp-planner builds for torchtitan's ``name`` / ``flavor`` (None: none); of ``TITAN_DECODERS``, the
    text decoder of a multimodal flavour."""
    key = (name.strip().lower(), flavor.strip().lower())
    return next((m for (n, f), m in models.items() if (n, f.lower()) == key), None)

SPEC = re.compile(r"^(?P<where>.+):(?P<function>[A-Za-z_]\w*)$", re.S)
MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
MAX_DEPTH = 8  # jobs built on jobs, and locals naming locals: deeper is refused, not followed
MAX_NUMBER = 10**100  # whole-number arithmetic in the file stays below this: a bound on the work (each step's
# operands stay short), not on the value, which the job's own checks judge as they do a literal's
MAX_FLAGS = 1000

# Trainer.Config keys that change nothing a step's time or memory depends on here: read past.
IGNORED = frozenset({"hf_assets_path", "dump_folder", "profiler", "metrics", "tokenizer", "dataloader",
                     "lr_scheduler", "checkpoint", "comm", "validator", "debug", "override"})
SECTION_CLASSES = {"training": "TrainingConfig", "parallelism": "ParallelismConfig", "compile": "CompileConfig",
                   "activation_checkpoint": "SelectiveAC.Config", "loss": "BaseLoss.Config"}  # each section's
# dataclass, for an override (Trainer.Config's defaults)
# TrainingConfig: the token counts become the TOML's local_batch_size / seq_len / global_batch_size; the rest keep
# their names. READ: a key whose value the job's simulation depends on (not a literal there: an error).
TOKENS = ("num_tokens_per_microbatch_per_dp_rank", "max_context_length", "num_tokens_per_train_step")
TOKEN_DEFAULTS = {"num_tokens_per_microbatch_per_dp_rank": 16384, "max_context_length": 2048,
                  "num_tokens_per_train_step": -1}  # TrainingConfig's defaults
READ = {"training": {*TOKENS, "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce",
                     "disable_cuda_graphs"},
        "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                        "tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                        "expert_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel"},
        "compile": {"enable", "enable_async_tensor_parallel", "components"}, "activation_checkpoint": set()}
# Keys of the current dataclasses the TOML reader does not know, and what becomes of them: None, read past (an
# option of tensor/pipeline/context parallelism, whose degree is noted); a string, a note.
NEW_KEYS: dict[str, dict[str, str | None]] = {
    "training": {},
    "parallelism": {"spmd_backend": None, "num_pp_microbatches": None,
                    "context_parallel_load_balancer": None, "context_parallel_ptrr_mask_key": None,
                    "enable_fsdp_symm_mem": "fsdp-planner models FSDP2's NCCL collectives, not symmetric-memory ones"},
    "compile": {"backend": None},
    "activation_checkpoint": {},
}
# Keys read past above whose value is noted where it is not what fsdp-planner simulates: (section, key) -> (the
# value simulated, what the note says)
SIMULATED_AS = {("compile", "backend"): ("inductor", "fsdp-planner simulates inductor's kernels")}
# activation_checkpoint's dataclass, as the TOML's mode (SelectiveAC is per-op: torchtitan's "op")
AC_CLASSES = {"SelectiveAC": {"mode": "selective", "selective_ac_option": "op"}, "FullAC": {"mode": "full"},
              "MemoryBudgetAC": {"mode": "memory_budget"}}
# model_registry's own defaults (each model's torchtitan/models/*/__init__.py at b5bcd76): a value there changes
# nothing fsdp-planner builds, so it is read past without a note
MODEL_REGISTRY_DEFAULTS = {"attn_backend": "flex", "tp_gemm_backend": "default", "moe_comm_backend": "standard",
                           "non_blocking_capacity_factor": None, "num_mtp_layers": 0}
OWN_REGISTRY_DEFAULTS = {"gpt_oss": {"attn_backend": "varlen"}, "qwen3": {"moe_comm_backend": None},
                         "qwen3_5": {"moe_comm_backend": None}}
AC_RENAMED = {"force_recompute_mm_shapes_by_fqns": "per_op_sac_force_recompute_mm_shapes_by_fqns"}
# each class's Config fields (torchtitan/distributed/activation_checkpoint.py at b5bcd76): no early_stop, which its
# wrapper fixes to False, and no mode or selective_ac_option, which the class is
_AC_BASE = ("preserve_rng_state", "determinism_check", "debug")
AC_FIELDS = {"SelectiveAC": (*_AC_BASE, "force_recompute_mm_shapes_by_fqns"), "FullAC": _AC_BASE,
             "MemoryBudgetAC": (*_AC_BASE, "memory_budget", "visualize_memory_budget_pareto")}
AC_SUBCOMMANDS = {"selective": "SelectiveAC", "full": "FullAC", "memory-budget": "MemoryBudgetAC", "none": None}
FLAG = re.compile(r"^--(?P<key>[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)+)(?:=(?P<value>.*))?$", re.S)
SUBCOMMAND = re.compile(r"^activation[-_]checkpoint:(?P<kind>selective|full|memory[-_]budget|none)$")
SUBCOMMAND_LIKE = re.compile(r"^-*activation[-_]checkpoint:", re.I)  # (one that is none: said, not taken as a value)


@dataclass(frozen=True)
class Call:
    """A call read from the file: ``model_registry("8B")``, ``TrainingConfig(steps=10)``."""

    name: str  # the callee as written ("SelectiveAC.Config")
    args: tuple[Any, ...] = ()
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The class a ``X.Config`` call configures (``SelectiveAC``), else the callee's last name."""
        parts = self.name.split(".")
        return parts[-2] if len(parts) > 1 and parts[-1] == "Config" else parts[-1]


@dataclass(frozen=True)
class Unread:
    """A value that is not a literal, as the file spells it (cut short)."""

    source: str


@dataclass(frozen=True)
class Outer:
    """A module-level constant a function names: read in the module's scope (a local of the function that has the
    same name as one of the constant's own names does not change it)."""

    node: ast.expr
    scope: dict[str, Any]


@dataclass(frozen=True)
class Override:
    """One torchtitan command-line flag: ``--training.steps 5`` is ``("training.steps", 5)``."""

    key: str
    value: Any
    bare: bool = field(default=False, compare=False)  # a flag given no value (``--section.flag``): true


def is_registry_spec(spec: str) -> bool:
    """Whether ``--from-torchtitan`` names a registry job (``FILE.py:FUNCTION``, ``MODULE:FUNCTION``), not a TOML."""
    m = SPEC.match(spec.strip())
    return bool(m) and (m["where"].endswith(".py") or (MODULE.match(m["where"]) is not None
                                                       and not m["where"].endswith(".toml")))


def registry_file(spec: str) -> str | None:
    """The file ``FILE.py:FUNCTION`` names (None for ``MODULE:FUNCTION`` or a TOML)."""
    m = SPEC.match(spec.strip())
    return m["where"] if m and is_registry_spec(spec) and m["where"].endswith(".py") else None


# -- the command line's flags ----------------------------------------------------------------------------------------
def parse_flags(tokens: Sequence[str]) -> tuple[Override, ...]:
    """torchtitan's flags (``--section.key VALUE``, ``--section.key=VALUE``, a bare ``--section.flag`` for true,
    ``--section.no_flag`` / ``no-flag`` for false, several values for a list, ``activation_checkpoint:full``)."""
    if len(tokens) > MAX_FLAGS:
        raise PlannerError(f"{len(tokens):,} torchtitan flags: at most {MAX_FLAGS:,} are read")
    out, i = [], 0
    while i < len(tokens):
        token, i = tokens[i], i + 1
        sub = SUBCOMMAND.match(token)
        if sub:
            kind = AC_SUBCOMMANDS[sub["kind"].replace("_", "-")]
            out.append(Override("activation_checkpoint", Call(f"{kind}.Config") if kind else None))
            continue
        m = FLAG.match(token)
        if m is None:
            raise PlannerError(_flag_error(token))
        values = [] if m["value"] is None else [m["value"]]
        while m["value"] is None and i < len(tokens) and not tokens[i].startswith("--") \
                and not SUBCOMMAND_LIKE.match(tokens[i]):
            values.append(tokens[i])
            i += 1
        *section, last = m["key"].replace("-", "_").split(".")
        if not values and last.startswith("no_"):  # tyro's --section.no-flag
            out.append(Override(".".join([*section, last[3:]]), False))
        elif not values:
            out.append(Override(".".join([*section, last]), True, bare=True))
        else:
            parsed = [_flag_value(v) for v in values]
            out.append(Override(".".join([*section, last]), parsed[0] if len(parsed) == 1 else parsed))
    return tuple(out)


@contextlib.contextmanager
def bare_flags_said(flags: Sequence[str]) -> Iterator[None]:
    """A setting refused as ``key = true`` where its flag was given no value says so: torchtitan's bare flag sets
    true, and ``--training.local_batch_size`` with its number left off read as "= true is not a whole number"."""
    try:
        yield
    except PlannerError as e:
        try:
            # (the value refused, "KEY = true is not ...", not a setting an error asks for: "needs KEY = true")
            bare = [o.key for o in parse_flags(flags) if o.bare and f"{o.key} = true is not" in str(e)]
        except PlannerError:
            raise e from None
        if not bare:
            raise
        raise PlannerError(f"{e} (--{bare[0]} was given no value, and a flag without one sets true: give "
                           f"--{bare[0]} VALUE)") from e


def _flag_error(token: str) -> str:
    if token in ("--module", "--config") or token.startswith(("--module=", "--config=")):
        return (f"torchtitan flag {shown_json(token)}: give the job as --from-torchtitan MODULE:FUNCTION (torchtitan's "
                "--module/--config), e.g. torchtitan.models.llama3:llama3_8b")
    if SUBCOMMAND.match(token.lstrip("-")):  # "--activation-checkpoint:full": torchtitan's subcommand has no dashes
        return (f"torchtitan flag {shown_json(token)}: write the activation checkpointing subcommand without the "
                f"dashes, {token.lstrip('-')}")
    if SUBCOMMAND_LIKE.match(token):  # (a trial's activation-checkpoint:bogus was read as a list's second value)
        return (f"torchtitan subcommand {shown_json(token)} is none of torchtitan's: activation-checkpoint:full, "
                "activation-checkpoint:selective, activation-checkpoint:memory-budget or activation-checkpoint:none")
    return (f"torchtitan flag {shown_json(token)} is not --section.key VALUE (e.g. "
            "--parallelism.data_parallel_shard_degree 8)")


def _flag_value(text: str) -> Any:
    """A flag's value as torchtitan's parser takes it: true/false, None, a number, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if re.fullmatch(r"[+-]?\d{1,40}", text.strip()):  # (a 20-digit count stays a whole number, shown as given)
        return int(text)
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d{1,3})?", low) and len(low) <= 40:
        return float(low)
    return text


def with_overrides(data: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A TOML job's tables with the flags set (``activation_checkpoint:full`` sets ``activation_checkpoint.mode``)."""
    for o in overrides:
        if o.key == "activation_checkpoint":
            data["activation_checkpoint"] = dict(AC_CLASSES[o.value.kind]) if o.value else {"mode": "none"}
            continue
        *path, last = o.key.split(".")
        table = data
        for part in path:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise PlannerError(f"torchtitan flag --{o.key}: {part} is not a table of the job")
        table[last] = o.value
    return data


# -- the file --------------------------------------------------------------------------------------------------------
def read_registry(spec: str, overrides: Sequence[Override] = ()) -> tuple[dict[str, Any], list[str]]:
    """The job ``FILE.py:FUNCTION`` / ``MODULE:FUNCTION`` returns, with ``overrides`` set, as a TOML job's tables,
    and the notes on what is left out."""
    m = SPEC.match(spec.strip())
    if m is None or not is_registry_spec(spec):
        raise PlannerError(f"torchtitan job {json.dumps(spec)} is not FILE.py:FUNCTION or MODULE:FUNCTION")
    path, function = _source(m["where"]), m["function"]
    label = f"torchtitan job '{path}:{function}'"
    tree = _parse(read_text(path, f"torchtitan config_registry '{path}'", "a torchtitan config_registry.py",
                       MAX_CONFIG_BYTES), label)
    notes: list[str] = []
    try:
        config = _job(Source.of(tree), function, label, 0, notes)
        _no_ac_mode(config.get("activation_checkpoint"), label)  # (before the flags, which may set it: _ac)
        for o in overrides:
            config = _set(config, o.key.split("."), o.value)
        config = check_set_over(config, overrides, label, notes)
        return toml_tables(config, _model_names(path, tree), label, notes, _exported_plan(tree, label)), notes
    except RecursionError:  # an expression nested thousands deep (ast.parse takes more than literal_eval does)
        raise PlannerError(f"{label}: its values nest too deeply to read") from None


def _source(where: str) -> Path:
    """The file a ``FILE.py`` or a module names; a module is found on ``sys.path`` without importing anything
    (``find_spec`` of a dotted name would import its parents: only the top package is looked up)."""
    if where.endswith(".py"):
        return Path(where)
    names = [where] if "." in where else [where, f"torchtitan.models.{where}", f"torchtitan.experiments.{where}"]
    for name in names:
        found = _module_file(name)
        if found is not None:
            return found / "config_registry.py" if found.is_dir() else found
    raise PlannerError(f"module {shown_json(where)} is not found here (is torchtitan installed?): give the file "
                       "instead, e.g. path/to/config_registry.py:FUNCTION")


def _module_file(name: str) -> Path | None:
    """A module's file, or a package's directory, from its top package's location."""
    top, *rest = name.split(".")
    try:
        found = importlib.util.find_spec(top)  # a top-level name: located, not imported
    except (ImportError, ValueError):
        return None
    if found is None:
        return None
    dirs = [Path(d) for d in (found.submodule_search_locations or [])]
    if not rest:
        return dirs[0] if dirs else Path(found.origin) if found.origin else None
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        package = next((d / part for d in dirs if (d / part / "__init__.py").is_file()), None)
        if package is None and last:
            return next((d / f"{part}.py" for d in dirs if (d / f"{part}.py").is_file()), None)
        if package is None:
            return None
        dirs = [package]
    return dirs[0]


def _parse(text: str, label: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as e:
        raise PlannerError(f"{label}: the file is not valid Python (line {e.lineno}: {e.msg})") from None
    except (RecursionError, MemoryError):
        raise PlannerError(f"{label}: the file nests too deeply to parse") from None
    except ValueError:  # a null byte
        raise PlannerError(f"{label}: the file cannot be parsed as Python") from None


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _constants(tree: ast.Module) -> dict[str, Outer]:
    """The module's names assigned once at its top level (``SEQ_LEN = 8192``), each read only where a job names it;
    a name assigned twice there, inside an ``if`` or a loop, or ``global`` in a function, is not one (its value
    would need running the file)."""
    counts: dict[str, int] = {}
    for node in _top_level(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else node.names if isinstance(node, ast.Global) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.NamedExpr)) else []
        for t in targets:
            for name in [t] if isinstance(t, str) else (n.id for n in ast.walk(t) if isinstance(n, ast.Name)):
                counts[name] = counts.get(name, 0) + 1
    scope: dict[str, Any] = {}
    for stmt in tree.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else \
            stmt.target if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else None
        if isinstance(target, ast.Name) and counts.get(target.id) == 1:
            scope[target.id] = Outer(stmt.value, scope)  # type: ignore[arg-type]
    return scope


def _top_level(body: list[ast.stmt]) -> list[ast.AST]:
    """The nodes that bind the module's names: its statements and what they hold, not functions' or classes' own
    locals (a ``global`` statement in a function is kept)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(n for n in ast.walk(node) if isinstance(n, ast.Global))
        else:
            todo.extend(ast.iter_child_nodes(node))
    return out


def _model_names(path: Path, tree: ast.Module) -> dict[str, str]:
    """The torchtitan model each name the file calls ``model_registry`` by belongs to: ``from
    torchtitan.models.llama3 import model_registry`` (``as llama_registry`` too: a file of several models), or
    ``from . import model_registry`` in ``models/llama3/``; a file importing none, its folder's model."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):  # (the file's order at its top level: a name imported twice is the last's)
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name == "model_registry":  # (``from ..llama3 import``: llama3's; ``from . import``: the folder's)
                    out[a.asname or a.name] = node.module.split(".")[-1] if node.module else path.resolve().parent.name
    where = path.resolve().parent
    return out or {"model_registry": where.name if where.parent.name == "models" else ""}


SKIPPED = (ast.Expr, ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assert, ast.Pass)


@dataclass(frozen=True)
class Source:
    """What of the parsed file the jobs read: its functions, its module-level constants and the classes it
    defines on ``Trainer.Config`` (a model's own trainer config, e.g. ``class _KimiTrainerConfig(Trainer.Config)``)."""

    functions: dict[str, ast.FunctionDef]
    constants: dict[str, Outer]
    trainer_classes: frozenset[str]
    imported: dict[str, str]  # a name ``from M import name`` binds anywhere in the file -> M (to say where it is)

    @classmethod
    def of(cls, tree: ast.Module) -> Source:
        classes = frozenset(n.name for n in tree.body if isinstance(n, ast.ClassDef)
                            and any(_dotted(b).endswith("Trainer.Config") for b in n.bases))
        imported = {a.asname or a.name: n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module and not n.level for a in n.names}
        return cls(_functions(tree), _constants(tree), classes, imported)

    def is_trainer_config(self, call: ast.expr) -> bool:
        return isinstance(call, ast.Call) and (_dotted(call.func).endswith("Trainer.Config")
                                               or _dotted(call.func) in self.trainer_classes)


@dataclass(frozen=True)
class Known:
    """A value already read: a job function's argument, bound to its parameter."""

    value: Any


def _job(source: Source, name: str, label: str, depth: int, notes: list[str],
         args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``Trainer.Config``'s keywords as ``name`` returns them: its call, or another job of the file (called with
    literal arguments or none) then the attributes the function sets on it. ``args``: the values of ``name``'s
    parameters it was called with."""
    fn = source.functions.get(name)
    if fn is None:
        names = sorted(source.functions)
        close = difflib.get_close_matches(name, names, n=3)
        ordered = [*close, *(n for n in names if n not in close)]
        known = ", ".join(ordered[:12]) + (f" and {len(ordered) - 12} more" if len(ordered) > 12 else "") or "none"
        raise PlannerError(f"{label}: the file has no function {shown_key(name)} (its functions"
                           f"{', closest first' if close else ''}: {known})")
    if depth > MAX_DEPTH:
        raise PlannerError(f"{label}: its jobs build on each other more than {MAX_DEPTH} deep")
    local, edits, returned = _statements(fn, name, label, notes, source.functions)
    params = _parameters(fn, args or {}, source.constants, label)
    scope: dict[str, Any] = {**source.constants, **params, **local}  # a local hides the module's constant
    variable = returned.id if isinstance(returned, ast.Name) else ""
    node = scope.get(variable, returned)
    if isinstance(node, Outer):  # a job the module builds at its top level
        node = node.node
    config = _returned(source, node, name, label, depth, notes, scope, bool(variable))
    for path, value in edits:
        if path[0] != variable:
            if path[0] in scope:  # a dataclass of the job built apart, then edited: its call is what is read
                raise PlannerError(f"{label}: {'.'.join(path)} is set after {path[0]} is made, which the reader "
                                   f"does not follow: pass it as a keyword of {path[0]}'s call")
            notes.append(f"{'.'.join(path)} is not read: it sets no attribute of the returned config")
            continue
        if path[1] not in IGNORED:
            config = _set(config, path[1:], _value(value, scope, 0))
    if isinstance(config.get(BASE), UnreadBase):  # (built on a job of the file that builds on an unread one)
        config[BASE] = replace(config[BASE], whole=config[BASE].whole | {p[1] for p, _ in edits
                                                                          if p[0] == variable and len(p) == 2})
    return config


BASE = "\0base"  # the key of a job's config that records an unread base (never a keyword's name)
# What a job built on one the reader does not read must set itself, a section whole or these keys of it (a key left
# out would be the base's, unknown): what the simulation reads of each, in torchtitan's current dataclasses.
SET_OVER_BASE = {"model_spec": (), "activation_checkpoint": (),
                 "training": ("num_tokens_per_microbatch_per_dp_rank", "max_context_length",
                              "num_tokens_per_train_step", "dtype", "mixed_precision_param", "enable_cpu_offload"),
                 "parallelism": ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                                 "fsdp_reshard_after_forward", "tensor_parallel_degree", "pipeline_parallel_degree",
                                 "context_parallel_degree", "expert_parallel_degree"),
                 "compile": ("enable", "components")}  # (its optimizer, where not set: torchtitan's default)


@dataclass(frozen=True)
class UnreadBase:
    """A job ``job`` builds on by calling ``base()``, a function the file does not define (``from
    torchtitan.models.llama3.config_registry import llama3_8b``): not read, so ``job`` must set what the simulation
    reads (``SET_OVER_BASE``); ``whole``: the sections it assigns whole."""

    base: str
    job: str
    whole: frozenset[str]
    module: str  # where the file imports it from ("MODULE" where it does not say)
    converts: str = ""  # MODULE:JOB of the job ``base`` is given to convert (``base(job(), ...)``), where imported


def check_set_over(config: dict[str, Any], overrides: Sequence[Override], label: str,
                   notes: list[str]) -> dict[str, Any]:
    """``config`` without its unread base's record, once each setting the simulation reads is known to be set by the
    job or a flag (an error naming the ones that are not); a note says the base was not read."""
    unread = config.pop(BASE, None)
    if not isinstance(unread, UnreadBase):
        return config
    whole = unread.whole | {o.key for o in overrides if "." not in o.key}
    missing = [f"{section}.{key}" if key else section for section, keys in SET_OVER_BASE.items()
               if section not in whole for key in (keys or ("",))
               if not key or not (isinstance(config.get(section), Call) and key in config[section].fields)]
    if missing:
        # (the first few named: all 15 cut the message's advice off, a trial)
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        them = "them" if len(missing) > 1 else "it"
        where = (f"or plan the job it converts (--from-torchtitan {unread.converts}); what {unread.base}() changes "
                 "of that job is not modelled") if unread.converts else \
            f"or read {unread.base}'s own file (--from-torchtitan {unread.module}:{unread.base})"
        raise PlannerError(f"{label}: {unread.job} builds on {unread.base}(), which is not in the file (the reader "
                           f"does not run it), and leaves {shown} as {unread.base}() has {them}: set {them} in "
                           f"{unread.job} (or give the flag), {where}")
    optimizer = config.get("optimizer")
    said = "" if "optimizer" in whole else ": its optimizer's param groups are simulated as AdamW" \
        if isinstance(optimizer, Call) and "implementation" in optimizer.fields \
        else ": its optimizer is simulated as torchtitan's default, fused AdamW"
    # its loss too (torchtitan's registry jobs chunk theirs, ChunkedLossWrapper's 8: a new user's derived job was
    # simulated with a whole loss and no word)
    loss = "" if "loss" in whole or "loss" in config or any(o.key.startswith("loss.") for o in overrides) else \
        f"; its loss is simulated whole, not in chunks: set config.loss = ChunkedLossWrapper.Config(...) where " \
        f"{unread.base}() chunks it"
    notes.append(f"{unread.job} builds on {unread.base}(), not read (it is not in the file): the job is what "
                 f"{unread.job} sets{said}{loss}")
    return config


def _returned(source: Source, node: Any, name: str, label: str, depth: int, notes: list[str], scope: dict[str, Any],
              edited: bool) -> dict[str, Any]:
    """The config ``name`` returns before its edits: a ``Trainer.Config`` call's keywords, another job of the file's,
    or (``edited``: a variable the function sets attributes on) an unread base's record."""
    if source.is_trainer_config(node):
        _written_out(node, label)
        return {k.arg: _value(k.value, scope, 0) for k in node.keywords if k.arg and k.arg not in IGNORED}
    if isinstance(node, ast.Call) and _dotted(node.func) in source.functions:
        _written_out(node, label)
        called = source.functions[_dotted(node.func)]
        given = _arguments(called, node, scope, label)
        return _job(source, _dotted(node.func), label, depth + 1, notes, given)
    if isinstance(node, ast.Call) and _dotted(node.func) and edited:  # a job of another module (torchtitan's own,
        # imported): not read; what the step depends on must be set here (``check_set_over``)
        base = _dotted(node.func)
        # a converter of another job (graph_trainer's ``to_graph_trainer_config(llama3_8b(), model_registry)``)
        given = _dotted(node.args[0].func) if node.args and isinstance(node.args[0], ast.Call) else ""
        converts = f"{source.imported[given]}:{given}" if given in source.imported else ""  # (a bare name only:
        # ``module.job`` would name no function of the module it was imported from)
        return {BASE: UnreadBase(base, name, frozenset(), source.imported.get(base.split(".")[0], "MODULE"),
                                 converts)}
    shown = "nothing" if node is None else cut_short(f"{_dotted(node.func)}(...)") \
        if isinstance(node, ast.Call) and _dotted(node.func) else cut_short(ast.unparse(node))
    raise PlannerError(f"{label}: {name} returns {shown}, not Trainer.Config(...) or another job of the file: "
                       "fsdp-planner reads the jobs of torchtitan's Trainer (and of its subclasses' Config), whose "
                       "keys it knows; another trainer's config is not read")


def _arguments(fn: ast.FunctionDef, call: ast.Call, scope: dict[str, Any], label: str) -> dict[str, Any]:
    """A call of the job function ``fn``'s arguments by parameter name (read in the caller's ``scope``)."""
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    extra = [k.arg for k in call.keywords if k.arg not in (*names, *(a.arg for a in fn.args.kwonlyargs))]
    if (extra and fn.args.kwarg is not None) or (len(call.args) > len(names) and fn.args.vararg is not None):
        # (the call may match: what the function does with them is its body's, which the reader does not run)
        spread = f"**{fn.args.kwarg.arg}" if extra and fn.args.kwarg is not None else f"*{fn.args.vararg.arg}"
        raise PlannerError(f"{label}: {fn.name} takes {spread}, which the reader does not expand without running "
                           "the file: give it parameters of their own")
    if len(call.args) > len(names) or extra:
        raise PlannerError(f"{label}: {cut_short(ast.unparse(call))} does not match {fn.name}'s parameters")
    given = dict(zip(names, (_value(a, scope, 0) for a in call.args), strict=False))
    given.update({k.arg: _value(k.value, scope, 0) for k in call.keywords if k.arg})
    return given


def _parameters(fn: ast.FunctionDef, args: dict[str, Any], constants: dict[str, Outer],
                label: str) -> dict[str, Any]:
    """``fn``'s parameters as the call gave them, else their defaults (read in the module's scope); one with
    neither is an error naming it."""
    positional = [*fn.args.posonlyargs, *fn.args.args]
    defaults = dict(zip([a.arg for a in positional][len(positional) - len(fn.args.defaults):], fn.args.defaults,
                        strict=True))
    defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d})
    out: dict[str, Any] = {}
    for a in (*positional, *fn.args.kwonlyargs):
        if a.arg in args:
            out[a.arg] = Known(args[a.arg])
        elif a.arg in defaults:
            out[a.arg] = Outer(defaults[a.arg], constants)
        else:
            raise PlannerError(f"{label}: {fn.name}'s parameter {a.arg} has no default and no argument: name a job "
                               "function that takes none")
    return out


def _setattr(stmt: ast.stmt) -> tuple[list[str], ast.expr] | None:
    """``setattr(a.b, "c", value)`` as the edit ``a.b.c = value`` (None for any other statement)."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if not isinstance(call, ast.Call) or _dotted(call.func) != "setattr" or len(call.args) != 3 or call.keywords:
        return None
    obj, attr, value = call.args
    if not _dotted(obj) or not isinstance(attr, ast.Constant) or not isinstance(attr.value, str):
        return None
    return [*_dotted(obj).split("."), attr.value], value


def _written_out(call: ast.Call, label: str) -> None:
    """A call's keywords must be written out: ``**settings`` would need running the file to read."""
    spread = next((k for k in call.keywords if k.arg is None), None)
    if spread is not None:
        where = f"{label}: " if label else ""
        raise PlannerError(f"{where}{_dotted(call.func)}(...) takes **{cut_short(ast.unparse(spread.value))}, "
                           "which the reader does not expand without running the file: write its keywords out")


def _statements(fn: ast.FunctionDef, name: str, label: str, notes: list[str],
                functions: dict[str, ast.FunctionDef]
                ) -> tuple[dict[str, ast.expr], list[tuple[list[str], ast.expr]], ast.expr | None]:
    """What ``fn``'s body assigns, up to its return: names' values, attribute edits (``setattr`` too) and the
    returned expression; a statement whose effect the reader cannot follow is an error or a note."""
    scope: dict[str, ast.expr] = {}
    edits: list[tuple[list[str], ast.expr]] = []
    returned: ast.expr | None = None
    for stmt in fn.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else \
            stmt.target if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else None
        if isinstance(stmt, ast.AugAssign):  # its value is the old one's: reading it would need running the file
            raise PlannerError(f"{label}: line {stmt.lineno} of {name} ({cut_short(ast.unparse(stmt))}) changes a "
                               "value in place, which the reader does not follow: assign the value itself")
        if isinstance(target, ast.Name):
            if target.id in scope:  # the reader keeps one value a name: a use before this line would read this
                raise PlannerError(f"{label}: line {stmt.lineno} of {name} assigns {target.id} again, which the "
                                   "reader does not follow (it keeps one value a name): give each value its own name")
            scope[target.id] = stmt.value  # type: ignore[union-attr]
        elif isinstance(target, ast.Attribute) and _dotted(target):
            edits.append((_dotted(target).split("."), stmt.value))  # type: ignore[union-attr]
        elif isinstance(stmt, ast.Return):
            returned = stmt.value
            break
        elif isinstance(stmt, ast.Raise):  # (it was said to return nothing: a trial looked for a missing return)
            raise PlannerError(f"{label}: line {stmt.lineno} of {name} raises ({cut_short(ast.unparse(stmt))}) before "
                               "it returns a job: torchtitan would stop there too")
        elif (edit := _setattr(stmt)) is not None:  # setattr(config.x, "y", value): config.x.y = value
            edits.append(edit)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):  # x.update(...), print(...)
            if (passed := _handed_over(stmt.value, scope, functions)) is not None:
                raise PlannerError(f"{label}: line {stmt.lineno} of {name} ({cut_short(ast.unparse(stmt))}) hands "
                                   f"{passed} to a call the reader does not run (it reads the job without running "
                                   "the function), so a change it makes to the job would not be read: write the "
                                   "change as assignments in the function, or give the setting as a flag after --")
            notes.append(f"line {stmt.lineno} of {name} ({cut_short(ast.unparse(stmt))}) is not run: a change "
                         "it makes to the job is not read (write it as an assignment)")
        elif not isinstance(stmt, SKIPPED):
            _check_unread_block(stmt, name, label, scope, functions)
            notes.append(f"line {stmt.lineno} of {name} ({type(stmt).__name__.lower()}) is not read: "
                         "only assignments and the return are read, without running the function")
    return scope, edits, returned


# calls that change nothing they are handed: builtins that read, a log line, a copy (``dataclasses.replace``)
READING_CALLS = frozenset({"print", "isinstance", "len", "sorted", "str", "repr", "getattr", "hasattr", "type", "id",
                           "format", "any", "all", "list", "tuple", "dict", "set", "replace", "dataclasses.replace",
                           "copy.deepcopy", "copy.copy", "deepcopy"})
LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "log"})
# the methods by which a call on a job's own object changes it in place (a list's, a dict's, a set's, an object's)
MUTATORS = frozenset({"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "remove", "clear",
                      "add", "discard", "sort", "reverse", "__setattr__", "__setitem__", "__init__", "__delattr__"})


def _handed_over(call: ast.Call, scope: dict[str, ast.expr], functions: dict[str, ast.FunctionDef]) -> str | None:
    """What of the function's own objects (``config``, ``config.parallelism``) ``call`` may change, unread: a method
    that changes its object in place (``MUTATORS``) or a call handed one, unless it only reads or logs
    (``READING_CALLS``, ``LOG_METHODS``), it reaches a section that changes no step (``IGNORED``:
    ``config.override.imports.append``), or it is a helper of the file that changes no other (torchtitan's
    ``enable_fused_swiglu(config)``); a helper that sets a degree (``tune(config)``) would simulate another job (a
    new user's trial)."""
    func = _dotted(call.func)
    method = call.func.attr if isinstance(call.func, ast.Attribute) else ""
    if func in READING_CALLS or method in LOG_METHODS:
        return None
    owner = call.func.value if isinstance(call.func, ast.Attribute) and method in MUTATORS else None
    handed = [(owner, None), *((a, k) for k, a in enumerate(call.args)), *((k.value, k.arg) for k in call.keywords)]
    for node, at in handed:
        path = _dotted(node).split(".") if node is not None else [""]
        if path[0] not in scope or (len(path) > 1 and path[1] in IGNORED):
            continue
        helper = functions.get(func) if at is not None and len(path) == 1 else None
        if helper is not None and not _helper_changes(helper, at, functions):
            continue
        return ".".join(path)
    return None


def _helper_changes(fn: ast.FunctionDef, at: int | str, functions: dict[str, ast.FunctionDef], depth: int = 0
                    ) -> bool:
    """Whether the file's function ``fn``, handed a job as its parameter ``at`` (a position or a keyword), may
    change a section of it the simulation reads: an assignment, ``setattr`` or changing method call under that
    parameter or a local name for a part of it (``p = config.parallelism``) outside ``IGNORED``, or either handed
    on to a call that may; one it cannot follow (too deep, its own caller) counts as a change."""
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    param = names[at] if isinstance(at, int) and at < len(names) else at if isinstance(at, str) else None
    if param is None or depth > MAX_DEPTH:
        return True
    held = _parts_named(fn, param)
    for node in ast.walk(fn):
        if _assigns_under(node, held, param):
            return True
        if isinstance(node, ast.Call) and (passed := _handed_over(node, dict.fromkeys(held), {})) is not None:
            helper = functions.get(_dotted(node.func))
            if helper is None or _dotted(node.func) == fn.name:
                return True
            handed = [k for k, a in enumerate(node.args) if _dotted(a) == passed]
            handed += [k.arg for k in node.keywords if _dotted(k.value) == passed]
            if not handed or any(_helper_changes(helper, k, functions, depth + 1) for k in handed):
                return True
    return False


def _parts_named(fn: ast.FunctionDef, param: str) -> set[str]:
    """``param`` and the local names ``fn`` gives its parts (``p = config.parallelism``), to a fixed point."""
    held = {param}
    while True:
        more = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign)
                and _dotted(node.value).split(".")[0] in held for t in node.targets if isinstance(t, ast.Name)}
        if more <= held:
            return held
        held |= more


def _assigns_under(node: ast.AST, held: set[str], param: str) -> bool:
    """Whether ``node`` assigns an attribute or item under one of ``held``, outside ``param``'s ``IGNORED``
    sections (a local name taking a part is no change: ``_parts_named`` follows it)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    for t in targets:
        if isinstance(t, ast.Name):
            continue
        path = _dotted(t.value if isinstance(t, ast.Subscript) else t).split(".")
        if path[0] in held and not (path[0] == param and len(path) > 1 and path[1] in IGNORED):
            return True
    return False


def _check_unread_block(stmt: ast.stmt, name: str, label: str, scope: dict[str, ast.expr],
                        functions: dict[str, ast.FunctionDef]) -> None:
    """Refuse a statement the reader does not run (an ``if``, a loop, a ``with``) whose body assigns, sets an
    attribute (``setattr`` by any name) or hands the function's objects to a call that may change them: which
    branch runs decides the job (a degree set under ``if big:``), so reading past it would simulate another one.
    Its test or iterable only reads."""
    body = [n for field in ("body", "orelse", "handlers", "finalbody") for n in getattr(stmt, field, ())]
    for node in (n for part in body for n in ast.walk(part)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        sets = isinstance(node, ast.Call) and (_dotted(node.func) == "setattr"
                                               or _handed_over(node, scope, functions) is not None)
        if targets or sets:
            what = f"assigns {cut_short(ast.unparse(targets[0]))}" if targets else \
                f"calls {cut_short(ast.unparse(node))}"
            raise PlannerError(f"{label}: line {stmt.lineno} of {name} ({type(stmt).__name__.lower()}) {what} "
                               "inside, which the reader does not run (it reads the job without running the "
                               "function): write the job without it, one function a setting, or give the setting "
                               "as a flag after --")


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` of a name or attribute chain ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _value(node: ast.expr, scope: dict[str, Any], depth: int) -> Any:
    """A literal, a ``Call`` of literals, a list of them, or ``Unread``."""
    if isinstance(node, ast.Name) and node.id in scope and depth < MAX_DEPTH:
        named = scope[node.id]
        if isinstance(named, Known):
            return named.value
        if isinstance(named, Outer):
            return _value(named.node, named.scope, depth + 1)
        return _value(named, scope, depth + 1)
    if isinstance(node, ast.Call) and _dotted(node.func):
        _written_out(node, "")
        return Call(_dotted(node.func), tuple(_value(a, scope, depth + 1) for a in node.args),
                    {k.arg: _value(k.value, scope, depth + 1) for k in node.keywords if k.arg})
    if isinstance(node, (ast.List, ast.Tuple)) and any(isinstance(e, (ast.Call, ast.Name)) for e in node.elts):
        return [_value(e, scope, depth + 1) for e in node.elts]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    number = _arithmetic(node, scope, depth)
    return Unread(cut_short(ast.unparse(node))) if number is None else number


ARITHMETIC = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.FloorDiv: lambda a, b: a // b if b else None,
              ast.Pow: lambda a, b: a ** b if 0 <= b <= 64 and abs(a) < 2**16 else None}  # (2 ** 14; bounded)


def _arithmetic(node: ast.expr, scope: dict[str, Any], depth: int) -> int | None:
    """Whole-number arithmetic of literals and the names of whole numbers (``8 * SEQ_LEN``), bounded; None for
    anything else."""
    if isinstance(node, ast.Name) and node.id in scope and depth < MAX_DEPTH:
        value = _value(node, scope, depth)
        return value if type(value) is int else None
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value if abs(node.value) < MAX_NUMBER else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and depth < MAX_DEPTH:
        a = _arithmetic(node.operand, scope, depth + 1)  # ``-SEQ`` as ``0 - SEQ`` (a literal -1 is one already)
        return None if a is None else -a if isinstance(node.op, ast.USub) else a
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC and depth < MAX_DEPTH:
        a, b = _arithmetic(node.left, scope, depth + 1), _arithmetic(node.right, scope, depth + 1)
        if a is None or b is None:
            return None
        out = ARITHMETIC[type(node.op)](a, b)
        return out if out is not None and abs(out) < MAX_NUMBER else None
    return None


def _set(config: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """``config`` with the dotted ``path`` set (a section not given is its dataclass's defaults)."""
    head, rest = path[0], path[1:]
    out = dict(config)
    if not rest:
        out[head] = value
        return out
    section = out.get(head)
    if not isinstance(section, Call):
        section = Call(SECTION_CLASSES.get(head, head))
    out[head] = replace(section, fields=_set(section.fields, rest, value))
    return out


# -- into the TOML job's tables --------------------------------------------------------------------------------------
def toml_tables(config: dict[str, Any], models: dict[str, str], label: str, notes: list[str],
                plan: str | None = None) -> dict[str, Any]:
    """``Trainer.Config``'s keywords as the tables of the old TOML job; what has no place there, a note.
    ``models``: the torchtitan model of each name the file calls ``model_registry`` by (``_model_names``). ``plan``:
    the plan an fsdp-planner export holds (``_exported_plan``), which its ``parallelize_fn`` applies: the job's
    grouping where the job keeps that function (``PLAN_TABLE``)."""
    data: dict[str, Any] = {}
    config.setdefault("activation_checkpoint", Call("SelectiveAC.Config"))  # Trainer.Config's default
    for key, value in config.items():
        if key in IGNORED:
            continue
        if key == "model_spec":
            _model(data, value, models, label, notes, plan)
        elif key == "activation_checkpoint":
            data[key] = _ac(value, label, notes)
        elif key == "optimizer":
            data[key] = _optimizer(value, label, notes)
        elif key == "loss":
            chunks = _loss(value, notes, label)
            # (a whole-sequence loss the job names: --loss-chunks would contradict it)
            data[LOSS_TABLE] = {"chunks": chunks} if chunks is not None else {"whole": _whole(value)}
        elif key in READ:
            data[key] = _section(key, value, label, notes)
        elif key == "fault_tolerance" and isinstance(value, Call):  # (read past, but for a note on torchft's)
            data[key] = {k: v for k, v in value.fields.items()
                         if k in ("enable", "semi_sync_method") and isinstance(v, (bool, str))}
        else:
            data[key] = {}  # the TOML reader names a section it does not know
    if "training" in data:
        data["training"] = _tokens(data["training"], label, notes)
    _check_cuda_graphs(config, models, label)
    # (TrainingConfig's default: torchtitan replays the forward and backward as a CUDA graph; the TOML jobs had none)
    data.setdefault("training", {}).setdefault("disable_cuda_graphs", False)
    if plan is not None and PLAN_TABLE not in data:  # (an export of a model that is not torchtitan's own)
        notes.append(f"{PLAN_NAME} holds an fsdp-planner plan that this job does not apply (it sets no "
                     f"model_spec.parallelize_fn = {EXPORTED_FN}): these figures are of torchtitan's own groups for "
                     "the job's keys; simulate the plan file for the plan's")
    return data


# the token dispatchers whose EP all-to-all a CUDA graph captures (no host sync): model_registry's moe_comm_backend,
# and whether it needs non_blocking_capacity_factor (Trainer.Config._validate_cuda_graphs at b5bcd76)
CAPTURED_DISPATCHERS = {"minimal_async_ep": False, "hybridep": True}


def _check_cuda_graphs(config: dict[str, Any], models: dict[str, str], label: str) -> None:
    """torchtitan refuses a job that CUDA-graphs an EP dispatch which syncs with the host (the standard all-to-all's
    split sizes, DeepEP's): its own config check, which a simulated step would pass over. Only a MoE flavour has a
    dispatcher to check."""
    def given(section: str, key: str, default: Any) -> Any:
        call = config.get(section)
        return call.fields.get(key, default) if isinstance(call, Call) else default

    spec = config.get("model_spec")
    flavor = (spec.args[0] if spec.args else spec.fields.get("flavor")) if isinstance(spec, Call) else None
    ep, off = given("parallelism", "expert_parallel_degree", 1), given("training", "disable_cuda_graphs", False)
    if not (isinstance(ep, int) and ep > 1 and off is False and isinstance(flavor, str)
            and _moe_flavour(models.get(spec.kind, ""), flavor)):
        return
    backend = given("model_spec", "moe_comm_backend", None) or "standard"  # (None: the registry's default)
    if backend in CAPTURED_DISPATCHERS and not (CAPTURED_DISPATCHERS[backend]
                                                and given("model_spec", "non_blocking_capacity_factor", None) is None):
        return
    if isinstance(backend, (Unread, Call)):  # (not read: noted as left out where it is not the default)
        return
    raise PlannerError(f"{label}: torchtitan refuses this job: its CUDA graphs (on: training.disable_cuda_graphs is "
                       f"False, the default) capture EP's dispatch only with moe_comm_backend \"minimal_async_ep\", or "
                       f"\"hybridep\" with a non_blocking_capacity_factor, and expert_parallel_degree = {ep} runs "
                       f"{shown_json(backend)}: set disable_cuda_graphs=True in the job's TrainingConfig, as its EP "
                       "jobs do (the flag -- --training.disable_cuda_graphs is not enough where the "
                       "Trainer.Config(...) call itself sets EP: torchtitan checks the config as it is built)")


def _moe_flavour(model: str, flavor: str) -> bool:
    """torchtitan's MoE models: every flavour of a MoE family, and qwen3's / qwen3_5's "debugmodel_moe", "30B-A3B"."""
    return model in ("deepseek_v3", "gpt_oss", "kimi_k2_7") or re.search(r"moe|-a\d+b$", flavor, re.I) is not None


# torchtitan's ChunkedLossWrapper.Config's default number of chunks (torchtitan/components/loss.py at b5bcd76)
DEFAULT_LOSS_CHUNKS = 8


def _loss(value: Any, notes: list[str], label: str) -> int | None:
    """``loss=``: torchtitan's whole-sequence ``CrossEntropyLoss`` is what the step simulates; any other, a note that
    says what is simulated instead (the loss is often a step's memory peak: its logits and their fp32 copies). A
    ``ChunkedLossWrapper``'s chunks are returned (its ``num_chunks``: the step's ``--loss-chunks``; 0 where not a
    literal, simulated whole with a note); a count torchtitan's wrapper would refuse is one error naming it."""
    if isinstance(value, Call) and value.kind in LOSS_FIELDS:
        _check_loss_fields(value, label)
    if isinstance(value, Call) and value.kind == "CrossEntropyLoss":
        return None
    if isinstance(value, Call) and value.kind == "ChunkedLossWrapper":
        return _chunks(value, notes, label)
    shown = value.name if isinstance(value, Call) else value.source if isinstance(value, Unread) else \
        cut_short(str(value))
    notes.append(f"loss = {shown_key(shown)} is simulated as torchtitan's CrossEntropyLoss over the whole "
                 "sequence")
    return None


# the fields of the losses' Configs (torchtitan/components/loss.py at b5bcd76: keyword-only dataclasses, which
# refuse any other; BaseLoss.Config has none)
LOSS_FIELDS = {"BaseLoss": frozenset(), "CrossEntropyLoss": frozenset({"global_vocab_size"}),
               "ChunkedLossWrapper": frozenset({"num_chunks", "loss_fn"})}


def _check_loss_fields(value: Call, label: str) -> None:
    """One error for a field the loss's Config does not have (``loss=`` or a ``--loss.KEY`` flag): torchtitan's
    dataclass raises, and read past, a misspelled ``num_chunks`` ran the default's 8 chunks, and ``--loss.num_chunks``
    on a whole-sequence loss nothing."""
    known = LOSS_FIELDS[value.kind]
    for key in value.fields:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8) if len(key) <= 100 else []
        hint = f" (did you mean {close[0]}?)" if close else ""
        whole = ": the job's loss runs over the whole sequence, and loss = ChunkedLossWrapper.Config(num_chunks=N) " \
                "runs it in chunks" if value.kind != "ChunkedLossWrapper" and key == "num_chunks" else ""
        raise PlannerError(f"{label}: loss = {value.kind}.Config has no field {shown_json(key)}{hint}, which "
                           f"torchtitan's dataclass refuses{whole}")
    inner = value.fields.get("loss_fn")  # (the wrapper's inner loss: the same dataclass rule)
    if isinstance(inner, Call) and inner.kind in LOSS_FIELDS:
        _check_loss_fields(inner, label)


def _whole(value: Any) -> bool:
    """Whether ``loss=`` names torchtitan's whole-sequence cross-entropy (or a wrapper of one chunk)."""
    return isinstance(value, Call) and (value.kind == "CrossEntropyLoss" or (
        value.kind == "ChunkedLossWrapper" and value.fields.get("num_chunks") == 1))


def _chunks(value: Call, notes: list[str], label: str) -> int | None:
    """A ``ChunkedLossWrapper.Config(...)``'s chunks (``_loss``)."""
    if value.args:  # (the Config is a keyword-only dataclass: torchtitan raises a TypeError)
        raise PlannerError(f"{label}: ChunkedLossWrapper.Config takes keyword arguments only (num_chunks=N), as "
                           "torchtitan's dataclass does")
    inner = value.fields.get("loss_fn")
    if inner is not None and not (isinstance(inner, Call) and inner.kind == "CrossEntropyLoss"):
        shown = inner.name if isinstance(inner, Call) else getattr(inner, "source", cut_short(str(inner)))
        notes.append(f"loss = ChunkedLossWrapper's loss_fn = {shown_key(shown)} is simulated as its default, "
                     "torchtitan's CrossEntropyLoss, in the chunks")
    chunks = value.fields.get("num_chunks", DEFAULT_LOSS_CHUNKS)
    if isinstance(chunks, Unread | Call):
        shown = chunks.source if isinstance(chunks, Unread) else f"{chunks.name}(...)"
        notes.append(f"loss = ChunkedLossWrapper with num_chunks = {shown} (not a literal) is simulated as "
                     "one cross-entropy over the whole sequence: the loss's own peak (the whole sequence's logits, "
                     "and what the loss makes of them) is over-counted")
        return 0
    if type(chunks) is not int or chunks < 1:
        raise PlannerError(f"{label}: loss = ChunkedLossWrapper with num_chunks = {cut_short(repr(chunks))}: "
                           "torchtitan's wrapper splits the tokens into num_chunks equal chunks, a whole number of "
                           "at least 1")
    if chunks > MAX_LOSS_CHUNKS:
        raise PlannerError(f"{label}: loss = ChunkedLossWrapper with num_chunks = {chunks:,}: fsdp-planner plans a "
                           f"loss in at most {MAX_LOSS_CHUNKS:,} chunks (--loss-chunks)")
    if chunks == 1:
        notes.append("loss = ChunkedLossWrapper with num_chunks = 1 is simulated as one cross-entropy over the "
                     "whole sequence (the wrapper's own backward of the output layer and its fp32 buffer of the "
                     "hidden states' gradient are not counted)")
        return None
    return chunks  # simulated as the wrapper runs (``trace/chunked_loss.py``)


def _exported_plan(tree: ast.Module, label: str) -> str | None:
    """The plan JSON an fsdp-planner export of the job holds (``PLAN_NAME = '...'`` at the top level, a string
    literal read as data), None where the file has none. Bound once, as the export binds it: a second binding
    (another assignment, ``+=``, an import as the name, a function's ``global``) is refused, since Python applies
    the last and the first was read (a trial's second assignment simulated a plan the job does not apply)."""
    bindings = _module_bindings(tree, PLAN_NAME)
    if bindings > 1:
        raise PlannerError(f"{label}: {PLAN_NAME} is bound {bindings} times, and fsdp-planner's export binds it "
                           "once (Python applies the last, the reader the first): export the plan again")
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == PLAN_NAME:
            value = node.value
            if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                raise PlannerError(f"{label}: {PLAN_NAME} is not a string literal (fsdp-planner's export writes the "
                                   "plan's JSON there): export the plan again")
            return value.value
    if bindings:  # (inside an if, a loop or a function: what the job applies is not read)
        raise PlannerError(f"{label}: {PLAN_NAME} is bound elsewhere than in one top-level assignment, where "
                           "fsdp-planner's export writes it: export the plan again")
    return None


def _module_bindings(tree: ast.Module, name: str) -> int:
    """How many times the module binds ``name`` in its own scope: a function's or class's locals are its own (a
    review: a local named so was counted), but for a ``global`` of it."""
    count, stack = 0, list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            count += node.name == name
            count += sum(isinstance(n, ast.Global) and name in n.names for n in ast.walk(node))
            continue
        count += _binds(node, name)
        stack.extend(ast.iter_child_nodes(node))
    return count


def _binds(node: ast.AST, name: str) -> bool:
    """Whether ``node`` binds ``name``: an assignment to it (``+=`` too), an import as it, a ``global`` of it, a
    function or class of that name."""
    if isinstance(node, ast.Name):
        return node.id == name and isinstance(node.ctx, ast.Store)
    if isinstance(node, ast.alias):
        return (node.asname or node.name) == name
    if isinstance(node, ast.Global | ast.Nonlocal):
        return name in node.names
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name


PLAN_NAME = "FSDP_PLANNER_PLAN"  # the export's constant holding its plan (``apply/torchtitan_parallelize.py``)
PLAN_TABLE = "fsdp_planner"  # the tables' key of that plan: {"plan": its JSON} (``JobConfig.plan``)
LOSS_TABLE = "fsdp_planner_loss"  # the tables' key of a ChunkedLossWrapper's chunks (``JobConfig.loss_chunks``)
EXPORTED_FN = "parallelize_fn"  # the export's function that applies it


def _model(data: dict[str, Any], spec: Any, models: dict[str, str], label: str, notes: list[str],
           plan: str | None = None) -> None:
    if spec is None:
        return
    flavor = (spec.args[0] if spec.args else spec.fields.get("flavor")) if isinstance(spec, Call) else None
    if not (isinstance(spec, Call) and spec.kind in models and isinstance(flavor, str)):
        shown = spec.source if isinstance(spec, Unread) else spec.name if isinstance(spec, Call) else shown_json(spec)
        notes.append(f"model_spec = {shown} is not read (not model_registry(FLAVOR) with a literal flavour): give "
                     "MODEL")
        return
    model = models[spec.kind]
    defaults = {**MODEL_REGISTRY_DEFAULTS, **OWN_REGISTRY_DEFAULTS.get(model, {})}
    table: dict[str, Any] = {"flavor": flavor, **({"name": model} if model else {})}
    for key, value in spec.fields.items():
        if key == "parallelize_fn" and plan is not None and _shown(value) == EXPORTED_FN:
            data[PLAN_TABLE] = {"plan": plan}
            notes.append(f"model_spec.parallelize_fn = {EXPORTED_FN} is this file's (fsdp-planner's export): the "
                         f"job's figures are of its plan ({PLAN_NAME}), its groups, checkpointing and layout")
        elif key == "parallelize_fn":  # (fsdp-planner's export sets its plan's groups so)
            notes.append(f"model_spec.parallelize_fn = {_shown(value)} is not read: these figures are of "
                         "torchtitan's own groups for the job's keys, not of that function's (an fsdp-planner "
                         "export's: simulate its plan file for them)")
        elif key not in ("converters", "flavor") and defaults.get(key, Unread("")) != value:
            notes.append(f"model_registry's {key} = {_shown(value)} is left out: fsdp-planner builds the "
                         "flavour's own model")
    for conv in spec.fields.get("converters") or []:
        if isinstance(conv, Call) and conv.kind == "Float8LinearConverter":
            table["converters"] = ["float8"]  # the TOML reader's form: model.converters and a [float8] table
            data["float8"] = _literals(conv, label, notes)
        else:
            notes.append(f"model_registry's converter {_shown(conv)} is left out: fsdp-planner simulates "
                         "the model without converters, in the mixed precision's dtype")
    data["model"] = table


def _shown(value: Any) -> str:
    if isinstance(value, Unread):
        return value.source
    if isinstance(value, Call):
        return f"{value.name}(...)"
    return shown_json(value)


def _section(name: str, value: Any, label: str, notes: list[str]) -> dict[str, Any]:
    """A dataclass call's literal keywords; one the job depends on that is not a literal is an error."""
    if not isinstance(value, Call):
        raise PlannerError(f"{label}: {name} = {_shown(value)} is not read: give {SECTION_CLASSES[name]}(...) of "
                           "literals")
    table = {}
    for key, v in value.fields.items():
        if isinstance(v, (Unread, Call)) or (isinstance(v, list) and any(isinstance(e, (Unread, Call)) for e in v)):
            if key in READ[name]:
                raise PlannerError(f"{label}: {name}.{key} = {_shown(v)} is not a literal: fsdp-planner reads the job "
                                   f"without running it (give the value, or the flag -- --{name}.{key} VALUE)")
            notes.append(f"{name}.{key} = {_shown(v)} is not read (not a literal; it does not change a step "
                         "here)")
            continue
        if key not in NEW_KEYS[name]:  # the TOML's key (or one it names as unknown)
            table[AC_RENAMED.get(key, key)] = v
        elif NEW_KEYS[name][key] and v:
            notes.append(f"{name}.{key} = {shown_json(v)} is left out: {NEW_KEYS[name][key]}")
        elif (name, key) in SIMULATED_AS and v != SIMULATED_AS[name, key][0]:
            notes.append(f"{name}.{key} = {shown_json(v)} is left out: {SIMULATED_AS[name, key][1]}")
    return table


FLOAT8_READ = ("enable_fsdp_float8_all_gather", "recipe_name")  # what changes the step: literals only


def _literals(conv: Call, label: str, notes: list[str]) -> dict[str, Any]:
    """``Float8LinearConverter.Config(...)``'s literal keywords, as the TOML's ``[float8]`` table; a setting the
    step depends on that is not a literal is an error. ``model_compile_enabled`` follows ``compile`` (read there)."""
    table = {}
    for key, v in conv.fields.items():
        if isinstance(v, (Unread, Call)) or (isinstance(v, list) and any(isinstance(e, (Unread, Call)) for e in v)):
            if key in FLOAT8_READ:
                raise PlannerError(f"{label}: Float8LinearConverter's {key} = {_shown(v)} is not a literal: "
                                   "fsdp-planner reads the job without running it (give the value)")
            if key != "model_compile_enabled":
                notes.append(f"Float8LinearConverter's {key} = {_shown(v)} is not read (not a literal)")
            continue
        table[key] = v
    return table


def _no_ac_mode(value: Any, label: str) -> None:
    """A checkpointing class given the TOML form's ``mode`` in the job's code (a new user's ``SelectiveAC.Config(mode=
    "op")`` was told to drop a --activation_checkpoint.mode flag it never gave)."""
    if isinstance(value, Call) and value.kind in AC_CLASSES and "mode" in value.fields:
        raise PlannerError(f"{label}: {value.kind}.Config has no field mode (the TOML form's activation_checkpoint."
                           "mode): the class is the mode, SelectiveAC.Config() op-level, FullAC.Config() every block "
                           "in full, MemoryBudgetAC.Config(), or None")


def _ac(value: Any, label: str, notes: list[str]) -> dict[str, Any]:
    if value is None:
        return {"mode": "none"}
    if not isinstance(value, Call) or value.kind not in AC_CLASSES:
        raise PlannerError(f"{label}: activation_checkpoint = {_shown(value)} is not SelectiveAC.Config(), "
                           "FullAC.Config(), MemoryBudgetAC.Config() or None")
    bad = next((key for key in value.fields if key not in AC_FIELDS[value.kind] and key != "mode"), None)
    if bad is not None:
        why = " (torchtitan's checkpoint wrapper runs early_stop=False)" if bad == "early_stop" else \
            " (the class is the mode: SelectiveAC is op-level, FullAC every block in full)" \
            if bad == "selective_ac_option" else ""
        raise PlannerError(f"{label}: {value.kind}.Config has no field {bad}{why}; its fields are "
                           f"{', '.join(AC_FIELDS[value.kind])}")
    table = _section("activation_checkpoint", value, label, notes)
    if "mode" in table:  # the TOML's key, set by a flag: the registry's job picks a class instead
        raise PlannerError(f"{label}: --activation_checkpoint.mode is the TOML form's key; a registry job picks the "
                           "class: give activation-checkpoint:full (or :selective, :memory-budget, :none)")
    return {**table, **AC_CLASSES[value.kind]}


# what ``optimizer=`` is read from: torchtitan's helper, its container's config, a flag's section (``_set``)
OPTIMIZER_CALLS = ("default_adamw", "OptimizersContainer", "optimizer")


def _optimizer(value: Any, label: str, notes: list[str]) -> dict[str, Any]:
    """``optimizer=`` as the TOML's ``[optimizer]`` table: ``default_adamw(...)`` (AdamW) or
    ``OptimizersContainer.Config(implementation=..., param_groups=[ParamGroupConfig(optimizer_name=...), ...])``;
    the container's ``implementation`` (default "fused") applies to every group unless a group's optimizer keywords
    (``default_adamw``'s own) set ``fused`` or ``foreach``. Groups of several optimizers: the first's, with a note;
    a value not read: torchtitan's default, with a note."""
    if not isinstance(value, Call) or (value.kind not in OPTIMIZER_CALLS and "implementation" not in value.fields):
        notes.append(f"optimizer = {_shown(value)} is not read: simulated as torchtitan's default, fused AdamW")
        return {}
    table: dict[str, Any] = {}
    if "implementation" in value.fields:
        how = value.fields["implementation"]
        if not isinstance(how, str):
            raise PlannerError(f"{label}: optimizer.implementation = {_shown(how)} is not a literal: fsdp-planner "
                               "reads the job without running it (give the value, or the flag -- "
                               "--optimizer.implementation VALUE)")
        table["implementation"] = how
    groups = value.fields.get("param_groups")
    if value.kind == "default_adamw":
        groups = [Call("ParamGroupConfig", fields={"optimizer_name": "AdamW", "optimizer_kwargs": value.fields})]
    elif groups is not None and not isinstance(groups, list):
        notes.append(f"optimizer's param_groups = {_shown(groups)} is not read (not a list): simulated as AdamW")
    named = [g for g in groups if isinstance(g, Call) and "optimizer_name" in g.fields] \
        if isinstance(groups, list) else []
    if not named:
        return table
    names = [_shown(g.fields["optimizer_name"]) for g in named]
    if len(set(names)) > 1:
        notes.append(f"optimizer's param groups run {', '.join(names)}: simulated as the first's")
    first = named[0].fields["optimizer_name"]
    table["name"] = first if isinstance(first, str) else _shown(first)
    kwargs = named[0].fields.get("optimizer_kwargs")
    if isinstance(kwargs, dict) and (kwargs.get("fused") is True or kwargs.get("foreach") is True):
        table["implementation"] = "fused" if kwargs.get("fused") is True else "foreach"
    return table


def default_tokens() -> tuple[int, int]:
    """(batch, seq) of TrainingConfig's default token counts: what torchtitan runs for a job that gives none."""
    seq = TOKEN_DEFAULTS["max_context_length"]
    return TOKEN_DEFAULTS["num_tokens_per_microbatch_per_dp_rank"] // seq, seq


def _check_tokens(key: str, v: Any, label: str) -> None:
    """One of ``TOKENS``: a whole number, bounded (the step's: the micro-batch's bound times the micro-batches and
    the world, checked again once they are sequences); the step's -1 is one micro-batch a step."""
    top = MAX_SEQ if key == "max_context_length" else MAX_TOKENS if key == TOKENS[0] else MAX_TOKENS << 24
    if isinstance(v, bool) or not isinstance(v, int) or not (1 <= v <= top or (v == -1 and key == TOKENS[2])):
        raise PlannerError(f"{label}: training.{key} = {shown_json(v)} is not a whole number from 1 to {top:,}"
                           + (" (or -1: one micro-batch a step)" if key == TOKENS[2] else ""))


def _tokens(training: dict[str, Any], label: str, notes: list[str]) -> dict[str, Any]:
    """The token counts as sequences: per GPU (local_batch_size), their length (seq_len) and per step
    (global_batch_size); a job that gives neither count runs TrainingConfig's defaults (``default_tokens``), which
    --batch and --seq replace; a count it leaves out beside one it gives is TrainingConfig's default, said in a
    note."""
    given = {k: training.pop(k) for k in TOKENS if k in training}
    if not given:
        return training
    left = [k for k in TOKENS[:2] if k not in given]
    if left:  # (torchtitan fills them in; the step's sequences need their length)
        notes.append(f"{' and '.join(f'training.{k}' for k in left)} {'is' if len(left) == 1 else 'are'} not "
                     f"given: TrainingConfig's default{'s' if len(left) > 1 else ''}, "
                     f"{' and '.join(f'{TOKEN_DEFAULTS[k]:,}' for k in left)}, as torchtitan runs it")
    old = [k for k in ("local_batch_size", "seq_len", "batch_size", "global_batch_size") if k in training]
    if old:  # a flag of the TOML form: the token counts below would replace it without a word
        raise PlannerError(f"{label}: training.{old[0]} is the TOML form's key; this registry job counts tokens: "
                           "give --training.num_tokens_per_microbatch_per_dp_rank (sequences x length per GPU) "
                           "and --training.max_context_length")
    n = {k: given.get(k, TOKEN_DEFAULTS[k]) for k in TOKENS}
    for key, v in n.items():
        _check_tokens(key, v, label)
    seq = n["max_context_length"]
    for key in (TOKENS[0], TOKENS[2]):
        if n[key] != -1 and n[key] % seq:
            default = "" if key in given else " (TrainingConfig's default)"
            raise PlannerError(f"{label}: training.{key} = {n[key]:,}{default} is not a multiple of "
                               f"training.max_context_length = {seq:,}: fsdp-planner simulates whole sequences")
    training.update(local_batch_size=n[TOKENS[0]] // seq, seq_len=seq)
    if n[TOKENS[2]] != -1:
        training["global_batch_size"] = n[TOKENS[2]] // seq
    return training
