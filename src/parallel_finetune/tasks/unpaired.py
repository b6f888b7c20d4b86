"""KTO's rows (task=kto) in TRL's formats, found from the columns:

- unpaired (TRL's unpaired preference format): `prompt`, `completion` and a boolean `label` (true: a desirable
  completion, false: an undesirable one); prompt and completion each a text, or a list of messages (the prompt's
  turns, then the completion's assistant turn(s));
- dpo's pairs (preferences.py: explicit or implicit prompt, texts or messages), unpaired as TRL's
  `unpair_preference_dataset` does: per block of 1,000 pairs, every chosen answer (label true), then every
  rejected one (label false), each with its pair's prompt.

Each row becomes `prompt`, `completion` (JSON texts the data stage renders, data/kto.py), `label`, `where`
(file:line, for its errors) and `index`. A label is a boolean (in a CSV or TSV cell, the text true or false, in
any case); anything else is one line naming the row. A split whose rows are all desirable or all undesirable is
refused: KTO's held-out margins and its loss's balance need both.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..errors import UserError
from .files import Table
from .preferences import KINDS, answer_cell, check_answer, detect_preference_format, preference_rows
from .task import Task

if TYPE_CHECKING:  # the section's type only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection

log = logging.getLogger(__name__)

UNPAIRED = "unpaired"  # the Task's name (the rows' format) for prompt, completion, label rows
UNPAIR_BLOCK = 1000  # datasets' map batch size, over which TRL's unpair_preference_dataset puts chosen first


def define_kto_task(train: Table, *, data: DataSection) -> Task:
    """The Task of KTO rows: unpaired (a completion column) or dpo's pairs, found from the training table's
    columns (prompt, completion and label; or dpo's pair columns)."""
    completion = data.completion_column or "completion"
    if completion in train.columns:
        prompt = data.prompt_column or "prompt"
        missing = [name for name in (prompt, data.label_column) if name not in train.columns]
        if missing:
            raise UserError(
                f"{train.where}: task=kto's unpaired rows need columns prompt, completion and label (a boolean); no "
                f"column {' or '.join(missing)} (found: {', '.join(train.columns)}); name yours with prompt_column, "
                "completion_column and label_column"
            )
        return Task.kto(UNPAIRED, (prompt, completion, data.label_column))
    if data.completion_column is not None:
        raise UserError(
            f"completion_column={completion!r}: {train.where} has no such column ({', '.join(train.columns)})"
        )
    form, columns = detect_preference_format(train, data=data, task_key="kto")
    return Task.kto(form, columns)


def _label(table: Table, row: int, column: str) -> bool:
    value = table.columns[column][row]
    if isinstance(value, bool):
        return value
    if table.text_cells and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise UserError(
        f"{table.at(row)}: column {column!r} holds {value!r}, not a boolean; a KTO label is true (a desirable "
        "completion) or false (an undesirable one)"
    )


def _unpaired_row(table: Table, row: int, columns: tuple[str, ...]) -> tuple:
    """(prompt, completion, label) of one unpaired row, checked as dpo checks a pair's prompt and answers."""
    where = table.at(row)
    (prompt, _), (completion, untrained) = (
        answer_cell(table, row, c, needs_answer=i > 0) for i, c in enumerate(columns[:2])
    )
    if isinstance(prompt, str) != isinstance(completion, str):
        raise UserError(f"{where}: the prompt and the completion mix a text and a list of messages; give both one kind")
    check_answer(where, "completion", completion, untrained, task_key="kto")
    if not isinstance(prompt, str) and prompt[-1]["role"] == "assistant":
        raise UserError(f"{where}: the prompt ends with an assistant turn; a completion follows the turn it answers")
    return prompt, completion, _label(table, row, columns[2])


def _unpaired_of_pairs(pairs: dict[str, list]) -> dict[str, list]:
    """TRL's unpair_preference_dataset: per block of UNPAIR_BLOCK pairs, the chosen rows, then the rejected ones."""
    rows: dict[str, list] = {"prompt": [], "completion": [], "label": [], "where": []}
    for start in range(0, len(pairs["index"]), UNPAIR_BLOCK):
        block = range(start, min(start + UNPAIR_BLOCK, len(pairs["index"])))
        for side, label in (("chosen", True), ("rejected", False)):
            for p in block:
                rows["prompt"].append(pairs["prompt"][p])
                rows["completion"].append(pairs[side][p])
                rows["label"].append(label)
                rows["where"].append(pairs["where"][p])
    return rows


def kto_rows(table: Table, split: str, form: str, columns: tuple[str, ...]) -> dict[str, list]:
    """`table`'s rows as the columns data/kto.py reads: `prompt`, `completion` (JSON texts), `label` (bool),
    `where` (the row's place) and `index` (the row's number among the split's unpaired rows)."""
    if form != UNPAIRED:
        rows = _unpaired_of_pairs(preference_rows(table, split, form, columns, task_key="kto"))
    else:
        missing = [name for name in columns if name not in table.columns]
        if missing:
            raise UserError(
                f"{table.where}: no column {', '.join(missing)} (prompt, completion and label, as in the train split)"
            )
        rows = {"prompt": [], "completion": [], "label": [], "where": []}
        kinds = set()
        for row in range(len(table)):
            prompt, completion, label = _unpaired_row(table, row, columns)
            kind = not isinstance(completion, str)
            if kinds and kind not in kinds:
                what = "messages" if kind else "text"
                raise UserError(f"{table.at(row)}: this row is {what}, earlier ones are not; a split's rows are 1 kind")
            kinds.add(kind)
            rows["prompt"].append(json.dumps(prompt, ensure_ascii=False))
            rows["completion"].append(json.dumps(completion, ensure_ascii=False))
            rows["label"].append(label)
            rows["where"].append(table.at(row))
        if not rows["where"]:
            raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
        if split == "train":
            log.info(
                "task=kto: %s: %d rows of %s (columns %s)",
                table.where,
                len(rows["where"]),
                KINDS[kind],
                ", ".join(columns),
            )
    rows["index"] = list(range(len(rows["where"])))
    desirable = sum(rows["label"])
    if desirable in (0, len(rows["label"])):
        which = "desirable (label true)" if desirable else "undesirable (label false)"
        raise UserError(
            f"{table.where}: every one of the {split} split's {len(rows['label'])} rows is {which}; KTO needs "
            "desirable and undesirable rows in each split (its loss weighs one against the other, its held-out "
            "margins compare them)"
        )
    return rows
