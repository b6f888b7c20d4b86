"""Write task=sft's small chat sample (src/parallel_finetune/sample_data/chat/) from the package's own SST-2-style
sample (sample_data/train.tsv and dev.tsv, written for this project: no GLUE row is shipped).

    python scripts/make_chat_sample.py

Instructions whose answers follow from the sentence alone, so a model can learn them: the review's sentiment
(SST-2's label), repeat, reverse or count the words, the first and last word, capital letters, a three-word
summary (the sentence's three longest words), several reviews at once; multi-turn rows (two or three user turns),
some with a system message; short and long rows. train.jsonl and validation.jsonl hold `messages` rows (disjoint
sentences); prompt_completion.jsonl holds the same kind of instructions as prompt/completion rows.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "parallel_finetune" / "sample_data"
OUT = SAMPLE / "chat"
TRAIN_ROWS, VALIDATION_ROWS, COMPLETION_ROWS = 400, 60, 60
SYSTEMS = (
    "You are a helpful assistant. Answer briefly.",
    "You are a film critic's assistant: you read reviews carefully.",
    "Answer with as few words as possible.",
)


def read_sentences(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    rows = []
    for line in lines:
        sentence, label = line.rsplit("\t", 1)
        rows.append((sentence.strip(), "positive" if label.strip() == "1" else "negative"))
    return rows


def three_words(words: list[str]) -> str:
    longest = sorted(range(len(words)), key=lambda i: (-len(words[i]), i))[:3]
    return " ".join(words[i] for i in sorted(longest))


def single(sentence: str, label: str, rng: random.Random) -> tuple[str, str]:
    """One instruction about a sentence and its answer."""
    words = sentence.split()
    kind = rng.choice(("sentiment", "repeat", "reverse", "count", "first", "last", "upper", "summary"))
    if kind == "sentiment":
        return f"Is this movie review positive or negative?\n\n{sentence}", f"{label.capitalize()}."
    if kind == "repeat":
        return f"Repeat this sentence exactly: {sentence}", sentence
    if kind == "reverse":
        return f"Reverse the order of the words: {sentence}", " ".join(reversed(words))
    if kind == "count":
        return f"How many words are in this sentence? {sentence}", f"{len(words)} words."
    if kind == "first":
        return f"What is the first word of this sentence? {sentence}", words[0]
    if kind == "last":
        return f"What is the last word of this sentence? {sentence}", words[-1]
    if kind == "upper":
        return f"Write this in capital letters: {sentence}", sentence.upper()
    return f"Summarise in three words: {sentence}", three_words(words)


def several(rows: list[tuple[str, str]]) -> tuple[str, str]:
    """A long row: several reviews classified at once."""
    listed = "\n".join(f"{n}. {sentence}" for n, (sentence, _) in enumerate(rows, 1))
    answers = "\n".join(f"{n}. {label}" for n, (_, label) in enumerate(rows, 1))
    return f"Classify each review as positive or negative:\n{listed}", answers


def multi_turn(sentence: str, label: str, rng: random.Random) -> list[dict]:
    words = sentence.split()
    turns = [
        ("Here is a review: " + sentence + "\nIs it positive or negative?", f"{label.capitalize()}."),
        ("How many words does it have?", f"{len(words)} words."),
        ("Now give its words in reverse order.", " ".join(reversed(words))),
    ][: rng.choice((2, 3))]
    messages = []
    for asked, answer in turns:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    return messages


def conversation(pool: list[tuple[str, str]], index: int, rng: random.Random) -> list[dict]:
    sentence, label = pool[index % len(pool)]  # a pool smaller than the rows: each sentence, other instructions
    shape = rng.random()
    if shape < 0.25:
        messages = multi_turn(sentence, label, rng)
    elif shape < 0.35:
        asked, answer = several([pool[(index + k) % len(pool)] for k in range(rng.randint(3, 6))])
        messages = [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    else:
        asked, answer = single(sentence, label, rng)
        messages = [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return messages


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    rng = random.Random(0)
    train_pool, validation_pool = read_sentences(SAMPLE / "train.tsv"), read_sentences(SAMPLE / "dev.tsv")
    completion_pool = train_pool[:COMPLETION_ROWS]
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "train.jsonl", [{"messages": conversation(train_pool, i, rng)} for i in range(TRAIN_ROWS)])
    write(
        OUT / "validation.jsonl",
        [{"messages": conversation(validation_pool, i, rng)} for i in range(VALIDATION_ROWS)],
    )
    pairs = [single(sentence, label, rng) for sentence, label in completion_pool]
    write(OUT / "prompt_completion.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])


if __name__ == "__main__":
    main()
