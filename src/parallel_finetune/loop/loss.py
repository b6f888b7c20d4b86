"""The loss, in one place: one small function per head, each summing (not averaging) in fp32 over the labels a
Batch (batch.py) carries, and what a global batch's loss is divided by. Each micro-batch's sum is divided by the
*global* count (TokenizedSplit.loss_count), so summing over micro-batches and data-parallel ranks gives exactly
the single-process mean, whatever the layout.

The labels are already aligned with the head's outputs and IGNORE (regression: NaN) where there is no loss, so
a padded and a packed batch, a row's label and a position's, go through the same function: outputs and labels
are flattened to one loss term per label.

A language model's loss takes the final hidden states and the head instead of logits (HiddenTokenLoss): only the
positions with a label reach the head, and with `loss_chunk_tokens` the head and the cross-entropy run together in
chunks (parallel/vocab.py), never holding every token's logits over the whole vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..data.batch import IGNORE
from ..interfaces import SummedLoss
from ..parallel.vocab import head_replaced, token_nll
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


class HiddenTokenLoss:
    """A language model's loss from its final hidden states and its head (the model's output embeddings): the
    positions with a label go through the head and the cross-entropy together, `chunk_tokens` at a time
    (parallel/vocab.token_nll: vocabulary-parallel under tensor parallelism), or, with chunk_tokens=0, as whole
    logits of those positions. Summed in fp32, like every loss here."""

    takes_hidden = True

    def __init__(self, head: nn.Module, chunk_tokens: int, softcap: float | None = None):
        self.head, self.chunk_tokens, self.softcap = head, chunk_tokens, softcap  # softcap: Gemma's logit capping

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`hidden` (..., hidden size) and `labels` (...) aligned, IGNORE where no loss."""
        scored = labels != IGNORE
        return self.scored(hidden[scored], labels[scored])

    def scored(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of rows that all have a label: `hidden` (rows, hidden size), `labels` (rows,)."""
        if self.chunk_tokens:
            return token_nll(hidden, self.head, labels, self.chunk_tokens, self.softcap).sum()
        return token_loss(self.logits(hidden), labels)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's whole logits of `hidden` (capped as the model caps them)."""
        logits = self.head(hidden)
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


class _ScoredHead(nn.Module):
    """Stands in for a model's output embeddings during one forward: the hidden states of the positions the
    model kept (`logits_to_keep`: those with a label) go to `loss` with their labels; the loss is kept in
    `result` (and returned as the model's "logits", which nothing reads)."""

    def __init__(self, loss: HiddenTokenLoss, labels: torch.Tensor):
        super().__init__()
        self.loss, self.labels, self.result = loss, labels, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.result = self.loss.scored(hidden, self.labels)
        return self.result


def hidden_loss_forward(model: nn.Module, inputs: dict, labels: torch.Tensor, loss: HiddenTokenLoss) -> torch.Tensor:
    """The model's own forward (so FSDP gathers and tensor-parallel layers work as always) with only the labelled
    positions kept for the head, and the head replaced by `loss`: the summed loss, no logits."""
    scored = labels != IGNORE
    head = _ScoredHead(loss, labels[scored])
    with head_replaced(model, head):
        model(**inputs, logits_to_keep=scored)
    return head.result


def summed_loss_for(task: Task, hidden: HiddenTokenLoss | None = None) -> SummedLoss:
    """The loss of a task's head: a language model's from hidden states when `hidden` says how, else from
    logits."""
    if task.head is HeadKind.CAUSAL_LM:
        return hidden or token_loss
    return regression_loss if task.regression else class_loss
