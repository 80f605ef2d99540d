"""Views of a trace that planners and the FSDP2 replay ask for again and again, each computed once.

Everything here depends on the trace only (not on a plan or a cluster), so one index serves every plan
simulated for a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.infos import ModuleInfo, ParamInfo
from fsdp_planner.trace.tree import ROOT, is_within, outermost, parent_of, proper_ancestors

Call = tuple[str, int]  # (module, call number)
CONTAINERS = frozenset({"ModuleList", "Sequential", "ModuleDict"})
NO_FORWARD = frozenset({"ModuleList", "ModuleDict"})  # containers nn.Module gives no forward
PEER_SHARE = 0.25  # a peer block class holds at least this share of the block class's params (Whisper's encoder
# layers: 0.75 of its decoder layers'; a stage's downsampling convs, far less, stay out)


class _Scan:
    """One pass over the events for the views built from them (each would otherwise be its own pass)."""

    def __init__(self, params: Sequence[ParamInfo], events: Sequence[Event]) -> None:
        self.param_uses: list[list[int]] = [[] for _ in params]
        self.forward_users: list[set[Call]] = [set() for _ in params]
        # per param, for each forward read: the call whose post-backward its backward is done by, and its caller
        # (``grad_ready_at``)
        self.done_by: list[set[tuple[Call, Call]]] = [set() for _ in params]
        self.forward_param_ops: list[tuple[int, str, tuple[int, ...]]] = []
        self.boundaries: dict[str, list[int]] = {}
        self.post_backward_at: dict[Call, int] = {}
        self.forward_end = len(events)
        self.op_count = 0
        op, fwd_pre, fwd_post, bwd_post = EventKind.OP, EventKind.FWD_PRE, EventKind.FWD_POST, EventKind.BWD_POST
        stack: list[Call] = []
        last_child: dict[Call, Call] = {}  # call -> the last call made from it that has returned
        for i, e in enumerate(events):
            kind = e.kind
            if kind is op:
                self.op_count += 1
                if e.params:
                    for p in e.params:
                        self.param_uses[p].append(i)
                    if not e.backward:
                        caller = stack[-1] if stack else (ROOT, 0)
                        # a read after a call its caller made runs its backward before that call's (autograd runs
                        # the later forward first): ``self.a.bias`` read again after ``self.b(self.a(x))``
                        done_by = (last_child.get(caller, caller), caller)
                        for p in e.params:
                            self.forward_users[p].add(caller)
                            self.done_by[p].add(done_by)
                        self.forward_param_ops.append((i, e.module, e.params))
            else:
                self.boundaries.setdefault(e.module, []).append(i)
                if kind is fwd_pre:
                    stack.append((e.module, e.call))
                elif kind is fwd_post:
                    done = stack.pop()
                    last_child[stack[-1] if stack else (ROOT, 0)] = done
                elif kind is bwd_post:
                    self.post_backward_at[(e.module, e.call)] = i
            if e.backward and self.forward_end == len(events):
                self.forward_end = i


class TraceIndex:
    def __init__(self, params: Sequence[ParamInfo], modules: Mapping[str, ModuleInfo],
                 events: Sequence[Event]) -> None:
        self._params, self._modules, self._events = params, modules, events

    @cached_property
    def memo(self) -> dict[tuple, Any]:
        """Derived views of the trace that take an argument (a plan's checkpointing), by a key led by the name of
        the function that computes them (``fsdp2/checkpointing.recomputed_spans``): each computed once per trace."""
        return {}

    @cached_property
    def registration(self) -> dict[str, int]:
        """Module name -> its position in registration order (``named_modules``), which FSDP2's orders follow."""
        return {m: i for i, m in enumerate(self._modules)}

    @cached_property
    def loss_region(self) -> list[bool]:
        """Per event: an op of the loss region (a forward op outside every module call, or a backward op before
        backward reached a module), where the memory model counts live bytes instead of saved ones."""
        out = []
        depth, reached = 0, False
        for e in self._events:
            kind = e.kind
            out.append(kind is EventKind.OP and ((e.backward and not reached) or (not e.backward and not depth)))
            if kind is EventKind.FWD_PRE:
                depth += 1
            elif kind is EventKind.FWD_POST:
                depth -= 1
            elif kind is EventKind.BWD_PRE:
                reached = True
        return out

    # -- params ------------------------------------------------------------------------------------------
    @cached_property
    def param_index(self) -> dict[str, int]:
        """Param name (canonical or alias) -> index into ``Trace.params``."""
        out: dict[str, int] = {}
        for i, p in enumerate(self._params):
            out[p.fqn] = i
            for alias in p.aliases:
                out[alias] = i
        return out

    @cached_property
    def _scan(self) -> _Scan:
        return _Scan(self._params, self._events)

    @property
    def param_uses(self) -> list[list[int]]:
        """Per param: the indices of the ops reading it, in order."""
        return self._scan.param_uses

    @cached_property
    def use_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (op, param) read as two flat arrays (op indices, param indices): whole-plan checks vectorise
        over them instead of looping over 10,000 params."""
        uses = self.param_uses
        ops = np.fromiter((i for u in uses for i in u), dtype=np.int64, count=sum(map(len, uses)))
        params = np.repeat(np.arange(len(uses), dtype=np.int64), [len(u) for u in uses])
        return ops, params

    @cached_property
    def read_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``use_arrays`` and after them every param given to a module call as an argument (``Event.passed``), read
        by the caller just before the call's FWD_PRE, before the call's hooks ran; and which of them are such passes.
        Built once: auto checks every candidate plan against them."""
        ops, params = self.use_arrays
        pairs = [(i - 1, p) for i, e in enumerate(self._events) if e.passed and i > 0 for p in e.passed]
        passed = np.zeros(len(ops) + len(pairs), dtype=bool)
        passed[len(ops):] = True
        return (np.concatenate([ops, np.array([i for i, _ in pairs], dtype=np.int64)]),
                np.concatenate([params, np.array([p for _, p in pairs], dtype=np.int64)]), passed)

    @cached_property
    def ops_through(self) -> np.ndarray:
        """ops_through[i]: how many of events 0..i are ops (boundaries launch nothing), for i up to len(events)."""
        is_op = np.fromiter((e.is_op for e in self._events), dtype=np.int64, count=len(self._events))
        return np.concatenate([np.cumsum(is_op), [int(is_op.sum())]])

    @cached_property
    def first_use(self) -> dict[int, int]:
        """Param index -> its first op (a forward one when it has any); params never read are absent."""
        return {p: uses[0] for p, uses in enumerate(self.param_uses) if uses}

    @cached_property
    def first_use_by_name(self) -> dict[str, int]:
        """Param name (canonical or alias) -> its first op, or ``len(events) + 1`` when never read: how plans order
        their groups, looked up for every param of every plan a planner builds."""
        never, first, index = len(self._events) + 1, self.first_use, self.param_index
        return {name: first.get(i, never) for name, i in index.items()}

    @cached_property
    def trainable_dtypes(self) -> frozenset[str]:
        """The dtypes of the params that require grad (FSDP2 wants one per group)."""
        return frozenset(p.dtype for p in self._params if p.requires_grad)

    @cached_property
    def first_backward_use(self) -> list[int]:
        """Per param: its first backward op, or ``len(events) + 1`` when backward never reads it."""
        never = len(self._events) + 1
        return [next((i for i in uses if self._events[i].backward), never) for uses in self.param_uses]

    @property
    def forward_users(self) -> list[set[Call]]:
        """Per param, the module calls (innermost) whose forward ops read it: autograd completes its grad once
        all of their backward passes are done. (Do not modify.)"""
        return self._scan.forward_users

    @cached_property
    def reducible(self) -> list[bool]:
        """Per param: whether it has a gradient to reduce-scatter (autograd gave it one, FSDP2's post_backward
        reduces only those; ``reduce_scatter_unused_params`` is off by default)."""
        return [p.requires_grad and p.gets_grad and bool(u)
                for p, u in zip(self._params, self.forward_users, strict=True)]

    @cached_property
    def grad_ready_at(self) -> list[int]:
        """Per param: the event after which autograd has finished its grad, the last ``BWD_POST`` by which the
        backward of each of its forward reads is done: the read's call's, or for a read after a call that call made
        (the call's own forward read again later: a parent's or the root's), that call's (``len(events)``, the end
        of backward, when the call never gets one). FSDP2 reduce-scatters only the grads autograd has finished
        at a group's post-backward.

        Both calls bound the read's backward (it ran inside the caller, after the call returned), so the earlier
        of their post-backwards is taken: a call without grad-requiring inputs gets no post-backward marker, only
        the one the recorder closes it with when an unrelated module's backward starts, which can come after its
        caller's (a parametrized Linear's ``parametrizations.weight`` call, made from its forward before
        ``F.linear`` reads its bias: the bias would be ready only after the Linear's group had reduced)."""
        end, post_at = len(self._events), self._scan.post_backward_at
        return [max((min(post_at.get(c, end), post_at.get(u, end)) for c, u in done), default=end)
                for done in self._scan.done_by]

    @property
    def forward_param_ops(self) -> list[tuple[int, str, tuple[int, ...]]]:
        """(event index, module, params) of every forward op that reads params, in order."""
        return self._scan.forward_param_ops

    @property
    def boundaries_by_module(self) -> dict[str, list[int]]:
        """Module -> the indices of its boundary events (where FSDP2's hooks would run), in order."""
        return self._scan.boundaries

    @property
    def forward_end(self) -> int:
        """Index of the first backward event (``len(events)`` if there is none)."""
        return self._scan.forward_end

    @property
    def op_count(self) -> int:
        return self._scan.op_count

    @cached_property
    def op_flops(self) -> np.ndarray:
        """Per event: its FLOPs (0 for boundaries)."""
        return np.fromiter((e.flops for e in self._events), dtype=np.float64, count=len(self._events))

    @cached_property
    def op_nbytes(self) -> np.ndarray:
        """Per event: the bytes it reads and writes (0 for boundaries)."""
        return np.fromiter((e.nbytes for e in self._events), dtype=np.float64, count=len(self._events))

    @cached_property
    def op_kernel(self) -> np.ndarray:
        """Per event: its ``Event.kernel`` (a matmul's smallest dim, attention, other; 0 for boundaries)."""
        return np.fromiter((e.kernel for e in self._events), dtype=np.int64, count=len(self._events))

    @cached_property
    def host_syncs(self) -> list[int]:
        """The ops the host waits for (``Event.syncs``), in order."""
        return [i for i, e in enumerate(self._events) if e.syncs]

    @cached_property
    def read_outside(self) -> frozenset[int]:
        """Params a forward op reads outside the modules that own them (only the root is unsharded around it)."""
        owners = [p.owners for p in self._params]
        out: set[int] = set()
        for _, module, params in self.forward_param_ops:
            for p in params:
                if p not in out and not any(is_within(module, o) for o in owners[p]):
                    out.add(p)
        return frozenset(out)

    @cached_property
    def outside_readers(self) -> dict[int, frozenset[str]]:
        """Each param of ``read_outside`` -> the modules whose forward ops read it (the module running each op)."""
        outside = self.read_outside
        out: dict[int, set[str]] = {}
        for _, module, params in self.forward_param_ops:
            for p in params:
                if p in outside:
                    out.setdefault(p, set()).add(module)
        return {p: frozenset(m) for p, m in out.items()}

    @cached_property
    def not_enclosing(self) -> frozenset[str]:
        """Modules whose calls do not enclose every call below them: those above a module called while its parent
        module is not running (a parent calling a grandchild directly, ``self.layer.proc(x)``; a shared module
        called through its other parent), up to the nearest one running then, which encloses that call. Hooks on
        such a module do not run around every use of its subtree. (JetMoE's attention calls its experts' ``map``,
        which calls their linears: the experts do not enclose them, the attention and its layer do.)"""
        running: dict[str, int] = {}  # module -> its calls open now
        out: set[str] = set()
        for e in self._events:
            if e.kind is EventKind.FWD_PRE:
                listed: list[str] = []  # ModuleLists/ModuleDicts walked through: never called, their parent decides
                for a in proper_ancestors(e.module):
                    if a == ROOT or running.get(a):
                        break
                    listed.append(a)
                    if self._modules[a].cls not in NO_FORWARD:
                        out.update(listed)
                        listed = []
                running[e.module] = running.get(e.module, 0) + 1
            elif e.kind is EventKind.FWD_POST:
                running[e.module] -= 1
        return frozenset(out)

    # -- modules -----------------------------------------------------------------------------------------
    @cached_property
    def parents(self) -> dict[str, tuple[str, ...]]:
        """Module -> the modules that hold it as a child (several for a shared submodule)."""
        out: dict[str, list[str]] = {m: [] for m in self._modules}
        for m, info in self._modules.items():
            for c in info.children:
                out[c].append(m)
        return {m: tuple(ps) for m, ps in out.items()}

    @cached_property
    def subtree_params(self) -> dict[str, frozenset[str]]:
        """Module -> canonical names of every param reachable below it (itself included), following the
        module objects' real children as FSDP2 does."""
        out: dict[str, frozenset[str]] = {}
        for m in self._post_order():
            info = self._modules[m]
            acc = set(info.params)
            for c in info.children:
                acc |= out[c]
            out[m] = frozenset(acc)
        return out

    @cached_property
    def subtree_numel(self) -> dict[str, int]:
        numel = {p.fqn: p.numel for p in self._params}
        return {m: sum(numel[p] for p in ps) for m, ps in self.subtree_params.items()}

    @cached_property
    def owning_modules(self) -> list[str]:
        """Modules that directly register at least one parameter, in registration order."""
        return [m for m, info in self._modules.items() if info.params]

    @cached_property
    def block_class(self) -> str | None:
        """The model's repeated block class: the class of a container's (ModuleList/Sequential) children that
        repeats and holds the most params; else that of a composite module the step calls again and again (an
        ALBERT's one shared layer: its Linears, the class with most instances' params, were taken for the block and
        each wrapped alone, 59 all-gathers a step); else the repeated class holding the most params."""
        if self.container_block_class is not None:
            return self.container_block_class
        # a repeated composite class before a leaf's (blocks held as attributes, not in a list: their Linears,
        # inside and out, held more params than the blocks)
        repeated = self._most_params(m for m, info in self._modules.items() if m != ROOT and info.children
                                     and info.cls not in CONTAINERS) or \
            self._most_params(m for m in self._modules if m != ROOT)
        reused = self._most_params((m for m, info in self._modules.items() if m != ROOT and info.calls >= 2
                                    and info.children and info.cls not in CONTAINERS), repeated=False)
        # (a small helper called twice, a projector run on two inputs, is no block beside larger repeated ones;
        # the repeated class's instances inside the reused module's are the block's own)
        return reused if reused is not None and (repeated is None or self._class_numel(reused) >=
                                                  self._class_numel(repeated, outside=reused)) else repeated

    @cached_property
    def container_block_class(self) -> str | None:
        """The repeated class, holding the most params, among the children of containers (ModuleList/Sequential;
        of a root container, ``nn.Sequential(*blocks)``, its composite children only: a root Sequential of layers
        has no blocks); a stage that stacks blocks of its own gives way to those blocks."""
        containers = [m for m, info in self._modules.items() if m != ROOT and info.cls in CONTAINERS]
        kids = [c for m in containers for c in self._modules[m].children]
        if self._modules[ROOT].cls in CONTAINERS:
            kids += [c for c in self._modules[ROOT].children if self._modules[c].children]
        # a container's child inside an instance of a composite class that containers hold is a piece of such a
        # block (a U-Net's DoubleConv stacks its convs in a Sequential of its own: the convs, in every block and
        # in the bottleneck outside the lists, held more params than the blocks and were taken for them); a
        # container holding containers (stages of blocks) is no block of its own
        composite = {self._modules[k].cls for k in kids if self._modules[k].children} - set(CONTAINERS)
        kids = [k for k in kids if not any(self._modules[a].cls in composite for a in proper_ancestors(k))]
        # a container stacking composite modules of one class (a ConvNeXt's Sequential stages of blocks in a
        # ModuleList) is a stage, whose blocks are candidates of their own: with the same params in both, the class
        # name broke the tie and made each stage one group (a trial); a container of composite layers of several
        # classes (Sequential(Attention, FeedForward)) is a block
        kids = [k for k in kids if not self._stage(k)]
        # no class repeats: a container of layers of several kinds, one of each (a 2-layer hybrid's Mamba and
        # attention layers), still stacks blocks; an inner class (its Linears) repeats in them, not a block
        cls = self._most_params(kids) or self._most_params(self._stacked_kinds(containers), repeated=False)
        while cls is not None and (inner := self._stacked_class(cls)) is not None:
            cls = inner
        return cls

    @cached_property
    def checkpoint_block_classes(self) -> tuple[str, ...]:
        """The classes whose instances are checkpointed as blocks: ``container_block_class`` and its peers, other
        composite classes repeated in containers that hold at least ``PEER_SHARE`` of its params and neither sit
        inside its instances nor hold them (Whisper's and BART's encoder layers beside their decoder layers, a
        hybrid's two layer kinds: checkpointing the block class alone left an encoder's activations, the larger
        part of a speech model's, saved in full), and a class stacked between its instances even where one kind
        holds the other (Zamba2's hybrid layers each wrap a Mamba layer: ``block_instances`` are the outermost).
        A model of no such class, whose blocks are attributes (``block0``, ``block1``, ...), has ``block_class``'s
        where it is composite and repeated (the titan and module policies wrapped those blocks, and ``--ac`` found
        none: a trial)."""
        main = self.container_block_class
        if main is None:
            return self._attribute_blocks()
        numel, chosen = self.subtree_numel, [main]
        kids = {c for m, info in self._modules.items() if info.cls in CONTAINERS for c in info.children
                if m != ROOT or self._modules[c].children}
        total: dict[str, int] = {}
        count: dict[str, int] = {}
        for m in kids:
            info = self._modules[m]
            if numel[m] > 0 and info.children:
                total[info.cls] = total.get(info.cls, 0) + numel[m]
                count[info.cls] = count.get(info.cls, 0) + 1
        # (a block class with no children of its own, a Conv2d that nested Sequential stages stack, is no container's
        # composite child: its share is its instances')
        ours = total.get(main, sum(numel[m] for m, info in self._modules.items() if info.cls == main))
        alone = count.get(main, 0) < 2  # (a stack of layers of several kinds, one of each: each is a block)
        # a class stacked between the block class's instances in their container is a layer of that stack whatever
        # its share (a hybrid's few attention layers among its Mamba layers: Jamba's 4 in 32, which torchtitan's
        # loop over the stack shards each); not a module at either end of it (an embedding or a head)
        stacked = self._interleaved(main)
        for cls in sorted((c for c in total if c != main and (count[c] >= 2 or alone or c in stacked)),
                          key=lambda c: (-total[c], c)):
            # (a stacked class is a layer of the stack even where another layer kind also holds one: Zamba2's
            # hybrid layers each wrap a Mamba layer beside the shared attention, between 5 plain Mamba layers,
            # which were left to the root, 75% of the params; transformers' _no_split_modules names both)
            if cls in stacked or (total[cls] >= PEER_SHARE * ours and not self._nested(cls, chosen)):
                chosen.append(cls)
        return tuple(chosen)

    def _attribute_blocks(self) -> tuple[str, ...]:
        """``block_class`` where each instance is composite and the class repeats (two instances or more, or one
        the step calls again and again: an ALBERT's shared layer); () otherwise (a leaf class, a Linear, is no
        block to checkpoint or compile)."""
        cls = self.block_class
        mine = [info for m, info in self._modules.items() if m != ROOT and info.cls == cls]
        if not mine or not all(info.children for info in mine) or cls in CONTAINERS:
            return ()
        return (cls,) if len(mine) >= 2 or any(info.calls >= 2 for info in mine) else ()

    @cached_property
    def block_instances(self) -> tuple[str, ...]:
        """The instances of ``checkpoint_block_classes``, in the model's order, but for one inside another (a
        hybrid layer's own Mamba layer): the blocks ``--ac`` checkpoints, ``--compile`` compiles and the order
        policy keeps whole."""
        classes = self.checkpoint_block_classes
        return tuple(outermost([m for m, info in self._modules.items() if info.cls in classes]))

    def _interleaved(self, cls: str) -> set[str]:
        """The classes of the modules that sit between two instances of ``cls`` in a container holding them."""
        out: set[str] = set()
        for parent in {parent_of(m) for m, info in self._modules.items() if info.cls == cls and m != ROOT}:
            children = self._modules[parent].children
            at = [i for i, c in enumerate(children) if self._modules[c].cls == cls]
            out.update(self._modules[c].cls for c in children[at[0] + 1:at[-1]])
        return out

    def _nested(self, cls: str, classes: list[str]) -> bool:
        """Whether an instance of ``cls`` sits inside, or holds, an instance of one of ``classes``."""
        mine = [m for m, info in self._modules.items() if info.cls == cls]
        theirs = [m for m, info in self._modules.items() if info.cls in classes]
        return any(is_within(a, b) or is_within(b, a) for a in mine for b in theirs)

    def _stage(self, fqn: str) -> bool:
        """Whether ``fqn`` is a container whose children are two or more composite modules of one class."""
        if self._modules[fqn].cls not in CONTAINERS:
            return False
        kids = [self._modules[c] for c in self._modules[fqn].children]
        return len(kids) >= 2 and all(k.children for k in kids) and len({k.cls for k in kids}) == 1

    def _stacked_class(self, cls: str) -> str | None:
        """The block class that every instance of ``cls`` stacks in a container child of its own (Swin's
        ``SwinStage.blocks`` of ``SwinLayer``, Hugging Face ResNet's stages), when those blocks hold most of its
        params: wrapping the stage would make one FSDP group of several layers. The stack's children must be
        composite modules of one class, so an MLP ``Sequential(Linear, GELU, Linear)`` or T5's heterogeneous
        ``T5Block.layer`` never counts, and ``cls`` must route no tokens to them (an MoE block's experts)."""
        numel = self.subtree_numel
        instances = [m for m, info in self._modules.items() if info.cls == cls and numel[m] > 0]
        # a router among its ops reading token counts (``host_syncs``): the stack holds experts, each running on the
        # tokens routed to it, not layers (a torch.where-routed MoE block's ModuleList of expert MLPs)
        routers = {self._events[i].module for i in self.host_syncs}
        if any(is_within(r, m) for r in routers for m in instances):
            return None
        found: set[str] = set()
        stacked = 0
        for m in instances:
            kids = [k for c in self._modules[m].children if self._modules[c].cls in CONTAINERS
                    for k in self._modules[c].children]
            classes = {self._modules[k].cls for k in kids}
            if len(classes) != 1 or not all(self._modules[k].children for k in kids):
                return None
            found |= classes
            stacked += sum(numel[k] for k in kids)
        if len(found) != 1 or 2 * stacked < sum(numel[m] for m in instances):
            return None
        return found.pop()

    def _stacked_kinds(self, containers: list[str]) -> list[str]:
        """The children of the containers that stack two or more composite modules holding params (layers)."""
        numel = self.subtree_numel
        out = []
        for m in containers:
            layers = [c for c in self._modules[m].children if self._modules[c].children and numel[c] > 0]
            if len(layers) >= 2:
                out += layers
        return out

    def _class_numel(self, cls: str, outside: str = "") -> int:
        """The params of the instances of ``cls`` (outermost ones: a nested instance's counted once), those inside
        an instance of class ``outside`` left out."""
        numel = self.subtree_numel
        found = {m for m, info in self._modules.items() if m != ROOT and info.cls == cls}
        return sum(numel[m] for m in found if not any(a in found or self._modules[a].cls == outside
                                                      for a in proper_ancestors(m) if a != ROOT))

    def _most_params(self, candidates: Iterable[str], repeated: bool = True) -> str | None:
        """The class holding the most params among ``candidates``, of those with two instances or more there
        (any, with ``repeated`` False)."""
        numel = self.subtree_numel
        count: dict[str, int] = {}
        total: dict[str, int] = {}
        for fqn in dict.fromkeys(candidates):
            if numel[fqn] > 0:
                cls = self._modules[fqn].cls
                count[cls] = count.get(cls, 0) + 1
                total[cls] = total.get(cls, 0) + numel[fqn]
        kinds = [c for c in count if count[c] >= 2 or not repeated]
        return max(kinds, key=lambda c: (total[c], c)) if kinds else None

    @cached_property
    def owners_below(self) -> dict[str, frozenset[str]]:
        """Module -> the modules that own params in its subtree (itself included when it owns some)."""
        out: dict[str, frozenset[str]] = {}
        for m in self._post_order():
            info = self._modules[m]
            acc = {m} if info.params else set()
            for c in info.children:
                acc |= out[c]
            out[m] = frozenset(acc)
        return out

    @cached_property
    def shared_modules(self) -> list[str]:
        """Modules held by several parents (one object under several names) with params below them."""
        return [m for m, ps in self.parents.items() if len(ps) > 1 and self.subtree_params[m]]

    @cached_property
    def tied_params(self) -> list[int]:
        """Params registered on more than one module (tied weights)."""
        return [i for i, p in enumerate(self._params) if len(p.owners) > 1]

    def _post_order(self) -> list[str]:
        """Every module after all of its children (iterative: no recursion limit on deep models)."""
        done: set[str] = set()
        order: list[str] = []
        for start in self._modules:
            stack = [(start, False)]
            while stack:
                m, expanded = stack.pop()
                if m in done:
                    continue
                if expanded:
                    done.add(m)
                    order.append(m)
                    continue
                stack.append((m, True))
                stack.extend((c, False) for c in self._modules[m].children if c not in done)
        return order
