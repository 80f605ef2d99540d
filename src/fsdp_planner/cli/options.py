"""The options several commands take, defined once (their meaning, default and help); the simulation's defaults
come from ``choices.py``. Imports nothing heavy: the parser is built without torch."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable

from fsdp_planner.choices import (
    ATTENTION_NAMES,
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    DEFAULT_SAC_POLICY,
    EXPERT_PLACEMENT_NAMES,
    FLOAT8_RECIPES,
    GRADIENT_SYNC_NAMES,
    OPTIMIZER_NAMES,
    POLICY_NAMES,
    PRECISION_NAMES,
    SAC_POLICY_NAMES,
    ACMode,
    ReduceDtype,
    ShardPlacement,
    Target,
    ZeroGrad,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, parse_count
from fsdp_planner.limits import MAX_BATCH, MAX_EP_DEGREE, MAX_SEARCH_EFFORT, MAX_SEQ, MAX_TP_DEGREE, MIN_MFU

CLUSTER_HELP = "preset and GPU count (h100:64, h100e:128, a100:16, b200:8, h200:512) or a cluster JSON file"

VERIFY_NPROC, VERIFY_STEPS = 2, 3  # verify's torchrun job when --nproc and --steps are not given
# verify: forward + backward steps timed after the checked ones, their median reported. A quick look, not a
# measurement: on a shared 2-vCPU host one job's median moves by up to 2x between runs, so
# benchmarks/fidelity_time.md times 9 steps in each of 5 jobs per plan and takes the median of their medians.
TIME_STEPS = 5




def positive_int(option: str, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least 1 and at most ``maximum`` (``1e3`` reads too), one line
    otherwise."""
    return _whole_number(option, 1, maximum)


def non_negative_int(option: str, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least 0 and at most ``maximum`` (``1e3`` reads too), one line
    otherwise."""
    return _whole_number(option, 0, maximum)


def _whole_number(option: str, minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = parse_count(text, option)
        except PlannerError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{option} must be at least {minimum}, got {cut_short(text)}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{option} must be at most {maximum:,}, got {cut_short(text)}")
        return value
    return parse



def add_policy_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--module-classes", help="comma-separated class names (default: the repeated block class)")
    sp.add_argument("--min-nonwrapped-numel", default=None,
                    help="size policy threshold in elements, e.g. 100000000 or 1e8 (default 1e8, FSDP1's; at most "
                         "1e15)")
    sp.add_argument("--target-bytes", help="order policy group size, e.g. 64MiB, in the model's bytes before TP "
                    "splits them (default: one block)")
    add_auto_options(sp)


def add_auto_options(sp: argparse.ArgumentParser) -> None:
    """The options auto reads (a command that runs auto alone, ``fit``, takes these and no classic policy's)."""
    sp.set_defaults(module_classes=None, min_nonwrapped_numel=None, target_bytes=None)
    sp.add_argument("--memory-budget", help="auto: per-rank peak memory budget, e.g. 60GiB, taken as given (default: "
                                            "the memory of one of the cluster's GPUs less --headroom)")
    sp.add_argument("--headroom", metavar="FRACTION_OR_SIZE",
                    help="memory held back below the GPU's capacity for what the memory model does not know "
                         "(allocator fragmentation, its error against real FSDP2): a fraction (0.05 or 5%%) or a "
                         "size (4GiB); auto's budget and every fits verdict use capacity less headroom (default "
                         "5%%; 0: the whole GPU). Not with --memory-budget, which is taken as given")
    sp.add_argument("--search-effort", type=non_negative_int("--search-effort", MAX_SEARCH_EFFORT), default=None,
                    metavar="N",
                    help="auto: plans its local refinement may simulate, counted, never timed, so the same command "
                         "gives the same plan on any machine (default: 6,000,000 trace events' worth, at least 24: "
                         "~520 plans of an 8B Llama, ~27 of a 10,000-module model)")
    sp.add_argument("--target", choices=[t.value for t in Target], default=None,
                    help="auto: plans FSDP2 can apply (fsdp2, the default) or only what FSDP1 can express")
    sp.add_argument("--ac", choices=[m.value for m in ACMode], default=None,
                    help="activation checkpointing of the repeated blocks: none, full (every block), op (every "
                         "block with op-level selective checkpointing, torchtitan's selective_ac_option=op; see "
                         "--ac-policy) or selective (every second block in full, torchtitan's removed "
                         "selective_ac_option=2), or offload (no checkpointing: every block's saved activations "
                         "copied to the host with save_on_cpu, not overlapped); default none. With auto, a mode "
                         "given is fixed for every plan it tries (offload included); without --ac, auto chooses "
                         "which blocks to checkpoint in full, and offload as a last resort when nothing fits")
    sp.add_argument("--ac-policy", choices=SAC_POLICY_NAMES, default=None,
                    help=f"with --ac op, or auto's own op-level choices (auto without --ac): the ops whose outputs "
                         f"are kept, the rest recomputed: titan (torchtitan's "
                         f"SelectiveAC of 2026), titan-2025 (its llama3 save list of 2025) or titan-early (its 2024 "
                         f"list); default {DEFAULT_SAC_POLICY.value}")
    sp.add_argument("--early-stop", action=argparse.BooleanOptionalAction, default=None,
                    help="checkpointed modules stop their recomputation after the last tensor their forward saved "
                         "(torch.utils.checkpoint's default); --no-early-stop re-runs each one's whole forward, as "
                         "torchtitan's checkpoint wrapper does (a --from-torchtitan job runs so; a plan file that "
                         "records checkpoint_early_stop false keeps it)")
    sp.add_argument("--mesh", metavar="RxS",
                    help="the data-parallel layout: R replicas of S-rank shard groups (HSDP; R*S = the GPU count, "
                         "divided by the TP degree with --tp; e.g. 2x4); default pure FSDP over all GPUs, and auto "
                         "chooses")
    sp.add_argument("--tp", type=positive_int("--tp", MAX_TP_DEGREE), default=None, metavar="N",
                    help="tensor parallelism of degree N inside each node (the innermost mesh dim), FSDP over the "
                         "rest: the layout from the plan file, transformers' tp plan for hf: models (refused where "
                         "it has none), torchtitan's for the built-in Llamas, else the column-then-row Linear pairs "
                         "found in your model; default none, and "
                         "auto chooses among 1, 2, 4, 8")
    add_ep_options(sp)
    sp.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=None,
                    help="with TP: keep the output head's logits sharded on the vocab and run the loss under "
                         "loss_parallel() (default on where the layout shards the output head, as torchtitan)")
    sp.add_argument("--async-tp", action="store_true", default=False,
                    help="with TP: torchtitan's async TP (the TP collectives overlapped with their matmuls; needs "
                         "compile)")


def add_ep_options(sp: argparse.ArgumentParser) -> None:
    """Expert parallelism's degree and where FSDP2 shards the experts."""
    sp.add_argument("--ep", type=positive_int("--ep", MAX_EP_DEGREE), default=None, metavar="N",
                    help="expert parallelism of degree N over the model's grouped experts (E / N experts a rank, "
                         "the tokens sent to them by all-to-all), the experts FSDP-sharded over the data-parallel "
                         "shard ranks / N in their blocks' fully_shard calls (a per-param mesh, as torchtitan "
                         "since 2026-03), or in calls of their own where auto finds that faster (--ep-placement "
                         "fixes it); default none")
    sp.add_argument("--ep-placement", choices=EXPERT_PLACEMENT_NAMES, default=None,
                    help="with EP: where FSDP2 shards the experts: 'blocks', in their blocks' fully_shard calls on a "
                         "per-param mesh (torchtitan since 2026-03), or 'own', each experts module fully_shard-ed "
                         "alone (torchtitan before; it can stay unsharded after forward apart from its block); "
                         "default blocks (own where the policy wraps no module above them: size), and auto "
                         "chooses (the plan file's expert_parallel.per_param_mesh)")


def add_model(sp: argparse.ArgumentParser, optional: bool = False) -> None:
    """MODEL and its workload; ``optional``: a job config may name the model instead (checked by the parser)."""
    sp.add_argument("model", nargs="?" if optional else None,
                    help="built-in name (see fsdp-planner models), path/file.py:fn, package.module:fn, "
                         "hf:NAME or hf:path/config.json" + ("; with --from-torchtitan, the job's model" if optional
                                                            else ""))
    sp.add_argument("--batch", type=positive_int("--batch", MAX_BATCH), default=None,
                    help="micro-batch size per rank: the factory's batch_size argument, 1 to 1,000,000 (default: "
                         "the factory's; see fsdp-planner models)")
    sp.add_argument("--seq", type=positive_int("--seq", MAX_SEQ), default=None,
                    help="sequence length: the factory's seq_len argument, 1 to 10,000,000 (default: the "
                         "factory's); --batch x --seq at most 1e9 tokens")
    sp.add_argument("--attention", choices=ATTENTION_NAMES, default=None,
                    help="the attention kernel the real run uses: sdpa (what F.scaled_dot_product_attention runs on "
                         "a GPU: flash or memory-efficient, O(seq) saved), flash (flash-attn: the same memory, "
                         "soft-capping too) or eager (the math path: O(seq^2) scores saved); default: sdpa, and a "
                         "Hugging Face model's own choice (recorded in the plan)")
    sp.add_argument("--compile", action="store_true",
                    help="the repeated blocks run torch.compile'd (fullgraph), as torchtitan's compile.enable: what "
                         "each saves for backward is what AOTAutograd's partitioner saves (recorded in the plan)")
    sp.add_argument("--compile-loss", action="store_true",
                    help="the loss runs torch.compile'd apart from the model, as torchtitan's compile.components "
                         "\"loss\": what it holds is what AOTAutograd's partitioner and inductor's fusion make (a "
                         "language model's cross-entropy without its fp32 copies of the logits; recorded in the plan)")
    sp.add_argument("--loss-chunks", type=int, default=None, metavar="N",
                    help="the output layer and the loss run in N chunks of the tokens, each with its backward, as "
                         "torchtitan's ChunkedLossWrapper (its default: 8): one chunk's logits alive at a time, "
                         "beside an fp32 buffer of the hidden states' gradient (2 to 1,024; recorded in the plan)")
    sp.add_argument("--routing", type=float, default=None, metavar="CAPACITY",
                    help="capacity factor of the balanced-routing stand-in that data-dependent ops (a torch.where "
                         "or nonzero router, .item() checks) run while planned: each expert gets tokens x top_k / "
                         "experts x CAPACITY rows (default 1; 0.1 to 64)")
    sp.add_argument("--fp32-modules", default=None, metavar="NAME[,NAME...]",
                    help="modules kept in fp32 under a mixed precision, each in an fp32 group of its own "
                         "(MixedPrecisionPolicy(param_dtype=float32)), e.g. MoE routers; BatchNorm with running "
                         "stats gets one without asking")
    sp.add_argument("--hf-config", action="append", metavar="KEY=VALUE", default=None,
                    help="hf: models: set a config field over the file's (repeatable; VALUE a JSON scalar, e.g. "
                         "use_cache=true, num_hidden_layers=4); training builds the model with use_cache=false "
                         "unless set here")
    sp.add_argument("--full-trace", action="store_true",
                    help="trace every module call (slower); by default identical calls of a repeated block are "
                         "traced once, which assumes its forward depends only on its own state and arguments")


# ``add_model``'s and ``add_precision_options``' options a hint naming the same job repeats: valued, switches
_JOB_VALUES = (("batch", "--batch"), ("seq", "--seq"), ("attention", "--attention"), ("loss_chunks", "--loss-chunks"),
               ("routing", "--routing"), ("fp32_modules", "--fp32-modules"), ("optimizer", "--optimizer"))
_JOB_SWITCHES = (("compile", "--compile"), ("compile_loss", "--compile-loss"), ("full_trace", "--full-trace"))


def job_flags(args: argparse.Namespace) -> list[str]:
    """The model's, workload's and precision options given (not at their defaults), shell-quoted: what a command
    the output suggests needs to run the same job."""
    flags: list[str] = []
    for dest, flag in _JOB_VALUES:
        if getattr(args, dest, None) is not None:
            flags += [flag, str(getattr(args, dest))]
    flags += [flag for dest, flag in _JOB_SWITCHES if getattr(args, dest, False)]
    for kv in getattr(args, "hf_config", None) or ():
        flags += ["--hf-config", kv]
    if getattr(args, "precision", DEFAULT_PRECISION) != DEFAULT_PRECISION:
        flags += ["--precision", args.precision]
    if getattr(args, "zero_grad", ZeroGrad.NONE.value) != ZeroGrad.NONE.value:
        flags += ["--zero-grad", args.zero_grad]
    return [shlex.quote(f) for f in flags]


def add_micro_batches(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--micro-batches", metavar="N",
                    help="gradient accumulation: split --batch (then the per-GPU batch of the optimizer step) into N "
                         "micro-batches of --batch/N, each a forward + backward, with "
                         "set_requires_gradient_sync(False) on all but the last (reduce-scatters in its backward "
                         "only; see --gradient-sync); default 1, except that plan --policy auto with a --batch "
                         "above 1 compares its three smallest splits (auto: up to eight) and keeps the fastest "
                         "that fits")
    sp.add_argument("--no-reshard-after-backward", dest="reshard_after_backward", action="store_false",
                    help="with --micro-batches: also set_reshard_after_backward(False) on all but the last "
                         "micro-batch, keeping the params gathered between micro-batches (no all-gather before "
                         "their next forward use; more memory)")
    sp.add_argument("--gradient-sync", choices=GRADIENT_SYNC_NAMES,
                    help="with --micro-batches: which micro-batches' backwards reduce-scatter. last (default): "
                         "set_requires_gradient_sync(False) on the others, their unsharded grads kept until the "
                         "last; every: gradient sync never disabled (as torchtitan's train_step), each backward "
                         "reduce-scatters and adds into the sharded grads")


def add_plan_source(sp: argparse.ArgumentParser, optional_model: bool = False) -> None:
    add_model(sp, optional_model)
    sp.add_argument("--plan", help="plan JSON file (from plan --out)")
    sp.add_argument("--policy", choices=POLICY_NAMES)
    add_policy_options(sp)


def add_sim_options(sp: argparse.ArgumentParser, cluster_required: bool) -> None:
    """``cluster_required``: the command needs ``--cluster`` (unless a job config gives the GPU count: the parser
    checks it, as argparse would)."""
    sp.add_argument("--cluster", help=CLUSTER_HELP + (" (required; with --from-torchtitan or --from-accelerate a "
                                                      "preset name alone: the config gives the GPU count)"
                                                      if cluster_required else ""))
    sp.add_argument("--mfu", type=float, default=None,
                    help=f"run every op's FLOPs at this one fraction of the peak FLOP/s, {MIN_MFU} to 1, instead of "
                         "the cluster's roofline (per-kernel efficiencies: docs/model.md#compute); not with --measure")
    add_precision_options(sp)
    sp.add_argument("--measure", action="store_true",
                    help="time the model's ops for real on this machine (GPU if present) instead of the roofline "
                         "estimate; the model must fit unsharded")


def add_precision_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--precision", default=DEFAULT_PRECISION,
                    help=f"{', '.join(PRECISION_NAMES)} (default {DEFAULT_PRECISION})")
    sp.add_argument("--optimizer", default=None,  # None: not given (a config's optimizer may stand)
                    help=f"{', '.join(OPTIMIZER_NAMES)} (default {DEFAULT_OPTIMIZER}, or the job config's)")
    sp.add_argument("--zero-grad", choices=[z.value for z in ZeroGrad], default=ZeroGrad.NONE.value,
                    help="how the loop clears grads: none = zero_grad(set_to_none=True), the default; zeros = "
                         "set_to_none=False (sharded grads kept all step)")


def add_memory_options(sp: argparse.ArgumentParser) -> None:
    """FSDP2's memory options (``fully_shard`` arguments), recorded in the plan and simulated."""
    sp.add_argument("--offload", action="store_true",
                    help="CPUOffloadPolicy: sharded params, grads and optimizer state on the CPU, the optimizer step "
                         "on the CPU (default off; auto turns it on only when nothing fits without it)")
    sp.add_argument("--cpu-optimizer-rate", type=float, default=None, metavar="ELEMENTS_PER_S",
                    help="with offload: the host's optimizer step rate per rank, elements/s (e.g. 615e6; default: "
                         "the cluster's cpu_optimizer_rate, a preset's derived in hardware/cluster.py; measure yours "
                         "with benchmarks/cpu_adamw.py)")
    sp.add_argument("--shard-placement", choices=[p.value for p in ShardPlacement], default=None,
                    help="dim0: FSDP2's Shard(0) for every param (default); auto: Shard(1) where dim 0 has fewer rows "
                         "than the shard size and dim 1 divides evenly (MoE experts). The auto policy keeps a "
                         "placement given here; without one it tries dim-1 sharding where nothing fits without it "
                         "or where it is faster")
    sp.add_argument("--reduce-dtype", choices=[d.value for d in ReduceDtype], default=None,
                    help="MixedPrecisionPolicy.reduce_dtype: the dtype grads are reduce-scattered in (default: the "
                         "precision's, fp32 for bf16-mixed; bf16 halves the bytes and changes numerics)")
    add_float8_options(sp)


def add_float8_options(sp: argparse.ArgumentParser) -> None:
    """Float8 training (torchao's Float8Linear), recorded in the plan and simulated with FSDP2's options."""
    sp.add_argument("--float8", choices=FLOAT8_RECIPES, default=None, metavar="RECIPE",
                    help="float8 training as torchtitan's float8 converter: each Linear with dims that are multiples "
                         "of 16, but those whose name holds output or lm_head (torchtitan's filter for the output "
                         "head; --float8-skip adds names), runs its matmuls in float8 with torchao's tensorwise or "
                         "rowwise scaling; tensorwise all-gathers the converted weights in float8 (1 byte a param) "
                         "with scales precomputed after each optimizer step (default: none)")
    sp.add_argument("--float8-skip", dest="float8_skip", default=None, metavar="NAMES",
                    help="with --float8: Linears kept in bf16 besides the output head's names, comma-separated; a "
                         "Linear whose name holds one is left out (torchtitan's filter_fqns), such as a head named "
                         "otherwise (lm_out)")
    sp.add_argument("--no-float8-all-gather", dest="float8_all_gather", action="store_false", default=None,
                    help="with --float8 tensorwise: all-gather the converted weights in bf16 and cast them in "
                         "forward (torchtitan's enable_fsdp_float8_all_gather false)")
    sp.add_argument("--float8-tp-all-gather", dest="float8_tp_all_gather", action="store_true", default=None,
                    help="with --float8 tensorwise and --tp (or auto's TP): torchao's float8 TP styles "
                         "(Float8ColwiseParallel, "
                         "Float8RowwiseParallel, PrepareFloat8ModuleInput) cast each sequence-sharded activation "
                         "to float8 before its all-gather, one byte an element; torchtitan ran them with tensorwise "
                         "float8 under TP until April 2026 (its published 2-D runs), not since")
    sp.add_argument("--no-float8-tp-all-gather", dest="float8_tp_all_gather", action="store_false",
                    help="TP's activations all-gathered in bf16 (the default; turns off a torchtitan TOML's float8 "
                         "under TP, which is read as torchtitan ran it then: with the float8 TP styles)")


def add_no_offload(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--no-offload", action="store_true",
                    help="auto: CPU offload is no answer: when nothing fits without it, say the fewest GPUs that fit "
                         "without it and exit 2 (by default auto offloads as its last resort and says so first)")


def add_force(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--force", action="store_true",
                    help="replace the file an output option names even when it is a file this command reads or "
                         "one it did not write (refused by default: a typo must not cost a model, config or plan)")


def add_json(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def add_job_config(sp: argparse.ArgumentParser, what: str) -> None:
    """``--from-torchtitan`` / ``--from-accelerate``: the job a training config describes (``configs/``)."""
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--from-torchtitan", metavar="FILE.py:FUNCTION|JOB.toml",
                       help=f"{what} the job a torchtitan config describes: a config_registry function "
                            "(FILE.py:FUNCTION or MODULE:FUNCTION, read without running it; torchtitan's flags after "
                            "--, e.g. -- --training.max_context_length 4096) or an older job TOML: its model, tokens "
                            "per GPU, context length, data-parallel degrees, fsdp_reshard_after_forward, activation "
                            "checkpointing and mixed precision (--cluster names the GPU; the GPU count comes from the "
                            "config)")
    group.add_argument("--from-accelerate", metavar="CONFIG.yaml",
                       help=f"{what} the job an Accelerate FSDP config describes for MODEL: its wrap policy, "
                            "fsdp_reshard_after_forward, activation checkpointing, offload, mixed precision and "
                            "num_processes")
