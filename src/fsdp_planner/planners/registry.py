"""Policies by name, and the typed request that selects and configures one (validated once, where it is built)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from fsdp_planner.choices import DEFAULT_SAC_POLICY, POLICY_NAMES, ExpertPlacement, PolicyName, SacPolicy
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.checkpointing import ACMode, check_checkpointing, checkpoint_blocks
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.fsdp2.validity import runnable
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.planners.auto import AutoPolicy, Target
from fsdp_planner.planners.classic import ModuleWrapPolicy, SizeBasedPolicy, TorchtitanPolicy
from fsdp_planner.planners.order import ExecutionOrderPolicy
from fsdp_planner.planners.repair import joined_until_runnable
from fsdp_planner.planners.tensor_parallel import TPChoice
from fsdp_planner.sim.budget import Headroom
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.trace.records import Trace


class Policy(Protocol):
    name: str

    def plan(self, trace: Trace, model: str = "") -> Plan: ...


class Baseline(Policy, Protocol):
    """A classic policy (or one of them checkpointed, or on a mesh): ``build`` gives its grouping unchecked, ``plan``
    only when FSDP2 can run it."""

    def build(self, trace: Trace, model: str = "") -> Plan: ...


CLASSIC_POLICIES = (PolicyName.MODULE, PolicyName.SIZE, PolicyName.TITAN, PolicyName.ORDER)


@dataclass(frozen=True)
class PolicyRequest:
    """A policy and its settings; each setting applies to the policies its comment names."""

    name: PolicyName
    module_classes: tuple[str, ...] = ()  # module, titan (first class): default the repeated block class
    min_nonwrapped_numel: int | None = None  # size: default FSDP1's 1e8
    target_bytes: int | None = None  # order: default one block
    memory_budget: int | None = None  # auto: default the memory of one of the cluster's GPUs less ``headroom``
    headroom: Headroom | None = None  # auto without memory_budget: default ``sim.budget.DEFAULT_HEADROOM``
    search_effort: int | None = None  # auto: plans its refinement may simulate; default ``default_search_effort``
    target: Target = Target.FSDP2  # auto
    checkpointing: ACMode | None = None  # all: activation checkpointing of the blocks; None: none (auto: chosen)
    sac_policy: SacPolicy = DEFAULT_SAC_POLICY  # what op-level checkpointing saves (--ac op, or auto's choices)
    mesh: Mesh | None = None  # all: the data-parallel layout (HSDP); None: pure FSDP (auto: chosen)
    tp: int | None = None  # all: the tensor-parallel degree (``planners/tensor_parallel.py``'s layout); None: no TP
    # (auto: chosen among ``TP_DEGREES``)
    loss_parallel: bool | None = None  # all, with TP: None: the layout's default (on where the output is sharded)
    async_tp: bool = False  # all, with TP
    tp_key: str = ""  # all, with TP: how the refusals name ``tp``: a config key, "tp" (the API); "": --tp
    ep: int | None = None  # all: the expert-parallel degree over the model's grouped experts
    # (``planners/expert_parallel.py``); None: no EP
    ep_placement: ExpertPlacement | None = None  # all, with EP: where FSDP2 shards the experts; None: their blocks'
    # calls (auto: chosen)
    keeps_placement: bool = False  # all: the user gave the shard placement (``--shard-placement``): kept, auto
    # choosing no dim-1 sharding of its own, an EP plan no torchtitan placement of its experts
    # (``service/planning.expert_placement``)

    def __post_init__(self) -> None:
        if any(not c for c in self.module_classes):
            raise PlannerError("module class names must not be empty")
        for what, value in (("the size policy's --min-nonwrapped-numel", self.min_nonwrapped_numel),
                            ("the order policy's --target-bytes", self.target_bytes),
                            ("auto's --memory-budget", self.memory_budget)):
            if value is not None and (isinstance(value, bool) or value < 1):
                raise PlannerError(f"{what} must be positive, got {value}")
        if self.search_effort is not None and (isinstance(self.search_effort, bool) or self.search_effort < 0):
            raise PlannerError(f"auto's --search-effort must be 0 or more, got {self.search_effort}")

    @classmethod
    def named(cls, name: str, **settings: object) -> PolicyRequest:
        try:
            policy = PolicyName(name)
        except ValueError:
            raise PlannerError(f"unknown policy '{name}': choose one of {', '.join(POLICY_NAMES)}") from None
        return cls(policy, **settings)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Checkpointed:
    """A whole-model policy whose plans checkpoint the blocks ``mode`` names (``--ac``), as its users run it."""

    policy: Baseline
    mode: ACMode
    sac_policy: SacPolicy = DEFAULT_SAC_POLICY  # with mode op

    @property
    def name(self) -> str:
        return self.policy.name

    def plan(self, trace: Trace, model: str = "") -> Plan:
        # checked with the recomputation, which reads params again; a group it cannot run joins the next
        return joined_until_runnable(trace, self.build(trace, model))

    def build(self, trace: Trace, model: str = "") -> Plan:
        plan = self.policy.build(trace, model)
        plan = checkpoint_blocks(plan, trace, self.mode, self.sac_policy)
        check_checkpointing(plan, trace)
        return plan


@dataclass(frozen=True)
class OnMesh:
    """A whole-model policy whose plans run on the HSDP layout ``mesh`` (``--mesh``): the same groups, sharded
    over ``mesh.shard`` ranks and replicated ``mesh.replicate`` times."""

    policy: Baseline
    mesh: Mesh

    @property
    def name(self) -> str:
        return self.policy.name

    def plan(self, trace: Trace, model: str = "") -> Plan:
        return runnable(trace, self.build(trace, model))

    def build(self, trace: Trace, model: str = "") -> Plan:
        plan = self.policy.build(trace, model)
        label = f"{plan.policy} on {self.mesh.describe()}" if self.mesh.replicate > 1 else plan.policy
        return replace(plan, mesh=self.mesh, policy=label)


def make_policy(request: PolicyRequest, cluster: Cluster | None = None, options: SimOptions | None = None,
                tensor_parallel: tuple[TPChoice, ...] = ()) -> Policy:
    """The policy a request names; auto needs the cluster it plans for, and takes the TP layouts to search
    (``planners/tensor_parallel.py`` makes them for the traced model; none: no TP)."""
    if request.name is not PolicyName.AUTO:
        return make_baseline(request)
    if cluster is None:
        raise PlannerError("the auto policy plans for a cluster: give one")
    return AutoPolicy(cluster, request.memory_budget, request.target, options or SimOptions(),
                      search_effort=request.search_effort, checkpointing=request.checkpointing,
                      sac_policy=request.sac_policy, mesh=request.mesh, headroom=request.headroom,
                      tensor_parallel=tensor_parallel, keeps_placement=request.keeps_placement,
                      ep_placement=request.ep_placement)


def make_baseline(request: PolicyRequest) -> Baseline:
    """The classic policy a request names (not auto): its ``build`` gives the grouping even when FSDP2 could not
    run it, for ``check`` to report what goes wrong."""
    if request.mesh is not None:
        return OnMesh(make_baseline(replace(request, mesh=None)), request.mesh)
    if request.checkpointing is not None:
        return Checkpointed(make_baseline(replace(request, checkpointing=None)), request.checkpointing,
                            request.sac_policy)
    name = request.name
    if name is PolicyName.MODULE:
        return ModuleWrapPolicy(request.module_classes)
    if name is PolicyName.SIZE:
        return SizeBasedPolicy(request.min_nonwrapped_numel or int(1e8))
    if name is PolicyName.TITAN:
        return TorchtitanPolicy(request.module_classes[0] if request.module_classes else None)
    if name is PolicyName.ORDER:
        return ExecutionOrderPolicy(request.target_bytes)
    raise ValueError("auto is no baseline: make_policy makes it, for a cluster")
