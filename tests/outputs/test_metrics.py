"""The metric modules (metrics/): every GLUE task and the two user-data metrics give exactly what scikit-learn and
scipy give when called directly, under the keys metric_keys promises; bad names fail clearly; nan, not a warning,
where a correlation is undefined."""

import math
import warnings
from pathlib import Path

import evaluate
import pytest
from scipy import stats
from sklearn import metrics as sk

from parallel_finetune import metrics
from parallel_finetune.errors import UserError
from parallel_finetune.metrics import compute_metrics, load_metric, main_metric, metric_keys

BINARY_REFS = [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]
BINARY_PREDS = [1, 0, 0, 1, 1, 1, 0, 1, 1, 0]
THREE_CLASS_REFS = [0, 1, 2, 2, 1, 0, 2, 1, 0, 2]
THREE_CLASS_PREDS = [0, 2, 2, 1, 1, 0, 2, 0, 0, 2]
FIVE_CLASS_REFS = [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 3]  # class 4 is never predicted
FIVE_CLASS_PREDS = [0, 1, 2, 3, 3, 0, 3, 1, 1, 0, 2]
# exact in float32 (stsb's feature type), with ties on both sides and a negative correlation
SCORE_REFS = [0.5, 1.25, 2.0, 2.0, 3.5, 4.75, 5.0]
SCORE_PREDS = [4.5, 3.0, 3.0, 2.25, 1.5, 0.75, 1.0]


def expected_glue(task, preds, refs):
    if task == "cola":
        return {"matthews_correlation": sk.matthews_corrcoef(refs, preds)}
    if task == "stsb":
        return {"pearson": stats.pearsonr(preds, refs)[0], "spearmanr": stats.spearmanr(preds, refs)[0]}
    if task in ("mrpc", "qqp"):
        return {"accuracy": sk.accuracy_score(refs, preds), "f1": sk.f1_score(refs, preds)}
    return {"accuracy": sk.accuracy_score(refs, preds)}


@pytest.mark.parametrize("task", ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"])
def test_glue_tasks_match_sklearn_and_scipy(task):
    cases = {"stsb": [(SCORE_PREDS, SCORE_REFS)], "mnli": [(THREE_CLASS_PREDS, THREE_CLASS_REFS)]}
    for preds, refs in cases.get(task, [(BINARY_PREDS, BINARY_REFS), (BINARY_REFS, BINARY_REFS)]):
        result = compute_metrics(task, preds, refs)
        expected = expected_glue(task, preds, refs)
        assert list(result) == list(metric_keys(task)) and set(result) == set(expected)
        assert all(type(value) is float for value in result.values())
        assert result == {key: pytest.approx(value, abs=1e-12) for key, value in expected.items()}
        assert main_metric(task) in result


def test_classification_binary_f1_and_multiclass_macro_f1():
    binary = compute_metrics("classification", BINARY_PREDS, BINARY_REFS, num_labels=2)
    assert binary == {
        "accuracy": pytest.approx(sk.accuracy_score(BINARY_REFS, BINARY_PREDS), abs=1e-12),
        "f1": pytest.approx(sk.f1_score(BINARY_REFS, BINARY_PREDS, pos_label=1), abs=1e-12),
    }
    for preds, refs, num_labels in [(THREE_CLASS_PREDS, THREE_CLASS_REFS, 3), (FIVE_CLASS_PREDS, FIVE_CLASS_REFS, 5)]:
        result = compute_metrics("classification", preds, refs, num_labels=num_labels)
        assert result == {
            "accuracy": pytest.approx(sk.accuracy_score(refs, preds), abs=1e-12),
            "macro_f1": pytest.approx(sk.f1_score(refs, preds, average="macro", zero_division=0.0), abs=1e-12),
        }
        assert list(result) == list(metric_keys("classification", num_labels))
    assert main_metric("classification", 2) == main_metric("classification", 7) == "accuracy"
    accuracy = load_metric("accuracy").compute(predictions=THREE_CLASS_PREDS, references=THREE_CLASS_REFS)
    assert accuracy == {"accuracy": pytest.approx(sk.accuracy_score(THREE_CLASS_REFS, THREE_CLASS_PREDS), abs=1e-12)}
    with pytest.raises(ValueError, match="num_labels=None"):
        compute_metrics("classification", BINARY_PREDS, BINARY_REFS)


def test_regression_matches_sklearn_and_scipy():
    result = compute_metrics("regression", SCORE_PREDS, SCORE_REFS)
    assert result == {
        "mse": pytest.approx(sk.mean_squared_error(SCORE_REFS, SCORE_PREDS), abs=1e-12),
        "pearson": pytest.approx(stats.pearsonr(SCORE_PREDS, SCORE_REFS)[0], abs=1e-12),
        "spearmanr": pytest.approx(stats.spearmanr(SCORE_PREDS, SCORE_REFS)[0], abs=1e-12),
    }
    assert result["pearson"] < 0 and list(result) == list(metric_keys("regression"))
    assert main_metric("regression") == main_metric("stsb") == "pearson"
    # float64 features: values that float32 would round still match exactly
    refs, preds = [0.1, 0.2, 0.35, 0.7], [0.15, 0.1, 0.4, 0.9]
    assert compute_metrics("regression", preds, refs)["mse"] == pytest.approx(
        sk.mean_squared_error(refs, preds), abs=1e-12
    )


def test_constant_predictions_give_nan_correlations_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for metric in ("regression", "stsb"):
            result = compute_metrics(metric, [2.5] * len(SCORE_REFS), SCORE_REFS)
            assert math.isnan(result["pearson"]) and math.isnan(result["spearmanr"])
        assert compute_metrics("regression", [2.5] * 4, [1.0, 2.0, 3.0, 4.0])["mse"] == pytest.approx(1.25, abs=1e-12)
        # nothing predicted positive: F1 is 0, as sklearn defines it, without its warning either
        assert compute_metrics("mrpc", [0, 0, 0], [1, 0, 1])["f1"] == 0.0


def test_unknown_metric_names_are_refused_with_the_valid_ones():
    with pytest.raises(UserError, match="unknown metric 'mnli-mm'.*cola, sst2.*wnli.*classification or regression"):
        compute_metrics("mnli-mm", [0], [0])
    with pytest.raises(UserError, match="unknown metric 'f1'"):
        main_metric("f1")
    with pytest.raises(ValueError, match="unknown GLUE task 'sst-2': valid are cola, sst2, mrpc, qqp, stsb"):
        evaluate.load(str(Path(metrics.__file__).parent / "glue.py"), "sst-2")
