"""A measured step beside the simulated one (``simulate --against TRACE.json``): both on one time axis (PNG and a
self-contained HTML page), a per-phase table and the largest gaps named, in the spirit of Holistic Trace Analysis'
temporal (compute, communication, idle) and overlap (exposed communication) breakdowns.

Each side is lanes of bars: compute, communication and host (FSDP2's hooks and copies). Phases, the same for both
sides: forward (the step's start to backward's), backward (to its last op), optimizer, compute (busy with ops),
exposed communication (a collective running while no op does), FSDP2 host (its hooks and copies while neither
runs) and idle (nothing of these).
"""

from __future__ import annotations

import html
import io
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable
from fsdp_planner.report.timeline_png import picture_format
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.sim.timeline import Stream, Work
from fsdp_planner.trace.records import Trace
from fsdp_planner.userfiles import WRITTEN_BY, write_atomic

LANES = ("compute", "communication", "host")
COLORS = {"compute": "#4c78a8", "communication": "#f58518", "host": "#9d755d"}
MAX_BARS = 20_000  # per side drawn: a long trace's bars beyond it are merged into their neighbours' pixels
GAPS = 3


@dataclass(frozen=True)
class Bar:
    lane: str  # one of LANES
    name: str
    start: float  # seconds from the step's start
    end: float


@dataclass(frozen=True)
class Phases:
    """Seconds of each phase of one step (module docstring)."""

    forward: float
    backward: float
    optimizer: float
    compute: float
    exposed_comm: float
    fsdp_host: float
    idle: float
    step: float


@dataclass(frozen=True)
class Side:
    label: str
    bars: tuple[Bar, ...]
    phases: Phases


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def phases_of(bars: Sequence[Bar], step: float, backward_start: float, backward_end: float,
              optimizer: float) -> Phases:
    """A step's phases from its bars (module docstring)."""
    lanes = {lane: [(b.start, b.end) for b in bars if b.lane == lane] for lane in LANES}
    compute = covered(lanes["compute"])
    busy = covered(lanes["compute"] + lanes["communication"])
    everything = covered(lanes["compute"] + lanes["communication"] + lanes["host"])
    return Phases(backward_start, backward_end - backward_start, optimizer, compute, busy - compute,
                  everything - busy, max(0.0, step - everything), step)


def simulated_side(trace: Trace, report: StepReport, label: str, optimizer: bool = True) -> Side:
    """The simulated step's bars and phases (its timeline: ``simulate(..., timeline=True)``); without its optimizer
    step where the measured one ran none (``optimizer`` False)."""
    bars = []
    for e in report.timeline:
        if e.work is Work.OPTIMIZER and not optimizer:
            continue
        if e.stream is Stream.COMPUTE:
            lane = "host" if e.work in (Work.HOST, Work.COPY_OUT) else "compute"
        else:
            lane = "communication"
        bars.append(Bar(lane, e.name, e.start, e.end))
    backward = [e for e in report.timeline if e.stream is Stream.COMPUTE and e.work is Work.OPS and e.op >= 0
                and trace.events[e.op].backward]
    step = report.step_seconds(optimizer)
    start = min((e.start for e in backward), default=step)
    end = max((e.end for e in backward), default=step)
    return Side(label, tuple(bars), phases_of(bars, step, start, end, report.optimizer_time if optimizer else 0.0))


def gaps(measured: Side, simulated: Side, count: int = GAPS) -> list[tuple[str, float, float]]:
    """The ``count`` phases whose simulated seconds are furthest from the measured: (phase, measured, simulated)."""
    rows = [(f.name.replace("_", " "), m, s) for f, m, s in zip(fields(Phases), astuple(measured.phases),
                                                                astuple(simulated.phases), strict=True)
            if f.name != "step"]
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))[:count]


def _thinned(bars: Sequence[Bar]) -> list[Bar]:
    """At most ``MAX_BARS`` bars: the longest kept (a picture cannot show more)."""
    if len(bars) <= MAX_BARS:
        return list(bars)
    return sorted(bars, key=lambda b: b.start - b.end)[:MAX_BARS]


def write_png(sides: Sequence[Side], path: Path, title: str, gap_lines: Sequence[str] = ()) -> None:
    """Both sides' lanes on one time axis, the gaps under the title."""
    try:
        from matplotlib import rc_context
        from matplotlib.figure import Figure
    except ImportError:
        raise PlannerError("--timeline draws with matplotlib, which is not installed: pip install matplotlib") from None
    end = max(s.phases.step for s in sides)
    with rc_context({"text.usetex": False}):
        fig = Figure(figsize=(16, 1.5 + 0.2 * len(gap_lines) + 1.3 * len(sides)), dpi=100, layout="constrained")
        heading = "\n".join([title, *(f"gap {i + 1}: {line}" for i, line in enumerate(gap_lines))])
        fig.suptitle(_plain(heading), x=0.01, ha="left", fontsize=11)
        ax = fig.subplots()
        labels = []
        for k, side in enumerate(sides):
            for j, lane in enumerate(LANES):
                y = (len(sides) - 1 - k) * (len(LANES) + 1) + (len(LANES) - 1 - j)
                spans = [(b.start * 1e3, (b.end - b.start) * 1e3) for b in _thinned(side.bars) if b.lane == lane]
                ax.broken_barh(spans, (y + 0.1, 0.8), facecolors=COLORS[lane], linewidth=0)
                labels.append((y + 0.5, f"{side.label}: {lane}"))
        ax.set_yticks([y for y, _ in labels], [_plain(t) for _, t in labels], fontsize=9)
        ax.set_xlim(0, end * 1e3 * 1.005)
        ax.set_xlabel("time in the training step (ms)")
        ax.grid(axis="x", color="#dddddd", linewidth=0.6)
        picture = io.BytesIO()
        try:
            fig.savefig(picture, **picture_format(path))
        except ValueError as e:
            raise PlannerError(f"cannot write {path}: {e}") from None
    write_atomic(path, picture.getvalue())


def _plain(text: str) -> str:
    return printable(text).replace("$", "\\$")


def phase_table_rows(sides: Sequence[Side]) -> list[list[str]]:
    """Per phase: its name and each side's milliseconds."""
    rows = []
    for i, f in enumerate(fields(Phases)):
        rows.append([f.name.replace("_", " ")] + [f"{astuple(s.phases)[i] * 1e3:,.2f}" for s in sides])
    return rows


def render_html(sides: Sequence[Side], title: str, gap_lines: Sequence[str]) -> str:
    """One self-contained page: an SVG of both sides on one axis, the phase table and the gaps."""
    width, lane_h, left = 1400, 18, 190
    end = max(s.phases.step for s in sides) or 1.0
    scale = (width - left - 10) / end
    parts, y = [], 0
    for side in sides:
        for lane in LANES:
            parts.append(f'<text x="4" y="{y + 13}" font-size="12">{html.escape(side.label)}: {lane}</text>')
            for b in _thinned(side.bars):
                if b.lane == lane:
                    parts.append(f'<rect x="{left + b.start * scale:.2f}" y="{y + 2}" '
                                 f'width="{max(0.5, (b.end - b.start) * scale):.2f}" height="{lane_h - 4}" '
                                 f'fill="{COLORS[lane]}"><title>{html.escape(printable(b.name))} '
                                 f'{b.start * 1e3:.3f}-{b.end * 1e3:.3f} ms</title></rect>')
            y += lane_h
        y += lane_h // 2
    head = "".join(f"<th>{html.escape(s.label)} (ms)</th>" for s in sides)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in phase_table_rows(sides))
    gaps_html = "".join(f"<li>{html.escape(line)}</li>" for line in gap_lines)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="generator" content="{WRITTEN_BY}"><title>{html.escape(title)}</title>'
            '<style>body{font-family:sans-serif;margin:16px}td,th{padding:2px 10px;text-align:right}'
            'td:first-child{text-align:left}</style></head><body>'
            f'<h1 style="font-size:17px">{html.escape(title)}</h1>'
            f'<svg width="{width}" height="{y + 10}" xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
            f'<table><tr><th>phase</th>{head}</tr>{body}</table><h2 style="font-size:15px">largest gaps</h2>'
            f'<ol>{gaps_html}</ol></body></html>')


def write_html(sides: Sequence[Side], path: Path, title: str, gap_lines: Sequence[str]) -> None:
    write_atomic(path, render_html(sides, title, gap_lines))
