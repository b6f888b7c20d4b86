"""scripts/fetch_sst2.py, what `make test` runs first: the lookup order (SST2_DIR, data/glue/sst2, ../shared/data/sst2),
the check of a folder found or fetched, a fetch from GLUE's zip and from the Hub's rows, and a fresh clone offline
with nothing beside it (one line, nothing written). Each repository here is a temporary folder holding a copy of the
script, as a user's clone would, so nothing depends on what lies beside this checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, fetch_sst2

SCRIPT = REPO / "scripts" / "fetch_sst2.py"
FILES = ("train.tsv", "dev.tsv", "test.tsv")


def clone(root: Path) -> Path:
    """root/repo with scripts/fetch_sst2.py, as a fresh clone (git clone copies no data/glue/: git ignores it)."""
    repo = root / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / SCRIPT.name)
    return repo


def link_sst2(source: Path, folder: Path) -> Path:
    """`folder` holding the real files (symlinks: the check reads them whole, nothing is copied)."""
    folder.mkdir(parents=True)
    for name in FILES:
        (folder / name).symlink_to(source / name)
    return folder


def run_script(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(repo / "scripts" / SCRIPT.name), *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def offline_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No SST2_DIR, no network for the Hub client (an empty cache of its own), GLUE's zip at a file that does not
    exist: each download fails at once whether or not this machine is online."""
    env = {k: v for k, v in os.environ.items() if k != "SST2_DIR"}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_CACHE=str(tmp_path / "hf-home" / "hub"),
        HF_DATASETS_CACHE=str(tmp_path / "hf-home" / "datasets"),
        SST2_ZIP_URL=(tmp_path / "no-such" / "SST-2.zip").as_uri(),
    )
    env.update(extra)
    return env


def test_the_lookup_order_is_sst2_dir_then_the_fetched_folder_then_shared(sst2_full, tmp_path):
    repo = clone(tmp_path)
    fetched, shared = repo / "data" / "glue" / "sst2", tmp_path / "shared" / "data" / "sst2"
    assert fetch_sst2.locate(repo, {}) is None  # nothing anywhere
    link_sst2(sst2_full, shared)
    assert fetch_sst2.locate(repo, {}) == shared
    link_sst2(sst2_full, fetched)
    assert fetch_sst2.locate(repo, {}) == fetched  # the repository's own copy before the shared one
    mine = link_sst2(sst2_full, tmp_path / "mine")
    assert fetch_sst2.locate(repo, {"SST2_DIR": str(mine)}) == mine
    # a set SST2_DIR is the one meant: a wrong one is said, never passed over for another copy
    with pytest.raises(fetch_sst2.Sst2Error, match=r"SST2_DIR='.*nowhere': no such folder; set SST2_DIR=FOLDER"):
        fetch_sst2.locate(repo, {"SST2_DIR": str(tmp_path / "nowhere")})


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("train.tsv", lambda lines: lines[:101], "train.tsv: 100 rows, GLUE SST-2's has 67,349"),
        ("dev.tsv", lambda lines: lines + lines[1:3], "dev.tsv: 874 rows, GLUE SST-2's has 872"),
        ("test.tsv", lambda lines: ["sentence\tindex\n", *lines[1:]], "test.tsv: header 'sentence\\tindex'"),
        ("dev.tsv", lambda lines: [*lines[:5], "a sentence\t2\n", *lines[6:]], "line 6: 'a sentence\\t2' is not a"),
        ("train.tsv", lambda lines: [*lines[:-1], lines[-1][:10]], "train.tsv line 67350: "),  # cut mid-row
    ],
)
def test_a_wrong_file_is_one_line_naming_it_and_what_is_wrong(sst2_full, tmp_path, name, edit, message):
    repo = clone(tmp_path)
    fetched = repo / "data" / "glue" / "sst2"
    fetched.mkdir(parents=True)
    for other in FILES:
        lines = (sst2_full / other).read_text(encoding="utf-8").splitlines(keepends=True)
        (fetched / other).write_text("".join(edit(lines) if other == name else lines), encoding="utf-8")
    with pytest.raises(fetch_sst2.Sst2Error) as error:
        fetch_sst2.locate(repo, {})
    text = str(error.value)
    assert f"{fetched / name}" in text and message in text and "\n" not in text, text
    assert f"delete {fetched} or fix it" in text


def test_a_fresh_clone_offline_stops_in_one_line_and_writes_nothing(tmp_path):
    """The README's `make test` on a user's machine without network: no SST2_DIR, no data/glue/sst2, nothing beside
    the clone. The script says how to provide the files in one error line (after one line saying it tried)."""
    repo = clone(tmp_path)
    for args in ((), ("--find",)):
        done = run_script(repo, offline_env(tmp_path), *args)
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and len(done.stderr.splitlines()) == (2 if not args else 1), done.stderr
        assert f"SST2_DIR=FOLDER holding GLUE's SST-2 train.tsv, dev.tsv, test.tsv, or put them in {repo}" in errors[0]
        assert "could not be fetched (file://" in errors[0] if not args else "GLUE SST-2 not found;" in errors[0]
    assert not (repo / "data" / "glue" / "sst2").exists()
    assert not list((repo / "data" / "glue").iterdir()), "a failed download leaves no partial folder"


def glue_zip(sst2_full: Path, path: Path, cut: str | None = None) -> Path:
    """A zip laid out as GLUE's SST-2.zip (SST-2/train.tsv, ..., SST-2/original/...), `cut` to 1,000 rows."""
    with zipfile.ZipFile(path, "w") as archive:
        for name in FILES:
            data = (sst2_full / name).read_bytes()
            if name == cut:
                data = b"".join(data.splitlines(keepends=True)[:1001])
            archive.writestr(f"SST-2/{name}", data)
        archive.writestr("SST-2/original/train.tsv", b"not GLUE's file\n")
    return path


def test_a_fetch_from_glues_zip_is_checked_and_then_found(sst2_full, tmp_path):
    repo = clone(tmp_path)
    url = glue_zip(sst2_full, tmp_path / "SST-2.zip").as_uri()
    done = run_script(repo, offline_env(tmp_path, SST2_ZIP_URL=url))
    fetched = repo / "data" / "glue" / "sst2"
    assert done.returncode == 0 and done.stdout.strip() == str(fetched), done.stderr
    assert all((fetched / name).read_bytes() == (sst2_full / name).read_bytes() for name in FILES)
    again = run_script(repo, offline_env(tmp_path, SST2_ZIP_URL=(tmp_path / "gone.zip").as_uri()))
    assert again.returncode == 0 and again.stdout.strip() == str(fetched) and again.stderr == ""  # fetched once


def test_a_cut_download_is_refused_and_leaves_nothing(sst2_full, tmp_path, monkeypatch):
    """The check runs on what a source wrote before it becomes data/glue/sst2: a cut-off train.tsv from the zip,
    then a Hub that cannot be reached, is one line naming both, and no folder appears for a later lookup."""
    repo = clone(tmp_path)
    url = glue_zip(sst2_full, tmp_path / "SST-2.zip", cut="train.tsv").as_uri()

    def no_hub(folder):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(fetch_sst2, "write_from_hub", no_hub)
    with pytest.raises(fetch_sst2.Sst2Error) as error:
        fetch_sst2.fetch(repo, {"SST2_ZIP_URL": url}, log=lambda line: None)
    text = str(error.value)
    assert f"{url}: Sst2Error: train.tsv: 1,000 rows, GLUE SST-2's has 67,349" in text, text
    assert "nyu-mll/glue (sst2): ConnectionError: Couldn't reach" in text and "\n" not in text
    assert not list((repo / "data" / "glue").iterdir())
    assert fetch_sst2.locate(repo, {}) is None


def test_the_hubs_rows_are_written_in_glues_layout(sst2_full, tmp_path, monkeypatch):
    """write_from_hub on the Hub's schema (sentence, label, idx; test labels -1), here rows read from GLUE's files:
    it writes those files back byte for byte (GLUE's headers, tabs, the sentences' trailing spaces)."""
    import datasets
    from huggingface_hub import constants

    def split(name: str, test: bool = False) -> datasets.Dataset:
        lines = (sst2_full / name).read_text(encoding="utf-8").splitlines()[1:]
        if test:
            index, sentence = zip(*(line.split("\t") for line in lines), strict=True)
            values = {"sentence": sentence, "label": [-1] * len(lines), "idx": [int(i) for i in index]}
            return datasets.Dataset.from_dict(values)
        sentence, label = zip(*(line.split("\t") for line in lines), strict=True)
        values = {"sentence": sentence, "label": [int(v) for v in label], "idx": list(range(len(lines)))}
        return datasets.Dataset.from_dict(values)

    hub = datasets.DatasetDict(train=split("train.tsv"), validation=split("dev.tsv"), test=split("test.tsv", test=True))
    asked = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no reachability request
    monkeypatch.setattr(datasets, "load_dataset", lambda *args: asked.append(args) or hub)
    folder = tmp_path / "written"
    folder.mkdir()
    fetch_sst2.write_from_hub(folder)
    assert asked == [("nyu-mll/glue", "sst2")]
    assert all((folder / name).read_bytes() == (sst2_full / name).read_bytes() for name in FILES)
    fetch_sst2.check(folder)
