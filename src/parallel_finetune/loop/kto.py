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

The reference pass (`measure_kto_reference`): the model as training starts (with LoRA / QLoRA: its adapters
disabled), in eval mode, before a checkpoint is resumed: each row a step trains on and each of the steps' KL rows,
and every held-out row and KL row, one forward each (as loop/reference.py measures dpo's pairs).

`KTOObjective` has the objective protocol's shape (`__call__(outputs, target) -> (summed loss, stats)`, `sums`,
`metrics`); `KTOLoss` is its adapter to today's Trainer, Evaluator and runners (the loss alone, its stats kept for
`take()`, as loop/loss.py's PreferenceLoss)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data.batch import IGNORE, TokenizedSplit
from ..data.kto import KTOBatcher, KTOReference, kl_key, kl_pairs
from ..data.sampling import scoring_chunks
from ..interfaces import Runner
from ..model.lora import adapters_disabled
from ..parallel.vocab import token_nll
from .loss import HiddenTokenLoss, KeepsPairRecords, PairRecord

log = logging.getLogger(__name__)

KTO_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
# what `sums` adds up, in this order (each over the rows; the desirable and undesirable counts, then all rows)
_SUMS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "chosen", "rejected")

Stats = dict[str, torch.Tensor]


class KTOObjective(HiddenTokenLoss):
    """KTO's loss from the final hidden states (the chunked, vocabulary-parallel head) or, with no head given,
    whole logits (engine=deepspeed). `target`: a KTO batch's loss_target, (label, answer, reference) at each
    position; an answer number's parity says the row's label (even: desirable). `kl`: the KL estimate of the rows
    being scored, set before them (`KTOLoss.share_of`)."""

    needs_reference = True
    scores_prompts = False  # (the batchers' question: only ORPO's chosen prompts are scored)
    metric_names = KTO_METRICS

    def __init__(self, head: nn.Module | None, chunk_tokens: int, softcap: float | None = None, *, preference):
        super().__init__(head, chunk_tokens, softcap)
        self.takes_hidden = head is not None
        self.beta = preference.dpo_beta
        self.weights = (preference.desirable_weight, preference.undesirable_weight)
        self.kl = 0.0

    def mask(self, target: torch.Tensor) -> torch.Tensor:
        return target[..., 0] != IGNORE

    def __call__(self, outputs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        scored = self.mask(target)
        if self.takes_hidden:
            return self.score(outputs[scored], target[scored])
        nll = F.cross_entropy(outputs[scored].float(), target[scored][:, 0].long(), reduction="none")
        return self.row_loss(nll, target[scored])

    def score(self, hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
        """The rows' loss and stats from the scored positions' hidden states and targets."""
        labels = target[:, 0].long()
        if self.chunk_tokens:
            nll = token_nll(hidden, self.head, labels, self.chunk_tokens, self.softcap)
        else:
            nll = F.cross_entropy(self.logits(hidden).float(), labels, reduction="none")
        return self.row_loss(nll, target)

    def row_loss(self, nll: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Stats]:
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
            "logps": logps,
        }
        return losses.sum(), stats

    def sums(self, stats: list[Stats], device) -> torch.Tensor:
        """_SUMS over the rows of `stats`, then the row count (float64)."""
        totals = torch.zeros(len(_SUMS) + 1, dtype=torch.float64, device=device)
        for part in stats:
            totals[:-1] += torch.stack([part[name].double().sum() for name in _SUMS])
            totals[-1] += len(part["loss"])
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


class KTOLoss(KTOObjective, KeepsPairRecords):
    """KTOObjective driven as today's Trainer, Evaluator and runners drive a pair loss: each call returns the summed
    loss and keeps its stats (`take`), `sums(record)`, and `share_of(split, rows)` before a step's or a held-out
    split's rows are scored, which measures their KL estimate (`estimate`, set by the reference pass)."""

    def __init__(self, head: nn.Module | None, chunk_tokens: int, softcap: float | None = None, *, preference):
        super().__init__(head, chunk_tokens, softcap, preference=preference)
        self.records: list[PairRecord] = []
        self.estimate: KLEstimate | None = None  # None while the reference is measured (z = 0, read by nothing)

    def _kept(self, result: tuple[torch.Tensor, Stats]) -> torch.Tensor:
        loss, stats = result
        self.records.append(PairRecord(stats["logps"], torch.ones_like(stats["logps"]), stats["loss"], stats))
        return loss

    def __call__(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._kept(super().__call__(outputs, target))

    def scored(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._kept(self.score(hidden, target))

    def share_of(self, split: TokenizedSplit, rows) -> None:
        self.kl = self.estimate(split, rows) if self.estimate is not None else 0.0

    def sums(self, record: PairRecord | None, device) -> torch.Tensor:
        return super().sums([record.stats] if record is not None else [], device)


@dataclass
class Scoring:
    """What a pass of forwards without gradients runs on: the runner (and the model it drives), the layout, the
    batches' padding (pad_id, padding_side, pad_multiple, device), max_length (KL rows are cut to it) and rows per
    forward on each data-parallel rank."""

    runner: Runner
    model: nn.Module
    layout: object
    padding: dict
    max_length: int
    batch_size: int

    def batcher(self, split: TokenizedSplit, reference: KTOReference | None = None) -> KTOBatcher:
        return KTOBatcher(split, max_length=self.max_length, reference=reference, **self.padding)

    def logps(self, loss: KTOLoss, items: list, lengths: list[int], batch) -> torch.Tensor:
        """Each item's summed completion log-probability (float64, on every rank): `batch(chunk)` makes a chunk's
        Batch; each data-parallel rank scores its chunks, the last pipeline stage's first tensor-parallel rank
        counts them, and a sum over every rank hands them to all."""
        layout = self.layout
        values = torch.zeros(len(items), dtype=torch.float64, device=layout.device)
        loss.take()
        with torch.no_grad():
            for chunk, counts in scoring_chunks(range(len(items)), lengths, self.batch_size, layout.dp_rank, layout.dp):
                self.runner.loss(batch([items[i] for i in chunk]))
                record = loss.take()  # None on a pipeline stage that is not the last
                if counts and record is not None and layout.tp_rank == 0:
                    values[torch.tensor(chunk, device=layout.device)] = record.logps.double()
        if layout.world_size > 1:
            dist.all_reduce(values)
        return values


class KLEstimate:
    """The KL estimate of some rows of a split (`__call__(split, rows)`): the clamped mean (policy - reference)
    log-probability of their KL rows (kl_pairs), the policy's measured now without gradients."""

    def __init__(self, loss: KTOLoss, scoring: Scoring, reference: dict[int, float]):
        self.loss, self.scoring, self.reference = loss, scoring, reference

    def __call__(self, split: TokenizedSplit, rows) -> float:
        batcher = self.scoring.batcher(split)
        pairs = kl_pairs(rows)
        ids = [batcher.kl_ids(*pair)[0] for pair in pairs]
        policy = self.scoring.logps(self.loss, pairs, [len(row) for row in ids], batcher.kl_batch)
        reference = torch.tensor([self.reference[kl_key(row)] for row in ids], dtype=torch.float64)
        return max((policy.cpu() - reference).mean().item(), 0.0)


def step_batches(sampler, total_steps: int) -> list[list[int]]:
    """The global batches of the run's steps (every rank draws the same)."""
    batches, per_epoch = [], len(sampler)
    for epoch in range(-(-total_steps // per_epoch)):
        batches += sampler.epoch(epoch)[: total_steps - epoch * per_epoch]
    return batches


def measure_kto_reference(
    loss: KTOLoss, scoring: Scoring, split: TokenizedSplit, batches: list[list[int]], lora: bool
) -> KTOReference:
    """The reference log-probabilities of the rows of `batches` (a run's steps' global batches, or a held-out
    split whole as one) and of their KL rows, the model in eval mode (its adapters disabled under LoRA)."""
    rows = sorted({i for batch in batches for i in batch})
    batcher = scoring.batcher(split)
    kl = {}
    for batch in batches:
        for pair in kl_pairs(batch):
            ids = batcher.kl_ids(*pair)[0]
            kl.setdefault(kl_key(ids), (pair, len(ids)))
    model, training = scoring.model, scoring.model.training
    model.eval()
    try:
        with adapters_disabled(model) if lora else contextlib.nullcontext():
            values = scoring.logps(loss, rows, [split.lengths[i] for i in rows], batcher.batch)
            pairs = [pair for pair, _ in kl.values()]
            kl_values = scoring.logps(loss, pairs, [length for _, length in kl.values()], batcher.kl_batch)
    finally:
        model.train(training)
    measured, per_row = [False] * len(split), [0.0] * len(split)
    for row, value in zip(rows, values.tolist()):
        measured[row], per_row[row] = True, value
    return KTOReference(per_row, measured, dict(zip(kl, kl_values.tolist())))


def kto_references(loss: KTOLoss, scoring: Scoring, splits: dict, sampler, total_steps: int, lora: bool) -> dict:
    """Each split's KTOReference by name (`splits`: train and validation, TokenizedSplits): the training rows and KL
    rows the run's steps draw, every held-out row and its KL rows; then `loss.estimate` measures each step's KL
    estimate against their reference."""
    started = time.perf_counter()
    validation = splits["validation"]
    references = {
        "train": measure_kto_reference(loss, scoring, splits["train"], step_batches(sampler, total_steps), lora),
        "validation": measure_kto_reference(loss, scoring, validation, [list(range(len(validation)))], lora),
    }
    loss.estimate = KLEstimate(loss, scoring, references["train"].kl | references["validation"].kl)
    log.info(
        "kto: reference log-probabilities of %d rows and %d KL rows measured in %.1f s (%s)",
        sum(sum(r.measured) for r in references.values()),
        sum(len(r.kl) for r in references.values()),
        time.perf_counter() - started,
        "the model with its adapters disabled" if lora else "the model before training",
    )
    return references
