"""The loss, in one place: one small function per head, each summing (not averaging) in fp32 over the labels a
Batch (batch.py) carries, and what a global batch's loss is divided by. Each micro-batch's sum is divided by the
*global* count (TokenizedSplit.loss_count), so summing over micro-batches and data-parallel ranks gives exactly
the single-process mean, whatever the layout.

The labels are already aligned with the head's outputs and IGNORE (regression: NaN) where there is no loss, so
a padded and a packed batch, a row's label and a position's, go through the same function: outputs and labels
are flattened to one loss term per label."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.batch import IGNORE
from ..interfaces import SummedLoss
from ..tasks.task import HeadKind, Task


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A language model's: cross-entropy of each position's next-token logits with its (shifted) label."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A classification head's: cross-entropy of class logits with class ids (a packed batch: per position)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def regression_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A regression head's: squared error of its one output (transformers' MSELoss), where a label is a number."""
    predicted, labels = outputs.float().flatten(), labels.float().flatten()
    scored = ~labels.isnan()
    return F.mse_loss(predicted[scored], labels[scored], reduction="sum")


def summed_loss_for(task: Task) -> SummedLoss:
    """The loss of a task's head."""
    if task.head is HeadKind.CAUSAL_LM:
        return token_loss
    return regression_loss if task.regression else class_loss
