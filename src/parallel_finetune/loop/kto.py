"""task=kto's objective, its KL estimate and its reference pass: KTO (Ethayarajh et al.) as TRL's KTOTrainer
computes it (loss_type="kto"), summed over rows; the Trainer divides by the global row count.

Per row, with r = beta (policy - reference) log-probability of its completion (summed over its tokens) and z the
step's KL estimate (below),

    desirable row:    desirable_weight   x (1 - sigmoid(beta (logratio - z)))
    undesirable row:  undesirable_weight x (1 - sigmoid(beta (z - logratio)))

and the loss is their mean over the global batch's rows (TRL's nanmean over its batch), whatever the layout.

The KL estimate z: TRL's detached, clamped-at-0 mean over the batch of (policy - reference) log-probabilities of
its KL rows, each row's prompt with another row's completion (data/kto.py's kl_pairs: the global batch rotated by
one). Here the pairing is over the step's GLOBAL batch, in the sampler's order, and z is measured before the
step's micro-batches by a forward of the policy over the KL rows without gradients (in the model's mode: training
mode while training, as TRL's, so dropout draws as it would there), each data-parallel rank its share, summed over
every rank: every layout and accumulation has the one-process z, and a one-process run's step is TRL's with its
batch the global batch. The KL rows' reference log-probabilities are measured once with the rows' (below). The
held-out split's z is its rows rotated alike, measured in eval mode before they are scored.

Metrics, TRL's names: kl (z), rewards/chosen and logps/chosen (means over the desirable rows), rewards/rejected
and logps/rejected (over the undesirable ones), rewards/margins (rewards/chosen - rewards/rejected); a side with
no row in the batch has none, as in TRL's log. TRL's logits/chosen, logits/rejected and entropy are not reported
(the chunked, vocabulary-parallel head makes no whole logits), nor its token count.

The reference pass is loop/reference.py's (the model as training starts, with LoRA / QLoRA its adapters disabled,
in eval mode, before a checkpoint is resumed), over the units data/kto.py's KTOBatcher names: each row a step
trains on and each of the steps' KL rows, and every held-out row and KL row, one forward each; each call's
"answer_logps" statistics are what it keeps.

`KTOObjective` is an `interfaces.Objective`: each call returns the summed loss and its per-row statistics; `measured`
(the declared hook after the reference pass) hands it the KL rows' reference log-probabilities and the scorer its
KL estimate forwards with, and `share_of` (the declared pre-step input) measures the estimate of the rows about to
be scored."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..interfaces import Stats, joined
from .loss import AnswerTokenLoss

KTO_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
# what `sums` adds up, in this order (each over the rows; the desirable and undesirable counts, then all rows)
_SUMS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "chosen", "rejected")


class KTOObjective(AnswerTokenLoss):
    """KTO's loss from the final hidden states (the chunked, vocabulary-parallel head) or, with no head given,
    whole logits (engine=deepspeed). `target`: a KTO batch's loss_target, (label, answer, reference) at each
    position; an answer number's parity says the row's label (even: desirable). Each call's statistics, per row:
    the metrics' terms, each side's count ("chosen", "rejected") and "answer_logps" (the row's summed
    log-probability: what the reference pass and the KL estimate read). `kl`: the KL estimate of the rows being
    scored, set by `share_of` before them."""

    needs_reference = True
    scores_prompts = False  # (the batchers' question: only ORPO's chosen prompts are scored)
    metric_names = KTO_METRICS

    def __init__(self, head: nn.Module | None, chunk_tokens: int, softcap: float | None = None, *, preference):
        super().__init__(head, chunk_tokens, softcap)
        self.takes_hidden = head is not None
        self.beta = preference.dpo_beta
        self.weights = (preference.desirable_weight, preference.undesirable_weight)
        self.kl = 0.0
        self.scorer = None  # set by `measured`; None while the reference is measured (z = 0, read by nothing)
        self.kl_reference: dict[int, float] = {}

    def measured(self, references: dict, scorer) -> None:
        """After the reference pass: every split's KL rows' reference log-probabilities (data/kto.py's
        KTOReference.kl, by the rows' tokens) and the scorer the KL estimate's forwards go through."""
        self.scorer, self.kl_reference = scorer, {}
        for reference in references.values():
            self.kl_reference |= reference.kl

    def share_of(self, split, indices) -> None:
        """Before these rows of `split` are scored (a step's global batch, or a whole held-out split): their KL
        estimate z, the clamped mean (policy - reference) log-probability of their KL rows (data/kto.py's
        kl_pairs), the policy's measured now without gradients, in the model's mode, on every rank alike."""
        if self.scorer is None:
            self.kl = 0.0
            return
        batcher = self.scorer.batcher(split)
        units = batcher.kl_units(indices)
        policy = self.scorer.answer_logps(batcher, units)[:, 0].cpu()
        keys = batcher.unit_keys(units)
        if any(key not in self.kl_reference for key in keys):
            raise RuntimeError("a KL row's reference log-probability was not measured before training")
        reference = torch.tensor([self.kl_reference[key] for key in keys], dtype=torch.float64)
        self.kl = max((policy - reference).mean().item(), 0.0)

    def answers_loss(self, nll: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """The rows' summed loss and per-row stats from each scored token's NLL and its (label, answer, reference)."""
        numbers, slot = torch.unique(target[:, 1].long(), return_inverse=True)  # 2r or 2r + 1 for each row r here
        logps = torch.zeros(len(numbers), device=nll.device).index_add(0, slot, -nll)
        reference = target.new_zeros(len(numbers)).scatter(0, slot, target[:, 2]).float()
        desirable = numbers % 2 == 0
        logratios = logps - reference
        kl = torch.full_like(logps, float(self.kl))
        desired, undesired = self.weights
        losses = torch.where(
            desirable,
            desired * (1 - torch.sigmoid(self.beta * (logratios - kl))),
            undesired * (1 - torch.sigmoid(self.beta * (kl - logratios))),
        )
        rewards, logps = self.beta * logratios.detach(), logps.detach()
        chosen, rejected = desirable.double(), (~desirable).double()
        stats = {
            "loss": losses.detach(),
            "kl": kl,
            "rewards/chosen": rewards * chosen,
            "rewards/rejected": rewards * rejected,
            "logps/chosen": logps * chosen,
            "logps/rejected": logps * rejected,
            "chosen": chosen,
            "rejected": rejected,
            "answer_logps": logps[:, None],  # (rows, 1): one answer a unit
        }
        return losses.sum(), stats

    def sums(self, stats: Sequence[Stats], device) -> torch.Tensor:
        """_SUMS over the rows of `stats`, then the row count (float64; zeros for none)."""
        totals = torch.zeros(len(_SUMS) + 1, dtype=torch.float64, device=device)
        rows = joined(stats)
        if rows:
            totals[:-1] = torch.stack([rows[name].double().sum() for name in _SUMS])
            totals[-1] = len(rows["loss"])
        return totals

    def metrics(self, totals: torch.Tensor) -> dict[str, float]:
        """`sums` (reduced over the ranks) as TRL's metrics; a side with no row has none (nor a margin)."""
        sums = dict(zip(_SUMS, totals.tolist()))
        rows = totals[-1].item()
        metrics = {"loss": sums["loss"] / rows, "kl": sums["kl"] / rows}
        for side in ("chosen", "rejected"):
            if sums[side]:
                metrics |= {f"{kind}/{side}": sums[f"{kind}/{side}"] / sums[side] for kind in ("rewards", "logps")}
        if sums["chosen"] and sums["rejected"]:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return {name: metrics[name] for name in KTO_METRICS if name in metrics}
