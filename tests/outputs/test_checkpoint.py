"""Checkpoints: exact resume, resharding across layouts, SIGTERM and torchrun restarts, export, and faults: code in
a checkpoint, corruption, divergence, run folders shared by two runs or by two settings, full disks, stopped ranks.

The reference is one uninterrupted TP=2 run of 10 fp32 steps that checkpoints every 5; every other run must
reproduce its losses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    FAMILIES,
    REPO,
    check,
    launch,
    plant_payload,
    python,
    recipe,
    short_dev,
    subprocess_env,
    tiny_overrides,
    tmpfs,
)
from safetensors.torch import load_file

from parallel_finetune.launch import torchrun_command
from parallel_finetune.outputs import integrity
from parallel_finetune.outputs.checkpoint import resolve_resume
from parallel_finetune.outputs.runfolder import RECORD, RunLock

SIGNAL_WORKER = str(REPO / "tests" / "workers" / "signal_at_step.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def sst2(sst2, tmp_path_factory) -> Path:
    """No test here compares dev metrics: 128 dev rows (conftest.short_dev)."""
    return short_dev(sst2, tmp_path_factory.mktemp("sst2"))


def overrides(sst2, cache_dir, *extra: str, family: str = "gptj") -> list[str]:
    return tiny_overrides(sst2, cache_dir, family=family, max_steps=10) + list(extra)


@pytest.fixture(scope="module")
def reference(sst2, cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2", "checkpoint_every=5"), out)


@pytest.fixture(scope="module")
def sharded_writer(sst2, cache_dir, tmp_path_factory):
    """The same run under FSDP over 2 ranks, checkpointing at step 5."""
    out = tmp_path_factory.mktemp("fsdp-writer")
    return launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=1", "sharding=full", "checkpoint_every=5"), out)


def assert_same_losses(run, reference, first_step: int) -> None:
    records = run.records
    assert [r["step"] for r in records] == list(range(first_step, 11))
    expected = reference.losses[first_step - 1 :]
    differences = [abs(a - b) for a, b in zip(run.losses, expected)]
    assert max(differences) < TOLERANCE, differences


def test_reference_keeps_the_newest_checkpoints(reference):
    assert sorted(p.name for p in (reference.output_dir / "checkpoints").iterdir()) == [
        RECORD,
        "step-00000005",
        "step-00000010",
    ]
    assert reference.losses[0] != reference.losses[-1]


@pytest.mark.parametrize(
    "name,nproc,layout",
    [
        ("tp2", 2, ["tensor_parallel_degree=2"]),
        ("single_process", 1, []),
        ("optimizer_dp2", 2, ["tensor_parallel_degree=1", "sharding=optimizer"]),
        ("full_dp2_tp2", 4, ["tensor_parallel_degree=2", "sharding=full"]),
        ("pp2_tp2", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
    ],
)
def test_resume_from_tp2_checkpoint_under_any_layout(name, nproc, layout, reference, sst2, cache_dir, tmp_path):
    step5 = reference.output_dir / "checkpoints" / "step-00000005"
    run = launch(nproc, overrides(sst2, cache_dir, f"resume={step5}", *layout), tmp_path / name)
    assert_same_losses(run, reference, 6)
    assert run.summary["resumed_from"] == str(step5)
    if name == "tp2":  # the same layout continues bit for bit
        assert run.losses == reference.losses[5:]


def test_fsdp_checkpoint_resumes_under_tp2(sharded_writer, reference, sst2, cache_dir, tmp_path):
    assert_same_losses(sharded_writer, reference, 1)
    step5 = sharded_writer.output_dir / "checkpoints" / "step-00000005"
    run = launch(2, overrides(sst2, cache_dir, f"resume={step5}", "tensor_parallel_degree=2"), tmp_path / "tp2")
    assert_same_losses(run, reference, 6)


@pytest.mark.parametrize(
    "family,task,layers",
    [
        ("gptj", "classification", "n_layer"),
        ("gpt2", "causal_lm", "n_layer"),
        ("qwen3", "causal_lm", "num_hidden_layers"),  # made from transformers' plans; tied, q/k norms, GQA
    ],
)
def test_pipeline_checkpoint_resumes_under_tp2(family, task, layers, sst2, cache_dir, tmp_path):
    """Stages write their own blocks under the unsplit names (GPT-2's and Qwen 3's tied embedding from both ends):
    a checkpoint of a PP=2 run is an ordinary checkpoint that TP=2 continues."""
    model = [f"model_config.{layers}=4", f"task={task}"]
    pipeline = launch(
        2,
        overrides(
            sst2,
            cache_dir,
            "tensor_parallel_degree=1",
            "pipeline_parallel_degree=2",
            "checkpoint_every=5",
            *model,
            family=family,
        ),
        tmp_path / "pp2",
        recipe=recipe(family),
    )
    step5 = pipeline.output_dir / "checkpoints" / "step-00000005"
    run = launch(
        2,
        overrides(sst2, cache_dir, f"resume={step5}", "tensor_parallel_degree=2", *model, family=family),
        tmp_path / "tp2",
        recipe=recipe(family),
    )
    assert_same_losses(run, pipeline, 6)


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(reference, sst2, cache_dir, tmp_path):
    out = tmp_path / "run"
    env = {"SIGNAL_NAME": "SIGTERM", "SIGNAL_RANK": "1", "SIGNAL_STEP": "4"}  # one rank only: all must agree
    stopped = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2"), out, script=SIGNAL_WORKER, env=env)
    assert stopped.returncode == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [RECORD, "step-00000004"]
    assert [r["step"] for r in stopped.records] == [1, 2, 3, 4]
    resumed = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2"), out)  # resume=auto, same folder
    assert resumed.losses == reference.losses, "metrics.jsonl reads as one uninterrupted run"


def test_killed_rank_restarts_from_the_last_checkpoint(reference, sst2, cache_dir, tmp_path):
    # the late restart: torchrun keeps its store across attempts, so peers must not find the dead rank's address
    env = {"SIGNAL_NAME": "SIGKILL", "SIGNAL_RANK": "1", "SIGNAL_STEP": "7", "LATE_RANK": "1", "LATE_BY_S": "5"}
    run = launch(
        2,
        overrides(sst2, cache_dir, "tensor_parallel_degree=2", "checkpoint_every=3"),
        tmp_path / "run",
        script=SIGNAL_WORKER,
        env=env,
        torchrun_args=("--max-restarts=1",),
    )
    assert "resumed from" in run.output and "step-00000006" in run.output
    assert run.losses == reference.losses
    assert run.summary["final_loss"] == reference.summary["final_loss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_from_a_checkpoint_equals_the_run_export(family, sst2, cache_dir, tmp_path):
    run = launch(
        2,
        tiny_overrides(sst2, cache_dir, family=family, max_steps=2, export="true") + ["tensor_parallel_degree=2"],
        tmp_path / "run",
        recipe=recipe(family),
    )
    out = tmp_path / "exported"
    proc = python("scripts/export_hf.py", str(run.output_dir / "checkpoints"), str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs = load_file(run.output_dir / "hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert ours[name].equal(theirs[name]), name


def test_incomplete_or_corrupt_checkpoints_are_skipped(reference, tmp_path, caplog):
    root = tmp_path / "checkpoints"
    shutil.copytree(reference.output_dir / "checkpoints", root)
    shutil.copytree(root / "step-00000010", root / "step-00000011")
    (root / "step-00000011" / ".metadata").unlink()  # the shards never finished
    (root / "step-00000010" / "trainer_state.json").write_text('{"ste')  # a torn write
    assert resolve_resume("auto", root) == root / "step-00000005"
    assert "skipping checkpoint" in caplog.text and "step-00000011: no DCP .metadata" in caplog.text
    assert "step-00000010: trainer_state.json unreadable" in caplog.text


def test_a_checkpoint_of_another_model_is_refused(reference, sst2, cache_dir, tmp_path):
    step5 = reference.output_dir / "checkpoints" / "step-00000005"
    run = launch(
        1, overrides(sst2, cache_dir, f"resume={step5}", "model_config.n_inner=256"), tmp_path / "run", check=False
    )
    assert run.returncode != 0
    assert run.output.count("error: checkpoint ") == 1
    assert (
        "holds another model: parameter 'transformer.h.0.mlp.fc_in.weight' is [512, 128] there, [256, 128] here"
        in run.output
    )


def test_check_refuses_resuming_into_another_model(reference, sst2, cache_dir):
    """What the run above refuses after building the model, `--check` refuses first, from the checkpoint's config."""
    step5 = reference.output_dir / "checkpoints" / "step-00000005"
    checked = check(*overrides(sst2, cache_dir, f"resume={step5}", "model_config.n_inner=256"), nproc=1)
    assert checked.returncode == 2 and checked.stderr.count("\n") == 1, checked.stderr
    assert (
        f"error: checkpoint {step5} was trained with other settings: model_config {{}} -> {{'n_inner': 256}}"
        in checked.stderr
    )


def test_resume_path_must_exist(sst2):
    proc = python(
        "-m",
        "parallel_finetune.train",
        "--check",
        str(REPO / "recipes" / "gptj" / "tp.yaml"),
        "size=tiny",
        f"data_dir={sst2}",
        "resume=/no/such/checkpoint",
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: resume='/no/such/checkpoint': no such checkpoint folder (valid: auto, none, or a step-… folder)"
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 30 MB file system: room for one tiny GPT-J checkpoint (17 MB of shards), not for a second."""
    with tmpfs(tmp_path / "small", "size=30m") as mount:
        yield mount


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_disk, reference, sst2, cache_dir, tmp_path):
    run = launch(1, overrides(sst2, cache_dir, "checkpoint_every=5", f"checkpoint_dir={small_disk}"), tmp_path / "run")
    line = next(line for line in run.output.splitlines() if "checkpoint at step 10 not written" in line)
    warning = line[line.index("checkpoint at step 10") :]  # after the progress bar's last redraw
    assert warning.startswith("checkpoint at step 10 not written (No space left on device (0 bytes free under ")
    assert len(warning) < 400, warning  # not 1,400 characters of tuples
    assert sorted(p.name for p in small_disk.iterdir()) == [RECORD, "step-00000005"]
    assert resolve_resume("auto", small_disk) == small_disk / "step-00000005"
    assert len(run.losses) == 10  # training went on
    state = json.loads((small_disk / "step-00000005" / "trainer_state.json").read_text())
    assert state["step"] == 5


def export_hf(checkpoint, out, answer: str | None = None) -> subprocess.CompletedProcess:
    """scripts/export_hf.py (forked); `answer`: what stdin holds for a question (none should be asked)."""
    return python("scripts/export_hf.py", str(checkpoint), str(out), input=answer, timeout=300)


def assert_one_error(output: str, message: str) -> None:
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], output[-3000:]
    assert "parallel_finetune/" not in output, "no traceback through our code, only torchrun's own report"


def copy_step5(reference, folder):
    return shutil.copytree(reference.output_dir / "checkpoints" / "step-00000005", folder / "step-00000005")


@pytest.fixture
def copied_run(reference, tmp_path):
    """The reference run's folder (checkpoints at steps 5 and 10, metrics, config) to continue or damage."""
    return shutil.copytree(reference.output_dir, tmp_path / "run")


def test_a_checkpoint_whose_metadata_runs_code_is_refused(reference, sst2, cache_dir, tmp_path):
    """A .metadata pickle that runs a payload (and then returns the real metadata), with a manifest to match."""
    step5 = copy_step5(reference, tmp_path)
    marker = tmp_path / "payload-ran"
    plant_payload(step5, marker)
    message = "asks to load posix.system, which DCP metadata never holds; refusing to read it"
    run = launch(
        2, overrides(sst2, cache_dir, f"resume={step5}", "tensor_parallel_degree=2"), tmp_path / "run", check=False
    )
    assert run.returncode != 0
    assert_one_error(run.output, message)
    exported = export_hf(step5, tmp_path / "hf")
    assert exported.returncode == 2 and exported.stderr.count("\n") == 1 and message in exported.stderr
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_tokenizer_asking_for_custom_code_is_refused_by_export(reference, tmp_path):
    """tokenizer/tokenizer_config.json with an auto_map and its payload, the manifest rewritten to match: export_hf.py
    refuses in one line with "y" waiting on stdin, the payload never runs and no hf/ (which would carry it) is
    written."""
    from conftest import plant_custom_code

    step5 = copy_step5(reference, tmp_path)
    marker = tmp_path / "payload-ran"
    plant_custom_code(step5 / "tokenizer", "tokenizer_config.json", marker)
    integrity.write_manifest(step5, integrity.describe(step5, integrity.files_in(step5)))
    exported = export_hf(step5, tmp_path / "hf", answer="y\n")
    message = f"{step5 / 'tokenizer' / 'tokenizer_config.json'} asks for custom code (auto_map: "
    assert exported.returncode == 2 and exported.stderr.count("\n") == 1 and message in exported.stderr, exported
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "hf").exists()
    assert not [path for path in reference.output_dir.rglob("*.py")], "a run never writes code"


def overwrite_inside(checkpoint, prefix: str) -> str:
    """4 KiB of 0xff (NaN as fp32) in the middle of the largest tensor whose name starts with `prefix`: the
    file keeps its size, only its content changes."""
    metadata = integrity.read_metadata(checkpoint / ".metadata")
    index, where = max(
        ((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith(prefix)), key=lambda pair: pair[1].length
    )
    with open(checkpoint / where.relative_path, "r+b") as handle:
        handle.seek(where.offset + where.length // 2)
        handle.write(b"\xff" * 4096)
    return where.relative_path


def test_flipped_bytes_in_weights_or_moments_are_found_at_resume_and_export(reference, sst2, cache_dir, tmp_path):
    weights, moments = copy_step5(reference, tmp_path / "weights"), copy_step5(reference, tmp_path / "moments")
    damaged = {
        folder: overwrite_inside(folder, prefix)
        for folder, prefix in [
            (weights, "model.transformer.wte"),
            (moments, "optimizer.transformer.h.0.mlp.fc_in.weight.exp_avg"),
        ]
    }
    for folder, shard in damaged.items():
        exported = export_hf(folder, tmp_path / f"hf-{folder.parent.name}")
        assert exported.returncode == 2, exported.stderr[-2000:]
        assert exported.stderr.strip() == (
            f"error: checkpoint '{folder}' is not a usable checkpoint: {shard} does not "
            "match its sha256 in the manifest (corrupted or modified)"
        )
    run = launch(
        2, overrides(sst2, cache_dir, f"resume={moments}", "tensor_parallel_degree=2"), tmp_path / "run", check=False
    )
    assert run.returncode != 0
    assert_one_error(
        run.output, f"resume='{moments}' is not a usable checkpoint: {damaged[moments]} does not match its sha256"
    )
    assert not (tmp_path / "run" / "checkpoints").exists(), "nothing trained from the damaged moments"


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(copied_run, reference, sst2, cache_dir):
    shard = copied_run / "checkpoints" / "step-00000010" / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    run = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2", "checkpoint_every=5"), copied_run)
    skipped = [line for line in run.output.splitlines() if line.startswith("skipping checkpoint")]
    assert skipped == [
        f"skipping checkpoint {copied_run / 'checkpoints' / 'step-00000010'}: __1_0.distcp is "
        f"{size // 2:,} bytes, the manifest says {size:,} (truncated or overwritten); trying the one "
        "before"
    ], run.output[-3000:]
    assert run.summary["resumed_from"] == str(copied_run / "checkpoints" / "step-00000005")
    assert run.losses == reference.losses  # steps 6-10 again, exactly


def test_a_diverging_run_stops_and_writes_no_nan(sst2, cache_dir, tmp_path):
    """lr=inf is refused by the config (tests/test_cli.py); a finite but absurd one diverges: weights ~1e30 after
    step 2, a NaN loss from step 3."""
    run = launch(
        1,
        overrides(sst2, cache_dir, "lr=1e30", "checkpoint_every=1", "max_nonfinite_steps=2", "export=true"),
        tmp_path / "run",
        check=False,
    )
    assert run.returncode != 0
    assert_one_error(
        run.output,
        "training diverged: loss nan, grad_norm nan at step 4, non-finite for 2 steps in a "
        "row (steps 3-4; max_nonfinite_steps=2)",
    )
    assert "checkpoint at step 3 not written: the loss or gradient norm of step 3 was not finite" in run.output
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        RECORD,
        "step-00000001",
        "step-00000002",
    ]
    assert not (tmp_path / "run" / "hf").exists() and not (tmp_path / "run" / "summary.json").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True]  # step 4 stopped the run before its record


def test_a_second_run_into_a_busy_folder_is_refused(sst2, cache_dir, tmp_path):
    out = tmp_path / "run"
    first = RunLock([out])
    first.acquire()  # a run in progress, as far as the folder can tell
    try:
        refusal = f"{out} is in use by another run (pid {os.getpid()} on "
        checked = check("size=tiny", f"output_dir={out}")
        assert checked.returncode == 2 and checked.stderr.startswith(f"error: {refusal}"), checked.stderr
        run = launch(2, overrides(sst2, cache_dir), out, check=False)
        assert run.returncode != 0
        assert_one_error(run.output, refusal)
        assert sorted(p.name for p in out.iterdir()) == [".run.lock"], "the second run wrote nothing"
    finally:
        first.release()


def test_continuing_with_another_lr_is_refused(copied_run, sst2, cache_dir):
    config = (copied_run / "config.yaml").read_text()
    step10 = copied_run / "checkpoints" / "step-00000010"
    message = f"checkpoint {step10} was trained with other settings: lr 0.001 -> 0.002, seed 42 -> 7; a continued run"
    checked = check(*overrides(sst2, cache_dir, "lr=2e-3", "seed=7"), f"output_dir={copied_run}", nproc=1)
    assert checked.returncode == 2 and message in checked.stderr, checked.stderr
    run = launch(1, overrides(sst2, cache_dir, "lr=2e-3", "seed=7"), copied_run, check=False)
    assert run.returncode != 0
    assert_one_error(run.output, message)
    assert (copied_run / "config.yaml").read_text() == config, "the old run's settings stay on record"
    longer = check(*overrides(sst2, cache_dir, "max_steps=20", "log_every=5"), f"output_dir={copied_run}", nproc=1)
    assert longer.returncode == 0, longer.stderr  # more steps and another cadence: a continuation


def test_overwrite_replaces_the_previous_run(copied_run, sst2, cache_dir):
    (copied_run / "notes.txt").write_text("mine")
    run = launch(1, overrides(sst2, cache_dir, "overwrite=true", "resume=none", "max_steps=3"), copied_run)
    assert (
        f"overwrite=true: deleted the previous run's config.yaml, labels.json, metrics.jsonl, eval.jsonl, "
        f"tensorboard, summary.json, 2 checkpoint(s) in {copied_run / 'checkpoints'} from {copied_run}"
    ) in run.output
    assert sorted(p.name for p in (copied_run / "checkpoints").iterdir()) == [RECORD, "step-00000003"]
    assert [r["step"] for r in run.records] == [1, 2, 3] and run.summary["steps"] == 3
    assert (copied_run / "notes.txt").read_text() == "mine"


def test_export_to_a_full_disk_leaves_no_partial_hf(sst2, cache_dir, tmp_path):
    with tmpfs(tmp_path / "full", "size=4m") as out:  # room for the logs, not for 23 MB of weights
        run = launch(
            1,
            overrides(sst2, cache_dir, "max_steps=2", "export=true", f"checkpoint_dir={tmp_path / 'checkpoints'}"),
            out,
            check=False,
        )
        assert run.returncode != 0
        assert_one_error(run.output, f"export to {out / 'hf'} failed (")
        assert "No space left on device" in run.output
        assert sorted(p.name for p in out.iterdir()) == [
            RECORD,
            "config.yaml",
            "eval.jsonl",
            "labels.json",
            "metrics.jsonl",
            "tensorboard",
        ]
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()  # the trained model is safe in its checkpoint


def test_export_hf_names_its_own_argument(tmp_path):
    proc = export_hf(tmp_path / "no-such", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: checkpoint '{tmp_path / 'no-such'}': no such checkpoint folder (valid: a "
        "step-… folder, or a folder of them)"
    )


def test_a_stopped_rank_ends_the_run_after_collective_timeout_s(sst2, cache_dir, tmp_path):
    env = {"SIGNAL_NAME": "SIGSTOP", "SIGNAL_RANK": "1", "SIGNAL_STEP": "3"}
    run = launch(
        2,
        overrides(sst2, cache_dir, "tensor_parallel_degree=2", "collective_timeout_s=10"),
        tmp_path / "run",
        script=SIGNAL_WORKER,
        env=env,
        check=False,
        timeout=300,
    )
    assert run.returncode != 0
    assert_one_error(
        run.output,
        "error: after step 2: rank 0 waited collective_timeout_s=10 s in a collective for another rank that never came",
    )


# ------------------------------------------------------------------------------------------------------------------
# Issue 26 (checkpoints): signals to real torchrun's launcher, and a launcher killed outright.


def train_until_it_trains(launcher: list[str], out, sst2, cache_dir) -> subprocess.Popen:
    """A long one-rank run under `launcher` (a torchrun command), its output in out.log, returned once a step is
    done."""
    command = [*launcher, str(REPO / "scripts" / "train.py"), str(recipe("gptj")), f"output_dir={out}"]
    command += overrides(sst2, cache_dir, "max_steps=100000", "tensor_parallel_degree=1")
    with open(out.with_suffix(".log"), "w") as log:  # the run writes to its own copy of the file
        proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
        assert proc.poll() is None and time.monotonic() < deadline, out.with_suffix(".log").read_text()[-3000:]
        time.sleep(0.2)
    return proc


def running(pid: int) -> bool:
    """Whether `pid` runs (an exited process nobody reaped is a zombie: not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("name,code", [("SIGTERM", 0), ("SIGINT", 130)])
def test_a_signal_to_the_launcher_ends_as_documented(name, code, sst2, cache_dir, tmp_path):
    """SIGTERM (docker stop, a spot interruption): a checkpoint and exit code 0; Ctrl-C: one line and 130. Not
    torchrun's SignalException traceback, nor one from each rank."""
    out = tmp_path / "run"
    launcher = [sys.executable, "-m", "parallel_finetune.launch", "--standalone", "--nproc_per_node=1"]
    proc = train_until_it_trains(launcher, out, sst2, cache_dir)
    proc.send_signal(getattr(signal, name))
    assert proc.wait(timeout=120) == code
    output = out.with_suffix(".log").read_text()
    assert "Traceback" not in output and "error:" not in output, output[-3000:]
    folder = out / "checkpoints"
    checkpoints = sorted(p.name for p in folder.iterdir() if p.name != RECORD) if folder.exists() else []
    if name == "SIGTERM":
        assert "as asked (SIGTERM); resume=auto continues from the checkpoint" in output and len(checkpoints) == 1
    else:
        assert output.count("interrupted (SIGINT) after step ") == 1 and checkpoints == []


def test_a_worker_whose_launcher_is_killed_checkpoints_and_exits(sst2, cache_dir, tmp_path):
    """kill -9 of torchrun: its worker notices, checkpoints and exits as on SIGTERM, instead of training on for
    hours holding the run folder's lock (and its GPUs)."""
    out = tmp_path / "run"
    proc = train_until_it_trains(torchrun_command(1), out, sst2, cache_dir)
    worker = json.loads((out / ".run.lock").read_text())["pid"]  # rank 0 holds the lock
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    try:
        while running(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(worker), "the worker trains on without its launcher"
    finally:
        if running(worker):
            os.kill(worker, signal.SIGKILL)
    assert "as asked (SIGTERM); resume=auto continues from the checkpoint" in out.with_suffix(".log").read_text()
    assert len(list((out / "checkpoints").glob("step-*"))) == 1
    lock = RunLock([out])
    lock.acquire()  # free again
    lock.release()
