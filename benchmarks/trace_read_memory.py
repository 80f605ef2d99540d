"""Peak memory and time of reading a large torch.profiler trace (``calibrate --trace``, ``simulate --against``).

Usage: python benchmarks/trace_read_memory.py [--steps 5] [--blocks 6000] [--real K]
Writes a synthetic GPU trace (``tests/kineto_fixture.py``'s schema: FSDP2 ranges, cpu ops, launches, kernels, NCCL
collectives with record_param_comms) of about ``steps x blocks x 6 KiB`` (a few steps, as a profiler's schedule
records), then in fresh processes, one at a time: ``json.loads`` of the whole file (how the reader parsed it before
it streamed the events) and ``read_trace``. Prints each one's peak resident memory (``ru_maxrss``), the part the
read added to its imports', and the read's wall and CPU seconds; benchmarks/trace_read_memory.md records a run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# each reader: what it imports, then how it reads the file (argv[1])
READERS = {
    "json.loads, whole": ("import json", "json.loads(open(sys.argv[1], 'rb').read())"),
    "read_trace": ("from fsdp_planner.calibrate.kineto import read_trace", "read_trace(sys.argv[1])"),
}
CHILD = """import resource, sys, time
{imports}
imported = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start, cpu = time.perf_counter(), time.process_time()
{read}
print(imported, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - start,
      time.process_time() - cpu)
"""


WRITER = """import json, sys
sys.path.insert(0, sys.argv[4])
from kineto_fixture import gpu_trace
data, _ = gpu_trace(steps=int(sys.argv[2]), blocks=int(sys.argv[3]))
with open(sys.argv[1], "w") as f:
    json.dump(data, f)
print(len(data["traceEvents"]))
"""


# ``--real K``: the real A100 trace the tests read (Holistic Trace Analysis' ResNet-50 under DDP, 3 steps; its
# kernels' launch args, grids and registers as Kineto writes them) repeated K times, each copy's steps later
REPEATER = """import gzip, json, sys
data = json.loads(gzip.open(sys.argv[2]).read())
events = data["traceEvents"]
times = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
span = max(times) - min(times) + 1000
out = []
for k in range(int(sys.argv[3])):
    for e in events:
        e = dict(e)
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] += k * span
        if str(e.get("name", "")).startswith("ProfilerStep#"):
            e["name"] = f"ProfilerStep#{k}_{e['name'][13:]}"
        out.append(e)
data["traceEvents"] = out
with open(sys.argv[1], "w") as f:
    json.dump(data, f)
print(len(out))
"""
REAL = ROOT / "tests" / "fixtures" / "kineto_hta" / "resnet50_ddp_a100_rank0.json.gz"


def write_trace(path: Path, steps: int, blocks: int, real: int) -> int:
    """The trace written by a process of its own: a child's peak RSS starts at its parent's (fork), so this one
    stays small."""
    args = [REPEATER, str(path), str(REAL), str(real)] if real else \
        [WRITER, str(path), str(steps), str(blocks), str(ROOT / "tests")]
    out = subprocess.run([sys.executable, "-c", *args], check=True, capture_output=True, text=True).stdout
    return int(out)


def measure(imports: str, read: str, path: Path) -> tuple[float, float, float, float]:
    """Peak RSS after the imports and after the read (MiB), and the read's wall and CPU seconds, in a fresh
    interpreter."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(imports=imports, read=read), str(path)], check=True,
                         capture_output=True, text=True).stdout.split()
    imported, peak, wall, cpu = map(float, out)
    return imported / 1024, peak / 1024, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=6000)
    ap.add_argument("--real", type=int, default=0, help="the tests' real A100 trace this many times instead")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        events = write_trace(path, a.steps, a.blocks, a.real)
        size = path.stat().st_size
        what = f"{REAL.name} x {a.real}" if a.real else f"{a.steps} steps of {a.blocks} blocks"
        print(f"trace: {what}, {events:,} events, {size / 2**20:,.0f} MiB")
        print("| reader | peak RSS | of it, the read's | read's / file size | wall | CPU |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, (imports, read) in READERS.items():
            imported, peak, wall, cpu = measure(imports, read, path)
            print(f"| {name} | {peak:,.0f} MiB | {peak - imported:,.0f} MiB | {(peak - imported) * 2**20 / size:.1f} "
                  f"| {wall:.1f} s | {cpu:.1f} s |")


if __name__ == "__main__":
    main()
