"""Replay FSDP2's hooks over a trace: when each group all-gathers, reshards and reduce-scatters.

``GroupReplay`` mirrors ``FSDPParamGroup`` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, 2.13)
together with the per-module part of ``FSDPState`` (_fsdp_state.py): its methods are FSDP2's lifecycle,
``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``, ``finalize_backward``, over the same
``TrainingState`` and ``ShardedState``. ``Replay`` plays the hooks' caller: it walks the trace's boundary events
of the modules that have FSDP hooks and calls the group that owns them, then runs the root's final callback. Where
backward first unpacks a tensor a call checkpointed in full saved, it replays the hooks of the groups inside that
call in its recomputation (``Replay._recompute``).

The output is events, not sizes or times: ``Collective`` (which group, at which trace event, why) and
``Residency`` (when a group is unsharded). Sizing is the cost layer's (``sim/sizing.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import NamedTuple

from fsdp_planner.fsdp2.checkpointing import recomputed_spans
from fsdp_planner.fsdp2.claim import hooked_in
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.expert_groups import param_group_hosts
from fsdp_planner.fsdp2.plan import Group, Mesh, Plan, ReshardAfterForward
from fsdp_planner.trace.chunked_loss import output_layer
from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT

Call = tuple[str, int]


class TrainingState(Enum):
    """FSDP2's ``TrainingState`` (_fsdp_common.py)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedState(Enum):
    """FSDP2's ``ShardedState`` (_fsdp_param.py): what each rank holds of the group's params."""

    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()  # reshard_after_forward=int: a shard over a sub-group until backward
    UNSHARDED = auto()


@dataclass(frozen=True)
class Collective:
    kind: CollectiveKind
    group: int
    event: int  # trace event at whose boundary it is issued (len(events): the final callback)
    backward: bool
    prefetch: bool = False  # issued ahead by a prefetch, not by the group's own hook
    ranks: int = 0  # 0: the group's full shard mesh (all-reduce: the replicas); k: the post-forward sub-group
    params: tuple[int, ...] = ()  # reduce-scatter, all-reduce: the params whose grads it carries (Trace.params)
    output_freed: int = -1  # all-gather: the position (exclusive) where FSDP2 frees its output buffer: just after
    # its copy-out in the group's own pre-backward; in forward, when the next group's copy-out starts or at the
    # root's post-forward (FSDPParamGroup.wait_for_unshard keeps it in all_gather_state to overlap the copy-out
    # with the next all-gather)

    def freed_at(self, end: int) -> Collective:
        """This all-gather with its output freed at ``end`` (``dataclasses.replace`` spelled out: a replay frees
        two outputs a group, and the generic replace was a tenth of it)."""
        return Collective(self.kind, self.group, self.event, self.backward, self.prefetch, self.ranks, self.params,
                          end)


@dataclass(frozen=True)
class Residency:
    """Group ``group`` holds ``1/divisor`` of its unsharded params on each rank over events [start, end)."""

    group: int
    start: int
    end: int
    divisor: int = 1


class ChunkedGrads(NamedTuple):
    """A chunked loss's output layer (``Replay._chunked_loop``): the chunks' first event, the layer's backward's
    first and last, its params, whose unsharded grads are kept through the chunks (``sim/memory.py``), and whether
    a group hooks the layer (its FSDP2 state syncs them at the last chunk only) or not (autograd accumulates)."""

    start: int
    backward: int
    end: int
    params: tuple[int, ...]
    own: bool
    weight_grad: int  # the output layer's backward op making its weight's grad (``OutputLayer.weight_grad``)


@dataclass
class Schedule:
    collectives: list[Collective] = field(default_factory=list)
    residency: list[Residency] = field(default_factory=list)
    num_events: int = 0
    hooks: list[tuple[int, int]] = field(default_factory=list)  # (event, group): a lifecycle call's host work
    # groups that are not the last param group of their state: their post-backward frees no earlier reduce-scatter
    # input (FSDPParamGroup.post_backward's wait on the retained ones is the last param group's)
    keeps_reduce_inputs: frozenset[int] = frozenset()
    # the groups in the order the root's final callback visits them (FSDP2's all_states: named_modules order of
    # each call's first module, the root first; a call's param groups the last first)
    final_order: tuple[int, ...] = ()
    chunked: ChunkedGrads | None = None  # a chunked loss's output layer
    # some group's post-backward ran before autograd finished every grad of its params (a module called again,
    # whose grads come after its last call's backward): after micro-batches that accumulated grads without syncing,
    # that post-backward reduces the accumulated grads on its own (``build_schedule(accumulated=True)``)
    early_post_backward: bool = False


@dataclass
class _Shared:
    """State FSDP2 keeps across groups (``FSDPCommContext`` and the root's state context)."""

    schedule: Schedule
    post_forward_order: list[GroupReplay] = field(default_factory=list)
    reduced: set[int] = field(default_factory=set)  # params whose grads were reduce-scattered this step
    pre_backward_at: dict[Call, list[GroupReplay]] = field(default_factory=dict)  # output grads -> pre_backward
    post_backward_at: dict[Call, list[GroupReplay]] = field(default_factory=dict)  # input grads -> post_backward
    # (each param group of the call's state registers its own, so backward runs the last registered first)
    all_gather_state: int | None = None  # FSDPCommContext.all_gather_state: a forward all-gather kept alive
    forward_root: GroupReplay | None = None  # FSDPStateContext.iter_forward_root, as a recomputation sets it
    # a recomputation's forward root has run its post-forward, which frees ``all_gather_state``: the replay frees
    # it as its recomputation ends (``Replay._recompute``)
    root_done: bool = False
    reshard_after_backward: bool = True  # FSDPParamGroup.reshard_after_backward (``set_reshard_after_backward``)
    accumulated: bool = False  # the groups' grads hold earlier micro-batches' (``set_requires_gradient_sync(False)``)

    def free_output(self, collective: int, end: int) -> None:
        self.schedule.collectives[collective] = self.schedule.collectives[collective].freed_at(end)

    def free_all_gather_state(self, at: int) -> None:
        if self.all_gather_state is not None:
            self.free_output(self.all_gather_state, at)
            self.all_gather_state = None
        self.root_done = False


class Kept(Enum):
    """A micro-batch of gradient accumulation under ``set_reshard_after_backward(False)`` on all but the last:
    whether the groups start it unsharded (kept from the previous micro-batch's backward: their first forward
    all-gather is skipped) and whether they stay unsharded after its backward."""

    NONE = (False, False)  # a step of its own, or any micro-batch with reshard_after_backward True
    FIRST = (False, True)
    MIDDLE = (True, True)
    LAST = (True, False)

    @property
    def before(self) -> bool:
        return self.value[0]

    @property
    def after(self) -> bool:
        return self.value[1]


class GroupReplay:
    """One ``fully_shard`` group through one training step (FSDPParamGroup + its FSDPState's module hooks). A state
    with several param groups (experts on a per-param mesh: ``expert_groups.param_group_hosts``) is driven through
    the group whose modules are hooked; ``members`` are its param groups in FSDP2's order, the others hooking no
    module of their own."""

    def __init__(self, index: int, group: Group, grad_params: list[int], grad_ready_at: list[int],
                 mesh: Mesh | None, shared: _Shared, hooked: Sequence[str]) -> None:
        self.index, self.group, self.shared = index, group, shared
        self.hooked = hooked  # the listed modules FSDP2 hooks (``hooked_modules``)
        self.has_params = bool(group.params)
        self.grad_params = grad_params  # params with a grad to reduce (trainable and read in forward)
        self.grad_ready_at = grad_ready_at
        self.reshard_after_forward = _resolve_reshard(group.reshard_after_forward, mesh and mesh.shard)
        self.replicated = mesh is not None and mesh.replicate > 1  # HSDP: reduced grads are all-reduced
        self.forward_prefetch: list[GroupReplay] = []
        self.backward_prefetch: list[GroupReplay] = []
        self.training_state = TrainingState.IDLE
        self.state_in_backward = False  # FSDPState._training_state is PRE_BACKWARD: set once backward reaches it
        self.sharded_state = ShardedState.SHARDED
        self.since = -1  # event from which the current (un)sharded-post-forward state holds
        self.gathered = False  # all-gathered at least once this step, so its params can have grads
        self.pending: int | None = None  # FSDP2's _all_gather_result: the issued all-gather not yet copied out
        self.modules_to_run: set[str] = set()  # FSDPState._modules_to_run_forward
        self.post_forward_indices: list[int] = []
        self._members: list[GroupReplay] | None = None  # a state's param groups where it has several
        self._state: GroupReplay | None = None  # the group whose hooks drive this one, where another's
        self.kept_after_backward = False  # its own set_reshard_after_backward(False): a chunked loss's output layer
        self.accumulated = shared.accumulated  # grads of earlier micro-batches not reduced yet (FSDPParam's
        # unsharded_accumulated_grad, or its grad where no reduce dtype upcasts it)
        self.chunked: frozenset[int] = frozenset()  # the output layer's params while a chunked loss's chunks run

    @property
    def members(self) -> Sequence[GroupReplay]:
        """FSDPState._fsdp_param_groups, on the group whose modules are hooked (just itself, mostly)."""
        return self._members or (self,)

    @property
    def param_groups(self) -> list[GroupReplay]:
        """Its state's members that are param groups in FSDP2 (a call claiming no params of its own makes none)."""
        return [m for m in self.state.members if m.has_params]

    @property
    def state(self) -> GroupReplay:
        """The group whose hooks drive this one: its state's (itself, mostly)."""
        return self._state or self

    # -- FSDPParamGroup.unshard / reshard -----------------------------------------------------------------
    def unshard(self, at: int, backward: bool, prefetch: bool = False) -> None:
        """Issue the all-gather; its output buffer lives until ``wait_for_unshard`` copies it out."""
        if self.sharded_state is ShardedState.UNSHARDED or self.pending is not None or not self.has_params:
            return  # no-op when already unsharded or already issued (e.g. prefetched)
        ranks = 0
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            ranks = int(self.reshard_after_forward)  # gather from the sub-group's shard
        collectives = self.shared.schedule.collectives
        self.pending = len(collectives)
        collectives.append(Collective(CollectiveKind.ALL_GATHER, self.index, at, backward, prefetch, ranks))
        self.gathered = True

    def wait_for_unshard(self, at: int) -> None:
        """Copy-out: the unsharded params are allocated here (not when a prefetch issued the all-gather), the
        all-gather output and a post-forward shard are freed."""
        if self.pending is None:
            return
        forward = self.training_state is TrainingState.FORWARD
        if forward:
            self.shared.free_all_gather_state(at)  # the previous forward all-gather's output, before this copy-out
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            self._hold_until(at, divisor=int(self.reshard_after_forward))
        if forward:
            self.shared.all_gather_state = self.pending  # kept until the next copy-out or the root's post-forward
        else:
            self.shared.free_output(self.pending, at + 1)
        self.sharded_state, self.since, self.pending = ShardedState.UNSHARDED, at, None

    def reshard(self, at: int) -> None:
        if self.sharded_state is not ShardedState.UNSHARDED:
            return
        if self.training_state is TrainingState.FORWARD:
            if self.reshard_after_forward is False:
                return  # kept unsharded until backward
            if self.reshard_after_forward is not True:  # _to_sharded_post_forward: keep a sub-group shard
                self._hold_until(at)
                self.sharded_state, self.since = ShardedState.SHARDED_POST_FORWARD, at
                return
        self._hold_until(at)
        self.sharded_state = ShardedState.SHARDED

    def _host_work(self, at: int) -> None:
        """One lifecycle call doing its work on the host (``Schedule.hooks``): once per group and pass however many
        modules the group lists (FSDP2's per-module hooks of a list group return at once but for one), and only
        for a group that manages params (a state without a param group does next to nothing)."""
        if self.has_params:
            self.shared.schedule.hooks.append((at, self.index))

    def _hold_until(self, at: int, divisor: int = 1) -> None:
        self.shared.schedule.residency.append(Residency(self.index, self.since, at, divisor))

    # -- the lifecycle ------------------------------------------------------------------------------------
    def pre_forward(self, at: int, call: Call, grad_inputs: bool, gated: bool = True,
                    recomputing: bool = False) -> None:
        """FSDPState._pre_forward + FSDPParamGroup.pre_forward: runs for every listed module; the post-backward
        hook and forward prefetch only for the first module of the pass. ``gated``: through the group's forward
        hook, which resets the modules still to run (not a registered method's wrapper). A call in backward (the
        recomputation of the user's own ``torch.utils.checkpoint``) after its state's pre-backward only unshards.
        ``recomputing``: a group inside a checkpointed call whose forward runs again in backward before the
        group's own pre-backward: its state is idle, so it runs its forward path, all-gathering again if it
        resharded after forward (kept as the all-gather state, as in forward), its state the recomputation's
        forward root if none is; the post-backward hook it registers is on the recomputed graph, never run."""
        if self.state_in_backward:
            for member in self.members:
                member.unshard(at, backward=True)
                member.wait_for_unshard(at)
            return
        if gated and not self.modules_to_run:
            self.modules_to_run = set(self.hooked)
        first_in_pass = self.training_state is not TrainingState.FORWARD
        if first_in_pass and recomputing and self.shared.forward_root is None:  # _root_pre_forward claims it
            self.shared.forward_root = self
        for member in self.members:  # each param group gathers and waits in turn (FSDPParamGroup.pre_forward)
            member.param_group_pre_forward(at, call, first_in_pass, grad_inputs and not recomputing, recomputing)
        if first_in_pass:
            for target in self.forward_prefetch:
                target.unshard(at, backward=recomputing, prefetch=True)

    def param_group_pre_forward(self, at: int, call: Call, first_in_pass: bool, grad_inputs: bool,
                                recomputing: bool) -> None:
        """FSDPParamGroup.pre_forward: unshard and wait; on entering the pass, the post-backward hook on this call's
        inputs (RegisterPostBackwardFunction)."""
        if first_in_pass:
            self._host_work(at)
        self.training_state = TrainingState.FORWARD
        self.unshard(at, backward=recomputing)
        self.wait_for_unshard(at)
        if first_in_pass and grad_inputs:
            self.shared.post_backward_at.setdefault(call, []).append(self)

    def post_forward(self, at: int, call: Call) -> None:
        """FSDPParamGroup.post_forward once every listed module has run (a list group reshards after its last
        module), then FSDPState._register_pre_backward_hook on the completing call's outputs."""
        module = call[0]
        if self.state_in_backward or module not in self.modules_to_run:  # a recomputation: post-backward reshards
            return
        self.modules_to_run.discard(module)
        if not self.modules_to_run:
            self.complete_forward(at, call)

    def post_recomputed_forward(self, at: int, module: str) -> None:
        """FSDPState._post_forward in a recomputation (in backward, ``is_bw()``): once every listed module has
        run, nothing resharded or recorded, the state idle, and the recomputation's forward root frees the kept
        all-gather output (as the recomputation ends, ``Replay._recompute``; a group whose call the early stop cut
        short stays as it is until its pre-backward)."""
        if self.state_in_backward or module not in self.modules_to_run:
            return
        self.modules_to_run.discard(module)
        if self.modules_to_run:
            return
        for member in self.members:
            member._host_work(at)
            member.training_state = TrainingState.IDLE
        if self.shared.forward_root is self:
            self.shared.root_done, self.shared.forward_root = True, None

    def complete_forward(self, at: int, call: Call) -> None:
        for member in self.members:  # FSDPParamGroup.post_forward of each param group
            member._host_work(at)
            member.reshard(at)
            if member.has_params:  # _record_post_forward: a fully_shard call that claimed nothing has none
                member.post_forward_indices.append(len(self.shared.post_forward_order))
                self.shared.post_forward_order.append(member)
            member.training_state = TrainingState.IDLE
        self.shared.pre_backward_at.setdefault(call, []).append(self)

    def pre_backward(self, at: int) -> None:
        """FSDPState._pre_backward: once per state, each param group's pre-backward in turn, then the explicit
        prefetch list."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        for member in self.members:
            member.param_group_pre_backward(at, default_prefetch=not self.backward_prefetch)
        for target in self.backward_prefetch:
            target.unshard(at, backward=True, prefetch=True)

    def param_group_pre_backward(self, at: int, default_prefetch: bool) -> None:
        """FSDPParamGroup.pre_backward: unshard and wait, then by default prefetch (_backward_prefetch) the param
        group that finished forward just before this call of it; of a state with several, only its second param
        group prefetches, every param group of the state before it (the others' forward order given back)."""
        self._host_work(at)
        self.training_state = TrainingState.PRE_BACKWARD
        self.state_in_backward = True
        self.unshard(at, backward=True)
        self.wait_for_unshard(at)
        if not default_prefetch or not self.post_forward_indices:
            return
        current = self.post_forward_indices.pop()
        order = self.shared.post_forward_order
        groups = self.param_groups
        if len(groups) == 1:
            if current > 0:
                order[current - 1].unshard(at, backward=True, prefetch=True)
            return
        if self is not groups[1]:
            return
        target: GroupReplay | None = None
        for before in reversed(order[:current]):
            if before.state is self.state:
                continue
            if target is None:
                target = before.state
            elif before.state is not target:
                break
            before.unshard(at, backward=True, prefetch=True)

    def post_backward(self, at: int) -> None:
        """FSDPParamGroup.post_backward: reshard, then reduce-scatter the grads autograd has finished (a param read
        by several module calls has its grad only after the backward of the last of them); with HSDP,
        ``foreach_reduce`` all-reduces the reduce-scatter's output across the replicas."""
        self.training_state = TrainingState.POST_BACKWARD
        if not self.has_params:
            return
        self._host_work(at)
        if self.shared.reshard_after_backward and not self.kept_after_backward:  # set_reshard_after_backward(False):
            # kept for the next micro-batch, or the next chunk of a chunked loss
            self.reshard(at)
        if not self.gathered:
            return
        reduced, ready_at = self.shared.reduced, self.grad_ready_at
        # the output layer's params after a chunked loss's last chunk: their grads whole so far, reduced then and
        # again where the model's backward reads one again (a tied embedding's weight)
        unreduced = [p for p in self.grad_params if p not in reduced]
        ready = tuple(p for p in unreduced if ready_at[p] <= at or p in self.chunked)
        if len(ready) < len(unreduced):
            self.shared.schedule.early_post_backward = True
        if self.accumulated:  # FSDP2 reduces every param holding an earlier micro-batch's grad at the first
            # post-backward, this one's ready grads added in; one not ready yet is reduced again when it is (a reused
            # block: 4 reduce-scatters a step for 3 measured, a trial's model with 2 micro-batches)
            self.accumulated = False
            ready = tuple(unreduced)
        if ready:
            reduced.update(p for p in ready if ready_at[p] <= at)
            self.shared.schedule.collectives.append(
                Collective(CollectiveKind.REDUCE_SCATTER, self.index, at, True, params=ready))
            if self.replicated:
                self.shared.schedule.collectives.append(
                    Collective(CollectiveKind.ALL_REDUCE, self.index, at, True, params=ready))

    def finalize_backward(self, end: int) -> None:
        """The root's final callback: post_backward for groups autograd never reached (inputs without grad),
        then the end of the step for whatever is still held."""
        if self.training_state is not TrainingState.POST_BACKWARD and self.has_params:
            self.post_backward(end)  # the root's final callback runs it
        self.training_state = TrainingState.IDLE
        if self.pending is not None:  # prefetched but never used: its output is freed at the end
            self.shared.free_output(self.pending, end)
            self.pending = None
        if self.sharded_state is ShardedState.UNSHARDED:
            # kept for the next micro-batch (set_reshard_after_backward(False)): still held through the final
            # callback, where a root's own reduce-scatter runs
            self._hold_until(end if self.shared.reshard_after_backward else end + 1)
        elif self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            self._hold_until(end, divisor=int(self.reshard_after_forward))


class ChunkedLoop(NamedTuple):
    """Where a chunked loss runs (``trace/chunked_loss.py``): the group hooking the output layer (None where none
    does: its params are another call's group's, the root's), the chunks' span and the layer's params (``grads``),
    the root's post-forward (run at the start: the model's forward skips the output layer) and the root's
    pre-backward (run at the end: the model's backward starts from the hidden states' gradient)."""

    group: GroupReplay | None
    grads: ChunkedGrads
    root_post: int
    root_pre: int | None


def _resolve_reshard(value: ReshardAfterForward, shard_size: int | None) -> ReshardAfterForward:
    """FSDP2's reading of an int: 1 keeps everything (False), the shard size or more reshards fully (True)."""
    if isinstance(value, bool):
        return value
    if shard_size is not None and value >= shard_size:
        return True
    return False if value == 1 else value


class Replay:
    """Drives the groups' hooks over the trace's boundary events, as autograd and ``nn.Module`` would."""

    def __init__(self, trace: Trace, plan: Plan, world_size: int | None = None,
                 group_params: Sequence[Sequence[int]] | None = None, kept: Kept = Kept.NONE,
                 accumulated: bool = False) -> None:
        self.trace, self.plan = trace, plan
        index = trace.index
        self.shared = _Shared(Schedule(num_events=len(trace.events)), reshard_after_backward=not kept.after,
                              accumulated=accumulated)
        if group_params is None:
            group_params = [[index.param_index[p] for p in g.params] for g in plan.groups]
        reducible = index.reducible
        mesh = plan.mesh or (Mesh.flat(world_size) if world_size is not None else None)
        hosts = param_group_hosts(plan, trace)
        self.groups = [GroupReplay(i, g, [p for p in ps if reducible[p]], index.grad_ready_at, mesh, self.shared,
                                   [] if i in hosts else hooked_in(trace, g.modules))
                       for i, (g, ps) in enumerate(zip(plan.groups, group_params, strict=True))]
        self._join_states(hosts, group_params)
        for g, replay in zip(plan.groups, self.groups, strict=True):
            if kept.before and replay.has_params:  # unsharded since the previous micro-batch's backward
                replay.sharded_state, replay.since, replay.gathered = ShardedState.UNSHARDED, 0, True
            # a prefetch gathers every param group of the target's state (in backward, the last first)
            replay.forward_prefetch = [m for j in g.forward_prefetch for m in self.groups[j].state.members]
            replay.backward_prefetch = [m for j in g.backward_prefetch for m in reversed(self.groups[j].state.members)]
        self.group_of = {m: r for r in self.groups for m in r.hooked}
        # FSDP2's all_states: one per fully_shard call, in the registration order of its first module
        registered = trace.index.registration
        self.states = sorted((r for r in self.groups if r.state is r),
                             key=lambda r: min(registered[m] for m in r.group.modules))
        self.shared.schedule.final_order = tuple(m.index for state in self.states for m in reversed(state.members))
        methods = set(plan.forward_methods)
        # calls of registered methods: register_fsdp_forward_method's wrapper calls FSDPState._pre_forward and
        # _post_forward itself, past a list group's gate (_register_group_forward_hooks' modules_to_run)
        self.method_calls = {call for call, name in trace.method_calls.items() if (call[0], name) in methods}
        self.recomputed = recomputed_spans(trace, plan)  # where a checkpointed forward runs again -> its span
        self.hooked: list[int] = []

    def _join_states(self, hosts: dict[int, int], group_params: Sequence[Sequence[int]]) -> None:
        """Each group sharded in another's call (``param_group_hosts``) made a param group of that call's state,
        in FSDP2's order (by their first param); the param groups before a state's last keep the reduce-scatter
        inputs (``Schedule.keeps_reduce_inputs``)."""
        never = len(self.trace.params)
        for member, host in hosts.items():
            state = self.groups[host]
            state._members = sorted([*state.members, self.groups[member]],
                                    key=lambda r: min(group_params[r.index], default=never))
            self.groups[member]._state = state
        self.shared.schedule.keeps_reduce_inputs = frozenset(
            r.index for host in set(hosts.values()) for r in self.groups[host].param_groups[:-1])

    def hooked_events(self) -> list[int]:
        """Boundary events of the modules FSDP2 hooks (``hooked_modules`` of each group), in order; a call of a
        non-forward method (``Trace.method_calls``) only when the plan registers it
        (``register_fsdp_forward_method``)."""
        by_module = self.trace.index.boundaries_by_module
        hooked = sorted(i for m in self.group_of for i in by_module.get(m, ()))
        unregistered = set(self.trace.method_calls) - self.method_calls
        if unregistered:  # a non-forward method runs inside its module's hooks only once registered
            events = self.trace.events
            hooked = [i for i in hooked if (events[i].module, events[i].call) not in unregistered]
        return hooked

    def run(self) -> Schedule:
        events, shared = self.trace.events, self.shared
        self.hooked = self.hooked_events()
        loop = self._chunked_loop()
        moved = {loop.root_post, loop.root_pre} if loop is not None else set()
        # the chunks' span is visited where no group hooks the output layer too (the root's hooks move to it)
        span = {loop.grads.start, loop.grads.end} - {*self.hooked, *self.recomputed} if loop is not None else set()
        for at in sorted({*self.hooked, *self.recomputed, *span}):  # a checkpointed module need not be a group's
            if at in moved:
                continue
            if loop is not None and at == loop.grads.start:
                self._chunks_begin(at, loop)
            if at not in span:
                self._event(at, events[at])
            if loop is not None and at == loop.grads.end:
                self._chunk_callbacks(at, loop)
                self._chunks_end(at + 1, loop)  # (after the last chunk's post-backward, before the model's backward)
        end = len(events)
        shared.free_all_gather_state(end)  # a root that is not a group: nothing freed it at post-forward
        for k in shared.schedule.final_order:  # the root's final callback: FSDP2's all_states, the last first
            self.groups[k].finalize_backward(end)
        self._unlink()
        return shared.schedule

    def _event(self, at: int, e: Event) -> None:
        """The hooks event ``e`` runs, at position ``at`` (its own, or where a chunked loss moves it)."""
        shared = self.shared
        call = (e.module, e.call)
        if e.kind is EventKind.FWD_PRE:
            self.group_of[e.module].pre_forward(at, call, e.grad_inputs, gated=call not in self.method_calls)
        elif e.kind is EventKind.FWD_POST:
            if call in self.method_calls:
                self.group_of[e.module].complete_forward(at, call)
            else:
                self.group_of[e.module].post_forward(at, call)
            if e.module == ROOT:
                self._force_complete_forward(at, call)
                shared.free_all_gather_state(at)
        elif e.kind is EventKind.BWD_PRE:
            for group in shared.pre_backward_at.get(call, ()):
                group.pre_backward(at)
            if at in self.recomputed:
                self._recompute(at, *self.recomputed[at])
        elif call in shared.post_backward_at:  # BWD_POST: the inputs' grads are ready
            for group in reversed(shared.post_backward_at.pop(call)):
                group.post_backward(at)

    def _chunked_loop(self) -> ChunkedLoop | None:
        """Where the output layer's chunks run, for a trace whose loss runs in chunks (``Trace.loss_chunks``) and
        whose output layer a group hooks; None otherwise (the hooks in trace order)."""
        if not self.trace.loss_chunks:
            return None
        head = output_layer(self.trace)
        if head is None:
            return None
        events, hooked = self.trace.events, set(self.hooked)
        root_post = next((i for i in range(head.forward.stop, len(events)) if i in hooked
                          and events[i].kind is EventKind.FWD_POST and events[i].module == ROOT), None)
        # (the root's output is the hidden states: its pre-backward runs once the chunks are done, wherever the
        # whole step's ran, before or inside the output layer's backward)
        root_pre = next((i for i in range(head.forward.stop, head.backward.stop) if i in hooked
                         and events[i].kind is EventKind.BWD_PRE and events[i].module == ROOT), None)
        own = head.module in self.group_of and root_post is not None
        grads = ChunkedGrads(head.forward.start, head.backward.start, head.backward.stop - 1, head.params, own,
                             head.weight_grad)
        self.shared.schedule.chunked = grads
        if root_post is None:
            return None
        if not own:  # the layer's params in a group hooking another module (the root's): the root's hooks move
            return ChunkedLoop(None, grads, root_post, root_pre)
        for member in self.group_of[head.module].members:  # as the wrapper left it after the step before
            member.reshard_after_forward = True
        return ChunkedLoop(self.group_of[head.module], grads, root_post, root_pre)

    def _chunks_begin(self, at: int, loop: ChunkedLoop) -> None:
        """The model's forward ends without the output layer (the root's post-forward runs here); then
        ``ChunkedLossWrapper``'s calls on it: kept unsharded through the chunks (gathered now if it was
        resharded), its grads synced at the last chunk only."""
        self._event(at, self.trace.events[loop.root_post])
        if loop.group is None:
            return
        for member in loop.group.members:
            member.unshard(at, backward=False)
            member.wait_for_unshard(at)
            member.reshard_after_forward, member.kept_after_backward = False, True
            member.chunked = frozenset(loop.grads.params)

    def _chunk_callbacks(self, at: int, loop: ChunkedLoop) -> None:
        """Where the output layer's state ran its pre-backward in the chunks (its group completes its forward in
        the output layer's call: it lists that alone), that hook queued FSDP2's root final callback, which runs
        after each chunk's backward: the explicit backward prefetches again each chunk and discarded each time, and
        every group the model's forward left unsharded resharded, its post-forward order forgotten (so the model's
        backward prefetches none by default) (``FSDPState._root_post_backward_final_callback``, torch 2.13)."""
        if loop.group is None:  # (no hook of the layer's own: nothing runs in the chunks' backward)
            return
        state = loop.group.state
        if not state.state_in_backward:
            return
        self._final_callback(at)
        for _ in range(self.trace.loss_chunks - 1):
            for target in state.backward_prefetch:
                target.unshard(at, backward=True, prefetch=True)
            self._final_callback(at)

    def _final_callback(self, at: int) -> None:
        """The root's final callback of one backward pass that is not the step's last one (a chunk's): the
        post-backward of each param group that has not run one, then every group idle, its all-gathers issued and
        not waited for dropped, and the post-forward order cleared."""
        shared = self.shared
        for state in self.states:
            for member in reversed(state.members):
                # (the output layer's group ran its own post-backward in each chunk, which the replay's one pass
                # of the layer's backward stands for)
                if member.training_state is not TrainingState.POST_BACKWARD and not member.chunked:
                    member.post_backward(at)
                member.training_state, member.state_in_backward = TrainingState.IDLE, False
                member.modules_to_run.clear()
                member.post_forward_indices.clear()
                if member.pending is not None:
                    shared.free_output(member.pending, at + 1)
                    member.pending = None
        shared.post_forward_order.clear()

    def _chunks_end(self, at: int, loop: ChunkedLoop) -> None:
        """After the last chunk: the wrapper resets the output layer's state to reshard after forward and after
        backward (its every later step reshards the group after forward, whatever the plan set) and reshards it;
        then the model's backward starts from the hidden states' gradient (the root's pre-backward, moved here)."""
        for member in loop.group.members if loop.group is not None else ():
            member.reshard_after_forward, member.kept_after_backward, member.chunked = True, False, frozenset()
            member.reshard(at)
        if loop.root_pre is not None:
            self._event(at, self.trace.events[loop.root_pre])

    def _unlink(self) -> None:
        """Break the references between the groups and their shared state (and between groups that prefetch each
        other), as a finished step has no more use for them: the replay is then freed by reference counting, not
        left with its schedule to Python's cycle collector. A search replays thousands of plans: their cycles were
        1.2 million objects a search of Mixtral on 64 GPUs, and 12% of its CPU time in the collector."""
        for group in self.groups:
            group.forward_prefetch, group.backward_prefetch = [], []
            group._members = group._state = None
        self.shared.post_forward_order.clear()
        self.shared.pre_backward_at.clear()
        self.shared.post_backward_at.clear()
        self.shared.forward_root = None

    def _recompute(self, at: int, start: int, stop: int) -> None:
        """A checkpointed call's forward run again at its pre-backward ``at``, the events [start, stop) of it: the
        hooks of the groups inside it, all at ``at``. The early stop raises out of the calls still running; of
        those, list groups' post-forward hooks run all the same (FSDP2 registers them ``always_call``)."""
        events = self.trace.events
        running: list[str] = []
        for i in self.hooked[bisect_left(self.hooked, start):bisect_left(self.hooked, stop)]:
            e = events[i]
            call = (e.module, e.call)
            if e.kind is EventKind.FWD_PRE:
                self.group_of[e.module].pre_forward(at, call, False, gated=call not in self.method_calls,
                                                    recomputing=True)
                running.append(e.module)
            elif e.kind is EventKind.FWD_POST:
                self.group_of[e.module].post_recomputed_forward(at, e.module)
                running.remove(e.module)
        for module in reversed(running):
            if len(self.group_of[module].group.modules) > 1:
                self.group_of[module].post_recomputed_forward(at, module)
        # The recomputation runs at ``at``: its forward root's post-forward frees the kept all-gather output after
        # the group's forward, so that output is alive there beside the group's unsharded params and the activations
        # re-created (the next group's copy-out frees an earlier one at ``at``: one at a time). Freed at ``at``, it
        # was counted nowhere: EP 4 x full AC on 32 fake ranks, the experts' all-gather output held through their
        # recomputed forward, -6.5% -> -4.2%.
        if self.shared.root_done:
            self.shared.free_all_gather_state(at + 1)

    def _force_complete_forward(self, at: int, call: Call) -> None:
        """FSDPState._force_complete_incomplete_states: at the root's post-forward, list groups whose modules
        did not all run complete their forward (their pre-backward hook goes on the root's output), visited in
        reverse order of FSDP2's all_states."""
        for group in reversed(self.states):
            if not group.group.is_root and group.modules_to_run:
                group.modules_to_run.clear()
                group.complete_forward(at, (ROOT, call[1]))


def build_schedule(trace: Trace, plan: Plan, world_size: int | None = None,
                   group_params: Sequence[Sequence[int]] | None = None, kept: Kept = Kept.NONE,
                   accumulated: bool = False) -> Schedule:
    """Replay FSDP2 over ``trace`` with ``plan``'s groups (``group_params``: their params' indices, if known) on
    ``world_size`` ranks laid out as the plan's mesh says (None: any world, ``reshard_after_forward`` ints as
    given); ``kept``: a micro-batch under ``set_reshard_after_backward(False)``; ``accumulated``: the micro-batch
    that syncs after others accumulated grads without syncing (it differs only where a schedule without it has an
    ``early_post_backward``)."""
    return Replay(trace, plan, world_size, group_params, kept, accumulated).run()


def state_hook_calls(trace: Trace, plan: Plan) -> list[int]:
    """The forward-call events of modules ``fully_shard`` was applied to (every module of every group that it
    hooks, ``hooked_modules``, the root too). Each such call runs its ``FSDPState``'s hooks (pre/post-forward, and
    in backward pre/post-backward) whether or not its group has work there: a list group of k modules pays k of
    these a pass, single-module groups one each (``Overhead.module_seconds``)."""
    hosts = param_group_hosts(plan, trace)  # (experts in their block's call: no hooks of their own)
    targets = {m for i, g in enumerate(plan.groups) if i not in hosts
               for m in hooked_in(trace, g.modules)}
    return [i for i, e in enumerate(trace.events) if e.kind is EventKind.FWD_PRE and e.module in targets]
