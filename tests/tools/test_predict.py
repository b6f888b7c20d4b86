"""scripts/predict.py: new texts classified by an exported model as the run itself predicted them.

Each run trains a tiny model for a few steps on a small CSV cut from SST-2, with predict=true on a test file; the
script's labels (or values) on that file must equal the run's predictions.tsv, which shows that it encodes texts
and pairs as training did and reads the labels the run learned."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, launch, plant_custom_code, python, tiny_overrides

from parallel_finetune.tools.inference import main as predict_main

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
    texts = [text for text, _ in rows[288:]]
    texts[3] = ""  # a row without text: predict=true predicts it all the same, and so must predict.py
    test = write_csv(folder / "new.csv", ["id", "review"], list(enumerate(texts)))
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
    written_header, *written = rows_of(out.read_text())
    assert written_header == header and [r[:2] for r in written] == [r[:2] for r in rows]
    # the default batch size pads differently from 5, so a score may round the other way in its 4th decimal
    assert all(abs(float(w[2]) - float(r[2])) <= 1.5e-4 for w, r in zip(written, rows, strict=True))
    again = python(SCRIPT, str(run), str(new), "--output", str(out))
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: --output {out}: already exists; choose a new file (or pass --overwrite for a file)"
    )


@pytest.fixture(scope="module")
def pairs_adapter(sst2, cache_dir, tmp_path_factory):
    """A LoRA run on GPT-2 pairs with three word labels, exported as adapter/ with the tiny base/ beside it."""
    tmp_path = tmp_path_factory.mktemp("pairs")
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
    return run, new


def test_a_lora_adapter_on_gpt2_classifies_pairs_as_training_joined_them(pairs_adapter):
    """adapter/ (peft) onto the tiny base/ beside it; the pair joined by EOS, three word labels (labels.json in
    adapter/ gives the head's width and names)."""
    run, new = pairs_adapter
    assert (run / "adapter" / "labels.json").is_file() and not (run / "hf").exists()
    done = python(SCRIPT, str(run / "adapter"), str(new))
    assert done.returncode == 0, done.stderr[-3000:]
    header, *rows = rows_of(done.stdout)
    assert [r[1] for r in rows] == predicted(run) and len(rows) == 40
    assert done.stderr == ""  # no warnings about the base's fresh head (the adapter brings the trained one)


def test_adapter_labels_naming_more_labels_than_its_head_are_refused(pairs_adapter, tmp_path, capsys):
    run, new = pairs_adapter
    adapter = shutil.copytree(run / "adapter", tmp_path / "adapter")
    shutil.copytree(run / "base", tmp_path / "base")
    labels = json.loads((adapter / "labels.json").read_text())
    labels["label_names"] = labels["label_values"] = [*labels["label_names"], "never"]
    (adapter / "labels.json").write_text(json.dumps(labels))
    assert predict_main([str(adapter), str(new)]) == 2
    assert capsys.readouterr().err == (
        f"error: {adapter}/adapter_model.safetensors: score.weight has shape [3, 128], but the labels beside the "
        "adapter make it [4, 128] (4 label(s)); labels.json does not belong to this adapter: restore the one the run "
        "exported\n"
    )


def test_an_adapter_that_does_not_load_says_why_in_full(pairs_adapter, tmp_path, capsys):
    """peft's error starts "Error(s) in loading state_dict for ...:", the cause on the lines below: all of it, on one
    line (a rank edited out of adapter_config.json: its weights no longer fit)."""
    run, new = pairs_adapter
    adapter = shutil.copytree(run / "adapter", tmp_path / "adapter")
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["rank_pattern"] == {"c_attn": 48}
    (adapter / "adapter_config.json").write_text(json.dumps({**settings, "rank_pattern": {}, "alpha_pattern": {}}))
    assert predict_main([str(adapter), str(new)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {adapter}: the adapter does not load onto {run / 'base'} (RuntimeError: Error(s) in loading "
        "state_dict for PeftModelForSequenceClassification: size mismatch for base_model.model.transformer.h.0.attn."
        "c_attn.lora_A.default.weight: copying a param with shape torch.Size([48, 128]) from checkpoint, the shape "
        "in current model is torch.Size([16, 128]). size mismatch for"
    ), err
    assert err.count("\n") == 1 and err.endswith(".)\n"), err


def test_an_adapter_on_a_hub_base_offline_says_where_to_point_it(pairs_adapter, tmp_path):
    run, new = pairs_adapter
    adapter = shutil.copytree(run / "adapter", tmp_path / "adapter")
    settings = json.loads((adapter / "adapter_config.json").read_text())
    settings["base_model_name_or_path"] = "nonesuch-org/gpt2-never-cached"
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    done = python(SCRIPT, str(adapter), str(new))  # HF_HUB_OFFLINE=1
    assert done.returncode == 2 and done.stderr == (
        f"error: {adapter}/adapter_config.json: base model 'nonesuch-org/gpt2-never-cached' is a Hub name and "
        "HF_HUB_OFFLINE=1, and the local Hugging Face cache does not hold it; set base_model_name_or_path to a local "
        "folder holding that model, or run with the network\n"
    ), done.stderr[-3000:]


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
        ("not-text", "{tmp}/new.jsonl:2: text 7 in column 'review' is a int, not text"),
        ("no-text-column", "{tmp}/other.csv: no text column named review, sentence, text, sentence1; give"),
        ("batch", "--batch-size 0 must be a positive integer"),
        (
            "max-length",
            "--max-length 129: the model has 128 positions (config.json's max_position_embeddings); give at most 128",
        ),
        ("output-is-file", "--output {tmp}/new.csv: the FILE being classified; writing there would replace its texts"),
        ("output-folder", "--output {tmp}/nowhere/out.tsv: no such folder '{tmp}/nowhere'; create it or write"),
    ],
)
def test_bad_input_is_one_line(reviews, tmp_path, capsys, case, message):
    run, _ = reviews
    (tmp_path / "new.csv").write_text("id,review\n1,fine\n2,\n")
    (tmp_path / "new.jsonl").write_text('{"review": "fine"}\n{"review": 7}\n')
    (tmp_path / "other.csv").write_text("words\nfine\n")
    args = {
        "no-model": [str(tmp_path), str(tmp_path / "new.csv")],
        "txt": [str(run), str(tmp_path / "new.txt")],
        "column": [str(run), str(tmp_path / "new.csv"), "--text-column", "title"],
        "not-text": [str(run), str(tmp_path / "new.jsonl")],
        "no-text-column": [str(run), str(tmp_path / "other.csv")],
        "batch": [str(run), str(tmp_path / "new.csv"), "--batch-size", "0"],
        "max-length": [str(run), str(tmp_path / "new.csv"), "--max-length", "129"],
        "output-is-file": [str(run), str(tmp_path / "new.csv"), "--output", str(tmp_path / "new.csv"), "--overwrite"],
        "output-folder": [str(run), str(tmp_path / "new.csv"), "--output", str(tmp_path / "nowhere" / "out.tsv")],
    }[case]
    try:
        code = predict_main(args)
    except SystemExit as exit:  # argparse's errors
        code = exit.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: " + message.format(tmp=tmp_path)), err
    assert len(err.strip().splitlines()) == 1
    assert (tmp_path / "new.csv").read_text() == "id,review\n1,fine\n2,\n"  # the texts are never written over


def edited_copy(run: Path, folder: Path, file: str, edit) -> Path:
    """A copy of the run's hf/ with `file` (JSON) changed by `edit`, and labels.json beside it."""
    copy = shutil.copytree(run / "hf", folder / "hf")
    shutil.copy(run / "labels.json", folder / "labels.json")
    path = copy.parent / file if file == "labels.json" else copy / file
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return copy


def three_labels(config: dict) -> dict:
    return {**config, "id2label": {"0": "awful", "1": "fine", "2": "great"}, "label2id": {}}


def test_a_config_naming_more_labels_than_the_head_has_is_refused_not_loaded_with_a_random_head(
    reviews, tmp_path, capsys
):
    """The trained head has 2 rows; a config.json naming 3 labels loaded with a fresh random head (transformers'
    ignore_mismatched_sizes, its notice silenced) and printed meaningless labels with exit 0."""
    run, new = reviews
    folder = edited_copy(run, tmp_path, "config.json", three_labels)
    assert predict_main([str(folder), str(new)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {folder}/model.safetensors: classifier.bias has shape [2], but {folder}/config.json makes it [3] "
        "(num_labels=3: its id2label names 3 label(s), the trained head has 2); this config.json does not belong to "
        "these weights: restore the one the run exported\n"
    )


def test_weights_without_the_head_are_refused(reviews, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    run, new = reviews
    folder = shutil.copytree(run / "hf", tmp_path / "hf")
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("classifier.")}, folder / "model.safetensors")
    assert predict_main([str(folder), str(new)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {folder}: its weight files hold no classifier.bias, classifier.weight; those would be random (give "
        "the hf/ folder a run exported, config.json and weights together)\n"
    )


VALID_LABELS = (
    "valid: the object a run writes, with problem_type (single_label_classification or regression), pair (true/false),"
    " label_names (two or more names for classification, none for regression) and columns (the text[, pair] and "
    "label column names)"
)


@pytest.mark.parametrize(
    "edit, wrong",
    [
        (lambda labels: [], "a JSON list, not an object"),
        (lambda labels: {**labels, "columns": []}, "columns [] (the text column name, then the label"),
        (
            lambda labels: {**labels, "pair": True},
            "columns ['review', 'sentiment'] (the text and pair column names, then",
        ),
        (lambda labels: {**labels, "label_names": "awful"}, "label_names 'awful' for problem_type single_label_"),
        (lambda labels: {**labels, "label_names": [0, 1]}, "label_names [0, 1] for problem_type single_label_"),
        (lambda labels: {**labels, "pair": "no"}, "pair 'no' is not true or false"),
        (lambda labels: {**labels, "problem_type": "multi"}, "problem_type 'multi'"),
    ],
)
def test_a_malformed_labels_file_is_one_line_naming_it(reviews, tmp_path, capsys, edit, wrong):
    run, new = reviews
    folder = edited_copy(run, tmp_path, "labels.json", edit)
    assert predict_main([str(folder), str(new)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}/labels.json: {wrong}") and err.count("\n") == 1, err
    assert err.endswith(f"; {VALID_LABELS}\n"), err


def test_an_encoder_that_is_no_classifier_is_not_called_a_causal_lm_run(reviews, tmp_path, capsys):
    run, new = reviews
    folder = edited_copy(run, tmp_path, "config.json", lambda config: {**config, "architectures": ["BertForMaskedLM"]})
    assert predict_main([str(folder), str(new)]) == 2
    assert capsys.readouterr().err == (
        f"error: {folder}/config.json: a BertForMaskedLM (not a sequence classifier); predict.py needs a model "
        "trained with task=classification (its hf/ config names a ...ForSequenceClassification)\n"
    )


def test_family_files_are_not_imported_for_a_model_a_built_in_family_knows(reviews, tmp_path, monkeypatch, capsys):
    """A BERT needs no plugin family: a PARALLEL_FINETUNE_FAMILIES file (here one that fails) is never run."""
    run, new = reviews
    plugin = tmp_path / "plugin.py"
    marker = tmp_path / "plugin-ran"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('not for BERT')\n")
    monkeypatch.setenv("PARALLEL_FINETUNE_FAMILIES", str(plugin))
    assert predict_main([str(run), str(new)]) == 0, capsys.readouterr().err
    assert not marker.exists()


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
