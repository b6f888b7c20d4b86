"""Classification metrics for a user's data set with any number of classes, as an `evaluate` metric module.

`compute(predictions=..., references=..., num_labels=N)`: the number of classes is the model's (its label count),
given at compute time rather than read off the labels, since one evaluation set may lack a class. It picks the F1:

    num_labels == 2    accuracy, f1        binary F1, positive class = label 1
    num_labels > 2     accuracy, macro_f1  unweighted mean of the per-class F1 over the classes that occur
                                           in the predictions or the references (scikit-learn's average="macro")
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score, f1_score


def classification_keys(num_labels: int) -> tuple[str, ...]:
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 2:
        raise ValueError(f"num_labels={num_labels!r}: a classification metric needs a whole number of classes >= 2")
    return ("accuracy", "f1") if num_labels == 2 else ("accuracy", "macro_f1")


_DESCRIPTION = "Accuracy and F1 (binary for two classes, macro-averaged for more) of class-id predictions."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted class ids.
    references (list of int): true class ids.
    num_labels (int): the number of classes (>= 2).
Returns:
    accuracy (float): correct / total.
    f1 (float, two classes): F1 of class 1.
    macro_f1 (float, more classes): mean of the per-class F1.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Classification(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, num_labels=None):
        f1_key = classification_keys(num_labels)[1]
        # zero_division=0.0: the value sklearn gives anyway for a class never predicted, without its warning
        average = "binary" if f1_key == "f1" else "macro"
        return {
            "accuracy": float(accuracy_score(references, predictions)),
            f1_key: float(f1_score(references, predictions, average=average, zero_division=0.0)),
        }
