"""The documentation stays true to the code: the configuration reference is generated from `Config` and current,
and every command shown in a code block of README.md or docs/*.md names what exists (make targets, scripts,
modules, recipes, configuration keys)."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, python

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
