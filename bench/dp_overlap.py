"""Data-parallel weak scaling, gradients summed after the backward (`overlap_gradients=false`) vs while it runs
(`overlap_gradients=true`, the default): whole training steps of the real trainer (bench/steps.py: fixed-length
sequences, median of the timed steps after the warm-up), GPT-J config widened to hidden 512 (4 blocks, 8 heads),
the same per-rank batch in every run:
  single   one process, one thread, batch B
  dp2      DP=2 (two processes, one thread each, gloo), global batch 2B, before and after overlap
efficiency = single step time / DP=2 step time (1.0 = perfect weak scaling). `--rounds` alternates the runs.
Writes runs/bench/dp_overlap/dp_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from steps import REPO, measure  # noqa: E402

MODEL = ["model_config.n_embd=512", "model_config.n_head=8", "model_config.n_inner=2048", "model_config.n_layer=4"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    out = REPO / "runs" / "bench" / "dp_overlap"
    out.mkdir(parents=True, exist_ok=True)
    runs = {
        "single": (1, args.batch, []),
        "dp2-after-backward": (2, 2 * args.batch, ["overlap_gradients=false"]),
        "dp2-overlapped": (2, 2 * args.batch, ["overlap_gradients=true"]),
    }
    common = MODEL + ["precision=fp32"]
    results: dict[str, list] = {name: [] for name in runs}
    for number in range(args.rounds):
        for name, (nproc, batch, extra) in runs.items():
            load = os.getloadavg()[0]
            result = measure(nproc, 1, batch, args.length, common + extra, args.data_dir, out / name, steps=args.steps)
            result["load_before"] = load
            results[name].append(result)
            print(f"round {number + 1} {name:20s} {result['step_s']:.3f} s/step (load {load:.2f})", flush=True)
    medians = {name: statistics.median(r["step_s"] for r in rs) for name, rs in results.items()}
    efficiency = {name: medians["single"] / medians[name] for name in runs if name != "single"}
    for name, value in efficiency.items():
        print(
            f"{name}: {medians[name]:.3f} s/step vs single {medians['single']:.3f}: weak-scaling efficiency {value:.2f}"
        )
    (out / "dp_overlap.json").write_text(
        json.dumps({"args": vars(args), "results": results, "medians": medians, "efficiency": efficiency}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
