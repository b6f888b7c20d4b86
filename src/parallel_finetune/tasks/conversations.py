"""Instruction rows (task=sft) as conversations, in TRL's formats, found from the columns:

- `messages`: a list of {role, content}, roles system | user | assistant | tool; a content may be OpenAI's list
  of text parts ([{"type": "text", "text": ...}]), read as their texts joined;
- ShareGPT `conversations`: a list of {from, value}, from system | human | gpt | tool;
- `prompt` + `completion`: strings (a user turn and its answer), or lists of messages (a conversational prompt,
  few-shot assistant turns included, and the answer's turns);
- `text`: plain text, every token trained, no template.

A conversational row may carry a `tools` column (TRL's: the function schemas the model may call, a list of
objects, OpenAI's {"type": "function", "function": {name, description, parameters}} or a bare {name, ...}; a
string there is JSON text of that list, as TRL reads it, in any source), handed to the chat template as
`apply_chat_template(..., tools=...)` does; a row without tools (empty, null, []) renders as it did before.

Each conversational row becomes the same thing, a list of messages as the chat template receives them (every
field kept: tool_calls, reasoning_content, name, ...), `answers_from` (the index of the first message whose
assistant turns are trained: 0, or the prompt's length) and `untrained` (assistant turns whose `weight` is 0,
ShareGPT's and axolotl's per-turn key), stored as JSON text so every row of a split has one column type. A CSV or
TSV cell holding a list is JSON text (a prompt or completion cell is read as one only when it begins with `[{` or
is `[]`: other text, `[Q] ...` too, is text); in JSON Lines, Parquet and `datasets` a string is text, never
parsed. A malformed row is one line naming its place (file:line, or `row N`) and what is valid.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

from ..errors import UserError
from .files import Table, check_text
from .task import Task

if TYPE_CHECKING:  # the section's type only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
# format name -> what the log and errors call it
FORMATS = {
    "messages": "messages (a list of {role, content})",
    "sharegpt": "ShareGPT conversations (a list of {from, value})",
    "prompt_completion": "prompt + completion",
    "text": "plain text",
}
# how many columns hold each format; a tools column, when the table has one, follows them in the Task's columns
FORMAT_COLUMNS = {"messages": 1, "sharegpt": 1, "prompt_completion": 2, "text": 1}
TOOLS_FORMAT = '[{"type": "function", "function": {"name": "...", "description": "...", "parameters": {...}}}]'
VALID = (
    "a column messages (a list of {role, content}), conversations (ShareGPT: {from, value}), prompt and "
    "completion, or text (or name yours with messages_column, prompt_column and completion_column, text_column)"
)


def _named(table: Table, key: str, name: str | None) -> str | None:
    if name is not None and name not in table.columns:
        raise UserError(f"{key}={name!r}: {table.where} has no such column ({', '.join(table.columns) or 'none'})")
    return name


def detect_format(table: Table, *, data: DataSection) -> tuple[str, tuple[str, ...]]:
    """The row format of `table` (a FORMATS key) and the columns that hold it, from the columns present (the
    `*_column` keys name them when they have other names), then the tools column if the table has one
    (`tools_column`, else `tools`)."""
    form, columns = _format(table, data=data)
    tools = _named(table, "tools_column", data.tools_column) or ("tools" if "tools" in table.columns else None)
    if tools is None:
        return form, columns
    if form == "text":  # no template renders plain text: its tools would be dropped
        raise UserError(
            f"{table.where}: column {tools!r} holds tools, and plain-text rows ({columns[0]!r}) have no chat "
            "template to render them; give conversations (messages or prompt and completion) or drop the column"
        )
    if tools in columns:
        raise UserError(f"tools_column={tools!r} is also the rows' {FORMATS[form]} column; name the tools' own column")
    return form, (*columns, tools)


def _format(table: Table, *, data: DataSection) -> tuple[str, tuple[str, ...]]:
    messages = _named(table, "messages_column", data.messages_column)
    prompt = _named(table, "prompt_column", data.prompt_column)
    completion = _named(table, "completion_column", data.completion_column)
    text = _named(table, "text_column", data.text_column)
    if messages is not None:
        return "messages", (messages,)
    if prompt is not None or completion is not None:
        prompt, completion = prompt or "prompt", completion or "completion"
        for key, name in (("prompt_column", prompt), ("completion_column", completion)):
            _named(table, key, name)
        return "prompt_completion", (prompt, completion)
    if text is not None:
        return "text", (text,)
    for name, form in (("messages", "messages"), ("conversations", "sharegpt")):
        if name in table.columns:
            return form, (name,)
    if "prompt" in table.columns and "completion" in table.columns:
        return "prompt_completion", ("prompt", "completion")
    if "text" in table.columns:
        return "text", ("text",)
    raise UserError(f"{table.where}: task=sft needs {VALID}; found: {', '.join(table.columns) or 'no column'}")


def _listed(table: Table, row: int, column: str, value) -> list:
    """A cell holding a list of messages; a CSV or TSV cell holds it as JSON text (other sources hold lists, and
    a string there is text, never parsed)."""
    if isinstance(value, str) and table.text_cells:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{table.at(row)}: column {column!r} is not JSON text of a list of messages ({exc.msg}); write "
                '[{"role": "user", "content": "..."}, ...]'
            ) from None
    if not isinstance(value, (list, tuple)):
        raise UserError(
            f"{table.at(row)}: column {column!r} holds a {type(value).__name__}, not a list of messages "
            "({role, content} or ShareGPT {from, value})"
        )
    return list(value)


def _weight(where: str, item: dict, role: str) -> bool:
    """Whether a turn trains: a message's `weight` (ShareGPT's and axolotl's per-turn key) is 1 or 0, and 0
    leaves an assistant turn untrained; absent: trained."""
    weight = item.get("weight")
    if weight is None:
        return True
    if isinstance(weight, bool) or weight not in (0, 1):
        raise UserError(f"{where}: weight {weight!r} is not 0 (an untrained turn) or 1 (trained)")
    if role != "assistant" and weight == 0:
        return True  # only answers are trained: a prompt turn's weight changes nothing
    return weight == 1


def _content_text(where: str, key: str, content):
    """A message's content as text: OpenAI's content parts ([{"type": "text", "text": ...}, ...]) joined as the
    templates that take parts render them (one after another, nothing between); other values as given."""
    if not isinstance(content, (list, tuple)):
        return content
    texts = []
    for number, part in enumerate(content, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"of type {kind!r}" if kind not in (None, "text") else "not a text part"
            raise UserError(
                f'{where}: {key} part {number} is {what}; a list of parts holds text parts {{"type": "text", '
                '"text": "..."} only (the model reads text)'
            )
        texts.append(part["text"])
    return "".join(texts)


def _message(table: Table, row: int, column: str, number: int, item) -> tuple[dict, bool]:
    """One message as the template receives it, and whether it trains: every field as given (tool_calls,
    reasoning_content, name, ...), ShareGPT's {from, value} as {role, content}; fields a table stores as None
    (a Parquet or datasets struct gives every message every field) are left out, as a template expects;
    `weight` is read (`_weight`), not passed on."""
    where = f"{table.at(row)}: {column} message {number}"
    if not isinstance(item, dict):
        raise UserError(f"{where} is a {type(item).__name__}, not an object {{role, content}}")
    sharegpt = "role" not in item and "from" in item
    key, text_key, valid = ("from", "value", tuple(SHAREGPT_ROLES)) if sharegpt else ("role", "content", ROLES)
    given = item.get(key)
    role = (SHAREGPT_ROLES.get(given) if sharegpt else given) if isinstance(given, str) else None
    if role not in ROLES:
        raise UserError(f"{where}: {key} {given!r} is not one of {', '.join(valid)}")
    content = _content_text(where, text_key, item.get(text_key))
    calls = item.get("tool_calls")
    if not isinstance(content, str) and not (content is None and role == "assistant" and calls):
        what = "missing" if content is None else f"a {type(content).__name__}, not text"
        raise UserError(f"{where}: {text_key} is {what}; every message has text (an assistant's may be tool_calls)")
    if role == "assistant" and not (content or "").strip() and not calls:
        raise UserError(f"{where}: an empty assistant answer; an answer has text or tool_calls to learn")
    check_text(table, row, content or "")
    message = {
        name: value for name, value in item.items() if value is not None and name not in (key, text_key, "weight")
    }
    message.update(role=role, content=content or "")
    return message, _weight(where, item, role)


def read_messages(table: Table, row: int, column: str, value, needs_answer: bool) -> tuple[list[dict], list[bool]]:
    """The messages of one cell and, per message, whether it trains (`weight`)."""
    read = [_message(table, row, column, n, item) for n, item in enumerate(_listed(table, row, column, value), 1)]
    messages, trained = [m for m, _ in read], [t for _, t in read]
    if needs_answer and not any(m["role"] == "assistant" for m in messages):
        raise UserError(
            f"{table.at(row)}: column {column!r} has no assistant turn (roles: "
            f"{', '.join(m['role'] for m in messages) or 'none'}); a row trains on its assistant answers"
        )
    return messages, trained


def _without_nulls(value):
    """A Parquet or datasets struct's value less the None fields Arrow gives every item of a column whose items
    have different keys (one tool's parameters filled in with another's as null), as messages leave them out."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [_without_nulls(item) for item in value]
    return value


def read_tools(table: Table, row: int, column: str, value) -> list[dict] | None:
    """One row's tool schemas as the template receives them: a list of objects, each with a name (OpenAI's
    {"type": "function", "function": {"name": ...}} or a bare {"name": ...}); a string is JSON text of the list
    (TRL reads it so in any source: a list of schemas that differ rarely survives Arrow's one type per column);
    None where the row has none (empty, null or [])."""
    where = f"{table.at(row)}: column {column!r}"
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{where} is not valid JSON ({exc.msg}); write a list of tool schemas {TOOLS_FORMAT}"
            ) from None
    else:
        value = _without_nulls(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(tool, dict) for tool in value):
        what = type(value).__name__ if not isinstance(value, (list, tuple)) else "list holding something else"
        raise UserError(f"{where} holds a {what}, not a list of tool schemas (objects) {TOOLS_FORMAT}")
    for number, tool in enumerate(value, 1):
        function = tool.get("function", tool)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise UserError(
                f'{where}: tool {number} has no name (a function schema\'s "name", inside "function" when it '
                f"is given); write {TOOLS_FORMAT}"
            )
    return list(value) or None


# JSON text of a list of messages: "[" then "{" (the first message) or "]" (none), spaces allowed between
MESSAGES_JSON = re.compile(r"\s*\[\s*[{\]]")


def holds_messages(table: Table, value) -> bool:
    """A prompt or completion cell holds messages: a list, or in a CSV/TSV cell JSON text of one, text that begins
    with `[{` (or is `[]`); other text beginning with "[" (`[Q] ...`, `[1, 2] reversed?`) is the text itself, as
    is any string elsewhere, whatever it begins with."""
    return not isinstance(value, str) or (table.text_cells and MESSAGES_JSON.match(value) is not None)


def _prompt_completion(table: Table, row: int, columns: tuple[str, ...]) -> tuple[list[dict], list[bool], int]:
    prompt_column, completion_column = columns
    prompt, completion = table.columns[prompt_column][row], table.columns[completion_column][row]
    if not holds_messages(table, completion):
        if not completion.strip():
            raise UserError(f"{table.at(row)}: column {completion_column!r} is empty; a completion is the answer")
        check_text(table, row, completion)
        answer, answer_trained = [{"role": "assistant", "content": completion}], [True]
    else:
        answer, answer_trained = read_messages(table, row, completion_column, completion, needs_answer=True)
    if not holds_messages(table, prompt):
        check_text(table, row, prompt)
        asked, asked_trained = [{"role": "user", "content": prompt}], [True]
    else:
        asked, asked_trained = read_messages(table, row, prompt_column, prompt, needs_answer=False)
    return asked + answer, asked_trained + answer_trained, len(asked)


def conversation_rows(table: Table, split: str, form: str, columns: tuple[str, ...]) -> dict[str, list]:
    """`table`'s rows in format `form` as the columns the model side reads: `messages` (JSON text of the list of
    messages), `answers_from`, `untrained` (the assistant turns a `weight` of 0 leaves untrained), `where` (the
    row's place), `index` and, where `columns` ends with a tools column, `tools` (JSON text) for conversations;
    `text` and `index` for plain text (an empty text is dropped and counted)."""
    missing = [name for name in columns if name not in table.columns]
    if missing:
        raise UserError(
            f"{table.where}: no column {', '.join(missing)} ({FORMATS[form]}, as in the train split; found: "
            f"{', '.join(table.columns) or 'none'})"
        )
    if form == "text":
        return _text_rows(table, split, columns[0])
    columns, tools_column = columns[: FORMAT_COLUMNS[form]], columns[FORMAT_COLUMNS[form] :]
    conversations, starts, untrained, tools = [], [], [], []
    for row in range(len(table)):
        if tools_column:  # JSON text (null: none) so that every row of the split has one column type
            value = table.columns[tools_column[0]][row]
            tools.append(json.dumps(read_tools(table, row, tools_column[0], value), ensure_ascii=False))
        if form == "prompt_completion":
            messages, trained, start = _prompt_completion(table, row, columns)
        else:
            value = table.columns[columns[0]][row]
            (messages, trained), start = read_messages(table, row, columns[0], value, needs_answer=True), 0
        first = next((m["role"] for m in messages if m["role"] != "system"), None)
        if first == "assistant":
            raise UserError(
                f"{table.at(row)}: the conversation begins with an assistant turn (after any system message); an "
                "answer follows the user turn (or prompt) it answers"
            )
        skipped = [i for i, (m, t) in enumerate(zip(messages, trained)) if m["role"] == "assistant" and not t]
        if not any(m["role"] == "assistant" and t for m, t in zip(messages[start:], trained[start:])):
            raise UserError(f"{table.at(row)}: every answer has weight 0; a row trains on at least one answer")
        conversations.append(json.dumps(messages, ensure_ascii=False))
        starts.append(start)
        untrained.append(skipped)
    if not conversations:
        raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
    places = [table.at(row) for row in range(len(table))]  # file:line, for the errors found when it is rendered
    rows = {
        "messages": conversations,
        "answers_from": starts,
        "untrained": untrained,
        "where": places,
        "index": list(range(len(table))),
    }
    return {**rows, "tools": tools} if tools_column else rows  # rows without a tools column: as before


def _text_rows(table: Table, split: str, column: str) -> dict[str, list]:
    texts, keep = [], []
    for row, value in enumerate(table.columns[column]):
        if value is not None and not isinstance(value, str):
            raise UserError(f"{table.at(row)}: column {column!r} holds a {type(value).__name__}, not text")
        check_text(table, row, value or "")
        if value and value.strip():
            texts.append(value)
            keep.append(row)
    if len(keep) < len(table):
        log.warning("%s: dropped %d row(s) with an empty text", table.where, len(table) - len(keep))
    if not keep:
        raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
    return {"text": texts, "index": keep}


def define_instruction_task(train: Table, *, data: DataSection) -> Task:
    """The Task of instruction rows: their format, found from the training table's columns and said in one line."""
    form, columns = detect_format(train, data=data)
    tools = f", with the tool schemas of column {columns[-1]!r}" if len(columns) > FORMAT_COLUMNS[form] else ""
    log.info("task=sft: %s rows in the %s format%s", train.where, FORMATS[form], tools)
    return Task.instruction(form, columns)
