"""Our task=reward against TRL's RewardTrainer (trl==1.16.0 from PyPI, a benchmark peer only, never a dependency):
the step-1 figures of both on the same tiny Llama sequence classifier, the same pairs and batch, in fp32 on CPU.

The fixture is bench/dpo_vs_trl.py's (a tiny Llama and a BPE tokenizer learned from the shipped preference sample,
ChatML as its chat template; the sample's first 8 pairs as conversations and as plain text), with the model saved
as a one-output LlamaForSequenceClassification (its score head initialised from torch.manual_seed(0), saved with
it, so both sides start from the same head). Cases: the conversational pairs; the text pairs with a `margin` column
and center_rewards_coefficient 0.01. One batch of all 8 pairs, max_length 128, one step (lr 1e-6).
Ours: scripts/train.py (recipes/llama/tp.yaml, task=reward, model=<folder>, one process), its first metrics.jsonl
record; TRL: `bench/trl_peer.py reward` in .venv-trl, what RewardTrainer logged for step 1. Figures: loss,
accuracy, margin, min/mean/max_reward (absolute 1e-5) and grad_norm (relative 1e-4); token ids compared row by row
(TRL's rows without the padding-id tokens they end with, which the score never reads: data/reward.py).

`make bench-reward-trl` prints the comparison as a table (docs/benchmarks.md; bench/trl_compare.py runs it);
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

NAME = "reward"
PAIRS = 8
MAX_LENGTH = 128
CENTER = 0.01
MARGINS = (0.5, 0.0, 1.0, -0.5, 0.25, 2.0, 0.0, 1.5)  # the text case's margin column, one per pair
CASES = ("conversational", "text")  # text: with MARGINS and center_rewards_coefficient CENTER
FIGURES = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm")


def write_fixture(folder: Path) -> Path:
    """dpo_vs_trl's fixture, its model saved as a one-output sequence classifier, the text pairs with MARGINS."""
    import torch
    from transformers import AutoConfig, LlamaForSequenceClassification

    dpo_vs_trl.write_fixture(folder)
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
    center = {"center_rewards_coefficient": CENTER} if case == "text" else {}
    settings = dict(batch_size=PAIRS, max_length=MAX_LENGTH, **center)
    return common.ours_overrides("reward", folder / "model", folder / case, cache_dir, **settings)


def ours_tokens(folder: Path, case: str, cache_dir: Path) -> list[dict]:
    """The rows our run trains on, in file order."""
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    train = prepare_data(load_config(RECIPE, ours_overrides(folder, case, cache_dir))).splits["train"]
    rows = sorted(zip(train["index"], train["input_ids"], train["rejected_ids"]))
    return [{"chosen": list(c), "rejected": list(r)} for _, c, r in rows]


def trl_request(folder: Path, case: str, cache_dir: Path, out: Path) -> list[str]:
    center = CENTER if case == "text" else None
    settings = dict(batch_size=PAIRS, max_length=MAX_LENGTH, out=out, center_rewards_coefficient=center)
    return common.peer_request("reward", model=folder / "model", pairs=folder / case / "train.jsonl", **settings)


def read_trl(out: Path) -> dict:
    """TRL's step-1 figures and its rows, each without the padding-id tokens it ends with."""
    result = json.loads(out.read_text())
    pad = result["pad_token_id"]

    def stripped(ids):
        while ids and ids[-1] == pad:
            ids = ids[:-1]
        return ids

    rows = [{side: stripped(row[side]) for side in ("chosen", "rejected")} for row in result["rows"]]
    return {"trl_version": result["trl_version"], "steps": [result["metrics"]], "rows": rows}


def compared(folder: Path, case: str, cache_dir: Path, ours_dir: Path, trl_out: Path, decode=None) -> dict:
    """One case: our run in `ours_dir` against the peer's `trl_out`, figure by figure and token by token."""
    trl = read_trl(trl_out)
    rows = common.compare(common.read_ours(ours_dir, FIGURES), trl["steps"], FIGURES, common.tolerance)
    differences = common.token_differences(ours_tokens(folder, case, cache_dir), trl["rows"], decode)
    return common.result_of({"case": case}, trl, rows, differences)


def table(results: list[dict]) -> str:
    title = (
        f"Step 1 of task=reward vs TRL {results[0]['trl_version']} RewardTrainer: tiny Llama sequence classifier, "
        f"{PAIRS} pairs of the shipped preference sample in one batch, max_length {MAX_LENGTH}, fp32, CPU (text: "
        f"with a margin column and center_rewards_coefficient {CENTER})."
    )
    return common.markdown_table(title, {"pairs": "case"}, results)


if __name__ == "__main__":
    sys.exit(common.main(sys.modules[__name__]))
