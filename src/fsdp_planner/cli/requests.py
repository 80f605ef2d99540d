"""What the user asked for, as typed requests built once from the command line and validated where they are built:
every argument is checked before the model is traced or auto searches, so a typo costs no minutes.

The options themselves (meaning, default, help) are defined in ``cli/options.py`` and ``cli/commands.py``; this
module reads them into the values the commands run with.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsdp_planner.cli.render as render
import fsdp_planner.service.validate as validate
from fsdp_planner.choices import (
    DEFAULT_PRECISION,
    POLICY_NAMES,
    PolicyName,
    ShardPlacement,
    ZeroGrad,
)
from fsdp_planner.cli.options import TIME_STEPS, VERIFY_NPROC, VERIFY_STEPS
from fsdp_planner.cli.paths import input_file, output_file
from fsdp_planner.configs.job_config import ACCELERATE, TORCHTITAN, JobConfig, read_config
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.fsdp2.precision import check_precision
from fsdp_planner.hardware.cluster import MAX_GPUS_PER_NODE, Cluster
from fsdp_planner.models import ModelSpec, planning_only
from fsdp_planner.models.hf import MAX_OVERRIDES, parse_override
from fsdp_planner.planners.registry import PolicyRequest
from fsdp_planner.service.configured import configured as from_config
from fsdp_planner.service.job import PlanJob
from fsdp_planner.service.validate import Keywords, Spelling
from fsdp_planner.sim.budget import Headroom, MemoryBudget
from fsdp_planner.sim.options import SimOptions

CLI = Spelling.CLI  # errors name the options as the command line spells them


@dataclass(frozen=True)
class PlanSource:
    """Where a command's plan comes from: a plan file, or a policy run on the model (exactly one)."""

    plan_file: Path | None
    policy: PolicyRequest | None

    def __post_init__(self) -> None:
        if (self.plan_file is None) == (self.policy is None):
            raise PlannerError("give exactly one of --plan FILE or --policy NAME")


class Configured:
    """The command line's options with a job config's settings merged in (``service/configured.py``), read-only:
    the validator's keywords from the merge, every other option as parsed."""

    def __init__(self, args: argparse.Namespace, merged: Keywords) -> None:
        self._args, self.keywords = args, merged

    def __getattr__(self, name: str) -> Any:
        return getattr(self.keywords if name in KEYWORD_NAMES else self._args, name)


KEYWORD_NAMES = frozenset(f.name for f in dataclasses.fields(Keywords))


def configured(args: argparse.Namespace, gpus_searched: bool = False
               ) -> tuple[argparse.Namespace | Configured, JobConfig | None]:
    """The options with the job ``--from-torchtitan`` / ``--from-accelerate`` describes (none given: as they are),
    and that config; ``gpus_searched``: the command searches the GPU count (``fit --gpus auto``)."""
    if getattr(args, "from_torchtitan", None):
        cfg = read_config(TORCHTITAN, args.from_torchtitan, getattr(args, "torchtitan_flags", ()))
    elif getattr(args, "from_accelerate", None):
        cfg = read_config(ACCELERATE, args.from_accelerate)
    else:
        return args, None
    merged = from_config(keywords(args), cfg, args.command, render.note, bool(getattr(args, "plan", None)),
                         gpus_searched)
    return Configured(args, merged), cfg


def keywords(args: argparse.Namespace | Configured) -> Keywords:
    """The options as the validator reads them (``service/validate.py``, which checks the API's keywords too):
    argparse's values, the repeated ``--hf-config KEY=VALUE`` read into a dict (the last of a key wins)."""
    if isinstance(args, Configured):
        return args.keywords
    given = getattr(args, "hf_config", None)
    if given is not None and len(given) > MAX_OVERRIDES:
        raise PlannerError(f"--hf-config: at most {MAX_OVERRIDES} fields, got {len(given)}")
    fields = dict(parse_override(text) for text in given) if given is not None else None
    return dataclasses.replace(Keywords.of(args), hf_config=fields)


def module_classes(arg: str | None) -> tuple[str, ...]:
    return validate.module_classes(arg, CLI)


# What each policy reads (planners/registry.py, PolicyRequest): an option no policy of the command reads is noted.
POLICY_OPTIONS: dict[str, tuple[str, tuple[PolicyName, ...]]] = {
    "--module-classes": ("module_classes", (PolicyName.MODULE, PolicyName.TITAN)),
    "--min-nonwrapped-numel": ("min_nonwrapped_numel", (PolicyName.SIZE,)),
    "--target-bytes": ("target_bytes", (PolicyName.ORDER,)),
    "--memory-budget": ("memory_budget", (PolicyName.AUTO,)),
    "--headroom": ("headroom", (PolicyName.AUTO,)),
    "--search-effort": ("search_effort", (PolicyName.AUTO,)),
    "--target": ("target", (PolicyName.AUTO,)),
    "--ac": ("ac", tuple(PolicyName)),
    "--ac-policy": ("ac_policy", tuple(PolicyName)),
    "--mesh": ("mesh", tuple(PolicyName)),
    "--tp": ("tp", tuple(PolicyName)),
    "--ep": ("ep", tuple(PolicyName)),
    "--ep-placement": ("ep_placement", tuple(PolicyName)),
    "--loss-parallel": ("loss_parallel", tuple(PolicyName)),
}


def policy_request(args: argparse.Namespace, name: str) -> PolicyRequest:
    """The request for one policy, with only the settings that policy reads (the others are checked for syntax
    here and noted as ignored by ``policy_notes``, never rejected by a policy that does not use them)."""
    return validate.policy_request(keywords(args), name, CLI)


def headroom_or_none(args: argparse.Namespace) -> Headroom | None:
    """``--headroom``, read; refused beside ``--memory-budget``, which is a budget taken as given."""
    return validate.headroom(keywords(args), CLI)


def memory_budget(args: argparse.Namespace, cluster: Cluster) -> MemoryBudget:
    """What every fits verdict of the command compares a plan's reserved peak with: ``--memory-budget`` as given,
    else one GPU of ``cluster`` less ``--headroom``."""
    return validate.memory_budget(keywords(args), cluster, CLI)


def policy_notes(args: argparse.Namespace, policies: Iterable[PolicyName], why: str = "",
                 plan_file: bool = False, budgeted: bool = False) -> list[str]:
    """One ``note:`` line per policy option the user gave that none of ``policies`` reads (all of them with
    ``plan_file``); ``why`` says what the command runs instead, e.g. 'with --policy order'. ``budgeted``: the
    command judges its plans against ``--memory-budget`` whatever the policy (plan and simulate on a cluster)."""
    ran = set(policies)
    notes = []
    files = [(flag, f) for flag, f in (("--plan", getattr(args, "plan", None)),
                                        ("--compare", getattr(args, "compare", None)))
             if plan_file and f is not None and f not in POLICY_NAMES]
    for option, (attr, readers) in POLICY_OPTIONS.items():
        if getattr(args, attr, None) is None or (ran & set(readers) and not plan_file):
            continue
        if option in ("--memory-budget", "--headroom") and budgeted:
            continue
        if option in ("--tp", "--ep") and files:
            for flag, path in files:  # (--compare's plan file too: it is run with the same options)
                _check_plan_degree(option, getattr(args, attr), flag, path)
            continue
        if plan_file:
            fixed = "its layout (the mesh it was planned on)" if option == "--mesh" else \
                "its tensor parallelism" if option in ("--tp", "--loss-parallel") else \
                "its expert parallelism" if option in ("--ep", "--ep-placement") else "the groups"
            notes.append(f"{option} has no effect with --plan: the plan file already fixes {fixed}")
            continue
        users = " and ".join(f"--policy {r.value}" for r in readers)
        notes.append(f"{option} has no effect {why}: only {users} {'use' if len(readers) > 1 else 'uses'} it")
    classes = module_classes(getattr(args, "module_classes", None))
    if PolicyName.TITAN in ran and not plan_file and len(classes) > 1:
        notes.append(f"the titan policy wraps one block class: it uses {classes[0]} and ignores "
                     f"{', '.join(classes[1:])} from --module-classes")
    return notes


def _check_plan_degree(option: str, asked: int, flag: str, path: str) -> None:
    """``--tp`` / ``--ep`` beside a plan file: its degree, or an error (a command given --tp 4 and a TP 2 plan ran
    TP 2 with a note, where the same contradiction with a job config is an error). A file that cannot be read is
    left to its own load, which says why."""
    try:
        plan = Plan.load(path)
    except PlannerError:
        return
    planned = plan.tp_degree if option == "--tp" else plan.expert_parallel.degree if plan.expert_parallel else 1
    if asked != planned:
        raise PlannerError(f"{option} {asked} contradicts {flag}'s plan file, planned with {option} {planned}: drop "
                           f"{option}, or plan again with {option} {asked}")


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The model and the workload (``--batch``, ``--seq``) the command runs: with ``--micro-batches N``, one
    micro-batch's (``--batch`` / N)."""
    return validate.model_spec(keywords(args), CLI)


def hf_config(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """``--hf-config KEY=VALUE`` options, parsed (a key given twice: the last wins, as on a config file)."""
    return validate.hf_config(keywords(args).hf_config, CLI)


def reshard_after_backward(args: argparse.Namespace) -> bool:
    """``--no-reshard-after-backward`` (False), which needs micro-batches to keep the params gathered between."""
    kw = keywords(args)
    validate.gradient_sync(kw, CLI)
    return bool(kw.reshard_after_backward)


def gradient_sync(args: argparse.Namespace) -> str:
    """``--gradient-sync last|every`` (default last), which says how micro-batches sync: it needs them."""
    return validate.gradient_sync(keywords(args), CLI).value


def micro_batches(args: argparse.Namespace, auto: bool = False) -> int:
    """``--micro-batches N``, checked: a whole number dividing ``--batch``, which it needs (1 when not given).
    ``auto``: 1 for ``--micro-batches auto`` (the whole batch, before auto splits it), else that is refused."""
    return validate.micro_batches(keywords(args), CLI, auto)


def plan_source(args: argparse.Namespace) -> PlanSource:
    return PlanSource(Path(args.plan) if args.plan else None,
                      policy_request(args, args.policy) if args.policy else None)


def compare_source(args: argparse.Namespace) -> PlanSource | None:
    """``--compare POLICY_OR_PLAN_FILE``: a policy name (run with the command's policy options) or a plan file."""
    arg = getattr(args, "compare", None)
    if arg is None:
        return None
    if arg in POLICY_NAMES:
        return PlanSource(None, policy_request(args, arg))
    if not os.path.lexists(arg):
        raise PlannerError(f"--compare '{arg}' is neither a policy ({', '.join(POLICY_NAMES)}) nor a plan file")
    return PlanSource(input_file(arg, "plan file"), None)


def sim_options(args: argparse.Namespace) -> SimOptions:
    return validate.sim_options(keywords(args), CLI)


def memory_options(args: argparse.Namespace) -> dict:
    """``SimOptions.named``'s memory options from the flags of commands that have them (``add_memory_options``)."""
    return validate.memory_options(keywords(args), CLI)


def cluster_or_none(args: argparse.Namespace) -> Cluster | None:
    return named_cluster(args, args.cluster) if args.cluster else None


def named_cluster(args: argparse.Namespace, spec: str) -> Cluster:
    """The cluster ``spec`` names, with the host figures given on the command line (``--cpu-optimizer-rate``)."""
    return validate.named(spec, getattr(args, "cpu_optimizer_rate", None), Spelling.CLI)




# -- plan ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRequest:
    """``plan MODEL``: the job (one policy's plan with ``--policy``, or the policies side by side) and what to do
    with its outcome."""

    job: PlanJob
    policy: PolicyName | None  # --policy: one plan, and its errors are errors; None: a comparison
    out: Path | None
    json: bool
    explain: bool
    notes: tuple[str, ...]  # what the user asked for that this run does not use, one note each


def plan_request(args: argparse.Namespace) -> PlanRequest:
    out = output_file(args.out, force=args.force)
    if out is not None and not args.policy:
        raise PlannerError("--out writes one plan: choose it with --policy")
    if args.explain and args.policy != PolicyName.AUTO.value:
        raise PlannerError("--explain explains an auto plan: add --policy auto")
    job = validate.plan_job(keywords(args), CLI, explain=args.explain, split_by_default=True)
    notes = _plan_notes(args, [p.name for p in job.policies], job.cluster is not None)
    measure = args.measure and not any(n.startswith("--measure") for n in notes)
    return PlanRequest(dataclasses.replace(job, measure=measure), PolicyName(args.policy) if args.policy else None,
                       out, args.json, args.explain, tuple(notes))


def _plan_notes(args: argparse.Namespace, ran: list[PolicyName], simulated: bool) -> list[str]:
    """What the user asked for that this ``plan`` does not use, one note each."""
    why = (f"with --policy {args.policy}" if args.policy
           else "without --cluster (the comparison includes auto only when a cluster is given)")
    notes = policy_notes(args, ran, why, budgeted=simulated)
    if not simulated:
        # (--precision is read without a cluster too: the model is traced in its compute dtype)
        given = [opt for opt, value, default in (("--mfu", args.mfu, None),
                                                  ("--optimizer", args.optimizer, None))
                 if value != default]
        if given:
            notes.append(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without --cluster: "
                         f"only the step simulation uses {'it' if len(given) == 1 else 'them'}")
        if args.measure:
            notes.append("--measure has no effect without --cluster: measured times only feed the step simulation "
                         "(nothing measured)")
        if args.shard_placement == ShardPlacement.AUTO.value:
            notes.append("--shard-placement auto has no effect without --cluster: the shard size decides which "
                         "params go on dim 1 (none recorded)")
    return notes


# -- verify ----------------------------------------------------------------------------------------------------------
# A torchrun job's size: ranks are processes on this one machine (calibrate --backend gloo allows as many), and a
# job of more steps than this is a typo that would run for days.
MAX_NPROC = 64
MAX_STEPS = 100_000


@dataclass(frozen=True)
class VerifyRequest:
    """``verify MODEL``: a torchrun job of ``nproc`` ranks training the plan, checked against the prediction."""

    model: ModelSpec
    source: PlanSource
    nproc: int
    steps: int
    time_steps: int  # timed forward + backward steps after the checked ones (none with --fsdp1)
    plan_cluster: Cluster | None  # what auto plans for (None: the plan is not auto's)
    cluster: Cluster | None  # --cluster: predict the job's step time on it too
    measure: bool
    full_trace: bool
    fsdp1: bool
    save_checkpoint: Path | None
    load_checkpoint: Path | None
    json: bool
    notes: tuple[str, ...]
    options: SimOptions  # what the job trains in (--precision) and with (SGD with momentum)
    plan_for: bool = False  # --plan-for: auto planned for ``plan_cluster``, its grouping carried onto the job
    plan_model: ModelSpec | None = None  # --plan-model: the model auto plans (None: the job's own)
    micro_batches: int = 1  # forward + backward passes a step (``model`` is one micro-batch's workload)
    reshard_after_backward: bool = True  # False: set_reshard_after_backward(False) on all but the last micro-batch
    profile: Path | None = None  # --profile DIR: each rank's torch.profiler trace of a few more steps


def verify_request(args: argparse.Namespace) -> VerifyRequest:
    # the job machinery (torchrun, DCP, the fake process group) is imported by the commands that run a job only
    from fsdp_planner.runtime.verify import JOB_OPTIMIZER, check_load_dir, check_save_dir, job_precision

    nproc = VERIFY_NPROC if args.nproc is None else args.nproc
    steps = VERIFY_STEPS if args.steps is None else args.steps
    if not 1 <= nproc <= MAX_NPROC:
        raise PlannerError(f"--nproc must be from 1 to {MAX_NPROC} (processes on this machine; --fake-world-size "
                           f"checks larger worlds), got {cut_short(nproc)}")
    if not 1 <= steps <= MAX_STEPS:
        raise PlannerError(f"--steps must be from 1 to {MAX_STEPS:,}, got {cut_short(steps)}")
    if not 0 <= args.time_steps <= MAX_STEPS:
        raise PlannerError(f"--time-steps must be from 0 to {MAX_STEPS:,}, got {cut_short(args.time_steps)}")
    if args.fsdp1 and micro_batches(args) > 1:
        raise PlannerError("--micro-batches runs FSDP2's set_requires_gradient_sync: not with --fsdp1")
    if args.fsdp1 and getattr(args, "compile", False):  # (FSDP1's worker wraps the model eager)
        raise PlannerError("--compile runs FSDP2's compiled blocks: not with --fsdp1 (its ranks would train eager "
                           "beside a compiled prediction)")
    if args.fsdp1 and (args.save_checkpoint is not None or args.load_checkpoint is not None):
        raise PlannerError("--save-checkpoint and --load-checkpoint run with FSDP2 only: drop --fsdp1")
    if planning_only(args.model):
        raise PlannerError(f"'{args.model}' is for planning only (too large to train here); verify a trainable "
                           "model")
    if args.save_checkpoint is not None:
        check_save_dir(args.save_checkpoint)
    if args.load_checkpoint is not None:
        check_load_dir(args.load_checkpoint, "")
    options = SimOptions.named(job_precision(args.precision, args.fsdp1).name, JOB_OPTIMIZER,
                               micro_batches=micro_batches(args), reshard_after_backward=reshard_after_backward(args),
                               gradient_sync=gradient_sync(args), **memory_options(args))
    notes = []
    if args.zero_grad != ZeroGrad.NONE.value:
        notes.append("--zero-grad applies with --fake-world-size: torchrun jobs clear grads with zero_grad()")
    if args.optimizer is not None:
        notes.append("--optimizer applies with --fake-world-size: torchrun jobs and their unsharded reference train "
                     "with SGD and momentum (the parity check)")
    source = plan_source(args)
    auto = source.policy is not None and source.policy.name is PolicyName.AUTO
    given = cluster_or_none(args)
    plan_for = _plan_for(args, auto)
    plan_cluster = (plan_for or given or named_cluster(args, f"h100:{min(nproc, MAX_GPUS_PER_NODE)}")) if auto \
        else None
    notes += policy_notes(args, [source.policy.name] if source.policy else [], f"with --policy {args.policy}",
                          plan_file=source.plan_file is not None)
    return VerifyRequest(model_spec(args), source, nproc, steps, args.time_steps, plan_cluster, given,
                         args.measure, args.full_trace, args.fsdp1, args.save_checkpoint, args.load_checkpoint,
                         args.json, tuple(notes), options, plan_for is not None,
                         ModelSpec(args.plan_model) if args.plan_model else None, micro_batches(args),
                         reshard_after_backward(args), args.profile)


def _plan_for(args: argparse.Namespace, auto: bool) -> Cluster | None:
    """``--plan-for CLUSTER`` (and ``--plan-model``), checked: what auto plans for when the job is smaller."""
    if args.plan_model and not args.plan_for:
        raise PlannerError("--plan-model names the model auto plans for --plan-for CLUSTER: add --plan-for")
    if not args.plan_for:
        return None
    if not auto:
        raise PlannerError("--plan-for CLUSTER says which cluster --policy auto plans for: add --policy auto (a "
                           "plan file or another policy does not depend on the cluster)")
    return named_cluster(args, args.plan_for)


@dataclass(frozen=True)
class FakeWorldRequest:
    """``verify MODEL --fake-world-size W``: real FSDP2 on W fake ranks beside the simulator's prediction."""

    model: ModelSpec
    source: PlanSource
    world: int
    cluster: Cluster  # the prediction's (W GPUs)
    options: SimOptions
    memory_tolerance: float  # the largest relative peak-memory error that passes
    full_trace: bool
    json: bool
    notes: tuple[str, ...]


def fake_world_request(args: argparse.Namespace) -> FakeWorldRequest:
    from fsdp_planner.runtime.fake_world import MAX_FAKE_WORLD

    if args.fsdp1:
        raise PlannerError("--fsdp1 runs on torchrun ranks (--nproc); the fake-world check runs FSDP2 only")
    if args.plan_for or args.plan_model:
        raise PlannerError("--plan-for and --plan-model carry a large cluster's plan onto a small torchrun job; "
                           "--fake-world-size runs the cluster's own world size: give --cluster instead")
    world = args.fake_world_size
    if not 1 <= world <= MAX_FAKE_WORLD:
        raise PlannerError(f"--fake-world-size must be between 1 and {MAX_FAKE_WORLD:,}, got {world}")
    if not 0 <= args.memory_tolerance < 1:
        raise PlannerError(f"--memory-tolerance must be in [0, 1), got {args.memory_tolerance}")
    notes = []
    if args.nproc is not None or args.steps is not None:
        notes.append("--nproc and --steps have no effect with --fake-world-size (one process, two steps)")
    if args.save_checkpoint is not None or args.load_checkpoint is not None:
        notes.append("--save-checkpoint and --load-checkpoint have no effect with --fake-world-size (fake tensors "
                     "hold no values)")
    if args.profile is not None or args.time_steps != TIME_STEPS or args.measure:  # (a trial: silently unused)
        notes.append("--profile, --time-steps and --measure have no effect with --fake-world-size (it counts "
                     "collectives, bytes and memory: fake tensors run no time worth measuring)")
    options = SimOptions.named(args.precision or DEFAULT_PRECISION, args.optimizer, zero_grad=args.zero_grad,
                               micro_batches=micro_batches(args), reshard_after_backward=reshard_after_backward(args),
                               gradient_sync=gradient_sync(args), **memory_options(args))
    check_precision(options.precision)
    source = plan_source(args)
    notes += policy_notes(args, [source.policy.name] if source.policy else [], f"with --policy {args.policy}",
                          plan_file=source.plan_file is not None)
    if args.cluster is None and world > MAX_GPUS_PER_NODE and world % MAX_GPUS_PER_NODE:
        raise PlannerError(f"--fake-world-size {world}: the prediction beside it is of a cluster of 1 to "
                           f"{MAX_GPUS_PER_NODE} GPUs or whole {MAX_GPUS_PER_NODE}-GPU nodes (h100 by default): give "
                           f"one of those sizes, or --cluster with a cluster file of {world} GPUs")
    cluster = named_cluster(args, args.cluster or f"h100:{world}")
    if cluster.world_size != world:
        raise PlannerError(f"--cluster {args.cluster} has {cluster.world_size} GPUs but --fake-world-size is {world}")
    return FakeWorldRequest(model_spec(args), source, world, cluster, options, args.memory_tolerance,
                            args.full_trace, args.json, tuple(notes))
