"""Every command's arguments, with their help: the command line's grammar, in one torch-free module (each
command's ``run`` lives in ``cli/<command>.py`` and is imported only when that command runs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from fsdp_planner.choices import (
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    OPTIMIZER_NAMES,
    POLICY_NAMES,
    PRECISION_NAMES,
    ExportFormat,
    ZeroGrad,
)
from fsdp_planner.cli.options import (
    CLUSTER_HELP,
    MIN_MFU,
    TIME_STEPS,
    VERIFY_NPROC,
    VERIFY_STEPS,
    add_auto_options,
    add_float8_options,
    add_force,
    add_job_config,
    add_json,
    add_memory_options,
    add_micro_batches,
    add_model,
    add_no_offload,
    add_plan_source,
    add_policy_options,
    add_precision_options,
    add_sim_options,
    positive_int,
)
from fsdp_planner.limits import MAX_BATCH, MAX_SEQ

Subparsers = argparse._SubParsersAction

# verify --fake-world-size: the largest relative peak-memory error that passes. The memory model counts neither the
# transients of backward ops nor allocator rounding beyond the inter-stream pools; on every run of
# benchmarks/fidelity_memory.md (83 of 83) the prediction is within 5% of real FSDP2 on the fake process group.
MEMORY_TOLERANCE = 0.05
# demo: one 8-GPU H100 node training Llama 3 8B on 8,192-token sequences: a job people run, where the classic plans
# do not fit 80 GB without checkpointing every block, and the search takes seconds.
DEMO_MODEL, DEMO_CLUSTER, DEMO_OUT_DIR = "llama3-8b", "h100:8", "fsdp-planner-demo"
# fit --gpus auto: the most GPUs tried by default (512 nodes of 8), and at most the largest cluster supported
DEFAULT_MAX_FIT_GPUS, MAX_FIT_GPUS = 4096, 1_000_000
CALIBRATE_BASE = "h100:8"  # calibrate: the cluster to start from with --overhead alone


def demo(sub: Subparsers) -> None:
    sp = sub.add_parser("demo", help="the seed's problem, then auto against the classic policies on a real cluster")
    sp.add_argument("--model", default=DEMO_MODEL, help=f"the main job's model (default {DEMO_MODEL})")
    sp.add_argument("--cluster", default=DEMO_CLUSTER, help=f"the main job's cluster (default {DEMO_CLUSTER})")
    sp.add_argument("--out-dir", default=DEMO_OUT_DIR,
                    help=f"where the timeline pictures go (default ./{DEMO_OUT_DIR}/)")
    add_json(sp)


def plan(sub: Subparsers) -> None:
    sp = sub.add_parser("plan", help="plan FSDP groups for a model; without --policy compare all policies")
    add_model(sp, optional=True)
    sp.add_argument("--policy", choices=POLICY_NAMES)
    add_policy_options(sp)
    add_sim_options(sp, cluster_required=False)
    add_micro_batches(sp)
    add_memory_options(sp)
    add_json(sp)
    sp.add_argument("--out", help="write the plan JSON here")
    add_force(sp)
    sp.add_argument("--explain", action="store_true", help="auto: why each group boundary sits where it does")
    add_no_offload(sp)
    add_job_config(sp, "plan auto for, and list the config keys auto would change in,")


def fit(sub: Subparsers) -> None:
    sp = sub.add_parser("fit", help="the largest batch and longest sequence that fit a cluster with auto's plan, "
                                    "their tokens/s and MFU; --gpus auto: the fewest nodes that fit a workload")
    add_model(sp, optional=True)
    add_auto_options(sp)
    sp.add_argument("--cluster", help=CLUSTER_HELP + "; with --gpus auto, without a count (required, unless a job "
                                                     "config gives the GPU count: --cluster names its GPU)")
    sp.add_argument("--mfu", type=float, default=None,
                    help=f"run every op's FLOPs at this one fraction of the peak FLOP/s, {MIN_MFU} to 1, instead of "
                         "the cluster's roofline (per-kernel efficiencies: docs/model.md#compute)")
    add_precision_options(sp)
    sp.set_defaults(measure=False)
    add_memory_options(sp)
    sp.add_argument("--find", choices=["batch", "seq", "both"], default="both",
                    help="what to search: the largest batch at --seq, the longest sequence at --batch, or both "
                         "(the default; each point is a trace and an auto search)")
    sp.add_argument("--gpus", choices=["auto"], default=None,
                    help="auto: the fewest whole nodes of --cluster's GPU (a preset without a count, e.g. h100, or "
                         "a cluster file) on which the workload (--batch, --seq) fits, and the tokens/s at each "
                         "count tried")
    sp.add_argument("--max-gpus", type=positive_int("--max-gpus", MAX_FIT_GPUS), default=DEFAULT_MAX_FIT_GPUS,
                    help=f"--gpus auto: the most GPUs to try (default {DEFAULT_MAX_FIT_GPUS:,})")
    add_no_offload(sp)
    sp.add_argument("--time-limit", type=positive_int("--time-limit", 86_400), default=None, metavar="SECONDS",
                    help="start no search after SECONDS and print what was found so far, marked partial (exit 3; "
                         "Ctrl-C does the same, exit 130)")
    sp.add_argument("--picture", metavar="FILE.png",
                    help="draw tokens/s per GPU and the reserved peak against the batch (--gpus auto: the GPU "
                         "count), the budget and the GPU's capacity drawn (matplotlib; .png, .svg or .pdf)")
    add_force(sp)
    add_json(sp)
    add_job_config(sp, "fit (auto choosing the checkpointing and the mesh)")


def simulate(sub: Subparsers) -> None:
    sp = sub.add_parser("simulate", help="simulate one step of a plan on a cluster")
    add_plan_source(sp, optional_model=True)
    add_sim_options(sp, cluster_required=True)
    add_micro_batches(sp)
    add_memory_options(sp)
    add_json(sp)
    sp.add_argument("--timeline", metavar="FILE.png",
                    help="draw the step: stream lanes, exposed communication and the memory curve (matplotlib)")
    sp.add_argument("--html", metavar="FILE.html",
                    help="the same timeline as one self-contained HTML page (hover for group names, scroll to zoom)")
    add_force(sp)
    add_no_offload(sp)
    sp.add_argument("--compare", metavar="POLICY_OR_PLAN",
                    help="a second plan (policy name or plan JSON) simulated beside the first, drawn on the same "
                         "time axis")
    sp.add_argument("--against", metavar="TRACE.json",
                    help="a torch.profiler trace of this plan's job (verify --profile writes them): its median step "
                         "beside the simulated one on one time axis (--timeline, --html), phase by phase")
    add_job_config(sp, "simulate")


def verify(sub: Subparsers) -> None:
    sp = sub.add_parser("verify", help="train with the plan under torchrun and check it against the prediction")
    add_plan_source(sp)
    # None: not given, so that --fake-world-size can say they have no effect when they are
    sp.add_argument("--nproc", type=int, help=f"processes (ranks) to run (default {VERIFY_NPROC})")
    add_micro_batches(sp)
    sp.add_argument("--steps", type=int, help=f"training steps (default {VERIFY_STEPS})")
    sp.add_argument("--cluster", help="auto: the cluster to plan for (default: h100 with --nproc GPUs, or with "
                                      "--fake-world-size GPUs); torchrun jobs: also predict the step time on it "
                                      "and print it beside the measured one (on CPU ranks give the cluster "
                                      "`calibrate --backend gloo --nproc N` wrote on this machine)")
    sp.add_argument("--plan-for", metavar="CLUSTER",
                    help="with --policy auto: plan for CLUSTER (e.g. h100:64: its GPUs, links and world size) and "
                         "run that grouping on the --nproc job, to prove the plan auto makes at scale; an HSDP "
                         "layout runs as plain FSDP, an int reshard_after_forward the job's ranks cannot hold as "
                         "true (docs/your-model.md)")
    sp.add_argument("--plan-model", metavar="MODEL",
                    help="with --plan-for: plan this model instead, the full-size one of the same code (llama3-8b "
                         "for toy-llama; its default workload), and keep each group's modules that MODEL has "
                         "(groups of deeper blocks are left out)")
    sp.add_argument("--time-steps", type=int, default=TIME_STEPS, metavar="T",
                    help=f"after the checked steps, time T more forward + backward steps of the sharded model alone "
                         f"and report their median (default {TIME_STEPS}; 0: none)")
    sp.add_argument("--profile", type=Path, metavar="DIR",
                    help="write a torch.profiler trace of a few more steps of each rank to DIR/rankR.json (the input "
                         "of calibrate --trace and simulate --against), and their wall and CPU seconds to "
                         "DIR/rankR.cpu.json (a new or empty DIR, or one an earlier --profile wrote)")
    add_force(sp)
    sp.add_argument("--measure", action="store_true",
                    help="with --cluster: time the model's ops on this machine for the step-time prediction (one "
                         "thread, as each gloo rank runs) instead of the roofline estimate")
    sp.add_argument("--fake-world-size", type=int, metavar="W",
                    help="run real FSDP2 on W fake ranks in this process (fake process group and fake tensors, any "
                         "model, no torchrun) and compare collectives, bytes and peak memory with the prediction")
    sp.add_argument("--precision", default=None, choices=list(PRECISION_NAMES),
                    help=f"the mixed precision FSDP2 trains in (its MixedPrecisionPolicy; default {DEFAULT_PRECISION}, "
                         "as plan assumes; the model is traced in it too); --fsdp1 trains in fp32")
    sp.add_argument("--zero-grad", choices=[z.value for z in ZeroGrad], default=ZeroGrad.NONE.value,
                    help="--fake-world-size: how the loop clears grads (none = set_to_none=True, the default; "
                         "zeros = set_to_none=False)")
    sp.add_argument("--optimizer", default=None, choices=list(OPTIMIZER_NAMES),
                    help=f"--fake-world-size: the optimizer the fake ranks step and the prediction charges (default "
                         f"{DEFAULT_OPTIMIZER}: torch's foreach kernel, as a loop's torch.optim.AdamW(params) runs "
                         "on a GPU; -fused: fused=True); torchrun jobs train with SGD and momentum (parity)")
    add_memory_options(sp)
    sp.add_argument("--memory-tolerance", type=float, default=MEMORY_TOLERANCE,
                    help=f"--fake-world-size: largest relative peak-memory error that passes (default "
                         f"{MEMORY_TOLERANCE})")
    sp.add_argument("--save-checkpoint", type=Path, metavar="DIR",
                    help="after the steps, save the sharded model and optimizer as a distributed checkpoint (DCP) "
                         "in the new directory DIR")
    sp.add_argument("--load-checkpoint", type=Path, metavar="DIR",
                    help="start from a checkpoint that --save-checkpoint wrote, at any --nproc and with any plan "
                         "(resharded on load), and check the restored state is the saved one. Its files are read as "
                         "data: DCP's metadata with an allow-list of DCP's classes, values with weights_only")
    sp.add_argument("--fsdp1", action="store_true",
                    help="run the plan with FSDP1 FullyShardedDataParallel (its auto_wrap_policy, one unit per "
                         "group) instead of FSDP2; checks parity, the wrapped units and the collectives")
    add_json(sp)


def check(sub: Subparsers) -> None:
    sp = sub.add_parser("check", help="FSDP pitfalls in a model and a plan, with fixes (exit 1 on an error)")
    add_plan_source(sp)
    add_micro_batches(sp)  # (a plan of several micro-batches is checked, and its answers simulated, at its step)
    sp.add_argument("--cluster", help="the cluster the plan runs on (auto needs it; an int reshard_after_forward is "
                                      "checked against its GPU count)")
    sp.add_argument("--mfu", type=float, default=None, help=argparse.SUPPRESS)
    add_precision_options(sp)
    add_float8_options(sp)
    add_json(sp)


def export(sub: Subparsers) -> None:
    sp = sub.add_parser("export", help="write a plan as ready code: apply(model, mesh) for plain FSDP2, "
                                       "Accelerate, Lightning or torchtitan")
    sp.add_argument("plan", help="plan JSON (from `plan --out`)")
    sp.add_argument("--format", default=ExportFormat.PYTHON.value, choices=[f.value for f in ExportFormat],
                    help="python (default): apply(model, mesh); accelerate: the YAML accelerate launch "
                         "--config_file takes (--out NAME.yaml) and beside it NAME.py with shard(accelerator, model) "
                         "and prepare(accelerator, model, ...); lightning: strategy(devices) and "
                         "configure_model(model, device_mesh); torchtitan: parallelize(model, world_mesh)")
    sp.add_argument("--precision", choices=list(PRECISION_NAMES),
                    help=f"the mixed precision apply() sets (default: the one the plan file records, which `plan "
                         f"--out` writes; {DEFAULT_PRECISION}, plan's default, for a plan that records none)")
    sp.add_argument("--out", help="file to write (default: stdout): a .py file, or for accelerate a .yaml file "
                                   "(its .py hook is written beside it)")
    add_force(sp)
    add_json(sp)


def cost(sub: Subparsers) -> None:
    sp = sub.add_parser("cost", help="time of one collective on a cluster")
    sp.add_argument("collective", choices=("all-gather", "reduce-scatter"))
    sp.add_argument("size", help="full (unsharded) size, e.g. 1GiB, 512MB, 1e9")
    sp.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    sp.add_argument("--ranks", type=int, default=None, help="sub-group size (default: the whole cluster)")
    add_json(sp)


def calibrate(sub: Subparsers) -> None:
    sp = sub.add_parser("calibrate", help="fit a cluster file: links from nccl-tests logs, FSDP2's host overhead "
                                          "(--overhead), this machine's gloo ranks (--backend gloo), kernels "
                                          "(--compute), the CPU optimizer (--cpu-optimizer), or a profiler trace "
                                          "of your job (--trace)")
    sp.add_argument("logs", nargs="*", help="all_gather_perf / reduce_scatter_perf output files")
    sp.add_argument("--overhead", action="store_true",
                    help="time real FSDP2 (fake process group, tiny layers) on this machine's GPU, or CPU when it "
                         "has none, and fit its per-hook, per-param and per-op host cost and its copy bandwidth")
    sp.add_argument("--compute", action="store_true",
                    help="time matmuls, fused attention and an elementwise op on this machine's CUDA GPU and fit the "
                         "roofline's efficiencies (the cluster file's compute section) against --base's peaks")
    sp.add_argument("--cpu-optimizer", action="store_true",
                    help="time torch's AdamW on one rank's share of this host's cores and write it as the cluster's "
                         "cpu_optimizer_rate (the optimizer step of --offload plans)")
    sp.add_argument("--backend", choices=["gloo"],
                    help="measure this machine's CPU ranks in a torchrun job instead: gloo collectives over a sweep "
                         "of sizes and FSDP2's per-group, per-param and per-op cost, fitted into a cluster whose "
                         "step-time predictions verify --cluster checks")
    sp.add_argument("--nproc", type=int, default=2, help="--backend gloo: ranks (processes) to run (default 2)")
    sp.add_argument("--trace", action="append", metavar="TRACE.json",
                    help="fit the cluster to torch.profiler Chrome traces of a job (repeat for more ranks or runs; "
                         "verify --profile writes them): with --model and --plan or --policy, the job's")
    sp.add_argument("--model", dest="trace_model", metavar="MODEL", help="--trace: the traced job's model")
    sp.add_argument("--batch", type=positive_int("--batch", MAX_BATCH), default=None,
                    help="--trace: the traced job's micro-batch size per rank (default: the model factory's)")
    sp.add_argument("--seq", type=positive_int("--seq", MAX_SEQ), default=None,
                    help="--trace: the traced job's sequence length (default: the model factory's)")
    sp.add_argument("--plan", help="--trace: the traced job's plan JSON file")
    sp.add_argument("--policy", choices=POLICY_NAMES, help="--trace: the traced job's policy (instead of --plan; "
                                                            "auto's plan depends on its cluster: give its --plan)")
    add_policy_options(sp)
    sp.add_argument("--precision", default=DEFAULT_PRECISION, choices=list(PRECISION_NAMES),
                    help=f"--trace: what the job trained in (default {DEFAULT_PRECISION})")
    sp.add_argument("--base", help="cluster to start from: a preset (e.g. h100:16) or a cluster JSON; default: "
                                   f"detected from the logs, or {CALIBRATE_BASE} with --overhead alone")
    sp.add_argument("--out", required=True, help="cluster JSON to write")
    add_force(sp)
    add_json(sp)


def memory(sub: Subparsers) -> None:
    sp = sub.add_parser("memory", help="per-rank memory: one device, DDP, ZeRO-1/2, FSDP (ZeRO-3)")
    add_model(sp)
    where = sp.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help=CLUSTER_HELP + " (its GPU count is the world size; its GPU's memory the "
                                                        "capacity the rows are held against)")
    where.add_argument("--world-size", type=int,
                       help="ranks sharing the model (DDP, ZeRO and FSDP divide by it), without a cluster")
    add_precision_options(sp)
    add_json(sp)


def models(sub: Subparsers) -> None:
    sp = sub.add_parser("models", help="list the built-in models and the shipped Hugging Face configs")
    add_json(sp)


# In the order ``fsdp-planner --help`` lists them; each is also the module under cli/ whose ``run`` executes it.
COMMANDS: tuple[Callable[[Subparsers], None], ...] = (demo, plan, fit, simulate, verify, check, export, cost, calibrate,
                                                      memory, models)
