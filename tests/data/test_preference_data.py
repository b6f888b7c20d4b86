"""task=dpo's rows: TRL's explicit and implicit prompt formats (text or messages, JSON Lines, CSV, Parquet), the
pairs' tokens (the prompt's shared by both rows, only the answers scored), the batches (a pair's rows together,
padded or packed), and every bad row refused in one line naming file:line."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import load_task_of, prepare_data, recipe

from parallel_finetune.data.batch import IGNORE, PairReference, PreferenceBatcher, TokenizedSplit
from parallel_finetune.data.packing import PackedShape
from parallel_finetune.errors import UserError
from parallel_finetune.resolve import load_config
from parallel_finetune.tasks import PREFERENCE_SAMPLE_DIR

USER = {"role": "user", "content": "Is this review positive or negative? a charming film"}
RIGHT = {"role": "assistant", "content": "Positive."}
WRONG = {"role": "assistant", "content": "Negative."}
GOOD = {"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]}
CALL = {"type": "function", "function": {"name": "get_rating", "arguments": '{"film": "Heat"}'}}
TOOL = {"role": "tool", "name": "get_rating", "content": "8.3"}


def dpo_config(*overrides: str, cache_dir: Path | None = None):
    cache = [f"cache_dir={cache_dir}"] if cache_dir else []
    return load_config(recipe("llama"), ["size=tiny", "task=dpo", "max_length=128", *cache, *overrides])


def pair_files(folder: Path, rows: list[dict]) -> list[str]:
    """`rows` as train.jsonl (then the sample's validation pairs as dev.jsonl); the overrides naming them."""
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return [f"train_file={train}", f"validation_file={PREFERENCE_SAMPLE_DIR / 'validation.jsonl'}"]


def refused(folder: Path, rows: list[dict], *overrides: str, cache_dir: Path | None = None) -> str:
    config = dpo_config(*pair_files(folder, rows), *overrides, cache_dir=cache_dir)
    with pytest.raises(UserError) as caught:
        prepare_data(config) if cache_dir else load_task_of(config)
    return str(caught.value)


@pytest.mark.parametrize(
    "row,message",
    [
        ({"prompt": [USER], "chosen": [RIGHT]}, "lacks key(s) rejected that the first row has"),
        ({"prompt": [USER], "chosen": [], "rejected": [WRONG]}, "column 'chosen' is empty"),
        ({"prompt": [USER], "chosen": "", "rejected": [WRONG]}, "column 'chosen' is empty"),
        ({"prompt": [USER], "chosen": [RIGHT], "rejected": [RIGHT]}, "chosen and rejected are the same answer"),
        (
            {"prompt": [USER], "chosen": [RIGHT], "rejected": [{"role": "assistant", "content": " "}]},
            "an empty assistant answer",
        ),
        ({"prompt": [USER], "chosen": [USER, RIGHT], "rejected": [WRONG]}, "begins with 'user', not an assistant"),
        ({"prompt": [USER, RIGHT], "chosen": [RIGHT], "rejected": [WRONG]}, "the prompt ends with an assistant turn"),
        ({"prompt": "a text", "chosen": [RIGHT], "rejected": [WRONG]}, "mix a text and a list of messages"),
        ({"chosen": [RIGHT], "rejected": [WRONG]}, "share no first turn (no implicit prompt)"),
        ({"chosen": "Positive.", "rejected": "Negative."}, "share no first turn (no implicit prompt)"),
        ({"chosen": "The film is good", "rejected": "The film is good."}, "the chosen answer is empty"),
        # issue 54: a user's or tool's turn at an answer's end would be scored as the model's
        (
            {"prompt": [USER], "chosen": [RIGHT, USER], "rejected": [WRONG]},
            "the chosen answer ends with a 'user' turn, which would be scored as the model's; an answer ends with",
        ),
        (
            {"prompt": [USER], "chosen": [RIGHT], "rejected": [{**WRONG, "tool_calls": [CALL]}, TOOL]},
            "the rejected answer ends with a 'tool' turn, which would be scored as the model's",
        ),
        # issue 54: weight 0 (honoured by task=sft) is refused, not ignored; in an implicit prompt it changes nothing
        (
            {"prompt": [USER], "chosen": [RIGHT], "rejected": [{**WRONG, "weight": 0}]},
            "the rejected answer's turn 1 has weight 0, and task=dpo scores an answer whole",
        ),
        (
            {"chosen": [USER, {**RIGHT, "weight": 0}], "rejected": [USER, WRONG]},
            "the chosen answer's turn 1 has weight 0, and task=dpo scores an answer whole",
        ),
    ],
)
def test_a_bad_pair_is_one_line_naming_its_place(row, message, tmp_path):
    first = GOOD if "prompt" in row else {"chosen": [USER, RIGHT], "rejected": [USER, WRONG]}  # the same format
    text = refused(tmp_path, [first, row])
    assert message in text and "\n" not in text
    assert text.startswith(f"{tmp_path / 'train.jsonl'}:2: "), text


def test_rows_without_a_rejected_column_are_refused_saying_the_formats(tmp_path):
    text = refused(tmp_path, [{"prompt": [USER], "chosen": [RIGHT]}] * 2)
    assert text == (
        f"{tmp_path / 'train.jsonl'}: task=dpo needs columns chosen and rejected (texts or lists of messages) and, "
        "unless both hold the prompt too, prompt (or name yours with prompt_column, chosen_column and "
        "rejected_column); no column rejected (found: prompt, chosen)"
    )


def test_a_prompt_with_no_room_for_its_answer_is_refused_saying_the_truncation_policy(tmp_path, cache_dir):
    long = {"prompt": [{"role": "user", "content": "a charming film " * 40}], "chosen": [RIGHT], "rejected": [WRONG]}
    text = refused(tmp_path, [GOOD, long], "max_length=64", cache_dir=cache_dir)
    assert text.startswith(f"{tmp_path / 'train.jsonl'}:2: the prompt is ") and "\n" not in text
    assert "prompts are never cut; answers are cut at the end to fit" in text


def test_a_cut_that_leaves_both_answers_the_same_tokens_is_refused_counting_such_pairs(tmp_path, cache_dir):
    """Issue 54: two answers that differ only after what max_length keeps were cut to the same tokens and counted
    only as cut; such a pair ties, training on nothing. Refused as identical answers are in the data, with the
    count, by the run and by --check."""

    shared = "a charming film, " * 30
    long = {"prompt": [USER], "chosen": [{**RIGHT, "content": shared + "Positive."}]}
    long["rejected"] = [{**WRONG, "content": shared + "Negative."}]
    rows = [GOOD, long, GOOD, long]
    held_out = tmp_path / "dev.jsonl"  # short pairs: every one fits max_length=64
    held_out.write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    files = [*pair_files(tmp_path, rows), f"validation_file={held_out}", f"output_dir={tmp_path / 'run'}"]
    config = dpo_config(*files, "max_length=64", cache_dir=cache_dir)
    said = (
        f"{tmp_path / 'train.jsonl'}:2: cutting the answers to max_length=64 leaves chosen and rejected the same "
        "tokens (2 of 4 pair(s) of the train split); a pair needs two different answers (identical ones are "
        "refused in the data alike): raise max_length, or shorten the prompts of those pairs"
    )
    assert_refused_before_and_at_preparation(config, said)
    prepare_data(dpo_config(*files, "max_length=256", cache_dir=cache_dir))  # room for the answers' ends: trains


def test_check_says_a_packed_dpo_sequence_holds_twice_max_length(tmp_path, cache_dir):
    """Issue 54: --check said DPO packs into max_length sequences; a sequence holds a pair's two rows, 2 x
    max_length (loop/builder.py's PackedShape)."""
    from parallel_finetune.preflight import preflight

    line = preflight(dpo_config("packing=true", f"output_dir={tmp_path / 'run'}", cache_dir=cache_dir), 1)
    assert line.endswith(
        " | packed into sequences of 256 tokens (2 x max_length: both rows of a pair, each up to 128)"
    ), line


def test_a_template_that_renders_no_assistant_turn_is_refused(tmp_path, cache_dir):
    template = tmp_path / "users_only.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    text = refused(tmp_path, [GOOD, GOOD], f"chat_template={template}", cache_dir=cache_dir)
    assert text == (
        f"chat_template {template}: renders no assistant turn (an answer 'hello' is not in its rendering), so no "
        "answer could be trained; use a template that renders every role (e.g. chatml)"
    )


def test_a_tool_call_answer_the_template_does_not_render_is_refused_and_one_it_renders_trains(tmp_path, cache_dir):
    """Issue 54: a chosen answer of only a tool call, through a template that does not write tool calls (a tiny
    model's chatml), would be an empty turn preferred to the rejected one: --check and the run refuse it in one line
    naming the row; through Qwen3's template, which writes them, the pair trains on the rendered call."""

    called = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    rows = [GOOD, {"prompt": [USER], "chosen": [called], "rejected": [WRONG]}]
    config = dpo_config(*pair_files(tmp_path, rows), f"output_dir={tmp_path / 'run'}", cache_dir=cache_dir)
    said = (
        f"{tmp_path / 'train.jsonl'}:2: the chosen answer: the chat template does not render turn 2's tool_calls (so "
        "it would train as an empty turn); use a chat_template that renders them (the checkpoint's own, e.g. "
        "Qwen3's), or leave them out of the row"
    )
    assert_refused_before_and_at_preparation(config, said)

    qwen3 = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen3-0.6b.jinja"
    overrides = [f"chat_template={qwen3}", "max_length=512"]  # the sample's held-out pairs are longer in Qwen3's
    prepared = prepare_data(dpo_config(*pair_files(tmp_path, rows), *overrides, cache_dir=cache_dir))
    split, tokenizer = TokenizedSplit.of(prepared.splits["train"], prepared.task), prepared.tokenizer
    answers = {tokenizer.decode(split.ids[i][split.prompt_lengths[i] :]) for i in range(len(split))}
    assert '<tool_call>\n{"name": "get_rating", "arguments": {"film": "Heat"}}\n</tool_call><|im_end|>\n' in {
        answer.removeprefix("<think>\n\n</think>\n\n") for answer in answers
    }, answers


def test_the_implicit_format_takes_the_shared_turns_as_the_prompt(tmp_path):
    raw, task, _ = load_task_of(dpo_config(f"train_file={PREFERENCE_SAMPLE_DIR / 'implicit.jsonl'}"))
    assert task.problem_type == "dpo" and task.name == "implicit"
    source = [json.loads(line) for line in (PREFERENCE_SAMPLE_DIR / "implicit.jsonl").read_text().splitlines()]
    for split in raw.values():
        for row in split.to_list():
            index = int(row["where"].rsplit(":", 1)[1]) - 1  # file:line
            prompt, chosen = json.loads(row["prompt"]), json.loads(row["chosen"])
            assert prompt == source[index]["chosen"][:-1] and chosen == source[index]["chosen"][-1:]
            assert json.loads(row["rejected"]) == source[index]["rejected"][-1:]


def test_text_pairs_in_csv_and_parquet_read_alike(tmp_path):
    rows = {"prompt": ["Review: a charming film\nSentiment:", "Review: a dull film\nSentiment:"]}
    rows |= {"chosen": [" positive", " negative"], "rejected": [" negative", " positive"]}
    pq.write_table(pa.table(rows), tmp_path / "train.parquet")
    with open(tmp_path / "train.csv", "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(rows)
        writer.writerows(zip(*rows.values()))
    read = []
    for name in ("train.parquet", "train.csv"):
        raw, task, _ = load_task_of(dpo_config(f"train_file={tmp_path / name}", "validation_split_percentage=50"))
        rows_read = raw["train"].to_list() + raw["validation"].to_list()
        read.append(sorted((row["prompt"], row["chosen"], row["rejected"]) for row in rows_read))
    assert read[0] == read[1] and task.name == "explicit"


def test_the_pairs_kind_and_prompt_format_are_said_as_they_are(tmp_path, caplog):
    """One line says what the pairs are: text (no chat template) or messages (rendered by it), with an explicit or
    an implicit prompt, and how many (text pairs were said to be in "the explicit format", which names only where
    the prompt is)."""
    train = tmp_path / "train.jsonl"
    text = [{"prompt": f"Review: film {i}\nSentiment:", "chosen": " good", "rejected": " bad"} for i in range(4)]
    train.write_text("".join(json.dumps(row) + "\n" for row in text), encoding="utf-8")
    said = {}
    for name, overrides in {
        "text": [f"train_file={train}", "validation_split_percentage=50"],
        "implicit messages": [f"train_file={PREFERENCE_SAMPLE_DIR / 'implicit.jsonl'}"],
    }.items():
        caplog.clear()
        with caplog.at_level("INFO", logger="parallel_finetune.tasks.preferences"):
            load_task_of(dpo_config(*overrides))
        (said[name],) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("task=dpo: ")]
    assert said["text"] == (
        f"task=dpo: {train}: 2 pairs of text (TRL's standard format, no chat template), explicit prompt (columns "
        "prompt, chosen, rejected)"
    )
    assert said["implicit messages"].endswith(
        "pairs of messages (TRL's conversational format, rendered by the chat template), implicit prompt (what both "
        "answers begin with) (columns chosen, rejected)"
    )


def test_a_csv_text_prompt_beginning_with_a_bracket_is_text(tmp_path):
    """Issue 54: a CSV text prompt `[Q] ...` was parsed as JSON messages and refused; only a cell beginning with
    `[{` is JSON messages (docs/data.md), so it reads as the Parquet file's text."""
    rows = {"prompt": ["[Q] Review: a charming film\nSentiment:", "[Q] Review: a dull film\nSentiment:"]}
    rows |= {"chosen": [" positive", " negative"], "rejected": [" [negative]", " [positive]"]}
    with open(tmp_path / "train.csv", "w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows([tuple(rows), *zip(*rows.values())])
    raw, task, _ = load_task_of(dpo_config(f"train_file={tmp_path / 'train.csv'}", "validation_split_percentage=50"))
    pairs = raw["train"].to_list() + raw["validation"].to_list()
    read = sorted((pair["prompt"], pair["chosen"], pair["rejected"]) for pair in pairs)
    assert read == sorted(tuple(json.dumps(value) for value in row) for row in zip(*rows.values()))


def test_pairs_share_the_prompts_tokens_and_batches_keep_a_pairs_rows_together(cache_dir):
    prepared = prepare_data(dpo_config(cache_dir=cache_dir))
    split = TokenizedSplit.of(prepared.splits["train"], prepared.task)
    assert split.targets == [1] * len(split)  # the loss is averaged over pairs
    for i in range(len(split)):
        prompt = split.prompt_lengths[i]
        assert split.ids[i][:prompt] == split.rejected_ids[i][:prompt] and split.ids[i] != split.rejected_ids[i]
        assert split.lengths[i] == len(split.ids[i]) + len(split.rejected_ids[i])
    indices = [5, 17, 3, 40]
    values = [(-float(i), -float(i) - 0.5) for i in range(len(split))]
    reference = PairReference(values, [i in indices for i in range(len(split))])  # only the batch's pairs measured
    pad = prepared.tokenizer.pad_token_id
    padding = {"pad_id": pad, "padding_side": "right", "pad_multiple": 1, "device": "cpu", "reference": reference}
    padded = PreferenceBatcher(split, **padding).batch(indices)
    packed = PreferenceBatcher(split, **padding, shape=PackedShape(capacity=256)).batch(indices)
    with pytest.raises(RuntimeError, match="pair 6's reference log-probabilities were not measured"):
        PreferenceBatcher(split, **padding).batch([5, 6])  # never a silent 0
    with pytest.raises(dataclasses.FrozenInstanceError):  # nothing is written into a split once it is read
        split.ids = []
    for batch in (padded, packed):
        assert batch.scored() == 4
        target = batch.loss_target()
        for answer in range(8):
            pair, side = divmod(answer, 2)
            index = indices[pair]
            at = batch.answers == answer
            row = (split.ids, split.rejected_ids)[side][index]
            assert int(at.sum()) == len(row) - split.prompt_lengths[index]  # every answer token, nothing else
            assert torch.equal(batch.labels[at], torch.tensor(row[split.prompt_lengths[index] :]))
            assert set(target[..., 2][at].tolist()) == {values[index][side]}
            if batch.packed:  # both rows of a pair in one sequence
                assert len(set(torch.nonzero(batch.answers // 2 == pair)[:, 0].tolist())) == 1
        assert ((batch.labels != IGNORE) == (batch.answers >= 0)).all()
    assert padded.rows == 8 and [int(padded.answers[r].max()) for r in range(8)] == list(range(8))


def assert_refused_before_and_at_preparation(config, said: str) -> None:
    """`--check` (preflight) and the run's data preparation both refuse `config` with exactly the line `said`."""
    from parallel_finetune.preflight import preflight

    for check in (lambda: preflight(config, 1), lambda: prepare_data(config)):
        with pytest.raises(UserError) as caught:
            check()
        assert str(caught.value) == said
