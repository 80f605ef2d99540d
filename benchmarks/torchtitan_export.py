"""``export --format torchtitan`` on torchtitan's own models, beside torchtitan's own parallelize.

Where torchtitan is importable (not in CI: it needs a checkout, tyro, spmd_types, grain, datasets, tensorboard,
triton), this builds a torchtitan flavour as torchtitan's Trainer does (its registry job, meta init, its
ParallelDims on gloo, CPU) and shards it twice on 4 ranks: with the job's own ``model_spec.parallelize_fn`` and
with the exported plan's ``parallelize_fn`` (``fsdp_planner_job()``'s). Both then take one forward pass on the same
tokens after the same seeded ``init_weights``. Written to the table: FSDP modules, every param's local shape and
placements, and the outputs' sums. torchtitan's FlexAttention has no backward on CPU, so no step is taken here.

    python benchmarks/torchtitan_export.py --torchtitan PATH/TO/TORCHTITAN [--python PY] [--commit C] \\
        > benchmarks/torchtitan_export.md

A second table loads the exported job of every torchtitan flavour fsdp-planner knows as torchtitan's launcher does
(``ConfigManager.parse_args(["--module", M, "--config", "fsdp_planner_job"])``) and builds what its Trainer builds
from the job's config without a GPU: the optimizer container (on a small module), the loss, and the settings; then
the export's ``TORCHTITAN_FLAGS`` on top of the flavour's own registry job, which must give the same settings.

torchtitan's default ``spmd_backend = "spmd_types"`` is not run: torchtitan's own parallelize fails under it on
torch 2.13 (fully_shard with dp_mesh_dims and plain params); the export's job sets "partial_dtensor".
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (torchtitan module, its registry job, the plan: fsdp-planner model and policy flags, TP degree)
CASES = [("llama3", "llama3_debugmodel", "llama3-debugmodel", [], 1),
         ("llama3", "llama3_debugmodel", "llama3-debugmodel", ["--tp", "2"], 2),
         ("llama3", "llama3_debugmodel", "llama3-debugmodel", ["--mesh", "2x2"], 1),
         ("qwen3", "qwen3_debugmodel", "hf:titan-qwen3-debugmodel", [], 1),
         # auto's one group of transformers' backbone and head: torchtitan's Decoder's parts in one group
         ("qwen3", "qwen3_debugmodel", "hf:titan-qwen3-debugmodel",
          ["--policy", "auto", "--tp", "1", "--batch", "4", "--seq", "256"], 1)]
WORLD, TOKENS = 4, 128


def worker(module: str, job: str, exported: str | None, tp: int, replicate: int, out: str) -> None:
    """One rank: torchtitan's Trainer's build of ``job``'s model, sharded by its own parallelize_fn or by the
    exported ``fsdp_planner_job()``'s, then one forward."""
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as tools
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    tools.device_type = parallel_dims_module.device_type = "cpu"  # torchtitan assumes a GPU
    dist.init_process_group("gloo")
    config = getattr(importlib.import_module(f"torchtitan.models.{module}.config_registry"), job)()
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.tensor_parallel_degree = tp
    config.parallelism.data_parallel_replicate_degree = replicate
    spec = config.model_spec
    if exported:
        sys.path.insert(0, str(Path(exported).parent))
        config = importlib.import_module(Path(exported).stem).fsdp_planner_job()
        spec = config.model_spec
    dims = ParallelDims(dp_replicate=replicate, dp_shard=WORLD // tp // replicate, cp=1, tp=tp, pp=1, ep=1,
                        world_size=WORLD, spmd_backend="partial_dtensor")
    dims.build_mesh()
    dist_utils.set_spmd_backend("partial_dtensor")
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
                                compile_config=config.compile, ac_config=None, dump_folder=tempfile.gettempdir())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    shards = sorted((n, tuple(p.to_local().shape), str(p.placements)) for n, p in model.named_parameters())
    tokens = torch.randint(0, 100, (TOKENS,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(TOKENS) % 64
    with torch.no_grad():
        logits = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions=positions))
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({
            "fsdp": sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("FSDP")),
            "params": len(shards), "shards": hashlib.sha256(repr(shards).encode()).hexdigest()[:12],
            "sum": float(logits.float().sum()), "abs": float(logits.float().abs().sum())}))
    dist.destroy_process_group()


def drive(torchtitan: str, python: str, commit: str) -> None:
    """Each case twice (torchtitan's parallelize, the export's), a markdown table on stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([torchtitan, os.environ.get("PYTHONPATH", "")])}
    tmp = Path(tempfile.mkdtemp())
    print("# torchtitan export beside torchtitan's own parallelize\n")
    print(f"`python benchmarks/torchtitan_export.py --torchtitan PATH --commit C`: torchtitan "
          f"{commit}, torch {_torch(python)}, {WORLD} gloo ranks on CPU, {TOKENS} tokens, one forward "
          "(`spmd_backend = \"partial_dtensor\"`). The plan is fsdp-planner's (`plan MODEL --policy titan FLAGS "
          "--cluster h100:4`; a FLAGS `--policy auto` replaces titan), exported with `--format torchtitan`; its "
          "`fsdp_planner_job()` builds the model and sets `parallelize_fn`. Both run without activation "
          "checkpointing (`ac_config=None`), as the plan does.\n")
    print("| torchtitan job | plan | FSDP modules: torchtitan's / the plan's | params: local shapes and placements "
          "| output sum: "
          "torchtitan / export | wall s |")
    print("|---|---|---|---|---|---|")
    for module, job, model, flags, tp in CASES:
        replicate = int(flags[1].split("x")[0]) if flags[:1] == ["--mesh"] else 1
        plan, code = tmp / f"{job}_{tp}_{replicate}.json", tmp / f"tt_{module}_{tp}_{replicate}.py"
        start = time.perf_counter()
        subprocess.run(["fsdp-planner", "plan", model, "--policy", "titan", *flags, "--cluster", "h100:4",
                        "--out", str(plan)], check=True, capture_output=True)
        subprocess.run(["fsdp-planner", "export", str(plan), "--format", "torchtitan", "--out", str(code)],
                       check=True, capture_output=True)
        runs = []
        for exported in (None, str(code)):
            out = tmp / "out.json"
            cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
                   str(_free_port()), __file__, "--worker", module, job, exported or "-", str(tp), str(replicate),
                   str(out)]
            ran = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if ran.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{ran.stderr[-3000:]}")
            seen = json.loads(out.read_text())
            runs.append(seen)
        own, ours = runs
        same_fsdp = own["fsdp"] == ours["fsdp"]
        # torchtitan's job wraps each block for checkpointing: its param names carry the wrapper's prefix
        print(f"| {module}:{job} | {model} {' '.join(flags) or '(FSDP 4)'} | {len(own['fsdp'])} / {len(ours['fsdp'])}"
              f"{' (the same)' if same_fsdp else ''} | {ours['params']} params, digest {own['shards']} / "
              f"{ours['shards']} | {own['sum']:.6f} / {ours['sum']:.6f} | {time.perf_counter() - start:.1f} |")


# the plan each job check exports: a workload, a 2-D layout on 64 GPUs and the foreach optimizer (torchtitan's
# default is fused: the job must set what the plan was simulated with)
JOB_WORKLOAD = (2, 4096, 1, 64, 8)  # batch, seq, micro-batches, ranks, nodes


def job_check(code: str, base: str, out: str) -> None:
    """In torchtitan's Python: the exported job loaded as its launcher loads it, and its flags over ``base``
    (``module:function``, or "-" for none); what each builds, as JSON."""
    import torch
    from torchtitan.config import ConfigManager

    sys.path.insert(0, str(Path(code).parent))
    built = {}
    jobs = [("job", Path(code).stem, "fsdp_planner_job", [])]
    if base != "-":
        flags = importlib.import_module(Path(code).stem).TORCHTITAN_FLAGS
        jobs.append(("flags", *base.split(":"), flags))
    for name, module, function, flags in jobs:
        config = ConfigManager().parse_args(["--module", module, "--config", function, *flags])
        seen: dict = {"settings": [config.training.num_tokens_per_microbatch_per_dp_rank,
                                   config.training.max_context_length, config.training.num_tokens_per_train_step,
                                   config.parallelism.data_parallel_shard_degree,
                                   config.parallelism.tensor_parallel_degree,
                                   config.parallelism.pipeline_parallel_degree, config.compile.enable,
                                   type(config.activation_checkpoint).__name__, config.optimizer.implementation]}
        try:
            optimizers = config.optimizer.build(model_parts=[torch.nn.Linear(4, 4)])
            group = optimizers.optimizers[0].param_groups[0]
            seen["optimizer"] = (f"{type(optimizers.optimizers[0]).__name__} lr {group['lr']:g}, "
                                 f"{'fused' if group.get('fused') else 'foreach' if group.get('foreach') else 'loop'}")
        except Exception as e:  # what torchtitan's Trainer would raise
            seen["optimizer"] = f"{type(e).__name__}: {str(e)[:80]}"
        try:
            loss = config.loss.build()
            vocab = getattr(getattr(config.loss, "loss_fn", config.loss), "global_vocab_size", None)
            seen["loss"] = f"{type(loss).__name__}, vocab {vocab}"
        except Exception as e:
            seen["loss"] = f"{type(e).__name__}: {str(e)[:80]}"
        spec = config.model_spec
        seen["model_vocab"] = getattr(getattr(spec, "model", None), "vocab_size", None) if spec else None
        seen["data"] = type(config.dataloader).__qualname__
        built[name] = seen
    Path(out).write_text(json.dumps(built))


def drive_jobs(torchtitan: str, python: str) -> None:
    """Every flavour's exported job through torchtitan's launcher: a second markdown table on stdout."""
    from fsdp_planner.apply.export import export_plan
    from fsdp_planner.apply.torchtitan_job import BASE_JOBS, FLAVORS
    from fsdp_planner.choices import ExportFormat
    from fsdp_planner.fsdp2.plan import Group, Plan, Workload
    from fsdp_planner.fsdp2.tensor_parallel import TensorParallel

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([torchtitan, os.environ.get("PYTHONPATH", "")])}
    tmp = Path(tempfile.mkdtemp())
    print("\n## The exported job as torchtitan's launcher loads it\n")
    print("Each flavour's plan (one group, TP 8 on 64 GPUs, batch 2 x 4,096 per data-parallel rank, foreach AdamW) "
          "exported and loaded with `ConfigManager.parse_args([\"--module\", M, \"--config\", "
          "\"fsdp_planner_job\"])`, then the optimizer container built on a small module and the loss built, as "
          "torchtitan's Trainer builds them; `TORCHTITAN_FLAGS` on the flavour's own registry job must give the same "
          "settings (token counts, dp_shard, TP, PP, compile, checkpointing, optimizer implementation).\n")
    print("| plan's model | built on | optimizer | loss (the model's vocabulary) | data | flags on the registry job |")
    print("|---|---|---|---|---|---|")
    for model, (name, flavor) in sorted(FLAVORS.items(), key=lambda kv: kv[1]):
        batch, seq, micro, ranks, nodes = JOB_WORKLOAD
        plan = Plan([Group([""])], "", 0, model=model, workload=Workload(batch, seq, micro, ranks, nodes),
                    tensor_parallel=TensorParallel(8, {}), optimizer="adamw")
        code = tmp / f"tt_{name}_{flavor.replace('.', '_').replace('-', '_').lower()}.py"
        code.write_text(export_plan(plan, ExportFormat.TORCHTITAN))
        base = BASE_JOBS.get((name, flavor))
        out = tmp / "job.json"
        ran = subprocess.run([python, __file__, "--job", str(code), f"{name}:{base}" if base else "-", str(out)],
                             env=env, capture_output=True, text=True, cwd=tmp)
        if ran.returncode:
            sys.exit(f"{code} failed:\n{ran.stderr[-3000:]}")
        seen = json.loads(out.read_text())
        job = seen["job"]
        flags = "the same" if "flags" in seen and seen["flags"]["settings"] == job["settings"] else \
            "(no registry job)" if "flags" not in seen else f"differ: {seen['flags']['settings']}"
        print(f"| {model} | {base + '()' if base else 'Trainer.Config()'} | {job['optimizer']} | {job['loss']} "
              f"({job['model_vocab']}) | {job['data']} | {flags} |")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torch(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True).stdout.strip()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        m, j, e, t, r, o = sys.argv[2:8]
        worker(m, j, None if e == "-" else e, int(t), int(r), o)
    elif sys.argv[1:2] == ["--job"]:
        job_check(*sys.argv[2:5])
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        parser.add_argument("--torchtitan", required=True, help="a torchtitan checkout (its root holds torchtitan/)")
        parser.add_argument("--python", default=sys.executable, help="a Python with torchtitan's dependencies")
        parser.add_argument("--commit", default="(commit not given)", help="torchtitan's commit, for the table")
        parser.add_argument("--jobs-only", action="store_true", help="the second table only (no gloo runs)")
        args = parser.parse_args()
        if not args.jobs_only:
            drive(args.torchtitan, args.python, args.commit)
        drive_jobs(args.torchtitan, args.python)
