"""What a task kind is: the questions callers ask a task's kind instead of comparing its `task:` key or its
problem type with a name. Each kind module (classification, causal_lm, sft, dpo, reward, kto, grpo) defines one
TaskKind and registers it (tasks/kinds/__init__.py); HeadKind, the model's last layer, is every kind's answer to
`head`. A kind also owns its recipe keys: which keys of the sections kinds share it reads (`reads`), and the checks of
their values (`check`)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from enum import Enum

# `reads`' value for a section only this kind reads (grpo's `grpo:`): every key of it, today's and those added later
WHOLE_SECTION = ("*",)

BadKey = typing.Callable[[str, str], Exception]  # (key, why) -> the one-line error naming the key and its value


class HeadKind(str, Enum):
    """The model's last layer. Its values are the recipe's `task:` key and the families' model_classes keys."""

    CLASSIFICATION = "classification"  # a sequence-classification head: class logits, or one regression output
    CAUSAL_LM = "causal_lm"  # the language-model head: each position's next-token logits

    def __str__(self) -> str:  # as the recipe writes it (cache keys, messages)
        return self.value


@dataclass(frozen=True)
class Sample:
    """The small data set shipped in sample_data/ that a run of the kind trains on without train_file or dataset."""

    folder: str  # under sample_data/
    name: str  # what the log calls it
    holds: str  # what its rows are
    reads: str  # what a run of the kind reads (the message for a GLUE folder)
    prefix: str  # its data fingerprint's prefix (the cache key)


class TaskKind:
    """One kind of task, registered under its recipe `task:` key. The defaults are classification's; a kind
    module overrides what differs."""

    key: str = ""  # the recipe's `task:` value
    problem_types: tuple[str, ...] = ()  # the Task.problem_type values of this kind (labels.json's problem_type)
    head: HeadKind = HeadKind.CLASSIFICATION
    has_labels: bool = True  # a run writes labels.json (what the head's ids mean)
    chat: bool = False  # instruction or preference tuning: rows rendered by the data stage (a chat template or the
    # pair's text), checked by --check on a sample; the planner times its rows as the run's own
    conversations: bool = False  # each row is a conversation whose answers are trained (sft)
    pairs: bool = False  # each row is a preference pair: a chosen and a rejected answer to one prompt (dpo)
    unpaired: bool = False  # each row is a prompt, a completion and a boolean label (desirable or not): KTO's
    # unpaired preferences, the loss per row against the reference and a KL estimate (task=kto)
    prompts: bool = False  # each row is a prompt whose completions the run samples and rewards (grpo)
    reward_model: bool = False  # its pairs are scored by a one-output head (reward modelling): padded pairs of
    # rows, the Bradley-Terry objective, exported as a one-output classifier; else pairs are the language model's
    reference: bool = False  # its objective reads a reference model's log-probabilities, measured before training,
    # unless the pair loss is reference-free (config.REFERENCE_FREE_LOSSES)
    rows: str = ""  # the tasks/ module reading its rows when they have a format of their own (tasks/__init__.py's
    # OWN_ROWS: conversations, preferences, rewards, unpaired, prompts); "": text columns (tasks/columns.py)
    # the names of its batcher (data/batchers.py: rows, pairs, reward_pairs, kto, grpo) and of its objective
    # (loop/objectives.py: classifier, tokens, pairs, reward, kto, grpo), which the run's assembly makes; the kind, a
    # floor below, only names them
    batcher: str = "rows"
    objective: str = "classifier"
    step_source: str = ""  # what makes each step's rows instead of the sampled split (rl/steps.py: rollouts), or none
    unread_keys: tuple[str, ...] = ()  # recipe keys a run of this kind never reads, left out of what it writes
    sample: Sample | None = None  # the shipped sample it trains on without train_file or dataset
    # Its recipe keys: by section, the keys it reads that other kinds do not all read (a section's name: the keys,
    # or WHOLE_SECTION). One of them set away from its default under a kind that reads it not is refused in one
    # line naming the kinds that read it (kinds.check_task_keys); `about` is what the kind trains on, in a few words,
    # for that line, and `notes` a key's own words where they say more than `about`.
    reads: typing.ClassVar[dict[str, tuple[str, ...]]] = {}
    about: str = ""
    notes: typing.ClassVar[dict[str, str]] = {}

    def check(self, sections: typing.Mapping[str, typing.Any], bad: BadKey) -> None:
        """A run of this kind: its keys' values and their combinations with the other sections (`sections`: the
        recipe's section dataclasses by name, as config.SECTIONS names them); raise bad(key, why) on the first."""

    @property
    def rows_per_sample(self) -> int:
        """Rows of tokens one sample holds (a pair: its chosen and its rejected row; the planner and packing)."""
        return 2 if self.pairs else 1

    def samples_per_step(self, batch_size: int, grpo) -> int:
        """The training split's rows a step draws: batch_size (grpo: its prompts, batch_size / num_generations)."""
        return batch_size

    @property
    def sample_unit(self) -> str:
        """What a sample is called in messages."""
        return "pairs" if self.pairs else "rows"

    def regression(self, problem_type: str) -> bool:
        """A classification head with one output, trained on real-valued targets."""
        return False

    def named_labels(self, problem_type: str) -> bool:
        """Its labels.json names two or more classes."""
        return False

    def chat_template(self, train) -> bool:
        """Whether a chat template renders these training rows (a `datasets` table of the kind's columns)."""
        return self.conversations

    def cache_key(self, train_on: str) -> str:
        """The tokenized cache's name after the tokenizer and length: what else changes the kind's tokens."""
        return ""

    def template_note(self, template: str, train_on: str) -> str:
        """The log line saying which chat template renders the rows and what is trained."""
        return f"task={self.key}: chat template {template}"

    def __repr__(self) -> str:
        return f"<task kind {self.key}>"
