"""The run's data stage: the splits prepared (on rank 0; the other ranks read its cache), the training split's
columns and the sampler of its global batches, as one record (`DataStage`) the later stages read. The schedule that
follows from the sampler's length is resolve's (resolve.resolve_schedule)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import DataSection, GRPOSection, TrainingSection
from ..data.batch import TokenizedSplit
from ..data.prepare import PreparedData, load_prepared
from ..data.sampling import GlobalBatches
from ..parallel.layout import Layout, rank0_decides

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataStage:
    """The data a run trains and scores on."""

    prepared: PreparedData  # every split, the Task, the tokenizer, the source
    train: TokenizedSplit  # the training split's columns
    sampler: GlobalBatches  # its global batches, epoch by epoch

    def split(self, name: str) -> TokenizedSplit:
        """Another split's columns (validation: the reference pass, the held-out prompts)."""
        return TokenizedSplit.of(self.prepared.splits[name], self.prepared.task)


def data_stage(
    layout: Layout,
    prepare: Callable[[], PreparedData],
    data: DataSection,
    training: TrainingSection,
    grpo: GRPOSection | None = None,
) -> DataStage:
    """The splits `prepare` makes on rank 0 (it builds the cache, and may fall back to the sample, loudly, once);
    the other ranks then read that cache. Said in one line: where the rows came from, each split's size."""
    mine: list[PreparedData] = []

    def prepare_on_rank0():
        mine.append(prepare())
        return str(mine[0].cache_path), mine[0].source

    cache_path, source = rank0_decides(layout, prepare_on_rank0)
    prepared = mine[0] if mine else load_prepared(Path(cache_path), source)
    log.info(
        "data: %s | %s",
        prepared.source.description,
        ", ".join(f"{k} {len(v):,} rows" for k, v in prepared.splits.items()),
    )
    train = TokenizedSplit.of(prepared.splits["train"], prepared.task)
    draws = prepared.task.kind.samples_per_step(training.batch_size, grpo or GRPOSection())  # grpo: its prompts
    sampler = GlobalBatches(train.lengths, draws, training.seed, data.group_by_length)
    return DataStage(prepared, train, sampler)
