"""Trains like scripts/train.py, task=grpo in the fixed-rollouts mode: every completion given, not sampled, so the
update is deterministic and any layout's step equals one process's; the held-out prompts' completions given too, so
its evaluation does as well. Completion (step, prompt row, generation) is drawn from a generator seeded by those
three numbers alone (so every rank and layout gives it the same tokens): 1 to max_completion_length tokens, ending
with a stop token unless it is cut at max_completion_length."""

import functools
import random
import sys

from parallel_finetune.rl import steps
from parallel_finetune.train import main


def fixed_completions(stage, step: int, global_batch: list[int], positions: list[int]) -> list[list[int]]:
    vocab, stop = len(stage.tokenizer), min(stage.settings.stop_ids)
    limit = stage.settings.max_completion_length
    completions = []
    for position in positions:
        for generation in range(stage.grpo.num_generations):
            rng = random.Random(f"{step}-{global_batch[position]}-{generation}")
            length = rng.randint(1, limit)
            tokens = [rng.randrange(8, vocab) for _ in range(length)]
            if length < limit or rng.random() < 0.5:  # a cut one at the limit half the time
                tokens[-1] = stop
            completions.append(tokens)
    return completions


_post_init = steps.RolloutStage.__post_init__


def held_out_completions(stage, positions: list[int]) -> list[list[int]]:
    """The held-out prompts' completions, drawn as a step's are but keyed by step 0 (no training step has it) and
    the prompt's position in the validation split."""
    return fixed_completions(stage, 0, positions, list(range(len(positions))))


def _fixed_post_init(self):
    _post_init(self)
    self.fixed = functools.partial(fixed_completions, self)
    self.fixed_held_out = functools.partial(held_out_completions, self)


if __name__ == "__main__":
    steps.RolloutStage.__post_init__ = _fixed_post_init
    sys.exit(main())
