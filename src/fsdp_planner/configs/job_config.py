"""The training job a torchtitan TOML (or a torchtitan config_registry job, read into the TOML's tables by
``configs/torchtitan_registry.py``) or an Accelerate FSDP YAML describes, read into the settings the command line
has (``--from-torchtitan``, ``--from-accelerate``): the model (torchtitan), the workload, the data-parallel layout,
the grouping policy, activation checkpointing, ``reshard_after_forward``, mixed precision, offload and torchtitan's
``compile.enable`` (``--compile``).

What the file asks for that fsdp-planner does not model (float8, tensor/pipeline/context parallel)
is one note each, naming the key; a value it cannot read is one error naming the key. Values quoted from the file
pass ``shown_json``. Torch-free: the reading is checked before anything is traced.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_planner.choices import TITAN_RECOMPUTE_FQNS, ACMode, PolicyName
from fsdp_planner.configs.torchtitan_registry import (
    LOSS_TABLE,
    PLAN_TABLE,
    TOKENS,
    bare_flags_said,
    default_tokens,
    is_registry_spec,
    parse_flags,
    read_registry,
    titan_model,
    with_overrides,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.limits import MAX_BATCH, MAX_EP_DEGREE, MAX_SEQ
from fsdp_planner.userfiles import MAX_CONFIG_BYTES, parse_yaml, read_text, shown_json, shown_key

TORCHTITAN, ACCELERATE = "torchtitan", "accelerate"
NO_WRAP_NUMEL = 10**15  # NO_WRAP: no module reaches it, so the size policy leaves every param to the root
ACCELERATE_MIN_NUM_PARAMS = 100_000_000  # Accelerate's fsdp_min_num_params default (FSDP1's)

# Sections of a torchtitan job that do not change one training step's time or memory.
TITAN_IGNORED = {"job", "profiling", "metrics", "logging", "checkpoint", "lr_scheduler", "validation", "comm",
                 "fault_tolerance", "experimental", "memory_estimation"}
# Accelerate keys that do not change one step (loading, saving, launching).
ACCELERATE_IGNORED = {"compute_environment", "debug", "machine_rank", "main_training_function", "rdzv_backend",
                      "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "enable_cpu_affinity",
                      "main_process_ip", "main_process_port", "gpu_ids", "downcast_bf16", "distributed_type",
                      "fsdp_cpu_ram_efficient_loading", "fsdp_state_dict_type", "fsdp_sync_module_states",
                      "fsdp_use_orig_params", "fsdp_backward_prefetch", "fsdp_forward_prefetch"}
TITAN_RESHARD = ("default", "always", "never")
# The keys torchtitan's JobConfig has in the sections read here: those not read change nothing a step's time or
# memory depends on here (or are noted where read); a key outside them is one note (a typo would otherwise be
# silently left at its default).
TITAN_SECTION_KEYS = {
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation", "fused",
                  "early_step_in_backward"},
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion",
              "print_model_summary"},
    "training": {"dataset", "dataset_path", "local_batch_size", "batch_size", "global_batch_size", "seq_len",
                 "max_norm", "steps", "enable_cpu_offload", "dtype", "mixed_precision_param",
                 "mixed_precision_reduce", "compile", "gc_freq", "gc_debug", "seed", "deterministic",
                 "debug_moe_force_load_balance", "warmup_steps", "tensor_parallel_degree",
                 "data_parallel_degree", "data_parallel_replicate_degree", "data_parallel_shard_degree",
                 "enable_async_tensor_parallel", "pipeline_parallel_degree", "context_parallel_degree",
                 "disable_cuda_graphs"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "enable_compiled_autograd", "tensor_parallel_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "pipeline_parallel_degree", "pipeline_parallel_split_points",
                    "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_microbatches",  # (torchtitan until #1073: its older TOMLs)
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
                    "pipeline_parallel_microbatch_size", "context_parallel_degree",
                    "context_parallel_rotate_method", "expert_parallel_degree", "expert_tensor_parallel_degree",
                    "enable_sequence_parallel"},  # (the Python config registry's ParallelismConfig)
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto",
                              "preserve_rng_state", "determinism_check", "debug"},
    "compile": {"enable", "components", "backend", "enable_async_tensor_parallel"},
}


@dataclass
class JobConfig:
    """A job's settings in the command line's terms (None: the file leaves it to the default)."""

    kind: str  # TORCHTITAN or ACCELERATE
    path: str
    model: str | None = None  # a built-in name (torchtitan only)
    model_label: str = ""  # the model as the file names it, for messages
    batch: int | None = None  # per-GPU batch of the optimizer step
    seq: int | None = None
    micro_batches: int = 1
    global_batch: int | None = None  # torchtitan's global_batch_size: the split is known once the world is
    default_workload: tuple[int, int] | None = None  # (batch, seq) torchtitan runs where the job gives neither
    # (TrainingConfig's token defaults; a TOML's local_batch_size and seq_len defaults, the same 8 x 2,048 then):
    # --batch and --seq replace them, where the job's own would conflict
    replicate: int = 1
    shard: int | None = None  # None: every GPU left (torchtitan's -1)
    tp: int = 1  # the tensor-parallel degree (torchtitan's tensor_parallel_degree, Accelerate's tp_size)
    loss_parallel: bool | None = None  # None: the layout's default (torchtitan's: on)
    async_tp: bool = False
    ep: int = 1  # torchtitan's expert_parallel_degree: EP's ranks taken from dp_shard (the --ep option)
    world: int | None = None  # Accelerate's num_processes
    nodes: int | None = None  # Accelerate's num_machines
    ac: ACMode | None = None
    reshard: str = "default"  # TITAN_RESHARD; "default": the policy's own choice
    precision: str | None = None
    reduce_dtype: str | None = None
    optimizer: str | None = None  # torchtitan's optimizer and its implementation, as --optimizer names them
    offload: bool = False
    cuda_graphs: bool = False  # torchtitan replays forward and backward as a CUDA graph (not disable_cuda_graphs)
    compile_loss: bool = False  # torchtitan's compile.enable with "loss" in compile.components: the loss compiled
    compile: bool = False  # torchtitan's compile.enable (or training.compile): every block torch.compile'd
    early_stop: bool | None = None  # torchtitan's checkpoint wrapper's early_stop (None: not checkpointed, or not
    # torchtitan's: torch's default)
    float8: str | None = None  # torchtitan's float8 converter: its recipe (--float8), None: bf16 matmuls
    float8_all_gather: bool = False  # its enable_fsdp_float8_all_gather (torchtitan's default: off)
    float8_tp_all_gather: bool = False  # torchao's float8 TP styles: a TOML's tensorwise float8 under TP (below)
    policy: PolicyName = PolicyName.TITAN
    module_classes: tuple[str, ...] = ()
    min_numel: int | None = None
    keys: dict[str, Any] = field(default_factory=dict)  # dotted key -> value, each key read
    plan: str | None = None  # the plan JSON of an fsdp-planner export whose parallelize_fn the job keeps: its grouping
    notes: list[str] = field(default_factory=list)  # what is left out, one line each
    loss_chunks: int | None = None  # a registry job's ChunkedLossWrapper chunks (--loss-chunks; 0: none read, simulated
    # whole)
    loss_whole: bool = False  # a registry job names a whole-sequence loss (CrossEntropyLoss, or one chunk)

    @property
    def registry(self) -> bool:
        """A torchtitan config_registry job (``FILE.py:FUNCTION``), not a TOML."""
        return self.kind == TORCHTITAN and is_registry_spec(self.path)

    def key(self, name: str) -> str:
        """How the file spells the setting ``name`` (``ac``, ``reshard``, ``mesh``, ``offload``, ``policy``)."""
        if name == "ac" and self.registry:
            return "activation_checkpoint"  # a dataclass of its own in the registry form
        if name == "early_stop" and self.registry:  # no field: torchtitan's FullAC and SelectiveAC fix it
            return "activation_checkpoint (torchtitan's checkpoint wrapper, early_stop=False)"
        if name == "early_stop" and "activation_checkpoint.early_stop" not in self.keys:
            return "activation_checkpoint.early_stop (not given: false, torchtitan's default since #1580)"
        if name == "reshard" and self.fsdp1:  # (Accelerate's FSDP1 plugin reads its strategy first)
            return "fsdp_config.fsdp_sharding_strategy"
        return KEY_NAMES[self.kind][name]

    @property
    def fsdp1(self) -> bool:
        """An Accelerate config of FSDP1 (fsdp_version 1, its default)."""
        return self.kind == ACCELERATE and self.keys.get("fsdp_config.fsdp_version", 1) == 1


KEY_NAMES = {
    TORCHTITAN: {"ac": "activation_checkpoint.mode", "reshard": "parallelism.fsdp_reshard_after_forward",
                 "replicate": "parallelism.data_parallel_replicate_degree",
                 "shard": "parallelism.data_parallel_shard_degree", "offload": "training.enable_cpu_offload",
                 "policy": "(the grouping)", "compile": "compile.enable",
                 "compile_loss": "compile.enable with \"loss\" in compile.components",
                 "early_stop": "activation_checkpoint.early_stop", "ep": "parallelism.expert_parallel_degree",
                 "tp": "parallelism.tensor_parallel_degree"},
    ACCELERATE: {"ac": "fsdp_config.fsdp_activation_checkpointing",
                 "reshard": "fsdp_config.fsdp_reshard_after_forward",
                 "replicate": "parallelism_config.parallelism_config_dp_replicate_size",
                 "shard": "parallelism_config.parallelism_config_dp_shard_size",
                 "offload": "fsdp_config.fsdp_offload_params", "policy": "fsdp_config.fsdp_auto_wrap_policy",
                 "compile": "dynamo_config.dynamo_use_regional_compilation",
                 "ep": "(expert parallelism: Accelerate's parallelism_config has no degree for it)",
                 "tp": "parallelism_config.parallelism_config_tp_size"},
}


def read_config(kind: str, path: str, flags: Sequence[str] = ()) -> JobConfig:
    """The job ``path`` describes, as ``kind`` (TORCHTITAN or ACCELERATE) reads it; torchtitan's ``path`` is a TOML
    or a registry job (``FILE.py:FUNCTION``, ``configs/torchtitan_registry.py``), ``flags`` its dotted overrides."""
    with bare_flags_said(flags):
        return _read_config(kind, path, flags)


def _read_config(kind: str, path: str, flags: Sequence[str]) -> JobConfig:
    if kind == TORCHTITAN and is_registry_spec(path):
        data, notes = read_registry(path, parse_flags(flags))
        loss = data.pop(LOSS_TABLE, {})
        cfg = JobConfig(kind, path, notes=notes, plan=data.pop(PLAN_TABLE, {}).get("plan"),
                        loss_chunks=loss.get("chunks"), loss_whole=loss.get("whole", False))
        _titan(cfg, data)
        if cfg.batch is None and cfg.seq is None:
            cfg.default_workload = default_tokens()
        return cfg
    label = f"{kind} config '{path}'"
    if kind == TORCHTITAN and path.endswith(".py"):
        raise PlannerError(f"{label} is a Python file: name the function that returns its job, "
                           f"{path}:FUNCTION (torchtitan's config registry form)")
    text = read_text(path, label, "a torchtitan job TOML" if kind == TORCHTITAN else "an Accelerate config YAML",
                     MAX_CONFIG_BYTES)
    cfg = from_data(kind, path, _load(kind, text, label), flags)
    if kind == TORCHTITAN and (cfg.batch is None or cfg.seq is None):  # (JobConfig's Training defaults before
        # torchtitan's registry form, 9810191: local_batch_size 8, seq_len 2048)
        cfg.default_workload = TOML_TOKEN_DEFAULTS
    return cfg


def from_data(kind: str, path: str, data: Any, flags: Sequence[str] = ()) -> JobConfig:
    """The job a parsed config describes: ``data`` as a TOML or YAML parse of the file at ``path`` gives it, with
    torchtitan's dotted ``flags`` over it (a reader of another source of the same settings hands its dict here too)."""
    label = f"{kind} config '{path}'"
    if data is None or data == "":
        raise PlannerError(f"{label} is empty: expected "
                           f"{'a torchtitan job TOML' if kind == TORCHTITAN else 'an Accelerate config YAML'}")
    if not isinstance(data, dict):
        shape = "a list" if isinstance(data, list) else "a single value"
        raise PlannerError(f"{label} holds {shape}, not a table of settings (key: value lines)")
    cfg = JobConfig(kind, path)
    if kind == TORCHTITAN:
        _titan(cfg, with_overrides(data, parse_flags(flags)))
    else:
        _accelerate(cfg, data)
    cfg.notes = capped(cfg.notes)
    return cfg


MAX_NOTES = 20  # a file of a thousand unknown keys is said in 21 lines, not a thousand


def capped(notes: list[str]) -> list[str]:
    """The first ``MAX_NOTES`` notes, then one line counting the rest."""
    if len(notes) <= MAX_NOTES:
        return notes
    return [*notes[:MAX_NOTES], f"... and {len(notes) - MAX_NOTES:,} more notes like these (keys not read or left out)"]


def _load(kind: str, text: str, label: str) -> Any:
    if kind == TORCHTITAN:
        toml = _toml_reader()
        try:
            return toml.loads(text)
        except toml.TOMLDecodeError as e:
            raise PlannerError(f"{label} is not valid TOML: {e}") from None
        except RecursionError:
            raise PlannerError(f"{label} nests too deeply to read") from None
        except ValueError:  # Python refuses integers of more than 4300 digits
            raise PlannerError(f"{label} holds a number too long to read, over 4300 digits") from None
    return parse_yaml(text, label)  # safe_load: plain values only, nothing from the file runs; aliases bounded


def _toml_reader() -> Any:
    """Python 3.11's ``tomllib``, or on 3.10 the ``tomli`` package it came from."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise PlannerError("reading a torchtitan TOML needs Python 3.11 or newer, or the tomli package "
                               "(pip install tomli)") from None
    return tomllib


def _bad(cfg: JobConfig, key: str, value: Any, expected: str) -> PlannerError:
    return PlannerError(f"{cfg.kind} config '{cfg.path}': {key} = {shown_json(value)} is not {expected}")


def _int(cfg: JobConfig, key: str, value: Any, minimum: int = 1, maximum: int = 10**9, other: str = "") -> int:
    """``other``: the key's other legal values, said beside the range (torchtitan's -1 of a shard degree)."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise _bad(cfg, key, value, f"a whole number from {minimum} to {maximum:,}{other}")
    return value


def _str(cfg: JobConfig, key: str, value: Any, choices: tuple[str, ...], exact: bool = False) -> str:
    """One of ``choices``, in any case unless ``exact`` (torchtitan compares its strings as written and refuses
    any other spelling: "Never" was read as "never", a job torchtitan would not run; a new user's trial). A flag's
    ``none``, read as None (``torchtitan_registry._flag_value``: a TOML has no null), is the choice "none" where there
    is one (``-- --activation_checkpoint.mode none`` was refused as null: a trial)."""
    if value is None and "none" in choices:
        return "none"
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise _bad(cfg, key, value, f"one of {', '.join(choices)}")
    if exact and value != value.strip().lower():  # (" never" too: torchtitan compares the string as written)
        raise _bad(cfg, key, value, f"one of {', '.join(choices)}, in lowercase as torchtitan compares it (it "
                   "refuses any other spelling)")
    return value.strip().lower()


def _bool(cfg: JobConfig, key: str, value: Any) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise _bad(cfg, key, value, "true or false")
    return value


def _table(cfg: JobConfig, data: dict[str, Any], name: str) -> dict[str, Any]:
    section = data.get(name, {})
    if not isinstance(section, dict):
        raise _bad(cfg, f"[{name}]" if cfg.kind == TORCHTITAN else name, section,
                   "a table" if cfg.kind == TORCHTITAN else "a mapping of keys")
    return section


# -- torchtitan ------------------------------------------------------------------------------------------------------
TOML_TOKEN_KEYS = frozenset({"local_batch_size", "batch_size", "seq_len", "global_batch_size"})
TOML_TOKEN_DEFAULTS = (8, 2048)  # (training.local_batch_size, training.seq_len) a TOML job leaving them out runs


TITAN_READ = ("model", "training", "parallelism", "activation_checkpoint", "compile", "float8", "quantize", "mx",
              "optimizer")


def _titan(cfg: JobConfig, data: dict[str, Any]) -> None:
    sections = sorted(TITAN_IGNORED | set(TITAN_READ))
    near = [*sections, "loss"] if cfg.registry else sections  # (a registry job's loss, read before: the job's)
    for name in data:
        if name not in sections:
            shown = f"[{shown_key(name)}]"
            close = difflib.get_close_matches(name, near, n=1, cutoff=0.8) if len(name) <= 100 else []
            if close:  # (a registry job's Trainer.Config field, or a TOML table: torchtitan itself refuses it)
                raise PlannerError(f"{cfg.kind} config '{cfg.path}': {shown} is not a section of the job (did you "
                                   f"mean {close[0]}?): as written, its settings would stay at their defaults")
            cfg.notes.append(f"{shown} is not read: fsdp-planner does not know that section")
    for section, known in TITAN_SECTION_KEYS.items():
        # a registry job's token counts stand for the TOML's batch and sequence keys (read into them before here)
        near = (known - TOML_TOKEN_KEYS) | set(TOKENS) if cfg.registry and section == "training" else known
        for key in _table(cfg, data, section):
            elsewhere = [s for s, keys in TITAN_SECTION_KEYS.items() if s != section and key in keys]
            if key not in known and elsewhere:  # (a trial's [parallelism] enable_cpu_offload: a note easy to miss
                # beside a job simulated without the offload it asked for)
                cfg.notes.append(f"{section}.{shown_key(key)} is not read: [{section}] has no such key, "
                                 f"{elsewhere[0]}.{key} is one (a key in the wrong table stays at its default, and "
                                 "torchtitan refuses a table's unknown field)")
            elif key not in known:
                _unknown_key(cfg, f"[{section}]", key, near)
    _fault_tolerance(cfg, data.get("fault_tolerance"))
    _titan_model(cfg, _table(cfg, data, "model"))
    _titan_training(cfg, _table(cfg, data, "training"))
    _titan_optimizer(cfg, _table(cfg, data, "optimizer"))
    _titan_parallelism(cfg, _older_parallelism(cfg, _table(cfg, data, "training"), _table(cfg, data, "parallelism")))
    _titan_ac(cfg, _table(cfg, data, "activation_checkpoint"))
    if "enable_async_tensor_parallel" in _table(cfg, data, "compile"):  # where torchtitan's registry keeps it
        cfg.async_tp = _bool(cfg, "compile.enable_async_tensor_parallel",
                             _table(cfg, data, "compile")["enable_async_tensor_parallel"])
    compile_on = _table(cfg, data, "compile").get("enable") or _table(cfg, data, "training").get("compile")
    components = _components(cfg, _table(cfg, data, "compile").get("components", ["model", "loss"]))
    if compile_on and "model" not in components:
        cfg.notes.append(f"compile.components = {shown_json(components)} compiles no part of the model: its blocks "
                         "are simulated eager")
    elif compile_on:  # torchtitan compiles each transformer block (fullgraph): --compile
        key = "compile.enable" if "enable" in _table(cfg, data, "compile") else "training.compile"
        cfg.compile = cfg.keys[key] = _bool(cfg, key, compile_on)
    # the loss compiled (--compile-loss): compile.components, whose default holds it; the older training.compile
    # compiled the model alone
    if _table(cfg, data, "compile").get("enable") and "loss" in components:
        cfg.compile_loss = True
    _check_async_tp(cfg, _table(cfg, data, "compile"))
    _titan_float8(cfg, data)
    _titan_float8_tp(cfg)
    if _table(cfg, data, "mx"):
        cfg.notes.append("[mx] (MX formats) is left out: fsdp-planner simulates those matmuls in the mixed "
                         "precision's dtype")


COMPILE_COMPONENTS = ("model", "loss")  # what torchtitan's compile.components names (CompileConfig)


def _components(cfg: JobConfig, value: Any) -> list[str]:
    """``compile.components`` as a list of torchtitan's names: a flag's value (``--compile.components loss``,
    ``model,loss``, ``["loss"]``) or the file's list; anything else one error (a misspelled name compiled nothing,
    said as a note, and a bare flag compiled the model alone)."""
    items = re.findall(r"[^\s,\[\]'\"]+", value) if isinstance(value, str) else \
        list(value) if isinstance(value, tuple) else value  # (a registry's Python may give a tuple: it runs as one)
    if not isinstance(items, list) or not all(isinstance(v, str) and v in COMPILE_COMPONENTS for v in items):
        raise PlannerError(f"{cfg.kind} config '{cfg.path}': compile.components = {shown_json(value)} is not a list "
                           f"of torchtitan's components ({' and '.join(map(shown_json, COMPILE_COMPONENTS))})")
    return items


def _unknown_key(cfg: JobConfig, section: str, key: object, known: set[str]) -> None:
    """A key ``section`` (``[training]``, ``fsdp_config``) does not have: a note, or, a letter or so from a key it
    has, an error (the misspelled setting would stay at its default, and the verdict be about another job). A YAML
    key may be no string (``5:``, ``true:``, ``~:``): said as the file spells it."""
    shown = f"{section.strip('[]')}.{shown_key(key)}"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8) \
        if isinstance(key, str) and len(key) <= 100 else []
    if close:
        raise PlannerError(f"{cfg.kind} config '{cfg.path}': {shown} is not a key of {section} (did you mean "
                           f"{close[0]}?): as written, the setting would stay at its default")
    cfg.notes.append(f"{shown} is not read: fsdp-planner does not know it")


def _check_async_tp(cfg: JobConfig, compile_table: dict[str, Any]) -> None:
    """Refuse async TP without the model compiled: torchtitan's ``maybe_enable_async_tp``
    (torchtitan/distributed/tensor_parallel.py), called where TP is on, raises "Async TP requires 'model' in
    --compile.components and --compile.enable" unless ``compile.enable and "model" in compile.components``
    (components' default holds "model"): the overlap is an inductor pass over the compiled model."""
    model_compiled = cfg.compile and "model" in _components(cfg, compile_table.get("components", ["model"]))
    if cfg.async_tp and cfg.tp > 1 and not model_compiled:
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' turns on enable_async_tensor_parallel without compiling "
                           "the model, which torchtitan refuses (async TP needs compile.enable = true with \"model\" "
                           "in compile.components): compile the model or turn async TP off")


HEAD_NAMES = {"output", "lm_head"}  # torchtitan's Llama output head, as its float8 filter names it
FLOAT8_KEYS = {"enable_float8_linear", "enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
               "recipe_name", "filter_fqns", "emulate", "model_compile_enabled", "force_recompute_fp8_weight_in_bwd"}


def _titan_float8(cfg: JobConfig, data: dict[str, Any]) -> None:
    """torchtitan's float8 training, in each of its forms: ``model.converters`` naming float8 (or the old
    ``float8.enable_float8_linear``) with the settings in ``[float8]`` or ``[quantize.linear.float8]``, or the
    registry's ``Float8LinearConverter.Config(...)`` (read into ``[float8]``): ``--float8`` and its all-gather."""
    section, table = "float8", _table(cfg, data, "float8")
    quantize = _table(cfg, data, "quantize").get("linear", {})
    if isinstance(quantize, dict) and isinstance(quantize.get("float8"), dict):
        section, table = "quantize.linear.float8", quantize["float8"]
    converters = _table(cfg, data, "model").get("converters") or []
    named = isinstance(converters, list) and any(isinstance(c, str) and "float8" in c for c in converters)
    if not (named or table.get("enable_float8_linear")):
        return
    for key in table:
        if key not in FLOAT8_KEYS:
            cfg.notes.append(f"{section}.{shown_key(key)} is not read: fsdp-planner does not know it")
    # the converter's defaults: the registry's Float8LinearConverter.Config rowwise and no filter (b5bcd76's
    # components/quantization/float8.py), the TOML era's [float8] tensorwise and the output head filtered
    recipe = table.get("recipe_name") or ("rowwise" if cfg.registry else "tensorwise")
    # (the registry's converter takes the rowwise recipes only: torchtitan b5bcd76's Float8LinearConverter)
    recipes = ("rowwise", "rowwise_with_gw_hp") if cfg.registry else ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    if recipe not in recipes:
        raise _bad(cfg, f"{section}.recipe_name", recipe, " or ".join(recipes) + (
            " (torchtitan's registry converter has the rowwise recipes only)" if cfg.registry else ""))
    if _bool(cfg, f"{section}.emulate", table.get("emulate", False)):  # (torchtitan's float8 debug job's)
        cfg.keys[f"{section}.emulate"] = True
        cfg.notes.append(f"{section}.emulate runs float8 emulated, its matmuls in the compute dtype (for GPUs "
                         "without float8 tensor cores, and tests): simulated as the job without float8, its casts "
                         "not charged")
        return
    cfg.float8 = cfg.keys[f"{section}.recipe_name"] = "rowwise" if recipe.startswith("rowwise") else recipe
    if recipe == "rowwise_with_gw_hp":
        cfg.notes.append(f"{section}.recipe_name rowwise_with_gw_hp is read as rowwise: its weight-gradient matmul in "
                         "bf16 is not modelled")
    key = f"{section}.enable_fsdp_float8_all_gather"
    cfg.float8_all_gather = cfg.keys[key] = _bool(cfg, key, table.get("enable_fsdp_float8_all_gather", False))
    if cfg.float8_all_gather and not table.get("precompute_float8_dynamic_scale_for_fsdp", False):
        cfg.notes.append(f"{section}.precompute_float8_dynamic_scale_for_fsdp off is read as on: fsdp-planner "
                         "counts one amax all-reduce a step for the float8 all-gather")
    fqns = table.get("filter_fqns", [] if cfg.registry else ["output"])
    if not isinstance(fqns, list) or not fqns or set(fqns) - HEAD_NAMES:  # the head: "output", "lm_head" in newer
        # torchtitan
        cfg.notes.append(f"{section}.filter_fqns = {shown_json(fqns)} is read as the output head alone: "
                         "fsdp-planner keeps it in bf16 and converts every other Linear with float8-sized dims")


def _titan_float8_tp(cfg: JobConfig) -> None:
    """A TOML's tensorwise float8 under TP ran torchao's float8 TP styles: torchtitan applied them with every such
    job until its config-based sharding (April 2026, pytorch/torchtitan 1786292), and TOMLs are that time's form;
    its registries since gather TP's activations in bf16."""
    if cfg.registry or cfg.float8 != "tensorwise" or cfg.tp < 2:
        return
    cfg.float8_tp_all_gather = True
    cfg.notes.append("tensorwise float8 under TP is read as torchtitan ran TOML jobs: TP's activations all-gathered "
                     "in float8 by torchao's float8 TP styles (--float8-tp-all-gather; --no-float8-tp-all-gather "
                     "gathers them in bf16, as torchtitan's registry jobs since April 2026)")


def _titan_model(cfg: JobConfig, model: dict[str, Any]) -> None:
    name, flavor = model.get("name"), model.get("flavor")
    cfg.model_label = f"{shown_json(name)} flavor {shown_json(flavor)}" if name is not None or flavor is not None \
        else "(no model name or flavor)"
    cfg.keys["model.name"], cfg.keys["model.flavor"] = name, flavor
    if isinstance(name, str) and isinstance(flavor, str):
        cfg.model = titan_model(name, flavor)


def _fault_tolerance(cfg: JobConfig, ft: Any) -> None:
    """A section read past, but for a note where torchft runs (a trial's torchft job was read without a word)."""
    if isinstance(ft, dict) and ft.get("enable") is True:
        method = ft.get("semi_sync_method")
        cfg.notes.append("fault_tolerance.enable: torchft's replica groups are not modelled (their quorum and "
                         "cross-replica gradient all-reduce" + (f"; {shown_json(method)}'s outer optimizer and its "
                         "copy of the params" if isinstance(method, str) else "") + "): the figures are of one "
                         "replica group's step without them")


def _titan_training(cfg: JobConfig, training: dict[str, Any]) -> None:
    key = "local_batch_size" if "local_batch_size" in training else "batch_size"
    if key in training:
        cfg.batch = cfg.keys[f"training.{key}"] = _int(cfg, f"training.{key}", training[key], maximum=MAX_BATCH)
    if "seq_len" in training:
        cfg.seq = cfg.keys["training.seq_len"] = _int(cfg, "training.seq_len", training["seq_len"], maximum=MAX_SEQ)
    if "global_batch_size" in training and training["global_batch_size"] not in (-1, None):
        cfg.global_batch = _int(cfg, "training.global_batch_size", training["global_batch_size"])
        cfg.keys["training.global_batch_size"] = cfg.global_batch
    dtypes = ("bfloat16", "float32")
    param = _str(cfg, "training.mixed_precision_param", training.get("mixed_precision_param", "bfloat16"), dtypes,
                 exact=True)
    reduce = _str(cfg, "training.mixed_precision_reduce", training.get("mixed_precision_reduce", "float32"), dtypes,
                  exact=True)
    cfg.keys["training.mixed_precision_param"], cfg.keys["training.mixed_precision_reduce"] = param, reduce
    cfg.precision = "bf16-mixed" if param == "bfloat16" else "fp32"
    cfg.reduce_dtype = "bf16" if reduce == "bfloat16" and param == "bfloat16" else None
    if "dtype" in training and _str(cfg, "training.dtype", training["dtype"], dtypes, exact=True) == "bfloat16":
        # no fp32 copy of anything, but FSDP2 reduces the bf16 grads in mixed_precision_reduce (float32 unless the
        # job says bfloat16: its MixedPrecisionPolicy keeps a reduce dtype other than the param dtype, _fsdp_param
        # init_dtype_attrs), as torchtitan's parallelize passes it
        cfg.precision, cfg.reduce_dtype = "pure-bf16", "fp32" if reduce == "float32" else None
        cfg.keys["training.dtype"] = "bfloat16"
        reduced = "fp32 (mixed_precision_reduce)" if reduce == "float32" else "bf16"
        cfg.notes.append("training.dtype = bfloat16 is simulated as pure-bf16: params, grads and optimizer state in "
                         f"bf16, the gradient reduction in {reduced}")
    if "disable_cuda_graphs" in training:
        cfg.cuda_graphs = not _bool(cfg, "training.disable_cuda_graphs", training["disable_cuda_graphs"])
    if "enable_cpu_offload" in training:
        cfg.offload = cfg.keys["training.enable_cpu_offload"] = _bool(cfg, "training.enable_cpu_offload",
                                                                      training["enable_cpu_offload"])


TITAN_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adam"}  # torchtitan's names, as --optimizer names them
TITAN_IMPLEMENTATIONS = ("fused", "foreach", "for-loop", "fused_opt_states_bf16")
# each implementation as --optimizer's suffix (for-loop: foreach's bytes, noted): the one table both ways, read and
# export (``apply/torchtitan_job.IMPLEMENTATIONS``)
TITAN_SUFFIXES = {"foreach": "", "fused": "-fused", "fused_opt_states_bf16": "-fused-bf16-states"}


def _titan_optimizer(cfg: JobConfig, opt: dict[str, Any]) -> None:
    """torchtitan's optimizer, fused unless the job says otherwise: ``implementation`` (its default "fused" since
    early 2025), or the key it replaced, ``fused`` (default false then)."""
    name = opt.get("name", "AdamW")
    if not isinstance(name, str) or name not in TITAN_OPTIMIZERS:
        cfg.notes.append(f"optimizer.name = {shown_json(name)} is simulated as AdamW (fsdp-planner models SGD, Adam "
                         "and AdamW)")
        name = "AdamW"
    if "implementation" in opt:
        how = _str(cfg, "optimizer.implementation", opt["implementation"], TITAN_IMPLEMENTATIONS, exact=True)
    elif "fused" in opt:
        how = "fused" if _bool(cfg, "optimizer.fused", opt["fused"]) else "foreach"
    else:
        how = "fused"
    if how == "for-loop":
        cfg.notes.append("optimizer.implementation = for-loop is simulated as foreach: the same bytes; its "
                         "temporaries are one param's, not the shard's (the memory is an upper bound)")
    if opt.get("early_step_in_backward"):
        cfg.notes.append("optimizer.early_step_in_backward = true is left out: fsdp-planner steps the optimizer after "
                         "backward, each grad held until then (the memory is an upper bound)")
    cfg.keys["optimizer.name"], cfg.keys["optimizer.implementation"] = name, how
    cfg.optimizer = TITAN_OPTIMIZERS[name] + TITAN_SUFFIXES.get(how, "")


# torchtitan's older TOMLs (2024) set the parallel degrees under [training]; [parallelism] holds them since
TRAINING_PARALLELISM = {"data_parallel_degree": "data_parallel_shard_degree",
                        **{k: k for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                                          "tensor_parallel_degree", "enable_async_tensor_parallel",
                                          "pipeline_parallel_degree", "context_parallel_degree")}}


def _older_parallelism(cfg: JobConfig, training: dict[str, Any], par: dict[str, Any]) -> dict[str, Any]:
    """``par`` with the parallel degrees an older TOML sets under [training], each said in a note; one set in both
    places to different values is an error."""
    out = dict(par)
    for old, key in TRAINING_PARALLELISM.items():
        if old not in training:
            continue
        if key in out and out[key] != training[old]:
            raise PlannerError(f"training.{old} = {shown_json(training[old])} and parallelism.{key} = "
                               f"{shown_json(out[key])} disagree: give it in [parallelism] only")
        out[key] = training[old]
        cfg.notes.append(f"training.{old} is read as parallelism.{key} (torchtitan's older TOMLs set it under "
                         "[training])")
    return out


def _titan_parallelism(cfg: JobConfig, par: dict[str, Any]) -> None:
    replicate = par.get("data_parallel_replicate_degree", 1)
    cfg.replicate = cfg.keys["parallelism.data_parallel_replicate_degree"] = _int(
        cfg, "parallelism.data_parallel_replicate_degree", replicate)
    shard = par.get("data_parallel_shard_degree", -1)
    cfg.keys["parallelism.data_parallel_shard_degree"] = shard
    cfg.shard = None if shard == -1 else _int(cfg, "parallelism.data_parallel_shard_degree", shard,
                                              other=", or -1 (the GPUs the other degrees leave)")
    if "fsdp_reshard_after_forward" in par:
        cfg.reshard = cfg.keys["parallelism.fsdp_reshard_after_forward"] = _str(
            cfg, "parallelism.fsdp_reshard_after_forward", par["fsdp_reshard_after_forward"], TITAN_RESHARD, exact=True)
    cfg.tp = cfg.keys["parallelism.tensor_parallel_degree"] = _int(
        cfg, "parallelism.tensor_parallel_degree", par.get("tensor_parallel_degree", 1))
    if "disable_loss_parallel" in par:
        cfg.loss_parallel = not _bool(cfg, "parallelism.disable_loss_parallel", par["disable_loss_parallel"])
    if "enable_async_tensor_parallel" in par:
        cfg.async_tp = _bool(cfg, "parallelism.enable_async_tensor_parallel", par["enable_async_tensor_parallel"])
    for key, what in (("pipeline_parallel_degree", "pipeline parallelism"),
                      ("context_parallel_degree", "context parallelism")):
        refuse_other_job(cfg, f"parallelism.{key}", par.get(key, 1), what)
    if cfg.tp > 1 and not _bool(cfg, "parallelism.enable_sequence_parallel", par.get("enable_sequence_parallel", True)):
        # without SP each block's norms run on whole activations, held whole on every TP rank: 8x the SP job's
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' sets parallelism.enable_sequence_parallel = false: "
                           "fsdp-planner models torchtitan's TP with sequence parallelism only (without it each "
                           "block's norms and residuals are whole on every TP rank), so its verdict would be about "
                           "another job (set it to true)")
    cfg.ep = cfg.keys["parallelism.expert_parallel_degree"] = _int(
        cfg, "parallelism.expert_parallel_degree", par.get("expert_parallel_degree", 1), maximum=MAX_EP_DEGREE)
    etp = par.get("expert_tensor_parallel_degree", 1)  # earlier torchtitan's: EP's ranks span TP's only at 1
    if cfg.registry and "expert_tensor_parallel_degree" in par:  # (a new user's trial: read past in silence)
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' sets parallelism.expert_tensor_parallel_degree, which "
                           "torchtitan's ParallelismConfig no longer has (removed in April 2026, c4b409a: torchtitan "
                           "would refuse the job): drop it (EP's ranks span the TP ranks; without EP the experts are "
                           "tensor-parallel)")
    if cfg.ep > 1 and etp not in (1, cfg.tp):  # (torchtitan checks it under EP only: without, it has no effect)
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' sets parallelism.expert_tensor_parallel_degree = "
                           f"{shown_json(etp)} with tensor_parallel_degree {cfg.tp}: torchtitan takes 1 or the TP "
                           "degree only, and refuses the job")
    if etp != 1 and cfg.ep > 1 and cfg.tp > 1:
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' sets parallelism.expert_tensor_parallel_degree = "
                           f"{shown_json(etp)}: with expert parallelism fsdp-planner models expert TP 1 only (EP's "
                           "ranks spanning the TP ranks, torchtitan's default; without EP the experts are "
                           "tensor-parallel), so its verdict would be about another job (set it to 1)")


def refuse_other_job(cfg: JobConfig, key: str, degree: Any, what: str) -> None:
    """Context or pipeline parallelism above 1: not modelled, so any verdict would be about another job."""
    if degree == -1 and cfg.kind == TORCHTITAN:  # (read as 1 before: a new user's trial)
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' sets {key} = -1, which torchtitan refuses (-1, the rest "
                           "of the GPUs, is data_parallel_shard_degree's alone): set it to 1")
    if degree not in (1, -1, None):
        raise PlannerError(f"{cfg.kind} config '{cfg.path}' sets {key} = {shown_json(degree)}: fsdp-planner does "
                           f"not model {what} yet, so its verdict would be about another job (set it to 1 to plan "
                           "the job without it)")


def _titan_ac(cfg: JobConfig, ac: dict[str, Any]) -> None:
    if isinstance(ac.get("mode"), str) and ac["mode"].strip().lower() == "memory_budget":
        if cfg.registry:
            raise PlannerError(f"torchtitan config '{cfg.path}': activation_checkpoint = MemoryBudgetAC.Config() is "
                               "torch.compile's memory-budget checkpointing, which fsdp-planner does not model: give "
                               "SelectiveAC.Config(), FullAC.Config() or None")
        raise _bad(cfg, "activation_checkpoint.mode", ac["mode"], "none, full or selective (memory_budget is "
                   "torch.compile's checkpointing, which fsdp-planner does not model)")
    mode = _str(cfg, "activation_checkpoint.mode", ac.get("mode", "selective"), ("none", "full", "selective"),
                exact=True)
    cfg.keys["activation_checkpoint.mode"] = mode
    cfg.early_stop = _titan_early_stop(cfg, ac)  # (whatever the mode: an edit or auto may checkpoint, torchtitan's way)
    forced = ac.get("per_op_sac_force_recompute_mm_shapes_by_fqns", list(TITAN_RECOMPUTE_FQNS))
    if forced != list(TITAN_RECOMPUTE_FQNS):
        key = "force_recompute_mm_shapes_by_fqns" if cfg.registry else \
            "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns"
        cfg.notes.append(f"{key} = {shown_json(forced)} is not read: op-level checkpointing is simulated with "
                         "torchtitan's default, the mm of a Linear named moe.router.gate recomputed")
    if mode != "selective":
        cfg.ac = ACMode(mode)
        return
    if "selective_ac_option" not in ac:
        cfg.notes.append('activation_checkpoint.selective_ac_option is not given: taken as "op", torchtitan\'s '
                         'selective mode since its every-k-th-layer option was removed (older torchtitan defaulted '
                         'to "2": give it to simulate that)')
    option = ac.get("selective_ac_option", "op")
    cfg.keys["activation_checkpoint.selective_ac_option"] = option
    if option == "op":
        cfg.ac = ACMode.OP
    elif str(option) == "2":
        cfg.ac = ACMode.SELECTIVE  # every second block in full (torchtitan's removed layer-level option)
    else:
        raise _bad(cfg, "activation_checkpoint.selective_ac_option", option,
                   "'op' or 2 (every second block; fsdp-planner models no other layer interval)")


def _titan_early_stop(cfg: JobConfig, ac: dict[str, Any]) -> bool:
    """torchtitan checkpoints its blocks with ``early_stop=False`` since #1580 (August 2025): its TOMLs' key
    ``activation_checkpoint.early_stop`` defaults to it (a TOML of older torchtitan, which stopped early, says
    true to be simulated so), and its registry's FullAC and SelectiveAC fix it."""
    if "early_stop" in ac:
        cfg.keys["activation_checkpoint.early_stop"] = _bool(cfg, "activation_checkpoint.early_stop", ac["early_stop"])
        return cfg.keys["activation_checkpoint.early_stop"]
    return False


# -- Accelerate ------------------------------------------------------------------------------------------------------
def _accelerate(cfg: JobConfig, data: dict[str, Any]) -> None:
    fsdp = _table(cfg, data, "fsdp_config")
    if "distributed_type" not in data and "fsdp_config" not in data:  # another tool's YAML, or not a config at all
        raise PlannerError(f"accelerate config '{cfg.path}' has neither distributed_type: FSDP nor an fsdp_config "
                           "section: it is not an Accelerate FSDP config (accelerate config writes both)")
    kind = data.get("distributed_type", "FSDP")
    if kind != "FSDP":
        raise _bad(cfg, "distributed_type", kind, "FSDP (fsdp-planner plans FSDP jobs)")
    for name in data:
        if name not in ACCELERATE_IGNORED and name not in ACCELERATE_TOP_KEYS:
            close = difflib.get_close_matches(name, sorted(ACCELERATE_TOP_KEYS | ACCELERATE_IGNORED), n=1,
                                              cutoff=0.8) if isinstance(name, str) and len(name) <= 100 else []
            if close:  # a misspelled setting would stay at its default: another job
                raise PlannerError(f"accelerate config '{cfg.path}': {shown_key(name)} is not a key of the "
                                   f"config (did you mean {close[0]}?): as written, the setting would stay at its "
                                   "default")
            cfg.notes.append(f"{shown_key(name)} is not read: fsdp-planner does not know it")
    for name in fsdp:
        if name not in ACCELERATE_IGNORED and name not in ACCELERATE_FSDP_KEYS:
            _unknown_key(cfg, "fsdp_config", name, ACCELERATE_FSDP_KEYS | ACCELERATE_IGNORED)
    _accelerate_world(cfg, data)
    _accelerate_wrap(cfg, fsdp)
    _accelerate_sharding(cfg, fsdp)
    if "fsdp_activation_checkpointing" in fsdp:
        on = _bool(cfg, "fsdp_config.fsdp_activation_checkpointing", fsdp["fsdp_activation_checkpointing"])
        cfg.keys["fsdp_config.fsdp_activation_checkpointing"] = on
        cfg.ac = ACMode.FULL if on else ACMode.NONE
    if "fsdp_offload_params" in fsdp:
        cfg.offload = cfg.keys["fsdp_config.fsdp_offload_params"] = _bool(
            cfg, "fsdp_config.fsdp_offload_params", fsdp["fsdp_offload_params"])
    _accelerate_precision(cfg, data)
    where, backend = "dynamo_config.dynamo_backend", _table(cfg, data, "dynamo_config").get("dynamo_backend", "NO")
    if "dynamo_backend" in data:  # older accelerate config files keep it at the top level
        where, backend = "dynamo_backend", data["dynamo_backend"]
    if isinstance(backend, str) and backend.upper() != "NO":
        dynamo = _table(cfg, data, "dynamo_config")
        regional = dynamo.get("dynamo_use_regional_compilation", False)
        if backend.upper() == "INDUCTOR" and regional is True:  # accelerate's compile_regions: each repeated
            # block compiled on its own, as --compile (torchtitan's per-block compile) models it
            cfg.compile = cfg.keys[KEY_NAMES[ACCELERATE]["compile"]] = True
        else:
            cfg.notes.append(f"{where} = {shown_json(backend)} is left out: fsdp-planner models torch.compile of "
                             "each repeated block (dynamo_use_regional_compilation: true with the INDUCTOR "
                             "backend), not of the whole model: these figures are eager FSDP2's")


ACCELERATE_TOP_KEYS = frozenset({"fsdp_config", "mixed_precision", "num_processes", "num_machines", "dynamo_config",
                                 "dynamo_backend", "parallelism_config", "fp8_config"})  # read (and ACCELERATE_IGNORED)
ACCELERATE_FSDP_KEYS = {"fsdp_version", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
                        "fsdp_min_num_params", "fsdp_reshard_after_forward", "fsdp_sharding_strategy",
                        "fsdp_activation_checkpointing", "fsdp_offload_params"}
CLASSES_KEY = "fsdp_config.fsdp_transformer_layer_cls_to_wrap"  # the classes a TRANSFORMER_BASED_WRAP wraps
FSDP1_PREFETCH_KEYS = ("fsdp_backward_prefetch", "fsdp_forward_prefetch")  # FSDP1's BackwardPrefetch, forward_prefetch
V1_STRATEGY_NUMBERS = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD",
                       5: "_HYBRID_SHARD_ZERO2"}  # torch's FSDP1 ShardingStrategy values
V1_STRATEGIES = {"FULL_SHARD": ("default", False), "SHARD_GRAD_OP": ("never", False),
                 "HYBRID_SHARD": ("default", True), "_HYBRID_SHARD_ZERO2": ("never", True)}  # (the reshard rule, and
# whether it replicates across machines; "default": every group but the root, as FSDP1 frees them)


def _accelerate_world(cfg: JobConfig, data: dict[str, Any]) -> None:
    if "num_processes" in data:
        cfg.world = cfg.keys["num_processes"] = _int(cfg, "num_processes", data["num_processes"])
    if "num_machines" in data:
        cfg.nodes = cfg.keys["num_machines"] = _int(cfg, "num_machines", data["num_machines"])
    if cfg.world and cfg.nodes and cfg.world % cfg.nodes:
        raise PlannerError(f"accelerate config '{cfg.path}': num_processes {cfg.world} is not a multiple of "
                           f"num_machines {cfg.nodes} (the GPUs of each machine)")
    par = _table(cfg, data, "parallelism_config")
    if par.get("parallelism_config_tp_size") is not None:
        cfg.tp = cfg.keys["parallelism_config.parallelism_config_tp_size"] = _int(
            cfg, "parallelism_config.parallelism_config_tp_size", par["parallelism_config_tp_size"])
    refuse_other_job(cfg, "parallelism_config.parallelism_config_cp_size", par.get("parallelism_config_cp_size", 1),
                     "context parallelism")
    refuse_other_job(cfg, "parallelism_config.parallelism_config_sp_size", par.get("parallelism_config_sp_size", 1),
                     "sequence parallelism (Accelerate's sp_size: DeepSpeed's ALST/Ulysses)")
    if par.get("parallelism_config_dp_replicate_size", 1) not in (1, None):
        cfg.replicate = _int(cfg, "parallelism_config.parallelism_config_dp_replicate_size",
                             par["parallelism_config_dp_replicate_size"])
    for name in par:  # a key no size reads is said, not dropped: an unprefixed size would silently leave TP out
        # (before the sizes' product: a misspelled size is said as such, not as a product short of the ranks)
        if name in ACCELERATE_PARALLELISM_KEYS or name in ACCELERATE_PARALLELISM_OPTIONS:
            continue
        said = shown_key(name)
        known = f"parallelism_config_{name}" if f"parallelism_config_{name}" in ACCELERATE_PARALLELISM_KEYS else None
        if not known:
            _unknown_key(cfg, "parallelism_config", name, ACCELERATE_PARALLELISM_KEYS)
            continue
        cfg.notes.append(f"parallelism_config.{said} is not read: Accelerate's config file spells it {known} "
                         "(ParallelismConfig's own argument name is not a config key here); this job is simulated "
                         "without it")
    _check_parallelism_size(cfg, par)


ACCELERATE_DIMS = ("dp_replicate", "dp_shard", "tp", "cp", "sp")  # ParallelismConfig's sizes (accelerate 1.16),
# whose product is its ranks
ACCELERATE_PARALLELISM_KEYS = {f"parallelism_config_{d}_size" for d in ACCELERATE_DIMS}
# the options of context and sequence parallelism `accelerate launch` also takes (accelerate 1.16's
# commands/launch.py): read past, their sizes above 1 refused
ACCELERATE_PARALLELISM_OPTIONS = {f"parallelism_config_{o}" for o in (
    "cp_backend", "cp_comm_strategy", "sp_backend", "sp_seq_length", "sp_seq_length_is_variable",
    "sp_attn_implementation")}


def _check_parallelism_size(cfg: JobConfig, par: dict[str, Any]) -> None:
    """Refuse a parallelism_config whose sizes do not multiply to num_processes (the job's processes, all machines
    together): Accelerate's ``ParallelismConfig._validate_accelerator`` raises "ParallelismConfig total_size (...)
    does not match num_processes (...)" unless ``total_size == accelerator.num_processes``, a total_size of 1 (no
    size given) taken as plain data parallelism over them all."""
    sizes = {d: par.get(f"parallelism_config_{d}_size") for d in ACCELERATE_DIMS}
    sizes = {d: 1 if v is None else _int(cfg, f"parallelism_config.parallelism_config_{d}_size", v)
             for d, v in sizes.items()}
    total = math.prod(sizes.values())
    if cfg.world and total != 1 and total != cfg.world:
        product = " x ".join(f"{d}_size {v}" for d, v in sizes.items())
        # a key no size reads (an unprefixed tp_size, said in a note) is why, often: name it here (a review)
        unread = [shown_key(k) for k in par
                  if k not in ACCELERATE_PARALLELISM_KEYS and k not in ACCELERATE_PARALLELISM_OPTIONS]
        why = f" ({', '.join(unread)} not read: the sizes' keys are parallelism_config_<dim>_size)" if unread else ""
        raise PlannerError(f"accelerate config '{cfg.path}': parallelism_config's {product} make {total} ranks, and "
                           f"num_processes is {cfg.world}, which Accelerate refuses (ParallelismConfig's total_size "
                           f"must match num_processes): make their product {cfg.world}{why}")


def _accelerate_wrap(cfg: JobConfig, fsdp: dict[str, Any]) -> None:
    policy = _str(cfg, "fsdp_config.fsdp_auto_wrap_policy", fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP"),
                  ("transformer_based_wrap", "size_based_wrap", "no_wrap"))
    cfg.keys["fsdp_config.fsdp_auto_wrap_policy"] = policy.upper()
    if policy == "transformer_based_wrap":
        cfg.policy = PolicyName.MODULE
        classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
        names = classes.split(",") if isinstance(classes, str) else classes or []
        if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
            raise _bad(cfg, CLASSES_KEY, classes, "class names")
        cfg.module_classes = tuple(n.strip() for n in names)
        cfg.keys[CLASSES_KEY] = ",".join(cfg.module_classes)
    elif policy == "size_based_wrap":
        cfg.policy = PolicyName.SIZE
        cfg.min_numel = _int(cfg, "fsdp_config.fsdp_min_num_params",
                             fsdp.get("fsdp_min_num_params", ACCELERATE_MIN_NUM_PARAMS))
        cfg.keys["fsdp_config.fsdp_min_num_params"] = cfg.min_numel
    else:  # NO_WRAP: one fully_shard, on the root
        cfg.policy, cfg.min_numel = PolicyName.SIZE, NO_WRAP_NUMEL
        if "fsdp_auto_wrap_policy" in fsdp:  # said so: a script may shard the model itself (an export's hook)
            cfg.notes.append("fsdp_auto_wrap_policy NO_WRAP is read as one FSDP group, the root: groups, HSDP or TP "
                             "that the training script applies itself (fsdp-planner's exported hook) are not in "
                             "the YAML; judge such a plan from its file (simulate MODEL --plan plan.json)")


def _v1_strategy(cfg: JobConfig, value: Any) -> str:
    """FSDP1's ShardingStrategy by name, or by number as Accelerate also takes it (1 FULL_SHARD ... 5
    _HYBRID_SHARD_ZERO2)."""
    number = value if isinstance(value, int) and not isinstance(value, bool) else \
        int(value) if isinstance(value, str) and value.strip().isdigit() else None
    if number is not None:
        value = V1_STRATEGY_NUMBERS.get(number, value)
    if not (isinstance(value, str) and value.strip().upper() in (*V1_STRATEGIES, "NO_SHARD")):
        raise _bad(cfg, "fsdp_config.fsdp_sharding_strategy", value, "one of FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, "
                   "_HYBRID_SHARD_ZERO2 (or their numbers 1, 2, 4, 5)")
    return value


def _fsdp2_notes(cfg: JobConfig, fsdp: dict[str, Any]) -> None:
    """What Accelerate's FSDP2 (fsdp_version 2, accelerate 1.16) runs otherwise than the keys' FSDP1 reading."""
    if cfg.policy is PolicyName.SIZE and cfg.min_numel != NO_WRAP_NUMEL:
        # fsdp2_prepare_auto_wrap_policy: the sum of a module's params > fsdp_min_num_params
        cfg.notes.append("Accelerate's FSDP2 SIZE_BASED_WRAP shards every module whose params exceed "
                         "fsdp_min_num_params, containers too, where FSDP1's rule (simulated here) recurses into "
                         "them: a ModuleList of blocks over the minimum makes its fully_shard raise (\"does not "
                         "support containers\"); TRANSFORMER_BASED_WRAP is the wrap its FSDP2 runs")
    if "fsdp_sharding_strategy" in fsdp:  # (FullyShardedDataParallelPlugin reads it for FSDP1 only)
        cfg.notes.append(f"fsdp_config.fsdp_sharding_strategy = {shown_json(fsdp['fsdp_sharding_strategy'])} is "
                         "FSDP1's, which Accelerate's FSDP2 (fsdp_version 2) does not read: its reshard after forward "
                         "is fsdp_reshard_after_forward (default true), its HSDP parallelism_config's "
                         "dp_replicate_size")


def _accelerate_sharding(cfg: JobConfig, fsdp: dict[str, Any]) -> None:
    version = fsdp.get("fsdp_version", 1)
    if isinstance(version, str) and version.strip() in ("1", "2"):  # (the launcher passes it through the
        # environment: FullyShardedDataParallelPlugin reads int(FSDP_VERSION), a quoted "2" alike)
        version = int(version)
    cfg.keys["fsdp_config.fsdp_version"] = version
    if version not in (1, 2):
        raise _bad(cfg, "fsdp_config.fsdp_version", version, "1 or 2")
    if version == 1:
        cfg.notes.append("fsdp_config.fsdp_version = 1 is simulated with FSDP2's semantics (fully_shard): FSDP1's "
                         "flat parameters gather the same bytes per unit")
        for key in FSDP1_PREFETCH_KEYS:  # known, but FSDP2 has no such switch: said, as it changes the overlap
            if key in fsdp:
                cfg.notes.append(f"fsdp_config.{key} = {shown_json(fsdp[key])} is FSDP1's: the step is simulated "
                                 "with FSDP2's default prefetching (backward one group ahead)")
    if version == 2:
        _fsdp2_notes(cfg, fsdp)
        _fsdp2_reshard(cfg, fsdp)
    else:
        _fsdp1_strategy(cfg, fsdp)


def _fsdp2_reshard(cfg: JobConfig, fsdp: dict[str, Any]) -> None:
    """FSDP2's fsdp_reshard_after_forward, a bool (default true): true is the wrap policy's own rule, as
    fsdp2_prepare_model shards the wrapped modules with it while its carved [final norm, output embedding] and the
    root stay unsharded after forward; false, every group."""
    value = fsdp.get("fsdp_reshard_after_forward")
    if value is None:
        return
    cfg.reshard = "default" if _bool(cfg, "fsdp_config.fsdp_reshard_after_forward", value) else "never"
    cfg.keys["fsdp_config.fsdp_reshard_after_forward"] = value


def _fsdp1_strategy(cfg: JobConfig, fsdp: dict[str, Any]) -> None:
    """FSDP1's sharding strategy: Accelerate's launcher passes fsdp_sharding_strategy (default FULL_SHARD), which
    its plugin reads before fsdp_reshard_after_forward (accelerate 1.16: launch.py, FullyShardedDataParallelPlugin).
    FULL_SHARD frees every unit but the root after forward (FSDP1's root keeps its params for backward)."""
    if "fsdp_reshard_after_forward" in fsdp:
        cfg.notes.append(f"fsdp_config.fsdp_reshard_after_forward = {shown_json(fsdp['fsdp_reshard_after_forward'])} "
                         "is not what FSDP1 runs: Accelerate's launcher passes fsdp_sharding_strategy (default "
                         "FULL_SHARD), which its plugin reads first; set that key")
    value = fsdp.get("fsdp_sharding_strategy")
    if value is None:
        return
    value = _v1_strategy(cfg, value)
    if value.strip().upper() == "NO_SHARD":
        raise _bad(cfg, "fsdp_config.fsdp_sharding_strategy", value, "a sharded strategy (NO_SHARD is DDP)")
    cfg.reshard, hybrid = V1_STRATEGIES[value.strip().upper()]
    if hybrid and (cfg.nodes or 1) > 1:  # HYBRID_SHARD: shard within a machine, replicate across machines
        if cfg.replicate not in (1, cfg.nodes):
            raise PlannerError(f"fsdp_config.fsdp_sharding_strategy = {value.strip()} replicates across the "
                               f"{cfg.nodes} machines and parallelism_config.parallelism_config_dp_replicate_size"
                               f" = {cfg.replicate}: they disagree, give one of them")
        cfg.replicate = cfg.nodes or 1
    cfg.keys["fsdp_config.fsdp_sharding_strategy"] = value


def _accelerate_precision(cfg: JobConfig, data: dict[str, Any]) -> None:
    mp = data.get("mixed_precision", "no")
    if mp is False:  # (YAML reads a bare no as false, which Accelerate's PrecisionType refuses too)
        raise PlannerError(f"accelerate config '{cfg.path}': mixed_precision is false: YAML reads a bare no so; write "
                           "'no' in quotes, as accelerate config writes it")
    mp = _str(cfg, "mixed_precision", mp if isinstance(mp, list | dict) else str(mp), ("no", "bf16", "fp16", "fp8"))
    cfg.keys["mixed_precision"] = mp
    cfg.precision = "fp32" if mp == "no" else "bf16-mixed"
    # FullyShardedDataParallelPlugin.set_mixed_precision: MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype),
    # FSDP1 and FSDP2 alike (accelerate 1.16)
    cfg.reduce_dtype = "bf16" if mp != "no" else None
    reduced = ("Accelerate's FSDP policy reduces the gradients in the param dtype, simulated so (--reduce-dtype "
               "bf16); the autocast it also runs the forward under is not modelled (the params are gathered in 16 bits "
               "already)")
    if mp == "bf16":
        cfg.notes.append(f"mixed_precision = bf16: {reduced}")
    if mp == "fp16":
        cfg.notes.append("mixed_precision = fp16 is simulated as bf16-mixed: the same bytes and FLOPs (no loss "
                         f"scaling modelled); {reduced}")
    _accelerate_float8(cfg, mp, data.get("fp8_config"), reduced)


# fp8_config's keys for torchao's backend (accelerate config writes them; ``AORecipeKwargs`` reads them from the
# launcher's ACCELERATE_FP8_* variables)
ACCELERATE_AO_KEYS = {"backend", "enable_fsdp_float8_all_gather", "pad_inner_dim"}


def _accelerate_float8(cfg: JobConfig, mp: str, fp8: Any, reduced: str) -> None:
    """``mixed_precision: fp8`` as Accelerate 1.16 runs it: its backend ``fp8_config.backend``, else torchao's where
    installed (``Accelerator``: AO before TE; ``NO`` names none). torchao's (``AORecipeKwargs``, ``_prepare_ao``)
    is ``--float8 tensorwise``: ``Float8LinearConfig(pad_inner_dim=True, enable_fsdp_float8_all_gather=...)``
    (default on), the scales precomputed after each optimizer step where the all-gather is on, every Linear
    converted but the model's first and last (``filter_first_and_last_linear_layers``) and those of a dim not a
    multiple of 16. Transformer Engine's is not modelled (bf16-mixed, said); FSDP1 with float8 neither."""
    if fp8 is not None and not isinstance(fp8, dict):
        raise _bad(cfg, "fp8_config", fp8, "a mapping (backend: AO, enable_fsdp_float8_all_gather: true, ...)")
    table = fp8 or {}
    if mp != "fp8":
        if table:
            cfg.notes.append(f"fp8_config is not read: mixed_precision = {mp}, so Accelerate trains without float8")
        return
    named = table.get("backend")
    # (NO, Accelerate's FP8BackendType for none named, or a null: torchao's where installed, as with no key)
    backend = "AO" if named is None or str(named).upper() == "NO" else str(named).upper()
    cfg.keys["fp8_config.backend"] = backend
    if backend != "AO" or cfg.fsdp1:
        why = "FSDP1 (fsdp_version 1)" if backend == "AO" else f"fp8_config.backend = {backend} (Transformer " \
            "Engine's float8, not torchao's)"
        cfg.notes.append(f"mixed_precision = fp8 under {why} is not modelled: simulated as bf16-mixed, the dtype of "
                         f"its all-gathers; {reduced}")
        return
    for key in table:
        if key not in ACCELERATE_AO_KEYS:
            cfg.notes.append(f"fp8_config.{shown_key(key)} is not read: torchao's backend does not take it")
    key = "fp8_config.enable_fsdp_float8_all_gather"
    cfg.float8 = "tensorwise"
    cfg.float8_all_gather = cfg.keys[key] = _bool(cfg, key, table.get("enable_fsdp_float8_all_gather", True))
    cfg.notes.append("mixed_precision = fp8 with torchao's backend (AO" + ("" if named is not None and
                                                                          str(named).upper() == "AO" else
                     ": fp8_config names none, and Accelerate takes torchao's where it is installed") +
                     "): torchao's tensorwise float8 of the Linears (--float8 tensorwise), their FSDP2 all-gather in "
                     f"float8 {'with precomputed scales' if cfg.float8_all_gather else 'off'}; Accelerate also "
                     "leaves the model's first Linear in bf16 (its last, the output head, is left so here too), "
                     f"simulated in float8; {reduced}")


def world_of(cfg: JobConfig, cluster_world: int | None) -> int | None:
    """The job's GPU count: the config's (dp_replicate x dp_shard, num_processes), else the cluster's."""
    if cfg.kind == ACCELERATE:
        return cfg.world or cluster_world
    if cfg.shard is not None:
        return cfg.replicate * cfg.shard * cfg.tp
    return cluster_world


REGISTRY_AC_MODES = (ACMode.NONE, ACMode.FULL, ACMode.OP)


def edit_choices(cfg: JobConfig) -> tuple[tuple[ACMode, ...], tuple[str, ...]]:
    """The checkpointing modes and ``reshard_after_forward`` rules the config's format can say (activation
    offloading is no option of these configs' checkpointing; Accelerate's rule is a bool)."""
    if cfg.registry:  # torchtitan's current checkpointing classes (None, FullAC, SelectiveAC): no every-k-th block
        return REGISTRY_AC_MODES, TITAN_RESHARD
    if cfg.kind == TORCHTITAN:
        return tuple(m for m in ACMode if m is not ACMode.OFFLOAD), TITAN_RESHARD
    return (ACMode.NONE, ACMode.FULL), ("default", "never")  # (true / FULL_SHARD: the policy's rule, the root kept)
