"""The safety nets in one process: DCP metadata read without running code, the checkpoint manifest, what else resume
checks (trainer_state.json's fields, the data, pickles in tensor and RNG files, NaN), Ctrl-C, the run-folder lock
(busy, stale after SIGKILL, file systems without flock), the non-finite guard's counting, and launcher messages
naming the real flags. Their torchrun counterparts are in test_checkpoint.py and test_cli.py."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import test_units
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, Payload, check, launch, plant_payload, tiny_overrides
from test_units import config as unit_config
from test_units import training_state
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from parallel_finetune import checkpoint as checkpointing
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
    state = training_state(world_of_one, dataclasses.replace(settings, resume=resume), step=0)
    return checkpointing.resume(state, root), state.step


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
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]


def test_ctrl_c_stops_the_run_in_one_line_with_exit_code_130(sst2, cache_dir, tmp_path):
    env = {"SIGNAL_NAME": "SIGINT", "SIGNAL_RANK": "0", "SIGNAL_STEP": "3"}
    overrides = tiny_overrides(sst2, cache_dir, max_steps=10, checkpoint_every=1)
    run = launch(1, overrides, tmp_path / "run", script=SIGNAL_WORKER, env=env, check=False)
    assert run.returncode == 130, run.output[-3000:]
    assert run.output.count("interrupted (SIGINT) after step 2: the run stopped") == 1, run.output[-3000:]
    assert "Traceback" not in run.output and "error:" not in run.output
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


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
