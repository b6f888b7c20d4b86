"""task: kto (KTO, Ethayarajh et al., as TRL's KTOTrainer): a causal LM trained on unpaired rows, each a prompt, a
completion and a boolean label (desirable or not), against the reference model's log-probabilities and a KL
estimate from mismatched prompt/completion rows; dpo's pairs serve unpaired (chosen: desirable, rejected: not);
scored on held-out rows by TRL's metrics (rewards/*, logps/*, kl)."""

from __future__ import annotations

import json

from . import register
from .base import HeadKind, TaskKind
from .dpo import PAIR_DATA_KEYS, PreferenceTuning

KTO = "kto"
WEIGHTS = ("desirable_weight", "undesirable_weight")  # the preference section's keys only task=kto reads


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
    # unpaired rows (prompt, completion, label), or dpo's pairs unpaired; its loss (loop/kto.py): dpo_beta, weights
    reads = {"data": (*PAIR_DATA_KEYS, "completion_column"), "preference": ("dpo_beta", *WEIGHTS)}
    about = "unpaired preferences, docs/kto.md"

    def chat_template(self, train) -> bool:
        """Rows of messages (rendered by a chat template), not of texts."""
        return not isinstance(json.loads(train["completion"][0]), str)

    def cache_key(self, train_on: str) -> str:
        return "-kto1"  # the rows' format version

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=kto: chat template {template}, the loss on the completions' log-probabilities"

    def check(self, sections, bad) -> None:
        """beta > 0, weights > 0, a global batch of 2 rows or more (its KL rows pair each prompt with another row's
        completion), no packing (its rows are padded)."""
        preference = sections["preference"]
        if not preference.dpo_beta > 0:
            raise bad("dpo_beta", "must be > 0 (KTO's beta, e.g. 0.1)")
        for key in WEIGHTS:
            if not getattr(preference, key) > 0:
                raise bad(key, "must be > 0 (1.0: TRL's default)")
        if sections["training"].batch_size < 2:
            raise bad(
                "batch_size", "must be >= 2 under task=kto: its KL estimate pairs each prompt with another row's answer"
            )
        if sections["data"].packing:
            raise bad("packing", "task=kto pads its rows (it packs none); drop packing")


register(UnpairedPreferenceTuning())
