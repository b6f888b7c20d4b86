"""Your own data and every GLUE task (tasks/): the same rows in every file format give the same tokens, tokenizer
and losses; each GLUE task read from its real file layout trains, reports its official metrics and writes GLUE's
submission file; bad input is one line naming file and row; label names reach the exported model."""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import RECIPE, check, launch, load_task_of, no_dropout, prepare_data, python
from glue_fixtures import LABELS, split_files, write_glue_task

from parallel_finetune.data import prepare as data
from parallel_finetune.errors import UserError
from parallel_finetune.resolve import load_config
from parallel_finetune.tasks import TASKS, read_label_file

FORMATS = ("tsv", "csv", "jsonl", "parquet", "dataset")
# Texts a naive reader or writer breaks: quoted commas, tabs, double quotes, newlines inside the text.
AWKWARD = (
    'a "quoted, comma" film, with commas , everywhere',
    "a tab\tinside the text\tand another",
    'she said ""hi"" and "left" early',
    "a first line\nand a second line\nand a third",
    '"starts with a quote, ends with one"',
    'mixed:\ta "tab", a comma\nand a newline',
)
# The official metric keys of each GLUE task (GLUE's evaluation; MNLI's mismatched dev set prefixed).
GLUE_METRICS = {
    "cola": {"matthews_correlation"},
    "sst2": {"accuracy"},
    "mrpc": {"accuracy", "f1"},
    "qqp": {"accuracy", "f1"},
    "stsb": {"pearson", "spearmanr"},
    "mnli": {"accuracy", "mismatched_accuracy"},
    "qnli": {"accuracy"},
    "rte": {"accuracy"},
    "wnli": {"accuracy"},
}


def tiny(cache_dir: Path, **extra) -> list[str]:
    """A few fp32 steps of the tiny GPT-J on small data."""
    settings = {
        "size": "tiny",
        "cache_dir": cache_dir,
        "precision": "fp32",
        "max_steps": 2,
        "batch_size": 8,
        "max_length": 64,
        "eval_batch_size": 64,
        "log_every": 1,
        "export": "false",
        "peak_tflops": 0.1,
        **extra,
    }
    return [f"{key}={value}" for key, value in settings.items()] + no_dropout("gptj")


def sst2_rows(sst2: Path, file: str, count: int) -> list[tuple[str, int]]:
    lines = (sst2 / file).read_text(encoding="utf-8").splitlines()[1 : count + 1]
    return [(sentence, int(label)) for sentence, label in (line.split("\t") for line in lines)]


def write_rows(folder: Path, kind: str, splits: dict[str, list[tuple[str, int]]]) -> list[str]:
    """`splits` (train, validation) in format `kind` under `folder`; returns the overrides that name them."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "dataset":
        columns = {
            name: {"sentence": [t for t, _ in rows], "label": [y for _, y in rows]} for name, rows in splits.items()
        }
        datasets.DatasetDict({name: datasets.Dataset.from_dict(c) for name, c in columns.items()}).save_to_disk(folder)
        return [f"dataset={folder}"]
    paths = {}
    for name, rows in splits.items():
        path = paths[name] = folder / f"{name}.{kind}"
        if kind in ("tsv", "csv"):
            with open(path, "w", encoding="utf-8", newline="") as handle:
                writer = csv.writer(handle, delimiter="\t" if kind == "tsv" else ",")
                writer.writerow(["sentence", "label"])
                writer.writerows(rows)
        elif kind == "jsonl":
            path.write_text("".join(json.dumps({"sentence": t, "label": y}) + "\n" for t, y in rows), encoding="utf-8")
        else:
            table = pa.table({"sentence": [t for t, _ in rows], "label": [y for _, y in rows]})
            pq.write_table(table, path)
    return [f"train_file={paths['train']}", f"validation_file={paths['validation']}"]


@pytest.fixture(scope="module")
def format_rows(sst2) -> dict[str, list[tuple[str, int]]]:
    """Real SST-2 rows (240 train, 60 dev), some of them rewritten to hold the awkward texts."""
    train, dev = sst2_rows(sst2, "train.tsv", 240), sst2_rows(sst2, "dev.tsv", 60)
    for number, text in enumerate(AWKWARD):
        train[7 * number] = (f"{text} {train[7 * number][0]}", train[7 * number][1])
        dev[5 * number] = (f"{dev[5 * number][0]} {text}", dev[5 * number][1])
    return {"train": train, "validation": dev}


@pytest.fixture(scope="module")
def format_sources(tmp_path_factory, format_rows) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("formats")
    return {kind: write_rows(root / kind, kind, format_rows) for kind in FORMATS}


def test_every_format_gives_the_same_rows_tokens_and_tokenizer(format_sources, format_rows, cache_dir):
    prepared = {}
    for kind, source in format_sources.items():
        config = load_config(RECIPE, tiny(cache_dir) + source)
        raw = load_task_of(config)[0]
        for split, rows in format_rows.items():  # the awkward texts read back as written (stripped)
            assert raw[split]["text"] == [t.strip() for t, _ in rows], kind
            assert raw[split]["label"] == [y for _, y in rows], kind
        prepared[kind] = prepare_data(config)
    reference = prepared["tsv"]
    assert reference.source.kind == "files" and prepared["dataset"].source.kind == "dataset"
    assert len({p.source.fingerprint for p in prepared.values()}) == len(FORMATS)  # each a cache of its own...
    assert len({p.cache_path for p in prepared.values()}) == len(FORMATS)
    tokenizers = {p.name for p in (cache_dir / "tokenizers").iterdir()}
    assert all(any(p.source.fingerprint in name for name in tokenizers) for p in prepared.values())
    for kind, other in prepared.items():  # ...holding the same tokenizer, task and tokens
        assert data.tokenizer_identity(other.tokenizer) == data.tokenizer_identity(reference.tokenizer), kind
        assert other.tokenizer.backend_tokenizer.to_str() == reference.tokenizer.backend_tokenizer.to_str(), kind
        assert other.task == reference.task, kind
        assert set(other.splits) == set(reference.splits) == {"train", "validation"}
        for split, tokens in reference.splits.items():
            assert other.splits[split].column_names == tokens.column_names
            for column in tokens.column_names:  # input_ids, length, label, index
                assert other.splits[split][column] == tokens[column], (kind, split, column)
    assert reference.task.label_values == ("0", "1")


def test_every_format_trains_the_same_losses(format_sources, cache_dir, tmp_path):
    losses = {}
    for kind, source in format_sources.items():
        run = launch(1, tiny(cache_dir, max_steps=5) + source, tmp_path / kind)
        losses[kind] = run.losses
    assert len(losses["tsv"]) == 5 and losses["tsv"][0] != losses["tsv"][-1]
    assert all(trajectory == losses["tsv"] for trajectory in losses.values()), losses


# ----------------------------------------------------------------------------------------------- GLUE


@pytest.fixture(scope="module")
def glue_folders(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("glue")
    return {task: (root / task, write_glue_task(root / task, task)) for task in TASKS}


def glue_config(folder: Path, task: str, cache_dir: Path, **extra):
    return load_config(RECIPE, tiny(cache_dir, glue_task=task, data_dir=folder, **extra))


@pytest.mark.parametrize("name", list(TASKS))
def test_a_glue_folder_reads_into_texts_and_labels(name, glue_folders, cache_dir):
    folder, written = glue_folders[name]
    raw, task, source = load_task_of(glue_config(folder, name, cache_dir))
    glue = TASKS[name]
    assert source.kind == "glue" and task.name == task.metric == name
    assert set(raw) == set(written) == set(split_files(name))
    assert task.validation_splits == tuple(s for s in written if s.startswith("validation"))
    assert task.test_splits == tuple(s for s in written if s.startswith("test"))
    assert task.label_names == glue.names and task.label_values == (LABELS[name] or ())
    assert task.pair == (glue.text_pair is not None)
    for split, rows in written.items():
        got = raw[split]
        assert got["text"] == [row.text.strip() for row in rows], split
        if task.pair:
            assert got["text_pair"] == [row.text_pair for row in rows], split
        else:
            assert "text_pair" not in got.column_names
        assert got["index"] == list(range(len(rows)))
        if split.startswith("test"):
            assert "label" not in got.column_names
        elif name == "stsb":
            assert got["label"] == [float(row.label) for row in rows]
        else:
            assert [task.label_values[i] for i in got["label"]] == [row.label for row in rows], split
    assert any('"' in text for text in raw["train"]["text"])  # GLUE's stray quotes are text, not quoting


@pytest.mark.parametrize("name", list(TASKS))
def test_a_glue_task_trains_reports_its_metrics_and_predicts(name, glue_folders, cache_dir, tmp_path):
    folder, written = glue_folders[name]
    run = launch(1, tiny(cache_dir, glue_task=name, data_dir=folder, predict="true"), tmp_path)
    keys = list(run.summary)[: list(run.summary).index("task")]
    assert {k for k in keys if not k.endswith("eval_loss")} == GLUE_METRICS[name]
    assert read_label_file(run.output_dir).label_names == TASKS[name].names
    for split in (s for s in written if s.startswith("test")):
        file = "predictions.tsv" if split == "test" else f"predictions_{split.removeprefix('test_')}.tsv"
        lines = (run.output_dir / file).read_text(encoding="utf-8").splitlines()
        assert lines[0] == "index\tprediction"
        rows = [line.split("\t") for line in lines[1:]]
        assert [int(index) for index, _ in rows] == list(range(len(written[split])))
        for _, value in rows:  # GLUE's own values: 0/1, entailment names, or a score with 3 decimals
            assert re.fullmatch(r"-?\d+\.\d{3}", value) if name == "stsb" else value in LABELS[name], value


# ----------------------------------------------------------------------------------------------- bad input


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "files,overrides,message",
    [
        (
            {"train.csv": "sentence,label\ngood,pos\nbad,neg\n", "dev.csv": "sentence,label\nok,pos\n"},
            ["text_column=nope"],
            r"text_column='nope': \S*train\.csv has no such column \(sentence, label\)",
        ),
        (
            {"train.csv": "sentence,label\ngood,pos\nbad,neg\n", "dev.csv": "sentence,label\nok,pos\nmeh,neutral\n"},
            [],
            r"\S*dev\.csv:3: label 'neutral' is not among the training labels \(neg, pos\)",
        ),
        (
            {"train.csv": "sentence,label\ngood,4.5\nbad,abc\n", "dev.csv": "sentence,label\nok,3\n"},
            ["problem_type=regression"],
            r"\S*train\.csv:3: regression target 'abc' in column 'label' is not a number",
        ),
        (
            {
                "train.csv": "sentence1,sentence2,label\na,b,yes\nc,d,no\n",
                "dev.csv": "sentence1,label\na,yes\n",
            },
            [],
            r"\S*dev\.csv: no column 'sentence2' \(text_pair_column; found: sentence1, label\)",
        ),
        (
            {"train.csv": "sentence,label\ngood,pos\nbad,neg\n", "dev.csv": "sentence,label\n"},
            [],
            r"\S*dev\.csv: no data rows \(the validation split is empty\)",
        ),
        (
            {"train.txt": "sentence,label\ngood,pos\n", "dev.csv": "sentence,label\nok,pos\n"},
            [],
            r"train_file='\S*train\.txt': unknown file type '\.txt'; valid: \.csv, \.tsv, \.jsonl, \.json, \.parquet",
        ),
        (
            {"dev.csv": "sentence,label\nok,pos\n"},
            [],
            r"validation_file and test_file need train_file .*; set train_file=PATH",
        ),
        (
            {"train.csv": "sentence,label\ngood,4.5\nbad,nan\n", "dev.csv": "sentence,label\nok,3\n"},
            [],
            r"\S*train\.csv:3: label 'nan' in column 'label' is not a finite number; a label is a class name, a "
            r"class id or a finite regression target",
        ),
        (
            {"train.csv": "sentence,label\ngood,4.5\nbad,1.5\n", "dev.csv": "sentence,label\nok,3\nmeh,-inf\n"},
            ["problem_type=regression"],
            r"\S*dev\.csv:3: label '-inf' in column 'label' is not a finite number",
        ),
        (
            {"train.csv": "sentence,label\ngood,1\nbad,0\nmeh,NaN\n", "dev.csv": "sentence,label\nok,1\n"},
            [],
            r"\S*train\.csv:4: label 'NaN' in column 'label' is not a finite number",
        ),
        (
            {"train.csv": "sentence,label\n", "dev.csv": "sentence,label\nok,pos\n"},
            [],
            r"\S*train\.csv: no data rows \(the train split is empty\)$",
        ),
        (
            {"train.tsv": "sentence;label\ngood;pos\nbad;neg\n", "dev.csv": "sentence,label\nok,pos\n"},
            [],
            r"no text column named sentence, text, sentence1; set text_column= one of sentence;label; the header is "
            r"one column: is the file separated by ';'\?",
        ),
        (
            {"train.jsonl": '{"sentence": "good", "label": ["pos"]}\n', "dev.csv": "sentence,label\nok,pos\n"},
            [],
            r"\S*train\.jsonl:1: label \['pos'\] in column 'label' is a list; a label is one value",
        ),
        (
            {
                "train.jsonl": '{"sentence": "good", "label": 1}\n{"sentence": {"t": "bad"}, "label": 0}\n',
                "dev.csv": "sentence,label\nok,1\n",
            },
            [],
            r"\S*train\.jsonl:2: \{'t': 'bad'\} in column 'sentence' is a dict, not text",
        ),
        (
            {"train.csv": "sentence,label\ngood,pos\nbad,neg\n", "dev.csv": "sentence,label\nok,pos\n"},
            ["text_pair_column=label"],
            r"text_pair_column='label' and label_column='label': one column for two uses; the text, the text pair "
            r"and the label are different columns of \S*train\.csv \(sentence, label\)",
        ),
        (
            {"train.csv": "sentence,label\ngood,pos\nbad,neg\n", "dev.csv": "sentence,label\nok,pos\n"},
            ["text_column=label"],
            r"text_column='label' and label_column='label': one column for two uses",
        ),
        (
            {"train.csv": "sentence,label\ngood,pos\nbad,neg\n", "dev.csv": "sentence,label\nok,pos\n"},
            ["predict=true"],
            r"predict=true: the data has no test split; give test_file=PATH",
        ),
    ],
    ids=[
        "unknown-column",
        "unseen-dev-label",
        "regression-not-a-number",
        "pair-missing",
        "empty-dev",
        "extension",
        "no-train",
        "nan-target",
        "inf-target-in-dev",
        "nan-among-0-1-labels",
        "header-only-train",
        "semicolon-header-hint",
        "list-label",
        "nested-text",
        "pair-is-the-label",
        "text-is-the-label",
        "predict-without-test",
    ],
)
def test_bad_input_is_one_line_naming_file_row_and_what_is_valid(tmp_path, cache_dir, files, overrides, message):
    paths = {name.split(".")[0]: write(tmp_path / name, text) for name, text in files.items()}
    given = [f"train_file={paths['train']}"] if "train" in paths else []
    config = load_config(RECIPE, tiny(cache_dir, validation_file=paths["dev"]) + given + overrides)
    with pytest.raises(UserError) as error:
        load_task_of(config)
    assert re.search(message, str(error.value)) and "\n" not in str(error.value), str(error.value)


def test_bad_input_through_check_is_an_error_line_and_exit_2(tmp_path):
    train = write(tmp_path / "train.csv", "sentence,label\ngood,pos\nbad,neg\n")
    proc = check("size=tiny", f"train_file={train}", "text_column=nope", nproc=1)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: text_column='nope': "), proc.stderr
    assert "has no such column (sentence, label)" in lines[0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train_file={train}", "validation_file={nan_dev}"], r"\S*dev\.csv:3: label 'nan' in column 'label' is not a"),
        (["train_file={train}", "predict=true"], r"predict=true: the data has no test split; give test_file=PATH"),
        (["dataset={train}"], r"dataset='\S*train\.csv' is a file: .*; for a file of rows give train_file="),
        (["glue_task=rte"], r"glue_task=rte: the Hugging Face Hub is unreachable \(.*\); give data_dir=PATH"),
    ],
    ids=["nan-target", "predict-without-test", "dataset-is-a-file", "glue-task-offline"],
)
def test_data_check_refuses_what_the_run_would_fail_on(tmp_path, overrides, message):
    """--check (what make runs before torchrun) stops each of these in one line, exit code 2, before any training:
    a non-finite target, predict=true without a test split, a file given as dataset=, a GLUE task whose rows
    cannot be had (offline, nothing in an empty Hub cache)."""
    train = write(tmp_path / "train.csv", "sentence,label\n" + "".join(f"row {i},{i % 3 * 1.5}\n" for i in range(40)))
    nan_dev = write(tmp_path / "dev.csv", "sentence,label\nok,1.5\nmeh,nan\n")
    given = [o.format(train=train, nan_dev=nan_dev) for o in overrides]
    empty_cache = {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    proc = python(
        "-m", "parallel_finetune.train", "--check", "--nproc", "1", str(RECIPE), "size=tiny", *given, env=empty_cache
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and re.search(message, lines[0]), proc.stderr


def test_a_saved_datasets_folder_given_as_train_file_says_to_give_dataset(tmp_path, cache_dir):
    """Issue 54: train_file= a folder written by save_to_disk said "unknown file type '(none)'"; it names the key
    that reads such a folder (as make's DATA= does: dataset_dict.json or state.json), any other folder the keys."""
    rows = datasets.Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0]})
    datasets.DatasetDict({"train": rows}).save_to_disk(tmp_path / "splits")
    rows.save_to_disk(tmp_path / "one")
    (tmp_path / "plain").mkdir()
    train = write(tmp_path / "train.csv", "sentence,label\ngood,1\nbad,0\n")
    for name, key, said in (
        ("splits", "train_file", "(it holds dataset_dict.json): give dataset={path} (its splits train, validation"),
        ("one", "validation_file", "(it holds state.json): give dataset={path} (its splits train, validation, test)"),
        ("plain", "train_file", "is a folder; train_file= takes a file of rows (.csv, .tsv, .jsonl, .json, .parquet)"),
    ):
        path = tmp_path / name
        given = {"train_file": train} | {key: path}
        with pytest.raises(UserError) as error:
            load_task_of(load_config(RECIPE, tiny(cache_dir, **given)))
        assert str(error.value).startswith(f"{key}={str(path)!r} ") and said.format(path=path) in str(error.value)
        assert "\n" not in str(error.value)


def test_non_finite_and_missing_targets_in_json_parquet_and_glue_files(tmp_path, cache_dir, glue_folders):
    """A NaN or an infinity is refused as not finite wherever it comes from (a JSON `NaN`, a Parquet float NaN, an
    STS-B score); a null is a missing label, refused as such."""
    dev = write(tmp_path / "dev.csv", "sentence,label\nok,1.5\n")
    cases = {
        "nan.jsonl": ('{"sentence": "a", "label": 1.5}\n{"sentence": "b", "label": NaN}\n', ":2: label nan in"),
        "inf.jsonl": ('{"sentence": "a", "label": Infinity}\n{"sentence": "b", "label": 2.5}\n', ":1: label inf in"),
        "null.jsonl": ('{"sentence": "a", "label": 1.5}\n{"sentence": "b", "label": null}\n', ":2: no label in"),
        "nan.parquet": (pa.table({"sentence": ["a", "b"], "label": [0.5, float("nan")]}), " row 2: label nan in"),
        "null.parquet": (pa.table({"sentence": ["a", "b"], "label": [0.5, None]}), " row 2: no label in"),
    }
    for name, (content, expected) in cases.items():
        path = tmp_path / name
        if isinstance(content, str):
            write(path, content)
        else:
            pq.write_table(content, path)
        config = load_config(RECIPE, tiny(cache_dir, train_file=path, validation_file=dev))
        with pytest.raises(UserError) as error:
            load_task_of(config)
        assert str(error.value).startswith(f"{path}{expected} column 'label'"), (name, str(error.value))
    stsb = tmp_path / "stsb"
    write_glue_task(stsb, "stsb")
    lines = (stsb / "dev.tsv").read_text(encoding="utf-8").splitlines()
    lines[3] = "\t".join(lines[3].split("\t")[:-1] + ["nan"])
    write(stsb / "dev.tsv", "\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"dev\.tsv:4: label 'nan' in column 'score' is not a finite number"):
        load_task_of(glue_config(stsb, "stsb", cache_dir))


def test_whole_number_labels_are_classes_however_written(tmp_path, cache_dir, caplog):
    """`0`, `01`, `1.0` and a float Parquet column of 0.0/1.0 (what pandas writes once a value is missing) are the
    class ids 0 and 1, in train and dev alike; a fraction makes a regression. The log says which, and why."""
    train = write(tmp_path / "train.csv", "sentence,label\na,0\nb,01\nc,1.0\nd,1\n")
    dev = write(tmp_path / "dev.csv", "sentence,label\nx,01\ny,0.0\n")
    floats = tmp_path / "train.parquet"
    pq.write_table(pa.table({"sentence": ["a", "b", "c"], "label": [0.0, 1.0, 1.0]}), floats)
    for source in (train, floats):
        with caplog.at_level(logging.INFO, logger="parallel_finetune"):
            raw, task, _ = load_task_of(load_config(RECIPE, tiny(cache_dir, train_file=source, validation_file=dev)))
        assert task.problem_type == "single_label_classification" and task.label_values == ("0", "1"), source
        assert raw["validation"]["label"] == [1, 0]
        assert f"{source}: labels in column 'label' are whole numbers: class ids" in caplog.text
    assert raw["train"]["label"] == [0, 1, 1]
    fraction = write(tmp_path / "scores.csv", "sentence,label\na,0\nb,0.5\n")
    with caplog.at_level(logging.INFO, logger="parallel_finetune"):
        task = load_task_of(load_config(RECIPE, tiny(cache_dir, train_file=fraction, validation_file=dev)))[1]
    assert task.problem_type == "regression"
    assert f"{fraction}: labels in column 'label' are numbers, 0.5 ({fraction}:3) with a fraction" in caplog.text


def test_a_semicolon_separated_csv_reads_as_its_comma_twin(tmp_path, cache_dir, caplog):
    """Excel writes `;`-separated CSV where the decimal separator is a comma: its header line says so."""
    rows = [("a good, fine film", "pos"), ("bad; very bad", "neg"), ("ok", "pos")]
    for name, delimiter in (("comma.csv", ","), ("semicolon.csv", ";")):
        with open(tmp_path / name, "w", encoding="utf-8", newline="") as handle:
            csv.writer(handle, delimiter=delimiter).writerows([("sentence", "label"), *rows])
    dev = write(tmp_path / "dev.csv", "sentence,label\nok,pos\n")
    loaded = {}
    for name in ("comma.csv", "semicolon.csv"):
        with caplog.at_level(logging.INFO, logger="parallel_finetune"):
            config = load_config(RECIPE, tiny(cache_dir, train_file=tmp_path / name, validation_file=dev))
            loaded[name] = load_task_of(config)[0]["train"].to_dict()
    assert loaded["semicolon.csv"] == loaded["comma.csv"]
    assert loaded["comma.csv"]["text"] == [text for text, _ in rows]
    assert f"{tmp_path / 'semicolon.csv'}: its header line holds no ',' but ';': read as ';'-separated" in caplog.text
    assert "comma.csv: its header" not in caplog.text
    scores = write(tmp_path / "scores.csv", "sentence;label\ngood;4,5\nbad;1\n")  # the decimal comma Excel writes
    with pytest.raises(UserError, match=r"scores\.csv:2: label '4,5' in column 'label' is a number with a decimal "):
        load_task_of(load_config(RECIPE, tiny(cache_dir, train_file=scores, validation_file=dev)))


def test_the_validation_file_must_not_be_the_training_file(tmp_path, cache_dir):
    train = write(tmp_path / "train.csv", "sentence,label\ngood,pos\nbad,neg\n")
    (tmp_path / "link.csv").symlink_to(train)
    for validation in (train, tmp_path / "link.csv"):
        config = load_config(RECIPE, tiny(cache_dir, train_file=train, validation_file=validation))
        with pytest.raises(UserError, match=r"validation_file='\S*' is the train_file: the validation rows would be"):
            load_task_of(config)


@pytest.mark.parametrize(
    "folder,task,hint",
    [
        ("wnli", "rte", "'0' is a label of GLUE cola, sst2, mrpc, qqp, wnli"),
        ("rte", "wnli", "'entailment' is a label of GLUE mnli, qnli, rte"),
        ("sst2", "cola", "the header has 4 (source, label, original_label, sentence)"),
        ("qnli", "cola", "its first line reads like a header, which cola lacks"),
    ],
    ids=["wnli-as-rte", "rte-as-wnli", "sst2-as-cola", "qnli-as-cola"],
)
def test_a_glue_folder_of_another_task_asks_if_data_dir_is_the_right_one(folder, task, hint, glue_folders, cache_dir):
    with pytest.raises(UserError) as error:
        load_task_of(glue_config(glue_folders[folder][0], task, cache_dir))
    assert hint in str(error.value) and f"is data_dir the {task} folder?" in str(error.value), str(error.value)


def test_an_empty_test_text_keeps_its_row_and_gets_a_token(sst2, cache_dir, tmp_path):
    """A one-column test file's `""` or blank-looking row, and a null text, are rows (predictions.tsv names them
    by their index); an empty text is one token (GPT tokenizers give it none, which the model cannot read)."""
    with open(tmp_path / "train.csv", "w", encoding="utf-8", newline="") as handle:
        csv.writer(handle).writerows([("sentence", "label"), *sst2_rows(sst2, "train.tsv", 40)])
    write(tmp_path / "test.csv", 'sentence\nfine\n""\n   \nok\n\n')  # the last line is blank: no row
    config = load_config(RECIPE, tiny(cache_dir, train_file=tmp_path / "train.csv", test_file=tmp_path / "test.csv"))
    test = prepare_data(config).splits["test"]
    assert test["index"] == [0, 1, 2, 3] and min(test["length"]) == 1
    assert load_task_of(config)[0]["test"]["text"] == ["fine", "", "", "ok"]
    write(tmp_path / "test.jsonl", '{"sentence": "fine"}\n{"sentence": null}\n{"sentence": "ok"}\n')
    config = load_config(RECIPE, tiny(cache_dir, train_file=tmp_path / "train.csv", test_file=tmp_path / "test.jsonl"))
    assert load_task_of(config)[0]["test"]["index"] == [0, 1, 2]  # a null text is an empty one, not a dropped row


# ----------------------------------------------------------------------------------------------- labels out


def test_label_names_reach_the_exported_model_and_predictions(sst2, cache_dir, tmp_path):
    """A CSV with three string labels: the exported config's id2label, transformers' pipeline, labels.json and
    predictions.tsv all speak the label names."""
    from transformers import pipeline

    names = ("negative", "neutral", "positive")

    def labelled(rows):
        return [(text, names[1] if number % 3 == 0 else names[2 * y]) for number, (text, y) in enumerate(rows)]

    train, dev = labelled(sst2_rows(sst2, "train.tsv", 120)), labelled(sst2_rows(sst2, "dev.tsv", 42))
    dev, test = dev[:30], [text for text, _ in dev[30:]]  # a test file without labels
    test[3:3], test[7:7] = ["", ""], ["   "]  # empty texts: rows to predict too, at their own index
    for name, rows in (("train", train), ("dev", dev)):
        with open(tmp_path / f"{name}.csv", "w", encoding="utf-8", newline="") as handle:
            csv.writer(handle).writerows([("review", "sentiment"), *rows])
    with open(tmp_path / "test.csv", "w", encoding="utf-8", newline="") as handle:
        csv.writer(handle).writerows([("review",), *[(t,) for t in test]])
    files = {
        f"{key}_file": tmp_path / f"{name}.csv"
        for key, name in [("train", "train"), ("validation", "dev"), ("test", "test")]
    }
    out = tmp_path / "run"
    # eval_batch_size=2: the empty texts (the shortest rows) make a chunk of their own
    extra = dict(
        files, text_column="review", label_column="sentiment", export="true", predict="true", eval_batch_size=2
    )
    run = launch(1, tiny(cache_dir, **extra), out)

    assert read_label_file(out).label_names == names == read_label_file(out).label_values
    assert {"accuracy", "macro_f1"} <= set(run.summary)
    classifier = pipeline("text-classification", model=str(out / "hf"), device="cpu")
    assert classifier.model.config.id2label == dict(enumerate(names))
    assert classifier.model.config.label2id == {name: i for i, name in enumerate(names)}
    scores = classifier(["a gorgeous, witty film", "a dull mess"], top_k=None)
    assert all({score["label"] for score in row} == set(names) for row in scores)

    lines = (out / "predictions.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 1 + len(test)
    assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(len(test))]
    assert {line.split("\t")[1] for line in lines[1:]} <= set(names)
