"""Small folders of the nine GLUE tasks in GLUE's own file layout (what the GLUE download unpacks: tab-separated,
unquoted, each task's own header and column order; CoLA's train and dev files headerless; MRPC's train and dev
beginning with the byte order mark of Microsoft's files; some STS-B lines with more fields than the header, the
score last), for tests that read `data_dir` without the real data.

`write_glue_task(folder, "mnli")` writes the files and returns what a reader should find: per split (train,
validation[, validation_mismatched], test[, test_mismatched]) the rows as (text, text_pair, label value as the file
writes it; None in a test split). Texts are drawn from a fixed word list by a seeded generator; some hold a stray
double quote, as GLUE's do, so a reader that treats quotes as quoting merges rows and is caught.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

WORDS = (
    "the a film movie story actor plot scene director cast script music ending is was feels seems remains "
    "good bad great dull funny sad long short warm cold clever silly honest strange quiet loud it this every "
    "never always rather quite very too and but or with without of for about"
).split()


class GlueRow(NamedTuple):
    text: str
    text_pair: str | None
    label: str | None  # as the file writes it (CoLA "0"/"1", MNLI "entailment", STS-B "3.200"); None in a test split


# Per task: the label values its files write (STS-B: None, a float score), whether it is a pair task, and the
# file names of its dev and test splits (MNLI: matched, then mismatched).
LABELS = {
    "cola": ("0", "1"),
    "sst2": ("0", "1"),
    "mrpc": ("0", "1"),
    "qqp": ("0", "1"),
    "stsb": None,
    "mnli": ("entailment", "neutral", "contradiction"),
    "qnli": ("entailment", "not_entailment"),
    "rte": ("entailment", "not_entailment"),
    "wnli": ("0", "1"),
}
PAIRS = {"mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}
MNLI_PARSES = ("sentence1_binary_parse", "sentence2_binary_parse", "sentence1_parse", "sentence2_parse")


def split_files(task: str) -> dict[str, str]:
    if task == "mnli":
        return {
            "train": "train.tsv",
            "validation": "dev_matched.tsv",
            "validation_mismatched": "dev_mismatched.tsv",
            "test": "test_matched.tsv",
            "test_mismatched": "test_mismatched.tsv",
        }
    return {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv"}


def _sentence(rng: random.Random, number: int) -> str:
    words = rng.choices(WORDS, k=rng.randint(4, 12))
    if number % 7 == 3:  # GLUE's texts hold unmatched quote characters; its files are not quoted
        words[rng.randrange(len(words))] = '"' + words[0]
    return " ".join(words) + rng.choice((" .", " !", " ?"))


def _parse(text: str) -> str:
    return "( " + " ".join(f"( {w} )" for w in text.split()) + " )"


def _header_and_fields(task: str, kind: str, number: int, row: GlueRow) -> tuple[list[str] | None, list[str]]:
    """The file's header (None: headerless) and this row's fields; `kind`: train, dev or test."""
    text, pair, label = row
    if task == "cola":
        if kind == "test":
            return ["index", "sentence"], [str(number), text]
        return None, ["gj04", label, "" if label == "1" else "*", text]
    if task == "sst2":
        if kind == "test":
            return ["index", "sentence"], [str(number), text]
        return ["sentence", "label"], [text + " ", label]  # GLUE's SST-2 sentences end with a space
    if task == "mrpc":
        ids = [str(1000 + 2 * number), str(1001 + 2 * number)]
        if kind == "test":
            return ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"], [str(number), *ids, text, pair]
        return ["\ufeffQuality", "#1 ID", "#2 ID", "#1 String", "#2 String"], [label, *ids, text, pair]
    if task == "qqp":
        if kind == "test":
            return ["id", "question1", "question2"], [str(number), text, pair]
        ids = [str(number), str(2 * number + 1), str(2 * number + 2)]
        return ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], [*ids, text, pair, label]
    if task == "stsb":
        header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"]
        fields = [str(number), "main-captions", "MSRvid", "2012test", f"{number:04d}", "none", "none", text, pair]
        if number % 5 == 4:  # real STS-B lines carrying extra tab-separated fields after sentence2
            fields += ["none", "2012"]
        return (header, fields) if kind == "test" else (header + ["score"], fields + [label])
    if task == "mnli":
        header = ["index", "promptID", "pairID", "genre", *MNLI_PARSES, "sentence1", "sentence2"]
        fields = [str(number), str(31193 + number), f"{31193 + number}n", "government"]
        fields += [_parse(text), _parse(pair), "(ROOT " + _parse(text) + ")", "(ROOT " + _parse(pair) + ")", text, pair]
        if kind == "test":
            return header, fields
        if kind == "train":
            return header + ["label1", "gold_label"], fields + [label, label]
        return header + ["label1", "label2", "label3", "label4", "label5", "gold_label"], fields + [label] * 6
    # qnli, rte, wnli: index, the two texts, label
    header = ["index", "question", "sentence"] if task == "qnli" else ["index", "sentence1", "sentence2"]
    fields = [str(number), text, pair]
    return (header, fields) if kind == "test" else (header + ["label"], fields + [label])


def write_glue_task(
    folder: Path, task: str, train_rows: int = 40, dev_rows: int = 12, test_rows: int = 10, seed: int = 0
) -> dict[str, list[GlueRow]]:
    """`task`'s files in `folder` (created), as GLUE ships them; returns the rows per split. Every label value
    occurs in train and in each dev file; texts are stripped of the space SST-2's files add."""
    rng = random.Random(f"{task}-{seed}")
    folder.mkdir(parents=True, exist_ok=True)
    values = LABELS[task]
    written: dict[str, list[GlueRow]] = {}
    for split, name in split_files(task).items():
        kind = "train" if split == "train" else "test" if split.startswith("test") else "dev"
        count = {"train": train_rows, "dev": dev_rows, "test": test_rows}[kind]
        rows = []
        for number in range(count):
            text = _sentence(rng, number)
            pair = _sentence(rng, number + 1) if task in PAIRS else None
            if kind == "test":
                label = None
            elif values is None:
                label = f"{rng.uniform(0, 5):.3f}"
            else:
                label = values[number % len(values)] if number < len(values) else rng.choice(values)
            rows.append(GlueRow(text, pair, label))
        lines = []
        for number, row in enumerate(rows):
            header, fields = _header_and_fields(task, kind, number, row)
            if number == 0 and header is not None:
                lines.append("\t".join(header))
            lines.append("\t".join(fields))
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        written[split] = rows
    return written
