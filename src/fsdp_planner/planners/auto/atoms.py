"""Atoms: what the auto search groups. One per module that owns params (tied owners merged), or per whole repeated
block, in execution order, each marked with how freely FSDP2 lets it be grouped."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.planners.order import atoms_in_execution_order
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import is_within


class Pin(Enum):
    FREE = "free"  # may share a group with its neighbours
    ALONE = "alone"  # a group of its own
    ROOT = "root"  # left to the root group


@dataclass
class Atom:
    modules: list[str]
    nbytes: int  # unsharded bytes at the traced dtype
    start: int  # first forward op reading its params (len(events) when never read in forward)
    pin: Pin = Pin.FREE
    params: list[int] = field(default_factory=list)  # indices into Trace.params


def plan_atoms(trace: Trace, whole_blocks: bool) -> list[Atom]:
    """Atoms in execution order with their pinning (see ``pin_atoms``)."""
    never = len(trace.events)
    first, index = trace.index.first_use, trace.index.param_index
    atoms = []
    for mods, nbytes in atoms_in_execution_order(trace, whole=block_instances(trace) if whole_blocks else ()):
        params = list(dict.fromkeys(index[p] for m in mods for p in trace.modules[m].params))
        start = min((first[p] for p in params if p in first and not trace.events[first[p]].backward), default=never)
        atoms.append(Atom(list(mods), nbytes, start, params=params))
    atoms = _folded_into_readers(trace, atoms)
    atoms.sort(key=lambda a: a.start)
    pin_atoms(trace, atoms)
    return atoms


def _folded_into_readers(trace: Trace, atoms: list[Atom]) -> list[Atom]:
    """An atom whose params only its ancestor's forward reads (``nn.MultiheadAttention``'s out_proj, whose weight
    the attention reads itself; it is never called) joins that ancestor's atom: in one group FSDP2 unshards it
    around each read, and a group of its own would never be unsharded. Pinned to the root instead, it held every
    boundary next to an attention fixed (auto's refinement moved none of a ViT's, and --explain said 'fixed')."""
    readers = trace.index.outside_readers
    host_of = {m: ai for ai, a in enumerate(atoms) for m in a.modules}
    folded: dict[int, int] = {}
    for ai, a in enumerate(atoms):
        reading = {m for p in a.params for m in readers.get(p, ())}
        host = next(iter(reading)) if len(reading) == 1 and all(p in readers for p in a.params) else None
        if host in host_of and host_of[host] != ai and all(is_within(m, host) for m in a.modules):
            folded[ai] = host_of[host]
    for ai, hi in folded.items():
        while hi in folded:  # (an ancestor's atom folded in turn)
            hi = folded[hi]
        h, a = atoms[hi], atoms[ai]
        atoms[hi] = Atom(h.modules + a.modules, h.nbytes + a.nbytes, min(h.start, a.start), params=h.params + a.params)
    return [a for ai, a in enumerate(atoms) if ai not in folded]


def pin_atoms(trace: Trace, atoms: list[Atom]) -> None:
    """Mark the atoms FSDP2 cannot group freely.

    - ROOT: its params are read outside the forward of the modules that own them (only the root group is
      unsharded around such a read); or a list of modules of which one is called more than once.
    - ALONE: a module called more than once, or an atom whose forward uses enclose other atoms' (a tied embedding
      used again by the head): pytorch#183702, a module of a list group reused later in the step can fail in
      backward. Also atoms never read in forward.
    """
    atom_of = {p: ai for ai, a in enumerate(atoms) for p in a.params}
    first, last = [-1] * len(atoms), [-1] * len(atoms)
    only_mine = [0] * len(atoms)  # forward param-reading ops that read this atom alone
    # (a read inside a module of the param's own atom is inside its group: ``_folded_into_readers``)
    outside = {atom_of[p] for p, modules in trace.index.outside_readers.items() if p in atom_of
               and not all(any(is_within(r, m) for m in atoms[atom_of[p]].modules) for r in modules)}
    for k, (_, _, params) in enumerate(trace.index.forward_param_ops):  # k: among forward ops reading params
        read = {atom_of[p] for p in params if p in atom_of}  # params on the root module are in no atom
        for ai in read:
            if first[ai] < 0:
                first[ai] = k
            last[ai] = k
        if len(read) == 1:
            only_mine[next(iter(read))] += 1
    for ai, a in enumerate(atoms):
        if ai in outside:
            a.pin = Pin.ROOT
        elif any(trace.modules[m].calls > 1 for m in a.modules):  # (a folded child is its host's: one module)
            a.pin = Pin.ROOT if sum(not any(is_within(m, o) for o in a.modules if o != m) for m in a.modules) > 1 \
                else Pin.ALONE
        elif first[ai] < 0 or only_mine[ai] != last[ai] - first[ai] + 1:
            a.pin = Pin.ALONE


def coarsen(free: list[Atom], limit: int) -> list[Atom]:
    """Merge runs of consecutive atoms into at most about ``limit`` atoms of similar bytes, so the DP stays fast on
    models with thousands of tiny modules (groups that small would be latency-bound anyway)."""
    if len(free) <= limit:
        return free
    target = sum(a.nbytes for a in free) / limit
    out: list[Atom] = []
    for a in free:
        if out and out[-1].nbytes + a.nbytes <= target:
            last = out[-1]
            out[-1] = Atom(last.modules + a.modules, last.nbytes + a.nbytes, last.start, params=last.params + a.params)
        else:
            out.append(Atom(list(a.modules), a.nbytes, a.start, params=list(a.params)))
    return out
