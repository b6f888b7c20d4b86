"""Write task=dpo's small preference sample (src/parallel_finetune/sample_data/preference/) from the package's own
SST-2-style sample (sample_data/train.tsv and dev.tsv, written for this project: no GLUE row is shipped).

    python scripts/make_preference_sample.py

Real pairs, the chosen answer right and the rejected one wrong, for instructions whose answers follow from the
sentence alone: the review's sentiment (SST-2's label; rejected: the other one), capital letters (rejected: the
sentence unchanged, or only its first word in capitals), the words in reverse order (rejected: the original order),
the first word (rejected: the last), the last word (rejected: the first), and the sentence in quotation marks
(rejected: without them). All but the sentiment can be learned from the text's form, so a tiny model trained for a
minute prefers the right answer of most held-out pairs (tests/loop/test_preference.py). Kinds are dealt evenly
(each run of six rows holds each kind once, in a shuffled order); a kind whose two answers would be equal for a
sentence gives way to the sentiment. Sentences over MAX_WORDS words are skipped, so prompt and answer stay short
for a tiny tokenizer.

train.jsonl and validation.jsonl (disjoint sentences: train.tsv, dev.tsv) hold TRL's explicit-prompt
conversational rows, {"prompt": [system?, user], "chosen": [assistant], "rejected": [assistant]}, a quarter of
them with a system message; implicit.jsonl (dev.tsv's sentences) holds implicit-prompt rows, {"chosen": [...,
assistant], "rejected": [..., assistant]} sharing every turn but the last: one user turn, some after a system
message, some after a first exchange about the same review (a two-turn conversation).
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

import make_chat_sample as chat_sample  # its sentences and system messages (run as scripts/make_preference_sample.py)

SAMPLE = Path(__file__).resolve().parents[1] / "src" / "parallel_finetune" / "sample_data"
OUT = SAMPLE / "preference"
TRAIN_ROWS, VALIDATION_ROWS, IMPLICIT_ROWS = 400, 64, 40
MAX_WORDS = 25
KINDS = ("sentiment", "upper", "reverse", "first", "last", "quote")


def read_sentences(path: Path) -> list[tuple[str, str]]:
    """make_chat_sample's sentences and labels, less those over MAX_WORDS words."""
    return [
        (sentence, label) for sentence, label in chat_sample.read_sentences(path) if len(sentence.split()) <= MAX_WORDS
    ]


def pair(sentence: str, label: str, kind: str, rng: random.Random, follow_up: bool = False) -> tuple[str, str, str]:
    """One instruction about a sentence, its right answer and a wrong one. `follow_up`: the question refers to a
    review already quoted in the conversation ("it") instead of quoting it."""
    words = sentence.split()
    other = "negative" if label == "positive" else "positive"
    if kind == "sentiment":
        asked = "Is it positive or negative?" if follow_up else f"Is this review positive or negative? {sentence}"
        return asked, f"{label.capitalize()}.", f"{other.capitalize()}."
    if kind == "upper":
        asked = "Write it in capital letters." if follow_up else f"Write this in capital letters: {sentence}"
        first_only = " ".join([words[0].upper(), *words[1:]])
        wrong = [answer for answer in (sentence, first_only) if answer != sentence.upper()] or [sentence]
        return asked, sentence.upper(), rng.choice(wrong)
    if kind == "reverse":
        asked = "Give its words in reverse order." if follow_up else f"Reverse the order of the words: {sentence}"
        return asked, " ".join(reversed(words)), sentence
    if kind == "first":
        asked = "What is its first word?" if follow_up else f"What is the first word of this sentence? {sentence}"
        return asked, words[0], words[-1]
    if kind == "last":
        asked = "What is its last word?" if follow_up else f"What is the last word of this sentence? {sentence}"
        return asked, words[-1], words[0]
    asked = "Put it in quotation marks." if follow_up else f"Put this sentence in quotation marks: {sentence}"
    return asked, f'"{sentence}"', sentence


def dealt(rng: random.Random, count: int) -> list[str]:
    """`count` kinds, each run of len(KINDS) holding every kind once."""
    kinds: list[str] = []
    while len(kinds) < count:
        deck = list(KINDS)
        rng.shuffle(deck)
        kinds += deck
    return kinds[:count]


def checked(sentence: str, label: str, kind: str, rng: random.Random, follow_up: bool = False):
    asked, chosen, rejected = pair(sentence, label, kind, rng, follow_up)
    if chosen == rejected:  # a one-word sentence: its reverse, first and last word are itself
        kind = "sentiment"
        asked, chosen, rejected = pair(sentence, label, kind, rng, follow_up)
    assert chosen != rejected, (sentence, kind)
    return kind, asked, chosen, rejected


def explicit(pool: list[tuple[str, str]], count: int, rng: random.Random) -> tuple[list[dict], Counter]:
    rows, kinds = [], Counter()
    for index, kind in enumerate(dealt(rng, count)):
        sentence, label = pool[index % len(pool)]  # a pool smaller than the rows: each sentence, other instructions
        kind, asked, chosen, rejected = checked(sentence, label, kind, rng)
        prompt = [{"role": "user", "content": asked}]
        if rng.random() < 0.25:
            prompt.insert(0, {"role": "system", "content": rng.choice(chat_sample.SYSTEMS)})
        rows.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
        kinds[kind] += 1
    return rows, kinds


def implicit(pool: list[tuple[str, str]], count: int, rng: random.Random) -> tuple[list[dict], Counter]:
    rows, kinds = [], Counter()
    for index, kind in enumerate(dealt(rng, count)):
        sentence, label = pool[index % len(pool)]
        shape = rng.random()
        if shape < 0.25:  # two turns: the review's sentiment, answered, then a question about it
            kind, asked, chosen, rejected = checked(sentence, label, kind, rng, follow_up=True)
            shared = [
                {"role": "user", "content": f"Here is a review: {sentence}\nIs it positive or negative?"},
                {"role": "assistant", "content": f"{label.capitalize()}."},
                {"role": "user", "content": asked},
            ]
        else:
            kind, asked, chosen, rejected = checked(sentence, label, kind, rng)
            shared = [{"role": "user", "content": asked}]
        if rng.random() < 0.25:
            shared.insert(0, {"role": "system", "content": rng.choice(chat_sample.SYSTEMS)})
        rows.append(
            {
                "chosen": [*shared, {"role": "assistant", "content": chosen}],
                "rejected": [*shared, {"role": "assistant", "content": rejected}],
            }
        )
        kinds[kind] += 1
    return rows, kinds


def write(path: Path, rows: list[dict], kinds: Counter) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} rows ({', '.join(f'{kind} {kinds[kind]}' for kind in KINDS)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    rng = random.Random(0)
    train_pool, validation_pool = read_sentences(SAMPLE / "train.tsv"), read_sentences(SAMPLE / "dev.tsv")
    assert not {s for s, _ in train_pool} & {s for s, _ in validation_pool}, "train.tsv and dev.tsv share a sentence"
    OUT.mkdir(parents=True, exist_ok=True)
    write(OUT / "train.jsonl", *explicit(train_pool, TRAIN_ROWS, rng))
    write(OUT / "validation.jsonl", *explicit(validation_pool, VALIDATION_ROWS, rng))
    write(OUT / "implicit.jsonl", *implicit(validation_pool, IMPLICIT_ROWS, rng))


if __name__ == "__main__":
    main()
