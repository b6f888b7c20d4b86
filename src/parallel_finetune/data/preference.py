"""task=dpo's tokens: each preference pair as two rows that share their prompt's tokens.

Tokens are made as TRL's DPOTrainer makes them, so that a pair trains alike here and there: a conversational
pair is rendered by the run's chat template (chat.py sets it), the prompt's messages with the generation prompt,
then the prompt and each answer together (the answer's turn and the template's end-of-turn text follow the
prompt's rendering); a text pair is the prompt's text and the prompt's text followed by each answer's and EOS's
(with the tokenizer's own special tokens, e.g. BOS). The prompt alone and each whole row are tokenized; the
prompt's tokens are those all three begin with (a token merging the prompt's end with an answer's start is the
answer's), so both rows begin with the same prompt tokens, and only the answers' tokens are scored.

Truncation: a prompt is never cut; an answer longer than what max_length leaves after its prompt is cut at the
end (counted in one log line). A prompt that leaves no token for an answer is an error naming the row's place, as
is a cut that leaves both answers the same tokens (an identical pair ties, so it would train on nothing: the data
refuses identical answers alike, tasks/preferences.py); the error counts such pairs in the split.
"""

from __future__ import annotations

import json
import logging

import datasets

from ..errors import UserError
from .chat import check_rendered_fields, render_failure

log = logging.getLogger(__name__)


def _render(tokenizer, messages: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def pair_texts(tokenizer, prompt, chosen, rejected, where: str) -> tuple[str, str, str]:
    """The prompt's text and each answer's, as the tokens are made from them."""
    if isinstance(chosen, str):
        eos = tokenizer.eos_token or ""
        return prompt, *(answer if answer.endswith(eos) else answer + eos for answer in (chosen, rejected))
    asked = _render(tokenizer, prompt, True)
    return asked, *(
        answer_text(tokenizer, prompt, asked, a, where, n) for n, a in (("chosen", chosen), ("rejected", rejected))
    )


def answer_text(tokenizer, prompt, asked: str, answer, where: str, name: str) -> str:
    """A text answer with EOS, or what the chat template renders for a conversational answer after `asked` (the
    prompt's rendering with its generation prompt); `name`: what errors call it (chosen, rejected, completion)."""
    if isinstance(answer, str):
        eos = tokenizer.eos_token or ""
        return answer if answer.endswith(eos) else answer + eos
    whole = _render(tokenizer, prompt + answer, False)
    said = next((m["content"].strip() for m in answer if m["role"] == "assistant" and m["content"].strip()), "")
    if not whole.startswith(asked) or (said and said not in whole[len(asked) :]):
        raise UserError(
            f"{where}: the chat template renders no assistant turn for the {name} answer after the prompt (the "
            "rendering of prompt and answer does not begin with the prompt's, with its generation prompt, and "
            "then hold the answer); use another chat_template (e.g. chatml)"
        )
    turns = [len(prompt) + j for j, m in enumerate(answer) if m["role"] == "assistant"]
    check_rendered_fields(tokenizer, prompt + answer, turns, f"{where}: the {name} answer")
    return whole[len(asked) :]


def prompt_text(tokenizer, prompt) -> str:
    """The prompt's text as the tokens are made from it: a text prompt as it is, a conversation rendered with the
    generation prompt."""
    return prompt if isinstance(prompt, str) else _render(tokenizer, prompt, True)


def shared_length(first: list[int], second: list[int]) -> int:
    """How many tokens `first` and `second` begin with alike."""
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


def tokenize_pairs(split: datasets.Dataset, tokenizer, max_length: int, desc: str) -> datasets.Dataset:
    """Each pair's rows: `input_ids` (the prompt and the chosen answer), `rejected_ids` (the prompt and the
    rejected answer), `prompt_length` (the prompt's tokens, which both rows begin with), `length` (the pair's
    tokens, both rows together) and `index`."""
    columns: dict[str, list] = {"input_ids": [], "rejected_ids": [], "prompt_length": [], "length": [], "index": []}
    cut, identical = 0, []
    rows = zip(split["prompt"][:], split["chosen"][:], split["rejected"][:], split["where"][:], split["index"][:])
    for prompt, chosen, rejected, where, index in rows:
        prompt, chosen, rejected = json.loads(prompt), json.loads(chosen), json.loads(rejected)
        try:
            texts = pair_texts(tokenizer, prompt, chosen, rejected, where)
        except UserError:
            raise
        except Exception as exc:  # jinja2's render errors, a template's raise_exception on this conversation
            raise render_failure(where, "pair", exc) from None
        specials = isinstance(chosen, str)  # a rendered conversation holds the template's own special tokens
        asked = tokenizer(texts[0], add_special_tokens=specials)["input_ids"]
        rows = [tokenizer(texts[0] + answer, add_special_tokens=specials)["input_ids"] for answer in texts[1:]]
        prompt_length = min(shared_length(asked, row) for row in rows)
        if not prompt_length:
            raise UserError(f"{where}: the prompt is no token; a pair's answers follow a prompt")
        if prompt_length >= max_length:
            raise UserError(
                f"{where}: the prompt is {prompt_length} tokens, which leaves no room for an answer within "
                f"max_length={max_length} (prompts are never cut; answers are cut at the end to fit); raise "
                "max_length or shorten the prompt"
            )
        for name, row in zip(("chosen", "rejected"), rows):
            if len(row) == prompt_length:
                raise UserError(f"{where}: the {name} answer renders to no token")
        cut += any(len(row) > max_length for row in rows)
        chosen_ids, rejected_ids = (row[:max_length] for row in rows)
        if chosen_ids == rejected_ids:  # different answers that share their first max_length - prompt tokens
            identical.append(where)
        columns["input_ids"].append(chosen_ids)
        columns["rejected_ids"].append(rejected_ids)
        columns["prompt_length"].append(prompt_length)
        columns["length"].append(len(chosen_ids) + len(rejected_ids))
        columns["index"].append(index)
    if identical:
        raise UserError(
            f"{identical[0]}: cutting the answers to max_length={max_length} leaves chosen and rejected the same "
            f"tokens ({len(identical)} of {len(columns['index'])} pair(s) of the {desc} split); a pair needs two "
            "different answers (identical ones are refused in the data alike): raise max_length, or shorten the "
            "prompts of those pairs"
        )
    if cut:
        log.warning(
            "dpo %s split: cut the answers of %d of %d pair(s) to max_length=%d (prompt and answer; an answer's end "
            "is lost there)",
            desc,
            cut,
            len(columns["index"]),
            max_length,
        )
    return datasets.Dataset.from_dict(columns)
