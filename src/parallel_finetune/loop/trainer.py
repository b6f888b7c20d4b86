"""The one training loop: any family, any layout, any precision, either engine.

The promise: for a given global batch, the loss, gradients and update are those of single-process training.
Every rank draws the same global batches; each slice's loss is a *sum* divided by the global count of samples
(classification) or target tokens (a language model); gradients are *summed* over data-parallel ranks.

The Trainer receives built components (builder.py makes them) and no Config:

    sampler     the global batches of each epoch (data.GlobalBatches)
    batcher     an accumulation slice's rows as a Batch, padded or packed (batch.py); it owns the training columns
    runner      a slice's forward and backward (`runner.WholeModel`, or the `parallel.pipeline.Pipeline`): its loss
                and the objective's statistics, together
    objective   the runner's loss (interfaces.Objective): its statistics beyond the loss (a pair objective's)
                are the step's metrics too
    updates     gradients -> an update (`updates.TorchUpdates`, or DeepSpeed's ZeRO)
    evaluator, generator, checkpoints
                each says whether it is `due(step)` after a step, the same way (torchtitan's validator and
                checkpointer do too)
    reporter    the progress bar, metrics files and trackers, already started

A whole run (build, fit, evaluate, export, summary.json) is `train.run`, the entry point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..data.sampling import GlobalBatches, accumulation_slices
from ..interfaces import Objective, Runner, Stats, Updates
from ..model.throughput import ModelFlops, Peak, achieved
from ..outputs.checkpoint import TrainingState
from ..outputs.reporting import PhaseTimer, Reporter
from ..parallel.layout import Layout
from .checkpointer import CheckpointManager
from .divergence import NonFiniteGuard
from .evaluation import Evaluator
from .generation import Generator

log = logging.getLogger(__name__)


class StopRequest:
    """SIGTERM (a spot interruption, `docker stop`): the current step finishes, then every rank checkpoints.
    Installed as the handler before the run is assembled, so a signal during assembly is not lost."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum=None, frame=None) -> None:
        self.requested = True


@dataclass(frozen=True)
class Steps:
    """How long the loop runs and how a global batch is split."""

    total: int  # steps of the run (max_steps, or epochs x steps per epoch)
    per_epoch: int
    accumulation: int  # gradient_accumulation_steps: slices per step on each data-parallel rank


@dataclass
class Trainer:
    """The loop over built components: `fit` trains, `train_step` is one update; after each step the evaluator,
    the generator and the checkpoint manager each say whether they are due."""

    steps: Steps
    sampler: GlobalBatches
    batcher: object  # batch.PaddedBatcher | batch.PackedBatcher
    runner: Runner
    objective: Objective  # the runner's: its statistics beyond the loss (a pair objective's) are the step's metrics
    updates: Updates
    scheduler: object  # the lr schedule
    model: nn.Module  # what the runner drives (DeepSpeed's engine under engine=deepspeed)
    evaluator: Evaluator
    generator: Generator | None  # generate_every, or None
    checkpoints: CheckpointManager  # its cadence, and the state it writes
    reporter: Reporter  # trackers started
    guard: NonFiniteGuard
    layout: Layout
    timer: PhaseTimer
    flops: ModelFlops  # per token of the model as built (MFU)
    peak: Peak  # the device's peak FLOP/s (MFU)
    step: int = 0  # the step reached (a resumed checkpoint's)
    stop: StopRequest = field(default_factory=StopRequest)  # set by SIGTERM: finish the step, checkpoint, exit 0
    # task=grpo's step source (rl/steps.py): before a step's slices, it turns the step's prompts into the
    # completions and batcher the step trains on; None: the step trains on the sampled rows
    rollouts: object | None = None
    after_backward: Callable[[Trainer, int], None] | None = None  # test hook: after a step's backward
    history: list[dict] = field(default_factory=list, init=False)
    stop_agreed: bool = field(default=False, init=False)  # some rank was asked to stop (the step's all-reduce)
    padding: dict[int, list[int]] = field(default_factory=dict, init=False)  # epoch -> [real tokens, token slots]

    def training_state(self) -> TrainingState:
        return self.checkpoints.state(self.step)

    def generate(self) -> None:
        """Every rank decodes the held-out prompts; rank 0's reporter writes the answers."""
        with self.timer("generate"):
            answers = self.generator.answers(self.step)
        self.reporter.generations(self.step, answers)

    def evaluate(self) -> None:
        with self.timer("eval"):
            results = self.evaluator.evaluate()
        self.reporter.evaluation(self.step, results)

    def train_step(self, global_batch: list[int]) -> dict:
        layout, batcher, rollout = self.layout, self.batcher, {}
        started = time.perf_counter()
        if self.rollouts is not None:  # the step's completions, sampled (or given) and scored: its own rows
            batcher, global_batch, rollout, records = self.rollouts.step(global_batch, self.step + 1)
            self.reporter.generations(self.step + 1, records)
        update_started = time.perf_counter()
        split = batcher.split
        count = split.loss_count(global_batch)
        self.objective.share_of(split, global_batch)  # e.g. ORPO's NLL: a token mean over the global batch
        local_loss = torch.zeros((), device=layout.device)
        stats: list[Stats] = []
        slices = accumulation_slices(global_batch, layout.dp_rank, layout.dp, self.steps.accumulation)
        for number, indices in enumerate(slices, start=1):
            loss, slice_stats = self.runner.train(batcher.batch(indices), count, last=number == len(slices))
            local_loss += loss
            stats.append(slice_stats)
        if self.after_backward is not None:
            self.after_backward(self, self.step + 1)
        lr = self.scheduler.get_last_lr()[0]
        outcome = self.updates.step(local_loss, self.stop.requested, self._skip)
        self.scheduler.step()
        self.step += 1
        self.stop_agreed = outcome.stop
        elapsed = time.perf_counter() - started
        if self.rollouts is not None:  # the time split: rollout_s and scoring_s are the stage's
            rollout["update_s"] = time.perf_counter() - update_started
        lengths = [split.lengths[i] for i in global_batch]
        tokens = sum(lengths)
        epoch_padding = self.padding.setdefault(int((self.step - 1) // self.steps.per_epoch), [0, 0])
        epoch_padding[0] += tokens
        epoch_padding[1] += batcher.token_slots(global_batch, layout.dp, self.steps.accumulation)
        flops = self.flops.batch(batcher.sequence_lengths(global_batch))
        tflops, mfu = achieved(flops, elapsed, layout.world_size, self.peak)
        # A skipped step's norm is not a number worth logging (and differs between ranks when one overflowed).
        beyond = self._objective_metrics(stats) | rollout  # the objective's metrics, a grpo step's rollout's
        return {
            "step": self.step,
            "epoch": self.step / self.steps.per_epoch,
            "loss": outcome.loss,
            "lr": lr,
            "grad_norm": outcome.grad_norm,
            "loss_scale": outcome.loss_scale,
            "skipped": outcome.skipped,
            "samples_per_s": len(global_batch) / elapsed,
            "tokens_per_s": tokens / elapsed,
            "tflops_per_device": tflops,
            "mfu": mfu,
            "step_time_s": elapsed,
        } | beyond

    def _objective_metrics(self, stats: list[Stats]) -> dict:
        """The objective's step metrics beyond the loss (a pair objective's, TRL's names: rewards/*, logps/*,
        ...), means over the global batch's units: every rank's sums of its slices' statistics (a pipeline's last
        stage holds them; tensor-parallel ranks hold copies, counted in the unit count alike) over the units they
        count. None (and no collective) for an objective whose only metric is its loss."""
        if len(self.objective.metric_names) <= 1:
            return {}
        totals = self.objective.sums(stats, self.layout.device)
        if self.layout.world_size > 1:
            dist.all_reduce(totals)
        metrics = self.objective.metrics(totals)
        del metrics["loss"]  # the step's loss is `loss`
        return metrics

    def _skip(self, loss: float, grad_norm: float, loss_scale: float | None) -> bool:
        return self.guard.skip(self.step + 1, loss, grad_norm, loss_scale)

    def after_step(self) -> None:
        """What is due after a step: an evaluation, answers, a checkpoint."""
        total = self.steps.total
        if self.evaluator.due(self.step, total):
            self.evaluate()
        if self.generator is not None and self.generator.due(self.step, total):
            self.generate()
        if self.checkpoints.due(self.step, total, self.stop_agreed):
            self.checkpoints.save(self.step, self.guard.bad_steps)

    def fit(self) -> list[dict]:
        if not self.reporter.started:  # SIGTERM while rank 0 started the trackers: stop before training a step
            self.stop_agreed = True
            log.info("stopping before step %d as asked (SIGTERM), while the trackers started", self.step + 1)
            return self.history
        with self.timer("train"):
            self.model.train()
            while self.step < self.steps.total:
                epoch, offset = divmod(self.step, self.steps.per_epoch)
                for global_batch in self.sampler.epoch(epoch)[offset:]:
                    record = self.train_step(global_batch)
                    self.history.append(record)
                    self.reporter.step(record)
                    self.after_step()
                    if self.stop_agreed:
                        log.info(
                            "stopping after step %d as asked (SIGTERM); resume=auto continues from the checkpoint",
                            self.step,
                        )
                        return self.history
                    if self.step >= self.steps.total:
                        break
        if self.generator is not None and self.generator.due_at_end(self.step):
            self.generate()
        if self.batcher.packed:
            real, slots = (sum(counts) for counts in zip(*self.padding.values()))
            log.info("packing: %.1f%% of the packed token slots held real tokens", 100 * real / slots)
        return self.history
