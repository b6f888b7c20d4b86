"""The GLUE benchmark's metrics as an `evaluate` metric module, shipped here because `evaluate.load("glue")` needs
the Hub. The config name is the task: the same figures and keys as the Hub's glue metric and GLUE's own scorer
(scikit-learn for Matthews correlation, accuracy and F1; scipy for Pearson and Spearman).

    cola                               matthews_correlation
    mrpc, qqp                          accuracy, f1 (binary, positive class = label 1)
    stsb                               pearson, spearmanr (float predictions and references)
    sst2, mnli, qnli, rte, wnli        accuracy
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from .correlation import pearson_spearman

GLUE_KEYS = {
    "cola": ("matthews_correlation",),
    "sst2": ("accuracy",),
    "mrpc": ("accuracy", "f1"),
    "qqp": ("accuracy", "f1"),
    "stsb": ("pearson", "spearmanr"),
    "mnli": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}

_DESCRIPTION = "GLUE's metric for one task (the config name): " + ", ".join(GLUE_KEYS) + "."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int, list of float for stsb): predicted labels or scores.
    references (list of int, list of float for stsb): true labels or scores.
Returns: by task, matthews_correlation (cola); accuracy and f1 (mrpc, qqp); pearson and spearmanr (stsb);
    accuracy (sst2, mnli, qnli, rte, wnli).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Glue(evaluate.Metric):
    def _info(self):
        if self.config_name not in GLUE_KEYS:
            raise ValueError(f"unknown GLUE task {self.config_name!r}: valid are {', '.join(GLUE_KEYS)}")
        value = datasets.Value("float32" if self.config_name == "stsb" else "int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": value, "references": value}),
        )

    def _compute(self, predictions, references):
        if self.config_name == "cola":
            return {"matthews_correlation": float(matthews_corrcoef(references, predictions))}
        if self.config_name == "stsb":
            return pearson_spearman(predictions, references)
        result = {"accuracy": float(accuracy_score(references, predictions))}
        if self.config_name in ("mrpc", "qqp"):
            # zero_division=0.0: the value sklearn gives anyway when nothing is predicted positive, without its warning
            result["f1"] = float(f1_score(references, predictions, zero_division=0.0))
        return result
