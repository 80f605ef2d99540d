"""torch.profiler's Chrome (Kineto) JSON traces, read as data: each ``ProfilerStep#`` range's time, its ops and
kernels by class, its collectives by kind and size, FSDP2's ``FSDP::`` ranges, and its phases.

What a trace holds, and what is read of it (the schema ``tests/kineto_fixture.py`` writes to):
- ``traceEvents``: complete events (``"ph": "X"``) with ``name``, ``cat``, ``ts`` and ``dur`` in microseconds,
  ``pid``/``tid`` and ``args``; everything else (metadata, flow arrows, instants) is skipped.
- ``ProfilerStep#N`` (``cat`` ``user_annotation``, on the training thread): one step each; ``prof.step()`` marks them.
  Their copies on the GPU's timeline (``gpu_user_annotation``) are not steps.
- CPU ops (``cpu_op``): on a CPU rank the outermost ``aten::`` op is one op of the step, classed by name
  (``op_class``); on a GPU the kernels (``kernel``) are, classed by kernel name, and a CPU trace's ops are ignored.
- Collectives: on GPUs NCCL kernels (a name with ``nccl``), sized by their own ``args`` where torch (2.3 on) copies
  ``record_param_comms``'s there, else by the ``record_param_comms`` CPU op whose ``External id`` the kernel
  carries (its ``args``: ``Collective name``, ``In msg nelems``, ``Out msg nelems``, ``Group size``, ``dtype``,
  the dtype as ``ScalarType`` names it: ``Float``, ``BFloat16``, ``Long``); a collective FSDP2 does not issue (a
  DDP job's buffer broadcast, a send/recv) is read, timed and drawn as communication, not fitted (``Step``'s
  ``other_collectives``); on gloo the training thread's ``c10d::`` op (its ``Input Dims`` and ``Input type``) runs
  as the next ``gloo:`` range on a gloo thread: the collective lasts from the first's start to the second's end.
  Sizes are nccl-tests': an all-gather's output, a reduce-scatter's input, an all-reduce's buffer.
- ``FSDP::`` ranges (FSDP2's ``record_function``s): its host work; ``FSDP::pre_backward`` or the autograd engine's
  first ``autograd::engine::evaluate_function`` range (on any thread: the engine runs CUDA backward on a thread of
  its own) starts backward; ``Optimizer.step#`` ranges are the optimizer step: the ops and kernels launched
  in them are its phase, not the model's ops (the simulator prices the optimizer apart). A step without one (a
  profile of forward and backward alone, as ``verify --profile`` records) is compared so.
- ``distributedInfo``'s ``rank`` and ``world_size``: numbers, or decimal strings (as some Kineto versions write).

Bounds: the file at most ``MAX_TRACE_BYTES`` (gzip too, inflated), ``MAX_EVENTS`` events, JSON only (never
pickle); numbers beyond ``MAX_MICROSECONDS``, non-finite ones (``NaN``, ``1e999``) and integers of more than
``MAX_INT_DIGITS`` digits are refused, as is nesting deeper than Python's parser goes. Every refusal is one
``PlannerError`` line that names the file.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, printable
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.report.against import covered
from fsdp_planner.userfiles import DuplicateKey, check_regular_file, read_bytes, shown_json, unique_keys

MAX_SHOWN_PATH = 120  # a trace's path longer than this is named by its last two parts
MAX_TRACE_BYTES = 512 << 20  # a few steps of a large job's GPU trace are 100-500 MiB; parsed, ~10x that in memory
MAX_EVENTS = 20_000_000
MAX_INT_DIGITS = 20  # ids, sizes and nanosecond timestamps fit; a longer integer is not a profiler's
MAX_MICROSECONDS = 1e17  # Unix-epoch microseconds (older Kineto writes them: 1.7e15 in 2024) up to the year 5000
MAX_NAME = 1000  # characters of a name kept
MAX_STEPS = 10_000
STEP_OVERLAP_US = 1.0  # how far a ProfilerStep# range may start before the one before ends (rounding of 'ts')


class OpClass(Enum):
    """What a measured op or kernel is, as the simulator's compute model tells them apart (``sim/compute.py``)."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    MEMORY = "memory-bound"


# the outermost aten op of a CPU step, by name (composites included: aten::linear runs a matmul)
CPU_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::addbmm", "aten::einsum", "aten::_scaled_mm", "aten::conv2d", "aten::convolution"}
# flash-linear-attention's gated delta rule and KDA kernels (fla/ops/gated_delta_rule, fla/ops/kda, fla/ops/common;
# KDA's output through GLA's), what the simulator times at a share of the attention efficiency; their backward
# recomputes chunk states with forward kernels whether or not the job checkpoints (``linear_attention.py``)
LINEAR_ATTENTION_WORDS = ("delta_rule", "chunk_fwd_kernel_o", "chunk_bwd_kernel_", "wy_repr", "recompute_w_u",
                          "scaled_dot_kkt", "solve_tril", "merge_16x16", "chunk_kda_", "chunk_gla_fwd_kernel_o")
ATTENTION_WORDS = ("scaled_dot_product", "flash", "attention", "fmha", "attn", "efficient_attention",
                   *LINEAR_ATTENTION_WORDS)
# (not "conv" alone: cuDNN's attention backward converts dQ in "cudnn::fusion::convert_dq_to_16bits", a copy)
GPU_MATMUL_WORDS = ("gemm", "cutlass", "xmma", "cublas", "matmul", "gemv", "sm90_", "sm80_", "ampere_", "hopper_",
                    "wgmma", "convolution", "convolve", "conv1d", "conv2d", "conv3d", "conv_depthwise",
                    # cuBLAS's nvjet kernels of every architecture (an H100's "nvjet_sm90_tst_...", a B200's sm100),
                    # inductor's max-autotune matmul templates ("triton_tem_fused_mm_0"; flex attention's is
                    # attention, matched first)
                    "nvjet", "triton_tem_",
                    # mamba_ssm's scan kernels (mamba_ssm/ops/triton/ssd_*.py), which the simulator times as one op
                    # of FLOPs (``mamba_scan.py``): the matmul class of a trace's ops
                    "_chunk_scan_", "_chunk_state_", "_bmm_chunk_", "_state_passing_")
GLOO_KINDS = {"c10d::_allgather_base_": CollectiveKind.ALL_GATHER, "c10d::allgather_": CollectiveKind.ALL_GATHER,
              "c10d::allgather_into_tensor_coalesced_": CollectiveKind.ALL_GATHER,
              "c10d::_reduce_scatter_base_": CollectiveKind.REDUCE_SCATTER,
              "c10d::reduce_scatter_": CollectiveKind.REDUCE_SCATTER,
              "c10d::reduce_scatter_tensor_coalesced_": CollectiveKind.REDUCE_SCATTER,
              "c10d::allreduce_": CollectiveKind.ALL_REDUCE}
# Kineto (seen in torch 2.11's traces on an H200) also draws each ``record_function`` range, ``ProfilerStep#``
# too, on the GPU's timeline, spanning the kernels it launched: not a step of the training thread
GPU_RANGES = ("gpu_user_annotation",)
ITEMSIZE = {"float": 4, "c10::bfloat16": 2, "c10::half": 2, "double": 8, "bfloat16": 2, "half": 2, "float16": 2,
            "float32": 4, "float64": 8, "int": 4, "long int": 8, "int64": 8, "int32": 4, "c10::float8_e4m3fn": 1,
            "float8_e4m3fn": 1, "unsigned char": 1, "signed char": 1, "bool": 1, "byte": 1, "long": 8, "short": 2,
            "char": 1, "float8_e5m2": 1, "c10::float8_e5m2": 1}


@dataclass(frozen=True)
class Span:
    """One complete event: seconds from the start of its step."""

    name: str
    start: float
    end: float
    lane: str  # "compute", "communication" or "host" (FSDP2's ranges)


@dataclass(frozen=True)
class Collective:
    kind: CollectiveKind
    nbytes: int  # nccl-tests' size (module docstring)
    ranks: int
    seconds: float


@dataclass(frozen=True)
class OtherCollective:
    """A collective FSDP2 does not issue (a broadcast, a send/recv, an all-to-all): timed as communication, not
    fitted; ``name`` as ``record_param_comms`` writes it."""

    name: str
    nbytes: int  # the larger of its input and output
    ranks: int
    seconds: float


Communication = Collective | OtherCollective


@dataclass(frozen=True)
class Step:
    """One ``ProfilerStep#`` of a trace, everything in seconds."""

    seconds: float
    op_seconds: dict[OpClass, float]
    op_counts: dict[OpClass, int]
    collectives: tuple[Collective, ...]
    fsdp_seconds: float  # FSDP2's host ranges: on a CPU rank less the collectives and ops inside them; on a GPU
    # all of them (the host runs ahead of the kernels: its time shows only where the GPU then waits)
    forward: float  # step start to backward's start
    backward: float  # to backward's last op
    optimizer: float
    exposed_comm: float  # collectives while no compute runs
    idle: float  # nothing of the above runs
    other_collectives: tuple[OtherCollective, ...] = ()
    spans: tuple[Span, ...] = field(default=(), repr=False)
    matmul_flops: int | None = None  # a CPU step's matmuls' FLOPs from their ops' Input Dims (record_shapes); None
    # where a matmul's are not recorded or not read, and on a GPU

    @property
    def compute_seconds(self) -> float:
        return sum(self.op_seconds.values())

    @property
    def ran_optimizer(self) -> bool:
        """Whether the step holds the optimizer step (an ``Optimizer.step#`` range)."""
        return self.optimizer > 0


@dataclass(frozen=True)
class MeasuredTrace:
    path: str
    device: str  # "cuda" or "cpu": where its ops ran
    rank: int
    world: int
    steps: tuple[Step, ...]
    backend: str = ""  # distributedInfo's ("nccl", "gloo"; "fake": one device running a larger job's step, whose
    # collectives run nowhere)

    @property
    def step_seconds(self) -> float:
        """The median step."""
        return statistics.median(s.seconds for s in self.steps)

    def median_step(self) -> Step:
        """The step of median time (the lower middle of an even count): one real step, its spans whole."""
        ordered = sorted(self.steps, key=lambda s: s.seconds)
        return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True, slots=True)  # (millions in a large job's trace)
class _Event:
    name: str
    cat: str
    ts: float  # microseconds
    dur: float
    tid: str
    args: Mapping[str, Any]

    @property
    def end(self) -> float:
        return self.ts + self.dur


def read_trace(path: str | Path) -> MeasuredTrace:
    """The trace at ``path`` (``.json`` or ``.json.gz``), read and checked (module docstring)."""
    p = Path(path)
    shown = str(p) if len(str(p)) <= MAX_SHOWN_PATH else str(Path(p.parent.name, p.name))  # a long one's end
    label = f"trace file '{printable(shown if len(shown) <= MAX_SHOWN_PATH else cut_short(shown))}'"
    if p.is_dir():
        raise PlannerError(f"{label} is a directory: give the trace files in it (verify --profile writes rankR.json)")
    check_regular_file(p, label)
    raw = read_bytes(p, label, "a torch.profiler Chrome trace (JSON)", MAX_TRACE_BYTES)
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(raw, label)
    text = _text(raw, label)
    del raw  # (its text is all that is read: a large trace's bytes are not held beside it)
    return parse_text(text, label, str(path))


def _gunzip(raw: bytes, label: str) -> bytes:
    import io
    import zlib

    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as f:
            out = f.read(MAX_TRACE_BYTES + 1)
    except (OSError, EOFError) as e:
        raise PlannerError(f"{label} is not a whole gzip file ({e}): a truncated trace?") from None
    except zlib.error as e:  # a gzip header before data deflate cannot read
        raise PlannerError(f"{label} is not a gzip file its header says it is ({e}): a damaged trace") from None
    if len(out) > MAX_TRACE_BYTES:
        raise PlannerError(f"{label} inflates past {MAX_TRACE_BYTES >> 20:,} MiB: not read")
    return out


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError("integer too long")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not a number a profiler writes")


# read of an event's args: the rest (a kernel's grid, a CPU op's sequence number, ...) is dropped as it is read
ARGS_READ = frozenset({"correlation", "External id", "Collective name", "In msg nelems", "Out msg nelems",
                       "Group size", "dtype", "Input Dims", "Input type"})


@dataclass
class _Events:
    """A trace's ``traceEvents``, taken one at a time as the reader reaches them (a 197 MB trace parsed whole took
    2.6 GB): its complete events kept as ``_Event``, the rest counted, and what a refusal names."""

    label: str
    complete: list[_Event] = field(default_factory=list)
    count: int = 0
    damaged: int = 0
    first_damage: str = ""
    first_step: dict | None = None  # the first ProfilerStep# event, and the first not on the GPU's timeline
    first_host_step: dict | None = None

    def add(self, e: Any) -> None:
        self.count += 1
        if self.count > MAX_EVENTS:
            raise PlannerError(f"{self.label} has more than {MAX_EVENTS:,} events: profile fewer steps")
        if not isinstance(e, dict):
            return
        if isinstance(e.get("name"), str) and e["name"].startswith("ProfilerStep#"):
            self.first_step = self.first_step or e
            if self.first_host_step is None and e.get("cat") not in GPU_RANGES:
                self.first_host_step = e
        if e.get("ph") != "X":
            return
        damage = _damage(e)
        if damage is not None:
            self.damaged += 1
            self.first_damage = self.first_damage or damage
            return
        self.complete.append(_event(e))


class _Stream:
    """JSON read a value at a time with ``json``'s own scanner: the top-level object's ``traceEvents`` list goes
    to a callback element by element, never held whole; every other value is read as ``json.loads`` reads it
    (numbers bounded, a key twice refused)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.decoder = json.JSONDecoder(parse_int=_bounded_int, parse_float=_finite_float,
                                        parse_constant=_no_constant, object_pairs_hook=unique_keys)

    def skip(self, i: int) -> int:
        return json.decoder.WHITESPACE.match(self.text, i).end()

    def expect(self, i: int, char: str, what: str) -> int:
        """The position after ``char`` (and whitespace) at ``i``; json's own error otherwise."""
        if not self.text.startswith(char, i):
            raise json.JSONDecodeError(f"Expecting {what}", self.text, i)
        return self.skip(i + 1)

    def document(self, on_event: Callable[[Any], None]) -> Any:
        """The top-level value, a ``traceEvents`` list in it replaced by ``EVENTS_READ`` (each element given to
        ``on_event``); a top-level list is the events."""
        i = self.skip(0)
        if self.text.startswith("[", i):
            value, i = EVENTS_READ, self.array(i, on_event)
        elif self.text.startswith("{", i):
            value, i = self.top_object(i, on_event)
        else:
            value, i = self.decoder.raw_decode(self.text, i)
        if self.skip(i) != len(self.text):
            raise json.JSONDecodeError("Extra data", self.text, self.skip(i))
        return value

    def top_object(self, i: int, on_event: Callable[[Any], None]) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        i = self.skip(i + 1)
        if self.text.startswith("}", i):
            return out, i + 1
        while True:
            if not self.text.startswith('"', i):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", self.text, i)
            key, i = json.decoder.scanstring(self.text, i + 1)
            if key in out:  # (two 'traceEvents': json.loads keeps the last, silently)
                raise DuplicateKey(key)
            i = self.expect(self.skip(i), ":", "':' delimiter")
            if key == "traceEvents" and self.text.startswith("[", i):
                out[key], i = EVENTS_READ, self.array(i, on_event)
            else:
                out[key], i = self.decoder.raw_decode(self.text, i)
            i = self.skip(i)
            if self.text.startswith("}", i):
                return out, i + 1
            i = self.expect(i, ",", "',' delimiter")

    def array(self, i: int, on_event: Callable[[Any], None]) -> int:
        i = self.skip(i + 1)
        if self.text.startswith("]", i):
            return i + 1
        while True:
            value, i = self.decoder.raw_decode(self.text, i)
            on_event(value)
            i = self.skip(i)
            if self.text.startswith("]", i):
                return i + 1
            i = self.expect(i, ",", "',' delimiter")


EVENTS_READ = ("traceEvents",)  # in place of the list the reader gave to its callback


def _text(raw: bytes, label: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # (a BOM an editor wrote: not the trace's)
    except UnicodeDecodeError:
        raise PlannerError(f"{label} is not text: expected a torch.profiler Chrome trace (JSON)") from None


def parse_json_trace(text: str, label: str, on_event: Callable[[Any], None]) -> Any:
    """The trace's JSON with bounded numbers (module docstring), its events given to ``on_event`` one at a time
    (``_Stream``); one line for anything else."""
    try:
        return _Stream(text).document(on_event)
    except DuplicateKey as e:
        detail = f"has the key {shown_json(e.key)} twice in one object, which no profiler writes: an edited trace"
    except json.JSONDecodeError as e:
        end = " (truncated?)" if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string") else ""
        detail = f"is not valid JSON{end}: {e.msg.removesuffix(' at')} at line {e.lineno} column {e.colno}"
    except RecursionError:
        detail = "is nested too deeply to be a profiler's trace"
    except ValueError as e:
        detail = f"holds a value no profiler writes ({e})"
    raise PlannerError(f"{label} {detail}") from None


def parse_trace(raw: bytes, label: str, path: str = "") -> MeasuredTrace:
    """A trace from its bytes (``read_trace``)."""
    return parse_text(_text(raw, label), label, path)


def parse_text(text: str, label: str, path: str = "") -> MeasuredTrace:
    """A trace from its text (``read_trace``)."""
    read = _Events(label)
    data = parse_json_trace(text, label, read.add)
    if data is EVENTS_READ:
        data = {"traceEvents": data}
    if not isinstance(data, dict) or data.get("traceEvents") is not EVENTS_READ:
        raise PlannerError(f"{label} is not a Chrome trace: expected a JSON object with a 'traceEvents' list "
                           "(torch.profiler's export_chrome_trace)")
    events = read.complete
    marks = _step_marks(read, label)
    info = data.get("distributedInfo") if isinstance(data.get("distributedInfo"), dict) else {}
    world = _int_field(info, "world_size", 1, label)
    rank = _int_field(info, "rank", 0, label)
    gpu = any(e.cat == "kernel" for e in events)
    timeline = _Timeline(events)
    steps = tuple(_step(timeline, marks, i, world, gpu, label) for i in range(len(marks)))
    if "world_size" not in info and any(s.collectives for s in steps):
        raise PlannerError(f"{label} has no distributedInfo.world_size, and its steps run collectives: over how many "
                           "ranks is not said (torch.profiler writes it for a distributed job: give its trace as "
                           "exported)")
    backend = info.get("backend") if isinstance(info.get("backend"), str) else ""
    return MeasuredTrace(path, "cuda" if gpu else "cpu", rank, world, steps, backend[:100])


def _step_marks(read: _Events, label: str) -> list[_Event]:
    """The trace's ``ProfilerStep#`` ranges in time order, refused where none is readable, where a complete event
    is damaged, or where they overlap (a profiler's follow one another)."""
    marks = sorted((e for e in read.complete if e.name.startswith("ProfilerStep#") and e.cat not in GPU_RANGES),
                   key=lambda e: e.ts)
    if not marks:
        # (the host's ranges are the steps: a GPU's copies of them, gpu_user_annotation, are not)
        step = read.first_host_step
        if step is not None:
            why = "its 'ph' is not 'X' (a complete event)" if step.get("ph") != "X" else _damage(step)
            raise PlannerError(f"{label} has ProfilerStep# ranges but none a profiler writes (the first: {why}): "
                               "an edited or damaged trace")
        if read.first_step is not None:
            raise PlannerError(f"{label} has ProfilerStep# ranges on the GPU only (category "
                               f"{shown_json(read.first_step.get('cat'))}), not the host's a profiler writes beside "
                               "them: an edited or damaged trace")
        raise PlannerError(f"{label} has no ProfilerStep# ranges: not a torch.profiler trace of training steps "
                           "(profile with a schedule and call prof.step() once a step)")
    if read.damaged:  # (dropped, an op's time went missing from the steps, which then read as another job's)
        raise PlannerError(f"{label} has {read.damaged:,} complete event{'s' if read.damaged > 1 else ''} ('ph': "
                           f"'X') a profiler would not write (the first: {read.first_damage}): an edited or damaged "
                           "trace")
    if len(marks) > MAX_STEPS:
        raise PlannerError(f"{label} has {len(marks):,} steps, over the {MAX_STEPS:,} read")
    overlapping = next((i for i in range(1, len(marks)) if marks[i].ts < marks[i - 1].ts + marks[i - 1].dur
                        - STEP_OVERLAP_US), None)
    if overlapping is not None:
        names = (printable(cut_short(m.name)) for m in marks[overlapping - 1:overlapping + 1])
        raise PlannerError(f"{label} has steps {' and '.join(names)} that overlap, where a profiler's "
                           "ProfilerStep# ranges follow one another: an edited or damaged trace")
    return marks


def _int_field(info: dict, key: str, default: int, label: str) -> int:
    value = info.get(key, default)
    if isinstance(value, str) and value.isdecimal() and len(value) <= 7:  # some Kineto versions write "0"
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1_000_000:
        raise PlannerError(f"{label}: distributedInfo.{key} must be a whole number from 0 to 1,000,000")
    return value


def _event(e: dict) -> _Event:
    """A complete event that ``_damage`` passed, as kept: its names interned (a kernel's repeat thousands of
    times) and its args cut to what is read (``ARGS_READ``)."""
    cat = e.get("cat")
    args = {k: v for k, v in e.get("args", {}).items() if k in ARGS_READ}
    return _Event(sys.intern(e["name"][:MAX_NAME]), sys.intern(cat) if isinstance(cat, str) else "", float(e["ts"]),
                  float(e.get("dur", 0)), sys.intern(str(e.get("tid", ""))[:100]), args or NO_ARGS)


NO_ARGS = MappingProxyType({})  # (one for every event none of whose args is read)


def _damage(e: dict) -> str | None:
    """What keeps a complete event from being read, said as a profiler writes it (None: nothing)."""
    ts, dur = e.get("ts"), e.get("dur", 0)
    if not isinstance(e.get("name"), str):
        return "its 'name' is not a string"
    if not _time(ts):
        return f"its 'ts' is not a number of microseconds, at most {MAX_MICROSECONDS:g}"
    if not _time(dur) or dur < 0:
        return f"its 'dur' is not a non-negative number of microseconds, at most {MAX_MICROSECONDS:g}"
    if not isinstance(e.get("args", {}), dict):  # (damaged: its correlation and sizes gone, it read as another op)
        return "its 'args' is not an object"
    return None


def _time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_MICROSECONDS


# how attention kernels' names say the forward's (cuDNN's "fprop", FlashAttention's "flash_fwd", xformers'
# "fmha_cutlassF") apart from the backward's ("bprop", "bwd", "cutlassB")
FORWARD_KERNEL_WORDS = ("fprop", "fwd", "forward", "cutlassf")
BACKWARD_KERNEL_WORDS = ("bprop", "bwd", "backward", "cutlassb")


def forward_kernel(name: str) -> bool:
    """Whether a softmax attention kernel's name says it is a forward one (``FORWARD_KERNEL_WORDS``); never a
    linear attention kernel's, whose backward runs forward ones of its own."""
    low = name.lower()
    return any(w in low for w in FORWARD_KERNEL_WORDS) and not any(w in low for w in BACKWARD_KERNEL_WORDS) and \
        not any(w in low for w in LINEAR_ATTENTION_WORDS)


def op_class(name: str, gpu: bool) -> OpClass:
    """A CPU op's or a GPU kernel's class, by its name."""
    low = name.lower()
    if any(w in low for w in ATTENTION_WORDS):
        return OpClass.ATTENTION
    if (gpu and any(w in low for w in GPU_MATMUL_WORDS)) or (not gpu and name in CPU_MATMUL):
        return OpClass.MATMUL
    return OpClass.MEMORY


KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


class _Timeline:
    """A trace's complete events indexed by when they start, and its GPU work by when it was launched: a step's
    are found by bisection, not by a scan of the whole trace for each step (180 steps of a real trace took 71 s).
    Each lookup gives its events in the file's order, as the scans did (a step's n-th record_param_comms op sizes
    its n-th NCCL kernel)."""

    def __init__(self, events: list[_Event]) -> None:
        self.events = events
        self.by_start = sorted(range(len(events)), key=lambda i: events[i].ts)
        self.starts = [events[i].ts for i in self.by_start]
        # a kernel's launch: the host call with its correlation id (the last such in the file, as a dict of them
        # keeps it); a kernel with none is taken at its own start
        self.launches = {e.args.get("correlation"): e.ts for e in events
                         if e.cat in LAUNCH_CATS and isinstance(e.args.get("correlation"), int)}
        launched = {i: self.launch(e, e.ts) for i, e in enumerate(events) if e.cat in KERNEL_CATS}
        self.by_launch = sorted(launched, key=launched.__getitem__)
        self.launch_times = [launched[i] for i in self.by_launch]

    def launch(self, e: _Event, default: float) -> float:
        """When the host launched GPU work ``e`` (``default`` where no launch has its correlation id, or the id is
        not a number: a trace's args are data)."""
        correlation = e.args.get("correlation")
        return self.launches.get(correlation, default) if isinstance(correlation, int) else default

    def starting(self, start: float, end: float) -> list[_Event]:
        """The events that start from ``start`` to ``end``, both included."""
        lo, hi = bisect.bisect_left(self.starts, start), bisect.bisect_right(self.starts, end)
        return [self.events[i] for i in sorted(self.by_start[lo:hi])]

    def within(self, start: float, end: float) -> list[_Event]:
        """The events from ``start`` to ``end`` (an end a clock's rounding later still in)."""
        return [e for e in self.starting(start, end + 1e-3) if e.end <= end + 1e-3]

    def launched(self, start: float, end: float) -> list[_Event]:
        """The GPU's kernels, copies and sets launched from ``start`` to ``end``."""
        lo, hi = bisect.bisect_left(self.launch_times, start), bisect.bisect_right(self.launch_times, end)
        return [self.events[i] for i in sorted(self.by_launch[lo:hi])]


def _outermost(events: list[_Event]) -> list[_Event]:
    """The events no other of ``events`` contains (one thread's, sorted by start)."""
    out: list[_Event] = []
    reach = -math.inf
    for e in sorted(events, key=lambda e: (e.ts, -e.dur)):
        if e.ts >= reach - 1e-3:  # (a partial overlap is a clock's rounding: counted once, in the first)
            out.append(e)
            reach = e.end
    return out


Interval = tuple[float, float]


BACKWARD_RANGES = ("autograd::engine::evaluate_function", "FSDP::pre_backward", "FSDP::post_backward",
                   "FSDP::root_post_backward")


def _step(timeline: _Timeline, marks: list[_Event], i: int, world: int, gpu: bool, label: str) -> Step:
    """Step ``i`` of the trace: its ProfilerStep range ``marks[i]``, its ops or kernels and its collectives."""
    mark = marks[i]
    start, end = mark.ts, mark.end
    during = timeline.within(start, end)
    main = [e for e in during if e.tid == mark.tid and e is not mark]
    fsdp = _outermost([e for e in main if e.name.startswith("FSDP::")])
    backward = [(e.ts, e.end) for e in during  # any thread (the engine's), not the GPU timeline's copies
                if e.name.startswith(BACKWARD_RANGES) and e.cat not in GPU_RANGES]
    stepping = [(e.ts, e.end) for e in main if e.name.startswith("Optimizer.step#")]
    if gpu:
        ops, comms, end, backward = _gpu_work(timeline, (start, end), world, label, (backward, stepping))
    else:
        in_optimizer = _inside(stepping)
        ops = [(e, None if in_optimizer(e.ts) else op_class(e.name, False))
               for e in _outermost([e for e in main if e.name.startswith(("aten::", "FSDP::"))])
               if e.name.startswith("aten::")]
        comms = _gloo_collectives(main, timeline, start, end + (marks[i + 1].ts - end if i + 1 < len(marks) else 0),
                                  world, label)
    spans = ([Span(e.name, e.ts, e.end, "compute") for e, _ in ops]
             + [Span(c.kind.value if isinstance(c, Collective) else c.name, a, b, "communication")
                for c, a, b in comms]
             + [Span(e.name, e.ts, e.end, "host") for e in fsdp])
    spans = [Span(sp.name, (sp.start - start) / 1e6, (sp.end - start) / 1e6, sp.lane) for sp in spans]
    optimizer = covered(stepping)
    step = _measured_step(spans, ops, [c for c, _, _ in comms], (start, end), gpu, (backward, optimizer))
    if gpu:
        return step
    flops = [matmul_flops(e.name, e.args.get("Input Dims")) for e, kind in ops if kind is OpClass.MATMUL]
    return replace(step, matmul_flops=None if None in flops else sum(flops))  # type: ignore[arg-type]


def _dims(value: Any) -> list[list[int]] | None:
    if not isinstance(value, list) or not all(isinstance(d, list) and all(_count(x) for x in d) for d in value):
        return None
    return value


# the positions of a CPU matmul op's two multiplied operands among its Input Dims (addmm and baddbmm: the added one
# first)
MATMUL_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2),
                   "aten::linear": (0, 1)}


def matmul_flops(name: str, dims: Any) -> int | None:
    """FLOPs of a CPU matmul op from its ``Input Dims`` (2 per multiply-add, as torch's FlopCounterMode counts):
    mm, addmm, linear, bmm and baddbmm; None for another op or dims that do not read as one."""
    d = _dims(dims)
    if d is None:
        return None
    if name not in MATMUL_OPERANDS or len(d) <= max(MATMUL_OPERANDS[name]):
        return None
    a, b = (d[i] for i in MATMUL_OPERANDS[name])
    if name == "aten::linear" and a and len(b) == 2 and a[-1] == b[1]:
        return 2 * math.prod(a) * b[0]
    if name in ("aten::mm", "aten::addmm") and len(a) == 2 and len(b) == 2 and a[1] == b[0]:
        return 2 * a[0] * a[1] * b[1]
    if name in ("aten::bmm", "aten::baddbmm") and len(a) == 3 and len(b) == 3 and a[2] == b[1]:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return None


def _measured_step(spans: list[Span], ops: list[tuple[_Event, OpClass | None]], comms: list[Communication],
                   bounds: Interval, gpu: bool, phases: tuple[list[Interval], float]) -> Step:
    """The step from its parts; ``phases``: backward's intervals (CPU ranges, or on a GPU the kernels they
    launched) and the optimizer's time. An op of class None is the optimizer step's: compute in the step's lanes,
    in no class's sum."""
    start, end = bounds
    backward, optimizer = phases
    seconds: dict[OpClass, float] = dict.fromkeys(OpClass, 0.0)
    counts: dict[OpClass, int] = dict.fromkeys(OpClass, 0)
    for e, kind in ops:
        if kind is None:
            continue
        seconds[kind] += e.dur / 1e6
        counts[kind] += 1
    lanes = {lane: [(s.start, s.end) for s in spans if s.lane == lane] for lane in ("compute", "communication",
                                                                                    "host")}
    compute = covered(lanes["compute"])
    busy = covered(lanes["compute"] + lanes["communication"])
    everything = covered(lanes["compute"] + lanes["communication"] + lanes["host"])
    bwd_start = min((a for a, _ in backward), default=end)
    bwd_end = max((b for _, b in backward), default=end)
    step = (end - start) / 1e6
    return Step(step, seconds, counts, tuple(c for c in comms if isinstance(c, Collective)),
                covered(lanes["host"]) if gpu else everything - busy, (bwd_start - start) / 1e6,
                (bwd_end - bwd_start) / 1e6, optimizer / 1e6, busy - compute,
                max(0.0, step - (busy if gpu else everything)),
                tuple(c for c in comms if isinstance(c, OtherCollective)), tuple(spans))


def _gpu_work(timeline: _Timeline, bounds: Interval, world: int, label: str,
              ranges: tuple[list[Interval], list[Interval]]
              ) -> tuple[list[tuple[_Event, OpClass | None]], list[tuple[Communication, float, float]], float,
                         list[Interval]]:
    """The step's kernels (those launched inside it) as ops and collectives, the step's end (its CPU range's, or
    its last kernel's) and the kernels launched inside backward's CPU ranges (``ranges``: backward's, then the
    optimizer step's, whose kernels are its phase, not ops of the model: class None, as the simulator prices it
    apart)."""
    start, end = bounds
    backward, stepping = ranges
    kernels = sorted(timeline.launched(start, end), key=lambda e: e.ts)
    comms = [e for e in kernels if "nccl" in e.name.lower()]
    sizes = [e for e in timeline.starting(start, end) if e.name == "record_param_comms"
             and e.args.get("Collective name") != "wait"]  # a work's wait launches no kernel
    by_id = {e.args.get("External id"): e for e in sizes}
    collectives = []
    for k, kernel in enumerate(comms):
        record = by_id.get(kernel.args.get("External id")) or (sizes[k] if k < len(sizes) else None)
        args = kernel.args if "Collective name" in kernel.args else record.args if record else None
        if args is None:
            raise PlannerError(f"{label}: NCCL kernel '{printable(cut_short(kernel.name))}' has no "
                               "record_param_comms op to size it (profile with record_shapes=True)")
        collectives.append((_nccl_collective(args, kernel, world, label), kernel.ts, kernel.end))
    in_optimizer = _inside(stepping)
    ops = [(e, None if in_optimizer(timeline.launch(e, -1.0)) else op_class(e.name, True))
           for e in kernels if "nccl" not in e.name.lower()]
    inside = _inside(backward)
    launched_in = [(e.ts, e.end) for e, _ in ops if inside(timeline.launch(e, -1.0))]
    return ops, collectives, max([end, *(e.end for e in kernels)]), launched_in


def _inside(intervals: list[Interval]) -> Callable[[float], bool]:
    """Whether a time falls in any of ``intervals`` (merged, then bisected: a trace has 100,000s of kernels)."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]

    def test(t: float) -> bool:
        k = bisect.bisect_right(starts, t) - 1
        return k >= 0 and t <= merged[k][1]

    return test


NCCL_NAMES = (("reduce_scatter", CollectiveKind.REDUCE_SCATTER), ("reducescatter", CollectiveKind.REDUCE_SCATTER),
              ("allgather", CollectiveKind.ALL_GATHER), ("all_gather", CollectiveKind.ALL_GATHER),
              ("allreduce", CollectiveKind.ALL_REDUCE), ("all_reduce", CollectiveKind.ALL_REDUCE))


def _nccl_collective(args: Mapping[str, Any], kernel: _Event, world: int, label: str) -> Communication:
    """The collective ``args`` (``record_param_comms``'s) size, timed by its kernel."""
    name = str(args.get("Collective name", "")).lower()
    kind = next((k for word, k in NCCL_NAMES if word in name), None)
    nelems = [args.get("In msg nelems"), args.get("Out msg nelems")]
    ranks = args.get("Group size", world)
    itemsize = ITEMSIZE.get(str(args.get("dtype", "")).lower())
    if not name:
        raise PlannerError(f"{label}: NCCL kernel '{printable(cut_short(kernel.name))}' has no collective name or "
                           "size: its record_param_comms op records none (older torch versions did not): profile "
                           "with a newer torch")
    if itemsize is None or not all(_count(v) for v in (*nelems, ranks)):
        raise PlannerError(f"{label}: a record_param_comms op ({printable(cut_short(name))}) lacks a known "
                           "dtype, message size or group size")
    if kind is None:
        return OtherCollective(printable(cut_short(name)), max(nelems) * itemsize, int(ranks), kernel.dur / 1e6)
    full = nelems[1] if kind is CollectiveKind.ALL_GATHER else nelems[0]
    return Collective(kind, int(full) * itemsize, int(ranks), kernel.dur / 1e6)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 50


def _gloo_collectives(main: list[_Event], timeline: _Timeline, start: float, end: float, world: int,
                      label: str) -> list[tuple[Collective, float, float]]:
    """The training thread's c10d collectives, each lasting until the gloo range that ran it ends (the next one of
    its kind to start on a gloo thread: gloo runs them in order)."""
    calls = sorted((e for e in main if e.name in GLOO_KINDS), key=lambda e: e.ts)
    runs = sorted((e for e in timeline.starting(start, end) if e.name.startswith("gloo:")
                   and e.name != "gloo:barrier"), key=lambda e: e.ts)
    out, used = [], 0
    for call in calls:
        while used < len(runs) and runs[used].ts < call.ts - 1e-3:
            used += 1
        finish = runs[used].end if used < len(runs) else call.end
        used += 1
        kind = GLOO_KINDS[call.name]
        out.append((Collective(kind, _gloo_bytes(call, kind, world, label), world, (finish - call.ts) / 1e6),
                    call.ts, finish))
    return out


def _gloo_bytes(call: _Event, kind: CollectiveKind, world: int, label: str) -> int:
    """nccl-tests' size of a c10d op from its ``Input Dims`` (output first) and ``Input type``."""
    dims, types = call.args.get("Input Dims"), call.args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or not dims or not types:
        raise PlannerError(f"{label}: collective {call.name} has no Input Dims (profile with record_shapes=True)")
    if str(types[0]) == "TensorList":  # (gloo's list and coalesced collectives: no dtype in the trace)
        raise PlannerError(f"{label}: collective {call.name} takes a list of tensors (FSDP2's HSDP all-reduce and "
                           "TP's coalesced collectives on gloo), whose dtype torch's profiler does not write: "
                           "calibrate from a trace of the job's plan without HSDP or TP (its all-gathers and "
                           "reduce-scatters carry theirs), then predict this plan with the cluster it writes")
    sizes = [math.prod(d) for d in dims[:2] if isinstance(d, list) and all(_count(x) for x in d)]
    itemsize = ITEMSIZE.get(str(types[0]).lower())
    if not sizes or itemsize is None:
        raise PlannerError(f"{label}: collective {call.name} has sizes or a dtype no profiler writes")
    if kind is CollectiveKind.ALL_REDUCE:
        return sizes[0] * itemsize
    return max(sizes) * itemsize  # the unsharded side: an all-gather's output, a reduce-scatter's input
