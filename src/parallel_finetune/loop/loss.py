"""The loss, in one place: one small function per head, each summing (not averaging) in fp32 over the labels a
Batch (batch.py) carries, and what a global batch's loss is divided by. Each micro-batch's sum is divided by the
*global* count (TokenizedSplit.loss_count), so summing over micro-batches and data-parallel ranks gives exactly
the single-process mean, whatever the layout.

The labels are already aligned with the head's outputs and IGNORE (regression: NaN) where there is no loss, so
a padded and a packed batch, a row's label and a position's, go through the same function: outputs and labels
are flattened to one loss term per label.

A language model's loss takes the final hidden states and the head instead of logits (HiddenTokenLoss): only the
positions with a label reach the head, and with `loss_chunk_tokens` the head and the cross-entropy run together in
chunks (parallel/vocab.py), never holding every token's logits over the whole vocabulary.

Each is an `interfaces.Objective`: a call returns the summed loss and its per-unit statistics together (none for
the plain losses; per pair for PreferenceLoss and loop/reward_loss.py's RewardLoss), which the Trainer and the
Evaluator add up with `sums` and turn into metrics with `metrics`; `objective_for` picks a head's."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.batch import IGNORE
from ..interfaces import Objective, Stats, joined
from ..parallel.vocab import head_replaced, token_nll
from ..tasks.task import HeadKind, Task
from .pair_losses import DPOLoss, pair_loss_for


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


class PerUnitObjective:
    """What the objectives here share: no reference pass, no pre-step input, and metrics that are means over units
    (a pair, ...) of the statistics their calls return, one value per unit for each of `metric_names` ("loss"
    first). The plain losses return none: their only metric is the loss, which the Trainer and Evaluator count."""

    takes_hidden = False
    needs_reference = False
    metric_names: tuple[str, ...] = ("loss",)

    def share_of(self, split, indices) -> None:
        """Nothing: each unit's loss is its own (PreferenceLoss's ORPO needs the global batch's token count)."""

    def measured(self, references: dict, scorer) -> None:
        """Nothing: no pre-step forwards of its own (loop/kto.py's KTOObjective keeps the KL rows' reference)."""

    def sums(self, stats: Sequence[Stats], device) -> torch.Tensor:
        """Each metric's sum over the units of `stats` and the unit count last (float64; zeros for no units)."""
        totals = torch.zeros(len(self.metric_names) + 1, dtype=torch.float64, device=device)
        units = joined(stats)
        if not units:
            return totals
        totals[:-1] = torch.stack([units[name].double().sum() for name in self.metric_names])
        totals[-1] = len(units[self.metric_names[0]])
        return totals

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """`sums` (reduced over the ranks) as the metrics: each sum over the unit count."""
        return dict(zip(self.metric_names, (totals[:-1] / totals[-1]).tolist()))


class HeadLoss(PerUnitObjective):
    """A head's loss from its logits by one of the formulas above, with no statistics."""

    def __init__(self, formula):
        self.formula = formula  # (outputs, labels) -> the summed loss

    def __call__(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        return self.formula(outputs, target), {}


TOKEN_OBJECTIVE = HeadLoss(token_loss)
CLASS_OBJECTIVE = HeadLoss(class_loss)
REGRESSION_OBJECTIVE = HeadLoss(regression_loss)


class HiddenTokenLoss(PerUnitObjective):
    """A language model's loss from its final hidden states and its head (the model's output embeddings): the
    positions with a label go through the head and the cross-entropy together, `chunk_tokens` at a time
    (parallel/vocab.token_nll: vocabulary-parallel under tensor parallelism), or, with chunk_tokens=0, as whole
    logits of those positions. Summed in fp32, like every loss here; no statistics."""

    takes_hidden = True

    def __init__(self, head: nn.Module, chunk_tokens: int, softcap: float | None = None):
        self.head, self.chunk_tokens, self.softcap = head, chunk_tokens, softcap  # softcap: Gemma's logit capping

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """`hidden` (..., hidden size) and `labels` (...) aligned, IGNORE where no loss."""
        scored = self.mask(labels)
        return self.scored(hidden[scored], labels[scored])

    def mask(self, target: torch.Tensor) -> torch.Tensor:
        """The positions of `target` (a Batch's loss_target) that have a loss term."""
        return target != IGNORE

    def scored(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """The loss of rows that all have a label, and its statistics: `hidden` (rows, hidden size), `labels`
        (rows,)."""
        if self.chunk_tokens:
            return token_nll(hidden, self.head, labels, self.chunk_tokens, self.softcap).sum(), {}
        return token_loss(self.logits(hidden), labels), {}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's whole logits of `hidden` (capped as the model caps them)."""
        logits = self.head(hidden)
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


class _ScoredHead(nn.Module):
    """Stands in for a model's output embeddings during one forward: the hidden states of the positions the
    model kept (`logits_to_keep`: those with a label) go to `loss` with their labels; the loss and its statistics
    are kept in `result` (the loss is returned as the model's "logits", which nothing reads)."""

    def __init__(self, loss: HiddenTokenLoss, labels: torch.Tensor):
        super().__init__()
        self.loss, self.labels, self.result = loss, labels, None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.result = self.loss.scored(hidden, self.labels)
        return self.result[0]


def hidden_loss_forward(
    model: nn.Module, inputs: dict, target: torch.Tensor, loss: HiddenTokenLoss
) -> tuple[torch.Tensor, Stats]:
    """The model's own forward (so FSDP gathers and tensor-parallel layers work as always) with only the labelled
    positions kept for the head, and the head replaced by `loss`: the summed loss and its statistics, no logits.
    `target`: the Batch's loss_target."""
    scored = loss.mask(target)
    head = _ScoredHead(loss, target[scored])
    with head_replaced(model, head):
        model(**inputs, logits_to_keep=scored)
    return head.result


# DPO's metrics (TRL's names): what PreferenceLoss.sums adds up over pairs, in this order, for the DPO family; each
# pair loss names its own (PreferenceLoss.metric_names).
PAIR_METRICS = ("loss", *DPOLoss.metric_names)

# A chosen row's prompt token, scored for ORPO's NLL term (chosen_sequence_nll), carries -(its answer's number + 2)
# in the answer column (-1: no answer, >= 0: an answer's token).
PROMPT_MARK = -2


class AnswerTokenLoss(HiddenTokenLoss):
    """An objective over answers' tokens (PreferenceLoss, loop/kto.py's KTOObjective): each scored token's NLL from
    the final hidden states through the head (chunked, vocabulary-parallel), or, with no head, from the model's
    whole logits (engine=deepspeed), handed with its target row (label, answer, reference) to `answers_loss`."""

    def mask(self, target: torch.Tensor) -> torch.Tensor:
        return target[..., 0] != IGNORE

    def __call__(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        scored = self.mask(target)
        if self.takes_hidden:
            return self.scored(outputs[scored], target[scored])
        logits, target = outputs[scored], target[scored]
        return self.answers_loss(F.cross_entropy(logits.float(), target[:, 0].long(), reduction="none"), target)

    def scored(self, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        labels = target[:, 0].long()
        if self.chunk_tokens:
            nll = token_nll(hidden, self.head, labels, self.chunk_tokens, self.softcap)
        else:
            nll = F.cross_entropy(self.logits(hidden).float(), labels, reduction="none")
        return self.answers_loss(nll, target)

    def answers_loss(self, nll: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        raise NotImplementedError


class PreferenceLoss(AnswerTokenLoss):
    """task=dpo's loss from the final hidden states (or, with no head given, engine=deepspeed's whole logits): the
    linear part, each answer's log-probability as the sum over its tokens of -token_nll (parallel/vocab.py:
    chunked, vocabulary-parallel, never the whole logits) and its token count, handed with the reference's sums to
    the pair loss (loop/pair_losses.py: DPO's family, SimPO, ORPO), which makes each pair's loss and statistics.

    Summed over pairs (the Trainer divides by the global pair count). `target` is a preference Batch's
    loss_target: (label, answer, reference) at each position. Each call's statistics, per pair: "loss", the pair
    loss's (`metric_names`), and beside the metrics "answer_logps" and "answer_tokens" (pairs x (chosen,
    rejected): each answer's summed log-probability, which the reference pass keeps, and its token count).
    `token_share` (set by `share_of`, the declared pre-step input): the pairs over the chosen rows' scored tokens
    of the batch being scored, which ORPO's token-mean NLL needs."""

    def __init__(self, head: nn.Module | None, chunk_tokens: int, softcap: float | None = None, *, preference):
        super().__init__(head, chunk_tokens, softcap)
        self.takes_hidden = head is not None  # else the model's whole logits (engine=deepspeed)
        self.pair_loss_of = pair_loss_for(preference)
        self.beta = preference.dpo_beta
        self.metric_names = ("loss", *self.pair_loss_of.metric_names)
        self.token_share = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.pair_loss_of.needs_reference

    @property
    def scores_prompts(self) -> bool:
        """The chosen rows' prompt tokens are scored too (ORPO): the batchers label them."""
        return self.pair_loss_of.chosen_sequence_nll

    def share_of(self, split, indices) -> None:
        """Before scoring these pairs of `split` (a step's global batch, or a whole held-out split): the pairs
        over their chosen rows' scored tokens (every token but the first), ORPO's NLL's divisor as a share."""
        if self.scores_prompts:
            self.token_share = len(indices) / sum(len(split.ids[i]) - 1 for i in indices)

    def answers_loss(self, nll: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """The pairs' summed loss and per-pair statistics from each scored token's NLL and its (label, answer,
        reference)."""
        answer = target[:, 1].long()
        prompt = answer <= PROMPT_MARK  # ORPO: a chosen row's prompt token (only in its NLL)
        chosen_nll = None
        if self.scores_prompts:
            nll, answer, target, prompt_nll, prompt_of = (
                nll[~prompt],
                answer[~prompt],
                target[~prompt],
                nll[prompt],
                answer[prompt],
            )
        numbers, slot = torch.unique(answer, return_inverse=True)  # 2p, 2p + 1 for each pair p here
        logps = torch.zeros(len(numbers), device=nll.device).index_add(0, slot, -nll).view(-1, 2)
        tokens = torch.zeros(len(numbers), device=nll.device).index_add(0, slot, torch.ones_like(nll)).view(-1, 2)
        reference = target.new_zeros(len(numbers)).scatter(0, slot, target[:, 2]).float().view(-1, 2)
        if self.scores_prompts:
            pair_of = torch.searchsorted(numbers, PROMPT_MARK - prompt_of) // 2
            prompts = torch.zeros(len(numbers) // 2, device=nll.device).index_add(0, pair_of, prompt_nll)
            chosen_nll = (prompts - logps[:, 0]) * self.token_share
        losses, stats = self.pair_loss_of(logps, tokens, reference if self.needs_reference else None, chosen_nll)
        stats = {"loss": losses.detach(), **stats, "answer_logps": logps.detach(), "answer_tokens": tokens}
        return losses.sum(), stats


def objective_for(task: Task, hidden: HiddenTokenLoss | None = None) -> Objective:
    """The objective of a task's head: a language model's from hidden states when `hidden` says how, else from
    logits."""
    if task.head is HeadKind.CAUSAL_LM:
        return hidden or TOKEN_OBJECTIVE
    return REGRESSION_OBJECTIVE if task.regression else CLASS_OBJECTIVE
