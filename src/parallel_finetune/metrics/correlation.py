"""Pearson and Spearman correlation (scipy) for the metric modules here (glue.py's stsb, regression.py).

A correlation is undefined when either side is constant (or has fewer than two values), as a regression head's
first evaluations can be: scipy then warns and returns nan. The figure is reported as nan, without the warning.
"""

import warnings

from scipy import stats


def pearson_spearman(predictions, references) -> dict[str, float]:
    if len(predictions) < 2:
        return {"pearson": float("nan"), "spearmanr": float("nan")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.ConstantInputWarning)
        return {
            "pearson": float(stats.pearsonr(predictions, references)[0]),
            "spearmanr": float(stats.spearmanr(predictions, references)[0]),
        }
