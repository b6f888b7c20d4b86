"""The safety nets in one process: DCP metadata read without running code, the checkpoint manifest, the run-folder
lock (busy, stale after SIGKILL, file systems without flock), the non-finite guard's counting, and launcher
messages naming the real flags. Their torchrun counterparts are in test_checkpoint.py and test_cli.py."""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, plant_custom_code, plant_payload
from torch.distributed.checkpoint.api import CheckpointException

from parallel_finetune import integrity
from parallel_finetune.config import load_config
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


# ------------------------------------------- issue 26: no code from a model folder; weights checked against shapes
def _plan_script():
    spec = importlib.util.spec_from_file_location("plan_script", REPO / "scripts" / "plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def small_gpt2(sst2, tmp_path_factory):
    """A small pretrained GPT-2 folder (random weights, a tokenizer learned from SST-2), as save_pretrained writes."""
    from parallel_finetune import synthetic
    from parallel_finetune.data import column, read_glue_dir

    sentences = column(read_glue_dir(sst2)["train"], "sentence")[:300]
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
    from parallel_finetune.data import load_tokenizer
    from parallel_finetune.families import get_family
    from parallel_finetune.train import main

    folder = shutil.copytree(small_gpt2, tmp_path / "model")
    marker = tmp_path / "payload-ran"
    plant_custom_code(folder, file, marker)
    message = f"{folder / file} asks for custom code (auto_map: "
    with pytest.raises(UserError, match=re.escape(message)):
        load_tokenizer(None, "full", str(folder), "bpe", 0, [], None, tmp_path)
    with pytest.raises(UserError, match=re.escape(message)):
        get_family("gpt2").config_for(load_config(REPO / "recipes/gpt2/tp.yaml", [f"model={folder}"]), 0)
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
    from parallel_finetune.train import main
    from parallel_finetune.weights import build_and_load

    family = get_family("gpt2")
    hf_config = family.hf_config(str(edited_gpt2), "full", 0, 128, {})
    family.set_task(hf_config, "classification", 0)
    message = (
        f"{edited_gpt2 / 'model.safetensors'}: tensor transformer.h.0.mlp.c_fc.weight is [64, 256] in the file, "
        "but the model built from the config needs [64, 128] for transformer.h.0.mlp.c_fc.weight"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        build_and_load(family, "classification", hf_config, str(edited_gpt2), seed=0)
    check = [f"data_dir={sst2}", f"cache_dir={tmp_path}", f"output_dir={tmp_path / 'run'}"]
    assert main(["--check", str(REPO / "recipes/gpt2/tp.yaml"), f"model={edited_gpt2}", *check]) == 2
    assert capsys.readouterr().err == f"error: {message}; the config does not describe these weights\n"


@pytest.mark.parametrize(
    "override, changed",
    [
        ("n_inner=128", "transformer.h.0.mlp.c_fc.weight from [256, 64] to [128, 64]"),
        ("n_embd=32", "transformer.wte.weight"),
    ],
)
def test_a_size_override_on_a_pretrained_model_is_refused_up_front(override, changed, small_gpt2, sst2, tmp_path):
    from parallel_finetune.families import get_family

    family, config = get_family("gpt2"), ["model_config.resid_pdrop=0.0", f"model_config.{override}"]
    with pytest.raises(UserError, match=rf"^model_config\.{override} changes {re.escape(changed)}"):
        family.config_for(load_config(REPO / "recipes/gpt2/tp.yaml", [f"model={small_gpt2}", *config]), 0)
    # the same keys on a model trained from scratch, or overrides that keep every shape, pass
    family.config_for(load_config(REPO / "recipes/gpt2/tp.yaml", ["size=tiny", *config]), 512)
    kept = ["model_config.n_layer=1", "model_config.resid_pdrop=0.1"]
    assert family.config_for(load_config(REPO / "recipes/gpt2/tp.yaml", [f"model={small_gpt2}", *kept]), 0).n_layer == 1


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
    from parallel_finetune.weights import SafetensorsFile

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
    from parallel_finetune.weights import open_checkpoint

    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(safetensors_bytes({"v": GOOD}))
    (folder / "model-1.safetensors").write_bytes(safetensors_bytes({"w": GOOD}))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model-1.safetensors", "v": entry}}))
    with pytest.raises(UserError, match=f"^{re.escape(str(index))}: {re.escape(problem)}"):
        open_checkpoint(folder)
