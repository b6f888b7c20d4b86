"""rl/rewards.py's weighting, group-relative advantages and reward metrics against TRL's own code (trl==1.16.0 in
.venv-trl, a peer only): the lines of GRPOTrainer._generate_and_score_completions from the unscorable mask to the
advantages' nan_to_num are read from TRL's source and run on random per-function rewards (NaNs, constant groups,
1 to 8 generations, 1 to 3 functions, random weights), beside ours on the same numbers, for scale_rewards group,
batch and none. Prints one JSON line: the cases run and the largest advantage difference.

  .venv-trl/bin/python bench/grpo_advantages_vs_trl.py   (tests/rl/test_rewards.py runs it)
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package, not an installed one
from parallel_finetune.rl.rewards import group_advantages, reward_metrics, weighted_rewards  # noqa: E402

FIRST = "        unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)"
AFTER = "        # Slice to keep only the local part of the data"


# TRL's files are read, not imported: importing trl.trainer loads transformers, accelerate and the rest (~13 s of CPU)
# for a few lines of tensor code that need only torch.
TRL = Path(importlib.util.find_spec("trl").origin).parent


def trl_block() -> str:
    source = (TRL / "trainer" / "grpo_trainer.py").read_text()
    method = source.index("    def _generate_and_score_completions(")
    start = source.index(FIRST, method)
    return textwrap.dedent(source[start : source.index(AFTER, start)])


def trl_function(path: str, name: str):
    """A top-level function of TRL's source file `path`, defined from its text (it needs only torch)."""
    source = (TRL / path).read_text()
    start = source.index(f"\ndef {name}(") + 1
    end = re.search(r"\n(?=[^\s)])", source[start:])  # the next top-level statement (a signature's `)` is not)
    space = {"torch": torch}
    exec(source[start : start + end.start() if end else len(source)], space)
    return space[name]


trl_nanstd = trl_function("trainer/utils.py", "nanstd")


class TrainerFields:
    multi_objective_aggregation = "sum_then_normalize"  # TRL's default

    def __init__(self, scale_rewards: str, weights: torch.Tensor):
        self.scale_rewards, self.reward_weights = scale_rewards, weights


def trl_metrics(per_function: torch.Tensor, weights: torch.Tensor, unscorable, zero_std) -> dict:
    """The metric lines that follow the slice in TRL's method, on the whole batch."""
    rewards = (per_function * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    metrics = {
        "reward": torch.nanmean(rewards).item(),
        "reward_std": trl_nanstd(rewards).item(),
        "frac_reward_zero_std": zero_std.float().mean().item(),
    }
    for i in range(per_function.shape[1]):
        metrics[f"rewards/f{i}/mean"] = torch.nanmean(per_function[:, i]).item()
        metrics[f"rewards/f{i}/std"] = trl_nanstd(per_function[:, i]).item()
    return metrics


def compare(trials: int = 200) -> dict:
    block = trl_block()
    torch.manual_seed(0)
    worst, differences, cases = 0.0, [], 0
    for trial in range(trials):
        generations, groups, functions = (1, 2, 4, 8)[trial % 4], 1 + trial % 3, 1 + trial % 3
        per_function = torch.randn(generations * groups, functions).round(decimals=1)
        if trial % 5 == 0:
            per_function[torch.rand_like(per_function) < 0.3] = float("nan")
        if trial % 7 == 0:
            per_function[:generations] = 1.0  # a group of equal rewards: zero std
        weights = torch.rand(functions) + 0.1
        for scale in ("group", "batch", "none"):
            cases += 1
            space = dict(
                self=TrainerFields(scale, weights),
                rewards_per_func=per_function.clone(),
                num_generations=generations,
                device="cpu",
                torch=torch,
                nanstd=trl_nanstd,
            )
            exec(block, space)
            ours = group_advantages(weighted_rewards(per_function, weights), generations, scale)
            worst = max(worst, (space["advantages"] - ours.advantages).abs().max().item())
            if not torch.equal(space["is_std_zero"], ours.zero_std):
                differences.append(f"trial {trial} {scale}: is_std_zero differs")
            theirs = trl_metrics(per_function, weights, space["unscorable_mask"], space["is_std_zero"])
            mine = reward_metrics(per_function, weights, [f"f{i}" for i in range(functions)], ours.zero_std)
            for key, value in theirs.items():
                both_nan = value != value and mine[key] != mine[key]
                if not both_nan and abs(value - mine[key]) > 1e-6:
                    differences.append(f"trial {trial} {scale}: {key} TRL {value} ours {mine[key]}")
    return {"cases": cases, "largest_advantage_difference": worst, "differences": differences[:10]}


if __name__ == "__main__":
    print(json.dumps(compare()))
