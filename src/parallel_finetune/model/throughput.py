"""Model FLOPs, the device's peak and MFU: what each log line and summary.json report.

Model FLOPs of a training step (forward + backward, PaLM's convention, so activation checkpointing's recompute
is not counted as useful work): for a sequence of n real tokens through a model whose tokens pass N matrix
parameters (blocks and head; embedding lookups are not matmuls) in L blocks whose attention is d wide,

    6 N n  +  12 L d n^2       (the second term: attention scores and their weighted sum)

With LoRA/QLoRA the base is frozen: its weights get no gradient, so each of its matrix parameters costs 2 FLOPs
a token forward and 2 backward (the gradient of the activations only), 4 in all; the adapters (A and B of every
adapted Linear: r x (in + out) multiply-accumulates a token) and a head trained in full cost 6, as in full
training. As NeMo AutoModel counts LoRA:

    (6 T + 4 F + 6 A) n  +  12 L d n^2      T trained base matrices (a LoRA head), F frozen ones, A the adapters'

Attention has no weights: its backward is the same whether the base is trained or frozen.

d = heads x head dimension (`attention_width`): the hidden width, except where a head has a dimension of its own
(Qwen 3 4B: 32 x 128 = 4096 for width 2560); grouped-query attention shares k/v, not these FLOPs.

summed over the real sequences of the global batch (padding is not useful work). Achieved FLOP/s per device =
step FLOPs / step time / world size; MFU = that / the device's peak.

Peak per device: `peak_tflops` when given; on CUDA the 16-bit (bf16/fp16) dense tensor-core peak of known GPUs
(NVIDIA's figures; fp32 runs use the same, since MFU is quoted against the tensor-core peak), a matmul probe for
an unknown GPU; on a CPU the hardware's theoretical peak, cores x clock x FLOPs per cycle of its vector units
(`cpu_peak`), with a short matmul probe reported beside it as the achievable matmul rate. A probe is no peak: run
while the machine is busy it reads low, and MFU against it went past 100%. An MFU above 100% means a wrong peak:
it is reported as unknown, never printed nor clamped.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# dense bf16/fp16 tensor-core TFLOP/s of one GPU, by a substring of torch.cuda.get_device_name()
GPU_PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 70.0, "L40S": 362.0, "L4": 121.0, "V100": 125.0}


@dataclass(frozen=True)
class ModelFlops:
    matmul_params: int  # N: matrix parameters a token goes through (blocks and head)
    layers: int
    attention_width: int  # d: heads x head dimension
    frozen_params: int = 0  # F: those of N that are frozen (LoRA's base): 4 FLOPs a token, not 6
    adapter_params: int = 0  # A: LoRA's A and B matrices (not in N), trained: 6 FLOPs a token

    def per_token(self) -> float:
        """Matmul FLOPs a token costs forward and backward (6 T + 4 F + 6 A; 6 N in full training)."""
        trained = self.matmul_params - self.frozen_params + self.adapter_params
        return 6.0 * trained + 4.0 * self.frozen_params

    def sequence(self, n: int) -> float:
        return self.per_token() * n + 12.0 * self.layers * self.attention_width * n * n

    def with_adapters(self, frozen_params: int, adapter_params: int) -> ModelFlops:
        """The same model under LoRA: `frozen_params` of its matrix parameters frozen, `adapter_params` added."""
        if not 0 <= frozen_params <= self.matmul_params:
            raise ValueError(f"frozen_params={frozen_params} outside 0..{self.matmul_params}")
        return ModelFlops(self.matmul_params, self.layers, self.attention_width, frozen_params, adapter_params)

    def convention(self) -> str:
        """Which count this is, for a summary or a benchmark's table."""
        if self.frozen_params or self.adapter_params:
            return "4 x frozen base + 6 x adapters and trained head per token, + 12 L d n^2 attention"
        return "6 x parameters per token + 12 L d n^2 attention"

    def batch(self, lengths) -> float:
        return sum(self.sequence(n) for n in lengths)


def model_flops(block_costs: list[int], head_cost: int, attention_width: int) -> ModelFlops:
    return ModelFlops(sum(block_costs) + head_cost, len(block_costs), attention_width)


def attention_width(hf_config) -> int:
    """Heads x head dimension: what the attention scores and their weighted sum cost per token and key."""
    heads = hf_config.num_attention_heads
    return heads * (getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)


def gpu_peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in GPU_PEAKS.items() if key in name), None)


def probe_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    """The best TFLOP/s of repeated size x size matmuls: what this device (with this process's threads) can do."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up (and one-time kernel selection)
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        best = max(best, 2 * size**3 / elapsed / 1e12)
        if started + elapsed > deadline:
            return best


# FLOPs per cycle of one core's vector units by dtype, for the first unit its flags list (x86 names; aarch64's
# NEON is asimd). Each is the most a core with that unit does: two FMA pipes of the unit's full width (Zen 4 and
# one-FMA Xeons do half with AVX-512); BF16 dot products (two multiply-adds per 32-bit lane) on all four 512-bit
# pipes of a Zen 5 core (Intel's issue on two). The peak errs high, so MFU errs low, never above the truth. A
# 16-bit dtype without its own unit is computed in float32: its peak is float32's.
VECTOR_UNITS = {
    "float32": (
        (("avx512f",), 64, "AVX-512F: 2 FMA units x 16 lanes x 2"),
        (("avx2", "fma"), 32, "AVX2+FMA: 2 FMA units x 8 lanes x 2"),
        (("avx",), 16, "AVX: an 8-lane add and an 8-lane multiply"),
        (("sse2",), 8, "SSE2: a 4-lane add and a 4-lane multiply"),
        (("asimd",), 32, "NEON: 4 FMA units x 4 lanes x 2"),
    ),
    "bfloat16": (
        (("amx_bf16",), 1024, "AMX-BF16 tiles"),
        (("avx512_bf16",), 256, "AVX-512 BF16 dot products: 4 pipes x 16 lanes x 2 pairs x 2"),
    ),
    "float16": (
        (("amx_fp16",), 1024, "AMX-FP16 tiles"),
        (("avx512_fp16",), 128, "AVX512-FP16: 2 FMA units x 32 lanes x 2"),
    ),
}


def _field(text: str, name: str) -> str | None:
    """`name: value` of lscpu's or /proc/cpuinfo's text (its first line of that name)."""
    found = re.search(rf"^{name}\s*:\s*(.+)$", text, re.MULTILINE | re.IGNORECASE)
    return found[1].strip() if found else None


def cpu_peak(dtype: str, cores: int, lscpu: str, cpuinfo: str, max_freq_khz: str = "") -> tuple[float | None, str]:
    """(theoretical TFLOP/s of `cores` cores in `dtype`, how it was computed), or (None, why not): cores x the
    highest clock (lscpu's CPU max MHz, cpufreq's cpuinfo_max_freq in kHz, /proc/cpuinfo's cpu MHz, else BogoMIPS
    / 2) x FLOPs per cycle of the widest vector unit the CPU flags name (VECTOR_UNITS)."""
    clock = None
    for value, scale, where in (
        (_field(lscpu, "CPU max MHz"), 1, "lscpu CPU max MHz"),
        (max_freq_khz.strip(), 1e-3, "cpufreq cpuinfo_max_freq"),
        (_field(cpuinfo, "cpu MHz"), 1, "/proc/cpuinfo cpu MHz: the clock when read, boost may be higher"),
        (_field(cpuinfo, "bogomips") or _field(lscpu, "BogoMIPS"), 0.5, "BogoMIPS / 2"),
    ):
        try:
            if value and float(value) > 0:
                clock = float(value) * scale, where
                break
        except ValueError:
            continue
    flags = set((_field(lscpu, "Flags") or _field(cpuinfo, "flags") or _field(cpuinfo, "Features") or "").split())
    for name in (dtype, "float32"):
        unit = next((u for u in VECTOR_UNITS.get(name, ()) if flags.issuperset(u[0])), None)
        if unit:
            break
    if clock is None or unit is None:
        missing = "clock (lscpu, cpufreq, /proc/cpuinfo)" if clock is None else "known vector unit in the CPU flags"
        return None, f"peak unknown: no {missing}"
    emulated = "" if name == dtype else f", no {dtype} unit: computed as float32"
    peak = cores * clock[0] * 1e6 * unit[1] / 1e12
    return peak, (
        f"CPU {dtype} peak: {cores} core(s) x {clock[0]:.0f} MHz ({clock[1]}) x {unit[1]} FLOPs/cycle ({unit[2]}"
        f"{emulated}, the most such a core does)"
    )


def cpu_cores_used() -> int:
    """Physical cores this process computes on: those of the CPUs it may run on, at most one per thread torch
    uses (hyperthreads of one core share its vector units)."""
    cores = set()
    for cpu in os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            cores.add(cpu)
    return max(1, min(len(cores), torch.get_num_threads()))


def this_cpu_peak(dtype: str) -> tuple[float | None, str]:
    def read(command_or_path) -> str:
        try:
            if isinstance(command_or_path, list):
                env = {**os.environ, "LC_ALL": "C"}
                return subprocess.run(command_or_path, capture_output=True, text=True, timeout=10, env=env).stdout
            return Path(command_or_path).read_text()
        except (OSError, subprocess.SubprocessError):
            return ""

    return cpu_peak(
        dtype,
        cpu_cores_used(),
        read(["lscpu"]),
        read("/proc/cpuinfo"),
        read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"),
    )


@dataclass
class Peak:
    """One device's peak for MFU (None: unknown), where it comes from, and on a CPU the achievable matmul rate."""

    tflops: float | None
    source: str
    achievable_tflops: float | None = None
    achievable_source: str = ""
    exceeded: bool = False  # a rate above the peak was seen: the peak is wrong

    def mfu(self, tflops: float) -> float | None:
        """tflops / the peak, or None (unknown): without a peak, or above it (said once; the rate is the global
        one, the same on every rank, so rank 0's log says it)."""
        if self.tflops is None:
            return None
        if tflops > self.tflops:
            if not self.exceeded:
                log.info(
                    "MFU unknown: %.3g TFLOP/s per device is above the %.3g TFLOP/s peak (%s), so that peak is "
                    "wrong; set peak_tflops to the device's real peak",
                    tflops,
                    self.tflops,
                    self.source,
                )
            self.exceeded = True
            return None
        return tflops / self.tflops

    def unknown_reason(self, tflops: float) -> str | None:
        if self.tflops is None:
            return self.source
        if tflops > self.tflops:
            return f"{tflops:.3g} TFLOP/s per device is above the {self.tflops:.3g} TFLOP/s peak: peak wrong"
        return None

    def achievable(self) -> str:
        if self.achievable_tflops is None:
            return ""
        return f"achievable matmul rate {self.achievable_tflops:.3g} TFLOP/s ({self.achievable_source})"

    def describe(self) -> str:
        """The setup log line."""
        told = (
            f"MFU is measured against {self.tflops:.3g} TFLOP/s per device ({self.source})"
            if self.tflops is not None
            else f"MFU is unknown ({self.source})"
        )
        return told + (f"; {self.achievable()}" if self.achievable_tflops is not None else "")


def device_peak(device: torch.device, dtype: torch.dtype, configured: float | None) -> Peak:
    if configured:
        return Peak(configured, "peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        if peak is not None:
            return Peak(peak, f"{name} 16-bit dense peak")
        return Peak(probe_matmul_tflops(device, dtype, size=4096), f"{name}: measured matmul probe (unknown GPU)")
    name = str(dtype).removeprefix("torch.")
    peak, source = this_cpu_peak(name)
    probe = probe_matmul_tflops(device, dtype)
    if peak is not None and probe > peak:  # measured above the computed peak: the clock or the unit is understated
        peak, source = None, f"peak unknown: the matmul probe reached {probe:.3g} TFLOP/s, above the {source}"
    threads = f"0.5 s {name} matmul probe, {torch.get_num_threads()} thread(s)"
    return Peak(peak, source, probe, threads)


def achieved(step_flops: float, seconds: float, world_size: int, peak: Peak) -> tuple[float, float | None]:
    """(TFLOP/s per device, MFU or None: unknown)."""
    per_device = step_flops / seconds / world_size / 1e12
    return per_device, peak.mfu(per_device)
