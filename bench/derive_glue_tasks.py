"""A GLUE sentence-pair task (MRPC's file format) and a regression task (STS-B's) derived from SST-2's rows, for
runs on a machine that reaches no other data. Deterministic: the same SST-2 files and seed write the same bytes.

Each split is paired within itself (train pairs from train.tsv, dev pairs from dev.tsv: no sentence crosses
splits). The split's rows are shuffled with the seed, then row k of that order is paired with row k+1 (the last
with the first): every sentence appears exactly twice, never with itself. MRPC and STS-B use different orders
(seed and seed + 1).

  mrpc/{train,dev}.tsv  GLUE MRPC header (Quality, #1 ID, #2 ID, #1 String, #2 String). Quality 1 (equivalent)
                        when both sentences have the same SST-2 label, else 0. IDs: the SST-2 file's line numbers.
  stsb/{train,dev}.tsv  GLUE STS-B header (index genre filename year old_index source1 source2 sentence1 sentence2
                        score). score = 3 * same_label + 2 * min(words1, words2) / max(words1, words2), rounded to
                        3 decimals: in [0, 5]; the sentiment part is learnable from the texts, the graded part (how
                        alike the two lengths are, in whitespace-separated words) too, so the task is not a
                        two-valued one in disguise.

Usage (from the repository root): python bench/derive_glue_tasks.py [--sst2 ../shared/data/sst2]
[--out ../shared/data/derived] [--seed 0]; then train with glue_task=mrpc data_dir=OUT/mrpc or glue_task=stsb
data_dir=OUT/stsb. The derived files are data: never commit them.
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

MRPC_HEADER = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
STSB_HEADER = "index genre filename year old_index source1 source2 sentence1 sentence2 score".split()


def read_sst2(path: Path) -> list[tuple[int, str, int]]:
    """(line number, sentence, label) per row of a GLUE SST-2 file (tab-separated, unquoted, header line)."""
    with open(path, encoding="utf-8", newline="") as file:
        rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    if rows[0] != ["sentence", "label"]:
        raise SystemExit(f"{path}: header {rows[0]}, expected SST-2's sentence<TAB>label")
    return [(line, sentence.strip(), int(label)) for line, (sentence, label) in enumerate(rows[1:], start=2)]


def pairs(rows: list, seed: int) -> list[tuple]:
    """Each row with its successor in a seeded shuffle (cyclically): every row twice, never with itself."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [(rows[order[k]], rows[order[(k + 1) % len(order)]]) for k in range(len(order))]


def similarity(first: tuple, second: tuple) -> float:
    """The STS-B score of a pair: 3 for the same sentiment, plus up to 2 for equally long sentences."""
    words1, words2 = len(first[1].split()), len(second[1].split())
    return round(3.0 * (first[2] == second[2]) + 2.0 * min(words1, words2) / max(words1, words2, 1), 3)


def write(path: Path, header: list[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file, delimiter="\t", quoting=csv.QUOTE_NONE, quotechar=None, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sst2", type=Path, default=Path("../shared/data/sst2"), help="SST-2's GLUE folder")
    parser.add_argument("--out", type=Path, default=Path("../shared/data/derived"), help="writes OUT/mrpc, OUT/stsb")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for split in ("train", "dev"):
        rows = read_sst2(args.sst2 / f"{split}.tsv")
        mrpc = [[int(a[2] == b[2]), a[0], b[0], a[1], b[1]] for a, b in pairs(rows, args.seed)]
        write(args.out / "mrpc" / f"{split}.tsv", MRPC_HEADER, mrpc)
        stsb = [
            [i, "sst2", f"sst2-{split}", "2013", i, f"line{a[0]}", f"line{b[0]}", a[1], b[1], f"{similarity(a, b):.3f}"]
            for i, (a, b) in enumerate(pairs(rows, args.seed + 1))
        ]
        write(args.out / "stsb" / f"{split}.tsv", STSB_HEADER, stsb)
        same = sum(row[0] for row in mrpc) / len(mrpc)
        mean = sum(float(row[-1]) for row in stsb) / len(stsb)
        print(f"{split}: {len(mrpc)} pairs each; mrpc equivalent {same:.3f}; stsb mean score {mean:.3f}")
    print(f"wrote {args.out / 'mrpc'} and {args.out / 'stsb'}")


if __name__ == "__main__":
    main()
