"""task=dpo's reference model, measured once before training: each pair's reference log-probabilities (chosen,
rejected), handed to the batchers beside the rows (data.batch.PairReference), so that no second model is held
while training.

The reference is the model as training starts (the pretrained weights, or a tiny model's seeded ones), or with
LoRA / QLoRA the same model with its adapters disabled (lora.adapters_disabled: the frozen base, exact whatever
the adapters hold, so a resumed run measures the same). The pass runs in the run's own layout, in eval mode (no
dropout), through the runner's loss path (the chunked, vocabulary-parallel head: no logits), before a checkpoint
is resumed. Only the pairs the run will train on are measured (and every held-out pair); each data-parallel rank
measures its share, which an all-reduce hands to every rank. Cost: one forward of every trained pair, about a
third of a training step each; memory: two numbers a pair.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from ..data.batch import PairReference, PreferenceBatcher
from ..data.sampling import scoring_chunks
from ..interfaces import Runner
from ..model.lora import adapters_disabled

log = logging.getLogger(__name__)


def trained_pairs(sampler, total_steps: int) -> list[int]:
    """The pairs the run's steps draw (every rank draws the same global batches)."""
    used: set[int] = set()
    per_epoch = len(sampler)
    for epoch in range(-(-total_steps // per_epoch)):
        batches = sampler.epoch(epoch)[: total_steps - epoch * per_epoch]
        used.update(i for batch in batches for i in batch)
    return sorted(used)


@torch.no_grad()
def measure_reference(
    batcher: PreferenceBatcher,
    pairs: list[int],
    *,
    runner: Runner,
    model: nn.Module,
    batch_size: int,
    layout,
    lora: bool,
) -> PairReference:
    """The reference log-probabilities of the batcher's split's `pairs` (the others are not measured: no step
    reads them): the "answer_logps" statistics of the runner's objective (loop/loss.py's PreferenceLoss) on them;
    `batcher` pads the pairs as the runner wants them."""
    started = time.perf_counter()
    split = batcher.split
    values = torch.zeros(len(split), 2, dtype=torch.float64, device=layout.device)
    training = model.training
    model.eval()
    try:
        with adapters_disabled(model) if lora else contextlib.nullcontext():
            for chunk, counts in scoring_chunks(pairs, split.lengths, batch_size, layout.dp_rank, layout.dp):
                _, stats = runner.loss(batcher.batch(chunk))  # {} on a pipeline stage that is not the last
                if counts and stats and layout.tp_rank == 0:  # each pair counted once
                    values[torch.tensor(chunk, device=layout.device)] = stats["answer_logps"].double()
    finally:
        model.train(training)
    if layout.world_size > 1:
        dist.all_reduce(values)
    measured = [False] * len(split)
    for pair in pairs:
        measured[pair] = True
    log.info(
        "dpo: reference log-probabilities of %d pairs measured in %.1f s (%s)",
        len(pairs),
        time.perf_counter() - started,
        "the model with its adapters disabled" if lora else "the model before training",
    )
    return PairReference([tuple(pair) for pair in values.tolist()], measured)
