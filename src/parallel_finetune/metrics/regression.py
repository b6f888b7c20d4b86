"""Regression metrics for a user's data set with a real-valued target, as an `evaluate` metric module:
mean squared error (scikit-learn), Pearson and Spearman correlation (scipy). A correlation is nan where undefined
(constant predictions, as a fresh regression head's may be), without a warning. Values are float64.
"""

import datasets
import evaluate
from sklearn.metrics import mean_squared_error

from .correlation import pearson_spearman

_DESCRIPTION = "Mean squared error, Pearson and Spearman correlation of real-valued predictions."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of float): predicted values.
    references (list of float): true values.
Returns:
    mse (float): mean of the squared differences.
    pearson (float): Pearson correlation, nan if either side is constant.
    spearmanr (float): Spearman rank correlation, nan if either side is constant.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Regression(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references):
        return {"mse": float(mean_squared_error(references, predictions)), **pearson_spearman(predictions, references)}
