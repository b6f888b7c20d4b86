"""A language model's loss at a real vocabulary on this CPU: peak memory and step time with the loss from whole
logits (loss_chunk_tokens=0, every position over the whole vocabulary, as before issue 47) and in chunks.

`make bench-lm-memory`: the command of issue 47's measurement, `recipes/llama/sft.yaml size=tiny
model_config.vocab_size=128256 max_length=1024 batch_size=16 precision=fp32` (a 33M-parameter Llama whose head is
128,256 wide; packed chat rows), one process, a few steps each way. Peak memory is the process's peak resident set
(summary.json's peak_memory_mib, the kernel's VmHWM), step time the median of the steps after the first. Writes
runs/bench/lm_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = ["size=tiny", "model_config.vocab_size=128256", "max_length=1024", "batch_size=16", "precision=fp32"]


def measure(chunk: int, steps: int, out: Path) -> dict:
    folder = out / f"chunk-{chunk}"
    overrides = [*COMMAND, f"loss_chunk_tokens={chunk}", f"max_steps={steps}", "export=false", "generate_every=0"]
    overrides += ["eval_every=null", "tensor_parallel_degree=1", f"output_dir={folder}", "overwrite=true"]
    command = [sys.executable, str(REPO / "scripts" / "train.py"), str(REPO / "recipes" / "llama" / "sft.yaml")]
    proc = subprocess.run([*command, *overrides], cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode:
        sys.exit(f"loss_chunk_tokens={chunk} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((folder / "summary.json").read_text())
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {
        "loss_chunk_tokens": chunk,
        "peak_rss_mib": max(summary["peak_memory_mib_per_rank"]),
        "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "losses": [r["loss"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "runs" / "bench" / "lm_memory"))
    args = parser.parse_args()
    out = Path(args.out)
    rows = [measure(chunk, args.steps, out) for chunk in (0, 1024)]
    for row in rows:
        print(
            f"loss_chunk_tokens={row['loss_chunk_tokens']:>5}: peak {row['peak_rss_mib'] / 1024:.2f} GiB RSS, "
            f"{row['step_s']:.1f} s per step, losses {', '.join(f'{x:.6f}' for x in row['losses'])}"
        )
    (out / "lm_memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
