"""Our task=kto against TRL's KTOTrainer (trl==1.16.0 from PyPI, a benchmark peer only, never a dependency): the
figures of the first two steps of both on the same tiny Llama, the same rows, beta and batches, in fp32 on CPU.

The fixture is bench/dpo_vs_trl.py's (a tiny Llama and a BPE tokenizer learned from the shipped preference sample,
ChatML as its chat template; the sample's first 8 pairs as conversations and as plain text), its pairs written as
TRL's unpaired rows (prompt, completion, label: each pair's chosen answer true, then its rejected one false): 16
rows, two global batches of 8, beta 0.1, desirable_weight 3, max_length 128, lr 1e-2 (linear decay, no weight
decay), two steps.
Ours: scripts/train.py (recipes/llama/tp.yaml, task=kto, model=<folder>, one process), its metrics.jsonl records.
TRL: bench/trl_kto_peer.py in .venv-trl, fed the rows in our sampler's order (its sequential batches are then our
global batches, so its KL rows, each batch rotated by one, are ours). At step 1 the policy is the reference: the
loss is 1/2, kl and the rewards 0 on both sides whatever the code does, and logps/* and grad_norm test the
figures; step 2 (after one identical update) tests kl, the rewards and the loss. Figures: loss, kl, rewards/chosen,
rewards/rejected, rewards/margins (absolute 1e-5), logps/chosen, logps/rejected (relative 1e-6: sums near -90)
and grad_norm (relative 1e-4) at both steps; token ids compared row by row.

`make bench-kto-trl` prints the comparison as a table (docs/benchmarks.md); tests/loop/test_kto_trl.py runs the
same comparison with this module's functions.
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
PEER = REPO / "bench" / "trl_kto_peer.py"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
OUT = REPO / "runs" / "bench" / "kto-vs-trl"
BATCH = 8
STEPS = 2
BETA = 0.1
LR = 1e-2
DESIRABLE_WEIGHT = 3.0  # (and undesirable_weight 1): step 1 moves the policy so that step 2's KL estimate is > 0
MAX_LENGTH = 128
CASES = ("conversational", "text")
FIGURES = (
    "loss",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "grad_norm",
)


def _dpo_bench():
    spec = importlib.util.spec_from_file_location("dpo_vs_trl", REPO / "bench" / "dpo_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_fixture(folder: Path) -> Path:
    """dpo_vs_trl's fixture, each format's pairs also as unpaired rows in `folder`/kto-<format>/{train,validation}
    .jsonl (validation: the first 4 rows)."""
    _dpo_bench().write_fixture(folder)
    for case in CASES:
        pairs = [json.loads(line) for line in (folder / case / "train.jsonl").read_text(encoding="utf-8").splitlines()]
        rows = [
            {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
            for pair in pairs
            for side in ("chosen", "rejected")
        ]
        (folder / f"kto-{case}").mkdir(exist_ok=True)
        for split, chosen in (("train", rows), ("validation", rows[:4])):
            text = "".join(json.dumps(row) + "\n" for row in chosen)
            (folder / f"kto-{case}" / f"{split}.jsonl").write_text(text, encoding="utf-8")
    return folder


def ours_overrides(folder: Path, case: str, cache_dir: Path) -> list[str]:
    return [
        "size=full",
        f"model={folder / 'model'}",
        "family=llama",
        "task=kto",
        f"train_file={folder / f'kto-{case}' / 'train.jsonl'}",
        f"validation_file={folder / f'kto-{case}' / 'validation.jsonl'}",
        f"batch_size={BATCH}",
        f"max_steps={STEPS}",
        "precision=fp32",
        f"max_length={MAX_LENGTH}",
        f"dpo_beta={BETA}",
        f"desirable_weight={DESIRABLE_WEIGHT}",
        "tensor_parallel_degree=1",
        "export=false",
        "log_every=1",
        f"cache_dir={cache_dir}",
        "peak_tflops=0.1",
        f"lr={LR}",
        "lr_scheduler=linear",
        "warmup_steps=0",
        "warmup_ratio=0",
        "weight_decay=0",
        "max_grad_norm=1.0",
        "group_by_length=false",
        "report_to=none",
        "seed=0",
        "resume=none",
    ]


def ours_rows(folder: Path, case: str, cache_dir: Path) -> tuple[list[dict], list[int]]:
    """The rows our run trains on (its own data preparation), by file row: prompt_length and input_ids; and the
    file rows in the order of our run's global batches (what TRL is fed)."""
    from parallel_finetune.data.sampling import GlobalBatches
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    config = load_config(RECIPE, ours_overrides(folder, case, cache_dir))
    train = prepare_data(config).splits["train"]
    index = train["index"][:]
    sampler = GlobalBatches(train["length"][:], config.batch_size, config.seed, config.group_by_length)
    order = [index[i] for batch in sampler.epoch(0)[:STEPS] for i in batch]
    rows = sorted(zip(index, train["prompt_length"][:], train["input_ids"][:]))
    return [{"prompt_length": p, "ids": list(ids)} for _, p, ids in rows], order


def write_trl_rows(folder: Path, case: str, order: list[int]) -> Path:
    """The training rows in `order` (our global batches, one after another), for TRL's sequential batches."""
    lines = (folder / f"kto-{case}" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    path = folder / f"kto-{case}" / "trl.jsonl"
    path.write_text("".join(lines[i] + "\n" for i in order), encoding="utf-8")
    return path


def trl_command(rows: Path, model: Path, out: Path, python: Path = TRL_PYTHON) -> list[str]:
    command = [str(python), str(PEER), "--model", str(model), "--rows", str(rows), "--batch-size", str(BATCH)]
    return (
        command
        + ["--max-length", str(MAX_LENGTH), "--steps", str(STEPS), "--lr", str(LR), "--out", str(out)]
        + [
            "--desirable-weight",
            str(DESIRABLE_WEIGHT),
        ]
    )


def read_ours(output_dir: Path) -> list[dict[str, float]]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    return [{figure: float(r[figure]) for figure in FIGURES if figure in r} for r in records]


def read_trl(out: Path, order: list[int]) -> dict:
    """TRL's figures per step and its rows by file row (it was fed them in `order`)."""
    result = json.loads(out.read_text())
    rows = [None] * len(order)
    for position, row in enumerate(result["rows"]):
        rows[order[position]] = {"prompt_length": len(row["prompt"]), "ids": (row["prompt"] + row["completion"])}
    return {"version": result["trl_version"], "steps": result["steps"], "rows": rows}


def tolerance(figure: str) -> dict[str, float]:
    """grad_norm relative 1e-4; logps/* (sums over an answer's ~40 tokens, ~-90: fp32's spacing there is 8e-6)
    relative 1e-6; the rest absolute 1e-5."""
    if figure == "grad_norm":
        return {"rel": 1e-4}
    return {"rel": 1e-6} if figure.startswith("logps/") else {"abs": 1e-5}


def compare(ours: list[dict], trl: list[dict]) -> list[dict]:
    rows = []
    for step, (mine, theirs) in enumerate(zip(ours, trl), start=1):
        for figure in FIGURES:
            a, b = mine.get(figure, math.nan), theirs.get(figure, math.nan)
            limit = tolerance(figure)
            difference = abs(a - b) / max(abs(b), 1e-30) if "rel" in limit else abs(a - b)
            ok = math.isfinite(a) and math.isfinite(b) and difference <= next(iter(limit.values()))
            rows.append(
                {
                    "step": step,
                    "figure": figure,
                    "ours": a,
                    "trl": b,
                    "difference": difference,
                    "limit": limit,
                    "ok": ok,
                }
            )
    return rows


def token_differences(ours: list[dict], trl: list[dict]) -> list[str]:
    differences = []
    for n, (a, b) in enumerate(zip(ours, trl)):
        if a["prompt_length"] != b["prompt_length"] or a["ids"] != b["ids"][:MAX_LENGTH]:
            differences.append(f"row {n}: ours {a}, TRL {b}")
    return differences if len(ours) == len(trl) else [f"ours has {len(ours)} rows, TRL {len(trl)}"]


def result_of(case: str, ours: list[dict], our_rows: list[dict], trl: dict) -> dict:
    return {
        "case": case,
        "trl_version": trl["version"],
        "rows": compare(ours, trl["steps"]),
        "token_differences": token_differences(our_rows, trl["rows"]),
    }


def markdown_table(results: list[dict]) -> str:
    lines = [
        f"Steps 1 and 2 of task=kto vs TRL {results[0]['trl_version']} KTOTrainer: tiny Llama, the preference "
        f"sample's first 8 pairs as 16 unpaired rows, global batches of {BATCH}, beta {BETA}, desirable_weight "
        f"{DESIRABLE_WEIGHT}, lr {LR}, max_length "
        f"{MAX_LENGTH}, fp32, CPU.",
        "",
        "| rows | step | figure | ours | TRL | difference | limit | tokens equal |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for result in results:
        for row in result["rows"]:
            kind = next(iter(row["limit"]))
            lines.append(
                f"| {result['case']} | {row['step']} | {row['figure']} | {row['ours']:.8g} | {row['trl']:.8g} | "
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
        sys.exit(f"--trl-python {trl_python}: no such interpreter; `make bench-kto-trl` creates .venv-trl")
    folder, cache_dir = write_fixture(out / "fixture"), out / "cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    results = []
    for case in CASES:
        our_rows, order = ours_rows(folder, case, cache_dir)
        trl_out = out / f"trl-{case}.json"
        ours = [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            str(RECIPE),
            *ours_overrides(folder, case, cache_dir),
        ]
        ours += [f"output_dir={out / f'ours-{case}'}", "overwrite=true"]
        trl = trl_command(write_trl_rows(folder, case, order), folder / "model", trl_out, trl_python)
        for name, command in (("TRL", trl), ("ours", ours)):
            proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name} ({case}) failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        results.append(result_of(case, read_ours(out / f"ours-{case}"), our_rows, read_trl(trl_out, order)))
    print(markdown_table(results))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [r["case"] for r in results if r["token_differences"] or not all(row["ok"] for row in r["rows"])]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every figure within its limit, every token equal'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
