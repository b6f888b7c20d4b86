"""Reward-modelling rows (task=reward): task=dpo's preference pairs (preferences.py: explicit or implicit prompt,
texts or messages, TRL's formats), and, as TRL's RewardTrainer reads them, an optional `margin` column: per pair
the number the chosen answer's score must exceed the rejected one's by (the loss is -log sigmoid(r_chosen -
r_rejected - margin)). A margin is a number (in a CSV or TSV cell, its text); anything else, or an empty cell, is
one line naming the row. The training split decides: with a margin column there, every split needs one; without
one, no split may have one (it would be read nowhere).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import UserError
from .files import Table
from .preferences import detect_preference_format, preference_rows
from .task import Task

if TYPE_CHECKING:  # the section's type only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection

MARGIN = "margin"  # TRL's column name


def define_reward_task(train: Table, *, data: DataSection) -> Task:
    """The Task of reward-modelling rows: the pair format found from the training table's columns, and `margin`
    last among the columns when the training table has one."""
    form, columns = detect_preference_format(train, data=data, task_key="reward")
    return Task.reward_model(form, columns + ((MARGIN,) if MARGIN in train.columns else ()))


def _margin(table: Table, row: int, value) -> float:
    """A margin cell as a number, or one line naming its row."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and value.strip():
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise UserError(
            f"{table.at(row)}: column {MARGIN!r} holds {value!r}, not a number; a margin is a finite number (how far "
            "the chosen answer's score must exceed the rejected one's, e.g. 0.5), or leave the column out"
        )
    return number


def reward_rows(table: Table, split: str, form: str, columns: tuple[str, ...]) -> dict[str, list]:
    """`table`'s pairs as preference_rows gives them, plus `margin` (a float per pair) when the task has one."""
    margins = columns[-1:] == (MARGIN,)
    pairs = columns[:-1] if margins else columns
    if margins and MARGIN not in table.columns:
        raise UserError(
            f"{table.where}: no column {MARGIN!r}; the training split has one, so every split needs a margin per pair"
        )
    if not margins and MARGIN in table.columns:
        raise UserError(
            f"{table.where}: column {MARGIN!r} is here but not in the training split, where the run would read none; "
            "give every split a margin, or none"
        )
    rows = preference_rows(table, split, form, pairs, task_key="reward")
    if margins:
        rows[MARGIN] = [_margin(table, row, table.columns[MARGIN][row]) for row in rows["index"]]
    return rows
