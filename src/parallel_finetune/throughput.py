"""Model FLOPs, the device's peak and MFU: what each log line and summary.json report.

Model FLOPs of a training step (forward + backward, PaLM's convention, so activation checkpointing's recompute
is not counted as useful work): for a sequence of n real tokens through a model whose tokens pass N matrix
parameters (blocks and head; embedding lookups are not matmuls) in L blocks of width h,

    6 N n  +  12 L h n^2       (the second term: attention scores and their weighted sum)

summed over the real sequences of the global batch (padding is not useful work). Achieved FLOP/s per device =
step FLOPs / step time / world size; MFU = that / the device's peak.

Peak per device: `peak_tflops` when given; on CUDA the 16-bit (bf16/fp16) dense tensor-core peak of known GPUs
(NVIDIA's figures; fp32 runs use the same, since MFU is quoted against the tensor-core peak); on a CPU a short
matmul probe in the run's precision with the process's threads, measured once at setup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# dense bf16/fp16 tensor-core TFLOP/s of one GPU, by a substring of torch.cuda.get_device_name()
GPU_PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 70.0, "L40S": 362.0, "L4": 121.0, "V100": 125.0}


@dataclass(frozen=True)
class ModelFlops:
    matmul_params: int  # N: matrix parameters a token goes through (blocks and head)
    layers: int
    hidden: int

    def sequence(self, n: int) -> float:
        return 6.0 * self.matmul_params * n + 12.0 * self.layers * self.hidden * n * n

    def batch(self, lengths) -> float:
        return sum(self.sequence(n) for n in lengths)


def model_flops(block_costs: list[int], head_cost: int, hidden: int) -> ModelFlops:
    return ModelFlops(sum(block_costs) + head_cost, len(block_costs), hidden)


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


def device_peak_tflops(device: torch.device, dtype: torch.dtype, configured: float | None) -> tuple[float, str]:
    """(peak TFLOP/s of one device, where the figure comes from)."""
    if configured:
        return configured, "peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        if peak is not None:
            return peak, f"{name} 16-bit dense peak"
        return probe_matmul_tflops(device, dtype, size=4096), f"{name}: measured matmul probe (unknown GPU)"
    return probe_matmul_tflops(
        device, dtype
    ), f"CPU {str(dtype).removeprefix('torch.')} matmul probe, {torch.get_num_threads()} thread(s)"


def achieved(step_flops: float, seconds: float, world_size: int, peak_tflops: float) -> tuple[float, float]:
    """(TFLOP/s per device, MFU)."""
    per_device = step_flops / seconds / world_size / 1e12
    return per_device, per_device / peak_tflops
