"""The safety nets in one process: DCP metadata read without running code, the checkpoint manifest, the run-folder
lock (busy, stale after SIGKILL, file systems without flock), the non-finite guard's counting, and launcher
messages naming the real flags. Their torchrun counterparts are in test_checkpoint.py and test_cli.py."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, plant_payload
from torch.distributed.checkpoint.api import CheckpointException

from parallel_finetune import integrity
from parallel_finetune.divergence import NonFiniteGuard
from parallel_finetune.errors import UserError
from parallel_finetune.runfolder import LOCK, RunLock


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


def test_a_checkpoint_of_the_same_step_is_replaced_not_refused(tmp_path):
    """Resuming from an older checkpoint of the same folder writes its later steps again: the rename used to fail
    with "Directory not empty" and leave the old trajectory's checkpoint in place."""
    from parallel_finetune.checkpoint import replace_folder

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
            "parallel_finetune.runfolder import RunLock; lock = RunLock([Path(sys.argv[1])]); "
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
    (folder / LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    RunLock([folder]).acquire()  # stale: that process is gone
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (folder / LOCK).write_text(json.dumps({"pid": alive.pid, "host": os.uname().nodename}))
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
    from parallel_finetune.config import load_config

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
    from parallel_finetune.config import load_config

    recipe = REPO / "recipes" / "gptj" / "tp.yaml"
    keys = ("output_dir", "checkpoint_dir", "data_dir", "cache_dir", "model", "tokenizer", "revision", "resume")
    for key in keys:
        assert getattr(load_config(recipe, [f"{key}={value}"]), key) == value
    assert load_config(recipe, [f"output.output_dir={value}"]).output_dir == value
    assert load_config(recipe, ["data_dir=/data/sst2", "data_dir="]).data_dir is None  # empty: back to null


def test_string_keys_in_a_recipe_follow_yaml_quoting(tmp_path):
    from parallel_finetune.config import load_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text('family: gptj\noutput_dir: "runs/run #2"\nrevision: "2024"\n')
    assert (load_config(recipe).output_dir, load_config(recipe).revision) == ("runs/run #2", "2024")
    recipe.write_text("family: gptj\nrevision: 2024\n")
    with pytest.raises(UserError, match=r"revision=2024 is not valid; .*unquoted value as int; quote it"):
        load_config(recipe)


@pytest.mark.parametrize("value", ["1e300", "1e-9", "0", "604801"])
def test_collective_timeout_outside_its_range_is_refused(value):
    from parallel_finetune.config import load_config

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

    from parallel_finetune.data import read_glue_tsv

    big = tmp_path / "train.tsv"
    with open(big, "wb") as file:
        file.truncate(20 * 2**30)  # sparse: no disk, but reading it would take 20 GiB of memory
    # A bounded address space, so a read of the whole file fails at once instead of filling the machine's memory.
    used = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize:")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + 4 * 2**30, hard))
    try:
        with pytest.raises(UserError, match=r"train\.tsv: 20\.0 GiB, more than the 1 GiB a data file may have"):
            read_glue_tsv(big, "train")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_long_row_or_word_is_refused_before_tokenizer_training(tmp_path):
    from parallel_finetune.data import MAX_ROW_CHARS, MAX_WORD_CHARS, read_glue_tsv

    path = tmp_path / "train.tsv"
    word = "ab" * 500_000  # one megabyte "word": learning a BPE on it took hours
    path.write_text(f"sentence\tlabel\na good film\t1\nsee {word} now\t0\n")
    with pytest.raises(UserError) as error:
        read_glue_tsv(path, "train")
    assert str(error.value).startswith(f"{path}:3: 1,000,010 characters, more than the {MAX_ROW_CHARS:,} a row")
    path.write_text(f"sentence\tlabel\na good film\t1\n{'x' * (MAX_WORD_CHARS + 1)} now\t0\n")
    with pytest.raises(UserError, match=r"train\.tsv:3: a word of 1,001 characters \('x{20}'\.\.\.\), more than"):
        read_glue_tsv(path, "train")
    path.write_text(f"sentence\tlabel\n{'x' * MAX_WORD_CHARS} {'y ' * 40_000}\t1\n")  # at both limits: fine
    assert read_glue_tsv(path, "train")["label"] == [1]
