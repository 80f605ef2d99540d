"""``fit --picture``: tokens/s (samples/s for a model without a sequence) per GPU and the reserved peak against
the batch (or the GPU count), one point per plan auto found, with the budget and the GPU's capacity drawn, so
where the curve stops reads at a glance."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes
from fsdp_planner.planners.fit import FitPoint
from fsdp_planner.report.timeline_png import (
    CAPACITY_COLOR,
    MEMORY_COLOR,
    RESERVED_COLOR,
    byte_unit,
    picture_format,
    plain,
    wrapped,
)
from fsdp_planner.userfiles import write_atomic

THROUGHPUT_COLOR, MISS_COLOR = "#2ca02c", "#d62728"
WIDTH_IN, HEIGHT_IN, DPI = 10.0, 7.0, 100
ANNOTATED = 8  # up to this many points each get their MFU written; beyond, only the fastest and the largest
CAPACITY_IN_VIEW = 8  # the capacity line is drawn when within this factor of the budget and the peaks


def write_fit_png(points: Sequence[FitPoint], x: Sequence[int], xlabel: str, capacity: int, path: Path,
                  title: str, per: str = "tokens") -> None:
    """Draw ``points`` (at ``x``: their batches or GPU counts) into ``path``; a point that does not fit is a red
    cross on the memory panel only (it has no throughput that runs). ``per``: what throughput counts, tokens or
    samples (a model without a sequence)."""
    try:
        from matplotlib import rc_context
    except ImportError:
        raise PlannerError("--picture draws with matplotlib, which is not installed: pip install matplotlib "
                           "(or the package's [plot] extra)") from None
    with rc_context({"text.usetex": False}):  # names are never TeX
        _draw(points, x, xlabel, capacity, path, title, per)


def _draw(points: Sequence[FitPoint], x: Sequence[int], xlabel: str, capacity: int, path: Path,
          title: str, per: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    fig.suptitle(wrapped(title, 95), x=0.01, ha="left", fontsize=12)
    top, bottom = fig.subplots(2, 1, sharex=True)
    fit = [(xi, p) for xi, p in zip(x, points, strict=True) if p.fits]
    miss = [(xi, p) for xi, p in zip(x, points, strict=True) if not p.fits]
    if fit:
        top.plot([xi for xi, _ in fit], [p.tokens_per_gpu for _, p in fit], "o-", color=THROUGHPUT_COLOR)
        best = max(fit, key=lambda f: f[1].tokens_per_gpu)
        for xi, p in fit if len(fit) <= ANNOTATED else dict.fromkeys([best, fit[-1]]):
            text = f"MFU {p.mfu:.1%}{' (offload)' if p.offload else ''}"
            top.annotate(text, (xi, p.tokens_per_gpu), xytext=(0, 6), textcoords="offset points",
                         ha="center", fontsize=8)
    top.set_ylabel(f"{per}/s per GPU")
    top.set_ylim(bottom=0, top=max((p.tokens_per_gpu for _, p in fit), default=1.0) * 1.2)
    _draw_memory(bottom, fit, miss, capacity, points[0].budget if points else capacity)
    bottom.set_xlabel(plain(xlabel))
    whole_number_axis(bottom, x)
    for ax in (top, bottom):
        ax.grid(color="#dddddd", linewidth=0.6)
        ax.set_axisbelow(True)
    picture = io.BytesIO()  # drawn in memory, then written whole: a failed write keeps the old file
    try:
        fig.savefig(picture, **picture_format(path))
    except ValueError as e:
        raise PlannerError(f"cannot write {path}: {e}") from None
    write_atomic(path, picture.getvalue())


def whole_number_axis(ax: Any, x: Sequence[int]) -> None:
    """Batches and GPU counts are whole numbers: a log-2 axis over a wide range, else whole ticks only (no 1.5
    between batches 1 and 2)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if x and max(x) / max(min(x), 1) >= 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_memory(ax: Any, fit: list[tuple[int, FitPoint]], miss: list[tuple[int, FitPoint]], capacity: int,
                 budget: int) -> None:
    """The reserved peaks, the budget, and the GPU's capacity when it is within the view (a small model's peaks
    would be a flat line at the bottom under an 80 GB capacity)."""
    top = max([budget, *(p.reserved_memory for _, p in fit + miss)])
    shown = capacity <= CAPACITY_IN_VIEW * top
    unit, div = byte_unit(max(top, capacity) if shown else top)
    ax.plot([xi for xi, _ in fit], [p.reserved_memory / div for _, p in fit], "o-", color=MEMORY_COLOR,
            label="reserved peak (fits)")
    if miss:
        ax.plot([xi for xi, _ in miss], [p.reserved_memory / div for _, p in miss], "x", color=MISS_COLOR,
                markersize=9, label="does not fit (auto's closest plan)")
    ax.axhline(budget / div, color=RESERVED_COLOR, linestyle=":", label=f"budget {fmt_bytes(budget)}")
    if shown:
        ax.axhline(capacity / div, color=CAPACITY_COLOR, linestyle="--", label=f"GPU capacity {fmt_bytes(capacity)}")
    else:
        ax.text(0.01, 0.97, f"GPU capacity {fmt_bytes(capacity)}: far above this scale", transform=ax.transAxes,
                va="top", fontsize=8, color=CAPACITY_COLOR)
    ax.set_ylabel(f"reserved memory per GPU ({unit})")
    ax.set_ylim(0, max(top, capacity if shown else 0) / div * 1.1)
    ax.legend(fontsize=8, loc="lower right")
