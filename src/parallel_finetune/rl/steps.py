"""task=grpo's step source: what turns a step's global batch of prompts into the completions the Trainer trains on.
The Trainer stays the one trainer; before a step's slices it asks this stage (`Trainer.rollouts`) for the step's
batcher, and everything after (slices, the objective, the update, the metrics' reduction) is every task's.

A step, on every rank alike:
  1. rollout   this data-parallel rank's share of the step's prompts (contiguous, P / dp each; tensor-parallel
               ranks share theirs) sampled num_generations times each (rl/rollout.py `sample`: the run's seed and
               the step number seed every token, so no generator state is kept and a resumed run samples what the
               uninterrupted one would have); or, in the fixed-rollouts mode (`fixed`), the completions given;
               then the completions all-gathered over the data-parallel ranks, so every rank holds the step's
               whole global batch in prompt-major order
  2. scoring   every reward function on every completion (rl/rewards.py; each rank alike, so the reward metrics
               and scale_rewards=batch's standard deviation are the global batch's with no further collective;
               a reward model's forwards split over every rank and its scores all-gathered: rl/reward_model.py),
               the weighted reward and the group-relative advantages
  3. the step's RolloutSplit (data/grpo.py) and its "grpo" batcher; the Trainer's slices cut it as any split.
The completions of the step (prompt, completion, each reward, advantage) go to the reporter's generations.jsonl and
trackers; the metrics (TRL's names: reward, reward_std, rewards/<function>/mean and /std, frac_reward_zero_std,
completions/mean_length, min_length, max_length, clipped_ratio) and the time split (rollout_s, scoring_s) join the
step's record.

num_iterations > 1: a rollout is trained on for num_iterations steps (TRL's), its old policy's per-token
log-probabilities measured right after it (no gradients, eval mode), the steps in between reusing it (the prompts
the sampler drew for them are not read). beta > 0 (LoRA only: tasks/kinds/grpo.py refuses it with full fine-tuning):
the reference's per-token log-probabilities, the same model with its adapters disabled. Both measured on every rank
for the step's whole global batch (the same forwards everywhere, as FSDP needs), through the objective's head
(chunked, vocabulary-parallel: parallel/vocab.token_nll), and handed to the batcher as the split's columns.

A checkpoint taken between a rollout's iterations keeps that rollout (`kept_state`: the step that sampled it, its
RolloutSplit with the old and reference log-probabilities, its metrics; outputs/checkpoint.py writes it as
rollout.json, rank 0's, since every rank holds the same whole global batch), and a resumed run trains its next
iterations on it (`kept_problem` checks what is read, `restore_kept` makes its batcher again), so it continues as
the uninterrupted run would; at a rollout boundary nothing is kept: the next rollout is sampled from the step
number alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import GRPOSection, TrainingSection
from ..data.batchers import Padding, make_batcher
from ..data.chat import stop_ids
from ..data.grpo import RolloutSplit
from ..errors import UserError
from ..loop.loss import HiddenTokenLoss, hidden_loss_forward
from ..loop.runner import model_inputs
from ..model.lora import adapters_disabled
from ..parallel.layout import Layout
from ..parallel.vocab import token_nll
from .reward_model import Placement
from .rewards import Rewards, RewardSettings, group_advantages, reward_metrics, weighted_rewards
from .rollout import SamplingSettings, sample

# (step, the step's global batch of prompt indices, this rank's positions in it) -> each of those prompts'
# num_generations completions (token lists, prompt-major): the fixed-rollouts mode (tests, a recorded rollout)
FixedRollouts = Callable[[int, list[int], list[int]], list[list[int]]]


@dataclass(frozen=True)
class PromptRows:
    """The training prompts as the stage reads them: tokens, what the reward functions receive as the prompt (a
    text or messages) and each row's other columns."""

    ids: list[list[int]]
    prompts: list
    columns: list[dict]

    @classmethod
    def of(cls, split) -> PromptRows:
        """A prepared grpo split (data/prompts.py's columns)."""
        prompts = [json.loads(p) for p in split["prompt"][:]]
        return cls(split["input_ids"][:], prompts, [json.loads(c) for c in split["columns"][:]])


@dataclass
class RolloutStage:
    """The step source of a grpo run (see the module docstring)."""

    model: nn.Module  # what samples: the run's model as built (whole, tensor-parallel or FSDP-sharded)
    tokenizer: object
    rows: PromptRows
    settings: SamplingSettings
    rewards: Rewards
    grpo: GRPOSection
    layout: Layout
    padding: Padding
    autocast: Callable = contextlib.nullcontext  # the run's mixed precision for the sampling forwards
    fixed: FixedRollouts | None = None  # completions given instead of sampled
    # the held-out prompts' completions given too (their positions in the validation split -> num_generations
    # completions each, prompt-major), so that a fixed-rollouts run's evaluation compares across layouts
    fixed_held_out: Callable[[list[int]], list[list[int]]] | None = None
    prompts_per_rank: int = 0  # a step's prompts on one data-parallel rank: an evaluation samples as many at once

    objective: object = None  # the run's GRPOLoss: its head, chunking and softcap score the kept log-probabilities
    lora: bool = False  # the reference is the model with its adapters disabled
    kept: tuple | None = field(default=None, init=False)  # num_iterations > 1: (step sampled, what step() returned)

    def __post_init__(self):
        if self.grpo.beta and not self.lora:
            raise UserError("beta > 0 needs peft=lora here (the reference: the base with its adapters disabled)")

    @torch.no_grad()
    def token_logps(self, split: RolloutSplit, reference: bool) -> list[list[float]]:
        """Each completion's scored tokens' log-probabilities under the model as it is (eval mode), or under the
        reference (its adapters disabled), through the objective's head."""
        batcher = make_batcher("grpo", split, self.padding)
        batch = batcher.batch(list(range(len(split))))
        scorer = _TokenLogps(self.objective.head, self.objective.chunk_tokens, self.objective.softcap)
        scorer.scale = self.objective.logit_scale  # the tempered distribution, as the loss scores the policy
        disabled = adapters_disabled(self.model) if reference else contextlib.nullcontext()
        training = self.model.training
        self.model.eval()
        try:
            with disabled, self.autocast():
                _, stats = hidden_loss_forward(self.model, model_inputs(batch), batch.labels, scorer)
        finally:
            self.model.train(training)
        values = stats["logps"].tolist() if stats else []
        bounds = [0]
        for count in split.scored:
            bounds.append(bounds[-1] + count)
        return [values[a:b] for a, b in zip(bounds, bounds[1:])]

    def mine(self, prompts: int) -> list[int]:
        """This data-parallel rank's positions among a step's `prompts` (contiguous)."""
        dp, rank = self.layout.dp, self.layout.dp_rank
        if prompts % dp:
            raise UserError(
                f"batch_size / num_generations = {prompts} prompts per step, which the {dp} data-parallel ranks do "
                "not share evenly; make batch_size a multiple of num_generations x the data-parallel degree"
            )
        share = prompts // dp
        return list(range(rank * share, (rank + 1) * share))

    def completions(self, global_batch: list[int], step: int) -> tuple[list[list[int]], list[bool]]:
        """Every completion of the step's global batch, prompt-major, and whether each was truncated."""
        positions = self.mine(len(global_batch))
        if self.fixed is not None:
            mine = self.fixed(step, global_batch, positions)
            limit = self.settings.max_completion_length
            truncated = [len(c) >= limit and c[-1] not in self.settings.stop_ids for c in mine]
        else:
            rollout = sample(
                self.model,
                [self.rows.ids[global_batch[p]] for p in positions],
                positions,
                self.settings,
                step,
                autocast=self.autocast,
            )
            mine, truncated = rollout.completions(), rollout.truncated.tolist()
        if self.layout.dp > 1:
            parts = [None] * self.layout.dp
            dist.all_gather_object(parts, (mine, truncated), group=self.layout.dp_group)
            mine = [c for part in parts for c in part[0]]
            truncated = [t for part in parts for t in part[1]]
        return mine, truncated

    @torch.no_grad()
    def held_out(self, split) -> dict:
        """The held-out prompts' rewards (`split`: a prepared grpo split): num_generations completions of each,
        sampled as a step's are but always with the same draws (step 0, which no training step has), so that
        evaluations compare (or, with `fixed_held_out`, given); each data-parallel rank samples its share, the
        completions are gathered, and every rank scores them all, as a step's."""
        rows = PromptRows.of(split)
        dp, rank = self.layout.dp, self.layout.dp_rank
        if len(rows.ids) < dp:
            raise UserError(
                f"the validation split holds {len(rows.ids)} prompts, fewer than the {dp} data-parallel ranks"
            )
        bounds = [len(rows.ids) * r // dp for r in range(dp + 1)]
        positions = list(range(bounds[rank], bounds[rank + 1]))
        completions = []
        for piece in self.held_out_pieces(positions, -(-len(rows.ids) // dp)):
            sampled = piece or positions[-1:]  # this rank's share ran out: it decodes beside the others, unused
            if self.fixed_held_out is not None:
                drawn = self.fixed_held_out(sampled)
            else:
                drawn = sample(
                    self.model, [rows.ids[p] for p in sampled], sampled, self.settings, 0, autocast=self.autocast
                ).completions()
            completions += drawn if piece else []
        if dp > 1:  # in rank order: every prompt's completions, prompt-major
            parts = [None] * dp
            dist.all_gather_object(parts, completions, group=self.layout.dp_group)
            completions = [c for part in parts for c in part]
        count = self.grpo.num_generations
        every = [p for p in range(len(rows.ids)) for _ in range(count)]
        prompts = [rows.prompts[p] for p in every]
        columns = {name: [rows.columns[p][name] for p in every] for name in rows.columns[0]}
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        per_function = self.rewards.score(prompts, texts, completions, columns)
        rewards = weighted_rewards(per_function, self.rewards.weights)
        results = {"eval_reward": torch.nanmean(rewards).item()}
        for j, name in enumerate(self.rewards.names):
            results[f"eval_rewards/{name}/mean"] = torch.nanmean(per_function[:, j]).item()
        return results

    def held_out_pieces(self, positions: list[int], largest_share: int) -> list[list[int]]:
        """This rank's held-out prompts in pieces of at most a step's prompts per rank (`prompts_per_rank`), so that
        an evaluation holds no more rows at once than a training step does (tools/planner.py counts a step's), and
        in as many pieces as the rank with the largest share, so that every rank samples in lockstep (FSDP): a rank
        whose share ran out gets an empty piece. A completion does not depend on the rows sampled beside it (its
        draws are keyed by its prompt and generation), so the pieces change no completion. 0: the whole share."""
        size = self.prompts_per_rank or largest_share
        return [positions[i * size : (i + 1) * size] for i in range(-(-largest_share // size))]

    def step(self, global_batch: list[int], step: int) -> tuple[object, list[int], dict, list[dict]]:
        """The step's batcher, its completion indices (the Trainer's global batch), its metrics and its records:
        a new rollout, or (num_iterations > 1, between a rollout's iterations) the kept one again."""
        if self.kept is not None and self.rollout_of(step) == self.rollout_of(self.kept[0]):
            batcher, indices, metrics, _ = self.kept[1]
            return batcher, indices, metrics | {"rollout_s": 0.0, "scoring_s": 0.0}, []
        made = self.rollout(global_batch, step)
        self.kept = (step, made) if self.grpo.num_iterations > 1 else None
        return made

    def rollout_of(self, step: int) -> int:
        """Which rollout `step` trains on (0 for steps 1 to num_iterations, ...)."""
        return (step - 1) // self.grpo.num_iterations

    def inside_rollout(self, step: int) -> bool:
        """Whether the step after `step` trains on `step`'s rollout again: a checkpoint of `step` keeps it."""
        return self.rollout_of(step + 1) == self.rollout_of(step)

    def kept_state(self, step: int) -> dict | None:
        """What a checkpoint of `step` keeps of the rollout (JSON values), or None: none to train on again."""
        if self.kept is None or not self.inside_rollout(step) or self.rollout_of(self.kept[0]) != self.rollout_of(step):
            return None
        sampled, (batcher, _, metrics, _) = self.kept
        kept = metrics | {"rollout_s": 0.0, "scoring_s": 0.0}  # as the steps trained on it again report them
        return {"sampled_step": sampled, "split": batcher.split.written(), "metrics": kept}

    def vocab_size(self) -> int:
        """The token ids the model embeds (and samples): its config's vocab_size, which may pad the tokenizer's."""
        return max(len(self.tokenizer), getattr(getattr(self.model, "config", None), "vocab_size", 0))

    def kept_problem(self, written, step: int) -> str | None:
        """Why `written` (what a checkpoint of `step` kept) cannot be trained on again, or None."""
        if not isinstance(written, dict) or sorted(written) != ["metrics", "sampled_step", "split"]:
            return "expected the keys metrics, sampled_step, split"
        sampled, metrics = written["sampled_step"], written["metrics"]
        if not (type(sampled) is int and 1 <= sampled <= step and self.rollout_of(sampled) == self.rollout_of(step)):
            return f"sampled_step is {sampled!r}, expected the step that sampled step {step}'s rollout"
        if not self.inside_rollout(step):
            return f"step {step} ends its rollout's {self.grpo.num_iterations} iterations: nothing is trained on again"
        if not (isinstance(metrics, dict) and all(map(_number, metrics.values()))):
            return "metrics must map names to numbers"
        try:
            split = RolloutSplit.read(written["split"], self.vocab_size())
        except ValueError as exc:
            return f"split: {exc}"
        if len(split) % self.grpo.num_generations:
            return f"split: {len(split)} completions, not groups of num_generations={self.grpo.num_generations}"
        if split.old_logps is None or (split.reference_logps is None) != (not self.grpo.beta):
            return "split: expected the old policy's log-probabilities, and the reference's exactly when beta > 0"
        return None

    def restore_kept(self, written: dict | None) -> None:
        """The rollout a checkpoint kept (`written`, checked by kept_problem) trained on again by the next steps;
        None: the next step samples."""
        if written is None:
            self.kept = None
            return
        split = RolloutSplit.read(written["split"], self.vocab_size())
        batcher = make_batcher("grpo", split, self.padding)
        self.kept = (written["sampled_step"], (batcher, list(range(len(split))), written["metrics"], []))

    def rollout(self, global_batch: list[int], step: int) -> tuple[object, list[int], dict, list[dict]]:
        started = time.perf_counter()
        completions, truncated = self.completions(global_batch, step)
        sampled = time.perf_counter()
        count = self.grpo.num_generations
        rows = [i for i in global_batch for _ in range(count)]
        prompts = [self.rows.prompts[i] for i in rows]
        columns = {name: [self.rows.columns[i][name] for i in rows] for name in self.rows.columns[rows[0]]}
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        per_function = self.rewards.score(prompts, texts, completions, columns)
        rewards = weighted_rewards(per_function, self.rewards.weights)
        advantages = group_advantages(rewards, count, self.grpo.scale_rewards)
        masked = self.grpo.mask_truncated_completions
        split = RolloutSplit(
            ids=[self.rows.ids[i] + c for i, c in zip(rows, completions)],
            prompt_lengths=[len(self.rows.ids[i]) for i in rows],
            scored=[0 if masked and cut else len(c) for c, cut in zip(completions, truncated)],
            advantages=advantages.advantages.tolist(),
        )
        if self.grpo.num_iterations > 1 or self.grpo.beta:  # what the loss reads of the policy as it sampled
            old = self.token_logps(split, reference=False) if self.grpo.num_iterations > 1 else None
            reference = self.token_logps(split, reference=True) if self.grpo.beta else None
            split = dataclasses.replace(split, old_logps=old, reference_logps=reference)
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
        metrics = reward_metrics(per_function, self.rewards.weights, self.rewards.names, advantages.zero_std)
        metrics |= {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": sum(truncated) / len(truncated),
            "rollout_s": sampled - started,
            "scoring_s": time.perf_counter() - sampled,
        }
        records = [
            {
                "prompt": prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False),
                "answer": text,
                "rewards": dict(zip(self.rewards.names, values)),
                "advantage": advantage,
            }
            for prompt, text, values, advantage in zip(
                prompts, texts, per_function.tolist(), advantages.advantages.tolist()
            )
        ]
        batcher = make_batcher("grpo", split, self.padding)
        return batcher, list(range(len(split))), metrics, records


def _number(value) -> bool:
    """A metric's value: a number (NaN too: a reward function that scored nothing)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _TokenLogps(HiddenTokenLoss):
    """Stands in for the head in one no-gradient forward: each labelled position's log-probability (of the logits
    times `scale`), in order."""

    scale = 1.0

    def scored(self, hidden: torch.Tensor, labels: torch.Tensor):
        if self.chunk_tokens:
            nll = token_nll(hidden, self.head, labels, self.chunk_tokens, self.softcap, self.scale)
        else:
            logits = self.logits(hidden).float() * self.scale
            nll = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        return nll.sum(), {"logps": -nll}


def _gather_over_every_rank(mine: list) -> list[list]:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return parts


def make_rollouts(
    *,
    built,
    prepared,
    grpo: GRPOSection,
    training: TrainingSection,
    layout: Layout,
    padding: Padding,
    lora: bool,
    compute_dtype: torch.dtype = torch.float32,
):
    """A grpo run's RolloutStage: the built model (loop/model_stage.BuiltModel: the model, its objective's head,
    its runner's mixed precision), its prompts (the prepared train split), its tokenizer's stop tokens (EOS and the
    chat template's end of turn), the recipe's sampling and reward keys, its seed and batch (a step's prompts per
    data-parallel rank: what an evaluation samples at once), and the run's compute dtype (its reward models'
    weights)."""
    tokenizer = prepared.tokenizer
    settings = SamplingSettings(
        num_generations=grpo.num_generations,
        max_completion_length=grpo.max_completion_length,
        stop_ids=frozenset(stop_ids(tokenizer)),
        pad_id=tokenizer.pad_token_id,
        temperature=grpo.temperature,
        top_p=grpo.top_p,
        top_k=grpo.top_k,
        seed=training.seed,
    )
    placement = Placement(  # reward models: whole on every rank, each scoring its share (rl/reward_model.py)
        device=padding.device,
        dtype=compute_dtype,
        rank=layout.rank,
        ranks=layout.world_size,
        gather=_gather_over_every_rank if layout.world_size > 1 else None,
    )
    rewards = Rewards(RewardSettings.of(grpo), placement)
    train = prepared.splits["train"]
    rewards.check_columns(prepared.task.columns[1:], f"the training rows ({prepared.source.description})")
    return RolloutStage(
        built.model,
        tokenizer,
        PromptRows.of(train),
        settings,
        rewards,
        grpo,
        layout,
        padding,
        getattr(built.runner, "autocast", contextlib.nullcontext),
        objective=built.objective,
        lora=lora,
        prompts_per_rank=training.batch_size // grpo.num_generations // layout.dp,
    )


# the step sources a task kind may name (`TaskKind.step_source`)
STEP_SOURCES: dict[str, Callable] = {"rollouts": make_rollouts}


def make_step_source(name: str, **parts):
    """The step source a kind names, made of the run's parts (make_rollouts's keywords)."""
    maker = STEP_SOURCES.get(name)
    if maker is None:
        raise UserError(f"no step source named {name!r}; registered (rl/steps.py): {', '.join(STEP_SOURCES)}")
    return maker(**parts)
