"""The distributed scorer: a split's metrics over all data-parallel ranks, each row scored exactly once.

Rows are sorted by length and cut into chunks; data-parallel rank r scores chunks r, r + dp, ...; the loss sums
and counts are all-reduced and the predictions gathered, and under pipeline parallelism the last stage, which
scored everything, hands both to the other stages, so every rank returns the same metrics. A task's metrics go
through metrics.compute_metrics (GLUE's official ones for a GLUE task); perplexity is exp of the mean token loss.
`predict` gives the same per-row predictions without labels (a test split).
"""

from __future__ import annotations

import math
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
from torch import nn

from .data import PreparedData, column, device_batch
from .errors import UserError
from .interfaces import Runner
from .loss import scored_count, summed_loss, targets
from .metrics import compute_metrics
from .runfolder import record_written
from .tasks.task import HeadKind, Task


@torch.no_grad()
def evaluate(
    model: nn.Module, runner: Runner, split: datasets.Dataset, tokenizer, task: Task, batch_size: int, layout
) -> dict:
    """`split`'s metrics through `runner`, in chunks of `batch_size` rows: eval_loss, and the task's metric(s)
    (metrics.compute_metrics) or perplexity; `model` (what the runner drives) is in eval mode meanwhile. Every rank
    calls it and gets the same result."""
    loss, predictions = _scored(model, runner, split, tokenizer, task, batch_size, layout, with_loss=True)
    if task.head is HeadKind.CAUSAL_LM:
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    references = column(split, "label")
    scores = compute_metrics(task.metric, predictions, references, task.num_labels)
    return {"eval_loss": loss, **scores}


@torch.no_grad()
def predict(
    model: nn.Module, runner: Runner, split: datasets.Dataset, tokenizer, task: Task, batch_size: int, layout
) -> list:
    """Each row's prediction (a class id, or a regression value), in the split's order; every rank calls it."""
    return _scored(model, runner, split, tokenizer, task, batch_size, layout, with_loss=False)[1]


def _scored(model, runner, split, tokenizer, task: Task, batch_size: int, layout, with_loss: bool):
    training = model.training
    model.eval()
    try:
        return _score(runner, split, tokenizer, task, batch_size, layout, with_loss)
    finally:
        model.train(training)


def _score(runner: Runner, split: datasets.Dataset, tokenizer, task: Task, batch_size: int, layout, with_loss: bool):
    ids, lengths = column(split, "input_ids"), column(split, "length")
    classifies = task.head is HeadKind.CLASSIFICATION  # a language model's rows are scored by their loss alone
    labels = column(split, "label") if with_loss and classifies else None
    types = column(split, "token_type_ids") if "token_type_ids" in split.column_names else None
    masks = column(split, "target_mask") if "target_mask" in split.column_names else None  # task=sft
    order = sorted(range(len(ids)), key=lambda i: lengths[i])
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    predictions: list[tuple[int, float | int]] = []
    totals = torch.zeros(2, dtype=torch.float64, device=layout.device)  # loss sum, count
    mine = chunks[layout.dp_rank :: layout.dp]
    # Under FSDP and ZeRO-3 a forward all-gathers parameters over the data-parallel ranks, so all of them
    # run the same number: a rank short of a chunk runs the first one again and scores it nowhere.
    rounds = -(-len(chunks) // layout.dp)
    for number, chunk in enumerate(mine + [chunks[0]] * (rounds - len(mine))):
        batch = device_batch(chunk, ids, labels, tokenizer, runner.pad_multiple, layout.device, types, masks)
        logits = runner.forward(batch)
        if number >= len(mine) or logits is None:  # a repeat, or a pipeline stage that is not the last
            continue
        if with_loss:
            totals[0] += summed_loss(logits, targets(batch, task.head)).double()
            totals[1] += scored_count(batch, task.head)
        if classifies:
            predictions.extend(zip(chunk, task.predicted(logits).tolist()))
    if with_loss and layout.dp > 1:
        dist.all_reduce(totals, group=layout.dp_group)
    gathered: list = [None] * layout.dp
    if classifies and layout.dp > 1:
        dist.all_gather_object(gathered, predictions, group=layout.dp_group)
    else:
        gathered = [predictions]
    if layout.pp > 1:  # the last stage scored everything: hand its sums and predictions to the other stages
        box = [(totals.tolist(), gathered)]
        dist.broadcast_object_list(box, group=layout.pp_group, group_src=layout.pp - 1)
        totals, gathered = torch.tensor(box[0][0], dtype=torch.float64), box[0][1]
    mean_loss = (totals[0] / totals[1]).item() if with_loss else float("nan")
    if not classifies:
        return mean_loss, []
    by_row = dict(pair for part in gathered for pair in part)
    assert len(by_row) == len(ids), "every row is predicted exactly once"
    return mean_loss, [by_row[i] for i in range(len(ids))]


def write_predictions(path: Path, index: list[int], predicted: list, task: Task) -> Path:
    """GLUE's submission format: a header `index<TAB>prediction`, then one row per test row, the prediction as
    the data writes its labels (GLUE's 0/1 or entailment names; a user's label names) or, for regression, the
    value with three decimals."""
    lines = ["index\tprediction"]
    for row, value in zip(index, predicted):
        lines.append(f"{row}\t{task.prediction_text(value)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def evaluate_all(model: nn.Module, runner: Runner, data: PreparedData, batch_size: int, layout) -> dict:
    """The metrics of every validation split: the first's as they are, a second's (MNLI's mismatched dev set)
    prefixed with its name ("mismatched_accuracy")."""
    results = {}
    for split in data.task.validation_splits:
        scores = evaluate(model, runner, data.splits[split], data.tokenizer, data.task, batch_size, layout)
        prefix = "" if split == "validation" else split.removeprefix("validation_") + "_"
        results.update({prefix + key: value for key, value in scores.items()})
    return results


def predict_test(
    model: nn.Module, runner: Runner, data: PreparedData, batch_size: int, layout, run_folder: Path
) -> list[Path]:
    """predictions.tsv (and predictions_mismatched.tsv for MNLI) in GLUE's submission format: every rank
    predicts, rank 0 writes."""
    task, written = data.task, []
    if not task.test_splits:
        raise UserError(
            "predict=true: the data has no test split; give test_file=PATH (or a GLUE folder with test.tsv)"
        )
    for split in task.test_splits:
        rows = data.splits[split]
        predicted = predict(model, runner, rows, data.tokenizer, task, batch_size, layout)
        if layout.is_main:
            name = "predictions.tsv" if split == "test" else f"predictions_{split.removeprefix('test_')}.tsv"
            record_written(run_folder, name)
            written.append(write_predictions(run_folder / name, column(rows, "index"), predicted, task))
    return written
