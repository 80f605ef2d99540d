"""Tables for people: policies side by side, one plan's groups, verify results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from fsdp_planner.metrics import PlanMetrics
from fsdp_planner.plan import Plan
from fsdp_planner.trace import Trace


def fmt_bytes(n: float) -> str:
    """Binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return str(n)


def fmt_numel(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def modules_label(modules: Sequence[str], limit: int = 3) -> str:
    names = ["(root)" if m == "" else m for m in modules]
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", +{len(names) - limit}"


def comparison_table(title: str, rows: list[tuple[Plan, PlanMetrics, dict[str, Any] | None]]) -> Table:
    """Policies side by side; the extra dict (step time, exposed comm, peak memory) comes from simulate."""
    with_cost = any(extra for _, _, extra in rows)
    t = Table(title=title, title_justify="left")
    for col in ("policy", "groups", "root params", "AG", "RS", "AG bytes", "peak unsharded", "idle (avg)"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    if with_cost:
        for col in ("step time", "exposed comm", "peak memory"):
            t.add_column(col, justify="right")
    for plan, m, extra in rows:
        cells = [plan.policy, str(m.groups), fmt_numel(m.root_numel), str(m.all_gathers), str(m.reduce_scatters),
                 fmt_bytes(m.all_gather_bytes), fmt_bytes(m.peak_unsharded_bytes), fmt_bytes(m.avg_idle_bytes)]
        if with_cost:
            e = extra or {}
            cells += [fmt_time(e["step_time"]) if "step_time" in e else "-",
                      fmt_time(e["exposed_comm"]) if "exposed_comm" in e else "-",
                      fmt_bytes(e["peak_memory"]) if "peak_memory" in e else "-"]
        t.add_row(*cells)
    return t


def groups_table(plan: Plan, trace: Trace, limit: int = 40) -> Table:
    t = Table(title=f"plan: {plan.policy}", title_justify="left")
    for col in ("#", "modules", "params", "bytes", "reshard_after_forward"):
        t.add_column(col, justify="left" if col == "modules" else "right")
    shown = plan.groups if len(plan.groups) <= limit else [*plan.groups[: limit - 1], plan.groups[-1]]
    for g in shown:
        i = plan.groups.index(g)
        numel = sum(trace.param(p).numel for p in g.params)
        nbytes = sum(trace.param(p).nbytes for p in g.params)
        raf = "root default (False)" if g.is_root and g.reshard_after_forward is False else str(
            g.reshard_after_forward)
        t.add_row(str(i), modules_label(g.modules), fmt_numel(numel) if g.params else "none", fmt_bytes(nbytes),
                  raf)
        if len(shown) < len(plan.groups) and i == limit - 2:
            t.add_row("...", f"({len(plan.groups) - limit} more groups)", "", "", "")
    return t


def verify_table(result: Any) -> Table:
    t = Table(title=f"verify: {result.world_size} ranks, {result.backend}, {result.steps} steps", title_justify="left")
    for col in ("check", "predicted", "measured", "result"):
        t.add_column(col)
    ok = "[green]ok[/green]"
    bad = "[red]MISMATCH[/red]"
    for kind in ("all_gather", "reduce_scatter"):
        measured = sorted({c[kind] for c in result.counted})
        t.add_row(f"{kind}s per step", str(result.predicted[kind]), "/".join(map(str, measured)),
                  ok if measured == [result.predicted[kind]] else bad)
        measured_b = sorted({c[kind] for c in result.counted_bytes})
        t.add_row(f"{kind} bytes per step", fmt_bytes(result.predicted_bytes[kind]),
                  "/".join(fmt_bytes(b) for b in measured_b),
                  ok if measured_b == [result.predicted_bytes[kind]] else bad)
    t.add_row("params vs unsharded reference (max abs diff)", f"<= {result.tolerance:g}",
              f"{result.max_abs_diff:.3g}", ok if result.params_match else bad)
    t.add_row("loss per step (FSDP / reference)", " ".join(f"{x:.5f}" for x in result.reference_losses),
              " ".join(f"{x:.5f}" for x in result.losses), "")
    return t


def memory_table(peak: int, breakdown: dict[str, int]) -> Table:
    t = Table(title=f"per-rank peak memory {fmt_bytes(peak)}", title_justify="left")
    t.add_column("part")
    t.add_column("bytes at peak", justify="right")
    for k, v in breakdown.items():
        t.add_row(k.replace("_", " "), fmt_bytes(v))
    return t


def explain_legend(reasons: dict[str, str]) -> str:
    return "\n".join(f"  {k}: {v}" for k, v in reasons.items())


def explain_table(rows: list, step_time: float, peak: int) -> Table:
    """``auto.explain`` as a table: per group its size, all-gather terms, boundary reason, best alternative."""
    t = Table(title=f"why the groups are where they are (step {fmt_time(step_time)}, peak {fmt_bytes(peak)})")
    for col in ("#", "modules", "size", "all-gather", "latency", "hidden by", "held by",
                "best alternative", "its step", "its peak"):
        t.add_column(col, overflow="fold")
    for r in rows:
        mods = r.modules[0] + (f" +{len(r.modules) - 1}" if len(r.modules) > 1 else "")
        t.add_row(str(r.group), mods, fmt_bytes(r.nbytes), fmt_time(r.all_gather), f"{r.latency_share:.0%}",
                  fmt_time(r.hidden_by), r.reason, r.alternative,
                  _delta_time(r.alternative_step, step_time), _delta_bytes(r.alternative_peak, peak))
    return t


def _delta_time(alt: float | None, base: float) -> str:
    return "-" if alt is None else f"{fmt_time(alt)} ({(alt - base) / base:+.2%})"


def _delta_bytes(alt: int | None, base: int) -> str:
    return "-" if alt is None else f"{fmt_bytes(alt)} ({(alt - base) / base:+.1%})"
