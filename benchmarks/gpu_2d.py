"""torchtitan's layouts on one GPU: real FSDP2 x TP (DTensor) on fake ranks with real CUDA tensors.

``benchmarks/gpu_step.py`` measured one rank (world size 1): no layout. Here this process is rank 0 of a world of
W on the fake process group (``dist.init_process_group("fake")``: every collective returns at once, moving no
bytes), its tensors real and on the GPU: the plan applied with ``apply_plan`` (``parallelize_module`` over the
mesh's ``tp`` dim, float8 and ``torch.compile`` where the plan says, ``fully_shard`` over the rest), so the rank
runs exactly the kernels, copies and host work of one rank of that job, with the CUDA caching allocator
(expandable segments, as torchtitan sets them) holding its memory. What it measures: the per-rank step with
free collectives (CUDA events), its peak allocated and reserved bytes, and a torch.profiler trace. What it cannot
measure: the collectives' time and their overlap (published multi-GPU runs check those:
``benchmarks/fidelity_published.md``). A fake all-gather's output is never written, so the unsharded params hold
whatever the allocator's blocks held: the same shapes and kernels, values that mean nothing.

1. ``python benchmarks/gpu_2d.py prepare`` (here): ``fsdp-planner plan MODEL --policy titan --tp T --cluster
   h200:W ... --out benchmarks/gpu/NAME.plan.json`` for each workload below.
2. ``python benchmarks/gpu_2d.py run OUTDIR [NAME ...]`` (on the GPU machine): each workload (or those named) in
   its own process.
   ``SMOKE=1`` runs every workload at 1/32 the width on a CPU (its own plans, under ``OUTDIR``: ``SMOKE=1 ...
   prepare OUTDIR`` first where the GPU image's torch is older than the planner's), to try the script.
   ``python benchmarks/gpu_2d.py peak NAME OUTDIR benchmarks/gpu``: the CUDA allocator's history of one step of
   one workload (``OUTDIR/NAME.peak.json``: the tensors alive at the allocated peak, each stream's reserved bytes).
3. Here: ``benchmarks/gpu_2d_report.py`` compares with the simulator on the same layout and free collectives.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]
from gpu_step import PLANS, cli, device_line, older_torch_shims, profile_steps, timed  # noqa: E402

SMOKE = os.environ.get("SMOKE") == "1"
WARMUP, TIMED, PEAK_STEPS = 3, 6, 2
WORKLOAD_TIMEOUT_S = 150
DEADLINE_S = 420  # the run's whole time: a rerun still fits in the session's 15 device minutes
ALLOC_CONF = "expandable_segments:True"  # torchtitan's launcher sets it; sim/allocator.py models it


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    world: int  # fake ranks: the cluster is h200:WORLD
    options: tuple[str, ...] = ()

    @property
    def cluster(self) -> str:
        return f"h200:{self.world}"


# torchtitan's Llama 3 70B job (TP 8 inside a node, FSDP over 8 nodes, full checkpointing, local batch 8 at 8,192
# tokens), its block cut to 4 layers; then compiled, then float8 with compile (how it ships); and Llama 3 8B on
# pure FSDP over 64 ranks. Eager first: what the later ones add is measured against it.
WORKLOADS = (
    Workload("llama3-70b-l4-tp8", "benchmarks/gpu_models.py:llama3_70b_l4", 64, ("--tp", "8", "--ac", "full")),
    Workload("llama3-8b-fsdp64", "benchmarks/gpu_models.py:llama3_8b", 64, ("--ac", "full")),
    Workload("llama3-70b-l4-tp8-compile", "benchmarks/gpu_models.py:llama3_70b_l4", 64,
             ("--tp", "8", "--ac", "full", "--compile")),
    Workload("llama3-70b-l4-tp8-float8", "benchmarks/gpu_models.py:llama3_70b_l4", 64,
             ("--tp", "8", "--ac", "full", "--compile", "--float8", "tensorwise")),
    # torchtitan's Llama 3.1 405B job (TP 8, local batch 2 at 8,192 tokens), its block cut to 2 layers
    Workload("llama3-405b-l2-tp8", "benchmarks/gpu_models.py:llama3_405b_l2", 128, ("--tp", "8", "--ac", "full")),
    Workload("llama3-405b-l2-tp8-float8", "benchmarks/gpu_models.py:llama3_405b_l2", 128,
             ("--tp", "8", "--ac", "full", "--compile", "--float8", "tensorwise")),
)
SMOKE_MODEL = "benchmarks/gpu_models.py:smoke"


def model_of(w: Workload) -> str:
    return SMOKE_MODEL if SMOKE else w.model


def plan_path(w: Workload, plans: Path = PLANS) -> Path:
    return plans / f"{w.name}.plan.json"


def prepare(plans: Path = PLANS) -> None:
    plans.mkdir(parents=True, exist_ok=True)
    for w in WORKLOADS:
        cli("plan", model_of(w), "--policy", "titan", *w.options, "--cluster", w.cluster, "--out",
            str(plan_path(w, plans)), "--force")


def run(out: Path, names: list[str]) -> None:
    """Each workload in its own process (an out-of-memory or a failed compile ends that one only), what ran
    written after each."""
    out.mkdir(parents=True, exist_ok=True)
    plans = out if SMOKE else PLANS
    if SMOKE and not all(plan_path(w, plans).is_file() for w in WORKLOADS):
        prepare(plans)
    results: dict[str, Any] = {"device": device_line()}
    started = time.perf_counter()
    for w in [w for w in WORKLOADS if not names or w.name in names]:
        if time.perf_counter() - started + WORKLOAD_TIMEOUT_S > DEADLINE_S:
            results[w.name] = {"error": "skipped: the machine's time was short"}
            continue
        begun = time.perf_counter()
        results[w.name] = _workload(w, out, plans)
        results[w.name]["wall_s"] = round(time.perf_counter() - begun, 1)
        (out / "results2d.json").write_text(json.dumps(results, indent=1) + "\n")
        print(w.name, json.dumps(results[w.name])[:800], flush=True)


def _workload(w: Workload, out: Path, plans: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF}
    try:
        done = subprocess.run([sys.executable, __file__, "one", w.name, str(out), str(plans)], capture_output=True,
                              text=True, timeout=WORKLOAD_TIMEOUT_S, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over {WORKLOAD_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    scratch = out / f"{w.name}.json"
    result = json.loads(scratch.read_text())
    scratch.unlink()
    return result


@dataclass
class Job:
    """One workload set up on this process: its step's parts, as ``one`` and ``peak`` run them."""

    forward_backward: Any
    stepping: Any
    model: Any
    device: Any
    setup_s: float

    def step(self) -> None:
        self.forward_backward()
        self.stepping.step()
        self.stepping.zero_grad()


def set_up(w: Workload, plans: Path) -> Job:
    """Rank 0 of ``w.world`` fake ranks on this process's GPU (or CPU): the model built whole, then sharded."""
    sys.path[:0] = [str(ROOT / "src")]
    older_torch_shims()
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_planner.apply.float8 import after_optimizer_step
    from fsdp_planner.apply.fully_shard import apply_plan, device_mesh, plan_policies
    from fsdp_planner.apply.tensor_parallel import loss_context
    from fsdp_planner.fsdp2.plan import Plan
    from fsdp_planner.fsdp2.precision import mixed_precision
    from fsdp_planner.models import ModelSpec, load_model
    from fsdp_planner.sim.options import precision_named

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=w.world)
    plan = Plan.from_json(plan_path(w, plans).read_text())
    setup = time.perf_counter()
    with device:  # built whole on the GPU (values to train on), then sharded: FSDP2 and TP free the whole params
        loaded = load_model(ModelSpec(model_of(w)), meta=False)
    model, inputs, loss_fn = loaded.model, loaded.example_inputs, loaded.loss_fn
    policy = plan_policies(plan, mixed_precision(precision_named("bf16-mixed"), model), None)[0]
    apply_plan(model, plan, mesh=device_mesh(plan, device.type, w.world), mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the whole model's blocks: a job built on meta never reserves them

    def forward_backward() -> None:
        with loss_context(plan):
            loss_fn(model(*inputs)).backward()

    class Stepping:  # the float8 scales' precompute is part of torchtitan's optimizer step
        def step(self) -> None:
            opt.step()
            after_optimizer_step(model, plan.float8)

        def zero_grad(self, set_to_none: bool = True) -> None:
            opt.zero_grad(set_to_none=set_to_none)

    return Job(forward_backward, Stepping(), model, device, time.perf_counter() - setup)


def one(name: str, out: Path, plans: Path) -> None:
    """One workload: its first step (where compiled blocks compile), warm-up, timed steps, peak memory, a trace."""
    w = next(w for w in WORKLOADS if w.name == name)
    job = set_up(w, plans)
    import torch

    cuda = job.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first = time.perf_counter()
    job.step()
    sync()
    first_s = time.perf_counter() - first
    for _ in range(WARMUP - 1):
        job.step()
    fb, opt_s = timed(job.device, job.forward_backward, job.stepping, TIMED)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(PEAK_STEPS):
        job.step()
    sync()
    stats = torch.cuda.memory_stats() if cuda else {}
    result = {"forward_backward_s": fb, "optimizer_s": opt_s, "timed_steps": TIMED, "world": w.world,
              "setup_s": round(job.setup_s, 1), "first_step_s": round(first_s, 1),
              "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
              "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
              "alloc_retries": stats.get("num_alloc_retries"), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "numel_local": sum(_local(p).numel() for p in job.model.parameters())}
    profile_steps(job.device, job.forward_backward, job.stepping, out / f"{name}.trace.json")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()


def peak(name: str, out: Path, plans: Path) -> None:
    """Where one workload's peaks are: the CUDA allocator's history over a whole step after warm-up, replayed here
    (``OUT/NAME.peak.json``: data, no pickle leaves the machine). Allocated: the tensors live at the peak, largest
    first, each with the Python frames that made it. Reserved: each stream's mapped bytes (what it held after
    warm-up, then its segments mapped and unmapped), at the step's most reserved moment and at each stream's own
    most, the streams named as FSDP2's (default, all-gather copy-in, all-gather, reduce-scatter, all-reduce)."""
    w = next(w for w in WORKLOADS if w.name == name)
    # read when CUDA starts: run as the timed runs are, not as the caller's shell left it
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    job = set_up(w, plans)
    import torch

    for _ in range(WARMUP):
        job.step()
    torch.cuda.synchronize()
    reserved: dict[int, int] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        reserved[segment["stream"]] = reserved.get(segment["stream"], 0) + segment["total_size"]
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    job.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    allocated, streams = _replay(snapshot["device_traces"][0], dict(reserved))
    names = _stream_names(job.model)
    named = {k: {names.get(int(s), str(s)): v for s, v in d.items()} if isinstance(d, dict) else d
             for k, d in streams.items()}
    (out / f"{name}.peak.json").write_text(json.dumps({
        "peak_in_step": allocated["peak"], "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(), "reserved_after_warmup": {
            names.get(s, str(s)): v for s, v in reserved.items()}, **named,
        "live": allocated["live"]}, indent=1) + "\n")


def _replay(events: list[dict], reserved: dict[int, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The step's allocated peak (above what was live when it began: tensors, largest first, with their frames)
    and its reserved bytes by stream over time."""
    live: dict[int, tuple[int, int, list[str]]] = {}
    total, best, at_best = 0, -1, {}
    most = dict(reserved)
    top, at_top = sum(reserved.values()), dict(reserved)
    for e in events:
        action, stream = e["action"], e.get("stream", 0)
        if action == "alloc":
            frames = [f"{'/'.join(f['filename'].rsplit('/', 2)[-2:])}:{f['line']} {f['name']}"
                      for f in e.get("frames", []) if f["filename"].endswith(".py")][:14]
            live[e["addr"]] = (e["size"], stream, frames)
            total += e["size"]
            if total > best:
                best, at_best = total, dict(live)
        elif action == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        elif action in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            sign = 1 if action in ("segment_alloc", "segment_map") else -1
            reserved[stream] = reserved.get(stream, 0) + sign * e["size"]
            most[stream] = max(most.get(stream, 0), reserved[stream])
            if sum(reserved.values()) > top:
                top, at_top = sum(reserved.values()), dict(reserved)
    by_stream: dict[int, int] = {}
    for size, stream, _ in at_best.values():
        by_stream[stream] = by_stream.get(stream, 0) + size
    rows = sorted(at_best.values(), key=lambda r: -r[0])
    return ({"peak": best, "live": [{"bytes": b, "stream": s, "frames": f} for b, s, f in rows[:60]]},
            {"reserved_peak": top, "reserved_at_peak": at_top, "reserved_most": most,
             "allocated_at_peak_by_stream": by_stream})


def _stream_names(model: Any) -> dict[int, str]:
    """FSDP2's streams and the default one, by their CUDA stream handle."""
    import torch

    names = {torch.cuda.default_stream().cuda_stream: "default", 0: "default"}
    with contextlib.suppress(Exception):
        ctx = model._get_fsdp_state()._comm_ctx
        for attr in ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream"):
            names[getattr(ctx, attr).cuda_stream] = attr.removesuffix("_stream")
    return names


def _local(p: Any) -> Any:
    """A param's shard on this rank (a DTensor's local tensor)."""
    return p.to_local() if hasattr(p, "to_local") else p


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "prepare":
        prepare(Path(sys.argv[2]) if len(sys.argv) == 3 else PLANS)
    elif what == "run" and len(sys.argv) >= 3:
        run(Path(sys.argv[2]), sys.argv[3:])
    elif what in ("one", "peak") and len(sys.argv) == 5:
        (one if what == "one" else peak)(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        raise SystemExit(__doc__)
