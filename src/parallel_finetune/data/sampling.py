"""Which rows each step trains on: an epoch's global batches, identical on every rank (GlobalBatches), this
rank's accumulation slices of one, and the token slots a global batch occupies once padded."""

from __future__ import annotations

import random

from ..errors import UserError


class GlobalBatches:
    """The index lists of an epoch's global batches, identical on every rank (same seed, same epoch).

    Every rank draws the same global batches and takes its own slice, so the optimizer sees the same samples
    whatever the data-parallel degree or accumulation. With `group_by_length`, each global batch holds samples
    of similar length (sorted inside shuffled mega-batches), which removes most padding.
    """

    MEGA_BATCH = 50  # global batches per sorting window, as in transformers' LengthGroupedSampler

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group_by_length: bool):
        if len(lengths) < batch_size:
            raise UserError(f"batch_size={batch_size} is larger than the training split ({len(lengths)} rows)")
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group_by_length = group_by_length

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def epoch(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed * 1_000_003 + epoch)
        rng.shuffle(order)
        usable = len(self) * self.batch_size
        if self.group_by_length:
            window = self.batch_size * self.MEGA_BATCH
            order = [
                i
                for start in range(0, len(order), window)
                for i in sorted(order[start : start + window], key=lambda i: -self.lengths[i])
            ]
            batches = [
                order[i : i + self.batch_size] for i in range(0, len(order) - self.batch_size + 1, self.batch_size)
            ]
            rng.shuffle(batches)
            return batches[: len(self)]
        return [order[i : i + self.batch_size] for i in range(0, usable, self.batch_size)]


def accumulation_slices(global_batch: list[int], dp_rank: int, dp_size: int, accumulation: int) -> list[list[int]]:
    """This rank's share of a global batch, cut into `accumulation` slices (gradient accumulation: one forward
    and backward each; a pipeline cuts a slice again into its `microbatches`)."""
    per_slice = len(global_batch) // (dp_size * accumulation)
    return [
        global_batch[(step * dp_size + dp_rank) * per_slice : (step * dp_size + dp_rank + 1) * per_slice]
        for step in range(accumulation)
    ]


def scoring_chunks(rows, lengths: list[int], batch_size: int, dp_rank: int, dp: int) -> list[tuple[list[int], bool]]:
    """This data-parallel rank's share of `rows` to score without gradients (evaluation, DPO's reference pass):
    the rows sorted by length and cut into chunks of `batch_size`, rank r taking chunks r, r + dp, ...; each with
    whether it counts. Under FSDP and ZeRO-3 a forward all-gathers parameters over the data-parallel ranks, so
    all of them run the same number: a rank short of a chunk runs the first one again and counts it nowhere."""
    order = sorted(rows, key=lambda i: lengths[i])
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    mine = chunks[dp_rank::dp]
    return [(chunk, True) for chunk in mine] + [(chunks[0], False)] * (-(-len(chunks) // dp) - len(mine))


def token_slots(global_batch: list[int], lengths: list[int], dp: int, accumulation: int, multiple: int = 1) -> int:
    """Token positions a global batch occupies once each replica's accumulation slices are padded to their longest
    row (rounded up to `multiple`): real tokens / this = the useful share of the compute."""
    slots = 0
    for replica in range(dp):
        for indices in accumulation_slices(global_batch, replica, dp, accumulation):
            if indices:
                slots += len(indices) * -(-max(lengths[i] for i in indices) // multiple) * multiple
    return slots
