"""Preference rows (task=dpo) in TRL's formats, found from the columns:

- explicit prompt: `prompt`, `chosen`, `rejected`; each a text, or a list of messages ({role, content}; the
  prompt's turns, then each answer's assistant turn(s));
- implicit prompt: `chosen` and `rejected` only, two conversations (or texts) that share their first turns (their
  first characters): the shared part is the prompt, what follows it each answer (TRL's `extract_prompt`).

Each row becomes a pair of JSON texts the data stage renders (data/preference.py): `prompt`, `chosen`,
`rejected` (a text, or a list of messages), with `where` (file:line, for its errors) and `index`. A CSV or TSV
cell holding a list is JSON text, read as one when it begins with `[{` (conversations.holds_messages: a text
prompt `[Q] ...` stays text); in JSON Lines, Parquet and `datasets` a string is text, never parsed. A bad row
is one line naming its place and what is valid: a missing or empty answer, two identical answers, an answer that
ends with a user's or tool's turn (it would be scored as the model's) or holds a turn of `weight` 0 (an answer is
scored whole), implicit rows that share no prompt, rows that mix text and messages.
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

FORMATS = {
    "explicit": "prompt, chosen and rejected (explicit prompt)",
    "implicit": "chosen and rejected sharing their prompt (implicit prompt)",
}
# TRL's two kinds of pair: plain text (its "standard" format, tokenized as it is) or conversations (rendered by
# the chat template); either holds its prompt explicitly or implicitly (FORMATS).
KINDS = {
    False: "text (TRL's standard format, no chat template)",
    True: "messages (TRL's conversational format, rendered by the chat template)",
}
PROMPTS = {"explicit": "explicit prompt", "implicit": "implicit prompt (what both answers begin with)"}
VALID = (
    "columns chosen and rejected (texts or lists of messages) and, unless both hold the prompt too, prompt (or "
    "name yours with prompt_column, chosen_column and rejected_column)"
)


def _column(table: Table, key: str, given: str | None, default: str) -> str | None:
    name = given or default
    if name not in table.columns:
        if given is not None:
            raise UserError(f"{key}={given!r}: {table.where} has no such column ({', '.join(table.columns)})")
        return None
    return name


def detect_preference_format(table: Table, *, data: DataSection, task_key: str = "dpo") -> tuple[str, tuple[str, ...]]:
    """The pair format of `table` (a FORMATS key) and its columns: (prompt,) chosen, rejected. `task_key`: the task
    reading them (dpo, reward), as errors name it."""
    chosen = _column(table, "chosen_column", data.chosen_column, "chosen")
    rejected = _column(table, "rejected_column", data.rejected_column, "rejected")
    prompt = _column(table, "prompt_column", data.prompt_column, "prompt")
    if chosen is None or rejected is None:
        missing = [name for name, found in (("chosen", chosen), ("rejected", rejected)) if found is None]
        raise UserError(
            f"{table.where}: task={task_key} needs {VALID}; no column {' or '.join(missing)} (found: "
            f"{', '.join(table.columns) or 'no column'})"
        )
    if prompt is None:
        return "implicit", (chosen, rejected)
    return "explicit", (prompt, chosen, rejected)


def answer_cell(table: Table, row: int, column: str, needs_answer: bool) -> tuple[str | list[dict], list[int]]:
    """A cell as a text or a list of messages (checked as task=sft checks them), and the indices of its assistant
    turns of `weight` 0 (which an answer may not hold: `_pair`)."""
    value = table.columns[column][row]
    if (
        value is None
        or (isinstance(value, str) and not value.strip())
        or (isinstance(value, (list, tuple)) and not value)
    ):
        what = "an answer" if needs_answer else "the prompt"
        raise UserError(f"{table.at(row)}: column {column!r} is empty; it holds {what} (a text or a list of messages)")
    if not holds_messages(table, value):
        if not isinstance(value, str):
            raise UserError(f"{table.at(row)}: column {column!r} holds a {type(value).__name__}, not text or messages")
        check_text(table, row, value)
        return value, []
    messages, trained = read_messages(table, row, column, value, needs_answer=False)
    return messages, [i for i, (m, t) in enumerate(zip(messages, trained)) if m["role"] == "assistant" and not t]


def _shared_prompt(chosen, rejected):
    """TRL's extract_prompt: the longest shared beginning (whole messages, or characters, then back to before a
    space) and what each answer adds."""
    shared = 0
    for shared in range(min(len(chosen), len(rejected)) + 1):
        if shared == min(len(chosen), len(rejected)) or chosen[shared] != rejected[shared]:
            break
    if isinstance(chosen, str) and shared and chosen[shared - 1] == " ":
        shared -= 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def check_answer(where: str, name: str, answer, untrained: list[int], task_key: str = "dpo") -> None:
    """An answer (a text, or the assistant turn(s) after the prompt) that can be scored whole: not empty, beginning
    and ending with the assistant's turn, no turn of weight 0 (`untrained`: their indices); else one line naming
    `where`. `name`: what the answer is called (chosen, rejected, the completion)."""
    if isinstance(answer, str):
        if not answer.strip():
            raise UserError(f"{where}: the {name} answer is empty (after the prompt they share)")
        return
    if not answer or answer[0]["role"] != "assistant":
        first = answer[0]["role"] if answer else "nothing"
        raise UserError(
            f"{where}: the {name} answer begins with {first!r}, not an assistant turn; an answer is the assistant "
            "turn(s) that follow the prompt"
        )
    if not any(m["content"].strip() or m.get("tool_calls") for m in answer if m["role"] == "assistant"):
        raise UserError(f"{where}: the {name} answer is empty; an answer has text to learn")
    if answer[-1]["role"] != "assistant":
        raise UserError(
            f"{where}: the {name} answer ends with a {answer[-1]['role']!r} turn, which would be scored as the "
            "model's; an answer ends with the assistant's turn (leave out what follows it)"
        )
    if untrained:
        raise UserError(
            f"{where}: the {name} answer's turn {untrained[0] + 1} has weight 0, and task={task_key} scores an "
            "answer whole (a weight leaves a turn untrained under task=sft only); drop the weight, or the turn"
        )


def _pair(table: Table, row: int, form: str, columns: tuple[str, ...]):
    """(prompt, chosen, rejected) of one row, each a text or a list of messages, checked."""
    where = table.at(row)
    if form == "explicit":
        (prompt, _), (chosen, chosen_unweighted), (rejected, rejected_unweighted) = (
            answer_cell(table, row, c, needs_answer=i > 0) for i, c in enumerate(columns)
        )
        untrained = {"chosen": chosen_unweighted, "rejected": rejected_unweighted}
    else:
        (whole_chosen, chosen_unweighted), (whole_rejected, rejected_unweighted) = (
            answer_cell(table, row, c, needs_answer=True) for c in columns
        )
        if isinstance(whole_chosen, str) != isinstance(whole_rejected, str):
            raise UserError(f"{where}: chosen and rejected mix a text and a list of messages; give both one kind")
        prompt, chosen, rejected = _shared_prompt(whole_chosen, whole_rejected)
        shared = len(prompt)  # the prompt's turns: a weight there changes nothing, as under task=sft
        untrained = {
            "chosen": [i - shared for i in chosen_unweighted if i >= shared],
            "rejected": [i - shared for i in rejected_unweighted if i >= shared],
        }
        if not prompt:
            raise UserError(
                f"{where}: chosen and rejected share no first turn (no implicit prompt); give a prompt column, or "
                "write the prompt's turns at the start of both"
            )
    kinds = {isinstance(part, str) for part in (chosen, rejected)}
    if len(kinds) > 1:
        raise UserError(f"{where}: chosen and rejected mix a text and a list of messages; give both one kind")
    if chosen == rejected:
        raise UserError(f"{where}: chosen and rejected are the same answer; a pair needs two different answers")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        check_answer(where, name, answer, untrained[name])
    if not isinstance(prompt, str) and prompt and prompt[-1]["role"] == "assistant":
        raise UserError(
            f"{where}: the prompt ends with an assistant turn; a pair's answers follow the turn they answer"
        )
    return prompt, chosen, rejected


def preference_rows(
    table: Table, split: str, form: str, columns: tuple[str, ...], task_key: str = "dpo"
) -> dict[str, list]:
    """`table`'s pairs as the columns data/preference.py reads: `prompt`, `chosen`, `rejected` (JSON texts),
    `where` (the row's place, for errors found when it is rendered) and `index`; `task_key` (dpo, reward): the
    task reading them, as its log line names it."""
    missing = [name for name in columns if name not in table.columns]
    if missing:
        raise UserError(
            f"{table.where}: no column {', '.join(missing)} ({FORMATS[form]}, as in the train split; found: "
            f"{', '.join(table.columns) or 'none'})"
        )
    rows: dict[str, list] = {"prompt": [], "chosen": [], "rejected": [], "where": [], "index": []}
    conversational = None
    for row in range(len(table)):
        prompt, chosen, rejected = _pair(table, row, form, columns)
        kind = not isinstance(chosen, str)
        if conversational is not None and kind != conversational:
            raise UserError(
                f"{table.at(row)}: this pair is {'messages' if kind else 'text'}, earlier ones are "
                f"{'messages' if conversational else 'text'}; a split's pairs are one kind"
            )
        if isinstance(prompt, str) == kind and prompt:
            raise UserError(f"{table.at(row)}: the prompt and the answers mix a text and a list of messages")
        conversational = kind
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            rows[name].append(json.dumps(value, ensure_ascii=False))
        rows["where"].append(table.at(row))
        rows["index"].append(row)
    if not rows["index"]:
        raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
    if split == "train":  # said once the rows are read: whether they are texts or messages is known only then
        log.info(
            "task=%s: %s: %d pairs of %s, %s (columns %s)",
            task_key,
            table.where,
            len(rows["index"]),
            KINDS[conversational],
            PROMPTS[form],
            ", ".join(columns),
        )
    return rows


def define_preference_task(train: Table, *, data: DataSection) -> Task:
    """The Task of preference rows: their format, found from the training table's columns (said in one line with
    the pairs' kind, texts or messages, once preference_rows has read them)."""
    form, columns = detect_preference_format(train, data=data)
    return Task.preference(form, columns)
