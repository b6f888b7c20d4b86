"""task: classification: a sequence-classification head over one text or a pair, trained on class ids, or on
real-valued targets (problem_type regression: one output, squared error)."""

from __future__ import annotations

from . import register
from .base import HeadKind, TaskKind

REGRESSION = "regression"
CLASSIFICATION = "single_label_classification"


class Classification(TaskKind):
    key = "classification"
    problem_types = (CLASSIFICATION, REGRESSION)
    head = HeadKind.CLASSIFICATION

    def regression(self, problem_type: str) -> bool:
        return problem_type == REGRESSION

    def named_labels(self, problem_type: str) -> bool:
        return problem_type == CLASSIFICATION


register(Classification())
