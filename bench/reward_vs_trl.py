"""Our task=reward against TRL's RewardTrainer (trl==1.16.0 from PyPI, a benchmark peer only, never a dependency):
the step-1 figures of both on the same tiny Llama sequence classifier, the same pairs and batch, in fp32 on CPU.

The fixture is bench/dpo_vs_trl.py's (a tiny Llama and a BPE tokenizer learned from the shipped preference sample,
ChatML as its chat template; the sample's first 8 pairs as conversations and as plain text), with the model saved
as a one-output LlamaForSequenceClassification (its score head initialised from torch.manual_seed(0), saved with
it, so both sides start from the same head). Cases: the conversational pairs; the text pairs with a `margin` column
and center_rewards_coefficient 0.01. One batch of all 8 pairs, max_length 128, one step (lr 1e-6).
Ours: scripts/train.py (recipes/llama/tp.yaml, task=reward, model=<folder>, one process), its first metrics.jsonl
record; TRL: bench/trl_reward_peer.py in .venv-trl, what RewardTrainer logged for step 1. Figures: loss, accuracy,
margin, min/mean/max_reward (absolute 1e-5) and grad_norm (relative 1e-4); token ids compared row by row (TRL's
rows without the padding-id tokens they end with, which the score never reads: data/reward.py).

`make bench-reward-trl` prints the comparison as a table (docs/benchmarks.md); tests/loop/test_reward_trl.py runs
the same comparison with this module's functions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama" / "tp.yaml"
PEER = REPO / "bench" / "trl_reward_peer.py"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
OUT = REPO / "runs" / "bench" / "reward-vs-trl"
PAIRS = 8
MAX_LENGTH = 128
CENTER = 0.01
MARGINS = (0.5, 0.0, 1.0, -0.5, 0.25, 2.0, 0.0, 1.5)  # the text case's margin column, one per pair
CASES = ("conversational", "text")  # text: with MARGINS and center_rewards_coefficient CENTER
FIGURES = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm")


def _dpo_bench():
    spec = importlib.util.spec_from_file_location("dpo_vs_trl", REPO / "bench" / "dpo_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_fixture(folder: Path) -> Path:
    """dpo_vs_trl's fixture, its model saved as a one-output sequence classifier, the text pairs with MARGINS."""
    import torch
    from transformers import AutoConfig, LlamaForSequenceClassification

    _dpo_bench().write_fixture(folder)
    model_dir = folder / "model"
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    config.architectures = ["LlamaForSequenceClassification"]
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(model_dir)
    for split in ("train", "validation"):
        path = folder / "text" / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        rows = [row | {"margin": margin} for row, margin in zip(rows, MARGINS)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder


def ours_overrides(folder: Path, case: str, cache_dir: Path) -> list[str]:
    return [
        "size=full",
        f"model={folder / 'model'}",
        "family=llama",
        "task=reward",
        f"train_file={folder / case / 'train.jsonl'}",
        f"validation_file={folder / case / 'validation.jsonl'}",
        f"batch_size={PAIRS}",
        "max_steps=1",
        "precision=fp32",
        f"max_length={MAX_LENGTH}",
        "tensor_parallel_degree=1",
        "export=false",
        "log_every=1",
        f"cache_dir={cache_dir}",
        "peak_tflops=0.1",
        "lr=1e-6",
        "warmup_steps=0",
        "max_grad_norm=1.0",
        "group_by_length=false",
        "report_to=none",
        "seed=0",
        "resume=none",
        *([f"center_rewards_coefficient={CENTER}"] if case == "text" else []),
    ]


def read_ours(output_dir: Path) -> dict[str, float]:
    first = json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1, first
    return {figure: float(first[figure]) for figure in FIGURES}


def ours_tokens(folder: Path, case: str, cache_dir: Path) -> list[dict]:
    """The rows our run trains on, in file order."""
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    train = prepare_data(load_config(RECIPE, ours_overrides(folder, case, cache_dir))).splits["train"]
    rows = sorted(zip(train["index"], train["input_ids"], train["rejected_ids"]))
    return [{"chosen": list(c), "rejected": list(r)} for _, c, r in rows]


def trl_command(folder: Path, case: str, out: Path, python: Path = TRL_PYTHON) -> list[str]:
    command = [str(python), str(PEER), "--model", str(folder / "model"), "--pairs", str(folder / case / "train.jsonl")]
    command += ["--batch-size", str(PAIRS), "--max-length", str(MAX_LENGTH), "--out", str(out)]
    return command + (["--center-rewards-coefficient", str(CENTER)] if case == "text" else [])


def read_trl(out: Path) -> dict:
    """TRL's step-1 figures and its rows, each without the padding-id tokens it ends with."""
    result = json.loads(out.read_text())
    pad = result["pad_token_id"]

    def stripped(ids):
        while ids and ids[-1] == pad:
            ids = ids[:-1]
        return ids

    rows = [{side: stripped(row[side]) for side in ("chosen", "rejected")} for row in result["rows"]]
    return {"version": result["trl_version"], "figures": result["metrics"], "rows": rows}


def tolerance(figure: str) -> dict[str, float]:
    return {"rel": 1e-4} if figure == "grad_norm" else {"abs": 1e-5}


def compare(ours: dict[str, float], trl: dict[str, float]) -> list[dict]:
    rows = []
    for figure in FIGURES:
        a, b, limit = ours[figure], trl[figure], tolerance(figure)
        difference = abs(a - b) / max(abs(b), 1e-30) if "rel" in limit else abs(a - b)
        ok = math.isfinite(a) and math.isfinite(b) and difference <= next(iter(limit.values()))
        rows.append({"figure": figure, "ours": a, "trl": b, "difference": difference, "limit": limit, "ok": ok})
    return rows


def token_differences(ours: list[dict], trl: list[dict]) -> list[str]:
    if len(ours) != len(trl):
        return [f"ours has {len(ours)} pairs, TRL {len(trl)}"]
    return [
        f"pair {n} {side}: ours {a[side]}, TRL {b[side]}"
        for n, (a, b) in enumerate(zip(ours, trl))
        for side in ("chosen", "rejected")
        if a[side] != b[side]
    ]


def result_of(case: str, ours: dict, our_rows: list[dict], trl: dict) -> dict:
    return {
        "case": case,
        "trl_version": trl["version"],
        "rows": compare(ours, trl["figures"]),
        "token_differences": token_differences(our_rows, trl["rows"]),
    }


def markdown_table(results: list[dict]) -> str:
    lines = [
        f"Step 1 of task=reward vs TRL {results[0]['trl_version']} RewardTrainer: tiny Llama sequence classifier, "
        f"{PAIRS} pairs of the shipped preference sample in one batch, max_length {MAX_LENGTH}, fp32, CPU (text: "
        f"with a margin column and center_rewards_coefficient {CENTER}).",
        "",
        "| pairs | figure | ours | TRL | difference | limit | tokens equal |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for result in results:
        for row in result["rows"]:
            kind = next(iter(row["limit"]))
            lines.append(
                f"| {result['case']} | {row['figure']} | {row['ours']:.8g} | {row['trl']:.8g} | "
                f"{kind} {row['difference']:.1e} | {row['limit'][kind]:g} | "
                f"{'yes' if not result['token_differences'] else 'NO'} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--trl-python", default=str(TRL_PYTHON))
    args = parser.parse_args()
    out, trl_python = Path(args.out_dir), Path(args.trl_python)
    if not trl_python.exists():
        sys.exit(f"--trl-python {trl_python}: no such interpreter; `make bench-reward-trl` creates .venv-trl")
    folder, cache_dir = write_fixture(out / "fixture"), out / "cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    results = []
    for case in CASES:
        trl_out = out / f"trl-{case}.json"
        ours = [sys.executable, str(REPO / "scripts" / "train.py"), str(RECIPE)]
        ours += ours_overrides(folder, case, cache_dir)
        ours += [f"output_dir={out / f'ours-{case}'}", "overwrite=true"]
        for name, command in (("TRL", trl_command(folder, case, trl_out, trl_python)), ("ours", ours)):
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name} ({case}) failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        mine = read_ours(out / f"ours-{case}")
        results.append(result_of(case, mine, ours_tokens(folder, case, cache_dir), read_trl(trl_out)))
    print(markdown_table(results))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [r["case"] for r in results if r["token_differences"] or not all(row["ok"] for row in r["rows"])]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every figure within its limit, every token equal'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
