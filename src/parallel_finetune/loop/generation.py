"""generate_every: what the model answers while it trains. Every N steps and at the end, the prompts of the first
`generate_prompts` validation conversations (the conversation before its first trained answer, with the
template's generation prompt: a split's `prompt_length` tokens) are answered greedily and written to
generations.jsonl and the trackers (reporting.Reporter.generations).

Decoding goes through the run's own runner, so it works under every layout: each new token recomputes the whole
prefix (no KV cache: a pipeline's stages and a tensor-parallel attention keep none), the argmax is taken where the
logits are (every rank, or a pipeline's last stage, which broadcasts it over the pipeline group), and every rank
runs the same forwards (FSDP and ZeRO-3 gather parameters in each). An answer ends at the template's end-of-turn
token or EOS, or after `max_new_tokens`, or when prompt and answer fill `max_length` (the positions trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..data.batch import TokenizedSplit, padded_batch
from ..data.chat import stop_ids
from ..errors import UserError
from ..interfaces import Runner


@dataclass(frozen=True)
class Prompt:
    row: int  # in the validation split
    ids: tuple[int, ...]


NO_PROMPTS = (  # the run's error, and --check's (preflight) for plain-text validation rows
    "generate_every: no validation row has a prompt to answer (plain-text rows, or every prompt longer than "
    "max_length); give conversations (messages or prompt/completion rows) or set generate_every=0"
)


def held_out_prompts(split: TokenizedSplit, count: int) -> list[Prompt]:
    """The prompts of the first `count` validation rows that have one (`prompt_length` > 0), in the split's
    order; a one-line error where none has (plain-text rows, or prompts cut by max_length)."""
    lengths = split.prompt_lengths
    if lengths is None:
        raise UserError("generate_every answers conversations' prompts; the validation split has none (task=sft only)")
    rows = [row for row, length in enumerate(lengths) if length > 0][:count]
    if not rows:
        raise UserError(NO_PROMPTS)
    return [Prompt(row, tuple(split.ids[row][: lengths[row]])) for row in rows]


class Generator:
    """Greedy answers to fixed prompts through a runner, the same on every rank: `due(step)` every `every` steps
    (and once at the end, `due_at_end`)."""

    def __init__(
        self,
        *,
        runner: Runner,
        model: nn.Module,
        tokenizer,
        prompts: list[Prompt],
        max_new_tokens: int,
        max_length: int,
        layout,
        every: int,
    ):
        self.runner, self.model, self.tokenizer, self.prompts = runner, model, tokenizer, prompts
        self.max_new_tokens, self.max_length, self.layout = max_new_tokens, max_length, layout
        self.stops = stop_ids(tokenizer)
        self.every = every  # generate_every
        self.generated_at: int | None = None  # the step of the last answers

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every == 0 and step < total_steps

    def due_at_end(self, step: int) -> bool:
        """The end of training answers too, unless the last step just did."""
        return self.generated_at != step

    @torch.no_grad()
    def answers(self, step: int) -> list[dict]:
        """{prompt, answer} per prompt (text; the answer without its end-of-turn token); the model in eval mode
        meanwhile. Every rank calls it and gets the same answers."""
        training = self.model.training
        self.model.eval()
        try:
            results = []
            for prompt in self.prompts:
                new = self.greedy(list(prompt.ids))
                results.append({"prompt": self.text(prompt.ids), "answer": self.text(new, skip_special_tokens=True)})
            self.generated_at = step
            return results
        finally:
            self.model.train(training)

    def text(self, ids, skip_special_tokens: bool = False) -> str:
        """The tokens' text as rendered (no clean-up of the spaces before punctuation, which the data has)."""
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def greedy(self, ids: list[int]) -> list[int]:
        """The new tokens after `ids`, one forward of the whole prefix each."""
        new: list[int] = []
        budget = min(self.max_new_tokens, self.max_length - len(ids))
        for _ in range(max(budget, 0)):
            token = self.next_token(ids + new)
            if token in self.stops:
                break
            new.append(token)
        return new

    def next_token(self, ids: list[int]) -> int:
        layout = self.layout
        tokenizer = self.tokenizer
        batch = padded_batch(
            [ids],
            pad_id=tokenizer.pad_token_id,
            padding_side=tokenizer.padding_side,
            pad_multiple=self.runner.pad_multiple,
        ).to(layout.device)
        logits = self.runner.last_logits(batch)
        chosen = torch.zeros((), dtype=torch.long, device=layout.device)
        if logits is not None:  # every rank but a pipeline's earlier stages
            chosen = logits[0].float().argmax()
        if layout.pp > 1:
            dist.broadcast(chosen, group=layout.pp_group, group_src=layout.pp - 1)
        return int(chosen)
