"""The Task: what a run learns. Its targets (class ids, regression values or next tokens), the head that makes
them (HeadKind), how its predictions are scored (`metric`, for metrics.compute_metrics) and what its label ids
mean; `labels.json` (in run folders, checkpoints, adapter/ and the data cache) is a Task as JSON; sft and dpo runs,
which have no labels, write none (`Task.has_labels`).

`problem_type` is the one field that decides the head: single_label_classification and regression are both a
sequence-classification head (class logits, or one output), causal_lm and sft (instruction tuning: conversations,
loss on the answers) are the language-model head. Each problem type belongs to a task kind (tasks/kinds/:
classification serves single_label_classification and regression); components ask `task.head`, `task.regression`
and `task.kind` (or `kind_of(task_key)` for the recipe's `task:` key), never compare the strings.
Reward modelling (task=reward: preference pairs, each row scored by one output) is a sequence-classification
head whose exported config says regression.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UserError
from .glue import TASKS, GlueTask
from .kinds import kind_of, kind_of_problem, problem_types
from .kinds.base import HeadKind, TaskKind  # HeadKind: most modules import it from here

# the kinds' problem types, re-exported for the modules that make a Task of them (columns, labels, GLUE)
from .kinds.causal_lm import CAUSAL_LM
from .kinds.classification import CLASSIFICATION, REGRESSION
from .kinds.dpo import DPO  # preference tuning: a causal LM trained to prefer each pair's chosen answer
from .kinds.grpo import GRPO  # online RL: a causal LM trained on its own completions' rewards
from .kinds.kto import KTO  # KTO: a causal LM trained on unpaired desirable and undesirable completions
from .kinds.reward import REWARD  # reward modelling: a one-output classifier scoring a pair's chosen answer higher
from .kinds.sft import SFT  # instruction tuning: a causal LM trained on conversations, scored on the answers

LABEL_FILE = "labels.json"  # in the run folder and the data cache: the task, its labels and columns


def head_of(task_key: str) -> HeadKind:
    """The head a recipe's `task:` value (classification | causal_lm | sft | dpo) trains: its kind's (sft and dpo
    train the causal LM's)."""
    return kind_of(task_key).head


@dataclass(frozen=True)
class Task:
    """A resolved task: what the model's head is and how its predictions are scored."""

    name: str  # a GLUE task name, or "custom" (the user's files or data set)
    problem_type: str  # single_label_classification | regression | causal_lm | sft
    pair: bool  # two texts per row
    label_names: tuple[str, ...] = ()  # label id -> name (the exported model's id2label)
    label_values: tuple[str, ...] = ()  # label id -> the label as the data writes it (predictions.tsv)
    metric: str = "classification"  # metrics.compute_metrics: a GLUE task name, classification, regression
    columns: tuple[str, ...] = ()  # the source's text, pair and label columns, for the record
    validation_splits: tuple[str, ...] = ("validation",)  # MNLI: also validation_mismatched
    test_splits: tuple[str, ...] = ()

    @classmethod
    def of_glue(
        cls,
        glue: GlueTask,
        validation_splits: tuple[str, ...] = ("validation",),
        test_splits: tuple[str, ...] = (),
    ) -> Task:
        """A GLUE task's classes (or regression) and official metric, read from GLUE's own columns."""
        pair = (glue.text_pair,) if glue.text_pair else ()
        return cls(
            glue.name,
            REGRESSION if glue.regression else CLASSIFICATION,
            bool(pair),
            glue.names,
            glue.values,
            glue.name,
            (glue.text, *pair, glue.label),
            validation_splits,
            test_splits,
        )

    @classmethod
    def language_model(cls, name: str, text: str, validation_splits: tuple[str, ...] = ("validation",)) -> Task:
        """Next-token prediction on one text column: no labels, no test split, perplexity as the score."""
        return cls(name, CAUSAL_LM, False, columns=(text,), validation_splits=validation_splits)

    @classmethod
    def instruction(cls, name: str, columns: tuple[str, ...], validation_splits: tuple[str, ...] = ("validation",)):
        """Instruction tuning (sft): conversations rendered by a chat template, the loss on the answers' tokens
        (or every token), perplexity over those tokens as the score; no test split."""
        return cls(name, SFT, False, metric="perplexity", columns=columns, validation_splits=validation_splits)

    @classmethod
    def preference(cls, name: str, columns: tuple[str, ...], validation_splits: tuple[str, ...] = ("validation",)):
        """Preference tuning (dpo): pairs of a prompt, a chosen and a rejected answer (conversations rendered by a
        chat template, or plain text), the loss on the answers' log-probabilities against the reference model's;
        scored on held-out pairs by rewards/accuracies and margins; no test split. `name`: the rows' format."""
        return cls(name, DPO, False, metric="preference", columns=columns, validation_splits=validation_splits)

    @classmethod
    def reward_model(cls, name: str, columns: tuple[str, ...], validation_splits: tuple[str, ...] = ("validation",)):
        """Reward modelling (task=reward): the preference pairs of task=dpo scored by a one-output
        sequence-classification head (Bradley-Terry: the chosen answer's score above the rejected one's); scored on
        held-out pairs by accuracy and margin; no test split. `name`: the rows' format."""
        return cls(name, REWARD, False, metric="reward", columns=columns, validation_splits=validation_splits)

    @classmethod
    def kto(cls, name: str, columns: tuple[str, ...], validation_splits: tuple[str, ...] = ("validation",)):
        """KTO (task=kto): unpaired rows of a prompt, a completion and a boolean label (or dpo's pairs, unpaired),
        the loss on the completions' log-probabilities against the reference model's and a KL estimate; scored on
        held-out rows by TRL's KTO metrics; no test split. `name`: the rows' format."""
        return cls(name, KTO, False, metric="kto", columns=columns, validation_splits=validation_splits)

    @classmethod
    def prompts(cls, name: str, columns: tuple[str, ...], validation_splits: tuple[str, ...] = ("validation",)):
        """Online RL (task=grpo): prompts whose sampled completions are rewarded; `columns`: the prompt column,
        then the columns the reward functions read; scored on held-out prompts by their mean reward; no test
        split. `name`: the prompts' format (text or messages)."""
        return cls(name, GRPO, False, metric="reward", columns=columns, validation_splits=validation_splits)

    @property
    def kind(self) -> TaskKind:
        """Its kind (tasks/kinds/): what every caller asks instead of comparing problem_type with a name."""
        kind = kind_of_problem(self.problem_type)
        if kind is None:
            valid = ", ".join(problem_types())
            raise UserError(f"problem_type={self.problem_type!r} is no task kind's; valid: {valid}")
        return kind

    @property
    def head(self) -> HeadKind:
        return self.kind.head

    @property
    def regression(self) -> bool:
        """A classification head with one output, trained on real-valued targets (squared error)."""
        return self.kind.regression(self.problem_type)

    @property
    def has_labels(self) -> bool:
        """Whether a run writes labels.json: what the head's ids mean and the columns they come from
        (classification, regression; causal_lm its text column, which predict.py reads to say what the model
        is). sft and dpo have no labels: their run folders and checkpoints hold none, and config.yaml's `task`
        says what they trained."""
        return self.kind.has_labels

    @property
    def num_labels(self) -> int:
        return len(self.label_names) or 1

    def predicted(self, logits):
        """A classification head's logits as predictions: class ids, or the regression value."""
        return logits.float().squeeze(-1) if self.regression else logits.argmax(-1)

    def prediction_text(self, value) -> str:
        """A prediction as predictions.tsv writes it: the label as the data writes its labels (GLUE's 0/1 or
        entailment names; a user's label names), or a regression value with three decimals."""
        return f"{value:.3f}" if self.regression else self.label_values[value]

    def check_predictable(self, task_key: str) -> None:
        """predict=true needs a test split: refused now, not after the training it follows."""
        if self.test_splits:
            return
        if self.head is HeadKind.CAUSAL_LM:
            raise UserError(f"predict=true: a task={task_key} run predicts no test split; drop predict")
        raise UserError(
            "predict=true: the data has no test split; give test_file=PATH (or a GLUE folder with test.tsv)"
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict) -> Task:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def estimate_task() -> Task:
    """The task assumed where there is no data (plans and memory estimates): SST-2's two classes."""
    return Task.of_glue(TASKS["sst2"])


def configure_head(hf_config, task: Task) -> None:
    """What a classification task writes into a transformers config: the head's width, its label names (the
    exported config.json's id2label/label2id, which transformers' pipeline prints) and the problem type."""
    hf_config.num_labels = task.num_labels
    if task.label_names:
        hf_config.id2label = dict(enumerate(task.label_names))
        hf_config.label2id = {name: i for i, name in enumerate(task.label_names)}
    # a reward model's one output is a score, not a class: transformers' pipeline then returns it as it is
    hf_config.problem_type = REGRESSION if task.kind.reward_model else task.problem_type


def write_label_file(folder: Path, task: Task) -> None:
    (folder / LABEL_FILE).write_text(json.dumps(task.to_json(), indent=1) + "\n", encoding="utf-8")


def read_label_file(folder: Path) -> Task:
    return Task.from_json(json.loads((folder / LABEL_FILE).read_text(encoding="utf-8")))
