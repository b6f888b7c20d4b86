"""task: dpo (preference tuning): a causal LM trained to prefer each pair's chosen answer to its rejected one
(conversations rendered by a chat template, or plain text), against the reference model's log-probabilities
unless the pair loss is reference-free; scored on held-out pairs by rewards/accuracies and margins."""

from __future__ import annotations

import json

from . import register
from .base import HeadKind, Sample, TaskKind

DPO = "dpo"
# the data keys of a preference pair (task=reward's and, unpaired, task=kto's too)
PAIR_DATA_KEYS = ("chat_template", "prompt_column", "chosen_column", "rejected_column")
# the pair loss's keys of the `preference:` section (task=dpo's alone but dpo_beta, which task=kto reads too)
PAIR_LOSS_KEYS = ("dpo_loss", "dpo_beta", "simpo_gamma", "dpo_label_smoothing", "rpo_alpha", "dpo_length_normalized")


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
    reads = {"data": PAIR_DATA_KEYS, "preference": PAIR_LOSS_KEYS}
    about = "preference pairs, docs/preference.md"
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

    def check(self, sections, bad) -> None:
        """The pair loss's keys in range, and a key of one pair loss set with another refused."""
        section = sections["preference"]
        loss, defaults = section.dpo_loss, type(section)()
        if not section.dpo_beta > 0:
            raise bad("dpo_beta", "must be > 0 (DPO's beta, e.g. 0.1)")
        if not 0 <= section.dpo_label_smoothing < 0.5:
            raise bad("dpo_label_smoothing", "must be in [0, 0.5) (the share of pairs assumed flipped)")
        if section.dpo_label_smoothing and loss in ("ipo", "hinge", "orpo"):
            raise bad("dpo_label_smoothing", f"is read by dpo_loss=sigmoid (cDPO), robust and simpo, not {loss}")
        if section.rpo_alpha < 0:
            raise bad("rpo_alpha", "must be >= 0 (0: no SFT term)")
        # keys of one pair loss set with another: refused, as another task's keys are
        if section.simpo_gamma != defaults.simpo_gamma and loss != "simpo":
            raise bad("simpo_gamma", f"is dpo_loss=simpo's target margin, and dpo_loss={loss} reads none; drop it")
        if loss in ("simpo", "orpo"):
            for key, why in (("rpo_alpha", "SFT term"), ("dpo_length_normalized", "averaging")):
                if getattr(section, key) != getattr(defaults, key):
                    raise bad(key, f"is the DPO family's {why}, and dpo_loss={loss} reads none (it averages); drop it")


register(PreferenceTuning())
