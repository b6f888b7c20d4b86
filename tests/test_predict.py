"""scripts/predict.py: new texts classified by an exported model as the run itself predicted them.

Each run trains a tiny model for a few steps on a small CSV cut from SST-2, with predict=true on a test file; the
script's labels (or values) on that file must equal the run's predictions.tsv, which shows that it encodes texts
and pairs as training did and reads the labels the run learned."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
from conftest import REPO, launch, plant_custom_code, python, tiny_overrides

from parallel_finetune.inference import main as predict_main

SCRIPT = str(REPO / "scripts" / "predict.py")


def sst2_rows(sst2: Path, count: int) -> list[tuple[str, str]]:
    lines = (sst2 / "train.tsv").read_text(encoding="utf-8").splitlines()[1 : count + 1]
    return [tuple(line.split("\t")) for line in lines]


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def train(family_recipe: str, folder: Path, cache_dir: Path, sst2: Path, **keys) -> Path:
    overrides = tiny_overrides(sst2, cache_dir, family=family_recipe.split("/")[0], max_steps=4, **keys)
    overrides = [o for o in overrides if not o.startswith("data_dir=")] + ["predict=true", "tensor_parallel_degree=1"]
    launch(1, overrides, folder, recipe=REPO / "recipes" / family_recipe)
    return folder


def predicted(run: Path) -> list[str]:
    """predictions.tsv's prediction column, in row order."""
    return [line.split("\t")[1] for line in (run / "predictions.tsv").read_text().splitlines()[1:]]


def rows_of(output: str) -> list[list[str]]:
    return [line.split("\t") for line in output.strip().splitlines()]


@pytest.fixture(scope="module")
def reviews(sst2, cache_dir, tmp_path_factory):
    """A tiny BERT trained on a CSV whose labels are words (awful, great), exported as hf/."""
    folder = tmp_path_factory.mktemp("reviews")
    rows = [[text, "great" if label == "1" else "awful"] for text, label in sst2_rows(sst2, 320)]
    write_csv(folder / "train.csv", ["review", "sentiment"], rows[:288])
    test = write_csv(folder / "new.csv", ["id", "review"], [[i, text] for i, (text, _) in enumerate(rows[288:])])
    run = train(
        "bert/tp.yaml",
        folder / "run",
        cache_dir,
        sst2,
        train_file=folder / "train.csv",
        test_file=test,
        text_column="review",
        label_column="sentiment",
        export="true",
    )
    return run, test


def test_predict_prints_the_label_names_the_run_predicted(reviews, tmp_path):
    run, new = reviews
    done = python(SCRIPT, str(run / "hf"), str(new), "--batch-size", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    header, *rows = rows_of(done.stdout)
    assert header == ["index", "label", "score"]
    assert [int(r[0]) for r in rows] == list(range(32))
    assert {r[1] for r in rows} <= {"awful", "great"}
    assert [r[1] for r in rows] == predicted(run)  # as the run encoded and scored them; batches change nothing
    assert all(0.5 <= float(r[2]) <= 1 for r in rows)
    # the run folder works too (hf/ inside); --output writes the same rows and never replaces a file unasked
    out = tmp_path / "labels.tsv"
    assert python(SCRIPT, str(run), str(new), "--output", str(out)).returncode == 0
    assert rows_of(out.read_text()) == [header, *rows]
    again = python(SCRIPT, str(run), str(new), "--output", str(out))
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: --output {out}: already exists; choose a new file (or pass --overwrite for a file)"
    )


def test_a_lora_adapter_on_gpt2_classifies_pairs_as_training_joined_them(sst2, cache_dir, tmp_path):
    """adapter/ (peft) onto the tiny base/ beside it; the pair joined by EOS, three word labels (labels.json in
    adapter/ gives the head's width and names)."""
    texts = [text for text, _ in sst2_rows(sst2, 240)]
    rows = [[texts[i], texts[-i - 1], ("yes", "no", "maybe")[i % 3]] for i in range(len(texts))]
    train_file = write_csv(tmp_path / "pairs.csv", ["premise", "hypothesis", "verdict"], rows[:200])
    new = write_csv(tmp_path / "new.csv", ["premise", "hypothesis"], [r[:2] for r in rows[200:]])
    run = train(
        "gpt2/lora.yaml",
        tmp_path / "run",
        cache_dir,
        sst2,
        train_file=train_file,
        test_file=new,
        text_column="premise",
        text_pair_column="hypothesis",
        label_column="verdict",
        lr=0.01,
        export="true",
    )
    assert (run / "adapter" / "labels.json").is_file() and not (run / "hf").exists()
    done = python(SCRIPT, str(run / "adapter"), str(new))
    assert done.returncode == 0, done.stderr[-3000:]
    header, *rows = rows_of(done.stdout)
    assert [r[1] for r in rows] == predicted(run) and len(rows) == 40
    assert done.stderr == ""  # no warnings about the base's fresh head (the adapter brings the trained one)


def test_regression_on_bert_pairs_prints_values(sst2, cache_dir, tmp_path):
    """Float labels make a regression; sentence1/sentence2 pair up as in training (BERT: token type ids)."""
    texts = [text for text, _ in sst2_rows(sst2, 200)]
    rows = [[texts[i], texts[-i - 1], f"{(i % 11) / 2:.1f}"] for i in range(len(texts))]
    train_file = write_csv(tmp_path / "scores.csv", ["sentence1", "sentence2", "label"], rows[:176])
    new = write_csv(tmp_path / "new.csv", ["sentence1", "sentence2"], [r[:2] for r in rows[176:]])
    run = train("bert/tp.yaml", tmp_path / "run", cache_dir, sst2, train_file=train_file, test_file=new, export="true")
    done = python(SCRIPT, str(run / "hf"), str(new))
    assert done.returncode == 0, done.stderr[-3000:]
    header, *rows = rows_of(done.stdout)
    assert header == ["index", "value"]
    assert [r[1] for r in rows] == predicted(run)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no-model", "MODEL_DIR='{tmp}': not an exported model (no config.json of an hf/ folder"),
        ("txt", "FILE='{tmp}/new.txt': unknown file type '.txt'; valid: .csv, .tsv, .jsonl, .json, .parquet"),
        ("column", "--text-column title: {tmp}/new.csv has no such column (id, review)"),
        ("empty", "{tmp}/new.csv:3: no text in column 'review' (every row needs one to be classified)"),
        ("no-text-column", "{tmp}/other.csv: no text column named review, sentence, text, sentence1; give"),
        ("batch", "--batch-size 0 must be a positive integer"),
    ],
)
def test_bad_input_is_one_line(reviews, tmp_path, capsys, case, message):
    run, _ = reviews
    (tmp_path / "new.csv").write_text("id,review\n1,fine\n2,\n")
    (tmp_path / "other.csv").write_text("words\nfine\n")
    args = {
        "no-model": [str(tmp_path), str(tmp_path / "new.csv")],
        "txt": [str(run), str(tmp_path / "new.txt")],
        "column": [str(run), str(tmp_path / "new.csv"), "--text-column", "title"],
        "empty": [str(run), str(tmp_path / "new.csv")],
        "no-text-column": [str(run), str(tmp_path / "other.csv")],
        "batch": [str(run), str(tmp_path / "new.csv"), "--batch-size", "0"],
    }[case]
    try:
        code = predict_main(args)
    except SystemExit as exit:  # argparse's errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: " + message.format(tmp=tmp_path)), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_model_folder_asking_for_custom_code_is_refused(reviews, tmp_path, capsys, file):
    run, new = reviews
    folder = shutil.copytree(run / "hf", tmp_path / "hf")
    marker = tmp_path / "payload-ran"
    plant_custom_code(folder, file, marker)
    assert predict_main([str(folder), str(new)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder / file} asks for custom code (auto_map: ") and err.count("\n") == 1, err
    assert not marker.exists()
