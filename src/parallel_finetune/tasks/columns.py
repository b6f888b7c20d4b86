"""Which columns of the sources hold the texts and the label, the Task they define, and each split as the columns
the model side reads: `text`[, `text_pair`][, `label`], `index`. A user's labels are the sorted distinct training
labels (as transformers' run_glue.py does), whole numbers sorted as numbers; labels that are numbers, one of them
with a fraction (or `problem_type: regression`), make a regression task (labels.py reads them).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from ..errors import UserError
from .files import Table, check_text
from .glue import GlueTask
from .kinds import kind_of_problem
from .labels import check_label, infer_problem_type, label_ids, shown, user_labels
from .sources import Source, carved_fingerprint
from .task import REGRESSION, HeadKind, Task

if TYPE_CHECKING:  # the sections' types only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection, ModelSection

log = logging.getLogger(__name__)

TEXT_COLUMNS = ("sentence", "text", "sentence1")  # what text_column means when not given, first present
PAIR_OF = {"sentence1": "sentence2"}  # a text column whose partner is the pair when text_pair_column is not given


def _separator_hint(table: Table) -> str:
    """For a file read as one column whose name holds another separator: which one it seems to use."""
    if len(table.columns) != 1:
        return ""
    name = next(iter(table.columns))
    found = [said for separator, said in ((";", "';'"), ("\t", "a tab"), (",", "','")) if separator in name]
    return f"; the header is one column: is the file separated by {found[0]}?" if found else ""


def _column(table: Table, key: str, name: str | None, needed_for: str) -> str:
    if name is not None and name not in table.columns:
        raise UserError(
            f"{key}={name!r}: {table.where} has no such column ({', '.join(table.columns) or 'none'}){needed_for}"
            f"{_separator_hint(table)}"
        )
    return name


def _user_columns(train: Table, head: HeadKind, *, data: DataSection) -> tuple[str, str | None, str | None]:
    text = data.text_column
    if text is None:
        text = next((name for name in TEXT_COLUMNS if name in train.columns), None)
        if text is None:
            chat = [name for name in ("messages", "conversations", "prompt", "completion") if name in train.columns]
            hint = f" (its {', '.join(chat)} column(s) are chat rows: task=sft trains on them)" if chat else ""
            raise UserError(
                f"{train.where}: no text column named {', '.join(TEXT_COLUMNS)}; set text_column= one of "
                f"{', '.join(train.columns)}{hint}{_separator_hint(train)}"
            )
    _column(train, "text_column", text, "")
    pair = data.text_pair_column
    if pair is None and text in PAIR_OF and PAIR_OF[text] in train.columns:
        pair = PAIR_OF[text]
    _column(train, "text_pair_column", pair, "")
    label = None
    if head is HeadKind.CLASSIFICATION:
        label = data.label_column
        _column(train, "label_column", label, "; set label_column= the column holding the labels")
    used = [(key, name) for key, name in (("text_column", text), ("text_pair_column", pair), ("label_column", label))]
    for number, (key, name) in enumerate(used):
        twin = next((other for other, same in used[:number] if same is not None and same == name), None)
        if twin is not None:
            raise UserError(
                f"{twin}={name!r} and {key}={name!r}: one column for two uses; the text, the text pair and the "
                f"label are different columns of {train.where} ({', '.join(train.columns)})"
            )
    return text, pair, label


def define_task(
    tables: dict[str, Table], glue: GlueTask | None, *, data: DataSection, model: ModelSection
) -> tuple[Task, str, str | None, str | None]:
    """The Task and the (text, pair, label) columns of the sources (`data` names the user's columns). The recipe's
    `task:` key (the head, `model.task`) is read here, once: every later component asks the Task."""
    train = tables["train"]
    if not len(train):
        raise UserError(f"{train.where}: no data rows (the train split is empty)")
    head = HeadKind(model.task)
    tests = tuple(s for s in tables if s.startswith("test"))
    validations = tuple(s for s in tables if s.startswith("validation")) or ("validation",)
    if glue is not None:
        if head is HeadKind.CAUSAL_LM:
            return Task.language_model(glue.name, glue.text, validations[:1]), glue.text, None, None
        task = Task.of_glue(glue, validations, tests)
        if model.num_labels not in (None, task.num_labels):
            raise UserError(f"num_labels={model.num_labels}: GLUE {glue.name} has {task.num_labels}; drop num_labels")
        if model.problem_type not in ("auto", task.problem_type):
            raise UserError(
                f"problem_type={model.problem_type}: GLUE {glue.name} is {task.problem_type}; drop problem_type"
            )
        return task, glue.text, glue.text_pair, glue.label
    text, pair, label = _user_columns(train, head, data=data)
    if head is HeadKind.CAUSAL_LM:
        return Task.language_model("custom", text), text, None, None
    task = _user_task(train, tests, text, pair, label, num_labels=model.num_labels, problem_type=model.problem_type)
    return task, text, pair, label


def _user_task(
    train: Table,
    tests: tuple[str, ...],
    text: str,
    pair: str | None,
    label: str,
    *,
    num_labels: int | None,
    problem_type: str,
) -> Task:
    """A classification head's Task over the user's own rows: classes or a regression, as the labels say (or
    `problem_type`, the recipe's, when not auto; `num_labels`: the recipe's head width, None to infer it)."""
    for row, value in enumerate(train.columns[label]):  # before the labels decide the problem type
        check_label(train, row, label, value)
    problem = infer_problem_type(train, label, problem_type=problem_type)
    regression = kind_of_problem(problem).regression(problem)
    names, values = ((), ()) if regression else user_labels(train, label, num_labels=num_labels)
    if not regression and len(names) < 2:
        raise UserError(
            f"{train.where}: column {label!r} holds one label ({', '.join(names)}); classification needs two or more"
        )
    metric = REGRESSION if regression else "classification"
    columns = (text, *([pair] if pair else []), label)
    return Task("custom", problem, pair is not None, names, values, metric, columns, ("validation",), tests)


def model_rows(table: Table, split: str, task: Task, text: str, pair: str | None, label: str | None) -> dict[str, list]:
    """A table as the columns the model side reads: text[, text_pair][, label], index (the row's position in its
    source, what predictions.tsv names). Rows without text are dropped and counted (a 0-token row has nothing to
    learn from), except in a test split, whose every row gets a prediction."""
    for name, key in ((text, "text_column"), (pair, "text_pair_column")):
        if name is not None and name not in table.columns:
            raise UserError(f"{table.where}: no column {name!r} ({key}; found: {', '.join(table.columns) or 'none'})")
    labelled = label is not None and not split.startswith("test")
    if labelled and label not in table.columns:
        raise UserError(
            f"{table.where}: no label column {label!r} (found: {', '.join(table.columns)}); set label_column="
        )
    keep, empty = [], []
    for row in range(len(table)):
        texts = [table.columns[text][row]] + ([table.columns[pair][row]] if pair else [])
        bad = next((n for n, t in zip((text, pair), texts) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            value = table.columns[bad][row]
            raise UserError(
                f"{table.at(row)}: {shown(value)} in column {bad!r} is a {type(value).__name__}, not text; a text "
                "column holds strings"
            )
        texts = [t or "" for t in texts]  # None (a Parquet or JSON null): no text, as an empty cell
        for t in texts:
            check_text(table, row, t)
        if any(not t.strip() for t in texts) and not split.startswith("test"):
            empty.append(row)
            continue
        keep.append(row)
    if empty:
        lines = [table.at(r).removeprefix(table.where + ":") for r in empty[:5]]
        log.warning(
            "%s: dropped %d row(s) with an empty text (%s%s%s)",
            table.where,
            len(empty),
            "lines " if all(line.isdigit() for line in lines) else "",
            ", ".join(lines),
            ", ..." if len(empty) > 5 else "",
        )
    if not keep:
        raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
    kept = table.take(keep) if len(keep) < len(table) else table
    columns = {"text": [(t or "").strip() for t in kept.columns[text]]}
    if pair:
        columns["text_pair"] = [(t or "").strip() for t in kept.columns[pair]]
    if labelled and task.head is HeadKind.CLASSIFICATION:
        columns["label"] = label_ids(kept, label, task, split)
    columns["index"] = keep
    return columns


def carve_validation(train: Table, percentage: float, seed: int) -> tuple[Table, Table]:
    """A validation split of `percentage` % of the training rows, drawn with `seed`; both keep the file's order."""
    count = round(len(train) * percentage / 100)
    if count < 1 or count >= len(train):
        raise UserError(
            f"validation_split_percentage={percentage:g} of {train.where}'s {len(train)} rows leaves "
            f"{'no validation row' if count < 1 else 'no training row'}; give validation_file= or another percentage"
        )
    held = set(random.Random(seed).sample(range(len(train)), count))
    return train.take([i for i in range(len(train)) if i not in held]), train.take(sorted(held))


def held_out_validation(tables: dict, source: Source, percentage: float, seed: int) -> tuple[dict, Source]:
    """Data without a validation split: `percentage` % of the training rows held out (drawn with `seed`), said in
    one log line; the Source's fingerprint then names the draw, so the tokenized cache follows it."""
    tables = dict(tables)
    tables["train"], tables["validation"] = carve_validation(tables["train"], percentage, seed)
    held, rows = len(tables["validation"]), len(tables["validation"]) + len(tables["train"])
    log.info(
        "no validation split given: %d of %d training rows held out (validation_split_percentage=%g, seed %d)",
        held,
        rows,
        percentage,
        seed,
    )
    carved = carved_fingerprint(source.fingerprint, validation_split_percentage=percentage, seed=seed)
    return tables, Source(source.kind, source.description, carved)
