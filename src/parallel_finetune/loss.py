"""The loss, in one place: what the logits are compared with (class ids, regression targets, next tokens),
summed (not averaged) in fp32, and what a global
batch's loss is divided by. Each micro-batch's sum is divided by the *global* count, so summing over micro-batches
and data-parallel ranks gives exactly the single-process mean, whatever the layout. The head kind (the Task's
`head`) chooses the targets and the count; the targets' form chooses the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .tasks.task import HeadKind

IGNORE = -100  # target of a padded position: no loss


def targets(batch: dict[str, torch.Tensor], head: HeadKind) -> torch.Tensor:
    """Labels (a classification head: one per row, or per position in a packed batch), or each next token (a
    language-model head), ignored where it is padding, where the split's `target_mask` says it is no target, and,
    in a packed batch, where a row starts (its first token is not predicted from the previous row)."""
    if HeadKind(head) is HeadKind.CLASSIFICATION:
        return batch["labels"]
    ignored = batch["attention_mask"][:, 1:] == 0
    if "target_mask" in batch:
        ignored = ignored | (batch["target_mask"][:, 1:] == 0)
    if "position_ids" in batch:
        ignored = ignored | (batch["position_ids"][:, 1:] == 0)
    return batch["input_ids"][:, 1:].masked_fill(ignored, IGNORE)


def summed_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss summed over the micro-batch, in fp32; `target` from `targets`: class ids (cross-entropy), float
    targets (regression: squared error of the one output, transformers' MSELoss), or next tokens (2-D, one
    shorter than the logits). 2-D targets as long as the logits are a packed batch's classification targets, one
    per position (IGNORE, or NaN for regression, where no row is pooled): no shift."""
    if target.ndim == 2 and target.shape == logits.shape[:-1]:
        if target.is_floating_point():
            scored = ~target.isnan()
            return F.mse_loss(logits.float().squeeze(-1)[scored], target[scored].float(), reduction="sum")
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
    if target.ndim == 1 and target.is_floating_point():
        return F.mse_loss(logits.float().squeeze(-1), target.float(), reduction="sum")
    if target.ndim == 1:
        return F.cross_entropy(logits.float(), target, reduction="sum")
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")


def loss_count(lengths: list[int], head: HeadKind, targets: list[int] | None = None) -> int:
    """What the loss of a global batch (rows of these lengths) is averaged over: samples, or predicted tokens
    (each row's `targets` where the rows say how many they have, task=sft)."""
    if HeadKind(head) is HeadKind.CLASSIFICATION:
        return len(lengths)
    if targets is not None:
        return sum(targets)
    return sum(length - 1 for length in lengths)


def scored_count(batch: dict[str, torch.Tensor], head: HeadKind) -> int:
    """The same count for one collated batch (evaluation)."""
    if HeadKind(head) is HeadKind.CLASSIFICATION:
        return len(batch["labels"])
    if "target_mask" in batch:
        return int((batch["target_mask"][:, 1:] * batch["attention_mask"][:, 1:]).sum())
    return int(batch["attention_mask"][:, 1:].sum())
