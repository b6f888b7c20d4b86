"""What a run learns. The rest of the package sees the result: `load_task(data=..., model=...)` -> the splits (columns
`text`[, `text_pair`][, `label`], `index`; task=sft: `messages`, `answers_from`, `index`, or plain `text`), a Task
(task.py: targets, head kind, metric, labels.json) and a Source. Inside: sources.py reads the rows (files.py's
formats, glue.py's tasks, a datasets folder, the Hub), columns.py chooses the columns and defines the Task,
labels.py reads the labels, conversations.py reads instruction rows. Every problem is one line naming file and row.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import datasets

from ..errors import UserError
from .columns import carve_validation, define_task, model_rows
from .conversations import FORMATS, conversation_rows, detect_format
from .glue import TASKS  # noqa: F401  (the face: what other modules import)
from .sources import (  # noqa: F401
    CHAT_SAMPLE_DIR,
    SAMPLE_DIR,
    Source,
    carved_fingerprint,
    check_hub_data,
    data_fingerprint,
    read_chat_sample,
    read_sources,
)
from .task import LABEL_FILE, SFT, HeadKind, Task, head_of, read_label_file, write_label_file  # noqa: F401

if TYPE_CHECKING:  # the sections' types only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection, ModelSection

log = logging.getLogger(__name__)


def load_task(
    *, data: DataSection, model: ModelSection, seed: int, predict: bool
) -> tuple[datasets.DatasetDict, Task, Source]:
    """The run's splits, its Task and where the rows came from; every problem is one line naming file and row.
    `seed` draws a held-out validation split; `predict`: the run predicts the test split, which must exist."""
    instruction = model.task == SFT
    if instruction and not (data.train_file or data.dataset):
        (tables, source), glue = read_chat_sample(data=data), None
    else:
        tables, source, glue = read_sources(data=data)
    if instruction:
        form, columns = detect_format(tables["train"], data=data)
        log.info("task=sft: %s rows in the %s format", tables["train"].where, FORMATS[form])
        task = Task.instruction(form, columns)
    else:
        task, text, pair, label = define_task(tables, glue, data=data, model=model)
    if predict and not task.test_splits:  # refused now, not after the training it follows
        if task.head is HeadKind.CAUSAL_LM:
            raise UserError(f"predict=true: a task={model.task} run predicts no test split; drop predict")
        raise UserError(
            "predict=true: the data has no test split; give test_file=PATH (or a GLUE folder with test.tsv)"
        )
    if "validation" not in tables:
        percentage = data.validation_split_percentage
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
        source = Source(source.kind, source.description, carved)
    splits = {}
    for split, table in tables.items():
        if task.head is HeadKind.CAUSAL_LM and split.startswith("test"):
            continue  # nothing evaluates a language model on a test split
        if instruction:
            splits[split] = datasets.Dataset.from_dict(conversation_rows(table, split, task.name, task.columns))
        else:
            splits[split] = datasets.Dataset.from_dict(model_rows(table, split, task, text, pair, label))
    return datasets.DatasetDict(splits), task, source
