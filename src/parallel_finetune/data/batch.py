"""The data contract between the data stage and the loop, written down: a tokenized split (`TokenizedSplit`, the
columns a cached split holds, read once) and the `Batch` a batcher makes of some of its rows.

    TokenizedSplit   ids, lengths[, labels][, token types][, target masks][, prompt lengths][, index], and each
                     row's count of loss terms (`targets`): 1 per labelled row of a classification split, its
                     trained tokens for a language model's
    Batch            input ids, the attention (a padding mask, and positions that restart at every row of a packed
                     batch: its rows' boundaries), labels already aligned with the head's output (shifted for a
                     language model) and IGNORE (regression: NaN) where there is no loss, token type ids for a
                     family with them, and its kind: PADDED or PACKED, a field, not a key's presence
    PaddedBatcher    rows padded to the longest of the batch (data.collate's rule, either padding side)
    PackedBatcher    rows laid end to end in sequences of max_length (packing.py's bins)

A batcher owns the training columns: the builder makes one, the Trainer asks it for an accumulation slice's Batch
and for the token slots a global batch occupies. Evaluation and generation make padded batches the same way.
    PreferenceBatcher
                     task=dpo: each pair's two rows (chosen, rejected), padded, or packed with both rows of a pair
                     in one sequence, so that a pair is never split across micro-batches or data-parallel ranks

A preference batch also says, at each labelled position, which answer the label belongs to (`answers`: 2p for
pair p's chosen answer, 2p + 1 for its rejected one) and that answer's reference log-probability (`reference`);
the loss is handed the final hidden states instead of logits, since a language model's labels are already where
its head's outputs are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import Enum

import datasets
import torch

from ..tasks.task import HeadKind, Task
from .packing import PackedShape, first_fit_decreasing, packed_slots, packed_token_slots
from .sampling import accumulation_slices, token_slots

IGNORE = -100  # the label of a position (or row) with no loss


class BatchKind(str, Enum):
    PADDED = "padded"  # rows padded to the batch's longest; attention_mask says which tokens are real
    PACKED = "packed"  # rows end to end; positions restart at every row; attention and targets never cross rows


@dataclass
class Batch:
    input_ids: torch.Tensor  # (rows, length)
    attention_mask: torch.Tensor  # (rows, length), 1 = a real token
    positions: torch.Tensor  # (rows, length): each token's position in its own row (its padding not counted)
    labels: torch.Tensor | None  # aligned with the head's outputs: (rows,) per row, or (rows, length) per position
    kind: BatchKind = BatchKind.PADDED
    token_type_ids: torch.Tensor | None = None  # sentence pairs of a family with token types (BERT)
    # task=dpo, at each labelled position: the answer the label belongs to (2p: pair p's chosen answer, 2p + 1:
    # its rejected one; -1 elsewhere) and that answer's reference log-probability (0 while it is being measured)
    answers: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    # task=grpo, at each labelled position: (completion, advantage, old log-probability, reference's), float64
    # (data/grpo.py); the loss target's columns after the label
    columns: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.kind is BatchKind.PACKED

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def row_starts(self) -> torch.Tensor:
        """Where each packed row (and the padding tail) begins: the boundaries its attention must not cross."""
        return self.positions == 0

    def last_positions(self) -> torch.Tensor:
        """Each row's last real token's position (rows,), whichever side it was padded on."""
        columns = torch.arange(self.length, device=self.attention_mask.device)
        return (self.attention_mask * columns).argmax(-1)

    def loss_target(self) -> torch.Tensor:
        """What the loss is handed beside the model's outputs: the labels, or for preference pairs (labels,
        answers, reference) stacked on a last axis, in float64 (token ids and answer numbers are exact there), so
        that a pipeline splits them into micro-batches with the rows."""
        if self.columns is not None:
            return torch.cat([self.labels.double().unsqueeze(-1), self.columns], -1)
        if self.answers is None:
            return self.labels
        return torch.stack([self.labels.double(), self.answers.double(), self.reference], -1)

    def scored(self) -> int:
        """How many labels carry a loss term (evaluation's count; training counts whole global batches): a
        preference batch's pairs."""
        if self.answers is not None:
            return int(self.answers.max()) // 2 + 1
        if self.columns is not None:  # task=grpo: its completions
            return int((self.labels != IGNORE).any(-1).sum())
        if self.labels.is_floating_point():
            return int((~self.labels.isnan()).sum())
        return int((self.labels != IGNORE).sum())

    def to(self, device: torch.device) -> Batch:
        moved = {
            f.name: value.to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def next_token_labels(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    target_mask: torch.Tensor | None = None,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A language model's labels, aligned with its outputs: position t is labelled with token t + 1, IGNORE where
    that token is padding, not trained (`target_mask` 0: a prompt token under train_on=answers) or the first of a
    packed row (it is not predicted from the previous row); the last position predicts nothing."""
    labels = torch.full_like(input_ids, IGNORE)
    ignored = attention_mask[:, 1:] == 0
    if target_mask is not None:
        ignored |= target_mask[:, 1:] == 0
    if row_starts is not None:
        ignored |= row_starts[:, 1:]
    labels[:, :-1] = input_ids[:, 1:].masked_fill(ignored, IGNORE)
    return labels


@dataclass(frozen=True)
class TokenizedSplit:
    """A cached split's columns as lists (a `datasets` column costs ~10 us a row, a list ~50 ns). Frozen: what is
    learned about its rows later (task=dpo's reference log-probabilities) travels beside it (PairReference), never
    written into it."""

    head: HeadKind
    ids: list[list[int]]
    lengths: list[int]
    targets: list[int]  # each row's loss terms: 1 (a labelled classification row) or its trained tokens
    labels: list | None = None  # class ids or regression values (classification rows with labels)
    regression: bool = False
    token_types: list | None = None
    target_masks: list | None = None  # which tokens are trained (task=sft)
    prompt_lengths: list[int] | None = None  # the tokens before a conversation's first trained answer (task=sft)
    index: list[int] | None = None  # the rows' own numbering (a test split's predictions)
    rejected_ids: list[list[int]] | None = None  # task=dpo: a pair's second row (`ids` holds the chosen one)
    margins: list[float] | None = None  # task=reward: each pair's margin (its `margin` column)
    desirable: list[bool] | None = None  # task=kto: each row's label (a desirable completion or not)
    completion_ids: list[list[int]] | None = None  # task=kto: each row's whole completion (KL rows: data/kto.py)

    @classmethod
    def of(cls, split: datasets.Dataset, task: Task) -> TokenizedSplit:
        """The columns data.prepare wrote for `task` (optional ones are None when the split has none)."""

        def optional(name: str) -> list | None:
            return split[name][:] if name in split.column_names else None

        lengths = split["length"][:]
        labels = optional("label") if task.head is HeadKind.CLASSIFICATION else None
        counts = optional("targets")  # sft: trained tokens per row
        if task.kind.pairs or task.kind.unpaired:  # the loss is averaged over pairs (kto: rows)
            targets = [1] * len(lengths)
        elif task.head is HeadKind.CLASSIFICATION:
            targets = [1] * len(lengths)
        else:
            targets = counts if counts is not None else [length - 1 for length in lengths]
        return cls(
            task.head,
            split["input_ids"][:],
            lengths,
            targets,
            labels,
            task.regression,
            optional("token_type_ids"),
            optional("target_mask"),
            optional("prompt_length"),
            optional("index"),
            optional("rejected_ids"),
            optional("margin"),
            optional("desirable"),
            optional("completion_ids"),
        )

    def __len__(self) -> int:
        return len(self.ids)

    def loss_count(self, indices: list[int]) -> int:
        """What the loss of these rows is averaged over: samples, or predicted tokens."""
        return sum(self.targets[i] for i in indices)

    def label_tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32 if self.regression else torch.long)


def padded_batch(
    rows: list[list[int]],
    *,
    pad_id: int,
    padding_side: str = "right",
    pad_multiple: int = 1,
    token_types: list[list[int]] | None = None,
) -> Batch:
    """`rows` padded to the longest (rounded up to `pad_multiple`) on `padding_side`, without labels. Positions
    count real tokens only, so a left-padded row sees the positions of its unpadded self."""
    longest = -(-max(len(row) for row in rows) // pad_multiple) * pad_multiple
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    types = torch.zeros_like(ids) if token_types is not None else None
    for number, row in enumerate(rows):
        span = slice(0, len(row)) if padding_side == "right" else slice(longest - len(row), longest)
        ids[number, span] = torch.tensor(row, dtype=torch.long)
        mask[number, span] = 1
        if types is not None:
            types[number, span] = torch.tensor(token_types[number], dtype=torch.long)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(ids, mask, positions, None, BatchKind.PADDED, types)


class PaddedBatcher:
    """Batches of a split's rows padded to their longest: a training slice, an evaluation chunk."""

    packed = False

    def __init__(self, split: TokenizedSplit, *, pad_id: int, padding_side: str, pad_multiple: int, device):
        self.split, self.pad_id, self.padding_side = split, pad_id, padding_side
        self.pad_multiple, self.device = pad_multiple, device

    def batch(self, indices: list[int], labelled: bool = True) -> Batch:
        """Rows `indices` on the device; `labelled`: with their labels (a test split's rows have none)."""
        split = self.split
        batch = padded_batch(
            [split.ids[i] for i in indices],
            pad_id=self.pad_id,
            padding_side=self.padding_side,
            pad_multiple=self.pad_multiple,
            token_types=[split.token_types[i] for i in indices] if split.token_types is not None else None,
        )
        if split.head is HeadKind.CAUSAL_LM:
            target_mask = None
            if split.target_masks is not None:
                target_mask = padded_batch(
                    [split.target_masks[i] for i in indices],
                    pad_id=0,
                    padding_side=self.padding_side,
                    pad_multiple=self.pad_multiple,
                ).input_ids
            batch.labels = next_token_labels(batch.input_ids, batch.attention_mask, target_mask)
        elif labelled and split.labels is not None:
            batch.labels = split.label_tensor([split.labels[i] for i in indices])
        return batch.to(self.device)

    def sequence_lengths(self, indices: list[int]) -> list[int]:
        """The lengths of the sequences these rows are (what FLOPs are counted over)."""
        return [self.split.lengths[i] for i in indices]

    def token_slots(self, global_batch: list[int], dp: int, accumulation: int) -> int:
        """Token positions a global batch occupies once each replica's slices are padded to their longest row."""
        return token_slots(global_batch, self.split.lengths, dp, accumulation, self.pad_multiple)


class PackedBatcher:
    """Batches of a split's rows packed end to end (`packing: true`) in sequences shaped as `shape` says."""

    packed = True

    def __init__(self, split: TokenizedSplit, *, pad_id: int, shape: PackedShape, device):
        self.split, self.pad_id, self.shape, self.device = split, pad_id, shape, device

    def batch(self, indices: list[int], labelled: bool = True) -> Batch:
        """Rows `indices` packed: positions restart at 0 for every row and for the padding tail (a segment of its
        own, so no query row is fully masked); a classification row's label sits at its pooled position only."""
        split, shape = self.split, self.shape
        lengths = [split.lengths[i] for i in indices]
        bins = [[indices[p] for p in group] for group in first_fit_decreasing(lengths, shape.capacity)]
        length = shape.length(max(sum(split.lengths[i] for i in group) for group in bins))
        rows = shape.rows(len(bins))
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, length), dtype=torch.long)
        positions = torch.arange(length, dtype=torch.long).repeat(rows, 1)  # all-padding sequences: one segment
        classified = split.head is HeadKind.CLASSIFICATION and labelled and split.labels is not None
        labels = None
        if classified:
            labels = split.label_tensor([]).new_full((rows, length), math.nan if split.regression else IGNORE)
        types = torch.zeros_like(input_ids) if split.token_types is not None else None
        trained = torch.zeros_like(input_ids) if split.target_masks is not None else None
        for row, group in enumerate(bins):
            start = 0
            for index in group:
                size = split.lengths[index]
                span = slice(start, start + size)
                input_ids[row, span] = torch.tensor(split.ids[index], dtype=torch.long)
                mask[row, span] = 1
                positions[row, span] = torch.arange(size)
                if labels is not None:
                    labels[row, start if shape.pooled == "first" else start + size - 1] = split.labels[index]
                if types is not None:
                    types[row, span] = torch.tensor(split.token_types[index], dtype=torch.long)
                if trained is not None:
                    trained[row, span] = torch.tensor(split.target_masks[index], dtype=torch.long)
                start += size
            positions[row, start:] = torch.arange(length - start)  # the padding tail: a segment of its own
        if split.head is HeadKind.CAUSAL_LM:
            labels = next_token_labels(input_ids, mask, trained, positions == 0)
        return Batch(input_ids, mask, positions, labels, BatchKind.PACKED, types).to(self.device)

    def sequence_lengths(self, indices: list[int]) -> list[int]:
        """The rows' own lengths: attention never crosses rows, so a packed row costs what it costs alone."""
        return [self.split.lengths[i] for i in indices]

    def token_slots(self, global_batch: list[int], dp: int, accumulation: int) -> int:
        return packed_token_slots(global_batch, self.split.lengths, dp, accumulation, self.shape)


@dataclass(frozen=True)
class PairReference:
    """task=dpo's reference log-probabilities of a split's pairs (chosen, rejected), each summed over its answer's
    tokens, as loop/reference.py measured them before training: handed to the batchers that put them into each
    batch (Batch.reference). Only the pairs the run trains on (and every held-out pair) are measured; a batch of
    another pair is refused, not given a silent 0."""

    values: list[tuple[float, float]]
    measured: list[bool]

    def of(self, pair: int) -> tuple[float, float]:
        if not self.measured[pair]:
            raise RuntimeError(f"pair {pair}'s reference log-probabilities were not measured before training")
        return self.values[pair]


class PreferenceBatcher:
    """Batches of preference pairs (task=dpo): pair i of a batch's `indices` is two rows, its chosen answer (answer
    2i) and its rejected one (2i + 1), each with the prompt, labelled on the answer's tokens only. Padded, the rows
    come in pairs (chosen, rejected, chosen, ...), so any split of the rows into micro-batches of an even count
    keeps pairs whole; packed (`shape`), both rows of a pair lie in one sequence (a sequence holds
    `shape.capacity` tokens: twice max_length, so any pair fits), positions restarting at each row. With
    `score_prompts` (ORPO's NLL over the chosen row's every token) a chosen row's prompt tokens are labelled too,
    their answer number -(the chosen answer's + 2) (loop/loss.py's PROMPT_MARK)."""

    def __init__(
        self,
        split: TokenizedSplit,
        *,
        pad_id: int,
        padding_side: str,
        pad_multiple: int,
        device,
        shape: PackedShape | None = None,
        score_prompts: bool = False,
        reference: PairReference | None = None,
    ):
        """`reference`: the pairs' reference log-probabilities (None: a reference-free loss, or while they are
        being measured: 0 in the batch, which nothing reads then)."""
        self.split, self.pad_id, self.padding_side = split, pad_id, padding_side
        self.pad_multiple, self.device, self.shape = pad_multiple, device, shape
        self.packed, self.score_prompts, self.reference = shape is not None, score_prompts, reference

    def _rows(self, indices: list[int]) -> list[tuple[list[int], int, int, float]]:
        """(ids, prompt length, answer number, reference log-probability) of each row, pair by pair."""
        split, rows = self.split, []
        for number, index in enumerate(indices):
            reference = self.reference.of(index) if self.reference is not None else (0.0, 0.0)
            for side, ids in enumerate((split.ids[index], split.rejected_ids[index])):
                rows.append((ids, split.prompt_lengths[index], 2 * number + side, reference[side]))
        return rows

    def batch(self, indices: list[int], labelled: bool = True) -> Batch:
        return self.rows_batch(self._rows(indices))

    # The reference pass's units (loop/reference.py): the pairs of the global batches it is given, each measured as
    # its two answers' summed log-probabilities (the objective's "answer_logps" statistics).
    reference_width = 2

    def reference_units(self, batches: list[list[int]]) -> list[int]:
        """The pairs the global batches `batches` draw (a run's steps', or a held-out split whole as one)."""
        return sorted({i for batch in batches for i in batch})

    def unit_lengths(self, units: list[int]) -> list[int]:
        return [self.split.lengths[i] for i in units]

    def units_batch(self, units: list[int]) -> Batch:
        return self.batch(units)

    def reference_of(self, units: list[int], values: list[list[float]]) -> PairReference:
        """The PairReference of the measured `units` (`values`: each pair's (chosen, rejected))."""
        measured, pairs = [False] * len(self.split), [(0.0, 0.0)] * len(self.split)
        for pair, value in zip(units, values):
            measured[pair], pairs[pair] = True, tuple(value)
        return PairReference(pairs, measured)

    def rows_batch(self, rows: list[tuple[list[int], int, int, float]]) -> Batch:
        """The Batch of `rows`: (ids, prompt length, answer number, reference log-probability) each."""
        if self.packed:
            batch, answer, reference = self._packed(rows)
            trained = (answer != -1).long()
            labels = next_token_labels(batch.input_ids, batch.attention_mask, trained, batch.positions == 0)
        else:
            batch = padded_batch(
                [ids for ids, *_ in rows],
                pad_id=self.pad_id,
                padding_side=self.padding_side,
                pad_multiple=self.pad_multiple,
            )
            real = batch.attention_mask == 1
            numbers = torch.tensor([number for *_, number, _ in rows])[:, None]
            in_answer = batch.positions >= torch.tensor([prompt for _, prompt, *_ in rows])[:, None]
            trained = in_answer & real
            answer = torch.where(trained, numbers, -1)
            if self.score_prompts:  # the chosen rows' (even numbers') prompts too
                prompts = real & ~in_answer & (numbers % 2 == 0)
                trained, answer = trained | prompts, answer.masked_fill(prompts, 0) - (numbers + 2) * prompts
            reference = torch.tensor([value for *_, value in rows], dtype=torch.float64)[:, None].expand_as(answer)
            labels = next_token_labels(batch.input_ids, batch.attention_mask, trained.long())
        # the label at t is token t + 1's: so are its answer and reference
        scored = labels != IGNORE
        batch.labels = labels
        batch.answers = torch.full_like(labels, -1)
        batch.answers[:, :-1] = answer[:, 1:]
        batch.answers[~scored] = -1
        batch.reference = torch.zeros(labels.shape, dtype=torch.float64)
        batch.reference[:, :-1] = reference[:, 1:]
        batch.reference[~scored] = 0.0
        return batch.to(self.device)

    def _packed(self, rows) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """Pairs laid end to end, both rows of a pair in one sequence: the Batch (no labels yet), each token's
        answer number (-1 for prompts and padding) and reference log-probability."""
        shape = self.shape
        pairs = [rows[i : i + 2] for i in range(0, len(rows), 2)]
        sizes = [len(chosen[0]) + len(rejected[0]) for chosen, rejected in pairs]
        bins = first_fit_decreasing(sizes, shape.capacity)
        length = shape.length(max(sum(sizes[p] for p in group) for group in bins))
        count = shape.rows(len(bins))
        input_ids = torch.full((count, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((count, length), dtype=torch.long)
        positions = torch.arange(length, dtype=torch.long).repeat(count, 1)
        answer = torch.full((count, length), -1, dtype=torch.long)
        reference = torch.zeros((count, length), dtype=torch.float64)
        for sequence, group in enumerate(bins):
            start = 0
            for ids, prompt, number, value in (row for p in group for row in pairs[p]):
                span = slice(start, start + len(ids))
                input_ids[sequence, span] = torch.tensor(ids, dtype=torch.long)
                mask[sequence, span] = 1
                positions[sequence, span] = torch.arange(len(ids))
                answer[sequence, start + prompt : start + len(ids)] = number
                if self.score_prompts and number % 2 == 0:  # a chosen row's prompt too
                    answer[sequence, start : start + prompt] = -(number + 2)
                reference[sequence, span] = value
                start += len(ids)
            positions[sequence, start:] = torch.arange(length - start)  # the padding tail: a segment of its own
        return Batch(input_ids, mask, positions, None, BatchKind.PACKED), answer, reference

    def sequence_lengths(self, indices: list[int]) -> list[int]:
        """Both rows of each pair: a pair's length is theirs together, but each row attends within itself."""
        return [len(ids[i]) for i in indices for ids in (self.split.ids, self.split.rejected_ids)]

    def token_slots(self, global_batch: list[int], dp: int, accumulation: int) -> int:
        """Token positions a global batch's rows occupy once padded (two rows a pair) or packed."""
        split, slots = self.split, 0
        for replica in range(dp):
            for indices in accumulation_slices(global_batch, replica, dp, accumulation):
                if not indices:
                    continue
                if self.packed:
                    slots += packed_slots([split.lengths[i] for i in indices], self.shape)
                    continue
                longest = max(max(len(split.ids[i]), len(split.rejected_ids[i])) for i in indices)
                slots += 2 * len(indices) * -(-longest // self.pad_multiple) * self.pad_multiple
        return slots
