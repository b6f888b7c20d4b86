"""The distributed scorer: a split's metrics over all data-parallel ranks, each row scored exactly once.

Rows are sorted by length and cut into chunks; data-parallel rank r scores chunks r, r + dp, ...; the loss sums
and counts are all-reduced and the predictions gathered, and under pipeline parallelism the last stage, which
scored everything, hands both to the other stages, so every rank returns the same metrics. Accuracy goes through
`evaluate` with the metric shipped in metrics/accuracy.py; perplexity is exp of the mean token loss.
"""

from __future__ import annotations

import math

import datasets
import torch
import torch.distributed as dist
from torch import nn

from .data import column, device_batch
from .interfaces import Runner
from .loss import scored_count, summed_loss, targets
from .metrics import load_metric


@torch.no_grad()
def evaluate(
    model: nn.Module, runner: Runner, split: datasets.Dataset, tokenizer, task: str, batch_size: int, layout
) -> dict:
    """`split`'s metrics (eval_loss, and accuracy or perplexity by `task`) through `runner`, in chunks of
    `batch_size` rows; `model` (what the runner drives) is in eval mode meanwhile. Every rank calls it."""
    training = model.training
    model.eval()
    try:
        return _score(runner, split, tokenizer, task, batch_size, layout)
    finally:
        model.train(training)


def _score(runner: Runner, split: datasets.Dataset, tokenizer, task: str, batch_size: int, layout) -> dict:
    ids, lengths = column(split, "input_ids"), column(split, "length")
    labels = column(split, "label") if task == "classification" else None
    order = sorted(range(len(ids)), key=lambda i: lengths[i])
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    predictions: list[tuple[int, int]] = []
    totals = torch.zeros(2, dtype=torch.float64, device=layout.device)  # loss sum, count
    mine = chunks[layout.dp_rank :: layout.dp]
    # Under FSDP and ZeRO-3 a forward all-gathers parameters over the data-parallel ranks, so all of them
    # run the same number: a rank short of a chunk runs the first one again and scores it nowhere.
    rounds = -(-len(chunks) // layout.dp)
    for number, chunk in enumerate(mine + [chunks[0]] * (rounds - len(mine))):
        batch = device_batch(chunk, ids, labels, tokenizer, runner.pad_multiple, layout.device)
        logits = runner.forward(batch)
        if number >= len(mine) or logits is None:  # a repeat, or a pipeline stage that is not the last
            continue
        totals[0] += summed_loss(logits, targets(batch, task)).double()
        totals[1] += scored_count(batch, task)
        if labels is not None:
            predictions.extend(zip(chunk, logits.argmax(-1).tolist()))
    if layout.dp > 1:
        dist.all_reduce(totals, group=layout.dp_group)
    gathered: list = [None] * layout.dp
    if labels is not None and layout.dp > 1:
        dist.all_gather_object(gathered, predictions, group=layout.dp_group)
    else:
        gathered = [predictions]
    if layout.pp > 1:  # the last stage scored everything: hand its sums and predictions to the other stages
        box = [(totals.tolist(), gathered)]
        dist.broadcast_object_list(box, group=layout.pp_group, group_src=layout.pp - 1)
        totals, gathered = torch.tensor(box[0][0], dtype=torch.float64), box[0][1]
    mean_loss = (totals[0] / totals[1]).item()
    if labels is None:
        return {"eval_loss": mean_loss, "perplexity": math.exp(min(mean_loss, 700.0))}
    by_row = dict(pair for part in gathered for pair in part)
    assert len(by_row) == len(ids), "every dev row is predicted exactly once"
    ordered = sorted(by_row)
    accuracy = load_metric("accuracy").compute(
        predictions=[by_row[i] for i in ordered], references=[labels[i] for i in ordered]
    )["accuracy"]
    return {"eval_loss": mean_loss, "accuracy": accuracy}
