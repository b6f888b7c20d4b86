"""task=grpo's objective, TRL's GRPOTrainer._compute_loss (loss types grpo, bnpo, dr_grpo, dapo; token or
sequence importance sampling; the k3 KL to the reference when beta > 0, times the importance ratio under
use_bias_correction_kl, TRL's default) from the final hidden states and the head:
each completion token's log-probability is -token_nll (parallel/vocab.py: chunked, vocabulary-parallel under tensor
parallelism, never the whole logits) of the logits divided by the sampling temperature (TRL's: the tempered policy
that sampled), and only completion tokens carry a label.

The target (a GRPO Batch's loss_target, data/grpo.py) holds at each position (label, completion, advantage, old
log-probability, reference log-probability), the last two read only when num_iterations > 1 (else the old policy is
the current one, detached, as TRL's) and when beta > 0. A completion is never split across slices or ranks, so its
tokens are all in one call.

Normalised by a GLOBAL count, so that the sum over micro-batches and ranks is one process's loss: the Trainer
divides every call's sum by the step's completion count N (the split's loss_count), and each loss type's own
divisor is folded into a per-token weight here: grpo = 1 / the completion's tokens (a mean per completion, then over
the N completions); bnpo and dapo = N / T, T the global batch's completion tokens (set by `share_of`, the declared
pre-step input); dr_grpo = 1 / max_completion_length (a sum over N x max_completion_length).

Statistics per completion (the units): "loss", and TRL's token-level means' numerators and denominators:
clip_ratio/low_mean, high_mean, region_mean (clipped tokens; under sequence importance sampling one per
completion) over "clip_tokens", and kl (beta > 0) over "kl_tokens". TRL's clip_ratio/low_min and high_max (a min
and a max over completions) are not reported: the step's metrics are sums all-reduced over ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GRPOSection
from ..data.batch import IGNORE
from ..interfaces import Stats, joined
from ..parallel.vocab import token_nll
from .loss import HiddenTokenLoss

CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
# the target's columns at each position
LABEL, COMPLETION, ADVANTAGE, OLD, REFERENCE = range(5)


def global_divisor(loss_type: str, completions: int, tokens: int, max_completion_length: int) -> float | None:
    """What the per-token weight of bnpo, dapo and dr_grpo is (their divisor over the completion count N, which the
    Trainer divides by): N / T for bnpo and dapo, 1 / max_completion_length for dr_grpo; None for grpo (its weight
    is each completion's own 1 / tokens)."""
    if loss_type in ("bnpo", "dapo"):
        return completions / max(tokens, 1)
    if loss_type == "dr_grpo":
        return 1.0 / max_completion_length
    return None


def logit_scale(temperature: float) -> float:
    """What the logits are multiplied by before the log-softmax: 1 / the sampling temperature, as TRL scores the
    policy, the old policy and the reference (its fused head's temperature); greedy sampling (0) the logits as
    they are."""
    return 1.0 / temperature if temperature > 0 else 1.0


class GRPOLoss(HiddenTokenLoss):
    """GRPO's clipped surrogate (+ beta x KL) summed over the completions of a call, each weighted as its loss type
    says (module docstring); the Trainer divides by the step's completion count."""

    needs_reference = False  # the reference log-probabilities come with each step's rollout, not a pass before

    def __init__(self, head: nn.Module, chunk_tokens: int, softcap: float | None = None, *, grpo: GRPOSection):
        super().__init__(head, chunk_tokens, softcap)
        self.loss_type, self.beta, self.bias_correction = grpo.loss_type, grpo.beta, grpo.use_bias_correction_kl
        self.epsilon_low = grpo.epsilon
        self.epsilon_high = grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high
        self.sequence_level = grpo.importance_sampling_level == "sequence"
        self.keeps_old = grpo.num_iterations > 1  # else the old policy is the current one (TRL's detach)
        self.max_completion_length = grpo.max_completion_length
        self.logit_scale = logit_scale(grpo.temperature)
        self.metric_names = ("loss", *CLIP_METRICS, *(("kl",) if self.beta else ()))
        self.token_weight = global_divisor(self.loss_type, 1, 1, self.max_completion_length)

    def share_of(self, split, indices) -> None:
        """Before scoring these completions of `split` (a step's global batch, data/grpo.py's RolloutSplit): the
        global divisor of bnpo and dapo (their completion tokens, truncated ones masked out)."""
        tokens = sum(split.scored[i] for i in indices)
        self.token_weight = global_divisor(self.loss_type, len(indices), tokens, self.max_completion_length)

    def mask(self, target: torch.Tensor) -> torch.Tensor:
        return target[..., LABEL] != IGNORE

    def scored(self, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        labels = target[:, LABEL].long()
        if self.chunk_tokens:
            nll = token_nll(hidden, self.head, labels, self.chunk_tokens, self.softcap, self.logit_scale)
        else:
            nll = F.cross_entropy(self.logits(hidden).float() * self.logit_scale, labels, reduction="none")
        return self.completion_losses(-nll, target)

    def completion_losses(self, logps: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """The summed loss and per-completion statistics from each scored token's log-probability `logps` and its
        target row (label, completion, advantage, old, reference)."""
        _, slot = torch.unique(target[:, COMPLETION].long(), return_inverse=True)
        count = int(slot.max()) + 1 if len(slot) else 0

        def per_completion(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, slot, values)

        tokens = per_completion(torch.ones_like(logps))
        advantages = target[:, ADVANTAGE].float()
        old = target[:, OLD].float() if self.keeps_old else logps.detach()
        log_ratio = logps - old
        if self.sequence_level:  # GSPO: the mean of a completion's log-ratios, at each of its tokens
            log_ratio = (per_completion(log_ratio) / tokens)[slot]
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        stats: Stats = {}
        if self.beta:
            delta = target[:, REFERENCE].float() - logps
            kl = torch.exp(delta) - delta - 1
            if self.bias_correction:  # TRL's use_bias_correction_kl: times the unclipped ratio (and so is kl's metric)
                kl = kl * ratio
            per_token = per_token + self.beta * kl
            stats["kl"], stats["kl_tokens"] = per_completion(kl.detach()), tokens
        weight = 1 / tokens[slot] if self.token_weight is None else self.token_weight
        losses = per_completion(per_token * weight)
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
        flags = [flag.detach().float() for flag in (low, high, low | high)]
        if self.sequence_level:  # one ratio per completion: TRL counts completions, not tokens
            clip = [per_completion(flag) / tokens for flag in flags]
            clip_tokens = torch.ones_like(tokens)
        else:
            clip, clip_tokens = [per_completion(flag) for flag in flags], tokens
        stats = {"loss": losses.detach(), **dict(zip(CLIP_METRICS, clip)), "clip_tokens": clip_tokens, **stats}
        return losses.sum(), stats

    def sums(self, stats: Sequence[Stats], device) -> torch.Tensor:
        """float64 sums over the completions: each metric's numerator, then clip_tokens, kl_tokens and the
        completion count last."""
        names = (*self.metric_names, "clip_tokens", *(("kl_tokens",) if self.beta else ()))
        totals = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)
        units = joined(stats)
        if units:
            totals[:-1] = torch.stack([units[name].double().sum() for name in names])
            totals[-1] = len(units["loss"])
        return totals

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """The loss over the scored completions (a masked one reaches no call: the step's loss, over every
        completion, is the Trainer's); the clip ratios over the clipped units, kl over the completion tokens."""
        values = totals.tolist()
        count, clip_tokens = max(values[-1], 1), max(values[len(self.metric_names)], 1)
        metrics = {"loss": values[0] / count}
        metrics.update({name: values[1 + i] / clip_tokens for i, name in enumerate(CLIP_METRICS)})
        if self.beta:
            metrics["kl"] = values[4] / max(values[len(self.metric_names) + 1], 1)
        return metrics
