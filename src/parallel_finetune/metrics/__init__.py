"""Evaluation metrics, loadable offline through `evaluate`: each is a metric module in this folder, loaded by path
(`evaluate.load("glue")` and the like need the Hub).

    metric            module             keys (main one first)
    a GLUE task name  glue.py (config)   glue.GLUE_KEYS: cola matthews_correlation; mrpc, qqp accuracy, f1;
                                         stsb pearson, spearmanr; sst2, mnli, qnli, rte, wnli accuracy
    "classification"  classification.py  accuracy, f1 (num_labels == 2) or accuracy, macro_f1 (num_labels > 2)
    "regression"      regression.py      pearson, spearmanr, mse

`compute_metrics` is the one entry point; `metric_keys` and `main_metric` say what it returns before it runs.
"""

from functools import cache
from pathlib import Path

import evaluate

from ..errors import UserError
from .classification import classification_keys
from .glue import GLUE_KEYS

USER_METRICS = ("classification", "regression")


@cache
def load_metric(name: str, config_name: str | None = None) -> evaluate.EvaluationModule:
    # keep_in_memory: no cache file and lock per compute, which every data-parallel rank would otherwise contend for
    return evaluate.load(str(Path(__file__).resolve().parent / f"{name}.py"), config_name, keep_in_memory=True)


def _check_name(metric: str) -> None:
    if metric not in GLUE_KEYS and metric not in USER_METRICS:
        raise UserError(
            f"unknown metric {metric!r}: valid are the GLUE tasks {', '.join(GLUE_KEYS)}, or "
            f"{' or '.join(USER_METRICS)} for your own data"
        )


def metric_keys(metric: str, num_labels: int | None = None) -> tuple[str, ...]:
    """The keys `compute_metrics(metric, ..., num_labels)` returns, the main one first."""
    _check_name(metric)
    if metric == "classification":
        return classification_keys(num_labels)
    if metric == "regression":
        return ("pearson", "spearmanr", "mse")
    return GLUE_KEYS[metric]


def main_metric(metric: str, num_labels: int | None = None) -> str:
    """The one figure to show first: matthews_correlation (cola), pearson (stsb, regression), else accuracy."""
    return metric_keys(metric, num_labels)[0]


def compute_metrics(
    metric: str, predictions: list, references: list, num_labels: int | None = None
) -> dict[str, float]:
    """`metric` (a GLUE task name, "classification" or "regression") of `predictions` against `references`:
    class ids (int), or real values for stsb and regression. `num_labels` (>= 2) is needed for "classification"
    only. Keys as `metric_keys`, values plain floats (nan where a correlation is undefined)."""
    keys = metric_keys(metric, num_labels)
    if metric == "classification":
        result = load_metric(metric).compute(predictions=predictions, references=references, num_labels=num_labels)
    elif metric == "regression":
        result = load_metric(metric).compute(predictions=predictions, references=references)
    else:
        result = load_metric("glue", metric).compute(predictions=predictions, references=references)
    return {key: float(result[key]) for key in keys}
