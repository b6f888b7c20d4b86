"""task=reward's objective: TRL's RewardTrainer loss on a one-output sequence classifier's scores, summed over pairs.

The classifier scores each row (its logits, (rows, 1)); a batch's rows come in pairs (chosen at 2p, rejected at
2p + 1: data/reward.py) and its labels are each row's pair's margin m (0 without a `margin` column). Per pair,

    loss = -log sigmoid(r_chosen - r_rejected - m) + c (r_chosen + r_rejected)^2

(c: center_rewards_coefficient, TRL's reward centring, Eisenstein et al.; TRL adds c x the batch's mean of the
squared sums, which is this term's mean over the pairs). Summed over the pairs; the Trainer divides by the global
pair count, so every layout and accumulation gives one process's update.

Metrics, TRL's names: accuracy (the share of pairs whose chosen score is strictly above the rejected one's),
margin (the mean r_chosen - r_rejected), mean_reward (every row's score's mean), min_reward and max_reward (over
every row). Each call returns them per pair with the loss (an `interfaces.Objective`); the means travel as
per-pair sums like the preference losses' (`sums`, all-reduced by the Trainer and the Evaluator over the pairs
they count); the extremes of the statistics `sums` is handed are kept until the next `metrics`, which reduces them
with MIN/MAX over the ranks (a repeated or copied row changes neither). The Trainer and Evaluator drive it as they
drive loop/loss.py's PreferenceLoss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..interfaces import Stats, joined
from .loss import PerUnitObjective

REWARD_METRICS = ("accuracy", "margin", "mean_reward")  # per-pair means; min_reward and max_reward besides


class RewardLoss(PerUnitObjective):
    """A reward model's pair loss from its scores (logits, not hidden states); no reference pass."""

    scores_prompts = False
    metric_names = ("loss", *REWARD_METRICS)

    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center = center_rewards_coefficient or 0.0
        self.extremes = (math.inf, -math.inf)  # the lowest and highest score summed into `sums` since `metrics`

    def __call__(self, logits: torch.Tensor, margins: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """`logits` (rows, 1) of rows in pairs (chosen, rejected, ...); `margins` (rows,): each row's pair's."""
        rewards = logits.float().reshape(-1, 2)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        margin = margins.float().reshape(-1, 2)[:, 0]
        losses = -F.logsigmoid(chosen - rejected - margin)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        scores = rewards.detach()
        stats = {
            "loss": losses.detach(),
            "accuracy": (scores[:, 0] > scores[:, 1]).float(),
            "margin": scores[:, 0] - scores[:, 1],
            "mean_reward": scores.mean(-1),
            "min": scores.min(-1).values,
            "max": scores.max(-1).values,
        }
        return losses.sum(), stats

    def sums(self, stats: Sequence[Stats], device) -> torch.Tensor:
        """The loss and REWARD_METRICS summed over the pairs of `stats`, the pair count last (float64; zeros for
        none); their lowest and highest score are kept for `metrics`."""
        units = joined(stats)
        if units and len(units["loss"]):
            low, high = float(units["min"].min()), float(units["max"].max())
            self.extremes = (min(self.extremes[0], low), max(self.extremes[1], high))
        return super().sums(stats, device)

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """`sums` (reduced over the ranks) as the metrics: each sum over the pair count, then min_reward and
        max_reward over every rank's pairs (a collective: every rank calls it)."""
        extremes = torch.tensor([-self.extremes[0], self.extremes[1]], dtype=torch.float64, device=totals.device)
        self.extremes = (math.inf, -math.inf)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        return super().metrics(totals) | {
            "min_reward": -extremes[0].item(),
            "max_reward": extremes[1].item(),
        }
