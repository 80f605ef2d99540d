"""Plans: which modules each FSDP group (one ``fully_shard`` call) covers, and how it behaves.

A plan is an ordered list of groups in execution order with the root group (modules ``[""]``) last. Every
group is exactly one ``fully_shard(list_of_modules)`` call; the params it owns are what that call claims when
the groups are applied children-first (``claim.py``). This module holds the data and its JSON form; whether a
plan fits a model is ``claim.check_plan_matches``.
"""

from __future__ import annotations

import difflib
import json
import keyword
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsdp_planner.choices import (
    ATTENTION_NAMES,
    KERNEL_PACKAGES,
    OPTIMIZER_NAMES,
    PRECISION_NAMES,
    SAC_POLICY_NAMES,
    SacPolicy,
    ZeroGrad,
)
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable_name
from fsdp_planner.fsdp2.expert_parallel import ExpertParallel, expert_parallel_from_dict
from fsdp_planner.fsdp2.float8 import Float8, float8_from_dict
from fsdp_planner.fsdp2.frozen import FrozenDict
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, matches, tensor_parallel_from_dict
from fsdp_planner.limits import MAX_LOSS_CHUNKS, check_field
from fsdp_planner.trace.tree import ROOT
from fsdp_planner.userfiles import parse_json, read_text, shown_json, write_atomic

PLAN_VERSION = 1
# The keys a plan file may hold (what ``to_dict`` writes): any other is a typo that would otherwise be ignored.
PLAN_KEYS = ("version", "model", "policy", "groups", "activation_checkpointing", "selective_checkpointing", "mesh",
             "forward_methods", "precision", "offload", "shard_dims", "reduce_dtype", "attention",
             "activation_offloading", "tensor_parallel", "expert_parallel", "compiled", "float8", "workload",
             "optimizer", "checkpoint_early_stop", "compiled_loss", "kernels", "loss_chunks", "loss_head",
             "zero_grad")
MODEL_KEYS = ("fingerprint", "numel", "name", "hf_config")
MAX_HF_CONFIG = 32  # model.hf_config fields (models/hf.py's MAX_OVERRIDES)
MAX_HF_CONFIG_CHARS = 200  # a field name's or a string value's length
GROUP_KEYS = ("modules", "params", "reshard_after_forward", "forward_prefetch", "backward_prefetch", "param_dtype")
# a group's own MixedPrecisionPolicy.param_dtype: "fp32" keeps its modules in full precision under a mixed
# precision (BatchNorm's running stats, which FSDP2 does not cast, need fp32 activations); absent: the plan's
GROUP_PARAM_DTYPES = ("fp32",)

ReshardAfterForward = bool | int  # True, False, or the size of the sub-group that keeps a shard after forward


@dataclass(frozen=True)
class Mesh:
    """The data-parallel layout: ``replicate`` x ``shard`` ranks, shard innermost (HSDP when ``replicate`` > 1).

    ``fully_shard(mesh=init_device_mesh(dev, (replicate, shard)))``: each group is all-gathered and
    reduce-scattered over its ``shard`` consecutive ranks, and the reduced grads are all-reduced across the
    ``replicate`` copies (FSDP2's HSDP; torchtitan's ``data_parallel_replicate_degree`` x ``_shard_degree``)."""

    replicate: int
    shard: int

    @property
    def size(self) -> int:
        return self.replicate * self.shard

    @classmethod
    def flat(cls, world_size: int) -> Mesh:
        """Pure FSDP: one shard group of the whole world."""
        return cls(1, world_size)

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """``RxS`` (``2x4``: 2 replicas of 4-rank shard groups)."""
        left, sep, right = text.strip().lower().partition("x")
        if sep and left.isdigit() and right.isdigit() and (len(left) > 7 or len(right) > 7):  # (a trial: "two
            # positive whole numbers" for two that were)
            raise PlannerError(f"bad mesh '{text[:40]}': each of REPLICATE and SHARD must be under 10,000,000 ranks")
        if not sep or not left.isdigit() or not right.isdigit() or int(left) < 1 or int(right) < 1:
            raise PlannerError(f"bad mesh '{text[:40]}': give REPLICATExSHARD with two positive whole numbers, e.g. "
                               "2x4 (2 replicas of 4-rank shard groups; 1xN is pure FSDP over N ranks)")
        return cls(int(left), int(right))

    def describe(self) -> str:
        return f"{self.replicate}x{self.shard}"

    def to_dict(self) -> dict[str, int]:
        return {"replicate": self.replicate, "shard": self.shard}


WORKLOAD_KEYS = ("batch", "seq", "micro_batches", "ranks", "nodes", "gradient_sync")
SYNC_EVERY = "every"  # ``Workload.sync_every`` as the plan file spells it (``--gradient-sync every``)
MAX_WORKLOAD = 10**9  # each figure's bound (a batch, a sequence, a world size)


@dataclass(frozen=True)
class Workload:
    """The step a plan was made for, so that an export runs it (torchtitan's job sets its token counts): ``batch``
    sequences of ``seq`` tokens per data-parallel rank in an optimizer step, in ``micro_batches``, on ``ranks``
    GPUs. Absent from a plan of a model whose batch fsdp-planner does not know (a user factory's default inputs)."""

    batch: int
    seq: int  # 0: the model takes no sequence length (a CNN's, a factory's of images)
    micro_batches: int = 1
    ranks: int = 0  # the world the plan was simulated on (0: not known)
    nodes: int = 0  # the machines those ranks are on (0: not known)
    sync_every: bool = False  # each micro-batch's backward reduce-scatters (``--gradient-sync every``,
    # torchtitan's); False: the last one's only

    def to_dict(self) -> dict[str, int | str]:
        return {"batch": self.batch, **({"seq": self.seq} if self.seq else {}), "micro_batches": self.micro_batches,
                **({"ranks": self.ranks} if self.ranks else {}), **({"nodes": self.nodes} if self.nodes else {}),
                **({"gradient_sync": SYNC_EVERY} if self.sync_every else {})}


def _tuples(obj: Any, names: tuple[str, ...]) -> None:
    """Lists given to a frozen dataclass kept as tuples (a policy builds its groups as lists); one name given alone
    is a tuple of it, not of its letters (``replace(activation_checkpointing="layers.3")``)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, str):
            object.__setattr__(obj, name, (value,))
        elif not isinstance(value, tuple):
            object.__setattr__(obj, name, tuple(value))


def _frozen_dicts(obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, FrozenDict):
            object.__setattr__(obj, name, FrozenDict(value))


@dataclass(frozen=True)
class Group:
    """One FSDP parameter group: ``fully_shard(modules, reshard_after_forward=...)``. Immutable: a plan shares its
    groups with the plans made from it (``dataclasses.replace``)."""

    modules: tuple[str, ...]
    params: tuple[str, ...] = ()
    reshard_after_forward: ReshardAfterForward = True
    forward_prefetch: tuple[int, ...] = ()  # group indices to unshard at this one's forward
    backward_prefetch: tuple[int, ...] = ()  # ... at this one's pre-backward
    param_dtype: str = ""  # "fp32": its own MixedPrecisionPolicy computing in fp32 (inputs cast to it, outputs back
    # to the plan's compute dtype); "": the plan's precision

    def __post_init__(self) -> None:
        _tuples(self, ("modules", "params", "forward_prefetch", "backward_prefetch"))

    @property
    def is_root(self) -> bool:
        return self.modules == (ROOT,)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"modules": list(self.modules), "params": list(self.params),
                             "reshard_after_forward": self.reshard_after_forward}
        if self.forward_prefetch:
            d["forward_prefetch"] = list(self.forward_prefetch)
        if self.backward_prefetch:
            d["backward_prefetch"] = list(self.backward_prefetch)
        if self.param_dtype:  # absent: the plan's precision, as plans written before it was recorded
            d["param_dtype"] = self.param_dtype
        return d


@dataclass(frozen=True)
class RunOptions:
    """FSDP2's memory options a plan runs with, beside its grouping: what auto chooses when nothing fits without
    them, and what a plan file records (``offload``, ``shard_dims``, ``reduce_dtype``). A search keeps them apart
    from its plans; they are written into the plan where it leaves the program (``Plan.running``)."""

    offload: bool = False  # CPUOffloadPolicy: sharded params, grads and optimizer state on the CPU
    shard_dims: Mapping[str, int] = field(default_factory=FrozenDict)  # param -> dim it is sharded on, where not 0
    reduce_dtype: str = ""  # MixedPrecisionPolicy.reduce_dtype the user chose ("fp32", "bf16"); "": the precision's

    def __post_init__(self) -> None:
        _frozen_dicts(self, ("shard_dims",))


@dataclass(frozen=True)
class Plan:
    """A grouping of a model's params into FSDP2 groups, with their settings: what ``apply_plan`` applies and
    ``plan --out`` writes (``save`` / ``load``; ``fingerprint`` ties it to one model's param names, shapes and
    dtypes). Immutable: changes make a new plan (``dataclasses.replace``), sharing the groups it keeps."""

    groups: tuple[Group, ...]  # execution order, root group last
    fingerprint: str
    numel: int
    policy: str = ""
    model: str = ""
    activation_checkpointing: tuple[str, ...] = ()  # modules checkpointed in full
    # (every call: only its inputs kept after forward, its forward run again in backward; ``checkpointing.py``)
    selective_checkpointing: Mapping[str, SacPolicy] = field(default_factory=FrozenDict)  # module -> the op-level
    # selective checkpointing policy of its every call (its inputs and saved ops' outputs kept; ``selective.py``)
    mesh: Mesh | None = None  # None: pure FSDP over whatever world it runs on
    forward_methods: tuple[tuple[str, str], ...] = ()  # (module, method): non-forward methods
    # the step calls on a sharded module, run inside its pre/post-forward hooks (register_fsdp_forward_method)
    precision: str = ""  # the mixed precision the plan was simulated in (``choices.PRECISION_NAMES``; "": not
    # recorded, e.g. a hand-written plan): what ``export`` sets, so the code runs as the numbers assumed
    offload: bool = False  # the run options (``RunOptions``): CPUOffloadPolicy
    shard_dims: Mapping[str, int] = field(default_factory=FrozenDict)  # param -> dim it is sharded on, where not 0
    # (fully_shard(shard_placement_fn=...) returning Shard(dim))
    reduce_dtype: str = ""  # MixedPrecisionPolicy.reduce_dtype the user chose ("fp32", "bf16"); "": the precision's
    attention: str = ""  # the attention kernel the plan was made for (--attention: choices.ATTENTION_NAMES); "": the
    # default (sdpa, or a Hugging Face model's own implementation)
    kernels: tuple[str, ...] = ()  # the kernel packages its figures assume for linear-time mixers
    # (choices.KERNEL_PACKAGES: FLA's, mamba_ssm's), which its export checks for at run time
    hf_config: Mapping[str, Any] = field(default_factory=FrozenDict)  # the --hf-config fields the model was
    # planned with (an hf: model's config fields set over its file's, e.g. use_cache): verify and check rebuild it
    activation_offloading: tuple[str, ...] = ()  # modules whose every call's saved tensors go
    # to the host (``torch.autograd.graph.save_on_cpu`` around its forward; ``checkpointing.py``)
    tensor_parallel: TensorParallel | None = None  # TP over the innermost mesh dim, applied before the groups
    # are sharded over the data-parallel dims (``tensor_parallel.py``); None: no TP
    expert_parallel: ExpertParallel | None = None  # EP of the expert modules over ``ep`` ranks taken from
    # ``dp_shard``, each expert module its own group sharded over the EP-reduced mesh (``expert_parallel.py``)
    compiled: tuple[str, ...] = ()  # modules torch.compile'd one by one (fullgraph), after TP and checkpointing and
    # before fully_shard, as torchtitan compiles its blocks (--compile; ``apply/fully_shard.py``)
    float8: Float8 | None = None  # float8 training of the Linears torchao converts, before TP and fully_shard
    # (--float8; ``float8.py``); None: none
    workload: Workload | None = None  # the step it was made for (``as_written``); None: not known
    optimizer: str = ""  # the optimizer and implementation the plan was simulated with (``choices.OPTIMIZER_NAMES``:
    # its state's memory and its step's time): what an export runs (torchtitan's optimizer.implementation); "": not
    # recorded (a hand-written plan, or one written before plans recorded it)
    checkpoint_early_stop: bool = True  # torch.utils.checkpoint(early_stop=...) of its checkpointed modules: False
    # re-runs each one's whole forward in backward, as torchtitan's checkpoint wrapper does (--no-early-stop)
    compiled_loss: bool = False  # the loss torch.compile'd apart from the model, as torchtitan's
    # compile.components "loss" (--compile-loss; ``trace/compiled_loss.py``): what an export compiles
    loss_chunks: int = 0  # the output layer and the loss run in this many chunks of the tokens, as torchtitan's
    # ChunkedLossWrapper (--loss-chunks; ``trace/chunked_loss.py``): what an export's loss does; 0: whole
    loss_head: str = ""  # with loss_chunks: the output layer's module name (what an export's chunked step runs
    # alone); "" where not recorded
    zero_grad: str = ""  # "zeros": simulated with the sharded grads kept all step (--zero-grad zeros, torchtitan's
    # CUDA-graph jobs' zero_grad(set_to_none=False)), which a torchtitan export keeps; "": freed (torch's default)

    def __post_init__(self) -> None:
        _tuples(self, ("groups", "activation_checkpointing", "activation_offloading", "compiled"))
        methods = self.forward_methods
        if not (isinstance(methods, tuple) and all(isinstance(m, tuple) for m in methods)):
            object.__setattr__(self, "forward_methods", tuple(tuple(m) for m in methods))
        _frozen_dicts(self, ("selective_checkpointing", "shard_dims", "hf_config"))

    def replace(self, **changes: Any) -> Plan:
        """``dataclasses.replace``: this plan with ``changes``, sharing the rest (nothing of it can change)."""
        return replace(self, **changes)

    def with_group(self, i: int, **changes: Any) -> Plan:
        """This plan with group ``i`` replaced by a copy with ``changes`` (the other groups shared)."""
        if isinstance(i, bool) or not isinstance(i, int) or not -len(self.groups) <= i < len(self.groups):
            raise PlannerError(f"with_group's i must be a group's index, from 0 to {len(self.groups) - 1} (-1: the "
                               f"root's), not {i!r}"[:300])
        groups = list(self.groups)
        groups[i] = replace(groups[i], **changes)
        return replace(self, groups=groups)

    def with_every_group(self, **changes: Any) -> Plan:
        """This plan with every group, the root's too, a copy with ``changes`` (a config's reshard rule, a classic
        grouping kept gathered after forward)."""
        return replace(self, groups=[replace(g, **changes) for g in self.groups])

    @property
    def run(self) -> RunOptions:
        """The run options the plan records."""
        return RunOptions(self.offload, self.shard_dims, self.reduce_dtype)

    def running(self, run: RunOptions) -> Plan:
        """This plan recording ``run``: what a plan leaving the program carries (``--out``, export, the API)."""
        return replace(self, offload=run.offload, shard_dims=run.shard_dims, reduce_dtype=run.reduce_dtype)

    @property
    def tp_degree(self) -> int:
        return self.tensor_parallel.degree if self.tensor_parallel is not None else 1

    @property
    def ep_degree(self) -> int:
        return self.expert_parallel.degree if self.expert_parallel is not None else 1

    @property
    def ep_shard_degree(self) -> int:
        """EP's ranks out of dp_shard: with TP, EP's ranks span the TP ranks too (torchtitan's expert TP of 1), so
        EP / TP of them."""
        return max(1, self.ep_degree // self.tp_degree)

    def transforms(self) -> str:
        """What the job does to the modules besides sharding them, for a title: "4 modules compiled, float8
        tensorwise"; "" for none."""
        n = len(self.compiled)
        parts = [f"{n} module{'s' if n != 1 else ''} compiled"] if n else []
        if self.compiled_loss:
            parts.append("loss compiled")
        if self.loss_chunks:
            parts.append(f"loss in {self.loss_chunks} chunks")
        if self.float8 is not None:
            parts.append(f"float8 {self.float8.recipe.value}"
                         + (" (TP all-gathers in float8)" if self.float8.tp_float8_all_gather else ""))
        return ", ".join(parts)

    def layout(self, world_size: int) -> Mesh:
        """The plan's data-parallel mesh on ``world_size`` ranks in all (``check_plan_world_size`` has checked they
        agree): its mesh, or pure FSDP over the ranks TP leaves (``world_size`` / the TP degree)."""
        return self.mesh or Mesh.flat(world_size // self.tp_degree)

    def mesh_dims(self, world_size: int) -> dict[str, int]:
        """The device mesh by named dim, outermost first, as torchtitan names them (``dp_replicate``, ``dp_shard``,
        ``tp``; with EP, dp_shard split into ``dp_shard_mod_ep`` and ``dp_shard_in_ep``, EP's ranks being
        dp_shard_in_ep x tp); a dim of size 1 is left out, but a mesh always has ``dp_shard``."""
        dp = self.layout(world_size)
        dims = {"dp_replicate": dp.replicate, "dp_shard": dp.shard, "tp": self.tp_degree}
        if self.ep_degree > 1:  # torchtitan's split of dp_shard: the experts' FSDP mesh, then EP's ranks (with
            # TP: EP's group is dp_shard_in_ep x tp)
            ep = self.ep_shard_degree
            dims = {"dp_replicate": dp.replicate, "dp_shard_mod_ep": dp.shard // ep, "dp_shard_in_ep": ep,
                    "tp": self.tp_degree}
            return {k: v for k, v in dims.items() if v > 1 or k.startswith("dp_shard")}
        return {k: v for k, v in dims.items() if v > 1 or k == "dp_shard"}

    def shard_size(self, world_size: int) -> int:
        """Ranks each group is sharded over: the world, or the mesh's shard dimension."""
        return self.layout(world_size).shard

    @property
    def root(self) -> Group:
        return self.groups[-1]

    @property
    def inner_groups(self) -> tuple[Group, ...]:
        return self.groups[:-1]

    @property
    def checkpoints(self) -> bool:
        """Whether any module is checkpointed (in full or op-level), so early stop matters."""
        return bool(self.activation_checkpointing or self.selective_checkpointing)

    def group_of_param(self) -> dict[str, int]:
        return {p: i for i, g in enumerate(self.groups) for p in g.params}

    def signature(self) -> tuple:
        """What makes two plans behave the same (names and labels aside)."""
        return (tuple((g.modules, g.reshard_after_forward, g.forward_prefetch, g.backward_prefetch, g.param_dtype)
                      for g in self.groups), self.activation_checkpointing,
                tuple(self.selective_checkpointing.items()), self.mesh, self.forward_methods, self.offload,
                tuple(sorted(self.shard_dims.items())), self.reduce_dtype, self.activation_offloading,
                self.tensor_parallel.signature() if self.tensor_parallel is not None else None,
                self.expert_parallel, self.compiled,
                self.float8.signature() if self.float8 is not None else None, self.checkpoint_early_stop)

    # -- JSON ------------------------------------------------------------------------------------------------
    @property
    def chunked_head(self) -> str | None:
        """The output layer a loss in chunks runs alone ("" where the plan did not record it); None without chunks."""
        return self.loss_head if self.loss_chunks else None

    def _loss_keys(self) -> dict[str, Any]:
        """The loss's keys of ``to_dict``: each absent where the loss runs eager and whole, as plans written before
        them read."""
        d: dict[str, Any] = {"compiled_loss": True} if self.compiled_loss else {}
        if self.loss_chunks:
            d["loss_chunks"] = self.loss_chunks
            if self.loss_head:
                d["loss_head"] = self.loss_head
        return d

    def to_dict(self) -> dict[str, Any]:
        d = {
            "version": PLAN_VERSION,
            "model": {"fingerprint": self.fingerprint, "numel": self.numel, "name": self.model,
                      **({"hf_config": dict(self.hf_config)} if self.hf_config else {})},
            "policy": self.policy,
            "groups": [g.to_dict() for g in self.groups],
            "activation_checkpointing": list(self.activation_checkpointing),
        }
        if self.selective_checkpointing:  # absent when empty: plans without it read as before
            d["selective_checkpointing"] = {m: p.value for m, p in self.selective_checkpointing.items()}
        if self.mesh is not None:
            d["mesh"] = self.mesh.to_dict()
        if self.forward_methods:
            d["forward_methods"] = [{"module": m, "method": name} for m, name in self.forward_methods]
        if self.precision:
            d["precision"] = self.precision
        # the memory options, written only when set: a plan that uses none reads and writes as before
        if self.offload:
            d["offload"] = True
        if self.shard_dims:
            d["shard_dims"] = dict(self.shard_dims)
        if self.reduce_dtype:
            d["reduce_dtype"] = self.reduce_dtype
        if self.attention:  # absent: the default kernel, as plans written before it was recorded
            d["attention"] = self.attention
        if self.kernels:
            d["kernels"] = list(self.kernels)
        if self.activation_offloading:
            d["activation_offloading"] = list(self.activation_offloading)
        if self.tensor_parallel is not None:
            d["tensor_parallel"] = self.tensor_parallel.to_dict()
        if self.expert_parallel is not None:
            d["expert_parallel"] = self.expert_parallel.to_dict()
        if self.compiled:
            d["compiled"] = list(self.compiled)
        d.update(self._loss_keys())
        if self.float8 is not None:
            d["float8"] = self.float8.to_dict()
        if self.workload is not None:
            d["workload"] = self.workload.to_dict()
        if self.optimizer:
            d["optimizer"] = self.optimizer
        if not self.checkpoint_early_stop:  # absent: torch's default, as plans written before it read
            d["checkpoint_early_stop"] = False
        if self.zero_grad:
            d["zero_grad"] = self.zero_grad
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def checked_json(self) -> str:
        """``to_json``, checked to read back: no file the tool writes is one it then refuses (a model whose
        names or size the reader's limits refuse is one line at write time, not a plan no command can read)."""
        text = self.to_json()
        try:
            Plan.from_json(text)
        except PlannerError as e:
            raise PlannerError(f"cannot write this plan: it would not read back ({e})") from None
        return text

    def save(self, path: str | Path) -> None:
        write_atomic(path, self.checked_json() + "\n")

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> Plan:
        if not isinstance(text, str | bytes):
            raise PlannerError(f"Plan.from_json reads a plan's JSON text (a str), not {type(text).__name__}: "
                               "json.dumps a dict first, or Plan.load a file")
        data = parse_json(text, lambda detail: f"{where} is not valid JSON: {detail}")
        return _plan_from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        where = f"plan file '{path}'"
        return cls.from_json(read_text(path, where, "the JSON that `plan --out` writes"), where)


def _plan_from_dict(data: Any) -> Plan:
    if not isinstance(data, dict) or "version" not in data:
        raise PlannerError("this JSON is not an fsdp-planner plan: expected an object with 'version' and 'groups' "
                           "(and 'model', optional), as `plan --out` writes")
    version = data["version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != PLAN_VERSION:
        raise PlannerError(f"unsupported plan version {shown_json(version)}: this fsdp-planner reads plans with "
                           f"\"version\": {PLAN_VERSION}")
    _check_keys(data, PLAN_KEYS, "plan JSON")
    check_plan_limits(data)
    model, groups = data.get("model", {}), data.get("groups")  # no model: a hand-written plan, for any model
    if not isinstance(groups, list) or not groups:
        raise PlannerError("plan JSON needs a non-empty 'groups' list (each group a list of module names, or an "
                           "object with 'modules', as `plan --out` writes)")
    if not isinstance(model, dict):
        raise PlannerError("plan 'model' must be an object (its 'name', 'fingerprint' and 'numel', as `plan --out` "
                           "writes), or left out for a plan of any model")
    _check_keys(model, MODEL_KEYS, "plan 'model' object")
    parsed = [_group_from_dict(i, g) for i, g in enumerate(groups)]
    if not parsed[-1].is_root:
        parsed.append(Group([ROOT], [], False))
    _check_structure(parsed)
    checkpointed = data.get("activation_checkpointing", [])
    if not _str_list(checkpointed) or len(set(checkpointed)) != len(checkpointed):
        raise PlannerError("plan 'activation_checkpointing' must be a list of module names, each listed once "
                           "(the modules checkpointed in full)")
    numel = model.get("numel", 0)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise PlannerError(f"plan 'model.numel' must be a whole number of 0 or more, got {shown_json(numel)}")
    plan = Plan(parsed, str(model.get("fingerprint", "")), numel, policy=str(data.get("policy", "")),
                model=str(model.get("name", "")), activation_checkpointing=list(checkpointed),
                selective_checkpointing=_selective_from_dict(data.get("selective_checkpointing", {})),
                mesh=_mesh_from_dict(data.get("mesh")),
                forward_methods=_methods_from_list(data.get("forward_methods", [])),
                precision=_precision_from(data.get("precision", "")),
                attention=_attention_from(data.get("attention", "")), kernels=_kernels_from(data.get("kernels", [])),
                hf_config=_hf_config_from(model),
                activation_offloading=_offloaded_from(data.get("activation_offloading", [])),
                tensor_parallel=tensor_parallel_from_dict(data.get("tensor_parallel")),
                expert_parallel=expert_parallel_from_dict(data.get("expert_parallel")),
                compiled=_compiled_from(data.get("compiled", [])), float8=float8_from_dict(data.get("float8")),
                workload=_workload_from(data.get("workload")), optimizer=_optimizer_from(data.get("optimizer", "")),
                checkpoint_early_stop=_early_stop_from(data.get("checkpoint_early_stop", True)),
                compiled_loss=_compiled_loss_from(data.get("compiled_loss", False)),
                loss_chunks=_loss_chunks_from(data.get("loss_chunks", 0)),
                loss_head=_loss_head_from(data.get("loss_head", "")),
                zero_grad=_zero_grad_from(data.get("zero_grad", "")),
                **_memory_options(data))
    plan = _with_its_ep(plan)
    check_int_reshard_on_dim0(plan)
    if plan.tensor_parallel is not None and plan.tensor_parallel.async_tp and not plan.compiled:
        # torchtitan's maybe_enable_async_tp raises unless the model is compiled (configs/job_config.py)
        raise PlannerError("plan 'tensor_parallel.async_tp' overlaps TP's collectives with the matmuls in compiled "
                           "code, and the plan compiles no module ('compiled' is empty): make the plan with "
                           "--compile, or set async_tp to false")
    return plan


def _hf_config_from(model: dict[str, Any]) -> dict[str, Any]:
    """``model.hf_config``: config field names to JSON scalars, bounded (what ``--hf-config`` gives)."""
    config = model.get("hf_config", {})
    if not isinstance(config, dict) or len(config) > MAX_HF_CONFIG:
        raise PlannerError(f"plan 'model.hf_config' must be an object of at most {MAX_HF_CONFIG} config fields, got "
                           f"{shown_json(config)}")
    for key, value in config.items():
        scalar = isinstance(value, bool | int | str) or value is None or (isinstance(value, float) and
                                                                           math.isfinite(value))
        if not key.isidentifier() or key.startswith("_") or len(key) > MAX_HF_CONFIG_CHARS or not scalar \
                or (isinstance(value, str) and len(value) > MAX_HF_CONFIG_CHARS):
            raise PlannerError(f"plan 'model.hf_config' field {shown_json(key)} must be a config field name with "
                               f"a true/false, finite number, string or null value, got {shown_json(value)}")
        check_field(key, value, "plan 'model.hf_config'")
    return dict(config)


def check_int_reshard_on_dim0(plan: Plan) -> None:
    """An int ``reshard_after_forward`` only for groups whose params are all sharded on dim 0: FSDP2 keeps the
    post-forward shard flat (``FSDPParam.to_sharded_post_forward`` narrows a 1-D view) and its all-gather copy-out
    then indexes the shard dim of that 1-D size, an IndexError for dim 1 (torch 2.13,
    ``_fsdp_collectives.foreach_all_gather_copy_out``)."""
    if not plan.shard_dims:
        return
    for i, g in enumerate(plan.groups):
        on_dim1 = next((p for p in g.params if plan.shard_dims.get(p, 0) != 0), None)
        if not isinstance(g.reshard_after_forward, bool) and on_dim1 is not None:
            raise PlannerError(f"plan group {i} reshards to {g.reshard_after_forward} ranks after forward but holds "
                               f"'{printable_name(on_dim1)}', sharded on dim {plan.shard_dims[on_dim1]}: FSDP2 "
                               "supports an int reshard_after_forward for dim-0 sharding only; use true or false for "
                               "this group")


REDUCE_DTYPES = ("fp32", "bf16")  # choices.ReduceDtype's values


def _memory_options(data: dict[str, Any]) -> dict[str, Any]:
    """``offload`` (a boolean), ``shard_dims`` ({param: dim >= 1}) and ``reduce_dtype`` ("fp32" or "bf16"); absent:
    FSDP2's defaults."""
    offload = data.get("offload", False)
    if not isinstance(offload, bool):
        raise PlannerError(f"plan 'offload' must be true or false (CPUOffloadPolicy), got {shown_json(offload)}")
    dims = data.get("shard_dims", {})
    if not isinstance(dims, dict) or any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64
                                         for v in dims.values()):
        raise PlannerError(f"plan 'shard_dims' must map param names to the dim they are sharded on (a whole number "
                           f"from 1 to 64; dim 0 is the default and not listed), got {shown_json(dims)}")
    reduce = data.get("reduce_dtype", "")
    if reduce != "" and reduce not in REDUCE_DTYPES:
        raise PlannerError(f"plan 'reduce_dtype' must be one of {', '.join(REDUCE_DTYPES)}, got {shown_json(reduce)}")
    return {"offload": offload, "shard_dims": dict(dims), "reduce_dtype": reduce}


def _early_stop_from(value: Any) -> bool:
    if not isinstance(value, bool):
        raise PlannerError("plan 'checkpoint_early_stop' must be true or false (torch.utils.checkpoint's early_stop: "
                           f"false re-runs each checkpointed forward whole), got {shown_json(value)}")
    return value


def _attention_from(value: Any) -> str:
    if value != "" and value not in ATTENTION_NAMES:
        raise PlannerError(f"plan 'attention' must be one of {', '.join(ATTENTION_NAMES)}, got {shown_json(value)}")
    return str(value)


def _kernels_from(items: Any) -> tuple[str, ...]:
    """``["flash-linear-attention"]``: the kernel packages the plan's figures assume; absent: none."""
    if not _str_list(items) or len(set(items)) != len(items) or any(k not in KERNEL_PACKAGES for k in items):
        raise PlannerError(f"plan 'kernels' must be a list of {', '.join(KERNEL_PACKAGES)}, each once, got "
                           f"{shown_json(items)}")
    return tuple(items)


def _offloaded_from(items: Any) -> list[str]:
    """``["layers.0", ...]``: the modules whose saved activations go to the host; absent: none."""
    if not _str_list(items) or len(set(items)) != len(items):
        raise PlannerError("plan 'activation_offloading' must be a list of module names, each listed once (the "
                           "modules whose saved activations are offloaded to the host)")
    return list(items)


def _compiled_loss_from(value: Any) -> bool:
    if not isinstance(value, bool):
        raise PlannerError(f"plan 'compiled_loss' must be true (the loss runs torch.compile'd, --compile-loss) or "
                           f"false, got {shown_json(value)}")
    return value


def _loss_chunks_from(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == 0 or 2 <= value <= MAX_LOSS_CHUNKS):
        raise PlannerError(f"plan 'loss_chunks' must be a whole number from 2 to {MAX_LOSS_CHUNKS:,} (the loss in "
                           f"that many chunks, --loss-chunks) or 0, got {shown_json(value)}")
    return value


def _loss_head_from(value: Any) -> str:
    if not isinstance(value, str) or (value and not is_module_path(value)):
        raise PlannerError(f"plan 'loss_head' must be the output layer's module name (non-empty names separated by "
                           f"dots), got {shown_json(value)}")
    return value


def _compiled_from(items: Any) -> list[str]:
    if not _str_list(items) or len(set(items)) != len(items):
        raise PlannerError("plan 'compiled' must be a list of module names, each listed once (the modules "
                           "torch.compile'd)")
    return list(items)


def _optimizer_from(value: Any) -> str:
    if value != "" and value not in OPTIMIZER_NAMES:
        raise PlannerError(f"plan 'optimizer' must be one of {', '.join(OPTIMIZER_NAMES)}, got {shown_json(value)}")
    return str(value)


def _zero_grad_from(value: Any) -> str:
    if value not in ("", ZeroGrad.NONE.value, ZeroGrad.ZEROS.value):
        raise PlannerError(f"plan 'zero_grad' must be \"zeros\" or \"none\", got {shown_json(value)}")
    return "zeros" if value == ZeroGrad.ZEROS.value else ""


def _precision_from(value: Any) -> str:
    if value != "" and value not in PRECISION_NAMES:
        raise PlannerError(f"plan 'precision' must be one of {', '.join(PRECISION_NAMES)}, got {shown_json(value)}")
    return str(value)


# the EP term the planner writes in a plan's policy label (``service/planning.with_ep``, auto's EP screens):
# "EP 4", "EP 8 (skew 1.5)", then what the screens add ("(experts' own calls, kept after forward)", "on 2x4")
_EP_TERM = re.compile(r", EP \d+(?: \([^()]*\)){0,2}(?: on \d+x\d+)?")
_EP_DEGREE = re.compile(r"\bEP \d+")


def _with_its_ep(plan: Plan) -> Plan:
    """A plan file's expert parallelism as it runs: degree 1 (a hand edit) is none, and its policy label says the
    degree it has, not the one it was planned with (the EP term is dropped for none, or where the file's
    ``expert_parallel`` was taken out)."""
    ep = plan.expert_parallel
    label = plan.policy or ""
    if ep is None or ep.degree == 1:
        if ep is None and _EP_TERM.search(label) is None:
            return plan
        return replace(plan, expert_parallel=None, policy=_EP_TERM.sub("", label, count=1))
    if ep is not None and (term := _EP_TERM.search(label)) is not None:
        said = _EP_DEGREE.sub(f"EP {ep.degree}", term.group(0), count=1)
        return replace(plan, policy=label[:term.start()] + said + label[term.end():])
    return plan


def _selective_from_dict(items: Any) -> dict[str, SacPolicy]:
    """``{"layers.0": "titan", ...}``; absent: none."""
    if not isinstance(items, dict) or any(not isinstance(p, str) for p in items.values()):
        raise PlannerError("plan 'selective_checkpointing' must be an object mapping module names to an op-level "
                           f"checkpointing policy ({', '.join(SAC_POLICY_NAMES)})")
    bad = next((p for p in items.values() if p not in SAC_POLICY_NAMES), None)
    if bad is not None:
        raise PlannerError(f"plan 'selective_checkpointing' names the unknown policy {shown_json(bad)}: choose one of "
                           f"{', '.join(SAC_POLICY_NAMES)}")
    return {m: SacPolicy(p) for m, p in items.items()}


def _methods_from_list(items: Any) -> list[tuple[str, str]]:
    """``[{"module": "head", "method": "loss"}, ...]``; absent: none."""
    if not isinstance(items, list) or any(
            not isinstance(x, dict) or set(x) != {"module", "method"} or not isinstance(x["module"], str)
            or not isinstance(x["method"], str) or not x["method"].isidentifier() for x in items):
        raise PlannerError(f"plan 'forward_methods' must be a list of {{\"module\": NAME, \"method\": NAME}} objects "
                           f"(methods registered with register_fsdp_forward_method), got {shown_json(items)}")
    pairs = [(x["module"], x["method"]) for x in items]
    if len(set(pairs)) != len(pairs):
        raise PlannerError("plan 'forward_methods' lists a method twice; list each once")
    return pairs


def _workload_from(w: Any) -> Workload | None:
    if w is None:
        return None
    sync = w.get("gradient_sync", "last") if isinstance(w, dict) else "last"
    whole = isinstance(w, dict) and {"batch"} <= set(w) <= set(WORKLOAD_KEYS) and sync in ("last", SYNC_EVERY) \
        and all(not isinstance(v, bool) and isinstance(v, int) and 0 <= v <= MAX_WORKLOAD
                for k, v in w.items() if k != "gradient_sync")
    if not whole or min(w["batch"], w.get("seq", 1), w.get("micro_batches", 1)) < 1 \
            or w["batch"] % w.get("micro_batches", 1) or (w.get("nodes") and w.get("ranks", 0) % w["nodes"]):
        raise PlannerError(f"plan 'workload' must be {{\"batch\": B, \"seq\": S}} with whole numbers from 1 to "
                           f"{MAX_WORKLOAD:,} (\"seq\" absent for a model without one; optional \"micro_batches\" "
                           "dividing B, \"ranks\", \"nodes\" dividing "
                           f"them, \"gradient_sync\" \"last\" or \"every\"), got {shown_json(w)}")
    return Workload(w["batch"], w.get("seq", 0), w.get("micro_batches", 1), w.get("ranks", 0), w.get("nodes", 0),
                    sync == SYNC_EVERY and w.get("micro_batches", 1) > 1)


def _mesh_from_dict(m: Any) -> Mesh | None:
    if m is None:
        return None
    if not isinstance(m, dict) or set(m) != {"replicate", "shard"} or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in m.values()):
        raise PlannerError(f"plan 'mesh' must be {{\"replicate\": R, \"shard\": S}} with two positive whole numbers "
                           f"(R x S ranks, shard innermost), got {shown_json(m)}")
    return Mesh(m["replicate"], m["shard"])


def _group_from_dict(i: int, g: Any) -> Group:
    if _str_list(g):  # a hand-written group: just its modules (params derived: ``claim.with_claimed_params``)
        g = {"modules": g}
    if not isinstance(g, dict) or not _str_list(g.get("modules")) or not _str_list(g.get("params", [])):
        raise PlannerError(f"plan group {i} must be an object with a 'modules' list and a 'params' list of names")
    _check_keys(g, GROUP_KEYS, f"plan group {i}")
    raf = g.get("reshard_after_forward", True)
    if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
        raise PlannerError(f"plan group {i}: reshard_after_forward must be true, false or a positive whole number "
                           f"(the size of the group that keeps a shard after forward), got {shown_json(raf)}")
    prefetch = {}
    for key in ("forward_prefetch", "backward_prefetch"):
        value = g.get(key, [])
        if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in value):
            raise PlannerError(f"plan group {i}: {key} must be a list of group indices")
        prefetch[key] = list(value)
    param_dtype = g.get("param_dtype", "")
    if param_dtype != "" and param_dtype not in GROUP_PARAM_DTYPES:
        raise PlannerError(f"plan group {i}: param_dtype must be {', '.join(GROUP_PARAM_DTYPES)} (the group computes "
                           f"in full precision) or absent (the plan's precision), got {shown_json(param_dtype)}")
    return Group(modules=list(g["modules"]), params=list(g.get("params", [])), reshard_after_forward=raf,
                 param_dtype=param_dtype, **prefetch)




def _check_keys(d: dict[str, Any], accepted: tuple[str, ...], where: str) -> None:
    """Refuse a key the plan format does not have: a misspelled one would otherwise be silently ignored."""
    for key in map(str, d):
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1) if len(key) <= 100 else []
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            name = json.dumps(key)[1:-1]  # control characters escaped: the message stays one line
            name = name if len(name) <= 40 else f"{name[:30]}...({len(key)} characters)"
            raise PlannerError(f"{where} has an unknown key '{name}'{hint}; the accepted keys are "
                               f"{_listed(accepted)}")


def _listed(keys: tuple[str, ...], width: int = 160) -> str:
    """``keys`` comma-separated, the ones past ``width`` characters counted (the message stays one short line)."""
    shown: list[str] = []
    for k in keys:
        if sum(len(s) + 2 for s in shown) + len(k) > width:
            return f"{', '.join(shown)} and {len(keys) - len(shown)} more (docs/json.md)"
        shown.append(k)
    return ", ".join(shown)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def check_plan_world_size(plan: Plan, world_size: int, plan_file: bool = False) -> None:
    """Refuse a plan that FSDP2 cannot apply on ``world_size`` ranks: its layout must fit them
    (``check_plan_layout``), and an int ``reshard_after_forward`` is the size of the post-forward sub-mesh, so it
    must divide the shard size and not exceed it (``fully_shard`` raises otherwise). Called where a plan meets a
    cluster or a process count."""
    check_plan_layout(plan, world_size, plan_file)
    check_reshard_sizes(plan, world_size)


def check_plan_layout(plan: Plan, world_size: int, plan_file: bool = False) -> None:
    """Refuse a plan whose layout does not fit ``world_size`` ranks: its TP degree must divide them, its mesh have
    that many, its EP degree divide the data-parallel shard ranks. ``plan_file``: the plan is a file's, whose mesh
    no option changes (its refusal says to plan again, not to give --mesh)."""
    tp = plan.tp_degree
    if world_size % tp:
        raise PlannerError(f"the plan's tensor-parallel degree {tp} does not divide the {world_size} ranks it is run "
                           "on: give a world size that is a multiple of it, or plan again for this one")
    if plan.mesh is not None and plan.mesh.size * tp != world_size:
        ranks = f"{plan.mesh.size} ranks" + (f" (x TP {tp})" if tp > 1 else "")
        if plan_file:  # (--mesh has no effect with --plan: a trial was told both)
            raise PlannerError(f"the plan file's mesh {plan.mesh.describe()} has {ranks} but the job runs on "
                               f"{world_size}: make the plan again for {world_size} ranks (a plan file fixes its "
                               "mesh)")
        raise PlannerError(f"the mesh {plan.mesh.describe()} has {ranks} but the job runs on {world_size}: give "
                           f"--mesh REPLICATExSHARD with a product of {world_size // tp} (e.g. 1x{world_size // tp})")
    shard = plan.shard_size(world_size)
    if plan.ep_degree > 1 and plan.ep_degree % tp:
        raise PlannerError(f"the plan's expert-parallel degree {plan.ep_degree} is not a multiple of its TP degree "
                           f"{tp}: EP's ranks span the TP ranks (torchtitan's expert TP of 1)")
    if shard % plan.ep_shard_degree:
        what = f"degree {plan.ep_degree}" if tp == 1 else f"degree {plan.ep_degree} / TP {tp}"
        raise PlannerError(f"the plan's expert-parallel {what} does not divide its {shard} data-parallel shard "
                           "ranks (EP's ranks come out of dp_shard" + (" x tp" if tp > 1 else "") + "): choose an "
                           "EP degree that divides them")


def check_reshard_sizes(plan: Plan, world_size: int) -> None:
    """Refuse an int ``reshard_after_forward`` that does not divide its group's shard ranks on ``world_size`` ranks
    (the plan's layout checked first: ``check_plan_layout``)."""
    shard = plan.shard_size(world_size)
    where = "world size" if plan.mesh is None or plan.mesh.replicate == 1 else "shard size"
    ep = plan.expert_parallel
    for i, g in enumerate(plan.groups):
        raf = g.reshard_after_forward
        if isinstance(raf, bool):
            continue
        # an expert module's group is sharded over the EP-reduced mesh: dp_shard / (EP / TP) ranks
        experts = ep is not None and plan.ep_shard_degree > 1 and \
            all(any(matches(p, m) for p in ep.modules) for m in g.modules)
        size = shard // plan.ep_shard_degree if experts else shard
        if raf > size or size % raf:
            ds = divisors(size)
            shown = ", ".join(map(str, ds[:8])) + (f", ..., {size}" if len(ds) > 8 else "")
            mesh = "experts' EP-reduced shard mesh" if experts else where
            raise PlannerError(f"plan group {i} has reshard_after_forward={raf}, which FSDP2 needs to divide the "
                               f"{mesh} of {size} ranks (and not exceed it); use true, false or one of {shown}")


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _check_structure(groups: list[Group]) -> None:
    """What any plan must satisfy, whatever the model: one root group, last; no empty group; each module and
    param listed once; prefetch lists naming other existing groups."""
    seen_modules: dict[str, int] = {}
    seen_params: dict[str, int] = {}
    for i, g in enumerate(groups):
        if not g.modules:
            raise PlannerError(f"plan group {i} lists no modules")
        if ROOT in g.modules and i != len(groups) - 1:
            raise PlannerError(f"plan group {i}: only the last group may be the root (module '')")
        for names, seen, what in ((g.modules, seen_modules, "module"), (g.params, seen_params, "param")):
            for name in names:
                if name in seen:
                    where = "twice in that group" if seen[name] == i else f"also in group {seen[name]}"
                    raise PlannerError(f"plan group {i} lists {what} {shown_json(name)} {where}; each may be "
                                       "listed once")
                seen[name] = i
        for key, targets in (("forward_prefetch", g.forward_prefetch), ("backward_prefetch", g.backward_prefetch)):
            bad = [j for j in targets if not 0 <= j < len(groups) or j == i]
            if bad:
                raise PlannerError(f"plan group {i}: {key} names {shown_json(bad[0])}, which is not another group of "
                                   f"the plan (groups are numbered 0 to {len(groups) - 1})")
            twice = _first_repeat(targets)
            if twice is not None:  # (FSDP2 would unshard it twice over; a 100,000-entry list was read, a trial)
                raise PlannerError(f"plan group {i}: {key} names group {twice} twice; each may be listed once")


def _first_repeat(values: Sequence[int]) -> int | None:
    """The first value ``values`` holds twice, if any (in one pass: a list may be long)."""
    seen: set[int] = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


# -- limits: what a plan file may hold at all, checked on the raw JSON before it is read ------------------------------
# Far beyond any real plan, yet small enough that no message, loop or number built from a file can blow up: a plan
# with a 100 KB policy string once hung the terminal output, a 4,000-digit reshard_after_forward filled an error.
MAX_GROUPS = 100_000  # a 50,000-module model has fewer
MAX_RANKS = 1_000_000  # hardware.cluster.MAX_WORLD_SIZE (not imported: fsdp2 comes before hardware)
MAX_NUMEL = 2**63 - 1  # parameters: any count torch holds (a plan is compared with its model, which says the rest)
# what the tool itself writes must read back: 'model.name' is the model spec (a path of up to PATH_MAX, 4,096), and
# 'policy' names every class --module-classes gave
MAX_LABEL = 10_000  # characters of 'policy', 'model.name', 'model.fingerprint'
MAX_NAME = 100_000  # characters of a module or param name (a 1,000-deep nn.Sequential's FQN is under 2,000)


def check_plan_limits(data: dict[str, Any]) -> None:
    """Sizes and names of a plan file's raw JSON, one line each: strings of bounded length, counts and numbers in
    range, module names that are module paths, forward methods that are public method names. What has the wrong
    type is left to the reader, which names it."""
    for key, value in (("policy", data.get("policy", "")), ("model.name", _get(data, "model", "name", "")),
                       ("model.fingerprint", _get(data, "model", "fingerprint", ""))):
        if not isinstance(value, str) or len(value) > MAX_LABEL:  # null too: it once read as the label 'None'
            raise PlannerError(f"plan '{key}' must be a string of at most {MAX_LABEL:,} characters, got "
                               f"{shown_json(value)}")
        if "\n" in value or "\r" in value:  # (it is printed in headers and notes: a line of its own would pose as
            # the program's, 'error: ...')
            raise PlannerError(f"plan '{key}' must be one line, got {shown_json(value)}")
    numel = _get(data, "model", "numel")
    if isinstance(numel, int) and not isinstance(numel, bool) and numel > MAX_NUMEL:
        raise PlannerError(f"plan 'model.numel' {shown_json(numel)} is more than {MAX_NUMEL:,} parameters (2**63 - "
                           "1): not a model's size")
    groups = data.get("groups")
    if isinstance(groups, list):
        if len(groups) > MAX_GROUPS:
            raise PlannerError(f"the plan has {len(groups):,} groups; at most {MAX_GROUPS:,} are accepted")
        for i, g in enumerate(groups):
            if isinstance(g, dict):
                _check_group_limits(i, g)
    _check_names(data.get("activation_checkpointing"), "plan 'activation_checkpointing'", module=True)
    _check_names(data.get("activation_offloading"), "plan 'activation_offloading'", module=True)
    _check_names(data.get("compiled"), "plan 'compiled'", module=True)
    selective = data.get("selective_checkpointing")
    if isinstance(selective, dict):
        _check_names(list(selective), "plan 'selective_checkpointing'", module=True)
    _check_methods_limits(data.get("forward_methods"))
    dims = data.get("shard_dims")
    if isinstance(dims, dict):
        _check_names(list(dims), "plan 'shard_dims'", module=False)
    _check_mesh_limits(data.get("mesh"))


def _get(data: dict[str, Any], key: str, sub: str, default: Any = None) -> Any:
    inner = data.get(key)
    return inner.get(sub, default) if isinstance(inner, dict) else default


def _check_group_limits(i: int, g: dict[str, Any]) -> None:
    raf = g.get("reshard_after_forward")
    if isinstance(raf, int) and not isinstance(raf, bool) and raf > MAX_RANKS:
        raise PlannerError(f"plan group {i}: reshard_after_forward {shown_json(raf)} is more ranks than the "
                           f"{MAX_RANKS:,} a cluster may have")
    _check_names(g.get("modules"), f"plan group {i} 'modules'", module=True)
    _check_names(g.get("params"), f"plan group {i} 'params'", module=False)
    for key in ("forward_prefetch", "backward_prefetch"):
        value = g.get(key)
        if isinstance(value, list) and len(value) > MAX_GROUPS:
            raise PlannerError(f"plan group {i}: {key} lists {len(value):,} groups; at most {MAX_GROUPS:,}")


def _check_names(names: Any, where: str, module: bool) -> None:
    """Module paths (``layers.0.attn``; ``""`` the root, for modules only) or param names, each at most
    ``MAX_NAME`` characters; a list of anything else is left to the reader."""
    if not isinstance(names, list):
        return
    if len(names) > MAX_GROUPS * 10:
        raise PlannerError(f"{where} lists {len(names):,} names; at most {MAX_GROUPS * 10:,} are accepted")
    for name in names:
        if isinstance(name, str) and not (module and name == "") and not is_module_path(name):
            what = "module path" if module else "param name"
            raise PlannerError(f"{where}: {shown_json(name)} is not a {what} (non-empty names separated by dots, at "
                               f"most {MAX_NAME:,} characters in all)")


def is_module_path(name: str) -> bool:
    """A dotted name as ``named_modules`` / ``named_parameters`` spell one: non-empty parts. Any other character is
    legal: ``add_module`` refuses only dots and the empty name, so ``nn.ModuleDict`` keys such as ``"block-1"`` (or a
    key with a space or a control character) are module names, and a plan written for such a model must read back;
    every output escapes names for its target instead."""
    return 0 < len(name) <= MAX_NAME and "" not in name.split(".")


def _check_methods_limits(items: Any) -> None:
    """``forward_methods``: module paths, and method names FSDP2 can register (public, valid identifiers: a dunder
    such as ``__init__`` or a private ``_helper`` is no forward-like method and used to fail only in the ranks)."""
    if not isinstance(items, list):
        return
    if len(items) > MAX_GROUPS:
        raise PlannerError(f"plan 'forward_methods' lists {len(items):,} methods; at most {MAX_GROUPS:,}")
    for x in items:
        if not isinstance(x, dict):
            continue
        module, method = x.get("module"), x.get("method")
        if isinstance(module, str) and module != "" and not is_module_path(module):
            raise PlannerError(f"plan 'forward_methods': module {shown_json(module)} is not a module path (names "
                               "separated by dots; \"\" for the root)")
        if isinstance(method, str) and not _is_public_method(method):
            raise PlannerError(f"plan 'forward_methods': method {shown_json(method)} is not a public method name (a "
                               "Python identifier, not a keyword, not starting with '_')")


def _is_public_method(name: str) -> bool:
    return len(name) <= MAX_NAME and name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_")


def _check_mesh_limits(m: Any) -> None:
    if not isinstance(m, dict):
        return
    sizes = [v for v in m.values() if isinstance(v, int) and not isinstance(v, bool)]
    if any(v > MAX_RANKS for v in sizes) or math.prod(min(v, MAX_RANKS + 1) for v in sizes) > MAX_RANKS:
        raise PlannerError(f"plan 'mesh' {shown_json(m)} has more ranks than the {MAX_RANKS:,} a cluster may have")
