"""Accuracy as an `evaluate` metric module, shipped here because `evaluate.load("accuracy")` needs the Hub."""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their reference label."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): true labels.
Returns:
    accuracy (float): correct / total, in [0, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references):
        return {"accuracy": float(accuracy_score(references, predictions))}
