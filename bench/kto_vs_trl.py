"""Our task=kto against TRL's KTOTrainer (trl==1.16.0 from PyPI, a benchmark peer only, never a dependency): the
figures of the first two steps of both on the same tiny Llama, the same rows, beta and batches, in fp32 on CPU.

The fixture is bench/dpo_vs_trl.py's (a tiny Llama and a BPE tokenizer learned from the shipped preference sample,
ChatML as its chat template; the sample's first 8 pairs as conversations and as plain text), its pairs written as
TRL's unpaired rows (prompt, completion, label: each pair's chosen answer true, then its rejected one false): 16
rows, two global batches of 8, beta 0.1, desirable_weight 3, max_length 128, lr 1e-2 (linear decay, no weight
decay), two steps.
Ours: scripts/train.py (recipes/llama/tp.yaml, task=kto, model=<folder>, one process), its metrics.jsonl records.
TRL: `bench/trl_peer.py kto` in .venv-trl, fed the rows in our sampler's order (its sequential batches are then our
global batches, so its KL rows, each batch rotated by one, are ours). At step 1 the policy is the reference: the
loss is 1/2, kl and the rewards 0 on both sides whatever the code does, and logps/* and grad_norm test the
figures; step 2 (after one identical update) tests kl, the rewards and the loss. Figures: loss, kl, rewards/chosen,
rewards/rejected, rewards/margins (absolute 1e-5), logps/chosen, logps/rejected (relative 1e-6: sums near -90)
and grad_norm (relative 1e-4) at both steps; token ids compared row by row.

`make bench-kto-trl` prints the comparison as a table (docs/benchmarks.md; bench/trl_compare.py runs it);
tests/loop/test_trl_peers.py runs the same comparison with this module's functions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # bench/'s scripts import each other by name
    sys.path.append(str(Path(__file__).resolve().parent))
import dpo_vs_trl  # noqa: E402
import trl_compare as common  # noqa: E402
from trl_compare import RECIPE  # noqa: E402

NAME = "kto"
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


def write_fixture(folder: Path) -> Path:
    """dpo_vs_trl's fixture, each format's pairs also as unpaired rows in `folder`/kto-<format>/{train,validation}
    .jsonl (validation: the first 4 rows)."""
    dpo_vs_trl.write_fixture(folder)
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
    settings = dict(batch_size=BATCH, max_steps=STEPS, max_length=MAX_LENGTH, dpo_beta=BETA, lr=LR)
    settings |= dict(desirable_weight=DESIRABLE_WEIGHT, lr_scheduler="linear", warmup_ratio=0, weight_decay=0)
    return common.ours_overrides("kto", folder / "model", folder / f"kto-{case}", cache_dir, **settings)


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


def trl_request(folder: Path, case: str, cache_dir: Path, out: Path) -> list[str]:
    """The peer's arguments for one case, its rows written in our run's batch order first."""
    rows = write_trl_rows(folder, case, ours_rows(folder, case, cache_dir)[1])
    settings = dict(batch_size=BATCH, max_length=MAX_LENGTH, steps=STEPS, lr=LR, beta=BETA)
    settings |= dict(desirable_weight=DESIRABLE_WEIGHT, out=out)
    return common.peer_request("kto", model=folder / "model", rows=rows, **settings)


def read_trl(out: Path, order: list[int]) -> dict:
    """TRL's figures per step and its rows by file row (it was fed them in `order`), cut to MAX_LENGTH tokens."""
    result = json.loads(out.read_text())
    rows = [None] * len(order)
    for position, row in enumerate(result["rows"]):
        ids = (row["prompt"] + row["completion"])[:MAX_LENGTH]
        rows[order[position]] = {"prompt_length": len(row["prompt"]), "ids": ids}
    return {"trl_version": result["trl_version"], "steps": result["steps"], "rows": rows}


def compared(folder: Path, case: str, cache_dir: Path, ours_dir: Path, trl_out: Path, decode=None) -> dict:
    """One case: our run in `ours_dir` against the peer's `trl_out`, step by step, figure by figure and row by
    row."""
    our_rows, order = ours_rows(folder, case, cache_dir)
    trl = read_trl(trl_out, order)
    rows = common.compare(common.read_ours(ours_dir, FIGURES, STEPS), trl["steps"], FIGURES, common.tolerance)
    differences = common.token_differences(our_rows, trl["rows"], decode, unit="row")
    return common.result_of({"case": case}, trl, rows, differences)


def table(results: list[dict]) -> str:
    title = (
        f"Steps 1 and 2 of task=kto vs TRL {results[0]['trl_version']} KTOTrainer: tiny Llama, the preference "
        f"sample's first 8 pairs as 16 unpaired rows, global batches of {BATCH}, beta {BETA}, desirable_weight "
        f"{DESIRABLE_WEIGHT}, lr {LR}, max_length {MAX_LENGTH}, fp32, CPU."
    )
    return common.markdown_table(title, {"rows": "case"}, results)


if __name__ == "__main__":
    sys.exit(common.main(sys.modules[__name__]))
