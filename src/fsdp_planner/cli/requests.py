"""What the user asked for, as typed requests built once from the command line and validated where they are built.

Every option that more than one command takes is read here, so its meaning and default exist in one place
(the simulation defaults themselves live in ``sim/options.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import parse_size
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.planners.auto import Target
from fsdp_planner.planners.registry import POLICY_NAMES, PolicyName, PolicyRequest
from fsdp_planner.sim.options import (
    DEFAULT_MFU,
    DEFAULT_OPTIMIZER,
    DEFAULT_PRECISION,
    OPTIMIZERS,
    PRECISIONS,
    SimOptions,
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


def size_or_none(arg: str | None) -> int | None:
    return None if arg is None else parse_size(arg)


def policy_request(args: argparse.Namespace, name: str) -> PolicyRequest:
    return PolicyRequest(
        PolicyName(name), module_classes=module_classes(args.module_classes),
        min_nonwrapped_numel=args.min_nonwrapped_numel, target_bytes=size_or_none(args.target_bytes),
        memory_budget=size_or_none(args.memory_budget), target=Target(args.target))


def plan_source(args: argparse.Namespace) -> PlanSource:
    return PlanSource(Path(args.plan) if args.plan else None,
                      policy_request(args, args.policy) if args.policy else None)


def sim_options(args: argparse.Namespace) -> SimOptions:
    return SimOptions.named(args.precision, args.optimizer, args.mfu)


def cluster_or_none(args: argparse.Namespace) -> Cluster | None:
    return parse_cluster(args.cluster) if args.cluster else None


def output_file(arg: str | None) -> Path | None:
    """``--out``: checked before any work, so a bad path fails in one line, not after minutes of planning."""
    if arg is None:
        return None
    path = Path(arg)
    if path.is_dir():
        raise PlannerError(f"--out '{arg}' is a directory: give a file name, e.g. {path / 'plan.json'}")
    if not path.parent.is_dir():
        raise PlannerError(f"--out '{arg}': directory '{path.parent}' does not exist")
    return path


# -- the options, defined once -------------------------------------------------------------------------------------
def add_policy_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--module-classes", help="comma-separated class names (default: the repeated block class)")
    sp.add_argument("--min-nonwrapped-numel", type=int, default=None,
                    help="size policy threshold in elements (default 1e8, FSDP1's)")
    sp.add_argument("--target-bytes", help="order policy group size, e.g. 64MiB (default: one block)")
    sp.add_argument("--memory-budget", help="auto: per-rank peak memory budget, e.g. 60GiB (default: the peak of "
                                            "the fastest classic policy)")
    sp.add_argument("--target", choices=[t.value for t in Target], default=Target.FSDP2.value,
                    help="auto: plans FSDP2 can apply (default) or only what FSDP1 can express")


def add_model(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model", help="built-in name, path/file.py:fn or package.module:fn")
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


def add_json(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
