"""Calibrate the collective model from nccl-tests logs (``all_gather_perf``, ``reduce_scatter_perf``).

Users run nccl-tests on their own cluster (e.g. ``all_gather_perf -b 8 -e 8G -f 2 -g 8``) and hand the
printed output to :func:`calibrate`. For every (collective, group size N) found we fit the ring line
``time = alpha + (N-1)/N * size / busbw`` and store (alpha, busbw) in ``Cluster.fits``, which
``collectives.py`` then prefers over the preset figures.

Parsing is lenient about what surrounds the tables (NCCL INFO lines, ``mpirun --tag-output`` prefixes, pasted
shell commands, several runs in one file) because real logs are collected every which way. A file is split
into runs at each ``# nThread ...`` header. For each run:

* the collective comes from the caller, else from a binary name in the text (``all_gather_perf``, as in the
  pasted command or the ``# Collective test starting:`` line of newer nccl-tests), else from the table: the
  all-gather prints redop ``none``, the reduce-scatter a reduction, and both print a per-rank ``count``
  with ``size = count * N * sizeof(type)`` (all-reduce prints ``size = count * sizeof(type)``);
* N comes from the caller, else from that size/count ratio (it is the communicator that ran, even with
  ``NCCL_TESTS_SPLIT_MASK``), else by counting the ``#  Rank ...`` lines.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.hardware.cluster import (
    GPUS,
    MAX_GPUS_PER_NODE,
    MAX_WORLD_SIZE,
    Cluster,
    Fits,
    calibrated_name,
    preset_cluster,
    with_fits,
)
from fsdp_planner.userfiles import read_bytes, shown_json

# nccl-tests type names -> bytes per element
_WORD = {
    "int8": 1, "uint8": 1, "char": 1, "f8e4m3": 1, "f8e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "half": 2, "float16": 2, "bfloat16": 2, "bf16": 2, "fp16": 2,
    "int32": 4, "uint32": 4, "int": 4, "float": 4, "float32": 4,
    "int64": 8, "uint64": 8, "double": 8, "float64": 8,
}
_BINARY = re.compile(
    r"\b(all_gather|reduce_scatter|all_reduce|alltoall|broadcast|reduce|sendrecv|gather|scatter|hypercube)"
    r"_perf(?:_mpi)?\b"
)
_NTHREAD = re.compile(r"^#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")
_RANK = re.compile(
    r"^#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+\d+\s+\[[^\]]*\]\s+(.+?)\s*$"
)
_TAG = re.compile(r"^\s*\[[^\]]*\]<std(?:out|err)>:")  # mpirun --tag-output
_MIN_SIZE = 1  # rows with size 0 (count rounded down to 0 per rank) carry no information
# What a real run prints: nccl-tests writes times in us with two decimals, so 0.01 is the smallest non-zero one,
# and no collective takes hours; sizes stay far below a PiB. Outside these a row is a typo or a corrupt log (and
# would break the fit's arithmetic: 1e-300 s squared is 0).
_MIN_TIME_US, _MAX_TIME_US = 0.01, 1e10
MAX_LOG_LINES = 1_000_000  # about 12 s of parsing on a 2-core host; a sweep of 8 B to 8 GiB is 31 rows a run
_MAX_SIZE = 1 << 50
_MIN_FIT_SIZES = 3  # two sizes make a line; a third checks it (and lets a hiccup be dropped)
_WHOLE = re.compile(r"\d+", re.ASCII)
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf|infinity)", re.ASCII | re.IGNORECASE)


@dataclass(frozen=True)
class NcclRow:
    """One data row: the out-of-place and in-place measurements of one size."""

    size: int  # bytes, the full (unsharded) buffer as nccl-tests prints it
    count: int  # elements as printed (per rank for all-gather / reduce-scatter)
    dtype: str
    redop: str | None  # None in the old 11-column layout
    oop_time_us: float | None
    oop_busbw: float | None
    oop_wrong: str
    ip_time_us: float | None
    ip_busbw: float | None
    ip_wrong: str


@dataclass(frozen=True)
class NcclTable:
    """One nccl-tests run: which collective, over how many ranks, and its rows."""

    kind: str  # all_gather, reduce_scatter, or the name of an unsupported collective / "unknown"
    ranks: int
    rows: tuple[NcclRow, ...]
    hosts: tuple[str, ...] = ()
    gpu_name: str | None = None  # the GPU most of its ranks ran on
    source: str = "<text>"
    gpu_names: tuple[str, ...] = ()  # every GPU its ranks ran on
    cut_rows: int = 0  # lines that began a row but held too few fields (a log cut short mid-row): left out

    @property
    def failed_checks(self) -> int:
        """Measurements (in- or out-of-place) whose data check failed: ``samples`` leaves them out."""
        return sum(t is not None and t > 0 and not _wrong_ok(wrong) for r in self.rows if r.size >= _MIN_SIZE
                   for t, wrong in ((r.oop_time_us, r.oop_wrong), (r.ip_time_us, r.ip_wrong)))

    def samples(self) -> list[tuple[int, float]]:
        """(size bytes, seconds) of every valid measurement, in- and out-of-place, data check passed."""
        out = []
        for r in self.rows:
            if r.size < _MIN_SIZE:
                continue
            for t, wrong in ((r.oop_time_us, r.oop_wrong), (r.ip_time_us, r.ip_wrong)):
                if t is not None and t > 0 and _wrong_ok(wrong):
                    out.append((r.size, t * 1e-6))
        return out


@dataclass(frozen=True)
class Fit:
    """A fitted ring line for one (collective, N)."""

    kind: str
    ranks: int
    alpha: float  # seconds
    bus_bandwidth: float  # bytes/s
    rel_rms: float  # root-mean-square relative error of the kept samples
    samples: int
    dropped: int  # outliers left out (hiccups, warm-up spikes)
    sources: tuple[str, ...] = field(default=())


def _wrong_ok(tok: str) -> bool:
    if tok.upper() == "N/A":
        return True
    try:
        return float(tok) == 0
    except ValueError:
        return False


def _float(tok: str) -> float | None:
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _parse_row(tokens: list[str], where: str = "a row") -> NcclRow | None:
    """A data row in the 13-column layout (size count type redop root + 2 x (time algbw busbw #wrong)) or
    the pre-2.13 11-column one (no redop/root). None for a line that is not a data row; PlannerError, naming
    ``where`` (e.g. "line 12 of ag.log"), for a data row whose size or time no nccl-tests run can print."""
    if len(tokens) not in (11, 13):
        return None
    if not (_WHOLE.fullmatch(tokens[0]) and _WHOLE.fullmatch(tokens[1])):
        if tokens[2].lower() in _WORD and _NUMBER.fullmatch(tokens[0]) and _NUMBER.fullmatch(tokens[1]):
            raise PlannerError(f"{where} has size {tokens[0]} and count {tokens[1]}, but nccl-tests prints them as "
                               "whole numbers of bytes and elements, 0 or more")
        return None
    if len(tokens) == 13:
        redop: str | None = tokens[3]
        if not re.fullmatch(r"-?\d+", tokens[4]):
            return None
        rest = tokens[5:]
    else:
        redop, rest = None, tokens[3:]
    oop_t, ip_t = _number(rest[0]), _number(rest[4])
    if oop_t is None and ip_t is None:
        return None
    if len(tokens[0]) > 16 or len(tokens[1]) > 16 or int(tokens[0]) > _MAX_SIZE:
        raise PlannerError(f"{where} has a size of {_short(tokens[0])} bytes, more than the {_MAX_SIZE:,} bytes "
                           "(1 PiB) any nccl-tests run measures")
    size = int(tokens[0])
    if size >= _MIN_SIZE:
        for label, t, tok in (("out-of-place", oop_t, rest[0]), ("in-place", ip_t, rest[4])):
            if t is not None and not _MIN_TIME_US <= t <= _MAX_TIME_US:
                raise PlannerError(f"{where} has an {label} time of {_short(tok)} us, which no nccl-tests run prints "
                                   f"(expected a finite time from {_MIN_TIME_US} to {_MAX_TIME_US:.0e} us)")
    else:  # size-0 rows carry no information: keep them only as the table's shape, never fitted
        oop_t = oop_t if oop_t is not None and math.isfinite(oop_t) else None
        ip_t = ip_t if ip_t is not None and math.isfinite(ip_t) else None
    return NcclRow(
        size=size, count=int(tokens[1]), dtype=tokens[2], redop=redop,
        oop_time_us=oop_t, oop_busbw=_float(rest[2]), oop_wrong=rest[3],
        ip_time_us=ip_t, ip_busbw=_float(rest[6]), ip_wrong=rest[7],
    )


def _number(tok: str) -> float | None:
    """Any number nccl-tests could have printed, NaN and infinities included (None: not a number at all)."""
    if not _NUMBER.fullmatch(tok):
        return None
    return float(tok)


def _short(tok: str) -> str:
    return tok if len(tok) <= 24 else f"{tok[:12]}...({len(tok)} characters)"


@dataclass
class _Run:
    hint: str | None = None
    ranks: list[tuple[int, str, str]] = field(default_factory=list)  # (rank, host, gpu name)
    rows: list[NcclRow] = field(default_factory=list)
    closed: bool = False
    cut: int = 0  # lines that began a row (a size first) but are no row: cut short


def _split_runs(text: str, source: str = "<text>") -> list[_Run]:
    runs: list[_Run] = []
    cur: _Run | None = None
    pending: str | None = None  # a binary name seen before the run it belongs to
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _TAG.sub("", raw).strip()
        if not line:
            continue
        if _NTHREAD.match(line):
            cur = _Run(hint=pending)
            runs.append(cur)
            pending = None
            continue
        row = _parse_row(line.split(), f"line {lineno} of {source}") if not line.startswith("#") else None
        if row is None and cur is not None and not cur.closed and cur.rows and line.split()[0].isdigit():
            cur.cut += 1  # (a size, then too few fields: the row a truncated log ends in)
            continue
        if row is not None:
            if cur is None or cur.closed:
                cur = _Run(hint=pending)
                runs.append(cur)
                pending = None
            cur.rows.append(row)
            continue
        m = _RANK.match(line)
        if m:
            if cur is None or cur.closed or cur.rows:
                cur = _Run(hint=pending)
                runs.append(cur)
                pending = None
            cur.ranks.append((int(m.group(1)), m.group(2), m.group(3)))
            continue
        if line.startswith("# Avg bus bandwidth") and cur is not None:
            cur.closed = True
            continue
        b = _BINARY.search(line)
        if b:
            if cur is not None and not cur.rows and not cur.closed and cur.hint is None:
                cur.hint = b.group(1)  # e.g. "# Collective test starting: ..." right after the header
            else:
                pending = b.group(1)
    return [r for r in runs if r.rows]


def _infer(run: _Run, kind: str | None, ranks: int | None, source: str) -> NcclTable:
    ratios = set()
    for r in run.rows:
        w = _WORD.get(r.dtype.lower())
        if w and r.count > 0 and r.size > 0:
            ratios.add(r.size / (r.count * w))
    data_n = int(next(iter(ratios))) if len(ratios) == 1 and float(next(iter(ratios))).is_integer() else None
    rank_ids = {rk for rk, _, _ in run.ranks}
    hosts = tuple(dict.fromkeys(h for _, h, _ in run.ranks))
    gpu = Counter(g for _, _, g in run.ranks).most_common(1)[0][0] if run.ranks else None

    if kind is not None:
        k = kind
    elif run.hint is not None:
        k = run.hint
    elif data_n == 1:
        k = "all_reduce"  # size == count * sizeof: all-reduce / reduce / broadcast layout
    else:
        redops = {r.redop for r in run.rows}
        if redops == {None}:
            k = "unknown"  # pre-2.13 layout without redop: cannot tell all-gather from reduce-scatter
        elif redops <= {"none"}:
            k = "all_gather"
        else:
            k = "reduce_scatter"

    n = ranks or (data_n if data_n and data_n > 1 else None) or len(rank_ids) or 0
    return NcclTable(kind=k, ranks=n, rows=tuple(run.rows), hosts=hosts, gpu_name=gpu, source=source,
                     cut_rows=run.cut, gpu_names=tuple(sorted({g for _, _, g in run.ranks})))


def _norm_kind(kind: str | None) -> str | None:
    if kind is None:
        return None
    text = kind.strip().lower().removesuffix("_perf")
    try:
        return CollectiveKind.parse(text).value
    except PlannerError:
        raise PlannerError(f"unknown collective '{kind}': calibration fits all_gather and reduce_scatter "
                           "logs") from None


def parse_nccl_tests(
    text: str, *, kind: str | None = None, ranks: int | None = None, source: str = "<text>"
) -> list[NcclTable]:
    """Every nccl-tests run found in ``text`` (maybe none). ``kind``/``ranks`` override what is inferred."""
    k = _norm_kind(kind)
    return [_infer(run, k, ranks, source) for run in _split_runs(text, source)]


def read_nccl_tests(
    path: str | Path, *, kind: str | None = None, ranks: int | None = None
) -> list[NcclTable]:
    """The runs of one log file; PlannerError if it is missing or holds no nccl-tests table."""
    p = Path(path)
    if not p.is_file():
        raise PlannerError(f"nccl-tests log {p} does not exist")
    text = read_bytes(p, f"nccl-tests log {p}", "the output of an nccl-tests binary").decode(errors="replace")
    lines = text.count("\n")
    if lines > MAX_LOG_LINES:  # (a 255 MiB file of short lines took 2 minutes and 1.6 GB to split, within the size)
        raise PlannerError(f"nccl-tests log {p} has {lines:,} lines, more than the {MAX_LOG_LINES:,} a log of "
                           "nccl-tests runs holds (tens of rows a run): give the output of all_gather_perf or "
                           "reduce_scatter_perf")
    tables = parse_nccl_tests(text, kind=kind, ranks=ranks, source=str(p))
    if not tables:
        raise PlannerError(
            f"no nccl-tests table found in {p}: expected the output of all_gather_perf or "
            "reduce_scatter_perf (rows of size, count, type, redop, root, time, algbw, busbw, #wrong)"
        )
    return tables


def _solve(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least squares of t = a + b x in relative error (weights 1/t^2), so 8 B and 8 GiB rows count alike:
    small sizes pin a, large ones b. Falls back to a = 0 if the free fit wants a negative latency."""
    w = [1 / (t * t) for t in ts]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    st = sum(wi * t for wi, t in zip(w, ts, strict=True))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
    det = sw * sxx - sx * sx
    if det > 0:
        a = (sxx * st - sx * sxt) / det
        b = (sw * sxt - sx * st) / det
        if a >= 0:
            return a, b
    return 0.0, (sxt / sxx if sxx > 0 else 0.0)


def fit_samples(
    samples: Sequence[tuple[int, float]], ranks: int, what: str = "the log"
) -> tuple[float, float, float, int]:
    """(alpha s, busbw B/s, relative rms, outliers dropped) for (size, seconds) samples of an N-rank ring.

    One robust pass: samples more than max(25%, 4 x median) off the first line are dropped and the line refit,
    so a single hiccup (a 3x spike is common in real logs) does not drag the latency.
    """
    if ranks < 2:
        raise PlannerError(f"cannot fit {what}: a collective needs at least 2 ranks, found {ranks}")
    k = (ranks - 1) / ranks
    for s, t in samples:
        if not (0 <= s <= _MAX_SIZE and _MIN_TIME_US * 1e-6 <= t <= _MAX_TIME_US * 1e-6):
            raise PlannerError(f"cannot fit {what}: the sample of {s!r} bytes in {t!r} s is not a plausible "
                               f"measurement (sizes 0 to 1 PiB, times {_MIN_TIME_US:g} us to {_MAX_TIME_US:.0e} us)")
    pts = [(k * s, t) for s, t in samples if s > 0]
    found = len({x for x, _ in pts})
    if found < _MIN_FIT_SIZES:
        raise PlannerError(
            f"cannot fit {what}: it needs measurements at {_MIN_FIT_SIZES} or more sizes and found {found} (two or "
            "more sizes make a line, a third checks it); run nccl-tests over a range of sizes, e.g. -b 8 -e 8G -f 2"
        )
    xs, ts = [x for x, _ in pts], [t for _, t in pts]
    a, b = _solve(xs, ts)
    res = [abs(a + b * x - t) / t for x, t in pts]
    cut = max(0.25, 4 * statistics.median(res))
    kept = [(x, t) for (x, t), r in zip(pts, res, strict=True) if r <= cut]
    dropped = len(pts) - len(kept)
    if dropped and len({x for x, _ in kept}) >= 2:
        xs, ts = [x for x, _ in kept], [t for _, t in kept]
        a, b = _solve(xs, ts)
    else:
        dropped = 0
    if not b > 0:
        raise PlannerError(
            f"cannot fit {what}: time does not grow with size, so it shows no bandwidth; run nccl-tests "
            "up to large sizes (e.g. -e 8G)"
        )
    rms = math.sqrt(sum(((a + b * x - t) / t) ** 2 for x, t in zip(xs, ts, strict=True)) / len(xs))
    if not (math.isfinite(a) and math.isfinite(1 / b) and math.isfinite(rms)):
        raise PlannerError(f"cannot fit {what}: the fitted latency {a!r} s and bandwidth {1 / b!r} B/s are not both "
                           "finite; check the log's times and sizes")
    return a, 1 / b, rms, dropped


def _expand(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, str | Path) else list(paths)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix in (".log", ".txt", ".out"))
            if not found:
                raise PlannerError(f"directory {p} holds no .log, .txt or .out nccl-tests logs")
            out += found
        else:
            out.append(p)
    if not out:
        raise PlannerError("calibration needs at least one nccl-tests log")
    return out


def fit_logs(
    paths: str | Path | Iterable[str | Path], *, kind: str | None = None, ranks: int | None = None,
    note: Callable[[str], None] = lambda line: None,
) -> tuple[list[NcclTable], list[Fit]]:
    """Parse the logs and fit one line per (collective, N); runs of other collectives are skipped. A row cut
    short (a log truncated mid-row) is left out, said in a note."""
    tables: list[NcclTable] = []
    for p in _expand(paths):
        tables += read_nccl_tests(p, kind=kind, ranks=ranks)
    for t in tables:
        if t.cut_rows:
            note(f"the {t.kind} run in {t.source} has {t.cut_rows} row{'s' if t.cut_rows > 1 else ''} cut short (a "
                 f"size, then fewer fields than nccl-tests prints: a log cut mid-row?), left out: fitted on its "
                 f"{len(t.rows)} whole rows")
        if t.failed_checks:  # (left out without a word before: a run whose data check fails is a broken one)
            note(f"the {t.kind} run in {t.source} has {t.failed_checks} measurement"
                 f"{'s' if t.failed_checks > 1 else ''} whose data check failed (#wrong not 0), left out of the fit: "
                 "a collective that delivers wrong data is a fault of the machine or the run, worth a look before "
                 "trusting its times")
    fitted = (CollectiveKind.ALL_GATHER.value, CollectiveKind.REDUCE_SCATTER.value)
    for t in tables:
        if t.kind == CollectiveKind.ALL_REDUCE.value and t.ranks >= 2:
            note(f"the all_reduce run in {t.source} is left out: the cost model charges an all-reduce as a "
                 "reduce-scatter and an all-gather, and fits those from their own logs (all_gather_perf, "
                 "reduce_scatter_perf)")
    usable = [t for t in tables if t.kind in fitted and t.ranks >= 2]
    if not usable:
        seen = ", ".join(sorted({f"{t.kind} ({t.ranks} ranks) in {t.source}" for t in tables}))
        raise PlannerError(
            f"no all_gather or reduce_scatter run with 2+ ranks in the logs (found {seen}); pass the "
            "collective and rank count explicitly if the log does not show them"
        )
    for t in usable:
        if t.ranks > MAX_WORLD_SIZE:
            raise PlannerError(f"a {t.kind} run in {t.source} is over {t.ranks:,} ranks, more than the "
                               f"{MAX_WORLD_SIZE:,} supported; check its size and count columns")
    groups: dict[tuple[str, int], list[NcclTable]] = {}
    for t in usable:
        groups.setdefault((t.kind, t.ranks), []).append(t)
    fits = []
    for (k, n), ts in sorted(groups.items()):
        samples = [s for t in ts for s in t.samples()]
        srcs = tuple(dict.fromkeys(t.source for t in ts))
        what = f"{k} over {n} ranks ({', '.join(srcs)})"
        a, bw, rms, dropped = fit_samples(samples, n, what=what)
        if len(ts) > 1:
            _note_disagreement(ts, k, n, note)
        _check_fit(what, samples, n, a, bw, rms)
        _note_fit(what, samples, n, (a, bw, rms, dropped), note)
        fits.append(Fit(k, n, a, bw, rms, len(samples) - dropped, dropped, srcs))
    return usable, fits


def _check_fit(what: str, samples: list[tuple[int, float]], ranks: int, alpha: float, busbw: float,
               rms: float) -> None:
    """Refuse a fit that measures nothing: every row latency-bound (the slope is noise: a log cut at 32 KiB
    fitted 1.8 TB/s where its GPUs ran 300 GB/s), or samples far off any line (a trial's log 82% off its line was
    written as a cluster, exit 0, beside a note that called the line no measurement)."""
    largest = max(size for size, _ in samples)
    if (ranks - 1) / ranks * largest / busbw < alpha:
        raise PlannerError(f"cannot fit {what}: its largest size, {fmt_bytes(largest)}, still takes mostly "
                           "latency, so the log shows no bandwidth (a log cut short?); run nccl-tests up to "
                           "large sizes, e.g. -b 8 -e 8G -f 2")
    if rms > UNFIT:
        raise PlannerError(f"cannot fit {what}: its samples sit {rms:.0%} off any line (root mean square), so the "
                           "log's runs or its in- and out-of-place columns disagree and no latency or bandwidth "
                           "stands for them; give the log of one clean run")


LATENCY_SEEN = 0.05  # the latency's share of the smallest size's time below which the log does not measure it
LOOSE_FIT = 0.25  # the kept samples' relative rms off the line from which the fit is said to be loose
UNFIT = 0.5  # ... and from which it is refused


def _note_fit(what: str, samples: list[tuple[int, float]], ranks: int, fit: tuple[float, float, float, int],
              note: Callable[[str], None]) -> None:
    """Say what a fit left out or could not see (a trial's logs fitted all three without a word): the samples
    dropped as outliers, samples far off the line (out-of-place times twice the in-place ones: 32% rms; over
    ``UNFIT`` the fit is refused, ``_check_fit``), and a latency the log's sizes do not measure (its smallest
    already bandwidth-bound)."""
    alpha, busbw, rms, dropped = fit
    if rms > LOOSE_FIT:
        note(f"{what}: its samples sit {rms:.0%} off the fitted line (root mean square): the log's runs or its in- "
             "and out-of-place columns disagree; the line is no measurement of either")
    if dropped:
        note(f"{what}: {dropped} of {len(samples)} samples left out of the fit as outliers, far off the line the "
             "others make (a hiccup; many: the log's runs disagree)")
    smallest = min(size for size, _ in samples if size > 0)
    took = alpha + (ranks - 1) / ranks * smallest / busbw
    if alpha < LATENCY_SEEN * took:
        note(f"{what}: its smallest size, {fmt_bytes(smallest)}, takes {took * 1e6:,.1f} us, nearly all of it "
             f"bandwidth: the latency fitted ({alpha * 1e6:.1f} us) is not measured; run nccl-tests from small "
             "sizes (-b 8)")


def _note_disagreement(tables: list[NcclTable], kind: str, ranks: int, note: Callable[[str], None]) -> None:
    """Say so when runs fitted as one disagree by over 25% in bandwidth (two clusters' logs, or one run on a busy
    fabric): the line fitted through both is neither's."""
    alone = []
    for t in tables:
        try:
            alone.append((fit_samples(t.samples(), ranks, what=t.source)[1], t.source))
        except PlannerError:  # too few sizes alone: only the pooled fit speaks for it
            continue
    if len(alone) > 1 and max(alone)[0] > 1.25 * min(alone)[0]:
        runs = ", ".join(f"{bw / 1e9:.0f} GB/s in {src}" for bw, src in alone)
        note(f"the {kind} runs over {ranks} ranks disagree ({runs}): fitted as one line; give the logs of one "
             "cluster in one state")


# a device line names the GPU as nvidia-smi does ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"): a preset is
# taken for the variant it describes only (an A100-SXM4-40GB taken as the 80 GB preset budgeted plans for twice its
# memory, an H100 PCIe as the SXM's clocks and NVLink: a trial's logs)
OTHER_VARIANTS = ("PCIE", "NVL")


def _preset_for(gpu_name: str | None) -> str | None:
    """The preset of the GPU a device line names: its kind by name (not inside another's: GH200), none of
    ``OTHER_VARIANTS``, and its memory where the name says it."""
    if not gpu_name:
        return None
    up = gpu_name.upper()
    # (a letter before the kind is another GPU: GH200 is no H200)
    key = next((k for k in ("h200", "h100", "a100", "b200") if re.search(rf"(?<![A-Z]){k.upper()}", up)), None)
    if key is None or any(w in up for w in OTHER_VARIANTS):
        return None
    sizes = re.findall(r"(\d+)\s*GB?\b", up)
    # the preset's memory, or the size its name gives (B200-180GB holds 192 GB)
    known = {round(GPUS[key].memory_bytes / 1e9), *(int(x) for x in re.findall(r"(\d+)GB", GPUS[key].name))}
    return key if not sizes or int(sizes[0]) in known else None


def _base_from_logs(tables: Sequence[NcclTable]) -> Cluster:
    """A preset matching the GPUs and topology the logs ran on."""
    every = sorted({g for t in tables for g in (t.gpu_names or ((t.gpu_name,) if t.gpu_name else ()))})
    if len(every) > 1:
        raise PlannerError(f"the logs ran on different GPUs ({', '.join(repr(g) for g in every[:4])}): no one preset "
                           "is theirs; pass a base cluster (a preset such as h100:16 or a cluster JSON)")
    gpu_name = every[0] if every else None
    key = _preset_for(gpu_name)
    if key is None:
        presets = ", ".join(GPUS[k].name for k in ("h100", "h200", "a100", "b200"))
        raise PlannerError(
            f"cannot tell which preset matches GPU '{gpu_name or 'unknown'}' in the logs (the presets are {presets}, "
            "taken for those only); pass a base cluster (a preset such as h100:16 or a cluster JSON)"
        )
    with_hosts = [t for t in tables if t.hosts]
    if with_hosts:
        per_node = max(-(-t.ranks // len(t.hosts)) for t in with_hosts)
        nodes = max(max(len(t.hosts) for t in with_hosts), -(-max(t.ranks for t in tables) // per_node))
    else:
        biggest = max(t.ranks for t in tables)
        per_node = min(biggest, MAX_GPUS_PER_NODE)
        nodes = -(-biggest // per_node)
    return preset_cluster(key, nodes=nodes, gpus_per_node=per_node)


def _check_base_gpu(tables: Sequence[NcclTable], base: Cluster) -> None:
    """A base that is another preset's GPU than the one the logs' device lines name is refused: its links would carry
    the fits of another machine's (a trial's H100 logs fitted onto the A100 preset's NVLink, 346 GB/s on 235). A base
    whose GPU is none of the presets' (the user's own cluster JSON) is the user's word for the machine."""
    presets = {g.name: k for k, g in GPUS.items()}
    names = sorted({g for t in tables for g in (t.gpu_names or ((t.gpu_name,) if t.gpu_name else ()))})
    if base.gpu.name not in presets or len(names) > 1:  # (logs of mixed GPUs need a base: the user's word)
        return
    for name in names:
        key = _preset_for(name)
        # (a variant of the logs' kind, h100e of an H100's, is the user's word for its memory and clocks: its
        # NVLink and network are the kind's)
        if key is not None and not presets[base.gpu.name].startswith(key):
            raise PlannerError(f"the logs ran on {shown_json(name)} (the {key} preset's {GPUS[key].name}) but the "
                               f"base cluster {shown_json(base.name)} has {base.gpu.name} GPUs: give a base of the "
                               f"logs' GPU ({key}:N or a cluster JSON of it), or leave --base out to take it from the "
                               "logs")


def calibrate(
    paths: str | Path | Iterable[str | Path],
    base: Cluster | None = None,
    *,
    kind: str | None = None,
    ranks: int | None = None,
    note: Callable[[str], None] = lambda line: None,
) -> Cluster:
    """``base`` (or a preset matching the logs' GPUs and hosts) plus fitted (alpha, busbw) per (kind, N).

    Fits are merged over any ``base.fits``; ``hardware.cost.collective_cost`` uses them for matching
    group sizes and scales the model by them for other sizes of the same one-node/multi-node regime.
    """
    tables, fits = fit_logs(paths, kind=kind, ranks=ranks, note=note)
    if base is not None:
        _check_base_gpu(tables, base)
    cluster = base if base is not None else _base_from_logs(tables)
    table: Fits = {}
    for f in fits:
        table.setdefault(f.kind, {})[f.ranks] = (f.alpha, f.bus_bandwidth)
    return with_fits(cluster, table, name=calibrated_name(cluster.name))
