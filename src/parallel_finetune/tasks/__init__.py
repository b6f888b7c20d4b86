"""What a run learns: `load_task(data=..., model=...)` -> the splits, a Task and a Source; each kind's rows read by its
own module (columns, conversations, preferences, rewards, unpaired, prompts); errors name file:row."""

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
from .unpaired import define_kto_task, kto_rows

# The kinds whose rows have a format of their own: how the Task is defined from the training table, how rows are read.
OWN_ROWS = {"conversations": (define_instruction_task, conversation_rows), "rewards": (define_reward_task, reward_rows)}
OWN_ROWS |= {"preferences": (define_preference_task, preference_rows), "unpaired": (define_kto_task, kto_rows)}
OWN_ROWS |= {"prompts": (define_prompt_task, prompt_rows)}

if TYPE_CHECKING:  # the sections' types only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection, ModelSection


def load_task(
    *, data: DataSection, model: ModelSection, seed: int, predict: bool
) -> tuple[datasets.DatasetDict, Task, Source]:
    """The run's splits, its Task and where the rows came from; every problem is one line naming file and row.
    `seed` draws a held-out validation split; `predict`: the run predicts the test split, which must exist."""
    tables, source, glue = read_sources(data=data, task_key=model.task)
    if own_rows := OWN_ROWS.get(kind_of(model.task).rows):  # sft's conversations, dpo's pairs...: their own format
        task, read = own_rows[0](tables["train"], data=data), own_rows[1]
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
