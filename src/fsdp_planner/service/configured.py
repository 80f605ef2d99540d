"""``--from-torchtitan JOB.toml`` / ``--from-accelerate CONFIG.yaml``: the job a config describes (``configs/``), as
the keywords the validator reads (``configured``) merged with what the user gave, and its ``reshard_after_forward``
rule on the plan (``adjusted``). A keyword the user gave that contradicts the config is one error naming both."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsdp_planner.choices import (
    DEFAULT_PRECISION,
    ACMode,
    AttentionKernel,
    ExpertPlacement,
    GradientSync,
    PolicyName,
    SacPolicy,
    ShardPlacement,
    ZeroGrad,
)
from fsdp_planner.configs.job_config import (
    ACCELERATE,
    CLASSES_KEY,
    NO_WRAP_NUMEL,
    TORCHTITAN,
    JobConfig,
    edit_choices,
    world_of,
)
from fsdp_planner.configs.torchtitan_registry import (
    PLAN_NAME,
    TITAN_DECODERS,
    TITAN_FUSED_ATTENTION,
    TITAN_MODELS,
    titan_model,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_time
from fsdp_planner.fsdp2.float8 import OUTPUT_HEAD_FQNS
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.hardware.cluster import MAX_GPUS_PER_NODE, MAX_WORLD_SIZE, parse_cluster
from fsdp_planner.models import BUILTINS, ModelSpec, takes_sequence
from fsdp_planner.planners.blocks import ClassesNotFound
from fsdp_planner.planners.config_edit import (
    Setting,
    best_edit,
    exported_setting,
    keeps_torchtitan_groups,
    plan_setting,
)
from fsdp_planner.service.outcome import PlanOutcome
from fsdp_planner.service.plan_files import load_plan
from fsdp_planner.service.planning import Reporter, Tracer, given_outcome, plan
from fsdp_planner.service.validate import Keywords, Spelling, plan_job
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import shown_json

_PRESET = re.compile(r"^\s*([a-z0-9]+)\s*$", re.I)
DEFAULT_GPU = "h100"
_CLI = Spelling.CLI  # a config is given on the command line: its errors name the options
TOKENS_KEY = "training.num_tokens_per_microbatch_per_dp_rank"  # the registry's batch, counted in tokens


class _Merge:
    """The keywords being built: the user's, with the config's settings added one at a time."""

    def __init__(self, kw: Keywords, cfg: JobConfig, note: Callable[[str], None]) -> None:
        self.values: dict[str, Any] = {f.name: getattr(kw, f.name) for f in dataclasses.fields(kw)}
        self.cfg, self.note = cfg, note
        self.gpus_searched = False

    def given(self, key: str, value: Any, config_key: str, default: Any = None) -> None:
        """The config's ``value`` for ``key`` unless the user gave another (an error)."""
        mine = self.values[key]
        if mine not in (default, value):
            given = f"{shown_json(value)} sequences of {self.cfg.seq:,} tokens" if config_key == TOKENS_KEY \
                and self.cfg.seq else f"{value} micro-batches a step" if key == "micro_batches" else \
                shown_json(value)  # (the key counts tokens, --batch sequences)
            raise PlannerError(f"{_CLI.name_of(key)} {shown_json(mine)} contradicts {config_key} in {self.cfg.kind} "
                               f"config '{self.cfg.path}' ({given}): drop one of them{self._override(key, mine)}")
        self.values[key] = value

    def _override(self, key: str, mine: Any) -> str:
        """How torchtitan's own command line sets the job's workload to the user's (fit's answers are replayed so:
        a new user's trial gave plan fit's batch with --batch and met the contradiction alone)."""
        cfg = self.cfg
        if cfg.kind != TORCHTITAN or not isinstance(mine, int):
            return ""
        if key == "batch" and not cfg.registry:
            return f", or set the job's own: -- --training.local_batch_size {mine}"
        if key == "batch" and cfg.seq:
            return f", or set the job's own: -- --{TOKENS_KEY} {mine * cfg.seq}"
        if key == "seq" and not cfg.registry:
            return f", or set the job's own: -- --training.seq_len {mine}"
        return ""

    def agrees(self, key: str, value: Any, config_key: str, default: Any = None) -> None:
        """An error where the user gave ``key`` another value than the config's ``value``, which is that key's
        default (so nothing is set: a command free to choose it, as ``plan``'s auto, stays free)."""
        mine = self.values[key]
        self.given(key, value, config_key, default)
        self.values[key] = mine


def configured(kw: Keywords, cfg: JobConfig, command: str, note: Callable[[str], None],
               plan_file: bool = False, gpus_searched: bool = False) -> Keywords:
    """``kw`` with the job the config describes, each of its notes said once. ``command``: the command it runs for
    (``simulate`` runs the config's own grouping); ``plan_file``: a plan file was given (it groups too);
    ``gpus_searched``: the command searches the GPU count (``fit --gpus auto``), so a config without one is not
    said to be planned for the cluster's."""
    for line in cfg.notes:
        note(line)
    merge = _Merge(kw, cfg, note)
    merge.gpus_searched = gpus_searched
    _model(merge)
    _workload(merge)
    _layout(merge)
    if not cfg.offload and command != "fit":  # (off, as the config says or leaves it: --offload would simulate
        # another job; fit's --offload asks what fits with it)
        merge.agrees("offload", False, cfg.key("offload") if cfg.key("offload") in cfg.keys else
                     f"{cfg.key('offload')} (not given: false)")
    _policy(merge, command, plan_file)
    if cfg.registry and cfg.plan is None and cfg.ac is ACMode.OP and kw.ac_policy not in (None, SacPolicy.TITAN.value):
        note(f"--ac-policy {kw.ac_policy} simulates the job's SelectiveAC (and op-level edits of it) with another save "
             "list than torchtitan runs (its list at b5bcd76: --ac-policy titan, the default)")
    if cfg.cuda_graphs:  # torchtitan clears grads with set_to_none=disable_cuda_graphs (trainer.py at b5bcd76)
        merge.given("zero_grad", ZeroGrad.ZEROS.value, "training.disable_cuda_graphs = False",
                    default=ZeroGrad.NONE.value)
        note("torchtitan's CUDA graphs (training.disable_cuda_graphs = False) clear the grads with "
             "zero_grad(set_to_none=False): the sharded grads are kept all step, simulated as --zero-grad zeros (the "
             "graph's own memory pool is not modelled)")
    if cfg.early_stop is not None and cfg.plan is None:  # torchtitan's checkpoint wrapper: an edit or auto
        # checkpoints as it does (an export's parallelize_fn checkpoints as its plan says)
        merge.given("early_stop", cfg.early_stop, cfg.key("early_stop"), default=None)
    return Keywords(**merge.values)


def _model(m: _Merge) -> None:
    cfg, model = m.cfg, m.values["model"]
    if cfg.kind != TORCHTITAN:
        return
    decoder = _decoder(cfg.keys.get("model.name"), cfg.keys.get("model.flavor"))
    if model is not None:
        if cfg.model is not None and model != cfg.model:
            raise PlannerError(f"MODEL '{model}' is not the torchtitan job's model ({cfg.model_label} is "
                               f"{cfg.model}): leave MODEL out, or give the config's model")
        if model == decoder:
            m.note(f"MODEL {model} is the text decoder of the torchtitan job's multimodal model {cfg.model_label}: "
                   "its vision encoder's params and work are left out")
        elif cfg.model is None and (cfg.keys.get("model.name") or cfg.keys.get("model.flavor")):
            m.note(f"MODEL {shown_json(model)} stands for the torchtitan job's model {cfg.model_label}")
        _attention(m)
        return
    if cfg.model is None and not (cfg.keys.get("model.name") or cfg.keys.get("model.flavor")):
        where = "[model] name and flavor" if cfg.path.endswith(".toml") else "model_spec = model_registry(FLAVOR)"
        raise PlannerError(f"the torchtitan config {shown_json(cfg.path)} names no model ({where}): give MODEL")
    if cfg.model is None and decoder is not None:
        raise PlannerError(f"the torchtitan job's model {cfg.model_label} is multimodal (a vision encoder beside its "
                           f"text decoder), and fsdp-planner builds its text decoder only, as {decoder}: give "
                           f"{decoder} as MODEL to plan the job without the vision encoder's params and work")
    if cfg.model is None:
        flavours: dict[str, list[str]] = {}
        for n, f in _titan_models():
            flavours.setdefault(n, []).append(f)
        known = ", ".join(f"{n} {'/'.join(fs)}" for n, fs in flavours.items())
        raise PlannerError(f"the torchtitan job's model {cfg.model_label} is not one fsdp-planner builds (known: "
                           f"{known}); give your model as MODEL, e.g. hf:path/config.json or path/model.py:build")
    m.values["model"] = cfg.model
    if cfg.model.startswith("hf:"):
        m.note(f"the torchtitan job's model {cfg.model_label} is simulated as {cfg.model} (transformers' modules, "
               "the same architecture numbers)")
    _attention(m)


def _decoder(name: object, flavor: object) -> str | None:
    """The shipped text decoder of torchtitan's multimodal ``name`` / ``flavor`` (None: none)."""
    return titan_model(name, flavor, TITAN_DECODERS) if isinstance(name, str) and isinstance(flavor, str) else None


def _attention(m: _Merge) -> None:
    """torchtitan's attention is fused (flex or varlen) where transformers' model of the same numbers runs eager."""
    if m.values["model"] in TITAN_FUSED_ATTENTION and m.values["attention"] is None:
        m.values["attention"] = AttentionKernel.FLASH.value
        m.note(f"attention planned as --attention flash: torchtitan runs {m.values['model']}'s with flex or varlen "
               "attention (fused, O(seq) saved), where transformers' own runs eager; its sliding windows are "
               "charged as full causal attention (an upper bound on those layers' FLOPs)")


def _titan_models() -> list[tuple[str, str]]:
    return [k for k, v in TITAN_MODELS.items() if v in BUILTINS or v.startswith("hf:")]


def _workload(m: _Merge) -> None:
    cfg = m.cfg
    registry = cfg.registry  # torchtitan's current keys
    batch_key = TOKENS_KEY if registry else \
        "training.local_batch_size" if cfg.kind == TORCHTITAN else "batch"
    seq_key = "training.max_context_length" if registry else "training.seq_len"
    # a job's token counts say nothing of a model without a sequence (a CNN): said as the job's, not as --seq
    sequence = cfg.kind != TORCHTITAN or (cfg.seq is None and cfg.default_workload is None) or \
        takes_sequence(m.values["model"])
    if cfg.seq is not None and not sequence:
        counts = f"counts its micro-batch in tokens, in sequences of {cfg.seq:,} ({seq_key})" if registry else \
            f"runs sequences of {cfg.seq:,} tokens ({seq_key})"
        raise PlannerError(f"the torchtitan job '{cfg.path}' {counts}, and the model {m.values['model']} takes no "
                           "sequence (its factory has no seq_len keyword): give a job without token counts for it, "
                           "or the model the job trains")
    if cfg.default_workload is not None:
        _default_workload(m, *cfg.default_workload, sequence)
    if cfg.batch is not None:
        m.given("batch", cfg.batch, batch_key)
    if cfg.seq is not None:
        m.given("seq", cfg.seq, seq_key)
    if cfg.precision is not None:
        m.given("precision", cfg.precision, "the mixed precision", DEFAULT_PRECISION)
    if cfg.reduce_dtype is not None:
        m.given("reduce_dtype", cfg.reduce_dtype,
                "training.mixed_precision_reduce" if cfg.kind == TORCHTITAN else "mixed_precision")
    elif cfg.keys.get("training.mixed_precision_reduce") == "float32":
        m.agrees("reduce_dtype", "fp32", "training.mixed_precision_reduce")
    if cfg.optimizer is not None:
        m.given("optimizer", cfg.optimizer, "the optimizer")
    if cfg.kind == TORCHTITAN:  # its experts Shard(1) where FSDP x EP ranks outnumber them (distributed/fsdp.py)
        m.given("shard_placement", ShardPlacement.AUTO.value, "torchtitan's expert shard placement")
    if cfg.offload:
        m.given("offload", True, cfg.key("offload"), False)


def _default_workload(m: _Merge, batch: int, seq: int, sequence: bool = True) -> None:
    """A torchtitan job without its batch or sequence length: torchtitan runs its defaults for them, which --batch
    and --seq replace (the job says nothing they would contradict). A model that takes no sequence (``sequence``
    False) is simulated at its factory's own batch or --batch: torchtitan's default counts are of tokens, and
    passing their sequence once failed with "--seq does not apply", an option the user never gave."""
    cfg = m.cfg
    if not sequence and cfg.registry:  # its defaults count tokens, which say nothing of such a model's step
        m.note(f"the job '{cfg.path}' gives no token counts, and the model {m.values['model']} takes no sequence: "
               "torchtitan's default counts do not apply, simulated at its factory's batch (--batch sets another)")
        return
    own = (("batch", batch, cfg.batch), ("seq", seq, cfg.seq)) if sequence else (("batch", batch, cfg.batch),)
    defaults = {k: v for k, v, given in own if given is None}
    mine = {k: m.values[k] for k in defaults}
    if all(mine.values()):
        return
    m.values.update({k: mine[k] or v for k, v in defaults.items()})
    replaced = "".join(f"; --{k} {mine[k]:,} in place of its {v:,}" for k, v in defaults.items() if mine[k])
    if cfg.registry:
        gives = (f"gives no token counts: torchtitan runs TrainingConfig's defaults, {batch * seq:,} tokens a "
                 f"micro-batch per data-parallel rank in sequences of {seq:,} (batch {batch})")
    else:
        gives = "gives no " + " and no ".join(f"training.{'local_batch_size' if k == 'batch' else 'seq_len'}"
                                              for k in defaults)
        gives += f": torchtitan runs its default{'s' if len(defaults) > 1 else ''}, " + " and ".join(
            f"{v:,}" for v in defaults.values())
    m.note(f"the job '{cfg.path}' {gives}, simulated here{replaced or ' (--batch and --seq replace them)'}")


def _layout(m: _Merge) -> None:
    """The cluster with the config's GPU count (the user's cluster names the GPU: a preset alone, default h100),
    the HSDP mesh and the micro-batches of a global batch."""
    cfg = m.cfg
    spec = m.values["cluster"] or DEFAULT_GPU
    preset = _PRESET.match(spec) if not spec.endswith(".json") else None
    given = None if preset else parse_cluster(spec).world_size
    world = world_of(cfg, given)
    if world is not None and world > MAX_WORLD_SIZE:  # said by the job's keys, not a cluster the user never typed
        raise PlannerError(f"the {cfg.kind} job runs on {world:,} GPUs ({_world_keys(cfg)}): at most "
                           f"{MAX_WORLD_SIZE:,} are supported")
    if world is None:  # the config leaves the count to the cluster: a bare preset's node, on each machine it names
        world = parse_cluster(spec).world_size * (cfg.nodes or 1)
        where = f"{cfg.nodes} machines (num_machines) of {spec.strip()}'s {world // cfg.nodes}" \
            if cfg.nodes and cfg.nodes > 1 else f"{spec.strip()}'s one node"
        if not m.gpus_searched:
            m.note(f"the {cfg.kind} config gives no GPU count ({_count_key(cfg)}): planning for {world} GPUs, {where} "
                   f"(give --cluster {spec.strip()}:N for another count)")
    if given is not None:
        _same_cluster(cfg, spec, world)
    if preset:
        per_node = world // cfg.nodes if cfg.nodes else None
        if per_node and per_node > MAX_GPUS_PER_NODE:
            machines = f"each of its {cfg.nodes} machines" if cfg.nodes > 1 else "its one machine"
            if world % MAX_GPUS_PER_NODE:  # no cluster of whole nodes agrees with the job: num_machines must change
                raise PlannerError(f"the {cfg.kind} job runs {per_node} processes on {machines} ({_world_keys(cfg)}, "
                                   f"num_machines = {cfg.nodes}), more than a node of {MAX_GPUS_PER_NODE} GPUs: set "
                                   "num_machines to the machines it runs on")
            m.note(f"the {cfg.kind} job runs {per_node} processes on {machines}, more than a node of "
                   f"{MAX_GPUS_PER_NODE} GPUs: planned as {world // MAX_GPUS_PER_NODE} nodes of "
                   f"{MAX_GPUS_PER_NODE} (num_machines sets another layout)")
        m.values["cluster"] = f"{preset.group(1)}:{cfg.nodes}x{per_node}" \
            if per_node and cfg.nodes and cfg.nodes > 1 and per_node <= 8 else f"{preset.group(1)}:{world}"
        if m.values["cluster"] == f"{preset.group(1)}:{world}" and world > MAX_GPUS_PER_NODE \
                and world % MAX_GPUS_PER_NODE:
            raise PlannerError(_nodes_needed(cfg, world, preset.group(1)))
    _tensor_parallel(m, world)
    _data_parallel(m, world // cfg.tp)


def _same_cluster(cfg: JobConfig, spec: str, world: int) -> None:
    """The user's cluster, a count or a layout, is the job's: its GPUs and (Accelerate's num_machines) nodes."""
    cluster = parse_cluster(spec)
    gpu = spec.split(":")[0].strip() if not spec.strip().endswith(".json") else DEFAULT_GPU  # the user's GPU, alone
    if cluster.world_size != world:
        raise PlannerError(f"--cluster {shown_json(spec)} has {cluster.world_size:,} GPUs but the {cfg.kind} job runs "
                           f"on {world:,} ({_world_keys(cfg)}): give the GPU alone (--cluster {gpu}) or agree")
    if cfg.nodes and cluster.nodes != cfg.nodes:
        raise PlannerError(f"--cluster {shown_json(spec)} has {cluster.nodes} node(s) but the {cfg.kind} job runs on "
                           f"{cfg.nodes} (num_machines): give the GPU alone (--cluster {gpu}) or agree")


def _titan_ep_placement(m: _Merge, cfg: JobConfig) -> None:
    """Where the job's torchtitan shards the experts: in their blocks' fully_shard calls on a per-param mesh since
    pytorch/torchtitan#2281 (March 2026; the config registry's jobs), each experts module in a call of its own
    before (a TOML job's: the registry replaced them in February 2026)."""
    placement = ExpertPlacement.BLOCKS if cfg.registry else ExpertPlacement.OWN
    if placement is ExpertPlacement.OWN and cfg.compile:
        # (its apply_compile of then compiled an MoE block's children apart, around the experts' own call)
        raise PlannerError(f"this TOML job runs EP ({cfg.key('ep')} = {cfg.ep}) with {cfg.key('compile')}: the "
                           "torchtitan of TOML jobs sharded each experts module in a fully_shard call of its own "
                           "and compiled an MoE block's other children apart around it, which is not modelled (the "
                           "planner compiles blocks whole, as torchtitan has since its config registry); plan it "
                           "with -- --compile.enable false, or as torchtitan runs it now with --ep-placement blocks")
    m.values["ep_placement"] = placement.value
    if placement is ExpertPlacement.OWN:
        m.note("the experts are planned as a TOML job's torchtitan shards them: each experts module in a fully_shard "
               "call of its own (torchtitan since pytorch/torchtitan#2281, March 2026, shards them in their blocks' "
               "calls on a per-param mesh: --ep-placement blocks)")


def _data_parallel(m: _Merge, dp: int) -> None:
    """The job's EP degree, HSDP mesh and micro-batches, over its ``dp`` data-parallel GPUs."""
    cfg = m.cfg
    if dp % cfg.replicate:
        raise PlannerError(f"{cfg.key('replicate')} = {cfg.replicate} does not divide the job's {dp} data-parallel "
                           f"GPUs")
    if cfg.ep > 1:  # EP's ranks come out of dp_shard (x tp: torchtitan's expert TP 1), as torchtitan's; the
        # degree bounded as --ep is
        if cfg.ep % cfg.tp:
            raise PlannerError(f"parallelism.expert_parallel_degree = {cfg.ep} is not a multiple of the tensor-"
                               f"parallel degree {cfg.tp}: EP's ranks span the TP ranks (torchtitan's expert TP 1)")
        if (dp // cfg.replicate * cfg.tp) % cfg.ep:
            raise PlannerError(f"parallelism.expert_parallel_degree = {cfg.ep} does not divide the job's "
                               f"{dp // cfg.replicate * cfg.tp} data-parallel shard x TP GPUs (EP's ranks come out "
                               "of dp_shard x tp)")
        m.given("ep", cfg.ep, "parallelism.expert_parallel_degree")
        if cfg.kind == TORCHTITAN and m.values["ep_placement"] is None:  # as the job's torchtitan shards them
            _titan_ep_placement(m, cfg)
    elif cfg.kind == TORCHTITAN:
        m.agrees("ep", 1, "parallelism.expert_parallel_degree")
    if cfg.replicate > 1:
        m.given("mesh", f"{cfg.replicate}x{dp // cfg.replicate}", cfg.key("replicate"))
    elif m.values["mesh"] is not None and str(m.values["mesh"]).strip().lower() != f"1x{dp}":
        m.agrees("mesh", f"1x{dp}", cfg.key("replicate") + " = 1")
    if cfg.global_batch is not None and not m.gpus_searched:  # (a GPU count searched runs one micro-batch a step)
        _micro_batches(m, dp)


def _tensor_parallel(m: _Merge, world: int) -> None:
    """The config's TP degree (its loss parallel and async TP with it), kept: the job runs with it."""
    cfg = m.cfg
    key = "parallelism.tensor_parallel_degree" if cfg.kind == TORCHTITAN else \
        "parallelism_config.parallelism_config_tp_size"
    if cfg.tp == 1:
        m.agrees("tp", 1, key)
        return
    if world % cfg.tp:
        raise PlannerError(f"{key} = {cfg.tp} does not divide the job's {world} GPUs")
    per_node = parse_cluster(m.values["cluster"]).gpus_per_node
    if per_node % cfg.tp:  # said here, by its key: the user gave no --tp
        raise PlannerError(f"{key} = {cfg.tp} must divide the {per_node} GPUs of a node of {m.values['cluster']} "
                           "(TP stays inside a node, on NVLink)")
    m.given("tp", cfg.tp, key)
    if m.values["tp_key"] is None:  # the degree is the config's: its refusals name the key
        m.values["tp_key"] = key
    if cfg.kind == TORCHTITAN and str(m.values["model"]).startswith("hf:") and cfg.plan is None:
        # (an export's job applies its plan's own layout: its parallelize_fn, not torchtitan's)
        m.note(f"torchtitan runs its own TP layout for {cfg.model_label} (sequence parallelism, loss parallel), "
               f"and the figures here are of {hf_tp_layout(str(m.values['model']))}")
    if cfg.loss_parallel is not None:
        m.given("loss_parallel", cfg.loss_parallel, "parallelism.disable_loss_parallel")
    if cfg.async_tp:
        m.given("async_tp", True, "enable_async_tensor_parallel", False)


def _float8_given(m: _Merge, cfg: JobConfig) -> None:
    """The job's float8 recipe and FSDP2 float8 all-gather, by the keys its file spells them with."""
    accelerate = cfg.kind == ACCELERATE
    m.given("float8", cfg.float8, "mixed_precision = fp8 (torchao's backend, tensorwise)" if accelerate else
            "the float8 converter's recipe_name")
    if cfg.float8 == "tensorwise":  # (rowwise gathers bf16 whatever the key says: nothing to give)
        m.given("float8_all_gather", cfg.float8_all_gather,
                f"{'fp8_config.' if accelerate else ''}enable_fsdp_float8_all_gather")


def _count_key(cfg: JobConfig) -> str:
    return "no num_processes" if cfg.kind == ACCELERATE else "data_parallel_shard_degree = -1"


def _nodes_needed(cfg: JobConfig, world: int, gpu: str) -> str:
    """Why a job of ``world`` GPUs needs its nodes named: more than one node, not whole nodes of the preset; the
    suggestion keeps each TP group inside a node."""
    sizes = [g for g in range(1, MAX_GPUS_PER_NODE + 1) if world % g == 0 and g % cfg.tp == 0]
    example = f"e.g. --cluster {gpu}:{world // sizes[-1]}x{sizes[-1]}" if sizes else f"--cluster {gpu}:NODESxGPUS"
    return (f"the {cfg.kind} job's {world:,} GPUs ({_world_keys(cfg)}) are not a whole number of "
            f"{MAX_GPUS_PER_NODE}-GPU nodes: give the nodes it runs on, {example}")


def _world_keys(cfg: JobConfig) -> str:
    if cfg.kind == ACCELERATE:
        return f"num_processes = {cfg.world}"
    tp = f" x tensor_parallel_degree {cfg.tp}" if cfg.tp > 1 else ""
    return f"data_parallel_replicate_degree {cfg.replicate} x data_parallel_shard_degree {cfg.shard}{tp}"


def _micro_batches(m: _Merge, world: int) -> None:
    """torchtitan's gradient accumulation: global_batch_size / (local_batch_size x data-parallel ranks) passes."""
    cfg = m.cfg
    local = cfg.batch or m.values["batch"]
    if local is None or cfg.global_batch is None or cfg.global_batch % (local * world):
        if cfg.registry and cfg.seq:  # its keys count tokens
            raise PlannerError(f"the torchtitan job '{cfg.path}': training.num_tokens_per_train_step = "
                               f"{(cfg.global_batch or 0) * cfg.seq:,} is not a multiple of {TOKENS_KEY} "
                               f"({(local or 0) * cfg.seq:,}) x the {world} data-parallel GPUs")
        raise PlannerError(f"training.global_batch_size = {cfg.global_batch} is not a multiple of "
                           f"training.local_batch_size ({local}) x the {world} data-parallel GPUs")
    n = cfg.global_batch // (local * world)
    if n > 1:  # the batch: the step's per-GPU batch, split in n
        # (a registry job's key counts the step's tokens: it says n micro-batches over its local ones)
        key = "training.num_tokens_per_train_step" if cfg.registry else "training.global_batch_size"
        m.given("micro_batches", str(n), key)
        m.values["batch"] = local * n
        # torchtitan's train_step never calls set_requires_gradient_sync(False): each backward reduce-scatters
        m.given("gradient_sync", GradientSync.EVERY.value, key)


def _compiled(m: _Merge) -> None:
    """The config's compiled blocks and loss; a torchtitan job compiling neither contradicts the options."""
    cfg = m.cfg
    for key, compiled in (("compile", cfg.compile), ("compile_loss", cfg.compile_loss)):
        if compiled:
            m.given(key, True, cfg.key(key), default=False)
        elif cfg.kind == TORCHTITAN:
            m.agrees(key, False, cfg.key(key), default=False)


def _loss_chunks(m: _Merge) -> None:
    """The job's loss in its ChunkedLossWrapper chunks; a job naming a whole-sequence loss contradicts chunks."""
    cfg = m.cfg
    if cfg.loss_chunks:  # (0: not a literal, simulated whole with a note saying so)
        m.given("loss_chunks", cfg.loss_chunks, "loss = ChunkedLossWrapper.Config(num_chunks=...)")
    elif cfg.loss_whole and m.values["loss_chunks"] is not None:
        raise PlannerError(f"--loss-chunks {m.values['loss_chunks']} contradicts torchtitan config '{cfg.path}', "
                           "whose loss runs over the whole sequence at once (loss = CrossEntropyLoss, or a "
                           "ChunkedLossWrapper of one chunk): drop one of them")


def _accelerate_fsdp2_carve(m: _Merge, model: str | None) -> None:
    """fsdp2_prepare_model (accelerate 1.16): after the blocks TRANSFORMER_BASED_WRAP wraps, a transformers model's
    input embedding alone and [final norm, output embedding] (tied: with the embedding) as one group kept unsharded
    after forward, the root last: torchtitan's grouping (the module policy left them to the root)."""
    cfg = m.cfg
    if cfg.kind != ACCELERATE or cfg.keys.get("fsdp_config.fsdp_version") != 2:
        return
    if not (cfg.policy is PolicyName.MODULE and len(cfg.module_classes) <= 1 and model is not None
            and model.startswith("hf:")):
        m.note("Accelerate's FSDP2 also shards, after the wrap policy's modules, a transformers model's input "
               "embedding alone and [final norm, output embedding] (a model of its own: a child of the root whose "
               "class name holds Norm) as a group kept unsharded after forward (fsdp2_prepare_model, accelerate "
               "1.16). That is simulated for TRANSFORMER_BASED_WRAP of one class on a transformers model only; here "
               "the wrap policy's groups are simulated as FSDP1 makes them, which leaves the embeddings and output to "
               "the root (gathered through the step): the job simulated may hold more than Accelerate's")
        return
    cfg.policy = PolicyName.TITAN
    m.note("Accelerate's FSDP2 shards a transformers model's input embedding alone and [final norm, output "
           "embedding] as one group kept unsharded after forward, beside the blocks TRANSFORMER_BASED_WRAP wraps "
           "(fsdp2_prepare_model, accelerate 1.16): simulated as titan's grouping, which is that for a Llama-style "
           "model (titan also shards another module before the first block alone, such as GPT-2's position "
           "embedding, and puts a final norm Accelerate does not find in its tail)")


def _policy(m: _Merge, command: str, plan_file: bool) -> None:
    cfg, policy = m.cfg, m.values["policy"]
    if plan_file:
        raise PlannerError(f"--plan and --from-{cfg.kind} both give the grouping: drop one")
    model = m.values["model"]
    if cfg.kind == ACCELERATE and cfg.policy is PolicyName.MODULE and not cfg.module_classes and model is not None \
            and not model.startswith("hf:"):
        # Accelerate's TRANSFORMER_BASED_WRAP without classes wraps the model's _no_split_modules (transformers'),
        # which a model of one's own has not: one fully_shard, on the root (accelerate/utils/fsdp_utils.py)
        cfg.policy, cfg.min_numel = PolicyName.SIZE, NO_WRAP_NUMEL
        m.note(f"{cfg.key('policy')} TRANSFORMER_BASED_WRAP without {CLASSES_KEY} wraps the model's "
               "_no_split_modules, which only transformers' models have: read as one FSDP group, the root (give "
               "the block classes to wrap them)")
    _accelerate_fsdp2_carve(m, model)
    if command == "simulate":
        if cfg.kind == TORCHTITAN and policy not in (None, cfg.policy.value):
            # torchtitan has no key for its grouping: name it, and where auto's plan for the job is
            raise PlannerError(f"--policy {policy} contradicts the torchtitan job {shown_json(cfg.path)}, "
                               f"which groups as torchtitan does (--policy {cfg.policy.value}): drop --policy, "
                               "or run `plan --from-torchtitan` for auto's plan beside the job's")
        m.given("policy", cfg.policy.value, cfg.key("policy"))
    if cfg.module_classes:
        m.given("module_classes", ",".join(cfg.module_classes), CLASSES_KEY)
    if cfg.min_numel is not None:
        m.given("min_nonwrapped_numel", str(cfg.min_numel), "fsdp_config.fsdp_min_num_params")
    if cfg.ac is not None and cfg.ac is not ACMode.NONE:
        m.given("ac", cfg.ac.value, cfg.key("ac"))
    elif cfg.ac is ACMode.NONE:
        m.agrees("ac", ACMode.NONE.value, cfg.key("ac"))
    elif cfg.kind == ACCELERATE and command != "fit":  # (not given: Accelerate checkpoints nothing, which an
        # option would contradict; fit's --ac asks what fits with it)
        m.agrees("ac", ACMode.NONE.value, f"{cfg.key('ac')} (not given: false, Accelerate's default)")
    _compiled(m)
    _loss_chunks(m)
    if cfg.float8:
        _float8_given(m, cfg)
        if cfg.float8_tp_all_gather and m.values["float8_tp_all_gather"] is not False:  # (a reading of the
            # TOML's time, not a key of it: --no-float8-tp-all-gather turns it off)
            m.values["float8_tp_all_gather"] = True
    elif cfg.kind == TORCHTITAN and m.values["float8"] is not None and \
            not (cfg.registry and cfg.keys.get("model.name") is None):  # (a registry job naming no model_spec,
        # as the export's for a model of the user's, has no converter to contradict; a TOML's default has none)
        raise PlannerError(f"--float8 {shown_json(m.values['float8'])} contradicts torchtitan config "
                           f"{shown_json(cfg.path)}, whose model has no float8 converter: drop --float8, or add "
                           "the converter to the job")



@dataclass(frozen=True)
class ConfigOutcome:
    """``plan --from-X``: the config's job, auto's plan for the same model, workload, precision and cluster, the
    settings config keys say of each, and the best edit of the config's keys alone (its grouping kept)."""

    config: PlanOutcome  # the config's own grouping, with its reshard rule
    auto: PlanOutcome  # auto's, free to choose checkpointing, layout and offload
    old: Setting
    new: Setting
    edit: tuple[Setting, StepReport] | None
    # auto's plan as ``export --format torchtitan`` runs it where the job keeps torchtitan's groups (EP on its MoE
    # model): its one checkpointing class and reshard rule on torchtitan's grouping, and that job's step; None where
    # the export runs auto's own groups
    exported: tuple[Setting, StepReport | None] | None = None


def graphed_host_note(cfg: JobConfig, step: StepReport) -> str | None:
    """torchtitan's CUDA-graph replay launches forward and backward without the host: the eager step simulated here
    waits on it where the host is the bound (a model of small layers), which the replay does not (None: the job
    runs no graphs, or its step hardly waits on the host)."""
    if not cfg.cuda_graphs or step.host_wait < 0.01 * step.step_time:
        return None
    return (f"torchtitan replays the forward and backward as a CUDA graph (training.disable_cuda_graphs = False, its "
            f"default), which spends no host time on its launches and FSDP2's hooks; the step here is eager, "
            f"{fmt_time(step.host_wait)} of it ({step.host_wait / step.step_time:.0%}) waiting on them: the replayed "
            "step is up to that much faster (-- --training.disable_cuda_graphs runs it as simulated)")


@contextlib.contextmanager
def classes_named_by(cfg: JobConfig | None) -> Iterator[None]:
    """A module class the config names that the model lacks is said with the key and file that gave it (the
    message named neither, as if the user had typed --module-classes)."""
    try:
        yield
    except ClassesNotFound as e:
        if cfg is None or not cfg.module_classes:
            raise
        raise PlannerError(f"{cfg.kind} config '{cfg.path}': {CLASSES_KEY}: {e}") from None


def _auto(kw: Keywords, cfg: JobConfig, tracer: Tracer, reporter: Reporter, early_stop_given: bool) -> PlanOutcome:
    """Auto's plan for the config's model, workload and cluster, free to choose checkpointing, layout and offload.
    Its early stop is free too where a torchtitan job's early_stop is torchtitan's wrapper's (not given on the
    command line): the export's parallelize_fn checkpoints as the plan says, except on a job that keeps torchtitan's
    groups (EP on its MoE model), which is planned again with the wrapper's."""
    free = dataclasses.replace(kw, policy=PolicyName.AUTO.value, ac=None, mesh=None, offload=False)  # (--ac-policy
    # kept: what auto's op-level blocks save, as fit's auto beside the job takes it)

    def search(early_stop: object, to: Reporter = reporter) -> PlanOutcome:
        return plan(dataclasses.replace(plan_job(dataclasses.replace(free, early_stop=early_stop), _CLI),
                                        must_fit=False), tracer, to)

    wrapper = cfg.kind == TORCHTITAN and cfg.plan is None and cfg.early_stop is not None and not early_stop_given
    if wrapper and not (isinstance(kw.ep, int) and kw.ep > 1):
        said: list[str] = []  # (its notes said only where this search is the one kept: the other's repeat them)
        auto = search(None, dataclasses.replace(reporter, note=said.append))
        assert auto.search is not None
        if not keeps_torchtitan_groups(auto.search.plan):
            for line in said:
                reporter.note(line)
            return auto
    return search(kw.early_stop)


def with_held_float8(kw: Keywords, held: Plan) -> Keywords:
    """The keywords auto plans with on an export's job: the float8 training its ``parallelize_fn`` applies from the
    plan it holds (a recipe torchtitan's converter lacks: no converter among the job's keys), which auto kept off
    and so advised the slower bf16 plan."""
    f8 = held.float8
    if f8 is None or kw.float8 is not None:
        return kw
    skip = tuple(n for n in f8.filter_fqns if n not in OUTPUT_HEAD_FQNS)
    return dataclasses.replace(kw, float8=f8.recipe.value, float8_all_gather=f8.fsdp_float8_all_gather or None,
                               float8_skip=skip or None, float8_tp_all_gather=f8.tp_float8_all_gather or None)


def _config_setting(cfg: JobConfig, kw: Keywords, dp: int) -> Setting:
    """What the config's keys set of a job over ``dp`` data-parallel ranks (its EP degree: the config's or
    ``--ep``, as ``kw`` has it)."""
    ep = kw.ep if isinstance(kw.ep, int) and kw.ep > 1 else 1
    return Setting(cfg.ac or ACMode.NONE, cfg.reshard, Mesh(cfg.replicate, dp // cfg.replicate), cfg.offload, ep,
                   cfg.tp)


def hf_tp_layout(model: str) -> str:
    """What TP on a torchtitan job built as transformers' modules is priced as (its own layout is torchtitan's)."""
    return (f"transformers' plan for {model} (no sequence parallelism, the logits all-gathered), which is slower "
            "and holds more: Llama 3 8B at TP 2, batch 2 x 4,096, full checkpointing on h100:8, 732 ms and 32 GiB "
            "reserved against 585 ms and 26 GiB in torchtitan's")


def _tp_advice_note(cfg: JobConfig, old: Setting, new: Setting, model: str, reporter: Reporter) -> None:
    """Auto's TP advice on a torchtitan job built as transformers' modules: priced on a layout torchtitan does not
    run (a trial)."""
    if cfg.kind == TORCHTITAN and new.tp != old.tp and new.tp > 1 and model.startswith("hf:") and cfg.plan is None:
        reporter.note(f"auto's TP {new.tp} would run torchtitan's own layout for {cfg.model_label}, and its figures "
                      f"here are of {hf_tp_layout(model)}")


def compare_config(kw: Keywords, cfg: JobConfig, tracer: Tracer, reporter: Reporter,
                   early_stop_given: bool = False) -> ConfigOutcome:
    """The config's job beside auto's plan, and the fastest edit of its keys within the budget (each edit planned
    by the config's policy on the one trace). ``early_stop_given``: the command line set checkpointing's early stop,
    which auto keeps."""
    own = plan_job(dataclasses.replace(kw, policy=cfg.policy.value), _CLI)
    job = dataclasses.replace(own, reshard=cfg.reshard)
    with classes_named_by(cfg):
        traced = plan(job, tracer, reporter)
    tr = traced.trace
    if cfg.plan is not None:  # an export's job: its parallelize_fn applies the plan it holds, not torchtitan's groups
        assert job.cluster is not None
        held = load_plan(f"{cfg.path}'s {PLAN_NAME}", tr, job.model, reporter.note, job.cluster.world_size,
                         job.options, text=cfg.plan)
        traced = given_outcome(job, tr, held)
        kw = with_held_float8(kw, held)

    def same_trace(spec: ModelSpec, options: SimOptions) -> Trace:
        # the job's model, workload and precision: its trace; auto's TP layouts trace the model at d times the
        # batch (a TP group of d shares the data-parallel rank's batch): those are traced
        return tr if spec == job.model and options.precision == job.options.precision else tracer(spec, options)

    auto = _auto(kw, cfg, same_trace, reporter, early_stop_given)
    assert job.cluster is not None and job.budget is not None and auto.search is not None
    world, before = job.cluster.world_size, traced.report
    assert before is not None
    if (said := graphed_host_note(cfg, before)) is not None:
        reporter.note(said)
    dp = world // cfg.tp
    old = _config_setting(cfg, kw, dp)
    if cfg.plan is not None and traced.plan is not None:  # an export's job: what its keys say is its plan's
        old = plan_setting(traced.plan, tr, world)
    new = plan_setting(auto.search.plan, tr, world)
    _tp_advice_note(cfg, old, new, job.model.name, reporter)

    def step(setting: Setting) -> StepReport | None:
        ac = setting.ac or ACMode.NONE
        edited = dataclasses.replace(
            kw, policy=cfg.policy.value, ac=ac.value if ac is not ACMode.NONE else None,
            ep=setting.ep if setting.ep > 1 else None,
            ac_policy=None if ac is not ACMode.OP else kw.ac_policy, offload=setting.offload,
            mesh=f"{setting.mesh.replicate}x{setting.mesh.shard}" if setting.mesh.replicate > 1 else None)
        try:
            one = dataclasses.replace(plan_job(edited, _CLI), reshard=setting.reshard or cfg.reshard)
            return plan(one, same_trace).report
        except PlannerError:  # the config's policy cannot take the setting
            return None

    modes, rules = edit_choices(cfg)
    # (an export's job runs its plan's groups: edits of its keys over torchtitan's grouping are another job's)
    edit = best_edit(modes, rules, old, new, step, job.budget.fits, before, cfg.kind == TORCHTITAN) \
        if cfg.plan is None else None
    as_exported = None
    if cfg.kind == TORCHTITAN and cfg.plan is None and keeps_torchtitan_groups(auto.search.plan):
        # (at auto's EP degree, which its screen may choose on a job without EP: the export writes it)
        setting = exported_setting(auto.search.plan, new.mesh)
        as_exported = (setting, step(setting))
    return ConfigOutcome(traced, auto, old, new, edit, as_exported)
