"""task: grpo (online RL with verifiable rewards, as TRL's GRPOTrainer): a causal LM trained on completions it
samples itself for each prompt (text, or messages rendered by the chat template with its generation prompt), scored
by reward functions that read the row's other columns (an `answer`, a `solution`); scored on held-out prompts by
their mean reward."""

from __future__ import annotations

import json

from . import register
from .base import HeadKind, Sample, TaskKind

GRPO = "grpo"


class ReinforcementLearning(TaskKind):
    key = GRPO
    rows = "prompts"
    problem_types = (GRPO,)
    head = HeadKind.CAUSAL_LM
    has_labels = False
    chat = True
    prompts = True
    batcher = "grpo"
    objective = "grpo"
    step_source = "rollouts"
    unread_keys = ("glue_task",)  # whatever glue_task's default, a grpo run reads no GLUE task
    sample = Sample(
        "grpo",
        "arithmetic sample",
        "small sums and products written in words and digits, each with its answer",
        "prompts",
        "grpo-sample-",
    )

    def samples_per_step(self, batch_size: int, grpo) -> int:
        return batch_size // grpo.num_generations  # batch_size counts completions

    def chat_template(self, train) -> bool:
        """Prompts of messages (rendered by a chat template with its generation prompt), not texts."""
        return not isinstance(json.loads(train["prompt"][0]), str)

    def cache_key(self, train_on: str) -> str:
        return "-prompts1"  # the prompts' format version

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=grpo: chat template {template}, each prompt rendered with its generation prompt"


register(ReinforcementLearning())
