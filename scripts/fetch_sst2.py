#!/usr/bin/env python
"""GLUE SST-2 for the tests (and for DATA=): find it, or fetch it once into data/glue/sst2, and check it.

python scripts/fetch_sst2.py [--find]    prints the folder on stdout; `make test-data` runs it, `make test` too.

Looked for in this order, the first folder present wins (and must hold GLUE's files, whole):
  1. SST2_DIR, when set (a folder of GLUE's train.tsv, dev.tsv, test.tsv);
  2. data/glue/sst2 in this repository (git ignores it): what an earlier run of this script fetched;
  3. ../shared/data/sst2 beside this repository (a shared copy, where a workplace keeps one).
None present: fetched into data/glue/sst2 from GLUE's published zip (SST2_ZIP_URL, default GLUE's own; a mirror or
a file:// URL works too), else from the Hugging Face Hub (nyu-mll/glue, sst2: written in GLUE's TSV layout). The
files are checked (headers, row counts 67,349 / 872 / 1,821, each row's fields) before the folder appears, so a
failed or partial download leaves nothing behind. --find only looks, never downloads. Exit 2 with one line on
stderr when there is no usable copy.

Standard library only at import: tests/conftest.py loads this file for its lookup (`locate`).
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ZIP_URL = "https://dl.fbaipublicfiles.com/glue/data/SST-2.zip"
HUB_NAME, HUB_CONFIG = "nyu-mll/glue", "sst2"
# GLUE's SST-2 as GLUE ships it: file -> (header columns, data rows). Test labels are private (no label column).
FILES = {
    "train.tsv": (("sentence", "label"), 67_349),
    "dev.tsv": (("sentence", "label"), 872),
    "test.tsv": (("index", "sentence"), 1_821),
}


def how_to_provide(repo: Path = REPO) -> str:
    return (
        f"set SST2_DIR=FOLDER holding GLUE's SST-2 train.tsv, dev.tsv, test.tsv, or put them in "
        f"{repo / 'data' / 'glue' / 'sst2'} (or SST2_ZIP_URL=a copy of {ZIP_URL}, file:// works)"
    )


class Sst2Error(Exception):
    """No usable copy of SST-2: the message is one line naming the folder or file and what to do."""


def fetched_folder(repo: Path = REPO) -> Path:
    return repo / "data" / "glue" / "sst2"


def candidates(repo: Path = REPO, environ=os.environ) -> list[tuple[str, Path]]:
    """(how it was named, folder) in lookup order. A set SST2_DIR is the only candidate: a user who names a folder
    means that one, so a wrong one is reported rather than passed over for another copy."""
    if environ.get("SST2_DIR"):
        return [("SST2_DIR", Path(environ["SST2_DIR"]).expanduser())]
    return [("fetched", fetched_folder(repo)), ("shared", repo.parent / "shared" / "data" / "sst2")]


def _count_problem(path: Path, columns: tuple[str, ...], rows: int) -> str | None:
    """Why `path` is not GLUE's file (its header, a row's fields or label, the number of rows), or None."""
    if not path.is_file():
        return f"{path}: no such file"
    with open(path, encoding="utf-8", newline="") as file:
        lines = file.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last row
    header = tuple(lines[0].rstrip("\r").split("\t")) if lines else ()
    if header != columns:
        return f"{path}: header {chr(9).join(header)!r}, GLUE SST-2's is {chr(9).join(columns)!r}"
    for number, line in enumerate(lines[1:], start=2):
        fields = line.rstrip("\r").split("\t")
        value = fields[0] if columns[0] == "index" else fields[-1]
        if len(fields) != 2 or not (value.isdigit() if columns[0] == "index" else value in ("0", "1")):
            return f"{path} line {number}: {line[:60]!r} is not a row of {len(columns)} tab-separated fields " + (
                "(index, sentence)" if columns[0] == "index" else "(sentence, label 0 or 1)"
            )
    if len(lines) - 1 != rows:
        return f"{path}: {len(lines) - 1:,} rows, GLUE SST-2's has {rows:,}"
    return None


def check(folder: Path) -> None:
    """Raise Sst2Error (one line, naming the file and what is wrong) unless `folder` holds GLUE's SST-2 files."""
    for name, (columns, rows) in FILES.items():
        problem = _count_problem(folder / name, columns, rows)
        if problem:
            raise Sst2Error(problem)


def locate(repo: Path = REPO, environ=os.environ) -> Path | None:
    """The first candidate folder that exists, checked (Sst2Error if it is not whole), or None: none exists."""
    for named, folder in candidates(repo, environ):
        if named == "SST2_DIR" and not folder.is_dir():
            raise Sst2Error(f"SST2_DIR={str(folder)!r}: no such folder; {how_to_provide(repo)}")
        if folder.is_dir():
            try:
                check(folder)
            except Sst2Error as exc:
                fix = "fix or unset SST2_DIR" if named == "SST2_DIR" else f"delete {folder} or fix it"
                raise Sst2Error(f"{exc} ({fix}; {how_to_provide(repo)})") from None
            return folder
    return None


def _timeout() -> float:
    return float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "10"))


def write_from_zip(folder: Path, url: str) -> None:
    """GLUE's own files, byte for byte, from its zip (SST-2/train.tsv, dev.tsv, test.tsv)."""
    with urllib.request.urlopen(url, timeout=_timeout()) as response:
        archive = zipfile.ZipFile(io.BytesIO(response.read()))
    members = archive.namelist()
    for name in FILES:
        # SST-2/train.tsv, not SST-2/original/...: the shortest path ending in the name
        found = sorted((m for m in members if m.rsplit("/", 1)[-1] == name), key=len)
        if not found:
            raise Sst2Error(f"{url}: no {name} in the zip (holds {', '.join(members[:6])})")
        (folder / name).write_bytes(archive.read(found[0]))


def write_from_hub(folder: Path) -> None:
    """The Hub's rows (splits train, validation, test; the test labels there are -1) in GLUE's TSV layout."""
    import datasets  # imported here: the lookup alone needs no third-party package
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        # one quick request first: offline, the datasets client retries each file five times (~25 s of warnings);
        # an HTTP error is an answer (a rate limit, a gated repo), for load_dataset to report
        request = urllib.request.Request(f"{constants.ENDPOINT}/api/datasets/{HUB_NAME}", method="HEAD")
        try:
            urllib.request.urlopen(request, timeout=_timeout()).close()
        except urllib.error.HTTPError:
            pass
    hub = datasets.load_dataset(HUB_NAME, HUB_CONFIG)
    for name, split in (("train.tsv", "train"), ("dev.tsv", "validation")):
        rows = hub[split]
        lines = [f"{sentence}\t{label}\n" for sentence, label in zip(rows["sentence"], rows["label"], strict=True)]
        (folder / name).write_text("sentence\tlabel\n" + "".join(lines), encoding="utf-8", newline="")
    rows = hub["test"]
    lines = [f"{index}\t{sentence}\n" for index, sentence in zip(rows["idx"], rows["sentence"], strict=True)]
    (folder / "test.tsv").write_text("index\tsentence\n" + "".join(lines), encoding="utf-8", newline="")


def _first_line(exc: BaseException) -> str:
    text = (str(exc).splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def fetch(repo: Path = REPO, environ=os.environ, log=print) -> Path:
    """Fetch GLUE SST-2 into data/glue/sst2: each source writes a temporary folder beside it, which is checked and
    only then renamed into place (a failed or cut-off download leaves nothing a later lookup would find)."""
    target = fetched_folder(repo)
    target.parent.mkdir(parents=True, exist_ok=True)
    url = environ.get("SST2_ZIP_URL") or ZIP_URL
    sources = [(url, lambda folder: write_from_zip(folder, url)), (f"{HUB_NAME} ({HUB_CONFIG})", write_from_hub)]
    problems = []
    log(f"GLUE SST-2: SST2_DIR unset, no {target} nor ../shared/data/sst2; fetching it once (about 7 MB)")
    for where, write in sources:
        partial = Path(tempfile.mkdtemp(prefix=".sst2-partial-", dir=target.parent))
        try:
            write(partial)
            check(partial)
            partial.rename(target)
            return target
        except Exception as exc:  # offline, blocked, a mirror without the file, a bad copy: try the next source
            if target.is_dir():  # another process fetched it meanwhile
                return locate(repo, environ) or target
            # the temporary folder is gone in a moment: name the file by the source it came from
            problems.append(f"{where}: {_first_line(exc).replace(str(partial) + os.sep, '')}")
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    raise Sst2Error(f"GLUE SST-2 is not here and could not be fetched ({'; '.join(problems)}); {how_to_provide(repo)}")


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv not in ([], ["--find"]):
        usage = "python scripts/fetch_sst2.py [--find]"
        print(f"error: unknown arguments {' '.join(argv)!r}; usage: {usage}", file=sys.stderr)
        return 2
    try:
        folder = locate()
        if folder is None and argv == ["--find"]:
            raise Sst2Error(f"GLUE SST-2 not found; {how_to_provide()}")
        folder = folder or fetch(log=lambda line: print(line, file=sys.stderr))
    except Sst2Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
