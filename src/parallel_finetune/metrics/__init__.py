"""Evaluation metrics, loadable offline through `evaluate`."""

from functools import lru_cache
from pathlib import Path

import evaluate


@lru_cache(maxsize=None)
def load_metric(name: str) -> evaluate.EvaluationModule:
    return evaluate.load(str(Path(__file__).resolve().parent / f"{name}.py"))
