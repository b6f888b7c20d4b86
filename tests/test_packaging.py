"""Copying a recipe into another project: the package builds as a wheel, and a recipe folder copied out of the
repository runs from there under torchrun with `python -m parallel_finetune.train` (no paths into the repo)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile

import harness
import pytest
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


# ---------------------------------------------------------------- issue 54: a core setup, the rest on demand

EXTRAS = ("deepspeed", "mlflow", "wandb", "sagemaker", "boto3", "moto", "papermill", "matplotlib", "pytest", "ruff")


def pins(path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in (REPO / path).read_text().splitlines()]
    return dict(line.split("==") for line in lines if "==" in line)


def test_setup_installs_the_core_and_says_so_and_the_rest_comes_with_the_targets_that_need_it():
    """`make gptj-tp` waits for no DeepSpeed, trackers, SageMaker or test tools; `make setup` says what it installs
    and lets pip show its progress; make test, lint, notebooks and the -sagemaker targets install the rest; the
    pyproject extras name the same packages; no module of the package imports an extra at its top."""
    core, everything = pins("requirements.txt"), pins("requirements-all.txt")
    assert "-r requirements.txt" in (REPO / "requirements-all.txt").read_text().splitlines()
    assert not set(core) & set(everything)  # each pin once
    assert {"torch", "transformers", "peft", "torchao"} <= set(core)
    extras_pinned = {name.split("[")[0] for name in everything}
    wanted = {"deepspeed", "mlflow", "wandb", "sagemaker-train", "moto", "pytest", "pytest-xdist", "ruff"}
    assert wanted <= extras_pinned
    text = (REPO / "pyproject.toml").read_text()  # (tomllib is Python 3.11's; the package supports 3.10)
    section = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    extras = dict(re.findall(r"^(\w+) = \[(.*)\]$", section, flags=re.M))
    assert set(extras) == {"deepspeed", "trackers", "sagemaker", "notebooks", "test", "all"}
    specs = [spec for group, listed in extras.items() if group != "all" for spec in re.findall(r'"([^"]+)"', listed)]
    named = {re.split(r"[\[<>=]", spec)[0] for spec in specs}
    assert named == extras_pinned

    def commands(target: str) -> str:
        env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        dry = subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, env=env)
        assert dry.returncode == 0, dry.stderr
        return dry.stdout

    setup = commands("gptj-tp")
    assert "pip install --progress-bar on -r requirements.txt" in setup and "requirements-all" not in setup
    assert 'echo ">>> setup: installing the core' in setup and " -q -r requirements" not in setup
    for target in ("test", "lint", "notebooks", "llama-tp-sagemaker"):
        assert "pip install --progress-bar on -r requirements-all.txt" in commands(target), target
    for path in (REPO / "src" / "parallel_finetune").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # the module's own statements, not its functions'
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n.split(".")[0] in EXTRAS], f"{path}: imports {names} at its top"


def test_a_tracker_the_core_setup_lacks_is_one_line_before_the_run(monkeypatch):
    """report_to=mlflow or wandb without the package (a core setup): said by load_config (so by --check too), with
    the command that installs it, not an ImportError on every rank once the model is loaded."""
    import importlib.util

    from parallel_finetune.errors import UserError
    from parallel_finetune.resolve import load_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert load_config(None, ["family=gptj", "report_to=[mlflow, tensorboard]"]).report_to == ["mlflow", "tensorboard"]
    with pytest.raises(UserError) as refused:
        load_config(None, ["family=gptj", "report_to=all"])
    assert str(refused.value) == (
        "config: report_to='all' needs wandb: make setup-all, or pip install -r requirements-all.txt"
    )
