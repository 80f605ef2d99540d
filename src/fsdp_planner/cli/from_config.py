"""``--from-torchtitan JOB.toml`` / ``--from-accelerate CONFIG.yaml`` on ``simulate`` and ``plan``: the job the
config describes, run as the command line's own options (``configured``), its ``reshard_after_forward`` rule on
the plan (``adjusted``); ``from_config_plan.py`` is ``plan --from-...``."""

from __future__ import annotations

import argparse
import re
from typing import Any

import fsdp_planner.cli.render as render
from fsdp_planner.choices import DEFAULT_PRECISION, ACMode, GradientSync
from fsdp_planner.configs.job_config import ACCELERATE, TITAN_MODELS, TORCHTITAN, JobConfig, read_config, world_of
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import BUILTINS
from fsdp_planner.userfiles import shown_json

_PRESET = re.compile(r"^\s*([a-z0-9]+)\s*$", re.I)
DEFAULT_GPU = "h100"


def job_config(args: argparse.Namespace) -> JobConfig | None:
    """The config ``--from-torchtitan`` / ``--from-accelerate`` names, read (None: neither given)."""
    if getattr(args, "from_torchtitan", None):
        return read_config(TORCHTITAN, args.from_torchtitan)
    if getattr(args, "from_accelerate", None):
        return read_config(ACCELERATE, args.from_accelerate)
    return None


def configured(args: argparse.Namespace) -> JobConfig | None:
    """``args`` set, in place, to the job the config describes, each of its notes said once; a command-line option
    that contradicts the config is one error naming both."""
    cfg = job_config(args)
    if cfg is None:
        return None
    for note in cfg.notes:
        render.note(note)
    _model(cfg, args)
    _workload(cfg, args)
    _layout(cfg, args)
    _policy(cfg, args)
    return cfg


def _given(args: argparse.Namespace, attr: str, option: str, value: Any, key: str, cfg: JobConfig,
           default: Any = None) -> None:
    """Set ``args.attr`` to the config's ``value`` unless the user gave another (an error)."""
    mine = getattr(args, attr, default)
    if mine not in (default, value):
        raise PlannerError(f"{option} {shown_json(mine)} contradicts {key} in {cfg.kind} config "
                           f"{shown_json(cfg.path)} ({shown_json(value)}): drop one of them")
    setattr(args, attr, value)


def _model(cfg: JobConfig, args: argparse.Namespace) -> None:
    if cfg.kind != TORCHTITAN:
        return
    if args.model is not None:
        if cfg.model is not None and args.model != cfg.model:
            raise PlannerError(f"MODEL '{args.model}' is not the torchtitan job's model ({cfg.model_label} is "
                               f"{cfg.model}): leave MODEL out, or give the config's model")
        if cfg.model is None and (cfg.keys.get("model.name") or cfg.keys.get("model.flavor")):
            render.note(f"MODEL {shown_json(args.model)} stands for the torchtitan job's model {cfg.model_label}")
        return
    if cfg.model is None and not (cfg.keys.get("model.name") or cfg.keys.get("model.flavor")):
        raise PlannerError(f"the torchtitan config {shown_json(cfg.path)} names no model ([model] name and flavor): "
                           "give MODEL")
    if cfg.model is None:
        known = ", ".join(f"{n} {f.upper()}" for n, f in _titan_models())
        raise PlannerError(f"the torchtitan job's model {cfg.model_label} is not one fsdp-planner builds (known: "
                           f"{known}); give your model as MODEL, e.g. hf:path/config.json or path/model.py:build")
    args.model = cfg.model


def _titan_models() -> list[tuple[str, str]]:
    return [k for k, v in TITAN_MODELS.items() if v in BUILTINS]


def _workload(cfg: JobConfig, args: argparse.Namespace) -> None:
    batch_key = "training.local_batch_size" if cfg.kind == TORCHTITAN else "batch"
    if cfg.batch is not None:
        _given(args, "batch", "--batch", cfg.batch, batch_key, cfg)
    if cfg.seq is not None:
        _given(args, "seq", "--seq", cfg.seq, "training.seq_len", cfg)
    if cfg.precision is not None:
        _given(args, "precision", "--precision", cfg.precision, "the mixed precision", cfg, DEFAULT_PRECISION)
    if cfg.reduce_dtype is not None:
        _given(args, "reduce_dtype", "--reduce-dtype", cfg.reduce_dtype, "training.mixed_precision_reduce", cfg)
    if cfg.offload:
        _given(args, "offload", "--offload", True, cfg.key("offload"), cfg, False)


def _layout(cfg: JobConfig, args: argparse.Namespace) -> None:
    """``--cluster`` with the config's GPU count (``--cluster`` names the GPU: a preset alone, default h100), the
    HSDP mesh and the micro-batches of a global batch."""
    spec = args.cluster or DEFAULT_GPU
    preset = _PRESET.match(spec) if not spec.endswith(".json") else None
    given = None if preset else parse_cluster(spec).world_size
    world = world_of(cfg, given)
    if world is None:  # the config leaves the count to the cluster: a bare preset's one node
        world = parse_cluster(spec).world_size
        render.note(f"the {cfg.kind} config gives no GPU count ({_count_key(cfg)}): planning for {world} GPUs, "
                    f"{spec.strip()}'s one node (give --cluster {spec.strip()}:N for another count)")
    if given is not None and given != world:
        raise PlannerError(f"--cluster {shown_json(spec)} has {given:,} GPUs but the {cfg.kind} job runs on "
                           f"{world:,} ({_world_keys(cfg)}): give the GPU alone (--cluster {DEFAULT_GPU}) or agree")
    if preset:
        per_node = world // cfg.nodes if cfg.nodes else None
        args.cluster = f"{preset.group(1)}:{cfg.nodes}x{per_node}" if per_node and cfg.nodes > 1 and per_node <= 8 \
            else f"{preset.group(1)}:{world}"
    if world % cfg.replicate:
        raise PlannerError(f"{cfg.key('replicate')} = {cfg.replicate} does not divide the job's {world} GPUs")
    if cfg.replicate > 1:
        _given(args, "mesh", "--mesh", f"{cfg.replicate}x{world // cfg.replicate}", cfg.key("replicate"), cfg)
    if cfg.global_batch is not None:
        _micro_batches(cfg, args, world)


def _count_key(cfg: JobConfig) -> str:
    return "no num_processes" if cfg.kind == ACCELERATE else "data_parallel_shard_degree = -1"


def _world_keys(cfg: JobConfig) -> str:
    if cfg.kind == ACCELERATE:
        return f"num_processes = {cfg.world}"
    return f"data_parallel_replicate_degree {cfg.replicate} x data_parallel_shard_degree {cfg.shard}"


def _micro_batches(cfg: JobConfig, args: argparse.Namespace, world: int) -> None:
    """torchtitan's gradient accumulation: global_batch_size / (local_batch_size x data-parallel ranks) passes."""
    local = cfg.batch or args.batch
    if local is None or cfg.global_batch is None or cfg.global_batch % (local * world):
        raise PlannerError(f"training.global_batch_size = {cfg.global_batch} is not a multiple of "
                           f"training.local_batch_size ({local}) x the {world} data-parallel GPUs")
    n = cfg.global_batch // (local * world)
    if n > 1:  # --batch: the step's per-GPU batch, split in n
        _given(args, "micro_batches", "--micro-batches", str(n), "training.global_batch_size", cfg)
        args.batch = local * n
        # torchtitan's train_step never calls set_requires_gradient_sync(False): each backward reduce-scatters
        _given(args, "gradient_sync", "--gradient-sync", GradientSync.EVERY.value, "training.global_batch_size", cfg)


def _policy(cfg: JobConfig, args: argparse.Namespace) -> None:
    if getattr(args, "plan", None):
        raise PlannerError(f"--plan and --from-{cfg.kind} both give the grouping: drop one")
    if args.command == "simulate":
        if cfg.kind == TORCHTITAN and getattr(args, "policy", None) not in (None, cfg.policy.value):
            # torchtitan has no key for its grouping: name it, and where auto's plan for the job is
            raise PlannerError(f"--policy {args.policy} contradicts the torchtitan job {shown_json(cfg.path)}, "
                               f"which groups as torchtitan does (--policy {cfg.policy.value}): drop --policy, "
                               "or run `plan --from-torchtitan` for auto's plan beside the job's")
        _given(args, "policy", "--policy", cfg.policy.value, cfg.key("policy"), cfg)
    if cfg.module_classes:
        _given(args, "module_classes", "--module-classes", ",".join(cfg.module_classes),
               "fsdp_config.fsdp_transformer_layer_cls_to_wrap", cfg)
    if cfg.min_numel is not None:
        _given(args, "min_nonwrapped_numel", "--min-nonwrapped-numel", str(cfg.min_numel),
               "fsdp_config.fsdp_min_num_params", cfg)
    if cfg.ac is not None and cfg.ac is not ACMode.NONE:
        _given(args, "ac", "--ac", cfg.ac.value, cfg.key("ac"), cfg)


def adjusted(plan: Plan, cfg: JobConfig | None) -> Plan:
    """The config's plan with its ``reshard_after_forward`` ("always": every group; "never": none; "default": the
    policy's own)."""
    if cfg is None or cfg.reshard == "default":
        return plan
    out = plan.copy(policy=f"{plan.policy}, reshard_after_forward {cfg.reshard}")
    for g in out.groups:
        g.reshard_after_forward = cfg.reshard == "always"
    return out
