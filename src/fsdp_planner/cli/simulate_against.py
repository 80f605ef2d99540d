"""``simulate MODEL --plan P --cluster C --against TRACE.json``: the measured step beside the simulated one
(``report/against.py``), as tables, and drawn with --timeline / --html."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.table import Table

import fsdp_planner.cli.render as render
from fsdp_planner.calibrate.kineto import read_trace
from fsdp_planner.calibrate.trace_fit import check_trace_of
from fsdp_planner.fmt import json_text
from fsdp_planner.fsdp2.plan import Plan
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.report.against import (
    Bar,
    Side,
    gaps,
    phase_table_rows,
    phases_of,
    simulated_side,
    write_html,
    write_png,
)
from fsdp_planner.sim.options import SimOptions
from fsdp_planner.sim.simulate import rank_step, simulate
from fsdp_planner.trace.records import Trace


def against(tr: Trace, labelled: tuple[str, Plan], cluster: Cluster, options: SimOptions, trace_path: str,
            pictures: tuple[Path | None, Path | None], as_json: bool) -> int:
    label, plan = labelled
    measured_trace = read_trace(trace_path)
    report = simulate(tr, plan, cluster, options, timeline=True)
    check_trace_of(tr, plan, cluster, options, measured_trace, report)
    step = measured_trace.median_step()
    bars = tuple(Bar(s.lane, s.name, s.start, s.end) for s in step.spans)
    measured = Side(f"measured (rank {measured_trace.rank})", bars,
                    phases_of(bars, step.seconds, step.forward, step.forward + step.backward, step.optimizer))
    optimizer = step.ran_optimizer
    rank_trace = rank_step(tr, plan, cluster)[0]  # with TP or EP the timeline's ops are one rank's view's
    simulated = simulated_side(rank_trace, report, f"simulated {label}", optimizer)
    largest = gaps(measured, simulated)
    lines = [f"{name}: measured {m * 1e3:,.2f} ms, simulated {s * 1e3:,.2f} ms ({(s - m) * 1e3:+,.2f} ms)"
             for name, m, s in largest]
    png, page = pictures
    title = f"{label} on {cluster.name}: measured ({Path(trace_path).name}) vs simulated"
    if png is not None:
        write_png([measured, simulated], png, title, lines)
    if page is not None:
        write_html([measured, simulated], page, title, lines)
    if as_json:
        print(json_text({"measured": asdict(measured.phases), "simulated": asdict(simulated.phases),
                         "steps_measured": len(measured_trace.steps), "optimizer_compared": optimizer,
                         "gaps": [{"phase": n, "measured": m, "simulated": s} for n, m, s in largest]}, indent=2))
        return 0
    table = Table(title=f"the step, phase by phase (measured: the median of {len(measured_trace.steps)} steps)")
    for col in ("phase", measured.label + " (ms)", simulated.label + " (ms)"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for row in phase_table_rows([measured, simulated]):
        table.add_row(*row)
    render.console.print(table)
    if not optimizer and report.optimizer_time:
        render.note(f"the measured steps ran no optimizer step (no Optimizer.step# range): the simulated step is "
                    f"shown without its {report.optimizer_time * 1e3:,.2f} ms one")
    render.plain("largest gaps:")
    for line in lines:
        render.plain(f"  {line}")
    for path in filter(None, pictures):
        render.plain(f"timeline written to {path}")
    return 0
