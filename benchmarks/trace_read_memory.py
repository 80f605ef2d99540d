"""Peak memory and time of reading a large torch.profiler trace (``calibrate --trace``, ``simulate --against``).

Usage: python benchmarks/trace_read_memory.py [--steps 120] [--blocks 48]
Writes a synthetic GPU trace (``tests/kineto_fixture.py``'s schema: FSDP2 ranges, cpu ops, launches, kernels, NCCL
collectives with record_param_comms) of about ``steps x blocks x 32 KiB``, then in fresh processes, one at a time:
``json.loads`` of the whole file (how the reader parsed it before it streamed the events) and ``read_trace``.
Prints each one's peak resident memory (``ru_maxrss``), the part the read added to its imports', and the read's wall
and CPU seconds; benchmarks/trace_read_memory.md records a run.
"""

from __future__ import annotations

import argparse
import json
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


def write_trace(path: Path, steps: int, blocks: int) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from kineto_fixture import gpu_trace

    data, _ = gpu_trace(steps=steps, blocks=blocks)
    path.write_text(json.dumps(data))
    return len(data["traceEvents"])


def measure(imports: str, read: str, path: Path) -> tuple[float, float, float, float]:
    """Peak RSS after the imports and after the read (MiB), and the read's wall and CPU seconds, in a fresh
    interpreter."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(imports=imports, read=read), str(path)], check=True,
                         capture_output=True, text=True).stdout.split()
    imported, peak, wall, cpu = map(float, out)
    return imported / 1024, peak / 1024, wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--blocks", type=int, default=48)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        events = write_trace(path, a.steps, a.blocks)
        size = path.stat().st_size
        print(f"trace: {a.steps} steps of {a.blocks} blocks, {events:,} events, {size / 2**20:,.0f} MiB")
        print("| reader | peak RSS | of it, the read's | read's / file size | wall | CPU |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, (imports, read) in READERS.items():
            imported, peak, wall, cpu = measure(imports, read, path)
            print(f"| {name} | {peak:,.0f} MiB | {peak - imported:,.0f} MiB | {(peak - imported) * 2**20 / size:.1f} "
                  f"| {wall:.1f} s | {cpu:.1f} s |")


if __name__ == "__main__":
    main()
