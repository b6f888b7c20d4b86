"""One epoch of the real all-MiniLM-L6-v2 checkpoint on the full SST-2 train set, single process (precision auto).

`make bench-minilm DATA=../shared/data/sst2` (`make bench-minilm-lora`: recipes/bert/minilm_lora.yaml): evaluates
every 400 steps and prints dev accuracy against the training time spent so far (the Hugging Face Trainer
reference measured here: 0.852 after 400 steps in 106 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from parallel_finetune.loop.run import run  # noqa: E402
from parallel_finetune.resolve import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--recipe", default="minilm.yaml", help="in recipes/bert/: minilm.yaml or minilm_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. lr=5e-5")
    args = parser.parse_args()
    out = REPO / "runs" / "bench" / f"{Path(args.recipe).stem.replace('_', '-')}-epoch"
    config = load_config(
        REPO / "recipes" / "bert" / args.recipe,
        [f"data_dir={args.data_dir}", "eval_every=400", f"output_dir={out}", "overwrite=true", *args.overrides],
    )
    started = time.perf_counter()
    summary = run(config)
    wall = time.perf_counter() - started
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    print(f"\n{'step':>6} {'train s':>8} {'dev accuracy':>13}")
    for evaluation in evals:
        seconds = sum(r["step_time_s"] for r in steps[: evaluation["step"]])
        print(f"{evaluation['step']:>6} {seconds:>8.1f} {evaluation['accuracy']:>13.4f}")
    print(
        f"one epoch: dev accuracy {summary['accuracy']:.4f}, wall {wall:.1f} s "
        f"(train {summary['seconds']['train']:.1f} s, {summary['train_samples_per_s']:.1f} samples/s, "
        f"median step {sorted(r['step_time_s'] for r in steps)[len(steps) // 2]:.3f} s)"
    )
    state = summary["state_bytes_per_rank"][0]
    print("state bytes: " + ", ".join(f"{k} {v:,}" for k, v in state.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
