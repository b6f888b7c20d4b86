"""task=grpo's tokens: each prompt as the tokens its completions are sampled after. A conversational prompt is
rendered by the run's chat template (chat.py sets it) with the generation prompt, as TRL's GRPOTrainer renders it
(`apply_chat_template(..., add_generation_prompt=True)`), its tokens taken without adding special tokens again; a
text prompt is tokenized as it is, with the tokenizer's own special tokens (e.g. BOS), as task=dpo's text pairs are.

A prompt is never cut: one longer than the prompt budget (max_length) is an error naming its row. The other
columns (JSON text per row) ride along for the reward functions.
"""

from __future__ import annotations

import json

import datasets

from ..errors import UserError
from .chat import render_failure


def prompt_text(tokenizer, prompt) -> str:
    """The text a prompt's tokens are made from: a text prompt as it is, messages rendered with the generation
    prompt."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def tokenize_prompts(split: datasets.Dataset, tokenizer, max_length: int, desc: str) -> datasets.Dataset:
    """Each prompt's `input_ids`, `length`, the reward functions' `columns` (JSON text), `prompt` (JSON text, what
    the reward functions receive as the prompt), `where` and `index`."""
    columns: dict[str, list] = {"input_ids": [], "length": [], "prompt": [], "columns": [], "where": [], "index": []}
    rows = zip(split["prompt"][:], split["columns"][:], split["where"][:], split["index"][:])
    for cell, extra, where, index in rows:
        prompt = json.loads(cell)
        try:
            text = prompt_text(tokenizer, prompt)
        except Exception as exc:  # jinja2's render errors, a template's raise_exception on this conversation
            raise render_failure(where, "prompt", exc) from None
        ids = tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
        if not ids:
            raise UserError(f"{where}: the prompt renders to no token; a completion follows a prompt")
        if len(ids) > max_length:
            raise UserError(
                f"{where}: the prompt is {len(ids)} tokens, more than the prompt budget max_length={max_length} "
                f"(prompts are never cut) in the {desc} split; raise max_length or shorten the prompt"
            )
        for name, value in (("input_ids", ids), ("length", len(ids)), ("prompt", cell), ("columns", extra)):
            columns[name].append(value)
        columns["where"].append(where)
        columns["index"].append(index)
    return datasets.Dataset.from_dict(columns)
