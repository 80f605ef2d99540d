"""A step's timeline as a PNG (matplotlib): per plan, the stream lanes above the per-rank memory curve, every plan
on one shared time axis so a comparison reads at a glance."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, printable
from fsdp_planner.report.step_view import BarKind, StepView, thin_curve, time_unit
from fsdp_planner.userfiles import WRITTEN_BY, write_atomic

MEMORY_COLOR, CAPACITY_COLOR, RESERVED_COLOR = "#4c78a8", "#d62728", "#7f7f7f"
WIDTH_IN, DPI = 16.0, 100  # 1600 pixels wide
LANE_IN, MEMORY_IN, TITLE_IN = 0.42, 1.7, 0.75
CAPACITY_IN_VIEW = 8  # the budget and capacity lines are drawn when within this factor of the curve's top
MIN_PIXELS = 1.5  # exposed gaps are drawn at least this wide: a 50 us wait in a 10 s step must still show
PLOT_SHARE = 0.9  # of the figure's width, the time axis
SEPARATED_PIXELS, LABEL_PIXELS = 4, 60  # collectives this wide get a white edge, this wide their group's name
LABELLED = (BarKind.ALL_GATHER, BarKind.REDUCE_SCATTER, BarKind.ALL_REDUCE)



def picture_format(path: Path) -> dict[str, Any]:
    """``savefig``'s format (the suffix's) and metadata naming the program, which a later --timeline, --picture or
    --against picture may replace without --force (``cli/paths.py``: a file it did not write is refused)."""
    fmt = path.suffix.lstrip(".").lower() or "png"
    return {"format": fmt, "metadata": {"Software" if fmt == "png" else "Creator": WRITTEN_BY}}


def figure_size(views: Sequence[StepView]) -> tuple[float, float]:
    """Inches: the lanes and memory panel of every plan, titles, the shared axis and the legend."""
    lanes = sum(len(v.lanes) for v in views)
    return WIDTH_IN, round(lanes * LANE_IN + len(views) * (MEMORY_IN + TITLE_IN) + 1.4, 2)


BUDGET_COLOR = "#9467bd"  # what auto holds the reserved peak to


def plain(text: str) -> str:
    """``text`` drawn as written: the one escaping rule for the picture's text. matplotlib reads a string with two
    ``$`` as TeX math (a module named ``a$b$`` would be typeset, one that is not valid TeX stops the picture); an
    escaped ``\\$`` is drawn as ``$``. ``write_png`` turns usetex off, so nothing else is TeX. Control characters
    are drawn as their escapes (``printable``): no font has them, and the warning naming them would print them."""
    return printable(text).replace("$", "\\$")


TITLE_CHARS = 110  # a title wider than this wraps: at 13 pt it would run past the figure's right edge


def wrapped(text: str, width: int = TITLE_CHARS) -> str:
    """``text`` drawn as written (``plain``), broken into lines of at most ``width`` characters: never clipped."""
    import textwrap

    return "\n".join(textwrap.wrap(plain(text), width, break_long_words=True)) or plain(text)


def write_png(views: Sequence[StepView], path: Path, title: str) -> None:
    """Draw ``views`` (one plan, or a plan and the one it is compared with) into ``path`` under ``title``."""
    try:
        from matplotlib import rc_context
    except ImportError:
        raise PlannerError("--timeline draws with matplotlib, which is not installed: pip install matplotlib "
                           "(or the package's [plot] extra)") from None
    with rc_context({"text.usetex": False}):  # a user's matplotlibrc may turn it on: names are never TeX
        _draw(views, path, title)


def _draw(views: Sequence[StepView], path: Path, title: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    end = max(v.report.step_time for v in views)
    unit, scale = time_unit(end)
    fig = Figure(figsize=figure_size(views), dpi=DPI, layout="constrained")
    fig.suptitle(wrapped(title), x=0.01, ha="left", fontsize=13)
    ratios = [r for v in views for r in (len(v.lanes) * LANE_IN, MEMORY_IN)]
    axes = fig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios})
    px = end / (WIDTH_IN * DPI * PLOT_SHARE)  # seconds per pixel
    min_width = MIN_PIXELS * px
    kinds: set[BarKind] = set()
    for k, v in enumerate(views):
        lanes_ax, memory_ax = axes[2 * k], axes[2 * k + 1]
        kinds |= _draw_lanes(lanes_ax, v, min_width, px)
        lanes_ax.set_title(wrapped(v.summary(), TITLE_CHARS + 10), loc="left", fontsize=11, fontweight="bold")
        _draw_memory(memory_ax, v)
    last = axes[-1]
    last.set_xlim(0, end * 1.005)
    last.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * scale:g}"))
    last.set_xlabel(f"time in the training step ({unit})", fontsize=10)
    handles = [Patch(color=kind.color, label=kind.label) for kind in BarKind if kind in kinds]
    handles += [*axes[1].get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=9, frameon=False)
    picture = io.BytesIO()  # drawn in memory, then written whole (write_atomic): a failed write keeps the old file
    try:
        fig.savefig(picture, **picture_format(path))
    except ValueError as e:  # a format matplotlib cannot write
        raise PlannerError(f"cannot write {path}: {e}") from None
    write_atomic(path, picture.getvalue())


def _draw_lanes(ax: Any, view: StepView, min_width: float, px: float) -> set[BarKind]:
    """One row per stream, top to bottom, collectives wide enough named inside their bar (``px``: seconds per
    pixel); returns the kinds drawn (for the legend)."""
    drawn: set[BarKind] = set()
    rows = len(view.lanes)
    for row, lane in enumerate(view.lanes):
        y = rows - 1 - row
        by_kind: dict[BarKind, list[tuple[float, float]]] = {}
        for b in lane.bars:
            width = max(b.seconds, min_width) if b.kind is BarKind.EXPOSED else b.seconds
            by_kind.setdefault(b.kind, []).append((b.start, width))
        for kind, spans in by_kind.items():
            # a white edge parts abutting collectives; thin bars get none, or they would turn white
            wide = [sp for sp in spans if sp[1] >= SEPARATED_PIXELS * px]
            thin = [sp for sp in spans if sp[1] < SEPARATED_PIXELS * px]
            ax.broken_barh(thin, (y + 0.12, 0.76), facecolors=kind.color, linewidth=0)
            ax.broken_barh(wide, (y + 0.12, 0.76), facecolors=kind.color, edgecolors="white", linewidth=0.6)
            drawn.add(kind)
        for b in lane.bars:
            if b.kind in LABELLED and b.seconds >= LABEL_PIXELS * px:
                chars = int(b.seconds / px / 6.5)
                text = b.name if len(b.name) <= chars else b.name[:max(1, chars - 1)] + "…"
                ax.text(b.start + b.seconds / 2, y + 0.5, plain(text), ha="center", va="center", fontsize=8,
                        color="white", clip_on=True)
    ax.set_ylim(0, rows)
    ax.set_yticks([rows - 1 - r + 0.5 for r in range(rows)], [plain(lane.name) for lane in view.lanes], fontsize=10)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return drawn


@dataclass(frozen=True)
class MemoryLine:
    """The budget's or the GPU capacity's level on the memory axis; off scale where far above the curve."""

    nbytes: int
    text: str
    drawn: bool


def memory_scale(view: StepView) -> tuple[float, MemoryLine, MemoryLine]:
    """The memory axis' top in bytes, with the budget and capacity lines: a line more than ``CAPACITY_IN_VIEW``
    times the curve's top is left off the scale (named in a corner), or a small model's curve would be flat."""
    curve_top = max(float(view.memory_bytes.max()), view.report.reserved_memory)
    budget, capacity = view.budget.limit, view.capacity
    lines = (MemoryLine(budget, f"budget {fmt_bytes(budget)}", budget <= CAPACITY_IN_VIEW * curve_top),
             MemoryLine(capacity, f"{view.gpu} capacity {fmt_bytes(capacity)}",
                        capacity <= CAPACITY_IN_VIEW * curve_top))
    return max([curve_top] + [line.nbytes for line in lines if line.drawn]), *lines


def _draw_memory(ax: Any, view: StepView) -> None:
    """Allocated bytes over the step as a filled step curve, the reserved peak, the budget and the GPU's capacity as
    lines (``memory_scale``)."""
    times, levels = thin_curve(view.memory_times, view.memory_bytes, 3000)
    top, budget, capacity = memory_scale(view)
    unit, div = byte_unit(top)
    ax.fill_between(times, levels / div, step="post", color=MEMORY_COLOR, alpha=0.25, linewidth=0)
    ax.step(times, levels / div, where="post", color=MEMORY_COLOR, linewidth=1.2, label="allocated memory per rank")
    ax.axhline(view.report.reserved_memory / div, color=RESERVED_COLOR, linestyle=":", linewidth=1.2,
               label="reserved at peak (caching allocator)")
    peak_at = float(times[int(levels.argmax())])
    ax.annotate(f"peak {fmt_bytes(view.report.peak_memory)}", (peak_at, view.report.peak_memory / div),
                xytext=(4, -12), textcoords="offset points", fontsize=9, color=MEMORY_COLOR)
    if budget.drawn:
        ax.axhline(budget.nbytes / div, color=BUDGET_COLOR, linestyle="-.", linewidth=1.1, label=budget.text)
    if capacity.drawn:
        ax.axhline(capacity.nbytes / div, color=CAPACITY_COLOR, linestyle="--", linewidth=1.3, label="GPU capacity")
        ax.text(0.002, capacity.nbytes / div, plain(f" {view.gpu}: {fmt_bytes(capacity.nbytes)}"),
                transform=ax.get_yaxis_transform(), va="bottom", fontsize=9, color=CAPACITY_COLOR)
    above = [line.text for line in (budget, capacity) if not line.drawn]
    if above:
        ax.text(0.002, 0.97, plain(f" {' and '.join(above)}: far above this scale"), transform=ax.transAxes,
                va="top", fontsize=9, color=CAPACITY_COLOR)
    ax.set_ylim(0, top / div * 1.15)
    ax.set_ylabel(f"memory ({unit})", fontsize=10)
    ax.grid(color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def byte_unit(nbytes: float) -> tuple[str, float]:
    """The axis unit for memory up to ``nbytes``: GiB, MiB or KiB, and the divisor from bytes."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= div:
            return unit, float(div)
    return "KiB", 1024.0
