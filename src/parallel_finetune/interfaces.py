"""The interfaces the training loop is written against, so it has no engine or pipeline branches.

    Runner    forward/backward of an accumulation slice: `runner.WholeModel` (the model this rank holds: whole,
              tensor-parallel or FSDP-sharded) | `parallel.pipeline.Pipeline` (this rank's stages under a schedule)
    Updates   gradients -> update: `updates.TorchUpdates` (our AdamW: every parameter, FSDP shards or ZeRO-1
              slices) | `parallel.deepspeed_engine.DeepSpeedUpdates` (DeepSpeed's ZeRO)
    Objective a head's outputs and a Batch's targets -> the summed loss and its per-unit Stats, returned
              together (no side lists): loop/loss.py's TOKEN_OBJECTIVE | CLASS_OBJECTIVE | REGRESSION_OBJECTIVE
              (no statistics) | HiddenTokenLoss | PreferenceLoss, loop/reward_loss.py's RewardLoss, loop/kto.py's
              KTOObjective
    PairLoss  task=dpo's pair loss from the answers' log-probabilities: loop/pair_losses.py's DPOLoss | SimPOLoss
              | ORPOLoss

A leaf module: it imports nothing of the package, so every implementation imports it and none imports another's
module (or the loop's) for a type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

# An objective's statistics of one call: name -> per-unit values (a unit: a pair, a row...; the unit on the first
# axis), detached, named as TRL logs them. Empty: an objective with none, or a pipeline stage that is not the last.
Stats = dict[str, torch.Tensor]


def joined(stats: Sequence[Stats]) -> Stats:
    """The statistics of several calls (micro-batches, accumulation slices) as one call's: each name's values
    concatenated over the units; the empty ones (no units here) add nothing."""
    parts = [part for part in stats if part]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]} if parts else {}


class Objective(Protocol):
    """What a run minimises: from the model's outputs (`takes_hidden`: the final hidden states, the head being the
    objective's, e.g. chunked and vocabulary-parallel; else the head's logits) and a Batch's loss_target, the loss
    SUMMED over the batch in fp32 and its per-unit statistics, returned together by each call. `sums` adds up
    the statistics of any number of calls (a step's slices, a held-out split's chunks) in float64, which the
    caller all-reduces over ranks (a sum, whatever the layout) and hands to `metrics`. An objective whose
    `metric_names` are only ("loss",) keeps no statistics (the step's loss and the task's held-out metrics say
    all); the others' are the step's and the held-out split's metrics."""

    takes_hidden: bool  # the outputs are the final hidden states (the head is the objective's), else logits
    needs_reference: bool  # a reference pass runs before training (loop/reference.py), else none does (zero time)
    metric_names: tuple[str, ...]  # its step and held-out metrics, "loss" first, as TRL names them

    def __call__(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """The summed loss (fp32) of `outputs` against `target` (a Batch's loss_target) and its statistics."""
        ...

    def share_of(self, split, indices) -> None:
        """The one declared input besides the batch: called before scoring these rows of `split` (a step's global
        batch, or a whole held-out split), for what the loss needs of all of them at once (ORPO's token mean over
        the global batch's chosen rows); most objectives need nothing."""
        ...

    def measured(self, references: dict, scorer) -> None:
        """The one declared hook after the reference pass (the run's assembly calls it when `needs_reference`,
        before training): every split's measured reference by name, and `scorer` (loop/reference.py's Scorer:
        forwards without gradients through the run's runner, each rank its share) for an objective whose
        `share_of` forwards rows of its own (KTO's KL estimate: the policy over the batch's mismatched rows);
        most objectives keep nothing."""
        ...

    def sums(self, stats: Sequence[Stats], device) -> torch.Tensor:
        """float64 sums over the units of `stats` in `metric_names` order, and the unit count last (zeros for none)."""
        ...

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """`sums` reduced over the ranks -> the metrics by name (every rank calls it: it may hold a collective)."""
        ...


class PairLoss(Protocol):
    """task=dpo's nonlinear part (loop/pair_losses.py: one class per loss family): from each pair's answers'
    summed log-probabilities and token counts (pairs x (chosen, rejected)), the reference's sums (None when it
    needs none) and, when `chosen_sequence_nll`, each pair's share of the chosen rows' token-mean NLL, to each
    pair's loss and its per-pair statistics named `metric_names` (their sums over pairs / the pair count are the
    metrics)."""

    needs_reference: bool  # a reference pass runs before training (else none does)
    chosen_sequence_nll: bool  # the chosen rows' prompt tokens are scored too (ORPO's NLL term)
    metric_names: tuple[str, ...]  # TRL's names, the keys of the statistics

    def __call__(
        self,
        logps: torch.Tensor,
        tokens: torch.Tensor,
        reference: torch.Tensor | None,
        chosen_nll: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Stats]: ...


# (step's global loss, global gradient norm, the fp16 scale it used or None) -> whether not to apply the step
SkipRule = Callable[[float, float, "float | None"], bool]


@dataclass
class StepOutcome:
    loss: float  # the global batch's mean loss
    grad_norm: float | None  # before clipping; None when the step was skipped
    skipped: bool
    stop: bool  # some rank was asked to stop (SIGTERM): every rank checkpoints after this step
    loss_scale: float  # the scale this step's backward used


@runtime_checkable
class Runner(Protocol):
    pad_multiple: int  # sequence lengths are padded to a multiple of it

    def train(self, batch, count: int, last: bool) -> tuple[torch.Tensor, Stats]:
        """This rank's share of the loss of `batch` (a batch.Batch), summed over the batch / the global `count`,
        and the objective's statistics of the batch (empty on a pipeline stage that is not the last); gradients
        accumulate in .grad. `last`: the step's last slice on this rank."""
        ...

    def forward(self, batch) -> torch.Tensor | None:
        """A classifier's logits for `batch` (a batch.Batch), or None on a pipeline stage that is not the last."""
        ...

    def loss(self, batch) -> tuple[torch.Tensor | None, Stats]:
        """The batch's summed loss without gradients (evaluation) and the objective's statistics of it, or
        (None, {}) on a pipeline stage that is not the last."""
        ...

    def last_logits(self, batch) -> torch.Tensor | None:
        """A language model's logits at each row's last position (generation), or None on a pipeline stage that
        is not the last."""
        ...


@runtime_checkable
class Updates(Protocol):
    # True: also a CheckpointableUpdates; the loop checkpoints and resumes only those (config.check_keys refuses
    # checkpoint keys for the others)
    checkpointable: bool
    module: nn.Module  # the model as built (not an engine wrapping it): what export reads names and config from
    optimizer: torch.optim.Optimizer  # whose lr the schedule sets

    @property
    def loss_scale(self) -> float:
        """The fp16 scale in use (1 otherwise)."""
        ...

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """One slice's loss, already divided by the global count; `last`: the step's last backward on this rank."""
        ...

    def step(self, local_loss: torch.Tensor, stop_requested: bool, skip_rule: SkipRule) -> StepOutcome:
        """The step's one reduction (global norm and loss, the stop flag), then the update or a skip."""
        ...

    def state_bytes(self) -> dict[str, int] | None:
        """This rank's bytes of parameters, gradients and optimizer state (None before the first update)."""
        ...

    def full_state_dict(self, dtype: torch.dtype, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The whole model's weights (only `names`, if given) in `dtype` for export: a collective every rank
        calls; rank 0 gets CPU tensors, the others may get nothing."""
        ...


@runtime_checkable
class CheckpointableUpdates(Updates, Protocol):
    """Updates whose state a checkpoint holds (`checkpoint.TrainingState`), in a form every layout can write and
    read."""

    def moment_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's moments by layout-neutral parameter name, shaped and placed like their parameters."""
        ...

    def counters(self) -> dict:
        """The update count and the fp16 loss scaler's state."""
        ...

    def restore(self, moments: dict[str, dict[str, torch.Tensor]], counters: dict) -> None: ...
