"""Classify new texts with an exported model: `scripts/predict.py MODEL_DIR FILE` is its command line.

MODEL_DIR is what a run exported: hf/ (a transformers folder; the merged model of a LoRA run too), adapter/ (peft's
format: loaded onto the base its adapter_config.json names, or, when that path is gone, the base/ beside it), or the
run folder holding one. Texts are encoded as training encoded them (data.tokenize_classification): BERT-like
families get the tokenizer's pair template and token type ids, GPT-like ones the two texts joined by EOS. Nothing
is loaded with code from a folder (pretrained.py). Label names come from the exported config's id2label (and
labels.json beside the model, which also names the columns the model was trained on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import collate, joined_pair
from .errors import UserError, one_line
from .tasks import LABEL_FILE, PAIR_OF, REGRESSION, TEXT_COLUMNS, Task, configure_head, read_label_file
from .tasks.files import Table, check_text, read_file

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class Classifier:
    model: torch.nn.Module
    tokenizer: object
    token_types: bool  # pairs through the tokenizer's template with token type ids (BERT), else A EOS B
    label_names: list[str]  # id -> name; empty for regression
    task: Task | None  # labels.json beside the model: the columns it was trained on, whether on pairs
    max_length: int
    device: torch.device

    @property
    def regression(self) -> bool:
        return not self.label_names


def find_model(folder: str | Path) -> tuple[str, Path]:
    """("hf" | "adapter", folder): an exported folder itself, or the one a run folder holds (hf/ first: with a LoRA
    run's lora_export_merged it is the merged model)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise UserError(f"MODEL_DIR={str(folder)!r}: no such folder (give a run's hf/ or adapter/ folder)")
    for path in (folder, folder / "hf", folder / "adapter"):
        if (path / ADAPTER_CONFIG).is_file():
            return "adapter", path
        if (path / "config.json").is_file():
            return "hf", path
    raise UserError(
        f"MODEL_DIR={str(folder)!r}: not an exported model (no config.json of an hf/ folder, no {ADAPTER_CONFIG} of "
        "an adapter/ folder, and no hf/ or adapter/ inside)"
    )


def _labels_beside(folder: Path) -> Task | None:
    """labels.json in the model's folder or the run folder above it."""
    for place in (folder, folder.parent):
        if (place / LABEL_FILE).is_file():
            try:
                return read_label_file(place)
            except (ValueError, TypeError) as exc:
                raise UserError(f"{place / LABEL_FILE}: not a labels file ({one_line(exc)})") from None
    return None


def _pair_token_types(hf_config) -> bool:
    """What training did for this model's family (Family.pair_token_types); a model of no registered family: BERT-like
    when it has token type embeddings to use."""
    from .families import all_families

    for family in all_families():
        if family.config_class.model_type == hf_config.model_type:
            return family.pair_token_types
    return getattr(hf_config, "type_vocab_size", 0) > 1


def _check_classifier(hf_config, where: Path) -> None:
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise UserError(
            f"{where}: a {architectures[0]}, not a classifier (a task=causal_lm run); predict.py needs a model "
            "trained with task=classification"
        )


def _from_pretrained(where, hf_config):
    from transformers import AutoModelForSequenceClassification

    try:
        return AutoModelForSequenceClassification.from_pretrained(
            where, config=hf_config, trust_remote_code=False, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"{where}: the model cannot be loaded ({one_line(exc)})") from None


def _adapter_base(folder: Path) -> str:
    """The base an adapter names; a local path that no longer exists (a run folder moved, a SageMaker job's
    /opt/ml/model/base) falls back to the base/ folder beside the adapter, where a tiny run writes it."""
    from .families.base import resolve_model_path

    try:
        settings = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / ADAPTER_CONFIG}: not readable JSON ({one_line(exc)})") from None
    if settings.get("task_type") not in (None, "SEQ_CLS"):
        raise UserError(
            f"{folder / ADAPTER_CONFIG}: task_type {settings['task_type']}, not SEQ_CLS (a task=causal_lm run); "
            "predict.py needs a model trained with task=classification"
        )
    base = settings.get("base_model_name_or_path") or ""
    beside = folder.parent / "base"
    if base.startswith("/") and not Path(base).is_dir() and (beside / "config.json").is_file():
        return str(beside)
    if not base:
        raise UserError(f"{folder / ADAPTER_CONFIG}: names no base model (base_model_name_or_path)")
    return resolve_model_path(base)


def load_classifier(model_dir: str | Path, max_length: int | None = None, device: str | None = None) -> Classifier:
    from .pretrained import load_hf_config, load_hf_tokenizer

    kind, folder = find_model(model_dir)
    task = _labels_beside(folder)
    tokenizer = load_hf_tokenizer(folder)
    if kind == "hf":
        hf_config = load_hf_config(folder)
        _check_classifier(hf_config, folder)
        model = _from_pretrained(folder, hf_config)
    else:
        from peft import PeftModel

        base = _adapter_base(folder)
        hf_config = load_hf_config(base)
        if task is not None:  # the head's width and names (a pretrained base's config.json knows nothing of them)
            if task.problem_type not in (REGRESSION, "single_label_classification"):
                raise UserError(f"{folder}: trained with task={task.problem_type}; predict.py classifies")
            configure_head(hf_config, task)
        if hf_config.pad_token_id is None:  # GPT configs: the padding id training used, to find each last token
            hf_config.pad_token_id = tokenizer.pad_token_id
        try:
            model = PeftModel.from_pretrained(_from_pretrained(base, hf_config), str(folder))
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{folder}: the adapter does not load onto {base} ({one_line(exc)})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(chosen).eval()
    problem = getattr(hf_config, "problem_type", None)
    regression = problem == REGRESSION or (problem is None and hf_config.num_labels == 1)
    names = [] if regression else [hf_config.id2label[i] for i in range(hf_config.num_labels)]
    if max_length is None:
        max_length = _trained_max_length(folder)
    if max_length is None:
        positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
        max_length = min(tokenizer.model_max_length, positions or tokenizer.model_max_length)
    return Classifier(model, tokenizer, _pair_token_types(hf_config), names, task, max_length, chosen)


def _trained_max_length(folder: Path) -> int | None:
    """The run's max_length (its config.yaml, in the run folder above hf/ or adapter/): texts are cut where
    training cut them."""
    import yaml

    recorded = folder.parent / "config.yaml"
    try:
        value = yaml.safe_load(recorded.read_text(encoding="utf-8")).get("max_length")
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def choose_columns(classifier: Classifier, table: Table, text: str | None, pair: str | None) -> tuple[str, str | None]:
    """The text (and pair) columns: as given, else those the model was trained on (labels.json), else the ones
    training would pick (sentence | text | sentence1, and sentence2 beside sentence1)."""
    task, present = classifier.task, table.columns
    trained = task.columns if task is not None else ()
    for key, name in (("--text-column", text), ("--text-pair-column", pair)):
        if name is not None and name not in present:
            raise UserError(f"{key} {name}: {table.where} has no such column ({', '.join(present) or 'none'})")
    if text is None:
        candidates = ([trained[0]] if trained else []) + list(TEXT_COLUMNS)
        text = next((name for name in candidates if name in present), None)
        if text is None:
            raise UserError(
                f"{table.where}: no text column named {', '.join(dict.fromkeys(candidates))}; give --text-column, "
                f"one of {', '.join(present)}"
            )
    if pair is None and task is not None and task.pair:
        pair = trained[1]
        if pair not in present:
            raise UserError(
                f"{table.where}: the model was trained on pairs ({trained[0]}, {trained[1]}) but the file has no "
                f"column {pair!r}; give --text-pair-column, one of {', '.join(present)}"
            )
    elif pair is None and task is None and PAIR_OF.get(text) in present:
        pair = PAIR_OF[text]
    return text, pair


def _texts(table: Table, name: str) -> list[str]:
    texts = table.columns[name]
    for row, value in enumerate(texts):
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{table.at(row)}: no text in column {name!r} (every row needs one to be classified)")
        check_text(table, row, value)
    return [value.strip() for value in texts]


def encode(classifier: Classifier, texts: list[str], pairs: list[str] | None) -> tuple[list, list | None]:
    """Token ids (and token type ids) as training made them (data.tokenize_classification)."""
    tokenizer, limit = classifier.tokenizer, classifier.max_length
    if pairs is None:
        return tokenizer(texts, truncation=True, max_length=limit)["input_ids"], None
    if classifier.token_types:
        encoded = tokenizer(texts, pairs, truncation=True, max_length=limit, return_token_type_ids=True)
        return encoded["input_ids"], encoded["token_type_ids"]
    if tokenizer.eos_token_id is None:
        raise UserError("the model's tokenizer has no EOS token to join a pair of texts with, as training did")
    firsts, seconds = tokenizer(texts)["input_ids"], tokenizer(pairs)["input_ids"]
    return [joined_pair(a, b, tokenizer.eos_token_id, limit) for a, b in zip(firsts, seconds)], None


@torch.no_grad()
def classify(
    classifier: Classifier, texts: list[str], pairs: list[str] | None = None, batch_size: int = 32
) -> list[tuple[str, float]]:
    """(label name, probability) per text, or for regression ("", value); batches of similar length."""
    ids, types = encode(classifier, texts, pairs)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: list = [None] * len(ids)
    tokenizer = classifier.tokenizer
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = collate(
            [ids[i] for i in chunk],
            tokenizer.pad_token_id,
            tokenizer.padding_side,
            token_type_ids=[types[i] for i in chunk] if types is not None else None,
        )
        logits = classifier.model(**{k: v.to(classifier.device) for k, v in batch.items()}).logits.float().cpu()
        if classifier.regression:
            values = [("", value) for value in logits[:, 0].tolist()]
        else:
            scores, labels = logits.softmax(-1).max(-1)
            values = [(classifier.label_names[label], score) for label, score in zip(labels.tolist(), scores.tolist())]
        for row, value in zip(chunk, values):
            results[row] = value
    return results


def format_rows(classifier: Classifier, results: list[tuple[str, float]]) -> list[str]:
    """index<TAB>label<TAB>score (regression: index<TAB>value), a header first; index: the row's position in the
    file, as in predictions.tsv."""
    if classifier.regression:
        return ["index\tvalue"] + [f"{i}\t{value:.3f}" for i, (_, value) in enumerate(results)]
    return ["index\tlabel\tscore"] + [f"{i}\t{label}\t{score:.4f}" for i, (label, score) in enumerate(results)]


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage too; every bad input here is one line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineErrors(
        prog="predict.py",
        description="Classify the texts of a file (CSV, TSV, JSON Lines, Parquet) with an exported model: prints "
        "index<TAB>label<TAB>score (regression: index<TAB>value), or writes it to --output.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a run's hf/ or adapter/ folder (or the run folder)")
    parser.add_argument("file", metavar="FILE", help="texts to classify: .csv .tsv .jsonl .json .parquet, a header")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--text-column", help="default: the model's training column, else sentence|text|sentence1")
    parser.add_argument("--text-pair-column", help="the second text of a pair (default: as the model was trained)")
    parser.add_argument("--max-length", type=int, help="tokens per row (default: the run's max_length)")
    parser.add_argument("--output", help="write the rows to this .tsv instead of printing them")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    args = parser.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value} must be a positive integer")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, not the user's
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "newly initialized" heads of a LoRA base: the adapter brings them
    hf_logging.disable_progress_bar()
    try:
        out = Path(args.output).expanduser() if args.output else None
        if out is not None and out.exists() and not (args.overwrite and out.is_file()):
            raise UserError(f"--output {out}: already exists; choose a new file (or pass --overwrite for a file)")
        table = read_file(args.file, "FILE")
        if not len(table):
            raise UserError(f"{table.where}: no rows to classify")
        classifier = load_classifier(args.model_dir, args.max_length, args.device)
        text, pair = choose_columns(classifier, table, args.text_column, args.text_pair_column)
        results = classify(
            classifier, _texts(table, text), _texts(table, pair) if pair else None, batch_size=args.batch_size
        )
        lines = format_rows(classifier, results)
        if out is None:
            print("\n".join(lines))
        else:
            partial = out.with_name(f".{out.name}.partial")
            partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.replace(partial, out)
            print(f"{len(results)} rows -> {out}", file=sys.stderr)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
