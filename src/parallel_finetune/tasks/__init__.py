"""What a run learns: `load_task(data=..., model=...)` -> the splits (`text`[, `text_pair`][, `label`], `index`; sft:
`messages`, `answers_from`, `index`[, `tools`]; dpo, reward: `prompt`, `chosen`, `rejected`[, `margin`], `where`,
`index`; grpo: `prompt`, `columns`, `where`, `index`), a Task and a Source; each kind's rows read by its module
(columns, conversations, preferences, rewards, prompts; labels, sources, files, glue beneath); errors name file, row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import datasets

from .columns import define_task, held_out_validation, model_rows
from .conversations import conversation_rows, define_instruction_task
from .glue import TASKS  # noqa: F401  (the face: what other modules import)
from .preferences import define_preference_task, preference_rows
from .prompts import define_prompt_task, prompt_rows
from .rewards import define_reward_task, reward_rows
from .sources import (  # noqa: F401
    CHAT_SAMPLE_DIR,
    PREFERENCE_SAMPLE_DIR,
    SAMPLE_DIR,
    Source,
    check_hub_data,
    data_fingerprint,
    read_sources,
)
from .task import LABEL_FILE, HeadKind, Task, head_of, kind_of, read_label_file, write_label_file  # noqa: F401

if TYPE_CHECKING:  # the sections' types only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection, ModelSection


def load_task(
    *, data: DataSection, model: ModelSection, seed: int, predict: bool
) -> tuple[datasets.DatasetDict, Task, Source]:
    """The run's splits, its Task and where the rows came from; every problem is one line naming file and row.
    `seed` draws a held-out validation split; `predict`: the run predicts the test split, which must exist."""
    tables, source, glue = read_sources(data=data, task_key=model.task)
    kind = kind_of(model.task)  # sft's conversations, dpo's pairs: rows of their own format, read from its columns
    if kind.pairs or kind.conversations or kind.prompts:
        pairs = (define_reward_task, reward_rows) if kind.reward_model else (define_preference_task, preference_rows)
        others = (define_prompt_task, prompt_rows) if kind.prompts else (define_instruction_task, conversation_rows)
        define, read = pairs if kind.pairs else others
        task = define(tables["train"], data=data)
    else:
        task, text, pair, label = define_task(tables, glue, data=data, model=model)
        read = lambda table, split, *_: model_rows(table, split, task, text, pair, label)  # noqa: E731
    if predict:
        task.check_predictable(model.task)
    if "validation" not in tables:
        tables, source = held_out_validation(tables, source, data.validation_split_percentage, seed)
    splits = {}
    learned = model.tokenizer is None and model.size == "tiny"  # a pretrained tokenizer takes any length
    for split, table in tables.items():
        table.teaches_tokenizer = learned
        if task.head is HeadKind.CAUSAL_LM and split.startswith("test"):
            continue  # nothing evaluates a language model on a test split
        splits[split] = datasets.Dataset.from_dict(read(table, split, task.name, task.columns))
    return datasets.DatasetDict(splits), task, source
