"""Copying a recipe into another project: the package builds as a wheel, and a recipe folder copied out of the
repository runs from there under torchrun with `python -m parallel_finetune.train` (no paths into the repo)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

import harness
import yaml
from conftest import REPO, subprocess_env


def test_pip_wheel_builds_with_the_package_data(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("parallel_finetune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "parallel_finetune/train.py",
        "parallel_finetune/sagemaker_job.py",
        "parallel_finetune/tools/notebook.py",
        "parallel_finetune/families/gptj.py",
        "parallel_finetune/metrics/accuracy.py",
    } <= names
    assert any(name.startswith("parallel_finetune/sample_data/") for name in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "parallel-finetune = parallel_finetune.train:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_recipes_hold_no_paths_into_the_repository():
    for path in (REPO / "recipes").rglob("*.yaml"):
        text = path.read_text()
        assert "recipes/" not in text and "../" not in text and str(REPO) not in text, path
        keys = set()
        pending = [yaml.safe_load(text)]
        while pending:
            section = pending.pop()
            keys |= set(section)
            pending += [value for value in section.values() if isinstance(value, dict)]
        assert not keys & {"data_dir", "cache_dir", "output_dir", "checkpoint_dir"}, path


def test_copied_recipe_runs_from_another_folder(tmp_path, sst2, cache_dir):
    """`torchrun --nproc_per_node=2 -m parallel_finetune.train recipes/gptj/tp.yaml ...` in the user's own folder,
    the ranks forked as torchrun's would be (tests/harness.py; test_harness proves them the same)."""
    project = tmp_path / "my-project"
    shutil.copytree(REPO / "recipes" / "gptj", project / "recipes" / "gptj")
    argv = [
        "-m",
        "parallel_finetune.train",
        "recipes/gptj/tp.yaml",
        "size=tiny",
        "max_steps=3",
        f"data_dir={sst2}",
        f"cache_dir={cache_dir}",
        "output_dir=runs/copied",
    ]
    done = harness.run_ranks(2, argv, dict(subprocess_env(), PYTHONPATH=""), project, 600)
    assert done.returncode == 0, done.report()
    summary = project / "runs" / "copied" / "summary.json"
    assert summary.is_file() and (project / "runs" / "copied" / "hf" / "config.json").is_file()
    assert not (REPO / "runs" / "copied").exists()
