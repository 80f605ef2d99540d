"""The wrap policies people use today, with their exact semantics, as baselines: ``ModuleWrapPolicy`` (FSDP's
class-based wrapping), ``SizeBasedPolicy`` (FSDP1 ``size_based_auto_wrap_policy``) and ``TorchtitanPolicy``
(torchtitan's ``apply_fsdp``).

Each policy's ``build`` is its grouping as its semantics give it; ``plan`` returns it only when FSDP2 can run it
(``fsdp2/validity.py``) and otherwise refuses, naming the first op that would read a sharded param. The grouping
is not repaired: a repaired plan would no longer be the baseline the policy stands for (auto's search, which
starts from ``build``, finds the plans that run)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_planner.arguments import check_fields, checked
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.claim import make_plan
from fsdp_planner.fsdp2.plan import Plan, ReshardAfterForward
from fsdp_planner.fsdp2.validity import runnable
from fsdp_planner.planners.blocks import default_block_class, find_class_instances
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, outermost, proper_ancestors

NO_WRAP_SHOWN = 10**12  # a size threshold from here on means "wrap nothing" (Accelerate's NO_WRAP is read as 1e15)


def block_classes(trace: Trace) -> tuple[str, ...]:
    """The classes a policy wraps by default: the repeated blocks the planner checkpoints and compiles (an
    encoder-decoder's encoder and decoder layers: each its own group, as Accelerate's wrap of ``_no_split_modules``
    makes them), else the model's repeated class outside containers (``default_block_class``)."""
    return trace.index.checkpoint_block_classes or tuple(filter(None, [default_block_class(trace)]))


@dataclass
class ModuleWrapPolicy:
    """Every instance of ``module_classes`` is a unit (nested instances too); the root takes the rest."""

    module_classes: tuple[str, ...] = ()
    name: str = "module"

    def __post_init__(self) -> None:
        if isinstance(self.module_classes, str):  # one class by name, not its letters
            self.module_classes = (self.module_classes,)
        if isinstance(self.module_classes, tuple | list) and not all(isinstance(c, str) and c
                                                                     for c in self.module_classes):
            raise PlannerError(f"module_classes must be class names (strings), got {self.module_classes!r}"[:300])
        check_fields(self)

    @checked
    def plan(self, trace: Trace, model: str | None = "") -> Plan:
        """``build``'s plan when it runs; a PlannerError naming the op that would read a sharded param otherwise."""
        return runnable(trace, self.build(trace, model))

    def build(self, trace: Trace, model: str = "") -> Plan:
        """The grouping the policy's rules make, whether or not FSDP2 can run it (auto starts from it)."""
        classes = self.module_classes or block_classes(trace)
        if not classes:
            raise PlannerError("the model has no repeated block class; pass --module-classes")
        wrapped = find_class_instances(trace, classes)
        return make_plan(trace, [[m] for m in wrapped], policy=f"{self.name}({','.join(classes)})", model=model)


@dataclass
class SizeBasedPolicy:
    """FSDP1 ``size_based_auto_wrap_policy`` replayed on the module tree (``_recursive_wrap`` semantics): a module
    is recursed into when its nonwrapped numel reaches the threshold (except MultiheadAttention) and wrapped when
    its remaining numel after wrapping children still does (except ModuleList/ModuleDict)."""

    min_nonwrapped_numel: int = int(1e8)  # FSDP1's default min_num_params
    name: str = "size"
    force_leaf_classes: tuple[str, ...] = ("MultiheadAttention",)
    exclude_wrap_classes: tuple[str, ...] = ("ModuleList", "ModuleDict")

    def __post_init__(self) -> None:
        check_fields(self)
        if isinstance(self.min_nonwrapped_numel, bool) or self.min_nonwrapped_numel < 1:
            raise PlannerError(f"the size policy's threshold must be a positive number of elements, got "
                               f"{self.min_nonwrapped_numel}")

    def wrapped_modules(self, trace: Trace) -> list[str]:
        numel = trace.index.subtree_numel
        wrapped: dict[str, None] = {}

        def visit(fqn: str, only_children: bool) -> int:
            if fqn in wrapped:  # a submodule shared by several parents is wrapped once, on its first visit
                return numel[fqn]
            cls = trace.modules[fqn].cls
            if not (numel[fqn] >= self.min_nonwrapped_numel and cls not in self.force_leaf_classes):
                return 0
            total = sum(visit(c, False) for c in trace.modules[fqn].children)
            if (not only_children and numel[fqn] - total >= self.min_nonwrapped_numel
                    and cls not in self.exclude_wrap_classes):
                wrapped[fqn] = None
                return numel[fqn]
            return total

        visit(ROOT, True)
        return list(wrapped)

    @checked
    def plan(self, trace: Trace, model: str | None = "") -> Plan:
        """``build``'s plan when it runs; a PlannerError naming the op that would read a sharded param otherwise."""
        return runnable(trace, self.build(trace, model))

    def build(self, trace: Trace, model: str = "") -> Plan:
        """The grouping the policy's rules make, whether or not FSDP2 can run it (auto starts from it)."""
        wrapped = self.wrapped_modules(trace)
        # (Accelerate's NO_WRAP is a threshold no model reaches: named as such, not as 15 digits)
        label = "no wrap" if not wrapped and self.min_nonwrapped_numel >= NO_WRAP_SHOWN else \
            str(self.min_nonwrapped_numel)
        return make_plan(trace, [[m] for m in wrapped], policy=f"{self.name}({label})", model=model)


@dataclass
class TorchtitanPolicy:
    """torchtitan's ``apply_fsdp``: the input embedding alone, each block, [norm, output] as one list group kept
    unsharded after forward, tied weights grouped as [embedding, norm, output], the root last.

    Generalised: modules that are not blocks and own params run before the first block or between blocks (each
    alone: a U-Net's downsampling convs, its middle blocks) or after the last block starts (one list group)."""

    block_class: str | None = None
    name: str = "titan"

    def __post_init__(self) -> None:
        check_fields(self)

    @checked
    def plan(self, trace: Trace, model: str | None = "") -> Plan:
        """``build``'s plan when it runs; a PlannerError naming the op that would read a sharded param otherwise."""
        return runnable(trace, self.build(trace, model))

    def build(self, trace: Trace, model: str = "") -> Plan:
        """The grouping the policy's rules make, whether or not FSDP2 can run it (auto starts from it)."""
        classes = (self.block_class,) if self.block_class else block_classes(trace)
        if not classes:
            raise PlannerError("the model has no repeated block class for the torchtitan policy")
        block_cls = ",".join(classes)
        found = find_class_instances(trace, classes)
        blocks = outermost(found)
        pre, middle, post = self._side_modules(trace, blocks)
        subtree = trace.index.subtree_params
        post_params = set().union(*(subtree[s] for s in post)) if post else set()
        # (a decoder's embedding, run between an encoder's blocks and its own, tied to the output: one group)
        tied_before = [s for s in [*pre, *middle] if subtree[s] & post_params]
        groups: list[list[str]] = [[s] for s in [*pre, *middle] if s not in tied_before] + [[b] for b in blocks]
        reshard: list[ReshardAfterForward] = [True] * len(groups)
        # each alone: an unused module (ModuleInfo.unused: why), and one called more than once (pytorch#183702: a
        # module of a list group reused later in the step can fail in backward; ALBERT's shared block's norm beside
        # the final norm, which check warned of in auto's plan from this baseline)
        unused = [s for s in post if trace.modules[s].unused or trace.forward_calls(s) > 1]
        post = [s for s in post if s not in unused]
        if post or tied_before:
            groups.append(tied_before + post)
            reshard.append(False)
        groups += [[s] for s in unused]
        reshard += [True] * len(unused)
        return make_plan(trace, groups, reshard, policy=f"{self.name}({block_cls})", model=model)

    @staticmethod
    def _side_modules(trace: Trace, blocks: list[str]) -> tuple[list[str], list[str], list[str]]:
        """Param-owning modules beside the blocks' chain of containers, split into those first used before the
        first block, before the last block and the rest, each list in first-use order (the rest is torchtitan's
        [norm, output], kept unsharded after forward: a module between blocks is not, whose params would stay
        gathered from its forward to its backward). A module whose params the forward reads outside it
        (a ParameterList the root indexes, an embedding the root multiplies with) stays with the root, the one
        group unsharded there."""
        chain = {a for b in blocks for a in proper_ancestors(b)}  # containers whose other children are side modules
        block_set = set(blocks)
        subtree = trace.index.subtree_params
        outside = {trace.params[i].fqn for i in trace.index.read_outside}
        side = [c for a in sorted(chain) for c in trace.modules[a].children
                if c not in chain and c not in block_set and subtree[c] and not subtree[c] & outside]
        never = len(trace.events)

        def first_use(fqn: str) -> int:  # ModuleInfo.first_use already covers the subtree
            use = trace.modules[fqn].first_use
            return use if use >= 0 else never

        side.sort(key=first_use)
        used = [trace.modules[b].first_use for b in blocks if trace.modules[b].first_use >= 0]
        first_block, last_block = (min(used), max(used)) if used else (0, 0)
        return ([s for s in side if first_use(s) < first_block],
                [s for s in side if first_block <= first_use(s) < last_block],
                [s for s in side if first_use(s) >= last_block])
