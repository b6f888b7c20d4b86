"""The interfaces the training loop is written against, so it has no engine or pipeline branches.

    Runner    forward/backward of an accumulation slice: `runner.WholeModel` (the model this rank holds: whole,
              tensor-parallel or FSDP-sharded) | `parallel.pipeline.Pipeline` (this rank's stages under a schedule)
    Updates   gradients -> update: `updates.TorchUpdates` (our AdamW: every parameter, FSDP shards or ZeRO-1
              slices) | `parallel.deepspeed_engine.DeepSpeedUpdates` (DeepSpeed's ZeRO)
    PairLoss  task=dpo's pair loss from the answers' log-probabilities: loop/pair_losses.py's DPOLoss | SimPOLoss
              | ORPOLoss

A leaf module: it imports nothing of the package, so every implementation imports it and none imports another's
module (or the loop's) for a type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

# (a head's outputs, a Batch's labels) -> the loss summed over them, in fp32 (loop/loss.py: one per head)
SummedLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


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

    def train(self, batch, count: int, last: bool) -> torch.Tensor:
        """This rank's share of the loss of `batch` (a batch.Batch), summed over the batch / the global `count`;
        gradients accumulate in .grad. `last`: the step's last slice on this rank."""
        ...

    def forward(self, batch) -> torch.Tensor | None:
        """A classifier's logits for `batch` (a batch.Batch), or None on a pipeline stage that is not the last."""
        ...

    def loss(self, batch) -> torch.Tensor | None:
        """The batch's summed loss without gradients (evaluation), or None on a pipeline stage that is not the last."""
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
