"""The hardware a plan is costed on: GPUs, the two link levels (NVLink inside a node, network across nodes).

A cluster is ``nodes`` nodes of ``gpus_per_node`` GPUs. The collective model that reads these numbers lives
in ``collectives.py``; this module holds them, the presets (each figure cites its public source), JSON
round-trips and the ``--cluster`` spec parser. A cluster written by ``calibrate.calibrate`` also carries
``fits``: measured (latency, bus bandwidth) per collective and group size, which the cost model prefers over
the preset figures.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import InitVar, asdict, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from enum import Enum
from pathlib import Path
from statistics import NormalDist
from typing import Any, NamedTuple

from fsdp_planner.arguments import checked
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_count
from fsdp_planner.fsdp2.collectives import COLLECTIVES
from fsdp_planner.userfiles import parse_json, read_text, shown_json, write_atomic

CLUSTER_VERSION = 1
# Sanity bounds on what a cluster may describe: a world far beyond any real job is a typo (and big enough
# counts overflow the float arithmetic of the cost model); 72 GPUs per node is an NVL72 rack, the largest
# NVLink domain sold today.
MAX_WORLD_SIZE = 1_000_000
MAX_NODE_GPUS = 72
MAX_NODE_NICS = 64  # NICs (rails) per node: 8 on DGX H100 / GB200 NVL72 trays, 64 leaves room for any design

# CPUOffloadPolicy's copies between host and GPU: one direction of a PCIe Gen5 x16 link, 64 GB/s (NVIDIA's H100 SXM,
# H200 and HGX B200 data sheets give "PCIe Gen5: 128 GB/s", both directions); A100 SXM4: Gen4, 64 GB/s both ways.
# A ceiling: pinned copies reach ~80-90% of it in practice.
PCIE5_ONE_WAY = 64e9
PCIE4_ONE_WAY = 32e9
# The CPU optimizer step under CPUOffloadPolicy: torch.optim.AdamW(foreach=True) on fp32 CPU params, elements/s of
# one rank. Measured on this project's 2-core x86 host: 87.8 M elements/s on 2 threads (benchmarks/cpu_adamw.md;
# a rerun while the host was shared gave 30.9 M), so 43.9 M per core. A cluster built without the figure (a file
# without the field) has that host's rate.
CPU_ADAMW_RATE = 87.8e6
CPU_ADAMW_SOURCE = "measured on a 2-core x86 host (benchmarks/cpu_adamw.md)"
CPU_ADAMW_RATE_PER_CORE = CPU_ADAMW_RATE / 2
# A GPU server's host: its cores shared by its 8 ranks. DGX H100, H200 and B200 have two 56-core Xeons (112 cores;
# NVIDIA's DGX H100/H200 and DGX B200 data sheets), DGX A100 two 64-core AMD EPYC 7742 (128; DGX A100 data sheet).
# The presets' rate is derived, not measured: the per-core rate above x the cores per GPU (14: 615 M elements/s; 16:
# 702 M), assuming foreach AdamW scales with cores (it streams ~28 bytes per element: 17 GB/s per rank, 138 GB/s a
# node, within the hosts' 8-channel DDR memory bandwidth). Give yours with --cpu-optimizer-rate or calibrate it.
SERVER_HOST_CORES = {"h100": 112, "h100e": 112, "h200": 112, "a100": 128, "b200": 112}

# Per-kind fitted (latency seconds, bus bandwidth bytes/s), keyed by group size N.
Fits = dict[str, dict[int, tuple[float, float]]]
# Per-kind measured (bytes, seconds) over all the cluster's ranks, sizes ascending (calibrate --backend gloo).
Tables = dict[str, list[tuple[int, float]]]


@dataclass(frozen=True)
class GPU:
    """One accelerator's dense peaks and memory: what compute and memory estimates divide by."""

    name: str
    peak_bf16_flops: float  # dense (no sparsity) tensor-core bf16, FLOP/s
    peak_fp32_flops: float  # dense fp32 as PyTorch runs it by default (see the presets), FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: int  # spec-sheet capacity (decimal GB); the usable total is a little lower
    peak_fp8_flops: float = 0.0  # dense float8 tensor-core peak, FLOP/s (float8 training); 0: none (A100)


@dataclass(frozen=True)
class Link:
    """One level of the interconnect, described the way NCCL's ring model sees it.

    ``bus_bandwidth`` is the asymptotic nccl-tests "busbw" of a ring over this link (large messages, large
    groups). A k-rank ring reaches ``bus_bandwidth * (1 - ring_overhead / k)``: small rings lose a share to
    the fixed per-step work (fitted on 8xH100, see the presets). ``base_latency`` is paid once per collective,
    ``hop_latency`` once per ring step over this link. ``half_bw_bytes`` is the small-message efficiency:
    a message of S bytes runs at ``S / (S + half_bw_bytes)`` of the link rate (see ``cost``).
    """

    bus_bandwidth: float  # bytes/s; math.inf allowed (an ideal link)
    base_latency: float  # seconds
    hop_latency: float  # seconds
    half_bw_bytes: float = 0.0
    ring_overhead: float = 0.0


@dataclass(frozen=True)
class Overhead:
    """What FSDP2 costs per step beyond the ops' GPU time and the collectives: what makes hundreds of tiny groups
    slow (pytorch#173680: pre-forward took half of a step on a model of tiny layers).

    The host runs eager PyTorch ahead of the GPU: each traced op costs ``op_seconds`` to dispatch and launch, each
    FSDP2 hook that runs (a group's pre/post-forward, pre/post-backward) ``hook_seconds`` (Python, stream and event
    bookkeeping, the collective's launch), and each param FSDP2 manages ``param_seconds`` a step (its views, its
    DTensor gradient, its share of the foreach copies), spread over its group's hooks. While the host keeps ahead
    of the GPU this is hidden; when it falls behind, the GPU waits (``sim/streams.py``). FSDP2's copy-in (the
    all-gather input, the reduce-scatter input) and copy-out (``split_with_sizes_copy`` into the unsharded params,
    on the compute stream) run at ``copy_bandwidth``. ``calibrate --overhead`` measures all four on the machine it
    runs on (``calibrate/overhead.py``). On the host engine (CPU ranks, ``Engine.HOST``) ``op_seconds`` corrects each
    measured op time instead, and may be negative (``sim/host_engine.py``, ``calibrate --backend gloo``).
    """

    hook_seconds: float
    op_seconds: float
    copy_bandwidth: float  # bytes/s
    param_seconds: float = 0.0
    source: str = ""  # where the figures come from (a preset's citation, or the machine calibrate measured)
    # per call of a module fully_shard was applied to: its FSDPState's forward and backward hooks run on every call,
    # whether or not its group has work there (a list group of k modules pays k a pass); 0 where not measured
    module_seconds: float = 0.0


NO_OVERHEAD = Overhead(0.0, 0.0, math.inf, source="none: an ideal host and free copies")


@dataclass(frozen=True)
class Compute:
    """How close each kind of GPU kernel comes to the data-sheet peaks: the roofline's factors (``sim/compute.py``).

    An op takes ``max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x memory_efficiency))``. A matmul's
    efficiency rises with its smallest dim d (of M, N, K) and saturates: ``matmul_efficiency x d / (d +
    matmul_half_dim)`` (small tiles and partial waves leave the tensor cores idle: NVIDIA's Matrix Multiplication
    Background User's Guide); a fused attention kernel runs at ``attention_efficiency``. ``variation`` is the
    relative standard deviation of one GPU's speed across a cluster: a synchronous step waits for its slowest rank,
    which grows with the world size (``slowest_rank_factor``). The presets cite their sources (below); ``calibrate
    --compute`` fits the first four from op times measured on a GPU.
    """

    matmul_efficiency: float  # a large matmul's fraction of the dense peak
    matmul_half_dim: float  # the smallest dim at which a matmul reaches half of matmul_efficiency
    attention_efficiency: float  # fused attention (flash / memory-efficient SDPA, forward and backward)
    memory_efficiency: float  # memory-bound ops' fraction of the HBM bandwidth
    variation: float = 0.0  # relative standard deviation of per-GPU speed across the cluster
    source: str = ""

    def matmul_fraction(self, dim: float) -> float:
        """The fraction of the dense peak a matmul whose smallest dim is ``dim`` reaches."""
        return self.matmul_efficiency * dim / (dim + self.matmul_half_dim)


def slowest_rank_factor(variation: float, ranks: int) -> float:
    """How much longer a step synchronised over ``ranks`` GPUs takes than one GPU of median speed: 1 + variation x
    the expected largest of ``ranks`` standard normal draws (Blom's approximation; 0 for one rank)."""
    if ranks <= 1 or variation <= 0:
        return 1.0
    return 1.0 + variation * NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))


class Engine(Enum):
    """How a rank runs its step, which decides what can overlap (``sim/streams.py``, ``sim/host_engine.py``).

    ``STREAMS``: a GPU with NCCL. The host launches work ahead of the GPU; compute, all-gather and reduce-scatter
    run on their own streams and overlap. ``HOST``: a CPU rank with gloo (``calibrate --backend gloo``). One
    thread runs the ops, FSDP2's hooks and copies, and every collective blocks it: FSDP2 issues them with
    ``async_op=False`` (``unshard_async_op`` defaults to False; ``foreach_reduce`` waits), which on a GPU only
    orders streams but on a CPU waits for gloo. Nothing overlaps: the step is the sum of its parts.
    """

    STREAMS = "streams"
    HOST = "host"


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs, NVLink inside a node (``intra``), network across (``inter``).

    ``inter.bus_bandwidth`` is what a full node (all ``nics_per_node`` NICs busy) reaches across nodes; a
    group with fewer ranks per node than NICs uses a proportional share of it.
    """

    name: str
    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link
    nics_per_node: int = 8
    fits: Fits = field(default_factory=dict, hash=False)
    overhead: Overhead = field(default_factory=lambda: NO_OVERHEAD)
    engine: Engine = Engine.STREAMS
    # the host engine's collectives as measured, interpolated (hardware/collectives.py): on a CPU the time per byte
    # changes with size (buffers of 32 MiB or more are fresh pages each step), which no single line follows
    tables: Tables = field(default_factory=dict, hash=False)
    host_copy_bandwidth: float = PCIE5_ONE_WAY  # bytes/s each way between a GPU and its host (CPUOffloadPolicy)
    cpu_optimizer_rate: float = CPU_ADAMW_RATE  # elements/s of the optimizer step on the host (CPUOffloadPolicy)
    cpu_optimizer_source: str = CPU_ADAMW_SOURCE  # where that figure comes from (shown with offload plans' steps)
    # how close kernels come to the GPU's peaks (the roofline's factors); a file without it: the H100's
    compute: Compute = field(default_factory=lambda: COMPUTE["h100"])
    # (gpus_per_node, nics_per_node, inter) of the node itself when this cluster is how one TP rank's data-parallel
    # groups see it (sim/tensor_parallel.py ``dp_cluster``: a node's share); None: the cluster is the nodes as they
    # are. ``fits`` stay keyed by the packed runs measured on whole nodes (``measured_on``). Never written to a file.
    whole_node: tuple[int, int, Link] | None = None

    where: InitVar[str | None] = None  # how errors name it, e.g. "cluster file c.json"; default: its name
    physical: InitVar[bool] = False  # read from a file: its figures are held to the physical ranges too

    def __post_init__(self, where: str | None, physical: bool) -> None:
        _check_cluster(self, where or f"cluster '{self.name}'", physical)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def measured_on(self) -> Cluster:
        """The cluster its ``fits`` were measured on: itself, or for a data-parallel view the whole nodes (a fit at
        N packed ranks is a run on N GPUs of full nodes, whichever view reads it)."""
        if self.whole_node is None:
            return self
        gpus, nics, inter = self.whole_node
        return replace(self, gpus_per_node=gpus, nics_per_node=nics, inter=inter, whole_node=None)

    def describe(self) -> str:
        """One line for CLI output."""
        fitted = ", calibrated" if self.fits else ""
        if self.engine is Engine.HOST:
            alpha, busbw = next(iter(next(iter(self.fits.values())).values()), (0.0, 0.0)) if self.fits else \
                (self.intra.base_latency, self.intra.bus_bandwidth)
            return (f"{self.name}: {fmt_count(self.world_size, 'CPU rank')} on gloo (collectives block the rank: "
                    f"nothing overlaps), latency {alpha * 1e6:.0f} us, bus bandwidth {busbw / 1e9:.2f} GB/s{fitted}")
        return (
            f"{self.name}: {self.nodes} x {self.gpus_per_node} {self.gpu.name} ({fmt_count(self.world_size, 'GPU')}), "
            f"NVLink {self.intra.bus_bandwidth / 1e9:.0f} GB/s, network {self.inter.bus_bandwidth / 1e9:.0f} "
            f"GB/s per node{fitted}"
        )

    # ---- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CLUSTER_VERSION,
            "name": self.name,
            "gpu": {k: v for k, v in asdict(self.gpu).items() if k != "peak_fp8_flops" or v},  # none: as before
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "nics_per_node": self.nics_per_node,
            "intra": asdict(self.intra),
            "inter": asdict(self.inter),
            "fits": {k: {str(n): [a, b] for n, (a, b) in sorted(t.items())} for k, t in self.fits.items()},
            "overhead": asdict(self.overhead),
            "engine": self.engine.value,
            "tables": {k: [[n, t] for n, t in rows] for k, rows in self.tables.items()},
            "host_copy_bandwidth": self.host_copy_bandwidth,
            "cpu_optimizer_rate": self.cpu_optimizer_rate,
            "cpu_optimizer_source": self.cpu_optimizer_source,
            "compute": asdict(self.compute),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: Any, where: str = "cluster JSON") -> Cluster:
        if not isinstance(d, dict):
            raise PlannerError(f"the {where} must be a JSON object, got {type(d).__name__}")
        _check_version(d, where)
        _check_known_keys(d, where)
        # the sections read in this order, so that a file with several faults is told the same first one
        gpu, intra, inter = _gpu_from(d, where), _link_from(d, "intra", where), _link_from(d, "inter", where)
        # (absent: none; null, 0 or [] is a file written wrong, refused as any wrong type is, not read as none)
        fits, overhead = _fits_from(d.get("fits", {}), where), _overhead_from(d, where)
        tables, compute, engine = _tables_from(d.get("tables", {}), where), _compute_from(d, where), \
            _engine_from(d, where)
        return cls(
            name=_get(d, "name", where),
            gpu=gpu,
            gpus_per_node=_int(d, "gpus_per_node", where),
            nodes=_int(d, "nodes", where),
            intra=intra,
            inter=inter,
            nics_per_node=_int(d, "nics_per_node", where, 8),
            fits=fits,
            overhead=overhead,
            engine=engine,
            tables=tables,
            host_copy_bandwidth=_num(d, "host_copy_bandwidth", where, PCIE5_ONE_WAY),
            cpu_optimizer_rate=_num(d, "cpu_optimizer_rate", where, CPU_ADAMW_RATE),
            cpu_optimizer_source=_get(d, "cpu_optimizer_source", where,
                                      CPU_ADAMW_SOURCE if "cpu_optimizer_rate" not in d else where),
            compute=compute,
            where=where,
            physical=True,
        )

    @classmethod
    def from_json(cls, text: str, where: str = "cluster JSON") -> Cluster:
        return cls.from_dict(parse_json(text, lambda detail: f"the {where} is not valid JSON ({detail})"), where)

    def save(self, path: str | Path) -> None:
        """Write the cluster JSON; a cluster the file could not be read back as (a figure beyond its physical range,
        e.g. a calibration on a machine too slow to plan for) is refused here, before the file is written."""
        _check_cluster(self, f"cluster to write to {path}", physical=True)
        write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        p = Path(path)
        text = read_text(p, f"cluster file {p}", "a cluster JSON such as `calibrate --out` writes")
        return cls.from_json(text, where=f"cluster file {p}")


_MISSING = object()


def _gpu_from(d: dict[str, Any], where: str) -> GPU:
    memory = _num(d, "gpu.memory_bytes", where)
    return GPU(
        name=_get(d, "gpu.name", where),
        peak_bf16_flops=_num(d, "gpu.peak_bf16_flops", where),
        peak_fp32_flops=_num(d, "gpu.peak_fp32_flops", where),
        hbm_bandwidth=_num(d, "gpu.hbm_bandwidth", where),
        # a whole byte count; NaN / infinity are kept as read so that _check_cluster names them
        memory_bytes=int(memory) if math.isfinite(memory) else memory,  # type: ignore[arg-type]
        peak_fp8_flops=_num(d, "gpu.peak_fp8_flops", where, 0.0),
    )


def _link_from(d: dict[str, Any], lname: str, where: str) -> Link:
    return Link(
        bus_bandwidth=_num(d, f"{lname}.bus_bandwidth", where),
        base_latency=_num(d, f"{lname}.base_latency", where),
        hop_latency=_num(d, f"{lname}.hop_latency", where),
        half_bw_bytes=_num(d, f"{lname}.half_bw_bytes", where, 0.0),
        ring_overhead=_num(d, f"{lname}.ring_overhead", where, 0.0),
    )


def _overhead_from(d: dict[str, Any], where: str) -> Overhead:
    """The file's ``overhead`` section; none: an ideal host."""
    if "overhead" not in d:
        return NO_OVERHEAD
    return Overhead(hook_seconds=_num(d, "overhead.hook_seconds", where),
                    op_seconds=_num(d, "overhead.op_seconds", where),
                    copy_bandwidth=_num(d, "overhead.copy_bandwidth", where),
                    param_seconds=_num(d, "overhead.param_seconds", where, 0.0),
                    module_seconds=_num(d, "overhead.module_seconds", where, 0.0),
                    source=_get(d, "overhead.source", where, ""))


def _compute_from(d: dict[str, Any], where: str) -> Compute:
    """The file's ``compute`` section, each figure missing from it the H100's."""
    compute = COMPUTE["h100"]
    if "compute" not in d:
        return compute
    return Compute(**{f.name: _get(d, f"compute.{f.name}", where, "") if f.name == "source"
                      else _num(d, f"compute.{f.name}", where, getattr(compute, f.name))
                      for f in dataclass_fields(Compute)})


def _engine_from(d: dict[str, Any], where: str) -> Engine:
    engine = _get(d, "engine", where, Engine.STREAMS.value)
    if not isinstance(engine, str) or engine not in {e.value for e in Engine}:
        raise PlannerError(f"the {where} field 'engine' must be one of {', '.join(e.value for e in Engine)}, "
                           f"got {_short(engine)}")
    return Engine(engine)


def _check_version(d: dict[str, Any], where: str) -> None:
    """The format version: the one this code writes (``to_dict``) is the one it reads."""
    version = d.get("version", _MISSING)
    if isinstance(version, bool) or not isinstance(version, int) or version != CLUSTER_VERSION:
        got = "none" if version is _MISSING else _short(version)
        raise PlannerError(f"the {where} has format version {got}: this fsdp-planner reads cluster files with "
                           f"\"version\": {CLUSTER_VERSION} (as calibrate and Cluster.save write)")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _as_float(v: int | float) -> float:
    """A JSON number as a float; an integer beyond any float as infinite (refused by name by the range checks)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _fits_from(raw: Any, where: str) -> Fits:
    """``{"all_gather": {"8": [latency, bandwidth]}}``: types checked here, values by ``_check_fits``."""
    shape = (f"the {where} field 'fits' must map each collective to {{\"RANKS\": [latency, bandwidth]}}, "
             "e.g. {\"all_gather\": {\"8\": [2e-05, 3e11]}}")
    if not isinstance(raw, dict) or not all(isinstance(t, dict) and t for t in raw.values()):  # ({} under a
        # collective: no line, which dropped its kind without a word)
        raise PlannerError(f"{shape}; got {shown_json(raw)}")
    fits: Fits = {}
    for kind, table in raw.items():
        for n, v in table.items():
            if not (n.isascii() and n.isdigit() and len(n) <= 9) or not isinstance(v, list) or len(v) != 2 \
                    or not all(map(_is_number, v)):
                raise PlannerError(f"{shape}; got {_short(n)}: {_short(v)} under {_short(kind)}")
            fits.setdefault(kind, {})[int(n)] = (_as_float(v[0]), _as_float(v[1]))
    return fits


def _tables_from(raw: Any, where: str) -> Tables:
    """``{"all_gather": [[bytes, seconds], ...]}``: types checked here, values by ``_check_tables``."""
    shape = f"the {where} field 'tables' must map each collective to [[bytes, seconds], ...] (whole bytes)"
    if not isinstance(raw, dict) or not all(isinstance(rows, list) for rows in raw.values()):
        raise PlannerError(f"{shape}; got {shown_json(raw)}")
    tables: Tables = {}
    for kind, rows in raw.items():
        for row in rows:
            if not isinstance(row, list) or len(row) != 2 or isinstance(row[0], bool) or \
                    not isinstance(row[0], int) or not _is_number(row[1]):
                raise PlannerError(f"{shape}; got {_short(row)} under {_short(kind)}")
        tables[kind] = [(n, _as_float(t)) for n, t in rows]
    return tables


def _get(d: dict[str, Any], dotted: str, where: str, default: Any = _MISSING) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is not _MISSING:
                return default
            raise PlannerError(f"the {where} is missing the field '{dotted}'")
        cur = cur[part]
    return cur


def _num(d: dict[str, Any], dotted: str, where: str, default: Any = _MISSING) -> float:
    v = _get(d, dotted, where, default)
    if not _is_number(v):
        raise PlannerError(f"the {where} field '{dotted}' must be a number, got {_short(v)}")
    return _as_float(v)


def _int(d: dict[str, Any], dotted: str, where: str, default: Any = _MISSING) -> int:
    v = _get(d, dotted, where, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PlannerError(f"the {where} field '{dotted}' must be a whole number, got {_short(v)}")
    return v


class Range(NamedTuple):
    """The physically plausible values of one cluster figure: beyond them a file is a typo or a unit slip (1e-9
    for 1e9), and the cost model would divide by almost nothing and print infinities or NaN as results."""

    low: float
    high: float
    unit: str
    infinite: bool = False  # math.inf allowed: an ideal link, free copies (NO_OVERHEAD)
    low_open: bool = False  # the value must be above low, not equal to it
    physical: bool = True  # a plausibility bound, checked on files only; False: what any cluster must satisfy

    def widened(self) -> Range:
        """What a cluster built in code must satisfy: studies of an ideal machine use 1e30 for 'free'; only files
        (which a person types, units and all) are held to the physical range."""
        if not self.physical:
            return self
        return self._replace(low=min(self.low, 0.0), high=math.inf, low_open=self.low_open or self.low > 0)


# Bounds far wider than any machine sold or measured (a CPU rank on gloo reaches ~1e10 FLOP/s and ~1e9 B/s; a B200
# 2.25e15 FLOP/s and 8e12 B/s HBM, NVLink 5 ~1e12 B/s), yet narrow enough that no step time overflows. Listed in
# docs/calibrate.md.
FLOPS = Range(1e8, 1e17, "FLOP/s")
MEMORY_BANDWIDTH = Range(1e8, 1e14, "B/s")
MEMORY = Range(1e8, 1e13, "B")
BANDWIDTH = Range(1e6, 1e14, "B/s", infinite=True)
LATENCY = Range(0.0, 1.0, "s")
ELEMENT_RATE = Range(1e3, 1e13, "elements/s")  # a CPU optimizer step: from a slow core to far beyond any host
HALF_BW = Range(0.0, 1e10, "B")
RING_OVERHEAD = Range(0.0, 2.0, "", physical=False)
HOST_SECONDS = Range(0.0, 1.0, "s", physical=False)
EFFICIENCY = Range(0.0, 1.0, "", low_open=True)  # a fraction of a peak: above 0, at most all of it
HALF_DIM = Range(0.0, 1e6, "")  # elements of a matmul dim
VARIATION = Range(0.0, 0.5, "")  # relative standard deviation of GPU speed: half the median is far beyond any cluster
TABLE_BYTES = Range(1, 1e13, "B")
TABLE_SECONDS = Range(0.0, 1e3, "s", low_open=True)
MAX_NAME = 1000  # characters of a cluster's or a GPU's name
MAX_SOURCE = 1000  # characters of overhead.source


def _short(v: Any) -> str:
    """A value for a message, never longer than a line."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} characters)"


def _fmt(x: float) -> str:
    """``1e9``, ``1e-9``, ``0.5``: a bound or a value as a person writes it."""
    mantissa, e, exponent = f"{x:g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if e else mantissa


def _check_range(label: str, name: str, v: Any, r: Range, physical: bool) -> None:
    """One figure: a number, finite (or infinite where ``r`` allows), within ``r`` (``physical``) or its widened
    form; one line naming field, value and range otherwise."""
    r = r if physical else r.widened()
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise PlannerError(f"the {label} field '{name}' must be a number, got {_short(v)}")
    inside = (v > r.low if r.low_open else v >= r.low) and v <= r.high
    if (v == math.inf and r.infinite) or (math.isfinite(v) and inside):
        return
    unit = f" {r.unit}" if r.unit else ""
    shown = "infinity" if v == math.inf else "-infinity" if v == -math.inf else "NaN" if math.isnan(v) else \
        f"{_fmt(v)}{unit}"
    extra = " (or infinity: an ideal link / free copies)" if r.infinite else ""
    if r.high == math.inf:
        raise PlannerError(f"the {label} field '{name}' is {shown}; it must be a finite number "
                           f"{'above' if r.low_open else 'of at least'} {_fmt(r.low)}{extra}")
    bounds = f"{_fmt(r.low)}..{_fmt(r.high)}{unit}{f' ({_fmt(r.low)} excluded)' if r.low_open else ''}"
    raise PlannerError(f"the {label} field '{name}' is {shown}, outside {bounds}{extra}")


def _check_text(label: str, name: str, v: Any, limit: int) -> None:
    if not isinstance(v, str):
        raise PlannerError(f"the {label} field '{name}' must be a string, got {_short(v)}")
    if len(v) > limit:
        raise PlannerError(f"the {label} field '{name}' is {len(v):,} characters long; at most {limit:,} are "
                           "accepted")
    if "\n" in v or "\r" in v:  # printed in headers: a line of its own would pose as the program's
        raise PlannerError(f"the {label} field '{name}' must be one line, got {_short(v)}")


def _check_cluster(c: Cluster, label: str, physical: bool = False) -> None:
    """Every number of a cluster (preset, JSON file, calibration) in one place: finite, in range, named; with
    ``physical`` (a file read or written) within the physical ranges too. The checks run in this order, so a
    cluster wrong in several ways is refused for the first."""
    _check_text(label, "name", c.name, MAX_NAME)
    _check_shape(c, label)
    _check_gpu(c.gpu, label, physical)
    for lname in ("intra", "inter"):
        _check_link(getattr(c, lname), label, lname, physical)
    _check_overhead(c.overhead, c.engine, label, physical)
    _check_range(label, "host_copy_bandwidth", c.host_copy_bandwidth, BANDWIDTH._replace(infinite=False), physical)
    _check_range(label, "cpu_optimizer_rate", c.cpu_optimizer_rate, ELEMENT_RATE, physical)
    _check_text(label, "cpu_optimizer_source", c.cpu_optimizer_source, MAX_SOURCE)
    _check_tables(c.tables, label, physical)
    _check_fits(c.fits, label, physical)
    _check_compute(c.compute, label)


def _check_known_keys(d: dict, where: str) -> None:
    """Every key is one a cluster file has (what ``to_dict`` writes): a typo such as ``ring_overhed`` would
    otherwise leave the default in place without a word."""
    sections = {"gpu": GPU, "intra": Link, "inter": Link, "overhead": Overhead, "compute": Compute}
    known = {"version", "name", "gpus_per_node", "nodes", "nics_per_node", "fits", "engine", "tables",
             "host_copy_bandwidth", "cpu_optimizer_rate", "cpu_optimizer_source", *sections}
    for key in d:
        if key not in known:
            raise PlannerError(f"the {where} has an unknown field {_short(key)} (a typo?); the fields are listed in "
                               "docs/calibrate.md")
    for section, cls in sections.items():
        if section in d and not isinstance(d[section], dict):
            # a list or null in place of a section would otherwise read as absent: the preset's figures, unsaid
            raise PlannerError(f"the {where} field '{section}' must be a JSON object of "
                               f"{', '.join(f.name for f in dataclass_fields(cls))}, got {_short(d[section])}")
        fields = {f.name for f in dataclass_fields(cls)}
        for key in d.get(section) or {} if isinstance(d.get(section), dict) else ():
            if key not in fields:
                raise PlannerError(f"the {where} has an unknown field {_short(f'{section}.{key}')} (a typo?): "
                                   f"'{section}' has {', '.join(sorted(fields))}")


def _check_shape(c: Cluster, label: str) -> None:
    """Nodes, GPUs and NICs per node: whole numbers in range, and a world size the planner supports."""
    for attr, top in (("gpus_per_node", MAX_NODE_GPUS), ("nodes", MAX_WORLD_SIZE), ("nics_per_node", MAX_NODE_NICS)):
        v = getattr(c, attr)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise PlannerError(f"the {label} field '{attr}' must be a whole number from 1 to {top:,}, got "
                               f"{_short(v)}")
    if c.world_size > MAX_WORLD_SIZE:
        raise PlannerError(f"the {label} has {c.world_size:,} GPUs ({c.nodes:,} nodes x {c.gpus_per_node}); "
                           f"at most {MAX_WORLD_SIZE:,} are supported")


def _check_gpu(gpu: GPU, label: str, physical: bool) -> None:
    _check_text(label, "gpu.name", gpu.name, MAX_NAME)
    for attr, r in (("peak_bf16_flops", FLOPS), ("peak_fp32_flops", FLOPS), ("hbm_bandwidth", MEMORY_BANDWIDTH),
                    ("memory_bytes", MEMORY)):
        _check_range(label, f"gpu.{attr}", getattr(gpu, attr), r, physical)
    if gpu.peak_fp8_flops:  # 0: no float8 tensor cores
        _check_range(label, "gpu.peak_fp8_flops", gpu.peak_fp8_flops, FLOPS, physical)
    if not isinstance(gpu.memory_bytes, int):
        raise PlannerError(f"the {label} field 'gpu.memory_bytes' must be a whole number of bytes, got "
                           f"{_short(gpu.memory_bytes)}")


def _check_link(link: Link, label: str, lname: str, physical: bool) -> None:
    """One level of the interconnect: a bandwidth in range (infinite: an ideal link), latencies in range."""
    for attr, r in (("bus_bandwidth", BANDWIDTH), ("base_latency", LATENCY), ("hop_latency", LATENCY),
                    ("half_bw_bytes", HALF_BW)):
        _check_range(label, f"{lname}.{attr}", getattr(link, attr), r, physical)
    _check_range(label, f"{lname}.ring_overhead", link.ring_overhead, RING_OVERHEAD, physical)
    if link.ring_overhead == RING_OVERHEAD.high:  # 1 - c/k must stay above 0 for a 2-rank ring
        raise PlannerError(f"the {label} field '{lname}.ring_overhead' must be below 2, got 2")


def _check_overhead(overhead: Overhead, engine: Engine, label: str, physical: bool) -> None:
    """FSDP2's host costs in seconds below 1, and a copy bandwidth in range (infinite: free copies)."""
    for attr in ("hook_seconds", "op_seconds", "param_seconds", "module_seconds"):
        # on the host engine op_seconds corrects measured op times, and timing each op can add more than the
        # framework's work around it: a negative correction (sim/host_engine.py)
        low = -1.0 if attr == "op_seconds" and engine is Engine.HOST else 0.0
        _check_range(label, f"overhead.{attr}", getattr(overhead, attr), HOST_SECONDS._replace(low=low),
                     physical)
    _check_range(label, "overhead.copy_bandwidth", overhead.copy_bandwidth, BANDWIDTH, physical)
    _check_text(label, "overhead.source", overhead.source, MAX_SOURCE)


def _check_compute(compute: Compute, label: str) -> None:
    """The roofline's factors: efficiencies in (0, 1], a half-efficiency dim and a speed variation in range."""
    for attr in ("matmul_efficiency", "attention_efficiency", "memory_efficiency"):
        _check_range(label, f"compute.{attr}", getattr(compute, attr), EFFICIENCY, True)
    _check_range(label, "compute.matmul_half_dim", compute.matmul_half_dim, HALF_DIM, True)
    _check_range(label, "compute.variation", compute.variation, VARIATION, True)
    _check_text(label, "compute.source", compute.source, MAX_SOURCE)


def _check_tables(tables: Tables, label: str, physical: bool) -> None:
    """Measured collectives: two or more rows of a known collective, sizes ascending, sizes and times in range."""
    for kind, rows in tables.items():
        sizes = [n for n, _ in rows]
        if kind not in COLLECTIVES or len(rows) < 2 or sizes != sorted(set(sizes)):
            raise PlannerError(f"the {label} field 'tables.{_shown(kind)}' must be two or more [bytes, seconds] of a "
                               f"known collective ({', '.join(COLLECTIVES)}), sizes ascending")
        for i, (n, t) in enumerate(rows):
            _check_range(label, f"tables.{kind}.{i}.bytes", n, TABLE_BYTES, physical)
            _check_range(label, f"tables.{kind}.{i}.seconds", t, TABLE_SECONDS, physical)
        # (calibrate writes them non-decreasing; one that falls would cost a large collective as a small one: a 1
        # GiB all-gather at 940 GB/s on gloo, a trial)
        fall = next((i for i in range(1, len(rows)) if rows[i][1] < rows[i - 1][1]), None)
        if fall is not None:
            raise PlannerError(f"the {label} field 'tables.{_shown(kind)}' has a time that falls as the size grows "
                               f"(row {fall}: {_short(rows[fall][0])} bytes in {rows[fall][1]:.3g} s, after "
                               f"{_short(rows[fall - 1][0])} in {rows[fall - 1][1]:.3g} s): times must not fall "
                               "with size, as calibrate writes them (a file of an older calibrate --trace: run it "
                               "again)")


def _check_fits(fits: Fits, label: str, physical: bool) -> None:
    """Calibrated lines: of a known collective, for 2 or more ranks, a latency and a bandwidth in range."""
    for kind, table in fits.items():
        if kind not in COLLECTIVES:
            raise PlannerError(f"the {label} has fits for unknown collective '{_shown(kind)}' "
                               f"(known: {', '.join(COLLECTIVES)})")
        for n, (alpha, bw) in table.items():
            if not 2 <= n <= MAX_WORLD_SIZE:
                raise PlannerError(f"the {label} field 'fits.{kind}' has a fit for {_short(n)} ranks; fits are for 2 "
                                   f"to {MAX_WORLD_SIZE:,} ranks")
            _check_range(label, f"fits.{kind}.{n} latency", alpha, LATENCY, physical)
            _check_range(label, f"fits.{kind}.{n} bandwidth", bw, BANDWIDTH._replace(infinite=False), physical)


# ---- presets ----------------------------------------------------------------------------------------------
# Dense (no sparsity) bf16 tensor-core peak, fp32 peak, HBM bandwidth and capacity, from NVIDIA's data sheets:
# H100 SXM5 and H200 SXM (1,979 TFLOP/s bf16 with sparsity = 989 dense; 67 TFLOP/s fp32; 3.35 / 4.8 TB/s),
# A100 SXM4 80GB (312 TFLOP/s bf16; 19.5 fp32; 2,039 GB/s), HGX B200 (36 PFLOP/s sparse bf16 and 600 TFLOP/s fp32
# per 8 GPUs; 8 TB/s). Dense float8 (e4m3) tensor-core peaks from the same data sheets: H100 SXM and H200 SXM
# 3,958 TFLOP/s with sparsity = 1,979 dense, HGX B200 72 PFLOP/s sparse per 8 GPUs = 4,500 dense each; the A100
# has no float8 tensor cores (0: float8 training refused). fp32 uses the non-tensor peak: PyTorch's default matmul
# precision is "highest" (torch.backends.cuda.matmul.allow_tf32 is False), so fp32 matmuls do not run on TF32
# tensor cores.
# h100e: the H100 of Meta's Grand Teton hosts that torchtitan's published Llama 3 runs used (pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md): "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "the default
# 500W power limit"; its footnote: "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact
# value". NVIDIA's H100 data sheet gives H100 NVL 1,671 TFLOP/s sparse bf16 = 835 dense: the peak here, 912, is the
# midpoint of 835 and 989, an estimate; fp32 and float8 (twice bf16, as on every Hopper part) scaled alike.
GPUS: dict[str, GPU] = {
    "h100": GPU("H100-SXM-80GB", 989e12, 67e12, 3.35e12, 80_000_000_000, 1979e12),
    "h100e": GPU("H100-SXM-96GB-HBM2e-500W", 912e12, 61.8e12, 2.4e12, 96_000_000_000, 1824e12),
    "h200": GPU("H200-SXM-141GB", 989e12, 67e12, 4.8e12, 141_000_000_000, 1979e12),
    "a100": GPU("A100-SXM4-80GB", 312e12, 19.5e12, 2.039e12, 80_000_000_000),
    "b200": GPU("B200-180GB", 2250e12, 75e12, 8.0e12, 192_000_000_000, 4500e12),
}

# The roofline's factors (``Compute``; docs/model.md "Compute" shows how far each moves the published runs).
# - Attention: PyTorch's flash SDPA kernel is FlashAttention-2. Its paper (Dao, arXiv:2307.08691) reports 50-73% of
#   the A100's peak (forward; backward lower) -> 0.6; the FlashAttention-3 paper (Shah et al., arXiv:2407.08608)
#   reports FlashAttention-2 at 35% of the H100's -> 0.35 on Hopper (H100, H200), and B200 assumed alike.
# - Matmul cap: the best bf16 matmul rate a GEMM sweep over shapes finds on the GPU, a source independent of the
#   training runs the model is checked on (benchmarks/fidelity_published.md): Stas Bekman's Maximum Achievable Matmul
#   FLOPS (ml-engineering, compute/accelerator/README.md, its v2 table: the mean of 100 timed iterations after 50
#   warm-up ones at the sweep's best shape) -> H100 SXM 794.5 of 989 TFLOP/s (80.3%, torch 2.7.0+cu126): 0.80 on H100
#   and H200 (an H200 of this project's fits 0.78-0.80 from its own sweep, benchmarks/gpu_step.md; GH200's MAMF is
#   83.6%); A100 SXM 271.2 of 312 (86.9%, torch 2.6.0+cu126): 0.87. B200 (no MAMF row): 0.75, cuBLAS at 8192^3
#   1,610 of 2,250 TFLOP/s (72%, pyptx.dev/performance). Before 2026-11-30 H100/H200 had B200's 0.75 and the A100
#   0.85, an estimate its training runs' MFU informed. Float8 matmuls: sim/float8.py FLOAT8_PEAK_SHARE.
#   calibrate --compute measures it.
# - Matmul shape: efficiency x d / (d + 128) in the smallest dim d: half the cap at d = 128, one cuBLAS tile (the
#   guide's 128x128 / 256x128 tiles), 89% of it at d = 1,024 (tile and wave quantization, NVIDIA's Matrix
#   Multiplication Background User's Guide, DU-09799-001).
# - Memory-bound ops: copy and triad kernels sustain ~90-92% of the data-sheet HBM bandwidth on H100 (published
#   STREAM-style runs: a device-to-device copy at ~3.1 of 3.35 TB/s); eager PyTorch elementwise ops (several inputs,
#   strided reads, small tensors) reach less -> 0.8 everywhere, an estimate below that ceiling.
# - Variation: Sinha et al., "Not All GPUs Are Created Equal" (SC22, arXiv:2208.11035): 8% average performance
#   variation across the same SKU's GPUs of a cluster (max 22%; outliers 1.5x slower). Read as the range of
#   thousands of GPUs, about 6.5 standard deviations: 0.08 / 6.5 = 1.2% standard deviation -> 0.012.
_MATMUL_HALF_DIM = 128.0
_MEMORY_EFFICIENCY = 0.8
_VARIATION = 0.012
_HOPPER = Compute(0.80, _MATMUL_HALF_DIM, 0.35, _MEMORY_EFFICIENCY, _VARIATION,
                  source="preset: docs/model.md#compute (FlashAttention-2/3 papers, NVIDIA matmul guide, SC22 "
                         "variability study)")
COMPUTE: dict[str, Compute] = {
    "h100": _HOPPER,
    "h100e": _HOPPER,
    "h200": _HOPPER,
    "a100": replace(_HOPPER, matmul_efficiency=0.87, attention_efficiency=0.6),
    "b200": replace(_HOPPER, matmul_efficiency=0.75),
}

# Latency: NCCL's own tuning model (src/graph/tuning.cc, ncclTunerConstantsDefaults, unchanged from 2.19 to
# 2.30), ring algorithm, SIMPLE protocol: base 8.4 us, 3.4 us per ring step over NVLink, 14.0 us per step over
# the network. For an all-gather over 2x8 / 8x8 / 32x8 H100s this gives NCCL's 70 / 297 / 1204 us.
_BASE_LAT = 8.4e-6
_NVLINK_HOP = 3.4e-6
_NET_HOP = 14e-6
# Small-message efficiency: one SIMPLE pipeline slot, NCCL's default buffer (src/init.cc DEFAULT_BUFFSIZE,
# 4 MiB) over its NCCL_STEPS (src/include/device.h, 8) = 512 KiB. A message that does not fill it leaves the
# link partly idle; collectives.py shows what this does to the time.
_HALF_BW = 512 * 1024
# Ring bus bandwidth over NVLink: nccl-tests all_gather_perf / reduce_scatter_perf busbw on one 8x H100 SXM
# node (NVLink 4 + NVSwitch) is 268.5 / 325.5 / 344.75 GB/s at 2 / 4 / 8 GPUs. busbw(k) = B * (1 - c/k) fits
# all three within 2% with B = 370 GB/s and c = 0.55; the same shape is assumed for other NVLink generations.
# The network shows no such small-ring loss in nccl-tests (c = 0).
_RING_OVERHEAD = 0.55


def _nvlink(busbw: float) -> Link:
    return Link(busbw, _BASE_LAT, _NVLINK_HOP, _HALF_BW, _RING_OVERHEAD)


def _infiniband(busbw_per_node: float) -> Link:
    return Link(busbw_per_node, _BASE_LAT, _NET_HOP, _HALF_BW, 0.0)


# Across nodes: 8 NICs per node. InfiniBand NDR is 400 Gb/s = 50 GB/s per NIC; nccl-tests reach 46-49 GB/s
# per NIC, 370-385 GB/s busbw for a full node's ring all-gather -> 380 GB/s. HDR (A100 systems): 200 Gb/s, half.
# NVLink: H100/H200 370 GB/s (above); A100 NVLink 3 nccl-tests busbw 230-240 GB/s; B200 NVLink 5 ~720 GB/s.
LINKS: dict[str, tuple[Link, Link]] = {
    "h100": (_nvlink(370e9), _infiniband(380e9)),
    "h100e": (_nvlink(370e9), _infiniband(380e9)),  # torchtitan: "400 Gb/s per GPU" RDMA network
    "h200": (_nvlink(370e9), _infiniband(380e9)),
    "a100": (_nvlink(235e9), _infiniband(190e9)),
    "b200": (_nvlink(720e9), _infiniband(380e9)),
}
# FSDP2's host overhead. There is no public per-hook figure (pytorch#173680 shows pre-forward at half of a step
# of tiny layers; an FSDP1 profile, pytorch#102434, ~454 us per _post_forward). The hook, param and op figures are
# what `fsdp-planner calibrate --overhead` measured for real FSDP2 2.13 on the fake process group on this project's
# 2-core x86 host (benchmarks/overhead.md): a GPU host adds CUDA stream, event and launch calls but usually has a
# faster CPU; calibrate on yours. Copy bandwidth: FSDP2's copy-out kernel reaches ~650-700 GB/s on H100 (pytorch PR
# #115515); other GPUs scale it by their HBM bandwidth.
_HOOK_SECONDS = 163e-6
_PARAM_SECONDS = 59.5e-6
_OP_SECONDS = 2.43e-6
_H100_COPY = 675e9


def _overhead(gpu: GPU) -> Overhead:
    return Overhead(hook_seconds=_HOOK_SECONDS, op_seconds=_OP_SECONDS, param_seconds=_PARAM_SECONDS,
                    copy_bandwidth=_H100_COPY * gpu.hbm_bandwidth / GPUS["h100"].hbm_bandwidth,
                    source="preset: calibrate --overhead on a 2-core x86 host (benchmarks/overhead.md); copy: "
                           "pytorch PR #115515")


PRESETS = tuple(GPUS)
MAX_GPUS_PER_NODE = 8


def preset_cluster(name: str, nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
    """A preset cluster (h100, h100e, h200, a100, b200) of ``nodes`` x ``gpus_per_node`` GPUs."""
    key = name.lower()
    if key not in GPUS:
        raise PlannerError(f"unknown cluster preset '{name}': use one of {', '.join(PRESETS)}")
    intra, inter = LINKS[key]
    return Cluster(
        name=f"{key}:{nodes * gpus_per_node}" if gpus_per_node == MAX_GPUS_PER_NODE or nodes == 1
        else f"{key}:{nodes}x{gpus_per_node}",
        gpu=GPUS[key],
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        intra=intra,
        inter=inter,
        nics_per_node=8,
        overhead=_overhead(GPUS[key]),
        compute=COMPUTE[key],
        host_copy_bandwidth=PCIE4_ONE_WAY if key == "a100" else PCIE5_ONE_WAY,
        **preset_cpu_optimizer(key),
    )


def preset_cpu_optimizer(key: str) -> dict[str, Any]:
    """A preset's host optimizer rate and its source (derived: see ``SERVER_HOST_CORES``)."""
    cores = SERVER_HOST_CORES[key] // MAX_GPUS_PER_NODE
    return {"cpu_optimizer_rate": CPU_ADAMW_RATE_PER_CORE * cores,
            "cpu_optimizer_source": f"preset: {cores} host cores per GPU x {CPU_ADAMW_RATE_PER_CORE / 1e6:.1f} M "
                                    "elements/s per core measured on a 2-core host (benchmarks/cpu_adamw.md)"}


CALIBRATED = "+calibrated"  # a cluster name's suffix once any of its figures was measured (calibrate)


def calibrated_name(name: str) -> str:
    """``name`` marked as calibrated, once: a simulation's header tells a calibrated file from its preset."""
    return name if name.endswith(CALIBRATED) else f"{name}{CALIBRATED}"


def with_cpu_optimizer_rate(cluster: Cluster, rate: float | None, source: str) -> Cluster:
    """``cluster`` with the host's optimizer rate the user gave (``--cpu-optimizer-rate``); None: as it is."""
    if rate is None:
        return cluster
    return replace(cluster, cpu_optimizer_rate=rate, cpu_optimizer_source=source)


_SPEC = re.compile(r"^([a-z0-9]+)(?::(\d+)(?:x(\d+))?)?$", re.ASCII)


def _shown(spec: str) -> str:
    """A spec or a name from a file for a message: its first 30 characters when long."""
    return spec if len(spec) <= 40 else f"{spec[:30]}...({len(spec)} characters)"


def _layout_example(name: str, gpus: int) -> str:
    """An example NODESxGPUS for ``gpus`` GPUs on equal nodes of at most ``MAX_GPUS_PER_NODE`` (the fewest nodes),
    for the refusal of a count that is no whole number of full nodes; "" where none is (a prime count)."""
    nodes = next((k for k in range(2, gpus) if gpus % k == 0 and gpus // k <= MAX_GPUS_PER_NODE), None)
    return f" (e.g. {name}:{nodes}x{gpus // nodes} for {gpus} GPUs on {nodes} nodes)" if nodes else ""


@checked
def parse_cluster(spec: str) -> Cluster:
    """``h100:64`` (8 nodes of 8), ``h100:4`` (4 GPUs, one node), ``a100:16x8`` (16 nodes x 8), a JSON path.

    A bare preset name means one full node of 8. Counts above 8 must fill whole 8-GPU nodes.
    """
    text = spec.strip()
    presets = ", ".join(PRESETS)
    m = _SPEC.match(text.lower())
    if m is None or m.group(1) not in GPUS:
        p = Path(text)
        if p.suffix.lower() == ".json" or p.is_file() or "/" in text:
            return Cluster.load(p)
        name, colon, _ = text.lower().partition(":")
        if colon and name in GPUS:  # a known GPU with a count that is no count ("h100:-8", "h100:1e9")
            raise PlannerError(
                f"bad GPU count in cluster '{_shown(spec)}': give a whole number of GPUs after '{name}:' (1 to "
                f"{MAX_GPUS_PER_NODE} for one node, a multiple of {MAX_GPUS_PER_NODE} for whole nodes, or NODESxGPUS)"
            )
        raise PlannerError(
            f"unknown cluster '{_shown(spec)}': give a preset NAME[:GPUS] with NAME one of {presets} "
            "(e.g. h100:64), or the path of a cluster JSON file"
        )
    name, count, per_node = m.group(1), m.group(2), m.group(3)
    if count is None:
        return preset_cluster(name)
    # digits are counted before int(): a count of thousands of digits is a typo, and int() refuses > 4300 digits
    if max(len(count), len(per_node or "")) > 9 or int(count) * int(per_node or 1) > MAX_WORLD_SIZE:
        raise PlannerError(
            f"bad GPU count in cluster '{_shown(spec)}': at most {MAX_WORLD_SIZE:,} GPUs are supported"
        )
    n = int(count)
    if per_node is not None:  # NODESxGPUS_PER_NODE
        g = int(per_node)
        if n < 1 or not 1 <= g <= MAX_GPUS_PER_NODE:
            raise PlannerError(
                f"bad cluster '{_shown(spec)}': NODESxGPUS needs at least one node of 1 to {MAX_GPUS_PER_NODE} "
                f"GPUs (presets: {presets})"
            )
        return preset_cluster(name, nodes=n, gpus_per_node=g)
    if n < 1 or (n > MAX_GPUS_PER_NODE and n % MAX_GPUS_PER_NODE):
        raise PlannerError(
            f"bad GPU count in cluster '{_shown(spec)}': give 1 to {MAX_GPUS_PER_NODE} GPUs (one node) or a "
            f"multiple of {MAX_GPUS_PER_NODE} (whole nodes), with a preset among {presets}; nodes of another "
            f"size as NODESxGPUS{_layout_example(name, n)}"
        )
    if n <= MAX_GPUS_PER_NODE:
        return preset_cluster(name, nodes=1, gpus_per_node=n)
    return preset_cluster(name, nodes=n // MAX_GPUS_PER_NODE, gpus_per_node=MAX_GPUS_PER_NODE)


def with_fits(cluster: Cluster, fits: Fits, name: str | None = None) -> Cluster:
    """A copy of ``cluster`` with ``fits`` merged over its existing ones (same (kind, N) replaced)."""
    merged: Fits = {k: dict(v) for k, v in cluster.fits.items()}
    for kind, table in fits.items():
        merged.setdefault(kind, {}).update(table)
    return replace(cluster, fits=merged, name=name or cluster.name)


def with_nodes(cluster: Cluster, nodes: int) -> Cluster:
    """``cluster`` with ``nodes`` nodes of its GPUs (a bare preset is one node of 8), named as the preset would be."""
    base = cluster.name.split(":")[0]
    gpus = cluster.gpus_per_node
    name = f"{base}:{nodes * gpus}" if gpus == MAX_GPUS_PER_NODE or nodes == 1 else f"{base}:{nodes}x{gpus}"
    return replace(cluster, nodes=nodes, name=name)
