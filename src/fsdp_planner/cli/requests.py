"""What the user asked for, as typed requests built once from the command line and validated where they are built.

Every option that more than one command takes is read here, so its meaning and default exist in one place
(the simulation defaults themselves live in ``sim/options.py``).
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import parse_count, parse_size
from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.auto import Target
from fsdp_planner.planners.registry import POLICY_NAMES, PolicyName, PolicyRequest
from fsdp_planner.sim.options import (
    DEFAULT_MFU,
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    OPTIMIZERS,
    PRECISIONS,
    SimOptions,
    ZeroGrad,
)


@dataclass(frozen=True)
class PlanSource:
    """Where a command's plan comes from: a plan file, or a policy run on the model (exactly one)."""

    plan_file: Path | None
    policy: PolicyRequest | None

    def __post_init__(self) -> None:
        if (self.plan_file is None) == (self.policy is None):
            raise PlannerError("give exactly one of --plan FILE or --policy NAME")


def module_classes(arg: str | None) -> tuple[str, ...]:
    if arg is None:
        return ()
    names = tuple(c.strip() for c in arg.split(",") if c.strip())
    if not names:
        raise PlannerError(f"--module-classes '{arg}' names no class: give comma-separated class names such as "
                           "TransformerBlock,Embedding")
    return names


def size_or_none(arg: str | None, what: str | None = None) -> int | None:
    return None if arg is None else parse_size(arg, what)


# What each policy reads (planners/registry.py, PolicyRequest): an option no policy of the command reads is noted.
POLICY_OPTIONS: dict[str, tuple[str, tuple[PolicyName, ...]]] = {
    "--module-classes": ("module_classes", (PolicyName.MODULE, PolicyName.TITAN)),
    "--min-nonwrapped-numel": ("min_nonwrapped_numel", (PolicyName.SIZE,)),
    "--target-bytes": ("target_bytes", (PolicyName.ORDER,)),
    "--memory-budget": ("memory_budget", (PolicyName.AUTO,)),
    "--target": ("target", (PolicyName.AUTO,)),
    "--ac": ("ac", tuple(PolicyName)),
    "--mesh": ("mesh", tuple(PolicyName)),
}


def policy_request(args: argparse.Namespace, name: str) -> PolicyRequest:
    """The request for one policy, with only the settings that policy reads (the others are checked for syntax
    here and noted as ignored by ``policy_notes``, never rejected by a policy that does not use them)."""
    policy = PolicyName(name)
    classes = module_classes(args.module_classes)
    numel = parse_count(args.min_nonwrapped_numel, "--min-nonwrapped-numel") \
        if args.min_nonwrapped_numel is not None else None
    target_bytes = size_or_none(args.target_bytes, "--target-bytes")
    budget = size_or_none(args.memory_budget, "--memory-budget")
    return PolicyRequest(
        policy,
        module_classes=classes if policy in (PolicyName.MODULE, PolicyName.TITAN) else (),
        min_nonwrapped_numel=numel if policy is PolicyName.SIZE else None,
        target_bytes=target_bytes if policy is PolicyName.ORDER else None,
        memory_budget=budget if policy is PolicyName.AUTO else None,
        target=Target(args.target) if args.target and policy is PolicyName.AUTO else Target.FSDP2,
        checkpointing=ACMode(args.ac) if getattr(args, "ac", None) else None,
        mesh=Mesh.parse(args.mesh) if getattr(args, "mesh", None) else None)


def policy_notes(args: argparse.Namespace, policies: Iterable[PolicyName], why: str = "",
                 plan_file: bool = False) -> list[str]:
    """One ``note:`` line per policy option the user gave that none of ``policies`` reads (all of them with
    ``plan_file``); ``why`` says what the command runs instead, e.g. 'with --policy order'."""
    ran = set(policies)
    notes = []
    for option, (attr, readers) in POLICY_OPTIONS.items():
        if getattr(args, attr, None) is None or (ran & set(readers) and not plan_file):
            continue
        if plan_file:
            fixed = "its layout (the mesh it was planned on)" if option == "--mesh" else "the groups"
            notes.append(f"{option} has no effect with --plan: the plan file already fixes {fixed}")
            continue
        users = " and ".join(f"--policy {r.value}" for r in readers)
        notes.append(f"{option} has no effect {why}: only {users} {'use' if len(readers) > 1 else 'uses'} it")
    classes = module_classes(getattr(args, "module_classes", None))
    if PolicyName.TITAN in ran and not plan_file and len(classes) > 1:
        notes.append(f"the titan policy wraps one block class: it uses {classes[0]} and ignores "
                     f"{', '.join(classes[1:])} from --module-classes")
    return notes


def positive_int(option: str) -> Callable[[str], int]:
    """An argparse type: a whole number of at least 1 (``1e3`` reads too), one line otherwise."""
    def parse(text: str) -> int:
        try:
            value = parse_count(text, option)
        except PlannerError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{option} must be at least 1, got {text}")
        return value
    return parse


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The model and the workload (``--batch``, ``--seq``) the command runs."""
    return ModelSpec(args.model, getattr(args, "batch", None), getattr(args, "seq", None))


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
    return SimOptions.named(args.precision, args.optimizer, args.mfu, args.zero_grad)


def cluster_or_none(args: argparse.Namespace) -> Cluster | None:
    return parse_cluster(args.cluster) if args.cluster else None


def output_file(arg: str | None, example: str = "plan.json", code: bool = False) -> Path | None:
    """``--out``: checked before any work, so a bad path fails in one line, not after minutes of planning. An
    existing regular file is overwritten only when it is what the command writes: a .json file, or for ``code``
    (``export``) code export wrote. A typo such as ``--out model.py`` must not replace the user's code, nor
    ``export ... --out plan.json`` the plan."""
    if arg is None:
        return None
    path = _file_to_write(arg, "--out", example)
    if path.is_file() and not (_generated(path) or (not code and path.suffix.lower() == ".json")):
        what = "not code" if code else "neither a .json file nor code"
        what += " fsdp-planner export wrote"
        other = path.with_suffix(".py").with_stem(path.stem + "_plan") if code else path.with_stem(path.stem + "2")
        raise PlannerError(f"--out '{arg}' already exists and is {what}: refusing to overwrite it (give a new name, "
                           f"e.g. {other})")
    return path


def _generated(path: Path) -> bool:
    """Whether ``path`` is code ``fsdp-planner export`` wrote (its header says so): safe to write again."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            return GENERATED_MARK in f.read(1000)
    except OSError:
        return False


GENERATED_MARK = "Generated by fsdp-planner"  # the header of every file `export` writes (apply/export.py)


def _file_to_write(arg: str, option: str, example: str) -> Path:
    """A file name an option gives for writing: not empty, not a directory, in a directory that exists."""
    if not arg.strip():
        raise PlannerError(f"{option} is empty: give the file to write, e.g. {option} {example}")
    path = Path(arg)
    if path.is_dir():
        raise PlannerError(f"{option} '{arg}' is a directory: give a file name, e.g. {path / example}")
    if not path.parent.is_dir():
        raise PlannerError(f"{option} '{arg}': directory '{path.parent}' does not exist")
    return path


def picture_file(arg: str | None, option: str, suffixes: tuple[str, ...]) -> Path | None:
    """``--timeline`` / ``--html``: checked before any work (as ``--out``); the suffix says the format, and an
    existing file is replaced only when it has one of ``suffixes`` (a picture this command writes)."""
    if arg is None:
        return None
    path = _file_to_write(arg, option, f"step{suffixes[0]}")
    if path.suffix.lower() not in suffixes:
        raise PlannerError(f"{option} '{arg}' must end in {' or '.join(suffixes)} (the format it writes), "
                           f"e.g. {path.with_suffix(suffixes[0])}")
    return path


def write_output(path: Path, text: str) -> None:
    """Write ``text`` to an ``--out`` file without losing the old one on failure: a regular file is written beside
    it and renamed over it (a full disk leaves the previous plan whole); a device or pipe is written directly."""
    if path.exists() and not path.is_file():
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None
        return
    target = Path(os.path.realpath(path))  # through a symlink, as a plain write would
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as e:
        raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _looks_like_cluster_file(spec: str) -> bool:
    """What ``parse_cluster`` reads as a file rather than a preset name."""
    text = spec.strip()
    return Path(text).suffix.lower() == ".json" or "/" in text or os.path.isfile(text)


def _model_file(spec: str) -> str | None:
    target = spec.rpartition(":")[0]
    return target if target.endswith(".py") else None


def input_file(arg: str, what: str) -> Path:
    """A file the command reads: 'does not exist', 'is a directory' and 'is not a regular file' told apart."""
    path = Path(arg)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise PlannerError(f"{what} '{arg}' does not exist") from None
    except OSError as e:
        raise PlannerError(f"cannot read {what} '{arg}': {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise PlannerError(f"{what} '{arg}' is a directory: give the file itself")
    if not stat.S_ISREG(mode):
        raise PlannerError(f"{what} '{arg}' is not a regular file")
    return path


def check_paths(args: argparse.Namespace) -> None:
    """Before any work: the files a command reads exist and are regular files, and ``--out`` is writable and none
    of them (``plan m.py:f --out m.py`` once replaced the user's model with a plan)."""
    inputs: list[tuple[str, str]] = []  # (path, what it is)
    model = getattr(args, "model", None)
    if model and _model_file(model):
        inputs.append((_model_file(model), "the model file"))  # type: ignore[arg-type]
    if getattr(args, "plan", None):
        input_file(args.plan, "plan file")
        inputs.append((args.plan, "the plan file"))
    for attr in ("cluster", "base"):
        spec = getattr(args, attr, None)
        if spec and _looks_like_cluster_file(spec) and os.path.lexists(spec.strip()):
            input_file(spec.strip(), "cluster file")
            inputs.append((spec.strip(), "the cluster file"))
    for log in getattr(args, "logs", None) or ():
        if os.path.lexists(log) and not os.path.isdir(log):  # a directory of logs is read whole
            input_file(log, "nccl-tests log")
        inputs.append((log, "a log"))
    out_arg = getattr(args, "out", None)
    if out_arg is None:
        return
    command = getattr(args, "command", None)
    example = {"calibrate": "cluster.json", "export": "plan_code.py"}.get(command, "plan.json")
    for path, what in inputs:
        if out_arg.strip() and _same_file(Path(out_arg), Path(path)):
            raise PlannerError(f"--out '{out_arg}' is {what} this command reads: write to another file, e.g. "
                               f"{example}")
    output_file(out_arg, example, code=command == "export")


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


# -- the options, defined once -------------------------------------------------------------------------------------
def add_policy_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--module-classes", help="comma-separated class names (default: the repeated block class)")
    sp.add_argument("--min-nonwrapped-numel", default=None,
                    help="size policy threshold in elements, e.g. 100000000 or 1e8 (default 1e8, FSDP1's)")
    sp.add_argument("--target-bytes", help="order policy group size, e.g. 64MiB (default: one block)")
    sp.add_argument("--memory-budget", help="auto: per-rank peak memory budget, e.g. 60GiB (default: the memory of "
                                            "one of the cluster's GPUs)")
    sp.add_argument("--target", choices=[t.value for t in Target], default=None,
                    help="auto: plans FSDP2 can apply (fsdp2, the default) or only what FSDP1 can express")
    sp.add_argument("--ac", choices=[m.value for m in ACMode], default=None,
                    help="activation checkpointing of the repeated blocks: none, full (every block) or selective "
                         "(every second block, torchtitan's selective_ac_option=2); default none, and auto "
                         "chooses which blocks to checkpoint")
    sp.add_argument("--mesh", metavar="RxS",
                    help="the data-parallel layout: R replicas of S-rank shard groups (HSDP; R*S = the GPU count, "
                         "e.g. 2x4); default pure FSDP over all GPUs, and auto chooses")


def add_model(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model", help="built-in name (see fsdp-planner models), path/file.py:fn, package.module:fn, "
                                   "hf:NAME or hf:path/config.json")
    sp.add_argument("--batch", type=positive_int("--batch"), default=None,
                    help="micro-batch size per rank: the factory's batch_size argument (default: the factory's; "
                         "see fsdp-planner models)")
    sp.add_argument("--seq", type=positive_int("--seq"), default=None,
                    help="sequence length: the factory's seq_len argument (default: the factory's)")
    sp.add_argument("--full-trace", action="store_true",
                    help="trace every module call (slower); by default identical calls of a repeated block are "
                         "traced once, which assumes its forward depends only on its own state and arguments")


def add_plan_source(sp: argparse.ArgumentParser) -> None:
    add_model(sp)
    sp.add_argument("--plan", help="plan JSON file (from plan --out)")
    sp.add_argument("--policy", choices=POLICY_NAMES)
    add_policy_options(sp)


def add_sim_options(sp: argparse.ArgumentParser, cluster_required: bool) -> None:
    sp.add_argument("--cluster", required=cluster_required,
                    help="preset and GPU count (h100:64, a100:16, b200:8, h200:512) or a cluster JSON file")
    sp.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                    help=f"fraction of peak FLOP/s matmuls reach (default {DEFAULT_MFU})")
    add_precision_options(sp)
    sp.add_argument("--measure", action="store_true",
                    help="time the model's ops for real on this machine (GPU if present) instead of the roofline "
                         "estimate; the model must fit unsharded")


def add_precision_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--precision", default=DEFAULT_PRECISION,
                    help=f"{', '.join(PRECISIONS)} (default {DEFAULT_PRECISION})")
    sp.add_argument("--optimizer", default=DEFAULT_OPTIMIZER,
                    help=f"{', '.join(OPTIMIZERS)} (default {DEFAULT_OPTIMIZER})")
    sp.add_argument("--zero-grad", choices=[z.value for z in ZeroGrad], default=ZeroGrad.NONE.value,
                    help="how the loop clears grads: none = zero_grad(set_to_none=True), the default; zeros = "
                         "set_to_none=False (sharded grads kept all step)")


def add_json(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
