"""Everything the commands print for people: rich tables and one-line summaries, in the units of ``fmt.py``."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.segment import Segment
from rich.table import Table

from fsdp_planner.choices import GradientSync
from fsdp_planner.fmt import cell_text, fmt_bytes, fmt_count, fmt_gain, fmt_modules, fmt_numel, fmt_time, printable
from fsdp_planner.fsdp2.pitfalls import Finding, Severity
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.hardware.cluster import Cluster, Engine
from fsdp_planner.service.outcome import SearchSummary
from fsdp_planner.sim.budget import MemoryBudget
from fsdp_planner.sim.host_work import HostWork
from fsdp_planner.sim.memory import MemoryBreakdown
from fsdp_planner.sim.metrics import PlanMetrics
from fsdp_planner.sim.simulate import StepReport
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import is_within

if TYPE_CHECKING:  # what the job and calibration commands print: their modules load only with those commands
    from fsdp_planner.calibrate.gloo import GlooMeasurement
    from fsdp_planner.calibrate.overhead import OverheadMeasurement
    from fsdp_planner.planners.auto.explain import GroupExplanation
    from fsdp_planner.runtime.verify import VerifyResult


def _isatty(stream: TextIO | None) -> bool:
    """False for a closed or missing stream (``fsdp-planner models >&-`` leaves ``sys.stdout`` None)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich exits with status 1 on a closed pipe; raise instead so ``cli.main`` ends every command the same
        way (``fsdp-planner models | head -1``)."""
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def _check_buffer(self) -> None:
        """A failed write (closed pipe, full disk) drops what it could not write rather than keeping it for the
        next print."""
        try:
            super()._check_buffer()
        except OSError:
            with contextlib.suppress(Exception):
                del self._buffer[:]
            raise

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        """Every piece of text through ``printable``, whichever line or table shows it: a name from a file cannot
        act on the terminal. rich's own cursor moves (control segments) and styles (added after) are kept."""
        return super()._render_buffer(s if s.control else Segment(printable(s.text), s.style) for s in buffer)


# Piped, the tables keep to 120 columns (rich falls back to 80 otherwise), the width every table is laid out for.
PIPED_WIDTH = 120
console = _Console(width=None if _isatty(sys.stdout) else PIPED_WIDTH, soft_wrap=True)
notes = _Console(stderr=True, width=None if _isatty(sys.stderr) else PIPED_WIDTH, soft_wrap=True)  # --json clean


def set_quiet(quiet: bool) -> None:
    """``--quiet``: no notes and no progress on stderr (errors are printed by ``cli.main``, not here)."""
    notes.quiet = quiet


@contextlib.contextmanager
def progress(description: str) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while a step that may take seconds runs (tracing, auto's search,
    a fake-world check, a torchrun job, a calibration); only on a terminal, never with ``--quiet``, and gone when the
    step ends (``transient``), so piped and ``--json`` output stays clean."""
    if notes.quiet or not notes.is_terminal:
        yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=notes, transient=True) as bar:
        bar.add_task(escape(description), total=None)  # it may name a cluster or model from a file
        yield


def plain(text: str) -> None:
    """A line on stdout printed as written, never read as rich markup: for lines that quote a name or a path the
    user gave (``plan written to p[1].json``)."""
    console.print(text, highlight=False, markup=False)


_said: set[str] = set()  # the notes one command printed: a model traced again (each split, each TP degree
# auto compares) says its notes once


def _first_time(text: str) -> bool:
    """Whether this command has not said ``text`` yet (and it now has)."""
    new = text not in _said
    _said.add(text)
    return new


def note(text: str) -> None:
    """``note: ...`` on stderr, for an option that has no effect or a part of the work left out; once a command."""
    if _first_time(text):
        notes.print(f"note: {text}", highlight=False, markup=False)


def tp_batch(tp: int) -> str:
    """What ``--tp d`` makes of ``--batch`` (torchtitan's local batch): said where a step is judged, as the same
    ``--batch`` without ``--tp`` runs d times the sequences (a new user compared the two steps as one job's)."""
    return (f"--tp {tp}: each batch is one data-parallel rank's, its {tp} TP GPUs sharing it: the step runs 1/{tp} "
            "of the sequences a step without --tp runs at the same --batch")


def trace_note(text: str) -> None:
    """What a trace notes about the model (dim, once a command: auto traces the model again at each split)."""
    if _first_time(text):
        notes.print(f"[dim]note: {escape(text)}[/dim]", highlight=False)


def new_command() -> None:
    """Forget the notes said: the next command (``main`` again, in one process) says its own."""
    _said.clear()


def workload_label(label: str, micro_batches: int, gradient_sync: GradientSync = GradientSync.LAST) -> str:
    """A model's label with its workload, and the micro-batches of its step when more than one (the label's batch
    is then one micro-batch's), saying which of them reduce-scatter."""
    if micro_batches == 1:
        return label
    return f"{label} per micro-batch, {micro_batches} micro-batches a step{sync_label(gradient_sync)}"


def sync_label(gradient_sync: GradientSync) -> str:
    """Which micro-batches reduce-scatter, for a label (``--gradient-sync``)."""
    return ", each reduce-scattering" if gradient_sync is GradientSync.EVERY else ", reduce-scattering in the last"


def model_line(name: str, tr: Trace) -> str:
    """The model as built: its params' count and bytes (in their dtypes, named where not all float32: the
    simulation may store them otherwise, as its note says), modules and FLOPs."""
    dtypes = sorted({p.dtype for p in tr.params})
    built = f" in {' and '.join(dtypes)}" if dtypes and dtypes != ["float32"] else ""
    return (f"[bold]{escape(name)}[/bold]: {fmt_count(tr.numel, 'param')} ({fmt_bytes(tr.nbytes)}{built}), "
            f"{fmt_count(len(tr.modules), 'module')}, "
            f"{tr.fwd_flops / 1e9:.3g} GFLOP forward, {tr.bwd_flops / 1e9:.3g} GFLOP backward")


def fmt_peak(peak: int, budget: MemoryBudget | None) -> str:
    """A per-rank reserved peak, marked when it exceeds the budget (such a plan is not a job anyone can run)."""
    if budget is None or budget.fits(peak):
        return fmt_bytes(peak)
    return f"[red]{fmt_bytes(peak)} > budget[/red]"


def fmt_margin(peak: int, budget: MemoryBudget) -> str:
    """A reserved peak's distance below the budget (``4.4 GiB (5.9%)``), or how far over it is, in red."""
    gap = budget.limit - peak
    shown = f"{fmt_bytes(abs(gap))} ({abs(gap) / budget.limit:.1%})"
    return shown if gap >= 0 else f"[red]{shown} over[/red]"


def margin_line(peak: int, budget: MemoryBudget) -> str:
    """``peak 70.1 GiB reserved, 4.4 GiB (5.9%) below the 74.5 GiB budget (80 GB H100 less 5% headroom)``."""
    return escape(f"peak {fmt_bytes(peak)} reserved, {budget.margin(peak)}")


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
_ITEMSIZE_NAMES = {4: "fp32", 2: "bf16"}  # a simulated precision's unsharded params (``Precision.gather_bytes``)


def metrics_dtype(tr: Trace, precision: Precision | None) -> str:
    """The dtype of a comparison table's byte columns, named in its caption: the simulated precision's
    unsharded params (``plan_metrics(precision=)``; the fp32 groups' in fp32), else the params' own dtype."""
    if precision is not None:
        name = _ITEMSIZE_NAMES.get(precision.gather_bytes, f"{precision.gather_bytes}-byte")
        return f"{name}, fp32 groups in fp32" if tr.full_precision and precision.gather_bytes != 4 else name
    dtypes = {p.dtype for p in tr.params}
    return _DTYPE_NAMES.get(next(iter(dtypes)), "own dtype") if len(dtypes) == 1 else "own dtypes"


POLICY_WORD = 24  # the widest a policy column grows to keep one word of a name on one line


def comparison_table(title: str, rows: Sequence[tuple[Plan, PlanMetrics, StepReport | None]],
                     budget: MemoryBudget | None = None, dtype: str = "own dtypes", float8_gather: bool = False
                     ) -> Table:
    """Policies side by side; step time, exposed communication, peak allocated and reserved memory (reserved
    marked over the ``budget``) and the margin below the budget when simulated on a cluster. The metrics' byte
    columns are all in one ``dtype`` (``metrics_dtype``), which the caption under them names (``float8_gather``:
    the simulated AG bytes gather the float8 Linears' weights in float8). Simulated, the table
    keeps to 120 columns: the root's params, the collective counts and the idle bytes are left to ``simulate``."""
    with_cost = any(report for _, _, report in rows)
    t = Table(title=title, title_justify="left")
    shape = ("policy", "groups", "AC", "AG bytes", "unsharded") if with_cost else \
        ("policy", "groups", "root params", "AC", "AG", "RS", "AG bytes", "peak unsharded", "idle (avg)")
    # a policy's name is its settings (size(100000000)): wrapped at its spaces onto more lines, never cut, and as
    # wide as its longest word (module(GPT2Block)) up to POLICY_WORD, beyond which it folds
    word = max((len(w) for plan, _, _ in rows for w in cell_text(plan.policy).split()), default=0)
    for col in shape:
        t.add_column(col, justify="left" if col == "policy" else "right", overflow="fold" if col == "policy" else None,
                     min_width=min(word, POLICY_WORD) if col == "policy" else None)
    if with_cost:
        for col in ("step time", "exposed comm", "allocated", "reserved", "margin")[:5 if budget else 4]:
            t.add_column(col, justify="right", min_width=len(col))  # a header on one line: the policy folds
    for plan, m, report in rows:
        ag_bytes = fmt_bytes(report.all_gather_bytes if report else m.all_gather_bytes)
        if with_cost:
            cells = [escape(cell_text(plan.policy)), str(m.groups), ac_cell(plan), ag_bytes,
                     fmt_bytes(m.peak_unsharded_bytes)]
        else:
            cells = [escape(cell_text(plan.policy)), str(m.groups), fmt_numel(m.root_numel), ac_cell(plan),
                     str(m.all_gathers), str(m.reduce_scatters), ag_bytes, fmt_bytes(m.peak_unsharded_bytes),
                     fmt_bytes(m.avg_idle_bytes)]
        if with_cost:
            cells += ([fmt_time(report.step_time), fmt_time(report.exposed_comm), fmt_bytes(report.peak_memory),
                       # with a margin column, an over-budget peak is just red: the margin says by how much
                       f"[red]{fmt_bytes(report.reserved_memory)}[/red]"
                       if budget is not None and not budget.fits(report.reserved_memory)
                       else fmt_peak(report.reserved_memory, budget)] if report else ["-"] * 4)
            if budget is not None:
                cells.append(fmt_margin(report.reserved_memory, budget) if report else "-")
        t.add_row(*cells)
    if with_cost:
        # under float8's all-gather the gathered float8 weights are 1 byte in AG bytes and the memory breakdown,
        # while the unsharded column (plan_metrics, which knows no float8) counts them in the dtype (a trial read
        # "in bf16" of both)
        said = (f"AG bytes in {dtype} but the float8 Linears' weights, gathered in float8 (FSDP2's float8 "
                f"all-gather), and unsharded in {dtype}, those weights too (the memory breakdown holds them in "
                "float8)") if float8_gather else \
            f"AG bytes and unsharded in {dtype} (the simulated precision, as in the memory breakdown)"
        t.caption = (f"{said}: what one rank's all-gathers return a step and the most params held unsharded at once; "
                     "allocated: the peak of live tensors, reserved: what the caching allocator holds at it")
    else:
        t.caption = (f"AG bytes, peak unsharded and idle (avg) in {dtype}: what one rank's all-gathers return a "
                     "step, the most params held unsharded at once, and unsharded bytes not being read, averaged "
                     "over ops")
    if with_cost and budget is not None:
        t.caption += escape(f"; margin: below the {fmt_bytes(budget.limit)} budget per rank ({budget.source})")
    return t


def groups_table(plan: Plan, tr: Trace, limit: int = 40) -> Table:
    """One plan's groups: modules, params, bytes, reshard_after_forward (the first ``limit`` - 1 and the root)."""
    transforms = plan.transforms()
    t = Table(title=f"plan: {escape(plan.policy + (f'; {transforms}' if transforms else ''))}", title_justify="left")
    for col in ("#", "modules", "params", "bytes", "reshard_after_forward", "checkpointed"):
        t.add_column(col, justify="left" if col == "modules" else "right")
    checkpointed = checkpointed_per_group(plan)
    shown = list(range(len(plan.groups))) if len(plan.groups) <= limit else [*range(limit - 1), len(plan.groups) - 1]
    for i in shown:
        g = plan.groups[i]
        numel = sum(tr.param(p).numel for p in g.params)
        nbytes = sum(tr.param(p).nbytes for p in g.params)
        raf = "root default (False)" if g.is_root and g.reshard_after_forward is False else str(g.reshard_after_forward)
        ac = checkpointed[i]
        # the whole group: how; some of its modules: how, and which (a trial read "blocks.0, blocks.1" above
        # "full" as two kinds)
        checkpoint = how_checkpointed(plan, ac) if ac and ac == list(g.modules) else \
            f"{how_checkpointed(plan, ac)}: {escape(fmt_modules(ac, 1))}" if ac else ""
        fp32 = f" (computes in {g.param_dtype})" if g.param_dtype else ""  # its own MixedPrecisionPolicy
        t.add_row(str(i), escape(fmt_modules(g.modules) + fp32), fmt_numel(numel) if g.params else "none",
                  fmt_bytes(nbytes), raf, checkpoint)
        if len(shown) < len(plan.groups) and i == limit - 2:
            t.add_row("...", f"({len(plan.groups) - limit} more groups)", "", "", "", "")
    split = [f"TP {plan.tp_degree}"] * (plan.tp_degree > 1) + [f"EP {plan.ep_degree}"] * (plan.ep_degree > 1)
    if split:  # a rank holds less of each group than the model does (the order policy's sizes count the model's)
        t.caption = (f"params and bytes: the model's, in its own dtype, before {' and '.join(split)} split them "
                     "across ranks (as --target-bytes counts them); what one rank holds and gathers: the table below")
    return t


def findings_table(findings: Sequence[Finding]) -> Table:
    """``check``'s findings: errors first, each with the module to change and the fix."""
    t = Table(title="findings", title_justify="left", show_lines=True)
    for col in ("severity", "code", "module", "finding", "fix"):
        t.add_column(col, justify="left", overflow="fold")
    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
    for f in sorted(findings, key=lambda f: order[f.severity]):
        style = {Severity.ERROR: "red", Severity.WARNING: "yellow"}.get(f.severity, "cyan")
        module = escape(cell_text(f.module)) if f.module else "(root)"
        t.add_row(f"[{style}]{f.severity.value}[/{style}]", f.code.value, module, escape(f.message), escape(f.fix))
    return t


def ac_cell(plan: Plan) -> str:
    """The comparison table's AC cell: how many modules are checkpointed in full and how many op-level."""
    full, op, off = len(plan.activation_checkpointing), len(plan.selective_checkpointing), \
        len(plan.activation_offloading)
    return " + ".join([*([f"{full} full"] if full else []), *([f"{op} op"] if op else []),
                       *([f"{off} offloaded"] if off else [])]) or "-"


def how_checkpointed(plan: Plan, modules: Sequence[str]) -> str:
    """How ``modules`` are checkpointed: ``full``, ``op POLICY`` (op-level selective checkpointing) or ``offload``
    (not checkpointed: their saved activations on the host), the kinds among them joined by "and"."""
    kinds = dict.fromkeys(sorted("offload" if m in plan.activation_offloading else
                                 f"op {plan.selective_checkpointing[m].value}" if m in plan.selective_checkpointing
                                 else "full" for m in modules))
    return " and ".join(kinds)


def checkpointed_per_group(plan: Plan) -> list[list[str]]:
    """The plan's checkpointed modules (in full or op-level) and offloaded ones by the group whose modules hold them
    (the root: those no other holds)."""
    out: list[list[str]] = [[] for _ in plan.groups]
    for m in [*plan.activation_checkpointing, *plan.selective_checkpointing, *plan.activation_offloading]:
        i = next((i for i, g in enumerate(plan.inner_groups) if any(is_within(m, gm) for gm in g.modules)),
                 len(plan.groups) - 1)
        out[i].append(m)
    return out


def step_lines(name: str, plan_label: str, cluster: Cluster, r: StepReport, offloaded: bool = False) -> list[str]:
    """``offloaded``: the plan offloads activations, whose host copies the copy time includes."""
    copies = "FSDP2 copy-outs and activation copies" if offloaded else "FSDP2 copy-outs"
    # the host figure an offload plan's step depends on, and where it comes from
    given = "--cpu-optimizer-rate" in cluster.cpu_optimizer_source
    host = [f"optimizer step on the CPU at {cluster.cpu_optimizer_rate / 1e6:,.1f} M elements/s per rank "
            f"({escape(cluster.cpu_optimizer_source)}{'' if given else '; --cpu-optimizer-rate to give yours'})"] \
        if r.cpu_optimizer_time else []
    device = "ranks' CPUs" if cluster.engine is Engine.HOST else "GPU"
    return [
        f"[bold]{escape(name)}[/bold] with [bold]{escape(plan_label)}[/bold] on {escape(cluster.describe())}",
        f"step time {fmt_time(r.step_time)}  compute {fmt_time(r.compute_time)}"
        f"{f' (recompute {fmt_time(r.recompute_time)})' if r.recompute_time else ''}"
        # the optimizer step after backward (on the host under CPUOffloadPolicy) is part of the step time
        f"{f'  optimizer step on the CPU {fmt_time(r.cpu_optimizer_time)}' if r.cpu_optimizer_time else ''}"
        # (a gloo cluster's ranks are CPU processes: their own optimizer step is no GPU's)
        f"{f'  optimizer step on the {device} {fmt_time(r.gpu_optimizer_time)}' if r.gpu_optimizer_time else ''}"
        f"  exposed comm "
        f"{fmt_time(r.exposed_comm)}  {copies} {fmt_time(r.copy_time)}  waiting for the host "
        f"{fmt_time(r.host_wait)} (host busy {fmt_time(r.host_time)}, {r.hooks} hooks)  lower bound "
        f"{fmt_time(r.lower_bound)}",
        f"{fmt_count(r.all_gathers, 'all-gather')} ({fmt_bytes(r.all_gather_bytes)}), "
        f"{fmt_count(r.reduce_scatters, 'reduce-scatter')} ({fmt_bytes(r.reduce_scatter_bytes)})"
        + (f", {fmt_count(r.all_reduces, 'all-reduce')} across replicas ({fmt_bytes(r.all_reduce_bytes)})"
           if r.all_reduces else "")
        + f" per step on mesh {r.mesh}; comm busy: all-gather {fmt_time(r.comm_time['all_gather'])}, "
        + _reduce_scatter_busy(r)
        + (f", all-reduce {fmt_time(r.comm_time['all_reduce'])}" if r.all_reduces else ""),
        *_tp_line(r),
        *_ep_line(r),
        *host,
    ]


def _reduce_scatter_busy(r: StepReport) -> str:
    """The reduce-scatter stream's busy time; on a shard group of one rank FSDP2 issues none, yet copies the grads
    into its buffer (``foreach_reduce`` at world size 1): said as that (it read as reduce-scatters, a trial)."""
    busy = r.comm_time["reduce_scatter"]
    if r.reduce_scatters == 0 and busy > 0:
        return f"reduce-scatter none (the grads' copy into its buffer {fmt_time(busy)})"
    return f"reduce-scatter {fmt_time(busy)}"


def _tp_line(r: StepReport) -> list[str]:
    """TP's collectives of one rank's step (on the compute stream: part of its compute time), with TP only."""
    if r.tp_degree == 1:
        return []
    return [f"TP {r.tp_degree}: {fmt_count(r.tp_all_gathers, 'all-gather')} ({fmt_bytes(r.tp_all_gather_bytes)}), "
            f"{fmt_count(r.tp_reduce_scatters, 'reduce-scatter')} ({fmt_bytes(r.tp_reduce_scatter_bytes)}), "
            f"{fmt_count(r.tp_all_reduces, 'all-reduce')} ({fmt_bytes(r.tp_all_reduce_bytes)}) per step in a node, "
            f"{fmt_time(r.tp_time)} of the compute stream"]


def fake_world_table(title: str, rows: Mapping[str, tuple[int, int]]) -> Table:
    """Predicted beside measured per quantity (counts, bytes, peak memory): equal, or the peak's relative error."""
    t = Table(title=title)
    for column in ("per step", "predicted", "measured", ""):
        t.add_column(column, justify="left" if column == "per step" else "right")
    for key, (p, m) in rows.items():
        as_bytes = key.endswith("bytes") or key == "peak_memory"
        shown = (fmt_bytes(p), fmt_bytes(m)) if as_bytes else (str(p), str(m))
        error = f"{p / m - 1:+.1%}" if m else "-"
        # (a byte count off by less than its shown precision says by how much: both sides read "3.01 GiB")
        off = f" ({p - m:+,} B)" if as_bytes and p != m else ""
        verdict = error if key == "peak_memory" else "exact" if p == m else f"MISMATCH{off}"
        t.add_row(key.replace("_", " "), *shown, verdict)
    return t


def memory_table(peak: int, reserved: int, breakdown: Mapping[str, int], budget: MemoryBudget | None = None
                 ) -> Table:
    """The allocated peak by category, and what the caching allocator reserves with its margin below the budget
    (marked when over it)."""
    margin = ""
    if budget is not None:
        margin = escape(f", {budget.margin(reserved)}")
        margin = margin if budget.fits(reserved) else f"[red]{margin}[/red]"
    t = Table(title=f"per-rank peak memory {fmt_bytes(peak)} allocated, {fmt_bytes(reserved)} reserved{margin}",
              title_justify="left")
    t.add_column("part")
    t.add_column("bytes at peak", justify="right")
    for k, v in breakdown.items():
        if v:
            t.add_row(k.replace("_", " "), fmt_bytes(v))
    return t


def strategy_table(rows: Mapping[str, MemoryBreakdown], title: str) -> Table:
    """Per-rank memory of each strategy; a category column only where some row has it."""
    values = {name: b.to_dict() for name, b in rows.items()}
    cats = [c for c in MemoryBreakdown().to_dict() if c != "total" and any(v[c] for v in values.values())]
    t = Table(title=title, title_justify="left")
    t.add_column("strategy")
    for c in [*cats, "total"]:
        t.add_column(c.replace("_", " "), justify="right")
    for name, v in values.items():
        t.add_row(name, *(fmt_bytes(v[c]) for c in [*cats, "total"]))
    t.caption = ("each row at its own peak moment (the end of forward when activations dominate: grads set to None "
                 "by zero_grad do not exist yet); fsdp casts each group to the compute dtype as it gathers it "
                 "(unsharded params), the others keep a compute-dtype copy of every weight (compute copies)")
    return t


OK, BAD = "[green]ok[/green]", "[red]MISMATCH[/red]"


def verify_table(result: VerifyResult, cluster: str | None = None, comparable: bool = True) -> Table:
    """Predicted beside measured for each check; the step time when one was timed (predicted with ``cluster``;
    ``comparable``: on the hardware that ran it, else no error is shown beside it)."""
    t = Table(title=f"verify: {result.world_size} ranks, {result.backend}, {result.steps} steps"
              + (f" from step {result.start_step}" if result.start_step else ""), title_justify="left")
    for col in ("check", "predicted", "measured", "result"):  # (a param's name folds: cut short, it named none)
        t.add_column(col, overflow="fold" if col == "measured" else "ellipsis")
    for row in [*_collective_rows(result), *_parity_rows(result), *_checkpoint_rows(result),
                *_step_time_rows(result, cluster, comparable)]:
        t.add_row(*row)
    return t


def _collective_rows(result: VerifyResult) -> list[tuple[str, ...]]:
    """Per collective kind, its count and bytes per step: predicted, and what each rank counted."""
    rows = []
    for kind in result.predicted:
        if kind == "all_reduce" and not result.predicted[kind] and not any(c[kind] for c in result.counted):
            continue  # not HSDP
        counts = sorted({c[kind] for c in result.counted})
        rows.append((f"{kind}s per step", str(result.predicted[kind]), "/".join(map(str, counts)),
                     OK if counts == [result.predicted[kind]] else BAD))
        nbytes = sorted({c[kind] for c in result.counted_bytes})
        rows.append((f"{kind} bytes per step", fmt_bytes(result.predicted_bytes[kind]),
                     "/".join(map(fmt_bytes, nbytes)), OK if nbytes == [result.predicted_bytes[kind]] else BAD))
    return rows


def _parity_rows(result: VerifyResult) -> list[tuple[str, ...]]:
    """The trained params against the unsharded reference's (the worst one named when over its bound), and the
    losses of both."""
    worst = f" ({escape(cell_text(result.worst_param))}, {result.param_error:.3g}x its bound)" \
        if not result.params_match and result.worst_param else ""
    measured = f"{result.max_abs_diff:.3g}{worst}"
    if not math.isfinite(result.max_abs_diff) and not all(map(math.isfinite, [*result.losses,
                                                                             *result.reference_losses])):
        measured = "NaN: training diverged (a loss is not finite), so the params are NaN"  # not 'inf x its bound'
    rows = [(f"params vs unsharded reference (max abs diff, {result.precision})", parity_bound(result),
             measured, OK if result.params_match else BAD)]
    if result.replica_diff is not None:
        from fsdp_planner.runtime.worker import REPLICA_ULPS

        drifted = f" ({escape(cell_text(result.replica_param))}, {result.replica_error:.3g}x its bound)" \
            if not result.replicas_match and result.replica_param else ""
        rows.append(("the ranks' copies of each param (max spread)",
                     f"<= {REPLICA_ULPS} steps of its dtype at its scale", f"{result.replica_diff:.3g}{drifted}",
                     OK if result.replicas_match else BAD))
    return [*rows,
            ("loss per step (reference / FSDP)", " ".join(f"{x:.5f}" for x in result.reference_losses),
             " ".join(f"{x:.5f}" for x in result.losses), "")]


def parity_bound(result: VerifyResult) -> str:
    """What the params may differ by, in the words of what the job trained: fp32's bound, or a few steps of the
    16-bit dtype its params or its compute were in."""
    if not result.bound:
        return f"<= {result.tolerance:g}"
    from fsdp_planner.runtime.worker import LOW_PRECISION_ULPS

    return f"<= {LOW_PRECISION_ULPS} steps of {result.bound} at each param's scale"


def _checkpoint_rows(result: VerifyResult) -> list[tuple[str, ...]]:
    """The state restored from ``--load-checkpoint`` (entries equal to the saved ones), and where
    ``--save-checkpoint`` wrote."""
    rows = []
    if result.loaded is not None:
        loaded, bad_keys = result.loaded, result.loaded["mismatched"]
        rows.append((f"state restored from step {loaded['step']} ({loaded['world']} ranks, "
                     f"{escape(loaded['policy'] or 'plan')})", f"{loaded['tensors']} entries as saved",
                     f"{loaded['tensors'] - len(bad_keys)} equal"
                     + (f" (differ: {escape(', '.join(map(cell_text, bad_keys[:3])))})" if bad_keys else ""),
                     OK if result.checkpoint_match else BAD))
        if local := loaded.get("rank_local"):
            first = escape(cell_text(local[0])) + (", ..." if len(local) > 1 else "")
            rows.append((f"{len(local)} buffers each rank held its own of ({first})",
                         "one rank's copy", "every rank restored one rank's copy (DCP saves one copy of a tensor "
                         "that is not a DTensor; FSDP2 syncs no buffer: SyncBatchNorm keeps them equal)", ""))
    if result.saved is not None:
        rows.append(("checkpoint saved", f"step {result.start_step + result.steps}", escape(result.saved), ""))
    return rows


def _step_time_rows(result: VerifyResult, cluster: str | None, comparable: bool = True) -> list[tuple[str, ...]]:
    """The timed steps' median beside the prediction on ``cluster``, or why there is none; no error between a GPU
    cluster's prediction and CPU ranks (a new user read "-84.7%" as the model's)."""
    if result.measured_step is None:
        return []
    if not comparable and result.predicted_step is not None:
        return [(f"step time (forward + backward, median of {len(result.step_seconds)})",
                 f"{fmt_time(result.predicted_step)} on {escape(cluster or '')}", fmt_time(result.measured_step),
                 "not comparable (CPU ranks)")]
    error = result.step_error
    predicted = (f"{fmt_time(result.predicted_step)} on {escape(cluster or '')}" if result.predicted_step is not None
                 else "(give --cluster to predict)" if cluster is None else "(not predicted: see the note)")
    return [(f"step time (forward + backward, median of {len(result.step_seconds)})", predicted,
             fmt_time(result.measured_step), f"{error:+.1%}" if error is not None else "")]


def auto_line(search: SearchSummary) -> str:
    plan = search.plan
    ac, op = len(plan.activation_checkpointing), len(plan.selective_checkpointing)
    owning = sum(1 for g in plan.groups if g.params)  # as the tables count: the root when it owns params
    groups = fmt_count(owning, "group") if plan.inner_groups else "the root alone"
    checkpointed = (f", {fmt_count(ac, 'module')} checkpointed" if ac else "") + \
        (f", {fmt_count(op, 'module')} with op-level checkpointing" if op else "") + \
        (f", activations of {fmt_count(len(plan.activation_offloading), 'module')} offloaded"
         if plan.activation_offloading else "")
    layout = f", HSDP {plan.mesh.describe()}" if plan.mesh and plan.mesh.replicate > 1 else ""
    if plan.tensor_parallel is not None and plan.tp_degree > 1:
        dp = plan.mesh or Mesh.flat(search.cluster.world_size)  # (the search's cluster: the data-parallel view)
        layout = (f", FSDP {dp.shard}" if dp.replicate == 1 else f", HSDP {dp.describe()}") + \
            f" x {plan.tensor_parallel.describe()}"
    # auto's last resorts, said where the step time is: an offload plan's step is mostly the CPU optimizer's
    dims = "/".join(str(d) for d in sorted(set(plan.shard_dims.values())))
    layout += (f", {fmt_count(len(plan.shard_dims), 'param')} sharded on dim {dims}" if dims else "") + \
        (f", CPU offload (optimizer step on the CPU {fmt_time(search.report.cpu_optimizer_time)} at "
         f"{search.cluster.cpu_optimizer_rate / 1e6:,.1f} M elements/s per rank: {search.cluster.cpu_optimizer_source})"
         if plan.offload else "")
    line = (f"auto: {groups}{checkpointed}{layout}, "
            f"step {fmt_time(search.report.step_time)}, "
            f"{fmt_bytes(search.report.reserved_memory)} reserved within the budget {fmt_bytes(search.budget)} "
            f"({search.budget_source}); {fmt_count(search.evaluated, 'plan')} simulated ({search.refined} "
            f"of them refining, where --search-effort allows {search.effort:,}) in {search.seconds:.1f} s")
    if search.best_baseline is None or search.best_baseline_step is None:
        line += "; no classic policy with its defaults (no checkpointing) fits this budget"
    else:
        gain = fmt_gain(search.report.step_time, search.best_baseline_step)
        without = " without EP" if plan.expert_parallel is not None else ""  # (the classic plans run none)
        line += (f"; {f'{gain} than' if gain else 'ties with'} the best classic policy that fits on this layout"
                 f"{without}, {search.best_baseline}")
    if len(search.layouts) > 1:
        line += "\n" + mesh_line(search)
    return escape(line)  # the budget's source names the GPU a cluster file gives: plain text, never markup


def mesh_line(search: SearchSummary) -> str:
    """The layouts auto compared (replicate x shard, and the TP and EP degrees), each with its best plan's step
    time and reserved memory: by TP degree, then EP degree, then the widest shard groups first."""
    def order(name: str) -> tuple[int, int, int]:
        layout, _, ep = name.partition(", EP ")
        mesh, _, tp = layout.partition(" x TP ")
        return int(tp or 1), int(ep or 1), -int(mesh.partition("x")[2])

    parts = []
    for layout in sorted(search.layouts, key=lambda m: order(m.name)):
        said = f" ({fmt_bytes(layout.reserved)}, does not fit)" if not layout.fits else \
            " (CPU offload)" if layout.offload else ""  # (what lets it fit beside layouts that do not: a trial)
        parts.append(f"{layout.name} {fmt_time(layout.step_time)}{said}")
    tp = " x TP" if any(" x TP " in x.name for x in search.layouts) else ""
    ep = ", EP" if any(", EP " in x.name for x in search.layouts) else ""
    # (auto's TP degrees, each at the step's sequences: TP d's data-parallel ranks run d x the batch; where --tp d or
    # a config fixed the degree, every layout runs the batch given per data-parallel rank, 1/d of a step without it)
    same = ("" if not tp else "; each at the batch given per data-parallel rank, the TP degree fixed"
            if search.tp_fixed else "; each at the same step's sequences, TP d at d x the batch per data-parallel rank")
    return f"  layouts (replicate x shard{tp}{ep}{same}): {', '.join(parts)}"


def explain_table(rows: Sequence[GroupExplanation], step_time: float, peak: int, collapse: bool = False) -> Table:
    """Per group its size, all-gather terms, what holds its boundary and the best one-step alternative;
    ``collapse``: consecutive groups that read the same (a run of identical blocks) share one row."""
    t = Table(title=f"why the groups are where they are (step {fmt_time(step_time)}, {fmt_bytes(peak)} reserved)")
    for col in ("#", "modules", "gathered", "all-gather", "latency", "hidden by", "held by", "best alternative",
                "its step", "its reserved"):
        t.add_column(col, overflow="fold")
    cells = [[fmt_bytes(r.nbytes), fmt_time(r.all_gather), f"{r.latency_share:.0%}", fmt_time(r.hidden_by),
              r.reason.value, r.alternative.value if r.alternative else "-",
              _delta_time(r.alternative_step, step_time), _delta_bytes(r.alternative_peak, peak)] for r in rows]
    k = 0
    while k < len(rows):
        end = k + 1
        while collapse and end < len(rows) and cells[end] == cells[k]:
            end += 1
        if end - k > 1:
            first, last = fmt_modules(rows[k].modules, 1), fmt_modules(rows[end - 1].modules, 1)
            t.add_row(f"{rows[k].group}-{rows[end - 1].group}", escape(f"{first} … {last} ({end - k} groups)"),
                      *cells[k])
        else:
            t.add_row(str(rows[k].group), escape(fmt_modules(rows[k].modules, 1)), *cells[k])
        k = end
    return t


def host_line(r: StepReport, cluster: Cluster, work: HostWork) -> str:
    """How much of the step FSDP2's host work is, the sum that makes it, and whether the GPU waits for it."""
    o = cluster.overhead
    if not r.host_time:
        return "host: not modelled (the cluster's overhead is zero)"
    terms = [f"{fmt_count(work.hooks, 'FSDP2 hook')} x {fmt_time(o.hook_seconds)}",
             f"{work.params:,.4g} params x {fmt_time(o.param_seconds)}"]
    if o.module_seconds:
        terms.append(f"{fmt_count(work.module_calls, 'module call')} x {fmt_time(o.module_seconds)}")
    if cluster.engine is Engine.HOST:
        return (f"host: {' + '.join(terms)} = {fmt_time(r.host_time)} of the {fmt_time(r.step_time)} step (CPU "
                "ranks: each rank runs them between its ops, nothing overlaps)")
    terms.append(f"{fmt_count(work.ops, 'op')} x {fmt_time(o.op_seconds)}")
    share = r.host_wait / r.step_time if r.step_time else 0.0
    verdict = (f"the host is the bottleneck: the GPU waits {fmt_time(r.host_wait)} for it, {share:.0%} of the step"
               if share >= 0.05 else f"hidden behind the GPU's work: it waits {fmt_time(r.host_wait)} for the host")
    if work.waits:  # the host's lead is gone after each: the GPU then waits for what it launches next
        verdict += (f"; the host waits for the GPU {fmt_count(work.waits, 'time')} ({work.forward_waits:,} in "
                    "forward) to read an op's output (a router's token counts), its lead gone each time")
    return f"host: {' + '.join(terms)} = {fmt_time(r.host_time)} of the {fmt_time(r.step_time)} step ({verdict})"


def explanation(rows: Sequence[GroupExplanation], step_time: float, peak: int, collapse: bool = False) -> list[Any]:
    """``--explain``: the table of ``explain_table`` and the legend of the reasons it names; a line when the plan
    has no group but the root (no boundary to explain)."""
    if not rows:
        return ["why: every param stays with the root (one all-gather before forward, kept until backward ends): "
                "no group boundary to explain"]
    legend = "held by:\n" + "\n".join(f"  {r.value}: {r.description}" for r in dict.fromkeys(r.reason for r in rows))
    return [explain_table(rows, step_time, peak, collapse), legend]


def _delta_time(alt: float | None, base: float) -> str:
    return "-" if alt is None else f"{fmt_time(alt)} ({_signed_share((alt - base) / base, 2)})"


def _delta_bytes(alt: int | None, base: int) -> str:
    return "-" if alt is None else f"{fmt_bytes(alt)} ({_signed_share((alt - base) / base, 1)})"


def _signed_share(x: float, digits: int) -> str:
    """``x`` as a signed percentage; a change too small for ``digits`` decimals in two significant digits (a tie's
    alternative read "-0.00%"); float noise (below 1e-9) is no change."""
    x = 0.0 if abs(x) < 1e-9 else x  # (a tie's step read "-1.7e-14%")
    shown = f"{x:+.{digits}%}"
    return shown if x == 0 or float(shown[:-1]) != 0 else f"{x * 100:+.2g}%"


def cost_line(collective: str, nbytes: int, ranks: int, cluster: Cluster, seconds: float,
              bus_bandwidth: float) -> str:
    where = (f"{collective} of {fmt_bytes(nbytes)} over {ranks} rank{'s' if ranks != 1 else ''} on "
             f"{escape(cluster.describe())}")
    if seconds == 0:
        why = "nothing to move" if nbytes == 0 else "one rank holds everything"
        return f"{where}: 0 s ({why})"
    gbps = bus_bandwidth / 1e9  # whole GB/s on GPUs; a host's fraction of one keeps three digits
    return f"{where}: {fmt_time(seconds)} (bus bandwidth {gbps:.0f} GB/s)" if gbps >= 9.5 else \
        f"{where}: {fmt_time(seconds)} (bus bandwidth {gbps:.3g} GB/s)"


def json_ready(value: Any) -> Any:
    """Enums and tuples as JSON writes them (for ``--json``)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(json_ready(k)): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def gloo_table(m: GlooMeasurement) -> Table:
    """``calibrate --backend gloo``: each collective's measured times and fitted line."""
    t = Table(title=f"gloo collectives on {m.world} ranks, as FSDP2 runs them (buffers allocated and copied in)")
    for col in ("size", *(f.kind.replace("_", "-") for f in m.collectives)):
        t.add_column(col, justify="right")
    for i, (size, _) in enumerate(m.collectives[0].samples):
        t.add_row(fmt_bytes(size), *(fmt_time(f.samples[i][1]) for f in m.collectives))
    t.caption = "; ".join(f"{f.kind.replace('_', '-')} line: latency {fmt_time(f.alpha)}, bus bandwidth "
                          f"{fmt_bytes(f.busbw)}/s (rms {f.rms:.0%}; the measured times are what the simulator uses)"
                          for f in m.collectives)
    return t


def overhead_table(m: OverheadMeasurement | GlooMeasurement) -> Table:
    """``calibrate --overhead`` / ``--backend gloo``: each measured plan beside the fitted line, then the fitted
    figures."""
    where = getattr(m, "device", None) or f"{m.world} gloo ranks"
    t = Table(title=f"FSDP2 overhead on {where}: {m.ops} ops, {m.params} params a step; "
                    f"without FSDP {fmt_time(m.plain_seconds)}")
    for col in ("groups", "hooks", "measured step", "fitted", "error"):
        t.add_column(col, justify="right")
    for p in m.plans:
        t.add_row(str(p.groups), str(p.hooks), fmt_time(p.seconds), fmt_time(p.predicted),
                  f"{p.seconds / p.predicted - 1:+.1%}")
    o = m.overhead
    t.caption = (f"per hook {fmt_time(o.hook_seconds)}, per param {fmt_time(o.param_seconds)}, per op "
                 f"{fmt_time(o.op_seconds)}, copy-out measured at {fmt_bytes(o.copy_bandwidth)}/s on {where}; "
                 f"worst error of the line {m.worst_residual:.1%}")
    return t


def _ep_line(r: StepReport) -> list[str]:
    """EP's all-to-alls of the step, when the plan has EP."""
    if r.ep_degree == 1:
        return []
    return [f"EP {r.ep_degree}: {fmt_count(r.ep_all_to_alls, 'all-to-all')} ({fmt_bytes(r.ep_all_to_all_bytes)} sent) "
            f"per step, {fmt_time(r.ep_time)} of the compute stream; experts FSDP-sharded over the EP-reduced mesh"]
