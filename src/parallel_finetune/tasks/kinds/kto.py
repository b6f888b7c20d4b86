"""task: kto (KTO, Ethayarajh et al., as TRL's KTOTrainer): a causal LM trained on unpaired rows, each a prompt, a
completion and a boolean label (desirable or not), against the reference model's log-probabilities and a KL
estimate from mismatched prompt/completion rows; dpo's pairs serve unpaired (chosen: desirable, rejected: not);
scored on held-out rows by TRL's metrics (rewards/*, logps/*, kl)."""

from __future__ import annotations

import json

from . import register
from .base import HeadKind, TaskKind
from .dpo import PreferenceTuning

KTO = "kto"


class UnpairedPreferenceTuning(TaskKind):
    key = KTO
    rows = "unpaired"
    problem_types = (KTO,)
    head = HeadKind.CAUSAL_LM
    has_labels = False
    chat = True
    unpaired = True
    reference = True
    batcher = "kto"  # its rows and KL rows (data/kto.py's KTOBatcher)
    objective = "kto"  # loop/kto.py's KTOObjective
    unread_keys = ("glue_task",)  # whatever glue_task's default, a kto run reads no GLUE task
    sample = PreferenceTuning.sample  # dpo's pairs, unpaired

    def chat_template(self, train) -> bool:
        """Rows of messages (rendered by a chat template), not of texts."""
        return not isinstance(json.loads(train["completion"][0]), str)

    def cache_key(self, train_on: str) -> str:
        return "-kto1"  # the rows' format version

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=kto: chat template {template}, the loss on the completions' log-probabilities"


register(UnpairedPreferenceTuning())
