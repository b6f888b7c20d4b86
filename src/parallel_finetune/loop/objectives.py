"""The objective registry: a task kind names its objective (`TaskKind.objective`, tasks/kinds/), and this maps the
name to the maker, so the run's assembly asks the kind once instead of branching on its flags. A new kind with its
own loss adds a maker here under a new name; a new pair loss is a class of pair_losses.py (the `pairs` objective
picks it by `dpo_loss`).

    classifier  a classification head's loss from its logits: cross-entropy over the classes, or squared error
                for one regression output (loss.py)
    tokens      a language model's next-token loss: from the final hidden states through the chunked head
                (HiddenTokenLoss), or from whole logits (engine=deepspeed; loss_chunk_tokens=0 without a pipeline)
    pairs       task=dpo's PreferenceLoss: each answer's log-probabilities from the hidden states and the head, then
                the pair loss `preference.dpo_loss` names
    reward      task=reward's RewardLoss: Bradley-Terry over the pair's two scores (reward_loss.py)
    kto         task=kto's KTOObjective: each row's log-probability from the hidden states and the head (as
                `pairs`), against the reference and the step's KL estimate (kto.py)
    grpo        task=grpo's GRPOLoss: TRL's clipped surrogate (+ beta x KL) on the completion tokens'
                log-probabilities from the hidden states and the head (grpo_loss.py)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..config import GRPOSection, PreferenceSection
from ..errors import UserError
from ..parallel.layout import Engine
from ..tasks.task import HeadKind, Task
from .grpo_loss import GRPOLoss
from .kto import KTOObjective
from .loss import HiddenTokenLoss, PreferenceLoss, objective_for
from .reward_loss import RewardLoss

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectiveInputs:
    """What a maker may read: the task, the model as loaded (its head and config), how the run computes the loss
    (engine, loss_chunk_tokens, a pipeline or not) and the `preference:` and `grpo:` sections."""

    task: Task
    model: nn.Module
    head: HeadKind
    engine: Engine
    loss_chunk_tokens: int
    pipeline: bool
    preference: PreferenceSection
    grpo: GRPOSection = field(default_factory=GRPOSection)  # task=grpo's section


def _classifier(inputs: ObjectiveInputs):
    return objective_for(inputs.task)


def _tokens(inputs: ObjectiveInputs):
    return objective_for(inputs.task, _hidden_loss(inputs))


def _hidden_loss(inputs: ObjectiveInputs) -> HiddenTokenLoss | None:
    """A language model's loss from its final hidden states and head: chunked (loss_chunk_tokens), or whole
    logits of the labelled positions; None: from the logits the model's forward makes (engine=deepspeed, or
    loss_chunk_tokens=0 without a pipeline, whose last stage always hands over hidden states)."""
    if inputs.head is not HeadKind.CAUSAL_LM:
        return None
    if inputs.engine is Engine.DEEPSPEED:
        log.info("engine=deepspeed: the language model's loss from its whole logits (loss_chunk_tokens: torch)")
        return None
    if not inputs.loss_chunk_tokens and not inputs.pipeline:
        return None
    model = inputs.model
    head = model.get_output_embeddings() if getattr(model, "lm_head", None) is not None else None
    softcap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2 and 3
    return HiddenTokenLoss(head, inputs.loss_chunk_tokens, softcap)


def _pairs(inputs: ObjectiveInputs) -> PreferenceLoss:
    return _answer_loss(PreferenceLoss, inputs)


def _kto(inputs: ObjectiveInputs) -> KTOObjective:
    return _answer_loss(KTOObjective, inputs)


def _answer_loss(objective, inputs: ObjectiveInputs):
    """An answers' loss (`objective`: PreferenceLoss, KTOObjective) from the final hidden states and the head
    (chunked, vocabulary-parallel), or under engine=deepspeed from the whole logits (ZeRO-3 gathers the head in its
    own forward)."""
    model = inputs.model
    head = None if inputs.engine is Engine.DEEPSPEED else model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return objective(head, inputs.loss_chunk_tokens, softcap, preference=inputs.preference)


def _reward(inputs: ObjectiveInputs) -> RewardLoss:
    return RewardLoss(inputs.preference.center_rewards_coefficient)  # the pairs' scores from the classifier's logits


def _grpo(inputs: ObjectiveInputs) -> GRPOLoss:
    model = inputs.model
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return GRPOLoss(model.get_output_embeddings(), inputs.loss_chunk_tokens, softcap, grpo=inputs.grpo)


OBJECTIVES: dict[str, Callable[[ObjectiveInputs], object]] = {
    "classifier": _classifier,
    "tokens": _tokens,
    "pairs": _pairs,
    "reward": _reward,
    "kto": _kto,
    "grpo": _grpo,
}


def make_objective(name: str, inputs: ObjectiveInputs):
    """The objective a kind names (`kind.objective`), made for this model and run."""
    maker = OBJECTIVES.get(name)
    if maker is None:
        raise UserError(f"no objective named {name!r}; registered (loop/objectives.py): {', '.join(OBJECTIVES)}")
    return maker(inputs)
