"""Evaluation metrics, loadable offline through `evaluate`."""

from functools import cache
from pathlib import Path

import evaluate


@cache
def load_metric(name: str) -> evaluate.EvaluationModule:
    return evaluate.load(str(Path(__file__).resolve().parent / f"{name}.py"))
