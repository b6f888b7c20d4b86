"""Classify new texts with an exported model: `scripts/predict.py MODEL_DIR FILE` is its command line.

MODEL_DIR is what a run exported: hf/ (a transformers folder; the merged model of a LoRA run too), adapter/ (peft's
format: loaded onto the base its adapter_config.json names, or, when that path is gone, the base/ beside it), or the
run folder holding one. Texts are encoded as training encoded them (data.tokenize_classification): BERT-like
families get the tokenizer's pair template and token type ids, GPT-like ones the two texts joined by EOS. Nothing
is loaded with code from a folder (pretrained.py). Label names come from the exported config's id2label (and
labels.json beside the model, which also names the columns the model was trained on). Every weight comes from the
files: a config whose label count differs from the trained head's rows, or a head the files lack, is refused, never
loaded with a fresh random head (transformers would only log it, and predict.py keeps its log quiet).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OneLineArgumentParser, UserError, one_line
from ..outputs.run_files import CONFIG_FILE
from ..tasks.columns import PAIR_OF, TEXT_COLUMNS
from ..tasks.files import Table, check_text, read_file
from ..tasks.kinds import find_kind, kind_of_problem
from ..tasks.task import LABEL_FILE, HeadKind, Task, configure_head

if TYPE_CHECKING:
    import torch

# torch, transformers and data/ (which imports torch) are imported by the functions that use them: predict.py's
# --help and a bad argument are answered in a second, not after the ~20 s torch and transformers take to import.
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
    """labels.json in the model's folder or the run folder above it; a chat model's run folder (sft, dpo: no
    labels.json) is said from its config.yaml."""
    for place in (folder, folder.parent):
        if (place / LABEL_FILE).is_file():
            return _read_labels(place / LABEL_FILE)
        trained = _run_settings(place).get("task")
        if (kind := find_kind(trained)) is not None and not kind.has_labels:
            raise UserError(_chat_model(place / CONFIG_FILE, trained))
    return None


def _run_settings(folder: Path) -> dict:
    """The config.yaml a run wrote into `folder`, or {} (none, or not a run's)."""
    import yaml

    try:
        settings = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return settings if isinstance(settings, dict) else {}


def _chat_model(path: Path, task_key: str) -> str:
    return (
        f"{path}: the model beside it is a chat model (task={task_key}), and predict.py classifies texts; chat with "
        "it through transformers (pipeline('text-generation') given messages; docs/running.md)"
    )


def _read_labels(path: Path) -> Task:
    """A labels.json as a run writes it (tasks.write_label_file), checked: its columns choose the texts to read
    and its label names the head's rows, so a hand-edited one must not pass for another model's."""
    valid = (
        "valid: the object a run writes, with problem_type (single_label_classification or regression), pair "
        "(true/false), label_names (two or more names for classification, none for regression) and columns (the "
        "text[, pair] and label column names)"
    )
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not readable JSON ({one_line(exc)}); {valid}") from None
    if not isinstance(values, dict):
        raise UserError(f"{path}: a JSON {type(values).__name__}, not an object; {valid}")
    problem, pair = values.get("problem_type"), values.get("pair")
    names, columns = values.get("label_names", []), values.get("columns", [])
    texts = 2 if pair is True else 1

    def strings(value) -> bool:
        return isinstance(value, list) and all(isinstance(item, str) and item for item in value)

    kind = kind_of_problem(problem) if isinstance(problem, str) else None
    if kind is not None and not kind.has_labels:  # a run before sft and dpo wrote no labels.json
        raise UserError(_chat_model(path, problem))
    if kind is not None and kind.reward_model and strings(columns) and not names:  # a reward model: its pairs' columns
        return Task.from_json(values)
    if kind is None:
        wrong = f"problem_type {problem!r}"
    elif not isinstance(pair, bool):
        wrong = f"pair {pair!r} is not true or false"
    elif not strings(names) or kind.named_labels(problem) != (len(names) >= 2):
        wrong = f"label_names {names!r} for problem_type {problem}"
    elif not strings(columns) or len(columns) != texts + (kind.head is HeadKind.CLASSIFICATION):
        texts_named = "the text and pair column names" if pair else "the text column name"
        labelled = kind.head is HeadKind.CLASSIFICATION  # a label column after the texts
        wrong = f"columns {columns!r} ({texts_named}{', then the label column' if labelled else ''})"
    else:
        try:
            return Task.from_json(values)
        except TypeError as exc:  # a key no Task has
            wrong = one_line(exc)
    raise UserError(f"{path}: {wrong}; {valid}")


def _pair_token_types(hf_config) -> bool:
    """What training did for this model's family (Family.pair_token_types); a model of no registered family: BERT-like
    when it has token type embeddings to use."""
    from ..families import family_of_model_type

    family = family_of_model_type(hf_config.model_type)
    if family is not None:
        return family.pair_token_types
    return getattr(hf_config, "type_vocab_size", 0) > 1


def _check_classifier(hf_config, where: Path) -> None:
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures and not any(name.endswith("ForSequenceClassification") for name in architectures):
        language_model = architectures[0].endswith(("ForCausalLM", "LMHeadModel"))
        made_by = "a task=causal_lm run, " if language_model else ""
        raise UserError(
            f"{where / 'config.json'}: a {architectures[0]} ({made_by}not a sequence classifier); predict.py needs "
            "a model trained with task=classification (its hf/ config names a ...ForSequenceClassification)"
        )


def _full_cause(exc: BaseException) -> str:
    """The whole message of a library's exception on one line (its first line alone often says only "see above")."""
    return f"{type(exc).__name__}: {' '.join(line.strip() for line in str(exc).splitlines() if line.strip())}"


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a .safetensors file's JSON header (8 bytes of length, then the header); no
    tensor is read."""
    try:
        with open(path, "rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({one_line(exc)})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return {name: entry["shape"] for name, entry in header.items() if isinstance(entry, dict) and "shape" in entry}


def _weight_files(folder: Path) -> list[Path]:
    """The .safetensors files of an hf/ folder: model.safetensors, or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{index}: not a safetensors index ({one_line(exc)})") from None
        return [folder / shard for shard in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _expected_shapes(hf_config) -> tuple[dict[str, list[int]], str]:
    """Parameter name -> the shape `hf_config` gives it, and the base model's prefix (bert., transformer.)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):  # shapes only: no memory, no initialization
        model = AutoModelForSequenceClassification.from_config(hf_config, trust_remote_code=False)
    return {name: list(tensor.shape) for name, tensor in model.state_dict().items()}, model.base_model_prefix


def _check_shapes_match(folder: Path, hf_config) -> None:
    """Every tensor of the weight files has the shape config.json makes it. A config.json whose id2label names more
    (or fewer) labels than the trained head has rows would otherwise load with a fresh random head: predictions
    that mean nothing."""
    files = _weight_files(folder)
    if not files:
        return  # pytorch_model.bin: transformers itself refuses a mismatch (ignore_mismatched_sizes=False)
    expected, prefix = _expected_shapes(hf_config)
    for path in files:
        for name, shape in _safetensors_shapes(path).items():
            model_name = name if name in expected or not prefix else f"{prefix}.{name}"
            wanted = expected.get(model_name)
            if wanted is None or wanted == list(shape):
                continue
            labels = hf_config.num_labels
            head = wanted[:1] == [labels] and shape[:1] != [labels]
            why = (
                f" (num_labels={labels}: its id2label names {labels} label(s), the trained head has {shape[0]})"
                if head
                else ""
            )
            raise UserError(
                f"{path}: {name} has shape {list(shape)}, but {folder / 'config.json'} makes it {wanted}{why}; "
                "this config.json does not belong to these weights: restore the one the run exported"
            )


def _from_pretrained(where, hf_config, head_from_adapter: bool = False):
    """The model with every weight from `where`'s files. `head_from_adapter`: a LoRA base, whose head is missing
    or of another width; the adapter brings the trained one (checked by _check_adapter_head)."""
    from transformers import AutoModelForSequenceClassification

    try:
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            where,
            config=hf_config,
            trust_remote_code=False,
            ignore_mismatched_sizes=head_from_adapter,
            output_loading_info=True,
        )
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" in str(exc):  # transformers' report of the shapes went to its (quiet) log
            raise UserError(
                f"{where}: weights whose shapes differ from its config.json (a config.json that does not belong to "
                "these weights: restore the one the run exported)"
            ) from None
        raise UserError(f"{where}: the model cannot be loaded ({_full_cause(exc)})") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: the model cannot be loaded ({_full_cause(exc)})") from None
    fresh = sorted(set(loading["missing_keys"]) | {name for name, *_ in loading["mismatched_keys"]})
    if fresh and not head_from_adapter:
        raise UserError(
            f"{where}: its weight files hold no {', '.join(fresh[:4])}{', ...' if len(fresh) > 4 else ''}; "
            "those would be random (give the hf/ folder a run exported, config.json and weights together)"
        )
    return model, fresh


def _adapter_settings(folder: Path) -> dict:
    try:
        settings = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / ADAPTER_CONFIG}: not readable JSON ({one_line(exc)})") from None
    if not isinstance(settings, dict):
        raise UserError(f"{folder / ADAPTER_CONFIG}: not a JSON object (peft's adapter settings)")
    if settings.get("task_type") not in (None, "SEQ_CLS"):
        raise UserError(
            f"{folder / ADAPTER_CONFIG}: task_type {settings['task_type']}, not SEQ_CLS (a task=causal_lm or "
            "task=sft run: a language model); predict.py needs a model trained with task=classification"
        )
    return settings


def _trained_over_nf4(folder: Path) -> bool:
    """The run that exported `folder` (adapter/, base/) held its base in NF4 (QLoRA): its config.yaml, beside."""
    return _run_settings(folder.parent).get("lora_base_quantization") == "nf4"


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _adapter_base(folder: Path, settings: dict) -> str:
    """The base an adapter names; a local path that no longer exists (a run folder moved, a SageMaker job's
    /opt/ml/model/base) falls back to the base/ folder beside the adapter, where a tiny run writes it."""
    from ..model.hub import resolve_model_path

    base = settings.get("base_model_name_or_path") or ""
    beside = folder.parent / "base"
    if base.startswith("/") and not Path(base).is_dir() and (beside / "config.json").is_file():
        return str(beside)
    if not base:
        raise UserError(f"{folder / ADAPTER_CONFIG}: names no base model (base_model_name_or_path)")
    resolved = resolve_model_path(base)
    if not Path(resolved).is_dir() and _hub_offline():
        from huggingface_hub import snapshot_download

        try:  # a Hub name offline: only the local Hugging Face cache can have it
            return snapshot_download(resolved, local_files_only=True)
        except Exception:  # the Hub client raises many types; all mean "not in the cache"
            raise UserError(
                f"{folder / ADAPTER_CONFIG}: base model {base!r} is a Hub name and HF_HUB_OFFLINE=1, and the local "
                "Hugging Face cache does not hold it; set base_model_name_or_path to a local folder holding that "
                f"model, or run with the network"
            ) from None
    return resolved


def _check_adapter_head(folder: Path, settings: dict, fresh: list[str], hf_config) -> None:
    """The base's weights it lacks or holds at another width (a pretrained LM has no classifier head; a tiny run's
    base/ one of its own) must come with the adapter (peft's modules_to_save), at the width labels.json gives;
    else they would stay random."""
    saved = settings.get("modules_to_save") or []
    in_file = {}
    weights = folder / "adapter_model.safetensors"
    if weights.is_file():
        in_file = {
            name.removeprefix("base_model.model."): shape for name, shape in _safetensors_shapes(weights).items()
        }
    expected, _ = _expected_shapes(hf_config)
    for name in fresh:
        module = name.rsplit(".", 1)[0]
        brought = any(module == kept or module.endswith("." + kept) for kept in saved)
        if not brought or (weights.is_file() and name not in in_file):
            raise UserError(
                f"{folder}: the base has no trained {name} and the adapter does not bring one (modules_to_save: "
                f"{', '.join(saved) or 'none'}); it would be random: use the adapter/ a task=classification run "
                "exported"
            )
        if name in in_file and in_file[name] != expected.get(name, in_file[name]):
            labels = hf_config.num_labels
            raise UserError(
                f"{weights}: {name} has shape {in_file[name]}, but the labels beside the adapter make it "
                f"{expected[name]} ({labels} label(s)); labels.json does not belong to this adapter: restore the one "
                "the run exported"
            )


def load_classifier(model_dir: str | Path, max_length: int | None = None, device: str | None = None) -> Classifier:
    kind, folder = find_model(model_dir)  # a wrong folder is said before torch is imported
    import torch

    from ..model.pretrained import load_hf_config, load_hf_tokenizer

    task = _labels_beside(folder)
    tokenizer = load_hf_tokenizer(folder)
    if kind == "hf":
        hf_config = load_hf_config(folder)
        _check_classifier(hf_config, folder)
        _check_shapes_match(folder, hf_config)
        model, _ = _from_pretrained(folder, hf_config)
    else:
        from peft import PeftModel

        settings = _adapter_settings(folder)
        base = _adapter_base(folder, settings)
        try:
            hf_config = load_hf_config(base)
        except OSError as exc:
            raise UserError(
                f"{folder / ADAPTER_CONFIG}: base model {base!r} cannot be loaded ({_full_cause(exc)})"
            ) from None
        if task is not None:  # the head's width and names (a pretrained base's config.json knows nothing of them)
            if task.head is not HeadKind.CLASSIFICATION:
                raise UserError(f"{folder}: trained with task={task.head}; predict.py classifies")
            configure_head(hf_config, task)
        if hf_config.pad_token_id is None:  # GPT configs: the padding id training used, to find each last token
            hf_config.pad_token_id = tokenizer.pad_token_id
        # a QLoRA run's own base/ (its parent a run folder of nf4) holds the base as trained: NF4, dequantized
        if _trained_over_nf4(folder) and not (Path(base).is_dir() and _trained_over_nf4(Path(base))):
            print(
                f"note: {folder} was trained over its base quantized to NF4 (QLoRA), and {base} is that base "
                "unquantized, so the scores differ slightly from the trained model's (the run's base/ folder, where "
                "it wrote one, holds the base as trained: NF4, dequantized)",
                file=sys.stderr,
            )
        base_model, fresh = _from_pretrained(base, hf_config, head_from_adapter=True)
        _check_adapter_head(folder, settings, fresh, hf_config)
        try:
            model = PeftModel.from_pretrained(base_model, str(folder))
        except (OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"{folder}: the adapter does not load onto {base} ({_full_cause(exc)})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    chosen = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(chosen).eval()
    problem = getattr(hf_config, "problem_type", None)
    kind = kind_of_problem(problem) if isinstance(problem, str) else None
    regression = (kind is not None and kind.regression(problem)) or (problem is None and hf_config.num_labels == 1)
    names = [] if regression else [hf_config.id2label[i] for i in range(hf_config.num_labels)]
    positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if max_length is not None and positions and max_length > positions:
        raise UserError(
            f"--max-length {max_length}: the model has {positions} positions (config.json's "
            f"{'n_positions' if getattr(hf_config, 'n_positions', None) else 'max_position_embeddings'}); give at "
            f"most {positions}"
        )
    if max_length is None:
        max_length = _trained_max_length(folder)
    if max_length is None:
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
    """The column's texts as a test split's (tasks.model_columns): every row is classified, an empty cell (or a
    Parquet or JSON null) as no text."""
    texts = []
    for row, value in enumerate(table.columns[name]):
        if value is not None and not isinstance(value, str):
            raise UserError(f"{table.at(row)}: text {value!r} in column {name!r} is a {type(value).__name__}, not text")
        check_text(table, row, value or "")
        texts.append((value or "").strip())
    return texts


def encode(classifier: Classifier, texts: list[str], pairs: list[str] | None) -> tuple[list, list | None]:
    """Token ids (and token type ids) as training made them (data.tokenize_classification)."""
    from ..data.prepare import joined_pair

    tokenizer, limit = classifier.tokenizer, classifier.max_length
    if pairs is None:
        # an empty text is no token for GPT tokenizers: the EOS token (or [PAD]) in its place, as in training
        nothing = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id]
        return [ids or nothing for ids in tokenizer(texts, truncation=True, max_length=limit)["input_ids"]], None
    if classifier.token_types:
        encoded = tokenizer(texts, pairs, truncation=True, max_length=limit, return_token_type_ids=True)
        return encoded["input_ids"], encoded["token_type_ids"]
    if tokenizer.eos_token_id is None:
        raise UserError("the model's tokenizer has no EOS token to join a pair of texts with, as training did")
    firsts, seconds = tokenizer(texts)["input_ids"], tokenizer(pairs)["input_ids"]
    return [joined_pair(a, b, tokenizer.eos_token_id, limit) for a, b in zip(firsts, seconds)], None


def classify(
    classifier: Classifier, texts: list[str], pairs: list[str] | None = None, batch_size: int = 32
) -> list[tuple[str, float]]:
    """(label name, probability) per text, or for regression ("", value); batches of similar length."""
    import torch

    from ..data.batch import padded_batch

    ids, types = encode(classifier, texts, pairs)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: list = [None] * len(ids)
    tokenizer = classifier.tokenizer
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = padded_batch(
            [ids[i] for i in chunk],
            pad_id=tokenizer.pad_token_id,
            padding_side=tokenizer.padding_side,
            token_types=[types[i] for i in chunk] if types is not None else None,
        ).to(classifier.device)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if batch.token_type_ids is not None:
            inputs["token_type_ids"] = batch.token_type_ids
        with torch.no_grad():
            logits = classifier.model(**inputs).logits.float().cpu()
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


def _check_output(out: Path, given: Path, overwrite: bool) -> None:
    if out.exists() and given.exists() and os.path.samefile(out, given):
        raise UserError(f"--output {out}: the FILE being classified; writing there would replace its texts")
    if out.exists() and not (overwrite and out.is_file()):
        raise UserError(f"--output {out}: already exists; choose a new file (or pass --overwrite for a file)")
    if not out.parent.is_dir():
        raise UserError(f"--output {out}: no such folder {str(out.parent)!r}; create it or write elsewhere")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(
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
        if out is not None:
            _check_output(out, Path(args.file).expanduser(), args.overwrite)
        table = read_file(args.file, "FILE")
        if not len(table):
            raise UserError(f"{table.where}: no rows to classify")
        classifier = load_classifier(args.model_dir, args.max_length, args.device)
        if classifier.task is not None and classifier.task.kind.reward_model:  # pairs, scored
            from .reward_scoring import pair_lines, score_pairs

            results = score_pairs(classifier, table, args.batch_size)
            lines = pair_lines(results)
        else:
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
