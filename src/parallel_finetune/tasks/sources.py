"""Where a run's rows come from, first match wins: `train_file` (+ `validation_file`, `test_file`: CSV, TSV, JSON
Lines, Parquet, files.py), a `dataset` (a `save_to_disk` folder or a Hub name), a GLUE task (`glue_task`, glue.py)
from `data_dir` in GLUE's file layout, else from the Hub (`nyu-mll/glue`), else, for SST-2 only, the small sample
shipped in sample_data (loudly). Each source gives its splits as Tables and a fingerprint that changes whenever
its rows could; `data_fingerprint` computes it from the files alone (what --check compares before a run
continues) and `check_hub_data` says whether a run can have Hub rows without downloading them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets

from ..errors import UserError
from . import files
from .files import Table, read_dataset, read_delimited, read_file
from .glue import TASKS, GlueTask

if TYPE_CHECKING:  # the section's type only: at run time tasks/ imports nothing of the package but errors.py
    from ..config import DataSection

log = logging.getLogger(__name__)

HUB_GLUE = "nyu-mll/glue"
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_data"
CHAT_SAMPLE_DIR = SAMPLE_DIR / "chat"  # task=sft's small sample: instructions over SST-2 sentences
PREFERENCE_SAMPLE_DIR = SAMPLE_DIR / "preference"  # task=dpo's: right and wrong answers about SST-2 sentences


@dataclass(frozen=True)
class Source:
    kind: str  # "files" | "dataset" | "glue" | "hub" | "sample"
    description: str  # for logs and summary.json
    fingerprint: str  # changes whenever the rows could change


def _fingerprint(paths: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as file:
            while chunk := file.read(2**24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def glue_folder_files(glue: GlueTask, folder: Path) -> dict[str, Path]:
    """The task's files present in a GLUE folder (train and the first dev file are required)."""
    present = {}
    for split, name in glue.split_files().items():
        if (folder / name).is_file() or split in ("train", "validation"):
            present[split] = folder / name
    return present


def read_glue_folder(glue: GlueTask, folder: Path) -> dict[str, Table]:
    if not folder.is_dir():
        raise UserError(
            f"data_dir={str(folder)!r}: no such folder (expected GLUE {glue.name} files: "
            f"{', '.join(glue.split_files().values())})"
        )
    tables = {}
    for split, path in glue_folder_files(glue, folder).items():
        test = split.startswith("test")
        headerless = glue.headerless if not test else ()
        extra = ("after" if test else "before_last") if glue.score_last else "refuse"
        try:
            table = read_delimited(path, "\t", quoting=False, names=headerless, extra_fields=extra)
        except UserError as exc:
            if not headerless or "fields, the header has" not in str(exc):
                raise
            # a file with a header line read by a headerless task's names: another task's folder
            raise UserError(f"{exc}; is data_dir the {glue.name} folder?") from None
        needed = [glue.text] + ([glue.text_pair] if glue.text_pair else [])
        needed += [glue.label] if not split.startswith("test") else []
        missing = [name for name in needed if name not in table.columns]
        if missing:
            raise UserError(
                f"{path}: lacks column(s) {', '.join(missing)} of GLUE {glue.name} (found: "
                f"{', '.join(table.columns) or 'nothing'}); is data_dir the {glue.name} folder?"
            )
        tables[split] = table
    return tables


def _user_files(*, data: DataSection) -> list[Path]:
    given = (data.train_file, data.validation_file, data.test_file)
    return [Path(path).expanduser().resolve() for path in given if path]


def _files_fingerprint(*, data: DataSection) -> str:
    given = "|".join(
        f"{key}={'given' if path else ''}"
        for key, path in (("validation_file", data.validation_file), ("test_file", data.test_file))
    )
    return "files-" + _fingerprint(_user_files(data=data), given)


def carved_fingerprint(fingerprint: str, *, validation_split_percentage: float, seed: int) -> str:
    """A fingerprint that also names the held-out validation rows (which depend on the percentage and seed)."""
    return f"{fingerprint}-val{validation_split_percentage:g}s{seed}"


def data_fingerprint(*, data: DataSection, seed: int) -> str | None:
    """The fingerprint a run on `data` (with `seed`, which draws a held-out validation split) records in its
    checkpoints (Source.fingerprint), from the files alone, without parsing them: what --check compares before a
    run continues. None for a Hub data set (its rows are fingerprinted once the run loads them)."""
    percentage = data.validation_split_percentage
    if data.train_file:
        fingerprint = _files_fingerprint(data=data)
        if data.validation_file:
            return fingerprint
        return carved_fingerprint(fingerprint, validation_split_percentage=percentage, seed=seed)
    if data.dataset:
        folder = Path(data.dataset).expanduser()
        if not folder.is_dir():
            return None
        tables, source = _dataset_tables(data.dataset, data.dataset_config)
        if "validation" in tables:
            return source.fingerprint
        return carved_fingerprint(source.fingerprint, validation_split_percentage=percentage, seed=seed)
    if data.data_dir:
        return glue_fingerprint(data.glue_task, data.data_dir)
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


def _glue_hub_tables(glue: GlueTask, hub) -> dict[str, Table]:
    """The Hub's GLUE splits as tables with the files' column names and label values."""
    rename = {glue.hub_text: glue.text, **({glue.hub_text_pair: glue.text_pair} if glue.text_pair else {})}
    tables = {}
    for split in hub:
        data = hub[split].to_dict()
        columns = {rename.get(k, k): v for k, v in data.items() if k in rename or k == "label"}
        if "label" in columns:
            labels = columns.pop("label")
            if split.startswith("test"):  # the Hub's test labels are all -1
                labels = None
            elif glue.regression:
                columns[glue.label] = [str(v) for v in labels]
            else:
                columns[glue.label] = [glue.values[v] for v in labels]
        where = f"{HUB_GLUE}/{glue.name} [{split}]"
        tables[split] = Table(where, columns, [f"{where} row {i + 1}" for i in range(len(hub[split]))])
    return tables


def _refuse_training_on_validation(*, data: DataSection) -> None:
    """validation_file naming train_file's file (by any path): the model would be scored on rows it trained on."""
    if not data.validation_file:
        return
    train, validation = (Path(path).expanduser() for path in (data.train_file, data.validation_file))
    try:
        same = train.resolve() == validation.resolve() or os.path.samefile(train, validation)
    except OSError:  # a file that is not there: read_file names it
        same = False
    if same:
        raise UserError(
            f"validation_file={str(validation)!r} is the train_file: the validation rows would be trained on; give "
            "a file of other rows, or drop validation_file to hold out validation_split_percentage of train"
        )


def _glue_unreachable(glue: GlueTask, problem: str) -> UserError:
    return UserError(
        f"glue_task={glue.name}: the Hugging Face Hub is unreachable ({problem}); give data_dir=PATH (a folder "
        f"with GLUE's {', '.join(glue.split_files().values())})"
    )


def _refuse_files_without_train(*, data: DataSection) -> None:
    if data.validation_file or data.test_file:
        raise UserError("validation_file and test_file need train_file (the rows to train on); set train_file=PATH")


def check_hub_data(*, data: DataSection) -> str:
    """What --check says of rows a run fetches from the Hub (no train_file, data_dir, or dataset folder): a
    description of them, or one line why the run cannot have them (one quick request online; offline, the local
    Hub cache decides, read without fetching anything). Nothing is downloaded."""
    _refuse_files_without_train(data=data)
    if data.dataset:
        _refuse_file_as_dataset(data.dataset)
    name, subset = (data.dataset, data.dataset_config) if data.dataset else (HUB_GLUE, data.glue_task)
    problem = hub_unreachable(name)
    if problem is None and _offline():
        problem = _hub_dataset(name, subset)[1]
    where = f"Hub {name}" + (f"/{subset}" if subset else "")
    if problem is None:
        return where
    if data.dataset:
        raise _dataset_unloadable(name, problem)
    if data.glue_task != "sst2":
        raise _glue_unreachable(TASKS[data.glue_task], problem)
    return f"the small shipped SST-2 sample {SAMPLE_DIR}, NOT SST-2 (the Hub is unreachable: {problem})"


def read_sources(*, data: DataSection, task_key: str) -> tuple[dict[str, Table], Source, GlueTask | None]:
    """The splits as tables (train, validation[_mismatched], test[_mismatched]), where they came from, and the GLUE
    task they are (None: the user's own files or data set, or the shipped sample of task=sft or dpo)."""
    if task_key in SHIPPED_SAMPLES and not (data.train_file or data.dataset):
        return *read_shipped_sample(task_key, data=data), None
    if data.train_file:
        _refuse_training_on_validation(data=data)
        tables = {"train": read_file(data.train_file, "train_file")}
        for split, key, path in (
            ("validation", "validation_file", data.validation_file),
            ("test", "test_file", data.test_file),
        ):
            if path:
                tables[split] = read_file(path, key)
        paths = _user_files(data=data)
        return tables, Source("files", ", ".join(map(str, paths)), _files_fingerprint(data=data)), None
    _refuse_files_without_train(data=data)
    if data.dataset:
        return (*_dataset_tables(data.dataset, data.dataset_config), None)
    task = TASKS[data.glue_task]
    if data.data_dir:
        folder = Path(data.data_dir).expanduser().resolve()
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


# task -> its shipped sample: folder, what the log calls it and its rows, what a run of it reads, fingerprint prefix
SHIPPED_SAMPLES = {
    "sft": (CHAT_SAMPLE_DIR, "chat sample", "instructions over SST-2 sentences", "conversations", "chat-sample-"),
    "dpo": (
        PREFERENCE_SAMPLE_DIR,
        "preference sample",
        "right and wrong answers about SST-2 sentences",
        "preference pairs",
        "dpo-sample-",
    ),
}
SHIPPED_SAMPLES["reward"] = SHIPPED_SAMPLES["dpo"]  # reward modelling reads the same preference pairs


def read_shipped_sample(task_key: str, *, data: DataSection) -> tuple[dict[str, Table], Source]:
    """task=sft or dpo without train_file or dataset: the small sample shipped in sample_data/chat (instructions
    over SST-2 sentences, scripts/make_chat_sample.py) or sample_data/preference (a right and a wrong answer to
    such instructions, scripts/make_preference_sample.py), said in the log. A GLUE folder is neither."""
    folder, name, holds, reads, prefix = SHIPPED_SAMPLES[task_key]
    if data.data_dir:
        raise UserError(
            f"data_dir={data.data_dir!r} is a GLUE folder (glue_task); task={task_key} reads {reads} from "
            "train_file=PATH (+ validation_file) or dataset=FOLDER"
        )
    files = {"train": folder / "train.jsonl", "validation": folder / "validation.jsonl"}
    log.info(
        "task=%s with no train_file or dataset: training on the small %s shipped in %s (%s); give train_file=PATH "
        "for your own %s",
        *(task_key, name, folder, holds, reads),
    )
    tables = {split: read_file(path, f"the {name}") for split, path in files.items()}
    return tables, Source("sample", str(folder), prefix + _fingerprint(list(files.values())))
