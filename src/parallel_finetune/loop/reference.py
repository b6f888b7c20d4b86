"""The reference model, measured once before training: the reference log-probabilities of the units the task's
batcher names (task=dpo: each pair's (chosen, rejected); task=kto: each row's and each KL row's), handed to the
batchers beside the rows (data.batch.PairReference, data.kto.KTOReference), so that no second model is held while
training.

The reference is the model as training starts (the pretrained weights, or a tiny model's seeded ones), or with
LoRA / QLoRA the same model with its adapters disabled (lora.adapters_disabled: the frozen base, exact whatever
the adapters hold, so a resumed run measures the same). The pass runs in the run's own layout, in eval mode (no
dropout), through the runner's loss path (the chunked, vocabulary-parallel head: no logits), before a checkpoint
is resumed. Only the units of the global batches the run will train on are measured (and every held-out one);
each data-parallel rank measures its share (`Scorer`), which an all-reduce hands to every rank. Cost: one forward
of every trained unit, about a third of a training step each; memory: a number or two a unit.

A batcher that has a reference answers `reference_units(batches)`, `unit_lengths(units)`, `units_batch(units)`,
`reference_width` (values a unit) and `reference_of(units, values)`; the objective's "answer_logps" statistics
(units x reference_width) are what is measured. `Scorer` is also what an objective's pre-step forwards go through
(interfaces.Objective.measured: KTO's KL estimate).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..data.sampling import scoring_chunks
from ..interfaces import Runner
from ..model.lora import adapters_disabled

log = logging.getLogger(__name__)


def step_batches(sampler, total_steps: int) -> list[list[int]]:
    """The global batches of the run's steps (every rank draws the same)."""
    batches, per_epoch = [], len(sampler)
    for epoch in range(-(-total_steps // per_epoch)):
        batches += sampler.epoch(epoch)[: total_steps - epoch * per_epoch]
    return batches


@dataclass
class Scorer:
    """Forwards without gradients through the run's runner, in the model's current mode: each unit's
    "answer_logps" statistics, each data-parallel rank scoring its share (data.sampling.scoring_chunks), summed
    over every rank. `batchers`: a split -> the task's batcher over it (KL rows cut to max_length)."""

    runner: Runner
    layout: object
    batch_size: int
    batchers: Callable

    def batcher(self, split):
        return self.batchers(split)

    @torch.no_grad()
    def answer_logps(self, batcher, units: list) -> torch.Tensor:
        """(units x batcher.reference_width) float64, on every rank: the last pipeline stage's first
        tensor-parallel rank counts each chunk it scores, and a sum over every rank hands them to all."""
        layout = self.layout
        values = torch.zeros(len(units), batcher.reference_width, dtype=torch.float64, device=layout.device)
        lengths = batcher.unit_lengths(units)
        for chunk, counts in scoring_chunks(range(len(units)), lengths, self.batch_size, layout.dp_rank, layout.dp):
            _, stats = self.runner.loss(batcher.units_batch([units[i] for i in chunk]))  # {}: not the last stage
            if counts and stats and layout.tp_rank == 0:  # each unit counted once
                values[torch.tensor(chunk, device=layout.device)] = stats["answer_logps"].double().view(len(chunk), -1)
        if layout.world_size > 1:
            dist.all_reduce(values)
        return values


def measure_reference(batcher, batches: list[list[int]], *, scorer: Scorer, model: nn.Module, lora: bool):
    """The reference log-probabilities of the units of `batches` (a run's steps' global batches, or a held-out
    split whole as one; the other units are not measured: no step reads them), as the batcher's reference
    (`reference_of`); `batcher` pads them as the runner wants them."""
    started = time.perf_counter()
    units = batcher.reference_units(batches)
    training = model.training
    model.eval()
    try:
        with adapters_disabled(model) if lora else contextlib.nullcontext():
            values = scorer.answer_logps(batcher, units)
    finally:
        model.train(training)
    log.info(
        "reference log-probabilities of %d units measured in %.1f s (%s)",
        len(units),
        time.perf_counter() - started,
        "the model with its adapters disabled" if lora else "the model before training",
    )
    return batcher.reference_of(units, values.tolist())
