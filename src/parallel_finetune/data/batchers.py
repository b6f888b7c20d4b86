"""The batcher registry: a task kind names its batcher (`TaskKind.batcher`, tasks/kinds/), and this maps the name
to the maker, so the run's assembly (and the Evaluator) ask the kind once instead of branching on its flags. A new
kind whose batches differ adds its batcher here under a new name; a kind whose batches are another's reuses the name.

    rows          PaddedBatcher, or PackedBatcher when given a PackedShape (packing: true): one row per sample
    pairs         PreferenceBatcher: each pair's chosen and rejected rows together, padded or packed, with the
                  pairs' reference log-probabilities (task=dpo)
    reward_pairs  RewardBatcher: each pair's two rows, padded (never packed), labelled with their margin (task=reward)
    kto           KTOBatcher: unpaired rows, padded (never packed), with their reference log-probabilities, and the
                  KL rows of a global batch (cut to `max_length`) for the reference pass and the KL estimate
                  (task=kto, data/kto.py)
    grpo          GRPOBatcher: a step's sampled completions after their prompts, padded, labelled on the completion
                  tokens with each one's advantage and kept log-probabilities (task=grpo; data/grpo.py)

Every maker is called as make(split, padding, shape, reference, score_prompts, max_length): `shape` None is padded
batches; `reference` is read by the batchers with a reference pass (pairs, kto), `score_prompts` by the pair
batcher alone, `max_length` by the kto batcher alone (0: it makes no KL rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import UserError
from .batch import PackedBatcher, PaddedBatcher, PairReference, PreferenceBatcher, TokenizedSplit
from .grpo import GRPOBatcher
from .kto import KTOBatcher, KTOReference
from .packing import PackedShape
from .reward import RewardBatcher


@dataclass(frozen=True)
class Padding:
    """How a runner wants its padded batches: the tokenizer's padding id and side, lengths padded to a multiple of
    the runner's `pad_multiple`, on its device."""

    pad_id: int
    padding_side: str
    pad_multiple: int
    device: torch.device


def _rows(split, padding: Padding, shape: PackedShape | None, reference, score_prompts: bool, max_length: int):
    if shape is not None:
        return PackedBatcher(split, pad_id=padding.pad_id, shape=shape, device=padding.device)
    return PaddedBatcher(split, **vars(padding))


def _pairs(split, padding: Padding, shape: PackedShape | None, reference, score_prompts: bool, max_length: int):
    return PreferenceBatcher(split, **vars(padding), shape=shape, score_prompts=score_prompts, reference=reference)


def _reward_pairs(split, padding: Padding, shape: PackedShape | None, reference, score_prompts: bool, max_length: int):
    return RewardBatcher(split, **vars(padding))  # a reward model's pairs are padded, whatever `packing` says


def _kto(split, padding: Padding, shape: PackedShape | None, reference, score_prompts: bool, max_length: int):
    return KTOBatcher(split, **vars(padding), reference=reference, max_length=max_length)  # packing: refused


def _grpo(split, padding: Padding, shape: PackedShape | None, reference, score_prompts: bool, max_length: int):
    return GRPOBatcher(split, **vars(padding))  # `split`: a step's RolloutSplit, made by the rollout stage


BATCHERS: dict[str, Callable] = {
    "rows": _rows,
    "pairs": _pairs,
    "reward_pairs": _reward_pairs,
    "kto": _kto,
    "grpo": _grpo,
}


def make_batcher(
    name: str,
    split: TokenizedSplit,
    padding: Padding,
    shape: PackedShape | None = None,
    reference: PairReference | KTOReference | None = None,
    *,
    score_prompts: bool = False,
    max_length: int = 0,
):
    """The batcher a kind names (`kind.batcher`) over `split`: padded as `padding` says, packed into `shape` where
    the batcher packs; `reference`: a pair split's reference log-probabilities (None: none measured);
    `score_prompts`: the objective's (ORPO labels the chosen rows' prompt tokens too); `max_length`: what made-up
    rows are cut to (task=kto's KL rows; 0: none are made)."""
    maker = BATCHERS.get(name)
    if maker is None:
        raise UserError(f"no batcher named {name!r}; registered (data/batchers.py): {', '.join(BATCHERS)}")
    return maker(split, padding, shape, reference, score_prompts, max_length)
