"""Packed batches (`packing: true`): a rank's rows of a global batch laid end to end in sequences of at most
`max_length` tokens, so that short rows share token slots instead of each being padded to the longest.

The sampler still picks each step's rows (data.GlobalBatches, data.accumulation_slices): packing only arranges an
accumulation slice's rows, by first-fit decreasing bin packing, so a packed step trains on exactly the rows the
unpacked step would and its loss (a sum over the same targets / the same global count) is the same.

A packed Batch (batch.PackedBatcher, kind PACKED) carries positions restarting at 0 for every row. Attention
never crosses rows: the models take a 4-D mask built from those positions (families.base.packed_attention_mask),
or, under flash attention, the positions themselves. The padding tail of a packed sequence is a segment of its
own with its own restarting positions, so no query row is fully masked. Targets never cross rows either: a
causal-LM row's first token is not predicted from the previous row's last (batch.next_token_labels), and a
classification row's label sits at its pooled position only (its first token or its last, as the family pools),
IGNORE (regression: NaN) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sampling import accumulation_slices


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
