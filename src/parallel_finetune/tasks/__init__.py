"""What a run learns: where its rows come from, which columns hold the texts and the label, what the labels are,
how a prediction is scored. The rest of the package sees only the result: `load_task(config)` -> the splits
(columns `text`[, `text_pair`][, `label`], `index`) and a Task.

Sources, first match wins: `train_file` (+ `validation_file`, `test_file`: CSV, TSV, JSON Lines, Parquet), a
`dataset` (a `save_to_disk` folder or a Hub name), a GLUE task (`glue_task`) from `data_dir` in GLUE's file layout,
else from the Hub (`nyu-mll/glue`), else, for SST-2 only, the small sample shipped in sample_data (loudly).
Labels: a GLUE task's are GLUE's (names and order as the Hub's `nyu-mll/glue`); a user's are the sorted distinct
training labels (as transformers' run_glue.py does), whole numbers sorted as numbers (`1`, `01`, `1.0`: one label).
Labels that are numbers, one of them with a fraction (or `problem_type: regression`), make a regression task.
Every label is one finite value: an empty or null cell, a nan or inf, a list or an object is refused, naming its row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets

from ..errors import UserError
from . import files
from .files import Table, check_text, read_dataset, read_delimited, read_file
from .glue import GLUE_TASK_NAMES, TASKS, GlueTask

log = logging.getLogger(__name__)

HUB_GLUE = "nyu-mll/glue"
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_data"
REGRESSION = "regression"
CLASSIFICATION = "single_label_classification"
CAUSAL_LM = "causal_lm"
TEXT_COLUMNS = ("sentence", "text", "sentence1")  # what text_column means when not given, first present
PAIR_OF = {"sentence1": "sentence2"}  # a text column whose partner is the pair when text_pair_column is not given
LABEL_FILE = "labels.json"  # in the run folder and the data cache: the task, its labels and columns


@dataclass(frozen=True)
class Task:
    """A resolved task: what the model's head is and how its predictions are scored."""

    name: str  # a GLUE task name, or "custom" (the user's files or data set)
    problem_type: str  # single_label_classification | regression | causal_lm
    pair: bool  # two texts per row
    label_names: tuple[str, ...] = ()  # label id -> name (the exported model's id2label)
    label_values: tuple[str, ...] = ()  # label id -> the label as the data writes it (predictions.tsv)
    metric: str = "classification"  # metrics.compute_metrics: a GLUE task name, classification, regression
    columns: tuple[str, ...] = ()  # the source's text, pair and label columns, for the record
    validation_splits: tuple[str, ...] = ("validation",)  # MNLI: also validation_mismatched
    test_splits: tuple[str, ...] = ()

    @property
    def num_labels(self) -> int:
        return len(self.label_names) or 1

    @property
    def classification(self) -> bool:
        return self.problem_type == CLASSIFICATION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict) -> Task:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def configure_head(hf_config, task: Task) -> None:
    """What a classification task writes into a transformers config: the head's width, its label names (the
    exported config.json's id2label/label2id, which transformers' pipeline prints) and the problem type."""
    hf_config.num_labels = task.num_labels
    if task.label_names:
        hf_config.id2label = dict(enumerate(task.label_names))
        hf_config.label2id = {name: i for i, name in enumerate(task.label_names)}
    hf_config.problem_type = task.problem_type


@dataclass(frozen=True)
class Source:
    kind: str  # "files" | "dataset" | "glue" | "hub" | "sample"
    description: str  # for logs and summary.json
    fingerprint: str  # changes whenever the rows could change


# ----------------------------------------------------------------------------------------------- sources


def _fingerprint(paths: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as file:
            while chunk := file.read(2**24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def glue_folder_files(task: GlueTask, folder: Path) -> dict[str, Path]:
    """The task's files present in a GLUE folder (train and the first dev file are required)."""
    present = {}
    for split, name in task.split_files().items():
        if (folder / name).is_file() or split in ("train", "validation"):
            present[split] = folder / name
    return present


def read_glue_folder(task: GlueTask, folder: Path) -> dict[str, Table]:
    if not folder.is_dir():
        raise UserError(
            f"data_dir={str(folder)!r}: no such folder (expected GLUE {task.name} files: "
            f"{', '.join(task.split_files().values())})"
        )
    tables = {}
    for split, path in glue_folder_files(task, folder).items():
        test = split.startswith("test")
        headerless = task.headerless if not test else ()
        extra = ("after" if test else "before_last") if task.score_last else "refuse"
        try:
            table = read_delimited(path, "\t", quoting=False, names=headerless, extra_fields=extra)
        except UserError as exc:
            if not headerless or "fields, the header has" not in str(exc):
                raise
            # a file with a header line read by a headerless task's names: another task's folder
            raise UserError(f"{exc}; is data_dir the {task.name} folder?") from None
        needed = [task.text] + ([task.text_pair] if task.text_pair else [])
        needed += [task.label] if not split.startswith("test") else []
        missing = [name for name in needed if name not in table.columns]
        if missing:
            raise UserError(
                f"{path}: lacks column(s) {', '.join(missing)} of GLUE {task.name} (found: "
                f"{', '.join(table.columns) or 'nothing'}); is data_dir the {task.name} folder?"
            )
        tables[split] = table
    return tables


def _user_files(config) -> list[Path]:
    keys = ("train_file", "validation_file", "test_file")
    return [Path(getattr(config, key)).expanduser().resolve() for key in keys if getattr(config, key)]


def _files_fingerprint(config) -> str:
    given = "|".join(f"{key}={'given' if getattr(config, key) else ''}" for key in ("validation_file", "test_file"))
    return "files-" + _fingerprint(_user_files(config), given)


def _carved(fingerprint: str, config) -> str:
    """A fingerprint that also names the held-out validation rows (which depend on the percentage and seed)."""
    return f"{fingerprint}-val{config.validation_split_percentage:g}s{config.seed}"


def data_fingerprint(config) -> str | None:
    """The fingerprint a run on `config`'s data records in its checkpoints (Source.fingerprint), from the files
    alone, without parsing them: what --check compares before a run continues. None for a Hub data set (its rows
    are fingerprinted once the run loads them)."""
    if config.train_file:
        fingerprint = _files_fingerprint(config)
        return fingerprint if config.validation_file else _carved(fingerprint, config)
    if config.dataset:
        folder = Path(config.dataset).expanduser()
        if not folder.is_dir():
            return None
        tables, source = _dataset_tables(config.dataset, config.dataset_config)
        return source.fingerprint if "validation" in tables else _carved(source.fingerprint, config)
    if config.data_dir:
        return glue_fingerprint(config.glue_task, config.data_dir)
    return None


def glue_fingerprint(task_name: str, data_dir: str | Path) -> str:
    """A GLUE folder's fingerprint from its files alone: what a checkpoint records of its data."""
    task = TASKS[task_name]
    folder = Path(data_dir).expanduser().resolve()
    present = [p for p in glue_folder_files(task, folder).values() if p.is_file()]
    # "tsv-" and no task name for SST-2: the fingerprint checkpoints of SST-2 runs have always recorded
    return "tsv-" + _fingerprint(present, task.name if task.name != "sst2" else "")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_unreachable(name: str = HUB_GLUE) -> str | None:
    """Why the Hub cannot serve a data set, found with one quick request (the datasets client retries each file
    five times, ~25 s of warnings from each process, before giving up), or None. With HF_HUB_OFFLINE=1 nothing is
    asked: the local Hub cache decides."""
    if _offline():
        return None
    from huggingface_hub import constants

    request = urllib.request.Request(f"{constants.ENDPOINT}/api/datasets/{name}", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "10"))).close()
    except urllib.error.HTTPError:
        return None  # it answered: anything else (a rate limit, a gated repo) is for datasets to report
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    return None


def _hub_dataset(name: str, config_name: str | None):
    problem = hub_unreachable(name)
    if problem is None:
        try:
            return datasets.load_dataset(name, config_name), None
        except Exception as exc:  # offline, blocked, rate-limited, no such data set
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
    return None, problem


def _glue_hub_tables(task: GlueTask, hub) -> dict[str, Table]:
    """The Hub's GLUE splits as tables with the files' column names and label values."""
    rename = {task.hub_text: task.text, **({task.hub_text_pair: task.text_pair} if task.text_pair else {})}
    tables = {}
    for split in hub:
        data = hub[split].to_dict()
        columns = {rename.get(k, k): v for k, v in data.items() if k in rename or k == "label"}
        if "label" in columns:
            labels = columns.pop("label")
            if split.startswith("test"):  # the Hub's test labels are all -1
                labels = None
            elif task.regression:
                columns[task.label] = [str(v) for v in labels]
            else:
                columns[task.label] = [task.values[v] for v in labels]
        where = f"{HUB_GLUE}/{task.name} [{split}]"
        tables[split] = Table(where, columns, [f"{where} row {i + 1}" for i in range(len(hub[split]))])
    return tables


def _refuse_training_on_validation(config) -> None:
    """validation_file naming train_file's file (by any path): the model would be scored on rows it trained on."""
    if not config.validation_file:
        return
    train, validation = (Path(getattr(config, key)).expanduser() for key in ("train_file", "validation_file"))
    try:
        same = train.resolve() == validation.resolve() or os.path.samefile(train, validation)
    except OSError:  # a file that is not there: read_file names it
        same = False
    if same:
        raise UserError(
            f"validation_file={str(validation)!r} is the train_file: the validation rows would be trained on; give "
            "a file of other rows, or drop validation_file to hold out validation_split_percentage of train"
        )


def _glue_unreachable(task: GlueTask, problem: str) -> UserError:
    return UserError(
        f"glue_task={task.name}: the Hugging Face Hub is unreachable ({problem}); give data_dir=PATH (a folder "
        f"with GLUE's {', '.join(task.split_files().values())})"
    )


def _refuse_files_without_train(config) -> None:
    if config.validation_file or config.test_file:
        raise UserError("validation_file and test_file need train_file (the rows to train on); set train_file=PATH")


def check_hub_data(config) -> str:
    """What --check says of rows a run fetches from the Hub (no train_file, data_dir, or dataset folder): a
    description of them, or one line why the run cannot have them (one quick request online; offline, the local
    Hub cache decides, read without fetching anything). Nothing is downloaded."""
    _refuse_files_without_train(config)
    if config.dataset:
        _refuse_file_as_dataset(config.dataset)
    name, subset = (config.dataset, config.dataset_config) if config.dataset else (HUB_GLUE, config.glue_task)
    problem = hub_unreachable(name)
    if problem is None and _offline():
        problem = _hub_dataset(name, subset)[1]
    where = f"Hub {name}" + (f"/{subset}" if subset else "")
    if problem is None:
        return where
    if config.dataset:
        raise _dataset_unloadable(name, problem)
    if config.glue_task != "sst2":
        raise _glue_unreachable(TASKS[config.glue_task], problem)
    return f"the small shipped SST-2 sample {SAMPLE_DIR}, NOT SST-2 (the Hub is unreachable: {problem})"


def read_sources(config) -> tuple[dict[str, Table], Source, GlueTask | None]:
    """The splits as tables (train, validation[_mismatched], test[_mismatched]), where they came from, and the GLUE
    task they are (None: the user's own files or data set)."""
    if config.train_file:
        _refuse_training_on_validation(config)
        tables = {"train": read_file(config.train_file, "train_file")}
        for split, key in (("validation", "validation_file"), ("test", "test_file")):
            if getattr(config, key):
                tables[split] = read_file(getattr(config, key), key)
        paths = _user_files(config)
        return tables, Source("files", ", ".join(map(str, paths)), _files_fingerprint(config)), None
    _refuse_files_without_train(config)
    if config.dataset:
        return (*_dataset_tables(config.dataset, config.dataset_config), None)
    task = TASKS[config.glue_task]
    if config.data_dir:
        folder = Path(config.data_dir).expanduser().resolve()
        tables = read_glue_folder(task, folder)
        return tables, Source("glue", f"{folder} (GLUE {task.name})", glue_fingerprint(task.name, folder)), task
    hub, problem = _hub_dataset(HUB_GLUE, task.name)
    if hub is not None:
        return (
            _glue_hub_tables(task, hub),
            Source("hub", f"{HUB_GLUE}/{task.name}", f"hub-{hub['train']._fingerprint}"),
            task,
        )
    if task.name != "sst2":
        raise _glue_unreachable(task, problem)
    log.warning(
        "THE HUGGING FACE HUB IS UNREACHABLE (%s): TRAINING ON THE SMALL SHIPPED SAMPLE %s, NOT ON "
        "SST-2; pass data_dir=PATH (a folder with GLUE's train.tsv and dev.tsv) for the real data set",
        problem,
        SAMPLE_DIR,
    )
    return (
        read_glue_folder(task, SAMPLE_DIR),
        Source("sample", str(SAMPLE_DIR), "sample-" + glue_fingerprint("sst2", SAMPLE_DIR)[4:]),
        task,
    )


def _dataset_unloadable(name: str, problem: str) -> UserError:
    file_hint = f"; a file of rows is train_file={name}" if Path(name).suffix.lower() in files.FORMATS else ""
    return UserError(f"dataset={name!r}: no such folder, and not loadable from the Hub ({problem}){file_hint}")


def _refuse_file_as_dataset(name: str) -> None:
    """dataset= is a save_to_disk folder or a Hub name; a file of rows (or what reads as one) is train_file's."""
    if Path(name).expanduser().is_file():
        raise UserError(
            f"dataset={name!r} is a file: dataset= is a folder written by save_to_disk or a Hub data set name; for "
            f"a file of rows give train_file={name}"
        )


def _dataset_tables(name: str, config_name: str | None) -> tuple[dict[str, Table], Source]:
    folder = Path(name).expanduser()
    _refuse_file_as_dataset(name)
    if folder.is_dir():
        try:
            loaded = datasets.load_from_disk(str(folder))
        except Exception as exc:
            raise UserError(
                f"dataset={name!r}: not a folder written by save_to_disk ({str(exc).splitlines()[0][:160]})"
            ) from None
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({"train": loaded})
        state = sorted(p for p in folder.rglob("*") if p.is_file())
        source = Source("dataset", str(folder.resolve()), "dataset-" + _fingerprint(state))
    else:
        loaded, problem = _hub_dataset(name, config_name)
        if loaded is None:
            raise _dataset_unloadable(name, problem)
        source = Source("hub", name + (f"/{config_name}" if config_name else ""), f"hub-{loaded['train']._fingerprint}")
    aliases = {"train": "train", "validation": "validation", "dev": "validation", "test": "test"}
    if "train" not in loaded:
        raise UserError(f"dataset={name!r}: no train split (found: {', '.join(loaded)})")
    tables = {}
    for split in loaded:
        if split in aliases and aliases[split] not in tables:
            tables[aliases[split]] = read_dataset(loaded[split], f"{name} [{split}]")
    return tables, source


# ----------------------------------------------------------------------------------------------- labels


def _number(value):
    """A label cell as a number if it is one (CSV cells are text): int, float, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _whole(number) -> int | None:
    """A number without a fraction as an int (`1`, `1.0`, `01`: class id 1), else None."""
    if isinstance(number, int):
        return number
    if isinstance(number, float) and number.is_integer():
        return int(number)
    return None


def _is_missing(value) -> bool:
    """No label: an empty cell, a JSON or Parquet null. (A NaN is a value, and refused as not finite.)"""
    return value is None or (isinstance(value, str) and not value.strip())


def _label_text(value) -> str:
    return value.strip() if isinstance(value, str) else str(value)


def _check_label(table: Table, row: int, label: str, value) -> None:
    """One line for a label cell that is no label: empty, a nested value (a JSON list or object, a Parquet list), or
    a number that is not finite (`nan`, `inf`: a NaN target makes every gradient it touches NaN, and a NaN among
    0/1 labels would make the task a regression)."""
    if _is_missing(value):
        raise UserError(f"{table.at(row)}: no label in column {label!r}; every labelled row needs one")
    if isinstance(value, (list, tuple, dict)):  # a JSON array or object, a Parquet list or struct
        kind = "a list" if isinstance(value, (list, tuple)) else "a mapping"
        raise UserError(
            f"{table.at(row)}: label {_shown(value)} in column {label!r} is {kind}; a label is one value: a class "
            "name, a class id or a regression target"
        )
    number = _number(value)
    if isinstance(number, float) and not math.isfinite(number):
        raise UserError(
            f"{table.at(row)}: label {_shown(value)} in column {label!r} is not a finite number; a label is a class "
            "name, a class id or a finite regression target (drop or fill the row)"
        )


def _shown(value) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def infer_problem_type(config, table: Table, label: str) -> str:
    """regression when asked, or when every training label is a number and one of them has a fraction; whole
    numbers (`1`, `1.0`: pandas writes a 0/1 column with a missing value as floats) are class ids. Says which in
    the log, and why."""
    if config.problem_type != "auto":
        return config.problem_type
    values = table.columns[label]
    numbers = [_number(v) for v in values]
    if any(n is None for n in numbers):
        commas = [_number(v.replace(",", ".")) if isinstance(v, str) else n for v, n in zip(values, numbers)]
        if all(n is not None for n in commas):  # a ';'-separated CSV's decimal commas: numbers, not class names
            row = next(row for row, n in enumerate(numbers) if n is None)
            raise UserError(
                f"{table.at(row)}: label {values[row]!r} in column {label!r} is a number with a decimal comma; write "
                f"{values[row].replace(',', '.').strip()}, or give problem_type=single_label_classification for "
                "class names"
            )
        log.info("%s: labels in column %r are text: classes", table.where, label)
        return CLASSIFICATION
    fraction = next((row for row, n in enumerate(numbers) if _whole(n) is None), None)
    if fraction is not None:
        log.info(
            "%s: labels in column %r are numbers, %s (%s) with a fraction: a regression "
            "(problem_type=single_label_classification makes them classes)",
            table.where,
            label,
            table.columns[label][fraction],
            table.at(fraction),
        )
        return REGRESSION
    log.info(
        "%s: labels in column %r are whole numbers: class ids (problem_type=regression makes them regression targets)",
        table.where,
        label,
    )
    return CLASSIFICATION


def user_labels(config, train: Table, label: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(names, values) by id: the sorted distinct training labels (whole numbers as numbers: `1`, `01` and `1.0`
    are one label, `1`), or ids 0..num_labels-1 when num_labels is given and the labels are those ids."""
    values = train.columns[label]
    wholes = [_whole(_number(v)) for v in values]
    if all(n is not None for n in wholes):
        distinct = sorted(set(wholes))
        if config.num_labels:
            bad = next((i for i, n in enumerate(wholes) if not 0 <= n < config.num_labels), None)
            if bad is not None:
                raise UserError(
                    f"{train.at(bad)}: label {wholes[bad]} is not an id below num_labels={config.num_labels}"
                )
            distinct = list(range(config.num_labels))
        texts = tuple(str(n) for n in distinct)
        return texts, texts
    distinct = sorted({_label_text(v) for v in values})
    if config.num_labels and config.num_labels != len(distinct):
        raise UserError(
            f"num_labels={config.num_labels}, but {train.where} has {len(distinct)} distinct labels "
            f"({', '.join(distinct[:10])}{', ...' if len(distinct) > 10 else ''}); drop num_labels to infer it"
        )
    return tuple(distinct), tuple(distinct)


def _ids(table: Table, label: str, task: Task, split: str) -> list:
    """Labels as the model's targets: ids (classification) or floats (regression); one line for the first bad row."""
    out = []
    index = {value: i for i, value in enumerate(task.label_values)}
    for row, value in enumerate(table.columns[label]):
        _check_label(table, row, label, value)
        if task.problem_type == REGRESSION:
            number = _number(value)
            if number is None:
                raise UserError(f"{table.at(row)}: regression target {value!r} in column {label!r} is not a number")
            out.append(float(number))
            continue
        text = _label_text(value)
        if text not in index:
            whole = _whole(_number(value))  # 1.0 in a JSON file, or 01, where train wrote 1
            text = str(whole) if whole is not None else text
        if text not in index:
            valid = ", ".join(task.label_values[:10]) + (", ..." if len(task.label_values) > 10 else "")
            where = "the training labels" if split != "train" else "the labels"
            raise UserError(
                f"{table.at(row)}: label {text!r} is not among {where} ({valid}){_other_glue(task, text, row)}"
            )
        out.append(index[text])
    return out


def _other_glue(task: Task, value: str, row: int) -> str:
    """For a GLUE task's refused label that suggests another task's files (WNLI's 0/1 read as RTE; a header line
    read as CoLA's first row): the question whether data_dir is the folder of this task."""
    if task.name not in TASKS:
        return ""
    others = [name for name, glue in TASKS.items() if name != task.name and value in glue.values]
    if others:
        return f"; is data_dir the {task.name} folder? ({value!r} is a label of GLUE {', '.join(others)})"
    if row == 0 and TASKS[task.name].headerless:
        return f"; is data_dir the {task.name} folder? (its first line reads like a header, which {task.name} lacks)"
    return ""


# ----------------------------------------------------------------------------------------------- the task


def _separator_hint(table: Table) -> str:
    """For a file read as one column whose name holds another separator: which one it seems to use."""
    if len(table.columns) != 1:
        return ""
    name = next(iter(table.columns))
    found = [shown for separator, shown in ((";", "';'"), ("\t", "a tab"), (",", "','")) if separator in name]
    return f"; the header is one column: is the file separated by {found[0]}?" if found else ""


def _column(table: Table, key: str, name: str | None, needed_for: str) -> str:
    if name is not None and name not in table.columns:
        raise UserError(
            f"{key}={name!r}: {table.where} has no such column ({', '.join(table.columns) or 'none'}){needed_for}"
            f"{_separator_hint(table)}"
        )
    return name


def _user_columns(config, train: Table) -> tuple[str, str | None, str | None]:
    text = config.text_column
    if text is None:
        text = next((name for name in TEXT_COLUMNS if name in train.columns), None)
        if text is None:
            raise UserError(
                f"{train.where}: no text column named {', '.join(TEXT_COLUMNS)}; set text_column= one of "
                f"{', '.join(train.columns)}{_separator_hint(train)}"
            )
    _column(train, "text_column", text, "")
    pair = config.text_pair_column
    if pair is None and text in PAIR_OF and PAIR_OF[text] in train.columns:
        pair = PAIR_OF[text]
    _column(train, "text_pair_column", pair, "")
    label = None
    if config.task != "causal_lm":
        label = config.label_column
        _column(train, "label_column", label, "; set label_column= the column holding the labels")
    used = [(key, name) for key, name in (("text_column", text), ("text_pair_column", pair), ("label_column", label))]
    for number, (key, name) in enumerate(used):
        twin = next((other for other, same in used[:number] if same is not None and same == name), None)
        if twin is not None:
            raise UserError(
                f"{twin}={name!r} and {key}={name!r}: one column for two uses; the text, the text pair and the "
                f"label are different columns of {train.where} ({', '.join(train.columns)})"
            )
    return text, pair, label


def define_task(config, tables: dict[str, Table], glue: GlueTask | None) -> tuple[Task, str, str | None, str | None]:
    """The Task and the (text, pair, label) columns of the sources."""
    train = tables["train"]
    if not len(train):
        raise UserError(f"{train.where}: no data rows (the train split is empty)")
    tests = tuple(s for s in tables if s.startswith("test"))
    validations = tuple(s for s in tables if s.startswith("validation")) or ("validation",)
    if glue is not None:
        text, pair, label = glue.text, glue.text_pair, glue.label
        if config.task == "causal_lm":
            task = Task(glue.name, CAUSAL_LM, False, columns=(text,), validation_splits=validations[:1])
            return task, text, None, None
        if config.num_labels not in (None, len(glue.names) or 1):
            raise UserError(
                f"num_labels={config.num_labels}: GLUE {glue.name} has {len(glue.names) or 1}; drop num_labels"
            )
        problem = REGRESSION if glue.regression else CLASSIFICATION
        if config.problem_type not in ("auto", problem):
            raise UserError(f"problem_type={config.problem_type}: GLUE {glue.name} is {problem}; drop problem_type")
        task = Task(
            glue.name,
            problem,
            pair is not None,
            glue.names,
            glue.values,
            glue.name,
            (text, *([pair] if pair else []), label),
            validations,
            tests,
        )
        return task, text, pair, label
    text, pair, label = _user_columns(config, train)
    if config.task == "causal_lm":
        return Task("custom", CAUSAL_LM, False, columns=(text,), validation_splits=("validation",)), text, None, None
    for row, value in enumerate(train.columns[label]):  # before the labels decide the problem type
        _check_label(train, row, label, value)
    problem = infer_problem_type(config, train, label)
    names, values = ((), ()) if problem == REGRESSION else user_labels(config, train, label)
    if problem == CLASSIFICATION and len(names) < 2:
        raise UserError(
            f"{train.where}: column {label!r} holds one label ({', '.join(names)}); classification needs two or more"
        )
    metric = REGRESSION if problem == REGRESSION else "classification"
    columns = (text, *([pair] if pair else []), label)
    return (
        Task("custom", problem, pair is not None, names, values, metric, columns, ("validation",), tests),
        text,
        pair,
        label,
    )


def _rows(table: Table, split: str, task: Task, text: str, pair: str | None, label: str | None) -> dict[str, list]:
    """A table as the columns the model side reads: text[, text_pair][, label], index (the row's position in its
    source, what predictions.tsv names). Rows without text are dropped and counted (a 0-token row has nothing to
    learn from), except in a test split, whose every row gets a prediction."""
    for name, key in ((text, "text_column"), (pair, "text_pair_column")):
        if name is not None and name not in table.columns:
            raise UserError(f"{table.where}: no column {name!r} ({key}; found: {', '.join(table.columns) or 'none'})")
    labelled = label is not None and not split.startswith("test")
    if labelled and label not in table.columns:
        raise UserError(
            f"{table.where}: no label column {label!r} (found: {', '.join(table.columns)}); set label_column="
        )
    keep, empty = [], []
    for row in range(len(table)):
        texts = [table.columns[text][row]] + ([table.columns[pair][row]] if pair else [])
        bad = next((n for n, t in zip((text, pair), texts) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            value = table.columns[bad][row]
            raise UserError(
                f"{table.at(row)}: {_shown(value)} in column {bad!r} is a {type(value).__name__}, not text; a text "
                "column holds strings"
            )
        texts = [t or "" for t in texts]  # None (a Parquet or JSON null): no text, as an empty cell
        for t in texts:
            check_text(table, row, t)
        if any(not t.strip() for t in texts) and not split.startswith("test"):
            empty.append(row)
            continue
        keep.append(row)
    if empty:
        lines = [table.at(r).removeprefix(table.where + ":") for r in empty[:5]]
        log.warning(
            "%s: dropped %d row(s) with an empty text (%s%s%s)",
            table.where,
            len(empty),
            "lines " if all(line.isdigit() for line in lines) else "",
            ", ".join(lines),
            ", ..." if len(empty) > 5 else "",
        )
    if not keep:
        raise UserError(f"{table.where}: no data rows (the {split} split is empty)")
    kept = table.take(keep) if len(keep) < len(table) else table
    columns = {"text": [(t or "").strip() for t in kept.columns[text]]}
    if pair:
        columns["text_pair"] = [(t or "").strip() for t in kept.columns[pair]]
    if labelled and task.problem_type != CAUSAL_LM:
        columns["label"] = _ids(kept, label, task, split)
    columns["index"] = keep
    return columns


def carve_validation(train: Table, percentage: float, seed: int) -> tuple[Table, Table]:
    """A validation split of `percentage` % of the training rows, drawn with `seed`; both keep the file's order."""
    count = round(len(train) * percentage / 100)
    if count < 1 or count >= len(train):
        raise UserError(
            f"validation_split_percentage={percentage:g} of {train.where}'s {len(train)} rows leaves "
            f"{'no validation row' if count < 1 else 'no training row'}; give validation_file= or another percentage"
        )
    held = set(random.Random(seed).sample(range(len(train)), count))
    return train.take([i for i in range(len(train)) if i not in held]), train.take(sorted(held))


def load_task(config) -> tuple[datasets.DatasetDict, Task, Source]:
    """The run's splits, its Task and where the rows came from; every problem is one line naming file and row."""
    tables, source, glue = read_sources(config)
    task, text, pair, label = define_task(config, tables, glue)
    if getattr(config, "predict", False) and not task.test_splits:  # refused now, not after the training it follows
        if task.problem_type == CAUSAL_LM:
            raise UserError("predict=true: a task=causal_lm run predicts no test split; drop predict")
        raise UserError(
            "predict=true: the data has no test split; give test_file=PATH (or a GLUE folder with test.tsv)"
        )
    if "validation" not in tables:
        tables["train"], tables["validation"] = carve_validation(
            tables["train"], config.validation_split_percentage, config.seed
        )
        log.info(
            "no validation split given: %d of %d training rows held out (validation_split_percentage=%g, seed %d)",
            len(tables["validation"]),
            len(tables["validation"]) + len(tables["train"]),
            config.validation_split_percentage,
            config.seed,
        )
        source = Source(source.kind, source.description, _carved(source.fingerprint, config))
    splits = {}
    for split, table in tables.items():
        if task.problem_type == CAUSAL_LM and split.startswith("test"):
            continue  # nothing evaluates a language model on a test split
        splits[split] = datasets.Dataset.from_dict(_rows(table, split, task, text, pair, label))
    return datasets.DatasetDict(splits), task, source


def write_label_file(folder: Path, task: Task) -> None:
    (folder / LABEL_FILE).write_text(json.dumps(task.to_json(), indent=1) + "\n", encoding="utf-8")


def read_label_file(folder: Path) -> Task:
    return Task.from_json(json.loads((folder / LABEL_FILE).read_text(encoding="utf-8")))


__all__ = [
    "CAUSAL_LM",
    "CLASSIFICATION",
    "GLUE_TASK_NAMES",
    "LABEL_FILE",
    "REGRESSION",
    "SAMPLE_DIR",
    "Source",
    "Task",
    "TASKS",
    "files",
    "check_hub_data",
    "configure_head",
    "data_fingerprint",
    "glue_fingerprint",
    "hub_unreachable",
    "load_task",
    "read_label_file",
    "write_label_file",
]
