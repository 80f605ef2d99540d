"""What the user asked for, as typed requests built once from the command line and validated where they are built.

Every option that more than one command takes is read here, so its meaning and default exist in one place
(the simulation defaults themselves live in ``sim/options.py``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_planner.cli.paths import input_file
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import parse_count, parse_size
from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.models import ModelSpec
from fsdp_planner.planners.auto import Target
from fsdp_planner.planners.registry import POLICY_NAMES, PolicyName, PolicyRequest
from fsdp_planner.sim.options import (
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


