"""task=sft's tokens: chat templates, and which tokens are trained.

The template is the tokenizer's own `chat_template`, or the recipe's `chat_template` (a built-in name, or a Jinja
file), set on the tokenizer that data.prepare caches, so it travels with the exported one. Each conversation is
rendered to text, tokenized with the fast tokenizer's offsets, and its trained tokens (`target_mask`) found from
the rendering itself: for every trained assistant turn i, the characters that messages[:i + 1]'s rendering adds
to messages[:i]'s with the generation prompt (the answer and the template's end-of-turn text) are the answer's,
read where the whole rendering holds them (`answer_spans`: templates that move the system message or drop
earlier think blocks included); a token holding any of them is a target. No token string is ever searched for.
An answer's `tool_calls` or `reasoning_content` that the template does not write (`check_rendered_fields`) is
refused naming the row: the turn would train without them, a tool-call-only answer as an empty turn. A row's
`tools` (its function schemas, JSON text in the split) are handed to every rendering of it, as
`apply_chat_template(..., tools=...)` takes them; a template that renders the row the same without them
(`check_rendered_tools`) is refused the same way: the schemas would be dropped silently.
`train_on: all` trains every token; plain-text rows are every token plus EOS.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import datasets

from ..errors import UserError

log = logging.getLogger(__name__)

# ChatML (OpenAI's, Qwen's): <|im_start|>role\ncontent<|im_end|>\n per message.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BUILT_IN = {"chatml": CHATML}
TINY_DEFAULT = "chatml"  # what a tiny model's learned tokenizer renders with when chat_template is not given
# Control tokens a template writes (<|im_start|>, <|eot_id|>): a tiny model's tokenizer learns them as special.
SPECIAL_PATTERN = re.compile(r"<\|[A-Za-z0-9_]+\|>")
PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def template_text(key: str | None) -> str | None:
    """The recipe's `chat_template`: a built-in template by name, or a Jinja file's text; None: not given."""
    if key is None:
        return None
    if key in BUILT_IN:
        return BUILT_IN[key]
    path = Path(key).expanduser()
    if not path.is_file():
        raise UserError(f"chat_template={key!r}: neither a built-in template ({', '.join(BUILT_IN)}) nor a Jinja file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"chat_template={key!r}: cannot be read ({exc})") from None


def template_specials(template: str) -> list[str]:
    """The control tokens a template writes, in order of appearance, each once."""
    return list(dict.fromkeys(SPECIAL_PATTERN.findall(template)))


def template_name(key: str | None) -> str:
    return key if key is not None else "the tokenizer's own chat template"


def apply_template(tokenizer, key: str | None, tiny: bool, where: str) -> str:
    """Set the run's chat template on `tokenizer` (the recipe's `key`, else the tokenizer's own, else for a tiny
    model ChatML) and check that it renders; returns what the log calls it."""
    text = template_text(key if key is not None or not tiny or tokenizer.chat_template else TINY_DEFAULT)
    if text is not None:
        tokenizer.chat_template = text
    elif not tokenizer.chat_template:
        raise UserError(
            f"tokenizer {where!r} has no chat template: set chat_template= one of {', '.join(BUILT_IN)}, or a Jinja "
            "file"
        )
    name = key or (TINY_DEFAULT if text is not None else "the tokenizer's own chat template")
    try:
        rendered = tokenizer.apply_chat_template(PROBE, tokenize=False)
        asked = tokenizer.apply_chat_template(PROBE[:1], tokenize=False, add_generation_prompt=True)
        told = tokenizer.apply_chat_template(PROBE[:1], tokenize=False)
    except Exception as exc:  # jinja2's syntax and render errors, a template's raise_exception
        raise UserError(f"chat_template {name}: does not render ({type(exc).__name__}: {exc})") from None
    if not rendered.strip():
        raise UserError(f"chat_template {name}: renders nothing for a conversation, so there is nothing to train on")
    if PROBE[-1]["content"] not in rendered:
        raise UserError(
            f"chat_template {name}: renders no assistant turn (an answer {PROBE[-1]['content']!r} is not in its "
            "rendering), so no answer could be trained; use a template that renders every role (e.g. chatml)"
        )
    marker = check_end_of_turn(tokenizer, name, tiny)
    check_turn_markers(name, *(text.replace(marker, "") if marker else text for text in (rendered, asked, told)))
    return name


def check_turn_markers(name: str, rendered: str, asked: str, told: str) -> None:
    """Warn about a template that marks no turn (the model could not tell who speaks) or ignores
    add_generation_prompt (a prompt would end with the user's text, not the assistant's turn); the texts are
    renderings without their end-of-turn marker."""
    question, answer = PROBE[0]["content"], PROBE[1]["content"]
    between = rendered[rendered.find(question) + len(question) : rendered.rfind(answer)]
    if rendered.find(question) >= 0 and rendered.rfind(answer) >= 0 and not between.strip():
        log.warning(
            "chat template %s writes nothing between a user's turn and the answer (no role markers): the model "
            "cannot tell who speaks",
            name,
        )
    if asked == told and told.rstrip().endswith(question):  # Mistral's [/INST] marks the answer's turn itself
        log.warning(
            "chat template %s ignores add_generation_prompt: generate_every's prompts and a chat's end with the "
            "user's text, not the start of the assistant's turn",
            name,
        )


def _render(tokenizer, messages: list[dict], generation: bool, tools: list[dict] | None = None) -> str:
    # tools=None renders as a call without it does: rows without tools are rendered as they always were
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation)


def template_label(tokenizer, key: str | None) -> str:
    """What errors call the run's chat template: the recipe's `chat_template` (a built-in name or a Jinja file),
    the built-in one a tiny model's tokenizer got, else the tokenizer's own."""
    if key is not None:
        return key
    return next((name for name, text in BUILT_IN.items() if text == tokenizer.chat_template), template_name(None))


def check_rendered_tools(tokenizer, messages: list[dict], tools: list[dict] | None, where: str, template: str):
    """A row's tool schemas are in the template's rendering of it; else one line naming the row and the template:
    a template that ignores `tools` (chatml, SmolLM2's, Gemma 2's) would drop them silently."""
    if tools and _render(tokenizer, messages, False, tools) == _render(tokenizer, messages, False):
        raise UserError(
            f"{where}: the chat template ({template}) ignores `tools`, so the row's {len(tools)} tool schema(s) "
            "would be dropped; use a chat_template that renders them (the checkpoint's own, e.g. Qwen3's or Llama "
            "3.1's), or leave the tools column out"
        )


# An assistant message's fields that are its answer as much as its text: a template that writes nothing for them
# (chatml, SmolLM2's, Gemma 2's: tool_calls) would train the turn without them, a tool-call-only answer as an
# empty turn.
ANSWER_FIELDS = ("tool_calls", "reasoning_content")


def dropped_fields(tokenizer, messages: list[dict], i: int, tools: list[dict] | None = None) -> list[str]:
    """The ANSWER_FIELDS assistant turn i holds that the chat template does not render: rendered as the last turn
    (where a template writes an answer whole; Qwen3's drops only earlier answers' reasoning), the conversation
    through it renders the same without them."""
    message = messages[i]
    held = [name for name in ANSWER_FIELDS if message.get(name)]
    if not held:
        return []
    rendered = _render(tokenizer, messages[: i + 1], False, tools)
    dropped = []
    for name in held:
        without = {key: value for key, value in message.items() if key != name}
        try:
            same = _render(tokenizer, [*messages[:i], without], False, tools) == rendered
        except Exception:  # a template that needs the field (raise_exception) reads it
            same = False
        if same:
            dropped.append(name)
    return dropped


def check_rendered_fields(
    tokenizer, messages: list[dict], turns: list[int], where: str, tools: list[dict] | None = None
) -> None:
    """Every trained assistant turn's tool calls and reasoning are in the template's rendering; else one line
    naming the turn and what the template dropped."""
    for i in turns:
        dropped = dropped_fields(tokenizer, messages, i, tools)
        if not dropped:
            continue
        empty = not messages[i]["content"].strip()
        outcome = "so it would train as an empty turn" if empty else "so the turn would train without them"
        raise UserError(
            f"{where}: the chat template does not render turn {i + 1}'s {' and '.join(dropped)} ({outcome}); use "
            "a chat_template that renders them (the checkpoint's own, e.g. Qwen3's), or leave them out of the row"
        )


def trained_turns(messages: list[dict], answers_from: int, untrained: list[int]) -> list[int]:
    """The indices of the assistant turns a row trains: from `answers_from` on, less those of weight 0."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= answers_from and i not in untrained]


def answer_spans(
    tokenizer, messages: list[dict], turns: list[int], full: str, where: str, tools: list[dict] | None = None
) -> list[tuple]:
    """(start, end, answer) character spans of `full` (the whole conversation's rendering) holding each trained
    assistant turn (`turns`): its answer (tool calls and reasoning included) and the template's end-of-turn text.

    A turn's text is what the template adds for it: the rendering of the conversation through it, less the
    rendering before it with the generation prompt. Where the whole rendering begins with both, the span lies
    between them. Templates that render history otherwise (Mistral's system message inside the last user turn,
    Qwen3's earlier answers without their think block) are read in the whole rendering itself, after the
    previous span: the turn's text where it is there whole; else the answer's text and what closes its turn."""
    spans, cursor = [], 0
    for i in turns:
        message = messages[i]
        prefix = _render(tokenizer, messages[:i], True, tools)
        upto = _render(tokenizer, messages[: i + 1], False, tools)
        turn = upto[len(prefix) :] if upto.startswith(prefix) else None
        held = full.find(turn, cursor) if turn else -1
        if turn is not None and full.startswith(upto) and len(prefix) >= cursor:
            start, end = len(prefix), len(upto)
        elif held >= 0:
            start, end = held, held + len(turn)
        else:
            bare = _render(tokenizer, messages[:i], False, tools)
            generation = prefix[len(bare) :] if prefix.startswith(bare) else ""
            start, end = _located(message, i + 1, generation, prefix, upto, full, cursor, where)
        spans.append((start, end, message["content"]))
        cursor = end
    return spans


def _located(
    message: dict, number: int, generation: str, asked: str, upto: str, full: str, cursor: int, where: str
) -> tuple[int, int]:
    """Turn `number`'s span (its `message`) in the whole rendering `full`, found after `cursor` by its answer's
    text and the closing text the template writes after it (`upto`: the rendering through the turn, which ends with
    them): back to the end of the generation prompt before it (`generation`, which the rendering before the turn
    with it, `asked`, ends with; a think block the template adds is the answer's) or, without one, the whitespace
    before it; on to the end of that closing text. An answer of tool calls only (no text to find) is read by
    `_located_calls`."""
    said = message["content"].strip()
    closing = upto[upto.rfind(said) + len(said) :] if said and said in upto else ""
    found = full.find(said + closing, cursor) if said else -1
    if not said:
        span = _located_calls(message, upto[len(asked) :] if upto.startswith(asked) else "", generation, full, cursor)
        if span is not None:
            return span
    if found < 0:
        raise UserError(
            f"{where}: the whole conversation's rendering does not hold turn {number}'s answer "
            f"({said[:40] or 'tool calls only'!r}) as the chat template renders it alone, so its tokens cannot be "
            "found; use another chat_template (e.g. chatml) or train_on=all"
        )
    opened = full.rfind(generation, cursor, found) if generation else -1
    start = opened + len(generation) if opened >= 0 else found
    while opened < 0 and start > cursor and full[start - 1] in " \n":  # the separator a template writes (Mistral's)
        start -= 1
    return start, found + len(said) + len(closing)


def _located_calls(message: dict, turn: str, generation: str, full: str, cursor: int) -> tuple[int, int] | None:
    """The span of an answer of tool calls only in `full`, after `cursor`: from the end of the next generation
    prompt (the assistant's turn opening) on, the longest end of its rendering alone (`turn`) that `full` holds
    there, holding every called function's name. Qwen3's template writes an empty think block before the last
    answer only: a call answered by a tool, then by a last answer, is in the whole rendering without it."""
    opened = full.find(generation, cursor) if generation and turn else -1
    if opened < 0:
        return None
    start = opened + len(generation)
    names = [(call.get("function") or call).get("name") or "" for call in message.get("tool_calls") or ()]
    for cut in range(len(turn)):
        tail = turn[cut:]
        if not all(name in tail for name in names):
            return None  # what is left no longer holds the calls: it is not this answer
        if full.startswith(tail, start):
            return start, start + len(tail)
    return None


def target_mask(tokenizer, full: str, offsets: list[tuple[int, int]], spans: list[tuple], ids: list[int], where: str):
    """1 for each token holding a character of a span, else 0; each span checked: the rendering holds the answer,
    the span's tokens decode to text that holds it, and the token after the answer (the end of turn) is a target."""
    mask = [0] * len(offsets)
    for start, end, answer in spans:
        covered = [t for t, (a, b) in enumerate(offsets) if b > start and a < end and b > a]
        for t in covered:
            mask[t] = 1
        said = answer.strip()
        found = full.find(said, start, end)
        decoded = tokenizer.decode([ids[t] for t in covered])
        if found < 0 or said not in decoded:
            raise UserError(
                f"{where}: the answer {said[:40]!r} is not in its turn's rendering or tokens ({decoded[:60]!r}); "
                "the chat template changes the answer or the tokenizer's offsets disagree with its text"
            )
        answer_end = found + len(said)
        after = next((t for t, (a, b) in enumerate(offsets) if b > answer_end and b > a), None)
        if full[answer_end:end].strip() and (after is None or not mask[after]):
            raise UserError(f"{where}: the end-of-turn token after the answer {said[:40]!r} is not a target")
    mask[0] = 0  # position 0 is predicted from nothing
    return mask


def render_failure(where: str, what: str, exc: Exception) -> UserError:
    """A template's failure on one row (jinja2's render errors, its own raise_exception) as one line naming it."""
    said = str(exc).splitlines()[0][:200] if str(exc) else "no message"
    return UserError(f"{where}: the chat template does not render this {what} ({type(exc).__name__}: {said})")


def tokenize_sft(
    split: datasets.Dataset, tokenizer, max_length: int, train_on: str, desc: str, template: str | None = None
) -> datasets.Dataset:
    """Each row's tokens (`input_ids`, `length`), which are targets (`target_mask`, position 0 never) and how many
    (`targets`), cut to `max_length`; rows left with no target are dropped, counted in one log line.
    `prompt_length`: how many leading tokens are the prompt of the row's first trained answer (the conversation
    before it and the template's generation prompt), what generate_every answers; 0 where the row has none left
    (plain text, or a prompt truncated to max_length). `template`: the recipe's chat_template key, what a
    refusal calls the template (`template_label`)."""
    columns: dict[str, list] = {"input_ids": [], "length": [], "target_mask": [], "targets": [], "prompt_length": []}
    conversational = "messages" in split.column_names
    rows = split["messages"][:] if conversational else split["text"][:]
    starts = split["answers_from"][:] if conversational else [0] * len(rows)
    untrained = split["untrained"][:] if conversational else [[]] * len(rows)
    places = split["where"][:] if "where" in split.column_names else [f"{desc} row {n + 1}" for n in range(len(rows))]
    tools = split["tools"][:] if "tools" in split.column_names else ["null"] * len(rows)
    label = template_label(tokenizer, template)
    dropped = cut = ends_lost = 0
    for row, answers_from, skipped, where, schemas in zip(rows, starts, untrained, places, tools):
        try:
            ids, mask, prompt = _tokenized_row(
                tokenizer, row, answers_from, skipped, train_on, where, conversational, (json.loads(schemas), label)
            )
        except UserError:
            raise
        except Exception as exc:  # jinja2's render errors, a template's raise_exception on this conversation
            raise render_failure(where, "conversation", exc) from None
        whole = mask
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            dropped += 1
            continue
        if len(whole) > max_length:
            cut += 1
            ends_lost += any(whole[max_length:])
        columns["input_ids"].append(ids)
        columns["length"].append(len(ids))
        columns["target_mask"].append(mask)
        columns["targets"].append(sum(mask))
        columns["prompt_length"].append(prompt if prompt < len(ids) else 0)
    if cut:
        log.warning(
            "sft %s split: cut %d of %d row(s) to max_length=%d; %d of them lost trained tokens at the end (the "
            "end of an answer: its end-of-turn is not learned there)",
            desc,
            cut,
            len(rows),
            max_length,
            ends_lost,
        )
    if dropped:
        log.warning(
            "sft %s split: dropped %d of %d row(s) with no trained token left after truncation to max_length=%d",
            desc,
            dropped,
            len(rows),
            max_length,
        )
    if not columns["input_ids"]:
        raise UserError(
            f"task=sft: every row of the {desc} split lost its answers to max_length={max_length}; raise it"
        )
    return datasets.Dataset.from_dict(columns)


def _tokenized_row(
    tokenizer,
    row: str,
    answers_from: int,
    untrained: list[int],
    train_on: str,
    where: str,
    conversational: bool,
    tooled: tuple[list[dict] | None, str] = (None, "chat template"),
):
    """(ids, target mask, prompt length) of one row; `tooled`: its tool schemas (None: none) and what errors call
    the template."""
    if not conversational:  # plain text: every token, and EOS to end it
        ids = tokenizer(row, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return ids, [0] + [1] * (len(ids) - 1), 0
    messages = json.loads(row)
    turns = trained_turns(messages, answers_from, untrained)
    every = [i for i, m in enumerate(messages) if m["role"] == "assistant"] if train_on == "all" else turns
    tools, template = tooled
    check_rendered_tools(tokenizer, messages, tools, where, template)
    check_rendered_fields(tokenizer, messages, every, where, tools)
    full = _render(tokenizer, messages, False, tools)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    prompt = _prompt_length(tokenizer, messages, turns, full, offsets, tools)
    if train_on == "all":
        return ids, [0] + [1] * (len(ids) - 1), prompt
    spans = answer_spans(tokenizer, messages, turns, full, where, tools)
    return ids, target_mask(tokenizer, full, offsets, spans, ids, where), prompt


def _prompt_length(
    tokenizer, messages: list[dict], turns: list[int], full: str, offsets: list[tuple], tools: list[dict] | None = None
) -> int:
    """Tokens of `full` that lie wholly inside the rendering of the conversation before its first trained
    assistant turn, with the generation prompt (a prefix of `full`); 0 if the template renders no such prefix."""
    turn = turns[0] if turns else None
    prefix = _render(tokenizer, messages[:turn], True, tools) if turn else ""
    if not prefix or not full.startswith(prefix):
        return 0
    return next((t for t, (_, end) in enumerate(offsets) if end > len(prefix)), len(offsets))


def _after_answer(tokenizer) -> str:
    """What the template writes after an assistant's answer (PROBE's last turn), up to the end of the rendering."""
    rendered = tokenizer.apply_chat_template(PROBE, tokenize=False)
    answer = PROBE[-1]["content"]
    return rendered[rendered.rindex(answer) + len(answer) :]


def _whole_tokens(tokenizer) -> set[str]:
    """Tokens never split: the special and added ones (<|im_end|>, </s>, <end_of_turn>)."""
    return set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())


def end_of_turn_marker(tokenizer) -> tuple[str | None, list[int]]:
    """The template's end-of-turn marker after an answer and its token ids: the first text that is not
    whitespace (chatml's <|im_end|> before its newline, Llama 2's </s> after its space, Llama 3's <|eot_id|>);
    a special or added token there is the marker whole, else the first word. (None, []): the template writes
    only whitespace after an answer."""
    text = _after_answer(tokenizer).lstrip()
    if not text:
        return None, []
    marker = next(
        (t for t in sorted(_whole_tokens(tokenizer), key=len, reverse=True) if t and text.startswith(t)), None
    )
    marker = marker or text.split()[0]
    return marker, tokenizer(marker, add_special_tokens=False)["input_ids"]


def _end_of_turn(tokenizer, name: str, learned: bool = False) -> tuple[str | None, list[int]]:
    """end_of_turn_marker, made one token: a marker the vocabulary splits is refused in one line (generation could
    not stop at it), or (`learned`: a tiny model's tokenizer, learned from the rows) added as a special token."""
    marker, ids = end_of_turn_marker(tokenizer)
    if marker is None or len(ids) == 1:
        return marker, ids
    if not learned:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise UserError(
            f"chat template {name}: its end-of-turn marker {marker!r} is {len(ids)} tokens of this tokenizer "
            f"({', '.join(map(repr, pieces[:8]))}), so generation could not stop at it; use a template whose "
            "end-of-turn is one token of this vocabulary (the checkpoint's own, or chatml where <|im_end|> is one)"
        )
    tokenizer.add_tokens([marker], special_tokens=True)
    return marker, tokenizer(marker, add_special_tokens=False)["input_ids"]


def check_end_of_turn(tokenizer, name: str, learned: bool) -> str | None:
    """The template's end-of-turn marker, one token (`_end_of_turn`); a template that writes nothing after an
    answer is said once (generation then stops at EOS only)."""
    marker, _ = _end_of_turn(tokenizer, name, learned)
    if marker is None:
        log.warning(
            "chat template %s writes nothing after an answer (no end-of-turn token): generation stops at EOS only",
            name,
        )
    return marker


def stop_ids(tokenizer) -> set[int]:
    """EOS and the template's end-of-turn token (chatml's <|im_end|>, Llama 3's <|eot_id|>, Mistral's </s>):
    what generation stops at."""
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if tokenizer.chat_template:
        stops.update(_end_of_turn(tokenizer, "of this tokenizer")[1])
    return stops
