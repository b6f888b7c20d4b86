"""The reward function both sides of bench/grpo_vs_trl.py call, with TRL's signature: our run names it as
`reward_functions=[..., bench/grpo_trl_reward.py:variety]`, TRL's GRPOTrainer gets the same function object's
source loaded from this file. It reads the decoded text and the token ids, and returns None (does not apply) for an
empty text, so the comparison covers decoding, conversational completions, TRL's NaN handling and the weights."""

from __future__ import annotations


def variety(completions, completion_ids, **kwargs) -> list[float | None]:
    """A tenth of the distinct characters of the completion's text, less a twentieth of its tokens; None when the
    text is empty (a completion of only the end-of-sequence token)."""
    rewards: list[float | None] = []
    for completion, ids in zip(completions, completion_ids):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        rewards.append(len(set(text)) / 10 - len(ids) / 20 if text else None)
    return rewards
