"""Rows from where a user keeps them: CSV, TSV, JSON Lines (or a JSON array), Parquet, a `datasets` folder saved
with `save_to_disk`, a Hub data set, and GLUE's own tab-separated files.

Every reader returns a Table: named columns plus, for each row, where it came from (`file:line`, or `file row N`),
so that every later problem (a missing label, a label dev has but train lacks) names the row. CSV and TSV go
through Python's csv reader (quoted fields with commas, tabs and newlines read as one field); a .csv file whose
header line holds `;` and no comma is read as `;`-separated (Excel's CSV where the decimal separator is a comma).
GLUE's files are read unquoted, as GLUE writes them. A file is held in memory whole, so one above
MAX_DATA_FILE_BYTES is refused before it is read.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

log = logging.getLogger(__name__)

# Bounds on a data file, far above SST-2 (train.tsv 3.8 MB; longest row 270 characters, longest word 38): a file is
# held in memory whole, and learning a tiny model's tokenizer takes time quadratic in a word's length (one word of
# 100,000 characters costs seconds, of a few megabytes hours).
MAX_DATA_FILE_BYTES = 2**30
MAX_ROW_CHARS = 100_000
MAX_WORD_CHARS = 1_000
FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Table:
    where: str  # the file (or data set and split) the rows came from
    columns: dict[str, list]
    places: list[str] = field(default_factory=list)  # per row: "file:line" or "file row N"
    text_cells: bool = False  # CSV or TSV: every cell is text, so a list of messages is stored as JSON text
    teaches_tokenizer: bool = True  # a tiny model's tokenizer is learned from these rows: check_text's bounds hold

    def __len__(self) -> int:
        return len(self.places)

    def at(self, row: int) -> str:
        return self.places[row]

    def take(self, rows: list[int]) -> Table:
        return Table(
            self.where,
            {k: [v[i] for i in rows] for k, v in self.columns.items()},
            [self.places[i] for i in rows],
            self.text_cells,
            self.teaches_tokenizer,
        )


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO or device: the read blocks; a folder: not a file
            raise UserError(f"{path}: not a regular file; give {what}")
        if info.st_size > MAX_DATA_FILE_BYTES:
            raise UserError(
                f"{path}: {info.st_size / 2**30:.1f} GiB, more than the {MAX_DATA_FILE_BYTES / 2**30:g} GiB a data "
                "file may have (it is read into memory whole; SST-2's train.tsv is 3.8 MB)"
            )
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file ({what})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror})") from None


def _decode(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None


def _header(path: Path, header: list[str]) -> list[str]:
    names = [name.strip() for name in header]
    if not any(names):
        raise UserError(f"{path}: empty file; expected a header line naming the columns, then rows")
    seen = set()
    for name in names:
        if name in seen:
            raise UserError(f"{path}:1: column {name!r} appears twice in the header")
        seen.add(name)
    return names


def read_delimited(
    path: Path,
    delimiter: str,
    quoting: bool = True,
    names: tuple[str, ...] = (),
    extra_fields: str = "refuse",
    semicolon_fallback: bool = False,
) -> Table:
    """A CSV or TSV file with a header line (or `names` for a headerless one). `quoting`: fields may be quoted (the
    csv standard); GLUE's files are not, and hold stray quote characters. A line with more fields than the header
    is refused, unless `extra_fields` says where the extra ones sit: "before_last" (the header's last column is the
    line's last field: STS-B's score) or "after" (dropped). `semicolon_fallback`: a header that is one column
    holding `;` (Excel's CSV where the decimal separator is a comma) makes the file `;`-separated, said in the log."""
    text = _decode(path, _read_bytes(path, "a file of rows"))
    csv.field_size_limit(MAX_DATA_FILE_BYTES)  # the row bound is checked on the texts, naming the line
    if semicolon_fallback and not names:
        try:
            first = next(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter), [])
        except csv.Error:  # the reader below names the line
            first = []
        if len(first) == 1 and ";" in first[0]:
            log.info("%s: its header line holds no %r but ';': read as ';'-separated", path, delimiter)
            delimiter = ";"
    kind = {";": "';'-separated CSV", "\t": "TSV"}.get(delimiter, "CSV")
    reader = csv.reader(
        io.StringIO(text, newline=""),
        delimiter=delimiter,
        quoting=csv.QUOTE_MINIMAL if quoting else csv.QUOTE_NONE,
        strict=quoting,
    )
    try:
        header = list(names) or _header(path, next(reader, []))
        columns: dict[str, list] = {name: [] for name in header}
        places = []
        line = reader.line_num
        for fields in reader:
            start, line = line + 1, reader.line_num
            # a blank line, or a whitespace line among several columns; in a one-column file `""` or spaces are a
            # row with an empty text (a test row still gets a prediction, at its own index)
            if not fields or (len(header) > 1 and len(fields) == 1 and not fields[0].strip()):
                continue
            if len(fields) > len(header) and extra_fields == "before_last":
                fields = fields[: len(header) - 1] + fields[-1:]
            elif len(fields) > len(header) and extra_fields == "after":
                fields = fields[: len(header)]
            if len(fields) != len(header):
                separated = {"\t": "tab-separated ", ";": "';'-separated "}.get(delimiter, "")
                raise UserError(
                    f"{path}:{start}: {len(fields)} {separated}fields, the header has {len(header)} "
                    f"({', '.join(header)})"
                )
            for name, value in zip(header, fields):
                columns[name].append(value)
            places.append(f"{path}:{start}")
    except csv.Error as exc:
        raise UserError(f"{path}:{reader.line_num}: not a valid {kind} row ({exc})") from None
    return Table(str(path), columns, places, text_cells=True)


def read_json(path: Path) -> Table:
    """JSON Lines (one object per line), or one JSON array of objects."""
    text = _decode(path, _read_bytes(path, "a JSON Lines file of objects"))
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        numbered = [(f"{path} item {i + 1}", item) for i, item in enumerate(items)]
    else:
        numbered = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{path}:{number}: not a JSON object ({exc.msg}); JSON Lines holds one per line"
                ) from None
    columns: dict[str, list] = {}
    places = []
    for place, item in numbered:
        if not isinstance(item, dict):
            raise UserError(f"{place}: a {type(item).__name__}, not a JSON object of column: value")
        if not columns:
            columns = {name: [] for name in item}
        missing = [name for name in columns if name not in item]
        if missing:
            raise UserError(f"{place}: lacks key(s) {', '.join(missing)} that the first row has")
        extra = [name for name in item if name not in columns]
        if extra:  # its values would be read nowhere (a `tools` the first row lacks): dropped silently
            raise UserError(
                f"{place}: has key(s) {', '.join(extra)} that the first row lacks; give every row the same keys "
                "(null where a row has no value)"
            )
        for name in columns:
            columns[name].append(item[name])
        places.append(place)
    return Table(str(path), columns, places)


def read_parquet(path: Path) -> Table:
    import pyarrow.parquet as pq

    _read_bytes(path, "a Parquet file")  # the size and kind checks (pyarrow reads it again, column by column)
    try:
        columns = pq.read_table(path).to_pydict()
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise UserError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:160]})") from None
    rows = len(next(iter(columns.values()), []))
    return Table(str(path), columns, [f"{path} row {i + 1}" for i in range(rows)])


# what `datasets`' save_to_disk writes at a folder's top: a DatasetDict's, a single Dataset's (the Makefile's DATA=
# and the notebooks read a folder holding either as dataset=)
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")


def read_file(path: str | Path, key: str) -> Table:
    """A user's data file by its extension; `key`: the config key that named it (for messages)."""
    path = Path(path).expanduser()
    if path.is_dir():
        saved = next((name for name in SAVED_DATASET_FILES if (path / name).is_file()), None)
        if saved is not None:
            raise UserError(
                f"{key}={str(path)!r} is a folder written by datasets' save_to_disk (it holds {saved}): give "
                f"dataset={path} (its splits train, validation, test); {key}= takes a file of rows"
            )
        raise UserError(
            f"{key}={str(path)!r} is a folder; {key}= takes a file of rows ({', '.join(FORMATS)}), dataset= a "
            "folder written by save_to_disk, data_dir= a folder of GLUE files"
        )
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UserError(
            f"{key}={str(path)!r}: unknown file type {path.suffix or '(none)'!r}; valid: {', '.join(FORMATS)}"
        )
    if kind == "csv":
        return read_delimited(path, ",", semicolon_fallback=True)
    if kind == "tsv":
        return read_delimited(path, "\t")
    if kind == "json":
        return read_json(path)
    return read_parquet(path)


def read_dataset(dataset, where: str) -> Table:
    """A `datasets.Dataset` (a split of a saved folder or of a Hub data set)."""
    columns = dataset.to_dict()
    return Table(where, columns, [f"{where} row {i + 1}" for i in range(len(dataset))])


def check_text(table: Table, row: int, text: str) -> None:
    """Bounds that keep tokenizer training from hanging: a row's and a word's length (only where a tokenizer is
    learned from the rows: a pretrained one takes any)."""
    if not table.teaches_tokenizer:
        return
    if len(text) > MAX_ROW_CHARS:
        raise UserError(
            f"{table.at(row)}: {len(text):,} characters, more than the {MAX_ROW_CHARS:,} a row may have "
            "(SST-2's longest has 270)"
        )
    if len(text) > MAX_WORD_CHARS:
        longest = max(text.split(), key=len, default="")
        if len(longest) > MAX_WORD_CHARS:
            raise UserError(
                f"{table.at(row)}: a word of {len(longest):,} characters ({longest[:20]!r}...), more than the "
                f"{MAX_WORD_CHARS:,} a word may have (learning a tokenizer takes time quadratic in a word's length)"
            )
