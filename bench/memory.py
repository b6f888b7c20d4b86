"""Measured per-rank training state and activation peaks of the tiny GPT-J for each memory layout.

`make bench-memory DATA=../shared/data/sst2`: one fp32 optimizer step per layout under torchrun; every rank
reports the bytes of its parameters, gradients and optimizer state (tensor accounting, not RSS, from the run's
summary.json), shown next to the planner's estimate for the same layout. Then peak activation bytes of one
forward/backward with activation checkpointing off / every 2nd block / every block (PyTorch's MemTracker).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from parallel_finetune.launch import torchrun_command  # noqa: E402
from parallel_finetune.tools.planner import Candidate, memory_per_gpu, model_shape  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (name, processes, overrides, planner candidate)
LAYOUTS = [
    ("single process", 1, [], Candidate(1, 1, 1, "none", False, 1)),
    ("TP=2", 2, ["tensor_parallel_degree=2"], Candidate(2, 1, 1, "none", False, 1)),
    ("sharding=optimizer, DP=2", 2, ["sharding=optimizer"], Candidate(1, 1, 2, "optimizer", False, 1, 2)),
    ("sharding=full, DP=2", 2, ["sharding=full"], Candidate(1, 1, 2, "full", False, 1, 2)),
    ("sharding=hybrid, 2 x 2", 4, ["sharding=hybrid", "shard_group_size=2"], Candidate(1, 1, 4, "hybrid", False, 1, 2)),
    ("sharding=full x TP=2", 4, ["sharding=full", "tensor_parallel_degree=2"], Candidate(2, 1, 2, "full", False, 1, 2)),
]
PARTS = ("params", "grads", "optimizer")


def measure(name: str, nproc: int, overrides: list[str], data_dir: str, out: Path) -> dict:
    folder = out / name.replace(" ", "").replace(",", "_").replace("=", "")
    defaults = [
        "size=tiny",
        "precision=fp32",
        "max_steps=1",
        "export=false",
        "tensor_parallel_degree=1",
        f"data_dir={data_dir}",
        f"output_dir={folder}",
        "overwrite=true",
    ]
    recipe = REPO / "recipes" / "gptj" / "tp.yaml"
    command = torchrun_command(nproc, str(REPO / "scripts" / "train.py"), str(recipe), *defaults, *overrides)
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
    per_rank = json.loads((folder / "summary.json").read_text())["state_bytes_per_rank"]
    return {part: max(rank[part] for rank in per_rank) for part in PARTS}


def activation_peaks() -> dict[str, int]:
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "model")]
    from test_memory import train_step_under_tracker  # the test's measurement, so both report the same thing

    return {
        label: train_step_under_tracker("gptj", every)[0]
        for label, every in (("off", False), ("every 2nd block", 2), ("every block", True))
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "sst2"))
    args = parser.parse_args()
    out = REPO / "runs" / "bench" / "memory"
    shape = model_shape("tiny:gptj")
    rows = []
    for name, nproc, overrides, candidate in LAYOUTS:
        measured = measure(name, nproc, overrides, args.data_dir, out)
        estimate = memory_per_gpu(shape, candidate, seq_len=128, batch_size=32)
        rows.append({"layout": name, "measured": measured, "estimate": {p: estimate[p] for p in PARTS}})
    single = sum(rows[0]["measured"].values())
    print("\nper-rank training state, tiny GPT-J (fp32, bytes; planner estimate in brackets)")
    print(f"{'layout':<28} {'params':>20} {'grads':>20} {'optimizer':>20} {'total':>10} {'x single':>9}")
    for row in rows:
        cells = [f"{row['measured'][p]:>9,} ({row['estimate'][p]:>9,.0f})" for p in PARTS]
        total = sum(row["measured"].values())
        print(f"{row['layout']:<28} {' '.join(cells)} {total:>10,} {total / single:>9.2f}")
    peaks = activation_peaks()
    print("\npeak activation bytes of one forward/backward, tiny GPT-J with 4 blocks, batch 16 x 64 tokens")
    for label, peak in peaks.items():
        print(f"  activation checkpointing {label:<16} {peak:>12,}  ({peak / peaks['off']:.2f} x off)")
    (out / "memory.json").write_text(json.dumps({"state": rows, "activation_peaks": peaks}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
