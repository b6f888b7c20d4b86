"""task=grpo's step data: a step's completions as a split (`RolloutSplit`: each row a prompt and one of its sampled
completions, with what the loss needs of it) and the batches the "grpo" batcher makes of it.

A rollout stage makes one RolloutSplit per step, global-batch ordered (prompt-major: each prompt's group of
num_generations completions together): `ids` (the prompt's tokens then the completion's), `prompt_lengths`,
`advantages` (one per completion, over the whole global batch), and per completion token the old policy's and the
reference's log-probabilities when the run keeps them (num_iterations > 1, beta > 0). `scored`: the completion's
tokens the loss reads (0 for a truncated completion under mask_truncated_completions, which then trains on
nothing, as TRL's completion mask says). Each completion counts one (`loss_count`): the objective folds its loss
type's divisor into a per-token weight (loop/grpo_loss.py). `written` and `read`: the split as JSON values and back,
checked, for a checkpoint taken between a rollout's iterations (rl/steps.py).

A batch (`GRPOBatcher.batch`) pads the rows, labels the scored completion tokens (next-token labels: the position
before each completion token predicts it) and carries, at each labelled position, (completion, advantage, old,
reference) as `Batch.columns`, which `Batch.loss_target` stacks after the labels: named parts of the batch, never
written into a split.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..tasks.task import HeadKind
from .batch import Batch, next_token_labels, padded_batch
from .sampling import token_slots


@dataclass(frozen=True)
class RolloutSplit:
    """One step's completions (see the module docstring); rows are numbered as in the step's global batch."""

    ids: list[list[int]]
    prompt_lengths: list[int]
    scored: list[int]  # completion tokens the loss reads (0: masked, a truncated completion)
    advantages: list[float]
    old_logps: list[list[float]] | None = None  # per completion token (num_iterations > 1)
    reference_logps: list[list[float]] | None = None  # per completion token (beta > 0)
    head: HeadKind = HeadKind.CAUSAL_LM

    @property
    def lengths(self) -> list[int]:
        return [len(row) for row in self.ids]

    @property
    def targets(self) -> list[int]:
        """Each completion counts one: the objective weighs its tokens (loop/grpo_loss.py)."""
        return [1] * len(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def loss_count(self, indices: list[int]) -> int:
        return len(indices)

    def written(self) -> dict:
        """The split as JSON values (a checkpoint keeps a rollout trained on again: rl/steps.py); JSON writes each
        float's shortest round-trip form, so `read` gives back the same numbers bit for bit."""
        written = asdict(self)
        del written["head"]  # always a causal LM's
        return written

    @classmethod
    def read(cls, written, vocab: int) -> RolloutSplit:
        """`written` back as a split, every field checked (its types, lengths, token ids under `vocab`, finite
        numbers): a ValueError saying what is wrong, never a split that fails later in a batch."""
        fields = ("ids", "prompt_lengths", "scored", "advantages", "old_logps", "reference_logps")
        if not isinstance(written, dict) or sorted(written) != sorted(fields):
            keys = sorted(written) if isinstance(written, dict) else type(written).__name__
            raise ValueError(f"expected the keys {', '.join(fields)}, found {keys}")
        ids, count = written["ids"], len(written["ids"]) if isinstance(written["ids"], list) else 0
        if not count or not all(isinstance(row, list) and all(_whole(t, vocab - 1) for t in row) for row in ids):
            raise ValueError(f"ids must be lists of token ids from 0 to {vocab - 1}")
        for name, valid, what in (
            ("prompt_lengths", _whole, "counts"),
            ("scored", _whole, "counts"),
            ("advantages", _number, "finite numbers"),
        ):
            values = written[name]
            if not (isinstance(values, list) and len(values) == count and all(map(valid, values))):
                raise ValueError(f"{name} must be {count} {what}, one per row")
        for row, start, scored in zip(ids, written["prompt_lengths"], written["scored"]):
            if start + scored > len(row):
                raise ValueError(f"a row of {len(row)} tokens cannot hold {start} prompt and {scored} scored tokens")
        for name in fields[4:]:
            logps = written[name]
            per_row = zip(logps or [], written["scored"])
            if logps is not None and not (
                isinstance(logps, list)
                and len(logps) == count
                and all(isinstance(row, list) and len(row) == n and all(map(_number, row)) for row, n in per_row)
            ):
                raise ValueError(f"{name} must be null or {count} lists of finite numbers, one per scored token")
        return cls(**written)


def _whole(value, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class GRPOBatcher:
    """Padded batches of a step's completions, labelled on their scored tokens, with each position's columns."""

    packed = False

    def __init__(self, split: RolloutSplit, *, pad_id: int, padding_side: str, pad_multiple: int, device):
        self.split, self.pad_id, self.padding_side = split, pad_id, padding_side
        self.pad_multiple, self.device = pad_multiple, device

    def batch(self, indices: list[int], labelled: bool = True) -> Batch:
        split = self.split
        rows = [split.ids[i] for i in indices]
        batch = padded_batch(rows, pad_id=self.pad_id, padding_side=self.padding_side, pad_multiple=self.pad_multiple)
        trained = torch.zeros_like(batch.input_ids)
        columns = torch.zeros((*batch.input_ids.shape, 4), dtype=torch.float64)
        for number, index in enumerate(indices):
            start = 0 if self.padding_side == "right" else batch.length - len(rows[number])
            first = start + split.prompt_lengths[index]  # the completion's first token
            scored = slice(first, first + split.scored[index])
            trained[number, scored] = 1
            before = slice(scored.start - 1, scored.stop - 1)  # the positions predicting them
            columns[number, before, 0] = index
            columns[number, before, 1] = split.advantages[index]
            for column, logps in ((2, split.old_logps), (3, split.reference_logps)):
                if logps is not None:
                    columns[number, before, column] = torch.tensor(logps[index][: split.scored[index]]).double()
        batch.labels = next_token_labels(batch.input_ids, batch.attention_mask, trained)
        batch.columns = columns
        return batch.to(self.device)

    def sequence_lengths(self, indices: list[int]) -> list[int]:
        return [len(self.split.ids[i]) for i in indices]

    def token_slots(self, global_batch: list[int], dp: int, accumulation: int) -> int:
        return token_slots(global_batch, self.split.lengths, dp, accumulation, self.pad_multiple)
