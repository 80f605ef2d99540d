"""Everything about a step that does not depend on the plan, computed once per (model, cluster, options), so a
planner can simulate many plans cheaply."""

from __future__ import annotations

import bisect
import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Mesh
from fsdp_planner.fsdp2.replay import Collective
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.hardware.cost import CollectiveCost, LinkCost, collective_cost
from fsdp_planner.sim.compute import step_op_times, traced_itemsize
from fsdp_planner.sim.expert_parallel import ep_seconds, expert_ranks
from fsdp_planner.sim.float8 import float8_step
from fsdp_planner.sim.memory import MemoryModel
from fsdp_planner.sim.optimizer_step import gpu_optimizer_seconds
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.recompute import Checkpointed, checkpointed_calls, offload_bytes
from fsdp_planner.sim.tensor_parallel import grad_all_reduce_positions, tp_amax_seconds, tp_seconds
from fsdp_planner.trace.records import Trace


@dataclass(frozen=True)
class Recompute:
    """Forward run again at one pre-backward boundary: its op seconds, the params it reads, whose calls, and how
    many ops the host launches again for it, of which ``syncs`` the host waits for (``Event.syncs``). Under
    activation offloading, the host copies at a boundary instead: ``copy_seconds`` on the compute stream
    (device-to-host after an offloaded call's forward, host-to-device at its pre-backward; ``save_on_cpu`` copies on
    the current stream, ``fsdp2/checkpointing.py``)."""

    seconds: float
    params: frozenset[int]
    modules: list[str]
    ops: int
    copy_seconds: float = 0.0
    syncs: int = 0


class SimContext:
    """Op times (``times`` if given, else the trace's measured ``op_seconds``, else the roofline estimate), their
    running sum, the memory model and the lower bound of one model on one cluster with one data-parallel layout
    (``mesh``; default pure FSDP over the whole cluster)."""

    def __init__(self, trace: Trace, cluster: Cluster, options: SimOptions | None = None,
                 times: list[float] | None = None, mesh: Mesh | None = None, like: SimContext | None = None) -> None:
        """``like``: a context of the same model, cluster and options on another layout, whose layout-free parts
        (op times and their running sum, activation levels, recomputations) are shared (``on_mesh``)."""
        self.trace, self.cluster = trace, cluster
        self.options = options or SimOptions()
        self.precision = self.options.precision
        self.world = cluster.world_size
        self.mesh = mesh or Mesh.flat(self.world)
        if self.mesh.size != self.world:
            raise PlannerError(f"mesh {self.mesh.describe()} has {self.mesh.size} ranks but cluster {cluster.name} has "
                               f"{self.world} GPUs")
        self.shard = self.mesh.shard
        self.grad_sync = True  # the micro-batch reduce-scatters its grads (``accumulating``: one that does not)
        self._accumulating: SimContext | None = None
        self._experts = frozenset(trace.expert_params)  # an EP view's expert params: sharded over shard / EP ranks
        if like is not None:
            if times is not None or like.trace is not trace or like.options != self.options:
                raise ValueError("a context shares op times only with one of the same trace and options")
            self.times, self.cum_array, self.cum = like.times, like.cum_array, like.cum
            self.compute_total, self.float8 = like.compute_total, like.float8
        else:
            f8 = self.options.float8  # float8 training's matmuls, casts and all-gathers (sim/float8.py)
            self.float8 = float8_step(trace, f8, self.precision.compute_bytes) if f8 is not None else None
            if times is None:
                times = step_op_times(trace, cluster.gpu, self.precision, cluster.compute, self.world,
                                      self.options.mfu, self.float8)
            if len(times) != len(trace.events):
                raise ValueError(f"got {len(times)} op times for a trace of {len(trace.events)} events")
            if trace.tensor_parallel:  # TP's collectives on their TP group (sim/tensor_parallel.py)
                times = tp_seconds(trace, cluster, list(times), self.precision.compute_bytes / traced_itemsize(trace))
                if self.float8 is not None:  # float8's amax all-reduces before the casts of TP shards
                    times = np.asarray(times)
                    times[self.float8.matmuls] += self.float8.tp_amax_seconds(tp_amax_seconds(trace, cluster))
            if trace.expert_parallel:  # EP's all-to-alls on their EP group (sim/expert_parallel.py)
                times = ep_seconds(trace, cluster, list(times), self.precision.compute_bytes / traced_itemsize(trace))
            self.times = list(times)
            self.cum_array = np.concatenate([[0.0], np.cumsum(self.times)])  # for vector work on every plan
            self.cum = self.cum_array.tolist()  # for the engines' scalar reads
            self.compute_total = float(sum(self.times))
        self.memory = MemoryModel(trace, self.shard, self.precision, self.options.optimizer,
                                  self.options.zero_grad, like.memory if like is not None else None,
                                  self.options.offload, self.options.shard_placement,
                                  self.float8.gathered if self.float8 is not None else frozenset(),
                                  self.float8.levels(len(trace.events) + 1) if self.float8 is not None else None,
                                  workspaces=cluster.engine is not Engine.HOST)
        self.sizing = self.memory.sizing
        self._costs: dict[tuple[CollectiveKind, int], CollectiveCost] = {}
        self._lines: dict[tuple[CollectiveKind, int, bool, int], LinkCost] = {}
        self._recompute: dict[tuple[Checkpointed, ...], dict[int, Recompute]] = \
            like._recompute if like is not None else {}
        self._optimizer: float | None = None  # ``optimizer_seconds``, once asked (every plan's report asks)
        self.lower_bound = self._lower_bound()

    def on_mesh(self, mesh: Mesh) -> SimContext:
        """This model, cluster and options on another layout, sharing what does not depend on the layout."""
        return SimContext(self.trace, self.cluster, self.options, mesh=mesh, like=self)

    def accumulating(self) -> SimContext:
        """This context for a micro-batch that accumulates grads (sync off): the same, less TP's grad all-reduces,
        which FSDP2 runs in the post-backward that reduce-scatters (``KERNEL_TP_GRAD_ALL_REDUCE``). Backward ops
        only: the recomputations (forward spans) and the memory model are shared."""
        if self._accumulating is None:  # built once: a search simulates many plans of micro-batches
            positions = grad_all_reduce_positions(self.trace)
            if not len(positions):
                self._accumulating = self
                return self
            out = copy.copy(self)
            times = np.asarray(self.times)
            times[positions] = 0.0
            out.times, out.grad_sync = times.tolist(), False
            out.cum_array = np.concatenate([[0.0], np.cumsum(times)])
            out.cum = out.cum_array.tolist()
            out.compute_total = float(times.sum())
            out.lower_bound = out._lower_bound()
            out._accumulating = self._accumulating = out
        return self._accumulating

    def cost(self, kind: CollectiveKind, ranks: int = 0) -> CollectiveCost:
        """What a ``kind`` collective costs on ``ranks`` ranks (``hardware/cost.py``: measured, fitted or modelled).
        ``ranks`` 0: its whole group, the ``shard`` consecutive ranks of the mesh (packed onto nodes), or for an
        all-reduce the ``replicate`` ranks ``shard`` apart."""
        key = (kind, ranks)
        if key not in self._costs:
            n, per_node = ranks or self.shard, None
            if kind is CollectiveKind.ALL_REDUCE:
                n = ranks or self.mesh.replicate
                per_node = replica_ranks_per_node(self.cluster, self.mesh)
            self._costs[key] = collective_cost(self.cluster, kind, n, per_node)
        return self._costs[key]

    def shard_of(self, params: Sequence[int]) -> int:
        """Ranks a group's params are sharded over: the mesh's shard dim, or for an EP view's expert group the
        EP-reduced mesh (``expert_parallel.expert_ranks``; a group holds experts only or none)."""
        if self._experts and params and params[0] in self._experts:
            return expert_ranks(self.cluster, self.shard, self.trace.ep_shard_degree)[0]
        return self.shard

    def group_cost(self, kind: CollectiveKind, ranks: int, params: Sequence[int]) -> CollectiveCost:
        """``cost`` of a collective of a group of ``params``: an expert group's all-gather and reduce-scatter on the
        EP-reduced mesh (its ranks EP apart), the rest as ``cost``."""
        if not self._on_experts(kind, params):
            return self.cost(kind, ranks)
        key = (kind, -1)
        if key not in self._costs:
            self._costs[key] = collective_cost(self.cluster, kind,
                                               *expert_ranks(self.cluster, self.shard, self.trace.ep_shard_degree))
        return self._costs[key]

    def line(self, kind: CollectiveKind, ranks: int, params: Sequence[int], nbytes: int) -> LinkCost:
        """``group_cost(kind, ranks, params).line(nbytes)``, remembered: a search prices the same sizes on the same
        groups plan after plan (choosing the protocol was a tenth of the engine's time)."""
        key = (kind, ranks, self._on_experts(kind, params), nbytes)
        found = self._lines.get(key)
        if found is None:
            found = self._lines[key] = self.group_cost(kind, ranks, params).line(nbytes)
        return found

    def _on_experts(self, kind: CollectiveKind, params: Sequence[int]) -> bool:
        """Whether a collective of a group of ``params`` runs on the EP-reduced mesh (an expert group's all-gather
        or reduce-scatter; a group holds experts only or none)."""
        return kind is not CollectiveKind.ALL_REDUCE and bool(self._experts and params and params[0] in self._experts)

    def comm_time(self, kind: CollectiveKind, nbytes: np.ndarray) -> np.ndarray:
        """Seconds of ``kind`` collectives of each size in ``nbytes`` on the whole group, the fastest protocol
        each (zero bytes: nothing)."""
        return self.cost(kind).seconds_each(nbytes)

    def copy_in_seconds(self, kind: CollectiveKind, nbytes: float | np.ndarray) -> float | np.ndarray:
        """FSDP2's copy-in before a collective of ``nbytes`` (the full size): an all-gather copies this rank's shard
        into its input buffer, a reduce-scatter the unsharded grads into its input (``copy_bandwidth``); an
        all-reduce reads the reduce-scatter's output in place."""
        if kind is CollectiveKind.ALL_GATHER:
            return nbytes / self.shard / self.cluster.overhead.copy_bandwidth
        if kind is CollectiveKind.REDUCE_SCATTER:
            return nbytes / self.cluster.overhead.copy_bandwidth
        return 0.0

    def recompute(self, checkpointed: Sequence[Checkpointed]) -> dict[int, Recompute]:
        """Position -> the checkpointed forward run again there (once per set of modules): where its backward
        first unpacks (``recomputed_at``: its pre-backward, or the last pre-backward before that of a call inside
        it); under op-level checkpointing, its ops that the policy does not keep."""
        key = tuple(checkpointed)
        if key not in self._recompute:
            out: dict[int, Recompute] = {}
            events = self.trace.events
            scale = self.precision.compute_bytes / traced_itemsize(self.trace)
            for c in checkpointed_calls(self.trace, key):
                if c.offload:  # its saved tensors copied out after its forward, back at its pre-backward
                    seconds = offload_bytes(self.trace, c, scale, self.precision.compute_bytes) \
                        / self.cluster.host_copy_bandwidth
                    # each pack and unpack is a copy the host launches: at least one per op that saves a tensor
                    packs = sum(1 for e in events[c.fwd_pre:c.fwd_post]
                                if e.is_op and not e.backward and (e.saved or e.params))
                    # the unpacks run in the call's backward nodes, after FSDP2's pre-backward waited for its group
                    read = frozenset(p for e in events[c.fwd_pre:c.fwd_post] for p in e.params)
                    for at, params in ((c.fwd_post, frozenset()), (c.bwd_pre, read)):
                        prev = out.get(at, Recompute(0.0, frozenset(), [], 0))
                        out[at] = replace(prev, params=prev.params | params, modules=[*prev.modules, c.module],
                                          ops=prev.ops + packs, copy_seconds=prev.copy_seconds + seconds)
                    continue
                # the call's params: FSDP2's pre-backward gathers its group before the recomputation, whatever it runs
                params = {p for e in events[c.fwd_pre:c.fwd_post] for p in e.params}
                kept = [i for i in c.kept if i < c.end]  # up to the early stop (``CheckpointedCall.stop``)
                seconds = self.cum[c.end] - self.cum[c.fwd_pre] - sum(self.times[i] for i in kept)
                ops = int(self.trace.index.ops_through[c.end - 1] - self.trace.index.ops_through[c.fwd_pre]) - len(kept)
                # where backward first unpacks: after the pre-backward of the inner groups that ran after the last
                # pack, whose all-gathers the recomputation then waits for (``recomputed_at``)
                at = c.runs_again_at(self.trace)
                # the host waits again for each op it reads that runs again (one a policy keeps comes from its cache)
                syncs = self._syncs_between(c.fwd_pre, c.end) - sum(1 for i in kept if events[i].syncs)
                prev = out.get(at)
                out[at] = Recompute(seconds, frozenset(params), [c.module], ops, syncs=syncs) if prev is None else \
                    Recompute(prev.seconds + seconds, prev.params | params, [*prev.modules, c.module],
                              prev.ops + ops, prev.copy_seconds, prev.syncs + syncs)
            self._recompute[key] = out
        return self._recompute[key]

    def _syncs_between(self, start: int, end: int) -> int:
        """The host syncs (``Event.syncs``) among events ``start`` to ``end`` - 1."""
        syncs = self.trace.index.host_syncs
        return bisect.bisect_left(syncs, end) - bisect.bisect_left(syncs, start)

    def host_copy_seconds(self, kind: CollectiveKind, params: tuple[int, ...]) -> float:
        """``CPUOffloadPolicy``: the shards of ``params`` copied host-to-device before their all-gather (the params'
        dtype), or the reduce-scatter's output device-to-host after it (the reduce dtype), at the cluster's host
        copy bandwidth; 0 without offload."""
        if not self.options.offload or kind is CollectiveKind.ALL_REDUCE:
            return 0.0
        itemsize = self.precision.param_bytes if kind is CollectiveKind.ALL_GATHER else self.precision.reduce_bytes
        return self.sizing.shard_numel(params) * itemsize / self.cluster.host_copy_bandwidth

    def optimizer_seconds(self) -> float:
        """The optimizer step over this rank's trainable shard (an HSDP replica's, a TP or EP rank's view), after
        the backward's last collective: on the GPU, a memory-bound pass (``optimizer_step.gpu_optimizer_seconds``);
        under ``CPUOffloadPolicy`` on the host instead, at the cluster's CPU optimizer rate."""
        if self._optimizer is None:
            trainable = [i for i, p in enumerate(self.trace.params) if p.requires_grad]
            numel = self.sizing.shard_numel(trainable)
            self._optimizer = numel / self.cluster.cpu_optimizer_rate if self.options.offload else \
                gpu_optimizer_seconds(numel, self.options.optimizer.step_bytes, self.precision.param_bytes,
                                      self.cluster)
        return self._optimizer

    def _lower_bound(self) -> float:
        """No plan on this mesh beats this: all compute; or every param gathered once and every grad reduced once
        (and all-reduced once across replicas), each in one message, their bytes sharing the links; then the
        optimizer step, which waits for all of them."""
        everything = range(len(self.trace.params))
        trainable = tuple(i for i in everything if self.trace.params[i].requires_grad)
        messages = [(CollectiveKind.ALL_GATHER, self.sizing.gather_bytes(everything)),
                    (CollectiveKind.REDUCE_SCATTER, self.sizing.reduce_bytes(trainable))]
        if self.mesh.replicate > 1:
            messages.append((CollectiveKind.ALL_REDUCE, self.sizing.reduce_bytes(trainable) // self.shard))
        times = [float(self.comm_time(kind, np.array([nbytes]))[0]) for kind, nbytes in messages if nbytes]
        by_link: dict[str, float] = {}
        for kind, nbytes in messages:  # the bytes at the best bandwidth any protocol reaches
            cost = self.cost(kind)
            by_link[cost.link] = by_link.get(cost.link, 0.0) + nbytes * cost.per_byte
        return max(self.compute_total, *times, *by_link.values()) + self.optimizer_seconds()


def replica_ranks_per_node(cluster: Cluster, mesh: Mesh) -> int:
    """Ranks of one HSDP replica group on a node: its members are ``shard`` ranks apart, spread over the nodes of
    ``gpus_per_node`` consecutive ranks they fall in (the most on one node where a shard does not divide a node:
    Accelerate's 3 x 4 on two 6-GPU nodes puts ranks 0, 4 and 8 on two nodes, which ``gpus_per_node // shard``
    ranks a node took for three)."""
    nodes = len({r * mesh.shard // cluster.gpus_per_node for r in range(mesh.replicate)})
    return -(-mesh.replicate // nodes)


def collective_bytes(ctx: SimContext, c: Collective, gather: list[int]) -> int:
    """Bytes as nccl-tests counts them: an all-gather's output, a reduce-scatter's input (both padded, the
    full unsharded size), an all-reduce's buffer (the reduce-scatter's output, one shard)."""
    if c.kind is CollectiveKind.ALL_GATHER:
        return gather[c.group]
    reduced = ctx.sizing.reduce_bytes(c.params)
    return reduced if c.kind is CollectiveKind.REDUCE_SCATTER else reduced // ctx.shard_of(c.params)
