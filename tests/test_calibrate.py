"""Calibration from nccl-tests logs: parsing real-looking output, recovering the fitted line, using it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fsdp_planner.calibrate.nccl_logs import calibrate, fit_logs, fit_samples, parse_nccl_tests, read_nccl_tests
from fsdp_planner.errors import PlannerError
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.hardware.collectives import alpha_beta
from fsdp_planner.hardware.cost import collective_time

NCCL = Path(__file__).parent / "fixtures" / "nccl"
AG8 = NCCL / "all_gather_perf_8xh100.log"
RS8 = NCCL / "reduce_scatter_perf_8xh100.log"
AG16 = NCCL / "all_gather_perf_16xh100_2nodes.log"
GiB = 1024**3


def _truth() -> dict[str, tuple[float, float]]:
    """The (alpha, busbw) the fixture generator used."""
    spec = importlib.util.spec_from_file_location("make_fixtures", NCCL / "make_fixtures.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TRUTH


TRUTH = _truth()


@pytest.mark.parametrize(
    ("path", "kind", "ranks", "hosts"),
    [(AG8, "all_gather", 8, 1), (RS8, "reduce_scatter", 8, 1), (AG16, "all_gather", 16, 2)],
)
def test_fixtures_parse(path: Path, kind: str, ranks: int, hosts: int) -> None:
    (table,) = read_nccl_tests(path)
    assert (table.kind, table.ranks, len(table.hosts)) == (kind, ranks, hosts)
    assert table.gpu_name == "NVIDIA H100 80GB HBM3"
    assert len(table.rows) == 31  # -b 8 -e 8G -f 2
    assert table.rows[-1].size == 8 * GiB
    samples = table.samples()
    assert all(size > 0 for size, _ in samples)  # zero-count rows carry nothing
    assert len(samples) == 2 * sum(1 for r in table.rows if r.size > 0)  # in- and out-of-place


@pytest.mark.parametrize("path", [AG8, RS8, AG16])
def test_fit_recovers_the_generating_line(path: Path) -> None:
    _, (fit,) = fit_logs(path)
    alpha, busbw = TRUTH[path.name]
    assert fit.alpha == pytest.approx(alpha, rel=0.10)
    assert fit.bus_bandwidth == pytest.approx(busbw, rel=0.10)
    assert fit.rel_rms < 0.1


def test_spikes_are_dropped() -> None:
    _, (fit,) = fit_logs(RS8)  # the reduce-scatter fixture has one 3x hiccup at 128 KiB
    assert fit.dropped >= 1


def test_calibrate_builds_a_matching_cluster_and_cost_uses_it() -> None:
    c = calibrate([AG8, RS8, AG16])
    assert (c.nodes, c.gpus_per_node, c.gpu.name) == (2, 8, parse_cluster("h100:16").gpu.name)
    assert set(c.fits) == {"all_gather", "reduce_scatter"} and set(c.fits["all_gather"]) == {8, 16}
    a, bw = c.fits["all_gather"][8]
    assert collective_time(c, "all_gather", GiB, 8) == pytest.approx(a + 7 / 8 * GiB / bw)
    a16, bw16 = c.fits["all_gather"][16]
    # no reduce-scatter run over 2 nodes: the all-gather ring stands in
    assert collective_time(c, "reduce_scatter", GiB, 16) == pytest.approx(a16 + 15 / 16 * GiB / bw16)
    # the 1 GiB anchor holds on the calibrated cluster too
    assert 2.7e-3 <= collective_time(c, "all_gather", GiB, 8) <= 3.0e-3
    # a 4-rank group has no fit: the model scaled by the 8-rank fit, on NVLink
    a4, bw4 = alpha_beta(c, "all_gather", 4)
    assert a4 < a and bw4 < bw


def test_calibrate_keeps_the_base_topology_and_round_trips(tmp_path: Path) -> None:
    base = parse_cluster("h100:64")
    c = calibrate(NCCL, base)  # a directory: every log in it
    assert (c.nodes, c.gpus_per_node) == (8, 8) and c.name == "h100:64+calibrated"
    path = tmp_path / "calibrated.json"
    c.save(path)
    back = Cluster.load(path)
    assert back == c
    assert collective_time(back, "all_gather", GiB, 8) == collective_time(c, "all_gather", GiB, 8)


def test_garbage_file_is_a_planner_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.log"
    junk.write_text("hello\nthis is not nccl-tests\n# size count\n1 2 3\n")
    with pytest.raises(PlannerError, match="no nccl-tests table"):
        calibrate(junk)
    with pytest.raises(PlannerError, match="does not exist"):
        calibrate(tmp_path / "missing.log")


def _lines(n: int, redop: str, count_of) -> str:
    rows = []
    for size in (1 << 20, 1 << 24, 1 << 28, 1 << 30):
        t = 30 + (n - 1) / n * size / 300e3  # us, busbw 300 GB/s
        alg = size / t / 1e3
        bus = alg * (n - 1) / n
        rows.append(
            f"{size:12d}  {count_of(size):12d}     float  {redop:>6}      -1  {t:7.1f}  {alg:6.2f}  "
            f"{bus:6.2f}      0  {t:7.1f}  {alg:6.2f}  {bus:6.2f}      0"
        )
    return "\n".join(rows)


def test_all_reduce_log_is_refused_clearly(tmp_path: Path) -> None:
    log = tmp_path / "ar.log"
    log.write_text("# nThread 1 nGpus 8 minBytes 1\n" + _lines(8, "sum", lambda s: s // 4) + "\n")
    (table,) = read_nccl_tests(log)
    assert table.kind == "all_reduce"
    with pytest.raises(PlannerError, match="no all_gather or reduce_scatter run"):
        calibrate(log)


def test_tagged_mpirun_output_and_inferred_ranks() -> None:
    body = _lines(32, "none", lambda s: s // 4 // 32)
    lines = ["# nThread 1 nGpus 1 minBytes 8", *body.splitlines()]
    text = "\n".join(f"[1,0]<stdout>:{line}" for line in lines)
    text += "\nnode7:1234:1234 [0] NCCL INFO comm 0x55 rank 0 nranks 32 - Init COMPLETE\n"
    (table,) = parse_nccl_tests(text)
    assert (table.kind, table.ranks) == ("all_gather", 32)  # from size = count * 32 * sizeof(float)
    a, bw, _, _ = fit_samples(table.samples(), table.ranks)
    assert a == pytest.approx(30e-6, rel=0.05) and bw == pytest.approx(300e9, rel=0.05)


def test_binary_name_and_explicit_kind_win() -> None:
    body = _lines(8, "none", lambda s: s // 4 // 8)  # the table alone would say all-gather
    cmd = "$ ./build/reduce_scatter_perf -b 1M -e 1G -f 16 -g 8\n"
    (t1,) = parse_nccl_tests(cmd + "# nThread 1 nGpus 8\n" + body)
    assert t1.kind == "reduce_scatter"
    (t2,) = parse_nccl_tests(cmd + body, kind="all_gather", ranks=16)
    assert (t2.kind, t2.ranks) == ("all_gather", 16)
    with pytest.raises(PlannerError, match="unknown collective"):
        parse_nccl_tests(body, kind="broadcast")


def test_several_runs_in_one_file() -> None:
    ag = _lines(8, "none", lambda s: s // 32)
    rs = _lines(4, "sum", lambda s: s // 16)
    text = (
        f"# nThread 1 nGpus 8 x\n{ag}\n# Avg bus bandwidth    : 1.0\n"
        f"# nThread 1 nGpus 4 x\n{rs}\n# Avg bus bandwidth    : 1.0\n"
    )
    tables = parse_nccl_tests(text)
    assert [(t.kind, t.ranks) for t in tables] == [("all_gather", 8), ("reduce_scatter", 4)]


def test_fit_needs_a_bandwidth_signal() -> None:
    with pytest.raises(PlannerError, match="no bandwidth"):
        fit_samples([(8, 30e-6), (16, 30e-6), (32, 29e-6)], 8)
    with pytest.raises(PlannerError, match="two or more sizes"):
        fit_samples([(1 << 20, 40e-6)], 8)


def test_a_log_cut_short_is_fitted_on_its_whole_rows_with_a_note(tmp_path: Path) -> None:
    """A log cut in the middle of its last row (a copy interrupted, a job killed) loses that row: fitted on the
    rows it has, said in a note (it was silent: a new user's trial); a whole log says nothing."""
    text = AG8.read_text()
    cut = tmp_path / "cut.log"
    last = text.rindex(str(8 * GiB))
    cut.write_text(text[:last + 40])  # mid-way through the 8 GiB row
    notes: list[str] = []
    tables, _ = fit_logs([cut, RS8], note=notes.append)
    assert [t.cut_rows for t in tables] == [1, 0] and len(tables[0].rows) == 30
    notes = [n for n in notes if "as outliers" not in n]  # (RS8's one hiccup: said in a note of its own)
    assert notes == [f"the all_gather run in {cut} has 1 row cut short (a size, then fewer fields than nccl-tests "
                     "prints: a log cut mid-row?), left out: fitted on its 30 whole rows"]
    fit_logs([AG8, RS8], note=notes.append)
    assert len([n for n in notes if "cut short" in n]) == 1


def test_measurements_whose_data_check_failed_are_left_out_with_a_note(tmp_path: Path) -> None:
    """nccl-tests' #wrong counts elements that arrived wrong: such measurements were left out without a word (a
    trial's log with every in-place #wrong at 5 fitted 30.0 us / 348 GB/s beside 29.8 / 346, silently)."""
    lines = []
    for line in AG8.read_text().splitlines():
        fields = line.split()
        if len(fields) == 13 and fields[0].isdigit():
            line = line[:line.rstrip().rindex(" ")] + " 5"  # the in-place #wrong
        lines.append(line)
    wrong = tmp_path / "wrong.log"
    wrong.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    tables, _ = fit_logs([wrong, RS8], note=notes.append)
    assert [t.failed_checks for t in tables] == [29, 0]  # (of the sizes fitted: the two rows of 0 bytes are not)
    assert [n for n in notes if "as outliers" not in n] == [
        f"the all_gather run in {wrong} has 29 measurements whose data check failed (#wrong not 0), "
        "left out of the fit: a collective that delivers wrong data is a fault of the machine or the "
        "run, worth a look before trusting its times"]


def test_a_log_of_more_lines_than_any_run_holds_is_refused(tmp_path: Path) -> None:
    """Within the size bound, a 255 MiB log of short lines took 2 minutes and 1.6 GB to split (a trial): its lines
    are counted first."""
    from fsdp_planner.calibrate.nccl_logs import MAX_LOG_LINES

    big = tmp_path / "big.log"
    big.write_text(AG8.read_text() + "a\n" * MAX_LOG_LINES)
    with pytest.raises(PlannerError, match=f"has {MAX_LOG_LINES + AG8.read_text().count(chr(10)):,} lines, more "
                                           f"than the {MAX_LOG_LINES:,} a log of nccl-tests runs holds"):
        read_nccl_tests(big)


def _rows_up_to(path: Path, largest: int) -> str:
    """The log ``path`` cut after its row of ``largest`` bytes (the lines after it dropped)."""
    out = []
    for line in path.read_text().splitlines():
        out.append(line)
        fields = line.split()
        if fields and fields[0].isdigit() and int(fields[0]) >= largest:
            break
    return "\n".join(out) + "\n"


def test_a_log_of_latency_bound_rows_only_is_refused(tmp_path: Path) -> None:
    """A log cut at 32 KiB shows no bandwidth: its slope is noise (1.8 TB/s fitted where the GPUs ran 300)."""
    cut = tmp_path / "all_gather_perf.log"
    cut.write_text(_rows_up_to(AG8, 32 * 1024))
    with pytest.raises(PlannerError, match="largest size, 32 KiB, still takes mostly latency"):
        calibrate(cut)


def test_an_all_reduce_run_is_left_out_with_a_word(tmp_path: Path) -> None:
    """An all_reduce_perf log (under any name) is no line the cost model reads: said, and refused alone."""
    log = tmp_path / "all_gather_perf.log"
    ranks = "".join(f"#  Rank  {r} Group  0 Pid  {100 + r} on node00 device  {r} [0x18] NVIDIA H100 80GB HBM3\n"
                    for r in range(8))
    log.write_text("# Collective test starting: all_reduce_perf\n# nThread 1 nGpus 8 minBytes 1\n" + ranks
                   + _lines(8, "sum", lambda s: s // 4) + "\n")
    notes: list[str] = []
    with pytest.raises(PlannerError, match="no all_gather or reduce_scatter run"):
        calibrate(log, note=notes.append)
    assert any("all_reduce run" in n and "left out" in n for n in notes)
    calibrate([log, AG8], note=notes.append)  # beside a log it fits, the fit goes on


def test_runs_that_disagree_are_said(tmp_path: Path) -> None:
    slow = tmp_path / "slow.log"
    lines = []
    for line in AG8.read_text().splitlines():  # every row's times doubled: half the bandwidth
        f = line.split()
        if f and f[0].isdigit() and len(f) == 13:
            f[5], f[9] = f"{float(f[5]) * 2:.2f}", f"{float(f[9]) * 2:.2f}"
            line = "  ".join(f)
        lines.append(line)
    slow.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    fit_logs([AG8, slow], note=notes.append)
    assert any("disagree" in n and "slow.log" in n for n in notes)
    notes.clear()
    fit_logs([AG8, AG8], note=notes.append)
    assert not notes


def test_calibrated_cost_is_the_fitted_line_at_small_sizes() -> None:
    """The log's 64 KiB rows took ~30 us: the calibrated cost says so (the model's LL line, scaled by the fitted
    ratios, said 10 us)."""
    c = calibrate([AG8, RS8])
    (table,) = read_nccl_tests(AG8)
    for size in (64 * 1024, 1024**2):
        measured = [t for s, t in table.samples() if s == size]
        assert collective_time(c, "all_gather", size, 8) == pytest.approx(sum(measured) / len(measured), rel=0.15)


def test_a_multi_node_calibration_serves_tensor_parallel_views() -> None:
    """Fits are runs on whole nodes: a TP rank's data-parallel view (fewer GPUs a node) reads them as such. A 2-node
    log of a slow network slows the view's 2-node groups as the log says (the view once looked a 16-rank fit up on
    its 8 GPUs and failed, and costed an 8-rank group over 2 nodes with the one-node fit)."""
    from fsdp_planner.sim.tensor_parallel import dp_cluster, node_cluster

    c = calibrate([AG8, RS8, AG16])
    view = dp_cluster(c, 2)
    assert alpha_beta(view, "all_gather", 8) == pytest.approx(alpha_beta(c, "all_gather", 8, 4))
    assert alpha_beta(view, "all_gather", 4) == pytest.approx(alpha_beta(c, "all_gather", 4))
    assert node_cluster(view, 2) == c


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_a_tensor_parallel_view_shares_the_node_s_network(tp: int) -> None:
    """The TP degree's data-parallel groups of a node run at once, each on its share of the NICs: a TP-8 group (one
    rank a node) gets one NIC's bandwidth, as an HSDP replica group does, not the whole node's."""
    from fsdp_planner.sim.tensor_parallel import dp_cluster

    c = parse_cluster("h100:64")
    view = dp_cluster(c, tp)
    per_node = 8 // tp
    for nodes in (2, 8):
        physical = alpha_beta(c, "all_gather", nodes * per_node, per_node)
        assert alpha_beta(view, "reduce_scatter", nodes * per_node) == pytest.approx(physical)


@pytest.mark.parametrize(("names", "says"), [
    (["NVIDIA A100-SXM4-40GB"], "cannot tell which preset matches GPU 'NVIDIA A100-SXM4-40GB'"),
    (["NVIDIA H100 PCIe"], "cannot tell which preset matches GPU 'NVIDIA H100 PCIe'"),
    (["NVIDIA GH200 480GB"], "cannot tell which preset matches GPU 'NVIDIA GH200 480GB'"),
    (["NVIDIA GH200 144G HBM3e"], "cannot tell which preset matches GPU 'NVIDIA GH200 144G HBM3e'"),
    (["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"], "the logs ran on different GPUs"),
])
def test_a_gpu_no_preset_describes_needs_a_base(tmp_path: Path, names: list[str], says: str) -> None:
    """The preset was the first whose kind the device line named: an A100-SXM4-40GB's logs wrote a cluster of
    80 GB GPUs (plans budgeted for twice their memory), an H100 PCIe's the SXM's clocks and NVLink, a log with an
    A100 among H100s the H100's; each without a word (a trial). Each now asks for a base cluster."""
    text = AG8.read_text()
    lines = text.splitlines(keepends=True)
    device = [i for i, line in enumerate(lines) if line.startswith("#  Rank")]
    for n, i in enumerate(device):  # (a second name: the last rank's)
        lines[i] = lines[i].replace("NVIDIA H100 80GB HBM3", names[-1] if n == len(device) - 1 else names[0])
    log = tmp_path / "ag.log"
    log.write_text("".join(lines))
    with pytest.raises(PlannerError, match=says):
        calibrate(log)
    assert calibrate(AG8).gpu.name == "H100-SXM-80GB"  # (the H100 80GB HBM3's own logs take its preset)


def test_what_a_fit_leaves_out_or_cannot_see_is_said(tmp_path: Path) -> None:
    """A log of three sizes of 2 GiB and more fitted a latency of 0.0 us, one whose out-of-place times were 1,000x
    its in-place ones fitted a line 71% off its samples, and dropped outliers were never mentioned (a trial). Each
    is said in a note, a fit over half off its samples refused; the clean all-gather fixture has none."""
    lines = AG8.read_text().splitlines(keepends=True)
    rows = [i for i, line in enumerate(lines) if line.strip() and not line.lstrip().startswith(("#", "NCCL"))]

    def notes(text: str) -> list[str]:
        log = tmp_path / "ag.log"
        log.write_text(text)
        said: list[str] = []
        fit_logs(log, note=said.append)
        return said

    assert notes("".join(lines)) == []
    large = "".join(line for i, line in enumerate(lines) if i not in rows[:-3])
    assert any("the latency fitted (" in n and "is not measured; run nccl-tests from small sizes" in n
               for n in notes(large))

    def slowed(line: str) -> str:  # the out-of-place time x 1,000
        fields = line.split()
        fields[5] = f"{float(fields[5]) * 1000:.2f}"
        return "  ".join(fields) + "\n"

    loose = "".join(slowed(line) if i in rows else line for i, line in enumerate(lines))
    with pytest.raises(PlannerError, match=r"off any line \(root mean square\), so the log's runs or its in- and "
                                           "out-of-place columns disagree"):  # (said once, and nothing written)
        notes(loose)

    def off(line: str) -> str:  # the out-of-place time x 2: 32% off, said (x 4: 52%, refused)
        fields = line.split()
        fields[5] = f"{float(fields[5]) * 2:.2f}"
        return "  ".join(fields) + "\n"

    looser = "".join(off(line) if i in rows else line for i, line in enumerate(lines))
    assert any("off the fitted line (root mean square)" in n for n in notes(looser)), notes(looser)
    said: list[str] = []
    fit_logs(RS8, note=said.append)  # (its one 3x hiccup)
    assert said == [f"reduce_scatter over 8 ranks ({RS8}): 1 of 58 samples left out of the fit as outliers, far off "
                    "the line the others make (a hiccup; many: the log's runs disagree)"]
