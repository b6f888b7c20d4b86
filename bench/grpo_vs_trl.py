"""Our task=grpo against TRL's GRPOTrainer end to end (trl==1.16.0 from PyPI, a benchmark peer only, never a
dependency): the figures of the first two steps of both on the same tiny Llama, prompts, completions and rewards,
in fp32 on CPU, for loss_type grpo, dr_grpo and dapo, each with beta 0 (full fine-tuning) and beta 0.04 (LoRA: the
reference is the base with its adapters disabled, on both sides).

The fixture is bench/dpo_vs_trl.py's (a tiny Llama and a BPE tokenizer learned from the shipped preference sample,
ChatML as its chat template), with the sample's first 4 prompts (messages) as the data: every step's batch is all 4,
num_generations 4 (16 completions). The completions are given, not sampled (TRL's generation replaced by
bench/trl_grpo_peer.py, ours by bench/grpo_given.py: rl/steps.py's fixed-rollouts mode), drawn once from a seeded
generator: 1 to max_completion_length (12) ordinary tokens, the last the tokenizer's EOS unless the completion is
cut at the limit (half of those at the limit), two rollouts. Rewards: our built-in `length` (limit 4, ramp 6;
TRL's get_soft_overlong_punishment(10, 6) named "length") weighted 1, and bench/grpo_trl_reward.py's `variety`
(the same Python function on both sides; None for an empty text) weighted 0.5. epsilon 0.02, epsilon_high 0.03,
temperature 0.7 (nothing is sampled, but the log-probabilities are the tempered distribution's on both sides), lr
2e-2 (constant, AdamW, no weight decay, gradients clipped at 1).

beta 0: num_iterations 2, so step 2 trains on step 1's rollout again against its kept log-probabilities (the
ratio moves off 1: the clipped objective and clip_ratio/* are compared, not only their values at ratio 1). beta
0.04: num_iterations 1, step 2 a new rollout; at step 1 the adapters' B is zero (policy = reference, kl 0), so
step 2 compares kl and the loss with it. Both sides start LoRA from the same adapter (the peer sets A to our
initial values; B zero).

Figures, per run and step, within 1e-5 absolute: loss, reward, reward_std, rewards/length/mean and /std,
rewards/variety/mean and /std, frac_reward_zero_std, completions/mean_length, min_length, max_length,
clipped_ratio, clip_ratio/low_mean, high_mean, region_mean, kl (beta > 0); grad_norm within 1e-4 relative (a norm
over every trained parameter). TRL's clip_ratio/low_min and high_max are not ours (docs/grpo.md). The token ids
each rollout trained on are compared too (prompt and completion, as multisets: TRL shuffles its batch).

`make bench-grpo-trl` prints the table (docs/benchmarks.md); tests/rl/test_grpo_trl.py runs the same comparison
with this module's functions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama" / "grpo.yaml"
PEER = REPO / "bench" / "trl_grpo_peer.py"
WORKER = REPO / "bench" / "grpo_given.py"
REWARD_FILE = REPO / "bench" / "grpo_trl_reward.py"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
OUT = REPO / "runs" / "bench" / "grpo-vs-trl"
PROMPTS = 4
NUM_GENERATIONS = 4
MAX_COMPLETION_LENGTH = 12
STEPS = 2
LR = 2e-2
EPSILON, EPSILON_HIGH = 0.02, 0.03
LENGTH_LIMIT, LENGTH_RAMP = 4, 6
REWARD_WEIGHTS = (1.0, 0.5)
# no sampling happens, but both sides score the tempered distribution (TRL's fused head divides the logits by it)
TEMPERATURE = 0.7
BETA = 0.04
LORA = {  # every projection of a block
    "rank": 8,
    "alpha": 16,
    "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
SEED = 0
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
# (name, loss_type, beta, num_iterations, lora)
RUNS = [(f"{loss} beta 0", loss, 0.0, 2, False) for loss in LOSS_TYPES] + [
    (f"{loss} beta {BETA}", loss, BETA, 1, True) for loss in LOSS_TYPES
]
FIGURES = (
    "loss",
    "reward",
    "reward_std",
    "rewards/length/mean",
    "rewards/length/std",
    "rewards/variety/mean",
    "rewards/variety/std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "kl",
    "grad_norm",
)
TOLERANCE = 1e-5


def _dpo_bench():
    spec = importlib.util.spec_from_file_location("dpo_vs_trl", REPO / "bench" / "dpo_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def given_completions(tokenizer, rollouts: int = STEPS) -> list:
    """[rollout][prompt][generation] token ids: 1 to MAX_COMPLETION_LENGTH ordinary tokens (no special one, so no
    early EOS and no pad), the last EOS unless cut at the limit; each from its own seeded generator."""
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for rollout in range(rollouts):
        prompts = []
        for prompt in range(PROMPTS):
            group = []
            for generation in range(NUM_GENERATIONS):
                rng = random.Random(f"{rollout}-{prompt}-{generation}")
                length = rng.randint(1, MAX_COMPLETION_LENGTH)
                tokens = [rng.choice(ordinary) for _ in range(length)]
                if length < MAX_COMPLETION_LENGTH or rng.random() < 0.5:
                    tokens[-1] = tokenizer.eos_token_id
                group.append(tokens)
            prompts.append(group)
        out.append(prompts)
    return out


def write_fixture(folder: Path) -> Path:
    """dpo_vs_trl's model folder, `folder`/prompts.jsonl (the preference sample's first PROMPTS prompts),
    validation.jsonl (the next 2, for our run's evaluation at the end) and spec.json (the peer's spec; both sides
    read the given completions from it)."""
    from transformers import AutoTokenizer

    _dpo_bench().write_fixture(folder)
    pairs = [json.loads(line) for line in (folder / "conversational" / "train.jsonl").read_text().splitlines()]
    prompts = [pair["prompt"] for pair in pairs[:PROMPTS]]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    held_out = [pair["prompt"] for pair in pairs[PROMPTS : PROMPTS + 2]]  # our run's end-of-training evaluation
    (folder / "validation.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held_out))
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    spec = {
        "model": str(folder / "model"),
        "prompts": prompts,
        "completions": given_completions(tokenizer),
        "reward_file": str(REWARD_FILE),
        "reward_function": "variety",
        "reward_weights": list(REWARD_WEIGHTS),
        "length_limit": LENGTH_LIMIT,
        "length_ramp": LENGTH_RAMP,
        "num_generations": NUM_GENERATIONS,
        "max_completion_length": MAX_COMPLETION_LENGTH,
        "steps": STEPS,
        "lr": LR,
        "epsilon": EPSILON,
        "epsilon_high": EPSILON_HIGH,
        "temperature": TEMPERATURE,
        "seed": SEED,
        "lora": LORA,
        "runs": [
            {"name": name, "loss_type": loss, "beta": beta, "num_iterations": iterations, "lora": lora}
            for name, loss, beta, iterations, lora in RUNS
        ],
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    return folder


def ours_overrides(folder: Path, run: tuple, cache_dir: Path) -> list[str]:
    """bench/grpo_given.py's arguments after RECIPE for one run (output_dir= is the caller's)."""
    _, loss, beta, iterations, lora = run
    overrides = [
        "size=full",
        f"model={folder / 'model'}",
        "family=llama",
        f"train_file={folder / 'prompts.jsonl'}",
        f"validation_file={folder / 'validation.jsonl'}",
        f"given_completions={folder / 'spec.json'}",
        f"batch_size={PROMPTS * NUM_GENERATIONS}",
        "gradient_accumulation_steps=1",
        f"max_steps={STEPS}",
        "precision=fp32",
        "activation_checkpointing=false",
        "max_length=128",
        "tensor_parallel_degree=1",
        "export=false",
        "log_every=1",
        f"cache_dir={cache_dir}",
        "peak_tflops=0.1",
        f"lr={LR}",
        "lr_scheduler=constant",
        "warmup_steps=0",
        "warmup_ratio=0",
        "weight_decay=0",
        "max_grad_norm=1.0",
        "report_to=none",
        f"seed={SEED}",
        "resume=none",
        f"num_generations={NUM_GENERATIONS}",
        f"max_completion_length={MAX_COMPLETION_LENGTH}",
        f"reward_functions=[length,{REWARD_FILE}:variety]",
        f"reward_weights=[{REWARD_WEIGHTS[0]},{REWARD_WEIGHTS[1]}]",
        f"length_limit={LENGTH_LIMIT}",
        f"length_ramp={LENGTH_RAMP}",
        f"loss_type={loss}",
        f"beta={beta}",
        f"num_iterations={iterations}",
        f"epsilon={EPSILON}",
        f"epsilon_high={EPSILON_HIGH}",
        "scale_rewards=group",
        f"temperature={TEMPERATURE}",
    ]
    if lora:
        overrides += ["peft=lora", f"lora_rank={LORA['rank']}", f"lora_alpha={LORA['alpha']}", "lora_dropout=0"]
        overrides += [f"lora_target_modules=[{','.join(LORA['targets'])}]"]
    return overrides


def ours_command(folder: Path, run: tuple, cache_dir: Path, output_dir: Path) -> list[str]:
    argv = [str(WORKER), str(RECIPE), *ours_overrides(folder, run, cache_dir), f"output_dir={output_dir}"]
    return [sys.executable, *argv, "overwrite=true"]


def trl_command(folder: Path, out: Path, python: Path = TRL_PYTHON) -> list[str]:
    return [str(python), str(PEER), str(folder / "spec.json"), str(out)]


def read_ours(output_dir: Path) -> tuple[list[dict], list[list[dict]]]:
    """Our figures per step (metrics.jsonl) and the rows of each rollout (given_rows.jsonl)."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r and "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    rollouts: dict[int, list] = {}
    for line in (output_dir / "given_rows.jsonl").read_text().splitlines():
        row = json.loads(line)
        rollouts.setdefault(row["rollout"], []).append({"prompt": row["prompt"], "completion": row["completion"]})
    return [{k: float(r[k]) for k in FIGURES if k in r} for r in records], [rollouts[k] for k in sorted(rollouts)]


def limit(figure: str) -> dict[str, float]:
    return {"rel": 1e-4} if figure == "grad_norm" else {"abs": TOLERANCE}


# what TRL logs at a step that trains on the kept rollout (num_iterations > 1): the update's figures only (ours
# repeats the rollout's figures there)
UPDATE_FIGURES = ("loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "grad_norm")


def compare(ours: list[dict], trl: list[dict], beta: float) -> list[dict]:
    """Every figure at a step with a new rollout (TRL logs `reward` there), the update's at the others."""
    rows = []
    for step, (mine, theirs) in enumerate(zip(ours, trl, strict=True), start=1):
        for figure in FIGURES if "reward" in theirs else UPDATE_FIGURES:
            if figure == "kl" and not beta:
                continue
            a, b = mine.get(figure, math.nan), theirs.get(figure, math.nan)
            bound = limit(figure)
            kind, value = next(iter(bound.items()))
            difference = abs(a - b) / max(abs(b), 1e-30) if kind == "rel" else abs(a - b)
            ok = math.isfinite(a) and math.isfinite(b) and difference <= value
            rows.append({"step": step, "figure": figure, "ours": a, "trl": b, "difference": difference, "ok": ok})
    return rows


def token_differences(ours: list[list[dict]], trl: list[list[dict]]) -> list[str]:
    """Each rollout's rows as a multiset of (prompt, completion) on both sides."""
    if len(ours) != len(trl):
        return [f"ours trained on {len(ours)} rollouts, TRL on {len(trl)}"]
    lines = []
    for n, (a, b) in enumerate(zip(ours, trl)):
        key = lambda rows: sorted((tuple(r["prompt"]), tuple(r["completion"])) for r in rows)  # noqa: E731
        if key(a) != key(b):
            only_ours = sorted(set(key(a)) - set(key(b)))[:2]
            only_trl = sorted(set(key(b)) - set(key(a)))[:2]
            lines.append(f"rollout {n}: rows only ours {only_ours}, only TRL's {only_trl}")
    return lines


def result_of(run: tuple, ours_dir: Path, trl_run: dict) -> dict:
    ours, our_rows = read_ours(ours_dir)
    assert trl_run["name"] == run[0], (trl_run["name"], run[0])
    return {
        "run": run[0],
        "rows": compare(ours, trl_run["steps"], run[2]),
        "token_differences": token_differences(our_rows, trl_run["rollouts"]),
    }


def markdown_table(results: list[dict], version: str) -> str:
    lines = [
        f"Steps 1 and 2 of task=grpo vs TRL {version} GRPOTrainer on given completions: tiny Llama, {PROMPTS} chat "
        f"prompts x {NUM_GENERATIONS} completions, rewards length + 0.5 x variety, epsilon {EPSILON} / "
        f"{EPSILON_HIGH}, temperature {TEMPERATURE}, lr {LR}, fp32, CPU; beta 0: full fine-tuning, num_iterations 2; "
        f"beta {BETA}: LoRA, num_iterations 1.",
        "",
        "| run | step | figure | ours | TRL | difference | tokens equal |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    for result in results:
        equal = "yes" if not result["token_differences"] else "NO"
        for row in result["rows"]:
            kind = next(iter(limit(row["figure"])))
            lines.append(
                f"| {result['run']} | {row['step']} | {row['figure']} | {row['ours']:.8g} | {row['trl']:.8g} | "
                f"{kind} {row['difference']:.1e}{'' if row['ok'] else ' FAIL'} | {equal} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--trl-python", default=str(TRL_PYTHON))
    args = parser.parse_args()
    out, trl_python = Path(args.out_dir), Path(args.trl_python)
    if not trl_python.exists():
        sys.exit(f"--trl-python {trl_python}: no such interpreter; `make bench-grpo-trl` creates .venv-trl")
    folder, cache_dir = write_fixture(out / "fixture"), out / "cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO / "src")  # (a tiny model: one thread each, ours and TRL side by side)
    trl_out = out / "trl.json"
    trl = subprocess.Popen(trl_command(folder, trl_out, trl_python), cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)  # fmt: skip
    for n, run in enumerate(RUNS):
        proc = subprocess.run(ours_command(folder, run, cache_dir, out / f"ours-{n}"), cwd=REPO, env=env,
                              capture_output=True, text=True)  # fmt: skip
        if proc.returncode:
            trl.kill()
            sys.exit(f"ours ({run[0]}) failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    output = trl.communicate()[0]
    if trl.returncode:
        sys.exit(f"TRL failed ({trl.returncode}):\n{output[-4000:]}")
    peer = json.loads(trl_out.read_text())
    results = [result_of(run, out / f"ours-{n}", peer["runs"][n]) for n, run in enumerate(RUNS)]
    print(markdown_table(results, peer["trl_version"]))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [r["run"] for r in results if r["token_differences"] or not all(row["ok"] for row in r["rows"])]
    for result in results:
        for line in result["token_differences"]:
            print(f"{result['run']}: {line}")
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every figure within its limit, every token equal'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
