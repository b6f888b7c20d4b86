"""task=reward's tokens and batches: each preference pair as two rows, scored by a one-output classification head.

Tokens: task=dpo's (preference.py: the prompt and each answer rendered and tokenized together as TRL's trainers
make them, EOS appended to a text answer), so that a row is TRL's RewardTrainer's `prompt + chosen`. Then each
row loses the padding-id tokens it ends with (a text row's EOS where the tokenizer pads with EOS): transformers'
sequence classifiers read the score at the rightmost token that is not the padding id (so do TRL and the exported
model under transformers' pipeline), and with a causal model nothing after that token changes it; without them,
the last real token is that token under every layout (a pipeline's last stage reads the last real token).

Batches (RewardBatcher): padded, the rows of pair p at 2p (chosen) and 2p + 1 (rejected), so that any split of
the rows into micro-batches of an even count keeps pairs whole; labels: each row's pair's margin (0 without a
`margin` column), which the loss (loop/reward_loss.py) reads at the chosen rows.
"""

from __future__ import annotations

import datasets
import torch

from ..errors import UserError
from .batch import Batch, PreferenceBatcher, TokenizedSplit, padded_batch
from .preference import tokenize_pairs


def _stripped(ids: list[int], pad_id: int | None) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] == pad_id:
        end -= 1
    return ids[:end]


def tokenize_reward_pairs(split: datasets.Dataset, tokenizer, max_length: int, desc: str) -> datasets.Dataset:
    """tokenize_pairs' columns (input_ids: the chosen row, rejected_ids, prompt_length, length, index), each row
    without the padding-id tokens it ends with, and `margin` where the split has one."""
    pairs = tokenize_pairs(split, tokenizer, max_length, desc)
    where = dict(zip(split["index"][:], split["where"][:]))
    columns = {name: pairs[name][:] for name in pairs.column_names}
    pad = tokenizer.pad_token_id
    for number, index in enumerate(columns["index"]):
        chosen, rejected = (_stripped(columns[name][number], pad) for name in ("input_ids", "rejected_ids"))
        if not chosen or not rejected:
            raise UserError(f"{where[index]}: a row is nothing but padding tokens; it has no token to score")
        if chosen == rejected:
            raise UserError(
                f"{where[index]}: chosen and rejected are the same tokens once the padding tokens they end with are "
                "dropped (a reward model scores the last other token); a pair needs two different answers"
            )
        columns["input_ids"][number], columns["rejected_ids"][number] = chosen, rejected
        columns["length"][number] = len(chosen) + len(rejected)
    if "margin" in split.column_names:
        columns["margin"] = split["margin"][:]
    return datasets.Dataset.from_dict(columns)


class RewardBatcher(PreferenceBatcher):
    """Batches of preference pairs for a reward model: pair i of a batch's `indices` is rows 2i (chosen) and 2i + 1
    (rejected), padded to the longest (never packed); labels: each row's pair's margin (float). Its rows' lengths
    and token slots are the preference batcher's, unpacked."""

    def __init__(self, split: TokenizedSplit, *, pad_id: int, padding_side: str, pad_multiple: int, device):
        super().__init__(split, pad_id=pad_id, padding_side=padding_side, pad_multiple=pad_multiple, device=device)

    def batch(self, indices: list[int], labelled: bool = True) -> Batch:
        split = self.split
        rows = [ids[i] for i in indices for ids in (split.ids, split.rejected_ids)]
        batch = padded_batch(rows, pad_id=self.pad_id, padding_side=self.padding_side, pad_multiple=self.pad_multiple)
        margins = [split.margins[i] if split.margins is not None else 0.0 for i in indices]
        batch.labels = torch.tensor(margins, dtype=torch.float32).repeat_interleave(2)
        return batch.to(self.device)
