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

from fsdp_planner.choices import ACMode
from fsdp_planner.configs.job_config import TITAN_OPTIMIZERS, TITAN_SUFFIXES
from fsdp_planner.configs.torchtitan_registry import TITAN_MODELS
from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.planners.config_edit import job_ac, keeps_torchtitan_groups, reshard_rule

FUNCTION = "fsdp_planner_job"
# each model's first flavour (qwen3's debugmodel, not its non_fused_qkv twin): the reversed items' last word wins
FLAVORS = {builtin: key for key, builtin in reversed(TITAN_MODELS.items())}

JOB = '''

def {function}() -> Any:
    """This plan's job in torchtitan's config_registry form: {built_on}, with the plan's
    data-parallel degrees, reshard_after_forward, activation checkpointing, mixed precision, offload and
    optimizer implementation, and (where it names torchtitan's model) the plan's groups as its model's
    ``parallelize_fn``.
    Run it with ``--module THIS_MODULE --config {function}`` (this file on the Python path), or give
    TORCHTITAN_FLAGS after an existing job's ``--module M --config F`` (the flags cannot set parallelize_fn: that
    job shards as torchtitan does). fsdp-planner reads it back without running it: ``fsdp-planner simulate
    --from-torchtitan THIS_FILE.py:{function}``."""
{imports}

{body}
    return config


# The same settings as torchtitan's command-line flags, on top of a registry job of this model: flags cannot set
# the model itself (its flavour, float8 converter and parallelize_fn are the job's own).
TORCHTITAN_FLAGS: list[str] = [
{flags}
]
'''

# torchtitan's own job of each flavour (torchtitan/models/*/config_registry.py at b5bcd76), which the export builds
# on for what a plan does not decide: the data, tokenizer, loss, schedule and the optimizer's hyper-parameters. A
# flavour without a job of its own builds on its family's job of the same tokenizer and vocabulary (the loss's
# global_vocab_size is that job's model's); the 405B on the 70B's, as llama3_405b() converts its Linears to float8
# as it is built, which raises on a GPU without float8 (an A100). Each was built with torchtitan at b5bcd76 and its
# loss's vocabulary compared with the flavour's (benchmarks/torchtitan_export.md). Kimi's Moonlight job runs
# DistMuon, not the AdamW the plan is simulated with: no base (the job then sets the plan's settings only).
BASE_JOBS = {("llama3", "debugmodel"): "llama3_debugmodel", ("llama3", "1B"): "llama3_8b",
             ("llama3", "3B"): "llama3_8b", ("llama3", "8B"): "llama3_8b", ("llama3", "70B"): "llama3_70b",
             ("llama3", "405B"): "llama3_70b",
             ("deepseek_v3", "debugmodel"): "deepseek_v3_debugmodel", ("deepseek_v3", "16B"): "deepseek_v3_16b",
             ("deepseek_v3", "236B"): "deepseek_v3_16b", ("deepseek_v3", "671B"): "deepseek_v3_671b",
             ("qwen3", "debugmodel"): "qwen3_debugmodel", ("qwen3", "debugmodel_moe"): "qwen3_moe_debug",
             ("qwen3", "0.6B"): "qwen3_0_6b", ("qwen3", "1.7B"): "qwen3_1_7b", ("qwen3", "4B"): "qwen3_1_7b",
             ("qwen3", "8B"): "qwen3_14b", ("qwen3", "14B"): "qwen3_14b", ("qwen3", "32B"): "qwen3_32b",
             ("qwen3", "30B-A3B"): "qwen3_30b_a3b", ("qwen3", "235B-A22B"): "qwen3_30b_a3b",
             ("gpt_oss", "debugmodel"): "gpt_oss_debugmodel", ("gpt_oss", "20b"): "gpt_oss_20b",
             ("gpt_oss", "120b"): "gpt_oss_120b"}
# the flavours torchtitan's registry has no job of (b5bcd76): flags on another job run that job's flavour
NO_REGISTRY_JOB = frozenset({("llama3", "1B"), ("llama3", "3B"), ("qwen3", "4B"), ("qwen3", "8B"),
                             ("qwen3", "235B-A22B"), ("deepseek_v3", "236B")})
# the plan's optimizer as torchtitan's OptimizersContainer.Config.implementation (torchtitan runs Adam and AdamW):
# the reader's table turned round
IMPLEMENTATIONS = {name + suffix: how for name in TITAN_OPTIMIZERS.values() for how, suffix in TITAN_SUFFIXES.items()}


# The fields of torchtitan's dataclasses the job is written with, as at b5bcd76 (2026; torchtitan/config/configs.py,
# components/quantization/float8.py): ParallelismConfig has no disable_loss_parallel (TP's loss is always loss
# parallel) and no enable_async_tensor_parallel (CompileConfig has it, refusing it without a compiled model);
# TrainingConfig's mixed_precision_reduce is float32 only; Float8LinearConverter.Config has the rowwise recipes
# only, no float8 all-gather of FSDP's weights (tests/fixtures/torchtitan/config_fields.json checks the export).
TITAN_FLOAT8_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def job_settings(plan: Plan, precision: Precision) -> dict[str, dict[str, Any]]:
    """The plan as Trainer.Config sections (``activation_checkpoint``: the class, or None), in the fields
    torchtitan's dataclasses have (above), each that the simulation reads set (a job built on another keeps none
    of its base's): with tensor parallelism, ``tensor_parallel_degree``, and async TP as
    ``compile.enable_async_tensor_parallel`` where the blocks are compiled; with expert parallelism,
    ``expert_parallel_degree``; the optimizer's implementation where the plan records its optimizer. What no field
    says is ``unexpressed``'s."""
    rule = reshard_rule(plan)
    # the shard degree of the world the plan was made for where it is known (its memory is that degree's), else -1
    ranks = plan.workload.ranks // plan.tp_degree if plan.workload and plan.workload.ranks else -1
    mesh = (plan.mesh.replicate, plan.mesh.shard) if plan.mesh else (1, ranks)
    tp = plan.tensor_parallel
    ac = {ACMode.OP: "SelectiveAC", ACMode.FULL: "FullAC"}.get(job_ac(plan))
    compiled = bool(plan.compiled)  # torchtitan compiles every block; the plan, the ones it names
    implementation = IMPLEMENTATIONS.get(plan.optimizer)
    return {
        "training": {**_tokens(plan), "dtype": "bfloat16" if precision.param_bytes == 2 else "float32",
                     "mixed_precision_param": "bfloat16" if precision.compute_bytes == 2 else "float32",
                     "mixed_precision_reduce": "float32",  # torchtitan's only (a bf16 reduce is said apart)
                     "enable_cpu_offload": plan.offload,
                     # torchtitan's CUDA graphs keep the sharded grads all step (zero_grad(set_to_none=False)):
                     # on where the plan's memory counted them (a graphed job's plan, read back as planned) and
                     # nothing rules them out (``graphs_off``), else off
                     "disable_cuda_graphs": plan.zero_grad != "zeros" or graphs_off(plan) is not None},
        "parallelism": {"data_parallel_replicate_degree": mesh[0], "data_parallel_shard_degree": mesh[1],
                        "fsdp_reshard_after_forward": rule, "tensor_parallel_degree": plan.tp_degree,
                        "pipeline_parallel_degree": 1, "context_parallel_degree": 1,  # (a base job's replaced)
                        "expert_parallel_degree": plan.ep_degree,  # EP's ranks out of dp_shard, as torchtitan's
                        "spmd_backend": "partial_dtensor"},  # parallelize_fn's: FSDP2 over DTensor meshes
        "activation_checkpoint": {"class": ac},
        "compile": {"enable": compiled or plan.compiled_loss,
                    # CompileConfig's default components compile the loss too: what the plan compiles, said
                    **({"components": [*(["model"] if compiled else []), *(["loss"] if plan.compiled_loss else [])]}
                       if compiled or plan.compiled_loss else {}),
                    **({"enable_async_tensor_parallel": True} if tp is not None and tp.async_tp and compiled else {})},
        "optimizer": {"implementation": implementation} if implementation else {},
    }


def _tokens(plan: Plan) -> dict[str, int]:
    """TrainingConfig's token counts for the plan's workload: a data-parallel rank's micro-batch, the sequence
    and the step's tokens over the data-parallel ranks (torchtitan derives the accumulation steps from them; -1, its
    default, is one micro-batch a step). None known: none set."""
    w = plan.workload
    if w is None or not w.seq:  # (no sequence: no token counts to say)
        return {}
    out = {"num_tokens_per_microbatch_per_dp_rank": w.batch // w.micro_batches * w.seq, "max_context_length": w.seq,
           "num_tokens_per_train_step": -1}  # -1: one micro-batch a step (a base job's own count replaced)
    if w.micro_batches > 1 and w.ranks:
        out["num_tokens_per_train_step"] = w.batch * w.seq * (w.ranks // plan.tp_degree)
    return out


def unexpressed(plan: Plan, precision: Precision, modules: Mapping[str, nn.Module] | None) -> list[str]:
    """What of ``plan`` torchtitan's job keys cannot say, each as a sentence: the job file then runs torchtitan's
    one setting for every block (``modules``: the model's, to tell a checkpointed subset of its blocks)."""
    out = []
    if plan.model not in FLAVORS:
        out.append(f"the job names no torchtitan model for {plan.model or 'this model'}: set its config.model_spec "
                   "to your model's spec, and that spec's parallelize_fn = parallelize_fn for the plan's groups, and "
                   "give it your job's data, tokenizer and loss (it sets the plan's settings only)")
    elif FLAVORS[plan.model] not in BASE_JOBS:
        out.append(f"the job builds on no torchtitan job of {plan.model} (torchtitan's runs DistMuon, not the AdamW "
                   "the plan is simulated with): give it the job's data, tokenizer and loss")
    out += _optimizer_notes(plan) + _flags_notes(plan)
    if plan.workload is None:
        out.append("the plan records no workload (written before plans recorded it, or of a model whose batch "
                   "fsdp-planner does not know): the job sets no token counts and runs the ones of the job it builds "
                   "on (or torchtitan's defaults); read back, give them as flags (--training."
                   "num_tokens_per_microbatch_per_dp_rank N --training.max_context_length N "
                   "--training.num_tokens_per_train_step -1)")
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
        out.append(f"the plan checkpoints {fmt_count(len(full), 'module')} in full and {len(op)} op-level; "
                   "torchtitan's job checkpoints every block one way (selective here)")
    elif modules is not None and (full or op) and (blocks := _alike(full or op, modules)) > len(full or op):
        out.append(f"the plan checkpoints {len(full or op)} of the model's {blocks} blocks; torchtitan's job "
                   f"checkpoints every block ({'selective' if op else 'full'})")
    if (full or op) and plan.checkpoint_early_stop and keeps_torchtitan_groups(plan):
        out.append("torchtitan's parallelize_fn, which this EP job keeps, checkpoints with its own wrapper, which "
                   "re-runs each block whole (early_stop=False); the plan was simulated stopping early: plan with "
                   "--no-early-stop for the job's step")
    out += _reshard_notes(plan)
    if modules is not None and plan.compiled and (blocks := _alike(plan.compiled, modules)) > len(plan.compiled):
        out.append(f"the plan compiles {len(plan.compiled)} of the model's {blocks} blocks; torchtitan's job "
                   "compiles every block")
    return out + _tp_and_precision_notes(plan, precision) + _float8_notes(plan, precision)


def _flags_notes(plan: Plan) -> list[str]:
    """What ``TORCHTITAN_FLAGS`` cannot carry, and the EP job's parallelize."""
    out = []
    flavor = FLAVORS.get(plan.model)
    if keeps_torchtitan_groups(plan):
        out.append("the plan's expert parallelism on torchtitan's own MoE model is torchtitan's (its parallelize_fn "
                   "lays the experts out itself): fsdp_planner_job() keeps torchtitan's parallelize_fn, with the "
                   "plan's degrees and settings but torchtitan's groups")
        if plan.expert_parallel is not None and not plan.expert_parallel.per_param_mesh:
            # (read back, the job is planned so, and its step is that placement's: a trial's 126 ms plan read
            # back as 135 ms)
            out.append("the plan shards the experts in fully_shard calls of their own, and torchtitan's job shards "
                       "them in their blocks' calls (since pytorch/torchtitan#2281): plan with --ep-placement blocks "
                       "for the figures of the job this exports")
    # (torchtitan's default is spmd_types; the plan's FSDP2 and TP run on DTensor meshes, as its parallelize_fn)
    out.append("the job sets parallelism.spmd_backend = \"partial_dtensor\" (torchtitan's default: spmd_types): the "
               "plan's FSDP2 and TP run over DTensor device meshes, as fsdp_planner_job()'s parallelize_fn applies "
               "them")
    if plan.zero_grad and (off := graphs_off(plan)) is not None:
        out.append("the plan was simulated with the sharded grads kept all step (--zero-grad zeros, a CUDA-graph "
                   f"job's zero_grad), and the job runs eager ({off}): its grads are freed between steps, below the "
                   "plan's memory")
    elif plan.zero_grad:
        out.append("the plan was simulated with the sharded grads kept all step (--zero-grad zeros): the job replays "
                   "its step as a CUDA graph (training.disable_cuda_graphs = False), whose zero_grad keeps them so")
    if flavor in NO_REGISTRY_JOB:
        # (qwen3 8B's jobs at b5bcd76 are an SFT job and an nvfp4 one: "no registry job" read as false, a trial)
        out.append(f"torchtitan's registry has no bf16 or float8 pretraining job of {plan.model} ({flavor[0]} "
                   f"{flavor[1]}): fsdp_planner_job() builds on {BASE_JOBS[flavor]}() (the same tokenizer) and sets "
                   "the model; TORCHTITAN_FLAGS, which cannot set it, run the flavour of whichever job they are "
                   "given to")
    if plan.checkpoints and plan.checkpoint_early_stop:
        out.append("TORCHTITAN_FLAGS on another job checkpoint with torchtitan's wrapper, which re-runs each block "
                   "whole (early_stop=False): the plan stops early, as fsdp_planner_job()'s parallelize_fn does")
    if plan.loss_chunks:
        out.append(f"TORCHTITAN_FLAGS set --loss.num_chunks {plan.loss_chunks}, which needs a job whose loss is "
                   "ChunkedLossWrapper (torchtitan refuses it on a CrossEntropyLoss job's): fsdp_planner_job() sets "
                   "the loss itself")
    else:
        out.append("TORCHTITAN_FLAGS keep the job's own loss (a flag cannot change its class): on a job with "
                   "ChunkedLossWrapper they run it in chunks, where the plan's figures are of the loss whole "
                   "(fsdp_planner_job() sets CrossEntropyLoss; --loss-chunks N plans the chunks)")
    if plan.float8 is not None and plan.float8.recipe.value in TITAN_FLOAT8_RECIPES and flavor is not None:
        out.append("TORCHTITAN_FLAGS carry no float8 converter (a model's converters are no flag): fsdp_planner_job() "
                   "sets it")
    return out


def _optimizer_notes(plan: Plan) -> list[str]:
    """``unexpressed``'s sentences for the optimizer: torchtitan runs Adam and AdamW in its container."""
    if not plan.optimizer:
        return ["the plan records no optimizer (written before plans recorded it): the job runs its base's "
                "implementation (torchtitan's default: fused AdamW); give --optimizer for the plan's figures"]
    if plan.optimizer.startswith("sgd"):
        return [f"torchtitan's jobs run Adam or AdamW, not the plan's {plan.optimizer}: the job runs AdamW (two "
                "states a param, where the plan has " + ("one" if plan.optimizer == "sgd-momentum" else "none") + ")"]
    if plan.optimizer.split("-")[0] == "adam":
        return [f"the job runs its base's AdamW where the plan was simulated with {plan.optimizer} (the same state; "
                "AdamW's step also decays the weights)"]
    return []


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
                   "the Linears itself, as the plan it holds says, which --from-torchtitan reads back)")
    if f8 is not None and plan.model not in FLAVORS:
        flags = f"--float8 {f8.recipe.value}" + (" --float8-tp-all-gather" if f8.tp_float8_all_gather else "")
        out.append(f"the job names no torchtitan model for {plan.model or 'this model'}, so fsdp_planner_job() has no "
                   "float8 converter (parallelize() converts the Linears itself): read back with --from-torchtitan, "
                   f"it is a bf16 job; give {flags} for the plan's figures")
    if f8 is not None and f8.tp_float8_all_gather:
        out.append("the plan all-gathers TP's activations in float8 (torchao's float8 TP styles): parallelize() here "
                   "applies them, but fsdp_planner_job()'s torchtitan config cannot say it (torchtitan's TP has no "
                   "float8 styles since April 2026: run with torchtitan's own parallelize, TP gathers bf16"
                   + ("; --from-torchtitan reads the plan this file holds, float8 gathers included)"
                      if plan.model in FLAVORS else ")"))
    if precision.autocast:
        out.append("the plan runs under autocast, which torchtitan's job has no key for: it runs FSDP2's mixed "
                   "precision (params cast to bf16 for compute)")
    return out


def graphs_off(plan: Plan) -> str | None:
    """Why the job runs without torchtitan's CUDA graphs whatever the plan's zero_grad (None: nothing does): EP's
    all-to-all dispatcher, which they refuse (its CPU sync: Trainer.Config's _validate_cuda_graphs), and the
    host copies of CPU and activation offloading, which a captured graph does not replay as eager runs them."""
    if plan.ep_degree > 1:
        return "torchtitan's CUDA graphs refuse EP's all-to-all dispatcher here"
    if plan.offload or plan.activation_offloading:
        return "CUDA graphs off for the plan's host offloading"
    return None


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


def torchtitan_job(plan: Plan, precision: Precision, literal: Callable[[Any], str]) -> str:
    """The source of ``fsdp_planner_job()`` and ``TORCHTITAN_FLAGS`` for ``plan`` (``literal``: the export's
    ``py_literal``): torchtitan's own job of the model (``BASE_JOBS``; a fresh Trainer.Config where it has none)
    with every setting the plan decides assigned on it, as torchtitan's registry builds a job on another."""
    settings = job_settings(plan, precision)
    ac = settings["activation_checkpoint"]["class"]
    imports = ["from torchtitan.config import CompileConfig, ParallelismConfig"]
    flavor = FLAVORS.get(plan.model)
    base = BASE_JOBS.get(flavor) if flavor else None
    if base is not None:
        assert flavor is not None
        imports.append(f"from torchtitan.models.{flavor[0]}.config_registry import {base}")
        body = [f"    config = {base}()  # torchtitan's job of the model: its data, tokenizer, loss, schedule and "
                "optimizer settings"]
    else:
        imports += ["from torchtitan.components.optimizer import default_adamw",
                    "from torchtitan.trainer import Trainer"]
        body = ["    config = Trainer.Config(optimizer=default_adamw())  # the plan's settings only: give the "
                "job its data, tokenizer and loss"]
    if flavor is not None:
        imports.append(f"from torchtitan.models.{flavor[0]} import model_registry")
        converters = _converters(plan, literal)
        if converters:
            imports.append("from torchtitan.components.quantization import Float8LinearConverter")
        body.append("    # the flavour's model as the plan simulated it: model_registry's other keywords "
                    "(attn_backend, moe_comm_backend, ...) at their defaults; add your job's here")
        body.append(f"    config.model_spec = model_registry({literal(flavor[1])}{converters})")
        if not keeps_torchtitan_groups(plan):
            body.append("    config.model_spec.parallelize_fn = parallelize_fn  # the plan's groups")
    body += [f"    config.training.{k} = {literal(v)}" for k, v in settings["training"].items()]
    fields = "".join(f"\n        {k}={literal(v)}," for k, v in settings["parallelism"].items())
    body.append(f"    config.parallelism = ParallelismConfig({fields}\n    )")
    if plan.loss_chunks:  # the loss the plan's figures are of (a base job's own replaced: some chunk it, some not)
        imports.append("from torchtitan.components.loss import ChunkedLossWrapper")
        body.append(f"    config.loss = ChunkedLossWrapper.Config(num_chunks={literal(plan.loss_chunks)})")
    elif base is not None:
        imports.append("from torchtitan.components.loss import CrossEntropyLoss")
        body.append("    config.loss = CrossEntropyLoss.Config()  # the plan's loss: whole (--loss-chunks N for "
                    "torchtitan's ChunkedLossWrapper)")
    if ac:
        imports.append(f"from torchtitan.distributed.activation_checkpoint import {ac}")
    body.append(f"    config.activation_checkpoint = {ac + '.Config()' if ac else 'None'}")
    compile_fields = ", ".join(f"{k}={literal(v)}" for k, v in settings["compile"].items())
    body.append(f"    config.compile = CompileConfig({compile_fields})")
    body += [f"    config.optimizer.{k} = {literal(v)}" for k, v in settings["optimizer"].items()]
    built_on = f"torchtitan's own {base}() job" if base else "a Trainer.Config of the plan's settings"
    return JOB.format(function=FUNCTION, built_on=built_on, imports="\n".join(f"    {i}" for i in sorted(imports)),
                      body="\n".join(body),
                      flags="\n".join(f"    {', '.join(literal(w) for w in flag)}," for flag in flags(settings,
                                                                                                _loss_flags(plan))))


def _loss_flags(plan: Plan) -> list[tuple[str, ...]]:
    """The plan's chunks as a flag (tyro's field of the job's ChunkedLossWrapper.Config); a whole loss has none: a
    flag cannot change the loss's class (``_flags_notes``)."""
    return [("--loss.num_chunks", str(plan.loss_chunks))] if plan.loss_chunks else []


def _converters(plan: Plan, literal: Callable[[Any], str]) -> str:
    """torchtitan's float8 converter for a plan with float8 training (its recipe and filter, and whether the
    model is compiled, as torchtitan's own registry passes it); none for a recipe it does not have."""
    f8 = plan.float8
    if f8 is None or f8.recipe.value not in TITAN_FLOAT8_RECIPES:
        return ""
    return (f", converters=[Float8LinearConverter.Config(recipe_name={literal(f8.recipe.value)}, "
            f"filter_fqns={literal(list(f8.filter_fqns))}, model_compile_enabled={literal(bool(plan.compiled))})]")


def flags(settings: dict[str, dict[str, Any]], more: list[tuple[str, ...]] | None = None) -> list[tuple[str, ...]]:
    """torchtitan's ``--section.key VALUE`` flags, each with its value (a true flag alone, a false one as tyro's
    ``--section.no_key``, which sets it over a job that has it true), then ``more`` of them, then the checkpointing
    as tyro's subcommand, last: tyro takes the job's own options before a subcommand only (``--loss.num_chunks``
    after it: "Unrecognized options", a new user's check with tyro 1.0)."""
    out: list[tuple[str, ...]] = []
    for section in ("training", "parallelism", "compile", "optimizer"):
        for key, value in settings[section].items():
            if value is True:
                out.append((f"--{section}.{key}",))
            elif value is False:
                out.append((f"--{section}.no_{key}",))
            elif isinstance(value, list):  # tyro takes a list's items as values of their own
                out.append((f"--{section}.{key}", *map(str, value)))
            else:
                out.append((f"--{section}.{key}", str(value)))
    out += more or []
    ac = settings["activation_checkpoint"]["class"]
    out.append(({"SelectiveAC": "activation-checkpoint:selective", "FullAC": "activation-checkpoint:full",
                 None: "activation-checkpoint:none"}[ac],))
    return out
