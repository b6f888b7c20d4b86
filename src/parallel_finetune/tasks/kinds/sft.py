"""task: sft (instruction tuning): a causal LM trained on conversations rendered by a chat template, the loss on
the answers' tokens (or every token), scored by perplexity over them; no labels, no test split."""

from __future__ import annotations

from . import register
from .base import HeadKind, Sample, TaskKind

SFT = "sft"


class InstructionTuning(TaskKind):
    key = SFT
    rows = "conversations"
    problem_types = (SFT,)
    head = HeadKind.CAUSAL_LM
    has_labels = False
    chat = True
    conversations = True
    objective = "tokens"
    unread_keys = ("glue_task",)  # whatever glue_task's default, an sft run reads no GLUE task
    reads = {
        "data": ("chat_template", "train_on", "messages_column", "prompt_column", "completion_column", "tools_column"),
        "training": ("generate_every",),  # greedy answers to held-out prompts (loop/generation.py)
    }
    about = "conversations rendered by a chat template"
    notes = {"generate_every": "it answers the validation conversations' prompts"}
    sample = Sample("chat", "chat sample", "instructions over SST-2 sentences", "conversations", "chat-sample-")

    def cache_key(self, train_on: str) -> str:
        # the template is in the tokenizer's identity; -p: rows carry prompt_length (generate_every's prompts)
        return f"-{train_on}-p"

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=sft: chat template {template}, the loss on {train_on}"


register(InstructionTuning())
