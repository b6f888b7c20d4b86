"""GRPO's rollouts: `num_generations` completions of each prompt sampled from the current policy, batched with a
KV cache (transformers' own DynamicCache: one forward of the left-padded prompts, then one forward of one new
token per row), with temperature, top-k and top-p, stopping each row at the template's end-of-turn token or EOS
(data/chat.py's `stop_ids`) or after `max_completion_length` tokens.

Randomness is counter-based, not a generator's state: the uniform that picks completion (prompt p, generation g)'s
t-th token is a hash of (seed, step, p, g, t) (splitmix64), and a token is drawn by inverting its filtered
distribution's CDF at that one uniform. So a completion is the same whatever else is sampled beside it: a
data-parallel rank sampling its share of the step's prompts samples exactly what one process samples for them,
every tensor-parallel rank (same logits, same uniforms) samples the same tokens, and a resumed run samples what
the uninterrupted one would have with no generator state saved (the step number is all it needs). `prompt_indices`
are each prompt's place in the step's global batch, which no layout changes.

Layouts: one process; data parallel; FSDP2/HSDP, whose forwards all-gather parameters, so every rank must run the
same number of forwards: the decode loop goes on until every rank's rows are done (one all-reduce of a flag per
token, over `group`, by default the whole world); tensor parallel (the families' DTensor plans: attention keeps
each rank's heads in the cache, the LM head's logits come back whole). Pipeline parallelism is not served: a
pipeline's stages keep no cache between micro-batches, and the coordinator refuses task=grpo with
pipeline_parallel_degree > 1. The model is in eval mode while it samples (no dropout, LoRA's included) and goes
back to the mode it was in; a LoRA model (model/lora.py, in place) or a peft `PeftModel` samples the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import DynamicCache


@dataclass(frozen=True)
class SamplingSettings:
    """What a rollout samples: TRL's GRPOConfig names (`top_k` 0: no top-k; temperature 0: greedy, as generate's
    do_sample=False). `stop_ids`: the tokens that end a completion (kept in it, as TRL's completion mask keeps
    EOS); `pad_id` fills a row after its stop."""

    num_generations: int
    max_completion_length: int
    stop_ids: frozenset[int]
    pad_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.num_generations < 1 or self.max_completion_length < 1:
            raise ValueError("num_generations and max_completion_length must be positive")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0")


@dataclass
class Rollout:
    """The completions of one call, prompt-major (prompt 0's generations 0..G-1, then prompt 1's, as TRL's
    repeat_interleave orders them, so a group is contiguous). `completion_ids`: (completions, longest) with
    `pad_id` after a row's stop; `completion_mask`: 1 on a completion's tokens, its stop token included;
    `truncated`: reached max_completion_length without a stop."""

    prompt_indices: torch.Tensor  # (completions,) each completion's prompt, as given
    generations: torch.Tensor  # (completions,) 0..num_generations-1
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor

    def completions(self) -> list[list[int]]:
        """Each completion's tokens (its stop token included, no padding)."""
        lengths = self.completion_mask.sum(-1).tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths)]


# ------------------------------------------------------------------------------ counter-based uniforms
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, step: int, prompt_indices: Iterable[int], generations: Iterable[int], length: int):
    """(completions, length) float64s in [0, 1), a numpy array: entry [i, t] is a function of (seed, step,
    prompt_indices[i], generations[i], t) only."""
    with np.errstate(over="ignore"):
        x = _mix(np.array([(seed & _MASK) ^ _GOLDEN], dtype=np.uint64))
        x = _mix(x ^ np.uint64(step & _MASK))
        x = _mix(x ^ np.asarray(list(prompt_indices), dtype=np.uint64)[:, None])
        x = _mix(x + np.uint64(_GOLDEN) * (np.asarray(list(generations), dtype=np.uint64)[:, None] + np.uint64(1)))
        x = _mix(x ^ (np.arange(length, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN)))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53  # 53 bits: exact in a float64


def next_tokens(logits: torch.Tensor, u: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """One token per row of `logits` (rows, vocabulary), fp32: greedy at temperature 0, else the temperature's
    distribution filtered by top-k then top-p (as generate's processors, in that order) and sampled by inverting
    its CDF at `u` (rows,). Each row's token depends on its own logits and uniform only."""
    if settings.temperature == 0:
        return logits.argmax(-1)
    logits = logits / settings.temperature
    vocabulary = logits.shape[-1]
    order = None
    if settings.top_p < 1 or 0 < settings.top_k < vocabulary:
        # stable: tied logits keep the vocabulary's order, so the draw does not depend on the sort's whims
        logits, order = logits.sort(dim=-1, descending=True, stable=True)
        if 0 < settings.top_k < vocabulary:
            logits, order = logits[:, : settings.top_k], order[:, : settings.top_k]
    probs = logits.softmax(-1)
    if settings.top_p < 1:
        # keep the most likely tokens until their mass reaches top_p (the first one always)
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(before >= settings.top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    threshold = (u.to(cdf) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, threshold, right=True).clamp(max=cdf.shape[-1] - 1)
    return (index if order is None else order.gather(-1, index)).squeeze(-1)


# ------------------------------------------------------------------------------ the batched decode
def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, attention mask and positions of `rows` padded on the left: each row's positions are those of its
    unpadded self (0 at its first token), as training sees it."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def any_left(running: torch.Tensor, group) -> bool:
    """Whether any row of any rank in `group` is still running (every rank then runs the next forward)."""
    flag = running.any().to(torch.int32).reshape(1)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


WORLD = "world"  # sample's default group: every rank of torch.distributed's world, when there is one


def lockstep_group(group):
    """The process group whose ranks run as many forwards as this one: `WORLD` (the default) is torch.distributed's
    whole world when there is one (every rank must run the same number of forwards under FSDP); None: this
    process alone."""
    if not (isinstance(group, str) and group == WORLD):
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: list[list[int]],
    prompt_indices: list[int],
    settings: SamplingSettings,
    step: int,
    *,
    group=WORLD,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Rollout:
    """`settings.num_generations` completions of each prompt (token lists) by `model` (a causal LM, in any layout
    but a pipeline's), `prompt_indices` their places in the step's global batch (what seeds them with `step`).
    `group`: the ranks that must run as many forwards as this one (`lockstep_group`: the world by default, None
    for this process alone);
    `autocast`: the run's mixed precision for the forwards."""
    if not prompts or len(prompts) != len(prompt_indices):
        raise ValueError(f"{len(prompts)} prompts and {len(prompt_indices)} indices; at least one prompt per rank")
    group = lockstep_group(group)
    count = settings.num_generations
    rows = [list(prompt) for prompt in prompts for _ in range(count)]
    keys = [index for index in prompt_indices for _ in range(count)]
    generations = [g for _ in prompts for g in range(count)]
    device = next(model.parameters()).device
    noise = torch.from_numpy(uniforms(settings.seed, step, keys, generations, settings.max_completion_length))
    training = model.training
    model.eval()
    try:
        tokens, lengths, stopped = decode(model, rows, noise.to(device), settings, group, autocast)
    finally:
        model.train(training)
    width = int(lengths.max())
    tokens = tokens[:, :width]
    mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return Rollout(
        prompt_indices=torch.tensor(keys, device=device),
        generations=torch.tensor(generations, device=device),
        completion_ids=tokens.masked_fill(~mask, settings.pad_id),
        completion_mask=mask.long(),
        truncated=~stopped,
    )


def decode(model, rows, noise, settings, group, autocast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode loop: the prompts' forward fills the cache, then each new token is one forward of one token per
    row. Returns the tokens (rows, steps run), each row's length (its stop included) and whether it stopped."""
    ids, mask, positions = left_padded(rows, settings.pad_id, noise.device)
    stops = torch.tensor(sorted(settings.stop_ids), dtype=torch.long, device=ids.device)
    cache = DynamicCache(config=model.config)
    running = torch.ones(len(rows), dtype=torch.bool, device=ids.device)
    lengths = torch.zeros(len(rows), dtype=torch.long, device=ids.device)
    tokens = []
    for t in range(settings.max_completion_length):
        with autocast():
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        token = next_tokens(out.logits[:, -1].float(), noise[:, t], settings)
        token = token.masked_fill(~running, settings.pad_id)
        tokens.append(token)
        lengths += running.long()
        running = running & ~torch.isin(token, stops)
        if t + 1 == settings.max_completion_length or not any_left(running, group):
            break
        ids = token[:, None]
        mask = torch.cat([mask, torch.ones_like(ids)], dim=-1)
        positions = positions[:, -1:] + 1
    return torch.stack(tokens, dim=-1), lengths, ~running
