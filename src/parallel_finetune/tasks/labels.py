"""Labels as the data writes them, read into what the model trains on: numbers (CSV cells are text), whole numbers
(`1`, `01`, `1.0`: one class id), a finite check on every cell, the problem type the labels imply (classes or a
regression), a user's sorted distinct labels, and each row's target (a class id or a float).
"""

from __future__ import annotations

import logging
import math

from ..errors import UserError
from .files import Table
from .glue import TASKS
from .task import CLASSIFICATION, REGRESSION, Task

log = logging.getLogger(__name__)


def as_number(value):
    """A label cell as a number if it is one (CSV cells are text): int, float, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return None
    return None


def as_whole(number) -> int | None:
    """A number without a fraction as an int (`1`, `1.0`, `01`: class id 1), else None."""
    if isinstance(number, int):
        return number
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return None


def is_missing(value) -> bool:
    """No label: an empty cell, a JSON or Parquet null. (A NaN is a value, and refused as not finite.)"""
    return value is None or (isinstance(value, str) and not value.strip())


def label_text(value) -> str:
    return value.strip() if isinstance(value, str) else str(value)


def check_label(table: Table, row: int, label: str, value) -> None:
    """One line for a label cell that is no label: empty, a nested value (a JSON list or object, a Parquet list), or
    a number that is not finite (`nan`, `inf`: a NaN target makes every gradient it touches NaN, and a NaN among
    0/1 labels would make the task a regression)."""
    if is_missing(value):
        raise UserError(f"{table.at(row)}: no label in column {label!r}; every labelled row needs one")
    if isinstance(value, (list, tuple, dict)):  # a JSON array or object, a Parquet list or struct
        kind = "a list" if isinstance(value, (list, tuple)) else "a mapping"
        raise UserError(
            f"{table.at(row)}: label {shown(value)} in column {label!r} is {kind}; a label is one value: a class "
            "name, a class id or a regression target"
        )
    number = as_number(value)
    if isinstance(number, float) and not math.isfinite(number):
        raise UserError(
            f"{table.at(row)}: label {shown(value)} in column {label!r} is not a finite number; a label is a class "
            "name, a class id or a finite regression target (drop or fill the row)"
        )


def shown(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def infer_problem_type(table: Table, label: str, *, problem_type: str) -> str:
    """`problem_type` (the recipe's) unless auto; else regression when every training label is a number and one
    of them has a fraction; whole numbers (`1`, `1.0`: pandas writes a 0/1 column with a missing value as floats)
    are class ids. Says which in the log, and why."""
    if problem_type != "auto":
        return problem_type
    values = table.columns[label]
    numbers = [as_number(v) for v in values]
    if any(n is None for n in numbers):
        commas = [as_number(v.replace(",", ".")) if isinstance(v, str) else n for v, n in zip(values, numbers)]
        if all(n is not None for n in commas):  # a ';'-separated CSV's decimal commas: numbers, not class names
            row = next(row for row, n in enumerate(numbers) if n is None)
            raise UserError(
                f"{table.at(row)}: label {values[row]!r} in column {label!r} is a number with a decimal comma; write "
                f"{values[row].replace(',', '.').strip()}, or give problem_type=single_label_classification for "
                "class names"
            )
        log.info("%s: labels in column %r are text: classes", table.where, label)
        return CLASSIFICATION
    fraction = next((row for row, n in enumerate(numbers) if as_whole(n) is None), None)
    if fraction is not None:
        log.info(
            "%s: labels in column %r are numbers, %s (%s) with a fraction: a regression "
            "(problem_type=single_label_classification makes them classes)",
            table.where,
            label,
            table.columns[label][fraction],
            table.at(fraction),
        )
        return REGRESSION
    log.info(
        "%s: labels in column %r are whole numbers: class ids (problem_type=regression makes them regression targets)",
        table.where,
        label,
    )
    return CLASSIFICATION


def user_labels(train: Table, label: str, *, num_labels: int | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names, values) by id: the sorted distinct training labels (whole numbers as numbers: `1`, `01` and `1.0`
    are one label, `1`), or ids 0..num_labels-1 when num_labels is given and the labels are those ids."""
    values = train.columns[label]
    wholes = [as_whole(as_number(v)) for v in values]
    if all(n is not None for n in wholes):
        distinct = sorted(set(wholes))
        if num_labels:
            bad = next((i for i, n in enumerate(wholes) if not 0 <= n < num_labels), None)
            if bad is not None:
                raise UserError(f"{train.at(bad)}: label {wholes[bad]} is not an id below num_labels={num_labels}")
            distinct = list(range(num_labels))
        texts = tuple(str(n) for n in distinct)
        return texts, texts
    distinct = sorted({label_text(v) for v in values})
    if num_labels and num_labels != len(distinct):
        raise UserError(
            f"num_labels={num_labels}, but {train.where} has {len(distinct)} distinct labels "
            f"({', '.join(distinct[:10])}{', ...' if len(distinct) > 10 else ''}); drop num_labels to infer it"
        )
    return tuple(distinct), tuple(distinct)


def label_ids(table: Table, label: str, task: Task, split: str) -> list:
    """Labels as the model's targets: ids (classification) or floats (regression); one line for the first bad row."""
    out = []
    index = {value: i for i, value in enumerate(task.label_values)}
    # A cell already read gives the same target: SST-2's 67,349 cells hold 2 values (checking each cost ~0.3 s at
    # every run's start). Keyed by type too (True == 1); a bad cell raises at its first row, before it is stored.
    known: dict = {}
    for row, value in enumerate(table.columns[label]):
        key = (type(value), value) if isinstance(value, (str, int, float)) else None
        if key is not None and key in known:
            out.append(known[key])
            continue
        target = label_target(table, row, label, value, task, index, split)
        if key is not None:
            known[key] = target
        out.append(target)
    return out


def label_target(table: Table, row: int, label: str, value, task: Task, index: dict, split: str) -> int | float:
    """One cell's target, checked: a class id, or a regression target's float."""
    check_label(table, row, label, value)
    if task.regression:
        number = as_number(value)
        if number is None:
            raise UserError(f"{table.at(row)}: regression target {value!r} in column {label!r} is not a number")
        return float(number)
    text = label_text(value)
    if text not in index:
        whole = as_whole(as_number(value))  # 1.0 in a JSON file, or 01, where train wrote 1
        text = str(whole) if whole is not None else text
    if text not in index:
        valid = ", ".join(task.label_values[:10]) + (", ..." if len(task.label_values) > 10 else "")
        where = "the training labels" if split != "train" else "the labels"
        raise UserError(f"{table.at(row)}: label {text!r} is not among {where} ({valid}){_other_glue(task, text, row)}")
    return index[text]


def _other_glue(task: Task, value: str, row: int) -> str:
    """For a GLUE task's refused label that suggests another task's files (WNLI's 0/1 read as RTE; a header line
    read as CoLA's first row): the question whether data_dir is the folder of this task."""
    if task.name not in TASKS:
        return ""
    others = [name for name, glue in TASKS.items() if name != task.name and value in glue.values]
    if others:
        return f"; is data_dir the {task.name} folder? ({value!r} is a label of GLUE {', '.join(others)})"
    if row == 0 and TASKS[task.name].headerless:
        return f"; is data_dir the {task.name} folder? (its first line reads like a header, which {task.name} lacks)"
    return ""
