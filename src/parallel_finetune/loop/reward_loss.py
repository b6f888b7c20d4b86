"""task=reward's objective: TRL's RewardTrainer loss on a one-output sequence classifier's scores, summed over pairs.

The classifier scores each row (its logits, (rows, 1)); a batch's rows come in pairs (chosen at 2p, rejected at
2p + 1: data/reward.py) and its labels are each row's pair's margin m (0 without a `margin` column). Per pair,

    loss = -log sigmoid(r_chosen - r_rejected - m) + c (r_chosen + r_rejected)^2

(c: center_rewards_coefficient, TRL's reward centring, Eisenstein et al.; TRL adds c x the batch's mean of the
squared sums, which is this term's mean over the pairs). Summed over the pairs; the Trainer divides by the global
pair count, so every layout and accumulation gives one process's update.

Metrics, TRL's names: accuracy (the share of pairs whose chosen score is strictly above the rejected one's),
margin (the mean r_chosen - r_rejected), mean_reward (every row's score's mean), min_reward and max_reward (over
every row). The means travel as per-pair sums like the preference losses' (`sums`, all-reduced by the Trainer and
the Evaluator over the pairs they count); the extremes are kept beside them and reduced with MIN/MAX over the
ranks in `metrics` (a repeated or copied row changes neither). The Trainer and Evaluator drive it as they drive
loop/loss.py's PreferenceLoss (`take`, `sums`, `metrics`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .loss import KeepsPairRecords, PairRecord

REWARD_METRICS = ("accuracy", "margin", "mean_reward")  # per-pair means; min_reward and max_reward besides


class RewardLoss(KeepsPairRecords):
    """A reward model's pair loss from its scores (logits, not hidden states)."""

    takes_hidden = False
    needs_reference = False  # no reference pass
    scores_prompts = False
    metric_names = ("loss", *REWARD_METRICS)

    def __init__(self, center_rewards_coefficient: float | None = None):
        self.center = center_rewards_coefficient or 0.0
        self.records: list[PairRecord] = []
        self.extremes = [math.inf, -math.inf]  # the lowest and highest score summed into `sums` since `metrics`

    def share_of(self, split, indices) -> None:
        """Nothing: every pair's loss is its own (PreferenceLoss's hook for ORPO's token mean)."""

    def __call__(self, logits: torch.Tensor, margins: torch.Tensor) -> torch.Tensor:
        """`logits` (rows, 1) of rows in pairs (chosen, rejected, ...); `margins` (rows,): each row's pair's."""
        rewards = logits.float().reshape(-1, 2)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        margin = margins.float().reshape(-1, 2)[:, 0]
        losses = -F.logsigmoid(chosen - rejected - margin)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        scores = rewards.detach()
        stats = {
            "accuracy": (scores[:, 0] > scores[:, 1]).float(),
            "margin": scores[:, 0] - scores[:, 1],
            "mean_reward": scores.mean(-1),
            "min": scores.min(-1).values,
            "max": scores.max(-1).values,
        }
        self.records.append(PairRecord(scores, torch.ones_like(scores), losses.detach(), stats))
        return losses.sum()

    def sums(self, record: PairRecord | None, device) -> torch.Tensor:
        """The loss and REWARD_METRICS summed over the record's pairs, the pair count last (float64; zeros for
        None); the record's lowest and highest score are kept for `metrics`."""
        totals = torch.zeros(len(self.metric_names) + 1, dtype=torch.float64, device=device)
        if record is None:
            return totals
        parts = (record.losses, *(record.stats[name] for name in REWARD_METRICS))
        totals[: len(parts)] = torch.stack([part.double().sum() for part in parts])
        totals[-1] = len(record.losses)
        if len(record.losses):
            low, high = float(record.stats["min"].min()), float(record.stats["max"].max())
            self.extremes = [min(self.extremes[0], low), max(self.extremes[1], high)]
        return totals

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """`sums` (reduced over the ranks) as the metrics: each sum over the pair count, then min_reward and
        max_reward over every rank's pairs (a collective: every rank calls it)."""
        values = (totals[:-1] / totals[-1]).tolist()
        extremes = torch.tensor([-self.extremes[0], self.extremes[1]], dtype=torch.float64, device=totals.device)
        self.extremes = [math.inf, -math.inf]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        return dict(zip(self.metric_names, values)) | {
            "min_reward": -extremes[0].item(),
            "max_reward": extremes[1].item(),
        }
