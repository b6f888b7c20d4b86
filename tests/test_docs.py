"""The documentation stays true to the code: the configuration reference is generated from `Config` and current,
and every command shown in a code block of README.md or docs/*.md names what exists (make targets, scripts,
modules, recipes, configuration keys)."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

import harness
import pytest
from conftest import REPO, assert_trains_like, launch, python, subprocess_env, tiny_overrides

from parallel_finetune import families
from parallel_finetune.config import SECTIONS, USER_KEYS, Config

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BOOKKEEPING = {"recipe", "lr_note"}  # set by the loader, not by users


def test_the_configuration_reference_is_generated_and_current():
    checked = python("scripts/config_reference.py", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_user_key_is_in_a_section_and_documented():
    fields = {field.name for field in dataclasses.fields(Config)} - BOOKKEEPING
    assert fields == set(SECTIONS), "Config's fields are its sections"
    flat = {key for name in SECTIONS for key in (f.name for f in dataclasses.fields(getattr(Config(), name)))}
    assert flat == set(USER_KEYS)
    page = (REPO / "docs" / "configuration.md").read_text()
    undocumented = [key for key in USER_KEYS if re.search(rf"^\| `{key}` \|.*\|  \|$", page, re.M)]
    assert not undocumented, f"fields without a comment in config/sections.py: {undocumented}"


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
    if head in SECTIONS and rest:  # model.model=X; a bare model=X is the key of that name
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

FAMILY_MARKER = "<!-- fifth family"


def family_source() -> str:
    """The first ```python block after the marker comment of docs/architecture.md: a complete family module."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text[text.index(FAMILY_MARKER) :], re.S).group(1)


def test_the_fifth_family_example_is_a_few_dozen_lines():
    lines = [line for line in family_source().splitlines() if line.strip()]
    assert 20 <= len(lines) <= 80, len(lines)


@pytest.fixture(scope="module")
def fifth_family(tmp_path_factory) -> Path:
    """The page's OPT family as one file, opt.py, with the recipe beside it (recipes/opt/tp.yaml), as a user
    outside the package would keep them."""
    folder = tmp_path_factory.mktemp("fifth-family")
    (folder / "opt.py").write_text(family_source())
    (folder / "recipes" / "opt").mkdir(parents=True)
    # GELU, not OPT's ReLU: a ReLU unit whose pre-activation lies within fp32 rounding of 0 passes its gradient under
    # one summation order and not under another, so a parity row would measure the kink, not the layout (a TP=2
    # row on SST-2's first 8,000 rows: 8.5e-4 with ReLU, 4.8e-7 with GELU).
    recipe = "family: opt\nsize: tiny\ntask: classification\nlr: 1.0e-3\nmodel_config:\n  activation_function: gelu\n"
    (folder / "recipes" / "opt" / "tp.yaml").write_text(recipe)
    return folder / "opt.py"


@pytest.fixture
def registered(fifth_family, monkeypatch):
    """PARALLEL_FINETUNE_FAMILIES names the file, here and in every process this test starts; the registry of this
    process is restored afterwards."""
    monkeypatch.setattr(families, "_families", dict(families._families))
    monkeypatch.setattr(families, "_files_loaded", set())
    monkeypatch.setenv(families.ENVIRONMENT, str(fifth_family))
    return {families.ENVIRONMENT: str(fifth_family)}


def test_a_family_registered_from_one_file_is_planned_checked_and_written_as_a_checkpoint(
    registered, fifth_family, sst2, cache_dir, tmp_path
):
    """The page's OPT, from its own file: the planner knows its published model, --check passes, and a synthetic
    OPT checkpoint is written and loads bit for bit."""
    from safetensors.torch import load_file

    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.model import synthetic
    from parallel_finetune.model.load import load_model

    assert "opt" in families.family_names() and "opt" not in families.LISTING_ORDER
    planned = python("scripts/plan.py", "facebook/opt-1.3b", "--gpus", "8", "--gpu-mem-gb", "40", env=registered)
    assert planned.returncode == 0 and "facebook/opt-1.3b" in planned.stdout, planned.stdout + planned.stderr
    sentences = column(read_glue_dir(sst2)["train"], "text")[:2000]
    folder = synthetic.write_checkpoint(
        tmp_path / "opt", "opt", sentences, hidden=64, layers=2, heads=4, vocab_size=300
    )
    recipe = fifth_family.parent / "recipes" / "opt" / "tp.yaml"
    checked = python(
        "-m",
        "parallel_finetune.train",
        "--check",
        "--nproc",
        "2",
        str(recipe),
        "size=full",
        f"model={folder}",
        "tensor_parallel_degree=2",
        f"data_dir={sst2}",
        f"cache_dir={cache_dir}",
        f"output_dir={tmp_path / 'run'}",
        env=registered,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    family = families.get_family("opt")
    hf_config = family.hf_config(str(folder), "full", 0, 0, {})
    model = load_model(family, "causal_lm", hf_config, str(folder), seed=0).model
    written = load_file(folder / "model.safetensors")
    loaded = model.state_dict()
    assert written.keys() <= loaded.keys()
    assert all(loaded[name].equal(tensor) for name, tensor in written.items())


def test_the_parity_table_takes_in_a_family_registered_from_one_file(registered, sst2, cache_dir, tmp_path, request):
    """tests/test_parity.py, collected with the page's OPT registered, has its TP=2 row, and the row passes: losses
    within 1e-5 of one process at every step, the same dev accuracy. Collected by a fresh pytest (the table is
    made at import, so the environment must name the file before); the row is then run here, by the parity
    module's own test function with that row's values (a second pytest with its own harness cost ~20 s more).
    The collecting pytest is forked from the harness's zygote (`python -m pytest`): a fresh pytest session and a
    fresh import of the parity module, without ~8 s of torch's imports."""
    import test_parity

    env = {k: v for k, v in subprocess_env().items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(registered, SST2_DIR=str(sst2))
    row = "tests/test_parity.py::test_layout_matches_single_process[opt-tp2-classification]"
    command = ["-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "--collect-only"]
    command += ["tests/test_parity.py", "-k", "opt-tp2", f"--basetemp={tmp_path / 'inner'}"]
    done = harness.python(command, env, REPO, 900)  # env as given: no PYTEST_ variable of this session
    assert done.returncode == 0 and row in done.stdout.splitlines(), done.stdout[-4000:] + done.stderr[-2000:]
    values = ("opt", "tp2", 2, ["tensor_parallel_degree=2"], "classification", ())
    single_process = request.getfixturevalue("single_process")
    test_parity.test_layout_matches_single_process(*values, single_process, sst2, cache_dir, tmp_path)


def test_the_fifth_family_of_the_architecture_page_trains_under_pp2_like_one_process(
    registered, fifth_family, sst2, cache_dir, tmp_path
):
    """The page's OPT, registered from its file through the environment, trains under PP=2 (4 blocks) as one
    process does: every torchrun worker finds the family."""
    recipe = fifth_family.parent / "recipes" / "opt" / "tp.yaml"
    model = ["model_config.num_hidden_layers=4"]
    overrides = tiny_overrides(sst2, cache_dir, family="opt") + model
    reference = launch(1, overrides, tmp_path / "one", recipe=recipe, env=registered)
    pipeline = ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]
    run = launch(2, overrides + pipeline, tmp_path / "pp2", recipe=recipe, env=registered)
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
    # and each has its row in the README's index of pages (a link in the prose is easy to miss)
    indexed = set(re.findall(r"^\| \[docs/([\w-]+\.md)\]", readme, flags=re.M))
    assert sorted(page.name for page in (REPO / "docs").glob("*.md") if page.name not in indexed) == []


def test_the_notebooks_page_gives_each_walkthroughs_step_count():
    """docs/notebooks.md's MAX_STEPS row holds every notebook's default, the parameters cell papermill overrides."""
    import json

    row = next(line for line in (REPO / "docs" / "notebooks.md").read_text().splitlines() if "| `MAX_STEPS`" in line)
    default = row.split("|")[2]
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        (cell,) = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        (steps,) = re.findall(r"^MAX_STEPS = (\w+)", "".join(cell["source"]), flags=re.M)
        said = f"`{steps}`" in default and (default.startswith(f" `{steps}`") or f"`{notebook.stem}`" in default)
        assert said, f"{notebook.name}: MAX_STEPS = {steps}, docs/notebooks.md says {default.strip()}"


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


def test_the_preference_parity_statement_says_the_shipped_lora_dropout_breaks_it():
    """Issue 54: the dpo_lora recipes' lora_dropout makes TP=2 differ from one process (each rank draws its own
    masks); the parity list, proven with dropout off, must say so while a shipped DPO recipe sets dropout."""
    import yaml

    dropouts = {
        path.relative_to(REPO).as_posix(): (yaml.safe_load(path.read_text()).get("peft") or {}).get("lora_dropout", 0)
        for path in sorted((REPO / "recipes").glob("*/dpo*.yaml"))
    }
    page = (REPO / "docs" / "preference.md").read_text(encoding="utf-8")
    layouts = page.split("## Batches, packing and layouts", 1)[1].split("\n## ", 1)[0]
    for recipe, dropout in dropouts.items():
        if dropout:
            said = f"`lora_dropout: {dropout:g}`" in layouts and "Those runs have dropout off" in layouts
            assert said, f"{recipe} sets lora_dropout: {dropout}, which preference.md's parity list does not say"
    assert "test_dpo_resumes_exactly_with_dropout_on" in layouts
