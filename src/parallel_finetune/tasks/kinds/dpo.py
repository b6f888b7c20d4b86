"""task: dpo (preference tuning): a causal LM trained to prefer each pair's chosen answer to its rejected one
(conversations rendered by a chat template, or plain text), against the reference model's log-probabilities
unless the pair loss is reference-free; scored on held-out pairs by rewards/accuracies and margins."""

from __future__ import annotations

import json

from . import register
from .base import HeadKind, Sample, TaskKind

DPO = "dpo"


class PreferenceTuning(TaskKind):
    key = DPO
    rows = "preferences"
    problem_types = (DPO,)
    head = HeadKind.CAUSAL_LM
    has_labels = False
    chat = True
    pairs = True
    reference = True
    batcher = "pairs"
    objective = "pairs"
    unread_keys = ("glue_task",)  # whatever glue_task's default, a dpo run reads no GLUE task
    sample = Sample(
        "preference",
        "preference sample",
        "right and wrong answers about SST-2 sentences",
        "preference pairs",
        "dpo-sample-",
    )

    def chat_template(self, train) -> bool:
        """Pairs of messages (rendered by a chat template), not of texts."""
        return not isinstance(json.loads(train["chosen"][0]), str)

    def cache_key(self, train_on: str) -> str:
        return "-pairs1"  # the pairs' format version

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=dpo: chat template {template}, the loss on the answers' log-probabilities"


register(PreferenceTuning())
