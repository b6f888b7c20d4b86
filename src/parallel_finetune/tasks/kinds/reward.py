"""task: reward (reward modelling, as TRL's RewardTrainer): dpo's preference pairs (an optional `margin` column)
scored by a one-output sequence-classification head, trained to score each pair's chosen answer above its rejected
one (Bradley-Terry); scored on held-out pairs by accuracy and margin; exported as a one-output classifier whose
config says regression (transformers' pipeline returns the raw score)."""

from __future__ import annotations

from . import register
from .base import HeadKind, TaskKind
from .dpo import PAIR_DATA_KEYS, PreferenceTuning

REWARD = "reward"


class RewardModelling(TaskKind):
    key = REWARD
    rows = "rewards"
    problem_types = (REWARD,)
    head = HeadKind.CLASSIFICATION
    has_labels = True  # labels.json says what the one output is (predict.py reads it)
    chat = True
    pairs = True
    reward_model = True
    batcher = "reward_pairs"
    objective = "reward"
    unread_keys = ("glue_task",)  # whatever glue_task's default, a reward run reads no GLUE task
    sample = PreferenceTuning.sample  # the same preference pairs
    reads = {"data": PAIR_DATA_KEYS, "preference": ("center_rewards_coefficient",)}  # its loss: loop/reward_loss.py
    about = "reward modelling, docs/reward.md"

    def chat_template(self, train) -> bool:
        return PreferenceTuning.chat_template(self, train)

    def cache_key(self, train_on: str) -> str:
        return "-pairs1"  # dpo's pair format version (the `task` in the cache name keeps the two apart)

    def template_note(self, template: str, train_on: str) -> str:
        return f"task=reward: chat template {template}, each row scored at its last token"

    def check(self, sections, bad) -> None:
        """Reward centring >= 0, no packing (a pair's rows are padded)."""
        if (sections["preference"].center_rewards_coefficient or 0) < 0:
            raise bad("center_rewards_coefficient", "must be >= 0 (e.g. 0.01; null: off)")
        if sections["data"].packing:
            raise bad("packing", "task=reward pads each pair's two rows (it packs none); drop packing")


register(RewardModelling())
