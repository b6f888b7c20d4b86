"""`make selftest` decides from the runs' own files: a difference beyond the tolerance, a missing skip or a weight
that differs from the file is a FAIL. (CI runs the selftest itself: .ci/run.)"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from parallel_finetune.selftest import INJECT_STEP, Check, check_reference, compare, verdict


def write_run(folder, losses, eval_loss, skipped=(), weights=None):
    folder.mkdir(parents=True)
    scale = 65536.0
    records = []
    for step, loss in enumerate(losses, start=1):
        records.append({"step": step, "loss": loss, "skipped": step in skipped, "loss_scale": scale})
        scale = scale / 2 if step in skipped else scale
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"eval_loss": eval_loss}))
    if weights is not None:
        (folder / "loaded").mkdir()
        save_file(weights, folder / "loaded" / "model.safetensors")


def test_equal_runs_pass_and_a_moved_loss_fails(tmp_path):
    check = Check("tp=2", "gptj", 2, [], reference="one")
    write_run(tmp_path / "one", [0.7, 0.6, 0.5], 0.4)
    write_run(tmp_path / "same", [0.7, 0.6 + 3e-7, 0.5], 0.4)
    write_run(tmp_path / "moved", [0.7, 0.6 + 3e-4, 0.5], 0.4)
    assert compare(check, tmp_path / "same", tmp_path / "one", None)[1]
    detail, ok = compare(check, tmp_path / "moved", tmp_path / "one", None)
    assert not ok and "3.0e-04" in detail


def test_overflow_must_be_skipped_everywhere(tmp_path):
    check = Check("fp16 tp=2", "gptj", 2, [], reference="one", fp16_overflow=True)
    write_run(tmp_path / "one", [0.7, 0.6, 0.5], 0.4, skipped=(INJECT_STEP,))
    write_run(tmp_path / "skipped", [0.7, 0.6, 0.5], 0.4, skipped=(INJECT_STEP,))
    write_run(tmp_path / "not", [0.7, 0.6, 0.5], 0.4)
    assert compare(check, tmp_path / "skipped", tmp_path / "one", None)[1]
    assert not compare(check, tmp_path / "not", tmp_path / "one", None)[1]


def test_loaded_weights_must_equal_the_file(tmp_path):
    check = Check("full tp=2", "gptj", 2, [], reference="one", full_size=True)
    weight = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    (tmp_path / "model").mkdir()
    save_file({"w": weight}, tmp_path / "model" / "model.safetensors")
    write_run(tmp_path / "one", [0.7, 0.6], 0.4, weights={"w": weight.float()})
    write_run(tmp_path / "equal", [0.7, 0.6], 0.4, weights={"w": weight.float()})
    write_run(tmp_path / "off", [0.7, 0.6], 0.4, weights={"w": weight.float() + 1e-3})
    assert compare(check, tmp_path / "equal", tmp_path / "one", tmp_path / "model")[1]
    detail, ok = compare(check, tmp_path / "off", tmp_path / "one", tmp_path / "model")
    assert not ok and "0/1 tensors equal the file" in detail


def test_the_one_process_fp16_run_must_skip_the_planted_overflow_itself(tmp_path):
    check = Check("fp16 one", "gptj", 1, [], fp16_overflow=True)
    write_run(tmp_path / "skipped", [0.7, 0.6, 0.5], 0.4, skipped=(INJECT_STEP,))
    write_run(tmp_path / "not", [0.7, 0.6, 0.5], 0.4)
    assert check_reference(check, tmp_path / "skipped", None)[1]
    detail, ok = check_reference(check, tmp_path / "not", None)
    assert not ok and "skipped steps []" in detail


def test_one_gpu_passes_its_runs_but_never_claims_a_layout():
    one, tp = Check("one", "gptj", 1, []), Check("tp=2", "gptj", 2, [], reference="one")
    line, passed = verdict([(one, "reference", True), (tp, "not run: needs 2 GPUs", None)], 9.0, "1 x H200, nccl")
    assert passed and "no parallel layout was checked" in line and "every layout" not in line
    line, passed = verdict([(one, "reference", True), (tp, "max |loss difference| 1e-7", True)], 9.0, "CPU")
    assert passed and "every layout trains like one process" in line
    assert not verdict([(one, "reference", True), (tp, "moved", False)], 9.0, "CPU")[1]
