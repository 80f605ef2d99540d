"""The loss in chunks (``--loss-chunks``, torchtitan's ChunkedLossWrapper): the simulator's prediction beside real
FSDP2 running the wrapper's loop on fake ranks, and what the chunks change of a job's peak.

Run: ``python benchmarks/chunked_loss.py`` (writes benchmarks/chunked_loss.md; about 3 min on 2 cores). Each row is
``fsdp-planner verify MODEL ARGS --cluster h100:8 --fake-world-size 8 --json``: FSDP2 (and DTensor for TP, EP's
all-to-alls) applied for real to the model on 8 fake ranks, the step run with the output layer and the loss in
chunks as the wrapper runs them (``apply/chunked_loss.py``), its collectives counted and its live bytes' peak
tracked, beside the prediction for the same plan. Nothing here was fitted to these rows.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from torchtitan_jobs import commit  # (this folder: the checkout's commit, '+' where files differ)

MIB = 2**20
# a small Qwen3 whose 151,936-token vocabulary dwarfs its two layers: the loss is the step's peak
QWEN = ["hf:qwen3-0.6b", "--hf-config", "num_hidden_layers=2", "--hf-config", "hidden_size=256", "--hf-config",
        "intermediate_size=512", "--hf-config", "num_attention_heads=4", "--hf-config", "num_key_value_heads=2",
        "--batch", "2", "--seq", "512"]
UNTIED = ["--hf-config", "tie_word_embeddings=false"]

# (what the row shows, the model and its options)
ROWS = (
    ("Qwen3 (small, untied), whole loss, titan", [*QWEN, *UNTIED, "--policy", "titan"]),
    ("the same, 4 chunks, titan ([norm, lm_head] one group)", [*QWEN, *UNTIED, "--policy", "titan",
                                                               "--loss-chunks", "4"]),
    ("the same, 8 chunks, titan", [*QWEN, *UNTIED, "--policy", "titan", "--loss-chunks", "8"]),
    ("4 chunks, auto (lm_head alone, explicit prefetch)", [*QWEN, *UNTIED, "--policy", "auto", "--loss-chunks", "4"]),
    ("4 chunks, module (lm_head in the root's group)", [*QWEN, *UNTIED, "--policy", "module", "--loss-chunks", "4"]),
    ("2 chunks, titan, fp32", [*QWEN, *UNTIED, "--policy", "titan", "--precision", "fp32", "--loss-chunks", "2"]),
    ("8 chunks, titan, tied embeddings", [*QWEN, "--policy", "titan", "--loss-chunks", "8"]),
    ("4 chunks, titan, TP 2 (loss parallel)", [*QWEN, *UNTIED, "--policy", "titan", "--tp", "2", "--loss-chunks",
                                               "4"]),
    ("4 chunks, titan, 2 micro-batches", [*QWEN, *UNTIED, "--policy", "titan", "--micro-batches", "2", "--batch", "4",
                                          "--loss-chunks", "4"]),
    ("4 chunks, titan, HSDP 2x4", [*QWEN, *UNTIED, "--policy", "titan", "--mesh", "2x4", "--loss-chunks", "4"]),
    ("32 chunks, module, tied (the layer in the root's group)", [*QWEN, "--policy", "module", "--loss-chunks", "32"]),
    ("Qwen3-0.6B (2 layers, tied, batch 1 x 1,024), auto, 8 chunks",
     ["hf:qwen3-0.6b", "--hf-config", "num_hidden_layers=2", "--seq", "1024", "--policy", "auto", "--loss-chunks",
      "8"]),
    ("torchtitan's qwen3 debugmodel_moe, EP 4, 4 chunks", ["hf:titan-qwen3-debugmodel-moe", "--policy", "titan",
                                                           "--ep", "4", "--loss-chunks", "4"]),
    ("torchtitan's deepseek_v3 debugmodel, 8 chunks", ["hf:titan-deepseek-v3-debugmodel", "--policy", "titan",
                                                       "--loss-chunks", "8"]),
    ("toy-llama (batch 4 x 128), titan, TP 2 with SP, whole loss", ["toy-llama", "--seq", "128", "--policy", "titan",
                                                                    "--tp", "2"]),
    ("the same, 4 chunks (the hidden states gathered once)", ["toy-llama", "--seq", "128", "--policy", "titan",
                                                              "--tp", "2", "--loss-chunks", "4"]),
    ("the same, 16 chunks", ["toy-llama", "--seq", "128", "--policy", "titan", "--tp", "2", "--loss-chunks", "16"]),
    ("toy-gpt2-tied (1.7 MiB), auto, 2 chunks", ["toy-gpt2-tied", "--policy", "auto", "--loss-chunks", "2"]),
    ("toy-gpt2-tied, batch 8, auto, 4 chunks", ["toy-gpt2-tied", "--batch", "8", "--policy", "auto",
                                                "--loss-chunks", "4"]),
)


def verified(args: list[str]) -> tuple[dict, float]:
    """``verify --json`` of the row and the CPU seconds it took (user + system, this process's children)."""
    before = os.times()
    out = subprocess.run([sys.executable, "-m", "fsdp_planner", "verify", *args, "--cluster", "h100:8",
                          "--fake-world-size", "8", "--json"], capture_output=True, text=True)
    after = os.times()
    if not out.stdout.strip():
        raise SystemExit(f"verify {' '.join(args)} failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout), (after.children_user - before.children_user
                                    + after.children_system - before.children_system)


def row(label: str, args: list[str]) -> str:
    result, cpu = verified(args)
    p, m = result["predicted"], result["measured"]
    exact = "exact" if result["counts_and_bytes_exact"] else "**differ**"
    counts = f"{m['all_gathers']} AG, {m['reduce_scatters']} RS"
    return (f"| {label} | {counts}: {exact} | {_mib(p['peak_memory'])} | {_mib(m['peak_memory'])} | "
            f"{result['peak_error']:+.1%} | {cpu:.0f} |")


def _mib(nbytes: int) -> str:
    """MiB to one decimal, two below 10 MiB (the toy models')."""
    return f"{nbytes / MIB:,.{2 if nbytes < 10 * MIB else 1}f}"


def main() -> None:
    lines = [
        "# The loss in chunks: prediction beside real FSDP2 on fake ranks",
        "",
        f"Measured by `python benchmarks/chunked_loss.py` at fsdp-planner {commit()} on {platform.machine()}, torch "
        f"{torch.__version__}: `fsdp-planner verify MODEL ARGS --cluster h100:8 --fake-world-size 8 --json` for each "
        "row (bf16-mixed unless said). The measured column is real FSDP2 (and DTensor, EP's all-to-alls) on 8 fake "
        "ranks running torchtitan's ChunkedLossWrapper loop (`apply/chunked_loss.py`); the counts are FSDP2's "
        "all-gathers and reduce-scatters a step (TP's and EP's compared too), 'exact' where every count and byte "
        "equals the prediction; the peak is the live bytes per rank. 'Qwen3 (small)' is hf:qwen3-0.6b with 2 layers "
        "of width 256, batch 2 x 512: its 151,936-token vocabulary makes the loss the step's peak.",
        "",
        "| job | collectives | predicted peak (MiB) | measured peak (MiB) | error | CPU s |",
        "|---|---|---|---|---|---|",
    ]
    for label, args in ROWS:
        lines.append(row(label, args))
        print(lines[-1], file=sys.stderr)
    Path(__file__).with_name("chunked_loss.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
