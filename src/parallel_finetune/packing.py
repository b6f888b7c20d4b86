"""Packed batches (`packing: true`): a rank's rows of a global batch laid end to end in sequences of at most
`max_length` tokens, so that short rows share token slots instead of each being padded to the longest.

The sampler still picks each step's rows (data.GlobalBatches, data.accumulation_slices): packing only arranges an
accumulation slice's rows, by first-fit decreasing bin packing, so a packed step trains on exactly the rows the
unpacked step would and its loss (a sum over the same targets / the same global count) is the same.

A packed batch carries `position_ids` restarting at 0 for every row; that is what marks it packed. Attention never
crosses rows: the models take a 4-D mask built from those positions (families.base.packed_attention_mask), or,
under flash attention, the positions themselves. The padding tail of a packed sequence is a segment of its own
with its own restarting positions, so no query row is fully masked. Targets never cross rows either: a causal-LM
row's first token is not predicted from the previous row's last (loss.targets), and a classification row's label
sits at its pooled position only (its first token or its last, as the family pools), IGNORE (regression: NaN)
elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .data import accumulation_slices
from .loss import IGNORE


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Positions into `lengths`, grouped into bins of at most `capacity` tokens: longest first (ties in list
    order), each into the first bin it fits, a new bin when none does. Deterministic: the same lengths give the
    same bins on every rank. Within a bin, rows keep the order they were placed in."""
    bins: list[list[int]] = []
    room: list[int] = []
    for position in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[position]
        target = next((b for b, free in enumerate(room) if free >= length), None)
        if target is None:
            bins.append([])
            room.append(capacity)
            target = len(bins) - 1
        bins[target].append(position)
        room[target] -= length
    return bins


@dataclass(frozen=True)
class PackedShape:
    """How a runner wants its packed batches shaped: sequences of at most `capacity` tokens, padded to a multiple
    of `pad_multiple` (the longest sequence's length, or with `fixed_length` every sequence `capacity` long: a
    pipeline's static shapes), their count padded with all-padding sequences to a multiple of `rows_multiple` (a
    pipeline's micro-batches). `pooled`: where a classification row's label sits, its "first" or "last" token."""

    capacity: int
    pad_multiple: int = 1
    fixed_length: bool = False
    rows_multiple: int = 1
    pooled: str = "last"

    def length(self, longest: int) -> int:
        length = max(self.capacity, longest) if self.fixed_length else longest
        return -(-length // self.pad_multiple) * self.pad_multiple

    def rows(self, sequences: int) -> int:
        return -(-sequences // self.rows_multiple) * self.rows_multiple


def packed_slots(lengths: list[int], shape: PackedShape) -> int:
    """Token slots one accumulation slice of rows of these lengths occupies once packed: sequences x length."""
    bins = first_fit_decreasing(lengths, shape.capacity)
    longest = max(sum(lengths[i] for i in group) for group in bins)
    return shape.rows(len(bins)) * shape.length(longest)


def packed_token_slots(
    global_batch: list[int], lengths: list[int], dp: int, accumulation: int, shape: PackedShape
) -> int:
    """data.token_slots for packed batches: the slots of every replica's packed accumulation slices."""
    return sum(
        packed_slots([lengths[i] for i in indices], shape)
        for replica in range(dp)
        for indices in accumulation_slices(global_batch, replica, dp, accumulation)
        if indices
    )


def packed_batch(
    indices: list[int],
    *,
    ids: list,
    labels: list | None,
    token_types: list | None,
    target_masks: list | None,
    pad_id: int,
    shape: PackedShape,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Rows `indices` of `ids` packed into tensors on `device`: input_ids, attention_mask (1 = a real token),
    position_ids (restarting at 0 for every row and for the padding tail), labels (classification: one per
    position, the row's label at its pooled position), token_type_ids and target_mask when the split has them."""
    bins = [
        [indices[p] for p in group] for group in first_fit_decreasing([len(ids[i]) for i in indices], shape.capacity)
    ]
    length = shape.length(max(sum(len(ids[i]) for i in group) for group in bins))
    rows = shape.rows(len(bins))
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.long)
    positions = torch.arange(length, dtype=torch.long).repeat(rows, 1)  # all-padding sequences: one segment
    regression = labels is not None and any(isinstance(labels[i], float) for i in indices)
    targets = None
    if labels is not None:
        targets = torch.full((rows, length), math.nan if regression else IGNORE)
        targets = targets.to(torch.float32 if regression else torch.long)
    types = torch.zeros_like(input_ids) if token_types is not None else None
    answer = torch.zeros_like(input_ids) if target_masks is not None else None
    for row, group in enumerate(bins):
        start = 0
        for index in group:
            size = len(ids[index])
            span = slice(start, start + size)
            input_ids[row, span] = torch.tensor(ids[index], dtype=torch.long)
            mask[row, span] = 1
            positions[row, span] = torch.arange(size)
            if targets is not None:
                targets[row, start if shape.pooled == "first" else start + size - 1] = labels[index]
            if types is not None:
                types[row, span] = torch.tensor(token_types[index], dtype=torch.long)
            if answer is not None:
                answer[row, span] = torch.tensor(target_masks[index], dtype=torch.long)
            start += size
        positions[row, start:] = torch.arange(length - start)  # the padding tail: a segment of its own
    batch = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
    for name, tensor in (("labels", targets), ("token_type_ids", types), ("target_mask", answer)):
        if tensor is not None:
            batch[name] = tensor
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}
