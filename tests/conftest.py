"""Shared test fixtures: the real SST-2 files, a session-wide tokenized-data cache, and `launch`, which runs
training on N ranks as torchrun would (forked from a pre-warmed process, see harness.py) and returns what it
wrote."""

from __future__ import annotations

import atexit
import contextlib
import csv
import importlib.util
import inspect
import json
import os
import pickle
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# A Hugging Face cache of this test process's own, empty but for what a test puts there, set before anything
# imports huggingface_hub (it reads HF_HUB_CACHE once, at import): no test reads the developer's cache, and the
# forked ranks (whose zygote imported the Hub client under this environment) see what a test fills in.
HUB_CACHE = Path(tempfile.mkdtemp(prefix="pf-hub-cache-"))
os.environ["HF_HUB_CACHE"] = str(HUB_CACHE)

import harness  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from parallel_finetune.families import family_names, get_family  # noqa: E402
from parallel_finetune.launch import torchrun_command  # noqa: E402
from parallel_finetune.outputs.reporting import format_step  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The tests mirror the package's folders (tests/data/, tests/loop/, ...); some share helpers across folders (an sft
# run's reference, a unit test's tiny model), imported by module name from whichever folder holds them.
sys.path[1:1] = [str(folder) for folder in sorted(Path(__file__).parent.glob("*/")) if any(folder.glob("test_*.py"))]
atexit.register(shutil.rmtree, HUB_CACHE, ignore_errors=True)
RECIPE = REPO / "recipes" / "gptj" / "tp.yaml"
# Every registered family (the registry's: built-in ones, plus those of PARALLEL_FINETUNE_FAMILIES files).
FAMILIES = tuple(family_names())


@pytest.fixture(autouse=True)
def transformers_left_whole():
    """A test must not leave transformers patched for the tests after it in its pytest worker: from_pretrained swaps
    PreTrainedModel.tie_weights (and init_weights) for no-ops while it builds, and two threads loading at once can
    leave the no-ops in place, so that every later model of the process stays untied (seen once, as a GPT-2 lm_head
    check that did not raise three files later)."""
    from transformers import PreTrainedModel

    before = PreTrainedModel.tie_weights, PreTrainedModel.init_weights
    yield
    after = PreTrainedModel.tie_weights, PreTrainedModel.init_weights
    if after != before:
        PreTrainedModel.tie_weights, PreTrainedModel.init_weights = before
        pytest.fail("this test left PreTrainedModel.tie_weights or init_weights patched (from_pretrained in threads?)")


def load_bench(name: str):
    """bench/NAME.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe(family: str) -> Path:
    """The family's tp.yaml: in recipes/, or for a family registered from a file, in recipes/ beside that file."""
    ours = REPO / "recipes" / family / "tp.yaml"
    if ours.is_file():
        return ours
    return Path(inspect.getfile(type(get_family(family)))).parent / "recipes" / family / "tp.yaml"


def no_dropout(family: str) -> list[str]:
    """Overrides that switch off the dropout a family's tiny model has (dropout draws different random numbers on
    differently sharded tensors): its `dropout_keys` that are not already 0."""
    model = get_family(family)
    tiny = model.tiny_config(64, 64)
    return [f"model_config.{key}=0" for key in model.dropout_keys if getattr(tiny, key)]


def _load_fetch_sst2():
    """scripts/fetch_sst2.py as a module: the one lookup of SST-2 (SST2_DIR, data/glue/sst2, ../shared/data/sst2)
    that `make test-data` also runs, so the tests read the folder it found or fetched."""
    spec = importlib.util.spec_from_file_location("fetch_sst2", REPO / "scripts" / "fetch_sst2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_sst2 = _load_fetch_sst2()


def find_sst2() -> Path | None:
    """The SST-2 folder the lookup finds, checked, or None (bench/launch_cost.py's default too)."""
    return fetch_sst2.locate()


@pytest.fixture(scope="session")
def sst2_full() -> Path:
    """The real GLUE SST-2 folder, all 67,349 / 872 / 1,821 rows: for the tests about reading it whole. Found, never
    downloaded, here (the suite runs offline, in parallel workers): `make test` fetches it first."""
    try:
        path = find_sst2()
    except fetch_sst2.Sst2Error as exc:
        pytest.fail(str(exc))
    if path is None:
        pytest.fail(f"GLUE SST-2 not found: run `make test-data` to fetch it, or {fetch_sst2.how_to_provide()}")
    return path


# What a tiny run reads of SST-2. A parity row trains 6 steps of 16 rows and scores the dev split, so loading all
# 67,349 training rows and scoring all 872 dev rows was most of each run's time; these real rows compare layouts
# as well. 128 dev rows, not 256 (until 2026-11-27): one evaluation batch of the tiny runs' 128, half the scoring,
# and the training rows, so every loss a parity row compares, unchanged. Tests about reading the whole data set
# take `sst2_full`.
SST2_ROWS = {"train.tsv": 8000, "dev.tsv": 128, "test.tsv": 128}


@pytest.fixture(scope="session")
def sst2(sst2_full, tmp_path_factory) -> Path:
    """A GLUE SST-2 folder of the real files' first rows (SST2_ROWS, headers kept): same bytes in every worker,
    so the tokenized-data cache and the tiny tokenizers are built once for the session."""
    folder = tmp_path_factory.mktemp("sst2")
    for name, rows in SST2_ROWS.items():
        lines = (sst2_full / name).read_text(encoding="utf-8").splitlines(keepends=True)[: rows + 1]
        (folder / name).write_text("".join(lines), encoding="utf-8")
    return folder


def short_dev(sst2: Path, folder: Path, rows: int = 128) -> Path:
    """`folder` holding SST-2's real training rows and its first `rows` dev rows: for runs that compare losses,
    checkpoints or errors but never dev metrics (scoring all 872 dev rows costs a tiny run as much as its
    training steps). The same files in every worker, so the tokenized-data cache serves them all."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.tsv").symlink_to(sst2 / "train.tsv")
    lines = (sst2 / "dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (folder / "dev.tsv").write_text("".join(lines[: rows + 1]), encoding="utf-8")
    return folder


def sst2_head(sst2: Path, folder: Path, train_rows: int, dev_rows: int) -> Path:
    """`folder` holding the first rows of SST-2's train and dev files (each with its header): for runs whose point
    is not the data (loading, --check, refusals), fast to tokenize."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.tsv", train_rows), ("dev.tsv", dev_rows)):
        lines = (sst2 / name).read_text(encoding="utf-8").splitlines(keepends=True)[: rows + 1]
        (folder / name).write_text("".join(lines), encoding="utf-8")
    return folder


def _sst2_rows(path: Path) -> list[tuple[str, int]]:
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [(text.strip(), int(label)) for text, label in (line.rsplit("\t", 1) for line in lines)]


def _five_classes(text: str, label: int) -> int:
    """Sentiment x length: a fragment of at most 3 words is class 4; else 2 x sentiment + (more than 10 words)."""
    words = len(text.split())
    return 4 if words <= 3 else 2 * label + (words > 10)


def _similarity(first: tuple[str, int], second: tuple[str, int]) -> str:
    """An STS-B-like score in [0, 5]: 2.5 for the same sentiment, plus 2.5 x the ratio of the two lengths."""
    a, b = len(first[0].split()), len(second[0].split())
    return f"{2.5 * (first[1] == second[1]) + 2.5 * min(a, b) / max(a, b):.3f}"


@pytest.fixture(scope="session")
def derived_tasks(sst2, tmp_path_factory) -> dict[str, list[str]]:
    """Tasks of issue 28 made from real SST-2 rows, as a user's CSV files (train 2,000 rows, dev 128 rows): `pairs`
    (sentence1, sentence2: another row drawn with a fixed seed; label "same"/"different" sentiment), `five_classes`
    (sentence; label 0-4, _five_classes), `regression` (the pairs; label a float score, _similarity). Task name ->
    the overrides that read it. Same content in every worker (the data fingerprint is the files' names and bytes),
    so the tokenized-data cache and the tokenizers are built once."""
    folder = tmp_path_factory.mktemp("derived_tasks")
    rng = random.Random(28)
    train = _sst2_rows(sst2 / "train.tsv")
    splits = {
        "train": [train[i] for i in rng.sample(range(len(train)), 2000)],
        "dev": _sst2_rows(sst2 / "dev.tsv")[:128],
    }
    tables: dict[str, dict[str, list[list]]] = {"pairs": {}, "five_classes": {}, "regression": {}}
    for split, rows in splits.items():
        partners = [rows[rng.randrange(len(rows))] for _ in rows]
        tables["pairs"][split] = [["sentence1", "sentence2", "label"]] + [
            [a[0], b[0], "same" if a[1] == b[1] else "different"] for a, b in zip(rows, partners)
        ]
        tables["five_classes"][split] = [["sentence", "label"]] + [[t, _five_classes(t, y)] for t, y in rows]
        tables["regression"][split] = [["sentence1", "sentence2", "label"]] + [
            [a[0], b[0], _similarity(a, b)] for a, b in zip(rows, partners)
        ]
    overrides = {}
    for task, files in tables.items():
        for split, rows in files.items():
            with open(folder / f"{task}_{split}.csv", "w", newline="", encoding="utf-8") as handle:
                csv.writer(handle).writerows(rows)
        overrides[task] = [
            f"train_file={folder / f'{task}_train.csv'}",
            f"validation_file={folder / f'{task}_dev.csv'}",
        ]
    return overrides


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenized-data cache for the whole session, pytest-xdist workers included (their temp folders share a
    parent): each tokenizer and dataset variant is built once, not once per worker. Concurrent builders are safe,
    as for ranks: data.prepare writes a variant to a temporary folder and renames it."""
    root = tmp_path_factory.getbasetemp()
    shared = root.parent / "cache" if os.environ.get("PYTEST_XDIST_WORKER") else root / "cache"
    shared.mkdir(exist_ok=True)
    return shared


@dataclass
class Run:
    returncode: int
    output: str
    output_dir: Path

    @property
    def records(self) -> list[dict]:
        return [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @property
    def summary(self) -> dict:
        return json.loads((self.output_dir / "summary.json").read_text())


def subprocess_env() -> dict:
    # TORCHINDUCTOR_COMPILE_THREADS=1: compile=true runs compile in the rank itself; a pool of compile workers (one
    # per core, each importing torch) costs a 2-core machine more than it saves.
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    return env


def python(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None, input: str | None = None
) -> subprocess.CompletedProcess:
    """`python *args` in the repository with subprocess_env() (plus `env`), output captured as text, `input` on
    its stdin; forked from the harness's pre-warmed zygote, which spares it ~8 s of imports."""
    return harness.python(list(args), {**subprocess_env(), **(env or {})}, REPO, timeout, input)


def make_commands(target: str, *variables: str) -> list[list[str]]:
    """The commands `make target variables...` runs (make -n, .venv taken as set up), each split into its words
    (a leading NAME=value is a word too). The tests run them forked; test_make_gptj_tp_end_to_end runs make."""
    # as typed in a shell, not nested in `make test` (which would add "make[1]: Entering directory" lines)
    env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "-o", ".venv/.installed-all", target, *variables],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.startswith("echo ")]


def launch(
    nproc: int,
    overrides: list[str],
    output_dir: Path,
    *,
    script: str | None = None,
    recipe: Path = RECIPE,
    check: bool = True,
    timeout: int = 600,
    torchrun: bool = False,
    torchrun_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Run:
    """torchrun --nproc_per_node N <script or scripts/train.py> RECIPE overrides... output_dir=...

    The ranks are forked from the harness's pre-warmed zygote (tests/harness.py), the same script under the same
    environment contract; `torchrun=True` (or any `torchrun_args`) launches real torchrun instead."""
    argv = [script or str(REPO / "scripts" / "train.py"), str(recipe), *overrides, f"output_dir={output_dir}"]
    env = {**subprocess_env(), **(env or {})}
    if torchrun or torchrun_args:
        command = torchrun_command(nproc, *torchrun_args, *argv)
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        run = Run(proc.returncode, proc.stdout + proc.stderr, output_dir)
        report = run.output[-6000:]
    else:
        ranks = harness.run_ranks(nproc, argv, env, REPO, timeout)
        run = Run(ranks.returncode, ranks.output, output_dir)
        report = ranks.report()
        if ranks.timed_out:
            pytest.fail(f"training timed out after {timeout} s:\n{report}")
    if check and run.returncode != 0:
        pytest.fail(f"training failed ({run.returncode}):\n{report}")
    return run


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
    """`get(recipe, overrides)`: a one-process reference run, launched once per session (per pytest-xdist worker)
    however many modules compare against it."""
    runs = {}

    def get(recipe: Path, overrides: list[str]) -> Run:
        key = (str(recipe), tuple(overrides))
        if key not in runs:
            runs[key] = launch(1, overrides, tmp_path_factory.mktemp(f"single-{recipe.parent.name}"), recipe=recipe)
        return runs[key]

    return get


@pytest.fixture
def single_process(single_process_run, sst2, cache_dir):
    """The one-process reference run of a tiny recipe, exported (test_deepspeed compares its exported weights)."""

    def get(family: str, task: str, model: tuple):
        return single_process_run(
            recipe(family), tiny_overrides(sst2, cache_dir, task, family, export="true") + list(model)
        )

    return get


def check(*overrides: str, nproc: int = 2, recipe: Path = RECIPE) -> subprocess.CompletedProcess:
    """`python -m parallel_finetune.train --check`: what make runs before torchrun."""
    return python(
        "-m", "parallel_finetune.train", "--check", "--nproc", str(nproc), str(recipe), *overrides, timeout=300
    )


def load_task_of(config):
    """tasks.load_task on a loaded Config's sections, as data.prepare calls it."""
    from parallel_finetune.tasks import load_task

    return load_task(data=config.data, model=config.model, seed=config.training.seed, predict=config.output.predict)


def prepare_data(config):
    """data.prepare on a loaded Config's sections, as the trainer calls it."""
    from parallel_finetune.loop.builder import prepare_data as prepare_for_run

    return prepare_for_run(config)


def assert_mfu_as_documented(records: list[dict], summary: dict, output: str) -> None:
    """MFU as docs/running.md promises it, on any CPU of this kind: a number in (0, 1] at every step, or null
    everywhere with `mfu_unknown` saying why (e.g. an AVX2-only CPU whose understated clock puts the computed peak
    below what the matmul probe measures), and the log saying which."""
    values = [r["mfu"] for r in records] + [summary["mfu"]]
    if summary["mfu"] is None:
        assert isinstance(summary["mfu_unknown"], str) and summary["mfu_unknown"], summary
        assert "MFU is unknown" in output or "MFU unknown" in output, "the log says why MFU is withheld"
        assert all(v is None or 0 < v <= 1 for v in values), values
    else:
        assert all(isinstance(v, float) and 0 < v <= 1 for v in values), values
        assert summary["mfu_unknown"] is None and "MFU is measured against" in output
    assert all(r["tflops_per_device"] > 0 for r in records) and summary["train_tflops_per_device"] > 0


def tiny_overrides(
    sst2: Path, cache_dir: Path, task: str = "classification", family: str = "gptj", **extra
) -> list[str]:
    """A short fp32 run of a family's tiny model on real SST-2: what parity tests compare. No hf/ export (it costs
    ~2 s per run) unless a test asks for one with export="true"; MFU against a given CPU peak instead of each
    rank's 0.5 s matmul probe (test_speed checks the probe; `make gptj-tp` end to end runs it)."""
    base = {
        "size": "tiny",
        "task": task,
        "data_dir": sst2,
        "cache_dir": cache_dir,
        "precision": "fp32",
        "max_steps": 6,
        "batch_size": 16,
        # 32, not 64 for classification (until 2026-11-29): SST-2's rows average under 20 tokens, but the one
        # evaluation batch of 128 dev rows is as long as its longest (58 tokens), and at 64 it cost a tiny run more
        # than its 6 training steps (0.15-0.3 CPU-s against 0.09 at 32; one-process launches 457 -> 343 CPU-s)
        "max_length": 32,
        "eval_batch_size": 128,
        "log_every": 1,
        "export": "false",
        "peak_tflops": 0.1,
        # Lengths in steps of 8 (data.pad_to_multiple_of): SST-2's short rows give a tiny run 5-6 distinct lengths,
        # and each costs every tensor-parallel rank DTensor's sharding propagation of every operator again (still a
        # fifth of a TP=2 GPT-J rank's CPU at 8, measured without a profiler; 3.3 -> 2.6 CPU-s a launch).
        # test_parity's `tp2_longest` row keeps the default (1).
        "pad_to_multiple_of": 8,
    }
    if task != "classification":  # a language model's loss in chunks of 48 tokens: several per slice, a ragged last
        base["loss_chunk_tokens"] = 48
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()] + no_dropout(family)


# Every key a dev evaluation can write into summary.json (metrics.metric_keys of any metric, and perplexity), and
# how closely it must match one process's. A rank statistic moves in steps: two predictions one fp32 rounding apart
# (a barely trained regression head's cluster within a thousandth) tie or swap under another layout, which moves
# Spearman's rho by up to 12 / (n (n + 1)), 7e-4 for 128 dev rows, while the values and mse agree to 1e-6.
DEV_METRICS = ("accuracy", "f1", "macro_f1", "matthews_correlation", "pearson", "spearmanr", "mse", "perplexity")
METRIC_TOLERANCE = {"spearmanr": {"abs": 1e-3}}


def assert_trains_like(run: Run, reference: Run, task: str, tolerance: float = 1e-5) -> float:
    """The project's promise, checked: the same loss at every step (within `tolerance`) and the same dev metrics
    as the single-process `reference`. Returns the largest loss difference."""
    assert len(run.losses) == len(reference.losses) >= 5
    differences = [abs(a - b) for a, b in zip(run.losses, reference.losses)]
    assert max(differences) < tolerance, f"loss differences {differences}"
    # The loss must actually move, or equal trajectories would prove nothing.
    assert reference.losses[0] != reference.losses[-1]
    # Evaluation: every dev row scored once, whatever the layout; every metric of the task (metrics.metric_keys).
    metrics = [key for key in reference.summary if key.removeprefix("mismatched_") in DEV_METRICS]
    assert metrics and (task == "classification" or metrics == ["perplexity"]), f"dev metrics {metrics}"
    for key in metrics:
        close = METRIC_TOLERANCE.get(key.removeprefix("mismatched_"), {"rel": 1e-5})
        assert run.summary[key] == pytest.approx(reference.summary[key], nan_ok=True, **close), key
    assert run.summary["eval_loss"] == pytest.approx(reference.summary["eval_loss"], abs=tolerance)
    assert_one_line_per_event(run)
    return max(differences)


def assert_one_line_per_event(run: Run) -> None:
    """What a run prints, on any layout: each step line (every `log_every` steps, the last, a skipped one) and
    each evaluation line exactly once, from rank 0, with rank 0's values, those of metrics.jsonl and eval.jsonl
    (the loss the pipeline's last stage computed, reduced to every rank; rank 0's throughput). Each rank's output
    is whole in `run.output` (the harness keeps one file per rank), so every rank's copy of a line would count."""
    log_every = yaml.safe_load((run.output_dir / "config.yaml").read_text())["log_every"]
    records = run.records
    total = records[-1]["step"]
    lines = run.output.splitlines()
    printed = [line for line in lines if line.startswith("step ") and " | epoch " in line]
    expected = [
        format_step(r, total) for r in records if r["step"] % log_every == 0 or r["step"] == total or r["skipped"]
    ]
    assert printed == expected, "one step line per logged step, rank 0's values, from one rank"
    evals = [json.loads(line) for line in (run.output_dir / "eval.jsonl").read_text().splitlines()]
    printed = [line for line in lines if line.startswith("eval @ step ")]
    expected = [
        f"eval @ step {e['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items() if k != "step") for e in evals
    ]
    assert printed == expected and expected, "one line per evaluation, rank 0's values, from one rank"
    # a run of fewer than 10 steps is said to be short once, by rank 0 (loop.builder.small_run_warnings)
    short = [line for line in lines if line.startswith(f"the run trains {total} step(s)")]
    assert len(short) == (total < 10), short


@contextlib.contextmanager
def fake_tp_mesh(world_size: int, rank: int):
    """A process group of `world_size` ranks inside this one process, seen from `rank` (torch's fake backend:
    collectives do nothing, shapes and placements are real), and its 1-D tensor-parallel mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


class Payload:
    """What an attacker pickles into a checkpoint's .metadata: a call that runs while it is unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_payload(checkpoint: Path, marker: Path) -> None:
    """Rewrite a DCP .metadata so that unpickling it runs `touch marker` and still returns the real metadata, and
    rewrite the manifest to match, as an attacker who can write the folder would: only the unpickler is left."""
    from parallel_finetune.outputs import integrity

    with open(checkpoint / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # our own file, written by the test
    metadata.__dict__["extra"] = Payload(marker)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    if (checkpoint / integrity.MANIFEST).exists():
        integrity.write_manifest(checkpoint, integrity.describe(checkpoint, integrity.files_in(checkpoint)))


def plant_custom_code(folder, file: str, marker) -> None:
    """An `auto_map` in `file` naming a class of payload.py, which touches `marker` when it is imported."""
    (folder / "payload.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
        "class PayloadConfig(PretrainedConfig):\n    model_type = 'payload'\n"
        "class PayloadTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    content = json.loads((folder / file).read_text())
    if file == "config.json":  # a model type transformers does not know: only the code can load it
        content.update(model_type="payload", auto_map={"AutoConfig": "payload.PayloadConfig"})
    else:  # no tokenizer class of transformers' own
        content.pop("tokenizer_class", None)
        content["auto_map"] = {"AutoTokenizer": ["payload.PayloadTokenizer", None]}
    (folder / file).write_text(json.dumps(content))


@contextlib.contextmanager
def tmpfs(folder: Path, options: str):
    """A tmpfs mounted on `folder` (e.g. "size=30m", "ro,size=1m"), or the test skipped where mounting is not
    allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)])


REWARD_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_reward_model(folder: Path, seed: int = 0) -> Path:
    """A reward model as task=reward exports one, made directly (a run would take a minute): a one-output
    LlamaForSequenceClassification of one tiny layer, random weights (its head scaled up so that scores spread),
    and a byte-level tokenizer of its own (every text tokenizes, none shared with the policy) with a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = REWARD_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        problem_type="regression",
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(50)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
