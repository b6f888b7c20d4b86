"""Write task=grpo's small sample (src/parallel_finetune/sample_data/grpo/): arithmetic with checkable answers.

    python scripts/make_grpo_sample.py

Each row is a TRL conversational prompt, {"prompt": [system?, user], "answer": "12"}: a sum, difference or product
of two small numbers, each written in words or in digits ("What is seven plus 5?"), asking for the answer in a
given format, `Answer: <number>` on the last line. The `answer` column is what the accuracy reward compares the
completion's final answer with (math-verify); the format reward checks the last line (recipes/*/grpo*.yaml's
format_pattern). A quarter of the prompts begin with a system message. Numbers stay small (0 to 12, results 0 to
144), so a tiny model's tokenizer holds them and a short run can learn the format and the easy sums.

train.jsonl and validation.jsonl hold disjoint questions (a question is its two numbers and its operation).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "parallel_finetune" / "sample_data"
OUT = SAMPLE / "grpo"
TRAIN_ROWS, VALIDATION_ROWS = 320, 48
WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
OPERATIONS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
FORMAT = "Give the answer on the last line as 'Answer: <number>'."
SYSTEM = "You are a careful calculator. Think briefly, then answer."


def number(value: int, rng: random.Random) -> str:
    """A number in words or in digits, by a coin toss."""
    return WORDS[value] if rng.random() < 0.5 else str(value)


def questions(rng: random.Random) -> list[tuple[int, str, int]]:
    """Every question (a, operation, b) with a non-negative result, shuffled."""
    every = [(a, op, b) for a in range(13) for b in range(13) for op in OPERATIONS if OPERATIONS[op](a, b) >= 0]
    rng.shuffle(every)
    return every


def row(question: tuple[int, str, int], rng: random.Random) -> dict:
    a, op, b = question
    asked = f"What is {number(a, rng)} {op} {number(b, rng)}? {FORMAT}"
    prompt = [{"role": "user", "content": asked}]
    if rng.random() < 0.25:
        prompt.insert(0, {"role": "system", "content": SYSTEM})
    return {"prompt": prompt, "answer": str(OPERATIONS[op](a, b))}


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=56)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    asked = questions(rng)
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "train.jsonl", [row(q, rng) for q in asked[:TRAIN_ROWS]])
    write(OUT / "validation.jsonl", [row(q, rng) for q in asked[TRAIN_ROWS : TRAIN_ROWS + VALIDATION_ROWS]])
    print(f"wrote {TRAIN_ROWS} train and {VALIDATION_ROWS} validation prompts to {OUT}")


if __name__ == "__main__":
    main()
