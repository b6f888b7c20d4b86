"""Checkpoints: exact resume, resharding across layouts, SIGTERM and torchrun restarts, export, and faults.

The reference is one uninterrupted TP=2 run of 10 fp32 steps that checkpoints every 5; every other run must
reproduce its losses."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from safetensors.torch import load_file

from parallel_finetune.checkpoint import resolve_resume

from conftest import FAMILIES, REPO, launch, python, recipe, tiny_overrides

SIGNAL_WORKER = str(REPO / "tests" / "workers" / "signal_at_step.py")
TOLERANCE = 1e-5


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
    return launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=1", "sharding=full", "checkpoint_every=5"),
                  out)


def assert_same_losses(run, reference, first_step: int) -> None:
    records = run.records
    assert [r["step"] for r in records] == list(range(first_step, 11))
    expected = reference.losses[first_step - 1:]
    differences = [abs(a - b) for a, b in zip(run.losses, expected)]
    assert max(differences) < TOLERANCE, differences


def test_reference_keeps_the_newest_checkpoints(reference):
    assert sorted(p.name for p in (reference.output_dir / "checkpoints").iterdir()) == ["step-00000005",
                                                                                       "step-00000010"]
    assert reference.losses[0] != reference.losses[-1]


@pytest.mark.parametrize("name,nproc,layout", [
    ("tp2", 2, ["tensor_parallel_degree=2"]),
    ("single_process", 1, []),
    ("optimizer_dp2", 2, ["tensor_parallel_degree=1", "sharding=optimizer"]),
    ("full_dp2_tp2", 4, ["tensor_parallel_degree=2", "sharding=full"]),
    ("pp2_tp2", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
])
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


@pytest.mark.parametrize("family,task", [("gptj", "classification"), ("gpt2", "causal_lm")])
def test_pipeline_checkpoint_resumes_under_tp2(family, task, sst2, cache_dir, tmp_path):
    """Stages write their own blocks under the unsplit names (GPT-2's tied embedding from both ends): a checkpoint
    of a PP=2 run is an ordinary checkpoint that TP=2 continues."""
    model = ["model_config.n_layer=4", f"task={task}"]
    pipeline = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=1", "pipeline_parallel_degree=2",
                                   "checkpoint_every=5", *model, family=family), tmp_path / "pp2",
                      recipe=recipe(family))
    step5 = pipeline.output_dir / "checkpoints" / "step-00000005"
    run = launch(2, overrides(sst2, cache_dir, f"resume={step5}", "tensor_parallel_degree=2", *model, family=family),
                 tmp_path / "tp2", recipe=recipe(family))
    assert_same_losses(run, pipeline, 6)


def test_sigterm_checkpoints_exits_zero_and_resumes_exactly(reference, sst2, cache_dir, tmp_path):
    out = tmp_path / "run"
    env = {"SIGNAL_NAME": "SIGTERM", "SIGNAL_RANK": "1", "SIGNAL_STEP": "4"}  # one rank only: all must agree
    stopped = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2"), out, script=SIGNAL_WORKER, env=env)
    assert stopped.returncode == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004"]
    assert [r["step"] for r in stopped.records] == [1, 2, 3, 4]
    resumed = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2"), out)  # resume=auto, same folder
    assert resumed.losses == reference.losses, "metrics.jsonl reads as one uninterrupted run"


def test_killed_rank_restarts_from_the_last_checkpoint(reference, sst2, cache_dir, tmp_path):
    # the late restart: torchrun keeps its store across attempts, so peers must not find the dead rank's address
    env = {"SIGNAL_NAME": "SIGKILL", "SIGNAL_RANK": "1", "SIGNAL_STEP": "7", "LATE_RANK": "1", "LATE_BY_S": "5"}
    run = launch(2, overrides(sst2, cache_dir, "tensor_parallel_degree=2", "checkpoint_every=3"), tmp_path / "run",
                 script=SIGNAL_WORKER, env=env, torchrun_args=("--max-restarts=1",))
    assert "resumed from" in run.output and "step-00000006" in run.output
    assert run.losses == reference.losses
    assert run.summary["final_loss"] == reference.summary["final_loss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_from_a_checkpoint_equals_the_run_export(family, sst2, cache_dir, tmp_path):
    run = launch(2, tiny_overrides(sst2, cache_dir, family=family, max_steps=2, export="true")
                 + ["tensor_parallel_degree=2"], tmp_path / "run", recipe=recipe(family))
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
    (root / "step-00000010" / "trainer_state.json").write_text("{\"ste")  # a torn write
    assert resolve_resume("auto", root) == root / "step-00000005"
    assert "skipping checkpoint" in caplog.text and "step-00000011: no DCP .metadata" in caplog.text
    assert "step-00000010: trainer_state.json unreadable" in caplog.text


def test_a_checkpoint_of_another_model_is_refused(reference, sst2, cache_dir, tmp_path):
    step5 = reference.output_dir / "checkpoints" / "step-00000005"
    run = launch(1, overrides(sst2, cache_dir, f"resume={step5}", "model_config.n_inner=256"), tmp_path / "run",
                 check=False)
    assert run.returncode != 0
    assert run.output.count("error: checkpoint ") == 1
    assert "holds another model: parameter 'transformer.h.0.mlp.fc_in.weight' is [512, 128] there, [256, 128] here" in run.output


def test_resume_path_must_exist(sst2):
    proc = python("-m", "parallel_finetune.train", "--check", str(REPO / "recipes" / "gptj" / "tp.yaml"), "size=tiny",
                  f"data_dir={sst2}", "resume=/no/such/checkpoint", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: resume='/no/such/checkpoint': no such checkpoint folder (valid: auto, none, "
                                   "or a step-… folder)")


@pytest.fixture
def small_disk(tmp_path):
    """A 30 MB file system: room for one tiny GPT-J checkpoint (17 MB of shards), not for a second."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)])


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_disk, reference, sst2, cache_dir,
                                                                       tmp_path):
    run = launch(1, overrides(sst2, cache_dir, "checkpoint_every=5", f"checkpoint_dir={small_disk}"), tmp_path / "run")
    assert "checkpoint at step 10 not written" in run.output
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-00000005"]
    assert resolve_resume("auto", small_disk) == small_disk / "step-00000005"
    assert len(run.losses) == 10  # training went on
    state = json.loads((small_disk / "step-00000005" / "trainer_state.json").read_text())
    assert state["step"] == 5
