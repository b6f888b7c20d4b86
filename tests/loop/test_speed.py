"""Speed features that must not change results: regional compilation, and the throughput arithmetic (model FLOPs,
MFU, padding share). No wall-clock assertions: timings go to `make bench`."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import RECIPE, assert_mfu_as_documented, assert_trains_like, check, launch, tiny_overrides

from parallel_finetune.config import COMPILE_AUTO_MIN_STEPS, COMPILE_WITH_TP, Config
from parallel_finetune.data import sampling
from parallel_finetune.errors import UserError
from parallel_finetune.families import get_family
from parallel_finetune.model import throughput
from parallel_finetune.model.throughput import (
    Peak,
    achieved,
    cpu_peak,
    gpu_peak_tflops,
    model_flops,
    probe_matmul_tflops,
)
from parallel_finetune.outputs.reporting import format_step, format_throughput
from parallel_finetune.outputs.summary import padding_fraction
from parallel_finetune.parallel.pipeline import stage_costs
from parallel_finetune.resolve import compile_decision


@pytest.mark.parametrize(
    "nproc,layout",
    [
        # batch_size=8: the rows each FSDP rank takes, so that the FSDP row finds many of this row's kernels in
        # Inductor's cache (cold, both rows: 236 -> 206 busy CPU-s)
        (1, ["tensor_parallel_degree=1", "activation_checkpointing=true", "batch_size=8"]),
        (2, ["tensor_parallel_degree=1", "sharding=full", "activation_checkpointing=true"]),
    ],
    ids=["single_process_checkpointing", "fsdp2_checkpointing"],
)
def test_compile_trains_like_eager(nproc, layout, sst2, cache_dir, tmp_path):
    """With activation checkpointing, which compile traces into the block's graph (until 2026-11-27 dynamo skipped
    the checkpointed blocks and they ran eager, while the log said compiled): dynamo's own count of the graphs it
    compiled, not only our log line, and the same training as eager."""
    # each batch as long as its longest row: padded in steps of 8, an FSDP rank's first batch is 8 x 8, and dynamo's
    # duck sizing ties the two sizes together, so the next length compiles every block again (3 graphs, +80 s)
    overrides = tiny_overrides(sst2, cache_dir, max_steps=5, pad_to_multiple_of=1) + layout
    eager = launch(nproc, overrides, tmp_path / "eager")
    compiled = launch(nproc, overrides + ["compile=true"], tmp_path / "compiled")
    assert "compiled on first use" in compiled.output
    graphs = re.search(r"compile: torch.compile compiled (\d+) graph", compiled.output)
    assert graphs and int(graphs.group(1)) >= 2, compiled.output[-3000:]  # with and without gradients, at least
    assert_trains_like(compiled, eager, "classification")
    summary = compiled.summary
    assert 0 < summary["padding_fraction"] < 0.5 and set(summary["padding_fraction_per_epoch"]) == {"0"}
    assert summary["peak_tflops_per_device"] > 0
    assert_mfu_as_documented(compiled.records, summary, compiled.output)


def test_a_withheld_mfu_is_null_everywhere_and_said_why(sst2, cache_dir, tmp_path):
    """What an AVX2-only CPU with an understated clock gives (the probe beats the computed peak): here forced by a
    configured peak below any real rate. Every record and the summary say null, `mfu_unknown` says why, and the
    assertions the end-to-end test makes hold for it."""
    run = launch(1, tiny_overrides(sst2, cache_dir, max_steps=2, peak_tflops=1e-9), tmp_path / "run")
    assert [r["mfu"] for r in run.records] == [None, None] and run.summary["mfu"] is None
    assert "peak wrong" in run.summary["mfu_unknown"]
    assert_mfu_as_documented(run.records, run.summary, run.output)


def test_lora_model_flops_count_the_frozen_base_at_four():
    """LoRA's MFU as NeMo AutoModel counts it: the frozen base 4 FLOPs a parameter and token (forward, and the
    activations' gradient: no weight gradient), the adapters and the head trained in full 6; attention unchanged."""
    from parallel_finetune.model import lora
    from parallel_finetune.model.load import lora_flops

    family = get_family("gptj")
    config = family.hf_config(None, "tiny", 8192, 128, {})
    torch.manual_seed(0)
    model = family.model_classes["classification"](config)
    full = model_flops(*stage_costs(model, family), config.hidden_size)
    settings = lora.LoraSettings(16, 32.0, 0.0, ("q_proj", "v_proj"), ("score",))
    adapters = lora.planned_shapes(model, family, settings)
    flops = lora_flops(full, model, family, settings, adapters)
    # q_proj and v_proj of 2 blocks: A 16x128 and B 128x16 each; the 128x2 score head trained in full
    assert sum(torch.Size(s).numel() for s in adapters.values()) == 2 * 2 * 2 * 16 * 128 == 16_384
    assert (flops.frozen_params, flops.adapter_params) == (393_472 - 256, 16_384)
    blocks = 2 * (4 * 128 * 128 + 2 * 128 * 512)
    assert flops.sequence(10) == (4 * blocks + 6 * 256 + 6 * 16_384) * 10 + 12 * 2 * 128 * 10 * 10
    assert flops.sequence(10) < full.sequence(10)  # was 6 x every base parameter before
    assert "4 x frozen" in flops.convention() and "6 x parameters" in full.convention()
    with pytest.raises(ValueError):
        full.with_adapters(full.matmul_params + 1, 0)


def test_model_flops_by_hand():
    family = get_family("gptj")
    config = family.hf_config(None, "tiny", 8192, 128, {})
    torch.manual_seed(0)
    model = family.model_classes["classification"](config)
    flops = model_flops(*stage_costs(model, family), config.hidden_size)
    # per block q, k, v, out_proj 4 x 128x128 + fc_in 128x512 + fc_out 512x128; the score head 128x2
    assert flops.matmul_params == 2 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 2 == 393_472
    assert (flops.layers, flops.attention_width) == (2, 128)
    assert flops.sequence(10) == 6 * 393_472 * 10 + 12 * 2 * 128 * 10 * 10 == 23_915_520
    assert flops.batch([10, 4]) == flops.sequence(10) + flops.sequence(4)
    assert achieved(1e12, 2.0, 4, Peak(0.5, "test")) == (
        0.125,
        0.25,
    )  # 1 TFLOP in 2 s over 4 devices: 0.125 each, half a 0.25 peak


def test_peaks_and_probe():
    assert gpu_peak_tflops("NVIDIA A100-SXM4-40GB") == 312 and gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert gpu_peak_tflops("Some Future GPU") is None
    assert 0 < probe_matmul_tflops(torch.device("cpu"), torch.float32, size=256, seconds=0.05) < 100


def test_token_slots_and_padding_fraction_by_hand():
    lengths = [3, 5, 2, 7]
    assert sampling.token_slots([0, 1, 2, 3], lengths, dp=1, accumulation=1) == 4 * 7
    assert sampling.token_slots([0, 1, 2, 3], lengths, dp=2, accumulation=1) == 2 * 5 + 2 * 7  # replicas pad apart
    assert sampling.token_slots([0, 1, 2, 3], lengths, dp=2, accumulation=1, multiple=8) == 2 * 8 + 2 * 8
    assert padding_fraction([[17, 24]]) == pytest.approx(7 / 24)
    assert padding_fraction([[17, 24], [3, 16]]) == pytest.approx(1 - 20 / 40)
    assert padding_fraction([]) is None


def test_compile_auto_compiles_long_gpu_runs_only():
    assert compile_decision(Config(), 999, "cuda", 1) == (False, "compile=auto: off (999 steps < 1000)")
    assert compile_decision(Config(), COMPILE_AUTO_MIN_STEPS, "cuda", 1) == (
        True,
        "compile=auto: on (1000 steps >= 1000)",
    )
    assert compile_decision(Config(), 5000, "cpu", 1) == (
        False,
        "compile=auto: off (CPU: compiled blocks are slower than eager here; compile=true forces it)",
    )
    assert compile_decision(Config.from_flat(dict(compile=False)), 5000, "cuda", 1)[0] is False
    assert compile_decision(Config.from_flat(dict(compile=True)), 5, "cpu", 1)[0] is True
    assert compile_decision(Config.from_flat(dict(engine="deepspeed")), 5000, "cuda", 1)[0] is False
    # tensor parallelism: torch.compile fails on its sharded blocks (config.COMPILE_WITH_TP)
    assert compile_decision(Config(), 5000, "cuda", 2) == (
        False,
        f"compile=auto: off (tensor_parallel_degree=2: torch.compile {COMPILE_WITH_TP})",
    )
    with pytest.raises(UserError) as refused:
        compile_decision(Config.from_flat(dict(compile=True)), 5000, "cuda", 4)
    assert str(refused.value) == f"compile=true with tensor_parallel_degree=4 {COMPILE_WITH_TP}"


def test_compile_with_tensor_parallelism_is_refused_before_the_launch(sst2, tmp_path):
    """A given degree, and the one tensor_parallel_degree=auto decides for the processes (every rank checks it
    again: compile_decision, above)."""
    checked = check("compile=true", "tensor_parallel_degree=2")
    assert checked.returncode == 2 and checked.stderr.strip().splitlines() == [
        f"error: recipe {RECIPE}: compile=True with tensor_parallel_degree=2 {COMPILE_WITH_TP}"
    ], checked.stderr
    tiny = ("size=tiny", f"data_dir={sst2}", f"output_dir={tmp_path / 'run'}", "compile=true")
    checked = check(*tiny, "tensor_parallel_degree=auto")
    assert checked.returncode == 2 and checked.stderr.strip().splitlines() == [
        f"error: compile=true with tensor_parallel_degree=2 {COMPILE_WITH_TP}"
    ], checked.stderr
    checked = check(*tiny, "tensor_parallel_degree=1")
    assert checked.returncode == 0, checked.stderr


# ----------------------------------------------------------------- issue 26: true figures (CPU peak, MFU <= 100%)
LSCPU = (
    "Model name:  AMD EPYC\nCPU max MHz:  3500.0000\nBogoMIPS:  5192.19\n"
    "Flags:  fpu sse2 avx avx2 fma avx512f avx512_bf16\n"
)
CPUINFO = "processor\t: 0\ncpu MHz\t\t: 2596.098\nflags\t\t: fpu sse2 avx avx2 fma\nbogomips\t: 5192.19\n"


def test_cpu_peak_is_cores_x_clock_x_flops_per_cycle_of_the_vector_units():
    peak, how = cpu_peak("float32", 4, LSCPU, CPUINFO)
    assert peak == pytest.approx(4 * 3500e6 * 64 / 1e12)
    assert how == (
        "CPU float32 peak: 4 core(s) x 3500 MHz (lscpu CPU max MHz) x 64 FLOPs/cycle (AVX-512F: 2 FMA units x 16 "
        "lanes x 2, the most such a core does)"
    )
    assert cpu_peak("bfloat16", 4, LSCPU, CPUINFO)[0] == pytest.approx(4 * 3500e6 * 256 / 1e12)
    fp16, how = cpu_peak("float16", 4, LSCPU, CPUINFO)  # no fp16 unit: computed in float32
    assert fp16 == pytest.approx(peak) and "no float16 unit: computed as float32" in how
    # clock sources in order: cpufreq's kHz, /proc/cpuinfo's cpu MHz, BogoMIPS / 2; flags from /proc/cpuinfo
    assert cpu_peak("float32", 2, "", CPUINFO, "3000000\n") == (
        pytest.approx(2 * 3000e6 * 32 / 1e12),
        "CPU float32 peak: 2 core(s) x 3000 MHz (cpufreq cpuinfo_max_freq) x 32 FLOPs/cycle (AVX2+FMA: 2 FMA units "
        "x 8 lanes x 2, the most such a core does)",
    )
    assert cpu_peak("float32", 1, "", CPUINFO)[0] == pytest.approx(2596.098e6 * 32 / 1e12)
    assert "bfloat16 unit" in cpu_peak("bfloat16", 1, "", CPUINFO)[1]
    bogomips_only = CPUINFO.replace("cpu MHz", "cpu kHz")
    assert cpu_peak("float32", 1, "", bogomips_only)[1].startswith(
        "CPU float32 peak: 1 core(s) x 2596 MHz (BogoMIPS / 2)"
    )
    assert cpu_peak("float32", 1, "", "flags : fpu\ncpu MHz : 2000\n") == (
        None,
        "peak unknown: no known vector unit in the CPU flags",
    )
    assert cpu_peak("float32", 1, "", "flags : avx2 fma\n") == (
        None,
        "peak unknown: no clock (lscpu, cpufreq, /proc/cpuinfo)",
    )


def test_mfu_is_never_above_100_percent_when_the_probe_reads_low(monkeypatch, caplog):
    """A matmul probe run while the machine was busy read half the real rate; as the peak, it made MFU 190%. The
    peak is the hardware's; the probe is reported beside it; a rate above a (wrong) peak makes MFU unknown."""
    monkeypatch.setattr(throughput, "this_cpu_peak", lambda dtype: (0.332, "CPU float32 peak: from the flags"))
    monkeypatch.setattr(throughput, "probe_matmul_tflops", lambda device, dtype: 0.05)  # a busy machine
    peak = throughput.device_peak(torch.device("cpu"), torch.float32, None)
    assert (peak.tflops, peak.achievable_tflops) == (0.332, 0.05)
    assert peak.describe().startswith("MFU is measured against 0.332 TFLOP/s per device (CPU float32 peak")
    assert "; achievable matmul rate 0.05 TFLOP/s (0.5 s float32 matmul probe" in peak.describe()
    assert achieved(0.095e12, 1.0, 1, peak) == (0.095, pytest.approx(0.095 / 0.332))  # was 190% of the probe
    record = {
        "step": 1, "epoch": 0.1, "loss": 0.7, "lr": 1e-4, "grad_norm": 1.0, "loss_scale": 1.0, "samples_per_s": 9.0,
        "tokens_per_s": 99.0, "skipped": False,
    }  # fmt: skip
    with caplog.at_level("INFO", logger="parallel_finetune.model.throughput"):
        tflops, mfu = achieved(0.5e12, 1.0, 1, peak)  # above the peak: the peak is wrong
        assert mfu is None and peak.mfu(0.6) is None
    assert caplog.text.count("MFU unknown: 0.5 TFLOP/s per device is above the 0.332 TFLOP/s peak") == 1
    assert format_step({**record, "tflops_per_device": tflops, "mfu": mfu}, 10).endswith("TFLOP/s | MFU unknown")
    summary = {
        "train_samples_per_s": 9.0, "train_tokens_per_s": 99.0, "train_tflops_per_device": tflops, "mfu": mfu,
        "mfu_unknown": peak.unknown_reason(tflops), "peak_tflops_per_device": 0.332, "achievable_matmul_tflops": 0.05,
    }  # fmt: skip
    assert format_throughput(summary) == (
        "throughput: 9.0 samples/s, 99 tokens/s, 0.5 TFLOP/s per device, MFU unknown (0.5 TFLOP/s per device is "
        "above the 0.332 TFLOP/s peak: peak wrong) | achievable matmul rate 0.05 TFLOP/s"
    )
    assert "MFU 28.6% of 0.332 TFLOP/s" in format_throughput(
        {**summary, "train_tflops_per_device": 0.095, "mfu": 0.286}
    )
    # a probe faster than the computed peak proves that peak wrong (an understated clock): unknown, said why
    monkeypatch.setattr(throughput, "probe_matmul_tflops", lambda device, dtype: 0.5)
    peak = throughput.device_peak(torch.device("cpu"), torch.float32, None)
    assert peak.tflops is None and peak.mfu(0.1) is None
    assert peak.describe().startswith("MFU is unknown (peak unknown: the matmul probe reached 0.5 TFLOP/s, above")
