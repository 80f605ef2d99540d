"""A plan's job in torchtitan's own form, for ``export --format torchtitan``: a config_registry function returning
``Trainer.Config(...)`` of literals (torchtitan #2386), and the same settings as torchtitan's command-line flags.

What a ``Trainer.Config`` can say of a plan: the data-parallel degrees, one ``fsdp_reshard_after_forward`` rule,
full or per-op checkpointing, the mixed precision and CPU offload. The exact groups are the export's
``parallelize``. ``--from-torchtitan FILE.py:fsdp_planner_job`` reads the function back
(``configs/torchtitan_registry.py``). Values enter the source only through ``py_literal``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from fsdp_planner.configs.torchtitan_registry import TITAN_MODELS
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision

FUNCTION = "fsdp_planner_job"
# each model's first flavour (qwen3's debugmodel, not its non_fused_qkv twin): the reversed items' last word wins
FLAVORS = {builtin: key for key, builtin in reversed(TITAN_MODELS.items())}

JOB = '''

def {function}() -> Any:
    """This plan's job in torchtitan's config_registry form: its data-parallel degrees, reshard_after_forward,
    activation checkpointing, mixed precision and offload, and (where it names torchtitan's model) the plan's
    groups as its model's ``parallelize_fn``. Run it with ``--module THIS_MODULE --config {function}`` (this file
    on the Python path), or give TORCHTITAN_FLAGS after an existing job's ``--module M --config F`` (the flags
    cannot set parallelize_fn: that job shards as torchtitan does). fsdp-planner reads it back without running
    it: ``fsdp-planner simulate --from-torchtitan THIS_FILE.py:{function}``."""
{imports}

{returned}


# The same settings as torchtitan's command-line flags, on top of any registry job.
TORCHTITAN_FLAGS: list[str] = [
{flags}
]
'''


# The fields of torchtitan's dataclasses the job is written with, as at b5bcd76 (2026; torchtitan/config/configs.py,
# components/quantization/float8.py): ParallelismConfig has no disable_loss_parallel (TP's loss is always loss
# parallel) and no enable_async_tensor_parallel (CompileConfig has it, refusing it without a compiled model);
# TrainingConfig's mixed_precision_reduce is float32 only; Float8LinearConverter.Config has the rowwise recipes
# only, no float8 all-gather of FSDP's weights (tests/fixtures/torchtitan/config_fields.json checks the export).
TITAN_FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def job_settings(plan: Plan, precision: Precision) -> dict[str, dict[str, Any]]:
    """The plan as Trainer.Config sections (``activation_checkpoint``: the class, or None), in the fields
    torchtitan's dataclasses have (above): with tensor parallelism, ``tensor_parallel_degree``, and async TP as
    ``compile.enable_async_tensor_parallel`` where the blocks are compiled; with expert parallelism,
    ``expert_parallel_degree``. What no field says is ``unexpressed``'s."""
    rule = reshard_rule(plan)
    # the shard degree of the world the plan was made for where it is known (its memory is that degree's), else -1
    ranks = plan.workload.ranks // plan.tp_degree if plan.workload and plan.workload.ranks else -1
    mesh = (plan.mesh.replicate, plan.mesh.shard) if plan.mesh else (1, ranks)
    tp = plan.tensor_parallel
    tp_keys: dict[str, Any] = {"tensor_parallel_degree": tp.degree} if tp is not None else {}
    if plan.expert_parallel is not None:  # EP's ranks out of dp_shard, as torchtitan takes them
        tp_keys["expert_parallel_degree"] = plan.expert_parallel.degree
    ac = "SelectiveAC" if plan.selective_checkpointing else "FullAC" if plan.activation_checkpointing else None
    compiled = bool(plan.compiled)  # torchtitan compiles every block; the plan, the ones it names
    return {
        "training": {**_tokens(plan), "dtype": "bfloat16" if precision.param_bytes == 2 else "float32",
                     "mixed_precision_param": "bfloat16" if precision.compute_bytes == 2 else "float32",
                     **({} if precision.reduce_bytes == 2 else {"mixed_precision_reduce": "float32"}),
                     "enable_cpu_offload": plan.offload},
        "parallelism": {"data_parallel_replicate_degree": mesh[0], "data_parallel_shard_degree": mesh[1],
                        "fsdp_reshard_after_forward": rule, **tp_keys,
                        "spmd_backend": "partial_dtensor"},  # parallelize_fn's: FSDP2 over DTensor meshes
        "activation_checkpoint": {"class": ac},
        "compile": {"enable": compiled,
                    **({"enable_async_tensor_parallel": True} if tp is not None and tp.async_tp and compiled else {})},
    }


def _tokens(plan: Plan) -> dict[str, int]:
    """TrainingConfig's token counts for the plan's workload: a data-parallel rank's micro-batch, the sequence
    and, with micro-batches, the step's tokens over the data-parallel ranks (torchtitan derives the accumulation
    steps from them; without micro-batches its default, -1, is one micro-batch a step). None known: none set."""
    w = plan.workload
    if w is None:
        return {}
    out = {"num_tokens_per_microbatch_per_dp_rank": w.batch // w.micro_batches * w.seq, "max_context_length": w.seq}
    if w.micro_batches > 1 and w.ranks:
        out["num_tokens_per_train_step"] = w.batch * w.seq * (w.ranks // plan.tp_degree)
    return out


def unexpressed(plan: Plan, precision: Precision, modules: Mapping[str, nn.Module] | None) -> list[str]:
    """What of ``plan`` torchtitan's job keys cannot say, each as a sentence: the job file then runs torchtitan's
    one setting for every block (``modules``: the model's, to tell a checkpointed subset of its blocks)."""
    out = []
    if plan.model not in FLAVORS:
        out.append(f"the job names no torchtitan model for {plan.model or 'this model'}: set its config.model_spec "
                   "to your model's spec, and that spec's parallelize_fn = parallelize_fn for the plan's groups")
    if plan.workload is None:
        out.append("the plan records no workload (written before plans recorded it, or of a model whose batch "
                   "fsdp-planner does not know): the job sets no token counts and runs torchtitan's defaults or "
                   "the registry job's")
    elif plan.workload.micro_batches > 1:
        out.append(f"torchtitan's train_step reduce-scatters every one of the {plan.workload.micro_batches} "
                   "micro-batches (it skips no gradient sync): the job's step is the plan's with --gradient-sync "
                   "every")
        if not plan.workload.ranks:
            out.append(f"the plan runs {plan.workload.micro_batches} micro-batches a step on a world it does not "
                       "record: the job sets no num_tokens_per_train_step (give it as the micro-batch's tokens x the "
                       f"data-parallel ranks x {plan.workload.micro_batches})")
    full, op = plan.activation_checkpointing, plan.selective_checkpointing
    if full and op:
        out.append(f"the plan checkpoints {len(full)} modules in full and {len(op)} op-level; torchtitan's job "
                   "checkpoints every block one way (selective here)")
    elif modules is not None and (full or op) and (blocks := _alike(full or op, modules)) > len(full or op):
        out.append(f"the plan checkpoints {len(full or op)} of the model's {blocks} blocks; torchtitan's job "
                   f"checkpoints every block ({'selective' if op else 'full'})")
    out += _reshard_notes(plan)
    if modules is not None and plan.compiled and (blocks := _alike(plan.compiled, modules)) > len(plan.compiled):
        out.append(f"the plan compiles {len(plan.compiled)} of the model's {blocks} blocks; torchtitan's job "
                   "compiles every block")
    return out + _tp_and_precision_notes(plan, precision) + _float8_notes(plan, precision)


def _tp_and_precision_notes(plan: Plan, precision: Precision) -> list[str]:
    """``unexpressed``'s sentences for TP and the gradient reduce."""
    out = []
    tp = plan.tensor_parallel
    if tp is not None and not tp.loss_parallel:
        out.append("the plan's TP leaves the loss whole (no loss parallel), which torchtitan's job has no key for: "
                   "its TP always runs the loss parallel over the vocabulary")
    if tp is not None and tp.async_tp and not plan.compiled:
        out.append("the plan's async TP runs with eager blocks, which torchtitan refuses (async TP needs the model "
                   "compiled): the job runs TP's collectives synchronously")
    if precision.reduce_bytes == 2:
        out.append("the plan reduce-scatters gradients in bf16; torchtitan's mixed_precision_reduce is float32 only: "
                   "the job reduces in float32")
    return out


def _float8_notes(plan: Plan, precision: Precision) -> list[str]:
    """``unexpressed``'s sentences for float8 and autocast."""
    out = []
    f8 = plan.float8
    if f8 is not None and plan.model in FLAVORS and f8.recipe.value not in TITAN_FLOAT8_RECIPES:
        out.append(f"torchtitan's Float8LinearConverter has the rowwise recipes only, not the plan's {f8.recipe.value} "
                   "(nor FSDP's float8 all-gather): fsdp_planner_job() has no float8 converter (parallelize() converts "
                   "the Linears itself); read back with --from-torchtitan, it is a bf16 job")
    if f8 is not None and plan.model not in FLAVORS:
        flags = f"--float8 {f8.recipe.value}" + (" --float8-tp-all-gather" if f8.tp_float8_all_gather else "")
        out.append(f"the job names no torchtitan model for {plan.model or 'this model'}, so fsdp_planner_job() has no "
                   "float8 converter (parallelize() converts the Linears itself): read back with --from-torchtitan, "
                   f"it is a bf16 job; give {flags} for the plan's figures")
    if f8 is not None and f8.tp_float8_all_gather:
        out.append("the plan all-gathers TP's activations in float8 (torchao's float8 TP styles): parallelize() here "
                   "applies them, but fsdp_planner_job()'s torchtitan config cannot say it (torchtitan's TP has no "
                   "float8 styles since April 2026: run as that job, TP gathers bf16; read back, give "
                   "--float8-tp-all-gather for the plan's figures)")
    if precision.autocast:
        out.append("the plan runs under autocast, which torchtitan's job has no key for: it runs FSDP2's mixed "
                   "precision (params cast to bf16 for compute)")
    return out


def _alike(names: Sequence[str], modules: Mapping[str, nn.Module]) -> int:
    """How many of the model's modules are of the classes of ``names``' (the blocks a job setting applies to)."""
    kinds = {type(modules[m]) for m in names if m in modules}
    return sum(type(mod) in kinds for mod in modules.values())


def _reshard_notes(plan: Plan) -> list[str]:
    """What torchtitan's one ``fsdp_reshard_after_forward`` cannot say of the plan's per-group settings."""
    if reshard_rule(plan) != "default":
        return []
    out = []
    if any(not isinstance(g.reshard_after_forward, bool) for g in plan.inner_groups):
        out.append("the plan reshards some groups to a smaller mesh after forward (an int reshard_after_forward), "
                   "which torchtitan's fsdp_reshard_after_forward cannot say: the job reshards them in full")
    kept = [g for g in plan.inner_groups[:-1] if g.reshard_after_forward is False]
    if kept:  # torchtitan's "default" keeps its last group ([norm, output]) only
        out.append(f"the plan keeps {len(kept)} more groups than the last unsharded after forward "
                   "(reshard_after_forward false); torchtitan's fsdp_reshard_after_forward 'default' keeps only "
                   "[norm, output]: the job reshards them")
    return out


def reshard_rule(plan: Plan) -> str:
    """torchtitan's one ``fsdp_reshard_after_forward`` for the plan's groups: "always" or "never" where every group
    agrees, else "default" (a size to reshard to has no torchtitan key)."""
    values = [g.reshard_after_forward for g in plan.inner_groups]
    if values and all(v is True for v in values):
        return "always"
    if values and all(v is False for v in values):
        return "never"
    return "default"


def torchtitan_job(plan: Plan, precision: Precision, literal: Callable[[Any], str]) -> str:
    """The source of ``fsdp_planner_job()`` and ``TORCHTITAN_FLAGS`` for ``plan`` (``literal``: the export's
    ``py_literal``)."""
    settings = job_settings(plan, precision)
    ac = settings["activation_checkpoint"]["class"]
    imports = ["from torchtitan.config import ParallelismConfig, TrainingConfig"]
    keywords = []
    if plan.model in FLAVORS:
        name, flavor = FLAVORS[plan.model]
        imports.append(f"from torchtitan.models.{name} import model_registry")
        converters = _converters(plan, literal)
        keywords.append(f"model_spec=model_registry({literal(flavor)}{converters}),")
        if converters:
            imports.append("from torchtitan.components.quantization import Float8LinearConverter")
    for section, cls in (("training", "TrainingConfig"), ("parallelism", "ParallelismConfig")):
        fields = "".join(f"\n            {k}={literal(v)}," for k, v in settings[section].items())
        keywords.append(f"{section}={cls}({fields}\n        ),")
    if ac:
        imports.append(f"from torchtitan.distributed.activation_checkpoint import {ac}")
    keywords.append(f"activation_checkpoint={ac + '.Config()' if ac else 'None'},")
    if settings["compile"]["enable"]:
        imports.append("from torchtitan.config import CompileConfig")
        fields = ", ".join(f"{k}={literal(v)}" for k, v in settings["compile"].items())
        keywords.append(f"compile=CompileConfig({fields}),")
    imports.append("from torchtitan.trainer import Trainer")
    call = "Trainer.Config(\n" + "\n".join(f"        {k}" for k in keywords) + "\n    )"
    # the plan's groups in place of torchtitan's parallelize: only where the job names the model (a spec to set)
    returned = f"    config = {call}\n    config.model_spec.parallelize_fn = parallelize_fn\n    return config" \
        if plan.model in FLAVORS else f"    return {call}"
    return JOB.format(function=FUNCTION, imports="\n".join(f"    {i}" for i in imports), returned=returned,
                      flags="\n".join(f"    {', '.join(literal(w) for w in flag)}," for flag in flags(settings)))


def _converters(plan: Plan, literal: Callable[[Any], str]) -> str:
    """torchtitan's float8 converter for a plan with float8 training (its recipe and filter, and whether the
    model is compiled, as torchtitan's own registry passes it); none for a recipe it does not have."""
    f8 = plan.float8
    if f8 is None or f8.recipe.value not in TITAN_FLOAT8_RECIPES:
        return ""
    return (f", converters=[Float8LinearConverter.Config(recipe_name={literal(f8.recipe.value)}, "
            f"filter_fqns={literal(list(f8.filter_fqns))}, model_compile_enabled={literal(bool(plan.compiled))})]")


def flags(settings: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    """torchtitan's ``--section.key VALUE`` flags, each with its value (a true flag alone, a false one left at
    torchtitan's default; the checkpointing as tyro's subcommand)."""
    out: list[tuple[str, ...]] = []
    for section in ("training", "parallelism", "compile"):
        for key, value in settings[section].items():
            if value is True:
                out.append((f"--{section}.{key}",))
            elif value is not False:
                out.append((f"--{section}.{key}", str(value)))
    ac = settings["activation_checkpoint"]["class"]
    out.append(({"SelectiveAC": "activation-checkpoint:selective", "FullAC": "activation-checkpoint:full",
                 None: "activation-checkpoint:none"}[ac],))
    return out
