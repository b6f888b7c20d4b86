"""GLUE-folder reading (SST-2), validation, tokenizing, caching, batching and padding (other formats and tasks:
test_tasks.py)."""

from __future__ import annotations

import logging
import os
import re
import time
from collections import Counter

import pytest
from conftest import REPO, SST2_ROWS, prepare_data

from parallel_finetune.config import DataSection, ModelSection
from parallel_finetune.data import prepare as data
from parallel_finetune.data import sampling
from parallel_finetune.errors import UserError
from parallel_finetune.resolve import load_config

# every key at its default: SST-2 from the Hub
DEFAULTS = dict(data=DataSection(), model=ModelSection(), seed=42, predict=False)


def test_real_sst2_rows(sst2_full):
    raw = data.read_glue_dir(sst2_full)
    assert {k: len(v) for k, v in raw.items()} == {"train": 67_349, "validation": 872, "test": 1_821}
    assert Counter(raw["train"]["label"]) == {1: 37_569, 0: 29_780}
    assert Counter(raw["validation"]["label"]) == {1: 444, 0: 428}
    assert "label" not in raw["test"].column_names
    assert not any(s != s.strip() for s in raw["train"]["text"][:1000])  # GLUE's trailing spaces removed
    assert raw["test"]["index"][:3] == [0, 1, 2]


def write(folder, name, text: str | bytes):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


GOOD = "sentence\tlabel\na good film \t1\na bad film \t0\n"


@pytest.mark.parametrize(
    "train,dev,message",
    [
        (None, GOOD, "train.tsv: no such file"),
        (GOOD, None, "dev.tsv: no such file"),
        ("sentence\tscore\nfine\t1\n", GOOD, "train.tsv: lacks column(s) label of GLUE sst2 (found: sentence, score"),
        ("text\tlabel\nfine\t1\n", GOOD, "train.tsv: lacks column(s) sentence of GLUE sst2"),
        (GOOD, "sentence\tlabel\nfine\t1\nawful\t2\n", "dev.tsv:3: label '2' is not among the training labels (0, 1)"),
        (GOOD, "sentence\tlabel\nfine\tpositive\n", "dev.tsv:2: label 'positive' is not among the training labels"),
        (b"sentence\tlabel\nfine\t1\n" + b"caf\xe9\t1\n", GOOD, "train.tsv:3: not UTF-8 text (byte 0xe9"),
        ("sentence\tlabel\n", GOOD, "train.tsv: no data rows (the train split is empty)"),
        ("", GOOD, "train.tsv: empty file"),
        (GOOD, "sentence\tlabel\nfine\t1\textra\n", "dev.tsv:2: 3 tab-separated fields, the header has 2"),
    ],
)
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, train, dev, message):
    if train is not None:
        write(tmp_path, "train.tsv", train)
    if dev is not None:
        write(tmp_path, "dev.tsv", dev)
    with pytest.raises(UserError) as error:
        data.read_glue_dir(tmp_path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_data_dir(tmp_path):
    with pytest.raises(UserError, match="data_dir=.*nope.*: no such folder"):
        data.read_glue_dir(tmp_path / "nope")


def test_unreadable_file(tmp_path):
    write(tmp_path, "dev.tsv", GOOD)
    (tmp_path / "train.tsv").mkdir()  # a folder where a file should be: reading fails
    with pytest.raises(UserError, match="train.tsv: not a regular file"):
        data.read_glue_dir(tmp_path)


def test_offline_hub_falls_back_to_the_sample_loudly(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.WARNING):
        raw, task, source = data.load_raw(**DEFAULTS)
    assert source.kind == "sample" and task.name == "sst2"
    assert "UNREACHABLE" in caplog.text and "SAMPLE" in caplog.text
    assert len(raw["train"]) >= 300 and len(raw["validation"]) >= 50
    assert set(raw["train"]["label"]) == {0, 1}


def prepare(sst2, cache_dir, task="classification", max_length=64):
    overrides = ["size=tiny", f"task={task}", f"data_dir={sst2}", f"cache_dir={cache_dir}", f"max_length={max_length}"]
    return prepare_data(load_config(REPO / "recipes/gptj/tp.yaml", overrides))


def test_tokenized_cache_is_keyed_and_reused(sst2, cache_dir):
    first = prepare(sst2, cache_dir)
    again = prepare(sst2, cache_dir)
    assert again.cache_path == first.cache_path
    assert prepare(sst2, cache_dir, max_length=32).cache_path != first.cache_path
    assert prepare(sst2, cache_dir, task="causal_lm", max_length=32).cache_path != first.cache_path
    train = first.splits["train"]
    assert len(train) == SST2_ROWS["train.tsv"] and len(first.splits["validation"]) == SST2_ROWS["dev.tsv"]
    lengths = data.column(train, "length")
    assert max(lengths) <= 64
    assert sum(lengths) / len(lengths) < 20  # SST-2 is short: padding to 64 or 128 would be mostly waste
    assert len(first.tokenizer) <= 8192


def test_causal_lm_blocks(sst2, cache_dir):
    prepared = prepare(sst2, cache_dir, task="causal_lm", max_length=32)
    blocks = data.column(prepared.splits["train"], "input_ids")
    assert {len(b) for b in blocks} == {32}
    eos = prepared.tokenizer.eos_token_id
    assert sum(b.count(eos) for b in blocks) >= SST2_ROWS["train.tsv"] - 32  # a separator per sentence, last block cut
    assert "test" not in prepared.splits


def test_global_batches_cover_each_sample_once_per_epoch():
    lengths = [(i * 7919) % 50 + 1 for i in range(1003)]
    for group in (True, False):
        batches = sampling.GlobalBatches(lengths, 16, seed=3, group_by_length=group)
        epoch = batches.epoch(0)
        flat = [i for b in epoch for i in b]
        assert len(epoch) == len(batches) == 1003 // 16
        assert all(len(b) == 16 for b in epoch)
        assert len(set(flat)) == len(flat) == 62 * 16
        assert batches.epoch(0) == epoch and batches.epoch(1) != epoch


def test_group_by_length_reduces_padding():
    lengths = [(i * 7919) % 50 + 1 for i in range(4000)]

    def padding(group):
        epoch = sampling.GlobalBatches(lengths, 32, seed=0, group_by_length=group).epoch(0)
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in epoch)

    assert padding(True) < 0.2 * padding(False)


def test_micro_batches_partition_the_global_batch():
    batch = list(range(24))
    shares = [sampling.accumulation_slices(batch, rank, 3, 2) for rank in range(3)]
    assert sorted(i for share in shares for micro in share for i in micro) == batch
    assert all(len(micro) == 4 for share in shares for micro in share)


def test_padded_batches_pad_dynamically_both_sides():
    import torch

    from parallel_finetune.data.batch import BatchKind, PaddedBatcher, TokenizedSplit, padded_batch
    from parallel_finetune.tasks.task import HeadKind

    split = TokenizedSplit(HeadKind.CLASSIFICATION, [[5, 6, 7], [8]], [3, 1], [1, 1], labels=[1, 0])
    right = PaddedBatcher(split, pad_id=0, padding_side="right", pad_multiple=1, device=torch.device("cpu"))
    batch = right.batch([0, 1])
    assert batch.kind is BatchKind.PADDED and not batch.packed
    assert batch.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.labels.tolist() == [1, 0] and batch.scored() == 2
    assert right.batch([0, 1], labelled=False).labels is None  # a test split's rows
    left = padded_batch([[5, 6, 7], [8]], pad_id=0, padding_side="left")
    assert left.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left.positions.tolist() == [[0, 1, 2], [0, 0, 0]]  # a left-padded row sees its unpadded positions
    assert padded_batch([[1, 2, 3]], pad_id=0, pad_multiple=8).input_ids.shape == (1, 8)


def test_a_byte_order_mark_and_any_line_ending_are_accepted(tmp_path):
    rows = ["sentence\tlabel", "a good film\t1", "a bad film\t0"]
    for name, text in [
        ("bom", "\ufeff" + "\n".join(rows) + "\n"),
        ("cr", "\r".join(rows) + "\r"),
        ("crlf", "\r\n".join(rows) + "\r\n"),
    ]:
        write(tmp_path / name, "train.tsv", text)
        write(tmp_path / name, "dev.tsv", text)
        train = data.read_glue_dir(tmp_path / name)["train"]
        assert (train["text"], train["label"]) == (["a good film", "a bad film"], [1, 0])
    write(tmp_path / "cr-bad", "train.tsv", "\r".join(rows) + "\r")
    write(tmp_path / "cr-bad", "dev.tsv", "sentence\tlabel\rfine\t1\rawful\t2\r")
    with pytest.raises(UserError, match=r"dev.tsv:3: label '2' is not among"):  # line 3, not the whole file
        data.read_glue_dir(tmp_path / "cr-bad")


def test_rows_with_an_empty_sentence_are_dropped_and_counted(tmp_path, caplog):
    write(tmp_path, "train.tsv", "sentence\tlabel\na good film\t1\n\t0\n   \t1\nbad\t0\n")
    write(tmp_path, "dev.tsv", GOOD)
    with caplog.at_level(logging.WARNING):
        train = data.read_glue_dir(tmp_path)["train"]
    assert (train["text"], train["label"], train["index"]) == (["a good film", "bad"], [1, 0], [0, 3])
    assert "train.tsv: dropped 2 row(s) with an empty text (lines 3, 4)" in caplog.text


def test_a_fifo_is_refused_instead_of_hanging(tmp_path):
    write(tmp_path, "dev.tsv", GOOD)
    os.mkfifo(tmp_path / "train.tsv")
    with pytest.raises(UserError, match=r"train.tsv: not a regular file"):
        data.read_glue_dir(tmp_path)


def test_an_unreachable_hub_is_one_line_without_retries(monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        raw, task, source = data.load_raw(**DEFAULTS)
    assert source.kind == "sample" and time.monotonic() - started < 5
    assert len(caplog.records) == 1 and "THE HUGGING FACE HUB IS UNREACHABLE (URLError" in caplog.text


def test_the_fingerprint_check_computes_is_the_one_a_run_records(tmp_path, sst2):
    """--check compares a checkpoint's data fingerprint with one computed from the files alone: for a GLUE folder,
    for user files with a held-out validation split (its rows depend on the percentage and seed) and without."""
    from parallel_finetune.tasks import data_fingerprint

    write(tmp_path, "train.csv", 'text,label\n"a good, fine film",pos\nbad,neg\nawful,neg\ngreat,pos\n')
    write(tmp_path, "dev.csv", "text,label\nfine,pos\n")
    cases = [
        dict(data_dir=str(sst2)),
        dict(train_file=str(tmp_path / "train.csv"), validation_split_percentage=50.0),
        dict(train_file=str(tmp_path / "train.csv"), validation_file=str(tmp_path / "dev.csv")),
    ]
    fingerprints = set()
    for case in cases:
        section = DataSection(**case)
        raw, task, source = data.load_raw(data=section, model=ModelSection(), seed=42, predict=False)
        assert data_fingerprint(data=section, seed=42) == source.fingerprint
        fingerprints.add(source.fingerprint)
    assert len(fingerprints) == 3
    carved = DataSection(**cases[1])
    assert data_fingerprint(data=carved, seed=7) != data_fingerprint(data=carved, seed=42)  # other held-out rows


# ------------------------------------------------ issue 34: token ids depend on the special tokens; EOS must exist
@pytest.fixture(scope="module")
def pretrained_gpt2(sst2, tmp_path_factory):
    """A small pretrained GPT-2 folder (random weights, a tokenizer learned from SST-2), and 300 SST-2 rows as a
    CSV to train on."""
    from parallel_finetune.model import synthetic

    sentences = data.column(data.read_glue_dir(sst2)["train"], "text")[:300]
    root = tmp_path_factory.mktemp("pretrained")
    rows = root / "rows.csv"
    rows.write_text("text,label\n" + "".join(f'"{s}",{i % 2}\n' for i, s in enumerate(sentences)))
    folder = synthetic.write_checkpoint(root / "gpt2", "gpt2", sentences, hidden=64, layers=2, heads=4, vocab_size=512)
    return folder, rows


def edit_json(path, **changes):
    import json

    settings = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))


def prepare_pretrained(folder, rows, cache_dir, task="causal_lm"):
    overrides = [f"model={folder}", f"task={task}", f"train_file={rows}", f"cache_dir={cache_dir}", "max_length=32"]
    return prepare_data(load_config(REPO / "recipes/gpt2/tp.yaml", overrides))


def test_the_cache_key_follows_the_special_tokens_the_data_code_inserts(pretrained_gpt2, tmp_path):
    """Changing a checkpoint's eos_token (the vocabulary unchanged) makes new token ids, not a reuse of the old."""
    import shutil

    folder, rows = pretrained_gpt2
    folder = shutil.copytree(folder, tmp_path / "model")
    tokenizer = data.load_hf_tokenizer(folder)  # a second special token, as chat tokenizers have (<|im_end|>)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tokenizer.save_pretrained(folder)
    before = prepare_pretrained(folder, rows, tmp_path / "cache")
    old_eos, new_eos = before.tokenizer.eos_token_id, before.tokenizer.convert_tokens_to_ids("<|im_end|>")
    edit_json(folder / "tokenizer_config.json", eos_token="<|im_end|>")
    after = prepare_pretrained(folder, rows, tmp_path / "cache")
    assert after.cache_path != before.cache_path and after.tokenizer.eos_token_id == new_eos
    separators = [block.count(new_eos) for block in data.column(after.splits["train"], "input_ids")]
    assert sum(separators) >= sum(block.count(old_eos) for block in data.column(before.splits["train"], "input_ids"))


def test_a_tokenizer_without_eos_is_refused_up_front_or_takes_the_model_configs(pretrained_gpt2, tmp_path, capsys):
    import shutil

    from parallel_finetune.train import main

    folder, rows = pretrained_gpt2
    folder = shutil.copytree(folder, tmp_path / "model")
    specials = dict(eos_token=None, bos_token=None, pad_token=None, unk_token=None)
    edit_json(folder / "tokenizer_config.json", **specials)
    # the model's config.json names eos_token_id 0: the run uses it, and says so
    prepared = prepare_pretrained(folder, rows, tmp_path / "cache")
    assert prepared.tokenizer.eos_token_id == 0 and prepared.tokenizer.pad_token_id == 0
    edit_json(folder / "config.json", eos_token_id=None, bos_token_id=None)
    message = f"tokenizer {str(folder)!r} has no EOS token (eos_token in tokenizer_config.json)"
    with pytest.raises(UserError, match=re.escape(message)):
        prepare_pretrained(folder, rows, tmp_path / "cache")
    with pytest.raises(UserError, match="has neither a padding token nor an EOS token"):
        prepare_pretrained(folder, rows, tmp_path / "cache", task="classification")
    check = [f"model={folder}", "task=causal_lm", f"train_file={rows}", f"cache_dir={tmp_path / 'cache'}"]
    capsys.readouterr()
    assert main(["--check", str(REPO / "recipes/gpt2/tp.yaml"), *check, f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {message}"), err


def test_of_two_runs_learning_a_tokenizer_at_once_both_use_the_one_the_cache_kept(tmp_path):
    """WordPiece's trainer orders equally frequent pieces differently in each process: a run whose save lost the
    race to another's (the folder already there when it renames) takes the saved tokenizer, not its own."""
    sentences = [f"row {n}: the quick brown fox {'jumps' * (n % 3)} over {n * 7} lazy dogs" for n in range(60)]
    folder = tmp_path / "tokenizers" / "learned"
    kept = data.train_tokenizer("wordpiece", list(reversed(sentences)), 300, folder).get_vocab()
    assert data.train_tokenizer("wordpiece", sentences, 300, tmp_path / "alone").get_vocab() != kept  # its own
    assert data.train_tokenizer("wordpiece", sentences, 300, folder).get_vocab() == kept  # lost the race: the kept one


def test_a_tiny_tokenizer_is_cached_by_what_it_learned_from_not_only_by_its_source(tmp_path):
    """Two tasks reading one source (a reward model's pairs, kto's unpaired rows) learn from other texts or orders:
    each gets the tokenizer of its own sentences, whichever ran first (the cache once handed the first one's over)."""
    from parallel_finetune.tasks.sources import Source

    source = Source("sample", "the preference sample", "dpo-sample-0123")
    tiny = data.TinyTokenizer("bpe", 300, ())
    sentences = [f"row {n}: the quick brown fox {'jumps' * (n % 3)} over {n * 7} lazy dogs" for n in range(60)]

    def learned(texts):
        tokenizer = data.load_tokenizer(None, "tiny", "", tiny, texts, source, tmp_path)
        return tokenizer.get_vocab()

    first = learned(sentences)
    assert learned(list(reversed(sentences))[:30]) != first  # other sentences: their own tokenizer
    assert learned(sentences) == first  # the same sentences: the cached one
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2
