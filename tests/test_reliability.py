"""The safety nets in one process: DCP metadata read without running code, the checkpoint manifest, what else resume
checks (trainer_state.json's fields, the data, pickles in tensor and RNG files, NaN), Ctrl-C, the run-folder lock
(busy, stale after SIGKILL, file systems without flock), the non-finite guard's counting, and launcher messages
naming the real flags. Their torchrun counterparts are in test_checkpoint.py and test_cli.py."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import test_units
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, Payload, check, launch, plant_custom_code, plant_payload, tiny_overrides
from test_units import config as unit_config
from test_units import training_state
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from parallel_finetune.errors import UserError
from parallel_finetune.loop.divergence import NonFiniteGuard
from parallel_finetune.outputs import checkpoint as checkpointing
from parallel_finetune.outputs import integrity
from parallel_finetune.outputs.runfolder import LOCK, RECORD, RUN_OUTPUTS, RunLock
from parallel_finetune.resolve import load_config


@pytest.fixture
def checkpoint(tmp_path):
    """A small DCP folder with its manifest, as checkpoint.save writes them."""
    folder = tmp_path / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in one process"
        dcp.save({"weight": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=folder)
    integrity.write_manifest(folder, integrity.describe(folder, integrity.files_in(folder)))
    return folder


def test_metadata_with_a_payload_is_refused_and_never_runs(checkpoint, tmp_path):
    assert integrity.read_metadata(checkpoint / ".metadata").storage_data  # DCP's own metadata loads
    marker = tmp_path / "payload-ran"
    plant_payload(checkpoint, marker)
    with pytest.raises(UserError, match=r"\.metadata asks to load posix\.system, which DCP metadata never holds"):
        integrity.read_metadata(checkpoint / ".metadata")
    with pytest.raises(CheckpointException, match="asks to load posix.system"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own load goes through the same reader (defence in depth)
        dcp.load({"weight": torch.zeros(4096)}, storage_reader=integrity.SafeReader(checkpoint))
    assert not marker.exists()
    pickle.loads((checkpoint / ".metadata").read_bytes())  # what DCP's own reader does: the payload runs
    assert marker.exists(), "the planted payload is real"


def test_manifest_catches_flipped_truncated_and_added_files(checkpoint):
    assert integrity.verify(checkpoint) is None
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[100:104] = b"\xff\xff\xff\xff"
    shard.write_bytes(bytes(data))
    assert integrity.verify(checkpoint, contents=False) is None  # same size: only the hash can tell
    assert (
        integrity.verify(checkpoint)
        == f"{shard.name} does not match its sha256 in the manifest (corrupted or modified)"
    )
    shard.write_bytes(bytes(data[:1000]))
    assert "is 1,000 bytes, the manifest says" in integrity.verify(checkpoint, contents=False)
    (checkpoint / "extra.bin").write_bytes(b"x")
    assert integrity.verify(checkpoint, contents=False).startswith("extra.bin is not in the manifest")
    (checkpoint / integrity.MANIFEST).unlink()
    assert integrity.verify(checkpoint).startswith("no manifest.json")


def test_hashing_is_shared_between_ranks(checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-4] + b"abcd")
    found = [integrity.verify(checkpoint, (rank, 2)) for rank in range(2)]
    assert sum(problem is not None for problem in found) == 1, found  # exactly one rank hashed the shard


def test_the_first_nonfinite_tensor_is_named_in_the_state_dicts_order():
    """What a save refuses: the first floating tensor, depth first, holding a NaN or an inf, whatever its dtype (the
    largest magnitudes are taken per dtype in one pass); empty and integer tensors are skipped, large finite bf16
    values are not mistaken for an overflow."""
    state = {
        "model": {"w": torch.randn(3, 4), "empty": torch.zeros(0), "steps": torch.arange(3)},
        "optimizer": {"exp_avg": torch.full((2,), 3.0e38, dtype=torch.bfloat16), "exp_avg_sq": torch.ones(5)},
    }
    assert integrity.nonfinite(state) is None and integrity.nonfinite({}) is None
    state["optimizer"]["exp_avg_sq"][4] = float("nan")
    assert integrity.nonfinite(state) == "optimizer.exp_avg_sq"
    state["optimizer"]["exp_avg"][0] = -float("inf")
    assert integrity.nonfinite(state) == "optimizer.exp_avg"
    state["model"]["w"][2, 3] = float("inf")
    assert integrity.nonfinite(state) == "model.w"


def test_a_checkpoint_of_the_same_step_is_replaced_not_refused(tmp_path):
    """Resuming from an older checkpoint of the same folder writes its later steps again: the rename used to fail
    with "Directory not empty" and leave the old trajectory's checkpoint in place."""
    from parallel_finetune.outputs.checkpoint import replace_folder

    old, new = tmp_path / "step-00000010", tmp_path / ".tmp-step-00000010"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / "trainer_state.json").write_text(text)
    replace_folder(new, old)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000010"]
    assert (old / "trainer_state.json").read_text() == "new"


def test_a_busy_folder_is_refused_naming_its_holder(tmp_path):
    first = RunLock([tmp_path / "run"])
    first.acquire()
    with pytest.raises(
        UserError,
        match=rf"run is in use by another run \(pid {os.getpid()} on .*started .*\); "
        "wait for it to end, or choose another output_dir",
    ):
        RunLock([tmp_path / "run"]).acquire()
    first.release()
    assert not (tmp_path / "run").exists(), "a run that wrote nothing leaves no folder"
    RunLock([tmp_path / "run"]).acquire()


def test_the_lock_of_a_killed_run_does_not_block(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from "
            "parallel_finetune.outputs.runfolder import RunLock; lock = RunLock([Path(sys.argv[1])]); "
            "lock.acquire(); print('held', flush=True); time.sleep(600)",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match="in use by another run"):
        RunLock([tmp_path / "run"]).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "run" / LOCK).is_file()  # left behind, as after any SIGKILL
    RunLock([tmp_path / "run"]).acquire()


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    RunLock([folder]).acquire()  # stale: that process is gone
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (folder / LOCK).write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname()}))
        with pytest.raises(UserError, match="in use by another run"):
            RunLock([folder]).acquire()
        (folder / LOCK).write_text(json.dumps({"pid": 1, "host": "another-node"}))
        with pytest.raises(UserError, match=f"if that run is over, delete {folder / LOCK}"):
            RunLock([folder]).acquire()
    finally:
        alive.kill()


def test_nonfinite_steps_are_skipped_and_stop_the_run():
    guard = NonFiniteGuard(limit=3, lr=1e30)
    assert guard.skip(1, 0.7, 2.0, None) is False
    assert guard.skip(2, float("nan"), float("nan"), None) is True
    assert guard.skip(3, 0.7, float("inf"), None) is True
    assert guard.skip(4, 0.7, 2.0, None) is False  # a finite step resets the count
    assert guard.skip(5, float("nan"), 1.0, None) and guard.skip(6, float("nan"), 1.0, None)
    with pytest.raises(
        UserError,
        match=r"training diverged: loss nan, grad_norm 1 at step 7, non-finite for 3 "
        r"steps in a row \(steps 5-7; max_nonfinite_steps=3\).*lr \(now 1e\+30\)",
    ):
        guard.skip(7, float("nan"), 1.0, None)


def test_fp16_overflows_count_only_once_the_scale_is_down_to_one():
    guard = NonFiniteGuard(limit=2, lr=1e-3)
    for step in range(1, 20):  # the scaler's business: skip, halve, try again
        assert guard.skip(step, 0.7, float("inf"), 2.0 ** (20 - step)) is True
    assert guard.skip(20, 0.7, float("inf"), 1.0) is True
    with pytest.raises(UserError, match="training diverged"):
        guard.skip(21, 0.7, float("inf"), 0.5)
    with pytest.raises(UserError, match="training diverged"):  # a NaN loss: no scale fixes the forward pass
        NonFiniteGuard(1, 1e-3).skip(1, float("nan"), float("nan"), 65536.0)


def test_sagemaker_settings_name_the_flags(monkeypatch):
    from parallel_finetune.sagemaker_job import JobSettings

    for name in ("SAGEMAKER_ROLE", "SAGEMAKER_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with pytest.raises(
        UserError,
        match=r"no SageMaker role: pass --role \(in a notebook: ROLE\) or set "
        r"\$SAGEMAKER_ROLE",
    ):
        JobSettings().resolve()


# ---------------------------------------------------------------------------------------------------------------
# Issue 26, inputs: recipes and overrides are data (no YAML aliases; path keys taken as written), data files and
# their rows and words are bounded, --check counts and collective_timeout_s are in range.


def test_yaml_anchors_and_aliases_are_refused_before_they_expand(tmp_path):
    from parallel_finetune.resolve import load_config

    # A "billion laughs" whose expansion is only 10^4 leaves here, so the test stays short without the refusal;
    # at 9 levels of 9 it is 387 million and loading never ended.
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 5)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("family: gptj\nmodel_config:\n" + "".join(f"  {level}\n" for level in levels))
    with pytest.raises(UserError, match=r"bomb\.yaml line 3: YAML anchor &a0 is not accepted \(recipes are plain data"):
        load_config(bomb)
    (tmp_path / "alias.yaml").write_text("family: gptj\nlr: *x\n")
    with pytest.raises(UserError, match=r"alias\.yaml line 2: YAML alias \*x is not accepted"):
        load_config(tmp_path / "alias.yaml")
    with pytest.raises(UserError, match=r"override 'model_config=\{a: &x \[1\], b: \*x\}': line 1: YAML anchor &x"):
        load_config(REPO / "recipes" / "gptj" / "tp.yaml", ["model_config={a: &x [1], b: *x}"])


@pytest.mark.parametrize("value", ["/tmp/x/run #2", "/tmp/x/first\nsecond", "~", "null", "None", "true", "2024"])
def test_string_key_overrides_are_taken_as_written(value):
    from parallel_finetune.resolve import load_config

    recipe = REPO / "recipes" / "gptj" / "tp.yaml"
    keys = ("output_dir", "checkpoint_dir", "data_dir", "cache_dir", "model", "tokenizer", "revision", "resume")
    for key in keys:
        assert load_config(recipe, [f"{key}={value}"]).value(key) == value
    assert load_config(recipe, [f"output.output_dir={value}"]).output_dir == value
    assert load_config(recipe, ["data_dir=/data/sst2", "data_dir="]).data_dir is None  # empty: back to null


def test_string_keys_in_a_recipe_follow_yaml_quoting(tmp_path):
    from parallel_finetune.resolve import load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text('family: gptj\noutput_dir: "runs/run #2"\nrevision: "2024"\n')
    assert (load_config(recipe).output_dir, load_config(recipe).revision) == ("runs/run #2", "2024")
    recipe.write_text("family: gptj\nrevision: 2024\n")
    with pytest.raises(UserError, match=r"revision=2024 is not valid; .*unquoted value as int; quote it"):
        load_config(recipe)


@pytest.mark.parametrize("value", ["1e300", "1e-9", "0", "604801"])
def test_collective_timeout_outside_its_range_is_refused(value):
    from parallel_finetune.resolve import load_config

    with pytest.raises(UserError, match=r"collective_timeout_s=.* must be in \[1, 604800\] seconds"):
        load_config(REPO / "recipes" / "gptj" / "tp.yaml", [f"collective_timeout_s={value}"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nproc", "0"], "--nproc 0 is not a number of processes; give 1 or more"),
        (["--nproc", "-2"], "--nproc -2 is not a number of processes"),
        (["--nproc", "2", "--nnodes", "0"], "--nnodes 0 is not a number of nodes"),
    ],
)
def test_check_refuses_process_counts_below_one(flags, message, tmp_path, capsys):
    from parallel_finetune.train import main

    recipe = str(REPO / "recipes" / "gptj" / "tp.yaml")
    overrides = ["size=tiny", f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}"]
    assert main(["--check", *flags, recipe, *overrides]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines


def test_a_data_file_too_large_for_memory_is_refused_before_it_is_read(tmp_path):
    import resource

    from parallel_finetune.data.prepare import read_glue_dir

    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    big = tmp_path / "train.tsv"
    with open(big, "wb") as file:
        file.truncate(20 * 2**30)  # sparse: no disk, but reading it would take 20 GiB of memory
    # A bounded address space, so a read of the whole file fails at once instead of filling the machine's memory.
    used = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize:")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + 4 * 2**30, hard))
    try:
        with pytest.raises(UserError, match=r"train\.tsv: 20\.0 GiB, more than the 1 GiB a data file may have"):
            read_glue_dir(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_long_row_or_word_is_refused_before_tokenizer_training(tmp_path):
    """A tiny model learns its tokenizer from the rows: bounded; a pretrained tokenizer (full size) takes them."""
    from parallel_finetune.config import DataSection, ModelSection, TrainingSection
    from parallel_finetune.data.prepare import MAX_ROW_CHARS, MAX_WORD_CHARS
    from parallel_finetune.tasks import load_task

    def read_glue_dir(folder, size="tiny"):
        data = DataSection(glue_task="sst2", data_dir=str(folder))
        return load_task(data=data, model=ModelSection(size=size), seed=TrainingSection().seed, predict=False)[0]

    (tmp_path / "dev.tsv").write_text("sentence\tlabel\nfine\t1\nbad\t0\n")
    path = tmp_path / "train.tsv"
    word = "ab" * 500_000  # one megabyte "word": learning a BPE on it took hours
    path.write_text(f"sentence\tlabel\na good film\t1\nsee {word} now\t0\n")
    with pytest.raises(UserError) as error:
        read_glue_dir(tmp_path)
    assert str(error.value).startswith(f"{path}:3: 1,000,008 characters, more than the {MAX_ROW_CHARS:,} a row")
    path.write_text(f"sentence\tlabel\na good film\t1\n{'x' * (MAX_WORD_CHARS + 1)} now\t0\n")
    with pytest.raises(UserError, match=r"train\.tsv:3: a word of 1,001 characters \('x{20}'\.\.\.\), more than"):
        read_glue_dir(tmp_path)
    assert read_glue_dir(tmp_path, size="full")["train"]["label"] == [1, 0]
    path.write_text(f"sentence\tlabel\n{'x' * MAX_WORD_CHARS} {'y ' * 40_000}\t1\nok\t0\n")  # at both limits: fine
    assert read_glue_dir(tmp_path)["train"]["label"] == [1, 0]


# ---------------------------------------------------------------- issue 26: what a run deletes, where it exports


def make_record(folder, *names):
    from parallel_finetune.outputs.runfolder import record_written

    folder.mkdir(parents=True, exist_ok=True)
    record_written(folder, *names)


def test_overwrite_deletes_only_what_runs_recorded(tmp_path):
    from parallel_finetune.outputs.runfolder import RECORD, recorded, replace_previous_run

    out, checkpoints, victim = tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "victim"
    victim.mkdir()
    for folder in ("tensorboard", "footstep-1", "my-step-2", "hf"):
        (out / folder).mkdir(parents=True)
    for name in ("metrics.jsonl", "notes.txt"):
        (out / name).write_text("x")
    (out / "summary.json").symlink_to(victim)  # recorded, but a run writes no links
    make_record(out, "metrics.jsonl", "tensorboard", "hf", "summary.json")
    # hand-edited lines that leave the folder are never followed
    (out / RECORD).write_text((out / RECORD).read_text() + "../victim\n/etc\n.\n")
    for folder in ("step-00000005", "step-00000010", "step-5", "other-step-00000001"):
        (checkpoints / folder).mkdir(parents=True)
    make_record(checkpoints, "step-00000005", "step-00000010")
    replace_previous_run(out, checkpoints)
    assert sorted(p.name for p in out.iterdir()) == [
        RECORD,
        "checkpoints",
        "footstep-1",
        "my-step-2",
        "notes.txt",
        "summary.json",
    ]
    assert sorted(p.name for p in checkpoints.iterdir()) == [RECORD, "other-step-00000001", "step-5"]
    assert victim.is_dir() and recorded(out) == ["summary.json"] and recorded(checkpoints) == []


def test_overwrite_refuses_outputs_no_run_recorded_and_deletes_nothing(tmp_path):
    from parallel_finetune.outputs.runfolder import check_run_folders, replace_previous_run

    mine, elsewhere = tmp_path / "mine", tmp_path / "other-project"
    (mine / "tensorboard").mkdir(parents=True)
    (mine / "hf").mkdir()
    (elsewhere / "step-00000100").mkdir(parents=True)  # another project's checkpoint under checkpoint_dir=
    message = (
        f"overwrite=true: {mine / 'hf'}, {mine / 'tensorboard'}, {elsewhere / 'step-00000100'} were not written by "
        "a run of ours (not in the folder's record), so the run will not delete or write over them: move them, "
        "or choose another output_dir"
    )
    for refuse in (lambda: check_run_folders(mine, elsewhere, True), lambda: replace_previous_run(mine, elsewhere)):
        with pytest.raises(UserError) as refused:
            refuse()
        assert str(refused.value) == message
    check_run_folders(mine, elsewhere, overwrite=False)  # without overwrite: the usual rules (non-empty: refused)
    assert sorted(p.name for p in mine.iterdir()) == ["hf", "tensorboard"]
    assert (elsewhere / "step-00000100").is_dir()
    plain = tmp_path / "plain"  # a folder that never held a run: overwrite=true deletes nothing there
    (plain / "notes").mkdir(parents=True)
    replace_previous_run(plain, plain / "checkpoints")
    assert [p.name for p in plain.iterdir()] == ["notes"]


@pytest.fixture(scope="module")
def plain_run(sst2, cache_dir, tmp_path_factory) -> Path:
    """A run that writes few of the names a run may write: report_to=none, no predictions, no export."""
    out = tmp_path_factory.mktemp("plain") / "run"
    launch(1, tiny_overrides(sst2, cache_dir, max_steps=1, report_to="none"), out)
    return out


def users_copy(run_folder: Path, folder: Path, *names: str) -> Path:
    """`run_folder` copied to `folder` (its checkpoints left out), then a user's file under each of `names`: a file
    of that name, or for a name a run writes as a folder, my_notes.txt inside it."""
    shutil.copytree(run_folder, folder, ignore=shutil.ignore_patterns("checkpoints"))
    for name in names:
        target = folder / name
        if "." in name:
            target.write_text("mine")
        else:
            target.mkdir()
            (target / "my_notes.txt").write_text("mine")
    return folder


@pytest.mark.parametrize("name", RUN_OUTPUTS)
def test_a_name_is_on_the_record_only_if_the_run_wrote_it(name, plain_run, tmp_path):
    """What a run did not write is not its to delete: a user's file under that name survives overwrite=true (the
    folder is refused, as one holding outputs no run recorded)."""
    from parallel_finetune.outputs.runfolder import check_run_folders, recorded, replace_previous_run

    written = (plain_run / name).exists()
    assert (name in recorded(plain_run)) == written, (name, written, recorded(plain_run))
    if written:
        return
    folder = users_copy(plain_run, tmp_path / "run", name)
    checkpoints = folder / "checkpoints"
    for replace in (
        lambda: check_run_folders(folder, checkpoints, True),
        lambda: replace_previous_run(folder, checkpoints),
    ):
        with pytest.raises(UserError, match=rf"^overwrite=true: {re.escape(str(folder / name))} was not written by"):
            replace()
    assert (folder / name).exists() and name not in recorded(folder)


def test_overwrite_spares_what_the_previous_run_did_not_write(plain_run, sst2, cache_dir, tmp_path):
    """End to end: a user's wandb/my_notes.txt and predictions_mismatched.tsv in a report_to=none run's folder stop
    a run with overwrite=true in one line, and stay."""
    folder = users_copy(plain_run, tmp_path / "run", "wandb", "predictions_mismatched.tsv")
    run = launch(1, tiny_overrides(sst2, cache_dir, max_steps=1, overwrite="true"), folder, check=False)
    assert run.returncode == 2, run.output[-2000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: overwrite=true: {folder / 'predictions_mismatched.tsv'}, {folder / 'wandb'} were")
    assert (folder / "wandb" / "my_notes.txt").read_text() == "mine"
    assert (folder / "predictions_mismatched.tsv").read_text() == "mine"


def test_sagemaker_folders_count_only_inside_a_job_and_never_over_output_dir(tmp_path, monkeypatch):
    """A stray SM_MODEL_DIR / SM_OUTPUT_DATA_DIR in a shell redirects (and would empty) nothing; in a job, an
    output_dir the user gave wins, and a LoRA adapter goes inside the model folder, which the job uploads."""
    from parallel_finetune.outputs.export import export_target
    from parallel_finetune.outputs.runfolder import choose_output_dir

    monkeypatch.delenv("SM_TRAINING_ENV", raising=False)
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "output"))
    monkeypatch.chdir(tmp_path)

    def target(output_dir):
        """Where a run's export goes: (`out`, whether a LoRA run's adapter/ goes inside it)."""
        return export_target(output_dir, tmp_path / (output_dir or "output"))

    assert choose_output_dir(None, "gptj-tp", False).parent == Path("runs")
    assert target("run") == (tmp_path / "run" / "hf", False)
    assert target(None) == (tmp_path / "output" / "hf", False)
    monkeypatch.setenv("SM_TRAINING_ENV", "{}")  # inside a SageMaker job
    assert choose_output_dir(None, "gptj-tp", False) == tmp_path / "output"
    assert target("run") == (tmp_path / "run" / "hf", False)
    assert target(None) == (tmp_path / "model", True)


def test_no_export_or_run_folder_inside_a_checkpoint(checkpoint, tmp_path):
    from parallel_finetune.outputs.convert import export_checkpoint
    from parallel_finetune.outputs.runfolder import RECORD, check_run_folders, write_folder

    refusal = (
        f"not exporting to {checkpoint / 'hf'}: it lies inside the checkpoint {checkpoint}; choose a folder outside it"
    )
    for export in (
        lambda: write_folder(checkpoint / "hf", lambda folder: (folder / "config.json").write_text("{}")),
        lambda: export_checkpoint(checkpoint, checkpoint / "hf"),  # scripts/export_hf.py
    ):
        with pytest.raises(UserError) as refused:
            export()
        assert str(refused.value) == refusal
    with pytest.raises(UserError, match=rf"lies inside the checkpoint {tmp_path / 'checkpoints' / 'step-00000020'}"):
        write_folder(tmp_path / "checkpoints" / "step-00000020", lambda folder: None)  # resume would pick it up
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / ".metadata").write_bytes(b"")  # a DCP checkpoint under any name
    with pytest.raises(UserError, match=rf"lies inside the checkpoint {tmp_path / 'best'};"):
        write_folder(tmp_path / "best" / "hf", lambda folder: None)
    with pytest.raises(
        UserError, match=rf"^output_dir='{checkpoint / 'run'}' lies inside the checkpoint {checkpoint};"
    ):
        check_run_folders(checkpoint / "run", checkpoint / "run" / "checkpoints", overwrite=False)
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    # export_hf.py's OUT: a file or a run folder is one line, before the checkpoint is read
    (tmp_path / "notes.txt").write_text("mine")
    make_record(tmp_path / "run", "metrics.jsonl")
    for out, message in (
        (tmp_path / "notes.txt", f"{tmp_path / 'notes.txt'} is a file, not a folder; choose a new or empty folder"),
        (tmp_path / "run", f"{tmp_path / 'run'} is a run folder (it holds {RECORD}); export into a new or empty"),
    ):
        with pytest.raises(UserError) as refused:
            export_checkpoint(tmp_path / "no-such-checkpoint", out)
        assert str(refused.value).startswith(message)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_export_staging_goes_on_interrupt_and_a_killed_exports_goes_next_time(tmp_path):
    from parallel_finetune.outputs.run_files import EXPORT_STAGING as STAGING
    from parallel_finetune.outputs.run_files import EXPORT_STAGING_MARKER as STAGING_MARKER
    from parallel_finetune.outputs.runfolder import write_folder

    out = tmp_path / "hf"

    def interrupted(folder):
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder(out, interrupted)
    assert list(tmp_path.iterdir()) == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".hf{STAGING}{int(dead.stdout)}"  # what a SIGKILLed export leaves: ours, its writer gone
    killed.mkdir()
    (killed / STAGING_MARKER).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    (killed / "model.safetensors").write_bytes(b"\0" * 4096)
    unmarked = tmp_path / f".hf{STAGING}1"  # the right name, but not our marker: left alone
    unmarked.mkdir()
    write_folder(out, lambda folder: (folder / "config.json").write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [unmarked.name, "hf"]
    assert [p.name for p in out.iterdir()] == ["config.json"]


# ------------------------------------------- issue 26: no code from a model folder; weights checked against shapes
def _plan_script():
    spec = importlib.util.spec_from_file_location("plan_script", REPO / "scripts" / "plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def small_gpt2(sst2, tmp_path_factory):
    """A small pretrained GPT-2 folder (random weights, a tokenizer learned from SST-2), as save_pretrained writes."""
    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.model import synthetic

    sentences = column(read_glue_dir(sst2)["train"], "text")[:300]
    folder = tmp_path_factory.mktemp("pretrained") / "gpt2"
    return synthetic.write_checkpoint(folder, "gpt2", sentences, hidden=64, layers=2, heads=4, vocab_size=512)


@pytest.fixture
def no_stdin(monkeypatch):
    """Every question transformers could ask is answered "y"; the test checks none is asked."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    return asked


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_model_folder_asking_for_custom_code_is_refused_everywhere(
    file, small_gpt2, sst2, no_stdin, tmp_path, capsys
):
    """The run's tokenizer and config, --check and plan.py refuse in one line naming the file and key; the
    payload never runs and nothing is asked on stdin (a "y" would run it)."""
    from parallel_finetune.data.prepare import TinyTokenizer, load_tokenizer
    from parallel_finetune.train import main

    folder = shutil.copytree(small_gpt2, tmp_path / "model")
    marker = tmp_path / "payload-ran"
    plant_custom_code(folder, file, marker)
    message = f"{folder / file} asks for custom code (auto_map: "
    with pytest.raises(UserError, match=re.escape(message)):
        load_tokenizer(None, "full", str(folder), TinyTokenizer("bpe", 0), [], None, tmp_path)
    with pytest.raises(UserError, match=re.escape(message)):
        gpt2_config(load_config(REPO / "recipes/gpt2/tp.yaml", [f"model={folder}"]), 0)
    check = [f"model={folder}", f"data_dir={sst2}", f"cache_dir={tmp_path}", f"output_dir={tmp_path / 'run'}"]
    for entry in (
        lambda: main(["--check", str(REPO / "recipes/gpt2/tp.yaml"), *check]),
        lambda: _plan_script().main([str(folder), "--gpus", "8", "--gpu-mem-gb", "80"]),
    ):
        code, err = entry(), capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err and "never runs code" in err, err
    assert not marker.exists() and not no_stdin


@pytest.fixture
def edited_gpt2(small_gpt2, tmp_path):
    """The small GPT-2 whose config.json says n_inner=128 (its files hold 4 x 64 = 256)."""
    folder = shutil.copytree(small_gpt2, tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_inner": 128}))
    return folder


def test_weights_of_other_shapes_are_refused_by_the_load_and_by_check(edited_gpt2, sst2, tmp_path, capsys):
    from parallel_finetune.families import get_family
    from parallel_finetune.model.load import load_model
    from parallel_finetune.train import main

    family = get_family("gpt2")
    hf_config = family.hf_config(str(edited_gpt2), "full", 0, 128, {})
    family.set_task(hf_config, "classification", 0)
    message = (
        f"{edited_gpt2 / 'model.safetensors'}: tensor transformer.h.0.mlp.c_fc.weight is [64, 256] in the file, "
        "but the model built from the config needs [64, 128] for transformer.h.0.mlp.c_fc.weight"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        load_model(family, "classification", hf_config, str(edited_gpt2), seed=0)
    check = [f"data_dir={sst2}", f"cache_dir={tmp_path}", f"output_dir={tmp_path / 'run'}"]
    assert main(["--check", str(REPO / "recipes/gpt2/tp.yaml"), f"model={edited_gpt2}", *check]) == 2
    assert capsys.readouterr().err == f"error: {message}; the config does not describe these weights\n"


def gpt2_config(config, tokenizer_size: int):
    """GPT-2's transformers config for `config`'s model section (families.config_for)."""
    from parallel_finetune.families import get_family

    return get_family("gpt2").config_for(
        model=config.model, head="classification", max_length=config.max_length, tokenizer_size=tokenizer_size
    )


@pytest.mark.parametrize(
    "override, changed",
    [
        ("n_inner=128", "transformer.h.0.mlp.c_fc.weight from [256, 64] to [128, 64]"),
        ("n_embd=32", "transformer.wte.weight"),
    ],
)
def test_a_size_override_on_a_pretrained_model_is_refused_up_front(override, changed, small_gpt2, sst2, tmp_path):
    config = ["model_config.resid_pdrop=0.0", f"model_config.{override}"]
    with pytest.raises(UserError, match=rf"^model_config\.{override} changes {re.escape(changed)}"):
        gpt2_config(load_config(REPO / "recipes/gpt2/tp.yaml", [f"model={small_gpt2}", *config]), 0)
    # the same keys on a model trained from scratch, or overrides that keep every shape, pass
    gpt2_config(load_config(REPO / "recipes/gpt2/tp.yaml", ["size=tiny", *config]), 512)
    kept = ["model_config.n_layer=1", "model_config.resid_pdrop=0.1"]
    assert gpt2_config(load_config(REPO / "recipes/gpt2/tp.yaml", [f"model={small_gpt2}", *kept]), 0).n_layer == 1


def safetensors_bytes(header, data: bytes = b"\0" * 16, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    "content, problem",
    [
        (
            safetensors_bytes({"w": GOOD}, length=2**60),
            "header length 1,152,921,504,606,846,976 is impossible in a file of",
        ),
        (safetensors_bytes([GOOD]), "the header is a JSON list, not an object of tensors"),
        (safetensors_bytes({"w": {**GOOD, "data_offsets": [-16, 0]}}), "tensor 'w' has data_offsets [-16, 0], not"),
        (safetensors_bytes({"w": {**GOOD, "dtype": "F8_E9"}}), "tensor 'w' has dtype 'F8_E9'; known: F64"),
        (safetensors_bytes({"w": {"dtype": "F32", "shape": [4]}}), "tensor 'w' lacks dtype, shape or data_offsets"),
        (
            safetensors_bytes({"w": {**GOOD, "shape": [2]}}),
            "tensor 'w' has data_offsets [0, 16] (16 bytes) but shape [2] of F32 is 8 bytes",
        ),
        (
            safetensors_bytes({"w": GOOD}, b"\0" * 8),
            "tensor 'w' has data_offsets [0, 16] past the end of the file's data (8 bytes)",
        ),
    ],
    ids=["huge-length", "list", "negative", "dtype", "missing-key", "size", "past-end"],
)
def test_malformed_safetensors_headers_are_one_line(content, problem, tmp_path):
    from parallel_finetune.model.weights import SafetensorsFile

    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}: {re.escape(problem)}"):
        SafetensorsFile(path)


@pytest.mark.parametrize(
    "entry, problem",
    [
        ("../outside.safetensors", "weight file '../outside.safetensors' is not a file name in"),
        ("/tmp/outside.safetensors", "weight file '/tmp/outside.safetensors' is not a file name in"),
        ("model-1.safetensors", "'v' is in model-1.safetensors by the index, but that file has no such tensor"),
    ],
)
def test_a_weight_index_pointing_elsewhere_is_one_line(entry, problem, tmp_path):
    from parallel_finetune.model.weights import open_checkpoint

    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(safetensors_bytes({"v": GOOD}))
    (folder / "model-1.safetensors").write_bytes(safetensors_bytes({"w": GOOD}))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-1.safetensors", "v": entry}}))
    with pytest.raises(UserError, match=f"^{re.escape(str(index))}: {re.escape(problem)}"):
        open_checkpoint(folder)


# ------------------------------------------------------------------------------------------------------------------
# Issue 26 (checkpoints): what resume trusts (trainer_state.json's fields, the data, the tensor and RNG files, their
# values) and what an interrupt does, on small checkpoints written in this process (test_units' world of one).

SIGNAL_WORKER = str(REPO / "tests" / "workers" / "signal_at_step.py")
world_of_one = test_units.world_of_one  # a gloo world of one in this process (a fixture)


@pytest.fixture(scope="module")
def two_checkpoints(world_of_one, tmp_path_factory):
    """checkpoints/step-00000001 and step-00000002 of test_units' tiny classifier, and the settings they were
    written with; tests damage copies."""
    folder = tmp_path_factory.mktemp("two-checkpoints")
    settings = unit_config(output_dir=str(folder))
    for step in (1, 2):
        checkpointing.save(training_state(world_of_one, settings, step=step), folder / "checkpoints")
    return folder / "checkpoints", settings


@pytest.fixture
def root(two_checkpoints, tmp_path):
    return shutil.copytree(two_checkpoints[0], tmp_path / "checkpoints")


def remake_manifest(folder):
    """As someone who rewrote files in a checkpoint and its manifest to match would leave it."""
    integrity.write_manifest(folder, integrity.describe(folder, integrity.files_in(folder)))


def resumed_from(root, world_of_one, settings, resume="auto"):
    """checkpoint.resume as a run calls it: (the folder it continued from, the step it restored)."""
    settings = settings.replace(resume=resume)
    state = training_state(world_of_one, settings, step=0)
    return checkpointing.resume(state, root, checkpoint=settings.checkpoint, output=settings.output), state.step


@pytest.mark.parametrize(
    "change,problem",
    [
        ({"step": -3}, "step is -3, expected a whole number from 1"),
        ({"step": "2"}, 'step is "2", expected a whole number from 1'),
        ({"step": 1}, "step is 1, but the folder is step-00000002"),
        ({"adam_step": 10**9}, "adam_step is 1000000000, expected a whole number from 0 to the step (2)"),
        ({"scheduler": None}, "scheduler.last_epoch is missing, expected the step (2)"),
        ({"loss_scaler": {"scale": float("nan"), "clean_steps": 0}}, "loss_scaler.scale is NaN, expected above 0"),
        ({"parameter_shapes": {"score.weight": [2, -1]}}, "parameter_shapes is {"),
        ({"family": None}, "family is null, expected a family name"),
    ],
)
def test_trainer_state_values_are_checked_and_auto_falls_back(change, problem, root, caplog):
    step2 = root / "step-00000002"
    state = json.loads((step2 / "trainer_state.json").read_text())
    (step2 / "trainer_state.json").write_text(json.dumps({**state, **change}))
    remake_manifest(step2)
    assert checkpointing.resolve_resume("auto", root) == root / "step-00000001"
    assert f"skipping checkpoint {step2}: trainer_state.json: {problem}" in caplog.text
    with pytest.raises(UserError, match=rf"^resume='{step2}' is not a usable checkpoint: trainer_state\.json: "):
        checkpointing.resolve_resume(str(step2), root)


def plant_in_rng(folder, marker) -> str:
    torch.save({"cpu": Payload(marker), "cuda": torch.zeros(0, dtype=torch.uint8)}, folder / "rng" / "rank0.pt")
    return "rng/rank0.pt"


def plant_in_shard(folder, marker) -> str:
    """A tensor's record in its .distcp file pointed at a pickle appended to the file, .metadata to match."""
    metadata = integrity.read_metadata(folder / ".metadata")
    index, where = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith("model."))
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    shard = folder / where.relative_path
    metadata.storage_data[index] = dataclasses.replace(
        where, offset=shard.stat().st_size, length=len(payload.getvalue())
    )
    with open(shard, "ab") as handle:
        handle.write(payload.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return where.relative_path


@pytest.mark.parametrize("plant", [plant_in_rng, plant_in_shard])
def test_a_pickle_in_rng_or_tensor_files_is_one_line_and_auto_falls_back(plant, root, world_of_one, tmp_path, caplog):
    settings, step2, marker = unit_config(output_dir=str(tmp_path)), root / "step-00000002", tmp_path / "payload-ran"
    name = plant(step2, marker)
    remake_manifest(step2)
    refusal = f"{name} asks to load posix.system, which a tensor file never holds; refusing to read it"
    assert resumed_from(root, world_of_one, settings) == (root / "step-00000001", 1)
    assert f"skipping checkpoint {step2}: {refusal}" in caplog.text
    with pytest.raises(UserError) as refused:
        resumed_from(root, world_of_one, settings, resume=str(step2))
    assert str(refused.value).startswith(f"resume='{step2}' is not a usable checkpoint: {refusal}")
    assert "\n" not in str(refused.value) and "weights_only=False" not in str(refused.value)
    assert not marker.exists()


def test_nan_behind_a_matching_manifest_is_found_at_load(two_checkpoints, world_of_one, tmp_path, monkeypatch, caplog):
    """Someone wrote NaN into a checkpoint and made its manifest again: said at load, naming the tensor, not blamed
    on the learning rate steps later."""
    root, settings = shutil.copytree(two_checkpoints[0], tmp_path / "checkpoints"), two_checkpoints[1]
    state = training_state(world_of_one, settings, step=3)
    with torch.no_grad():
        state.model.score.weight[0, 0] = float("nan")
    with monkeypatch.context() as patch:
        patch.setattr(integrity, "nonfinite", lambda *args: None)  # the save's own refusal, bypassed
        checkpointing.save(state, root)
    step3 = root / "step-00000003"
    assert integrity.verify(step3) is None
    assert resumed_from(root, world_of_one, settings) == (root / "step-00000002", 2)
    assert f"skipping checkpoint {step3}: model.score.weight holds NaN or inf; trying the one before" in caplog.text


def test_ctrl_c_while_a_checkpoint_is_written_stops_and_removes_it(root, world_of_one, tmp_path, monkeypatch):
    write = FileSystemWriter.write_data

    def interrupted(self, *args, **kwargs):
        write(self, *args, **kwargs)
        raise KeyboardInterrupt  # what SIGINT's handler raises, here inside DCP's write (which wraps it)

    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(training_state(world_of_one, unit_config(output_dir=str(tmp_path)), step=3), root)
    assert sorted(p.name for p in root.iterdir() if p.name != RECORD) == ["step-00000001", "step-00000002"]


def test_ctrl_c_stops_the_run_in_one_line_with_exit_code_130(sst2, cache_dir, tmp_path):
    env = {"SIGNAL_NAME": "SIGINT", "SIGNAL_RANK": "0", "SIGNAL_STEP": "3"}
    overrides = tiny_overrides(sst2, cache_dir, max_steps=10, checkpoint_every=1)
    run = launch(1, overrides, tmp_path / "run", script=SIGNAL_WORKER, env=env, check=False)
    assert run.returncode == 130, run.output[-3000:]
    assert run.output.count("interrupted (SIGINT) after step 2: the run stopped") == 1, run.output[-3000:]
    assert "Traceback" not in run.output and "error:" not in run.output
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name != RECORD)
    assert kept == ["step-00000001", "step-00000002"]


def test_continuing_on_changed_data_is_refused(sst2, cache_dir, tmp_path):
    """The same data_dir, its labels flipped: the checkpoint records the data's fingerprint."""
    data, out = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    for name, rows in (("train.tsv", 200), ("dev.tsv", 64)):
        (data / name).write_text("".join((sst2 / name).read_text().splitlines(keepends=True)[: rows + 1]))
    overrides = tiny_overrides(data, cache_dir, max_steps=2, checkpoint_every=1)
    first = launch(1, overrides, out)
    header, *rows = (data / "train.tsv").read_text().splitlines()
    flipped = [f"{sentence}\t{1 - int(label)}" for sentence, label in (row.split("\t") for row in rows)]
    (data / "train.tsv").write_text("\n".join([header, *flipped]) + "\n")
    message = f"error: checkpoint {out / 'checkpoints' / 'step-00000002'} was trained on other data: its rows were "
    checked = check(*overrides, f"output_dir={out}", nproc=1)
    assert checked.returncode == 2 and checked.stderr.count("\n") == 1, checked.stderr
    assert checked.stderr.startswith(message) and "resume=none" in checked.stderr
    run = launch(1, overrides, out, check=False)
    assert run.returncode == 2 and run.output.count(message) == 1, run.output[-3000:]
    assert first.records == run.records, "nothing trained on the changed data"
