"""GRPO's rewards: the recipe's `reward_functions`, each a built-in by name, a user's own function named as
`path/to/file.py:function` or a reward model named as `model:path/to/folder` (rl/reward_model.py), scored on every
completion, combined with `reward_weights`, and turned into
group-relative advantages, all as TRL's GRPOTrainer does (`_calculate_rewards` and the advantages that follow it,
multi_objective_aggregation="sum_then_normalize", its default).

Built-ins:
  accuracy  1.0 where the completion's final answer equals the row's answer column (`answer_column`, "answer"),
            else 0.0: math answers (the answer parses as math) compared by math-verify (`parse` of the answer and
            of the completion, then `verify`: 0.5 equals 1/2, \\boxed{7} is found); any other answer compared as
            text, the completion ending with it (case and surrounding punctuation aside). None (not scored) where
            a row's answer is empty.
  format    1.0 where the whole completion matches the regular expression `format_pattern` (re.fullmatch, `.`
            matching newlines too), else 0.0.
  length    0.0 up to `length_limit` completion tokens, then a penalty falling linearly to -1.0 at
            `length_limit + length_ramp` tokens and staying there: DAPO's soft overlong punishment (TRL's
            get_soft_overlong_punishment with max_completion_len = limit + ramp, soft_punish_cache = ramp).
A user's function has TRL's signature: `f(prompts, completions, completion_ids, **columns)`, every argument a list
with one entry per completion (the row's other columns repeated for each of its completions; `**kwargs` takes
what it does not name), returning one float or None (does not apply) per completion. The file is the one the
user's recipe names: no code is read from data, a checkpoint or a model folder. Conversational prompts (lists of
messages) come with completions as TRL hands them, `[{"role": "assistant", "content": text}]`.

A reward model (`model:path/to/folder`, a one-output sequence classifier such as task=reward's hf/): its logit of
the prompt and completion rendered with its own tokenizer, as TRL scores one; rl/reward_model.py says how it is
loaded and where it runs.

Combining (TRL): None becomes NaN; rewards = nansum over functions of weight x reward; a completion no function
scored is NaN, left out of its group's mean and standard deviation, and its advantage is 0.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GRPOSection
from ..errors import UserError
from .reward_model import MODEL_PREFIX, Placement, RewardModel, check_reward_model, is_reward_model

BUILTINS = ("accuracy", "format", "length")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)
MATH_VERIFY_PIN = "math-verify==0.9.0"  # requirements.txt's


@dataclass(frozen=True)
class RewardSettings:
    """The recipe's reward keys: `functions` (reward_functions), `weights` (reward_weights; None: 1.0 each) and
    the built-ins' own values."""

    functions: tuple[str, ...]
    weights: tuple[float, ...] | None = None
    format_pattern: str | None = None
    length_limit: int | None = None
    length_ramp: int | None = None  # None: length_limit
    answer_column: str = "answer"

    @classmethod
    def of(cls, grpo: GRPOSection) -> RewardSettings:
        """The `grpo:` section's reward keys."""
        return cls(
            tuple(grpo.reward_functions),
            tuple(grpo.reward_weights) if grpo.reward_weights is not None else None,
            grpo.format_pattern,
            grpo.length_limit,
            grpo.length_ramp,
            grpo.answer_column,
        )


# ------------------------------------------------------------------------------ built-ins
def completion_text(completion) -> str:
    """A completion's text: a string, or TRL's conversational form (a list of messages: the last one's content)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


class AccuracyReward:
    def __init__(self, column: str):
        self.column, self.__name__ = column, "accuracy"

    def __call__(self, completions, **columns) -> list[float | None]:
        try:
            from math_verify import parse, verify
        except ImportError as exc:  # a core dependency; a broken install says what to add
            raise UserError(f"reward accuracy needs math-verify: pip install {MATH_VERIFY_PIN} ({exc})") from None
        # math-verify times out with signal.alarm, which only the main thread may set (TRL does the same)
        timeout = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
        rewards: list[float | None] = []
        for completion, answer in zip(completions, columns[self.column]):
            gold = "" if answer is None else str(answer).strip()
            if not gold:
                rewards.append(None)
                continue
            text = completion_text(completion)
            gold_math = parse(gold, **timeout)
            if gold_math:
                check = {} if not timeout else {"timeout_seconds": None}
                rewards.append(float(verify(gold_math, parse(text, **timeout), **check)))
            else:
                rewards.append(float(ends_with_answer(text, gold)))
        return rewards


def ends_with_answer(text: str, answer: str) -> bool:
    """The text's last words are the answer, as whole words, case and surrounding punctuation aside."""
    words = re.compile(r"\W*(.*?)\W*", re.S)
    target = words.fullmatch(answer.casefold()).group(1)
    ending = words.fullmatch(text.casefold()).group(1)
    return bool(target) and (ending == target or bool(re.search(r"(?<!\w)" + re.escape(target) + r"\Z", ending)))


class FormatReward:
    def __init__(self, pattern: str):
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise UserError(f"format_pattern {pattern!r} is not a regular expression: {exc}") from None
        self.__name__ = "format"

    def __call__(self, completions, **_) -> list[float]:
        return [float(self.pattern.fullmatch(completion_text(c)) is not None) for c in completions]


class LengthReward:
    def __init__(self, limit: int, ramp: int):
        self.limit, self.ramp, self.__name__ = limit, ramp, "length"

    def __call__(self, completion_ids, **_) -> list[float]:
        return [-min(1.0, max(0, len(ids) - self.limit) / self.ramp) for ids in completion_ids]


def builtin(name: str, settings: RewardSettings) -> Callable:
    if name == "accuracy":
        return AccuracyReward(settings.answer_column)
    if name == "format":
        if not settings.format_pattern:
            raise UserError("reward format needs format_pattern: the regular expression a whole completion matches")
        return FormatReward(settings.format_pattern)
    limit, ramp = settings.length_limit, settings.length_ramp
    if limit is None or limit < 1 or (ramp is not None and ramp < 1):
        raise UserError(
            f"reward length needs length_limit (completion tokens before the penalty starts, > 0; got {limit}) and "
            f"length_ramp > 0 or unset (tokens from no penalty to -1; got {ramp})"
        )
    return LengthReward(limit, limit if ramp is None else ramp)


# ------------------------------------------------------------------------------ a user's function
def load_function(spec: str) -> Callable:
    """`path/to/file.py:function` -> the function (the file run as a module of its own); one line naming the file
    or function where it cannot be had."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise UserError(f"reward_functions: {spec!r}: no such file {path_text} (relative to the current folder)")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    loader_spec = importlib.util.spec_from_file_location(f"parallel_finetune_user_reward_{digest}", path)
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any failure is theirs, said in one line
        raise UserError(f"reward_functions: {path_text} could not be loaded: {cause(exc, path)}") from None
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(f"reward_functions: {path_text} has no function {name!r}; its functions: {found}")
    function = getattr(module, name)
    if not callable(function) or isinstance(function, type):
        raise UserError(f"reward_functions: {path_text}:{name} is not a function ({type(function).__name__})")
    return function


def cause(exc: BaseException, path: Path | None = None) -> str:
    """An exception in one line: its type, its message's first line and, when `path` raised it, the line number."""
    text = str(exc).strip().splitlines()
    line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    if line is None and path is not None:
        frames = [f for f in _frames(exc.__traceback__) if Path(f[0].f_code.co_filename).resolve() == path.resolve()]
        line = frames[-1][1] if frames else None
    return f"{type(exc).__name__}: {text[0] if text else ''}" + (f" (line {line})" if line else "")


def _frames(traceback):
    while traceback is not None:
        yield traceback.tb_frame, traceback.tb_lineno
        traceback = traceback.tb_next


# ------------------------------------------------------------------------------ scoring
@dataclass(frozen=True)
class Reward:
    name: str  # the metric's rewards/<name>/mean: a built-in's name, a user function's __name__, a model's folder's
    source: str  # as the recipe names it
    function: Callable | None  # None: a reward model checked, not loaded (Rewards' placement=None)


class Rewards:
    """The recipe's reward functions and weights, ready to score completions. `placement`: where reward models are
    loaded and score (rl/reward_model.py); None checks them only (--check: each folder's config.json, no weights
    loaded), and such Rewards do not score."""

    def __init__(self, settings: RewardSettings, placement: Placement | None = Placement()):
        if not settings.functions:
            raise UserError(f"reward_functions is empty; name at least one of {', '.join(BUILTINS)} or a file")
        self.rewards = [self.resolve(spec, settings, placement) for spec in settings.functions]
        names = [reward.name for reward in self.rewards]
        if len(set(names)) < len(names):
            raise UserError(f"reward_functions: two functions share a name ({names}); each names its own metric")
        weights = settings.weights if settings.weights is not None else (1.0,) * len(self.rewards)
        if len(weights) != len(self.rewards):
            raise UserError(
                f"reward_weights has {len(weights)} values for {len(self.rewards)} reward_functions {names}"
            )
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.answer_column = settings.answer_column

    @staticmethod
    def resolve(spec: str, settings: RewardSettings, placement: Placement | None) -> Reward:
        if spec in BUILTINS:
            return Reward(spec, spec, builtin(spec, settings))
        if is_reward_model(spec):
            if placement is None:
                folder, _ = check_reward_model(spec)
                return Reward(folder.resolve().name, spec, None)
            model = RewardModel(spec, placement)
            return Reward(model.__name__, spec, model)
        if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
            function = load_function(spec)
            return Reward(getattr(function, "__name__", spec.rpartition(":")[2]), spec, function)
        raise UserError(
            f"reward_functions: unknown reward {spec!r}; the built-ins are {', '.join(BUILTINS)}, or name your own "
            f"function as path/to/file.py:function, a reward model as {MODEL_PREFIX}path/to/folder"
        )

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self.rewards]

    def check_columns(self, columns: Sequence[str], where: str) -> None:
        """The data's columns (`where`: the file or split) hold what the rewards read: accuracy's answer column."""
        if "accuracy" in self.names and self.answer_column not in columns:
            raise UserError(
                f"{where}: reward accuracy compares completions with the column {self.answer_column!r}, which the "
                f"rows lack (their columns: {', '.join(columns)}); add it or set answer_column"
            )

    def score(self, prompts: list, completions: list[str], completion_ids: list[list[int]], columns: dict):
        """(completions, functions) rewards (a tensor), NaN where a function returned None. `columns`: the rows'
        other columns, one entry per completion (TRL's own keys prompt, completion, completion_ids left out)."""
        self.check_columns(list(columns), "the rollout's rows")
        if any(reward.function is None for reward in self.rewards):
            raise RuntimeError("these Rewards were made to check the recipe (placement=None); they do not score")
        if prompts and not isinstance(prompts[0], str):  # conversational: completions as TRL hands them
            completions = [[{"role": "assistant", "content": text}] for text in completions]
        table = torch.full((len(completions), len(self.rewards)), float("nan"))
        reserved = ("prompt", "completion", "completion_ids")
        columns = {key: value for key, value in columns.items() if key not in reserved}
        for j, reward in enumerate(self.rewards):
            try:
                values = reward.function(
                    prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
                )
            except UserError:
                raise
            except Exception as exc:  # the user's function: say which and why, in one line
                raise UserError(f"reward function {reward.source} raised {cause(exc)}") from None
            table[:, j] = torch.tensor(checked(values, reward, len(completions)), dtype=torch.float32)
        return table


def checked(values, reward: Reward, count: int) -> list[float]:
    """A function's rewards as floats (None -> NaN), or one line on what is wrong with them."""
    try:
        values = list(values)
    except TypeError:
        raise UserError(
            f"reward function {reward.source} returned {type(values).__name__}, not a list of one float or None per "
            "completion"
        ) from None
    if len(values) != count:
        raise UserError(
            f"reward function {reward.source} returned {len(values)} rewards for {count} completions (one float or "
            "None per completion)"
        )
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise UserError(
                f"reward function {reward.source} returned {value!r} for completion {i}; return a float or None"
            ) from None
        if number != number:
            raise UserError(
                f"reward function {reward.source} returned NaN for completion {i}; return None where it does not apply"
            )
        out.append(number)
    return out


# ------------------------------------------------------------------------------ TRL's combination and advantages
def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted nansum over functions; NaN where no function scored it."""
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_function).all(dim=1)] = torch.nan
    return rewards


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the non-NaN values (Bessel's correction; NaN for fewer than two), as TRL's."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = (variance * correction).sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


@dataclass
class Advantages:
    advantages: torch.Tensor  # (completions,)
    std: torch.Tensor  # (completions,) the std each was scaled by (group's or batch's)
    zero_std: torch.Tensor  # (completions,) bool: the std is ~0 (frac_reward_zero_std)


def check_groups(completions: int, num_generations: int, what: str = "the batch") -> None:
    if num_generations < 1 or completions % num_generations:
        raise UserError(
            f"{what} holds {completions} completions, not whole groups of num_generations={num_generations}: "
            f"make it a multiple of num_generations"
        )


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> Advantages:
    """TRL's group-relative advantages of the whole batch's rewards (groups contiguous): reward minus its group's
    mean, divided by the group's std (`group`), the batch's (`batch`) or nothing (`none`), + 1e-4."""
    if scale_rewards not in SCALE_REWARDS:
        raise UserError(f"scale_rewards={scale_rewards!r}; valid: {', '.join(SCALE_REWARDS)}")
    check_groups(len(rewards), num_generations)
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return Advantages(torch.nan_to_num(advantages, nan=0.0), std, zero_std)


def reward_metrics(per_function: torch.Tensor, weights: torch.Tensor, names: list[str], zero_std: torch.Tensor) -> dict:
    """TRL's reward metrics of a step's whole batch: rewards/<name>/mean and /std, reward, reward_std,
    frac_reward_zero_std."""
    metrics = {}
    for j, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_function[:, j]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_function[:, j]).item()
    rewards = weighted_rewards(per_function, weights)
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = zero_std.float().mean().item()
    return metrics
