"""The documentation stays true to the code: the configuration reference is generated from `Config` and current,
and every command shown in a code block of README.md or docs/*.md names what exists (make targets, scripts,
modules, recipes, configuration keys)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, assert_trains_like, launch, python, tiny_overrides

from parallel_finetune.config import SECTIONS, USER_KEYS, Config

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BOOKKEEPING = {"recipe", "lr_note"}  # set by the loader, not by users


def test_the_configuration_reference_is_generated_and_current():
    checked = python("scripts/config_reference.py", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_user_key_is_in_a_section_and_documented():
    fields = {field.name for field in dataclasses.fields(Config)} - BOOKKEEPING
    assert fields == set(USER_KEYS)
    page = (REPO / "docs" / "configuration.md").read_text()
    undocumented = [key for key in USER_KEYS if re.search(rf"^\| `{key}` \|.*\|  \|$", page, re.M)]
    assert not undocumented, f"fields without a comment in config.py: {undocumented}"


def commands(page) -> list[tuple[str, str]]:
    """(where, command) for each shell line of each fenced code block: continuations joined, comments dropped."""
    result, block, text = [], None, page.read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block is None or block not in ("", "bash", "sh", "shell"):
            continue
        result.append((f"{page.name}:{number}", line))
    joined = []
    for where, line in result:
        if joined and joined[-1][1].endswith("\\"):
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
        else:
            joined.append((where, line))
    shell = re.compile(r"^(make|python|torchrun|sbatch|NPROC_PER_NODE=\S+ sbatch)\b")
    return [(where, line.split("  #")[0].strip()) for where, line in joined if shell.match(line.strip())]


ALL = [pytest.param(where, command, id=where) for page in PAGES for where, command in commands(page)]


def known_key(key: str) -> bool:
    key = key.lstrip("-")
    head, _, rest = key.partition(".")
    if head in SECTIONS:
        return rest in SECTIONS[head]
    return head in USER_KEYS and (not rest or head == "model_config")


def check_overrides(words: list[str]) -> list[str]:
    """Problems with recipe paths and key=value overrides among `words`."""
    problems = []
    for word in words:
        if word.endswith(".yaml") and not (REPO / word).is_file():
            problems.append(f"no recipe {word}")
        elif "=" in word and not word.startswith("-") and re.match(r"^[a-z_.]+=", word):
            if not known_key(word.split("=", 1)[0]):
                problems.append(f"unknown key {word.split('=', 1)[0]}")
    return problems


def test_there_are_commands_to_check():
    assert len(ALL) > 20


@pytest.mark.parametrize("where,command", ALL)
def test_a_documented_command_names_what_exists(where, command):
    words = [w for w in shlex.split(command.replace("...", "")) if w]
    if words[0].startswith("NPROC_PER_NODE="):
        words = words[1:]
    problems = []
    if words[0] == "make":
        target = words[1]
        variables = [w for w in words[2:] if "=" in w]
        dry = subprocess.run(["make", "-n", target, *variables], cwd=REPO, capture_output=True, text=True)
        if dry.returncode != 0:
            problems.append(f"make {target}: {dry.stderr.strip().splitlines()[-1:]}")
        for variable in variables:
            if variable.startswith("ARGS="):
                problems += check_overrides(variable[5:].split())
    else:
        for index, word in enumerate(words):
            if word == "-m":
                module = words[index + 1]
                path = REPO / "src" / Path(*module.split("."))
                if module.startswith("parallel_finetune") and not path.with_suffix(".py").is_file():
                    problems.append(f"no module {module}")
            elif re.match(r"^(scripts|bench)/\S+\.(py|sbatch)$", word) and not (REPO / word).is_file():
                problems.append(f"no file {word}")
        problems += check_overrides(words)
    assert not problems, f"{where}: `{command}`: " + "; ".join(problems)


# ------------------------------------------------------------------------ the worked example of a fifth family

FAMILY_WORKER = REPO / "tests" / "workers" / "docs_family.py"
FAMILY_LAYOUTS = [
    ("tp2", 2, ["tensor_parallel_degree=2"]),
    ("pp2", 2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2", "model_config.num_hidden_layers=4"]),
]


def family_source() -> str:
    spec = importlib.util.spec_from_file_location("docs_family_worker", FAMILY_WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker.family_source(worker.PAGE)


def test_the_fifth_family_example_is_a_few_dozen_lines():
    lines = [line for line in family_source().splitlines() if line.strip()]
    assert 20 <= len(lines) <= 80, len(lines)


@pytest.fixture(scope="module")
def family_recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("opt-recipe") / "tp.yaml"
    path.write_text("family: opt\nsize: tiny\ntask: classification\nlr: 1.0e-3\nmodel_config:\n  dropout: 0\n")
    return path


@pytest.fixture(scope="module")
def family_reference(family_recipe, sst2, cache_dir, tmp_path_factory):
    def get(extra: tuple[str, ...]):
        overrides = tiny_overrides(sst2, cache_dir, family="opt") + list(extra)
        out = tmp_path_factory.mktemp("opt-single")
        return launch(1, overrides, out, script=str(FAMILY_WORKER), recipe=family_recipe)

    return functools.cache(get)


@pytest.mark.parametrize("name,nproc,overrides", [pytest.param(*layout, id=layout[0]) for layout in FAMILY_LAYOUTS])
def test_the_fifth_family_of_the_architecture_page_trains_like_one_process(
    name, nproc, overrides, family_recipe, family_reference, sst2, cache_dir, tmp_path
):
    """docs/architecture.md's OPT family, run as the page shows it, trains under TP=2 and PP=2 exactly like one
    process: the page's code is all a family needs."""
    model = tuple(o for o in overrides if o.startswith("model_config."))
    reference = family_reference(model)
    run = launch(
        nproc,
        tiny_overrides(sst2, cache_dir, family="opt") + overrides,
        tmp_path / name,
        script=str(FAMILY_WORKER),
        recipe=family_recipe,
    )
    assert "tiny opt from config" in reference.output
    assert_trains_like(run, reference, "classification")


# ------------------------------------------------------------------------------------- the README stays short

README_MAX_LINES = 250


def test_the_readme_stays_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    unlinked = [page.name for page in sorted((REPO / "docs").glob("*.md")) if f"](docs/{page.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_point_at_pages_and_headings_that_exist():
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                problems.append(f"{page.name}: no file {target}")
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.M)
                if fragment not in {anchor(h) for h in headings}:
                    problems.append(f"{page.name}: no heading #{fragment} in {linked.name}")
    assert not problems, "\n".join(problems)
