"""A GPU trace made to the Kineto schema torch.profiler's ``export_chrome_trace`` writes, with known answers.

The schema (what ``calibrate/kineto.py`` reads; field names as Kineto writes them):
- top level: ``schemaVersion``, ``deviceProperties``, ``distributedInfo`` (``backend``, ``rank``, ``world_size``),
  ``traceEvents``;
- ``ProfilerStep#N``: ``ph`` "X", ``cat`` "user_annotation", on the training thread (``tid`` = ``pid``);
- CPU ops: ``cat`` "cpu_op" with ``args`` {``External id``, ``Input Dims``, ``Input type``}; FSDP2's ranges
  (``FSDP::pre_forward (layers.0)``, ...) are ``user_annotation``;
- ``record_param_comms`` (``cpu_op``) with ``args`` {``Collective name``, ``In msg nelems``, ``Out msg nelems``,
  ``Group size``, ``dtype``, ``External id``};
- launches: ``cat`` "cuda_runtime", ``name`` "cudaLaunchKernel", ``args`` {``correlation``, ``External id``};
- kernels: ``cat`` "kernel", ``tid`` the stream (7 compute, 21 NCCL), ``args`` {``correlation``, ``External id``,
  ``stream``, ``device``}; the same ``correlation`` as their launch, the same ``External id`` as the CPU op that
  launched them;
- flow events (``ph`` "s"/"f") and metadata (``ph`` "M") as Kineto writes them, which the reader skips.
Times are whole microseconds, so every total below is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PID, COMPUTE_STREAM, NCCL_STREAM = 4242, 7, 21
KERNELS = {  # name -> (class, microseconds)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": ("matmul", 40),
    "flash_fwd_kernel": ("attention", 25),
    "vectorized_elementwise_kernel<4, RMSNorm>": ("memory-bound", 6),
    "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": ("attention", 55),
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn": ("matmul", 80),
    "elementwise_kernel<128, 2, add>": ("memory-bound", 4),
}
FORWARD = list(KERNELS)[:3]
BACKWARD = list(KERNELS)[3:]
GATHER_BYTES = 4 << 20  # an all-gather's output per block; the reduce-scatter's input is the same
ALL_GATHER_US, REDUCE_SCATTER_US = 30, 45


@dataclass
class Expected:
    """What the reader must read back: per step, its seconds, per-class kernel seconds and counts, collectives."""

    steps: list[float] = field(default_factory=list)
    classes: dict[str, float] = field(default_factory=dict)  # per step (every step is the same)
    counts: dict[str, int] = field(default_factory=dict)
    collectives: list[tuple[str, int, int, float]] = field(default_factory=list)  # per step: kind, bytes, ranks, s


class _Writer:
    def __init__(self) -> None:
        self.events: list[dict] = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0,
                                    "args": {"name": "python"}}]
        self.ids = 0

    def x(self, name: str, cat: str, ts: int, dur: int, tid: int = PID, **args: object) -> dict:
        event = {"ph": "X", "cat": cat, "name": name, "pid": PID if cat != "kernel" else 0, "tid": tid, "ts": ts,
                 "dur": dur, "args": dict(args)}
        self.events.append(event)
        return event

    def launch(self, ts: int, external: int, kernel: str, start: int, dur: int, stream: int) -> None:
        self.ids += 1
        self.x("cudaLaunchKernel", "cuda_runtime", ts, 3, correlation=self.ids, **{"External id": external})
        self.x(kernel, "kernel", start, dur, tid=stream, correlation=self.ids, stream=stream, device=0,
               **{"External id": external})
        self.events.append({"ph": "s", "id": self.ids, "pid": PID, "tid": PID, "ts": ts, "cat": "ac2g",
                            "name": "ac2g"})


def _collective(w: _Writer, t: int, gpu: int, kind: str, blocks_bytes: int, world: int, dur: int) -> int:
    """A record_param_comms op at ``t`` launching an NCCL kernel at ``gpu``; returns the kernel's end."""
    w.ids += 1
    external = 10_000 + w.ids
    if kind == "all_gather":
        name, ins, outs, kernel = "_allgather_base", blocks_bytes // 2 // world, blocks_bytes // 2, \
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    else:
        name, ins, outs, kernel = "_reduce_scatter_base", blocks_bytes // 4, blocks_bytes // 4 // world, \
            "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    w.x("record_param_comms", "cpu_op", t, 10, **{"Collective name": name, "In msg nelems": ins,
                                                  "Out msg nelems": outs, "Group size": world,
                                                  "dtype": "BFloat16" if kind == "all_gather" else "Float",
                                                  "External id": external})
    w.launch(t + 2, external, kernel, gpu, dur, NCCL_STREAM)
    return gpu + dur


def gpu_trace(steps: int = 3, blocks: int = 4, world: int = 8, gap_us: int = 500) -> tuple[dict, Expected]:
    """``steps`` steps of a model of ``blocks`` blocks on ``world`` GPUs: per block an all-gather then the forward
    kernels, then per block in reverse the backward kernels and a reduce-scatter; the answers the reader must
    give."""
    w, expected = _Writer(), Expected()
    t = 1_000_000
    for s in range(steps):
        start, gpu = t, t + 20
        mark = w.x(f"ProfilerStep#{s + 1}", "user_annotation", start, 0)  # its duration set at the step's end
        for b in range(blocks):
            w.x(f"FSDP::pre_forward (layers.{b})", "user_annotation", t + 5, 12)
            gpu = _collective(w, t + 6, gpu, "all_gather", GATHER_BYTES, world, ALL_GATHER_US)
            t += 20
            for k in FORWARD:
                w.ids += 1
                external = w.ids + 50_000
                w.x("aten::mm" if "gemm" in k else "aten::_op", "cpu_op", t, 8, **{"External id": external})
                w.launch(t + 1, external, k, gpu, KERNELS[k][1], COMPUTE_STREAM)
                gpu += KERNELS[k][1]
                t += 10
        w.x("FSDP::pre_backward (layers.3)", "user_annotation", t, 6)
        t += 10
        for b in reversed(range(blocks)):
            for k in BACKWARD:
                w.ids += 1
                external = w.ids + 50_000
                w.x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", t, 8, **{"External id": external})
                w.launch(t + 1, external, k, gpu, KERNELS[k][1], COMPUTE_STREAM)
                gpu += KERNELS[k][1]
                t += 10
            w.x(f"FSDP::post_backward_reduce (layers.{b})", "user_annotation", t, 12)
            gpu = _collective(w, t + 1, gpu, "reduce_scatter", GATHER_BYTES * 2, world, REDUCE_SCATTER_US)
            t += 20
        end = max(t, gpu)
        mark["dur"] = t - start
        expected.steps.append((end - start) / 1e6)
        t = end + gap_us
    per = {"matmul": 0.0, "attention": 0.0, "memory-bound": 0.0}
    counts = dict.fromkeys(per, 0)
    for k in FORWARD + BACKWARD:
        per[KERNELS[k][0]] += KERNELS[k][1] * blocks / 1e6
        counts[KERNELS[k][0]] += blocks
    expected.classes, expected.counts = per, counts
    expected.collectives = ([("all_gather", GATHER_BYTES, world, ALL_GATHER_US / 1e6)] * blocks
                            + [("reduce_scatter", GATHER_BYTES * 2, world, REDUCE_SCATTER_US / 1e6)] * blocks)
    data = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
            "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": world}, "traceEvents": w.events,
            "displayTimeUnit": "ms"}
    return data, expected


def simulated_gpu_trace(trace: object, plan: object, cluster: object, options: object, steps: int = 2) -> dict:
    """A GPU trace of ``plan`` on ``cluster`` as the simulator runs it, written to the schema above: each op a kernel
    of its class (its roofline time on ``cluster``), laid out in the simulated compute runs, each collective an NCCL
    kernel sized by a ``record_param_comms`` op. What ``calibrate --trace`` must recover ``cluster``'s figures from.
    (Typed loosely: the fixture module stays importable without the planner's layers.)"""
    from fsdp_planner.sim.compute import op_times
    from fsdp_planner.sim.simulate import simulate
    from fsdp_planner.sim.sizing import Sizing
    from fsdp_planner.sim.timeline import Stream, Work
    from fsdp_planner.trace.events import ATTENTION_KERNELS

    report = simulate(trace, plan, cluster, options, timeline=True)
    seconds = op_times(trace, cluster.gpu, options.precision, cluster.compute, cluster.world_size)
    sizing = Sizing(trace, cluster.world_size, options.precision)
    params = sizing.group_params(plan)
    runs = sorted((e for e in report.timeline if e.stream is Stream.COMPUTE and e.work is Work.OPS and e.op >= 0),
                  key=lambda e: e.start)
    w, t0 = _Writer(), 1_000_000.0
    for s in range(steps):
        mark = w.x(f"ProfilerStep#{s + 1}", "user_annotation", round(t0, 3), round(report.step_time * 1e6, 3))
        for k, run in enumerate(runs):
            stop = runs[k + 1].op if k + 1 < len(runs) and runs[k + 1].op > run.op else len(trace.events)
            at = t0 + run.start * 1e6
            for i in range(run.op, stop):
                ev = trace.events[i]
                if not ev.is_op or seconds[i] <= 0:
                    continue
                kernel = ev.kernel
                name = ("sm90_xmma_gemm_bf16bf16_bf16f32" if kernel > 0 else
                        ("flash_bwd_kernel" if ev.backward else "flash_fwd_kernel") if kernel in ATTENTION_KERNELS
                        else "vectorized_elementwise_kernel")
                w.ids += 1
                launch = round(max(mark["ts"], at - 5), 3)
                if ev.backward:  # launched by autograd's engine, as a real backward kernel is
                    w.x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", launch, 4)
                w.launch(launch, 90_000 + w.ids, name, round(at, 3), round(seconds[i] * 1e6, 3), COMPUTE_STREAM)
                at += seconds[i] * 1e6
        for e in report.timeline:
            if e.work is Work.OPTIMIZER:  # its range, and a kernel launched in it: the optimizer's, not an op
                at = round(t0 + e.start * 1e6, 3)
                w.x("Optimizer.step#AdamW.step", "user_annotation", at, round((e.end - e.start) * 1e6, 3))
                w.ids += 1
                w.launch(at, 90_000 + w.ids, "multi_tensor_apply_kernel", at, round((e.end - e.start) * 1e6, 3),
                         COMPUTE_STREAM)
            if e.stream in (Stream.ALL_GATHER, Stream.REDUCE_SCATTER):
                gather = e.stream is Stream.ALL_GATHER
                nbytes = (sizing.gather_bytes(params[e.group]) if gather else sizing.reduce_bytes(params[e.group]))
                itemsize = options.precision.compute_bytes if gather else options.precision.reduce_bytes
                _nccl(w, t0 + e.start * 1e6, (e.end - e.start) * 1e6, gather, nbytes // itemsize, itemsize,
                      cluster.world_size, mark["ts"])
        t0 += report.step_time * 1e6 + 200
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": cluster.world_size},
            "traceEvents": w.events}


def _nccl(w: _Writer, start: float, dur: float, gather: bool, numel: int, itemsize: int, world: int,
          step_start: float) -> None:
    w.ids += 1
    external = 70_000 + w.ids
    dtype = {2: "BFloat16", 4: "Float"}[itemsize]
    # FSDP2's range around the issue, as its unshard and post-backward record_function them
    w.x("FSDP::all_gather" if gather else "FSDP::post_backward_reduce", "user_annotation",
        round(max(step_start, start - 10), 3), 6)
    w.x("record_param_comms", "cpu_op", round(max(step_start, start - 10), 3), 5,
        **{"Collective name": "_allgather_base" if gather else "_reduce_scatter_base",
           "In msg nelems": numel // world if gather else numel, "Out msg nelems": numel if gather else numel // world,
           "Group size": world, "dtype": dtype, "External id": external})
    kernel = "ncclDevKernel_AllGather_RING_LL" if gather else "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"
    w.launch(round(max(step_start, start - 8), 3), external, kernel, round(start, 3), round(dur, 3), NCCL_STREAM)
