"""Real FSDP2 steps on one GPU beside the planner's prediction for it: step time, peak memory, profiler traces.

The planner's time and memory figures for Hopper come from data sheets, papers and published training runs; this
benchmark checks them against a GPU it measured itself. Three phases, so that the GPU runs only the steps:

1. ``python benchmarks/gpu_step.py prepare`` (here, any CPU): ``fsdp-planner plan MODEL --policy titan [--ac full]
   [--compile] --cluster h200:1 --out benchmarks/gpu/NAME.plan.json`` for each workload below.
2. ``python benchmarks/gpu_step.py run OUTDIR`` (on the GPU machine): each workload in its own process: the model
   built on the GPU, the plan applied with ``apply_plan`` (bf16-mixed, as planned), AdamW; 3 warm-up steps, 10 timed
   steps (CUDA events: forward + backward, and the optimizer step apart), the peak allocated / reserved bytes of 2
   more whole steps, and a torch.profiler trace of 3 forward + backward steps (``OUTDIR/NAME.trace.json.gz``: what
   ``calibrate --trace`` reads); ``fsdp-planner calibrate --compute`` and ``--overhead --base h200:1`` before the
   compiled workload. ``one NAME OUTDIR`` runs one workload again (the repeats in ``measured.json``).
3. Here: ``benchmarks/gpu_report.py`` collects the machine's files into ``benchmarks/gpu/`` and writes
   ``benchmarks/gpu_step.md``: ``calibrate --trace`` on one workload's trace, the others predicted with that
   cluster, the preset beside both.

Run on an H200 on 2026-11-30 (torch 2.11, the machine's image; ``benchmarks/gpu/run.log``). ``one`` also runs each
workload with gloo on a CPU when no GPU is there, to try the script anywhere.

FSDP2 runs on one rank (NCCL, world size 1): no collective moves bytes, so this checks compute, host overhead and
memory, not the network (published multi-GPU runs check that: ``benchmarks/fidelity_published.md``).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PLANS = HERE / "gpu"
CLUSTER = "h200:1"
WARMUP, TIMED, PEAK_STEPS, PROFILED = 3, 10, 2, 3
WORKLOAD_TIMEOUT_S = 150  # one workload's process, at most
DEADLINE_S = 500  # the run's whole time, inside the machine's 600 s command limit


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    options: tuple[str, ...] = ()


WORKLOADS = (
    Workload("llama-1b", "benchmarks/gpu_models.py:llama_1b"),
    Workload("llama-1b-ac", "benchmarks/gpu_models.py:llama_1b", ("--ac", "full")),
    Workload("llama32-3b", "llama32-3b"),
    Workload("llama32-3b-ac", "llama32-3b", ("--ac", "full")),
    Workload("llama-1b-compile", "benchmarks/gpu_models.py:llama_1b", ("--compile",)),
)
CALIBRATIONS = {"calibrate-compute": "--compute", "calibrate-overhead": "--overhead"}  # name: calibrate's option
SAMPLES = "compute-samples"  # calibrate --compute's raw samples, SAMPLE_RUNS times: what gpu_report.py fits
SAMPLE_RUNS = 3
CALIBRATED_ON = "llama-1b"  # the trace calibrate --trace fits; the other workloads are predicted with its cluster


def cli(*args: str, timeout: float = 900) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "fsdp_planner", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"fsdp-planner {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def prepare() -> None:
    """The plans, made here (the product's torch; the GPU machine's may be older). ``gpu_report.py`` predicts them."""
    PLANS.mkdir(exist_ok=True)
    for w in WORKLOADS:
        cli("plan", w.model, "--policy", "titan", *w.options, "--cluster", CLUSTER,
            "--out", str(PLANS / f"{w.name}.plan.json"), "--force")


# --- on the GPU machine -------------------------------------------------------------------------------------------

def older_torch_shims() -> None:
    """The GPU image may carry a torch older than the product's (2.13): give it the two FSDP helpers the tracer
    imports (added in 2.13), over torch's pytree, so the same code runs there. Nothing else is patched."""
    from torch.distributed.fsdp import _common_utils as common
    from torch.utils import _pytree as pytree

    if hasattr(common, "collect_grad_tensors"):
        return
    import torch

    def wanted(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.requires_grad

    def collect(output: Any) -> tuple[Any, ...]:
        return tuple(x for x in pytree.tree_leaves(output) if wanted(x))

    def replace(output: Any, tensors: Any) -> Any:
        return pytree.tree_map(lambda x: next(tensors) if wanted(x) else x, output)

    common.collect_grad_tensors, common.replace_grad_tensors = collect, replace


def run(out: Path) -> None:
    """Each workload in its own process (a failure or an out-of-memory ends that one only), the two calibrations
    before the compiled workload (whose compile takes longest); each step skipped where it could overrun the
    machine's command limit, and what ran written after each. The calibrated clusters go inside results.json: the
    machine returns at most 8 files (results, 5 traces, the log)."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"device": device_line()}
    started = time.perf_counter()
    steps = [w.name for w in WORKLOADS]
    steps[-1:-1] = [*CALIBRATIONS, SAMPLES]
    for name in steps:
        if time.perf_counter() - started + WORKLOAD_TIMEOUT_S > DEADLINE_S:
            results[name] = {"error": "skipped: the machine's time was short"}
            continue
        begun = time.perf_counter()
        results[name] = (_calibrate(name, out) if name in CALIBRATIONS else
                         _workload(name, out, "samples" if name == SAMPLES else "one"))
        results[name]["wall_s"] = round(time.perf_counter() - begun, 1)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        print(name, json.dumps(results[name])[:600], flush=True)


def _workload(name: str, out: Path, verb: str) -> dict[str, Any]:
    try:
        done = subprocess.run([sys.executable, __file__, verb, name, str(out)], capture_output=True, text=True,
                              timeout=WORKLOAD_TIMEOUT_S, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"over {WORKLOAD_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    scratch = out / f"{name}.json"  # the machine returns 8 files: the results hold it
    result = json.loads(scratch.read_text())
    scratch.unlink()
    return result


def _calibrate(name: str, out: Path) -> dict[str, Any]:
    """``calibrate --compute`` or ``--overhead`` on this GPU: the cluster it writes and the table it prints."""
    path = out / f"{name}.json"
    try:
        printed = _in_process_cli(["calibrate", CALIBRATIONS[name], "--base", CLUSTER, "--out", str(path)],
                                  timeout=WORKLOAD_TIMEOUT_S)
    except Exception as e:
        return {"error": str(e)[-2000:]}
    cluster = json.loads(path.read_text())
    path.unlink()
    return {"cluster": cluster, "printed": printed[-4000:]}


def device_line() -> str:
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{name}, torch {torch.__version__}"


def _in_process_cli(argv: list[str], timeout: float) -> str:
    """``python -m fsdp_planner ARGV`` with the shims in place (a child process, so a hang ends at ``timeout``)."""
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'src')!r}, {str(HERE)!r}]; import gpu_step; "
            f"gpu_step.older_torch_shims(); from fsdp_planner.cli import main; sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    print(done.stdout[-3000:], done.stderr[-3000:], flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr[-1500:]}")
    return done.stdout


def samples(name: str, out: Path) -> None:
    """``calibrate --compute``'s timed samples, ``SAMPLE_RUNS`` times, as ``OUT/NAME.json`` (the runs' spread shows)."""
    import dataclasses

    sys.path[:0] = [str(ROOT / "src")]
    older_torch_shims()
    from fsdp_planner.calibrate.compute import measure_compute

    runs = [[dataclasses.asdict(s) for s in measure_compute()] for _ in range(SAMPLE_RUNS)]
    (out / f"{name}.json").write_text(json.dumps({"runs": runs}) + "\n")


def one(name: str, out: Path) -> None:
    """One workload on this process's GPU (or CPU with gloo when none, to try the script anywhere)."""
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT / "src")]
    older_torch_shims()
    import torch
    import torch.distributed as dist

    from fsdp_planner.apply.fully_shard import apply_plan, device_mesh, plan_policies
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.fsdp2.precision import mixed_precision
    from fsdp_planner.models import ModelSpec, load_model
    from fsdp_planner.sim.options import precision_named

    w = next(w for w in WORKLOADS if w.name == name)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    plan = Plan.from_json((PLANS / f"{name}.plan.json").read_text())
    with device:
        loaded = load_model(ModelSpec(w.model), meta=False)
    model, inputs, loss_fn = loaded.model, loaded.example_inputs, loaded.loss_fn
    policy = plan_policies(plan, mixed_precision(precision_named("bf16-mixed"), model), None)[0]
    apply_plan(model, plan, mesh=device_mesh(plan, device.type, 1), mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def forward_backward() -> None:
        loss_fn(model(*inputs)).backward()

    def step() -> None:
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    fb, opt_s = timed(device, forward_backward, opt, TIMED)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(PEAK_STEPS):
        step()
    sync()
    result = {"forward_backward_s": fb, "optimizer_s": opt_s, "timed_steps": TIMED,
              "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
              "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
              "numel": sum(p.numel() for p in model.parameters())}
    profile_steps(device, forward_backward, opt, out / f"{name}.trace.json")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


def timed(device: Any, forward_backward: Any, opt: Any, steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each step's forward + backward and of its optimizer step (CUDA events on a GPU)."""
    import torch

    fb, os_ = [], []
    for _ in range(steps):
        if device.type == "cuda":
            a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            a.record()
            forward_backward()
            b.record()
            opt.step()
            c.record()
            torch.cuda.synchronize()
            fb.append(a.elapsed_time(b) / 1e3)
            os_.append(b.elapsed_time(c) / 1e3)
        else:
            t0 = time.perf_counter()
            forward_backward()
            t1 = time.perf_counter()
            opt.step()
            fb.append(t1 - t0)
            os_.append(time.perf_counter() - t1)
        opt.zero_grad(set_to_none=True)
    return fb, os_


def profile_steps(device: Any, forward_backward: Any, opt: Any, path: Path) -> None:
    """PROFILED forward + backward steps as ``verify --profile`` records them, gzipped (the machine's files come
    back at most 16 MiB each)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=PROFILED, repeat=1)) as prof:
        for _ in range(PROFILED + 1):
            forward_backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            opt.zero_grad(set_to_none=True)
            prof.step()
    prof.export_chrome_trace(str(path))
    with path.open("rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "prepare":
        prepare()
    elif what == "run" and len(sys.argv) == 3:
        run(Path(sys.argv[2]))
    elif what in ("one", "samples") and len(sys.argv) == 4:
        (one if what == "one" else samples)(sys.argv[2], Path(sys.argv[3]))
    else:
        raise SystemExit(__doc__)
