"""A reward model as a GRPO reward function: `reward_functions: [model:path/to/folder]`, a transformers folder
holding a one-output sequence classifier (num_labels 1: the hf/ folder a task=reward run exports, or any
...ForSequenceClassification of the kind), scored as TRL's GRPOTrainer scores a reward model: each completion
appended to its prompt and rendered with the reward model's own tokenizer (conversational prompts: the prompt's
messages and the completion as the assistant's turn, through its chat template; text prompts: prompt + completion),
tokenized with no special tokens added, right-padded, and the classifier's one logit read (transformers reads it at
each row's last token that is not the padding id). The metric is rewards/<the folder's name>/mean, TRL's (the last
part of the model's path).

Loading: once per rank, when the run's rewards are made, never with code from the folder (model/pretrained.py);
weights in the run's compute dtype (fp32, or bf16/fp16 under mixed precision), in eval mode, no gradients, on the
rank's device; a folder whose weight files lack a weight (a head that would be random) is refused.

Placement (`Placement`): every rank holds the whole reward model, never sharded by the policy's layout (a reward
model is one forward per completion with no optimizer state, usually far smaller than the policy, and the policy's
tensor-parallel plan is its family's, which an arbitrary classifier need not have). Every rank of the run holds the
step's whole global batch when it scores (rl/steps.py), so the work is split instead of repeated: rank r of W scores
the r-th contiguous share of the completions, in batches of BATCH_ROWS, and the scores are all-gathered over every
rank: each completion is scored once in the run, whatever the layout. Each row's score does not depend on which
rows share its batch (right padding, masked), so the scores are one process's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError, one_line
from ..model.pretrained import load_hf_config, load_hf_tokenizer

MODEL_PREFIX = "model:"
BATCH_ROWS = 32  # completions per reward-model forward


@dataclass(frozen=True)
class Placement:
    """Where a run's reward models score: their weights' device and dtype, and this rank's share of the rows (rank
    of ranks; `gather`: each rank's list -> every rank's lists in rank order, a collective over every rank)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    rank: int = 0
    ranks: int = 1
    gather: Callable[[list], list[list]] | None = None

    def share(self, count: int) -> range:
        """This rank's contiguous share of `count` rows (the first ranks take one more where they do not divide)."""
        return range(count * self.rank // self.ranks, count * (self.rank + 1) // self.ranks)


def is_reward_model(spec: str) -> bool:
    return spec.startswith(MODEL_PREFIX)


def check_reward_model(spec: str):
    """`model:path/to/folder` -> (the folder, its transformers config): one line where the folder is missing, holds
    no model, or is not a one-output sequence classifier. Reads config.json only, no weights (--check calls it)."""
    text = spec[len(MODEL_PREFIX) :]
    where = f"reward_functions: {spec!r}"
    folder = Path(text).expanduser()
    if not text or not folder.is_dir():
        raise UserError(f"{where}: no such folder {text!r} (relative to the current folder)")
    if not (folder / "config.json").is_file():
        if (folder / "hf" / "config.json").is_file():
            hint = f"it holds a run's hf/: give model:{(folder / 'hf').as_posix()}"
        elif (folder / "adapter_config.json").is_file() or (folder / "adapter" / "adapter_config.json").is_file():
            hint = (
                "a LoRA adapter is not read as a reward model: export the merged model (lora_export_merged: true) "
                "and give its hf/"
            )
        else:
            hint = "give a transformers folder, such as the hf/ a task=reward run exports"
        raise UserError(f"{where}: {folder} holds no config.json; {hint}")
    try:
        hf_config = load_hf_config(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: {folder / 'config.json'} is not a transformers config ({one_line(exc)})") from None
    architectures = getattr(hf_config, "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        kind = architectures[0] if architectures else f"model_type {hf_config.model_type!r} with no architectures"
        raise UserError(
            f"{where}: {folder / 'config.json'} is a {kind}, not a sequence classifier; a reward model is a "
            "...ForSequenceClassification with one output (num_labels 1), as task=reward exports"
        )
    if hf_config.num_labels != 1:
        raise UserError(
            f"{where}: {folder / 'config.json'} is a classifier of {hf_config.num_labels} labels; a reward model has "
            "one output, its score (num_labels 1, as task=reward exports)"
        )
    return folder, hf_config


class RewardModel:
    """A reward function (rl/rewards.py's signature) scoring with a reward model (see the module docstring)."""

    def __init__(self, spec: str, placement: Placement):
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        folder, hf_config = check_reward_model(spec)
        self.spec, self.placement, self.folder = spec, placement, folder
        self.__name__ = folder.resolve().name  # TRL's: the last part of the model's path
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Loading weights" bar per rank in the run's log
        try:
            tokenizer = load_hf_tokenizer(folder)
            model, loading = AutoModelForSequenceClassification.from_pretrained(
                folder, config=hf_config, dtype=placement.dtype, trust_remote_code=False, output_loading_info=True
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"reward_functions: {spec!r}: the model cannot be loaded ({one_line(exc)})") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        fresh = sorted(set(loading["missing_keys"]) | {name for name, *_ in loading["mismatched_keys"]})
        if fresh:
            raise UserError(
                f"reward_functions: {spec!r}: its weight files hold no {', '.join(fresh[:4])}; those would be random "
                "(give a folder whose config.json and weights were saved together)"
            )
        if tokenizer.pad_token_id is None:  # TRL's: pad with EOS; the model reads the last token that is not it
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.tokenizer = tokenizer
        self.model = model.to(placement.device).eval().requires_grad_(False)
        self.positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)

    def texts(self, prompts: list, completions: list) -> list[str]:
        """Each prompt + completion as TRL renders it for a reward model."""
        if prompts and not isinstance(prompts[0], str):  # messages: the completion is the assistant's turn
            if not self.tokenizer.chat_template:
                raise UserError(
                    f"reward model {self.spec}: the prompts are conversations and {self.folder}'s tokenizer has no "
                    "chat template to render them with; give a reward model whose tokenizer has one"
                )
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    def __call__(self, prompts, completions, **_) -> list[float]:
        ids = self.tokenizer(self.texts(prompts, completions), add_special_tokens=False)["input_ids"]
        for i, row in enumerate(ids):  # every rank checks every row, so all of them refuse alike
            if not row or (self.positions and len(row) > self.positions):
                raise UserError(
                    f"reward model {self.spec}: completion {i} with its prompt is {len(row)} tokens, and the model "
                    f"reads 1 to {self.positions} (its config.json); lower max_completion_length or max_length"
                )
        mine = list(self.placement.share(len(ids)))
        scores = self.scores([ids[i] for i in mine])
        if self.placement.gather is None:
            return scores
        return [score for part in self.placement.gather(scores) for score in part]

    @torch.no_grad()
    def scores(self, rows: list[list[int]]) -> list[float]:
        """Each row's score, in batches of BATCH_ROWS rows of similar length, right-padded."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out = [0.0] * len(rows)
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(order), BATCH_ROWS):
            chunk = order[start : start + BATCH_ROWS]
            width = max(len(rows[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, i in enumerate(chunk):
                input_ids[j, : len(rows[i])] = torch.tensor(rows[i])
                mask[j, : len(rows[i])] = 1
            device = self.placement.device
            logits = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
            for i, value in zip(chunk, logits[:, 0].float().tolist()):
                out[i] = value
        return out
