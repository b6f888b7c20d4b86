"""task=dpo's pair losses: the nonlinear part of a preference objective, one class per loss family.

PreferenceLoss (loop/loss.py) does the linear part: each answer's log-probabilities summed over its tokens (the
chunked, vocabulary-parallel head) and its token count. A pair loss takes those, per pair (rows: pairs; columns:
chosen, rejected), with the reference model's sums when it `needs_reference` (else None: no reference pass runs),
and returns each pair's loss and its statistics: a dict of per-pair tensors, named as TRL logs them
(`metric_names`), whose sums over the pairs divided by the pair count are the metrics. Every layout sums the same
per-pair figures, so the metrics are the single-process ones whatever the layout.

A pair loss whose `chosen_sequence_nll` is set also gets, per pair, its chosen row's negative log-likelihood over
every token (prompt and answer, as TRL's ORPOTrainer), already scaled to its share of the batch's token mean.

A new pair loss is one class here, one name in `pair_loss_for` and config/sections.py's `dpo_loss`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..interfaces import Stats


def _rewards(logps: torch.Tensor, rewards: torch.Tensor) -> Stats:
    """TRL's common figures: rewards/* of a pair's two rewards, logps/* of its two log-probabilities."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": (chosen > rejected).float(),
        "rewards/margins": chosen - rejected,
        "logps/chosen": logps[:, 0],
        "logps/rejected": logps[:, 1],
    }


REWARD_METRICS = tuple(_rewards(torch.zeros(1, 2), torch.zeros(1, 2)))


class DPOLoss:
    """TRL's DPOTrainer formulas, against the reference model's log-probabilities:

        d = (policy chosen - policy rejected) - (reference chosen - reference rejected)
        sigmoid: -log sigmoid(beta d) (1 - s) - log sigmoid(-beta d) s      (s: dpo_label_smoothing, cDPO)
        robust:  (-log sigmoid(beta d) (1 - s) + log sigmoid(-beta d) s) / (1 - 2 s)
        ipo:     (d - 1 / (2 beta))^2, on log-probabilities averaged over each answer's tokens
        hinge:   max(0, 1 - beta d)
        + rpo_alpha x the chosen answer's negative log-likelihood per token (RPO)

    Rewards and logps/* are of the summed log-probabilities, whichever the loss compares (as TRL logs them)."""

    needs_reference = True
    chosen_sequence_nll = False
    metric_names = REWARD_METRICS

    def __init__(self, kind: str, beta: float, smoothing: float = 0.0, rpo_alpha: float = 0.0, normalized=False):
        self.kind, self.beta, self.smoothing, self.rpo_alpha = kind, beta, smoothing, rpo_alpha
        self.normalized = normalized or kind == "ipo"

    def _scaled(self, logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return logps / tokens if self.normalized else logps

    def __call__(self, logps, tokens, reference, chosen_nll=None) -> tuple[torch.Tensor, Stats]:
        policy, measured = self._scaled(logps, tokens), self._scaled(reference, tokens)
        d = (policy[:, 0] - policy[:, 1]) - (measured[:, 0] - measured[:, 1])
        beta, s = self.beta, self.smoothing
        if self.kind == "sigmoid":
            losses = -F.logsigmoid(beta * d) * (1 - s) - F.logsigmoid(-beta * d) * s
        elif self.kind == "robust":
            losses = (-F.logsigmoid(beta * d) * (1 - s) + F.logsigmoid(-beta * d) * s) / (1 - 2 * s)
        elif self.kind == "ipo":
            losses = (d - 1 / (2 * beta)) ** 2
        else:  # hinge
            losses = torch.relu(1 - beta * d)
        if self.rpo_alpha:
            losses = losses - self.rpo_alpha * logps[:, 0] / tokens[:, 0]
        logps = logps.detach()
        return losses, _rewards(logps, self.beta * (logps - reference))


class SimPOLoss:
    """SimPO (Meng et al.), as TRL's CPOTrainer computes it with loss_type="simpo" and cpo_alpha=0: no reference;
    each answer's log-probability averaged over its tokens (a, per pair a_chosen and a_rejected),

        z = (a_chosen - a_rejected) - gamma / beta
        loss = -log sigmoid(beta z) (1 - s) - log sigmoid(-beta z) s      (s: dpo_label_smoothing)

    rewards/* are beta x a, logps/* the averages a (TRL's)."""

    needs_reference = False
    chosen_sequence_nll = False
    metric_names = REWARD_METRICS

    def __init__(self, beta: float, gamma: float, smoothing: float = 0.0):
        self.beta, self.gamma, self.smoothing = beta, gamma, smoothing

    def __call__(self, logps, tokens, reference=None, chosen_nll=None) -> tuple[torch.Tensor, Stats]:
        average = logps / tokens
        z = (average[:, 0] - average[:, 1]) - self.gamma / self.beta
        beta, s = self.beta, self.smoothing
        losses = -F.logsigmoid(beta * z) * (1 - s) - F.logsigmoid(-beta * z) * s
        average = average.detach()
        return losses, _rewards(average, self.beta * average)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (TRL's ORPOTrainer's branches)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ORPOLoss:
    """ORPO (Hong et al.), as TRL's ORPOTrainer computes it: no reference; each answer's log-probability averaged
    over its tokens (a_chosen, a_rejected),

        log_odds = (a_chosen - a_rejected) - (log(1 - exp a_chosen) - log(1 - exp a_rejected))
        loss = nll - beta log sigmoid(log_odds)

    where nll is the chosen rows' negative log-likelihood over every token (prompt and answer) averaged over the
    batch's chosen tokens: each pair brings its chosen row's sum x (pairs / the batch's chosen tokens)
    (`chosen_nll`), so the mean over pairs is TRL's token mean whatever the layout. Metrics (TRL's names):
    rewards/* (beta x a), logps/* (a), nll_loss, log_odds_ratio (the mean log sigmoid(log_odds)) and
    log_odds_chosen (the mean log_odds)."""

    needs_reference = False
    chosen_sequence_nll = True
    metric_names = (*REWARD_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __init__(self, beta: float):
        self.beta = beta

    def __call__(self, logps, tokens, reference=None, chosen_nll=None) -> tuple[torch.Tensor, Stats]:
        average = logps / tokens
        chosen, rejected = average[:, 0], average[:, 1]
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = chosen_nll - self.beta * ratio
        average = average.detach()
        stats = _rewards(average, self.beta * average)
        return losses, stats | {
            "nll_loss": chosen_nll.detach(),
            "log_odds_ratio": ratio.detach(),
            "log_odds_chosen": log_odds.detach(),
        }


# dpo_loss's values: the DPO family's, and the reference-free losses
DPO_KINDS = ("sigmoid", "ipo", "hinge", "robust")
PAIR_LOSSES = (*DPO_KINDS, "simpo", "orpo")


def pair_loss_for(preference) -> DPOLoss | SimPOLoss | ORPOLoss:
    """The pair loss the `preference:` section names (tasks/kinds/dpo.py has checked its keys)."""
    kind, beta = preference.dpo_loss, preference.dpo_beta
    if kind == "simpo":
        return SimPOLoss(beta, preference.simpo_gamma, preference.dpo_label_smoothing)
    if kind == "orpo":
        return ORPOLoss(beta)
    return DPOLoss(kind, beta, preference.dpo_label_smoothing, preference.rpo_alpha, preference.dpo_length_normalized)
