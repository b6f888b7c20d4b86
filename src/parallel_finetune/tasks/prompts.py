"""Prompt rows (task=grpo) in TRL's formats: a `prompt` column (or prompt_column), each cell a text or a list of
messages ({role, content}) that ends with the turn the model answers (a user's, never an assistant's); every other
column of the row (`answer`, `solution`, ...) is kept for the reward functions, which receive it per completion
(TRL's **kwargs). A CSV or TSV cell holding a list is JSON text, read as one when it begins with `[{`
(conversations.holds_messages), as for the other kinds.

Each row becomes: `prompt` (JSON text of the text or the messages), `columns` (JSON text of the other columns'
values), `where` (file:line, for the errors found when it is rendered) and `index`. A bad row is one line naming
its place: a missing or empty prompt, a prompt ending with an assistant turn, rows mixing text and messages; a
split without a column the training split has (the rewards would read it nowhere) is refused too.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from ..errors import UserError
from .conversations import holds_messages, read_messages
from .files import Table, check_text
from .task import Task

if TYPE_CHECKING:  # the section's type only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection

log = logging.getLogger(__name__)

FORMAT = "prompts"  # the Task's name


def define_prompt_task(train: Table, *, data: DataSection) -> Task:
    """The Task of prompt rows: the prompt column, then every other column of the training table (what the
    reward functions read)."""
    prompt = data.prompt_column or "prompt"
    if prompt not in train.columns:
        key = "prompt_column" if data.prompt_column else "column"
        raise UserError(
            f"{train.where}: task=grpo needs a {key} {prompt!r} of prompts (texts or lists of messages; name yours "
            f"with prompt_column) (found: {', '.join(train.columns) or 'no column'})"
        )
    others = tuple(name for name in train.columns if name != prompt)
    return Task.prompts(FORMAT, (prompt, *others))


def _prompt(table: Table, row: int, column: str) -> str | list[dict]:
    value = table.columns[column][row]
    empty = not value.strip() if isinstance(value, str) else isinstance(value, (list, tuple)) and not value
    if value is None or empty:
        raise UserError(f"{table.at(row)}: column {column!r} is empty; it holds the prompt (a text or messages)")
    if not holds_messages(table, value):
        if not isinstance(value, str):
            raise UserError(f"{table.at(row)}: column {column!r} holds a {type(value).__name__}, not text or messages")
        check_text(table, row, value)
        return value
    messages, _ = read_messages(table, row, column, value, needs_answer=False)
    if messages[-1]["role"] == "assistant":
        raise UserError(
            f"{table.at(row)}: the prompt ends with an assistant turn; a prompt ends with the turn the model answers "
            "(leave the answer out: the run samples it)"
        )
    return messages


def _plain(value):
    """A cell as JSON can hold it (a Parquet or `datasets` value may be a numpy scalar or array)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def prompt_rows(table: Table, split: str, form: str, columns: tuple[str, ...]) -> dict[str, list]:
    """`table`'s prompts as the columns data/prompts.py reads: `prompt`, `columns` (JSON texts), `where`, `index`."""
    prompt, others = columns[0], columns[1:]
    missing = [name for name in columns if name not in table.columns]
    if missing:
        raise UserError(
            f"{table.where}: no column {', '.join(missing)} (the training split has it, and the reward functions "
            f"read every column; found: {', '.join(table.columns) or 'none'})"
        )
    rows: dict[str, list] = {"prompt": [], "columns": [], "where": [], "index": []}
    conversational = None
    for row in range(len(table)):
        value = _prompt(table, row, prompt)
        kind = not isinstance(value, str)
        if conversational is not None and kind != conversational:
            raise UserError(
                f"{table.at(row)}: this prompt is {'messages' if kind else 'text'}, earlier ones are "
                f"{'messages' if conversational else 'text'}; a split's prompts are one kind"
            )
        conversational = kind
        rows["prompt"].append(json.dumps(value, ensure_ascii=False))
        extra = {name: _plain(table.columns[name][row]) for name in others}
        rows["columns"].append(json.dumps(extra, ensure_ascii=False, default=str))
        rows["where"].append(table.at(row))
        rows["index"].append(row)
    if not rows["index"]:
        raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
    if split == "train":
        log.info(
            "task=grpo: %s: %d prompts of %s (the rewards read %s)",
            table.where,
            len(rows["index"]),
            "messages (rendered by the chat template)" if conversational else "text",
            ", ".join(others) or "no other column",
        )
    return rows
