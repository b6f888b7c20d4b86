"""Speed features that must not change results: regional compilation, and the throughput arithmetic (model FLOPs,
MFU, padding share). No wall-clock assertions: timings go to `make bench`."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_trains_like, launch, tiny_overrides

from parallel_finetune import data
from parallel_finetune.config import COMPILE_AUTO_MIN_STEPS, Config, compile_decision
from parallel_finetune.families import get_family
from parallel_finetune.parallel.pipeline import stage_costs
from parallel_finetune.throughput import achieved, gpu_peak_tflops, model_flops, probe_matmul_tflops
from parallel_finetune.trainer import padding_fraction


@pytest.mark.parametrize(
    "nproc,layout",
    [(1, []), (2, ["tensor_parallel_degree=2", "activation_checkpointing=true"])],
    ids=["single_process", "tp2_checkpointing"],
)
def test_compile_trains_like_eager(nproc, layout, sst2, cache_dir, tmp_path):
    overrides = tiny_overrides(sst2, cache_dir, max_steps=5) + layout
    eager = launch(nproc, overrides, tmp_path / "eager")
    compiled = launch(nproc, overrides + ["compile=true"], tmp_path / "compiled")
    assert "compiled on first use" in compiled.output
    assert_trains_like(compiled, eager, "classification")
    summary = compiled.summary
    assert 0 < summary["padding_fraction"] < 0.5 and set(summary["padding_fraction_per_epoch"]) == {"0"}
    assert summary["mfu"] > 0 and summary["train_tflops_per_device"] > 0 and summary["peak_tflops_per_device"] > 0
    assert all(r["tflops_per_device"] > 0 and r["mfu"] > 0 for r in compiled.records)


def test_model_flops_by_hand():
    family = get_family("gptj")
    config = family.hf_config(None, "tiny", 8192, 128, {})
    torch.manual_seed(0)
    model = family.model_classes["classification"](config)
    flops = model_flops(*stage_costs(model, family), config.hidden_size)
    # per block q, k, v, out_proj 4 x 128x128 + fc_in 128x512 + fc_out 512x128; the score head 128x2
    assert flops.matmul_params == 2 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 2 == 393_472
    assert (flops.layers, flops.hidden) == (2, 128)
    assert flops.sequence(10) == 6 * 393_472 * 10 + 12 * 2 * 128 * 10 * 10 == 23_915_520
    assert flops.batch([10, 4]) == flops.sequence(10) + flops.sequence(4)
    assert achieved(1e12, 2.0, 4, 0.5) == (0.125, 0.25)  # 1 TFLOP in 2 s over 4 devices: 0.125 each, half a 0.25 peak


def test_peaks_and_probe():
    assert gpu_peak_tflops("NVIDIA A100-SXM4-40GB") == 312 and gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert gpu_peak_tflops("Some Future GPU") is None
    assert 0 < probe_matmul_tflops(torch.device("cpu"), torch.float32, size=256, seconds=0.05) < 100


def test_token_slots_and_padding_fraction_by_hand():
    lengths = [3, 5, 2, 7]
    assert data.token_slots([0, 1, 2, 3], lengths, dp=1, accumulation=1) == 4 * 7
    assert data.token_slots([0, 1, 2, 3], lengths, dp=2, accumulation=1) == 2 * 5 + 2 * 7  # replicas pad apart
    assert data.token_slots([0, 1, 2, 3], lengths, dp=2, accumulation=1, multiple=8) == 2 * 8 + 2 * 8
    assert padding_fraction([[17, 24]]) == pytest.approx(7 / 24)
    assert padding_fraction([[17, 24], [3, 16]]) == pytest.approx(1 - 20 / 40)
    assert padding_fraction([]) is None


def test_compile_auto_compiles_long_gpu_runs_only():
    assert compile_decision(Config(), 999, "cuda") == (False, "compile=auto: off (999 steps < 1000)")
    assert compile_decision(Config(), COMPILE_AUTO_MIN_STEPS, "cuda") == (
        True,
        "compile=auto: on (1000 steps >= 1000)",
    )
    assert compile_decision(Config(), 5000, "cpu") == (
        False,
        "compile=auto: off (CPU: compiled blocks are slower than eager here; compile=true forces it)",
    )
    assert compile_decision(Config(compile=False), 5000, "cuda")[0] is False
    assert compile_decision(Config(compile=True), 5, "cpu")[0] is True
    assert compile_decision(Config(engine="deepspeed"), 5000, "cuda")[0] is False
