"""Calibrate from one plan's profiler trace, predict other plans' steps on the same host, compare with theirs.

Run: python benchmarks/trace_holdout.py [WORKDIR]   (writes benchmarks/trace_holdout.md and .json; about 4 minutes on 2
cores; WORKDIR keeps the plans, traces and cluster, and a rerun reuses the traces found there)

What a user runs, command for command, on toy-llama with 2 gloo ranks of this machine:
1. ``fsdp-planner plan toy-llama --policy P --cluster h100:2 --out P.json`` for titan, order (``--target-bytes
   256KiB``: three blocks a group) and auto (auto's plan
   depends on the cluster it plans for: the file pins it, so the job and the prediction run the same plan);
2. ``fsdp-planner verify toy-llama --plan P.json --nproc 2 --profile DIR`` three times per plan, the plans taking
   turns (titan, order, auto, titan, ...): each rank writes a torch.profiler trace of 3 steps
   (``runtime/worker.profile_steps``);
3. ``fsdp-planner calibrate --trace DIR/rank0.json --trace DIR/rank1.json ... --model toy-llama --plan titan.json``
   from titan's runs (both ranks of each: 18 steps; the host is shared with other jobs, and one run's steps vary
   by 2x);
4. ``fsdp-planner simulate toy-llama --plan P.json --cluster cluster.json --json``: the predicted step of each plan,
   against the measured one: per run the median step of both ranks' traces (``calibrate/kineto.py``), then the
   median of the three runs. Target (issue 37): order and auto within 15%.

Beside the wall time, what the host did to each run (a shared host's load moves a plan's step by up to 3x):
- the ranks' CPU share: each profiled step's process CPU seconds over its wall seconds (``rankR.cpu.json``, which
  ``verify --profile`` writes beside each trace), the median over both ranks' steps: lower when other jobs took the
  cores (it is below 1 on an idle host too: a rank blocked on its peer uses no CPU);
- the ops a step: the step's ``aten`` ops (matmul, attention, memory-bound), the same ops in every plan, which
  the simulator charges the same in every plan. (Scaling each run's step by its ops' time, as a clock of the host's
  load, was tried on 2026-11-29 and dropped: auto's ops took 1.6-2.3x titan's in every round, whatever the load, so
  they measure the plan too, not only the host.)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_planner.calibrate.kineto import read_trace

HERE = Path(__file__).resolve().parent
PLANS = ("titan", "order", "auto")
RUNS = 3
POLICY_OPTIONS = {"order": ("--target-bytes", "256KiB")}  # three blocks a group: not titan's one-block groups
TARGET = 0.15


def cli(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    done = subprocess.run([sys.executable, "-m", "fsdp_planner", *args], capture_output=True, text=True, env=env,
                          timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"fsdp-planner {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def measured_run(directory: Path) -> dict[str, float]:
    """One run's median step, its median ops' seconds a step and its ranks' median CPU share, over both ranks."""
    steps = [s for r in (0, 1) for s in read_trace(directory / f"rank{r}.json").steps]
    shares = []
    for r in (0, 1):
        times = json.loads((directory / f"rank{r}.cpu.json").read_text())
        shares += [c / w for c, w in zip(times["cpu"], times["wall"], strict=True)]
    return {"step": statistics.median(s.seconds for s in steps),
            "ops": statistics.median(s.compute_seconds for s in steps), "cpu_share": statistics.median(shares)}


def main() -> None:
    if len(sys.argv) > 1:
        Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
        measure(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            measure(Path(tmp))


def measure(work: Path) -> None:
    rows = []
    runs: dict[str, list[dict[str, float]]] = {}
    load: list[float] | None = None
    for plan in PLANS:
        if not (work / f"{plan}.json").exists():
            cli("plan", "toy-llama", "--policy", plan, "--cluster", "h100:2", "--out", str(work / f"{plan}.json"),
                *POLICY_OPTIONS.get(plan, ()))
        runs[plan] = []
    for i in range(RUNS):  # the plans take turns: a change in the host's load falls on all of them alike
        for plan in PLANS:
            out = work / f"{plan}{i}"
            if not (out / "rank1.json").exists():
                load = [*(load or []), os.getloadavg()[0]]
                cli("verify", "toy-llama", "--plan", str(work / f"{plan}.json"), "--nproc", "2", "--profile",
                    str(out), "--time-steps", "0")
            runs[plan].append(measured_run(out))
    cluster = work / "cluster.json"
    traces = [arg for i in range(RUNS) for r in (0, 1) for arg in ("--trace", str(work / f"titan{i}/rank{r}.json"))]
    cli("calibrate", *traces, "--model", "toy-llama", "--plan", str(work / "titan.json"), "--out", str(cluster),
        "--force")
    for plan in PLANS:
        report = json.loads(cli("simulate", "toy-llama", "--plan", str(work / f"{plan}.json"), "--cluster",
                                str(cluster), "--json"))
        # the profiled steps are forward and backward (no optimizer step: verify --profile): so is the prediction
        predicted = report["step_time"] - report.get("gpu_optimizer_time", 0.0) - report.get("cpu_optimizer_time",
                                                                                             0.0)
        measured = statistics.median(run["step"] for run in runs[plan])
        rows.append({"plan": plan, "groups": len(json.loads((work / f"{plan}.json").read_text())["groups"]),
                     "runs_ms": [round(run["step"] * 1e3, 2) for run in runs[plan]],
                     "ops_ms": [round(run["ops"] * 1e3, 2) for run in runs[plan]],
                     "cpu_share": [round(run["cpu_share"], 3) for run in runs[plan]],
                     "measured_ms": round(measured * 1e3, 2), "predicted_ms": round(predicted * 1e3, 2),
                     "error": round(predicted / measured - 1, 4),
                     "role": "calibrated on" if plan == "titan" else "held out"})
    write(rows, load)


def write(rows: list[dict], load: list[float] | None) -> None:
    """The run's table on top of the file, every earlier run (kept in the JSON) summarised below it: on a shared
    host one run's verdict says little, the runs together say more."""
    path = HERE / "trace_holdout.json"
    history = json.loads(path.read_text()) if path.exists() else []
    history.append({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": load, "rows": rows,
                    "schedule": "plans take turns"})
    path.write_text(json.dumps(history, indent=2) + "\n")
    render(history)


def render(history: list[dict]) -> None:
    """``trace_holdout.md``: the last run's table, then every run's errors."""
    rows = history[-1]["rows"]
    lines = ["# Calibrated from one plan's profiler trace, checked on other plans' traces (issue 37)", "",
             "Command: `python benchmarks/trace_holdout.py` (toy-llama, 2 gloo ranks of this machine, bf16-mixed; "
             f"{os.cpu_count()} cores). The cluster comes from `calibrate --trace` on titan's runs' traces; each "
             "plan's measured step is the median of its three runs' medians (3 profiled steps on each of 2 ranks). "
             f"Target: held-out plans within {TARGET:.0%}. Beside each run's step: its ops' seconds a step (matmul, "
             "attention, memory-bound: the same ops in every plan) and its ranks' CPU share (CPU over wall seconds "
             "a step, `rankR.cpu.json`; below 1 on an idle host too, where a rank blocks on its peer).", "",
             _table(rows), "",
             "| computed | runs | load average (1 min) at each verify | titan | order | auto | held out within "
             "target | CPU share (median of the runs: titan, order, auto) |",
             "|---|---|---|---:|---:|---:|---|---|"]
    for run in history:
        errors = {r["plan"]: r["error"] for r in run["rows"]}
        ok = all(abs(r["error"]) <= TARGET for r in run["rows"] if r["role"] == "held out")
        shown = "traces reused" if run["load"] is None else ", ".join(f"{v:.1f}" for v in run["load"])
        schedule = run.get("schedule", "each plan's back to back")
        cells = " | ".join(f"{errors.get(p, 0):+.1%}" for p in PLANS)
        shares = ", ".join(f"{statistics.median(r['cpu_share']):.2f}" for r in run["rows"] if r.get("cpu_share"))
        lines.append(f"| {run['when']} | {schedule} | {shown} | {cells} | {'yes' if ok else 'no'} | {shares or '-'} |")
    lines += ["", "The host is shared with other jobs: one plan's runs differ by up to 3x (the runs column), a "
              "rank's collectives wait on a busy peer, and the verdict moves from run to run with the load. In the "
              "18:08 run the ops alone (matmul, attention, memory-bound: the same ops in every plan) took 12.1 ms a "
              "step in titan's typical steps and 26.1 ms in auto's (the 03:32 run, below, found the same 2x in every "
              "round; the idle runs at the end do not show it); "
              "the same 84 KiB all-gather took 1.14 ms in titan's runs and 2.72 ms in order's. The model predicts "
              "the plan's cost on the host as it was while the calibrating plan ran.", "",
              "The 2026-11-29 03:32 run (load average 7 to 10 on the 2 cores) adds each rank's CPU share: 0.20 to "
              "0.38: each rank ran on a core for a fifth to two fifths of its steps' wall time, and the steps took "
              "1.5 to 3x as long as in the 18:08 run; titan's prediction is within 2%, auto's within 1%, order's "
              "15.3% over (its three runs: 112, 190 and 96 ms). Auto's ops took 30-33 ms a step in every round "
              "against titan's 15-21 ms (its flash-attention backward 11.7 ms against 3.7 ms in the same round), "
              "which the idle runs below do not reproduce.", "",
              "The three runs of 2026-11-29 06:01-06:05 ran on an idle host (load average 0.2 to 1.5, before other "
              "jobs started; CPU share 0.66 to 0.95) and all three meet the target: order +3.1%, -7.4%, -2.5%; auto "
              "+8.2%, -1.1%, -3.3%; titan, calibrated on, -0.5% to -5.7%. A step took 20 to 57 ms there, against 70 "
              "to 190 ms under load. Idle, auto's ops took 8.9 to 10.7 ms a step and titan's 9.6 to 11.3 ms: the 2x "
              "the loaded runs showed between them appears only when other jobs share the cores (how a plan's ops "
              "slow under contention, e.g. auto's larger buffers losing the caches, is not modelled), not on an idle "
              "host, where charging every plan the same ops holds. The check is met on an idle host and not "
              "reliably on a loaded one, where the calibrating and the held-out runs see different hosts.", "",
              "From 2026-11-30 18:36 on, `calibrate --trace` charges a CPU rank's collectives a line fitted on each "
              "size's least-delayed quarter of calls plus the mean call's wait (`trace_fit._waited`); before, each "
              "size its calls' mean, and beyond the largest size the last two sizes' slope of the means, which over "
              "titan's 32-168 KiB is the waits' noise (52 MB/s in the 18:22 run's fit, charging auto's 401 KiB "
              "all-gathers 3.1 ms where they took 1.3). The rows marked \"traces of\" are the same traces "
              "calibrated and predicted again; before and after, order and auto: the 18:22 traces (the change was "
              "designed on them) +0.6% and -4.7%, +25.0% and +2.1%; 18:27's +30.5% and +22.0%, +45.2% and +21.8%; "
              "18:31's +18.7% and +13.8%, +65.3% and +40.8%; the 18:39 run (after the change) +22.0% and +25.7%, "
              "-18.3% and -13.7%: the held-out error's mean size on the three runs the change was not designed on "
              "went from 33% to 23%, and no loaded run meets 15%. What is left is the plans' own load on the 2 "
              "cores, which moves both ways: in the 18:31 run's typical steps auto's ops took 13.1 ms a step "
              "against titan's 17.0 (its ranks' CPU share 0.93 against 0.77) and its step's time outside the ops, "
              "FSDP2's host ranges and the collectives 6.3 ms against 9.4 (7.2 of its 11.9 ms over, the "
              "collectives 1.8); in the 18:39 run auto's ops took 20.1 ms against titan's 18.4 and its "
              "reduce-scatter 5.7 ms a call against 1.7 for titan's largest. A host cluster fitted on one plan "
              "charges every plan the host as that plan found it.", "",
              "From 2026-11-29 06:26 (ab80bf8) `simulate` prices the optimizer step on the GPU, and its step time "
              "includes it; the profiled steps here are forward and backward only. So every row from the 11-29 "
              "09:23 run to the 12-01 04:28 one compared the measured step with a prediction an optimizer step "
              "longer (4.9 ms on the CPU cluster of the 04:28 run, where titan, calibrated on, read +8.3%: its "
              "prediction less that step is the fitted step exactly). From 12-01 04:30 the prediction leaves the "
              "optimizer step out; the rows marked \"traces of 04:26\" and \"traces of 04:28\" are those runs' "
              "traces calibrated and predicted again that way: titan +8.2% and -0.0%, order +10.9% and +8.4%, auto "
              "+9.8% and -27.6%; the 04:26 run meets the target, the 04:28 one misses it on auto alone, whose three "
              "runs took 32.6, 44.1 and 50.3 ms (the median is the middle run's)."]
    (HERE / "trace_holdout.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _table(rows: list[dict]) -> str:
    lines = ["| plan | groups | runs (ms) | ops a step (ms) | CPU share | measured (ms) | predicted (ms) | error | "
             "role |",
             "|---|---:|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        ops, shares = ", ".join(map(str, r.get("ops_ms", []))), ", ".join(f"{v:.2f}" for v in r.get("cpu_share", []))
        lines.append(f"| {r['plan']} | {r['groups']} | {', '.join(map(str, r['runs_ms']))} | {ops or '-'} | "
                     f"{shares or '-'} | {r['measured_ms']} | {r['predicted_ms']} | {r['error']:+.1%} | "
                     f"{r['role']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
