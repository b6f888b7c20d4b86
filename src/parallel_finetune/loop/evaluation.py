"""The distributed scorer: a split's metrics over all data-parallel ranks, each row scored exactly once.

Rows are sorted by length and cut into chunks; data-parallel rank r scores chunks r, r + dp, ...; the loss sums
and counts are all-reduced and the predictions gathered, and under pipeline parallelism the last stage, which
scored everything, hands both to the other stages, so every rank returns the same metrics. A task's metrics go
through metrics.compute_metrics (GLUE's official ones for a GLUE task); perplexity is exp of the mean token loss.
`predict` gives the same per-row predictions without labels (a test split); the entry point writes them
(`write_predictions`).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..data.batch import PairReference, TokenizedSplit
from ..data.batchers import Padding, make_batcher
from ..data.prepare import PreparedData
from ..data.sampling import scoring_chunks
from ..errors import UserError
from ..interfaces import Objective, Runner
from ..metrics import compute_metrics
from ..tasks.task import HeadKind, Task


class Evaluator:
    """The run's scorer over its runner: `due(step)` every `every` steps (and the end of training always
    evaluates), `evaluate` a validation split, `evaluate_all` every one, `predict` a test split's rows. Every rank
    calls them and gets the same result; `model` (what the runner drives) is in eval mode meanwhile."""

    # task=grpo's step source (rl/steps.py), which the assembly hands over with `scoring_by`: held-out prompts are
    # scored by their sampled completions' rewards instead of a loss
    rollouts = None

    def scoring_by(self, rollouts) -> Evaluator:
        """Held-out splits scored by `rollouts` (task=grpo's step source, or None: by the objective)."""
        self.rollouts = rollouts
        return self

    def __init__(
        self,
        *,
        model: nn.Module,
        runner: Runner,
        data: PreparedData,
        batch_size: int,
        layout,
        every=None,
        objective: Objective,
        references: dict[str, PairReference] | None = None,
    ):
        """`objective`: the runner's; one with metrics beyond its loss (a pair objective's) scores the held-out
        rows by them, any other by the task's metrics (a classifier's held-out loss is the objective's, from its
        logits); `references`: the held-out pairs' reference log-probabilities, by split name."""
        self.model, self.runner, self.data, self.batch_size, self.layout = model, runner, data, batch_size, layout
        self.every = every  # eval_every: steps between evaluations (None: at the end only)
        self.task = data.task
        self.loss = objective  # a classifier's takes its logits
        self.objective = objective if len(objective.metric_names) > 1 else None
        self._splits: dict[str, TokenizedSplit] = {}  # each read on first use
        self.references = dict(references or {})

    def due(self, step: int, total_steps: int) -> bool:
        """An evaluation after this step (not after the last one: the run's end evaluates every split)."""
        return bool(self.every) and step % self.every == 0 and step < total_steps

    @torch.no_grad()
    def evaluate(self, name: str = "validation") -> dict:
        """eval_loss, and the task's metric(s) (metrics.compute_metrics) or perplexity."""
        if self.rollouts is not None:  # the held-out prompts' completions, sampled and rewarded
            with self._eval_mode():
                return self.rollouts.held_out(self.data.splits[name])
        split = self._split(name)
        if self.objective is not None:
            return self._scored_units(split, self.references.get(name))
        loss, predictions = self._scored(split, with_loss=True)
        if self.task.head is HeadKind.CAUSAL_LM:
            return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0))}
        scores = compute_metrics(self.task.metric, predictions, split.labels, self.task.num_labels)
        return {"eval_loss": loss, **scores}

    def evaluate_all(self) -> dict:
        """The metrics of every validation split: the first's as they are, a second's (MNLI's mismatched dev set)
        prefixed with its name ("mismatched_accuracy")."""
        results = {}
        for name in self.task.validation_splits:
            prefix = "" if name == "validation" else name.removeprefix("validation_") + "_"
            results.update({prefix + key: value for key, value in self.evaluate(name).items()})
        return results

    @torch.no_grad()
    def predict(self, name: str) -> list:
        """Each row's prediction (a class id, or a regression value), in the split's order."""
        return self._scored(self._split(name), with_loss=False)[1]

    def predict_tests(self) -> dict[str, list]:
        """Every test split's predictions, by split name (predict=true)."""
        if not self.task.test_splits:
            raise UserError(
                "predict=true: the data has no test split; give test_file=PATH (or a GLUE folder with test.tsv)"
            )
        return {name: self.predict(name) for name in self.task.test_splits}

    def _split(self, name: str) -> TokenizedSplit:
        if name not in self._splits:
            self._splits[name] = TokenizedSplit.of(self.data.splits[name], self.task)
        return self._splits[name]

    def _scored(self, split: TokenizedSplit, with_loss: bool):
        with self._eval_mode():
            return self._score(split, with_loss)

    @contextlib.contextmanager
    def _eval_mode(self):
        """The model in eval mode (no dropout) meanwhile, then as it was."""
        training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(training)

    def _chunks(self, split: TokenizedSplit) -> list[tuple[list[int], bool]]:
        """This rank's chunks of the split's rows, and whether each counts (data.scoring_chunks)."""
        layout = self.layout
        return scoring_chunks(range(len(split)), split.lengths, self.batch_size, layout.dp_rank, layout.dp)

    def _score(self, split: TokenizedSplit, with_loss: bool):
        layout, runner = self.layout, self.runner
        tokenizer = self.data.tokenizer
        padding = Padding(tokenizer.pad_token_id, tokenizer.padding_side, runner.pad_multiple, layout.device)
        batcher = make_batcher(self.task.kind.batcher, split, padding)  # held-out rows: padded, never packed
        classifies = self.task.head is HeadKind.CLASSIFICATION  # a language model's rows are scored by their loss
        predictions: list[tuple[int, float | int]] = []
        totals = torch.zeros(2, dtype=torch.float64, device=layout.device)  # loss sum, count
        for chunk, counts in self._chunks(split):
            batch = batcher.batch(chunk, labelled=with_loss)
            if not classifies:  # a language model: its loss only, from hidden states (no logits held)
                loss, _ = runner.loss(batch)
                if counts and loss is not None:  # not a repeat, not a pipeline's earlier stage
                    totals[0] += loss.double()
                    totals[1] += batch.scored()
                continue
            logits = runner.forward(batch)
            if not counts or logits is None:  # a repeat, or a pipeline stage that is not the last
                continue
            if with_loss:
                totals[0] += self.loss(logits, batch.labels)[0].double()
                totals[1] += batch.scored()
            predictions.extend(zip(chunk, self.task.predicted(logits).tolist()))
        if with_loss and layout.dp > 1:
            dist.all_reduce(totals, group=layout.dp_group)
        return self._gathered(split, totals, predictions, with_loss)

    def _scored_units(self, split: TokenizedSplit, reference: PairReference | None) -> dict:
        """Held-out pairs: eval_loss (the mean pair loss) and the objective's metrics (TRL's rewards/*, logps/*,
        ...): the sums of the statistics of every counted chunk's call, over the pairs."""
        layout, runner, objective, tokenizer = self.layout, self.runner, self.objective, self.data.tokenizer
        padding = Padding(tokenizer.pad_token_id, tokenizer.padding_side, runner.pad_multiple, layout.device)
        score_prompts = getattr(objective, "scores_prompts", False)  # ORPO's NLL over the chosen prompts too
        batcher = make_batcher(self.task.kind.batcher, split, padding, None, reference, score_prompts=score_prompts)
        totals = objective.sums([], layout.device)
        with self._eval_mode():
            # ORPO's NLL: a token mean over every held-out pair; KTO's KL estimate of the held-out rows (eval mode)
            objective.share_of(split, range(len(split)))
            for chunk, counts in self._chunks(split):
                _, stats = runner.loss(batcher.batch(chunk))  # {} on a pipeline stage that is not the last
                if counts:
                    totals += objective.sums([stats], layout.device)
        if layout.dp > 1:
            dist.all_reduce(totals, group=layout.dp_group)
        if layout.pp > 1:  # the last stage scored every pair
            dist.broadcast(totals, group=layout.pp_group, group_src=layout.pp - 1)
        metrics = objective.metrics(totals)
        return {"eval_loss": metrics.pop("loss"), **metrics}

    def _gathered(self, split: TokenizedSplit, totals: torch.Tensor, predictions: list, with_loss: bool):
        """Every rank's sums and predictions, on every rank."""
        layout = self.layout
        classifies = self.task.head is HeadKind.CLASSIFICATION
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
        assert len(by_row) == len(split), "every row is predicted exactly once"
        return mean_loss, [by_row[i] for i in range(len(split))]


def write_predictions(path: Path, index: list[int], predicted: list, task: Task) -> Path:
    """GLUE's submission format: a header `index<TAB>prediction`, then one row per test row, the prediction as
    the data writes its labels (GLUE's 0/1 or entailment names; a user's label names) or, for regression, the
    value with three decimals."""
    lines = ["index\tprediction"]
    for row, value in zip(index, predicted):
        lines.append(f"{row}\t{task.prediction_text(value)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def prediction_files(task: Task) -> dict[str, str]:
    """The file each test split's predictions go to: predictions.tsv (and predictions_mismatched.tsv, MNLI)."""
    return {
        split: "predictions.tsv" if split == "test" else f"predictions_{split.removeprefix('test_')}.tsv"
        for split in task.test_splits
    }
