"""task=grpo learns on the shipped arithmetic sample: a tiny Llama's held-out reward before and after a short run.

A tiny model from scratch samples near-uniform tokens: it never writes `Answer: <number>` on its own, so every
completion of a group scores alike, every advantage is 0 and GRPO has nothing to climb (the recipe's tiny run stays
at reward ~0). So the policy starts from a short supervised warm start, as GRPO runs start from an instruct model:

1. sft   `scripts/train.py recipes/llama/tp.yaml size=tiny task=sft` on the sample's own prompts with the completion
         `Answer: <answer>` (tools/notebook.py's warm_start_rows, as the walkthrough), --sft-steps steps:
         enough that the tiny model writes the format about half of the time and the right number rarely (60 steps
         give the format 0.97 of the time, and then only the accuracy is left to climb);
2. grpo  `scripts/train.py recipes/llama/grpo.yaml size=full model=<sft>/hf` on the shipped sample, the recipe's
         rewards (accuracy against the `answer` column by math-verify, and the format), twice: one step at lr 1e-30
         (its end-of-training evaluation is the model as given: every update below fp32 resolution) and
         --grpo-steps steps. Both evaluate the 48 held-out prompts with the same draws (num_generations each).

Prints the held-out reward (eval_reward and each function's mean) before and after, and the training batches'
mean reward over the first and last five steps.

    python bench/grpo_learning.py [--sft-steps 20] [--grpo-steps 40] [--lr 5e-4] [key=value ...]  # grpo overrides

Results: runs/bench/grpo-learning/results.json (and each run's folder beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from parallel_finetune.tools.notebook import warm_start_rows  # noqa: E402


def sft_command(data: Path, out: Path, steps: int, lr: float) -> list[str]:
    return [
        sys.executable,
        "scripts/train.py",
        "recipes/llama/tp.yaml",
        "size=tiny",
        "task=sft",
        f"train_file={data / 'train.jsonl'}",
        f"validation_file={data / 'validation.jsonl'}",
        "tensor_parallel_degree=1",
        "precision=fp32",
        "batch_size=16",
        f"max_steps={steps}",
        f"lr={lr}",
        "warmup_ratio=0",
        "lr_scheduler=constant",
        "log_every=10",
        "export=true",
        f"output_dir={out}",
        f"cache_dir={out.parent / 'cache'}",
        "overwrite=true",
        "resume=none",
    ]


def grpo_command(model: Path, out: Path, steps: int, lr: float, overrides: list[str]) -> list[str]:
    """The recipe at the settings of its tiny section, on the warm-started model (size=full: a model folder)."""
    return [
        sys.executable,
        "scripts/train.py",
        "recipes/llama/grpo.yaml",
        "size=full",
        f"model={model}",
        "family=llama",
        "tensor_parallel_degree=1",
        "precision=fp32",
        "activation_checkpointing=false",
        "max_length=96",
        "batch_size=16",
        "gradient_accumulation_steps=1",
        "num_generations=4",
        "max_completion_length=16",
        f"max_steps={steps}",
        f"lr={lr}",
        "eval_every=null",
        "log_every=1",
        "export=false",
        f"output_dir={out}",
        f"cache_dir={out.parent / 'cache'}",
        "overwrite=true",
        "resume=none",
        *overrides,
    ]


def run(argv: list[str], log: Path) -> float:
    """One run, its output to `log`; its wall time in seconds."""
    print("$", shlex.join(str(a) for a in argv), flush=True)
    start = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        sys.exit(f"error: the run failed ({done.returncode}); its output: {log}")
    return round(time.monotonic() - start, 1)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: round(v, 4) for k, v in summary.items() if k.startswith("eval_reward")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft-steps", type=int, default=20)
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench" / "grpo-learning")
    parser.add_argument("overrides", nargs="*", help="the grpo runs' recipe overrides, e.g. temperature=0.7")
    args = parser.parse_args()
    work = args.work.resolve()
    data = warm_start_rows(work / "sft-data")  # the notebook's warm start reads the same rows
    seconds = {"sft": run(sft_command(data, work / "sft", args.sft_steps, args.sft_lr), work / "sft.log")}
    model = work / "sft" / "hf"
    # lr 1e-30 (lr must be positive): one step that moves no weight, so its final evaluation is the warm start's
    seconds["before"] = run(grpo_command(model, work / "before", 1, 1e-30, args.overrides), work / "before.log")
    after = grpo_command(model, work / "after", args.grpo_steps, args.lr, args.overrides)
    seconds["after"] = run(after, work / "after.log")
    steps = read_jsonl(work / "after" / "metrics.jsonl")
    first, last = steps[:5], steps[-5:]
    results = {
        "sft_steps": args.sft_steps,
        "grpo_steps": args.grpo_steps,
        "lr": args.lr,
        "command": shlex.join(str(a) for a in after[1:]),
        "held_out_before": held_out(work / "before"),
        "held_out_after": held_out(work / "after"),
        "train_reward_first5": round(statistics.fmean(s["reward"] for s in first), 4),
        "train_reward_last5": round(statistics.fmean(s["reward"] for s in last), 4),
        "train_rewards_by_step": [round(s["reward"], 4) for s in steps],
        "seconds": seconds,
    }
    (work / "results.json").write_text(json.dumps(results, indent=2))
    before, after_ = results["held_out_before"], results["held_out_after"]
    print(f"held-out (48 prompts x 4): eval_reward {before['eval_reward']:.3f} -> {after_['eval_reward']:.3f}")
    for key in sorted(k for k in before if k != "eval_reward"):
        print(f"  {key}: {before[key]:.3f} -> {after_[key]:.3f}")
    print(
        f"training batches' reward: {results['train_reward_first5']:.3f} (steps 1-5) -> "
        f"{results['train_reward_last5']:.3f} (last 5)"
    )
    print(json.dumps(results["seconds"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
